//! File operations on a sandbox, done inside it.
//!
//! The edge never touches a sandbox's files itself. A process in the sandbox — a
//! container's init, a VM guest's agent, a fncall call's first process — opens them and
//! answers the edge over the control channel ([`service`] on that side, [`client`] on the
//! edge's). File operations thus run in the sandbox's mount and pid namespaces, with its
//! reduced capability set, no_new_privs and seccomp filter, and see the sandbox's own
//! `/proc`: nothing the files API does exceeds what a command of the sandbox could do,
//! and nothing of the host (its environment, its kernel's addresses) can be read through it.
//!
//! Within the sandbox the rules are stricter than for a command, because the caller — a
//! grader, a trainer — trusts what it gets and must never hang on what an agent planted:
//! - a path is resolved from the root with `openat2(RESOLVE_BENEATH |
//!   RESOLVE_NO_MAGICLINKS)`: `..` above `/`, absolute symbolic links and `/proc` magic
//!   links are refused, whatever the agent made of the path;
//! - only regular files and directories are served, on an allow-list of filesystem types
//!   ([`ALLOWED_FILESYSTEMS`]: never procfs, sysfs, devpts, cgroupfs, debugfs, tracefs,
//!   securityfs, bpffs, mqueue...), and never anything on the sandbox's `/dev` (its tmpfs,
//!   told by `st_dev`);
//! - race-free: the path is opened `O_PATH` (which opens nothing), that descriptor is
//!   checked with `fstat` and `fstatfs`, and only then reopened for reading or writing
//!   through `/proc/self/fd` with `O_NONBLOCK | O_NOCTTY`. A FIFO, a tty or a device is
//!   never opened, so nothing blocks and no open has a side effect; a swap of the path
//!   after the check cannot change which inode is reopened. A missing file is created
//!   `O_CREAT | O_EXCL | O_NOFOLLOW`, so the create cannot land on anything else either;
//! - bounded: reads stop at a size the edge gives, listings at an entry count, and the
//!   in-sandbox side holds a bounded number of open transfers ([`service`]);
//! - `stat`, `mkdir`, `move` and `remove` resolve a path's parent as a read does and act on
//!   its last component without following it: a symbolic link is reported, moved or
//!   removed itself, never its target; a recursive remove never follows a link nor
//!   crosses into another filesystem, and the root is never moved or removed;
//! - watches ([`watch`]) open the directory as a listing does and watch that inode;
//! - metadata ([`metadata`], E2B's `user.e2b.*` extended attributes) is set on the
//!   descriptor a write opened, and read through the descriptors a listing or `stat`
//!   already holds (`/proc/self/fd/N`, the last component not followed), never by path.

pub mod client;
mod identity;
pub mod metadata;
pub mod service;
pub mod watch;

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use serde::{Deserialize, Serialize};

/// What the caller was doing, for the messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileOp {
    /// `read_file`.
    Read,
    /// `write_file`.
    Write,
    /// `list_files`.
    List,
    /// `stat`.
    Stat,
    /// `mkdir`.
    MakeDir,
    /// `move`.
    Move,
    /// `remove`.
    Remove,
    /// `watch`.
    Watch,
}

impl FileOp {
    fn past(self) -> &'static str {
        match self {
            FileOp::Read => "read",
            FileOp::Write => "written",
            FileOp::List => "listed",
            FileOp::Stat => "examined",
            FileOp::MakeDir => "made",
            FileOp::Move => "moved",
            FileOp::Remove => "removed",
            FileOp::Watch => "watched",
        }
    }
}

/// Why a path that exists is not served.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "refusal", rename_all = "snake_case")]
pub enum Refusal {
    /// A FIFO.
    Fifo,
    /// A unix socket.
    Socket,
    /// A character device (`/dev/zero`, a tty...).
    CharDevice,
    /// A block device.
    BlockDevice,
    /// On a filesystem the files API does not serve (procfs, sysfs...).
    Filesystem {
        /// Its name, or its magic number.
        name: String,
    },
    /// On the sandbox's `/dev`.
    SandboxDev,
    /// A symbolic link whose target does not exist (a write would have to create it
    /// through the link).
    DanglingLink,
    /// The path crosses a `/proc` magic link, or too many symbolic links.
    MagicLink,
}

impl Refusal {
    /// The `reason` label of `dsec_file_refused_total`.
    pub fn label(&self) -> &'static str {
        match self {
            Refusal::Fifo => "fifo",
            Refusal::Socket => "socket",
            Refusal::CharDevice => "char_device",
            Refusal::BlockDevice => "block_device",
            Refusal::Filesystem { .. } => "filesystem",
            Refusal::SandboxDev => "sandbox_dev",
            Refusal::DanglingLink => "dangling_link",
            Refusal::MagicLink => "magic_link",
        }
    }
}

/// A file operation failed. Serializable: a sandbox's side sends it to the edge as is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FileError {
    /// The path is not absolute, or is otherwise malformed.
    #[error("invalid path {path:?}: {reason}")]
    InvalidPath {
        /// The path as given.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Resolution would leave the sandbox's root.
    #[error(
        "path {path:?} escapes the sandbox's root through '..' or a symbolic link \
         (absolute symbolic links included)"
    )]
    Escapes {
        /// The path as given.
        path: String,
    },
    /// Nothing at that path.
    #[error("no such file or directory in the sandbox: {path:?}")]
    NotFound {
        /// The path as given.
        path: String,
    },
    /// Something is already there.
    #[error("{path:?} {reason}")]
    Exists {
        /// The path as given.
        path: String,
        /// What is there, and how to replace it.
        reason: String,
    },
    /// A directory where a file was expected, or the reverse.
    #[error("{path:?} {reason}")]
    WrongType {
        /// The path as given.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// Something the files API never serves (see the module docs).
    #[error("{}", refused_message(path, *op, refusal, link.as_deref()))]
    Refused {
        /// The path as given.
        path: String,
        /// What was asked.
        op: FileOp,
        /// Why not.
        #[serde(flatten)]
        refusal: Refusal,
        /// The target of the symbolic link the path named, if it was one.
        link: Option<String>,
    },
    /// Over the server's size or count limit.
    #[error("{path:?} {what}")]
    TooLarge {
        /// The path as given.
        path: String,
        /// What was asked.
        op: FileOp,
        /// What was too large, with the limit and the option that sets it.
        what: String,
    },
    /// The sandbox has too many transfers open.
    #[error("{path:?}: the sandbox has {limit} file transfers open already; retry when one ends")]
    Busy {
        /// The path as given.
        path: String,
        /// The limit.
        limit: usize,
    },
    /// The sandbox has too many watches open.
    #[error(
        "{path:?}: the sandbox has {limit} watches open already; end one (close its stream) first"
    )]
    TooManyWatches {
        /// The path as given.
        path: String,
        /// The limit.
        limit: usize,
    },
    /// The user the operation runs as may not do it (`EACCES`, `EPERM`).
    #[error(
        "permission denied on {path:?}: the user the request runs as may not do this \
         (the sandbox's file modes and owners decide, as for a command as that user)"
    )]
    PermissionDenied {
        /// The path as given.
        path: String,
    },
    /// The writable layer is full.
    #[error("no space left in the sandbox's writable layer writing {path:?}")]
    NoSpace {
        /// The path as given.
        path: String,
    },
    /// Metadata was asked for a file whose filesystem keeps no user extended
    /// attributes ([`metadata`]), or the metadata is malformed.
    #[error("metadata of {path:?}: {reason}")]
    Metadata {
        /// The path as given.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// Any other OS error.
    #[error("{path:?}: {message}")]
    Io {
        /// The path as given.
        path: String,
        /// The OS error number, if there was one.
        errno: Option<i32>,
        /// The OS error's message.
        message: String,
    },
}

