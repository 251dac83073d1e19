//! The rate-limit algorithms as pure transitions `(state, now, cost) -> (decision, state)`:
//! four that admit or reject, and the leaky bucket, which also says how long an admitted
//! request waits for its turn ([`Limit::wait`]).
//!
//! Time is integer nanoseconds since the Unix epoch ([`Nanos`]). Nothing here reads a
//! clock: callers pass `now`, which is clamped to [`LATEST`] so no arithmetic saturates.
//!
//! Clock steps: a state never lies far ahead of `now`. A state written a little ahead (the
//! clocks of two workers, a window boundary between them) is read as it is and every wait it
//! implies is measured from the real `now`; a state further ahead than one window (or, for a
//! bucket, a full refill) — left by a clock that stepped back, a forward excursion, or a
//! limit it was not written under — is moved back to `now` with its counts kept. So after
//! any step a denied client's `retry_after` is the truth, and no counter is poisoned for
//! longer than one window or refill.

use core::cmp::{max, min};

/// Nanoseconds since the Unix epoch (or a span of nanoseconds).
pub type Nanos = u64;

/// One second in [`Nanos`].
pub const SECOND: Nanos = 1_000_000_000;

/// Largest `requests` a limit may have (counts are stored as `u32`).
pub const MAX_REQUESTS: u64 = u32::MAX as u64;
/// Largest `requests` for the sliding log (its state is [`LOG_SLOTS`] counts, so any limit
/// fits; kept at the documented 10,000 so no document's meaning changes).
pub const MAX_SLIDING_LOG_REQUESTS: u64 = 10_000;
/// The sliding log keeps counts per `per / LOG_QUANTA` of time, not one timestamp per unit:
/// a unit counts until the end of its slot plus `per`, so the log never admits more than
/// `requests` in any window of `per`, and holds units up to `per / LOG_QUANTA` longer than an
/// exact log would.
pub const LOG_QUANTA: u64 = 8;
/// Slots of a sliding-log state: the current one and the [`LOG_QUANTA`] before it.
pub const LOG_SLOTS: usize = LOG_QUANTA as usize + 1;
/// The latest instant the algorithms represent (2^63 ns: the year 2262); later clocks are
/// read as this one, so a clock at `u64::MAX` cannot saturate a state into admitting
/// everything.
pub const LATEST: Nanos = 1 << 63;
/// Longest `per` a limit may have: 366 days.
pub const MAX_PER: Nanos = 366 * 24 * 3600 * SECOND;
/// Longest time a token bucket may take to refill completely: 100 years.
const MAX_BUCKET_SPAN: Nanos = 100 * 366 * 24 * 3600 * SECOND;

/// Which algorithm a limit uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Algorithm {
    /// GCRA token bucket: capacity `burst` (default `requests`), refill `requests / per`.
    TokenBucket = 0,
    /// Sliding window counter: `floor(prev * (1 - elapsed / per)) + curr`.
    SlidingWindow = 1,
    /// Fixed windows aligned to multiples of `per` since the epoch.
    FixedWindow = 2,
    /// Sliding log: admitted units counted per `per / 8` slot (see [`LOG_QUANTA`]).
    SlidingLog = 3,
    /// Leaky bucket that queues (NGINX `limit_req`): one request per `per / requests`
    /// leaves; `burst` more wait their turn, the first `delay` of them without waiting.
    LeakyBucket = 4,
    /// Requests in flight (`limit.concurrent`): at most `requests` slots, each taken on
    /// admission and given back ([`Limit::refund`]) when the response completes, or after
    /// `per` (`hold_max`) anyway. Counted like the sliding log, except that a slot is
    /// released at the start of its `per / 8` slot plus `hold_max`: no later than `hold_max`
    /// after it was taken (up to an eighth of it sooner), as a lost release must not hold it
    /// past the documented time.
    Concurrent = 5,
}

impl Algorithm {
    /// The name used in the rules document.
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::LeakyBucket => "leaky_bucket",
            Algorithm::Concurrent => "concurrent",
        }
    }

    /// Every algorithm, in the order of its wire code: the one list names, codes and error
    /// messages are derived from.
    pub const ALL: [Algorithm; 6] = [
        Algorithm::TokenBucket,
        Algorithm::SlidingWindow,
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::LeakyBucket,
        Algorithm::Concurrent,
    ];

    /// Its code on the wire and in limit fingerprints (docs/sync-protocol.md): its index in
    /// [`Algorithm::ALL`].
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The algorithm of a wire code.
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => Algorithm::TokenBucket,
            1 => Algorithm::SlidingWindow,
            2 => Algorithm::FixedWindow,
            3 => Algorithm::SlidingLog,
            4 => Algorithm::LeakyBucket,
            5 => Algorithm::Concurrent,
            _ => return None,
        })
    }

    /// Parses a name from the rules document (the inverse of [`Algorithm::as_str`], a
    /// `match` rather than a search of [`Algorithm::ALL`]: 1.1 KB less wasm in the filter).
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "token_bucket" => Algorithm::TokenBucket,
            "sliding_window" => Algorithm::SlidingWindow,
            "fixed_window" => Algorithm::FixedWindow,
            "sliding_log" => Algorithm::SlidingLog,
            "leaky_bucket" => Algorithm::LeakyBucket,
            "concurrent" => Algorithm::Concurrent,
            _ => return None,
        })
    }
}

/// The names a rule's `algorithm` takes ([`Algorithm::ALL`] but `concurrent`, which a
/// `limit.concurrent` selects), for messages (a constant: joining them at run time cost the
/// filter's wasm ~200 bytes; a test holds it to the list).
pub const ALGORITHM_NAMES: &str = "token_bucket, sliding_window, fixed_window, sliding_log, leaky_bucket";

