//! The admin listener of the built `ratewall-store` over a real Redis: off unless asked for,
//! and serving the fleet's top offenders, series, nodes, the page, metrics and health; and
//! how the HTTP listeners (the main one and the admin one) treat clients that send slowly or
//! hold connections open, and the process's log while Redis refuses it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_core::sync::{hex, sign, Delta, RuleTop, SyncRequest, TopSection};
use ratewall_core::topk::{node_bit, Summary};
use ratewall_core::{Algorithm, Limit, SECOND};
use ratewall_tests::conformance::SECRET;
use ratewall_tests::http;
use ratewall_tests::redis::Redis;
use serde_json::Value;
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Store {
    child: Child,
    addr: String,
    admin: Option<String>,
}

impl Drop for Store {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(redis: &Redis, admin: bool) -> Store {
    start_at(&redis.url(), admin, Stdio::null())
}

/// A store on the Redis at `url`, its standard error to `stderr`.
fn start_at(url: &str, admin: bool, stderr: Stdio) -> Store {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ratewall-store"));
    cmd.env("RATEWALL_SYNC_SECRET", SECRET).args(["--listen", "127.0.0.1:0", "--redis", url]);
    if admin {
        cmd.args(["--admin", "127.0.0.1:0"]);
    }
    let mut child = cmd.stdout(Stdio::piped()).stderr(stderr).spawn().unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let addr_of =
        |line: &str| line.split("http://").nth(1).and_then(|s| s.split(['/', ' ']).next()).unwrap().to_owned();
    let mut lines = Vec::new();
    for _ in 0..if admin { 2 } else { 1 } {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        lines.push(line);
    }
    let admin_line = lines.iter().find(|l| l.contains("admin on"));
    assert_eq!(admin_line.is_some(), admin, "{lines:?}");
    let listen = lines.iter().find(|l| l.contains("listening on")).unwrap();
    Store { child, addr: addr_of(listen), admin: admin_line.map(|l| addr_of(l)) }
}

fn limit() -> Limit {
    Limit::new(Algorithm::FixedWindow, 100, 60 * SECOND, None).unwrap()
}

fn batch(node: u64, seq: u64, section: Option<&TopSection>) -> Vec<u8> {
    let deltas = vec![Delta { key: format!("counter-{node}").into_bytes(), limit: limit(), units: 4 }];
    let sent = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let mut body = SyncRequest { node, seq, sent, deltas, ask: false }.encode();
    if let Some(s) = section {
        s.encode_into(&mut body);
    }
    body
}

fn post(addr: &str, body: &[u8]) -> u16 {
    let tag = hex(&sign(SECRET.as_bytes(), body));
    http::request(addr, "POST", "/v1/sync", &[("x-ratewall-signature", &tag)], body).unwrap().status
}

fn get(addr: &str, path: &str) -> (u16, String) {
    let r = http::request(addr, "GET", path, &[], &[]).unwrap();
    (r.status, String::from_utf8_lossy(&r.body).into_owned())
}

fn json(addr: &str, path: &str) -> Value {
    let (status, body) = get(addr, path);
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

fn section(node: u64, heavy: u64, light: u64) -> TopSection {
    let mut top = Summary::default();
    top.add(b"api_key=#3f9a1c2e", heavy, 2, node_bit(node));
    top.add(b"ip=203.0.113.7", light, 0, node_bit(node));
    let rule = RuleTop { rule: "api-key".into(), allowed: 4, denied: heavy + light, shadow_denied: 0, top };
    let watch = RuleTop { rule: "watch".into(), allowed: 0, denied: 0, shadow_denied: 5, top: Summary::default() };
    TopSection { rules: vec![rule, watch] }
}

#[test]
fn the_admin_listener_lists_the_fleets_top_offenders_and_nodes() {
    let redis = Redis::start(false).unwrap();
    let store = start(&redis, true);
    let admin = store.admin.clone().unwrap();
    for node in 1..=3 {
        assert_eq!(post(&store.addr, &batch(node, 1, Some(&section(node, 30, node)))), 200);
    }
    assert_eq!(post(&store.addr, &batch(4, 1, None)), 200, "a batch without the section is taken as before");
    assert_eq!(post(&store.addr, &batch(1, 1, Some(&section(1, 30, 1)))), 200, "a retry");
    assert_eq!(post(&store.addr, &batch(2, 2, None)), 200);
    assert_eq!(post(&store.addr, &batch(2, 1, Some(&section(2, 30, 2)))), 409, "an older batch, which the node drops");
    let top = json(&admin, "/v1/top");
    assert_eq!(top["window_s"], 60);
    let rule = &top["rules"][0];
    assert_eq!(
        (rule["rule"].as_str(), rule["allowed"].as_u64(), rule["denied"].as_u64()),
        (Some("api-key"), Some(12), Some(96))
    );
    assert_eq!(rule["top"][0], serde_json::json!({"key": "api_key=#3f9a1c2e", "denied": 90, "allowed": 6, "nodes": 3}));
    assert_eq!(rule["top"][1]["key"], "ip=203.0.113.7");
    assert_eq!(top["rules"][1]["shadow_denied"], 15, "rules in the order first heard");
    let only = json(&admin, "/v1/top?rule=watch&window=1h");
    assert_eq!((only["window_s"].as_u64(), only["rules"].as_array().unwrap().len()), (Some(3600), 1));
    assert_eq!(get(&admin, "/v1/top?window=2d").0, 400);
    let fleet = json(&admin, "/v1/fleet");
    assert_eq!(fleet["nodes"].as_array().unwrap().len(), 4);
    assert_eq!(fleet["redis"]["ok"], true);
    let nodes = fleet["nodes"].as_array().unwrap();
    assert!(nodes.iter().all(|n| n["degraded"] == false), "an older batch refused is no failure: {fleet}");
    // Each node: its id, when last heard (seconds ago), batches a second, last round trip.
    for n in nodes {
        let fields: Vec<&str> = n.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(fields, ["batches_per_s", "degraded", "id", "last_seen_s", "rtt_ms"], "{n}");
        assert!(n["id"].is_string() && n["last_seen_s"].is_number() && n["batches_per_s"].is_number(), "{n}");
        assert!(n["rtt_ms"].is_number(), "{n}");
    }
    let series = json(&admin, "/v1/series?rule=api-key");
    let denied: u64 = series["rules"][0]["denied"].as_array().unwrap().iter().filter_map(Value::as_u64).sum();
    assert_eq!((series["step_s"].as_u64(), denied), (Some(1), 96));
    let (status, page) = get(&admin, "/");
    assert_eq!((status, page.as_str()), (200, ratewall_store::admin::PAGE));
    assert_eq!(get(&admin, "/healthz").0, 200);
    assert!(get(&admin, "/metrics").1.contains("ratewall_store_sync_ok_total 6"));
    assert_eq!(get(&store.addr, "/v1/top").0, 404, "not on the main listener");
    // Another path or method: a reason, not an empty body.
    let (status, body) = get(&admin, "/v1/tops");
    assert_eq!(status, 404);
    assert!(body.contains("no admin route /v1/tops"), "{body}");
    let r = http::request(&admin, "POST", "/v1/top", &[], b"").unwrap();
    assert_eq!(r.status, 405);
    assert!(String::from_utf8_lossy(&r.body).contains("GET only"));
    assert!(r.headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("allow") && v.contains("GET")), "{:?}", r.headers);
    // Redis gone: no process can answer a batch, and every node shows degraded.
    let mut redis = redis;
    redis.stop();
    let fleet = json(&admin, "/v1/fleet");
    assert_eq!(fleet["redis"]["ok"], false);
    let nodes = fleet["nodes"].as_array().unwrap();
    assert!(!nodes.is_empty() && nodes.iter().all(|n| n["degraded"] == true), "{fleet}");
}

#[test]
fn any_store_processs_admin_listener_answers_for_batches_its_peers_answered() {
    let redis = Redis::start(false).unwrap();
    let with_admin = start(&redis, true);
    let peer = start(&redis, false);
    let admin = with_admin.admin.clone().unwrap();
    // Behind a load balancer: nodes 1 and 2 reach the peer, node 3 the process with the admin
    // listener.
    assert_eq!(post(&peer.addr, &batch(1, 1, Some(&section(1, 30, 1)))), 200);
    assert_eq!(post(&peer.addr, &batch(2, 1, Some(&section(2, 30, 2)))), 200);
    assert_eq!(post(&with_admin.addr, &batch(3, 1, Some(&section(3, 30, 3)))), 200);
    // The peer shares once a second; wait for both of its nodes (bounded).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let top = loop {
        let top = json(&admin, "/v1/top");
        if top["rules"][0]["denied"].as_u64() == Some(96) || std::time::Instant::now() > deadline {
            break top;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let rule = &top["rules"][0];
    assert_eq!((rule["allowed"].as_u64(), rule["denied"].as_u64()), (Some(12), Some(96)), "{top}");
    assert_eq!(rule["top"][0], serde_json::json!({"key": "api_key=#3f9a1c2e", "denied": 90, "allowed": 6, "nodes": 3}));
    assert_eq!(top["rules"][1]["shadow_denied"], 15);
    let fleet = json(&admin, "/v1/fleet");
    assert_eq!(fleet["nodes"].as_array().unwrap().len(), 3, "{fleet}");
    let series = json(&admin, "/v1/series?rule=api-key");
    let denied: u64 = series["rules"][0]["denied"].as_array().unwrap().iter().filter_map(Value::as_u64).sum();
    assert_eq!(denied, 96);
    // Its own batches are not counted twice when its own share comes back from the stream.
    std::thread::sleep(std::time::Duration::from_millis(2500));
    assert_eq!(json(&admin, "/v1/top")["rules"][0]["denied"].as_u64(), Some(96));
    let metrics = get(&admin, "/metrics").1;
    let merged = metrics.lines().find_map(|l| l.strip_prefix("ratewall_store_top_peer_shares_total "));
    assert!(merged.and_then(|n| n.parse::<u64>().ok()).is_some_and(|n| n >= 1), "{metrics}");
}

#[test]
fn the_admin_listener_is_off_unless_asked_for() {
    let redis = Redis::start(false).unwrap();
    let store = start(&redis, false);
    assert!(store.admin.is_none());
    assert_eq!(get(&store.addr, "/v1/fleet").0, 404);
}

mod fleet {
    //! The built filter in the wasmtime host, three proxies of two VMs each, syncing over real
    //! HTTP to this store on Redis.

    use super::*;
    use ratewall_tests::host::{Callout, HttpRequest, Node, Plugin, Started, Vm};

    const HEAVY: &str = "sk_live_HEAVYSECRET";

    fn rules() -> String {
        format!(
            r#"{{"identity": {{"api_key": {{"header": "x-api-key"}}, "hash_key": "this deployment's hash key"}},
  "rules": [{{"name": "api-key", "key": ["api_key"], "limit": {{"requests": 5, "per": "60s"}}}}],
  "sync": {{"cluster": "store", "secret": "{SECRET}", "interval": "100ms", "timeout": "500ms", "nodes": 3}}}}"#
        )
    }