fn refused_message(path: &str, op: FileOp, refusal: &Refusal, link: Option<&str>) -> String {
    let through = link.map_or_else(String::new, |l| {
        format!(" (through a symbolic link to {l})")
    });
    let wanted = match op {
        FileOp::List | FileOp::Watch => "directories",
        FileOp::Read | FileOp::Write => "regular files",
        FileOp::Stat | FileOp::MakeDir | FileOp::Move | FileOp::Remove => {
            "regular files, directories and symbolic links"
        }
    };
    let kind = |what: &str| {
        format!(
            "{path} is {what}{through}: only {wanted} can be {}",
            op.past()
        )
    };
    match refusal {
        Refusal::Fifo => kind("a FIFO"),
        Refusal::Socket => kind("a socket"),
        Refusal::CharDevice => kind("a character device"),
        Refusal::BlockDevice => kind("a block device"),
        Refusal::Filesystem { name } => format!(
            "{path} is on {name}{through}: the files API serves the sandbox's own files \
             (overlayfs, tmpfs, ext4, xfs, btrfs, erofs...), not kernel interfaces; \
             run a command to read it"
        ),
        Refusal::SandboxDev => {
            format!("{path} is in the sandbox's /dev{through}: the files API does not serve it")
        }
        Refusal::DanglingLink => format!(
            "{path} is a symbolic link to {}, which does not exist: write to the link's \
             target instead",
            link.unwrap_or("a missing file")
        ),
        Refusal::MagicLink => {
            format!("{path} passes through a /proc magic link or more than 40 symbolic links")
        }
    }
}

impl FileError {
    /// An OS error on `path`, mapped to the variant a caller can act on.
    pub fn os(path: &str, e: io::Error) -> FileError {
        let path = path.to_owned();
        match e.raw_os_error() {
            Some(libc::ENOENT) => FileError::NotFound { path },
            Some(libc::EXDEV) => FileError::Escapes { path },
            Some(libc::ELOOP) => FileError::Refused {
                path,
                op: FileOp::Read,
                refusal: Refusal::MagicLink,
                link: None,
            },
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => FileError::NoSpace { path },
            Some(libc::EACCES) | Some(libc::EPERM) => FileError::PermissionDenied { path },
            Some(libc::EISDIR) => FileError::WrongType {
                path,
                reason: "is a directory".into(),
            },
            Some(libc::ENOTDIR) => FileError::WrongType {
                path,
                reason: "has a parent that is not a directory".into(),
            },
            errno => FileError::Io {
                path,
                errno,
                message: e.to_string(),
            },
        }
    }

    /// The label of `dsec_file_refused_total` when this error is a refusal or a limit
    /// (what an operator wants to see), `None` for ordinary failures.
    pub fn refusal_label(&self) -> Option<&'static str> {
        match self {
            FileError::Refused { refusal, .. } => Some(refusal.label()),
            FileError::Escapes { .. } => Some("escapes"),
            FileError::TooLarge { .. } => Some("too_large"),
            FileError::Busy { .. } => Some("busy"),
            FileError::TooManyWatches { .. } => Some("watches"),
            _ => None,
        }
    }

    /// The path the error is about.
    pub fn path(&self) -> &str {
        match self {
            FileError::InvalidPath { path, .. }
            | FileError::Escapes { path }
            | FileError::NotFound { path }
            | FileError::Exists { path, .. }
            | FileError::WrongType { path, .. }
            | FileError::Refused { path, .. }
            | FileError::TooLarge { path, .. }
            | FileError::Busy { path, .. }
            | FileError::TooManyWatches { path, .. }
            | FileError::Metadata { path, .. }
            | FileError::NoSpace { path }
            | FileError::PermissionDenied { path }
            | FileError::Io { path, .. } => path,
        }
    }
}

/// What an entry is. Only files and directories are read, written or listed; the others
/// are reported by listings and `stat`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link (never followed by a listing or `stat`).
    Symlink,
    /// A FIFO, a socket or a device.
    Other,
}

/// An entry of a directory listing, or the status of one path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// File name.
    pub name: String,
    /// Path relative to the listed directory (the name, at depth 1); for `stat`, the
    /// absolute path asked.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Whether it is a directory.
    pub is_dir: bool,
    /// Permission bits.
    pub mode: u32,
    /// What it is.
    pub kind: EntryKind,
    /// Last modification, seconds since the epoch.
    pub mtime: i64,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// A symbolic link's target.
    pub link: Option<String>,
    /// A file's or directory's metadata ([`metadata`]: its `user.e2b.*` attributes).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub metadata: std::collections::BTreeMap<String, String>,
}

impl Entry {
    /// The entry of an inode of status `stat`, named `name` and shown at `path`; `link`
    /// is its target when it is a symbolic link.
    fn new(name: String, path: String, stat: &rustix::fs::Stat, link: Option<String>) -> Entry {
        let kind = match FileType::from_raw_mode(stat.st_mode) {
            FileType::RegularFile => EntryKind::File,
            FileType::Directory => EntryKind::Dir,
            FileType::Symlink => EntryKind::Symlink,
            _ => EntryKind::Other,
        };
        Entry {
            name,
            path,
            size: size(stat),
            is_dir: kind == EntryKind::Dir,
            mode: stat.st_mode & 0o7777,
            kind,
            mtime: stat.st_mtime,
            uid: stat.st_uid,
            gid: stat.st_gid,
            link,
            metadata: std::collections::BTreeMap::new(),
        }
    }

    /// Whether it may carry metadata: user attributes live on files and directories only.
    fn has_metadata(&self) -> bool {
        matches!(self.kind, EntryKind::File | EntryKind::Dir)
    }
}

/// Directories [`SandboxRoot::remove`] descends at most: deeper trees are refused.
const MAX_REMOVE_DEPTH: usize = 256;

/// Filesystems whose regular files and directories are served: what a sandbox's root,
/// writable layer and image layers are made of (`statfs(2)` magic numbers).
pub const ALLOWED_FILESYSTEMS: &[(u32, &str)] = &[
    (0x794c_7630, "overlayfs"),
    (0x0102_1994, "tmpfs"),
    (0x0000_ef53, "ext4"),
    (0x5846_5342, "xfs"),
    (0x9123_683e, "btrfs"),
    (0xe0f5_e1e2, "erofs"),
    (0x7371_7368, "squashfs"),
    (0x8584_58f6, "ramfs"),
    (0xf2f5_2010, "f2fs"),
];

