//! File operations as a user of the sandbox.
//!
//! The process that serves a sandbox's files (a container's init, a VM guest's agent) is
//! root. For an operation as a user it takes that user's filesystem uid and gid and its
//! supplementary groups for the length of the operation, then takes its own back: the
//! kernel checks every path resolved and every file opened, made, renamed or removed as
//! it would for a command of that user, and what is made belongs to the user (its uid,
//! its primary gid). Leaving fsuid 0 clears the filesystem capabilities
//! (`CAP_DAC_OVERRIDE`, `CAP_FOWNER`, `CAP_CHOWN`...) from the effective set and going
//! back restores them (capabilities(7), "Effect of user ID changes on capabilities"), so
//! no root privilege leaks into the operation. Raw system calls, which change only the
//! calling thread: the poll loop that serves files is one thread, and the C library's
//! `setgroups` would change every thread of the process.

use std::io;

use crate::proto::AsUser;

/// The serving thread's own ids, given back on drop.
pub(crate) struct Assumed {
    fsuid: libc::uid_t,
    fsgid: libc::gid_t,
    groups: Vec<libc::gid_t>,
}

/// Takes `user`'s ids for the calling thread until the returned guard drops; `None`
/// (root, as the server is) changes nothing.
pub(crate) fn assume(user: Option<&AsUser>) -> io::Result<Option<Assumed>> {
    let Some(user) = user else {
        return Ok(None);
    };
    let own = Assumed {
        fsuid: current_fsuid(),
        fsgid: current_fsgid(),
        groups: groups()?,
    };
    set_groups(&user.groups)?;
    // SAFETY: setfsgid(2) and setfsuid(2) take an integer and return one.
    let (gid, uid) = unsafe {
        libc::setfsgid(user.gid);
        libc::setfsuid(user.uid);
        (current_fsgid(), current_fsuid())
    };
    if (uid, gid) != (user.uid, user.gid) {
        drop(own); // gives back what was taken
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the server cannot take uid {} and gid {} for the operation",
                user.uid, user.gid
            ),
        ));
    }
    Ok(Some(own))
}

impl Drop for Assumed {
    fn drop(&mut self) {
        // SAFETY: as in `assume`.
        unsafe {
            libc::setfsuid(self.fsuid);
            libc::setfsgid(self.fsgid);
        }
        if let Err(e) = set_groups(&self.groups) {
            tracing::error!(error = %e, "cannot give the file server its own groups back");
        }
    }
}

/// The thread's fsuid: setfsuid(2) with an invalid id changes nothing and returns it.
fn current_fsuid() -> libc::uid_t {
    // SAFETY: setfsuid(2) takes an integer; -1 is never a valid id, so nothing changes.
    unsafe { libc::setfsuid(libc::uid_t::MAX) }.cast_unsigned()
}

/// The thread's fsgid, likewise.
fn current_fsgid() -> libc::gid_t {
    // SAFETY: as in `current_fsuid`.
    unsafe { libc::setfsgid(libc::gid_t::MAX) }.cast_unsigned()
}

/// The thread's supplementary groups.
fn groups() -> io::Result<Vec<libc::gid_t>> {
    // SAFETY: with a size of 0, getgroups(2) writes nothing and returns the count.
    let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
    let mut groups = vec![0; usize::try_from(n).map_err(|_| io::Error::last_os_error())?];
    // SAFETY: `groups` has room for `n` ids, the size passed.
    let got = unsafe { libc::getgroups(n, groups.as_mut_ptr()) };
    groups.truncate(usize::try_from(got).map_err(|_| io::Error::last_os_error())?);
    Ok(groups)
}

/// Sets the calling thread's supplementary groups (the raw system call: this thread only).
fn set_groups(groups: &[libc::gid_t]) -> io::Result<()> {
    // SAFETY: setgroups(2) reads `groups.len()` ids from a buffer that outlives the call.
    let r = unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    fn is_root() -> bool {
        // SAFETY: geteuid(2) takes nothing.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn a_user_owns_what_it_makes_and_is_refused_what_it_may_not_touch() {
        if !is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        // A thread of its own: the ids are per thread and the test harness runs others.
        std::thread::spawn(|| {
            let dir = tempfile::tempdir().unwrap();
            std::fs::set_permissions(
                dir.path(),
                std::os::unix::fs::PermissionsExt::from_mode(0o777),
            )
            .unwrap();
            let closed = dir.path().join("closed");
            std::fs::create_dir(&closed).unwrap();
            std::fs::set_permissions(&closed, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .unwrap();
            let before = (current_fsuid(), current_fsgid(), groups().unwrap());
            let alice = AsUser {
                uid: 4321,
                gid: 4322,
                groups: vec![4322, 50],
            };
            {
                let _as = assume(Some(&alice)).unwrap();
                assert_eq!(groups().unwrap(), vec![50, 4322]); // the kernel sorts them
                std::fs::write(dir.path().join("mine"), b"x").unwrap();
                let denied = std::fs::write(closed.join("theirs"), b"x").unwrap_err();
                assert_eq!(denied.raw_os_error(), Some(libc::EACCES));
            }
            assert_eq!(
                (current_fsuid(), current_fsgid(), groups().unwrap()),
                before
            );
            let meta = std::fs::metadata(dir.path().join("mine")).unwrap();
            assert_eq!((meta.uid(), meta.gid()), (4321, 4322));
            // Root again: the closed directory takes the file.
            std::fs::write(closed.join("root's"), b"x").unwrap();
            assert!(assume(None).unwrap().is_none());
        })
        .join()
        .unwrap();
    }
}
