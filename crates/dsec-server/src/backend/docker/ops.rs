//! `stat`, `mkdir`, `move` and `remove` on a Docker container.
//!
//! Paths are resolved and checked as for reads and writes ([`super::paths`]); `stat` is
//! the archive API's status, and the three changes run `mkdir`, `mv`, `rmdir` or `rm` from
//! the image as root execs in the container, on the resolved paths. An exec runs in the
//! container's namespaces with its capabilities, so unlike the daemon's archive API it can
//! reach nothing a command of the sandbox could not; the checks before it give the same
//! refusals as the native backend. An image without these tools answers with the exec's
//! error.

use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use dsec_api::FileInfo;
use dsec_runtime::files::{relative, FileError, FileOp};
use futures::StreamExt;

use super::host::exec_error;
use super::paths::{join, Resolved, Stat};
use super::{not_found, Inner};
use crate::backend::{MakeDir, MovePath, RemovePath};
use crate::error::ApiError;

/// Standard error kept from a tool, for the message of its failure.
const MAX_TOOL_STDERR: usize = 4 << 10;

/// A path split for an operation on its last component: the resolved, checked
/// directory that holds it, and its name.
struct Leaf {
    dir: Resolved,
    name: String,
}

impl Leaf {
    fn path(&self) -> String {
        join(&self.dir.existing, Some(&self.name))
    }
}

impl Inner {
    /// Resolves the directory holding `path`'s last component, which must exist.
    async fn leaf(&self, path: &str, op: FileOp) -> Result<Option<Leaf>, ApiError> {
        let rel = relative(path)?;
        let Some(name) = rel.file_name() else {
            return Ok(None);
        };
        let parent = rel
            .parent()
            .map_or_else(String::new, |p| p.display().to_string());
        let dir = self.resolve(&format!("/{parent}")).await?;
        dir.check_in(path, op, Some(&name.to_string_lossy()))?;
        if !dir.missing.is_empty() {
            return Err(not_found(path));
        }
        if !dir.last.dir {
            return Err(
                FileError::os(path, std::io::Error::from_raw_os_error(libc::ENOTDIR)).into(),
            );
        }
        Ok(Some(Leaf {
            dir,
            name: name.to_string_lossy().into_owned(),
        }))
    }

    pub(super) async fn stat_path(&self, path: &str) -> Result<FileInfo, ApiError> {
        let (resolved, name) = match self.leaf(path, FileOp::Stat).await? {
            Some(leaf) => (leaf.path(), leaf.name),
            None => ("/".to_owned(), String::new()),
        };
        let s = self
            .path_stat(&resolved)
            .await?
            .ok_or_else(|| not_found(path))?;
        let stat = Stat::of(&s);
        let link = match stat.symlink {
            true => Some(self.link_target(&resolved).await?),
            false => None,
        };
        let mtime = s
            .modification_time
            .as_deref()
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .map_or(0, |t| t.timestamp());
        Ok(FileInfo {
            name,
            path: path.to_owned(),
            size: stat.size,
            is_dir: stat.dir,
            mode: s.file_mode & 0o7777,
            kind: stat.kind(),
            mtime,
            uid: None,
            gid: None,
            link,
            metadata: Default::default(),
        })
    }

    pub(super) async fn make_dir(&self, req: &MakeDir) -> Result<bool, ApiError> {
        let path = req.path.as_str();
        let resolved = self.resolve(path).await?;
        resolved.check(path, FileOp::MakeDir)?;
        let exists = |reason: &str| FileError::Exists {
            path: path.to_owned(),
            reason: reason.to_owned(),
        };
        if resolved.missing.is_empty() {
            return match (resolved.last.dir, req.exist_ok) {
                (true, true) => Ok(false),
                (true, false) => {
                    Err(exists("is a directory already; pass exist_ok=True to accept one").into())
                }
                (false, _) => Err(exists("exists and is not a directory").into()),
            };
        }
        if !resolved.last.dir {
            return Err(
                FileError::os(path, std::io::Error::from_raw_os_error(libc::ENOTDIR)).into(),
            );
        }
        if resolved.missing.len() > 1 && !req.parents {
            return Err(not_found(path));
        }
        if resolved.missing.iter().any(|n| n == "..") {
            return Err(FileError::Escapes {
                path: path.to_owned(),
            }
            .into());
        }
        let mut target = resolved.existing;
        target.extend(resolved.missing);
        let target = join(&target, None);
        let mode = format!("{:o}", req.mode & 0o7777);
        self.tool(path, &["mkdir", "-p", "-m", &mode, "--", &target])
            .await?;
        Ok(true)
    }

