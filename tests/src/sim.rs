//! A deterministic multi-node simulation of cross-replica sync: nodes of several VMs each
//! running the *built* filter, a virtual clock (with per-node skew), ticks, and the core's
//! reference store answering the nodes' signed callouts — with faults injected between them.
//! It measures, per scenario, over-admission against the limit per window, false denials,
//! store calls per node per second and bytes per sync.

use crate::host::{Callout, FilterResult, HttpRequest, Node, Plugin, Started, Vm};
use ratewall_core::sync::{hex, sign, unhex, Store};
use ratewall_core::SECOND;
use std::collections::BTreeMap;

/// The shared secret of the simulated fleet.
pub const SECRET: &str = "simulation-secret-0123456789";
const MS: u64 = 1_000_000;
const START: u64 = 1_800_000_000 * SECOND;

/// Faults between the nodes and the store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Every call fails (connection refused / timeout).
    pub down: bool,
    /// Answers arrive after the call's timeout (the node sees a timeout).
    pub slow: bool,
    /// The store answers 503.
    pub error_5xx: bool,
    /// The store answers 200 with an unsigned garbage body.
    pub garbage: bool,
    /// Every batch reaches the store twice (a duplicated request); its answer arrives once
    /// (a proxy answers each call of a token once: the SDK traps on a token answered twice).
    pub duplicate: bool,
    /// Answers arrive one tick late (after the node's next tick).
    pub reorder: bool,
    /// Nodes with an index below this cannot reach the store.
    pub partitioned: usize,
}

/// How traffic spreads over nodes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Spread {
    /// Node `i` gets a share proportional to `1 / (i + 1)`.
    Zipf,
    /// Every node alike.
    Even,
    /// All on node 0.
    OneNode,
    /// Each counter's client on one node at a time, as a client's keep-alive connection is
    /// through a load balancer: it moves to another node (drawn alike) after a stay of this
    /// many ns on average (exponentially distributed).
    Sticky(u64),
}

/// One scenario.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Its name in figure lines.
    pub name: &'static str,
    /// Nodes.
    pub nodes: usize,
    /// VMs per node.
    pub vms: usize,
    /// Counters (users) under load.
    pub keys: usize,
    /// The limit per window of each counter.
    pub limit: u64,
    /// The window.
    pub window: u64,
    /// Offered requests per counter per window, as a multiple of the limit.
    pub load: f64,
    /// Windows simulated.
    pub windows: u64,
    /// Traffic spread.
    pub spread: Spread,
    /// Node clocks skewed by up to this (ns), either way.
    pub skew: u64,
    /// Faults, and the window from which they apply (to the end).
    pub faults: Faults,
    /// The window from which `faults` apply.
    pub faults_from: u64,
    /// The RNG seed.
    pub seed: u64,
    /// The rule's algorithm: `fixed_window`, `sliding_window`, or `token_bucket` (burst =
    /// limit).
    pub algorithm: &'static str,
    /// Whether the rule is `"exact": true` (a spent grant waits for the store).
    pub exact: bool,
    /// Simulated time the traffic spreads over (default: `window × windows`).
    pub duration: Option<u64>,
    /// The store's round trip (ns; 0: every call is answered at once). Each call reaches the
    /// store after half of it and its answer the node after the other half, each half
    /// jittered by up to ±25 %; a call whose answer would come after its deadline fails at
    /// the deadline (the store has still applied it).
    pub rtt: u64,
    /// `sync.max_wait` (ns; `None`: its default, the call deadline).
    pub max_wait: Option<u64>,
    /// A token bucket's `burst` (`None`: the limit).
    pub burst: Option<u64>,
}

/// What a scenario measured. Over-admission and false denials are against one exact limiter
/// of the rule's own algorithm fed, in time order, with what the fleet admitted: a request the
/// fleet admitted while that limiter had no room for it is over-admitted, one it denied while
/// that limiter had room is a false denial. (For a fixed window: admitted beyond the limit in
/// the window, and denied while the window's count was under it.)
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Mean over (counter, window) of the requests admitted in it beyond the exact limiter's
    /// room ÷ limit, in %.
    pub overadmission_pct: f64,
    /// The worst (counter, window), in %.
    pub overadmission_max_pct: f64,
    /// The most the exact limiter's count ever stood above its limit, ÷ limit, in % (fixed and
    /// sliding windows; 0 for the others). Where the fleet runs a unit ahead of that limiter
    /// for a while, each admission meanwhile counts as over-admitted: this says by how much it
    /// was ahead.
    pub overadmission_peak_pct: f64,
    /// Denials while the counter's true global count was under the limit ÷ requests, in %.
    pub false_denial_pct: f64,
    /// Store calls per node per second.
    pub calls_per_node_per_sec: f64,
    /// Mean request body bytes per sync call.
    pub bytes_per_sync: f64,
    /// Requests offered.
    pub requests: u64,
    /// Requests that waited (paused) for an ask to the store, ÷ requests, in %.
    pub paused_pct: f64,
    /// Asks per node per second (included in `calls_per_node_per_sec`).
    pub asks_per_node_per_sec: f64,
    /// Requests admitted.
    pub admitted: u64,
    /// Added latency (the wait for an ask's answer; 0 for a request that did not wait) at
    /// the 50th, 99th and 99.9th percentiles of all requests, ms.
    pub added_latency_ms: [f64; 3],
}