    /// Posts a VM's call to the store and hands it the answer; the body sent.
    fn answer(store: &str, vm: &mut Vm, c: &Callout) -> Vec<u8> {
        let sig = c.headers.iter().find(|(k, _)| k == "x-ratewall-signature").map(|(_, v)| v.clone()).unwrap();
        let sig = String::from_utf8(sig).unwrap();
        let r = http::request(store, "POST", "/v1/sync", &[("x-ratewall-signature", &sig)], &c.body).unwrap();
        let back = r.header("x-ratewall-signature").unwrap_or_default().as_bytes().to_vec();
        vm.respond(c, r.status, &[("x-ratewall-signature", &back)], r.body).unwrap();
        c.body.clone()
    }

    fn request(store: &str, vm: &mut Vm, key: &str, sent: &mut Vec<Vec<u8>>) -> bool {
        let req = HttpRequest::new("GET", "/v1/items").header("x-api-key", key);
        match vm.begin(&req).unwrap() {
            Started::Done(r) => r.passed,
            Started::Paused(ctx) => {
                for c in vm.take_callouts() {
                    sent.push(answer(store, vm, &c));
                }
                vm.finish(ctx).unwrap().is_some_and(|r| r.passed)
            }
        }
    }

    fn wall() -> u64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    }

    #[test]
    fn a_heavy_client_shows_first_within_two_intervals_and_its_key_never_in_plain_text() {
        let redis = Redis::start(false).unwrap();
        let store = start(&redis, true);
        let admin = store.admin.clone().unwrap();
        let plugin = Plugin::filter().unwrap();
        let config = rules();
        let start = wall();
        let mut fleet: Vec<(Node, Vec<Vm>)> = (0..3)
            .map(|_| {
                let node = Node::new(start);
                let vms = (0..2).map(|_| Vm::start(&plugin, &node, config.as_bytes()).unwrap()).collect();
                (node, vms)
            })
            .collect();
        let mut sent = Vec::new();
        let tick = |fleet: &mut Vec<(Node, Vec<Vm>)>, at: u64, sent: &mut Vec<Vec<u8>>| {
            for (node, vms) in fleet.iter_mut() {
                node.set_time(at);
                for vm in vms.iter_mut() {
                    vm.tick().unwrap();
                    for c in vm.take_callouts() {
                        sent.push(answer(&store.addr, vm, &c));
                    }
                }
            }
        };
        // The proxies join: a heartbeat each.
        tick(&mut fleet, start, &mut sent);
        let parsed = ratewall_core::Config::parse(config.as_bytes()).unwrap();
        let shown = |key: &str| {
            let headers: Vec<Option<&[u8]>> = vec![Some(key.as_bytes())];
            let req = ratewall_core::Request { method: "GET", path: "/v1/items", headers: &headers, ip: None };
            ratewall_core::topk::render(&parsed, &parsed.checks(&req).0[0].key).unwrap().1
        };
        let mut first_at = None;
        for round in 1..=4u64 {
            let at = start + round * 100_000_000;
            for (n, (node, vms)) in fleet.iter_mut().enumerate() {
                node.set_time(at);
                for (v, vm) in vms.iter_mut().enumerate() {
                    for _ in 0..6 {
                        request(&store.addr, vm, HEAVY, &mut sent);
                    }
                    request(&store.addr, vm, &format!("sk_light_{round}_{n}_{v}"), &mut sent);
                }
            }
            tick(&mut fleet, at + 50_000_000, &mut sent);
            let top = json(&admin, "/v1/top?rule=api-key");
            let listed = top["rules"][0]["top"][0]["key"].as_str().map(str::to_owned);
            if first_at.is_none() && listed.as_deref() == Some(shown(HEAVY).as_str()) {
                first_at = Some(round);
            }
        }
        assert!(first_at.is_some_and(|r| r <= 2), "first listed after {first_at:?} intervals");
        // Two more intervals: the denials of VMs that ticked after their node's batch arrive.
        for round in 5..=6u64 {
            tick(&mut fleet, start + round * 100_000_000, &mut sent);
        }
        let top = json(&admin, "/v1/top");
        let heavy = &top["rules"][0]["top"][0];
        assert!((130..=144).contains(&heavy["denied"].as_u64().unwrap()), "144 requests, 5 admitted: {top}");
        // Nodes are bits of a 64-bit set: two of three may share one.
        assert!((2..=3).contains(&heavy["nodes"].as_u64().unwrap()), "{top}");
        // The key in plain text (or in hex) nowhere: batches, logs, Redis, the admin listener.
        let plain = HEAVY.as_bytes();
        let hexed = hex(plain);
        let has =
            |hay: &[u8]| hay.windows(plain.len()).any(|w| w == plain) || String::from_utf8_lossy(hay).contains(&hexed);
        assert!(sent.len() > 6 && sent.iter().all(|b| !has(b)), "a batch carries the key");
        for (node, _) in &fleet {
            assert!(node.logs().iter().all(|(_, l)| !has(l.as_bytes())), "a log line names the key");
        }
        let keys = ratewall_tests::redis::cli(redis.port, &["--scan"]).unwrap();
        assert!(!keys.trim().is_empty() && !has(keys.as_bytes()), "a Redis key holds the key");
        for k in keys.lines() {
            let kind = ratewall_tests::redis::cli(redis.port, &["TYPE", k]).unwrap();
            let read: &[&str] =
                if kind.trim() == "stream" { &["--raw", "XRANGE", k, "-", "+"] } else { &["--raw", "GET", k] };
            let v = ratewall_tests::redis::cli(redis.port, read).unwrap();
            assert!(!has(v.as_bytes()), "the Redis value of {k} holds the key");
        }
        for path in ["/v1/top", "/v1/top?window=1h", "/v1/fleet", "/v1/series", "/metrics"] {
            assert!(!has(get(&admin, path).1.as_bytes()), "{path} shows the key");
        }
    }
}

