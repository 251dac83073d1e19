//! An isolate as a node of the counter objects it uses (docs/sync-protocol.md, "The
//! Worker's own traffic"): it holds a grant per counter, as a filter node does, spends it in
//! isolate memory, and reports what it admitted in the background (a [`Call::Spend`], which
//! brings the next grant, when the grant runs low, or every [`REPORT_EVERY`] while the
//! object leases for less than [`MAX_LEASE`], near the quota's end). No request waits for the
//! object: past its grant (spent, lapsed, or not yet given) an isolate decides at once from
//! its copy of the counter's state (the object's, as of its last answer, with the units
//! admitted here since), and sends its report at once. Grants are strict at the object (the
//! grants on lease never sum past what remains); past them an isolate admits only units no
//! grant holds as far as its last answer showed: all of them while an answer within
//! [`FRESH`] named it the counter's only node; else its *share* of the quota ([`share`])
//! while at least half of it is free, and near the limit one unrepaid [`overdraft_cap`]
//! (repaid by an answer that grants it anything, or by any answer while it is the counter's
//! only node).

use super::Call;
use ratewall_core::algo::{Algorithm, Decision, Limit, Nanos, State};
use ratewall_core::eval::StoreError;
use ratewall_core::sync::{hex, unhex, window_of, MAX_LEASE, OVERDRAFT_PART, RETRY_HORIZON};
use serde_json::{json, Value};
use std::collections::HashMap;

/// Refunds a counter holds for the object at most, each of the units counted from one
/// instant (one goes with each report; past it the last takes the others').
const MAX_REFUNDS: usize = 8;

/// How long an answer naming the isolate the counter's only node lets it decide past its
/// grant on its copy: two report intervals (an isolate admitting past its grant is answered
/// every interval and round trip). Past it the copy may miss what other nodes admitted since:
/// trusted for ever, in the native simulation of a client's bursts spread over three
/// isolates (`bursts` at a 20 ms round trip and 0.8 of the limit, seeds 1-8) over-admission
/// went from 0.5 % to 8.1 %.
pub const FRESH: Nanos = 2 * REPORT_EVERY;

/// How often the background task looks for reports due: near a quota's end (a lease under
/// [`MAX_LEASE`]) one report per counter per this interval; further from it units wait for
/// the grant to run low (see `Held::due`).
pub const REPORT_EVERY: Nanos = 250 * super::MS;

/// A counter on which an isolate holding a grant has seen no request for this many of its
/// recent gaps between requests (and at least [`REPORT_EVERY`]) is idle there: its client
/// has moved to another isolate, or paused, and the grant goes back to the object
/// ([`Call::Spend`]'s `idle`).
pub const IDLE_GAPS: u64 = 8;

/// The `Retry-After` of a request denied because the isolate's grant and overdraft are
/// spent while its copy of the counter still shows room: its report has gone at once, and
/// the next grant is a round trip away (the header rounds up to whole seconds).
pub const SHORT_RETRY: Nanos = ratewall_core::SECOND;

/// Units an isolate may admit past its grant before an answer finds room for it: a
/// hundredth of the quota split over the `nodes` the object last counted on the counter,
/// at least 1 (as a filter node's overdraft, docs/sync-protocol.md, "The error bound").
pub fn overdraft_cap(quota: u64, nodes: u32) -> u64 {
    (quota / OVERDRAFT_PART / u64::from(nodes.max(1))).max(1)
}

/// Units an isolate may admit past its grant, before the object has counted them, while its
/// copy of the counter shows at least half the quota free beside every grant: the quota
/// split over the `nodes` the object last counted on the counter (as a filter node's first
/// interval admits `limit / nodes`). Far from the limit a client's burst is not cut at the
/// grant the object sized from the traffic it had seen (a new client's burst of 20 on a limit
/// of 100 a minute got 6 to 10 through, the rest short denials).
pub fn share(quota: u64, nodes: u32) -> u64 {
    quota / u64::from(nodes.max(1))
}

/// A counter object's answer to [`Call::Spend`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spent {
    /// The report's answer, when the call carried one: the isolate's new grant and its lease.
    pub grant: Option<(u64, Nanos)>,
    /// Units the ask took and gave (0: refused, or no ask); they include the request's
    /// `cost`.
    pub asked: u64,
    /// How long the isolate may spend the units given beside the asked ones.
    pub ask_lease: Nanos,
    /// Units remaining at the object, after this call.
    pub remaining: u64,
    /// Time until the object's quota is restored.
    pub reset_after: Nanos,
    /// For a refused ask: how long until one could take its units (`None`: never).
    pub retry_after: Option<Nanos>,
    /// The object's clock.
    pub now: Nanos,
    /// The counter's state after this call (`None` from an object that does not send it).
    pub state: Option<State>,
    /// Nodes active on the counter (0: not known).
    pub nodes: u32,
    /// Units the other nodes' grants held.
    pub held: u64,
}

fn u64_of(v: &Value, name: &str) -> Option<u64> {
    v.get(name)?.as_u64()
}

impl Spent {
    /// The reply body (JSON).
    pub fn encode(&self) -> String {
        json!({"grant": self.grant.map(|g| g.0), "lease": self.grant.map(|g| g.1), "asked": self.asked, "ask_lease": self.ask_lease,
               "remaining": self.remaining, "reset_after": self.reset_after, "retry_after": self.retry_after,
               "now": self.now, "state": self.state.as_ref().map(|s| hex(&s.encode())), "nodes": self.nodes,
               "held": self.held})
        .to_string()
    }

    /// Parses a reply body. `state`, `nodes` and `held` are optional (an object of an older
    /// version leaves them out); a `state` that does not decode is an error.
    pub fn decode(body: &str) -> Option<Spent> {
        let v: Value = serde_json::from_str(body).ok()?;
        let grant = match (v.get("grant")?, v.get("lease")?) {
            (Value::Null, Value::Null) => None,
            (g, l) => Some((g.as_u64()?, l.as_u64()?)),
        };
        let state = match v.get("state") {
            None | Some(Value::Null) => None,
            Some(s) => {
                let bytes = unhex(s.as_str()?.as_bytes())?;
                let (state, used) = State::decode(&bytes).ok()?;
                (used == bytes.len()).then_some(state)?.into()
            }
        };
        Some(Spent {
            grant,
            asked: u64_of(&v, "asked")?,
            ask_lease: u64_of(&v, "ask_lease")?,
            remaining: u64_of(&v, "remaining")?,
            reset_after: u64_of(&v, "reset_after")?,
            retry_after: v.get("retry_after").and_then(Value::as_u64),
            now: u64_of(&v, "now")?,
            state,
            nodes: u64_of(&v, "nodes").map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
            held: u64_of(&v, "held").unwrap_or(0),
        })
    }
}

/// How a request's check was charged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// By the object, at its clock's instant (given back with [`Call::Refund`]).
    Object(super::Taken),
    /// In isolate memory, from the grant or the overdraft (given back with
    /// [`Grants::refund`]), or denied there by its copy of the counter.
    Grant(Decision),
    /// Denied in isolate memory until the isolate's next grant ([`Local::Short`]).
    Short(Decision),
}

impl Answer {
    /// The decision.
    pub fn decision(&self) -> Decision {
        match self {
            Answer::Object(t) => t.decision,
            Answer::Grant(d) | Answer::Short(d) => *d,
        }
    }
}

/// How a check was decided in isolate memory (always at once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Local {
    /// Admitted from the grant.
    Admitted(Decision),
    /// Admitted past the grant: on the isolate's copy while it is the counter's only node, on
    /// its share or its overdraft, or, for a counter it has no answer for yet, as a fresh
    /// counter with its own admissions would admit it.
    Overdraft(Decision),
    /// Denied: its copy of the counter has no room (`Retry-After` as the counter's).
    Denied(Decision),
    /// Denied: the copy has room but the isolate's grant, share and overdraft are spent
    /// (`Retry-After`: [`SHORT_RETRY`]; the report for the next grant has gone). Its
    /// `remaining` is the copy's: the counter is not known to be out.
    Short(Decision),
    /// Not decided: the grant and overdraft are spent and the counter's object failed the
    /// last report, so no grant is coming — a store failure (the rule's `on_store_failure`
    /// decides: an `open` rule's local limit, a `closed` rule's 503), not a 429.
    Unreachable(Decision),
    /// Not decided: the isolate holds as many counters as it may, each with units not yet
    /// reported (a flood of new keys), so this one is not held; the object decides it, as an
    /// exact rule's (the decision given is the limit's for a fresh counter, unused).
    Full(Decision),
}

impl Local {
    /// The decision.
    pub fn decision(&self) -> Decision {
        match self {
            Local::Admitted(d)
            | Local::Overdraft(d)
            | Local::Denied(d)
            | Local::Short(d)
            | Local::Unreachable(d)
            | Local::Full(d) => *d,
        }
    }
}

/// What the glue starts for a counter's reports ([`Grants::schedule`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// The background task: it looks after this delay, then every [`REPORT_EVERY`] while
    /// units wait, and sends the reports due ([`Grants::report`]).
    Reports(Nanos),
    /// One report now ([`Grants::report_once`]), beside the task that sleeps.
    Once,
}

/// A report on its way (or to retry with the same `seq`).
#[derive(Clone, Copy, Debug)]
struct Report {
    seq: u64,
    units: u64,
    /// Of `units`, those admitted past the grant.
    past: u64,
    /// When the first of its units was admitted.
    since: Nanos,
    /// Units of earlier reports it gives back (their requests were rejected by another
    /// rule), and when the object counted them from: (since, units).
    refund: Option<(Nanos, u64)>,
    /// When it was cut (and first sent).
    first_sent: Nanos,
    /// Its last call failed: the task sends it again (else it is on its way).
    failed: bool,
    /// It gives the grant back ([`Held::idle`]).
    idle: bool,
}

