//! A counter Durable Object's logic without the runtime: what each call answers, what it
//! must write before answering, and when its alarm writes back or forgets the counter. The
//! glue only reads and writes storage and sets alarms as an [`Object`] says.

use super::grants::Spent;
use super::{encode_applied, encode_heard, parse_stored, stored_value, Call, Taken};
use ratewall_core::algo::{Limit, Nanos};
use ratewall_core::sync::{Counter, Registry, MAX_REQUEST_SKEW};
use ratewall_core::SECOND;
use std::collections::{BTreeMap, HashMap};

/// A node that has not synced a counter for this long no longer takes a share of it.
pub const NODE_TTL: Nanos = 2 * SECOND;
/// A counter object writes its state to storage at most this long after it changed: what a
/// restart of the object can lose is the admissions of the last `FLUSH` (see README).
pub const FLUSH: Nanos = SECOND;

/// What one call to the object does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handled {
    /// The answer body.
    pub reply: String,
    /// A value to write to storage *before* answering (the units a filter node is told were
    /// counted must survive a restart).
    pub write_now: Option<String>,
    /// An alarm to set, at this time (the object's clock).
    pub alarm_at: Option<Nanos>,
}

/// What the object's alarm does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AlarmPlan {
    /// The counter is idle (equivalent to fresh): delete the stored state.
    Delete,
    /// Write the state back (when it changed), then wake again at `alarm_at`.
    Keep { write: Option<String>, alarm_at: Option<Nanos> },
}

/// One counter object's state (or, for the object named [`super::REGISTRY_OBJECT`], the
/// sync store's node registry).
#[derive(Debug, Default)]
pub struct Object {
    loaded: bool,
    counter: Option<Counter>,
    /// Changed since it was last written.
    dirty: bool,
    /// The alarm set, if any.
    alarm_at: Option<Nanos>,
    /// The node registry (soft state: after a restart it is rebuilt within one heartbeat
    /// period, as every node's next batch or heartbeat is heard), but for the asks it answered,
    /// which a restart must not forget: see [`Object::load_registry`].
    registry: Registry,
    /// The registry's stored ask marks, by node, once read: every ask of the node it answered
    /// was made (on the node's clock) no later than its mark.
    ask_marks: Option<BTreeMap<u64, Nanos>>,
    /// The mark to store before the ask just heard is answered ([`Object::mark_due`]).
    mark_due: Option<(u64, Nanos)>,
}

/// How far past an ask's time its node's stored ask mark is set when the ask is later than the
/// mark: at most one storage write per node per this much of its clock, and after a restart a
/// node's asks made up to this long after its latest one answered are refused (409: their
/// requests are decided on what the node holds).
pub const ASK_MARK_AHEAD: Nanos = 250 * super::MS;

/// The storage keys of the registry's ask marks: this and the node's id in hex.
pub const ASK_MARK_PREFIX: &str = "registry:ask:";

/// Most stale ask marks deleted along with one written.
const STALE_MARKS_DELETED: usize = 32;

/// A node's ask mark to store before its ask is answered, and stale ones to delete.
#[derive(Debug, PartialEq, Eq)]
pub struct MarkWrite {
    /// The node.
    pub node: u64,
    /// Its mark.
    pub mark: Nanos,
    /// Its storage key.
    pub key: String,
    /// Stale marks' keys.
    pub delete: Vec<String>,
}

/// The storage key of `node`'s ask mark.
fn mark_key(node: u64) -> String {
    let mut key = String::from(ASK_MARK_PREFIX);
    key.push_str(&ratewall_core::sync::hex(&node.to_be_bytes()));
    key
}

/// The node an ask mark's storage key names.
fn mark_node(key: &str) -> Option<u64> {
    let bytes = ratewall_core::sync::unhex(key.strip_prefix(ASK_MARK_PREFIX)?.as_bytes())?;
    Some(u64::from_be_bytes(bytes.try_into().ok()?))
}

impl Object {
    /// Whether the stored counter has been read.
    pub fn loaded(&self) -> bool {
        self.loaded
    }

    /// Takes what storage held (read once; `limit` is the caller's, `None` from an alarm,
    /// which reads the limit stored with the value). A value that cannot be read is an error
    /// and is *kept*: the object stays unloaded, every call fails (the rule's failure policy
    /// applies) and nothing is written over it.
    pub fn load(&mut self, stored: Option<&str>, limit: Option<Limit>) -> Result<(), String> {
        if self.loaded {
            return Ok(());
        }
        self.counter = match stored {
            None => None,
            Some(v) => Some(parse_stored(v, limit).map_err(|e| format!("stored counter unreadable: {e}"))?),
        };
        self.loaded = true;
        Ok(())
    }