struct Rng(u64);

/// An index drawn with probability `weights[i] / total` (`total`: their sum).
fn weighted(rng: &mut Rng, weights: &[f64], total: f64) -> usize {
    let mut x = (rng.below(1 << 30) as f64 / f64::from(1u32 << 30)) * total;
    for (i, w) in weights.iter().enumerate() {
        if x < *w {
            return i;
        }
        x -= w;
    }
    weights.len().saturating_sub(1)
}

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// A Poisson process's wait for its next event at `rate` per ns.
    fn wait(&mut self, rate: f64) -> u64 {
        let u = (self.below(1 << 30) as f64 + 1.0) / f64::from(1u32 << 30);
        (-u.ln() / rate) as u64
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The sync calls' deadline the simulated fleet is configured with: 50 ms, or three round
/// trips where the store is further (an operator sets the deadline above the round trip).
pub fn call_timeout(s: &Scenario) -> u64 {
    (50 * MS).max(3 * s.rtt)
}

/// The written bound on a scenario's over-admission per counter and window, in % of the limit
/// (docs/sync-protocol.md, "The error bound"): `n × c` for the nodes' overdrafts
/// (`c = max(1, limit / 100 / n)`; none for exact rules) plus what the fleet admits while a
/// batch is on its way, at most its offered rate × (round trip + one interval); where nodes
/// lose the store (down, slow, failing, cut off), plus degraded mode's term, `limit × 0.05 +
/// n / 2` (the caps' margin and their rounding).
pub fn bound_pct(s: &Scenario) -> f64 {
    let n = s.nodes as f64;
    let c = if s.exact { 0.0 } else { (s.limit as f64 / 100.0 / n).floor().max(1.0) };
    let rate = s.load * s.limit as f64 / (s.window as f64 / SECOND as f64);
    let in_flight = rate * (s.rtt + 100 * MS) as f64 / SECOND as f64;
    let f = &s.faults;
    let outage = f.down || f.slow || f.error_5xx || f.garbage || f.partitioned > 0;
    let degraded = if outage { s.limit as f64 * 0.05 + n / 2.0 } else { 0.0 };
    (n * c + in_flight + degraded) / s.limit as f64 * 100.0
}

/// The rules document of the simulated fleet.
pub fn rules(s: &Scenario) -> String {
    let mut doc = serde_json::json!({
        "identity": {"user": {"header": "x-user-id"}},
        "rules": [{"name": "per-user", "key": ["user"], "algorithm": s.algorithm,
                   "exact": s.exact,
                   "limit": if s.algorithm == "token_bucket" {
                       serde_json::json!({"requests": s.limit, "per": format!("{}ms", s.window / MS), "burst": s.burst.unwrap_or(s.limit)})
                   } else {
                       serde_json::json!({"requests": s.limit, "per": format!("{}ms", s.window / MS)})
                   }}],
        "filter": {"slots": 1024},
        "sync": {"cluster": "store", "secret": SECRET, "interval": "100ms",
                 "timeout": format!("{}ms", call_timeout(s) / MS), "stale_after": "1s", "nodes": s.nodes}
    });
    if let (Some(w), Some(sync)) = (s.max_wait, doc.get_mut("sync").and_then(|v| v.as_object_mut())) {
        sync.insert("max_wait".into(), format!("{}ms", w / MS).into());
    }
    doc.to_string()
}

/// The global store the fleet syncs to.
pub enum Backend<'a> {
    /// The core's reference store, in process, on the simulation's clock.
    Reference,
    /// A real store over HTTP (the Worker's `POST /v1/sync` in workerd), on its own clock.
    Http(&'a str),
}

/// Answers one signed batch (`None`: no answer, as for a refused connection).
fn answer(backend: &Backend<'_>, store: &mut Store, now: u64, body: &[u8], tag_hex: &[u8]) -> Option<Answer> {
    match backend {
        Backend::Reference => {
            let tag = unhex(tag_hex).unwrap_or_default();
            match store.handle_signed(now, SECRET.as_bytes(), body, &tag) {
                Ok(out) => Some((200, hex(&sign(SECRET.as_bytes(), &out)).into_bytes(), out)),
                Err(e) => Some((e.status(), Vec::new(), e.to_string().into_bytes())),
            }
        }
        Backend::Http(addr) => {
            let tag = String::from_utf8_lossy(tag_hex).into_owned();
            let headers = [("x-ratewall-signature", tag.as_str()), ("content-type", "application/octet-stream")];
            let r = crate::http::request(addr, "POST", "/v1/sync", &headers, body).ok()?;
            let sig = r.header("x-ratewall-signature").unwrap_or_default().as_bytes().to_vec();
            Some((r.status, sig, r.body))
        }
    }
}

/// The end-to-end scenario run against each real store (the Worker, ratewall-store): 3 nodes
/// × 2 VMs, two users, a token bucket of 40 an hour offered 2.5×, for 5 s.
pub fn end_to_end(name: &'static str) -> Scenario {
    Scenario {
        name,
        nodes: 3,
        vms: 2,
        keys: 2,
        limit: 40,
        window: 3600 * SECOND,
        load: 2.5,
        windows: 1,
        spread: Spread::Even,
        skew: 0,
        faults: Faults::default(),
        faults_from: 99,
        seed: 7,
        algorithm: "token_bucket",
        exact: false,
        duration: Some(5 * SECOND),
        rtt: 0,
        max_wait: None,
        burst: None,
    }
}

/// Three proxies × 2 VMs on one counter of 60 per 4 s (fixed windows, rules not exact), Zipf
/// traffic offered at 3× the limit: two thirds of each window come after its quota is spent,
/// where grants run out and nodes decide on their overdraft.
pub fn past_the_quota(name: &'static str) -> Scenario {
    Scenario {
        name,
        nodes: 3,
        vms: 2,
        keys: 1,
        limit: 60,
        window: 4 * SECOND,
        load: 3.0,
        windows: 2,
        spread: Spread::Zipf,
        skew: 0,
        faults: Faults::default(),
        faults_from: 99,
        seed: 5,
        algorithm: "fixed_window",
        exact: false,
        duration: None,
        rtt: 0,
        max_wait: None,
        burst: None,
    }
}

/// [`past_the_quota`]'s fleet offered 1.5× the limit over 4 windows, its busiest node (about
/// half the traffic) cut off from the store from the second window on: it admits its share
/// on its own, which the store does not hear of.
pub fn cut_off(name: &'static str) -> Scenario {
    Scenario {
        load: 1.5,
        windows: 4,
        faults: Faults { partitioned: 1, ..Faults::default() },
        faults_from: 1,
        seed: 42,
        ..past_the_quota(name)
    }
}

/// [`past_the_quota`]'s fleet offered 1.5× the limit over 4 windows by one client whose
/// connection moves from node to node (every 1.5 s on average), as a keep-alive connection
/// through a load balancer does: every node stays in reach of the store.
pub fn moving_client(name: &'static str) -> Scenario {
    Scenario { load: 1.5, windows: 4, spread: Spread::Sticky(1_500 * MS), seed: 11, ..past_the_quota(name) }
}

/// Runs a scenario against the reference store.
pub fn run(s: &Scenario) -> wasmtime::Result<Report> {
    run_with(s, &Backend::Reference)
}

/// Runs a scenario against `backend`.
pub fn run_with(s: &Scenario, backend: &Backend<'_>) -> wasmtime::Result<Report> {
    let plugin = Plugin::filter()?;
    // A real store answers on its own clock, and nodes refuse a store clock far from theirs
    // (`MAX_STORE_SKEW`): against one, the virtual clock starts at the real time.
    // Fixed windows are aligned to multiples of `per` since the epoch: so are the windows the
    // simulation counts in, or one of them would span two of the limit's. Against a real store
    // that means waiting for the next boundary (short windows only: it is up to one window).
    let start = match backend {
        Backend::Reference => START,
        Backend::Http(_) => {
            let wall = || {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(START, |d| u64::try_from(d.as_nanos()).unwrap_or(START))
            };
            let now = wall();
            if s.window <= 30 * SECOND {
                let boundary = now.div_ceil(s.window) * s.window;
                std::thread::sleep(std::time::Duration::from_nanos(boundary.saturating_sub(wall())));
                boundary
            } else {
                now
            }
        }
    };
    let config = rules(s);
    let mut rng = Rng(s.seed | 1);
    let mut fleet: Vec<(Node, Vec<Vm>, i64)> = Vec::new();
    for i in 0..s.nodes {
        let skew = if s.skew == 0 { 0 } else { rng.below(2 * s.skew) as i64 - s.skew as i64 };
        // Named by its place in the fleet: the node ids (hashed from it) are the same whatever
        // ran before.
        let node = Node::named(start.saturating_add_signed(skew), &format!("node-{i}"));
        let vms = (0..s.vms).map(|_| Vm::start(&plugin, &node, config.as_bytes())).collect::<wasmtime::Result<_>>()?;
        fleet.push((node, vms, skew));
    }
    let store = Store::new(100_000, 2 * SECOND);
    let weights: Vec<f64> = (0..s.nodes)
        .map(|i| match s.spread {
            Spread::Zipf => 1.0 / (i as f64 + 1.0),
            Spread::Even | Spread::Sticky(_) => 1.0,
            Spread::OneNode => f64::from(u8::from(i == 0)),
        })
        .collect();
    let total_w: f64 = weights.iter().sum();
    let pick_node = |rng: &mut Rng| weighted(rng, &weights, total_w);
    // For a sticky spread: each counter's node and until when it stays there.
    let mut stays: Vec<(usize, u64)> = vec![(0, 0); s.keys];
    let interval = 100 * MS;
    let per_window = (s.limit as f64 * s.load).round() as u64;
    let total_requests = per_window * s.keys as u64 * s.windows;
    // Requests spread evenly in time over the run.
    let duration = s.duration.unwrap_or(s.window * s.windows);
    let gap = duration / total_requests.max(1);
    let mut w = World {
        s,
        backend,
        start,
        interval,
        fleet,
        store,
        rng,
        queue: BTreeMap::new(),
        seq: 0,
        admitted: BTreeMap::new(),
        over: BTreeMap::new(),
        truth: BTreeMap::new(),
        exact_limit: exact_limit(s)?,
        false_denials: 0,
        peak_excess: 0,
        calls: 0,
        sync_bytes: 0,
        asks: 0,
        waits: Vec::new(),
    };
    let mut next_tick = start;
    let mut t = start;
    // A real store runs on the real clock: the virtual one may not run ahead of it (leases and
    // windows would mean different things on each side).
    let real_start = std::time::Instant::now();
    let paced = matches!(backend, Backend::Http(_));
    for i in 0..total_requests {
        t = start + i * gap;
        loop {
            // Answers due by the next tick arrive before it.
            let due = w.queue.keys().next().map(|(at, _)| *at).filter(|at| *at <= t.min(next_tick));
            if let Some(at) = due {
                w.event(at)?;
                continue;
            }
            if next_tick > t {
                break;
            }
            if paced {
                let ahead = (next_tick - start)
                    .saturating_sub(u64::try_from(real_start.elapsed().as_nanos()).unwrap_or(u64::MAX));
                std::thread::sleep(std::time::Duration::from_nanos(ahead));
            }
            w.tick(next_tick)?;
            next_tick += interval;
        }
        let key = (i % s.keys as u64) as usize;
        let n = match s.spread {
            Spread::Sticky(stay) => {
                if stays[key].1 <= t {
                    stays[key] = (pick_node(&mut w.rng), t + w.rng.wait(1.0 / stay as f64));
                }
                stays[key].0
            }
            _ => pick_node(&mut w.rng),
        };
        let v = w.rng.below(s.vms as u64) as usize;
        let (node, vms, skew) = &mut w.fleet[n];
        node.set_time(t.saturating_add_signed(*skew));
        let window = (t - start) / s.window;
        let req = HttpRequest::new("GET", "/").header("x-user-id", format!("user-{key}"));
        match vms[v].begin(&req)? {
            Started::Done(r) => w.decided(key, window, t, r.passed),
            Started::Paused(ctx) => {
                for c in vms[v].take_callouts() {
                    w.asks += 1;
                    w.send(n, v, c, t, Some(Paused { ctx, key, window, at: t }))?;
                }
            }
        }
    }
    // Requests still waiting get their answers.
    while let Some(at) = w.queue.keys().next().map(|(at, _)| *at) {
        w.event(at)?;
    }
    let World { fleet, admitted, over, peak_excess, false_denials, calls, sync_bytes, asks, mut waits, .. } = w;
    if std::env::var("RATEWALL_SIM_SUM").is_ok() {
        let mut sums: BTreeMap<String, i64> = BTreeMap::new();
        for (node, _, _) in &fleet {
            for m in node.metrics() {
                *sums.entry(m.name.clone()).or_default() += m.value;
            }
        }
        eprintln!("{sums:?}");
    }
    if std::env::var("RATEWALL_SIM_DEBUG").is_ok() {
        for (node, _, _) in &fleet {
            let m: Vec<String> = node
                .metrics()
                .iter()
                .filter(|m| m.name.contains("sync") || m.name.contains("per_user"))
                .map(|m| format!("{}={}", m.name, m.value))
                .collect();
            eprintln!("{m:?}");
            eprintln!("{:?}", node.logs().iter().rev().take(3).collect::<Vec<_>>());
        }
        eprintln!("{admitted:?}");
    }
    let seconds = (t - start) as f64 / SECOND as f64;
    if paced {
        // How far a real store's clock ran ahead of the simulation's: windows and leases mean
        // the same on both sides only while this stays small.
        let real = real_start.elapsed().as_secs_f64();
        eprintln!("simulation against a real store: {seconds:.1} s simulated in {real:.1} s");
    }
    let overs: Vec<f64> =
        admitted.keys().map(|k| over.get(k).copied().unwrap_or(0) as f64 / s.limit as f64 * 100.0).collect();
    Ok(Report {
        overadmission_pct: overs.iter().sum::<f64>() / overs.len().max(1) as f64,
        overadmission_max_pct: overs.iter().copied().fold(0.0, f64::max),
        overadmission_peak_pct: peak_excess as f64 / s.limit as f64 * 100.0,
        false_denial_pct: false_denials as f64 / total_requests.max(1) as f64 * 100.0,
        calls_per_node_per_sec: calls as f64 / s.nodes as f64 / seconds.max(1e-9),
        bytes_per_sync: sync_bytes as f64 / calls.saturating_sub(asks).max(1) as f64,
        requests: total_requests,
        paused_pct: asks as f64 / total_requests.max(1) as f64 * 100.0,
        asks_per_node_per_sec: asks as f64 / s.nodes as f64 / seconds.max(1e-9),
        admitted: admitted.values().sum(),
        added_latency_ms: {
            waits.sort_unstable();
            // Over all requests: those that did not wait added 0.
            let at = |q: f64| {
                let rank = ((q * total_requests as f64).ceil() as u64).max(1);
                let zeros = total_requests.saturating_sub(waits.len() as u64);
                match rank.checked_sub(zeros + 1) {
                    Some(i) => waits.get(i as usize).copied().unwrap_or(0) as f64 / MS as f64,
                    None => 0.0,
                }
            };
            [at(0.5), at(0.99), at(0.999)]
        },
    })
}

/// A request paused on an ask.
#[derive(Clone, Copy, Debug)]
struct Paused {
    ctx: u32,
    key: usize,
    window: u64,
    at: u64,
}

/// A call on its way: to the store, or its answer (`None`: failed) back to its VM.
enum Leg {
    Arrive,
    Answer(Option<Answer>),
}

struct InFlight {
    n: usize,
    v: usize,
    callout: Callout,
    leg: Leg,
    paused: Option<Paused>,
    /// When the answer reaches the VM after arriving at the store (the return half).
    back: u64,
    /// Its answer is lost (past the call's deadline): the VM sees a failure at the deadline.
    lost: bool,
}

/// The simulated fleet, its store, and the calls in flight between them.
struct World<'a> {
    s: &'a Scenario,
    backend: &'a Backend<'a>,
    start: u64,
    interval: u64,
    fleet: Vec<(Node, Vec<Vm>, i64)>,
    store: Store,
    rng: Rng,
    /// Calls in flight by (time of their next leg, order sent).
    queue: BTreeMap<(u64, u64), InFlight>,
    seq: u64,
    admitted: BTreeMap<(usize, u64), u64>,
    /// Per (counter, window): admitted while the exact limiter had no room.
    over: BTreeMap<(usize, u64), u64>,
    /// The most the exact limiter's count stood above its limit.
    peak_excess: u64,
    /// Per counter: the exact limiter's state, fed with what the fleet admitted.
    truth: BTreeMap<usize, ratewall_core::State>,
    exact_limit: ratewall_core::Limit,
    false_denials: u64,
    calls: u64,
    sync_bytes: u64,
    asks: u64,
    /// The added latency of every request that waited, ns.
    waits: Vec<u64>,
}

