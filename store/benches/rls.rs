//! ratewall-store's rate limit service against envoyproxy/ratelimit's design, in one run on
//! one Redis on loopback, driven by a tonic gRPC client of `ShouldRateLimit` with 16
//! concurrent streams. The peer is built into this bench: a `RateLimitService` that does
//! what envoyproxy/ratelimit does per descriptor per call — one pipelined `INCRBY` + `EXPIRE`
//! on a fixed window's key — on the same descriptors. Prints `figure:` lines (BENCHMARKS.md):
//!
//! - `rls_calls_per_sec` and `rls_calls_per_sec_baseline`, `rls_vs_baseline` (goal ≥ 3);
//! - `rls_p99_ms` / `rls_p50_ms` at 16 streams (goal p99 ≤ 1 ms), and the baseline's;
//! - `rls_redis_ops_per_call` on a hot descriptor (goal ≤ 0.05; the baseline's is 2);
//! - `rls_over_admission_pct`: units admitted past a hot descriptor's limit by two store
//!   processes on one Redis, the calls spread over both (goal ≤ 1).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing, clippy::zombie_processes)]

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus, RateLimit};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use ratewall_tests::bench::figure;
use ratewall_tests::redis::{cli, Redis};
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

const STREAMS: usize = 16;
const RUN: Duration = Duration::from_secs(4);
const CONFIG: &str = "domain: bench
descriptors:
  - key: hot
    rate_limit: {unit: hour, requests_per_unit: 4000000000}
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 4000000000}
  - key: capped
    rate_limit: {unit: hour, requests_per_unit: 20000}
";

struct Store {
    child: Child,
    grpc: String,
    _out: std::io::BufReader<std::process::ChildStdout>,
}

impl Drop for Store {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn store(redis: &Redis, config: &std::path::Path) -> Store {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratewall-store"))
        .env("RATEWALL_SYNC_SECRET", "bench-secret-0123456789")
        .args(["--listen", "127.0.0.1:0", "--rls", "127.0.0.1:0", "--deadline-ms", "1000", "--redis", &redis.url()])
        .arg("--rls-config")
        .arg(config)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "ratewall-store ended");
        if let Some(rest) = line.split("rate limit service on ").nth(1) {
            let grpc = rest.split_whitespace().next().unwrap().to_owned();
            return Store { child, grpc, _out: out };
        }
    }
}

/// Commands Redis ran for clients (a script call is one; `INFO` itself is left out).
fn commands(redis: &Redis) -> u64 {
    let info = cli(redis.port, &["info", "commandstats"]).unwrap();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_") && !l.starts_with("cmdstat_info:"))
        .filter_map(|l| l.split("calls=").nth(1)?.split(',').next()?.parse::<u64>().ok())
        .sum()
}

/// envoyproxy/ratelimit's per-call work, on the same Redis: for each descriptor with a limit,
/// `INCRBY key hits` and `EXPIRE key unit` in one pipeline, over limit when the count passes
/// `requests_per_unit` (every descriptor here is limited per hour, as in `CONFIG`).
struct Baseline {
    conn: redis::aio::ConnectionManager,
}

#[tonic::async_trait]
impl RateLimitService for Baseline {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let req = request.into_inner();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let window = now / 3600 * 3600;
        let hits = u64::from(req.hits_addend.max(1));
        let mut pipe = redis::pipe();
        for d in &req.descriptors {
            let mut key = format!("{}_", req.domain);
            for e in &d.entries {
                key.push_str(&e.key);
                key.push('_');
                key.push_str(&e.value);
                key.push('_');
            }
            key.push_str(&window.to_string());
            pipe.cmd("INCRBY").arg(&key).arg(hits).cmd("EXPIRE").arg(&key).arg(3600).ignore();
        }
        let mut conn = self.conn.clone();
        let counts: Vec<u64> =
            pipe.query_async(&mut conn).await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let limit = if req.descriptors.iter().any(|d| d.entries.iter().any(|e| e.key == "capped")) {
            20_000
        } else {
            4_000_000_000
        };
        let statuses: Vec<DescriptorStatus> = counts
            .iter()
            .map(|c| DescriptorStatus {
                code: if *c > limit { Code::OverLimit as i32 } else { Code::Ok as i32 },
                current_limit: Some(RateLimit { name: String::new(), requests_per_unit: limit as u32, unit: 3 }),
                limit_remaining: u32::try_from(limit.saturating_sub(*c)).unwrap_or(u32::MAX),
                duration_until_reset: None,
                quota: None,
            })
            .collect();
        let over = statuses.iter().any(|s| s.code == Code::OverLimit as i32);
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: if over { Code::OverLimit as i32 } else { Code::Ok as i32 },
            statuses,
            ..Default::default()
        }))
    }
}

