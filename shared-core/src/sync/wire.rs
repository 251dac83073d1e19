//! The wire format: batches, asks and answers (`version | kind | varints`).

use super::auth::verify;
use super::counter::{Applied, SEQ_MEMORY};
use crate::algo::{Algorithm, Limit, Nanos, SECOND};
use crate::encoding::{put_varint, DecodeError, Reader};
use alloc::vec::Vec;

/// The protocol version byte. Version 2 requests carry the time they were made (`sent`);
/// version 1 ones did not, and are refused ([`SyncError::Version`]). A first byte that is no
/// version ever spoken (0, or above this one) is not a message of this protocol: malformed.
pub const VERSION: u8 = 2;
/// How far a request's `sent` may be from the store's clock, either way, before the store
/// refuses it ([`SyncError::Skewed`]). A store first applies a request no earlier than
/// `sent - MAX_REQUEST_SKEW` and remembers its `seq` for [`SEQ_MEMORY`] after that; a copy
/// replayed later than `sent + MAX_REQUEST_SKEW` is refused. Twice the bound is under the
/// memory, with 10 s to spare for the store's own clocks disagreeing (a store process, its
/// Redis primaries, the Worker's objects): every copy a store could still be made to apply is
/// one whose `seq` it still remembers.
pub const MAX_REQUEST_SKEW: Nanos = 25 * SECOND;
const _: () = assert!(2 * MAX_REQUEST_SKEW + 10 * SECOND <= SEQ_MEMORY);
const KIND_REQUEST: u8 = 1;
const KIND_RESPONSE: u8 = 2;
const KIND_ASK: u8 = 3;
/// Longest reason a store gives with a refusal (a [`SyncError`]'s text, plain): a node
/// reads a refusal of up to this many bytes, for its status and to quote it in a log line.
pub const MAX_REASON: usize = 512;
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
    /// When the node made the request (Unix ns, its own clock): a store refuses a request
    /// further than [`MAX_REQUEST_SKEW`] from its clock. A retry repeats the whole body, this
    /// included. 0 in a request not meant for a store (the filter's outboxes).
    pub sent: Nanos,
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

    /// The grant answering `key`'s delta when the store could not apply it (listed in
    /// [`SyncResponse::failed`]): zeros.
    pub fn unapplied(key: &[u8]) -> Grant {
        Grant { key: key.to_vec(), remaining: 0, grant: 0, reset_after: 0, lease: 0 }
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
    /// The deltas (their indices, ascending) the store could not apply because their
    /// counter's stored value is unreadable to it (written by a newer store, or damaged):
    /// nothing of them was counted, so their node sends their units again in a later batch.
    /// Their grants hold zeros. Only a batch's answer lists any ([`FAILED_SECTION`]).
    pub failed: Vec<u32>,
}

/// The marker of a batch answer's last, optional section: the deltas the store could not
/// apply ([`SyncResponse::failed`]). An answer with none has no section, and reads the same
/// to a node that predates it.
pub const FAILED_SECTION: u8 = 0x46;

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
    /// Signed, but made further than [`MAX_REQUEST_SKEW`] from the store's clock: a replay
    /// of a captured request, or a node whose clock is off. Nothing of it is applied.
    Skewed {
        /// The request's `sent`.
        sent: Nanos,
        /// The store's clock.
        now: Nanos,
    },
    /// Signed, but in an earlier protocol version, which this store no longer speaks
    /// (version 1: requests without a time). Any other first byte is [`SyncError::Malformed`].
    Version(u8),
    /// An ask the store has already answered (a node numbers each ask once: a copy is a
    /// replay of a captured one). Nothing of it is applied.
    Repeated {
        /// The ask's number.
        ask: u64,
    },
}

impl SyncError {
    /// The HTTP status every store answers this with (docs/sync-protocol.md, "HTTP").
    pub fn status(&self) -> u16 {
        match self {
            SyncError::Stale { .. } => 409,
            SyncError::Malformed(_) => 400,
            SyncError::Unauthorized => 401,
            SyncError::Skewed { .. } => 422,
            SyncError::Version(_) => 415,
            SyncError::Repeated { .. } => 409,
        }
    }
}