/// Names of filesystems that are refused, for the messages.
const KNOWN_FILESYSTEMS: &[(u32, &str)] = &[
    (0x0000_9fa0, "procfs"),
    (0x6265_6572, "sysfs"),
    (0x0000_1cd1, "devpts"),
    (0x0027_e0eb, "cgroupfs"),
    (0x6367_7270, "cgroup2fs"),
    (0x6462_6720, "debugfs"),
    (0x7472_6163, "tracefs"),
    (0x7363_6673, "securityfs"),
    (0xcafe_4a11, "bpffs"),
    (0x1980_0202, "mqueue"),
    (0x6573_5546, "fuse"),
    (0x0000_6969, "nfs"),
    (0x4249_4e4d, "binfmt_misc"),
    (0x6e73_6673, "nsfs"),
];

const PROC_SUPER_MAGIC: u32 = 0x9fa0;

fn filesystem_name(magic: u32) -> String {
    KNOWN_FILESYSTEMS
        .iter()
        .chain(ALLOWED_FILESYSTEMS)
        .find(|(m, _)| *m == magic)
        .map_or_else(
            || format!("a filesystem of type {magic:#x}"),
            |(_, n)| (*n).to_owned(),
        )
}

const RESOLVE: ResolveFlags = ResolveFlags::BENEATH.union(ResolveFlags::NO_MAGICLINKS);

/// Flags of every reopen: never block, never take a controlling terminal.
const REOPEN: OFlags = OFlags::NONBLOCK
    .union(OFlags::NOCTTY)
    .union(OFlags::CLOEXEC);

/// A sandbox's root as seen by a process inside it (or a test's directory), with what
/// the checks need: the `/proc` that reopens descriptors and the `st_dev` of `/dev`.
#[derive(Debug)]
pub struct SandboxRoot {
    root: OwnedFd,
    proc_fd: OwnedFd,
    dev: Option<u64>,
}

impl SandboxRoot {
    /// The root `root` (`/` inside a sandbox). Descriptors are reopened through this
    /// process's own `/proc`, checked to be a procfs root.
    pub fn open(root: &Path) -> io::Result<SandboxRoot> {
        let dir = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let root_fd = rustix::fs::open(root, dir, Mode::empty())?;
        let proc_fd = rustix::fs::open("/proc", dir, Mode::empty())?;
        let proc_stat = rustix::fs::fstat(&proc_fd)?;
        if fs_magic(&rustix::fs::fstatfs(&proc_fd)?) != PROC_SUPER_MAGIC || proc_stat.st_ino != 1 {
            return Err(io::Error::other("/proc is not the root of a procfs"));
        }
        let root_dev = rustix::fs::fstat(&root_fd)?.st_dev;
        let dev = rustix::fs::statat(&root_fd, "dev", AtFlags::SYMLINK_NOFOLLOW)
            .ok()
            .map(|s| s.st_dev)
            .filter(|d| *d != root_dev);
        Ok(SandboxRoot {
            root: root_fd,
            proc_fd,
            dev,
        })
    }

    /// Opens a regular file for reading; refuses one larger than `max_bytes`. Returns
    /// the file and its size now.
    pub fn open_read(&self, path: &str, max_bytes: u64) -> Result<(File, u64), FileError> {
        let rel = relative(path)?;
        let fd = openat2(&self.root, target(&rel), OFlags::PATH, Mode::empty())
            .map_err(|e| FileError::os(path, e))?;
        let size = self
            .check(&fd, FileOp::Read)
            .map_err(|f| f.into_error(path, FileOp::Read, self.link_of(&rel)))?;
        if size > max_bytes {
            return Err(FileError::TooLarge {
                path: path.to_owned(),
                op: FileOp::Read,
                what: too_large(size, max_bytes),
            });
        }
        Ok((self.reopen(&fd, OFlags::RDONLY, path)?, size))
    }

