//! The sync protocol between proxies and the global store, and a reference store.
//!
//! Each proxy admits locally and, once per interval, sends the store one batch: the units it
//! admitted per counter since its last sync ([`SyncRequest`]). The store adds them to the
//! global state of each counter ([`Limit::consume`]) and answers with the global view and a
//! *grant* per counter ([`SyncResponse`]): the units this node may admit before its next sync.
//! Grants split the global remaining quota between the nodes in proportion to their recent
//! traffic, so the grants outstanding at one instant never sum to more than what remains.
//!
//! - **Idempotent:** a request carries the node id and a sequence number. The store answers a
//!   repeat of the node's last sequence with the response it already gave (a retried batch is
//!   never counted twice) and refuses older ones ([`SyncError::Stale`]).
//! - **Authenticated:** [`sign`] / [`verify`] are HMAC-SHA256 over the encoded body with a
//!   shared secret; the tag travels beside the body (a header), never in logs.
//! - **One clock:** the store's `now` in the response is the reference for window ids, so
//!   nodes with skewed clocks agree on windows.
//! - **Compact:** `version | kind | varints`; a delta is its key, its limit (4 varints) and
//!   its units.
//!
//! `docs/sync-protocol.md` describes the wire format and the error bound.

use crate::algo::{Algorithm, Limit, Nanos, State};
use crate::encoding::{put_varint, DecodeError, Reader};
use alloc::collections::BTreeMap;
use alloc::vec::Vec;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The protocol version byte.
pub const VERSION: u8 = 1;
const KIND_REQUEST: u8 = 1;
const KIND_RESPONSE: u8 = 2;
const KIND_ASK: u8 = 3;
/// Longest counter key accepted on the wire.
pub const MAX_KEY: usize = 1024;
/// Most deltas (or grants) in one message.
pub const MAX_ENTRIES: usize = 65_536;

/// Units one node admitted for one counter since its last sync.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delta {
    /// The counter key ([`crate::eval::Check::key`]).
    pub key: Vec<u8>,
    /// The limit the node applies to it.
    pub limit: Limit,
    /// Units admitted since the last sync (0: only asking for a grant).
    pub units: u64,
}

/// One node's batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncRequest {
    /// The node's id (stable across restarts of its process is not required).
    pub node: u64,
    /// Strictly increasing per node; a retry repeats the same number.
    pub seq: u64,
    /// The deltas.
    pub deltas: Vec<Delta>,
    /// An *ask* rather than a batch: each delta's `units` are units a paused request needs
    /// now, beyond the node's spent grant. The store takes them, counting them at once, only
    /// if they are free (not consumed and not held by any node's grant). `seq` then numbers
    /// the node's asks, not its batches: a repeated ask is answered again and takes nothing.
    pub ask: bool,
}

/// The store's answer for one counter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The counter key.
    pub key: Vec<u8>,
    /// Units remaining globally, after this batch.
    pub remaining: u64,
    /// Units this node may admit before its next sync.
    pub grant: u64,
    /// Time until the global quota is restored.
    pub reset_after: Nanos,
    /// How long the grant may be spent, from when the node sent its request.
    pub lease: Nanos,
}

impl Grant {
    /// The grant answering `key` with what its counter `applied`.
    pub fn from_applied(key: &[u8], a: &Applied) -> Grant {
        Grant { key: key.to_vec(), remaining: a.remaining, grant: a.grant, reset_after: a.reset_after, lease: a.lease }
    }
}

/// The store's answer to a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncResponse {
    /// The sequence number answered.
    pub seq: u64,
    /// The store's clock: the reference for window ids.
    pub now: Nanos,
    /// Nodes the store has heard from recently.
    pub nodes: u32,
    /// One grant per delta of the request, in order.
    pub grants: Vec<Grant>,
}

/// Why a batch was not applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncError {
    /// Older than the node's last batch (a reordered or duplicated old request).
    Stale {
        /// The last sequence number applied for this node.
        last: u64,
    },
    /// The bytes are not a valid message.
    Malformed(DecodeError),
    /// The tag does not match the body.
    Unauthorized,
}

fn put_limit(out: &mut Vec<u8>, l: &Limit) {
    out.push(l.algorithm().code());
    put_varint(out, l.requests());
    put_varint(out, l.per());
    put_varint(out, l.capacity());
}

