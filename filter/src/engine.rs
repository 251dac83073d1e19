//! The filter's logic, independent of proxy-wasm: configuration, identity extraction,
//! evaluation against the shared-data table, metrics, and the reply to send.

use crate::host::{headers, HeaderNames, Host, Level};
use crate::sync::Syncer;
use crate::table::{Grants, Table, TableCounters};
use ratewall_core::algo::Limit;
use ratewall_core::eval::{evaluate, Check, CheckResult, Outcome, Request, Skip, StoreError, Tally};
use ratewall_core::glob::normalize_path;
use ratewall_core::key::{client_key, parse_ip};
use ratewall_core::rules::{Config, Dimension, FailurePolicy, SyncOptions};
use ratewall_core::sync::{Delta, TopSection};
use ratewall_core::Nanos;
use ratewall_core::{render, ConfigError, Reply};
use std::borrow::Cow;
use std::cell::{Cell, OnceCell};
use std::rc::Rc;

/// A shared-data key read once per VM before any other: where the host has no shared data
/// (ngx_wasm_module without a `shm_kv` zone) this read traps, and the counters of
/// [`Engine::ready`] let the next instance know.
const PROBE_KEY: &str = "rw1/probe";
/// Set (to any value) once a VM found that the host ran a request on while it waited for an
/// ask's answer ([`Engine::pause_ignored`]): every VM of the proxy then decides at once.
const PAUSE_IGNORED_KEY: &str = "rw1/pause-ignored";
/// How long after a VM began its first shared-data call another VM still takes an unfinished
/// probe for one in progress rather than for a trap.
const PROBE_GRACE_MS: u64 = 1_000;
/// Most probes taken to be in progress at once (workers starting together); more out
/// within [`PROBE_GRACE_MS`] are instances that trapped.
const PROBES_IN_FLIGHT: u64 = 3;
/// Reads of the probe counters a VM makes while another VM's probe is in progress.
const PROBE_SPIN: usize = 2_000;
/// How long after a probe that trapped a tick probes again.
const REPROBE_AFTER_MS: u64 = 60_000;
/// Counts the requests passed without limits because no usable configuration is in force
/// (a rejected rules document with none before it, or no shared data).
pub const FALLBACK_METRIC: &str = "ratewall_config_rejected";
/// How often a filter serving without limits says so at error level.
pub const FALLBACK_LOG_EVERY: Nanos = 10 * ratewall_core::algo::SECOND;

/// Headers read before the identity headers: `:method`, `:path`, `X-Forwarded-For`.
const FIXED_HEADERS: usize = 3;
/// Where `X-Forwarded-For` is among them.
const XFF: usize = 2;

/// Per-rule metric ids.
#[derive(Clone, Copy, Debug, Default)]
struct RuleMetrics {
    allowed: Option<u32>,
    rejected: Option<u32>,
    shadow_rejected: Option<u32>,
    unkeyed: Option<u32>,
    cas_exhausted: Option<u32>,
    store_failed: Option<u32>,
    /// Leaky-bucket rules only: requests that waited their turn, and rejections because the
    /// queue was full.
    delayed: Option<u32>,
    queue_full: Option<u32>,
    /// Concurrency rules only: requests in flight (the proxy's, as last seen).
    in_flight: Option<u32>,
}

/// Node-wide metric ids.
#[derive(Clone, Copy, Debug, Default)]
struct NodeMetrics {
    evictions: Option<u32>,
    corrupt: Option<u32>,
    lost: Option<u32>,
    cas_conflicts: Option<u32>,
    /// Requests passed without limits: no usable configuration (here: no shared data).
    fallback: Option<u32>,
    /// Waits a host that cannot resume a paused request turned into 429s.
    waits_refused: Option<u32>,
}

/// What to do with a request.
#[derive(Debug)]
pub enum Verdict {
    /// Send this reply (or pass, adding its headers to the response).
    Reply(Reply),
    /// Wait, paused, for the store's answer to an ask.
    Ask(Asking),
    /// Admitted by a leaky bucket: wait, paused, for its turn, then pass with this reply.
    Wait(Waiting),
    /// Passes, holding concurrency slots until the request ends ([`Engine::release`]).
    Hold(Reply, Slots),
}

/// The concurrency slots a request holds: given back when it ends.
#[derive(Debug, Default)]
pub struct Slots {
    checks: Vec<Check>,
    at: Nanos,
}

impl Verdict {
    /// The reply this comes to, waits aside (tests).
    #[cfg(test)]
    pub fn into_reply(self) -> Reply {
        match self {
            Verdict::Reply(r) | Verdict::Wait(Waiting { reply: r, .. }) | Verdict::Hold(r, _) => r,
            Verdict::Ask(_) => Reply { status: 429, headers: Vec::new(), body: String::new() },
        }
    }
}

/// A request waiting its turn in a leaky bucket's queue.
#[derive(Debug)]
pub struct Waiting {
    /// When it goes (the host clock).
    pub until: Nanos,
    /// Its reply (a pass) once it goes.
    pub reply: Reply,
    /// The leaky-bucket checks it took a turn from, given back if it never goes.
    turns: Vec<Turn>,
    at: Nanos,
    /// Its concurrency slots, held while it waits and after.
    pub slots: Slots,
    /// The verdict its reply was rendered from: [`Engine::reply_now`] renders it again with
    /// its queues as they are when it goes.
    outcome: Outcome,
}

/// A turn in one leaky bucket's queue: the check, the turn given (the host clock) and the
/// queue's departure count then; departures after it move the turn up ([`Engine::turn`]).
#[derive(Clone, Debug)]
pub struct Turn {
    check: Check,
    at: Nanos,
    seq: u32,
}

impl Waiting {
    /// Its turns, for [`Engine::turn`].
    pub fn turns(&self) -> &[Turn] {
        &self.turns
    }
}

/// A request paused on an ask: what deciding it again needs.
#[derive(Debug)]
pub struct Asking {
    /// The ask's call token.
    pub token: u32,
    checks: Vec<Check>,
    skipped: Vec<(usize, Skip)>,
    wants: Vec<Delta>,
    asked_at: Nanos,
}

impl Asking {
    /// The longest valid answer to this ask: the glue reads no longer body.
    pub fn answer_cap(&self) -> usize {
        ratewall_core::sync::SyncResponse::max_len(self.wants.iter().map(|d| d.key.len()))
    }
}