#[test]
fn query_parameters_are_read_as_a_browser_encodes_them_and_a_bare_window_is_refused() {
    let redis = Redis::start(false).unwrap();
    let store = start(&redis, true);
    let admin = store.admin.clone().unwrap();
    assert_eq!(post(&store.addr, &batch(1, 1, Some(&section(1, 30, 1)))), 200);
    // Percent-encoded names and windows read as their plain forms (as the Worker reads them).
    let only = json(&admin, "/v1/top?rule=api%2Dkey&window=1%68");
    assert_eq!(only["window_s"], 3600, "{only}");
    let rules: Vec<&str> = only["rules"].as_array().unwrap().iter().filter_map(|r| r["rule"].as_str()).collect();
    assert_eq!(rules, ["api-key"], "{only}");
    let series = json(&admin, "/v1/series?rule=%77atch");
    assert_eq!(series["rules"][0]["rule"], "watch", "{series}");
    // `window` without a value is not a window: 400, as for any other.
    for bad in ["/v1/top?window", "/v1/top?window=", "/v1/top?rule=watch&window", "/v1/top?window=1m%FF"] {
        let (status, body) = get(&admin, bad);
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(body.contains("is not 1m or 1h"), "{bad}: {body}");
    }
    assert_eq!(get(&admin, "/v1/top?windows=1h&window=1h").0, 200, "another parameter's name is not `window`");
}

