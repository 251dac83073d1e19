//! The Worker in local workerd (`wrangler dev`): the latency ratewall adds over a
//! pass-through route of the same Worker (no rule matches it), beside what Cloudflare's own
//! `ratelimit` binding adds on a third route in the same run; object calls per 1,000 admitted
//! requests of one hot key, with isolate grants and with per-request checks; checks per
//! second; and what a hot key hammered past its limit costs in object calls with and without
//! the blocked-key cache. Prints `figure:` lines (BENCHMARKS.md).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_tests::bench::figure;
use ratewall_tests::workerd::{root, Workerd};
use std::time::Instant;

const RULES: &str = r#"{"identity":{"user":{"header":"x-user-id"}},"rules":[
  {"name":"roomy","match":{"path":"/limited/*"},"key":["user"],"limit":{"requests":1000000000,"per":"60s"}},
  {"name":"hot","match":{"path":"/hot/*"},"key":["user"],"limit":{"requests":10,"per":"1h"}}]}"#;

/// Cloudflare's own limiter on `/_peer/cf-ratelimit/*` (simulated by local workerd), with a
/// limit no request reaches: the peer's cost on the admit path.
const PEER: &str = r#"[[ratelimits]]
name = "RATEWALL_PEER_LIMITER"
namespace_id = "1001"
simple = { limit = 1000000000, period = 60 }"#;

/// Long enough for every report an isolate holds back to have gone: a grant's longest lease
/// and a second.
const SETTLE: std::time::Duration = std::time::Duration::from_nanos(ratewall_core::sync::MAX_LEASE + 1_000_000_000);

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Latencies (ms) of `n` sequential requests, sorted.
fn latencies(w: &Workerd, path: &str, users: usize, n: usize) -> Vec<f64> {
    let mut out: Vec<f64> = (0..n)
        .map(|i| {
            let user = format!("u{}", i % users);
            let t = Instant::now();
            let r = w.request("GET", path, &[("x-user-id", &user)], &[]);
            assert!(r.status == 200 || r.status == 429, "{} {}", r.status, r.text());
            t.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    out.sort_by(f64::total_cmp);
    out
}

/// Seconds that `threads` concurrent clients take for `per_thread` requests each, their
/// users (50 per client) named with `round`, so each round's keys are new to the Worker.
fn throughput(w: &Workerd, path: &str, threads: usize, per_thread: usize, round: usize) -> f64 {
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                for i in 0..per_thread {
                    let user = format!("r{round}-t{t}-{}", i % 50);
                    w.request("GET", path, &[("x-user-id", &user)], &[]);
                }
            });
        }
    });
    start.elapsed().as_secs_f64()
}

fn hot_key_object_calls(w: &Workerd, user: &str) -> (u64, f64) {
    // The keys of earlier phases report what they admitted in the background (at once, then
    // 250 ms later): let those calls land before counting this key's.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let before = w.metric("ratewall_object_calls");
    let lat = latencies_for(w, "/hot/x", user, 1000);
    let calls = w.metric("ratewall_object_calls") - before;
    (calls, percentile(&lat, 0.5))
}

