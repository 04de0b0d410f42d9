//! The sandbox's side of the files API: a container's init, or a VM guest's agent,
//! answering the edge's file frames from its poll loop.
//!
//! Every request is answered at once and never blocks: opens are checked before anything
//! is opened for I/O ([`SandboxRoot`]), and I/O happens only on regular files of the
//! sandbox's own filesystems, one chunk ([`proto::FILE_CHUNK`]) per request. Open
//! transfers are bounded ([`MAX_TRANSFERS`]); one the edge left unused for [`IDLE`] (its
//! close was lost) makes room for a new one.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use super::identity::{self, Assumed};
use super::watch::Watches;
use super::{FileError, FileOp, SandboxRoot};
use crate::proto::{self, AsUserRequest, Frame, FrameKind, InitError};

/// Transfers open at once in one sandbox. The edge allows fewer in flight per sandbox;
/// the margin covers closes still on their way.
pub const MAX_TRANSFERS: usize = 16;

/// A transfer untouched for this long may be closed to make room for a new one.
pub const IDLE: Duration = Duration::from_secs(120);

struct Open {
    path: String,
    file: File,
    /// Bytes a read may still return before the file counts as too large.
    left: u64,
    used: Instant,
}

/// The open transfers of one sandbox, and the root they are opened in.
pub struct FileService {
    /// `None` in a fncall worker, whose own root is not the calls' (they get `files=`).
    root: Option<SandboxRoot>,
    open: HashMap<u32, Open>,
    next_id: u32,
    buf: Vec<u8>,
    watches: Watches,
}

impl FileService {
    /// Serves files beneath `root`; with `None`, every request is refused.
    pub fn new(root: Option<SandboxRoot>) -> FileService {
        FileService {
            root,
            open: HashMap::new(),
            next_id: 1,
            buf: Vec::new(),
            watches: Watches::default(),
        }
    }

    /// Makes the chunk buffer at the first read (zeroed by the allocator, not by a loop).
    fn ensure_buf(&mut self) {
        if self.buf.is_empty() {
            self.buf = vec![0; proto::FILE_CHUNK];
        }
    }

    /// Answers one file frame: `Some(Ok(payload))` for [`FrameKind::Done`],
    /// `Some(Err(..))` for [`FrameKind::Error`], `None` when no answer is due.
    pub fn serve(&mut self, frame: &Frame) -> Option<Result<Vec<u8>, InitError>> {
        let answer = match frame.kind {
            FrameKind::ReadFile => as_user(frame, |r| self.open_read(r)),
            FrameKind::WriteFile => proto::decode_with_header(frame).map_err(decode).and_then(
                |(h, data): (AsUserRequest<proto::OpenWrite>, _)| {
                    let _as = assume(h.user.as_ref(), &h.req.path)?;
                    self.open_write(h.req, data)
                },
            ),
            FrameKind::ListDir => as_user(frame, |r| self.list(r)),
            FrameKind::Stat => as_user(frame, |r| self.stat(r)),
            FrameKind::MakeDir => as_user(frame, |r| self.mkdir(r)),
            FrameKind::MovePath => as_user(frame, |r| self.rename(r)),
            FrameKind::RemovePath => as_user(frame, |r| self.remove(r)),
            FrameKind::ReadChunk => frame.json().map_err(decode).and_then(|t| self.read(t)),
            FrameKind::WriteChunk => proto::decode_with_header(frame)
                .map_err(decode)
                .and_then(|(t, data)| self.write(t, data)),
            FrameKind::CloseFile => {
                if let Ok(t) = frame.json::<proto::Transfer>() {
                    self.open.remove(&t.id);
                }
                return None;
            }
            _ => return None,
        };
        Some(answer)
    }

    /// Starts the watch a [`FrameKind::Watch`] frame asks for, known by the frame's id.
    pub fn watch(&mut self, frame: &Frame) -> Result<(), InitError> {
        let req: proto::WatchRequest = frame.json().map_err(decode)?;
        let root = self.root.as_ref().ok_or_else(|| no_files(&req.path))?;
        self.watches
            .add(root, frame.exec_id, &req.path, req.recursive)
            .map_err(failed)
    }

    /// Ends watch `id` (its client went away); nothing is sent.
    pub fn unwatch(&mut self, id: u32) {
        self.watches.remove(id);
    }