/// Set in the environment of this bench run again as the baseline's server, to the Redis URL.
const BASELINE_ENV: &str = "RATEWALL_RLS_BENCH_BASELINE_REDIS";

/// The baseline's server, in this process: prints its address, then serves until killed.
async fn serve_baseline(redis_url: &str) {
    let client = redis::Client::open(redis_url).unwrap();
    let conn = redis::aio::ConnectionManager::new(client).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!("baseline on {}", listener.local_addr().unwrap());
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(RateLimitServiceServer::new(Baseline { conn }))
        .serve_with_incoming(incoming)
        .await
        .unwrap();
}

/// The baseline in a process of its own, as ratewall-store runs in its own (and as
/// envoyproxy/ratelimit does): this bench binary run again with [`BASELINE_ENV`], on a runtime
/// of the same two worker threads. In one process with the load generator, the two shared
/// one runtime while ratewall-store had its own.
fn baseline(redis: &Redis) -> Store {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(BASELINE_ENV, redis.url())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    assert!(out.read_line(&mut line).unwrap() > 0, "the baseline ended");
    let grpc = line.trim().strip_prefix("baseline on ").unwrap().to_owned();
    Store { child, grpc, _out: out }
}

fn call(entries: &[(&str, String)]) -> RateLimitRequest {
    RateLimitRequest {
        domain: "bench".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: entries.iter().map(|(k, v)| Entry { key: (*k).into(), value: v.clone() }).collect(),
            ..Default::default()
        }],
        hits_addend: 0,
    }
}

/// What one load run measured.
struct Run {
    calls: u64,
    ok: u64,
    secs: f64,
    latencies_ms: Vec<f64>,
}

impl Run {
    fn per_sec(&self) -> f64 {
        self.calls as f64 / self.secs
    }
    fn quantile(&self, q: f64) -> f64 {
        let mut l = self.latencies_ms.clone();
        l.sort_by(f64::total_cmp);
        l.get(((l.len() as f64 * q) as usize).min(l.len().saturating_sub(1))).copied().unwrap_or(f64::NAN)
    }
}

/// `STREAMS` concurrent streams over `addrs` (stream `i` on `addrs[i % n]`), each calling
/// `make(stream, n)` in turn, for `run` (or until `stop_after` calls were answered OK).
async fn load(
    addrs: &[String],
    run: Duration,
    make: impl Fn(usize, u64) -> RateLimitRequest + Send + Sync + 'static,
) -> Run {
    let make = Arc::new(make);
    let mut channels = Vec::new();
    for a in addrs {
        channels.push(RateLimitServiceClient::new(
            Channel::from_shared(format!("http://{a}")).unwrap().connect().await.unwrap(),
        ));
    }
    let ok = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..STREAMS)
        .map(|i| {
            let mut client: RateLimitServiceClient<Channel> = channels[i % channels.len()].clone();
            let (make, ok) = (Arc::clone(&make), Arc::clone(&ok));
            tokio::spawn(async move {
                let mut lat = Vec::with_capacity(100_000);
                let mut n = 0u64;
                while started.elapsed() < run {
                    let t = Instant::now();
                    let r = client.should_rate_limit(make(i, n)).await.unwrap().into_inner();
                    lat.push(t.elapsed().as_secs_f64() * 1e3);
                    if r.overall_code == Code::Ok as i32 {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    n += 1;
                }
                lat
            })
        })
        .collect();
    let mut latencies_ms = Vec::new();
    for t in tasks {
        latencies_ms.extend(t.await.unwrap());
    }
    let secs = started.elapsed().as_secs_f64();
    Run { calls: latencies_ms.len() as u64, ok: ok.load(Ordering::Relaxed), secs, latencies_ms }
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    match std::env::var(BASELINE_ENV) {
        Ok(url) => runtime.block_on(serve_baseline(&url)),
        Err(_) => runtime.block_on(bench()),
    }
}

