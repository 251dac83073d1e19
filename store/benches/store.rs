//! ratewall-store on a real Redis on loopback, against the named peer in the same run:
//! `redis-benchmark -t set -P 16` on the same server. Prints `figure:` lines (BENCHMARKS.md).
//!
//! - `store_sync_p99_ms` / `store_sync_p50_ms`: 20-counter batches from 8 concurrent senders;
//! - `store_batches_per_sec` and `store_counter_updates_per_sec` of one store process;
//! - `store_counter_updates_vs_redis_benchmark`: counter updates per second ÷ the SETs per
//!   second redis-benchmark reaches (goal ≥ 0.25);
//! - `store_cas_conflict_pct`: reruns ÷ counter updates, with every sender on one hot counter
//!   through two store processes;
//! - `redis_ops_per_admitted_request`: Redis commands ÷ requests the fleet admitted, for 20
//!   filter nodes (the built filter in the wasmtime host) syncing to the store (goal ≤ 0.05;
//!   envoyproxy/ratelimit's per-request design is 2 per descriptor per request).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_core::sync::{Delta, SyncRequest};
use ratewall_core::{Algorithm, Limit, SECOND};
use ratewall_tests::bench::figure;
use ratewall_tests::conformance::{Http, SyncStore, SECRET};
use ratewall_tests::redis::{cli, Redis};
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn store(redis: &Redis, secret: &str) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratewall-store"))
        .env("RATEWALL_SYNC_SECRET", secret)
        .args(["--listen", "127.0.0.1:0", "--deadline-ms", "1000", "--redis", &redis.url()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.split("http://").nth(1).and_then(|s| s.split_whitespace().next()).unwrap().to_owned();
    (child, addr)
}

/// Commands the store sent Redis (each script call is one; the commands a script runs inside
/// Redis are not round trips and are not counted).
fn commands(redis: &Redis) -> u64 {
    let info = cli(redis.port, &["info", "commandstats"]).unwrap();
    info.lines()
        .filter(|l| {
            ["cmdstat_evalsha:", "cmdstat_eval:", "cmdstat_script|load:", "cmdstat_ping:"]
                .iter()
                .any(|p| l.starts_with(p))
        })
        .filter_map(|l| l.split("calls=").nth(1)?.split(',').next()?.parse::<u64>().ok())
        .sum()
}

fn metric(addr: &str, name: &str) -> u64 {
    let text = ratewall_tests::http::request(addr, "GET", "/metrics", &[], &[]).unwrap().text();
    text.lines().find_map(|l| l.strip_prefix(name)?.trim().parse().ok()).unwrap_or(0)
}

/// `senders` threads (nodes new to the store), each `batches` batches naming `keys(sender)`;
/// the latencies in ms.
fn drive(addrs: &[String], senders: u64, batches: u64, keys: impl Fn(u64) -> Vec<Vec<u8>> + Sync) -> Vec<f64> {
    static NODES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(10_000);
    let base = NODES.fetch_add(senders, std::sync::atomic::Ordering::Relaxed);
    let limit = Limit::new(Algorithm::FixedWindow, 1_000_000_000, 3600 * SECOND, None).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..senders)
            .map(|sender| {
                let keys = keys(sender);
                scope.spawn(move || {
                    let mut lat = Vec::new();
                    for seq in 1..=batches {
                        let deltas = keys.iter().map(|k| Delta { key: k.clone(), limit, units: 1 }).collect();
                        let req = SyncRequest { node: base + sender, seq, sent: 0, deltas, ask: false };
                        let addr = &addrs[(sender as usize + seq as usize) % addrs.len()];
                        let t = Instant::now();
                        let (status, _) = Http(addr).call(&req);
                        lat.push(t.elapsed().as_secs_f64() * 1000.0);
                        assert_eq!(status, 200, "batch {seq} of sender {sender}");
                    }
                    lat
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    })
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn main() {
    // `cargo test --all-targets` runs benches too, in a debug build: these figures mean
    // something only under `cargo bench` (which passes --bench), so the test run skips them.
    if !std::env::args().any(|a| a == "--bench") {
        println!("store bench: run it with `cargo bench -p ratewall-store`");
        return;
    }
    let redis = Redis::start(false).unwrap();
    // The peer: what Redis itself does with pipelined SETs, in this run on this machine.
    let out = Command::new("redis-benchmark")
        .args(["-p", &redis.port.to_string(), "-t", "set", "-P", "16", "-n", "200000", "-q"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let sets_per_sec: f64 = text
        .split(['\r', '\n'])
        .filter_map(|l| l.strip_prefix("SET: "))
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .next_back()
        .unwrap();
    figure("redis_benchmark_set_p16_per_sec", sets_per_sec, "ops/s");

    let (mut a, addr_a) = store(&redis, SECRET);
    let (mut b, addr_b) = store(&redis, SECRET);
    // Warm up: connections, scripts loaded.
    drive(std::slice::from_ref(&addr_a), 2, 20, |s| (0..20).map(|i| format!("warm/{s}/{i}").into_bytes()).collect());

    // 20-counter batches, 8 senders, one store process; distinct counters per sender.
    let (senders, batches) = (8u64, 150u64);
    let start = Instant::now();
    let mut lat = drive(std::slice::from_ref(&addr_a), senders, batches, |s| {
        (0..20).map(|i| format!("b/{s}/{i}").into_bytes()).collect()
    });
    let secs = start.elapsed().as_secs_f64();
    let per_sec = (senders * batches) as f64 / secs;
    figure("store_sync_p50_ms", percentile(&mut lat, 0.50), "ms");
    figure("store_sync_p99_ms", percentile(&mut lat, 0.99), "ms");
    figure("store_batches_per_sec", per_sec, "batches/s");
    figure("store_counter_updates_per_sec", per_sec * 20.0, "updates/s");
    figure("store_counter_updates_vs_redis_benchmark", per_sec * 20.0 / sets_per_sec, "ratio");

    // One-counter batches from 64 senders at once, one store process: every sender its own
    // counter, then every sender the same hot one (a fleet's global limit, in every proxy's
    // batch), whose batches wait for one another's turn and are written together.
    let one = |keys: &(dyn Fn(u64) -> Vec<u8> + Sync)| {
        let writes0 = metric(&addr_a, "ratewall_store_state_writes_total");
        let start = Instant::now();
        let mut lat = drive(std::slice::from_ref(&addr_a), 64, 30, |s| vec![keys(s)]);
        let per_sec = (64 * 30) as f64 / start.elapsed().as_secs_f64();
        let writes = metric(&addr_a, "ratewall_store_state_writes_total") - writes0;
        (per_sec, percentile(&mut lat, 0.99), writes as f64 / (64 * 30) as f64)
    };
    let (distinct, distinct_p99, _) = one(&|s| format!("one/{s}").into_bytes());
    let (hot, hot_p99, hot_writes) = one(&|_| b"one-hot".to_vec());
    figure("store_one_counter_batches_per_sec", distinct, "batches/s");
    figure("store_hot_counter_batches_per_sec", hot, "batches/s");
    figure("store_hot_counter_vs_distinct", hot / distinct, "ratio");
    figure("store_hot_counter_p99_ms", hot_p99, "ms");
    figure("store_one_counter_p99_ms", distinct_p99, "ms");
    figure("store_hot_counter_writes_per_batch", hot_writes, "writes");

    // One hot counter, every sender, two store processes: compare-and-swap conflicts.
    let before =
        metric(&addr_a, "ratewall_store_cas_conflicts_total") + metric(&addr_b, "ratewall_store_cas_conflicts_total");
    let writes0 =
        metric(&addr_a, "ratewall_store_state_writes_total") + metric(&addr_b, "ratewall_store_state_writes_total");
    drive(&[addr_a.clone(), addr_b.clone()], senders, 60, |_| vec![b"hot".to_vec()]);
    let conflicts = metric(&addr_a, "ratewall_store_cas_conflicts_total")
        + metric(&addr_b, "ratewall_store_cas_conflicts_total")
        - before;
    let writes = metric(&addr_a, "ratewall_store_state_writes_total")
        + metric(&addr_b, "ratewall_store_state_writes_total")
        - writes0;
    figure("store_cas_conflict_pct", conflicts as f64 / writes.max(1) as f64 * 100.0, "%");
    let _ = (a.kill(), b.kill());

    // The fleet: 20 filter nodes × 2 VMs syncing to the store in real time (4 dense counters
    // of 2,000 a second, offered 1.5×); Redis commands per admitted request.
    use ratewall_tests::sim::{run_with, Backend, Faults, Scenario, Spread};
    let (mut s, addr) = store(&redis, ratewall_tests::sim::SECRET);
    let scenario = Scenario {
        name: "store_fleet",
        nodes: 20,
        vms: 2,
        keys: 4,
        limit: 20_000,
        window: 10 * SECOND,
        load: 1.5,
        windows: 1,
        spread: Spread::Zipf,
        skew: 0,
        faults: Faults::default(),
        faults_from: 99,
        seed: 11,
        algorithm: "fixed_window",
        exact: false,
        duration: None,
        rtt: 0,
        max_wait: None,
        burst: None,
    };
    let c0 = commands(&redis);
    let r = run_with(&scenario, &Backend::Http(&addr)).unwrap();
    let used = commands(&redis) - c0;
    figure("redis_ops_per_admitted_request", used as f64 / r.admitted.max(1) as f64, "ops");
    figure("store_fleet_overadmission_pct", r.overadmission_pct, "%");
    figure("store_fleet_false_denial_pct", r.false_denial_pct, "%");
    figure("store_fleet_calls_per_node_per_sec", r.calls_per_node_per_sec, "calls/s");
    let _ = s.kill();
    std::thread::sleep(Duration::from_millis(50));
}
