//! The dashboard page (`dashboard/index.html`) in headless Chromium, as the Worker serves it:
//! at `/_ratewall/?token=…`, its JSON at `/_ratewall/top` and `/_ratewall/series` only with the
//! Bearer token the page was given, and no fleet. First the built Worker in real workerd with
//! real traffic behind it; then a loopback server that plays the Worker's routes with answers
//! that lack fields, which the page must cope with (the page as a real store serves it is
//! tested in `store/tests/dashboard.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_tests::browser::{unavailable, visit, Visit};
use ratewall_tests::workerd::Workerd;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

/// The (method and path, authorization) of each request the stand-in got.
type Seen = Arc<Mutex<Vec<(String, String)>>>;

const TOKEN: &str = "t0ken-for-the-dashboard-test";

/// The Worker's admin routes on loopback: the page, `top` behind the token (a 500 once it has
/// answered `top_answers` times) and `series` (without its denials), 404 otherwise. Returns the origin and the (method, path,
/// authorization) of every request it got.
fn worker_routes(top_answers: usize) -> (String, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let origin = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../dashboard/index.html")).unwrap();
    let mut tops = 0;
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request_line = String::new();
            if reader.read_line(&mut request_line).is_err() {
                continue;
            }
            let mut auth = String::new();
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
                    break;
                }
                if let Some((n, v)) = h.split_once(':') {
                    if n.eq_ignore_ascii_case("authorization") {
                        auth = v.trim().to_owned();
                    }
                }
            }
            let path = request_line.split_whitespace().nth(1).unwrap_or("").to_owned();
            log.lock().unwrap().push((path.clone(), auth.clone()));
            let top = serde_json::json!({"window_s": 60, "full": true, "rules": [
                {"rule": "api-key", "allowed": 1200, "denied": 37, "shadow_denied": 0,
                 "top": [{"key": "api_key=#3f9a1c2e", "denied": 30, "allowed": 5, "nodes": 3},
                         {"key": "api_key=#77aa01b3"}]},
                {"rule": "login-per-ip", "allowed": 10},
                {"no rule name": true}
            ]})
            .to_string();
            let (status, kind, body) = match path.split('?').next().unwrap_or("") {
                "/_ratewall/" if path.ends_with(&format!("?token={TOKEN}")) || auth == format!("Bearer {TOKEN}") => {
                    ("200 OK", "text/html; charset=utf-8", page.clone())
                }
                "/_ratewall/" => ("401 Unauthorized", "text/plain", "unauthorized".to_owned()),
                "/_ratewall/top" if auth == format!("Bearer {TOKEN}") && tops >= top_answers => {
                    ("500 Internal Server Error", "text/plain", "the admin object did not answer".to_owned())
                }
                "/_ratewall/top" if auth == format!("Bearer {TOKEN}") => {
                    tops += 1;
                    ("200 OK", "application/json", top)
                }
                "/_ratewall/top" => ("401 Unauthorized", "text/plain", "unauthorized".to_owned()),
                // A series without its denials: not drawn as zeros.
                "/_ratewall/series" if auth == format!("Bearer {TOKEN}") => {
                    let series = serde_json::json!({"step_s": 1, "rules": [{"rule": "api-key", "allowed": [1, 2, 3]}]});
                    ("200 OK", "application/json", series.to_string())
                }
                _ => ("404 Not Found", "text/plain", "not found".to_owned()),
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (origin, seen)
}

