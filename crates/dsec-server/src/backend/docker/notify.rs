//! `watch` on a Docker container: inotify on this host, over the container's merged root
//! directory (the overlay mount the daemon made, `GraphDriver.Data.MergedDir`).
//!
//! The path is resolved and checked as for reads ([`super::paths`]), then watched beneath
//! the merged directory with the same confined resolution the native backends use inside
//! the sandbox ([`SandboxRoot`], [`Watches`]). Writes the container makes through its
//! root are seen; what it writes on its own mounts (volumes, a tmpfs) is not, since those
//! are not in the merged directory. Needs the daemon on this host and an overlay-style
//! storage driver; each watch is its own inotify instance, [`MAX_WATCHES`] per container.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dsec_runtime::files::watch::{WatchEvent, Watches, MAX_WATCHES};
use dsec_runtime::files::{FileError, FileOp, SandboxRoot};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::OwnedSemaphorePermit;

use super::archive::blocking;
use super::host::daemon_error;
use super::paths::join;
use super::Inner;
use crate::backend::FileWatch;
use crate::error::ApiError;

/// The id of the one watch each instance holds.
const WATCH_ID: u32 = 1;

/// How often a quiet watch checks that its container still runs: a stopped one's merged
/// directory lives on while the watch holds it, and reports nothing more.
const ALIVE_CHECK: Duration = Duration::from_secs(1);

impl Inner {
    pub(super) async fn watch(
        self: &Arc<Self>,
        path: &str,
        recursive: bool,
    ) -> Result<Box<dyn FileWatch>, ApiError> {
        if self.local.is_none() {
            return Err(unsupported(path, "the daemon is not on this host"));
        }
        let resolved = self.resolve_dir(path, FileOp::Watch).await?;
        let permit = Arc::clone(&self.watches).try_acquire_owned().map_err(|_| {
            FileError::TooManyWatches {
                path: path.to_owned(),
                limit: MAX_WATCHES,
            }
        })?;
        let info = self
            .docker
            .inspect_container(&self.id, None)
            .await
            .map_err(|e| daemon_error(&self.host, "inspecting the container", e))?;
        let merged = info
            .graph_driver
            .and_then(|g| g.data.get("MergedDir").cloned())
            .ok_or_else(|| unsupported(path, "its storage driver shows no merged directory"))?;
        let inside = join(&resolved.existing, None);
        let (root, watches, fd) = blocking(move || {
            let root = SandboxRoot::open(Path::new(&merged)).map_err(|e| {
                ApiError::internal(format!("opening the container's root {merged}: {e}"))
            })?;
            let mut watches = Watches::default();
            watches.add(&root, WATCH_ID, &inside, recursive)?;
            let fd: OwnedFd = watches
                .fd()
                .ok_or_else(|| ApiError::internal("a watch without an inotify descriptor"))?
                .try_clone_to_owned()
                .map_err(|e| {
                    ApiError::internal(format!("duplicating the inotify descriptor: {e}"))
                })?;
            Ok((root, watches, fd))
        })
        .await?;
        // SAFETY: the `OwnedFd` is moved into the `AsyncFd`, which owns it (and so keeps it
        // open, naming the same inotify instance) until it is dropped.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(|e| ApiError::internal(format!("polling the inotify descriptor: {e}")))?;
        Ok(Box::new(DockerWatch {
            container: Arc::clone(self),
            root,
            watches,
            fd,
            ended: false,
            _permit: permit,
        }))
    }
}

fn unsupported(path: &str, why: &str) -> ApiError {
    ApiError::invalid(format!(
        "cannot watch {path:?} in this docker sandbox: {why}; poll stat or list_files, or \
         use a container, microvm or vm sandbox"
    ))
}

struct DockerWatch {
    container: Arc<Inner>,
    root: SandboxRoot,
    watches: Watches,
    fd: AsyncFd<OwnedFd>,
    ended: bool,
    /// One of the container's [`MAX_WATCHES`].
    _permit: OwnedSemaphorePermit,
}

#[async_trait]
impl FileWatch for DockerWatch {
    async fn next(&mut self) -> Option<Result<Vec<WatchEvent>, ApiError>> {
        while !self.ended {
            let mut guard = match tokio::time::timeout(ALIVE_CHECK, self.fd.readable()).await {
                Err(_) => {
                    self.ended = !self.container.alive.get();
                    continue;
                }
                Ok(Ok(guard)) => guard,
                Ok(Err(e)) => {
                    self.ended = true;
                    return Some(Err(ApiError::internal(format!(
                        "polling the inotify descriptor: {e}"
                    ))));
                }
            };
            // The whole queue is read: the descriptor is not ready until more comes.
            let pumped = self.watches.pump(Some(&self.root));
            guard.clear_ready();
            self.ended = !pumped.ended.is_empty();
            let events: Vec<WatchEvent> = pumped.events.into_iter().flat_map(|(_, e)| e).collect();
            if !events.is_empty() {
                return Some(Ok(events));
            }
        }
        None
    }
}