fn read_limit(r: &mut Reader<'_>) -> Result<Limit, DecodeError> {
    let code = r.u8()?;
    let algorithm = Algorithm::from_code(code).ok_or(DecodeError::Tag(code))?;
    let (requests, per, capacity) = (r.varint()?, r.varint()?, r.varint()?);
    let burst = (algorithm == Algorithm::TokenBucket).then_some(capacity);
    Limit::new(algorithm, requests, per, burst).map_err(|_| DecodeError::Tag(255))
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn read_bytes(r: &mut Reader<'_>, max: usize) -> Result<Vec<u8>, DecodeError> {
    let n = usize::try_from(r.varint()?).map_err(|_| DecodeError::Truncated)?;
    if n > max {
        return Err(DecodeError::Truncated);
    }
    Ok(r.take(n)?.to_vec())
}

/// Reads the version and a kind among `kinds`; returns the kind.
fn read_header(r: &mut Reader<'_>, kinds: &[u8]) -> Result<u8, DecodeError> {
    let v = r.u8()?;
    if v != VERSION {
        return Err(DecodeError::Version(v));
    }
    let k = r.u8()?;
    if !kinds.contains(&k) {
        return Err(DecodeError::Tag(k));
    }
    Ok(k)
}

fn read_count(r: &mut Reader<'_>) -> Result<usize, DecodeError> {
    let n = usize::try_from(r.varint()?).map_err(|_| DecodeError::Truncated)?;
    if n > MAX_ENTRIES {
        return Err(DecodeError::Truncated);
    }
    Ok(n)
}

impl SyncRequest {
    /// The wire encoding.
    pub fn encode(&self) -> Vec<u8> {
        SyncRequest::encode_parts(self.node, self.seq, &self.deltas, self.ask)
    }

    /// The wire encoding of a request made of these parts (without building one).
    pub fn encode_parts(node: u64, seq: u64, deltas: &[Delta], ask: bool) -> Vec<u8> {
        let mut out = alloc::vec![VERSION, if ask { KIND_ASK } else { KIND_REQUEST }];
        put_varint(&mut out, node);
        put_varint(&mut out, seq);
        put_varint(&mut out, deltas.len() as u64);
        for d in deltas {
            put_bytes(&mut out, &d.key);
            put_limit(&mut out, &d.limit);
            put_varint(&mut out, d.units);
        }
        out
    }

    /// Decodes the wire encoding; trailing bytes are an error.
    pub fn decode(bytes: &[u8]) -> Result<SyncRequest, DecodeError> {
        let mut r = Reader { bytes, pos: 0 };
        let ask = read_header(&mut r, &[KIND_REQUEST, KIND_ASK])? == KIND_ASK;
        let (node, seq) = (r.varint()?, r.varint()?);
        let n = read_count(&mut r)?;
        let mut deltas = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            deltas.push(Delta { key: read_bytes(&mut r, MAX_KEY)?, limit: read_limit(&mut r)?, units: r.varint()? });
        }
        if r.pos != bytes.len() {
            return Err(DecodeError::Truncated);
        }
        Ok(SyncRequest { node, seq, deltas, ask })
    }
}

impl SyncResponse {
    /// The wire encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = alloc::vec![VERSION, KIND_RESPONSE];
        put_varint(&mut out, self.seq);
        put_varint(&mut out, self.now);
        put_varint(&mut out, u64::from(self.nodes));
        put_varint(&mut out, self.grants.len() as u64);
        for g in &self.grants {
            put_bytes(&mut out, &g.key);
            put_varint(&mut out, g.remaining);
            put_varint(&mut out, g.grant);
            put_varint(&mut out, g.reset_after);
            put_varint(&mut out, g.lease);
        }
        out
    }

    /// The longest valid answer to a request for counters with keys of these lengths: a
    /// node refuses a longer one before reading (or authenticating) it.
    pub fn max_len(key_lens: impl Iterator<Item = usize>) -> usize {
        // version, kind, seq, now, nodes, count; then per grant its key (length varint and
        // bytes) and four varints of at most 10 bytes each.
        key_lens.fold(2 + 10 + 10 + 5 + 10, |n, k| n.saturating_add(k.saturating_add(3 + 40)))
    }

    /// Decodes the wire encoding; trailing bytes are an error.
    pub fn decode(bytes: &[u8]) -> Result<SyncResponse, DecodeError> {
        let mut r = Reader { bytes, pos: 0 };
        read_header(&mut r, &[KIND_RESPONSE])?;
        let (seq, now) = (r.varint()?, r.varint()?);
        let nodes = u32::try_from(r.varint()?).unwrap_or(u32::MAX);
        let n = read_count(&mut r)?;
        let mut grants = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            grants.push(Grant {
                key: read_bytes(&mut r, MAX_KEY)?,
                remaining: r.varint()?,
                grant: r.varint()?,
                reset_after: r.varint()?,
                lease: r.varint()?,
            });
        }
        if r.pos != bytes.len() {
            return Err(DecodeError::Truncated);
        }
        Ok(SyncResponse { seq, now, nodes, grants })
    }
}

/// Lower-case hex, as signatures travel in the `x-ratewall-signature` header.
pub fn hex(bytes: &[u8]) -> alloc::string::String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = alloc::string::String::with_capacity(bytes.len() * 2);
    for b in bytes {
        for d in [b >> 4, b & 15] {
            s.push(char::from(DIGITS.get(usize::from(d)).copied().unwrap_or(b'0')));
        }
    }
    s
}

/// Parses [`hex`] (either case); `None` on an odd length or a non-hex digit.
pub fn unhex(s: &[u8]) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    s.chunks(2)
        .map(|p| {
            let d = |c: u8| char::from(c).to_digit(16);
            Some((d(*p.first()?)? * 16 + d(*p.get(1)?)?) as u8)
        })
        .collect()
}

/// HMAC-SHA256 of `body` under `secret`.
pub fn sign(secret: &[u8], body: &[u8]) -> [u8; 32] {
    // HMAC accepts keys of any length, so `new_from_slice` cannot fail.
    match Hmac::<Sha256>::new_from_slice(secret) {
        Ok(mut mac) => {
            mac.update(body);
            mac.finalize().into_bytes().into()
        }
        Err(_) => [0; 32],
    }
}

/// Whether `tag` is the HMAC-SHA256 of `body` under `secret` (constant-time comparison).
pub fn verify(secret: &[u8], body: &[u8], tag: &[u8]) -> bool {
    match Hmac::<Sha256>::new_from_slice(secret) {
        Ok(mut mac) => {
            mac.update(body);
            mac.verify_slice(tag).is_ok()
        }
        Err(_) => false,
    }
}

/// Most nodes one counter remembers (the least recently seen go first). A fleet of more
/// nodes syncing one counter within [`SEQ_MEMORY`] may see a late retry counted twice.
pub const MAX_SHARES: usize = 256;

/// How long a counter remembers a node's last `seq` after it last heard from it, and the
/// registry a node's: longer than any retry a node makes (the filter gives a batch up after
/// [`RETRY_HORIZON`]), so a late retry is recognized, never counted twice.
pub const SEQ_MEMORY: Nanos = 60 * crate::algo::SECOND;

