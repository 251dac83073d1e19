//! An isolate as a node of the counter objects it uses (docs/sync-protocol.md, "The
//! Worker's own traffic"): it holds a grant per counter, as a filter node does, spends it in
//! isolate memory, reports what it admitted in the background (one [`Call::Spend`] per
//! counter per [`REPORT_EVERY`], which brings the next grant), and only a request whose grant
//! is spent waits for the object. Grants are strict at the object (the grants on lease never
//! sum past what remains), so this admits no more than per-request checks would, but for the
//! units spent while a report is on its way (at most one grant per isolate) and those of an
//! isolate that disappears before reporting (at most what it held).

use super::{make_room, Call, Taken};
use ratewall_core::algo::{Algorithm, Decision, Limit, Nanos};
use ratewall_core::eval::StoreError;
use ratewall_core::sync::RETRY_HORIZON;
use serde_json::{json, Value};
use std::collections::HashMap;

/// How long units admitted from a grant wait before they are reported: one report per
/// counter per this interval, whatever the traffic.
pub const REPORT_EVERY: Nanos = 250 * super::MS;

/// A counter object's answer to [`Call::Spend`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
}

fn u64_of(v: &Value, name: &str) -> Option<u64> {
    v.get(name)?.as_u64()
}

impl Spent {
    /// The reply body (JSON).
    pub fn encode(&self) -> String {
        json!({"grant": self.grant.map(|g| g.0), "lease": self.grant.map(|g| g.1), "asked": self.asked, "ask_lease": self.ask_lease,
               "remaining": self.remaining, "reset_after": self.reset_after, "retry_after": self.retry_after,
               "now": self.now})
        .to_string()
    }

    /// Parses a reply body.
    pub fn decode(body: &str) -> Option<Spent> {
        let v: Value = serde_json::from_str(body).ok()?;
        let grant = match (v.get("grant")?, v.get("lease")?) {
            (Value::Null, Value::Null) => None,
            (g, l) => Some((g.as_u64()?, l.as_u64()?)),
        };
        Some(Spent {
            grant,
            asked: u64_of(&v, "asked")?,
            ask_lease: u64_of(&v, "ask_lease")?,
            remaining: u64_of(&v, "remaining")?,
            reset_after: u64_of(&v, "reset_after")?,
            retry_after: v.get("retry_after").and_then(Value::as_u64),
            now: u64_of(&v, "now")?,
        })
    }
}

/// How a request's check was charged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// By the object, at its clock's instant (given back with [`Call::Refund`]).
    Object(Taken),
    /// From the isolate's grant (given back with [`Grants::refund`]).
    Grant(Decision),
}

impl Answer {
    /// The decision.
    pub fn decision(&self) -> Decision {
        match self {
            Answer::Object(t) => t.decision,
            Answer::Grant(d) => *d,
        }
    }
}

/// A check decided in isolate memory, or the call to make for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Local {
    /// Admitted from the grant.
    Admitted(Decision),
    /// The grant does not cover it: this call to the counter object decides it.
    Call(Call),
}

/// A report on its way (or to retry with the same `seq`).
#[derive(Clone, Copy, Debug)]
struct Report {
    seq: u64,
    units: u64,
    first_sent: Nanos,
}

/// One counter as this isolate holds it.
#[derive(Clone, Copy, Debug)]
struct Held {
    limit: Limit,
    /// Grant units left to spend, until `until` (the isolate's clock).
    left: u64,
    until: Nanos,
    /// The last grant received (the grant runs low below half of it).
    granted: u64,
    /// Units admitted from grants and not yet reported.
    pending: u64,
    report: Option<Report>,
    /// A report is scheduled (the glue's background task for this counter runs).
    scheduled: bool,
    /// When the last report answered was sent: an ask sent before it was settled by it
    /// (its units are no longer the isolate's to spend).
    settled: Nanos,
    /// The object's last view: remaining and reset, at `known_at`.
    remaining: u64,
    reset_after: Nanos,
    known_at: Nanos,
}

impl Held {
    fn new(limit: Limit) -> Held {
        Held {
            limit,
            left: 0,
            until: 0,
            granted: 0,
            pending: 0,
            report: None,
            scheduled: false,
            settled: 0,
            remaining: 0,
            reset_after: 0,
            known_at: 0,
        }
    }