    /// Opens `path` for writing from the start: an existing regular file is truncated, a
    /// missing one is created with `mode`, missing parent directories with mode 0755.
    /// The path resolves as for a read: symbolic links are followed while they stay
    /// beneath the root.
    pub fn open_write(&self, path: &str, mode: u32) -> Result<File, FileError> {
        let rel = relative(path)?;
        let name = rel.file_name().ok_or_else(|| FileError::InvalidPath {
            path: path.to_owned(),
            reason: "names a directory, not a file".into(),
        })?;
        let dir = self.parent(path, &rel, FileOp::Write)?;
        let mode = Mode::from_raw_mode(mode & 0o7777);
        // Each round either opens the file, or finds it missing and creates it; a path the
        // sandbox keeps swapping between the two is given up on.
        for _ in 0..8 {
            match openat2(&self.root, &rel, OFlags::PATH, Mode::empty()) {
                Ok(fd) => {
                    self.check(&fd, FileOp::Write)
                        .map_err(|f| f.into_error(path, FileOp::Write, link_target(&dir, name)))?;
                    let file = self.reopen(&fd, OFlags::WRONLY | OFlags::TRUNC, path)?;
                    return set_mode(file, mode, path);
                }
                Err(e) if e.raw_os_error() != Some(libc::ENOENT) => {
                    return Err(FileError::os(path, e))
                }
                Err(_) => {}
            }
            let create = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW;
            match openat2(&dir, Path::new(name), create | REOPEN, mode) {
                Ok(fd) => return set_mode(File::from(fd), mode, path),
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    // Missing, yet there: a link to nothing (or a racing create).
                    if let Some(target) = link_target(&dir, name) {
                        if openat2(&self.root, &rel, OFlags::PATH, Mode::empty())
                            .is_err_and(|e| e.raw_os_error() == Some(libc::ENOENT))
                        {
                            return Err(Fault::Refused(Refusal::DanglingLink).into_error(
                                path,
                                FileOp::Write,
                                Some(target),
                            ));
                        }
                    }
                }
                Err(e) => return Err(FileError::os(path, e)),
            }
        }
        Err(FileError::Io {
            path: path.to_owned(),
            errno: None,
            message: "the path kept changing while it was being opened".into(),
        })
    }

    /// Writes `data` to `path` as [`open_write`](Self::open_write) opens it.
    pub fn write_all(&self, path: &str, data: &[u8], mode: u32) -> Result<(), FileError> {
        let mut file = self.open_write(path, mode)?;
        io::Write::write_all(&mut file, data).map_err(|e| FileError::os(path, e))
    }

    /// Lists a directory `depth` levels deep (1: its own entries), sorted by path;
    /// refuses a listing of more than `max_entries`. Symbolic links are listed, never
    /// followed, and a subdirectory on another filesystem (a mount point) is listed but
    /// not entered.
    pub fn list(
        &self,
        path: &str,
        max_entries: usize,
        depth: u32,
    ) -> Result<Vec<Entry>, FileError> {
        let fd = self.open_dir(path, FileOp::List)?;
        let mut entries = Vec::new();
        let listing = Listing { path, max_entries };
        listing.read(&fd, "", depth.max(1), &mut entries)?;
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(entries)
    }

    /// Opens the directory `path` for reading, checked for `op` (a listing or a watch).
    pub(crate) fn open_dir(&self, path: &str, op: FileOp) -> Result<OwnedFd, FileError> {
        let rel = relative(path)?;
        // O_DIRECTORY: anything but a directory fails the lookup and is never opened.
        let fd = openat2(
            &self.root,
            target(&rel),
            OFlags::RDONLY | OFlags::DIRECTORY | REOPEN,
            Mode::empty(),
        )
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENOTDIR) => FileError::WrongType {
                path: path.to_owned(),
                reason: "is not a directory".into(),
            },
            _ => FileError::os(path, e),
        })?;
        self.check(&fd, op)
            .map_err(|f| f.into_error(path, op, self.link_of(&rel)))?;
        Ok(fd)
    }

    /// The status of `path`. A symbolic link in its last component is reported, not
    /// followed; the filesystems and the `/dev` the files API never serves are refused.
    pub fn stat(&self, path: &str) -> Result<Entry, FileError> {
        let rel = relative(path)?;
        let (fd, name) = match rel.file_name() {
            None => (
                openat2(&self.root, Path::new("."), OFlags::PATH, Mode::empty())
                    .map_err(|e| FileError::os(path, e))?,
                String::new(),
            ),
            Some(name) => {
                let dir = self.parent_of(path, &rel, FileOp::Stat)?;
                (
                    leaf(&dir, name).map_err(|e| FileError::os(path, e))?,
                    name.to_string_lossy().into_owned(),
                )
            }
        };
        let stat = rustix::fs::fstat(&fd).map_err(|e| FileError::os(path, e.into()))?;
        self.check_filesystem(&fd, stat.st_dev)
            .map_err(|f| f.into_error(path, FileOp::Stat, None))?;
        let link = (FileType::from_raw_mode(stat.st_mode) == FileType::Symlink)
            .then(|| link_target(&fd, ""))
            .flatten();
        let mut entry = Entry::new(name, path.to_owned(), &stat, link);
        if entry.has_metadata() {
            let fd_path = format!("/proc/self/fd/{}", fd.as_raw_fd());
            entry.metadata = metadata::read_following(fd_path.as_str());
        }
        Ok(entry)
    }

    /// Makes the directory `path` with `mode`, and with `parents` its missing parents
    /// (mode 0755). Returns whether it was made: an existing directory is `Ok(false)`
    /// with `exist_ok`, an error without.
    pub fn mkdir(
        &self,
        path: &str,
        mode: u32,
        parents: bool,
        exist_ok: bool,
    ) -> Result<bool, FileError> {
        let rel = relative(path)?;
        let exists = |is_dir: bool| {
            let reason = match is_dir {
                true => "is a directory already; pass exist_ok=True to accept one",
                false => "exists and is not a directory",
            };
            FileError::Exists {
                path: path.to_owned(),
                reason: reason.into(),
            }
        };
        let Some(name) = rel.file_name() else {
            return if exist_ok {
                Ok(false)
            } else {
                Err(exists(true))
            };
        };
        let dir = match parents {
            true => self.parent(path, &rel, FileOp::MakeDir)?,
            false => self.parent_of(path, &rel, FileOp::MakeDir)?,
        };
        let mode = Mode::from_raw_mode(mode & 0o7777);
        match rustix::fs::mkdirat(&dir, name, mode) {
            Ok(()) => {}
            Err(rustix::io::Errno::EXIST) => {
                let is_dir = openat2(
                    &self.root,
                    &rel,
                    OFlags::PATH | OFlags::DIRECTORY,
                    Mode::empty(),
                )
                .is_ok();
                return if is_dir && exist_ok {
                    Ok(false)
                } else {
                    Err(exists(is_dir))
                };
            }
            Err(e) => return Err(FileError::os(path, e.into())),
        }
        // The sandbox's umask must not change the mode the caller asked for.
        let made = rustix::fs::openat(
            &dir,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | REOPEN,
            Mode::empty(),
        )
        .map_err(|e| FileError::os(path, e.into()))?;
        rustix::fs::fchmod(&made, mode).map_err(|e| FileError::os(path, e.into()))?;
        Ok(true)
    }

    /// Renames `src` to `dst`, both resolved beneath the root; a symbolic link in `src`'s
    /// last component is moved itself. `dst`'s parent must exist. Without `overwrite`
    /// an existing `dst` is an error; with it, `dst` is replaced as `rename(2)` replaces
    /// (a file or link, or an empty directory by a directory).
    pub fn rename(&self, src: &str, dst: &str, overwrite: bool) -> Result<(), FileError> {
        let src_rel = relative(src)?;
        let dst_rel = relative(dst)?;
        let root = |path: &str| FileError::InvalidPath {
            path: path.to_owned(),
            reason: "is the sandbox's root, which cannot be moved or replaced".into(),
        };
        let src_name = src_rel.file_name().ok_or_else(|| root(src))?;
        let dst_name = dst_rel.file_name().ok_or_else(|| root(dst))?;
        let src_dir = self.parent_of(src, &src_rel, FileOp::Move)?;
        let moved = leaf(&src_dir, src_name).map_err(|e| FileError::os(src, e))?;
        let st_dev = rustix::fs::fstat(&moved)
            .map_err(|e| FileError::os(src, e.into()))?
            .st_dev;
        self.check_filesystem(&moved, st_dev)
            .map_err(|f| f.into_error(src, FileOp::Move, None))?;
        let dst_dir = self.parent_of(dst, &dst_rel, FileOp::Move)?;
        let flags = match overwrite {
            true => rustix::fs::RenameFlags::empty(),
            false => rustix::fs::RenameFlags::NOREPLACE,
        };
        rustix::fs::renameat_with(&src_dir, src_name, &dst_dir, dst_name, flags).map_err(|e| {
            let dst_error = |reason: &str| FileError::Exists {
                path: dst.to_owned(),
                reason: reason.to_owned(),
            };
            match e {
                rustix::io::Errno::EXIST if !overwrite => {
                    dst_error("exists; pass overwrite=True to replace it")
                }
                rustix::io::Errno::EXIST | rustix::io::Errno::NOTEMPTY => {
                    dst_error("is a directory that is not empty; remove it first")
                }
                rustix::io::Errno::ISDIR => {
                    dst_error("is a directory, which only a directory can replace")
                }
                rustix::io::Errno::NOTDIR => {
                    dst_error("is not a directory, which a directory cannot replace")
                }
                rustix::io::Errno::INVAL => FileError::InvalidPath {
                    path: dst.to_owned(),
                    reason: format!("is inside {src:?}, which cannot move into itself"),
                },
                rustix::io::Errno::XDEV => FileError::Io {
                    path: src.to_owned(),
                    errno: Some(libc::EXDEV),
                    message: format!(
                        "cannot be renamed to {dst:?}: another filesystem, or a directory \
                         of the image, which overlayfs cannot rename; copy it with a command"
                    ),
                },
                e => FileError::os(src, e.into()),
            }
        })
    }

    /// Removes the file, symbolic link (itself, never its target) or directory `path`;
    /// a directory that is not empty only with `recursive`, which never crosses into
    /// another filesystem. The root is never removed.
    pub fn remove(&self, path: &str, recursive: bool) -> Result<(), FileError> {
        let rel = relative(path)?;
        let name = rel.file_name().ok_or_else(|| FileError::InvalidPath {
            path: path.to_owned(),
            reason: "is the sandbox's root, which cannot be removed".into(),
        })?;
        let dir = self.parent_of(path, &rel, FileOp::Remove)?;
        let stat = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| FileError::os(path, e.into()))?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::Directory {
            return rustix::fs::unlinkat(&dir, name, AtFlags::empty())
                .map_err(|e| FileError::os(path, e.into()));
        }
        let fd = open_subdir(&dir, name).map_err(|e| FileError::os(path, e))?;
        self.check_filesystem(&fd, stat.st_dev)
            .map_err(|f| f.into_error(path, FileOp::Remove, None))?;
        if recursive {
            empty_dir(&fd, path, stat.st_dev, 0)?;
        }
        rustix::fs::unlinkat(&dir, name, AtFlags::REMOVEDIR).map_err(|e| match e {
            rustix::io::Errno::NOTEMPTY | rustix::io::Errno::EXIST => FileError::WrongType {
                path: path.to_owned(),
                reason: "is a directory that is not empty; pass recursive=True".into(),
            },
            rustix::io::Errno::BUSY => FileError::WrongType {
                path: path.to_owned(),
                reason: "is a mount point".into(),
            },
            e => FileError::os(path, e.into()),
        })
    }

    /// The directory holding `rel`'s last component, resolved as a read resolves (never
    /// made) and checked to be on a filesystem the files API serves.
    fn parent_of(&self, path: &str, rel: &Path, op: FileOp) -> Result<OwnedFd, FileError> {
        let parent = rel.parent().filter(|p| !p.as_os_str().is_empty());
        let dir = openat2(
            &self.root,
            parent.unwrap_or(Path::new(".")),
            OFlags::PATH | OFlags::DIRECTORY,
            Mode::empty(),
        )
        .map_err(|e| FileError::os(path, e))?;
        let st_dev = rustix::fs::fstat(&dir)
            .map_err(|e| FileError::os(path, e.into()))?
            .st_dev;
        self.check_filesystem(&dir, st_dev)
            .map_err(|f| f.into_error(path, op, None))?;
        Ok(dir)
    }

    /// Checks the inode behind `fd` (an `O_PATH` or directory descriptor) for `op`;
    /// returns its size.
    fn check(&self, fd: &OwnedFd, op: FileOp) -> Result<u64, Fault> {
        let stat = rustix::fs::fstat(fd).map_err(|e| Fault::Os(e.into()))?;
        let wrong = |reason: &str| Fault::WrongType(reason.to_owned());
        match (FileType::from_raw_mode(stat.st_mode), op) {
            (FileType::RegularFile, FileOp::Read | FileOp::Write) => {}
            (FileType::Directory, FileOp::List | FileOp::Watch) => {}
            (FileType::Directory, FileOp::Read) => {
                return Err(wrong("is a directory; use list_files"))
            }
            (FileType::Directory, _) => return Err(wrong("is a directory")),
            (FileType::RegularFile, _) => return Err(wrong("is not a directory")),
            (FileType::Fifo, _) => return Err(Fault::Refused(Refusal::Fifo)),
            (FileType::Socket, _) => return Err(Fault::Refused(Refusal::Socket)),
            (FileType::CharacterDevice, _) => return Err(Fault::Refused(Refusal::CharDevice)),
            (FileType::BlockDevice, _) => return Err(Fault::Refused(Refusal::BlockDevice)),
            // O_PATH without O_NOFOLLOW never stops at a symbolic link.
            (_, _) => return Err(wrong("is of an unknown type")),
        }
        self.check_filesystem(fd, stat.st_dev)?;
        Ok(size(&stat))
    }

    fn check_filesystem(&self, fd: &OwnedFd, st_dev: u64) -> Result<(), Fault> {
        let magic = fs_magic(&rustix::fs::fstatfs(fd).map_err(|e| Fault::Os(e.into()))?);
        if !ALLOWED_FILESYSTEMS.iter().any(|(m, _)| *m == magic) {
            return Err(Fault::Refused(Refusal::Filesystem {
                name: filesystem_name(magic),
            }));
        }
        if self.dev == Some(st_dev) {
            return Err(Fault::Refused(Refusal::SandboxDev));
        }
        Ok(())
    }

    /// Opens the inode of a checked `O_PATH` descriptor for I/O.
    fn reopen(&self, fd: &OwnedFd, flags: OFlags, path: &str) -> Result<File, FileError> {
        let name = format!("self/fd/{}", fd.as_raw_fd());
        rustix::fs::openat(&self.proc_fd, name.as_str(), flags | REOPEN, Mode::empty())
            .map(File::from)
            .map_err(|e| FileError::os(path, e.into()))
    }

    /// The directory that holds `rel`'s last component, made (mode 0755) where missing;
    /// every directory on the way is checked as a listing would be.
    fn parent(&self, path: &str, rel: &Path, op: FileOp) -> Result<OwnedFd, FileError> {
        let dir_flags = OFlags::PATH | OFlags::DIRECTORY;
        let checked = |fd: OwnedFd| -> Result<OwnedFd, FileError> {
            let st_dev = rustix::fs::fstat(&fd)
                .map_err(|e| FileError::os(path, e.into()))?
                .st_dev;
            self.check_filesystem(&fd, st_dev)
                .map_err(|f| f.into_error(path, op, None))?;
            Ok(fd)
        };
        let mut dir = checked(
            openat2(&self.root, Path::new("."), dir_flags, Mode::empty())
                .map_err(|e| FileError::os(path, e))?,
        )?;
        // Each prefix resolves from the root, as the whole path of a read does; a missing
        // one is made in the directory its parent resolved to.
        let mut prefix = PathBuf::new();
        for comp in rel.parent().into_iter().flat_map(Path::components) {
            prefix.push(comp);
            let next = match openat2(&self.root, &prefix, dir_flags, Mode::empty()) {
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    match rustix::fs::mkdirat(&dir, comp.as_os_str(), Mode::from_raw_mode(0o755)) {
                        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                        Err(e) => return Err(FileError::os(path, e.into())),
                    }
                    openat2(&self.root, &prefix, dir_flags, Mode::empty())
                }
                other => other,
            };
            dir = checked(next.map_err(|e| FileError::os(path, e))?)?;
        }
        Ok(dir)
    }

    /// The target of the symbolic link `rel` names, if it is one (for messages only).
    fn link_of(&self, rel: &Path) -> Option<String> {
        let name = rel.file_name()?;
        let parent = rel.parent().filter(|p| !p.as_os_str().is_empty());
        let dir = openat2(
            &self.root,
            parent.unwrap_or(Path::new(".")),
            OFlags::PATH | OFlags::DIRECTORY,
            Mode::empty(),
        )
        .ok()?;
        link_target(&dir, name)
    }
}

