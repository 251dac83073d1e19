//! The node's counter table in proxy-wasm shared data: a fixed number of buckets, each one
//! shared-data key holding up to [`WAYS`] entries, so memory stays bounded whatever the
//! number of distinct clients.
//!
//! Shared data has no delete and Envoy never frees a key, so the filter never creates a key
//! per client. A (rule, key) hashes (SipHash-1-3, keyed by `filter.hash_seed`) to a bucket
//! and a 48-bit fingerprint (with 8 entries per bucket a false match is about 8 in 2^48). A
//! bucket value is
//! `version (1) | n (1) | n × (fingerprint u48 | idle_at_secs u32 | usage u8 | state)`: 21
//! bytes per token-bucket entry and 29 per sliding-window entry.
//!
//! Eviction: a new key takes the slot of an entry that is idle (its state is equivalent to
//! fresh, so forgetting it grants nothing); when none is idle, the active entry that had
//! used the least of its quota when last written, then the one idle soonest. A flood of
//! one-request keys therefore evicts the flood first: evicting a client that is currently
//! limited needs every other entry of its bucket to be limited too, which costs an attacker
//! a full quota on each of [`WAYS`] keys that land in that bucket, and finding such keys
//! needs the secret hash seed.
//!
//! Creation: on Envoy a missing key reads as NotFound and a set with `cas = 0` is
//! unconditional, so a first insert is not protected. Every bucket key is therefore created
//! (empty) before the VM counts its first request (by that request, or the first tick), and
//! request-path writes only ever use a CAS value they have read. ngx_wasm_module reads
//! `cas = 0` as "only if absent": there a VM that loses the creation race to another finds
//! the key created, which is all it wanted.

use crate::host::{Host, SetError};
use ratewall_core::algo::{Nanos, State, SECOND};
use ratewall_core::encoding::{put_varint, DecodeError, Reader};
use ratewall_core::eval::{Check, Counters, StoreError};
use siphasher::sip::SipHasher13;
use std::cell::RefCell;
use std::hash::Hasher;

/// Entries per bucket.
pub const WAYS: usize = 8;
const VERSION: u8 = 1;
const VERSION_GRANTS: u8 = 2;
/// Entries carry a grant and a leaky bucket's [`Departures`].
const VERSION_QUEUE: u8 = 3;
/// Entries carry a grant with its overdraft and traffic share.
const VERSION_OVER: u8 = 4;
/// Entries carry a grant with its overdraft and traffic share, and a leaky bucket's
/// [`Departures`].
const VERSION_OVER_QUEUE: u8 = 5;
/// Entries carry a grant with its overdraft, traffic share and units not yet reported.
const VERSION_UNREPORTED: u8 = 6;
/// Entries carry a grant with its overdraft, traffic share and units not yet reported, and a
/// leaky bucket's [`Departures`].
const VERSION_UNREPORTED_QUEUE: u8 = 7;
/// Entries carry a grant with its overdraft, traffic share, units not yet reported and the
/// [`Flow`] a bucket's share is measured on.
const VERSION_FLOW: u8 = 8;
/// As [`VERSION_FLOW`], and a leaky bucket's [`Departures`].
const VERSION_FLOW_QUEUE: u8 = 9;
/// Versions kept for later encodings of a bucket: one of them is a newer VM's, which this
/// one leaves as it is (any other that does not decode is reset).
const NEWER_VERSIONS: core::ops::RangeInclusive<u8> = 10..=31;
/// The most departures a leaky bucket's entry remembers: a waiter that leaves while the log
/// is full leaves its turn empty rather than let later arrivals take turns already held.
pub const DEPARTURES: usize = 4;
/// Bytes of an entry before its state.
const HEAD: usize = 11;
/// Fingerprints keep their low 48 bits.
const FINGERPRINT_MASK: u64 = (1 << 48) - 1;
const MS: Nanos = 1_000_000;

/// Where a (rule, key) lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Bucket index.
    pub bucket: u32,
    /// Fingerprint within the bucket (48 bits).
    pub fingerprint: u64,
}

/// One tracked (rule, key).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Fingerprint of the (rule, key) (48 bits).
    pub fingerprint: u64,
    /// Whole seconds since the epoch from which the state equals fresh.
    pub idle_at: u32,
    /// Share of the quota used when last written, 0..=255.
    pub usage: u8,
    /// The limiter state.
    pub state: State,
    /// What the global store lets this node admit before its next sync (None: the store has
    /// not answered for this counter).
    pub grant: Option<Allowance>,
    /// A leaky bucket's waiters that left before their turn.
    pub queue: Departures,
    /// What a token or leaky bucket's share is measured on, kept with a grant (none without
    /// one). Apart from the grant, which every request copies through its update: 40 bytes
    /// more there cost 4 % more guest instructions per request.
    pub flow: Flow,
}

/// The waiters of a leaky bucket that left before their turn, newest last: each moves every
/// waiter behind it up by its `shift`. A waiter admitted when the count was `seq` applies
/// the departures numbered after it, in order, to the turn it was given ([`Departures::turn`]),
/// so the queue closes up across every VM of the node and no two waiters share a turn.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Departures {
    /// Departures so far (wrapping); the last of `gone` is number `seq`.
    pub seq: u32,
    /// (the turn it left, how far the waiters behind it move up), oldest first.
    pub gone: Vec<(Nanos, Nanos)>,
}

impl Departures {
    /// The turn now of a waiter given `turn` when the count was `seq`.
    pub fn turn(&self, mut turn: Nanos, seq: u32) -> Nanos {
        let n = self.gone.len() as u32;
        for (i, (left, shift)) in self.gone.iter().enumerate() {
            // The number of the i-th departure, compared with wrapping.
            let number = self.seq.wrapping_sub(n - 1 - i as u32);
            if (number.wrapping_sub(seq) as i32) > 0 && *left < turn {
                turn = turn.saturating_sub(*shift);
            }
        }
        turn
    }

