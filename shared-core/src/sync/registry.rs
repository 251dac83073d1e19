//! The nodes a store has heard from.

use super::counter::SEQ_MEMORY;
use super::wire::SyncError;
use crate::algo::Nanos;
use alloc::collections::BTreeMap;
use alloc::vec::Vec;

/// The nodes a store has heard from: the `nodes` it answers, and each node's latest batch
/// `seq`, by which it refuses an older one. Every store keeps one (the reference store in
/// memory, the Worker in a Durable Object of its own); nodes not heard from for
/// [`SEQ_MEMORY`] are forgotten, and at most [`MAX_NODES`] are kept.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Registry {
    /// node → (latest batch seq, last heard from)
    nodes: BTreeMap<u64, (u64, Nanos)>,
}

/// Most nodes a [`Registry`] keeps (the least recently heard from go first).
pub const MAX_NODES: usize = 10_000;
/// Most nodes a store names to a counter as heard from lately
/// ([`Counter::heard_lately`](super::Counter::heard_lately)); beyond, a counter tells the
/// others' silence by its own traffic alone.
pub const MAX_HEARD_LATELY: usize = 1_000;

impl Registry {
    /// Notes that `node` sent a batch (`ask` false: its `seq` must not be older than its
    /// latest) or an ask at `now`; returns the nodes heard from within `node_ttl`, this one
    /// included, or [`SyncError::Stale`] for an older batch (which then counts for nothing).
    pub fn heard(&mut self, now: Nanos, node: u64, seq: u64, ask: bool, node_ttl: Nanos) -> Result<u32, SyncError> {
        let entry = self.nodes.get(&node).copied();
        if let (Some((last, _)), false) = (entry, ask) {
            if seq < last {
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
        self.nodes.insert(node, (seq, now));
        self.nodes.retain(|_, (_, seen)| now.saturating_sub(*seen) <= SEQ_MEMORY);
        let active = self.nodes.values().filter(|(_, seen)| now.saturating_sub(*seen) <= node_ttl).count();
        Ok(u32::try_from(active).unwrap_or(u32::MAX))
    }

    /// The nodes heard from within `within` of `now` (at most [`MAX_HEARD_LATELY`], the latest
    /// first).
    pub fn heard_within(&self, now: Nanos, within: Nanos) -> Vec<u64> {
        let mut recent: Vec<(Nanos, u64)> = self
            .nodes
            .iter()
            .filter(|(_, (_, seen))| now.saturating_sub(*seen) < within)
            .map(|(node, (_, seen))| (*seen, *node))
            .collect();
        recent.sort_unstable_by(|a, b| b.cmp(a));
        recent.into_iter().take(MAX_HEARD_LATELY).map(|(_, node)| node).collect()
    }
}
