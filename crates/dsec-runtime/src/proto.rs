//! The control protocol between the edge and a sandbox's init.
//!
//! For a container the channel is one end of a `socketpair(AF_UNIX, SOCK_STREAM)` that
//! init inherited at clone time. It has no name in any filesystem, init marks itself
//! non-dumpable so `/proc/1/fd` is closed to the sandbox's processes, and every descriptor
//! init holds is close-on-exec: nothing inside the sandbox can open, reach or forge it.
//! A VM guest's agent speaks the same protocol over a virtio-serial port or a vsock
//! connection (see `dsec-agent`), where the guest's identity travels on the channel too.
//! Requests — file operations, identity — are answered by [`FrameKind::Done`] or
//! [`FrameKind::Error`] with the request's id.
//!
//! Files move in chunks of at most [`FILE_CHUNK`] bytes, one request each: the edge asks
//! for the next chunk of a read only when its client took the last one, so neither side
//! buffers more than a chunk per transfer, and a large file is interleaved with command
//! output instead of holding the channel. A file that fits in one chunk costs one round
//! trip (see [`crate::files::service`]).
//!
//! Each frame is a 9-byte header — payload length (`u32` LE), kind (`u8`), exec id
//! (`u32` LE) — followed by the payload. Output travels as raw bytes (no JSON escaping on
//! the hot path); the few structured messages are JSON.

use serde::{Deserialize, Serialize};

/// Bumped on any incompatible change; the edge refuses a mismatching init or agent.
pub const VERSION: u32 = 7;

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 9;

/// Bytes of an interactive command's standard input the edge sends ahead of what init has
/// written to it (one write larger than this is sent alone, once nothing is queued).
pub const MAX_STDIN_QUEUED: usize = 4 << 20;

/// Largest payload a peer accepts; bounds memory against a corrupt stream.
pub const MAX_PAYLOAD: usize = 256 << 20;

/// Most bytes of file content in one frame.
pub const FILE_CHUNK: usize = 1 << 20;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// init → edge: setup finished; payload: JSON [`Ready`].
    Ready = 1,
    /// edge → init: run a command; payload: `u32` LE JSON length, JSON [`ExecSpec`], stdin,
    /// then the contents of [`ExecSpec::files`].
    Exec = 2,
    /// edge → init: kill an exec's process tree (client went away).
    Kill = 3,
    /// init → edge: a chunk of standard output.
    Stdout = 4,
    /// init → edge: a chunk of standard error.
    Stderr = 5,
    /// init → edge: the command ended; payload: JSON [`ExecExit`].
    Exit = 6,
    /// init → edge: the command, the request or the setup failed; payload: JSON
    /// [`InitError`].
    Error = 7,
    /// edge → agent: take a fresh identity after a snapshot restore; payload: JSON
    /// [`Identity`].
    Identity = 8,
    /// edge → sandbox: open a regular file for reading; payload: JSON [`OpenRead`].
    /// Answer: a header (see [`encode_with_header`]) [`Opened`], then the first chunk.
    ReadFile = 9,
    /// edge → sandbox: open a file for writing (created or truncated); payload: a header
    /// [`OpenWrite`], then the first chunk. Answer: JSON [`Opened`].
    WriteFile = 10,
    /// edge → sandbox: list a directory; payload: JSON [`ListDir`]. Answer: JSON
    /// `Vec<`[`crate::files::Entry`]`>`.
    ListDir = 11,
    /// init → edge: a request succeeded; payload: its answer.
    Done = 12,
    /// edge → sandbox: the next chunk of an open read; payload: JSON [`Transfer`].
    /// Answer: a header [`Transfer`], then the chunk.
    ReadChunk = 13,
    /// edge → sandbox: the next chunk of an open write; payload: a header [`Transfer`],
    /// then the chunk. Answer: empty.
    WriteChunk = 14,
    /// edge → sandbox: abandon an open transfer (its client went away); payload: JSON
    /// [`Transfer`]. No answer.
    CloseFile = 15,
    /// init → edge: a step of a stepped call (see [`ExecSpec::then`]) ended and the next
    /// one starts; payload: JSON [`ExecExit`]. The last step's end is the `Exit` frame.
    StepExit = 16,
    /// init → edge: a file read back from a call's root after its last step (see
    /// [`ExecSpec::fetch`]), sent before the `Exit` frame; payload: `u32` LE JSON length,
    /// JSON [`FetchedFile`], contents.
    Fetched = 17,
    /// init → edge: an interactive command (see [`ExecSpec::interactive`]) started;
    /// payload: JSON [`Started`]. Sent before any of its output.
    Started = 20,
    /// edge → init: bytes for an interactive command's standard input (or its terminal).
    Stdin = 21,
    /// edge → init: close an interactive command's standard input once what was sent is
    /// written; for a terminal, its end-of-file character is typed instead.
    CloseStdin = 22,
    /// edge → init: send a signal to a command's main process; payload: JSON [`Signal`].
    Signal = 23,
    /// edge → init: resize a command's terminal; payload: JSON [`WinSize`].
    Resize = 24,
    /// init → edge: bytes of an interactive command's standard input that init no longer
    /// holds (written to the command, or dropped: its input ended); payload: `u64` LE. The
    /// edge keeps at most [`MAX_STDIN_QUEUED`] bytes sent and not yet taken (backpressure),
    /// so a client that writes faster than the command reads costs init no more.
    StdinTaken = 25,
    /// edge → sandbox: the status of a path, its last component not followed; payload:
    /// JSON [`PathRequest`]. Answer: JSON [`crate::files::Entry`].
    Stat = 30,
    /// edge → sandbox: make a directory; payload: JSON [`MakeDir`]. Answer: JSON `bool`,
    /// whether it was made (false: it existed and `exist_ok` was given).
    MakeDir = 31,
    /// edge → sandbox: rename a path within the sandbox; payload: JSON [`MovePath`].
    /// Answer: empty.
    MovePath = 32,
    /// edge → sandbox: remove a file, a link or a directory; payload: JSON
    /// [`RemovePath`]. Answer: empty.
    RemovePath = 33,
    /// edge → sandbox: watch a directory; payload: JSON [`WatchRequest`]. Answer:
    /// `Watching` once the watch is armed (or `Error`), then `FileEvents` frames of the
    /// same id, until `Done` (the directory went away) or the edge's `Unwatch`.
    Watch = 34,
    /// init → edge: the watch of this id is armed; empty payload.
    Watching = 35,
    /// init → edge: events of the watch of this id; payload: JSON
    /// `Vec<`[`crate::files::watch::WatchEvent`]`>`.
    FileEvents = 36,
    /// edge → sandbox: end the watch of this id (its client went away). No answer.
    Unwatch = 37,
    /// edge → VM guest agent: what the guest uses now; empty payload. Answer: JSON
    /// [`GuestUsage`].
    Usage = 40,
}

