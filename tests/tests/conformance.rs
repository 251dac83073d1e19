//! One specification, every store: the same sequences of sync calls (docs/sync-protocol.md)
//! against the core's reference `Store` on a virtual clock and the Worker's `POST /v1/sync`
//! in workerd on its own clock, compared on what a node relies on — statuses, the units
//! counted (`remaining`), whether an ask was granted, and `nodes`. Grants and leases depend
//! on timing and are not compared. (ratewall-store, the Redis store, joins this list when
//! it lands.)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_core::sync::{hex, sign, unhex, verify, Delta, Store, SyncError, SyncRequest, SyncResponse};
use ratewall_core::{Algorithm, Limit, Nanos, SECOND};
use ratewall_tests::workerd::Workerd;

const SECRET: &str = "conformance-secret-0123";
/// The Worker's node TTL (and the reference store's here).
const NODE_TTL: Nanos = 2 * SECOND;

/// A store under test: answers a signed batch with (status, decoded answer when 200).
trait SyncStore {
    fn call(&mut self, req: &SyncRequest) -> (u16, Option<SyncResponse>);
    /// Lets `by` pass (the virtual clock moves; a real store is waited for).
    fn wait(&mut self, by: Nanos);
}

struct Reference {
    store: Store,
    now: Nanos,
}

impl SyncStore for Reference {
    fn call(&mut self, req: &SyncRequest) -> (u16, Option<SyncResponse>) {
        let body = req.encode();
        let tag = sign(SECRET.as_bytes(), &body);
        match self.store.handle_signed(self.now, SECRET.as_bytes(), &body, &tag) {
            Ok(out) => (200, Some(SyncResponse::decode(&out).unwrap())),
            Err(SyncError::Stale { .. }) => (409, None),
            Err(SyncError::Malformed(_)) => (400, None),
            Err(SyncError::Unauthorized) => (401, None),
        }
    }
    fn wait(&mut self, by: Nanos) {
        self.now += by;
    }
}

struct Worker<'a>(&'a Workerd);

impl SyncStore for Worker<'_> {
    fn call(&mut self, req: &SyncRequest) -> (u16, Option<SyncResponse>) {
        let body = req.encode();
        let tag = hex(&sign(SECRET.as_bytes(), &body));
        let r = self.0.request("POST", "/v1/sync", &[("x-ratewall-signature", tag.as_str())], &body);
        if r.status != 200 {
            return (r.status, None);
        }
        let sig = unhex(r.header("x-ratewall-signature").unwrap().as_bytes()).unwrap();
        assert!(verify(SECRET.as_bytes(), &r.body, &sig), "the store signs its answer");
        (200, Some(SyncResponse::decode(&r.body).unwrap()))
    }
    fn wait(&mut self, by: Nanos) {
        std::thread::sleep(std::time::Duration::from_nanos(by));
    }
}

/// A fixed window of an hour: what a sequence counts stays counted for the whole test.
fn limit() -> Limit {
    Limit::new(Algorithm::FixedWindow, 100, 3600 * SECOND, None).unwrap()
}

/// Keys unique per run (the Worker's objects outlive a sequence within one workerd).
fn key(run: &str, name: &str) -> Vec<u8> {
    format!("{run}/{name}").into_bytes()
}

fn batch(node: u64, seq: u64, deltas: &[(&[u8], u64)]) -> SyncRequest {
    let deltas = deltas.iter().map(|(k, u)| Delta { key: k.to_vec(), limit: limit(), units: *u }).collect();
    SyncRequest { node, seq, deltas, ask: false }
}

/// What a node sees of one call: the status, each counter's `remaining`, the grants given to
/// an ask (as given or not), and `nodes`.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    status: u16,
    remaining: Vec<u64>,
    asked: Vec<bool>,
    nodes: Option<u32>,
}

fn seen(req: &SyncRequest, (status, resp): (u16, Option<SyncResponse>)) -> Seen {
    let remaining = resp.as_ref().map_or(Vec::new(), |r| r.grants.iter().map(|g| g.remaining).collect());
    let asked = match (&resp, req.ask) {
        (Some(r), true) => r.grants.iter().zip(&req.deltas).map(|(g, d)| g.grant >= d.units).collect(),
        _ => Vec::new(),
    };
    Seen { status, remaining, asked, nodes: resp.map(|r| r.nodes) }
}

