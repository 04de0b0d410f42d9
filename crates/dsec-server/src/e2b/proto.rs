//! The envd messages dsec serves (`process.proto`, `filesystem.proto` of e2b-dev/E2B's
//! `spec/envd`) in proto3's canonical JSON mapping: lowerCamelCase names, default values
//! left out, `bytes` as base64, 64-bit integers as strings, enums by name, a `oneof` as the
//! key of its chosen field. Requests ignore fields they do not know, as proto3 parsers do.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize, Serializer};

/// An empty message (`{}`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Empty {}

// ------------------------------------------------------------------ process.Process

/// What to run.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ProcessConfig {
    /// The program.
    pub cmd: String,
    /// Its arguments.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Environment added to the sandbox's.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub envs: BTreeMap<String, String>,
    /// Working directory; the user's home when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// A terminal's size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PtySize {
    /// Columns.
    pub cols: u32,
    /// Rows.
    pub rows: u32,
}

/// A terminal request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct Pty {
    /// Its size.
    pub size: PtySize,
}

/// `process.Process/Start`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct StartRequest {
    /// What to run.
    pub process: ProcessConfig,
    /// A terminal instead of pipes.
    pub pty: Option<Pty>,
    /// A name to find the process by.
    pub tag: Option<String>,
    /// Keep stdin open; absent means true (envd ≥ 0.3.0 honours `false`).
    pub stdin: Option<bool>,
}

/// Which process a call is about.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessSelector {
    /// Its pid.
    Pid(u32),
    /// The tag it was started with.
    Tag(String),
}

/// `Connect` and `CloseStdin`: a process, and nothing else.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct SelectorRequest {
    /// The process.
    pub process: Option<ProcessSelector>,
}

/// Bytes for a process: to its standard input, or typed on its terminal.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessInput {
    /// To its standard input.
    Stdin(#[serde(deserialize_with = "base64_bytes::deserialize")] Vec<u8>),
    /// To its terminal.
    Pty(#[serde(deserialize_with = "base64_bytes::deserialize")] Vec<u8>),
}

/// `SendInput`, and a `data` message of `StreamInput`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct SendInputRequest {
    /// The process (absent in `StreamInput`, which names it once, first).
    pub process: Option<ProcessSelector>,
    /// The bytes.
    pub input: Option<ProcessInput>,
}

/// One message of the `StreamInput` request stream.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum StreamInputRequest {
    /// First: the process the input is for.
    Start(SelectorRequest),
    /// Input.
    Data(SendInputRequest),
    /// Nothing; keeps a quiet stream alive.
    Keepalive(Empty),
}

/// A signal as a name (`SIGNAL_SIGKILL`) or its number, as proto3 JSON parsers take enums.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum SignalValue {
    /// The enum value's name.
    Name(String),
    /// Its number.
    Number(i32),
}

/// `SendSignal`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct SendSignalRequest {
    /// The process.
    pub process: Option<ProcessSelector>,
    /// The signal.
    pub signal: Option<SignalValue>,
}

/// `Update`: a new terminal size.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct UpdateRequest {
    /// The process.
    pub process: Option<ProcessSelector>,
    /// Its terminal's new size; absent changes nothing.
    pub pty: Option<Pty>,
}

/// A process as `List` describes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ProcessInfo {
    /// What it runs, as it was started.
    pub config: ProcessConfig,
    /// Its pid.
    pub pid: u32,
    /// Its tag.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

/// `List`'s reply.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ListResponse {
    /// The running processes.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<ProcessInfo>,
}

/// A chunk of output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum DataEvent {
    /// Standard output.
    Stdout(#[serde(serialize_with = "base64_bytes::serialize")] Arc<[u8]>),
    /// Standard error.
    Stderr(#[serde(serialize_with = "base64_bytes::serialize")] Arc<[u8]>),
    /// The terminal's output.
    Pty(#[serde(serialize_with = "base64_bytes::serialize")] Arc<[u8]>),
}

/// How a process ended.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndEvent {
    /// Its exit code; -1 when a signal ended it (as Go's `ProcessState.ExitCode`).
    #[serde(skip_serializing_if = "is_zero")]
    pub exit_code: i32,
    /// Whether it exited (rather than being killed by a signal).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub exited: bool,
    /// `exit status N` or `signal: killed`, as Go's `ProcessState.String`.
    pub status: String,
    /// Why waiting for it failed, if it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

fn is_zero(n: &i32) -> bool {
    *n == 0
}

/// One event of a process stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessEvent {
    /// First: the process started.
    Start {
        /// Its pid.
        pid: u32,
    },
    /// Output.
    Data(DataEvent),
    /// Last: it ended.
    End(EndEvent),
    /// Nothing; keeps a quiet stream alive.
    Keepalive(Empty),
}

/// A message of `Start` and `Connect` reply streams.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ProcessStreamMessage {
    /// The event.
    pub event: ProcessEvent,
}