impl FrameKind {
    fn from_u8(v: u8) -> Option<FrameKind> {
        Some(match v {
            1 => FrameKind::Ready,
            2 => FrameKind::Exec,
            3 => FrameKind::Kill,
            4 => FrameKind::Stdout,
            5 => FrameKind::Stderr,
            6 => FrameKind::Exit,
            7 => FrameKind::Error,
            8 => FrameKind::Identity,
            9 => FrameKind::ReadFile,
            10 => FrameKind::WriteFile,
            11 => FrameKind::ListDir,
            12 => FrameKind::Done,
            13 => FrameKind::ReadChunk,
            14 => FrameKind::WriteChunk,
            15 => FrameKind::CloseFile,
            16 => FrameKind::StepExit,
            17 => FrameKind::Fetched,
            20 => FrameKind::Started,
            21 => FrameKind::Stdin,
            22 => FrameKind::CloseStdin,
            23 => FrameKind::Signal,
            24 => FrameKind::Resize,
            25 => FrameKind::StdinTaken,
            30 => FrameKind::Stat,
            31 => FrameKind::MakeDir,
            32 => FrameKind::MovePath,
            33 => FrameKind::RemovePath,
            34 => FrameKind::Watch,
            35 => FrameKind::Watching,
            36 => FrameKind::FileEvents,
            37 => FrameKind::Unwatch,
            40 => FrameKind::Usage,
            _ => return None,
        })
    }
}

/// A malformed frame: the peer is broken, the channel must be dropped.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    /// Unknown kind byte.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Length over [`MAX_PAYLOAD`].
    #[error("frame of {0} bytes exceeds the protocol limit")]
    TooLarge(usize),
    /// Structured payload did not parse.
    #[error("malformed {kind:?} payload: {reason}")]
    Payload {
        /// Frame kind.
        kind: FrameKind,
        /// Parser message.
        reason: String,
    },
}