impl World<'_> {
    fn faults(&self, at: u64) -> Faults {
        if (at - self.start) / self.s.window >= self.s.faults_from {
            self.s.faults
        } else {
            Faults::default()
        }
    }

    /// The store's answer to a call from node `n` arriving at `at`, through the faults.
    fn answer(&mut self, n: usize, c: &Callout, at: u64) -> Option<Answer> {
        let faults = self.faults(at);
        let tag = signature(c);
        if faults.down || n < faults.partitioned || faults.slow {
            None
        } else if faults.error_5xx {
            Some((503, Vec::new(), b"unavailable".to_vec()))
        } else if faults.garbage {
            Some((200, Vec::new(), (0..64).map(|_| self.rng.next() as u8).collect()))
        } else {
            if faults.duplicate {
                let _ = answer(self.backend, &mut self.store, at, &c.body, &tag);
            }
            answer(self.backend, &mut self.store, at, &c.body, &tag)
        }
    }

    /// Half a round trip, jittered by up to ±25 %.
    fn half_trip(&mut self) -> u64 {
        let half = self.s.rtt / 2;
        let j = half / 4;
        if j == 0 {
            half
        } else {
            half - j + self.rng.below(2 * j + 1)
        }
    }

    fn push(&mut self, at: u64, f: InFlight) {
        self.seq += 1;
        self.queue.insert((at, self.seq), f);
    }

    /// A VM sends a call at `at`.
    fn send(&mut self, n: usize, v: usize, c: Callout, at: u64, paused: Option<Paused>) -> wasmtime::Result<()> {
        self.calls += 1;
        if paused.is_none() {
            self.sync_bytes += c.body.len() as u64;
        }
        if self.s.rtt == 0 {
            // Answered at once (a late answer under the reorder fault: by the next tick).
            let resp = self.answer(n, &c, at);
            if self.faults(at).reorder && paused.is_none() {
                let f = InFlight { n, v, callout: c, leg: Leg::Answer(resp), paused, back: 0, lost: false };
                self.push(at + self.interval, f);
                return Ok(());
            }
            return self.deliver(n, v, &c, resp, paused, at);
        }
        let (there, back) = (self.half_trip(), self.half_trip());
        let deadline = u64::from(c.timeout_ms) * MS;
        let lost = there + back > deadline;
        if lost {
            // The VM gives up at its deadline, whatever the store does with the call.
            let f = InFlight { n, v, callout: c.clone(), leg: Leg::Answer(None), paused, back: 0, lost: false };
            self.push(at + deadline, f);
        }
        let f = InFlight { n, v, callout: c, leg: Leg::Arrive, paused: if lost { None } else { paused }, back, lost };
        self.push(at + there, f);
        Ok(())
    }

    /// The next leg of the call due at `at`.
    fn event(&mut self, at: u64) -> wasmtime::Result<()> {
        let Some(((_, _), f)) = self.queue.pop_first() else { return Ok(()) };
        match f.leg {
            Leg::Arrive => {
                let resp = self.answer(f.n, &f.callout, at);
                if !f.lost {
                    let back = if self.faults(at).reorder { f.back + self.interval } else { f.back };
                    let InFlight { n, v, callout, paused, .. } = f;
                    self.push(
                        at + back,
                        InFlight { n, v, callout, leg: Leg::Answer(resp), paused, back: 0, lost: false },
                    );
                }
                Ok(())
            }
            Leg::Answer(resp) => self.deliver(f.n, f.v, &f.callout, resp, f.paused, at),
        }
    }

    /// An answer reaches its VM at `at`; a paused request it answers is decided.
    fn deliver(
        &mut self,
        n: usize,
        v: usize,
        c: &Callout,
        resp: Option<Answer>,
        paused: Option<Paused>,
        at: u64,
    ) -> wasmtime::Result<()> {
        let (node, vms, skew) = &mut self.fleet[n];
        node.set_time(at.saturating_add_signed(*skew));
        let vm = &mut vms[v];
        deliver(vm, c, resp)?;
        if let Some(p) = paused {
            let Some(r) = vm.finish(p.ctx)? else {
                wasmtime::bail!("a request stayed paused after its ask was answered")
            };
            self.waits.push(at - p.at);
            self.decided(p.key, p.window, at, r.passed);
        }
        Ok(())
    }

    /// Counts a request of `key` that arrived in `window`, decided at `at`, against the exact
    /// limiter.
    fn decided(&mut self, key: usize, window: u64, at: u64, passed: bool) {
        let state = self.truth.entry(key).or_insert(ratewall_core::State::Fresh);
        let (room, _) = self.exact_limit.decide(state, at, 1);
        *self.admitted.entry((key, window)).or_insert(0) += u64::from(passed);
        if passed {
            *state = self.exact_limit.consume(state, at, 1);
            self.peak_excess = self.peak_excess.max(excess(&self.exact_limit, state, at));
            if !room.allowed {
                *self.over.entry((key, window)).or_insert(0) += 1;
            }
        } else if room.allowed {
            self.false_denials += 1;
        }
    }

    /// Every VM's tick at `at`, and the batches it sends.
    fn tick(&mut self, at: u64) -> wasmtime::Result<()> {
        for n in 0..self.fleet.len() {
            for v in 0..self.fleet[n].1.len() {
                let (node, vms, skew) = &mut self.fleet[n];
                node.set_time(at.saturating_add_signed(*skew));
                vms[v].tick()?;
                for c in vms[v].take_callouts() {
                    self.send(n, v, c, at, None)?;
                }
            }
        }
        Ok(())
    }
}

