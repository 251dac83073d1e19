//! `ratewall-store`: serves `POST /v1/sync`, `GET /healthz` (and envoyproxy/ratelimit's
//! `GET /healthcheck`) and `GET /metrics` over Redis.
//!
//! ```text
//! RATEWALL_SYNC_SECRET=<at least 16 chars> \
//! ratewall-store --listen 127.0.0.1:8090 --redis redis://127.0.0.1:6379 [--redis URL ...] [--cluster] [--deadline-ms 50]
//!                [--rls 127.0.0.1:8081 --rls-config ratelimit-config.yaml]
//! ```
//!
//! With `--rls-config` it also answers Envoy's rate limit service: gRPC `ShouldRateLimit` on
//! `--rls`, and `POST /json` on `--listen`.

/// mimalloc rather than the system allocator: a rate limit service call allocates and frees
/// small buffers on tokio's worker threads (gRPC frames, descriptors, header fields), where
/// glibc's malloc took about a sixth of the process's time (perf, the `rls` bench's hot
/// descriptor); measured in `cargo bench -p ratewall-store --bench rls` (BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use ratewall_core::Nanos;
use ratewall_store::redis_kv::RedisKv;
use ratewall_store::rls::config::RlsConfig;
use ratewall_store::rls::Rls;
use ratewall_store::Quiet;
use ratewall_store::{Kv, Store, MAX_BODY};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OnceCell;

const USAGE: &str =
    "usage: RATEWALL_SYNC_SECRET=<at least 16 characters> [RATEWALL_SYNC_SECRET_PREVIOUS=<the one being \
rotated out>] ratewall-store --listen ADDR:PORT --redis URL [--redis URL ...] [--cluster] [--deadline-ms N] \
[--rls ADDR:PORT --rls-config FILE_OR_DIR] [--admin ADDR:PORT]";