/// One counter as this isolate holds it.
#[derive(Clone, Debug)]
struct Held {
    limit: Limit,
    /// Grant units left to spend, until `until` (the isolate's clock).
    left: u64,
    until: Nanos,
    /// The last grant received (the grant runs low below half of it).
    granted: u64,
    /// How long its lease was (the grant runs low past half of it).
    lease: Nanos,
    /// Units admitted here and not yet reported.
    pending: u64,
    /// Of `pending`, the units admitted past the grant.
    past: u64,
    /// When the first of `pending` was admitted (a fixed window's are all of that one
    /// window: see [`Held::drop_ended`]).
    pending_since: Nanos,
    report: Option<Report>,
    /// When the last report answered was cut, and its `since`: where a unit it carried was
    /// counted, for a refund.
    counted_cut: (Nanos, Nanos),
    /// Units the object counted that are to be given back (another rule rejected their
    /// requests), by the `since` of the report that carried them: one goes with each report.
    refunds: Vec<(Nanos, u64)>,
    /// A report should go at once, with or without units: the grant does not cover the
    /// requests coming.
    urgent: bool,
    /// The object's state at its last answer, with the units admitted here since (`None`:
    /// no answer yet).
    copy: Option<State>,
    /// What the other nodes' grants held at the last answer, until `held_until`.
    held: u64,
    held_until: Nanos,
    /// Nodes on the counter at the last answer.
    nodes: u32,
    /// When the last answer came (the isolate's clock).
    answered_at: Nanos,
    /// Units admitted past the grant since an answer last granted anything (repaid then).
    over: u64,
    /// When the last of them was admitted.
    over_at: Nanos,
    /// An answer from the object has come (since the counter was last decided as new to
    /// the isolate).
    answered: bool,
    /// An answer from the object has ever come.
    ever_answered: bool,
    /// The last report failed (no answer, or one that could not be read).
    failing: bool,
    /// When the last check came, and the recent gap between checks (a moving average).
    last_check: Nanos,
    gap: Nanos,
}

impl Held {
    fn new(limit: Limit) -> Held {
        Held {
            limit,
            left: 0,
            until: 0,
            granted: 0,
            lease: 0,
            pending: 0,
            past: 0,
            pending_since: 0,
            report: None,
            counted_cut: (0, 0),
            refunds: Vec::new(),
            urgent: false,
            copy: None,
            held: 0,
            held_until: 0,
            nodes: 0,
            answered_at: 0,
            over: 0,
            over_at: 0,
            answered: false,
            ever_answered: false,
            failing: false,
            last_check: 0,
            // A counter's first checks are taken as far apart: a grant goes back only once
            // some fifteen checks have come close together (a busy client, not a key that
            // sees a request now and then, for which giving back would double the calls).
            gap: MAX_LEASE,
        }
    }

    /// Of the units admitted here that the object's last answer does not count, the units that still count at `now`: a fixed window's
    /// admitted in an earlier window count in none (see [`Held::drop_ended`]).
    fn unreported_at(&self, now: Nanos) -> u64 {
        let current = |t: Nanos| window_of(&self.limit, t) == window_of(&self.limit, now);
        let pending = if current(self.pending_since) { self.pending } else { 0 };
        pending.saturating_add(self.report.filter(|r| current(r.since)).map_or(0, |r| r.units))
    }

    /// Forgets the pending units of a fixed window that has ended by `now`: they counted in
    /// their window, which is over, and reported now the object would count them in its
    /// current one (a client's last requests of a window would take from its next).
    fn drop_ended(&mut self, now: Nanos) {
        if window_of(&self.limit, self.pending_since) != window_of(&self.limit, now) {
            self.pending = 0;
            self.past = 0;
        }
    }

    /// Units admitted past the grant that the object has not counted yet (pending, or in
    /// the report on its way).
    fn unseen_past(&self) -> u64 {
        self.past.saturating_add(self.report.map_or(0, |r| r.past))
    }

    /// Whether the grant runs low at `now`: below half of what was granted, or its lease
    /// ends within two [`REPORT_EVERY`] or half of it (the next grant should arrive before it
    /// is spent or lapses), or a check went past it. (Within two intervals alone, every
    /// lease under 500 ms, as near a quota's end, was low at once: each admission sent a
    /// report.)
    fn low(&self, now: Nanos) -> bool {
        // A grant of 0 is low at once: units spent from the last grant while its report was
        // on its way are held by no grant at the object, so they must reach it now.
        self.answered
            && (self.urgent
                || self.left.saturating_mul(2) < self.granted.max(1)
                || self.until.saturating_sub(now) < (2 * REPORT_EVERY).min(self.lease / 2))
    }

    /// Whether a report is due at `now`: the object has not answered yet, the grant runs
    /// low, or the object leased it for less than [`MAX_LEASE`] (the quota runs out within
    /// two such leases at the fleet's rate). Far from the limit, units admitted from a grant
    /// wait until it runs low: the object holds the whole grant for the isolate while it is
    /// on lease, so what the others may take does not depend on how much of it was spent.
    /// Native simulation (`cargo bench -p ratewall-tests --bench worker`, seeds 1-8): object
    /// calls 447 → 301 per 1,000 admitted, false denials 1.05 % → 1.02 %. Near the end the
    /// reports every interval stay: without them, 265 calls and 1.19 % false denials (the
    /// grants, sized from reported traffic, went to the wrong isolates).
    fn due(&self, now: Nanos) -> bool {
        !self.answered || self.low(now) || self.lease < MAX_LEASE || self.idle(now)
    }

    /// Whether the grant should go back at `now`: [`Held::releasable`], and no check has
    /// come for [`IDLE_GAPS`] of the recent gaps between checks (at least [`REPORT_EVERY`]).
    /// A client whose requests stay on one isolate at a time (a keep-alive connection) leaves
    /// it holding what the object granted its traffic, most of what remains when it was the
    /// only busy node, and was given as much again at its next report: native simulation
    /// (`sticky5s_under`, one client at 0.8 × its limit moving every 5 s on average over 20
    /// isolates, seed 7) false denials 3.34 % → 1.40 %, object calls 56 → 41 per 1,000
    /// admitted; a client's bursts over three isolates (`bursts`, seeds 1-8) 3.77 % → 2.62 %;
    /// 20 isolates' Zipf traffic (seeds 1-8) 0.82 % → 0.87 %, 301 → 304 calls.
    fn idle(&self, now: Nanos) -> bool {
        self.last_check > 0 && self.releasable(now) && now.saturating_sub(self.last_check) >= self.quiet()
    }

    /// How long without a check makes the counter idle: [`IDLE_GAPS`] of the recent gaps
    /// between checks, at least [`REPORT_EVERY`].
    fn quiet(&self) -> Nanos {
        self.gap.saturating_mul(IDLE_GAPS).max(REPORT_EVERY)
    }

    /// Whether the grant may go back before its lease ends: [`Held::releasable`], and checks
    /// close enough together that a silence of [`IDLE_GAPS`] of their gaps ends within the
    /// lease. The background task looks again while this holds.
    fn may_go_idle(&self, now: Nanos) -> bool {
        self.last_check > 0 && self.releasable(now) && self.last_check.saturating_add(self.quiet()) < self.until
    }

    /// Whether the isolate holds a grant worth giving back: answered, on lease, with at least
    /// a hundredth of the quota (and 2 units) left. Smaller ones lapse on their own.
    fn releasable(&self, now: Nanos) -> bool {
        self.answered
            && !self.failing
            && now < self.until
            && self.left >= 2
            && self.left.saturating_mul(OVERDRAFT_PART) >= self.limit.quota()
    }

    fn live(&self, now: Nanos) -> bool {
        self.until > now || self.owes()
    }

    /// Whether it owes the object anything: units to report, a report in flight, refunds.
    fn owes(&self) -> bool {
        self.pending > 0 || self.report.is_some() || !self.refunds.is_empty()
    }

    /// The copy of the counter, or a fresh counter's state before any answer.
    fn state(&self) -> State {
        self.copy.clone().unwrap_or_default()
    }

    /// Records `cost` units admitted at `now`, `past` of them past the grant: reported later,
    /// and counted in the copy.
    fn admit(&mut self, now: Nanos, cost: u64, past: u64) -> Decision {
        self.drop_ended(now);
        if self.pending == 0 {
            self.pending_since = now;
        }
        self.pending = self.pending.saturating_add(cost);
        self.past = self.past.saturating_add(past);
        let (d, next) = self.limit.decide(&self.state(), now, cost);
        let state = if d.allowed { next } else { self.limit.consume(&self.state(), now, cost) };
        let (view, _) = self.limit.decide(&state, now, 0);
        self.copy = Some(state);
        Decision { allowed: true, retry_after: None, ..view }
    }
}

/// The background reports to one counter object.
#[derive(Debug, Default)]
struct Task {
    /// The glue's task for this object runs.
    running: bool,
    /// A [`Schedule::Once`] was started and has not sent its reports yet.
    kicked: bool,
    /// The counters of this object with a report due or on its way.
    keys: Vec<Vec<u8>>,
}

/// The isolate's grants, bounded to `cap` counters.
pub struct Grants {
    /// This isolate's node id at the objects (random per isolate).
    node: u64,
    /// The last report `seq` used (one sequence for all counters: each counter only needs
    /// it to grow).
    seq: u64,
    held: HashMap<Vec<u8>, Held>,
    cap: usize,
    /// The counter objects' shards ([`super::object_name`]).
    shards: u32,
    /// Background reports, by counter object.
    tasks: HashMap<String, Task>,
    /// Checks admitted from a grant.
    pub local: u64,
    /// Checks admitted on an overdraft.
    pub overdrafts: u64,
    /// Checks admitted on a counter new to the isolate, before the object's first answer.
    pub first: u64,
    /// Checks admitted past the grant on the isolate's copy while it was the counter's only
    /// node, or on its share.
    pub shared: u64,
    /// Checks denied in isolate memory with room left in the copy (grant and overdraft
    /// spent).
    pub short: u64,
    /// Admitted units never reported: given up after [`RETRY_HORIZON`] of failed reports, or
    /// forgotten when the map was full of live counters.
    pub dropped: u64,
}

/// The end of a lease that starts at `sent` and lasts `lease`, and, for a fixed window, no
/// later than the window's end (its grant is not carried into the next one).
fn lease_end(limit: &Limit, sent: Nanos, lease: Nanos) -> Nanos {
    let end = sent.saturating_add(lease);
    if limit.algorithm() == Algorithm::FixedWindow {
        return end.min(window_end(limit, sent));
    }
    end
}

fn window_end(limit: &Limit, t: Nanos) -> Nanos {
    let per = limit.per().max(1);
    (t / per).saturating_add(1).saturating_mul(per)
}

