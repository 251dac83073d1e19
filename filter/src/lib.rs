//! `ratewall-filter`: ratewall as a proxy-wasm HTTP filter for Envoy and NGINX
//! (ngx_wasm_module).
//!
//! The logic ([`engine`], [`table`]) depends only on `ratewall-core` and the small
//! [`host::Host`] trait, so it is unit-tested natively; the thin proxy-wasm glue (`glue`,
//! wasm32 only) implements that trait with the SDK's host calls that return errors instead
//! of panicking. Counters live in a fixed-size table in the proxy's shared data, updated by
//! compare-and-swap so every worker thread (VM) of one proxy agrees.
//!
//! It does not talk to a global store yet: limits are per proxy.

pub mod engine;
pub mod host;
pub mod table;

#[cfg(target_arch = "wasm32")]
mod glue;
