//! Who is being limited: a bounded, mergeable heavy-hitters summary of denials (Misra-Gries),
//! a distinct-key estimate, and the readable identity of a counter key (`api_key=#3f9a1c2e`).
//!
//! [`Summary`] keeps at most its capacity `k` of keys whatever the traffic. For a stream of
//! total weight `N` (merged summaries: the sum of theirs), each listed count is a lower bound
//! of the key's true count and at most [`Summary::error`] below it, and `error ≤ N / (k + 1)`:
//! every key with more than `N / (k + 1)` is listed. Merging is a pure function, the same
//! whichever summary is merged into which.
//!
//! The listed count is the weight added while the key was listed: the Misra-Gries counter
//! (which decides evictions) plus what the reductions took from it. So a key listed since its
//! first denial, as a heavy hitter soon is, shows its exact count, not one lowered by every
//! reduction; the bound above still holds, since the counter alone satisfies it.

use crate::encoding::{put_varint, DecodeError, Reader};
use crate::eval::{HASHED_PART, KEY_VERSION};
use crate::key::{push_hashed, push_value};
use crate::rules::Config;
use alloc::string::String;
use alloc::vec::Vec;

/// Keys a rule's summary keeps (per proxy, per store window).
pub const CAPACITY: usize = 64;
/// Most entries a decoded summary may have.
pub const MAX_CAPACITY: usize = 1024;
/// Longest shown key a summary keeps: a longer one is cut and ends in `…#hash` (see
/// [`bounded_key`]).
pub const MAX_KEY: usize = 160;

/// One listed key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The key (a counter key, or its shown form).
    pub key: Vec<u8>,
    /// Denials counted for it while listed: at most [`Summary::error`] below its true count.
    pub denied: u64,
    /// Its Misra-Gries counter (at most `denied`): what decides which key is dropped.
    pub weight: u64,
    /// Units admitted for it while listed (side information, not part of the bound).
    pub allowed: u64,
    /// Nodes that reported it, as bits of a 64-bit set ([`node_bit`]).
    pub nodes: u64,
}

/// A bounded Misra-Gries summary of weighted keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    capacity: usize,
    /// Sorted by key.
    entries: Vec<Entry>,
    /// Total weight added.
    total: u64,
    /// Weight subtracted from every listed counter so far: the error bound.
    offset: u64,
    /// Keys dropped to keep the bound.
    evictions: u64,
}

impl Default for Summary {
    fn default() -> Self {
        Summary::new(CAPACITY)
    }
}

/// The bit of a 64-bit node set that stands for `node`.
pub fn node_bit(node: u64) -> u64 {
    1 << (crate::hash::fnv1a(&node.to_le_bytes()) % 64)
}

/// Nodes in a node set (a linear-counting estimate: exact while nodes are few).
pub fn node_count(set: u64) -> u64 {
    estimate(u64::from(set.count_ones()), 64)
}

/// Linear counting: distinct items that set `ones` of `bits` bits.
fn estimate(ones: u64, bits: u64) -> u64 {
    if ones == 0 {
        return 0;
    }
    let zeros = bits.saturating_sub(ones).max(1) as f64;
    // -bits · ln(zeros / bits), through log2 (no_std has no `ln`): ln x = log2 x · ln 2.
    let ratio = zeros / bits as f64;
    let est = -(bits as f64) * log2(ratio) * core::f64::consts::LN_2;
    (est + 0.5) as u64
}

/// log2 of a positive finite `x`, to about 1e-9 (no_std has no float math).
fn log2(x: f64) -> f64 {
    let bits = x.to_bits();
    let exp = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mantissa = f64::from_bits((bits & ((1 << 52) - 1)) | (1023 << 52)); // in [1, 2)
                                                                            // ln(m) by the series of atanh: ln m = 2 atanh((m-1)/(m+1)).
    let t = (mantissa - 1.0) / (mantissa + 1.0);
    let (t2, mut term, mut sum) = (t * t, t, 0.0);
    let mut n = 1.0;
    while n < 40.0 {
        sum += term / n;
        term *= t2;
        n += 2.0;
    }
    exp as f64 + 2.0 * sum / core::f64::consts::LN_2
}

