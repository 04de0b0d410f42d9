//! The edge's side of the files API: file operations on a sandbox, asked of the process
//! that serves them inside it ([`super::service`]) over its control [`Channel`].
//!
//! A read is pulled one chunk at a time ([`FileReader::next`]), so the edge holds one
//! chunk per transfer and a slow consumer slows the transfer instead of growing the
//! server; a write is pushed the same way ([`FileWriter::write`]). A reader or writer
//! dropped before the end tells the sandbox to close the transfer.

use super::Entry;
use crate::channel::{channel_err, Channel};
use crate::container::RuntimeError;
use crate::proto::{self, Frame, FrameKind};

impl Channel {
    /// Opens a regular file for reading; refuses one larger than `max_bytes`. The answer
    /// already holds the first chunk.
    pub async fn read_file(&self, path: &str, max_bytes: u64) -> Result<FileReader, RuntimeError> {
        let req = proto::OpenRead {
            path: path.to_owned(),
            max_bytes,
        };
        let answer = self
            .request(FrameKind::ReadFile, &as_user_json(req))
            .await?;
        let (opened, first): (proto::Opened, Vec<u8>) = split(answer)?;
        Ok(FileReader {
            channel: self.clone(),
            id: opened.transfer,
            size: opened.size,
            first: Some(first),
            done: opened.last,
        })
    }

    /// Opens `path` for writing (created with `mode`, or truncated), replaces its
    /// metadata with `metadata` when given, and writes `data` (in parts, as they came);
    /// with `last`, that is the whole file.
    pub async fn write_file(
        &self,
        path: &str,
        mode: u32,
        metadata: Option<std::collections::BTreeMap<String, String>>,
        data: &[&[u8]],
        last: bool,
    ) -> Result<FileWriter, RuntimeError> {
        let header = proto::json_header(&proto::AsUserRequest {
            req: proto::OpenWrite {
                path: path.to_owned(),
                mode,
                last,
                metadata,
            },
            user: current_user(),
        });
        let answer = self
            .request_parts(FrameKind::WriteFile, &with_header(&header, data))
            .await?;
        let opened: proto::Opened = serde_json::from_slice(&answer).map_err(channel_err)?;
        Ok(FileWriter {
            channel: self.clone(),
            id: opened.transfer,
            done: opened.last,
        })
    }

    /// Lists a directory `depth` levels deep; refuses a listing of more than
    /// `max_entries` entries.
    pub async fn list_dir(
        &self,
        path: &str,
        max_entries: usize,
        depth: u32,
    ) -> Result<Vec<Entry>, RuntimeError> {
        let req = proto::ListDir {
            path: path.to_owned(),
            max_entries,
            depth,
        };
        let answer = self.request(FrameKind::ListDir, &as_user_json(req)).await?;
        serde_json::from_slice(&answer).map_err(channel_err)
    }

    /// The status of `path`, a symbolic link in its last component not followed.
    pub async fn stat(&self, path: &str) -> Result<Entry, RuntimeError> {
        let req = proto::PathRequest {
            path: path.to_owned(),
        };
        let answer = self.request(FrameKind::Stat, &as_user_json(req)).await?;
        serde_json::from_slice(&answer).map_err(channel_err)
    }

    /// Makes a directory (see [`proto::MakeDir`]); whether it was made.
    pub async fn make_dir(&self, req: &proto::MakeDir) -> Result<bool, RuntimeError> {
        let answer = self.request(FrameKind::MakeDir, &as_user_json(req)).await?;
        serde_json::from_slice(&answer).map_err(channel_err)
    }

    /// Renames a path within the sandbox (see [`proto::MovePath`]).
    pub async fn move_path(&self, req: &proto::MovePath) -> Result<(), RuntimeError> {
        self.request(FrameKind::MovePath, &as_user_json(req))
            .await
            .map(drop)
    }

    /// Removes a path (see [`proto::RemovePath`]).
    pub async fn remove_path(&self, req: &proto::RemovePath) -> Result<(), RuntimeError> {
        self.request(FrameKind::RemovePath, &as_user_json(req))
            .await
            .map(drop)
    }

    fn close_transfer(&self, id: u32) {
        let t = proto::Transfer { id, last: false };
        self.post(FrameKind::CloseFile, &json(&t));
    }
}

