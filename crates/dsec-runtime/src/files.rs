//! File operations on a running sandbox, done by the edge without entering it.
//!
//! The edge opens `/proc/<init>/root` — the sandbox's root as its init sees it, mounts
//! included — and resolves every path beneath it with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_MAGICLINKS)`: the kernel refuses any resolution that would leave that
//! directory, through `..` or through a symbolic link (absolute links included), so a
//! link an agent planted cannot redirect the edge to a host file. No round trip to init
//! is needed, and file traffic never competes with command output on the channel.
//!
//! A VM guest's agent runs the same code against its own root ([`SandboxRoot::at`]), and
//! sends failures back as [`FileFault`]s, so both backends answer alike.

use std::borrow::Cow;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{Mode, OFlags, ResolveFlags};
use serde::{Deserialize, Serialize};

/// A file operation failed.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The path is not absolute, or climbs above `/`.
    #[error("invalid path {path:?}: {reason}")]
    InvalidPath {
        /// The path as given.
        path: String,
        /// What is wrong with it.
        reason: Cow<'static, str>,
    },
    /// Resolution would leave the sandbox's root.
    #[error("path {0:?} escapes the sandbox's root through '..' or a symbolic link")]
    Escapes(String),
    /// Nothing at that path.
    #[error("no such file or directory in the sandbox: {0:?}")]
    NotFound(String),
    /// A directory where a file was expected, or the reverse.
    #[error("{path:?}: {reason}")]
    WrongType {
        /// The path as given.
        path: String,
        /// What was expected.
        reason: Cow<'static, str>,
    },
    /// The writable layer is full.
    #[error("no space left in the sandbox's writable layer writing {0:?}")]
    NoSpace(String),
    /// Any other OS error.
    #[error("{path:?}: {source}")]
    Io {
        /// The path as given.
        path: String,
        /// The OS error.
        source: io::Error,
    },
}

/// An entry of a directory listing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// File name.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Whether it is a directory.
    pub is_dir: bool,
    /// Permission bits.
    pub mode: u32,
}

/// A [`FileError`] as it crosses a VM guest's channel (the path travels separately).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FileFault {
    /// [`FileError::InvalidPath`].
    InvalidPath {
        /// What is wrong with the path.
        reason: String,
    },
    /// [`FileError::Escapes`].
    Escapes,
    /// [`FileError::NotFound`].
    NotFound,
    /// [`FileError::WrongType`].
    WrongType {
        /// What was expected.
        reason: String,
    },
    /// [`FileError::NoSpace`].
    NoSpace,
    /// [`FileError::Io`].
    Io {
        /// The OS error number, if there was one.
        errno: Option<i32>,
        /// The OS error's message.
        message: String,
    },
}

impl FileError {
    /// This error in its wire form.
    pub fn fault(&self) -> FileFault {
        match self {
            FileError::InvalidPath { reason, .. } => FileFault::InvalidPath {
                reason: reason.to_string(),
            },
            FileError::Escapes(_) => FileFault::Escapes,
            FileError::NotFound(_) => FileFault::NotFound,
            FileError::WrongType { reason, .. } => FileFault::WrongType {
                reason: reason.to_string(),
            },
            FileError::NoSpace(_) => FileFault::NoSpace,
            FileError::Io { source, .. } => FileFault::Io {
                errno: source.raw_os_error(),
                message: source.to_string(),
            },
        }
    }

    /// The error a guest reported for `path`.
    pub fn from_fault(path: &str, fault: FileFault) -> FileError {
        let path = path.to_owned();
        match fault {
            FileFault::InvalidPath { reason } => FileError::InvalidPath {
                path,
                reason: reason.into(),
            },
            FileFault::Escapes => FileError::Escapes(path),
            FileFault::NotFound => FileError::NotFound(path),
            FileFault::WrongType { reason } => FileError::WrongType {
                path,
                reason: reason.into(),
            },
            FileFault::NoSpace => FileError::NoSpace(path),
            FileFault::Io { errno, message } => FileError::Io {
                path,
                source: match errno {
                    Some(errno) => io::Error::from_raw_os_error(errno),
                    None => io::Error::other(message),
                },
            },
        }
    }
}

