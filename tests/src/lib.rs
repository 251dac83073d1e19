//! `ratewall-tests`: runs ratewall's *built* wasm for real.
//!
//! - [`host`]: a proxy-wasm ABI v0.2.1 host on wasmtime (nodes of several VMs sharing one
//!   shared-data store with Envoy's CAS semantics, a virtual clock, metrics, callouts).
//! - `tests/`: the filter's behaviour through that host; `benches/`: benchmarks.
//! - [`workerd`]: the built Worker in real local workerd (wrangler dev), over [`http`].
//! - [`conformance`]: the sync protocol's call sequences, for every store; [`redis`]: Redis
//!   servers and Clusters on loopback for the store's tests, stopped by PID.
//! - `src/bin/gateway.rs`: a small local HTTP gateway that serves through the filter.

pub mod bench;
pub mod conformance;
pub mod host;
pub mod http;
pub mod redis;
pub mod sim;
pub mod workerd;
