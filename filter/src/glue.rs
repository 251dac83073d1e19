//! The thin proxy-wasm layer: implements [`Host`] with the SDK's host calls (the variants
//! that return errors rather than panic) and wires contexts to the [`Engine`].

use crate::engine::{Asking, Engine, Slots, Turn, Verdict, Waiting, FALLBACK_LOG_EVERY, FALLBACK_METRIC};
use crate::host::{Host, Level, SetError};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};
use ratewall_core::Nanos;
use std::cell::{Cell, RefCell};
use std::rc::Rc;

/// How often the root ticks under rules that shape (a leaky bucket): a waiting request is
/// resumed within this of its turn.
const WAIT_TICK: Nanos = 5_000_000;

/// The requests of this VM waiting their turn in a leaky bucket.
#[derive(Default)]
struct WaitList {
    /// (context id, when it goes, its turns: a waiter ahead that leaves moves it up).
    list: Vec<(u32, Nanos, Vec<Turn>)>,
}

type Waiters = Rc<RefCell<WaitList>>;

/// What a root context does while no rules are in force (its document was rejected and the VM
/// has no good rules to serve instead): it serves, open by default, or closed (503) when the
/// VM configuration says `{"without_rules": "closed"}`; either way every such request is
/// counted in `ratewall_config_rejected` and the rejection is said at error level, at most
/// every [`FALLBACK_LOG_EVERY`], until good rules arrive.
#[derive(Default)]
struct Fallback {
    metric: Cell<Option<u32>>,
    /// Why the rules were rejected (None: rules are in force, or none were given yet).
    why: RefCell<Option<String>>,
    /// Why they were rejected, while the VM's last good rules are taken to serve instead:
    /// becomes `why` should the host turn out to be ngx_wasm_module (see
    /// `Request::on_http_request_headers`).
    standby: RefCell<Option<String>>,
    logged: Cell<Option<Nanos>>,
}

impl Fallback {
    /// Says at error level, at most every [`FALLBACK_LOG_EVERY`], that no rules are in force.
    fn say(&self) {
        let Some(why) = self.why.borrow().clone() else { return };
        let now = ProxyHost.now();
        if !crate::engine::due(&self.logged, now, FALLBACK_LOG_EVERY) {
            return;
        }
        let how = if VM.with(|vm| vm.closed.get()) {
            "every request is refused with 503 (without_rules: closed)"
        } else {
            "requests pass without limits"
        };
        ProxyHost.log(
            Level::Error,
            &format!("ratewall: no rules in force, the rules document was rejected: {why}; {how}, counted in {FALLBACK_METRIC}"),
        );
    }

    /// A request while no rules are in force: whether it goes on.
    fn request(&self) -> bool {
        if self.why.borrow().is_none() {
            let Some(why) = self.standby.take() else { return true };
            *self.why.borrow_mut() = Some(why);
        }
        if let Some(id) = self.metric.get() {
            ProxyHost.increment(id, 1);
        }
        self.say();
        if !VM.with(|vm| vm.closed.get()) {
            return true;
        }
        let body = r#"{"type":"about:blank","title":"Service Unavailable","status":503,"detail":"the rate limiter has no valid rules"}"#;
        let headers = vec![("content-type", "application/problem+json"), ("retry-after", "10")];
        hostcalls::send_http_response(503, headers, Some(body.as_bytes())).is_err()
    }
}

// The ABI call behind the SDK's `get_map_bytes`, which would deserialize every header into
// its own `String` and `Vec` (two allocations per header); the engine reads the serialized
// map in place instead.
#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_header_map_pairs(map_type: u32, return_map_data: *mut *mut u8, return_map_size: *mut usize) -> u32;
    // The SDK's `get_current_time` returns a `SystemTime`, which the engine would turn back
    // into nanoseconds through 128-bit arithmetic on every request.
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    // The SDK's `get_metric` traps on a status it does not expect.
    fn proxy_get_metric(metric_id: u32, return_value: *mut u64) -> u32;
}

