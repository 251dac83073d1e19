//! Top offenders, measured: a Zipf flood of 100,000 clients through 3 proxies (the built
//! filter in the wasmtime host, 2 VMs each) syncing over HTTP to ratewall-store on a real
//! Redis; the store's `/v1/top` against the exact count of denials. Prints `figure:` lines.
//!
//! - `top_true_top10_listed`: how many of the true top 10 by denials are the listed top 10
//!   (goal 10);
//! - `top_top10_worst_count_error_pct`: the worst listed count's error among them (goal ≤ 5);
//! - `top_added_instructions_per_429` / `_per_allowed`: guest instructions counting adds to a
//!   denied request (goal ≤ 500) and an admitted one (goal 0), against a baseline build;
//! - `top_summary_bytes_per_rule`: a full summary's memory (64 keys of typical length) and
//!   `top_shared_bytes_per_rule`: its proxy's shared-data value (goal ≤ 8 KiB).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_core::topk::{Summary, CAPACITY};
use ratewall_tests::bench::figure;
use ratewall_tests::conformance::SECRET;
use ratewall_tests::host::{Callout, HttpRequest, Node, Plugin, Started, Vm};
use ratewall_tests::http;
use ratewall_tests::redis::Redis;
use std::collections::HashMap;
use std::io::BufRead;
use std::process::{Command, Stdio};

const CLIENTS: usize = 100_000;
const REQUESTS: usize = 200_000;
const ZIPF_S: f64 = 1.0;
const PER_TICK: usize = 1_000;

fn answer(store: &str, vm: &mut Vm, c: &Callout) {
    let sig = c.headers.iter().find(|(k, _)| k == "x-ratewall-signature").map(|(_, v)| v.clone()).unwrap();
    let sig = String::from_utf8(sig).unwrap();
    let r = http::request(store, "POST", "/v1/sync", &[("x-ratewall-signature", &sig)], &c.body).unwrap();
    let back = r.header("x-ratewall-signature").unwrap_or_default().as_bytes().to_vec();
    vm.respond(c, r.status, &[("x-ratewall-signature", &back)], r.body).unwrap();
}

fn memory() {
    let mut s = Summary::new(CAPACITY);
    for i in 0..CAPACITY {
        s.add(format!("api_key=#{:08x}", i * 7919).as_bytes(), 1 + i as u64, 0, 1);
    }
    let heap: usize = s.entries().iter().map(|e| e.key.capacity()).sum::<usize>() + std::mem::size_of_val(s.entries());
    figure("top_summary_bytes_per_rule", (std::mem::size_of::<Summary>() + heap) as f64, "B");
    let mut enc = Vec::new();
    s.encode(&mut enc);
    // The proxy's shared value holds two such summaries (the minute's and the batch's) of
    // counter keys (~30 bytes for one api_key), and two 128-byte distinct-key bitmaps.
    figure("top_encoded_summary_bytes", enc.len() as f64, "B");
}

/// What counting who is denied costs the filter: guest instructions per admitted and per
/// denied request on a rule keyed by a (non-secret) user, and the same for the build at
/// `RATEWALL_BASELINE_WASM` when given (e.g. main's `dist/ratewall_filter.wasm`).
fn instructions() {
    let rules = r#"{"identity": {"user": {"header": "x-user-id"}}, "rules": [{"name": "per-user",
        "key": ["user"], "limit": {"requests": 1, "per": "1h"}}]}"#;
    let per = |bytes: &[u8]| {
        let mut vm =
            Vm::start(&Plugin::metered(bytes).unwrap(), &Node::new(1_800_000_000 * 1_000_000_000), rules.as_bytes())
                .unwrap();
        let mut run = |users: &[String]| {
            for u in users.iter().take(100) {
                vm.request(&HttpRequest::new("GET", "/").header("x-user-id", u)).unwrap();
            }
            let before = vm.fuel_used();
            for u in users.iter().skip(100) {
                vm.request(&HttpRequest::new("GET", "/").header("x-user-id", u)).unwrap();
            }
            (vm.fuel_used() - before) as f64 / (users.len() - 100) as f64
        };
        // Admitted: a new user each time; denied: the same 16 users, long spent.
        let fresh: Vec<String> = (0..1100).map(|i| format!("user-{i}")).collect();
        let allowed = run(&fresh);
        let spent: Vec<String> = (0..1100).map(|i| format!("user-{}", i % 16)).collect();
        (allowed, run(&spent))
    };
    let ours = std::fs::read(ratewall_tests::host::filter_wasm_path()).unwrap();
    let (allowed, denied) = per(&ours);
    figure("top_guest_instructions_per_allowed", allowed, "instructions");
    figure("top_guest_instructions_per_429", denied, "instructions");
    if let Some(base) = std::env::var_os("RATEWALL_BASELINE_WASM").and_then(|p| std::fs::read(p).ok()) {
        let (base_allowed, base_denied) = per(&base);
        figure("top_added_instructions_per_allowed", allowed - base_allowed, "instructions");
        figure("top_added_instructions_per_429", denied - base_denied, "instructions");
    }
}

