//! One counter's state machine at a store: the global state, each node's share and last
//! `seq`, grants and leases.

use crate::algo::{Algorithm, Limit, Nanos, State};
use crate::encoding::{put_varint, DecodeError, Reader};
use alloc::vec::Vec;

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
pub(super) struct Share {
    node: u64,
    /// The sequence number of the node's last batch applied to this counter.
    seq: u64,
    /// Recent units, in [`WEIGHT_SCALE`]ths, decaying by half every [`TRAFFIC_HALF_LIFE`]
    /// from `seen` on: the node's traffic share.
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
    /// On an exact rule's counter: units of the grant its last batch replaced that the node
    /// may have spent while that batch was on its way, beyond its new grant. They reach the
    /// store with its next batch, so they stay outstanding until then, or for
    /// [`REPORT_GRACE`] after `seen` (see [`Share::in_flight`]).
    pub(super) flight: u64,
    /// For a filter node (a node with a fallback of its own when the store is out of its
    /// reach): the counter's [`Counter::reported`] just after the node's last batch or ask.
    /// `None` for the Worker's isolates and the RLS front, which are never cut off.
    mark: Option<u64>,
    /// For a filter node: its part of the units the counter counted lately, in 1,024ths
    /// (see [`Share::counted`]).
    part: u64,
    /// How many of the counter's units `part` is of, up to the horizon.
    depth: u64,
    /// When the counter first heard from the node (its share was made).
    born: Nanos,
}

impl Share {
    /// Holds nothing beyond its grant: the units given to its asks, carried, or spent while
    /// its batch was on its way.
    fn settle(&mut self) {
        self.asked = 0;
        self.carried = 0;
        self.flight = 0;
    }

    /// A share read back from storage.
    fn decoded(
        [node, seq, units, grant, seen, until, asked, carried]: [u64; 8],
        last_ask: (u64, u64),
        flight: u64,
        (mark, part, depth, born): (Option<u64>, u64, u64, Nanos),
    ) -> Share {
        Share { node, seq, units, grant, seen, until, asked, carried, last_ask, flight, mark, part, depth, born }
    }

    /// A filter node's batch or ask counted `units`, after which the counter had counted
    /// `reported` units in all: its [`Share::part`] moves towards its part of what the counter
    /// counted since its last one, weighed by how much that was against `horizon` units (the
    /// quota: a node's part is of about one window's units). Weighed by units rather than by
    /// time, it stays as it was while nothing is counted (a quota ran out) and, for a node
    /// that falls silent, as it was when the node was last heard.
    fn counted(&mut self, units: u64, reported: u64, horizon: u64) {
        let since = self.mark.map_or(units, |m| reported.saturating_sub(m)).max(units);
        // Weighed against what it was of so far (a new node's first parts are not weighed
        // against an empty past).
        let depth = u128::from(self.depth.min(horizon));
        let part = (u128::from(self.part) * depth + (u128::from(units) << 10)) / (depth + u128::from(since)).max(1);
        self.part = u64::try_from(part.min(1 << 10)).unwrap_or(1 << 10);
        self.depth = self.depth.saturating_add(since).min(horizon);
        self.mark = Some(reported);
    }

    /// Its [`Share::part`] for as many of the counter's units as it was measured over, of
    /// `horizon` (in 1,024ths): a node barely heard from weighs little.
    fn weighed_part(&self, horizon: u128) -> u128 {
        u128::from(self.part) * u128::from(self.depth) / horizon.max(1)
    }

    /// Units held for what the node may have spent while its last batch was on its way, at
    /// `now`: [`Share::flight`] until [`REPORT_GRACE`] after that batch.
    fn in_flight(&self, now: Nanos) -> u64 {
        if self.seen.saturating_add(REPORT_GRACE) > now {
            self.flight
        } else {
            0
        }
    }

    /// Its recent units at `now` (decayed since it was last seen).
    fn recent(&self, now: Nanos) -> u64 {
        decayed(self.units, now.saturating_sub(self.seen))
    }

