//! The plain-text reasons a store gives when it refuses a sync call, one text for each
//! refusal, so that ratewall-store and the Worker answer alike (docs/sync-protocol.md,
//! "Status codes").

use alloc::format;
use alloc::string::String;

/// 401: the signature is missing or does not match.
pub const UNSIGNED: &str = "missing or invalid x-ratewall-signature";

/// 503: the node registry could not say whether the batch is new.
pub const REGISTRY_FAILED: &str = "the node registry failed; retry the batch with the same seq";

/// 413: a body over `max` bytes.
pub fn too_large(max: usize) -> String {
    format!("a body is at most {max} bytes")
}

/// 413: a batch naming more than `max` counters.
pub fn too_many(max: usize) -> String {
    format!("a batch names at most {max} counters")
}

/// 503: an ask naming a counter the store cannot read (a newer store's encoding, or a damaged
/// value): nothing of the ask is counted, and the counter is kept as it is.
pub const UNREADABLE_ASK: &str = "an ask names a stored counter that is unreadable; nothing is taken and it is kept";

/// 400: a body that is not a batch.
pub fn malformed(detail: impl core::fmt::Display) -> String {
    format!("malformed batch: {detail}")
}

/// 409: a batch older than the node's latest.
pub fn older(seq: u64, latest: u64) -> String {
    if seq == latest {
        // A batch closed once answered with counters it could not apply (`Registry::close`).
        return format!(
            "seq {seq} was answered with counters it could not apply, which the node sends again under a later seq"
        );
    }
    format!("seq {seq} is older than this node's latest batch ({latest})")
}
