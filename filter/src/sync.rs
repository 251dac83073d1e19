//! The filter's side of cross-replica sync (docs/sync-protocol.md).
//!
//! Every VM (worker thread) keeps the units it admitted per counter since its last tick in
//! its own memory, and on each tick merges them into an *outbox* in shared data (CAS). One VM
//! per node — the holder of a lease taken by CAS in shared data, so no Envoy-only singleton
//! is needed and NGINX works too — drains the outboxes and sends the store one signed batch
//! per interval (or every other one, while every counter is far from its limit; with nothing
//! to report, a heartbeat every third of `stale_after`). The store's answer carries a leased
//! grant per counter, written into the counter's table entry, where every VM's admissions
//! spend it; and the global view (nodes, the store's clock, when it was last heard from),
//! which every VM reads on its tick.
//!
//! A request whose grant is spent while the store still showed quota *asks* (see
//! [`Syncer::ask`]): it waits, paused, for one round trip instead of being denied.
//!
//! While the view is stale (the store unreachable past `stale_after`), `open` rules limit to
//! `limit / nodes` locally and `closed` rules reject. Deltas are kept, bounded, and sent after
//! recovery. A failing store trips a circuit breaker, so ticks stop paying timeouts.

use crate::host::{Host, Level, SetError};
use crate::table::{Allowance, Flow, Table};
use ratewall_core::algo::{Limit, Nanos};
use ratewall_core::encoding::{put_varint, Reader};
use ratewall_core::rules::SyncOptions;
use ratewall_core::sync::{
    hex, sign, unhex, verify, window_of, Delta, SyncRequest, SyncResponse, TopSection, MAX_REQUEST_SKEW, RETRY_HORIZON,
};
use ratewall_core::topk::Lately;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

/// Deltas by counter key. A `HashMap` (its code is in the module already, for the SDK's
/// contexts) rather than a `BTreeMap`, which added ~8 KB to the wasm for no use of order.
type Pending = HashMap<Vec<u8>, (Limit, u64), KeyHasher>;

/// Units admitted, by counter key: (limit, units, window) — `window`: a fixed window's the
/// units were admitted in, on the store's clock ([`window_of`]; 0 for the other algorithms).
/// A fixed window's units are sent only while their window lasts: reported after it, the
/// store would count them in the next one (a client's last requests of a window would take
/// from its next).
type Units = HashMap<Vec<u8>, (Limit, u64, u64), KeyHasher>;

/// SipHash-1-3 (the table's hash) with fixed keys for the pending maps. std's `RandomState`
/// has no randomness to draw on wasm32-unknown-unknown either (its keys are constants there),
/// and brings its own hasher and lazy thread-local keys (~2 KB of wasm); the maps are bounded
/// ([`MAX_PENDING`]), which bounds what crafted colliding keys could cost.
#[derive(Clone, Copy, Debug, Default)]
struct KeyHasher;

impl std::hash::BuildHasher for KeyHasher {
    type Hasher = siphasher::sip::SipHasher13;
    fn build_hasher(&self) -> Self::Hasher {
        siphasher::sip::SipHasher13::new_with_keys(0x7261_7465_7761_6c6c, 0x7065_6e64_696e_6721)
    }
}

/// VM numbers are taken from this counter, one per proxy (whatever store its documents sync
/// to, so that no two VMs share one).
const VMS: &str = "rw1/sync/vms";
/// Outboxes VMs spread their deltas over (VM `i` uses `i % OUTBOXES`).
pub const OUTBOXES: u32 = 8;
/// Most counters one VM's pending deltas, one outbox, or the syncer's unsent set hold; units
/// for further counters are dropped (and counted): memory stays bounded.
pub const MAX_PENDING: usize = 20_000;
/// Most counters in one batch (the Worker store accepts 500).
pub const MAX_BATCH: usize = 500;
/// Most asks one VM has in flight; a request past them is denied as before asks existed.
pub const MAX_ASKS: u32 = 64;
/// How long after a counter's last request the node keeps renewing its grant: a counter a
/// node sees a request on every few seconds (a quiet node's share of a busy key) then finds
/// its grant fresh, rather than lapsed, when the next one comes. Counted in whole seconds,
/// so 5 to 6 s.
const RENEW_FOR: Nanos = 5_000 * MS;
/// For how long past the end of its wait (and [`Syncer::lag`]) a quiet node takes the unit
/// that came back to a counter the store named out (a sliding log: one of its slots more):
/// a client told to come back then (its `Retry-After`, rounded up to a whole second) finds it
/// (see [`Syncer::came_back`]).
pub const BACK_FOR: Nanos = 1_500 * MS;
/// How long past the end of its wait (and [`Syncer::lag`]) a counter named out is kept when no
/// answer names it again: longer than [`BACK_FOR`] for a sliding log, whose unit the node's own
/// count may free up to one of the log's slots sooner than the store's.
const BACK_KEPT: Nanos = 10_000 * MS;
/// A grant leased at least this long shows its counter far from its limit.
const RELAXED_LEASE: Nanos = 1_000 * MS;
/// The most the store's clock may differ from the node's: an answer further off is refused
/// (one signed answer claiming the year 2554 would otherwise shift every window).
pub const MAX_STORE_SKEW: Nanos = 300 * 1_000 * MS;
/// Failures in a row that open the circuit breaker.
const BREAKER_AFTER: u32 = 3;
/// The longest the breaker stays open: a store back after an outage is tried within it (at
/// 30 s, closed rules answered 503 for 28 s after the store was back). A call every 8 s per
/// node is nothing to a store that is down.
const BREAKER_MAX: Nanos = 8_000 * MS;

/// The longest a node whose batches the store refuses for their time waits before it tries
/// again (its clock may have been put right meanwhile).
const REFUSED_RETRY: Nanos = 2_000 * MS;

/// How long the breaker stays open after `failures` in a row (none below [`BREAKER_AFTER`]):
/// 500 ms, doubling with each failure after, at most [`BREAKER_MAX`].
fn breaker_backoff(failures: u32) -> Nanos {
    if failures < BREAKER_AFTER {
        return 0;
    }
    (500 * MS).saturating_mul(1 << (failures - BREAKER_AFTER).min(6)).min(BREAKER_MAX)
}
/// The longest a VM's failing asks back off.
const ASK_BACKOFF_MAX: Nanos = 32_000 * MS;
/// Whether a wait until `until` is still on at `now`: `until` is ahead, and by no more than
/// `max`, the longest such a wait lasts. A wait further ahead is from a clock that stepped
/// back: over now, rather than when the clock catches up.
pub(crate) fn waiting(until: Nanos, now: Nanos, max: Nanos) -> bool {
    now < until && until <= now.saturating_add(max)
}

/// How long a failed batch is retried. A retry repeats the body, and with it the time the
/// batch was made: a store refuses it once that is [`MAX_REQUEST_SKEW`] old (so a captured
/// copy cannot be replayed after the store forgets its `seq`), so the node gives it up then
/// rather than at [`RETRY_HORIZON`].
const GIVE_UP_AFTER: Nanos = if MAX_REQUEST_SKEW < RETRY_HORIZON { MAX_REQUEST_SKEW } else { RETRY_HORIZON };
/// The status a store refuses a request with when its time is too far from the store's clock.
const REFUSED_FOR_TIME: u32 = 422;
const MS: Nanos = 1_000_000;

pub use ratewall_core::sync::OVERDRAFT_PART;
/// Below this many units beyond a node's grant, an overdraft is a draw (see [`overdraft`]).
const OVERDRAFT_DRAWN_BELOW: u64 = 5;

/// The overdraft a batch's answer allows a node on a counter of `quota` units per window
/// shared by `nodes`, that showed `remaining` units left and granted it `grant`: what it may
/// admit past the grant before the next answer, without waiting for the store — at most
/// what the store had beyond the grant, and at most [`OVERDRAFT_PART`]th of the quota per
/// node (but 1). The units admitted on it reach the store with the next batch, which counts
/// them: what the store grants next is smaller by them (the debt is repaid). While a node is
/// `overdrawn` — it spent overdraft units and no answer has found room for it since (a grant
/// of 0: the other nodes' grants hold all that remains) — its debt is not repaid and it gets
/// no new overdraft. So each node has at most one overdraft unrepaid at a time, and a fleet
/// of `n` nodes over-admits by at most `n × max(1, quota / 100 / n)` units through them
/// (docs/sync-protocol.md, "The error bound").
///
/// Near the quota's end, where the store had fewer than [`OVERDRAFT_DRAWN_BELOW`] units beyond
/// the grant, the overdraft is given only with the chance `beyond / 5` (`draw`: a well-mixed
/// value of the answer): every node of a fleet was otherwise given one there, together many
/// times what was left. A chance of `beyond / 3` had cut mean over-admission from 1.83 % to
/// 1.46 % in `zipf20_rtt20` and from 7.52 % to 7.12 % in `zipf100_rtt20` (seeds 11, 22, 33;
/// a chance of `3 × beyond / nodes` cut more and raised false denials at 100 nodes from 3.7 %
/// to 9.3 %). Since a node granted nothing renews its counter at the next batch (and is
/// repaid sooner), `beyond / 5` measures better on both figures than `beyond / 3` (`cargo
/// bench -p ratewall-tests --bench sync`, seeds 0x5eed2026, 11, 22): `zipf20_rtt20` over
/// 1.21 % → 0.81 % mean, false denials 1.10 % → 1.51 %; `zipf100_rtt20` over 1.75 % → 1.47 %,
/// false denials 3.74 % → 3.45 %.
pub fn overdraft(quota: u64, nodes: u32, remaining: u64, grant: u64, overdrawn: bool, draw: u64) -> u32 {
    if grant == 0 && overdrawn {
        return 0;
    }
    let beyond = remaining.saturating_sub(grant);
    if beyond < OVERDRAFT_DRAWN_BELOW && draw % OVERDRAFT_DRAWN_BELOW >= beyond {
        return 0;
    }
    let cap = (quota / OVERDRAFT_PART / u64::from(nodes.max(1))).max(1);
    u32::try_from(beyond.min(cap)).unwrap_or(u32::MAX)
}