/// Why a limit could not be built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LimitError {
    /// `requests` is 0 or above the maximum.
    Requests(u64),
    /// `per` is 0 or above [`MAX_PER`].
    Per(Nanos),
    /// `burst` is 0, above the maximum, or given for a window algorithm.
    Burst(&'static str),
    /// `delay` is above `burst`, or given for another algorithm than the leaky bucket.
    Delay(&'static str),
    /// A bucket's `requests` per `per` above one unit per nanosecond, the finest step its
    /// emission interval has.
    Rate,
}

impl core::fmt::Display for LimitError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            LimitError::Requests(n) => write!(f, "requests must be 1 to the maximum, not {n}"),
            LimitError::Per(p) => write!(f, "the period must be above 0 ns and at most {MAX_PER} ns, not {p}"),
            LimitError::Burst(why) => write!(f, "bad burst: {why}"),
            LimitError::Delay(why) => write!(f, "bad delay: {why}"),
            LimitError::Rate => f.write_str("a bucket earns or drains at most one unit per nanosecond"),
        }
    }
}

impl core::error::Error for LimitError {}

/// A validated limit: the hot path cannot fail on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    algorithm: Algorithm,
    requests: u64,
    per: Nanos,
    capacity: u64,
    /// Leaky bucket: queued requests that go at once (NGINX `delay=`).
    delay: u64,
    /// Token bucket emission interval, `ceil(per / requests)`.
    interval: Nanos,
    /// A hash of everything above: counters are keyed by it, so a state is only ever read
    /// under the limit that wrote it.
    fingerprint: u64,
}

impl Limit {
    /// Builds a limit of `requests` per `per`, with an optional `burst`: a token bucket's
    /// capacity, or how many requests a leaky bucket queues (default 0; its capacity is one
    /// more, the request being served).
    pub fn new(algorithm: Algorithm, requests: u64, per: Nanos, burst: Option<u64>) -> Result<Self, LimitError> {
        let max_requests = match algorithm {
            Algorithm::SlidingLog | Algorithm::Concurrent => MAX_SLIDING_LOG_REQUESTS,
            _ => MAX_REQUESTS,
        };
        if requests == 0 || requests > max_requests {
            return Err(LimitError::Requests(requests));
        }
        if per == 0 || per > MAX_PER {
            return Err(LimitError::Per(per));
        }
        let capacity = match (algorithm, burst) {
            (Algorithm::TokenBucket, None) => requests,
            (Algorithm::TokenBucket, Some(0)) => return Err(LimitError::Burst("must be at least 1")),
            (Algorithm::TokenBucket, Some(b)) if b > MAX_REQUESTS => return Err(LimitError::Burst("is too large")),
            (Algorithm::TokenBucket, Some(b)) => b,
            (Algorithm::LeakyBucket, b) if b.unwrap_or(0) >= MAX_REQUESTS => {
                return Err(LimitError::Burst("is too large"))
            }
            (Algorithm::LeakyBucket, b) => b.unwrap_or(0) + 1,
            (_, None) => requests,
            (_, Some(_)) => return Err(LimitError::Burst("applies only to token_bucket and leaky_bucket")),
        };
        if matches!(algorithm, Algorithm::TokenBucket | Algorithm::LeakyBucket) && requests > per {
            return Err(LimitError::Rate);
        }
        let interval = per.div_ceil(requests);
        if capacity.saturating_mul(interval) > MAX_BUCKET_SPAN {
            return Err(LimitError::Burst("makes the bucket take over 100 years to refill"));
        }
        // Not adversarial (operators write limits), only distinct in practice: odd multipliers
        // and rotations keep every field's bits apart, in a few instructions.
        let fingerprint = (u64::from(algorithm.code()) ^ 0x9e37_79b9_7f4a_7c15).wrapping_mul(0xff51_afd7_ed55_8ccd)
            ^ requests.wrapping_mul(0xc4ce_b9fe_1a85_ec53)
            ^ per.rotate_left(21).wrapping_mul(0x8765_4321_0fed_cba9)
            ^ capacity.rotate_left(42).wrapping_mul(0x2545_f491_4f6c_dd1d);
        Ok(Limit { algorithm, requests, per, capacity, delay: 0, interval, fingerprint })
    }

    /// The leaky bucket with `delay` of its queued requests going at once (at most `burst`).
    pub fn with_delay(self, delay: u64) -> Result<Self, LimitError> {
        if delay == 0 {
            return Ok(self);
        }
        if self.algorithm != Algorithm::LeakyBucket {
            return Err(LimitError::Delay("applies only to leaky_bucket"));
        }
        if delay >= self.capacity {
            return Err(LimitError::Delay("must be at most burst"));
        }
        let fingerprint = self.fingerprint ^ delay.rotate_left(11).wrapping_mul(0x9fb2_1c65_1e98_df25);
        Ok(Limit { delay, fingerprint, ..self })
    }

    /// The limit of `algorithm` whose [`Limit::capacity`] is `capacity`, as the wire and the
    /// Worker's stored values carry it: a token bucket's capacity is its burst, a leaky
    /// bucket's one more than its queue (0 makes no leaky bucket); other algorithms' is
    /// `requests`, and `capacity` is not read.
    pub fn from_capacity(algorithm: Algorithm, requests: u64, per: Nanos, capacity: u64) -> Result<Self, LimitError> {
        let burst = match algorithm {
            Algorithm::TokenBucket => Some(capacity),
            Algorithm::LeakyBucket => Some(capacity.checked_sub(1).ok_or(LimitError::Burst("must be at least 0"))?),
            _ => None,
        };
        Limit::new(algorithm, requests, per, burst)
    }

