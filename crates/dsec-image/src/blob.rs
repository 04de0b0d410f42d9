//! Layers as EROFS blobs.
//!
//! A layer is unpacked once into a staging tree (whiteouts already in overlayfs form, see
//! `unpack`), written as an EROFS image by `mkfs.erofs`, and published into the layer
//! store under its diff id; sandboxes then mount it read-only in place and read only the
//! blocks they touch. `mkfs.erofs` keeps what the tree holds: modes (setuid included),
//! owners, mtimes, hard links, xattrs (`trusted.overlay.opaque`, `security.capability`),
//! device nodes and the 0:0 whiteouts.
//!
//! Publication is atomic on any POSIX filesystem, NFS included: a blob is written and
//! fsynced under a temporary name in the store's own directory, then hard-linked to its
//! final name, which fails instead of replacing when another edge got there first. So a
//! blob is whole from the moment its name exists, and a blob some edge has mounted is
//! never swapped under it.

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use rustix::io::Errno;

/// The builder, from erofs-utils.
const MKFS: &str = "mkfs.erofs";

/// Writes the tree at `tree` as an EROFS image at `out`, a new file (in the layer store's
/// directory, so that publishing it is a link). The filesystem UUID comes from the diff
/// id, so one layer always builds the same blob. A full or read-only target comes back as
/// `ENOSPC` / `EROFS`, as if written here.
pub(crate) fn build(tree: &Path, out: &Path, diff_id: &str) -> io::Result<()> {
    let hex = diff_id.strip_prefix("sha256:").unwrap_or(diff_id);
    let uuid = format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    );
    // Made here first: a store that cannot take the file says why with its own errno.
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(out)?;
    let output = Command::new(MKFS)
        .arg("--quiet")
        .arg(format!("-U{uuid}"))
        .arg(out)
        .arg(tree)
        .output()
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => {
                io::Error::other(format!("{MKFS} not found: install erofs-utils"))
            }
            _ => e,
        })?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    // mkfs.erofs reports its write errors by their strerror(3) text only.
    for (errno, text) in [
        (Errno::NOSPC, "No space left on device"),
        (Errno::DQUOT, "Disk quota exceeded"),
        (Errno::ROFS, "Read-only file system"),
    ] {
        if stderr.contains(text) {
            return Err(errno.into());
        }
    }
    Err(io::Error::other(format!(
        "{MKFS} failed ({}): {}",
        output.status,
        stderr.trim()
    )))
}

/// Publishes the complete file `built` as `dir/name`, unless that name exists already.
/// Says whether this call published it. `tmp` names the temporary file used when
/// `built` lies on another filesystem than `dir` (it is then copied there first).
/// `built` is consumed either way.
pub(crate) fn publish(built: &Path, dir: &Path, name: &str, tmp: &str) -> io::Result<bool> {
    let target = dir.join(name);
    let result = (|| {
        File::open(built)?.sync_all()?;
        match link(built, &target) {
            Err(e) if Errno::from_io_error(&e) == Some(Errno::XDEV) => {
                let tmp = dir.join(tmp);
                let copied = copy_synced(built, &tmp).and_then(|()| link(&tmp, &target));
                let _ = fs::remove_file(&tmp);
                copied
            }
            other => other,
        }
    })();
    let _ = fs::remove_file(built);
    let published = result?;
    if published {
        File::open(dir)?.sync_all()?;
    }
    Ok(published)
}

