//! The client contract: from an [`Outcome`] to a status, headers and body.
//!
//! - Rejected: `429`, `Retry-After` (whole seconds, rounded up), `RateLimit-Policy` and
//!   `RateLimit` in the Structured Fields syntax of draft-ietf-httpapi-ratelimit-headers
//!   (`"name";q=10;w=60`, `"name";r=0;t=42`) for every violated policy, optional legacy
//!   `X-RateLimit-*`, and an RFC 9457 `application/problem+json` body.
//! - Allowed: the same fields for every enforcing policy that decided, the most restrictive
//!   first (the legacy fields are its).
//! - A `closed` rule whose store failed: `503` with `Retry-After: 1` and a problem body.

use crate::algo::{Algorithm, Decision, Limit, Nanos, SECOND};
use crate::eval::{CheckResult, Outcome};
pub use crate::field::{ceil_secs, policy_item, push_state_item};
use crate::field::{pers_in_whole_seconds, policy_quota, push_policy_item, window_secs};
use crate::rules::{Config, Mode, Rule};
use crate::text::decimal;
pub use crate::text::{digits, push_decimal};
use alloc::string::String;
use alloc::vec::Vec;

/// The problem type for an exceeded quota (IANA HTTP Problem Types registry).
pub const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// What to send: for `status == 200` the request goes on to the origin and `headers` are
/// added to the origin's response; otherwise it is a local reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// 200 (pass), 429 (limited) or 503 (closed rule, store failed).
    pub status: u16,
    /// Header fields, names in canonical case.
    pub headers: Vec<(&'static str, String)>,
    /// The problem+json body of a local reply; empty when passing.
    pub body: String,
}

impl Reply {
    /// Whether the request goes on to the origin.
    pub fn passes(&self) -> bool {
        self.status == 200
    }
}

/// The order an allowed request's policies are listed in: the most restrictive first (least
/// remaining, then longest until reset).
pub fn most_restrictive_first(a: &Decision, b: &Decision) -> core::cmp::Ordering {
    a.remaining.cmp(&b.remaining).then(b.reset_after.cmp(&a.reset_after))
}

/// Renders the reply for an outcome.
pub fn render(config: &Config, outcome: &Outcome) -> Reply {
    let decided = || {
        outcome.checks.iter().filter_map(|c| match c.result {
            CheckResult::Decided(d) if c.mode == Mode::Enforce => Some((c, d)),
            _ => None,
        })
    };
    if !outcome.rejected {
        // Every enforcing policy, the most restrictive first.
        let mut policies: Vec<(&Rule, &Limit, Decision)> =
            decided().filter_map(|(c, d)| Some((config.rules.get(c.rule)?, &c.limit, d))).collect();
        policies.sort_by(|(_, _, a), (_, _, b)| most_restrictive_first(a, b));
        let mut headers = Vec::with_capacity(2);
        fields(&mut headers, config, &policies, 0);
        return Reply { status: 200, headers, body: String::new() };
    }
    let violated: Vec<(&Rule, &Limit, Decision)> = decided()
        .filter(|(_, d)| !d.allowed)
        .filter_map(|(c, d)| Some((config.rules.get(c.rule)?, &c.limit, d)))
        .collect();
    if violated.is_empty() {
        // Only a `closed` rule whose store failed.
        let failed: Vec<&str> = outcome
            .checks
            .iter()
            .filter(|c| c.rejects())
            .filter_map(|c| config.rules.get(c.rule).map(|r| r.name.as_str()))
            .collect();
        // Built by hand like the 429 body below: rule names need no escaping.
        let mut body = String::from(
            "{\"type\":\"about:blank\",\"title\":\"Service Unavailable\",\"status\":503,\"detail\":\"The rate limiter's counter store is unavailable and these policies fail closed.\",\"policies\":[",
        );
        for (i, n) in failed.iter().enumerate() {
            body.push_str(if i > 0 { ",\"" } else { "\"" });
            body.push_str(n);
            body.push('"');
        }
        body.push_str("]}");
        let headers =
            alloc::vec![("Retry-After", String::from("1")), ("Content-Type", String::from("application/problem+json"))];
        return Reply { status: 503, headers, body };
    }
    let wait = |(_, l, d): &(&Rule, &Limit, Decision)| d.retry_after.map_or(window_secs(l), ceil_secs).max(1);
    let retry = violated.iter().map(wait).max().unwrap_or(1);
    let mut headers = alloc::vec![("Retry-After", decimal(retry))];
    // The legacy fields are the policy's that sets `Retry-After` (the first of them): a client
    // that retries at its `X-RateLimit-Reset` is not refused by another.
    let legacy = violated.iter().position(|v| wait(v) == retry).unwrap_or(0);
    fields(&mut headers, config, &violated, legacy);
    headers.push(("Content-Type", String::from("application/problem+json")));
    // Built by hand: rule names are validated to [A-Za-z0-9_.-], so nothing needs escaping,
    // and this is several times cheaper than building a serde_json::Value.
    let mut names = String::new();
    let mut list = String::new();
    for (i, (rule, _, _)) in violated.iter().enumerate() {
        let n = rule.name.as_str();
        let sep = if i > 0 { ", " } else { "" };
        names.push_str(sep);
        names.push_str(n);
        list.push_str(if i > 0 { ",\"" } else { "\"" });
        list.push_str(n);
        list.push('"');
    }
    let mut body = String::with_capacity(300);
    body.push_str("{\"type\":\"");
    body.push_str(QUOTA_EXCEEDED);
    body.push_str(
        "\",\"title\":\"Request cannot be satisfied as assigned quota has been exceeded\",\"status\":429,\"detail\":\"",
    );
    if violated.iter().any(|(_, _, d)| d.retry_after.is_none()) {
        body.push_str("The request costs more than policy ");
        body.push_str(&names);
        body.push_str(" can ever admit.");
    } else {
        body.push_str("Quota exceeded for policy ");
        body.push_str(&names);
        body.push_str("; retry after ");
        push_decimal(&mut body, retry);
        body.push_str(" s.");
    }
    body.push_str("\",\"violated-policies\":[");
    body.push_str(&list);
    body.push_str("]}");
    Reply { status: 429, headers, body }
}

