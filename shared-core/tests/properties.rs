//! Property tests of the algorithms' exactness promises and of the total parsers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use proptest::prelude::*;
use ratewall_core::{Algorithm, Config, Limit, Nanos, State};

const MS: Nanos = 1_000_000;

fn algorithm() -> impl Strategy<Value = Algorithm> {
    prop_oneof![
        Just(Algorithm::TokenBucket),
        Just(Algorithm::SlidingWindow),
        Just(Algorithm::FixedWindow),
        Just(Algorithm::SlidingLog),
        Just(Algorithm::LeakyBucket),
    ]
}

fn limit() -> impl Strategy<Value = Limit> {
    (
        algorithm(),
        1u64..50,
        prop_oneof![1u64..2_000, Just(3_600_000), Just(86_400_000 * 366)],
        proptest::option::of(1u64..60),
    )
        .prop_filter_map("valid limit", |(a, requests, per_ms, burst)| {
            let burst = match a {
                Algorithm::TokenBucket => burst,
                Algorithm::LeakyBucket => burst.map(|b| b - 1),
                _ => None,
            };
            Limit::new(a, requests, per_ms * MS, burst).ok()
        })
}

/// A clock step: to an extreme instant, or by an amount back or forward.
#[derive(Clone, Copy, Debug)]
enum Step {
    To(Nanos),
    By(Nanos, bool),
}

impl Step {
    fn apply(self, t: Nanos) -> Nanos {
        match self {
            Step::To(to) => to,
            Step::By(d, true) => t.saturating_add(d),
            Step::By(d, false) => t.saturating_sub(d),
        }
    }
}

fn clock_step() -> impl Strategy<Value = Step> {
    const HOUR: Nanos = 3_600_000_000_000;
    const YEAR: Nanos = 366 * 24 * HOUR;
    let to = prop_oneof![Just(0u64), Just(1), Just(1 << 63), Just(u64::MAX), Just(u64::MAX - 1)].prop_map(Step::To);
    let by =
        (prop_oneof![Just(MS), Just(2 * HOUR), Just(30 * 24 * HOUR), Just(5 * YEAR), Just(300 * YEAR)], any::<bool>())
            .prop_map(|(d, forward)| Step::By(d, forward));
    prop_oneof![to, by]
}

/// A limit and a history of (gap, cost) steps that drives it into some state.
fn scenario() -> impl Strategy<Value = (Limit, Vec<(Nanos, u64)>, Nanos)> {
    scenario_with(algorithm())
}

/// The same for the exact algorithms only (all but the sliding window counter).
fn exact_scenario() -> impl Strategy<Value = (Limit, Vec<(Nanos, u64)>, Nanos)> {
    scenario_with(prop_oneof![Just(Algorithm::TokenBucket), Just(Algorithm::FixedWindow), Just(Algorithm::SlidingLog)])
}

fn scenario_with(
    algorithm: impl Strategy<Value = Algorithm>,
) -> impl Strategy<Value = (Limit, Vec<(Nanos, u64)>, Nanos)> {
    (algorithm, 1u64..50, 1u64..120_000, proptest::option::of(1u64..60))
        .prop_filter_map("valid limit", |(a, requests, per_ms, burst)| {
            let burst = match a {
                Algorithm::TokenBucket => burst,
                Algorithm::LeakyBucket => burst.map(|b| b - 1),
                _ => None,
            };
            Limit::new(a, requests, per_ms * MS, burst).ok()
        })
        .prop_flat_map(|limit| {
            let steps = proptest::collection::vec((0u64..(limit.per() / 2 + 2), 0u64..=limit.capacity()), 0..60);
            (Just(limit), steps, 1_600_000_000u64 * 1_000_000_000..1_700_000_000u64 * 1_000_000_000)
        })
}

