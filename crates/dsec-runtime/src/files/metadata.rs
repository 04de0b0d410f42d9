//! File metadata: string pairs kept on a file as `user.e2b.<key>` extended attributes,
//! where E2B's envd keeps an upload's `X-Metadata-<key>` headers, so that what an E2B
//! client wrote reads back the same through dsec (and through `getfattr` in the sandbox).
//!
//! The limits are envd's: a key is at most 246 bytes (the xattr name, prefix included,
//! at most 255), keys and values printable ASCII, a file's whole set (names with their
//! prefix, and values) at most 4096 bytes, what ext4 keeps in one inode block. Keys are
//! lowercase: HTTP header names carry no case.
//!
//! Reading is best effort, as envd's: an entry whose filesystem has no user xattrs, or
//! that the user may not read, has no metadata, and a value that is not UTF-8 (set in the
//! sandbox by hand) is left out. Writing is not: a set that cannot be stored is an error,
//! never dropped.

use std::collections::BTreeMap;
use std::os::fd::AsFd;

use rustix::fs::XattrFlags;

use super::FileError;

/// The attribute namespace of the metadata.
pub const PREFIX: &str = "user.e2b.";

/// Longest key: the kernel bounds an attribute's whole name to 255 bytes.
pub const MAX_KEY_LEN: usize = 255 - PREFIX.len();

/// Most bytes of one file's metadata (names with their prefix, and values).
pub const MAX_TOTAL_LEN: usize = 4096;

/// The kernel's bound on a listing of attribute names and on one value (64 KiB).
const XATTR_MAX: usize = 65536;

/// Why a metadata set is refused, before anything is written.
pub fn validate(metadata: &BTreeMap<String, String>) -> Result<(), String> {
    let printable = |what: &str, s: &str| match s.bytes().position(|b| !(0x20..=0x7e).contains(&b))
    {
        Some(at) => Err(format!(
            "metadata {what} contains a byte that is not printable ASCII (0x{:02x} at offset {at})",
            s.as_bytes()[at]
        )),
        None => Ok(()),
    };
    let mut total = 0;
    for (key, value) in metadata {
        if key.is_empty() {
            return Err("a metadata key is empty".into());
        }
        if key.len() > MAX_KEY_LEN {
            return Err(format!(
                "metadata key {key:?} is {} bytes, over the {MAX_KEY_LEN} an extended \
                 attribute's name leaves",
                key.len()
            ));
        }
        if key.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(format!("metadata key {key:?} is not lowercase"));
        }
        printable("key", key)?;
        printable(&format!("value of {key:?}"), value)?;
        total += PREFIX.len() + key.len() + value.len();
    }
    if total > MAX_TOTAL_LEN {
        return Err(format!(
            "the metadata is {total} bytes (names with their {PREFIX:?} prefix, and values), \
             over the {MAX_TOTAL_LEN} one file keeps"
        ));
    }
    Ok(())
}

/// Whether an attribute call failed because the filesystem keeps no user attributes.
fn unsupported(e: rustix::io::Errno) -> bool {
    e == rustix::io::Errno::OPNOTSUPP || e == rustix::io::Errno::NOSYS
}

/// Replaces the metadata of the open file `file` (at `path`, for the messages) with
/// `metadata`: attributes of the namespace absent from it are removed (a rewritten file
/// keeps its attributes across `O_TRUNC`, and must not keep an earlier upload's
/// metadata). An empty set on a filesystem without user attributes is nothing to do; a
/// non-empty one is an error.
pub fn replace(
    file: impl AsFd,
    path: &str,
    metadata: &BTreeMap<String, String>,
) -> Result<(), FileError> {
    let refused = |reason: String| FileError::Metadata {
        path: path.to_owned(),
        reason,
    };
    let failed = |e: rustix::io::Errno| match e {
        e if unsupported(e) => refused(NO_XATTRS.into()),
        e => FileError::os(path, e.into()),
    };
    validate(metadata).map_err(refused)?;
    let fd = file.as_fd();
    let mut names = vec![0u8; XATTR_MAX];
    let listed = match rustix::fs::flistxattr(fd, &mut names[..]) {
        Ok(n) => n,
        Err(e) if unsupported(e) && metadata.is_empty() => return Ok(()),
        Err(e) => return Err(failed(e)),
    };
    for name in names[..listed].split(|b| *b == 0) {
        let Some(key) = name.strip_prefix(PREFIX.as_bytes()) else {
            continue;
        };
        if std::str::from_utf8(key).is_ok_and(|k| metadata.contains_key(k)) {
            continue;
        }
        match rustix::fs::fremovexattr(fd, name) {
            Ok(()) | Err(rustix::io::Errno::NODATA) => {}
            Err(e) => return Err(failed(e)),
        }
    }
    for (key, value) in metadata {
        let name = format!("{PREFIX}{key}");
        rustix::fs::fsetxattr(fd, name.as_str(), value.as_bytes(), XattrFlags::empty())
            .map_err(failed)?;
    }
    Ok(())
}