async fn bench() {
    let redis = Redis::start(false).unwrap();
    let dir = std::env::temp_dir().join(format!("ratewall-rls-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("config.yaml");
    std::fs::write(&config, CONFIG).unwrap();
    let a = store(&redis, &config);
    let b = store(&redis, &config);
    let baseline = baseline(&redis);
    let peer = baseline.grpc.clone();
    let one = [a.grpc.clone()];

    // Mixed traffic: each stream its own 1,000 users, plus the hot descriptor.
    let users = |i: usize, n: u64| call(&[("user", format!("u{}-{}", i, n % 1000))]);
    let hot = |_: usize, _: u64| call(&[("hot", "all".into())]);

    // Warm both (connections, scripts, grants).
    load(&one, Duration::from_millis(500), hot).await;
    load(std::slice::from_ref(&peer), Duration::from_millis(500), hot).await;

    let before = commands(&redis);
    let rls_hot = load(&one, RUN, hot).await;
    let rls_hot_ops = (commands(&redis) - before) as f64 / rls_hot.calls as f64;
    let before = commands(&redis);
    let base_hot = load(std::slice::from_ref(&peer), RUN, hot).await;
    let base_hot_ops = (commands(&redis) - before) as f64 / base_hot.calls as f64;
    let rls_users = load(&one, RUN, users).await;
    let base_users = load(std::slice::from_ref(&peer), RUN, users).await;

    figure("rls_calls_per_sec", rls_hot.per_sec(), "calls/s");
    figure("rls_calls_per_sec_baseline", base_hot.per_sec(), "calls/s");
    figure("rls_vs_baseline", rls_hot.per_sec() / base_hot.per_sec(), "x");
    figure("rls_p50_ms", rls_hot.quantile(0.5), "ms");
    figure("rls_p99_ms", rls_hot.quantile(0.99), "ms");
    figure("rls_p99_ms_baseline", base_hot.quantile(0.99), "ms");
    figure("rls_redis_ops_per_call", rls_hot_ops, "ops/call");
    figure("rls_redis_ops_per_call_baseline", base_hot_ops, "ops/call");
    figure("rls_calls_per_sec_many_keys", rls_users.per_sec(), "calls/s");
    figure("rls_calls_per_sec_many_keys_baseline", base_users.per_sec(), "calls/s");
    figure("rls_vs_baseline_many_keys", rls_users.per_sec() / base_users.per_sec(), "x");
    figure("rls_p99_ms_many_keys", rls_users.quantile(0.99), "ms");

    // Over-admission: a hot descriptor of 20,000 an hour, calls spread over both stores until
    // well past the limit.
    let hour = |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() / 3600;
    let start = std::time::SystemTime::now();
    let capped = |_: usize, _: u64| call(&[("capped", "one".into())]);
    let two = [a.grpc.clone(), b.grpc.clone()];
    let run = load(&two, Duration::from_secs(3), capped).await;
    if hour(start) != hour(std::time::SystemTime::now()) {
        println!("(the over-admission run crossed an hour boundary: run the bench again)");
    }
    let over = (run.ok as f64 - 20_000.0).max(0.0) / 20_000.0 * 100.0;
    println!("two stores admitted {} of {} calls on a limit of 20000", run.ok, run.calls);
    figure("rls_over_admission_pct", over, "%");
    drop((a, b, baseline));
    let _ = std::fs::remove_dir_all(&dir);
}
