//! `ratewall-store`: the self-hosted global store for filter fleets off Cloudflare — the sync
//! protocol's `POST /v1/sync` (docs/sync-protocol.md) with its counters in Redis or Valkey.
//!
//! It is stateless: any number of processes may serve one Redis. Each counter is one Redis
//! key holding the core's `sync::Counter` encoding, changed only by compare-and-swap: read
//! the value and the key's own clock (Redis `TIME` on the key's primary, so store processes
//! with skewed clocks agree), run the core's pure transition — the same `Counter::apply` /
//! `Counter::ask` the Worker's Durable Object runs — and write the result only if the value
//! is still the one read, else run it again. The small scripts ([`READ`], [`CAS`], and
//! [`MANY`], which runs them for many keys in one call on a single server) are those
//! primitives and nothing else: no rate-limit logic lives in Lua. The node registry
//! (the `nodes` every answer reports, and each node's latest batch `seq`) is a hash and a
//! sorted set updated by one more script ([`REGISTRY`]).
//!
//! It is not a rate limiter of its own: proxies decide; this adds up what they admitted.

/// `eprintln!` for a server: a line stderr cannot take is dropped rather than a panic (a log
/// pipe that closed must not take the store down).
#[macro_export]
macro_rules! log_line {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let text = format!($($t)*);
        let _ = writeln!(std::io::stderr().lock(), "{}", $crate::one_line(&text));
    }};
}

/// `text` as one log line: a line break or other control character in it (a reason quoted
/// from Redis, or from a server that is not Redis) is escaped, so it cannot end the line or
/// make one up.
pub fn one_line(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return text.into();
    }
    text.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}

/// `println!` likewise, for the lines that say where the store listens.
#[macro_export]
macro_rules! out_line {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($t)*);
    }};
}

use ratewall_core::sync::{
    hex, reason, sign, unhex, Counter, Delta, Grant, Out, SyncError, SyncRequest, SyncResponse, RETRY_HORIZON,
    SEQ_MEMORY,
};
use ratewall_core::{Limit, Nanos, SECOND};

pub mod admin;
/// The refusal of a sync body over [`MAX_BODY`] bytes.
fn too_large() -> Answer {
    Answer::error(413, reason::too_large(MAX_BODY))
}

#[cfg(test)]
mod fake;
pub mod redis_kv;
pub mod rls;
pub mod top;
use futures_util::future::join_all;
use std::fmt::Write as _;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Largest request body accepted.
pub const MAX_BODY: usize = 1 << 20;
/// Most deltas one batch may name.
pub const MAX_DELTAS: usize = 500;
/// A node not heard from for this long no longer counts in `nodes` (the Worker's too).
pub const NODE_TTL: Nanos = 2 * SECOND;
/// Compare-and-swap attempts per counter per call; past them the call is a 503 (the node
/// retries with the same `seq`, counted once) and `ratewall_store_cas_exhausted` counts it.
pub const CAS_ATTEMPTS: u32 = 16;

/// Time kept, before a call's deadline, for its answer's way back: a compare-and-set a call
/// carries is not written later than this before the call is answered 503.
pub(crate) const ANSWER_MARGIN: std::time::Duration = std::time::Duration::from_millis(2);

/// A counter's TTL in Redis: kept while anything in it matters (the state, leases, remembered
/// seqs), and a retry horizon on top.
fn ttl_ms(counter: &Counter) -> u64 {
    let idle = counter.idle_at().saturating_sub(counter.last_seen).max(SEQ_MEMORY);
    (idle.saturating_add(RETRY_HORIZON) / 1_000_000).max(1)
}

/// When an ask took `d`'s units at its counter, as `r` says (its key's clock); `None` for a
/// batch's delta, or an ask that took nothing there.
fn taken_at(req: &SyncRequest, d: &Delta, r: &Result<Update, Answer>) -> Option<Nanos> {
    match r {
        Ok(Update::Applied(a, at, _)) if req.ask && a.counted && a.grant >= d.units => Some(*at),
        _ => None,
    }
}

/// How long an ask's task may run past its deadline ([`Store::ask`]), for the give-back.
const ASK_TASK_PAST: Duration = Duration::from_secs(10);

/// The answer to an ask whose compare-and-set Redis refused at its deadline, or failed.
const ASK_FAILED: &str =
    "Redis failed, or did not write the ask by its deadline (--deadline-ms); nodes do not send an ask \
     again";

/// The answer to an ask whose deadline passed before its counter's turn came.
const ASK_PAST_DEADLINE: &str =
    "no answer from Redis within the store's deadline (--deadline-ms): the counter busy, Redis slow, or the store \
     process loaded; the ask takes nothing";

/// The scripts' read of a key: its value, or for a key of another type (not a counter ever
/// written here) a value no counter has, so it is named unreadable and kept like any damaged
/// counter rather than failing the call and every other counter in it.
macro_rules! get_or_unreadable {
    () => {
        "local function get(k) local v = redis.pcall('GET', k) \
if type(v) == 'table' then return '\\0' .. tostring(v.err) end return v end "
    };
}

/// Reads a key and its primary's clock: `{value or false, seconds, microseconds}`.
pub const READ: &str = concat!(get_or_unreadable!(), "local t = redis.call('TIME') return {get(KEYS[1]), t[1], t[2]}");

/// Sets `KEYS[1]` to `ARGV[2]` (expiring in `ARGV[3]` ms) if it still holds `ARGV[1]`
/// (`ARGV[4]` = "0": if it does not exist): `{1, false, s, µs}` when set, else
/// `{0, value or false, s, µs}` — what it holds instead, so the caller can run its transition
/// again without another read. (`s, µs`: the key's primary's clock.) Past `ARGV[5]` ms of that
/// clock (when not "0"), nothing is written: `{2, false, s, µs}` — a call Redis runs only after
/// its caller gave up (Redis paused with it on the socket) counts nothing.
pub const CAS: &str = concat!(
    get_or_unreadable!(),
    "local v = get(KEYS[1]) local t = redis.call('TIME') \
if ARGV[5] ~= '0' and tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > tonumber(ARGV[5]) then \
return {2, false, t[1], t[2]} end \
if (ARGV[4] == '0' and v == false) or (ARGV[4] == '1' and v == ARGV[1]) then \
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return {1, false, t[1], t[2]} end return {0, v, t[1], t[2]}"
);

/// [`READ`]s and [`CAS`]es of many keys at once, as one script call: for each `KEYS[i]` in
/// turn, from the next `ARGV`, `r` (a read), or `c` and the [`CAS`]'s expected value, new
/// value, TTL in ms and "0"/"1" (must not exist / must hold the expected value). Returns `{s,
/// µs, status, value or false, status, value or false, …}`, per key: a read `2` and the value;
/// a compare-and-set `1` when set, else `0` and what the key holds instead (`s, µs`: the
/// server's clock). For a single server only: a Cluster takes a script's keys in one slot,
/// and each counter has its own.
pub const MANY: &str = concat!(
    get_or_unreadable!(),
    "local t = redis.call('TIME') local out = {t[1], t[2]} local a = 1 \
for i = 1, #KEYS do local v = get(KEYS[i]) \
if ARGV[a] == 'r' then out[#out + 1] = 2 out[#out + 1] = v a = a + 1 \
elseif (ARGV[a + 4] == '0' and v == false) or (ARGV[a + 4] == '1' and v == ARGV[a + 1]) then \
redis.call('SET', KEYS[i], ARGV[a + 2], 'PX', ARGV[a + 3]) out[#out + 1] = 1 out[#out + 1] = false a = a + 5 \
else out[#out + 1] = 0 out[#out + 1] = v a = a + 5 end end return out"
);

/// What a compare-and-set found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cas {
    /// Written, at this time of the key's clock.
    Written(Nanos),
    /// Not written: the key holds this instead (None: absent), at this time.
    Changed(Option<Vec<u8>>, Nanos),
}