    /// The `burst` that [`Limit::new`] takes to build this limit again.
    pub fn burst(&self) -> Option<u64> {
        match self.algorithm {
            Algorithm::TokenBucket => Some(self.capacity),
            Algorithm::LeakyBucket => Some(self.capacity - 1),
            _ => None,
        }
    }

    /// A bucket's emission interval: `per / requests`, rounded up.
    pub fn interval(&self) -> Nanos {
        self.interval
    }

    /// A leaky bucket's queued requests that go at once.
    pub fn delay(&self) -> u64 {
        self.delay
    }

    /// How long a request of `cost` that `decision` admitted waits for its turn before it is
    /// forwarded: 0 but for a leaky bucket's queued requests past the first `delay`, whose
    /// turns come one per `per / requests` (the decision's `reset_after` is when the queue,
    /// this request included, has drained).
    pub fn wait(&self, decision: &Decision, cost: u64) -> Nanos {
        if self.algorithm != Algorithm::LeakyBucket || !decision.allowed {
            return 0;
        }
        let ahead = decision.reset_after.saturating_sub(cost.saturating_mul(self.interval));
        ahead.saturating_sub(self.delay.saturating_mul(self.interval))
    }

    /// A 64-bit hash of the algorithm, `requests`, `per` and capacity: part of every counter
    /// key, so a rules push that changes a limit (or a plan that applies another) starts its
    /// counters fresh instead of reading states written under another limit.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }
    /// Requests allowed per `per` (the policy's quota).
    pub fn requests(&self) -> u64 {
        self.requests
    }
    /// The window, or the time the bucket takes to earn `requests` tokens.
    pub fn per(&self) -> Nanos {
        self.per
    }
    /// The quota reported to clients: `requests`, or a larger token-bucket `burst`, so that
    /// `remaining` never exceeds it.
    pub fn quota(&self) -> u64 {
        max(self.requests, self.capacity)
    }
    /// Most units admitted at once: `burst` for a token bucket, else `requests`.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Decides a request of `cost` units at `now`; returns the decision and the new state.
    ///
    /// A denied request consumes nothing: the state returned is the one given, except when
    /// it lay too far ahead of `now` (a clock step; see the module doc) and was moved back,
    /// which the caller should store (a `retry_after` is true of the moved state: the one
    /// given, read again later, would be moved again). `cost == 0` peeks without consuming.
    #[inline]
    #[must_use = "dropping the returned state loses the units the decision admitted"]
    pub fn decide(&self, state: &State, now: Nanos, cost: u64) -> (Decision, State) {
        let now = now.min(LATEST);
        match self.algorithm {
            Algorithm::TokenBucket | Algorithm::LeakyBucket => self.token_bucket(state, now, cost),
            Algorithm::SlidingWindow => self.sliding_window(state, now, cost),
            Algorithm::FixedWindow => self.fixed_window(state, now, cost),
            Algorithm::SlidingLog | Algorithm::Concurrent => {
                let (d, s) = self.sliding_log(state, now, cost);
                if self.algorithm == Algorithm::SlidingLog {
                    return (d, s);
                }
                // Slots free as responses complete, not on a schedule: a denied client is
                // told to retry in a second, and the quota has no reset time to announce.
                let retry_after = if d.allowed { None } else { d.retry_after.map(|_| SECOND) };
                (Decision { reset_after: SECOND, retry_after, ..d }, s)
            }
        }
    }

    /// Gives back `cost` units consumed at `consumed_at` (a request that was admitted by this
    /// limit but rejected by another rule must not keep its quota).
    #[must_use = "the refund is in the returned state"]
    pub fn refund(&self, state: &State, consumed_at: Nanos, cost: u64) -> State {
        let consumed_at = consumed_at.min(LATEST);
        match (self.algorithm, state) {
            (Algorithm::TokenBucket | Algorithm::LeakyBucket, State::TokenBucket { tat }) => {
                State::TokenBucket { tat: tat.saturating_sub(cost.saturating_mul(self.interval)) }
            }
            (Algorithm::SlidingWindow, State::SlidingWindow { window, prev, curr }) => {
                let at = consumed_at / self.per;
                let c = clamp_u32(cost);
                if at == *window {
                    State::SlidingWindow { window: *window, prev: *prev, curr: curr.saturating_sub(c) }
                } else if at.saturating_add(1) == *window {
                    State::SlidingWindow { window: *window, prev: prev.saturating_sub(c), curr: *curr }
                } else {
                    state.clone()
                }
            }
            (Algorithm::FixedWindow, State::FixedWindow { window, count }) => {
                if consumed_at / self.per == *window {
                    State::FixedWindow { window: *window, count: count.saturating_sub(clamp_u32(cost)) }
                } else {
                    state.clone()
                }
            }
            (Algorithm::SlidingLog | Algorithm::Concurrent, State::SlidingLog { newest, counts }) => {
                // Units consumed in a slot since merged into a later one (the clock stepped
                // back) are in the newest slot.
                let back = newest.saturating_sub(consumed_at / self.quantum());
                let mut counts = *counts;
                if let Some(c) = (LOG_SLOTS - 1).checked_sub(back as usize).and_then(|i| counts.get_mut(i)) {
                    *c = c.saturating_sub(clamp_u16(cost));
                }
                State::SlidingLog { newest: *newest, counts }
            }
            _ => state.clone(),
        }
    }

    /// The sliding log's slot length: `per / LOG_QUANTA`, rounded up. What a slot counts, it
    /// counts for up to this long more than a log of every instant would.
    pub fn quantum(&self) -> Nanos {
        self.per.div_ceil(LOG_QUANTA).max(1)
    }