/// The failure of a check, before it is given its path.
enum Fault {
    Refused(Refusal),
    WrongType(String),
    Os(io::Error),
}

impl Fault {
    fn into_error(self, path: &str, op: FileOp, link: Option<String>) -> FileError {
        match self {
            Fault::Refused(refusal) => FileError::Refused {
                path: path.to_owned(),
                op,
                refusal,
                link,
            },
            Fault::WrongType(reason) => FileError::WrongType {
                path: path.to_owned(),
                reason,
            },
            Fault::Os(e) => FileError::os(path, e),
        }
    }
}

fn too_large(size: u64, limit: u64) -> String {
    format!(
        "is {} MiB, over the server's limit of {} MiB for a file read (dsec serve --max-file-mb)",
        size.div_ceil(1 << 20),
        limit >> 20
    )
}

fn set_mode(file: File, mode: Mode, path: &str) -> Result<File, FileError> {
    // The creating process's umask must not change the mode the caller asked for.
    rustix::fs::fchmod(&file, mode).map_err(|e| FileError::os(path, e.into()))?;
    Ok(file)
}

fn link_target(dir: &OwnedFd, name: impl rustix::path::Arg) -> Option<String> {
    rustix::fs::readlinkat(dir, name, Vec::new())
        .ok()
        .map(|t| t.to_string_lossy().into_owned())
}

