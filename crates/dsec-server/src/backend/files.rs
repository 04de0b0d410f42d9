//! The files API on the edge's side of every backend: reads as a stream of chunks
//! ([`FileRead`]), writes from a stream of chunks ([`Upload`]), and the three operations
//! for sandboxes whose init or guest agent serves its own files over the control channel
//! (`container`, `microvm`, `vm`; see `dsec_runtime::files`).
//!
//! The edge holds at most a chunk ([`FILE_CHUNK`]) per transfer: a read asks for the
//! next chunk only when the HTTP client took the last one, a write forwards the upload
//! as it arrives. So a slow client slows its own transfer, and neither a large file nor
//! many of them grow the server.

use std::collections::BTreeMap;
use std::pin::Pin;

use async_trait::async_trait;
use axum::body::Bytes;
use dsec_api::FileInfo;
use dsec_runtime::channel::{Channel, WatchHandle};
use dsec_runtime::files::client::FileReader;
use dsec_runtime::files::watch::WatchEvent;
use dsec_runtime::files::{FileError, FileOp};
pub use dsec_runtime::proto::FILE_CHUNK;
use futures::{Stream, StreamExt};

use super::file_info;
use crate::error::ApiError;

/// Most entries `list_files` returns; a larger directory is refused, not cut short.
pub const MAX_LIST_ENTRIES: usize = 100_000;

/// A file being read out of a sandbox, a chunk at a time.
#[async_trait]
pub trait FileRead: Send {
    /// The next chunk; `None` after the last.
    async fn next(&mut self) -> Option<Result<Bytes, ApiError>>;
    /// Whether every chunk has been returned, known without asking the sandbox again.
    fn finished(&self) -> bool;
}

type Body = Pin<Box<dyn Stream<Item = Result<Bytes, String>> + Send>>;

/// The bytes of a file write, as they arrive from the client.
pub struct Upload {
    body: Body,
    /// The length the client announced (`Content-Length`), if it did.
    declared: Option<u64>,
    /// A piece read ahead, to know whether the body goes on.
    ahead: Option<Bytes>,
    received: u64,
    limit: u64,
    /// Metadata to replace the file's with (`dsec_runtime::files::metadata`); `None`
    /// leaves the file's as it is.
    metadata: Option<BTreeMap<String, String>>,
}

impl Upload {
    /// An upload from a request body of `declared` bytes, if known.
    pub fn new<E: std::fmt::Display>(
        body: impl Stream<Item = Result<Bytes, E>> + Send + 'static,
        declared: Option<u64>,
    ) -> Upload {
        Upload {
            body: Box::pin(body.map(|r| r.map_err(|e| e.to_string()))),
            declared,
            ahead: None,
            received: 0,
            limit: u64::MAX,
            metadata: None,
        }
    }

    /// The same upload, replacing the file's metadata with `metadata`.
    pub fn with_metadata(mut self, metadata: BTreeMap<String, String>) -> Upload {
        self.metadata = Some(metadata);
        self
    }

    /// The metadata to set, taken: a backend that cannot keep metadata refuses a set
    /// that is not empty rather than drop it.
    pub fn take_metadata(&mut self) -> Option<BTreeMap<String, String>> {
        self.metadata.take()
    }

    /// An upload of bytes already in memory (a command's `files`).
    pub fn whole(data: Vec<u8>) -> Upload {
        let len = data.len() as u64;
        Upload::new(
            futures::stream::iter([Ok::<_, String>(Bytes::from(data))]),
            Some(len),
        )
    }

    /// The length the client announced, if it did.
    pub fn declared_len(&self) -> Option<u64> {
        self.declared
    }

    /// Refuse more than `limit` bytes.
    pub(crate) fn set_limit(&mut self, limit: u64) {
        self.limit = limit;
    }

