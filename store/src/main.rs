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

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use ratewall_core::Nanos;
use ratewall_store::redis_kv::RedisKv;
use ratewall_store::rls::config::RlsConfig;
use ratewall_store::rls::Rls;
use ratewall_store::{Kv, Store, MAX_BODY};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OnceCell;

const USAGE: &str = "usage: RATEWALL_SYNC_SECRET=<at least 16 characters> ratewall-store --listen ADDR:PORT \
--redis URL [--redis URL ...] [--cluster] [--deadline-ms N] [--rls ADDR:PORT --rls-config FILE_OR_DIR] [--admin ADDR:PORT]";

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
                deadline_ms = v
                    .parse()
                    .ok()
                    .filter(|ms| *ms > 0)
                    .ok_or_else(|| format!("--deadline-ms: {v:?} is not a number of milliseconds above 0"))?;
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
    urls: Vec<String>,
    cluster: bool,
    conn: OnceCell<RedisKv>,
}

impl LazyKv {
    async fn get(&self) -> Option<&RedisKv> {
        if let Some(c) = self.conn.get() {
            return Some(c);
        }
        let connect = RedisKv::connect(&self.urls, self.cluster);
        match tokio::time::timeout(Duration::from_millis(500), connect).await {
            Ok(Ok(kv)) => Some(self.conn.get_or_init(|| async { kv }).await),
            Ok(Err(e)) => {
                eprintln!("ratewall-store: cannot reach Redis yet: {e}");
                None
            }
            Err(_) => None,
        }
    }
}

impl Kv for LazyKv {
    async fn read(&self, key: &str) -> Result<(Option<Vec<u8>>, Nanos), String> {
        self.get().await.ok_or("Redis unreachable")?.read(key).await
    }
    async fn cas(&self, key: &str, old: Option<&[u8]>, new: &[u8], ttl_ms: u64) -> Result<ratewall_store::Cas, String> {
        self.get().await.ok_or("Redis unreachable")?.cas(key, old, new, ttl_ms).await
    }
    async fn heard(
        &self,
        node: u64,
        seq: u64,
        batch: bool,
        sent: Nanos,
    ) -> Result<(u32, Vec<u64>), ratewall_store::Unheard> {
        self.get().await.ok_or(ratewall_store::Unheard::Failed)?.heard(node, seq, batch, sent).await
    }
    async fn present(&self, node: u64) -> Result<u32, String> {
        self.get().await.ok_or("Redis unreachable")?.present(node).await
    }
    async fn ping(&self) -> bool {
        match self.get().await {
            Some(kv) => tokio::time::timeout(Duration::from_millis(500), kv.ping()).await.unwrap_or(false),
            None => false,
        }
    }
    async fn append(&self, key: &str, payload: &[u8], len: u64, ttl_ms: u64) -> Result<(), String> {
        self.get().await.ok_or("Redis unreachable")?.append(key, payload, len, ttl_ms).await
    }
    async fn read_after(&self, key: &str, after: Option<&str>, count: usize) -> Result<(String, Vec<Vec<u8>>), String> {
        self.get().await.ok_or("Redis unreachable")?.read_after(key, after, count).await
    }
}

type Shared = Arc<Store<LazyKv>>;
type SharedRls = Arc<Rls<LazyKv>>;

/// `POST /json`: envoyproxy/ratelimit's JSON twin of `ShouldRateLimit`.
async fn rls_json(State(rls): State<SharedRls>, body: Bytes) -> Response {
    let result = match ratewall_store::rls::json::call_of(&body) {
        Ok(call) => rls.should_rate_limit(&call).await,
        Err(why) => Err(ratewall_store::rls::Refusal::Invalid(why)),
    };
    let (status, body) = ratewall_store::rls::json::http(&result);
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut out = (status, body).into_response();
    out.headers_mut().insert("content-type", HeaderValue::from_static("application/json"));
    out
}

