//! `dsec top`: a refreshing table of the sandboxes' live usage, like `docker stats`.
//!
//! CPU is the share of one core used since the previous refresh (from the CPU time each
//! refresh reads); NET I/O the bytes received and sent over the sandbox's network; FLAGS
//! shows the Watcher's `watcher.<rule>` labels, the limits a sandbox keeps hitting and the
//! share of the refresh its CPU limit held it back (`throttled`), so misbehaving
//! sandboxes stand out.

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::{Args, ValueEnum};
use dsec_api::SandboxInfo;

use crate::{human_size, parse_label, Client, Remote};

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SortKey {
    Cpu,
    Memory,
    Pids,
    Disk,
    Net,
    Age,
    Id,
}

#[derive(Args)]
pub struct TopArgs {
    /// Column to sort by, largest first (age: oldest first; id: alphabetical).
    #[arg(long, value_enum, default_value = "cpu")]
    sort: SortKey,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
    /// Print the table once (CPU over one interval) and exit.
    #[arg(long)]
    once: bool,
    /// Only sandboxes with this label, `k=v` (repeatable).
    #[arg(long = "label", value_parser = parse_label)]
    labels: Vec<(String, String)>,
    #[command(flatten)]
    remote: Remote,
}

struct Row {
    info: SandboxInfo,
    cpu_percent: f64,
    /// Share of the refresh the CPU limit held it back, in percent.
    throttled_percent: f64,
}

/// A sandbox's CPU and throttled time at the previous refresh.
struct Before {
    cpu_ms: f64,
    throttled_ms: f64,
}

pub fn run(args: TopArgs) -> Result<()> {
    let client = Client::new(args.remote)?;
    let query: Vec<(&str, String)> = args
        .labels
        .iter()
        .map(|(k, v)| ("label", format!("{k}={v}")))
        .collect();
    let interval = Duration::from_secs_f64(args.interval.clamp(0.1, 3600.0));
    let fetch =
        || -> Result<Vec<SandboxInfo>> { client.json(client.get("/v1/sandboxes").query(&query)) };
    let mut before: HashMap<String, Before> = HashMap::new();
    let mut at = Instant::now();
    let mut first = true;
    loop {
        let list = fetch()?;
        let elapsed_ms = at.elapsed().as_secs_f64() * 1000.0;
        at = Instant::now();
        let rows: Vec<Row> = list
            .into_iter()
            .map(|info| {
                let percent = |now: f64, prev: f64| (now - prev).max(0.0) / elapsed_ms * 100.0;
                let (cpu_percent, throttled_percent) = match before.get(&info.id) {
                    Some(prev) if elapsed_ms > 0.0 => (
                        percent(info.usage.cpu_ms, prev.cpu_ms),
                        percent(info.usage.cpu_throttled_ms, prev.throttled_ms),
                    ),
                    _ => (0.0, 0.0),
                };
                Row {
                    info,
                    cpu_percent,
                    throttled_percent,
                }
            })
            .collect();
        before = rows
            .iter()
            .map(|r| {
                let u = &r.info.usage;
                let prev = Before {
                    cpu_ms: u.cpu_ms,
                    throttled_ms: u.cpu_throttled_ms,
                };
                (r.info.id.clone(), prev)
            })
            .collect();
        // The first round has no CPU share yet: measure over one interval first.
        if !first || !args.once {
            let table = render(rows, args.sort);
            let mut out = std::io::stdout().lock();
            let clear = if args.once { "" } else { "\x1b[H\x1b[2J" };
            if write!(out, "{clear}{table}")
                .and_then(|()| out.flush())
                .is_err()
            {
                return Ok(());
            }
            if args.once {
                return Ok(());
            }
        }
        first = false;
        std::thread::sleep(interval);
    }
}

fn render(mut rows: Vec<Row>, sort: SortKey) -> String {
    rows.sort_by(|a, b| {
        let (ua, ub) = (&a.info.usage, &b.info.usage);
        match sort {
            SortKey::Cpu => b.cpu_percent.total_cmp(&a.cpu_percent),
            SortKey::Memory => ub.memory_bytes.cmp(&ua.memory_bytes),
            SortKey::Pids => ub.pids.cmp(&ua.pids),
            SortKey::Disk => ub.disk_bytes.cmp(&ua.disk_bytes),
            SortKey::Net => net_bytes(ub).cmp(&net_bytes(ua)),
            SortKey::Age => a.info.created_at.total_cmp(&b.info.created_at),
            SortKey::Id => a.info.id.cmp(&b.info.id),
        }
    });
    let mut out = format!(
        "{:<22} {:<9} {:<8} {:>6} {:>10} {:>10} {:>9} {:>10} {:>21}  FLAGS\n",
        "ID", "BACKEND", "STATE", "CPU%", "MEM", "MEM PEAK", "PIDS", "DISK", "NET I/O"
    );
    for r in rows {
        let (i, u) = (&r.info, &r.info.usage);
        let pids = match i.limits.pids {
            Some(limit) => format!("{}/{limit}", u.pids),
            None => u.pids.to_string(),
        };
        let mut flags: Vec<String> = i
            .labels
            .keys()
            .filter_map(|k| k.strip_prefix("watcher."))
            .map(str::to_owned)
            .collect();
        if u.pids_limit_hits > 0 {
            flags.push(format!("pids-limit×{}", u.pids_limit_hits));
        }
        if u.oom_kills > 0 {
            flags.push(format!("oom×{}", u.oom_kills));
        }
        if r.throttled_percent >= 10.0 {
            flags.push(format!("throttled {:.0}%", r.throttled_percent));
        }
        let net = match (u.network_rx_bytes, u.network_tx_bytes) {
            (Some(rx), Some(tx)) => format!("{} / {}", human_size(rx), human_size(tx)),
            _ => "-".to_owned(),
        };
        out.push_str(&format!(
            "{:<22} {:<9} {:<8} {:>6.1} {:>10} {:>10} {:>9} {:>10} {:>21}  {}\n",
            i.id,
            i.backend,
            i.state.as_str(),
            r.cpu_percent,
            human_size(u.memory_bytes),
            human_size(u.memory_peak_bytes),
            pids,
            u.disk_bytes.map_or_else(|| "-".to_owned(), human_size),
            net,
            flags.join(",")
        ));
    }
    out
}

/// Bytes received and sent over its network (0 without one).
fn net_bytes(u: &dsec_api::Usage) -> u64 {
    u.network_rx_bytes.unwrap_or(0) + u.network_tx_bytes.unwrap_or(0)
}
