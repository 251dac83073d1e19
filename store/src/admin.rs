//! The admin listener (`--admin ADDR`, off unless given): the dashboard page, the fleet's top
//! offenders, its traffic series and nodes, metrics and health — without authentication, as
//! Envoy's admin port, so bind it to loopback or a private network (docs/operations.md).

use crate::rls::Rls;
use crate::top::Window;
use crate::{Kv, Store};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};
use std::sync::Arc;

/// The dashboard page, compiled in.
pub const PAGE: &str = include_str!("../../dashboard/index.html");

/// The admin routes over `store`, and the rate limit service `rls` when it runs (its
/// metrics are in `/metrics`, as on the main listener).
pub fn router<K: Kv + Send + Sync + 'static>(store: Arc<Store<K>>, rls: Option<Arc<Rls<K>>>) -> Router {
    Router::new()
        .route("/", get(page))
        .route(
            "/v1/top",
            get({
                let rls = rls.clone();
                move |State(store): State<Arc<Store<K>>>, uri: Uri| async move { top(&store, rls.as_deref(), &uri) }
            }),
        )
        .route("/v1/series", get(series::<K>))
        .route("/v1/fleet", get(fleet::<K>))
        .route(
            "/metrics",
            get(move |State(store): State<Arc<Store<K>>>| async move { metrics(&store, rls.as_deref()) }),
        )
        .route("/healthz", get(healthz::<K>))
        .fallback(|uri: Uri| async move {
            let why = format!(
                "no admin route {} (GET /, /v1/top, /v1/series, /v1/fleet, /metrics, /healthz, /healthcheck)",
                uri.path()
            );
            json_response(StatusCode::NOT_FOUND, &json!({"error": why}))
        })
        .method_not_allowed_fallback(|| async {
            json_response(StatusCode::METHOD_NOT_ALLOWED, &json!({"error": "the admin routes answer GET only"}))
        })
        .with_state(store)
}

/// `GET /metrics`, on the main listener and the admin one alike: the store's metrics in
/// Prometheus text, then the rate limit service's when it runs.
pub fn metrics<K>(store: &Store<K>, rls: Option<&Rls<K>>) -> Response {
    let mut text = store.metrics.render();
    if let Some(rls) = rls {
        text.push_str(&rls.metrics.render());
    }
    let mut out = (StatusCode::OK, text).into_response();
    out.headers_mut().insert("content-type", HeaderValue::from_static("text/plain; version=0.0.4"));
    out
}

/// A query string's value of `name` (the first), percent-decoded as a browser encodes it (`+`
/// a space; bytes that are not UTF-8 replaced), as the Worker reads it; a bare `name` is
/// the empty value.
fn param(uri: &Uri, name: &str) -> Option<String> {
    let raw = uri.query()?.split('&').find_map(|p| match p.split_once('=') {
        Some((k, v)) if k == name => Some(v),
        None if p == name => Some(""),
        _ => None,
    })?;
    let (bytes, mut out, mut i) = (raw.as_bytes(), Vec::with_capacity(raw.len()), 0);
    while let Some(&b) = bytes.get(i) {
        let hex = bytes
            .get(i + 1..i + 3)
            .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
            .and_then(|h| std::str::from_utf8(h).ok());
        match (b, hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(v)) => {
                out.push(v);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            _ => {
                out.push(b);
                i += 1;
            }
        }
    }
    Some(String::from_utf8_lossy(&out).into_owned())
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    let mut out = (status, v.to_string()).into_response();
    out.headers_mut().insert("content-type", HeaderValue::from_static("application/json"));
    out.headers_mut().insert("cache-control", HeaderValue::from_static("no-store"));
    out
}

async fn page() -> Response {
    let mut out = (StatusCode::OK, PAGE).into_response();
    out.headers_mut().insert("content-type", HeaderValue::from_static("text/html; charset=utf-8"));
    out
}

