//! One decision of ratewall-core against the `governor` crate, in the same run.
//!
//! Both sides use the same quota (1000 per 60 s, burst 200) and a frozen clock (governor's
//! `FakeRelativeClock`, our `now` argument), so the figures compare the algorithms, not clock
//! reads. governor updates its atomic state in place; ratewall's decision is a pure function
//! `(state, now, cost) -> (decision, state)`, measured from a half-spent state (storing the
//! new state is the wrapper's job: the keyed group measures that round trip through bytes).
//! Prints `figure:` lines with criterion's medians.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use criterion::Criterion;
use governor::clock::FakeRelativeClock;
use governor::middleware::StateInformationMiddleware;
use governor::{Quota, RateLimiter};
use ratewall_core::{Algorithm, Limit, State};
use ratewall_tests::bench::{figure, median_ns};
use std::collections::HashMap;
use std::hint::black_box;
use std::num::NonZeroU32;

const NOW: u64 = 1_700_000_000_000_000_000;
const KEYS: u64 = 1000;

const PER: u64 = 60_000_000_000;

fn quota() -> Quota {
    Quota::with_period(std::time::Duration::from_millis(60)).unwrap().allow_burst(NonZeroU32::new(200).unwrap())
}

fn limit(a: Algorithm) -> Limit {
    let burst = (a == Algorithm::TokenBucket).then_some(200);
    Limit::new(a, 1000, PER, burst).unwrap()
}

/// A state with about half its quota spent.
fn half_spent(limit: &Limit) -> State {
    let mut s = State::Fresh;
    for _ in 0..limit.capacity() / 2 {
        s = limit.decide(&s, NOW, 1).1;
    }
    s
}

fn main() {
    let mut c = Criterion::default().output_directory(&ratewall_tests::bench::criterion_dir()).configure_from_args();
    let one = NonZeroU32::new(1).unwrap();

    let mut g = c.benchmark_group("direct");
    // governor refills one cell per 60 ms: advance its clock by that per check so it stays
    // in the allowed regime, as a steady client at the limit would.
    let clock = FakeRelativeClock::default();
    let gov = RateLimiter::direct_with_clock(quota(), clock.clone());
    let step = std::time::Duration::from_millis(60);
    g.bench_function("governor_allowed", |b| {
        b.iter(|| {
            clock.advance(step);
            black_box(gov.check().is_ok())
        })
    });
    // governor with the middleware that, like ratewall's decision, reports the remaining quota.
    let gov_state =
        RateLimiter::direct_with_clock(quota(), clock.clone()).with_middleware::<StateInformationMiddleware>();
    g.bench_function("governor_state_allowed", |b| {
        b.iter(|| {
            clock.advance(step);
            black_box(gov_state.check().map(|s| s.remaining_burst_capacity()))
        })
    });
    let gov_denied = RateLimiter::direct_with_clock(Quota::per_hour(one), FakeRelativeClock::default());
    let _ = gov_denied.check();
    g.bench_function("governor_denied", |b| b.iter(|| black_box(gov_denied.check().is_ok())));
    for (name, a) in [("token_bucket", Algorithm::TokenBucket), ("sliding_window", Algorithm::SlidingWindow)] {
        let limit = limit(a);
        let state = half_spent(&limit);
        g.bench_function(format!("ratewall_{name}_allowed"), |b| {
            b.iter(|| black_box(limit.decide(black_box(&state), black_box(NOW), 1)))
        });
        let tight = Limit::new(a, 1, 3_600_000_000_000, None).unwrap();
        let (_, spent) = tight.decide(&State::Fresh, NOW, 1);
        g.bench_function(format!("ratewall_{name}_denied"), |b| {
            b.iter(|| black_box(tight.decide(black_box(&spent), black_box(NOW), 1).0.allowed))
        });
    }
    g.finish();

    let mut g = c.benchmark_group("keyed");
    // Keyed: 1000 keys in turn; both clocks advance 60 µs per check (60 ms per key per
    // round), so every key refills as fast as it is spent and stays allowed.
    let gov = RateLimiter::dashmap_with_clock(quota(), clock.clone());
    let step = std::time::Duration::from_micros(60);
    let mut k = 0u64;
    g.bench_function("governor_dashmap", |b| {
        b.iter(|| {
            k = (k + 1) % KEYS;
            clock.advance(step);
            black_box(gov.check_key(&k).is_ok())
        })
    });
    let limit = limit(Algorithm::TokenBucket);
    let mut map: HashMap<u64, Vec<u8>> = (0..KEYS).map(|k| (k, State::Fresh.encode())).collect();
    let mut now = NOW;
    g.bench_function("ratewall_token_bucket_bytes", |b| {
        b.iter(|| {
            k = (k + 1) % KEYS;
            now += 60_000;
            let bytes = map.get_mut(&k).unwrap();
            let state = State::decode(bytes).map(|(s, _)| s).unwrap_or_default();
            let (d, next) = limit.decide(&state, black_box(now), 1);
            bytes.clear();
            next.encode_into(bytes);
            black_box(d.allowed)
        })
    });
    g.finish();
    c.final_summary();

    let m = |id: &str| median_ns(id);
    if let (Some(gov), Some(tb), Some(sw)) = (
        m("direct/governor_allowed"),
        m("direct/ratewall_token_bucket_allowed"),
        m("direct/ratewall_sliding_window_allowed"),
    ) {
        figure("governor_direct_ns", gov, "ns");
        figure("core_token_bucket_ns", tb, "ns");
        figure("core_sliding_window_ns", sw, "ns");
        figure("core_vs_governor_direct", tb / gov, "x");
        figure("core_sliding_window_vs_governor_direct", sw / gov, "x");
    }
    if let (Some(gov), Some(tb)) = (m("direct/governor_state_allowed"), m("direct/ratewall_token_bucket_allowed")) {
        figure("governor_direct_state_ns", gov, "ns");
        figure("core_vs_governor_direct_state", tb / gov, "x");
    }
    if let (Some(gov), Some(tb)) = (m("direct/governor_denied"), m("direct/ratewall_token_bucket_denied")) {
        figure("core_vs_governor_direct_denied", tb / gov, "x");
    }
    if let (Some(gov), Some(ours)) = (m("keyed/governor_dashmap"), m("keyed/ratewall_token_bucket_bytes")) {
        figure("governor_keyed_ns", gov, "ns");
        figure("core_keyed_bytes_ns", ours, "ns");
        figure("core_vs_governor_keyed", ours / gov, "x");
    }
}