/// `ns` as seconds with milliseconds (`12.345`).
struct Secs(Nanos);

impl core::fmt::Display for Secs {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{}.{:03}", self.0 / SECOND, self.0 % SECOND / 1_000_000)
    }
}

impl core::fmt::Display for SyncError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            SyncError::Stale { last } => write!(f, "older than the node's latest batch (seq {last})"),
            SyncError::Malformed(e) => write!(f, "malformed message: {e}"),
            SyncError::Unauthorized => f.write_str("the signature does not match the body"),
            SyncError::Skewed { sent, now } => {
                let side = if sent > now { "ahead of" } else { "behind" };
                write!(
                    f,
                    "request time {} s is {} s {side} the store's clock ({} s), more than {} s: the node's \
                     clock is off, or the request is a replay; nothing was applied",
                    Secs(*sent),
                    Secs(sent.abs_diff(*now)),
                    Secs(*now),
                    MAX_REQUEST_SKEW / SECOND
                )
            }
            SyncError::Version(1) => write!(
                f,
                "sync protocol version 1 (requests without a time) is not spoken here: this store speaks \
                 version {VERSION}; upgrade the node"
            ),
            SyncError::Version(v) => {
                write!(f, "sync protocol version {v} is not spoken here: this store speaks version {VERSION}")
            }
            SyncError::Repeated { ask } => write!(
                f,
                "ask {ask} of this node was already answered (a node asks under each number once): a replay; \
                 nothing was applied"
            ),
        }
    }
}

impl core::error::Error for SyncError {}

pub(super) fn put_limit(out: &mut Vec<u8>, l: &Limit) {
    out.push(l.algorithm().code());
    put_varint(out, l.requests());
    put_varint(out, l.per());
    put_varint(out, l.capacity());
}

pub(super) fn read_limit(r: &mut Reader<'_>) -> Result<Limit, DecodeError> {
    let code = r.u8()?;
    // A concurrency limit counts one proxy's requests in flight: it is never synced.
    let algorithm = Algorithm::from_code(code)
        .filter(|a| *a != Algorithm::Concurrent)
        .ok_or(DecodeError::Invalid("limit algorithm"))?;
    let (requests, per, capacity) = (r.varint()?, r.varint()?, r.varint()?);
    // A window's capacity is its `requests`: any other is no limit a node applies.
    if !matches!(algorithm, Algorithm::TokenBucket | Algorithm::LeakyBucket) && capacity != requests {
        return Err(DecodeError::Invalid("limit (a window's capacity is its requests)"));
    }
    // A leaky bucket's `delay` does not travel: the store never says how long a request
    // waits.
    Limit::from_capacity(algorithm, requests, per, capacity)
        .map_err(|_| DecodeError::Invalid("limit (requests, per or burst)"))
}

pub(super) fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

pub(super) fn read_bytes(r: &mut Reader<'_>, max: usize) -> Result<Vec<u8>, DecodeError> {
    // Compared as read, so that a length past a 32-bit `usize` (the Worker's wasm32) is refused
    // with the same reason as on a 64-bit store.
    let n = r.varint()?;
    let n = usize::try_from(n).ok().filter(|n| *n <= max);
    let n = n.ok_or(DecodeError::Invalid("length (a key or name too long)"))?;
    Ok(r.take(n)?.to_vec())
}

/// Reads the version and a kind among `kinds`; returns the kind.
pub(super) fn read_header(r: &mut Reader<'_>, kinds: &[u8]) -> Result<u8, DecodeError> {
    let v = r.u8()?;
    if v != VERSION {
        return Err(DecodeError::Version(v));
    }
    let k = r.u8()?;
    if !kinds.contains(&k) {
        return Err(DecodeError::Invalid("message kind"));
    }
    Ok(k)
}

pub(super) fn read_count(r: &mut Reader<'_>) -> Result<usize, DecodeError> {
    let n = usize::try_from(r.varint()?).map_err(|_| DecodeError::Invalid("count (too many)"))?;
    if n > MAX_ENTRIES {
        return Err(DecodeError::Invalid("count (too many)"));
    }
    Ok(n)
}