struct Args {
    listen: String,
    redis: Vec<String>,
    cluster: bool,
    deadline: Duration,
    /// Where Envoy's rate limit service listens (gRPC).
    rls: Option<String>,
    /// envoyproxy/ratelimit's configuration: a YAML file or a directory of them.
    rls_config: Option<std::path::PathBuf>,
    /// The admin listener's address (none: off).
    admin: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = std::env::args().skip(1);
    let (mut listen, mut redis, mut cluster, mut deadline_ms) = (None, Vec::new(), false, 50u64);
    let (mut rls, mut rls_config) = (None, None);
    let mut admin = None;
    // An option given twice is an error, not the last one silently.
    fn once<T>(slot: &mut Option<T>, flag: &str, value: Option<T>, what: &str) -> Result<(), String> {
        if slot.is_some() {
            return Err(format!("{flag} is given twice"));
        }
        *slot = Some(value.ok_or(format!("{flag} needs {what}"))?);
        Ok(())
    }
    while let Some(a) = args.next() {
        match a.as_str() {
            "--listen" => once(&mut listen, "--listen", args.next(), "an address")?,
            "--redis" => redis.push(args.next().ok_or("--redis needs a URL")?),
            "--cluster" => cluster = true,
            "--admin" => once(&mut admin, "--admin", args.next(), "an address")?,
            "--deadline-ms" => {
                let v = args.next().ok_or("--deadline-ms needs a number")?;
                deadline_ms =
                    v.parse().ok().filter(|ms| (1..=60_000).contains(ms)).ok_or_else(|| {
                        format!("--deadline-ms: {v:?} is not a number of milliseconds from 1 to 60000")
                    })?;
            }
            "--rls" => once(&mut rls, "--rls", args.next(), "an address")?,
            "--rls-config" => {
                once(&mut rls_config, "--rls-config", args.next().map(Into::into), "a file or directory")?;
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let listen = listen.ok_or(format!("--listen is required\n{USAGE}"))?;
    if redis.is_empty() {
        return Err(format!("--redis is required\n{USAGE}"));
    }
    if redis.len() > 1 && !cluster {
        return Err(format!("several --redis URLs are the nodes of a Cluster: add --cluster, or give one\n{USAGE}"));
    }
    for url in &redis {
        redis::IntoConnectionInfo::into_connection_info(url.as_str())
            .map_err(|e| format!("--redis {}: not a Redis URL ({e})", redacted(url)))?;
    }
    if rls.is_some() && rls_config.is_none() {
        return Err(format!("--rls needs --rls-config\n{USAGE}"));
    }
    Ok(Args { listen, redis, cluster, deadline: Duration::from_millis(deadline_ms), rls, rls_config, admin })
}

/// A Redis URL as it may be logged: without its password, whether in the user part
/// (`redis://:pw@host`) or in the query (`redis+unix:///run/redis.sock?pass=pw`), so the query
/// is not shown at all.
fn redacted(url: &str) -> String {
    let url = match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => format!("{}://…@{}", &url[..scheme], &url[at + 1..]),
        _ => url.to_owned(),
    };
    url.split_once('?').map_or(url.clone(), |(base, _)| format!("{base}?…"))
}

/// Redis, connected on first use (and retried until it answers), so the store starts — and
/// answers 503 — while Redis is not there yet.
struct LazyKv {
    urls: Arc<Vec<String>>,
    cluster: bool,
    conn: Arc<OnceCell<RedisKv>>,
    /// The attempts to connect: one at a time, at most every [`LazyKv::RETRY`], each in a task
    /// of its own (a call whose deadline passes leaves it running), and why the last failed.
    /// Every call made while none is connected had tried one of its own: a fleet's batches
    /// were as many connections a second, each cut off by its 50 ms deadline before a Redis
    /// further than that could answer it.
    attempt: Arc<std::sync::Mutex<Attempt>>,
    /// Woken when an attempt ends.
    ended: Arc<tokio::sync::Notify>,
    /// Why Redis cannot be reached is said at most once per [`Quiet::EVERY`].
    unreachable: Arc<Quiet>,
    /// Why a command failed once connected (Redis stopped, restarted, out of memory), as
    /// often.
    failing: Quiet,
}

/// Whether an attempt to connect runs, when the last ended, and why it failed.
#[derive(Default)]
struct Attempt {
    running: bool,
    ended: Option<std::time::Instant>,
    why: Option<String>,
}

impl LazyKv {
    /// How long an attempt to connect may take.
    const WAIT: Duration = Duration::from_millis(500);
    /// How long after a failed attempt the next may start.
    const RETRY: Duration = Duration::from_millis(250);

    fn new(urls: Vec<String>, cluster: bool) -> LazyKv {
        LazyKv {
            urls: Arc::new(urls),
            cluster,
            conn: Arc::new(OnceCell::new()),
            attempt: Arc::default(),
            ended: Arc::default(),
            unreachable: Arc::default(),
            failing: Quiet::default(),
        }
    }

    /// Redis, connected, or why not (as Redis or the connection said it: a wrong password is
    /// told apart from a Redis that is not there). Waits for an attempt under way, or starts
    /// one when the last ended [`LazyKv::RETRY`] ago or more; else answers at once.
    async fn connected(&self) -> Result<&RedisKv, String> {
        if let Some(c) = self.conn.get() {
            return Ok(c);
        }
        let ended = self.ended.notified();
        tokio::pin!(ended);
        ended.as_mut().enable();
        let wait = {
            let Ok(mut a) = self.attempt.lock() else { return Err("Redis unreachable".to_owned()) };
            if a.running {
                true
            } else if a.ended.is_some_and(|at| at.elapsed() < Self::RETRY) || self.conn.get().is_some() {
                false
            } else {
                a.running = true;
                self.attempt_now();
                true
            }
        };
        if wait {
            // A little past the attempt's own limit, so the waiter hears how it ended.
            let _ = tokio::time::timeout(Self::WAIT + Duration::from_millis(100), ended).await;
        }
        if let Some(c) = self.conn.get() {
            return Ok(c);
        }
        let why = self.attempt.lock().ok().and_then(|a| a.why.clone());
        Err(why.unwrap_or_else(|| "Redis unreachable: connecting".to_owned()))
    }

    /// Starts an attempt to connect, in a task of its own.
    fn attempt_now(&self) {
        let (urls, cluster, conn) = (Arc::clone(&self.urls), self.cluster, Arc::clone(&self.conn));
        let (attempt, ended, unreachable) =
            (Arc::clone(&self.attempt), Arc::clone(&self.ended), Arc::clone(&self.unreachable));
        /// Ends the attempt however its task ends (a panic in the connection included: the
        /// next call starts another, rather than wait for one that never ends).
        struct Ending(Arc<std::sync::Mutex<Attempt>>, Arc<tokio::sync::Notify>, Option<String>);
        impl Drop for Ending {
            fn drop(&mut self) {
                if let Ok(mut a) = self.0.lock() {
                    let why = self.2.take().or_else(|| Some("Redis unreachable: the attempt to connect failed".into()));
                    *a = Attempt { running: false, ended: Some(std::time::Instant::now()), why };
                }
                self.1.notify_waiters();
            }
        }
        tokio::spawn(async move {
            let mut ending = Ending(attempt, ended, None);
            let reason = match tokio::time::timeout(Self::WAIT, RedisKv::connect(&urls, cluster)).await {
                Ok(Ok(kv)) => {
                    let _ = conn.set(kv);
                    ending.2 = Some("Redis connected".to_owned());
                    return;
                }
                Ok(Err(e)) => e,
                Err(_) => format!("no connection within {} ms", Self::WAIT.as_millis()),
            };
            unreachable.log(&format!("cannot reach Redis yet: {reason}"), "failed attempt(s)");
            ending.2 = Some(format!("Redis unreachable: {reason}"));
        });
    }

    /// Redis's `maxmemory-policy`, if it is reached and tells.
    async fn eviction_policy(&self) -> Option<String> {
        self.connected().await.ok()?.eviction_policy().await
    }

    /// `r`, its failure said (at most once per [`Quiet::EVERY`]).
    fn noted<T>(&self, r: Result<T, String>) -> Result<T, String> {
        if let Err(e) = &r {
            self.failed(e);
        }
        r
    }

    fn failed(&self, why: &str) {
        self.failing.log(&format!("a Redis command failed: {why}"), "failed command(s)");
    }
}

impl Kv for LazyKv {
    async fn read(&self, key: &str) -> Result<(Option<Vec<u8>>, Nanos), String> {
        self.noted(self.connected().await?.read(key).await)
    }
    async fn cas(
        &self,
        key: &str,
        old: Option<&[u8]>,
        new: &[u8],
        ttl_ms: u64,
        deadline_ms: u64,
    ) -> Result<ratewall_store::Cas, String> {
        self.noted(self.connected().await?.cas(key, old, new, ttl_ms, deadline_ms).await)
    }
    async fn heard(
        &self,
        node: u64,
        seq: u64,
        batch: bool,
        sent: Nanos,
    ) -> Result<(u32, Vec<u64>), ratewall_store::Unheard> {
        let kv = self.connected().await.map_err(ratewall_store::Unheard::Failed)?;
        let heard = kv.heard(node, seq, batch, sent).await;
        if let Err(ratewall_store::Unheard::Failed(e)) = &heard {
            self.failed(&format!("the node registry could not be read or written: {e}"));
        }
        heard
    }
    async fn close(&self, node: u64, seq: u64) -> Result<(), String> {
        self.noted(self.connected().await?.close(node, seq).await)
    }
    async fn present(
        &self,
        node: u64,
        low: &[(String, Nanos)],
        seen: &str,
    ) -> Result<ratewall_store::Presence, String> {
        self.noted(self.connected().await?.present(node, low, seen).await)
    }
    async fn ping(&self) -> Result<(), String> {
        let kv = self.connected().await?;
        let answered = tokio::time::timeout(Duration::from_millis(500), kv.ping()).await;
        let r = answered.unwrap_or_else(|_| Err("no answer within 500 ms".into()));
        if let Err(e) = &r {
            self.failed(&format!("the health check's write: {e}"));
        }
        r
    }
    async fn append(&self, key: &str, payload: &[u8], len: u64, ttl_ms: u64) -> Result<(), String> {
        self.noted(self.connected().await?.append(key, payload, len, ttl_ms).await)
    }
    async fn read_after(&self, key: &str, after: Option<&str>, count: usize) -> Result<(String, Vec<Vec<u8>>), String> {
        self.noted(self.connected().await?.read_after(key, after, count).await)
    }
}

type Shared = Arc<Store<LazyKv>>;
type SharedRls = Arc<Rls<LazyKv>>;

/// A request's declared length (`Content-Length`), if any.
fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(axum::http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok())
}

/// KiB of request bodies the store holds at once, being read or read: a request holds its
/// declared length (its limit, when it declares none) from before its body is read until it is
/// answered, so that the connections it serves (up to 16,384) cannot each hold a body of the
/// largest size. Past it a request waits up to [`BODY_WAIT`] for room, then is answered 503.
const BODY_BUDGET_KIB: usize = 64 * 1024;

/// How long a request waits for room in [`BODY_BUDGET_KIB`].
const BODY_WAIT: Duration = Duration::from_millis(500);

/// The room left in [`BODY_BUDGET_KIB`], in KiB.
static BODIES: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(BODY_BUDGET_KIB);

/// Why a request's body was not read whole.
#[derive(Debug, PartialEq, Eq)]
enum Unread {
    /// The store holds [`BODY_BUDGET_KIB`] of bodies already.
    Busy,
    /// Past the limit (read up to it, no further).
    TooLarge,
    /// Not all of it arrived within [`conn::BODY`].
    Slow,
    /// The connection failed, or the body was malformed (a bad chunk).
    Broken,
}

/// A request's body, read whole within [`conn::BODY`] and at most `limit` bytes (`declared`:
/// its `Content-Length`), with its room in [`BODY_BUDGET_KIB`], held until it is dropped. A
/// body past `limit` is read on and thrown away ([`drain`]) before it is refused.
async fn read_body(
    body: axum::body::Body,
    limit: usize,
    declared: Option<u64>,
) -> Result<(Bytes, tokio::sync::SemaphorePermit<'static>), Unread> {
    use http_body_util::BodyExt as _;
    let bytes = declared.map_or(limit, |n| usize::try_from(n).unwrap_or(limit).min(limit));
    let kib = u32::try_from(bytes.div_ceil(1024).max(1)).unwrap_or(u32::MAX);
    let room = match tokio::time::timeout(BODY_WAIT, BODIES.acquire_many(kib)).await {
        Ok(Ok(room)) => room,
        _ => return Err(Unread::Busy),
    };
    let mut body = body;
    let read = async {
        let mut whole = Vec::with_capacity(bytes);
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame.map_err(|_| Unread::Broken)?.into_data() else { continue };
            if whole.len().saturating_add(data.len()) > limit {
                return Err(Unread::TooLarge);
            }
            whole.extend_from_slice(&data);
        }
        Ok(Bytes::from(whole))
    };
    match tokio::time::timeout(conn::BODY, read).await {
        Ok(Ok(bytes)) => Ok((bytes, room)),
        Ok(Err(Unread::TooLarge)) => {
            drop(room);
            drain(body).await;
            Err(Unread::TooLarge)
        }
        Ok(Err(e)) => Err(e),
        Err(_) => Err(Unread::Slow),
    }
}

