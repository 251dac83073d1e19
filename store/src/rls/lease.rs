//! The service as a node of its counters, like a proxy: it holds grants and decides most
//! calls in memory.
//!
//! A call on a counter this process holds a grant of is decided here: the grant pays for its
//! hits, which are reported with the next batch. Otherwise — no grant yet, spent, expired, or
//! the limit changed — it *asks* at Redis ([`Counter::ask`](ratewall_core::sync::Counter::ask):
//! the hits are taken there only if free beside every grant held, and the answer brings a
//! share of what else is free) — except a counter this process has not held yet: as a proxy
//! does, it admits on an initial share (`quota / nodes`, `nodes` counting every service
//! process on the Redis) without waiting, and reports what it admitted with the next batch
//! ([`Leases::cold`]); past a fixed window's first quarter it asks instead, as a proxy new to
//! a counter does. Every [`FLUSH`] the process notes itself as present in Redis
//! ([`Kv::present`]) and the spent units go to Redis in one batch per counter
//! ([`Counter::report_since`], with this node's id and a sequence number, so a retried batch
//! is never counted twice), the answer being the next grant; a process that stops sends what
//! it has not reported ([`flush_all`]). These are the transitions the sync endpoint runs for
//! the filter's proxies, so the overshoot bound of docs/sync-protocol.md holds for the
//! service too, with every process a node.
//!
//! A batch's units are counted at Redis as of when the first of them was admitted, as this
//! process counted them when it decided (a token bucket counted when the batch came was
//! behind the `Retry-After` the process had given: a client that waited it was refused once
//! more), and a fixed window's units of a window that has ended count in none: reported
//! after its end, they would take from the client's next window. Those times are on the
//! counter's clock — Redis's `TIME` on the key's primary, not this process's — converted by
//! the difference between the two measured at the counter's last answer ([`skew`]).

use super::Rls;
use crate::Kv;
use ratewall_core::sync::{window_of, Applied, Counter, CLOCK_CORRECTION, RETRY_HORIZON};
use ratewall_core::{Algorithm, Decision, Limit, Nanos};
use std::collections::HashMap;
use std::hash::BuildHasher as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often spent units are reported and grants renewed.
pub const FLUSH: Duration = Duration::from_millis(100);
/// Most counters whose grants one process holds (past it, calls ask at Redis).
pub const MAX_HELD: usize = 100_000;
/// How long a refused ask is answered from memory (at most its `retry_after`): a hot
/// counter over its limit costs Redis one call per this, not one per call.
pub const DENY_CACHE: Nanos = 50_000_000;
/// How long a process that stops keeps reporting what it admitted while Redis fails
/// ([`flush_all`]).
pub const STOP_FLUSH: Duration = Duration::from_secs(5);
/// A counter on which Redis may hold units for this process and that has seen no call for
/// this many of the recent gaps between its calls (and at least [`IDLE_MIN`]) is idle here:
/// its client moved to another process, or paused, and what it holds goes back to Redis with
/// the next batch
/// ([`Counter::release`]), as a Worker isolate's grant does. Held on, renewed while in use,
/// it was refused to the client at the other processes (30 of 50 spent here, the client
/// moving on a second later was refused there with 20 free, told to wait 48 minutes).
pub const IDLE_GAPS: u64 = 8;
/// The least silence that makes a counter idle ([`IDLE_GAPS`]).
pub const IDLE_MIN: Nanos = 250_000_000;
/// How old a counter's view may be for a look (a call of no hits) to be answered from it.
pub const STALE_LOOK: Nanos = 250_000_000;
/// Counters synced concurrently in one flush.
const BATCH: usize = 256;

/// One counter as this process holds it.
#[derive(Clone, Debug)]
struct Held {
    limit: Limit,
    /// Units it may still admit, of the last batch's grant.
    grant: u64,
    /// When the grant ends (our clock).
    until: Nanos,
    /// Units given beside the asked ones by asks answered since the last batch's answer:
    /// Redis holds them for this process until the batch after the next one is counted, so
    /// they are spent after the grant, until the next batch is cut.
    extra: u64,
    /// Those of asks answered before the last batch's answer: Redis holds them until the next
    /// batch is counted, so they are spent only until it is cut. (Dropped with the grant at
    /// each answer, as they were, they were held at Redis and spent by no call: a lone
    /// process's calls were refused below the limit, told to retry when the hold lapsed.)
    carried: u64,
    /// When `extra` and `carried` end (our clock): the lease of the last ask that gave any.
    extra_until: Nanos,
    /// Units admitted since the last batch was cut.
    spent: u64,
    /// When the first of `spent` was admitted (the counter's clock): a fixed window's are
    /// all of that one window (see [`Held::drop_ended`]).
    spent_since: Nanos,
    /// Units a call took from the grant and could not give back (it went, unanswered, after a
    /// batch had reported them), and when it took them (the counter's clock): taken off the
    /// next units reported ([`Held::cut`]).
    owed: (u64, Nanos),
    /// A batch sent and not yet acknowledged.
    pending: Option<InFlight>,
    /// The counter's clock as this process knows it.
    clock: Clock,
    /// The global view last answered: remaining, time to reset, when (our clock).
    view: (u64, Nanos, Nanos),
    /// Last call.
    used: Nanos,
    /// The recent gap between calls (a moving average; 0 before the second).
    gap: Nanos,
    /// Refused until then (our clock), for calls of at least this many hits.
    denied_until: Nanos,
    denied_hits: u64,
    /// When the refused call would fit (our clock; None: never): the retry time of the calls
    /// answered from memory.
    retry_at: Option<Nanos>,
    /// Whether Redis has answered for it (a counter first spent on an initial share has
    /// not, until its first batch is answered: an ask meanwhile would be answered from a
    /// count that lacks those units).
    answered: bool,
}

/// A counter's clock as this process knows it: the counter's clock less ours, as measured at
/// its last answer ([`skew`]), and the latest instant the counter is known to have seen. A
/// step back of Redis's clock is taken as the counter takes it
/// ([`Counter`]'s clock): held at that instant until the clock is past it again, unless the
/// step is longer than [`CLOCK_CORRECTION`] (a clock that had been ahead, put back). Without
/// the hold, units admitted after a step back across a window's edge were counted in the
/// window before (or in none), and the client had a fresh quota when the clock came back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Clock {
    skew: i64,
    seen: Nanos,
}

impl Clock {
    /// `now` (our clock) on the counter's clock.
    fn at(&self, now: Nanos) -> Nanos {
        now.saturating_add_signed(self.skew).max(self.seen)
    }

    /// The instant a transition read at Redis at `raw` (Redis's clock) runs at.
    fn run_at(&self, raw: Nanos) -> Nanos {
        held(raw, self.seen)
    }

    /// Notes an answer: Redis's clock read `raw` when ours read `ours`, and the transition ran
    /// at `ran` ([`Clock::run_at`], or later: the counter's own latest instant).
    fn observe(&mut self, raw: Nanos, ours: Nanos, ran: Nanos) {
        self.skew = skew(raw, ours);
        self.seen = held(ran, self.seen);
    }
}

/// `at` as a counter that has seen `seen` takes it ([`Counter`]'s clock): no earlier than
/// `seen`, unless more than [`CLOCK_CORRECTION`] before it (a clock put back: taken as it is).
fn held(at: Nanos, seen: Nanos) -> Nanos {
    if at.saturating_add(CLOCK_CORRECTION) < seen {
        at
    } else {
        at.max(seen)
    }
}

/// A batch sent and not yet acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct InFlight {
    seq: u64,
    units: u64,
    /// When it was first sent (our clock).
    sent: Nanos,
    /// When the first of its units was admitted (the counter's clock; 0: none).
    since: Nanos,
    /// Sends of it that failed in a row, and the [`Leases::acks`] when the last one did.
    failures: (u32, u64),
    /// Not sent again before then (our clock).
    next: Nanos,
    /// It gives back what the process holds (the counter went idle here).
    release: bool,
}

impl InFlight {
    /// This batch of counter `rkey`, of `limit`, to send.
    fn batch(&self, rkey: &str, limit: Limit) -> Batch {
        let (seq, units, since, release) = (self.seq, self.units, self.since, self.release);
        Batch { rkey: rkey.to_owned(), limit, seq, units, since, release }
    }
}

/// The longest a batch whose sends keep failing waits between two ([`Leases::failed`]).
pub const MAX_BACKOFF: Nanos = 3_200_000_000;

/// One counter's batch: what a process admitted on it since its last batch, to report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// The counter's Redis key.
    pub rkey: String,
    /// Its limit.
    pub limit: Limit,
    /// The batch's sequence number (a retry keeps it).
    pub seq: u64,
    /// Units admitted.
    pub units: u64,
    /// When the first of `units` was admitted, on the counter's clock (0: no units).
    pub since: Nanos,
    /// It gives back what the process holds ([`IDLE_GAPS`]).
    pub release: bool,
}

/// The counter's clock less ours: `counter_now` read from the counter, `ours` our clock
/// then. The counter's time is Redis's, read at most a round trip before the transition that
/// sees it runs (a read's or a compare-and-set's answer, or the last value written, its
/// clock advanced by our monotonic clock since): a time converted with it is early by at most
/// that round trip (within the deadline; well under a millisecond on one network).
pub fn skew(counter_now: Nanos, ours: Nanos) -> i64 {
    let d = i128::from(counter_now) - i128::from(ours);
    i64::try_from(d).unwrap_or(if d > 0 { i64::MAX } else { i64::MIN })
}

/// The instant a transition run at `now` on `counter` ran at: the counter's own latest
/// instant, when it holds a later one ([`Clock`]).
pub(crate) fn ran(counter: &Counter, now: Nanos) -> Nanos {
    held(now, counter.last_seen)
}

/// Reports batch `b` of this node on `counter` at `now` (the counter's clock): its units as
/// of when the first was admitted, none of them if that was in a fixed window that has
/// ended.
pub(crate) fn report(counter: &mut Counter, now: Nanos, node: u64, b: (Limit, u64, u64, Nanos)) -> Applied {
    let (limit, seq, units, since) = b;
    counter.report_counted(limit, (now, since), (node, seq, units), crate::NODE_TTL, true)
}

/// A batch's transition at Redis ([`report`]) as [`Rls::update_then`](super::Rls::update_then)
/// runs it: its answer, until when the counter is then too low for an initial share
/// ([`low_until`]), and whether it changed.
pub(crate) fn reported(
    counter: &mut Counter,
    now: Nanos,
    node: u64,
    b: (Limit, u64, u64, Nanos),
    release: bool,
) -> ((Applied, Option<Nanos>), bool) {
    let mut a = report(counter, now, node, b);
    if release {
        // Counted, then what the process holds goes back ([`IDLE_GAPS`]).
        counter.release(node);
        a.grant = 0;
    }
    ((a, low_until(counter, now)), a.counted || release)
}

/// Until when (the counter's clock) `counter` cannot pay a process new to it an initial share,
/// if it cannot at `now`: half its capacity, the most share a process takes blind when there
/// are others, does not fit beside what it counted and what every grant holds. A process that
/// has not held the counter asks Redis there instead ([`Leases::cold`]): its share, spent
/// blind, would come on top of what the others spent (two processes, a token bucket of 50 an
/// hour spent at one of them: the other admitted 25 more).
pub(crate) fn low_until(counter: &Counter, now: Nanos) -> Option<Nanos> {
    let now = now.max(counter.last_seen);
    let limit = counter.limit;
    // Node 0 is no process's: every grant counts.
    let taken = limit.consume(&counter.state, now, counter.held_by_others(now, 0));
    let (share, _) = limit.decide(&taken, now, (limit.capacity() / 2).max(1));
    if share.allowed {
        return None;
    }
    let wait = share.retry_after.unwrap_or_else(|| limit.decide(&taken, now, 0).0.reset_after);
    Some(now.saturating_add(wait))
}

