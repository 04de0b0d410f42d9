//! `dsec events [-f]`: the server's event stream, one line per event.

use std::io::{BufRead, Write};

use anyhow::{Context, Result};
use clap::Args;

use crate::{parse_label, Client, Remote};

#[derive(Args)]
pub struct EventsArgs {
    /// Keep going: print new events as they happen.
    #[arg(short, long)]
    follow: bool,
    /// Only this sandbox's events.
    #[arg(long)]
    sandbox: Option<String>,
    /// Only these kinds (repeatable); `limit` stands for every `limit.…` kind.
    #[arg(long = "kind")]
    kinds: Vec<String>,
    /// Only events of sandboxes with this label, `k=v` (repeatable).
    #[arg(long = "label", value_parser = parse_label)]
    labels: Vec<(String, String)>,
    /// Only events of the last this many seconds.
    #[arg(long)]
    since: Option<f64>,
    /// Print each event as its JSON line.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    remote: Remote,
}

pub fn run(args: EventsArgs) -> Result<()> {
    let client = Client::new(args.remote)?;
    let mut query: Vec<(&str, String)> = Vec::new();
    if let Some(s) = args.sandbox {
        query.push(("sandbox", s));
    }
    for k in args.kinds {
        query.push(("kind", k));
    }
    for (k, v) in args.labels {
        query.push(("label", format!("{k}={v}")));
    }
    if let Some(ago) = args.since {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        query.push(("since", (now - ago).max(0.0).to_string()));
    }
    if args.follow {
        query.push(("follow", "true".to_owned()));
    }
    let resp = client.send(
        client
            .get("/v1/events")
            .header(reqwest::header::ACCEPT, "application/x-ndjson")
            .query(&query),
    )?;
    let mut out = std::io::stdout().lock();
    for line in std::io::BufReader::new(resp).lines() {
        let line = line.context("reading the event stream")?;
        if line.trim().is_empty() {
            continue; // a follower's heartbeat
        }
        let text = if args.json {
            line
        } else {
            let event: serde_json::Value =
                serde_json::from_str(&line).context("the server sent a bad event")?;
            render(&event)
        };
        if writeln!(out, "{text}").and_then(|()| out.flush()).is_err() {
            break; // the reader went away (`dsec events | head`)
        }
    }
    Ok(())
}

/// `2026-12-02T05:01:02.345Z  command.end  sb-…  exit_code=0 duration_ms=3.1`.
fn render(event: &serde_json::Value) -> String {
    let time = event["time"].as_f64().unwrap_or(0.0);
    let stamp = chrono_free_utc(time);
    let kind = event["kind"].as_str().unwrap_or("?");
    let sandbox = event["sandbox"].as_str().unwrap_or("-");
    let details = match &event["data"] {
        serde_json::Value::Object(map) => map
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => format!("{k}={s:?}"),
                other => format!("{k}={other}"),
            })
            .collect::<Vec<_>>()
            .join(" "),
        serde_json::Value::Null => String::new(),
        other => other.to_string(),
    };
    format!("{stamp}  {kind:<18} {sandbox:<22} {details}")
}

/// A Unix time as `YYYY-MM-DDTHH:MM:SS.mmmZ` (civil-from-days, proleptic Gregorian).
fn chrono_free_utc(time: f64) -> String {
    // A Unix time in ms is far inside i64; `as` from f64 saturates regardless.
    #[allow(clippy::cast_possible_truncation)]
    let millis = (time * 1000.0) as i64;
    let (days, ms) = (millis.div_euclid(86_400_000), millis.rem_euclid(86_400_000));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_stamps() {
        assert_eq!(chrono_free_utc(0.0), "1970-01-01T00:00:00.000Z");
        assert_eq!(chrono_free_utc(1_796_187_662.5), "2026-12-02T05:01:02.500Z");
    }
}