impl SyncRequest {
    /// The wire encoding.
    pub fn encode(&self) -> Vec<u8> {
        SyncRequest::encode_parts(self.node, self.seq, self.sent, &self.deltas, self.ask)
    }

    /// The wire encoding of a request made of these parts (without building one).
    pub fn encode_parts(node: u64, seq: u64, sent: Nanos, deltas: &[Delta], ask: bool) -> Vec<u8> {
        let mut out = alloc::vec![VERSION, if ask { KIND_ASK } else { KIND_REQUEST }];
        put_varint(&mut out, node);
        put_varint(&mut out, seq);
        // The time goes in the head: what follows the deltas is left for optional sections.
        put_varint(&mut out, sent);
        put_varint(&mut out, deltas.len() as u64);
        for d in deltas {
            put_bytes(&mut out, &d.key);
            put_limit(&mut out, &d.limit);
            put_varint(&mut out, d.units);
        }
        out
    }

    /// Decodes the wire encoding; trailing bytes are an error, but for an optional
    /// [`TopSection`] (read by [`SyncRequest::decode_with_top`]).
    pub fn decode(bytes: &[u8]) -> Result<SyncRequest, DecodeError> {
        SyncRequest::decode_with_top(bytes).map(|(req, _)| req)
    }

    /// Decodes a request at the start of `bytes`: the request and where it ends (what
    /// follows is the caller's).
    pub fn decode_prefix(bytes: &[u8]) -> Result<(SyncRequest, usize), DecodeError> {
        let mut r = Reader { bytes, pos: 0 };
        let ask = read_header(&mut r, &[KIND_REQUEST, KIND_ASK])? == KIND_ASK;
        let (node, seq, sent) = (r.varint()?, r.varint()?, r.varint()?);
        let n = read_count(&mut r)?;
        let mut deltas = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            deltas.push(Delta { key: read_bytes(&mut r, MAX_KEY)?, limit: read_limit(&mut r)?, units: r.varint()? });
        }
        // One seq per node and counter: a counter named twice would have its second delta
        // taken for a repeat of the first, and its units lost.
        let mut keys: Vec<&[u8]> = deltas.iter().map(|d| d.key.as_slice()).collect();
        keys.sort_unstable();
        if keys.windows(2).any(|w| w.first() == w.get(1)) {
            return Err(DecodeError::Invalid("batch: a counter is named twice"));
        }
        Ok((SyncRequest { node, seq, sent, deltas, ask }, r.pos))
    }

    /// Decodes a request and its optional trailing [`TopSection`] (a batch's only: an ask
    /// carries none); any other trailing bytes are an error.
    pub fn decode_with_top(bytes: &[u8]) -> Result<(SyncRequest, Option<TopSection>), DecodeError> {
        let (req, end) = SyncRequest::decode_prefix(bytes)?;
        match bytes.get(end..) {
            None | Some([]) => Ok((req, None)),
            Some(_) if req.ask => Err(DecodeError::Invalid("ask: trailing bytes (an ask carries no top section)")),
            Some(rest) => Ok((req, Some(TopSection::decode(rest)?))),
        }
    }
}

/// The first byte of a batch's optional top-offenders section, after everything else.
pub const TOP_SECTION: u8 = 0x55;
/// The first byte of the section's first form, still read: its entries carry no count of
/// what reductions took (see [`crate::topk`]).
pub const TOP_SECTION_COUNTERS_ONLY: u8 = 0x54;
/// The most bytes a top section takes: a rule whose entries would not fit travels with its
/// counts only.
pub const MAX_TOP_SECTION: usize = 32 * 1024;

/// One rule's report in a batch's top section: what the node decided since its last batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleTop {
    /// The rule's name.
    pub rule: alloc::string::String,
    /// Units admitted.
    pub allowed: u64,
    /// Requests denied (enforcing).
    pub denied: u64,
    /// Requests a shadow rule would have denied.
    pub shadow_denied: u64,
    /// Its denied (and shadow-denied) keys, by their shown form
    /// ([`crate::topk::render`]; never a secret value).
    pub top: crate::topk::Summary,
}

