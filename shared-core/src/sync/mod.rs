//! The sync protocol between proxies and the global store, and a reference store.
//!
//! Each proxy admits locally and, once per interval, sends the store one batch: the units it
//! admitted per counter since its last sync ([`SyncRequest`]). The store adds them to the
//! global state of each counter ([`Limit::consume`](crate::algo::Limit::consume)) and answers with the global view and a
//! *grant* per counter ([`SyncResponse`]): the units this node may admit before its next sync.
//! Grants split the global remaining quota between the nodes in proportion to their recent
//! traffic, so the grants outstanding at one instant never sum to more than what remains.
//!
//! - **Idempotent:** a request carries the node id and a sequence number. The store answers a
//!   repeat of the node's last sequence with the response it already gave (a retried batch is
//!   never counted twice) and refuses older ones ([`SyncError::Stale`]).
//! - **Authenticated:** [`sign`] / [`verify`] are HMAC-SHA256 over the encoded body with a
//!   shared secret; the tag travels beside the body (a header), never in logs.
//! - **Fresh:** every request carries the time it was made, inside the signed body; a store
//!   refuses one made further than [`MAX_REQUEST_SKEW`] from its clock, so a captured request
//!   cannot be replayed once its `seq` is forgotten ([`SyncError::Skewed`]).
//! - **One clock:** the store's `now` in the response is the reference for window ids, so
//!   nodes with skewed clocks agree on windows.
//! - **Compact:** `version | kind | varints`; a delta is its key, its limit (4 varints) and
//!   its units.
//!
//! `docs/sync-protocol.md` describes the wire format and the error bound.

mod auth;
mod counter;
mod out;
pub mod reason;
mod registry;
mod store;
#[cfg(test)]
mod tests;
mod wire;

pub use auth::{hex, sign, unhex, verify};

/// The overdraft's part of the quota, per node: a node that may not wait for the store admits
/// up to `quota / OVERDRAFT_PART / nodes` units (at least 1) past what it holds
/// (docs/sync-protocol.md, "The error bound").
pub const OVERDRAFT_PART: u64 = 100;
/// A node the store is out of reach of admits its measured share of a counter's traffic times
/// `1 + 1 / DEGRADED_MARGIN` of its limit (docs/sync-protocol.md, "Degraded mode"); the store
/// holds as much for a node it takes as cut off.
pub const DEGRADED_MARGIN: u64 = 20;
/// The fixed window `t` lies in, for `limit` (0 for the other algorithms, whose units count
/// whenever they are reported).
pub fn window_of(limit: &crate::algo::Limit, t: crate::algo::Nanos) -> u64 {
    if limit.algorithm() == crate::algo::Algorithm::FixedWindow {
        t / limit.per().max(1)
    } else {
        0
    }
}

/// Of `units` a report made at `sent` (on the clock of `now`; 0: not known), those that count
/// at `now`: a fixed window's units reported from a window that has ended count in none.
/// Counted now, they would take from the window after theirs — a client's last requests of
/// a window from its next one. (A filter node's batch carries its own clock, not the store's:
/// a node drops such units itself before it sends them.)
pub(crate) fn counted_units(
    limit: &crate::algo::Limit,
    sent: crate::algo::Nanos,
    now: crate::algo::Nanos,
    units: u64,
) -> u64 {
    if sent > 0 && window_of(limit, sent) < window_of(limit, now) {
        0
    } else {
        units
    }
}

pub use counter::{
    asks_alone, Applied, Counter, ASKS_ONLY_UP_TO, ASK_LEASE, CLOCK_CORRECTION, CUT_OFF_SILENCE, MAX_LEASE, MAX_SHARES,
    REPORT_GRACE, RETRY_HORIZON, ROOM_UNIT_FREE, ROOM_UNIT_FREE_EXACT, SEQ_MEMORY,
};
pub use out::{Out, MAX_OUT};
pub use registry::{Registry, MAX_ASKS_REMEMBERED, MAX_HEARD_LATELY, MAX_NODES};
pub use store::Store;
pub use wire::{
    Delta, Grant, RuleTop, SyncError, SyncRequest, SyncResponse, TopSection, FAILED_SECTION, MAX_ENTRIES, MAX_KEY,
    MAX_REASON, MAX_REQUEST_SKEW, MAX_TOP_SECTION, TOP_SECTION, TOP_SECTION_COUNTERS_ONLY, VERSION,
};
