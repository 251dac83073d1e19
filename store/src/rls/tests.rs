//! The service's logic on Redis in memory.

use super::config::RlsConfig;
use super::*;
use crate::fake::FakeKv;
use crate::Store;
use serde_json::json;

const CONFIG: &str = "domain: d
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 3, exact: true}
  - key: ip
    rate_limit: {unit: hour, requests_per_unit: 10, name: per-ip, exact: true}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1, exact: true}
  - key: banned
    rate_limit: {unit: hour, requests_per_unit: 0}
  - key: free
    rate_limit: {unlimited: true}
  - key: plain
    rate_limit: {unit: hour, requests_per_unit: 10, algorithm: sliding_window}
  - key: X-Api-Key
    rate_limit: {unit: hour, requests_per_unit: 0}
  - key: buyer
    secret: true
    rate_limit: {unit: hour, requests_per_unit: 0}
";

fn rls() -> Rls<FakeKv> {
    let kv = FakeKv::default();
    kv.now.store(1_000 * 3600 * ratewall_core::SECOND, Ordering::Relaxed);
    let store = Arc::new(Store::new(kv, b"unit-test-secret-0123", Duration::from_secs(1)));
    Rls::new(store, RlsConfig::parse("t.yaml", CONFIG).unwrap(), None, b"unit-test-secret-0123")
}

fn call(descriptors: &[&[(&str, &str)]]) -> Call {
    Call {
        domain: "d".into(),
        descriptors: descriptors
            .iter()
            .map(|e| Descriptor {
                entries: e.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
                ..Default::default()
            })
            .collect(),
        hits_addend: 0,
    }
}

fn remaining(a: &Answer) -> Vec<u32> {
    a.statuses.iter().map(|s| s.limit_remaining).collect()
}

#[tokio::test]
async fn a_limit_counts_each_hit_and_denies_past_it() {
    let r = rls();
    let c = call(&[&[("user", "alice")]]);
    for left in [2, 1, 0] {
        let a = r.should_rate_limit(&c).await.unwrap();
        assert_eq!(a.overall_code, Code::Ok);
        assert_eq!(remaining(&a), [left]);
    }
    let a = r.should_rate_limit(&c).await.unwrap();
    assert_eq!(a.overall_code, Code::OverLimit);
    assert_eq!(a.statuses[0].code, Code::OverLimit);
    assert!(a.headers.iter().any(|(k, _)| *k == "Retry-After"), "{:?}", a.headers);
    // Another value of the key has a counter of its own.
    assert_eq!(r.should_rate_limit(&call(&[&[("user", "bob")]])).await.unwrap().overall_code, Code::Ok);
}

#[tokio::test]
async fn a_denied_call_charges_no_descriptor() {
    let r = rls();
    let both = call(&[&[("ip", "1.2.3.4")], &[("user", "alice")]]);
    for _ in 0..3 {
        assert_eq!(r.should_rate_limit(&both).await.unwrap().overall_code, Code::Ok);
    }
    for _ in 0..5 {
        let a = r.should_rate_limit(&both).await.unwrap();
        assert_eq!(a.overall_code, Code::OverLimit);
        assert_eq!(a.statuses[0].code, Code::Ok);
        assert_eq!(a.statuses[0].limit_remaining, 7, "the ip descriptor was given its hit back");
    }
    let a = r.should_rate_limit(&call(&[&[("ip", "1.2.3.4")]])).await.unwrap();
    assert_eq!(remaining(&a), [6]);
}

#[tokio::test]
async fn a_call_that_names_a_counter_twice_takes_its_hits_as_one() {
    // Two of Envoy's `rate_limits` actions can send the same entries: one hit past the limit
    // in one call is refused as a whole, and the counter stays free for a call that fits.
    for (rule, limit) in [("user", 3), ("plain", 10)] {
        let r = rls();
        let alice: &[(&str, &str)] = &[(rule, "alice")];
        let over = r.should_rate_limit(&call(&vec![alice; limit + 1])).await.unwrap();
        assert_eq!(over.overall_code, Code::OverLimit, "{rule}");
        assert!(over.statuses.iter().all(|s| s.code == Code::OverLimit), "{rule}: refused as one");
        let once = r.should_rate_limit(&call(&[alice])).await.unwrap();
        assert_eq!(once.overall_code, Code::Ok, "{rule}: {:?}", once.headers);
        assert_eq!(remaining(&once), [limit as u32 - 1], "{rule}");
        let fits = r.should_rate_limit(&call(&vec![alice; limit - 1])).await.unwrap();
        assert_eq!(fits.overall_code, Code::Ok, "{rule}");
        assert_eq!(remaining(&fits), vec![0; limit - 1], "{rule}: each says what the call left");
    }
}