/// How far `state`'s count stands above `limit`'s quota at `at` (fixed and sliding windows;
/// 0 for the others).
fn excess(limit: &ratewall_core::Limit, state: &ratewall_core::State, at: u64) -> u64 {
    let per = limit.per().max(1);
    let used = match *state {
        ratewall_core::State::FixedWindow { window, count } if window == at / per => u64::from(count),
        ratewall_core::State::SlidingWindow { window, prev, curr } if window == at / per => {
            let e = at % per;
            (u128::from(prev) * u128::from(per - e) / u128::from(per)) as u64 + u64::from(curr)
        }
        _ => 0,
    };
    used.saturating_sub(limit.requests())
}

/// The scenario's limit, as one exact limiter applies it.
fn exact_limit(s: &Scenario) -> wasmtime::Result<ratewall_core::Limit> {
    let algorithm = ratewall_core::Algorithm::from_name(s.algorithm)
        .ok_or_else(|| wasmtime::format_err!("unknown algorithm {}", s.algorithm))?;
    let burst = (algorithm == ratewall_core::Algorithm::TokenBucket).then_some(s.burst.unwrap_or(s.limit));
    ratewall_core::Limit::new(algorithm, s.limit, s.window, burst).map_err(|e| wasmtime::format_err!("{e:?}"))
}

