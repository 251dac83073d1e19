//! The built filter's per-request cost in the wasmtime host, against a pass-through
//! proxy-wasm module in the same run, and its shared-data footprint under 1,000,000
//! distinct keys. Prints `figure:` lines.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use criterion::Criterion;
use ratewall_tests::bench::{figure, median_ns};
use ratewall_tests::host::{HttpRequest, Node, Plugin, Vm};
use serde_json::json;
use std::hint::black_box;

const T0: u64 = 1_700_000_000_000_000_000;

/// A proxy-wasm module that does nothing but run `request` (WAT, with a local `$i`) in its
/// request-headers callback, after `imports`. With neither it is the pass-through filter: the
/// host's own cost per request.
fn module(imports: &str, request: &str) -> Plugin {
    let wat = r#"(module
  IMPORTS
  (memory (export "memory") 2)
  (global $heap (mut i32) (i32.const 1024))
  (func (export "malloc") (param $n i32) (result i32) (local $p i32)
    (if (i32.gt_u (i32.add (global.get $heap) (local.get $n)) (i32.const 131072))
      (then (global.set $heap (i32.const 1024))))
    (local.set $p (global.get $heap))
    (global.set $heap (i32.add (global.get $heap) (local.get $n)))
    (local.get $p))
  (data (i32.const 16) "k")
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "_initialize"))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32) (local $i i32)
    REQUEST
    (i32.const 0))
  (func (export "proxy_on_response_headers") (param i32 i32 i32) (result i32) (i32.const 0))
  (func (export "proxy_on_done") (param i32) (result i32) (i32.const 1))
  (func (export "proxy_on_log") (param i32))
  (func (export "proxy_on_delete") (param i32)))"#;
    Plugin::from_bytes(wat.replace("IMPORTS", imports).replace("REQUEST", request).as_bytes()).unwrap()
}

/// 100 host calls of one kind per request: what a host call costs in this host.
fn calls(call: &str) -> Plugin {
    let imports = r#"(import "env" "proxy_get_current_time_nanoseconds" (func $now (param i32) (result i32)))
  (import "env" "proxy_get_shared_data" (func $get (param i32 i32 i32 i32 i32) (result i32)))"#;
    let request = r#"(loop $l
      (drop (call CALL))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 100))))"#;
    module(imports, &request.replace("CALL", call))
}