const NO_XATTRS: &str = "its filesystem keeps no user extended attributes, where file \
    metadata is stored: write it on the sandbox's own filesystem, or keep the metadata \
    beside the file";

/// The metadata of the entry at `path`, its last component not followed (for the
/// entries of a listing, named through their directory's descriptor).
pub fn read_nofollow<P: rustix::path::Arg + Copy>(path: P) -> BTreeMap<String, String> {
    read_with(
        |buf| rustix::fs::llistxattr(path, buf),
        |name, buf| rustix::fs::lgetxattr(path, name, buf),
    )
}

/// The metadata of what `path` leads to (a descriptor's `/proc/self/fd/N`, followed).
pub fn read_following<P: rustix::path::Arg + Copy>(path: P) -> BTreeMap<String, String> {
    read_with(
        |buf| rustix::fs::listxattr(path, buf),
        |name, buf| rustix::fs::getxattr(path, name, buf),
    )
}

fn read_with(
    list: impl Fn(&mut [u8]) -> rustix::io::Result<usize>,
    get: impl Fn(&[u8], &mut [u8]) -> rustix::io::Result<usize>,
) -> BTreeMap<String, String> {
    let mut metadata = BTreeMap::new();
    let Some(names) = fetch(list) else {
        return metadata;
    };
    for name in names.split(|b| *b == 0) {
        let Some(key) = name.strip_prefix(PREFIX.as_bytes()) else {
            continue;
        };
        let Ok(key) = std::str::from_utf8(key) else {
            continue;
        };
        let Some(value) = fetch(|buf| get(name, buf)) else {
            continue;
        };
        if let Ok(v) = String::from_utf8(value) {
            metadata.insert(key.to_owned(), v);
        }
    }
    metadata
}

/// What an attribute call returns: most files have no attributes or short ones, so a
/// small buffer first, the kernel's largest only when that is too short.
fn fetch(call: impl Fn(&mut [u8]) -> rustix::io::Result<usize>) -> Option<Vec<u8>> {
    for size in [256, XATTR_MAX] {
        let mut buf = vec![0u8; size];
        match call(&mut buf[..]) {
            Ok(n) => {
                buf.truncate(n);
                return Some(buf);
            }
            Err(rustix::io::Errno::RANGE) => {}
            Err(_) => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn limits_are_envds() {
        assert!(validate(&set(&[("k", "v")])).is_ok());
        assert!(validate(&set(&[("", "v")])).is_err());
        assert!(validate(&set(&[("K", "v")])).is_err());
        assert!(validate(&set(&[("k", "caf\u{e9}")])).is_err());
        assert!(validate(&set(&[("k", "a\nb")])).is_err());
        assert!(validate(&set(&[(&"k".repeat(MAX_KEY_LEN), "")])).is_ok());
        assert!(validate(&set(&[(&"k".repeat(MAX_KEY_LEN + 1), "")])).is_err());
        let big = "v".repeat(MAX_TOTAL_LEN - PREFIX.len() - 1);
        assert!(validate(&set(&[("k", &big)])).is_ok());
        assert!(validate(&set(&[("k", &format!("{big}v"))])).is_err());
    }

    #[test]
    fn a_set_replaces_the_last_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let file = std::fs::File::create(&path).unwrap();
        let p = path.to_str().unwrap();
        match replace(&file, p, &set(&[("a", "1"), ("b", "2")])) {
            Ok(()) => {}
            // tmpfs before Linux 6.6 keeps no user attributes: then it must say so.
            Err(FileError::Metadata { .. }) => return,
            Err(e) => panic!("{e}"),
        }
        rustix::fs::setxattr(p, "user.other", b"x", XattrFlags::empty()).unwrap();
        assert_eq!(read_nofollow(p), set(&[("a", "1"), ("b", "2")]));
        replace(&file, p, &set(&[("b", "3")])).unwrap();
        assert_eq!(read_following(p), set(&[("b", "3")]));
        replace(&file, p, &BTreeMap::new()).unwrap();
        assert!(read_nofollow(p).is_empty());
        // Attributes outside the namespace are not the metadata's to remove.
        let mut buf = [0u8; 8];
        assert_eq!(
            rustix::fs::getxattr(p, "user.other", &mut buf[..]).unwrap(),
            1
        );
    }
}