/// A file being read out of a sandbox.
pub struct FileReader {
    channel: Channel,
    id: u32,
    size: u64,
    first: Option<Vec<u8>>,
    /// The sandbox has sent the last chunk (and closed the transfer).
    done: bool,
}

impl FileReader {
    /// The file's size when it was opened; it may change while it is read.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether every chunk has been returned: no more round trip is needed.
    pub fn finished(&self) -> bool {
        self.done && self.first.is_none()
    }

    /// The next chunk; `None` after the last. The first comes with the open.
    pub async fn next(&mut self) -> Result<Option<Vec<u8>>, RuntimeError> {
        if let Some(first) = self.first.take() {
            return Ok(Some(first));
        }
        if self.done {
            return Ok(None);
        }
        let t = proto::Transfer {
            id: self.id,
            last: false,
        };
        let answer = self.channel.request(FrameKind::ReadChunk, &json(&t)).await;
        let (t, chunk): (proto::Transfer, Vec<u8>) = match answer.and_then(split) {
            Ok(answer) => answer,
            Err(e) => {
                // The sandbox closes a transfer it failed; nothing is left to close.
                self.done = true;
                return Err(e);
            }
        };
        self.done = t.last;
        Ok(Some(chunk))
    }
}

impl Drop for FileReader {
    fn drop(&mut self) {
        if !self.done {
            self.channel.close_transfer(self.id);
        }
    }
}

/// A file being written into a sandbox.
pub struct FileWriter {
    channel: Channel,
    id: u32,
    done: bool,
}

impl FileWriter {
    /// Appends `data` (in parts, as they came); with `last`, the file is complete.
    pub async fn write(&mut self, data: &[&[u8]], last: bool) -> Result<(), RuntimeError> {
        if self.done {
            return Err(RuntimeError::Channel(
                "write after the end of the file".into(),
            ));
        }
        let header = proto::json_header(&proto::Transfer { id: self.id, last });
        let answer = self
            .channel
            .request_parts(FrameKind::WriteChunk, &with_header(&header, data))
            .await;
        self.done = last || answer.is_err();
        answer.map(drop)
    }
}

impl Drop for FileWriter {
    fn drop(&mut self) {
        if !self.done {
            self.channel.close_transfer(self.id);
        }
    }
}

fn with_header<'a>(header: &'a [u8], data: &[&'a [u8]]) -> Vec<&'a [u8]> {
    let mut parts = Vec::with_capacity(1 + data.len());
    parts.push(header);
    parts.extend_from_slice(data);
    parts
}

tokio::task_local! {
    /// The user the file requests made within [`as_user`] run as.
    static AS_USER: Option<proto::AsUser>;
}

/// Runs `operation` with every file request it makes of a sandbox (open, list, stat,
/// mkdir, move, remove) asked as `user`; `None`: as root. A scope rather than a parameter
/// so that it reaches every backend's file operations unchanged, from the edge that
/// resolved the user down to the request this client sends.
pub async fn as_user<F: std::future::Future>(
    user: Option<proto::AsUser>,
    operation: F,
) -> F::Output {
    AS_USER.scope(user, operation).await
}

/// The user file requests made here run as (see [`as_user`]); `None` outside its scope.
pub fn current_user() -> Option<proto::AsUser> {
    AS_USER.try_with(Clone::clone).ok().flatten()
}

/// A file request as the current user, encoded.
fn as_user_json<T: serde::Serialize>(req: T) -> Vec<u8> {
    json(&proto::AsUserRequest {
        req,
        user: current_user(),
    })
}

fn json<T: serde::Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("protocol types serialize")
}

/// Splits an answer made by [`proto::encode_with_header`].
fn split<T: for<'de> serde::Deserialize<'de>>(
    payload: Vec<u8>,
) -> Result<(T, Vec<u8>), RuntimeError> {
    let frame = Frame {
        kind: FrameKind::Done,
        exec_id: 0,
        payload,
    };
    let (header, data): (T, &[u8]) = proto::decode_with_header(&frame).map_err(channel_err)?;
    let start = frame.payload.len() - data.len();
    let mut data = frame.payload;
    data.drain(..start);
    Ok((header, data))
}