/// Fewest units a store must have counted on a counter for a node's part of them to be taken
/// as its share of the traffic: of a limit of 10, two proxies' first units (one each, a
/// batch apart) measured the first at 100 %, and in an outage right after the pair admitted
/// 14 (shares summing to 1.36).
const SHARE_SAMPLE_MIN: u64 = 8;

/// This node's share of a counter's traffic, in 65,535ths, from the answer to a batch: what
/// the node's own state has used of the limit less its units the store has not counted yet
/// (`unreported`), over what the store's has (`remaining` left), averaged with the share
/// known before (`old`, 0: none) at a quarter's weight. Measured only once the store has
/// counted 5 % of the quota and [`SHARE_SAMPLE_MIN`] units (before that one request more or
/// less moves the ratio by a lot); until then the old share stays.
fn traffic_share(
    limit: Limit,
    local: &ratewall_core::State,
    now: Nanos,
    (remaining, unreported): (u64, u64),
    old: u16,
) -> u16 {
    // What `remaining` is counted against (a window's `requests`; buckets are measured by
    // `bucket_share`).
    let quota = limit.capacity();
    let global = quota.saturating_sub(remaining);
    if global == 0 || global < quota / 20 || global < SHARE_SAMPLE_MIN {
        return old;
    }
    let own = quota.saturating_sub(limit.decide(local, now, 0).0.remaining).saturating_sub(unreported).min(global);
    let sample = u16::try_from(own.saturating_mul(u64::from(u16::MAX)) / global).unwrap_or(u16::MAX);
    averaged(old, sample)
}

/// A share measured as `sample` (65,535ths), averaged with the one known before (`old`, 0:
/// none) at a quarter's weight; never 0, which reads as no share known.
fn averaged(old: u16, sample: u16) -> u16 {
    if old == 0 {
        return sample.max(1);
    }
    u16::try_from((u32::from(old) * 3 + u32::from(sample)) / 4).unwrap_or(u16::MAX).max(1)
}

/// Shortest time a bucket's share is measured over: ended when the fleet had taken a given
/// number of units, a measurement tended to end just after the node's own report of several
/// (two proxies' shares summed to 1.1-1.25).
const BUCKET_SAMPLE_MS: u64 = 5_000;

/// A token or leaky bucket's share, from the answer to a batch that reported `reported` units
/// of it at the store's `now`, its bucket `reset_after` short of full: the units the node
/// reported over those the fleet took from the bucket meanwhile (how much further from full
/// it is than at the last answer, plus the tokens that came back since), summed from answer
/// to answer for [`BUCKET_SAMPLE_MS`] at least and until the fleet took [`SHARE_SAMPLE_MIN`]
/// units and a twentieth of the burst, then averaged with the share known before (`old`) at
/// a quarter's weight. Returns the flow to keep and the share. A bucket's own state cannot
/// say it: a node's tokens come back at the whole rate, so at the limit a node that spent a
/// third of them read as having spent none (two proxies sharing a bucket admitted 4 of 60 a
/// minute while the store was down), or, just after a burst, all of them. Nor can the tokens
/// left: a bucket the fleet overdrew shows none left however far it is overdrawn.
pub(crate) fn bucket_share(
    limit: Limit,
    flow: Flow,
    (now, reset_after, reported): (Nanos, Nanos, u64),
    old: u16,
) -> (Flow, u16) {
    const ONE: u128 = Flow::ONE as u128;
    let now_ms = (now / MS).max(1);
    let per = u128::from(limit.per().max(1));
    let part = |n: u128| u64::try_from(n).unwrap_or(u64::MAX);
    // Units of a bucket's refill over `ns` (how far from full it is, when `ns` is its time to
    // fill), in [`Flow::ONE`]ths.
    let units_short = |ns: u64| u128::from(limit.requests()) * u128::from(ns) * ONE / per;
    let short = units_short(reset_after);
    let fresh = Flow { at_ms: now_ms, from_ms: now_ms, short_ns: reset_after, own: 0, all: 0 };
    let span = limit.capacity().saturating_mul(limit.interval());
    let elapsed = now_ms.saturating_sub(flow.at_ms).saturating_mul(MS);
    // None before, a clock that went back, or a gap longer than the bucket takes to fill
    // (what the fleet took meanwhile is unknown): measured from now on.
    if flow.at_ms == 0 || now_ms < flow.at_ms || flow.from_ms > flow.at_ms || elapsed > span {
        return (fresh, old);
    }
    let back = units_short(elapsed);
    let taken = short.saturating_sub(units_short(flow.short_ns).saturating_sub(back));
    let own = u128::from(flow.own) + u128::from(reported);
    let all = u128::from(flow.all) + taken;
    let enough = u128::from(SHARE_SAMPLE_MIN.max(limit.capacity() / 20)) * ONE;
    if now_ms.saturating_sub(flow.from_ms) < BUCKET_SAMPLE_MS || all < enough {
        let own = u32::try_from(own).unwrap_or(u32::MAX);
        return (Flow { from_ms: flow.from_ms, own, all: part(all), ..fresh }, old);
    }
    let sample = u16::try_from((own * ONE * u128::from(u16::MAX) / all).min(u128::from(u16::MAX))).unwrap_or(u16::MAX);
    (fresh, averaged(old, sample))
}

/// Units a node admitted on a counter that no batch the store has counted reported, when a
/// batch's answer comes: spent from the grant the answer replaces (while the batch was on its
/// way, or before it but published to the syncer too late), they reach the store with the
/// next batch, so the new grant and what remains are smaller by them (else the node spends
/// them twice: `zipf20_dense_rtt20` over-admitted 1.37 % of the limit, 1.12 % without it).
/// Estimated as the units admitted since the node's last answer on the counter (`since`) and
/// those that answer found unreported (`carry`), less the batch's (`reported`) — and no more
/// than `since`, so that units lost on the way (a batch given up) weigh on one answer only.
pub(crate) fn unreported(since: u32, carry: u32, reported: u64) -> u64 {
    u64::from(carry).saturating_add(u64::from(since)).saturating_sub(reported).min(u64::from(since))
}

/// Writes an answer's grants into the counters' table entries. A batch's grant replaces what
/// the node held; an ask's is added to it. Leases count from when the request was sent
/// (`sent`, the node's clock: the answer's `now` less the round trip), so the node's lease
/// always ends before the store's. Returns the counters (`fnv1a` of their keys) whose store
/// had no quota beyond their grant: at their limit fleet-wide, or about to be.
fn write_grants(
    host: &dyn Host,
    table: &Table,
    deltas: &[Delta],
    resp: &SyncResponse,
    sent: Nanos,
    ask: bool,
) -> Vec<u64> {
    let now = host.now();
    let mut limited = Vec::new();
    let sent_store = resp.now.saturating_sub(now.saturating_sub(sent));
    for (d, g) in deltas.iter().zip(&resp.grants) {
        let until_ms = (sent_store.saturating_add(g.lease) / MS).max(1);
        // An ask answered after its lease ended (a store further away than the lease): the
        // units it asked for were counted at the store for the request waiting on them, which
        // is decided now, so they are held for it — only they, the rest of the grant having
        // lapsed. Else the request was refused with its units counted all the same.
        let late_ask = ask && g.grant >= d.units && until_ms.saturating_mul(MS) <= resp.now;
        let (g_grant, until_ms) = if late_ask {
            (d.units, (resp.now.saturating_add(ratewall_core::sync::ASK_LEASE) / MS).max(1))
        } else {
            (g.grant, until_ms)
        };
        let weigh = |st: &ratewall_core::State| (d.limit.idle_at(st), d.limit.usage(st, now));
        let mut at_limit = false;
        let _ = table.update(
            host,
            &d.key,
            now,
            &weigh,
            &mut |st, held, flow| {
                // Units admitted in a fixed window that has ended are not reported (see
                // [`Units`]): none of them weighs on the current window's grant.
                let per = d.limit.per().max(1);
                let ended = matches!(st, ratewall_core::State::FixedWindow { window, .. } if *window < resp.now / per);
                let (since, carry) = held.filter(|_| !ended).map_or((0, 0), |h| (h.since, h.carry));
                // An ask's answer (exact rules, which count no units unreported) leaves them
                // as they were.
                let unreported = if ask { 0 } else { unreported(since, carry, d.units) };
                // A grant the store found room for stays at least 1: it repays the node.
                let (remaining, grant) =
                    (g.remaining.saturating_sub(unreported), g_grant.saturating_sub(unreported).max(g_grant.min(1)));
                // Whether the store had quota beyond this grant: a request it leaves short may ask.
                // An ask's `remaining` is counted after its asked units, which its grant holds.
                let more = if ask { grant > 0 && remaining > grant.saturating_sub(d.units) } else { remaining > grant };
                at_limit = !more;
                let kept = if ask { held.map_or(0, |h| h.units_at(resp.now)) } else { 0 };
                // An ask's answer leaves the overdraft as it was.
                let over = if ask {
                    held.map_or(0, |h| h.over)
                } else {
                    let overdrawn = held.is_some_and(|h| h.overdrawn);
                    let h = ratewall_core::key::fnv1a(&d.key) ^ resp.now.wrapping_mul(0x9e37_79b9_7f4a_7c15);
                    overdraft(d.limit.quota(), resp.nodes, remaining, grant, overdrawn, h ^ (h >> 29))
                };
                // Repaid once an answer finds room for the node; else it stays overdrawn.
                let overdrawn = held.is_some_and(|h| h.overdrawn) && (ask || grant == 0);
                let (since, carry) =
                    if ask { (since, carry) } else { (0, u32::try_from(unreported).unwrap_or(u32::MAX)) };
                let grant = u32::try_from(grant).unwrap_or(u32::MAX);
                let share = held.map_or(0, |h| h.share);
                // A fixed window's grant belongs to the store's current window: a state of an
                // older one is moved on with it (it is spent; else the grant would be read as
                // the old window's and dropped), and a fresh one (the node admitted nothing on
                // the counter yet) takes that window, so that in the next window the grant is
                // read as an old window's, not spent as a grant of that one.
                let fresh_fixed = matches!(st, ratewall_core::State::Fresh)
                    && d.limit.algorithm() == ratewall_core::Algorithm::FixedWindow;
                let before = ended || fresh_fixed;
                let st = if before {
                    ratewall_core::State::FixedWindow { window: resp.now / per, count: 0 }
                } else {
                    st.clone()
                };
                let kept_flow = if held.is_some() { *flow } else { Flow::default() };
                let bucket = matches!(
                    d.limit.algorithm(),
                    ratewall_core::Algorithm::TokenBucket | ratewall_core::Algorithm::LeakyBucket
                );
                let (next_flow, share) = match (ask, bucket) {
                    // An exact bucket's units taken by asks are the node's too.
                    (true, true) if g.grant >= d.units => (
                        Flow {
                            own: kept_flow.own.saturating_add(u32::try_from(d.units).unwrap_or(u32::MAX)),
                            ..kept_flow
                        },
                        share,
                    ),
                    (true, _) => (kept_flow, share),
                    (false, true) => bucket_share(d.limit, kept_flow, (resp.now, g.reset_after, d.units), share),
                    (false, false) => {
                        (kept_flow, traffic_share(d.limit, &st, resp.now, (g.remaining, unreported), share))
                    }
                };
                *flow = next_flow;
                Some((
                    st,
                    Some(Allowance {
                        units: kept.saturating_add(grant),
                        more,
                        until_ms,
                        over,
                        overdrawn,
                        share,
                        since,
                        carry,
                    }),
                ))
            },
            &mut Default::default(),
        );
        if at_limit {
            limited.push(ratewall_core::key::fnv1a(&d.key));
        }
    }
    limited
}

