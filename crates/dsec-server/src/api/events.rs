//! `GET /v1/events`: the edge's event stream as NDJSON (or SSE), filtered.
//!
//! Without `follow` the answer is what is kept (oldest first, at most `limit`) and ends;
//! with `follow` it goes on with new events as they happen, a blank line every
//! [`HEARTBEAT`] keeping idle connections open. A follower subscribes before it reads the
//! history, and skips live events the history already held, so nothing falls in between.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap};
use axum::response::Response;
use futures::StreamExt;
use tokio::sync::broadcast;

use super::{form_pairs, AppState};
use crate::error::ApiError;
use crate::events::{kind, Event, Filter};
use crate::projects::Caller;

/// How often an idle follower gets a blank line.
const HEARTBEAT: Duration = Duration::from_secs(15);
/// History served when no `limit` is given.
const DEFAULT_LIMIT: usize = 10_000;

/// The query of `GET /v1/events`, parsed.
struct EventsQuery {
    filter: Filter,
    follow: bool,
    limit: usize,
}

fn parse_query(query: &str) -> Result<EventsQuery, ApiError> {
    let mut q = EventsQuery {
        filter: Filter::default(),
        follow: false,
        limit: DEFAULT_LIMIT,
    };
    let number = |key: &str, value: &str| -> Result<f64, ApiError> {
        value
            .parse::<f64>()
            .ok()
            .filter(|n| n.is_finite() && *n >= 0.0)
            .ok_or_else(|| {
                ApiError::invalid(format!(
                    "{key} must be a non-negative number, got {value:?}"
                ))
            })
    };
    // Finite and non-negative: `as` drops the fraction and saturates.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let whole = |key: &str, value: &str| number(key, value).map(|n| n as u64);
    for (key, value) in form_pairs(query) {
        match key.as_str() {
            "sandbox" => q.filter.sandbox = Some(value),
            "label" => {
                let (k, v) = value.split_once('=').ok_or_else(|| {
                    ApiError::invalid(format!("label filter {value:?} must look like key=value"))
                })?;
                q.filter.labels.push((k.to_owned(), v.to_owned()));
            }
            "kind" => q.filter.kinds.extend(
                value
                    .split(',')
                    .filter(|k| !k.is_empty())
                    .map(str::to_owned),
            ),
            "since" => q.filter.since = Some(number("since", &value)?),
            "after" => q.filter.after = Some(whole("after", &value)?),
            "limit" => q.limit = usize::try_from(whole("limit", &value)?).unwrap_or(usize::MAX),
            "follow" => {
                q.follow = match value.as_str() {
                    "" | "1" | "true" => true,
                    "0" | "false" => false,
                    _ => {
                        return Err(ApiError::invalid(format!(
                            "follow must be true or false, got {value:?}"
                        )))
                    }
                }
            }
            other => {
                return Err(ApiError::invalid(format!(
                    "unknown query parameter {other:?}: GET /v1/events takes sandbox, label, \
                     kind, since, after, limit and follow"
                )))
            }
        }
    }
    Ok(q)
}

fn frame(event: &Event, sse: bool) -> Bytes {
    let json = serde_json::to_string(event).expect("events serialize");
    Bytes::from(if sse {
        format!("id: {}\ndata: {json}\n\n", event.id)
    } else {
        format!("{json}\n")
    })
}

/// What a follower that fell `missed` events behind is told.
fn lost(missed: u64) -> Event {
    Event {
        id: 0,
        time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
        kind: kind::EVENTS_LOST.to_owned(),
        sandbox: None,
        labels: Default::default(),
        project: None,
        data: serde_json::json!({"missed": missed}),
    }
}

#[utoipa::path(get, path = "/v1/events",
    params(
        ("sandbox" = Option<String>, Query, description = "only this sandbox's events"),
        ("label" = Option<Vec<String>>, Query, description = "k=v; repeatable; all must match"),
        ("kind" = Option<Vec<String>>, Query, description = "kinds, repeatable or comma-separated; `limit` or `limit.*` for a family"),
        ("since" = Option<f64>, Query, description = "Unix time: only events at or after it"),
        ("after" = Option<u64>, Query, description = "only events with a larger id (resume)"),
        ("limit" = Option<u64>, Query, description = "at most this many of the kept events (the newest); default 10000"),
        ("follow" = Option<bool>, Query, description = "keep the answer open and send new events as they happen"),
    ),
    responses((status = 200, description = "NDJSON (or SSE) of Event", body = crate::events::Event),
              (status = 400, body = dsec_api::ErrorBody)))]
pub(super) async fn events(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let mut q = parse_query(query.as_deref().unwrap_or_default())?;
    q.filter.project = caller.project().map(|p| p.to_string());
    let sse = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"));
    let events = Arc::clone(state.edge.events());
    let live = q.follow.then(|| events.subscribe());
    let filter = q.filter.clone();
    let limit = q.limit;
    let history = tokio::task::spawn_blocking(move || events.history(&filter, limit))
        .await
        .map_err(|e| ApiError::unavailable(format!("reading events: {e}")))?;
    let last = history.last().map_or(0, |e| e.id);
    let past = futures::stream::iter(
        history
            .into_iter()
            .map(move |e| Ok::<_, Infallible>(frame(&e, sse))),
    );
    let body = match live {
        None => Body::from_stream(past),
        Some(live) => {
            let filter = q.filter;
            let follow = futures::stream::unfold(live, move |mut live| {
                let filter = filter.clone();
                async move {
                    loop {
                        match tokio::time::timeout(HEARTBEAT, live.recv()).await {
                            Err(_) => {
                                let beat = if sse { ":\n\n" } else { "\n" };
                                return Some((Bytes::from_static(beat.as_bytes()), live));
                            }
                            Ok(Ok(e)) if e.id > last && filter.matches(&e) => {
                                return Some((frame(&e, sse), live))
                            }
                            Ok(Ok(_)) => {}
                            Ok(Err(broadcast::error::RecvError::Lagged(n))) => {
                                return Some((frame(&lost(n), sse), live))
                            }
                            Ok(Err(broadcast::error::RecvError::Closed)) => return None,
                        }
                    }
                }
            })
            .map(Ok::<_, Infallible>);
            Body::from_stream(past.chain(follow))
        }
    };
    Ok(super::streamed(sse, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_parse_and_bad_ones_say_why() {
        let q = parse_query("sandbox=a&kind=limit,command.end&label=t=x&since=5&follow=true")
            .expect("parses");
        assert_eq!(q.filter.sandbox.as_deref(), Some("a"));
        assert_eq!(q.filter.kinds, ["limit", "command.end"]);
        assert_eq!(q.filter.labels, [("t".to_owned(), "x".to_owned())]);
        assert_eq!(q.filter.since, Some(5.0));
        assert!(q.follow);
        for (bad, says) in [
            ("since=yesterday", "since"),
            ("label=novalue", "key=value"),
            ("follow=maybe", "follow"),
            ("sandboxes=a", "unknown query parameter"),
        ] {
            let e = parse_query(bad).err().expect(bad);
            assert!(e.message.contains(says), "{bad}: {}", e.message);
        }
    }
}
