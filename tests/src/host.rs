//! A proxy-wasm ABI v0.2.1 host on wasmtime, faithful where ratewall depends on it.
//!
//! - A [`Node`] is one proxy process: one shared-data store with Envoy's semantics (a missing
//!   key reads as NotFound; a set with `cas = 0` is unconditional, so a key's first insert is
//!   not protected; every set bumps the key's CAS), one metric registry, one clock, one log.
//! - A [`Vm`] is one worker thread's VM: its own wasmtime store and instance. VMs of a node
//!   are `Send` and run on real threads, so CAS races are real.
//! - The clock is virtual: tests set and advance it; nothing sleeps.
//! - Guest calls that trap return an error, and the VM is then unusable (as in Envoy).
//!
//! Every `env.proxy_*` import the module declares is defined: the ones ratewall uses
//! faithfully, the rest (gRPC, queues, foreign functions) answer `Unimplemented`. WASI
//! imports of wasm32-wasip1 modules get minimal shims.

use rustc_hash::FxHashMap;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use wasmtime::{
    bail, format_err, Caller, Engine, Extern, Func, Instance, Linker, Memory, Module, Result, Store, TypedFunc, Val,
};

/// proxy-wasm status codes.
mod status {
    pub const OK: i32 = 0;
    pub const NOT_FOUND: i32 = 1;
    pub const BAD_ARGUMENT: i32 = 2;
    pub const CAS_MISMATCH: i32 = 8;
    pub const UNIMPLEMENTED: i32 = 12;
}

/// Buffer types of `proxy_get_buffer_bytes`.
const BUFFER_HTTP_CALL_RESPONSE_BODY: i32 = 4;
const BUFFER_VM_CONFIGURATION: i32 = 6;
const BUFFER_PLUGIN_CONFIGURATION: i32 = 7;
/// Header map types.
const MAP_REQUEST_HEADERS: i32 = 0;
const MAP_RESPONSE_HEADERS: i32 = 2;
const MAP_HTTP_CALL_RESPONSE_HEADERS: i32 = 6;

/// Where the built filter lives, relative to the workspace.
pub fn filter_wasm_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../dist/ratewall_filter.wasm")
}

/// A compiled module, shared by every VM (compiling once per process keeps tests fast).
#[derive(Clone)]
pub struct Plugin {
    engine: Engine,
    module: Module,
}

impl Plugin {
    /// The built `dist/ratewall_filter.wasm`, compiled once per process.
    pub fn filter() -> Result<Plugin> {
        static FILTER: OnceLock<std::result::Result<Plugin, String>> = OnceLock::new();
        FILTER
            .get_or_init(|| {
                let path = filter_wasm_path();
                let bytes = std::fs::read(&path).map_err(|e| {
                    format!("{}: {e}. Build it with `cargo xtask build` (or run `cargo xtask test`).", path.display())
                })?;
                Plugin::from_bytes(&bytes).map_err(|e| format!("{e:#}"))
            })
            .clone()
            .map_err(|e| format_err!(e))
    }

    /// Compiles a module from its bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Plugin> {
        // RATEWALL_FUEL=1 meters every plugin (see [`Plugin::metered`]).
        Plugin::compile(bytes, std::env::var_os("RATEWALL_FUEL").is_some())
    }

    /// Compiles a module whose VMs count the wasm instructions they run ([`Vm::fuel_used`]):
    /// a figure that, unlike time, does not vary from run to run. Metering slows the guest.
    pub fn metered(bytes: &[u8]) -> Result<Plugin> {
        Plugin::compile(bytes, true)
    }

    fn compile(bytes: &[u8], metered: bool) -> Result<Plugin> {
        // RATEWALL_PERFMAP=1 writes /tmp/perf-PID.map so `perf report` names guest functions.
        let mut config = wasmtime::Config::new();
        if std::env::var_os("RATEWALL_PERFMAP").is_some() {
            config.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        config.consume_fuel(metered);
        let engine = Engine::new(&config)?;
        let module = Module::new(&engine, bytes)?;
        if module.get_export("proxy_abi_version_0_2_1").is_none() {
            bail!("the module does not export proxy_abi_version_0_2_1");
        }
        Ok(Plugin { engine, module })
    }
}

/// A metric as the host keeps it.
#[derive(Clone, Debug)]
pub struct Metric {
    /// Its name.
    pub name: String,
    /// proxy-wasm type: 0 counter, 1 gauge, 2 histogram.
    pub kind: i32,
    /// Its value.
    pub value: i64,
}

/// What one proxy process shares between its VMs.
#[derive(Default)]
pub struct NodeState {
    /// Keys hashed with FxHash, as a proxy's own maps use a fast hash (Envoy: absl's).
    shared: Mutex<FxHashMap<String, (Vec<u8>, u32)>>,
    next_cas: AtomicU32,
    metrics: Mutex<Vec<Metric>>,
    clock: AtomicU64,
    logs: Mutex<Vec<(i32, String)>>,
    next_token: AtomicU32,
    /// Fault injection: every conditional shared-data write fails with CasMismatch.
    cas_always_fails: std::sync::atomic::AtomicBool,
    /// The `node.id` property (Envoy's `--service-node`): unique per node.
    id: std::sync::OnceLock<String>,
}

static NODES: AtomicU64 = AtomicU64::new(0);

/// An HTTP call a VM dispatched (`proxy_http_call`), waiting for the test to answer it.
#[derive(Clone, Debug)]
pub struct Callout {
    /// The token the VM got.
    pub token: u32,
    /// The context that dispatched it.
    pub context: u32,
    /// The cluster / upstream name.
    pub upstream: String,
    /// Request headers.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Request body.
    pub body: Vec<u8>,
    /// Timeout in milliseconds.
    pub timeout_ms: u32,
}