/// Counters a VM's answers found at their limit fleet-wide are remembered this long (the
/// store's shortest top-offenders window), at most [`LIMITED_KEPT`] of them.
const LIMITED_FOR: Nanos = 60 * ratewall_core::SECOND;
const LIMITED_KEPT: usize = 256;

impl Syncing {
    /// Notes a counter a VM's deltas named at `now`.
    /// At most [`MAX_PENDING`] are kept, as in the other pending maps (through [`merge`]: a
    /// map insert of its own cost 800 B of wasm); the quiet ones go at the next batch.
    fn touch(&mut self, key: &[u8], limit: Limit, now: Nanos) {
        merge(&mut self.recent, key, limit, 0);
        if let Some(r) = self.recent.get_mut(key) {
            r.1 = Recent(r.1).touched(now).0;
        }
    }

    /// Adds a 0-unit delta (a renewal: the store answers it with a fresh grant) for each
    /// recent counter whose grant would lapse before the answer to the batch after the next
    /// one comes (two intervals and a round trip), so that its next request finds a grant
    /// rather than waiting for an ask. Counters quiet for [`RENEW_FOR`] are forgotten.
    fn renew(&mut self, now: Nanos, interval: Nanos, rtt: Nanos) {
        let horizon = now.saturating_add(interval.saturating_mul(2)).saturating_add(rtt);
        let unsent = &mut self.unsent;
        self.recent.retain(|k, (limit, r)| {
            let (r, keep) = (Recent(*r), Recent(*r).recent(now));
            if keep && unsent.len() < MAX_BATCH && (1..=horizon).contains(&r.lease_end()) {
                add(unsent, k, *limit, 0, 0);
            }
            keep
        });
    }
}

/// A store's plain-text reason, for a log line: printable ASCII, at most 300 bytes.
fn quoted(body: &[u8]) -> String {
    body.iter().take(300).map(|b| if b.is_ascii_graphic() || *b == b' ' { char::from(*b) } else { '?' }).collect()
}

/// The shared-data keys of one store's sync on this proxy: documents that sync to the same
/// store (cluster, path and secret) share one lease, view and outboxes, so one VM syncs for
/// them all; documents syncing elsewhere (NGINX's `proxy_wasm` directives, filters sharing a
/// `vm_id`) keep theirs apart.
#[derive(Clone, Debug)]
struct Keys {
    lease: String,
    view: String,
    /// The longest `timeout` of the documents sharing the sync, while one says it (see
    /// [`Syncer::share_timeout`]).
    timeout: String,
    /// Outboxes with each delta's window (see [`encode_outbox`]).
    out: String,
    /// Outboxes without, as VMs of earlier versions publish them (drained all the same).
    out_plain: String,
}

/// The prefix of the shared keys of one store's sync on this proxy ([`Keys`]).
pub(crate) fn namespace(opts: &SyncOptions) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = KeyHasher.build_hasher();
    for part in [&opts.cluster, &opts.path, &opts.secret] {
        h.write(part.as_bytes());
        h.write_u8(0);
    }
    // 32 bits of a keyed hash of the secret among the rest: the key names no secret.
    format!("rw1/sync/{:08x}", h.finish() as u32)
}

impl Keys {
    fn of(opts: &SyncOptions) -> Keys {
        let ns = namespace(opts);
        Keys {
            lease: format!("{ns}/lease"),
            view: format!("{ns}/view"),
            timeout: format!("{ns}/timeout"),
            out: format!("{ns}/outw/"),
            out_plain: format!("{ns}/out/"),
        }
    }

    fn outbox(&self, i: u32) -> String {
        format!("{}{i}", self.out)
    }

    fn plain_outbox(&self, i: u32) -> String {
        format!("{}{i}", self.out_plain)
    }
}

/// What the node last heard from the store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct View {
    /// Local time of the last successful sync (0: never).
    pub ok_at: Nanos,
    /// Nodes the store reported.
    pub nodes: u32,
    /// The store's clock minus ours, ns.
    pub offset: i64,
    /// The last batch's round trip, ns.
    pub rtt: Nanos,
}

/// The length of [`View::encode`].
const VIEW_LEN: usize = 28;

impl View {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(VIEW_LEN);
        b.extend_from_slice(&self.ok_at.to_le_bytes());
        b.extend_from_slice(&self.nodes.to_le_bytes());
        b.extend_from_slice(&self.offset.to_le_bytes());
        b.extend_from_slice(&self.rtt.to_le_bytes());
        b
    }
    fn decode(b: &[u8]) -> Option<View> {
        Some(View {
            ok_at: u64::from_le_bytes(b.get(..8)?.try_into().ok()?),
            nodes: u32::from_le_bytes(b.get(8..12)?.try_into().ok()?),
            offset: i64::from_le_bytes(b.get(12..20)?.try_into().ok()?),
            // A view an older VM wrote (during an upgrade) has none.
            rtt: b.get(20..28).and_then(|r| r.try_into().ok()).map_or(0, u64::from_le_bytes),
        })
    }
}

/// Counters the store named out of quota in its last answer (`ratewall_core::sync::Out`):
/// (the key's FNV-1a hash, out until, whole ms of the store's clock). Kept after the view in
/// its shared value, so every VM reads them with it.
type Named = Vec<(u64, u64)>;

/// Whether the store's answer `g` leaves a counter of `limit` no room for `need` units until
/// its `reset_after`: a fixed window's with fewer left (until the window ends), a sliding
/// window's or log's with none (until one unit is free again, which is what the store answers
/// then).
fn spent(limit: &Limit, g: &ratewall_core::sync::Grant, need: u64) -> bool {
    match limit.algorithm() {
        ratewall_core::Algorithm::FixedWindow => g.remaining < need.max(1),
        ratewall_core::Algorithm::SlidingWindow | ratewall_core::Algorithm::SlidingLog => g.remaining == 0,
        _ => false,
    }
}

/// A counter's entry in [`Named`], from the grant of an answer made at the store's `now`:
/// its key's hash, and until when (ms of the store's clock) it is out: rounded up, as a
/// sliding window's unit comes back a nanosecond into a window and a client told the whole
/// second before it was refused again.
fn out_entry(g: &ratewall_core::sync::Grant, now: Nanos) -> (u64, u64) {
    (ratewall_core::key::fnv1a(&g.key), now.saturating_add(g.reset_after).div_ceil(MS))
}

/// How long a VM whose asks failed `failures` times in a row does not ask: 1 s, doubling up
/// to 32 s.
fn ask_backoff_len(failures: u32) -> Nanos {
    (1_000 * MS).saturating_mul(1 << failures.saturating_sub(1).min(5))
}

/// Two numbers as 16 bytes (little-endian), as the lease, the shared timeout and each counter
/// named out are kept in shared data.
fn pair_bytes((a, b): (u64, u64)) -> [u8; 16] {
    let mut out = [0; 16];
    out[..8].copy_from_slice(&a.to_le_bytes());
    out[8..].copy_from_slice(&b.to_le_bytes());
    out
}

/// The two numbers of [`pair_bytes`] at the start of `b`.
fn pair(b: &[u8]) -> Option<(u64, u64)> {
    Some((u64::from_le_bytes(b.get(..8)?.try_into().ok()?), u64::from_le_bytes(b.get(8..16)?.try_into().ok()?)))
}

fn encode_named(named: &[(u64, u64)], out: &mut Vec<u8>) {
    for entry in named {
        out.extend_from_slice(&pair_bytes(*entry));
    }
}

fn decode_named(b: &[u8]) -> Named {
    b.chunks_exact(16).filter_map(pair).take(ratewall_core::sync::MAX_OUT).collect()
}

/// A batch sent and not yet answered, or failed and waiting to be retried with the same seq.
#[derive(Clone, Debug)]
struct Batch {
    seq: u64,
    deltas: Vec<Delta>,
    body: Vec<u8>,
    /// Its top-offenders section, kept for the next batch should this one be given up.
    top: Option<TopSection>,
    /// When it was first sent (0: not yet): it is retried for [`GIVE_UP_AFTER`] at most.
    first_sent: Nanos,
}