/// Which time a request is decided.
#[derive(Clone, Copy, Debug)]
enum Round<'a> {
    /// First: it may still ask.
    First,
    /// After its ask: it may not ask again; `paid` are the keys whose units the store took
    /// (counted there, so not reported again); `failed`: the ask failed (or could not be
    /// made, the store failing), so the request is decided as while the store is out of
    /// reach: `open` rules on the node's local share, `closed` ones rejected (503).
    AfterAsk { paid: &'a [&'a [u8]], failed: bool },
}

/// A configured filter: validated rules, the table, and metric ids.
#[derive(Debug)]
pub struct Engine {
    config: Config,
    table: Table,
    rules: Vec<RuleMetrics>,
    node: NodeMetrics,
    /// The sync state, made with the table ([`Engine::ready`]) unless carried over.
    sync: OnceCell<Syncer>,
    /// Who the rules deny (top offenders).
    top: crate::top::Top,
    sync_opts: Option<SyncOptions>,
    /// Whether shared data works (None: not tried yet in this VM).
    shared: Cell<Option<bool>>,
    /// The metrics [`Engine::ready`] keeps its probes in.
    probe_metrics: OnceCell<(Option<u32>, Option<u32>, Option<u32>)>,
    /// When the filter last said at error level that it serves without limits.
    fallback_logged: Cell<Option<Nanos>>,
    /// When the filter last said at error level that the host dropped counters.
    lost_logged: Cell<Option<Nanos>>,
    /// The request headers read, in the order [`Engine::on_request`] expects them: `:method`,
    /// `:path`, `x-forwarded-for` (empty when untrusted), then the identity headers.
    header_names: HeaderNames,
    /// Per rule, whether it is exact: only those wait for the store (asks); the others decide
    /// at once, on their grant and overdraft. A shadow rule never is: no request waits on it,
    /// so an exact one, holding no grant before the store's answer, would say "would reject"
    /// of a client's first requests the store would have let through.
    exact: Vec<bool>,
    /// Whether a later configuration took this engine's sync state over
    /// ([`Syncer::continuing`]).
    retired: Cell<bool>,
    /// The engine that took it over ([`Engine::hand_over`]): the requests this one still
    /// decides (a filter chain draining after a push) record into, and sync through, its
    /// syncer, which is the one in force.
    successor: OnceCell<Rc<Engine>>,
    /// When the next periodic tick is due ([`Engine::tick_due`]).
    next_tick: Cell<Nanos>,
    /// Shadow rules' "would reject" lines: the second (Unix) and how many were logged in it,
    /// and how many were not ([`SHADOW_LINES_PER_SECOND`]).
    shadow_lines: Cell<(u64, u32, u64)>,
    /// Whether the host does not hold a paused request ([`Engine::pause_ignored`]): then no
    /// request waits for an ask.
    no_pause: Cell<bool>,
}

/// Most "would reject" lines a VM logs a second: past them a shadow rule's denials are
/// counted (its metric, its top keys) but not each logged, and the next line says how many
/// were not, so that a shadow rule on busy traffic does not flood the proxy's log.
pub const SHADOW_LINES_PER_SECOND: u32 = 10;

impl Engine {
    /// Logs that the shadow rule `rule` would reject `method path`, as the first
    /// [`SHADOW_LINES_PER_SECOND`] of a second; past them counts the line as not logged.
    fn shadow_line(&self, host: &dyn Host, rule: &str, method: &str, path: &str) {
        let second = host.now() / ratewall_core::SECOND;
        let (mut at, mut logged, held) = self.shadow_lines.get();
        if second != at {
            (at, logged) = (second, 0);
        }
        if logged >= SHADOW_LINES_PER_SECOND {
            self.shadow_lines.set((at, logged, held.saturating_add(1)));
            return;
        }
        let more =
            if held > 0 { format!(" ({held} more such lines not logged before this one)") } else { String::new() };
        host.log(Level::Info, &format!("ratewall: shadow rule \"{rule}\" would reject {method} {path}{more}"));
        self.shadow_lines.set((at, logged + 1, 0));
    }
}

/// The local limit while the global store is unreachable: `limit` scaled by this node's share
/// of the counter's traffic before the outage (`share` 65,535ths; rounded, at least 1), or,
/// with no share known (0), shared evenly by `nodes`.
pub(crate) fn share(limit: Limit, share: u16, nodes: u32) -> Limit {
    let part = |units: u64| {
        if share == 0 {
            (units / u64::from(nodes.max(1))).max(1)
        } else {
            // With a margin of 1/20th: a node's measured share is an estimate, and a node held
            // below its traffic leaves the others short too (the fleet then never reaches the
            // limit, and every denial is one the limit allowed).
            let scaled = u128::from(units) * u128::from(share) * u128::from(ratewall_core::sync::DEGRADED_MARGIN + 1)
                / u128::from(ratewall_core::sync::DEGRADED_MARGIN);
            u64::try_from((scaled + u128::from(u16::MAX / 2)) / u128::from(u16::MAX)).unwrap_or(u64::MAX).max(1)
        }
    };
    // A queue (or the part of it that goes at once) of none stays none.
    let part_of_queue = |units: u64| if units == 0 { 0 } else { part(units) };
    let burst = match limit.algorithm() {
        ratewall_core::Algorithm::TokenBucket => Some(part(limit.capacity())),
        // A leaky bucket keeps its queue (and the part of it that goes at once), scaled as its
        // rate is: its requests still wait their turn rather than be refused.
        ratewall_core::Algorithm::LeakyBucket => limit.burst().map(part_of_queue),
        _ => None,
    };
    let delay = part_of_queue(limit.delay()).min(burst.unwrap_or(0));
    match Limit::new(limit.algorithm(), part(limit.requests()), limit.per(), burst) {
        Ok(l) => l.with_delay(delay).unwrap_or(l),
        Err(_) => limit,
    }
}

/// Whether a rule counts requests in flight.
/// Whether a line said at most every `every` is due at `now`, given when it was `last` said;
/// if so, `now` is noted as the last time.
pub fn due(last: &Cell<Option<Nanos>>, now: Nanos, every: Nanos) -> bool {
    if last.get().is_some_and(|at| now.saturating_sub(at) < every) {
        return false;
    }
    last.set(Some(now));
    true
}

fn concurrent(r: &ratewall_core::rules::Rule) -> bool {
    r.limit.algorithm() == ratewall_core::Algorithm::Concurrent
}

/// Whether a rule queues (its default limit is a leaky bucket).
fn leaky(r: &ratewall_core::rules::Rule) -> bool {
    r.limit.algorithm() == ratewall_core::Algorithm::LeakyBucket
}

/// Metric-safe form of a rule name: `[a-z0-9_]`.
fn metric_name(rule: &str, what: &str) -> String {
    format!("ratewall_rule_{}_{what}", ratewall_core::rules::metric_form(rule))
}