fn replay(limit: &Limit, steps: &[(Nanos, u64)], start: Nanos) -> (State, Nanos) {
    let mut s = State::Fresh;
    let mut now = start;
    for &(gap, cost) in steps {
        now += gap;
        s = limit.decide(&s, now, cost).1;
    }
    (s, now)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// A denied caller that waits exactly retry-after is admitted; one that waits 1 ms less is
    /// not. This holds for every algorithm: retry-after is computed exactly, in nanoseconds,
    /// for the sliding window too (against its floored estimate).
    #[test]
    fn waiting_retry_after_is_enough_and_1ms_less_is_not((limit, steps, start) in scenario(), cost_frac in 0.0f64..=1.0) {
        let (s, now) = replay(&limit, &steps, start);
        let cost = ((limit.capacity() as f64 * cost_frac) as u64).max(1);
        let (d, same) = limit.decide(&s, now, cost);
        if let (false, Some(wait)) = (d.allowed, d.retry_after) {
            // A denial consumes nothing: the state it returns decides alike.
            prop_assert_eq!(limit.decide(&same, now, cost).0, d, "a denial must not change the count");
            prop_assert!(wait > 0);
            for s in [&s, &same] {
                prop_assert!(limit.decide(s, now + wait, cost).0.allowed, "waited {wait} ns");
                if wait > MS {
                    prop_assert!(!limit.decide(s, now + wait - MS, cost).0.allowed, "admitted 1 ms early");
                }
                prop_assert!(!limit.decide(s, now + wait - 1, cost).0.allowed, "admitted 1 ns early");
            }
        }
    }

    #[test]
    fn remaining_never_exceeds_the_quota((limit, steps, start) in scenario()) {
        let mut s = State::Fresh;
        let mut now = start;
        for (gap, cost) in steps {
            now += gap;
            let (d, n) = limit.decide(&s, now, cost);
            prop_assert!(d.remaining <= d.limit);
            prop_assert_eq!(d.limit, limit.quota());
            s = n;
        }
    }

    /// The exact algorithms never admit more than their capacity in any window of `per`.
    #[test]
    fn exact_algorithms_never_exceed_the_limit_in_any_window((limit, steps, start) in exact_scenario()) {
        let mut s = State::Fresh;
        let mut now = start;
        let mut admitted: Vec<(Nanos, u64)> = Vec::new();
        for (gap, cost) in steps {
            now += gap;
            let (d, n) = limit.decide(&s, now, cost);
            s = n;
            if d.allowed && cost > 0 {
                admitted.push((now, cost));
            }
        }
        for &(t0, _) in &admitted {
            let in_window: u64 = admitted.iter().filter(|(t, _)| *t >= t0 && *t < t0 + limit.per()).map(|(_, c)| c).sum();
            let bound = match limit.algorithm() {
                // A fixed window may straddle two windows: at most twice the limit.
                Algorithm::FixedWindow => 2 * limit.requests(),
                // A bucket admits its capacity plus what refills during the window.
                Algorithm::TokenBucket => limit.capacity() + limit.requests(),
                _ => limit.requests(),
            };
            prop_assert!(in_window <= bound, "{in_window} > {bound} in [{t0}, +per)");
        }
        if limit.algorithm() == Algorithm::FixedWindow {
            for &(t0, _) in &admitted {
                let w = t0 / limit.per();
                let n: u64 = admitted.iter().filter(|(t, _)| t / limit.per() == w).map(|(_, c)| c).sum();
                prop_assert!(n <= limit.requests());
            }
        }
    }

    /// Rules can be reloaded with a lower limit while states live on: deciding a state built
    /// under another limit of the same algorithm never panics and never reports more than the
    /// quota; for the counting algorithms a full window stays full under a lower limit. (A
    /// token bucket's state is time owed, which a new rate re-prices, so it is not counted.)
    #[test]
    fn a_lowered_limit_on_live_state_is_safe((limit, steps, start) in scenario(), new_requests in 1u64..5) {
        let (s, now) = replay(&limit, &steps, start);
        let s = limit.consume(&s, now, limit.capacity());
        let burst = (limit.algorithm() == Algorithm::TokenBucket).then_some(new_requests);
        let lower = Limit::new(limit.algorithm(), new_requests, limit.per(), burst).unwrap();
        let (d, _) = lower.decide(&s, now, 1);
        prop_assert!(d.remaining <= d.limit);
        if limit.algorithm() != Algorithm::TokenBucket && new_requests <= limit.requests() {
            prop_assert!(!d.allowed, "a full window under the old limit is full under a lower one");
        }
    }

    #[test]
    fn states_round_trip_through_bytes((limit, steps, start) in scenario()) {
        let (s, _) = replay(&limit, &steps, start);
        let bytes = s.encode();
        prop_assert_eq!(State::decode(&bytes), Ok((s.clone(), bytes.len())));
        prop_assert!(bytes.len() <= 29, "{} bytes: {s:?}", bytes.len());
    }

    /// After the clock steps — back or forward, by a millisecond or by years, to 0 or to the
    /// end of time — a denied caller that waits exactly retry-after is admitted, and no wait
    /// is longer than a few windows (or refills). A step the clock then takes back costs no
    /// client more than that either.
    #[test]
    fn retry_after_stays_true_and_short_after_any_clock_step(
        (limit, steps, start) in scenario(),
        step in clock_step(),
        back_again in any::<bool>(),
    ) {
        let (s, now) = replay(&limit, &steps, start);
        let s = limit.consume(&s, now, limit.capacity());
        let stepped = step.apply(now);
        let (s, now) = if back_again {
            // The state is written at the stepped clock, which then returns.
            (limit.consume(&s, stepped, limit.capacity()), now)
        } else {
            (s, stepped)
        };
        let bound = 3 * limit.per().max(limit.capacity() * limit.per().div_ceil(limit.requests()));
        let (d, kept) = limit.decide(&s, now, 1);
        prop_assert!(d.reset_after <= bound, "reset {} > {bound}", d.reset_after);
        if let (false, Some(wait)) = (d.allowed, d.retry_after) {
            prop_assert!(wait <= bound, "retry {wait} > {bound}");
            let at = now.min(ratewall_core::algo::LATEST);
            prop_assert!(limit.decide(&kept, at + wait, 1).0.allowed, "waited {wait} ns and was still denied");
        }
    }

    /// A state read under a limit it was not written with (another `per`, `requests`,
    /// algorithm — a rules push, or a plan that lapsed) never locks a client out and never
    /// promises an absurd wait: at most a few of the new limit's windows or refills.
    #[test]
    fn a_state_under_another_limit_never_locks_out(
        (old, steps, start) in scenario(),
        new in limit(),
        later in 0u64..10_000_000_000,
    ) {
        let (s, now) = replay(&old, &steps, start);
        let s = old.consume(&s, now, old.capacity());
        let now = now + later;
        let bound = 3 * new.per().max(new.capacity() * new.per().div_ceil(new.requests()));
        let (d, kept) = new.decide(&s, now, 1);
        prop_assert!(d.remaining <= d.limit);
        if let (false, Some(wait)) = (d.allowed, d.retry_after) {
            prop_assert!(wait <= bound, "retry {wait} > {bound} under {new:?}");
            prop_assert!(new.decide(&kept, now + wait, 1).0.allowed);
        }
    }

    /// Normalizing is idempotent (so the fast path for already-normal paths agrees with the
    /// full one), and every result is absolute.
    #[test]
    fn path_normalization_is_idempotent(path in "[/a.%2e6C?#\\x{ff}-]{0,24}") {
        let once = ratewall_core::glob::normalize_path(path.as_bytes());
        prop_assert!(once.starts_with('/'));
        prop_assert_eq!(ratewall_core::glob::normalize_path(once.as_bytes()), once.clone());
    }

    #[test]
    fn decoding_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = State::decode(&bytes);
    }

    #[test]
    fn decoding_garbage_sync_messages_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
        let _ = ratewall_core::sync::SyncRequest::decode(&bytes);
        let _ = ratewall_core::sync::SyncResponse::decode(&bytes);
        let mut with_header = vec![1u8, 1];
        with_header.extend_from_slice(&bytes);
        let _ = ratewall_core::sync::SyncRequest::decode(&with_header);
    }

    #[test]
    fn parsing_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = Config::parse(&bytes);
    }

    /// Structured garbage: JSON documents that look like rules with random values.
    #[test]
    fn parsing_rule_shaped_garbage_never_panics(doc in rule_shaped_json()) {
        if let Err(e) = Config::parse(doc.as_bytes()) {
            prop_assert!(!e.reason.is_empty());
        }
    }
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::json;
    prop_oneof![
        Just(json!(null)),
        any::<bool>().prop_map(|b| json!(b)),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        (-1e20f64..1e20).prop_map(|n| json!(n)),
        "[a-z0-9*/ .]{0,12}".prop_map(|s| json!(s)),
        prop_oneof![
            Just("60s"),
            Just("0s"),
            Just("500ms"),
            Just("367d"),
            Just("unlimited"),
            Just("ip"),
            Just("user"),
            Just("/v1/*")
        ]
        .prop_map(|s| json!(s)),
    ]
}