/// A callout's `x-ratewall-signature` header (empty: none).
fn signature(c: &Callout) -> Vec<u8> {
    c.headers.iter().find(|(k, _)| k == "x-ratewall-signature").map(|(_, v)| v.clone()).unwrap_or_default()
}

/// Answers `c` from the reference `store` at `now` and delivers the answer to `vm`.
pub fn answer_from(store: &mut Store, now: u64, vm: &mut Vm, c: &Callout) -> wasmtime::Result<()> {
    let resp = answer(&Backend::Reference, store, now, &c.body, &signature(c));
    deliver(vm, c, resp)
}

/// Runs a request; if the filter pauses it on an ask, answers the ask from `store` at `now`
/// (`None`: the call fails, as with the store down) and finishes it.
pub fn request_with(
    store: Option<&mut Store>,
    now: u64,
    vm: &mut Vm,
    req: &HttpRequest,
) -> wasmtime::Result<FilterResult> {
    let ctx = match vm.begin(req)? {
        Started::Done(r) => return Ok(r),
        Started::Paused(ctx) => ctx,
    };
    let mut store = store;
    for c in vm.take_callouts() {
        match store.as_deref_mut() {
            Some(s) => answer_from(s, now, vm, &c)?,
            None => vm.deliver(&c, None)?,
        }
    }
    vm.finish(ctx)?.ok_or_else(|| wasmtime::format_err!("a request stayed paused after its ask was answered"))
}