/// Appends `RateLimit-Policy`, `RateLimit` and, when enabled, the legacy fields of
/// `policies[legacy]` (its `q` as `X-RateLimit-Limit`).
fn fields(
    headers: &mut Vec<(&'static str, String)>,
    config: &Config,
    policies: &[(&Rule, &Limit, Decision)],
    legacy: usize,
) {
    if policies.is_empty() {
        return;
    }
    // Sized for one or two policies, so the pushes below do not reallocate.
    let mut policy = String::with_capacity(64 * policies.len());
    let mut state = String::with_capacity(64 * policies.len());
    for (i, (rule, limit, d)) in policies.iter().enumerate() {
        let name = rule.name.as_str();
        if i > 0 {
            policy.push_str(", ");
            state.push_str(", ");
        }
        if limit.algorithm() == Algorithm::LeakyBucket {
            push_leaky_item(&mut policy, name, d.limit, limit);
        } else if **limit == rule.limit && d.limit == limit.quota() {
            // Under the rule's default limit the item was rendered when the rules were loaded.
            policy.push_str(&rule.policy_item);
        } else {
            push_policy_item(&mut policy, name, d.limit, limit);
        }
        push_state_item(&mut state, name, d.remaining, shown_reset(d));
    }
    headers.push(("RateLimit-Policy", policy));
    headers.push(("RateLimit", state));
    if config.response.legacy_headers {
        if let Some((_, limit, d)) = policies.get(legacy) {
            let q = if limit.algorithm() == Algorithm::LeakyBucket {
                leaky_policy(limit, d.limit).0
            } else if limit.algorithm() == Algorithm::Concurrent {
                d.limit
            } else {
                policy_quota(d.limit, limit).0
            };
            headers.push(("X-RateLimit-Limit", decimal(q)));
            headers.push(("X-RateLimit-Remaining", decimal(d.remaining)));
            headers.push(("X-RateLimit-Reset", decimal(ceil_secs(shown_reset(d)))));
        }
    }
}

/// The reset a decision's fields show: a denial's no sooner than its `Retry-After`, whose
/// wait carries the lag of the store's view past the quota's own reset (a sliding log's 429
/// said `Retry-After: 75` beside `t=67`).
fn shown_reset(d: &Decision) -> Nanos {
    match (d.allowed, d.retry_after) {
        (false, Some(retry)) => d.reset_after.max(retry),
        _ => d.reset_after,
    }
}

/// A leaky bucket's `RateLimit-Policy` quota and window in whole seconds, `(q, w)`: the rate
/// it drains at, `requests` per `per`, over the fewest whole `per`s that make whole seconds
/// and drain the `held` units it takes at once (its queue and the request served; on a host
/// where requests cannot wait, `delay + 1`), at least `requests`. So `q / w` is the rate, and
/// `RateLimit`'s `r`, which counts places in the bucket, is never above `q`:
/// `{"requests": 2, "per": "1s", "burst": 12}` is `q=14;w=7`.
fn leaky_policy(limit: &Limit, held: u64) -> (u64, u64) {
    let (requests, per, second) =
        (u128::from(limit.requests().max(1)), u128::from(limit.per().max(1)), u128::from(SECOND));
    // `k` times `per` is whole seconds when `k` is a multiple of `step`.
    let step = u128::from(pers_in_whole_seconds(limit.per()));
    let k = u128::from(held.max(1)).div_ceil(requests).div_ceil(step).saturating_mul(step);
    let whole = |v: u128| u64::try_from(v).unwrap_or(u64::MAX);
    (whole(k.saturating_mul(requests)), whole(k.saturating_mul(per) / second))
}

/// Appends a leaky bucket's `RateLimit-Policy` item ([`leaky_policy`]).
fn push_leaky_item(out: &mut String, name: &str, held: u64, limit: &Limit) {
    let (q, w) = leaky_policy(limit, held);
    // Rule names are validated to [A-Za-z0-9_.-], so they need no escaping in sf-string.
    out.push('"');
    out.push_str(name);
    out.push_str("\";q=");
    push_decimal(out, q);
    out.push_str(";w=");
    push_decimal(out, w);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::{evaluate, MemoryCounters, Request};
    use alloc::format;

    /// The `RateLimit-Policy` and `RateLimit` fields of `n` requests at one instant to a fresh
    /// key of a rule with `limit`.
    fn fields_of(limit: &str, n: usize) -> Vec<(u16, String, String)> {
        let doc = format!(
            r#"{{"identity":{{"user":{{"header":"x-user-id"}}}},"rules":[{{"name":"l","key":["user"],"limit":{limit}}}]}}"#
        );
        let config = Config::parse(doc.as_bytes()).unwrap();
        let mut counters = MemoryCounters::default();
        let headers = [Some(&b"ann"[..])];
        let req = Request { method: "GET", path: "/", headers: &headers, ip: None };
        (0..n)
            .map(|_| {
                let (checks, _) = config.checks(&req);
                let reply = render(&config, &evaluate(&config, &checks, &mut counters, 1_700_000_000 * SECOND));
                let field = |name: &str| reply.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone());
                (reply.status, field("RateLimit-Policy").unwrap_or_default(), field("RateLimit").unwrap_or_default())
            })
            .collect()
    }

    /// A denial's reset is shown no sooner than its `Retry-After` (a node's wait, longer by the
    /// lag of its view of the store); an admission's, and a denial that never fits, as they are.
    #[test]
    fn a_denials_reset_is_shown_no_sooner_than_its_retry_after() {
        let denied = Decision {
            allowed: false,
            limit: 5,
            remaining: 0,
            reset_after: 67 * SECOND,
            retry_after: Some(75 * SECOND),
        };
        assert_eq!(shown_reset(&denied), 75 * SECOND);
        assert_eq!(shown_reset(&Decision { retry_after: Some(SECOND), ..denied }), 67 * SECOND);
        assert_eq!(shown_reset(&Decision { retry_after: None, ..denied }), 67 * SECOND);
        assert_eq!(shown_reset(&Decision { allowed: true, remaining: 1, retry_after: None, ..denied }), 67 * SECOND);
    }

    /// The legacy fields agree with the standard ones: a leaky bucket's `X-RateLimit-Limit`
    /// is its policy's `q`, and on a 429 that breaks two rules they are the rule's that sets
    /// `Retry-After` (they were the first rule's, whose reset came 17 s before it).
    #[test]
    fn the_legacy_fields_are_those_of_the_policy_they_stand_for() {
        let doc = r#"{"identity":{"user":{"header":"x-user-id"}},"response":{"legacy_headers":true},"rules":[
            {"name":"lb","match":{"path":"/lb"},"key":["user"],"algorithm":"leaky_bucket","limit":{"requests":2,"per":"1s","burst":12}},
            {"name":"a","match":{"path":"/two"},"key":["user"],"algorithm":"sliding_window","limit":{"requests":1,"per":"3s"}},
            {"name":"b","match":{"path":"/two"},"key":["user"],"algorithm":"token_bucket","limit":{"requests":1,"per":"20s"}}]}"#;
        let config = Config::parse(doc.as_bytes()).unwrap();
        let mut counters = MemoryCounters::default();
        let headers = [Some(&b"ann"[..])];
        let mut send = |path: &str| {
            let req = Request { method: "GET", path, headers: &headers, ip: None };
            let (checks, _) = config.checks(&req);
            render(&config, &evaluate(&config, &checks, &mut counters, 1_700_000_000 * SECOND))
        };
        let field = |r: &Reply, name: &str| r.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone());
        let r = send("/lb");
        assert_eq!(field(&r, "RateLimit-Policy").as_deref(), Some(r#""lb";q=14;w=7"#));
        assert_eq!(field(&r, "X-RateLimit-Limit").as_deref(), Some("14"));
        assert_eq!(send("/two").status, 200);
        let r = send("/two");
        assert_eq!(r.status, 429);
        assert_eq!(field(&r, "Retry-After").as_deref(), Some("20"));
        assert_eq!(
            (field(&r, "X-RateLimit-Limit"), field(&r, "X-RateLimit-Reset")),
            (Some("1".into()), Some("20".into()))
        );
    }

    #[test]
    fn a_leaky_buckets_policy_is_its_drain_rate_over_a_window_its_queue_fits_in() {
        for (limit, policy) in [
            (r#"{"requests":2,"per":"1s","burst":12,"algorithm":"leaky_bucket"}"#, r#""l";q=14;w=7"#),
            (r#"{"requests":1,"per":"1s","burst":12,"delay":8,"algorithm":"leaky_bucket"}"#, r#""l";q=13;w=13"#),
            (r#"{"requests":5,"per":"1s","burst":5,"algorithm":"leaky_bucket"}"#, r#""l";q=10;w=2"#),
            (r#"{"requests":5,"per":"1s","burst":10,"delay":3,"algorithm":"leaky_bucket"}"#, r#""l";q=15;w=3"#),
            // A queue within `requests`: the rule's own window, as a sliding window's.
            (r#"{"requests":60,"per":"60s","burst":2,"algorithm":"leaky_bucket"}"#, r#""l";q=60;w=60"#),
            // Whole `per`s that are whole seconds: 10 a second, 2 a second.
            (r#"{"requests":5,"per":"500ms","algorithm":"leaky_bucket"}"#, r#""l";q=10;w=1"#),
            (r#"{"requests":3,"per":"1500ms","burst":4,"algorithm":"leaky_bucket"}"#, r#""l";q=6;w=3"#),
        ] {
            let seen = fields_of(limit, 20);
            assert!(seen.iter().any(|(status, _, _)| *status == 429), "{limit}: the queue fills");
            let q: u64 = policy.split(";q=").nth(1).and_then(|s| s.split(';').next()?.parse().ok()).unwrap();
            for (status, p, state) in &seen {
                assert_eq!(p, policy, "{limit}, status {status}");
                let r: u64 = state.split(";r=").nth(1).and_then(|s| s.split(';').next()?.parse().ok()).unwrap();
                assert!(r <= q, "{limit}: r={r} above q={q}");
            }
        }
    }

    #[test]
    fn a_counting_policy_of_a_per_that_is_not_whole_seconds_states_its_rate() {
        for (limit, policy) in [
            (r#"{"requests":5,"per":"500ms"}"#, r#""l";q=10;w=1"#),
            (r#"{"requests":5,"per":"500ms","algorithm":"sliding_log"}"#, r#""l";q=10;w=1"#),
            (r#"{"requests":5,"per":"1500ms","algorithm":"fixed_window"}"#, r#""l";q=10;w=3"#),
            (r#"{"requests":5,"per":"250ms","algorithm":"token_bucket"}"#, r#""l";q=20;w=1"#),
            // A burst above the rate over that window is still taken at once.
            (r#"{"requests":5,"per":"500ms","burst":30}"#, r#""l";q=30;w=1"#),
            // Whole seconds: as the rule says.
            (r#"{"requests":5,"per":"2s","algorithm":"fixed_window"}"#, r#""l";q=5;w=2"#),
        ] {
            let seen = fields_of(limit, 40);
            assert!(seen.iter().any(|(status, _, _)| *status == 429), "{limit}: the limit is reached");
            for (status, p, state) in &seen {
                assert_eq!(p, policy, "{limit}, status {status}");
                let r: u64 = state.split(";r=").nth(1).and_then(|s| s.split(';').next()?.parse().ok()).unwrap();
                assert!(r <= 30, "{limit}: r={r}");
            }
        }
    }

    #[test]
    fn digits_match_core_fmt_at_every_width() {
        let mut values =
            alloc::vec![0, 9, 10, 99, 100, 101, 999, u64::from(u32::MAX), u64::from(u32::MAX) + 1, u64::MAX];
        let mut p = 1u64;
        while let Some(next) = p.checked_mul(10) {
            values.extend([p - 1, p, p + 1, next / 3]);
            p = next;
        }
        for v in values {
            let mut buf = [0u8; 20];
            assert_eq!(digits(v, &mut buf), format!("{v}").as_bytes(), "{v}");
            let mut s = String::from("x");
            push_decimal(&mut s, v);
            assert_eq!(s, format!("x{v}"));
        }
    }
}