impl Grants {
    /// An isolate's grants as node `node`, holding at most `cap` counters.
    pub fn new(node: u64, cap: usize) -> Grants {
        Grants {
            node: node.max(1),
            seq: 0,
            held: HashMap::new(),
            cap: cap.max(1),
            shards: super::DEFAULT_SHARDS,
            tasks: HashMap::new(),
            local: 0,
            overdrafts: 0,
            first: 0,
            shared: 0,
            short: 0,
            dropped: 0,
        }
    }

    /// Spreads counters over `shards` objects (0: one object per counter). Counters held
    /// stay where they are reported.
    pub fn set_shards(&mut self, shards: u32) {
        self.shards = shards;
    }

    /// The object `key`'s counter lives in.
    pub fn object_of(&self, key: &[u8]) -> String {
        super::object_name(key, self.shards)
    }

    /// `key`'s counter, held from now if it was not: `None` when the isolate holds as many as
    /// it may and each owes the object something (units to report, a report in flight,
    /// refunds). Counters that owe nothing make room first, those merely holding a grant too
    /// (the object keeps it for its lease: it is not spent, only not free meanwhile); one that
    /// owes is never let go, so no admitted unit goes unreported.
    fn entry(&mut self, key: &[u8], limit: Limit, now: Nanos) -> Option<&mut Held> {
        if self.held.len() >= self.cap && !self.held.contains_key(key) {
            self.held.retain(|_, h| h.live(now));
            if self.held.len() >= self.cap {
                self.held.retain(|_, h| h.owes());
            }
            if self.held.len() >= self.cap {
                return None;
            }
        }
        let h = self.held.entry(key.to_vec()).or_insert_with(|| Held::new(limit));
        if h.limit != limit {
            // The rules changed: what was granted under the old limit is not spent under the
            // new one; the units admitted are still reported. The copy carries over (a state
            // of another algorithm reads as fresh).
            h.limit = limit;
            h.left = 0;
            h.until = 0;
        }
        Some(h)
    }

    /// Decides a check of `cost` units on `key` at once: from the grant; past it, on the units
    /// of the copy of the counter that no grant holds (all of them while the isolate was the
    /// counter's only node at an answer within [`FRESH`], its share while half the quota is
    /// free, else its overdraft); else denied. Past the grant, the counter's report goes at
    /// once (see [`Grants::schedule`]).
    pub fn check(&mut self, key: &[u8], limit: Limit, cost: u64, now: Nanos) -> Local {
        let Some(h) = self.entry(key, limit, now) else {
            return Local::Full(limit.decide(&State::default(), now, 0).0);
        };
        if h.last_check > 0 {
            h.gap = (h.gap.saturating_mul(3).saturating_add(now.saturating_sub(h.last_check))) / 4;
        }
        h.last_check = h.last_check.max(now);
        if now < h.until && cost <= h.left {
            h.left -= cost;
            let d = h.admit(now, cost, 0);
            self.local += 1;
            return Local::Admitted(d);
        }
        let (room, _) = limit.decide(&h.state(), now, cost);
        if !room.allowed {
            // The counter is out as far as this isolate knows: the counter's own
            // `Retry-After`; no report is due for it.
            return Local::Denied(room);
        }
        h.urgent = true;
        // A fixed window's overdraft is of its window: the next one starts with none.
        if limit.algorithm() == Algorithm::FixedWindow && window_end(&limit, h.over_at) != window_end(&limit, now) {
            h.over = 0;
        }
        // What is left of this isolate's grant (lapsed, or less than `cost`): spent first, the
        // rest of the check past it.
        let own = if now < h.until { h.left } else { 0 };
        let beyond = cost.saturating_sub(own);
        // Nothing owed: no unit unreported and no overdraft (a fixed window's units of a
        // window that has ended are owed in none).
        let quiet = h.answered && !h.failing && now >= h.until && h.unreported_at(now) == 0 && h.over == 0;
        let others = if now < h.held_until { h.held } else { 0 };
        if quiet && room.remaining.saturating_add(cost).saturating_sub(others).saturating_mul(2) >= limit.quota() {
            // Quiet since its grant lapsed, with nothing owed, and at least half the quota
            // free in its copy: the object has let the isolate's units go, as for an isolate
            // new to the counter. It is decided as one (below), on its copy, until the answer
            // to the report this check sends: a client's burst after a pause is not cut at
            // the overdraft's one unit. (Near the limit, where the copy may be stale, the
            // overdraft stays the only way past a grant.)
            h.answered = false;
        }
        if !h.answered {
            // New to this isolate: until the object's first answer (a round trip), it is
            // decided as a fresh counter with this isolate's admissions — what one client
            // may spend — so a new client's first requests are not refused for the lack of
            // a grant. What it admits beyond the quota's rest reaches the object with the
            // report, at most the rate × the round trip ("The error bound").
            let d = h.admit(now, cost, beyond);
            self.first += 1;
            return Local::Overdraft(d);
        }
        // Units no grant holds: what the copy has left, less what the other nodes' grants
        // held at the last answer (while those could still be on lease) and what is left of
        // this isolate's own.
        let (view, _) = limit.decide(&h.state(), now, 0);
        let free = view.remaining.saturating_sub(others).saturating_sub(own);
        // The counter's only node at an answer within [`FRESH`]: no other node took the units
        // its copy shows free, so it decides on its copy as the object would. A node that
        // starts on the counter meanwhile is new to it, decided so until its first answer;
        // this isolate learns of it with its next answer.
        let sole = h.nodes == 1 && now < h.answered_at.saturating_add(FRESH);
        // Far from the limit, its share of the quota past its grant, counted until the object
        // has counted it: a client's burst is not cut at a grant sized from the traffic the
        // object had seen. It over-admits only once the other nodes have admitted half the
        // quota since this isolate's last answer.
        let spare = free.saturating_sub(beyond).saturating_mul(2) >= limit.quota();
        let shared = h.nodes > 0 && spare && h.unseen_past().saturating_add(beyond) <= share(limit.quota(), h.nodes);
        if beyond <= free && !h.failing && (sole || shared) {
            h.left = h.left.saturating_sub(cost);
            let d = h.admit(now, cost, beyond);
            self.shared += 1;
            return Local::Overdraft(d);
        }
        // One unrepaid overdraft at a time: up to the cap, or one request's cost when that
        // is more (a request is never refused for costing more than the cap alone).
        let cap = overdraft_cap(limit.quota(), h.nodes);
        if beyond <= free && (h.over == 0 || h.over.saturating_add(beyond) <= cap) {
            h.over = h.over.saturating_add(beyond);
            h.over_at = now;
            h.left = h.left.saturating_sub(cost);
            let d = h.admit(now, cost, beyond);
            self.overdrafts += 1;
            return Local::Overdraft(d);
        }
        // The counter is not known to be out: its remaining is the copy's.
        let short = Decision { allowed: false, retry_after: Some(SHORT_RETRY), ..view };
        if h.failing {
            return Local::Unreachable(short);
        }
        self.short += 1;
        Local::Short(short)
    }

    /// Starts a report of `key`'s pending units (none, for an urgent one, which only brings
    /// a grant) and of its first refund owed, unless one is on its way.
    /// Units not yet due wait, unless `ride`: another counter's report goes to the same
    /// object now, and they go in the same call. (Its caller, [`Grants::due_reports`], has
    /// dropped a fixed window's units of a window that has ended.)
    fn next_report(&mut self, key: &[u8], now: Nanos, ride: bool) -> Option<Report> {
        let next = self.seq.wrapping_add(1).max(1);
        let h = self.held.get_mut(key)?;
        let idle = h.report.is_none() && h.idle(now);
        if h.report.is_some() || (h.pending == 0 && !h.urgent && !idle) || !(ride || h.due(now)) {
            return None;
        }
        self.seq = next;
        if idle {
            // Given back from now: the object frees it once the report is counted.
            h.left = 0;
            h.until = now;
        }
        let units = std::mem::take(&mut h.pending);
        let past = std::mem::take(&mut h.past);
        let since = if units > 0 { h.pending_since } else { now };
        let refund = (!h.refunds.is_empty()).then(|| h.refunds.remove(0));
        // Another refund owed goes with the next report, at once.
        h.urgent = !h.refunds.is_empty();
        let r = Report { seq: next, units, past, since, refund, first_sent: now, failed: false, idle };
        h.report = Some(r);
        Some(r)
    }

    /// What the glue should start for `key`'s object now, if anything: its background task
    /// of reports ([`Schedule::Reports`]: none runs, and units wait to be reported or a grant
    /// is needed), first at once when the object has not answered for the counter yet, the
    /// grant runs low (so the next one arrives before it is spent) or is spent, else after
    /// [`REPORT_EVERY`]; or, while that task sleeps and the counter's grant runs low, one
    /// report of the object's counters at once ([`Schedule::Once`]). Once any counter of the
    /// object has a report due, each sends every one of them with units: one call per
    /// object, whatever its counters.
    pub fn schedule(&mut self, key: &[u8], now: Nanos) -> Option<(String, Schedule)> {
        let object = self.object_of(key);
        let h = self.held.get_mut(key)?;
        if h.pending == 0 && h.report.is_none() && !h.urgent {
            return None;
        }
        let low = h.low(now);
        let idle = h.report.is_none();
        let task = self.tasks.entry(object.clone()).or_default();
        if !task.keys.iter().any(|k| k == key) {
            task.keys.push(key.to_vec());
        }
        if !task.running {
            task.running = true;
            let first = if low || !h.answered { 0 } else { REPORT_EVERY };
            return Some((object, Schedule::Reports(first)));
        }
        if low && idle && !task.kicked {
            task.kicked = true;
            return Some((object, Schedule::Once));
        }
        None
    }

