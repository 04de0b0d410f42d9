//! Paths inside the container, resolved before the daemon is asked anything: component by
//! component through the archive API's stat, the way `openat2(RESOLVE_BENEATH)` resolves
//! them for the native backend, and refused under the container's kernel interfaces or
//! when they are neither regular files nor directories (the daemon reads and writes with
//! the host's credentials, so these rules cannot be left to it).

use std::collections::VecDeque;

use bollard::container::PathStatResponse;
use bollard::query_parameters::ContainerArchiveInfoOptionsBuilder;
use dsec_api::FileKind;
use dsec_runtime::files::{relative, FileError, FileOp, Refusal};

use super::host::{daemon_error, status};
use super::{not_found, Inner};
use crate::error::ApiError;

/// Symbolic links followed while resolving one path (the kernel's limit).
const MAX_LINKS: usize = 40;
/// How often a stat the daemon answers with 500 is asked (see [`Inner::path_stat`]).
const STAT_TRIES: u32 = 3;
/// Go's `os.FileMode` bits in the archive API's stat header.
const GO_MODE_DIR: u32 = 1 << 31;
const GO_MODE_SYMLINK: u32 = 1 << 27;
const GO_MODE_DEVICE: u32 = 1 << 26;
const GO_MODE_NAMED_PIPE: u32 = 1 << 25;
const GO_MODE_SOCKET: u32 = 1 << 24;
const GO_MODE_CHAR_DEVICE: u32 = 1 << 21;
const GO_MODE_IRREGULAR: u32 = 1 << 19;
/// The container's kernel interfaces, never handed to the daemon: (top directory, the
/// filesystem named in the refusal; none for `/dev`).
const KERNEL_DIRS: &[(&str, Option<&str>)] = &[
    ("proc", Some("procfs")),
    ("sys", Some("sysfs")),
    ("dev", None),
];

impl Inner {
    /// The daemon's status of the resolved `path`, a symbolic link itself (`lstat`).
    ///
    /// The daemon answers 500 when the entry changes under its own stat (it `lstat`s a link,
    /// a command swaps it for a file, its `readlink` fails with `EINVAL`); the answer to a
    /// `HEAD` carries no message to tell that from a failing daemon, so a 500 is asked again
    /// up to [`STAT_TRIES`] times before it is reported.
    pub(super) async fn path_stat(&self, path: &str) -> Result<Option<PathStatResponse>, ApiError> {
        let mut tries = 1;
        loop {
            let opts = ContainerArchiveInfoOptionsBuilder::new().path(path).build();
            match self
                .docker
                .get_container_archive_info(&self.id, Some(opts))
                .await
            {
                Ok(s) => return Ok(Some(s)),
                Err(e) if status(&e) == Some(404) => return Ok(None),
                Err(e) if status(&e) == Some(500) && tries < STAT_TRIES => tries += 1,
                Err(e) if status(&e) == Some(500) => {
                    return Err(ApiError::internal(format!(
                        "reading the status of {path:?}: the docker daemon answered 500 {tries} \
                         times (a HEAD answer carries no message: the daemon's log has it)"
                    )))
                }
                Err(e) => return Err(daemon_error(&self.host, "reading the file's status", e)),
            }
        }
    }

    async fn stat(&self, path: &str) -> Result<Option<Stat>, ApiError> {
        Ok(self.path_stat(path).await?.map(|s| Stat::of(&s)))
    }

    /// Resolves `path` (see [`resolve`](Self::resolve)), which must be an existing
    /// directory `op` may use.
    pub(super) async fn resolve_dir(&self, path: &str, op: FileOp) -> Result<Resolved, ApiError> {
        let resolved = self.resolve(path).await?;
        resolved.check(path, op)?;
        if !resolved.missing.is_empty() {
            return Err(not_found(path));
        }
        if !resolved.last.dir {
            return Err(FileError::WrongType {
                path: path.to_owned(),
                reason: "is not a directory".into(),
            }
            .into());
        }
        Ok(resolved)
    }