impl Held {
    /// `now` (our clock) on the counter's clock.
    fn on_counter(&self, now: Nanos) -> Nanos {
        self.clock.at(now)
    }

    /// Forgets the spent units of a fixed window that has ended by `now` (our clock): they
    /// counted in their window, which is over, and reported now Redis would count them in its
    /// current one (a client's last calls of a window would take from its next). Nor do they
    /// weigh on a grant of the new window.
    fn drop_ended(&mut self, now: Nanos) {
        if self.spent > 0 && window_of(&self.limit, self.spent_since) < window_of(&self.limit, self.on_counter(now)) {
            self.spent = 0;
        }
    }

    /// When the last of what this process holds ends (our clock).
    fn held_until(&self) -> Nanos {
        self.until.max(self.extra_until)
    }

    /// What this process may still spend at `now` (our clock), on lease: what Redis carries
    /// for it, its grant, and the units its asks were given beside.
    fn spendable(&self, now: Nanos) -> (u64, u64, u64) {
        let (carried, extra) = if now < self.extra_until { (self.carried, self.extra) } else { (0, 0) };
        let grant = if now < self.until { self.grant } else { 0 };
        (carried, grant, extra)
    }

    /// Takes `hits` from what this process holds at `now` (our clock): what Redis carries for
    /// it first (it ends soonest), then the grant, then the units its asks were given beside.
    /// None: they do not cover `hits` (nothing is taken).
    fn spend(&mut self, hits: u64, now: Nanos) -> Option<()> {
        let (carried, grant, extra) = self.spendable(now);
        if carried.saturating_add(grant).saturating_add(extra) < hits {
            return None;
        }
        let from_carried = hits.min(carried);
        let from_grant = (hits - from_carried).min(grant);
        let from_extra = hits - from_carried - from_grant;
        self.carried = carried - from_carried;
        self.grant = grant - from_grant;
        self.extra = extra - from_extra;
        Some(())
    }

    /// Notes a call at `now` (our clock).
    fn called(&mut self, now: Nanos) {
        let since = now.saturating_sub(self.used);
        self.gap = if self.gap == 0 { since } else { self.gap.saturating_mul(3).saturating_add(since) / 4 };
        self.used = now;
    }

    /// Whether the counter is idle here at `now` ([`IDLE_GAPS`]) while Redis may hold units of
    /// it for this process: a grant or units given to its asks still on lease, whether or not
    /// this process may still spend them (Redis carries an ask's units until the batch after
    /// the next, which an idle process does not send: the others were refused on them with
    /// the process holding nothing it could spend).
    fn idle(&self, now: Nanos) -> bool {
        now < self.held_until() && now.saturating_sub(self.used) >= self.quiet()
    }

    /// How long without a call makes the counter idle here ([`IDLE_GAPS`]).
    fn quiet(&self) -> Nanos {
        self.gap.saturating_mul(IDLE_GAPS).max(IDLE_MIN)
    }

    /// Records `hits` admitted at `now` (our clock), to report with the next batch.
    fn admit(&mut self, hits: u64, now: Nanos) {
        self.drop_ended(now);
        if self.spent == 0 {
            self.spent_since = self.on_counter(now);
        }
        self.spent = self.spent.saturating_add(hits);
    }

    /// Units admitted here that Redis may not have counted yet and that still count at `now`
    /// (our clock): a fixed window's admitted in an earlier window count in none.
    fn unreported_at(&self, now: Nanos) -> u64 {
        let window = window_of(&self.limit, self.on_counter(now));
        let current = |since: Nanos| window_of(&self.limit, since) >= window;
        let spent = if current(self.spent_since) { self.spent } else { 0 };
        let pending = self.pending.filter(|p| p.since == 0 || current(p.since)).map_or(0, |p| p.units);
        spent.saturating_add(pending)
    }

    /// Cuts a batch at `now` (our clock) of what was spent: its seq `seq`, units and since.
    fn cut(&mut self, seq: u64, now: Nanos) -> InFlight {
        self.drop_ended(now);
        let since = if self.spent > 0 { self.spent_since } else { 0 };
        let mut units = std::mem::take(&mut self.spent);
        // Units reported for a call that took nothing in the end come off these: of a fixed
        // window, only in the window they were counted in (they count in no other).
        let (owed, owed_at) = self.owed;
        if owed > 0 && units > 0 {
            let per = self.limit.per().max(1);
            if self.limit.algorithm() == Algorithm::FixedWindow && owed_at / per != since / per {
                self.owed = (0, 0);
            } else {
                let off = units.min(owed);
                units -= off;
                self.owed.0 = owed - off;
            }
        }
        // Past this cut Redis may have counted the batch, and stopped holding what it carried.
        self.carried = 0;
        let batch = InFlight { seq, units, sent: now, since, failures: (0, 0), next: 0, release: false };
        self.pending = Some(batch);
        batch
    }
}

/// Where a call's hits were taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// From this process's grant (given back here).
    Grant,
    /// At Redis (given back there).
    Redis,
    /// This many from this process's grant ([`Leases::take_part`]), the rest at Redis.
    Split(u64),
}

/// The grants this process holds.
#[derive(Debug)]
pub struct Leases {
    /// This process's node id on its counters.
    pub node: u64,
    seq: AtomicU64,
    asks: AtomicU64,
    held: Mutex<HashMap<String, Held>>,
    /// Calls decided from a grant.
    pub local: AtomicU64,
    /// Asks sent to Redis.
    pub asked: AtomicU64,
    /// Batches acknowledged.
    pub synced: AtomicU64,
    /// Units of batches given up after [`RETRY_HORIZON`] (Redis unreachable that long).
    pub dropped: AtomicU64,
    /// Batches acknowledged, as a generation: a batch that failed before the last one was
    /// goes again at the next flush (Redis takes writes again).
    acks: AtomicU64,
    /// Calls on a counter not held yet decided on an initial share, without waiting.
    pub cold: AtomicU64,
    /// Whether Redis answered the last call made to it (false until one has): while it does
    /// not, no call is decided on a grant or an initial share (it asks, and is refused as
    /// unavailable; the proxy's failure mode decides).
    redis_ok: std::sync::atomic::AtomicBool,
    /// The most nodes seen, this minute and the one before (minute, this one's, the last
    /// one's) — on a counter in Redis's answers, or service processes present on the Redis
    /// ([`Leases::present`]): what an initial share is divided by.
    fleet: Mutex<(u64, u32, u32)>,
    /// Whether this process's last note of itself as present in Redis was answered (false
    /// until one is): until then the others may not count it, and it does not know how many
    /// they are, so no call is decided on an initial share.
    registered: std::sync::atomic::AtomicBool,
    /// The clock of the counter last answered: a counter's until its own is.
    clock: Mutex<Clock>,
    /// The counters too low for an initial share, as the processes found them.
    low: Mutex<Low>,
}

/// Counters on which a process new to them asks Redis rather than spend an initial share
/// blind ([`low_until`]), as every process on the Redis found them: each process tells Redis
/// of those it finds with its note of itself as present, and reads the list back when it
/// changed ([`Kv::present`]), so within two [`FLUSH`]es of one process finding a counter
/// spent, the others know.
#[derive(Debug, Default)]
struct Low {
    /// Each counter's key and until when (Redis's clock).
    known: HashMap<String, Nanos>,
    /// Those this process found and has not told Redis of yet.
    untold: Vec<(String, Nanos)>,
    /// The version of the list last read.
    version: String,
}

/// Most counters found low that a process tells Redis of at once (more wait their turn).
const MAX_UNTOLD: usize = 256;

impl Default for Leases {
    fn default() -> Leases {
        Leases::new()
    }
}

impl Leases {
    /// No grants yet, and a node id of its own.
    pub fn new() -> Leases {
        let node = std::collections::hash_map::RandomState::new().hash_one((std::process::id(), super::wall_clock()));
        Leases {
            node: node.max(1),
            seq: AtomicU64::new(0),
            asks: AtomicU64::new(0),
            held: Mutex::default(),
            local: AtomicU64::new(0),
            asked: AtomicU64::new(0),
            synced: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            acks: AtomicU64::new(0),
            cold: AtomicU64::new(0),
            redis_ok: std::sync::atomic::AtomicBool::new(false),
            fleet: Mutex::new((0, 1, 1)),
            registered: std::sync::atomic::AtomicBool::new(false),
            clock: Mutex::default(),
            low: Mutex::default(),
        }
    }

    /// Notes counter `rkey` as too low for an initial share until `until` (the counter's
    /// clock; None: not low), to tell Redis of with the next note of presence.
    pub fn note_low(&self, rkey: &str, until: Option<Nanos>) {
        let (Some(until), Ok(mut low)) = (until, self.low.lock()) else { return };
        // Put later by less than a flush: not worth a word to Redis.
        let flush = u64::try_from(FLUSH.as_nanos()).unwrap_or(u64::MAX);
        if low.known.get(rkey).is_some_and(|t| t.saturating_add(flush) >= until) {
            return;
        }
        if low.known.len() >= crate::MAX_LOW * 2 {
            low.known.retain(|_, t| *t > until.saturating_sub(flush));
        }
        if low.known.len() < crate::MAX_LOW * 2 {
            low.known.insert(rkey.to_owned(), until);
        }
        let untold = &mut low.untold;
        match untold.iter().position(|(k, _)| k == rkey) {
            Some(i) => untold.get_mut(i).into_iter().for_each(|entry| entry.1 = until),
            None if untold.len() < MAX_UNTOLD => untold.push((rkey.to_owned(), until)),
            None => {}
        }
    }

    /// What to tell Redis with the next note of presence: the counters found low, and the
    /// version of the list last read.
    fn to_tell(&self) -> (Vec<(String, Nanos)>, String) {
        self.low.lock().map_or_else(
            |_| (Vec::new(), String::new()),
            |mut low| (std::mem::take(&mut low.untold), low.version.clone()),
        )
    }

    /// Whether some counter found too low is still to be told of.
    fn has_untold(&self) -> bool {
        self.low.lock().is_ok_and(|low| !low.untold.is_empty())
    }

    /// Notes Redis's answer to a note of presence that told it `told`: the list of counters
    /// low when it changed; `told` again with the next note when Redis did not answer.
    fn heard_low(&self, answer: Option<&Option<crate::LowList>>, told: Vec<(String, Nanos)>) {
        let Ok(mut low) = self.low.lock() else { return };
        match answer {
            Some(Some((version, entries))) => {
                low.known = entries.iter().cloned().collect();
                low.version.clone_from(version);
            }
            Some(None) => {}
            None => {
                for entry in told {
                    if low.untold.len() < MAX_UNTOLD && !low.untold.iter().any(|(k, _)| *k == entry.0) {
                        low.untold.push(entry);
                    }
                }
            }
        }
    }

    /// Whether counter `rkey` is too low for an initial share at `at` (Redis's clock).
    fn is_low(&self, rkey: &str, at: Nanos) -> bool {
        self.low.lock().is_ok_and(|low| low.known.get(rkey).is_some_and(|until| *until > at))
    }