/// A decoded frame.
#[derive(Debug, PartialEq, Eq)]
pub struct Frame {
    /// What it carries.
    pub kind: FrameKind,
    /// Which exec it belongs to (0 for sandbox-wide frames).
    pub exec_id: u32,
    /// Raw payload.
    pub payload: Vec<u8>,
}

/// Appends one frame to `out`.
pub fn encode(out: &mut Vec<u8>, kind: FrameKind, exec_id: u32, payload: &[u8]) {
    out.reserve(HEADER_LEN + payload.len());
    out.extend_from_slice(&header(kind, exec_id, payload.len()));
    out.extend_from_slice(payload);
}

/// Appends a frame whose payload is `value` as JSON.
pub fn encode_json<T: Serialize>(out: &mut Vec<u8>, kind: FrameKind, exec_id: u32, value: &T) {
    let json = serde_json::to_vec(value).expect("protocol types serialize");
    encode(out, kind, exec_id, &json);
}

/// The header at the start of `buf`: kind, exec id and payload length, once all 9
/// bytes are there.
pub fn decode_header(buf: &[u8]) -> Result<Option<(FrameKind, u32, usize)>, ProtoError> {
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let len = u32::from_le_bytes(buf[0..4].try_into().expect("4 bytes")) as usize;
    if len > MAX_PAYLOAD {
        return Err(ProtoError::TooLarge(len));
    }
    let kind = FrameKind::from_u8(buf[4]).ok_or(ProtoError::UnknownKind(buf[4]))?;
    let exec_id = u32::from_le_bytes(buf[5..9].try_into().expect("4 bytes"));
    Ok(Some((kind, exec_id, len)))
}

/// The 9 header bytes of a frame whose payload is `len` bytes.
pub fn header(kind: FrameKind, exec_id: u32, len: usize) -> [u8; HEADER_LEN] {
    let mut h = [0; HEADER_LEN];
    // Saturated, a length over the limit still reads as one: never as a shorter frame.
    let len = u32::try_from(len).unwrap_or(u32::MAX);
    h[..4].copy_from_slice(&len.to_le_bytes());
    h[4] = kind as u8;
    h[5..].copy_from_slice(&exec_id.to_le_bytes());
    h
}

/// Removes and returns the first complete frame of `buf`, if there is one.
pub fn decode(buf: &mut Vec<u8>) -> Result<Option<Frame>, ProtoError> {
    let Some((kind, exec_id, len)) = decode_header(buf)? else {
        return Ok(None);
    };
    if buf.len() < HEADER_LEN + len {
        return Ok(None);
    }
    let payload = buf[HEADER_LEN..HEADER_LEN + len].to_vec();
    buf.drain(..HEADER_LEN + len);
    Ok(Some(Frame {
        kind,
        exec_id,
        payload,
    }))
}

impl Frame {
    /// Parses a JSON payload.
    pub fn json<T: for<'de> Deserialize<'de>>(&self) -> Result<T, ProtoError> {
        serde_json::from_slice(&self.payload).map_err(|e| ProtoError::Payload {
            kind: self.kind,
            reason: e.to_string(),
        })
    }
}

/// Sent once by init when the sandbox can take commands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ready {
    /// [`VERSION`] of the init.
    pub version: u32,
    /// init's descriptor of the writable layer's upper directory.
    pub upper_fd: i32,
}

/// A command for init to run.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecSpec {
    /// argv; `argv[0]` is looked up in the `PATH` of `env` when it has no `/`.
    pub argv: Vec<String>,
    /// The complete environment, `K=V`.
    pub env: Vec<String>,
    /// Working directory inside the sandbox.
    pub cwd: String,
    /// Kill the tree after this long.
    pub timeout_ms: Option<u64>,
    /// Bound on each output stream.
    pub max_output_bytes: u64,
    /// Files init writes in the command's root right before it starts (fncall workers,
    /// whose commands each get a root of their own); their contents follow stdin in the
    /// frame, in order.
    #[serde(default)]
    pub files: Vec<ExecFile>,
    /// fncall calls only: commands run after `argv`, one at a time in the same root,
    /// each only if the one before it exited 0. Each step's whole process tree is killed
    /// when its main process exits or its own timeout (counted from its own start)
    /// fires, and every step reads the exec's stdin from its beginning.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub then: Vec<ExecStep>,
    /// fncall calls only: files (absolute, or relative to `cwd`) read back from the
    /// call's root after its last step; regular files of the call's own filesystems
    /// only, missing ones are left out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fetch: Vec<String>,
    /// Bound on the fetched files together: the file that exceeds it comes cut short
    /// (`FetchedFile::truncated`) and the files after it are not read.
    #[serde(default)]
    pub fetch_max_bytes: u64,
    /// A spawned process: its standard input stays open for [`FrameKind::Stdin`] frames
    /// until [`FrameKind::CloseStdin`], and init reports its pid ([`FrameKind::Started`]).
    #[serde(default)]
    pub interactive: bool,
    /// Run on a new terminal of this size: the command's stdin, stdout and stderr are the
    /// terminal, its output travels as [`FrameKind::Stdout`]. Interactive commands only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<WinSize>,
    /// Run as this user of the sandbox rather than as root (see [`crate::users`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_as: Option<RunAs>,
}

