//! Unpacking one layer tar into a staging directory.
//!
//! Every filesystem operation goes through a directory descriptor opened
//! component by component with `O_NOFOLLOW`, so no entry (symlink, hard link,
//! path) can make the unpacker touch anything outside the staging directory.
//! OCI whiteouts become overlayfs whiteouts on the way: `.wh.NAME` turns into a
//! 0:0 character device `NAME`, `.wh..wh..opq` into the `trusted.overlay.opaque`
//! xattr of its directory.

use std::ffi::{OsStr, OsString};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Gid, Mode, OFlags, Timespec, Timestamps, Uid, XattrFlags};
use rustix::io::Errno;
use tar::EntryType;
use tempfile::TempDir;

use crate::digest::HashingReader;
use crate::error::Fault;

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";
const PAX_XATTR_PREFIX: &[u8] = b"SCHILY.xattr.";

/// A layer unpacked into a staging directory, not yet in the store.
pub(crate) struct Unpacked {
    /// sha256 of the uncompressed tar stream.
    pub(crate) diff_id: String,
    /// Bytes of regular-file content.
    pub(crate) size: u64,
    /// The unpacked tree; deleted if dropped before being committed.
    pub(crate) dir: TempDir,
}

/// Unpacks a (possibly gzip or zstd compressed) tar stream into a fresh
/// directory under `staging`, hashing the uncompressed stream as it goes.
pub(crate) fn unpack_layer(staging: &Path, reader: impl Read) -> Result<Unpacked, Fault> {
    let dir = tempfile::Builder::new()
        .prefix("layer-")
        .tempdir_in(staging)
        .map_err(Fault::io("cannot create a staging directory"))?;
    let root = open_dir(dir.path())?;
    let mut stream = HashingReader::new(decompress(reader)?);
    let mut unpacker = Unpacker {
        root_path: dir.path(),
        root,
        size: 0,
        dir_times: Vec::new(),
        root_seen: false,
    };
    {
        let mut archive = tar::Archive::new(&mut stream);
        for entry in archive.entries().map_err(corrupt_stream)? {
            let mut entry = entry.map_err(corrupt_stream)?;
            unpacker.entry(&mut entry)?;
        }
    }
    stream.drain().map_err(corrupt_stream)?;
    unpacker.finish()?;
    Ok(Unpacked {
        diff_id: stream.digest(),
        size: unpacker.size,
        dir,
    })
}

fn corrupt_stream(e: io::Error) -> Fault {
    Fault::Corrupt(format!("unreadable tar stream: {e}"))
}

/// Wraps `reader` in a decompressor chosen by its magic bytes.
fn decompress<'a>(mut reader: impl Read + 'a) -> Result<Box<dyn Read + 'a>, Fault> {
    let mut magic = [0u8; 4];
    let mut len = 0;
    while len < magic.len() {
        match reader.read(&mut magic[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(corrupt_stream(e)),
        }
    }
    let head = &magic[..len];
    let whole = io::Cursor::new(head.to_vec()).chain(reader);
    Ok(match Compression::sniff(head) {
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(whole)),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::new(whole)
                .map_err(Fault::io("cannot start a zstd decoder"))?,
        ),
        Compression::None => Box::new(whole),
    })
}

/// How a stream is compressed, judged by its first bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    pub(crate) fn sniff(head: &[u8]) -> Compression {
        if head.starts_with(&[0x1f, 0x8b]) {
            Compression::Gzip
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Compression::Zstd
        } else {
            Compression::None
        }
    }
}

/// Splits an archive path into its components, refusing `..` and absolute paths.
fn normalize(raw: &[u8]) -> Result<Vec<OsString>, Fault> {
    let shown = String::from_utf8_lossy(raw);
    if raw.starts_with(b"/") {
        return Err(Fault::Corrupt(format!("entry {shown:?} is absolute")));
    }
    let mut parts = Vec::new();
    for part in raw.split(|b| *b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => return Err(Fault::Corrupt(format!("entry {shown:?} contains `..`"))),
            _ => parts.push(OsStr::from_bytes(part).to_owned()),
        }
    }
    Ok(parts)
}