fn main() {
    let mut c = Criterion::default().output_directory(&ratewall_tests::bench::criterion_dir()).configure_from_args();
    let filter = Plugin::filter().unwrap_or_else(|e| panic!("{e}"));
    let pass = module("", "");
    // Three rules, two of which match: both counters go through CAS and fields are rendered.
    let rules = json!({
        "identity": {"api_key": {"header": "x-api-key"}, "ip": {"trusted_hops": 1}},
        "rules": [
            {"name": "per-key", "match": {"path": "/v1/*"}, "key": ["api_key"], "limit": {"requests": 4_000_000_000u64, "per": "60s"}},
            {"name": "per-ip", "match": {"path": "/v1/*"}, "key": ["ip"], "limit": {"requests": 1_000_000_000u64, "per": "1s", "burst": 4_000_000_000u64}},
            {"name": "admin", "match": {"path": "/admin/*"}, "key": ["ip"], "limit": {"requests": 1, "per": "1h"}},
            {"name": "tight", "match": {"path": "/v1/tight"}, "key": ["api_key"], "limit": {"requests": 1, "per": "1h"}}
        ]
    })
    .to_string();
    let node = Node::new(T0);
    let mut vm = Vm::start(&filter, &node, rules.as_bytes()).unwrap();
    let mut base = Vm::start(&pass, &Node::new(T0), b"").unwrap();
    let req =
        HttpRequest::new("GET", "/v1/things").header("x-api-key", "k-123").header("x-forwarded-for", "203.0.113.7");
    let limited =
        HttpRequest::new("GET", "/v1/tight").header("x-api-key", "k-123").header("x-forwarded-for", "203.0.113.7");
    assert!(vm.request(&req).unwrap().passed);
    assert!(vm.request(&limited).unwrap().passed);
    assert_eq!(vm.request(&limited).unwrap().status, 429);

    // Where the time goes: a request no rule matches, and one counter instead of two.
    let no_match = json!({"rules": [{"name": "admin", "match": {"path": "/admin/*"}, "key": ["ip"],
        "limit": {"requests": 1, "per": "1h"}}]})
    .to_string();
    let one_rule = json!({"identity": {"api_key": {"header": "x-api-key"}}, "rules": [{"name": "per-key",
        "match": {"path": "/v1/*"}, "key": ["api_key"], "limit": {"requests": 4_000_000_000u64, "per": "60s"}}]})
    .to_string();
    let mut vm_none = Vm::start(&filter, &Node::new(T0), no_match.as_bytes()).unwrap();
    let mut vm_one = Vm::start(&filter, &Node::new(T0), one_rule.as_bytes()).unwrap();
    let calls_vm = |call: &str| {
        let node = Node::new(T0);
        node.set_shared("k", &[0u8; 60], 0);
        Vm::start(&calls(call), &node, b"").unwrap()
    };
    let mut vm_now = calls_vm("$now (i32.const 64)");
    let mut vm_get = calls_vm("$get (i32.const 16) (i32.const 1) (i32.const 64) (i32.const 68) (i32.const 72)");

    let mut g = c.benchmark_group("filter");
    g.bench_function("passthrough", |b| b.iter(|| black_box(base.request(&req).unwrap())));
    g.bench_function("ratewall_no_match", |b| b.iter(|| black_box(vm_none.request(&req).unwrap())));
    g.bench_function("ratewall_one_rule", |b| b.iter(|| black_box(vm_one.request(&req).unwrap())));
    g.bench_function("host_100_time_calls", |b| b.iter(|| black_box(vm_now.request(&req).unwrap())));
    g.bench_function("host_100_shared_gets", |b| b.iter(|| black_box(vm_get.request(&req).unwrap())));
    g.bench_function("ratewall_allowed", |b| b.iter(|| black_box(vm.request(&req).unwrap())));
    g.bench_function("ratewall_429", |b| b.iter(|| black_box(vm.request(&limited).unwrap())));
    g.finish();
    c.final_summary();

    // Whole requests: context create, request headers, response headers, done, log, delete.
    if let (Some(p), Some(a), Some(r)) =
        (median_ns("filter/passthrough"), median_ns("filter/ratewall_allowed"), median_ns("filter/ratewall_429"))
    {
        figure("passthrough_whole_request_ns", p, "ns");
        figure("filter_whole_request_ns", a, "ns");
        figure("filter_whole_429_ns", r, "ns");
        figure("filter_whole_added_ns", a - p, "ns");
        if let (Some(n), Some(o)) = (median_ns("filter/ratewall_no_match"), median_ns("filter/ratewall_one_rule")) {
            figure("filter_whole_no_match_ns", n, "ns");
            figure("filter_whole_one_rule_ns", o, "ns");
        }
        if let (Some(t), Some(g)) = (median_ns("filter/host_100_time_calls"), median_ns("filter/host_100_shared_gets"))
        {
            figure("host_call_time_ns", (t - p) / 100.0, "ns");
            figure("host_call_shared_get_ns", (g - p) / 100.0, "ns");
        }
    }
    if std::env::args().any(|a| a == "--bench") {
        callback_alone(&mut vm, &mut base, &req, &limited);
        guest_instructions(&rules, &req, &limited);
        footprint(&filter);
        shaping(&filter);
    }
    if let Ok(m) = std::fs::metadata(ratewall_tests::host::filter_wasm_path()) {
        figure("filter_wasm_bytes", m.len() as f64, "B");
    }
}

/// The request-headers callback alone — where the filter decides, counts (CAS included) and
/// renders its fields: `filter_request_ns` as the issue defines it. Timed call by call inside
/// whole requests, filter (allowed, then rejected) and pass-through alternating; medians of
/// 200,000 calls each.
fn callback_alone(vm: &mut Vm, base: &mut Vm, req: &HttpRequest, limited: &HttpRequest) {
    let median = |mut v: Vec<u64>| {
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0) as f64
    };
    vm.time_request_headers();
    base.time_request_headers();
    let mut rejected = Vec::new();
    for _ in 0..200_000 {
        black_box(vm.request(req).unwrap());
        black_box(base.request(req).unwrap());
    }
    let allowed = vm.take_request_headers_times();
    for _ in 0..200_000 {
        black_box(vm.request(limited).unwrap());
        rejected.extend(vm.take_request_headers_times());
    }
    let (f, r, p) = (median(allowed), median(rejected), median(base.take_request_headers_times()));
    figure("filter_request_ns", f, "ns");
    figure("filter_429_ns", r, "ns");
    figure("passthrough_request_ns", p, "ns");
    figure("filter_added_ns", f - p, "ns");
}

