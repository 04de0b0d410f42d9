//! The edge's end of a control channel: to a container's init, or to a VM guest's agent.
//!
//! One reader task per channel routes every frame to whoever is waiting for its id — a
//! running command, or a request (file operation, identity change) awaiting its answer.
//! The file operations themselves are in [`crate::files::client`].
//! When the channel ends, each waiter learns that the sandbox is gone; nothing hangs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, watch};

use crate::container::RuntimeError;
use crate::files::watch::WatchEvent;
use crate::proto::{self, ExecExit, ExecSpec, Frame, FrameKind, InitError};

type Routes = Arc<Mutex<HashMap<u32, mpsc::UnboundedSender<Frame>>>>;
type Writer = Arc<tokio::sync::Mutex<OwnedWriteHalf>>;

/// One event of a running command.
#[derive(Debug)]
pub enum ExecEvent {
    /// An interactive command started, with this pid in the sandbox; first of its events.
    Started(i32),
    /// A chunk of standard output.
    Stdout(Vec<u8>),
    /// A chunk of standard error.
    Stderr(Vec<u8>),
    /// A step of a stepped call ended; the next step's events follow.
    StepExit(ExecExit),
    /// A file read back after a stepped call's last step.
    Fetched {
        /// The path as the exec asked for it.
        path: String,
        /// Its contents, up to the bound.
        data: Vec<u8>,
        /// The file was longer than the bound.
        truncated: bool,
    },
    /// The command ended.
    Exit(ExecExit),
}

/// Writes to a channel held back ([`Channel::hold_writes`]) until this is dropped.
pub struct WriteHold {
    writer: tokio::sync::OwnedMutexGuard<OwnedWriteHalf>,
    drained: bool,
}

impl WriteHold {
    /// Whether the peer had read every byte written before the hold began.
    pub fn drained(&self) -> bool {
        self.drained
    }
}

