//! The Connect protocol (connectrpc.com/docs/protocol) as envd speaks it to the e2b SDK:
//! the JSON codec only, no compression, over HTTP/1.1 (or h2c).
//!
//! - **Unary**: `POST /pkg.Service/Method`, `Content-Type: application/json`, the request
//!   message as the body; the reply is `200 application/json` with the response message, or
//!   a non-2xx status (see [`Code::http_status`]) with `{"code","message"}`.
//! - **Streams**: `Content-Type: application/connect+json`; each message travels in an
//!   envelope `[flags u8][length u32 big-endian][JSON]`. The reply is always `200`: message
//!   envelopes (flags 0), then one end-of-stream envelope (flags [`FLAG_END_STREAM`]) whose
//!   JSON is `{}` or `{"error":{"code","message"}}`. A client stream (`StreamInput`) sends
//!   envelopes the same way in the request body, decoded as they arrive
//!   ([`EnvelopeDecoder`]), and is answered as a server stream of one message.
//! - `Connect-Timeout-Ms` bounds the whole call ([`deadline`]); a streaming call past it
//!   ends with `deadline_exceeded`, and dropping the handler's stream is what stops its work.
//! - `Keepalive-Ping-Interval` (seconds, an envd extension) asks a server stream to send a
//!   service-specific keep-alive message when it has been quiet that long.

use std::pin::Pin;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::time::Instant;

use crate::error::ApiError;

/// Envelope flag: the payload is compressed (never accepted: the SDK does not compress).
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: the end-of-stream message.
pub const FLAG_END_STREAM: u8 = 0x02;
/// `Content-Type` of unary JSON calls.
pub const UNARY_JSON: &str = "application/json";
/// `Content-Type` of streaming JSON calls.
pub const STREAM_JSON: &str = "application/connect+json";
/// Longest `Connect-Timeout-Ms` the protocol allows: ten digits.
const MAX_TIMEOUT_MS: u64 = 9_999_999_999;

/// A Connect error code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// The caller cancelled.
    Canceled,
    /// Nothing better fits.
    Unknown,
    /// Bad input, whatever the state.
    InvalidArgument,
    /// The call's deadline passed.
    DeadlineExceeded,
    /// No such thing.
    NotFound,
    /// It exists already.
    AlreadyExists,
    /// Not allowed for this caller.
    PermissionDenied,
    /// A quota or limit was hit.
    ResourceExhausted,
    /// Wrong state for this call.
    FailedPrecondition,
    /// A concurrency conflict.
    Aborted,
    /// Past a valid range.
    OutOfRange,
    /// Not implemented by this server.
    Unimplemented,
    /// A bug or a host failure.
    Internal,
    /// Cannot be served now.
    Unavailable,
    /// Data was lost.
    DataLoss,
    /// No valid credentials.
    Unauthenticated,
}

impl Code {
    /// The code's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status a unary error with this code carries (the protocol's table).
    pub fn http_status(self) -> StatusCode {
        let status = match self {
            Code::Canceled => 499,
            Code::Unknown | Code::Internal | Code::DataLoss => 500,
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists | Code::Aborted => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::Unauthenticated => 401,
        };
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

/// An error as a Connect client receives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectError {
    /// Its class.
    pub code: Code,
    /// What went wrong, for the user.
    pub message: String,
}

impl ConnectError {
    /// An error of `code`.
    pub fn new(code: Code, message: impl Into<String>) -> ConnectError {
        ConnectError {
            code,
            message: message.into(),
        }
    }

    /// Bad input.
    pub fn invalid(message: impl Into<String>) -> ConnectError {
        ConnectError::new(Code::InvalidArgument, message)
    }

    /// What this server does not do.
    pub fn unimplemented(message: impl Into<String>) -> ConnectError {
        ConnectError::new(Code::Unimplemented, message)
    }

