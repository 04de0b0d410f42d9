//! Which programs an image has, read from its layers on the host, so that a request for a
//! language whose runtime the image lacks is answered with the runtime's name at once,
//! instead of as a compile error from `bash: g++: command not found`.
//!
//! Lookups follow overlayfs over the image's layers (topmost first): a whiteout (a 0:0
//! character device) hides what is below it, an opaque directory hides the directories
//! below it, and symbolic links are resolved in the merged view — never on the host, so a
//! link to `/usr/bin` in a layer means the image's `/usr/bin`.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::Metadata;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

/// Links followed in one lookup before giving up (the kernel's own limit).
const MAX_LINKS: usize = 40;

/// An image's read-only layers, topmost first.
pub(crate) struct Layers<'a>(pub &'a [PathBuf]);

impl Layers<'_> {
    /// Whether `program` is an existing file (links followed) in one of `path_dirs`.
    pub(crate) fn has_program(&self, path_dirs: &str, program: &str) -> bool {
        path_dirs
            .split(':')
            .filter(|d| d.starts_with('/'))
            .any(|d| self.has_file(&format!("{d}/{program}")))
    }

    /// Whether the absolute `path` names an existing non-directory, links followed.
    pub(crate) fn has_file(&self, path: &str) -> bool {
        self.resolve(Path::new(path)).is_some_and(|m| !m.is_dir())
    }

    /// The metadata of what `path` leads to in the merged view, links followed.
    fn resolve(&self, path: &Path) -> Option<Metadata> {
        let mut todo: VecDeque<OsString> = parts(path).collect();
        let mut done = PathBuf::new();
        let mut links = 0;
        let mut last = None;
        while let Some(part) = todo.pop_front() {
            if part == ".." {
                done.pop();
                continue;
            }
            let next = done.join(&part);
            let (host, meta) = self.lstat(&next)?;
            if meta.file_type().is_symlink() {
                links += 1;
                if links > MAX_LINKS {
                    return None;
                }
                let target = std::fs::read_link(&host).ok()?;
                if target.is_absolute() {
                    done = PathBuf::new();
                }
                for p in parts(&target).collect::<Vec<_>>().into_iter().rev() {
                    todo.push_front(p);
                }
                continue;
            }
            if !todo.is_empty() && !meta.is_dir() {
                return None;
            }
            done = next;
            last = Some(meta);
        }
        last
    }

    /// `lstat` of `rel` (relative to the root, every directory on the way a real one) in
    /// the merged view: the host path where it was found and its metadata.
    fn lstat(&self, rel: &Path) -> Option<(PathBuf, Metadata)> {
        let parts: Vec<OsString> = parts(rel).collect();
        for layer in self.0 {
            let mut host = layer.clone();
            let mut opaque = false;
            for (i, part) in parts.iter().enumerate() {
                host.push(part);
                // Every earlier part was a directory of this layer: nothing on the host
                // outside the layer is followed.
                let Ok(meta) = std::fs::symlink_metadata(&host) else {
                    break;
                };
                if meta.file_type().is_char_device() && meta.rdev() == 0 {
                    return None;
                }
                if i + 1 == parts.len() {
                    return Some((host, meta));
                }
                if !meta.is_dir() {
                    return None;
                }
                opaque |= xattr::get(&host, "trusted.overlay.opaque")
                    .ok()
                    .flatten()
                    .is_some_and(|v| v == b"y");
            }
            if opaque {
                return None;
            }
        }
        None
    }
}

/// The normal components of a path (`..` kept, `.` and the root dropped).
fn parts(path: &Path) -> impl Iterator<Item = OsString> + '_ {
    path.components().filter_map(|c| match c {
        Component::Normal(p) => Some(p.to_owned()),
        Component::ParentDir => Some(OsString::from("..")),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn overlay_rules_and_links_in_the_merged_view() {
        let tmp = tempfile::tempdir().unwrap();
        let (upper, lower) = (tmp.path().join("upper"), tmp.path().join("lower"));
        for d in ["usr/bin", "usr/lib/x", "opt/tool"] {
            std::fs::create_dir_all(lower.join(d)).unwrap();
        }
        std::fs::create_dir_all(upper.join("usr/bin")).unwrap();
        std::fs::write(lower.join("usr/bin/python3.11"), "").unwrap();
        std::fs::write(lower.join("usr/lib/x/gone"), "").unwrap();
        std::fs::write(lower.join("opt/tool/bin"), "").unwrap();
        // Merged /usr: /bin is a link to usr/bin, python a link to python3.11 below it.
        symlink("usr/bin", upper.join("bin")).unwrap();
        symlink("python3.11", upper.join("usr/bin/python")).unwrap();
        symlink("/usr/bin/missing", upper.join("usr/bin/dangling")).unwrap();
        // An absolute link is the image's path, not the host's.
        symlink("/usr/bin/python", upper.join("usr/bin/py")).unwrap();
        symlink("/etc/passwd", upper.join("usr/bin/host")).unwrap();
        let layers = [upper, lower];
        let image = Layers(&layers);
        assert!(image.has_file("/usr/bin/python3.11"));
        assert!(image.has_file("/bin/python"));
        assert!(image.has_file("/usr/bin/py"));
        assert!(!image.has_file("/usr/bin/dangling"));
        assert!(!image.has_file("/usr/bin/host"));
        assert!(image.has_program("/usr/local/bin:/bin", "python"));
        assert!(!image.has_program("/usr/local/bin:/bin", "ruby"));
        assert!(image.has_file("/usr/lib/x/gone"));
        assert!(image.has_file("/opt/tool/bin"));
    }

    #[test]
    fn whiteouts_and_opaque_directories_hide_what_is_below() {
        let tmp = tempfile::tempdir().unwrap();
        let (upper, lower) = (tmp.path().join("upper"), tmp.path().join("lower"));
        std::fs::create_dir_all(lower.join("usr/bin")).unwrap();
        std::fs::create_dir_all(lower.join("opt/a")).unwrap();
        std::fs::write(lower.join("usr/bin/gcc"), "").unwrap();
        std::fs::write(lower.join("opt/a/f"), "").unwrap();
        std::fs::create_dir_all(upper.join("usr/bin")).unwrap();
        std::fs::create_dir_all(upper.join("opt/a")).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            upper.join("usr/bin/gcc"),
            rustix::fs::FileType::CharacterDevice,
            rustix::fs::Mode::empty(),
            0,
        )
        .unwrap();
        let layers = [upper.clone(), lower];
        assert!(!Layers(&layers).has_file("/usr/bin/gcc"));
        assert!(Layers(&layers).has_file("/opt/a/f"));
        xattr::set(upper.join("opt/a"), "trusted.overlay.opaque", b"y").unwrap();
        assert!(!Layers(&layers).has_file("/opt/a/f"));
    }
}
