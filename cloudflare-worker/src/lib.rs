//! `ratewall-worker`: ratewall as a Cloudflare Worker.
//!
//! Each rate-limit counter — one rule under one key — is a Durable Object
//! (`RateLimitCounter`): single-threaded, so every check is atomic and global. The Worker
//! evaluates a request's rules with `ratewall-core`, asks the objects of the matching rules in
//! parallel, answers 429 with the core's client contract or forwards the request to the
//! origin with the RateLimit fields added, and serves `POST /v1/sync`: the global store that
//! proxy-wasm filter fleets sync their deltas to, backed by the same objects.
//!
//! [`edge`] is the logic without the runtime (unit-tested natively); `glue` binds it to
//! workers-rs and exists only on wasm32.

pub mod edge;

#[cfg(target_arch = "wasm32")]
mod glue;
