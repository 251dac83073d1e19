//! `ratewall-core`: the rate-limit core that ratewall's proxy-wasm filter and Cloudflare
//! Worker both wrap.
//!
//! It is `no_std` + `alloc` and does no I/O: no clock (every entry point takes `now` in
//! nanoseconds since the epoch), no storage, no host calls. It holds:
//!
//! - [`algo`]: token bucket (GCRA), sliding window counter, fixed window and sliding log as
//!   pure transitions `(state, now, cost) -> (decision, state)`;
//! - [`rules`]: the rules document parsed once into typed, validated rules;
//! - [`glob`] and [`key`]: path matching and identity (client IP, composite keys);
//! - [`eval`]: multi-rule evaluation over any [`eval::Counters`] store;
//! - [`response`]: the 429 / `RateLimit` client contract;
//! - [`encoding`]: the versioned byte encoding of states;
//! - [`sync`]: the protocol between proxies and the global store, and a reference store.
//!
//! It is not a store, a proxy plugin or a Worker: those are the wrappers' jobs.
#![no_std]
#![warn(missing_docs)]

extern crate alloc;
#[cfg(feature = "std")]
extern crate std;

pub mod algo;
pub mod encoding;
pub mod eval;
pub mod glob;
mod hash;
pub mod json;
pub mod key;
pub mod response;
pub mod rules;
pub mod sync;

/// `bytes` as text. ASCII — header names, numbers, addresses, most paths — passes a much
/// simpler test than full UTF-8 validation, which costs several times more on short strings
/// on the request path; anything else is validated in full.
pub fn text(bytes: &[u8]) -> Option<&str> {
    if bytes.is_ascii() {
        // SAFETY: every ASCII byte sequence is valid UTF-8.
        Some(unsafe { core::str::from_utf8_unchecked(bytes) })
    } else {
        core::str::from_utf8(bytes).ok()
    }
}

pub use algo::{Algorithm, Decision, Limit, Nanos, State, SECOND};
pub use eval::{combine, evaluate, Check, Counters, MemoryCounters, Outcome, Request};
pub use response::{render, Reply};
pub use rules::{Config, ConfigError};