/// A counter the node saw a request on lately, for renewing its grant before it lapses:
/// when a VM's deltas last named it (whole seconds, modulo 2^21: it is only compared within
/// [`RENEW_FOR`]) above, and below, in ms, when its grant's lease ends — 0 when not answered
/// yet, or when the store's last answer had no quota left, so a renewal would gain nothing;
/// and when that answer had quota left but granted the node nothing (other nodes' grants held
/// it), the time the batch was sent, so the next batch renews it: its next answer may find
/// room (and repay an overdraft the node spent), where waiting for the lease's end left the
/// node denying for up to [`ratewall_core::sync::MAX_LEASE`].
/// Packed in the pending maps' value so the recent set is one more of them: a map of its
/// own type cost ~2 KB more of wasm (the filter's size budget had 1.6 KB left).
#[derive(Clone, Copy, Debug)]
struct Recent(u64);

const LEASE_BITS: u32 = 43;

impl Recent {
    /// The same lease, touched at `now`.
    fn touched(self, now: Nanos) -> Recent {
        Recent(((now / 1_000_000_000) << LEASE_BITS) | (self.0 & ((1 << LEASE_BITS) - 1)))
    }
    /// Whether it was touched within [`RENEW_FOR`] of `now`.
    fn recent(self, now: Nanos) -> bool {
        let secs = (now / 1_000_000_000).wrapping_sub(self.0 >> LEASE_BITS) & ((1 << (64 - LEASE_BITS)) - 1);
        secs <= RENEW_FOR / 1_000_000_000
    }
    fn lease_end(self) -> Nanos {
        (self.0 & ((1 << LEASE_BITS) - 1)).saturating_mul(MS)
    }
    /// The same touch, with a lease ending at `end`.
    fn leased(self, end: Nanos) -> Recent {
        Recent((self.0 & !((1 << LEASE_BITS) - 1)) | ((end / MS) & ((1 << LEASE_BITS) - 1)))
    }
}

impl Syncing {
    /// How long the breaker stays open after the failures so far: its backoff, at most
    /// [`REFUSED_RETRY`] while the store refuses the node's batches for their time (the store
    /// answers: it is the node's clock that is off, and it may be put right meanwhile — the
    /// breaker's 32 s had held sync that long after).
    fn backoff(&self) -> Nanos {
        let backoff = breaker_backoff(self.failures);
        if self.refused {
            backoff.min(REFUSED_RETRY)
        } else {
            backoff
        }
    }
}

#[derive(Debug, Default)]
struct Syncing {
    seq: u64,
    unsent: Units,
    /// (call token, batch, sent at).
    inflight: Option<(u32, Batch, Nanos)>,
    retry: Option<Batch>,
    /// The top-offenders sections of batches given up, for the next new batch: who was
    /// limited while the store was out of reach for longer than a batch is retried is not
    /// lost from its view (a Redis down for 25 s or more had its first seconds' denials
    /// missing for good).
    given_up: Option<TopSection>,
    failures: u32,
    open_until: Nanos,
    /// Whether the last failure was the store refusing a batch for its time: the breaker
    /// then waits at most [`REFUSED_RETRY`].
    refused: bool,
    /// When the last batch was sent.
    sent_at: Nanos,
    /// Whether the last answer left every counter far from its limit (each grant leased for
    /// at least [`RELAXED_LEASE`]).
    relaxed: bool,
    /// Whether a VM admitted a request past its grant since the last batch (see
    /// [`Syncer::overdrawn`]): the next batch goes at once, relaxed or not.
    urgent: bool,
    /// Counters with recent requests, whose grants the next batch renews before they lapse
    /// (the value: [`Recent`]).
    recent: Pending,
    /// Counters a store answered as not applied (their stored value unreadable to it), with
    /// when it first did: their units go out again for [`GIVE_UP_AFTER`], as a failed batch's.
    unapplied: Pending,
}

/// Why a VM does not ask the store now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AskRefused {
    /// The store is failing (its breaker is open, this VM's asks failed lately, or it answers
    /// slower than `max_wait`), or the call could not be made: the request is decided as the
    /// store's failure policy says.
    Failing,
    /// As many asks are in flight as a VM allows: the request is decided on what the node
    /// holds.
    Busy,
}

/// An ask's deadline at least, where only its own answer can resume its request.
pub const ASK_DEADLINE_UNRESUMED: Nanos = 1_000_000_000;

/// Metric ids.
#[derive(Clone, Copy, Debug, Default)]
struct Metrics {
    ok: Option<u32>,
    failed: Option<u32>,
    degraded: Option<u32>,
    dropped: Option<u32>,
    staleness_ms: Option<u32>,
    pending: Option<u32>,
    breaker_open: Option<u32>,
    asks: Option<u32>,
    asks_granted: Option<u32>,
    refused_stale: Option<u32>,
    unapplied: Option<u32>,
}

/// What ends a new batch: given the node's id, the batch's deltas and the section of batches
/// given up since the last one was made (to fold in), its top-offenders section.
/// The last argument: the counters (`fnv1a` of their keys) this VM's answers found at their
/// limit fleet-wide in the last minute, sorted.
pub type Section<'a> = dyn Fn(u64, &[Delta], Option<&TopSection>, &[u64]) -> Option<TopSection> + 'a;

/// One VM's syncer.
#[derive(Debug)]
pub struct Syncer {
    opts: SyncOptions,
    keys: Keys,
    /// The deadline batches go with: the longest `timeout` of the documents that share this
    /// sync (as of this VM's last tick), never under this document's.
    batch_timeout: Cell<Nanos>,
    vm: u32,
    token: u64,
    started: Nanos,
    local: RefCell<Units>,
    syncing: RefCell<Syncing>,
    view: Cell<View>,
    /// Counters the store named out in its last answer.
    named: RefCell<Named>,
    metrics: Metrics,
    /// Asks in flight, and the number of the last one sent.
    asks: Cell<(u32, u64)>,
    /// Asks that failed in a row (timed out past `max_wait`, or refused by the host), and
    /// until when this VM does not ask.
    ask_backoff: Cell<(u32, Nanos)>,
    /// Whether the last ask counted as failed did so while batches were failing too (none
    /// answered for two intervals): the store was out of reach, and a batch answered since
    /// ends the backoff. Asks that time out while batches are answered (a store slow on
    /// asks alone) back off as they fail.
    ask_outage: Cell<bool>,
    /// Whether this VM has logged that the store refuses its requests for their time (once,
    /// until a batch succeeds again).
    refusal_logged: Cell<bool>,
    /// When a failed ask was last said (at most once a minute): under NGINX the metrics are
    /// not to be read, and a worker whose asks fail decides on the proxy's share meanwhile.
    ask_failure_said: Cell<Option<Nanos>>,
    /// When this VM last logged that a store could not apply counters of its batches (0:
    /// never; once a minute at most).
    unapplied_logged: Cell<Nanos>,
    /// Whether this VM admitted a request past its grant since it last published.
    overdrawn: Cell<bool>,
    /// Whether this VM has published on a request's path since its last tick (once per tick
    /// at most: each publish rewrites its whole outbox).
    handed: Cell<bool>,
    /// Counters (`fnv1a` of their keys) this VM's answers found at their limit fleet-wide,
    /// and when: a batch's top section then carries what the node admitted on them though it
    /// denied none (another node may have).
    limited: RefCell<Lately>,
}

/// Adds `units` admitted in `window` to `key`'s: a later window's replace an earlier one's,
/// which count in none, and an earlier window's count in none (a 0-unit renewal, of window
/// 0, changes nothing). False when the map is full.
fn add(into: &mut Units, key: &[u8], limit: Limit, units: u64, window: u64) -> bool {
    if let Some(e) = into.get_mut(key) {
        e.0 = limit;
        if window > e.2 {
            (e.1, e.2) = (units, window);
        } else if window == e.2 || units == 0 {
            e.1 = e.1.saturating_add(units);
        }
        return true;
    }
    if into.len() >= MAX_PENDING {
        return false;
    }
    into.insert(key.to_vec(), (limit, units, window));
    true
}

/// An outbox: its deltas as a batch's encoding (node, seq and time 0), then each delta's
/// window, in order, then a 1 when a VM admitted a request in it past its grant (nothing
/// otherwise, so that an outbox without the flag reads as one with it unset).
fn encode_outbox(units: Units, overdrawn: bool) -> Vec<u8> {
    let (deltas, windows): (Vec<Delta>, Vec<u64>) =
        units.into_iter().map(|(key, (limit, units, window))| (Delta { key, limit, units }, window)).unzip();
    let mut out = SyncRequest::encode_parts(0, 0, 0, &deltas, false);
    for window in windows {
        put_varint(&mut out, window);
    }
    if overdrawn {
        put_varint(&mut out, 1);
    }
    out
}

/// Reads [`encode_outbox`] into `into`; `plain` (an outbox of an earlier version, without
/// windows): each delta's window is the current one at `store_now`. Whether a VM admitted
/// past its grant. `None` when it cannot be read.
fn read_outbox(bytes: &[u8], plain: bool, store_now: Nanos, into: &mut Units) -> Option<bool> {
    let (req, end) = SyncRequest::decode_prefix(bytes).ok()?;
    let mut windows = Reader { bytes, pos: end };
    for d in req.deltas {
        let window = if plain { window_of(&d.limit, store_now) } else { windows.varint().ok()? };
        // Units that do not fit are dropped (counted when the VM published them).
        add(into, &d.key, d.limit, d.units, window);
    }
    Some(!plain && windows.varint().is_ok_and(|f| f == 1))
}

fn merge(into: &mut Pending, key: &[u8], limit: Limit, units: u64) -> bool {
    if let Some(e) = into.get_mut(key) {
        e.0 = limit;
        e.1 = e.1.saturating_add(units);
        return true;
    }
    if into.len() >= MAX_PENDING {
        return false;
    }
    into.insert(key.to_vec(), (limit, units));
    true
}

