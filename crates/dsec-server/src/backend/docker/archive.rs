//! Tar archives, the archive API's only currency: downloads spooled to an anonymous file
//! under a bound, a file or a directory listing read from them, and the head and padding
//! of an upload whose contents are streamed between them.

use std::fs::File;
use std::io::Seek;
use std::path::PathBuf;

use async_trait::async_trait;
use axum::body::Bytes;
use bollard::errors::Error as DockerError;
use bollard::query_parameters::DownloadFromContainerOptionsBuilder;
use dsec_api::{FileInfo, FileKind};
use dsec_runtime::files::FileError;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

use super::host::daemon_error;
use super::Inner;
use crate::backend::files::{upload_pieces, FILE_CHUNK};
use crate::backend::{FileRead, Upload};
use crate::error::ApiError;

/// Bound on the archive of a directory being listed (the daemon sends contents too).
pub(super) const MAX_LIST_ARCHIVE: u64 = 1 << 30;
/// Bound on the archive of a symbolic link.
const MAX_LINK_ARCHIVE: u64 = 64 << 10;
/// A file's archive beyond its size: headers, long names, padding.
pub(super) const ARCHIVE_OVERHEAD: u64 = 64 << 10;

/// Whether the daemon failed because a command changed the path while the daemon worked
/// on it (after dsec resolved it): a directory on it swapped for a file or a link (or
/// back) or removed — the daemon, told never to replace one with the other, refuses, or
/// finds a file where it was to make a missing directory, or the directory gone — or a
/// link swapped for a file between the daemon's `lstat` and its `readlink` (`EINVAL`).
pub(super) fn changed_under_the_daemon(message: &str) -> bool {
    message.contains("cannot overwrite")
        || (message.contains("readlink") && message.contains("invalid argument"))
        || (message.contains("Error processing tar file")
            && [
                "file exists",
                "not a directory",
                "no such file or directory",
            ]
            .iter()
            .any(|m| message.contains(m)))
}

impl Inner {
    /// The archive of `path` (a resolved path), spooled to an anonymous file; `None` when
    /// it is larger than `limit`.
    pub(super) async fn download(&self, path: &str, limit: u64) -> Result<Option<File>, ApiError> {
        let opts = DownloadFromContainerOptionsBuilder::new()
            .path(path)
            .build();
        let stream = self.docker.download_from_container(&self.id, Some(opts));
        spool(stream, limit).await.map_err(|e| match &e {
            DockerError::DockerResponseServerError { message, .. }
                if changed_under_the_daemon(message) =>
            {
                ApiError::conflict(format!(
                    "reading {path:?}: the path changed in the sandbox while it was read \
                     ({message})"
                ))
            }
            _ => daemon_error(&self.host, "reading from the container", e),
        })
    }

    /// The raw target of the symbolic link at `path`, read from its one-entry archive. A
    /// link that a command replaced (or removed) since it was seen is a conflict: its
    /// archive is then that of whatever took its place.
    pub(super) async fn link_target(&self, path: &str) -> Result<String, ApiError> {
        let changed = {
            let path = path.to_owned();
            move || {
                ApiError::conflict(format!(
                    "{path:?} changed in the sandbox while it was resolved: the symbolic link \
                     was replaced"
                ))
            }
        };
        let tar = self
            .download(path, MAX_LINK_ARCHIVE)
            .await?
            .ok_or_else(changed.clone())?;
        blocking(move || {
            let mut archive = tar::Archive::new(tar);
            let mut entries = archive.entries().map_err(io_internal)?;
            let entry = entries
                .next()
                .ok_or_else(changed.clone())?
                .map_err(io_internal)?;
            let target = entry
                .link_name()
                .map_err(io_internal)?
                .ok_or_else(changed)?;
            Ok(target.to_string_lossy().into_owned())
        })
        .await
    }
}

fn io_internal(e: std::io::Error) -> ApiError {
    ApiError::internal(format!("reading the container's archive: {e}"))
}

pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
}

/// Writes a byte stream to an anonymous temporary file, rewound: memory stays bounded
/// whatever the size, and the disk by `limit` (`None` beyond it).
async fn spool<B: AsRef<[u8]>>(
    stream: impl Stream<Item = Result<B, DockerError>>,
    limit: u64,
) -> Result<Option<File>, DockerError> {
    let mut stream = std::pin::pin!(stream);
    let file = tempfile::tempfile().map_err(|err| DockerError::IOError { err })?;
    let mut out = tokio::fs::File::from_std(file);
    let mut written = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        written += chunk.as_ref().len() as u64;
        if written > limit {
            return Ok(None);
        }
        out.write_all(chunk.as_ref())
            .await
            .map_err(|err| DockerError::IOError { err })?;
    }
    let mut file = out.into_std().await;
    file.rewind().map_err(|err| DockerError::IOError { err })?;
    Ok(Some(file))
}