/// Latencies (ms) of `n` sequential requests of one user, sorted; each must be answered.
fn latencies_for(w: &Workerd, path: &str, user: &str, n: usize) -> Vec<f64> {
    let mut out: Vec<f64> = (0..n)
        .map(|_| {
            let t = Instant::now();
            let r = w.request("GET", path, &[("x-user-id", user)], &[]);
            assert!(r.status == 200 || r.status == 429, "{} {}", r.status, r.text());
            t.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    out.sort_by(f64::total_cmp);
    out
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // Accuracy first, natively: 20 isolates' grants against one object (no runtime).
    let s = ratewall_tests::worker_sim::zipf20();
    let r = ratewall_tests::worker_sim::run(&s);
    figure(&format!("worker_overadmission_pct_{}", s.name), r.overadmission_pct, "%");
    figure(&format!("worker_false_denial_pct_{}", s.name), r.false_denial_pct, "%");
    figure(&format!("worker_do_calls_per_1000_admitted_{}", s.name), r.calls_per_1000_admitted, "calls");
    // The same over seeds 1-8 of 20 windows each, at a 20 and an 80 ms round trip: means,
    // and the worst seed's.
    for rtt_ms in [20, 80] {
        let runs: Vec<_> = (1..=8)
            .map(|seed| {
                let s =
                    ratewall_tests::worker_sim::Scenario { seed, windows: 20, rtt: rtt_ms * 1_000_000, ..s.clone() };
                ratewall_tests::worker_sim::run(&s)
            })
            .collect();
        let mean =
            |f: fn(&ratewall_tests::worker_sim::Report) -> f64| runs.iter().map(f).sum::<f64>() / runs.len() as f64;
        let worst = |f: fn(&ratewall_tests::worker_sim::Report) -> f64| runs.iter().map(f).fold(0.0, f64::max);
        let name = format!("{}_rtt{rtt_ms}_seeds", s.name);
        figure(&format!("worker_overadmission_pct_{name}"), mean(|r| r.overadmission_pct), "%");
        figure(&format!("worker_overadmission_worst_pct_{name}"), worst(|r| r.overadmission_pct), "%");
        figure(&format!("worker_false_denial_pct_{name}"), mean(|r| r.false_denial_pct), "%");
        figure(&format!("worker_false_denial_worst_pct_{name}"), worst(|r| r.false_denial_pct), "%");
        figure(&format!("worker_do_calls_per_1000_admitted_{name}"), mean(|r| r.calls_per_1000_admitted), "calls");
    }

    // One client under its limit whose requests stay on one isolate at a time.
    let s = ratewall_tests::worker_sim::sticky5s();
    let r = ratewall_tests::worker_sim::run(&s);
    figure(&format!("worker_overadmission_pct_{}", s.name), r.overadmission_pct, "%");
    figure(&format!("worker_false_denial_pct_{}", s.name), r.false_denial_pct, "%");
    figure(&format!("worker_do_calls_per_1000_admitted_{}", s.name), r.calls_per_1000_admitted, "calls");

    let rules = serde_json::from_str::<serde_json::Value>(RULES).unwrap().to_string();
    let w = Workerd::start_with(&[("RATEWALL_RULES", &rules)], PEER).unwrap();
    // Warm up: isolate, objects, connections.
    latencies(&w, "/pass/x", 10, 100);
    latencies(&w, "/limited/x", 10, 100);
    latencies(&w, "/_peer/cf-ratelimit/x", 10, 100);
    let n = 1000;
    let (mut pass, mut limited, mut peer) = (Vec::new(), Vec::new(), Vec::new());
    // Interleaved rounds, so drift on a shared machine hits all alike.
    for _ in 0..4 {
        pass.extend(latencies(&w, "/pass/x", 50, n / 4));
        limited.extend(latencies(&w, "/limited/x", 50, n / 4));
        peer.extend(latencies(&w, "/_peer/cf-ratelimit/x", 50, n / 4));
    }
    for v in [&mut pass, &mut limited, &mut peer] {
        v.sort_by(f64::total_cmp);
    }
    let (p50, p99) = (percentile(&pass, 0.5), percentile(&pass, 0.99));
    let (l50, l99) = (percentile(&limited, 0.5), percentile(&limited, 0.99));
    let (c50, c99) = (percentile(&peer, 0.5), percentile(&peer, 0.99));
    figure("worker_passthrough_p50_ms", p50, "ms");
    figure("worker_passthrough_p99_ms", p99, "ms");
    figure("worker_limited_p50_ms", l50, "ms");
    figure("worker_limited_p99_ms", l99, "ms");
    figure("worker_added_latency_p50_ms", l50 - p50, "ms");
    figure("worker_added_latency_p99_ms", l99 - p99, "ms");
    figure("cf_ratelimit_p50_ms", c50, "ms");
    figure("cf_ratelimit_added_latency_p50_ms", c50 - p50, "ms");
    figure("cf_ratelimit_added_latency_p99_ms", c99 - p99, "ms");
    // Both added latencies are differences of noisy medians: the ratio is only meaningful
    // while the binding's is clearly above zero (it is printed either way, with its parts).
    figure("worker_vs_cf_ratelimit_added", (l50 - p50) / (c50 - p50).max(0.001), "x");

    // The reports of the keys above go first (a grant far from its limit is reported as its
    // lease nears its end), so that they are not counted here.
    std::thread::sleep(SETTLE);
    let before = w.metric("ratewall_object_calls");
    let admitted = latencies_for(&w, "/limited/x", "hot-admitted", 1000);
    let calls = w.metric("ratewall_object_calls") - before;
    assert_eq!(admitted.len(), 1000);
    figure("worker_do_calls_per_1000_admitted", calls as f64, "calls");
    // One hot key from one isolate: the grant's case (the 50-user mix above pays each cold
    // key's first call).
    figure("worker_hot_key_added_latency_p50_ms", percentile(&admitted, 0.5) - p50, "ms");
    // Three rounds, the two routes in turn, so drift on a shared machine hits both alike;
    // each round's 400 keys are new (cold).
    let (rounds, mut pass_s, mut checks_s) = (3, 0.0, 0.0);
    let before = w.metric("ratewall_object_calls");
    for round in 0..rounds {
        pass_s += throughput(&w, "/pass/x", 8, 150, round);
        checks_s += throughput(&w, "/limited/x", 8, 150, round);
    }
    let (pass_rps, checks_rps) = ((rounds * 1200) as f64 / pass_s, (rounds * 1200) as f64 / checks_s);
    // The keys' reports, once the last ones have gone.
    std::thread::sleep(SETTLE);
    let calls = w.metric("ratewall_object_calls") - before;
    figure("worker_object_calls_per_cold_key", calls as f64 / (rounds * 400) as f64, "calls");
    figure("worker_passthrough_rps_8_clients", pass_rps, "req/s");
    figure("worker_checks_per_sec_8_clients", checks_rps, "req/s");
    figure("worker_checks_vs_passthrough_throughput", checks_rps / pass_rps, "x");

    let (cached_calls, cached_p50) = hot_key_object_calls(&w, "hot-cached");
    drop(w);
    // Per-request checks: no blocked-key cache, no isolate grants.
    let w = Workerd::start(&[("RATEWALL_RULES", &rules), ("BLOCKED_CACHE", "off"), ("ISOLATE_GRANTS", "off")]).unwrap();
    latencies(&w, "/pass/x", 10, 50);
    latencies(&w, "/limited/x", 10, 50);
    let (uncached_calls, uncached_p50) = hot_key_object_calls(&w, "hot-uncached");
    let before = w.metric("ratewall_object_calls");
    latencies_for(&w, "/limited/x", "hot-admitted", 1000);
    figure("worker_do_calls_per_1000_admitted_exact", (w.metric("ratewall_object_calls") - before) as f64, "calls");
    let (mut pass, mut exact) = (Vec::new(), Vec::new());
    for _ in 0..4 {
        pass.extend(latencies(&w, "/pass/x", 50, n / 4));
        exact.extend(latencies(&w, "/limited/x", 50, n / 4));
    }
    pass.sort_by(f64::total_cmp);
    exact.sort_by(f64::total_cmp);
    figure("worker_added_latency_p50_ms_exact", percentile(&exact, 0.5) - percentile(&pass, 0.5), "ms");
    figure("blocked_hot_key_do_calls_per_1000", cached_calls as f64, "calls");
    figure("blocked_hot_key_do_calls_per_1000_without_cache", uncached_calls as f64, "calls");
    figure("blocked_hot_key_p50_ms", cached_p50, "ms");
    figure("blocked_hot_key_p50_ms_without_cache", uncached_p50, "ms");

    let wasm = root().join("dist/worker/index_bg.wasm");
    let bytes = std::fs::read(&wasm).unwrap();
    figure("worker_wasm_bytes", bytes.len() as f64, "B");
    let gz = std::process::Command::new("gzip").args(["-9", "-c"]).arg(&wasm).output().unwrap();
    figure("worker_wasm_gzip_bytes", gz.stdout.len() as f64, "B");
}