impl ProcessStreamMessage {
    /// The keep-alive message.
    pub fn keepalive() -> ProcessStreamMessage {
        ProcessStreamMessage {
            event: ProcessEvent::Keepalive(Empty {}),
        }
    }
}

// ------------------------------------------------------------------ filesystem.Filesystem

/// `filesystem.Filesystem/Stat`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct PathRequest {
    /// The path; relative paths are the user's home's.
    pub path: String,
}

/// `filesystem.Filesystem/ListDir`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct ListDirRequest {
    /// The directory.
    pub path: String,
    /// How many levels down; 0 means 1.
    pub depth: u32,
}

/// `filesystem.Filesystem/Move`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct MoveRequest {
    /// What is moved.
    pub source: String,
    /// Where to.
    pub destination: String,
}

/// `filesystem.Filesystem/WatchDir` and `CreateWatcher`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct WatchDirRequest {
    /// The directory.
    pub path: String,
    /// Below it too.
    pub recursive: bool,
    /// Each event carries the entry of its path (envd 0.6.3).
    #[serde(alias = "include_entry")]
    pub include_entry: bool,
    /// A directory on a network filesystem may be watched (envd 0.6.4). dsec's files
    /// API serves no network filesystem whatever this says (see `envd::watch_dir`).
    #[serde(alias = "allow_network_mounts")]
    pub allow_network_mounts: bool,
}

/// `GetWatcherEvents` and `RemoveWatcher`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct WatcherRequest {
    /// What `CreateWatcher` answered.
    pub watcher_id: String,
}

/// What happened to a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum EventType {
    /// Made, or moved in.
    #[serde(rename = "EVENT_TYPE_CREATE")]
    Create,
    /// Written.
    #[serde(rename = "EVENT_TYPE_WRITE")]
    Write,
    /// Removed.
    #[serde(rename = "EVENT_TYPE_REMOVE")]
    Remove,
    /// Moved away.
    #[serde(rename = "EVENT_TYPE_RENAME")]
    Rename,
    /// Mode or owner changed.
    #[serde(rename = "EVENT_TYPE_CHMOD")]
    Chmod,
}

/// One change under a watched directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FilesystemEvent {
    /// Its path relative to the watched directory.
    pub name: String,
    /// What happened.
    #[serde(rename = "type")]
    pub event_type: EventType,
    /// The path's entry as the event was handled, when the watch asked for entries;
    /// none for a path removed or moved away, or gone by then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<Box<EntryInfo>>,
}

/// A message of the `WatchDir` reply stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum WatchDirResponse {
    /// First: the watch is armed.
    Start(Empty),
    /// A change.
    Filesystem(FilesystemEvent),
    /// Nothing; keeps a quiet stream alive.
    Keepalive(Empty),
}

/// What kind of file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum FileType {
    /// Unknown.
    #[serde(rename = "FILE_TYPE_UNSPECIFIED")]
    Unspecified,
    /// A regular file.
    #[serde(rename = "FILE_TYPE_FILE")]
    File,
    /// A directory.
    #[serde(rename = "FILE_TYPE_DIRECTORY")]
    Directory,
    /// A symbolic link.
    #[serde(rename = "FILE_TYPE_SYMLINK")]
    Symlink,
}

/// A file's description.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    /// Its name.
    pub name: String,
    /// Its type.
    #[serde(rename = "type")]
    pub file_type: FileType,
    /// Its absolute path.
    pub path: String,
    /// Its size in bytes.
    #[serde(serialize_with = "int64_string")]
    pub size: i64,
    /// Mode bits, type included (as Go's `os.FileMode`).
    pub mode: u32,
    /// `ls -l`-style permissions, e.g. `-rw-r--r--`.
    pub permissions: String,
    /// Owner's user name.
    pub owner: String,
    /// Owner's group name.
    pub group: String,
    /// Last modification, RFC 3339.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub modified_time: Option<String>,
    /// Where a symbolic link points.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    /// User metadata (the `user.e2b.*` extended attributes).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// A reply carrying one entry (`Stat`, `MakeDir`, `Move`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EntryResponse {
    /// The entry.
    pub entry: EntryInfo,
}

/// `ListDir`'s reply.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ListDirResponse {
    /// The entries.
    pub entries: Vec<EntryInfo>,
}

// ------------------------------------------------------------------ encodings

fn int64_string<S: Serializer>(n: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(n)
}

