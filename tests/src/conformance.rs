//! The sync protocol's conformance harness (docs/sync-protocol.md): the same sequences of
//! sync calls against any store — the core's reference `Store` on a virtual clock, the Worker
//! in workerd, ratewall-store on Redis — compared on what a node relies on: statuses, the
//! units counted (`remaining`), whether an ask was granted, and `nodes`. Grants and leases
//! depend on timing and are not compared.
//!
//! Test scaffolding, not a runtime path: an answer that does not decode fails the test that
//! made the call, so it unwraps.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ratewall_core::sync::{hex, sign, unhex, verify, Delta, Store, SyncRequest, SyncResponse, SEQ_MEMORY};
use ratewall_core::{Algorithm, Limit, Nanos, SECOND};

/// The secret every store under test is started with.
pub const SECRET: &str = "conformance-secret-0123";
/// The Worker's node TTL (and the reference store's here).
pub const NODE_TTL: Nanos = 2 * SECOND;

/// A store under test: answers a signed body with its status and body.
pub trait SyncStore {
    /// Sends `body` signed with [`SECRET`]: the status, and the body (an answer, whose
    /// signature the store checked, on a 200; else the store's reason).
    fn send(&mut self, body: &[u8]) -> (u16, Vec<u8>);
    /// Lets `by` pass (the virtual clock moves; a real store is waited for).
    fn wait(&mut self, by: Nanos);
    /// The clock requests are stamped with: the store's own (virtual, or the wall clock).
    fn now(&self) -> Nanos;
    /// Sends `req`, made now (its `sent` is the store's clock when it is 0): the status, and
    /// the decoded answer on a 200.
    fn call(&mut self, req: &SyncRequest) -> (u16, Option<SyncResponse>) {
        let req = SyncRequest { sent: if req.sent == 0 { self.now() } else { req.sent }, ..req.clone() };
        let (status, body) = self.send(&req.encode());
        (status, (status == 200).then(|| SyncResponse::decode(&body).unwrap()))
    }
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
    fn send(&mut self, body: &[u8]) -> (u16, Vec<u8>) {
        let tag = sign(SECRET.as_bytes(), body);
        match self.store.handle_signed(self.now, SECRET.as_bytes(), body, &tag) {
            Ok(out) => (200, out),
            Err(e) => (e.status(), e.to_string().into_bytes()),
        }
    }
    fn wait(&mut self, by: Nanos) {
        self.now += by;
    }
    fn now(&self) -> Nanos {
        self.now
    }
}

/// A store over HTTP: the Worker in workerd, or ratewall-store, at `host:port`.
pub struct Http<'a>(pub &'a str);

impl SyncStore for Http<'_> {
    fn send(&mut self, body: &[u8]) -> (u16, Vec<u8>) {
        let tag = hex(&sign(SECRET.as_bytes(), body));
        let r = crate::http::request(self.0, "POST", "/v1/sync", &[("x-ratewall-signature", tag.as_str())], body)
            .unwrap_or(crate::http::Response { status: 0, headers: Vec::new(), body: Vec::new() });
        if r.status == 200 {
            let sig = unhex(r.header("x-ratewall-signature").unwrap().as_bytes()).unwrap();
            assert!(verify(SECRET.as_bytes(), &r.body, &sig), "the store signs its answer");
        }
        (r.status, r.body)
    }
    fn wait(&mut self, by: Nanos) {
        std::thread::sleep(std::time::Duration::from_nanos(by));
    }
    fn now(&self) -> Nanos {
        wall_clock()
    }
}

/// The wall clock, Unix ns: what a real store's clock reads.
pub fn wall_clock() -> Nanos {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    u64::try_from(since.as_nanos()).unwrap()
}

/// A fixed window of an hour: what a sequence counts stays counted for the whole test.
pub fn limit() -> Limit {
    Limit::new(Algorithm::FixedWindow, 100, 3600 * SECOND, None).unwrap()
}

/// Waits, when `store`'s clock is less than `needed` before the end of [`limit`]'s fixed window,
/// until the next window: a sequence run on a real clock must not see its window roll over
/// (a run started a minute before the hour saw its counters' quota restored mid-sequence).
pub fn clear_of_the_windows_end(store: &mut dyn SyncStore, needed: Nanos) {
    let per = limit().per();
    let left = per - store.now() % per;
    if left < needed {
        store.wait(left + SECOND);
    }
}