#[tokio::test]
async fn hits_addend_per_call_and_per_descriptor() {
    let r = rls();
    let mut c = call(&[&[("ip", "a")]]);
    c.hits_addend = 4;
    assert_eq!(remaining(&r.should_rate_limit(&c).await.unwrap()), [6]);
    c.descriptors[0].hits_addend = Some(0);
    assert_eq!(remaining(&r.should_rate_limit(&c).await.unwrap()), [6], "0 checks without taking");
    c.descriptors[0].hits_addend = Some(7);
    assert_eq!(r.should_rate_limit(&c).await.unwrap().overall_code, Code::OverLimit);
    c.descriptors[0].hits_addend = Some(6);
    assert_eq!(remaining(&r.should_rate_limit(&c).await.unwrap()), [0]);
}

#[tokio::test]
async fn shadow_mode_reports_ok() {
    let r = rls();
    let c = call(&[&[("shadow", "x")]]);
    r.should_rate_limit(&c).await.unwrap();
    let a = r.should_rate_limit(&c).await.unwrap();
    assert_eq!(a.overall_code, Code::Ok);
    assert_eq!(a.statuses[0].code, Code::Ok);
    assert!(r.metrics.render().contains("ratewall_rls_shadow_mode_total{domain=\"d\",rule=\"d.shadow\"} 1"));
}

#[tokio::test]
async fn zero_requests_deny_and_unlimited_allows() {
    let r = rls();
    let a = r.should_rate_limit(&call(&[&[("banned", "x")], &[("free", "y")], &[("nothing", "z")]])).await.unwrap();
    assert_eq!(a.overall_code, Code::OverLimit);
    assert_eq!(a.statuses[0].code, Code::OverLimit);
    assert_eq!(a.statuses[1].limit_remaining, u32::MAX);
    assert!(a.statuses[1].current_limit.is_none());
    assert_eq!(
        a.statuses[2],
        Status { code: Code::Ok, current_limit: None, limit_remaining: 0, duration_until_reset: None }
    );
    assert_eq!(r.store.kv.ops.load(Ordering::Relaxed), 0, "none of them needs Redis");
}

#[tokio::test]
async fn an_override_replaces_the_configured_limit() {
    let r = rls();
    let mut c = call(&[&[("user", "carol")]]);
    c.descriptors[0].limit = Some((1, Unit::Minute.proto()));
    let a = r.should_rate_limit(&c).await.unwrap();
    let l = a.statuses[0].current_limit.clone().unwrap();
    assert_eq!((l.requests_per_unit, l.unit), (1, Unit::Minute.proto()));
    // The policy is named by the value's keyed hash: a value may be a secret.
    let policy = &a.headers.iter().find(|(n, _)| *n == "RateLimit-Policy").unwrap().1;
    assert!(policy.starts_with("\"d.user_#") && policy.len() == "\"d.user_#3f9a1c2e\";q=1;w=60".len(), "{policy}");
    assert!(a.headers.iter().all(|(_, v)| !v.contains("carol")), "{:?}", a.headers);
    assert_eq!(r.should_rate_limit(&c).await.unwrap().overall_code, Code::OverLimit);
    // Another value is another counter.
    let mut other = call(&[&[("user", "carl")]]);
    other.descriptors[0].limit = Some((1, Unit::Minute.proto()));
    assert_eq!(r.should_rate_limit(&other).await.unwrap().overall_code, Code::Ok);
    c.descriptors[0].limit = Some((1, 0));
    assert!(matches!(r.should_rate_limit(&c).await, Err(Refusal::Invalid(_))));
}

#[tokio::test]
async fn limits_of_other_windows_on_the_same_entries_count_apart() {
    let r = rls();
    // 3 a minute and 100 a day on one tenant, in one call: the minute's limit holds.
    let mut two = call(&[&[("tenant", "t1")], &[("tenant", "t1")]]);
    two.descriptors[0].limit = Some((3, Unit::Minute.proto()));
    two.descriptors[1].limit = Some((100, Unit::Day.proto()));
    for left in [(2, 99), (1, 98), (0, 97)] {
        let a = r.should_rate_limit(&two).await.unwrap();
        assert_eq!(a.overall_code, Code::Ok);
        assert_eq!(remaining(&a), [left.0, left.1]);
    }
    let a = r.should_rate_limit(&two).await.unwrap();
    assert_eq!(a.overall_code, Code::OverLimit);
    assert_eq!(codes(&a), [Code::OverLimit, Code::Ok]);
    // The configured 3 an hour beside an override of 100 a day on the same user: each counts
    // every admitted call, and the hour's limit holds.
    let mut beside = call(&[&[("user", "dave")], &[("user", "dave")]]);
    beside.descriptors[1].limit = Some((100, Unit::Day.proto()));
    for left in [(2, 99), (1, 98), (0, 97)] {
        assert_eq!(remaining(&r.should_rate_limit(&beside).await.unwrap()), [left.0, left.1]);
    }
    assert_eq!(r.should_rate_limit(&beside).await.unwrap().overall_code, Code::OverLimit);
}