/// What every root context of this VM shares. The wasm instance is the VM: under Envoy a
/// configuration push starts a new root context in the running instance (proxy-wasm-cpp-host
/// keys a root context by its plugin configuration), so what must outlive one root context —
/// the last good rules and the node's sync identity — lives here.
struct VmWide {
    /// The engine of the last good rules configured in this VM.
    last_good: RefCell<Option<Rc<Engine>>>,
    /// Whether the host is ngx_wasm_module (found out in the first request: None before).
    nginx: Cell<Option<bool>>,
    /// The VM configuration says `{"without_rules": "closed"}`.
    closed: Cell<bool>,
}

thread_local! {
    static VM: VmWide = const {
        VmWide { last_good: RefCell::new(None), nginx: Cell::new(None), closed: Cell::new(false) }
    };
}

/// The VM's last good rules.
fn last_good() -> Option<Rc<Engine>> {
    VM.with(|vm| vm.last_good.borrow().clone())
}

/// Whether the host is ngx_wasm_module, as far as this VM knows: it has the `ngx.*`
/// properties (NGINX's variables) in a request, which is where this is found out (asking
/// outside a request logs an error there).
fn known_nginx() -> Option<bool> {
    VM.with(|vm| vm.nginx.get())
}

/// Finds out, in a request's context, whether the host is ngx_wasm_module (once per VM).
fn nginx_host() -> bool {
    if let Some(known) = known_nginx() {
        return known;
    }
    let nginx = ProxyHost.property(&["ngx", "nginx_version"]).is_some();
    VM.with(|vm| vm.nginx.set(Some(nginx)));
    nginx
}

/// Whether a root context configured now replaces the VM's previous rules. Under Envoy every
/// root context after the first is a configuration push (one set of rules per `vm_id`);
/// under ngx_wasm_module, whose VMs are configured once (a reload starts new ones), each root
/// context is a `proxy_wasm` directive of its own, with its own sync state. Until a request
/// has told the hosts apart, a `sync.cluster` of `host:port` says ngx_wasm_module.
fn replaces_previous(config: &ratewall_core::Config) -> bool {
    match known_nginx() {
        Some(nginx) => !nginx,
        None => !config.sync.as_ref().is_some_and(|s| s.cluster.contains(':')),
    }
}

/// The request headers as the host serializes them.
fn raw_request_headers() -> Option<Vec<u8>> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the host writes a buffer it allocated through this module's exported allocator
    // (the SDK's `proxy_on_memory_allocate`, a `Vec<u8>` of exactly `size` bytes) and its
    // size; ownership passes to us, so rebuilding that `Vec` frees it once.
    unsafe {
        if proxy_get_header_map_pairs(MapType::HttpRequestHeaders as u32, &mut data, &mut size) != 0 {
            return None;
        }
        if data.is_null() || size == 0 {
            return None;
        }
        Some(Vec::from_raw_parts(data, size, size))
    }
}

/// The proxy as a [`Host`].
struct ProxyHost;