    /// Starts a report of every counter of `object` with one due and none on its way.
    /// With `retry`, a report whose call failed goes again; a report on its way never does
    /// (its answer would give an old grant). Also says whether any report is on its way.
    fn due_reports(&mut self, object: &str, now: Nanos, retry: bool) -> (Vec<(Vec<u8>, Call)>, bool) {
        let keys: Vec<Vec<u8>> = self.tasks.get(object).map(|t| t.keys.clone()).unwrap_or_default();
        let (mut calls, mut waiting, mut done) = (Vec::new(), false, Vec::new());
        let node = self.node;
        // One call per object: once any of its counters is due, all of them with units go
        // (a fixed window's units of a window that has ended go in none, so not counting).
        for key in &keys {
            if let Some(h) = self.held.get_mut(key) {
                h.drop_ended(now);
            }
        }
        let ride = keys
            .iter()
            .any(|k| self.held.get(k).is_some_and(|h| h.report.is_none() && (h.pending > 0 || h.urgent) && h.due(now)));
        let spend = |limit, r: Report| {
            let (refund_at, refund) = r.refund.unwrap_or((0, 0));
            let (seq, units, at) = (r.seq, r.units, r.since);
            Call::Spend { limit, node, seq, units, ask: 0, cost: 0, at, refund, refund_at, idle: r.idle }
        };
        for key in keys {
            // A counter no longer held, or with nothing due, leaves the task.
            let Some((limit, report)) = self.held.get(&key).map(|h| (h.limit, h.report)) else {
                done.push(key);
                continue;
            };
            let send = match report {
                Some(r) => {
                    waiting |= !r.failed;
                    (retry && r.failed).then_some(r)
                }
                None => match self.next_report(&key, now, ride) {
                    Some(next) => Some(next),
                    // Units that wait for the grant to run low: the task looks again later.
                    // So do grants that may go back when idle.
                    None if self.held.get(&key).is_some_and(|h| {
                        (h.pending > 0 || !h.refunds.is_empty() || h.may_go_idle(now)) && h.report.is_none()
                    }) =>
                    {
                        waiting = true;
                        None
                    }
                    None => {
                        done.push(key);
                        continue;
                    }
                },
            };
            if let Some(r) = send {
                calls.push((key, spend(limit, r)));
            }
        }
        if let Some(t) = self.tasks.get_mut(object) {
            t.keys.retain(|k| !done.contains(k));
        }
        (calls, waiting)
    }

    /// The reports of a [`Schedule::Once`]: like [`Grants::report`], but only of counters
    /// with no report on its way, and it leaves the schedule as it is.
    pub fn report_once(&mut self, object: &str, now: Nanos) -> Vec<(Vec<u8>, Call)> {
        if let Some(t) = self.tasks.get_mut(object) {
            t.kicked = false;
        }
        self.due_reports(object, now, false).0
    }

    /// The background reports to `object` (a report whose call failed is sent again with
    /// its `seq`): `None` when nothing waits (the task ends); none to send while a report is
    /// on its way (the task sleeps, and sends it again if its call fails) or units wait for
    /// a report to be due.
    pub fn report(&mut self, object: &str, now: Nanos) -> Option<Vec<(Vec<u8>, Call)>> {
        let (calls, waiting) = self.due_reports(object, now, true);
        if calls.is_empty() && !waiting {
            if let Some(t) = self.tasks.get_mut(object) {
                t.running = false;
                if t.keys.is_empty() && !t.kicked {
                    self.tasks.remove(object);
                }
            }
            return None;
        }
        Some(calls)
    }

    /// Takes the object's answer (`Err`: the call failed) to the report `call` for `key`,
    /// sent at `sent`, received at `now`.
    pub fn answered(&mut self, key: &[u8], call: &Call, reply: Result<&str, StoreError>, sent: Nanos, now: Nanos) {
        let Call::Spend { limit, seq, .. } = *call else { return };
        let spent = reply.ok().and_then(Spent::decode);
        let Some(h) = self.held.get_mut(key) else { return };
        h.failing = spent.is_none();
        let Some(s) = spent else {
            if let Some(r) = h.report.as_mut().filter(|r| r.seq == seq) {
                r.failed = true;
            }
            if let Some(r) = h.report.filter(|r| r.seq == seq && now.saturating_sub(r.first_sent) > RETRY_HORIZON) {
                // Given up: a store that has forgotten the seq could count a later retry twice.
                // The refund it carried, of units an earlier report counted, goes with the next.
                self.dropped = self.dropped.saturating_add(r.units);
                h.report = None;
                if let Some(refund) = r.refund {
                    h.refunds.insert(0, refund);
                    h.urgent = true;
                }
            }
            // A counter decided as new to the isolate again after a quiet spell: the object
            // is failing, so it is decided as any counter whose object fails (past its grant,
            // its overdraft, then the rule's failure policy), not on its copy for ever.
            h.answered |= h.ever_answered;
            return;
        };
        if let Some(r) = h.report.filter(|r| r.seq == seq) {
            h.counted_cut = (r.first_sent, r.since);
            h.report = None;
        }
        // Past the first answer the isolate admits beyond its grants only on its overdraft
        // (an object that sends no state leaves the copy as this isolate's own count).
        h.answered = true;
        h.ever_answered = true;
        if let Some((grant, lease)) = s.grant {
            // The new grant replaces the old one; what was spent while the report was on
            // its way is spent from the new one. A grant finds room for the isolate: its
            // overdraft is repaid.
            h.left = grant.saturating_sub(h.pending);
            h.past = h.past.min(h.pending.saturating_sub(grant));
            h.granted = grant;
            h.until = lease_end(&limit, sent, lease);
            h.lease = h.until.saturating_sub(sent);
            if grant > 0 {
                h.over = 0;
            }
        }
        if let Some(state) = s.state {
            // The object's count, with what this isolate admitted since the report was cut.
            // and less the refunds the object has not had yet.
            let mut copy = limit.consume(&state, now, h.unreported_at(now));
            for (at, units) in h.report.and_then(|r| r.refund).iter().chain(&h.refunds) {
                copy = limit.refund(&copy, *at, *units);
            }
            h.copy = Some(copy);
            h.held = s.held;
            let until = sent.saturating_add(MAX_LEASE);
            h.held_until =
                if limit.algorithm() == Algorithm::FixedWindow { until.min(window_end(&limit, sent)) } else { until };
        }
        if s.nodes > 0 {
            h.nodes = s.nodes;
        }
        h.answered_at = now;
        if h.nodes == 1 && h.unseen_past() == 0 {
            // The only node: the object has counted every unit it admitted past its grants,
            // and no other node took the units its copy shows free, so its overdraft is
            // repaid (as by a grant). A client that waited the `Retry-After` its copy gave,
            // after the quota ran out on the overdraft, is admitted on it.
            h.over = 0;
        }
    }

    /// Whether `key`'s counter object failed its last report: the isolate decides on what it
    /// holds while the object is out of reach (a store failure in the rule's metrics).
    pub fn failing(&self, key: &[u8]) -> bool {
        self.held.get(key).is_some_and(|h| h.failing)
    }

    /// Gives back `cost` units a check admitted on `key` at `at` (another rule rejected the
    /// request): units not reported yet leave the next report (to the grant or overdraft);
    /// units already reported are given back to the object with the next report, named by
    /// when that report's units were counted from. Either way the copy has them back at once.
    pub fn refund(&mut self, key: &[u8], cost: u64, at: Nanos) {
        let Some(h) = self.held.get_mut(key) else { return };
        if h.pending >= cost && h.pending_since <= at {
            // Not cut into a report yet (a check's units are admitted and cut together).
            h.pending -= cost;
            h.past = h.past.min(h.pending);
            let from_over = cost.min(h.over);
            h.over -= from_over;
            h.left = h.left.saturating_add(cost - from_over);
            if let Some(copy) = &h.copy {
                h.copy = Some(h.limit.refund(copy, at, cost));
            }
            return;
        }
        // Reported: in the report on its way if it was cut at or after `at` and the one
        // before it was not, else in the last one answered (a check waits for its other rules
        // for at most a call's deadline: an older report is named by `at`).
        let since = match h.report {
            Some(r) if r.first_sent >= at && h.counted_cut.0 < at => r.since,
            _ if h.counted_cut.0 >= at => h.counted_cut.1,
            _ => at,
        };
        // Many at once: past [`MAX_REFUNDS`] the last entry takes them (they may leave a later
        // slot than theirs).
        let full = h.refunds.len() >= MAX_REFUNDS;
        match h.refunds.iter().position(|(s, _)| *s == since).or(full.then_some(MAX_REFUNDS - 1)) {
            Some(i) => {
                if let Some(owed) = h.refunds.get_mut(i) {
                    owed.1 = owed.1.saturating_add(cost);
                }
            }
            None => h.refunds.push((since, cost)),
        }
        h.urgent = true;
        if let Some(copy) = &h.copy {
            h.copy = Some(h.limit.refund(copy, since, cost));
        }
    }

    /// Counters held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edge::object::{Object, Shard};
    use crate::edge::Taken;
    use ratewall_core::SECOND;

    const T: Nanos = 1_700_000_000 * SECOND;
    const KEY: &[u8] = b"k";
    const MS: Nanos = super::super::MS;

    /// One isolate and one counter object. Reports run as the glue runs them: the task's
    /// when due (then every [`REPORT_EVERY`]), a one-off at once; each answered `rtt` later.
    struct Pair {
        object: Object,
        grants: Grants,
        limit: Limit,
        calls: u64,
        rtt: Nanos,
        due: Option<Nanos>,
        /// The last `seq` of [`Pair::other_node`]'s reports.
        other_seq: u64,
        /// Reports on their way: (answered at, sent at, call, the task's).
        flying: Vec<(Nanos, Nanos, Call, bool)>,
    }

    impl Pair {
        fn new(limit: Limit) -> Pair {
            let mut object = Object::default();
            object.load(None, Some(limit)).unwrap();
            Pair {
                object,
                grants: Grants::new(7, 100),
                limit,
                calls: 0,
                rtt: 0,
                due: None,
                flying: Vec::new(),
                other_seq: 0,
            }
        }

        /// Another node (node 99) reports `units` spent at `t`: the object counts two nodes on
        /// the counter for a while (`NODE_TTL`), and holds the grant it answers for it.
        fn other_node(&mut self, t: Nanos, units: u64) -> Spent {
            self.other_seq += 1;
            let (limit, seq) = (self.limit, self.other_seq);
            let call = Call::Spend {
                limit,
                node: 99,
                seq,
                units,
                ask: 0,
                cost: 0,
                at: t,
                refund: 0,
                refund_at: 0,
                idle: false,
            };
            Spent::decode(&self.object.handle(call, t).unwrap().reply).unwrap()
        }