#[tokio::test]
async fn a_call_that_never_fits_is_told_its_quotas_reset_not_a_whole_window() {
    let r = rls();
    let kv = &r.store().kv;
    kv.now.store(1_000 * 3600 * ratewall_core::SECOND + 1200 * ratewall_core::SECOND, Ordering::Relaxed);
    let mut c = call(&[&[("ip", "far")]]);
    c.hits_addend = 20;
    let a = r.should_rate_limit(&c).await.unwrap();
    let reset = a.statuses[0].duration_until_reset.unwrap() / ratewall_core::SECOND;
    assert_eq!(reset, 2400);
    assert_eq!(a.headers[0], ("Retry-After", "2400".to_owned()));
}

#[tokio::test]
async fn headers_are_the_filters_fields() {
    let r = rls();
    let a = r.should_rate_limit(&call(&[&[("ip", "a")], &[("user", "b")]])).await.unwrap();
    // Every policy, the most restrictive first: the user's (2 of 3 left), then the address's.
    assert_eq!(
        a.headers,
        vec![
            ("RateLimit-Policy", "\"d.user\";q=3;w=3600, \"per-ip\";q=10;w=3600".to_owned()),
            ("RateLimit", "\"d.user\";r=2;t=3600, \"per-ip\";r=9;t=3600".to_owned()),
        ]
    );
    let mut c = call(&[&[("ip", "a")]]);
    c.hits_addend = 20;
    let a = r.should_rate_limit(&c).await.unwrap();
    assert_eq!(a.headers[0], ("Retry-After", "3600".to_owned()));
    assert_eq!(a.headers[1], ("RateLimit-Policy", "\"per-ip\";q=10;w=3600".to_owned()));
    // One rule matched twice (one counter, two; both count): named once, at its tightest.
    for entries in [[("user", "twice"), ("user", "twice")], [("user", "one"), ("user", "other")]] {
        let a = r.should_rate_limit(&call(&[&entries[..1], &entries[1..]])).await.unwrap();
        assert_eq!(
            a.headers,
            vec![
                ("RateLimit-Policy", "\"d.user\";q=3;w=3600".to_owned()),
                ("RateLimit", format!("\"d.user\";r={};t=3600", if entries[0] == entries[1] { 1 } else { 2 })),
            ],
            "{entries:?}"
        );
    }
}

#[tokio::test]
async fn redis_down_is_unavailable_and_nothing_is_lost() {
    let r = rls();
    let c = call(&[&[("user", "dave")]]);
    r.should_rate_limit(&c).await.unwrap();
    r.store.kv.down.store(true, Ordering::Relaxed);
    assert!(matches!(r.should_rate_limit(&c).await, Err(Refusal::Unavailable(_))));
    r.store.kv.down.store(false, Ordering::Relaxed);
    assert_eq!(remaining(&r.should_rate_limit(&c).await.unwrap()), [1]);
}

/// An exact descriptor's look (no hits) and refusal are decided at Redis, not on what this
/// process last wrote: another process's hits since are seen, and with Redis down the look is
/// unavailable (it answered from memory: OK, with a stale count).
#[tokio::test]
async fn an_exact_look_is_decided_at_redis_not_on_this_process_last_write() {
    let r = rls();
    let other =
        Rls::new(Arc::clone(&r.store), RlsConfig::parse("t.yaml", CONFIG).unwrap(), None, b"unit-test-secret-0123");
    let c = call(&[&[("user", "erin")]]);
    let mut look = c.clone();
    look.descriptors[0].hits_addend = Some(0);
    assert_eq!(remaining(&r.should_rate_limit(&c).await.unwrap()), [2]);
    assert_eq!(remaining(&other.should_rate_limit(&c).await.unwrap()), [1]);
    assert_eq!(remaining(&r.should_rate_limit(&look).await.unwrap()), [1], "the other process's hit counts");
    r.store.kv.down.store(true, Ordering::Relaxed);
    assert!(matches!(r.should_rate_limit(&look).await, Err(Refusal::Unavailable(_))));
}