impl Summary {
    /// An empty summary keeping at most `capacity` keys (1 to [`MAX_CAPACITY`]).
    pub fn new(capacity: usize) -> Summary {
        Summary { capacity: capacity.clamp(1, MAX_CAPACITY), entries: Vec::new(), total: 0, offset: 0, evictions: 0 }
    }

    /// Keys it keeps at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Total weight added (denials).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// How far below a key's true count its listed count may be (a key not listed counted at
    /// most this): at most `total / (capacity + 1)`.
    pub fn error(&self) -> u64 {
        self.offset
    }

    /// Keys dropped to keep the summary bounded.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.total == 0 && self.entries.is_empty()
    }

    /// The listed keys, in key order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The listed count of `key` (0: not listed).
    pub fn count(&self, key: &[u8]) -> u64 {
        self.find(key).ok().and_then(|i| self.entries.get(i)).map_or(0, |e| e.denied)
    }

    fn find(&self, key: &[u8]) -> Result<usize, usize> {
        self.entries.binary_search_by(|e| e.key.as_slice().cmp(key))
    }

    /// Adds `denied` denials and `allowed` admitted units of `key`, seen by the nodes in
    /// `nodes`.
    pub fn add(&mut self, key: &[u8], denied: u64, allowed: u64, nodes: u64) {
        self.total = self.total.saturating_add(denied);
        match self.find(key) {
            Ok(i) => {
                if let Some(e) = self.entries.get_mut(i) {
                    e.denied = e.denied.saturating_add(denied);
                    e.weight = e.weight.saturating_add(denied);
                    e.allowed = e.allowed.saturating_add(allowed);
                    e.nodes |= nodes;
                }
            }
            Err(i) => {
                if denied == 0 {
                    // Admitted units alone do not list a key.
                    return;
                }
                self.entries.insert(i, Entry { key: key.to_vec(), denied, weight: denied, allowed, nodes });
                self.reduce();
            }
        }
    }

    /// Adds `allowed` admitted units of `key` seen by the nodes in `nodes`, for a key the
    /// fleet may list though these nodes did not deny it: a listed key's entry takes them, and
    /// a key not listed gets an entry of admitted units only (no denial, no count: it is never
    /// listed on its own, and the first reduction drops it) while there is room.
    pub fn add_admitted(&mut self, key: &[u8], allowed: u64, nodes: u64) {
        match self.find(key) {
            Ok(i) => {
                if let Some(e) = self.entries.get_mut(i) {
                    e.allowed = e.allowed.saturating_add(allowed);
                    e.nodes |= nodes;
                }
            }
            Err(i) if self.entries.len() < self.capacity && allowed > 0 => {
                self.entries.insert(i, Entry { key: key.to_vec(), denied: 0, weight: 0, allowed, nodes });
            }
            Err(_) => {}
        }
    }

    /// Adds `other` (the summary of another part of the stream): the result is the summary
    /// of both parts, with an error of at most the sum of both plus what this adds.
    pub fn merge(&mut self, other: &Summary) {
        self.merge_within(other, self.capacity.max(other.capacity));
    }

    /// [`Summary::merge`], keeping this summary's capacity: a small bounded summary takes in
    /// a larger transient one (a tick's worth of denials) without growing.
    pub fn merge_keeping(&mut self, other: &Summary) {
        self.merge_within(other, self.capacity);
    }

    fn merge_within(&mut self, other: &Summary, capacity: usize) {
        let mut merged = Vec::with_capacity(self.entries.len() + other.entries.len());
        let (mut a, mut b) =
            (core::mem::take(&mut self.entries).into_iter().peekable(), other.entries.iter().peekable());
        loop {
            let next = match (a.peek(), b.peek()) {
                (Some(x), Some(y)) => x.key.as_slice().cmp(&y.key),
                (Some(_), None) => core::cmp::Ordering::Less,
                (None, Some(_)) => core::cmp::Ordering::Greater,
                (None, None) => break,
            };
            match next {
                core::cmp::Ordering::Less => merged.extend(a.next()),
                core::cmp::Ordering::Greater => merged.extend(b.next().cloned()),
                core::cmp::Ordering::Equal => {
                    if let (Some(mut x), Some(y)) = (a.next(), b.next()) {
                        x.denied = x.denied.saturating_add(y.denied);
                        x.weight = x.weight.saturating_add(y.weight);
                        x.allowed = x.allowed.saturating_add(y.allowed);
                        x.nodes |= y.nodes;
                        merged.push(x);
                    }
                }
            }
        }
        self.entries = merged;
        self.capacity = capacity;
        self.total = self.total.saturating_add(other.total);
        self.offset = self.offset.saturating_add(other.offset);
        self.evictions = self.evictions.saturating_add(other.evictions);
        self.reduce();
    }

    /// Keeps at most `capacity` keys: past it, the `(capacity + 1)`-th largest count is taken
    /// off every key and those left with none are dropped (each such step takes that much from
    /// `capacity + 1` keys at least, which bounds the error).
    fn reduce(&mut self) {
        if self.entries.len() <= self.capacity {
            return;
        }
        let mut counts: Vec<u64> = self.entries.iter().map(|e| e.weight).collect();
        let cut = match counts.get(self.capacity) {
            Some(_) => *counts.select_nth_unstable_by(self.capacity, |x, y| y.cmp(x)).1,
            None => 0,
        };
        // Entries of admitted units only go too, and are no evictions: they listed no key.
        let before = self.entries.iter().filter(|e| e.weight > 0).count();
        for e in &mut self.entries {
            e.weight = e.weight.saturating_sub(cut);
        }
        self.entries.retain(|e| e.weight > 0);
        self.offset = self.offset.saturating_add(cut);
        self.evictions = self.evictions.saturating_add((before - self.entries.len()) as u64);
    }

    /// The `n` most denied keys, most first (ties: by key); entries of admitted units only
    /// are not among them.
    pub fn top(&self, n: usize) -> Vec<&Entry> {
        let mut v: Vec<&Entry> = self.entries.iter().filter(|e| e.denied > 0).collect();
        v.sort_by(|x, y| y.denied.cmp(&x.denied).then_with(|| x.key.cmp(&y.key)));
        v.truncate(n);
        v
    }

    /// Appends the encoding: capacity, total, error, evictions, then the entries (key,
    /// denied, allowed, nodes, and how far the counter is below `denied`).
    pub fn encode(&self, out: &mut Vec<u8>) {
        put_varint(out, self.capacity as u64);
        put_varint(out, self.total);
        put_varint(out, self.offset);
        put_varint(out, self.evictions);
        put_varint(out, self.entries.len() as u64);
        for e in &self.entries {
            put_varint(out, e.key.len() as u64);
            out.extend_from_slice(&e.key);
            put_varint(out, e.denied);
            put_varint(out, e.allowed);
            out.extend_from_slice(&e.nodes.to_le_bytes());
            put_varint(out, e.denied.saturating_sub(e.weight));
        }
    }

    /// Reads [`Summary::encode`]'s form, keys at most `max_key` bytes each.
    pub fn decode(r: &mut Reader<'_>, max_key: usize) -> Result<Summary, DecodeError> {
        Summary::decode_form(r, max_key, true)
    }

    /// Reads the first form of the encoding, whose entries end at their nodes (every listed
    /// count then is its counter).
    pub fn decode_counters_only(r: &mut Reader<'_>, max_key: usize) -> Result<Summary, DecodeError> {
        Summary::decode_form(r, max_key, false)
    }

    fn decode_form(r: &mut Reader<'_>, max_key: usize, taken: bool) -> Result<Summary, DecodeError> {
        let capacity = usize::try_from(r.varint()?).map_err(|_| DecodeError::Invalid("summary capacity"))?;
        if !(1..=MAX_CAPACITY).contains(&capacity) {
            return Err(DecodeError::Invalid("summary capacity"));
        }
        let (total, offset, evictions) = (r.varint()?, r.varint()?, r.varint()?);
        let n =
            usize::try_from(r.varint()?).map_err(|_| DecodeError::Invalid("summary entries (over its capacity)"))?;
        if n > capacity {
            return Err(DecodeError::Invalid("summary entries (over its capacity)"));
        }
        let mut entries: Vec<Entry> = Vec::with_capacity(n);
        for _ in 0..n {
            let len = usize::try_from(r.varint()?).map_err(|_| DecodeError::Invalid("summary key (too long)"))?;
            if len > max_key {
                return Err(DecodeError::Invalid("summary key (too long)"));
            }
            let key = r.take(len)?.to_vec();
            let (denied, allowed) = (r.varint()?, r.varint()?);
            let mut nodes = [0u8; 8];
            nodes.copy_from_slice(r.take(8)?);
            let taken = if taken { r.varint()? } else { 0 };
            // Sorted and distinct, as encoded, with a counter above 0, or an entry of admitted
            // units only (no denial, nothing taken): anything else is not this encoding.
            let weight = match (denied, taken) {
                (0, 0) => 0,
                _ => denied
                    .checked_sub(taken)
                    .filter(|w| *w > 0)
                    .ok_or(DecodeError::Invalid("summary entry (no count left)"))?,
            };
            if entries.last().is_some_and(|l| l.key >= key) {
                return Err(DecodeError::Invalid("summary entries (not in key order)"));
            }
            entries.push(Entry { key, denied, weight, allowed, nodes: u64::from_le_bytes(nodes) });
        }
        Ok(Summary { capacity, entries, total, offset, evictions })
    }

    /// Every listed key mapped through `f` (keys that map to one are merged): a summary of
    /// counter keys becomes one of shown keys.
    pub fn map_keys(&self, mut f: impl FnMut(&[u8]) -> Option<Vec<u8>>) -> Summary {
        let mut out = Summary { entries: Vec::new(), ..self.clone() };
        for e in &self.entries {
            let Some(key) = f(&e.key) else { continue };
            match out.find(&key) {
                Ok(i) => {
                    if let Some(o) = out.entries.get_mut(i) {
                        o.denied = o.denied.saturating_add(e.denied);
                        o.weight = o.weight.saturating_add(e.weight);
                        o.allowed = o.allowed.saturating_add(e.allowed);
                        o.nodes |= e.nodes;
                    }
                }
                Err(i) => out.entries.insert(i, Entry { key, ..e.clone() }),
            }
        }
        out
    }

    /// Halves every key's Misra-Gries counter (at least 1 stays: no key is dropped), keeping
    /// the listed counts: a summary that runs on across intervals lets keys that were heavy
    /// long ago give way to new ones twice as fast each interval.
    pub fn halve_weights(&mut self) {
        for e in self.entries.iter_mut().filter(|e| e.weight > 0) {
            e.weight = (e.weight / 2).max(1);
        }
    }

    /// Sets a listed key's admitted units (keys not listed are not added).
    pub fn set_allowed(&mut self, key: &[u8], allowed: u64) {
        if let Ok(i) = self.find(key) {
            if let Some(e) = self.entries.get_mut(i) {
                e.allowed = allowed;
            }
        }
    }
}