/// The sequences, each a list of (wait before, call); returns what each call saw.
fn sequences(run: &str, store: &mut dyn SyncStore) -> Vec<(&'static str, Vec<Seen>)> {
    let late = key(run, "late");
    let hb = key(run, "heartbeat");
    let old = key(run, "older");
    let rep = key(run, "repeat");
    let asked = key(run, "ask");
    let many = key(run, "many");
    let mut out = Vec::new();
    let mut go = |name: &'static str, steps: Vec<(Nanos, SyncRequest)>, store: &mut dyn SyncStore| {
        let mut seen_all = Vec::new();
        for (wait, req) in steps {
            if wait > 0 {
                store.wait(wait);
            }
            seen_all.push(seen(&req, store.call(&req)));
        }
        out.push((name, seen_all));
    };
    // `nodes` is the fleet heard from, in a heartbeat too (the Worker answered 1).
    go(
        "heartbeat nodes",
        vec![
            (0, batch(201, 1, &[(&hb, 1)])),
            (0, batch(202, 1, &[(&hb, 1)])),
            (0, batch(203, 1, &[(&hb, 1)])),
            (0, batch(201, 2, &[])),
        ],
        store,
    );
    // A late retry, after the node was quiet past the node TTL while another synced the
    // counter: counted once (the Worker counted it twice).
    go(
        "late repeat",
        vec![
            (0, batch(101, 1, &[(&late, 5)])),
            (SECOND + SECOND / 4, batch(102, 1, &[(&late, 0)])),
            (SECOND + SECOND / 4, batch(102, 2, &[(&late, 0)])),
            (0, batch(101, 1, &[(&late, 5)])),
            (0, batch(102, 3, &[(&late, 0)])),
        ],
        store,
    );
    // An older seq is refused with 409, and counts nothing (the Worker answered 200).
    go(
        "older seq",
        vec![(0, batch(301, 5, &[(&old, 2)])), (0, batch(301, 4, &[(&old, 7)])), (0, batch(301, 6, &[(&old, 0)]))],
        store,
    );
    // A repeat of the latest seq counts nothing again.
    go(
        "repeat",
        vec![(0, batch(401, 1, &[(&rep, 3)])), (0, batch(401, 1, &[(&rep, 3)])), (0, batch(401, 2, &[(&rep, 0)]))],
        store,
    );
    // An ask takes its units at once; its `remaining` is after them (the Worker reported it
    // before); a repeat of the ask takes nothing more.
    let ask = |n: u64| SyncRequest {
        node: 501,
        seq: n,
        deltas: vec![Delta { key: asked.clone(), limit: limit(), units: 4 }],
        ask: true,
    };
    go(
        "ask",
        // The ask comes once node 502's grant (which holds the last units) is off lease.
        vec![
            (0, batch(502, 1, &[(&asked, 90)])),
            (2 * SECOND + SECOND / 4, ask(1)),
            (0, ask(1)),
            (0, batch(502, 2, &[(&asked, 0)])),
        ],
        store,
    );
    // More nodes on one counter than the Worker used to remember (64), then a repeat from
    // the first: counted once.
    let mut steps = vec![(0, batch(600, 1, &[(&many, 1)]))];
    steps.extend((601..=680).map(|n| (0, batch(n, 1, &[(&many, 0)]))));
    steps.push((0, batch(600, 1, &[(&many, 1)])));
    steps.push((0, batch(600, 2, &[(&many, 0)])));
    go("many nodes", steps, store);
    out
}

/// The parts of what a sequence saw that every store must agree on. `nodes` is compared in
/// the first sequence only, which starts from an empty registry (later ones also count the
/// nodes of the sequences before, which a real clock may or may not still hold recent).
fn comparable(all: Vec<(&'static str, Vec<Seen>)>) -> Vec<(&'static str, Vec<Seen>)> {
    all.into_iter()
        .map(|(name, mut seen)| {
            if name != "heartbeat nodes" {
                seen.iter_mut().for_each(|s| s.nodes = None);
            }
            (name, seen)
        })
        .collect()
}

#[test]
fn the_reference_store_answers_as_the_protocol_says() {
    let mut r = Reference { store: Store::new(10_000, NODE_TTL), now: 1_800_000_000 * SECOND };
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
    // Ask: granted, remaining after its 4 units, a repeat takes nothing.
    let ask = find("ask");
    assert_eq!((ask[1].asked.as_slice(), ask[1].remaining.as_slice()), (&[true][..], &[6][..]));
    assert_eq!(ask[3].remaining, [6]);
    // Many nodes: the first node's repeat counted once.
    assert_eq!(find("many nodes").last().unwrap().remaining, [99]);
}

#[test]
fn the_worker_answers_as_the_reference_store_does() {
    let w = Workerd::start(&[("RATEWALL_SYNC_SECRET", SECRET)]).unwrap();
    let run = format!("w{}", std::process::id());
    let worker = comparable(sequences(&run, &mut Worker(&w)));
    let mut r = Reference { store: Store::new(10_000, NODE_TTL), now: 1_800_000_000 * SECOND };
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
                        let req = SyncRequest { node: 900 + sender, seq, deltas, ask: false };
                        // A retry of the same seq after a failure counts once, so retry until
                        // the store acknowledges.
                        for _ in 0..5 {
                            if Worker(w).call(&req).0 == 200 {
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
        let probe =
            SyncRequest { node: 999, seq: 1, deltas: vec![Delta { key: k.clone(), limit: big, units: 0 }], ask: false };
        let (status, resp) = Worker(&w).call(&probe);
        assert_eq!(status, 200);
        let counted = 1_000_000 - resp.unwrap().grants[0].remaining;
        assert_eq!(counted, acknowledged, "{}", String::from_utf8_lossy(k));
    }
}