    /// When the units of sliding-log slot `q` stop counting: the end of the slot plus
    /// [`Limit::held_for`].
    fn slot_expiry(&self, q: u64) -> Nanos {
        q.saturating_add(1).saturating_mul(self.quantum()).saturating_add(self.held_for())
    }

    /// How long past the end of its slot a sliding-log unit counts: `per` (so the log never
    /// admits more than `requests` in any window of `per`), and for a concurrency slot one
    /// slot less (so it is released no later than `hold_max` after it was taken).
    fn held_for(&self) -> Nanos {
        if self.algorithm == Algorithm::Concurrent {
            self.per.saturating_sub(self.quantum())
        } else {
            self.per
        }
    }

    /// The instant from which `state` is equivalent to [`State::Fresh`]: an entry idle since
    /// then can be forgotten without giving anyone extra quota.
    pub fn idle_at(&self, state: &State) -> Nanos {
        match (self.algorithm, state) {
            (Algorithm::TokenBucket | Algorithm::LeakyBucket, State::TokenBucket { tat }) => *tat,
            (Algorithm::SlidingWindow, State::SlidingWindow { window, .. }) => {
                window.saturating_add(2).saturating_mul(self.per)
            }
            (Algorithm::FixedWindow, State::FixedWindow { window, .. }) => {
                window.saturating_add(1).saturating_mul(self.per)
            }
            (Algorithm::SlidingLog | Algorithm::Concurrent, State::SlidingLog { newest, counts }) => {
                match counts.iter().rposition(|&c| c > 0) {
                    Some(i) => self.slot_expiry(newest.saturating_sub((LOG_SLOTS - 1 - i) as u64)),
                    None => 0,
                }
            }
            _ => 0,
        }
    }

    /// How much of its quota `state` has spent at `now`, from 0 (none) to 255 (all of it):
    /// the table's eviction keeps the most-used (currently limited) keys longest.
    pub fn usage(&self, state: &State, now: Nanos) -> u8 {
        let (d, _) = self.decide(state, now, 0);
        let quota = d.limit.max(1);
        let spent = quota.saturating_sub(d.remaining);
        // 64-bit arithmetic (a u128 division is a library call on wasm32): exact while
        // `spent * 255` fits, else scaled down first; only the eviction order reads it.
        let scaled = match spent.checked_mul(255) {
            Some(s) => s / quota,
            None => spent / (quota / 255).max(1),
        };
        scaled.min(255) as u8
    }

    /// The sliding window's (window, elapsed in it, previous count, current count, lag) at
    /// `now`, rolled forward. A state one window ahead (a clock a little behind the one that
    /// wrote it) is read at the start of its window, and `lag` is how far that lies ahead of
    /// `now`: every wait is that much longer. A state further ahead is moved to `now`'s
    /// window with its counts.
    fn sliding_roll(&self, state: &State, now: Nanos) -> (u64, Nanos, u64, u64, Nanos) {
        let w = self.per;
        let idx = now / w;
        match state {
            State::SlidingWindow { window, prev, curr } => {
                let (prev, curr) = (u64::from(*prev), u64::from(*curr));
                if *window == idx.saturating_add(1) {
                    (*window, 0, prev, curr, window.saturating_mul(w).saturating_sub(now))
                } else if *window >= idx {
                    // Now's window, or one far ahead moved back to it with its counts.
                    (idx, now % w, prev, curr, 0)
                } else if *window + 1 == idx {
                    (idx, now % w, curr, 0, 0)
                } else {
                    (idx, now % w, 0, 0, 0)
                }
            }
            _ => (idx, now % w, 0, 0, 0),
        }
    }

    /// The fixed window's (window, count) at `now`. The next window (a clock a little behind
    /// the one that wrote it) is kept, and its end measured from `now`; a window further
    /// ahead is moved to `now`'s with its count.
    fn fixed_roll(&self, state: &State, now: Nanos) -> (u64, u64) {
        let idx = now / self.per;
        match state {
            State::FixedWindow { window, count } if *window == idx || *window == idx.saturating_add(1) => {
                (*window, u64::from(*count))
            }
            State::FixedWindow { window, count } if *window > idx => (idx, u64::from(*count)),
            _ => (idx, 0),
        }
    }

    /// The token bucket's theoretical arrival time at `now`: never before `now`, never more
    /// than two full refills after it (one: a full bucket; the second: units a global store
    /// counted past the limit, which its nodes had admitted).
    fn bucket_tat(&self, state: &State, now: Nanos) -> Nanos {
        let span = self.capacity * self.interval; // bounded by MAX_BUCKET_SPAN in `new`
        match state {
            State::TokenBucket { tat } => (*tat).clamp(now, now + 2 * span),
            _ => now,
        }
    }

    /// The sliding log's slot counts at `now` (slot `LOG_SLOTS - 1` is `now`'s), with the
    /// slots whose units no longer count emptied. Slots ahead of `now` (the clock stepped
    /// back) are merged into `now`'s: their units count until `now`'s slot expires.
    fn log_roll(&self, state: &State, now: Nanos) -> (u64, [u16; LOG_SLOTS]) {
        const LAST: usize = LOG_SLOTS - 1;
        let g = self.quantum();
        let cur = now / g;
        let mut counts = [0u16; LOG_SLOTS];
        if let State::SlidingLog { newest, counts: old } = state {
            // Old slot `i` is slot `newest - LAST + i`: it moves by `newest - cur` places.
            let (ahead, behind) = (newest.saturating_sub(cur), cur.saturating_sub(*newest));
            for (i, &c) in old.iter().enumerate() {
                let to = (i as u64).saturating_add(ahead).checked_sub(behind).map(|j| j.min(LAST as u64));
                if let Some(slot) = to.and_then(|j| counts.get_mut(j as usize)) {
                    *slot = slot.saturating_add(c);
                }
            }
        }
        // Slot q counts while (q + 1) * g + held > now, that is from q = (now - held) / g on.
        let oldest = now.saturating_sub(self.held_for()) / g;
        let live_from = LAST.saturating_sub(usize::try_from(cur - oldest.min(cur)).unwrap_or(usize::MAX));
        for c in counts.iter_mut().take(live_from) {
            *c = 0;
        }
        (cur, counts)
    }

