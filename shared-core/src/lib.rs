//! `ratewall-core`: the rate-limit core that ratewall's proxy-wasm filter and Cloudflare
//! Worker both wrap.
//!
//! It is `no_std` + `alloc` and does no I/O: no clock (every entry point takes `now` in
//! nanoseconds since the epoch), no storage, no host calls. It holds:
//!
//! - [`text`](mod@text): ASCII-fast text and decimal helpers (a leaf);
//! - [`algo`]: token bucket (GCRA), sliding window counter, fixed window and sliding log as
//!   pure transitions `(state, now, cost) -> (decision, state)`;
//! - [`encoding`]: the versioned byte encoding of states;
//! - [`glob`] and [`key`]: path matching and identity (client IP and its source, counter-key
//!   parts);
//! - [`field`]: header-field pieces rules are pre-rendered into (`RateLimit-Policy` items);
//! - [`rules`]: the rules document parsed once into typed, validated rules;
//! - [`eval`]: multi-rule evaluation over any [`eval::Counters`] store;
//! - [`response`]: the 429 / `RateLimit` client contract;
//! - [`topk`]: who is being limited: a bounded heavy-hitters summary of denials and the
//!   readable identity of a counter key;
//! - [`sync`]: the protocol between proxies and the global store, and a reference store.
//!
//! It is not a store, a proxy plugin or a Worker: those are the wrappers' jobs.
#![no_std]
#![warn(missing_docs)]

extern crate alloc;
#[cfg(feature = "std")]
extern crate std;

// In the order of the data path; each module imports only the ones above it.
pub mod text;
mod hash;
pub mod algo;
pub mod encoding;
pub mod glob;
pub mod json;
pub mod field;
pub mod key;
pub mod rules;
pub mod eval;
pub mod response;
pub mod topk;
pub mod sync;

pub use algo::{Algorithm, Decision, Limit, Nanos, State, SECOND};
pub use eval::{combine, evaluate, Check, Counters, MemoryCounters, Outcome, Request};
pub use response::{render, Reply};
pub use rules::{Config, ConfigError};
pub use text::text;