#[tokio::test]
async fn malformed_calls_are_invalid() {
    let r = rls();
    let mut c = call(&[&[("user", "a")]]);
    c.domain.clear();
    assert!(matches!(r.should_rate_limit(&c).await, Err(Refusal::Invalid(_))));
    assert!(matches!(r.should_rate_limit(&call(&[])).await, Err(Refusal::Invalid(_))));
}

#[tokio::test]
async fn counter_names_hide_descriptor_values() {
    let r = rls();
    r.should_rate_limit(&call(&[&[("user", "secret-api-key-123")]])).await.unwrap();
    for k in r.store.kv.values.lock().unwrap().keys() {
        assert!(!k.contains("secret") && !k.contains(&hex(b"secret")), "{k}");
    }
}

#[tokio::test]
async fn a_long_value_is_matched_and_counted_never_refused() {
    let r = rls();
    let long = "v".repeat(5_000);
    // A blocklisted descriptor beside a long value still denies the call.
    let a = r.should_rate_limit(&call(&[&[("banned", "x")], &[("user", &long)]])).await.unwrap();
    assert_eq!(a.overall_code, Code::OverLimit);
    assert_eq!(a.statuses[0].code, Code::OverLimit);
    // The long value is counted against its limit, on a counter of its own.
    let c = call(&[&[("user", &long)]]);
    for left in [2, 1, 0] {
        assert_eq!(remaining(&r.should_rate_limit(&c).await.unwrap()), [left]);
    }
    assert_eq!(r.should_rate_limit(&c).await.unwrap().overall_code, Code::OverLimit);
    let other = format!("{}w", &long[1..]);
    assert_eq!(remaining(&r.should_rate_limit(&call(&[&[("user", &other)]])).await.unwrap()), [2]);
    // An override named by a long value gives a bounded policy name.
    let mut c = call(&[&[("tenant", &long)]]);
    c.descriptors[0].limit = Some((5, Unit::Minute.proto()));
    let a = r.should_rate_limit(&c).await.unwrap();
    assert_eq!(a.overall_code, Code::Ok);
    assert!(a.headers.iter().all(|(_, v)| v.len() < 400), "{:?}", a.headers);
}

#[tokio::test]
async fn a_process_that_stops_reports_what_it_admitted_or_says_how_much_it_could_not() {
    let r = rls();
    // Noted present (as every flush does): a new counter is decided on an initial share.
    lease::flush(&r).await;
    let c = call(&[&[("plain", "p")]]);
    for left in [9, 8, 7] {
        assert_eq!(remaining(&r.should_rate_limit(&c).await.unwrap()), [left]);
    }
    assert_eq!(r.leases.cold.load(Ordering::Relaxed), 1, "admitted in memory, not reported yet");
    r.store.kv.down.store(true, Ordering::Relaxed);
    assert_eq!(lease::flush_all(&r, Duration::from_millis(300)).await, 3, "Redis down: 3 units not reported");
    r.store.kv.down.store(false, Ordering::Relaxed);
    assert_eq!(lease::flush_all(&r, Duration::from_secs(1)).await, 0);
    assert_eq!(lease::flush_all(&r, Duration::from_secs(1)).await, 0, "nothing left to send");
    // The next process on the Redis finds them counted, once.
    let next =
        Rls::new(Arc::clone(&r.store), RlsConfig::parse("t.yaml", CONFIG).unwrap(), None, b"unit-test-secret-0123");
    let mut look = c.clone();
    look.descriptors[0].hits_addend = Some(0);
    assert_eq!(remaining(&next.should_rate_limit(&look).await.unwrap()), [7]);
}

#[tokio::test]
async fn duration_until_reset_is_whole_seconds_rounded_up() {
    let r = rls();
    // 0.4 s into the hour: a fixed window of an hour ends in 3599.6 s.
    r.store.kv.now.store(1_000 * 3600 * ratewall_core::SECOND + 400_000_000, Ordering::Relaxed);
    let a = r.should_rate_limit(&call(&[&[("user", "whole")], &[("banned", "b")]])).await.unwrap();
    assert_eq!(a.statuses[0].duration_until_reset, Some(3600 * ratewall_core::SECOND));
    let banned = a.statuses[1].duration_until_reset.unwrap();
    assert_eq!(banned % ratewall_core::SECOND, 0, "{banned}");
    assert!((1..=3600).contains(&(banned / ratewall_core::SECOND)), "{banned}");
}