fn main() {
    memory();
    instructions();
    let redis = Redis::start(false).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratewall-store"))
        .env("RATEWALL_SYNC_SECRET", SECRET)
        .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--deadline-ms", "1000", "--redis", &redis.url()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut addr = |_: ()| {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        line.split("http://").nth(1).and_then(|s| s.split(['/', ' ']).next()).unwrap().to_owned()
    };
    let (store, admin) = (addr(()), addr(()));
    let rules = format!(
        r#"{{"identity": {{"user": {{"header": "x-user-id"}}}},
  "rules": [{{"name": "per-user", "key": ["user"], "limit": {{"requests": 10, "per": "1h"}}, "algorithm": "fixed_window"}}],
  "sync": {{"cluster": "store", "secret": "{SECRET}", "interval": "100ms", "timeout": "1000ms", "nodes": 3}}}}"#
    );
    let plugin = Plugin::filter().unwrap();
    let start = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let mut fleet: Vec<(Node, Vec<Vm>)> = (0..3)
        .map(|_| {
            let node = Node::new(start);
            let vms = (0..2).map(|_| Vm::start(&plugin, &node, rules.as_bytes()).unwrap()).collect();
            (node, vms)
        })
        .collect();
    // Zipf's cumulative weights, sampled by a fixed-seed generator.
    let mut cdf = Vec::with_capacity(CLIENTS);
    let mut sum = 0.0;
    for r in 1..=CLIENTS {
        sum += 1.0 / (r as f64).powf(ZIPF_S);
        cdf.push(sum);
    }
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut denied: HashMap<usize, u64> = HashMap::new();
    let mut t = start;
    let began = std::time::Instant::now();
    for i in 0..REQUESTS {
        if i % PER_TICK == 0 {
            t += 100_000_000;
            for (node, vms) in fleet.iter_mut() {
                node.set_time(t);
                for vm in vms.iter_mut() {
                    vm.tick().unwrap();
                    for c in vm.take_callouts() {
                        answer(&store, vm, &c);
                    }
                }
            }
        }
        let u = (next() >> 11) as f64 / (1u64 << 53) as f64 * sum;
        let client = cdf.partition_point(|&c| c < u);
        let r = next();
        let (node, vms) = &mut fleet[(r % 3) as usize];
        node.set_time(t);
        let vm = &mut vms[((r >> 8) % 2) as usize];
        let req = HttpRequest::new("GET", "/").header("x-user-id", format!("client-{client}"));
        let passed = match vm.begin(&req).unwrap() {
            Started::Done(res) => res.passed,
            Started::Paused(ctx) => {
                for c in vm.take_callouts() {
                    answer(&store, vm, &c);
                }
                vm.finish(ctx).unwrap().is_some_and(|r| r.passed)
            }
        };
        if !passed {
            *denied.entry(client).or_default() += 1;
        }
    }
    // Two more intervals: every VM's last denials reach the store.
    for _ in 0..3 {
        t += 100_000_000;
        for (node, vms) in fleet.iter_mut() {
            node.set_time(t);
            for vm in vms.iter_mut() {
                vm.tick().unwrap();
                for c in vm.take_callouts() {
                    answer(&store, vm, &c);
                }
            }
        }
    }
    let r = http::request(&admin, "GET", "/v1/top?window=1h", &[], &[]).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    let listed: Vec<(String, u64)> = v["rules"][0]["top"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["key"].as_str().unwrap().to_owned(), e["denied"].as_u64().unwrap()))
        .collect();
    let mut truth: Vec<(usize, u64)> = denied.into_iter().collect();
    truth.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let true_top: Vec<(String, u64)> = truth.iter().take(10).map(|(c, n)| (format!("user=client-{c}"), *n)).collect();
    let listed_top: Vec<&String> = listed.iter().take(10).map(|(k, _)| k).collect();
    let found = true_top.iter().filter(|(k, _)| listed_top.contains(&k)).count();
    let worst = true_top
        .iter()
        .map(|(k, n)| {
            let got = listed.iter().find(|(l, _)| l == k).map_or(0, |(_, c)| *c);
            got.abs_diff(*n) as f64 / *n as f64 * 100.0
        })
        .fold(0.0, f64::max);
    let total_denied: u64 = truth.iter().map(|(_, n)| n).sum();
    eprintln!("true top 10: {true_top:?}\nlisted: {:?}", &listed[..listed.len().min(12)]);
    figure("top_zipf_clients", CLIENTS as f64, "clients");
    figure("top_zipf_requests", REQUESTS as f64, "requests");
    figure("top_zipf_exponent", ZIPF_S, "s");
    figure("top_zipf_denied", total_denied as f64, "requests");
    figure("top_true_top10_listed", found as f64, "of 10");
    figure("top_top10_worst_count_error_pct", worst, "%");
    figure("top_zipf_run_s", began.elapsed().as_secs_f64(), "s");
    let _ = child.kill();
    let _ = child.wait();
}