    /// Handles a call at `t` (the object's clock). A counter call needs [`Object::load`]
    /// first; before it, it is refused with `None` (never decided on a fresh counter).
    pub fn handle(&mut self, call: Call, t: Nanos) -> Option<Handled> {
        let Some(limit) = call.limit() else {
            return match call {
                Call::Heard { node, seq, ask, sent } => {
                    let heard = self.registry.heard(t, node, (seq, ask, sent), NODE_TTL);
                    // An ask made after its node's stored mark: the mark moves past it before
                    // the ask is answered ([`Object::mark_due`]).
                    let mark = self.ask_marks.as_ref().map(|m| m.get(&node).copied().unwrap_or(0));
                    if ask && sent > 0 && heard.is_ok() && mark.is_some_and(|m| sent > m) {
                        self.mark_due = Some((node, sent.saturating_add(ASK_MARK_AHEAD)));
                    }
                    Some(Handled { reply: encode_heard(heard), write_now: None, alarm_at: None })
                }
                Call::Close { node, seq } => {
                    self.registry.close(node, seq);
                    Some(Handled { reply: String::from("{}"), write_now: None, alarm_at: None })
                }
                _ => None,
            };
        };
        if !self.loaded {
            return None;
        }
        let c = self.counter.get_or_insert_with(|| Counter::new(limit));
        let (reply, changed, sync) = match call {
            Call::Take { limit, cost } => {
                let decision = c.take(limit, t, cost);
                (Taken { decision, now: c.last_seen }.encode(), decision.allowed && cost > 0, false)
            }
            Call::Refund { limit, cost, at } => {
                c.refund(limit, t, at, cost);
                (String::from("{}"), true, false)
            }
            Call::Apply { limit, node, seq, units } => {
                let a = c.apply(limit, t, node, seq, units, NODE_TTL);
                (encode_applied(&a, c.out_for(t)), a.counted, true)
            }
            Call::Ask { limit, node, ask, units } => {
                let a = c.ask(limit, t, node, ask, units, NODE_TTL);
                (encode_applied(&a, c.out_for(t)), a.grant > 0, true)
            }
            Call::Spend { limit, node, seq, units, ask, cost, at, refund, refund_at, idle } => {
                // The isolate's own traffic, like a take: written back by the alarm, counted as
                // of when the isolate admitted it; a fixed window's units of a window that has
                // ended here count in none.
                let report = (seq > 0).then(|| c.report_since(limit, t, at, (node, seq, units), NODE_TTL));
                let counted = report.is_some_and(|a| a.counted);
                if counted {
                    // The isolate holds only the grant answered: it counts what it spends
                    // while the report is out against that grant, and spends nothing more of
                    // the old one or of earlier asks.
                    c.settle(node);
                    // Units of its earlier reports whose requests another rule rejected: given
                    // back once (a repeat of the report is not counted, nor is its refund).
                    if refund > 0 {
                        c.refund(limit, t, refund_at, refund);
                    }
                    // An isolate gone idle on the counter gives its grant back: what it held
                    // is free for the others, and it is given nothing more.
                    if idle {
                        c.release(node);
                    }
                }
                let grant = report.map(|a| if counted && idle { (0, 0) } else { (a.grant, a.lease) });
                let covered = grant.is_some_and(|(g, _)| g >= cost);
                let (asked, ask_lease) = if cost > 0 && !covered {
                    let a = c.ask_sized(limit, t, node, ask, cost, NODE_TTL);
                    (a.grant, a.lease)
                } else {
                    (0, 0)
                };
                let (view, _) = c.limit.decide(&c.state, c.last_seen, 0);
                let retry_after = if cost > 0 && !covered && asked == 0 { c.retry_after(t, cost) } else { None };
                let s = Spent {
                    grant,
                    asked,
                    ask_lease,
                    remaining: view.remaining,
                    reset_after: view.reset_after,
                    retry_after,
                    now: c.last_seen,
                    state: Some(c.state.clone()),
                    nodes: report.map_or(0, |a| a.nodes),
                    held: c.held_by_others(t, node),
                };
                (s.encode(), counted || asked > 0, false)
            }
            Call::Heard { .. } | Call::Close { .. } => return None,
        };
        self.dirty |= changed;
        // A sync answer acknowledges units: whatever is unwritten goes to storage first (a
        // repeat of a batch whose first write failed included). The glue calls
        // [`Object::flushed`] once the write is done.
        let write_now = if sync && self.dirty { self.counter.as_ref().map(stored_value) } else { None };
        let alarm_at = if self.dirty { self.schedule(t.saturating_add(FLUSH)) } else { None };
        Some(Handled { reply, write_now, alarm_at })
    }

    /// The alarm at `t`. Only a loaded counter is judged (an unloaded one is not "no
    /// counter": forgetting it would reset it); the caller loads first.
    pub fn alarm(&mut self, t: Nanos) -> AlarmPlan {
        self.alarm_at = None;
        if !self.loaded {
            return AlarmPlan::Keep { write: None, alarm_at: None };
        }
        let idle_at = self.counter.as_ref().map_or(0, Counter::idle_at);
        if idle_at <= t {
            // Idle: equivalent to fresh, so forgetting it gives nobody extra quota.
            self.counter = None;
            self.dirty = false;
            return AlarmPlan::Delete;
        }
        let write = if self.dirty { self.counter.as_ref().map(stored_value) } else { None };
        AlarmPlan::Keep { write, alarm_at: self.schedule(idle_at) }
    }

    /// Whether the registry's stored ask marks have been read ([`Object::load_registry`]).
    pub fn registry_loaded(&self) -> bool {
        self.ask_marks.is_some()
    }