    /// Reads and drops up to `max` bytes of what the client is sending, so that a
    /// client refused early still reads the answer instead of a reset connection.
    pub(crate) async fn discard(mut self, max: u64) {
        let mut seen = 0;
        while seen < max {
            match self.body.next().await {
                Some(Ok(piece)) => seen += piece.len() as u64,
                _ => return,
            }
        }
    }

    /// The next chunk of at most [`FILE_CHUNK`] bytes, in the pieces the client sent it
    /// (never copied into one), and whether more follows. An empty body gives no piece.
    pub async fn chunk(&mut self, path: &str) -> Result<(Vec<Bytes>, bool), ApiError> {
        let mut pieces: Vec<Bytes> = Vec::new();
        let mut len = 0;
        while len < FILE_CHUNK {
            let Some(mut piece) = self.piece(path).await? else {
                break;
            };
            if piece.len() > FILE_CHUNK - len {
                self.ahead = Some(piece.split_off(FILE_CHUNK - len));
            }
            len += piece.len();
            pieces.push(piece);
        }
        if self.ahead.is_none() {
            self.ahead = self.piece(path).await?;
        }
        Ok((pieces, self.ahead.is_some()))
    }

    async fn piece(&mut self, path: &str) -> Result<Option<Bytes>, ApiError> {
        if let Some(piece) = self.ahead.take() {
            return Ok(Some(piece));
        }
        loop {
            match self.body.next().await {
                None => return Ok(None),
                Some(Err(e)) => {
                    return Err(ApiError::invalid(format!(
                        "the upload of {path:?} broke off: {e}"
                    )))
                }
                Some(Ok(piece)) if piece.is_empty() => continue,
                Some(Ok(piece)) => {
                    self.received += piece.len() as u64;
                    if self.received > self.limit {
                        return Err(too_large_upload(path, None, self.limit).into());
                    }
                    return Ok(Some(piece));
                }
            }
        }
    }
}

/// The upload as a stream of the pieces the client sent.
pub(crate) fn upload_pieces(
    upload: Upload,
    path: String,
) -> impl Stream<Item = Result<Bytes, ApiError>> + Send + 'static {
    futures::stream::unfold(Some(upload), move |state| {
        let path = path.clone();
        async move {
            let mut upload = state?;
            match upload.chunk(&path).await {
                Ok((pieces, more)) => Some((Ok(pieces), more.then_some(upload))),
                Err(e) => Some((Err(e), None)),
            }
        }
    })
    .flat_map(|chunk| {
        let items: Vec<Result<Bytes, ApiError>> = match chunk {
            Ok(pieces) => pieces.into_iter().map(Ok).collect(),
            Err(e) => vec![Err(e)],
        };
        futures::stream::iter(items)
    })
}

/// The refusal of an upload over `limit` bytes (`size`, when announced).
pub(crate) fn too_large_upload(path: &str, size: Option<u64>, limit: u64) -> FileError {
    let size = size.map_or_else(
        || "exceeds".to_owned(),
        |s| format!("is {} MiB, over", s.div_ceil(1 << 20)),
    );
    FileError::TooLarge {
        path: path.to_owned(),
        op: FileOp::Write,
        what: format!(
            "{size} the server's limit of {} MiB for a file write \
             (dsec serve --max-upload-mb, --max-file-mb)",
            limit >> 20
        ),
    }
}

/// An armed watch of a directory: its events in batches, as they happen.
#[async_trait]
pub trait FileWatch: Send {
    /// The next batch; `None` once the watched directory is gone.
    async fn next(&mut self) -> Option<Result<Vec<WatchEvent>, ApiError>>;
}

/// Watches a directory of a sandbox whose init or agent serves its files.
pub(crate) async fn watch_served(
    channel: &Channel,
    path: &str,
    recursive: bool,
) -> Result<Box<dyn FileWatch>, ApiError> {
    Ok(Box::new(ServedWatch(channel.watch(path, recursive).await?)))
}

struct ServedWatch(WatchHandle);

#[async_trait]
impl FileWatch for ServedWatch {
    async fn next(&mut self) -> Option<Result<Vec<WatchEvent>, ApiError>> {
        self.0.next().await.map(|r| r.map_err(ApiError::from))
    }
}