/// Who a command runs as: a user looked up inside the sandbox, in its own `/etc/passwd`
/// and `/etc/group`, right before the command starts (the sandbox may have added it).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunAs {
    /// A name, a uid or `uid:gid` (see [`crate::users::UserSpec`]).
    pub user: String,
    /// The request named no working directory: the command starts in the user's home,
    /// or in [`ExecSpec::cwd`] when that is not a directory.
    pub home_cwd: bool,
}

impl ExecSpec {
    /// Whether the command runs as the steps of a stepped call rather than alone.
    pub fn is_stepped(&self) -> bool {
        !self.then.is_empty() || !self.fetch.is_empty()
    }
}

/// A terminal's size, in character cells.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WinSize {
    /// Columns.
    pub cols: u16,
    /// Rows.
    pub rows: u16,
}

/// The payload of [`FrameKind::Started`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Started {
    /// The command's pid as the sandbox's own processes see it.
    pub pid: i32,
}

/// The payload of [`FrameKind::Signal`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Signal {
    /// The signal's number.
    pub signal: i32,
}

/// A later command of a stepped call (see [`ExecSpec::then`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecStep {
    /// argv, looked up in the `PATH` of the exec's environment like the first command's.
    pub argv: Vec<String>,
    /// Kill the step's tree this long after the step started.
    pub timeout_ms: Option<u64>,
}

/// Header of a [`FrameKind::Fetched`] frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FetchedFile {
    /// The path as the exec asked for it.
    pub path: String,
    /// The file was longer than the bound; the rest was not read.
    pub truncated: bool,
}

/// A file carried in an [`FrameKind::Exec`] frame.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecFile {
    /// Absolute path in the command's root.
    pub path: String,
    /// Permission bits.
    pub mode: u32,
    /// Bytes of content in the frame.
    pub len: u64,
}

/// How a command ended.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecExit {
    /// Exit status, or `128 + signal`; `None` when the timeout fired.
    pub exit_code: Option<i32>,
    /// The signal that killed the main process, if any.
    pub signal: Option<i32>,
    /// The timeout fired.
    pub timed_out: bool,
    /// Some output was discarded.
    pub truncated: bool,
    /// Wall time from fork to exit.
    pub duration_us: u64,
    /// The kernel's OOM killer struck while the command ran (set by a VM guest's agent,
    /// where the whole guest is the sandbox; a container's edge asks its cgroup instead).
    #[serde(default)]
    pub oom_killed: bool,
}

