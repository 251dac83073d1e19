//! One specification, every store (`ratewall_tests::conformance`): the reference store and
//! the Worker's `POST /v1/sync` in workerd, on the same call sequences. ratewall-store runs
//! the same sequences in `store/tests/store.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_core::sync::{Delta, SyncRequest, SyncResponse};
use ratewall_core::{Algorithm, Limit, SECOND};
use ratewall_tests::conformance::{
    batch, clear_of_the_windows_end, comparable, key, limit, replay_after_the_seq_memory, sequences, Http, Reference,
    Seen, SyncStore, SECRET,
};
use ratewall_tests::workerd::Workerd;

#[test]
fn the_reference_store_answers_as_the_protocol_says() {
    let mut r = Reference::new();
    let got = sequences("ref", &mut r);
    let find = |n: &str| &got.iter().find(|(name, _)| *name == n).unwrap().1;
    // Late repeat: 5 counted once.
    assert_eq!(find("late repeat").last().unwrap().remaining, [95]);
    // Heartbeat: three nodes.
    assert_eq!(find("heartbeat nodes").last().unwrap().nodes, Some(3));
    // Older seq: 409, and its 7 units are not counted.
    let older = find("older seq");
    assert_eq!(older[1].status, 409);
    assert_eq!(older[2].remaining, [98]);
    // Repeat: counted once.
    assert_eq!(find("repeat")[2].remaining, [97]);
    // Ask: granted, remaining after its 4 units; a copy of an answered ask (before the
    // node's next ask or after it, or under the same number made anew) refused, taking
    // nothing: 8 units taken by the two asks.
    let ask = find("ask");
    assert_eq!((ask[1].asked.as_slice(), ask[1].remaining.as_slice()), (&[true][..], &[6][..]));
    let statuses: Vec<u16> = ask.iter().map(|s| s.status).collect();
    assert_eq!(statuses, [200, 200, 409, 200, 409, 409, 200]);
    assert_eq!(ask[3].asked, [true], "{ask:?}");
    assert_eq!(ask[6].remaining, [2], "{ask:?}");
    // Many nodes: the first node's repeat counted once.
    assert_eq!(find("many nodes").last().unwrap().remaining, [99]);
    // Skewed clocks: 20 s either way served, 30 s refused (a batch, a heartbeat, an ask),
    // and only the served units counted.
    let skewed = find("skewed clocks");
    let statuses: Vec<u16> = skewed.iter().map(|s| s.status).collect();
    assert_eq!(statuses, [200, 200, 422, 422, 422, 422, 200]);
    assert_eq!(skewed.last().unwrap().remaining, [93]);
    // The old shape and a concurrency delta: refused, nothing counted.
    let refused = find("refused shapes");
    assert_eq!((refused[0].status, refused[1].status), (415, 400));
    assert_eq!(refused[2].remaining, [100]);
}

/// What the replay must show at every store: the captured batch counted once.
fn assert_replay_refused(seen: &[Seen], store: &str) {
    let statuses: Vec<u16> = seen.iter().map(|s| s.status).collect();
    assert_eq!(statuses, [200, 200, 422, 200], "{store}: the replay is refused for its time");
    assert_eq!(seen[1].remaining, [75]);
    assert_eq!(seen[3].remaining, [75], "{store}: 25 units reported, 25 counted");
}

#[test]
fn the_reference_store_refuses_a_batch_replayed_after_its_seq_is_forgotten() {
    assert_replay_refused(&replay_after_the_seq_memory("ref", &mut Reference::new()), "the reference store");
}

/// Waits out the Worker's 60 s `seq` memory on the real clock (61 s): no virtual clock
/// reaches inside workerd.
#[test]
fn the_worker_refuses_a_batch_replayed_after_its_seq_is_forgotten() {
    let w = Workerd::start(&[("RATEWALL_SYNC_SECRET", SECRET)]).unwrap();
    let run = format!("r{}", std::process::id());
    let seen = replay_after_the_seq_memory(&run, &mut Http(&w.addr));
    assert_replay_refused(&seen, &format!("the Worker\n{}", w.log()));
    let metrics = ratewall_tests::http::request(&w.addr, "GET", "/_ratewall/metrics", &[], &[]).unwrap().text();
    assert!(metrics.contains("ratewall_sync_refused_stale 1\n"), "{metrics}");
}

/// The Worker's node registry is a Durable Object, whose memory goes with a restart (or an
/// eviction): the asks it answered before are still refused after it, by the mark it keeps in
/// storage. Two captured asks sent again after a restart take nothing; a new ask is answered.
#[test]
fn the_worker_refuses_asks_replayed_after_it_restarts() {
    let mut w = Workerd::start(&[("RATEWALL_SYNC_SECRET", SECRET)]).unwrap();
    let k = key(&format!("a{}", std::process::id()), "asked");
    let mut http = Http(&w.addr);
    clear_of_the_windows_end(&mut http, 120 * SECOND);
    let ask = |store: &dyn SyncStore, number: u64| {
        let d = Delta { key: k.clone(), limit: limit(), units: 4 };
        SyncRequest { node: 701, seq: (1 << 40) | number, sent: store.now(), deltas: vec![d], ask: true }.encode()
    };
    let remaining = |status: u16, body: &[u8]| {
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(body));
        SyncResponse::decode(body).unwrap().grants[0].remaining
    };
    let captured = [ask(&http, 1), ask(&http, 2)];
    let (s1, b1) = http.send(&captured[0]);
    let (s2, b2) = http.send(&captured[1]);
    assert_eq!((remaining(s1, &b1), remaining(s2, &b2)), (96, 92));
    let started = std::time::Instant::now();
    w.restart().unwrap();
    let mut http = Http(&w.addr);
    for body in &captured {
        let (status, reason) = http.send(body);
        assert_eq!(
            status,
            409,
            "a captured ask sent again {:?} after the restart: {}\n{}",
            started.elapsed(),
            String::from_utf8_lossy(&reason),
            w.log()
        );
    }
    let (status, body) = http.send(&SyncRequest { sent: http.now(), ..batch(702, 1, &[(&k, 0)]) }.encode());
    assert_eq!(remaining(status, &body), 92, "the replays took nothing");
    let (status, body) = http.send(&ask(&http, 3));
    assert_eq!(remaining(status, &body), 88, "a new ask is answered\n{}", w.log());
}