    /// The JSON object both unary bodies and end-of-stream messages carry.
    fn json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

impl From<ApiError> for ConnectError {
    fn from(e: ApiError) -> ConnectError {
        use dsec_api::ErrorKind;
        let code = match e.kind {
            ErrorKind::InvalidArgument => Code::InvalidArgument,
            ErrorKind::Unauthorized => Code::Unauthenticated,
            ErrorKind::PermissionDenied => Code::PermissionDenied,
            ErrorKind::NotFound => Code::NotFound,
            ErrorKind::Conflict | ErrorKind::TrajectoryDiverged | ErrorKind::SandboxFailed => {
                Code::FailedPrecondition
            }
            ErrorKind::PayloadTooLarge | ErrorKind::Capacity | ErrorKind::QuotaExceeded => {
                Code::ResourceExhausted
            }
            ErrorKind::Unavailable => Code::Unavailable,
            ErrorKind::Internal => Code::Internal,
        };
        ConnectError::new(code, e.message)
    }
}

/// A unary error reply.
impl IntoResponse for ConnectError {
    fn into_response(self) -> Response {
        if self.code == Code::Internal {
            tracing::error!(message = %self.message, "envd: internal error");
        }
        let body = self.json().to_string();
        (
            self.code.http_status(),
            [(header::CONTENT_TYPE, UNARY_JSON)],
            body,
        )
            .into_response()
    }
}

/// One envelope: flags, big-endian length, payload.
pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let len = u32::try_from(payload.len()).expect("a message fits in 4 GiB");
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(flags);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(payload);
    Bytes::from(out)
}

/// The end-of-stream envelope: `{}` on success, else the error.
pub fn end_of_stream(result: Result<(), &ConnectError>) -> Bytes {
    let json = match result {
        Ok(()) => serde_json::json!({}),
        Err(e) => serde_json::json!({ "error": e.json() }),
    };
    envelope(FLAG_END_STREAM, json.to_string().as_bytes())
}

/// Splits a byte stream into envelopes, holding at most one message (plus its header).
#[derive(Debug)]
pub struct EnvelopeDecoder {
    pending: Vec<u8>,
    max_message_bytes: usize,
}

impl EnvelopeDecoder {
    /// A decoder refusing messages over `max_message_bytes`.
    pub fn new(max_message_bytes: usize) -> EnvelopeDecoder {
        EnvelopeDecoder {
            pending: Vec::new(),
            max_message_bytes,
        }
    }

    /// Takes more bytes of the stream.
    pub fn push(&mut self, data: &[u8]) {
        self.pending.extend_from_slice(data);
    }

    /// The next complete message's payload, `None` until one is complete.
    pub fn next_message(&mut self) -> Result<Option<Bytes>, ConnectError> {
        let Some(header) = self.pending.get(..5) else {
            return Ok(None);
        };
        let flags = header[0];
        let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
        if flags & FLAG_COMPRESSED != 0 {
            return Err(ConnectError::unimplemented(
                "compressed messages are not supported: send Connect-Content-Encoding: identity",
            ));
        }
        if flags & !FLAG_COMPRESSED != 0 {
            return Err(ConnectError::invalid(format!(
                "unexpected envelope flags {flags:#04x} in a request stream"
            )));
        }
        if len > self.max_message_bytes {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!(
                    "message of {len} bytes exceeds the limit of {} bytes",
                    self.max_message_bytes
                ),
            ));
        }
        if self.pending.len() < 5 + len {
            return Ok(None);
        }
        let message = Bytes::copy_from_slice(&self.pending[5..5 + len]);
        self.pending.drain(..5 + len);
        Ok(Some(message))
    }

    /// Checks that the stream ended on a message boundary.
    pub fn finish(&self) -> Result<(), ConnectError> {
        if self.pending.is_empty() {
            Ok(())
        } else {
            Err(ConnectError::invalid(format!(
                "request stream ended inside an envelope ({} bytes left over)",
                self.pending.len()
            )))
        }
    }
}

/// Parses a JSON message, naming the message type in the error.
pub fn decode<T: DeserializeOwned>(what: &str, data: &[u8]) -> Result<T, ConnectError> {
    // proto3 JSON: an empty body is the empty message.
    let data: &[u8] = if data.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        data
    };
    serde_json::from_slice(data).map_err(|e| ConnectError::invalid(format!("{what}: {e}")))
}

/// The call's deadline from `Connect-Timeout-Ms`; `None` when the client set none.
pub fn deadline(headers: &HeaderMap) -> Result<Option<Instant>, ConnectError> {
    let Some(value) = headers.get("connect-timeout-ms") else {
        return Ok(None);
    };
    let ms = value
        .to_str()
        .ok()
        .filter(|v| !v.is_empty() && v.len() <= 10 && v.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|ms| *ms <= MAX_TIMEOUT_MS)
        .ok_or_else(|| {
            ConnectError::invalid(format!(
                "Connect-Timeout-Ms must be 1 to 10 digits, got {value:?}"
            ))
        })?;
    Ok(Some(Instant::now() + Duration::from_millis(ms)))
}