    /// The descriptor to poll for watch events, while a watch is open.
    pub fn watch_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.watches.fd()
    }

    /// Appends the frames of the watch events queued since the last call to `out`.
    pub fn pump_watches(&mut self, out: &mut Vec<u8>) {
        self.watches.pump_frames(self.root.as_ref(), out);
    }

    /// The root files are served from; `None` in a fncall worker.
    pub fn sandbox_root(&self) -> Option<&SandboxRoot> {
        self.root.as_ref()
    }

    fn root(&self, path: &str) -> Result<&SandboxRoot, InitError> {
        self.root.as_ref().ok_or_else(|| no_files(path))
    }

    fn open_read(&mut self, req: proto::OpenRead) -> Result<Vec<u8>, InitError> {
        let (file, size) = self
            .root(&req.path)?
            .open_read(&req.path, req.max_bytes)
            .map_err(failed)?;
        let mut open = Open {
            path: req.path,
            file,
            left: req.max_bytes,
            used: Instant::now(),
        };
        self.ensure_buf();
        let (got, last) = fill(&mut self.buf, &mut open).map_err(failed)?;
        let transfer = if last { 0 } else { self.insert(open)? };
        let header = proto::Opened {
            transfer,
            size,
            last,
        };
        Ok(proto::encode_with_header(&header, &self.buf[..got]))
    }

    fn open_write(&mut self, req: proto::OpenWrite, data: &[u8]) -> Result<Vec<u8>, InitError> {
        let root = self.root(&req.path)?;
        let mut file = root.open_write(&req.path, req.mode).map_err(failed)?;
        if let Some(metadata) = &req.metadata {
            super::metadata::replace(&file, &req.path, metadata).map_err(failed)?;
        }
        file.write_all(data)
            .map_err(|e| failed(FileError::os(&req.path, e)))?;
        let transfer = if req.last {
            0
        } else {
            self.insert(Open {
                path: req.path,
                file,
                left: 0,
                used: Instant::now(),
            })?
        };
        let opened = proto::Opened {
            transfer,
            size: 0,
            last: req.last,
        };
        Ok(serde_json::to_vec(&opened).expect("serializes"))
    }

    fn list(&mut self, req: proto::ListDir) -> Result<Vec<u8>, InitError> {
        let entries = self
            .root(&req.path)?
            .list(&req.path, req.max_entries, req.depth)
            .map_err(failed)?;
        Ok(serde_json::to_vec(&entries).expect("entries serialize"))
    }

    fn stat(&mut self, req: proto::PathRequest) -> Result<Vec<u8>, InitError> {
        let entry = self.root(&req.path)?.stat(&req.path).map_err(failed)?;
        Ok(serde_json::to_vec(&entry).expect("an entry serializes"))
    }

    fn mkdir(&mut self, req: proto::MakeDir) -> Result<Vec<u8>, InitError> {
        let made = self
            .root(&req.path)?
            .mkdir(&req.path, req.mode, req.parents, req.exist_ok)
            .map_err(failed)?;
        Ok(serde_json::to_vec(&made).expect("a bool serializes"))
    }

    fn rename(&mut self, req: proto::MovePath) -> Result<Vec<u8>, InitError> {
        self.root(&req.src)?
            .rename(&req.src, &req.dst, req.overwrite)
            .map_err(failed)?;
        Ok(Vec::new())
    }

    fn remove(&mut self, req: proto::RemovePath) -> Result<Vec<u8>, InitError> {
        self.root(&req.path)?
            .remove(&req.path, req.recursive)
            .map_err(failed)?;
        Ok(Vec::new())
    }

    fn read(&mut self, t: proto::Transfer) -> Result<Vec<u8>, InitError> {
        self.ensure_buf();
        let open = self.open.get_mut(&t.id).ok_or_else(|| unknown(t.id))?;
        open.used = Instant::now();
        let filled = fill(&mut self.buf, open);
        if !matches!(filled, Ok((_, false))) {
            self.open.remove(&t.id);
        }
        let (got, last) = filled.map_err(failed)?;
        let header = proto::Transfer { id: t.id, last };
        Ok(proto::encode_with_header(&header, &self.buf[..got]))
    }

    fn write(&mut self, t: proto::Transfer, data: &[u8]) -> Result<Vec<u8>, InitError> {
        let open = self.open.get_mut(&t.id).ok_or_else(|| unknown(t.id))?;
        open.used = Instant::now();
        let written = open
            .file
            .write_all(data)
            .map_err(|e| failed(FileError::os(&open.path, e)));
        if t.last || written.is_err() {
            self.open.remove(&t.id);
        }
        written.map(|()| Vec::new())
    }

    fn insert(&mut self, open: Open) -> Result<u32, InitError> {
        if self.open.len() >= MAX_TRANSFERS {
            let now = Instant::now();
            self.open.retain(|_, o| now.duration_since(o.used) < IDLE);
        }
        if self.open.len() >= MAX_TRANSFERS {
            return Err(failed(FileError::Busy {
                path: open.path,
                limit: MAX_TRANSFERS,
            }));
        }
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        self.open.insert(id, open);
        Ok(id)
    }
}