fn top<K: Kv>(store: &Store<K>, rls: Option<&Rls<K>>, uri: &Uri) -> Response {
    let window = match Window::parse(param(uri, "window").as_deref()) {
        Ok(w) => w,
        Err(why) => return json_response(StatusCode::BAD_REQUEST, &json!({"error": why})),
    };
    let rule = param(uri, "rule");
    let mut out = store.top.top(rule.as_deref(), window);
    if let (Some(rls), Some(Value::Array(rules))) = (rls, out.get_mut("rules")) {
        in_configuration_order(rules, &rls.config(), rule.as_deref());
    }
    json_response(StatusCode::OK, &out)
}

/// The rate limit service's rules in its configuration's order, each (or only `only`) listed
/// even when no call was heard for it, then the filters' rules and the overrides, which keep
/// the order they were first heard in.
fn in_configuration_order(rules: &mut Vec<Value>, config: &crate::rls::config::RlsConfig, only: Option<&str>) {
    let mut order: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for r in config.rules.iter().filter(|r| !r.unlimited) {
        order.entry(r.top_name.as_str()).or_insert(r.order);
    }
    let heard: std::collections::HashSet<String> =
        rules.iter().filter_map(|r| r["rule"].as_str().map(str::to_owned)).collect();
    for r in config.rules.iter().filter(|r| !r.unlimited) {
        let name = r.top_name.as_str();
        if !heard.contains(name) && only.is_none_or(|o| o == name) && order.get(name) == Some(&r.order) {
            rules.push(json!({"rule": name, "allowed": 0, "denied": 0, "shadow_denied": 0, "top": []}));
        }
    }
    // Stable: the filters' rules and the overrides keep the order they were first heard in.
    rules.sort_by_key(|r| r["rule"].as_str().and_then(|n| order.get(n)).map_or((1, 0), |o| (0, *o)));
}

async fn series<K: Kv>(State(store): State<Arc<Store<K>>>, uri: Uri) -> Response {
    json_response(StatusCode::OK, &store.top.series(param(&uri, "rule").as_deref()))
}

async fn fleet<K: Kv>(State(store): State<Arc<Store<K>>>) -> Response {
    let ok = store.kv.ping().await.is_ok();
    let mut nodes = store.top.fleet();
    if !ok {
        // With Redis out of reach no store process can answer a batch: every node is degraded,
        // those heard through a peer (whose shares stopped with Redis) too.
        for n in &mut nodes {
            if let Some(o) = n.as_object_mut() {
                o.insert("degraded".into(), Value::Bool(true));
            }
        }
    }
    json_response(StatusCode::OK, &json!({"nodes": nodes, "redis": {"ok": ok}}))
}

async fn healthz<K: Kv>(State(store): State<Arc<Store<K>>>) -> Response {
    health(&store).await
}

/// `GET /healthz`: 200 `ok` while Redis answers and takes the store's writes, else 503 and
/// why (Redis's error: `OOM command not allowed…`, `READONLY…`, `NOPERM…`, or no answer).
pub async fn health<K: Kv>(store: &Store<K>) -> Response {
    match store.kv.ping().await {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(e) => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("Redis does not take the store's writes: {e}\n")).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_limit_services_rules_are_listed_in_configuration_order_heard_or_not() {
        let config = crate::rls::config::RlsConfig::parse(
            "t.yaml",
            "domain: api
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: apikey
    rate_limit: {unit: minute, requests_per_unit: 2, name: apikey-limit}
  - key: free
    rate_limit: {unlimited: true}
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 10}
",
        )
        .unwrap();
        let heard = |name: &str| json!({"rule": name, "allowed": 1, "denied": 1, "shadow_denied": 0, "top": []});
        let mut rules = vec![heard("api.tenant"), heard("login"), heard("apikey-limit")];
        in_configuration_order(&mut rules, &config, None);
        let names: Vec<&str> = rules.iter().filter_map(|r| r["rule"].as_str()).collect();
        assert_eq!(names, ["api.user", "apikey-limit", "api.tenant", "login"], "the file's rules, then a filter's");
        assert_eq!(rules[0]["denied"], 0, "a rule no call was heard for, with nothing counted");
        let mut one = vec![];
        in_configuration_order(&mut one, &config, Some("apikey-limit"));
        assert_eq!(one.len(), 1);
        assert_eq!(one[0]["rule"], "apikey-limit");
    }
}