#[test]
fn an_admin_listener_counts_what_its_peers_heard_from_when_it_announced_itself() {
    let redis = Redis::start(false).unwrap();
    // The peer runs first; the process with the admin listener joins later. What the peer hears
    // once that process has announced its listener is in its answers.
    let peer = start(&redis, false);
    // Half a share interval later: the peer's next share comes well before the newcomer's first
    // read of the stream.
    std::thread::sleep(ratewall_store::top::SHARE_EVERY / 2);
    let with_admin = start(&redis, true);
    let admin = with_admin.admin.clone().unwrap();
    assert_eq!(post(&peer.addr, &batch(1, 1, Some(&section(1, 30, 1)))), 200);
    denied_within(&admin, "/v1/top", 31);
    assert_eq!(json(&admin, "/v1/fleet")["nodes"].as_array().unwrap().len(), 1);
}

#[test]
fn an_admin_listener_started_later_shows_what_its_peers_shared_before_it() {
    let redis = Redis::start(false).unwrap();
    // The peer hears a batch and shares it; the process with the admin listener (a restart of
    // the one that served the dashboard) starts after that.
    let peer = start(&redis, false);
    assert_eq!(post(&peer.addr, &batch(1, 1, Some(&section(1, 30, 1)))), 200);
    std::thread::sleep(ratewall_store::top::SHARE_EVERY * 3);
    let with_admin = start(&redis, true);
    let admin = with_admin.admin.clone().unwrap();
    denied_within(&admin, "/v1/top?window=1h", 31);
}