#[test]
fn under_the_worker_the_page_sends_its_token_and_copes_with_what_is_missing() {
    if let Some(why) = unavailable() {
        panic!("the browser tests cannot run: {why}");
    }
    let (origin, seen) = worker_routes(usize::MAX);
    let url = format!("{origin}/_ratewall/?token={TOKEN}");
    let v = visit(&Visit {
        url: &url,
        until: "document.querySelector('section.rule[data-rule=\"api-key\"] table.top td.key')",
        timeout_ms: 15_000,
        collect: "({ keys: [...document.querySelectorAll('section.rule[data-rule=\"api-key\"] table.top td.key')].map(e => e.textContent),
                    rules: [...document.querySelectorAll('section.rule')].map(e => e.dataset.rule),
                    charts: [...document.querySelectorAll('section.rule .chart-box')].map(e => e.textContent),
                    lines: document.querySelectorAll('section.rule[data-rule=\"api-key\"] svg polyline').length,
                    loginTop: document.querySelector('section.rule[data-rule=\"login-per-ip\"] .top-box').textContent,
                    updated: document.getElementById('updated').textContent,
                    fleetShown: document.getElementById('fleet-area').offsetHeight > 0,
                    full: document.getElementById('full').offsetHeight > 0,
                    href: location.href })",
        screenshots: &[],
    })
    .unwrap();
    let r = &v.result;
    assert_eq!(r["keys"], serde_json::json!(["api_key=#3f9a1c2e", "api_key=#77aa01b3"]), "{v:?}");
    assert_eq!(r["rules"], serde_json::json!(["api-key", "login-per-ip"]), "a rule without a name is skipped: {v:?}");
    // What an answer leaves out shows as no data, never as zeros or "nobody denied"; an answer
    // without a field is not a full one.
    let charts = r["charts"].as_array().unwrap();
    assert!(charts[0].as_str().unwrap().contains("no data: denied, shadow denied"), "{v:?}");
    assert_eq!((r["lines"].as_u64(), &charts[1]), (Some(1), &serde_json::json!("no data")), "{v:?}");
    assert_eq!(r["loginTop"], "no data", "a rule without its top: {v:?}");
    assert!(r["updated"].as_str().unwrap().starts_with("no answer at"), "{v:?}");
    assert_eq!(r["fleetShown"], false, "the Worker has no fleet: {v:?}");
    assert_eq!(r["full"], true, "an answer that says it is full is said to be: {v:?}");
    assert_eq!(r["href"], format!("{origin}/_ratewall/"), "the token is out of the address bar: {v:?}");
    assert!(v.outside(&origin).is_empty(), "requests outside the server: {:?}", v.outside(&origin));
    // The only console errors are the browser's own notes of the routes the Worker lacks.
    let unexpected: Vec<&String> = v.errors.iter().filter(|e| !e.contains("404")).collect();
    assert!(unexpected.is_empty(), "console errors: {:?}", v.errors);
    let seen = seen.lock().unwrap();
    let tops: Vec<&(String, String)> = seen.iter().filter(|(p, _)| p.starts_with("/_ratewall/top")).collect();
    assert!(!tops.is_empty(), "{seen:?}");
    assert!(tops.iter().all(|(_, auth)| *auth == format!("Bearer {TOKEN}")), "{seen:?}");
    assert!(seen[0].0.contains(TOKEN), "the page's own address: {seen:?}");
    assert!(seen[1..].iter().all(|(p, _)| !p.contains(TOKEN)), "the token goes in no other URL: {seen:?}");
}

const RULES: &str = r#"{
  "identity": {"api_key": {"header": "x-api-key"}},
  "rules": [{"name": "per-key", "match": {"path": "/k/*"}, "key": ["api_key"], "limit": {"requests": 2, "per": "60s"}}]
}"#;

