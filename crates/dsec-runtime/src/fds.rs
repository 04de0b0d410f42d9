//! What a process started by dsec may inherit: nothing but its standard descriptors.
//!
//! Whatever the launcher of the server left open without close-on-exec — a directory, a
//! socket, a log file — would otherwise be open in the zygote, in every init, and so in
//! every command: a directory descriptor alone reaches the host's filesystem through
//! `/proc/self/fd/N/` (the runc CVE-2024-21626 class). So the server and the zygote mark
//! every descriptor above 2 close-on-exec as they start, and each command's first process
//! does it again right before its `execve`, whatever init or the agent holds.

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

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    #[test]
    fn inherited_descriptors_become_close_on_exec() {
        let dir = std::fs::File::open("/").unwrap();
        // SAFETY: fcntl on a descriptor this test owns, integer arguments only.
        unsafe { libc::fcntl(dir.as_raw_fd(), libc::F_SETFD, 0) };
        super::close_on_exec_above_stdio().unwrap();
        // SAFETY: as above.
        let flags = unsafe { libc::fcntl(dir.as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
    }
}