/// One proxy process: shared data, metrics, clock and logs shared by its [`Vm`]s.
#[derive(Clone, Default)]
pub struct Node {
    state: Arc<NodeState>,
}

impl Node {
    /// A node with its clock at `now` (nanoseconds since the epoch).
    pub fn new(now: u64) -> Node {
        let node = Node::default();
        let _ = node.state.id.set(format!("node-{}", NODES.fetch_add(1, Ordering::SeqCst)));
        node.set_time(now);
        node
    }
    /// Sets the virtual clock.
    pub fn set_time(&self, now: u64) {
        self.state.clock.store(now, Ordering::SeqCst);
    }
    /// Advances the virtual clock.
    pub fn advance(&self, by: u64) {
        self.state.clock.fetch_add(by, Ordering::SeqCst);
    }
    /// The virtual clock.
    pub fn now(&self) -> u64 {
        self.state.clock.load(Ordering::SeqCst)
    }
    /// A metric's value by name (0 when undefined).
    pub fn metric(&self, name: &str) -> i64 {
        lock(&self.state.metrics).iter().find(|m| m.name == name).map_or(0, |m| m.value)
    }
    /// Every metric.
    pub fn metrics(&self) -> Vec<Metric> {
        lock(&self.state.metrics).clone()
    }
    /// Log lines `(level, message)`.
    pub fn logs(&self) -> Vec<(i32, String)> {
        lock(&self.state.logs).clone()
    }
    /// Number of shared-data keys and total bytes of keys and values.
    pub fn shared_data_size(&self) -> (usize, usize) {
        let map = lock(&self.state.shared);
        (map.len(), map.iter().map(|(k, (v, _))| k.len() + v.len()).sum())
    }
    /// A shared-data value.
    pub fn shared_get(&self, key: &str) -> Option<Vec<u8>> {
        lock(&self.state.shared).get(key).map(|(v, _)| v.clone())
    }
    /// Writes shared data as a guest would (`cas = 0`: unconditional); returns the status.
    pub fn set_shared(&self, key: &str, value: &[u8], cas: u32) -> i32 {
        self.shared_set(key, value, cas)
    }

    /// Fault injection: from now on every conditional shared-data write (`cas != 0`) answers
    /// CasMismatch, as under contention that never lets up.
    pub fn fail_every_cas(&self, on: bool) {
        self.state.cas_always_fails.store(on, Ordering::SeqCst);
    }