    /// Takes the registry's stored ask marks ((storage key, value) pairs under
    /// [`ASK_MARK_PREFIX`]), read before its first call since the object started: the asks it
    /// answered before are not in its memory, and each node's were made no later than its
    /// mark, so its asks made by then are refused as replays. Per node, on its own clock: a
    /// node whose clock runs ahead holds back no other. A mark that cannot be read refuses
    /// every ask of its node that could still be a replay (made up to [`MAX_REQUEST_SKEW`]
    /// after `t`), and is written over by its next. Returns the keys to delete — marks too old
    /// to matter (a copy of an ask made by then is refused for its time) and keys that name no
    /// node — and whether any mark was unreadable.
    pub fn load_registry(&mut self, stored: &[(String, Option<String>)], t: Nanos) -> (Vec<String>, bool) {
        if self.ask_marks.is_some() {
            return (Vec::new(), false);
        }
        let mut marks = BTreeMap::new();
        let (mut delete, mut unreadable) = (Vec::new(), false);
        for (key, value) in stored {
            let Some(node) = mark_node(key) else {
                delete.push(key.clone());
                continue;
            };
            let mark = match value.as_deref().map(str::parse::<Nanos>) {
                Some(Ok(mark)) => mark,
                _ => {
                    unreadable = true;
                    t.saturating_add(MAX_REQUEST_SKEW)
                }
            };
            if mark.saturating_add(MAX_REQUEST_SKEW) < t {
                delete.push(key.clone());
                continue;
            }
            self.registry.refuse_asks_through(node, mark);
            marks.insert(node, mark);
        }
        self.ask_marks = Some(marks);
        (delete, unreadable)
    }

    /// The ask mark to store before the ask just handled is answered (none: its node's mark
    /// covers it, or it was refused), with stale marks to delete beside it.
    pub fn mark_due(&mut self, t: Nanos) -> Option<MarkWrite> {
        let (node, mark) = self.mark_due.take()?;
        let marks = self.ask_marks.as_mut()?;
        let stale: Vec<u64> = marks
            .iter()
            .filter(|(n, m)| **n != node && m.saturating_add(MAX_REQUEST_SKEW) < t)
            .map(|(n, _)| *n)
            .take(STALE_MARKS_DELETED)
            .collect();
        for n in &stale {
            marks.remove(n);
        }
        let delete = stale.iter().map(|n| mark_key(*n)).collect();
        Some(MarkWrite { node, mark, key: mark_key(node), delete })
    }

    /// `node`'s ask mark reached storage.
    pub fn mark_written(&mut self, node: u64, mark: Nanos) {
        if let Some(marks) = self.ask_marks.as_mut() {
            let m = marks.entry(node).or_insert(0);
            *m = (*m).max(mark);
        }
    }

    /// A write this object asked for (an alarm's, or a call's `write_now`) reached storage.
    pub fn flushed(&mut self) {
        self.dirty = false;
    }

    /// Whether a write is owed.
    pub fn dirty(&self) -> bool {
        self.dirty
    }

    /// An alarm at `at` unless an earlier one is set: the time to set it to, if it moves.
    fn schedule(&mut self, at: Nanos) -> Option<Nanos> {
        move_earlier(&mut self.alarm_at, at)
    }
}

/// Sets `alarm` to `at` unless it is set no later: the time to set it to, if it moves.
fn move_earlier(alarm: &mut Option<Nanos>, at: Nanos) -> Option<Nanos> {
    if alarm.is_some_and(|a| a <= at) {
        return None;
    }
    *alarm = Some(at);
    Some(at)
}

/// The earlier of two alarms, either of which may be unset.
pub fn earliest(a: Option<Nanos>, b: Option<Nanos>) -> Option<Nanos> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// What a shard's alarm does: each change to storage, then the next alarm.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardAlarm {
    /// Idle counters to delete (their keys).
    pub delete: Vec<Vec<u8>>,
    /// Counters to write back: (key, stored value).
    pub write: Vec<(Vec<u8>, String)>,
    /// The next alarm (the object's clock), if one is due.
    pub alarm_at: Option<Nanos>,
}

/// Counters a shard keeps in memory: past it, the least recently used of those written back
/// are dropped from memory (read again from storage when a call names them).
pub const SHARD_MEMORY: usize = 20_000;
/// Keys one storage call may name (Durable Objects' `get`, `put` and `delete` of many).
pub const STORAGE_KEYS: usize = 128;
/// Stored counters a sweep reads per alarm.
pub const SWEEP_PAGE: usize = STORAGE_KEYS;
/// How soon the next alarm comes while a sweep is under way.
pub const SWEEP_EVERY: Nanos = SECOND;

/// A counter object's counters: one per key its calls name (a shard of the deployment's, or
/// one alone), each an [`Object`], read from storage the first time a call names it. Memory
/// holds at most [`SHARD_MEMORY`] of them beside those owing a write; storage may hold more,
/// and a *sweep* (a page per alarm, [`Shard::swept`]) deletes the idle ones memory does not
/// hold — after a restart, and after counters were dropped from memory.
#[derive(Debug)]
pub struct Shard {
    counters: HashMap<Vec<u8>, Object>,
    /// The alarm set, if any.
    alarm_at: Option<Nanos>,
    /// Counters kept in memory (beyond those owing a write).
    memory: usize,
    /// A sweep under way: the storage key it goes on from (inclusive; empty: the first).
    sweep: Option<String>,
    /// Counters were dropped from memory since the sweep under way started.
    dropped: bool,
}

impl Default for Shard {
    fn default() -> Shard {
        // Storage may hold counters from before a restart: the first alarm starts a sweep.
        Shard {
            counters: HashMap::new(),
            alarm_at: None,
            memory: SHARD_MEMORY,
            sweep: Some(String::new()),
            dropped: false,
        }
    }
}

