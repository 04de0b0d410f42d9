//! A fleet past this machine: a discrete-event simulation that drives the real placement
//! code ([`place`] over each apiserver's [`EdgeTable`], updated by [`EdgeTable::apply`] as a
//! watch would) with `--edges` simulated edges and `--apiservers` apiservers, at
//! `--rate` offered creations per second.
//!
//! Each simulated edge is this machine as measured (`bench/RESULTS.md`): `--cores` create
//! slots taking `--create-ms` each (the server's CPU per create), room for `--capacity`
//! sandboxes (its admission veto: a create is refused when the edge has promised that
//! many), each living `--lifetime-s`. An edge publishes its load every 0.5 s (random phase)
//! and every apiserver sees it `--watch-ms` later; a forward to an edge, and a veto's
//! answer, costs `--hop-ms`. Time is virtual; each real `place` and `apply` call is timed
//! in this thread's CPU time (so a busy host's preemption does not count) and that time is
//! the decision's share of the placement delay.
//!
//! Prints one JSON line: the load spread (max/mean of live sandboxes per edge, sampled
//! each second after the fill), placement delay (decision + hops until an edge accepts)
//! p50/p99/max, create latency (+ the edge's queue and the create) p99, vetoes per create,
//! refusals, and the real CPU per decision.
//!
//! Not modelled: the apiservers' own CPU queueing and the network's (each decision and hop
//! costs its measured or given time, never waits for a core), etcd's own latency beyond
//! `--watch-ms`, failures, keyed (idempotent) creates, backends other than `container`,
//! sandboxes of different sizes, and a host's create cost growing with its load.
//!
//!     cargo run --release -p dsec-fleet --example fleet_sim -- [--rate 5000] [--edges 160]

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use rustix::time::{clock_gettime, ClockId};

use dsec_fleet::membership::{EdgeRecord, EdgeTable};
use dsec_fleet::placement::place;
use dsec_server::edge::EdgeLoad;
use rand::Rng;

/// Memory each simulated sandbox is promised, MiB (the budget is `capacity` of them).
const SANDBOX_MB: u64 = 256;
/// How often an edge publishes its load, as `dsec edge` does.
const PUBLISH_EVERY_S: f64 = 0.5;

struct Options {
    rate: f64,
    edges: usize,
    apiservers: usize,
    cores: usize,
    create_ms: f64,
    capacity: u64,
    lifetime_s: f64,
    seconds: f64,
    watch_ms: f64,
    hop_ms: f64,
    choices: usize,
}

impl Options {
    fn parse() -> Options {
        // Defaults from this machine (bench/RESULTS.md): ~183 creations/s on 2 cores is
        // ~11 ms of server CPU per create; 1,000 idle sandboxes held without a failure.
        let mut o = Options {
            rate: 5000.0,
            edges: 160,
            apiservers: 4,
            cores: 2,
            create_ms: 11.0,
            capacity: 1000,
            lifetime_s: 24.0,
            seconds: 60.0,
            watch_ms: 5.0,
            hop_ms: 0.5,
            choices: 2,
        };
        let mut args = std::env::args().skip(1);
        while let Some(flag) = args.next() {
            let value = args
                .next()
                .unwrap_or_else(|| panic!("{flag} needs a value"));
            let number = || -> f64 {
                value
                    .parse()
                    .unwrap_or_else(|_| panic!("{flag}: not a number: {value}"))
            };
            let count = || -> usize {
                value
                    .parse()
                    .unwrap_or_else(|_| panic!("{flag}: not a whole number: {value}"))
            };
            match flag.as_str() {
                "--rate" => o.rate = number(),
                "--edges" => o.edges = count(),
                "--apiservers" => o.apiservers = count(),
                "--cores" => o.cores = count(),
                "--create-ms" => o.create_ms = number(),
                "--capacity" => o.capacity = count() as u64,
                "--lifetime-s" => o.lifetime_s = number(),
                "--seconds" => o.seconds = number(),
                "--watch-ms" => o.watch_ms = number(),
                "--hop-ms" => o.hop_ms = number(),
                "--choices" => o.choices = count(),
                other => panic!("unknown option {other}"),
            }
        }
        o
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// The next offered create.
    Arrival,
    /// A create reaches edge `.0` (after placement and its hops), arrived at `.1` (ns).
    Accepted(usize, u64),
    /// A create slot of edge `.0` finished one, arrived at `.1` (ns).
    Created(usize, u64),
    /// A sandbox of edge `.0` stops.
    Stopped(usize),
    /// Edge `.0` publishes its load.
    Publish(usize),
    /// Record `.0` of the published ones reaches the apiservers.
    Delivered(usize),
    /// Sample the spread.
    Sample,
}

#[derive(Default)]
struct SimEdge {
    live: u64,
    /// Accepted, not yet made: promised at admission, as an edge's budget is.
    creating: u64,
    busy_slots: usize,
    queue: VecDeque<u64>,
}

struct Sim {
    o: Options,
    now: u64,
    seq: u64,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    edges: Vec<SimEdge>,
    names: Vec<String>,
    tables: Vec<EdgeTable>,
    published: Vec<Option<EdgeRecord>>,
    rng: rand::rngs::ThreadRng,
    placement_ns: Vec<u64>,
    create_ns: Vec<u64>,
    vetoes: u64,
    refused: u64,
    spread: Vec<f64>,
    decide_cpu_ns: u64,
    decisions: u64,
    apply_cpu_ns: u64,
    applies: u64,
}

/// This thread's CPU time, ns.
fn cpu_ns() -> u64 {
    let t = clock_gettime(ClockId::ThreadCPUTime);
    let (secs, nanos) = (u64::try_from(t.tv_sec), u64::try_from(t.tv_nsec));
    secs.expect("a CPU time is positive") * 1_000_000_000 + nanos.expect("so are its ns")
}

/// Virtual time of `seconds` (never negative here), in ns.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn ns(seconds: f64) -> u64 {
    (seconds * 1e9) as u64
}