    /// Records a waiter leaving `turn` (a departure moving those behind by `shift`), first
    /// forgetting departures that left before `horizon` (no waiter admitted before them can
    /// still wait). False when the log is full: the turn stays empty instead.
    pub fn leave(&mut self, turn: Nanos, shift: Nanos, horizon: Nanos) -> bool {
        self.gone.retain(|(left, _)| *left >= horizon);
        if self.gone.len() >= DEPARTURES {
            return false;
        }
        self.gone.push((turn, shift));
        self.seq = self.seq.wrapping_add(1);
        true
    }

    fn is_empty(&self) -> bool {
        self.seq == 0 && self.gone.is_empty()
    }

    fn put(&self, out: &mut Vec<u8>) {
        put_varint(out, u64::from(self.seq));
        put_varint(out, self.gone.len().min(DEPARTURES) as u64);
        for (left, shift) in self.gone.iter().take(DEPARTURES) {
            put_varint(out, *left);
            put_varint(out, *shift);
        }
    }

    fn read(r: &mut Reader<'_>) -> Result<Departures, DecodeError> {
        let seq = u32::try_from(r.varint()?).unwrap_or(0);
        let n = r.varint()?;
        if n > DEPARTURES as u64 {
            return Err(DecodeError::Truncated);
        }
        let mut gone = Vec::with_capacity(n as usize);
        for _ in 0..n {
            gone.push((r.varint()?, r.varint()?));
        }
        Ok(Departures { seq, gone })
    }
}

/// A node's grant on one counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allowance {
    /// Units left to admit.
    pub units: u32,
    /// Whether the store had quota beyond this grant when it last answered: a request the
    /// spent grant denies may then *ask* the store (docs/sync-protocol.md).
    pub more: bool,
    /// The end of the grant's lease, in whole milliseconds of the store's clock (0: none);
    /// after it the grant is spent.
    pub until_ms: u64,
    /// The overdraft left: units a rule that is not exact may admit once `units` are spent,
    /// without waiting for the store, reported with the next batch like any others (the
    /// store counts them, so what it grants next is smaller by them). Set by each answer,
    /// not leased: an overdraft is not held at the store, only spent after the fact.
    pub over: u32,
    /// Whether the node has admitted on its overdraft since an answer last found room for it
    /// (a grant above 0): until one does, its overdraft is not repaid and it gets no other.
    pub overdrawn: bool,
    /// This node's share of the counter's traffic, in 65,535ths (0: not known yet), as its
    /// answers measured it: what an `open` rule admits locally while the store is out of
    /// reach (docs/sync-protocol.md, "Degraded mode").
    pub share: u16,
    /// Units admitted on the counter (not refunded) since the node's last batch answer for it.
    pub since: u32,
    /// Units the node had admitted that no batch had reported when that answer came (its
    /// estimate, see `sync::write_grants`).
    pub carry: u32,
}

/// The units a node reported on a bucket against those the fleet took from it, since the
/// last measurement of the node's share: a bucket's state cannot say it (its tokens come back
/// at the whole rate on every node). See `sync::bucket_share`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flow {
    /// When the store last answered a batch on the counter, in milliseconds of its clock (0:
    /// never).
    pub at_ms: u64,
    /// When the measurement began, in milliseconds of the store's clock.
    pub from_ms: u64,
    /// How long the store's bucket would take to be full again then (its `reset_after`).
    pub short_ns: u64,
    /// Units this node reported since the measurement began.
    pub own: u32,
    /// Units the fleet took since then, in [`Flow::ONE`]ths.
    pub all: u64,
}

impl Flow {
    /// A unit, in the fractions [`Flow::all`] counts (a tenth of a second
    /// of a bucket of 60 a minute is a tenth of a unit: counted in 16ths, it read as one
    /// sixteenth, and the fleet's units taken as a ninth fewer than they were).
    pub const ONE: u64 = 1 << 16;
}

impl Allowance {
    /// Units that may be admitted at `now` (the store's clock).
    pub fn units_at(&self, now: Nanos) -> u32 {
        if self.until_ms == 0 || now / MS < self.until_ms {
            self.units
        } else {
            0
        }
    }

    /// Whether the lease ended while the node was quiet on the counter — nothing admitted
    /// since the answer, none of its units found unreported then, no overdraft owed — and that
    /// answer showed at least half of `quota` free: the grant and the overdraft it allowed,
    /// which together never exceed what remained (`since` 0: the grant is as it was given).
    pub fn lapsed_quietly(&self, now: Nanos, quota: u64) -> bool {
        self.until_ms > 0
            && now / MS >= self.until_ms
            && self.since == 0
            && self.carry == 0
            && !self.overdrawn
            && u64::from(self.units).saturating_add(u64::from(self.over)).saturating_mul(2) >= quota
    }

    /// Writes the entry encoding: a varint, 0 for none, else
    /// `(units << 2 | more << 1 | leased) + 1`, then the lease end when leased, then (bucket
    /// version 4) the overdraft and the traffic share, then (version 6) the units admitted
    /// since the last answer and those it found unreported, then (version 8) the entry's
    /// [`Flow`].
    fn put(a: Option<Allowance>, flow: &Flow, out: &mut Vec<u8>) {
        let Some(a) = a else {
            put_varint(out, 0);
            return;
        };
        let leased = a.until_ms > 0;
        put_varint(out, ((u64::from(a.units) << 2) | (u64::from(a.more) << 1) | u64::from(leased)) + 1);
        if leased {
            put_varint(out, a.until_ms);
        }
        put_varint(out, (u64::from(a.over) << 1) | u64::from(a.overdrawn));
        put_varint(out, u64::from(a.share));
        put_varint(out, u64::from(a.since));
        put_varint(out, u64::from(a.carry));
        put_varint(out, flow.at_ms);
        put_varint(out, flow.from_ms);
        put_varint(out, flow.short_ns);
        put_varint(out, u64::from(flow.own));
        put_varint(out, flow.all);
    }

