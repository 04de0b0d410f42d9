//! What a process started by dsec may inherit: nothing but its standard descriptors.
//!
//! Whatever the launcher of the server left open without close-on-exec — a directory, a
//! socket, a log file — would otherwise be open in the zygote, in every init, and so in
//! every command: a directory descriptor alone reaches the host's filesystem through
//! `/proc/self/fd/N/` (the runc CVE-2024-21626 class). So the server and the zygote mark
//! every descriptor above 2 close-on-exec as they start, and each command's first process
//! does it again right before its `execve`, whatever init or the agent holds.

use std::os::fd::RawFd;

/// Marks every descriptor above 2 close-on-exec (`close_range(3, ~0,
/// CLOSE_RANGE_CLOEXEC)`). Close-on-exec rather than close: a command's report pipe must
/// stay usable until the `execve`. One system call, so safe between `clone` and `execve`.
pub fn close_on_exec_above_stdio() -> std::io::Result<()> {
    // SAFETY: close_range(2) with integer arguments only changes descriptor flags.
    let r = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Closes every descriptor of this process but `keep`: for a process forked to live on
/// without anything of its parent's (a copy of a command's pipe would keep the pipe's
/// reader from its end-of-file).
///
/// # Safety
/// Every descriptor but `keep` is closed under whatever owns it: the caller never uses
/// or drops those owners again (it runs until it exits without unwinding).
pub unsafe fn close_all_but(keep: &[RawFd]) -> std::io::Result<()> {
    let mut keep: Vec<libc::c_uint> = keep.iter().filter_map(|&fd| fd.try_into().ok()).collect();
    keep.sort_unstable();
    let mut first: libc::c_uint = 0;
    for fd in keep.into_iter().chain([libc::c_uint::MAX]) {
        if fd > first {
            // SAFETY: close_range(2) with integer arguments; the caller gave up what
            // owned these descriptors.
            let r = unsafe { libc::syscall(libc::SYS_close_range, first, fd - 1, 0) };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        first = fd.saturating_add(1);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use rustix::io::{fcntl_getfd, fcntl_setfd, FdFlags};

    #[test]
    fn inherited_descriptors_become_close_on_exec() {
        let dir = std::fs::File::open("/").unwrap();
        fcntl_setfd(&dir, FdFlags::empty()).unwrap();
        super::close_on_exec_above_stdio().unwrap();
        assert!(fcntl_getfd(&dir).unwrap().contains(FdFlags::CLOEXEC));
    }
}
