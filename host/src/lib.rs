//! A proxy-wasm ABI v0.2.1 host on wasmtime, faithful where ratewall depends on it.
//!
//! - A [`Node`] is one proxy process: one shared-data store with Envoy's semantics (a missing
//!   key reads as NotFound; a set with `cas = 0` is unconditional, so a key's first insert is
//!   not protected; every set bumps the key's CAS), one metric registry, one clock, one log.
//!   A node made with [`Profile::Nginx`] behaves as NGINX with ngx_wasm_module instead,
//!   wherever the two differ (the list is [`Profile::Nginx`]'s).
//! - A [`Vm`] is one worker thread's VM: its own wasmtime store and instance. VMs of a node
//!   are `Send` and run on real threads, so CAS races are real.
//! - The clock is virtual: tests set and advance it; nothing sleeps.
//! - Guest calls that trap return an error, and the VM is then unusable (as in Envoy).
//!
//! Every `env.proxy_*` import the module declares is defined: the ones ratewall uses
//! faithfully, the rest (gRPC, queues, foreign functions) answer `Unimplemented`. WASI
//! imports of wasm32-wasip1 modules get minimal shims.

mod abi;
mod imports;
mod memory;
mod node;
mod vm;
mod wasi;
pub mod http;

pub use node::{filter_wasm_path, Callout, Metric, Node, NodeState, Plugin, Profile};
pub use vm::{FilterResult, Forward, HeaderMap, HttpRequest, Started, Vm};

/// The error type of host calls (wasmtime's).
pub use wasmtime::Result;

#[cfg(test)]
mod tests;
