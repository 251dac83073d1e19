//! The sync protocol's conformance harness (docs/sync-protocol.md): the same sequences of
//! sync calls against any store — the core's reference `Store` on a virtual clock, the Worker
//! in workerd, ratewall-store on Redis — compared on what a node relies on: statuses, the
//! units counted (`remaining`), whether an ask was granted, and `nodes`. Grants and leases
//! depend on timing and are not compared.
//!
//! Test scaffolding, not a runtime path: an answer that does not decode fails the test that
//! made the call, so it unwraps.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ratewall_core::sync::{hex, sign, unhex, verify, Delta, Store, SyncError, SyncRequest, SyncResponse};
use ratewall_core::{Algorithm, Limit, Nanos, SECOND};

/// The secret every store under test is started with.
pub const SECRET: &str = "conformance-secret-0123";
/// The Worker's node TTL (and the reference store's here).
pub const NODE_TTL: Nanos = 2 * SECOND;

/// A store under test: answers a signed batch with (status, decoded answer when 200).
pub trait SyncStore {
    /// Sends `req` signed with [`SECRET`].
    fn call(&mut self, req: &SyncRequest) -> (u16, Option<SyncResponse>);
    /// Lets `by` pass (the virtual clock moves; a real store is waited for).
    fn wait(&mut self, by: Nanos);
}

/// The core's reference store on a virtual clock.
pub struct Reference {
    /// The store.
    pub store: Store,
    /// Its clock.
    pub now: Nanos,
}

impl Reference {
    /// A fresh reference store with the Worker's node TTL.
    pub fn new() -> Reference {
        Reference { store: Store::new(10_000, NODE_TTL), now: 1_800_000_000 * SECOND }
    }
}

impl Default for Reference {
    fn default() -> Self {
        Reference::new()
    }
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

/// A store over HTTP: the Worker in workerd, or ratewall-store, at `host:port`.
pub struct Http<'a>(pub &'a str);

impl SyncStore for Http<'_> {
    fn call(&mut self, req: &SyncRequest) -> (u16, Option<SyncResponse>) {
        let body = req.encode();
        let tag = hex(&sign(SECRET.as_bytes(), &body));
        let r = crate::http::request(self.0, "POST", "/v1/sync", &[("x-ratewall-signature", tag.as_str())], &body)
            .unwrap_or(crate::http::Response { status: 0, headers: Vec::new(), body: Vec::new() });
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
pub fn limit() -> Limit {
    Limit::new(Algorithm::FixedWindow, 100, 3600 * SECOND, None).unwrap()
}

/// A counter key unique per run (the Worker's objects outlive a sequence within one workerd).
pub fn key(run: &str, name: &str) -> Vec<u8> {
    format!("{run}/{name}").into_bytes()
}

pub fn batch(node: u64, seq: u64, deltas: &[(&[u8], u64)]) -> SyncRequest {
    let deltas = deltas.iter().map(|(k, u)| Delta { key: k.to_vec(), limit: limit(), units: *u }).collect();
    SyncRequest { node, seq, deltas, ask: false }
}

/// What a node sees of one call: the status, each counter's `remaining`, the grants given to
/// an ask (as given or not), and `nodes`.
#[derive(Debug, PartialEq, Eq)]
pub struct Seen {
    /// HTTP status.
    pub status: u16,
    /// Each counter's `remaining`.
    pub remaining: Vec<u64>,
    /// For an ask: whether each counter granted its units.
    pub asked: Vec<bool>,
    /// `nodes`.
    pub nodes: Option<u32>,
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
pub fn sequences(run: &str, store: &mut dyn SyncStore) -> Vec<(&'static str, Vec<Seen>)> {
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
pub fn comparable(all: Vec<(&'static str, Vec<Seen>)>) -> Vec<(&'static str, Vec<Seen>)> {
    all.into_iter()
        .map(|(name, mut seen)| {
            if name != "heartbeat nodes" {
                seen.iter_mut().for_each(|s| s.nodes = None);
            }
            (name, seen)
        })
        .collect()
}
