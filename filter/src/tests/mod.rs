//! Native unit tests of the filter's logic on the fake host ([`crate::fake`]): the engine
//! (`engine.rs`) and the syncer (`sync.rs`). The built wasm is tested in `tests/`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod engine;
mod sync;
mod top;

use crate::engine::{Engine, Verdict};
use crate::fake::{FakeHost, MS, T0};
use crate::host::Host;
use ratewall_core::Reply;

/// An engine for `doc` (which must be valid).
fn engine(host: &FakeHost, doc: &str) -> Engine {
    Engine::configure(host, doc.as_bytes(), None).unwrap()
}

/// Decides the request the host holds now; an ask is a test failure.
fn current(e: &Engine, h: &FakeHost) -> Reply {
    match e.on_request(h) {
        Verdict::Reply(r) | Verdict::Hold(r, _) => r,
        Verdict::Ask(a) => panic!("unexpected ask {}", a.token),
        Verdict::Wait(w) => panic!("unexpected wait until {}", w.until),
    }
}

/// Decides one request.
fn reply(e: &Engine, h: &FakeHost, method: &str, path: &str, headers: &[(&str, &str)]) -> Reply {
    h.request(method, path, headers);
    current(e, h)
}

/// The statuses of `n` identical requests.
fn statuses(e: &Engine, h: &FakeHost, method: &str, path: &str, headers: &[(&str, &str)], n: usize) -> Vec<u16> {
    (0..n).map(|_| reply(e, h, method, path, headers).status).collect()
}