impl Syncer {
    /// Joins the node's sync: takes a VM number and creates the shared keys it needs.
    pub fn new(host: &dyn Host, opts: SyncOptions) -> Syncer {
        let now = host.now();
        let mut vm = 0;
        for _ in 0..32 {
            let (value, cas) = host.shared_get(VMS).unwrap_or((None, None));
            vm = value.and_then(|v| Some(u32::from_le_bytes(v.get(..4)?.try_into().ok()?))).unwrap_or(0);
            if host.shared_set(VMS, &(vm.wrapping_add(1)).to_le_bytes(), cas).is_ok() {
                break;
            }
        }
        let keys = Keys::of(&opts);
        for i in 0..OUTBOXES {
            if let Ok((None, _)) = host.shared_get(&keys.outbox(i)) {
                let _ = host.shared_set(&keys.outbox(i), &[], None);
            }
        }
        let counter = |n: &str| host.define_counter(n);
        let gauge = |n: &str| host.define_gauge(n);
        let metrics = Metrics {
            ok: counter("ratewall_sync_ok"),
            failed: counter("ratewall_sync_failed"),
            degraded: counter("ratewall_sync_degraded_requests"),
            dropped: counter("ratewall_sync_dropped_units"),
            staleness_ms: gauge("ratewall_sync_staleness_ms"),
            pending: gauge("ratewall_sync_pending_counters"),
            breaker_open: gauge("ratewall_sync_breaker_open"),
            asks: counter("ratewall_sync_asks"),
            asks_granted: counter("ratewall_sync_asks_granted"),
            refused_stale: counter("ratewall_sync_refused_stale"),
            unapplied: counter("ratewall_sync_unapplied_counters"),
        };
        // The node id on the wire and the lease token: unique per VM incarnation — the proxy's
        // node id (Envoy's --service-node), this VM's number and its start time, hashed.
        let token = {
            use std::hash::Hasher;
            let mut h = siphasher::sip::SipHasher13::new_with_keys(0x7261_7465_7761_6c6c, u64::from(vm));
            // ngx_wasm_module (whose upstreams are `host:port`) has no `node.id`, and asking
            // for it outside a request logs an error there.
            let id = if opts.cluster.contains(':') { None } else { host.property(&["node", "id"]) };
            h.write(&id.unwrap_or_default());
            h.write_u64(now);
            h.write_u32(vm);
            h.finish()
        };
        Syncer {
            batch_timeout: Cell::new(opts.timeout),
            opts,
            keys,
            vm,
            token,
            started: now,
            local: RefCell::default(),
            syncing: RefCell::default(),
            view: Cell::new(View::default()),
            named: RefCell::default(),
            metrics,
            asks: Cell::new((0, 0)),
            ask_backoff: Cell::new((0, 0)),
            ask_outage: Cell::new(false),
            refusal_logged: Cell::new(false),
            ask_failure_said: Cell::new(None),
            unapplied_logged: Cell::new(0),
            overdrawn: Cell::new(false),
            handed: Cell::new(false),
            limited: RefCell::new(Lately::new(LIMITED_FOR, LIMITED_KEPT)),
        }
    }

    /// The syncer of a VM whose rules were pushed again (Envoy ECDS / xDS): the same node
    /// identity (a new one would count as an extra node at the store until it expired, and
    /// shrink every node's share), VM number, lease, pending deltas, batch in flight and view,
    /// under the new options. `previous` is left empty; deltas that requests still holding the
    /// old rules record into it afterwards are lost (at most the requests in flight).
    pub fn continuing(previous: &Syncer, opts: SyncOptions) -> Syncer {
        let take_local = previous.local.try_borrow_mut().map(|mut l| std::mem::take(&mut *l));
        let take_syncing = previous.syncing.try_borrow_mut().map(|mut s| std::mem::take(&mut *s));
        Syncer {
            keys: Keys::of(&opts),
            batch_timeout: Cell::new(opts.timeout),
            opts,
            vm: previous.vm,
            token: previous.token,
            started: previous.started,
            local: RefCell::new(take_local.unwrap_or_default()),
            syncing: RefCell::new(take_syncing.unwrap_or_default()),
            view: Cell::new(previous.view.get()),
            named: RefCell::new(previous.named.borrow().clone()),
            metrics: previous.metrics,
            asks: Cell::new(previous.asks.get()),
            ask_backoff: Cell::new(previous.ask_backoff.get()),
            ask_outage: Cell::new(previous.ask_outage.get()),
            refusal_logged: Cell::new(previous.refusal_logged.get()),
            ask_failure_said: Cell::new(previous.ask_failure_said.get()),
            unapplied_logged: Cell::new(previous.unapplied_logged.get()),
            overdrawn: Cell::new(previous.overdrawn.take()),
            handed: Cell::new(previous.handed.get()),
            limited: RefCell::new(previous.limited.borrow().clone()),
        }
    }

    /// The options in force.
    pub fn options(&self) -> &SyncOptions {
        &self.opts
    }

    /// The view as of this VM's last tick.
    pub fn view(&self) -> View {
        self.view.get()
    }

    /// The hashes (FNV-1a) of the counters the store's last answer named out of quota that
    /// are still out at `store_now` (the store's clock).
    pub fn named_out(&self, store_now: Nanos) -> Vec<u64> {
        self.named.borrow().iter().filter(|(_, until)| store_now / MS < *until).map(|(h, _)| *h).collect()
    }

    /// How long after a counter's unit came back at the store an answer about the counter
    /// would have come if any VM had been denying on it: its denial's 0-unit delta goes with
    /// a tick (up to two intervals, through the outbox), then its round trip; three intervals
    /// and two round trips, for a tick's jitter.
    pub fn lag(&self) -> Nanos {
        self.opts.interval.saturating_mul(3).saturating_add(self.view.get().rtt.saturating_mul(2))
    }

    /// The hashes of the counters the store named out whose unit came back at least
    /// [`Syncer::lag`] before `store_now` with no answer naming them since, each with how long
    /// past that lag `store_now` is: the node was quiet on them (a node still denying on one
    /// has it named again, or given a grant, by each answer). A request there may take that
    /// unit on an overdraft of one (see `TableCounters`), as a client that waited its
    /// `Retry-After` does.
    pub fn came_back(&self, store_now: Nanos) -> Vec<(u64, Nanos)> {
        let lag = self.lag();
        let named = self.named.borrow();
        named
            .iter()
            .filter_map(|(h, u)| Some((*h, store_now.checked_sub(u.saturating_mul(MS).saturating_add(lag))?)))
            .filter(|(_, since)| *since < BACK_KEPT)
            .collect()
    }

    /// Until when (the store's clock) the store's last answer named the counter of `hash` out
    /// of quota, if it is still out at `store_now`.
    pub fn out_until(&self, hash: u64, store_now: Nanos) -> Option<Nanos> {
        let named = self.named.borrow();
        let until = named.iter().find(|(h, _)| *h == hash)?.1.saturating_mul(MS);
        (store_now < until).then_some(until)
    }

    /// The store's clock, from ours.
    pub fn store_now(&self, local: Nanos) -> Nanos {
        local.saturating_add_signed(self.view.get().offset)
    }

    /// Nodes to divide limits by: what the store last said, else the configured count.
    pub fn nodes(&self) -> u32 {
        let v = self.view.get();
        if v.ok_at > 0 && v.nodes > 0 { v.nodes } else { self.opts.nodes }.max(1)
    }

    /// Whether the global data is fresh enough to admit on grants at `now`. Before the first
    /// answer the node admits on initial shares for `stale_after`.
    pub fn fresh(&self, now: Nanos) -> bool {
        let v = self.view.get();
        let since = if v.ok_at > 0 { v.ok_at } else { self.started };
        // An answer further ahead than `stale_after` is from a clock that stepped back: not
        // fresh (degraded until the next answer, an interval away), rather than fresh until
        // the clock catches up with it.
        now <= since.saturating_add(self.opts.stale_after) && since <= now.saturating_add(self.opts.stale_after)
    }

    /// Counts a request decided in degraded mode.
    pub fn degraded(&self, host: &dyn Host) {
        if let Some(m) = self.metrics.degraded {
            host.increment(m, 1);
        }
    }

    /// Records units this VM admitted on a counter.
    pub fn record(&self, host: &dyn Host, key: &[u8], limit: Limit, units: u64) {
        // The node's view of the store's clock is within half a round trip of it (the call's
        // legs may differ): units admitted within that of a fixed window's start may be of
        // the window before, and are taken to be (reported in none, as units that reach the
        // store after their window ended). Taken for the new window's, one that was not took
        // a unit of its quota, and where the window ran out, every request after was refused
        // with that unit free (`zipf20_rtt20` at one seed: 106 false denials).
        let window = window_of(&limit, self.store_now(host.now()).saturating_sub(self.view.get().rtt / 2));
        if !add(&mut self.local.borrow_mut(), key, limit, units, window) {
            if let Some(m) = self.metrics.dropped {
                host.increment(m, units);
            }
        }
    }

    /// Notes that this VM admitted a request past its grant (on its overdraft): the node's
    /// next batch goes at the next tick even while every counter is far from its limit, so
    /// that its answer brings a grant before more requests come (a node new to a counter past
    /// a fixed window's first quarter, or whose grant lapsed, has an overdraft of one unit;
    /// waiting an interval more for the answer, its next requests were denied with most of
    /// the quota left). The VM hands its units over at once the first time between two of its
    /// ticks; later ones go with its tick (where every request is a counter's first, past a
    /// fixed window's first quarter, each would otherwise rewrite the outbox).
    pub fn overdrawn(&self, host: &dyn Host) {
        self.overdrawn.set(true);
        if !self.handed.replace(true) {
            self.publish(host);
        }
    }

    /// Every VM, every interval: publish deltas, read the view; the lease holder syncs. A new
    /// batch ends with what `section` appends for its node and deltas (the optional
    /// top-offenders section).
    pub fn on_tick(&self, host: &dyn Host, section: &Section<'_>) {
        let now = host.now();
        self.handed.set(false);
        self.publish(host);
        self.share_timeout(host, now);
        self.read_view(host);
        let v = self.view.get();
        if let Some(m) = self.metrics.staleness_ms {
            let since = if v.ok_at > 0 { v.ok_at } else { self.started };
            host.set_gauge(m, now.saturating_sub(since) / MS);
        }
        if self.hold_lease(host, now) {
            self.drive(host, now, section);
        }
    }