#[tokio::test]
async fn a_sliding_windows_duration_until_reset_is_when_it_is_fully_restored() {
    let config = "domain: s
descriptors:
  - key: slide
    rate_limit: {unit: minute, requests_per_unit: 2, algorithm: sliding_window, exact: true}
";
    let store = rls().store;
    // A process fresh for each call: it reads the counter at the clock set (not its own last
    // write moved on by the time since).
    let process =
        || Rls::new(Arc::clone(&store), RlsConfig::parse("s.yaml", config).unwrap(), None, b"unit-test-secret-0123");
    let s = ratewall_core::SECOND;
    let minute = 1_000 * 3600 * s;
    let hit = Call {
        domain: "s".into(),
        descriptors: vec![Descriptor { entries: vec![("slide".into(), "x".into())], ..Default::default() }],
        hits_addend: 0,
    };
    let mut look = hit.clone();
    look.descriptors[0].hits_addend = Some(0);
    let at = |t: u64| store.kv.now.store(minute + t, Ordering::Relaxed);
    let ask = |c: &Call| {
        let c = c.clone();
        let r = process();
        async move {
            let a = r.should_rate_limit(&c).await.unwrap();
            (a.statuses[0].limit_remaining, a.statuses[0].duration_until_reset.unwrap() / s)
        }
    };
    // Two hits at :50.5 of a minute: they weigh on the next minute until past its half.
    let ms = s / 1000;
    at(50 * s + 500 * ms);
    assert_eq!(ask(&hit).await, (1, 10), "one unit: gone just after the window's end");
    assert_eq!(ask(&hit).await, (0, 40));
    at(89 * s + 500 * ms);
    assert_eq!(ask(&look).await.0, 1, "not restored 39 s later");
    at(90 * s + 500 * ms);
    assert_eq!(ask(&look).await, (2, 0), "restored 40 s later, as said");
}

/// Two quotas (one of them shadow) beside an enforced limit, decided at Redis.
const QUOTAS: &str = "domain: q
descriptors:
  - key: plain
    rate_limit: {unit: hour, requests_per_unit: 1, exact: true}
  - key: backend
    value: primary
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1, exact: true}
  - key: backend
    value: fallback
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 2, exact: true}
  - key: backend
    value: trial
    quota_mode: true
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 0}
";

fn quotas() -> Rls<FakeKv> {
    let kv = FakeKv::default();
    kv.now.store(1_000 * 3600 * ratewall_core::SECOND, Ordering::Relaxed);
    let store = Arc::new(Store::new(kv, b"unit-test-secret-0123", Duration::from_secs(1)));
    Rls::new(store, RlsConfig::parse("q.yaml", QUOTAS).unwrap(), None, b"unit-test-secret-0123")
}

fn in_domain(domain: &str, mut c: Call) -> Call {
    c.domain = domain.into();
    c
}

fn codes(a: &Answer) -> Vec<Code> {
    a.statuses.iter().map(|s| s.code).collect()
}