    /// Its recent units at `now` with `units` more spent.
    fn spent(&self, now: Nanos, units: u64) -> u64 {
        self.recent(now).saturating_add(units.saturating_mul(WEIGHT_SCALE))
    }
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

/// The fewest units free (beside every other node's grant) for which [`Counter::apply`]
/// grants a node that reported units at least 1. Any: the quota's last units, free, were
/// otherwise given to no node, and every request was denied while they stayed free. Since a
/// node admitting past its grant reports at once (the filter's `Syncer::overdrawn`), 1 measures
/// best (seeds 1, 33, 0x5eed2026): `zipf20_rtt20` 0.77 % over-admission on average and 0.80 %
/// false denials (2: 0.65 % and 0.94 %; 3: 0.57 % and 1.40 %), `zipf100_rtt20` 1.07 % and
/// 1.00 % (2: 0.94 % and 1.12 %; 3: 0.94 % and 1.44 %).
pub const ROOM_UNIT_FREE: u64 = 1;

/// [`ROOM_UNIT_FREE`] on an exact rule's counter, whose nodes have no overdraft to repay (a
/// spent grant asks): there a unit of room sits in a node's grant while others' asks are
/// refused, and at 1 it could be the unit the node spent while its batch travelled, held for
/// it beside the new grant ([`Counter::apply`]).
pub const ROOM_UNIT_FREE_EXACT: u64 = 3;

/// How far behind the latest instant a counter has seen a clock may be and still be a step
/// back, which is clamped (time never goes backwards for a counter). Further behind, it was
/// that instant that was wrong — a clock that jumped ahead and was put back — and the clock
/// is taken: clamped, a Redis clock 5 minutes ahead for 3 s kept a client of 5 a minute
/// refused for 5 minutes after it was put back.
pub const CLOCK_CORRECTION: Nanos = 60 * crate::algo::SECOND;

/// The longest lease a grant gets (far from the limit, or with no traffic to go by).
pub const MAX_LEASE: Nanos = 2 * crate::algo::SECOND;
/// The lease of units given to an ask (the longest, for [`Counter::ask_sized`]): they are
/// spent soon, or given back by expiring.
pub const ASK_LEASE: Nanos = crate::algo::SECOND;

const COUNTER_VERSION: u8 = 5;

/// The most units held for what a node of an exact rule may spend while its batch is on its
/// way ([`Share::flight`]): at a busy node's rate (8 per second in `zipf20`) a round trip
/// spends one at most; holding the whole unspent grant raised `zipf20_rtt20_exact`'s false
/// denials from 0.9 % to 2.6-4.7 %.
const FLIGHT_MAX: u64 = 1;

/// How fast a node's recent units fade: by half per second. Decayed by time, not per sync,
/// so that a node syncing a counter every 100 ms and one syncing it every 2 s weigh what
/// they spend per second (halved per sync, both weighed about 2 units: in `zipf20` the
/// busiest node, with 28 % of the traffic, got about 10 % of each grant split).
pub const TRAFFIC_HALF_LIFE: Nanos = crate::algo::SECOND;
/// Units count this many times against the `+ 1` every active node weighs, so a quiet
/// node's weight is a quarter of a unit a second's.
const WEIGHT_SCALE: u64 = 4;

/// An ask on an exact rule's counter with fewer than this many units per active node left
/// beside it is given only the units it asked for.
pub const ASK_SCARCE: u64 = 2;

/// An exact rule's counter of at most this many units at once (a window's quota, a bucket's
/// burst) is taken by asks alone ([`Counter::asks_only`]): a share of it is most of it.
pub const ASKS_ONLY_UP_TO: u64 = 10;

/// Whether an exact rule's counter under `limit` is taken by asks alone, no unit granted
/// beside an asked one: a limit of at most [`ASKS_ONLY_UP_TO`] units at once, or one slower
/// than a unit per longest lease ([`Counter::asks_only`]). A filter node asks for each of its
/// requests then, but while the store has named the counter out.
pub fn asks_alone(limit: &Limit) -> bool {
    limit.capacity() <= ASKS_ONLY_UP_TO
        || u128::from(limit.requests()) * u128::from(MAX_LEASE) < u128::from(limit.per().max(1))
}

/// How long past its lease a grant on an exact rule's counter stays held (or until the node's
/// next batch replaces it): units a node spends just before its lease ends reach the store
/// with its next batch, a sync interval and a round trip later (`sync.interval` and
/// `sync.timeout` at their defaults). Without it they looked free to other nodes' asks
/// meanwhile: `zipf20_rtt20_sliding_exact` over-admitted 7 % in its worst window against an
/// exact rule's bound of 1.8 %. Rules that are not exact keep their leases as they are: their
/// bound has room for the overdraft, and holding every lapsed grant raised `zipf20_rtt1`'s
/// false denials from 2.0 % to 3.0 %.
pub const REPORT_GRACE: Nanos = 150 * 1_000_000;

/// How long a filter node must have been silent on a counter before the store may take it as
/// cut off (ten sync intervals at the default).
pub const CUT_OFF_SILENCE: Nanos = crate::algo::SECOND;
/// A silent filter node is taken as cut off once the other nodes have reported so many units
/// since its last batch that, at its share of the counter's traffic, it would have had this
/// many to report (a node routed traffic by chance, at that share, reports none with odds
/// of about e⁻⁶, 0.25 %). Lower, live nodes were taken as cut off often enough to cost
/// false denials (at 3: `zipf20_rtt80` 1.09 % → 2.36 %, and `zipf20_rtt20_sliding_exact`'s
/// worst window 2.5 %, over its bound; at 4, `zipf20_rtt20` 1.09 % → 2.48 %; at 5,
/// `zipf20_rtt80` 1.72 %); higher, a node with a small share is taken too late (at 10,
/// `partition5_zipf20` over-admitted 9.9 % / 28 %, against 5.9 % / 14.5 % at 6).
pub const CUT_OFF_EXPECTED: u64 = 6;
/// [`CUT_OFF_EXPECTED`] for the other silent nodes of a counter once one is taken as cut off
/// (a partition cuts off several at once): at 6 a node with 5 % of the traffic was taken
/// only after most of a window, and `partition5_zipf20` over-admitted 5.9 % / 14.5 %; at 3
/// beside another, 4.0 % / 10.0 %, and no other scenario moved.
pub const CUT_OFF_EXPECTED_BESIDE: u64 = 3;

/// Until when `s`'s grant holds units: its lease, and on an `exact` rule's counter
/// [`REPORT_GRACE`] more.
fn held_until(s: &Share, exact: bool) -> Nanos {
    if exact {
        s.until.saturating_add(REPORT_GRACE)
    } else {
        s.until
    }
}

/// A well-mixed 64-bit value of `x` (SplitMix64's finalizer).
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// `units` decayed over `elapsed`: halved per [`TRAFFIC_HALF_LIFE`], linear in between.
fn decayed(units: u64, elapsed: Nanos) -> u64 {
    let halvings = elapsed / TRAFFIC_HALF_LIFE;
    if halvings >= 64 {
        return 0;
    }
    let whole = units >> halvings;
    let part = u128::from(whole) * u128::from(elapsed % TRAFFIC_HALF_LIFE) / u128::from(2 * TRAFFIC_HALF_LIFE);
    whole - u64::try_from(part).unwrap_or(whole)
}

/// One global counter: its state, the traffic shares of the nodes that sync to it, and its
/// recent rate.
///
/// The reference [`Store`](super::Store) holds many; the Cloudflare Worker holds one per Durable Object, so
/// both answer a delta the same way. Every operation clamps `now` to the latest instant the
/// counter has seen: time never goes backwards for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counter {
    /// The limit last applied (a delta or check with another limit replaces it).
    pub limit: Limit,
    /// The global state.
    pub state: State,
    pub(super) shares: Vec<Share>,
    /// The latest instant seen.
    pub last_seen: Nanos,
    /// Units reported per whole second: (second, units in the one before, units in it).
    rate: (u64, u64, u64),
    /// Whether a filter node has asked on this counter since its limit was last set: its
    /// rule is exact (rules that are not never ask), and lapsed grants are held for
    /// [`REPORT_GRACE`]. (The Worker's isolates ask on every rule, with [`Counter::ask_sized`],
    /// and report as they settle: holding theirs raised the isolates' false denials from
    /// 0.37 % to 3.5 %.)
    pub(super) exact: bool,
    /// Units counted from nodes' batches, asks and takes, all told (see [`Counter::cut_off`]).
    reported: u64,
    /// The nodes the store heard from on any counter within [`CUT_OFF_SILENCE`], sorted, as
    /// its registry says for the call at hand ([`Counter::heard_lately`]); `None` when it
    /// cannot say. Not stored: it is the registry's, not the counter's.
    heard: Option<Vec<u64>>,
}