/// Waits up to 5 s for the admin listener's `path` to count `denied` for its first rule.
fn denied_within(admin: &str, path: &str, denied: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let top = loop {
        let top = json(admin, path);
        if top["rules"][0]["denied"].as_u64() == Some(denied) || std::time::Instant::now() > deadline {
            break top;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert_eq!(top["rules"][0]["denied"].as_u64(), Some(denied), "{top}");
}

/// Opens a connection to `addr` and sends `bytes`, then nothing more.
fn send_part(addr: &str, bytes: &[u8]) -> std::net::TcpStream {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(bytes).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s
}

/// Reads what the server sends until it closes the connection: that, and how long it took.
fn until_closed(mut s: std::net::TcpStream) -> (String, Duration) {
    use std::io::Read;
    let start = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("still open after {:?}: {e}", start.elapsed()),
        }
    }
    (String::from_utf8_lossy(&got).into_owned(), start.elapsed())
}

#[test]
fn a_request_whose_head_does_not_arrive_is_closed_within_five_seconds_on_either_listener() {
    let redis = Redis::start(false).unwrap();
    let store = start(&redis, true);
    let admin = store.admin.clone().unwrap();
    let held: Vec<_> = [&store.addr, &admin]
        .into_iter()
        .flat_map(|addr| {
            [
                send_part(addr, b"POST /v1/sync HTTP/1.1\r\nHost: x\r\n"),
                send_part(addr, b"GET /healthz HT"),
                send_part(addr, b""),
            ]
        })
        .collect();
    for s in held {
        let (said, took) = until_closed(s);
        assert!(took < Duration::from_secs(8), "closed after {took:?}");
        assert!(said.is_empty(), "{said}");
    }
    // The listeners serve on.
    assert_eq!(get(&store.addr, "/healthz").0, 200);
    assert_eq!(get(&admin, "/healthz").0, 200);
}

