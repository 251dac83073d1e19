//! The Workers runtime glue (wasm32 only): the fetch handler, the counter Durable Object and
//! the `/v1/sync` store. Decisions are made by `ratewall-core` and `crate::edge`.

use crate::edge::admin::{self, Access};
use crate::edge::grants::{Answer, Grants, Local, Schedule, REPORT_EVERY};
use crate::edge::object::{earliest, Object, Shard, ASK_MARK_PREFIX, STORAGE_KEYS};
use crate::edge::top::{self, Aggregate, IsolateTop, Report, TopCall, Window, ADMIN_OBJECT};
use crate::edge::{
    cached_denials, checks_for, decided_locally, decisions, decode_batch, decode_replies, encode_batch, encode_replies,
    forwarded_header, in_flight, object_name, passable_status, refund_calls, shadow_lines, storage_key, store,
    take_answer, wait_of, BlockedCache, Call, LocalFallback, Metrics, Offered, Rules, DEFAULT_SHARDS, MS, NOT_APPLIED,
    REGISTRY_OBJECT,
};
use futures_util::future::{join, join_all, select, Either};
use ratewall_core::eval::{combine, Check, Outcome, Skip, StoreError};
use ratewall_core::{render, Config, Nanos, Reply, SECOND};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;
use worker::wasm_bindgen::JsValue;
use worker::{
    console_error, console_log, durable_object, event, Context, Date, Delay, DurableObject, Env, Fetch, Headers,
    Method, Request, RequestInit, Response, ResponseBody, Result,
};

/// The counter objects' namespace binding (wrangler.toml); the `COUNTER_BINDING` var names
/// another.
const COUNTERS: &str = "RATEWALL_COUNTER";
/// Where the sync store listens.
const SYNC_PATH: &str = "/v1/sync";
/// The isolate's metrics.
const METRICS_PATH: &str = "/_ratewall/metrics";
/// The admin routes (behind `RATEWALL_ADMIN_TOKEN`): the edge's top offenders, its
/// per-second series, and the dashboard page.
const TOP_PATH: &str = "/_ratewall/top";
const SERIES_PATH: &str = "/_ratewall/series";
const PAGE_PATH: &str = "/_ratewall/";
/// Requests under this path are limited by Cloudflare's own `ratelimit` binding named
/// [`PEER_LIMITER`], keyed by `x-user-id`, when the Worker has that binding (the benchmark's
/// peer, in the same Worker and run); without it they are ordinary requests.
const PEER_PREFIX: &str = "/_peer/cf-ratelimit/";
const PEER_LIMITER: &str = "RATEWALL_PEER_LIMITER";
struct Isolate {
    rules: Rules,
    var_loaded: bool,
    /// The `RATEWALL_RULES` var was rejected (it is read once: a deployment's vars do not
    /// change under it).
    var_rejected: bool,
    /// `COUNTER_SHARDS`, once read.
    shards: Option<u32>,
    kv_next: Nanos,
    /// Whether this isolate has read the rules in KV once (later reads go in the background).
    kv_read: bool,
    /// The rules in force came from KV (its `rules` key, or [`LAST_GOOD_KEY`]).
    kv_in_force: bool,
    /// What this isolate made sure [`LAST_GOOD_KEY`] holds (`Some(None)`: nothing).
    last_good: Option<Option<String>>,
    cache: BlockedCache,
    fallback: LocalFallback,
    grants: Grants,
    metrics: Metrics,
    /// This isolate's node id at the counter and admin objects.
    node: u64,
    top: IsolateTop,
    /// A too-short admin token was reported.
    admin_warned: bool,
    /// Counters this isolate's `/v1/sync` calls found out of quota, named to the nodes.
    out: ratewall_core::sync::Out,
}

/// A random node id for this isolate at the counter objects.
fn random_node() -> u64 {
    let half = || (worker::js_sys::Math::random() * f64::from(u32::MAX)) as u64;
    (half() << 32) | half()
}