    pub(super) async fn move_path(&self, req: &MovePath) -> Result<(), ApiError> {
        let root = |path: &str| FileError::InvalidPath {
            path: path.to_owned(),
            reason: "is the sandbox's root, which cannot be moved or replaced".into(),
        };
        let src = self
            .leaf(&req.src, FileOp::Move)
            .await?
            .ok_or_else(|| root(&req.src))?;
        let dst = self
            .leaf(&req.dst, FileOp::Move)
            .await?
            .ok_or_else(|| root(&req.dst))?;
        let (src_path, dst_path) = (src.path(), dst.path());
        let moved = self
            .path_stat(&src_path)
            .await?
            .ok_or_else(|| not_found(&req.src))?;
        if dst_path == src_path || dst_path.starts_with(&format!("{src_path}/")) {
            return Err(FileError::InvalidPath {
                path: req.dst.clone(),
                reason: format!("is inside {:?}, which cannot move into itself", req.src),
            }
            .into());
        }
        let exists = |reason: &str| FileError::Exists {
            path: req.dst.clone(),
            reason: reason.to_owned(),
        };
        if let Some(there) = self.path_stat(&dst_path).await? {
            let there = Stat::of(&there);
            if !req.overwrite {
                return Err(exists("exists; pass overwrite=True to replace it").into());
            }
            match (Stat::of(&moved).dir, there.dir) {
                // rename(2) replaces an empty directory only; `mv` would move into it.
                (true, true) => {
                    self.tool(&req.dst, &["rmdir", "--", &dst_path])
                        .await
                        .map_err(|_| exists("is a directory that is not empty; remove it first"))?;
                }
                (false, true) => {
                    return Err(exists("is a directory, which only a directory can replace").into())
                }
                (true, false) => {
                    return Err(
                        exists("is not a directory, which a directory cannot replace").into(),
                    )
                }
                (false, false) => {}
            }
        }
        self.tool(&req.src, &["mv", "-f", "--", &src_path, &dst_path])
            .await
    }

    pub(super) async fn remove_path(&self, req: &RemovePath) -> Result<(), ApiError> {
        let path = req.path.as_str();
        let leaf =
            self.leaf(path, FileOp::Remove)
                .await?
                .ok_or_else(|| FileError::InvalidPath {
                    path: path.to_owned(),
                    reason: "is the sandbox's root, which cannot be removed".into(),
                })?;
        let target = leaf.path();
        let stat = self
            .path_stat(&target)
            .await?
            .map(|s| Stat::of(&s))
            .ok_or_else(|| not_found(path))?;
        match (stat.dir, req.recursive) {
            (true, false) => self
                .tool(path, &["rmdir", "--", &target])
                .await
                .map_err(|_| {
                    FileError::WrongType {
                        path: path.to_owned(),
                        reason: "is a directory that is not empty; pass recursive=True".into(),
                    }
                    .into()
                }),
            (true, true) => self.tool(path, &["rm", "-rf", "--", &target]).await,
            (false, _) => self.tool(path, &["rm", "-f", "--", &target]).await,
        }
    }

    /// Runs `argv` as root in the container and waits for it; its failure is an error
    /// about `path` carrying its standard error.
    async fn tool(&self, path: &str, argv: &[&str]) -> Result<(), ApiError> {
        let config = CreateExecOptions {
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            user: Some("0".to_owned()),
            cmd: Some(argv.iter().map(|a| (*a).to_owned()).collect()),
            ..Default::default()
        };
        let exec = self
            .docker
            .create_exec(&self.id, config)
            .await
            .map_err(|e| exec_error(self, e))?;
        let opts = StartExecOptions {
            detach: false,
            tty: false,
            output_capacity: None,
        };
        let mut stderr = Vec::new();
        if let StartExecResults::Attached { mut output, .. } = self
            .docker
            .start_exec(&exec.id, Some(opts))
            .await
            .map_err(|e| exec_error(self, e))?
        {
            while let Some(piece) = output.next().await {
                if let Ok(bollard::container::LogOutput::StdErr { message }) = piece {
                    let room = MAX_TOOL_STDERR.saturating_sub(stderr.len());
                    stderr.extend_from_slice(&message[..message.len().min(room)]);
                }
            }
        }
        let inspect = self
            .docker
            .inspect_exec(&exec.id)
            .await
            .map_err(|e| exec_error(self, e))?;
        match inspect.exit_code {
            Some(0) => Ok(()),
            code => Err(FileError::Io {
                path: path.to_owned(),
                errno: None,
                message: format!(
                    "{} failed in the container (exit status {}): {}",
                    argv[0],
                    code.map_or_else(|| "unknown".to_owned(), |c| c.to_string()),
                    String::from_utf8_lossy(&stderr).trim()
                ),
            }
            .into()),
        }
    }
}