/// A store answer: status, signature header (empty: none), body.
type Answer = (u16, Vec<u8>, Vec<u8>);

fn deliver(vm: &mut Vm, c: &Callout, resp: Option<Answer>) -> wasmtime::Result<()> {
    match resp {
        None => vm.deliver(c, None),
        Some((status, sig, body)) if sig.is_empty() => vm.deliver(c, Some((status, body))),
        Some((status, sig, body)) => vm.respond(c, status, &[("x-ratewall-signature", &sig)], body),
    }
}

/// The traffic shares of `nodes` Zipf nodes (node `i` ∝ 1 / (i + 1)), summing to 1.
fn zipf_shares(nodes: usize) -> Vec<f64> {
    let total: f64 = (1..=nodes).map(|i| 1.0 / i as f64).sum();
    (1..=nodes).map(|i| 1.0 / i as f64 / total).collect()
}

/// How a node decides a fixed window's counter with no store to ask, in [`outage_model`].
#[derive(Clone, Copy, Debug)]
pub enum Fallback {
    /// Up to `max(1, round(margin × s_i × limit))` units of the window (the filter's degraded
    /// mode), `s_i` the node's share exactly, or, `measured`, as one earlier window's
    /// admissions measured it.
    Caps { margin: f64, measured: bool },
    /// While the fleet's count, estimated from the clock at the rate before the outage, is
    /// under `margin × limit`: every node stops at one instant.
    Clock(f64),
    /// Within its cap (`cap × s_i × limit`), or while an estimate of the fleet's count is
    /// under `est × limit`: the clock's estimate and the node's own arrivals ÷ its share,
    /// the latter weighed `e / (e + k)` where `e` is the arrivals it expected by then.
    CapsOrEstimate { cap: f64, est: f64, k: f64 },
}