/// Declares [`InitStage`] from one list: each stage's variant and its name, which is both
/// what messages say and what the wire carries.
macro_rules! init_stages {
    ($($(#[$doc:meta])* $variant:ident => $name:literal,)*) => {
        /// The step at which init (or a VM guest's agent) failed: a closed set, so the edge
        /// matches on it rather than on words.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
        pub enum InitStage {
            $($(#[$doc])* #[serde(rename = $name)] $variant,)*
        }

        impl InitStage {
            /// The stage as messages and the wire name it.
            pub fn name(self) -> &'static str {
                match self {
                    $(InitStage::$variant => $name,)*
                }
            }
        }
    };
}

init_stages! {
    /// The guest's identity could not be taken (or was asked for again).
    Identity => "identity",
    /// A request could not be decoded.
    Decode => "decode",
    /// The control channel could not be read.
    ReadChannel => "read the channel",
    /// init could not say it is ready.
    ReportReady => "report ready",
    /// The guest could not answer its identity.
    AnswerIdentity => "answer the identity",
    /// A guest's pids limit could not be set.
    PidsLimit => "pids limit",
    /// Capabilities could not be dropped.
    DropCapabilities => "drop capabilities",
    /// The seccomp filter could not be installed.
    InstallSeccomp => "install seccomp filter",
    /// The root the files are served from could not be opened.
    OpenFilesRoot => "open the root for files",
    /// `SIGCHLD` could not be blocked.
    BlockSigchld => "block SIGCHLD",
    /// The signalfd could not be made.
    Signalfd => "signalfd",
    /// init could not enter the network namespace the zygote made for it.
    JoinNetworkNamespace => "join the network namespace",
    /// init could not join the sandbox's cgroups.
    JoinCgroup => "join cgroup",
    /// The cgroup namespace could not be unshared.
    UnshareCgroupNamespace => "unshare cgroup namespace",
    /// init could not move to the inits' memory cgroup.
    LeaveMemoryCgroup => "leave the sandbox's memory cgroup",
    /// The commands' cgroup could not be opened.
    OpenCommandsCgroup => "open the commands' cgroup",
    /// `TIME_WAIT` could not be turned off in the sandbox's network.
    DisableTimeWait => "disable TIME_WAIT",
    /// `/dev/null` could not be opened.
    OpenDevNull => "open /dev/null",
    /// The root filesystem could not be built.
    Rootfs => "rootfs",
    /// The hostname could not be set.
    Sethostname => "sethostname",
    /// The loopback interface could not be brought up.
    Loopback => "loopback",
    /// A VM guest's agent could not set the guest up.
    GuestSetup => "guest setup",
    /// A file request failed.
    Files => "files",
    /// The command's spec is invalid.
    Spec => "spec",
    /// A pipe could not be made.
    Pipe => "pipe",
    /// A terminal could not be opened for the command.
    Terminal => "open a terminal",
    /// The command could not be forked.
    Fork => "fork",
    /// The command could not be cloned.
    Clone => "clone",
    /// The command could not become a subreaper.
    Subreaper => "become subreaper",
    /// The command's standard descriptors could not be set up.
    Stdio => "set up stdio",
    /// The command's working directory could not be entered.
    Chdir => "chdir",
    /// The command could not be executed.
    Exec => "exec",
    /// A fncall call's root could not be built.
    CallRoot => "build the call's root",
    /// A fncall call could not drop its privileges.
    Confine => "drop privileges",
    /// A fncall call's files could not be written.
    CallFiles => "write the command's files",
    /// The command could not join the commands' cgroup.
    CommandsCgroup => "join the commands' cgroup",
    /// The user to run as is not one of the sandbox's, or is malformed.
    User => "look up the user",
    /// The command could not take its user's identity.
    SetUser => "switch to the user",
}

impl std::fmt::Display for InitStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why init could not do what it was asked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitError {
    /// Which step failed.
    pub stage: InitStage,
    /// `errno`, when a syscall failed.
    pub errno: Option<i32>,
    /// Human-readable explanation.
    pub message: String,
    /// For a failed file request (or a fncall call's `files`): the failure itself, so the
    /// edge answers it as precisely as the sandbox's side saw it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<Box<crate::files::FileError>>,
}

/// What a VM guest takes on when it is restored from a snapshot that other sandboxes
/// share: its own name, fresh randomness, the current time and its network. The host
/// sends it again when the sandbox's network changes ([`GuestNetwork`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// The new hostname (the sandbox id).
    pub hostname: String,
    /// Bytes mixed into the guest's random pool, credited as entropy, before the pool
    /// is reseeded: no two restored guests share a random stream.
    pub entropy: Vec<u8>,
    /// Wall-clock time, nanoseconds since the epoch.
    pub unix_time_ns: u128,
    /// The sandbox's process limit for its commands.
    #[serde(default)]
    pub pids_max: Option<u64>,
    /// Its network interface, when it has one; `None` leaves the guest with loopback
    /// only (an interface it had is taken down).
    #[serde(default)]
    pub network: Option<GuestNetwork>,
}

/// A VM guest's network interface (see [`crate::guest`]): the sandbox's own address,
/// alone on `eth0`, and a default route through the VMM's user-mode network, whose
/// connections the host makes from the sandbox's network namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestNetwork {
    /// The sandbox's address (a /32: every destination is reached through the gateway).
    pub address: std::net::Ipv4Addr,
}

/// What a VM guest's commands use, as its agent reads it ([`FrameKind::Usage`]): the
/// guest's own counts, which the host cannot see.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestUsage {
    /// Memory charged to the commands' cgroup now.
    pub memory_bytes: u64,
    /// The most charged to it at once (`memory.peak`; 0 where the kernel lacks it).
    pub memory_peak_bytes: u64,
    /// Live processes and threads of the commands.
    pub pids: u64,
    /// Forks their pids limit refused since the guest booted.
    pub pids_limit_hits: u64,
    /// OOM kills since the guest booted.
    pub oom_kills: u64,
    /// Bytes used on the guest's scratch disk (its writable layer).
    pub disk_bytes: u64,
    /// Files and directories on it.
    pub disk_inodes: u64,
    /// The image's files in its binary directories that commands overwrote or removed
    /// (see [`crate::layers`]), at most [`MAX_REPLACED_REPORTED`].
    #[serde(default)]
    pub replaced: Vec<String>,
}