    /// Envoy's `SharedData::set`: with `cas != 0` an existing key must still have that CAS;
    /// a missing key is inserted whatever `cas` is.
    fn shared_set(&self, key: &str, value: &[u8], cas: u32) -> i32 {
        if cas != 0 && self.state.cas_always_fails.load(Ordering::SeqCst) {
            return status::CAS_MISMATCH;
        }
        let mut map = lock(&self.state.shared);
        let next = self.state.next_cas.fetch_add(1, Ordering::SeqCst).wrapping_add(1).max(1);
        match map.get_mut(key) {
            Some(entry) if cas != 0 && cas != entry.1 => status::CAS_MISMATCH,
            Some(entry) => {
                entry.0.clear();
                entry.0.extend_from_slice(value);
                entry.1 = next;
                status::OK
            }
            None => {
                map.insert(key.to_owned(), (value.to_vec(), next));
                status::OK
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A request as the proxy hands it to the filter.
#[derive(Clone, Debug, Default)]
pub struct HttpRequest {
    /// Header fields including `:method`, `:path`, `:authority`; names lower-case.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The `source.address` property (`ip:port`).
    pub source_address: Option<String>,
}

impl HttpRequest {
    /// A request with a method and path.
    pub fn new(method: &str, path: &str) -> HttpRequest {
        HttpRequest {
            headers: vec![
                (":method".into(), method.as_bytes().to_vec()),
                (":path".into(), path.as_bytes().to_vec()),
                (":authority".into(), b"api.example.com".to_vec()),
            ],
            source_address: Some("10.0.0.1:40000".into()),
        }
    }
    /// Adds a header.
    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> HttpRequest {
        self.headers.push((name.to_ascii_lowercase(), value.as_ref().to_vec()));
        self
    }
    /// Sets the peer address.
    pub fn from_addr(mut self, addr: &str) -> HttpRequest {
        self.source_address = Some(addr.into());
        self
    }
}

/// A request the filter decided at once, or paused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Started {
    /// Decided.
    Done(FilterResult),
    /// Paused: its context id, for [`Vm::finish`].
    Paused(u32),
}

/// What the filter did with a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FilterResult {
    /// Status: the local reply's, or 200 when the request went upstream.
    pub status: u32,
    /// The local reply's headers, or the headers the filter added to the upstream response.
    pub headers: Vec<(String, String)>,
    /// The local reply's body.
    pub body: Vec<u8>,
    /// Whether the request went upstream.
    pub passed: bool,
}

impl FilterResult {
    /// A header value (case-insensitive name).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
struct LocalReply {
    status: u32,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// Header fields as the host keeps them: lower-case names, raw values.
pub type HeaderMap = Vec<(String, Vec<u8>)>;

/// Per-VM host state.
struct VmState {
    node: Node,
    plugin_config: Vec<u8>,
    request_headers: Vec<(String, Vec<u8>)>,
    response_headers: Vec<(String, Vec<u8>)>,
    source_address: Option<String>,
    /// Local replies sent, by context.
    local_replies: HashMap<u32, LocalReply>,
    /// Paused contexts the plugin resumed (`proxy_continue_stream`).
    resumed: HashSet<u32>,
    tick_period_ms: u32,
    callouts: Vec<Callout>,
    call_response: Option<(HeaderMap, Vec<u8>)>,
    effective_context: u32,
    /// The guest's memory and allocator, looked up once after instantiation.
    memory: Option<Memory>,
    alloc: Option<TypedFunc<i32, i32>>,
    /// Behave like a host whose header-map listing leaves out the pseudo-headers.
    pairs_without_pseudo_headers: bool,
    /// When set, the time of each `proxy_on_request_headers` call, in ns.
    request_headers_ns: Option<Vec<u64>>,
    /// A buffer reused by the host calls that copy bytes into the guest.
    scratch: Vec<u8>,
}

/// The guest entry points called per request, looked up once.
struct Entries {
    context_create: TypedFunc<(i32, i32), ()>,
    request_headers: TypedFunc<(i32, i32, i32), i32>,
    response_headers: TypedFunc<(i32, i32, i32), i32>,
    done: TypedFunc<i32, i32>,
    log: TypedFunc<i32, ()>,
    delete: TypedFunc<i32, ()>,
}

/// One VM (one worker thread) of a node, with the plugin instantiated and configured.
pub struct Vm {
    store: Store<VmState>,
    instance: Instance,
    entries: Entries,
    root: u32,
    next_context: u32,
    broken: Option<String>,
}

fn memory(caller: &mut Caller<'_, VmState>) -> Result<Memory> {
    if let Some(m) = caller.data().memory {
        return Ok(m);
    }
    match caller.get_export("memory") {
        Some(Extern::Memory(m)) => Ok(m),
        _ => bail!("the module exports no memory"),
    }
}

/// Reads guest memory `ptr..ptr+len`; sizes are u32 on wasm32 (`-1` means `u32::MAX`).
fn read(caller: &mut Caller<'_, VmState>, ptr: i32, len: i32) -> Result<Vec<u8>> {
    let mem = memory(caller)?;
    let (ptr, len) = (ptr as u32 as usize, len as u32 as usize);
    mem.data(&caller)
        .get(ptr..ptr.checked_add(len).ok_or_else(|| format_err!("overflow"))?)
        .map(<[u8]>::to_vec)
        .ok_or_else(|| format_err!("guest pointer {ptr}+{len} out of bounds"))
}

/// Guest memory `ptr..ptr+len`, borrowed (no copy) beside the VM's state.
fn guest_slice(mem: &[u8], ptr: i32, len: i32) -> Result<&[u8]> {
    let (ptr, len) = (ptr as u32 as usize, len as u32 as usize);
    mem.get(ptr..ptr.checked_add(len).ok_or_else(|| format_err!("overflow"))?)
        .ok_or_else(|| format_err!("guest pointer {ptr}+{len} out of bounds"))
}

/// Runs `f` on guest memory and the VM state at once, so keys and values are read in place.
fn with_memory<R>(caller: &mut Caller<'_, VmState>, f: impl FnOnce(&[u8], &mut VmState) -> Result<R>) -> Result<R> {
    let mem = memory(caller)?;
    let (data, state) = mem.data_and_store_mut(caller);
    f(data, state)
}

/// Guest bytes as text, as the proxy would treat a key (invalid UTF-8 replaced).
fn text(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    match std::str::from_utf8(bytes) {
        Ok(s) => std::borrow::Cow::Borrowed(s),
        Err(_) => String::from_utf8_lossy(bytes),
    }
}

fn read_str(caller: &mut Caller<'_, VmState>, ptr: i32, len: i32) -> Result<String> {
    let bytes = read(caller, ptr, len)?;
    Ok(String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
}

/// A header name from guest memory, lower-cased as the proxy keeps names (one allocation).
fn read_name(caller: &mut Caller<'_, VmState>, ptr: i32, len: i32) -> Result<String> {
    let mut name = read_str(caller, ptr, len)?;
    name.make_ascii_lowercase();
    Ok(name)
}

fn write_u32(caller: &mut Caller<'_, VmState>, ptr: i32, v: u32) -> Result<()> {
    let mem = memory(caller)?;
    mem.write(caller, ptr as u32 as usize, &v.to_le_bytes())?;
    Ok(())
}

fn write_u64(caller: &mut Caller<'_, VmState>, ptr: i32, v: u64) -> Result<()> {
    let mem = memory(caller)?;
    mem.write(caller, ptr as u32 as usize, &v.to_le_bytes())?;
    Ok(())
}

/// Copies `data` into a buffer the guest allocates (at exactly `data.len()` bytes, since the
/// SDK frees it as a `Vec` of that capacity), then stores its address and size. Memory may
/// grow during the allocation, so no view of it is held across the call.
fn return_bytes(caller: &mut Caller<'_, VmState>, data: &[u8], ret_ptr: i32, ret_size: i32) -> Result<()> {
    // Taken out and put back rather than cloned: a TypedFunc clone costs a type-registry
    // refcount round trip on every host call that returns data.
    let alloc = match caller.data_mut().alloc.take() {
        Some(a) => a,
        None => ["malloc", "proxy_on_memory_allocate"]
            .iter()
            .find_map(|n| caller.get_export(n).and_then(Extern::into_func))
            .ok_or_else(|| format_err!("the module exports no allocator"))?
            .typed::<i32, i32>(&caller)?,
    };
    let addr = if data.is_empty() { Ok(0) } else { alloc.call(&mut *caller, data.len() as i32) };
    caller.data_mut().alloc = Some(alloc);
    let addr = addr?;
    if !data.is_empty() {
        if addr == 0 {
            bail!("guest allocation of {} bytes failed", data.len());
        }
        let mem = memory(caller)?;
        mem.write(&mut *caller, addr as u32 as usize, data)?;
    }
    write_u32(caller, ret_ptr, addr as u32)?;
    write_u32(caller, ret_size, data.len() as u32)
}

/// Answers a getter: NotFound for `None`, else the bytes copied into the guest and Ok.
fn reply_bytes(caller: &mut Caller<'_, VmState>, value: Option<Vec<u8>>, ret_ptr: i32, ret_size: i32) -> Result<i32> {
    match value {
        None => Ok(status::NOT_FOUND),
        Some(v) => {
            return_bytes(caller, &v, ret_ptr, ret_size)?;
            Ok(status::OK)
        }
    }
}

/// The proxy-wasm header map encoding.
/// The proxy-wasm header map encoding, into `out` (cleared first; its capacity is reused).
fn serialize_map(pairs: &[(String, Vec<u8>)], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(4 + pairs.iter().map(|(k, v)| 10 + k.len() + v.len()).sum::<usize>());
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
}

fn deserialize_map(bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>> {
    let u32_at = |at: usize| -> Result<usize> {
        let b = bytes.get(at..at + 4).ok_or_else(|| format_err!("header map truncated"))?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    let n = u32_at(0)?;
    let mut p = 4 + n * 8;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let (kl, vl) = (u32_at(4 + i * 8)?, u32_at(8 + i * 8)?);
        let k = bytes.get(p..p + kl).ok_or_else(|| format_err!("header map truncated"))?;
        p += kl + 1;
        let v = bytes.get(p..p + vl).ok_or_else(|| format_err!("header map truncated"))?;
        p += vl + 1;
        out.push((String::from_utf8_lossy(k).into_owned(), v.to_vec()));
    }
    Ok(out)
}

fn map_for(state: &mut VmState, map_type: i32) -> Option<&mut Vec<(String, Vec<u8>)>> {
    match map_type {
        MAP_REQUEST_HEADERS => Some(&mut state.request_headers),
        MAP_RESPONSE_HEADERS => Some(&mut state.response_headers),
        MAP_HTTP_CALL_RESPONSE_HEADERS => state.call_response.as_mut().map(|(h, _)| h),
        _ => None,
    }
}

fn define_imports(linker: &mut Linker<VmState>, module: &Module) -> Result<()> {
    // First a stub for everything the module imports (gRPC, queues, foreign functions answer
    // Unimplemented; WASI gets shims); the real host calls below then replace the stubs.
    for import in module.imports() {
        let (m, n) = (import.module(), import.name());
        let Some(ty) = import.ty().func().cloned() else {
            continue;
        };
        let name = format!("{m}.{n}");
        if m == "env" {
            linker.func_new(m, n, ty, move |_c, _args, results| {
                if let Some(r) = results.first_mut() {
                    *r = Val::I32(status::UNIMPLEMENTED);
                }
                Ok(())
            })?;
        } else if m.starts_with("wasi") {
            define_wasi(linker, m, n, ty)?;
        } else {
            bail!("the module imports {name}, which no proxy provides");
        }
    }
    linker.allow_shadowing(true);
    linker.func_wrap(
        "env",
        "proxy_log",
        |mut c: Caller<'_, VmState>, level: i32, ptr: i32, len: i32| -> Result<i32> {
            let msg = read_str(&mut c, ptr, len)?;
            lock(&c.data().node.state.logs).push((level, msg));
            Ok(status::OK)
        },
    )?;
    linker.func_wrap("env", "proxy_get_log_level", |mut c: Caller<'_, VmState>, ret: i32| -> Result<i32> {
        write_u32(&mut c, ret, 0)?;
        Ok(status::OK)
    })?;
    linker.func_wrap(
        "env",
        "proxy_get_current_time_nanoseconds",
        |mut c: Caller<'_, VmState>, ret: i32| -> Result<i32> {
            let now = c.data().node.now();
            write_u64(&mut c, ret, now)?;
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_tick_period_milliseconds",
        |mut c: Caller<'_, VmState>, period: i32| -> i32 {
            c.data_mut().tick_period_ms = period as u32;
            status::OK
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_buffer_bytes",
        |mut c: Caller<'_, VmState>, kind: i32, start: i32, max: i32, ret_ptr: i32, ret_size: i32| -> Result<i32> {
            let data = match kind {
                BUFFER_PLUGIN_CONFIGURATION => c.data().plugin_config.clone(),
                BUFFER_VM_CONFIGURATION => Vec::new(),
                BUFFER_HTTP_CALL_RESPONSE_BODY => match &c.data().call_response {
                    Some((_, body)) => body.clone(),
                    None => return Ok(status::NOT_FOUND),
                },
                _ => return Ok(status::NOT_FOUND),
            };
            let start = (start as u32 as usize).min(data.len());
            let end = start.saturating_add(max as u32 as usize).min(data.len());
            return_bytes(&mut c, &data[start..end], ret_ptr, ret_size)?;
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_header_map_pairs",
        |mut c: Caller<'_, VmState>, map_type: i32, ret_ptr: i32, ret_size: i32| -> Result<i32> {
            let omit = c.data().pairs_without_pseudo_headers && map_type == MAP_REQUEST_HEADERS;
            let mut bytes = std::mem::take(&mut c.data_mut().scratch);
            let Some(map) = map_for(c.data_mut(), map_type) else {
                return Ok(status::NOT_FOUND);
            };
            if omit {
                let kept: Vec<_> = map.iter().filter(|(k, _)| !k.starts_with(':')).cloned().collect();
                serialize_map(&kept, &mut bytes);
            } else {
                serialize_map(map, &mut bytes);
            }
            let r = return_bytes(&mut c, &bytes, ret_ptr, ret_size);
            c.data_mut().scratch = bytes;
            r.map(|()| status::OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_header_map_pairs",
        |mut c: Caller<'_, VmState>, map_type: i32, ptr: i32, len: i32| -> Result<i32> {
            let pairs = deserialize_map(&read(&mut c, ptr, len)?)?;
            let Some(map) = map_for(c.data_mut(), map_type) else {
                return Ok(status::NOT_FOUND);
            };
            *map = pairs;
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_header_map_value",
        |mut c: Caller<'_, VmState>, map_type: i32, kp: i32, kl: i32, ret_ptr: i32, ret_size: i32| -> Result<i32> {
            let key = read_name(&mut c, kp, kl)?;
            let value =
                map_for(c.data_mut(), map_type).and_then(|m| m.iter().find(|(k, _)| *k == key).map(|(_, v)| v.clone()));
            reply_bytes(&mut c, value, ret_ptr, ret_size)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_remove_header_map_value",
        |mut c: Caller<'_, VmState>, map_type: i32, kp: i32, kl: i32| -> Result<i32> {
            let key = read_name(&mut c, kp, kl)?;
            if let Some(map) = map_for(c.data_mut(), map_type) {
                map.retain(|(k, _)| *k != key);
            }
            Ok(status::OK)
        },
    )?;
    for (name, replace) in [("proxy_replace_header_map_value", true), ("proxy_add_header_map_value", false)] {
        linker.func_wrap(
            "env",
            name,
            move |mut c: Caller<'_, VmState>, map_type: i32, kp: i32, kl: i32, vp: i32, vl: i32| -> Result<i32> {
                let key = read_name(&mut c, kp, kl)?;
                let value = read(&mut c, vp, vl)?;
                let Some(map) = map_for(c.data_mut(), map_type) else {
                    return Ok(status::NOT_FOUND);
                };
                if replace {
                    map.retain(|(k, _)| *k != key);
                }
                map.push((key, value));
                Ok(status::OK)
            },
        )?;
    }
    linker.func_wrap(
        "env",
        "proxy_get_property",
        |mut c: Caller<'_, VmState>, pp: i32, pl: i32, ret_ptr: i32, ret_size: i32| -> Result<i32> {
            let path = read(&mut c, pp, pl)?;
            let parts: Vec<&[u8]> = path.split(|&b| b == 0).collect();
            let value = match parts.as_slice() {
                [b"source", b"address"] => c.data().source_address.clone().map(String::into_bytes),
                [b"plugin_root_id"] | [b"plugin_name"] => Some(b"ratewall".to_vec()),
                [b"node", b"id"] => c.data().node.state.id.get().map(|s| s.clone().into_bytes()),
                _ => None,
            };
            reply_bytes(&mut c, value, ret_ptr, ret_size)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_shared_data",
        |mut c: Caller<'_, VmState>, kp: i32, kl: i32, ret_ptr: i32, ret_size: i32, ret_cas: i32| -> Result<i32> {
            // Copied out under the lock into the VM's scratch buffer (no allocation), then into
            // the guest's: the guest's allocator runs in between.
            let mut value = std::mem::take(&mut c.data_mut().scratch);
            let found = with_memory(&mut c, |mem, s| {
                let key = text(guest_slice(mem, kp, kl)?);
                Ok(lock(&s.node.state.shared).get(key.as_ref()).map(|(v, cas)| {
                    value.clear();
                    value.extend_from_slice(v);
                    *cas
                }))
            });
            let r = match found {
                Ok(Some(cas)) => return_bytes(&mut c, &value, ret_ptr, ret_size)
                    .and_then(|()| write_u32(&mut c, ret_cas, cas))
                    .map(|()| status::OK),
                Ok(None) => Ok(status::NOT_FOUND),
                Err(e) => Err(e),
            };
            c.data_mut().scratch = value;
            r
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_shared_data",
        |mut c: Caller<'_, VmState>, kp: i32, kl: i32, vp: i32, vl: i32, cas: i32| -> Result<i32> {
            with_memory(&mut c, |mem, s| {
                let (key, value) = (text(guest_slice(mem, kp, kl)?), guest_slice(mem, vp, vl)?);
                Ok(s.node.shared_set(&key, value, cas as u32))
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_send_local_response",
        |mut c: Caller<'_, VmState>,
         code: i32,
         _dp: i32,
         _dl: i32,
         bp: i32,
         bl: i32,
         hp: i32,
         hl: i32,
         _grpc: i32|
         -> Result<i32> {
            let body = read(&mut c, bp, bl)?;
            let headers = deserialize_map(&read(&mut c, hp, hl)?)?
                .into_iter()
                .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
                .collect();
            let ctx = c.data().effective_context;
            c.data_mut().local_replies.insert(ctx, LocalReply { status: code as u32, headers, body });
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_http_call",
        |mut c: Caller<'_, VmState>,
         up: i32,
         ul: i32,
         hp: i32,
         hl: i32,
         bp: i32,
         bl: i32,
         _tp: i32,
         _tl: i32,
         timeout: i32,
         ret: i32|
         -> Result<i32> {
            let upstream = read_str(&mut c, up, ul)?;
            let headers = deserialize_map(&read(&mut c, hp, hl)?)?;
            let body = read(&mut c, bp, bl)?;
            let token = c.data().node.state.next_token.fetch_add(1, Ordering::SeqCst) + 1;
            let context = c.data().effective_context;
            c.data_mut().callouts.push(Callout { token, context, upstream, headers, body, timeout_ms: timeout as u32 });
            write_u32(&mut c, ret, token)?;
            Ok(status::OK)
        },
    )?;
    linker.func_wrap("env", "proxy_set_effective_context", |mut c: Caller<'_, VmState>, ctx: i32| -> i32 {
        c.data_mut().effective_context = ctx as u32;
        status::OK
    })?;
    linker.func_wrap("env", "proxy_continue_stream", |mut c: Caller<'_, VmState>, _t: i32| -> i32 {
        let ctx = c.data().effective_context;
        c.data_mut().resumed.insert(ctx);
        status::OK
    })?;
    linker.func_wrap("env", "proxy_close_stream", |_c: Caller<'_, VmState>, _t: i32| -> i32 { status::OK })?;
    linker.func_wrap("env", "proxy_done", |_c: Caller<'_, VmState>| -> i32 { status::OK })?;
    linker.func_wrap(
        "env",
        "proxy_define_metric",
        |mut c: Caller<'_, VmState>, kind: i32, np: i32, nl: i32, ret: i32| -> Result<i32> {
            let name = read_str(&mut c, np, nl)?;
            let id = {
                let mut metrics = lock(&c.data().node.state.metrics);
                match metrics.iter().position(|m| m.name == name) {
                    Some(i) => i,
                    None => {
                        metrics.push(Metric { name, kind, value: 0 });
                        metrics.len() - 1
                    }
                }
            };
            write_u32(&mut c, ret, id as u32)?;
            Ok(status::OK)
        },
    )?;
    linker.func_wrap("env", "proxy_increment_metric", |c: Caller<'_, VmState>, id: i32, by: i64| -> i32 {
        match lock(&c.data().node.state.metrics).get_mut(id as u32 as usize) {
            Some(m) => {
                m.value = m.value.saturating_add(by);
                status::OK
            }
            None => status::NOT_FOUND,
        }
    })?;
    linker.func_wrap("env", "proxy_record_metric", |c: Caller<'_, VmState>, id: i32, v: i64| -> i32 {
        match lock(&c.data().node.state.metrics).get_mut(id as u32 as usize) {
            Some(m) => {
                m.value = v;
                status::OK
            }
            None => status::NOT_FOUND,
        }
    })?;
    linker.func_wrap("env", "proxy_get_metric", |mut c: Caller<'_, VmState>, id: i32, ret: i32| -> Result<i32> {
        let v = lock(&c.data().node.state.metrics).get(id as u32 as usize).map(|m| m.value);
        match v {
            Some(v) => {
                write_u64(&mut c, ret, v as u64)?;
                Ok(status::OK)
            }
            None => Ok(status::NOT_FOUND),
        }
    })?;
    linker.func_wrap(
        "env",
        "proxy_set_property",
        |_c: Caller<'_, VmState>, _a: i32, _b: i32, _d: i32, _e: i32| -> i32 { status::OK },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_buffer_bytes",
        |_c: Caller<'_, VmState>, _a: i32, _b: i32, _d: i32, _e: i32, _f: i32| -> i32 { status::BAD_ARGUMENT },
    )?;
    Ok(())
}

/// Minimal WASI shims for wasm32-wasip1 builds: output goes to the node log, the clock is
/// the virtual one, and the rest reports ENOSYS.
fn define_wasi(linker: &mut Linker<VmState>, m: &str, n: &str, ty: wasmtime::FuncType) -> Result<()> {
    const ENOSYS: i32 = 52;
    match n {
        "fd_write" => {
            linker.func_wrap(
                m,
                n,
                |mut c: Caller<'_, VmState>, _fd: i32, iovs: i32, len: i32, ret: i32| -> Result<i32> {
                    let mut total = 0u32;
                    let mut text = Vec::new();
                    for i in 0..len {
                        let iov = read(&mut c, iovs + i * 8, 8)?;
                        let (p, l) = (
                            u32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]),
                            u32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]),
                        );
                        text.extend(read(&mut c, p as i32, l as i32)?);
                        total += l;
                    }
                    lock(&c.data().node.state.logs).push((2, String::from_utf8_lossy(&text).into_owned()));
                    write_u32(&mut c, ret, total)?;
                    Ok(0)
                },
            )?;
        }
        "clock_time_get" => {
            linker.func_wrap(m, n, |mut c: Caller<'_, VmState>, _id: i32, _prec: i64, ret: i32| -> Result<i32> {
                let now = c.data().node.now();
                write_u64(&mut c, ret, now)?;
                Ok(0)
            })?;
        }
        "environ_sizes_get" | "args_sizes_get" => {
            linker.func_wrap(m, n, |mut c: Caller<'_, VmState>, a: i32, b: i32| -> Result<i32> {
                write_u32(&mut c, a, 0)?;
                write_u32(&mut c, b, 0)?;
                Ok(0)
            })?;
        }
        "proc_exit" => {
            linker
                .func_wrap(m, n, |_c: Caller<'_, VmState>, code: i32| -> Result<()> { bail!("proc_exit({code})") })?;
        }
        _ => {
            linker.func_new(m, n, ty, move |_c, _args, results| {
                if let Some(r) = results.first_mut() {
                    *r = Val::I32(ENOSYS);
                }
                Ok(())
            })?;
        }
    }
    Ok(())
}