impl Counter {
    /// A fresh counter.
    pub fn new(limit: Limit) -> Counter {
        Counter {
            limit,
            state: State::Fresh,
            shares: Vec::new(),
            last_seen: 0,
            rate: (0, 0, 0),
            exact: false,
            reported: 0,
            heard: None,
        }
    }

    /// Tells the counter, for the call at hand, which filter nodes the store heard from on
    /// any counter within [`CUT_OFF_SILENCE`] (its registry; a list cut short names no node
    /// wrongly, it only names fewer). A node among them is not out of reach of the store,
    /// however silent on this counter: its client moved to another node, or went quiet, and
    /// nothing is held for it ([`Counter::cut_off`]). The registries give the list in id
    /// order, so that a batch's counters need not each sort it; any other order is sorted.
    pub fn heard_lately(&mut self, nodes: &[u64]) {
        let mut nodes = nodes.to_vec();
        if !nodes.is_sorted() {
            nodes.sort_unstable();
        }
        self.heard = Some(nodes);
    }

    /// Tells the counter, for the call at hand, that none of its nodes is out of reach of the
    /// store: nodes that admit nothing without it (ratewall-store's rate limit service
    /// processes, which answer `UNAVAILABLE` while Redis does not), so a node silent on the
    /// counter has stopped spending, and nothing is held for it ([`Counter::cut_off`]).
    pub fn heard_all(&mut self) {
        let mut nodes: Vec<u64> = self.shares.iter().map(|s| s.node).collect();
        nodes.sort_unstable();
        self.heard = Some(nodes);
    }

