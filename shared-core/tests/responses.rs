//! The client contract, end to end through the core: evaluate the example rules (examples/rules.json),
//! render, and read the fields back with an independent Structured Fields parser.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_core::glob::normalize_path;
use ratewall_core::{evaluate, render, Config, MemoryCounters, Nanos, Reply, Request, SECOND};
use sfv::{BareItem, List, ListEntry, Parser};

const RULES: &str = include_str!("../../examples/rules.json");
const T0: Nanos = 1_700_000_000 * SECOND;

fn call(
    c: &Config,
    m: &mut MemoryCounters,
    method: &str,
    path: &str,
    hdrs: &[(&str, &str)],
    ip: Option<&str>,
    now: Nanos,
) -> Reply {
    let values: Vec<Option<&[u8]>> =
        c.identity.headers.iter().map(|(_, h)| hdrs.iter().find(|(n, _)| n == h).map(|(_, v)| v.as_bytes())).collect();
    let path = normalize_path(path.as_bytes());
    let req = Request { method, path: &path, headers: &values, ip };
    let (checks, _) = c.checks(&req);
    let outcome = evaluate(c, &checks, m, now);
    render(c, &outcome)
}

fn header<'a>(r: &'a Reply, name: &str) -> Option<&'a str> {
    r.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

/// Parses a List field and returns, per member, its string and integer parameters.
fn sf_list(value: &str) -> Vec<(String, Vec<(String, i64)>)> {
    let list: List = Parser::new(value).parse().expect("a valid Structured Fields List");
    list.into_iter()
        .map(|e| match e {
            ListEntry::Item(item) => {
                let name = match &item.bare_item {
                    BareItem::String(s) => s.as_str().to_owned(),
                    other => panic!("policy name must be an sf-string, got {other:?}"),
                };
                let params = item
                    .params
                    .iter()
                    .map(|(k, v)| (k.as_str().to_owned(), v.as_integer().map(i64::from).expect("integer parameter")))
                    .collect();
                (name, params)
            }
            ListEntry::InnerList(_) => panic!("unexpected inner list"),
        })
        .collect()
}

#[test]
fn allowed_requests_carry_every_enforcing_policy_the_most_restrictive_first() {
    let c = Config::parse(RULES.as_bytes()).unwrap();
    let mut m = MemoryCounters::default();
    let h = [("x-user-id", "alice"), ("x-api-key", "k1")];
    let r = call(&c, &mut m, "POST", "/v1/events/7/holds", &h, None, T0);
    assert_eq!(r.status, 200);
    // holds-per-user (5/60s, 4 left) is tighter than api-key (burst 200): it comes first.
    assert_eq!(
        sf_list(header(&r, "RateLimit-Policy").unwrap()),
        [
            ("holds-per-user".to_owned(), vec![("q".to_owned(), 5), ("w".to_owned(), 60)]),
            ("api-key".to_owned(), vec![("q".to_owned(), 1000), ("w".to_owned(), 60)])
        ]
    );
    let rl = sf_list(header(&r, "RateLimit").unwrap());
    assert_eq!(rl[0].0, "holds-per-user");
    assert_eq!(rl[0].1[0], ("r".to_owned(), 4));
    assert_eq!(rl[1].0, "api-key");
    assert_eq!(rl[1].1[0], ("r".to_owned(), 199));
}

#[test]
fn rejected_requests_get_429_retry_after_and_a_problem() {
    let c = Config::parse(RULES.as_bytes()).unwrap();
    let mut m = MemoryCounters::default();
    let h = [("x-user-id", "bob"), ("x-api-key", "k2")];
    for i in 0..5 {
        assert_eq!(call(&c, &mut m, "POST", "/v1/events/7/holds", &h, None, T0 + i * SECOND).status, 200);
    }
    let now = T0 + 5 * SECOND + SECOND / 3;
    let r = call(&c, &mut m, "POST", "/v1/events/7/holds", &h, None, now);
    assert_eq!(r.status, 429);
    let retry: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
    assert!(retry >= 1);
    let policy = sf_list(header(&r, "RateLimit-Policy").unwrap());
    assert_eq!(policy[0].0, "holds-per-user");
    let state = sf_list(header(&r, "RateLimit").unwrap());
    assert_eq!(state[0].1[0], ("r".to_owned(), 0));
    assert!(state[0].1[1].1 >= retry as i64, "t must not promise less than Retry-After");
    assert_eq!(header(&r, "Content-Type"), Some("application/problem+json"));
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(body["status"], 429);
    assert_eq!(body["type"], ratewall_core::response::QUOTA_EXCEEDED);
    assert_eq!(body["violated-policies"], serde_json::json!(["holds-per-user"]));

    // A client that waits exactly Retry-After is admitted, one second less is not.
    let early = call(&c, &mut m, "POST", "/v1/events/7/holds", &h, None, now + (retry - 1) * SECOND);
    assert_eq!(early.status, 429);
    let on_time = call(&c, &mut m, "POST", "/v1/events/7/holds", &h, None, now + retry * SECOND);
    assert_eq!(on_time.status, 200);
}

#[test]
fn plans_override_and_unlimited_plans_are_not_counted() {
    let c = Config::parse(RULES.as_bytes()).unwrap();
    let mut m = MemoryCounters::default();
    for i in 0..1000 {
        let r = call(&c, &mut m, "GET", "/v1/things", &[("x-api-key", "int"), ("x-plan", "internal")], None, T0 + i);
        assert_eq!(r.status, 200);
        assert!(header(&r, "RateLimit").is_none(), "an unlimited plan has no policy to report");
    }
    let r = call(&c, &mut m, "GET", "/v1/things", &[("x-api-key", "p"), ("x-plan", "partner")], None, T0);
    assert_eq!(sf_list(header(&r, "RateLimit-Policy").unwrap())[0].1[0], ("q".to_owned(), 10000));
    // The default plan's bucket holds a burst of 200.
    let mut admitted = 0;
    for i in 0..300 {
        admitted += u32::from(call(&c, &mut m, "GET", "/v1/things", &[("x-api-key", "free")], None, T0 + i).passes());
    }
    assert_eq!(admitted, 200);
}

#[test]
fn legacy_headers_only_when_enabled() {
    let doc = r#"{"response":{"legacy_headers":true},"rules":[{"name":"ip","key":["ip"],"limit":{"requests":2,"per":"1s"}}]}"#;
    let c = Config::parse(doc.as_bytes()).unwrap();
    let mut m = MemoryCounters::default();
    let r = call(&c, &mut m, "GET", "/", &[], Some("192.0.2.1"), T0);
    assert_eq!(header(&r, "X-RateLimit-Limit"), Some("2"));
    assert_eq!(header(&r, "X-RateLimit-Remaining"), Some("1"));
    let c = Config::parse(RULES.as_bytes()).unwrap();
    let r = call(&c, &mut m, "POST", "/v1/auth/login", &[], Some("192.0.2.1"), T0);
    assert_eq!(header(&r, "X-RateLimit-Limit"), None);
}