impl Vm {
    /// Instantiates `plugin` as one VM of `node` and configures it with `config`. A rejected
    /// configuration is not an error here: check [`Vm::configure`]'s result or the logs.
    pub fn start(plugin: &Plugin, node: &Node, config: &[u8]) -> Result<Vm> {
        let state = VmState {
            node: node.clone(),
            plugin_config: config.to_vec(),
            request_headers: Vec::new(),
            response_headers: Vec::new(),
            source_address: None,
            local_replies: HashMap::new(),
            resumed: HashSet::new(),
            tick_period_ms: 0,
            callouts: Vec::new(),
            call_response: None,
            effective_context: 0,
            memory: None,
            alloc: None,
            pairs_without_pseudo_headers: false,
            request_headers_ns: None,
            scratch: Vec::new(),
        };
        let mut store = Store::new(&plugin.engine, state);
        // Fails, harmlessly, unless the engine meters fuel.
        let _ = store.set_fuel(u64::MAX);
        let mut linker = Linker::new(&plugin.engine);
        define_imports(&mut linker, &plugin.module)?;
        let instance = linker.instantiate(&mut store, &plugin.module)?;
        store.data_mut().memory = instance.get_memory(&mut store, "memory");
        store.data_mut().alloc = ["malloc", "proxy_on_memory_allocate"]
            .iter()
            .find_map(|n| instance.get_typed_func::<i32, i32>(&mut store, n).ok());
        let entries = Entries {
            context_create: instance.get_typed_func(&mut store, "proxy_on_context_create")?,
            request_headers: instance.get_typed_func(&mut store, "proxy_on_request_headers")?,
            response_headers: instance.get_typed_func(&mut store, "proxy_on_response_headers")?,
            done: instance.get_typed_func(&mut store, "proxy_on_done")?,
            log: instance.get_typed_func(&mut store, "proxy_on_log")?,
            delete: instance.get_typed_func(&mut store, "proxy_on_delete")?,
        };
        let mut vm = Vm { store, instance, entries, root: 1, next_context: 2, broken: None };
        for init in ["_initialize", "_start"] {
            if vm.instance.get_func(&mut vm.store, init).is_some() {
                vm.call(init, &[])?;
                break;
            }
        }
        vm.call("proxy_on_context_create", &[Val::I32(1), Val::I32(0)])?;
        if vm.instance.get_func(&mut vm.store, "proxy_on_vm_start").is_some() {
            vm.call("proxy_on_vm_start", &[Val::I32(1), Val::I32(0)])?;
        }
        vm.configure(config)?;
        Ok(vm)
    }