    fn clock(&mut self, limit: Limit, now: Nanos) -> Nanos {
        if limit != self.limit {
            // The rules changed: the state carries over; a state of another algorithm reads
            // as fresh. Whether the rule is exact is learnt again from its asks.
            self.limit = limit;
            self.exact = false;
        }
        if now.saturating_add(CLOCK_CORRECTION) < self.last_seen {
            // The instants the counter holds from the clock that was ahead are brought back
            // to now: its state's (moved to now's window with its counts when it is used),
            // and its nodes' (a lease then ended, at the latest, as long after now as it can
            // last).
            for s in &mut self.shares {
                s.seen = s.seen.min(now);
                s.born = s.born.min(now);
                s.until = s.until.min(now.saturating_add(MAX_LEASE));
            }
            if self.rate.0 > now / crate::algo::SECOND {
                self.rate = (now / crate::algo::SECOND, 0, 0);
            }
            self.last_seen = now;
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
        if d.allowed {
            self.reported = self.reported.saturating_add(cost);
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
    ///
    /// For a filter node's batch: a node that reported units, whose share of the units free
    /// rounds to 0 while at least [`ROOM_UNIT_FREE`] are free, is granted 1 — see
    /// [`Counter::report`] for the answer without it.
    pub fn apply(&mut self, limit: Limit, now: Nanos, node: u64, seq: u64, units: u64, node_ttl: Nanos) -> Applied {
        self.apply_with(limit, now, (node, seq, units, now), node_ttl, (true, false))
    }

    /// [`Counter::apply`] with no unit of room: for the Worker's isolates and ratewall-store's
    /// RLS front, whose overdrafts are repaid by their own rules (given it, the isolates'
    /// simulation over-admitted 1.47 % instead of 0.85 %).
    pub fn report(&mut self, limit: Limit, now: Nanos, node: u64, seq: u64, units: u64, node_ttl: Nanos) -> Applied {
        self.apply_with(limit, now, (node, seq, units, now), node_ttl, (false, false))
    }

    /// [`Counter::report`] of units the node admitted from `since` on (its clock, at most
    /// `now`; 0: not known, taken as `now`): they are counted as of then, as the node counted
    /// them when it decided, so a token bucket's or a sliding window's state is not behind by
    /// the report's delay (a client that waited the `Retry-After` the node gave it was
    /// refused again by what the store then answered). Never before the counter's previous
    /// report; and a fixed window's units admitted in a window that has ended count in none
    /// ([`super::counted_units`]).
    pub fn report_since(
        &mut self,
        limit: Limit,
        now: Nanos,
        since: Nanos,
        (node, seq, units): (u64, u64, u64),
        node_ttl: Nanos,
    ) -> Applied {
        self.report_counted(limit, (now, since), (node, seq, units), node_ttl, false)
    }

    /// [`Counter::report_since`]; with `held_only`, for a node that admits only on what it
    /// holds (its grant and what its asks were given, never an overdraft: ratewall-store's
    /// RLS front), and spends what its asks were given before this report only until it cut
    /// it: of those units, only what the node could still spend (what it held, less what it
    /// reports) stays held through the next report. Holding them all, a lone process whose
    /// asks had been given 32 units, 28 of them spent and reported, saw its next asks refused
    /// with 16 of 50 free.
    pub fn report_counted(
        &mut self,
        limit: Limit,
        (now, since): (Nanos, Nanos),
        (node, seq, units): (u64, u64, u64),
        node_ttl: Nanos,
        held_only: bool,
    ) -> Applied {
        let units = super::counted_units(&limit, since, now, units);
        let since = if since == 0 { now } else { since };
        self.apply_with(limit, now, (node, seq, units, since), node_ttl, (false, held_only))
    }

    fn apply_with(
        &mut self,
        limit: Limit,
        now: Nanos,
        (node, seq, units, since): (u64, u64, u64, Nanos),
        node_ttl: Nanos,
        (room_unit, held_only): (bool, bool),
    ) -> Applied {
        let before = self.last_seen;
        let now = self.clock(limit, now);
        self.forget_quiet(node, now);
        let nodes = |c: &Counter| u32::try_from(c.active(now, node_ttl).count()).unwrap_or(u32::MAX);
        let prior = self.shares.iter().position(|s| s.node == node);
        if let Some(s) = prior.and_then(|i| self.shares.get(i)).filter(|s| seq <= s.seq) {
            let (grant, lease) = if seq == s.seq { (s.grant, s.until.saturating_sub(now)) } else { (0, 0) };
            let (view, _) = self.limit.decide(&self.state, now, 0);
            let (remaining, reset_after) = (view.remaining, self.reset_of(&view, now));
            return Applied { remaining, grant, reset_after, lease, nodes: nodes(self), counted: false };
        }
        self.state = self.limit.consume(&self.state, since.clamp(before.min(now), now), units);
        self.note_rate(now, units);
        self.reported = self.reported.saturating_add(units);
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
        // What the grant this batch replaces had left when the batch was cut (what the batch
        // reports came out of it): the node may spend it while the batch is on its way.
        let exact = self.exact;
        let unspent =
            self.shares.get(idx).filter(|s| held_until(s, exact) > now).map_or(0, |s| s.grant.saturating_sub(units));
        let ended = self.shares.get(idx).is_some_and(|s| self.window_ended(s.seen, now));
        if let Some(s) = self.shares.get_mut(idx) {
            s.units = s.spent(now, units);
            // Units given to its asks in a fixed window that has ended are held in none; of a
            // node that admits only on what it holds, at most what it could still spend.
            let carried = match (ended, held_only) {
                (true, _) => 0,
                (false, false) => s.asked,
                (false, true) => {
                    let could = held_until(s, exact) > now;
                    let held = if could { s.grant.saturating_add(s.asked).saturating_add(s.carried) } else { 0 };
                    s.asked.min(held.saturating_sub(units))
                }
            };
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
                flight: 0,
                mark: s.mark,
                part: s.part,
                depth: s.depth,
                born: s.born,
            };
            if room_unit {
                s.counted(units, self.reported, self.limit.requests());
            }
            let free = available.saturating_sub(carried);
            grant = self.share_of(node, free, lease, (node_ttl, !room_unit));
            // A unit of room: a filter node spends its overdraft again only after an answer
            // finds room for it (a grant above 0), and a node whose share rounds to 0 (most
            // of a fleet of 20 or 100 near a limit) otherwise waited many answers for one
            // while units were free, denying meanwhile.
            let room_free = if exact { ROOM_UNIT_FREE_EXACT } else { ROOM_UNIT_FREE };
            if room_unit && grant == 0 && units > 0 && free >= room_free && lease > 0 && !self.asks_only() {
                grant = 1;
            }
        }
        if let Some(s) = self.shares.get_mut(idx) {
            s.grant = grant;
            // An exact rule's units spent while the batch was on its way are counted nowhere
            // until the node's next batch: the node takes them out of its new grant, keeping
            // at least one unit of a grant above 0, so it may spend `unspent` and one more in
            // all where the store holds `grant`. Where the quota comes back all along (all but
            // fixed windows), the difference, up to [`FLIGHT_MAX`], is held until the next
            // batch can have come: given to another node's ask meanwhile, it put the fleet a
            // unit or two ahead of the exact limiter for the rest of a window, and
            // `zipf20_rtt20_sliding_exact` admitted 1.0-5.5 % of a window's quota while that
            // limiter had no room (0-1.5 % with it; bound 1.8 %). A fixed window's unit counted
            // late is over its limit once, within the bound, and holding it there raised
            // `zipf20_rtt20_exact`'s false denials from 0.6-1.3 % to 1.6-4.4 %.
            let unspent = unspent.min(FLIGHT_MAX);
            if exact && self.limit.algorithm() != Algorithm::FixedWindow {
                s.flight = if grant > 0 { unspent.saturating_add(1).saturating_sub(grant) } else { unspent };
            }
        }
        // What nodes cut off are taken to admit is not there for this one to count on.
        let remaining = view.remaining.saturating_sub(self.cut_off(now, Some(node)));
        Applied { remaining, grant, reset_after: self.reset_of(&view, now), lease, nodes: nodes(self), counted: true }
    }

    /// `node`'s part of `available` units for a lease of `lease`: its traffic share (weights
    /// are recent units + 1, so a node new to a counter still gets some), rounded down, and
    /// no more than twice what that share of the fleet's recent rate would use in the lease
    /// — units a quiet node holds are locked from every other node.
    fn share_of(&self, node: u64, available: u64, lease: Nanos, (node_ttl, window_memory): (Nanos, bool)) -> u64 {
        if lease == 0 || self.asks_only() {
            return 0;
        }
        let now = self.last_seen;
        let weight = |s: &Share| u128::from(s.recent(now)) + 1;
        let mine = self.shares.iter().find(|s| s.node == node).map_or(1, weight);
        // `window_memory` (nodes that report with no unit of room, and sized asks: the
        // Worker's isolates, the RLS front's proxies): weighed against every node heard from
        // within the limit's window (at least `node_ttl`, at most [`SEQ_MEMORY`]), not only
        // the active ones. The Worker's isolates go quiet on a counter once its quota runs out (they report only
        // what they admit), and the first to report in the next window was the only one
        // active and was given 40 % of the quota for 2 s while the busy ones ran short: in
        // their simulation (seeds 1-8) false denials 1.17 % → 1.02 % (worst seed 1.35 % →
        // 1.10 %). Filter nodes keep `node_ttl`: weighed this way, their fixed-window
        // scenarios denied more (seeds 1, 33, 0x5eed2026: `zipf20_rtt20` 0.73 % → 0.87 %,
        // `zipf100_rtt20` 1.02 % → 1.17 %, `zipf20_rtt20_exact` 0.97 % → 1.44 %).
        let memory = if window_memory { self.limit.per().clamp(node_ttl, SEQ_MEMORY.max(node_ttl)) } else { node_ttl };
        let total: u128 = self.active(now, memory).filter(|s| s.node != node).map(weight).sum::<u128>() + mine;
        // In 1,024ths of a unit, rounded below by chance (see the end).
        // (Saturating: a limit of billions per nanosecond and a node's units near `u64::MAX`
        // overflow even `u128`; the share is then wrong but still at most `available`.)
        let fair = u128::from(available).saturating_mul(1 << 10).saturating_mul(mine) / total.max(mine);
        // The fleet's rate, no lower than the limit's own (`requests` per `per`): just after a
        // quota ran out nothing was reported for a while, and a new window's grants sized on
        // that would be 0 for every node (measured: 1 in 5 of `zipf20_rtt20`'s asks was a
        // busy node at a window's start).
        let per = u128::from(self.limit.per().max(1));
        let own = u128::from(self.limit.requests()) * u128::from(crate::algo::SECOND) / per;
        let rate = u128::from(self.rate.1.max(self.rate.2)).max(own).max(1);
        let use_in_lease = rate.saturating_mul(u128::from(lease)).saturating_mul(1 << 10).saturating_mul(mine)
            / total.max(mine)
            / u128::from(crate::algo::SECOND);
        // A fraction of a unit is a whole one with that chance (drawn from the node and the
        // instant): rounded down, a node whose share is under one unit — most nodes of a
        // fleet of 20 near a limit — was given nothing, and asked for every request.
        let share = fair.min(2 * use_in_lease);
        let draw = u128::from(mix(node ^ now) & 1023);
        let units = (share >> 10) + u128::from(draw < (share & 1023));
        u64::try_from(units).unwrap_or(u64::MAX).min(available)
    }

    /// Whether every unit of this counter is taken by an ask: an exact rule's limit slower than
    /// one unit per longest lease (5 a minute, 10 logins a minute), or of at most
    /// [`ASKS_ONLY_UP_TO`] units at once. A grant or the units given beside an ask would sit
    /// with one node, its lease longer than the limit's own pace, while the others' asks are
    /// refused: at 3 nodes and a limit of 5 a minute, requests taking turns over the nodes
    /// were refused with 3 units left; at 2 NGINX and a token bucket of burst 3, the second
    /// proxy's first request was refused with 2 tokens left, in the first proxy's grant.
    /// Asking costs each request a round trip, which such a limit's traffic can afford.
    fn asks_only(&self) -> bool {
        self.exact && asks_alone(&self.limit)
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
            flight: 0,
            mark: None,
            part: 0,
            depth: 0,
            born: now,
        });
        self.shares.len() - 1
    }