        fn send(&mut self, call: Call, t: Nanos, task: bool) {
            self.calls += 1;
            self.flying.push((t + self.rtt, t, call, task));
        }

        /// Everything due by `t`: answers, the task's report, and what the grants ask for.
        fn run(&mut self, t: Nanos) {
            loop {
                self.flying.sort_by_key(|f| f.0);
                if let Some(&(at, sent, call, task)) = self.flying.first().filter(|f| f.0 <= t) {
                    self.flying.remove(0);
                    let reply = self.object.handle(call, sent + self.rtt / 2).unwrap().reply;
                    self.grants.answered(KEY, &call, Ok(&reply), sent, at);
                    if task {
                        self.due = Some(at + REPORT_EVERY);
                    }
                    continue;
                }
                if let Some(d) = self.due.filter(|d| *d <= t) {
                    // The task: its reports, or it sleeps while units wait, or it ends.
                    let object = self.grants.object_of(KEY);
                    self.due = match self.grants.report(&object, d) {
                        Some(calls) if calls.is_empty() => Some(d + REPORT_EVERY),
                        Some(calls) => {
                            for (key, call) in calls {
                                assert_eq!(key, KEY);
                                self.send(call, d, true);
                            }
                            None
                        }
                        None => None,
                    };
                    continue;
                }
                break;
            }
            match self.grants.schedule(KEY, t) {
                Some((_, Schedule::Reports(d))) => self.due = Some(t + d),
                Some((object, Schedule::Once)) => {
                    for (key, call) in self.grants.report_once(&object, t) {
                        assert_eq!(key, KEY);
                        self.send(call, t, false);
                    }
                }
                None => {}
            }
            if self.due.is_some_and(|d| d <= t) || self.flying.iter().any(|f| f.0 <= t) {
                self.run(t);
            }
        }

        fn request(&mut self, t: Nanos) -> Local {
            self.request_of(t, 1)
        }

        fn request_of(&mut self, t: Nanos, cost: u64) -> Local {
            self.run(t);
            let local = self.grants.check(KEY, self.limit, cost, t);
            self.run(t);
            local
        }

        /// The object's count, as a per-request check would see it.
        fn object_remaining(&mut self, t: Nanos) -> u64 {
            let view = self.object.handle(Call::Take { limit: self.limit, cost: 0 }, t).unwrap().reply;
            Taken::decode(&view).unwrap().decision.remaining
        }
    }

    impl Grants {
        /// The task's report of [`KEY`] alone (as if it were due), at `t`.
        fn report_key(&mut self, t: Nanos) -> Option<Call> {
            let object = self.object_of(KEY);
            self.tasks.entry(object.clone()).or_default().keys = vec![KEY.to_vec()];
            let mut calls = self.report(&object, t).unwrap_or_default();
            assert!(calls.len() <= 1);
            calls.pop().map(|(key, call)| {
                assert_eq!(key, KEY);
                call
            })
        }
    }

    fn sliding(requests: u64) -> Limit {
        Limit::new(Algorithm::SlidingWindow, requests, 60 * SECOND, None).unwrap()
    }

    fn fixed(requests: u64, per: Nanos) -> Limit {
        Limit::new(Algorithm::FixedWindow, requests, per, None).unwrap()
    }

    #[test]
    fn a_hot_key_is_decided_in_isolate_memory_and_never_past_its_limit() {
        let mut p = Pair::new(sliding(10_000));
        let mut admitted = 0;
        // 1,000 requests a second for 2 s: well under the limit.
        for i in 0..2000 {
            let d = p.request(T + i * SECOND / 1000).decision();
            assert!(d.allowed, "request {i} denied: {d:?}");
            admitted += 1;
        }
        assert!(p.calls <= 40, "{} object calls for {admitted} admitted", p.calls);
        assert!(p.grants.local >= 1950, "{}", p.grants.local);
        // Then past the limit, one isolate alone: the limit, and at most its overdraft more.
        let t = T + 3 * SECOND;
        for i in 0..9000 {
            admitted += u64::from(p.request(t + i).decision().allowed);
        }
        let cap = overdraft_cap(10_000, 1);
        assert!((10_000..=10_000 + cap).contains(&admitted), "admitted {admitted} (overdraft cap {cap})");
    }

    #[test]
    fn a_keys_first_requests_are_decided_at_once_and_reported() {
        let mut p = Pair::new(sliding(5));
        p.rtt = 50 * MS;
        assert!(matches!(p.grants.check(KEY, p.limit, 1, T), Local::Overdraft(d) if d.allowed));
        assert_eq!(p.calls, 0, "no call on the request's path");
        p.run(T);
        assert_eq!(p.calls, 1, "its report went at once");
        // Before the answer, as a fresh counter with this isolate's admissions: the limit,
        // then denials with the window's Retry-After.
        let burst: Vec<Local> = (1..8).map(|i| p.request(T + i * MS)).collect();
        assert_eq!(burst.iter().filter(|l| l.decision().allowed).count(), 4, "{burst:?}");
        let last = burst.last().unwrap().decision();
        assert!(!last.allowed && last.retry_after.is_some_and(|r| r > 30 * SECOND), "{last:?}");
        // The answers come; every unit admitted was counted, once.
        p.run(T + 200 * MS);
        p.run(T + 400 * MS);
        assert_eq!(p.object_remaining(T + 400 * MS), 0);
        assert!(!p.request(T + 401 * MS).decision().allowed);
    }

    #[test]
    fn an_isolate_that_knows_the_counter_is_out_asks_nothing_and_denies_until_the_window_allows() {
        let l = fixed(3, 60 * SECOND);
        let mut p = Pair::new(l);
        let statuses: Vec<bool> = (0..5).map(|i| p.request(T + i * MS).decision().allowed).collect();
        assert_eq!(statuses, [true, true, true, false, false]);
        p.run(T + SECOND);
        let calls = p.calls;
        for i in 0..100 {
            let d = p.request(T + SECOND + i * MS).decision();
            // The window ends 40 s after `T`.
            assert!(!d.allowed && d.retry_after.is_some_and(|r| r > 38 * SECOND), "{d:?}");
        }
        assert_eq!(p.calls, calls, "a client the isolate knows is out costs no call");
        assert!(p.request(T + 41 * SECOND).decision().allowed, "the next window");
    }

    #[test]
    fn a_spent_grant_admits_on_the_overdraft_without_a_call_and_a_grant_repays_it() {
        let l = fixed(10_000, 60 * SECOND);
        let mut p = Pair::new(l);
        p.rtt = 20 * MS;
        // Another node has spent most of the quota: past its grant this isolate has no share
        // (under half the quota is free), and it is not the only node.
        p.other_node(T - 20 * SECOND, 9_000);
        p.other_node(T - 500 * MS, 0);
        // Warm: a grant comes with the first report's answer.
        p.request(T);
        p.run(T + 30 * MS);
        let granted = p.grants.held[KEY].left;
        assert!(granted > 0);
        let calls = p.calls;
        // Spend the grant with no time passing: nothing is answered meanwhile.
        let t = T + 40 * MS;
        for _ in 0..granted {
            assert!(matches!(p.grants.check(KEY, l, 1, t), Local::Admitted(_)));
        }
        let cap = overdraft_cap(10_000, p.grants.held[KEY].nodes);
        for _ in 0..cap {
            assert!(matches!(p.grants.check(KEY, l, 1, t), Local::Overdraft(_)));
        }
        // The counter is not known to be out: the short denial says what the copy has left.
        let short = p.grants.check(KEY, l, 1, t);
        let view = l.decide(&p.grants.held[KEY].state(), t, 0).0;
        assert!(view.remaining > 0);
        assert_eq!(short, Local::Short(Decision { allowed: false, retry_after: Some(SHORT_RETRY), ..view }));
        assert_eq!(p.calls, calls, "decided without a call");
        // The report goes at once; its answer finds room: a new grant, the overdraft repaid.
        p.run(t);
        p.run(t + 30 * MS);
        assert_eq!(p.grants.held[KEY].over, 0);
        assert!(matches!(p.grants.check(KEY, l, 1, t + 31 * MS), Local::Admitted(_)));
    }

    #[test]
    fn an_isolate_over_its_overdraft_is_held_to_it_until_an_answer_finds_room() {
        let l = fixed(100, 60 * SECOND);
        let mut p = Pair::new(l);
        p.other_node(T - 500 * MS, 60);
        p.request(T);
        p.run(T + MS);
        let granted = p.grants.held[KEY].left;
        // No answer comes within the next second: the grant, one overdraft (its cap), then
        // denials.
        p.rtt = 2 * SECOND;
        let admitted = (0..50).filter(|i| p.request(T + 2 * MS + i * MS).decision().allowed).count() as u64;
        let cap = overdraft_cap(100, p.grants.held[KEY].nodes);
        assert_eq!(admitted, granted + cap);
        assert_eq!(p.grants.short, 50 - admitted);
    }

    #[test]
    fn a_denial_from_the_copy_waits_for_the_window_not_a_lease() {
        let mut p = Pair::new(sliding(5));
        p.rtt = 2 * MS;
        let mut out = Vec::new();
        for i in 0..40 {
            let d = p.request(T + i * 5 * MS).decision();
            out.push(d);
        }
        let admitted = out.iter().filter(|d| d.allowed).count();
        assert_eq!(admitted, 5, "the limit, one isolate alone");
        let denied = out.iter().rev().find(|d| !d.allowed).unwrap();
        // What a per-request check at the object would answer then.
        let mut exact = ratewall_core::sync::Counter::new(p.limit);
        let times: Vec<Nanos> = (0..40).map(|i| T + i * 5 * MS).collect();
        let mut last = None;
        for (t, d) in times.iter().zip(&out) {
            let e = exact.take(p.limit, *t, 1);
            if !d.allowed {
                last = Some(e);
            }
        }
        let expected = last.unwrap().retry_after;
        assert!(expected.is_some_and(|e| e > 30 * SECOND));
        let got = denied.retry_after.unwrap();
        assert!(got.abs_diff(expected.unwrap()) < 5 * MS, "Retry-After is the window's: {got} vs {expected:?}");
    }