fn show(parts: &[OsString]) -> String {
    parts
        .iter()
        .map(|p| p.to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

fn rel_path(parts: &[OsString]) -> PathBuf {
    parts.iter().collect()
}

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

fn open_dir(path: &Path) -> Result<OwnedFd, Fault> {
    rustix::fs::open(path, DIR_FLAGS, Mode::empty())
        .map_err(|e| Fault::Io(format!("cannot open {}", path.display()), e.into()))
}

/// Ownership, permissions and times of one entry.
struct Attrs {
    uid: Uid,
    gid: Gid,
    mode: Mode,
    times: Timestamps,
    xattrs: Vec<(OsString, Vec<u8>)>,
}

struct Unpacker<'a> {
    root_path: &'a Path,
    root: OwnedFd,
    size: u64,
    /// Directory mtimes, applied last since creating entries changes them.
    dir_times: Vec<(Vec<OsString>, Timestamps)>,
    root_seen: bool,
}

impl Unpacker<'_> {
    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), Fault> {
        let kind = entry.header().entry_type();
        if kind.is_pax_global_extensions() {
            return Ok(());
        }
        let raw_path = entry.path_bytes().into_owned();
        let parts = normalize(&raw_path)?;
        let attrs = attrs(entry, &parts)?;
        let is_dir = kind.is_dir()
            || (matches!(kind, EntryType::Regular | EntryType::Continuous)
                && raw_path.ends_with(b"/"));
        let Some((name, parents)) = parts.split_last() else {
            if is_dir {
                self.root_seen = true;
                self.set_dir_attrs(&self.root, &attrs, &parts)?;
                self.dir_times.push((parts, attrs.times));
            }
            return Ok(());
        };
        let parent = self.open_parent(parents, true, &parts)?;
        let name_bytes = name.as_bytes();

        if name_bytes == OPAQUE_MARKER {
            return rustix::fs::fsetxattr(&parent, OPAQUE_XATTR, b"y", XattrFlags::empty())
                .map_err(|e| Fault::Io(format!("cannot mark {} opaque", show(parents)), e.into()));
        }
        if let Some(hidden) = name_bytes.strip_prefix(WHITEOUT_PREFIX) {
            if hidden.starts_with(WHITEOUT_PREFIX) {
                // Other `.wh..wh.` names are aufs bookkeeping with no overlayfs meaning.
                return Ok(());
            }
            if hidden.is_empty() {
                return Err(Fault::Corrupt(format!(
                    "whiteout {:?} names nothing",
                    show(&parts)
                )));
            }
            let hidden = OsStr::from_bytes(hidden);
            let mut target = parents.to_vec();
            target.push(hidden.to_owned());
            self.clear(&parent, hidden, &target, false)?;
            return self.make_node(
                &parent,
                hidden,
                FileType::CharacterDevice,
                0,
                &attrs,
                &target,
            );
        }

        if is_dir {
            let kept = self.clear(&parent, name, &parts, true)?;
            if !kept {
                rustix::fs::mkdirat(&parent, name.as_os_str(), Mode::from_raw_mode(0o700))
                    .map_err(|e| io_fault("create", &parts, e))?;
            }
            let fd = rustix::fs::openat(&parent, name.as_os_str(), DIR_FLAGS, Mode::empty())
                .map_err(|e| io_fault("open", &parts, e))?;
            self.set_dir_attrs(&fd, &attrs, &parts)?;
            self.dir_times.push((parts, attrs.times));
            return Ok(());
        }

        match kind {
            EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .filter(|t| !t.is_empty())
                    .ok_or_else(|| {
                        Fault::Corrupt(format!("symlink {:?} has no target", show(&parts)))
                    })?
                    .into_owned();
                self.clear(&parent, name, &parts, false)?;
                rustix::fs::symlinkat(OsStr::from_bytes(&target), &parent, name.as_os_str())
                    .map_err(|e| io_fault("create", &parts, e))?;
                chown_at(&parent, name, &attrs, &parts)?;
                set_xattrs_at(&parent, name, &attrs, &parts)?;
                utimes_at(&parent, name, &attrs.times, &parts)
            }
            EntryType::Link => {
                let target = entry.link_name_bytes().ok_or_else(|| {
                    Fault::Corrupt(format!("hard link {:?} has no target", show(&parts)))
                })?;
                let target = normalize(&target)?;
                let Some((target_name, target_parents)) = target.split_last() else {
                    return Err(Fault::Corrupt(format!(
                        "hard link {:?} points at the layer root",
                        show(&parts)
                    )));
                };
                let target_parent = self.open_parent(target_parents, false, &target)?;
                self.clear(&parent, name, &parts, false)?;
                rustix::fs::linkat(
                    &target_parent,
                    target_name.as_os_str(),
                    &parent,
                    name.as_os_str(),
                    AtFlags::empty(),
                )
                .map_err(|e| match e {
                    Errno::NOENT | Errno::PERM | Errno::ISDIR => Fault::Corrupt(format!(
                        "hard link {:?} points at {:?}, which is missing or a directory",
                        show(&parts),
                        show(&target)
                    )),
                    e => io_fault("link", &parts, e),
                })
            }
            EntryType::Char | EntryType::Block | EntryType::Fifo => {
                let (file_type, dev) = match kind {
                    EntryType::Char => (FileType::CharacterDevice, device(entry, &parts)?),
                    EntryType::Block => (FileType::BlockDevice, device(entry, &parts)?),
                    _ => (FileType::Fifo, 0),
                };
                self.clear(&parent, name, &parts, false)?;
                self.make_node(&parent, name, file_type, dev, &attrs, &parts)
            }
            // As in POSIX tar, anything unrecognised is a regular file.
            _ => {
                self.clear(&parent, name, &parts, false)?;
                let fd = rustix::fs::openat(
                    &parent,
                    name.as_os_str(),
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o600),
                )
                .map_err(|e| io_fault("create", &parts, e))?;
                let mut file = File::from(fd);
                self.size += copy_content(entry, &mut file, &parts)?;
                let fault = |e: Errno| io_fault("set attributes of", &parts, e);
                chown_fd(&file, &attrs, &parts)?;
                rustix::fs::fchmod(&file, attrs.mode).map_err(fault)?;
                set_xattrs_fd(&file, &attrs, &parts)?;
                rustix::fs::futimens(&file, &attrs.times).map_err(fault)
            }
        }
    }

    /// Opens the directory `parents` inside the layer, creating missing ones
    /// when `create`; a symlink or non-directory on the way is corruption.
    fn open_parent(
        &self,
        parents: &[OsString],
        create: bool,
        entry: &[OsString],
    ) -> Result<OwnedFd, Fault> {
        let mut dir = rustix::fs::openat(&self.root, ".", DIR_FLAGS, Mode::empty())
            .map_err(|e| io_fault("open", &[], e))?;
        for (depth, part) in parents.iter().enumerate() {
            let here = &parents[..=depth];
            dir = match rustix::fs::openat(&dir, part.as_os_str(), DIR_FLAGS, Mode::empty()) {
                Ok(fd) => fd,
                Err(Errno::NOENT) if create => {
                    rustix::fs::mkdirat(&dir, part.as_os_str(), Mode::from_raw_mode(0o755))
                        .map_err(|e| io_fault("create", here, e))?;
                    let fd = rustix::fs::openat(&dir, part.as_os_str(), DIR_FLAGS, Mode::empty())
                        .map_err(|e| io_fault("open", here, e))?;
                    rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o755))
                        .map_err(|e| io_fault("set attributes of", here, e))?;
                    fd
                }
                Err(Errno::LOOP | Errno::NOTDIR | Errno::NOENT) => {
                    return Err(Fault::Corrupt(format!(
                        "entry {:?} lies beneath {:?}, which is not a directory of the layer",
                        show(entry),
                        show(here)
                    )))
                }
                Err(e) => return Err(io_fault("open", here, e)),
            };
        }
        Ok(dir)
    }

    /// Makes room for a new entry `name`: an existing directory is kept when
    /// the new entry is one too (returns true), anything else is removed.
    fn clear(
        &self,
        parent: &OwnedFd,
        name: &OsStr,
        parts: &[OsString],
        keep_dir: bool,
    ) -> Result<bool, Fault> {
        let stat = match rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => stat,
            Err(Errno::NOENT) => return Ok(false),
            Err(e) => return Err(io_fault("inspect", parts, e)),
        };
        if FileType::from_raw_mode(stat.st_mode) == FileType::Directory {
            if keep_dir {
                return Ok(true);
            }
            // Every component up to here was opened with O_NOFOLLOW, so this
            // path stays inside the staging directory.
            let path = self.root_path.join(rel_path(parts));
            fs::remove_dir_all(&path).map_err(Fault::io(format!(
                "cannot replace {} in a staging layer",
                show(parts)
            )))?;
        } else {
            rustix::fs::unlinkat(parent, name, AtFlags::empty())
                .map_err(|e| io_fault("replace", parts, e))?;
        }
        Ok(false)
    }

    fn make_node(
        &self,
        parent: &OwnedFd,
        name: &OsStr,
        file_type: FileType,
        dev: u64,
        attrs: &Attrs,
        parts: &[OsString],
    ) -> Result<(), Fault> {
        rustix::fs::mknodat(parent, name, file_type, Mode::empty(), dev)
            .map_err(|e| io_fault("create", parts, e))?;
        chown_at(parent, name, attrs, parts)?;
        // The node was just created by us, so following the name cannot leave the layer.
        rustix::fs::chmodat(parent, name, attrs.mode, AtFlags::empty())
            .map_err(|e| io_fault("set attributes of", parts, e))?;
        set_xattrs_at(parent, name, attrs, parts)?;
        utimes_at(parent, name, &attrs.times, parts)
    }

    fn set_dir_attrs(&self, fd: &OwnedFd, attrs: &Attrs, parts: &[OsString]) -> Result<(), Fault> {
        chown_fd(fd, attrs, parts)?;
        rustix::fs::fchmod(fd, attrs.mode).map_err(|e| io_fault("set attributes of", parts, e))?;
        set_xattrs_fd(fd, attrs, parts)
    }

    /// Applies directory mtimes and gives the layer root a sane mode if the
    /// archive did not describe it.
    fn finish(&mut self) -> Result<(), Fault> {
        if !self.root_seen {
            rustix::fs::fchmod(&self.root, Mode::from_raw_mode(0o755))
                .map_err(|e| io_fault("set attributes of", &[], e))?;
        }
        for (parts, times) in std::mem::take(&mut self.dir_times) {
            let Some((name, parents)) = parts.split_last() else {
                rustix::fs::futimens(&self.root, &times)
                    .map_err(|e| io_fault("set times of", &parts, e))?;
                continue;
            };
            // A later entry may have replaced the directory; then its time is moot.
            let Ok(parent) = self.open_parent(parents, false, &parts) else {
                continue;
            };
            match rustix::fs::utimensat(
                &parent,
                name.as_os_str(),
                &times,
                AtFlags::SYMLINK_NOFOLLOW,
            ) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(e) => return Err(io_fault("set times of", &parts, e)),
            }
        }
        Ok(())
    }
}