/// `link(2)`: true when made, false when `target` exists.
fn link(source: &Path, target: &Path) -> io::Result<bool> {
    match fs::hard_link(source, target) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

fn copy_synced(source: &Path, target: &Path) -> io::Result<()> {
    let mut out = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(target)?;
    io::copy(&mut File::open(source)?, &mut out)?;
    out.flush()?;
    out.sync_all()
}

/// Writes `bytes` to `dir/name` the same way [`publish`] does (a sidecar of a blob).
pub(crate) fn publish_bytes(bytes: &[u8], dir: &Path, name: &str, tmp: &str) -> io::Result<()> {
    let path: PathBuf = dir.join(tmp);
    let written = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()));
    let result = written.and_then(|()| link(&path, &dir.join(name)).map(drop));
    let _ = fs::remove_file(&path);
    result
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    use sha2::{Digest, Sha256};

    use super::*;
    use crate::mount::LayerMounts;
    use crate::unpack::unpack_layer;

    /// A layer with everything the unpacker has to get right.
    fn rich_layer() -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        let entry = |b: &mut tar::Builder<Vec<u8>>,
                     kind: tar::EntryType,
                     path: &str,
                     mode: u32,
                     owner: (u64, u64),
                     data: &[u8],
                     link: Option<&str>| {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_mode(mode);
            h.set_uid(owner.0);
            h.set_gid(owner.1);
            h.set_mtime(1_600_000_000 + path.len() as u64);
            h.set_size(data.len() as u64);
            if kind == tar::EntryType::Char {
                h.set_device_major(1).unwrap();
                h.set_device_minor(3).unwrap();
            }
            if kind == tar::EntryType::Block {
                h.set_device_major(7).unwrap();
                h.set_device_minor(0).unwrap();
            }
            match link {
                Some(target) => b.append_link(&mut h, path, target).unwrap(),
                None => b.append_data(&mut h, path, data).unwrap(),
            }
        };
        use tar::EntryType::*;
        entry(&mut b, Directory, "etc", 0o755, (0, 0), b"", None);
        entry(&mut b, Directory, "etc/secret", 0o700, (12, 34), b"", None);
        entry(
            &mut b,
            Regular,
            "etc/secret/key",
            0o600,
            (12, 34),
            b"k",
            None,
        );
        entry(&mut b, Directory, "tmp", 0o1777, (0, 0), b"", None);
        entry(&mut b, Regular, "etc/.wh.gone", 0o644, (0, 0), b"", None);
        entry(&mut b, Directory, "opt", 0o755, (0, 0), b"", None);
        entry(
            &mut b,
            Regular,
            "opt/.wh..wh..opq",
            0o644,
            (0, 0),
            b"",
            None,
        );
        entry(
            &mut b,
            Regular,
            "opt/tool",
            0o4755,
            (0, 0),
            b"#!/bin/sh\n",
            None,
        );
        entry(
            &mut b,
            Link,
            "opt/tool-again",
            0o4755,
            (0, 0),
            b"",
            Some("opt/tool"),
        );
        entry(&mut b, Symlink, "opt/rel", 0o777, (0, 0), b"", Some("tool"));
        entry(
            &mut b,
            Symlink,
            "opt/abs",
            0o777,
            (0, 0),
            b"",
            Some("/nowhere"),
        );
        entry(&mut b, Fifo, "opt/pipe", 0o640, (5, 6), b"", None);
        entry(&mut b, Char, "opt/null", 0o666, (0, 0), b"", None);
        entry(&mut b, Block, "opt/loop", 0o660, (0, 6), b"", None);
        entry(&mut b, Regular, "opt/none", 0o000, (0, 0), b"", None);
        let big: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        entry(&mut b, Regular, "opt/big", 0o644, (1000, 1000), &big, None);
        // File capabilities (v2: cap_net_raw permitted and effective) and a user xattr.
        let cap = [
            1u8, 0, 0, 2, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ];
        b.append_pax_extensions([
            ("SCHILY.xattr.security.capability", &cap[..]),
            ("SCHILY.xattr.user.note", b"hello".as_slice()),
        ])
        .unwrap();
        entry(&mut b, Regular, "opt/ping", 0o755, (0, 0), b"ping", None);
        b.into_inner().unwrap()
    }

    /// Everything about every entry under `root`, hard links named by their first path.
    fn describe(root: &Path) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        let mut first_path: HashMap<u64, String> = HashMap::new();
        let mut pending = vec![PathBuf::new()];
        while let Some(rel) = pending.pop() {
            let mut names: Vec<_> = fs::read_dir(root.join(&rel))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            names.sort();
            for name in names {
                let rel = rel.join(name);
                let path = root.join(&rel);
                let m = fs::symlink_metadata(&path).unwrap();
                let ft = m.file_type();
                let mut xattrs: Vec<String> = xattr::list(&path)
                    .map(|names| {
                        names
                            .map(|n| {
                                let v = xattr::get(&path, &n).unwrap().unwrap_or_default();
                                format!("{}={}", n.to_string_lossy(), hex::encode(v))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                xattrs.sort();
                let content = if ft.is_file() {
                    let link = first_path
                        .entry(m.ino())
                        .or_insert_with(|| rel.display().to_string());
                    format!(
                        "file {} {} first={link}",
                        m.len(),
                        hex::encode(Sha256::digest(fs::read(&path).unwrap()))
                    )
                } else if ft.is_symlink() {
                    format!("symlink {}", fs::read_link(&path).unwrap().display())
                } else if ft.is_char_device() || ft.is_block_device() {
                    format!("device {}", m.rdev())
                } else if ft.is_fifo() {
                    "fifo".into()
                } else {
                    pending.push(rel.clone());
                    "dir".into()
                };
                let mtime = if ft.is_symlink() { 0 } else { m.mtime() };
                out.insert(
                    rel.display().to_string(),
                    format!(
                        "{content} mode={:o} owner={}:{} mtime={mtime} xattrs={xattrs:?}",
                        m.mode(),
                        m.uid(),
                        m.gid()
                    ),
                );
            }
        }
        out
    }

    /// The tree a sandbox sees through the blob is the tree the unpacker made: the
    /// blob is a faithful container, not a re-interpretation (run as root: it mounts).
    #[test]
    fn a_mounted_blob_holds_exactly_the_unpacked_tree() {
        let tmp = tempfile::tempdir().unwrap();
        let unpacked = unpack_layer(tmp.path(), rich_layer().as_slice()).unwrap();
        let blob = tmp.path().join("layer.erofs");
        build(unpacked.dir.path(), &blob, &unpacked.diff_id).unwrap();
        let mounts = LayerMounts::open(&tmp.path().join("mnt")).unwrap();
        let dir = mounts.mount(&unpacked.diff_id, &blob).unwrap();
        let (expected, got) = (describe(unpacked.dir.path()), describe(&dir));
        assert_eq!(expected, got);
        // The properties that matter to overlayfs and to the sandbox are really there.
        assert!(
            got["etc/gone"].starts_with("device 0 "),
            "whiteout: {}",
            got["etc/gone"]
        );
        assert!(
            got["opt"].contains("trusted.overlay.opaque=79"),
            "{}",
            got["opt"]
        );
        assert!(
            got["opt/ping"].contains("security.capability="),
            "{}",
            got["opt/ping"]
        );
        assert!(
            got["opt/tool"].contains("mode=104755"),
            "{}",
            got["opt/tool"]
        );
        assert!(
            got["opt/tool-again"].contains("first=opt/tool "),
            "{}",
            got["opt/tool-again"]
        );
        assert!(
            got["etc/secret"].contains("owner=12:34"),
            "{}",
            got["etc/secret"]
        );
        drop(mounts);
        assert_eq!(fs::read_dir(tmp.path().join("mnt")).unwrap().count(), 0);
    }

    /// Kernels without file-backed EROFS get the blob through a loop device, which goes
    /// away with the mount.
    #[test]
    fn a_blob_mounts_through_a_loop_device_too() {
        let tmp = tempfile::tempdir().unwrap();
        let unpacked = unpack_layer(tmp.path(), rich_layer().as_slice()).unwrap();
        let blob = tmp.path().join("layer.erofs");
        build(unpacked.dir.path(), &blob, &unpacked.diff_id).unwrap();
        let (device, path) = crate::mount::loop_device(&blob).unwrap();
        let target = tmp.path().join("via-loop");
        fs::create_dir(&target).unwrap();
        rustix::mount::mount(
            &path,
            &target,
            "erofs",
            rustix::mount::MountFlags::RDONLY,
            None,
        )
        .unwrap();
        drop(device);
        let got = describe(&target);
        rustix::mount::unmount(&target, rustix::mount::UnmountFlags::DETACH).unwrap();
        assert_eq!(describe(unpacked.dir.path()), got);
        let backing = format!(
            "/sys/block/{}/loop/backing_file",
            path.file_name().unwrap().to_string_lossy()
        );
        let detached = (0..50).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(20));
            fs::read_to_string(&backing).is_err()
        });
        assert!(
            detached,
            "{} still attached after the unmount",
            path.display()
        );
    }
}
