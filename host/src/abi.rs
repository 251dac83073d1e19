//! The ABI's numbers: status codes, buffer and map types.

/// proxy-wasm status codes.
pub(crate) mod status {
    pub const OK: i32 = 0;
    pub const NOT_FOUND: i32 = 1;
    pub const BAD_ARGUMENT: i32 = 2;
    pub const CAS_MISMATCH: i32 = 8;
    pub const INTERNAL_FAILURE: i32 = 10;
    pub const UNIMPLEMENTED: i32 = 12;
}

/// Buffer types of `proxy_get_buffer_bytes`.
pub(crate) const BUFFER_HTTP_CALL_RESPONSE_BODY: i32 = 4;
pub(crate) const BUFFER_VM_CONFIGURATION: i32 = 6;
pub(crate) const BUFFER_PLUGIN_CONFIGURATION: i32 = 7;
/// Header map types.
pub(crate) const MAP_REQUEST_HEADERS: i32 = 0;
pub(crate) const MAP_RESPONSE_HEADERS: i32 = 2;
pub(crate) const MAP_HTTP_CALL_RESPONSE_HEADERS: i32 = 6;