/// A directory's entries, read a level at a time for [`SandboxRoot::list`].
struct Listing<'a> {
    /// The listed path, for the messages.
    path: &'a str,
    max_entries: usize,
}

impl Listing<'_> {
    /// Appends the entries of `fd` (at `prefix` below the listed directory) to `out`,
    /// and with `depth` over 1 those of its subdirectories on the same filesystem.
    fn read(
        &self,
        fd: &OwnedFd,
        prefix: &str,
        depth: u32,
        out: &mut Vec<Entry>,
    ) -> Result<(), FileError> {
        let path = self.path;
        let st_dev = rustix::fs::fstat(fd)
            .map_err(|e| FileError::os(path, e.into()))?
            .st_dev;
        let dir = rustix::fs::Dir::read_from(fd).map_err(|e| FileError::os(path, e.into()))?;
        let mut subdirs = Vec::new();
        for entry in dir {
            let entry = entry.map_err(|e| FileError::os(path, e.into()))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name == "." || name == ".." {
                continue;
            }
            if out.len() == self.max_entries {
                return Err(FileError::TooLarge {
                    path: path.to_owned(),
                    op: FileOp::List,
                    what: format!(
                        "has more than {} entries, the most list_files returns; \
                         list a subdirectory or less deep, or run a command",
                        self.max_entries
                    ),
                });
            }
            let Ok(stat) = rustix::fs::statat(fd, entry.file_name(), AtFlags::SYMLINK_NOFOLLOW)
            else {
                continue;
            };
            let kind = FileType::from_raw_mode(stat.st_mode);
            let link = (kind == FileType::Symlink)
                .then(|| link_target(fd, entry.file_name()))
                .flatten();
            let rel_path = match prefix {
                "" => name.clone(),
                _ => format!("{prefix}/{name}"),
            };
            if depth > 1 && kind == FileType::Directory && stat.st_dev == st_dev {
                subdirs.push((entry.file_name().to_owned(), rel_path.clone()));
            }
            let mut listed = Entry::new(name, rel_path, &stat, link);
            if listed.has_metadata() {
                let mut at = format!("/proc/self/fd/{}/", fd.as_raw_fd()).into_bytes();
                at.extend_from_slice(entry.file_name().to_bytes());
                listed.metadata = metadata::read_nofollow(&at[..]);
            }
            out.push(listed);
        }
        for (name, sub_path) in subdirs {
            // A directory swapped for a link since it was read is not entered.
            let Ok(sub) = open_subdir(fd, name.as_c_str()) else {
                continue;
            };
            self.read(&sub, &sub_path, depth - 1, out)?;
        }
        Ok(())
    }
}

/// Opens the directory `name` of `dir` for reading, never through a symbolic link.
fn open_subdir(dir: &OwnedFd, name: impl rustix::path::Arg) -> io::Result<OwnedFd> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | REOPEN;
    rustix::fs::openat(dir, name, flags, Mode::empty()).map_err(Into::into)
}

/// An `O_PATH` descriptor of `name` in `dir`, a symbolic link itself rather than its
/// target.
fn leaf(dir: &OwnedFd, name: &std::ffi::OsStr) -> io::Result<OwnedFd> {
    openat2(
        dir,
        Path::new(name),
        OFlags::PATH | OFlags::NOFOLLOW,
        Mode::empty(),
    )
}

/// Removes everything in the directory `fd` of `path`, never descending into another
/// filesystem than `st_dev` nor through a symbolic link.
fn empty_dir(fd: &OwnedFd, path: &str, st_dev: u64, depth: usize) -> Result<(), FileError> {
    if depth == MAX_REMOVE_DEPTH {
        return Err(FileError::TooLarge {
            path: path.to_owned(),
            op: FileOp::Remove,
            what: format!(
                "is nested more than {MAX_REMOVE_DEPTH} directories deep; remove it with a command"
            ),
        });
    }
    let os = |e: rustix::io::Errno| FileError::os(path, e.into());
    let mut names = Vec::new();
    for entry in rustix::fs::Dir::read_from(fd).map_err(os)? {
        let name = entry.map_err(os)?.file_name().to_owned();
        if name.as_bytes() != b"." && name.as_bytes() != b".." {
            names.push(name);
        }
    }
    for name in names {
        let stat = match rustix::fs::statat(fd, name.as_c_str(), AtFlags::SYMLINK_NOFOLLOW) {
            Err(rustix::io::Errno::NOENT) => continue,
            other => other.map_err(os)?,
        };
        let flags = if FileType::from_raw_mode(stat.st_mode) == FileType::Directory {
            if stat.st_dev != st_dev {
                return Err(FileError::WrongType {
                    path: path.to_owned(),
                    reason: format!(
                        "holds a mount point ({}), which remove does not cross",
                        name.to_string_lossy()
                    ),
                });
            }
            let sub = open_subdir(fd, name.as_c_str()).map_err(|e| FileError::os(path, e))?;
            empty_dir(&sub, path, st_dev, depth + 1)?;
            AtFlags::REMOVEDIR
        } else {
            AtFlags::empty()
        };
        match rustix::fs::unlinkat(fd, name.as_c_str(), flags) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => {}
            Err(e) => return Err(os(e)),
        }
    }
    Ok(())
}

/// `rel`, or `.` for the root itself.
fn target(rel: &Path) -> &Path {
    if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
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
    let invalid = |reason: &str| FileError::InvalidPath {
        path: path.to_owned(),
        reason: reason.to_owned(),
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
                    return Err(FileError::Escapes {
                        path: path.to_owned(),
                    });
                }
            }
            Component::Normal(c) => out.push(c),
            Component::Prefix(_) => return Err(invalid("has a prefix")),
        }
    }
    Ok(out)
}