    /// Says this document's `timeout` to the others that share its sync, when it is the
    /// longest, and takes the longest said within the last 3 intervals as its batches'
    /// deadline: whichever VM holds the lease, a document whose store is far gets the deadline
    /// it set. (Two `proxy_wasm` documents on one store, one with a `timeout` of 2 s, the store
    /// 0.4 s away, the other with the default 50 ms: while the second's VM held the lease, every
    /// batch failed, and the first's `closed` rule answered 503 to every request.)
    fn share_timeout(&self, host: &dyn Host, now: Nanos) {
        let mine = self.opts.timeout;
        let Ok((value, cas)) = host.shared_get(&self.keys.timeout) else { return };
        let longest = match value.as_deref().and_then(pair) {
            Some((timeout, until)) if until > now && timeout > mine => timeout,
            _ => {
                let _ = host.shared_set(&self.keys.timeout, &pair_bytes((mine, self.held_until(now))), cas);
                mine
            }
        };
        self.batch_timeout.set(longest);
    }

    /// Reads the view the syncing VM last wrote, and the counters named out with it.
    pub fn read_view(&self, host: &dyn Host) {
        if let Ok((Some(v), _)) = host.shared_get(&self.keys.view) {
            if let Some(view) = View::decode(&v) {
                self.view.set(view);
                *self.named.borrow_mut() = decode_named(v.get(VIEW_LEN..).unwrap_or_default());
            }
        }
    }