    /// Reads [`Allowance::put`]; a bucket of an older version (an older VM's, during an
    /// upgrade) has no overdraft (version 2) or no units unreported (versions 4 and 5).
    fn read(r: &mut Reader<'_>, version: u8) -> Result<(Option<Allowance>, Flow), DecodeError> {
        let Some(v) = r.varint()?.checked_sub(1) else { return Ok((None, Flow::default())) };
        let until_ms = if v & 1 == 1 { r.varint()? } else { 0 };
        let (over, share) = if version >= VERSION_OVER {
            (r.varint()?, u16::try_from(r.varint()?).unwrap_or(u16::MAX))
        } else {
            (0, 0)
        };
        let (since, carry) = if version >= VERSION_UNREPORTED { (r.varint()?, r.varint()?) } else { (0, 0) };
        let small = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
        let flow = if version >= VERSION_FLOW {
            Flow {
                at_ms: r.varint()?,
                from_ms: r.varint()?,
                short_ns: r.varint()?,
                own: small(r.varint()?),
                all: r.varint()?,
            }
        } else {
            Flow::default()
        };
        let grant = Allowance {
            units: u32::try_from(v >> 2).unwrap_or(u32::MAX),
            more: v & 2 == 2,
            until_ms,
            over: u32::try_from(over >> 1).unwrap_or(u32::MAX),
            overdrawn: over & 1 == 1,
            share,
            since: small(since),
            carry: small(carry),
        };
        Ok((Some(grant), flow))
    }
}

/// Decodes a bucket value.
pub fn decode_bucket(bytes: &[u8]) -> Result<Vec<Entry>, DecodeError> {
    let mut entries = Vec::new();
    decode_bucket_into(bytes, &mut entries)?;
    Ok(entries)
}

/// Decodes a bucket value into `entries` (cleared first; its capacity is reused).
pub fn decode_bucket_into(bytes: &[u8], entries: &mut Vec<Entry>) -> Result<(), DecodeError> {
    entries.clear();
    let (&version, rest) = bytes.split_first().ok_or(DecodeError::Truncated)?;
    if !matches!(
        version,
        VERSION
            | VERSION_GRANTS
            | VERSION_QUEUE
            | VERSION_OVER
            | VERSION_OVER_QUEUE
            | VERSION_UNREPORTED
            | VERSION_UNREPORTED_QUEUE
            | VERSION_FLOW
            | VERSION_FLOW_QUEUE
    ) {
        return Err(DecodeError::Version(version));
    }
    let (&n, mut rest) = rest.split_first().ok_or(DecodeError::Truncated)?;
    for _ in 0..n {
        let head = rest.get(..HEAD).ok_or(DecodeError::Truncated)?;
        let mut fp = [0u8; 8];
        fp.get_mut(..6).ok_or(DecodeError::Truncated)?.copy_from_slice(head.get(..6).ok_or(DecodeError::Truncated)?);
        let mut idle = [0u8; 4];
        idle.copy_from_slice(head.get(6..10).ok_or(DecodeError::Truncated)?);
        let usage = head.get(10).copied().ok_or(DecodeError::Truncated)?;
        let (state, used) = State::decode(rest.get(HEAD..).ok_or(DecodeError::Truncated)?)?;
        rest = rest.get(HEAD + used..).ok_or(DecodeError::Truncated)?;
        let (mut grant, mut queue, mut flow) = (None, Departures::default(), Flow::default());
        if version != VERSION {
            let mut r = Reader { bytes: rest, pos: 0 };
            (grant, flow) = Allowance::read(&mut r, version)?;
            if matches!(version, VERSION_QUEUE | VERSION_OVER_QUEUE | VERSION_UNREPORTED_QUEUE | VERSION_FLOW_QUEUE) {
                queue = Departures::read(&mut r)?;
            }
            rest = rest.get(r.pos..).ok_or(DecodeError::Truncated)?;
        }
        entries.push(Entry {
            fingerprint: u64::from_le_bytes(fp),
            idle_at: u32::from_le_bytes(idle),
            usage,
            state,
            grant,
            queue,
            flow,
        });
    }
    Ok(())
}

/// Encodes a bucket value.
pub fn encode_bucket(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + entries.len() * 30);
    encode_bucket_into(entries, &mut out);
    out
}

/// Encodes a bucket value into `out` (cleared first; its capacity is reused).
pub fn encode_bucket_into(entries: &[Entry], out: &mut Vec<u8>) {
    out.clear();
    let grants = entries.iter().take(WAYS).any(|e| e.grant.is_some());
    let queues = entries.iter().take(WAYS).any(|e| !e.queue.is_empty());
    out.push(match (grants, queues) {
        (_, true) => VERSION_FLOW_QUEUE,
        (true, false) => VERSION_FLOW,
        (false, false) => VERSION,
    });
    out.push(entries.len().min(WAYS) as u8);
    for e in entries.iter().take(WAYS) {
        out.extend_from_slice(e.fingerprint.to_le_bytes().get(..6).unwrap_or(&[0; 6]));
        out.extend_from_slice(&e.idle_at.to_le_bytes());
        out.push(e.usage);
        e.state.encode_into(out);
        if grants || queues {
            Allowance::put(e.grant, &e.flow, out);
        }
        if queues {
            e.queue.put(out);
        }
    }
}

/// An update of one entry: (state, grant) to the new (state, grant), or `None` to leave it;
/// the entry's [`Flow`] may be changed in place (kept only with a grant, and only when the
/// update returns one).
pub type EntryUpdate<'a> = dyn FnMut(&State, Option<Allowance>, &mut Flow) -> Option<(State, Option<Allowance>)> + 'a;

