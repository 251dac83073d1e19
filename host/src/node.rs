//! A node (one proxy process): the compiled plugin, shared data with its host's semantics
//! (Envoy's or ngx_wasm_module's, see [`Profile`]), metrics, the clock, logs and the calls
//! its VMs dispatch.

use crate::abi::*;
use rustc_hash::FxHashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use wasmtime::{bail, format_err, Engine, Module, Result};

/// Where the built filter lives, relative to the workspace.
pub fn filter_wasm_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../dist/ratewall_filter.wasm")
}

/// A compiled module, shared by every VM (compiling once per process keeps tests fast).
#[derive(Clone)]
pub struct Plugin {
    pub(crate) engine: Engine,
    pub(crate) module: Module,
    /// Tells plugins apart (a node's configuration canaries are cached per plugin).
    pub(crate) id: u64,
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
        static PLUGINS: AtomicU64 = AtomicU64::new(0);
        Ok(Plugin { engine, module, id: PLUGINS.fetch_add(1, Ordering::SeqCst) })
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

/// A proxy's metrics, found by name as a proxy finds them (a map: a search through the list
/// made a document of 1,000 rules, 6,000 metrics, take half a second to configure, while
/// every request that counted waited for the list).
#[derive(Default)]
pub(crate) struct Metrics {
    list: Vec<Metric>,
    by_name: FxHashMap<String, usize>,
}

impl Metrics {
    /// The id of metric `name`, defined now if it is new.
    pub(crate) fn define(&mut self, name: String, kind: i32) -> usize {
        if let Some(&id) = self.by_name.get(&name) {
            return id;
        }
        self.list.push(Metric { name: name.clone(), kind, value: 0 });
        self.by_name.insert(name, self.list.len() - 1);
        self.list.len() - 1
    }

    pub(crate) fn get(&self, id: usize) -> Option<&Metric> {
        self.list.get(id)
    }

    pub(crate) fn get_mut(&mut self, id: usize) -> Option<&mut Metric> {
        self.list.get_mut(id)
    }
}

/// Which proxy a node behaves as, where proxies differ in what a filter can observe.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Profile {
    /// Envoy: a missing key reads as NotFound and a set with `cas = 0` is unconditional; any
    /// context may set the root's tick period; `set_effective_context` switches the context
    /// that `continue_stream` resumes; a configuration push starts a new root context in the
    /// running instance after a canary in a fresh one, and is refused when the canary's
    /// `on_configure` answers false ([`crate::Vm`]).
    #[default]
    Envoy,
    /// NGINX with Kong's ngx_wasm_module (0.6): `cas = 0` means "only if absent" (and a
    /// missing key takes only `cas = 0`); without a `shm_kv` zone every shared-data call
    /// traps; the tick period is set only from the root context, and a non-zero period
    /// replacing another traps; `set_effective_context` does nothing and `continue_stream`
    /// resumes only the context whose callback runs; `http_call` takes `host:port` only;
    /// scoped properties (`node.id`, ...) fail outside a request; `proxy_done`,
    /// `proxy_close_stream`, `proxy_get_status` and the gRPC calls trap; `on_configure` or
    /// `on_vm_start` returning false (or trapping) is fatal to the worker; a reload brings
    /// fresh VMs and an empty `shm_kv` zone ([`Node::reload`]).
    Nginx {
        /// Whether `wasm { shm_kv * SIZE; }` is configured.
        shm_kv: bool,
    },
}

impl Profile {
    /// ngx_wasm_module with a `shm_kv` zone, as `envoy-config/nginx.conf` configures it.
    pub const NGINX: Profile = Profile::Nginx { shm_kv: true };

    /// Whether this is ngx_wasm_module.
    pub fn is_nginx(self) -> bool {
        matches!(self, Profile::Nginx { .. })
    }
}

/// What one proxy process shares between its VMs.
#[derive(Default)]
pub struct NodeState {
    /// The proxy it behaves as (a reload may change its configuration).
    pub(crate) profile: Mutex<Profile>,
    /// Keys hashed with FxHash, as a proxy's own maps use a fast hash (Envoy: absl's).
    pub(crate) shared: Mutex<FxHashMap<String, (Vec<u8>, u32)>>,
    pub(crate) next_cas: AtomicU32,
    pub(crate) metrics: Mutex<Metrics>,
    pub(crate) clock: AtomicU64,
    pub(crate) logs: Mutex<Vec<(i32, String)>>,
    pub(crate) next_token: AtomicU32,
    /// Fault injection: every conditional shared-data write fails with CasMismatch.
    pub(crate) cas_always_fails: std::sync::atomic::AtomicBool,
    /// The `node.id` property (Envoy's `--service-node`): unique per node.
    pub(crate) id: std::sync::OnceLock<String>,
    /// Envoy's configuration canaries' verdicts, by plugin, VM configuration and plugin
    /// configuration.
    pub(crate) canaries: Mutex<std::collections::HashMap<Canary, bool>>,
}