    /// An isolate that admitted one request of a sliding window of `requests` a minute at
    /// `T`, was answered, and was quiet for 2 s (past its grant's lease).
    fn quiet_for_two_seconds(requests: u64) -> Pair {
        let mut p = Pair::new(sliding(requests));
        p.rtt = 2 * MS;
        assert!(p.request(T).decision().allowed);
        for i in 0..100 {
            p.run(T + i * 20 * MS);
        }
        p
    }

    #[test]
    fn a_burst_after_a_pause_longer_than_the_lease_is_not_cut_at_the_overdraft() {
        let mut p = quiet_for_two_seconds(3);
        let h = &p.grants.held[KEY];
        assert!(h.answered && h.until < T + 2 * SECOND, "answered, its grant lapsed by the burst");
        // Three at once, before the report the first sends is answered: the limit's rest.
        let burst: Vec<Local> = (0..3).map(|i| p.grants.check(KEY, p.limit, 1, T + 2 * SECOND + i)).collect();
        let allowed: Vec<bool> = burst.iter().map(|l| l.decision().allowed).collect();
        assert_eq!(allowed, [true, true, false], "{burst:?}");
        assert!(matches!(burst[2], Local::Denied(_)), "the limit's own denial, not a short one: {burst:?}");
    }

    #[test]
    fn a_quiet_counter_whose_object_fails_is_decided_by_the_failure_policy_not_its_copy() {
        let mut p = quiet_for_two_seconds(10);
        let t = T + 2 * SECOND;
        // Quiet past its lease: decided as new (admitted on its copy), its report fails.
        assert!(matches!(p.grants.check(KEY, p.limit, 1, t), Local::Overdraft(_)));
        let call = p.grants.report_key(t).unwrap();
        p.grants.answered(KEY, &call, Err(StoreError::Unavailable), t, t + MS);
        // Then as any counter whose object fails: its overdraft's one unit, then the rule's
        // failure policy (with room in the copy).
        let next: Vec<Local> = (2..5).map(|i| p.grants.check(KEY, p.limit, 1, t + i * MS)).collect();
        assert!(matches!(next[0], Local::Overdraft(_)), "{next:?}");
        assert!(next[1..].iter().all(|l| matches!(l, Local::Unreachable(_))), "{next:?}");
    }

    #[test]
    fn an_isolate_reports_every_counter_of_an_object_in_one_call() {
        let mut g = Grants::new(3, 100);
        g.set_shards(1);
        let limit = sliding(100);
        // The first key starts the object's task at once (no answer yet); the others join it.
        assert!(g.check(b"k0", limit, 1, T).decision().allowed);
        assert_eq!(g.schedule(b"k0", T), Some(("s:0".to_owned(), Schedule::Reports(0))));
        for k in 100..149u8 {
            assert!(g.check(&[b'k', k], limit, 1, T + 1).decision().allowed);
            assert_eq!(g.schedule(&[b'k', k], T + 1), None, "the running task reports it");
        }
        let calls = g.report("s:0", T + 2).unwrap();
        assert_eq!(calls.len(), 50, "one call for the fifty counters");
        assert!(calls.iter().all(|(_, c)| matches!(c, Call::Spend { units: 1, .. })));
        // Their answers come; with nothing more admitted, the task ends.
        let mut object = Shard::default();
        for (key, call) in &calls {
            object.load(key, None, Some(limit)).unwrap();
            let reply = object.handle(key, *call, T + 3).unwrap().reply;
            g.answered(key, call, Ok(&reply), T + 2, T + 4);
        }
        assert_eq!(g.report("s:0", T + REPORT_EVERY), None, "the task ends");
        // Per-counter objects: one task each.
        g.set_shards(0);
        assert!(g.check(b"solo", limit, 1, T + 5).decision().allowed);
        assert_eq!(g.schedule(b"solo", T + 5), Some((super::super::object_name(b"solo", 0), Schedule::Reports(0))));
    }

    #[test]
    fn units_spent_from_a_grant_far_from_the_limit_are_reported_as_it_runs_low_not_on_a_timer() {
        let mut p = Pair::new(sliding(1000));
        assert!(p.request(T).decision().allowed);
        p.run(T + MS);
        let granted = p.grants.held[KEY].granted;
        assert!(granted >= 8, "{granted}");
        let calls = p.calls;
        // Half the grant, spent over the next half second: the object holds the whole grant
        // for the isolate, so no report goes.
        let step = SECOND / 2 / (granted / 2);
        for i in 0..granted / 2 {
            assert!(matches!(p.request(T + SECOND / 2 + i * step), Local::Admitted(_)));
        }
        p.run(T + SECOND);
        assert_eq!(p.calls, calls, "no report while half the grant and of its lease are left");
        // One more: the grant runs low, and its report goes at once, with every unit spent.
        assert!(matches!(p.request(T + SECOND + MS), Local::Admitted(_)));
        assert_eq!(p.calls, calls + 1);
        assert_eq!(1000 - p.object_remaining(T + SECOND + 2 * MS), 1 + granted / 2 + 1);
    }

    #[test]
    fn a_report_is_due_when_the_grant_runs_low_its_lease_ends_or_the_quota_nears_its_end() {
        let mut h = Held::new(sliding(1000));
        assert!(h.due(T), "no answer yet");
        (h.answered, h.granted, h.left, h.lease, h.until) = (true, 10, 10, MAX_LEASE, T + MAX_LEASE);
        assert!(!h.due(T + SECOND), "the grant whole, half its lease left");
        h.left = 4;
        assert!(h.due(T + SECOND), "under half the grant left");
        h.left = 10;
        assert!(h.due(T + MAX_LEASE - 400 * MS), "the lease ends within two intervals");
        // An answer of no grant, on a full lease, to a report while a unit was spent from the
        // grant before: that unit is held by no grant, and goes at once.
        (h.granted, h.left, h.pending) = (0, 0, 1);
        assert!(h.due(T + SECOND));
        (h.granted, h.left, h.pending) = (10, 10, 0);
        // Near the quota's end the object leases for less: the grant runs low past half of
        // its lease (not at once), and until then units go every interval.
        (h.lease, h.until) = (400 * MS, T + 400 * MS);
        assert!(!h.low(T + 100 * MS));
        assert!(h.low(T + 250 * MS));
        assert!(h.due(T + 100 * MS));
    }

    #[test]
    fn units_that_wait_ride_with_another_counters_report_to_the_same_object() {
        let mut g = Grants::new(3, 100);
        g.set_shards(1);
        let limit = sliding(1000);
        let mut object = Shard::default();
        for key in [b"k0", b"k1"] {
            object.load(key, None, Some(limit)).unwrap();
            assert!(g.check(key, limit, 1, T).decision().allowed);
            g.schedule(key, T);
        }
        for (key, call) in g.report("s:0", T).unwrap() {
            let reply = object.handle(&key, call, T + 1).unwrap().reply;
            g.answered(&key, &call, Ok(&reply), T, T + 2);
        }
        let granted = g.held[&b"k0"[..]].granted;
        assert!(granted >= 4, "{granted}");
        // A unit from each grant: neither runs low, so the task waits, sending nothing.
        let t = T + SECOND / 2;
        for key in [b"k0", b"k1"] {
            assert!(matches!(g.check(key, limit, 1, t), Local::Admitted(_)));
        }
        assert_eq!(g.report("s:0", t), Some(Vec::new()), "units wait");
        // `k0`'s grant runs low: its report goes, and `k1`'s unit with it, in the one call.
        for i in 0..granted {
            g.check(b"k0", limit, 1, t + 1 + i);
        }
        let calls = g.report("s:0", t + SECOND / 4).unwrap();
        let keys: Vec<&[u8]> = calls.iter().map(|(k, _)| k.as_slice()).collect();
        assert_eq!(keys, [&b"k0"[..], &b"k1"[..]]);
    }

    #[test]
    fn a_fixed_windows_first_requests_are_not_cut_at_the_overdraft_by_a_report_of_the_last() {
        let mut p = Pair::new(fixed(100, 10 * SECOND));
        p.rtt = 40 * MS;
        let w = (T / (10 * SECOND) + 1) * 10 * SECOND;
        assert!(p.request(w + 9 * SECOND).decision().allowed);
        p.run(w + 9 * SECOND + 500 * MS);
        // Units spent at the window's end, reported as it ends: the report is on its way
        // when the next window starts.
        for i in 0..3 {
            assert!(matches!(p.grants.check(KEY, p.limit, 1, w + 10 * SECOND - 30 * MS + i), Local::Admitted(_)));
        }
        assert!(p.grants.report_key(w + 10 * SECOND - 20 * MS).is_some());
        // They counted in a window that has ended: nothing is owed in the new one, whose first
        // requests are decided on the copy (a fresh window) until the next answer, not cut
        // at the overdraft's one unit.
        let burst: Vec<Local> = (0..3).map(|i| p.grants.check(KEY, p.limit, 1, w + 10 * SECOND + 1 + i)).collect();
        assert!(burst.iter().all(|l| l.decision().allowed), "{burst:?}");
    }

    #[test]
    fn a_fixed_windows_units_of_an_ended_window_do_not_make_the_others_waiting_units_go() {
        let mut g = Grants::new(3, 100);
        g.set_shards(1);
        let (fixed, slow) = (fixed(100, 10 * SECOND), sliding(1000));
        let mut object = Shard::default();
        let w = (T / (10 * SECOND) + 1) * 10 * SECOND;
        for (key, limit) in [(&b"f"[..], fixed), (&b"s"[..], slow)] {
            object.load(key, None, Some(limit)).unwrap();
            assert!(g.check(key, limit, 1, w + 9 * SECOND).decision().allowed);
            g.schedule(key, w + 9 * SECOND);
        }
        for (key, call) in g.report("s:0", w + 9 * SECOND).unwrap() {
            let reply = object.handle(&key, call, w + 9 * SECOND + 1).unwrap().reply;
            g.answered(&key, &call, Ok(&reply), w + 9 * SECOND, w + 9 * SECOND + 2);
        }
        // A unit of each from its grant at the window's end; the fixed window's is due (its
        // lease ends with the window), but the window ends before the task looks.
        assert!(matches!(g.check(b"f", fixed, 1, w + 10 * SECOND - 1), Local::Admitted(_)));
        assert!(matches!(g.check(b"s", slow, 1, w + 10 * SECOND - 1), Local::Admitted(_)));
        // The fixed window's unit counts in none now, so nothing is due: the other waits.
        assert_eq!(g.report("s:0", w + 10 * SECOND + 1), Some(Vec::new()));
    }