/// Reads the next chunk of `open` into `buf`: how many bytes, and whether that reached
/// the end of the file.
fn fill(buf: &mut [u8], open: &mut Open) -> Result<(usize, bool), FileError> {
    let mut got = 0;
    let end = loop {
        match open.file.read(&mut buf[got..]) {
            Ok(0) => break true,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FileError::os(&open.path, e)),
        }
        if got == buf.len() {
            break false;
        }
    };
    open.left = open
        .left
        .checked_sub(got as u64)
        .ok_or_else(|| FileError::TooLarge {
            path: open.path.clone(),
            op: FileOp::Read,
            what: "grew past the server's limit for a file read (dsec serve --max-file-mb) \
                   while it was read"
                .into(),
        })?;
    Ok((got, end))
}

/// Decodes a file request and serves it with `serve`, as the user it names (see
/// [`super::identity`]).
fn as_user<T: for<'de> serde::Deserialize<'de> + Named>(
    frame: &Frame,
    serve: impl FnOnce(T) -> Result<Vec<u8>, InitError>,
) -> Result<Vec<u8>, InitError> {
    let r: AsUserRequest<T> = frame.json().map_err(decode)?;
    let _as = assume(r.user.as_ref(), r.req.path())?;
    serve(r.req)
}

/// Takes `user`'s ids for an operation on `path`.
fn assume(user: Option<&proto::AsUser>, path: &str) -> Result<Option<Assumed>, InitError> {
    identity::assume(user).map_err(|e| {
        failed(FileError::Io {
            path: path.to_owned(),
            errno: e.raw_os_error(),
            message: e.to_string(),
        })
    })
}

/// The path a file request is about, for the messages.
trait Named {
    fn path(&self) -> &str;
}

macro_rules! named {
    ($($t:ty => $field:ident),*) => {
        $(impl Named for $t {
            fn path(&self) -> &str {
                &self.$field
            }
        })*
    };
}

named!(proto::OpenRead => path, proto::ListDir => path, proto::PathRequest => path,
    proto::MakeDir => path, proto::MovePath => src, proto::RemovePath => path);

fn failed(e: FileError) -> InitError {
    let errno = match &e {
        FileError::Io { errno, .. } => *errno,
        _ => None,
    };
    InitError {
        stage: proto::InitStage::Files,
        errno,
        message: e.to_string(),
        file: Some(Box::new(e)),
    }
}

fn no_files(path: &str) -> InitError {
    failed(FileError::InvalidPath {
        path: path.to_owned(),
        reason: "this sandbox serves no files (a fncall worker: pass files= to run)".into(),
    })
}

fn decode(e: proto::ProtoError) -> InitError {
    InitError {
        stage: proto::InitStage::Decode,
        errno: None,
        message: e.to_string(),
        file: None,
    }
}