impl Engine {
    /// Validates a rules document and prepares the table and metrics. On error nothing is
    /// changed: the caller keeps its previous engine. A `previous` engine's sync state
    /// carries over (see [`Syncer::continuing`]).
    pub fn configure(host: &dyn Host, document: &[u8], previous: Option<&Engine>) -> Result<Engine, ConfigError> {
        Ok(Engine::new(host, Config::parse(document)?, previous))
    }

    /// [`Engine::configure`] with a document already validated. A `previous` engine whose
    /// sync state carries over is retired: see [`Engine::hand_over`].
    pub fn new(host: &dyn Host, config: Config, previous: Option<&Engine>) -> Engine {
        let f = config.filter;
        let table = Table::new(f.slots, f.hash_seed, f.cas_retries);
        let rules = config
            .rules
            .iter()
            .map(|r| RuleMetrics {
                allowed: host.define_counter(&metric_name(&r.name, "allowed")),
                rejected: host.define_counter(&metric_name(&r.name, "rejected")),
                shadow_rejected: host.define_counter(&metric_name(&r.name, "shadow_rejected")),
                unkeyed: host.define_counter(&metric_name(&r.name, "unkeyed")),
                cas_exhausted: host.define_counter(&metric_name(&r.name, "cas_exhausted")),
                store_failed: host.define_counter(&metric_name(&r.name, "store_failed")),
                delayed: leaky(r).then(|| host.define_counter(&metric_name(&r.name, "delayed"))).flatten(),
                queue_full: leaky(r).then(|| host.define_counter(&metric_name(&r.name, "queue_full"))).flatten(),
                in_flight: concurrent(r).then(|| host.define_gauge(&metric_name(&r.name, "in_flight"))).flatten(),
            })
            .collect();
        let node = NodeMetrics {
            evictions: host.define_counter("ratewall_table_evictions"),
            corrupt: host.define_counter("ratewall_table_corrupt"),
            lost: host.define_counter("ratewall_table_lost"),
            cas_conflicts: host.define_counter("ratewall_table_cas_conflicts"),
            fallback: host.define_counter(FALLBACK_METRIC),
            waits_refused: host.define_counter("ratewall_waits_refused"),
        };
        // Shared data is first touched by a request or a tick, never here: on ngx_wasm_module
        // a trap in `on_configure` is fatal to the worker, and without a `shm_kv` zone the
        // first shared-data call traps. A VM that has used it already goes on at once.
        let proven = previous.is_some_and(|p| p.shared.get() == Some(true));
        let sync = OnceCell::new();
        if let (Some(opts), Some(p)) = (&config.sync, previous) {
            if let Some(old) = p.sync() {
                let _ = sync.set(Syncer::continuing(old, opts.clone()));
                p.retired.set(true);
            }
        }
        let sync_opts = config.sync.clone();
        let xff = if config.identity.ip.trusted_hops > 0 { "x-forwarded-for" } else { "" };
        let header_names = HeaderNames::new(
            [":method", ":path", xff]
                .into_iter()
                .map(String::from)
                .chain(config.identity.headers.iter().map(|(_, h)| h.clone()))
                .collect(),
        )
        .reporting_repeats_of(XFF);
        let top = crate::top::Top::new(host, &config, metric_name);
        let exact = config.rules.iter().map(|r| r.exact && r.mode == ratewall_core::rules::Mode::Enforce).collect();
        let engine = Engine {
            config,
            table,
            rules,
            node,
            sync,
            top,
            sync_opts,
            shared: Cell::new(None),
            probe_metrics: OnceCell::new(),
            fallback_logged: Cell::new(None),
            lost_logged: Cell::new(None),
            header_names,
            exact,
            retired: Cell::new(false),
            successor: OnceCell::new(),
            next_tick: Cell::new(0),
            shadow_lines: Cell::new((0, 0, 0)),
            no_pause: Cell::new(false),
        };
        if proven {
            engine.shared.set(Some(true));
            engine.prepare(host);
            // A resized table starts clean; the old one's entries are dropped (its keys stay).
            if let Some(old) = previous.map(|p| &p.table).filter(|t| t.buckets() != engine.table.buckets()) {
                old.clear(host);
            }
        }
        engine
    }

    /// Sets to 0 the gauges of this engine's rules that `next` takes out (a rule's
    /// `limited_keys`), or no longer counts in flight (its `in_flight`): nothing sets them
    /// again, and a gauge left as it was would show its last value for as long as the
    /// proxy runs.
    pub fn zero_gauges_left_by(&self, host: &dyn Host, next: &Config) {
        let form = |name: &str| ratewall_core::rules::metric_form(name);
        for (i, r) in self.config.rules.iter().enumerate() {
            let same = next.rules.iter().find(|n| form(&n.name) == form(&r.name));
            if same.is_none() {
                self.top.zero_gauge(host, i);
            }
            if let (Some(id), false) = (self.rules.get(i).and_then(|m| m.in_flight), same.is_some_and(concurrent)) {
                host.set_gauge(id, 0);
            }
        }
    }

    /// Links a retired engine (one whose sync state `successor` took over when configured
    /// with it as `previous`) to its successor: requests it still decides then record their
    /// units into, and ask through, the syncer in force, instead of one no tick drives any
    /// more. Does nothing to an engine that was not retired.
    pub fn hand_over(&self, successor: &Rc<Engine>) {
        if self.retired.get() && !std::ptr::eq(self, successor.as_ref()) {
            let _ = self.successor.set(Rc::clone(successor));
        }
    }

    /// The engine whose sync state is in force for this one: itself, or the last of its
    /// successors. Ticks and the answers to sync calls go to it.
    pub fn live(self: &Rc<Engine>) -> Rc<Engine> {
        let mut e = Rc::clone(self);
        while let Some(next) = e.successor.get().cloned() {
            e = next;
        }
        e
    }

    /// Whether the periodic tick ([`Engine::on_tick`]) is due at `now`; if so, the next one
    /// is one [`Engine::tick_interval`] later. Several root contexts of a VM may serve one
    /// engine: each asks, and it ticks once per interval.
    pub fn tick_due(&self, now: Nanos) -> bool {
        let Some(interval) = self.tick_interval() else { return false };
        // A next tick further ahead than one interval is from a clock that stepped back:
        // due now, not when the clock catches up.
        if crate::sync::waiting(self.next_tick.get(), now, interval) {
            return false;
        }
        self.next_tick.set(now.saturating_add(interval));
        true
    }