    /// Units admitted here that the object's last view does not count.
    fn unreported(&self) -> u64 {
        self.pending.saturating_add(self.report.map_or(0, |r| r.units))
    }

    /// The object's view brought forward to `now` with the units admitted here since: the
    /// remaining quota, and the time until it is whole (a bucket's grows by one emission
    /// interval per unit; a window's end does not move).
    fn view(&self, now: Nanos) -> (u64, Nanos) {
        let units = self.unreported();
        let remaining = self.remaining.saturating_sub(units);
        let reset = self.reset_after.saturating_sub(now.saturating_sub(self.known_at));
        let l = &self.limit;
        if matches!(l.algorithm(), Algorithm::TokenBucket | Algorithm::LeakyBucket) {
            let interval = l.interval();
            let span = l.capacity().saturating_mul(interval);
            return (remaining, reset.saturating_add(units.saturating_mul(interval)).min(span));
        }
        (remaining, reset)
    }

    fn live(&self, now: Nanos) -> bool {
        self.until > now || self.pending > 0 || self.report.is_some()
    }
}

/// The isolate's grants, bounded to `cap` counters.
pub struct Grants {
    /// This isolate's node id at the objects (random per isolate).
    node: u64,
    /// The last report `seq` and ask number used (one sequence for all counters: each
    /// counter only needs them to grow).
    seq: u64,
    ask: u64,
    held: HashMap<Vec<u8>, Held>,
    cap: usize,
    /// Checks admitted from a grant, without an object call.
    pub local: u64,
    /// Admitted units never reported: given up after [`RETRY_HORIZON`] of failed reports, or
    /// forgotten when the map was full of live counters.
    pub dropped: u64,
}

/// The end of a lease that starts at `sent` and lasts `lease`, and, for a fixed window, no
/// later than the window's end (its grant is not carried into the next one).
fn lease_end(limit: &Limit, sent: Nanos, lease: Nanos) -> Nanos {
    let end = sent.saturating_add(lease);
    if limit.algorithm() == Algorithm::FixedWindow {
        let per = limit.per().max(1);
        return end.min((sent / per).saturating_add(1).saturating_mul(per));
    }
    end
}

impl Grants {
    /// An isolate's grants as node `node`, holding at most `cap` counters.
    pub fn new(node: u64, cap: usize) -> Grants {
        Grants { node: node.max(1), seq: 0, ask: 0, held: HashMap::new(), cap: cap.max(1), local: 0, dropped: 0 }
    }

    fn entry(&mut self, key: &[u8], limit: Limit, now: Nanos) -> &mut Held {
        if self.held.len() >= self.cap && !self.held.contains_key(key) {
            let before: u64 = self.held.values().map(Held::unreported).sum();
            make_room(&mut self.held, key, self.cap, |h| h.live(now));
            let after: u64 = self.held.values().map(Held::unreported).sum();
            self.dropped = self.dropped.saturating_add(before.saturating_sub(after));
        }
        let h = self.held.entry(key.to_vec()).or_insert_with(|| Held::new(limit));
        if h.limit != limit {
            // The rules changed: what was granted under the old limit is not spent under the
            // new one; the units admitted are still reported.
            h.limit = limit;
            h.left = 0;
            h.until = 0;
        }
        h
    }

    /// Decides a check of `cost` units on `key` from the grant, or names the call to make.
    pub fn check(&mut self, key: &[u8], limit: Limit, cost: u64, now: Nanos) -> Local {
        let h = self.entry(key, limit, now);
        if now < h.until && cost <= h.left && h.known_at > 0 {
            h.left -= cost;
            h.pending = h.pending.saturating_add(cost);
            let (remaining, reset_after) = h.view(now);
            self.local += 1;
            return Local::Admitted(Decision {
                allowed: true,
                limit: limit.quota(),
                remaining,
                reset_after,
                retry_after: None,
            });
        }
        self.ask = self.ask.wrapping_add(1).max(1);
        let ask = self.ask;
        let (seq, units) = self.next_report(key, now).unwrap_or((0, 0));
        if seq > 0 {
            // A report a request waits on settles the isolate at the object (it then holds
            // only the grant answered): nothing of the old grant is spent while it is out.
            if let Some(h) = self.held.get_mut(key) {
                h.left = 0;
            }
        }
        Local::Call(Call::Spend { limit, node: self.node, seq, units, ask, cost })
    }