impl Sim {
    fn new(o: Options) -> Sim {
        let names: Vec<String> = (0..o.edges).map(|i| format!("host-{i:03}")).collect();
        let mut sim = Sim {
            now: 0,
            seq: 0,
            events: BinaryHeap::new(),
            edges: (0..o.edges).map(|_| SimEdge::default()).collect(),
            tables: (0..o.apiservers).map(|_| EdgeTable::default()).collect(),
            published: Vec::new(),
            rng: rand::rng(),
            placement_ns: Vec::new(),
            create_ns: Vec::new(),
            vetoes: 0,
            refused: 0,
            spread: Vec::new(),
            decide_cpu_ns: 0,
            decisions: 0,
            apply_cpu_ns: 0,
            applies: 0,
            names,
            o,
        };
        for i in 0..sim.o.edges {
            let record = sim.record(i);
            for table in &sim.tables {
                table.apply(vec![record.clone()], Vec::new());
            }
            let phase = sim.rng.random::<f64>() * PUBLISH_EVERY_S;
            sim.at(ns(phase), Event::Publish(i));
        }
        sim.at(0, Event::Arrival);
        sim.at(ns(sim.o.lifetime_s.max(1.0)), Event::Sample);
        sim
    }

    fn at(&mut self, time: u64, event: Event) {
        self.seq += 1;
        self.events.push(Reverse((time, self.seq, event)));
    }

    fn record(&self, i: usize) -> EdgeRecord {
        let e = &self.edges[i];
        EdgeRecord {
            name: self.names[i].clone(),
            url: format!("http://{}:7700", self.names[i]),
            ready: true,
            load: EdgeLoad {
                backends: vec!["fncall".into(), "container".into()],
                sandbox_count: e.live,
                creating: e.creating,
                memory_budget_mb: self.o.capacity * SANDBOX_MB,
                memory_promised_mb: (e.live + e.creating) * SANDBOX_MB,
                ..Default::default()
            },
            updated_at: self.now as f64 / 1e9,
            e2b: None,
        }
    }

    fn warm(&self) -> bool {
        self.now >= ns(self.o.lifetime_s)
    }

    fn run(&mut self) {
        let end = ns(self.o.seconds);
        while let Some(Reverse((time, _, event))) = self.events.pop() {
            if time > end {
                break;
            }
            self.now = time;
            match event {
                Event::Arrival => self.arrival(),
                Event::Accepted(edge, arrived) => self.accepted(edge, arrived),
                Event::Created(edge, arrived) => self.created(edge, arrived),
                Event::Stopped(edge) => self.edges[edge].live -= 1,
                Event::Publish(edge) => {
                    self.published.push(Some(self.record(edge)));
                    let index = self.published.len() - 1;
                    self.at(time + ns(self.o.watch_ms / 1e3), Event::Delivered(index));
                    self.at(time + ns(PUBLISH_EVERY_S), Event::Publish(edge));
                }
                Event::Delivered(index) => {
                    let record = self.published[index].take().expect("delivered once");
                    let started = cpu_ns();
                    for table in &self.tables {
                        table.apply(vec![record.clone()], Vec::new());
                    }
                    self.apply_cpu_ns += cpu_ns() - started;
                    self.applies += self.tables.len() as u64;
                }
                Event::Sample => {
                    let live: Vec<u64> = self.edges.iter().map(|e| e.live).collect();
                    let mean = live.iter().sum::<u64>() as f64 / live.len() as f64;
                    let max = *live.iter().max().unwrap_or(&0) as f64;
                    if mean > 0.0 {
                        self.spread.push(max / mean);
                    }
                    self.at(time + ns(1.0), Event::Sample);
                }
            }
        }
    }