    /// Whether shared data can be used, found out on the first call in this VM: a host
    /// without it (ngx_wasm_module with no `shm_kv` zone) traps on the first shared-data
    /// call, so two counters in the host's metrics, which outlive a trapped instance (and, on
    /// ngx_wasm_module, a reload), record each first call tried and each that came back, and
    /// a gauge when the last began. More tried than came back: a probe is in progress in
    /// another VM (begun within [`PROBE_GRACE_MS`]; this one waits a little for it, and
    /// probes too while fewer than [`PROBES_IN_FLIGHT`] are out), or an earlier instance
    /// trapped there. Then this VM does not probe on a request: it serves without limits
    /// (counted in `ratewall_config_rejected`, said at error level), asking again at its next
    /// request, so the successors of a trapped instance stop trapping after a few. Once a trap is [`REPROBE_AFTER_MS`]
    /// old, one tick probes again (a trap in a tick fails no request): a `shm_kv` zone added
    /// since, with a reload, is found, and limits return.
    pub fn ready(&self, host: &dyn Host, tick: bool) -> bool {
        if let Some(ok) = self.shared.get() {
            return ok;
        }
        let (tried, came_back, probe_at) = *self.probe_metrics.get_or_init(|| {
            (
                host.define_counter("ratewall_shared_data_tried"),
                host.define_counter("ratewall_shared_data_ready"),
                host.define_gauge("ratewall_shared_data_probe_ms"),
            )
        });
        let read = |m: Option<u32>| m.and_then(|id| host.metric_value(id)).unwrap_or(0);
        let now_ms = host.now() / 1_000_000;
        let (mut t, mut c) = (read(tried), read(came_back));
        let age = now_ms.saturating_sub(read(probe_at));
        if t > c && age < PROBE_GRACE_MS {
            // Another worker's probe, just begun, takes a few host calls to come back: wait
            // for it (an instance that trapped never comes back, and this one serves open).
            for _ in 0..PROBE_SPIN {
                (t, c) = (read(tried), read(came_back));
                if t <= c {
                    break;
                }
            }
        }
        // Probes still out within the grace, but few: others' in progress (workers starting
        // together), taken for such — at the cost, on a host without shared data, of a trap
        // for each of the first few instances.
        let concurrent = t > c && t - c < PROBES_IN_FLIGHT && age < PROBE_GRACE_MS;
        if t > c && !concurrent && (!tick || age < REPROBE_AFTER_MS) {
            if age >= PROBE_GRACE_MS {
                self.say_fallback(host);
            }
            return false;
        }
        if let Some(id) = probe_at {
            host.set_gauge(id, now_ms);
        }
        if let Some(id) = tried {
            host.increment(id, 1);
        }
        let _ = host.shared_get(PROBE_KEY);
        if let Some(id) = came_back {
            // Every earlier probe settled: the ones that trapped are behind this one.
            host.increment(id, t.saturating_sub(c).saturating_add(1));
        }
        self.shared.set(Some(true));
        self.prepare(host);
        true
    }

    /// Creates the table's keys and joins the node's sync: the first shared-data writes.
    fn prepare(&self, host: &dyn Host) {
        if let Err(e) = self.table.create(host) {
            host.log(Level::Warn, &format!("ratewall: could not create the counter table: {e:?}"));
        }
        if let (Some(opts), None) = (&self.sync_opts, self.sync.get()) {
            let _ = self.sync.set(Syncer::new(host, opts.clone()));
        }
    }

    /// Says at error level, at most once a minute, that the host dropped counters: its shared
    /// data is too small for the table (or something else wrote over it).
    fn say_lost(&self, host: &dyn Host, now: Nanos) {
        if !due(&self.lost_logged, now, 60 * ratewall_core::SECOND) {
            return;
        }
        host.log(
            Level::Error,
            "ratewall: counters were dropped by the host (their counts start over, counted in ratewall_table_lost): \
             its shared data is too small for the counter table; on NGINX give `shm_kv` 128 bytes per \
             `filter.slots` entry (8m for the default 65,536; 128m for 1,048,576)",
        );
    }

    /// Says at error level, at most every [`FALLBACK_LOG_EVERY`], that requests pass
    /// without limits because the host has no shared data.
    fn say_fallback(&self, host: &dyn Host) {
        let now = host.now();
        if !due(&self.fallback_logged, now, FALLBACK_LOG_EVERY) {
            return;
        }
        host.log(
            Level::Error,
            "ratewall: the proxy has no shared data (on NGINX: add `shm_kv * 16m;` to the `wasm {}` block); \
             requests pass without limits, counted in ratewall_config_rejected; a minute after the last \
             attempt trapped the filter tries again (after a reload that added the zone, this is said of the \
             attempt before it until then, and limits are back within that minute)",
        );
    }

    /// The sync state in force, once the table is prepared: this engine's, or its
    /// successor's once it has one ([`Engine::hand_over`]).
    fn sync(&self) -> Option<&Syncer> {
        match self.successor.get() {
            Some(next) => next.sync(),
            None => self.sync.get(),
        }
    }

    /// The validated configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The counter table.
    pub fn table(&self) -> &Table {
        &self.table
    }

    /// How often the host should call [`Engine::on_tick`] (None: never needed).
    pub fn tick_interval(&self) -> Option<ratewall_core::Nanos> {
        let top = (!self.config.rules.is_empty()).then_some(crate::top::TICK);
        self.sync_opts.as_ref().map(|s| s.interval).or(top)
    }

    /// Whether some rule shapes (a leaky bucket): its admitted requests may wait their turn.
    pub fn shapes(&self) -> bool {
        self.config.rules.iter().any(leaky)
    }

    /// The periodic tick: merge this VM's denials into the proxy's top offenders, sync with
    /// the global store.
    pub fn on_tick(&self, host: &dyn Host) {
        if !self.ready(host, true) {
            return;
        }
        if !self.no_pause.get() && matches!(host.shared_get(PAUSE_IGNORED_KEY), Ok((Some(_), _))) {
            self.no_pause.set(true);
        }
        self.top.on_tick(host, &self.config);
        if let Some(s) = self.sync() {
            s.on_tick(host, &|node, deltas, given_up, limited| {
                let mut section = self.top.section(host, &self.config, node, deltas, limited);
                if let Some(given_up) = given_up {
                    let s = section.get_or_insert_with(TopSection::default);
                    s.absorb(given_up, (usize::MAX, None));
                    // In the document's order, as the store lists them (by hand: a sort's
                    // code cost the filter 10 KB).
                    let mut ordered = Vec::with_capacity(s.rules.len());
                    for rule in &self.config.rules {
                        if let Some(i) = s.rules.iter().position(|r| r.rule == rule.name) {
                            ordered.push(s.rules.swap_remove(i));
                        }
                    }
                    ordered.append(&mut s.rules);
                    s.rules = ordered;
                }
                section
            });
        }
    }