#[tokio::test]
async fn a_quota_over_its_limit_says_so_and_denies_only_with_every_other_quota_over() {
    use Code::{Ok as OK, OverLimit as OVER};
    let r = quotas();
    let both = || in_domain("q", call(&[&[("backend", "primary")], &[("backend", "fallback")]]));
    let a = r.should_rate_limit(&both()).await.unwrap();
    assert_eq!((a.overall_code, codes(&a)), (OK, vec![OK, OK]));
    // The primary's quota is spent: its status says so, the call goes on (the fallback has
    // room), and only the fallback counts it.
    let a = r.should_rate_limit(&both()).await.unwrap();
    assert_eq!((a.overall_code, codes(&a), remaining(&a)), (OK, vec![OVER, OK], vec![0, 0]));
    assert!(a.headers.iter().all(|(k, _)| *k != "Retry-After"), "{:?}", a.headers);
    let policy = &a.headers.iter().find(|(k, _)| *k == "RateLimit-Policy").unwrap().1;
    assert_eq!(policy, "\"q.backend_fallback\";q=2;w=3600", "the quota over its limit is not a policy of the call");
    // Every quota of the call over: over the limit, charging nothing.
    let a = r.should_rate_limit(&both()).await.unwrap();
    assert_eq!((a.overall_code, codes(&a)), (OVER, vec![OVER, OVER]));
    assert!(a.headers.iter().any(|(k, v)| *k == "Retry-After" && v == "3600"), "{:?}", a.headers);
    // A quota alone is every quota of its call.
    let a = r.should_rate_limit(&in_domain("q", call(&[&[("backend", "primary")]]))).await.unwrap();
    assert_eq!((a.overall_code, codes(&a)), (OVER, vec![OVER]));
    // A shadow quota over its limit answers OK and counts as a quota with room.
    let shadowed = in_domain("q", call(&[&[("backend", "primary")], &[("backend", "trial")]]));
    let a = r.should_rate_limit(&shadowed).await.unwrap();
    assert_eq!((a.overall_code, codes(&a)), (OK, vec![OVER, OK]));
    // An enforced limit over denies whatever the quotas say; quotas do not make a call over
    // while one has room.
    let mixed = || in_domain("q", call(&[&[("plain", "p")], &[("backend", "primary")], &[("backend", "trial")]]));
    let a = r.should_rate_limit(&mixed()).await.unwrap();
    assert_eq!((a.overall_code, codes(&a)), (OK, vec![OK, OVER, OK]));
    let a = r.should_rate_limit(&mixed()).await.unwrap();
    assert_eq!((a.overall_code, codes(&a)), (OVER, vec![OVER, OVER, OK]));
    let policy = &a.headers.iter().find(|(k, _)| *k == "RateLimit-Policy").unwrap().1;
    assert_eq!(policy, "\"q.plain\";q=1;w=3600", "denied for the enforced limit alone");
}