/// The most of a body refused as too large that is read and thrown away before the refusal
/// is sent, and for how long at most.
const DRAIN: (u64, Duration) = (8 << 20, Duration::from_secs(2));

/// [`drain`] for a body refused on its declared length: not one declared past [`DRAIN`]'s
/// most, which is refused at once.
async fn drain_declared(body: axum::body::Body, declared: Option<u64>) {
    if declared.is_some_and(|n| n <= DRAIN.0) {
        drain(body).await;
    }
}

/// Reads what is left of `body` and throws it away, up to [`DRAIN`]: a client still sending a
/// body refused as too large then reads its 413. Answered with the body unread, the connection
/// was closed under the client's writes, and the answer was lost with it (a client sending
/// 1 MiB and a byte read no 413 in 11 of 20 tries).
async fn drain(mut body: axum::body::Body) {
    use http_body_util::BodyExt as _;
    let (most, within) = DRAIN;
    let _ = tokio::time::timeout(within, async {
        let mut read = 0u64;
        while read <= most {
            match body.frame().await {
                Some(Ok(frame)) => read = read.saturating_add(frame.data_ref().map_or(0, |d| d.len() as u64)),
                _ => break,
            }
        }
    })
    .await;
}

/// 408 for a body that did not arrive in time, in `content_type`; the connection is closed.
fn too_slow(content_type: &'static str, body: String) -> Response {
    let mut out = (StatusCode::REQUEST_TIMEOUT, body).into_response();
    out.headers_mut().insert("content-type", HeaderValue::from_static(content_type));
    out.headers_mut().insert("connection", HeaderValue::from_static("close"));
    out
}

/// The reason given for a request turned away for [`BODY_BUDGET_KIB`].
fn busy_reason() -> String {
    format!("the store holds {} MiB of request bodies already: try again", BODY_BUDGET_KIB / 1024)
}

/// The reason given for a body that did not arrive in time.
fn slow_reason() -> String {
    format!("the request body did not arrive within {} s", conn::BODY.as_secs())
}

/// `POST /json`: envoyproxy/ratelimit's JSON twin of `ShouldRateLimit`. Every refusal is a
/// JSON `{"error": …}`: 400 for a malformed call (one over [`json::MAX_BODY`] included), 408
/// for one whose body did not arrive in time.
async fn rls_json(State(rls): State<SharedRls>, headers: HeaderMap, body: axum::body::Body) -> Response {
    use ratewall_store::rls::{json, Refusal};
    let too_large = || Refusal::Invalid(format!("a call is at most {} bytes", json::MAX_BODY));
    let declared = declared_length(&headers);
    let result = if declared.is_some_and(|n| n > json::MAX_BODY as u64) {
        drain_declared(body, declared).await;
        Err(too_large())
    } else {
        match read_body(body, json::MAX_BODY, declared).await {
            Ok((body, _room)) => match json::call_of(&body) {
                Ok(call) => rls.should_rate_limit(&call).await,
                Err(why) => Err(Refusal::Invalid(why)),
            },
            Err(Unread::TooLarge) => Err(too_large()),
            Err(Unread::Broken) => Err(Refusal::Invalid("the body could not be read".into())),
            Err(Unread::Slow) => {
                return too_slow("application/json", serde_json::json!({"error": slow_reason()}).to_string())
            }
            Err(Unread::Busy) => {
                let body = serde_json::json!({"error": busy_reason()}).to_string();
                return (StatusCode::SERVICE_UNAVAILABLE, [("content-type", "application/json")], body).into_response();
            }
        }
    };
    let (status, body) = json::http(&result);
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut out = (status, body).into_response();
    out.headers_mut().insert("content-type", HeaderValue::from_static("application/json"));
    out
}