impl Shard {
    /// Whether `key`'s stored counter has been read.
    pub fn loaded(&self, key: &[u8]) -> bool {
        self.counters.get(key).is_some_and(Object::loaded)
    }

    /// Takes what storage held for `key` ([`Object::load`]).
    pub fn load(&mut self, key: &[u8], stored: Option<&str>, limit: Option<Limit>) -> Result<(), String> {
        let o = self.counters.entry(key.to_vec()).or_default();
        let loaded = o.load(stored, limit);
        if loaded.is_err() {
            self.counters.remove(key);
        }
        loaded
    }

    /// Handles a call on `key`'s counter at `t` ([`Object::handle`]); `None` before
    /// [`Shard::load`]. The alarm it asks for is the shard's, set only when it moves earlier.
    pub fn handle(&mut self, key: &[u8], call: Call, t: Nanos) -> Option<Handled> {
        let o = self.counters.get_mut(key)?;
        let mut handled = o.handle(call, t)?;
        // A counter owing a write needs an alarm; one set for the past has been lost (its set
        // failed, or its runs did), so it is set again.
        let owed = handled.alarm_at.or(o.dirty.then_some(t.saturating_add(FLUSH)));
        if self.alarm_at.is_some_and(|a| a < t) {
            self.alarm_at = None;
        }
        handled.alarm_at = owed.and_then(|at| self.schedule(at));
        Some(handled)
    }

    /// Setting the alarm failed: the next call or alarm sets one again.
    pub fn alarm_unset(&mut self) {
        self.alarm_at = None;
    }

    /// An alarm's writes or deletes failed at `t`: the counters owing a write are written at
    /// the next alarm (at `t + FLUSH`, returned to set), and the deleted ones are left to a
    /// sweep.
    pub fn alarm_failed(&mut self, t: Nanos) -> Nanos {
        self.sweep_again();
        let at = t.saturating_add(FLUSH);
        self.alarm_at = Some(at);
        at
    }

    /// Trims memory to its bound after a call ([`SHARD_MEMORY`]).
    pub fn trim(&mut self) {
        if self.counters.len() > self.memory {
            self.drop_clean();
        }
    }

    /// Keeps at most `memory` counters in memory (for tests; [`SHARD_MEMORY`] otherwise).
    pub fn with_memory(memory: usize) -> Shard {
        Shard { memory: memory.max(1), ..Shard::default() }
    }

    /// Drops from memory the least recently used counters that owe no write, down to three
    /// quarters of the memory bound: their stored values are as they are, and a sweep will
    /// delete the idle ones.
    fn drop_clean(&mut self) {
        let keep = self.memory - self.memory / 4;
        let last_used = |o: &Object| o.counter.as_ref().map_or(0, |c| c.last_seen);
        // The oldest first, a quarter of the clean counters' span of last use at a time
        // (no sort: a few passes over the map).
        while self.counters.len() > keep {
            let (mut oldest, mut newest) = (Nanos::MAX, 0);
            for o in self.counters.values().filter(|o| !o.dirty) {
                oldest = oldest.min(last_used(o));
                newest = newest.max(last_used(o));
            }
            if oldest > newest {
                break;
            }
            let cutoff = oldest + (newest - oldest) / 4;
            self.counters.retain(|_, o| o.dirty || last_used(o) > cutoff);
        }
        self.sweep_again();
    }

    /// Storage may hold counters memory does not: another sweep after the one under way (or
    /// one now).
    fn sweep_again(&mut self) {
        self.dropped = true;
        if self.sweep.is_none() {
            self.sweep = Some(String::new());
        }
    }

    /// The storage key a sweep's next page starts from (inclusive), while one is under way.
    pub fn sweep_from(&self) -> Option<&str> {
        self.sweep.as_deref()
    }

    /// A sweep's page at `t`: stored counters as (storage key, value), in key order, from
    /// [`Shard::sweep_from`]. Returns the storage keys to delete: the idle counters memory
    /// does not hold (one whose value cannot be read is kept). A page shorter than
    /// [`SWEEP_PAGE`] ends the sweep, unless counters were dropped from memory meanwhile.
    pub fn swept(&mut self, page: &[(String, String)], t: Nanos) -> Vec<String> {
        let Some(from) = self.sweep.clone() else { return Vec::new() };
        let mut delete = Vec::new();
        for (name, value) in page.iter().filter(|(name, _)| *name != from) {
            if name == "c" {
                // An object's one counter as versions before shards stored it: never read.
                delete.push(name.clone());
                continue;
            }
            let held =
                name.strip_prefix("c:").and_then(|h| super::unhex(h.as_bytes())).is_some_and(|k| self.loaded(&k));
            if !held && parse_stored(value, None).is_ok_and(|c| c.idle_at() <= t) {
                delete.push(name.clone());
            }
        }
        self.sweep = match page.last() {
            Some((last, _)) if page.len() >= SWEEP_PAGE => Some(last.clone()),
            _ if self.dropped => Some(String::new()),
            _ => None,
        };
        if self.sweep.as_deref() == Some("") {
            self.dropped = false;
        }
        delete
    }

    /// A write of `key`'s counter reached storage.
    pub fn flushed(&mut self, key: &[u8]) {
        if let Some(o) = self.counters.get_mut(key) {
            o.flushed();
        }
    }