/// A counter key unique per run (the Worker's objects outlive a sequence within one workerd).
pub fn key(run: &str, name: &str) -> Vec<u8> {
    format!("{run}/{name}").into_bytes()
}

/// A batch of `node`, made when it is sent.
pub fn batch(node: u64, seq: u64, deltas: &[(&[u8], u64)]) -> SyncRequest {
    let deltas = deltas.iter().map(|(k, u)| Delta { key: k.to_vec(), limit: limit(), units: *u }).collect();
    SyncRequest { node, seq, sent: 0, deltas, ask: false }
}

/// One call of a sequence.
pub enum Step {
    /// A request made when it is sent.
    Now(SyncRequest),
    /// A request made by a node whose clock is this far ahead of the store's (behind, when
    /// negative).
    Skewed(SyncRequest, i64),
    /// A body sent as it is (signed), answered with no `remaining`.
    Raw(Vec<u8>),
    /// The body of the sequence's call number `n` again, byte for byte: a captured request
    /// replayed.
    Replay(usize),
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

fn seen(req: Option<&SyncRequest>, status: u16, body: &[u8]) -> Seen {
    let resp = (status == 200 && req.is_some()).then(|| SyncResponse::decode(body).unwrap());
    let Some(req) = req else { return Seen { status, remaining: Vec::new(), asked: Vec::new(), nodes: None } };
    let remaining = resp.as_ref().map_or(Vec::new(), |r| r.grants.iter().map(|g| g.remaining).collect());
    let asked = match (&resp, req.ask) {
        (Some(r), true) => r.grants.iter().zip(&req.deltas).map(|(g, d)| g.grant >= d.units).collect(),
        _ => Vec::new(),
    };
    Seen { status, remaining, asked, nodes: resp.map(|r| r.nodes) }
}

/// The sequences, each a list of (wait before, call); returns what each call saw.
pub fn sequences(run: &str, store: &mut dyn SyncStore) -> Vec<(&'static str, Vec<Seen>)> {
    // Against a real store they take about a minute of its clock.
    clear_of_the_windows_end(store, 180 * SECOND);
    let late = key(run, "late");
    let hb = key(run, "heartbeat");
    let old = key(run, "older");
    let rep = key(run, "repeat");
    let asked = key(run, "ask");
    let many = key(run, "many");
    let skewed = key(run, "skewed");
    let refused = key(run, "refused");
    let mut out = Vec::new();
    let mut go = |name: &'static str, steps: Vec<(Nanos, SyncRequest)>, store: &mut dyn SyncStore| {
        out.push((name, run_steps(steps.into_iter().map(|(w, r)| (w, Step::Now(r))).collect(), store)));
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
    // More nodes on one counter than the Worker used to remember (64), then a repeat from
    // the first: counted once.
    let mut steps = vec![(0, batch(600, 1, &[(&many, 1)]))];
    steps.extend((601..=680).map(|n| (0, batch(n, 1, &[(&many, 0)]))));
    steps.push((0, batch(600, 1, &[(&many, 1)])));
    steps.push((0, batch(600, 2, &[(&many, 0)])));
    go("many nodes", steps, store);
    // An ask takes its units at once; its `remaining` is after them (the Worker reported it
    // before). A node asks under each number once: a copy of an ask answered — a captured one
    // sent again, after the node's next ask or not — is refused (409) and takes nothing.
    let ask = |n: u64| SyncRequest {
        node: 501,
        seq: n,
        sent: 0,
        deltas: vec![Delta { key: asked.clone(), limit: limit(), units: 4 }],
        ask: true,
    };
    out.push((
        "ask",
        // The ask comes once node 502's grant (which holds the last units) is off lease.
        run_steps(
            vec![
                (0, Step::Now(batch(502, 1, &[(&asked, 90)]))),
                (2 * SECOND + SECOND / 4, Step::Now(ask(1))),
                (0, Step::Replay(1)),
                (0, Step::Now(ask(2))),
                (0, Step::Replay(1)),
                (0, Step::Now(ask(1))),
                (0, Step::Now(batch(502, 2, &[(&asked, 0)]))),
            ],
            store,
        ),
    ));
    // A node whose clock is within 25 s of the store's is served, one further is refused
    // (422) and counts nothing — batches, heartbeats and asks alike.
    let ask_of = |node: u64, units: u64| SyncRequest {
        ask: true,
        deltas: vec![Delta { key: skewed.clone(), limit: limit(), units }],
        ..batch(node, 1, &[])
    };
    let s = |secs: i64| secs * SECOND as i64;
    out.push((
        "skewed clocks",
        run_steps(
            vec![
                (0, Step::Skewed(batch(701, 1, &[(&skewed, 3)]), s(20))),
                (0, Step::Skewed(batch(702, 1, &[(&skewed, 4)]), s(-20))),
                (0, Step::Skewed(batch(703, 1, &[(&skewed, 5)]), s(30))),
                (0, Step::Skewed(batch(704, 1, &[(&skewed, 6)]), s(-30))),
                (0, Step::Skewed(batch(705, 1, &[]), s(-30))),
                (0, Step::Skewed(ask_of(706, 1), s(40))),
                (0, Step::Now(batch(707, 1, &[(&skewed, 0)]))),
            ],
            store,
        ),
    ));
    // A body of the previous version (no time), and a delta for a concurrency limit (code 5:
    // never synced), are refused — 415 and 400 — and count nothing.
    let v1 = version_1_batch(801, 1, &refused, 5);
    let concurrent = Limit::new(Algorithm::Concurrent, 5, 60 * SECOND, None).unwrap();
    let code5 = SyncRequest {
        sent: store.now(),
        deltas: vec![Delta { key: refused.clone(), limit: concurrent, units: 1 }],
        ..batch(802, 1, &[])
    };
    out.push((
        "refused shapes",
        run_steps(
            vec![(0, Step::Raw(v1)), (0, Step::Raw(code5.encode())), (0, Step::Now(batch(803, 1, &[(&refused, 0)])))],
            store,
        ),
    ));
    out
}

/// A batch in the shape of protocol version 1: no time after the `seq`.
pub fn version_1_batch(node: u64, seq: u64, key: &[u8], units: u64) -> Vec<u8> {
    use ratewall_core::encoding::put_varint;
    let mut out = vec![1, 1];
    for v in [node, seq, 1, key.len() as u64] {
        put_varint(&mut out, v);
    }
    out.extend_from_slice(key);
    out.push(limit().algorithm().code());
    for v in [limit().requests(), limit().per(), limit().capacity(), units] {
        put_varint(&mut out, v);
    }
    out
}

/// Runs `steps` (each after its wait) against `store`; what each call saw.
pub fn run_steps(steps: Vec<(Nanos, Step)>, store: &mut dyn SyncStore) -> Vec<Seen> {
    let mut sent: Vec<(Option<SyncRequest>, Vec<u8>)> = Vec::new();
    let mut seen_all = Vec::new();
    for (wait, step) in steps {
        if wait > 0 {
            store.wait(wait);
        }
        let stamped = |r: SyncRequest, skew: i64, store: &dyn SyncStore| SyncRequest {
            sent: store.now().saturating_add_signed(skew),
            ..r
        };
        let (req, body) = match step {
            Step::Now(r) => {
                let r = stamped(r, 0, store);
                let body = r.encode();
                (Some(r), body)
            }
            Step::Skewed(r, skew) => {
                let r = stamped(r, skew, store);
                let body = r.encode();
                (Some(r), body)
            }
            Step::Raw(body) => (None, body),
            Step::Replay(n) => sent[n].clone(),
        };
        let (status, answer) = store.send(&body);
        seen_all.push(seen(req.as_ref(), status, &answer));
        sent.push((req, body));
    }
    seen_all
}

/// The replay the protocol's time defeats: a node's batch of 25 units is captured; the node
/// goes quiet, and past the stores' `seq` memory (60 s) another node syncs the counter — all
/// it takes for the store to forget the first node — and the captured batch is sent again
/// byte for byte. It is refused (422) and counts nothing: the counter's `remaining` is the
/// same after it. (Without the time, every store counted it again.) Against a real store this
/// waits out the memory on the real clock: 61 s.
pub fn replay_after_the_seq_memory(run: &str, store: &mut dyn SyncStore) -> Vec<Seen> {
    let k = key(run, "replayed");
    clear_of_the_windows_end(store, SEQ_MEMORY + 10 * SECOND);
    run_steps(
        vec![
            (0, Step::Now(batch(1001, 1, &[(&k, 25)]))),
            (SEQ_MEMORY + SECOND, Step::Now(batch(1002, 1, &[(&k, 0)]))),
            (0, Step::Replay(0)),
            (0, Step::Now(batch(1002, 2, &[(&k, 0)]))),
        ],
        store,
    )
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