/// Bytes written to `stream` that its peer has not read yet (`SIOCOUTQ`).
fn unread_bytes(stream: &UnixStream) -> std::io::Result<libc::c_int> {
    use std::os::fd::AsRawFd;
    let mut queued: libc::c_int = 0;
    // SAFETY: SIOCOUTQ writes one int through the pointer, which outlives the call; the
    // descriptor is the stream's own, open while it is borrowed.
    if unsafe { libc::ioctl(stream.as_raw_fd(), libc::TIOCOUTQ, &mut queued) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(queued)
}

/// A connected control channel whose peer has reported ready. Clones share it.
#[derive(Clone)]
pub struct Channel {
    shared: Arc<Shared>,
}

struct Shared {
    writer: Writer,
    routes: Routes,
    next_id: AtomicU32,
    alive: watch::Receiver<bool>,
    /// Set while the peer moves to another transport ([`Channel::suspend`]): the end of
    /// the current one is not the end of the channel.
    suspended: Arc<AtomicBool>,
    /// The reader task's next transport, once the current one has ended.
    next_reader: mpsc::UnboundedSender<OwnedReadHalf>,
}

impl Channel {
    /// Waits up to `timeout` for the peer's `Ready` on `stream`, checks its protocol
    /// version, then starts routing. Returns the peer's `Ready`.
    pub async fn open(
        mut stream: UnixStream,
        timeout: Duration,
    ) -> Result<(Channel, proto::Ready), RuntimeError> {
        let mut buf = Vec::new();
        let frame = tokio::time::timeout(timeout, read_frame(&mut stream, &mut buf))
            .await
            .map_err(|_| {
                RuntimeError::Channel(format!(
                    "the sandbox did not become ready within {} s",
                    timeout.as_secs()
                ))
            })??
            .ok_or(RuntimeError::Gone)?;
        let ready: proto::Ready = match frame.kind {
            FrameKind::Ready => frame.json().map_err(channel_err)?,
            FrameKind::Error => {
                return Err(RuntimeError::Setup(frame.json().map_err(channel_err)?))
            }
            other => {
                return Err(RuntimeError::Channel(format!(
                    "unexpected {other:?} before ready"
                )))
            }
        };
        if ready.version != proto::VERSION {
            return Err(RuntimeError::Channel(format!(
                "the sandbox speaks protocol {}, this server {}",
                ready.version,
                proto::VERSION
            )));
        }
        Ok((Channel::route(stream, buf), ready))
    }

    /// Starts routing on a channel whose peer is already serving — a VM guest restored
    /// from a snapshot taken after its `Ready` — without waiting for anything. `pending`
    /// holds the bytes read from `stream` so far (from a frame boundary on); the ids of
    /// new requests start at `first_id`, past any the guest may still know.
    pub fn attach(stream: UnixStream, pending: Vec<u8>, first_id: u32) -> Channel {
        let channel = Channel::route(stream, pending);
        channel.shared.next_id.store(first_id, Ordering::Relaxed);
        channel
    }

    /// The id the next request will take: a guest saved now has seen only smaller ones.
    pub fn next_id(&self) -> u32 {
        self.shared.next_id.load(Ordering::Relaxed)
    }

    /// Keeps every other writer out until the hold is dropped, once all that was written
    /// has been read by the peer (or `within` has passed: see [`WriteHold::drained`]).
    /// A VM saved under the hold has no request half-delivered to its guest.
    pub async fn hold_writes(&self, within: Duration) -> WriteHold {
        let writer = Arc::clone(&self.shared.writer).lock_owned().await;
        let deadline = tokio::time::Instant::now() + within;
        let drained = loop {
            match unread_bytes(writer.as_ref()) {
                Ok(0) => break true,
                Ok(_) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                _ => break false,
            }
        };
        WriteHold { writer, drained }
    }

    /// `pending` holds bytes already read past the `Ready` frame.
    fn route(stream: UnixStream, pending: Vec<u8>) -> Channel {
        let (reader, writer) = stream.into_split();
        let routes: Routes = Arc::default();
        let (alive_tx, alive) = watch::channel(true);
        let suspended = Arc::new(AtomicBool::new(false));
        let (next_reader, readers) = mpsc::unbounded_channel();
        let transports = Transports {
            current: reader,
            suspended: Arc::clone(&suspended),
            next: readers,
        };
        tokio::spawn(route_frames(
            transports,
            pending,
            Arc::clone(&routes),
            alive_tx,
        ));
        Channel {
            shared: Arc::new(Shared {
                writer: Arc::new(tokio::sync::Mutex::new(writer)),
                routes,
                next_id: AtomicU32::new(1),
                alive,
                suspended,
                next_reader,
            }),
        }
    }

    /// Keeps the channel open across the end of its transport: the peer (a VM guest
    /// being saved to disk) will go on over another, given to [`Channel::resume_on`].
    /// Requests wait for it under the hold taken before the peer stopped.
    pub fn suspend(&self) {
        self.shared.suspended.store(true, Ordering::SeqCst);
    }

    /// Goes on over `stream` (the restored guest's), exactly where the old transport
    /// ended: the reader reads what the old one still held to its end first, so a frame
    /// split between the two arrives whole. `hold` (taken before the guest stopped, so
    /// nothing was half-written to it) is released once writes go to `stream`.
    pub fn resume_on(&self, stream: UnixStream, mut hold: WriteHold) {
        let (reader, writer) = stream.into_split();
        *hold.writer = writer;
        // The reader task takes it once the old transport has ended, and only then clears
        // `suspended`; it ends only with the channel, which then has no one to resume.
        let _ = self.shared.next_reader.send(reader);
    }

    /// Whether the peer is still there.
    pub fn is_alive(&self) -> bool {
        *self.shared.alive.borrow()
    }

    /// Waits up to `timeout` for the channel to close (the peer exited).
    pub async fn wait_closed(&self, timeout: Duration) {
        let mut alive = self.shared.alive.clone();
        let _ = tokio::time::timeout(timeout, alive.wait_for(|a| !*a)).await;
    }

    /// Registers a new id and sends it a frame of `kind` whose payload is `parts`, one
    /// after the other (so that large contents are written as they are, never copied into
    /// one frame first).
    async fn send(
        &self,
        kind: FrameKind,
        parts: &[&[u8]],
    ) -> Result<(u32, mpsc::UnboundedReceiver<Frame>), RuntimeError> {
        if !self.is_alive() {
            return Err(RuntimeError::Gone);
        }
        // init would refuse the frame and end the sandbox: refused here, it ends the request.
        let len = parts.iter().map(|p| p.len()).sum();
        if len > proto::MAX_PAYLOAD {
            return Err(RuntimeError::Channel(
                proto::ProtoError::TooLarge(len).to_string(),
            ));
        }
        let shared = &self.shared;
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        shared.routes.lock().expect("routes lock").insert(id, tx);
        let header = proto::header(kind, id, len);
        let written = async {
            let mut writer = shared.writer.lock().await;
            writer.write_all(&header).await?;
            for part in parts {
                writer.write_all(part).await?;
            }
            Ok::<_, std::io::Error>(())
        };
        if written.await.is_err() {
            shared.routes.lock().expect("routes lock").remove(&id);
            return Err(RuntimeError::Gone);
        }
        Ok((id, rx))
    }

    /// Sends a frame that gets no answer, from a task of its own: callable where nothing
    /// can wait (a `Drop`).
    pub(crate) fn post(&self, kind: FrameKind, payload: &[u8]) {
        post(&self.shared.writer, kind, 0, payload);
    }

    /// Starts a command; `files` are the contents of `spec.files`.
    pub async fn exec(
        &self,
        spec: &ExecSpec,
        stdin: &[u8],
        files: &[&[u8]],
    ) -> Result<ExecHandle, RuntimeError> {
        let header = proto::json_header(spec);
        let mut parts = vec![header.as_slice(), stdin];
        parts.extend_from_slice(files);
        let (id, frames) = self.send(FrameKind::Exec, &parts).await?;
        Ok(ExecHandle {
            id,
            frames,
            writer: Arc::clone(&self.shared.writer),
            stdin: Arc::default(),
            done: false,
        })
    }

    /// Watches the directory `path` (with `recursive`, the directories below too);
    /// returns once the watch is armed.
    pub async fn watch(&self, path: &str, recursive: bool) -> Result<WatchHandle, RuntimeError> {
        let req = proto::WatchRequest {
            path: path.to_owned(),
            recursive,
        };
        let payload = serde_json::to_vec(&req).expect("a watch request serializes");
        let (id, mut frames) = self.send(FrameKind::Watch, &[&payload]).await?;
        let mut handle = WatchHandle {
            id,
            frames: mpsc::unbounded_channel().1,
            writer: Arc::clone(&self.shared.writer),
            done: true,
        };
        let frame = frames.recv().await.ok_or(RuntimeError::Gone)?;
        match frame.kind {
            FrameKind::Watching => {}
            FrameKind::Error => return Err(refused(frame.json().map_err(channel_err)?)),
            other => {
                return Err(RuntimeError::Channel(format!(
                    "unexpected {other:?} answering a watch"
                )))
            }
        }
        handle.frames = frames;
        handle.done = false;
        Ok(handle)
    }

    /// Sends a request and waits for its answer (`Done`'s payload). An `Error` answer
    /// becomes [`RuntimeError::File`] for a file failure, [`RuntimeError::Exec`] otherwise.
    pub async fn request(&self, kind: FrameKind, payload: &[u8]) -> Result<Vec<u8>, RuntimeError> {
        self.request_parts(kind, &[payload]).await
    }

    /// What a VM guest's commands use now, as its agent reads it.
    pub async fn guest_usage(&self) -> Result<proto::GuestUsage, RuntimeError> {
        let answer = self.request(FrameKind::Usage, &[]).await?;
        serde_json::from_slice(&answer).map_err(channel_err)
    }

    /// [`request`](Self::request) with a payload in parts, sent one after the other.
    pub async fn request_parts(
        &self,
        kind: FrameKind,
        parts: &[&[u8]],
    ) -> Result<Vec<u8>, RuntimeError> {
        let (_, mut frames) = self.send(kind, parts).await?;
        let frame = frames.recv().await.ok_or(RuntimeError::Gone)?;
        match frame.kind {
            FrameKind::Done => Ok(frame.payload),
            FrameKind::Error => Err(refused(frame.json().map_err(channel_err)?)),
            other => Err(RuntimeError::Channel(format!(
                "unexpected {other:?} answering {kind:?}"
            ))),
        }
    }
}

pub(crate) fn channel_err(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Channel(e.to_string())
}

/// What the peer's `Error` answer means for the edge.
fn refused(err: InitError) -> RuntimeError {
    match err.file {
        Some(file) => RuntimeError::File(*file),
        None => RuntimeError::Exec(err),
    }
}

/// Writes one frame from a task of its own.
fn post(writer: &Writer, kind: FrameKind, id: u32, payload: &[u8]) {
    let mut frame = Vec::new();
    proto::encode(&mut frame, kind, id, payload);
    let writer = Arc::clone(writer);
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(async move {
            let _ = writer.lock().await.write_all(&frame).await;
        });
    }
}

