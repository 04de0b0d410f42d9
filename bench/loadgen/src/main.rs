//! Drives `dsec serve` with many sandboxes in flight and reports rates and latencies.
//!
//! The Python SDK costs a few milliseconds of CPU per request; on a 2-core machine that
//! shares its cores with the server, a Python client measures itself as much as dsec.
//! This client costs a fraction of that, so the rates it reports are the server's.
//! `bench/bench.py` runs it beside the SDK-driven measurements.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use futures::stream::{self, StreamExt};
use serde_json::{json, Value};

#[derive(Parser)]
#[command(about = "Create/exec/stop load against a dsec server")]
struct Args {
    /// Server URL.
    #[arg(long, default_value = "http://127.0.0.1:7700")]
    url: String,
    /// Image to create sandboxes from.
    #[arg(long, default_value = "busybox")]
    image: String,
    /// Sandboxes to create.
    #[arg(long, default_value_t = 500)]
    n: usize,
    /// Sandboxes (or calls) in flight.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Instead of sandboxes, make `n` calls of `/bin/true` through one `fncall` handle.
    #[arg(long)]
    fncall: bool,
    /// Instead of sandboxes, make `n` calls of `/bin/true`, each one `POST /v1/calls`.
    #[arg(long, conflicts_with = "fncall")]
    calls: bool,
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    // p is in [0, 1]: the index is in range, and `as` from f64 saturates anyway.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let i = ((sorted.len() as f64 * p) as usize).min(sorted.len() - 1);
    sorted[i].as_secs_f64() * 1000.0
}

async fn send(rb: reqwest::RequestBuilder) -> Result<Value> {
    let resp = rb.send().await.context("request failed")?;
    let status = resp.status();
    let text = resp.text().await?;
    if !status.is_success() {
        bail!("{status}: {text}");
    }
    Ok(if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text)?
    })
}

/// Creates a sandbox and runs `/bin/true` in it; returns the id and the latency.
async fn create_and_exec(http: &reqwest::Client, args: &Args) -> Result<(String, Duration)> {
    let started = Instant::now();
    let info = send(
        http.post(format!("{}/v1/sandboxes", args.url))
            .json(&json!({"image": args.image, "labels": {"bench": "loadgen"}})),
    )
    .await?;
    let id = info["id"].as_str().context("no id")?.to_owned();
    let result = send(
        http.post(format!("{}/v1/sandboxes/{id}/exec", args.url))
            .json(&json!({"cmd": ["/bin/true"]})),
    )
    .await?;
    if result["exit_code"] != json!(0) {
        bail!("/bin/true failed: {result}");
    }
    Ok((id, started.elapsed()))
}

/// `n` stateless calls of `/bin/true`, `concurrency` at a time: through one fncall handle
/// (`exec` on it), or with `one_request` each a `POST /v1/calls` of its own.
async fn fncall(http: &reqwest::Client, args: &Args, one_request: bool) -> Result<()> {
    let (url, body, handle) = if one_request {
        let body = json!({"image": args.image, "cmd": ["/bin/true"]});
        (format!("{}/v1/calls", args.url), body, None)
    } else {
        let info = send(
            http.post(format!("{}/v1/sandboxes", args.url))
                .json(&json!({"backend": "fncall", "image": args.image})),
        )
        .await?;
        let id = info["id"].as_str().context("no id")?.to_owned();
        let url = format!("{}/v1/sandboxes/{id}/exec", args.url);
        (url, json!({"cmd": ["/bin/true"]}), Some(id))
    };
    let started = Instant::now();
    let results: Vec<Result<Duration>> = stream::iter(0..args.n)
        .map(|_| {
            let rb = http.post(&url).json(&body);
            async move {
                let t = Instant::now();
                let r = send(rb).await?;
                if r["exit_code"] != json!(0) {
                    bail!("/bin/true failed: {r}");
                }
                Ok(t.elapsed())
            }
        })
        .buffer_unordered(args.concurrency)
        .collect()
        .await;
    let elapsed = started.elapsed();
    if let Some(id) = handle {
        send(http.delete(format!("{}/v1/sandboxes/{id}", args.url))).await?;
    }
    let failures = results.iter().filter(|r| r.is_err()).count();
    if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
        eprintln!("loadgen: first failure: {e:#}");
    }
    let mut latencies: Vec<Duration> = results.into_iter().flatten().collect();
    latencies.sort();
    println!(
        "{}",
        json!({
            "n": args.n,
            "concurrency": args.concurrency,
            "calls_per_s": latencies.len() as f64 / elapsed.as_secs_f64(),
            "call_p50_ms": percentile(&latencies, 0.5),
            "call_p99_ms": percentile(&latencies, 0.99),
            "failures": failures,
        })
    );
    if failures > 0 {
        bail!("{failures} failures");
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Arc::new(Args::parse());
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency)
        .build()?;
    if args.fncall || args.calls {
        return fncall(&http, &args, args.calls).await;
    }
    let started = Instant::now();
    let results: Vec<Result<(String, Duration)>> = stream::iter(0..args.n)
        .map(|_| {
            let (http, args) = (http.clone(), Arc::clone(&args));
            async move { create_and_exec(&http, &args).await }
        })
        .buffer_unordered(args.concurrency)
        .collect()
        .await;
    let create_elapsed = started.elapsed();
    let mut ids = Vec::new();
    let mut latencies = Vec::new();
    let mut failures = 0;
    for r in results {
        match r {
            Ok((id, latency)) => {
                ids.push(id);
                latencies.push(latency);
            }
            Err(e) => {
                failures += 1;
                eprintln!("loadgen: {e:#}");
            }
        }
    }
    latencies.sort();
    let stop_started = Instant::now();
    let stops: Vec<Result<Value>> = stream::iter(ids.iter())
        .map(|id| send(http.delete(format!("{}/v1/sandboxes/{id}", args.url))))
        .buffer_unordered(args.concurrency)
        .collect()
        .await;
    let stop_elapsed = stop_started.elapsed();
    failures += stops.iter().filter(|r| r.is_err()).count();
    println!(
        "{}",
        json!({
            "n": args.n,
            "concurrency": args.concurrency,
            "creations_per_s": ids.len() as f64 / create_elapsed.as_secs_f64(),
            "create_exec_p50_ms": percentile(&latencies, 0.5),
            "create_exec_p99_ms": percentile(&latencies, 0.99),
            "stops_per_s": ids.len() as f64 / stop_elapsed.as_secs_f64(),
            "failures": failures,
        })
    );
    if failures > 0 {
        bail!("{failures} failures");
    }
    Ok(())
}