/// Reads a file that the sandbox's init or agent serves.
pub(crate) async fn read_served(
    channel: &Channel,
    path: &str,
    max_bytes: u64,
) -> Result<Box<dyn FileRead>, ApiError> {
    let reader = channel.read_file(path, max_bytes).await?;
    Ok(Box::new(ServedRead(reader)))
}

struct ServedRead(FileReader);

#[async_trait]
impl FileRead for ServedRead {
    async fn next(&mut self) -> Option<Result<Bytes, ApiError>> {
        self.0
            .next()
            .await
            .map_err(ApiError::from)
            .transpose()
            .map(|r| r.map(Bytes::from))
    }

    fn finished(&self) -> bool {
        self.0.finished()
    }
}

/// Writes a file that the sandbox's init or agent serves, chunk by chunk as it arrives:
/// while the sandbox writes one chunk, the next is read from the client.
pub(crate) async fn write_served(
    channel: &Channel,
    path: &str,
    mode: u32,
    mut upload: Upload,
) -> Result<(), ApiError> {
    // The first chunk is in hand before the file is opened: a small file is one round
    // trip, and an upload that fails at once leaves the file as it was.
    let (first, more) = upload.chunk(path).await?;
    let metadata = upload.take_metadata();
    let mut writer = channel
        .write_file(path, mode, metadata, &slices(&first), !more)
        .await?;
    drop(first);
    let mut next = match more {
        true => Some(upload.chunk(path).await?),
        false => None,
    };
    while let Some((chunk, more)) = next.take() {
        let parts = slices(&chunk);
        let read_ahead = async {
            match more {
                true => upload.chunk(path).await.map(Some),
                false => Ok(None),
            }
        };
        let (written, ahead) = tokio::join!(writer.write(&parts, !more), read_ahead);
        written?;
        next = ahead?;
    }
    Ok(())
}

fn slices(pieces: &[Bytes]) -> Vec<&[u8]> {
    pieces.iter().map(|p| &p[..]).collect()
}

/// Lists a directory that the sandbox's init or agent serves.
pub(crate) async fn list_served(
    channel: &Channel,
    path: &str,
    depth: u32,
) -> Result<Vec<FileInfo>, ApiError> {
    let entries = channel.list_dir(path, MAX_LIST_ENTRIES, depth).await?;
    Ok(entries.into_iter().map(file_info).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upload(pieces: &[usize], declared: Option<u64>) -> Upload {
        let pieces: Vec<Result<Bytes, String>> = pieces
            .iter()
            .enumerate()
            .map(|(i, n)| Ok(Bytes::from(vec![u8::try_from(i).unwrap(); *n])))
            .collect();
        Upload::new(futures::stream::iter(pieces), declared)
    }

    #[tokio::test]
    async fn chunks_gather_pieces_and_know_when_the_body_ends() {
        let mut u = upload(&[10, FILE_CHUNK, 5], None);
        let (a, more) = u.chunk("/f").await.unwrap();
        let lens = |c: &[Bytes]| c.iter().map(Bytes::len).collect::<Vec<_>>();
        assert_eq!(lens(&a), [10, FILE_CHUNK - 10]);
        assert!(more);
        assert_eq!(a[1][0], 1);
        let (b, more) = u.chunk("/f").await.unwrap();
        assert_eq!(lens(&b), [10, 5]);
        assert!(!more);
        let mut empty = upload(&[], Some(0));
        assert_eq!(empty.chunk("/f").await.unwrap(), (vec![], false));
    }

    #[tokio::test]
    async fn an_upload_over_its_limit_is_refused() {
        let mut u = upload(&[600, 600], None);
        u.set_limit(1000);
        let err = u.chunk("/big").await.unwrap_err();
        assert_eq!(err.kind, dsec_api::ErrorKind::PayloadTooLarge);
        assert!(err.message.contains("/big"), "{}", err.message);
    }
}