/// The registry: `KEYS[1]` a hash node → latest batch seq (20 zero-padded digits, so string
/// order is numeric order), `KEYS[2]` a sorted set node → last heard (ms of the key's
/// clock). `ARGV`: node, seq, "1" for a batch (checked and moved) or "0" for an ask, the node
/// TTL and the seq memory in ms, the request's time and the most it may be from the key's
/// clock, in ms, the silence after which a node counts as not heard lately and the most such
/// nodes named, latest first, the most asks remembered, and the most nodes remembered (the
/// longest unheard are forgotten past it). `KEYS[3]`: a sorted set of the
/// asks answered, `node:seq` → the ask's time (ms of the node's clock), kept while a copy
/// would be accepted (the skew); `KEYS[4]`: the time at or before which asks are refused,
/// raised when the earliest are dropped for room. Returns `{nodes heard within the TTL, "",
/// the nodes heard lately...}` (for [`Counter::heard_lately`]), `{-1, latest seq}` for a batch
/// older than the node's latest, `{-2, the clock in ms}` for a request made too far from it,
/// or `{-3}` for an ask already answered, a replay (nothing is changed then). The time is
/// checked here, at the clock the registry's memory runs on, so that every request it accepts
/// is one whose `seq` it remembers.
pub const REGISTRY: &str = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000) \
if math.abs(now - tonumber(ARGV[6])) > tonumber(ARGV[7]) then return {-2, now} end \
if ARGV[3] == '0' then local skew = tonumber(ARGV[7]) local sent = tonumber(ARGV[6]) \
local floor = tonumber(redis.call('GET', KEYS[4]) or '-1') \
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. (now - skew)) \
if sent <= floor or redis.call('ZADD', KEYS[3], 'NX', sent, ARGV[1] .. ':' .. ARGV[2]) == 0 then return {-3} end \
if redis.call('ZCARD', KEYS[3]) > tonumber(ARGV[10]) then \
local old = redis.call('ZRANGE', KEYS[3], 0, 99, 'WITHSCORES') redis.call('ZREMRANGEBYRANK', KEYS[3], 0, 99) \
redis.call('SET', KEYS[4], old[#old], 'PX', 2 * skew) end \
redis.call('PEXPIRE', KEYS[3], 2 * skew) end \
if ARGV[3] == '1' then local last = redis.call('HGET', KEYS[1], ARGV[1]) \
if last and ARGV[2] < last then return {-1, last} end \
if (not last) or ARGV[2] > last then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end end \
redis.call('ZADD', KEYS[2], now, ARGV[1]) \
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[5]), 'LIMIT', 0, 100) \
for _, n in ipairs(gone) do redis.call('HDEL', KEYS[1], n) redis.call('ZREM', KEYS[2], n) end \
local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[11]) \
if extra > 0 then for _, n in ipairs(redis.call('ZRANGE', KEYS[2], 0, extra - 1)) do \
redis.call('HDEL', KEYS[1], n) redis.call('ZREM', KEYS[2], n) end end \
redis.call('PEXPIRE', KEYS[1], ARGV[5]) redis.call('PEXPIRE', KEYS[2], ARGV[5]) \
local out = {redis.call('ZCOUNT', KEYS[2], now - tonumber(ARGV[4]), '+inf'), ''} \
for _, n in ipairs(redis.call('ZREVRANGEBYSCORE', KEYS[2], '+inf', '(' .. (now - tonumber(ARGV[8])), 'LIMIT', 0, tonumber(ARGV[9]))) \
do out[#out + 1] = n end return out";

/// Closes a node's latest batch ([`Kv::close`]): `KEYS[1]` the registry's hash of each node's
/// latest `seq`, `ARGV` the node and the batch's `seq` as [`REGISTRY`] writes it. The `seq`
/// gets a `c` after it, which sorts after it and before the next one, so [`REGISTRY`] refuses
/// a repeat of it as older and takes the next.
pub const CLOSE: &str = "if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then \
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. 'c') end return 1";

/// The rate limit service's processes: `KEYS[1]` a sorted set process → last heard (ms of the
/// key's clock). `ARGV`: the process's node id and the time a process counts for after it was
/// last heard, in ms. Notes the process as heard now, forgets the others not heard for that
/// long and returns how many it counts, the process included. Apart from the sync registry
/// ([`REGISTRY`]): the service's counters are not the filters', so neither fleet shrinks the
/// other's initial shares.
///
/// With it, the counters too low for an initial share ([`Presence::low`]): `KEYS[2]` a sorted
/// set counter key → until when (ms), `KEYS[3]` its version, changed with every entry added
/// or put later. `ARGV[3]`: the version the process last read; `ARGV[4..]`: pairs of a counter
/// key and its time, which the set takes where later than what it has. Entries past their time
/// are dropped, and past [`MAX_LOW`] the soonest to end. Returns `{processes, seconds,
/// microseconds, version}`, and when the version is not the one read, every entry as a key
/// and its time.
pub const PRESENT: &str = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000) \
redis.call('ZADD', KEYS[1], now, ARGV[1]) \
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2])) \
redis.call('PEXPIRE', KEYS[1], ARGV[2]) \
local changed = false \
for i = 4, #ARGV - 1, 2 do local old = redis.call('ZSCORE', KEYS[2], ARGV[i]) \
if (not old) or tonumber(old) < tonumber(ARGV[i + 1]) then redis.call('ZADD', KEYS[2], ARGV[i + 1], ARGV[i]) changed = true end end \
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now) \
if changed then redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -1025) redis.call('INCR', KEYS[3]) \
local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES') \
local ttl = math.max(1000, (tonumber(last[2]) or now) - now + 1000) \
redis.call('PEXPIRE', KEYS[2], ttl) redis.call('PEXPIRE', KEYS[3], ttl) end \
local version = redis.call('GET', KEYS[3]) or '0' \
local out = {redis.call('ZCARD', KEYS[1]), t[1], t[2], version} \
if version ~= ARGV[3] then for _, e in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')) do out[#out + 1] = e end end \
return out";

/// Most counters [`PRESENT`] keeps as too low for an initial share (the soonest to end go; the
/// script's `-1025` is this less one).
pub const MAX_LOW: usize = 1024;

/// The answer to a rate limit service process's note of itself as present ([`Kv::present`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Presence {
    /// The processes heard within [`NODE_TTL`], this one included.
    pub processes: u32,
    /// Redis's clock then, ns.
    pub now: Nanos,
    /// The counters on which a process new to them may not spend an initial share blind, as
    /// some process found them (too little left beside what grants hold): each counter's key
    /// and until when, ns of Redis's clock; with the list's version. None: unchanged since the
    /// version the process read last.
    pub low: Option<LowList>,
}

/// The counters too low for an initial share, each with its time, and the list's version
/// ([`Presence::low`]).
pub type LowList = (String, Vec<(String, Nanos)>);

/// What the health checks run: Redis's clock and a write, through a script, as every command
/// of the store needs them. A Redis that answers `PING` but refuses writes (out of memory
/// under `noeviction`, a read-only replica, an ACL user without `EVALSHA` or `TIME`) serves
/// no call: the store is not healthy then. Nor is it when a key of the registry
/// ([`REGISTRY_KEYS`], `KEYS[2..]`) holds a value of another type than the registry writes
/// there (`ARGV`: those types): every batch fails on it, and the error names the key.
pub const PROBE: &str = "redis.call('TIME') \
for i = 2, #KEYS do local t = redis.call('TYPE', KEYS[i]).ok \
if t ~= 'none' and t ~= ARGV[i - 1] then return redis.error_reply('WRONGTYPE ' .. KEYS[i] .. ' holds a ' .. t .. \
' where the node registry keeps a ' .. ARGV[i - 1] .. ': every batch fails until it is deleted') end end \
redis.call('SET', KEYS[1], '1', 'PX', 10000) return 1";

/// The key [`PROBE`] writes (in the registry's slot).
pub const PROBE_KEY: &str = "rw:{registry}:probe";

/// The type of each of [`REGISTRY_KEYS`], as Redis's `TYPE` names it.
pub const REGISTRY_TYPES: [&str; 4] = ["hash", "zset", "zset", "string"];

/// The key of the rate limit service's processes ([`PRESENT`]).
pub const PRESENT_KEY: &str = "rw:{rls-processes}";

/// The keys of the counters too low for an initial share and of their version ([`PRESENT`]),
/// in the processes' slot.
pub const LOW_KEYS: [&str; 2] = ["rw:{rls-processes}:low", "rw:{rls-processes}:low-version"];

/// A key never written, read for Redis's clock when a call names no counter (a heartbeat).
pub const CLOCK_KEY: &str = "rw:{registry}:clock";

/// The registry's keys, in one slot (a Cluster needs a script's keys together).
pub const REGISTRY_KEYS: [&str; 4] =
    ["rw:{registry}:seq", "rw:{registry}:seen", "rw:{registry}:asks", "rw:{registry}:ask-floor"];

/// The Redis key of a counter: its key in hex inside a hash tag, so each counter has a slot of
/// its own (no hot slot per rule).
pub fn redis_key(key: &[u8]) -> String {
    format!("rw:{{{}}}", hex(key))
}

/// A log line said at most once per [`Quiet::EVERY`] however often it happens (while Redis
/// refuses the store, every request would say it), with how many times it was held back.
#[derive(Default)]
pub struct Quiet(std::sync::Mutex<(Option<std::time::Instant>, u64)>);

impl Quiet {
    /// How often at most a line is said.
    pub const EVERY: std::time::Duration = std::time::Duration::from_secs(10);

    /// Logs `line` unless held back, with how many `held` (what it counts: "failed
    /// attempt(s)") were held back since the line before.
    pub fn log(&self, line: &str, held: &str) {
        match self.say(std::time::Instant::now()) {
            Some(0) => log_line!("ratewall-store: {line}"),
            Some(n) => log_line!("ratewall-store: {line} ({n} more {held} since the last line)"),
            None => {}
        }
    }

    /// Whether to say it at `now`: `Some(n)` with the `n` times it was held back since it was
    /// last said, `None` to hold it back.
    pub fn say(&self, now: std::time::Instant) -> Option<u64> {
        let Ok(mut s) = self.0.lock() else { return Some(0) };
        match s.0 {
            Some(last) if now.saturating_duration_since(last) < Quiet::EVERY => {
                s.1 = s.1.saturating_add(1);
                None
            }
            _ => {
                s.0 = Some(now);
                Some(std::mem::take(&mut s.1))
            }
        }
    }
}