fn rule_shaped_json() -> impl Strategy<Value = String> {
    // A rule's fields, and some of its limit's and match's.
    let mut fields = ratewall_core::rules::RULE_FIELDS.to_vec();
    fields.extend(["requests", "per", "burst", "delay", "concurrent", "hold_max", "path", "method"]);
    let leaf = json_value();
    let tree = leaf.prop_recursive(3, 24, 4, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
            proptest::collection::btree_map(
                proptest::sample::select(fields.clone()).prop_map(String::from),
                inner,
                0..5
            )
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    });
    proptest::collection::vec(tree, 0..4).prop_map(|rules| serde_json::json!({ "rules": rules }).to_string())
}

proptest! {
    /// The leaky bucket forwards one request per `per / requests` (no two turns closer, the
    /// `delay` requests that go at once aside), never before the turn the GCRA gives it, and
    /// a rejected request's `retry_after` is exact: admitted then, not a nanosecond sooner.
    #[test]
    fn leaky_bucket_turns_are_never_early_and_one_per_interval(
        requests in 1u64..20,
        per_ms in 1u64..5_000,
        burst in 0u64..10,
        delay_pick in 0u64..10,
        gaps in proptest::collection::vec(0u64..400, 1..60),
    ) {
        let delay = delay_pick % (burst + 1);
        let limit = Limit::new(Algorithm::LeakyBucket, requests, per_ms * MS, Some(burst)).unwrap().with_delay(delay).unwrap();
        let interval = (per_ms * MS).div_ceil(requests);
        let mut s = State::Fresh;
        let mut t = 1_700_000_000_000 * MS;
        let mut forwarded: Vec<Nanos> = Vec::new();
        let mut tat = 0;
        for g in gaps {
            t += g * MS / 10;
            let (d, next) = limit.decide(&s, t, 1);
            if d.allowed {
                let at = t + limit.wait(&d, 1);
                // Its turn: the previous request's turn plus one interval, or now.
                let turn = tat.max(t);
                prop_assert!(at + delay * interval >= turn, "early: {at} before {turn}");
                prop_assert!(at <= turn, "late: {at} after {turn}");
                tat = turn + interval;
                forwarded.push(at);
                prop_assert!(d.remaining <= burst);
            } else {
                let r = d.retry_after.unwrap();
                let (later, _) = limit.decide(&next, t + r, 1);
                prop_assert!(later.allowed, "not admitted after its retry_after");
                if r > 0 {
                    let (sooner, _) = limit.decide(&next, t + r - 1, 1);
                    prop_assert!(!sooner.allowed, "admitted before its retry_after");
                }
            }
            s = next;
        }
        if delay == 0 {
            forwarded.sort_unstable();
            for w in forwarded.windows(2) {
                prop_assert!(w[1] - w[0] >= interval, "two turns {} ns apart", w[1] - w[0]);
            }
        }
    }
}
