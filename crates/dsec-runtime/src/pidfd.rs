//! Host processes held by pidfd, so that what the edge reads or signals by pid is never a
//! process that took the pid after the one it meant exited.

use std::os::fd::{AsRawFd, OwnedFd};

/// Whether the process `pidfd` names is still there (not reaped): while it is, its pid
/// names it and nothing else, so what was read through `/proc/<pid>` before was its.
pub fn alive(pidfd: &OwnedFd) -> bool {
    // SAFETY: signal 0 through a pidfd we own only probes that the process exists.
    let probe = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    probe == 0
}

/// A pidfd of the process `pid` if `belongs` holds for it: `belongs` reads `/proc/<pid>`,
/// and the pidfd, opened first and found alive after, makes sure that was this process.
pub fn open_if(pid: i32, belongs: impl FnOnce(i32) -> bool) -> Option<OwnedFd> {
    let fd = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(pid)?,
        rustix::process::PidfdFlags::empty(),
    )
    .ok()?;
    (belongs(pid) && alive(&fd)).then_some(fd)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_process_is_held_while_it_lives() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        assert!(super::open_if(pid, |_| false).is_none());
        let fd = super::open_if(pid, |p| p == pid).unwrap();
        assert!(super::alive(&fd));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!super::alive(&fd));
    }
}
