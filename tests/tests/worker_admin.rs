//! The Worker's admin routes in real workerd: `/_ratewall/top` and `/_ratewall/series` for the
//! whole edge (denials answered from the isolate's blocked-key cache counted), the dashboard
//! page at `/_ratewall/`, all only for `RATEWALL_ADMIN_TOKEN` (401 without it or with another,
//! 404 when the Worker has none), and no API key in plain text in any of it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_tests::workerd::Workerd;
use serde_json::Value;
use std::time::{Duration, Instant};

const RULES: &str = r#"{
  "identity": {"user": {"header": "x-user-id"}, "api_key": {"header": "x-api-key"}},
  "rules": [
    {"name": "per-user", "match": {"path": "/u/*"}, "key": ["user"], "limit": {"requests": 5, "per": "60s"}},
    {"name": "per-key", "match": {"path": "/k/*"}, "key": ["api_key"], "limit": {"requests": 2, "per": "60s"}}
  ]
}"#;

const TOKEN: &str = "admin-token-for-the-workerd-test";
const HEAVY: &str = "sk_live_the_heavy_partner_key";
const LIGHT: &str = "sk_live_a_lighter_key";

fn compact(json: &str) -> String {
    serde_json::from_str::<Value>(json).unwrap().to_string()
}

fn start(token: Option<&str>) -> Workerd {
    let rules = compact(RULES);
    let mut vars = vec![("RATEWALL_RULES", rules.as_str()), ("TOP_REPORT_SECONDS", "1")];
    if let Some(t) = token {
        vars.push(("RATEWALL_ADMIN_TOKEN", t));
    }
    Workerd::start(&vars).unwrap()
}

fn statuses(w: &Workerd, path: &str, headers: &[(&str, &str)], n: usize) -> Vec<u16> {
    (0..n).map(|_| w.request("GET", path, headers, &[]).status).collect()
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

fn top(w: &Workerd, query: &str) -> Value {
    let auth = bearer(TOKEN);
    let r = w.request("GET", &format!("/_ratewall/top{query}"), &[("authorization", &auth)], &[]);
    assert_eq!(r.status, 200, "{}\n{}", r.text(), w.log());
    assert!(!r.text().contains("sk_live"), "an API key in plain text: {}", r.text());
    assert_eq!(r.header("cache-control"), Some("no-store"));
    serde_json::from_slice(&r.body).unwrap()
}

fn rule<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["rules"].as_array().unwrap().iter().find(|r| r["rule"] == name).unwrap_or(&Value::Null)
}

