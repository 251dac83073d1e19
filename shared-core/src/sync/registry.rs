//! The nodes a store has heard from.

use super::counter::SEQ_MEMORY;
use super::wire::{SyncError, MAX_REQUEST_SKEW};
use crate::algo::Nanos;
use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;

/// The nodes a store has heard from: the `nodes` it answers, and each node's latest batch
/// `seq`, by which it refuses an older one. Every store keeps one (the reference store in
/// memory, the Worker in a Durable Object of its own); nodes not heard from for
/// [`SEQ_MEMORY`] are forgotten, and at most [`MAX_NODES`] are kept.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Registry {
    /// node → (latest batch seq, last heard from)
    nodes: BTreeMap<u64, (u64, Nanos)>,
    /// Nodes whose latest batch was answered with counters it could not apply
    /// ([`Registry::close`]): a repeat of it is refused as an older batch.
    closed: BTreeSet<u64>,
    /// The asks answered that could still be replayed (made within [`MAX_REQUEST_SKEW`]):
    /// (node, ask number).
    asks: BTreeSet<(u64, u64)>,
    /// The same, by the time each was made (its node's clock): the earliest go first, when
    /// too old to be replayed or for room.
    ask_order: BTreeSet<(Nanos, u64, u64)>,
    /// Per node, asks made at or before this time are refused: past [`MAX_ASKS_REMEMBERED`]
    /// the earliest asks are forgotten, and their nodes' floors rise to their times; and a
    /// store that lost its memory of the asks it answered sets them
    /// ([`Registry::refuse_asks_through`]). Per node, as the times are on each node's clock:
    /// one floor for the fleet, raised by a node whose clock ran 20 s ahead, refused every
    /// other node's asks for 20 s. Each kept until asks made by then are too old.
    node_floors: BTreeMap<u64, Nanos>,
    /// When `node_floors` were last pruned.
    floors_pruned: Nanos,
}

/// Most asks a [`Registry`] remembers (some 40 bytes each); past it the earliest go, and asks
/// made no later than them are refused. A fleet of 100 nodes asking 8 times a second each
/// makes 20,000 within [`MAX_REQUEST_SKEW`].
pub const MAX_ASKS_REMEMBERED: usize = 100_000;

/// Most nodes a [`Registry`] keeps (the least recently heard from go first).
pub const MAX_NODES: usize = 10_000;
/// Most nodes a store names to a counter as heard from lately
/// ([`Counter::heard_lately`](super::Counter::heard_lately)); beyond, a counter tells the
/// others' silence by its own traffic alone.
pub const MAX_HEARD_LATELY: usize = 1_000;

impl Registry {
    /// Notes that `node` sent a batch (`ask` false: its `seq` must not be older than its
    /// latest) or an ask (`seq` its number, made at `sent`, the node's clock) at `now`;
    /// returns the nodes heard from within `node_ttl`, this one included, or why the request
    /// counts for nothing: [`SyncError::Stale`] for an older batch, [`SyncError::Repeated`]
    /// for an ask already answered. A store refuses requests made further than
    /// [`MAX_REQUEST_SKEW`] from its clock, so an ask is remembered for as long as a copy of
    /// it would be accepted. (`sent` 0: a caller that cannot say; the ask is not checked.)
    pub fn heard(
        &mut self,
        now: Nanos,
        node: u64,
        (seq, ask, sent): (u64, bool, Nanos),
        node_ttl: Nanos,
    ) -> Result<u32, SyncError> {
        if ask && sent > 0 {
            self.ask_once(now, node, seq, sent)?;
        }
        let entry = self.nodes.get(&node).copied();
        if let (Some((last, _)), false) = (entry, ask) {
            if seq < last || (seq == last && self.closed.contains(&node)) {
                return Err(SyncError::Stale { last });
            }
        }
        let last = entry.map_or(0, |(l, _)| l);
        let seq = if ask { last } else { seq.max(last) };
        if entry.is_none() && self.nodes.len() >= MAX_NODES {
            if let Some(oldest) = self.nodes.iter().min_by_key(|(_, (_, seen))| *seen).map(|(n, _)| *n) {
                self.nodes.remove(&oldest);
            }
        }
        if seq > last {
            self.closed.remove(&node);
        }
        self.nodes.insert(node, (seq, now));
        self.nodes.retain(|_, (_, seen)| now.saturating_sub(*seen) <= SEQ_MEMORY);
        let nodes = &self.nodes;
        self.closed.retain(|n| nodes.contains_key(n));
        let active = self.nodes.values().filter(|(_, seen)| now.saturating_sub(*seen) <= node_ttl).count();
        Ok(u32::try_from(active).unwrap_or(u32::MAX))
    }

