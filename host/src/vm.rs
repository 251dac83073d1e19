//! A VM (one worker thread's instance of the plugin): its state, and the calls into the
//! guest — configure, requests, ticks, call answers.

use crate::imports::define_imports;
use crate::node::*;
use std::collections::{HashMap, HashSet};
use wasmtime::{bail, format_err, Func, Instance, Linker, Memory, Result, Store, TypedFunc, Val};

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

/// What became of a request a host forwards to a real upstream ([`Vm::begin_forwarded`]).
#[derive(Debug)]
pub enum Forward {
    /// Answered by the filter (its local reply); the stream has ended.
    Answered(FilterResult),
    /// Passed: to be sent upstream now, its context id for [`Vm::upstream_response`] and
    /// [`Vm::done`] (or [`Vm::abort`] when its client goes away).
    Upstream(u32),
    /// Paused (an ask, a leaky bucket's turn): its context id, for [`Vm::resumed`].
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
pub(crate) struct LocalReply {
    pub(crate) status: u32,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Vec<u8>,
}

/// Header fields as the host keeps them: lower-case names, raw values.
pub type HeaderMap = Vec<(String, Vec<u8>)>;

/// Per-VM host state.
pub(crate) struct VmState {
    pub(crate) node: Node,
    pub(crate) plugin_config: Vec<u8>,
    /// The VM configuration (Envoy's `vm_config.configuration`, ngx_wasm_module's `module`
    /// directive's third argument), read at `proxy_on_vm_start`.
    pub(crate) vm_config: Vec<u8>,
    pub(crate) request_headers: Vec<(String, Vec<u8>)>,
    pub(crate) response_headers: Vec<(String, Vec<u8>)>,
    pub(crate) source_address: Option<String>,
    /// Local replies sent, by context.
    pub(crate) local_replies: HashMap<u32, LocalReply>,
    /// Paused contexts the plugin resumed (`proxy_continue_stream`).
    pub(crate) resumed: HashSet<u32>,
    /// The tick period each root context set (0 or absent: none).
    pub(crate) tick_periods: HashMap<u32, u32>,
    /// The live root contexts: the one new requests go to and, under Envoy, those whose
    /// filter chains still drain after a configuration push.
    pub(crate) roots: Vec<u32>,
    /// The root context of each live request context.
    pub(crate) request_roots: HashMap<u32, u32>,
    pub(crate) callouts: Vec<Callout>,
    pub(crate) call_response: Option<(HeaderMap, Vec<u8>)>,
    pub(crate) effective_context: u32,
    /// The context whose callback is running (ngx_wasm_module checks this one, not the
    /// effective context).
    pub(crate) current: u32,
    /// The guest's memory and allocator, looked up once after instantiation.
    pub(crate) memory: Option<Memory>,
    pub(crate) alloc: Option<TypedFunc<i32, i32>>,
    /// Behave like a host whose header-map listing leaves out the pseudo-headers.
    pub(crate) pairs_without_pseudo_headers: bool,
    /// When set, the time of each `proxy_on_request_headers` call, in ns.
    pub(crate) request_headers_ns: Option<Vec<u64>>,
    /// A buffer reused by the host calls that copy bytes into the guest.
    pub(crate) scratch: Vec<u8>,
    /// Append the peer's address to `x-forwarded-for` before the filter runs, as Envoy's
    /// connection manager does with `use_remote_address: true`.
    pub(crate) envoy_xff: bool,
}

impl VmState {
    /// Whether `ctx` is a root context.
    pub(crate) fn is_root(&self, ctx: u32) -> bool {
        self.roots.contains(&ctx)
    }