/// The device number of a character or block device entry.
fn device<R: Read>(entry: &tar::Entry<'_, R>, parts: &[OsString]) -> Result<u64, Fault> {
    let header = entry.header();
    match (header.device_major(), header.device_minor()) {
        (Ok(major), Ok(minor)) => Ok(rustix::fs::makedev(
            major.unwrap_or_default(),
            minor.unwrap_or_default(),
        )),
        _ => Err(Fault::Corrupt(format!(
            "device {:?} has a bad device number",
            show(parts)
        ))),
    }
}

fn io_fault(action: &str, parts: &[OsString], e: Errno) -> Fault {
    let shown = if parts.is_empty() {
        ".".to_owned()
    } else {
        show(parts)
    };
    Fault::Io(
        format!("cannot {action} {shown} in a staging layer"),
        e.into(),
    )
}

fn attrs<R: Read>(entry: &mut tar::Entry<'_, R>, parts: &[OsString]) -> Result<Attrs, Fault> {
    let bad = |what: &str| Fault::Corrupt(format!("entry {:?} has a bad {what}", show(parts)));
    let header = entry.header();
    let id = |value: io::Result<u64>, what: &str| {
        value
            .ok()
            .and_then(|v| u32::try_from(v).ok())
            .filter(|v| *v != u32::MAX)
            .ok_or_else(|| bad(what))
    };
    let uid = Uid::from_raw(id(header.uid(), "uid")?);
    let gid = Gid::from_raw(id(header.gid(), "gid")?);
    let mode = Mode::from_raw_mode(header.mode().map_err(|_| bad("mode"))? & 0o7777);
    let mtime = Timespec {
        tv_sec: header.mtime().unwrap_or(0).try_into().unwrap_or(i64::MAX),
        tv_nsec: 0,
    };
    let mut xattrs = Vec::new();
    if let Some(extensions) = entry.pax_extensions().map_err(corrupt_stream)? {
        for extension in extensions {
            let extension = extension.map_err(|_| bad("pax header"))?;
            let Some(key) = extension.key_bytes().strip_prefix(PAX_XATTR_PREFIX) else {
                continue;
            };
            // Overlay xattrs come only from whiteouts, never from the archive:
            // they would let an image redirect lookups.
            if key.starts_with(b"trusted.overlay.") {
                continue;
            }
            xattrs.push((
                OsStr::from_bytes(key).to_owned(),
                extension.value_bytes().to_vec(),
            ));
        }
    }
    Ok(Attrs {
        uid,
        gid,
        mode,
        times: Timestamps {
            last_access: mtime,
            last_modification: mtime,
        },
        xattrs,
    })
}