    /// Notes ask `number` of `node`, made at `sent`: [`SyncError::Repeated`] when it was
    /// answered already (or made no later than asks forgotten for room).
    fn ask_once(&mut self, now: Nanos, node: u64, number: u64, sent: Nanos) -> Result<(), SyncError> {
        // Asks that could no longer be replayed (made more than the skew before now).
        while let Some(&(at, n, a)) = self.ask_order.first() {
            if at.saturating_add(MAX_REQUEST_SKEW) >= now {
                break;
            }
            self.ask_order.pop_first();
            self.asks.remove(&(n, a));
        }
        // Pruned at most once a second (every ask would walk them all).
        if !self.node_floors.is_empty() && now.saturating_sub(self.floors_pruned) >= crate::algo::SECOND {
            self.node_floors.retain(|_, floor| floor.saturating_add(MAX_REQUEST_SKEW) >= now);
            self.floors_pruned = now;
        }
        let floor = self.node_floors.get(&node).copied().unwrap_or(0);
        if sent <= floor || !self.asks.insert((node, number)) {
            return Err(SyncError::Repeated { ask: number });
        }
        self.ask_order.insert((sent, node, number));
        while self.ask_order.len() > MAX_ASKS_REMEMBERED {
            if let Some((at, n, a)) = self.ask_order.pop_first() {
                self.asks.remove(&(n, a));
                self.refuse_asks_through(n, at);
            }
        }
        Ok(())
    }

    /// Refuses every ask of `node` made at or before `t` (its clock; [`SyncError::Repeated`]):
    /// for a store that lost its memory of the asks it answered (a Durable Object restarted or
    /// evicted) and knows the node's were all made no later than `t`.
    pub fn refuse_asks_through(&mut self, node: u64, t: Nanos) {
        let floor = self.node_floors.entry(node).or_insert(0);
        *floor = (*floor).max(t);
    }

    /// Closes batch `seq` of `node`, answered with counters it could not apply: the node sends
    /// their units again under a later `seq`, so a repeat of this one (a copy on its way, or a
    /// replay) is refused as an older batch — applied again once the counter could be read, it
    /// would count them twice. Nothing when the node's latest batch is another.
    pub fn close(&mut self, node: u64, seq: u64) {
        if self.nodes.get(&node).is_some_and(|(last, _)| *last == seq) {
            self.closed.insert(node);
        }
    }

    /// The nodes heard from within `within` of `now` (the latest [`MAX_HEARD_LATELY`]), in id
    /// order ([`Counter::heard_lately`](super::Counter::heard_lately)).
    pub fn heard_within(&self, now: Nanos, within: Nanos) -> Vec<u64> {
        let mut recent: Vec<(Nanos, u64)> = self
            .nodes
            .iter()
            .filter(|(_, (_, seen))| now.saturating_sub(*seen) < within)
            .map(|(node, (_, seen))| (*seen, *node))
            .collect();
        recent.sort_unstable_by(|a, b| b.cmp(a));
        let mut latest: Vec<u64> = recent.into_iter().take(MAX_HEARD_LATELY).map(|(_, node)| node).collect();
        latest.sort_unstable();
        latest
    }
}
