//! `ratewall-store`: serves `POST /v1/sync`, `GET /healthz` and `GET /metrics` over Redis.
//!
//! ```text
//! RATEWALL_SYNC_SECRET=<at least 16 chars> \
//! ratewall-store --listen 127.0.0.1:8090 --redis redis://127.0.0.1:6379 [--redis URL ...] [--cluster] [--deadline-ms 50]
//! ```

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use ratewall_core::Nanos;
use ratewall_store::redis_kv::RedisKv;
use ratewall_store::{Kv, Store, MAX_BODY};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OnceCell;

const USAGE: &str = "usage: RATEWALL_SYNC_SECRET=<at least 16 characters> ratewall-store --listen ADDR:PORT \
--redis URL [--redis URL ...] [--cluster] [--deadline-ms N] [--admin ADDR:PORT]";

struct Args {
    listen: String,
    redis: Vec<String>,
    cluster: bool,
    deadline: Duration,
    /// The admin listener's address (none: off).
    admin: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = std::env::args().skip(1);
    let (mut listen, mut redis, mut cluster, mut deadline_ms) = (None, Vec::new(), false, 50u64);
    let mut admin = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--listen" => listen = Some(args.next().ok_or("--listen needs an address")?),
            "--redis" => redis.push(args.next().ok_or("--redis needs a URL")?),
            "--cluster" => cluster = true,
            "--admin" => admin = Some(args.next().ok_or("--admin needs an address")?),
            "--deadline-ms" => {
                let v = args.next().ok_or("--deadline-ms needs a number")?;
                deadline_ms = v.parse().map_err(|_| format!("--deadline-ms: {v:?} is not a number of milliseconds"))?;
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let listen = listen.ok_or(format!("--listen is required\n{USAGE}"))?;
    if redis.is_empty() {
        return Err(format!("--redis is required\n{USAGE}"));
    }
    Ok(Args { listen, redis, cluster, deadline: Duration::from_millis(deadline_ms.max(1)), admin })
}

/// A Redis URL as it may be logged: without its password.
fn redacted(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => format!("{}://…@{}", &url[..scheme], &url[at + 1..]),
        _ => url.to_owned(),
    }
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
    async fn heard(&self, node: u64, seq: u64, batch: bool) -> Result<u32, Option<u64>> {
        self.get().await.ok_or(None)?.heard(node, seq, batch).await
    }
    async fn ping(&self) -> bool {
        match self.get().await {
            Some(kv) => tokio::time::timeout(Duration::from_millis(500), kv.ping()).await.unwrap_or(false),
            None => false,
        }
    }
}

type Shared = Arc<Store<LazyKv>>;

async fn sync(State(store): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    let signature = headers.get("x-ratewall-signature").map(HeaderValue::as_bytes);
    let a = store.sync(&body, signature).await;
    let status = StatusCode::from_u16(a.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut out = (status, a.body).into_response();
    if let Some(sig) = a.signature.and_then(|s| HeaderValue::from_str(&s).ok()) {
        out.headers_mut().insert("x-ratewall-signature", sig);
        out.headers_mut().insert("content-type", HeaderValue::from_static("application/octet-stream"));
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

async fn metrics(State(store): State<Shared>) -> Response {
    let mut out = (StatusCode::OK, store.metrics.render()).into_response();
    out.headers_mut().insert("content-type", HeaderValue::from_static("text/plain; version=0.0.4"));
    out
}

fn main() -> std::process::ExitCode {
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
    let redis: Vec<String> = args.redis.iter().map(|u| redacted(u)).collect();
    let mode = if args.cluster { "Cluster" } else { "single server" };
    println!(
        "ratewall-store: listening on http://{addr} (POST /v1/sync, GET /healthz, GET /metrics); Redis {} ({mode}); deadline {} ms",
        redis.join(", "),
        args.deadline.as_millis()
    );
    if !store.kv.ping().await {
        eprintln!("ratewall-store: Redis does not answer yet; /v1/sync answers 503 until it does");
    }
    let admin = match &args.admin {
        Some(a) => {
            let l = tokio::net::TcpListener::bind(a).await.map_err(|e| format!("cannot listen on --admin {a}: {e}"))?;
            let at = l.local_addr().map_err(|e| e.to_string())?;
            println!("ratewall-store: admin on http://{at}/ (GET /, /v1/top, /v1/series, /v1/fleet, /metrics, /healthz; no authentication)");
            Some(l)
        }
        None => None,
    };
    if let Some(l) = admin {
        let router = ratewall_store::admin::router(Arc::clone(&store));
        tokio::spawn(async move {
            if let Err(e) = axum::serve(l, router).await {
                eprintln!("ratewall-store: the admin listener stopped: {e}");
            }
        });
    }
    let app = Router::new()
        .route("/v1/sync", post(sync))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(MAX_BODY + 1))
        .with_state(store);
    let stop = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        }
    };
    axum::serve(listener, app).with_graceful_shutdown(stop).await.map_err(|e| e.to_string())
}