    /// Pushes a new plugin configuration (as Envoy does on an ECDS update); returns whether
    /// the plugin accepted it.
    pub fn configure(&mut self, config: &[u8]) -> Result<bool> {
        self.store.data_mut().plugin_config = config.to_vec();
        let root = self.root as i32;
        let r = self.call("proxy_on_configure", &[Val::I32(root), Val::I32(config.len() as i32)])?;
        Ok(r.first().and_then(Val::i32) == Some(1))
    }

    fn call(&mut self, name: &str, args: &[Val]) -> Result<Vec<Val>> {
        if let Some(why) = &self.broken {
            bail!("this VM trapped earlier and is unusable: {why}");
        }
        let func: Func =
            self.instance.get_func(&mut self.store, name).ok_or_else(|| format_err!("no export {name}"))?;
        let mut results = vec![Val::I32(0); func.ty(&self.store).results().len()];
        if let Err(e) = func.call(&mut self.store, args, &mut results) {
            let why = format!("{name} trapped: {e:#}");
            self.broken = Some(why.clone());
            return Err(format_err!(why));
        }
        Ok(results)
    }

    /// Starts a request: its headers go through the filter, which decides it now or pauses
    /// it (waiting for a callout it dispatched; see [`Vm::finish`]).
    pub fn begin(&mut self, req: &HttpRequest) -> Result<Started> {
        let ctx = self.next_context;
        self.next_context += 1;
        {
            let s = self.store.data_mut();
            // clone_from reuses the previous request's allocations.
            s.request_headers.clone_from(&req.headers);
            s.response_headers = Vec::new();
            s.source_address.clone_from(&req.source_address);
            s.effective_context = ctx;
        }
        let root = self.root as i32;
        let c = ctx as i32;
        self.guard(|s, e| e.context_create.call(s, (c, root)))?;
        let n = req.headers.len() as i32;
        let timed = self.store.data().request_headers_ns.is_some().then(std::time::Instant::now);
        let action = self.guard(|s, e| e.request_headers.call(s, (c, n, 1)))?;
        if let (Some(t), Some(times)) = (timed, self.store.data_mut().request_headers_ns.as_mut()) {
            times.push(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
        }
        let reply = self.store.data_mut().local_replies.remove(&ctx);
        if action == 1 && reply.is_none() {
            return Ok(Started::Paused(ctx));
        }
        self.complete(ctx, reply).map(Started::Done)
    }

    /// Runs a request through the filter: request headers, then (when it passes) an upstream
    /// `200` response's headers, then the end of the stream. A request the filter pauses
    /// without replying is an error here: see [`Vm::begin`].
    pub fn request(&mut self, req: &HttpRequest) -> Result<FilterResult> {
        match self.begin(req)? {
            Started::Done(r) => Ok(r),
            Started::Paused(_) => bail!("the filter paused the request without replying"),
        }
    }

    /// A paused request after the callouts it waits for were delivered: its result once the
    /// plugin replied or resumed it (`None`: still paused).
    pub fn finish(&mut self, ctx: u32) -> Result<Option<FilterResult>> {
        let s = self.store.data_mut();
        let reply = s.local_replies.remove(&ctx);
        if reply.is_none() && !s.resumed.remove(&ctx) {
            return Ok(None);
        }
        self.complete(ctx, reply).map(Some)
    }

    /// The rest of a request's life once its headers are decided: the upstream `200`
    /// response's headers when it passed, then the end of the stream.
    fn complete(&mut self, ctx: u32, reply: Option<LocalReply>) -> Result<FilterResult> {
        let c = ctx as i32;
        self.store.data_mut().effective_context = ctx;
        let result = if let Some(reply) = reply {
            FilterResult { status: reply.status, headers: reply.headers, body: reply.body, passed: false }
        } else {
            self.store.data_mut().response_headers = vec![(":status".into(), b"200".to_vec())];
            self.guard(|s, e| e.response_headers.call(s, (c, 1, 1)))?;
            let headers = std::mem::take(&mut self.store.data_mut().response_headers)
                .into_iter()
                .filter(|(k, _)| k != ":status")
                .map(|(k, v)| {
                    (k, String::from_utf8(v).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
                })
                .collect();
            FilterResult { status: 200, headers, body: Vec::new(), passed: true }
        };
        self.guard(|s, e| e.done.call(s, c))?;
        self.guard(|s, e| e.log.call(s, c))?;
        self.guard(|s, e| e.delete.call(s, c))?;
        self.store.data_mut().resumed.remove(&ctx);
        Ok(result)
    }

    /// Runs a typed guest call; a trap makes the VM unusable, as in Envoy.
    fn guard<R>(&mut self, f: impl FnOnce(&mut Store<VmState>, &Entries) -> Result<R>) -> Result<R> {
        if let Some(why) = &self.broken {
            bail!("this VM trapped earlier and is unusable: {why}");
        }
        f(&mut self.store, &self.entries).map_err(|e| {
            let why = format!("guest trapped: {e:#}");
            self.broken = Some(why.clone());
            format_err!(why)
        })
    }

    /// Runs the root context's tick.
    pub fn tick(&mut self) -> Result<()> {
        let root = self.root as i32;
        self.store.data_mut().effective_context = self.root;
        self.call("proxy_on_tick", &[Val::I32(root)]).map(|_| ())
    }

    /// The tick period the plugin asked for (0: none).
    pub fn tick_period_ms(&self) -> u32 {
        self.store.data().tick_period_ms
    }

    /// Takes the HTTP calls dispatched since the last call.
    pub fn take_callouts(&mut self) -> Vec<Callout> {
        std::mem::take(&mut self.store.data_mut().callouts)
    }

    /// Delivers the response to a callout (`None`: it failed or timed out, as Envoy reports
    /// with zero headers and an empty body).
    pub fn deliver(&mut self, callout: &Callout, response: Option<(u16, Vec<u8>)>) -> Result<()> {
        match response {
            Some((status, body)) => self.respond(callout, status, &[], body),
            None => self.deliver_headers(callout, Vec::new(), Vec::new()),
        }
    }

    /// Delivers a response with headers besides `:status`.
    pub fn respond(&mut self, callout: &Callout, status: u16, headers: &[(&str, &[u8])], body: Vec<u8>) -> Result<()> {
        let mut all = vec![(":status".to_owned(), status.to_string().into_bytes())];
        all.extend(headers.iter().map(|(k, v)| ((*k).to_owned(), v.to_vec())));
        self.deliver_headers(callout, all, body)
    }

    fn deliver_headers(&mut self, callout: &Callout, headers: Vec<(String, Vec<u8>)>, body: Vec<u8>) -> Result<()> {
        let (nh, nb) = (headers.len() as i32, body.len() as i32);
        self.store.data_mut().call_response = Some((headers, body));
        self.store.data_mut().effective_context = callout.context;
        let r = self.call(
            "proxy_on_http_call_response",
            &[
                Val::I32(callout.context as i32),
                Val::I32(callout.token as i32),
                Val::I32(nh),
                Val::I32(nb),
                Val::I32(0),
            ],
        );
        self.store.data_mut().call_response = None;
        r.map(|_| ())
    }

    /// From now on list request headers (`proxy_get_header_map_pairs`) without the
    /// pseudo-headers, as some hosts do; they stay readable one by one.
    pub fn list_headers_without_pseudo_headers(&mut self) {
        self.store.data_mut().pairs_without_pseudo_headers = true;
    }

    /// From now on time each `proxy_on_request_headers` call (the request-headers callback
    /// alone, without the context's creation, the response and the end of the stream).
    pub fn time_request_headers(&mut self) {
        self.store.data_mut().request_headers_ns = Some(Vec::new());
    }

    /// The times recorded since [`Vm::time_request_headers`], in ns; recording goes on.
    pub fn take_request_headers_times(&mut self) -> Vec<u64> {
        self.store.data_mut().request_headers_ns.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The guest's linear memory, in bytes.
    pub fn memory_bytes(&self) -> usize {
        self.store.data().memory.map_or(0, |m| m.data_size(&self.store))
    }

    /// Wasm instructions the guest has run (a [`Plugin::metered`] plugin; else 0).
    pub fn fuel_used(&self) -> u64 {
        self.store.get_fuel().map_or(0, |left| u64::MAX - left)
    }

    /// The node this VM belongs to.
    pub fn node(&self) -> &Node {
        &self.store.data().node
    }
}