#[test]
fn the_worker_answers_as_the_reference_store_does() {
    let w = Workerd::start(&[("RATEWALL_SYNC_SECRET", SECRET)]).unwrap();
    let run = format!("w{}", std::process::id());
    let worker = comparable(sequences(&run, &mut Http(&w.addr)));
    let mut r = Reference::new();
    let reference = comparable(sequences(&run, &mut r));
    for ((name, ours), (_, theirs)) in worker.iter().zip(&reference) {
        assert_eq!(ours, theirs, "{name}: the Worker and the reference store disagree\n{}", w.log());
    }
}

/// Conservation under concurrent senders: every unit the Worker acknowledged with a signed
/// 200 is counted, exactly once, however the batches interleave (its objects write a sync
/// delta before answering).
#[test]
fn the_worker_counts_every_acknowledged_unit_once_under_concurrent_senders() {
    let w = Workerd::start(&[("RATEWALL_SYNC_SECRET", SECRET)]).unwrap();
    let big = Limit::new(Algorithm::FixedWindow, 1_000_000, 3600 * SECOND, None).unwrap();
    let run = format!("c{}", std::process::id());
    let keys: Vec<Vec<u8>> = (0..5).map(|i| key(&run, &format!("k{i}"))).collect();
    let acknowledged: u64 = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8u64)
            .map(|sender| {
                let (w, keys) = (&w, &keys);
                scope.spawn(move || {
                    let mut mine = 0;
                    for seq in 1..=15u64 {
                        let units = 1 + (sender + seq) % 4;
                        let deltas = keys.iter().map(|k| Delta { key: k.clone(), limit: big, units }).collect();
                        let req = SyncRequest { node: 900 + sender, seq, sent: 0, deltas, ask: false };
                        // A retry of the same seq after a failure counts once, so retry until
                        // the store acknowledges.
                        for _ in 0..5 {
                            if Http(&w.addr).call(&req).0 == 200 {
                                mine += units;
                                break;
                            }
                        }
                    }
                    mine
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    for k in &keys {
        let probe = SyncRequest {
            node: 999,
            seq: 1,
            sent: 0,
            deltas: vec![Delta { key: k.clone(), limit: big, units: 0 }],
            ask: false,
        };
        let (status, resp) = Http(&w.addr).call(&probe);
        assert_eq!(status, 200);
        let counted = 1_000_000 - resp.unwrap().grants[0].remaining;
        assert_eq!(counted, acknowledged, "{}", String::from_utf8_lossy(k));
    }
}

/// A leaky bucket's fields, the same from the filter (in the wasmtime host) and the Worker (in
/// workerd): `RateLimit-Policy` states the rate the bucket drains at (`q / w` is `requests /
/// per`) over a window its whole queue fits in, so `RateLimit`'s `r` never exceeds `q`.
#[test]
fn a_leaky_buckets_policy_is_its_drain_rate_alike_in_the_filter_and_the_worker() {
    use ratewall_tests::host::{HttpRequest, Node, Plugin, Vm};
    let doc = serde_json::json!({
        "identity": {"user": {"header": "x-user-id"}},
        "rules": [
            {"name": "drain", "match": {"path": "/d/*"}, "key": ["user"],
             "limit": {"requests": 2, "per": "1s", "burst": 12, "algorithm": "leaky_bucket"}},
            {"name": "slow", "match": {"path": "/s/*"}, "key": ["user"],
             "limit": {"requests": 1, "per": "1s", "burst": 12, "delay": 8, "algorithm": "leaky_bucket"}}
        ]
    })
    .to_string();
    let node = Node::new(1_700_000_000 * SECOND);
    let mut vm = Vm::start(&Plugin::filter().unwrap(), &node, doc.as_bytes()).unwrap();
    let w = Workerd::start(&[("RATEWALL_RULES", doc.as_str())]).unwrap();
    // The requests that go at once: the first of "drain", the first `delay + 1` of "slow".
    for (path, n, policy) in [("/d/x", 1, r#""drain";q=14;w=7"#), ("/s/x", 9, r#""slow";q=13;w=13"#)] {
        for i in 0..n {
            let f = vm.request(&HttpRequest::new("GET", path).header("x-user-id", "lee")).unwrap();
            let r = w.request("GET", path, &[("x-user-id", "lee")], &[]);
            assert!(f.passed && r.status == 200, "{path} request {i}: {} / {}", f.status, r.text());
            let filter = (f.header("ratelimit-policy"), f.header("ratelimit"));
            assert_eq!(filter, (r.header("ratelimit-policy"), r.header("ratelimit")), "{path} request {i}");
            assert_eq!(filter.0, Some(policy), "{path} request {i}");
            let remaining: u64 = filter.1.and_then(|s| s.split(";r=").nth(1)?.split(';').next()?.parse().ok()).unwrap();
            assert_eq!(remaining, 12 - i, "{path} request {i}: the queue's places left, at most q");
        }
    }
}