    /// The host ran on a request that was paused for an ask (its response came while the ask
    /// was out): ngx_wasm_module does so for a request on a kept-alive connection when the
    /// filter runs in NGINX's rewrite phase, and its worker can then crash when the ask's
    /// answer comes. From now on no request of the proxy waits for an ask (each is decided
    /// as with the store out of reach, the rule's `on_store_failure` deciding), and it is
    /// said at error level with the fix.
    pub fn pause_ignored(&self, host: &dyn Host) {
        if self.no_pause.replace(true) {
            return;
        }
        let _ = host.shared_set(PAUSE_IGNORED_KEY, b"1", None);
        host.log(
            Level::Error,
            "ratewall: the proxy ran a request on while it waited for the store's answer (NGINX runs \
             a request on a kept-alive connection so when the filter is in its rewrite phase, and a \
             worker can crash when the answer comes): add `proxy_wasm_request_headers_in_access on;` \
             beside `proxy_wasm` (docs/nginx.md); until the proxy is reloaded, no request waits for \
             the store (each is decided as with the store out of reach)",
        );
    }

    /// The longest valid answer to sync call `token`: the glue reads no longer body.
    pub fn answer_cap(&self, token: u32) -> usize {
        self.sync().map_or(0, |s| s.answer_cap(token))
    }

    /// The answer to a sync call (`status` 0: failed or timed out).
    pub fn on_sync_response(&self, host: &dyn Host, token: u32, status: u32, tag: Option<&[u8]>, body: &[u8]) {
        if let Some(s) = self.sync() {
            s.on_response(host, &self.table, token, status, tag, body);
        }
    }