    /// Counter `rkey`'s clock as this process knows it.
    fn clock_of(&self, rkey: &str) -> Clock {
        let own = self.held.lock().ok().and_then(|held| held.get(rkey).map(|h| h.clock));
        own.unwrap_or_else(|| self.process_clock())
    }

    /// The clock of the counter this process last heard from (or Redis's, at its last note of
    /// itself as present): a counter's until its own is known.
    fn process_clock(&self) -> Clock {
        self.clock.lock().ok().map(|c| *c).unwrap_or_default()
    }

    /// The instant a transition of counter `rkey` read at Redis at `raw` (Redis's clock) runs
    /// at: not before an instant the counter is known to have seen ([`Clock`]).
    pub fn run_at(&self, rkey: &str, raw: Nanos) -> Nanos {
        self.clock_of(rkey).run_at(raw)
    }

    /// Notes an answer from counter `rkey`: Redis's clock read `raw` when ours read `ours`,
    /// and the transition ran at `ran`.
    pub fn observed(&self, rkey: &str, raw: Nanos, ours: Nanos, ran: Nanos) {
        if let Ok(mut c) = self.clock.lock() {
            c.observe(raw, ours, ran);
        }
        if let Ok(mut held) = self.held.lock() {
            if let Some(h) = held.get_mut(rkey) {
                h.clock.observe(raw, ours, ran);
            }
        }
    }

    /// Notes Redis's clock, read `raw` when ours read `ours`, outside any counter's answer.
    pub fn observed_redis(&self, raw: Nanos, ours: Nanos) {
        if let Ok(mut c) = self.clock.lock() {
            c.observe(raw, ours, raw);
        }
    }

    /// `now` (our clock) on counter `rkey`'s clock, as far as this process knows it.
    pub fn on_counter(&self, rkey: &str, now: Nanos) -> Nanos {
        self.clock_of(rkey).at(now)
    }

    /// Notes whether a call to Redis was answered.
    pub fn reached(&self, ok: bool) {
        self.redis_ok.store(ok, Ordering::Relaxed);
    }

    /// Notes the answer to this process's note of itself as present in Redis at `now`: the
    /// service processes on the Redis (None: no answer).
    pub fn present(&self, processes: Option<u32>, now: Nanos) {
        if let Some(n) = processes {
            self.saw_nodes(n, now);
        }
        self.registered.store(processes.is_some(), Ordering::Relaxed);
        self.reached(processes.is_some());
    }

    /// Notes the nodes an answer at `now` showed on its counter.
    fn saw_nodes(&self, nodes: u32, now: Nanos) {
        let Ok(mut f) = self.fleet.lock() else { return };
        let minute = now / (60 * ratewall_core::SECOND);
        if minute != f.0 {
            *f = (minute, 1, if minute == f.0 + 1 { f.1 } else { 1 });
        }
        f.1 = f.1.max(nodes);
    }

    /// Nodes an initial share is divided by (at least 1).
    fn fleet(&self) -> u64 {
        self.fleet.lock().map_or(1, |f| u64::from(f.1.max(f.2).max(1)))
    }

    /// Decides a call on a counter this process holds nothing of (never asked, or forgotten
    /// once its quota was restored) without waiting for Redis: it spends an initial share,
    /// `quota / nodes` (rounded down; `nodes`: the most service processes present on the
    /// Redis, or nodes on one counter, seen this minute or the last), and the next batch
    /// reports what it admitted; Redis's answer is the grant from then on. None — the call
    /// asks — when the counter is held, the share cannot pay for `hits`, no more counters can
    /// be held, Redis did not answer the last call or this process's last note of itself as
    /// present, or past the first quarter of a fixed window: the other processes may have
    /// spent its quota by then, and a share spent blind would come on top of it.
    pub fn cold(&self, rkey: &str, limit: Limit, hits: u64, now: Nanos) -> Option<Decision> {
        if !self.redis_ok.load(Ordering::Relaxed) || !self.registered.load(Ordering::Relaxed) {
            return None;
        }
        let (quota, per) = (limit.quota(), limit.per().max(1));
        let fixed = limit.algorithm() == Algorithm::FixedWindow;
        // The window's quarter on the counter's clock, which its windows run on.
        let clock = self.process_clock();
        if fixed && clock.at(now) % per >= per / 4 {
            return None;
        }
        if self.is_low(rkey, clock.at(now)) {
            return None;
        }
        let nodes = self.fleet();
        let mut held = self.held.lock().ok()?;
        if held.contains_key(rkey) || held.len() >= MAX_HELD {
            return None;
        }
        // What the counter admits at once: a token bucket's burst, not its rate's quota.
        let share = limit.capacity() / nodes;
        if hits == 0 || hits > share {
            return None;
        }
        // The counter as far as this process knows: fresh, and its hits taken.
        let (before, _) = limit.decide(&ratewall_core::State::Fresh, now, 0);
        let (decision, _) = limit.decide(&ratewall_core::State::Fresh, now, hits);
        let until = lease_end(limit, now, ratewall_core::sync::MAX_LEASE, before.reset_after.max(decision.reset_after));
        held.insert(
            rkey.to_owned(),
            Held {
                limit,
                grant: share - hits,
                until,
                extra: 0,
                carried: 0,
                extra_until: 0,
                spent: hits,
                spent_since: clock.at(now),
                owed: (0, 0),
                pending: None,
                clock,
                view: (before.remaining, before.reset_after, now),
                used: now,
                gap: 0,
                denied_until: 0,
                denied_hits: 0,
                retry_at: None,
                answered: false,
            },
        );
        self.cold.fetch_add(1, Ordering::Relaxed);
        Some(Decision { allowed: true, limit: quota, retry_after: None, ..decision })
    }

    /// Spends on a call of `hits` that its grant of counter `rkey` cannot pay whole what the
    /// grant holds at `now` (our clock): the units taken, for the call to ask Redis for only
    /// the rest (0: none taken). Its own grant is held against a process's ask, so a call of
    /// more hits than it holds asked for all of them was refused with them free: on a
    /// token bucket of 10 an hour, a call of 1 then one of 9 on a process holding 4 of the 9
    /// left. What is taken goes back ([`Leases::give_back`]) when the ask is refused.
    pub fn take_part(&self, rkey: &str, limit: Limit, hits: u64, now: Nanos) -> u64 {
        if hits == 0 || !self.redis_ok.load(Ordering::Relaxed) {
            return 0;
        }
        let Ok(mut held) = self.held.lock() else { return 0 };
        let Some(h) = held.get_mut(rkey).filter(|h| h.limit == limit) else { return 0 };
        let (carried, grant, extra) = h.spendable(now);
        let part = carried.saturating_add(grant).saturating_add(extra).min(hits);
        if part == 0 || h.spend(part, now).is_none() {
            return 0;
        }
        h.admit(part, now);
        part
    }