#[test]
fn a_body_that_does_not_arrive_is_answered_408_within_ten_seconds() {
    let redis = Redis::start(false).unwrap();
    let store = start(&redis, false);
    let s = send_part(
        &store.addr,
        b"POST /v1/sync HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\nx-ratewall-signature: 00\r\n\r\nabc",
    );
    let (said, took) = until_closed(s);
    assert!(took > Duration::from_secs(8) && took < Duration::from_secs(13), "answered after {took:?}");
    assert!(said.starts_with("HTTP/1.1 408"), "{said}");
    assert!(said.contains("did not arrive within 10 s"), "{said}");
    // Counted with the other refusals.
    let metrics = get(&store.addr, "/metrics").1;
    assert!(metrics.contains("ratewall_store_sync_failed_total{status=\"408\"} 1\n"), "{metrics}");
}

/// Bodies being read are held to 64 MiB in all: 64 clients each declaring a body of 1 MiB and
/// sending a little of it leave no room, and the next request is answered 503 at once rather
/// than read; room comes back as they go.
#[test]
fn request_bodies_held_at_once_are_bounded_and_a_request_past_them_is_answered_503() {
    let redis = Redis::start(false).unwrap();
    let store = start(&redis, false);
    let head = format!("POST /v1/sync HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\nabc", 1 << 20);
    let mut held: Vec<_> = (0..64).map(|_| send_part(&store.addr, head.as_bytes())).collect();
    std::thread::sleep(Duration::from_millis(300));
    let (said, took) = until_closed(send_part(
        &store.addr,
        b"POST /v1/sync HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc",
    ));
    assert!(said.starts_with("HTTP/1.1 503"), "{said}");
    assert!(said.contains("64 MiB of request bodies"), "{said}");
    assert!(took < Duration::from_secs(3), "answered after {took:?}");
    // One client gone: its room is free again, and a small request is read (and refused for
    // what it is).
    drop(held.pop());
    std::thread::sleep(Duration::from_millis(300));
    let (said, _) = until_closed(send_part(
        &store.addr,
        b"POST /v1/sync HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc",
    ));
    assert!(said.starts_with("HTTP/1.1 401") || said.starts_with("HTTP/1.1 400"), "{said}");
    drop(held);
    assert_eq!(get(&store.addr, "/healthz").0, 200);
}

#[test]
fn a_stopped_store_ends_within_its_drain_whatever_its_clients_hold_open() {
    use std::io::Write;
    let redis = Redis::start(false).unwrap();
    let mut store = start(&redis, true);
    let admin = store.admin.clone().unwrap();
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(send_part(&store.addr, b"POST /v1/sync HTTP/1.1\r\nHost: x\r\n"));
        held.push(send_part(&store.addr, b"POST /v1/sync HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nabc"));
    }
    // A client that asks for the page again and again and reads none of it: the answers fill
    // the connection and the store waits to write.
    let mut stuck = std::net::TcpStream::connect(&admin).unwrap();
    let ask = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".repeat(200);
    let _ = stuck.write_all(&ask);
    std::thread::sleep(Duration::from_millis(500));
    let _ = Command::new("kill").args(["-TERM", &store.child.id().to_string()]).status();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = store.child.try_wait().unwrap() {
            break status;
        }
        assert!(start.elapsed() < Duration::from_secs(16), "still running {:?} after SIGTERM", start.elapsed());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
    drop((held, stuck));
}

