//! Deleting staging trees off the import's path.
//!
//! Once a layer's blob is built, its unpacked staging tree is only scratch, but
//! deleting a multi-GiB tree takes about as long as unpacking it did. The tree is
//! renamed into `trash/` (instant: the same filesystem as `staging/`) and one thread
//! per store deletes what lands there. A crash leaves at most the trash's contents,
//! which the next open hands to the same thread.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Sender};
use std::thread;

use tempfile::TempDir;

/// An edge-local directory whose contents are deleted in the background.
#[derive(Debug)]
pub(crate) struct Trash {
    dir: PathBuf,
    sweeper: Sender<PathBuf>,
}

impl Trash {
    /// Opens (creating if needed) the trash at `dir`, queueing what a crashed run left
    /// in it, and starts its sweeper; the sweeper ends once the store is dropped and
    /// the queue is empty.
    pub(crate) fn open(dir: &Path) -> io::Result<Trash> {
        fs::create_dir_all(dir)?;
        let (sweeper, queue) = mpsc::channel::<PathBuf>();
        for entry in fs::read_dir(dir)? {
            // The receiver is alive until the thread below ends: sending cannot fail.
            let _ = sweeper.send(entry?.path());
        }
        thread::Builder::new()
            .name("dsec-image-trash".to_owned())
            .spawn(move || {
                for path in queue {
                    remove(&path);
                }
            })?;
        Ok(Trash {
            dir: dir.to_owned(),
            sweeper,
        })
    }

    /// Moves `tree` out of the way and has it deleted in the background; deletes it
    /// here when it cannot be moved (another filesystem, a name already taken).
    pub(crate) fn discard(&self, tree: TempDir) {
        let Some(name) = tree.path().file_name() else {
            return;
        };
        let dest = self.dir.join(name);
        if fs::rename(tree.path(), &dest).is_ok() {
            // The tree is in the trash now: nothing is left for TempDir's drop to delete.
            let _ = tree.keep();
            if let Err(mpsc::SendError(path)) = self.sweeper.send(dest) {
                remove(&path);
            }
        }
    }
}

fn remove(path: &Path) {
    let removed = if path.is_dir() && !path.is_symlink() {
        fs::remove_dir_all(path)
    } else {
        fs::remove_file(path)
    };
    if let Err(e) = removed {
        tracing::warn!(path = %path.display(), error = %e, "cannot delete a discarded staging tree");
    }
}