    /// Records `units` already admitted elsewhere, whatever the limit says: the global store
    /// counts every request its nodes admitted, even past the limit (its view then reports
    /// no remaining quota until the overshoot has drained).
    #[must_use = "the consumed units are in the returned state"]
    pub fn consume(&self, state: &State, now: Nanos, units: u64) -> State {
        let now = now.min(LATEST);
        match self.algorithm {
            Algorithm::TokenBucket | Algorithm::LeakyBucket => {
                // At most two full refills ahead: an overshoot beyond that is forgiven.
                let span = self.capacity * self.interval;
                let tat = self.bucket_tat(state, now);
                State::TokenBucket { tat: tat.saturating_add(units.saturating_mul(self.interval)).min(now + 2 * span) }
            }
            Algorithm::SlidingWindow => {
                let (window, _, prev, curr, _) = self.sliding_roll(state, now);
                State::SlidingWindow { window, prev: clamp_u32(prev), curr: clamp_u32(curr.saturating_add(units)) }
            }
            Algorithm::FixedWindow => {
                let (window, count) = self.fixed_roll(state, now);
                State::FixedWindow { window, count: clamp_u32(count.saturating_add(units)) }
            }
            Algorithm::SlidingLog | Algorithm::Concurrent => {
                let (newest, mut counts) = self.log_roll(state, now);
                if let Some(c) = counts.last_mut() {
                    *c = c.saturating_add(clamp_u16(units));
                }
                State::SlidingLog { newest, counts }
            }
        }
    }

    #[inline]
    fn token_bucket(&self, state: &State, now: Nanos, cost: u64) -> (Decision, State) {
        let t = self.interval;
        let quota = self.quota();
        let span = self.capacity * t; // bounded by MAX_BUCKET_SPAN in `new`
        let tat = self.bucket_tat(state, now);
        let used = tat - now;
        let remaining_at = |used: Nanos| span.saturating_sub(used) / t;
        let kept = || match state {
            State::TokenBucket { tat: stored } if *stored > now + 2 * span => State::TokenBucket { tat },
            _ => state.clone(),
        };
        if cost > self.capacity {
            let d = Decision::denied(quota, remaining_at(used), used, None);
            return (d, kept());
        }
        let new_used = used + cost * t;
        if new_used > span {
            let d = Decision::denied(quota, remaining_at(used), used, Some(new_used - span));
            return (d, kept());
        }
        let d = Decision::allowed(quota, remaining_at(new_used), new_used);
        (d, State::TokenBucket { tat: now.saturating_add(new_used) })
    }

    #[inline]
    fn sliding_window(&self, state: &State, now: Nanos, cost: u64) -> (Decision, State) {
        let w = self.per;
        let limit = self.requests;
        let (window, elapsed, prev, curr, lag) = self.sliding_roll(state, now);
        // In 64 bits whenever the product fits (a u128 division is a library call on wasm32).
        let weighted = |prev: u64, elapsed: Nanos| -> u64 {
            match prev.checked_mul(w - elapsed) {
                Some(p) => p / w,
                None => (u128::from(prev) * u128::from(w - elapsed) / u128::from(w)) as u64,
            }
        };
        let used = weighted(prev, elapsed) + curr;
        let to_window_end = w - elapsed + lag;
        // When the quota is whole again (`reset_after`: `r` back to `q`), what it counts
        // weighing nothing: this window's units through the part of the next one over which
        // they fade, else the previous window's as they fade in this one.
        let whole_again = |prev: u64, curr: u64| -> Nanos {
            if curr > 0 {
                to_window_end + wait_for_weight(curr, w, 0)
            } else {
                wait_for_weight(prev, w, 0).saturating_sub(elapsed) + lag
            }
        };
        if cost <= limit && used + cost <= limit {
            let curr = curr + cost;
            let d = Decision::allowed(limit, limit - used - cost, whole_again(prev, curr));
            let s = State::SlidingWindow { window, prev: clamp_u32(prev), curr: clamp_u32(curr) };
            return (d, s);
        }
        let retry = if cost > limit {
            None
        } else if curr + cost <= limit {
            // Within this window, once floor(prev * (w - e) / w) <= limit - curr - cost.
            Some(wait_for_weight(prev, w, limit - curr - cost) - elapsed + lag)
        } else {
            // In the next window, where `curr` becomes the previous window's count.
            Some(to_window_end + wait_for_weight(curr, w, limit - cost))
        };
        let reset = max(whole_again(prev, curr), retry.unwrap_or(0));
        let s = State::SlidingWindow { window, prev: clamp_u32(prev), curr: clamp_u32(curr) };
        (Decision::denied(limit, limit.saturating_sub(used), reset, retry), s)
    }

