//! Exports a few of `ratewall-core`'s entry points from a wasm32 cdylib so that CI can check
//! the built module imports nothing from its host: the core has no I/O and no clock.

use ratewall_core::{Config, MemoryCounters, Request};

/// Parses a rules document at `ptr..ptr+len` and evaluates one request against it at `now`.
/// Returns the HTTP status, or 0 when the document is invalid.
///
/// # Safety
/// `ptr..ptr+len` must be readable memory of this module.
#[no_mangle]
pub unsafe extern "C" fn ratewall_probe(ptr: *const u8, len: usize, now: u64) -> u32 {
    // SAFETY: the caller passes a readable region of this module's memory.
    let doc = unsafe { core::slice::from_raw_parts(ptr, len) };
    let Ok(config) = Config::parse(doc) else {
        return 0;
    };
    let headers = vec![None; config.identity.headers.len()];
    let req = Request { method: "GET", path: "/", headers: &headers, ip: Some("192.0.2.1") };
    let (checks, _) = config.checks(&req);
    let outcome = ratewall_core::evaluate(&config, &checks, &mut MemoryCounters::default(), now);
    u32::from(ratewall_core::render(&config, &outcome).status)
}

/// Decodes a state and re-encodes it; returns the encoded length, or 0 on a decode error.
///
/// # Safety
/// `ptr..ptr+len` must be readable memory of this module.
#[no_mangle]
pub unsafe extern "C" fn ratewall_probe_state(ptr: *const u8, len: usize) -> u32 {
    // SAFETY: the caller passes a readable region of this module's memory.
    let bytes = unsafe { core::slice::from_raw_parts(ptr, len) };
    ratewall_core::State::decode(bytes).map_or(0, |(s, _)| s.encode().len() as u32)
}
