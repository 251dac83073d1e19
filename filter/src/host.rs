//! The small host interface the filter logic needs; the proxy-wasm glue implements it, and
//! unit tests use an in-memory fake.

use ratewall_core::Nanos;

/// A shared-data write that did not happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetError {
    /// The value changed since it was read.
    CasMismatch,
    /// Any other host failure.
    Other,
}

/// Log levels, as proxy-wasm numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Debug.
    Debug,
    /// Info.
    Info,
    /// Warn.
    Warn,
    /// Error.
    Error,
}

/// What the filter needs from its host.
pub trait Host {
    /// Wall-clock time, nanoseconds since the epoch.
    fn now(&self) -> Nanos;
    /// A request header's first value.
    fn request_header(&self, name: &str) -> Option<Vec<u8>>;
    /// A host property such as `["source", "address"]`.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
    /// Shared data: the value (None when the key does not exist) and its CAS token.
    fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), SetError>;
    /// Shared data: a write, conditional on `cas` when given.
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError>;
    /// Defines (or finds) a counter metric.
    fn define_counter(&self, name: &str) -> Option<u32>;
    /// Adds to a counter metric.
    fn increment(&self, metric: u32, by: u64);
    /// Defines (or finds) a gauge metric.
    fn define_gauge(&self, name: &str) -> Option<u32>;
    /// Sets a gauge.
    fn set_gauge(&self, metric: u32, value: u64);
    /// Sends an HTTP request to an upstream; the answer arrives later, by its token.
    fn dispatch(&self, upstream: &str, headers: &[(&str, &str)], body: &[u8], timeout: Nanos) -> Option<u32>;
    /// Logs a line.
    fn log(&self, level: Level, message: &str);
}