    #[test]
    fn a_report_on_its_way_is_not_sent_again_and_one_whose_call_failed_is() {
        let mut g = Grants::new(3, 100);
        let limit = sliding(100);
        assert!(g.check(b"k", limit, 1, T).decision().allowed);
        let Some((object, Schedule::Reports(0))) = g.schedule(b"k", T) else { panic!("the task starts") };
        let sent = g.report(&object, T).unwrap();
        assert_eq!(sent.len(), 1);
        // While it is on its way the task sends nothing, and does not end.
        assert_eq!(g.report(&object, T + REPORT_EVERY), Some(Vec::new()));
        // Its call fails: the task sends it again, with its seq.
        g.answered(b"k", &sent[0].1, Err(StoreError::Unavailable), T, T + MS);
        assert_eq!(g.report(&object, T + 2 * REPORT_EVERY), Some(sent));
    }

    #[test]
    fn a_failed_report_is_retried_with_its_seq_and_counted_once() {
        let mut p = Pair::new(sliding(100));
        for i in 0..10 {
            assert!(p.request(T + i).decision().allowed);
        }
        p.due = None;
        p.flying.clear();
        // The report goes as the grant's lease nears its end.
        let t = T + MAX_LEASE - 100 * MS;
        let call = p.grants.report_key(t).unwrap();
        let Call::Spend { units, .. } = call else { panic!() };
        assert!(units > 0);
        // The object applied it but its answer was lost.
        let _ = p.object.handle(call, t);
        p.grants.answered(KEY, &call, Err(StoreError::Unavailable), t, t + 10);
        let again = p.grants.report_key(t + 20).unwrap();
        assert_eq!(again, call, "the same seq and units");
        let reply = p.object.handle(again, t + 20).unwrap().reply;
        p.grants.answered(KEY, &again, Ok(&reply), t + 20, t + 20);
        let counted = 100 - p.object_remaining(t + 30);
        assert!(counted <= 10, "counted once: {counted} of 10");
    }

    #[test]
    fn a_report_failing_past_the_retry_horizon_is_dropped_and_counted() {
        let mut p = Pair::new(sliding(100));
        for i in 0..3 {
            p.grants.check(KEY, p.limit, 1, T + i);
        }
        let call = p.grants.report_key(T + 10).unwrap();
        let Call::Spend { units, .. } = call else { panic!() };
        let late = T + 10 + RETRY_HORIZON + 1;
        p.grants.answered(KEY, &call, Err(StoreError::Unavailable), T + 10, late);
        assert_eq!(p.grants.dropped, units);
        assert_ne!(p.grants.report_key(late), Some(call), "not retried again");
    }

    /// The isolate a client left gives its grant back once it has seen no request for
    /// [`IDLE_GAPS`] gaps (at least [`REPORT_EVERY`]): the object frees it for the others and
    /// gives the isolate nothing more, where it held it for its lease and was granted as much
    /// again at its next report.
    #[test]
    fn an_isolate_its_client_left_gives_its_grant_back() {
        let mut p = Pair::new(fixed(1000, 10 * SECOND));
        p.rtt = 20 * MS;
        // 80 requests a second for a second, then none.
        let mut t = T;
        for _ in 0..80 {
            assert!(p.request(t).decision().allowed);
            t += 12_500_000;
        }
        let held = p.other_node(t, 0).held;
        assert!(held >= 10, "the client's isolate holds a grant: {held}");
        let calls = p.calls;
        p.run(t + 100 * MS);
        assert_eq!(p.calls, calls, "not idle yet");
        p.run(t + 800 * MS);
        assert_eq!(p.other_node(t + 800 * MS, 0).held, 0, "given back");
        assert_eq!(p.calls, calls + 1, "one call gave it back");
        // Its copy stays: a request that comes back is decided on it, as for a counter new to
        // the isolate, and its next report brings a grant again.
        assert!(p.request(t + SECOND).decision().allowed);
        p.run(t + SECOND + 100 * MS);
        assert!(p.request(t + SECOND + 100 * MS).decision().allowed);
    }

    #[test]
    fn past_its_grant_with_its_object_failing_a_counter_is_unreachable_not_short() {
        let mut p = Pair::new(sliding(100));
        p.request(T);
        p.run(T + MS);
        // The object stops answering: the next report (as the lease nears its end) fails,
        // the grant lapses.
        let t = T + MAX_LEASE - 100 * MS;
        p.grants.check(KEY, p.limit, 1, t);
        let call = p.grants.report_key(t + MS).unwrap();
        p.grants.answered(KEY, &call, Err(StoreError::Unavailable), t + MS, t + 2 * MS);
        let later = T + 10 * SECOND;
        let outcomes: Vec<Local> = (0..5).map(|i| p.grants.check(KEY, p.limit, 1, later + i)).collect();
        assert!(matches!(outcomes[0], Local::Overdraft(_)), "{outcomes:?}");
        assert!(outcomes[1..].iter().all(|o| matches!(o, Local::Unreachable(_))), "{outcomes:?}");
        // Once the object answers again, a spent grant is short again, not a failure.
        let call = p.grants.report_key(later + 10).unwrap();
        let reply = p.object.handle(call, later + 10).unwrap().reply;
        p.grants.answered(KEY, &call, Ok(&reply), later + 10, later + 11);
        assert!(!p.grants.failing(KEY));
    }

    #[test]
    fn a_refund_goes_back_to_the_grant() {
        let mut p = Pair::new(sliding(100));
        p.request(T);
        p.run(T + MS);
        let Local::Admitted(a) = p.grants.check(KEY, p.limit, 1, T + 2 * MS) else { panic!("from the grant") };
        p.grants.refund(KEY, 1, T + 2 * MS);
        let Local::Admitted(b) = p.grants.check(KEY, p.limit, 1, T + 3 * MS) else { panic!() };
        assert_eq!(a.remaining, b.remaining, "the refunded unit was not counted");
    }

    /// The four counting algorithms at 100 a minute (a token bucket's burst 100).
    fn hundred_a_minute() -> [Limit; 4] {
        [
            sliding(100),
            Limit::new(Algorithm::TokenBucket, 100, 60 * SECOND, Some(100)).unwrap(),
            fixed(100, 60 * SECOND),
            Limit::new(Algorithm::SlidingLog, 100, 60 * SECOND, None).unwrap(),
        ]
    }

    /// A burst of `n` requests `gap` apart from `t`: how many were admitted.
    fn burst(p: &mut Pair, t: Nanos, n: u64, gap: Nanos) -> Vec<Local> {
        (0..n).map(|i| p.request(t + i * gap)).collect()
    }

    /// A new client's burst of 20 on a limit of 100 a minute, the object's first answer
    /// coming during it with a grant sized from the one request it had seen: the whole burst
    /// is admitted (before: 6 to 10, then short denials with `RateLimit` r=0). After a pause,
    /// another burst of 20 is admitted whole too.
    #[test]
    fn a_clients_burst_far_from_its_limit_is_admitted_whole() {
        for limit in hundred_a_minute() {
            for (rtt, gap) in [(2 * MS, MS), (2 * MS, MS / 4), (20 * MS, 5 * MS)] {
                for pause in [SECOND / 2, 2 * SECOND, 8 * SECOND] {
                    let mut p = Pair::new(limit);
                    p.rtt = rtt;
                    let t = T + 100 * MS;
                    let first = burst(&mut p, t, 20, gap);
                    assert!(first.iter().all(|l| l.decision().allowed), "{limit:?}, rtt {rtt}: {first:?}");
                    let t = t + 20 * gap + pause;
                    let next = burst(&mut p, t, 20, gap);
                    assert!(next.iter().all(|l| l.decision().allowed), "{limit:?}, pause {pause}: {next:?}");
                    assert_eq!(p.grants.short, 0, "{limit:?}");
                    // The object counts the 40 once the reports land, as a per-request check
                    // would have.
                    p.run(t + SECOND);
                    p.run(t + 2 * SECOND);
                    let start = T + 100 * MS;
                    let times = (0..20).map(|i| start + i * gap).chain((0..20).map(|i| t + i * gap));
                    let exact = times.fold(State::Fresh, |s, at| limit.consume(&s, at, 1));
                    let expected = limit.decide(&exact, t + 2 * SECOND, 0).0.remaining;
                    assert_eq!(p.object_remaining(t + 2 * SECOND), expected, "{limit:?}");
                }
            }
        }
    }

    /// With another node on the counter, an isolate's burst far from the limit is admitted
    /// on its share of the quota (the quota over the nodes) past the grant the object sized,
    /// not cut at that grant and one overdraft unit; and no further than that share while
    /// the object has not counted it.
    #[test]
    fn beside_another_node_a_burst_far_from_the_limit_gets_the_isolates_share() {
        let limits = [
            sliding(1000),
            Limit::new(Algorithm::TokenBucket, 1000, 60 * SECOND, Some(1000)).unwrap(),
            fixed(1000, 60 * SECOND),
            Limit::new(Algorithm::SlidingLog, 1000, 60 * SECOND, None).unwrap(),
        ];
        for limit in limits {
            let mut p = Pair::new(limit);
            p.rtt = 2 * MS;
            p.other_node(T - 100 * MS, 0);
            let t = T + 100 * MS;
            assert!(p.request(t).decision().allowed);
            p.run(t + 10 * MS);
            assert_eq!(p.grants.held[KEY].nodes, 2, "{limit:?}");
            // No answer for a while: past its grant, its share (500) less what it admitted past
            // the grant and the object has not counted, then its overdraft; then short denials.
            p.rtt = 10 * SECOND;
            let t = t + 20 * MS;
            let h = &p.grants.held[KEY];
            let grant = if h.until > t { h.left } else { 0 };
            let admitted = burst(&mut p, t, 700, 0).iter().filter(|l| l.decision().allowed).count() as u64;
            // (Its share stops at half the quota free beside the other node's grant.)
            let (share, cap) = (share(1000, 2), overdraft_cap(1000, 2));
            assert!(admitted >= grant + 300 && admitted <= grant + share + cap, "{limit:?}: {admitted}, grant {grant}");
        }
    }