/// What the store needs of Redis (a fake in the unit tests).
pub trait Kv: Send + Sync + 'static {
    /// The value of `key` (None: absent) and the clock of its primary, ns.
    fn read(&self, key: &str) -> impl Future<Output = Result<(Option<Vec<u8>>, Nanos), String>> + Send;
    /// Sets `key` to `new` for `ttl_ms` if it still holds `old` (None: absent).
    /// Not written past `deadline_ms` of the key's clock (0: no deadline): an error then.
    fn cas(
        &self,
        key: &str,
        old: Option<&[u8]>,
        new: &[u8],
        ttl_ms: u64,
        deadline_ms: u64,
    ) -> impl Future<Output = Result<Cas, String>> + Send;
    /// The registry, for a request made at `sent` (the node's clock): `Ok(nodes heard within
    /// the TTL, the nodes heard lately in id order)`, or why not.
    fn heard(
        &self,
        node: u64,
        seq: u64,
        batch: bool,
        sent: Nanos,
    ) -> impl Future<Output = Result<(u32, Vec<u64>), Unheard>> + Send;
    /// Closes batch `seq` of `node`, answered with counters it could not apply
    /// ([`ratewall_core::sync::Registry::close`]): a repeat of it is refused as an older batch.
    fn close(&self, node: u64, seq: u64) -> impl Future<Output = Result<(), String>> + Send;
    /// Notes rate limit service process `node` as heard now ([`PRESENT`]), and the counters it
    /// found too low for an initial share (`low`: key, until when in ns of Redis's clock); the
    /// list of those counters comes back when its version is not `seen`.
    fn present(
        &self,
        node: u64,
        low: &[(String, Nanos)],
        seen: &str,
    ) -> impl Future<Output = Result<Presence, String>> + Send;
    /// Whether Redis answers and takes the store's writes ([`PROBE`]); why not.
    fn ping(&self) -> impl Future<Output = Result<(), String>> + Send;
    /// Appends `payload` to the stream `key` ([`APPEND`]).
    fn append(
        &self,
        key: &str,
        payload: &[u8],
        len: u64,
        ttl_ms: u64,
    ) -> impl Future<Output = Result<(), String>> + Send;
    /// The stream `key`'s entries after the id `after`, at most `count`, and the id of the
    /// last one (`after` when none); with `after` None, none and the stream's last id
    /// ([`READ_AFTER`]).
    fn read_after(
        &self,
        key: &str,
        after: Option<&str>,
        count: usize,
    ) -> impl Future<Output = Result<(String, Vec<Vec<u8>>), String>> + Send;
}

/// Appends a share to the stream `KEYS[1]`, trimmed to about `ARGV[2]` entries, and sets the
/// stream to expire `ARGV[3]` ms later.
pub const APPEND: &str = "local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'p', ARGV[1]) \
    redis.call('PEXPIRE', KEYS[1], ARGV[3]) return id";

/// The entries of the stream `KEYS[1]` after the id `ARGV[1]`, at most `ARGV[2]`: `{last id,
/// payload...}`; with `ARGV[1]` empty, only the stream's last id (`0-0` when it is empty).
pub const READ_AFTER: &str = "if ARGV[1] == '' then \
    local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1) \
    if #last == 0 then return {'0-0'} end return {last[1][1]} end \
    local es = redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2]) \
    local out = {ARGV[1]} \
    for _, e in ipairs(es) do out[1] = e[1] out[#out + 1] = e[2][2] end return out";

/// Why the registry refused a call, or could not say. Nothing is changed in either case.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unheard {
    /// A batch older than the node's latest (this one).
    Older(u64),
    /// A request made further than [`MAX_REQUEST_SKEW`](ratewall_core::sync::MAX_REQUEST_SKEW)
    /// from the registry's clock (this).
    Skewed(Nanos),
    /// An ask already answered: a replay of a captured one.
    Repeated,
    /// Redis failed: why.
    Failed(String),
}

/// The store's counters, exported at `GET /metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Batches and asks answered 200.
    pub sync_ok: AtomicU64,
    /// Calls refused or failed, by status.
    pub status_400: AtomicU64,
    /// Unsigned or forged.
    pub status_401: AtomicU64,
    /// The body did not arrive in time.
    pub status_408: AtomicU64,
    /// An older seq.
    pub status_409: AtomicU64,
    /// Too large.
    pub status_413: AtomicU64,
    /// Of a protocol version this store does not speak.
    pub status_415: AtomicU64,
    /// Made too far from the store's clock (a node's clock is off, or a replay).
    pub status_422: AtomicU64,
    /// Redis failed or was too slow.
    pub status_503: AtomicU64,
    /// Counter updates written.
    pub counter_writes: AtomicU64,
    /// Compare-and-swap attempts that found the value changed and ran again.
    pub cas_conflicts: AtomicU64,
    /// Counters whose compare-and-swap attempts ran out.
    pub cas_exhausted: AtomicU64,
    /// Redis commands that failed, and calls Redis did not answer within the deadline.
    pub redis_errors: AtomicU64,
    /// Stored counters that did not decode (kept, never overwritten).
    pub unreadable: AtomicU64,
    /// Units counted from batches and asks.
    pub units_counted: AtomicU64,
    /// Counter answers given while part of the quota was held for filter nodes taken as cut
    /// off from the store.
    pub cut_off_answers: AtomicU64,
    /// Shares of what this process heard written to the shared stream, and those that
    /// could not be (kept for the next).
    pub top_shared: AtomicU64,
    pub top_share_failed: AtomicU64,
    /// Peers' shares read from the stream and merged.
    pub top_peer_shares: AtomicU64,
}

impl Metrics {
    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut counter = |name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", v.load(Ordering::Relaxed));
        };
        counter("ratewall_store_sync_ok_total", "Sync calls answered 200.", &self.sync_ok);
        // Not `…_counter_writes_total`: promtool's lint refuses a metric name with a type in it.
        counter("ratewall_store_state_writes_total", "Counter states written to Redis.", &self.counter_writes);
        counter(
            "ratewall_store_units_counted_total",
            "Units counted from batches and asks answered here (one written after its deadline, answered 503, is counted in Redis, not here).",
            &self.units_counted,
        );
        counter(
            "ratewall_store_cut_off_answers_total",
            "Counter answers given while part of the quota was held for proxies taken as cut off.",
            &self.cut_off_answers,
        );
        counter("ratewall_store_cas_conflicts_total", "Compare-and-swap attempts that ran again.", &self.cas_conflicts);
        counter(
            "ratewall_store_cas_exhausted_total",
            "Counters whose compare-and-swap attempts ran out.",
            &self.cas_exhausted,
        );
        counter(
            "ratewall_store_redis_errors_total",
            "Redis commands that failed, and calls Redis did not answer within the deadline.",
            &self.redis_errors,
        );
        counter("ratewall_store_unreadable_counters_total", "Stored counters that did not decode.", &self.unreadable);
        counter(
            "ratewall_store_top_shared_total",
            "Shares of top offenders written for peer processes.",
            &self.top_shared,
        );
        counter(
            "ratewall_store_top_share_failed_total",
            "Shares of top offenders Redis did not take (kept for the next).",
            &self.top_share_failed,
        );
        counter(
            "ratewall_store_top_peer_shares_total",
            "Peer processes' shares of top offenders merged.",
            &self.top_peer_shares,
        );
        let _ = writeln!(out, "# HELP ratewall_store_sync_failed_total Sync calls not answered 200, by status.");
        let _ = writeln!(out, "# TYPE ratewall_store_sync_failed_total counter");
        for (status, v) in [
            (400, &self.status_400),
            (401, &self.status_401),
            (408, &self.status_408),
            (409, &self.status_409),
            (413, &self.status_413),
            (415, &self.status_415),
            (422, &self.status_422),
            (503, &self.status_503),
        ] {
            let _ =
                writeln!(out, "ratewall_store_sync_failed_total{{status=\"{status}\"}} {}", v.load(Ordering::Relaxed));
        }
        out
    }
}

/// An HTTP answer: status, signature header (200s), body.
#[derive(Debug, PartialEq, Eq)]
pub struct Answer {
    /// HTTP status.
    pub status: u16,
    /// `x-ratewall-signature` (hex), on a 200.
    pub signature: Option<String>,
    /// Body: the encoded response, or a reason.
    pub body: Vec<u8>,
}

impl Answer {
    fn error(status: u16, why: impl Into<String>) -> Answer {
        Answer { status, signature: None, body: why.into().into_bytes() }
    }
}

/// The store: settings, metrics and a [`Kv`].
pub struct Store<K> {
    /// Redis (or a fake).
    pub kv: K,
    secret: Vec<u8>,
    /// A secret being rotated out (`RATEWALL_SYNC_SECRET_PREVIOUS`): a batch signed with it is
    /// accepted too, and answered signed with it, so proxies move to the new secret one by one.
    previous: Option<Vec<u8>>,
    /// How long a call may take before it is a 503.
    pub deadline: Duration,
    /// Its counters.
    pub metrics: Metrics,
    /// The fleet's top offenders, traffic and nodes, from the batches this process answered.
    pub top: top::Top,
    /// Counters being updated by this process: concurrent calls naming the same counter take
    /// turns here, so compare-and-swap conflicts come only from other processes (measured:
    /// 8 senders on one hot counter through two processes ran out of 16 attempts without it).
    busy: std::sync::Mutex<std::collections::HashMap<String, Turn>>,
    /// The updates waiting for each counter's turn: the call whose turn comes applies every
    /// one waiting, in order, with one compare-and-swap, so a hot counter named by many
    /// batches at once costs a Redis round trip per turn, not per batch (200 batches at once
    /// on one counter: 140 answered 503 past the 50 ms deadline when each took its own).
    waiting: std::sync::Mutex<std::collections::HashMap<String, Vec<Job>>>,
    /// The value this process last wrote to each counter, with the key's clock then: the next
    /// update runs its transition on it and goes straight to the compare-and-set — one Redis
    /// call instead of a read and a write — and when another process wrote in between, the
    /// failed compare-and-set returns the value to run again on. At most [`KNOWN`] counters.
    known: std::sync::Mutex<std::collections::HashMap<String, Known>>,
    /// Counters this process found out of quota, named to every node with each batch answer
    /// (`ratewall_core::sync::Out`; each process names those its own calls found).
    out: std::sync::Mutex<Out>,
    /// Stored counters that do not decode, said at most once per [`Quiet::EVERY`].
    unreadable: Quiet,
    /// Sync calls past the deadline, as often.
    late: Quiet,
    /// Asks answered 503 whose units could not be given back, as often.
    unreturned: Quiet,
}

/// A counter's turn within the process.
type Turn = std::sync::Arc<tokio::sync::Mutex<()>>;