/// proto3 `bytes`: standard base64 out; standard or URL-safe, padded or not, in (as
/// proto3 JSON parsers accept).
mod base64_bytes {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE_NO_PAD};
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(data: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(data))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        let bare = text.trim_end_matches('=');
        let engine = if bare.contains(['-', '_']) {
            URL_SAFE_NO_PAD
        } else {
            STANDARD_NO_PAD
        };
        engine
            .decode(bare)
            .map_err(|e| serde::de::Error::custom(format!("bytes must be base64: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sdks_start_request_parses() {
        let req: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"},"cwd":"/tmp"},"stdin":false,"unknownField":1}"#,
        )
        .unwrap();
        assert_eq!(req.process.args, ["-l", "-c", "echo hi"]);
        assert_eq!(req.process.cwd.as_deref(), Some("/tmp"));
        assert_eq!(req.stdin, Some(false));
        assert!(req.pty.is_none());
        let pty: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"bash"},"pty":{"size":{"cols":80,"rows":24}},"tag":"t"}"#,
        )
        .unwrap();
        assert_eq!(pty.pty.unwrap().size, PtySize { cols: 80, rows: 24 });
        assert_eq!(pty.tag.as_deref(), Some("t"));
        assert_eq!(pty.stdin, None);
    }

    #[test]
    fn events_serialize_in_canonical_json() {
        let end = ProcessStreamMessage {
            event: ProcessEvent::End(EndEvent {
                exit_code: 0,
                exited: true,
                status: "exit status 0".into(),
                error: None,
            }),
        };
        assert_eq!(
            serde_json::to_string(&end).unwrap(),
            r#"{"event":{"end":{"exited":true,"status":"exit status 0"}}}"#
        );
        let data = ProcessStreamMessage {
            event: ProcessEvent::Data(DataEvent::Stdout(Arc::from(&b"hi\n"[..]))),
        };
        assert_eq!(
            serde_json::to_string(&data).unwrap(),
            r#"{"event":{"data":{"stdout":"aGkK"}}}"#
        );
        assert_eq!(
            serde_json::to_string(&ProcessStreamMessage::keepalive()).unwrap(),
            r#"{"event":{"keepalive":{}}}"#
        );
        assert_eq!(
            serde_json::to_string(&ProcessEvent::Start { pid: 5 }).unwrap(),
            r#"{"start":{"pid":5}}"#
        );
    }

    #[test]
    fn the_sdks_process_requests_parse() {
        let req: SendInputRequest =
            serde_json::from_str(r#"{"process":{"pid":42},"input":{"stdin":"aGkK"}}"#).unwrap();
        assert_eq!(req.process, Some(ProcessSelector::Pid(42)));
        assert_eq!(req.input, Some(ProcessInput::Stdin(b"hi\n".to_vec())));
        let pty: SendInputRequest =
            serde_json::from_str(r#"{"process":{"tag":"t"},"input":{"pty":"_w"}}"#).unwrap();
        assert_eq!(pty.input, Some(ProcessInput::Pty(vec![0xff])));
        let start: StreamInputRequest =
            serde_json::from_str(r#"{"start":{"process":{"pid":7}}}"#).unwrap();
        assert_eq!(
            start,
            StreamInputRequest::Start(SelectorRequest {
                process: Some(ProcessSelector::Pid(7))
            })
        );
        let keepalive: StreamInputRequest = serde_json::from_str(r#"{"keepalive":{}}"#).unwrap();
        assert_eq!(keepalive, StreamInputRequest::Keepalive(Empty {}));
        for (json, want) in [
            (
                r#"{"signal":"SIGNAL_SIGKILL"}"#,
                SignalValue::Name("SIGNAL_SIGKILL".into()),
            ),
            (r#"{"signal":15}"#, SignalValue::Number(15)),
        ] {
            let req: SendSignalRequest = serde_json::from_str(json).unwrap();
            assert_eq!(req.signal, Some(want));
        }
        assert!(serde_json::from_str::<SendInputRequest>(r#"{"input":{"stdin":"!"}}"#).is_err());
    }

    #[test]
    fn lists_name_their_processes() {
        let list = ListResponse {
            processes: vec![ProcessInfo {
                config: ProcessConfig {
                    cmd: "sleep".into(),
                    args: vec!["9".into()],
                    ..ProcessConfig::default()
                },
                pid: 12,
                tag: None,
            }],
        };
        assert_eq!(
            serde_json::to_string(&list).unwrap(),
            r#"{"processes":[{"config":{"cmd":"sleep","args":["9"]},"pid":12}]}"#
        );
        assert_eq!(
            serde_json::to_string(&ListResponse::default()).unwrap(),
            "{}"
        );
    }

    #[test]
    fn entries_use_strings_for_int64_and_enum_names() {
        let entry = EntryInfo {
            name: "a.txt".into(),
            file_type: FileType::File,
            path: "/home/user/a.txt".into(),
            size: 3,
            mode: 0o644,
            permissions: "-rw-r--r--".into(),
            owner: "user".into(),
            group: "user".into(),
            modified_time: Some("2024-01-01T00:00:00Z".into()),
            symlink_target: None,
            metadata: BTreeMap::new(),
        };
        let json = serde_json::to_value(&entry).unwrap();
        assert_eq!(json["size"], "3");
        assert_eq!(json["type"], "FILE_TYPE_FILE");
        assert_eq!(json["modifiedTime"], "2024-01-01T00:00:00Z");
        assert!(json.get("symlinkTarget").is_none());
    }
}
