//! A directory tree as one layer: a rootfs directory being imported, or a sandbox's
//! writable layer being snapshotted.
//!
//! The directory is serialised as a tar stream in a fixed order (names sorted
//! bytewise, no access or change times) and fed straight into the layer
//! unpacker, so the same tree always hashes to the same diff id and lands in
//! the store once.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::{self, File, Metadata};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::pipe::PipeFlags;
use tar::{EntryType, Header};

use crate::error::Fault;
use crate::unpack::{unpack_layer, Unpacked};

/// Unpacks the tree at `dir` into a staging layer, leaving out the directories
/// `skip` (the store itself and its staging area, should `dir` contain them).
pub(crate) fn unpack_tree(staging: &Path, dir: &Path, skip: &[&Path]) -> Result<Unpacked, Fault> {
    let mut skipped = Vec::with_capacity(skip.len());
    for path in skip {
        let meta =
            fs::metadata(path).map_err(Fault::io(format!("cannot inspect {}", path.display())))?;
        skipped.push((meta.dev(), meta.ino()));
    }
    unpack_walk(staging, dir, &skipped, false)
}

/// Unpacks an overlayfs upper directory (a sandbox's writable layer) as a layer. Its
/// whiteouts (0:0 character devices) and opaque directories (`trusted.overlay.opaque=y`)
/// go into the stream as OCI whiteout entries, which the unpacker turns back into
/// overlayfs form: the layer is exactly the diff the sandbox made.
pub(crate) fn unpack_upper(staging: &Path, upper: &Path) -> Result<Unpacked, Fault> {
    unpack_walk(staging, upper, &[], true)
}

fn unpack_walk(
    staging: &Path,
    dir: &Path,
    skip: &[(u64, u64)],
    upper: bool,
) -> Result<Unpacked, Fault> {
    let (reader, writer) = rustix::pipe::pipe_with(PipeFlags::CLOEXEC)
        .map_err(|e| Fault::Io("cannot create a pipe".into(), e.into()))?;
    let (unpacked, written) = std::thread::scope(|scope| {
        let producer = scope.spawn(move || write_tree(dir, skip, upper, File::from(writer)));
        let unpacked = unpack_layer(staging, File::from(reader));
        let written = producer
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (unpacked, written)
    });
    match written {
        // A broken pipe only means the unpacker stopped early; its error says why.
        Err(e) if unpacked.is_ok() || e.kind() != io::ErrorKind::BrokenPipe => {
            Err(Fault::Io(format!("cannot read {}", dir.display()), e))
        }
        _ => unpacked,
    }
}

/// Writes the tree under `root` (not `root` itself) as a tar stream, leaving
/// out the directories whose (device, inode) are in `skip`; `upper` converts overlayfs
/// whiteouts to OCI ones.
fn write_tree(root: &Path, skip: &[(u64, u64)], upper: bool, out: impl Write) -> io::Result<()> {
    let mut builder = tar::Builder::new(out);
    let mut walker = Walker {
        root,
        skip,
        upper,
        links: HashMap::new(),
    };
    walker.walk(&mut builder, Path::new(""))?;
    builder.into_inner()?.flush()
}

struct Walker<'a> {
    root: &'a Path,
    skip: &'a [(u64, u64)],
    /// Converting an overlayfs upper directory.
    upper: bool,
    /// First path seen of each multiply linked file, keyed by (device, inode).
    links: HashMap<(u64, u64), PathBuf>,
}

impl Walker<'_> {
    fn walk<W: Write>(&mut self, builder: &mut tar::Builder<W>, rel: &Path) -> io::Result<()> {
        let mut names = fs::read_dir(self.root.join(rel))?
            .map(|entry| entry.map(|e| e.file_name()))
            .collect::<io::Result<Vec<OsString>>>()?;
        names.sort();
        for name in names {
            let rel = rel.join(name);
            let path = self.root.join(&rel);
            let meta = fs::symlink_metadata(&path)?;
            if meta.is_dir() && self.skip.contains(&(meta.dev(), meta.ino())) {
                continue;
            }
            if self.upper && meta.file_type().is_char_device() && meta.rdev() == 0 {
                let mut whiteout = OsString::from(".wh.");
                whiteout.push(rel.file_name().unwrap_or_default());
                append_marker(builder, &rel.with_file_name(whiteout))?;
                continue;
            }
            append(builder, &path, &rel, &meta, &mut self.links)?;
            if meta.is_dir() {
                if self.upper && xattr::get(&path, OPAQUE)?.is_some_and(|v| v == b"y") {
                    append_marker(builder, &rel.join(".wh..wh..opq"))?;
                }
                self.walk(builder, &rel)?;
            }
        }
        Ok(())
    }
}