/// Bits of a [`Distinct`] estimate.
pub const DISTINCT_BITS: usize = 1024;

/// Distinct keys seen, estimated by linear counting over [`DISTINCT_BITS`] bits (128 bytes;
/// within a few percent up to about a thousand keys, saturating near 7,000).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Distinct(pub [u64; DISTINCT_BITS / 64]);

impl Default for Distinct {
    fn default() -> Self {
        Distinct([0; DISTINCT_BITS / 64])
    }
}

impl Distinct {
    /// Notes a key by its hash.
    pub fn add(&mut self, hash: u64) {
        let bit = (hash >> 54) as usize; // the top 10 bits
        if let Some(w) = self.0.get_mut(bit / 64) {
            *w |= 1 << (bit % 64);
        }
    }

    /// Both sets.
    pub fn merge(&mut self, other: &Distinct) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a |= b;
        }
    }

    /// The estimated number of distinct keys.
    pub fn estimate(&self) -> u64 {
        let ones: u64 = self.0.iter().map(|w| u64::from(w.count_ones())).sum();
        estimate(ones, DISTINCT_BITS as u64)
    }
}

/// The readable identity of a counter key ([`crate::eval::Check::key`]): the rule's index and
/// its key's `dim=value` pairs in the rule's key order, comma-separated
/// (`api_key=#3f9a1c2e,ip=203.0.113.7`). A secret value (or one too long to keep whole) is in
/// the key only as its keyed hash, shown as `#` and 8 hex digits; other values are shown with
/// [`push_value`]'s escapes. `None` for a key of no rule of `config`.
pub fn render(config: &Config, key: &[u8]) -> Option<(usize, String)> {
    let mut r = Reader { bytes: key, pos: 0 };
    if r.u8().ok()? != KEY_VERSION {
        return None;
    }
    let name_len = usize::from(r.u8().ok()?);
    let name = r.take(name_len).ok()?;
    let index = config.rules.iter().position(|rule| rule.name.as_bytes() == name)?;
    let rule = config.rules.get(index)?;
    r.take(8).ok()?; // the limit's fingerprint
    let mut out = String::with_capacity(32);
    for (i, dim) in rule.key.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(config.identity.name(*dim));
        out.push('=');
        match r.u8().ok()? {
            HASHED_PART => {
                let mut h = [0u8; 8];
                h.copy_from_slice(r.take(8).ok()?);
                push_hashed(&mut out, u64::from_le_bytes(h));
            }
            n => push_value(&mut out, r.take(usize::from(n)).ok()?),
        }
    }
    (r.pos == key.len()).then_some((index, out))
}