#[test]
fn top_lists_the_heavy_client_with_the_denials_its_isolate_answered_from_cache() {
    let w = start(Some(TOKEN));
    ratewall_tests::clear_of_a_window_edge(Duration::from_secs(60), Duration::from_secs(15));
    let heavy = statuses(&w, "/k/x", &[("x-api-key", HEAVY)], 30);
    assert_eq!(heavy[..2], [200, 200]);
    assert!(heavy[2..].iter().all(|s| *s == 429), "{heavy:?}");
    assert_eq!(statuses(&w, "/k/x", &[("x-api-key", LIGHT)], 4), [200, 200, 429, 429]);
    assert_eq!(statuses(&w, "/u/x", &[("x-user-id", "ann")], 2), [200, 200]);
    let cached = w.metric("ratewall_rule_cached_denials{rule=\"per-key\"}");
    assert!(cached >= 25, "most denials are answered from the blocked cache, with no object call: {cached}");

    // The isolate reports within a second or so; each read also brings its own counts.
    let start = Instant::now();
    let v = loop {
        let v = top(&w, "");
        if rule(&v, "per-key")["denied"] == 30 || start.elapsed() > Duration::from_secs(20) {
            break v;
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    assert_eq!(v["window_s"], 60);
    let names: Vec<&str> = v["rules"].as_array().unwrap().iter().map(|r| r["rule"].as_str().unwrap()).collect();
    assert_eq!(names, ["per-user", "per-key"], "the rules in document order");
    let r = rule(&v, "per-key");
    assert_eq!((r["allowed"].clone(), r["denied"].clone()), (4.into(), 30.into()), "{v}");
    let listed = r["top"].as_array().unwrap();
    assert_eq!(listed.len(), 2, "{v}");
    let key = listed[0]["key"].as_str().unwrap();
    assert!(key.starts_with("api_key=#") && key.len() == "api_key=#".len() + 8, "shown only as its hash: {key}");
    assert_eq!(listed[0]["denied"], 28, "every denial counted, the cached ones included: {v}");
    assert_eq!(listed[0]["nodes"], 1);
    assert_eq!(listed[1]["denied"], 2);
    assert_ne!(listed[1]["key"], listed[0]["key"]);
    let u = rule(&v, "per-user");
    assert_eq!(
        (u["allowed"].clone(), u["denied"].clone(), u["top"].clone()),
        (2.into(), 0.into(), Value::Array(vec![]))
    );

    // One rule, the hour; a window that is neither is refused.
    let hour = top(&w, "?rule=per-key&window=1h");
    assert_eq!((hour["window_s"].clone(), hour["rules"].as_array().unwrap().len()), (3600.into(), 1));
    assert_eq!(hour["rules"][0]["top"][0]["key"], key);
    let auth = bearer(TOKEN);
    assert_eq!(w.request("GET", "/_ratewall/top?window=1d", &[("authorization", &auth)], &[]).status, 400);

    // The per-second series the dashboard draws.
    let r = w.request("GET", "/_ratewall/series?rule=per-key", &[("authorization", &auth)], &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let s: Value = serde_json::from_slice(&r.body).unwrap();
    let denied: u64 = s["rules"][0]["denied"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).sum();
    assert_eq!((s["rules"][0]["rule"].clone(), denied), ("per-key".into(), 30));
    assert_eq!(s["rules"][0]["allowed"].as_array().unwrap().len(), 900);

    assert!(w.metric("ratewall_top_reports ") >= 1);
    // The admin object keeps the windows in memory: a quiet spell longer than local workerd
    // keeps an object nothing calls (10 s) does not empty them.
    std::thread::sleep(Duration::from_secs(15));
    let later = top(&w, "?rule=per-key&window=1h");
    assert_eq!(later["rules"][0]["denied"], 30, "after a quiet spell: {later}");
    let log = w.log();
    assert!(!log.contains(TOKEN) && !log.contains("sk_live"), "the log names a secret:\n{log}");
}

#[test]
fn the_admin_routes_and_the_page_answer_only_the_token() {
    let w = start(Some(TOKEN));
    let ok = bearer(TOKEN);
    let wrong = bearer("admin-token-for-another-worker");
    let longer = bearer(&format!("{TOKEN}x"));
    for path in ["/_ratewall/top", "/_ratewall/series", "/_ratewall/"] {
        for headers in [vec![], vec![("authorization", wrong.as_str())], vec![("authorization", longer.as_str())]] {
            let r = w.request("GET", path, &headers, &[]);
            assert_eq!(r.status, 401, "{path} {headers:?}: {}", r.text());
            assert_eq!(r.header("www-authenticate"), Some("Bearer realm=\"ratewall\""));
            assert!(!r.text().contains(TOKEN));
        }
        assert_eq!(w.request("GET", path, &[("authorization", &ok)], &[]).status, 200, "{path}");
    }
    assert_eq!(w.request("POST", "/_ratewall/top", &[("authorization", &ok)], &[]).status, 405);
    // A trailing slash is the same route; the rest of /_ratewall/ is ratewall's, never the origin's.
    assert_eq!(w.request("GET", "/_ratewall/top/", &[("authorization", &ok)], &[]).status, 200);
    assert_eq!(w.request("GET", "/_ratewall/top/", &[], &[]).status, 401);
    assert_eq!(w.request("GET", "/_ratewall/nothing", &[("authorization", &ok)], &[]).status, 404);
    assert_eq!(w.request("GET", &format!("/_ratewall/top?token={TOKEN}"), &[], &[]).status, 401, "JSON: Bearer only");

    // The page, for the token as a header or as the query parameter a browser can send.
    let refused = w.request("GET", "/_ratewall/", &[], &[]);
    assert!(refused.text().contains("?token="), "{}", refused.text());
    assert_eq!(w.request("GET", "/_ratewall/?token=not-the-admin-token", &[], &[]).status, 401);
    for (path, headers) in [
        ("/_ratewall/".to_owned(), vec![("authorization", ok.as_str())]),
        (format!("/_ratewall/?token={TOKEN}"), vec![]),
    ] {
        let r = w.request("GET", &path, &headers, &[]);
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        assert_eq!(r.header("content-type"), Some("text/html; charset=utf-8"));
        assert_eq!(r.header("referrer-policy"), Some("no-referrer"));
        assert!(r.header("content-security-policy").is_some_and(|c| c.contains("connect-src 'self'")));
        let page = r.text();
        assert!(page.contains("<title>ratewall</title>"), "the dashboard page");
        assert!(!page.contains(TOKEN), "the page never holds the token");
    }
    assert!(!w.log().contains(TOKEN), "the log names the token");
}

#[test]
fn without_a_token_the_admin_routes_do_not_exist() {
    let w = start(None);
    for path in ["/_ratewall/top", "/_ratewall/series", "/_ratewall/", "/_ratewall"] {
        for auth in ["", "Bearer anything-at-all-of-length"] {
            let headers: Vec<(&str, &str)> = if auth.is_empty() { vec![] } else { vec![("authorization", auth)] };
            let r = w.request("GET", path, &headers, &[]);
            assert_eq!(r.status, 404, "{path} {auth:?}: {}", r.text());
        }
    }
    // The limits work as ever.
    assert_eq!(statuses(&w, "/k/x", &[("x-api-key", HEAVY)], 3), [200, 200, 429]);
}

#[test]
fn the_top_sections_of_filter_batches_synced_to_the_worker_are_in_its_top() {
    use ratewall_core::sync::{hex, sign, RuleTop, SyncRequest, TopSection};
    use ratewall_core::topk::{node_bit, Summary};
    const SECRET: &str = "test-sync-secret";
    let rules = compact(RULES);
    let w = Workerd::start(&[
        ("RATEWALL_RULES", rules.as_str()),
        ("RATEWALL_ADMIN_TOKEN", TOKEN),
        ("RATEWALL_SYNC_SECRET", SECRET),
    ])
    .unwrap();
    let mut summary = Summary::default();
    summary.add(b"api_key=#0badc0de", 40, 3, node_bit(91));
    let section = TopSection {
        rules: vec![RuleTop { rule: "per-key".into(), allowed: 7, denied: 40, shadow_denied: 0, top: summary }],
    };
    let mut body =
        SyncRequest { node: 91, seq: 1, sent: ratewall_tests::conformance::wall_clock(), deltas: vec![], ask: false }
            .encode();
    section.encode_into(&mut body);
    let tag = hex(&sign(SECRET.as_bytes(), &body));
    // Sent twice, as a node retries a batch whose answer it lost: merged once.
    for _ in 0..2 {
        let headers = [("content-type", "application/octet-stream"), ("x-ratewall-signature", tag.as_str())];
        let r = w.request("POST", "/v1/sync", &headers, &body);
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let start = Instant::now();
    let v = loop {
        let v = top(&w, "?rule=per-key");
        if v["rules"][0]["denied"] != 0 || start.elapsed() > Duration::from_secs(10) {
            break v;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    std::thread::sleep(Duration::from_millis(500));
    let v2 = top(&w, "?rule=per-key");
    assert_eq!(v, v2, "the retried batch added nothing");
    let r = &v["rules"][0];
    assert_eq!((r["allowed"].clone(), r["denied"].clone()), (7.into(), 40.into()), "{v}");
    assert_eq!(r["top"][0], serde_json::json!({"key": "api_key=#0badc0de", "denied": 40, "allowed": 3, "nodes": 1}));
}