    /// Starts a report of `key`'s pending units, unless one is on its way: its `seq` and
    /// units.
    fn next_report(&mut self, key: &[u8], now: Nanos) -> Option<(u64, u64)> {
        let next = self.seq.wrapping_add(1).max(1);
        let h = self.held.get_mut(key)?;
        if h.report.is_some() || h.pending == 0 {
            return None;
        }
        self.seq = next;
        let units = std::mem::take(&mut h.pending);
        h.report = Some(Report { seq: next, units, first_sent: now });
        Some((next, units))
    }

    /// When `key`'s next background report should go, if the glue should schedule one now
    /// (none is scheduled, and units wait to be reported): after [`REPORT_EVERY`], or at
    /// once when the grant runs low (so the next one arrives before it is spent). Marks it
    /// scheduled.
    pub fn schedule(&mut self, key: &[u8], now: Nanos) -> Option<Nanos> {
        let h = self.held.get_mut(key)?;
        if h.scheduled || (h.pending == 0 && h.report.is_none()) {
            return None;
        }
        h.scheduled = true;
        let low = h.left.saturating_mul(2) < h.granted || h.until.saturating_sub(now) < 2 * REPORT_EVERY;
        Some(if low { 0 } else { REPORT_EVERY })
    }

    /// The background report of `key` (its retry, if the last one failed), or `None` when
    /// nothing waits (the schedule ends).
    pub fn report(&mut self, key: &[u8], now: Nanos) -> Option<Call> {
        let h = self.held.get_mut(key)?;
        let (limit, pending) = (h.limit, h.report.map(|r| (r.seq, r.units)));
        let Some((seq, units)) = pending.or_else(|| self.next_report(key, now)) else {
            if let Some(h) = self.held.get_mut(key) {
                h.scheduled = false;
            }
            return None;
        };
        Some(Call::Spend { limit, node: self.node, seq, units, ask: 0, cost: 0 })
    }

    /// Takes the object's answer (`Err`: the call failed) to `call` for `key`, sent at
    /// `sent`, received at `now`. For a request's call (`cost` > 0 or an ask), the check's
    /// answer; for a report, `None`.
    pub fn answered(
        &mut self,
        key: &[u8],
        call: &Call,
        reply: Result<&str, StoreError>,
        sent: Nanos,
        now: Nanos,
    ) -> Option<Result<Answer, StoreError>> {
        let Call::Spend { limit, seq, ask, cost, .. } = *call else { return None };
        let request = ask != 0;
        let spent = reply.ok().and_then(Spent::decode);
        let h = self.held.get_mut(key)?;
        let Some(s) = spent else {
            if h.report.is_some_and(|r| r.seq == seq && now.saturating_sub(r.first_sent) > RETRY_HORIZON) {
                // Given up: a store that has forgotten the seq could count a later retry twice.
                self.dropped = self.dropped.saturating_add(h.report.map_or(0, |r| r.units));
                h.report = None;
            }
            return request.then_some(Err(StoreError::Unavailable));
        };
        if h.report.is_some_and(|r| r.seq == seq) {
            h.report = None;
        }
        if let Some((grant, lease)) = s.grant {
            // The new grant replaces the old one and the asks' units at the object (the
            // report settles the isolate); what was spent while the report was on its way
            // is spent from the new one.
            let spent_since = h.pending;
            h.left = grant.saturating_sub(spent_since);
            h.granted = grant;
            h.until = lease_end(&limit, sent, lease);
            h.settled = h.settled.max(sent);
        }
        h.remaining = s.remaining;
        h.reset_after = s.reset_after;
        h.known_at = now.max(1);
        if !request {
            return None;
        }
        let quota = limit.quota();
        let decision = |allowed: bool, (remaining, reset_after): (u64, Nanos), retry_after: Option<Nanos>| Decision {
            allowed,
            limit: quota,
            remaining,
            reset_after,
            retry_after,
        };
        if cost == 0 {
            return Some(Ok(Answer::Grant(decision(true, h.view(now), None))));
        }
        if s.asked > 0 {
            // The ask took `cost` at the object; the rest is the isolate's to spend, unless
            // a report sent after the ask settled it meanwhile.
            if sent >= h.settled || s.grant.is_some() {
                h.left = h.left.saturating_add(s.asked.saturating_sub(cost));
            }
            h.until = h.until.max(lease_end(&limit, sent, s.ask_lease));
            let d = decision(true, h.view(now), None);
            return Some(Ok(Answer::Object(Taken { decision: d, now: s.now })));
        }
        if s.grant.is_some() && cost <= h.left && now < h.until {
            // The report's new grant covers the request.
            h.left -= cost;
            h.pending = h.pending.saturating_add(cost);
            return Some(Ok(Answer::Grant(decision(true, h.view(now), None))));
        }
        let retry = s.retry_after.map(|r| r.max(super::MS));
        Some(Ok(Answer::Object(Taken { decision: decision(false, (0, s.reset_after), retry), now: s.now })))
    }