    /// Whether `seen` is in a fixed window that has ended by `now` (never, for the other
    /// algorithms): what a node was given then — a grant, units beside an ask — holds nothing
    /// in the current window, as [`Counter::outstanding`] counts it. Held on, units an ask
    /// gave a node at a window's end took from the next window's quota (the node's first
    /// calls there were refused).
    fn window_ended(&self, seen: Nanos, now: Nanos) -> bool {
        super::window_of(&self.limit, seen) < super::window_of(&self.limit, now)
    }

    /// Units held by the nodes' grants still on lease (all nodes but `except`). A fixed
    /// window's grant also ends with the window it was given in.
    pub(super) fn outstanding(&self, now: Nanos, except: Option<u64>) -> u64 {
        let per = self.limit.per().max(1);
        let fixed = self.limit.algorithm() == Algorithm::FixedWindow;
        let exact = self.exact;
        self.shares
            .iter()
            .filter(|s| Some(s.node) != except && !(fixed && s.seen / per != now / per))
            .map(|s| {
                let leased = if held_until(s, exact) > now {
                    s.grant.saturating_add(s.asked).saturating_add(s.carried)
                } else {
                    0
                };
                leased.saturating_add(s.in_flight(now))
            })
            .fold(self.cut_off(now, except), u64::saturating_add)
    }