impl Host for ProxyHost {
    fn now(&self) -> Nanos {
        let mut now: u64 = 0;
        // SAFETY: the host writes one u64 through a pointer to a live local.
        match unsafe { proxy_get_current_time_nanoseconds(&mut now) } {
            0 => now,
            _ => 0,
        }
    }
    fn request_headers(&self) -> Vec<u8> {
        raw_request_headers().unwrap_or_default()
    }
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name).ok().flatten()
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }
    fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), SetError> {
        hostcalls::get_shared_data(key).map_err(|_| SetError::Other)
    }
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(SetError::CasMismatch),
            Err(_) => Err(SetError::Other),
        }
    }
    fn define_counter(&self, name: &str) -> Option<u32> {
        hostcalls::define_metric(MetricType::Counter, name).ok()
    }
    fn increment(&self, metric: u32, by: u64) {
        let _ = hostcalls::increment_metric(metric, i64::try_from(by).unwrap_or(i64::MAX));
    }
    fn define_gauge(&self, name: &str) -> Option<u32> {
        hostcalls::define_metric(MetricType::Gauge, name).ok()
    }
    fn set_gauge(&self, metric: u32, value: u64) {
        let _ = hostcalls::record_metric(metric, value);
    }
    fn metric_value(&self, metric: u32) -> Option<u64> {
        let mut value: u64 = 0;
        // SAFETY: the host writes one u64 through a pointer to a live local.
        match unsafe { proxy_get_metric(metric, &mut value) } {
            0 => Some(value),
            _ => None,
        }
    }
    fn resumes_waiters(&self) -> bool {
        // ngx_wasm_module accepts `proxy_set_effective_context` and does nothing, so
        // `proxy_continue_stream` from the root's tick cannot reach a paused request. Asked
        // from a request's context only.
        !nginx_host()
    }
    fn dispatch(&self, upstream: &str, headers: &[(&str, &str)], body: &[u8], timeout: Nanos) -> Option<u32> {
        let timeout = std::time::Duration::from_nanos(timeout);
        hostcalls::dispatch_http_call(upstream, headers.to_vec(), Some(body), Vec::new(), timeout).ok()
    }
    fn log(&self, level: Level, message: &str) {
        let level = match level {
            Level::Debug => LogLevel::Debug,
            Level::Info => LogLevel::Info,
            Level::Warn => LogLevel::Warn,
            Level::Error => LogLevel::Error,
        };
        let _ = hostcalls::log(level, message);
    }
}

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    // A panic aborts the VM; make sure the proxy's log says why.
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("ratewall: panic: {info}"));
    }));
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root {
            engine: None,
            waiters: Waiters::default(),
            ticking: 0,
            fallback: Rc::new(Fallback::default()),
        })
    });
}}

/// A root context (one plugin configuration): its rules, and the requests of it that wait
/// their turn.
struct Root {
    /// The engine of this root context's own document (None: it was rejected).
    engine: Option<Rc<Engine>>,
    waiters: Waiters,
    /// The tick period set (0: none).
    ticking: Nanos,
    fallback: Rc<Fallback>,
}

impl Root {
    /// The engine this root context ticks and hands sync answers to: the one whose sync state
    /// is in force for its rules (or for the VM's last good ones, which it may serve).
    fn ticked(&self) -> Option<Rc<Engine>> {
        let serving = match &self.engine {
            Some(e) => Some(Rc::clone(e)),
            None if known_nginx() == Some(true) => None,
            None => last_good(),
        };
        serving.map(|e| e.live())
    }
}

/// Sets, from the root context, the tick period `engine` needs: [`WAIT_TICK`] under rules
/// that shape, else the sync interval (none without sync); `current` is the one set. Set at
/// configure only: ngx_wasm_module traps on a period set from a request's context, and on a
/// non-zero period replacing another (where a push changes it — Envoy — it is cleared first;
/// ngx_wasm_module configures each VM once).
fn tick_for(engine: Option<&Engine>, current: &mut Nanos) {
    let sync = engine.and_then(Engine::tick_interval);
    let want = match (engine.is_some_and(Engine::shapes), sync) {
        (true, Some(i)) => WAIT_TICK.min(i),
        (true, None) => WAIT_TICK,
        (false, i) => i.unwrap_or(0),
    };
    if want == *current {
        return;
    }
    if *current != 0 && want != 0 {
        let _ = hostcalls::set_tick_period(std::time::Duration::ZERO);
    }
    *current = want;
    let _ = hostcalls::set_tick_period(std::time::Duration::from_nanos(want));
}

/// The store's answer to a call: status (0: failed, timed out, or a body longer than `cap`,
/// which no valid answer is), signature, body. An oversized body is not read (reading and
/// authenticating 16 MB would stall the worker thread).
fn call_response(num_headers: usize, body_size: usize, cap: usize) -> (u32, Option<Vec<u8>>, Vec<u8>) {
    if body_size > cap {
        let message =
            format!("ratewall: a store answer of {body_size} bytes refused unread (a valid one has at most {cap})");
        let _ = hostcalls::log(LogLevel::Warn, &message);
        return (0, None, Vec::new());
    }
    let (status, tag) = if num_headers == 0 {
        (0, None)
    } else {
        let status = hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten()
            .and_then(|s| std::str::from_utf8(&s).ok().and_then(|s| s.parse().ok()))
            .unwrap_or(0);
        let tag =
            hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, "x-ratewall-signature").ok().flatten();
        (status, tag)
    };
    let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size).ok().flatten().unwrap_or_default();
    (status, tag, body)
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _num_trailers: usize) {
        let Some(engine) = self.ticked() else { return };
        let (status, tag, body) = call_response(num_headers, body_size, engine.answer_cap(token));
        engine.on_sync_response(&ProxyHost, token, status, tag.as_deref(), &body);
    }
}