/// The root of one sandbox, seen from the host.
#[derive(Clone, Debug)]
pub struct SandboxRoot {
    proc_root: PathBuf,
}

const RESOLVE: ResolveFlags = ResolveFlags::BENEATH.union(ResolveFlags::NO_MAGICLINKS);

impl SandboxRoot {
    /// The root of the sandbox whose init has host pid `pid`.
    pub fn of_pid(pid: i32) -> SandboxRoot {
        SandboxRoot {
            proc_root: PathBuf::from(format!("/proc/{pid}/root")),
        }
    }

    /// The directory `root` (a VM guest's agent serves files beneath `/`).
    pub fn at(root: impl Into<PathBuf>) -> SandboxRoot {
        SandboxRoot {
            proc_root: root.into(),
        }
    }

    fn open_root(&self) -> io::Result<OwnedFd> {
        Ok(rustix::fs::open(
            &self.proc_root,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?)
    }

    /// Opens a file for reading.
    pub fn open_read(&self, path: &str) -> Result<File, FileError> {
        let rel = relative(path)?;
        let root = self.open_root().map_err(|e| map_err(path, e))?;
        let fd = openat2(&root, &rel, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| map_err(path, e))?;
        let file = File::from(fd);
        if file.metadata().map_err(|e| map_err(path, e))?.is_dir() {
            return Err(FileError::WrongType {
                path: path.to_owned(),
                reason: "is a directory; use list_files".into(),
            });
        }
        Ok(file)
    }

    /// Writes `data` to `path`, creating missing parent directories (mode 0755).
    pub fn write(&self, path: &str, data: &[u8], mode: u32) -> Result<(), FileError> {
        let rel = relative(path)?;
        let name = rel.file_name().ok_or(FileError::InvalidPath {
            path: path.to_owned(),
            reason: "names a directory".into(),
        })?;
        let mut dir = self.open_root().map_err(|e| map_err(path, e))?;
        for comp in rel.parent().into_iter().flat_map(Path::components) {
            let comp = comp.as_os_str();
            dir = match openat2(
                &dir,
                Path::new(comp),
                OFlags::PATH | OFlags::DIRECTORY,
                Mode::empty(),
            ) {
                Ok(fd) => fd,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    match rustix::fs::mkdirat(&dir, comp, Mode::from_raw_mode(0o755)) {
                        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                        Err(e) => return Err(map_err(path, e.into())),
                    }
                    openat2(
                        &dir,
                        Path::new(comp),
                        OFlags::PATH | OFlags::DIRECTORY,
                        Mode::empty(),
                    )
                    .map_err(|e| map_err(path, e))?
                }
                Err(e) => return Err(map_err(path, e)),
            };
        }
        let fd = openat2(
            &dir,
            Path::new(name),
            OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode & 0o7777),
        )
        .map_err(|e| map_err(path, e))?;
        // The server's umask must not change the mode the caller asked for.
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode & 0o7777))
            .map_err(|e| map_err(path, e.into()))?;
        let mut file = File::from(fd);
        io::Write::write_all(&mut file, data).map_err(|e| map_err(path, e))?;
        Ok(())
    }

    /// Lists a directory, sorted by name.
    pub fn list(&self, path: &str) -> Result<Vec<Entry>, FileError> {
        let rel = relative(path)?;
        let root = self.open_root().map_err(|e| map_err(path, e))?;
        let target = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel.as_path()
        };
        let fd = openat2(
            &root,
            target,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENOTDIR) => FileError::WrongType {
                path: path.to_owned(),
                reason: "is not a directory".into(),
            },
            _ => map_err(path, e),
        })?;
        let mut entries = Vec::new();
        for entry in rustix::fs::Dir::read_from(&fd).map_err(|e| map_err(path, e.into()))? {
            let entry = entry.map_err(|e| map_err(path, e.into()))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name == "." || name == ".." {
                continue;
            }
            let Ok(stat) = rustix::fs::statat(
                &fd,
                entry.file_name(),
                rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
            ) else {
                continue;
            };
            let file_type = rustix::fs::FileType::from_raw_mode(stat.st_mode);
            entries.push(Entry {
                name,
                size: stat.st_size as u64,
                is_dir: file_type == rustix::fs::FileType::Directory,
                mode: stat.st_mode & 0o7777,
            });
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(entries)
    }
}