    /// Gives back `cost` units a check spent from `key`'s grant (another rule rejected the
    /// request). Units already on their way in a report stay counted.
    pub fn refund(&mut self, key: &[u8], cost: u64) {
        if let Some(h) = self.held.get_mut(key) {
            let back = cost.min(h.pending);
            h.pending -= back;
            h.left = h.left.saturating_add(back);
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
    use crate::edge::object::Object;
    use ratewall_core::SECOND;

    const T: Nanos = 1_700_000_000 * SECOND;
    const KEY: &[u8] = b"k";

    /// One isolate and one counter object, calls answered at once; background reports run
    /// when due.
    struct Pair {
        object: Object,
        grants: Grants,
        limit: Limit,
        calls: u64,
        due: Option<Nanos>,
    }

    impl Pair {
        fn new(limit: Limit) -> Pair {
            let mut object = Object::default();
            object.load(None, Some(limit)).unwrap();
            Pair { object, grants: Grants::new(7, 100), limit, calls: 0, due: None }
        }

        fn call(&mut self, call: &Call, t: Nanos) -> String {
            self.calls += 1;
            self.object.handle(*call, t).unwrap().reply
        }

        /// The glue's background task: it wakes when due, sends one report, and sleeps
        /// [`REPORT_EVERY`]; it ends when nothing waits, and a later spend starts another.
        fn reports(&mut self, t: Nanos) {
            if self.due.is_some_and(|d| d <= t) {
                self.due = match self.grants.report(KEY, t) {
                    Some(call) => {
                        let reply = self.call(&call, t);
                        assert_eq!(self.grants.answered(KEY, &call, Ok(&reply), t, t), None);
                        Some(t + REPORT_EVERY)
                    }
                    None => None,
                };
            }
            if self.due.is_none() {
                self.due = self.grants.schedule(KEY, t).map(|d| t + d);
            }
        }

        fn request(&mut self, t: Nanos) -> Decision {
            self.reports(t);
            let d = match self.grants.check(KEY, self.limit, 1, t) {
                Local::Admitted(d) => d,
                Local::Call(call) => {
                    let reply = self.call(&call, t);
                    self.grants.answered(KEY, &call, Ok(&reply), t, t).unwrap().unwrap().decision()
                }
            };
            self.reports(t);
            d
        }
    }

    fn sliding(requests: u64) -> Limit {
        Limit::new(Algorithm::SlidingWindow, requests, 60 * SECOND, None).unwrap()
    }

    #[test]
    fn a_hot_key_is_decided_in_isolate_memory_and_never_past_its_limit() {
        let mut p = Pair::new(sliding(10_000));
        let mut admitted = 0;
        // 1,000 requests a second for 2 s: well under the limit.
        for i in 0..2000 {
            let d = p.request(T + i * SECOND / 1000);
            assert!(d.allowed, "request {i} denied: {d:?}");
            admitted += 1;
        }
        assert!(p.calls <= 40, "{} object calls for {admitted} admitted", p.calls);
        assert!(p.grants.local >= 1950, "{}", p.grants.local);
        // Then past the limit: exactly the limit is admitted in the window.
        let t = T + 3 * SECOND;
        for _ in 0..9000 {
            admitted += u64::from(p.request(t).allowed);
        }
        assert_eq!(admitted, 10_000, "no more than the limit, and no false denial");
    }

    #[test]
    fn a_denial_after_the_grant_is_spent_waits_for_the_window_not_a_lease() {
        let mut p = Pair::new(sliding(5));
        let states: Vec<Decision> = (0..6).map(|i| p.request(T + i * super::super::MS)).collect();
        let remaining: Vec<u64> = states.iter().take(5).map(|d| d.remaining).collect();
        assert_eq!(remaining, [4, 3, 2, 1, 0], "RateLimit remaining counts down per request");
        let denied = states[5];
        assert!(!denied.allowed);
        // What a per-request check at the object would answer.
        let mut exact = ratewall_core::sync::Counter::new(p.limit);
        for i in 0..5 {
            exact.take(p.limit, T + i * super::super::MS, 1);
        }
        let expected = exact.take(p.limit, T + 5 * super::super::MS, 1).retry_after;
        assert!(expected.is_some_and(|e| e > 30 * SECOND));
        assert_eq!(denied.retry_after, expected, "Retry-After is the window's, not a grant's lease");
    }

    #[test]
    fn a_failed_report_is_retried_with_its_seq_and_counted_once() {
        let mut p = Pair::new(sliding(100));
        for i in 0..10 {
            assert!(p.request(T + i).allowed);
        }
        let call = p.grants.report(KEY, T + 20).unwrap();
        let Call::Spend { seq, units, .. } = call else { panic!() };
        assert!(units > 0);
        // The object applied it but its answer was lost.
        let _ = p.call(&call, T + 20);
        assert_eq!(p.grants.answered(KEY, &call, Err(StoreError::Unavailable), T + 20, T + 30), None);
        let again = p.grants.report(KEY, T + 40).unwrap();
        assert_eq!(again, call, "the same seq and units");
        let reply = p.call(&again, T + 40);
        p.grants.answered(KEY, &again, Ok(&reply), T + 40, T + 40);
        let mut o = p.object;
        let view = o.handle(Call::Take { limit: p.limit, cost: 0 }, T + 50).unwrap().reply;
        let before_spent = Taken::decode(&view).unwrap().decision.remaining;
        assert_eq!(before_spent, 100 - units - (10 - units).min(10), "{seq}: counted once");
    }

    #[test]
    fn a_report_failing_past_the_retry_horizon_is_dropped_and_counted() {
        let mut p = Pair::new(sliding(100));
        for i in 0..3 {
            p.request(T + i);
        }
        let call = p.grants.report(KEY, T + 10).unwrap();
        let Call::Spend { units, .. } = call else { panic!() };
        let late = T + 10 + RETRY_HORIZON + 1;
        p.grants.answered(KEY, &call, Err(StoreError::Unavailable), T + 10, late);
        assert_eq!(p.grants.dropped, units);
        assert_ne!(p.grants.report(KEY, late), Some(call), "not retried again");
    }

    #[test]
    fn a_refund_goes_back_to_the_grant() {
        let mut p = Pair::new(sliding(100));
        p.request(T);
        let Local::Admitted(a) = p.grants.check(KEY, p.limit, 1, T + 1) else { panic!("from the grant") };
        p.grants.refund(KEY, 1);
        let Local::Admitted(b) = p.grants.check(KEY, p.limit, 1, T + 2) else { panic!() };
        assert_eq!(a.remaining, b.remaining, "the refunded unit was not counted");
    }

    #[test]
    fn grants_held_are_bounded_and_a_rules_change_spends_no_old_grant() {
        let mut g = Grants::new(1, 10);
        for i in 0..1000u32 {
            let _ = g.check(&i.to_le_bytes(), sliding(10), 1, T);
        }
        assert!(g.len() <= 10);
        let mut p = Pair::new(sliding(100));
        p.request(T);
        assert!(matches!(p.grants.check(KEY, p.limit, 1, T + 1), Local::Admitted(_)));
        assert!(matches!(p.grants.check(KEY, sliding(50), 1, T + 2), Local::Call(_)), "a new limit asks");
    }

    #[test]
    fn a_fixed_windows_grant_ends_with_its_window() {
        let l = Limit::new(Algorithm::FixedWindow, 1000, SECOND, None).unwrap();
        let mut p = Pair::new(l);
        let start = T + SECOND - 10 * super::super::MS;
        p.request(start);
        assert!(matches!(p.grants.check(KEY, l, 1, start + 1), Local::Admitted(_)));
        assert!(matches!(p.grants.check(KEY, l, 1, T + SECOND), Local::Call(_)), "the next window asks");
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
            },
            Spent {
                grant: None,
                asked: 0,
                ask_lease: 0,
                remaining: 0,
                reset_after: 0,
                retry_after: None,
                now: u64::MAX,
            },
        ] {
            assert_eq!(Spent::decode(&s.encode()), Some(s));
        }
        assert_eq!(Spent::decode("{}"), None);
    }
}
