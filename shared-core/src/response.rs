//! The client contract: from an [`Outcome`] to a status, headers and body.
//!
//! - Rejected: `429`, `Retry-After` (whole seconds, rounded up), `RateLimit-Policy` and
//!   `RateLimit` in the Structured Fields syntax of draft-ietf-httpapi-ratelimit-headers
//!   (`"name";q=10;w=60`, `"name";r=0;t=42`) for every violated policy, optional legacy
//!   `X-RateLimit-*`, and an RFC 9457 `application/problem+json` body.
//! - Allowed: the same fields for the most restrictive enforcing policy.
//! - A `closed` rule whose store failed: `503` with `Retry-After: 1` and a problem body.

use crate::algo::{Decision, Limit, Nanos, SECOND};
use crate::eval::{CheckResult, Outcome};
use crate::rules::{Config, Mode};
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt::Write;

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

/// Whole seconds, rounded up.
pub fn ceil_secs(n: Nanos) -> u64 {
    n.div_ceil(SECOND)
}

/// The policy window in whole seconds (at least 1: the field is an integer of seconds).
fn window_secs(limit: &Limit) -> u64 {
    ceil_secs(limit.per()).max(1)
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
        // The most restrictive enforcing policy: least remaining, then longest reset.
        let best =
            decided().min_by(|(_, a), (_, b)| a.remaining.cmp(&b.remaining).then(b.reset_after.cmp(&a.reset_after)));
        let mut headers = Vec::new();
        if let Some((c, d)) = best {
            let name = config.rules.get(c.rule).map_or("", |r| r.name.as_str());
            fields(&mut headers, config, &[(name, &c.limit, d)]);
        }
        return Reply { status: 200, headers, body: String::new() };
    }
    let violated: Vec<(&str, &Limit, Decision)> = decided()
        .filter(|(_, d)| !d.allowed)
        .map(|(c, d)| (config.rules.get(c.rule).map_or("", |r| r.name.as_str()), &c.limit, d))
        .collect();
    if violated.is_empty() {
        // Only a `closed` rule whose store failed.
        let failed: Vec<&str> = outcome
            .checks
            .iter()
            .filter(|c| c.rejects())
            .filter_map(|c| config.rules.get(c.rule).map(|r| r.name.as_str()))
            .collect();
        let body = serde_json::json!({
            "type": "about:blank",
            "title": "Service Unavailable",
            "status": 503,
            "detail": "The rate limiter's counter store is unavailable and these policies fail closed.",
            "policies": failed,
        });
        let headers =
            alloc::vec![("Retry-After", String::from("1")), ("Content-Type", String::from("application/problem+json"))];
        return Reply { status: 503, headers, body: body.to_string() };
    }
    let retry =
        violated.iter().map(|(_, l, d)| d.retry_after.map_or(window_secs(l), ceil_secs).max(1)).max().unwrap_or(1);
    let mut headers = alloc::vec![("Retry-After", format!("{retry}"))];
    fields(&mut headers, config, &violated);
    headers.push(("Content-Type", String::from("application/problem+json")));
    let names: Vec<&str> = violated.iter().map(|(n, _, _)| *n).collect();
    let detail = if violated.iter().any(|(_, _, d)| d.retry_after.is_none()) {
        format!("The request costs more than policy {} can ever admit.", quoted_list(&names))
    } else {
        format!("Quota exceeded for policy {}; retry after {retry} s.", quoted_list(&names))
    };
    let body = serde_json::json!({
        "type": QUOTA_EXCEEDED,
        "title": "Request cannot be satisfied as assigned quota has been exceeded",
        "status": 429,
        "detail": detail,
        "violated-policies": names,
    });
    Reply { status: 429, headers, body: body.to_string() }
}

fn quoted_list(names: &[&str]) -> String {
    let mut s = String::new();
    for (i, n) in names.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "\"{n}\"");
    }
    s
}

/// Appends `RateLimit-Policy`, `RateLimit` and, when enabled, the legacy fields.
fn fields(headers: &mut Vec<(&'static str, String)>, config: &Config, policies: &[(&str, &Limit, Decision)]) {
    if policies.is_empty() {
        return;
    }
    let mut policy = String::new();
    let mut state = String::new();
    for (i, (name, limit, d)) in policies.iter().enumerate() {
        let sep = if i > 0 { ", " } else { "" };
        // Rule names are validated to [A-Za-z0-9_.-], so they need no escaping in sf-string.
        let _ = write!(policy, "{sep}\"{name}\";q={};w={}", d.limit, window_secs(limit));
        let _ = write!(state, "{sep}\"{name}\";r={};t={}", d.remaining, ceil_secs(d.reset_after));
    }
    headers.push(("RateLimit-Policy", policy));
    headers.push(("RateLimit", state));
    if config.response.legacy_headers {
        if let Some((_, _, d)) = policies.first() {
            headers.push(("X-RateLimit-Limit", format!("{}", d.limit)));
            headers.push(("X-RateLimit-Remaining", format!("{}", d.remaining)));
            headers.push(("X-RateLimit-Reset", format!("{}", ceil_secs(d.reset_after))));
        }
    }
}