    /// The root context of `ctx` (itself for a root).
    pub(crate) fn root_of(&self, ctx: u32) -> u32 {
        self.request_roots.get(&ctx).copied().unwrap_or(ctx)
    }
}

/// The guest entry points called per request, looked up once.
pub(crate) struct Entries {
    pub(crate) context_create: TypedFunc<(i32, i32), ()>,
    pub(crate) request_headers: TypedFunc<(i32, i32, i32), i32>,
    pub(crate) response_headers: TypedFunc<(i32, i32, i32), i32>,
    pub(crate) done: TypedFunc<i32, i32>,
    pub(crate) log: TypedFunc<i32, ()>,
    pub(crate) delete: TypedFunc<i32, ()>,
}

/// One VM (one worker thread) of a node, with the plugin instantiated and configured.
///
/// Under Envoy a configuration push is what proxy-wasm-cpp-host does with a new plugin
/// configuration (its plugin key is the root id and the configuration): first a canary — a
/// fresh instance of the module that starts a root context and runs `on_configure` with the
/// new configuration, its verdict cached per configuration for the node — and the push is
/// refused when that answers false (the running root context serves on); then, in this same
/// instance, a new root context (a new context id: `on_context_create`, `on_vm_start`,
/// `on_configure`) that new requests go to, while the previous root context lives on until
/// the requests it holds are done (its filter chain drains), and then ends (`on_done`,
/// `on_delete`). Pushing a configuration whose root context still lives makes that one
/// current again, with no call into the guest (the thread-local plugin is cached by key).
pub struct Vm {
    pub(crate) store: Store<VmState>,
    pub(crate) instance: Instance,
    pub(crate) entries: Entries,
    /// The root context new requests go to.
    pub(crate) root: u32,
    pub(crate) next_context: u32,
    pub(crate) broken: Option<String>,
    plugin: Plugin,
    /// The plugin configuration of each live root context.
    configs: Vec<(u32, Vec<u8>)>,
    /// The root contexts that have ended.
    ended_roots: HashSet<u32>,
}

impl Vm {
    /// Instantiates `plugin` as one VM of `node` and configures it with `config`. Under Envoy a
    /// configuration whose canary answers false is refused (an error: Envoy creates no filter
    /// from it); under ngx_wasm_module a false answer is fatal to the worker (an error too).
    pub fn start(plugin: &Plugin, node: &Node, config: &[u8]) -> Result<Vm> {
        Vm::start_with_vm_config(plugin, node, &[], config)
    }

    /// [`Vm::start`] with a VM configuration, which the plugin reads when its VM starts.
    pub fn start_with_vm_config(plugin: &Plugin, node: &Node, vm_config: &[u8], config: &[u8]) -> Result<Vm> {
        if !node.profile().is_nginx() && !canary(plugin, node, vm_config, config) {
            bail!("Envoy refuses the plugin configuration: on_configure returned false in its canary");
        }
        let mut vm = Vm::instantiate(plugin, node, vm_config)?;
        if !vm.start_root(1, config)? {
            bail!("on_configure returned false after the canary accepted the configuration");
        }
        vm.configs.push((1, config.to_vec()));
        Ok(vm)
    }