/// One call's update of a counter, waiting for the counter's turn ([`Store::waiting`]).
struct Job {
    node: u64,
    seq: u64,
    ask: bool,
    units: u64,
    limit: Limit,
    lately: std::sync::Arc<[u64]>,
    /// What the call read of the counter (an ask's, before any counter took a unit).
    read: Option<Read>,
    /// An ask's: when its call is answered 503 if not before. Its units are not written later
    /// (nodes do not retry asks, and its request was decided as with the store out of reach):
    /// past it, less [`ANSWER_MARGIN`], it is answered 503 unapplied, and a compare-and-set that
    /// carries it is not written on Redis's clock. Twelve nodes asking at once on one counter
    /// of a loaded store had nine asks answered 503, two of which took their units after.
    deadline: Option<std::time::Instant>,
    done: tokio::sync::oneshot::Sender<Result<Update, Answer>>,
}

/// A counter's value as this process last wrote it, the key's clock then, and when (ours).
type Known = (Vec<u8>, Nanos, std::time::Instant);

/// Most counters whose last written value a process keeps.
pub const KNOWN: usize = 100_000;

impl<K: Kv> Store<K> {
    /// Counts a stored counter at Redis key `rkey` that does not decode (`why`), and says so
    /// at most once per [`Quiet::EVERY`], naming the key (its first 100 characters: a
    /// `redis-cli --scan --pattern` finds it) — hex of the counter's key, where secret values
    /// are keyed hashes already.
    pub fn said_unreadable(&self, rkey: &str, why: &str) {
        self.metrics.unreadable.fetch_add(1, Ordering::Relaxed);
        let shown = match rkey.char_indices().nth(100) {
            Some((i, _)) => format!("{}…", &rkey[..i]),
            None => rkey.to_owned(),
        };
        self.unreadable.log(
            &format!("the counter at Redis key {shown} is unreadable ({why}): it is kept, and calls on it fail until it is deleted"),
            "unreadable counter read(s)",
        );
    }

    /// A store over `kv` with the shared secret and a deadline per call.
    pub fn new(kv: K, secret: &[u8], deadline: Duration) -> Store<K> {
        Store {
            kv,
            secret: secret.to_vec(),
            previous: None,
            deadline,
            metrics: Metrics::default(),
            top: top::Top::default(),
            busy: Default::default(),
            waiting: Default::default(),
            known: Default::default(),
            out: Default::default(),
            unreadable: Quiet::default(),
            late: Quiet::default(),
            unreturned: Quiet::default(),
        }
    }

    /// `answer`, counted in the sync metrics by its status.
    fn counted(&self, answer: Answer) -> Answer {
        self.count(answer.status);
        answer
    }