/// How long after first sending a batch a node may still retry it (with the same `seq`);
/// after that it drops the batch (its units are counted as dropped) rather than risk a store
/// that has forgotten the `seq` counting it twice.
pub const RETRY_HORIZON: Nanos = 45 * crate::algo::SECOND;

/// One node's recent traffic on a counter, and its last batch for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Share {
    node: u64,
    /// The sequence number of the node's last batch applied to this counter.
    seq: u64,
    /// Recent units (halved at each of the node's syncs): the traffic share.
    units: u64,
    /// The grant answered to that batch (a retry gets the same answer).
    grant: u64,
    seen: Nanos,
    /// The end of the grant's lease: after it the node no longer spends the grant.
    until: Nanos,
    /// Units given to the node's asks since its last batch.
    asked: u64,
    /// Units given to its asks before its last batch, which may have been cut before they
    /// were spent: they stay outstanding until the batch after.
    carried: u64,
    /// The node's last ask (its number) and the units it was given: a repeat of it (a
    /// duplicated request) gets the same answer and takes nothing more.
    last_ask: (u64, u64),
}

/// What a counter answers to one node's delta.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Applied {
    /// Units remaining globally, after the delta.
    pub remaining: u64,
    /// Units this node may admit before its next sync.
    pub grant: u64,
    /// Time until the global quota is restored.
    pub reset_after: Nanos,
    /// How long the node may spend the grant.
    pub lease: Nanos,
    /// Nodes active on this counter.
    pub nodes: u32,
    /// False when the delta was a repeat (or older than one) already applied: not counted.
    pub counted: bool,
}

/// The longest lease a grant gets (far from the limit, or with no traffic to go by).
pub const MAX_LEASE: Nanos = 2 * crate::algo::SECOND;
/// The lease of units given to an ask: they are spent at once, or given back by expiring.
pub const ASK_LEASE: Nanos = crate::algo::SECOND;

const COUNTER_VERSION: u8 = 2;

/// One global counter: its state, the traffic shares of the nodes that sync to it, and its
/// recent rate.
///
/// The reference [`Store`] holds many; the Cloudflare Worker holds one per Durable Object, so
/// both answer a delta the same way. Every operation clamps `now` to the latest instant the
/// counter has seen: time never goes backwards for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counter {
    /// The limit last applied (a delta or check with another limit replaces it).
    pub limit: Limit,
    /// The global state.
    pub state: State,
    shares: Vec<Share>,
    /// The latest instant seen.
    pub last_seen: Nanos,
    /// Units reported per whole second: (second, units in the one before, units in it).
    rate: (u64, u64, u64),
}

impl Counter {
    /// A fresh counter.
    pub fn new(limit: Limit) -> Counter {
        Counter { limit, state: State::Fresh, shares: Vec::new(), last_seen: 0, rate: (0, 0, 0) }
    }

    fn clock(&mut self, limit: Limit, now: Nanos) -> Nanos {
        if limit != self.limit {
            // The rules changed: the state carries over; a state of another algorithm reads
            // as fresh.
            self.limit = limit;
        }
        self.last_seen = self.last_seen.max(now);
        self.last_seen
    }

    /// Decides a request of `cost` units and consumes them when it is allowed.
    pub fn take(&mut self, limit: Limit, now: Nanos, cost: u64) -> crate::algo::Decision {
        let now = self.clock(limit, now);
        let (d, next) = self.limit.decide(&self.state, now, cost);
        // A denial returns the state as it was, or moved back after a clock step.
        if !d.allowed || cost > 0 {
            self.state = next;
        }
        d
    }

    /// Gives back `cost` units taken at `taken_at`.
    pub fn refund(&mut self, limit: Limit, now: Nanos, taken_at: Nanos, cost: u64) {
        self.clock(limit, now);
        self.state = self.limit.refund(&self.state, taken_at, cost);
    }

    /// Forgets the nodes not heard from for [`SEQ_MEMORY`] whose leases are over.
    fn forget_quiet(&mut self, node: u64, now: Nanos) {
        self.shares.retain(|s| s.node == node || now.saturating_sub(s.seen) <= SEQ_MEMORY || s.until > now);
    }

    /// Nodes active on this counter at `now`: heard from within `node_ttl`, or holding a
    /// lease. (Quieter ones are only remembered, for their `seq`.)
    fn active(&self, now: Nanos, node_ttl: Nanos) -> impl Iterator<Item = &Share> {
        self.shares.iter().filter(move |s| now.saturating_sub(s.seen) <= node_ttl || s.until > now)
    }

    /// Adds one node's delta (units it already admitted) and answers its grant. A delta whose
    /// `seq` this counter has already applied for the node is not counted again: a repeat gets
    /// the grant it got before, an older one a grant of 0.
    pub fn apply(&mut self, limit: Limit, now: Nanos, node: u64, seq: u64, units: u64, node_ttl: Nanos) -> Applied {
        let now = self.clock(limit, now);
        self.forget_quiet(node, now);
        let nodes = |c: &Counter| u32::try_from(c.active(now, node_ttl).count()).unwrap_or(u32::MAX);
        let prior = self.shares.iter().position(|s| s.node == node);
        if let Some(s) = prior.and_then(|i| self.shares.get(i)).filter(|s| seq <= s.seq) {
            let (grant, lease) = if seq == s.seq { (s.grant, s.until.saturating_sub(now)) } else { (0, 0) };
            let (view, _) = self.limit.decide(&self.state, now, 0);
            let (remaining, reset_after) = (view.remaining, view.reset_after);
            return Applied { remaining, grant, reset_after, lease, nodes: nodes(self), counted: false };
        }
        self.state = self.limit.consume(&self.state, now, units);
        self.note_rate(now, units);
        let idx = match prior {
            Some(i) => i,
            None => self.new_share(node, now),
        };
        let (view, _) = self.limit.decide(&self.state, now, 0);
        // Grants are strict: what this node may take is what remains minus every other node's
        // grant still on lease, so the grants outstanding never sum to more than what remains
        // (units a node spent from its grant are not counted until it reports them, and its
        // report replaces its grant). Of that, the node gets its traffic share, rounded down.
        //
        // A grant is leased for about half the time the whole fleet, at its recent rate,
        // would take to use up what remains: a node that goes quiet holds its grant for no
        // longer than that, so by the time the quota runs low the units it held are free
        // again for the nodes that ask ([`Counter::ask`]).
        let others = self.outstanding(now, Some(node));
        let available = view.remaining.saturating_sub(others);
        let lease = self.lease(view.remaining, now);
        let mut grant = 0;
        if let Some(s) = self.shares.get_mut(idx) {
            s.units = s.units / 2 + units;
            let carried = s.asked;
            let until = now.saturating_add(lease);
            *s = Share {
                node,
                seq,
                units: s.units,
                grant: 0,
                seen: now,
                until,
                asked: 0,
                carried,
                last_ask: s.last_ask,
            };
            grant = self.share_of(node, available.saturating_sub(carried), lease, node_ttl);
        }
        if let Some(s) = self.shares.get_mut(idx) {
            s.grant = grant;
        }
        let (remaining, reset_after) = (view.remaining, view.reset_after);
        Applied { remaining, grant, reset_after, lease, nodes: nodes(self), counted: true }
    }