/// How often a quiet server stream sends a keep-alive (`Keepalive-Ping-Interval`, seconds);
/// `None` when not asked for.
pub fn keepalive_interval(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get("keepalive-ping-interval")?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
}

/// Checks the `Content-Type` of a call: `streaming` calls take `application/connect+json`,
/// unary ones `application/json`. A binary (proto) codec is refused with 415, as the
/// protocol asks, so the client learns which codec to use.
#[expect(
    clippy::result_large_err,
    reason = "the error is the reply, returned once"
)]
pub fn check_content_type(headers: &HeaderMap, streaming: bool) -> Result<(), Response> {
    let given = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let base = given.split(';').next().unwrap_or_default().trim();
    let want = if streaming { STREAM_JSON } else { UNARY_JSON };
    if base.eq_ignore_ascii_case(want) {
        return Ok(());
    }
    Err((
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        [("accept-post", want)],
        format!("this endpoint takes Content-Type {want} (the Connect JSON codec), got {given:?}"),
    )
        .into_response())
}

/// A unary success reply.
pub fn unary_response<M: Serialize>(message: &M) -> Response {
    match serde_json::to_vec(message) {
        Ok(body) => ([(header::CONTENT_TYPE, UNARY_JSON)], body).into_response(),
        Err(e) => ConnectError::new(Code::Internal, e.to_string()).into_response(),
    }
}

/// The messages of a server stream, ending with `Err` to end it with that error.
pub type MessageStream<M> = Pin<Box<dyn Stream<Item = Result<M, ConnectError>> + Send>>;