#[tokio::test]
async fn denied_calls_are_heard_among_the_top_offenders_by_readable_keys_and_secrets_by_hash() {
    use crate::top::Window;
    let r = rls();
    let alice = call(&[&[("ip", "10.0.0.1")], &[("user", "alice")]]);
    for _ in 0..3 {
        assert_eq!(r.should_rate_limit(&alice).await.unwrap().overall_code, Code::Ok);
    }
    for _ in 0..2 {
        assert_eq!(r.should_rate_limit(&alice).await.unwrap().overall_code, Code::OverLimit);
    }
    // A shadow limit over: would deny.
    for _ in 0..2 {
        r.should_rate_limit(&call(&[&[("shadow", "s")]])).await.unwrap();
    }
    r.should_rate_limit(&call(&[&[("banned", "x")]])).await.unwrap();
    // Secret values: an API key's (secret by its name) and one marked `secret: true`.
    r.should_rate_limit(&call(&[&[("X-Api-Key", "k-123456")]])).await.unwrap();
    r.should_rate_limit(&call(&[&[("buyer", "b-654321")]])).await.unwrap();
    let v = r.store.top.top(None, Window::Minute);
    let text = v.to_string();
    assert!(!text.contains("k-123456") && !text.contains("b-654321"), "{text}");
    let rules = v["rules"].as_array().unwrap();
    let names: Vec<&str> = rules.iter().map(|r| r["rule"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["d.user", "per-ip", "d.shadow", "d.banned", "d.plain", "d.X-Api-Key", "d.buyer"],
        "in the configuration's order, every rule that limits (one no call was heard for with nothing counted)"
    );
    let hashed = |v: &str| {
        let mut s = String::new();
        ratewall_core::key::push_hashed(&mut s, r.hash_key.hash(v.as_bytes()));
        s
    };
    let user = &rules[0];
    assert_eq!((user["allowed"].clone(), user["denied"].clone()), (json!(3), json!(2)));
    // Her 3 admitted calls before her first denial count for her.
    assert_eq!(user["top"][0], json!({"key": "user=alice", "denied": 2, "allowed": 3, "nodes": 1}));
    // The address's limit had room: it admitted 3 and denied nothing (the 2 denied calls were
    // given back to it).
    assert_eq!((rules[1]["allowed"].clone(), rules[1]["denied"].clone()), (json!(3), json!(0)));
    assert_eq!(rules[1]["top"], json!([]));
    assert_eq!((rules[2]["allowed"].clone(), rules[2]["shadow_denied"].clone()), (json!(1), json!(1)));
    assert_eq!(rules[2]["top"][0]["key"], json!("shadow=s"));
    assert_eq!(rules[3]["top"][0]["key"], json!("banned=x"));
    assert_eq!(
        (rules[4]["allowed"].clone(), rules[4]["denied"].clone(), rules[4]["top"].clone()),
        (json!(0), json!(0), json!([]))
    );
    assert_eq!(rules[5]["top"][0]["key"], json!(format!("X-Api-Key={}", hashed("k-123456"))));
    assert_eq!(rules[6]["top"][0]["key"], json!(format!("buyer={}", hashed("b-654321"))));
    // The same counts per second, for the dashboard.
    let series = r.store.top.series(Some("d.user"));
    assert_eq!(series["rules"][0]["denied"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).sum::<u64>(), 2);
}

#[tokio::test]
async fn overrides_are_one_top_rule_per_domain() {
    let r = rls();
    for user in ["u1", "u2"] {
        let mut c = call(&[&[("user", user)]]);
        c.descriptors[0].limit = Some((0, Unit::Minute.proto()));
        assert_eq!(r.should_rate_limit(&c).await.unwrap().overall_code, Code::OverLimit);
    }
    let v = r.store.top.top(None, crate::top::Window::Minute);
    let rules = v["rules"].as_array().unwrap();
    let o = rules.last().unwrap();
    assert_eq!(o["rule"], "d (override)", "after the configured rules: {v}");
    assert_eq!(o["denied"], 2);
    assert_eq!(o["top"].as_array().unwrap().len(), 2);
    assert!(rules[..rules.len() - 1].iter().all(|r| r["denied"] == 0 && r["allowed"] == 0), "{v}");
}

/// A call refused on a grant's spent fixed window is told the window's end both ways: its
/// `Retry-After` and its quota's reset (`duration_until_reset`, `RateLimit`'s `t`), which
/// Envoy hands on as `x-ratelimit-reset`: a client that read 1 s there was refused again.
#[tokio::test]
async fn a_refused_calls_reset_is_not_before_its_retry_after() {
    let config = "domain: h
descriptors:
  - key: hold
    rate_limit: {unit: minute, requests_per_unit: 5}
";
    let store = rls().store;
    let r = Rls::new(Arc::clone(&store), RlsConfig::parse("h.yaml", config).unwrap(), None, b"unit-test-secret-0123");
    let s = ratewall_core::SECOND;
    store.kv.now.store(1_000 * 3600 * s + 3 * s, Ordering::Relaxed);
    let hold = Call {
        domain: "h".into(),
        descriptors: vec![Descriptor { entries: vec![("hold".into(), "x".into())], ..Default::default() }],
        hits_addend: 0,
    };
    let mut other = hold.clone();
    other.descriptors[0].entries[0].1 = "y".into();
    // Redis answered (a call) and the process is noted as present: a new counter is spent on
    // an initial share, reported with the next flush.
    assert_eq!(r.should_rate_limit(&other).await.unwrap().overall_code, Code::Ok);
    lease::flush(&r).await;
    for i in 0..5 {
        assert_eq!(r.should_rate_limit(&hold).await.unwrap().overall_code, Code::Ok);
        if i == 2 {
            lease::flush(&r).await;
        }
    }
    for _ in 0..2 {
        let a = r.should_rate_limit(&hold).await.unwrap();
        assert_eq!(a.overall_code, Code::OverLimit);
        let header = |name: &str| a.headers.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone());
        assert_eq!(header("Retry-After").as_deref(), Some("57"));
        assert_eq!(a.statuses[0].duration_until_reset, Some(57 * s), "{:?}", a.headers);
        assert!(header("RateLimit").is_some_and(|v| v.ends_with(";r=0;t=57")), "{:?}", a.headers);
    }
}

/// A refused call's wait takes what the other processes' grants hold as spent: they may be, and
/// reach Redis only with those processes' next batches. Counting those grants free once their
/// leases end, a call refused with 20 s of the window left was told 1-2 s, and refused again.
#[test]
fn a_refused_calls_wait_counts_the_other_processes_grants_as_spent() {
    let s = ratewall_core::SECOND;
    let limit = Limit::new(ratewall_core::Algorithm::FixedWindow, 50, 60 * s, None).unwrap();
    let start = 1_000 * 3600 * s + 40 * s;
    let mut c = Counter::new(limit);
    let a = c.report_counted(limit, (start, start), (1, 1, 40), 10 * s, true);
    // Process 1 counted 40 and holds the other 10.
    assert_eq!(a.grant, 10, "{a:?}");
    let wait = super::retry_after(&c, start + 10_000_000, 1, (2, 0)).unwrap();
    assert!(wait >= 19 * s, "{wait}: the window's end, 20 s on");
    // The process holding the grant waits as before: its own are counted as what it spent.
    assert!(super::retry_after(&c, start, 1, (1, 10)).unwrap() >= 19 * s);
}

