//! ratewall-store's rate limit service as Envoy drives it: the built binary with `--rls` on
//! loopback, over a real Redis the tests start and stop by PID, called by a tonic client of
//! `envoy.service.ratelimit.v3.RateLimitService` (and `POST /json`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{Entry, RateLimitOverride};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use ratewall_tests::http;
use ratewall_tests::redis::Redis;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

const SECRET: &str = "rls-test-secret-0123456789";
const DEADLINE_MS: u64 = 200;

/// A running `ratewall-store --rls`, killed when dropped.
struct RlsProcess {
    child: Child,
    /// The HTTP listener.
    http: String,
    /// The gRPC listener.
    grpc: String,
    /// The admin listener, when started with one.
    admin: Option<String>,
    stderr: PathBuf,
    _stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl RlsProcess {
    fn start(redis: &str, config: &Path) -> RlsProcess {
        RlsProcess::start_with(redis, config, false)
    }

    /// With `admin`, also an admin listener (`--admin`).
    fn start_with(redis: &str, config: &Path, admin: bool) -> RlsProcess {
        let stderr = config.with_extension(format!("stderr-{}", std::process::id()));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ratewall-store"));
        cmd.env("RATEWALL_SYNC_SECRET", SECRET)
            .args(["--listen", "127.0.0.1:0", "--rls", "127.0.0.1:0", "--deadline-ms", &DEADLINE_MS.to_string()])
            .args(["--redis", redis])
            .arg("--rls-config")
            .arg(config)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap());
        if admin {
            cmd.args(["--admin", "127.0.0.1:0"]);
        }
        let mut child = cmd.spawn().unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let (mut http, mut grpc, mut admin_at) = (None, None, None);
        while grpc.is_none() || admin && admin_at.is_none() {
            let mut line = String::new();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "ratewall-store ended: {}",
                std::fs::read_to_string(&stderr).unwrap()
            );
            assert!(!line.contains(SECRET));
            let addr = line.split("http://").nth(1).and_then(|rest| rest.split(['/', ' ']).next()).map(str::to_owned);
            if line.contains("admin on") {
                admin_at = addr;
            } else if addr.is_some() {
                http = addr;
            }
            if let Some(rest) = line.split("rate limit service on ").nth(1) {
                grpc = rest.split_whitespace().next().map(str::to_owned);
            }
        }
        RlsProcess { child, http: http.unwrap(), grpc: grpc.unwrap(), admin: admin_at, stderr, _stdout: out }
    }

    async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc)).await.unwrap()
    }

    /// Stops the process as an orchestrator does (SIGTERM) and waits, at most 15 s, for it
    /// to end; whether it ended successfully.
    fn terminate(&mut self) -> bool {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.success();
            }
            assert!(start.elapsed() < Duration::from_secs(15), "ratewall-store did not stop: {}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn metrics(&self) -> String {
        http::request(&self.http, "GET", "/metrics", &[], &[]).unwrap().text()
    }
}

impl Drop for RlsProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.stderr);
    }
}

/// A fresh directory for a test's configuration files, removed with what it holds when
/// dropped.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn dir(name: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("ratewall-rls-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}

/// A configuration file in a directory of its own, removed when dropped (declare it before
/// the process that reads it, so that the process is stopped first).
struct Config {
    path: PathBuf,
    _dir: Scratch,
}

impl std::ops::Deref for Config {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for Config {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

/// `text` written to `file` in a fresh directory `name`.
fn config(name: &str, file: &str, text: &str) -> Config {
    let dir = dir(name);
    let path = dir.join(file);
    std::fs::write(&path, text).unwrap();
    Config { path, _dir: dir }
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries.iter().map(|(k, v)| Entry { key: (*k).into(), value: (*v).into() }).collect(),
        ..Default::default()
    }
}

fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest { domain: domain.into(), descriptors, hits_addend: 0 }
}

async fn ask(c: &mut RateLimitServiceClient<Channel>, r: RateLimitRequest) -> RateLimitResponse {
    c.should_rate_limit(r).await.unwrap().into_inner()
}

/// The limit a status reports: (requests per unit, unit), or None.
fn limit_of(r: &RateLimitResponse, i: usize) -> Option<(u32, i32)> {
    r.statuses[i].current_limit.as_ref().map(|l| (l.requests_per_unit, l.unit))
}

fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    r.response_headers_to_add.iter().find(|h| h.key.eq_ignore_ascii_case(name)).map(|h| h.value.as_str())
}

const SECOND: i32 = 1;
const MINUTE: i32 = 2;
const DAY: i32 = 4;
const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

