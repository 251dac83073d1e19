//! `envoy.service.ratelimit.v3.RateLimitService` over gRPC (h2c), on the `envoy-types`
//! crate's generated tonic server, beside gRPC's standard health service
//! (`grpc.health.v1.Health`): SERVING while the store reaches Redis, NOT_SERVING when it does
//! not and once the process is stopping.

use super::{Answer, Call, Code, Descriptor, Refusal, Rls};
use crate::Kv;
use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code as PbCode, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use std::future::Future;
use std::sync::Arc;

/// Largest request accepted, bytes (the descriptor limits keep a valid one far below).
pub const MAX_MESSAGE: usize = 1 << 20;

/// The services the health service reports: the whole server (""), the rate limit service,
/// and `ratelimit` (the name envoyproxy/ratelimit reports under).
pub const HEALTH_SERVICES: [&str; 3] = ["", "envoy.service.ratelimit.v3.RateLimitService", "ratelimit"];

/// How often the health service asks Redis.
pub const HEALTH_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// A call from its protobuf message.
pub fn call_of(req: &RateLimitRequest) -> Call {
    Call {
        domain: req.domain.clone(),
        descriptors: req
            .descriptors
            .iter()
            .map(|d| Descriptor {
                entries: d.entries.iter().map(|e| (e.key.clone(), e.value.clone())).collect(),
                limit: d.limit.map(|l| (l.requests_per_unit, l.unit)),
                hits_addend: d.hits_addend.as_ref().map(|h| h.value),
            })
            .collect(),
        hits_addend: req.hits_addend,
    }
}

fn code(c: Code) -> i32 {
    match c {
        Code::Ok => PbCode::Ok as i32,
        Code::OverLimit => PbCode::OverLimit as i32,
    }
}

/// A duration in protobuf's form.
pub fn duration(n: ratewall_core::Nanos) -> PbDuration {
    let secs = n / ratewall_core::SECOND;
    PbDuration {
        seconds: i64::try_from(secs).unwrap_or(i64::MAX),
        nanos: i32::try_from(n % ratewall_core::SECOND).unwrap_or(0),
    }
}

/// An answer as its protobuf message.
pub fn response_of(a: &Answer) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: code(a.overall_code),
        statuses: a
            .statuses
            .iter()
            .map(|s| DescriptorStatus {
                code: code(s.code),
                current_limit: s.current_limit.as_ref().map(|l| RateLimit {
                    name: l.name.clone(),
                    requests_per_unit: l.requests_per_unit,
                    unit: l.unit,
                }),
                limit_remaining: s.limit_remaining,
                duration_until_reset: s.duration_until_reset.map(duration),
                quota: None,
            })
            .collect(),
        response_headers_to_add: a
            .headers
            .iter()
            .map(|(k, v)| HeaderValue { key: (*k).to_owned(), value: v.clone(), raw_value: Vec::new() })
            .collect(),
        ..Default::default()
    }
}

/// The service, for tonic.
pub struct Service<K>(pub Arc<Rls<K>>);

#[tonic::async_trait]
impl<K: Kv + 'static> RateLimitService for Service<K> {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let call = call_of(request.get_ref());
        match self.0.should_rate_limit(&call).await {
            Ok(a) => Ok(tonic::Response::new(response_of(&a))),
            Err(Refusal::Invalid(why)) => Err(tonic::Status::invalid_argument(why)),
            Err(Refusal::Unavailable(why)) => Err(tonic::Status::unavailable(why)),
        }
    }
}

/// Sets every service the health service reports to SERVING or not.
async fn report(reporter: &tonic_health::server::HealthReporter, serving: bool) {
    let status = if serving { tonic_health::ServingStatus::Serving } else { tonic_health::ServingStatus::NotServing };
    for name in HEALTH_SERVICES {
        reporter.set_service_status(name, status).await;
    }
}

/// Reports, every [`HEALTH_EVERY`], whether the store reaches Redis.
async fn watch_health<K: Kv>(rls: Arc<Rls<K>>, reporter: tonic_health::server::HealthReporter) {
    let mut tick = tokio::time::interval(HEALTH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let up = tokio::time::timeout(HEALTH_EVERY, rls.store().kv.ping()).await.is_ok_and(|r| r.is_ok());
        report(&reporter, up).await;
    }
}

/// Longest a call may take once its head has arrived, its request's body read included (a
/// call is answered within the store's deadline; this bounds a client that sends its message
/// slowly, or part of it). A health `Watch` stream, once answered, is not bounded by it.
pub const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// How often the server pings a connection's client (HTTP/2 keep-alive), and how long it waits
/// for the answer before it closes the connection: a client gone without closing it is found.
pub const KEEPALIVE: (std::time::Duration, std::time::Duration) =
    (std::time::Duration::from_secs(30), std::time::Duration::from_secs(10));

/// Most calls in flight on one connection.
pub const MAX_STREAMS: u32 = 256;

/// Serves the service and the health service (h2c) on the connections `incoming` accepts until
/// `stop`; then each connection is asked to end once its calls in flight are answered.
pub async fn serve<K, I, IO, IE>(rls: Arc<Rls<K>>, incoming: I, stop: impl Future<Output = ()>) -> Result<(), String>
where
    K: Kv + 'static,
    I: futures_util::Stream<Item = Result<IO, IE>>,
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + tonic::transport::server::Connected + Unpin + Send + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (reporter, health) = tonic_health::server::health_reporter();
    // NOT_SERVING until Redis has answered.
    report(&reporter, false).await;
    let watcher = tokio::spawn(watch_health(Arc::clone(&rls), reporter.clone()));
    let stopping = async move {
        stop.await;
        watcher.abort();
        report(&reporter, false).await;
    };
    let service = RateLimitServiceServer::new(Service(rls)).max_decoding_message_size(MAX_MESSAGE);
    tonic::transport::Server::builder()
        .timeout(CALL_TIMEOUT)
        // Calls at once on one connection: Envoy multiplexes every call of a proxy on one, a
        // few in flight at a time; unbounded, one client held 1,500 calls' bodies (1.5 GB).
        .max_concurrent_streams(MAX_STREAMS)
        .http2_keepalive_interval(Some(KEEPALIVE.0))
        .http2_keepalive_timeout(Some(KEEPALIVE.1))
        .add_service(health)
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, stopping)
        .await
        .map_err(|e| e.to_string())
}
