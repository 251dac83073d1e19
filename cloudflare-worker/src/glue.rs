//! The Workers runtime glue (wasm32 only): the fetch handler, the counter Durable Object and
//! the `/v1/sync` store. Decisions are made by `ratewall-core` and `crate::edge`.

use crate::edge::{
    checks_for, decode_applied, decode_heard, encode_applied, encode_heard, hex, object_name, parse_stored,
    stored_value, unhex, BlockedCache, Call, LocalFallback, Metrics, Rules, Taken, MS, REGISTRY_OBJECT,
};
use futures_util::future::{join, join_all, select, Either};
use ratewall_core::eval::{combine, CheckResult, Outcome, Skip, StoreError};
use ratewall_core::rules::{FailurePolicy, Mode};
use ratewall_core::sync::{sign, verify, Counter, Grant, Registry, SyncRequest, SyncResponse};
use ratewall_core::{render, Check, Config, Decision, Nanos, Reply, SECOND};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;
use worker::wasm_bindgen::JsValue;
use worker::{
    console_error, console_log, durable_object, event, Context, Date, Delay, DurableObject, Env, Fetch, Headers,
    Method, Request, RequestInit, Response, Result,
};

/// The counter objects' namespace binding (wrangler.toml); the `COUNTER_BINDING` var names
/// another.
const COUNTERS: &str = "RATEWALL_COUNTER";
/// Where the sync store listens.
const SYNC_PATH: &str = "/v1/sync";
/// The isolate's metrics.
const METRICS_PATH: &str = "/_ratewall/metrics";
/// A batch may name at most this many counters: each is one Durable Object call, and a
/// Worker invocation has a bounded number of subrequests. Filters split larger batches.
const MAX_SYNC_DELTAS: usize = 500;
/// Largest sync body accepted.
const MAX_SYNC_BODY: usize = 1 << 20;
/// A node that has not synced a counter for this long no longer takes a share of it.
const NODE_TTL: Nanos = 2 * SECOND;
/// A counter object writes its state to storage at most this long after it changed: what a
/// restart of the object can lose is the admissions of the last `FLUSH` (see README).
const FLUSH: Nanos = SECOND;

struct Isolate {
    rules: Rules,
    var_loaded: bool,
    kv_next: Nanos,
    last_rejected: String,
    cache: BlockedCache,
    fallback: LocalFallback,
    metrics: Metrics,
}

thread_local! {
    static ISOLATE: RefCell<Isolate> = RefCell::new(Isolate {
        rules: Rules::default(),
        var_loaded: false,
        kv_next: 0,
        last_rejected: String::new(),
        cache: BlockedCache::new(10_000),
        fallback: LocalFallback::new(10_000),
        metrics: Metrics::default(),
    });
}

fn with<T>(f: impl FnOnce(&mut Isolate) -> T) -> T {
    ISOLATE.with(|i| f(&mut i.borrow_mut()))
}

/// The Workers clock in ns. It only advances between I/O, so one request sees one instant;
/// counter objects clamp it so it never runs backwards for them.
fn now() -> Nanos {
    Date::now().as_millis().saturating_mul(MS)
}

fn var(env: &Env, name: &str) -> Option<String> {
    env.var(name).ok().map(|v| v.to_string()).filter(|v| !v.is_empty())
}