/// A server-stream reply: the messages as envelopes, a keep-alive message after each
/// quiet `keepalive` interval, and the end-of-stream envelope, which carries the first
/// error, or `deadline_exceeded` once `deadline` passes (the message stream is then
/// dropped, which stops the work behind it).
pub fn stream_response<M, K>(
    messages: MessageStream<M>,
    deadline: Option<Instant>,
    keepalive: Option<(Duration, K)>,
) -> Response
where
    M: Serialize + Send + 'static,
    K: Fn() -> M + Send + 'static,
{
    struct State<M, K> {
        messages: Option<MessageStream<M>>,
        deadline: Option<Instant>,
        keepalive: Option<(Duration, K)>,
    }
    let state = State {
        messages: Some(messages),
        deadline,
        keepalive,
    };
    let body = futures::stream::unfold(state, |mut state| async move {
        let messages = state.messages.as_mut()?;
        let far = Instant::now() + Duration::from_secs(86400 * 365);
        let deadline = state.deadline.unwrap_or(far);
        let quiet = state
            .keepalive
            .as_ref()
            .map_or(far, |(every, _)| Instant::now() + *every);
        let next = tokio::select! {
            next = messages.next() => next,
            () = tokio::time::sleep_until(deadline) => Some(Err(ConnectError::new(
                Code::DeadlineExceeded,
                "the call's deadline (Connect-Timeout-Ms) passed",
            ))),
            () = tokio::time::sleep_until(quiet) => {
                let make = &state.keepalive.as_ref().expect("quiet needs keepalive").1;
                return Some((encode_message(&make()), state));
            }
        };
        let frame = match next {
            Some(Ok(message)) => return Some((encode_message(&message), state)),
            Some(Err(e)) => end_of_stream(Err(&e)),
            None => end_of_stream(Ok(())),
        };
        state.messages = None;
        Some((frame, state))
    })
    .map(Ok::<_, std::convert::Infallible>);
    (
        [
            (header::CONTENT_TYPE, STREAM_JSON),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

/// A stream reply that fails before its first message.
pub fn stream_error(e: &ConnectError) -> Response {
    if e.code == Code::Internal {
        tracing::error!(message = %e.message, "envd: internal error");
    }
    (
        [(header::CONTENT_TYPE, STREAM_JSON)],
        Body::from(end_of_stream(Err(e))),
    )
        .into_response()
}

fn encode_message<M: Serialize>(message: &M) -> Bytes {
    let json = serde_json::to_vec(message).expect("envd messages serialize");
    envelope(0, &json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip_across_any_split() {
        let mut wire = envelope(0, br#"{"a":1}"#).to_vec();
        wire.extend_from_slice(&envelope(0, b"{}"));
        for cut in 0..wire.len() {
            let mut d = EnvelopeDecoder::new(1024);
            let mut got = Vec::new();
            for part in [&wire[..cut], &wire[cut..]] {
                d.push(part);
                while let Some(m) = d.next_message().unwrap() {
                    got.push(m);
                }
            }
            assert_eq!(got, vec![Bytes::from(r#"{"a":1}"#), Bytes::from("{}")]);
            d.finish().unwrap();
        }
    }

    #[test]
    fn the_sdks_captured_start_request_decodes() {
        let mut d = EnvelopeDecoder::new(1 << 20);
        let json = br#"{"process":{"cmd":"/bin/bash"},"stdin":false}"#;
        d.push(&[0, 0, 0, 0, u8::try_from(json.len()).unwrap()]);
        d.push(json);
        assert_eq!(d.next_message().unwrap().unwrap(), Bytes::from(&json[..]));
    }

    #[test]
    fn oversized_compressed_and_truncated_messages_are_refused() {
        let mut d = EnvelopeDecoder::new(4);
        d.push(&envelope(0, b"12345"));
        assert_eq!(d.next_message().unwrap_err().code, Code::ResourceExhausted);
        let mut d = EnvelopeDecoder::new(64);
        d.push(&envelope(FLAG_COMPRESSED, b"x"));
        assert_eq!(d.next_message().unwrap_err().code, Code::Unimplemented);
        let mut d = EnvelopeDecoder::new(64);
        d.push(&envelope(0, b"{}")[..4]);
        assert!(d.next_message().unwrap().is_none());
        assert_eq!(d.finish().unwrap_err().code, Code::InvalidArgument);
    }

    #[test]
    fn end_of_stream_carries_the_error() {
        let frame = end_of_stream(Err(&ConnectError::new(Code::DeadlineExceeded, "late")));
        assert_eq!(frame[0], FLAG_END_STREAM);
        let json: serde_json::Value = serde_json::from_slice(&frame[5..]).unwrap();
        assert_eq!(json["error"]["code"], "deadline_exceeded");
        assert_eq!(json["error"]["message"], "late");
        assert_eq!(&end_of_stream(Ok(()))[5..], b"{}");
    }

    #[test]
    fn timeouts_parse_strictly() {
        let mut h = HeaderMap::new();
        assert!(deadline(&h).unwrap().is_none());
        h.insert("connect-timeout-ms", "60000".parse().unwrap());
        let d = deadline(&h).unwrap().unwrap();
        assert!(d > Instant::now() + Duration::from_secs(59));
        for bad in ["", "-1", "1.5", "12345678901", "abc"] {
            h.insert("connect-timeout-ms", bad.parse().unwrap());
            assert_eq!(
                deadline(&h).unwrap_err().code,
                Code::InvalidArgument,
                "{bad}"
            );
        }
    }

    #[test]
    fn status_table_matches_the_protocol() {
        assert_eq!(Code::Canceled.http_status().as_u16(), 499);
        assert_eq!(Code::DeadlineExceeded.http_status().as_u16(), 504);
        assert_eq!(Code::FailedPrecondition.http_status().as_u16(), 400);
        assert_eq!(Code::ResourceExhausted.http_status().as_u16(), 429);
        assert_eq!(Code::Unauthenticated.http_status().as_u16(), 401);
    }

    #[tokio::test(start_paused = true)]
    async fn quiet_streams_get_keepalives_and_deadlines_end_them() {
        let messages: MessageStream<u32> = Box::pin(futures::stream::pending());
        let deadline = Instant::now() + Duration::from_secs(25);
        let response = stream_response(
            messages,
            Some(deadline),
            Some((Duration::from_secs(10), || 7u32)),
        );
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        let mut d = EnvelopeDecoder::new(1 << 20);
        // Two keep-alives (at 10 s and 20 s), then the deadline's end of stream.
        let (keepalives, end) = body.split_at(2 * 6);
        d.push(keepalives);
        assert_eq!(d.next_message().unwrap().unwrap(), Bytes::from("7"));
        assert_eq!(d.next_message().unwrap().unwrap(), Bytes::from("7"));
        assert_eq!(end[0], FLAG_END_STREAM);
        assert!(std::str::from_utf8(&end[5..])
            .unwrap()
            .contains("deadline_exceeded"));
    }
}