/// The configuration section of envoyproxy/ratelimit's README, one example per file.
const README_EXAMPLES: [(&str, &str); 8] = [
    (
        "example1.yaml",
        "domain: mongo_cps
descriptors:
  - key: database
    value: users
    rate_limit:
      unit: second
      requests_per_unit: 500

  - key: database
    value: default
    rate_limit:
      unit: second
      requests_per_unit: 500
",
    ),
    (
        "example2.yaml",
        "domain: messaging
descriptors:
  # Only allow 5 marketing messages a day
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit:
          unit: day
          requests_per_unit: 5

  # Only allow 100 messages a day to any unique phone number
  - key: to_number
    rate_limit:
      unit: day
      requests_per_unit: 100
",
    ),
    (
        "example3.yaml",
        "domain: edge_proxy_per_ip
descriptors:
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 10

  # Black list IP
  - key: remote_address
    value: 50.0.0.5
    rate_limit:
      unit: second
      requests_per_unit: 0
",
    ),
    (
        "example4.yaml",
        "domain: example4
descriptors:
  - key: key
    value: value
    rate_limit:
      requests_per_unit: 300
      unit: second
  - key: nested
    value: value
    descriptors:
      - key: subkey
        rate_limit:
          requests_per_unit: 300
          unit: second
",
    ),
    (
        "example5.yaml",
        "domain: internal
descriptors:
  - key: ldap
    rate_limit:
      unlimited: true

  - key: azure
    rate_limit:
      unit: minute
      requests_per_unit: 100

  # Neither a limit nor descriptors: whitelisted.
  - key: health
",
    ),
    (
        "example6.yaml",
        "domain: example6
descriptors:
  - key: service
    descriptors:
      - key: user
        value: user-a
        rate_limit:
          requests_per_unit: 10
          unit: second
        shadow_mode: true
      - key: user
        value: user-b
        rate_limit:
          requests_per_unit: 20
          unit: second
",
    ),
    (
        "example7.yaml",
        "domain: example7
descriptors:
  - key: key_1
    value: value_1
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          name: specific_limit
          requests_per_unit: 5
          unit: second
  - key: key_2
    value: value_2
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          replaces:
            - name: specific_limit
          requests_per_unit: 10
          unit: second
",
    ),
    (
        "example9.yml",
        "domain: example9
descriptors:
  - key: key1
    value: value*
    rate_limit:
      unit: minute
      requests_per_unit: 20
  - key: path
    value: /api/*/action
    rate_limit:
      unit: minute
      requests_per_unit: 21
  - key: route
    value: /api/*/resource/*/action
    rate_limit:
      unit: minute
      requests_per_unit: 22
",
    ),
];

fn readme_examples() -> Scratch {
    let d = dir("readme");
    for (name, text) in README_EXAMPLES {
        std::fs::write(d.join(name), text).unwrap();
    }
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_readme_example_answers_as_the_readme_says() {
    let redis = Redis::start(false).unwrap();
    let examples = readme_examples();
    let store = RlsProcess::start(&redis.url(), &examples);
    let mut c = store.client().await;

    // Example 1: two values of one key, 500 per second each.
    for value in ["users", "default"] {
        let r = ask(&mut c, request("mongo_cps", vec![descriptor(&[("database", value)])])).await;
        assert_eq!((r.overall_code, limit_of(&r, 0)), (OK, Some((500, SECOND))), "{value}");
        assert_eq!(r.statuses[0].limit_remaining, 499);
    }
    let r = ask(&mut c, request("mongo_cps", vec![descriptor(&[("database", "other")])])).await;
    assert_eq!((r.overall_code, limit_of(&r, 0)), (OK, None));

    // Example 2: nested descriptors, and several descriptors in one call.
    let marketing = || descriptor(&[("message_type", "marketing"), ("to_number", "2061111111")]);
    let number = || descriptor(&[("to_number", "2061111111")]);
    let r = ask(&mut c, request("messaging", vec![marketing(), number()])).await;
    assert_eq!((limit_of(&r, 0), limit_of(&r, 1)), (Some((5, DAY)), Some((100, DAY))));
    let other = ask(
        &mut c,
        request("messaging", vec![descriptor(&[("message_type", "marketing"), ("to_number", "2062222222")])]),
    )
    .await;
    assert_eq!(other.statuses[0].limit_remaining, 4, "each number has its own 5 a day");
    for _ in 0..4 {
        assert_eq!(ask(&mut c, request("messaging", vec![marketing(), number()])).await.overall_code, OK);
    }
    let r = ask(&mut c, request("messaging", vec![marketing(), number()])).await;
    assert_eq!(r.overall_code, OVER, "the sixth marketing message of the day");
    assert_eq!((r.statuses[0].code, r.statuses[1].code), (OVER, OK));
    assert_eq!(r.statuses[1].limit_remaining, 95, "a denied call charges no descriptor");

    // Example 3: the most specific match; 0 requests per unit blocks.
    let r = ask(&mut c, request("edge_proxy_per_ip", vec![descriptor(&[("remote_address", "50.0.0.1")])])).await;
    assert_eq!((r.overall_code, limit_of(&r, 0)), (OK, Some((10, SECOND))));
    let r = ask(&mut c, request("edge_proxy_per_ip", vec![descriptor(&[("remote_address", "50.0.0.5")])])).await;
    assert_eq!((r.overall_code, limit_of(&r, 0)), (OVER, Some((0, SECOND))));

    // Example 4: a request matches only at its own depth.
    let r = ask(&mut c, request("example4", vec![descriptor(&[("key", "value"), ("subkey", "subvalue")])])).await;
    assert_eq!((r.overall_code, limit_of(&r, 0)), (OK, None));
    let r = ask(&mut c, request("example4", vec![descriptor(&[("nested", "value"), ("subkey", "subvalue")])])).await;
    assert_eq!(limit_of(&r, 0), Some((300, SECOND)));

    // Example 5: unlimited answers OK with the most remaining; a bare descriptor is whitelisted.
    let r = ask(
        &mut c,
        request(
            "internal",
            vec![descriptor(&[("ldap", "x")]), descriptor(&[("azure", "y")]), descriptor(&[("health", "z")])],
        ),
    )
    .await;
    assert_eq!(r.overall_code, OK);
    assert_eq!((r.statuses[0].code, r.statuses[0].limit_remaining, limit_of(&r, 0)), (OK, u32::MAX, None));
    assert_eq!(limit_of(&r, 1), Some((100, MINUTE)));
    assert_eq!((r.statuses[2].code, limit_of(&r, 2)), (OK, None));

    // Example 6: shadow mode never limits; its neighbour does.
    let mut shadow = request("example6", vec![descriptor(&[("service", "auth-service"), ("user", "user-a")])]);
    shadow.hits_addend = 11;
    let r = ask(&mut c, shadow).await;
    assert_eq!((r.overall_code, r.statuses[0].code), (OK, OK), "over its 10 a second, in shadow mode");
    let mut enforced = request("example6", vec![descriptor(&[("service", "auth-service"), ("user", "user-b")])]);
    enforced.hits_addend = 21;
    assert_eq!(ask(&mut c, enforced).await.overall_code, OVER);
    assert!(store
        .metrics()
        .contains("ratewall_rls_shadow_mode_total{domain=\"example6\",rule=\"example6.service.user_user-a\"} 11"));

    // Example 7: replaces.
    let one = || descriptor(&[("key_1", "value_1"), ("user", "bkthomps")]);
    let two = || descriptor(&[("key_2", "value_2"), ("user", "bkthomps")]);
    assert_eq!(limit_of(&ask(&mut c, request("example7", vec![one()])).await, 0), Some((5, SECOND)));
    assert_eq!(limit_of(&ask(&mut c, request("example7", vec![two()])).await, 0), Some((10, SECOND)));
    let r = ask(&mut c, request("example7", vec![one(), two()])).await;
    assert_eq!((limit_of(&r, 0), limit_of(&r, 1)), (None, Some((10, SECOND))), "specific_limit was replaced");

    // Example 9: wildcards, trailing, in the middle and several.
    for (key, value, want) in [
        ("key1", "value1", Some((20, MINUTE))),
        ("key1", "valueXYZ", Some((20, MINUTE))),
        ("path", "/api/123/action", Some((21, MINUTE))),
        ("path", "/api/123/other", None),
        ("route", "/api/v1/resource/123/action", Some((22, MINUTE))),
    ] {
        let r = ask(&mut c, request("example9", vec![descriptor(&[(key, value)])])).await;
        assert_eq!(limit_of(&r, 0), want, "{key}={value}");
    }

    // A domain nobody configured limits nothing.
    let r = ask(&mut c, request("nobody", vec![descriptor(&[("database", "users")])])).await;
    assert_eq!((r.overall_code, limit_of(&r, 0)), (OK, None));
}

const LIMITS: &str = "domain: api
descriptors:
  - key: user
    rate_limit:
      unit: day
      requests_per_unit: 5
  - key: exact_user
    exact: true
    rate_limit:
      unit: day
      requests_per_unit: 5
      name: exact-user
  - key: sliding
    rate_limit:
      unit: minute
      requests_per_unit: 4
      algorithm: sliding_window
";

fn limits(name: &str) -> Config {
    config(name, "limits.yaml", LIMITS)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_addend_counts_per_call_and_per_descriptor() {
    let redis = Redis::start(false).unwrap();
    let config = limits("hits");
    let store = RlsProcess::start(&redis.url(), &config);
    let mut c = store.client().await;
    for key in ["user", "exact_user"] {
        let mut r = request("api", vec![descriptor(&[(key, "h")])]);
        r.hits_addend = 3;
        assert_eq!(ask(&mut c, r.clone()).await.statuses[0].limit_remaining, 2, "{key}");
        // Its own hits_addend wins over the call's; 0 looks without taking.
        r.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
        let a = ask(&mut c, r.clone()).await;
        assert_eq!((a.overall_code, a.statuses[0].limit_remaining), (OK, 2), "{key}");
        r.descriptors[0].hits_addend = Some(UInt64Value { value: 3 });
        assert_eq!(ask(&mut c, r.clone()).await.overall_code, OVER, "{key}");
        r.descriptors[0].hits_addend = Some(UInt64Value { value: 2 });
        let a = ask(&mut c, r).await;
        assert_eq!((a.overall_code, a.statuses[0].limit_remaining), (OK, 0), "{key}: the denied 3 took nothing");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_serves_the_same_metrics_as_the_main_one() {
    let redis = Redis::start(false).unwrap();
    let config = limits("admin-metrics");
    let store = RlsProcess::start_with(&redis.url(), &config, true);
    let mut c = store.client().await;
    let mut r = request("api", vec![descriptor(&[("user", "m")])]);
    r.hits_addend = 2;
    assert_eq!(ask(&mut c, r).await.overall_code, OK);
    let admin = store.admin.as_deref().unwrap();
    let main = store.metrics();
    let answer = http::request(admin, "GET", "/metrics", &[], &[]).unwrap();
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("content-type"), Some("text/plain; version=0.0.4"));
    assert!(answer.text().contains("ratewall_rls_"), "{}", answer.text());
    // The same text, but for the counts of top-offender shares, which go on every second.
    let shape = |t: &str| -> Vec<String> {
        t.lines()
            .map(|l| match l.rsplit_once(' ') {
                Some((name, _)) if l.starts_with("ratewall_store_top_") => name.to_owned(),
                _ => l.to_owned(),
            })
            .collect()
    };
    assert_eq!(shape(&answer.text()), shape(&main), "the admin listener's /metrics is the main listener's");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_override_replaces_the_configured_limit() {
    let redis = Redis::start(false).unwrap();
    let config = limits("override");
    let store = RlsProcess::start(&redis.url(), &config);
    let mut c = store.client().await;
    let mut d = descriptor(&[("user", "o")]);
    d.limit = Some(RateLimitOverride { requests_per_unit: 2, unit: MINUTE });
    let r = ask(&mut c, request("api", vec![d.clone()])).await;
    assert_eq!((limit_of(&r, 0), r.statuses[0].limit_remaining), (Some((2, MINUTE)), 1));
    assert_eq!(ask(&mut c, request("api", vec![d.clone()])).await.overall_code, OK);
    assert_eq!(ask(&mut c, request("api", vec![d.clone()])).await.overall_code, OVER);
    // Overrides also limit descriptors the configuration does not match, in a known domain.
    let mut unmatched = descriptor(&[("tenant", "t")]);
    unmatched.limit = Some(RateLimitOverride { requests_per_unit: 1, unit: DAY });
    assert_eq!(limit_of(&ask(&mut c, request("api", vec![unmatched])).await, 0), Some((1, DAY)));
    // An override without a unit is refused, not guessed.
    d.limit = Some(RateLimitOverride { requests_per_unit: 2, unit: 0 });
    let e = c.should_rate_limit(request("api", vec![d])).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_carry_ratelimit_policy_and_retry_after() {
    let redis = Redis::start(false).unwrap();
    let config = limits("headers");
    let store = RlsProcess::start(&redis.url(), &config);
    let mut c = store.client().await;
    let r = ask(&mut c, request("api", vec![descriptor(&[("exact_user", "hd")])])).await;
    assert_eq!(header(&r, "RateLimit-Policy"), Some("\"exact-user\";q=5;w=86400"));
    let state = header(&r, "RateLimit").unwrap();
    assert!(state.starts_with("\"exact-user\";r=4;t="), "{state}");
    assert!(header(&r, "Retry-After").is_none());
    let mut big = request("api", vec![descriptor(&[("exact_user", "hd")]), descriptor(&[("sliding", "hd")])]);
    big.hits_addend = 5;
    let r = ask(&mut c, big).await;
    assert_eq!(r.overall_code, OVER);
    let retry: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
    assert!((1..=86_400).contains(&retry), "{retry}");
    let policy = header(&r, "RateLimit-Policy").unwrap();
    assert!(policy.contains("\"exact-user\";q=5;w=86400") && policy.contains("\"api.sliding\";q=4;w=60"), "{policy}");
    let duration = r.statuses[0].duration_until_reset.unwrap();
    assert!(duration.seconds > 0 && duration.seconds <= 86_400, "{duration:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_file_is_reloaded_and_a_broken_one_refused() {
    let redis = Redis::start(false).unwrap();
    let path = limits("reload");
    let store = RlsProcess::start(&redis.url(), &path);
    let mut c = store.client().await;
    let probe = || request("api", vec![descriptor(&[("user", "r")])]);
    assert_eq!(limit_of(&ask(&mut c, probe()).await, 0), Some((5, DAY)));
    std::fs::write(
        &path,
        LIMITS.replace("requests_per_unit: 5\n  - key: exact_user", "requests_per_unit: 7\n  - key: exact_user"),
    )
    .unwrap();
    let start = Instant::now();
    while limit_of(&ask(&mut c, probe()).await, 0) != Some((7, DAY)) {
        assert!(start.elapsed() < Duration::from_secs(10), "the changed file was not reloaded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    std::fs::write(&path, "domain: api\ndescriptors:\n  - key: user\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n").unwrap();
    let start = Instant::now();
    while !store.metrics().contains("ratewall_rls_config_errors_total 1") {
        assert!(start.elapsed() < Duration::from_secs(10), "the broken file was not read");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(limit_of(&ask(&mut c, probe()).await, 0), Some((7, DAY)), "the last good configuration stays");
    let log = store.log();
    assert!(
        log.contains(&format!("{}:3:", path.display())) && log.contains("invalid rate limit unit 'fortnight'"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_is_unavailable_within_the_deadline_and_answers_resume() {
    let mut redis = Redis::start(false).unwrap();
    let config = limits("down");
    let store = RlsProcess::start(&redis.url(), &config);
    let mut c = store.client().await;
    assert_eq!(ask(&mut c, request("api", vec![descriptor(&[("exact_user", "x")])])).await.overall_code, OK);
    // A counter this process then holds a grant on.
    assert_eq!(ask(&mut c, request("api", vec![descriptor(&[("user", "held")])])).await.overall_code, OK);
    redis.stop();
    for (key, value) in [("exact_user", "never-seen"), ("user", "never-seen"), ("user", "held")] {
        let started = Instant::now();
        let e = c.should_rate_limit(request("api", vec![descriptor(&[(key, value)])])).await.unwrap_err();
        let took = started.elapsed();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{key}={value}: {e}");
        assert!(took < Duration::from_millis(DEADLINE_MS + 300), "{key}={value}: {took:?}");
    }
    // Said in the log, once for the three calls (at most once per 10 s).
    let said = |log: String| log.lines().filter(|l| l.contains("a Redis command failed")).count();
    let start = Instant::now();
    while said(store.log()) == 0 {
        assert!(start.elapsed() < Duration::from_secs(5), "Redis's failure was not logged: {}", store.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(said(store.log()), 1, "{}", store.log());
    redis.restart().unwrap();
    answered_within_15_s(&mut c, ("exact_user", "y")).await;
}

/// Redis paused (SIGSTOP: connected, answering nothing): calls are UNAVAILABLE at the
/// deadline, and each such call counts as a Redis error in the metrics (they stayed at 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_is_unavailable_at_the_deadline_and_counted_as_an_error() {
    let redis = Redis::start(false).unwrap();
    let config = limits("paused");
    let store = RlsProcess::start(&redis.url(), &config);
    let mut c = store.client().await;
    assert_eq!(ask(&mut c, request("api", vec![descriptor(&[("exact_user", "p")])])).await.overall_code, OK);
    let errors = |m: String| {
        m.lines()
            .find_map(|l| l.strip_prefix("ratewall_store_redis_errors_total "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let before = errors(store.metrics());
    let pid = redis.pid().unwrap().to_string();
    assert!(Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
    let e = c.should_rate_limit(request("api", vec![descriptor(&[("exact_user", "q")])])).await.unwrap_err();
    let after = errors(store.metrics());
    assert!(Command::new("kill").args(["-CONT", &pid]).status().unwrap().success());
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    assert!(after > before, "{before} -> {after}");
}

/// A call answered `UNAVAILABLE` while Redis is paused takes nothing, though its
/// compare-and-set is on Redis's socket and Redis runs it when it answers again: the script
/// writes nothing past the call's deadline (the call was counted, 994 left here, while Envoy,
/// failing closed, denied the request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_answered_unavailable_while_redis_is_paused_takes_nothing() {
    let redis = Redis::start(false).unwrap();
    let scratch = dir("late");
    let path = scratch.join("limits.yaml");
    let limits = "domain: api\ndescriptors:\n  - key: exact_user\n    exact: true\n    rate_limit: {unit: hour, requests_per_unit: 1000}\n";
    std::fs::write(&path, limits).unwrap();
    let store = RlsProcess::start(&redis.url(), &path);
    let mut c = store.client().await;
    let pid = redis.pid().unwrap().to_string();
    // Decided at Redis on every call: the process knows the counter's value from its last
    // write, so its compare-and-set goes out at once.
    let hit = request("api", vec![descriptor(&[("exact_user", "late")])]);
    let mut look = hit.clone();
    look.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    for _ in 0..5 {
        assert_eq!(ask(&mut c, hit.clone()).await.overall_code, OK);
    }
    assert_eq!(ask(&mut c, look.clone()).await.statuses[0].limit_remaining, 995);
    assert!(Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
    let e = c.should_rate_limit(hit.clone()).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(Command::new("kill").args(["-CONT", &pid]).status().unwrap().success());
    assert_eq!(e.map(|_| ()).unwrap_err().code(), tonic::Code::Unavailable);
    // Redis has run it by the first look that is answered (a look takes nothing).
    let start = Instant::now();
    let left = loop {
        match c.should_rate_limit(look.clone()).await {
            Ok(r) => break r.into_inner().statuses[0].limit_remaining,
            Err(e) => assert!(start.elapsed() < Duration::from_secs(10), "{e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(left, 995, "the call answered UNAVAILABLE was counted");
    // And the counter serves on.
    assert_eq!(ask(&mut c, hit).await.statuses[0].limit_remaining, 994);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_started_while_redis_is_down_answers_unavailable_until_it_is_up() {
    let mut redis = Redis::start(false).unwrap();
    redis.stop();
    let config = limits("down-at-start");
    let store = RlsProcess::start(&redis.url(), &config);
    let mut c = store.client().await;
    let e = c.should_rate_limit(request("api", vec![descriptor(&[("user", "first")])])).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    redis.restart().unwrap();
    answered_within_15_s(&mut c, ("user", "first")).await;
}

/// Asks on `entry` until it is answered OK, for at most 15 s.
async fn answered_within_15_s(c: &mut RateLimitServiceClient<Channel>, entry: (&str, &str)) {
    let start = Instant::now();
    loop {
        match c.should_rate_limit(request("api", vec![descriptor(&[entry])])).await {
            Ok(r) if r.get_ref().overall_code == OK => return,
            other => assert!(start.elapsed() < Duration::from_secs(15), "no answer: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_json_is_the_grpc_answer_in_proto3_json() {
    let redis = Redis::start(false).unwrap();
    let config = limits("json");
    let store = RlsProcess::start(&redis.url(), &config);
    let body = br#"{"domain":"api","descriptors":[{"entries":[{"key":"exact_user","value":"j"}]}],"hitsAddend":4}"#;
    let r = http::request(&store.http, "POST", "/json", &[("content-type", "application/json")], body).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["overallCode"], "OK");
    assert_eq!(v["statuses"][0]["currentLimit"]["requestsPerUnit"], 5);
    assert_eq!(v["statuses"][0]["currentLimit"]["unit"], "DAY");
    assert_eq!(v["statuses"][0]["limitRemaining"], 1);
    assert!(v["statuses"][0]["durationUntilReset"].as_str().unwrap().ends_with('s'));
    let r = http::request(&store.http, "POST", "/json", &[], body).unwrap();
    assert_eq!(r.status, 429);
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["overallCode"], "OVER_LIMIT");
    assert!(v["responseHeadersToAdd"].as_array().unwrap().iter().any(|h| h["key"] == "Retry-After"));
    let r = http::request(&store.http, "POST", "/json", &[], b"{\"domain\":\"api\",\"bogus\":1}").unwrap();
    assert_eq!(r.status, 400);
    // Another method names the one it takes; another path, every one the listener serves.
    let r = http::request(&store.http, "GET", "/json", &[], &[]).unwrap();
    assert_eq!(r.status, 405);
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"], "method not allowed: POST /json");
    assert!(r.headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("allow") && v == "POST"), "{:?}", r.headers);
    let r = http::request(&store.http, "GET", "/jsn", &[], &[]).unwrap();
    assert!(r.status == 404 && r.text().contains("POST /json"), "{}", r.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_file_at_start_stops_the_store_with_its_line() {
    let scratch = dir("broken");
    let p = scratch.join("bad.yaml");
    std::fs::write(&p, "domain: d\ndescriptors:\n  - key: a\n    ratelimit:\n      unit: second\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ratewall-store"))
        .env("RATEWALL_SYNC_SECRET", SECRET)
        .args(["--listen", "127.0.0.1:0", "--redis", "redis://127.0.0.1:1", "--rls", "127.0.0.1:0", "--rls-config"])
        .arg(&p)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("{}:4:", p.display())) && err.contains("unknown field `ratelimit`"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_value_never_skips_a_limit() {
    let redis = Redis::start(false).unwrap();
    let d = readme_examples();
    std::fs::write(d.join("limits.yaml"), LIMITS).unwrap();
    let store = RlsProcess::start(&redis.url(), &d);
    let mut c = store.client().await;
    let long = "a".repeat(5_000);
    // A blocklisted address beside a long value in another descriptor: still over the limit.
    let blocked = descriptor(&[("remote_address", "50.0.0.5")]);
    let r = ask(&mut c, request("edge_proxy_per_ip", vec![blocked, descriptor(&[("remote_address", &long)])])).await;
    assert_eq!((r.overall_code, r.statuses[0].code), (OVER, OVER));
    assert_eq!(limit_of(&r, 1), Some((10, SECOND)), "the long value matches the key alone");
    let body = format!(
        r#"{{"domain":"edge_proxy_per_ip","descriptors":[{{"entries":[{{"key":"remote_address","value":"50.0.0.5"}}]}},{{"entries":[{{"key":"remote_address","value":"{long}"}}]}}]}}"#
    );
    let r = http::request(&store.http, "POST", "/json", &[], body.as_bytes()).unwrap();
    assert_eq!(r.status, 429, "{}", r.text());
    // A long value is counted against its limit, on its own counter.
    for left in (0..5).rev() {
        let r = ask(&mut c, request("api", vec![descriptor(&[("user", &long)])])).await;
        assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, left));
    }
    assert_eq!(ask(&mut c, request("api", vec![descriptor(&[("user", &long)])])).await.overall_code, OVER);
    let r = ask(&mut c, request("api", vec![descriptor(&[("user", &format!("{long}b"))])])).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 4));
}

/// Retry-After of an answer, seconds.
fn retry_after(r: &RateLimitResponse) -> u64 {
    header(r, "Retry-After").unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_the_end_of_a_spent_fixed_window() {
    let redis = Redis::start(false).unwrap();
    let config = limits("retry");
    let store = RlsProcess::start(&redis.url(), &config);
    let mut c = store.client().await;
    let call = || request("api", vec![descriptor(&[("user", "retry")])]);
    while ask(&mut c, call()).await.overall_code == OK {}
    // The first denial and the ones answered from memory after it alike: the day's end (a
    // client that waits less is refused again).
    for i in 0..8 {
        let r = ask(&mut c, call()).await;
        assert_eq!(r.overall_code, OVER, "{i}");
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let day_end = 86_400 - now % 86_400;
        let retry = retry_after(&r);
        assert!(retry + 2 >= day_end && retry <= day_end + 1, "{i}: Retry-After {retry}, {day_end} s to the day's end");
        // Whole seconds to the day's end, as envoyproxy/ratelimit answers (give or take the
        // second read here after the answer).
        let reset = r.statuses[0].duration_until_reset.unwrap();
        assert_eq!(reset.nanos, 0, "{i}: {reset:?}");
        let reset = reset.seconds as u64;
        assert!(reset + 1 >= day_end && reset <= day_end + 1, "{i}: duration_until_reset {reset}, {day_end} s left");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unquoted_values_match_as_written() {
    let redis = Redis::start(false).unwrap();
    let scratch = dir("literals");
    let p = scratch.join("literals.yaml");
    std::fs::write(
        &p,
        "domain: phones
descriptors:
  - key: to_number
    value: +15551234567
    rate_limit: {unit: day, requests_per_unit: 1}
  - key: code
    value: 0x1F
    rate_limit: {unit: day, requests_per_unit: 2}
  - key: flag
    value: True
    rate_limit: {unit: day, requests_per_unit: 3}
  - key: mode
    value: 0o17
    rate_limit: {unit: day, requests_per_unit: 4}
",
    )
    .unwrap();
    let store = RlsProcess::start(&redis.url(), &p);
    let mut c = store.client().await;
    for (key, written, rewritten, rpu) in [
        ("to_number", "+15551234567", "15551234567", 1),
        ("code", "0x1F", "31", 2),
        ("flag", "True", "true", 3),
        ("mode", "0o17", "15", 4),
    ] {
        let r = ask(&mut c, request("phones", vec![descriptor(&[(key, written)])])).await;
        assert_eq!(limit_of(&r, 0), Some((rpu, DAY)), "{key}: {written}");
        let r = ask(&mut c, request("phones", vec![descriptor(&[(key, rewritten)])])).await;
        assert_eq!(limit_of(&r, 0), None, "{key}: {rewritten}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_envoyproxy_ratelimit_accepts_are_accepted() {
    let redis = Redis::start(false).unwrap();
    let scratch = dir("accepted");
    let p = scratch.join("accepted.yaml");
    std::fs::write(
        &p,
        "domain: lenient
descriptors:
  - key: user
    name: misplaced
    rate_limit: &per_day
      unit: day
      requests_per_unit: 2
      shadow_mode: true
  - key: team
    rate_limit:
      <<: *per_day
      requests_per_unit: 3
  - key: blocked
    rate_limit:
      unit: second
---
domain: second_document
",
    )
    .unwrap();
    let store = RlsProcess::start(&redis.url(), &p);
    let mut c = store.client().await;
    // `shadow_mode` inside `rate_limit` is not read: the limit is enforced.
    let user = || request("lenient", vec![descriptor(&[("user", "u")])]);
    assert_eq!(ask(&mut c, user()).await.overall_code, OK);
    assert_eq!(ask(&mut c, user()).await.overall_code, OK);
    assert_eq!(ask(&mut c, user()).await.overall_code, OVER);
    let r = ask(&mut c, request("lenient", vec![descriptor(&[("team", "t")])])).await;
    assert_eq!((limit_of(&r, 0), r.statuses[0].limit_remaining), (Some((3, DAY)), 2), "merged, then overridden");
    let r = ask(&mut c, request("lenient", vec![descriptor(&[("blocked", "b")])])).await;
    assert_eq!((r.overall_code, limit_of(&r, 0)), (OVER, Some((0, SECOND))), "no requests_per_unit: 0");
    let r = ask(&mut c, request("second_document", vec![descriptor(&[("user", "u")])])).await;
    assert_eq!(limit_of(&r, 0), None, "the second document is not read");
    let log = store.log();
    let file = p.display().to_string();
    for said in [
        format!("{file}:3: lenient.user: `name` is not read here"),
        format!("{file}:3: lenient.user: `rate_limit.shadow_mode` is not read here"),
        format!("{file}:16: only the first YAML document"),
    ] {
        assert!(log.contains(&said), "{said}\n{log}");
    }
}

/// The health service's status for `service` on the gRPC listener.
async fn grpc_health(store: &RlsProcess, service: &str) -> i32 {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let channel = Channel::from_shared(format!("http://{}", store.grpc)).unwrap().connect().await.unwrap();
    let mut c = HealthClient::new(channel);
    c.check(HealthCheckRequest { service: service.into() }).await.unwrap().into_inner().status
}

/// Waits (at most 10 s) until every reported service has `status`.
async fn health_becomes(store: &RlsProcess, status: tonic_health::ServingStatus) {
    let start = Instant::now();
    for service in ["", "envoy.service.ratelimit.v3.RateLimitService", "ratelimit"] {
        while grpc_health(store, service).await != status as i32 {
            assert!(start.elapsed() < Duration::from_secs(10), "{service:?} never became {status:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthcheck_and_grpc_health_follow_redis() {
    let mut redis = Redis::start(false).unwrap();
    let config = limits("health");
    let store = RlsProcess::start_with(&redis.url(), &config, true);
    let admin = store.admin.clone().unwrap();
    for at in [&store.http, &admin] {
        let r = http::request(at, "GET", "/healthcheck", &[], &[]).unwrap();
        assert_eq!((r.status, r.text()), (200, "OK".to_owned()), "{at}");
    }
    health_becomes(&store, tonic_health::ServingStatus::Serving).await;
    redis.stop();
    for at in [&store.http, &admin] {
        assert_eq!(http::request(at, "GET", "/healthcheck", &[], &[]).unwrap().status, 500, "{at}");
    }
    health_becomes(&store, tonic_health::ServingStatus::NotServing).await;
    redis.restart().unwrap();
    health_becomes(&store, tonic_health::ServingStatus::Serving).await;
    assert_eq!(http::request(&store.http, "GET", "/healthcheck", &[], &[]).unwrap().status, 200);
}

/// Two limits of 3 a minute, for the service processes sharing one Redis.
const THREE_A_MINUTE: &str = "domain: api
descriptors:
  - key: fixed
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: sliding
    rate_limit: {unit: minute, requests_per_unit: 3, algorithm: sliding_window}
  - key: bucket
    rate_limit: {unit: hour, requests_per_unit: 3, algorithm: token_bucket}
";

/// Seconds since the Unix epoch.
fn unix_secs() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64()
}

/// Waits, if need be, until `need` seconds fit in one part of the minute — its first quarter,
/// or the rest — and returns whether it is the first quarter.
async fn part_of_the_minute_with_room(need: f64) -> bool {
    loop {
        let t = unix_secs() % 60.0;
        let (first_quarter, end) = if t < 15.0 { (true, 15.0) } else { (false, 60.0) };
        if end - t >= need {
            return first_quarter;
        }
        tokio::time::sleep(Duration::from_secs_f64(end - t + 0.05)).await;
    }
}

/// Calls `entry` once on each process of `order` (0 or 1), `pause` after each, and
/// `switch_pause` more where the process changes; how many calls were allowed.
async fn allowed(
    clients: &mut [RateLimitServiceClient<Channel>; 2],
    order: &[usize],
    entry: (&str, &str),
    pause: Duration,
    switch_pause: Duration,
) -> usize {
    let mut ok = 0;
    for (i, &p) in order.iter().enumerate() {
        if i > 0 && order[i - 1] != p {
            tokio::time::sleep(switch_pause).await;
        }
        if ask(&mut clients[p], request("api", vec![descriptor(&[entry])])).await.overall_code == OK {
            ok += 1;
        }
        tokio::time::sleep(pause).await;
    }
    ok
}

/// One client, one call at a time, over two service processes on one Redis: it switches from
/// one to the other, or takes turns between them. docs/rls.md's bound with N processes: a
/// process new to a counter admits at most ⌊limit / N⌋ (here 1) before Redis counts it, and
/// nothing past a fixed window's first quarter: at most 3 + 1 here, 3 for a fixed window past
/// its first quarter. (Each process had counted itself alone and spent the whole quota blind:
/// 6 of 3, and 4 of 3 past a fixed window's first quarter.) Nor on a counter another process
/// found spent and said so at Redis: 3 where the client switches after 0.5 s (it was 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_on_one_redis_admit_within_the_written_bound() {
    let redis = Redis::start(false).unwrap();
    let configs = ["a", "b"].map(|p| config(&format!("two-processes-{p}"), "limits.yaml", THREE_A_MINUTE));
    let stores = configs.each_ref().map(|c| RlsProcess::start(&redis.url(), c));
    let mut clients = [stores[0].client().await, stores[1].client().await];
    // Each has had an answer from Redis (a look at a counter of its own), as a process
    // serving traffic has, and has noted itself present there (every 100 ms) and counted the
    // other.
    for (i, c) in clients.iter_mut().enumerate() {
        let mut look = descriptor(&[("fixed", &format!("warm-{i}"))]);
        look.hits_addend = Some(UInt64Value { value: 0 });
        assert_eq!(ask(c, request("api", vec![look])).await.overall_code, OK);
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let run = unix_secs() as u64;
    let switch = [0, 0, 0, 0, 1, 1, 1, 1];
    let turns = [0, 1, 0, 1, 0, 1, 0, 1];
    let (no_pause, half_a_second, a_flush) = (Duration::ZERO, Duration::from_millis(500), Duration::from_millis(150));
    let mut failures = Vec::new();
    let mut check = |what: String, got: usize, bound: usize| {
        eprintln!("{what}: {got} of 3 allowed (bound {bound})");
        if got > bound {
            failures.push(format!("{what}: {got} of 3 allowed, over the bound of {bound}"));
        }
    };
    // Sliding windows: a process new to the counter spends its initial share (1 of 3), but
    // not once another process found the counter spent and said so at Redis (within two
    // flushes): the switch after 0.5 s admits none on top.
    for (name, order, pause, switch_pause, bound) in [
        ("switch after 0.5 s", &switch, no_pause, half_a_second, 3),
        ("turns", &turns, no_pause, no_pause, 4),
        ("turns, 150 ms apart", &turns, a_flush, no_pause, 4),
    ] {
        // A minute turning mid-run would weigh the spent quota down (a sliding window's
        // previous minute counts less as the new one goes on): each run fits in one minute.
        part_of_the_minute_with_room(3.0).await;
        let value = format!("{name}-{run}");
        let got = allowed(&mut clients, order, ("sliding", &value), pause, switch_pause).await;
        check(format!("sliding_window, {name}"), got, bound);
    }
    // Fixed windows: the same in a window's first quarter, none past it. A minute turning
    // mid-run would give a fresh quota: each run fits in one part of the minute.
    let mut first_quarter = part_of_the_minute_with_room(3.0).await;
    for round in 0..2 {
        for (name, order, pause, switch_pause, bound) in [
            ("switch after 0.5 s", &switch, no_pause, half_a_second, 3),
            ("turns", &turns, no_pause, no_pause, if first_quarter { 4 } else { 3 }),
        ] {
            let part = if first_quarter { "first quarter" } else { "past the first quarter" };
            let value = format!("{name}-{run}-{round}");
            let got = allowed(&mut clients, order, ("fixed", &value), pause, switch_pause).await;
            check(format!("fixed_window, {part}, {name}"), got, bound);
        }
        if !first_quarter {
            break;
        }
        // Past the first quarter too (at most 15 s away).
        first_quarter = part_of_the_minute_with_room(3.0).await;
        while first_quarter {
            tokio::time::sleep(Duration::from_millis(500)).await;
            first_quarter = part_of_the_minute_with_room(3.0).await;
        }
    }
    // A token bucket (an hour's, so nothing comes back meanwhile): spent at one process, then
    // called at the other, which has never held it. It admitted half the bucket again.
    let value = format!("bucket-{run}");
    let got = allowed(&mut clients, &switch, ("bucket", &value), no_pause, half_a_second).await;
    check("token_bucket of 3 an hour, switch after 0.5 s".into(), got, 3);
    assert!(failures.is_empty(), "{failures:#?}");
}

/// One hour-long token bucket of 5: a process that has met Redis decides a new counter's first
/// calls on its initial share, from memory.
const BUCKET: &str = "domain: api
descriptors:
  - key: bucket
    rate_limit: {unit: hour, requests_per_unit: 5, algorithm: token_bucket}
";

/// Units admitted from memory and not yet reported when the process is stopped (SIGTERM) are
/// reported on the way out: the next process does not admit them again. (They were lost: the
/// next process found the bucket full.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_process_reports_what_it_admitted_from_memory() {
    let redis = Redis::start(false).unwrap();
    let scratch = dir("stop");
    let path = scratch.join("limits.yaml");
    std::fs::write(&path, BUCKET).unwrap();
    let look = |value: &str| {
        let mut d = descriptor(&[("bucket", value)]);
        d.hits_addend = Some(UInt64Value { value: 0 });
        request("api", vec![d])
    };
    for round in 0..3 {
        let mut store = RlsProcess::start(&redis.url(), &path);
        let mut c = store.client().await;
        // Redis has answered this process (a look at another counter, and its notes).
        ask(&mut c, look("warm")).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let value = format!("stop-{round}");
        for left in [4, 3, 2] {
            let r = ask(&mut c, request("api", vec![descriptor(&[("bucket", &value)])])).await;
            assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, left), "round {round}");
        }
        assert!(store.terminate(), "round {round}: {}", store.log());
        let next = RlsProcess::start(&redis.url(), &path);
        let r = ask(&mut next.client().await, look(&value)).await;
        assert_eq!(
            (r.overall_code, r.statuses[0].limit_remaining),
            (OK, 2),
            "round {round}: the 3 units admitted before the stop are counted"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_shaped_as_envoyproxy_ratelimits_example_answers_with_its_quotas() {
    let redis = Redis::start(false).unwrap();
    let scratch = dir("envoyproxy-shaped");
    let p = scratch.join("config.yaml");
    std::fs::write(&p, include_str!("data/envoyproxy-shaped.yaml")).unwrap();
    let store = RlsProcess::start(&redis.url(), &p);
    let mut c = store.client().await;
    let both = || request("shop", vec![descriptor(&[("backend", "primary")]), descriptor(&[("backend", "fallback")])]);
    let codes = |r: &RateLimitResponse| (r.overall_code, r.statuses.iter().map(|s| s.code).collect::<Vec<_>>());
    assert_eq!(codes(&ask(&mut c, both()).await), (OK, vec![OK, OK]));
    // The primary's quota is spent: its status says so; the call goes on while the fallback
    // has room.
    assert_eq!(codes(&ask(&mut c, both()).await), (OK, vec![OVER, OK]));
    let r = ask(&mut c, both()).await;
    assert_eq!(codes(&r), (OVER, vec![OVER, OVER]), "every quota spent");
    let reset = r.statuses[0].duration_until_reset.unwrap();
    assert!(reset.nanos == 0 && (1..=3600).contains(&reset.seconds), "{reset:?}");
    // A limit that is not a quota denies as ever; replaces, named limits and a blocklist too.
    let r = ask(&mut c, request("shop", vec![descriptor(&[("buyer", "b"), ("item", "recalled")])])).await;
    assert_eq!((r.overall_code, limit_of(&r, 0)), (OVER, Some((0, MINUTE))));
    let gold_and_limited =
        request("shop", vec![descriptor(&[("tier", "gold")]), descriptor(&[("buyer", "b"), ("item", "limited")])]);
    let r = ask(&mut c, gold_and_limited).await;
    assert_eq!((limit_of(&r, 0), limit_of(&r, 1)), (Some((6, MINUTE)), None), "per_buyer was replaced");
    let r = ask(&mut c, request("shop", vec![descriptor(&[("buyer", "b"), ("gift", "g")])])).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, u32::MAX));
    let body = br#"{"domain":"shop","descriptors":[{"entries":[{"key":"report","value":"r"}],"limit":null}]}"#;
    let r = http::request(&store.http, "POST", "/json", &[], body).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["statuses"][0]["currentLimit"]["requestsPerUnit"], 3);
    let reset = v["statuses"][0]["durationUntilReset"].as_str().unwrap();
    let secs: u64 = reset.strip_suffix('s').unwrap().parse().unwrap_or_else(|_| panic!("not whole seconds: {reset}"));
    assert!((1..=60).contains(&secs), "{reset}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_calls_show_in_the_admin_listeners_top_offenders_by_their_descriptors_entries() {
    let redis = Redis::start(false).unwrap();
    let scratch = dir("top");
    let p = scratch.join("config.yaml");
    std::fs::write(&p, include_str!("data/envoyproxy-shaped.yaml")).unwrap();
    let store = RlsProcess::start_with(&redis.url(), &p, true);
    let admin = store.admin.clone().unwrap();
    let mut c = store.client().await;
    let recalled = |buyer: &str| request("shop", vec![descriptor(&[("buyer", buyer), ("item", "recalled")])]);
    for _ in 0..3 {
        assert_eq!(ask(&mut c, recalled("alice")).await.overall_code, OVER);
    }
    assert_eq!(ask(&mut c, recalled("bob")).await.overall_code, OVER);
    // A call allowed: counted for its rule.
    assert_eq!(ask(&mut c, request("shop", vec![descriptor(&[("report", "r")])])).await.overall_code, OK);
    let top = http::request(&admin, "GET", "/v1/top", &[], &[]).unwrap();
    assert_eq!(top.status, 200);
    let v: serde_json::Value = serde_json::from_str(&top.text()).unwrap();
    let rule = |name: &str| v["rules"].as_array().unwrap().iter().find(|r| r["rule"] == name).cloned();
    let denied = rule("recalled_item").unwrap_or_else(|| panic!("{v}"));
    assert_eq!(
        (denied["denied"].clone(), denied["allowed"].clone()),
        (serde_json::json!(4), serde_json::json!(0)),
        "{v}"
    );
    assert_eq!(
        denied["top"],
        serde_json::json!([
            {"key": "buyer=alice,item=recalled", "denied": 3, "allowed": 0, "nodes": 1},
            {"key": "buyer=bob,item=recalled", "denied": 1, "allowed": 0, "nodes": 1},
        ])
    );
    let report = rule("shop.report").unwrap_or_else(|| panic!("{v}"));
    assert_eq!((report["allowed"].clone(), report["denied"].clone()), (serde_json::json!(1), serde_json::json!(0)));
    // The same calls per second in the series the dashboard draws.
    let series: serde_json::Value =
        serde_json::from_slice(&http::request(&admin, "GET", "/v1/series?rule=recalled_item", &[], &[]).unwrap().body)
            .unwrap();
    let per_second = series["rules"][0]["denied"].as_array().unwrap();
    assert_eq!(per_second.iter().map(|n| n.as_u64().unwrap()).sum::<u64>(), 4, "{series}");
}

/// Limits of 3 a minute whose counters a process decides on an initial share at any time.
const THREE_A_MINUTE_SHARED: &str = "domain: api
descriptors:
  - key: sliding
    rate_limit: {unit: minute, requests_per_unit: 3, algorithm: sliding_window}
  - key: bucket
    rate_limit: {unit: minute, requests_per_unit: 3, algorithm: token_bucket}
";

fn hits(entry: (&str, &str), hits: u64) -> RateLimitRequest {
    let mut d = descriptor(&[entry]);
    d.hits_addend = Some(UInt64Value { value: hits });
    request("api", vec![d])
}

/// One call, `pause`, then three calls (one after another, or all at once), or one of 2 hits,
/// and one call more: the codes.
async fn burst_after(
    c: RateLimitServiceClient<Channel>,
    entry: (&'static str, String),
    pause: Duration,
    at_once: Option<bool>,
) -> Vec<i32> {
    let entry = (entry.0, entry.1.as_str());
    let mut one = c.clone();
    let mut got = vec![ask(&mut one, hits(entry, 1)).await.overall_code];
    tokio::time::sleep(pause).await;
    match at_once {
        Some(false) => {
            for _ in 0..3 {
                got.push(ask(&mut one, hits(entry, 1)).await.overall_code);
            }
        }
        Some(true) => {
            let calls = (0..3).map(|_| {
                let mut c = c.clone();
                async move { ask(&mut c, hits(entry, 1)).await.overall_code }
            });
            let mut codes = futures_util::future::join_all(calls).await;
            codes.sort_unstable();
            got.extend(codes);
        }
        None => got.push(ask(&mut one, hits(entry, 2)).await.overall_code),
    }
    got.push(ask(&mut one, hits(entry, 1)).await.overall_code);
    got
}

/// 3 a minute: one call, a pause, then a burst answers as one exact limiter does — OK, OK,
/// then OVER_LIMIT (a call of 2 hits: OK, then OVER_LIMIT) — whether the process's grant was
/// renewed through the pause (1.5 s) or lapsed (6.5 s: renewals stop 4 s after the last call,
/// and the last lease is at most 2 s). (After a lapse, the burst's first ask made the grant
/// Redis still held on the process's share count again: OK, OVER_LIMIT, OVER_LIMIT.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_after_a_pause_longer_than_the_lease_answers_as_an_exact_limiter() {
    let redis = Redis::start(false).unwrap();
    let scratch = dir("burst-after-pause");
    let path = scratch.join("limits.yaml");
    std::fs::write(&path, THREE_A_MINUTE_SHARED).unwrap();
    let store = RlsProcess::start(&redis.url(), &path);
    let c = store.client().await;
    // The calls and pauses take about 8 s: all in one minute, so that a minute's turn does not
    // move the sliding window's count between them (the exact answers below are a minute's).
    let into = unix_secs() % 60.0;
    if into > 48.0 {
        sleep_until_unix(unix_secs() - into + 60.2).await;
    }
    // Redis has answered this process, which has noted itself present: new counters are
    // decided on an initial share, as in a process serving traffic.
    ask(&mut c.clone(), hits(("sliding", "warm"), 0)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut runs = Vec::new();
    for key in ["sliding", "bucket"] {
        for pause in [1_500, 6_500] {
            for at_once in [Some(false), Some(true), None] {
                let what = format!("{key}, {pause} ms, {at_once:?}");
                let entry = (key, what.clone());
                let run = burst_after(c.clone(), entry, Duration::from_millis(pause), at_once);
                runs.push(async move { (what, at_once, run.await) });
            }
        }
    }
    for (what, at_once, got) in futures_util::future::join_all(runs).await {
        let exact = if at_once.is_some() { vec![OK, OK, OK, OVER, OVER] } else { vec![OK, OK, OVER] };
        assert_eq!(got, exact, "{what}");
    }
}

/// A fixed window of 3 a second, and a token bucket of 1 a second (a token back every
/// second, at most one at once).
const PER_SECOND: &str = "domain: api
descriptors:
  - key: fixed
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: bucket
    rate_limit: {unit: second, requests_per_unit: 1, algorithm: token_bucket}
";

/// Sends `signal` (`STOP`, `CONT`) to the process.
fn signal(store: &RlsProcess, signal: &str) {
    let pid = store.child.id().to_string();
    assert!(Command::new("kill").args([&format!("-{signal}"), &pid]).status().unwrap().success());
}

/// Sleeps until `t` (seconds since the Unix epoch), if it is ahead.
async fn sleep_until_unix(t: f64) {
    let left = t - unix_secs();
    if left > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(left)).await;
    }
}

/// A client that makes its last calls of a fixed window (3 a second) in the window's last
/// quarter, is refused the one past the limit, and waits the `Retry-After` it is given (the
/// window's rest, rounded up to a second) gets the next window's whole quota. The process is
/// paused (SIGSTOP) across the window's end, so that its report of those calls reaches Redis
/// after it, as a report of calls in a window's last 100 ms does. Resumed 100 ms into the next
/// window, it reports at once and renews its grant there 800 ms in (in the grant's last
/// 200 ms): the client's calls there, 750 ms in, meet the counter as that first report left
/// it. (Counted in the window Redis was in when the report came, the calls took from the
/// next one: OK, then OVER_LIMIT. And the units Redis had given beside the window's first
/// call, an ask, stayed held for the process in the next window: its first grant there was 1
/// and its next ask was refused.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_windows_last_calls_reported_after_its_end_take_nothing_from_the_next() {
    let redis = Redis::start(false).unwrap();
    let scratch = dir("window-end");
    let path = scratch.join("limits.yaml");
    std::fs::write(&path, PER_SECOND).unwrap();
    let store = RlsProcess::start(&redis.url(), &path);
    let mut c = store.client().await;
    // Redis has answered this process, which has noted itself present, as a process serving
    // traffic has.
    ask(&mut c, hits(("fixed", "warm"), 0)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for attempt in 0..5 {
        // 250 ms before a second's end.
        let end = (unix_secs() + 0.3).ceil();
        sleep_until_unix(end - 0.25).await;
        let value = format!("edge-{attempt}");
        let call = || request("api", vec![descriptor(&[("fixed", &value)])]);
        let mut codes = Vec::new();
        for _ in 0..3 {
            codes.push(ask(&mut c, call()).await.overall_code);
        }
        let refused = ask(&mut c, call()).await;
        let answered = unix_secs();
        signal(&store, "STOP");
        sleep_until_unix(end + 0.1).await;
        signal(&store, "CONT");
        if answered >= end - 0.01 {
            // Too slow to fit in the window's end (a loaded machine): again, a second later.
            continue;
        }
        assert_eq!((codes, refused.overall_code), (vec![OK, OK, OK], OVER), "attempt {attempt}");
        let wait = retry_after(&refused);
        assert_eq!(wait, 1, "attempt {attempt}: the window's rest, rounded up");
        sleep_until_unix(answered + wait as f64).await;
        let mut next = Vec::new();
        for _ in 0..4 {
            next.push(ask(&mut c, call()).await.overall_code);
        }
        assert!(unix_secs() < end + 1.0, "attempt {attempt}: the calls after the wait left the next window");
        assert_eq!(next, vec![OK, OK, OK, OVER], "attempt {attempt}: the next window's quota, whole");
        return;
    }
    panic!("no attempt fitted its calls in a window's last 250 ms");
}

/// A client of a token bucket (1 a second) that spends it, is refused with `Retry-After: 1`,
/// and calls again a second after that answer, is admitted — whenever the process's report
/// of the spent unit reaches Redis. The process holds a grant of the counter (a look at it
/// first, then its renewals), so the refused call is answered while that unit is unreported;
/// the runs start at several points of the grant's lease, and at least one is refused for
/// the token alone (`Retry-After: 1`; near a lease's start the lease is what it waits for).
/// (Counted when the report came, up to 100 ms after the refusal, the token came back that
/// much later than the `Retry-After` said: the call was refused once more.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_waits_its_retry_after_on_a_token_bucket_is_admitted() {
    let redis = Redis::start(false).unwrap();
    let scratch = dir("bucket-retry");
    let path = scratch.join("limits.yaml");
    std::fs::write(&path, PER_SECOND).unwrap();
    let store = RlsProcess::start(&redis.url(), &path);
    let c = store.client().await;
    ask(&mut c.clone(), hits(("bucket", "warm"), 0)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let runs = [2_100, 2_300, 2_500].map(|start| {
        let mut c = c.clone();
        async move {
            let value = format!("retry-{start}");
            ask(&mut c, hits(("bucket", &value), 0)).await;
            tokio::time::sleep(Duration::from_millis(start)).await;
            let mut got = vec![ask(&mut c, hits(("bucket", &value), 1)).await.overall_code];
            let refused = ask(&mut c, hits(("bucket", &value), 1)).await;
            let answered = Instant::now();
            got.push(refused.overall_code);
            let wait = header(&refused, "Retry-After").map_or(0, |r| r.parse::<u64>().unwrap());
            tokio::time::sleep_until((answered + Duration::from_secs(wait)).into()).await;
            got.push(ask(&mut c, hits(("bucket", &value), 1)).await.overall_code);
            (start, wait, got)
        }
    });
    let mut tight = 0;
    for (start, wait, got) in futures_util::future::join_all(runs).await {
        eprintln!("{start} ms after the look: Retry-After {wait}, {got:?}");
        assert_eq!(got, vec![OK, OVER, OK], "{start} ms after the look: Retry-After {wait}");
        tight += usize::from(wait == 1);
    }
    assert!(tight > 0, "no run was refused for the token alone");
}

/// Sends `head` then `body` to `addr` (from another thread, so that a server answering before it
/// has read the whole body is heard) and reads the answer until the server closes.
fn raw_exchange(addr: &str, head: &[u8], body: Vec<u8>) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(head).unwrap();
    let mut w = s.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(&body);
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(_) if !got.is_empty() => break,
            Err(e) => panic!("{e}"),
        }
        let text = String::from_utf8_lossy(&got);
        // The whole answer: its head and as many bytes as its length says.
        if let Some((head, rest)) = text.split_once("\r\n\r\n") {
            let len = head
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length: ").map(str::to_owned))
                .and_then(|n| n.trim().parse::<usize>().ok());
            if len.is_some_and(|n| rest.len() >= n) {
                break;
            }
        }
    }
    drop(s);
    let _ = writer.join();
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_call_over_2_mib_is_refused_as_malformed_in_json() {
    let redis = Redis::start(false).unwrap();
    let config = limits("json-too-large");
    let store = RlsProcess::start(&redis.url(), &config);
    let over = 2 * 1024 * 1024 + 1;
    // Declared too large, and found too large as it is read (chunked: no length declared).
    let declared =
        format!("POST /json HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {over}\r\n\r\n");
    let mut chunked = format!("{over:x}\r\n").into_bytes();
    chunked.extend(std::iter::repeat_n(b' ', over));
    chunked.extend_from_slice(b"\r\n0\r\n\r\n");
    for (head, body) in [
        (declared.into_bytes(), vec![b' '; over]),
        (b"POST /json HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec(), chunked),
    ] {
        let answer = raw_exchange(&store.http, &head, body);
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
        assert!(answer.to_ascii_lowercase().contains("content-type: application/json"), "{answer}");
        let body = answer.split_once("\r\n\r\n").unwrap().1;
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert!(v["error"].as_str().unwrap().contains("at most 2097152 bytes"), "{v}");
    }
    // At the limit it is read, and judged as JSON.
    let at = http::request(&store.http, "POST", "/json", &[], &vec![b' '; over - 1]).unwrap();
    assert_eq!(at.status, 400);
    assert!(at.text().contains("not JSON"), "{}", at.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_listener_closes_a_connection_that_does_not_open_within_five_seconds() {
    use std::io::{Read, Write};
    let redis = Redis::start(false).unwrap();
    let config = limits("grpc-opening");
    let store = RlsProcess::start(&redis.url(), &config);
    let held: Vec<_> = [&b"PRI * HTTP/2.0\r\n"[..], b""]
        .into_iter()
        .map(|part| {
            let mut s = std::net::TcpStream::connect(&store.grpc).unwrap();
            s.write_all(part).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            s
        })
        .collect();
    let start = Instant::now();
    for mut s in held {
        let mut buf = [0u8; 256];
        while s.read(&mut buf).is_ok_and(|n| n > 0) {}
        assert!(start.elapsed() < Duration::from_secs(8), "closed after {:?}", start.elapsed());
    }
    // A client that opens its connection is served, past that time too.
    let mut c = store.client().await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(ask(&mut c, request("api", vec![descriptor(&[("user", "u")])])).await.overall_code, OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_admin_listener_lists_the_services_rules_in_the_configurations_order() {
    let redis = Redis::start(false).unwrap();
    // A store process without the configuration, with an admin listener, on the same Redis.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut peer = Command::new(env!("CARGO_BIN_EXE_ratewall-store"))
        .env("RATEWALL_SYNC_SECRET", SECRET)
        .args(["--listen", "127.0.0.1:0", "--redis", &redis.url(), "--admin", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(peer.stdout.take().unwrap());
    let _peer = Killed(peer);
    let admin = loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "the peer ended");
        if let Some(rest) = line.split("admin on http://").nth(1) {
            break rest.split('/').next().unwrap().to_owned();
        }
    };
    let scratch = dir("peer-order");
    let path = scratch.join("limits.yaml");
    std::fs::write(
        &path,
        "domain: order
descriptors:
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 0}
  - key: b
    rate_limit: {unit: minute, requests_per_unit: 0}
  - key: c
    rate_limit: {unit: minute, requests_per_unit: 0}
",
    )
    .unwrap();
    let store = RlsProcess::start(&redis.url(), &path);
    let mut c = store.client().await;
    // Called last rule first, in seconds of their own.
    for key in ["c", "b", "a"] {
        assert_eq!(ask(&mut c, request("order", vec![descriptor(&[(key, "x")])])).await.overall_code, OVER);
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    let start = Instant::now();
    let v = loop {
        let top = http::request(&admin, "GET", "/v1/top", &[], &[]).unwrap();
        let v: serde_json::Value = serde_json::from_str(&top.text()).unwrap();
        let denied: u64 = v["rules"].as_array().unwrap().iter().filter_map(|r| r["denied"].as_u64()).sum();
        if denied == 3 {
            break v;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{v}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let names: Vec<&str> = v["rules"].as_array().unwrap().iter().filter_map(|r| r["rule"].as_str()).collect();
    assert_eq!(names, ["order.a", "order.b", "order.c"], "{v}");
}
