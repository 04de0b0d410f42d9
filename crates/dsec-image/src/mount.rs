//! Layer blobs mounted once per edge, for every sandbox to stack.
//!
//! Each layer in use is one read-only EROFS mount under `<local>/mnt/<n>` (`nosuid`,
//! `nodev`, on a private mount of that directory so that nothing propagates to other
//! namespaces): one superblock per layer and edge, so the page cache of a layer is shared
//! by every sandbox on the edge, and a sandbox's overlay names it by a short relative
//! name (`<n>`), which keeps the overlay's option string within its page for the 500
//! layers overlayfs can stack. New sandboxes copy these mounts with the host's mount
//! table and drop them with their old root; the edge's own copies stay until the layer
//! leaves the store or the edge stops.
//!
//! A blob is mounted straight from its file (Linux 6.12), with `directio` where the kernel
//! offers it so its pages are cached once (in EROFS) rather than twice; an older kernel
//! gets a loop device instead, which detaches itself when the mount goes away.
//!
//! Everything lives under one directory of the edge's own: at start and at stop the whole
//! tree is detached (a crashed edge's mounts included), never anything else.

use std::collections::HashMap;
use std::ffi::CStr;
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use rustix::io::Errno;
use rustix::mount::{MountFlags, MountPropagationFlags, UnmountFlags};

/// Flags of every layer mount: nothing in a layer gains privileges or opens a device
/// on the host.
const LAYER_FLAGS: MountFlags = MountFlags::RDONLY
    .union(MountFlags::NOSUID)
    .union(MountFlags::NODEV);

/// The mounted layers of one edge.
#[derive(Debug)]
pub(crate) struct LayerMounts {
    dir: PathBuf,
    state: Mutex<Mounted>,
    /// Cleared once the kernel refused `directio` (it predates the option).
    directio: AtomicBool,
}

#[derive(Debug, Default)]
struct Mounted {
    by_layer: HashMap<String, PathBuf>,
    next: u64,
}

impl LayerMounts {
    /// Takes over `dir`: detaches whatever an earlier run left mounted there and makes it
    /// a private mount of its own.
    pub(crate) fn open(dir: &Path) -> io::Result<LayerMounts> {
        detach_all(dir);
        fs::create_dir_all(dir)?;
        rustix::mount::mount_bind(dir, dir)?;
        rustix::mount::mount_change(dir, MountPropagationFlags::PRIVATE)?;
        Ok(LayerMounts {
            dir: dir.to_owned(),
            state: Mutex::default(),
            directio: AtomicBool::new(true),
        })
    }

    /// The directory where `layer` (stored in `blob`) is mounted, mounting it first if
    /// no sandbox of this edge used it yet.
    pub(crate) fn mount(&self, layer: &str, blob: &Path) -> io::Result<PathBuf> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(path) = state.by_layer.get(layer) {
            return Ok(path.clone());
        }
        // Short names in base 36 keep 500 of them well inside one page of options.
        let target = self.dir.join(base36(state.next));
        state.next += 1;
        fs::create_dir(&target)?;
        if let Err(e) = self.mount_blob(blob, &target) {
            let _ = fs::remove_dir(&target);
            return Err(e);
        }
        tracing::debug!(layer, path = %target.display(), "mounted layer");
        state.by_layer.insert(layer.to_owned(), target.clone());
        Ok(target)
    }

    /// Layers mounted now.
    pub(crate) fn layers(&self) -> Vec<String> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.by_layer.keys().cloned().collect()
    }

    /// Unmounts `layer`; sandboxes already built on it keep their own copies.
    pub(crate) fn unmount(&self, layer: &str) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(path) = state.by_layer.remove(layer) {
            let _ = rustix::mount::unmount(&path, UnmountFlags::DETACH);
            let _ = fs::remove_dir(&path);
        }
    }

    fn mount_blob(&self, blob: &Path, target: &Path) -> io::Result<()> {
        let mount = |source: &Path, data: Option<&CStr>| {
            rustix::mount::mount(source, target, "erofs", LAYER_FLAGS, data)
        };
        let direct = self.directio.load(Ordering::Relaxed);
        let result = match mount(blob, direct.then_some(c"directio")) {
            Err(Errno::INVAL) if direct => {
                self.directio.store(false, Ordering::Relaxed);
                mount(blob, None)
            }
            other => other,
        };
        match result {
            // A kernel without file-backed EROFS wants a block device.
            Err(Errno::NOTBLK) => {
                let (device, path) = loop_device(blob)?;
                let mounted = mount(&path, None);
                drop(device);
                mounted.map_err(io::Error::from)
            }
            other => other.map_err(io::Error::from),
        }
    }
}

impl Drop for LayerMounts {
    fn drop(&mut self) {
        detach_all(&self.dir);
    }
}

/// Detaches `dir` and every mount beneath it (a private bind carries them all), then
/// removes the mount points left empty.
fn detach_all(dir: &Path) {
    while rustix::mount::unmount(dir, UnmountFlags::DETACH).is_ok() {}
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let _ = fs::remove_dir(entry.path());
    }
}

fn base36(mut n: u64) -> String {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8(out).unwrap_or_default()
}

/// `struct loop_info64` of `<linux/loop.h>`.
#[repr(C)]
struct LoopInfo64 {
    device: u64,
    inode: u64,
    rdevice: u64,
    offset: u64,
    sizelimit: u64,
    number: u32,
    encrypt_type: u32,
    encrypt_key_size: u32,
    flags: u32,
    file_name: [u8; 64],
    crypt_name: [u8; 64],
    encrypt_key: [u8; 32],
    init: [u64; 2],
}

/// `struct loop_config` of `<linux/loop.h>`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;

/// Attaches `blob` to a free loop device: read-only, direct I/O, and autoclear, so the
/// device detaches itself once the last user (the mount made from it) lets go.
pub(crate) fn loop_device(blob: &Path) -> io::Result<(OwnedFd, PathBuf)> {
    let file = fs::File::open(blob)?;
    let control = fs::File::open("/dev/loop-control")?;
    for _ in 0..16 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
        let n = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let device = OwnedFd::from(fs::File::open(&path)?);
        let config = LoopConfig {
            fd: u32::try_from(file.as_raw_fd()).map_err(io::Error::other)?,
            block_size: 0,
            info: LoopInfo64 {
                device: 0,
                inode: 0,
                rdevice: 0,
                offset: 0,
                sizelimit: 0,
                number: 0,
                encrypt_type: 0,
                encrypt_key_size: 0,
                flags: LO_FLAGS_READ_ONLY | LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO,
                file_name: [0; 64],
                crypt_name: [0; 64],
                encrypt_key: [0; 32],
                init: [0; 2],
            },
            reserved: [0; 8],
        };
        // SAFETY: LOOP_CONFIGURE reads a `struct loop_config`, which `config` is (repr(C),
        // the kernel's layout) and which outlives the call.
        let rc = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CONFIGURE, &config) };
        if rc == 0 {
            return Ok((device, path));
        }
        let e = io::Error::last_os_error();
        // Another process took that device between the two calls: ask again.
        if Errno::from_io_error(&e) != Some(Errno::BUSY) {
            return Err(e);
        }
    }
    Err(io::Error::other("no free loop device"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_names() {
        assert_eq!(base36(0), "0");
        assert_eq!(base36(35), "z");
        assert_eq!(base36(36), "10");
        assert_eq!(base36(36 * 36 * 36 * 36 - 1), "zzzz");
    }
}