/// The most replaced image files one [`GuestUsage`] names: the host reports each once, so
/// a guest that replaces more still trips the Watcher with the first ones.
pub const MAX_REPLACED_REPORTED: usize = 256;

/// The ids a file operation runs with, as the edge looked them up in the sandbox's own
/// `/etc/passwd` and `/etc/group` (see [`crate::users`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AsUser {
    /// User id: what the kernel checks permissions as, and the owner of what is made.
    pub uid: u32,
    /// Primary group id: the group of what is made.
    pub gid: u32,
    /// Every group the user is in, the primary one first.
    pub groups: Vec<u32>,
}

/// A file request (`ReadFile`, `WriteFile`, `ListDir`, `Stat`, `MakeDir`, `MovePath`,
/// `RemovePath`) and the user it runs as; `None`: as the serving process, root.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AsUserRequest<T> {
    /// The request.
    #[serde(flatten)]
    pub req: T,
    /// The user it runs as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<AsUser>,
}

/// A [`FrameKind::ReadFile`] request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenRead {
    /// Absolute path in the sandbox.
    pub path: String,
    /// Refuse a larger file; stop a file that grows past it while it is read.
    pub max_bytes: u64,
}

/// Header of a [`FrameKind::WriteFile`] request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenWrite {
    /// Absolute path in the sandbox.
    pub path: String,
    /// Permission bits.
    pub mode: u32,
    /// The chunk in this frame is the whole file.
    pub last: bool,
    /// The file's metadata, replacing what it had ([`crate::files::metadata`]); `None`
    /// leaves it as it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<std::collections::BTreeMap<String, String>>,
}

/// A [`FrameKind::ListDir`] request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListDir {
    /// Absolute path in the sandbox.
    pub path: String,
    /// Refuse a listing with more entries.
    pub max_entries: usize,
    /// Levels listed: 1 lists the directory's own entries, 2 those of its
    /// subdirectories too, and so on.
    pub depth: u32,
}

/// A [`FrameKind::Stat`] request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathRequest {
    /// Absolute path in the sandbox.
    pub path: String,
}

/// A [`FrameKind::MakeDir`] request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MakeDir {
    /// Absolute path in the sandbox.
    pub path: String,
    /// Permission bits of the directory (missing parents get 0755).
    pub mode: u32,
    /// Make missing parent directories too.
    pub parents: bool,
    /// An existing directory is no error.
    pub exist_ok: bool,
}

/// A [`FrameKind::MovePath`] request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MovePath {
    /// Absolute path of what is moved; a symbolic link is moved itself.
    pub src: String,
    /// Absolute path it gets; missing parents are made.
    pub dst: String,
    /// Replace what `dst` names (a file, a link or an empty directory).
    pub overwrite: bool,
}

/// A [`FrameKind::Watch`] request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchRequest {
    /// Absolute path of a directory in the sandbox.
    pub path: String,
    /// Watch the directories below it too, and those made later.
    pub recursive: bool,
}

/// A [`FrameKind::RemovePath`] request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemovePath {
    /// Absolute path in the sandbox; a symbolic link is removed itself.
    pub path: String,
    /// Remove a directory with everything in it.
    pub recursive: bool,
}

/// The answer to [`FrameKind::ReadFile`] and [`FrameKind::WriteFile`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Opened {
    /// The transfer's id for the next chunks.
    pub transfer: u32,
    /// The file's size when it was opened (reads).
    pub size: u64,
    /// The transfer ended with this frame (and is closed).
    pub last: bool,
}