/// Whether a body's error is its length limit.
fn is_length_limit(mut e: &(dyn std::error::Error + 'static)) -> bool {
    loop {
        if e.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        match e.source() {
            Some(next) => e = next,
            None => return false,
        }
    }
}

async fn sync(State(store): State<Shared>, headers: HeaderMap, body: axum::body::Body) -> Response {
    let signature = headers.get("x-ratewall-signature").map(HeaderValue::as_bytes);
    // A body declared over `MAX_BODY` is refused before it is read, as the store refuses any
    // body over it, and counted.
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let a = if declared.is_some_and(|n| n > MAX_BODY as u64) {
        store.sync_too_large()
    } else {
        match axum::body::to_bytes(body, MAX_BODY + 1).await {
            Ok(body) => store.sync(&body, signature).await,
            // Past `MAX_BODY` + 1 bytes read: cut off there.
            Err(e) if is_length_limit(&e) => store.sync_too_large(),
            Err(_) => return (StatusCode::BAD_REQUEST, "the body could not be read").into_response(),
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
    if store.kv.ping().await {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "Redis does not answer\n").into_response()
    }
}

/// `GET /healthcheck`, envoyproxy/ratelimit's: 200 `OK` when Redis answers, else 500.
async fn healthcheck(State(store): State<Shared>) -> Response {
    if store.kv.ping().await {
        (StatusCode::OK, "OK").into_response()
    } else {
        StatusCode::INTERNAL_SERVER_ERROR.into_response()
    }
}

fn main() -> std::process::ExitCode {
    if std::env::args().skip(1).any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return std::process::ExitCode::SUCCESS;
    }
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("ratewall-store: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let secret = std::env::var("RATEWALL_SYNC_SECRET").unwrap_or_default();
    if secret.chars().count() < 16 {
        eprintln!("ratewall-store: set RATEWALL_SYNC_SECRET to the filters' sync secret (at least 16 characters)");
        return std::process::ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ratewall-store: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(args, secret)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ratewall-store: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn serve(args: Args, secret: String) -> Result<(), String> {
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let kv = LazyKv { urls: args.redis.clone(), cluster: args.cluster, conn: OnceCell::new() };
    let store: Shared = Arc::new(Store::new(kv, secret.as_bytes(), args.deadline));
    let running = match &args.rls_config {
        Some(path) => Some(start_rls(&store, path, args.rls.as_deref(), secret.as_bytes()).await?),
        None => None,
    };
    let rls = running.as_ref().map(|r| Arc::clone(&r.rls));
    if !store.kv.ping().await {
        eprintln!("ratewall-store: Redis does not answer yet; /v1/sync answers 503 until it does");
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
    println!(
        "ratewall-store: listening on http://{addr} (POST /v1/sync, GET /healthz, GET /healthcheck, GET /metrics); Redis {} ({mode}); deadline {} ms",
        redis.join(", "),
        args.deadline.as_millis()
    );
    for line in running.iter().flat_map(|r| &r.announce) {
        println!("{line}");
    }
    let admin = admin.map(|(l, at)| {
        println!("ratewall-store: admin on http://{at}/ (GET /, /v1/top, /v1/series, /v1/fleet, /metrics, /healthz, /healthcheck; no authentication)");
        l
    });
    // Every process shares what its batches said; one with an admin listener also reads its
    // peers', so its /v1/top and /v1/fleet cover the whole fleet.
    let sharing = Arc::clone(&store);
    let reads = admin.is_some();
    tokio::spawn(async move { sharing.share_top_forever(reads, joined).await });
    if let Some(l) = admin {
        let router = ratewall_store::admin::router(Arc::clone(&store), rls.clone())
            .merge(Router::new().route("/healthcheck", get(healthcheck)).with_state(Arc::clone(&store)));
        tokio::spawn(async move {
            if let Err(e) = axum::serve(l, router).await {
                eprintln!("ratewall-store: the admin listener stopped: {e}");
            }
        });
    }
    let for_metrics = rls.clone();
    let mut app = Router::new()
        .route("/v1/sync", post(sync))
        .route("/healthz", get(healthz))
        .route("/healthcheck", get(healthcheck))
        .route(
            "/metrics",
            get(move |State(store): State<Shared>| async move {
                ratewall_store::admin::metrics(&store, for_metrics.as_deref())
            }),
        )
        .layer(DefaultBodyLimit::max(MAX_BODY + 1))
        .with_state(store);
    if let Some(rls) = rls {
        app = app.merge(Router::new().route("/json", post(rls_json)).with_state(rls));
    }
    let served = axum::serve(listener, app).with_graceful_shutdown(stop()).await.map_err(|e| e.to_string());
    if let Some(r) = running {
        r.stop(args.deadline).await;
    }
    served
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
            eprintln!(
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
) -> Result<RlsRunning, String> {
    let config = RlsConfig::load(path).map_err(|e| format!("--rls-config: {e}"))?;
    let domains: Vec<&str> = config.domains().collect();
    let mut announce = vec![format!(
        "ratewall-store: rate limit configuration {}: {} domain(s) ({}), {} limit(s)",
        path.display(),
        domains.len(),
        domains.join(", "),
        config.rules.len()
    )];
    for w in &config.warnings {
        eprintln!("ratewall-store: rate limit configuration: {w}");
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
        grpc = Some(tokio::spawn(async move {
            if let Err(e) = ratewall_store::rls::grpc::serve(rls, listener, stop()).await {
                eprintln!("ratewall-store: the rate limit service stopped: {e}");
            }
        }));
    }
    Ok(RlsRunning { rls, announce, flusher, grpc })
}

#[cfg(test)]
mod tests {
    use super::redacted;

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