/// Copies an entry's content, telling a damaged archive from a failing disk.
fn copy_content(reader: &mut impl Read, file: &mut File, parts: &[OsString]) -> Result<u64, Fault> {
    let mut buf = vec![0u8; 128 * 1024];
    let mut total = 0u64;
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(corrupt_stream(e)),
        };
        file.write_all(&buf[..n]).map_err(Fault::io(format!(
            "cannot write {} in a staging layer",
            show(parts)
        )))?;
        total += n as u64;
    }
}

/// Ownership is kept where the process may set it; an unprivileged store
/// keeps its own.
fn chown_fd(fd: impl AsFd, attrs: &Attrs, parts: &[OsString]) -> Result<(), Fault> {
    match rustix::fs::fchown(fd, Some(attrs.uid), Some(attrs.gid)) {
        Ok(()) | Err(Errno::PERM) => Ok(()),
        Err(e) => Err(io_fault("set the owner of", parts, e)),
    }
}

fn chown_at(
    parent: &OwnedFd,
    name: &OsStr,
    attrs: &Attrs,
    parts: &[OsString],
) -> Result<(), Fault> {
    match rustix::fs::chownat(
        parent,
        name,
        Some(attrs.uid),
        Some(attrs.gid),
        AtFlags::SYMLINK_NOFOLLOW,
    ) {
        Ok(()) | Err(Errno::PERM) => Ok(()),
        Err(e) => Err(io_fault("set the owner of", parts, e)),
    }
}