#[test]
fn while_redis_refuses_the_store_it_says_so_once_in_a_while_not_per_request() {
    let redis = Redis::start(false).unwrap();
    let log = std::env::temp_dir().join(format!("ratewall-admin-refused-{}.log", std::process::id()));
    let url = format!("redis://:wrong-password@127.0.0.1:{}", redis.port);
    let store = start_at(&url, false, std::fs::File::create(&log).unwrap().into());
    for _ in 0..30 {
        assert_eq!(get(&store.addr, "/healthz").0, 503);
        assert_eq!(post(&store.addr, &batch(1, 1, None)), 503);
    }
    let text = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_file(&log);
    let said = text.lines().filter(|l| l.contains("cannot reach Redis yet")).count();
    assert!((1..=2).contains(&said), "{said} lines for 60 requests:\n{text}");
    assert!(!text.contains("wrong-password"), "{text}");
}

/// A Redis that refuses the store's password is said as such on `/healthz`, not as a Redis
/// that is not there (the operator would look at the network), and the password is not shown.
#[test]
fn healthz_says_redis_refused_the_password_without_showing_it() {
    let redis = Redis::start(false).unwrap();
    ratewall_tests::redis::cli(redis.port, &["CONFIG", "SET", "requirepass", "the-right-one"]).unwrap();
    let url = format!("redis://:not-the-password@127.0.0.1:{}", redis.port);
    let store = start_at(&url, true, Stdio::null());
    for addr in [&store.addr, store.admin.as_ref().unwrap()] {
        let (status, body) = get(addr, "/healthz");
        assert_eq!(status, 503, "{body}");
        assert!(body.to_lowercase().contains("password") || body.contains("WRONGPASS"), "{body}");
        assert!(!body.contains("not-the-password") && !body.contains("the-right-one"), "{body}");
    }
    // Batches meanwhile are refused with the reason, and do not each try a connection of
    // their own.
    let connections = || {
        let info =
            ratewall_tests::redis::cli(redis.port, &["-a", "the-right-one", "--no-auth-warning", "INFO", "stats"])
                .unwrap();
        let line = info.lines().find_map(|l| l.strip_prefix("total_connections_received:")).unwrap().trim().to_owned();
        line.parse::<u64>().unwrap()
    };
    let before = connections();
    for seq in 1..=40 {
        let body = batch(1, seq, None);
        let tag = hex(&sign(SECRET.as_bytes(), &body));
        let r = http::request(&store.addr, "POST", "/v1/sync", &[("x-ratewall-signature", &tag)], &body).unwrap();
        let body = String::from_utf8_lossy(&r.body).into_owned();
        assert_eq!(r.status, 503, "{body}");
        assert!(!body.contains("not-the-password"), "{body}");
        std::thread::sleep(Duration::from_millis(25));
    }
    let made = connections() - before - 1;
    assert!(made <= 12, "{made} connections tried for 40 batches in about a second");
}

/// An idle store finds the connection a restarted Redis dropped before anyone asks: the first
/// `/healthz` and the first batch after the restart are answered (each failed once, on the
/// dead connection, when nothing had used it since the restart).
#[test]
fn after_redis_restarts_an_idle_stores_first_answers_are_good() {
    let mut redis = Redis::start(false).unwrap();
    let store = start(&redis, false);
    assert_eq!(post(&store.addr, &batch(1, 1, None)), 200);
    assert_eq!(get(&store.addr, "/healthz").0, 200);
    // Idle: what the batch brought has been shared on the stream.
    std::thread::sleep(Duration::from_millis(2500));
    redis.restart().unwrap();
    // Idle a few keepalive intervals, then ask.
    std::thread::sleep(Duration::from_secs(3));
    let (status, body) = get(&store.addr, "/healthz");
    assert_eq!(status, 200, "{body}");
    assert_eq!(post(&store.addr, &batch(1, 2, None)), 200);
}