thread_local! {
    static ISOLATE: RefCell<Isolate> = RefCell::new({
        let node = random_node();
        Isolate {
            rules: Rules::default(),
            var_loaded: false,
            var_rejected: false,
            shards: None,
            kv_next: 0,
            kv_read: false,
            kv_in_force: false,
            last_good: None,
            cache: BlockedCache::new(10_000),
            fallback: LocalFallback::new(10_000),
            grants: Grants::new(node, 10_000),
            metrics: Metrics::default(),
            node,
            top: IsolateTop::default(),
            admin_warned: false,
            out: ratewall_core::sync::Out::default(),
        }
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

fn load_rules(doc: &[u8], origin: &str) {
    match with(|i| i.rules.offer(doc, origin, &mut i.metrics)) {
        Offered::Loaded(m) => console_log!("{m}"),
        Offered::Rejected(m) => console_error!("{m}"),
        Offered::Unchanged => {}
    }
}

/// The rules in force: the `RATEWALL_RULES` var, overridden by the `rules` key of the
/// `RATEWALL_KV` namespace when it is set. KV is read again every `RULES_REFRESH_SECONDS`
/// (default 10) per isolate, so a change is in force within that interval plus KV's own
/// propagation (up to 60 s across Cloudflare's edge; immediate locally). With a namespace
/// bound, the rules that load are kept in it ([`LAST_GOOD_KEY`]), and an isolate whose own
/// document is bad (the `rules` key's, or the var's while that key is unset) takes them.
/// An isolate's first read is waited for (the rules in KV may not be the var's); later ones,
/// while rules are in force, run in the background (`ctx`): no request waits for them.
async fn rules(env: &Env, ctx: &Context) -> Option<Rc<Config>> {
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
        // Secret identity values hash under a key of this deployment's, not ratewall's own.
        let secret = ["RATEWALL_SYNC_SECRET", "RATEWALL_ADMIN_TOKEN"]
            .iter()
            .find_map(|n| {
                env.secret(n).map(|s| s.to_string()).ok().or_else(|| var(env, n)).filter(|s| !s.trim().is_empty())
            })
            .unwrap_or_default();
        with(|i| i.rules.set_deployment_secret(&secret));
        match &from_var {
            Some(doc) => {
                load_rules(doc.as_bytes(), "var RATEWALL_RULES");
                with(|i| i.var_rejected = !i.rules.in_force(doc.as_bytes()));
            }
            None => console_error!("ratewall: no RATEWALL_RULES var; waiting for rules in KV"),
        }
    }
    if read_kv {
        if with(|i| i.kv_read && i.rules.current().is_some()) {
            let env = env.clone();
            ctx.wait_until(async move { refresh_rules(&env, from_var).await });
        } else {
            refresh_rules(env, from_var).await;
            with(|i| i.kv_read = true);
        }
    }
    with(|i| i.rules.current())
}

/// Reads the rules in KV, if a namespace is bound, and puts them in force (see [`rules`];
/// `from_var`: the `RATEWALL_RULES` var).
async fn refresh_rules(env: &Env, from_var: Option<String>) {
    if let Ok(kv) = env.kv("RATEWALL_KV") {
        // With a deadline: a KV read that hangs must not hold the request that waits for
        // it, nor the background task (the rules in force stay, and the next refresh reads
        // again).
        // As bytes: read as text, bytes that are not UTF-8 would become U+FFFD, and a document
        // the filter and `ratewall check` refuse would go into force here.
        match within(object_timeout(env), kv.get("rules").bytes()).await {
            Some(Ok(Some(doc))) => {
                load_rules(&doc, "KV RATEWALL_KV/rules");
                if with(|i| i.rules.in_force(&doc)) {
                    with(|i| i.kv_in_force = true);
                    // In force, so UTF-8.
                    if let Ok(doc) = String::from_utf8(doc) {
                        keep_last_good(env, &kv, Some(doc)).await;
                    }
                } else if !with(|i| i.kv_in_force) {
                    // A bad document, and this isolate never had KV's rules in force (it
                    // started since): the last rules that loaded, if any.
                    take_last_good(env, &kv, "KV RATEWALL_KV/rules was rejected").await;
                }
            }
            // No `rules` key (or it was removed): the deploy-time var is in force, and a
            // good one is the deployment's last good rules. A bad one leaves the rules in
            // force, or, in an isolate that has none, the last good ones.
            Some(Ok(None)) => {
                with(|i| i.kv_in_force = false);
                match &from_var {
                    Some(doc) if !with(|i| i.var_rejected) => {
                        load_rules(doc.as_bytes(), "var RATEWALL_RULES");
                        if with(|i| i.rules.in_force(doc.as_bytes())) {
                            keep_last_good(env, &kv, Some(doc.clone())).await;
                        }
                    }
                    Some(_) => {
                        if with(|i| i.rules.current().is_none()) {
                            take_last_good(env, &kv, "var RATEWALL_RULES was rejected").await;
                        }
                    }
                    None => keep_last_good(env, &kv, None).await,
                }
            }
            Some(Err(e)) => {
                console_error!("ratewall: reading rules from KV failed ({e}); the rules in force stay")
            }
            None => console_error!("ratewall: reading rules from KV took too long; the rules in force stay"),
        }
    }
}

/// The `RATEWALL_KV` key holding the last rules document that loaded (the `rules` key's, or
/// the var's while that key is unset), so that an isolate starting while its own document is
/// bad keeps the deployment's last good rules: not the var's while `rules` holds a bad
/// document, and not none while the var is bad.
const LAST_GOOD_KEY: &str = "rules.last_good";

/// Loads the rules kept under [`LAST_GOOD_KEY`], if any, saying `why` in the log.
async fn take_last_good(env: &Env, kv: &worker::kv::KvStore, why: &str) {
    if let Some(Ok(Some(good))) = within(object_timeout(env), kv.get(LAST_GOOD_KEY).text()).await {
        load_rules(good.as_bytes(), &format!("KV RATEWALL_KV/{LAST_GOOD_KEY}, the last good rules ({why})"));
        if with(|i| i.rules.in_force(good.as_bytes())) {
            with(|i| i.kv_in_force = true);
        }
    }
}

/// `op` within `deadline` (`None`: it took longer).
async fn within<T>(deadline: Duration, op: impl std::future::Future<Output = T>) -> Option<T> {
    match select(Box::pin(op), Delay::from(deadline)).await {
        Either::Left((v, _)) => Some(v),
        Either::Right(_) => None,
    }
}

/// Makes sure [`LAST_GOOD_KEY`] holds `good` (`None`: neither the `rules` key nor the var
/// gives rules, and the last good copy goes too): read, and written only when it differs,
/// once per change per isolate.
async fn keep_last_good(env: &Env, kv: &worker::kv::KvStore, good: Option<String>) {
    if with(|i| i.last_good.as_ref() == Some(&good)) {
        return;
    }
    let Some(Ok(held)) = within(object_timeout(env), kv.get(LAST_GOOD_KEY).text()).await else { return };
    let written = match (&good, held == good) {
        (_, true) => true,
        (Some(doc), false) => match kv.put(LAST_GOOD_KEY, doc.as_str()) {
            Ok(put) => matches!(within(object_timeout(env), put.execute()).await, Some(Ok(()))),
            Err(_) => false,
        },
        (None, false) => matches!(within(object_timeout(env), kv.delete(LAST_GOOD_KEY)).await, Some(Ok(()))),
    };
    if written {
        with(|i| i.last_good = Some(good));
    }
}

/// One call to the object holding `key`'s counter, with a deadline.
async fn call_object(env: &Env, key: &[u8], call: Call, timeout: Duration) -> std::result::Result<String, StoreError> {
    let object = object_name(key, shards(env));
    let mut replies = call_batch(env, &object, &[(key.to_vec(), call)], timeout).await;
    replies.pop().unwrap_or(Err(StoreError::Unavailable))
}

/// Counter objects the deployment's counters are spread over (`COUNTER_SHARDS`; 0: one
/// object per counter), read once per isolate (a deployment's vars do not change under it).
fn shards(env: &Env) -> u32 {
    if let Some(n) = with(|i| i.shards) {
        return n;
    }
    let n = u32::try_from(var_u64(env, "COUNTER_SHARDS", u64::from(DEFAULT_SHARDS))).unwrap_or(u32::MAX);
    with(|i| {
        i.shards = Some(n);
        i.grants.set_shards(n);
    });
    n
}

/// Counter calls to the one object `object` holding their counters, in one message: each
/// call's answer, in order (a failed call fails them all; an object's refusal one).
async fn call_batch(
    env: &Env,
    object: &str,
    calls: &[(Vec<u8>, Call)],
    timeout: Duration,
) -> Vec<std::result::Result<String, StoreError>> {
    let replies = call_body(env, object, encode_batch(calls), timeout).await.and_then(|body| {
        decode_replies(&body, calls.len()).ok_or_else(|| {
            console_error!("ratewall: counter object {object} answered a batch unreadably");
            StoreError::Unavailable
        })
    });
    match replies {
        Ok(r) => {
            // A call the object could not apply (its stored counter unreadable: `NOT_APPLIED`)
            // or refused failed as much as one whose message did.
            let refused = r.iter().filter(|r| r.as_deref().is_none_or(|r| r == NOT_APPLIED)).count() as u64;
            if refused > 0 {
                with(|i| i.metrics.object_failures += refused);
            }
            r.into_iter().map(|r| r.ok_or(StoreError::Unavailable)).collect()
        }
        Err(e) => calls.iter().map(|_| Err(e)).collect(),
    }
}

/// Counter calls on any keys: one message per object, answers in the calls' order.
async fn call_objects(
    env: &Env,
    calls: &[(Vec<u8>, Call)],
    timeout: Duration,
) -> Vec<std::result::Result<String, StoreError>> {
    let n = shards(env);
    let mut by_object: Vec<(String, Vec<usize>)> = Vec::new();
    for (i, (key, _)) in calls.iter().enumerate() {
        let object = object_name(key, n);
        match by_object.iter_mut().find(|(o, _)| *o == object) {
            Some((_, at)) => at.push(i),
            None => by_object.push((object, vec![i])),
        }
    }
    let sent = by_object.iter().map(|(object, at)| {
        let batch: Vec<(Vec<u8>, Call)> = at.iter().filter_map(|&i| calls.get(i).cloned()).collect();
        async move { call_batch(env, object, &batch, timeout).await }
    });
    let answered = join_all(sent).await;
    let mut out: Vec<std::result::Result<String, StoreError>> =
        calls.iter().map(|_| Err(StoreError::Unavailable)).collect();
    for ((_, at), replies) in by_object.iter().zip(answered) {
        for (&i, r) in at.iter().zip(replies) {
            if let Some(slot) = out.get_mut(i) {
                *slot = r;
            }
        }
    }
    out
}

/// One call to the object named `name`, with a deadline.
async fn call_named(env: &Env, name: &str, call: Call, timeout: Duration) -> std::result::Result<String, StoreError> {
    call_body(env, name, call.encode(), timeout).await
}

/// One message `body` to the object named `name`, with a deadline.
async fn call_body(env: &Env, name: &str, body: String, timeout: Duration) -> std::result::Result<String, StoreError> {
    with(|i| i.metrics.object_calls += 1);
    let attempt = async {
        let binding = var(env, "COUNTER_BINDING").unwrap_or_else(|| COUNTERS.to_owned());
        let stub = env.durable_object(&binding)?.get_by_name(name)?;
        let mut init = RequestInit::new();
        init.with_method(Method::Post).with_body(Some(JsValue::from_str(&body)));
        let req = Request::new_with_init("https://counter.ratewall/", &init)?;
        let mut resp = stub.fetch_with_request(req).await?;
        if resp.status_code() != 200 {
            return Err(worker::Error::RustError(format!("counter object answered {}", resp.status_code())));
        }
        resp.text().await
    };
    let result = match within(timeout, attempt).await {
        Some(Ok(body)) => Ok(body),
        Some(Err(e)) => {
            console_error!("ratewall: counter object failed: {e}");
            Err(StoreError::Unavailable)
        }
        None => {
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
        "method": req.inner().method(),
        "path": req.path(),
    });
    let headers = Headers::new();
    headers.set("content-type", "application/json")?;
    Ok(Response::from_bytes(body.to_string().into_bytes())?.with_headers(headers))
}

/// Sends an admitted request upstream and adds the RateLimit fields to the answer.
async fn forward(req: Request, env: &Env, fields: &[(&'static str, String)]) -> Result<Response> {
    let upgrade = req.headers().has("upgrade").unwrap_or(false);
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
        // The client's header values go on as the runtime holds them, never read into strings
        // and back: a value that is not UTF-8 came out changed (and the runtime logged it,
        // an API key included, as it was set again).
        let headers = worker::web_sys::Headers::new_with_headers(req.inner().headers().as_ref())?;
        for (name, _) in req.headers().entries().filter(|(k, _)| !forwarded_header(k)) {
            headers.delete(&name)?;
        }
        let init = worker::web_sys::RequestInit::new();
        // The method as the client sent it: workers-rs's `Method` reads any method it does not
        // name (PROPFIND, PURGE, QUERY) as GET, and a GET with a body is no request at all.
        init.set_method(&req.inner().method());
        init.set_headers(&headers);
        if let Some(body) = req.inner().body() {
            init.set_body(&body);
        }
        // A redirect is the origin's answer to the client (a login's 302 and its cookie), not
        // one for the Worker to follow.
        init.set_redirect(worker::web_sys::RequestRedirect::Manual);
        let upstream = worker::web_sys::Request::new_with_str_and_init(&target, &init)?;
        Fetch::Request(Request::from(upstream)).send().await?
    } else {
        demo_origin(&req)?
    };
    // The runtime builds a response only with a status it can send as a final one: an
    // interim `100 Continue` passed on made workers-rs panic, and the isolate started over.
    if !passable_status(resp.status_code(), upgrade) {
        console_error!("ratewall: the origin answered with status {}, which cannot be passed on", resp.status_code());
        return problem_502("the origin answered with a status that cannot be passed on", fields);
    }
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

/// `response` with its body passed through a stream, and the promise of that passing: it
/// settles once the body has been sent to the client, or the client went away (`None`: no
/// body to wait for, or a response this cannot pass through — a WebSocket's).
fn until_sent(response: Response) -> (Response, Option<worker::js_sys::Promise>) {
    let ResponseBody::Stream(body) = response.body() else { return (response, None) };
    if response.status_code() == 101 {
        return (response, None);
    }
    let Ok(pass) = worker::web_sys::TransformStream::new() else { return (response, None) };
    // Made before the body is piped (which locks it): if it cannot be, the response goes as it
    // came, and its slots are given back at once.
    let (status, headers) = (response.status_code(), response.headers().clone());
    let Ok(passed) =
        Response::from_body(ResponseBody::Stream(pass.readable())).map(|r| r.with_status(status).with_headers(headers))
    else {
        return (response, None);
    };
    let sent = body.pipe_to(&pass.writable());
    (passed, Some(sent))
}

/// The answer when the origin could not be reached: 502, an RFC 9457 body, the cause in the
/// log (never in the answer).
fn bad_gateway(e: &worker::Error, fields: &[(&'static str, String)]) -> Result<Response> {
    console_error!("ratewall: the origin could not be reached: {e}");
    problem_502("the origin could not be reached", fields)
}

/// 502 with an RFC 9457 body saying `detail`, and the admitted request's `fields` (its
/// `RateLimit` fields: it was counted, and its client sees its budget as on any answer).
fn problem_502(detail: &str, fields: &[(&'static str, String)]) -> Result<Response> {
    let body = serde_json::json!({"type": "about:blank", "title": "Bad Gateway", "status": 502, "detail": detail});
    let body = body.to_string();
    let headers = Headers::new();
    headers.set("content-type", "application/problem+json")?;
    for (name, value) in fields {
        headers.set(name, value)?;
    }
    Ok(Response::from_bytes(body.as_bytes().to_vec())?.with_status(502).with_headers(headers))
}

/// One check's answer: for an `exact` rule, the counter object's (a take, waited for); for
/// any other, the isolate's, at once (from its grant, its overdraft or its copy of the
/// counter), its units reported in the background.
async fn answer(
    env: &Env,
    ctx: &Context,
    c: &Check,
    exact: bool,
    t: Nanos,
    timeout: Duration,
) -> std::result::Result<Answer, StoreError> {
    if exact {
        return take_answer(call_object(env, &c.key, Call::Take { limit: c.limit, cost: c.cost }, timeout).await);
    }
    let local = with(|i| i.grants.check(&c.key, c.limit, c.cost, t));
    if let Local::Full(_) = local {
        // The isolate holds as many counters as it may, each owing its object units: this
        // one is decided by its object, as an exact rule's, rather than let one of them go.
        return take_answer(call_object(env, &c.key, Call::Take { limit: c.limit, cost: c.cost }, timeout).await);
    }
    schedule_report(env, ctx, &c.key, timeout);
    Ok(match local {
        Local::Short(d) => Answer::Short(d),
        Local::Unreachable(_) => return Err(StoreError::Unavailable),
        l => Answer::Grant(l.decision()),
    })
}

/// Starts the background reports of the object holding `key`'s counter unless they run:
/// a look every [`REPORT_EVERY`] while any of its counters has units waiting, and one call
/// when a report is due, bringing their next grants; or, while that task sleeps and the
/// isolate needs a grant, one call at once.
fn schedule_report(env: &Env, ctx: &Context, key: &[u8], timeout: Duration) {
    if let Some(task) = report_task(env, key, timeout) {
        ctx.wait_until(task);
    }
}

/// The task [`schedule_report`] starts, if one is to start, for the caller to run in the
/// background.
fn report_task(env: &Env, key: &[u8], timeout: Duration) -> Option<impl std::future::Future<Output = ()> + 'static> {
    shards(env);
    let (object, schedule) = with(|i| i.grants.schedule(key, now()))?;
    let env = env.clone();
    Some(async move {
        let mut delay = match schedule {
            Schedule::Reports(first) => first,
            Schedule::Once => {
                let sent = now();
                let calls = with(|i| i.grants.report_once(&object, sent));
                if !calls.is_empty() {
                    report_to(&env, &object, &calls, sent, timeout).await;
                }
                return;
            }
        };
        loop {
            if delay > 0 {
                Delay::from(Duration::from_millis(delay / MS)).await;
            }
            let sent = now();
            let Some(calls) = with(|i| i.grants.report(&object, sent)) else { break };
            if !calls.is_empty() {
                report_to(&env, &object, &calls, sent, timeout).await;
            }
            delay = REPORT_EVERY;
        }
    })
}

/// Sends the isolate's reports `calls` to `object`, and takes its answers.
async fn report_to(env: &Env, object: &str, calls: &[(Vec<u8>, Call)], sent: Nanos, timeout: Duration) {
    let replies = call_batch(env, object, calls, timeout).await;
    with(|i| {
        for ((key, call), reply) in calls.iter().zip(&replies) {
            i.grants.answered(key, call, reply.as_deref().map_err(|e| *e), sent, now());
        }
    });
}

/// Counts a request's outcome: the isolate's metrics, and its top offenders (reported to the
/// admin object in the background, at most once per `TOP_REPORT_SECONDS`).
fn count(
    env: &Env,
    ctx: &Context,
    config: &Rc<Config>,
    checks: &[Check],
    outcome: &Outcome,
    skipped: &[(usize, Skip)],
    cached: bool,
) {
    let t = now();
    with(|i| {
        i.metrics.count(config, outcome, skipped, cached);
        i.top.count(config, checks, outcome, t);
    });
    schedule_top(env, ctx);
}

fn object_timeout(env: &Env) -> Duration {
    Duration::from_millis(var_u64(env, "OBJECT_TIMEOUT_MS", 1000))
}

/// Starts the background report of what this isolate counted, unless one is scheduled: one
/// call to the admin object per interval (`TOP_REPORT_SECONDS`, 1 to 20, default 5) while
/// there is traffic, none per request.
fn schedule_top(env: &Env, ctx: &Context) {
    let every = || var_u64(env, "TOP_REPORT_SECONDS", top::REPORT_EVERY / SECOND).clamp(1, 20).saturating_mul(SECOND);
    let Some(delay) = with(|i| i.top.schedule(now(), every)) else { return };
    let (env, timeout) = (env.clone(), object_timeout(env));
    ctx.wait_until(async move {
        if delay > 0 {
            Delay::from(Duration::from_millis(delay / MS)).await;
        }
        let Some(report) = with(|i| i.top.take(i.node, now())) else { return };
        let sent = call_body(&env, ADMIN_OBJECT, TopCall::Report(report.clone()).encode(), timeout).await;
        with(|i| {
            i.metrics.top_reports += 1;
            if sent.is_err() {
                i.metrics.top_reports_failed += 1;
                i.metrics.top_reports_dropped += u64::from(!i.top.failed(report, now()));
            }
        });
    });
}

/// The admin token, if the Worker has one (a secret, or a var in local runs). A token too
/// short to be one leaves the routes off; that is logged once (never the token).
fn admin_token(env: &Env) -> Option<String> {
    let token = env
        .secret("RATEWALL_ADMIN_TOKEN")
        .map(|s| s.to_string())
        .ok()
        .or_else(|| var(env, "RATEWALL_ADMIN_TOKEN"))
        .filter(|t| !t.trim().is_empty())?;
    if token.trim().len() < admin::MIN_TOKEN && !with(|i| std::mem::replace(&mut i.admin_warned, true)) {
        console_error!(
            "ratewall: RATEWALL_ADMIN_TOKEN is shorter than {} characters; use a longer one",
            admin::MIN_TOKEN
        );
    }
    Some(token)
}

fn json_response(status: u16, body: &str) -> Result<Response> {
    let headers = Headers::new();
    headers.set("content-type", "application/json")?;
    headers.set("cache-control", "no-store")?;
    Ok(Response::from_bytes(body.as_bytes().to_vec())?.with_status(status).with_headers(headers))
}

/// The answer to a request for an admin route (`page`: the dashboard's) without the admin
/// token: 401 asking for it, or 404 while none is set.
fn refused_access(access: Access, page: bool) -> Result<Response> {
    let headers = Headers::new();
    headers.set("content-type", "text/plain; charset=utf-8")?;
    headers.set("cache-control", "no-store")?;
    if access == Access::Refused {
        headers.set("www-authenticate", "Bearer realm=\"ratewall\"")?;
    }
    let body = admin::refusal(access, page).as_bytes().to_vec();
    Ok(Response::from_bytes(body)?.with_status(access.status()).with_headers(headers))
}

/// `GET /_ratewall/top`, `GET /_ratewall/series` and the page at `GET /_ratewall/`, only for
/// the admin token (edge::admin): the answers come from the admin object, which this
/// isolate's own unreported counts reach first, with the rules in document order.
async fn admin_route(req: Request, env: Env, ctx: &Context, path: &str) -> Result<Response> {
    let page = path == PAGE_PATH || path == "/_ratewall";
    let url = req.url()?;
    let query = |name: &str| url.query_pairs().find(|(k, _)| k == name).map(|(_, v)| v.into_owned());
    let authorization = req.headers().get("authorization").ok().flatten();
    let query_token = if page { query("token") } else { None };
    let access = admin::access(admin_token(&env).as_deref(), authorization.as_deref(), query_token.as_deref());
    if access != Access::Granted {
        return refused_access(access, page);
    }
    if req.inner().method() != "GET" {
        let headers = Headers::new();
        headers.set("allow", "GET")?;
        return Ok(Response::from_bytes(b"GET only\n".to_vec())?.with_status(405).with_headers(headers));
    }
    if page {
        let headers = Headers::new();
        for (name, value) in admin::PAGE_HEADERS {
            headers.set(name, value)?;
        }
        return Ok(Response::from_bytes(admin::PAGE.as_bytes().to_vec())?.with_headers(headers));
    }
    let rule = query("rule");
    let window = match Window::parse(query("window").as_deref()) {
        Ok(w) => w,
        Err(why) => return json_response(400, &serde_json::json!({"error": why}).to_string()),
    };
    let config = rules(&env, ctx).await;
    let report = with(|i| i.top.take(i.node, now()));
    let (call, zeros) = if path == TOP_PATH {
        (TopCall::Top { window, rule: rule.clone(), report: report.clone() }, true)
    } else {
        (TopCall::Series { rule: rule.clone(), report: report.clone() }, false)
    };
    let answer = call_body(&env, ADMIN_OBJECT, call.encode(), object_timeout(&env)).await;
    with(|i| {
        let Some(report) = report else { return };
        i.metrics.top_reports += 1;
        if answer.is_err() {
            i.metrics.top_reports_failed += 1;
            i.metrics.top_reports_dropped += u64::from(!i.top.failed(report, now()));
        }
    });
    match answer.ok().and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok()) {
        Some(v) => {
            let v = top::in_document_order(config.as_deref(), rule.as_deref(), v, zeros);
            json_response(200, &v.to_string())
        }
        None => json_response(503, r#"{"error": "the admin object did not answer"}"#),
    }
}

async fn limit(req: Request, env: Env, ctx: Context) -> Result<Response> {
    let Some(config) = rules(&env, &ctx).await else {
        // Never a good rules document: serve unlimited and say so in the logs (above), and,
        // when one was rejected, in the metrics.
        with(|i| i.metrics.config_rejected += u64::from(i.rules.rejected_without_rules()));
        return forward(req, &env, &[]).await.or_else(|e| bad_gateway(&e, &[]));
    };
    // As the client sent it (see [`forward`]): a rule on PURGE matches PURGE, and one on GET
    // does not count it.
    let method = req.inner().method();
    let path = req.path();
    let (checks, skipped) = checks_for(&config, &method, &path, &|h| req.headers().get(h).ok().flatten());
    let t = now();
    let use_cache = var(&env, "BLOCKED_CACHE").as_deref() != Some("off");
    if use_cache {
        let outcome = with(|i| cached_denials(&config, &checks, t, &mut i.cache));
        if outcome.rejected {
            count(&env, &ctx, &config, &checks, &outcome, &skipped, true);
            return reply_response(&render(&config, &outcome));
        }
    }
    let timeout = Duration::from_millis(var_u64(&env, "OBJECT_TIMEOUT_MS", 1000));
    let grants_on = var(&env, "ISOLATE_GRANTS").as_deref() != Some("off");
    let calls = checks.iter().map(|c| {
        // A leaky bucket's turn is the object's queue, and requests in flight are counted
        // by the key's object for the whole edge: always decided there.
        let queues =
            matches!(c.limit.algorithm(), ratewall_core::Algorithm::LeakyBucket | ratewall_core::Algorithm::Concurrent);
        let exact = !grants_on || queues || config.rules.get(c.rule).is_none_or(|r| r.exact);
        answer(&env, &ctx, c, exact, t, timeout)
    });
    let answers = join_all(calls).await;
    let (decisions, charged) = with(|i| {
        let (decided, charged) = decisions(&config, &checks, answers, t, &mut i.fallback, &mut i.metrics);
        // A check decided on the isolate's grants while its object fails the reports is
        // degraded as much as one whose take failed: a store failure in its rule's metrics.
        for (c, a) in checks.iter().zip(&charged) {
            let on_grants = matches!(a, Some(Answer::Grant(_) | Answer::Short(_)));
            if let (true, Some(r)) = (on_grants && i.grants.failing(&c.key), config.rules.get(c.rule)) {
                i.metrics.rule(&r.name).store_failed += 1;
            }
        }
        (decided, charged)
    });
    let (mut outcome, refunds) = combine(&config, &checks, &decisions);
    // Units taken by rules that allowed a request another rule rejected go back. The client
    // gets its 429 without waiting for that.
    if !refunds.is_empty() {
        ctx.wait_until(give_back(&env, &checks, &refunds, &decisions, &charged, t, timeout));
    }
    if use_cache {
        // Denials until the counter's retry time (not those until the isolate's next grant).
        with(|i| {
            for ((c, d), a) in checks.iter().zip(&decisions).zip(&charged) {
                if let (Ok(d), Some(Answer::Object(_) | Answer::Grant(_))) = (d, a) {
                    i.cache.insert(&c.key, t, c.cost, *d);
                }
            }
        });
    }
    count(&env, &ctx, &config, &checks, &outcome, &skipped, false);
    for line in shadow_lines(&config, &outcome, &skipped, &method, &path) {
        console_log!("{line}");
    }
    // A leaky bucket's queued request waits its turn, then goes, with its fields as of then.
    let wait = if outcome.rejected { 0 } else { wait_of(&config, &checks, &decisions) };
    outcome.waited(wait);
    let reply = render(&config, &outcome);
    if reply.passes() {
        if wait > 0 {
            // While it waits, a task that outlives the request (the client may leave, ending
            // it) looks every CLIENT_POLL whether the client went away: if so the request
            // gives its turn back, and every unit it took, and is not forwarded.
            let (signal, until, gone) = (req.inner().signal(), now().saturating_add(wait), Rc::new(Cell::new(false)));
            let (left_early, env2) = (gone.clone(), env.clone());
            let all: Vec<usize> = (0..checks.len()).collect();
            let (checks, decisions, charged) = (checks.clone(), decisions.clone(), charged.clone());
            ctx.wait_until(async move {
                loop {
                    let left = until.saturating_sub(now());
                    if left == 0 {
                        return;
                    }
                    Delay::from(Duration::from_nanos(left.min(CLIENT_POLL))).await;
                    if signal.aborted() {
                        left_early.set(true);
                        with(|i| i.metrics.queue_abandoned += 1);
                        give_back(&env2, &checks, &all, &decisions, &charged, t, timeout).await;
                        return;
                    }
                }
            });
            Delay::from(Duration::from_nanos(wait)).await;
            if gone.get() {
                return Ok(Response::empty()?.with_status(499));
            }
        }
        let response = forward(req, &env, &reply.headers).await.or_else(|e| bad_gateway(&e, &reply.headers));
        // Its concurrency slots are given back once its response has completed (its body
        // sent, or the client gone): to their objects, or to the isolate's fallback that
        // decided them.
        let running = in_flight(&checks);
        if running.is_empty() {
            return response;
        }
        let locally: Vec<Check> = decided_locally(&checks, &running, &decisions, &charged).cloned().collect();
        let (slots, _) = refund_calls(&checks, &running, &charged);
        let (response, sent) = match response {
            Ok(r) => {
                let (r, sent) = until_sent(r);
                (Ok(r), sent)
            }
            Err(e) => (Err(e), None),
        };
        ctx.wait_until(async move {
            if let Some(sent) = sent {
                // Resolved when the body has been sent, rejected when the client went away.
                let _ = worker::wasm_bindgen_futures::JsFuture::from(sent).await;
            }
            with(|i| {
                for c in &locally {
                    i.fallback.refund(c, now());
                }
            });
            call_objects(&env, &slots, timeout).await;
        });
        response
    } else {
        reply_response(&reply)
    }
}

/// How often a request waiting its leaky-bucket turn looks whether its client went away.
const CLIENT_POLL: Nanos = 50 * MS;

/// Gives back what checks `which` took at `t`: at once to the isolate's grants, or to the
/// isolate's fallback that decided them, forgetting their counters' cached denials (the units
/// came back); the returned future gives the objects theirs.
fn give_back(
    env: &Env,
    checks: &[Check],
    which: &[usize],
    decisions: &[std::result::Result<ratewall_core::Decision, StoreError>],
    charged: &[Option<Answer>],
    t: Nanos,
    timeout: Duration,
) -> impl std::future::Future<Output = ()> + 'static {
    let (refunding, grant_refunds) = refund_calls(checks, which, charged);
    with(|i| {
        for (key, cost) in &grant_refunds {
            i.grants.refund(key, *cost, t);
        }
        for c in decided_locally(checks, which, decisions, charged) {
            i.fallback.refund(c, t);
        }
        for c in which.iter().filter_map(|&n| checks.get(n)) {
            i.cache.forget(&c.key);
        }
    });
    // Units already reported go back with the counter's next report: started now unless
    // the counter's task runs.
    let reports: Vec<_> = grant_refunds.iter().filter_map(|(key, _)| report_task(env, key, timeout)).collect();
    let env = env.clone();
    async move {
        join(call_objects(&env, &refunding, timeout), join_all(reports)).await;
    }
}

/// `POST /v1/sync`: a filter node's signed batch of deltas in, the global view out (signed).
async fn sync(mut req: Request, env: Env, ctx: Context) -> Result<Response> {
    let secret = env.secret("RATEWALL_SYNC_SECRET").map(|s| s.to_string()).unwrap_or_default();
    let tag = req.headers().get("x-ratewall-signature").ok().flatten();
    let refused = |r: store::Refusal| {
        with(|i| {
            i.metrics.sync_failed += 1;
            i.metrics.sync_refused_stale += u64::from(r.status == 422);
        });
        let mut out = Response::error(r.message, r.status)?;
        out.headers_mut().set("content-type", "text/plain; charset=utf-8")?;
        Ok(out)
    };
    let declared = req.headers().get("content-length").ok().flatten();
    if let Some(r) = store::declared_too_large(&secret, declared.as_deref()) {
        return refused(r);
    }
    let body = req.bytes().await?;
    // While the secret is rotated, a batch signed with the one going out is taken too, and
    // answered signed with it (docs/operations.md).
    let previous = env.secret("RATEWALL_SYNC_SECRET_PREVIOUS").map(|s| s.to_string()).unwrap_or_default();
    let (secret, batch) = match store::check_rotating(&secret, &previous, tag.as_deref(), &body, now()) {
        Ok((s, b)) => (s.to_owned(), b),
        Err(r) => return refused(r),
    };
    let timeout = Duration::from_millis(var_u64(&env, "OBJECT_TIMEOUT_MS", 1000));
    // The registry first: an older batch seq, and an ask already answered (a replay of a
    // captured one), are refused (409) before any counter sees them.
    let registry = call_named(&env, REGISTRY_OBJECT, store::heard_call(&batch), timeout);
    let counters: Vec<(Vec<u8>, Call)> =
        store::counter_calls(&batch).into_iter().map(|(k, c)| (k.to_vec(), c)).collect();
    let nodes = match store::registry_verdict(&batch, registry.await.ok().as_deref()) {
        Err(r) => return refused(r),
        Ok(n) => n,
    };
    let replies = call_objects(&env, &counters, timeout).await;
    let replies: Vec<Option<String>> = replies.into_iter().map(|r| r.ok()).collect();
    let refunds = store::ask_refunds(&batch, &replies, now());
    if !refunds.is_empty() {
        let _ = call_objects(&env, &refunds, timeout).await;
    }
    let answered = with(|i| store::answer(&secret, &batch, &replies, nodes, now(), &mut i.out));
    let (out, signature) = match answered {
        Ok(a) => a,
        Err(r) => return refused(r),
    };
    // Closed before the answer, or not answered.
    if let Some(close) = store::close_call(&batch, &replies) {
        if call_named(&env, REGISTRY_OBJECT, close, timeout).await.is_err() {
            return refused(store::Refusal {
                status: 503,
                message: "the node registry could not be written; retry the batch with the same seq".into(),
            });
        }
    }
    let headers = Headers::new();
    headers.set("content-type", "application/octet-stream")?;
    headers.set("x-ratewall-signature", &signature)?;
    with(|i| i.metrics.sync_ok += 1);
    // A batch's top section (who the node's proxy is limiting) goes to the admin object, in
    // the background: the Worker's /_ratewall/top then covers the filter fleet too.
    if let Ok((_, Some(section))) = ratewall_core::sync::SyncRequest::decode_with_top(&body) {
        let report = Report { node: batch.node, seq: batch.seq, section, series: Vec::new() };
        ctx.wait_until(async move {
            let _ = call_body(&env, ADMIN_OBJECT, TopCall::Report(report).encode(), timeout).await;
        });
    }
    Ok(Response::from_bytes(out)?.with_headers(headers))
}

#[event(fetch)]
async fn fetch(req: Request, env: Env, ctx: Context) -> Result<Response> {
    let path = req.path();
    // ratewall's own routes, a trailing slash or not (but the page's, which has one); the
    // rest of `/_ratewall/` is ratewall's too, never the origin's.
    let path = match path.strip_suffix('/') {
        Some(p) if p.starts_with(PAGE_PATH) => p.to_owned(),
        _ => path,
    };
    if path.starts_with(PAGE_PATH) && ![METRICS_PATH, TOP_PATH, SERIES_PATH, PAGE_PATH].contains(&path.as_str()) {
        return Response::error("not a ratewall route", 404);
    }
    if path == METRICS_PATH {
        // Open to scrapes by default; with `METRICS_NEED_TOKEN = "on"`, for the admin token
        // only, as Prometheus sends it (`authorization: { credentials: … }`).
        if var(&env, "METRICS_NEED_TOKEN").as_deref() == Some("on") {
            let authorization = req.headers().get("authorization").ok().flatten();
            let access = admin::access(admin_token(&env).as_deref(), authorization.as_deref(), None);
            if access != Access::Granted {
                return refused_access(access, false);
            }
        }
        return Response::ok(with(|i| {
            i.metrics.grant_admissions = i.grants.local;
            i.metrics.overdraft_admissions = i.grants.overdrafts + i.grants.first + i.grants.shared;
            i.metrics.short_denials = i.grants.short;
            i.metrics.units_dropped = i.grants.dropped;
            i.metrics.render()
        }));
    }
    if path == TOP_PATH || path == SERIES_PATH || path == PAGE_PATH || path == "/_ratewall" {
        return admin_route(req, env, &ctx, &path).await;
    }
    if path == SYNC_PATH && req.method() == Method::Post {
        return sync(req, env, ctx).await;
    }
    if path == SYNC_PATH && env.secret("RATEWALL_SYNC_SECRET").is_ok() {
        // A store's sync path takes a POST only, refused with a plain-text reason as
        // ratewall-store refuses it (not passed on to the origin).
        let mut out = Response::error("method not allowed: POST /v1/sync", 405)?;
        out.headers_mut().set("content-type", "text/plain; charset=utf-8")?;
        out.headers_mut().set("allow", "POST")?;
        return Ok(out);
    }
    if path.starts_with(PEER_PREFIX) {
        if let Ok(peer) = env.rate_limiter(PEER_LIMITER) {
            let key = req.headers().get("x-user-id").ok().flatten().unwrap_or_default();
            return match peer.limit(key).await {
                Ok(o) if !o.success => Response::error("rate limited by the ratelimit binding", 429),
                _ => forward(req, &env, &[]).await,
            };
        }
    }
    limit(req, env, ctx).await
}

/// A Durable Object holding counters — a shard of the deployment's (`s:<n>`), or one counter
/// (`c:<key hex>`, with `COUNTER_SHARDS = "0"`) — or, the one named [`REGISTRY_OBJECT`], the
/// sync store's node registry, or, the one named [`ADMIN_OBJECT`], the edge's top offenders.
/// Single-threaded, so every check is atomic and global. A counter lives in memory and is
/// read from storage (under [`storage_key`]) the first time a call names it; what to answer,
/// write and schedule is [`Shard`]'s (cloudflare-worker/src/edge/object.rs): a change from
/// the Worker's own traffic is written back by an alarm at most `FLUSH` later, a sync delta or
/// ask is written before it is acknowledged, an idle counter is deleted, and a stored value
/// that cannot be read is never replaced (its calls fail, and the rule's `on_store_failure`
/// applies).
#[durable_object]
pub struct RateLimitCounter {
    state: worker::State,
    shard: RefCell<Shard>,
    /// For the object named [`REGISTRY_OBJECT`].
    registry: RefCell<Object>,
    /// For the object named [`ADMIN_OBJECT`]: the isolates' reports, merged.
    top: RefCell<Aggregate>,
    /// For the admin object: an alarm is set to keep it in memory.
    kept_alive: Cell<bool>,
    /// When (ms) this object last said a stored counter is unreadable: at most once a minute,
    /// as every call to such a counter finds it so.
    unreadable_said: Cell<Option<u64>>,
}

/// How often the admin object wakes while its windows show anything: it keeps them in memory
/// only, and an object nothing calls for a few seconds is evicted (10 s in local workerd).
const ADMIN_KEEP_ALIVE: Duration = Duration::from_secs(5);

impl RateLimitCounter {
    /// One page of a sweep under way: the stored counters from where it stands, the idle ones
    /// memory does not hold deleted.
    async fn sweep(&self) -> Result<()> {
        let Some(from) = self.shard.borrow().sweep_from().map(str::to_owned) else { return Ok(()) };
        // "c": counters ("c:" and the key's hex), and the one value of versions before shards.
        let options = worker::ListOptions::new().prefix("c").start(&from).limit(crate::edge::object::SWEEP_PAGE);
        let listed = self.state.storage().list_with_options(options).await?;
        let mut page = Vec::new();
        listed.for_each(&mut |value, key| {
            if let (Some(k), Some(v)) = (key.as_string(), value.as_string()) {
                page.push((k, v));
            }
        });
        // In key order, as storage lists them.
        let delete = self.shard.borrow_mut().swept(&page, now());
        self.delete_all(delete).await
    }

    /// Deletes stored values, at most [`STORAGE_KEYS`] per storage call.
    async fn delete_all(&self, names: Vec<String>) -> Result<()> {
        for chunk in names.chunks(STORAGE_KEYS) {
            self.state.storage().delete_multiple(chunk.to_vec()).await?;
        }
        Ok(())
    }

    /// Reads, in one storage call, the stored counters `calls` name that are not in memory.
    /// A counter whose read failed, or whose value cannot be read, stays unread (its calls
    /// fail; it is never written over).
    async fn load_many(&self, calls: &[(Vec<u8>, Call)]) {
        let mut names: Vec<String> = Vec::new();
        for (key, _) in calls {
            let name = storage_key(key);
            if !self.shard.borrow().loaded(key) && !names.contains(&name) {
                names.push(name);
            }
        }
        if names.is_empty() {
            return;
        }
        let mut stored = Vec::new();
        for chunk in names.chunks(STORAGE_KEYS) {
            match self.state.storage().get_multiple(chunk.to_vec()).await {
                Ok(m) => stored.push(m),
                Err(e) => {
                    console_error!("ratewall: counter storage read failed: {e}");
                    return;
                }
            }
        }
        for (key, call) in calls {
            if self.shard.borrow().loaded(key) {
                continue;
            }
            let name = JsValue::from_str(&storage_key(key));
            let value = stored.iter().map(|m| m.get(&name)).find(|v| !v.is_undefined()).unwrap_or(JsValue::UNDEFINED);
            let value = match value.as_string() {
                Some(v) => Some(v),
                None if value.is_undefined() => None,
                None => {
                    if self.say_unreadable() {
                        console_error!("ratewall: a stored counter is not text; it is kept, and calls to it fail");
                    }
                    continue;
                }
            };
            if let Err(e) = self.shard.borrow_mut().load(key, value.as_deref(), call.limit()) {
                if self.say_unreadable() {
                    console_error!("ratewall: {e}; it is kept, and calls to it fail (said at most once a minute)");
                }
            }
        }
    }

    /// A call to the node registry (the object named [`REGISTRY_OBJECT`]). Its memory goes
    /// with the object (a restart, an eviction); what a replay would need survives in its
    /// storage: per node, the mark every ask of it answered was made by, read before its first
    /// call and moved on before an ask past it is answered ([`Object::load_registry`]). A
    /// captured ask sent again after a restart took its units again.
    async fn registry_call(&self, call: Call) -> Result<Response> {
        if !self.registry.borrow().registry_loaded() {
            let options = worker::ListOptions::new().prefix(ASK_MARK_PREFIX);
            let listed = match self.state.storage().list_with_options(options).await {
                Ok(listed) => listed,
                Err(e) => {
                    console_error!("ratewall: the node registry's ask marks could not be read ({e})");
                    return Response::error("the node registry could not be read", 503);
                }
            };
            let mut stored = Vec::new();
            listed.for_each(&mut |value, key| {
                if let Some(k) = key.as_string() {
                    stored.push((k, value.as_string()));
                }
            });
            let (stale, unreadable) = self.registry.borrow_mut().load_registry(&stored, now());
            if unreadable {
                console_error!(
                    "ratewall: a stored ask mark of the node registry is unreadable: its node's asks that could be \
                     replays are refused"
                );
            }
            self.delete_marks(stale).await;
        }
        let Some(handled) = self.registry.borrow_mut().handle(call, now()) else {
            return Response::error("not a registry call", 400);
        };
        let due = self.registry.borrow_mut().mark_due(now());
        if let Some(w) = due {
            if let Err(e) = self.state.storage().put(&w.key, w.mark.to_string()).await {
                console_error!("ratewall: the node registry's ask mark could not be written ({e})");
                return Response::error("the node registry could not be written", 503);
            }
            self.registry.borrow_mut().mark_written(w.node, w.mark);
            self.delete_marks(w.delete).await;
        }
        Response::ok(handled.reply)
    }

    /// Deletes the node registry's stale ask marks (a failure is said: they are deleted at a
    /// later restart).
    async fn delete_marks(&self, keys: Vec<String>) {
        if let Err(e) = self.delete_all(keys).await {
            console_error!("ratewall: stale ask marks of the node registry could not be deleted ({e})");
        }
    }

    /// Whether an unreadable stored counter is to be said now (at most once a minute).
    fn say_unreadable(&self) -> bool {
        let now = Date::now().as_millis();
        if self.unreadable_said.get().is_some_and(|at| now.saturating_sub(at) < 60_000) {
            return false;
        }
        self.unreadable_said.set(Some(now));
        true
    }

    /// Writes counters' values in one storage call.
    async fn write_all(&self, values: Vec<(Vec<u8>, String)>) -> Result<()> {
        for chunk in values.chunks(STORAGE_KEYS) {
            let object = worker::js_sys::Object::new();
            for (key, value) in chunk {
                worker::js_sys::Reflect::set(
                    &object,
                    &JsValue::from_str(&storage_key(key)),
                    &JsValue::from_str(value),
                )?;
            }
            self.state.storage().put_multiple_raw(object).await?;
            let mut shard = self.shard.borrow_mut();
            for (key, _) in chunk {
                shard.flushed(key);
            }
        }
        Ok(())
    }

    async fn set_alarm(&self, at: Option<Nanos>) -> Result<()> {
        match at {
            Some(at) => self.state.storage().set_alarm(Duration::from_millis(at.saturating_sub(now()) / MS)).await,
            None => Ok(()),
        }
    }

    /// Counter calls, each on its key's counter: the answers in order (`None` for a call
    /// that failed: its counter could not be read, or what it acknowledges not written).
    async fn batch(&self, calls: Vec<(Vec<u8>, Call)>) -> Vec<Option<String>> {
        let mut replies: Vec<Option<String>> = Vec::with_capacity(calls.len());
        let mut writes: Vec<(Vec<u8>, String)> = Vec::new();
        let mut alarm_at: Option<Nanos> = None;
        let mut first_write: Option<usize> = None;
        self.load_many(&calls).await;
        for (n, (key, call)) in calls.into_iter().enumerate() {
            if !self.shard.borrow().loaded(&key) {
                replies.push(Some(NOT_APPLIED.to_owned()));
                continue;
            }
            let handled = self.shard.borrow_mut().handle(&key, call, now());
            let Some(handled) = handled else {
                replies.push(None);
                continue;
            };
            if let Some(w) = handled.write_now {
                first_write = Some(first_write.unwrap_or(n));
                writes.retain(|(k, _)| *k != key);
                writes.push((key, w));
            }
            alarm_at = earliest(alarm_at, handled.alarm_at);
            replies.push(Some(handled.reply));
        }
        // Before the answers: the units the nodes are told were counted are in storage, in
        // one write. A write that fails fails every call from the first that wrote (their
        // nodes send them again, with their `seq`).
        if let Some(first) = first_write {
            if let Err(e) = self.write_all(writes).await {
                console_error!("ratewall: counter storage write failed: {e}");
                for slot in replies.iter_mut().skip(first) {
                    *slot = None;
                }
            }
        }
        self.shard.borrow_mut().trim();
        if let Err(e) = self.set_alarm(alarm_at).await {
            console_error!("ratewall: the counter object's alarm could not be set ({e})");
            self.shard.borrow_mut().alarm_unset();
        }
        replies
    }
}

impl DurableObject for RateLimitCounter {
    fn new(state: worker::State, _env: Env) -> Self {
        RateLimitCounter {
            state,
            shard: RefCell::new(Shard::default()),
            registry: RefCell::new(Object::default()),
            top: RefCell::new(Aggregate::default()),
            kept_alive: Cell::new(false),
            unreadable_said: Cell::new(None),
        }
    }

    async fn fetch(&self, mut req: Request) -> Result<Response> {
        let body = req.text().await?;
        if let Some(calls) = decode_batch(&body) {
            return Response::ok(encode_replies(&self.batch(calls).await));
        }
        let call = Call::decode(&body);
        if let Some(call) = call.filter(|c| c.limit().is_some()) {
            // One counter call without a key: an isolate of a version before shard objects,
            // still running while a deploy rolls out, calling its counter's own object. Its
            // counter is the object's keyless one (a fresh count, as after any upgrade), so
            // the rule keeps working instead of falling back to its failure policy.
            return match self.batch(vec![(Vec::new(), call)]).await.pop().flatten() {
                Some(reply) => Response::ok(reply),
                None => Response::error("the counter could not be read or written", 503),
            };
        }
        if let Some(call @ (Call::Heard { .. } | Call::Close { .. })) = call {
            return self.registry_call(call).await;
        }
        if let Some(call) = TopCall::decode(&body) {
            let answer = self.top.borrow_mut().handle(call, now() / SECOND);
            if !self.kept_alive.get() && self.top.borrow().holds(now() / SECOND) {
                self.state.storage().set_alarm(ADMIN_KEEP_ALIVE).await?;
                self.kept_alive.set(true);
            }
            return Response::ok(answer);
        }
        Response::error("not a counter call", 400)
    }

    async fn alarm(&self) -> Result<Response> {
        // The admin object, while its windows show anything: woken again before it would be
        // evicted with them. It has no counter.
        if self.kept_alive.get() {
            if self.top.borrow().holds(now() / SECOND) {
                self.state.storage().set_alarm(ADMIN_KEEP_ALIVE).await?;
            } else {
                self.kept_alive.set(false);
            }
            return Response::ok("");
        }
        // Stored counters memory does not hold (after a restart, or dropped from memory):
        // a page of them judged, the idle ones deleted. A counter is never deleted unread.
        if let Err(e) = self.sweep().await {
            console_error!("ratewall: sweeping the stored counters failed ({e}); they are kept");
        }
        let plan = self.shard.borrow_mut().alarm(now());
        let deleted = self.delete_all(plan.delete.iter().map(|k| storage_key(k)).collect()).await;
        let written = self.write_all(plan.write).await;
        let alarm_at = match (deleted, written) {
            (Ok(()), Ok(())) => plan.alarm_at,
            (d, w) => {
                let e = d.err().or(w.err()).map(|e| e.to_string()).unwrap_or_default();
                console_error!("ratewall: counter storage write failed ({e}); tried again in a second");
                Some(self.shard.borrow_mut().alarm_failed(now()))
            }
        };
        if let Err(e) = self.set_alarm(alarm_at).await {
            console_error!("ratewall: the counter object's alarm could not be set ({e})");
            self.shard.borrow_mut().alarm_unset();
        }
        Response::ok("")
    }
}
