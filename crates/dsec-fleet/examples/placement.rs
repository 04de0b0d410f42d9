//! Placement decisions per second on one core with a table of `--edges` edges (default
//! 160, with varied loads and backends): keyless creates (random draws) and keyed ones
//! (rendezvous draws). `bench/fleet_bench.py` runs it; the target is 20,000/s.
//!
//!     cargo run --release -p dsec-fleet --example placement -- [--edges N] [--seconds S]

use std::time::{Duration, Instant};

use dsec_fleet::membership::{EdgeRecord, Members};
use dsec_fleet::placement::place;
use dsec_server::edge::EdgeLoad;

fn table(edges: usize) -> Members {
    Members::new((0..edges).map(|i| EdgeRecord {
        name: format!("host-{i:03}"),
        url: format!("http://10.0.{}.{}:7700", i / 250, i % 250),
        ready: true,
        load: EdgeLoad {
            // Every edge runs container and fncall; one in four also runs the VM backends.
            backends: if i % 4 == 0 {
                vec![
                    "fncall".into(),
                    "container".into(),
                    "microvm".into(),
                    "vm".into(),
                ]
            } else {
                vec!["fncall".into(), "container".into()]
            },
            sandbox_count: (i * 7 % 500) as u64,
            memory_budget_mb: 90_000,
            memory_promised_mb: (i * 7 % 500) as u64 * 512,
            creating: (i % 5) as u64,
            ..Default::default()
        },
        updated_at: 0.0,
        e2b: None,
    }))
}

fn rate(seconds: f64, mut decide: impl FnMut(u64)) -> f64 {
    let until = Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < until {
        for _ in 0..1000 {
            decide(n);
            n += 1;
        }
    }
    n as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    let mut edges = 160;
    let mut seconds = 2.0;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().expect("a value after each option");
        match arg.as_str() {
            "--edges" => edges = value.parse().expect("--edges N"),
            "--seconds" => seconds = value.parse().expect("--seconds S"),
            other => panic!("unknown option {other}"),
        }
    }
    let members = table(edges);
    let mut rng = rand::rng();
    let keyless = rate(seconds, |_| {
        std::hint::black_box(place(&members, "container", 2, None, &mut rng).expect("placed"));
    });
    let keyed = rate(seconds, |n| {
        let key = format!("key-{n}");
        std::hint::black_box(
            place(&members, "container", 2, Some(&key), &mut rng).expect("placed"),
        );
    });
    let vm = rate(seconds, |_| {
        std::hint::black_box(place(&members, "vm", 2, None, &mut rng).expect("placed"));
    });
    println!(
        "{{\"edges\": {edges}, \"keyless_per_s\": {keyless:.0}, \"keyed_per_s\": {keyed:.0}, \"vm_per_s\": {vm:.0}}}"
    );
}