/// The table's shape and hashing.
#[derive(Debug)]
pub struct Table {
    buckets: u32,
    seed: u64,
    prefix: String,
    cas_retries: u32,
    /// The departure count of the entry the last successful [`Table::update`] wrote.
    last_seq: std::cell::Cell<u32>,
    /// Buffers reused by every update (a VM runs one request at a time), so the request path
    /// does not allocate per bucket read and write.
    scratch: RefCell<(Vec<Entry>, Vec<u8>)>,
}

/// What one table update did, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableStats {
    /// Active (non-idle) entries evicted to make room.
    pub evictions: u64,
    /// Bucket values that did not decode and were reset.
    pub corrupt: u64,
    /// Buckets found gone after the table was created: the host dropped them (NGINX's
    /// `shm_kv` evicts its least recently used keys when the zone is full), their counts with
    /// them.
    pub lost: u64,
    /// CAS conflicts retried.
    pub cas_conflicts: u64,
}

impl Table {
    /// A table of at least `slots` entries: a power of two of buckets, so that however
    /// often the size is changed, the tables ever created (shared data has no delete) hold at
    /// most twice the keys of the largest.
    pub fn new(slots: u32, seed: u64, cas_retries: u32) -> Table {
        let buckets = slots.div_ceil(WAYS as u32).max(1).checked_next_power_of_two().unwrap_or(1 << 31);
        // The bucket count is part of the key so a resized table starts clean.
        let scratch = RefCell::new((Vec::with_capacity(WAYS), Vec::with_capacity(2 + WAYS * 32)));
        Table {
            buckets,
            seed,
            prefix: format!("rw1/{buckets}/"),
            cas_retries,
            last_seq: std::cell::Cell::new(0),
            scratch,
        }
    }

    /// The grant held on `key` (one read; nothing written).
    pub fn grant(&self, host: &dyn Host, key: &[u8]) -> Option<Allowance> {
        let mut held = None;
        let weigh = |_: &State| (0, 0);
        let _ = self.update(
            host,
            key,
            0,
            &weigh,
            &mut |_, g, _| {
                held = g;
                None
            },
            &mut TableStats::default(),
        );
        held
    }

    /// Number of buckets (shared-data keys).
    pub fn buckets(&self) -> u32 {
        self.buckets
    }

    /// The bucket and fingerprint of a counter key.
    pub fn slot(&self, key: &[u8]) -> Slot {
        let mut h = SipHasher13::new_with_keys(self.seed, 0x7261_7465_7761_6c6c);
        h.write(key);
        let hash = h.finish();
        // Multiply-shift maps the high bits uniformly onto the bucket range.
        let bucket = (((hash >> 32) * u64::from(self.buckets)) >> 32) as u32;
        Slot { bucket, fingerprint: hash & FINGERPRINT_MASK }
    }

    /// The shared-data key of a bucket.
    pub fn bucket_key(&self, bucket: u32) -> String {
        String::from(self.bucket_key_in(bucket, &mut [0u8; 32]))
    }