/// Names an open transfer; in an answer to [`FrameKind::ReadChunk`] and in a
/// [`FrameKind::WriteChunk`], `last` says the chunk ends the file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfer {
    /// As [`Opened::transfer`].
    pub id: u32,
    /// The transfer ends with this chunk.
    #[serde(default)]
    pub last: bool,
}

/// Builds a payload made of a JSON header and raw bytes (`u32` LE header length first),
/// as [`FrameKind::Exec`] and the file frames use.
pub fn encode_with_header<T: Serialize>(header: &T, data: &[u8]) -> Vec<u8> {
    let mut payload = json_header(header);
    payload.extend_from_slice(data);
    payload
}

/// The start of a payload built by [`encode_with_header`]: `u32` LE length, JSON; the raw
/// bytes follow.
pub fn json_header<T: Serialize>(header: &T) -> Vec<u8> {
    let json = serde_json::to_vec(header).expect("protocol types serialize");
    let mut out = Vec::with_capacity(4 + json.len());
    // Saturated, an impossible length reads as past the end, never as a shorter header.
    let len = u32::try_from(json.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&json);
    out
}

/// Splits a payload built by [`encode_with_header`].
pub fn decode_with_header<T: for<'de> Deserialize<'de>>(
    frame: &Frame,
) -> Result<(T, &[u8]), ProtoError> {
    let bad = |reason: String| ProtoError::Payload {
        kind: frame.kind,
        reason,
    };
    let p = &frame.payload;
    let n = p
        .get(0..4)
        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
        .ok_or_else(|| bad("missing header length".into()))?;
    let json = p
        .get(4..4 + n)
        .ok_or_else(|| bad("header past the end".into()))?;
    let header = serde_json::from_slice(json).map_err(|e| bad(e.to_string()))?;
    Ok((header, &p[4 + n..]))
}

/// A decoded [`FrameKind::Exec`] payload.
#[derive(Debug)]
pub struct ExecPayload<'a> {
    /// What to run.
    pub spec: ExecSpec,
    /// Standard input.
    pub stdin: &'a [u8],
    /// Contents of `spec.files`, in order.
    pub files: Vec<&'a [u8]>,
}