fn utimes_at(
    parent: &OwnedFd,
    name: &OsStr,
    times: &Timestamps,
    parts: &[OsString],
) -> Result<(), Fault> {
    rustix::fs::utimensat(parent, name, times, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| io_fault("set times of", parts, e))
}

/// xattrs are kept where the filesystem and the process allow them (a
/// `security.*` label from a build host may well be refused here).
fn xattr_result(
    result: rustix::io::Result<()>,
    key: &OsStr,
    parts: &[OsString],
) -> Result<(), Fault> {
    match result {
        Ok(()) => Ok(()),
        Err(Errno::PERM | Errno::ACCESS | Errno::NOTSUP | Errno::INVAL) => {
            tracing::debug!(entry = %show(parts), key = %key.to_string_lossy(), "xattr not kept");
            Ok(())
        }
        Err(e) => Err(io_fault("set xattrs of", parts, e)),
    }
}

fn set_xattrs_fd(fd: impl AsFd, attrs: &Attrs, parts: &[OsString]) -> Result<(), Fault> {
    for (key, value) in &attrs.xattrs {
        let result = rustix::fs::fsetxattr(fd.as_fd(), key.as_os_str(), value, XattrFlags::empty());
        xattr_result(result, key, parts)?;
    }
    Ok(())
}

/// Sets xattrs on a symlink or device node, which cannot be opened for that;
/// the parent is named through /proc so no symlink on the way is followed.
fn set_xattrs_at(
    parent: &OwnedFd,
    name: &OsStr,
    attrs: &Attrs,
    parts: &[OsString],
) -> Result<(), Fault> {
    if attrs.xattrs.is_empty() {
        return Ok(());
    }
    let path = Path::new("/proc/self/fd")
        .join(parent.as_raw_fd().to_string())
        .join(name);
    for (key, value) in &attrs.xattrs {
        let result = rustix::fs::lsetxattr(&path, key.as_os_str(), value, XattrFlags::empty());
        xattr_result(result, key, parts)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_strips_dots_and_refuses_escapes() {
        let parts = normalize(b"./a//b/./c/").unwrap();
        assert_eq!(parts, ["a", "b", "c"].map(OsString::from));
        assert!(normalize(b"./").unwrap().is_empty());
        assert!(matches!(normalize(b"a/../../b"), Err(Fault::Corrupt(_))));
        assert!(matches!(normalize(b"/etc/passwd"), Err(Fault::Corrupt(_))));
    }

    #[test]
    fn sniffs_compression() {
        assert_eq!(Compression::sniff(&[0x1f, 0x8b, 8, 0]), Compression::Gzip);
        assert_eq!(
            Compression::sniff(&[0x28, 0xb5, 0x2f, 0xfd]),
            Compression::Zstd
        );
        assert_eq!(Compression::sniff(b"etc/"), Compression::None);
        assert_eq!(Compression::sniff(&[]), Compression::None);
    }
}