impl RootContext for Root {
    fn on_tick(&mut self) {
        let now = ProxyHost.now();
        // Requests whose turn came go on (resumed in their own context).
        let due: Vec<u32> = {
            let mut w = self.waiters.borrow_mut();
            if let Some(engine) = self.engine.clone().or_else(last_good) {
                for (_, until, turns) in w.list.iter_mut().filter(|(_, until, _)| *until > now) {
                    *until = engine.turn(&ProxyHost, turns, *until);
                }
            }
            let due = w.list.iter().filter(|(_, until, _)| *until <= now).map(|(ctx, _, _)| *ctx).collect();
            w.list.retain(|(_, until, _)| *until > now);
            due
        };
        for ctx in due {
            if hostcalls::set_effective_context(ctx).is_ok() {
                let _ = hostcalls::resume_http_request();
            }
        }
        if let Some(engine) = self.ticked().filter(|e| e.tick_due(now)) {
            engine.on_tick(&ProxyHost);
        }
        self.fallback.say();
    }

    fn on_vm_start(&mut self, size: usize) -> bool {
        // Never false: on ngx_wasm_module a VM that fails to start takes its worker down.
        let config = hostcalls::get_buffer(BufferType::VmConfiguration, 0, size).ok().flatten().unwrap_or_default();
        let closed = match crate::engine::without_rules(&config) {
            Some(closed) => closed,
            None => {
                ProxyHost.log(
                    Level::Error,
                    &format!(
                        "ratewall: VM configuration {:?} not understood (expected {{\"without_rules\": \"open\"}} or {{\"without_rules\": \"closed\"}}); taken as closed: without valid rules every request is refused with 503",
                        String::from_utf8_lossy(&config)
                    ),
                );
                true
            }
        };
        VM.with(|vm| vm.closed.set(closed));
        true
    }