fn unknown(id: u32) -> InitError {
    InitError {
        stage: proto::InitStage::Files,
        errno: None,
        message: format!(
            "no open file transfer {id} (it ended, or was closed after {IDLE:?} unused)"
        ),
        file: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(
        service: &mut FileService,
        kind: FrameKind,
        payload: Vec<u8>,
    ) -> Result<Vec<u8>, InitError> {
        let frame = Frame {
            kind,
            exec_id: 1,
            payload,
        };
        service.serve(&frame).expect("an answer")
    }

    fn header<T: for<'de> serde::Deserialize<'de>>(payload: Vec<u8>) -> (T, Vec<u8>) {
        let frame = Frame {
            kind: FrameKind::Done,
            exec_id: 1,
            payload,
        };
        let (h, data) = proto::decode_with_header(&frame).unwrap();
        (h, data.to_vec())
    }

    fn open_read(path: &str, max_bytes: u64) -> Vec<u8> {
        serde_json::to_vec(&proto::OpenRead {
            path: path.into(),
            max_bytes,
        })
        .unwrap()
    }

    #[test]
    fn a_large_file_travels_in_chunks_and_a_small_one_in_one_answer() {
        let tmp = tempfile::tempdir().unwrap();
        let big: Vec<u8> = (0..proto::FILE_CHUNK * 2 + 10)
            .map(|i| i.to_le_bytes()[0])
            .collect();
        std::fs::write(tmp.path().join("big"), &big).unwrap();
        std::fs::write(tmp.path().join("small"), b"tiny").unwrap();
        let mut service = FileService::new(Some(SandboxRoot::open(tmp.path()).unwrap()));

        let (opened, data): (proto::Opened, _) = header(
            ask(
                &mut service,
                FrameKind::ReadFile,
                open_read("/small", 1 << 30),
            )
            .unwrap(),
        );
        assert!(opened.last);
        assert_eq!(data, b"tiny");

        let (opened, mut data): (proto::Opened, _) = header(
            ask(
                &mut service,
                FrameKind::ReadFile,
                open_read("/big", 1 << 30),
            )
            .unwrap(),
        );
        assert!(!opened.last);
        assert_eq!(opened.size, big.len() as u64);
        loop {
            let t = serde_json::to_vec(&proto::Transfer {
                id: opened.transfer,
                last: false,
            })
            .unwrap();
            let (t, chunk): (proto::Transfer, _) =
                header(ask(&mut service, FrameKind::ReadChunk, t).unwrap());
            assert!(chunk.len() <= proto::FILE_CHUNK);
            data.extend_from_slice(&chunk);
            if t.last {
                break;
            }
        }
        assert_eq!(data, big);
        assert!(service.open.is_empty(), "the finished read is closed");
    }

    #[test]
    fn a_file_growing_past_the_limit_is_stopped() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("f"), vec![1; 100]).unwrap();
        let mut service = FileService::new(Some(SandboxRoot::open(tmp.path()).unwrap()));
        let err = ask(&mut service, FrameKind::ReadFile, open_read("/f", 50)).unwrap_err();
        assert!(
            matches!(err.file.as_deref(), Some(FileError::TooLarge { .. })),
            "{err:?}"
        );
    }

    #[test]
    fn a_chunked_write_lands_whole_and_transfers_are_bounded() {
        let tmp = tempfile::tempdir().unwrap();
        let mut service = FileService::new(Some(SandboxRoot::open(tmp.path()).unwrap()));
        let mut ids = Vec::new();
        for i in 0..MAX_TRANSFERS {
            let h = proto::OpenWrite {
                path: format!("/w{i}"),
                mode: 0o644,
                last: false,
                metadata: None,
            };
            let answer = ask(
                &mut service,
                FrameKind::WriteFile,
                proto::encode_with_header(&h, b"ab"),
            )
            .unwrap();
            let opened: proto::Opened = serde_json::from_slice(&answer).unwrap();
            ids.push(opened.transfer);
        }
        let h = proto::OpenWrite {
            path: "/one-too-many".into(),
            mode: 0o644,
            last: false,
            metadata: None,
        };
        let err = ask(
            &mut service,
            FrameKind::WriteFile,
            proto::encode_with_header(&h, b""),
        )
        .unwrap_err();
        assert!(
            matches!(err.file.as_deref(), Some(FileError::Busy { .. })),
            "{err:?}"
        );
        let t = proto::Transfer {
            id: ids[0],
            last: true,
        };
        ask(
            &mut service,
            FrameKind::WriteChunk,
            proto::encode_with_header(&t, b"cd"),
        )
        .unwrap();
        assert_eq!(std::fs::read(tmp.path().join("w0")).unwrap(), b"abcd");
        let close = serde_json::to_vec(&proto::Transfer {
            id: ids[1],
            last: false,
        })
        .unwrap();
        let frame = Frame {
            kind: FrameKind::CloseFile,
            exec_id: 2,
            payload: close,
        };
        assert!(service.serve(&frame).is_none());
        assert_eq!(service.open.len(), MAX_TRANSFERS - 2);
    }

    #[test]
    fn a_worker_serves_no_files() {
        let mut service = FileService::new(None);
        let err = ask(
            &mut service,
            FrameKind::ReadFile,
            open_read("/etc/passwd", 1),
        )
        .unwrap_err();
        assert!(matches!(
            err.file.as_deref(),
            Some(FileError::InvalidPath { .. })
        ));
    }
}
