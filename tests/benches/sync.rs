//! The cross-replica sync simulation (`ratewall_tests::sim`): 20 nodes × 4 VMs of the built
//! filter syncing every 100 ms with the reference store, healthy and under faults. Prints
//! `figure:` lines per scenario (BENCHMARKS.md).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_core::SECOND;
use ratewall_tests::bench::figure;
use ratewall_tests::sim::{bound_pct, outage_model, run, trickle_model, Fallback, Faults, Scenario, Spread};

const MS: u64 = 1_000_000;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let seed = std::env::var("RATEWALL_SIM_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_2026);
    println!("simulation seed: {seed} (replay with RATEWALL_SIM_SEED={seed})");
    let base = Scenario {
        name: "zipf20",
        nodes: 20,
        vms: 4,
        keys: 10,
        limit: 200,
        window: 10 * SECOND,
        load: 1.5,
        windows: 3,
        spread: Spread::Zipf,
        skew: 0,
        faults: Faults::default(),
        faults_from: 1,
        seed,
        algorithm: "fixed_window",
        exact: false,
        duration: None,
        rtt: 0,
        max_wait: None,
        burst: None,
    };
    let f = Faults::default();
    let scenarios = [
        base.clone(),
        Scenario { name: "zipf20_dense", keys: 4, limit: 2000, ..base.clone() },
        Scenario { name: "even20", spread: Spread::Even, ..base.clone() },
        Scenario { name: "one_node20", spread: Spread::OneNode, ..base.clone() },
        Scenario { name: "skew500ms_zipf20", skew: 500_000_000, ..base.clone() },
        // Two proxies on one client far past a token bucket (60 a minute, burst 20), the
        // store down from the second window: each admits on its share of the bucket.
        Scenario {
            name: "bucket_store_down2",
            nodes: 2,
            vms: 2,
            keys: 1,
            limit: 60,
            window: 60 * SECOND,
            load: 8.0,
            windows: 4,
            spread: Spread::Even,
            algorithm: "token_bucket",
            burst: Some(20),
            faults: Faults { down: true, ..f },
            ..base.clone()
        },
        Scenario { name: "store_down_zipf20", faults: Faults { down: true, ..f }, ..base.clone() },
        // Clients under their limit (0.8×) while the store is down: what an outage costs them.
        Scenario { name: "store_down_zipf20_under", load: 0.8, faults: Faults { down: true, ..f }, ..base.clone() },
        Scenario { name: "slow_store_zipf20", faults: Faults { slow: true, ..f }, ..base.clone() },
        Scenario { name: "store_5xx_zipf20", faults: Faults { error_5xx: true, ..f }, ..base.clone() },
        Scenario { name: "garbage_zipf20", faults: Faults { garbage: true, ..f }, ..base.clone() },
        Scenario { name: "dup_reorder_zipf20", faults: Faults { duplicate: true, reorder: true, ..f }, ..base.clone() },
        Scenario { name: "partition5_zipf20", faults: Faults { partitioned: 5, ..f }, ..base.clone() },
        // The store a round trip away: answers and asks take time.
        Scenario { name: "zipf20_rtt1", rtt: MS, ..base.clone() },
        Scenario { name: "zipf20_rtt20", rtt: 20 * MS, ..base.clone() },
        Scenario { name: "zipf20_rtt80", rtt: 80 * MS, ..base.clone() },
        Scenario { name: "zipf20_rtt80_wait50", rtt: 80 * MS, max_wait: Some(50 * MS), ..base.clone() },
        Scenario { name: "zipf20_rtt20_wait10", rtt: 20 * MS, max_wait: Some(10 * MS), ..base.clone() },
        Scenario { name: "zipf20_dense_rtt1", keys: 4, limit: 2000, rtt: MS, ..base.clone() },
        Scenario { name: "zipf20_dense_rtt20", keys: 4, limit: 2000, rtt: 20 * MS, ..base.clone() },
        Scenario { name: "zipf20_dense_rtt80", keys: 4, limit: 2000, rtt: 80 * MS, ..base.clone() },
        Scenario { name: "even20_rtt1", spread: Spread::Even, rtt: MS, ..base.clone() },
        Scenario { name: "even20_rtt20", spread: Spread::Even, rtt: 20 * MS, ..base.clone() },
        Scenario { name: "even20_rtt80", spread: Spread::Even, rtt: 80 * MS, ..base.clone() },
        Scenario { name: "zipf100_rtt20", nodes: 100, rtt: 20 * MS, ..base.clone() },
        // Each client on one node at a time, moving on after 5 s on average (keep-alive
        // connections through a load balancer).
        Scenario { name: "sticky5s20_rtt20", spread: Spread::Sticky(5 * SECOND), rtt: 20 * MS, ..base.clone() },
        Scenario {
            name: "sticky5s20_rtt20_under",
            spread: Spread::Sticky(5 * SECOND),
            rtt: 20 * MS,
            load: 0.8,
            ..base.clone()
        },
        Scenario { name: "zipf20_rtt20_under", rtt: 20 * MS, load: 0.8, ..base.clone() },
        // The rules' default algorithms (sliding window; token bucket when `burst` is given),
        // and every rule exact.
        Scenario { name: "zipf20_rtt20_sliding", rtt: 20 * MS, algorithm: "sliding_window", ..base.clone() },
        Scenario { name: "zipf20_rtt20_bucket", rtt: 20 * MS, algorithm: "token_bucket", ..base.clone() },
        Scenario {
            name: "zipf100_rtt20_sliding",
            nodes: 100,
            rtt: 20 * MS,
            algorithm: "sliding_window",
            ..base.clone()
        },
        Scenario { name: "zipf100_rtt20_bucket", nodes: 100, rtt: 20 * MS, algorithm: "token_bucket", ..base.clone() },
        // Clients under their limit on the continuous algorithms: what their denials cost them.
        Scenario {
            name: "zipf20_rtt20_sliding_under",
            rtt: 20 * MS,
            algorithm: "sliding_window",
            load: 0.8,
            ..base.clone()
        },
        Scenario {
            name: "zipf20_rtt20_bucket_under",
            rtt: 20 * MS,
            algorithm: "token_bucket",
            load: 0.8,
            ..base.clone()
        },
        Scenario { name: "zipf20_rtt20_exact", rtt: 20 * MS, exact: true, ..base.clone() },
        // The continuous algorithms with waits allowed: what the no-wait mode gives up.
        Scenario {
            name: "zipf20_rtt20_sliding_exact",
            rtt: 20 * MS,
            algorithm: "sliding_window",
            exact: true,
            ..base.clone()
        },
        Scenario {
            name: "zipf20_rtt20_bucket_exact",
            rtt: 20 * MS,
            algorithm: "token_bucket",
            exact: true,
            ..base.clone()
        },
        Scenario { name: "zipf100", nodes: 100, ..base.clone() },
    ];
    let only = std::env::var("RATEWALL_SIM_ONLY").ok();
    // Per-node caps without any store: the floor of degraded mode's false denials.
    if only.as_deref().is_none_or(|o| o.split(',').any(|n| n == "cap_model")) {
        // The last two: the Worker simulation's quota (1,000 per window), where one grant per
        // isolate and window is the floor of its object calls.
        for (margin, measured, limit, name) in [
            (1.05, false, 200, "exact_shares_105"),
            (1.10, false, 200, "exact_shares_110"),
            (1.05, true, 200, "measured_shares_105"),
            (1.02, false, 1000, "exact_shares_102_of_1000"),
            (1.05, false, 1000, "exact_shares_105_of_1000"),
        ] {
            let (denied, over, worst) = outage_model(Fallback::Caps { margin, measured }, limit, 400, seed);
            figure(&format!("cap_model_false_denial_pct_{name}"), denied, "%");
            figure(&format!("cap_model_overadmission_pct_{name}"), over, "%");
            figure(&format!("cap_model_overadmission_max_pct_{name}"), worst, "%");
        }
    }
    // Other node-local rules for an outage, with shares and the rate known exactly.
    if only.as_deref().is_none_or(|o| o.split(',').any(|n| n == "outage_model")) {
        let blend = |cap, est, k| Fallback::CapsOrEstimate { cap, est, k };
        for (policy, name) in [
            (Fallback::Caps { margin: 1.05, measured: false }, "caps_105"),
            (Fallback::Caps { margin: 1.08, measured: false }, "caps_108"),
            (Fallback::Clock(1.0), "clock_100"),
            (Fallback::Clock(1.08), "clock_108"),
            (blend(1.0, 1.0, 20.0), "caps_or_estimate_100"),
            (blend(1.03, 1.0, 60.0), "caps_or_estimate_103"),
            (blend(1.05, 1.03, 20.0), "caps_or_estimate_105"),
        ] {
            let (denied, over, worst) = outage_model(policy, 200, 1000, seed);
            figure(&format!("outage_model_false_denial_pct_{name}"), denied, "%");
            figure(&format!("outage_model_overadmission_pct_{name}"), over, "%");
            figure(&format!("outage_model_overadmission_max_pct_{name}"), worst, "%");
        }
    }
    // Units placed on nodes before their requests: the floor of no-wait false denials where
    // the quota comes back all along.
    if only.as_deref().is_none_or(|o| o.split(',').any(|n| n == "trickle_model")) {
        for (lease, name) in [(None, "kept"), (Some(100 * MS), "lease_100ms"), (Some(20 * MS), "lease_20ms")] {
            figure(&format!("trickle_model_false_denial_pct_{name}"), trickle_model(lease, 400, seed), "%");
        }
    }
    for s in scenarios.iter().filter(|s| only.as_deref().is_none_or(|o| o.split(',').any(|n| n == s.name))) {
        let r = run(s).unwrap();
        figure(&format!("overadmission_pct_{}", s.name), r.overadmission_pct, "%");
        figure(&format!("overadmission_max_pct_{}", s.name), r.overadmission_max_pct, "%");
        figure(&format!("overadmission_peak_pct_{}", s.name), r.overadmission_peak_pct, "%");
        figure(&format!("overadmission_bound_pct_{}", s.name), bound_pct(s), "%");
        figure(&format!("false_denial_pct_{}", s.name), r.false_denial_pct, "%");
        figure(&format!("admitted_pct_{}", s.name), r.admitted as f64 / r.requests.max(1) as f64 * 100.0, "%");
        figure(&format!("store_calls_per_node_per_sec_{}", s.name), r.calls_per_node_per_sec, "calls/s");
        figure(&format!("bytes_per_sync_{}", s.name), r.bytes_per_sync, "B");
        figure(&format!("paused_pct_{}", s.name), r.paused_pct, "%");
        figure(&format!("asks_per_node_per_sec_{}", s.name), r.asks_per_node_per_sec, "calls/s");
        for (q, v) in ["p50", "p99", "p999"].iter().zip(r.added_latency_ms) {
            figure(&format!("added_latency_{q}_ms_{}", s.name), v, "ms");
        }
    }
}