/// Two service processes on one store, both noted present (an initial share is half the
/// bucket), serving a token bucket of 10 an hour on `tok`.
async fn two_processes_on_a_bucket(deadline: Duration) -> (Arc<Store<FakeKv>>, Rls<FakeKv>, Rls<FakeKv>) {
    const BUCKET: &str = "domain: t
descriptors:
  - key: tok
    rate_limit: {unit: hour, requests_per_unit: 10, algorithm: token_bucket}
";
    let kv = FakeKv::default();
    kv.now.store(1_000 * 3600 * ratewall_core::SECOND, Ordering::Relaxed);
    let store = Arc::new(Store::new(kv, b"unit-test-secret-0123", deadline));
    let process =
        || Rls::new(Arc::clone(&store), RlsConfig::parse("t.yaml", BUCKET).unwrap(), None, b"unit-test-secret-0123");
    let (r, other) = (process(), process());
    lease::flush(&r).await;
    lease::flush(&other).await;
    lease::flush(&r).await;
    (store, r, other)
}

/// A call of `hits` on the bucket of [`two_processes_on_a_bucket`] (0: a look).
fn tok(hits: u64) -> Call {
    let mut c = call(&[&[("tok", "v")]]);
    c.domain = "t".into();
    c.descriptors[0].hits_addend = Some(hits);
    c
}

/// A call of more hits than this process's grant holds spends what the grant holds and asks
/// Redis for the rest only: its own grant is held against its ask, so asked for whole, a call
/// of 9 on a token bucket of 10 after a call of 1, on one of two processes, was refused with
/// the 9 free. Refused, the part it took goes back to the grant.
#[tokio::test]
async fn a_call_its_grant_cannot_pay_whole_asks_only_for_the_rest() {
    let (_store, r, other) = two_processes_on_a_bucket(Duration::from_secs(1)).await;
    let first = r.should_rate_limit(&tok(1)).await.unwrap();
    assert_eq!((first.overall_code, remaining(&first)), (Code::Ok, vec![9]));
    let nine = r.should_rate_limit(&tok(9)).await.unwrap();
    assert_eq!((nine.overall_code, remaining(&nine)), (Code::Ok, vec![0]), "{:?}", nine.headers);
    let over = r.should_rate_limit(&tok(1)).await.unwrap();
    assert_eq!(over.overall_code, Code::OverLimit);
    // At the other process too, once this one's units are counted and its note of the
    // counter as spent read there.
    lease::flush(&r).await;
    lease::flush(&other).await;
    assert_eq!(other.should_rate_limit(&tok(1)).await.unwrap().overall_code, Code::OverLimit);
}

/// A call refused by its ask gives back what it took from the grant: the grant pays the calls
/// after it.
#[tokio::test]
async fn a_refused_ask_gives_its_grants_part_back() {
    let (_store, r, other) = two_processes_on_a_bucket(Duration::from_secs(1)).await;
    assert_eq!(r.should_rate_limit(&tok(1)).await.unwrap().overall_code, Code::Ok);
    // More than the bucket holds: refused, nothing taken.
    assert_eq!(r.should_rate_limit(&tok(10)).await.unwrap().overall_code, Code::OverLimit);
    lease::flush(&r).await;
    assert_eq!(
        remaining(&other.should_rate_limit(&tok(0)).await.unwrap()),
        [9],
        "only the first call's unit is counted"
    );
    let nine = r.should_rate_limit(&tok(9)).await.unwrap();
    assert_eq!((nine.overall_code, remaining(&nine)), (Code::Ok, vec![0]));
}

/// A call dropped at its deadline while it asks (answered UNAVAILABLE) gives back what it took
/// from its grant: before, that part was reported with the next batch, as if admitted.
#[tokio::test]
async fn a_call_answered_unavailable_gives_its_grants_part_back() {
    let (store, r, other) = two_processes_on_a_bucket(Duration::from_millis(50)).await;
    assert_eq!(r.should_rate_limit(&tok(1)).await.unwrap().overall_code, Code::Ok);
    lease::flush(&r).await;
    // The ask's reply comes after the call's deadline.
    store.kv.cas_reply_delay_ms.store(200, Ordering::Relaxed);
    assert!(matches!(r.should_rate_limit(&tok(9)).await, Err(Refusal::Unavailable(_))));
    store.kv.cas_reply_delay_ms.store(0, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(250)).await;
    lease::flush(&r).await;
    let left = remaining(&other.should_rate_limit(&tok(0)).await.unwrap());
    // The first call's unit is counted, and (written, answered late) the ask's rest; not the
    // part the call took from its grant.
    assert!(left[0] >= 4, "{left:?}");
}