async fn sync(State(store): State<Shared>, headers: HeaderMap, body: axum::body::Body) -> Response {
    // Several signature fields read as one, their values joined as the Worker's runtime joins
    // them (so never as a valid signature): the first alone had a good one beside a forged one
    // accepted here and refused by the Worker.
    let signatures: Vec<&[u8]> = headers.get_all("x-ratewall-signature").iter().map(HeaderValue::as_bytes).collect();
    let joined = signatures.join(&b", "[..]);
    let signature = (!signatures.is_empty()).then_some(joined.as_slice());
    // A body declared over `MAX_BODY` is refused unread (thrown away as it comes), as the
    // store refuses any body over it, and counted.
    let declared = declared_length(&headers);
    let a = if declared.is_some_and(|n| n > MAX_BODY as u64) {
        drain_declared(body, declared).await;
        store.sync_too_large()
    } else {
        match read_body(body, MAX_BODY + 1, declared).await {
            Ok((body, _room)) => store.sync(&body, signature).await,
            // Past `MAX_BODY` + 1 bytes read: cut off there.
            Err(Unread::TooLarge) => store.sync_too_large(),
            Err(Unread::Slow) => {
                store.sync_refused(408);
                return too_slow("text/plain; charset=utf-8", slow_reason());
            }
            Err(Unread::Broken) => {
                store.sync_refused(400);
                return (StatusCode::BAD_REQUEST, "the body could not be read").into_response();
            }
            Err(Unread::Busy) => {
                store.sync_refused(503);
                let text = [("content-type", "text/plain; charset=utf-8")];
                return (StatusCode::SERVICE_UNAVAILABLE, text, busy_reason()).into_response();
            }
        }
    };
    let status = StatusCode::from_u16(a.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut out = (status, a.body).into_response();
    match a.signature.and_then(|s| HeaderValue::from_str(&s).ok()) {
        Some(sig) => {
            out.headers_mut().insert("x-ratewall-signature", sig);
            out.headers_mut().insert("content-type", HeaderValue::from_static("application/octet-stream"));
        }
        // A refusal's body is its plain-text reason, as the Worker's.
        None => {
            out.headers_mut().insert("content-type", HeaderValue::from_static("text/plain; charset=utf-8"));
        }
    }
    out
}

async fn healthz(State(store): State<Shared>) -> Response {
    ratewall_store::admin::health(&store).await
}

/// `GET /healthcheck`, envoyproxy/ratelimit's: 200 `OK` when Redis answers, else 500.
async fn healthcheck(State(store): State<Shared>) -> Response {
    if store.kv.ping().await.is_ok() {
        (StatusCode::OK, "OK").into_response()
    } else {
        StatusCode::INTERNAL_SERVER_ERROR.into_response()
    }
}

fn main() -> std::process::ExitCode {
    if std::env::args().skip(1).any(|a| a == "-h" || a == "--help") {
        ratewall_store::out_line!("{USAGE}");
        return std::process::ExitCode::SUCCESS;
    }
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            // Not `log_line!`: the usage after the reason is lines of its own.
            let _ = std::io::Write::write_fmt(&mut std::io::stderr().lock(), format_args!("ratewall-store: {e}\n"));
            return std::process::ExitCode::from(2);
        }
    };
    let secret = std::env::var("RATEWALL_SYNC_SECRET").unwrap_or_default();
    if secret.chars().count() < 16 {
        ratewall_store::log_line!(
            "ratewall-store: set RATEWALL_SYNC_SECRET to the filters' sync secret (at least 16 characters)"
        );
        return std::process::ExitCode::from(2);
    }
    // While the secret is rotated, the one going out (docs/operations.md).
    let previous = std::env::var("RATEWALL_SYNC_SECRET_PREVIOUS").unwrap_or_default();
    if !previous.is_empty() && previous.chars().count() < 16 {
        ratewall_store::log_line!(
            "ratewall-store: RATEWALL_SYNC_SECRET_PREVIOUS, when set, is a secret of at least 16 characters"
        );
        return std::process::ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            ratewall_store::log_line!("ratewall-store: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(args, secret, previous)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            ratewall_store::log_line!("ratewall-store: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn serve(args: Args, secret: String, previous: String) -> Result<(), String> {
    let (gate, admin_gate) = conn::Gate::new();
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let kv = LazyKv::new(args.redis.clone(), args.cluster);
    let store: Shared =
        Arc::new(Store::new(kv, secret.as_bytes(), args.deadline).with_previous_secret(previous.as_bytes()));
    let stopping = Stopping::on_signal();
    let running = match &args.rls_config {
        Some(path) => Some(start_rls(&store, path, args.rls.as_deref(), secret.as_bytes(), &stopping, &gate).await?),
        None => None,
    };
    let rls = running.as_ref().map(|r| Arc::clone(&r.rls));
    if let Err(e) = store.kv.ping().await {
        ratewall_store::log_line!(
            "ratewall-store: Redis does not take the store's writes yet ({e}); /v1/sync answers 503 until it does"
        );
    }
    if let Some(policy) = store.kv.eviction_policy().await.filter(|p| p != "noeviction") {
        ratewall_store::log_line!(
            "ratewall-store: warning: Redis's maxmemory-policy is {policy}: when Redis is full it evicts counters (each a quota given again, unsaid); run it with noeviction (docs/deploy.md)"
        );
    }
    // A process with an admin listener merges what its peers share from here on.
    let joined = if args.admin.is_some() { store.join_shares().await } else { None };
    let admin = match &args.admin {
        Some(a) => {
            let l = tokio::net::TcpListener::bind(a).await.map_err(|e| format!("cannot listen on --admin {a}: {e}"))?;
            let at = l.local_addr().map_err(|e| e.to_string())?;
            Some((l, at))
        }
        None => None,
    };
    // Said once every listener is bound and the configuration read (a process that says it
    // listens serves), and first: its address is the first a reader of the output finds.
    let redis: Vec<String> = args.redis.iter().map(|u| redacted(u)).collect();
    let mode = if args.cluster { "Cluster" } else { "single server" };
    let json = if args.rls_config.is_some() { ", POST /json" } else { "" };
    ratewall_store::out_line!(
        "ratewall-store: listening on http://{addr} (POST /v1/sync{json}, GET /healthz, GET /healthcheck, GET /metrics); Redis {} ({mode}); deadline {} ms",
        redis.join(", "),
        args.deadline.as_millis()
    );
    for line in running.iter().flat_map(|r| &r.announce) {
        ratewall_store::out_line!("{line}");
    }
    let admin = admin.map(|(l, at)| {
        ratewall_store::out_line!("ratewall-store: admin on http://{at}/ (GET /, /v1/top, /v1/series, /v1/fleet, /metrics, /healthz, /healthcheck; no authentication)");
        l
    });
    // Every process shares what its batches said; one with an admin listener also reads its
    // peers', so its /v1/top and /v1/fleet cover the whole fleet.
    let sharing = Arc::clone(&store);
    let reads = admin.is_some();
    tokio::spawn(async move { sharing.share_top_forever(reads, joined).await });
    let limits = conn::Limits { head: conn::HEAD, idle: conn::IDLE };
    let admin = admin.map(|l| {
        let router = ratewall_store::admin::router(Arc::clone(&store), rls.clone())
            .merge(Router::new().route("/healthcheck", get(healthcheck)).with_state(Arc::clone(&store)));
        tokio::spawn(serve_http(
            conn::Listener::new(l, limits, &admin_gate),
            router,
            "admin listener",
            stopping.clone(),
        ))
    });
    let for_metrics = rls.clone();
    let mut app = Router::new()
        .route(
            "/v1/sync",
            post(sync).fallback(|| async {
                post_only(plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed: POST /v1/sync"))
            }),
        )
        .route("/healthz", get(healthz))
        .route("/healthcheck", get(healthcheck))
        .route(
            "/metrics",
            get(move |State(store): State<Shared>| async move {
                ratewall_store::admin::metrics(&store, for_metrics.as_deref())
            }),
        )
        .with_state(store);
    let json = rls.is_some();
    if let Some(rls) = rls {
        app = app.merge(
            Router::new()
                .route(
                    "/json",
                    post(rls_json).fallback(|| async {
                        // Refused as every call of this path is: a JSON `{"error": …}`.
                        let body = serde_json::json!({"error": "method not allowed: POST /json"}).to_string();
                        post_only((StatusCode::METHOD_NOT_ALLOWED, [("content-type", "application/json")], body))
                    }),
                )
                .with_state(rls),
        );
    }
    // Every answer has a plain-text reason, as the sync protocol's refusals do.
    let app = app
        .fallback(move || async move {
            plain(axum::http::StatusCode::NOT_FOUND, if json { NOT_FOUND_JSON } else { NOT_FOUND })
        })
        .method_not_allowed_fallback(|| async {
            plain(axum::http::StatusCode::METHOD_NOT_ALLOWED, "method not allowed: POST /v1/sync, GET for the others")
        });
    serve_http(conn::Listener::new(listener, limits, &gate), app, "listener", stopping).await;
    if let Some(admin) = admin {
        let _ = admin.await;
    }
    if let Some(r) = running {
        r.stop(args.deadline).await;
    }
    Ok(())
}

/// An answer of `status` with `why` as its plain-text body.
/// The main listener's answer to a path it does not serve, without and with `--rls`.
const NOT_FOUND: &str =
    "not found: this listener serves POST /v1/sync, GET /healthz, GET /healthcheck and GET /metrics";
const NOT_FOUND_JSON: &str =
    "not found: this listener serves POST /v1/sync, POST /json, GET /healthz, GET /healthcheck and GET /metrics";

/// `refusal` (a 405) with `Allow: POST`.
fn post_only(refusal: impl IntoResponse) -> Response {
    let mut out = refusal.into_response();
    out.headers_mut().insert("allow", HeaderValue::from_static("POST"));
    out
}

fn plain(status: axum::http::StatusCode, why: &'static str) -> impl axum::response::IntoResponse {
    (status, [(axum::http::header::CONTENT_TYPE, "text/plain; charset=utf-8")], why)
}

/// Serves `app` on `listener` until the process is stopping, then lets the connections open
/// finish for at most [`conn::DRAIN`] (a request in flight is answered; an idle connection
/// is closed at once) and stops waiting for those still open: they close as the process ends.
async fn serve_http(listener: conn::Listener, app: Router, name: &'static str, stopping: Stopping) {
    let open = Arc::clone(&listener.open);
    let app = app.layer(axum::middleware::from_fn(conn::mark)).into_make_service_with_connect_info::<conn::Conn>();
    let served = axum::serve(listener, app).with_graceful_shutdown(stopping.clone().wait());
    let drained = async {
        stopping.wait().await;
        tokio::time::sleep(conn::DRAIN).await;
    };
    tokio::select! {
        r = std::future::IntoFuture::into_future(served) => {
            if let Err(e) = r {
                ratewall_store::log_line!("ratewall-store: the {name} stopped: {e}");
            }
        }
        () = drained => {
            let n = open.load(std::sync::atomic::Ordering::Relaxed);
            ratewall_store::log_line!(
                "ratewall-store: stopping: {n} connection(s) to the {name} still open after {} s are dropped",
                conn::DRAIN.as_secs()
            );
        }
    }
}

/// Whether the process is stopping (SIGINT or SIGTERM received), for every listener.
#[derive(Clone)]
struct Stopping(tokio::sync::watch::Receiver<bool>);

impl Stopping {
    /// Listens for the signals.
    fn on_signal() -> Stopping {
        let (tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            stop().await;
            let _ = tx.send(true);
        });
        Stopping(rx)
    }

    /// Once the process is stopping.
    async fn wait(mut self) {
        let _ = self.0.wait_for(|stopping| *stopping).await;
    }
}

/// SIGINT or SIGTERM.
async fn stop() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

/// The rate limit service running: its leases' syncing and its gRPC listener.
struct RlsRunning {
    rls: SharedRls,
    /// What it says of itself, once the main listener has said where it listens.
    announce: Vec<String>,
    flusher: tokio::task::JoinHandle<()>,
    grpc: Option<tokio::task::JoinHandle<()>>,
}

impl RlsRunning {
    /// Once the HTTP listener has stopped: waits for the gRPC listener's calls in flight (a
    /// call ends within the deadline; a health `Watch` stream may stay open, so not past
    /// that), then reports to Redis every unit admitted from a grant or an initial share
    /// and not counted yet, so a restart does not admit them again.
    async fn stop(self, deadline: Duration) {
        if let Some(grpc) = self.grpc {
            let drain = (deadline * 4).max(Duration::from_secs(1));
            let _ = tokio::time::timeout(drain, grpc).await;
        }
        self.flusher.abort();
        let budget = ratewall_store::rls::lease::STOP_FLUSH;
        let left = ratewall_store::rls::lease::flush_all(&self.rls, budget).await;
        if left > 0 {
            ratewall_store::log_line!(
                "ratewall-store: stopping: {left} admitted unit(s) could not be reported to Redis within {} s and are not counted",
                budget.as_secs()
            );
        }
    }
}

/// The rate limit service: its configuration read (refused: the store does not start), its
/// reloads, its leases' syncing and, with `--rls`, its gRPC listener.
async fn start_rls(
    store: &Shared,
    path: &std::path::Path,
    addr: Option<&str>,
    secret: &[u8],
    stopping: &Stopping,
    gate: &Arc<conn::Gate>,
) -> Result<RlsRunning, String> {
    let shown_by = ratewall_core::key::HashKey::derive(secret);
    let config = RlsConfig::load_keyed(path, Some(shown_by)).map_err(|e| format!("--rls-config: {e}"))?;
    let domains: Vec<&str> = config.domains().collect();
    let mut announce = vec![format!(
        "ratewall-store: rate limit configuration {}: {} domain(s) ({}), {} limit(s)",
        path.display(),
        domains.len(),
        domains.join(", "),
        config.rules.len()
    )];
    for w in &config.warnings {
        ratewall_store::log_line!("ratewall-store: rate limit configuration: {w}");
    }
    let rls: SharedRls = Arc::new(Rls::new(Arc::clone(store), config, Some(path.to_path_buf()), secret));
    tokio::spawn(ratewall_store::rls::watch(Arc::clone(&rls), Duration::from_secs(1)));
    let flusher = tokio::spawn(ratewall_store::rls::lease::run(Arc::clone(&rls)));
    let mut grpc = None;
    if let Some(addr) = addr {
        let listener =
            tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr} (--rls): {e}"))?;
        let local = listener.local_addr().map_err(|e| e.to_string())?;
        announce.push(format!(
            "ratewall-store: rate limit service on {local} (gRPC envoy.service.ratelimit.v3.RateLimitService, grpc.health.v1.Health)"
        ));
        let rls = Arc::clone(&rls);
        let incoming = conn::h2_incoming(listener, conn::Limits { head: conn::HEAD, idle: conn::IDLE }, gate);
        let stopping = stopping.clone().wait();
        grpc = Some(tokio::spawn(async move {
            if let Err(e) = ratewall_store::rls::grpc::serve(rls, incoming, stopping).await {
                ratewall_store::log_line!("ratewall-store: the rate limit service stopped: {e}");
            }
        }));
    }
    Ok(RlsRunning { rls, announce, flusher, grpc })
}

/// How long the listeners wait for a client: each connection's reads run under a deadline
/// while the process waits for a request's head (or, on the gRPC listener, the connection's
/// preface), so a client that connects and sends a request slowly, or part of one, is closed
/// rather than held; a request's body is read within its own deadline by the handler that
/// reads it.
///
/// Written here, around the accepted stream, rather than taken from hyper: its HTTP/1
/// `header_read_timeout` is one duration for both a request's head and the wait for a
/// keep-alive connection's next request (5 s and 60 s here), axum's `serve` exposes neither,
/// and tonic's server has no deadline for a connection's HTTP/2 preface at all. One wrapper
/// of the socket gives all three listeners (sync, admin, gRPC) the same deadlines.
mod conn {
    use std::future::Future;
    use std::io;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll};
    use std::time::Duration;
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
    use tokio::time::{Instant, Sleep};

    /// A request's head must have arrived this long after the connection was accepted, or
    /// after the first byte of a later request on it was read.
    pub const HEAD: Duration = Duration::from_secs(5);
    /// A request's body must have arrived this long after its head.
    pub const BODY: Duration = Duration::from_secs(10);
    /// A keep-alive connection with no next request for this long is closed.
    pub const IDLE: Duration = Duration::from_secs(60);
    /// How long a stopping process lets the connections open on its HTTP listeners finish.
    pub const DRAIN: Duration = Duration::from_secs(10);
    /// The bytes an HTTP/2 client sends first: its preface (24 bytes) and a frame's header.
    const H2_OPENING: usize = 24 + 9;

    /// The deadlines a connection runs under.
    #[derive(Clone, Copy, Debug)]
    pub struct Limits {
        /// For a request's head (HTTP/1), or the connection's opening (HTTP/2).
        pub head: Duration,
        /// Between requests (HTTP/1).
        pub idle: Duration,
    }

    /// What the connection waits for.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Phase {
        /// A request's head, or (HTTP/2) the opening's bytes still to come.
        Head { opening: usize },
        /// A request is being answered: its handler bounds its body's read.
        Serving,
        /// The next request's first byte (HTTP/1 keep-alive).
        Idle,
        /// Nothing: an HTTP/2 connection past its opening, whose pings find dead peers.
        Open,
    }

    #[derive(Debug)]
    struct State {
        phase: Phase,
        deadline: Option<Instant>,
    }

    /// One connection's deadline, shared by its reads and the requests it carries.
    #[derive(Clone, Debug)]
    pub struct Conn {
        state: Arc<Mutex<State>>,
        limits: Limits,
    }

    impl Conn {
        /// An HTTP/1 connection just accepted: its first request's head is due.
        pub fn http1(limits: Limits) -> Conn {
            Conn::new(Phase::Head { opening: 0 }, limits)
        }

        /// An HTTP/2 connection just accepted: its opening is due.
        pub fn h2(limits: Limits) -> Conn {
            Conn::new(Phase::Head { opening: H2_OPENING }, limits)
        }

        fn new(phase: Phase, limits: Limits) -> Conn {
            let deadline = Some(Instant::now() + limits.head);
            Conn { state: Arc::new(Mutex::new(State { phase, deadline })), limits }
        }

        fn set(&self, phase: Phase, deadline: Option<Duration>) {
            if let Ok(mut s) = self.state.lock() {
                *s = State { phase, deadline: deadline.map(|d| Instant::now() + d) };
            }
        }

        /// A request's head was read: its handler runs (and bounds its body's read).
        pub fn serving(&self) {
            self.set(Phase::Serving, None);
        }

        /// The request is answered: the connection waits for the next one, for
        /// [`Limits::idle`].
        pub fn answered(&self) {
            self.set(Phase::Idle, Some(self.limits.idle));
        }

        fn deadline(&self) -> Option<Instant> {
            self.state.lock().ok().and_then(|s| s.deadline)
        }

        /// `n` bytes were read.
        fn read(&self, n: usize) {
            let Ok(mut s) = self.state.lock() else { return };
            match s.phase {
                // A next request begins: its head is due.
                Phase::Idle => {
                    *s = State { phase: Phase::Head { opening: 0 }, deadline: Some(Instant::now() + self.limits.head) }
                }
                Phase::Head { opening } if opening > 0 => {
                    let opening = opening.saturating_sub(n);
                    *s = if opening == 0 {
                        State { phase: Phase::Open, deadline: None }
                    } else {
                        State { phase: Phase::Head { opening }, ..*s }
                    };
                }
                _ => {}
            }
        }
    }

    /// A connection whose reads fail once its deadline has passed (its server then closes
    /// it).
    pub struct Timed<S> {
        inner: S,
        /// Its deadline.
        pub conn: Conn,
        sleep: Pin<Box<Sleep>>,
        open: Option<Arc<AtomicUsize>>,
    }

    impl<S> Timed<S> {
        /// `inner` under `conn`'s deadline, counted in `open` while it lives.
        pub fn new(inner: S, conn: Conn, open: Option<Arc<AtomicUsize>>) -> Timed<S> {
            if let Some(o) = &open {
                o.fetch_add(1, Ordering::Relaxed);
            }
            let at = conn.deadline().unwrap_or_else(Instant::now);
            Timed { inner, conn, sleep: Box::pin(tokio::time::sleep_until(at)), open }
        }
    }

    impl<S> Drop for Timed<S> {
        fn drop(&mut self) {
            if let Some(o) = &self.open {
                o.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    impl<S: AsyncRead + Unpin> AsyncRead for Timed<S> {
        fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
            let this = &mut *self;
            if let Some(at) = this.conn.deadline() {
                if this.sleep.deadline() != at {
                    this.sleep.as_mut().reset(at);
                }
                if this.sleep.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client did not send its request in time",
                    )));
                }
            }
            let before = buf.filled().len();
            let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
            let n = buf.filled().len().saturating_sub(before);
            if n > 0 {
                this.conn.read(n);
            }
            polled
        }
    }

    impl<S: AsyncWrite + Unpin> AsyncWrite for Timed<S> {
        fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            Pin::new(&mut self.inner).poll_write(cx, buf)
        }
        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_flush(cx)
        }
        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_shutdown(cx)
        }
        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[io::IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
        }
        fn is_write_vectored(&self) -> bool {
            self.inner.is_write_vectored()
        }
    }

    impl tonic::transport::server::Connected for Timed<tokio::net::TcpStream> {
        type ConnectInfo = tonic::transport::server::TcpConnectInfo;
        fn connect_info(&self) -> Self::ConnectInfo {
            self.inner.connect_info()
        }
    }

    /// Most connections the store keeps open at once, every listener's together, whatever
    /// the file descriptors allow.
    pub const MAX_CONNECTIONS: usize = 16_384;
    /// File descriptors kept for the rest (Redis's connections, the configuration's files).
    const FDS_KEPT: u64 = 256;
    /// Most connections the admin listener keeps open, apart from the others': idle
    /// connections to it (it has no authentication) cannot take the proxies' places.
    pub const ADMIN_CONNECTIONS: usize = 256;

    /// The connections open on every listener, and how many may be: past them a new one is
    /// closed at once, so that idle connections cannot take every file descriptor (20,000
    /// held open stopped the store answering anyone until they closed).
    pub struct Gate {
        pub open: Arc<AtomicUsize>,
        pub max: usize,
        said: std::sync::Mutex<Option<Instant>>,
    }

    impl Gate {
        /// The gates of the process's listeners: the sync and rate limit service listeners',
        /// and the admin listener's. Its soft limit of file descriptors is raised to its hard
        /// one first; the first keeps at most [`MAX_CONNECTIONS`], or that limit less
        /// [`FDS_KEPT`] and [`ADMIN_CONNECTIONS`] (at least 64), the second
        /// [`ADMIN_CONNECTIONS`].
        pub fn new() -> (Arc<Gate>, Arc<Gate>) {
            let fds = raise_fd_limit();
            let kept = FDS_KEPT.saturating_add(ADMIN_CONNECTIONS as u64);
            let max = usize::try_from(fds.saturating_sub(kept).max(64)).unwrap_or(usize::MAX).min(MAX_CONNECTIONS);
            let gate = |max| Arc::new(Gate { open: Arc::default(), max, said: std::sync::Mutex::new(None) });
            (gate(max), gate(ADMIN_CONNECTIONS))
        }

        /// Whether a new connection may be kept; if not, it is said, once a minute at most.
        fn admits(&self) -> bool {
            if self.open.load(Ordering::Relaxed) < self.max {
                return true;
            }
            if let Ok(mut said) = self.said.lock() {
                if said.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
                    *said = Some(Instant::now());
                    ratewall_store::log_line!(
                        "ratewall-store: {} connections open, the most it keeps: new ones are closed at once until some end",
                        self.max
                    );
                }
            }
            false
        }
    }

    /// The soft limit of open files, raised to the hard limit first (as servers do): the
    /// limit in force.
    fn raise_fd_limit() -> u64 {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: `getrlimit` writes the limits into the struct it is given, which lives here.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
            return 1024;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
            // SAFETY: `setrlimit` reads the struct it is given, which lives here.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
        lim.rlim_cur
    }

    /// An HTTP/1 listener whose connections run under [`Limits`], counted in a [`Gate`].
    pub struct Listener {
        inner: tokio::net::TcpListener,
        limits: Limits,
        gate: Arc<Gate>,
        /// Connections open (every listener's of its gate).
        pub open: Arc<AtomicUsize>,
    }

    impl Listener {
        /// `inner`'s connections under `limits`, through `gate`.
        pub fn new(inner: tokio::net::TcpListener, limits: Limits, gate: &Arc<Gate>) -> Listener {
            Listener { inner, limits, gate: Arc::clone(gate), open: Arc::clone(&gate.open) }
        }
    }

    impl axum::serve::Listener for Listener {
        type Io = Timed<tokio::net::TcpStream>;
        type Addr = std::net::SocketAddr;

        async fn accept(&mut self) -> (Self::Io, Self::Addr) {
            loop {
                let (stream, addr) = axum::serve::Listener::accept(&mut self.inner).await;
                if self.gate.admits() {
                    return (Timed::new(stream, Conn::http1(self.limits), Some(Arc::clone(&self.open))), addr);
                }
                drop(stream);
            }
        }

        fn local_addr(&self) -> io::Result<Self::Addr> {
            self.inner.local_addr()
        }
    }

    impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, Listener>> for Conn {
        fn connect_info(stream: axum::serve::IncomingStream<'_, Listener>) -> Conn {
            stream.io().conn.clone()
        }
    }

    /// Middleware: a request's head has been read when it reaches the router; once answered,
    /// its connection waits for the next.
    pub async fn mark(req: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response {
        let conn = req.extensions().get::<axum::extract::ConnectInfo<Conn>>().map(|c| c.0.clone());
        if let Some(c) = &conn {
            c.serving();
        }
        let out = next.run(req).await;
        if let Some(c) = &conn {
            c.answered();
        }
        out
    }

    /// The gRPC listener's connections under `limits` (their opening due within
    /// [`Limits::head`]); a failed accept (out of file descriptors, say) is retried after a
    /// pause rather than at once.
    pub fn h2_incoming(
        listener: tokio::net::TcpListener,
        limits: Limits,
        gate: &Arc<Gate>,
    ) -> impl futures_util::Stream<Item = io::Result<Timed<tokio::net::TcpStream>>> {
        let gate = Arc::clone(gate);
        futures_util::stream::unfold(listener, move |l| {
            let gate = Arc::clone(&gate);
            async move {
                loop {
                    match l.accept().await {
                        Ok((stream, _)) if !gate.admits() => drop(stream),
                        Ok((stream, _)) => {
                            let _ = stream.set_nodelay(true);
                            return Some((Ok(Timed::new(stream, Conn::h2(limits), Some(Arc::clone(&gate.open)))), l));
                        }
                        Err(e) if is_connection_error(&e) => {}
                        Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
                    }
                }
            }
        })
    }

    /// An accept error of the connection alone (the listener is fine).
    fn is_connection_error(e: &io::Error) -> bool {
        matches!(
            e.kind(),
            io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
        )
    }

    #[cfg(test)]
    mod tests {
        #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
        use super::*;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        const MS: Duration = Duration::from_millis(1);

        fn limits() -> Limits {
            Limits { head: 200 * MS, idle: 600 * MS }
        }

        /// Reads what is sent until the deadline fails the read; how long that took.
        async fn read_until_cut(io: &mut Timed<tokio::io::DuplexStream>) -> Duration {
            let start = Instant::now();
            let mut buf = [0u8; 64];
            loop {
                match io.read(&mut buf).await {
                    Ok(0) => panic!("closed, not cut"),
                    Ok(_) => {}
                    Err(e) => {
                        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
                        return start.elapsed();
                    }
                }
            }
        }

        #[tokio::test]
        async fn a_head_sent_in_part_is_cut_at_its_deadline() {
            let (mut client, server) = tokio::io::duplex(1024);
            let mut io = Timed::new(server, Conn::http1(limits()), None);
            client.write_all(b"POST /v1/sync HTTP/1.1\r\nHost: x\r\n").await.unwrap();
            let took = read_until_cut(&mut io).await;
            assert!(took >= 150 * MS && took < 500 * MS, "{took:?}");
        }

        #[tokio::test]
        async fn a_request_being_answered_has_no_deadline_and_the_next_waits_idle_then_head() {
            let (mut client, server) = tokio::io::duplex(1024);
            let mut io = Timed::new(server, Conn::http1(limits()), None);
            let conn = io.conn.clone();
            client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
            let mut buf = [0u8; 64];
            assert!(io.read(&mut buf).await.unwrap() > 0);
            conn.serving();
            // Past the head's deadline while answering: a read waits, not fails.
            let waited = tokio::time::timeout(400 * MS, io.read(&mut buf)).await;
            assert!(waited.is_err(), "{waited:?}");
            conn.answered();
            // Idle: the next request may take longer than a head to begin...
            tokio::time::sleep(300 * MS).await;
            client.write_all(b"GET / HT").await.unwrap();
            // ...but once begun, its head is due within the head's deadline.
            let took = read_until_cut(&mut io).await;
            assert!(took >= 150 * MS && took < 500 * MS, "{took:?}");
        }

        #[tokio::test]
        async fn an_idle_connection_is_cut_after_the_idle_deadline() {
            let (_client, server) = tokio::io::duplex(1024);
            let mut io = Timed::new(server, Conn::http1(limits()), None);
            io.conn.answered();
            let took = read_until_cut(&mut io).await;
            assert!(took >= 550 * MS && took < 1000 * MS, "{took:?}");
        }

        #[tokio::test]
        async fn an_http2_connection_needs_its_opening_in_time_and_then_no_deadline() {
            let (mut client, server) = tokio::io::duplex(1024);
            let mut io = Timed::new(server, Conn::h2(limits()), None);
            client.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
            read_until_cut(&mut io).await;

            let (mut client, server) = tokio::io::duplex(1024);
            let mut io = Timed::new(server, Conn::h2(limits()), None);
            client.write_all(&[0u8; H2_OPENING]).await.unwrap();
            let mut buf = [0u8; 64];
            assert_eq!(io.read(&mut buf).await.unwrap(), H2_OPENING);
            assert!(tokio::time::timeout(400 * MS, io.read(&mut buf)).await.is_err(), "open: no deadline");
        }

        #[tokio::test]
        async fn open_connections_are_counted_while_they_live() {
            let open = Arc::new(AtomicUsize::new(0));
            let (_c, s) = tokio::io::duplex(16);
            let io = Timed::new(s, Conn::http1(limits()), Some(Arc::clone(&open)));
            assert_eq!(open.load(Ordering::Relaxed), 1);
            drop(io);
            assert_eq!(open.load(Ordering::Relaxed), 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{redacted, Quiet};

    #[test]
    fn a_quiet_line_is_said_once_per_interval_with_the_count_held_back() {
        let q = Quiet::default();
        let t = std::time::Instant::now();
        assert_eq!(q.say(t), Some(0));
        for i in 1..=5 {
            assert_eq!(q.say(t + std::time::Duration::from_secs(i)), None);
        }
        assert_eq!(q.say(t + Quiet::EVERY), Some(5));
        assert_eq!(q.say(t + Quiet::EVERY), None);
        assert_eq!(q.say(t + 2 * Quiet::EVERY), Some(1));
    }

    #[test]
    fn a_redis_urls_password_is_never_shown() {
        let cases = [
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
            ("redis://:Pa55word@10.0.0.1:6379/0", "redis://…@10.0.0.1:6379/0"),
            ("rediss://user:Pa55word@cache.internal:6380", "rediss://…@cache.internal:6380"),
            ("redis+unix:///run/redis.sock?db=1&pass=Pa55word", "redis+unix:///run/redis.sock?…"),
            ("unix:///run/redis.sock?pass=Pa55word", "unix:///run/redis.sock?…"),
            ("redis://u:p@host/0?pass=Pa55word", "redis://…@host/0?…"),
            ("redis://:Pa55?word@host", "redis://…@host"),
        ];
        for (url, shown) in cases {
            assert_eq!(redacted(url), shown);
            assert!(!redacted(url).contains("Pa55word"));
        }
    }
}
