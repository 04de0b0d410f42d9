//! Keeping what the store holds inert on the host.
//!
//! Layers are faithful copies of what images and sandboxes contain: setuid and setgid
//! bits, `security.capability` xattrs and device nodes included. Inside a sandbox they
//! are what the image means (an `apt install` then `fork()` must give a working copy;
//! `sudo` in an image must stay setuid). On the host they must mean nothing, or any
//! host user who reaches a setuid-root file an agent planted runs it as root. Stripping
//! the bits would break the copies, so dsec keeps them and makes them powerless where
//! the host sees them:
//! - the state directory is `0700` and owned by the server (checked at start);
//! - the store lies on a `nosuid,nodev` mount, so even a store whose permissions were
//!   loosened (an operator's `chmod -R`, a restored backup) runs nothing with raised
//!   privileges and opens no device: the kernel ignores setuid bits and file
//!   capabilities on such a mount, and refuses to open device nodes from it.
//!
//! Inside a sandbox, the overlay over these layers is a mount of the sandbox's own
//! namespace: its flags, not the store's, apply there.
//!
//! A store the server owns (inside its state directory) is bind-mounted over itself
//! with those flags when it is not on such a mount already ([`Seal`], whose recorded
//! mounts also put the container runtime's per-sandbox state on a tmpfs).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, StatVfsMountFlags, StatxAttributes, StatxFlags, CWD};
use rustix::io::Errno;
use rustix::mount::{MountFlags, UnmountFlags};

/// Is `dir` on a mount that honours neither setuid bits nor device nodes?
pub fn is_inert(dir: &Path) -> io::Result<bool> {
    let flags = rustix::fs::statvfs(dir)?.f_flag;
    Ok(flags.contains(StatVfsMountFlags::NOSUID | StatVfsMountFlags::NODEV))
}

/// A mount the server made over a directory of its state directory, removed when
/// dropped: the image store's `nosuid,nodev` bind over itself ([`Seal::apply`]), the
/// runtime's tmpfs ([`Seal::tmpfs`]). The mount is recorded in a file before it is made,
/// so that a server restarted after a crash adopts the mount its predecessor left instead
/// of stacking another, and removes it at its own stop.
#[derive(Debug)]
pub struct Seal {
    /// The directory and the record of the mount, when this process owns the mount.
    mounted: Option<(PathBuf, PathBuf)>,
}

impl Seal {
    /// Makes sure `dir` is on a `nosuid,nodev` mount, bind-mounting it over itself if it
    /// is not; `record` (outside `dir`) notes that the mount is dsec's. A mount that an
    /// earlier run recorded is adopted; a mount made by someone else is used and left
    /// alone.
    pub fn apply(dir: &Path, record: &Path) -> io::Result<Seal> {
        Seal::make(dir, record, "nosuid,nodev bind", is_inert, |dir| {
            rustix::mount::mount_bind(dir, dir).and_then(|()| {
                rustix::mount::mount_remount(
                    dir,
                    MountFlags::BIND | MountFlags::NOSUID | MountFlags::NODEV,
                    "",
                )
                .inspect_err(|_| {
                    let _ = rustix::mount::unmount(dir, UnmountFlags::DETACH);
                })
            })
        })
    }

    /// Makes sure `dir` is on a tmpfs (`nosuid,nodev,noexec`, `0700`), mounting one if it
    /// is not, recorded in `record` as [`apply`](Self::apply) does. For state that means
    /// nothing after a reboot (mount points, records of live processes): writing it costs
    /// no journal, which on a VM's disk takes a millisecond or more per file.
    pub fn tmpfs(dir: &Path, record: &Path) -> io::Result<Seal> {
        Seal::make(dir, record, "tmpfs", is_tmpfs, |dir| {
            // What a run without the tmpfs left there stays visible to its clean-up.
            let mut entries =
                fs::read_dir(dir).map_err(|e| Errno::from_io_error(&e).unwrap_or(Errno::IO))?;
            if entries.next().is_some() {
                return Err(Errno::NOTEMPTY);
            }
            rustix::mount::mount(
                "tmpfs",
                dir,
                "tmpfs",
                MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
                c"mode=0700",
            )
        })
    }

    /// Adopts the recorded mount on `dir`, or uses `dir` as it is when `present` says it
    /// is on such a mount already, or mounts it (recorded first).
    fn make(
        dir: &Path,
        record: &Path,
        what: &str,
        present: fn(&Path) -> io::Result<bool>,
        mount: impl FnOnce(&Path) -> rustix::io::Result<()>,
    ) -> io::Result<Seal> {
        if record.exists() {
            if is_mount_root(dir)? && present(dir)? {
                tracing::info!(dir = %dir.display(), mount = what, "adopting the mount of an earlier run");
                return Ok(Seal::owned(dir, record));
            }
            fs::remove_file(record)?;
        }
        if present(dir)? {
            return Ok(Seal { mounted: None });
        }
        fs::write(record, dir.as_os_str().as_encoded_bytes())?;
        if let Err(e) = mount(dir) {
            let _ = fs::remove_file(record);
            return Err(e.into());
        }
        tracing::info!(dir = %dir.display(), mount = what, "mounted over the directory");
        Ok(Seal::owned(dir, record))
    }

    fn owned(dir: &Path, record: &Path) -> Seal {
        Seal {
            mounted: Some((dir.to_owned(), record.to_owned())),
        }
    }
}

/// Is `dir` on a tmpfs?
fn is_tmpfs(dir: &Path) -> io::Result<bool> {
    Ok(rustix::fs::statfs(dir)?.f_type == libc::TMPFS_MAGIC)
}

impl Drop for Seal {
    fn drop(&mut self) {
        let Some((dir, record)) = self.mounted.take() else {
            return;
        };
        match rustix::mount::unmount(&dir, UnmountFlags::DETACH) {
            Ok(()) => {
                let _ = fs::remove_file(&record);
                tracing::debug!(dir = %dir.display(), "removed the mount over the directory");
            }
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot remove the mount over the directory; the next start adopts it")
            }
        }
    }
}

/// Is `dir` the root of a mount (as a bind mount over itself is)?
fn is_mount_root(dir: &Path) -> io::Result<bool> {
    let stat = rustix::fs::statx(CWD, dir, AtFlags::empty(), StatxFlags::BASIC_STATS)?;
    if !stat
        .stx_attributes_mask
        .contains(StatxAttributes::MOUNT_ROOT)
    {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the kernel does not report mount roots (statx, Linux 5.8)",
        ));
    }
    Ok(stat.stx_attributes.contains(StatxAttributes::MOUNT_ROOT))
}
