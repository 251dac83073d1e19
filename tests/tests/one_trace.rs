//! One trace through every runtime: the same requests through the built filter in the
//! wasmtime host and through the Worker in real workerd, compared request by request on what
//! a client sees — status, `Retry-After`, `RateLimit`, `RateLimit-Policy` and the problem
//! body.
//!
//! Timing-insensitive by construction: every rule is a token bucket over an hour, so a wait
//! is a whole number of 15-minute emission intervals minus the few milliseconds the trace
//! takes, which rounds up to the same second on both. The filter runs on a virtual clock
//! that stands still, the Worker on the real one.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_tests::host::{HttpRequest, Node, Plugin, Vm};
use ratewall_tests::workerd::Workerd;

const RULES: &str = r#"{
  "identity": {"user": {"header": "x-user-id"}, "api_key": {"header": "x-api-key"}, "plan": {"header": "x-plan"}},
  "rules": [
    {"name": "per-user", "match": {"path": "/v1/*"}, "key": ["user"], "limit": {"requests": 4, "per": "1h", "burst": 4}},
    {"name": "per-key", "match": {"path": "/v1/*"}, "key": ["api_key"], "limit": {"requests": 6, "per": "1h", "burst": 6},
     "plans": {"partner": {"requests": 8, "per": "1h", "burst": 8}, "internal": "unlimited"}},
    {"name": "orders", "match": {"path": "/v1/orders", "method": "POST"}, "key": ["api_key", "user"],
     "limit": {"requests": 2, "per": "1h", "burst": 2}},
    {"name": "watch", "match": {"path": "/v1/*"}, "key": ["user"], "mode": "shadow", "limit": {"requests": 1, "per": "1h", "burst": 1}}
  ]
}"#;

/// (method, path, user, api key, plan), in order.
fn trace() -> Vec<(&'static str, &'static str, &'static str, &'static str, &'static str)> {
    let mut t = Vec::new();
    // Composite keys: the third order is denied by "orders" alone, and charges no other rule.
    for _ in 0..3 {
        t.push(("POST", "/v1/orders", "ann", "k1", ""));
    }
    // "per-user" for ann: 4, so two more pass, then 429s naming per-user.
    for _ in 0..3 {
        t.push(("GET", "/v1/things", "ann", "k1", ""));
    }
    // "per-key" for k1 (6): bob's requests run it out.
    for _ in 0..3 {
        t.push(("GET", "/v1/things", "bob", "k1", ""));
    }
    // Plans: a partner key gets 8, an internal one is not limited by per-key.
    for i in 0..9 {
        t.push(("GET", "/v1/things", ["cy", "di", "ed"][i % 3], "k2", "partner"));
    }
    // fay's fifth is denied by per-user: an internal plan lifts only per-key.
    for i in 0..9 {
        t.push(("GET", "/v1/things", ["fay", "gus"][i % 2], "k3", "internal"));
    }
    // No key at all: unkeyed, not counted.
    t.push(("GET", "/v1/things", "", "", ""));
    t
}

/// What a client sees of one answer, in a comparable form.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    status: u16,
    retry_after: Option<String>,
    ratelimit: Option<String>,
    policy: Option<String>,
    body: String,
}

fn headers<'a>(user: &'a str, key: &'a str, plan: &'a str) -> Vec<(&'static str, &'a str)> {
    [("x-user-id", user), ("x-api-key", key), ("x-plan", plan)].into_iter().filter(|(_, v)| !v.is_empty()).collect()
}

#[test]
fn the_filter_and_the_worker_answer_one_trace_the_same_way() {
    let doc = serde_json::from_str::<serde_json::Value>(RULES).unwrap().to_string();
    let node = Node::new(1_700_000_000_000_000_000);
    let mut vm = Vm::start(&Plugin::filter().unwrap(), &node, doc.as_bytes()).unwrap();
    let w = Workerd::start(&[("RATEWALL_RULES", doc.as_str())]).unwrap();
    let mut statuses = Vec::new();
    for (i, (method, path, user, key, plan)) in trace().into_iter().enumerate() {
        let hs = headers(user, key, plan);
        let mut req = HttpRequest::new(method, path);
        for (n, v) in &hs {
            req = req.header(n, v);
        }
        let f = vm.request(&req).unwrap();
        let filter = Seen {
            status: f.status as u16,
            retry_after: f.header("retry-after").map(str::to_owned),
            ratelimit: f.header("ratelimit").map(str::to_owned),
            policy: f.header("ratelimit-policy").map(str::to_owned),
            body: String::from_utf8_lossy(&f.body).into_owned(),
        };
        let r = w.request(method, path, &hs, &[]);
        let worker = Seen {
            status: r.status,
            retry_after: r.header("retry-after").map(str::to_owned),
            ratelimit: r.header("ratelimit").map(str::to_owned),
            policy: r.header("ratelimit-policy").map(str::to_owned),
            // A passing request's body is the origin's, not ratewall's.
            body: if r.status == 200 { String::new() } else { r.text() },
        };
        assert_eq!(filter, worker, "request {i}: {method} {path} user={user} key={key} plan={plan}");
        if filter.status == 429 {
            assert!(filter.retry_after.is_some() && filter.body.contains("violated-policies"), "{filter:?}");
        }
        if filter.status == 200 && !key.is_empty() {
            assert!(filter.ratelimit.is_some() && filter.policy.is_some(), "{filter:?}");
        }
        statuses.push(filter.status);
    }
    // The trace reaches every case: passes, and denials by each enforcing rule.
    let denied = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!((statuses.len(), denied), (28, 5), "{statuses:?}");
}