/// `shown` cut to [`MAX_KEY`] bytes when longer: its first bytes, then `…` and the hash of the
/// whole under `hash` (so two long keys stay apart).
pub fn bounded_key(shown: String, hash: &crate::key::HashKey) -> String {
    if shown.len() <= MAX_KEY {
        return shown;
    }
    let mut cut = MAX_KEY - 12;
    while !shown.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut out = String::with_capacity(MAX_KEY);
    out.push_str(shown.get(..cut).unwrap_or(""));
    out.push('…');
    push_hashed(&mut out, hash.hash(shown.as_bytes()));
    out
}

/// Keys [`Admitted`] keeps per rule.
pub const ADMITTED_KEYS: usize = 64;
/// How long (s) units admitted for a key not listed yet are kept for it: a window of the
/// store's shortest view (the last minute).
pub const ADMITTED_FOR_S: u64 = 60;

/// What `units` last added to at unix second `at` weigh at `now`: themselves, none once let
/// go ([`ADMITTED_FOR_S`] later).
fn kept(units: u64, at: u64, now: u64) -> u64 {
    if now.saturating_sub(at) > ADMITTED_FOR_S {
        0
    } else {
        units
    }
}

/// Units admitted for keys a rule's summary does not list yet, kept so that a key's first
/// denial brings them with it: its entry's `allowed` then counts what the client was
/// admitted before it was first denied, not only after. Bounded: at most
/// [`ADMITTED_KEYS`] keys, a new one past them taking the place of the one with the fewest
/// units (or the oldest) when it brings more; units older than [`ADMITTED_FOR_S`] are let go.
#[derive(Clone, Debug, Default)]
pub struct Admitted {
    /// (key, units, unix second of the last units); a list, as it is short.
    entries: Vec<(Vec<u8>, u64, u64)>,
}