/// Decentralized fallbacks with no store at all, and the fleet's rate (and, but for measured
/// caps, the shares) known exactly: a model of the fault scenarios' outage windows and of
/// what any node-local rule can do in them (20 Zipf nodes, a fixed window of `limit` offered
/// 1.5 ×, Poisson arrivals, over `windows`). Returns (false denials ÷ requests, mean
/// over-admission per window, worst window), in %.
pub fn outage_model(policy: Fallback, limit: u32, windows: u32, seed: u64) -> (f64, f64, f64) {
    let (limit, nodes) = (f64::from(limit), 20usize);
    let offered = 1.5 * limit;
    let shares = zipf_shares(nodes);
    let mut rng = Rng(seed | 1);
    let (mut requests, mut false_denials, mut over, mut worst) = (0u64, 0u64, 0u64, 0u64);
    for _ in 0..windows {
        // Each node's cap, for the policies that have one.
        let (margin, measured) = match policy {
            Fallback::Caps { margin, measured } => (margin, measured),
            Fallback::CapsOrEstimate { cap, .. } => (cap, false),
            Fallback::Clock(_) => (0.0, false),
        };
        let capped_shares: Vec<f64> = if measured {
            let mut seen = vec![0u64; nodes];
            for _ in 0..limit as u64 {
                seen[weighted(&mut rng, &shares, 1.0)] += 1;
            }
            seen.iter().map(|n| *n as f64 / limit).collect()
        } else {
            shares.clone()
        };
        let caps: Vec<u64> = capped_shares.iter().map(|s| ((margin * s * limit).round() as u64).max(1)).collect();
        let (mut used, mut seen, mut global, mut window_over) = (vec![0u64; nodes], vec![0u64; nodes], 0u64, 0u64);
        let mut t = rng.wait(offered / SECOND as f64);
        while t < SECOND {
            let i = weighted(&mut rng, &shares, 1.0);
            seen[i] += 1;
            requests += 1;
            let clock = offered * t as f64 / SECOND as f64;
            let within_cap = caps.get(i).is_some_and(|c| used[i] < *c);
            let admit = match policy {
                Fallback::Caps { .. } => within_cap,
                Fallback::Clock(margin) => clock < margin * limit,
                Fallback::CapsOrEstimate { est, k, .. } => {
                    let expected = clock * shares[i];
                    let weight = expected / (expected + k);
                    let estimate = weight * seen[i] as f64 / shares[i] + (1.0 - weight) * clock;
                    within_cap || estimate < est * limit
                }
            };
            if admit {
                used[i] += 1;
                window_over += u64::from(global >= limit as u64);
                global += 1;
            } else if global < limit as u64 {
                false_denials += 1;
            }
            t += rng.wait(offered / SECOND as f64);
        }
        over += window_over;
        worst = worst.max(window_over);
    }
    let pct = |n: u64, of: f64| n as f64 / of.max(1.0) * 100.0;
    (pct(false_denials, requests as f64), pct(over, limit * f64::from(windows)), pct(worst, limit))
}

