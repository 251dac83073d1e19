//! A deterministic multi-node simulation of cross-replica sync: nodes of several VMs each
//! running the *built* filter, a virtual clock (with per-node skew), ticks, and the core's
//! reference store answering the nodes' signed callouts — with faults injected between them.
//! It measures, per scenario, over-admission against the limit per window, false denials,
//! store calls per node per second and bytes per sync.

use crate::host::{Callout, FilterResult, HttpRequest, Node, Plugin, Started, Vm};
use ratewall_core::sync::{hex, sign, unhex, Store};
use ratewall_core::SECOND;
use std::collections::{BTreeMap, VecDeque};

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
    /// Every batch reaches the store twice and its answer arrives twice.
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
    /// The rule's algorithm: `fixed_window`, or `token_bucket` (burst = limit).
    pub algorithm: &'static str,
    /// Simulated time the traffic spreads over (default: `window × windows`).
    pub duration: Option<u64>,
}

/// What a scenario measured.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Mean over (counter, window) of max(0, admitted − limit) ÷ limit, in %.
    pub overadmission_pct: f64,
    /// The worst (counter, window), in %.
    pub overadmission_max_pct: f64,
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
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The rules document of the simulated fleet.
pub fn rules(s: &Scenario) -> String {
    serde_json::json!({
        "identity": {"user": {"header": "x-user-id"}},
        "rules": [{"name": "per-user", "key": ["user"], "algorithm": s.algorithm,
                   "limit": if s.algorithm == "token_bucket" {
                       serde_json::json!({"requests": s.limit, "per": format!("{}ms", s.window / MS), "burst": s.limit})
                   } else {
                       serde_json::json!({"requests": s.limit, "per": format!("{}ms", s.window / MS)})
                   }}],
        "filter": {"slots": 1024},
        "sync": {"cluster": "store", "secret": SECRET, "interval": "100ms", "timeout": "50ms",
                 "stale_after": "1s", "nodes": s.nodes}
    })
    .to_string()
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
                Err(_) => Some((409, Vec::new(), Vec::new())),
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
        duration: Some(5 * SECOND),
    }
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
    for _ in 0..s.nodes {
        let skew = if s.skew == 0 { 0 } else { rng.below(2 * s.skew) as i64 - s.skew as i64 };
        let node = Node::new(start.saturating_add_signed(skew));
        let vms = (0..s.vms).map(|_| Vm::start(&plugin, &node, config.as_bytes())).collect::<wasmtime::Result<_>>()?;
        fleet.push((node, vms, skew));
    }
    let mut store = Store::new(100_000, 2 * SECOND);
    let weights: Vec<f64> = (0..s.nodes)
        .map(|i| match s.spread {
            Spread::Zipf => 1.0 / (i as f64 + 1.0),
            Spread::Even => 1.0,
            Spread::OneNode => f64::from(u8::from(i == 0)),
        })
        .collect();
    let total_w: f64 = weights.iter().sum();
    let pick_node = |rng: &mut Rng| {
        let mut x = (rng.below(1 << 30) as f64 / f64::from(1u32 << 30)) * total_w;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len() - 1
    };
    let interval = 100 * MS;
    let per_window = (s.limit as f64 * s.load).round() as u64;
    let total_requests = per_window * s.keys as u64 * s.windows;
    // Requests spread evenly in time over the run.
    let duration = s.duration.unwrap_or(s.window * s.windows);
    let gap = duration / total_requests.max(1);
    let mut admitted: BTreeMap<(usize, u64), u64> = BTreeMap::new();
    let (mut false_denials, mut calls, mut sync_bytes, mut asks) = (0u64, 0u64, 0u64, 0u64);
    let mut held: VecDeque<(usize, usize, Callout, Option<Answer>)> = VecDeque::new();
    // The store's answer to a call from node `n` at `at`, through the faults in force.
    let call = |store: &mut Store, rng: &mut Rng, n: usize, c: &Callout, at: u64| -> Option<Answer> {
        let window_now = (at - start) / s.window;
        let faults = if window_now >= s.faults_from { s.faults } else { Faults::default() };
        let tag = signature(c);
        if faults.down || n < faults.partitioned || faults.slow {
            None
        } else if faults.error_5xx {
            Some((503, Vec::new(), b"unavailable".to_vec()))
        } else if faults.garbage {
            Some((200, Vec::new(), (0..64).map(|_| rng.next() as u8).collect()))
        } else {
            if faults.duplicate {
                let _ = answer(backend, store, at, &c.body, &tag);
            }
            answer(backend, store, at, &c.body, &tag)
        }
    };
    let mut next_tick = start;
    let mut t = start;
    // A real store runs on the real clock: the virtual one may not run ahead of it (leases and
    // windows would mean different things on each side).
    let real_start = std::time::Instant::now();
    let paced = matches!(backend, Backend::Http(_));
    for i in 0..total_requests {
        t = start + i * gap;
        while next_tick <= t {
            if paced {
                let ahead = (next_tick - start)
                    .saturating_sub(u64::try_from(real_start.elapsed().as_nanos()).unwrap_or(u64::MAX));
                std::thread::sleep(std::time::Duration::from_nanos(ahead));
            }
            let window_now = (next_tick - start) / s.window;
            let faults = if window_now >= s.faults_from { s.faults } else { Faults::default() };
            // Late answers from the previous tick arrive first.
            for (n, v, c, resp) in std::mem::take(&mut held) {
                deliver(&mut fleet[n].1[v], &c, resp)?;
            }
            for (n, (node, vms, skew)) in fleet.iter_mut().enumerate() {
                node.set_time(next_tick.saturating_add_signed(*skew));
                for (v, vm) in vms.iter_mut().enumerate() {
                    vm.tick()?;
                    for c in vm.take_callouts() {
                        calls += 1;
                        sync_bytes += c.body.len() as u64;
                        let resp = call(&mut store, &mut rng, n, &c, next_tick);
                        if faults.reorder {
                            held.push_back((n, v, c, resp));
                        } else {
                            if faults.duplicate {
                                deliver(vm, &c, resp.clone())?;
                            }
                            deliver(vm, &c, resp)?;
                        }
                    }
                }
            }
            next_tick += interval;
        }
        let key = (i % s.keys as u64) as usize;
        let n = pick_node(&mut rng);
        let v = rng.below(s.vms as u64) as usize;
        let (node, vms, skew) = &mut fleet[n];
        node.set_time(t.saturating_add_signed(*skew));
        let window = (t - start) / s.window;
        let count = admitted.entry((key, window)).or_insert(0);
        let req = HttpRequest::new("GET", "/").header("x-user-id", format!("user-{key}"));
        let r = match vms[v].begin(&req)? {
            Started::Done(r) => r,
            Started::Paused(ctx) => {
                // An ask: answered at once on the virtual clock (its latency is one store
                // round trip, which the simulation does not model).
                for c in vms[v].take_callouts() {
                    asks += 1;
                    calls += 1;
                    let resp = call(&mut store, &mut rng, n, &c, t);
                    deliver(&mut vms[v], &c, resp)?;
                }
                match vms[v].finish(ctx)? {
                    Some(r) => r,
                    None => wasmtime::bail!("a request stayed paused after its ask was answered"),
                }
            }
        };
        if r.passed {
            *count += 1;
        } else if *count < s.limit {
            false_denials += 1;
        }
    }
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
        admitted.values().map(|&a| a.saturating_sub(s.limit) as f64 / s.limit as f64 * 100.0).collect();
    Ok(Report {
        overadmission_pct: overs.iter().sum::<f64>() / overs.len().max(1) as f64,
        overadmission_max_pct: overs.iter().copied().fold(0.0, f64::max),
        false_denial_pct: false_denials as f64 / total_requests.max(1) as f64 * 100.0,
        calls_per_node_per_sec: calls as f64 / s.nodes as f64 / seconds.max(1e-9),
        bytes_per_sync: sync_bytes as f64 / calls.saturating_sub(asks).max(1) as f64,
        requests: total_requests,
        paused_pct: asks as f64 / total_requests.max(1) as f64 * 100.0,
        asks_per_node_per_sec: asks as f64 / s.nodes as f64 / seconds.max(1e-9),
        admitted: admitted.values().sum(),
    })
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