impl Admitted {
    /// Notes `units` admitted for `key` at unix second `now`.
    pub fn note(&mut self, key: &[u8], units: u64, now: u64) {
        if units == 0 {
            return;
        }
        let weight = |u: u64, at: u64| kept(u, at, now);
        if let Some((_, u, at)) = self.entries.iter_mut().find(|(k, _, _)| k.as_slice() == key) {
            *u = weight(*u, *at).saturating_add(units);
            *at = (*at).max(now);
            return;
        }
        if self.entries.len() >= ADMITTED_KEYS {
            let least = self.entries.iter().enumerate().min_by_key(|(_, (_, u, at))| weight(*u, *at));
            match least.map(|(i, (_, u, at))| (i, weight(*u, *at))) {
                Some((i, w)) if w < units => {
                    self.entries.swap_remove(i);
                }
                _ => return,
            }
        }
        self.entries.push((key.to_vec(), units, now));
    }

    /// The units kept for `key` (those of the last [`ADMITTED_FOR_S`] at unix second `now`),
    /// taken out.
    pub fn take(&mut self, key: &[u8], now: u64) -> u64 {
        let Some(i) = self.entries.iter().position(|(k, _, _)| k.as_slice() == key) else { return 0 };
        let (_, u, at) = self.entries.swap_remove(i);
        kept(u, at, now)
    }