    fn arrival(&mut self) {
        let gap = -(1.0 - self.rng.random::<f64>()).ln() / self.o.rate;
        self.at(self.now + ns(gap), Event::Arrival);
        let api = self.rng.random_range(0..self.tables.len());
        let members = self.tables[api].members();
        let started = cpu_ns();
        let mut placement = place(&members, "container", self.o.choices, None, &mut self.rng)
            .expect("every edge runs container");
        let mut decide = cpu_ns() - started;
        // Ask the edges in order, as the apiserver does; each refusal costs a hop.
        let mut delay = 0;
        let mut next = 0;
        while next < placement.order.len() {
            if next == placement.drawn {
                let started = cpu_ns();
                placement.narrow_fallbacks();
                decide += cpu_ns() - started;
            }
            let member = Arc::clone(&placement.order[next]);
            next += 1;
            delay += ns(self.o.hop_ms / 1e3);
            let edge = self
                .names
                .binary_search(&member.record.name)
                .expect("a known edge");
            let e = &mut self.edges[edge];
            if e.live + e.creating < self.o.capacity {
                e.creating += 1;
                self.decide_cpu_ns += decide;
                self.decisions += 1;
                delay += decide;
                if self.warm() {
                    self.placement_ns.push(delay);
                }
                let arrived = self.now;
                self.at(self.now + delay, Event::Accepted(edge, arrived));
                return;
            }
            if self.warm() {
                self.vetoes += 1;
            }
        }
        self.decide_cpu_ns += decide;
        self.decisions += 1;
        if self.warm() {
            self.refused += 1;
        }
    }

    fn accepted(&mut self, edge: usize, arrived: u64) {
        let e = &mut self.edges[edge];
        if e.busy_slots < self.o.cores {
            e.busy_slots += 1;
            let service = self.service();
            self.at(self.now + service, Event::Created(edge, arrived));
        } else {
            e.queue.push_back(arrived);
        }
    }

    /// One create's time on a slot: the measured cost, ±50 % uniformly.
    fn service(&mut self) -> u64 {
        ns(self.o.create_ms / 1e3 * (0.5 + self.rng.random::<f64>()))
    }

    fn created(&mut self, edge: usize, arrived: u64) {
        if self.warm() {
            self.create_ns.push(self.now - arrived);
        }
        let lifetime = ns(self.o.lifetime_s * (0.5 + self.rng.random::<f64>()));
        self.at(self.now + lifetime, Event::Stopped(edge));
        let next = {
            let e = &mut self.edges[edge];
            e.creating -= 1;
            e.live += 1;
            e.queue.pop_front()
        };
        match next {
            Some(queued) => {
                let service = self.service();
                self.at(self.now + service, Event::Created(edge, queued));
            }
            None => self.edges[edge].busy_slots -= 1,
        }
    }
}

fn percentile_ms(values: &mut [u64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_unstable();
    // q is in [0, 1]: the index is in range.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let i = ((values.len() - 1) as f64 * q).round() as usize;
    values[i] as f64 / 1e6
}

fn main() {
    let options = Options::parse();
    let mut sim = Sim::new(options);
    let wall = Instant::now();
    sim.run();
    let o = &sim.o;
    let measured_s = (o.seconds - o.lifetime_s).max(1e-9);
    let made = sim.create_ns.len();
    let spread_mean = sim.spread.iter().sum::<f64>() / sim.spread.len().max(1) as f64;
    let spread_max = sim.spread.iter().copied().fold(0.0, f64::max);
    let live: u64 = sim.edges.iter().map(|e| e.live).sum();
    println!(
        "{{\"edges\": {}, \"apiservers\": {}, \"offered_per_s\": {}, \"made_per_s\": {:.0}, \
         \"live_at_end\": {live}, \"fill\": {:.3}, \"spread_max_over_mean\": {spread_mean:.3}, \
         \"spread_max_over_mean_worst\": {spread_max:.3}, \
         \"placement_delay_ms\": {{\"p50\": {:.3}, \"p99\": {:.3}, \"max\": {:.3}}}, \
         \"create_latency_ms\": {{\"p50\": {:.1}, \"p99\": {:.1}}}, \
         \"vetoes_per_create\": {:.4}, \"refused\": {}, \
         \"decision_cpu_us\": {:.2}, \"apply_cpu_us\": {:.2}, \"wall_s\": {:.1}}}",
        o.edges,
        o.apiservers,
        o.rate,
        made as f64 / measured_s,
        live as f64 / (o.capacity * o.edges as u64) as f64,
        percentile_ms(&mut sim.placement_ns, 0.5),
        percentile_ms(&mut sim.placement_ns, 0.99),
        percentile_ms(&mut sim.placement_ns, 1.0),
        percentile_ms(&mut sim.create_ns, 0.5),
        percentile_ms(&mut sim.create_ns, 0.99),
        sim.vetoes as f64 / made.max(1) as f64,
        sim.refused,
        sim.decide_cpu_ns as f64 / sim.decisions.max(1) as f64 / 1e3,
        sim.apply_cpu_ns as f64 / sim.applies.max(1) as f64 / 1e3,
        wall.elapsed().as_secs_f64(),
    );
}
