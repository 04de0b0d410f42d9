//! Directory watches, inside the sandbox: `sb.watch(path, recursive=)`.
//!
//! One inotify instance per sandbox (made at the first watch) serves every watch; each
//! watch is known by the id of the edge's request, and every event is sent as a
//! [`FrameKind::FileEvents`] frame of that id (the edge watches a Docker container's
//! merged root the same way, with one instance per watch). A watched directory is opened as a listing
//! opens it (resolved beneath the root, checked) and handed to `inotify_add_watch` as
//! `/proc/self/fd/N`, so the inode watched is the one checked, whatever the path became
//! since. A recursive watch adds the directories below, and those made or moved in later,
//! on the same filesystem, never through a symbolic link.
//!
//! Bounded: [`MAX_WATCHES`] watches and [`MAX_WATCHED_DIRS`] directories per sandbox. When
//! the kernel's queue overflows, every watch gets an `overflow` event (events were lost);
//! when the watched directory itself goes, its watch ends with [`FrameKind::Done`].

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::inotify::{self, ReadFlags, WatchFlags};
use serde::{Deserialize, Serialize};

use super::{relative, FileError, FileOp, SandboxRoot};
use crate::proto::{self, FrameKind};

/// Watches open at once in one sandbox.
pub const MAX_WATCHES: usize = 8;

/// Directories watched at once in one sandbox, all watches together.
pub const MAX_WATCHED_DIRS: usize = 4096;

/// Events sent in one frame at most.
const EVENTS_PER_FRAME: usize = 256;

/// What happened to a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchEventKind {
    /// Made, or moved in.
    Create,
    /// Written.
    Write,
    /// Removed.
    Remove,
    /// Moved away (the old name; the new one, if still watched, is a `create`).
    Rename,
    /// Its mode, owner or times changed.
    Chmod,
    /// The kernel's queue overflowed: events were lost.
    Overflow,
}

/// One event of a watch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchEvent {
    /// What happened.
    pub kind: WatchEventKind,
    /// The absolute path it happened to, under the path the watch was asked for (empty
    /// for `overflow`).
    pub path: String,
    /// Whether it is a directory.
    pub is_dir: bool,
}

/// The watches of one sandbox.
#[derive(Default)]
pub struct Watches {
    inotify: Option<OwnedFd>,
    /// Each watch's root path, whether it is recursive, and its directories.
    by_id: HashMap<u32, Watch>,
    /// Each directory watched: the watches that see it, under the path each sees.
    dirs: HashMap<i32, Vec<(u32, String)>>,
    buf: Vec<MaybeUninit<u8>>,
}

/// What [`Watches::pump`] read.
#[derive(Debug, Default)]
pub struct Pumped {
    /// Each watch's events, in order.
    pub events: Vec<(u32, Vec<WatchEvent>)>,
    /// The watches that ended.
    pub ended: Vec<u32>,
}

struct Watch {
    root_wd: i32,
    recursive: bool,
}

const MASK: WatchFlags = WatchFlags::CREATE
    .union(WatchFlags::MODIFY)
    .union(WatchFlags::DELETE)
    .union(WatchFlags::MOVED_FROM)
    .union(WatchFlags::MOVED_TO)
    .union(WatchFlags::ATTRIB)
    .union(WatchFlags::DELETE_SELF)
    .union(WatchFlags::MOVE_SELF)
    .union(WatchFlags::ONLYDIR)
    .union(WatchFlags::EXCL_UNLINK);