    /// The units kept (those of the last [`ADMITTED_FOR_S`] at unix second `now`) of every
    /// key `pick` takes, taken out.
    pub fn take_where(&mut self, now: u64, mut pick: impl FnMut(&[u8]) -> bool) -> Vec<(Vec<u8>, u64)> {
        let mut taken = Vec::new();
        self.entries.retain(|(k, u, at)| {
            if !pick(k) {
                return true;
            }
            let units = kept(*u, *at, now);
            if units > 0 {
                taken.push((k.clone(), units));
            }
            false
        });
        taken
    }

    /// Keys kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Keys (their [`crate::key::fnv1a`]) noted lately, each with when it was last noted: one
/// noted `span` or longer ago is no longer held, and past `cap` the oldest go. Time is in the
/// caller's unit (`span`, `at` and `now` alike). A node notes the counters it found at their
/// limit, whose admitted units its reports then carry at once (another node may be the one
/// denying the client).
#[derive(Clone, Debug)]
pub struct Lately {
    span: u64,
    cap: usize,
    /// (hash, when last noted), oldest first.
    entries: Vec<(u64, u64)>,
}

impl Lately {
    /// Empty, holding a key for `span` after it was noted, at most `cap` keys.
    pub fn new(span: u64, cap: usize) -> Lately {
        Lately { span, cap, entries: Vec::new() }
    }

    /// Notes `hashes` at `at`.
    pub fn note(&mut self, hashes: &[u64], at: u64) {
        let span = self.span;
        self.entries.retain(|(h, t)| at.saturating_sub(*t) < span && !hashes.contains(h));
        self.entries.extend(hashes.iter().map(|h| (*h, at)));
        let over = self.entries.len().saturating_sub(self.cap);
        self.entries.drain(..over);
    }

    /// Whether `hash` was noted within `span` before `now`.
    pub fn holds(&self, hash: u64, now: u64) -> bool {
        self.entries.iter().any(|(h, t)| *h == hash && now.saturating_sub(*t) < self.span)
    }

    /// The keys noted within `span` before `now`, sorted.
    pub fn held(&self, now: u64) -> Vec<u64> {
        let mut v: Vec<u64> =
            self.entries.iter().filter(|(_, t)| now.saturating_sub(*t) < self.span).map(|(h, _)| *h).collect();
        v.sort_unstable();
        v
    }
}

#[cfg(feature = "admin")]
pub mod windows;

#[cfg(test)]
mod tests;
