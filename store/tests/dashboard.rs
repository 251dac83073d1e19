//! The dashboard page as an operator opens it: `GET /` on the admin listener of a real
//! `ratewall-store` on a real Redis, with the built filter in the wasmtime host syncing real
//! traffic to it, loaded in headless Chromium (`ratewall_tests::browser`). No console error,
//! no request outside the server, a chart with points, and the heaviest client named first.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_tests::browser::{unavailable, visit, Visit};
use ratewall_tests::conformance::SECRET;
use ratewall_tests::host::{Callout, HttpRequest, Node, Plugin, Started, Vm};
use ratewall_tests::http;
use ratewall_tests::redis::Redis;
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A running `ratewall-store` with its admin listener, killed when dropped.
struct Store {
    child: Child,
    addr: String,
    admin: String,
}

impl Drop for Store {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_store(redis: &Redis) -> Store {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratewall-store"))
        .env("RATEWALL_SYNC_SECRET", SECRET)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--redis",
            &format!("redis://127.0.0.1:{}", redis.port),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    // It announces both listeners, the admin one as "admin on http://…".
    let (mut addr, mut admin) = (None, None);
    while addr.is_none() || admin.is_none() {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "ratewall-store exited before announcing both listeners");
        let Some(at) = line.split("http://").nth(1).and_then(|s| s.split_whitespace().next()) else { continue };
        let at = at.trim_end_matches('/').to_owned();
        if line.contains("admin") {
            admin = Some(at);
        } else {
            addr = Some(at);
        }
    }
    std::thread::spawn(move || out.lines().for_each(drop));
    let (addr, admin) = (addr.unwrap(), admin.unwrap());
    let store = Store { child, addr, admin };
    let start = Instant::now();
    while http::request(&store.admin, "GET", "/healthz", &[], &[]).map_or(true, |r| r.status != 200) {
        assert!(start.elapsed() < Duration::from_secs(10), "the admin listener did not answer on {}", store.admin);
        std::thread::sleep(Duration::from_millis(50));
    }
    store
}

fn wall() -> u64 {
    u64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()).unwrap()
}

/// Sends a node's callouts to the store and gives the VM the answers.
fn forward(vm: &mut Vm, store: &str, calls: Vec<Callout>) {
    for c in calls {
        let sig =
            c.headers.iter().find(|(k, _)| k == "x-ratewall-signature").map(|(_, v)| v.clone()).unwrap_or_default();
        let sig = String::from_utf8_lossy(&sig).into_owned();
        let headers = [("x-ratewall-signature", sig.as_str()), ("content-type", "application/octet-stream")];
        match http::request(store, "POST", "/v1/sync", &headers, &c.body) {
            Ok(r) => {
                let answer_sig = r.header("x-ratewall-signature").unwrap_or_default().as_bytes().to_vec();
                vm.respond(&c, r.status, &[("x-ratewall-signature", &answer_sig)], r.body).unwrap();
            }
            Err(_) => vm.deliver(&c, None).unwrap(),
        }
    }
}

#[test]
fn the_dashboard_shows_the_fleets_traffic_and_names_the_heaviest_client() {
    if let Some(why) = unavailable() {
        panic!("the browser tests cannot run: {why}");
    }
    let redis = Redis::start(false).unwrap();
    let store = start_store(&redis);
    // The example rules, synced to the store every 100 ms.
    let mut rules: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/rules.json")).unwrap(),
    )
    .unwrap();
    rules["sync"] =
        serde_json::json!({"cluster": "store", "secret": SECRET, "interval": "100ms", "timeout": "500ms", "nodes": 2});
    let config = rules.to_string();
    let plugin = Plugin::filter().unwrap();
    let mut fleet: Vec<(Node, Vm)> = (0..2)
        .map(|_| {
            let node = Node::new(wall());
            let vm = Vm::start(&plugin, &node, config.as_bytes()).unwrap();
            (node, vm)
        })
        .collect();
    // Four seconds of traffic on the real clock (the store counts on its own): 203.0.113.7
    // logs in 30 times a second, two others twice a second, and API calls go by.
    let (heavy, light) = ("203.0.113.7", ["198.51.100.20", "198.51.100.21"]);
    let start = Instant::now();
    let mut step = 0u64;
    while start.elapsed() < Duration::from_secs(4) {
        for (n, (node, vm)) in fleet.iter_mut().enumerate() {
            node.set_time(wall());
            let mut reqs: Vec<HttpRequest> = (0..3)
                .map(|_| HttpRequest::new("POST", "/v1/auth/login").from_addr(&format!("{heavy}:40000")))
                .collect();
            if step % 5 == n as u64 {
                reqs.extend(
                    light.iter().map(|ip| HttpRequest::new("POST", "/v1/auth/login").from_addr(&format!("{ip}:40000"))),
                );
            }
            reqs.push(HttpRequest::new("GET", "/v1/items").header("x-api-key", format!("key-{}", step % 4)));
            for req in reqs {
                if let Started::Paused(ctx) = vm.begin(&req).unwrap() {
                    let calls = vm.take_callouts();
                    forward(vm, &store.addr, calls);
                    vm.finish(ctx).unwrap();
                }
            }
            vm.tick().unwrap();
            let calls = vm.take_callouts();
            forward(vm, &store.addr, calls);
        }
        step += 1;
        // Paced by the real clock: the store and its series count real seconds.
        std::thread::sleep(Duration::from_millis(100));
    }
    let origin = format!("http://{}", store.admin);
    let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
    let (laptop, phone) = (target.join("dashboard.png"), target.join("dashboard-phone.png"));
    let rule = "section.rule[data-rule=\"login-per-ip\"]";
    let v = visit(&Visit {
        url: &format!("{origin}/"),
        until: &format!(
            "document.querySelector('{rule} table.top td.key') && +(document.querySelector('{rule} svg.chart') || {{dataset: {{}}}}).dataset.max > 0 && document.querySelector('table.fleet')"
        ),
        timeout_ms: 20_000,
        collect: &format!(
            "({{ top: [...document.querySelectorAll('{rule} table.top td.key')].map(e => e.textContent),
                points: +document.querySelector('{rule} svg.chart').dataset.points,
                max: +document.querySelector('{rule} svg.chart').dataset.max,
                nodes: document.querySelectorAll('table.fleet tbody tr').length,
                redis: document.getElementById('redis').textContent,
                updated: document.getElementById('updated').textContent,
                full: document.getElementById('full').offsetHeight > 0 }})"
        ),
        screenshots: &[(&laptop, 1280, 900), (&phone, 390, 844)],
    })
    .unwrap();
    assert!(v.errors.is_empty(), "console errors: {:?}", v.errors);
    assert!(v.failed.is_empty(), "failed requests: {:?}", v.failed);
    assert!(v.outside(&origin).is_empty(), "requests outside the server: {:?}", v.outside(&origin));
    let r = &v.result;
    assert_eq!(r["top"][0], format!("ip={heavy}"), "the heaviest client comes first: {v:?}");
    assert!(r["points"].as_u64().unwrap() > 0 && r["max"].as_f64().unwrap() > 0.0, "the chart has points: {v:?}");
    assert_eq!(r["nodes"], 2, "both nodes are in the fleet: {v:?}");
    assert_eq!(r["redis"], "ok", "{v:?}");
    assert!(r["updated"].as_str().unwrap().starts_with("updated "), "the store's answers are full ones: {v:?}");
    assert_eq!(r["full"], false, "the store tracks every rule: {v:?}");
    // On a phone nothing scrolls sideways: the fleet's nodes are a line each.
    assert_eq!(v.scrolling, [(1280, vec![]), (390, vec![])], "boxes scrolled sideways, by viewport width");
    println!("screenshots: {} and {}", laptop.display(), phone.display());
}

