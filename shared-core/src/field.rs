//! Header-field pieces of the client contract that rules are rendered into when they load:
//! whole seconds and `RateLimit-Policy` items. Depends on [`crate::algo`] and
//! [`crate::text`](mod@crate::text) only, so the rules and the response both build on it.

use crate::algo::{Limit, Nanos, SECOND};
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

/// A `RateLimit-Policy` item: `"name";q=<quota>;w=<window seconds>`.
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
    push_decimal(out, quota);
    if limit.algorithm() == crate::algo::Algorithm::Concurrent {
        out.push_str(";qu=\"concurrent-requests\"");
        return;
    }
    out.push_str(";w=");
    push_decimal(out, window_secs(limit));
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
