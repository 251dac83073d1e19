//! `ratewall-filter`: ratewall as a proxy-wasm HTTP filter for Envoy and NGINX
//! (ngx_wasm_module).
//!
//! The logic ([`engine`], [`table`]) depends only on `ratewall-core` and the small
//! [`host::Host`] trait, so it is unit-tested natively; the thin proxy-wasm glue (`glue`,
//! wasm32 only) implements that trait with the SDK's host calls that return errors instead
//! of panicking. Counters live in a fixed-size table in the proxy's shared data, updated by
//! compare-and-swap so every worker thread (VM) of one proxy agrees.
//!
//! With a `sync` section in the rules, [`sync`] shares each limit across replicas: one VM
//! per node (a lease in shared data) sends the global store batched deltas and applies the
//! grants it answers with.

pub mod engine;
pub mod host;
mod small_alloc;
pub mod sync;
pub mod table;
pub mod top;

#[cfg(target_arch = "wasm32")]
mod glue;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;

#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
#[global_allocator]
static ALLOCATOR: small_alloc::CachedAlloc = small_alloc::CachedAlloc::new();