/// A tar holding the missing parent directories (mode 0755) and the file.
pub(super) fn tar_head(names: &[String], size: u64, mode: u32) -> Result<Bytes, ApiError> {
    let mtime = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut builder = tar::Builder::new(Vec::with_capacity(4096));
    let err = |e: std::io::Error| ApiError::internal(format!("building the upload: {e}"));
    let (file, dirs) = names
        .split_last()
        .ok_or_else(|| ApiError::invalid("empty path"))?;
    let mut prefix = PathBuf::new();
    for d in dirs {
        prefix.push(d);
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(0o755);
        h.set_size(0);
        h.set_mtime(mtime);
        builder
            .append_data(&mut h, &prefix, std::io::empty())
            .map_err(err)?;
    }
    prefix.push(file);
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(mode & 0o7777);
    h.set_size(size);
    h.set_mtime(mtime);
    // The header (and a long name's extra entry) only: the contents follow as they come.
    builder
        .append_data(&mut h, &prefix, std::io::empty())
        .map_err(err)?;
    Ok(Bytes::from(std::mem::take(builder.get_mut())))
}

/// Zero bytes that complete the last 512-byte block of a `size`-byte entry.
pub(super) fn tar_padding(size: u64) -> usize {
    ((512 - size % 512) % 512) as usize
}

/// A file's contents inside a spooled archive, read a chunk at a time.
pub(super) struct SpooledRead {
    file: tokio::fs::File,
    left: u64,
}

impl SpooledRead {
    /// The regular file that is the first entry of `tar`, the archive of `path`.
    pub(super) async fn open(tar: File, path: String) -> Result<SpooledRead, ApiError> {
        let (tar, start, size) = blocking(move || {
            let (start, size) = {
                let mut archive = tar::Archive::new(&tar);
                let mut entries = archive.entries().map_err(io_internal)?;
                let entry = entries
                    .next()
                    .ok_or_else(|| ApiError::internal("the daemon sent an empty archive"))?
                    .map_err(io_internal)?;
                if !entry.header().entry_type().is_file() {
                    return Err(FileError::WrongType {
                        path,
                        reason: "is not a regular file".into(),
                    }
                    .into());
                }
                (entry.raw_file_position(), entry.size())
            };
            // The daemon sizes the entry from a stat, then copies: a file a command
            // replaced or truncated in between leaves the archive short of its header.
            let spooled = tar.metadata().map_err(io_internal)?.len();
            if spooled < start.saturating_add(size) {
                return Err(ApiError::conflict(format!(
                    "{path:?} changed in the sandbox while it was read: read it again"
                )));
            }
            Ok((tar, start, size))
        })
        .await?;
        let mut file = tokio::fs::File::from_std(tar);
        file.seek(std::io::SeekFrom::Start(start))
            .await
            .map_err(io_internal)?;
        Ok(SpooledRead { file, left: size })
    }
}

#[async_trait]
impl FileRead for SpooledRead {
    async fn next(&mut self) -> Option<Result<Bytes, ApiError>> {
        if self.left == 0 {
            return None;
        }
        let mut chunk =
            vec![0; usize::try_from(self.left).map_or(FILE_CHUNK, |l| l.min(FILE_CHUNK))];
        let read = self.file.read_exact(&mut chunk).await;
        self.left = match read {
            Ok(_) => self.left - chunk.len() as u64,
            Err(_) => 0,
        };
        Some(read.map(|_| Bytes::from(chunk)).map_err(io_internal))
    }

    fn finished(&self) -> bool {
        self.left == 0
    }
}

/// The upload's contents and their exact length, which the archive's header needs first:
/// as they arrive when the client announced the length, else spooled to an anonymous
/// file.
pub(super) async fn sized(
    mut data: Upload,
    path: &str,
) -> Result<(u64, BoxStream<'static, Result<Bytes, ApiError>>), ApiError> {
    if let Some(len) = data.declared_len() {
        return Ok((len, upload_pieces(data, path.to_owned()).boxed()));
    }
    let mut spool = tokio::fs::File::from_std(
        tempfile::tempfile().map_err(|e| ApiError::internal(format!("temporary file: {e}")))?,
    );
    let mut size = 0;
    loop {
        let (pieces, more) = data.chunk(path).await?;
        for piece in pieces {
            size += piece.len() as u64;
            spool.write_all(&piece).await.map_err(io_internal)?;
        }
        if !more {
            break;
        }
    }
    spool.rewind().await.map_err(io_internal)?;
    let chunks = tokio_util::io::ReaderStream::with_capacity(spool, FILE_CHUNK)
        .map(|r| r.map_err(io_internal));
    Ok((size, chunks.boxed()))
}