/// The optional trailing section of a batch: per rule, its counts and top denied keys since
/// the node's last batch. Applied with the batch it ends (a repeated batch is not applied).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopSection {
    /// The rules that decided anything.
    pub rules: Vec<RuleTop>,
}

/// Longest rule name in a top section.
const MAX_RULE_NAME: usize = 64;

impl TopSection {
    /// Adds `other`'s counts and keys, rule by rule, each summary keeping its capacity: the
    /// section of both sections' time (a filter's batch that carried `other` was given up; a
    /// store merges what it heard in one second). A rule not here goes last while there are
    /// fewer than `max_rules`, its summary of at most `kept` keys (None: as it came).
    pub fn absorb(&mut self, other: &TopSection, (max_rules, kept): (usize, Option<usize>)) {
        for o in &other.rules {
            let full = self.rules.len() >= max_rules;
            match self.rules.iter_mut().find(|r| r.rule == o.rule) {
                Some(r) => {
                    r.allowed = r.allowed.saturating_add(o.allowed);
                    r.denied = r.denied.saturating_add(o.denied);
                    r.shadow_denied = r.shadow_denied.saturating_add(o.shadow_denied);
                    r.top.merge_keeping(&o.top);
                }
                None if full => {}
                None => {
                    let top = match kept {
                        Some(kept) => {
                            let mut top = crate::topk::Summary::new(kept);
                            top.merge_keeping(&o.top);
                            top
                        }
                        None => o.top.clone(),
                    };
                    self.rules.push(RuleTop { top, ..o.clone() });
                }
            }
        }
    }

    /// Appends `TOP_SECTION | count | per rule: name | allowed | denied | shadow_denied |
    /// summary`, at most [`MAX_TOP_SECTION`] bytes. Every rule's counts are given room first:
    /// a rule's entries go only where they leave room for the counts of the rules after it,
    /// else it goes with its counts only; rules whose counts alone are past the bytes (over a
    /// thousand rules) are left out.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let counts_only = |r: &RuleTop, body: &mut Vec<u8>| {
            put_bytes(body, r.rule.as_bytes().get(..r.rule.len().min(MAX_RULE_NAME)).unwrap_or_default());
            put_varint(body, r.allowed);
            put_varint(body, r.denied);
            put_varint(body, r.shadow_denied);
        };
        // The bytes each rule's counts take (with an empty summary), and those of the rules
        // after the one being encoded.
        let sizes: Vec<usize> = self
            .rules
            .iter()
            .map(|r| {
                let mut b = Vec::new();
                counts_only(r, &mut b);
                crate::topk::Summary::new(r.top.capacity()).encode(&mut b);
                b.len()
            })
            .collect();
        let mut rest: usize = sizes.iter().sum();
        let room = MAX_TOP_SECTION - 16;
        let mut body = Vec::new();
        let mut n = 0u64;
        for (r, size) in self.rules.iter().zip(&sizes) {
            let at = body.len();
            rest -= size;
            counts_only(r, &mut body);
            let counts = body.len();
            r.top.encode(&mut body);
            if body.len() + rest > room {
                body.truncate(counts);
                crate::topk::Summary::new(r.top.capacity()).encode(&mut body);
            }
            if body.len() > room {
                body.truncate(at);
                break;
            }
            n += 1;
        }
        out.push(TOP_SECTION);
        put_varint(out, n);
        out.extend_from_slice(&body);
    }

    /// Reads [`TopSection::encode_into`]'s form (the whole of `bytes`).
    pub fn decode(bytes: &[u8]) -> Result<TopSection, DecodeError> {
        if bytes.len() > MAX_TOP_SECTION {
            return Err(DecodeError::Invalid("top section (over 32 KiB)"));
        }
        let mut r = Reader { bytes, pos: 0 };
        let marker = r.u8()?;
        let taken = match marker {
            TOP_SECTION => true,
            TOP_SECTION_COUNTERS_ONLY => false,
            _ => return Err(DecodeError::Tag(marker)),
        };
        let n = read_count(&mut r)?;
        let mut rules = Vec::with_capacity(n.min(64));
        for _ in 0..n {
            let name = read_bytes(&mut r, MAX_RULE_NAME)?;
            let rule =
                alloc::string::String::from_utf8(name).map_err(|_| DecodeError::Invalid("rule name (not UTF-8)"))?;
            let (allowed, denied, shadow_denied) = (r.varint()?, r.varint()?, r.varint()?);
            let top = if taken {
                crate::topk::Summary::decode(&mut r, crate::topk::MAX_KEY)?
            } else {
                crate::topk::Summary::decode_counters_only(&mut r, crate::topk::MAX_KEY)?
            };
            rules.push(RuleTop { rule, allowed, denied, shadow_denied, top });
        }
        if r.pos != bytes.len() {
            return Err(DecodeError::Invalid("top section (trailing bytes)"));
        }
        Ok(TopSection { rules })
    }
}