    /// Decides one request from its headers: a reply, or an ask to the global store that the
    /// request waits for (paused), answered through [`Engine::on_ask_response`].
    pub fn on_request(&self, host: &dyn Host) -> Verdict {
        if !self.ready(host, false) {
            if let Some(id) = self.node.fallback {
                host.increment(id, 1);
            }
            return Verdict::Reply(Reply { status: 200, headers: Vec::new(), body: String::new() });
        }
        let now = host.now();
        let map = host.request_headers();
        let identity = &self.config.identity;
        // Every header the filter may read, found in one pass over the map: the two
        // pseudo-headers, X-Forwarded-For, then the identity headers. On the stack for up to
        // 13 identity headers.
        let wanted = self.header_names.len();
        let (mut small, mut large) = ([None; 16], Vec::new());
        let found: &mut [Option<&[u8]>] = match small.get_mut(..wanted) {
            Some(s) => s,
            None => {
                large.resize(wanted, None);
                &mut large
            }
        };
        let mut joined = Vec::new();
        let repeated = headers(&map, &self.header_names, found, &mut joined);
        let (fixed, rest) = found.split_at_mut(FIXED_HEADERS.min(found.len()));
        let (method_raw, path_raw, xff) = match fixed {
            [m, p, x] => (*m, *p, *x),
            _ => (None, None, None),
        };
        // X-Forwarded-For sent as several fields is one list (RFC 9110 §5.3), counted from
        // its right end: reading only the first field would let a client rotate a spoofed
        // one past a per-IP limit on a host that passes header lines as they arrive.
        let xff = if repeated { Some(&joined[..]) } else { xff };
        // A host that leaves the pseudo-headers out of the map is asked for them by name.
        fn pseudo<'a>(found: Option<&'a [u8]>, host: &dyn Host, name: &str) -> Cow<'a, [u8]> {
            match found {
                Some(v) => Cow::Borrowed(v),
                None => Cow::Owned(host.request_header(name).unwrap_or_default()),
            }
        }
        let method_raw = pseudo(method_raw, host, ":method");
        let method = ratewall_core::text(&method_raw).unwrap_or("");
        let path_raw = pseudo(path_raw, host, ":path");
        let path = normalize_path(&path_raw);
        // The matching rules' indices, on the stack up to 16 (past that, all of them in a Vec).
        let (mut small_m, mut large_m) = ([0usize; 16], Vec::new());
        let mut matched = 0;
        for (i, rule) in self.config.rules.iter().enumerate() {
            if rule.matcher.matches(method, &path) {
                match small_m.get_mut(matched) {
                    Some(slot) => *slot = i,
                    None => {
                        if large_m.is_empty() {
                            large_m.extend_from_slice(&small_m);
                        }
                        large_m.push(i);
                    }
                }
                matched += 1;
            }
        }
        let matching: &[usize] = if large_m.is_empty() { small_m.get(..matched).unwrap_or(&[]) } else { &large_m };
        // Header values count only when non-empty; the client IP is worked out only when a
        // matching rule keys on it.
        for v in rest.iter_mut() {
            *v = v.filter(|v| !v.is_empty());
        }
        let needs_ip =
            matching.iter().filter_map(|&i| self.config.rules.get(i)).any(|r| r.key.contains(&Dimension::Ip));
        let ip = needs_ip.then(|| {
            let src = identity.ip;
            let peer = || host.property(&["source", "address"]).as_deref().and_then(parse_ip);
            client_key(peer, xff, &src)
        });
        let ip = ip.flatten();
        let req = Request { method, path: &path, headers: rest, ip: ip.as_deref() };
        let (checks, skipped) = self.config.checks_of(&req, matching);
        self.decide(host, now, checks, skipped, (method, &path), Round::First)
    }

    /// The store's answer to a paused request's ask (`status` 0: the call failed): the units
    /// given join the grants, and the request is decided again — once; it never asks twice.
    pub fn on_ask_response(
        &self,
        host: &dyn Host,
        asking: Asking,
        status: u32,
        tag: Option<&[u8]>,
        body: &[u8],
    ) -> Verdict {
        let taken = match self.sync() {
            Some(s) => s.on_ask_response(host, &self.table, (&asking.wants, asking.asked_at), (status, tag, body)),
            None => Vec::new(),
        };
        let paid: Vec<&[u8]> =
            asking.wants.iter().zip(&taken).filter(|(_, t)| **t).map(|(w, _)| w.key.as_slice()).collect();
        // Each want answered, or the ask failed — but for a store that says it answered the
        // ask already (409: a copy of it came through another store, or a replay): the
        // request is decided on what the node holds, not as with the store out of reach (a
        // `closed` rule's 503 with the store in reach).
        let failed = taken.len() != asking.wants.len() && status != 409;
        // The request's method and path are not kept while it waits: a shadow rule's log line
        // after an ask names the rule only.
        let round = Round::AfterAsk { paid: &paid, failed };
        match self.decide(host, host.now(), asking.checks, asking.skipped, ("(after an ask)", ""), round) {
            // `decide` only asks when told it may; a 429 all the same.
            Verdict::Ask(_) => Verdict::Reply(Reply { status: 429, headers: Vec::new(), body: String::new() }),
            v => v,
        }
    }

    /// A request that waited its turn went away before it: its turns go back to the queues,
    /// so the requests after it are not held for it, and its slots are given back.
    /// Each waiter behind it in a queue moves up a turn (see [`crate::table::Departures`]).
    pub fn give_back(&self, host: &dyn Host, waiting: Waiting) {
        let mut counters = TableCounters::new(&self.table, host, Grants::Off, &[]);
        let now = host.now();
        for t in &waiting.turns {
            let shift = t.check.cost.saturating_mul(t.check.limit.interval());
            let span = t.check.limit.capacity().saturating_mul(t.check.limit.interval());
            let horizon = now.saturating_sub(span).saturating_sub(ratewall_core::algo::SECOND);
            counters.leaving = Some((t.at, t.seq, shift, horizon));
            let _ = ratewall_core::eval::Counters::refund(&mut counters, &t.check, waiting.at);
        }
        self.release(host, waiting.slots);
    }

    /// The reply of a request that waited its turn, as of now (when it goes): each leaky
    /// bucket's fields from its queue now, so that `r` counts the places left behind the
    /// requests that joined the queue meanwhile (its reply when it was admitted said those
    /// were free: a client trusting them found the queue full).
    pub fn reply_now(&self, host: &dyn Host, waiting: &Waiting) -> Reply {
        let host_now = host.now();
        let now = self.sync().map_or(host_now, |s| s.store_now(host_now));
        let mut outcome = waiting.outcome.clone();
        for t in &waiting.turns {
            let Some((state, _)) = self.table.queue(host, &t.check.key) else { continue };
            let (peeked, _) = t.check.limit.decide(&state, now, 0);
            for c in outcome.checks.iter_mut().filter(|c| c.rule == t.check.rule) {
                if let CheckResult::Decided(d) = &mut c.result {
                    (d.remaining, d.reset_after) = (peeked.remaining, peeked.reset_after);
                }
            }
        }
        render(&self.config, &outcome)
    }

    /// When a waiter with `turns` goes now (the host clock): the latest of its turns, each
    /// moved up by the waiters ahead of it that left. `until`: when it was to go.
    pub fn turn(&self, host: &dyn Host, turns: &[Turn], until: Nanos) -> Nanos {
        let mut latest = None;
        for t in turns {
            let moved = match self.table.queue(host, &t.check.key) {
                Some((_, q)) => q.turn(t.at, t.seq),
                None => t.at,
            };
            latest = Some(latest.map_or(moved, |l: Nanos| l.max(moved)));
        }
        latest.map_or(until, |l| l.min(until))
    }

    /// A request that held concurrency slots ended (its response completed, or its stream
    /// was reset): the slots are free again.
    pub fn release(&self, host: &dyn Host, slots: Slots) {
        let mut counters = TableCounters::new(&self.table, host, Grants::Off, &[]);
        let now = host.now();
        for c in &slots.checks {
            // The refund, and the gauge from the state it leaves, in one read and write (a
            // concurrency rule's counters take no grants, so this is the refund the core's
            // `Counters::refund` would make).
            let mut remaining = None;
            let _ = ratewall_core::eval::Counters::update(&mut counters, c, now, &mut |s, _| {
                let next = c.limit.refund(s, slots.at, c.cost);
                remaining = Some(c.limit.decide(&next, now, 0).0.remaining);
                Some((next, 0))
            });
            self.in_flight(host, c, remaining);
        }
    }

    /// Sets a concurrency rule's in-flight gauge from the slots `remaining`.
    fn in_flight(&self, host: &dyn Host, c: &Check, remaining: Option<u64>) {
        if let (Some(id), Some(r)) = (self.rules.get(c.rule).and_then(|m| m.in_flight), remaining) {
            host.set_gauge(id, c.limit.requests().saturating_sub(r));
        }
    }

    /// A request paused on an ask went away before the answer.
    pub fn ask_abandoned(&self) {
        if let Some(s) = self.sync() {
            s.ask_done();
        }
    }

    /// On a host that cannot resume a paused request later (ngx_wasm_module resumes one only
    /// from its own callbacks, not from the root's tick), a request a leaky bucket would hold
    /// for its turn is refused instead: what it took is given back, and its 429 says when its
    /// turn would have come (`Retry-After`, rounded up: waiting that long, it passes; the
    /// bucket's reset no longer counts it). What such a host passes at once is the bucket's
    /// `delay + 1`, so that is what `remaining` counts there, not the queue no request can
    /// wait in. Whether a request was refused.
    fn refuse_wait(
        &self,
        host: &dyn Host,
        checks: &[Check],
        outcome: &mut ratewall_core::eval::Outcome,
        counters: &mut TableCounters<'_>,
        now: Nanos,
    ) -> bool {
        let leaky = |c: &Check| c.limit.algorithm() == ratewall_core::Algorithm::LeakyBucket;
        if !checks.iter().any(leaky) || host.resumes_waiters() {
            return false;
        }
        let waits = |c: &Check, o: &ratewall_core::eval::CheckOutcome| match o.result {
            CheckResult::Decided(d) if o.mode == ratewall_core::rules::Mode::Enforce => c.limit.wait(&d, c.cost),
            _ => 0,
        };
        let refuse = !outcome.rejected && checks.iter().zip(&outcome.checks).any(|(c, o)| waits(c, o) > 0);
        for (c, o) in checks.iter().zip(outcome.checks.iter_mut()).filter(|(c, _)| leaky(c)) {
            if let CheckResult::Decided(d) = &mut o.result {
                // A token bucket of `delay + 1` at the bucket's rate: `remaining` counts what
                // goes at once, and `limit` is what the policy's window drains (`wait` reads
                // neither field).
                let queue = c.limit.burst().unwrap_or(0).saturating_sub(c.limit.delay());
                d.remaining = d.remaining.saturating_sub(queue);
                d.limit = c.limit.requests().max(c.limit.delay().saturating_add(1));
                // A request refused for a full queue passes, here, only once it would go at
                // once: when no more than `delay` turns are ahead of it (its `reset_after`, the
                // queue ahead, drained to that), not once it would fit the queue (a request of
                // 2 units that waited that was refused again).
                if !d.allowed {
                    let at_once = d.reset_after.saturating_sub(c.limit.delay().saturating_mul(c.limit.interval()));
                    d.retry_after = d.retry_after.map(|r| r.max(at_once));
                }
            }
        }
        if !refuse {
            return false;
        }
        for (c, o) in checks.iter().zip(&outcome.checks) {
            if let CheckResult::Decided(d) = o.result {
                if d.allowed && c.cost > 0 {
                    // A failed refund leaves the units spent: conservative, never over-admits.
                    let _ = ratewall_core::eval::Counters::refund(counters, c, now);
                }
            }
        }
        for (c, o) in checks.iter().zip(outcome.checks.iter_mut()) {
            let wait = waits(c, o);
            if let (CheckResult::Decided(d), true) = (&mut o.result, wait > 0) {
                d.allowed = false;
                d.remaining = 0;
                d.retry_after = Some(wait);
                d.reset_after = d.reset_after.saturating_sub(c.cost.saturating_mul(c.limit.interval()));
            }
        }
        outcome.rejected = true;
        true
    }

    /// Evaluates a request's checks against the table (and the store's grants), records the
    /// units for sync and the metrics, and renders the reply. In its first round a request
    /// that only spent grants deny, while the store had quota left, becomes an ask instead.
    fn decide(
        &self,
        host: &dyn Host,
        now: Nanos,
        mut checks: Vec<Check>,
        skipped: Vec<(usize, Skip)>,
        (method, path): (&str, &str),
        round: Round<'_>,
    ) -> Verdict {
        let (may_ask, paid, failed) = match round {
            Round::First => (true, &[][..], false),
            Round::AfterAsk { paid, failed } => (false, paid, failed),
        };
        let real_limits: Vec<Limit> =
            if self.sync().is_some() { checks.iter().map(|c| c.limit).collect() } else { Vec::new() };
        // With sync: admit on the store's grants while its data is fresh; else degrade, open
        // rules to `limit / nodes` locally and closed rules to rejection.
        let mut unavailable = Vec::new();
        let (grants, now) = match self.sync() {
            None => (Grants::Off, now),
            Some(s) if s.fresh(now) && !failed => (Grants::On { nodes: s.nodes() }, s.store_now(now)),
            Some(s) => {
                s.degraded(host);
                unavailable = self.config.rules.iter().map(|r| r.on_store_failure == FailurePolicy::Closed).collect();
                let nodes = s.nodes();
                for c in checks.iter_mut().filter(|c| c.limit.algorithm() != ratewall_core::Algorithm::Concurrent) {
                    let known = self.table.grant(host, &c.key).map_or(0, |g| g.share);
                    c.limit = share(c.limit, known, nodes);
                }
                (Grants::Off, s.store_now(now))
            }
        };
        let mut counters = TableCounters::new(&self.table, host, grants, &unavailable);
        counters.exact = &self.exact;
        if let (Some(s), Grants::On { .. }) = (self.sync(), grants) {
            counters.named_out = s.named_out(now);
            counters.came_back = s.came_back(now);
        }
        let mut outcome = evaluate(&self.config, &checks, &mut counters, now);
        if self.refuse_wait(host, &checks, &mut outcome, &mut counters, now) {
            if let Some(id) = self.node.waits_refused {
                host.increment(id, 1);
            }
        }
        let stats = counters.stats;
        let bump = |m: Option<u32>, by: u64| {
            if let (Some(id), true) = (m, by > 0) {
                host.increment(id, by);
            }
        };
        bump(self.node.evictions, stats.evictions);
        bump(self.node.corrupt, stats.corrupt);
        bump(self.node.cas_conflicts, stats.cas_conflicts);
        if stats.lost > 0 {
            bump(self.node.lost, stats.lost);
            self.say_lost(host, now);
        }
        if let (true, true, Some(s)) = (may_ask, outcome.rejected, self.sync()) {
            // Ask only when every rejection is a spent grant the store may still cover.
            let askable = &counters.askable;
            let asks = |c: &Check| askable.contains(&c.key);
            let all = checks.iter().zip(&outcome.checks).filter(|(_, o)| o.rejects()).all(|(c, _)| asks(c));
            if all && !askable.is_empty() {
                let wants: Vec<Delta> = checks
                    .iter()
                    .zip(&real_limits)
                    .filter(|(c, _)| asks(c))
                    .map(|(c, l)| Delta { key: c.key.clone(), limit: *l, units: c.cost })
                    .collect();
                let asked =
                    if self.no_pause.get() { Err(crate::sync::AskRefused::Failing) } else { s.ask(host, &wants) };
                match asked {
                    Ok(token) => {
                        return Verdict::Ask(Asking { token, checks, skipped, wants, asked_at: host.now() });
                    }
                    Err(crate::sync::AskRefused::Failing) => {
                        let round = Round::AfterAsk { paid: &[], failed: true };
                        return self.decide(host, host.now(), checks, skipped, (method, path), round);
                    }
                    Err(crate::sync::AskRefused::Busy) => {}
                }
            }
        }
        if let (Some(s), Grants::On { .. }) = (self.sync(), grants) {
            // A counter the store named out of quota is denied until a unit is free there
            // again (a fixed window's end), not for the short wait of a spent grant: a client
            // that waits its `Retry-After` is then not refused again. A sliding window's or
            // log's unit comes back within the window, where the node holds no grant for it
            // until an answer: for a rule that is not exact the wait is longer by
            // [`Syncer::lag`], past which the node takes that unit on an overdraft of one
            // (`Syncer::came_back`).
            //
            // A token bucket's denial by the limit itself waits also for the store: it counts
            // this node's units when their batch arrives (up to an interval and half a round
            // trip after they were admitted), and the node's grant for the unit that comes
            // back arrives with the answer to a renewal sent once it is back (the next tick,
            // and its round trip). Told only the limit's own wait, a client that waited it
            // was refused once more.
            let lag = s.lag();
            let mut fresh_view = false;
            for (c, o) in checks.iter().zip(outcome.checks.iter_mut()) {
                if let CheckResult::Decided(d) = &mut o.result {
                    let sliding = matches!(
                        c.limit.algorithm(),
                        ratewall_core::Algorithm::SlidingWindow | ratewall_core::Algorithm::SlidingLog
                    );
                    let lagging = sliding && !self.exact.get(c.rule).copied().unwrap_or(false);
                    if !d.allowed && d.retry_after == Some(ratewall_core::eval::ALLOWANCE_RETRY) {
                        if let Some(free) = s.out_until(ratewall_core::key::fnv1a(&c.key), now) {
                            let free = if lagging { free.saturating_add(lag) } else { free };
                            d.retry_after = Some(free.saturating_sub(now).max(ratewall_core::eval::ALLOWANCE_RETRY));
                        } else if c.limit.algorithm() == ratewall_core::Algorithm::FixedWindow
                            && self.table.grant(host, &c.key).is_some_and(|g| !g.more)
                        {
                            // A fixed window whose last answer left no quota beyond the node's
                            // grant, now spent: the window is out, until its end (the store's
                            // clock), before any answer names it so. Told a spent grant's
                            // second, a client was refused again after waiting it.
                            let per = c.limit.per().max(1);
                            let end = (now / per).saturating_add(1).saturating_mul(per);
                            d.retry_after = Some(end.saturating_sub(now).max(ratewall_core::eval::ALLOWANCE_RETRY));
                        }
                    } else if !d.allowed && lagging {
                        // Denied by the limit itself (the node's own count is full): its unit
                        // comes back as the store's does, and is taken the same way — once the
                        // store has it too, as the view says now (another VM may have written it
                        // since this one's tick). The store counted the node's units later, so
                        // it may free them later: where it has not said when, a sliding log's
                        // by up to one of its slots.
                        if !fresh_view {
                            s.read_view(host);
                            fresh_view = true;
                        }
                        let store = s.out_until(ratewall_core::key::fnv1a(&c.key), now).map(|f| f.saturating_sub(now));
                        let log = c.limit.algorithm() == ratewall_core::Algorithm::SlidingLog;
                        let later = if log && store.is_none() { c.limit.quantum() } else { 0 };
                        let store = store.unwrap_or(0);
                        d.retry_after = d.retry_after.map(|r| r.max(store).saturating_add(later).saturating_add(lag));
                    } else if !d.allowed && c.limit.algorithm() == ratewall_core::Algorithm::TokenBucket {
                        d.retry_after = d.retry_after.map(|r| r.saturating_add(lag));
                    }
                }
            }
        }
        if let Some(s) = self.sync() {
            // Deltas name each counter's real limit, not a degraded share of it. A denied
            // counter is named with 0 units: the next batch asks the store for a new grant
            // (its window may have rolled over, or quota come back).
            for ((c, real), o) in checks.iter().zip(&real_limits).zip(&outcome.checks) {
                if c.limit.algorithm() == ratewall_core::Algorithm::Concurrent {
                    continue;
                }
                if let CheckResult::Decided(d) = o.result {
                    let counted = paid.contains(&c.key.as_slice());
                    let admitted = d.allowed && !outcome.rejected;
                    s.record(host, &c.key, *real, if admitted && !counted { c.cost } else { 0 });
                    if admitted && counted {
                        // Units an ask took at the store: in no delta, but admitted all the same.
                        self.top.paid(c.rule, &c.key, c.cost);
                    }
                }
            }
            if counters.overdrawn && !outcome.rejected {
                s.overdrawn(host);
            }
        }
        // A leaky bucket's admitted request waits its turn (the longest of its queues'); a
        // concurrency rule's holds its slot until it ends.
        let mut wait = 0;
        let (mut turns, mut slots, mut delayed) = (Vec::new(), Vec::new(), Vec::new());
        let host_now = host.now();
        for (c, o) in checks.iter().zip(&outcome.checks) {
            let CheckResult::Decided(d) = o.result else { continue };
            match c.limit.algorithm() {
                ratewall_core::Algorithm::LeakyBucket if d.allowed && !outcome.rejected => {
                    let w = c.limit.wait(&d, c.cost);
                    if w > 0 {
                        delayed.push(c.rule);
                    }
                    if o.mode == ratewall_core::rules::Mode::Enforce {
                        wait = wait.max(w);
                    }
                    let seq = counters.seqs.iter().find(|(k, _)| *k == c.key).map_or(0, |(_, s)| *s);
                    turns.push(Turn { check: c.clone(), at: host_now.saturating_add(w), seq });
                }
                ratewall_core::Algorithm::Concurrent => {
                    self.in_flight(host, c, Some(d.remaining));
                    if d.allowed && !outcome.rejected {
                        slots.push(c.clone());
                    }
                }
                _ => {}
            }
        }
        let slots = Slots { checks: slots, at: now };
        for (rule, tally) in outcome.tally(&skipped) {
            let Some(m) = self.rules.get(rule) else { continue };
            match tally {
                Tally::Allowed => bump(m.allowed, 1),
                Tally::Rejected => {
                    bump(m.rejected, 1);
                    bump(m.queue_full, 1);
                    self.top.denied_by(rule, &checks, false);
                }
                Tally::Unkeyed => bump(m.unkeyed, 1),
                Tally::Failed(StoreError::Contention) => bump(m.cas_exhausted, 1),
                Tally::Failed(_) => bump(m.store_failed, 1),
                Tally::ShadowRejected => {
                    bump(m.shadow_rejected, 1);
                    self.top.denied_by(rule, &checks, true);
                    if let Some(rule) = self.config.rules.get(rule) {
                        self.shadow_line(host, &rule.name, method, path);
                    }
                }
            }
        }
        // A request that waits its turn is forwarded with its fields as of then (the Worker's
        // the same).
        outcome.waited(wait);
        let reply = render(&self.config, &outcome);
        if wait == 0 {
            if slots.checks.is_empty() {
                return Verdict::Reply(reply);
            }
            return Verdict::Hold(reply, slots);
        }
        for rule in delayed {
            if let Some(m) = self.rules.get(rule) {
                bump(m.delayed, 1);
            }
        }
        Verdict::Wait(Waiting { until: host_now.saturating_add(wait), reply, turns, at: now, slots, outcome })
    }
}

/// The deployment's choice for a VM without valid rules, from its VM configuration:
/// `Some(true)` (closed: 503) for `{"without_rules": "closed"}`, `Some(false)` (open: requests
/// pass) for `{"without_rules": "open"}` or none (empty, white space); `None` for anything
/// else. A deployment that wrote a configuration meant the one choice it can make, closed: the
/// glue takes a typo in it (`"clsoed"`) as closed, said at error level, rather than let every
/// request through with a warning.
pub fn without_rules(config: &[u8]) -> Option<bool> {
    use ratewall_core::json::Value;
    if config.trim_ascii().is_empty() {
        return Some(false);
    }
    let Ok(Value::Object(m)) = ratewall_core::json::parse(config) else { return None };
    match (m.len(), m.get("without_rules")) {
        (1, Some(Value::String(v))) if v == "closed" => Some(true),
        (1, Some(Value::String(v))) if v == "open" => Some(false),
        _ => None,
    }
}