/// Splits an [`FrameKind::Exec`] payload into the spec, stdin and the files' contents.
pub fn decode_exec(frame: &Frame) -> Result<ExecPayload<'_>, ProtoError> {
    let bad = |reason: &str| ProtoError::Payload {
        kind: FrameKind::Exec,
        reason: reason.to_owned(),
    };
    let (spec, rest): (ExecSpec, _) = decode_with_header(frame)?;
    let past_the_end = || bad("file contents past the end");
    let lens = spec
        .files
        .iter()
        .map(|f| usize::try_from(f.len).map_err(|_| past_the_end()))
        .collect::<Result<Vec<_>, _>>()?;
    let data = lens
        .iter()
        .try_fold(0usize, |sum, len| sum.checked_add(*len))
        .ok_or_else(past_the_end)?;
    let stdin_len = rest.len().checked_sub(data).ok_or_else(past_the_end)?;
    let (stdin, mut tail) = rest.split_at(stdin_len);
    let mut files = Vec::with_capacity(lens.len());
    for len in lens {
        let (head, rest) = tail.split_at(len);
        files.push(head);
        tail = rest;
    }
    Ok(ExecPayload { spec, stdin, files })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An exec frame as the edge's channel sends it: the spec, stdin, the files.
    fn encode_exec(
        out: &mut Vec<u8>,
        exec_id: u32,
        spec: &ExecSpec,
        stdin: &[u8],
        files: &[&[u8]],
    ) {
        let mut payload = encode_with_header(spec, stdin);
        for f in files {
            payload.extend_from_slice(f);
        }
        encode(out, FrameKind::Exec, exec_id, &payload);
    }

    #[test]
    fn frames_round_trip_and_wait_for_completeness() {
        let mut buf = Vec::new();
        encode(&mut buf, FrameKind::Stdout, 7, b"hello");
        encode_json(
            &mut buf,
            FrameKind::Ready,
            0,
            &Ready {
                version: VERSION,
                upper_fd: 3,
            },
        );
        let mut partial = buf[..HEADER_LEN + 2].to_vec();
        assert_eq!(decode(&mut partial).unwrap(), None);

        let first = decode(&mut buf).unwrap().unwrap();
        assert_eq!(first.kind, FrameKind::Stdout);
        assert_eq!(first.exec_id, 7);
        assert_eq!(first.payload, b"hello");
        let second = decode(&mut buf).unwrap().unwrap();
        assert_eq!(second.json::<Ready>().unwrap().version, VERSION);
        assert!(buf.is_empty());
    }

    #[test]
    fn exec_payload_carries_spec_and_stdin() {
        let spec = ExecSpec {
            argv: vec!["cat".into()],
            cwd: "/".into(),
            max_output_bytes: 10,
            ..Default::default()
        };
        let mut buf = Vec::new();
        encode_exec(&mut buf, 3, &spec, b"input", &[]);
        let frame = decode(&mut buf).unwrap().unwrap();
        let got = decode_exec(&frame).unwrap();
        assert_eq!(got.spec, spec);
        assert_eq!(got.stdin, b"input");
        assert!(got.files.is_empty());
    }

    #[test]
    fn exec_payload_carries_files_after_stdin() {
        let spec = ExecSpec {
            argv: vec!["sh".into()],
            files: vec![
                ExecFile {
                    path: "/a".into(),
                    mode: 0o644,
                    len: 2,
                },
                ExecFile {
                    path: "/b".into(),
                    mode: 0o755,
                    len: 3,
                },
            ],
            ..Default::default()
        };
        let mut buf = Vec::new();
        encode_exec(&mut buf, 1, &spec, b"in", &[b"aa", b"bbb"]);
        let frame = decode(&mut buf).unwrap().unwrap();
        let got = decode_exec(&frame).unwrap();
        assert_eq!(got.stdin, b"in");
        assert_eq!(got.files, vec![&b"aa"[..], &b"bbb"[..]]);
    }

    #[test]
    fn file_lengths_that_overflow_are_refused() {
        let file = |len| ExecFile {
            path: "/f".into(),
            mode: 0o644,
            len,
        };
        let spec = ExecSpec {
            files: vec![file(u64::MAX), file(2)],
            ..Default::default()
        };
        let mut buf = Vec::new();
        encode_exec(&mut buf, 1, &spec, b"", &[b"a"]);
        let frame = decode(&mut buf).unwrap().unwrap();
        assert!(matches!(
            decode_exec(&frame),
            Err(ProtoError::Payload { .. })
        ));
    }

    #[test]
    fn stepped_specs_round_trip_and_plain_ones_stay_plain() {
        let plain: ExecSpec = serde_json::from_str(
            r#"{"argv":["true"],"env":[],"cwd":"/","timeout_ms":1,"max_output_bytes":1}"#,
        )
        .unwrap();
        assert!(!plain.is_stepped());
        let json = serde_json::to_string(&plain).unwrap();
        assert!(
            !json.contains("then") && !json.contains("\"fetch\""),
            "{json}"
        );
        let stepped = ExecSpec {
            then: vec![ExecStep {
                argv: vec!["./a.out".into()],
                timeout_ms: Some(5),
            }],
            fetch: vec!["out.txt".into()],
            fetch_max_bytes: 9,
            ..plain
        };
        assert!(stepped.is_stepped());
        let back: ExecSpec =
            serde_json::from_str(&serde_json::to_string(&stepped).unwrap()).unwrap();
        assert_eq!(back, stepped);
    }

    #[test]
    fn fetched_files_carry_their_path_and_bytes() {
        let header = FetchedFile {
            path: "/mnt/b".into(),
            truncated: true,
        };
        let mut buf = Vec::new();
        encode(
            &mut buf,
            FrameKind::Fetched,
            4,
            &encode_with_header(&header, b"\x00\xff"),
        );
        let frame = decode(&mut buf).unwrap().unwrap();
        let (got, data): (FetchedFile, _) = decode_with_header(&frame).unwrap();
        assert_eq!((got, data), (header, &b"\x00\xff"[..]));
        assert_eq!(FrameKind::from_u8(16), Some(FrameKind::StepExit));
    }

    #[test]
    fn garbage_is_rejected() {
        let mut buf = vec![0, 0, 0, 0, 99, 0, 0, 0, 0];
        assert!(matches!(decode(&mut buf), Err(ProtoError::UnknownKind(99))));
        let mut huge = vec![0xff, 0xff, 0xff, 0x7f, 4, 0, 0, 0, 0];
        assert!(matches!(decode(&mut huge), Err(ProtoError::TooLarge(_))));
    }
}