fn append<W: Write>(
    builder: &mut tar::Builder<W>,
    path: &Path,
    rel: &Path,
    meta: &Metadata,
    links: &mut HashMap<(u64, u64), PathBuf>,
) -> io::Result<()> {
    let file_type = meta.file_type();
    if file_type.is_socket() {
        tracing::debug!(path = %path.display(), "socket skipped: tar cannot hold it");
        return Ok(());
    }
    let mut header = Header::new_gnu();
    header.set_mode(meta.mode() & 0o7777);
    header.set_uid(meta.uid().into());
    header.set_gid(meta.gid().into());
    header.set_mtime(meta.mtime().max(0).unsigned_abs());
    header.set_size(0);
    append_xattrs(builder, path)?;

    if file_type.is_file() && meta.nlink() > 1 {
        if let Some(first) = links.get(&(meta.dev(), meta.ino())) {
            header.set_entry_type(EntryType::Link);
            return builder.append_link(&mut header, rel, first);
        }
        links.insert((meta.dev(), meta.ino()), rel.to_owned());
    }
    if file_type.is_file() {
        header.set_entry_type(EntryType::Regular);
        header.set_size(meta.len());
        let file = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)?;
        let exact = Exact {
            inner: file.take(meta.len()),
            left: meta.len(),
        };
        builder.append_data(&mut header, rel, exact)
    } else if file_type.is_symlink() {
        header.set_entry_type(EntryType::Symlink);
        builder.append_link(&mut header, rel, fs::read_link(path)?)
    } else {
        let entry_type = if file_type.is_dir() {
            EntryType::Directory
        } else if file_type.is_char_device() {
            EntryType::Char
        } else if file_type.is_block_device() {
            EntryType::Block
        } else {
            EntryType::Fifo
        };
        header.set_entry_type(entry_type);
        if file_type.is_char_device() || file_type.is_block_device() {
            header.set_device_major(rustix::fs::major(meta.rdev()))?;
            header.set_device_minor(rustix::fs::minor(meta.rdev()))?;
        }
        builder.append_data(&mut header, rel, io::empty())
    }
}

/// overlayfs's mark of a directory that hides the layers below it.
const OPAQUE: &str = "trusted.overlay.opaque";

/// An empty regular file: the OCI form of a whiteout.
fn append_marker<W: Write>(builder: &mut tar::Builder<W>, rel: &Path) -> io::Result<()> {
    let mut header = Header::new_gnu();
    header.set_entry_type(EntryType::Regular);
    header.set_mode(0o600);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    header.set_size(0);
    builder.append_data(&mut header, rel, io::empty())
}

/// Emits a PAX header carrying the entry's xattrs (`SCHILY.xattr.*`), the
/// form GNU tar, Docker and the `tar` crate's reader understand.
fn append_xattrs<W: Write>(builder: &mut tar::Builder<W>, path: &Path) -> io::Result<()> {
    let mut names: Vec<OsString> = match xattr::list(path) {
        Ok(names) => names.collect(),
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::NOTSUP.raw_os_error()) => {
            return Ok(())
        }
        Err(e) => return Err(e),
    };
    names.sort();
    let mut records = Vec::new();
    // overlayfs's own attributes describe the layer stack, not the file: never carried.
    for name in names
        .into_iter()
        .filter(|n| !n.as_bytes().starts_with(b"trusted.overlay."))
    {
        let Some(value) = xattr::get(path, &name)? else {
            continue;
        };
        let mut key = b"SCHILY.xattr.".to_vec();
        key.extend_from_slice(name.as_bytes());
        records.extend(pax_record(&key, &value));
    }
    if records.is_empty() {
        return Ok(());
    }
    let mut header = Header::new_ustar();
    header.set_entry_type(EntryType::XHeader);
    header.set_path("PaxHeader")?;
    header.set_mode(0o644);
    header.set_size(records.len() as u64);
    header.set_cksum();
    builder.append(&header, records.as_slice())
}

/// One `"<len> <key>=<value>\n"` record, where `len` counts the whole record.
fn pax_record(key: &[u8], value: &[u8]) -> Vec<u8> {
    let rest = key.len() + value.len() + 3;
    let mut len = rest + 1;
    while len != rest + len.to_string().len() {
        len = rest + len.to_string().len();
    }
    let mut record = format!("{len} ").into_bytes();
    record.extend_from_slice(key);
    record.push(b'=');
    record.extend_from_slice(value);
    record.push(b'\n');
    record
}

/// Fails instead of writing a short entry when a file shrinks while it is read.
struct Exact<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && self.left > 0 && !buf.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "file shrank while it was read",
            ));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pax_record_length_counts_itself() {
        let record = pax_record(b"SCHILY.xattr.user.a", b"1");
        let text = String::from_utf8(record.clone()).unwrap();
        let (len, _) = text.split_once(' ').unwrap();
        assert_eq!(len.parse::<usize>().unwrap(), record.len());
        let long = pax_record(b"k", &[b'v'; 95]);
        let text = String::from_utf8(long.clone()).unwrap();
        let (len, _) = text.split_once(' ').unwrap();
        assert_eq!(len.parse::<usize>().unwrap(), long.len());
    }
}