/// What a configuration canary's verdict is cached by: the plugin, the VM configuration and
/// the plugin configuration.
pub(crate) type Canary = (u64, Vec<u8>, Vec<u8>);

pub(crate) static NODES: AtomicU64 = AtomicU64::new(0);

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

/// Most log lines a node keeps: past them the oldest half goes, so a node whose lines
/// nothing takes stays bounded.
pub const MAX_LOGS: usize = 10_000;

impl NodeState {
    /// Keeps a log line, within [`MAX_LOGS`].
    pub(crate) fn log(&self, level: i32, message: String) {
        let mut logs = lock(&self.logs);
        if logs.len() >= MAX_LOGS {
            logs.drain(..MAX_LOGS / 2);
        }
        logs.push((level, message));
    }
}

/// One proxy process: shared data, metrics, clock and logs shared by its [`Vm`]s.
#[derive(Clone, Default)]
pub struct Node {
    pub(crate) state: Arc<NodeState>,
}

impl Node {
    /// A node with its clock at `now` (nanoseconds since the epoch), behaving as Envoy.
    pub fn new(now: u64) -> Node {
        Node::with_profile(now, Profile::Envoy)
    }

    /// A node behaving as `profile`.
    pub fn with_profile(now: u64, profile: Profile) -> Node {
        let node = Node { state: Arc::new(NodeState { profile: Mutex::new(profile), ..NodeState::default() }) };
        let _ = node.state.id.set(format!("node-{}", NODES.fetch_add(1, Ordering::SeqCst)));
        node.set_time(now);
        node
    }
    /// A node with its clock at `now` and the `node.id` property `id` (a simulation names its
    /// nodes, so its figures do not depend on how many nodes were made before it).
    pub fn named(now: u64, id: &str) -> Node {
        let node = Node { state: Arc::new(NodeState { profile: Mutex::new(Profile::Envoy), ..NodeState::default() }) };
        let _ = node.state.id.set(id.to_owned());
        node.set_time(now);
        node
    }

    /// The proxy this node behaves as.
    pub fn profile(&self) -> Profile {
        *lock(&self.state.profile)
    }

    /// A configuration reload (`nginx -s reload`): under ngx_wasm_module the new workers get a
    /// fresh, empty `shm_kv` zone (start new [`crate::Vm`]s for them), while its metrics zone
    /// is reused, values and all; under Envoy a configuration push keeps shared data, so
    /// nothing changes here.
    pub fn reload(&self) {
        if self.profile().is_nginx() {
            lock(&self.state.shared).clear();
        }
    }

    /// A reload after the proxy's own configuration was edited to behave as `profile` (for
    /// ngx_wasm_module, a `shm_kv` directive added or removed).
    pub fn reload_as(&self, profile: Profile) {
        *lock(&self.state.profile) = profile;
        self.reload();
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
        let metrics = lock(&self.state.metrics);
        metrics.by_name.get(name).and_then(|&id| metrics.get(id)).map_or(0, |m| m.value)
    }
    /// Every metric.
    pub fn metrics(&self) -> Vec<Metric> {
        lock(&self.state.metrics).list.clone()
    }
    /// Log lines `(level, message)` kept (the last [`MAX_LOGS`] at most).
    pub fn logs(&self) -> Vec<(i32, String)> {
        lock(&self.state.logs).clone()
    }
    /// Log lines `(level, message)` kept, taken: a proxy writes them out as they come.
    pub fn take_logs(&self) -> Vec<(i32, String)> {
        std::mem::take(&mut *lock(&self.state.logs))
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
    /// a missing key is inserted whatever `cas` is. ngx_wasm_module's: the CAS given must be
    /// the key's (0 for a missing key), so `cas = 0` on an existing key is a CasMismatch.
    pub(crate) fn shared_set(&self, key: &str, value: &[u8], cas: u32) -> i32 {
        if cas != 0 && self.state.cas_always_fails.load(Ordering::SeqCst) {
            return status::CAS_MISMATCH;
        }
        let nginx = self.profile().is_nginx();
        let mut map = lock(&self.state.shared);
        let next = self.state.next_cas.fetch_add(1, Ordering::SeqCst).wrapping_add(1).max(1);
        match map.get_mut(key) {
            Some(entry) if nginx && cas != entry.1 => status::CAS_MISMATCH,
            None if nginx && cas != 0 => status::CAS_MISMATCH,
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

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