    /// Units held for filter nodes that look cut off from the store at `now` (all but
    /// `except`): a node out of reach falls back to admitting its share of the limit on its
    /// own (docs/sync-protocol.md, "Degraded mode"), which the store never hears of until it
    /// is back. Without a hold the nodes still in reach were granted the whole quota, and
    /// `partition5_zipf20` over-admitted 15.8 % per window (32.5 % at worst; with it, 4.0 %
    /// and 10.0 %, false denials 3.0 % → 6.6 %, most of them the nodes cut off denying on
    /// their own). The answers' `remaining` leaves it out too, so that no node overdraws on it
    /// (without: 8.1 % / 16.5 % at a hold of the bare part).
    ///
    /// A node is taken as cut off when it has been silent on the counter for
    /// [`CUT_OFF_SILENCE`], its lease is over, the store has heard nothing from it on any
    /// counter for as long (where the store can say: [`Counter::heard_lately`]), and the units the others reported meanwhile
    /// say it would have had at least [`CUT_OFF_EXPECTED`] to report at its part of the
    /// counter's traffic ([`Share::part`]); once one is, the others at
    /// [`CUT_OFF_EXPECTED_BESIDE`]. Its part of the quota is held until it reports
    /// again or is forgotten ([`SEQ_MEMORY`]), less the parts of nodes that began to sync the
    /// counter since it fell silent: a restarted node syncs under a new id, and its
    /// replacement takes its traffic over, so what is held goes as the newcomer's part grows.
    /// What is held is the part times `1 + 1 / DEGRADED_MARGIN`, as the node admits.
    /// A part counts for as many of the quota's units as it was measured over, so a node
    /// barely heard from holds little. Only windowed counters hold: a window's count is what
    /// the nodes admitted in it, so holding the share's units keeps the fleet at the limit,
    /// where a bucket's tokens come back at the full rate whatever is held.
    pub(super) fn cut_off(&self, now: Nanos, except: Option<u64>) -> u64 {
        let windowed =
            matches!(self.limit.algorithm(), Algorithm::FixedWindow | Algorithm::SlidingWindow | Algorithm::SlidingLog);
        if !windowed {
            return 0;
        }
        let quota = u128::from(self.limit.requests());
        // The nodes taken as cut off at `expected` units: their parts, and the earliest of
        // their silences.
        let cut_at = |expected: u64| {
            let expected = u128::from(expected);
            let mut earliest: Option<Nanos> = None;
            let cut: u128 = self
                .shares
                .iter()
                .filter(|s| Some(s.node) != except && s.until <= now)
                .filter(|s| now.saturating_sub(s.seen) >= CUT_OFF_SILENCE)
                .filter(|s| self.heard.as_ref().is_none_or(|heard| heard.binary_search(&s.node).is_err()))
                .filter_map(|s| {
                    // Its part of the counter's units as of its last batch.
                    let mine = s.weighed_part(quota);
                    let rest = (1u128 << 10).saturating_sub(mine);
                    let since = u128::from(self.reported.saturating_sub(s.mark?));
                    let missed = mine > 0 && rest > 0 && since >= expected && since * mine >= expected * rest;
                    missed.then(|| {
                        earliest = Some(earliest.map_or(s.seen, |e| e.min(s.seen)));
                        mine
                    })
                })
                .sum();
            (cut, earliest)
        };
        let (mut cut, mut earliest_silence) = cut_at(CUT_OFF_EXPECTED);
        if earliest_silence.is_some() {
            // One node cut off makes it likelier that others are (a partition cuts off several
            // at once): they are taken at fewer units.
            (cut, earliest_silence) = cut_at(CUT_OFF_EXPECTED_BESIDE);
        }
        let Some(earliest) = earliest_silence else { return 0 };
        // Less the parts of filter nodes that began to sync the counter since: a node
        // restarted under a new id, or its replacement, takes its traffic over.
        let taken: u128 =
            self.shares.iter().filter(|j| j.mark.is_some() && j.born > earliest).map(|j| j.weighed_part(quota)).sum();
        // As much as such a node admits on its own: its share, with the margin.
        let margin = u128::from(super::DEGRADED_MARGIN);
        let held = (quota * cut.saturating_sub(taken) * (margin + 1) / margin) >> 10;
        u64::try_from(held.min(quota)).unwrap_or(u64::MAX)
    }

    /// Units held at `now` for filter nodes taken as cut off from the store (see the protocol
    /// doc, "Degraded mode"): what a store counts in its metrics.
    pub fn held_for_cut_off(&self, now: Nanos) -> u64 {
        self.cut_off(now.max(self.last_seen), None)
    }

    /// An answer's `reset_after`: the view's (the quota's reset: a fixed window's end, a
    /// sliding one's current window's), except that while nothing remains of a sliding
    /// window or log it is the time until one unit is free again, so that a node tells a
    /// client the wait after which it is admitted.
    fn reset_of(&self, view: &crate::algo::Decision, now: Nanos) -> Nanos {
        let sliding = matches!(self.limit.algorithm(), Algorithm::SlidingWindow | Algorithm::SlidingLog);
        match (sliding && view.remaining == 0).then(|| self.out_for(now)).flatten() {
            Some(free) => free,
            None => view.reset_after,
        }
    }

    /// How long until one unit is free again, if not one is at `now` (`None`: one is, or
    /// none ever will be): how long a store names the counter out ([`super::Out`]).
    pub fn out_for(&self, now: Nanos) -> Option<Nanos> {
        let (one, _) = self.limit.decide(&self.state, now.max(self.last_seen), 1);
        if one.allowed {
            return None;
        }
        one.retry_after
    }

    /// Units the grants of nodes other than `node` hold at `now` (on lease): what the node
    /// must not take for itself beyond its own grant. The Worker's isolates read it in every
    /// answer, to admit past their grants only on units nobody holds.
    pub fn held_by_others(&self, now: Nanos, node: u64) -> u64 {
        self.outstanding(now.max(self.last_seen), Some(node))
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
        self.ask_leased(limit, now, (node, ask), cost, node_ttl, (false, None))
    }