    #[inline]
    fn fixed_window(&self, state: &State, now: Nanos, cost: u64) -> (Decision, State) {
        let w = self.per;
        let limit = self.requests;
        let (window, count) = self.fixed_roll(state, now);
        let to_end = (window + 1).saturating_mul(w).saturating_sub(now);
        if count.saturating_add(cost) <= limit {
            let d = Decision::allowed(limit, limit - count - cost, to_end);
            return (d, State::FixedWindow { window, count: clamp_u32(count + cost) });
        }
        let retry = (cost <= limit).then_some(to_end);
        (
            Decision::denied(limit, limit.saturating_sub(count), to_end, retry),
            State::FixedWindow { window, count: clamp_u32(count) },
        )
    }

    fn sliding_log(&self, state: &State, now: Nanos, cost: u64) -> (Decision, State) {
        let limit = self.requests;
        let (newest, mut counts) = self.log_roll(state, now);
        let count: u64 = counts.iter().map(|&c| u64::from(c)).sum();
        let expiry = |i: usize| self.slot_expiry(newest.saturating_sub((LOG_SLOTS - 1 - i) as u64));
        // The quota is whole again when the newest slot holding units expires.
        let reset = |counts: &[u16; LOG_SLOTS]| {
            counts.iter().rposition(|&c| c > 0).map_or(0, |i| expiry(i).saturating_sub(now))
        };
        if count.saturating_add(cost) <= limit {
            if let Some(c) = counts.last_mut() {
                *c = c.saturating_add(clamp_u16(cost));
            }
            let d = Decision::allowed(limit, limit - count - cost, reset(&counts));
            return (d, State::SlidingLog { newest, counts });
        }
        let retry = if cost > limit {
            None
        } else {
            // The oldest `count + cost - limit` units must stop counting first.
            let need = count + cost - limit;
            let mut gone = 0u64;
            counts.iter().enumerate().find_map(|(i, &c)| {
                gone += u64::from(c);
                (gone >= need).then(|| expiry(i).saturating_sub(now))
            })
        };
        let d = Decision::denied(limit, limit - min(count, limit), max(reset(&counts), retry.unwrap_or(0)), retry);
        (d, State::SlidingLog { newest, counts })
    }
}

/// Smallest elapsed time `e` in a window of `w` at which `floor(count * (w - e) / w) <= allowed`.
fn wait_for_weight(count: u64, w: Nanos, allowed: u64) -> Nanos {
    if count <= allowed {
        return 0;
    }
    // floor(count*(w-e)/w) <= allowed  <=>  count*(w-e) <= (allowed+1)*w - 1; in 64 bits
    // whenever the product fits (a u128 division is a library call on wasm32, and this runs
    // on every admission of a sliding window, for its reset).
    let span = match (allowed + 1).checked_mul(w) {
        Some(bound) => (bound - 1) / count,
        None => (((u128::from(allowed) + 1) * u128::from(w) - 1) / u128::from(count)) as u64,
    }; // < w since count > allowed
    w - span
}

fn clamp_u32(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// Sliding-log slot counts are 16 bits (a log's limit is at most 10,000, so a saturated
/// count still reads as a full window) — it keeps `State` as small as before the log was
/// bounded, which every decision copies.
fn clamp_u16(v: u64) -> u16 {
    u16::try_from(v).unwrap_or(u16::MAX)
}

/// The state of one (rule, key): a few integers.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum State {
    /// Nothing recorded yet.
    #[default]
    Fresh,
    /// GCRA: the theoretical arrival time of the next request (the token bucket's, and the
    /// leaky bucket's, whose queue has drained at `tat`).
    TokenBucket {
        /// Theoretical arrival time, [`Nanos`].
        tat: Nanos,
    },
    /// Counts of the current and previous window.
    SlidingWindow {
        /// Index of the current window (`now / per`).
        window: u64,
        /// Units admitted in the previous window.
        prev: u32,
        /// Units admitted in the current window.
        curr: u32,
    },
    /// Count of the current window.
    FixedWindow {
        /// Index of the window (`now / per`).
        window: u64,
        /// Units admitted in it.
        count: u32,
    },
    /// Units admitted per slot of `per / LOG_QUANTA` ([`LOG_QUANTA`]), oldest slot first.
    SlidingLog {
        /// Index of the last slot (`now / (per / LOG_QUANTA)` when written).
        newest: u64,
        /// Units per slot: `counts[LOG_SLOTS - 1]` is slot `newest`, the one before it
        /// `newest - 1`, and so on.
        counts: [u16; LOG_SLOTS],
    },
}

/// The answer for one request against one limit. Being limited is a value, not an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request is admitted.
    pub allowed: bool,
    /// The policy's quota (`requests`).
    pub limit: u64,
    /// Units still available after this decision.
    pub remaining: u64,
    /// Time until the quota is restored (bucket full, or the window ends).
    pub reset_after: Nanos,
    /// For a denied request: the wait after which the same request is admitted. `None` when
    /// allowed, or when the request costs more than the limit can ever admit.
    pub retry_after: Option<Nanos>,
}