/// Bytes read from the channel at a time; a larger frame is read straight into its
/// payload.
const READ_CHUNK: usize = 64 << 10;

async fn read_frame<R: AsyncReadExt + Unpin>(
    reader: &mut R,
    buf: &mut Vec<u8>,
) -> Result<Option<Frame>, RuntimeError> {
    loop {
        if let Some(frame) = proto::decode(buf).map_err(channel_err)? {
            return Ok(Some(frame));
        }
        if let Some((kind, exec_id, len)) = proto::decode_header(buf).map_err(channel_err)? {
            if len > READ_CHUNK {
                let mut payload = Vec::with_capacity(len);
                payload.extend_from_slice(&buf[proto::HEADER_LEN..]);
                buf.clear();
                let rest = (len - payload.len()) as u64;
                AsyncReadExt::take(&mut *reader, rest)
                    .read_to_end(&mut payload)
                    .await
                    .map_err(channel_err)?;
                if payload.len() < len {
                    // Kept whole: the frame may go on over the next transport.
                    *buf = proto::header(kind, exec_id, len).to_vec();
                    buf.extend_from_slice(&payload);
                    return Ok(None);
                }
                return Ok(Some(Frame {
                    kind,
                    exec_id,
                    payload,
                }));
            }
        }
        let mut chunk = [0u8; READ_CHUNK];
        let n = reader.read(&mut chunk).await.map_err(channel_err)?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Whether `frame` is the last one of its id.
fn ends_route(frame: &Frame) -> bool {
    !matches!(
        frame.kind,
        FrameKind::Started
            | FrameKind::Stdout
            | FrameKind::Stderr
            | FrameKind::StepExit
            | FrameKind::Fetched
            | FrameKind::Watching
            | FrameKind::FileEvents
            | FrameKind::StdinTaken
    )
}

/// The reader task's transports: the current one, and where the next comes from.
struct Transports {
    current: OwnedReadHalf,
    suspended: Arc<AtomicBool>,
    next: mpsc::UnboundedReceiver<OwnedReadHalf>,
}

/// Routes frames to the exec or request they belong to; when the channel ends, every
/// waiter's sender is dropped, which it reads as the sandbox being gone.
async fn route_frames(
    mut transports: Transports,
    mut buf: Vec<u8>,
    routes: Routes,
    alive: watch::Sender<bool>,
) {
    loop {
        let frame = match read_frame(&mut transports.current, &mut buf).await {
            Ok(Some(frame)) => frame,
            Ok(None) if transports.suspended.load(Ordering::SeqCst) => {
                match transports.next.recv().await {
                    Some(next) => {
                        transports.current = next;
                        transports.suspended.store(false, Ordering::SeqCst);
                        continue;
                    }
                    None => break,
                }
            }
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(error = %e, "control channel unreadable: closing it");
                break;
            }
        };
        let id = frame.exec_id;
        let last = ends_route(&frame);
        let mut routes = routes.lock().expect("routes lock");
        if let Some(tx) = routes.get(&id) {
            let _ = tx.send(frame);
        }
        if last {
            routes.remove(&id);
        }
    }
    let _ = alive.send(false);
    routes.lock().expect("routes lock").clear();
}

/// A running command: its events, in order, ending with `Exit` (a stepped call's steps
/// each end with `StepExit` but the last).
pub struct ExecHandle {
    id: u32,
    frames: mpsc::UnboundedReceiver<Frame>,
    writer: Writer,
    stdin: Arc<StdinCredit>,
    done: bool,
}

/// What an interactive command's input costs init: bytes sent and not yet taken (see
/// [`FrameKind::StdinTaken`]), kept under [`proto::MAX_STDIN_QUEUED`] by making writers
/// wait.
#[derive(Default)]
struct StdinCredit {
    /// Bytes in flight, and whether the command ended (nothing is held for it any more).
    state: Mutex<(usize, bool)>,
    freed: tokio::sync::Notify,
}

impl StdinCredit {
    /// Waits until `n` more bytes fit (or nothing is in flight), then counts them.
    async fn reserve(&self, n: usize) {
        loop {
            let freed = self.freed.notified();
            {
                let mut state = self.state.lock().expect("stdin credit lock");
                let (queued, ended) = &mut *state;
                if *ended || *queued == 0 || *queued + n <= proto::MAX_STDIN_QUEUED {
                    *queued += n;
                    return;
                }
            }
            freed.await;
        }
    }

    /// `n` bytes were taken by init.
    fn taken(&self, n: usize) {
        let mut state = self.state.lock().expect("stdin credit lock");
        state.0 = state.0.saturating_sub(n);
        drop(state);
        self.freed.notify_waiters();
    }

    /// The command ended: its writers wait no more.
    fn end(&self) {
        self.state.lock().expect("stdin credit lock").1 = true;
        self.freed.notify_waiters();
    }
}

impl ExecHandle {
    /// The next event; `None` after `Exit` or an error.
    pub async fn next(&mut self) -> Option<Result<ExecEvent, RuntimeError>> {
        if self.done {
            return None;
        }
        let event = loop {
            let frame = self.frames.recv().await;
            if let Some(f) = frame.as_ref().filter(|f| f.kind == FrameKind::StdinTaken) {
                let n = f.payload.get(..8).and_then(|b| b.try_into().ok());
                self.stdin.taken(n.map_or(0, |b| {
                    usize::try_from(u64::from_le_bytes(b)).unwrap_or(usize::MAX)
                }));
                continue;
            }
            break frame;
        };
        let event = match event {
            None => Err(RuntimeError::Gone),
            Some(frame) => match frame.kind {
                FrameKind::Started => frame
                    .json()
                    .map(|s: proto::Started| ExecEvent::Started(s.pid))
                    .map_err(channel_err),
                FrameKind::Stdout => Ok(ExecEvent::Stdout(frame.payload)),
                FrameKind::Stderr => Ok(ExecEvent::Stderr(frame.payload)),
                FrameKind::StepExit => frame.json().map(ExecEvent::StepExit).map_err(channel_err),
                FrameKind::Fetched => proto::decode_with_header(&frame)
                    .map(|(file, data): (proto::FetchedFile, _)| ExecEvent::Fetched {
                        path: file.path,
                        data: data.to_vec(),
                        truncated: file.truncated,
                    })
                    .map_err(channel_err),
                FrameKind::Exit => frame.json().map(ExecEvent::Exit).map_err(channel_err),
                FrameKind::Error => Err(frame.json().map_or_else(channel_err, refused)),
                other => Err(RuntimeError::Channel(format!(
                    "unexpected {other:?} for a command"
                ))),
            },
        };
        self.done = matches!(event, Ok(ExecEvent::Exit(_)) | Err(_));
        if self.done {
            self.stdin.end();
        }
        Some(event)
    }
}

impl ExecHandle {
    /// What steers the command while its events are read elsewhere.
    pub fn control(&self) -> ExecControl {
        ExecControl {
            id: self.id,
            writer: Arc::clone(&self.writer),
            stdin: Arc::clone(&self.stdin),
        }
    }
}

/// Steers a running interactive command: its input, signals, its terminal's size.
/// Frames for a command that already ended are ignored by the peer.
#[derive(Clone)]
pub struct ExecControl {
    id: u32,
    writer: Writer,
    stdin: Arc<StdinCredit>,
}

impl ExecControl {
    async fn send(&self, kind: FrameKind, payload: &[u8]) -> Result<(), RuntimeError> {
        if payload.len() > proto::MAX_PAYLOAD {
            return Err(channel_err(proto::ProtoError::TooLarge(payload.len())));
        }
        let mut writer = self.writer.lock().await;
        writer
            .write_all(&proto::header(kind, self.id, payload.len()))
            .await
            .map_err(|_| RuntimeError::Gone)?;
        writer
            .write_all(payload)
            .await
            .map_err(|_| RuntimeError::Gone)
    }

    /// Appends `data` to the command's standard input; waits while init holds
    /// [`proto::MAX_STDIN_QUEUED`] bytes of it that the command has not read yet.
    pub async fn send_stdin(&self, data: &[u8]) -> Result<(), RuntimeError> {
        self.stdin.reserve(data.len()).await;
        self.send(FrameKind::Stdin, data).await
    }

    /// Closes its standard input once what was sent is written.
    pub async fn close_stdin(&self) -> Result<(), RuntimeError> {
        self.send(FrameKind::CloseStdin, &[]).await
    }

    /// Sends signal number `signal` to its main process.
    pub async fn signal(&self, signal: i32) -> Result<(), RuntimeError> {
        let payload = serde_json::to_vec(&proto::Signal { signal }).expect("serializes");
        self.send(FrameKind::Signal, &payload).await
    }

    /// Resizes its terminal.
    pub async fn resize(&self, size: proto::WinSize) -> Result<(), RuntimeError> {
        let payload = serde_json::to_vec(&size).expect("serializes");
        self.send(FrameKind::Resize, &payload).await
    }

    /// Kills its process tree.
    pub async fn kill(&self) -> Result<(), RuntimeError> {
        self.send(FrameKind::Kill, &[]).await
    }
}

impl Drop for ExecHandle {
    /// A caller that stops listening (a client that disconnected mid-stream) must not
    /// leave the command running: tell init to kill its tree.
    fn drop(&mut self) {
        if !self.done {
            post(&self.writer, FrameKind::Kill, self.id, &[]);
        }
    }
}

/// An armed watch: batches of events until the watched directory goes away. Dropped,
/// it tells the sandbox to end the watch.
pub struct WatchHandle {
    id: u32,
    frames: mpsc::UnboundedReceiver<Frame>,
    writer: Writer,
    done: bool,
}

impl WatchHandle {
    /// The next batch of events; `None` once the watched directory is gone.
    pub async fn next(&mut self) -> Option<Result<Vec<WatchEvent>, RuntimeError>> {
        if self.done {
            return None;
        }
        let batch = match self.frames.recv().await {
            None => Some(Err(RuntimeError::Gone)),
            Some(frame) => match frame.kind {
                FrameKind::FileEvents => Some(frame.json().map_err(channel_err)),
                FrameKind::Done => None,
                FrameKind::Error => Some(Err(frame.json().map_or_else(channel_err, refused))),
                other => Some(Err(RuntimeError::Channel(format!(
                    "unexpected {other:?} for a watch"
                )))),
            },
        };
        self.done = !matches!(batch, Some(Ok(_)));
        batch
    }
}

impl Drop for WatchHandle {
    fn drop(&mut self) {
        if !self.done {
            post(&self.writer, FrameKind::Unwatch, self.id, &[]);
        }
    }
}