fn openat2(dir: impl AsFd, path: &Path, flags: OFlags, mode: Mode) -> io::Result<OwnedFd> {
    loop {
        match rustix::fs::openat2(&dir, path, flags | OFlags::CLOEXEC, mode, RESOLVE) {
            Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => continue,
            other => return other.map_err(Into::into),
        }
    }
}

/// Checks that `path` is absolute and stays inside `/` lexically, and makes it relative
/// to the root.
pub fn relative(path: &str) -> Result<PathBuf, FileError> {
    let invalid = |reason: &'static str| FileError::InvalidPath {
        path: path.to_owned(),
        reason: reason.into(),
    };
    if path.contains('\0') {
        return Err(invalid("contains a NUL byte"));
    }
    let p = Path::new(path);
    if !p.is_absolute() {
        return Err(invalid("must be absolute"));
    }
    let mut out = PathBuf::new();
    for comp in p.components() {
        match comp {
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return Err(FileError::Escapes(path.to_owned()));
                }
            }
            Component::Normal(c) => out.push(c),
            Component::Prefix(_) => return Err(invalid("has a prefix")),
        }
    }
    Ok(out)
}

fn map_err(path: &str, e: io::Error) -> FileError {
    match e.raw_os_error() {
        Some(libc::ENOENT) => FileError::NotFound(path.to_owned()),
        Some(libc::EXDEV) | Some(libc::ELOOP) => FileError::Escapes(path.to_owned()),
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => FileError::NoSpace(path.to_owned()),
        Some(libc::EISDIR) => FileError::WrongType {
            path: path.to_owned(),
            reason: "is a directory".into(),
        },
        Some(libc::ENOTDIR) => FileError::WrongType {
            path: path.to_owned(),
            reason: "a parent is not a directory".into(),
        },
        _ => FileError::Io {
            path: path.to_owned(),
            source: e,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lexical_escape_is_refused() {
        assert!(matches!(relative("/../etc"), Err(FileError::Escapes(_))));
        assert!(matches!(
            relative("etc"),
            Err(FileError::InvalidPath { .. })
        ));
        assert_eq!(relative("/a/./b/../c").unwrap(), PathBuf::from("a/c"));
    }

    #[test]
    fn symlinks_out_of_the_root_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir(&root).unwrap();
        std::fs::write(tmp.path().join("secret"), b"host").unwrap();
        std::os::unix::fs::symlink("../secret", root.join("rel")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("abs")).unwrap();
        let sb = SandboxRoot::at(&root);
        assert!(matches!(sb.open_read("/rel"), Err(FileError::Escapes(_))));
        assert!(matches!(
            sb.open_read("/abs/passwd"),
            Err(FileError::Escapes(_))
        ));
        assert!(matches!(
            sb.write("/abs/x", b"no", 0o644),
            Err(FileError::Escapes(_))
        ));
    }

    #[test]
    fn write_creates_parents_and_list_reports_them() {
        let tmp = tempfile::tempdir().unwrap();
        let sb = SandboxRoot::at(tmp.path());
        sb.write("/a/b/c.txt", b"hello", 0o600).unwrap();
        let mut content = String::new();
        io::Read::read_to_string(&mut sb.open_read("/a/b/c.txt").unwrap(), &mut content).unwrap();
        assert_eq!(content, "hello");
        let listing = sb.list("/a").unwrap();
        assert_eq!(listing.len(), 1);
        assert!(listing[0].is_dir);
        let files = sb.list("/a/b").unwrap();
        assert_eq!(
            files,
            vec![Entry {
                name: "c.txt".into(),
                size: 5,
                is_dir: false,
                mode: 0o600
            }]
        );
        assert!(matches!(
            sb.open_read("/a"),
            Err(FileError::WrongType { .. })
        ));
        assert!(matches!(sb.open_read("/nope"), Err(FileError::NotFound(_))));
    }
}