    /// The alarm at `t`: every counter whose own alarm is due writes back or is forgotten.
    pub fn alarm(&mut self, t: Nanos) -> ShardAlarm {
        self.alarm_at = None;
        let mut plan = ShardAlarm::default();
        let mut next: Option<Nanos> = None;
        for (key, o) in &mut self.counters {
            // A counter owing a write is written at every alarm until a write succeeds.
            if !o.dirty && o.alarm_at.is_some_and(|at| at > t) {
                next = earliest(next, o.alarm_at);
                continue;
            }
            match o.alarm(t) {
                AlarmPlan::Delete => plan.delete.push(key.clone()),
                AlarmPlan::Keep { write, alarm_at } => {
                    if let Some(w) = write {
                        plan.write.push((key.clone(), w));
                    }
                    // Judged again at its next alarm (or, with none, at the next call).
                    let at = alarm_at.or(o.alarm_at);
                    next = earliest(next, at);
                }
            }
        }
        for key in &plan.delete {
            self.counters.remove(key);
        }
        if self.sweep.is_some() {
            next = earliest(next, Some(t.saturating_add(SWEEP_EVERY)));
        }
        plan.alarm_at = next.and_then(|at| self.schedule(at));
        plan
    }

    /// Counters in memory.
    pub fn len(&self) -> usize {
        self.counters.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.counters.is_empty()
    }