/// The floor of false denials where the quota comes back all along (a sliding window or a
/// token bucket at its limit) and no request waits: a model with no store and no delay at
/// all. One unit comes back every `1 / R` (`R` = 20 per second, 200 per 10 s), and is placed at
/// once on a node drawn by its exact share of the traffic (20 Zipf nodes); requests arrive at
/// 1.5 × `R` (Poisson), and one is admitted only where its node holds a unit. A unit not spent
/// within `lease` (ns; `None`: never) goes back and is placed again. Units are the exact
/// limiter's room, so nothing is over-admitted, and a request denied while any node holds a
/// unit is a false denial. Returns false denials ÷ requests, in %.
pub fn trickle_model(lease: Option<u64>, seconds: u64, seed: u64) -> f64 {
    let nodes = 20usize;
    let weights = zipf_shares(nodes);
    let mut rng = Rng(seed | 1);
    let (back_every, arrival_rate) = (SECOND / 20, 30.0 / SECOND as f64);
    // Each node's units, by when they were placed.
    let mut held: Vec<std::collections::VecDeque<u64>> = vec![std::collections::VecDeque::new(); nodes];
    let (mut next_back, mut t) = (0u64, 0u64);
    let (mut requests, mut false_denials) = (0u64, 0u64);
    while t < seconds * SECOND {
        t += rng.wait(arrival_rate);
        // Units come back, and lapsed ones are placed again, up to `t`.
        while next_back <= t {
            let i = weighted(&mut rng, &weights, 1.0);
            held[i].push_back(next_back);
            next_back += back_every;
        }
        if let Some(lease) = lease {
            let lapsed: usize = held
                .iter_mut()
                .map(|q| {
                    let n = q.iter().take_while(|at| t.saturating_sub(**at) > lease).count();
                    q.drain(..n).count()
                })
                .sum();
            for _ in 0..lapsed {
                let i = weighted(&mut rng, &weights, 1.0);
                held[i].push_back(t);
            }
        }
        requests += 1;
        let i = weighted(&mut rng, &weights, 1.0);
        if held[i].pop_front().is_none() && held.iter().any(|q| !q.is_empty()) {
            false_denials += 1;
        }
    }
    false_denials as f64 / requests.max(1) as f64 * 100.0
}