    /// `node`'s part of `available` units for a lease of `lease`: its traffic share (weights
    /// are recent units + 1, so a node new to a counter still gets some), rounded down, and
    /// no more than twice what that share of the fleet's recent rate would use in the lease
    /// — units a quiet node holds are locked from every other node.
    fn share_of(&self, node: u64, available: u64, lease: Nanos, node_ttl: Nanos) -> u64 {
        if lease == 0 {
            return 0;
        }
        let weight = |s: &Share| u128::from(s.units) + 1;
        let now = self.last_seen;
        let total: u128 = self.active(now, node_ttl).filter(|s| s.node != node).map(weight).sum::<u128>()
            + self.shares.iter().find(|s| s.node == node).map_or(1, weight);
        let mine = self.shares.iter().find(|s| s.node == node).map_or(1, weight);
        let fair = u128::from(available) * mine / total.max(mine);
        let rate = u128::from(self.rate.1.max(self.rate.2).max(1));
        let use_in_lease = rate * u128::from(lease) * mine / total.max(mine) / u128::from(crate::algo::SECOND);
        u64::try_from(fair.min(2 * use_in_lease)).unwrap_or(u64::MAX).min(available)
    }

    /// Counts `units` reported at `now` into the per-second rate.
    fn note_rate(&mut self, now: Nanos, units: u64) {
        let sec = now / crate::algo::SECOND;
        let (at, prev, curr) = self.rate;
        self.rate = match sec.saturating_sub(at) {
            0 => (at, prev, curr.saturating_add(units)),
            1 => (sec, curr, units),
            _ => (sec, 0, units),
        };
    }

    /// Units reported over the last second (the one before counted pro rata).
    fn rate_per_sec(&self, now: Nanos) -> u64 {
        let second = crate::algo::SECOND;
        let (at, prev, curr) = self.rate;
        let left = u128::from(second - now % second);
        let part = |n: u64| (u128::from(n) * left / u128::from(second)) as u64;
        match (now / second).saturating_sub(at) {
            0 => part(prev).saturating_add(curr),
            1 => part(curr),
            _ => 0,
        }
    }

    /// The lease of a grant given now: half the time the fleet would take to use up
    /// `remaining` at its recent rate, at most [`MAX_LEASE`]; 0 when nothing remains.
    fn lease(&self, remaining: u64, now: Nanos) -> Nanos {
        if remaining == 0 {
            return 0;
        }
        let rate = self.rate_per_sec(now);
        if rate == 0 {
            return MAX_LEASE;
        }
        let until_empty = u128::from(remaining) * u128::from(crate::algo::SECOND) / u128::from(rate);
        u64::try_from(until_empty / 2).unwrap_or(u64::MAX).min(MAX_LEASE)
    }

    /// Adds a share for `node` (the least recently seen goes when full); returns its index.
    fn new_share(&mut self, node: u64, now: Nanos) -> usize {
        if self.shares.len() >= MAX_SHARES {
            if let Some(old) = self.shares.iter().enumerate().min_by_key(|(_, s)| s.seen).map(|(i, _)| i) {
                self.shares.swap_remove(old);
            }
        }
        let last_ask = (0, 0);
        self.shares.push(Share {
            node,
            seq: 0,
            units: 0,
            grant: 0,
            seen: now,
            until: now,
            asked: 0,
            carried: 0,
            last_ask,
        });
        self.shares.len() - 1
    }

    /// Units held by the nodes' grants still on lease (all nodes but `except`). A fixed
    /// window's grant also ends with the window it was given in.
    fn outstanding(&self, now: Nanos, except: Option<u64>) -> u64 {
        let per = self.limit.per().max(1);
        let fixed = self.limit.algorithm() == Algorithm::FixedWindow;
        self.shares
            .iter()
            .filter(|s| Some(s.node) != except && s.until > now && !(fixed && s.seen / per != now / per))
            .map(|s| s.grant.saturating_add(s.asked).saturating_add(s.carried))
            .fold(0, u64::saturating_add)
    }