    /// An alarm at `at` unless an earlier one is set: the time to set it to, if it moves.
    fn schedule(&mut self, at: Nanos) -> Option<Nanos> {
        move_earlier(&mut self.alarm_at, at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edge::{decode_applied, decode_heard};
    use ratewall_core::algo::Algorithm;
    use ratewall_core::sync::SyncError;

    const T: Nanos = 1_700_000_000 * SECOND;

    fn limit() -> Limit {
        Limit::new(Algorithm::SlidingWindow, 3, 60 * SECOND, None).unwrap()
    }

    fn loaded() -> Object {
        let mut o = Object::default();
        o.load(None, Some(limit())).unwrap();
        o
    }

    fn take(o: &mut Object, t: Nanos) -> (bool, Handled) {
        let h = o.handle(Call::Take { limit: limit(), cost: 1 }, t).unwrap();
        (Taken::decode(&h.reply).unwrap().decision.allowed, h)
    }

    #[test]
    fn takes_are_written_back_by_an_alarm_within_the_flush_bound() {
        let mut o = loaded();
        let (allowed, h) = take(&mut o, T);
        assert!(allowed);
        assert_eq!(h.write_now, None, "the Worker's own traffic is not written per request");
        assert_eq!(h.alarm_at, Some(T + FLUSH));
        let (_, h) = take(&mut o, T + 10);
        assert_eq!(h.alarm_at, None, "the alarm set covers it");
        let AlarmPlan::Keep { write: Some(w), alarm_at: Some(next) } = o.alarm(T + FLUSH) else { panic!() };
        o.flushed();
        assert!(next > T + FLUSH, "wakes again when the counter goes idle");
        assert_eq!(parse_stored(&w, None).unwrap().encode(), o.counter.as_ref().unwrap().encode());
        let AlarmPlan::Keep { write: None, .. } = o.alarm(next - 1) else { panic!("nothing changed") };
    }

    #[test]
    fn an_alarm_forgets_an_idle_counter_and_keeps_a_live_one() {
        let mut o = loaded();
        let _ = take(&mut o, T);
        assert!(matches!(o.alarm(T + FLUSH), AlarmPlan::Keep { .. }));
        o.flushed();
        assert_eq!(o.alarm(T + 200 * SECOND), AlarmPlan::Delete);
        let (allowed, _) = take(&mut o, T + 200 * SECOND);
        assert!(allowed, "fresh after idle");
    }

    #[test]
    fn a_write_the_alarm_could_not_make_is_owed_until_it_is_made() {
        let mut o = loaded();
        let _ = take(&mut o, T);
        let AlarmPlan::Keep { write: Some(_), .. } = o.alarm(T + FLUSH) else { panic!() };
        // The put failed: `flushed` is not called, and the next alarm writes again.
        assert!(o.dirty());
        let AlarmPlan::Keep { write: Some(_), .. } = o.alarm(T + 2 * FLUSH) else { panic!() };
    }

    #[test]
    fn an_unloaded_object_decides_nothing_and_its_alarm_deletes_nothing() {
        let mut o = Object::default();
        assert_eq!(o.handle(Call::Take { limit: limit(), cost: 1 }, T), None);
        assert_eq!(o.alarm(T), AlarmPlan::Keep { write: None, alarm_at: None });
    }

    #[test]
    fn an_unreadable_stored_value_is_an_error_and_stays_unloaded() {
        let mut o = Object::default();
        let err = o.load(Some("not hex/[]"), Some(limit())).unwrap_err();
        assert!(err.contains("unreadable"), "{err}");
        assert!(!o.loaded());
        assert_eq!(o.handle(Call::Take { limit: limit(), cost: 1 }, T), None, "every call fails");
        assert_eq!(o.alarm(T), AlarmPlan::Keep { write: None, alarm_at: None }, "and nothing overwrites it");
    }

    #[test]
    fn a_stored_counter_is_read_back_after_a_restart() {
        let mut o = loaded();
        for _ in 0..3 {
            let _ = take(&mut o, T);
        }
        let AlarmPlan::Keep { write: Some(w), .. } = o.alarm(T + FLUSH) else { panic!() };
        let mut restarted = Object::default();
        // An alarm may come first after a restart: it reads the limit stored with the value.
        restarted.load(Some(&w), None).unwrap();
        assert!(matches!(restarted.alarm(T + FLUSH), AlarmPlan::Keep { .. }), "not idle, not deleted");
        let (allowed, _) = take(&mut restarted, T + FLUSH);
        assert!(!allowed, "the three takes survived");
    }

    #[test]
    fn a_counted_delta_or_granted_ask_is_written_before_the_answer() {
        let mut o = loaded();
        let h = o.handle(Call::Apply { limit: limit(), node: 7, seq: 1, units: 2 }, T).unwrap();
        let a = decode_applied(&h.reply).unwrap();
        assert!(a.counted);
        assert!(h.write_now.is_some());
        o.flushed();
        assert!(!o.dirty(), "written now: the alarm owes nothing");
        let again = o.handle(Call::Apply { limit: limit(), node: 7, seq: 1, units: 2 }, T + 1).unwrap();
        assert!(!decode_applied(&again.reply).unwrap().counted, "a repeat counts nothing");
        assert_eq!(again.write_now, None);
        let ask = o.handle(Call::Ask { limit: limit(), node: 8, ask: 1, units: 1 }, T + 2).unwrap();
        assert_eq!(decode_applied(&ask.reply).unwrap().grant > 0, ask.write_now.is_some());
    }

    #[test]
    fn a_repeated_batch_whose_first_write_failed_is_written_before_its_answer() {
        let mut o = loaded();
        let first = o.handle(Call::Apply { limit: limit(), node: 7, seq: 1, units: 2 }, T).unwrap();
        assert!(first.write_now.is_some());
        // The put failed (no `flushed`), so the node got an error and retries.
        let again = o.handle(Call::Apply { limit: limit(), node: 7, seq: 1, units: 2 }, T + 1).unwrap();
        assert!(!decode_applied(&again.reply).unwrap().counted, "counted once");
        let w = again.write_now.expect("the units it acknowledges now are written first");
        assert_eq!(parse_stored(&w, None).unwrap().encode(), o.counter.as_ref().unwrap().encode());
    }

    #[test]
    fn a_refund_gives_back_and_is_written_by_the_alarm() {
        let mut o = loaded();
        let (_, first) = take(&mut o, T);
        let at = Taken::decode(&first.reply).unwrap().now;
        for _ in 0..2 {
            let _ = take(&mut o, T);
        }
        assert!(!take(&mut o, T).0);
        let h = o.handle(Call::Refund { limit: limit(), cost: 1, at }, T + 5).unwrap();
        assert_eq!(h.reply, "{}");
        assert!(o.dirty());
        assert!(take(&mut o, T + 6).0, "the refunded unit is free again");
    }

    /// An isolate's report may give back units of its earlier reports (another rule
    /// rejected their requests): once, and not again when the report is sent again.
    #[test]
    fn a_report_gives_back_the_units_it_names_once() {
        let mut o = loaded();
        let spend = |seq, units, refund| Call::Spend {
            limit: limit(),
            node: 7,
            seq,
            units,
            ask: 0,
            cost: 0,
            at: T,
            refund,
            refund_at: T,
            idle: false,
        };
        let remaining = |h: Handled| Spent::decode(&h.reply).unwrap().remaining;
        assert_eq!(remaining(o.handle(spend(1, 2, 0), T).unwrap()), 1);
        assert_eq!(remaining(o.handle(spend(2, 0, 1), T + 1).unwrap()), 2, "one unit back");
        assert_eq!(remaining(o.handle(spend(2, 0, 1), T + 2).unwrap()), 2, "a repeat gives nothing");
        assert!(take(&mut o, T + 3).0 && take(&mut o, T + 3).0 && !take(&mut o, T + 3).0);
    }

    #[test]
    fn a_shard_keeps_each_keys_counter_apart_and_writes_and_forgets_each_on_its_own() {
        let mut shard = Shard::default();
        assert_eq!(shard.sweep_from(), Some(""), "a new object sweeps what storage may hold");
        assert!(shard.swept(&[], T).is_empty());
        assert_eq!(shard.sweep_from(), None, "storage held nothing");
        let take = Call::Take { limit: limit(), cost: 1 };
        assert_eq!(shard.handle(b"a", take, T), None, "a counter not read from storage decides nothing");
        shard.load(b"a", None, Some(limit())).unwrap();
        let allowed = |h: Option<Handled>| Taken::decode(&h.unwrap().reply).unwrap().decision.allowed;
        for _ in 0..3 {
            assert!(allowed(shard.handle(b"a", take, T)));
        }
        assert!(!allowed(shard.handle(b"a", take, T)), "a's limit");
        // a is written back within FLUSH of its change, at the shard's alarm.
        let plan = shard.alarm(T + FLUSH);
        assert_eq!(plan.write.iter().map(|(k, _)| k.as_slice()).collect::<Vec<_>>(), [b"a"]);
        shard.flushed(b"a");
        let a_idle = parse_stored(&plan.write[0].1, None).unwrap().idle_at();
        assert_eq!(plan.alarm_at, Some(a_idle), "woken when a goes idle");
        // b, a window later, counts apart, and moves the shard's alarm earlier for its write.
        let b_at = T + 70 * SECOND;
        shard.load(b"b", None, Some(limit())).unwrap();
        let first = shard.handle(b"b", take, b_at).unwrap();
        assert!(Taken::decode(&first.reply).unwrap().decision.allowed, "b counts apart");
        assert_eq!(first.alarm_at, Some(b_at + FLUSH));
        let plan = shard.alarm(b_at + FLUSH);
        assert_eq!(plan.write.iter().map(|(k, _)| k.as_slice()).collect::<Vec<_>>(), [b"b"]);
        assert!(plan.delete.is_empty());
        shard.flushed(b"b");
        assert_eq!(plan.alarm_at, Some(a_idle));
        // a, idle first, is forgotten while b is kept.
        let plan = shard.alarm(a_idle);
        assert_eq!(plan.delete, vec![b"a".to_vec()]);
        assert!(plan.write.is_empty());
        assert!(plan.alarm_at.is_some_and(|at| at > a_idle), "woken again for b");
        assert!(!shard.loaded(b"a") && shard.loaded(b"b"));
        assert_eq!(shard.len(), 1);
    }

    #[test]
    fn a_shards_memory_is_bounded_and_a_sweep_deletes_the_idle_counters_it_dropped() {
        let mut shard = Shard::with_memory(8);
        assert!(shard.swept(&[], T).is_empty());
        let take = Call::Take { limit: limit(), cost: 1 };
        let mut stored: Vec<(String, String)> = Vec::new();
        for i in 0..40u8 {
            let key = [b'k', i];
            shard.load(&key, None, Some(limit())).unwrap();
            assert!(shard.handle(&key, take, T + u64::from(i)).is_some());
            shard.trim();
            // Each is written back at once (as an alarm would), so it can be dropped.
            let value = stored_value(shard.counters[key.as_slice()].counter.as_ref().unwrap());
            shard.flushed(&key);
            stored.push((super::super::storage_key(&key), value));
            assert!(shard.len() <= 8, "{} counters in memory", shard.len());
        }
        // The most recent stay; the oldest were dropped, and a sweep is under way.
        assert!(shard.loaded(&[b'k', 39]) && !shard.loaded(&[b'k', 0]));
        assert_eq!(shard.sweep_from(), Some(""));
        let next = shard.alarm(T + FLUSH).alarm_at;
        assert!(next.is_some_and(|at| at <= T + FLUSH + SWEEP_EVERY), "an alarm comes while it sweeps: {next:?}");
        // Not idle yet: nothing is deleted, and the sweep goes on a page at a time.
        stored.sort();
        let page: Vec<(String, String)> = stored.iter().take(SWEEP_PAGE).cloned().collect();
        assert!(shard.swept(&page, T + 2 * SECOND).is_empty(), "live counters are kept");
        assert_eq!(shard.sweep_from(), Some(""), "counters were dropped during the pass: another");
        // Idle: every stored counter memory does not hold is deleted; those it holds are its
        // alarm's to judge.
        let idle = T + 200 * SECOND;
        let deleted = shard.swept(&page, idle);
        assert_eq!(deleted.len(), 40 - shard.len(), "{deleted:?}");
        assert!(deleted.iter().all(|name| !shard.loaded(&super::super::unhex(&name.as_bytes()[2..]).unwrap())));
        assert_eq!(shard.sweep_from(), None, "the pass ended with nothing dropped meanwhile");
        // An unreadable value is never deleted.
        shard.sweep = Some(String::new());
        assert!(shard.swept(&[("c:00".to_owned(), "not hex/[]".to_owned())], idle).is_empty());
    }

    #[test]
    fn a_shards_write_that_failed_is_made_at_the_next_alarm_and_a_lost_alarm_is_set_again() {
        let mut shard = Shard::default();
        assert!(shard.swept(&[], T).is_empty());
        let take = Call::Take { limit: limit(), cost: 1 };
        shard.load(b"a", None, Some(limit())).unwrap();
        assert_eq!(shard.handle(b"a", take, T).unwrap().alarm_at, Some(T + FLUSH));
        let plan = shard.alarm(T + FLUSH);
        assert_eq!(plan.write.len(), 1);
        // The write failed: the next alarm, a second later, writes it again.
        assert_eq!(shard.alarm_failed(T + FLUSH), T + 2 * FLUSH);
        let plan = shard.alarm(T + 2 * FLUSH);
        assert_eq!(plan.write.len(), 1, "still owed");
        shard.flushed(b"a");
        assert!(shard.alarm(T + 3 * FLUSH).write.is_empty());
        // An alarm that never ran (its set failed): the next change sets one again.
        let mut shard = Shard::default();
        assert!(shard.swept(&[], T).is_empty());
        shard.load(b"b", None, Some(limit())).unwrap();
        assert_eq!(shard.handle(b"b", take, T).unwrap().alarm_at, Some(T + FLUSH));
        assert_eq!(shard.handle(b"b", take, T + 10 * SECOND).unwrap().alarm_at, Some(T + 10 * SECOND + FLUSH));
    }

    #[test]
    fn a_shard_refuses_only_the_counter_whose_stored_value_is_unreadable() {
        let mut shard = Shard::default();
        assert!(shard.load(b"bad", Some("not hex/[]"), Some(limit())).is_err());
        shard.load(b"good", None, Some(limit())).unwrap();
        let take = Call::Take { limit: limit(), cost: 1 };
        assert_eq!(shard.handle(b"bad", take, T), None);
        assert!(shard.handle(b"good", take, T).is_some());
        assert!(!shard.loaded(b"bad"), "read again at its next call, never written over");
    }

    #[test]
    fn the_registry_keeps_asks_refused_across_a_restart_by_its_stored_marks() {
        let ask = |node: u64, number: u64, sent: Nanos| Call::Heard { node, seq: (1 << 40) | number, ask: true, sent };
        let refused = |o: &mut Object, (node, number, sent): (u64, u64, Nanos), t: Nanos| {
            let reply = o.handle(ask(node, number, sent), t).unwrap().reply;
            decode_heard(&reply) == Some(Err(SyncError::Repeated { ask: (1 << 40) | number }))
        };
        let mut o = Object::default();
        assert_eq!(o.load_registry(&[], T), (vec![], false));
        // An ask past its node's mark (none yet) moves it, before the ask is answered.
        o.handle(ask(1, 1, T), T).unwrap();
        let w = o.mark_due(T).unwrap();
        assert_eq!((w.node, w.mark, w.key.as_str()), (1, T + ASK_MARK_AHEAD, "registry:ask:0000000000000001"));
        o.mark_written(w.node, w.mark);
        // One within it writes nothing; one past it moves it again; a refused one (a replay)
        // moves nothing.
        o.handle(ask(1, 2, T + ASK_MARK_AHEAD / 2), T).unwrap();
        assert_eq!(o.mark_due(T), None);
        o.handle(ask(1, 3, T + ASK_MARK_AHEAD + 1), T).unwrap();
        let w = o.mark_due(T).unwrap();
        o.mark_written(w.node, w.mark);
        assert!(refused(&mut o, (1, 1, T + SECOND), T + SECOND));
        assert_eq!(o.mark_due(T + SECOND), None);
        // Node 2's clock runs 20 s ahead.
        o.handle(ask(2, 1, T + 20 * SECOND), T).unwrap();
        let w2 = o.mark_due(T).unwrap();
        o.mark_written(w2.node, w2.mark);
        // Restarted: each node's stored mark refuses its asks answered before; a later one of
        // node 1 is answered, whatever node 2's clock says.
        let stored = vec![(w.key.clone(), Some(w.mark.to_string())), (w2.key.clone(), Some(w2.mark.to_string()))];
        let mut restarted = Object::default();
        assert_eq!(restarted.load_registry(&stored, T + 2 * SECOND), (vec![], false));
        for (n, sent) in [(1, T), (2, T + ASK_MARK_AHEAD / 2), (3, T + ASK_MARK_AHEAD + 1)] {
            assert!(refused(&mut restarted, (1, n, sent), T + 2 * SECOND), "ask {n}");
        }
        assert!(refused(&mut restarted, (2, 1, T + 20 * SECOND), T + 2 * SECOND));
        assert!(!refused(&mut restarted, (1, 4, T + 2 * SECOND), T + 2 * SECOND));
        assert!(!refused(&mut restarted, (2, 2, T + 22 * SECOND), T + 2 * SECOND));
        // Marks too old to matter, and keys naming no node, are deleted when read; an
        // unreadable mark refuses whatever of its node could still be a replay.
        let stored = vec![
            (w.key.clone(), Some(w.mark.to_string())),
            ("registry:ask:zz".to_owned(), Some("1".to_owned())),
            (mark_key(3), None),
        ];
        let mut later = Object::default();
        let at = T + MAX_REQUEST_SKEW + SECOND;
        let (stale, unreadable) = later.load_registry(&stored, at);
        assert_eq!((stale, unreadable), (vec![w.key.clone(), "registry:ask:zz".to_owned()], true));
        assert!(refused(&mut later, (3, 1, at + MAX_REQUEST_SKEW), at));
        assert!(!refused(&mut later, (3, 2, at + MAX_REQUEST_SKEW + 1), at));
        assert!(later.mark_due(at).is_some(), "and is written over");
        // A mark gone stale is deleted beside the next one written.
        let mut o = Object::default();
        o.load_registry(&stored[..1], T);
        o.handle(ask(5, 1, at), at).unwrap();
        assert_eq!(o.mark_due(at).unwrap().delete, vec![w.key.clone()]);
    }

    #[test]
    fn the_registry_object_answers_heard_calls_without_loading() {
        let mut o = Object::default();
        let h = o.handle(Call::Heard { node: 1, seq: 5, ask: false, sent: T }, T).unwrap();
        assert_eq!(decode_heard(&h.reply), Some(Ok(1)));
        let h = o.handle(Call::Heard { node: 2, seq: 1, ask: false, sent: T }, T).unwrap();
        assert_eq!(decode_heard(&h.reply), Some(Ok(2)));
        let h = o.handle(Call::Heard { node: 1, seq: 4, ask: false, sent: T }, T).unwrap();
        assert_eq!(decode_heard(&h.reply), Some(Err(SyncError::Stale { last: 5 })), "an older batch is stale");
        // An ask is answered once: a copy of it is a replay.
        let ask = Call::Heard { node: 1, seq: (1 << 40) | 3, ask: true, sent: T };
        assert_eq!(decode_heard(&o.handle(ask, T).unwrap().reply), Some(Ok(2)));
        let again = decode_heard(&o.handle(ask, T + SECOND).unwrap().reply);
        assert_eq!(again, Some(Err(SyncError::Repeated { ask: (1 << 40) | 3 })));
    }
}
