//! Header-field pieces of the client contract that rules are rendered into when they load:
//! whole seconds and `RateLimit-Policy` items. Depends on [`crate::algo`] and
//! [`crate::text`](mod@crate::text) only, so the rules and the response both build on it.

use crate::algo::{Algorithm, Limit, Nanos, SECOND};
use crate::text::push_decimal;
use alloc::string::String;

/// Whole seconds, rounded up.
pub fn ceil_secs(n: Nanos) -> u64 {
    n.div_ceil(SECOND)
}

/// The policy window in whole seconds (at least 1: the field is an integer of seconds).
pub fn window_secs(limit: &Limit) -> u64 {
    ceil_secs(limit.per()).max(1)
}

/// How many `per`s make the fewest whole seconds: 1 for a `per` of whole seconds, 2 for
/// `500ms`, 3 for `1500ms` (`SECOND` over the greatest common divisor of the two).
pub fn pers_in_whole_seconds(per: Nanos) -> u64 {
    let (mut a, mut b) = (per.max(1), SECOND);
    while b != 0 {
        (a, b) = (b, a % b);
    }
    SECOND / a
}

/// A counting policy's `q` and `w` for `quota` units per `limit.per()`: over the fewest whole
/// `per`s that make whole seconds, so that `q / w` is the rate (`{"requests": 5, "per":
/// "500ms"}` is `q=10;w=1`, not `q=5;w=1`, which said half of it). A token bucket's `q`
/// stays `max(requests, burst)` over that window, its `burst` taken at once.
pub fn policy_quota(quota: u64, limit: &Limit) -> (u64, u64) {
    let k = pers_in_whole_seconds(limit.per());
    if k == 1 {
        return (quota, window_secs(limit));
    }
    let w = u64::try_from(u128::from(limit.per()) * u128::from(k) / u128::from(SECOND)).unwrap_or(u64::MAX);
    let q = if limit.algorithm() == Algorithm::TokenBucket && quota == limit.quota() {
        limit.requests().saturating_mul(k).max(limit.capacity())
    } else {
        quota.saturating_mul(k)
    };
    (q, w.max(1))
}

/// A `RateLimit-Policy` item: `"name";q=<quota>;w=<window seconds>` ([`policy_quota`]).
pub fn policy_item(name: &str, quota: u64, limit: &Limit) -> String {
    let mut item = String::with_capacity(name.len() + 32);
    push_policy_item(&mut item, name, quota, limit);
    item
}

/// Appends [`policy_item`] to `out`.
pub fn push_policy_item(out: &mut String, name: &str, quota: u64, limit: &Limit) {
    // Rule names are validated to [A-Za-z0-9_.-], so they need no escaping in sf-string.
    out.push('"');
    out.push_str(name);
    out.push_str("\";q=");
    if limit.algorithm() == Algorithm::Concurrent {
        push_decimal(out, quota);
        out.push_str(";qu=\"concurrent-requests\"");
        return;
    }
    let (q, w) = policy_quota(quota, limit);
    push_decimal(out, q);
    out.push_str(";w=");
    push_decimal(out, w);
}

/// Appends a `RateLimit` item: `"name";r=<remaining>;t=<seconds until reset>`.
pub fn push_state_item(out: &mut String, name: &str, remaining: u64, reset_after: Nanos) {
    out.push('"');
    out.push_str(name);
    out.push_str("\";r=");
    push_decimal(out, remaining);
    out.push_str(";t=");
    push_decimal(out, ceil_secs(reset_after));
}