#[test]
fn the_worker_serves_the_page_for_its_token_and_the_page_names_the_heaviest_client() {
    if let Some(why) = unavailable() {
        panic!("the browser tests cannot run: {why}");
    }
    let rules = serde_json::from_str::<serde_json::Value>(RULES).unwrap().to_string();
    let w = Workerd::start(&[("RATEWALL_RULES", &rules), ("RATEWALL_ADMIN_TOKEN", TOKEN), ("TOP_REPORT_SECONDS", "1")])
        .unwrap();
    for (key, n) in [("sk_live_heaviest", 12), ("sk_live_lighter", 4)] {
        for _ in 0..n {
            assert_ne!(w.request("GET", "/k/x", &[("x-api-key", key)], &[]).status, 0);
        }
    }
    let origin = format!("http://{}", w.addr);
    let shot = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/dashboard-worker.png");
    let v = visit(&Visit {
        url: &format!("{origin}/_ratewall/?token={TOKEN}"),
        until: "document.querySelector('section.rule[data-rule=\"per-key\"] table.top td.key') &&
                document.querySelector('section.rule[data-rule=\"per-key\"] svg.chart')",
        timeout_ms: 20_000,
        collect: "({ keys: [...document.querySelectorAll('section.rule[data-rule=\"per-key\"] table.top td.key')].map(e => e.textContent),
                    denied: [...document.querySelectorAll('section.rule[data-rule=\"per-key\"] table.top td.denied')].map(e => e.textContent),
                    points: Number(document.querySelector('section.rule[data-rule=\"per-key\"] svg.chart').dataset.points),
                    updated: document.getElementById('updated').textContent,
                    text: document.body.innerText, href: location.href })",
        screenshots: &[(&shot, 1280, 800)],
    })
    .unwrap();
    let r = &v.result;
    assert!(r["keys"][0].as_str().unwrap().starts_with("api_key=#"), "{v:?}");
    assert_eq!(r["denied"][0], "10", "the heaviest client first: {v:?}");
    assert!(r["points"].as_u64().unwrap() > 0, "the chart has points: {v:?}");
    assert!(r["updated"].as_str().unwrap().starts_with("updated "), "the Worker's answers are full ones: {v:?}");
    assert!(!r["text"].as_str().unwrap().contains(TOKEN) && !r["text"].as_str().unwrap().contains("sk_live"), "{v:?}");
    assert_eq!(r["href"], format!("{origin}/_ratewall/"), "{v:?}");
    assert!(v.outside(&origin).is_empty(), "requests outside the Worker: {:?}", v.outside(&origin));
    assert!(v.requests[1..].iter().all(|u| !u.contains(TOKEN)), "the token in a URL: {:?}", v.requests);
    assert!(v.errors.is_empty(), "console errors: {:?}", v.errors);

    // Opened without its token, the Worker answers 401 and says how to open it.
    let v = visit(&Visit {
        url: &format!("{origin}/_ratewall/"),
        until: "document.body && document.body.innerText.length > 0",
        timeout_ms: 15_000,
        collect: "document.body.innerText",
        screenshots: &[],
    })
    .unwrap();
    assert!(v.result.as_str().unwrap().contains("?token="), "{v:?}");
    assert!(v.requests.len() == 1, "nothing else is loaded: {:?}", v.requests);
}

#[test]
fn numbers_the_endpoints_stop_answering_are_not_shown_as_fresh() {
    if let Some(why) = unavailable() {
        panic!("the browser tests cannot run: {why}");
    }
    let (origin, _) = worker_routes(1);
    let v = visit(&Visit {
        url: &format!("{origin}/_ratewall/?token={TOKEN}"),
        until: "document.querySelector('section.rule[data-rule=\"api-key\"]') &&
                !document.querySelector('section.rule[data-rule=\"api-key\"] table.top')",
        timeout_ms: 15_000,
        collect: "({ top: document.querySelector('section.rule[data-rule=\"api-key\"] .top-box').textContent,
                    totals: document.querySelector('section.rule[data-rule=\"api-key\"] .totals').textContent,
                    updated: document.getElementById('updated').textContent })",
        screenshots: &[],
    })
    .unwrap();
    let r = &v.result;
    assert_eq!(r["top"], "no data", "the last answer's offenders are gone once top fails: {v:?}");
    assert_eq!(r["totals"], "", "{v:?}");
    assert!(r["updated"].as_str().unwrap().starts_with("no answer at"), "{v:?}");
}