    /// [`Counter::ask`] of a node that says how much of what it holds here it may still
    /// spend or has spent unreported (`mine`): of its own grants, only that much is held
    /// against its ask. For ratewall-store's RLS front, which knows it exactly: a grant
    /// lapsed there but still held here for its report's grace (150 ms) had its next ask
    /// refused with units free.
    pub fn ask_holding(
        &mut self,
        limit: Limit,
        now: Nanos,
        (node, ask, mine): (u64, u64, u64),
        cost: u64,
        node_ttl: Nanos,
    ) -> Applied {
        self.ask_leased(limit, now, (node, ask), cost, node_ttl, (false, Some(mine)))
    }

    /// [`Counter::ask`], with the units given beside the asked ones held only for the lease
    /// they were sized for (the lease a sync would give now, at most [`ASK_LEASE`]) instead
    /// of [`ASK_LEASE`]. For the Worker's isolates, which count a lease from when they asked
    /// and settle with every report. Filter nodes keep the fixed lease: theirs run from the
    /// answer's arrival, and near a quota's end a sized lease is shorter than a round trip
    /// (measured: false denials 1.1 % → 27 % in `zipf20_rtt20`).
    pub fn ask_sized(&mut self, limit: Limit, now: Nanos, node: u64, ask: u64, cost: u64, node_ttl: Nanos) -> Applied {
        self.ask_leased(limit, now, (node, ask), cost, node_ttl, (true, None))
    }

    fn ask_leased(
        &mut self,
        limit: Limit,
        now: Nanos,
        (node, ask): (u64, u64),
        cost: u64,
        node_ttl: Nanos,
        (sized, mine): (bool, Option<u64>),
    ) -> Applied {
        let now = self.clock(limit, now);
        self.exact |= !sized;
        self.forget_quiet(node, now);
        let (view, _) = self.limit.decide(&self.state, now, 0);
        let nodes = u32::try_from(self.active(now, node_ttl).count()).unwrap_or(u32::MAX);
        let (remaining, reset_after) = (view.remaining, self.reset_of(&view, now));
        if let Some(s) = self.shares.iter().find(|s| s.node == node && ask != 0 && s.last_ask.0 == ask) {
            let grant = s.last_ask.1;
            // A sized lease's repeat answers what is left of the hold, not a fresh second.
            let lease = if sized { s.until.saturating_sub(now) } else { ASK_LEASE };
            return Applied { remaining, grant, reset_after, lease, nodes, counted: false };
        }
        let held = match mine {
            None => self.outstanding(now, None),
            Some(mine) => {
                let others = self.outstanding(now, Some(node));
                let own = self.outstanding(now, None).saturating_sub(others);
                others.saturating_add(own.min(mine))
            }
        };
        let free = view.remaining.saturating_sub(held);
        let mut given = 0;
        // The units given beside the asked ones are sized for this lease (and, `sized`, held
        // for it).
        let sized_lease = self.lease(view.remaining, now).min(ASK_LEASE);
        let lease = if sized { sized_lease } else { ASK_LEASE };
        if cost <= free {
            // On an exact rule's counter near its quota's end, an ask takes only what it asked
            // for: units given beside it would sit in one node's grant while other nodes' asks
            // are refused (at 3 nodes and a limit of 5, a fleet admitted 4).
            let scarce = !sized && free - cost < u64::from(nodes.max(1)).saturating_mul(ASK_SCARCE);
            let extra = if scarce { 0 } else { self.share_of(node, free - cost, sized_lease, (node_ttl, sized)) };
            given = cost.saturating_add(extra);
            self.state = self.limit.consume(&self.state, now, cost);
            self.note_rate(now, cost);
            self.reported = self.reported.saturating_add(cost);
            let idx = match self.shares.iter().position(|s| s.node == node) {
                Some(i) => i,
                None => self.new_share(node, now),
            };
            let (reported, horizon, exact) = (self.reported, self.limit.requests(), self.exact);
            let ended = self.shares.get(idx).is_some_and(|s| self.window_ended(s.seen, now));
            if let Some(s) = self.shares.get_mut(idx) {
                if held_until(s, exact) <= now || ended {
                    // Its lease ran out, or its fixed window ended: what it held then is free,
                    // and extending the lease for this ask must not hold it again (a burst
                    // after a pause had its second call refused for units the node no longer
                    // held).
                    s.grant = 0;
                    s.asked = 0;
                    s.carried = 0;
                }
                if !sized {
                    s.counted(cost, reported, horizon);
                }
                // The asked units are the node's traffic too (it never reports them).
                s.units = s.spent(now, cost);
                s.asked = s.asked.saturating_add(extra);
                s.last_ask = (ask, given);
                s.until = s.until.max(now.saturating_add(lease));
                s.seen = now;
            }
        }
        // What remains after the units this ask took.
        let (view, _) = self.limit.decide(&self.state, now, 0);
        let nodes = u32::try_from(self.active(now, node_ttl).count()).unwrap_or(nodes);
        let remaining = view.remaining.saturating_sub(self.cut_off(now, Some(node)));
        // A filter node's refused ask is told how long until an ask of its units could be
        // taken ([`Counter::retry_after`]): its request's `Retry-After`. (A token bucket's
        // time to fill, or a spent grant's second, was short: a client that waited it was
        // refused again.)
        let reset_after = match (given, sized) {
            (0, false) if cost > 0 => self.retry_after(now, cost).unwrap_or_else(|| self.reset_of(&view, now)),
            _ => self.reset_of(&view, now),
        };
        Applied { remaining, grant: given, reset_after, lease, nodes, counted: given > 0 }
    }