    /// A new ask number (never 0).
    pub fn next_ask(&self) -> u64 {
        self.asks.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Takes `hits` from the grant of counter `rkey` at `now` (our clock): the decision, or
    /// None when the call must ask at Redis. A refused ask answers from here for a while.
    pub fn take(&self, rkey: &str, limit: Limit, hits: u64, now: Nanos) -> Option<Decision> {
        let mut held = self.held.lock().ok()?;
        let h = held.get_mut(rkey)?;
        if h.limit != limit {
            return None;
        }
        h.called(now);
        h.drop_ended(now);
        let (_, reset_after) = estimate(h, now);
        if hits > 0 && hits >= h.denied_hits && now < h.denied_until {
            self.local.fetch_add(1, Ordering::Relaxed);
            // The refused call's own retry time, not the end of its stay in memory.
            let retry = h.retry_at.map(|at| at.saturating_sub(now));
            return Some(Decision {
                allowed: false,
                limit: limit.quota(),
                remaining: 0,
                reset_after,
                retry_after: retry,
            });
        }
        // While Redis does not answer (or has not yet), a call is not decided on a grant: it
        // asks, and is answered `UNAVAILABLE` within the deadline, as Envoy's own service
        // answers (Envoy's `failure_mode_deny` then decides).
        if !self.redis_ok.load(Ordering::Relaxed) {
            return None;
        }
        // A look (no hits) answers the counter as it stands: from a view older than
        // [`STALE_LOOK`] (a counter this process has not spent on lately gets no answers) it
        // asks. Answered from memory, three processes' looks at one counter said 38, 30 and 30
        // where 30 were left, seconds after the others' spending.
        if hits == 0 && now.saturating_sub(h.view.2) > STALE_LOOK {
            return None;
        }
        h.spend(hits, now)?;
        h.admit(hits, now);
        self.local.fetch_add(1, Ordering::Relaxed);
        let (remaining, reset_after) = estimate(h, now);
        Some(Decision { allowed: true, limit: limit.quota(), remaining, reset_after, retry_after: None })
    }

    /// Records an ask's answer at `now` (our clock) for a call whose `hits` were asked for,
    /// `part` more having been taken from the grant first ([`Leases::take_part`]): the units
    /// beside them become this process's grant. Returns the call's decision, and where its
    /// asked hits were taken (a refused ask's call is admitted on a grant that came while it
    /// waited its turn).
    pub fn answered(
        &self,
        rkey: &str,
        limit: Limit,
        (hits, part): (u64, u64),
        a: &Applied,
        retry: Option<Nanos>,
        now: Nanos,
    ) -> (Decision, Source) {
        self.asked.fetch_add(1, Ordering::Relaxed);
        self.saw_nodes(a.nodes, now);
        let allowed = hits == 0 || a.grant >= hits;
        // `a.reset_after` is the counter's own reset (for a refused ask [`super::ask_at`] gives
        // it: the core's answer says when the ask could be taken, which read as the reset had a
        // spent token bucket looked at as full again in a second).
        // What Redis answered, less the units this process admitted that it has not counted yet.
        let mut known = (a.remaining, a.reset_after);
        let mut from = Source::Redis;
        if let Ok(mut held) = self.held.lock() {
            if held.len() >= MAX_HELD && !held.contains_key(rkey) {
                held.retain(|_, h| h.pending.is_some() || h.spent > 0 || now < h.held_until());
            }
            if held.len() < MAX_HELD || held.contains_key(rkey) {
                let clock = self.process_clock();
                let h = held.entry(rkey.to_owned()).or_insert_with(|| Held {
                    limit,
                    grant: 0,
                    until: 0,
                    extra: 0,
                    carried: 0,
                    extra_until: 0,
                    spent: 0,
                    spent_since: 0,
                    owed: (0, 0),
                    pending: None,
                    clock,
                    view: (0, 0, now),
                    used: now,
                    gap: 0,
                    denied_until: 0,
                    denied_hits: 0,
                    retry_at: None,
                    answered: true,
                });
                if h.limit != limit {
                    // The rules changed: what was held under the old limit is not spent any more.
                    h.limit = limit;
                    h.grant = 0;
                    h.extra = 0;
                    h.carried = 0;
                }
                h.called(now);
                h.answered = true;
                h.drop_ended(now);
                h.view = (a.remaining, a.reset_after, now);
                known = estimate(h, now);
                if allowed {
                    // Beside what the process holds: Redis holds both (an ask answered while
                    // another was on its way had the units of the first dropped here).
                    if now >= h.extra_until {
                        (h.extra, h.carried) = (0, 0);
                    }
                    h.extra = h.extra.saturating_add(a.grant - hits);
                    h.extra_until = h.extra_until.max(lease_end(limit, now, a.lease, a.reset_after));
                    h.denied_until = 0;
                } else if hits > 0 && h.spend(hits, now).is_some() {
                    // A batch's answer gave a grant while the ask waited its turn: Redis held
                    // it for this process, and refused the ask for it.
                    h.admit(hits, now);
                    known = estimate(h, now);
                    from = Source::Grant;
                    h.denied_until = 0;
                } else if hits > 0 {
                    h.denied_until = now.saturating_add(retry.unwrap_or(DENY_CACHE).min(DENY_CACHE));
                    h.denied_hits = hits.saturating_add(part);
                    h.retry_at = retry.map(|r| now.saturating_add(r));
                }
            }
        }
        let allowed = allowed || from == Source::Grant;
        // A refused call's reset is no sooner than it fits (`retry`).
        let reset_after = if allowed { known.1 } else { known.1.max(retry.unwrap_or(0)) };
        let d = Decision {
            allowed,
            limit: limit.quota(),
            remaining: if allowed { known.0 } else { 0 },
            reset_after,
            retry_after: if allowed { None } else { retry },
        };
        (d, from)
    }

    /// The batch of a counter spent on an initial share that Redis has not answered for yet
    /// (the one in flight, if any, else one cut now), for a call its share cannot pay: the
    /// call sends it first, so that what it then asks for is answered from a count that has
    /// those units. None for any other counter.
    pub fn unanswered(&self, rkey: &str, now: Nanos) -> Option<Batch> {
        let mut held = self.held.lock().ok()?;
        let h = held.get_mut(rkey).filter(|h| !h.answered)?;
        let b = match h.pending {
            Some(b) => b,
            None => h.cut(self.seq.fetch_add(1, Ordering::Relaxed) + 1, now),
        };
        Some(b.batch(rkey, h.limit))
    }

    /// Units of counter `rkey` this process admitted that Redis may not have counted yet
    /// (spent since the last batch, and the batch in flight), of those that still count at
    /// `now` (a fixed window's of an ended window do not).
    pub fn unreported(&self, rkey: &str, now: Nanos) -> u64 {
        let Ok(held) = self.held.lock() else { return 0 };
        held.get(rkey).map_or(0, |h| h.unreported_at(now))
    }

    /// What of counter `rkey` this process may still spend at `now` (our clock) or has spent
    /// and Redis may not have counted: the most of its grants at Redis an ask of its must
    /// leave held ([`Counter::ask_holding`]). Changed only by Redis's answers, which are
    /// noted in turn: a call spends what it then no longer may spend.
    pub fn holding(&self, rkey: &str, now: Nanos) -> u64 {
        let Ok(held) = self.held.lock() else { return u64::MAX };
        held.get(rkey).map_or(0, |h| {
            let (carried, grant, extra) = h.spendable(now);
            h.unreported_at(now).saturating_add(carried).saturating_add(grant).saturating_add(extra)
        })
    }

    /// Gives back `hits` taken from the grant: false when they were reported already (then
    /// they are given back at Redis).
    pub fn give_back(&self, rkey: &str, hits: u64) -> bool {
        let Ok(mut held) = self.held.lock() else { return false };
        match held.get_mut(rkey) {
            Some(h) if h.spent >= hits => {
                h.spent -= hits;
                // To what lasts longer of what it may have come from.
                if h.extra_until > h.until {
                    h.extra = h.extra.saturating_add(hits);
                } else {
                    h.grant = h.grant.saturating_add(hits);
                }
                true
            }
            _ => false,
        }
    }

    /// Gives back `hits` a call took from the grant at `at` (the counter's clock) and did not
    /// use (it went unanswered): to the grant, or, reported already, off the next units
    /// reported ([`Held::cut`]).
    pub fn give_back_or_owe(&self, rkey: &str, hits: u64, at: Nanos) {
        if self.give_back(rkey, hits) {
            return;
        }
        let Ok(mut held) = self.held.lock() else { return };
        if let Some(h) = held.get_mut(rkey) {
            h.owed = (h.owed.0.saturating_add(hits), at);
        }
    }

    /// Notes `hits` given back at Redis (reported already, so not in this process's grant):
    /// the view of the counter gains them, as Redis's count did.
    pub fn refunded(&self, rkey: &str, hits: u64) {
        let Ok(mut held) = self.held.lock() else { return };
        if let Some(h) = held.get_mut(rkey) {
            let (remaining, reset_after, at) = h.view;
            let reset_after = reset_after_given_back(h.limit, reset_after, hits);
            h.view = (remaining.saturating_add(hits).min(h.limit.quota()), reset_after, at);
        }
    }

    /// The batches due at `now`, one per counter (a retry keeps its seq). A grant still in
    /// use is renewed before it ends even when nothing was spent. A fixed window's units
    /// admitted in a window that has ended are not reported.
    fn due(&self, now: Nanos) -> Vec<Batch> {
        self.batches(now, false)
    }

    /// The batches that report every unit admitted and not yet counted at `now`, for a
    /// process that stops: per counter, the batch in flight (resent with its seq), else one
    /// cut of what was spent since. No grant is renewed and no counter forgotten. Empty once
    /// Redis has acknowledged everything (a counter whose batch in flight is answered and
    /// that spent nothing since). A counter that spent while its batch was on its way needs
    /// two rounds: the batch, then the units after it.
    fn unreported_batches(&self, now: Nanos) -> Vec<Batch> {
        self.batches(now, true)
    }

    fn batches(&self, now: Nanos, stopping: bool) -> Vec<Batch> {
        let Ok(mut held) = self.held.lock() else { return Vec::new() };
        let mut out = Vec::new();
        let renew = 2 * u64::try_from(FLUSH.as_nanos()).unwrap_or(u64::MAX);
        held.retain(|rkey, h| {
            let limit = h.limit;
            let batch = |b: InFlight| b.batch(rkey, limit);
            if let Some(b) = h.pending {
                if now.saturating_sub(b.sent) > RETRY_HORIZON {
                    // Past the horizon a store may have forgotten the seq: dropped, never
                    // counted twice.
                    self.dropped.fetch_add(b.units, Ordering::Relaxed);
                    h.pending = None;
                } else {
                    // Sent again as it was: Redis counts none of it if its window has ended.
                    // A batch whose sends keep failing waits longer each time, unless another
                    // batch was acknowledged since (a Redis that refuses writes — out of
                    // memory, read-only — was sent every counter's batch every flush).
                    let acked_since = b.failures.1 < self.acks.load(Ordering::Relaxed);
                    if stopping || now >= b.next || acked_since {
                        out.push(batch(b));
                    }
                    return true;
                }
            }
            h.drop_ended(now);
            if !stopping && h.answered && h.idle(now) {
                // What it holds goes back with this batch, and is spent no more here.
                let mut b = h.cut(self.seq.fetch_add(1, Ordering::Relaxed) + 1, now);
                b.release = true;
                h.pending = Some(b);
                (h.grant, h.extra, h.carried) = (0, 0, 0);
                (h.until, h.extra_until) = (now, now);
                out.push(batch(b));
                return true;
            }
            let in_use = now.saturating_sub(h.used) < 2 * ratewall_core::sync::MAX_LEASE;
            // Renewed while calls come (not once the counter has gone idle here).
            let calling = now.saturating_sub(h.used) < h.quiet();
            if h.spent > 0 || (!stopping && calling && h.held_until().saturating_sub(now) < renew) {
                let b = h.cut(self.seq.fetch_add(1, Ordering::Relaxed) + 1, now);
                out.push(batch(b));
                return true;
            }
            // Forgotten once idle, its grant over, nothing to report and its quota restored as
            // far as it knows (a counter forgotten sooner would be spent again on an initial
            // share: see `cold`).
            // And idle for as long as any state of its limit takes to be whole again: a spent
            // sliding window's answer says when one unit is free, and a counter forgotten then
            // was spent again on an initial share (50 more of 50 a minute at the next window's
            // start, where 1 was free).
            let (remaining, reset_after, at) = h.view;
            let restored = (remaining >= h.limit.quota() || now >= at.saturating_add(reset_after))
                && now >= whole_after(h.limit, h.on_counter(h.used));
            stopping || in_use || now < h.held_until() || !restored
        });
        out
    }

    /// Records that batch `seq` of counter `rkey` sent at `now` (our clock) was not
    /// acknowledged: it goes again after [`FLUSH`], then twice as long each time it fails
    /// again, at most [`MAX_BACKOFF`].
    pub fn failed(&self, rkey: &str, seq: u64, now: Nanos) {
        let Ok(mut held) = self.held.lock() else { return };
        let Some(b) = held.get_mut(rkey).and_then(|h| h.pending.as_mut()).filter(|b| b.seq == seq) else { return };
        let flush = u64::try_from(FLUSH.as_nanos()).unwrap_or(u64::MAX);
        let wait = flush.saturating_mul(1 << b.failures.0.min(5)).min(MAX_BACKOFF);
        b.failures = (b.failures.0.saturating_add(1), self.acks.load(Ordering::Relaxed));
        b.next = now.saturating_add(wait);
    }

    /// Records a batch's transition at Redis ([`reported`]) at `now` (our clock): its answer,
    /// and the counter as too low for an initial share if it is.
    pub fn reported(&self, rkey: &str, seq: u64, (a, low): &(Applied, Option<Nanos>), now: Nanos) {
        self.note_low(rkey, *low);
        self.synced(rkey, seq, a, now);
    }

    /// Records a batch's answer at `now` (our clock).
    pub fn synced(&self, rkey: &str, seq: u64, a: &Applied, now: Nanos) {
        self.synced.fetch_add(1, Ordering::Relaxed);
        self.acks.fetch_add(1, Ordering::Relaxed);
        self.saw_nodes(a.nodes, now);
        let Ok(mut held) = self.held.lock() else { return };
        let Some(h) = held.get_mut(rkey) else { return };
        let released = h.pending.is_some_and(|b| b.seq == seq && b.release);
        if h.pending.is_some_and(|b| b.seq == seq) {
            h.pending = None;
        }
        h.answered = true;
        // What was spent while the batch travelled came from the old grant, and is not in
        // the answer's remaining yet (a fixed window's of an ended window: in none).
        h.drop_ended(now);
        h.grant = a.grant.saturating_sub(h.spent);
        // A batch that gave everything back leaves nothing on lease.
        h.until = if released { now } else { lease_end(h.limit, now, a.lease, a.reset_after) };
        // What its asks were given is carried by Redis through this batch, until the next —
        // unless the batch gave back all the process held, those of asks Redis answered
        // before it included.
        (h.carried, h.extra) = if released { (0, 0) } else { (h.extra, 0) };
        // A grant answers calls again, whatever an ask was refused before it.
        if h.grant > 0 {
            h.denied_until = 0;
        }
        // The units spent since the batch was cut are not in the answer: `estimate` takes them
        // off.
        h.view = (a.remaining, a.reset_after, now);
    }

    /// Counters held.
    pub fn held(&self) -> usize {
        self.held.lock().map_or(0, |h| h.len())
    }
}

/// A counter's time to reset once `hits` taken are given back: a token bucket is full again
/// sooner by one interval a hit; a window's end does not move.
pub(crate) fn reset_after_given_back(limit: Limit, reset_after: Nanos, hits: u64) -> Nanos {
    if limit.algorithm() == Algorithm::TokenBucket {
        reset_after.saturating_sub(hits.saturating_mul(limit.interval()))
    } else {
        reset_after
    }
}

/// When any state of `limit` whose last unit came at `last` is whole again: a fixed window's
/// end, the end of a sliding window's next window (its units weigh on it), a sliding log's
/// `per` and a slot later, a bucket's time to fill.
fn whole_after(limit: Limit, last: Nanos) -> Nanos {
    let per = limit.per().max(1);
    let window_end = |windows: u64| (last / per).saturating_add(windows).saturating_mul(per);
    match limit.algorithm() {
        Algorithm::FixedWindow | Algorithm::Concurrent => window_end(1),
        Algorithm::SlidingWindow => window_end(2),
        Algorithm::SlidingLog => last.saturating_add(per).saturating_add(limit.quantum()),
        Algorithm::TokenBucket | Algorithm::LeakyBucket => {
            last.saturating_add(limit.capacity().saturating_mul(limit.interval()))
        }
    }
}

/// A grant's end: its lease, and for a fixed window no later than the window's end (the
/// store counts a fixed window's grant only within the window it was given in).
fn lease_end(limit: Limit, now: Nanos, lease: Nanos, reset_after: Nanos) -> Nanos {
    let lease = if limit.algorithm() == Algorithm::FixedWindow { lease.min(reset_after) } else { lease };
    now.saturating_add(lease)
}

/// The global remaining and time to reset at `now`, from the last view and what was spent
/// since.
fn estimate(h: &Held, now: Nanos) -> (u64, Nanos) {
    let (remaining, reset_after, at) = h.view;
    let elapsed = now.saturating_sub(at);
    let unreported = h.unreported_at(now);
    if h.limit.algorithm() == Algorithm::TokenBucket {
        // A bucket is full `reset_after` from when it was seen, later by one interval per unit
        // spent since; a token back per interval.
        let t = h.limit.interval().max(1);
        let span = h.limit.capacity().saturating_mul(t);
        let used = reset_after.saturating_sub(elapsed).saturating_add(unreported.saturating_mul(t)).min(span);
        return ((span - used) / t, used);
    }
    if elapsed >= reset_after {
        // The window turned (or the bucket filled) since: a fresh quota less what was spent.
        let per = h.limit.per().max(1);
        return (h.limit.quota().saturating_sub(unreported), per - h.on_counter(now) % per);
    }
    (remaining.saturating_sub(unreported), reset_after - elapsed)
}

/// Syncs `rls`'s grants every [`FLUSH`] while the process runs.
pub async fn run<K: Kv>(rls: Arc<Rls<K>>) {
    let mut tick = tokio::time::interval(FLUSH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        flush(&rls).await;
    }
}

/// Notes this process as present in Redis, sends every batch due now and records the
/// answers.
pub async fn flush<K: Kv>(rls: &Rls<K>) {
    let leases = &rls.leases;
    let present = async {
        let answer = note_present(rls, rls.store().deadline * 4).await;
        let ours = super::wall_clock();
        match &answer {
            // Redis's clock for counters this process has not heard from yet (an initial
            // share's first units are on it).
            Some(p) => leases.observed_redis(p.now, ours),
            None => {
                rls.store().metrics.redis_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        leases.present(answer.map(|p| p.processes), ours);
    };
    let due = leases.due(super::wall_clock());
    futures_util::future::join(present, send(rls, &due)).await;
}

/// Sends what this process admitted and Redis has not counted, for a process that stops
/// (its listeners closed: nothing more is admitted), round after round until Redis has
/// acknowledged all of it or `budget` has passed. Returns the units left unacknowledged
/// (0: none). A batch in flight is sent again with its seq, so a batch whose answer was
/// lost is counted once.
pub async fn flush_all<K: Kv>(rls: &Rls<K>, budget: Duration) -> u64 {
    let started = tokio::time::Instant::now();
    loop {
        let batches = rls.leases.unreported_batches(super::wall_clock());
        let left: u64 = batches.iter().map(|b| b.units).fold(0, u64::saturating_add);
        if batches.is_empty() || started.elapsed() >= budget {
            // And the counters those answers found too low for an initial share: the other
            // processes, new to them, would spend one blind (a client that moved on from a
            // stopped process where it spent 30 of 50 was admitted 55 in all).
            let within = budget.saturating_sub(started.elapsed()).max(rls.store().deadline * 4);
            tell_low(rls, within).await;
            return left;
        }
        let sent = tokio::time::timeout(budget.saturating_sub(started.elapsed()), send(rls, &batches)).await;
        if sent.is_ok_and(|acked| acked < batches.len()) {
            // Redis failed some: not again at once.
            tokio::time::sleep(FLUSH.min(budget.saturating_sub(started.elapsed()))).await;
        }
    }
}

/// Notes this process as present in Redis within `within`, telling it of the counters found
/// too low for an initial share since the last note, and reads the list back if it changed.
async fn note_present<K: Kv>(rls: &Rls<K>, within: Duration) -> Option<crate::Presence> {
    let leases = &rls.leases;
    let (told, seen) = leases.to_tell();
    let r = tokio::time::timeout(within, rls.store().kv.present(leases.node, &told, &seen)).await;
    let answer = r.ok().and_then(Result::ok);
    leases.heard_low(answer.as_ref().map(|p| &p.low), told);
    answer
}

/// [`note_present`] for a process that stops, if it has counters found too low to tell of.
async fn tell_low<K: Kv>(rls: &Rls<K>, within: Duration) {
    if rls.leases.has_untold() {
        note_present(rls, within).await;
    }
}

/// Sends `batches` and records the answers; how many were acknowledged.
async fn send<K: Kv>(rls: &Rls<K>, batches: &[Batch]) -> usize {
    let leases = &rls.leases;
    let node = leases.node;
    let mut acked = 0;
    for chunk in batches.chunks(BATCH) {
        let sends = chunk.iter().map(|b| {
            let batch = (b.limit, b.seq, b.units, b.since);
            // Noted before another call of this process may change the counter, and its lease
            // counted from when it was sent, so that it ends here before Redis's.
            let sent = super::wall_clock();
            let synced = move |r: (Applied, Option<Nanos>)| leases.reported(&b.rkey, b.seq, &r, sent);
            let release = b.release;
            let send = rls.update_then(
                &b.rkey,
                b.limit,
                move |counter, now| reported(counter, now, node, batch, release),
                synced,
            );
            async move { (b, tokio::time::timeout(rls.store().deadline * 4, send).await) }
        });
        for (b, r) in futures_util::future::join_all(sends).await {
            if let Ok(Ok(())) = r {
                acked += 1;
            } else {
                leases.failed(&b.rkey, b.seq, super::wall_clock());
            }
        }
    }
    acked
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Batches as (key, limit, seq, units).
    fn cut(batches: Vec<Batch>) -> Vec<(String, Limit, u64, u64)> {
        batches.into_iter().map(|b| (b.rkey, b.limit, b.seq, b.units)).collect()
    }

    fn limit() -> Limit {
        Limit::new(Algorithm::FixedWindow, 100, 60 * ratewall_core::SECOND, None).unwrap()
    }

    /// Leases of a process that Redis has answered, alone on it.
    fn answered() -> Leases {
        let l = Leases::new();
        l.reached(true);
        l.present(Some(1), 0);
        l
    }

    #[test]
    fn nothing_is_decided_without_redis_before_it_answers_or_while_it_does_not() {
        let l = Leases::new();
        assert!(l.cold("k", limit(), 1, 10).is_none(), "Redis has not answered yet: it asks");
        l.present(Some(1), 0);
        l.reached(true);
        assert!(l.answered("k", limit(), (1, 0), &applied(4, 99), None, 10).0.allowed);
        assert!(l.take("k", limit(), 1, 20).is_some());
        l.reached(false);
        assert!(l.take("k", limit(), 1, 20).is_none(), "a grant held waits for Redis too");
        assert!(l.cold("other", limit(), 1, 20).is_none());
        l.reached(true);
        assert!(l.take("k", limit(), 1, 20).is_some(), "the grant is spent again once Redis answers");
    }

    fn applied(grant: u64, remaining: u64) -> Applied {
        Applied {
            remaining,
            grant,
            reset_after: 30 * ratewall_core::SECOND,
            lease: ratewall_core::SECOND,
            nodes: 1,
            counted: true,
        }
    }

    #[test]
    fn a_grant_pays_for_calls_until_spent_or_over() {
        let l = answered();
        assert!(l.take("k", limit(), 1, 10).is_none(), "nothing held yet");
        let d = l.answered("k", limit(), (1, 0), &applied(4, 99), None, 10).0;
        assert!(d.allowed);
        for _ in 0..3 {
            assert!(l.take("k", limit(), 1, 20).unwrap().allowed);
        }
        assert!(l.take("k", limit(), 1, 20).is_none(), "spent");
        assert_eq!(cut(l.due(30)), vec![("k".to_owned(), limit(), 1, 3)]);
        l.synced("k", 1, &applied(10, 93), 40);
        assert_eq!(l.take("k", limit(), 1, 50).unwrap().remaining, 92);
        assert!(l.take("k", limit(), 1, 40 + ratewall_core::SECOND).is_none(), "the lease ended");
    }

    #[test]
    fn an_unacknowledged_batch_is_sent_again_with_its_seq() {
        let l = answered();
        l.answered("k", limit(), (1, 0), &applied(5, 99), None, 0);
        l.take("k", limit(), 2, 1).unwrap();
        let first = l.due(2);
        l.take("k", limit(), 1, 3).unwrap();
        assert_eq!(l.due(4), first, "the same seq and units, the new hit waits");
        l.synced("k", first[0].seq, &applied(5, 90), 5);
        let next = l.due(6);
        assert_eq!((next[0].seq, next[0].units), (first[0].seq + 1, 1));
    }

    /// A call's part taken from the grant comes back to it; reported already, it comes off the
    /// next units reported — of a fixed window, only in the window it was counted in.
    #[test]
    fn a_part_reported_for_a_call_that_took_nothing_comes_off_the_next_batch() {
        let l = answered();
        // An ask of 1 given 4 more beside it.
        l.answered("k", limit(), (1, 0), &applied(5, 99), None, 0);
        assert_eq!(l.take_part("k", limit(), 9, 1), 4, "all the grant holds");
        l.give_back_or_owe("k", 4, 1);
        assert_eq!(l.take_part("k", limit(), 9, 2), 4, "back in the grant");
        let first = l.due(3);
        assert_eq!(first[0].units, 4);
        l.synced("k", first[0].seq, &applied(5, 90), 4);
        // Reported, then the call took nothing.
        l.give_back_or_owe("k", 4, 2);
        for t in 5..8 {
            l.take("k", limit(), 1, t).unwrap();
        }
        let next = l.due(8);
        assert_eq!(next[0].units, 0, "3 admitted, 4 owed");
        // In the next window, what is still owed counts in none.
        let minute = 60 * ratewall_core::SECOND;
        l.synced("k", next[0].seq, &applied(5, 90), 9);
        l.answered("k", limit(), (1, 0), &applied(5, 99), None, minute + 1);
        l.take("k", limit(), 2, minute + 2).unwrap();
        assert_eq!(l.due(minute + 3).iter().map(|b| b.units).sum::<u64>(), 2);
    }

    #[test]
    fn a_batch_past_the_retry_horizon_is_dropped_not_resent() {
        let l = answered();
        l.answered("k", limit(), (1, 0), &applied(5, 99), None, 0);
        l.take("k", limit(), 2, 1).unwrap();
        assert_eq!(l.due(2).len(), 1);
        assert!(l.due(3 + RETRY_HORIZON).iter().all(|b| b.units == 0));
        assert_eq!(l.dropped.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_refused_ask_answers_from_memory_briefly() {
        let l = answered();
        let d = l.answered("k", limit(), (1, 0), &applied(0, 0), Some(10 * ratewall_core::SECOND), 0).0;
        assert!(!d.allowed);
        let cached = l.take("k", limit(), 1, DENY_CACHE - 1).unwrap();
        assert!(!cached.allowed);
        assert_eq!(
            cached.retry_after,
            Some(10 * ratewall_core::SECOND - (DENY_CACHE - 1)),
            "the call's own retry time"
        );
        assert!(l.take("k", limit(), 1, DENY_CACHE).is_none());
        l.answered("k", limit(), (3, 0), &applied(0, 2), Some(ratewall_core::SECOND), 0);
        assert!(l.take("k", limit(), 2, 1).is_none(), "a smaller call may fit: it asks");
        assert!(!l.take("k", limit(), 3, 1).unwrap().allowed);
    }

    #[test]
    fn a_token_buckets_initial_share_splits_its_burst_not_its_rate() {
        let s = ratewall_core::SECOND;
        // 1,000 a minute with a burst of 200, on 4 nodes: 50 each, not 250.
        let bucket = Limit::new(Algorithm::TokenBucket, 1_000, 60 * s, Some(200)).unwrap();
        let l = answered();
        l.saw_nodes(4, 0);
        assert!(l.cold("big", bucket, 51, s).is_none(), "more than a quarter of the burst asks");
        assert!(l.cold("k", bucket, 1, s).unwrap().allowed);
        let taken = (0..60).take_while(|_| l.take("k", bucket, 1, s).is_some_and(|d| d.allowed)).count();
        assert_eq!(taken + 1, 50);
    }

    #[test]
    fn answers_show_remaining_and_reset_as_the_counter_stands_after_the_call() {
        let s = ratewall_core::SECOND;
        // 3 a minute: a token every 20 s; `reset_after` is when the bucket is full again.
        let bucket = Limit::new(Algorithm::TokenBucket, 3, 60 * s, None).unwrap();
        let l = answered();
        let d = l.cold("b", bucket, 1, s).unwrap();
        assert_eq!((d.remaining, d.reset_after), (2, 20 * s), "a fresh bucket less one token");
        let d = l.take("b", bucket, 1, s).unwrap();
        assert_eq!((d.remaining, d.reset_after), (1, 40 * s), "this call's token counted");
        // Redis counts the batch of both; the answer shows them, and nothing is taken twice.
        assert_eq!(cut(l.due(2 * s)), vec![("b".to_owned(), bucket, 1, 2)]);
        let a = Applied { remaining: 1, grant: 1, reset_after: 39 * s, lease: 10 * s, nodes: 1, counted: true };
        l.synced("b", 1, &a, 2 * s);
        let d = l.take("b", bucket, 0, 2 * s).unwrap();
        assert_eq!((d.remaining, d.reset_after), (1, 39 * s), "a look after the batch");
        let d = l.take("b", bucket, 1, 3 * s).unwrap();
        assert_eq!((d.remaining, d.reset_after), (0, 58 * s));
        // Given back at Redis once reported: the view gains it back.
        assert_eq!(cut(l.due(4 * s)), vec![("b".to_owned(), bucket, 2, 1)]);
        l.synced("b", 2, &Applied { remaining: 0, reset_after: 56 * s, grant: 0, ..a }, 4 * s);
        l.refunded("b", 1);
        let d = l.take("b", bucket, 0, 4 * s).unwrap();
        assert_eq!((d.remaining, d.reset_after), (1, 36 * s));
        // A window's: what Redis answered, less what was spent since the batch was cut.
        let l = answered();
        let ms = s / 1000;
        l.answered("w", limit(), (1, 0), &applied(10, 90), None, s);
        assert!(l.take("w", limit(), 1, s).is_some());
        assert_eq!(cut(l.due(s + 100 * ms)), vec![("w".to_owned(), limit(), 1, 1)]);
        assert!(l.take("w", limit(), 1, s + 200 * ms).is_some());
        l.synced("w", 1, &applied(10, 89), s + 300 * ms);
        assert_eq!(l.take("w", limit(), 0, s + 300 * ms).unwrap().remaining, 88, "the unit after the cut, once");
    }

    #[test]
    fn a_counter_not_held_yet_is_decided_at_once_on_an_initial_share() {
        let s = ratewall_core::SECOND;
        let l = answered();
        // Early in the window: the whole quota over the nodes Redis has shown.
        l.saw_nodes(4, 0);
        let d = l.cold("k", limit(), 1, s).unwrap();
        assert!(d.allowed);
        assert!(l.cold("k", limit(), 1, s).is_none(), "held now: its grant decides");
        for _ in 0..24 {
            assert!(l.take("k", limit(), 1, 2 * s).unwrap().allowed);
        }
        assert!(l.take("k", limit(), 1, 2 * s).is_none(), "100 / 4 spent: the next call asks");
        assert_eq!(cut(l.due(3 * s)), vec![("k".to_owned(), limit(), 1, 25)], "reported with the next batch");
        // Past the first quarter of a fixed window, nothing is admitted blind: the call asks.
        let late = answered();
        assert!(late.cold("late", limit(), 1, 15 * s).is_none());
        assert!(late.cold("late", limit(), 1, 59 * s).is_none());
        assert_eq!(late.unanswered("late", 20 * s), None, "nothing to send first");
        assert!(late.cold("late", limit(), 1, 60 * s).is_some(), "a new window's first quarter");
        let unanswered = |l: &Leases, k: &str, now: Nanos| l.unanswered(k, now).map(|b| (b.seq, b.units));
        assert_eq!(unanswered(&late, "late", 61 * s), Some((1, 1)), "the call sends the batch first");
        assert_eq!(unanswered(&late, "late", 61 * s), Some((1, 1)), "the same one while unanswered");
        assert_eq!(unanswered(&l, "k", 3 * s), Some((1, 25)), "the batch in flight");
        // A counter its batch showed spent is kept, idle, until its window ends.
        l.synced("k", 1, &applied(0, 0), 4 * s);
        assert_eq!(cut(l.due(10 * s)), vec![]);
        assert!(l.cold("k", limit(), 1, 10 * s).is_none(), "not spent again on a share");
        l.due(4 * s + 30 * s);
        assert!(l.cold("k", limit(), 1, 35 * s).is_none(), "past the first quarter: it asks");
        l.due(59 * s);
        assert_eq!(l.held(), 1, "its window not over: kept");
        l.due(61 * s);
        assert_eq!(l.held(), 0);
        assert!(l.cold("k", limit(), 1, 61 * s).is_some(), "forgotten once its quota is restored");
        l.reached(false);
        assert!(l.cold("other", limit(), 1, 36 * s).is_none(), "Redis not answering: it asks");
    }

    #[test]
    fn an_initial_share_is_divided_by_the_processes_present() {
        let s = ratewall_core::SECOND;
        let l = answered();
        assert!(l.cold("k", limit(), 100, s).is_some(), "alone: the whole quota");
        let l = Leases::new();
        l.reached(true);
        assert!(l.cold("k", limit(), 1, s).is_none(), "not noted as present yet: it asks");
        l.present(Some(3), 0);
        assert!(l.cold("big", limit(), 34, s).is_none(), "more than 100 / 3 asks");
        assert!(l.cold("k", limit(), 33, s).unwrap().allowed);
        // A process gone from the Redis still counts for the minute (and the next).
        l.present(Some(1), s);
        assert!(l.cold("k2", limit(), 34, 2 * s).is_none());
        // A counter's own nodes count too, whichever is more.
        l.saw_nodes(5, 2 * s);
        assert!(l.cold("k3", limit(), 21, 3 * s).is_none());
        assert!(l.cold("k3", limit(), 20, 3 * s).is_some());
        // Fewer units than processes: no share at all, every call asks.
        let three = Limit::new(Algorithm::SlidingWindow, 3, 60 * s, None).unwrap();
        l.present(Some(4), 3 * s);
        assert!(l.cold("small", three, 1, 3 * s).is_none());
        // Not answered: nothing on a share until the next note is.
        l.present(None, 4 * s);
        assert!(l.cold("k4", limit(), 1, 4 * s).is_none());
    }

    #[test]
    fn a_process_that_stops_reports_every_unit_not_acknowledged() {
        let s = ratewall_core::SECOND;
        let l = answered();
        l.answered("a", limit(), (1, 0), &applied(10, 99), None, 0);
        l.answered("b", limit(), (1, 0), &applied(10, 99), None, 0);
        l.answered("idle", limit(), (1, 0), &applied(10, 99), None, 0);
        l.take("a", limit(), 2, 1).unwrap();
        l.take("b", limit(), 1, 1).unwrap();
        // A batch of `a` on its way, and a unit spent after it was cut.
        let first = l.due(2);
        assert_eq!(first.iter().map(|b| b.units).sum::<u64>(), 3);
        l.take("a", limit(), 1, 3).unwrap();
        let round = l.unreported_batches(4);
        let mut units: Vec<_> = round.iter().map(|b| (b.rkey.as_str(), b.seq, b.units)).collect();
        units.sort_unstable();
        let seq = |k: &str| first.iter().find(|b| b.rkey == k).unwrap().seq;
        assert_eq!(units, vec![("a", seq("a"), 2), ("b", seq("b"), 1)], "the batches in flight, with their seqs");
        for b in &round {
            l.synced(&b.rkey, b.seq, &applied(5, 90), 5);
        }
        let round = l.unreported_batches(6);
        assert_eq!(round.iter().map(|b| (b.rkey.as_str(), b.units)).collect::<Vec<_>>(), vec![("a", 1)]);
        // No renewal (the `idle` grant is about to end), nothing forgotten.
        assert!(l.unreported_batches(s).iter().all(|b| b.rkey == "a"));
        l.synced("a", round[0].seq, &applied(5, 89), 7);
        assert_eq!(l.unreported_batches(8), vec![], "all of it acknowledged");
        assert_eq!(l.held(), 3);
    }

    #[test]
    fn a_call_whose_ask_waited_while_a_grant_came_is_admitted_on_it() {
        let l = answered();
        assert!(l.answered("k", limit(), (1, 0), &applied(1, 99), None, 0).0.allowed);
        // Refused at Redis, which held the grant a batch's answer brought meanwhile.
        l.synced("k", 1, &applied(5, 90), 1);
        let (d, from) = l.answered("k", limit(), (1, 0), &applied(0, 0), Some(ratewall_core::SECOND), 2);
        assert!(d.allowed && from == Source::Grant, "{d:?}");
        assert_eq!(l.unreported("k", 3), 1);
        // A refusal is answered from memory only until a grant comes.
        assert!(!l.answered("j", limit(), (1, 0), &applied(0, 0), Some(ratewall_core::SECOND), 2).0.allowed);
        assert!(!l.take("j", limit(), 1, 3).unwrap().allowed);
        l.synced("j", 1, &applied(5, 90), 4);
        assert!(l.take("j", limit(), 1, 5).unwrap().allowed);
    }

    #[test]
    fn given_back_hits_return_to_the_grant() {
        let l = answered();
        l.answered("k", limit(), (1, 0), &applied(2, 99), None, 0);
        l.take("k", limit(), 1, 1).unwrap();
        assert!(l.give_back("k", 1));
        assert!(l.take("k", limit(), 1, 2).is_some());
        assert!(!l.give_back("k", 5));
    }

    const MS: Nanos = 1_000_000;
    /// A time on a second's edge.
    const T: Nanos = 1_700_000_000 * ratewall_core::SECOND;

    /// This process's leases and one counter as Redis holds it, on a virtual clock, the
    /// counter's `skew` from ours: calls decided as [`Rls::take`](super::super::Rls) decides
    /// them, batches sent as [`flush`] sends them.
    struct Pair {
        l: Leases,
        c: Counter,
        limit: Limit,
        skew: i64,
        /// The process's next flush (our clock).
        tick: Nanos,
    }

    impl Pair {
        fn new(limit: Limit, skew: i64, tick: Nanos) -> Pair {
            Pair { l: answered(), c: Counter::new(limit), limit, skew, tick }
        }

        /// A transition at Redis at `t` (our clock), kept if it writes (as `Rls::update` does).
        fn update<R>(&mut self, t: Nanos, f: impl FnOnce(&mut Counter, Nanos) -> (R, bool)) -> R {
            let raw = t.saturating_add_signed(self.skew);
            let now = self.l.run_at("k", raw);
            let mut c = self.c.clone();
            c.heard_all();
            let (r, write) = f(&mut c, now);
            self.l.observed("k", raw, t, ran(&c, now));
            if write {
                self.c = c;
            }
            r
        }

        fn report(&mut self, b: &Batch, t: Nanos) {
            let (node, batch) = (self.l.node, (b.limit, b.seq, b.units, b.since));
            let r = self.update(t, |c, now| reported(c, now, node, batch, b.release));
            self.l.reported(&b.rkey, b.seq, &r, t);
        }

        /// A call of `hits` at `t` (our clock), after the flushes due before it.
        fn call(&mut self, hits: u64, t: Nanos) -> Decision {
            self.run(t);
            let limit = self.limit;
            if let Some(d) = self.l.take("k", limit, hits, t).or_else(|| self.l.cold("k", limit, hits, t)) {
                return d;
            }
            if let Some(b) = self.l.unanswered("k", t) {
                self.report(&b, t);
                if let Some(d) = self.l.take("k", limit, hits, t) {
                    return d;
                }
            }
            let (node, ask, unreported) = (self.l.node, self.l.next_ask(), self.l.unreported("k", t));
            let mine = self.l.holding("k", t);
            let (a, retry, low) = self.update(t, |c, now| {
                let (a, retry) = super::super::ask_at(c, now, (node, ask, mine), hits, unreported);
                ((a, retry, low_until(c, now)), a.counted)
            });
            self.l.note_low("k", low);
            self.l.answered("k", limit, (hits, 0), &a, retry, t).0
        }

        /// The flushes every [`FLUSH`] before `t`.
        fn run(&mut self, t: Nanos) {
            while self.tick < t {
                for b in self.l.due(self.tick) {
                    self.report(&b, self.tick);
                }
                self.tick += u64::try_from(FLUSH.as_nanos()).unwrap();
            }
        }
    }

    #[test]
    fn what_a_process_holds_on_a_counter_gone_idle_goes_back_for_the_others() {
        let s = ratewall_core::SECOND;
        let fifty = Limit::new(Algorithm::FixedWindow, 50, 3600 * s, None).unwrap();
        let l = answered();
        let grant = |grant, remaining| Applied {
            remaining,
            grant,
            reset_after: 3000 * s,
            lease: 2 * s,
            nodes: 2,
            counted: true,
        };
        // A burst of calls 3 ms apart, the grant renewed by the batch after it.
        assert!(l.answered("k", fifty, (1, 0), &grant(30, 49), None, T).0.allowed);
        assert!((1..30).all(|i| l.take("k", fifty, 1, T + i * 3 * MS).is_some_and(|d| d.allowed)));
        let b = l.due(T + 100 * MS);
        assert_eq!((b.len(), b[0].units, b[0].release), (1, 29, false));
        l.synced("k", b[0].seq, &grant(20, 20), T + 100 * MS);
        assert_eq!(l.holding("k", T + 200 * MS), 20);
        assert!(l.due(T + 200 * MS).is_empty(), "in use: held");
        // Idle for eight of its gaps (at least 250 ms): the next batch gives it back, and it
        // is spent no more here.
        let b = l.due(T + 400 * MS);
        assert_eq!((b.len(), b[0].units, b[0].release), (1, 0, true));
        assert_eq!(l.holding("k", T + 400 * MS), 0);
        l.synced("k", b[0].seq, &grant(0, 20), T + 500 * MS);
        assert!(l.due(T + 600 * MS).is_empty());
        assert!(l.due(T + 1200 * MS).is_empty(), "given back once, not renewed");
        assert!(l.take("k", fifty, 1, T + 1300 * MS).is_none(), "a call asks");
        // At Redis: counted, then nothing held for the process.
        let mut c = Counter::new(fifty);
        c.report_counted(fifty, (T, T), (l.node, 1, 30), crate::NODE_TTL, true);
        assert!(c.held_by_others(T, 99) > 0);
        let ((a, _), write) = reported(&mut c, T + MS, l.node, (fifty, 2, 0, 0), true);
        assert!(write && a.grant == 0);
        assert_eq!(c.held_by_others(T + MS, 99), 0);
    }

    #[test]
    fn a_look_at_a_counter_not_answered_lately_is_answered_at_redis() {
        let s = ratewall_core::SECOND;
        let fifty = Limit::new(Algorithm::FixedWindow, 50, 3600 * s, None).unwrap();
        let mut p = Pair::new(fifty, 0, T);
        assert!(p.call(1, T).allowed);
        p.run(T + 150 * MS);
        assert_eq!(p.call(0, T + 200 * MS).remaining, 49, "a fresh view");
        // Seconds later (no batch of this process since it went idle), another process
        // spends 10 at Redis; this process's view is stale, and the look asks.
        p.run(T + 5 * s);
        let mut c = p.c.clone();
        assert!(super::super::ask_at(&mut c, T + 5 * s, (99, 1, 0), 10, 0).0.counted);
        p.c = c;
        assert_eq!(p.call(0, T + 6 * s).remaining, 39);
    }

    #[test]
    fn a_counter_another_process_found_spent_is_asked_for_not_spent_on_an_initial_share() {
        let s = ratewall_core::SECOND;
        // An hour's token bucket of 50 (a token every 72 s): nothing comes back meanwhile.
        let bucket = Limit::new(Algorithm::TokenBucket, 50, 3600 * s, None).unwrap();
        let mut p = Pair::new(bucket, 0, T);
        p.l.saw_nodes(2, T);
        let admitted = (0..60).filter(|i| p.call(1, T + i * MS).allowed).count();
        assert_eq!(admitted, 50);
        // Found too low for a share (25 tokens) until 25 are back, and told Redis of.
        let (told, _) = p.l.to_tell();
        assert_eq!(told.len(), 1);
        let until = told[0].1;
        assert!((T + 25 * 72 * s..T + 25 * 72 * s + s).contains(&until), "{}", until - T);
        // A process that has not heard of it yet spends a share blind (25 more on top of
        // the 50); once it has, it asks Redis, which refuses.
        let blind = answered();
        blind.saw_nodes(2, T);
        assert!(blind.cold("k", bucket, 1, T + s).is_some_and(|d| d.allowed));
        let other = answered();
        other.saw_nodes(2, T);
        other.heard_low(Some(&Some(("1".into(), told.clone()))), Vec::new());
        assert!(other.cold("k", bucket, 1, T + s).is_none(), "asks");
        assert!(other.cold("j", bucket, 1, T + s).is_some(), "a counter no process found low");
        assert!(other.cold("k", bucket, 1, until + 1).is_some(), "a share fits again");
        // Told again with the next note when Redis did not answer; an unchanged list keeps
        // what is known.
        p.l.heard_low(None, told.clone());
        assert_eq!(p.l.to_tell().0, told);
        other.heard_low(Some(&None), Vec::new());
        assert!(other.cold("k", bucket, 1, T + 2 * s).is_none());
    }

    /// The `Retry-After` of a refusal: whole seconds, rounded up.
    fn retry_after(d: &Decision) -> Nanos {
        d.retry_after.unwrap().div_ceil(ratewall_core::SECOND) * ratewall_core::SECOND
    }

    #[test]
    fn a_batch_redis_keeps_refusing_is_sent_less_and_less_often_until_another_is_taken() {
        let l = answered();
        for k in ["k", "j"] {
            assert!(l.answered(k, limit(), (1, 0), &applied(4, 99), None, T).0.allowed);
            l.take(k, limit(), 1, T + MS).unwrap();
        }
        let keys = |b: Vec<Batch>| b.into_iter().map(|b| b.rkey).collect::<Vec<_>>();
        let mut t = T + 10 * MS;
        let mut sent = l.due(t);
        sent.sort_by(|a, b| a.rkey.cmp(&b.rkey));
        assert_eq!(keys(sent.clone()), ["j", "k"]);
        // Redis refuses both, again and again: each waits 100, 200, 400 ... ms, then 3.2 s.
        let mut waits = Vec::new();
        let mut last = t;
        while t < T + 20 * ratewall_core::SECOND {
            let due = l.due(t);
            if !due.is_empty() {
                waits.push((t - last) / MS);
                last = t;
                for b in &due {
                    l.failed(&b.rkey, b.seq, t);
                }
            }
            t += 10 * MS;
        }
        assert_eq!(waits[..8], [0, 100, 200, 400, 800, 1600, 3200, 3200], "{waits:?}");
        // One of them taken: the other goes at the next flush (beside the one taken, idle for
        // seconds, giving back what it holds).
        let j = sent.remove(0);
        l.synced(&j.rkey, j.seq, &applied(4, 99), t);
        let next = l.due(t + 10 * MS);
        assert_eq!(keys(next.iter().filter(|b| !b.release).cloned().collect()), ["k"]);
        assert_eq!(keys(next.into_iter().filter(|b| b.release).collect()), ["j"]);
    }

    #[test]
    fn a_spent_sliding_window_left_idle_is_not_spent_again_at_the_next_windows_start() {
        let s = ratewall_core::SECOND;
        let fifty = Limit::new(Algorithm::SlidingWindow, 50, 60 * s, None).unwrap();
        let minute = (T / (60 * s) + 1) * 60 * s;
        let mut p = Pair::new(fifty, 0, minute + 30 * s);
        let spent = (0..60).filter(|i| p.call(1, minute + 30 * s + i * MS).allowed).count();
        assert_eq!(spent, 50);
        // Idle to just past the next window's start: the 50 still weigh about 49.7.
        let next = minute + 60 * s + 300 * MS;
        let burst = (0..70).filter(|i| p.call(1, next + i * MS).allowed).count();
        assert!(burst <= 1, "{burst} admitted at the next window's start");
        // A look says so too.
        assert!(p.call(0, next + 100 * MS).remaining <= 1);
    }

    #[test]
    fn a_lone_process_admits_its_whole_limit_whatever_its_calls_pace() {
        let s = ratewall_core::SECOND;
        let fifty = Limit::new(Algorithm::FixedWindow, 50, 60 * s, None).unwrap();
        let minute = (T / (60 * s) + 1) * 60 * s;
        // Past the window's first quarter, so that its first call asks.
        for gap in [MS / 2, 3 * MS, 7 * MS, 20 * MS, 45 * MS] {
            let mut p = Pair::new(fifty, 0, minute + 20 * s);
            let mut t = minute + 20 * s + MS;
            let mut admitted = 0;
            for call in 1..=60u64 {
                let d = p.call(1, t);
                if d.allowed {
                    admitted += 1;
                } else {
                    assert_eq!(admitted, 50, "gap {gap}: call {call} refused with {admitted} admitted: {d:?}");
                }
                t += gap;
            }
            assert_eq!(admitted, 50, "gap {gap}");
        }
    }

    #[test]
    fn a_step_back_of_redis_clock_across_a_windows_edge_gives_no_fresh_quota() {
        let s = ratewall_core::SECOND;
        let five = Limit::new(Algorithm::FixedWindow, 5, 60 * s, None).unwrap();
        let minute = (T / (60 * s) + 1) * 60 * s;
        let back = -20 * i64::try_from(s).unwrap();
        for reported_before_the_step in [true, false] {
            let what = format!("reported before the step: {reported_before_the_step}");
            let mut p = Pair::new(five, 0, minute + 3 * s + 50 * MS);
            // The process's note of itself as present just before: Redis's clock.
            let before = minute + 3 * s - 100 * MS;
            p.l.observed_redis(before, before);
            for _ in 0..3 {
                assert!(p.call(1, minute + 3 * s).allowed, "{what}");
            }
            if reported_before_the_step {
                p.run(minute + 3 * s + 200 * MS);
            }
            // Redis's clock 20 s back: 16.8 s before the window's end on it.
            p.skew = back;
            for _ in 0..2 {
                assert!(p.call(1, minute + 3 * s + 300 * MS).allowed, "{what}");
            }
            let refused = p.call(1, minute + 3 * s + 400 * MS);
            assert!(!refused.allowed, "{what}");
            let wait = retry_after(&refused) / s;
            assert!((56..=58).contains(&wait), "{what}: the window's end on the clock before the step, not {wait} s");
            p.run(minute + 4 * s);
            assert_eq!(
                p.c.state,
                ratewall_core::State::FixedWindow { window: minute / (60 * s), count: 5 },
                "{what}: every unit counted in its window"
            );
            // The clock put right again: still the same window, spent.
            p.skew = 0;
            assert!(!p.call(1, minute + 5 * s).allowed, "{what}");
            assert!(!p.call(1, minute + 59 * s).allowed, "{what}");
            assert!(p.call(1, minute + 60 * s + 500 * MS).allowed, "{what}: the next window");
        }
    }

    #[test]
    fn a_batch_carries_when_its_first_unit_was_admitted_on_the_counters_clock() {
        let s = ratewall_core::SECOND;
        let bucket = Limit::new(Algorithm::TokenBucket, 10, 10 * s, None).unwrap();
        let l = answered();
        // The counter's clock 5 s behind ours.
        l.observed("k", T - 5 * s, T, T - 5 * s);
        l.answered("k", bucket, (1, 0), &applied(5, 9), None, T);
        l.take("k", bucket, 1, T + 10 * MS).unwrap();
        l.take("k", bucket, 2, T + 20 * MS).unwrap();
        let b = l.due(T + 50 * MS);
        assert_eq!((b[0].units, b[0].since), (3, T - 5 * s + 10 * MS), "since the first of them");
        assert_eq!(l.due(T + 60 * MS), b, "a retry carries the same");
        l.synced("k", b[0].seq, &applied(5, 6), T + 70 * MS);
        let next = l.due(T + 900 * MS);
        assert_eq!((next[0].units, next[0].since), (0, 0), "a batch of no units carries no time");
        // Redis counts them as of then, not when the batch came.
        let mut at_redis = Counter::new(bucket);
        let a = report(&mut at_redis, T - 5 * s + 900 * MS, 7, (bucket, 1, 3, T - 5 * s + 10 * MS));
        assert_eq!((a.remaining, a.reset_after), (7, 3 * s - 890 * MS), "full again 3 s after the first");
        // A fixed window's first quarter is the counter's too (here 10 s ahead of ours): 10 s
        // into our minute is 20 s into the counter's, 52 s is 2 s into its next one.
        let l = answered();
        l.observed("other", 10 * s, 0, 10 * s);
        assert!(l.cold("w", limit(), 1, 10 * s).is_none());
        assert!(l.cold("w", limit(), 1, 52 * s).is_some());
    }

    #[test]
    fn a_fixed_windows_units_are_reported_only_while_their_window_lasts() {
        let s = ratewall_core::SECOND;
        let three = Limit::new(Algorithm::FixedWindow, 3, s, None).unwrap();
        let end = T + s;
        // An ask late in the window: 1 taken at Redis, 2 more granted until the window's end.
        let l = answered();
        let a = Applied { remaining: 2, grant: 3, reset_after: 100 * MS, lease: s, nodes: 1, counted: true };
        assert!(l.answered("k", three, (1, 0), &a, None, end - 100 * MS).0.allowed);
        l.take("k", three, 1, end - 90 * MS).unwrap();
        l.take("k", three, 1, end - 80 * MS).unwrap();
        assert_eq!(l.unreported("k", end - 50 * MS), 2);
        assert_eq!(l.unreported("k", end), 0, "the window ended: they count in none");
        // Past the end they are not reported: the batch only renews the grant.
        assert_eq!(cut(l.due(end + 20 * MS)), vec![("k".to_owned(), three, 1, 0)]);
        // An answer in the new window is not weighed by them.
        l.synced("k", 1, &Applied { remaining: 3, grant: 3, reset_after: 980 * MS, ..a }, end + 30 * MS);
        for _ in 0..3 {
            assert!(l.take("k", three, 1, end + 40 * MS).unwrap().allowed);
        }
        // A batch cut before the end that reaches Redis after it counts in neither window.
        let l = answered();
        l.answered("k", three, (1, 0), &a, None, end - 100 * MS);
        l.take("k", three, 2, end - 90 * MS).unwrap();
        let b = l.due(end - 10 * MS);
        assert_eq!((b[0].units, b[0].since), (2, end - 90 * MS));
        let mut at_redis = Counter::new(three);
        at_redis.ask(three, end - 100 * MS, l.node, 1, 1, crate::NODE_TTL);
        // Another process's batch has moved the counter into the new window first.
        at_redis.report(three, end + MS, l.node + 1, 1, 0, crate::NODE_TTL);
        let a = report(&mut at_redis, end + 5 * MS, l.node, (three, b[0].seq, b[0].units, b[0].since));
        assert_eq!(a.remaining, 3, "the new window's quota, whole");
        assert_eq!(l.unreported("k", end + 5 * MS), 0);
    }

    /// A client that spends a token bucket (1 a second) on this process's grant, is refused,
    /// and calls again after the `Retry-After` it was given, is admitted: the process's batch
    /// is counted as of when the unit was admitted, whenever it reaches Redis (counted when it
    /// came, up to a flush later, the token came back that much after the `Retry-After`),
    /// whatever the counter's clock is to ours.
    #[test]
    fn a_client_that_waits_the_retry_after_of_a_spent_bucket_is_admitted() {
        let s = ratewall_core::SECOND;
        let bucket = Limit::new(Algorithm::TokenBucket, 1, s, None).unwrap();
        let mut tight = 0;
        for skew in [0, 7_000_000_000, -7_000_000_000] {
            for phase in [0, 30 * MS, 70 * MS] {
                for start in [2_100 * MS, 2_300 * MS, 2_500 * MS] {
                    let what = format!("skew {skew}, phase {phase}, start {start}");
                    let mut p = Pair::new(bucket, skew, T + phase);
                    // A look, then the grant's renewals hold the whole bucket for the process.
                    assert!(p.call(0, T).allowed);
                    let t1 = T + start;
                    assert!(p.call(1, t1).allowed, "{what}");
                    let refused = p.call(1, t1 + MS);
                    assert!(!refused.allowed, "{what}");
                    let wait = retry_after(&refused);
                    tight += usize::from(wait == s);
                    let again = p.call(1, t1 + MS + wait);
                    assert!(again.allowed, "{what}: after Retry-After {wait}: {again:?}");
                }
            }
        }
        assert!(tight > 0, "no refusal waited for the token alone");
    }

    /// A client that makes its last calls of a fixed window (3 a second) in its last 100 ms,
    /// is refused the one past the limit and waits the `Retry-After` it was given (the
    /// window's rest, rounded up) gets the next window's whole quota — whether the process's
    /// report of those calls reaches Redis before the window's end or after it (the next
    /// flush, or a pause), whatever the counter's clock is to ours.
    #[test]
    fn a_windows_last_calls_take_nothing_from_the_next_window() {
        let s = ratewall_core::SECOND;
        let three = Limit::new(Algorithm::FixedWindow, 3, s, None).unwrap();
        for skew in [0, 300_000_000, -300_000_000] {
            for (phase, paused) in [(0, false), (20 * MS, false), (50 * MS, false), (80 * MS, false), (0, true)] {
                let what = format!("skew {skew}, phase {phase}, paused {paused}");
                // The window ends at `end` on the counter's clock.
                let end = T + s;
                let ours = |t: Nanos| t.saturating_add_signed(-skew);
                let mut p = Pair::new(three, skew, ours(T) + phase);
                let first = ours(end - 60 * MS);
                let codes: Vec<bool> = (0..3).map(|i| p.call(1, first + i * MS).allowed).collect();
                assert_eq!(codes, [true; 3], "{what}");
                let refused = p.call(1, first + 3 * MS);
                assert!(!refused.allowed, "{what}");
                let wait = retry_after(&refused);
                assert_eq!(wait, s, "{what}: the window's rest, rounded up");
                if paused {
                    // No flush until 100 ms into the next window.
                    p.tick = ours(end + 100 * MS);
                }
                let next: Vec<bool> = (0..4).map(|i| p.call(1, first + 3 * MS + wait + i * MS).allowed).collect();
                assert_eq!(next, [true, true, true, false], "{what}: the next window's quota, whole");
            }
        }
    }

    /// A fixed window's units given beside an ask hold nothing once the window has ended:
    /// neither the process's first answer there (a batch) nor its asks are short of them.
    #[test]
    fn units_an_ask_gave_in_an_ended_window_are_held_in_none() {
        let s = ratewall_core::SECOND;
        // Over `ASKS_ONLY_UP_TO`, so that an ask is given units beside the asked one.
        let twelve = Limit::new(Algorithm::FixedWindow, 12, s, None).unwrap();
        let end = T + s;
        let mut c = Counter::new(twelve);
        let a = c.ask(twelve, end - 150 * MS, 7, 1, 1, crate::NODE_TTL);
        assert_eq!((a.grant, a.remaining), (12, 11), "1 taken, 11 beside it");
        let renewal = c.report(twelve, end + 50 * MS, 7, 1, 0, crate::NODE_TTL);
        assert_eq!((renewal.grant, renewal.remaining), (12, 12), "the next window's answer");
        // The next window's first ask: what the node holds there is what it was given there.
        let mut c = Counter::new(twelve);
        c.ask(twelve, end - 150 * MS, 7, 1, 1, crate::NODE_TTL);
        let a = c.ask(twelve, end + 50 * MS, 7, 2, 1, crate::NODE_TTL);
        assert!(a.counted, "{a:?}");
        assert_eq!(c.held_by_others(end + 60 * MS, 8), a.grant - 1, "{a:?}");
    }
}