    /// A fresh instance of `plugin` (initialized, no context yet).
    fn instantiate(plugin: &Plugin, node: &Node, vm_config: &[u8]) -> Result<Vm> {
        let state = VmState {
            node: node.clone(),
            plugin_config: Vec::new(),
            vm_config: vm_config.to_vec(),
            request_headers: Vec::new(),
            response_headers: Vec::new(),
            source_address: None,
            local_replies: HashMap::new(),
            resumed: HashSet::new(),
            tick_periods: HashMap::new(),
            roots: Vec::new(),
            request_roots: HashMap::new(),
            callouts: Vec::new(),
            call_response: None,
            effective_context: 0,
            current: 1,
            memory: None,
            alloc: None,
            pairs_without_pseudo_headers: false,
            envoy_xff: false,
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
        let mut vm = Vm {
            store,
            instance,
            entries,
            root: 1,
            next_context: 2,
            broken: None,
            plugin: plugin.clone(),
            configs: Vec::new(),
            ended_roots: HashSet::new(),
        };
        for init in ["_initialize", "_start"] {
            if vm.instance.get_func(&mut vm.store, init).is_some() {
                vm.call(init, &[])?;
                break;
            }
        }
        Ok(vm)
    }

    /// Starts root context `id` with plugin configuration `config` (`on_context_create`,
    /// `on_vm_start`, `on_configure`) and makes it the one new requests go to when the
    /// plugin accepts the configuration; returns whether it did. Under ngx_wasm_module a
    /// false answer is fatal: the worker exits and cannot be respawned, so this is an error
    /// and the VM is unusable.
    fn start_root(&mut self, id: u32, config: &[u8]) -> Result<bool> {
        self.store.data_mut().plugin_config = config.to_vec();
        self.store.data_mut().roots.push(id);
        self.enter(id);
        let root = id as i32;
        self.call("proxy_on_context_create", &[Val::I32(root), Val::I32(0)])?;
        if self.instance.get_func(&mut self.store, "proxy_on_vm_start").is_some() {
            let size = self.store.data().vm_config.len() as i32;
            let r = self.call("proxy_on_vm_start", &[Val::I32(root), Val::I32(size)])?;
            if r.first().and_then(Val::i32) == Some(0) {
                let why = "on_vm_start returned false: the VM failed to start".to_owned();
                self.broken = Some(why.clone());
                bail!(why);
            }
        }
        let r = self.call("proxy_on_configure", &[Val::I32(root), Val::I32(config.len() as i32)])?;
        let accepted = r.first().and_then(Val::i32) == Some(1);
        if !accepted && self.node().profile().is_nginx() {
            let why = "on_configure returned false: worker process exited with fatal code 2 and cannot be respawned";
            self.broken = Some(why.to_owned());
            bail!(why);
        }
        if accepted {
            self.root = id;
        } else {
            self.store.data_mut().roots.retain(|r| *r != id);
        }
        Ok(accepted)
    }

    /// Pushes a new plugin configuration, as Envoy does on an ECDS / xDS update (see [`Vm`]):
    /// whether it took effect (false: its canary refused it, and the running root context
    /// serves on). The configuration in force again: nothing happens. Under ngx_wasm_module,
    /// which configures a VM once, an error: a new configuration comes with a reload and new
    /// VMs ([`Node::reload`]).
    pub fn configure(&mut self, config: &[u8]) -> Result<bool> {
        if self.node().profile().is_nginx() {
            bail!("ngx_wasm_module configures a VM once: a new configuration comes with a reload and new VMs");
        }
        if self.configs.iter().any(|(id, c)| *id == self.root && c == config) {
            return Ok(true);
        }
        let vm_config = self.store.data().vm_config.clone();
        if !canary(&self.plugin, self.node(), &vm_config, config) {
            return Ok(false);
        }
        let previous = self.root;
        if let Some(&(id, _)) = self.configs.iter().find(|(_, c)| c == config) {
            self.root = id;
        } else {
            let id = self.next_context;
            self.next_context += 1;
            if !self.start_root(id, config)? {
                bail!(
                    "on_configure returned false after its canary accepted it: Envoy fails the plugin on this worker"
                );
            }
            self.configs.push((id, config.to_vec()));
        }
        self.drained(previous)?;
        Ok(true)
    }

    /// The live root contexts, the one new requests go to last.
    pub fn root_contexts(&self) -> Vec<u32> {
        let mut roots: Vec<u32> = self.configs.iter().map(|(id, _)| *id).filter(|id| *id != self.root).collect();
        roots.push(self.root);
        roots
    }

    /// Ends root context `root` when it no longer serves: not the current one, and no
    /// request of it in flight (Envoy's plugin handle is released once its filter chains
    /// have drained): `on_done`, then `on_delete` (the guest answers `on_done` true; a root
    /// that answers false would wait for `proxy_done`, which ratewall does not call).
    fn drained(&mut self, root: u32) -> Result<()> {
        if root == self.root || self.store.data().request_roots.values().any(|r| *r == root) {
            return Ok(());
        }
        if !self.configs.iter().any(|(id, _)| *id == root) {
            return Ok(());
        }
        self.configs.retain(|(id, _)| *id != root);
        self.ended_roots.insert(root);
        let c = root as i32;
        self.enter(root);
        self.guard(|s, e| e.done.call(s, c))?;
        self.guard(|s, e| e.delete.call(s, c))?;
        let s = self.store.data_mut();
        s.roots.retain(|r| *r != root);
        s.tick_periods.remove(&root);
        Ok(())
    }

    /// Marks `ctx` as the context whose callback runs next (and the effective one).
    fn enter(&mut self, ctx: u32) {
        let s = self.store.data_mut();
        s.current = ctx;
        s.effective_context = ctx;
    }

    pub(crate) fn call(&mut self, name: &str, args: &[Val]) -> Result<Vec<Val>> {
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
        self.start_request(req, false)
    }

    /// Starts a request whose upstream answers later: when the filter passes it, it stays
    /// in flight (`Started::Paused`) until [`Vm::finish_upstream`] (its response comes) or
    /// [`Vm::abort`] (its stream is reset).
    pub fn begin_in_flight(&mut self, req: &HttpRequest) -> Result<Started> {
        self.start_request(req, true)
    }

    /// A request the filter paused that the host runs on all the same, as ngx_wasm_module
    /// does with a request on a kept-alive connection paused in NGINX's rewrite phase: its
    /// upstream's response goes to the client without the filter's `on_response_headers`
    /// (the module takes the pause as still in force), then the request ends.
    pub fn run_on(&mut self, ctx: u32) -> Result<()> {
        self.store.data_mut().response_headers = vec![(":status".into(), b"200".to_vec())];
        self.end(ctx)
    }

    /// The upstream response of a request started with [`Vm::begin_in_flight`].
    pub fn finish_upstream(&mut self, ctx: u32) -> Result<FilterResult> {
        self.complete(ctx, None)
    }

    /// Starts a request a host sends to a real upstream once the filter passes it, as a
    /// proxy does: its headers go through the filter, which answers it, passes it, or
    /// pauses it.
    pub fn begin_forwarded(&mut self, req: &HttpRequest) -> Result<Forward> {
        let (ctx, action, reply) = self.request_headers(req)?;
        Ok(match reply {
            Some(reply) => Forward::Answered(self.complete(ctx, Some(reply))?),
            None if action == 1 => Forward::Paused(ctx),
            None => Forward::Upstream(ctx),
        })
    }

    /// A request [`Vm::begin_forwarded`] paused, once the callouts it waits for were
    /// delivered or its turn came: answered, resumed (to be sent upstream), or still paused
    /// (`None`).
    pub fn resumed(&mut self, ctx: u32) -> Result<Option<Forward>> {
        let s = self.store.data_mut();
        if let Some(reply) = s.local_replies.remove(&ctx) {
            return self.complete(ctx, Some(reply)).map(|r| Some(Forward::Answered(r)));
        }
        Ok(s.resumed.remove(&ctx).then_some(Forward::Upstream(ctx)))
    }

    /// The upstream's response to a forwarded request: its status and headers go through the
    /// filter's `on_response_headers`; the headers to send the client are returned (the
    /// upstream's, with what the filter added, without those it removed; `:status` left
    /// out). The stream goes on until [`Vm::done`].
    pub fn upstream_response(
        &mut self,
        ctx: u32,
        status: u16,
        headers: &[(String, String)],
    ) -> Result<Vec<(String, String)>> {
        let c = ctx as i32;
        self.enter(ctx);
        let mut sent = vec![(":status".to_owned(), status.to_string().into_bytes())];
        sent.extend(headers.iter().map(|(k, v)| (k.to_ascii_lowercase(), v.clone().into_bytes())));
        let n = sent.len() as i32;
        self.store.data_mut().response_headers = sent;
        self.guard(|s, e| e.response_headers.call(s, (c, n, 1)))?;
        Ok(std::mem::take(&mut self.store.data_mut().response_headers)
            .into_iter()
            .filter(|(k, _)| k != ":status")
            .map(|(k, v)| {
                (k, String::from_utf8(v).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
            })
            .collect())
    }

    /// The end of a forwarded request's stream once its response was sent: its done, log and
    /// delete callbacks (a concurrency slot goes back here).
    pub fn done(&mut self, ctx: u32) -> Result<()> {
        self.end(ctx)
    }

    fn start_request(&mut self, req: &HttpRequest, in_flight: bool) -> Result<Started> {
        let (ctx, action, reply) = self.request_headers(req)?;
        if (action == 1 || in_flight) && reply.is_none() {
            return Ok(Started::Paused(ctx));
        }
        self.complete(ctx, reply).map(Started::Done)
    }

    /// A new request's context and its request headers through the filter: the context, the
    /// filter's action (1: pause) and its local reply, if it made one.
    fn request_headers(&mut self, req: &HttpRequest) -> Result<(u32, i32, Option<LocalReply>)> {
        let ctx = self.next_context;
        self.next_context += 1;
        {
            let s = self.store.data_mut();
            // clone_from reuses the previous request's allocations.
            s.request_headers.clone_from(&req.headers);
            if s.envoy_xff {
                envoy_append_peer(&mut s.request_headers, req.source_address.as_deref());
            }
            s.response_headers = Vec::new();
            s.source_address.clone_from(&req.source_address);
            s.effective_context = ctx;
            s.current = ctx;
        }
        let root = self.root;
        self.store.data_mut().request_roots.insert(ctx, root);
        let (c, root) = (ctx as i32, root as i32);
        self.guard(|s, e| e.context_create.call(s, (c, root)))?;
        let n = req.headers.len() as i32;
        let timed = self.store.data().request_headers_ns.is_some().then(std::time::Instant::now);
        let action = self.guard(|s, e| e.request_headers.call(s, (c, n, 1)))?;
        if let (Some(t), Some(times)) = (timed, self.store.data_mut().request_headers_ns.as_mut()) {
            times.push(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
        }
        let reply = self.store.data_mut().local_replies.remove(&ctx);
        Ok((ctx, action, reply))
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

    /// A paused request whose client went away (the stream was reset): the end of its
    /// stream without a response, as Envoy ends it.
    pub fn abort(&mut self, ctx: u32) -> Result<()> {
        self.end(ctx)
    }

    /// The end of request `ctx`'s stream: its done, log and delete callbacks.
    fn end(&mut self, ctx: u32) -> Result<()> {
        let c = ctx as i32;
        self.enter(ctx);
        self.guard(|s, e| e.done.call(s, c))?;
        self.guard(|s, e| e.log.call(s, c))?;
        self.guard(|s, e| e.delete.call(s, c))?;
        self.ended(ctx)
    }

    /// Request context `ctx` was deleted: its root context ends with it if it was draining.
    fn ended(&mut self, ctx: u32) -> Result<()> {
        // No request callback runs now: calls made from outside one are the root's.
        self.enter(self.root);
        let s = self.store.data_mut();
        s.resumed.remove(&ctx);
        match s.request_roots.remove(&ctx) {
            Some(root) => self.drained(root),
            None => Ok(()),
        }
    }

    /// The rest of a request's life once its headers are decided: the upstream `200`
    /// response's headers when it passed, then the end of the stream.
    fn complete(&mut self, ctx: u32, reply: Option<LocalReply>) -> Result<FilterResult> {
        self.enter(ctx);
        let result = if let Some(reply) = reply {
            FilterResult { status: reply.status, headers: reply.headers, body: reply.body, passed: false }
        } else {
            let headers = self.upstream_response(ctx, 200, &[])?;
            FilterResult { status: 200, headers, body: Vec::new(), passed: true }
        };
        self.end(ctx)?;
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

    /// Runs the root context's tick, and that of every root context still draining that set
    /// a tick period (each root context has its own timer).
    pub fn tick(&mut self) -> Result<()> {
        for root in self.root_contexts() {
            let period = self.store.data().tick_periods.get(&root).copied().unwrap_or(0);
            if root != self.root && period == 0 {
                continue;
            }
            self.enter(root);
            self.call("proxy_on_tick", &[Val::I32(root as i32)])?;
        }
        Ok(())
    }

    /// The shortest tick period a live root context asked for (0: none).
    pub fn tick_period_ms(&self) -> u32 {
        let s = self.store.data();
        s.roots.iter().filter_map(|r| s.tick_periods.get(r).copied()).filter(|p| *p != 0).min().unwrap_or(0)
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
        // A root context that has ended had its calls cancelled (Envoy cancels a context's
        // pending calls when it is destroyed): no answer reaches the guest.
        if self.ended_roots.contains(&callout.context) {
            return Ok(());
        }
        let (nh, nb) = (headers.len() as i32, body.len() as i32);
        self.store.data_mut().call_response = Some((headers, body));
        self.enter(callout.context);
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

    /// Mutates every request's headers as Envoy's HTTP connection manager does with
    /// `use_remote_address: true` before any filter runs: the peer's address (without its
    /// port) is appended to `x-forwarded-for`, which is created when absent.
    pub fn append_peer_to_xff_as_envoy(&mut self) {
        self.store.data_mut().envoy_xff = true;
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

    /// Why the VM is unusable (it trapped, or its start or configuration failed fatally).
    pub fn trapped(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// The node this VM belongs to.
    pub fn node(&self) -> &Node {
        &self.store.data().node
    }
}

/// proxy-wasm-cpp-host's configuration canary (`WasmHandleBase::canary`): a fresh instance of
/// `plugin` — none of a running instance's memory — starts a root context with `config` and
/// runs its `on_configure`; the configuration is accepted when that answers true, and a
/// failed start or a trap refuses it. The verdict is cached per configuration for the node
/// (the process), so the canary runs once per plugin configuration; the instance is then
/// dropped with nothing more called in it. Its host calls (logs, metrics) are the node's.
fn canary(plugin: &Plugin, node: &Node, vm_config: &[u8], config: &[u8]) -> bool {
    let key = (plugin.id, vm_config.to_vec(), config.to_vec());
    if let Some(verdict) = lock(&node.state.canaries).get(&key) {
        return *verdict;
    }
    let verdict = match Vm::instantiate(plugin, node, vm_config) {
        Ok(mut vm) => vm.start_root(1, config).unwrap_or(false),
        Err(_) => false,
    };
    lock(&node.state.canaries).insert(key, verdict);
    verdict
}

/// Envoy's append of the downstream peer (`address:port`, `[v6]:port` or a bare address) to
/// `x-forwarded-for`: to its last field, after `", "`, or as a new field.
fn envoy_append_peer(headers: &mut Vec<(String, Vec<u8>)>, peer: Option<&str>) {
    let Some(peer) = peer else { return };
    let addr = match peer.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(v6),
        None if peer.matches(':').count() == 1 => peer.split(':').next().unwrap_or(peer),
        None => peer,
    };
    match headers.iter_mut().rev().find(|(n, _)| n == "x-forwarded-for") {
        Some((_, v)) => {
            v.extend_from_slice(b", ");
            v.extend_from_slice(addr.as_bytes());
        }
        None => headers.push(("x-forwarded-for".to_owned(), addr.as_bytes().to_vec())),
    }
}