impl SyncRequest {
    /// What a store does with a call before anything else: checks the signature (`tag`, the
    /// raw HMAC), the version ([`SyncError::Version`] for an earlier one), the encoding, and — when `now` is the
    /// store's clock — that the request was made within [`MAX_REQUEST_SKEW`] of it. `None`
    /// leaves the time to the caller (ratewall-store checks it at Redis's clock).
    pub fn verified(secret: &[u8], body: &[u8], tag: &[u8], now: Option<Nanos>) -> Result<SyncRequest, SyncError> {
        if !verify(secret, body, tag) {
            return Err(SyncError::Unauthorized);
        }
        let req = SyncRequest::decode(body).map_err(|e| match e {
            // Only a version that once existed is a version; any other first byte (text,
            // JSON, a version not yet spoken) is not a message of this protocol.
            DecodeError::Version(v) if (1..VERSION).contains(&v) => SyncError::Version(v),
            e => SyncError::Malformed(e),
        })?;
        if let Some(now) = now {
            req.check_time(now)?;
        }
        Ok(req)
    }

    /// [`SyncError::Skewed`] unless the request was made within [`MAX_REQUEST_SKEW`] of the
    /// store's clock `now`.
    pub fn check_time(&self, now: Nanos) -> Result<(), SyncError> {
        if self.sent.abs_diff(now) > MAX_REQUEST_SKEW {
            return Err(SyncError::Skewed { sent: self.sent, now });
        }
        Ok(())
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
        if !self.failed.is_empty() {
            out.push(FAILED_SECTION);
            put_varint(&mut out, self.failed.len() as u64);
            for i in &self.failed {
                put_varint(&mut out, u64::from(*i));
            }
        }
        out
    }

    /// The longest valid answer to a request for counters with keys of these lengths — the
    /// encoded response, or a store's refusal reason (at most [`MAX_REASON`] bytes): a node
    /// refuses a longer one before reading (or authenticating) it.
    pub fn max_len(key_lens: impl Iterator<Item = usize>) -> usize {
        // version, kind, seq, now, nodes, count; then per grant its key (length varint and
        // bytes) and four varints of at most 10 bytes each. A failed section fits in it too:
        // a failed delta's grant holds zeros, 36 bytes under the most a grant may take, more
        // than the section's marker, count and index need (11 bytes for the first, 5 more for
        // each other), so nodes of every version accept every answer of this length.
        key_lens.fold(2 + 10 + 10 + 5 + 10, |n: usize, k| n.saturating_add(k.saturating_add(3 + 40))).max(MAX_REASON)
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
        let mut failed = Vec::new();
        if bytes.get(r.pos) == Some(&FAILED_SECTION) {
            r.pos += 1;
            let m = read_count(&mut r)?;
            for _ in 0..m {
                let i = u32::try_from(r.varint()?).map_err(|_| DecodeError::Invalid("failed delta index"))?;
                // Ascending, and naming a grant.
                if failed.last().is_some_and(|l| *l >= i) || i as usize >= grants.len() {
                    return Err(DecodeError::Invalid("failed delta index"));
                }
                failed.push(i);
            }
        }
        if r.pos != bytes.len() {
            return Err(DecodeError::Invalid("answer (trailing bytes)"));
        }
        Ok(SyncResponse { seq, now, nodes, grants, failed })
    }
}