    fn on_configure(&mut self, size: usize) -> bool {
        // Never false, whatever the document. On ngx_wasm_module a false answer is fatal to
        // the worker (NGINX then serves nothing). On Envoy it would refuse the configuration
        // in its canary — a fresh instance, which cannot tell a first start (where a refusal
        // stops the listener from serving at all) from a push — and the canary's verdict is
        // cached per document while the workers' VMs configure later, so a false that depends
        // on anything but the document could disagree with it and fail the plugin on a
        // worker. A rejected document is said here instead, and the VM's last good rules
        // serve on.
        self.fallback.metric.set(ProxyHost.define_counter(FALLBACK_METRIC));
        let document = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size) {
            Ok(Some(d)) => d,
            Ok(None) => Vec::new(),
            Err(_) => b"(the host did not give the plugin configuration)".to_vec(),
        };
        match ratewall_core::Config::parse(&document) {
            Ok(config) => {
                // A push continues the VM's previous rules: the node's sync identity, lease and
                // unsent units carry over, and a table of another size replaces the old one.
                let previous = self.engine.clone().or_else(last_good).filter(|_| replaces_previous(&config));
                if let Some(p) = &previous {
                    p.zero_gauges_left_by(&ProxyHost, &config);
                }
                let engine = Rc::new(Engine::new(&ProxyHost, config, previous.as_deref()));
                if let Some(p) = &previous {
                    p.hand_over(&engine);
                }
                ProxyHost.log(Level::Info, &format!("ratewall: loaded {} rules", engine.config().rules.len()));
                tick_for(Some(&engine), &mut self.ticking);
                VM.with(|vm| *vm.last_good.borrow_mut() = Some(Rc::clone(&engine)));
                self.engine = Some(engine);
                *self.fallback.why.borrow_mut() = None;
                *self.fallback.standby.borrow_mut() = None;
            }
            Err(e) => match self.engine.clone().or_else(|| last_good().filter(|_| known_nginx() != Some(true))) {
                Some(serving) => {
                    // This context's own rules stay; the VM's last good ones stand in only where
                    // the host is not ngx_wasm_module (not known yet at a first configure).
                    let keeping = if self.engine.is_some() {
                        "keeping the previous rules"
                    } else {
                        "keeping the previous rules (on NGINX none: a reloaded worker starts without rules)"
                    };
                    ProxyHost.log(Level::Error, &format!("ratewall: configuration rejected: {e}; {keeping}"));
                    tick_for(Some(&serving), &mut self.ticking);
                    if self.engine.is_none() {
                        // Said again should the host turn out to be ngx_wasm_module, whose
                        // other rules are another directive's (`on_http_request_headers`).
                        *self.fallback.standby.borrow_mut() = Some(e.to_string());
                    }
                }
                None => {
                    // What follows (requests pass, or 503) is said by the first request or tick:
                    // Envoy's canary, which never serves, configures too.
                    ProxyHost.log(Level::Error, &format!("ratewall: configuration rejected: {e}"));
                    *self.fallback.why.borrow_mut() = Some(e.to_string());
                    self.fallback.logged.set(None);
                }
            },
        }
        true
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            engine: self.engine.clone(),
            fallback: self.fallback.clone(),
            response_headers: Vec::new(),
            asking: None,
            id: context_id,
            waiters: self.waiters.clone(),
            waiting: None,
            slots: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One HTTP request's context.
struct Request {
    engine: Option<Rc<Engine>>,
    fallback: Rc<Fallback>,
    response_headers: Vec<(&'static str, String)>,
    /// The ask this request is paused on.
    asking: Option<Asking>,
    id: u32,
    waiters: Waiters,
    /// The turn this request waits for (or waited for: the root resumed it).
    waiting: Option<Waiting>,
    /// The concurrency slots it holds until it ends.
    slots: Option<Slots>,
}

impl Request {
    /// Passes the request on (keeping the headers for the response) or sends the local
    /// reply; whether the request went on.
    fn reply(&mut self, reply: ratewall_core::Reply) -> bool {
        if reply.passes() {
            self.response_headers = reply.headers;
            return true;
        }
        let headers: Vec<(&str, &str)> = reply.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        hostcalls::send_http_response(u32::from(reply.status), headers, Some(reply.body.as_bytes())).is_err()
    }