    /// `node` has stopped spending on this counter (a Worker isolate whose client moved to
    /// another): what it held is free for the others at once, and its recent traffic no
    /// longer weighs against theirs in the shares of what remains. Without it, the isolate a
    /// client left held most of what remained for its lease, and was given as much again at
    /// its last report, while the isolate the client had moved to denied.
    pub fn release(&mut self, node: u64) {
        if let Some(s) = self.shares.iter_mut().find(|s| s.node == node) {
            s.settle();
            s.grant = 0;
            s.units = 0;
            s.until = s.until.min(s.seen);
        }
    }

    /// Releases what `node` holds beyond its grant (the units given to its asks, which
    /// [`Counter::apply`] keeps outstanding until the batch after): for a node that spent
    /// nothing while its batch was on its way, so the batch reported all it spent. The
    /// Worker's isolates settle this way when a request waits on their report.
    pub fn settle(&mut self, node: u64) {
        if let Some(s) = self.shares.iter_mut().find(|s| s.node == node) {
            s.settle();
        }
    }

    /// How long a request of `cost` units refused by [`Counter::ask`] at `now` waits before
    /// an ask could take them: until the state alone has `cost` units free beside every grant
    /// held, or until the grants' leases run out (their units are then free unless their
    /// holders reported spending them), whichever is sooner. `None` when `cost` can never
    /// fit the limit.
    pub fn retry_after(&self, now: Nanos, cost: u64) -> Option<Nanos> {
        let now = now.max(self.last_seen);
        let (alone, _) = self.limit.decide(&self.state, now, cost);
        let held = self.outstanding(now, None);
        if held == 0 {
            return alone.retry_after.or(alone.allowed.then_some(0));
        }
        let (beside, _) = self.limit.decide(&self.state, now, cost.saturating_add(held));
        let exact = self.exact;
        let flights = self.shares.iter().filter(|s| s.flight > 0).map(|s| s.seen.saturating_add(REPORT_GRACE));
        let leases_end = self
            .shares
            .iter()
            .map(|s| held_until(s, exact))
            .chain(flights)
            .filter(|&u| u > now)
            .map(|u| u - now)
            .min()
            .unwrap_or(0);
        let after_leases = match (alone.allowed, alone.retry_after) {
            (true, _) => Some(leases_end),
            (false, Some(r)) => Some(r.max(leases_end)),
            (false, None) => None,
        };
        match (beside.retry_after, after_leases) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
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
        self.encode_version(COUNTER_VERSION)
    }

    /// The encoding of `version`, 2 or later (version 2 has no exactness flag, 3 no units
    /// in flight, 4 no marks for nodes cut off): what a store of that version wrote, for reading old counters.
    pub(super) fn encode_version(&self, version: u8) -> Vec<u8> {
        let mut out = alloc::vec![version];
        self.state.encode_into(&mut out);
        put_varint(&mut out, self.last_seen);
        for v in [self.rate.0, self.rate.1, self.rate.2] {
            put_varint(&mut out, v);
        }
        put_varint(&mut out, self.shares.len() as u64);
        for s in &self.shares {
            let fields =
                [s.node, s.seq, s.units, s.grant, s.seen, s.until, s.asked, s.carried, s.last_ask.0, s.last_ask.1];
            let flight = (version >= 4).then_some(s.flight);
            // The mark is written 0 for none, otherwise + 1.
            let cut_off = if version >= 5 {
                alloc::vec![s.mark.map_or(0, |m| m.saturating_add(1)), s.part, s.depth, s.born]
            } else {
                alloc::vec![]
            };
            for v in fields.into_iter().chain(flight).chain(cut_off) {
                put_varint(&mut out, v);
            }
        }
        if version >= 3 {
            out.push(u8::from(self.exact));
        }
        if version >= 5 {
            put_varint(&mut out, self.reported);
        }
        out
    }

    /// This counter as a store of version 4 or before reads it back: no node's part known.
    #[cfg(test)]
    pub(super) fn without_parts(&self) -> Counter {
        let mut c = self.clone();
        c.reported = 0;
        for s in &mut c.shares {
            (s.mark, s.part, s.depth, s.born) = (None, 0, 0, 0);
        }
        c
    }

    /// Decodes [`Counter::encode`] under `limit`, and the versions before it: version 4 had
    /// no marks (read as none: no node is taken as cut off before its next batch), version 3 had
    /// no units held in flight (read as none), version 2
    /// no exactness flag (read as not exact until the next ask), version 1 no rate and no
    /// leases (its grants are taken as leased for [`MAX_LEASE`]). Trailing bytes are an
    /// error.
    pub fn decode(limit: Limit, bytes: &[u8]) -> Result<Counter, DecodeError> {
        let mut r = Reader { bytes, pos: 0 };
        let v = r.u8()?;
        if !(1..=COUNTER_VERSION).contains(&v) {
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
            let flight = if v >= 4 { r.varint()? } else { 0 };
            let (mark, part, depth, born) = if v >= 5 {
                (r.varint()?.checked_sub(1), r.varint()?.min(1 << 10), r.varint()?, r.varint()?)
            } else {
                (None, 0, 0, 0)
            };
            let cut_off = (mark, part, depth, born);
            shares.push(Share::decoded(
                [node, seq, units, grant, seen, until, asked, carried],
                last_ask,
                flight,
                cut_off,
            ));
        }
        let exact = v >= 3 && r.u8()? == 1;
        let reported = if v >= 5 { r.varint()? } else { 0 };
        if r.pos != bytes.len() {
            return Err(DecodeError::Truncated);
        }
        Ok(Counter { limit, state, shares, last_seen, rate, exact, reported, heard: None })
    }
}