fn var_u64(env: &Env, name: &str, default: u64) -> u64 {
    var(env, name).and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

fn load_rules(doc: &str, origin: &str) {
    with(|i| match i.rules.load(doc) {
        Ok(true) => {
            i.metrics.rules_loaded += 1;
            i.last_rejected.clear();
            console_log!("ratewall: rules loaded from {origin}");
        }
        Ok(false) => {}
        Err(e) => {
            if i.last_rejected != doc {
                i.metrics.rules_rejected += 1;
                i.last_rejected = doc.to_owned();
                let kept = if i.rules.current().is_some() { "the previous rules stay in force" } else { "no rules" };
                console_error!("ratewall: rules from {origin} rejected: {e}; {kept}");
            }
        }
    });
}

/// The rules in force: the `RATEWALL_RULES` var, overridden by the `rules` key of the
/// `RATEWALL_KV` namespace when it is set. KV is read again every `RULES_REFRESH_SECONDS`
/// (default 10) per isolate, so a change is in force within that interval plus KV's own
/// propagation (up to 60 s across Cloudflare's edge; immediate locally).
async fn rules(env: &Env) -> Option<Rc<Config>> {
    let t = now();
    let (load_var, read_kv) = with(|i| {
        let read_kv = t >= i.kv_next;
        if read_kv {
            i.kv_next = t.saturating_add(var_u64(env, "RULES_REFRESH_SECONDS", 10).saturating_mul(SECOND));
        }
        (!std::mem::replace(&mut i.var_loaded, true), read_kv)
    });
    let from_var = var(env, "RATEWALL_RULES");
    if load_var {
        match &from_var {
            Some(doc) => load_rules(doc, "var RATEWALL_RULES"),
            None => console_error!("ratewall: no RATEWALL_RULES var; waiting for rules in KV"),
        }
    }
    if read_kv {
        if let Ok(kv) = env.kv("RATEWALL_KV") {
            match kv.get("rules").text().await {
                Ok(Some(doc)) => load_rules(&doc, "KV RATEWALL_KV/rules"),
                // The key was removed: the deploy-time var is in force again.
                Ok(None) => {
                    if let Some(doc) = &from_var {
                        load_rules(doc, "var RATEWALL_RULES");
                    }
                }
                Err(e) => console_error!("ratewall: reading rules from KV failed ({e}); the rules in force stay"),
            }
        }
    }
    with(|i| i.rules.current())
}

/// One call to a counter object, with a deadline.
async fn call_object(env: &Env, key: &[u8], call: Call, timeout: Duration) -> std::result::Result<String, StoreError> {
    call_named(env, &object_name(key), call, timeout).await
}

/// One call to the object named `name`, with a deadline.
async fn call_named(env: &Env, name: &str, call: Call, timeout: Duration) -> std::result::Result<String, StoreError> {
    with(|i| i.metrics.object_calls += 1);
    let attempt = async {
        let binding = var(env, "COUNTER_BINDING").unwrap_or_else(|| COUNTERS.to_owned());
        let stub = env.durable_object(&binding)?.get_by_name(name)?;
        let mut init = RequestInit::new();
        init.with_method(Method::Post).with_body(Some(JsValue::from_str(&call.encode())));
        let req = Request::new_with_init("https://counter.ratewall/", &init)?;
        let mut resp = stub.fetch_with_request(req).await?;
        if resp.status_code() != 200 {
            return Err(worker::Error::RustError(format!("counter object answered {}", resp.status_code())));
        }
        resp.text().await
    };
    let result = match select(Box::pin(attempt), Delay::from(timeout)).await {
        Either::Left((Ok(body), _)) => Ok(body),
        Either::Left((Err(e), _)) => {
            console_error!("ratewall: counter object failed: {e}");
            Err(StoreError::Unavailable)
        }
        Either::Right(_) => {
            console_error!("ratewall: counter object timed out after {} ms", timeout.as_millis());
            Err(StoreError::Unavailable)
        }
    };
    if result.is_err() {
        with(|i| i.metrics.object_failures += 1);
    }
    result
}

fn reply_response(reply: &Reply) -> Result<Response> {
    let headers = Headers::new();
    for (name, value) in &reply.headers {
        headers.set(name, value)?;
    }
    Ok(Response::from_bytes(reply.body.as_bytes().to_vec())?.with_status(reply.status).with_headers(headers))
}

/// The built-in demo origin, used when neither the `ORIGIN` service binding nor the
/// `ORIGIN_URL` var is set (`cargo xtask dev`).
fn demo_origin(req: &Request) -> Result<Response> {
    let body = serde_json::json!({
        "origin": "ratewall demo origin",
        "method": req.method().to_string(),
        "path": req.path(),
    });
    let headers = Headers::new();
    headers.set("content-type", "application/json")?;
    Ok(Response::from_bytes(body.to_string().into_bytes())?.with_headers(headers))
}

/// Sends an admitted request upstream and adds the RateLimit fields to the answer.
async fn forward(req: Request, env: &Env, fields: &[(&'static str, String)]) -> Result<Response> {
    let resp = if let Ok(origin) = env.service("ORIGIN") {
        origin.fetch_request(req).await?
    } else if let Some(base) = var(env, "ORIGIN_URL") {
        let url = req.url()?;
        let target = format!(
            "{}{}{}",
            base.trim_end_matches('/'),
            url.path(),
            url.query().map(|q| format!("?{q}")).unwrap_or_default()
        );
        let headers = Headers::new();
        for (k, v) in req.headers().entries() {
            headers.append(&k, &v)?;
        }
        let mut init = RequestInit::new();
        init.with_method(req.method()).with_headers(headers).with_body(req.inner().body().map(JsValue::from));
        Fetch::Request(Request::new_with_init(&target, &init)?).send().await?
    } else {
        demo_origin(&req)?
    };
    if fields.is_empty() {
        return Ok(resp);
    }
    // A fetched response's headers are immutable: copy them.
    let headers = Headers::new();
    for (k, v) in resp.headers().entries() {
        headers.append(&k, &v)?;
    }
    for (name, value) in fields {
        headers.set(name, value)?;
    }
    Ok(resp.with_headers(headers))
}

fn count(config: &Config, outcome: &Outcome, skipped: &[(usize, Skip)], cached: bool) {
    with(|i| {
        for (rule, why) in skipped {
            if let (Skip::Unkeyed, Some(r)) = (why, config.rules.get(*rule)) {
                i.metrics.rule(&r.name).unkeyed += 1;
            }
        }
        for c in &outcome.checks {
            let Some(r) = config.rules.get(c.rule) else { continue };
            let m = i.metrics.rule(&r.name);
            match c.result {
                CheckResult::Decided(_) if c.would_reject() => m.shadow_rejected += 1,
                CheckResult::Decided(d) if !d.allowed && cached => m.cached_denials += 1,
                CheckResult::Decided(d) if !d.allowed => m.rejected += 1,
                CheckResult::Decided(_) => m.allowed += 1,
                CheckResult::Failed(..) => m.store_failed += 1,
            }
        }
    });
}

/// Denials still cached for the enforcing checks of a request.
fn cached_denials(config: &Config, checks: &[Check], t: Nanos) -> Outcome {
    let mut out = Outcome::default();
    with(|i| {
        for c in checks {
            let Some(rule) = config.rules.get(c.rule).filter(|r| r.mode == Mode::Enforce) else { continue };
            if let Some(d) = i.cache.get(&c.key, t, c.cost) {
                let result = CheckResult::Decided(d);
                out.checks.push(ratewall_core::eval::CheckOutcome {
                    rule: c.rule,
                    mode: rule.mode,
                    limit: c.limit,
                    result,
                });
                out.rejected = true;
            }
        }
    });
    out
}

async fn limit(req: Request, env: Env, ctx: Context) -> Result<Response> {
    let Some(config) = rules(&env).await else {
        // Never a good rules document: serve unlimited and say so in the logs (above).
        return forward(req, &env, &[]).await;
    };
    let method = req.method().to_string();
    let path = req.path();
    let (checks, skipped) = checks_for(&config, &method, &path, &|h| req.headers().get(h).ok().flatten());
    let t = now();
    let use_cache = var(&env, "BLOCKED_CACHE").as_deref() != Some("off");
    if use_cache {
        let outcome = cached_denials(&config, &checks, t);
        if outcome.rejected {
            count(&config, &outcome, &skipped, true);
            return reply_response(&render(&config, &outcome));
        }
    }
    let timeout = Duration::from_millis(var_u64(&env, "OBJECT_TIMEOUT_MS", 1000));
    let calls = checks.iter().map(|c| call_object(&env, &c.key, Call::Take { limit: c.limit, cost: c.cost }, timeout));
    let answers = join_all(calls).await;
    let mut taken_at = Vec::with_capacity(checks.len());
    let mut decisions: Vec<std::result::Result<Decision, StoreError>> = Vec::with_capacity(checks.len());
    for (c, answer) in checks.iter().zip(answers) {
        let taken = answer.and_then(|body| Taken::decode(&body).ok_or(StoreError::Unavailable));
        let open = config.rules.get(c.rule).is_some_and(|r| r.on_store_failure == FailurePolicy::Open);
        decisions.push(match taken {
            Ok(tk) => {
                taken_at.push(Some(tk.now));
                Ok(tk.decision)
            }
            Err(e) => {
                taken_at.push(None);
                if open {
                    with(|i| {
                        i.metrics.rule(config.rules.get(c.rule).map_or("", |r| r.name.as_str())).store_failed += 1
                    });
                    Ok(with(|i| i.fallback.take(c, t)))
                } else {
                    Err(e)
                }
            }
        });
    }
    let (outcome, refunds) = combine(&config, &checks, &decisions);
    // Units taken by rules that allowed a request another rule rejected go back. The client
    // gets its 429 without waiting for that.
    let refund_calls: Vec<(Vec<u8>, Call)> = refunds
        .iter()
        .filter_map(|&i| {
            let c = checks.get(i)?;
            let at = (*taken_at.get(i)?)?;
            Some((c.key.clone(), Call::Refund { limit: c.limit, cost: c.cost, at }))
        })
        .collect();
    if !refund_calls.is_empty() {
        let env2 = env.clone();
        ctx.wait_until(async move {
            let calls = refund_calls.iter().map(|(key, call)| call_object(&env2, key, *call, timeout));
            join_all(calls).await;
        });
    }
    if use_cache {
        with(|i| {
            for (c, d) in checks.iter().zip(&decisions) {
                if let Ok(d) = d {
                    i.cache.insert(&c.key, t, c.cost, *d);
                }
            }
        });
    }
    count(&config, &outcome, &skipped, false);
    let reply = render(&config, &outcome);
    if reply.passes() {
        forward(req, &env, &reply.headers).await
    } else {
        reply_response(&reply)
    }
}

/// `POST /v1/sync`: a filter node's signed batch of deltas in, the global view out (signed).
async fn sync(mut req: Request, env: Env) -> Result<Response> {
    let secret = env.secret("RATEWALL_SYNC_SECRET").map(|s| s.to_string()).unwrap_or_default();
    if secret.is_empty() {
        with(|i| i.metrics.sync_failed += 1);
        return Response::error(
            "sync is disabled: set RATEWALL_SYNC_SECRET (wrangler secret put RATEWALL_SYNC_SECRET)",
            503,
        );
    }
    let tag = req.headers().get("x-ratewall-signature").ok().flatten().and_then(|h| unhex(h.trim().as_bytes()));
    let body = req.bytes().await?;
    if body.len() > MAX_SYNC_BODY {
        with(|i| i.metrics.sync_failed += 1);
        return Response::error("batch too large", 413);
    }
    if !tag.is_some_and(|tag| verify(secret.as_bytes(), &body, &tag)) {
        with(|i| i.metrics.sync_failed += 1);
        return Response::error("missing or invalid x-ratewall-signature", 401);
    }
    let batch = match SyncRequest::decode(&body) {
        Ok(b) => b,
        Err(e) => {
            with(|i| i.metrics.sync_failed += 1);
            return Response::error(format!("malformed batch: {e:?}"), 400);
        }
    };
    if batch.deltas.len() > MAX_SYNC_DELTAS {
        with(|i| i.metrics.sync_failed += 1);
        return Response::error(format!("a batch names at most {MAX_SYNC_DELTAS} counters"), 413);
    }
    let timeout = Duration::from_millis(var_u64(&env, "OBJECT_TIMEOUT_MS", 1000));
    // The registry first, for a batch: an older seq is refused (409) before any counter sees
    // it. An ask (a paused request waits on it) asks the registry alongside its counters.
    let heard = Call::Heard { node: batch.node, seq: batch.seq, ask: batch.ask };
    let registry = call_named(&env, REGISTRY_OBJECT, heard, timeout);
    let calls = batch.deltas.iter().map(|d| {
        let call = if batch.ask {
            Call::Ask { limit: d.limit, node: batch.node, ask: batch.seq, units: d.units }
        } else {
            Call::Apply { limit: d.limit, node: batch.node, seq: batch.seq, units: d.units }
        };
        call_object(&env, &d.key, call, timeout)
    });
    let (answers, nodes) = if batch.ask {
        let (answers, registry) = join(join_all(calls), registry).await;
        (answers, registry.ok().and_then(|b| decode_heard(&b)).and_then(Result::ok))
    } else {
        match registry.await.ok().and_then(|b| decode_heard(&b)) {
            Some(Ok(n)) => (join_all(calls).await, Some(n)),
            Some(Err(last)) => {
                with(|i| i.metrics.sync_failed += 1);
                return Response::error(
                    format!("seq {} is older than this node's latest batch ({last})", batch.seq),
                    409,
                );
            }
            None => {
                with(|i| i.metrics.sync_failed += 1);
                return Response::error("the node registry failed; retry the batch with the same seq", 503);
            }
        }
    };
    let mut grants = Vec::with_capacity(answers.len());
    let mut per_counter = 1;
    for (d, answer) in batch.deltas.iter().zip(answers) {
        // Counters apply each (node, seq) once, so the node retrying the whole batch after a
        // partial failure never counts twice.
        let Some(a) = answer.ok().and_then(|b| decode_applied(&b)) else {
            with(|i| i.metrics.sync_failed += 1);
            return Response::error("a counter object failed; retry the batch with the same seq", 503);
        };
        per_counter = per_counter.max(a.nodes);
        grants.push(Grant::from_applied(&d.key, &a));
    }
    // The fleet heard from (the registry); only if it failed to answer an ask, the most any
    // counter saw.
    let nodes = nodes.unwrap_or(per_counter);
    let out = SyncResponse { seq: batch.seq, now: now(), nodes, grants }.encode();
    let headers = Headers::new();
    headers.set("content-type", "application/octet-stream")?;
    headers.set("x-ratewall-signature", &hex(&sign(secret.as_bytes(), &out)))?;
    with(|i| i.metrics.sync_ok += 1);
    Ok(Response::from_bytes(out)?.with_headers(headers))
}

#[event(fetch)]
async fn fetch(req: Request, env: Env, ctx: Context) -> Result<Response> {
    let path = req.path();
    if path == METRICS_PATH {
        return Response::ok(with(|i| i.metrics.render()));
    }
    if path == SYNC_PATH && req.method() == Method::Post {
        return sync(req, env).await;
    }
    limit(req, env, ctx).await
}

/// Persistent state of one counter object.
struct Slot {
    loaded: bool,
    counter: Option<Counter>,
    dirty: bool,
    /// The alarm the object has set, if any.
    alarm_at: Option<Nanos>,
}

/// A Durable Object holding one counter (one rule, one key), or — the one named
/// [`REGISTRY_OBJECT`] — the sync store's node registry. Single-threaded, so every check is
/// atomic and global. State lives in memory and is loaded lazily from storage. A change from
/// the Worker's own traffic is written back by an alarm at most [`FLUSH`] later (not one row
/// per request); a sync delta or ask is written before it is acknowledged, so a restart of
/// the object never loses units a filter node was told were counted. The same alarm deletes
/// the state once it is idle. A stored value that cannot be read is never replaced: the call
/// fails, and the rule's `on_store_failure` applies.
#[durable_object]
pub struct RateLimitCounter {
    state: worker::State,
    slot: RefCell<Slot>,
    /// The node registry (only in the registry object; soft state: after a restart it is
    /// rebuilt within one heartbeat period, as every node's next batch or heartbeat is heard).
    registry: RefCell<Registry>,
}

impl RateLimitCounter {
    /// Loads the stored counter once (`limit`: the caller's; `None` from an alarm, which
    /// reads the limit stored with it).
    async fn load(&self, limit: Option<ratewall_core::Limit>) -> Result<()> {
        if self.slot.borrow().loaded {
            return Ok(());
        }
        // A read that fails fails the call: a counter is never reset because a read failed.
        let stored: Option<String> = self.state.storage().get("c").await.map_err(|e| {
            console_error!("ratewall: counter storage read failed: {e}");
            e
        })?;
        let counter = match stored {
            None => None,
            Some(v) => match parse_stored(&v, limit) {
                Ok(c) => Some(c),
                Err(e) => {
                    // Kept as it is (never overwritten with a fresh counter); every call fails.
                    console_error!("ratewall: stored counter unreadable ({e}); kept, and calls to it fail");
                    return Err(worker::Error::RustError(format!("stored counter unreadable: {e}")));
                }
            },
        };
        let mut slot = self.slot.borrow_mut();
        if !slot.loaded {
            slot.counter = counter;
            slot.loaded = true;
        }
        Ok(())
    }

    async fn schedule(&self, at: Nanos) -> Result<()> {
        let due = {
            let mut slot = self.slot.borrow_mut();
            if slot.alarm_at.is_some_and(|a| a <= at) {
                return Ok(());
            }
            slot.alarm_at = Some(at);
            at
        };
        self.state.storage().set_alarm(Duration::from_millis(due.saturating_sub(now()) / MS)).await
    }
}

impl DurableObject for RateLimitCounter {
    fn new(state: worker::State, _env: Env) -> Self {
        RateLimitCounter {
            state,
            slot: RefCell::new(Slot { loaded: false, counter: None, dirty: false, alarm_at: None }),
            registry: RefCell::new(Registry::default()),
        }
    }

    async fn fetch(&self, mut req: Request) -> Result<Response> {
        let body = req.text().await?;
        let Some(call) = Call::decode(&body) else {
            return Response::error("not a counter call", 400);
        };
        let Some(limit) = call.limit() else {
            let Call::Heard { node, seq, ask } = call else {
                return Response::error("not a counter call", 400);
            };
            let heard = self.registry.borrow_mut().heard(now(), node, seq, ask, NODE_TTL);
            return Response::ok(encode_heard(heard));
        };
        if let Err(e) = self.load(Some(limit)).await {
            return Response::error(format!("counter unavailable: {e}"), 503);
        }
        let t = now();
        let (reply, write_now) = {
            let mut slot = self.slot.borrow_mut();
            let c = slot.counter.get_or_insert_with(|| Counter::new(limit));
            let (reply, changed, write_now) = match call {
                Call::Take { limit, cost } => {
                    let decision = c.take(limit, t, cost);
                    (Taken { decision, now: c.last_seen }.encode(), decision.allowed && cost > 0, false)
                }
                Call::Refund { limit, cost, at } => {
                    c.refund(limit, t, at, cost);
                    (String::from("{}"), true, false)
                }
                Call::Apply { limit, node, seq, units } => {
                    let a = c.apply(limit, t, node, seq, units, NODE_TTL);
                    (encode_applied(&a), a.counted, a.counted)
                }
                Call::Ask { limit, node, ask, units } => {
                    let a = c.ask(limit, t, node, ask, units, NODE_TTL);
                    (encode_applied(&a), a.grant > 0, a.grant > 0)
                }
                Call::Heard { .. } => (String::new(), false, false),
            };
            slot.dirty |= changed;
            let write = if write_now { slot.counter.as_ref().map(stored_value) } else { None };
            (reply, write)
        };
        if let Some(w) = write_now {
            // Before the answer: the units the node is told were counted are in storage.
            self.state.storage().put("c", w).await?;
        }
        if self.slot.borrow().dirty {
            self.schedule(t.saturating_add(FLUSH)).await?;
        }
        Response::ok(reply)
    }

    async fn alarm(&self) -> Result<Response> {
        let t = now();
        // After a restart the alarm may come first: load, so that idleness is judged on the
        // stored counter (an unloaded one is not "no counter": deleting it would reset it).
        if let Err(e) = self.load(None).await {
            console_error!("ratewall: alarm could not load its counter ({e}); it is kept");
            return Response::ok("");
        }
        let (write, idle_at) = {
            let mut slot = self.slot.borrow_mut();
            slot.alarm_at = None;
            let idle_at = slot.counter.as_ref().map_or(0, Counter::idle_at);
            let write = if slot.dirty { slot.counter.as_ref().map(stored_value) } else { None };
            slot.dirty = false;
            if idle_at <= t {
                // Idle: equivalent to fresh, so forgetting it gives nobody extra quota.
                slot.counter = None;
            }
            (write, idle_at)
        };
        if idle_at <= t {
            self.state.storage().delete_all().await?;
        } else {
            if let Some(w) = write {
                self.state.storage().put("c", w).await?;
            }
            self.schedule(idle_at).await?;
        }
        Response::ok("")
    }
}