/// Wasm instructions the guest runs per request (metered, so exact and the same every run):
/// a figure to compare builds by where timings are noisy.
fn guest_instructions(rules: &str, req: &HttpRequest, limited: &HttpRequest) {
    let bytes = std::fs::read(ratewall_tests::host::filter_wasm_path()).unwrap();
    let plugin = Plugin::metered(&bytes).unwrap();
    let mut vm = Vm::start(&plugin, &Node::new(T0), rules.as_bytes()).unwrap();
    let per_request = |vm: &mut Vm, r: &HttpRequest| {
        for _ in 0..100 {
            vm.request(r).unwrap();
        }
        let before = vm.fuel_used();
        for _ in 0..1000 {
            vm.request(r).unwrap();
        }
        (vm.fuel_used() - before) as f64 / 1000.0
    };
    figure("filter_guest_instructions_per_request", per_request(&mut vm, req), "instructions");
    figure("filter_guest_instructions_per_429", per_request(&mut vm, limited), "instructions");
}

/// Shared-data bytes after 1,000,000 distinct client IPs with the default table size.
fn footprint(filter: &Plugin) {
    let rules = json!({
        "identity": {"ip": {"trusted_hops": 1}},
        "rules": [{"name": "per-ip", "key": ["ip"], "limit": {"requests": 100, "per": "60s"}}]
    })
    .to_string();
    let node = Node::new(T0);
    let mut vm = Vm::start(filter, &node, rules.as_bytes()).unwrap();
    let start = std::time::Instant::now();
    for i in 0..1_000_000u32 {
        let ip = format!("{}.{}.{}.{}", 11 + (i >> 24), (i >> 16) & 255, (i >> 8) & 255, i & 255);
        vm.request(&HttpRequest::new("GET", "/").header("x-forwarded-for", ip)).unwrap();
    }
    let (keys, bytes) = node.shared_data_size();
    let evictions = node.metric("ratewall_table_evictions");
    figure("shared_data_keys_after_1m_keys", keys as f64, "keys");
    figure("shared_data_bytes_after_1m_keys", bytes as f64, "B");
    figure("shared_data_bytes_per_tracked_key", bytes as f64 / 65_536.0, "B");
    figure("table_evictions_during_1m_keys", evictions as f64, "entries");
    figure("footprint_run_ns_per_request", start.elapsed().as_nanos() as f64 / 1e6, "ns");
}

/// The leaky bucket (`ratewall_tests::shaping`): 60 requests of one user at once over 4 VMs
/// at 5 per second with a queue of 50, on the virtual clock (1 ms steps, each VM ticking at
/// the period it asks for). Goals: at most one forwarded per 200 ms, and resumed within 10 ms
/// of its turn.
fn shaping(filter: &Plugin) {
    let (node, mut vms) = ratewall_tests::shaping::node(filter, &ratewall_tests::shaping::rules(50, 0), 4, T0).unwrap();
    let b = ratewall_tests::shaping::burst(&node, &mut vms, 60, 11_000, &[]).unwrap();
    assert_eq!((b.at_once, b.forwarded.len(), b.rejected.len()), (1, 50, 9), "{b:?}");
    let interval = 200 * ratewall_tests::shaping::MS;
    // Most forwarded in one interval of the schedule ([k, k+1) intervals after the burst),
    // and in any sliding window of one interval (which the ticks' jitter can put two in).
    let mut slots = std::collections::BTreeMap::new();
    for &t in &b.forwarded {
        *slots.entry(t / interval).or_insert(0usize) += 1;
    }
    let most = slots.values().copied().max();
    let sliding =
        b.forwarded.iter().map(|&t| b.forwarded.iter().filter(|&&u| u >= t && u < t + interval).count()).max();
    let mut late: Vec<f64> =
        b.forwarded.iter().enumerate().map(|(i, &at)| (at as f64 - interval as f64 * (i as f64 + 1.0)) / 1e6).collect();
    late.sort_by(f64::total_cmp);
    let p99 = late[((late.len() - 1) as f64 * 0.99).round() as usize];
    figure("shaping_max_forwarded_per_interval", most.unwrap_or(0) as f64, "requests");
    figure("shaping_max_forwarded_per_sliding_interval", sliding.unwrap_or(0) as f64, "requests");
    figure("shaping_resume_lateness_p99_ms", p99, "ms");
    figure("shaping_resume_earliest_ms", late[0], "ms");
}