/// The direct children of the archived directory, sorted by name.
/// The entries of a directory's archive `depth` levels below it.
pub(super) fn list_tar(tar: File, depth: u32) -> Result<Vec<FileInfo>, ApiError> {
    let depth = usize::try_from(depth.max(1)).unwrap_or(usize::MAX);
    let mut archive = tar::Archive::new(tar);
    let mut base: Option<Vec<String>> = None;
    let mut out = Vec::new();
    for entry in archive.entries().map_err(io_internal)? {
        let entry = entry.map_err(io_internal)?;
        let path = entry.path().map_err(io_internal)?;
        let comps: Vec<String> = path
            .components()
            .filter_map(|c| match c {
                std::path::Component::Normal(n) => Some(n.to_string_lossy().into_owned()),
                _ => None,
            })
            .collect();
        // The first entry is the directory itself.
        let Some(base) = &base else {
            base = Some(comps);
            continue;
        };
        if comps.len() <= base.len() || comps.len() > base.len() + depth || !comps.starts_with(base)
        {
            continue;
        }
        let header = entry.header();
        let kind = header.entry_type();
        let size = if kind.is_symlink() {
            entry
                .link_name()
                .ok()
                .flatten()
                .map_or(0, |l| l.as_os_str().len() as u64)
        } else {
            header.size().unwrap_or(0)
        };
        let file_kind = if kind.is_dir() {
            FileKind::Dir
        } else if kind.is_symlink() {
            FileKind::Symlink
        } else if kind.is_file() {
            FileKind::File
        } else {
            FileKind::Other
        };
        out.push(FileInfo {
            name: comps[comps.len() - 1].clone(),
            path: comps[base.len()..].join("/"),
            size,
            is_dir: kind.is_dir(),
            mode: header.mode().unwrap_or(0) & 0o7777,
            kind: file_kind,
            mtime: header
                .mtime()
                .ok()
                .and_then(|t| i64::try_from(t).ok())
                .unwrap_or(0),
            uid: header.uid().ok().and_then(|u| u32::try_from(u).ok()),
            gid: header.gid().ok().and_then(|g| u32::try_from(g).ok()),
            link: entry
                .link_name()
                .ok()
                .flatten()
                .filter(|_| kind.is_symlink())
                .map(|l| l.to_string_lossy().into_owned()),
            metadata: Default::default(),
        });
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}
#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn upload_tar_holds_missing_parents_then_the_file() {
        let long = "n".repeat(150);
        for name in ["f.txt", long.as_str()] {
            let names = ["a".to_owned(), "b".to_owned(), name.to_owned()];
            let contents = vec![7u8; 700];
            // As the upload streams it: the head, the contents, the padding and the end.
            let mut tar = tar_head(&names, contents.len() as u64, 0o640)
                .unwrap()
                .to_vec();
            tar.extend_from_slice(&contents);
            tar.resize(tar.len() + tar_padding(contents.len() as u64) + 1024, 0);
            assert_eq!(tar.len() % 512, 0);
            let mut archive = tar::Archive::new(&tar[..]);
            let entries: Vec<(String, u32, bool, Vec<u8>)> = archive
                .entries()
                .unwrap()
                .map(|e| {
                    let mut e = e.unwrap();
                    let mut data = Vec::new();
                    std::io::Read::read_to_end(&mut e, &mut data).unwrap();
                    (
                        e.path().unwrap().to_string_lossy().into_owned(),
                        e.header().mode().unwrap(),
                        e.header().entry_type().is_dir(),
                        data,
                    )
                })
                .collect();
            assert_eq!(
                entries,
                vec![
                    ("a".into(), 0o755, true, vec![]),
                    ("a/b".into(), 0o755, true, vec![]),
                    (format!("a/b/{name}"), 0o640, false, contents),
                ]
            );
        }
    }

    #[test]
    fn listing_keeps_direct_children_only() {
        let mut builder = tar::Builder::new(Vec::new());
        for (path, dir) in [("ls", true), ("ls/a.txt", false), ("ls/sub", true)] {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(if dir {
                tar::EntryType::Directory
            } else {
                tar::EntryType::Regular
            });
            h.set_mode(if dir { 0o755 } else { 0o640 });
            h.set_size(if dir { 0 } else { 3 });
            let data: &[u8] = if dir { b"" } else { b"abc" };
            builder.append_data(&mut h, path, data).unwrap();
        }
        let mut h = tar::Header::new_gnu();
        h.set_size(0);
        h.set_mode(0o644);
        builder
            .append_data(&mut h, "ls/sub/deep", &b""[..])
            .unwrap();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&builder.into_inner().unwrap()).unwrap();
        let mut list = |depth| {
            file.rewind().unwrap();
            list_tar(file.try_clone().unwrap(), depth).unwrap()
        };
        let first = list(1);
        let names: Vec<(&str, u64, bool, u32)> = first
            .iter()
            .map(|f| (f.name.as_str(), f.size, f.is_dir, f.mode))
            .collect();
        assert_eq!(
            names,
            vec![("a.txt", 3, false, 0o640), ("sub", 0, true, 0o755)]
        );
        let paths: Vec<String> = list(2).into_iter().map(|f| f.path).collect();
        assert_eq!(paths, ["a.txt", "sub", "sub/deep"]);
    }
}
