//! What a sandbox changed of its image, read from its overlay's writable layer: by the
//! edge for a container (its own layer, or a local Docker daemon's `overlay2` one) and by
//! a VM guest's agent for its own root.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

/// Directories of an image's own programs and libraries: writes there replace them (the
/// Watcher's `binary-overwrite`).
pub const IMAGE_BINARY_DIRS: [&str; 8] = [
    "/bin/",
    "/sbin/",
    "/usr/bin/",
    "/usr/sbin/",
    "/lib/",
    "/lib64/",
    "/usr/lib/",
    "/usr/local/bin/",
];

/// The image's files under `dirs` (absolute directories, e.g. `/usr/bin/`) that the
/// writable layer `upper` over the image layers `lowers` (their roots) overwrote or
/// removed, as absolute paths (a whole directory hidden: `/usr/bin/`).
///
/// An overlay's upper directory holds exactly what the sandbox changed (removals as
/// whiteouts); those of its entries that an image layer also has are replaced. The
/// sandbox writes that directory: it is walked without following any link (a planted
/// `usr -> /` would otherwise list the host's own directories), and only so far per call,
/// since the sandbox chooses how many entries there are.
pub fn replaced_image_files(
    upper: BorrowedFd<'_>,
    lowers: &[impl AsFd],
    dirs: &[&str],
) -> Vec<String> {
    let in_image = |path: &Path| {
        lowers
            .iter()
            .any(|root| rustix::fs::statat(root, path, AtFlags::SYMLINK_NOFOLLOW).is_ok())
    };
    let mut replaced = Vec::new();
    for dir in dirs {
        let rel = dir.trim_matches('/');
        match layer_dir(upper, rel) {
            LayerDir::Untouched => {}
            LayerDir::Replaced => {
                if in_image(Path::new(rel)) {
                    replaced.push(format!("/{rel}/"));
                }
            }
            LayerDir::Merged(names) => {
                for name in names {
                    if in_image(&Path::new(rel).join(&name)) {
                        replaced.push(format!("/{rel}/{}", name.to_string_lossy()));
                    }
                }
            }
        }
    }
    replaced
}

/// The roots of `layers` (directories), opened for [`replaced_image_files`]; one that
/// cannot be opened is left out.
pub fn open_layers(layers: &[impl AsRef<Path>]) -> Vec<rustix::fd::OwnedFd> {
    layers
        .iter()
        .filter_map(|l| {
            rustix::fs::open(
                l.as_ref(),
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .ok()
        })
        .collect()
}

/// The most entries of one directory of a writable layer read per sample.
const CHANGED_FILES_READ: usize = 4096;

/// What a writable layer holds at one of the image's directories.
enum LayerDir {
    /// Nothing: the sandbox left the image's directory as it was.
    Untouched,
    /// A directory merged with the image's: these non-directories in it are the
    /// sandbox's, over the image's entries or beside them.
    Merged(Vec<std::ffi::OsString>),
    /// Something hiding the image's whole directory: a link, a file or a whiteout at
    /// the path or at one of its parents, or an opaque directory (removed and made anew).
    Replaced,
}

/// What the writable layer `upper` holds at `rel` (a relative path), each component
/// opened without following links: a planted `usr -> /` is reported as replacing
/// `/usr/...`, never followed into the host's directories.
fn layer_dir(upper: BorrowedFd<'_>, rel: &str) -> LayerDir {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let Ok(mut fd) = rustix::fs::openat(upper, ".", flags, Mode::empty()) else {
        return LayerDir::Untouched;
    };
    for component in rel.split('/').filter(|c| !c.is_empty()) {
        fd = match rustix::fs::openat(&fd, component, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => return LayerDir::Untouched,
            Err(_) => return LayerDir::Replaced,
        };
        let mut opaque = [0u8; 1];
        if rustix::fs::fgetxattr(&fd, "trusted.overlay.opaque", &mut opaque).is_ok_and(|n| n == 1)
            && opaque[0] == b'y'
        {
            return LayerDir::Replaced;
        }
    }
    let Ok(dir) = rustix::fs::Dir::read_from(&fd) else {
        return LayerDir::Untouched;
    };
    let mut names = Vec::new();
    for entry in dir.take(CHANGED_FILES_READ) {
        let Ok(entry) = entry else { break };
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." || entry.file_type() == FileType::Directory {
            continue;
        }
        names.push(std::ffi::OsStr::from_bytes(name).to_owned());
    }
    LayerDir::Merged(names)
}
