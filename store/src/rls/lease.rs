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
//! ([`Counter::report`](ratewall_core::sync::Counter::report), with this node's id and a
//! sequence number, so a retried batch is never counted twice), the answer being the next
//! grant; a process that stops sends what it has not reported ([`flush_all`]). These are the
//! transitions the sync endpoint runs for the filter's proxies, so the overshoot bound of
//! docs/sync-protocol.md holds for the service too, with every process a node.

use super::Rls;
use crate::Kv;
use ratewall_core::sync::{Applied, RETRY_HORIZON};
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
/// Counters synced concurrently in one flush.
const BATCH: usize = 256;

/// One counter as this process holds it.
#[derive(Clone, Debug)]
struct Held {
    limit: Limit,
    /// Units it may still admit.
    grant: u64,
    /// When the grant ends (our clock).
    until: Nanos,
    /// Units admitted since the last batch was cut.
    spent: u64,
    /// A batch sent and not yet acknowledged: its seq, its units, when first sent.
    pending: Option<(u64, u64, Nanos)>,
    /// The global view last answered: remaining, time to reset, when (our clock).
    view: (u64, Nanos, Nanos),
    /// Last call.
    used: Nanos,
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

/// Where a call's hits were taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// From this process's grant (given back here).
    Grant,
    /// At Redis (given back there).
    Redis,
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
}

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
            cold: AtomicU64::new(0),
            redis_ok: std::sync::atomic::AtomicBool::new(false),
            fleet: Mutex::new((0, 1, 1)),
            registered: std::sync::atomic::AtomicBool::new(false),
        }
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
        if fixed && now % per >= per / 4 {
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
                spent: hits,
                pending: None,
                view: (before.remaining, before.reset_after, now),
                used: now,
                denied_until: 0,
                denied_hits: 0,
                retry_at: None,
                answered: false,
            },
        );
        self.cold.fetch_add(1, Ordering::Relaxed);
        Some(Decision { allowed: true, limit: quota, retry_after: None, ..decision })
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
        h.used = now;
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
        if now >= h.until || h.grant < hits || !self.redis_ok.load(Ordering::Relaxed) {
            return None;
        }
        h.grant -= hits;
        h.spent = h.spent.saturating_add(hits);
        self.local.fetch_add(1, Ordering::Relaxed);
        let (remaining, reset_after) = estimate(h, now);
        Some(Decision { allowed: true, limit: limit.quota(), remaining, reset_after, retry_after: None })
    }

    /// Records an ask's answer at `now` (our clock) for a call of `hits`: the units beside
    /// them become this process's grant. Returns the call's decision.
    pub fn asked(
        &self,
        rkey: &str,
        limit: Limit,
        hits: u64,
        a: &Applied,
        retry: Option<Nanos>,
        now: Nanos,
    ) -> Decision {
        self.asked.fetch_add(1, Ordering::Relaxed);
        self.saw_nodes(a.nodes, now);
        let allowed = hits == 0 || a.grant >= hits;
        // What Redis answered, less the units this process admitted that it has not counted yet.
        let mut known = (a.remaining, a.reset_after);
        if let Ok(mut held) = self.held.lock() {
            if held.len() >= MAX_HELD && !held.contains_key(rkey) {
                held.retain(|_, h| h.pending.is_some() || h.spent > 0 || now < h.until);
            }
            if held.len() < MAX_HELD || held.contains_key(rkey) {
                let h = held.entry(rkey.to_owned()).or_insert_with(|| Held {
                    limit,
                    grant: 0,
                    until: 0,
                    spent: 0,
                    pending: None,
                    view: (0, 0, now),
                    used: now,
                    denied_until: 0,
                    denied_hits: 0,
                    retry_at: None,
                    answered: true,
                });
                if h.limit != limit {
                    // The rules changed: what was held under the old limit is not spent any more.
                    h.limit = limit;
                    h.grant = 0;
                }
                h.used = now;
                h.answered = true;
                h.view = (a.remaining, a.reset_after, now);
                known = estimate(h, now);
                if allowed {
                    h.grant = a.grant - hits;
                    h.until = lease_end(limit, now, a.lease, a.reset_after);
                    h.denied_until = 0;
                } else if hits > 0 {
                    h.denied_until = now.saturating_add(retry.unwrap_or(DENY_CACHE).min(DENY_CACHE));
                    h.denied_hits = hits;
                    h.retry_at = retry.map(|r| now.saturating_add(r));
                }
            }
        }
        Decision {
            allowed,
            limit: limit.quota(),
            remaining: if allowed { known.0 } else { 0 },
            reset_after: known.1,
            retry_after: if allowed { None } else { retry },
        }
    }

    /// The batch of a counter spent on an initial share that Redis has not answered for yet
    /// (its seq and units: the one in flight, if any, else one cut now), for a call its
    /// share cannot pay: the call sends it first, so that what it then asks for is answered
    /// from a count that has those units. None for any other counter.
    pub fn unanswered(&self, rkey: &str, now: Nanos) -> Option<(u64, u64)> {
        let mut held = self.held.lock().ok()?;
        let h = held.get_mut(rkey).filter(|h| !h.answered)?;
        if let Some((seq, units, _)) = h.pending {
            return Some((seq, units));
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        h.pending = Some((seq, h.spent, now));
        let units = std::mem::take(&mut h.spent);
        Some((seq, units))
    }

    /// Units of counter `rkey` this process admitted that Redis may not have counted yet
    /// (spent since the last batch, and the batch in flight).
    pub fn unreported(&self, rkey: &str) -> u64 {
        let Ok(held) = self.held.lock() else { return 0 };
        held.get(rkey).map_or(0, |h| h.spent.saturating_add(h.pending.map_or(0, |(_, u, _)| u)))
    }

    /// Gives back `hits` taken from the grant: false when they were reported already (then
    /// they are given back at Redis).
    pub fn give_back(&self, rkey: &str, hits: u64) -> bool {
        let Ok(mut held) = self.held.lock() else { return false };
        match held.get_mut(rkey) {
            Some(h) if h.spent >= hits => {
                h.spent -= hits;
                h.grant = h.grant.saturating_add(hits);
                true
            }
            _ => false,
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

    /// The batches due at `now`: per counter, its key, limit, seq and units (a retry keeps
    /// its seq). A grant still in use is renewed before it ends even when nothing was spent.
    fn due(&self, now: Nanos) -> Vec<(String, Limit, u64, u64)> {
        self.batches(now, false)
    }

    /// The batches that report every unit admitted and not yet counted at `now`, for a
    /// process that stops: per counter, the batch in flight (resent with its seq), else one
    /// cut of what was spent since. No grant is renewed and no counter forgotten. Empty once
    /// Redis has acknowledged everything (a counter whose batch in flight is answered and
    /// that spent nothing since). A counter that spent while its batch was on its way needs
    /// two rounds: the batch, then the units after it.
    fn unreported_batches(&self, now: Nanos) -> Vec<(String, Limit, u64, u64)> {
        self.batches(now, true)
    }

    fn batches(&self, now: Nanos, stopping: bool) -> Vec<(String, Limit, u64, u64)> {
        let Ok(mut held) = self.held.lock() else { return Vec::new() };
        let mut out = Vec::new();
        let renew = 2 * u64::try_from(FLUSH.as_nanos()).unwrap_or(u64::MAX);
        held.retain(|rkey, h| {
            if let Some((seq, units, first)) = h.pending {
                if now.saturating_sub(first) > RETRY_HORIZON {
                    // Past the horizon a store may have forgotten the seq: dropped, never
                    // counted twice.
                    self.dropped.fetch_add(units, Ordering::Relaxed);
                    h.pending = None;
                } else {
                    out.push((rkey.clone(), h.limit, seq, units));
                    return true;
                }
            }
            let in_use = now.saturating_sub(h.used) < 2 * ratewall_core::sync::MAX_LEASE;
            if h.spent > 0 || (!stopping && in_use && h.until.saturating_sub(now) < renew) {
                let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
                h.pending = Some((seq, h.spent, now));
                out.push((rkey.clone(), h.limit, seq, h.spent));
                h.spent = 0;
                return true;
            }
            // Forgotten once idle, its grant over, nothing to report and its quota restored as
            // far as it knows (a counter forgotten sooner would be spent again on an initial
            // share: see `cold`).
            let (remaining, reset_after, at) = h.view;
            let restored = remaining >= h.limit.quota() || now >= at.saturating_add(reset_after);
            stopping || in_use || now < h.until || !restored
        });
        out
    }

    /// Records a batch's answer at `now` (our clock).
    pub fn synced(&self, rkey: &str, seq: u64, a: &Applied, now: Nanos) {
        self.synced.fetch_add(1, Ordering::Relaxed);
        self.saw_nodes(a.nodes, now);
        let Ok(mut held) = self.held.lock() else { return };
        let Some(h) = held.get_mut(rkey) else { return };
        if h.pending.is_some_and(|(s, _, _)| s == seq) {
            h.pending = None;
        }
        h.answered = true;
        // What was spent while the batch travelled came from the old grant, and is not in
        // the answer's remaining yet.
        h.grant = a.grant.saturating_sub(h.spent);
        h.until = lease_end(h.limit, now, a.lease, a.reset_after);
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
    let unreported = h.spent.saturating_add(h.pending.map_or(0, |(_, u, _)| u));
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
        return (h.limit.quota().saturating_sub(h.spent), per - now % per);
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
        let r = tokio::time::timeout(rls.store().deadline * 4, rls.store().kv.present(leases.node)).await;
        let processes = r.ok().and_then(Result::ok);
        if processes.is_none() {
            rls.store().metrics.redis_errors.fetch_add(1, Ordering::Relaxed);
        }
        leases.present(processes, super::wall_clock());
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
        let left: u64 = batches.iter().map(|(_, _, _, units)| *units).fold(0, u64::saturating_add);
        if batches.is_empty() || started.elapsed() >= budget {
            return left;
        }
        let sent = tokio::time::timeout(budget.saturating_sub(started.elapsed()), send(rls, &batches)).await;
        if sent.is_ok_and(|acked| acked < batches.len()) {
            // Redis failed some: not again at once.
            tokio::time::sleep(FLUSH.min(budget.saturating_sub(started.elapsed()))).await;
        }
    }
}

/// Sends `batches` and records the answers; how many were acknowledged.
async fn send<K: Kv>(rls: &Rls<K>, batches: &[(String, Limit, u64, u64)]) -> usize {
    let leases = &rls.leases;
    let node = leases.node;
    let mut acked = 0;
    for chunk in batches.chunks(BATCH) {
        let sends = chunk.iter().map(|(rkey, limit, seq, units)| {
            let (limit, seq, units) = (*limit, *seq, *units);
            let send = rls.update(rkey, limit, move |counter, now| {
                let a = counter.report(limit, now, node, seq, units, crate::NODE_TTL);
                (a, a.counted)
            });
            async move { (rkey, seq, tokio::time::timeout(rls.store().deadline * 4, send).await) }
        });
        for (rkey, seq, r) in futures_util::future::join_all(sends).await {
            if let Ok(Ok(a)) = r {
                leases.synced(rkey, seq, &a, super::wall_clock());
                acked += 1;
            }
        }
    }
    acked
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(l.asked("k", limit(), 1, &applied(4, 99), None, 10).allowed);
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
        let d = l.asked("k", limit(), 1, &applied(4, 99), None, 10);
        assert!(d.allowed);
        for _ in 0..3 {
            assert!(l.take("k", limit(), 1, 20).unwrap().allowed);
        }
        assert!(l.take("k", limit(), 1, 20).is_none(), "spent");
        let due = l.due(30);
        assert_eq!(due, vec![("k".to_owned(), limit(), 1, 3)]);
        l.synced("k", 1, &applied(10, 93), 40);
        assert_eq!(l.take("k", limit(), 1, 50).unwrap().remaining, 92);
        assert!(l.take("k", limit(), 1, 40 + ratewall_core::SECOND).is_none(), "the lease ended");
    }

    #[test]
    fn an_unacknowledged_batch_is_sent_again_with_its_seq() {
        let l = answered();
        l.asked("k", limit(), 1, &applied(5, 99), None, 0);
        l.take("k", limit(), 2, 1).unwrap();
        let first = l.due(2);
        l.take("k", limit(), 1, 3).unwrap();
        assert_eq!(l.due(4), first, "the same seq and units, the new hit waits");
        l.synced("k", first[0].2, &applied(5, 90), 5);
        let next = l.due(6);
        assert_eq!((next[0].2, next[0].3), (first[0].2 + 1, 1));
    }

    #[test]
    fn a_batch_past_the_retry_horizon_is_dropped_not_resent() {
        let l = answered();
        l.asked("k", limit(), 1, &applied(5, 99), None, 0);
        l.take("k", limit(), 2, 1).unwrap();
        assert_eq!(l.due(2).len(), 1);
        assert!(l.due(3 + RETRY_HORIZON).iter().all(|(_, _, _, u)| *u == 0));
        assert_eq!(l.dropped.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_refused_ask_answers_from_memory_briefly() {
        let l = answered();
        let d = l.asked("k", limit(), 1, &applied(0, 0), Some(10 * ratewall_core::SECOND), 0);
        assert!(!d.allowed);
        let cached = l.take("k", limit(), 1, DENY_CACHE - 1).unwrap();
        assert!(!cached.allowed);
        assert_eq!(
            cached.retry_after,
            Some(10 * ratewall_core::SECOND - (DENY_CACHE - 1)),
            "the call's own retry time"
        );
        assert!(l.take("k", limit(), 1, DENY_CACHE).is_none());
        l.asked("k", limit(), 3, &applied(0, 2), Some(ratewall_core::SECOND), 0);
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
        assert_eq!(l.due(2 * s), vec![("b".to_owned(), bucket, 1, 2)]);
        let a = Applied { remaining: 1, grant: 1, reset_after: 39 * s, lease: 10 * s, nodes: 1, counted: true };
        l.synced("b", 1, &a, 2 * s);
        let d = l.take("b", bucket, 0, 2 * s).unwrap();
        assert_eq!((d.remaining, d.reset_after), (1, 39 * s), "a look after the batch");
        let d = l.take("b", bucket, 1, 3 * s).unwrap();
        assert_eq!((d.remaining, d.reset_after), (0, 58 * s));
        // Given back at Redis once reported: the view gains it back.
        assert_eq!(l.due(4 * s), vec![("b".to_owned(), bucket, 2, 1)]);
        l.synced("b", 2, &Applied { remaining: 0, reset_after: 56 * s, grant: 0, ..a }, 4 * s);
        l.refunded("b", 1);
        let d = l.take("b", bucket, 0, 4 * s).unwrap();
        assert_eq!((d.remaining, d.reset_after), (1, 36 * s));
        // A window's: what Redis answered, less what was spent since the batch was cut.
        let l = answered();
        let ms = s / 1000;
        l.asked("w", limit(), 1, &applied(10, 90), None, s);
        assert!(l.take("w", limit(), 1, s).is_some());
        assert_eq!(l.due(s + 100 * ms), vec![("w".to_owned(), limit(), 1, 1)]);
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
        assert_eq!(l.due(3 * s), vec![("k".to_owned(), limit(), 1, 25)], "reported with the next batch");
        // Past the first quarter of a fixed window, nothing is admitted blind: the call asks.
        let late = answered();
        assert!(late.cold("late", limit(), 1, 15 * s).is_none());
        assert!(late.cold("late", limit(), 1, 59 * s).is_none());
        assert_eq!(late.unanswered("late", 20 * s), None, "nothing to send first");
        assert!(late.cold("late", limit(), 1, 60 * s).is_some(), "a new window's first quarter");
        assert_eq!(late.unanswered("late", 61 * s), Some((1, 1)), "the call sends the batch first");
        assert_eq!(late.unanswered("late", 61 * s), Some((1, 1)), "the same one while unanswered");
        assert_eq!(l.unanswered("k", 3 * s), Some((1, 25)), "the batch in flight");
        // A counter its batch showed spent is kept, idle, until its window ends.
        l.synced("k", 1, &applied(0, 0), 4 * s);
        assert_eq!(l.due(10 * s), vec![]);
        assert!(l.cold("k", limit(), 1, 10 * s).is_none(), "not spent again on a share");
        l.due(4 * s + 30 * s);
        assert!(l.cold("k", limit(), 1, 35 * s).is_none(), "past the first quarter: it asks");
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
        l.asked("a", limit(), 1, &applied(10, 99), None, 0);
        l.asked("b", limit(), 1, &applied(10, 99), None, 0);
        l.asked("idle", limit(), 1, &applied(10, 99), None, 0);
        l.take("a", limit(), 2, 1).unwrap();
        l.take("b", limit(), 1, 1).unwrap();
        // A batch of `a` on its way, and a unit spent after it was cut.
        let first = l.due(2);
        assert_eq!(first.iter().map(|b| b.3).sum::<u64>(), 3);
        l.take("a", limit(), 1, 3).unwrap();
        let round = l.unreported_batches(4);
        let mut units: Vec<_> = round.iter().map(|(k, _, seq, u)| (k.as_str(), *seq, *u)).collect();
        units.sort_unstable();
        let seq = |k: &str| first.iter().find(|b| b.0 == k).unwrap().2;
        assert_eq!(units, vec![("a", seq("a"), 2), ("b", seq("b"), 1)], "the batches in flight, with their seqs");
        for (k, _, seq, _) in &round {
            l.synced(k, *seq, &applied(5, 90), 5);
        }
        let round = l.unreported_batches(6);
        assert_eq!(round.iter().map(|(k, _, _, u)| (k.as_str(), *u)).collect::<Vec<_>>(), vec![("a", 1)]);
        // No renewal (the `idle` grant is about to end), nothing forgotten.
        assert!(l.unreported_batches(s).iter().all(|(k, _, _, _)| k == "a"));
        l.synced("a", round[0].2, &applied(5, 89), 7);
        assert_eq!(l.unreported_batches(8), vec![], "all of it acknowledged");
        assert_eq!(l.held(), 3);
    }

    #[test]
    fn given_back_hits_return_to_the_grant() {
        let l = answered();
        l.asked("k", limit(), 1, &applied(2, 99), None, 0);
        l.take("k", limit(), 1, 1).unwrap();
        assert!(l.give_back("k", 1));
        assert!(l.take("k", limit(), 1, 2).is_some());
        assert!(!l.give_back("k", 5));
    }
}