    fn publish(&self, host: &dyn Host) {
        let local = std::mem::take(&mut *self.local.borrow_mut());
        let overdrawn = self.overdrawn.take();
        if local.is_empty() && !overdrawn {
            return;
        }
        let key = self.keys.outbox(self.vm % OUTBOXES);
        let store_now = self.store_now(host.now());
        for _ in 0..32 {
            let Ok((value, cas)) = host.shared_get(&key) else { break };
            let mut merged = Units::default();
            let mut flagged = overdrawn;
            if let Some(v) = value.as_deref().filter(|v| !v.is_empty()) {
                flagged |= read_outbox(v, false, store_now, &mut merged).unwrap_or(false);
            }
            let mut dropped = 0;
            for (k, (l, u, w)) in &local {
                if !add(&mut merged, k, *l, *u, *w) {
                    dropped += u;
                }
            }
            let body = encode_outbox(merged, flagged);
            match host.shared_set(&key, &body, cas) {
                Ok(()) => {
                    if let (Some(m), true) = (self.metrics.dropped, dropped > 0) {
                        host.increment(m, dropped);
                    }
                    return;
                }
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Other) => break,
            }
        }
        // Could not publish now: keep the deltas for the next tick.
        self.overdrawn.set(self.overdrawn.get() || overdrawn);
        let mut mine = self.local.borrow_mut();
        for (k, (l, u, w)) in local {
            add(&mut mine, &k, l, u, w);
        }
    }

    /// The lease's holder and expiry, and its CAS value.
    fn lease(&self, host: &dyn Host) -> Option<((u64, Nanos), Option<u32>)> {
        let (value, cas) = host.shared_get(&self.keys.lease).ok()?;
        Some((value.as_deref().and_then(pair).unwrap_or((0, 0)), cas))
    }

    /// Until when what this VM says in shared data now holds (its lease, its timeout): 3
    /// intervals, so that two of its ticks can be late.
    fn held_until(&self, now: Nanos) -> Nanos {
        now.saturating_add(self.opts.interval.saturating_mul(3))
    }

    fn hold_lease(&self, host: &dyn Host, now: Nanos) -> bool {
        let Some(((holder, expires), cas)) = self.lease(host) else { return false };
        if holder != self.token && expires > now {
            return false;
        }
        host.shared_set(&self.keys.lease, &pair_bytes((self.token, self.held_until(now))), cas).is_ok()
    }

    fn drive(&self, host: &dyn Host, now: Nanos, section: &Section<'_>) {
        let mut s = self.syncing.borrow_mut();
        let store_now = self.store_now(now);
        // Drain the outboxes (and those of VMs of an earlier version).
        for (i, plain) in (0..OUTBOXES).flat_map(|i| [(i, false), (i, true)]) {
            let key = if plain { self.keys.plain_outbox(i) } else { self.keys.outbox(i) };
            let Ok((Some(value), cas)) = host.shared_get(&key) else { continue };
            if value.is_empty() {
                continue;
            }
            if host.shared_set(&key, &[], cas).is_err() {
                continue; // a VM is publishing: next tick
            }
            let mut drained = Units::default();
            s.urgent |= read_outbox(&value, plain, store_now, &mut drained).unwrap_or(false);
            for (k, (limit, units, window)) in drained {
                s.touch(&k, limit, now);
                if !add(&mut s.unsent, &k, limit, units, window) {
                    if let Some(m) = self.metrics.dropped {
                        host.increment(m, units);
                    }
                }
            }
        }
        if let Some(m) = self.metrics.pending {
            host.set_gauge(m, s.unsent.len() as u64);
        }
        if let Some((_, _, sent)) = &s.inflight {
            // The host answers every call by its timeout; this only guards against one lost.
            if now.saturating_sub(*sent) <= self.batch_timeout.get().saturating_mul(4).max(self.opts.interval) {
                return;
            }
            if let Some((_, batch, _)) = s.inflight.take() {
                drop(s);
                self.failed(host, batch, now, "no answer");
                s = self.syncing.borrow_mut();
            }
        }
        // Times ahead of what they can be are from a clock that stepped back: clamped, so the
        // breaker and the batches run on rather than wait for the clock to catch up (the
        // breaker for no longer than its backoff now: a clock put back a minute had kept it
        // open 30 s after the store answered again).
        s.open_until = s.open_until.min(now.saturating_add(s.backoff()));
        s.sent_at = s.sent_at.min(now);
        if now < s.open_until {
            return;
        }
        s.renew(now, self.opts.interval, self.view.get().rtt);
        // When the next batch is due, so that store calls stay under 10 per node per second
        // when asks add to them:
        // - with nothing to report, a batch is only a heartbeat that keeps the view fresh: one
        //   every third of `stale_after` (two can fail before the view goes stale);
        // - while every counter is far from its limit, deltas wait for every other tick (half
        //   an interval's margin for a host's tick jitter): the grants they were spent from
        //   stay on lease far longer, so the store counts them as held meanwhile;
        // - otherwise, for a denied counter (0 units) that wants its fresh grant, and after a
        //   request admitted past its grant ([`Syncer::overdrawn`]), at once.
        let interval = self.opts.interval;
        let due = if s.unsent.is_empty() {
            (self.opts.stale_after / 3).max(interval)
        } else if s.relaxed && !s.urgent && s.unsent.values().all(|(_, units, _)| *units > 0) {
            interval.saturating_add(interval / 2)
        } else {
            0
        };
        if s.retry.is_none() && now < s.sent_at.saturating_add(due) {
            return;
        }
        // A batch failing for as long as a store accepts its time is given up: the store
        // would refuse it from then on (and it remembers the seq no longer than that allows).
        // So is one made that much ahead of the clock now (a clock put back): its time, which
        // its retries repeat, is one no store accepts.
        let unacceptable = |b: &Batch| {
            now.saturating_sub(b.first_sent) > GIVE_UP_AFTER || b.first_sent > now.saturating_add(GIVE_UP_AFTER)
        };
        if let Some(old) = s.retry.take_if(|b| b.first_sent > 0 && unacceptable(b)) {
            if let Some(top) = &old.top {
                match s.given_up.as_mut() {
                    Some(given_up) => given_up.absorb(top, (usize::MAX, None)),
                    None => s.given_up = Some(top.clone()),
                }
            }
            let units = old.deltas.iter().map(|d| d.units).fold(0, u64::saturating_add);
            if let Some(m) = self.metrics.dropped {
                host.increment(m, units);
            }
            // A batch of renewals and heartbeats only loses nothing: not worth a warning.
            if units > 0 {
                host.log(
                    Level::Warn,
                    &format!(
                        "ratewall: a sync batch {} and was dropped ({units} admitted units the store may not have counted)",
                        if old.first_sent > now { "made 25 s ahead of the clock now (a clock put back)" } else { "failed for 25 s" }
                    ),
                );
            }
        }
        let batch = match s.retry.take() {
            Some(b) => b,
            None => {
                let keys: Vec<Vec<u8>> = s.unsent.keys().take(MAX_BATCH).cloned().collect();
                // A fixed window's units that would reach the store after their window ended
                // (the batch's answer half a round trip away) count in none: the delta goes
                // without them, as a renewal.
                let arrives = store_now.saturating_add(self.view.get().rtt / 2);
                let deltas: Vec<Delta> = keys
                    .into_iter()
                    .filter_map(|k| {
                        let (limit, units, window) = s.unsent.remove(&k)?;
                        let units = if window < window_of(&limit, arrives) { 0 } else { units };
                        Some(Delta { key: k, limit, units })
                    })
                    .collect();
                s.seq += 1;
                s.urgent = false;
                // Made now: its retries repeat this time, so a store accepts them for as long
                // as it would accept a replay it still recognizes.
                let mut body = SyncRequest::encode_parts(self.token, s.seq, now, &deltas, false);
                let given_up = s.given_up.take();
                let top = section(self.token, &deltas, given_up.as_ref(), &self.limited.borrow().held(now));
                if let Some(top) = &top {
                    top.encode_into(&mut body);
                }
                Batch { seq: s.seq, deltas, body, top, first_sent: 0 }
            }
        };
        let batch = Batch { first_sent: if batch.first_sent == 0 { now } else { batch.first_sent }, ..batch };
        match self.send(host, &batch.body, self.batch_timeout.get()) {
            Some(token) => {
                s.inflight = Some((token, batch, now));
                s.sent_at = now;
            }
            None => {
                drop(s);
                self.failed(host, batch, now, "dispatch refused");
            }
        }
    }

    /// Signs and sends a message to the store, with a deadline; the call's token.
    fn send(&self, host: &dyn Host, body: &[u8], timeout: Nanos) -> Option<u32> {
        let tag = hex(&sign(self.opts.secret.as_bytes(), body));
        let headers = [
            (":method", "POST"),
            (":path", self.opts.path.as_str()),
            (":authority", self.opts.authority.as_str()),
            ("content-type", "application/octet-stream"),
            ("x-ratewall-signature", tag.as_str()),
        ];
        host.dispatch(&self.opts.cluster, &headers, body, timeout)
    }

    /// Asks the store for units a paused request needs now (its grants being spent); the
    /// call's token. The request waits for the answer at most `max_wait`. `None` — too many
    /// asks in flight, the breaker open, this VM's asks failing (see
    /// [`Syncer::on_ask_response`]; and while the last batch's round trip is longer than
    /// `max_wait`, until one succeeds), or the call refused — means the request is decided on
    /// what the node holds.
    pub fn ask(&self, host: &dyn Host, wants: &[Delta]) -> Result<u32, AskRefused> {
        let (inflight, seq) = self.asks.get();
        let max_wait = self.opts.max_wait.min(self.opts.timeout);
        // Asks that failed while the store was out of reach, and a batch answered within
        // `max_wait` since: the store is in reach again, and the asks with it (after an
        // outage, the asks' backoff, up to 32 s, had outlasted it).
        let (failures, until) = self.ask_backoff.get();
        let view = self.view.get();
        let back = view.ok_at > until.saturating_sub(ask_backoff_len(failures)) && view.rtt <= max_wait;
        if failures > 0 && self.ask_outage.get() && back {
            self.ask_backoff.set((0, 0));
        }
        if host.now() < self.syncing.try_borrow().map_or(0, |s| s.open_until)
            || waiting(self.ask_backoff.get().1, host.now(), ASK_BACKOFF_MAX)
            || (self.view.get().rtt > max_wait && self.ask_backoff.get().0 > 0)
        {
            return Err(AskRefused::Failing);
        }
        if inflight >= MAX_ASKS {
            return Err(AskRefused::Busy);
        }
        // Asks are numbered per node id: VM number above, this VM's count below.
        let seq = seq.wrapping_add(1).max(1) & ((1 << 40) - 1);
        let number = (u64::from(self.vm) << 40) | seq;
        // The node asks under the id its batches carry (the lease holder's): the store then
        // replaces the units it gives with the grant of the node's next batch.
        let node = self.lease(host).map_or(0, |((holder, _), _)| holder);
        let node = if node == 0 { self.token } else { node };
        let body = SyncRequest::encode_parts(node, number, host.now(), wants, true);
        // Where a paused request can be resumed only by the answer to its own call
        // (ngx_wasm_module), the call's deadline is the wait: and a call that times out there
        // ends its request with no response at all, so it is given a second at least.
        let deadline = if host.resumes_waiters() { max_wait } else { max_wait.max(ASK_DEADLINE_UNRESUMED) };
        let token = self.send(host, &body, deadline).ok_or(AskRefused::Failing)?;
        self.asks.set((inflight + 1, seq));
        if let Some(m) = self.metrics.asks {
            host.increment(m, 1);
        }
        Ok(token)
    }

    /// An ask is no longer in flight.
    pub fn ask_done(&self) {
        let (inflight, seq) = self.asks.get();
        self.asks.set((inflight.saturating_sub(1), seq));
    }

    /// The answer to an ask: the units given are added to the counters' grants. A counter
    /// the store refused is not asked for again until the next sync answers. Returns, per
    /// counter asked for, whether the store took the units the request needs (they are
    /// counted there already, and must not be reported again).
    pub fn on_ask_response(
        &self,
        host: &dyn Host,
        table: &Table,
        ask: (&[Delta], Nanos),
        answer: (u32, Option<&[u8]>, &[u8]),
    ) -> Vec<bool> {
        let ((wants, asked_at), (status, tag, body)) = (ask, answer);
        self.ask_done();
        // A failed ask (most often one the store could not answer within `max_wait`: it is
        // further than that) stops this VM asking for 1 s, doubling while they keep failing
        // (at most 32 s): requests are decided at once rather than wait for nothing, and the
        // store is not left holding units for answers nobody reads.
        let (failures, until) = self.ask_backoff.get();
        // Counted; said by the VM that syncs, whose batches the store refuses alike (each VM
        // that asked said it too: a line per VM for one clock).
        if let Some(m) = self.metrics.refused_stale.filter(|_| status == REFUSED_FOR_TIME) {
            host.increment(m, 1);
        }
        // An ask refused for its time would be refused again: it backs off as one that failed.
        if status == 0 || status == REFUSED_FOR_TIME {
            // Asks that were on their way together fail together (a store that stalls a
            // moment times out every ask in flight): one that was sent before the backoff in
            // force began is the same failure, not one more. Counted one by one, 12 asks
            // failing in one stall of 1 s kept a worker from asking for 30 s after it.
            let began = until.saturating_sub(ask_backoff_len(failures));
            if failures == 0 || asked_at >= began {
                let failures = failures.saturating_add(1);
                self.ask_backoff.set((failures, host.now().saturating_add(ask_backoff_len(failures))));
                let silent = host.now().saturating_sub(self.view.get().ok_at);
                self.ask_outage.set(silent > self.opts.interval.saturating_mul(2));
            }
        } else {
            self.ask_backoff.set((0, 0));
        }
        if status != 200 && crate::engine::due(&self.ask_failure_said, host.now(), 60 * ratewall_core::SECOND) {
            let why = if status == 0 { "no answer within its deadline".to_owned() } else { format!("status {status}") };
            host.log(
                Level::Warn,
                &format!(
                    "ratewall: an ask to {} failed ({why}); its request was decided as with the store out of \
                     reach (said at most once a minute)",
                    self.opts.cluster
                ),
            );
        }
        let verified = tag.and_then(unhex).is_some_and(|t| verify(self.opts.secret.as_bytes(), body, &t));
        let now = host.now();
        let Some(resp) = (status == 200 && verified)
            .then(|| SyncResponse::decode(body).ok())
            .flatten()
            .filter(|r| r.now.abs_diff(now) <= MAX_STORE_SKEW)
        else {
            return Vec::new();
        };
        let taken: Vec<bool> =
            wants.iter().zip(&resp.grants).map(|(d, g)| g.grant >= d.units && g.key == d.key).collect();
        let limited = write_grants(host, table, wants, &resp, asked_at, true);
        self.limited.borrow_mut().note(&limited, now);
        // A counter the ask was refused on is out until an ask of its units could be taken,
        // as the store's answer says (for a window, until a unit is free again), as a batch's
        // answer would name it: the request's denial (and this VM's next ones, until the view
        // names it) says that wait, not a spent grant's second, so a client that waits its
        // `Retry-After` is not refused again.
        let out = wants.iter().zip(&resp.grants).filter(|(d, g)| g.key == d.key && g.grant < d.units);
        {
            // The newest refusal is named whatever the list holds: where it is full, in place
            // of the counter that is free soonest (or was free first). Left out, its request
            // would say a spent grant's second and its client be refused again after it.
            let mut named = self.named.borrow_mut();
            for (_, g) in out {
                let (hash, until) = out_entry(g, resp.now);
                named.retain(|(h, _)| *h != hash);
                if named.len() >= ratewall_core::sync::MAX_OUT {
                    let soonest = named.iter().enumerate().min_by_key(|(_, (_, u))| *u).map(|(i, _)| i);
                    if let Some(i) = soonest {
                        named.swap_remove(i);
                    }
                }
                named.push((hash, until));
            }
        }
        if let (Some(m), true) = (self.metrics.asks_granted, !taken.is_empty() && taken.iter().all(|t| *t)) {
            host.increment(m, 1);
        }
        taken
    }

    fn failed(&self, host: &dyn Host, batch: Batch, now: Nanos, why: &str) {
        self.failed_as(host, batch, now, why, false);
    }

    /// A failed batch; `refused`: refused by the store for its time (the breaker then waits
    /// at most [`REFUSED_RETRY`]).
    fn failed_as(&self, host: &dyn Host, batch: Batch, now: Nanos, why: &str, refused: bool) {
        let mut s = self.syncing.borrow_mut();
        s.retry = Some(batch);
        s.refused = refused;
        s.failures = s.failures.saturating_add(1);
        if s.failures >= BREAKER_AFTER {
            s.open_until = now.saturating_add(s.backoff());
            if let Some(m) = self.metrics.breaker_open {
                host.set_gauge(m, 1);
            }
        }
        if let Some(m) = self.metrics.failed {
            host.increment(m, 1);
        }
        if (s.failures == 1 || s.failures == BREAKER_AFTER) && !why.is_empty() {
            host.log(Level::Warn, &format!("ratewall: sync to {} failed: {why}", self.opts.cluster));
        }
    }

    /// The store refused a request because its time is further than [`MAX_REQUEST_SKEW`]
    /// from the store's clock: this node's clock is off. Counted every time, logged once
    /// until a batch succeeds again, quoting the store's reason (its clock and the difference).
    fn refused_for_time(&self, host: &dyn Host, body: &[u8]) {
        if let Some(m) = self.metrics.refused_stale {
            host.increment(m, 1);
        }
        if self.refusal_logged.replace(true) {
            return;
        }
        host.log(
            Level::Error,
            &format!(
                "ratewall: the store at {} refuses this node's sync requests: this proxy's clock is more than \
                 {} s from the store's (\"{}\"); the limits stay in degraded mode until the clocks agree",
                self.opts.cluster,
                MAX_REQUEST_SKEW / 1_000_000_000,
                quoted(body)
            ),
        );
    }

    /// The batch and its answer without the deltas the store could not apply (their counter's
    /// stored value unreadable to it: nothing of them was counted). Their units go out again
    /// in the next batch, for [`GIVE_UP_AFTER`] from the first such answer (then they are
    /// dropped, as a failed batch's are); the node holds on to what it knew of those counters.
    fn without_unapplied(
        &self,
        host: &dyn Host,
        mut batch: Batch,
        mut resp: SyncResponse,
        now: Nanos,
        sent: Nanos,
    ) -> (Batch, SyncResponse) {
        let mut s = self.syncing.borrow_mut();
        if resp.failed.is_empty() {
            // Counters answered that had not been applied before are applied now (most
            // batches meet none: no key is hashed then).
            if !s.unapplied.is_empty() {
                for d in &batch.deltas {
                    s.unapplied.remove(&d.key);
                }
            }
            return (batch, resp);
        }
        let failed = core::mem::take(&mut resp.failed);
        let extra = resp.grants.split_off(batch.deltas.len().min(resp.grants.len()));
        let window_then = self.store_now(sent);
        let mut kept = (Vec::with_capacity(batch.deltas.len()), Vec::with_capacity(resp.grants.len()));
        for (i, (d, g)) in core::mem::take(&mut batch.deltas).into_iter().zip(resp.grants.drain(..)).enumerate() {
            if u32::try_from(i).map_or(true, |i| failed.binary_search(&i).is_err()) {
                s.unapplied.remove(&d.key);
                kept.0.push(d);
                kept.1.push(g);
                continue;
            }
            if let Some(m) = self.metrics.unapplied {
                host.increment(m, 1);
            }
            if s.unapplied.len() >= MAX_PENDING && !s.unapplied.contains_key(&d.key) {
                s.unapplied.clear();
            }
            let first = s.unapplied.entry(d.key.clone()).or_insert((d.limit, now)).1;
            let resent = now.saturating_sub(first) <= GIVE_UP_AFTER
                && add(&mut s.unsent, &d.key, d.limit, d.units, window_of(&d.limit, window_then));
            if !resent {
                if let Some(m) = self.metrics.dropped {
                    host.increment(m, d.units);
                }
            }
        }
        let logged = self.unapplied_logged.get();
        if logged == 0 || now.saturating_sub(logged) >= 60 * 1_000_000_000 || logged > now {
            self.unapplied_logged.set(now.max(1));
            host.log(
                Level::Warn,
                &format!(
                    "ratewall: the store at {} could not apply {} counter(s) of a batch (their stored value is \
                     unreadable to it: written by a newer store, or damaged); their units are sent again",
                    self.opts.cluster,
                    failed.len()
                ),
            );
        }
        batch.deltas = kept.0;
        resp.grants = kept.1;
        resp.grants.extend(extra);
        (batch, resp)
    }

    /// The longest valid answer to call `token` (0 when it is not the batch in flight): a
    /// longer body is refused before it is read.
    pub fn answer_cap(&self, token: u32) -> usize {
        match self.syncing.try_borrow().ok().as_ref().and_then(|s| s.inflight.as_ref()) {
            Some((t, batch, _)) if *t == token => SyncResponse::max_len(batch.deltas.iter().map(|d| d.key.len())),
            _ => 0,
        }
    }

    /// The answer to a sync call: `status` 0 when the call failed or timed out.
    pub fn on_response(
        &self,
        host: &dyn Host,
        table: &Table,
        token: u32,
        status: u32,
        tag: Option<&[u8]>,
        body: &[u8],
    ) {
        let now = host.now();
        let (batch, sent) = {
            let mut s = self.syncing.borrow_mut();
            match s.inflight.take() {
                Some((t, b, sent)) if t == token => (b, sent),
                other => {
                    s.inflight = other;
                    return; // not ours (a late answer to a call already given up on)
                }
            }
        };
        let verified = tag.and_then(unhex).is_some_and(|t| verify(self.opts.secret.as_bytes(), body, &t));
        let resp = match (status, verified) {
            (200, true) => SyncResponse::decode(body).ok().filter(|r| r.seq == batch.seq),
            _ => None,
        };
        let skewed = resp.as_ref().is_some_and(|r| r.now.abs_diff(now) > MAX_STORE_SKEW);
        let resp = resp.filter(|_| !skewed);
        if status == 409 {
            // The store has applied a later batch of this node: this one is an old duplicate.
            if let Some(m) = self.metrics.failed {
                host.increment(m, 1);
            }
            return;
        }
        let Some(resp) = resp else {
            if status == REFUSED_FOR_TIME {
                // Logged once by itself, not as each failed batch.
                self.refused_for_time(host, body);
                self.failed_as(host, batch, now, "", true);
                return;
            }
            let why = match (status, verified) {
                _ if skewed => "the store's clock is more than 300 s away from ours".to_owned(),
                (0, _) => "timeout or connection failure".to_owned(),
                (200, false) => "answer not signed with the shared secret".to_owned(),
                (200, true) => "garbled answer".to_owned(),
                (401, _) => "status 401: the store does not take this node's signature (sync.secret is not the \
                             store's RATEWALL_SYNC_SECRET, nor the one it rotates out)"
                    .to_owned(),
                (s, _) if body.is_empty() => format!("status {s}"),
                (s, _) => format!("status {s} (\"{}\")", quoted(body)),
            };
            self.failed(host, batch, now, &why);
            return;
        };
        let (batch, resp) = self.without_unapplied(host, batch, resp, now, sent);
        let limited = write_grants(host, table, &batch.deltas, &resp, sent, false);
        self.limited.borrow_mut().note(&limited, now);
        // The store read its clock about half way through the call, not when its answer
        // arrived: taken as of the arrival, the store's clock read half a round trip behind,
        // so for that long after a fixed window turned the node took the old window to run
        // on (a counter named out in it was denied with `Retry-After: 1`, and units admitted
        // then were dropped as the old window's, reported in none).
        let rtt = now.saturating_sub(sent);
        let midway = i64::try_from(sent.saturating_add(rtt / 2)).unwrap_or(i64::MAX);
        let offset = i64::try_from(resp.now).unwrap_or(i64::MAX).saturating_sub(midway);
        let view = View { ok_at: now, nodes: resp.nodes.max(1), offset, rtt };
        // The grants past the deltas' name the counters the store found out of quota; so does
        // the grant of a window's delta that leaves nothing (until a unit is free again: a
        // fixed window's end; the `Retry-After` of the denials meanwhile).
        let mut named: Named = batch
            .deltas
            .iter()
            .zip(&resp.grants)
            .filter(|(d, g)| g.grant == 0 && spent(&d.limit, g, 1))
            .map(|(_, g)| g)
            .chain(resp.grants.get(batch.deltas.len()..).unwrap_or_default())
            .take(ratewall_core::sync::MAX_OUT)
            .map(|g| out_entry(g, resp.now))
            .collect();
        // Counters named before and not in this batch are remembered until a while after their
        // unit came back (see `came_back`); those in it are as this answer says.
        let lag = self.lag();
        let old_named = self.named.borrow();
        // Each delta's key hashed once, and only when there is anything to keep. A counter in
        // the batch whose answer shows no room keeps its entry (a refused ask's wait, for a
        // token bucket, which no batch answer names).
        let in_batch: Vec<u64> = if old_named.is_empty() {
            Vec::new()
        } else {
            batch
                .deltas
                .iter()
                .zip(&resp.grants)
                .filter(|(_, g)| g.remaining > 0)
                .map(|(d, _)| ratewall_core::key::fnv1a(&d.key))
                .collect()
        };
        for old in old_named.iter() {
            let answered = named.iter().any(|(h, _)| *h == old.0) || in_batch.contains(&old.0);
            let remembered = old.1.saturating_mul(MS).saturating_add(lag).saturating_add(BACK_KEPT) > resp.now;
            if !answered && remembered && named.len() < ratewall_core::sync::MAX_OUT {
                named.push(*old);
            }
        }
        // Given up before the named counters are replaced below.
        drop(old_named);
        let mut shared = view.encode();
        encode_named(&named, &mut shared);
        // With the value's CAS: ngx_wasm_module writes a CAS of 0 only to a key that is
        // absent, so the view would stay as first written and every VM would go stale.
        for _ in 0..3 {
            let cas = host.shared_get(&self.keys.view).ok().and_then(|(_, cas)| cas);
            if host.shared_set(&self.keys.view, &shared, cas) != Err(SetError::CasMismatch) {
                break;
            }
        }
        self.view.set(view);
        *self.named.borrow_mut() = named;
        // A refusal is said again once the clocks agree: not when a refused batch's retry,
        // which repeats its time, is taken as that time comes within the store's bound (a
        // clock ahead by more than the bound would have it said every few seconds).
        if offset.unsigned_abs() <= MAX_REQUEST_SKEW {
            self.refusal_logged.set(false);
        }
        {
            let mut s = self.syncing.borrow_mut();
            s.failures = 0;
            s.open_until = 0;
            s.refused = false;
            // A spent token bucket is renewed when the store has a token back (the lease's end
            // is that far past it: the time the bucket takes to fill, less all but one of its
            // units), so that the node holds a grant by the time a client it refused comes
            // back. (Renewing sliding windows so, when a unit is back by the limit's pace,
            // over-admitted: `zipf100_rtt20_sliding`'s worst window 3.0 % → 6.5 %.)
            let renewed_after = self.opts.interval.saturating_mul(2).saturating_add(now.saturating_sub(sent));
            for (d, g) in batch.deltas.iter().zip(&resp.grants) {
                if let Some(r) = s.recent.get_mut(&d.key) {
                    let bucket = d.limit.algorithm() == ratewall_core::Algorithm::TokenBucket;
                    let end = match (g.remaining, g.grant) {
                        (0, _) if bucket => {
                            let rest = d.limit.quota().saturating_sub(1).saturating_mul(d.limit.interval());
                            sent.saturating_add(g.reset_after.saturating_sub(rest)).saturating_add(renewed_after)
                        }
                        (0, _) => 0,
                        (_, 0) => sent.max(1),
                        _ => sent.saturating_add(g.lease),
                    };
                    r.1 = Recent(r.1).leased(end).0;
                }
            }
            // A heartbeat's empty answer says nothing about the counters (nor do the
            // counters named out past the deltas' grants).
            let own = resp.grants.get(..batch.deltas.len()).unwrap_or(&resp.grants);
            if !own.is_empty() {
                s.relaxed = own.iter().all(|g| g.lease >= RELAXED_LEASE);
            }
        }
        if let Some(m) = self.metrics.breaker_open {
            host.set_gauge(m, 0);
        }
        if let Some(m) = self.metrics.ok {
            host.increment(m, 1);
        }
    }
}