    /// Counts a sync call answered `status` in the sync metrics.
    fn count(&self, status: u16) {
        let m = &self.metrics;
        let c = match status {
            400 => &m.status_400,
            401 => &m.status_401,
            408 => &m.status_408,
            409 => &m.status_409,
            413 => &m.status_413,
            415 => &m.status_415,
            422 => &m.status_422,
            503 => &m.status_503,
            _ => &m.sync_ok,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Shares what this process heard with its peers on the same Redis
    /// ([`top`](crate::top)), and, with `read`, merges theirs from `cursor` on (None: from
    /// now). Once per [`top::SHARE_EVERY`], by [`Store::share_top_forever`].
    /// Returns whether it called Redis.
    pub async fn share_top(&self, read: bool, cursor: &mut Option<String>) -> bool {
        let shared = self.top.take_share();
        let called = read || shared.is_some();
        if let Some(share) = shared {
            let payload = share.encode();
            let write = self.kv.append(top::SHARED_STREAM, &payload, top::SHARED_LEN, top::SHARED_TTL_MS);
            match tokio::time::timeout(self.deadline, write).await {
                Ok(Ok(())) => self.metrics.top_shared.fetch_add(1, Ordering::Relaxed),
                _ => {
                    self.top.unshared(share);
                    self.metrics.top_share_failed.fetch_add(1, Ordering::Relaxed)
                }
            };
        }
        if !read {
            return called;
        }
        let mut read_count = 0;
        while read_count < top::READ_PER_INTERVAL {
            let want = (top::READ_PER_INTERVAL - read_count).min(128);
            let read = self.kv.read_after(top::SHARED_STREAM, cursor.as_deref(), want);
            let Ok(Ok((last, entries))) = tokio::time::timeout(self.deadline, read).await else { return called };
            let first = cursor.is_none();
            *cursor = Some(last);
            read_count += entries.len();
            for e in &entries {
                // A share this version cannot read (a newer store's) is skipped.
                if let Ok(share) = top::Share::decode(e) {
                    if share.process != self.top.process() {
                        self.top.merge_share(&share);
                        self.metrics.top_peer_shares.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            if first || entries.len() < want {
                return called;
            }
        }
        called
    }

    /// Where a process with an admin listener starts reading its peers' shares: the shared
    /// stream's start, so that a process started (or restarted) later shows the hour its peers
    /// (and the process it replaces, under another id) shared before it, as far as the stream
    /// keeps it ([`top::SHARED_LEN`] shares), read [`top::READ_PER_INTERVAL`] a second. From
    /// the stream's end, a restarted admin store's `window=1h` and series started empty.
    pub async fn join_shares(&self) -> Option<String> {
        Some("0-0".to_owned())
    }

    /// [`Store::share_top`] every [`top::SHARE_EVERY`], for ever, reading peers' shares (with
    /// `read`) from `cursor` ([`Store::join_shares`]) on.
    pub async fn share_top_forever(&self, read: bool, mut cursor: Option<String>) {
        loop {
            tokio::time::sleep(top::SHARE_EVERY).await;
            if !self.share_top(read, &mut cursor).await {
                // An idle process still asks Redis the time once a second: a connection Redis
                // dropped (a restart) is found dead and made again now, where otherwise the
                // next batch, or `/healthz`, failed on it once Redis was back.
                let _ = tokio::time::timeout(self.deadline, self.kv.read(CLOCK_KEY)).await;
            }
        }
    }

    /// `POST /v1/sync`: checks, applies within the deadline, answers.
    pub async fn sync(self: &std::sync::Arc<Self>, body: &[u8], signature: Option<&[u8]>) -> Answer {
        self.counted(self.sync_checked(body, signature).await)
    }

    /// Accepts batches signed with `previous` too (a secret being rotated out), and answers
    /// each signed with the secret it came with.
    pub fn with_previous_secret(mut self, previous: &[u8]) -> Store<K> {
        self.previous = Some(previous.to_vec()).filter(|p| !p.is_empty() && *p != self.secret);
        self
    }

    /// A `POST /v1/sync` the listener turned away before its body was read whole (408: it
    /// did not arrive in time; 400: it could not be read; 503: too many bodies held): counted
    /// by its status, as every other refusal.
    pub fn sync_refused(&self, status: u16) {
        self.count(status);
    }

    /// `POST /v1/sync` with a body over [`MAX_BODY`] bytes, cut off before it was read whole
    /// (the listener reads no more): refused, and counted, as one read whole would be.
    pub fn sync_too_large(&self) -> Answer {
        self.counted(too_large())
    }

    async fn sync_checked(self: &std::sync::Arc<Self>, body: &[u8], signature: Option<&[u8]>) -> Answer {
        if body.len() > MAX_BODY {
            return too_large();
        }
        let tag = signature.and_then(|s| unhex(s.trim_ascii())).unwrap_or_default();
        // The time is checked by the registry, at Redis's clock. A batch the current secret does
        // not sign may be signed with the one being rotated out.
        let mut key = self.secret.as_slice();
        let mut verified = SyncRequest::verified(key, body, &tag, None);
        if let (Err(SyncError::Unauthorized), Some(previous)) = (&verified, &self.previous) {
            key = previous;
            verified = SyncRequest::verified(key, body, &tag, None);
        }
        let req = match verified {
            Ok(r) => r,
            Err(SyncError::Unauthorized) => return Answer::error(401, reason::UNSIGNED),
            Err(SyncError::Malformed(e)) => return Answer::error(400, reason::malformed(e)),
            Err(e) => return Answer::error(e.status(), e.to_string()),
        };
        if req.deltas.len() > MAX_DELTAS {
            return Answer::error(413, reason::too_many(MAX_DELTAS));
        }
        // The optional top section (verified with the rest of the body above).
        let section = SyncRequest::decode_with_top(body).ok().and_then(|(_, s)| s);
        let started = std::time::Instant::now();
        let applied = if req.ask {
            self.ask(&req, started + self.deadline).await
        } else {
            tokio::time::timeout(self.deadline, self.apply(&req, started + self.deadline)).await.ok()
        };
        let answer = match applied {
            Some(Ok(resp)) => {
                let out = resp.encode();
                Answer { status: 200, signature: Some(hex(&sign(key, &out))), body: out }
            }
            Some(Err(a)) => a,
            None => {
                self.metrics.redis_errors.fetch_add(1, Ordering::Relaxed);
                let ms = self.deadline.as_millis();
                self.late.log(
                    &format!(
                        "a sync call had no answer from Redis within the deadline ({ms} ms; --deadline-ms): Redis slow or \
                         paused, or this process too loaded to wait on it; answered 503"
                    ),
                    "call(s) past the deadline",
                );
                // An ask answered so gives back what it took ([`Store::ask`]).
                let then = if req.ask { "the ask takes nothing" } else { "retry the batch with the same seq" };
                Answer::error(
                    503,
                    format!(
                        "no answer from Redis within the store's deadline ({ms} ms): Redis slow or paused (on a \
                         Cluster, also a slot migrating or a primary failing over), or the store process loaded; {then}"
                    ),
                )
            }
        };
        if !req.ask {
            // A 409 (an older batch, which the node drops) is no failure of the node's; only a
            // counted batch's section is counted.
            let section = section.as_ref().filter(|_| answer.status == 200);
            self.top.heard(req.node, req.seq, matches!(answer.status, 200 | 409), started.elapsed(), section);
        }
        answer
    }

    /// An ask, answered by `deadline` (`None`: not in time). It runs on in a task of its own
    /// past it: a call dropped at its deadline while it carries the compare-and-set of other
    /// calls' asks, or whose write Redis made just in time but answered late, left units
    /// taken for asks answered 503 (twelve nodes asking at once on one counter of a loaded
    /// store: nine answered 503, two of which had taken their units). What an ask answered
    /// 503 took is given back when its task learns it ([`Store::give_back`]); the task ends
    /// within [`ASK_TASK_PAST`] of the deadline (a write it leaves on its way is not made past
    /// the ask's deadline, [`Job::deadline`]).
    async fn ask(
        self: &std::sync::Arc<Self>,
        req: &SyncRequest,
        deadline: std::time::Instant,
    ) -> Option<Result<SyncResponse, Answer>> {
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let (store, ask) = (std::sync::Arc::clone(self), req.clone());
        let task_for = store.deadline.saturating_add(ASK_TASK_PAST);
        tokio::spawn(async move {
            let Ok(applied) = tokio::time::timeout(task_for, store.apply_timed(&ask, deadline)).await else {
                store.unreturned.log(
                    "an ask had no answer from Redis long past its deadline: what it took, if anything, stays counted",
                    "ask(s) not given back",
                );
                return;
            };
            if let Err(Ok((_, taken))) = tx.send(applied) {
                store.give_back(&ask, &taken).await;
            }
        });
        let answered = tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), &mut rx).await;
        let applied = match answered {
            Ok(applied) => applied.ok(),
            // Closed first: an answer that comes after is given back, not lost between the two.
            Err(_) => {
                rx.close();
                rx.try_recv().ok()
            }
        };
        applied.map(|a| a.map(|(resp, _)| resp))
    }

    /// Gives back the units an ask answered 503 took on each of its counters, as of when each
    /// took them (`taken`, per delta: [`taken_at`]). Said in the log when it cannot: the units
    /// then stay counted. (The units its answer granted beside them stay held for the node for
    /// the ask's lease, 1 s.)
    async fn give_back(&self, req: &SyncRequest, taken: &[Option<Nanos>]) {
        for (d, at) in req.deltas.iter().zip(taken) {
            if let Some(at) = at {
                self.refund(&d.key, d.limit, d.units, *at).await;
            }
        }
    }

    /// Gives `units` taken at `taken_at` back to the counter at `key` (compare-and-swap).
    async fn refund(&self, key: &[u8], limit: Limit, units: u64, taken_at: Nanos) {
        let rkey = redis_key(key);
        for _ in 0..CAS_ATTEMPTS {
            let Ok((Some(stored), now)) = self.kv.read(&rkey).await else { break };
            let Ok(mut counter) = Counter::decode(limit, &stored) else { break };
            counter.refund(limit, now, taken_at, units);
            match self.kv.cas(&rkey, Some(&stored), &counter.encode(), ttl_ms(&counter), 0).await {
                Ok(Cas::Written(_)) => {
                    self.metrics.counter_writes.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                Ok(Cas::Changed(..)) => continue,
                Err(_) => break,
            }
        }
        self.unreturned.log(
            "an ask answered 503 had taken units, which could not be given back: they stay counted",
            "ask(s) not given back",
        );
    }

    /// Applies `req`, answered 503 at `deadline` (an ask's counters are not written past it).
    async fn apply(
        self: &std::sync::Arc<Self>,
        req: &SyncRequest,
        deadline: std::time::Instant,
    ) -> Result<SyncResponse, Answer> {
        self.apply_timed(req, deadline).await.map(|(resp, _)| resp)
    }

    /// [`Store::apply`], with what an ask took of each counter ([`taken_at`]).
    async fn apply_timed(
        self: &std::sync::Arc<Self>,
        req: &SyncRequest,
        deadline: std::time::Instant,
    ) -> Result<(SyncResponse, Vec<Option<Nanos>>), Answer> {
        // The registry first: a request made too far from Redis's clock, and an older batch,
        // are refused before any counter sees them.
        let (nodes, lately) = match self.kv.heard(req.node, req.seq, !req.ask, req.sent).await {
            Ok(n) => n,
            Err(Unheard::Older(last)) => return Err(Answer::error(409, reason::older(req.seq, last))),
            Err(Unheard::Repeated) => return Err(Answer::error(409, SyncError::Repeated { ask: req.seq }.to_string())),
            Err(Unheard::Skewed(now)) => {
                let e = SyncError::Skewed { sent: req.sent, now };
                return Err(Answer::error(e.status(), e.to_string()));
            }
            Err(Unheard::Failed(why)) => {
                self.metrics.redis_errors.fetch_add(1, Ordering::Relaxed);
                // Redis's reason (a refused password, a refused connection), which names no
                // secret: the node logs it.
                return Err(Answer::error(503, format!("{} ({why})", reason::REGISTRY_FAILED)));
            }
        };
        // An ask that names a counter this store cannot read fails whole: its counters are read
        // first, so that its other counters take nothing for it (and each update starts from
        // what was read).
        let read: Vec<Option<Read>> = if req.ask {
            let read = self.read_all(req).await?;
            let unreadable = |(d, (stored, _)): (&Delta, &Read)| {
                let e = Counter::decode(d.limit, stored.as_deref()?).err()?;
                Some((redis_key(&d.key), e.to_string()))
            };
            if let Some((rkey, why)) = req.deltas.iter().zip(&read).find_map(unreadable) {
                self.said_unreadable(&rkey, &why);
                return Err(Answer::error(503, reason::UNREADABLE_ASK));
            }
            read.into_iter().map(Some).collect()
        } else {
            vec![None; req.deltas.len()]
        };
        let lately: std::sync::Arc<[u64]> = lately.into();
        let updates = req
            .deltas
            .iter()
            .zip(read)
            .map(|(d, r)| self.update(req, &d.key, d.limit, d.units, &lately, (r, deadline)));
        let results = join_all(updates).await;
        // An ask that fails on one counter (or finds it unreadable) fails whole: what its
        // other counters took for it is given back (its request is decided as with the store
        // out of reach).
        let taken: Vec<Option<Nanos>> = req.deltas.iter().zip(&results).map(|(d, r)| taken_at(req, d, r)).collect();
        let fails = |r: &Result<Update, Answer>| r.is_err() || matches!(r, Ok(Update::Unreadable));
        if let Some(i) = results.iter().position(fails).filter(|_| req.ask) {
            self.give_back(req, &taken).await;
            let failure = results.into_iter().nth(i).and_then(Result::err);
            return Err(failure.unwrap_or_else(|| Answer::error(503, reason::UNREADABLE_ASK)));
        }
        let mut grants = Vec::with_capacity(results.len());
        let mut failed = Vec::new();
        let mut now = 0;
        let mut noted = Vec::with_capacity(results.len());
        for (i, (d, r)) in req.deltas.iter().zip(results).enumerate() {
            match r? {
                Update::Applied(a, at, out_for) => {
                    now = now.max(at);
                    noted.push((d.key.as_slice(), out_for, at));
                    grants.push(Grant::from_applied(&d.key, &a));
                }
                // A batch's other counters are answered: this one's units are sent again in
                // a later batch (nothing of them was counted), while one counter this store
                // cannot read would otherwise hold back every counter of the node's batches.
                Update::Unreadable if !req.ask => {
                    failed.push(u32::try_from(i).unwrap_or(u32::MAX));
                    grants.push(Grant::unapplied(&d.key));
                }
                // Checked before any counter took a unit ([`Store::readable`]): one that
                // became unreadable since takes nothing either.
                Update::Unreadable => return Err(Answer::error(503, reason::UNREADABLE_ASK)),
            }
        }
        if now == 0 {
            // A heartbeat: Redis's clock, read through a key that is never written.
            match self.kv.read(CLOCK_KEY).await {
                Ok((_, t)) => now = t,
                Err(_) => {
                    self.metrics.redis_errors.fetch_add(1, Ordering::Relaxed);
                    return Err(Answer::error(503, "Redis failed; retry the batch with the same seq"));
                }
            }
        }
        // Counters named failed send their units again under a later `seq`: a repeat of this
        // one, applied once such a counter could be read, would count them twice. Closed before
        // the answer, or not answered.
        if !failed.is_empty() && self.kv.close(req.node, req.seq).await.is_err() {
            self.metrics.redis_errors.fetch_add(1, Ordering::Relaxed);
            return Err(Answer::error(503, "Redis failed; retry the batch with the same seq"));
        }
        let mut resp = SyncResponse { seq: req.seq, now, nodes, grants, failed };
        if let Ok(mut out) = self.out.lock() {
            for (key, out_for, at) in noted {
                out.note(key, out_for, at);
            }
            out.name(now, req, &mut resp);
        }
        Ok((resp, taken))
    }

    /// What every counter `req` names holds, and its key's clock. An error when Redis failed.
    async fn read_all(&self, req: &SyncRequest) -> Result<Vec<Read>, Answer> {
        let reads = req.deltas.iter().map(|d| async move { self.kv.read(&redis_key(&d.key)).await });
        join_all(reads).await.into_iter().collect::<Result<_, _>>().map_err(|_| {
            self.metrics.redis_errors.fetch_add(1, Ordering::Relaxed);
            Answer::error(503, "Redis failed; the ask takes nothing")
        })
    }

    /// One counter's update: waits for the counter's turn, unless a call whose turn came
    /// first applied it meanwhile ([`Store::waiting`]). An error when Redis failed (whether the
    /// update was applied is unknown).
    async fn update(
        self: &std::sync::Arc<Self>,
        req: &SyncRequest,
        key: &[u8],
        limit: Limit,
        units: u64,
        lately: &std::sync::Arc<[u64]>,
        (read, deadline): (Option<Read>, std::time::Instant),
    ) -> Result<Update, Answer> {
        let rkey = redis_key(key);
        let (done, mut answer) = tokio::sync::oneshot::channel();
        let job = Job {
            node: req.node,
            seq: req.seq,
            ask: req.ask,
            units,
            limit,
            lately: std::sync::Arc::clone(lately),
            read,
            deadline: req.ask.then_some(deadline),
            done,
        };
        if let Ok(mut waiting) = self.waiting.lock() {
            waiting.entry(rkey.clone()).or_default().push(job);
        } else {
            return Err(Answer::error(503, "the store's state is unusable; retry the batch with the same seq"));
        }
        let turn: Option<Turn> =
            self.busy.lock().ok().map(|mut b| std::sync::Arc::clone(b.entry(rkey.clone()).or_default()));
        let guard = match &turn {
            Some(t) => Some(std::sync::Arc::clone(t).lock_owned().await),
            None => None,
        };
        drop(turn);
        match answer.try_recv() {
            Ok(result) => {
                self.turn_done(&rkey, guard);
                result
            }
            // Taken by a turn whose task ended before it answered (it cannot: each is
            // answered): whether it was written is unknown, as when Redis fails.
            Err(tokio::sync::oneshot::error::TryRecvError::Closed) => {
                self.turn_done(&rkey, guard);
                Err(Answer::error(503, "Redis failed; retry the batch with the same seq"))
            }
            Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {
                let jobs = self.waiting.lock().ok().and_then(|mut w| w.remove(&rkey)).unwrap_or_default();
                if jobs.iter().any(|j| j.ask) {
                    // In a task of its own, with the turn: a call dropped at its deadline does
                    // not drop the asks of other calls it carries (they are answered as Redis
                    // answers: one written in time but answered late, whose call was answered
                    // 503, is given back, [`Store::ask`]). Batches alone need no task (one
                    // dropped so is sent again under its seq) and spawn none, at tens of
                    // thousands of counter turns a second.
                    let store = std::sync::Arc::clone(self);
                    let run = tokio::spawn(async move {
                        store.update_locked(&rkey, jobs).await;
                        store.turn_done(&rkey, guard);
                    });
                    let _ = run.await;
                } else {
                    self.update_locked(&rkey, jobs).await;
                    self.turn_done(&rkey, guard);
                }
                answer
                    .try_recv()
                    .unwrap_or_else(|_| Err(Answer::error(503, "Redis failed; retry the batch with the same seq")))
            }
        }
    }

    /// A counter's turn is over: the next waiting call takes it, and the counter is forgotten
    /// from [`Store::busy`] once no call waits for it (the map holds only counters in use).
    fn turn_done(&self, rkey: &str, guard: Option<tokio::sync::OwnedMutexGuard<()>>) {
        drop(guard);
        if let Ok(mut busy) = self.busy.lock() {
            if busy.get(rkey).is_some_and(|t| std::sync::Arc::strong_count(t) <= 1) {
                busy.remove(rkey);
            }
        }
    }

    /// The compare-and-swap loop of the updates `jobs` of one counter, each answered in turn:
    /// read (or take the value this process last wrote), run the core's transition of each
    /// update in order, write if still unchanged.
    async fn update_locked(&self, rkey: &str, mut jobs: Vec<Job>) {
        let answer = |jobs: Vec<Job>, each: &mut dyn FnMut(&Job) -> Result<Update, Answer>| {
            for job in jobs {
                let r = each(&job);
                let _ = job.done.send(r);
            }
        };
        let unavailable = |m: &Metrics| {
            m.redis_errors.fetch_add(1, Ordering::Relaxed);
            Answer::error(503, "Redis failed; retry the batch with the same seq")
        };
        // One counter's: one key, so one limit (the key names it).
        let Some(limit) = jobs.first().map(|j| j.limit) else { return };
        // The value last written here, at the key's clock now (its clock then, plus the time
        // since on ours); else what an ask read.
        let mut current: Option<Read> = self
            .known
            .lock()
            .ok()
            .and_then(|k| {
                k.get(rkey).map(|(v, t, at)| {
                    let since = u64::try_from(at.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    (Some(v.clone()), t.saturating_add(since))
                })
            })
            .or_else(|| jobs.iter().find_map(|j| j.read.clone()));
        for attempt in 0..CAS_ATTEMPTS {
            // Asks whose calls were answered 503 meanwhile (or are about to be) take nothing.
            let soon = std::time::Instant::now() + ANSWER_MARGIN;
            let (late, on_time): (Vec<Job>, Vec<Job>) =
                std::mem::take(&mut jobs).into_iter().partition(|j| j.deadline.is_some_and(|d| d <= soon));
            jobs = on_time;
            answer(late, &mut |_| Err(Answer::error(503, ASK_PAST_DEADLINE)));
            if jobs.is_empty() {
                return;
            }
            let cached = current.is_some() && attempt == 0;
            let (stored, now) = match current.take() {
                Some(c) => c,
                None => match self.kv.read(rkey).await {
                    Ok(r) => r,
                    Err(_) => return answer(jobs, &mut |_| Err(unavailable(&self.metrics))),
                },
            };
            let mut counter = match &stored {
                None => Counter::new(limit),
                Some(bytes) => match Counter::decode(limit, bytes) {
                    Ok(c) => c,
                    Err(e) => {
                        // Kept as it is: a counter is never reset because it could not be read.
                        self.said_unreadable(rkey, &e.to_string());
                        return answer(jobs, &mut |_| Ok(Update::Unreadable));
                    }
                },
            };
            let mut applied = Vec::with_capacity(jobs.len());
            let mut write = false;
            let mut stale = false;
            for job in &jobs {
                counter.heard_lately(&job.lately);
                let a = if job.ask {
                    counter.ask(job.limit, now, job.node, job.seq, job.units, NODE_TTL)
                } else {
                    counter.apply(job.limit, now, job.node, job.seq, job.units, NODE_TTL)
                };
                // A repeat judged on what this process last wrote is answered from Redis's
                // value (another process may have counted more since); one judged on that
                // value has nothing to write.
                let repeat = !a.counted && stored.is_some() && !job.ask;
                stale |= repeat && cached;
                write |= !repeat;
                applied.push((a, counter.last_seen, counter.out_for(counter.last_seen)));
            }
            if stale {
                continue;
            }
            let results = |jobs: Vec<Job>, applied: Vec<(ratewall_core::sync::Applied, Nanos, Option<Nanos>)>| {
                let mut applied = applied.into_iter();
                answer(jobs, &mut |job| {
                    let (a, last_seen, out_for) = applied.next().ok_or_else(|| unavailable(&self.metrics))?;
                    if write && a.counted {
                        let n = if job.ask { a.grant.min(job.units) } else { job.units };
                        // Saturating: a counter exported to Prometheus never goes back. A
                        // delta counts at most 2^32 − 1 here (one of 2^64 − 1 units, which a
                        // node could send, pinned the metric at its end for good).
                        let n = n.min(u64::from(u32::MAX));
                        let _ = self
                            .metrics
                            .units_counted
                            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_add(n)));
                    }
                    Ok(Update::Applied(a, last_seen, out_for))
                })
            };
            if !write {
                return results(jobs, applied);
            }
            let ttl_ms = ttl_ms(&counter);
            let new = counter.encode();
            // No deadline for batches: one written late is one its node retries under the same
            // seq, which counts it once. Asks carried are not written past the earliest of
            // their deadlines, on the key's clock (`now` was read before: the time left is
            // measured from later, so the deadline there comes no later than ours).
            let deadline_ms = jobs.iter().filter_map(|j| j.deadline).min().map_or(0, |d| {
                let left = d.saturating_duration_since(std::time::Instant::now()).saturating_sub(ANSWER_MARGIN);
                now.saturating_add(u64::try_from(left.as_nanos()).unwrap_or(u64::MAX)) / 1_000_000
            });
            match self.kv.cas(rkey, stored.as_deref(), &new, ttl_ms, deadline_ms).await {
                Ok(Cas::Written(at)) => {
                    if let Ok(mut known) = self.known.lock() {
                        if known.len() >= KNOWN && !known.contains_key(rkey) {
                            known.clear();
                        }
                        known.insert(rkey.to_owned(), (new, at, std::time::Instant::now()));
                    }
                    self.metrics.counter_writes.fetch_add(1, Ordering::Relaxed);
                    if counter.held_for_cut_off(counter.last_seen) > 0 {
                        self.metrics.cut_off_answers.fetch_add(jobs.len() as u64, Ordering::Relaxed);
                    }
                    return results(jobs, applied);
                }
                Ok(Cas::Changed(value, at)) => {
                    // Counted here, not per attempt: a repeat judged on the cached value runs
                    // again with no compare-and-swap lost.
                    self.metrics.cas_conflicts.fetch_add(1, Ordering::Relaxed);
                    current = Some((value, at));
                }
                Err(_) => {
                    // Unknown whether it was written: forget the value, read it next time.
                    if let Ok(mut known) = self.known.lock() {
                        known.remove(rkey);
                    }
                    // Refused at its asks' deadline (Redis's clock, read early, may say so a
                    // little before ours), or failed: the asks are answered 503 (nodes do not
                    // send an ask again), and the batches carried go on without them, on what
                    // Redis holds (one applied already is a repeat there, counted once).
                    if deadline_ms > 0 {
                        let (asks, batches): (Vec<Job>, Vec<Job>) =
                            std::mem::take(&mut jobs).into_iter().partition(|j| j.deadline.is_some());
                        answer(asks, &mut |_| Err(Answer::error(503, ASK_FAILED)));
                        jobs = batches;
                        if !jobs.is_empty() {
                            continue;
                        }
                        return;
                    }
                    return answer(jobs, &mut |_| Err(unavailable(&self.metrics)));
                }
            }
        }
        self.metrics.cas_exhausted.fetch_add(1, Ordering::Relaxed);
        answer(jobs, &mut |_| {
            Err(Answer::error(503, "a counter was too contended; retry the batch with the same seq"))
        });
    }
}

/// What one counter's call did.
enum Update {
    /// Applied (or a repeat answered again): the answer, the key's clock, and how long the
    /// counter is out of quota ([`Counter::out_for`]).
    Applied(ratewall_core::sync::Applied, Nanos, Option<Nanos>),
    /// Its stored value does not decode here (a newer store wrote it, or it is damaged):
    /// nothing was applied, and the value is kept as it is.
    Unreadable,
}

/// A stored value (None: absent) and its key's clock when it was read.
type Read = (Option<Vec<u8>>, Nanos);

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]
    use super::*;
    use crate::fake::FakeKv;
    use ratewall_core::sync::Delta;
    use ratewall_core::Algorithm;

    const SECRET: &[u8] = b"unit-test-secret-0123";

    fn limit() -> Limit {
        Limit::new(Algorithm::FixedWindow, 100, 3600 * SECOND, None).unwrap()
    }

    async fn call(store: &std::sync::Arc<Store<FakeKv>>, node: u64, seq: u64, units: &[(&[u8], u64)]) -> Answer {
        let sent = store.kv.now.load(Ordering::Relaxed);
        call_at(store, SyncRequest { node, seq, sent, deltas: deltas(units), ask: false }).await
    }

    fn deltas(units: &[(&[u8], u64)]) -> Vec<Delta> {
        units.iter().map(|(k, u)| Delta { key: k.to_vec(), limit: limit(), units: *u }).collect()
    }

    async fn call_at(store: &std::sync::Arc<Store<FakeKv>>, req: SyncRequest) -> Answer {
        let body = req.encode();
        store.sync(&body, Some(hex(&sign(SECRET, &body)).as_bytes())).await
    }

    fn remaining(a: &Answer) -> Vec<u64> {
        SyncResponse::decode(&a.body).unwrap().grants.iter().map(|g| g.remaining).collect()
    }

    fn denied_in(store: &Store<FakeKv>) -> u64 {
        store.top.top(None, top::Window::Minute)["rules"][0]["denied"].as_u64().unwrap_or(0)
    }

    fn peer_share(process: u64, denied: u64) -> top::Share {
        use ratewall_core::sync::{RuleTop, TopSection};
        let mut summary = ratewall_core::topk::Summary::default();
        summary.add(b"user=alice", denied, 0, 1);
        let rule = RuleTop { rule: "r".into(), allowed: 1, denied, shadow_denied: 0, top: summary };
        let unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        top::Share { process, seq: denied, seconds: vec![(unix, TopSection { rules: vec![rule] })], nodes: Vec::new() }
    }

    /// While the secret is rotated, a batch signed with the one going out is counted and
    /// answered signed with it (the proxy that sent it checks the answer with it); one signed
    /// with neither is refused.
    #[tokio::test]
    async fn a_batch_signed_with_the_secret_being_rotated_out_is_answered_with_it() {
        const OLD: &[u8] = b"the secret going out, 16+";
        let store = std::sync::Arc::new(
            Store::new(FakeKv::default(), SECRET, Duration::from_secs(1)).with_previous_secret(OLD),
        );
        let sent = store.kv.now.load(Ordering::Relaxed);
        for (seq, key, status) in [(1, SECRET, 200), (2, OLD, 200), (3, b"neither of the two secrets", 401)] {
            let body = SyncRequest { node: 1, seq, sent, deltas: deltas(&[(b"k", 1)]), ask: false }.encode();
            let a = store.sync(&body, Some(hex(&sign(key, &body)).as_bytes())).await;
            assert_eq!(a.status, status, "seq {seq}");
            if status == 200 {
                assert_eq!(a.signature, Some(hex(&sign(key, &a.body))), "seq {seq}");
            }
        }
        assert_eq!(remaining(&call(&store, 2, 1, &[(b"k", 0)]).await), [98]);
        // Without it, the old secret is refused.
        let store = std::sync::Arc::new(Store::new(FakeKv::default(), SECRET, Duration::from_secs(1)));
        let body = SyncRequest { node: 1, seq: 1, sent, deltas: deltas(&[(b"k", 1)]), ask: false }.encode();
        assert_eq!(store.sync(&body, Some(hex(&sign(OLD, &body)).as_bytes())).await.status, 401);
    }

    /// A store with a 30 ms deadline whose counters `keys` have taken 10 units each, and the
    /// turn of counter `held` (as a call of this process on it would hold it) for the test to
    /// take.
    async fn with_turn(keys: &[&[u8]], held: &[u8]) -> (std::sync::Arc<Store<FakeKv>>, Turn) {
        let store = std::sync::Arc::new(Store::new(FakeKv::default(), SECRET, Duration::from_millis(30)));
        let units: Vec<(&[u8], u64)> = keys.iter().map(|k| (*k, 10)).collect();
        assert_eq!(remaining(&call(&store, 1, 1, &units).await), vec![90; keys.len()]);
        let turn = std::sync::Arc::clone(store.busy.lock().unwrap().entry(redis_key(held)).or_default());
        (store, turn)
    }

    /// An ask answered 503 at its deadline, still waiting for its counter's turn then, takes
    /// nothing when the turn comes (the call that holds it applies everything waiting).
    #[tokio::test]
    async fn an_ask_answered_at_its_deadline_takes_nothing_after() {
        let (store, turn) = with_turn(&[b"k"], b"k").await;
        let held = turn.lock().await;
        let sent = store.kv.now.load(Ordering::Relaxed);
        let ask = SyncRequest { node: 2, seq: (1 << 40) | 1, sent, deltas: deltas(&[(b"k", 4)]), ask: true };
        let answered = call_at(&store, ask).await;
        assert_eq!(answered.status, 503);
        assert!(String::from_utf8_lossy(&answered.body).contains("the ask takes nothing"));
        drop(held);
        // The next call on the counter takes the turn, with the ask's update still waiting.
        assert_eq!(store.waiting.lock().unwrap().get(&redis_key(b"k")).map(Vec::len), Some(1));
        assert_eq!(remaining(&call(&store, 1, 2, &[(b"k", 0)]).await), [90], "the ask took nothing");
    }

    /// An ask whose write Redis made in time but answered late (here carried by a batch's
    /// call, which the ask's answer does not wait for) is answered 503 and gives its units back.
    #[tokio::test]
    async fn an_ask_written_in_time_but_answered_late_gives_its_units_back() {
        let (store, turn) = with_turn(&[b"k"], b"k").await;
        let held = turn.lock().await;
        let batch = tokio::spawn({
            let store = std::sync::Arc::clone(&store);
            async move { call(&store, 1, 2, &[(b"k", 1)]).await }
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
        let sent = store.kv.now.load(Ordering::Relaxed);
        let ask = tokio::spawn({
            let store = std::sync::Arc::clone(&store);
            let ask = SyncRequest { node: 2, seq: (1 << 40) | 1, sent, deltas: deltas(&[(b"k", 4)]), ask: true };
            async move { call_at(&store, ask).await }
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
        store.kv.cas_reply_delay_ms.store(40, Ordering::Relaxed);
        drop(held);
        let (batch, ask) = (batch.await.unwrap(), ask.await.unwrap());
        store.kv.cas_reply_delay_ms.store(0, Ordering::Relaxed);
        assert_eq!((batch.status, ask.status), (503, 503));
        // The batch is sent again (counted once); the ask is not, and took nothing.
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(remaining(&call(&store, 1, 2, &[(b"k", 1)]).await), [89]);
    }

    /// An ask on two counters, one of which it waits for past its deadline: answered 503, it
    /// takes nothing on either.
    #[tokio::test]
    async fn an_ask_that_fails_on_one_counter_takes_nothing_on_the_others() {
        let (store, turn) = with_turn(&[b"a", b"b"], b"b").await;
        let held = turn.lock().await;
        let sent = store.kv.now.load(Ordering::Relaxed);
        let ask = SyncRequest { node: 2, seq: (1 << 40) | 1, sent, deltas: deltas(&[(b"a", 4), (b"b", 4)]), ask: true };
        assert_eq!(call_at(&store, ask).await.status, 503);
        drop(held);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(remaining(&call(&store, 1, 2, &[(b"a", 0), (b"b", 0)]).await), [90, 90]);
    }

    #[tokio::test]
    async fn answers_given_while_a_proxy_is_taken_as_cut_off_are_counted_and_leave_its_part_out() {
        let store = std::sync::Arc::new(Store::new(FakeKv::default(), SECRET, Duration::from_secs(1)));
        let at = |ms: u64| store.kv.now.store(1_700_000_000 * SECOND + ms * 1_000_000, Ordering::Relaxed);
        // Node 1 carries half the traffic, nodes 2 and 3 a quarter each: 40 units.
        for seq in 1..=10u64 {
            at(seq * 300);
            for (node, units) in [(2, 1), (3, 1), (1, 2)] {
                assert_eq!(call(&store, node, seq, &[(b"k", units)]).await.status, 200);
            }
        }
        assert_eq!(store.metrics.cut_off_answers.load(Ordering::Relaxed), 0);
        // Node 1 falls silent while the others report 30 units: at its part it would have had
        // about 8 to report.
        let mut last = Vec::new();
        for seq in 11..=25u64 {
            at(seq * 300);
            call(&store, 2, seq, &[(b"k", 1)]).await;
            last = remaining(&call(&store, 3, seq, &[(b"k", 1)]).await);
        }
        assert!(store.metrics.cut_off_answers.load(Ordering::Relaxed) > 0);
        assert!(store.metrics.render().contains("ratewall_store_cut_off_answers_total "));
        // 30 units remain; about 20 are held for node 1 (its part, as much as it was measured
        // over), so the answer shows fewer.
        assert!(last[0] <= 15, "remaining {last:?}");
    }

    #[tokio::test]
    async fn a_batch_answer_names_the_counters_this_process_found_out_of_quota() {
        let store = std::sync::Arc::new(Store::new(FakeKv::default(), SECRET, Duration::from_secs(1)));
        let a = call(&store, 1, 1, &[(b"spent", 100), (b"other", 1)]).await;
        assert_eq!(remaining(&a), [0, 99], "a batch's own counters have their grants");
        // Another node's heartbeat hears that `spent` is out.
        let heard = SyncResponse::decode(&call(&store, 2, 1, &[]).await.body).unwrap();
        assert_eq!(heard.grants.len(), 1, "{heard:?}");
        let g = &heard.grants[0];
        assert_eq!((g.key.as_slice(), g.remaining, g.grant, g.lease), (&b"spent"[..], 0, 0, 0));
        assert!(g.reset_after > 0 && g.reset_after <= 3600 * SECOND);
    }

    #[tokio::test]
    async fn peers_shares_are_merged_once_from_where_the_reader_joined_and_its_own_never() {
        let store = std::sync::Arc::new(Store::new(FakeKv::default(), SECRET, Duration::from_secs(1)));
        let stream = top::SHARED_STREAM;
        // Before this process reads: not merged (it starts from the stream's end).
        store.kv.append(stream, &peer_share(7, 5).encode(), 100, 1).await.unwrap();
        let mut cursor = None;
        store.share_top(true, &mut cursor).await;
        assert_eq!(denied_in(&store), 0);
        // A peer's shares since, and one of this process's own (already in its view), and one
        // no store of this version reads.
        store.kv.append(stream, &peer_share(7, 3).encode(), 100, 1).await.unwrap();
        store.kv.append(stream, &peer_share(store.top.process(), 100).encode(), 100, 1).await.unwrap();
        store.kv.append(stream, b"\x09garbage", 100, 1).await.unwrap();
        store.kv.append(stream, &peer_share(8, 4).encode(), 100, 1).await.unwrap();
        store.share_top(true, &mut cursor).await;
        assert_eq!(denied_in(&store), 7);
        store.share_top(true, &mut cursor).await;
        assert_eq!(denied_in(&store), 7, "read once");
        assert_eq!(store.metrics.top_peer_shares.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn a_share_redis_did_not_take_goes_with_the_next() {
        use ratewall_core::sync::TopSection;
        let store = std::sync::Arc::new(Store::new(FakeKv::default(), SECRET, Duration::from_secs(1)));
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        store.kv.now.store(now, Ordering::Relaxed);
        let mut body = SyncRequest { node: 1, seq: 1, sent: now, deltas: deltas(&[(b"a", 1)]), ask: false }.encode();
        TopSection { rules: peer_share(0, 6).seconds[0].1.rules.clone() }.encode_into(&mut body);
        assert_eq!(store.sync(&body, Some(hex(&sign(SECRET, &body)).as_bytes())).await.status, 200);
        store.kv.down.store(true, Ordering::Relaxed);
        store.share_top(false, &mut None).await;
        assert_eq!(store.metrics.top_share_failed.load(Ordering::Relaxed), 1);
        store.kv.down.store(false, Ordering::Relaxed);
        store.share_top(false, &mut None).await;
        let streams = store.kv.streams.lock().unwrap();
        let shares = &streams[top::SHARED_STREAM];
        assert_eq!(shares.len(), 1);
        let share = top::Share::decode(&shares[0].1).unwrap();
        assert_eq!(share.seconds.iter().map(|(_, s)| s.rules[0].denied).sum::<u64>(), 6);
    }

    #[tokio::test]
    async fn a_retry_after_a_partial_failure_counts_each_counter_once() {
        let store = std::sync::Arc::new(Store::new(FakeKv::default(), SECRET, Duration::from_secs(1)));
        store.kv.now.store(1_800_000_000 * SECOND, Ordering::Relaxed);
        // The batch's second counter fails to write: the answer is a 503, the first counter
        // has counted its units.
        *store.kv.fail_next_write_of.lock().unwrap() = Some(redis_key(b"b"));
        let first = call(&store, 1, 1, &[(b"a", 5), (b"b", 7)]).await;
        assert_eq!(first.status, 503);
        // The node retries the same seq: "a" does not count again, "b" counts now.
        let retry = call(&store, 1, 1, &[(b"a", 5), (b"b", 7)]).await;
        assert_eq!(retry.status, 200);
        assert_eq!(remaining(&retry), [95, 93]);
        // An older seq is refused, a newer one counted.
        assert_eq!(call(&store, 1, 2, &[(b"a", 1)]).await.status, 200);
        assert_eq!(call(&store, 1, 1, &[(b"a", 5)]).await.status, 409);
        assert_eq!(remaining(&call(&store, 1, 3, &[(b"a", 0), (b"b", 0)]).await), [94, 93]);
    }

    #[test]
    fn a_log_line_keeps_to_one_line() {
        assert_eq!(
            super::one_line("Parse error: Unexpected \"\\r\\nHTTP/1.1\""),
            "Parse error: Unexpected \"\\r\\nHTTP/1.1\""
        );
        assert_eq!(super::one_line("a\r\nb\x1b[31m"), "a\\r\\nb\\u{1b}[31m");
    }

    #[tokio::test]
    async fn units_counted_takes_a_delta_at_most_as_2_to_the_32_and_keeps_counting() {
        let store = std::sync::Arc::new(Store::new(FakeKv::default(), SECRET, Duration::from_secs(1)));
        assert_eq!(call(&store, 1, 1, &[(b"a", u64::MAX)]).await.status, 200);
        assert_eq!(call(&store, 1, 2, &[(b"b", 5)]).await.status, 200);
        assert_eq!(store.metrics.units_counted.load(Ordering::Relaxed), u64::from(u32::MAX) + 5);
    }

    #[tokio::test]
    async fn a_request_made_too_far_from_the_registrys_clock_is_refused_before_any_counter() {
        let store = std::sync::Arc::new(Store::new(FakeKv::default(), SECRET, Duration::from_secs(1)));
        let now = 1_800_000_000 * SECOND;
        store.kv.now.store(now, Ordering::Relaxed);
        for (sent, status) in [(now - 26 * SECOND, 422), (now + 26 * SECOND, 422), (now - 25 * SECOND, 200)] {
            for ask in [false, true] {
                let a = call_at(&store, SyncRequest { node: 1, seq: 1, sent, deltas: deltas(&[(b"a", 5)]), ask }).await;
                assert_eq!(a.status, status, "{}", String::from_utf8_lossy(&a.body));
                if status == 422 {
                    let why = String::from_utf8(a.body).unwrap();
                    assert!(why.contains("26.000 s") && why.contains("the store's clock"), "{why}");
                }
            }
        }
        assert_eq!(store.metrics.status_422.load(Ordering::Relaxed), 4);
        assert!(store.metrics.render().contains("ratewall_store_sync_failed_total{status=\"422\"} 4\n"));
        // Only the accepted batch and ask counted.
        assert_eq!(store.metrics.units_counted.load(Ordering::Relaxed), 10);
    }

    #[tokio::test]
    async fn an_unreadable_counter_is_kept_and_named_failed_while_the_rest_of_the_batch_counts() {
        let store = std::sync::Arc::new(Store::new(FakeKv::default(), SECRET, Duration::from_secs(1)));
        store.kv.values.lock().unwrap().insert(redis_key(b"a"), b"\x09garbage".to_vec());
        let answer = call(&store, 1, 1, &[(b"b", 2), (b"a", 5), (b"c", 3)]).await;
        assert_eq!(answer.status, 200);
        let resp = SyncResponse::decode(&answer.body).unwrap();
        assert_eq!(resp.failed, vec![1]);
        assert_eq!(resp.grants.iter().map(|g| (g.remaining, g.grant)).collect::<Vec<_>>()[1], (0, 0));
        assert_eq!(remaining(&answer)[0], 98);
        assert_eq!(remaining(&answer)[2], 97);
        assert_eq!(store.kv.values.lock().unwrap().get(&redis_key(b"a")).unwrap(), b"\x09garbage");
        assert_eq!(store.metrics.unreadable.load(Ordering::Relaxed), 1);
        assert_eq!(store.metrics.units_counted.load(Ordering::Relaxed), 5, "b's and c's units, not a's");
        // An ask carries no acknowledged units: it fails whole, and its request is decided on
        // what the node holds.
        let body = SyncRequest {
            node: 1,
            seq: 1,
            sent: store.kv.now.load(Ordering::Relaxed),
            deltas: deltas(&[(b"a", 1)]),
            ask: true,
        };
        assert_eq!(call_at(&store, body).await.status, 503);
        assert_eq!(store.kv.values.lock().unwrap().get(&redis_key(b"a")).unwrap(), b"\x09garbage");
    }

    #[test]
    fn metrics_are_prometheus_text() {
        let m = Metrics::default();
        m.status_503.fetch_add(2, Ordering::Relaxed);
        let text = m.render();
        assert!(text.contains("# TYPE ratewall_store_sync_failed_total counter\n"), "{text}");
        assert!(text.contains("ratewall_store_sync_failed_total{status=\"503\"} 2\n"), "{text}");
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            assert!(line.rsplit(' ').next().unwrap().parse::<u64>().is_ok(), "{line}");
        }
    }
}
