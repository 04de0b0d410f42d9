//! The control protocol between the edge and a sandbox's init.
//!
//! For a container the channel is one end of a `socketpair(AF_UNIX, SOCK_STREAM)` that
//! init inherited at clone time. It has no name in any filesystem, init marks itself
//! non-dumpable so `/proc/1/fd` is closed to the sandbox's processes, and every descriptor
//! init holds is close-on-exec: nothing inside the sandbox can open, reach or forge it.
//! A VM guest's agent speaks the same protocol over a virtio-serial port or a vsock
//! connection (see `dsec-agent`); there file operations and the guest's identity travel
//! on the channel too, as request frames answered by [`FrameKind::Done`] or
//! [`FrameKind::Error`] with the request's id.
//!
//! Each frame is a 9-byte header — payload length (`u32` LE), kind (`u8`), exec id
//! (`u32` LE) — followed by the payload. Output travels as raw bytes (no JSON escaping on
//! the hot path); the few structured messages are JSON.

use serde::{Deserialize, Serialize};

/// Bumped on any incompatible change; the edge refuses a mismatching init or agent.
pub const VERSION: u32 = 2;

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 9;

/// Largest payload a peer accepts; bounds memory against a corrupt stream.
pub const MAX_PAYLOAD: usize = 256 << 20;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// init → edge: setup finished; payload: JSON [`Ready`].
    Ready = 1,
    /// edge → init: run a command; payload: `u32` LE JSON length, JSON [`ExecSpec`], stdin.
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
    /// edge → agent: read a file; payload: the absolute path. Answer: its contents.
    ReadFile = 9,
    /// edge → agent: write a file; payload: `u32` LE JSON length, JSON [`WriteFile`],
    /// contents.
    WriteFile = 10,
    /// edge → agent: list a directory; payload: the absolute path. Answer: JSON
    /// `Vec<`[`crate::files::Entry`]`>`.
    ListDir = 11,
    /// init → edge: a request succeeded; payload: its answer.
    Done = 12,
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
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.push(kind as u8);
    out.extend_from_slice(&exec_id.to_le_bytes());
    out.extend_from_slice(payload);
}

/// Appends a frame whose payload is `value` as JSON.
pub fn encode_json<T: Serialize>(out: &mut Vec<u8>, kind: FrameKind, exec_id: u32, value: &T) {
    let json = serde_json::to_vec(value).expect("protocol types serialize");
    encode(out, kind, exec_id, &json);
}

/// Removes and returns the first complete frame of `buf`, if there is one.
pub fn decode(buf: &mut Vec<u8>) -> Result<Option<Frame>, ProtoError> {
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let len = u32::from_le_bytes(buf[0..4].try_into().expect("4 bytes")) as usize;
    if len > MAX_PAYLOAD {
        return Err(ProtoError::TooLarge(len));
    }
    let kind = FrameKind::from_u8(buf[4]).ok_or(ProtoError::UnknownKind(buf[4]))?;
    if buf.len() < HEADER_LEN + len {
        return Ok(None);
    }
    let exec_id = u32::from_le_bytes(buf[5..9].try_into().expect("4 bytes"));
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

/// Why init could not do what it was asked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitError {
    /// Which step failed (`chdir`, `exec`, `setup`, `files`, ...).
    pub stage: String,
    /// `errno`, when a syscall failed.
    pub errno: Option<i32>,
    /// Human-readable explanation.
    pub message: String,
    /// For a failed file request: what kind of failure, so the edge can answer exactly as
    /// it does for a container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<crate::files::FileFault>,
}

/// What a VM guest takes on when it is restored from a snapshot that other sandboxes
/// share: its own name, fresh randomness and the current time.
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
}

/// Header of a [`FrameKind::WriteFile`] request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteFile {
    /// Absolute path in the guest.
    pub path: String,
    /// Permission bits.
    pub mode: u32,
}

/// Builds a payload made of a JSON header and raw bytes (`u32` LE header length first),
/// as [`FrameKind::WriteFile`] uses.
pub fn encode_with_header<T: Serialize>(header: &T, data: &[u8]) -> Vec<u8> {
    let json = serde_json::to_vec(header).expect("protocol types serialize");
    let mut payload = Vec::with_capacity(4 + json.len() + data.len());
    payload.extend_from_slice(&(json.len() as u32).to_le_bytes());
    payload.extend_from_slice(&json);
    payload.extend_from_slice(data);
    payload
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

/// Builds the payload of an [`FrameKind::Exec`] frame: the spec, stdin, then the
/// contents of `spec.files` in order.
pub fn encode_exec(
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
    let data: u64 = spec.files.iter().map(|f| f.len).sum();
    let stdin_len = (rest.len() as u64)
        .checked_sub(data)
        .ok_or_else(|| bad("file contents past the end"))? as usize;
    let (stdin, mut tail) = rest.split_at(stdin_len);
    let mut files = Vec::with_capacity(spec.files.len());
    for f in &spec.files {
        let (head, rest) = tail.split_at(f.len as usize);
        files.push(head);
        tail = rest;
    }
    Ok(ExecPayload { spec, stdin, files })
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn garbage_is_rejected() {
        let mut buf = vec![0, 0, 0, 0, 99, 0, 0, 0, 0];
        assert!(matches!(decode(&mut buf), Err(ProtoError::UnknownKind(99))));
        let mut huge = vec![0xff, 0xff, 0xff, 0x7f, 4, 0, 0, 0, 0];
        assert!(matches!(decode(&mut huge), Err(ProtoError::TooLarge(_))));
    }
}