    /// Acts on a verdict: whether the request goes on now.
    fn verdict(&mut self, verdict: Verdict) -> bool {
        match verdict {
            Verdict::Reply(reply) => self.reply(reply),
            Verdict::Hold(reply, slots) => {
                self.slots = Some(slots);
                self.reply(reply)
            }
            Verdict::Ask(asking) => {
                self.asking = Some(asking);
                false
            }
            Verdict::Wait(waiting) => {
                self.response_headers.clone_from(&waiting.reply.headers);
                // The root, ticking every WAIT_TICK under rules that shape, resumes it.
                self.waiters.borrow_mut().list.push((self.id, waiting.until, waiting.turns().to_vec()));
                self.waiting = Some(waiting);
                false
            }
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // A request gone while it waited (the client left): its ask no longer counts as in
        // flight; the answer, if it comes, finds no context and is dropped.
        if let (Some(engine), Some(_)) = (&self.engine, self.asking.take()) {
            engine.ask_abandoned();
        }
        let Some(engine) = &self.engine else { return };
        // Gone while it waited its turn (the root had not resumed it): the turn goes back.
        // Resumed, it only gives back its concurrency slots, as every request does when it
        // ends (completed or reset).
        if let Some(waiting) = self.waiting.take() {
            let mut w = self.waiters.borrow_mut();
            match w.list.iter().position(|(ctx, _, _)| *ctx == self.id) {
                Some(i) => {
                    w.list.swap_remove(i);
                    drop(w);
                    engine.give_back(&ProxyHost, waiting);
                }
                None => {
                    drop(w);
                    engine.release(&ProxyHost, waiting.slots);
                }
            }
        }
        if let Some(slots) = self.slots.take() {
            engine.release(&ProxyHost, slots);
        }
    }
}

impl Context for Request {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _num_trailers: usize) {
        let (Some(engine), Some(asking)) = (self.engine.clone(), self.asking.take_if(|a| a.token == token)) else {
            return;
        };
        let (status, tag, body) = call_response(num_headers, body_size, asking.answer_cap());
        let mut verdict = engine.on_ask_response(&ProxyHost, asking, status, tag.as_deref(), &body);
        if let (0, Verdict::Reply(reply), true) = (status, &mut verdict, nginx_host()) {
            // ngx_wasm_module gives a local response sent in the answer to a call that failed
            // (timed out) a body buffer that the call's socket, closing, then empties: NGINX
            // sends nothing at all ("zero size buf in writer"). Without a body the status and
            // fields reach the client (and no `Content-Type` says a body comes).
            reply.body.clear();
            reply.headers.retain(|(name, _)| !name.eq_ignore_ascii_case("content-type"));
        }
        if nginx_host() && went_on() {
            // ngx_wasm_module ran this request on while it waited (see `went_on`). It is neither
            // answered (the upstream's response is on its way) nor resumed; what it holds is
            // given back when it ends, and an admitted one's fields still reach a response whose
            // headers are yet to come. From now on no request waits: ngx_wasm_module resumes a
            // request after the answer by itself, and one it ran on whose upstream has not
            // answered yet goes to the upstream a second time.
            let reply = match verdict {
                Verdict::Hold(reply, slots) => {
                    self.slots = Some(slots);
                    Some(reply)
                }
                Verdict::Reply(reply) => Some(reply),
                _ => None,
            };
            if let Some(reply) = reply.filter(ratewall_core::Reply::passes) {
                self.response_headers = reply.headers;
            }
            engine.pause_ignored(&ProxyHost);
            return;
        }
        if self.verdict(verdict) {
            let _ = hostcalls::resume_http_request();
        }
    }
}

/// Whether a request paused for an ask has gone on already, in the ask's answer: it has an
/// upstream, or a response. ngx_wasm_module, running the filter in NGINX's rewrite phase
/// (`proxy_wasm_request_headers_in_access` missing), runs a paused request on a kept-alive
/// connection on; it does not call the filter's `on_http_response_headers` while the request
/// is paused, so the answer is the first the filter sees of it (measured: the upstream was
/// being sent the request, or had answered). A request it holds has neither.
fn went_on() -> bool {
    // NGINX's `$upstream_addr`, not `upstream.address`: ngx_wasm_module reads that one from
    // an upstream that may not have connected yet (a null peer name).
    let upstream = ProxyHost.property(&["ngx", "upstream_addr"]).is_some_and(|a| !a.is_empty());
    upstream || hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, ":status").ok().flatten().is_some()
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // Once per VM: which host this is (see `replaces_previous`).
        let nginx = nginx_host();
        if self.engine.is_none() {
            // This root context's document was rejected: under Envoy (a push of a bad
            // document) the VM's last good rules decide. Under ngx_wasm_module the VM's other
            // rules are another `proxy_wasm` directive's: none.
            self.engine = if nginx { None } else { last_good() };
        }
        let Some(engine) = self.engine.clone() else {
            return if self.fallback.request() { Action::Continue } else { Action::Pause };
        };
        if self.verdict(engine.on_request(&ProxyHost)) {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn on_log(&mut self) {
        // Ended while it waited for an ask, with a response: the host ran it on rather than
        // hold it (a client that went away leaves no response status).
        if let (Some(engine), Some(_)) = (&self.engine, &self.asking) {
            if hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, ":status").ok().flatten().is_some() {
                engine.pause_ignored(&ProxyHost);
            }
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // A response while the request waits for an ask: the host ran it on (ngx_wasm_module
        // does not call this while the request is paused, so there the ask's answer says so).
        if let (Some(engine), Some(_)) = (&self.engine, &self.asking) {
            engine.pause_ignored(&ProxyHost);
        }
        // A request that waited its turn: its fields as of now, the queues as they are.
        if let (Some(engine), Some(waiting)) = (&self.engine, &self.waiting) {
            self.response_headers = engine.reply_now(&ProxyHost, waiting).headers;
        }
        for (name, value) in &self.response_headers {
            let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value);
        }
        Action::Continue
    }
}