    /// [`Table::bucket_key`] written into `buf`, without allocating.
    fn bucket_key_in<'b>(&self, bucket: u32, buf: &'b mut [u8; 32]) -> &'b str {
        let prefix = self.prefix.as_bytes();
        let mut digit_buf = [0u8; 20];
        let digits = ratewall_core::text::digits(u64::from(bucket), &mut digit_buf);
        let len = prefix.len() + digits.len();
        // The prefix is "rw1/<u32>/" (at most 15 bytes) and a bucket at most 10 digits: it fits.
        match (buf.get_mut(..prefix.len()), len <= 32) {
            (Some(head), true) => head.copy_from_slice(prefix),
            _ => return "",
        }
        if let Some(tail) = buf.get_mut(prefix.len()..len) {
            tail.copy_from_slice(digits);
        }
        ratewall_core::text(buf.get(..len).unwrap_or_default()).unwrap_or_default()
    }

    /// Creates every bucket key that does not exist yet. Runs at a VM's first request or
    /// tick, before it counts anything in the table: this is the only place a key is written
    /// without a CAS value that was read.
    pub fn create(&self, host: &dyn Host) -> Result<u32, SetError> {
        let empty = encode_bucket(&[]);
        let mut created = 0;
        for b in 0..self.buckets {
            let key = self.bucket_key(b);
            // Missing, or emptied when the table was resized away from this size.
            let missing = match host.shared_get(&key) {
                Ok((None, _)) => true,
                Ok((Some(v), _)) => v.is_empty(),
                Err(_) => false,
            };
            if missing {
                match host.shared_set(&key, &empty, None) {
                    Ok(()) => created += 1,
                    // Another VM created it between the read and the write (ngx_wasm_module
                    // refuses a `cas = 0` write to a key that exists): it is there, as wanted.
                    Err(SetError::CasMismatch) if matches!(host.shared_get(&key), Ok((Some(_), _))) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(created)
    }

    /// Empties every bucket of a table no longer in use (a resize): shared data has no
    /// delete, so its keys stay, but not its entries.
    pub fn clear(&self, host: &dyn Host) {
        for b in 0..self.buckets {
            let key = self.bucket_key(b);
            if let Ok((Some(v), cas)) = host.shared_get(&key) {
                if !v.is_empty() {
                    // With the CAS read: a write without one would be refused by a host that
                    // reads `cas = 0` as "only if absent".
                    let _ = host.shared_set(&key, &[], cas);
                }
            }
        }
    }

    /// Atomically updates the state and grant of `key` in its bucket with `f` (`None`: leave
    /// the bucket unchanged).
    pub fn update(
        &self,
        host: &dyn Host,
        key: &[u8],
        now: Nanos,
        weigh: &dyn Fn(&State) -> (Nanos, u8),
        f: &mut EntryUpdate<'_>,
        stats: &mut TableStats,
    ) -> Result<(), StoreError> {
        self.update_queue(host, key, now, weigh, f, None, stats)
    }

    /// The departure count of the entry the last successful update wrote (read with that
    /// update's state, so a waiter it admitted knows which departures came after it).
    pub fn last_seq(&self) -> u32 {
        self.last_seq.get()
    }

    /// A leaky bucket's state and departures for `key` (None: not tracked, or unreadable).
    pub fn queue(&self, host: &dyn Host, key: &[u8]) -> Option<(State, Departures)> {
        let slot = self.slot(key);
        let (bytes, _) = host.shared_get(&self.bucket_key(slot.bucket)).ok()?;
        let entries = decode_bucket(&bytes?).ok()?;
        entries.into_iter().find(|e| e.fingerprint == slot.fingerprint).map(|e| (e.state, e.queue))
    }

    /// [`Table::update`], and in the same write `departure` changes the entry's departures
    /// (false: leave the bucket unchanged).
    #[allow(clippy::too_many_arguments)]
    pub fn update_queue(
        &self,
        host: &dyn Host,
        key: &[u8],
        now: Nanos,
        weigh: &dyn Fn(&State) -> (Nanos, u8),
        f: &mut EntryUpdate<'_>,
        mut departure: Option<&mut dyn FnMut(&mut Departures) -> bool>,
        stats: &mut TableStats,
    ) -> Result<(), StoreError> {
        let slot = self.slot(key);
        let mut key_buf = [0u8; 32];
        let bkey = self.bucket_key_in(slot.bucket, &mut key_buf);
        let now_secs = u32::try_from(now / SECOND).unwrap_or(u32::MAX);
        // Never contended (one request at a time per VM); fresh buffers if it ever were.
        let mut own = None;
        let mut guard = self.scratch.try_borrow_mut().ok();
        let (entries, value) = match guard.as_deref_mut() {
            Some((e, v)) => (e, v),
            None => {
                let (e, v) = own.insert((Vec::new(), Vec::new()));
                (e, v)
            }
        };
        for _ in 0..self.cas_retries {
            let (bytes, cas) = host.shared_get(bkey).map_err(|_| StoreError::Unavailable)?;
            match bytes.as_deref().map(|b| decode_bucket_into(b, entries)) {
                Some(Ok(())) => {}
                // A newer VM's bucket (during an upgrade, old and new VMs share the table):
                // not read, and not overwritten, so its counters are not reset; the check
                // fails as a store failure (its rule's `on_store_failure` decides).
                Some(Err(DecodeError::Version(v))) if NEWER_VERSIONS.contains(&v) => {
                    return Err(StoreError::Unavailable);
                }
                Some(Err(_)) => {
                    stats.corrupt += 1;
                    entries.clear();
                }
                None => {
                    stats.lost += 1;
                    entries.clear();
                }
            }
            let pos = entries.iter().position(|e| e.fingerprint == slot.fingerprint);
            let (current, grant, mut queue, mut flow) = pos.and_then(|i| entries.get(i)).map_or_else(
                || (State::Fresh, None, Departures::default(), Flow::default()),
                |e| (e.state.clone(), e.grant, e.queue.clone(), e.flow),
            );
            let Some((next, grant)) = f(&current, grant, &mut flow) else {
                return Ok(());
            };
            if let Some(leave) = departure.as_deref_mut() {
                if !leave(&mut queue) {
                    return Ok(());
                }
            }
            let (idle_at, usage) = weigh(&next);
            let idle = u32::try_from(idle_at.div_ceil(SECOND)).unwrap_or(u32::MAX);
            let seq = queue.seq;
            let flow = if grant.is_some() { flow } else { Flow::default() };
            let entry = Entry { fingerprint: slot.fingerprint, idle_at: idle, usage, state: next, grant, queue, flow };
            match pos {
                Some(i) => {
                    if let Some(e) = entries.get_mut(i) {
                        *e = entry;
                    }
                }
                None if entries.len() < WAYS => entries.push(entry),
                None => {
                    // An idle entry; else the least used, then the soonest idle.
                    let victim = entries
                        .iter()
                        .enumerate()
                        .min_by_key(|(_, e)| (e.idle_at > now_secs, e.usage, e.idle_at))
                        .map_or(0, |(i, _)| i);
                    if entries.get(victim).is_some_and(|e| e.idle_at > now_secs) {
                        stats.evictions += 1;
                    }
                    if let Some(e) = entries.get_mut(victim) {
                        *e = entry;
                    }
                }
            }
            encode_bucket_into(entries, value);
            // A bucket that does not exist yet was not created at configure time (a table
            // resized while traffic flows); create it now, unprotected, as Envoy allows.
            match host.shared_set(bkey, value, cas) {
                Ok(()) => {
                    self.last_seq.set(seq);
                    return Ok(());
                }
                Err(SetError::CasMismatch) => stats.cas_conflicts += 1,
                Err(SetError::Other) => return Err(StoreError::Unavailable),
            }
        }
        Err(StoreError::Contention)
    }
}

/// How a request's checks meet the global store's grants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grants {
    /// No sync, or the store's data is stale: no allowance applies.
    Off,
    /// Admissions spend the entry's grant; an entry without one (the store has not answered
    /// for it yet) starts with an equal share of the limit between `nodes`.
    On {
        /// Nodes sharing each limit.
        nodes: u32,
    },
}

/// The table as the core's [`Counters`] for one request.
pub struct TableCounters<'a> {
    /// The table.
    pub table: &'a Table,
    /// The host.
    pub host: &'a dyn Host,
    /// Statistics collected.
    pub stats: TableStats,
    /// Whether grants apply.
    pub grants: Grants,
    /// Checks of these rules fail with [`StoreError::Unavailable`] (closed rules while the
    /// global store is unreachable).
    pub unavailable: &'a [bool],
    /// Keys of the checks that a spent grant denied while the local limit would admit and
    /// the store had quota left: the request may ask the store for them (exact rules only).
    pub askable: Vec<Vec<u8>>,
    /// Whether each rule is exact (`"exact": true`): its spent grant asks the store, and it
    /// has no overdraft. Rules past the end are not.
    pub exact: &'a [bool],
    /// The counters (FNV-1a hashes of their keys) the store's last answer named out of
    /// quota: a rule that is not exact spends no initial share or overdraft on them.
    pub named_out: Vec<u64>,
    /// The counters the store named out whose unit came back with no answer since
    /// (`Syncer::came_back`): a sliding window's or log's of a rule that is not exact, whose
    /// grant and overdraft are spent, admits that one unit on an overdraft.
    pub came_back: Vec<(u64, Nanos)>,
    /// The departure count each leaky bucket's admission read (by counter key): the turn it
    /// was given is moved up by the departures after it.
    pub seqs: Vec<(Vec<u8>, u32)>,
    /// Set while a refund is a waiter leaving its turn: (its turn as given, the count when it
    /// was, how far those behind move up, the oldest departure still worth remembering).
    pub leaving: Option<(Nanos, u32, Nanos, Nanos)>,
    /// Whether a check admitted units past its grant (on its overdraft).
    pub overdrawn: bool,
    refunding: bool,
}