    /// Answers a node's *ask*: a request that needs `cost` units now, its grant being spent.
    /// The units are taken — counted here, at once — only if they are free: not consumed and
    /// not held by any node's grant on lease, the asker's included, so an ask never
    /// over-admits. With them comes the node's share of what else is free, as a sync would
    /// give it, so its next requests need not ask; the node reports what it spends of that
    /// with its next batch, like any grant. `grant` in the answer is 0 (refused), or `cost`
    /// (taken) plus that share, leased for [`ASK_LEASE`]. `ask` numbers the node's asks
    /// (not 0): a repeat of its last one gets the same answer and takes nothing.
    pub fn ask(&mut self, limit: Limit, now: Nanos, node: u64, ask: u64, cost: u64, node_ttl: Nanos) -> Applied {
        let now = self.clock(limit, now);
        self.forget_quiet(node, now);
        let (view, _) = self.limit.decide(&self.state, now, 0);
        let nodes = u32::try_from(self.active(now, node_ttl).count()).unwrap_or(u32::MAX);
        let (remaining, reset_after) = (view.remaining, view.reset_after);
        if let Some(s) = self.shares.iter().find(|s| s.node == node && ask != 0 && s.last_ask.0 == ask) {
            let grant = s.last_ask.1;
            return Applied { remaining, grant, reset_after, lease: ASK_LEASE, nodes, counted: false };
        }
        let held = self.outstanding(now, None);
        let free = view.remaining.saturating_sub(held);
        let mut given = 0;
        if cost <= free {
            let extra = self.share_of(node, free - cost, self.lease(view.remaining, now).min(ASK_LEASE), node_ttl);
            given = cost.saturating_add(extra);
            self.state = self.limit.consume(&self.state, now, cost);
            self.note_rate(now, cost);
            let idx = match self.shares.iter().position(|s| s.node == node) {
                Some(i) => i,
                None => self.new_share(node, now),
            };
            if let Some(s) = self.shares.get_mut(idx) {
                s.asked = s.asked.saturating_add(extra);
                s.last_ask = (ask, given);
                s.until = s.until.max(now.saturating_add(ASK_LEASE));
                s.seen = now;
            }
        }
        // What remains after the units this ask took.
        let (view, _) = self.limit.decide(&self.state, now, 0);
        let nodes = u32::try_from(self.active(now, node_ttl).count()).unwrap_or(nodes);
        let (remaining, reset_after) = (view.remaining, view.reset_after);
        Applied { remaining, grant: given, reset_after, lease: ASK_LEASE, nodes, counted: given > 0 }
    }

    /// When this counter can be forgotten: its state is fresh, no node holds a lease, and
    /// no node's `seq` needs remembering ([`SEQ_MEMORY`]).
    pub fn idle_at(&self) -> Nanos {
        let shares = self.shares.iter().map(|s| s.seen.saturating_add(SEQ_MEMORY).max(s.until)).max().unwrap_or(0);
        self.limit.idle_at(&self.state).max(shares)
    }

    /// The persistent encoding: state, clock, rate and shares (the limit travels with each
    /// call).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = alloc::vec![COUNTER_VERSION];
        self.state.encode_into(&mut out);
        put_varint(&mut out, self.last_seen);
        for v in [self.rate.0, self.rate.1, self.rate.2] {
            put_varint(&mut out, v);
        }
        put_varint(&mut out, self.shares.len() as u64);
        for s in &self.shares {
            for v in [s.node, s.seq, s.units, s.grant, s.seen, s.until, s.asked, s.carried, s.last_ask.0, s.last_ask.1]
            {
                put_varint(&mut out, v);
            }
        }
        out
    }

    /// Decodes [`Counter::encode`] under `limit` (and the version before it, which had no
    /// rate and no leases: its grants are taken as leased for [`MAX_LEASE`]); trailing bytes
    /// are an error.
    pub fn decode(limit: Limit, bytes: &[u8]) -> Result<Counter, DecodeError> {
        let mut r = Reader { bytes, pos: 0 };
        let v = r.u8()?;
        if v != COUNTER_VERSION && v != 1 {
            return Err(DecodeError::Version(v));
        }
        let (state, used) = State::decode(bytes.get(1..).unwrap_or_default())?;
        r.pos += used;
        let last_seen = r.varint()?;
        let rate = if v == 1 { (0, 0, 0) } else { (r.varint()?, r.varint()?, r.varint()?) };
        let n = usize::try_from(r.varint()?).map_err(|_| DecodeError::Truncated)?;
        if n > MAX_SHARES {
            return Err(DecodeError::Truncated);
        }
        let mut shares = Vec::with_capacity(n);
        for _ in 0..n {
            let (node, seq, units, grant, seen) = (r.varint()?, r.varint()?, r.varint()?, r.varint()?, r.varint()?);
            let (until, asked, carried, last_ask) = if v == 1 {
                (seen.saturating_add(MAX_LEASE), 0, 0, (0, 0))
            } else {
                (r.varint()?, r.varint()?, r.varint()?, (r.varint()?, r.varint()?))
            };
            shares.push(Share { node, seq, units, grant, seen, until, asked, carried, last_ask });
        }
        if r.pos != bytes.len() {
            return Err(DecodeError::Truncated);
        }
        Ok(Counter { limit, state, shares, last_seen, rate })
    }
}

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
}

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
}