/// A filesystem's magic number. `f_type` holds it in a wider type whose width and
/// signedness vary by architecture; the magic numbers are 32-bit.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn fs_magic(stat: &rustix::fs::StatFs) -> u32 {
    stat.f_type as u32
}

/// An inode's size: the kernel's `i_size` is never negative.
#[allow(clippy::cast_sign_loss)]
fn size(stat: &rustix::fs::Stat) -> u64 {
    stat.st_size as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: u64 = 1 << 30;

    fn read(root: &SandboxRoot, path: &str) -> Result<Vec<u8>, FileError> {
        let (mut file, _) = root.open_read(path, MAX)?;
        let mut data = Vec::new();
        io::Read::read_to_end(&mut file, &mut data).unwrap();
        Ok(data)
    }

    fn refusal(r: Result<impl std::fmt::Debug, FileError>) -> Refusal {
        match r {
            Err(FileError::Refused { refusal, .. }) => refusal,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn lexical_escape_is_refused() {
        assert!(matches!(
            relative("/../etc"),
            Err(FileError::Escapes { .. })
        ));
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
        let sb = SandboxRoot::open(&root).unwrap();
        assert!(matches!(read(&sb, "/rel"), Err(FileError::Escapes { .. })));
        assert!(matches!(
            read(&sb, "/abs/passwd"),
            Err(FileError::Escapes { .. })
        ));
        assert!(matches!(
            sb.write_all("/abs/x", b"no", 0o644),
            Err(FileError::Escapes { .. })
        ));
    }

    #[test]
    fn write_creates_parents_and_list_reports_them() {
        let tmp = tempfile::tempdir().unwrap();
        let sb = SandboxRoot::open(tmp.path()).unwrap();
        sb.write_all("/a/b/c.txt", b"hello", 0o600).unwrap();
        assert_eq!(read(&sb, "/a/b/c.txt").unwrap(), b"hello");
        sb.write_all("/a/b/c.txt", b"2", 0o640).unwrap();
        assert_eq!(read(&sb, "/a/b/c.txt").unwrap(), b"2");
        let listing = sb.list("/a", 10, 1).unwrap();
        assert_eq!(listing.len(), 1);
        assert!(listing[0].is_dir);
        let listing = sb.list("/a/b", 10, 1).unwrap();
        assert_eq!(listing.len(), 1);
        let c = &listing[0];
        assert_eq!((c.name.as_str(), c.path.as_str()), ("c.txt", "c.txt"));
        assert_eq!(
            (c.size, c.is_dir, c.mode, c.kind),
            (1, false, 0o640, EntryKind::File)
        );
        assert!(matches!(read(&sb, "/a"), Err(FileError::WrongType { .. })));
        assert!(matches!(
            read(&sb, "/nope"),
            Err(FileError::NotFound { .. })
        ));
        assert!(matches!(
            sb.list("/a/b/c.txt", 10, 1),
            Err(FileError::WrongType { .. })
        ));
    }

    #[test]
    fn a_relative_link_inside_the_root_is_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let sb = SandboxRoot::open(tmp.path()).unwrap();
        sb.write_all("/data/real.txt", b"real", 0o644).unwrap();
        std::os::unix::fs::symlink("data/real.txt", tmp.path().join("link")).unwrap();
        assert_eq!(read(&sb, "/link").unwrap(), b"real");
        sb.write_all("/link", b"through", 0o644).unwrap();
        assert_eq!(read(&sb, "/data/real.txt").unwrap(), b"through");
        assert!(tmp.path().join("link").is_symlink());
        // Links climbing up, still beneath the root, resolve for writes as for reads, in
        // the last component and on the way.
        std::fs::create_dir(tmp.path().join("work")).unwrap();
        std::os::unix::fs::symlink("../data/real.txt", tmp.path().join("work/out")).unwrap();
        std::os::unix::fs::symlink("../data", tmp.path().join("work/data")).unwrap();
        sb.write_all("/work/out", b"up", 0o644).unwrap();
        assert_eq!(read(&sb, "/data/real.txt").unwrap(), b"up");
        sb.write_all("/work/data/new/file", b"made", 0o644).unwrap();
        assert_eq!(read(&sb, "/data/new/file").unwrap(), b"made");
    }

    #[test]
    fn fifos_are_refused_without_blocking() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("fifo");
        let mode = rustix::fs::Mode::from_bits_truncate(0o644);
        rustix::fs::mknodat(rustix::fs::CWD, &fifo, rustix::fs::FileType::Fifo, mode, 0).unwrap();
        std::os::unix::fs::symlink("fifo", tmp.path().join("result.txt")).unwrap();
        let sb = SandboxRoot::open(tmp.path()).unwrap();
        // An open of the FIFO would block these calls forever: they return at once.
        assert_eq!(refusal(read(&sb, "/fifo")), Refusal::Fifo);
        assert_eq!(refusal(sb.open_write("/fifo", 0o644)), Refusal::Fifo);
        let err = read(&sb, "/result.txt").unwrap_err();
        assert_eq!(
            err.to_string(),
            "/result.txt is a FIFO (through a symbolic link to fifo): only regular files \
             can be read"
        );
        // A listing looks only for directories: the FIFO is not opened either.
        assert!(matches!(
            sb.list("/fifo", 10, 1),
            Err(FileError::WrongType { .. })
        ));
    }

    #[test]
    fn dangling_links_are_not_written_through() {
        let tmp = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("missing", tmp.path().join("out")).unwrap();
        let sb = SandboxRoot::open(tmp.path()).unwrap();
        assert_eq!(
            refusal(sb.write_all("/out", b"x", 0o644)),
            Refusal::DanglingLink
        );
        assert!(!tmp.path().join("missing").exists());
    }

    #[test]
    fn kernel_interfaces_and_devices_are_refused() {
        // The host's own root stands in for a sandbox's: /proc, /sys and /dev are there.
        let sb = SandboxRoot::open(Path::new("/")).unwrap();
        let procfs = Refusal::Filesystem {
            name: "procfs".into(),
        };
        assert_eq!(refusal(read(&sb, "/proc/self/environ")), procfs);
        assert_eq!(refusal(read(&sb, "/proc/kmsg")), procfs);
        assert_eq!(refusal(sb.list("/proc", 10, 1)), procfs);
        assert_eq!(refusal(sb.open_write("/proc/self/comm", 0o644)), procfs);
        if Path::new("/sys/kernel/vmcoreinfo").exists() {
            assert_eq!(
                refusal(read(&sb, "/sys/kernel/vmcoreinfo")),
                Refusal::Filesystem {
                    name: "sysfs".into()
                }
            );
        }
        assert_eq!(refusal(read(&sb, "/dev/zero")), Refusal::CharDevice);
        // A write is refused on the way, in /dev itself.
        assert_eq!(
            refusal(sb.open_write("/dev/null", 0o644)),
            Refusal::SandboxDev
        );
        assert_eq!(
            refusal(sb.open_write("/dev/new", 0o644)),
            Refusal::SandboxDev
        );
        assert!(!Path::new("/dev/new").exists());
        // /proc/self/fd/N are magic links: never followed.
        assert_eq!(refusal(read(&sb, "/proc/self/fd/0")), Refusal::MagicLink);
        // A relative symbolic link to a device, planted where a grader reads.
        let tmp = tempfile::tempdir_in("/tmp").unwrap();
        let depth = tmp.path().components().count() - 1;
        let up = "../".repeat(depth);
        std::os::unix::fs::symlink(format!("{up}dev/zero"), tmp.path().join("result.txt")).unwrap();
        let planted = format!("{}/result.txt", tmp.path().display());
        let err = read(&sb, &planted).unwrap_err();
        assert_eq!(refusal(Err::<(), _>(err.clone())), Refusal::CharDevice);
        assert!(
            err.to_string()
                .contains(&format!("through a symbolic link to {up}dev/zero")),
            "{err}"
        );
    }

    #[test]
    fn reads_over_the_limit_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let sb = SandboxRoot::open(tmp.path()).unwrap();
        sb.write_all("/big", &[7; 4096], 0o644).unwrap();
        assert!(matches!(
            sb.open_read("/big", 4095),
            Err(FileError::TooLarge { .. })
        ));
        assert_eq!(sb.open_read("/big", 4096).unwrap().1, 4096);
    }

    #[test]
    fn listings_are_bounded() {
        let tmp = tempfile::tempdir().unwrap();
        for i in 0..5 {
            std::fs::write(tmp.path().join(i.to_string()), b"").unwrap();
        }
        let sb = SandboxRoot::open(tmp.path()).unwrap();
        assert_eq!(sb.list("/", 5, 1).unwrap().len(), 5);
        assert!(matches!(
            sb.list("/", 4, 1),
            Err(FileError::TooLarge { .. })
        ));
    }

    #[test]
    fn listings_go_as_deep_as_asked_without_following_links() {
        let tmp = tempfile::tempdir().unwrap();
        let sb = SandboxRoot::open(tmp.path()).unwrap();
        sb.write_all("/d/a/b/deep.txt", b"x", 0o644).unwrap();
        sb.write_all("/d/top.txt", b"xy", 0o644).unwrap();
        std::os::unix::fs::symlink("a", tmp.path().join("d/link")).unwrap();
        let paths = |depth| -> Vec<String> {
            sb.list("/d", 100, depth)
                .unwrap()
                .into_iter()
                .map(|e| e.path)
                .collect()
        };
        assert_eq!(paths(1), ["a", "link", "top.txt"]);
        assert_eq!(paths(2), ["a", "a/b", "link", "top.txt"]);
        assert_eq!(paths(9), ["a", "a/b", "a/b/deep.txt", "link", "top.txt"]);
        let link = sb.list("/d", 100, 1).unwrap().remove(1);
        assert_eq!(
            (link.kind, link.link.as_deref()),
            (EntryKind::Symlink, Some("a"))
        );
        assert!(matches!(
            sb.list("/d", 3, 3),
            Err(FileError::TooLarge { .. })
        ));
    }

    #[test]
    fn stat_reports_links_without_following_them() {
        let tmp = tempfile::tempdir().unwrap();
        let sb = SandboxRoot::open(tmp.path()).unwrap();
        sb.write_all("/f", b"abc", 0o600).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", tmp.path().join("abs")).unwrap();
        let f = sb.stat("/f").unwrap();
        assert_eq!(
            (f.kind, f.size, f.mode, f.path.as_str()),
            (EntryKind::File, 3, 0o600, "/f")
        );
        let abs = sb.stat("/abs").unwrap();
        assert_eq!(abs.kind, EntryKind::Symlink);
        assert_eq!(abs.link.as_deref(), Some("/etc/passwd"));
        assert_eq!(sb.stat("/").unwrap().kind, EntryKind::Dir);
        assert!(matches!(sb.stat("/abs/x"), Err(FileError::Escapes { .. })));
        assert!(matches!(sb.stat("/nope"), Err(FileError::NotFound { .. })));
        let host = SandboxRoot::open(Path::new("/")).unwrap();
        assert!(matches!(
            refusal(host.stat("/proc/self")),
            Refusal::Filesystem { .. }
        ));
    }

    #[test]
    fn mkdir_move_and_remove_stay_beneath_the_root() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir(&root).unwrap();
        std::fs::create_dir(tmp.path().join("outside")).unwrap();
        std::fs::write(tmp.path().join("outside/keep"), b"host").unwrap();
        std::os::unix::fs::symlink("../outside", root.join("out")).unwrap();
        let sb = SandboxRoot::open(&root).unwrap();

        assert!(sb.mkdir("/a/b", 0o700, true, false).unwrap());
        assert_eq!(sb.stat("/a/b").unwrap().mode, 0o700);
        assert!(!sb.mkdir("/a/b", 0o700, true, true).unwrap());
        assert!(matches!(
            sb.mkdir("/a/b", 0o700, true, false),
            Err(FileError::Exists { .. })
        ));
        assert!(matches!(
            sb.mkdir("/x/y", 0o755, false, true),
            Err(FileError::NotFound { .. })
        ));
        assert!(matches!(
            sb.mkdir("/out/new", 0o755, true, true),
            Err(FileError::Escapes { .. })
        ));

        sb.write_all("/a/f", b"1", 0o644).unwrap();
        sb.write_all("/a/g", b"2", 0o644).unwrap();
        assert!(matches!(
            sb.rename("/a/f", "/a/g", false),
            Err(FileError::Exists { .. })
        ));
        sb.rename("/a/f", "/a/g", true).unwrap();
        assert_eq!(read(&sb, "/a/g").unwrap(), b"1");
        assert!(matches!(
            sb.rename("/a/g", "/out/g", true),
            Err(FileError::Escapes { .. })
        ));
        assert!(matches!(
            sb.rename("/out/keep", "/k", true),
            Err(FileError::Escapes { .. })
        ));
        assert!(matches!(
            sb.rename("/a", "/a/b/c", false),
            Err(FileError::InvalidPath { .. })
        ));
        // A link is moved itself, and removed itself.
        sb.rename("/out", "/a/link", false).unwrap();
        sb.remove("/a/link", false).unwrap();
        assert!(tmp.path().join("outside/keep").exists());

        assert!(matches!(
            sb.remove("/a", false),
            Err(FileError::WrongType { .. })
        ));
        assert!(matches!(
            sb.remove("/", true),
            Err(FileError::InvalidPath { .. })
        ));
        std::os::unix::fs::symlink("../outside", root.join("a/b/out")).unwrap();
        sb.remove("/a", true).unwrap();
        assert!(!root.join("a").exists());
        assert!(tmp.path().join("outside/keep").exists());
        assert!(matches!(
            sb.remove("/a", true),
            Err(FileError::NotFound { .. })
        ));
    }

    #[test]
    fn errors_cross_the_channel_unchanged() {
        let err = FileError::Refused {
            path: "/x".into(),
            op: FileOp::Write,
            refusal: Refusal::Filesystem {
                name: "sysfs".into(),
            },
            link: Some("../sys/x".into()),
        };
        let json = serde_json::to_string(&err).unwrap();
        assert_eq!(serde_json::from_str::<FileError>(&json).unwrap(), err);
    }
}