impl<'a> TableCounters<'a> {
    /// Counters over `table` for one request.
    pub fn new(table: &'a Table, host: &'a dyn Host, grants: Grants, unavailable: &'a [bool]) -> TableCounters<'a> {
        TableCounters {
            table,
            host,
            stats: TableStats::default(),
            grants,
            unavailable,
            askable: Vec::new(),
            exact: &[],
            named_out: Vec::new(),
            came_back: Vec::new(),
            seqs: Vec::new(),
            leaving: None,
            overdrawn: false,
            refunding: false,
        }
    }
}

impl Counters for TableCounters<'_> {
    fn update(
        &mut self,
        check: &Check,
        now: Nanos,
        f: &mut dyn FnMut(&State, u64) -> ratewall_core::eval::Write,
    ) -> Result<(), StoreError> {
        let limit = check.limit;
        // Requests in flight are counted per proxy: no store, no grants.
        let local = limit.algorithm() == ratewall_core::Algorithm::Concurrent;
        if !local && self.unavailable.get(check.rule).copied().unwrap_or(false) {
            return Err(StoreError::Unavailable);
        }
        let cost = u32::try_from(check.cost).unwrap_or(u32::MAX);
        let (grants, refunding) = (if local { Grants::Off } else { self.grants }, self.refunding);
        // The initial share splits what the counter admits at once (a token bucket's `burst`,
        // not its `requests` per `per`: at 1,000 a minute with a burst of 200, three nodes had
        // 333 each, and a burst across them admitted 233 in 0.14 s).
        let initial = match grants {
            Grants::On { nodes } => {
                u32::try_from((limit.capacity() / u64::from(nodes.max(1))).max(1)).unwrap_or(u32::MAX)
            }
            Grants::Off => u32::MAX,
        };
        // Before the store has answered for a counter (in this window) the node spends an
        // initial share. The store does not know of it until the node's next batch, so once
        // it is spent the node waits for that batch's answer rather than ask: an ask would be
        // answered from a count that lacks those units.
        // Past the first quarter of a fixed window, a node new to the counter in this window
        // asks the store rather than spend an initial share: others may have spent the quota
        // by then, and units it admitted unasked would reach the store only with its next
        // batch (measured: 5.6 % over-admission at 100 nodes, where most nodes see a counter
        // first late in a window).
        let late = matches!(grants, Grants::On { .. })
            && limit.algorithm() == ratewall_core::Algorithm::FixedWindow
            && now % limit.per().max(1) >= limit.per() / 4;
        // A rule that is not exact never waits: once its grant is spent it admits on the
        // overdraft the store's last answer allowed (see `sync::overdraft`). A node new to a
        // fixed window's counter late in the window, which has no answer yet, starts on an
        // overdraft of its own (what an answer showing the whole quota left would allow):
        // spent, it is the node's one unrepaid overdraft, until an answer finds room for it.
        let no_wait = !self.exact.get(check.rule).copied().unwrap_or(false);
        // A counter the store named out of quota: no initial share or overdraft (an exact
        // rule's first request asks, as always: the store refuses it while the counter is out).
        let out =
            no_wait && !self.named_out.is_empty() && self.named_out.contains(&ratewall_core::key::fnv1a(&check.key));
        // For [`crate::sync::BACK_FOR`] (a sliding log: one of its slots more, as its denial's
        // wait may be that much longer than the store's) once its unit came back.
        let back_for = match limit.algorithm() {
            ratewall_core::Algorithm::SlidingWindow => crate::sync::BACK_FOR,
            ratewall_core::Algorithm::SlidingLog => crate::sync::BACK_FOR.saturating_add(limit.quantum()),
            _ => 0,
        };
        // An exact limit taken by asks alone: each request asks, but while the store has named
        // the counter out (a refused ask says until when: its `Retry-After`, after which a
        // client's request is asked for, and admitted, at once).
        let asks_alone = !no_wait
            && ratewall_core::sync::asks_alone(&limit)
            && !self.named_out.contains(&ratewall_core::key::fnv1a(&check.key));
        let back = no_wait
            && !out
            && back_for > 0
            && !self.came_back.is_empty()
            && self.came_back.iter().any(|(h, since)| *h == ratewall_core::key::fnv1a(&check.key) && *since < back_for);
        let late_over = match grants {
            Grants::On { nodes } if no_wait && late && !out => {
                crate::sync::overdraft(limit.quota(), nodes, u64::MAX, 1, false, 0)
            }
            _ => 0,
        };
        // An exact rule spends only what the store granted: its first request on a counter
        // asks, as a spent grant does (an initial share would be units no store counted, on
        // every node at once: at three nodes, three through an exact limit of two).
        let unasked = !late && no_wait;
        let first = Allowance {
            units: if unasked && !out { initial } else { 0 },
            more: !unasked,
            until_ms: 0,
            over: late_over,
            overdrawn: false,
            share: 0,
            since: 0,
            carry: 0,
        };
        let mut askable = false;
        let mut past_grant = false;
        let mut g = |state: &State, grant: Option<Allowance>, flow: &mut Flow| {
            // Degraded, a token bucket is no fuller than the store's was at its last answer:
            // the node's own state comes back at the whole rate, so it was about full when the
            // store went away, and each node let its part of a whole burst through at once.
            let mirrored = match (grants, state) {
                (Grants::Off, State::TokenBucket { .. } | State::Fresh)
                    if grant.is_some()
                        && limit.algorithm() == ratewall_core::Algorithm::TokenBucket
                        && flow.at_ms > 0 =>
                {
                    let full_at = flow.at_ms.saturating_mul(MS).saturating_add(flow.short_ns);
                    let tat = match state {
                        State::TokenBucket { tat } => (*tat).max(full_at),
                        _ => full_at,
                    };
                    (tat > now).then_some(State::TokenBucket { tat })
                }
                _ => None,
            };
            let state = mirrored.as_ref().unwrap_or(state);
            // A fixed window's grant is a share of that window's quota: once the window has
            // rolled over, the node starts the new one on its initial share rather than on an
            // exhausted old grant (which denied until the next sync answered).
            let rolled = matches!(state, State::FixedWindow { window, .. } if *window != now / limit.per().max(1));
            // The node's traffic share outlives the window (degraded mode reads it).
            let share = grant.map_or(0, |g| g.share);
            let kept = grant;
            let grant = if rolled { None } else { grant };
            // A grant that lapsed while the node was quiet on the counter, its last answer
            // showing at least half the quota free: the counter is decided as one new to the
            // node (on the node's own state and its initial share) until the next answer, so a
            // client's burst after a pause longer than the lease is not cut at the overdraft
            // (none at all where the grant took all that remained). Near the limit the answer
            // may be stale, and the overdraft stays the only way past a grant.
            let quiet = matches!(grants, Grants::On { .. })
                && first.units > 0
                && grant.is_some_and(|g| g.lapsed_quietly(now, limit.quota()));
            let held = match grant {
                Some(g) if !quiet => g,
                _ => Allowance { share, ..first },
            };
            let held = Allowance { units: held.units_at(now), ..held };
            // The unit the store named the counter out until is back, and the node was quiet on
            // the counter since (nothing admitted, no overdraft owed): one unit on an overdraft.
            let back = back && held.units == 0 && held.over == 0 && !held.overdrawn && held.since == 0;
            let over = if no_wait && !out { u64::from(held.over).max(u64::from(back)) } else { 0 };
            let allowance = match (grants, refunding) {
                (Grants::On { .. }, false) => u64::from(held.units) + over,
                _ => u64::MAX,
            };
            // An exact rule asks past its grant when the last answer showed quota beyond it, or
            // when that answer is over a second old (a unit may be back since: a client that
            // waited its `Retry-After` was refused for the lack of a newer answer), while the
            // node's own count has room. At most one such ask a second per counter, then.
            let stale = held.until_ms > 0 && now / MS >= held.until_ms.saturating_add(1_000);
            askable = !no_wait
                && allowance < u64::from(cost)
                && (held.more || stale || asks_alone)
                && limit.decide(state, now, check.cost).0.allowed;
            let (next, charged) = f(state, allowance)?;
            let charged = u32::try_from(charged).unwrap_or(u32::MAX);
            // The grant is spent first, then the overdraft.
            let from_grant = charged.min(held.units);
            past_grant = matches!((grants, refunding), (Grants::On { .. }, false)) && charged > from_grant;
            // A rule that is not exact counts what it admits until the store's answer (see
            // `sync::write_grants`); an exact rule's asked units are counted at the store.
            let since = if no_wait { held.since.saturating_add(charged) } else { held.since };
            let spent = Allowance {
                units: held.units - from_grant,
                over: held.over.saturating_sub(charged - from_grant),
                overdrawn: held.overdrawn || charged > from_grant,
                since,
                ..held
            };
            let grant = match (grants, refunding) {
                (Grants::On { .. }, false) if charged == 0 => grant,
                (Grants::On { .. }, false) => Some(spent),
                (Grants::On { .. }, true) => grant.map(|g| Allowance {
                    units: g.units.saturating_add(cost),
                    since: if no_wait { g.since.saturating_sub(cost) } else { g.since },
                    ..g
                }),
                // Degraded, the grant is left as it was, with the share the fallback reads
                // (the answer to the batch that reports the degraded admissions replaces it).
                (Grants::Off, _) => kept,
            };
            Some((next, grant))
        };
        let weigh = |s: &State| (limit.idle_at(s), limit.usage(s, now));
        let leaky = limit.algorithm() == ratewall_core::Algorithm::LeakyBucket;
        let r = match self.leaving.filter(|_| refunding && leaky) {
            // A waiter leaving: its turn goes to the waiters behind it, in the same write as
            // its refund (or, the log full, neither: its turn stays empty).
            Some((turn, seq, shift, horizon)) => {
                let mut leave = |q: &mut Departures| {
                    let now_turn = q.turn(turn, seq);
                    q.leave(now_turn, shift, horizon)
                };
                self.table.update_queue(self.host, &check.key, now, &weigh, &mut g, Some(&mut leave), &mut self.stats)
            }
            None => self.table.update(self.host, &check.key, now, &weigh, &mut g, &mut self.stats),
        };
        if leaky && !refunding && r.is_ok() {
            self.seqs.push((check.key.clone(), self.table.last_seq()));
        }
        if askable {
            self.askable.push(check.key.clone());
        }
        self.overdrawn |= past_grant && r.is_ok();
        r
    }