impl Store {
    /// A store tracking at most `max_counters` counters (least recently seen are dropped).
    pub fn new(max_counters: usize, node_ttl: Nanos) -> Store {
        Store { counters: BTreeMap::new(), registry: Registry::default(), max_counters: max_counters.max(1), node_ttl }
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

    /// Verifies and applies an encoded, signed batch; returns the encoded response.
    pub fn handle_signed(&mut self, now: Nanos, secret: &[u8], body: &[u8], tag: &[u8]) -> Result<Vec<u8>, SyncError> {
        if !verify(secret, body, tag) {
            return Err(SyncError::Unauthorized);
        }
        let req = SyncRequest::decode(body).map_err(SyncError::Malformed)?;
        self.handle(now, &req).map(|r| r.encode())
    }

    /// Applies a batch, or answers an ask, at the store's `now`, as docs/sync-protocol.md
    /// specifies: an older batch `seq` is refused ([`SyncError::Stale`]); every counter
    /// applies a node's `seq` once, so a repeat — whole, or after a partial failure — counts
    /// nothing again and is answered with the grant each counter gave it, on what remains of
    /// its lease. An ask's `seq` numbers the node's asks: it neither checks nor moves the
    /// batch sequence (each counter answers a repeated ask again, taking nothing).
    pub fn handle(&mut self, now: Nanos, req: &SyncRequest) -> Result<SyncResponse, SyncError> {
        let ttl = self.node_ttl;
        let nodes = self.registry.heard(now, req.node, req.seq, req.ask, ttl)?;
        let mut grants = Vec::with_capacity(req.deltas.len());
        for d in &req.deltas {
            if !self.counters.contains_key(&d.key) && self.counters.len() >= self.max_counters {
                self.evict_oldest();
            }
            let c = self.counters.entry(d.key.clone()).or_insert_with(|| Counter::new(d.limit));
            let a = if req.ask {
                c.ask(d.limit, now, req.node, req.seq, d.units, ttl)
            } else {
                c.apply(d.limit, now, req.node, req.seq, d.units, ttl)
            };
            grants.push(Grant::from_applied(&d.key, &a));
        }
        Ok(SyncResponse { seq: req.seq, now, nodes, grants })
    }

    fn evict_oldest(&mut self) {
        if let Some(key) = self.counters.iter().min_by_key(|(_, c)| c.last_seen).map(|(k, _)| k.clone()) {
            self.counters.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::SECOND;
    use alloc::vec;

    fn limit() -> Limit {
        Limit::new(Algorithm::SlidingWindow, 100, 60 * SECOND, None).unwrap()
    }

    fn req(node: u64, seq: u64, units: u64) -> SyncRequest {
        SyncRequest { node, seq, deltas: vec![Delta { key: b"k".to_vec(), limit: limit(), units }], ask: false }
    }

    const NOW: Nanos = 1_700_000_000 * SECOND;

    #[test]
    fn the_longest_answer_fits_its_bound() {
        let key = vec![7u8; MAX_KEY];
        let g =
            Grant { key: key.clone(), remaining: u64::MAX, grant: u64::MAX, reset_after: u64::MAX, lease: u64::MAX };
        let resp = SyncResponse { seq: u64::MAX, now: u64::MAX, nodes: u32::MAX, grants: vec![g.clone(), g] };
        assert!(resp.encode().len() <= SyncResponse::max_len([MAX_KEY, MAX_KEY].into_iter()));
        let empty = SyncResponse { seq: u64::MAX, now: u64::MAX, nodes: u32::MAX, grants: vec![] };
        assert!(empty.encode().len() <= SyncResponse::max_len(core::iter::empty()));
    }

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        assert_eq!(hex(&[0, 0xab, 7]), "00ab07");
        assert_eq!(unhex(b"00AB07"), Some(vec![0, 0xab, 7]));
        assert_eq!(unhex(b"0g"), None);
        assert_eq!(unhex(b"abc"), None);
    }

    #[test]
    fn messages_round_trip_and_trailing_bytes_are_errors() {
        let r = req(7, 9, 3);
        assert_eq!(SyncRequest::decode(&r.encode()), Ok(r.clone()));
        let mut long = r.encode();
        long.push(0);
        assert!(SyncRequest::decode(&long).is_err());
        let resp = SyncResponse {
            seq: 9,
            now: NOW,
            nodes: 3,
            grants: vec![Grant { key: b"k".to_vec(), remaining: 5, grant: 2, reset_after: 7, lease: 9 }],
        };
        assert_eq!(SyncResponse::decode(&resp.encode()), Ok(resp));
        assert!(SyncResponse::decode(&r.encode()).is_err(), "a request is not a response");
    }

    #[test]
    fn a_delta_costs_a_few_bytes() {
        let r = SyncRequest {
            node: 1,
            seq: 1,
            deltas: vec![Delta { key: vec![b'x'; 24], limit: limit(), units: 12 }; 100],
            ask: false,
        };
        let per_delta = (r.encode().len() - 5) / 100;
        assert!(per_delta <= 36, "{per_delta} bytes per delta for a 24-byte key");
    }

    #[test]
    fn forged_or_tampered_batches_are_refused() {
        let mut s = Store::new(100, 10 * SECOND);
        let body = req(1, 1, 5).encode();
        let tag = sign(b"secret", &body);
        assert_eq!(s.handle_signed(NOW, b"other", &body, &tag), Err(SyncError::Unauthorized));
        let mut tampered = body.clone();
        if let Some(last) = tampered.last_mut() {
            *last = 99;
        }
        assert_eq!(s.handle_signed(NOW, b"secret", &tampered, &tag), Err(SyncError::Unauthorized));
        assert!(s.handle_signed(NOW, b"secret", &body, &tag).is_ok());
        assert_eq!(s.peek(b"k", NOW).map(|d| d.remaining), Some(95));
    }

    #[test]
    fn a_retried_batch_is_never_counted_twice_and_old_ones_are_refused() {
        let mut s = Store::new(100, 10 * SECOND);
        let first = s.handle(NOW, &req(1, 5, 10)).unwrap();
        let retry = s.handle(NOW + SECOND, &req(1, 5, 10)).unwrap();
        // The same grant, on what remains of its lease, at the store's clock now.
        let (a, b) = (&first.grants[0], &retry.grants[0]);
        assert_eq!((b.grant, b.remaining, b.lease, retry.now), (a.grant, a.remaining, a.lease - SECOND, NOW + SECOND));
        assert_eq!(s.peek(b"k", NOW).map(|d| d.remaining), Some(90));
        s.handle(NOW, &req(1, 6, 1)).unwrap();
        assert_eq!(s.handle(NOW, &req(1, 5, 10)), Err(SyncError::Stale { last: 6 }));
        assert_eq!(s.peek(b"k", NOW).map(|d| d.remaining), Some(89));
    }

    #[test]
    fn a_late_retry_is_recognized_after_other_nodes_synced_and_quiet_spells() {
        // The Worker forgot a node's seq once it had been quiet for 2 s while another node
        // synced the counter: the retry counted twice. Now it is remembered for SEQ_MEMORY,
        // longer than the filter retries (RETRY_HORIZON).
        let ttl = 2 * SECOND;
        for wait in [SECOND + SECOND / 2, 5 * SECOND / 2, 6 * SECOND, RETRY_HORIZON] {
            let mut s = Store::new(100, ttl);
            s.handle(NOW, &req(1, 1, 5)).unwrap();
            s.handle(NOW + wait / 2, &req(2, 1, 0)).unwrap();
            s.handle(NOW + wait, &req(2, 2, 0)).unwrap();
            let before = s.peek(b"k", NOW + wait).map(|d| d.remaining);
            s.handle(NOW + wait, &req(1, 1, 5)).unwrap();
            assert_eq!(s.peek(b"k", NOW + wait).map(|d| d.remaining), before, "repeat after {wait} ns");
        }
    }

    #[test]
    fn more_nodes_than_the_old_share_cap_keep_their_seq() {
        let mut s = Store::new(100, 2 * SECOND);
        for node in 1..=100u64 {
            s.handle(NOW + node, &req(node, 1, 0)).unwrap();
        }
        s.handle(NOW, &req(1000, 1, 1)).unwrap();
        for node in 1..=100u64 {
            s.handle(NOW + 200, &req(node, 2, 0)).unwrap();
        }
        // Node 1000's retry, after 100 other nodes.
        s.handle(NOW + 300, &req(1000, 1, 1)).unwrap();
        assert_eq!(s.peek(b"k", NOW + 300).map(|d| d.remaining), Some(99));
    }

    #[test]
    fn nodes_are_the_fleet_heard_from_even_in_a_heartbeat() {
        let mut s = Store::new(100, 2 * SECOND);
        for node in 1..=3 {
            assert_eq!(s.handle(NOW, &req(node, 1, 1)).unwrap().nodes, node as u32);
        }
        let heartbeat = SyncRequest { node: 1, seq: 2, deltas: vec![], ask: false };
        assert_eq!(s.handle(NOW + SECOND, &heartbeat).unwrap().nodes, 3);
        // Past the node TTL only the sender counts.
        let heartbeat = SyncRequest { node: 1, seq: 3, deltas: vec![], ask: false };
        assert_eq!(s.handle(NOW + 4 * SECOND, &heartbeat).unwrap().nodes, 1);
    }

    #[test]
    fn an_asks_remaining_is_after_its_units() {
        let mut s = Store::new(100, 2 * SECOND);
        s.handle(NOW, &req(1, 1, 90)).unwrap();
        let ask = SyncRequest {
            node: 2,
            seq: 1,
            deltas: vec![Delta { key: b"k".to_vec(), limit: limit(), units: 3 }],
            ask: true,
        };
        // Past node 1's lease, its grant no longer holds the last 10 units.
        let r = s.handle(NOW + 3 * SECOND, &ask).unwrap();
        assert!(r.grants[0].grant >= 3, "{r:?}");
        assert_eq!(r.grants[0].remaining, 7);
    }

    #[test]
    fn grants_never_promise_more_than_remains_and_follow_traffic() {
        let mut s = Store::new(100, 10 * SECOND);
        let mut grants = BTreeMap::new();
        // Node 1 sends 9x the traffic of node 2 and node 3.
        for round in 1..=3 {
            for (node, units) in [(1u64, 9u64), (2, 1), (3, 1)] {
                let r = s.handle(NOW + round, &req(node, round, units)).unwrap();
                grants.insert(node, r.grants[0].grant);
            }
        }
        let remaining = s.peek(b"k", NOW + 3).unwrap().remaining;
        assert_eq!(remaining, 100 - 33);
        assert!(grants.values().sum::<u64>() <= remaining, "{grants:?} vs {remaining}");
        assert!(grants[&1] > 4 * grants[&2], "{grants:?}");
    }

    #[test]
    fn an_ask_neither_checks_nor_moves_the_batch_sequence() {
        let mut s = Store::new(100, 10 * SECOND);
        s.handle(NOW, &req(1, 5, 10)).unwrap();
        let ask = SyncRequest { ask: true, ..req(1, 0, 1) };
        assert_eq!(SyncRequest::decode(&ask.encode()), Ok(ask.clone()));
        let answer = s.handle(NOW, &ask).unwrap();
        assert!(answer.grants[0].grant >= 1, "{answer:?}");
        assert_eq!(s.peek(b"k", NOW).map(|d| d.remaining), Some(89), "the asked unit is counted");
        assert_eq!(s.handle(NOW, &req(1, 5, 10)).unwrap().seq, 5, "batch 5 is still the last one");
        assert!(s.handle(NOW, &req(1, 6, 0)).is_ok());
    }

    #[test]
    fn grants_on_lease_never_sum_past_what_remains_and_asks_take_only_free_units() {
        let small = Limit::new(Algorithm::FixedWindow, 10, 60 * SECOND, None).unwrap();
        let mut c = Counter::new(small);
        let mut held = 0;
        c.take(small, NOW, 5);
        for node in 1..=5 {
            held += c.apply(small, NOW, node, 1, 0, 10 * SECOND).grant;
        }
        let remaining = c.limit.decide(&c.state, NOW, 0).0.remaining;
        assert_eq!(remaining, 5);
        assert!(held <= remaining, "{held} granted of {remaining}");
        // Asks take what no grant holds, counting it at once, and no more.
        let mut taken = 0;
        for node in 1..=10 {
            let a = c.ask(small, NOW, node, 1, 1, 10 * SECOND);
            assert!(a.grant == 0 || a.grant >= 1);
            taken += u64::from(a.grant > 0);
        }
        assert_eq!(taken, remaining - held, "exactly the free units");
        assert_eq!(c.limit.decide(&c.state, NOW, 0).0.remaining, held, "asked units are counted at once");
    }

    #[test]
    fn a_quiet_nodes_grant_lapses_with_its_lease_and_frees_its_units() {
        let l = Limit::new(Algorithm::FixedWindow, 100, 60 * SECOND, None).unwrap();
        let mut c = Counter::new(l);
        let first = c.apply(l, NOW, 1, 1, 40, 10 * SECOND);
        assert!(first.grant > 0 && first.lease > 0 && first.lease <= MAX_LEASE, "{first:?}");
        // While node 1's grant is on lease, node 2 cannot ask for those units.
        let free_now = 60 - first.grant;
        let mut asked = 0;
        for n in 1.. {
            if c.ask(l, NOW, 2, n, 1, 10 * SECOND).grant == 0 {
                break;
            }
            asked += 1;
            assert!(asked <= free_now, "asks reached units node 1 holds");
        }

        // Once the lease is over, node 1's units are free again.
        let later = NOW + first.lease + 1;
        assert!(c.ask(l, later, 2, 1000, 1, 10 * SECOND).grant > 0, "a lapsed grant locks nothing");
    }

    #[test]
    fn a_duplicated_ask_is_answered_again_and_takes_nothing_more() {
        let l = Limit::new(Algorithm::FixedWindow, 100, 60 * SECOND, None).unwrap();
        let mut c = Counter::new(l);
        let first = c.ask(l, NOW, 2, 5, 1, 10 * SECOND);
        assert!(first.grant >= 1 && first.counted);
        let again = c.ask(l, NOW + 1, 2, 5, 1, 10 * SECOND);
        assert_eq!((again.grant, again.counted, again.remaining), (first.grant, false, 99));
        assert!(c.ask(l, NOW + 2, 2, 6, 1, 10 * SECOND).counted, "the next ask is a new one");
    }

    #[test]
    fn leases_shorten_as_the_quota_runs_out_at_the_fleets_rate() {
        let l = Limit::new(Algorithm::FixedWindow, 1000, 60 * SECOND, None).unwrap();
        let mut c = Counter::new(l);
        let mut leases = Vec::new();
        // 100 units per second reported, from t = 0 to t = 9 s.
        for i in 0..10u64 {
            leases.push(c.apply(l, NOW + i * SECOND, 1, i + 1, 100, 10 * SECOND).lease);
        }
        assert!(leases.windows(2).all(|w| w[1] <= w[0]), "{leases:?}");
        assert_eq!(leases[0], MAX_LEASE, "{leases:?}");
        // 100 units left at 100 per second (up to 200 counted at a second's edge): at most
        // half a second.
        assert!(leases[8] > 0 && leases[8] <= SECOND / 2, "{leases:?}");
        assert_eq!(leases[9], 0, "nothing left: no lease");
    }

    #[test]
    fn a_counter_applies_each_nodes_batch_once_and_keeps_it_across_encoding() {
        let mut c = Counter::new(limit());
        let first = c.apply(limit(), NOW, 1, 7, 10, SECOND);
        assert!(first.counted);
        assert_eq!(first.remaining, 90);
        let again = c.apply(limit(), NOW + 1, 1, 7, 10, SECOND);
        assert_eq!((again.counted, again.grant, again.remaining), (false, first.grant, 90));
        let older = c.apply(limit(), NOW + 2, 1, 6, 10, SECOND);
        assert_eq!((older.counted, older.grant, older.remaining), (false, 0, 90));
        let mut restored = Counter::decode(limit(), &c.encode()).unwrap();
        assert_eq!(restored, c);
        assert!(!restored.apply(limit(), NOW + 3, 1, 7, 10, SECOND).counted, "a restart forgets no batch");
        assert!(restored.apply(limit(), NOW + 3, 2, 7, 5, SECOND).counted, "another node's seq is its own");
        assert!(Counter::decode(limit(), &c.encode()[..3]).is_err());
        // Asks, a lease and the rate survive a restart too.
        assert!(restored.ask(limit(), NOW + 4, 3, 1, 1, SECOND).grant > 0);
        assert_eq!(Counter::decode(limit(), &restored.encode()).unwrap(), restored);
        // A counter stored by the version before leases reads with its grants leased.
        let mut v1 = vec![1u8];
        State::Fresh.encode_into(&mut v1);
        v1.extend_from_slice(&[5, 1, 9, 3, 2, 4, 5]);
        let old = Counter::decode(limit(), &v1).unwrap();
        assert_eq!(old.shares.len(), 1);
        assert_eq!(old.outstanding(5, None), 4);
    }

    #[test]
    fn a_counter_never_lets_time_run_backwards() {
        let mut c = Counter::new(limit());
        assert!(c.take(limit(), NOW, 100).allowed);
        // A clock 30 s behind must not find the window fresher than it is.
        let d = c.take(limit(), NOW - 30 * SECOND, 1);
        assert!(!d.allowed);
        assert_eq!(c.last_seen, NOW);
        c.refund(limit(), NOW, NOW, 100);
        assert!(c.take(limit(), NOW, 1).allowed, "a refund gives the units back");
    }

    #[test]
    fn memory_is_bounded_by_max_counters() {
        let mut s = Store::new(10, 10 * SECOND);
        for i in 0..1000u64 {
            let d = Delta { key: i.to_le_bytes().to_vec(), limit: limit(), units: 1 };
            s.handle(NOW + i, &SyncRequest { node: 1, seq: i + 1, deltas: vec![d], ask: false }).unwrap();
        }
        assert_eq!(s.len(), 10);
    }
}