    /// Resolves `path` inside the container the way the native backend's
    /// `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` does: every symbolic link is
    /// followed only while it stays beneath `/` (absolute targets are refused). Returns the
    /// resolved existing components, the components that do not exist, and the status of
    /// the last existing one.
    pub(super) async fn resolve(&self, path: &str) -> Result<Resolved, ApiError> {
        let rel = relative(path)?;
        let mut todo: VecDeque<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let mut done: Vec<String> = Vec::new();
        let mut last = Stat::DIR;
        let mut links = 0;
        while let Some(comp) = todo.pop_front() {
            match comp.as_str() {
                "" | "." => continue,
                ".." => {
                    if done.pop().is_none() {
                        return Err(FileError::Escapes {
                            path: path.to_owned(),
                        }
                        .into());
                    }
                    last = Stat::DIR;
                    continue;
                }
                _ => {}
            }
            if !last.dir {
                return Err(FileError::WrongType {
                    path: path.to_owned(),
                    reason: "has a parent that is not a directory".into(),
                }
                .into());
            }
            let candidate = join(&done, Some(&comp));
            let Some(stat) = self.stat(&candidate).await? else {
                todo.push_front(comp);
                return Ok(Resolved {
                    existing: done,
                    missing: todo.into(),
                    last,
                });
            };
            if stat.symlink {
                links += 1;
                let target = self.link_target(&candidate).await?;
                if links > MAX_LINKS || target.starts_with('/') {
                    return Err(FileError::Escapes {
                        path: path.to_owned(),
                    }
                    .into());
                }
                for c in target.rsplit('/') {
                    todo.push_front(c.to_owned());
                }
                continue;
            }
            done.push(comp);
            last = stat;
        }
        Ok(Resolved {
            existing: done,
            missing: Vec::new(),
            last,
        })
    }
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Stat {
    pub(super) dir: bool,
    pub(super) symlink: bool,
    /// Go's `os.FileMode` of the path.
    go_mode: u32,
    pub(super) size: u64,
}

impl Stat {
    pub(super) fn of(s: &PathStatResponse) -> Stat {
        Stat {
            dir: s.file_mode & GO_MODE_DIR != 0,
            symlink: s.file_mode & GO_MODE_SYMLINK != 0,
            go_mode: s.file_mode,
            size: u64::try_from(s.size).unwrap_or(0),
        }
    }

    /// What the entry is, as the API names it.
    pub(super) fn kind(&self) -> FileKind {
        if self.dir {
            FileKind::Dir
        } else if self.symlink {
            FileKind::Symlink
        } else if self.refusal().is_some() {
            FileKind::Other
        } else {
            FileKind::File
        }
    }

    /// The root, or a directory reached through `..`.
    const DIR: Stat = Stat {
        dir: true,
        symlink: false,
        go_mode: GO_MODE_DIR,
        size: 0,
    };

    /// Why this is neither a regular file nor a directory, if it is not.
    fn refusal(&self) -> Option<Refusal> {
        let m = self.go_mode;
        Some(if m & GO_MODE_NAMED_PIPE != 0 {
            Refusal::Fifo
        } else if m & GO_MODE_SOCKET != 0 {
            Refusal::Socket
        } else if m & GO_MODE_CHAR_DEVICE != 0 {
            Refusal::CharDevice
        } else if m & GO_MODE_DEVICE != 0 {
            Refusal::BlockDevice
        } else if m & GO_MODE_IRREGULAR != 0 {
            Refusal::Filesystem {
                name: "an irregular file".into(),
            }
        } else {
            return None;
        })
    }
}

pub(super) struct Resolved {
    pub(super) existing: Vec<String>,
    pub(super) missing: Vec<String>,
    pub(super) last: Stat,
}

impl Resolved {
    /// Refuses a path that is (or would be created) under the container's kernel
    /// interfaces, or that is neither a regular file nor a directory.
    pub(super) fn check(&self, path: &str, op: FileOp) -> Result<(), FileError> {
        self.check_in(path, op, None)
    }

    /// As [`check`](Self::check), for the entry `name` of the resolved directory.
    pub(super) fn check_in(
        &self,
        path: &str,
        op: FileOp,
        name: Option<&str>,
    ) -> Result<(), FileError> {
        let refused = |refusal| FileError::Refused {
            path: path.to_owned(),
            op,
            refusal,
            link: None,
        };
        let top = self
            .existing
            .first()
            .or(self.missing.first())
            .map(String::as_str)
            .or(name);
        let kernel = KERNEL_DIRS.iter().find(|(dir, _)| top == Some(*dir));
        if let Some((_, fs)) = kernel {
            return Err(refused(match fs {
                None => Refusal::SandboxDev,
                Some(name) => Refusal::Filesystem {
                    name: (*name).to_owned(),
                },
            }));
        }
        match self.last.refusal() {
            Some(r) if self.missing.is_empty() && name.is_none() => Err(refused(r)),
            _ => Ok(()),
        }
    }
}

/// `/a/b` (plus `next`) from components.
pub(super) fn join(components: &[String], next: Option<&str>) -> String {
    let mut out = String::from("/");
    out.push_str(&components.join("/"));
    if let Some(n) = next {
        if !components.is_empty() {
            out.push('/');
        }
        out.push_str(n);
    }
    out
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_makes_absolute_paths() {
        assert_eq!(join(&[], None), "/");
        assert_eq!(join(&[], Some("a")), "/a");
        assert_eq!(join(&["a".into(), "b".into()], Some("c")), "/a/b/c");
    }
}