    fn refund(&mut self, check: &Check, now: Nanos) -> Result<(), StoreError> {
        self.refunding = true;
        let r = self.update(check, now, &mut |s, _| Some((check.limit.refund(s, now, check.cost), 0)));
        self.refunding = false;
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_trip_and_garbage_is_an_error() {
        let entries = vec![
            Entry {
                fingerprint: 1,
                idle_at: 2,
                usage: 0,
                state: State::TokenBucket { tat: 3 },
                grant: None,
                queue: Departures::default(),
                flow: Flow::default(),
            },
            Entry {
                fingerprint: FINGERPRINT_MASK,
                idle_at: 5,
                usage: 255,
                state: State::SlidingWindow { window: 1, prev: 2, curr: 3 },
                grant: None,
                queue: Departures::default(),
                flow: Flow::default(),
            },
        ];
        let bytes = encode_bucket(&entries);
        // At most 32 bytes per tracked key: 21 for a token bucket, 29 for a sliding window.
        assert_eq!(bytes.len(), 2 + 21 + 29);
        // With a sync grant the bucket is version 8 and each entry carries it (1 byte here, 6
        // for the end of a lease, 1 for the overdraft, and 2 for the units unreported).
        let mut granted = entries.clone();
        granted[0].grant = Some(Allowance {
            units: 3,
            more: true,
            until_ms: 0,
            over: 2,
            overdrawn: true,
            share: 0,
            since: 4,
            carry: 1,
        });
        granted[1].grant = Some(Allowance {
            units: 1,
            more: false,
            until_ms: 1_800_000_000_123,
            over: 0,
            overdrawn: false,
            share: 9_000,
            since: 0,
            carry: 0,
        });
        granted[1].flow = Flow { at_ms: 1_800_000_000_100, from_ms: 1_800_000_000_000, short_ns: 3, own: 2, all: 40 };
        let bytes2 = encode_bucket(&granted);
        // (1 byte for no share, 2 for one of 9,000; then 5 for no flow, 15 for entry 1's.)
        assert_eq!(bytes2.len(), bytes.len() + 2 + 6 + 2 + 3 + 2 * 2 + 5 + 15);
        assert_eq!(bytes2[0], VERSION_FLOW);
        assert_eq!(decode_bucket(&bytes2).unwrap(), granted);
        assert_eq!(decode_bucket(&bytes).unwrap(), entries);
        // Older VMs' buckets: version 2 reads with no overdraft, version 4 with no units
        // unreported (entry 0's grant: 3 units, more; then the overdraft of 2, overdrawn).
        let three =
            Allowance { units: 3, more: true, until_ms: 0, over: 0, overdrawn: false, share: 0, since: 0, carry: 0 };
        for (version, tail, grant) in [
            (VERSION_GRANTS, &[((3 << 2) | 2) + 1][..], three),
            (VERSION_OVER, &[((3 << 2) | 2) + 1, (2 << 1) | 1, 0][..], Allowance { over: 2, overdrawn: true, ..three }),
        ] {
            let mut old = vec![version, 1];
            old.extend_from_slice(&bytes2[2..2 + 21]);
            old.extend_from_slice(tail);
            assert_eq!(decode_bucket(&old).unwrap()[0].grant, Some(grant), "version {version}");
        }
        assert!(decode_bucket(&bytes[..bytes.len() - 1]).is_err());
        assert!(decode_bucket(&[]).is_err());
        assert!(decode_bucket(&[1, 200]).is_err());
        // A leaky bucket's departures make it version 9.
        let mut queued = entries.clone();
        queued[0].queue = Departures { seq: 7, gone: vec![(1_800_000_000_400_000_000, 200_000_000)] };
        let bytes3 = encode_bucket(&queued);
        assert_eq!(bytes3[0], VERSION_FLOW_QUEUE);
        assert_eq!(decode_bucket(&bytes3).unwrap(), queued);
        for cut in 0..bytes3.len() {
            assert!(decode_bucket(&bytes3[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn departures_move_up_only_the_waiters_behind_them_and_after_whom_they_left() {
        const I: Nanos = 200;
        let mut q = Departures::default();
        // Waiters given turns 200..=1000 when the count was 0; the one at 400 leaves.
        assert!(q.leave(400, I, 0));
        assert_eq!([200, 600, 800, 1000].map(|t| q.turn(t, 0)), [200, 400, 600, 800]);
        // A waiter admitted after it (count 1) was given its turn from the queue as closed.
        assert_eq!(q.turn(1000, 1), 1000);
        // Then the waiter now at 600 (given 800) leaves too: the rest move up once more.
        assert!(q.leave(q.turn(800, 0), I, 0));
        assert_eq!([200, 1000].map(|t| q.turn(t, 0)), [200, 600]);
        assert_eq!(q.turn(1000, 1), 800);
        // The log is bounded: past DEPARTURES a leaving waiter's turn stays empty.
        assert!(q.leave(5000, I, 0) && q.leave(5200, I, 0));
        assert!(!q.leave(5400, I, 0));
        // Departures older than the horizon are forgotten.
        assert!(q.leave(5400, I, 1000));
        assert_eq!(q.gone.len(), 3);
    }

    #[test]
    fn bucket_keys_name_the_table_size_and_the_bucket() {
        for slots in [64, 65_536, ratewall_core::rules::MAX_SLOTS] {
            let t = Table::new(slots, 1, 8);
            for b in [0, 1, 9, 10, 4095, t.buckets() - 1] {
                assert_eq!(t.bucket_key(b), format!("rw1/{}/{b}", t.buckets()));
            }
        }
    }

    #[test]
    fn slots_spread_over_buckets() {
        let t = Table::new(8192, 42, 8);
        let mut seen = vec![0u32; t.buckets() as usize];
        for i in 0..100_000u32 {
            seen[t.slot(&i.to_le_bytes()).bucket as usize] += 1;
        }
        let (min, max) = (seen.iter().min().unwrap(), seen.iter().max().unwrap());
        assert!(*min > 60 && *max < 140, "bucket load {min}..{max} for a mean of 97");
    }
}