    /// A client that spends its limit, is refused, and waits exactly the `Retry-After` it was
    /// given (in whole seconds, rounded up), is admitted — whatever of the isolate's grant
    /// and overdraft went into spending it (before: 1 to 3 in 10 got a short denial, with
    /// `RateLimit` r=0).
    #[test]
    fn a_client_that_waits_its_retry_after_is_admitted_on_every_algorithm_and_cost() {
        let per = 3 * SECOND;
        let cases = [
            (Limit::new(Algorithm::SlidingLog, 5, per, None).unwrap(), 1),
            (Limit::new(Algorithm::SlidingLog, 10, per, None).unwrap(), 2),
            (Limit::new(Algorithm::TokenBucket, 10, per, Some(10)).unwrap(), 2),
            (Limit::new(Algorithm::SlidingWindow, 10, per, None).unwrap(), 2),
            (Limit::new(Algorithm::TokenBucket, 1, per, Some(3)).unwrap(), 1),
            (Limit::new(Algorithm::FixedWindow, 5, per, None).unwrap(), 1),
        ];
        for (limit, cost) in cases {
            for rtt in [0, 2 * MS, 20 * MS] {
                for gap in [0, MS, 10 * MS, 300 * MS, 600 * MS, 1100 * MS] {
                    for start in [0, 700 * MS, 1300 * MS] {
                        let mut p = Pair::new(limit);
                        p.rtt = rtt;
                        let mut t = T + 100 * MS + start;
                        let mut seen = Vec::new();
                        let refusal = loop {
                            let d = p.request_of(t, cost).decision();
                            seen.push(d.allowed);
                            if !d.allowed {
                                break Some(d);
                            }
                            if seen.len() > 40 {
                                // The limit comes back faster than this client spends it.
                                break None;
                            }
                            t += gap;
                        };
                        let Some(refusal) = refusal else { continue };
                        let wait = refusal.retry_after.unwrap().div_ceil(SECOND) * SECOND;
                        let again = p.request_of(t + wait, cost).decision();
                        let case = format!("{limit:?} cost {cost}, rtt {rtt}, gap {gap}, start {start}");
                        assert!(again.allowed, "{case}: {seen:?}, then after {wait}: {again:?}");
                        assert_eq!(p.grants.short, 0, "{case}: {seen:?}");
                    }
                }
            }
        }
    }

    /// A unit already reported when another rule rejects its request is given back at the
    /// object, with the next report, once: whether its report was still on its way or had
    /// been answered, and even when the report carrying the refund is sent again.
    #[test]
    fn a_refund_of_units_already_reported_reaches_the_object_once() {
        let bucket = Limit::new(Algorithm::TokenBucket, 2, 86_400 * SECOND, Some(2)).unwrap();
        for answered in [false, true] {
            let mut p = Pair::new(bucket);
            p.rtt = 20 * MS;
            // The first request's report goes at once, and is on its way (or answered).
            assert!(p.request(T).decision().allowed);
            assert_eq!(p.calls, 1);
            let t = if answered { T + 30 * MS } else { T + 5 * MS };
            p.run(t);
            assert_eq!(p.grants.held[KEY].report.is_none(), answered);
            p.grants.refund(KEY, 1, T);
            // The isolate has it back at once, and the object with the next report.
            assert_eq!(p.grants.held[KEY].limit.decide(&p.grants.held[KEY].state(), t, 0).0.remaining, 2);
            p.run(t + 100 * MS);
            p.run(t + 200 * MS);
            assert_eq!(p.object_remaining(t + 200 * MS), 2, "answered {answered}");
            // Both units are there for the client.
            let later = T + SECOND;
            assert!(p.request(later).decision().allowed && p.request(later + MS).decision().allowed);
            assert!(!p.request(later + 2 * MS).decision().allowed);
        }
        // A report carrying a refund whose answer was lost is sent again with its seq: the
        // object gives the unit back once.
        let mut p = Pair::new(bucket);
        assert!(p.request(T).decision().allowed);
        p.run(T + MS);
        assert!(p.request(T + 2 * MS).decision().allowed);
        p.run(T + 3 * MS);
        p.flying.clear();
        p.due = None;
        p.grants.refund(KEY, 1, T + 2 * MS);
        let call = p.grants.report_key(T + 4 * MS).unwrap();
        assert!(matches!(call, Call::Spend { refund: 1, .. }), "{call:?}");
        let _ = p.object.handle(call, T + 4 * MS);
        p.grants.answered(KEY, &call, Err(StoreError::Unavailable), T + 4 * MS, T + 5 * MS);
        let again = p.grants.report_key(T + 6 * MS).unwrap();
        assert_eq!(again, call);
        let reply = p.object.handle(again, T + 6 * MS).unwrap().reply;
        p.grants.answered(KEY, &again, Ok(&reply), T + 6 * MS, T + 6 * MS);
        assert_eq!(p.object_remaining(T + 7 * MS), 1, "two admitted, one given back, once");
    }

    #[test]
    fn grants_held_are_bounded_and_a_rules_change_spends_no_old_grant() {
        let mut g = Grants::new(1, 10);
        let mut full = 0;
        for i in 0..1000u32 {
            full += usize::from(matches!(g.check(&i.to_le_bytes(), sliding(10), 1, T), Local::Full(_)));
        }
        assert!(g.len() <= 10);
        // Each of the ten held admitted a unit it has not reported: none is let go (its unit
        // would go uncounted); the counters past them are decided by their objects.
        assert_eq!((full, g.dropped), (990, 0));
        assert!((0..10u32).all(|i| g.held.contains_key(&i.to_le_bytes()[..])));
        let mut p = Pair::new(sliding(100));
        p.request(T);
        p.run(T + MS);
        assert!(matches!(p.grants.check(KEY, p.limit, 1, T + 2 * MS), Local::Admitted(_)));
        assert!(
            !matches!(p.grants.check(KEY, sliding(50), 1, T + 3 * MS), Local::Admitted(_)),
            "not from the old limit's grant"
        );
    }

    #[test]
    fn a_fixed_windows_grant_and_overdraft_end_with_its_window() {
        let l = fixed(1000, SECOND);
        let mut p = Pair::new(l);
        let start = T + SECOND - 10 * MS;
        p.request(start);
        p.run(start + 1);
        assert!(matches!(p.grants.check(KEY, l, 1, start + 2), Local::Admitted(_)));
        // Spend everything this isolate may in the window, overdraft included.
        while p.grants.check(KEY, l, 1, start + 3).decision().allowed {}
        // The next window: no grant yet, but a fresh overdraft.
        assert!(matches!(p.grants.check(KEY, l, 1, T + SECOND), Local::Overdraft(_)), "the next window");
    }

    /// A client's requests at the end of a fixed window are counted in that window, not in
    /// the next one, however late their report reaches the object.
    #[test]
    fn units_admitted_at_a_windows_end_are_not_counted_in_the_next_window() {
        let l = fixed(3, 5 * SECOND);
        for (gap, rtt) in [(10 * MS, 0), (10 * MS, 20 * MS), (40 * MS, 60 * MS), (100 * MS, 20 * MS)] {
            let mut p = Pair::new(l);
            p.rtt = rtt;
            let end = T + 5 * SECOND;
            let first = end - 3 * gap - 5 * MS;
            let passed: Vec<bool> = (0..4).map(|i| p.request(first + i * gap).decision().allowed).collect();
            assert_eq!(passed, [true, true, true, false], "gap {gap}, rtt {rtt}");
            // The next window: its quota whole, at the isolate and at the object.
            for i in 0..3 {
                let t = end + 500 * MS + i * 10 * MS;
                assert!(p.request(t).decision().allowed, "gap {gap}, rtt {rtt}: request {i} of the next window");
            }
            assert!(!p.request(end + 600 * MS).decision().allowed, "gap {gap}, rtt {rtt}");
            p.run(end + 2 * SECOND);
            assert_eq!(p.object_remaining(end + 2 * SECOND), 0, "gap {gap}, rtt {rtt}: the next window's three");
        }
    }

    /// A client of a token bucket that spends its burst, is refused, and waits exactly the
    /// `Retry-After` it was given, is admitted.
    #[test]
    fn a_client_that_waits_its_retry_after_is_admitted() {
        let bucket = Limit::new(Algorithm::TokenBucket, 1, 3 * SECOND, Some(3)).unwrap();
        for rtt in [0, 2 * MS, 20 * MS] {
            for gap in [0, MS, 10 * MS] {
                let mut p = Pair::new(bucket);
                p.rtt = rtt;
                let t0 = T + 100 * MS;
                let mut t = t0;
                let mut first = Vec::new();
                let refusal = loop {
                    let local = p.request(t);
                    first.push(local.decision().allowed);
                    if !local.decision().allowed {
                        break local.decision();
                    }
                    t += gap;
                };
                assert_eq!(first, [true, true, true, false], "rtt {rtt}, gap {gap}");
                let wait = refusal.retry_after.unwrap().div_ceil(SECOND) * SECOND;
                let again = p.request(t + wait).decision();
                assert!(again.allowed, "rtt {rtt}, gap {gap}: after Retry-After {wait}: {again:?}");
            }
        }
    }

    #[test]
    fn spent_round_trips() {
        for s in [
            Spent {
                grant: Some((3, 4)),
                asked: 5,
                ask_lease: 10,
                remaining: 6,
                reset_after: 7,
                retry_after: Some(8),
                now: 9,
                state: Some(State::FixedWindow { window: 3, count: 4 }),
                nodes: 11,
                held: 12,
            },
            Spent {
                grant: None,
                asked: 0,
                ask_lease: 0,
                remaining: 0,
                reset_after: 0,
                retry_after: None,
                now: u64::MAX,
                state: None,
                nodes: 0,
                held: 0,
            },
        ] {
            assert_eq!(Spent::decode(&s.encode()), Some(s));
        }
        assert_eq!(Spent::decode("{}"), None);
        let garbled =
            r#"{"grant":null,"lease":null,"asked":0,"ask_lease":0,"remaining":0,"reset_after":0,"now":1,"state":"zz"}"#;
        assert_eq!(Spent::decode(garbled), None, "a state that does not decode is an error");
    }
}