/// A signed batch from `node` whose top section has one rule per name, each denying `user=a`
/// (a name starting `shadow`: would-deny, as a shadow rule counts).
fn batch_with_rules(node: u64, names: &[&str]) -> Vec<u8> {
    use ratewall_core::sync::{Delta, RuleTop, SyncRequest, TopSection};
    use ratewall_core::topk::{node_bit, Summary};
    use ratewall_core::{Algorithm, Limit, SECOND};
    let limit = Limit::new(Algorithm::FixedWindow, 100, 60 * SECOND, None).unwrap();
    let deltas = vec![Delta { key: b"counter".to_vec(), limit, units: 1 }];
    let mut body = SyncRequest { node, seq: 1, sent: wall(), deltas, ask: false }.encode();
    let rules = names
        .iter()
        .map(|name| {
            let mut top = Summary::default();
            top.add(b"user=a", 3, 1, node_bit(node));
            let (denied, shadow_denied) = if name.starts_with("shadow") { (0, 3) } else { (3, 0) };
            RuleTop { rule: (*name).to_owned(), allowed: 1, denied, shadow_denied, top }
        })
        .collect();
    TopSection { rules }.encode_into(&mut body);
    body
}

#[test]
fn rules_named_like_javascripts_object_members_each_get_their_card() {
    if let Some(why) = unavailable() {
        panic!("the browser tests cannot run: {why}");
    }
    let redis = Redis::start(false).unwrap();
    let store = start_store(&redis);
    // Valid rule names (A-Z a-z 0-9 _ . -) that an object literal already has as members.
    let names = ["constructor", "toString", "__proto__", "hasOwnProperty", "api-key", "shadow-ip"];
    let body = batch_with_rules(1, &names);
    let tag = ratewall_core::sync::hex(&ratewall_core::sync::sign(SECRET.as_bytes(), &body));
    let r = http::request(&store.addr, "POST", "/v1/sync", &[("x-ratewall-signature", &tag)], &body).unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let origin = format!("http://{}", store.admin);
    let v = visit(&Visit {
        url: &format!("{origin}/"),
        until:
            "document.querySelectorAll('section.rule table.top').length >= 6 && document.querySelector('table.fleet')",
        timeout_ms: 10_000,
        collect: "({ rules: [...document.querySelectorAll('section.rule')].map(s => [s.dataset.rule,
                     (s.querySelector('table.top td.key') || {}).textContent]),
                    heads: [...document.querySelectorAll('section.rule table.top th:nth-child(2)')].map(e => e.textContent),
                    nodes: document.querySelectorAll('table.fleet tbody tr').length })",
        screenshots: &[],
    })
    .unwrap();
    assert!(v.errors.is_empty(), "console errors: {:?}", v.errors);
    let shown: Vec<(String, String)> = serde_json::from_value(v.result["rules"].clone()).unwrap();
    let want: Vec<(String, String)> = names.iter().map(|n| ((*n).to_owned(), "user=a".to_owned())).collect();
    assert_eq!(shown, want, "{v:?}");
    // A shadow rule's clients are those it would have denied, and the table says so.
    let heads: Vec<String> = serde_json::from_value(v.result["heads"].clone()).unwrap();
    assert_eq!(heads, ["denied", "denied", "denied", "denied", "denied", "would deny"], "{v:?}");
    assert_eq!(v.result["nodes"], 1, "{v:?}");
}