impl Watches {
    /// The inotify descriptor to poll, once there is a watch.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.inotify
            .as_ref()
            .filter(|_| !self.by_id.is_empty())
            .map(AsFd::as_fd)
    }

    /// Starts watch `id` of the directory `path` (and with `recursive` what is below).
    pub fn add(
        &mut self,
        root: &SandboxRoot,
        id: u32,
        path: &str,
        recursive: bool,
    ) -> Result<(), FileError> {
        if self.by_id.len() >= MAX_WATCHES {
            return Err(FileError::TooManyWatches {
                path: path.to_owned(),
                limit: MAX_WATCHES,
            });
        }
        let dir = root.open_dir(path, FileOp::Watch)?;
        if self.inotify.is_none() {
            let flags = inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK;
            self.inotify = Some(inotify::init(flags).map_err(|e| FileError::os(path, e.into()))?);
        }
        let shown = display_path(path);
        let root_wd = self.add_dir(id, &dir, path, shown.clone())?;
        self.by_id.insert(id, Watch { root_wd, recursive });
        if recursive {
            if let Err(e) = self.add_below(root, id, &shown) {
                self.remove(id);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Ends watch `id` (its client went away).
    pub fn remove(&mut self, id: u32) {
        if self.by_id.remove(&id).is_none() {
            return;
        }
        let inotify = self.inotify.as_ref();
        self.dirs.retain(|wd, seen| {
            seen.retain(|(w, _)| *w != id);
            if seen.is_empty() {
                if let Some(fd) = inotify {
                    let _ = inotify::remove_watch(fd, *wd);
                }
            }
            !seen.is_empty()
        });
    }

    /// Reads what the kernel queued and appends the frames it makes to `out`.
    pub(super) fn pump_frames(&mut self, root: Option<&SandboxRoot>, out: &mut Vec<u8>) {
        let pumped = self.pump(root);
        for (id, list) in pumped.events {
            for chunk in list.chunks(EVENTS_PER_FRAME) {
                proto::encode_json(out, FrameKind::FileEvents, id, &chunk);
            }
        }
        for id in pumped.ended {
            proto::encode(out, FrameKind::Done, id, &[]);
        }
    }

    /// Reads what the kernel queued: the events of each watch, and the watches that
    /// ended (their directory went away; they are removed).
    pub fn pump(&mut self, root: Option<&SandboxRoot>) -> Pumped {
        let mut pumped = Pumped::default();
        let Some(fd) = self.inotify.take() else {
            return pumped;
        };
        if self.buf.is_empty() {
            self.buf = vec![MaybeUninit::uninit(); 64 << 10];
        }
        let mut buf = std::mem::take(&mut self.buf);
        let mut events: HashMap<u32, Vec<WatchEvent>> = HashMap::new();
        let mut ended: Vec<u32> = Vec::new();
        let mut new_dirs: Vec<(u32, String)> = Vec::new();
        let mut reader = inotify::Reader::new(&fd, &mut buf);
        while let Ok(ev) = reader.next() {
            let flags = ev.events();
            if flags.contains(ReadFlags::QUEUE_OVERFLOW) {
                for id in self.by_id.keys() {
                    events.entry(*id).or_default().push(WatchEvent {
                        kind: WatchEventKind::Overflow,
                        path: String::new(),
                        is_dir: false,
                    });
                }
                continue;
            }
            let Some(seen) = self.dirs.get(&ev.wd()) else {
                continue;
            };
            if flags.intersects(ReadFlags::IGNORED | ReadFlags::DELETE_SELF | ReadFlags::MOVE_SELF)
            {
                // The directory is gone from where it was watched: a watch rooted there
                // ends; for a recursive one above, its parent reported the change.
                ended.extend(
                    seen.iter()
                        .filter(|(id, _)| self.by_id.get(id).is_some_and(|w| w.root_wd == ev.wd()))
                        .map(|(id, _)| *id),
                );
                if flags.contains(ReadFlags::IGNORED) {
                    self.dirs.remove(&ev.wd());
                }
                continue;
            }
            let Some(name) = ev.file_name().map(|n| n.to_string_lossy().into_owned()) else {
                continue;
            };
            let is_dir = flags.contains(ReadFlags::ISDIR);
            let Some(kind) = kind_of(flags) else {
                continue;
            };
            for (id, dir) in seen {
                let path = join(dir, &name);
                let recursive = self.by_id.get(id).is_some_and(|w| w.recursive);
                if recursive && is_dir && kind == WatchEventKind::Create {
                    new_dirs.push((*id, path.clone()));
                }
                events
                    .entry(*id)
                    .or_default()
                    .push(WatchEvent { kind, path, is_dir });
            }
        }
        self.inotify = Some(fd);
        self.buf = buf;
        if let Some(root) = root {
            for (id, path) in new_dirs {
                if self.by_id.contains_key(&id) {
                    // A directory gone again, or one too many, is not watched; its events
                    // were reported by its parent.
                    let _ = self.add_tree(root, id, &path);
                }
            }
        }
        pumped.events = events.into_iter().collect();
        for id in ended {
            if self.by_id.contains_key(&id) {
                self.remove(id);
                pumped.ended.push(id);
            }
        }
        pumped
    }

    /// Watches `path` and, below it, every directory on its filesystem.
    fn add_tree(&mut self, root: &SandboxRoot, id: u32, path: &str) -> Result<(), FileError> {
        let dir = root.open_dir(path, FileOp::Watch)?;
        self.add_dir(id, &dir, path, path.to_owned())?;
        self.add_below(root, id, path)
    }

    /// Watches every directory below `path` (already watched) on its filesystem.
    fn add_below(&mut self, root: &SandboxRoot, id: u32, path: &str) -> Result<(), FileError> {
        let real = if path.is_empty() { "/" } else { path };
        for entry in root.list(real, MAX_WATCHED_DIRS, 1)? {
            if entry.is_dir {
                self.add_tree(root, id, &join(path, &entry.name))?;
            }
        }
        Ok(())
    }

    /// Adds the directory `dir` (opened for `path`) to watch `id`, seen as `shown`.
    fn add_dir(
        &mut self,
        id: u32,
        dir: &OwnedFd,
        path: &str,
        shown: String,
    ) -> Result<i32, FileError> {
        if self.dirs.len() >= MAX_WATCHED_DIRS {
            return Err(FileError::TooLarge {
                path: path.to_owned(),
                op: FileOp::Watch,
                what: format!(
                    "holds more directories than the {MAX_WATCHED_DIRS} one sandbox may \
                     watch; watch a subdirectory, or not recursively"
                ),
            });
        }
        let inotify = self.inotify.as_ref().expect("made before the first watch");
        // The magic link names the checked inode itself.
        let link = format!("/proc/self/fd/{}", dir.as_raw_fd());
        let wd = inotify::add_watch(inotify, link.as_str(), MASK)
            .map_err(|e| FileError::os(path, e.into()))?;
        let seen = self.dirs.entry(wd).or_default();
        // A directory moved within the tree keeps its inode and so its descriptor: it is
        // now seen at its new path.
        seen.retain(|(w, _)| *w != id);
        seen.push((id, shown));
        Ok(wd)
    }
}

fn kind_of(flags: ReadFlags) -> Option<WatchEventKind> {
    Some(
        if flags.intersects(ReadFlags::CREATE | ReadFlags::MOVED_TO) {
            WatchEventKind::Create
        } else if flags.contains(ReadFlags::MODIFY) {
            WatchEventKind::Write
        } else if flags.contains(ReadFlags::DELETE) {
            WatchEventKind::Remove
        } else if flags.contains(ReadFlags::MOVED_FROM) {
            WatchEventKind::Rename
        } else if flags.contains(ReadFlags::ATTRIB) {
            WatchEventKind::Chmod
        } else {
            return None;
        },
    )
}

/// The path as events name it: normalised, without a trailing `/` (empty for the root,
/// so that joining a name gives `/name`).
fn display_path(path: &str) -> String {
    match relative(path) {
        Ok(rel) if rel.as_os_str().is_empty() => String::new(),
        Ok(rel) => Path::new("/").join(rel).display().to_string(),
        Err(_) => path.to_owned(),
    }
}

fn join(dir: &str, name: &str) -> String {
    format!("{dir}/{name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(watches: &mut Watches, root: &SandboxRoot) -> Vec<(u32, Vec<WatchEvent>)> {
        let mut out = Vec::new();
        watches.pump_frames(Some(root), &mut out);
        let mut frames = Vec::new();
        while let Some(frame) = proto::decode(&mut out).unwrap() {
            let events = match frame.kind {
                FrameKind::FileEvents => frame.json().unwrap(),
                _ => Vec::new(),
            };
            frames.push((frame.exec_id, events));
        }
        frames
    }

    #[test]
    fn events_name_paths_under_the_watched_one_and_recursion_follows_new_dirs() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(tmp.path().join("w/old")).unwrap();
        let root = SandboxRoot::open(tmp.path()).unwrap();
        let mut watches = Watches::default();
        watches.add(&root, 7, "/w/", true).unwrap();
        std::fs::write(tmp.path().join("w/old/a"), b"x").unwrap();
        std::fs::create_dir(tmp.path().join("w/new")).unwrap();
        let first = drain(&mut watches, &root);
        let paths: Vec<(WatchEventKind, String)> = first
            .iter()
            .flat_map(|(_, evs)| evs.iter().map(|e| (e.kind, e.path.clone())))
            .collect();
        assert!(
            paths.contains(&(WatchEventKind::Create, "/w/old/a".into())),
            "{paths:?}"
        );
        assert!(
            paths.contains(&(WatchEventKind::Create, "/w/new".into())),
            "{paths:?}"
        );
        std::fs::write(tmp.path().join("w/new/b"), b"y").unwrap();
        let second = drain(&mut watches, &root);
        assert!(second
            .iter()
            .flat_map(|(_, e)| e)
            .any(|e| e.path == "/w/new/b" && e.kind == WatchEventKind::Create));
        watches.remove(7);
        assert!(watches.dirs.is_empty() && watches.fd().is_none());
    }

    #[test]
    fn the_watch_ends_with_its_directory_and_watches_are_bounded() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("gone")).unwrap();
        let root = SandboxRoot::open(tmp.path()).unwrap();
        let mut watches = Watches::default();
        watches.add(&root, 1, "/gone", false).unwrap();
        std::fs::remove_dir(tmp.path().join("gone")).unwrap();
        let mut out = Vec::new();
        watches.pump_frames(Some(&root), &mut out);
        let mut kinds = Vec::new();
        while let Some(frame) = proto::decode(&mut out).unwrap() {
            kinds.push(frame.kind);
        }
        assert_eq!(kinds.last(), Some(&FrameKind::Done));
        assert!(watches.by_id.is_empty());
        for id in 0..MAX_WATCHES {
            watches
                .add(&root, u32::try_from(id).unwrap(), "/", false)
                .unwrap();
        }
        assert!(matches!(
            watches.add(&root, 99, "/", false),
            Err(FileError::TooManyWatches { .. })
        ));
        assert!(matches!(
            Watches::default().add(&root, 1, "/missing", false),
            Err(FileError::NotFound { .. })
        ));
    }
}