impl Decision {
    #[inline]
    fn allowed(limit: u64, remaining: u64, reset_after: Nanos) -> Self {
        Decision { allowed: true, limit, remaining, reset_after, retry_after: None }
    }
    #[inline]
    fn denied(limit: u64, remaining: u64, reset_after: Nanos, retry_after: Option<Nanos>) -> Self {
        Decision { allowed: false, limit, remaining, reset_after, retry_after }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    fn run(limit: &Limit, times: &[Nanos]) -> usize {
        let mut s = State::Fresh;
        let mut admitted = 0;
        for &t in times {
            let (d, n) = limit.decide(&s, t, 1);
            s = n;
            admitted += usize::from(d.allowed);
        }
        admitted
    }

    /// The seed trace: 10 per second, 10 requests at 0.99 s and 10 at 1.01 s.
    #[test]
    fn names_and_codes_come_from_one_list() {
        for (i, a) in Algorithm::ALL.into_iter().enumerate() {
            assert_eq!(usize::from(a.code()), i);
            assert_eq!(Algorithm::from_code(a.code()), Some(a));
            assert_eq!(Algorithm::from_name(a.as_str()), Some(a));
        }
        assert_eq!(Algorithm::from_code(6), None);
        let names: alloc::vec::Vec<&str> =
            Algorithm::ALL.iter().filter(|a| **a != Algorithm::Concurrent).map(|a| a.as_str()).collect();
        assert_eq!(ALGORITHM_NAMES, names.join(", "));
        assert_eq!(Algorithm::from_name("leaky"), None);
        assert_eq!(Algorithm::from_name("leaky_bucket"), Some(Algorithm::LeakyBucket));
    }

    #[test]
    fn seed_trace_admits_what_each_algorithm_promises() {
        let mut times = [990 * MS; 20];
        for t in times.iter_mut().skip(10) {
            *t = 1010 * MS;
        }
        let admitted = |a| run(&Limit::new(a, 10, SECOND, None).unwrap(), &times);
        assert_eq!(admitted(Algorithm::FixedWindow), 20);
        assert_eq!(admitted(Algorithm::SlidingLog), 10);
        assert_eq!(admitted(Algorithm::TokenBucket), 10);
        assert_eq!(admitted(Algorithm::SlidingWindow), 11);
    }

    /// throttled's `TestRateLimit` table (GCRA, MaxBurst 4 = capacity 5, 1 per second)
    /// reproduced with our token bucket: throttled's "limit 5" is our `burst: 5`, its reset is
    /// our `reset_after`, its retry of -1 is our `None`.
    #[test]
    fn gcra_reference_vectors_match_throttled() {
        let limit = Limit::new(Algorithm::TokenBucket, 1, SECOND, Some(5)).unwrap();
        let start = 1_000 * SECOND;
        // (offset ms, cost, remaining, reset ms, retry ms or -1, limited)
        let table: [(u64, u64, u64, u64, i64, bool); 15] = [
            (0, 6, 5, 0, -1, true),
            (0, 1, 4, 1000, -1, false),
            (0, 1, 3, 2000, -1, false),
            (0, 1, 2, 3000, -1, false),
            (0, 1, 1, 4000, -1, false),
            (0, 1, 0, 5000, -1, false),
            (0, 1, 0, 5000, 1000, true),
            (3000, 1, 2, 3000, -1, false),
            (3100, 1, 1, 3900, -1, false),
            (4000, 1, 1, 4000, -1, false),
            (8000, 1, 4, 1000, -1, false),
            (9500, 1, 4, 1000, -1, false),
            (9500, 0, 4, 1000, -1, false),
            (9500, 2, 2, 3000, -1, false),
            (9500, 5, 2, 3000, 3000, true),
        ];
        let mut s = State::Fresh;
        for (i, &(off, cost, remaining, reset, retry, limited)) in table.iter().enumerate() {
            let (d, n) = limit.decide(&s, start + off * MS, cost);
            s = n;
            assert_eq!(d.allowed, !limited, "step {i}");
            assert_eq!(d.remaining, remaining, "step {i}");
            assert_eq!(d.reset_after, reset * MS, "step {i}");
            let expect_retry = (retry >= 0).then(|| retry as u64 * MS);
            assert_eq!(d.retry_after, expect_retry, "step {i}");
        }
    }

    /// A sliding window's `reset_after` is when its quota is whole again (`r` back to `q`):
    /// then, and not a nanosecond before, what it counts weighs nothing. (It was this
    /// window's end, when units spent in it still count through part of the next.)
    #[test]
    fn a_sliding_windows_reset_is_when_its_quota_is_whole_again() {
        let limit = Limit::new(Algorithm::SlidingWindow, 2, 3 * SECOND, None).unwrap();
        let mut x: u64 = 0x5eed;
        let mut next = |below: u64| {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (x >> 33) % below
        };
        let (mut s, mut now) = (State::Fresh, 1_000 * SECOND);
        for i in 0..2_000 {
            now += next(2_000) * MS;
            let (d, n) = limit.decide(&s, now, 1);
            s = n;
            let whole = |at: Nanos| limit.decide(&s, at, 0).0.remaining == 2;
            assert!(whole(now + d.reset_after), "step {i}: not whole {} ms on", d.reset_after / MS);
            if d.reset_after > 0 {
                assert!(!whole(now + d.reset_after - 1), "step {i}: whole before {} ms", d.reset_after / MS);
            }
        }
        // 0.1 s into a window of 3 s, two admitted: whole again 4.4 s on (the two weigh 1
        // until just past half the next window), where the window's end is 2.9 s away.
        let start = 999 * SECOND + 100 * MS;
        let (_, s1) = limit.decide(&State::Fresh, start, 1);
        let (d, _) = limit.decide(&s1, start, 1);
        assert_eq!(d.reset_after, 4_400 * MS + 1);
    }

    #[test]
    fn backwards_time_is_clamped_not_underflowed() {
        for a in [Algorithm::TokenBucket, Algorithm::SlidingWindow, Algorithm::FixedWindow, Algorithm::SlidingLog] {
            let limit = Limit::new(a, 3, SECOND, None).unwrap();
            let (_, s) = limit.decide(&State::Fresh, 10 * SECOND, 3);
            let (d, _) = limit.decide(&s, 0, 1);
            assert!(!d.allowed, "{a:?}: going back in time must not grant quota");
            assert!(d.retry_after.is_some(), "{a:?}");
        }
    }

    #[test]
    fn refund_restores_quota() {
        for a in [Algorithm::TokenBucket, Algorithm::SlidingWindow, Algorithm::FixedWindow, Algorithm::SlidingLog] {
            let limit = Limit::new(a, 2, SECOND, None).unwrap();
            let now = 5 * SECOND + 10 * MS;
            let (_, s) = limit.decide(&State::Fresh, now, 2);
            let s = limit.refund(&s, now, 1);
            let (d, _) = limit.decide(&s, now, 1);
            assert!(d.allowed, "{a:?}");
        }
    }

    #[test]
    fn consumed_units_count_even_past_the_limit() {
        for a in [Algorithm::TokenBucket, Algorithm::SlidingWindow, Algorithm::FixedWindow, Algorithm::SlidingLog] {
            let limit = Limit::new(a, 5, SECOND, None).unwrap();
            let now = 7 * SECOND;
            let s = limit.consume(&State::Fresh, now, 3);
            assert_eq!(limit.decide(&s, now, 0).0.remaining, 2, "{a:?}");
            let s = limit.consume(&s, now, 10);
            let (d, _) = limit.decide(&s, now, 1);
            assert!(!d.allowed, "{a:?}");
            assert_eq!(d.remaining, 0, "{a:?}");
        }
    }

    #[test]
    fn a_concurrency_limit_takes_slots_gives_them_back_and_frees_them_after_hold_max() {
        let limit = Limit::new(Algorithm::Concurrent, 2, 60 * SECOND, None).unwrap();
        let t = 1_000 * SECOND;
        let (a, s) = limit.decide(&State::Fresh, t, 1);
        let (b, s) = limit.decide(&s, t + MS, 1);
        let (c, s) = limit.decide(&s, t + 2 * MS, 1);
        assert!(a.allowed && b.allowed && !c.allowed);
        assert_eq!(c.retry_after, Some(SECOND), "Retry-After: 1");
        // The first response completes: its slot is free at once.
        let s = limit.refund(&s, t, 1);
        let (d, s) = limit.decide(&s, t + 3 * MS, 1);
        assert!(d.allowed);
        // Releases lost: the slots free by hold_max (up to an eighth of it sooner), whenever
        // in their slot they were taken.
        assert!(!limit.decide(&s, t + 52 * SECOND, 1).0.allowed);
        assert!(limit.decide(&s, t + 60 * SECOND, 1).0.allowed);
        for taken in [t, t + 7 * SECOND, t + 7_499 * MS, t + 7_500 * MS] {
            let (one, held) = limit.decide(&State::Fresh, taken, 2);
            assert!(one.allowed);
            assert!(!limit.decide(&held, taken + 52 * SECOND + 500 * MS, 1).0.allowed, "{taken}");
            assert!(limit.decide(&held, taken + 60 * SECOND, 1).0.allowed, "{taken}");
        }
    }

    #[test]
    fn a_limit_is_rebuilt_from_its_capacity() {
        for (a, burst) in [
            (Algorithm::TokenBucket, Some(7)),
            (Algorithm::LeakyBucket, Some(0)),
            (Algorithm::LeakyBucket, Some(4)),
            (Algorithm::SlidingWindow, None),
            (Algorithm::Concurrent, None),
        ] {
            let l = Limit::new(a, 5, SECOND, burst).unwrap();
            assert_eq!(Limit::from_capacity(a, 5, SECOND, l.capacity()), Ok(l), "{a:?}");
        }
        assert!(Limit::from_capacity(Algorithm::LeakyBucket, 5, SECOND, 0).is_err(), "no leaky bucket holds nothing");
    }

    #[test]
    fn burst_is_only_for_token_bucket() {
        assert_eq!(
            Limit::new(Algorithm::FixedWindow, 5, SECOND, Some(2)),
            Err(LimitError::Burst("applies only to token_bucket and leaky_bucket"))
        );
    }

    /// NGINX `limit_req rate=5r/s burst=5` (no `nodelay`): of 12 requests at once, the first
    /// goes, 5 wait their turns 200 ms apart, 6 are rejected, each told to retry when a
    /// place in the queue frees.
    #[test]
    fn the_leaky_bucket_queues_a_burst_like_nginx() {
        let limit = Limit::new(Algorithm::LeakyBucket, 5, SECOND, Some(5)).unwrap();
        let t = 1_000 * SECOND;
        let mut s = State::Fresh;
        let mut out = alloc::vec::Vec::new();
        for _ in 0..12 {
            let (d, n) = limit.decide(&s, t, 1);
            s = n;
            out.push(if d.allowed { Ok(limit.wait(&d, 1) / MS) } else { Err(d.retry_after.map(|r| r / MS)) });
        }
        let mut expected: alloc::vec::Vec<Result<u64, Option<u64>>> = (0..6).map(|i| Ok(i * 200)).collect();
        expected.extend([Err(Some(200)); 6]);
        assert_eq!(out, expected);
        // `delay=3`: three of the queued go at once, the rest keep their turns.
        let delayed = limit.with_delay(3).unwrap();
        let mut s = State::Fresh;
        let waits: alloc::vec::Vec<u64> = (0..6)
            .map(|_| {
                let (d, n) = delayed.decide(&s, t, 1);
                s = n;
                delayed.wait(&d, 1) / MS
            })
            .collect();
        assert_eq!(waits, [0, 0, 0, 0, 200, 400]);
        assert_eq!(limit.with_delay(6), Err(LimitError::Delay("must be at most burst")));
        assert_eq!(
            Limit::new(Algorithm::TokenBucket, 5, SECOND, None).unwrap().with_delay(1),
            Err(LimitError::Delay("applies only to leaky_bucket"))
        );
        assert_ne!(delayed.fingerprint(), limit.fingerprint(), "another delay, another counter");
    }
}
