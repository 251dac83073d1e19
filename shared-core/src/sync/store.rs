//! The reference store.

use super::counter::Counter;
use super::out::Out;
use super::registry::Registry;
use super::wire::{Grant, SyncError, SyncRequest, SyncResponse};
use crate::algo::Nanos;
use alloc::collections::BTreeMap;
use alloc::vec::Vec;

/// A reference global store: the protocol's semantics in memory, for tests and the
/// simulation. The production stores — the Cloudflare Worker's Durable Objects and
/// ratewall-store on Redis — answer alike (the conformance tests hold them to it).
#[derive(Clone, Debug)]
pub struct Store {
    counters: BTreeMap<Vec<u8>, Counter>,
    registry: Registry,
    max_counters: usize,
    /// A node not heard from for this long no longer counts as active.
    node_ttl: Nanos,
    /// Counters found out of quota, named to every node.
    out: Out,
}

impl Store {
    /// A store tracking at most `max_counters` counters (least recently seen are dropped).
    pub fn new(max_counters: usize, node_ttl: Nanos) -> Store {
        Store {
            counters: BTreeMap::new(),
            registry: Registry::default(),
            max_counters: max_counters.max(1),
            node_ttl,
            out: Out::default(),
        }
    }

    /// Counters currently held.
    pub fn len(&self) -> usize {
        self.counters.len()
    }

    /// Whether no counter is held.
    pub fn is_empty(&self) -> bool {
        self.counters.is_empty()
    }

    /// The global state of a counter at `now` (as a peek decision).
    pub fn peek(&self, key: &[u8], now: Nanos) -> Option<crate::algo::Decision> {
        self.counters.get(key).map(|c| c.limit.decide(&c.state, now, 0).0)
    }

    /// Verifies and applies an encoded, signed batch or ask; returns the encoded response.
    /// What every store checks first ([`SyncRequest::verified`]): the signature, the version,
    /// the encoding, and that the request was made within
    /// [`MAX_REQUEST_SKEW`](super::MAX_REQUEST_SKEW) of `now` — a captured request replayed
    /// after its `seq` is forgotten is refused ([`SyncError::Skewed`]) and counts nothing.
    pub fn handle_signed(&mut self, now: Nanos, secret: &[u8], body: &[u8], tag: &[u8]) -> Result<Vec<u8>, SyncError> {
        let req = SyncRequest::verified(secret, body, tag, Some(now))?;
        self.handle(now, &req).map(|r| r.encode())
    }

    /// Applies a batch, or answers an ask, at the store's `now`, as docs/sync-protocol.md
    /// specifies (the request trusted as it is: its signature and time are checked by
    /// [`Store::handle_signed`]): an older batch `seq` is refused ([`SyncError::Stale`]); every counter
    /// applies a node's `seq` once, so a repeat — whole, or after a partial failure — counts
    /// nothing again and is answered with the grant each counter gave it, on what remains of
    /// its lease. An ask's `seq` numbers the node's asks: it neither checks nor moves the
    /// batch sequence (each counter answers a repeated ask again, taking nothing). A batch's
    /// answer names, after its deltas' grants, the counters found out of quota ([`Out`]).
    pub fn handle(&mut self, now: Nanos, req: &SyncRequest) -> Result<SyncResponse, SyncError> {
        let ttl = self.node_ttl;
        let nodes = self.registry.heard(now, req.node, (req.seq, req.ask, req.sent), ttl)?;
        let heard = self.registry.heard_within(now, super::CUT_OFF_SILENCE);
        let mut grants = Vec::with_capacity(req.deltas.len());
        for d in &req.deltas {
            if !self.counters.contains_key(&d.key) && self.counters.len() >= self.max_counters {
                self.evict_oldest();
            }
            let c = self.counters.entry(d.key.clone()).or_insert_with(|| Counter::new(d.limit));
            c.heard_lately(&heard);
            let a = if req.ask {
                c.ask(d.limit, now, req.node, req.seq, d.units, ttl)
            } else {
                c.apply(d.limit, now, req.node, req.seq, d.units, ttl)
            };
            self.out.note(&d.key, c.out_for(now), now);
            grants.push(Grant::from_applied(&d.key, &a));
        }
        let mut resp = SyncResponse { seq: req.seq, now, nodes, grants, failed: Vec::new() };
        self.out.name(now, req, &mut resp);
        Ok(resp)
    }

    fn evict_oldest(&mut self) {
        if let Some(key) = self.counters.iter().min_by_key(|(_, c)| c.last_seen).map(|(k, _)| k.clone()) {
            self.counters.remove(&key);
        }
    }
}
