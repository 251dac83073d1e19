//! `cargo xtask dev`'s gateway as a user meets it: started as a process, reached over real
//! HTTP at the address it prints.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Kills the gateway when the test ends, however it ends; holds its stdout open meanwhile.
struct Gateway(Child, #[allow(dead_code)] BufReader<std::process::ChildStdout>);

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(rules: &std::path::Path) -> (Gateway, String) {
    let (gateway, addr, _) = start_logged(rules, false);
    (gateway, addr)
}

/// [`start`], with the gateway's log lines (stderr) sent to the receiver when `logged`.
fn start_logged(rules: &std::path::Path, logged: bool) -> (Gateway, String, std::sync::mpsc::Receiver<String>) {
    start_with(rules, logged, &[])
}

/// [`start_logged`], with more arguments.
fn start_with(
    rules: &std::path::Path,
    logged: bool,
    more: &[&str],
) -> (Gateway, String, std::sync::mpsc::Receiver<String>) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratewall-gateway"))
        .current_dir(&root)
        .args(["--port", "0", "--rules"])
        .arg(rules)
        .args(more)
        .stdout(Stdio::piped())
        .stderr(if logged { Stdio::piped() } else { Stdio::null() })
        .spawn()
        .unwrap();
    let (send, lines) = std::sync::mpsc::channel();
    if let Some(err) = child.stderr.take() {
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = send.send(line);
            }
        });
    }
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://127.0.0.1:"))
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    let addr = url.trim_start_matches("http://").to_owned();
    (Gateway(child, out), addr, lines)
}

/// One HTTP/1.1 request; returns (status, headers, body).
fn http(addr: &str, method: &str, path: &str, headers: &[(&str, &str)]) -> (u16, Vec<(String, String)>, String) {
    let r = ratewall_host::http::request(addr, method, path, headers, &[]).unwrap();
    let body = r.text();
    (r.status, r.headers, body)
}

fn header<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
    h.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

#[test]
fn the_dev_gateway_serves_the_example_rules_over_http() {
    let rules = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/rules.json");
    let (_gateway, addr) = start(&rules);
    let (status, headers, body) = http(&addr, "GET", "/v1/things", &[("x-api-key", "demo")]);
    assert_eq!(status, 200, "{body}");
    assert_eq!(header(&headers, "ratelimit-policy"), Some("\"api-key\";q=1000;w=60"));
    let statuses: Vec<u16> = (0..11).map(|_| http(&addr, "POST", "/v1/auth/login", &[]).0).collect();
    assert_eq!(statuses.iter().filter(|&&s| s == 200).count(), 10, "{statuses:?}");
    assert_eq!(statuses[10], 429);
    let (status, headers, body) = http(&addr, "POST", "/v1/auth/login", &[]);
    assert_eq!(status, 429);
    assert!(header(&headers, "retry-after").unwrap().parse::<u64>().unwrap() >= 1);
    assert_eq!(header(&headers, "content-type"), Some("application/problem+json"));
    let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(problem["violated-policies"], serde_json::json!(["login-per-ip"]));
    // The filter's metrics, in Prometheus text with their types.
    let (status, _, metrics) = http(&addr, "GET", "/_ratewall/metrics", &[]);
    assert_eq!(status, 200);
    assert!(metrics.contains("# TYPE ratewall_rule_login_per_ip_rejected counter\n"), "{metrics}");
    assert!(metrics.contains("ratewall_rule_login_per_ip_rejected 2\n"), "{metrics}");
    assert!(metrics.contains("# TYPE ratewall_rule_login_per_ip_limited_keys gauge\n"), "{metrics}");
}

#[test]
fn the_dev_gateway_reloads_changed_rules_and_keeps_them_when_broken() {
    let dir = std::env::temp_dir().join(format!("ratewall-gateway-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rules = dir.join("rules.json");
    let doc = |n: u32| format!(r#"{{"rules":[{{"name":"r","key":["user"],"limit":{{"requests":{n},"per":"1h"}}}}]}}"#);
    std::fs::write(&rules, doc(1)).unwrap();
    let (_gateway, addr, log) = start_logged(&rules, true);
    let get = |user: &str| http(&addr, "GET", "/", &[("x-user-id", user)]).0;
    assert_eq!((get("a"), get("a")), (200, 429));
    std::fs::write(&rules, doc(3)).unwrap();
    // The gateway polls every 250 ms; wait (bounded, generously for a loaded machine) for it
    // to say it reloaded.
    let said =
        std::iter::from_fn(|| log.recv_timeout(Duration::from_secs(15)).ok()).find(|l| l.contains("rules reloaded"));
    assert!(said.is_some(), "the new rules were never loaded");
    // From then on every worker VM takes the new rules before its next request (one waiting
    // for a request when they came included): none answers on the old ones.
    let policies: Vec<String> = (0..8)
        .map(|i| {
            let (_, headers, _) = http(&addr, "GET", "/", &[("x-user-id", &format!("p{i}"))]);
            header(&headers, "ratelimit-policy").unwrap_or("").to_owned()
        })
        .collect();
    assert!(policies.iter().all(|p| p == "\"r\";q=3;w=3600"), "{policies:?}");
    assert_eq!((get("probe"), get("probe"), get("probe"), get("probe")), (200, 200, 200, 429));
    // Written as a shell's `>` does: emptied, then written a moment later. Not a rejection.
    std::fs::write(&rules, "").unwrap();
    std::thread::sleep(Duration::from_millis(600));
    std::fs::write(&rules, doc(4)).unwrap();
    let said: Vec<String> = std::iter::from_fn(|| log.recv_timeout(Duration::from_secs(15)).ok())
        .take_while(|l| !l.contains("rules reloaded"))
        .collect();
    assert!(!said.iter().any(|l| l.contains("rejected")), "{said:?}");
    assert_eq!(get("c"), 200);
    // Twice more, each time back to the rules in force (a job that writes the same rules
    // again): nothing to say, neither rejected nor reloaded.
    for _ in 0..2 {
        std::fs::write(&rules, "").unwrap();
        std::thread::sleep(Duration::from_millis(600));
        std::fs::write(&rules, doc(4)).unwrap();
        std::thread::sleep(Duration::from_millis(1500));
    }
    let said: Vec<String> = log.try_iter().collect();
    assert!(said.iter().all(|l| !l.contains("rejected") && !l.contains("reloaded")), "{said:?}");
    std::fs::write(&rules, "{ broken").unwrap();
    let said = std::iter::from_fn(|| log.recv_timeout(Duration::from_secs(15)).ok()).find(|l| l.contains("rejected"));
    assert!(said.is_some_and(|l| l.contains("keeping the previous rules")), "a bad document is said");
    let fresh: Vec<u16> = (0..5).map(|_| get("b")).collect();
    assert_eq!(fresh, [200, 200, 200, 200, 429], "the last good rules (4 per hour) stay");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_dev_gateway_forwards_a_leaky_buckets_waiting_requests_in_their_turn() {
    let dir = std::env::temp_dir().join(format!("ratewall-gateway-shape-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rules = dir.join("rules.json");
    // 2 per second with a queue of 3: of 6 at once, one goes now, three wait their turns
    // (0.5 s, 1 s, 1.5 s later) and two are refused.
    let doc = r#"{"identity": {"user": {"header": "x-user-id"}},
        "rules": [{"name": "shape", "key": ["user"],
                   "limit": {"requests": 2, "per": "1s", "burst": 3, "algorithm": "leaky_bucket"}}]}"#;
    std::fs::write(&rules, doc).unwrap();
    let (_gateway, addr) = start(&rules);
    let started = std::time::Instant::now();
    let clients: Vec<_> = (0..6)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                // An empty reply (the connection closed unanswered) shows as status 0.
                let r = ratewall_host::http::request(&addr, "GET", "/q", &[("x-user-id", "shaped")], &[]);
                (r.map_or(0, |r| r.status), started.elapsed())
            })
        })
        .collect();
    let mut answers: Vec<(u16, Duration)> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    answers.sort_by_key(|(_, took)| *took);
    let statuses: Vec<u16> = answers.iter().map(|(s, _)| *s).collect();
    assert_eq!(statuses.iter().filter(|&&s| s == 200).count(), 4, "{answers:?}");
    assert_eq!(statuses.iter().filter(|&&s| s == 429).count(), 2, "{answers:?}");
    // The last one forwarded waited for the third turn.
    assert_eq!(statuses[5], 200, "{answers:?}");
    assert!(answers[5].1 >= Duration::from_millis(1400), "{answers:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes `doc` as a rules file in a directory of its own, for one test.
fn rules_file(test: &str, doc: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ratewall-gateway-{test}"));
    std::fs::create_dir_all(&dir).unwrap();
    let rules = dir.join("rules.json");
    std::fs::write(&rules, doc).unwrap();
    rules
}

/// Sends `bytes` as they are and reads the answer until the gateway closes the connection.
fn raw(addr: &str, bytes: &[u8]) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(bytes).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// Connections that are opened and send nothing: more than the gateway has worker VMs.
fn idle(addr: &str) -> Vec<std::net::TcpStream> {
    (0..4).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect()
}

/// 2 per second with a queue of 5: the first request goes at once, the next ones wait their
/// turns, one every 500 ms.
const SHAPED: &str = r#"{"identity": {"user": {"header": "x-user-id"}},
    "rules": [{"name": "shape", "key": ["user"],
               "limit": {"requests": 2, "per": "1s", "burst": 5, "algorithm": "leaky_bucket"}}]}"#;

#[test]
fn idle_connections_hold_up_no_other_request() {
    let rules = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/rules.json");
    let (_gateway, addr) = start(&rules);
    let _idle = idle(&addr);
    let started = std::time::Instant::now();
    let (status, _, body) = http(&addr, "GET", "/v1/things", &[("x-api-key", "demo")]);
    assert_eq!(status, 200, "{body}");
    assert!(started.elapsed() < Duration::from_secs(3), "answered after {:?}", started.elapsed());
}

#[test]
fn a_waiting_request_goes_in_its_turn_while_connections_idle() {
    let rules = rules_file("idle-turn", SHAPED);
    let (_gateway, addr) = start(&rules);
    assert_eq!(http(&addr, "GET", "/q", &[("x-user-id", "idle")]).0, 200);
    let started = std::time::Instant::now();
    let queued = {
        let addr = addr.clone();
        std::thread::spawn(move || (http(&addr, "GET", "/q", &[("x-user-id", "idle")]).0, started.elapsed()))
    };
    std::thread::sleep(Duration::from_millis(100));
    let _idle = idle(&addr);
    let (status, took) = queued.join().unwrap();
    assert_eq!(status, 200);
    // Its turn is 500 ms after the first one's.
    assert!(took >= Duration::from_millis(350) && took < Duration::from_millis(1500), "forwarded after {took:?}");
    let _ = std::fs::remove_dir_all(rules.parent().unwrap());
}

#[test]
fn a_waiting_client_that_goes_away_gives_its_turn_back() {
    let rules = rules_file("gone", SHAPED);
    let (_gateway, addr) = start(&rules);
    let started = std::time::Instant::now();
    let get = |addr: &str| {
        let addr = addr.to_owned();
        std::thread::spawn(move || (http(&addr, "GET", "/q", &[("x-user-id", "leaves")]).0, started.elapsed()))
    };
    // #0 goes at once, #1 waits for 500 ms.
    let first = get(&addr);
    std::thread::sleep(Duration::from_millis(50));
    let second = get(&addr);
    std::thread::sleep(Duration::from_millis(50));
    // #2 waits for 1 s, but its client goes away at once.
    {
        use std::io::Write;
        let mut leaving = std::net::TcpStream::connect(&addr).unwrap();
        leaving.write_all(b"GET /q HTTP/1.1\r\nhost: x\r\nx-user-id: leaves\r\n\r\n").unwrap();
    }
    std::thread::sleep(Duration::from_millis(150));
    // #3 then takes #2's turn, at 1 s, rather than waiting for 1.5 s.
    let fourth = get(&addr);
    let answers = [first.join().unwrap(), second.join().unwrap(), fourth.join().unwrap()];
    assert!(answers.iter().all(|(status, _)| *status == 200), "{answers:?}");
    let took = answers[2].1;
    assert!(took >= Duration::from_millis(850) && took < Duration::from_millis(1350), "{answers:?}");
    let _ = std::fs::remove_dir_all(rules.parent().unwrap());
}

#[test]
fn a_request_line_that_is_not_utf8_gets_a_400() {
    let rules = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/rules.json");
    let (_gateway, addr) = start(&rules);
    let answer = raw(&addr, b"GET /v1/\xff HTTP/1.1\r\nhost: x\r\n\r\n");
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer:?}");
}

#[test]
fn an_absolute_form_target_is_matched_on_its_path() {
    let rules = rules_file(
        "absolute",
        r#"{"identity": {"user": {"header": "x-user-id"}},
            "rules": [{"name": "once", "match": {"path": "/limited"}, "key": ["user"],
                       "limit": {"requests": 1, "per": "1h"}}]}"#,
    );
    let (_gateway, addr) = start(&rules);
    let request =
        b"GET http://api.example.com/limited?page=2 HTTP/1.1\r\nhost: api.example.com\r\nx-user-id: abs\r\n\r\n";
    let first = raw(&addr, request);
    assert!(first.starts_with("HTTP/1.1 200 "), "{first:?}");
    assert!(first.contains(r#""path":"/limited?page=2""#), "{first:?}");
    let second = raw(&addr, request);
    assert!(second.starts_with("HTTP/1.1 429 "), "{second:?}");
    let _ = std::fs::remove_dir_all(rules.parent().unwrap());
}

/// Rules that sync, given with no `--store`: the gateway says at start that every sync will
/// fail (it started without a word, and its `closed` rules answered 503).
#[test]
fn rules_that_sync_with_no_store_given_are_said_at_start() {
    let rules = rules_file(
        "no-store",
        r#"{"identity": {"user": {"header": "x-user-id"}},
            "rules": [{"name": "r", "key": ["user"], "limit": {"requests": 5, "per": "1m"}}],
            "sync": {"cluster": "store", "secret": "a sync secret of 16+"}}"#,
    );
    let (_gateway, _addr, log) = start_logged(&rules, true);
    let said = std::iter::from_fn(|| log.recv_timeout(Duration::from_secs(10)).ok())
        .find(|l| l.contains("no --store was given"));
    assert!(said.is_some(), "not said");
    let _ = std::fs::remove_dir_all(rules.parent().unwrap());
}

/// A `--store` for rules without a sync section: each gateway would hold the limits alone,
/// and it says so at start.
#[test]
fn a_store_given_to_rules_that_do_not_sync_is_said_at_start() {
    let rules = rules_file(
        "no-sync",
        r#"{"identity": {"user": {"header": "x-user-id"}},
            "rules": [{"name": "r", "key": ["user"], "limit": {"requests": 5, "per": "1m"}}]}"#,
    );
    let (_gateway, _addr, log) = start_with(&rules, true, &["--store", "127.0.0.1:9"]);
    let said = std::iter::from_fn(|| log.recv_timeout(Duration::from_secs(10)).ok())
        .find(|l| l.contains("--store was given but the rules have no sync section"));
    assert!(said.is_some(), "not said");
    let _ = std::fs::remove_dir_all(rules.parent().unwrap());
}

/// A HEAD request's answer, passed or refused, has headers and no body (the gateway sent the
/// demo origin's and the problem body after them).
#[test]
fn a_head_request_is_answered_without_a_body() {
    let rules = rules_file(
        "head",
        r#"{"identity": {"user": {"header": "x-user-id"}},
            "rules": [{"name": "once", "match": {"path": "/limited"}, "key": ["user"],
                       "limit": {"requests": 1, "per": "1h"}}]}"#,
    );
    let (_gateway, addr) = start(&rules);
    let request = b"HEAD /limited HTTP/1.1\r\nhost: x\r\nx-user-id: head\r\n\r\n";
    for status in ["200", "429"] {
        let answer = raw(&addr, request);
        assert!(answer.starts_with(&format!("HTTP/1.1 {status} ")), "{answer:?}");
        assert!(answer.ends_with("\r\n\r\n") && answer.contains("content-length: "), "{answer:?}");
    }
    let _ = std::fs::remove_dir_all(rules.parent().unwrap());
}

#[test]
fn a_header_section_over_the_limit_gets_a_431() {
    let rules = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/rules.json");
    let (_gateway, addr) = start(&rules);
    let mut request = b"GET /v1/things HTTP/1.1\r\nhost: x\r\n".to_vec();
    for i in 0..1000 {
        request.extend_from_slice(format!("x-filler-{i}: {}\r\n", "a".repeat(100)).as_bytes());
    }
    request.extend_from_slice(b"x-api-key: demo\r\n\r\n");
    let answer = raw(&addr, &request);
    assert!(answer.starts_with("HTTP/1.1 431 Request Header Fields Too Large"), "{}", &answer[..answer.len().min(200)]);
}

#[test]
fn the_filters_own_log_lines_are_written_to_stderr() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let err = std::env::temp_dir().join(format!("ratewall-gateway-log-{}.txt", std::process::id()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratewall-gateway"))
        .current_dir(&root)
        .args(["--port", "0", "--rules", "examples/rules.json"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let _gateway = Gateway(child, out);
    let addr = line.split_whitespace().find_map(|w| w.strip_prefix("http://")).unwrap().to_owned();
    // The workers write what the filter logged on their next pass.
    http(&addr, "GET", "/v1/things", &[("x-api-key", "demo")]);
    let start = std::time::Instant::now();
    let text = loop {
        let text = std::fs::read_to_string(&err).unwrap();
        if text.contains("ratewall: loaded") || start.elapsed() > Duration::from_secs(10) {
            break text;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = std::fs::remove_file(&err);
    assert!(text.contains("filter (info): ratewall: loaded"), "{text}");
}

/// An upstream for the gateway to forward to: each request it reads (method, path, header
/// section and body, as text) goes to `seen`; it answers one only when `release` sends, but
/// for `GET /now…` at once.
fn held_upstream() -> (String, std::sync::mpsc::Receiver<String>, std::sync::mpsc::Sender<()>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (seen_tx, seen) = std::sync::mpsc::channel();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let released = std::sync::Arc::new(std::sync::Mutex::new(released));
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let (seen_tx, released) = (seen_tx.clone(), std::sync::Arc::clone(&released));
            std::thread::spawn(move || {
                let mut stream = stream;
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                let head_end = loop {
                    if let Some(p) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        break p + 4;
                    }
                    let n = stream.read(&mut buf).unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                };
                let head = String::from_utf8_lossy(&got[..head_end]).to_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                while got.len() < head_end + length {
                    let n = stream.read(&mut buf).unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                }
                let _ = seen_tx.send(String::from_utf8_lossy(&got).into_owned());
                if !head.starts_with("get /now") {
                    let _ = released.lock().unwrap().recv();
                }
                let body = "from the origin";
                let answer = format!(
                    "HTTP/1.1 201 Created\r\ncontent-type: text/plain\r\nx-origin: yes\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes());
            });
        }
    });
    (addr, seen, release)
}

/// A rules file named `name` of one rule, `flight`: `concurrent` requests in flight per user.
fn in_flight_per_user(name: &str, concurrent: u32) -> std::path::PathBuf {
    let doc = format!(
        r#"{{"identity": {{"user": {{"header": "x-user-id"}}}},
            "rules": [{{"name": "flight", "key": ["user"], "limit": {{"concurrent": {concurrent}}}}}]}}"#
    );
    rules_file(name, &doc)
}

/// With `--upstream`, an admitted request goes to the user's origin and is in flight until its
/// answer is sent on: a concurrency limit holds while the origin works, and its slot comes
/// back when the answer is sent or the client goes away.
#[test]
fn with_an_upstream_a_concurrency_limit_holds_while_the_origin_answers() {
    let rules = in_flight_per_user("upstream", 2);
    let (upstream, seen, release) = held_upstream();
    let (_gateway, addr, _) = start_with(&rules, false, &["--upstream", &upstream]);
    let wait = Duration::from_secs(10);
    let send = |body: &'static str| {
        let addr = addr.clone();
        std::thread::spawn(move || {
            ratewall_host::http::request(&addr, "POST", "/orders?x=1", &[("x-user-id", "ann")], body.as_bytes())
                .unwrap()
        })
    };
    let first = send("one");
    let got = seen.recv_timeout(wait).unwrap();
    assert!(got.starts_with("POST /orders?x=1 HTTP/1.1\r\n"), "{got}");
    assert!(got.contains("x-user-id: ann\r\n") && got.ends_with("\r\n\r\none"), "{got}");
    assert!(got.to_lowercase().contains(&format!("host: {addr}\r\n")), "the client's Host: {got}");
    let second = send("two");
    seen.recv_timeout(wait).unwrap();
    // Two in flight at the origin: a third is refused at once.
    let (status, headers, _) = http(&addr, "GET", "/orders", &[("x-user-id", "ann")]);
    assert_eq!((status, header(&headers, "retry-after")), (429, Some("1")), "{headers:?}");
    assert_eq!(header(&headers, "ratelimit-policy"), Some("\"flight\";q=2;qu=\"concurrent-requests\""));
    assert!(seen.try_recv().is_err(), "the refused request did not reach the origin");
    // One answered: its client gets the origin's answer, and its slot is free again.
    release.send(()).unwrap();
    let answered = first.join().unwrap();
    assert_eq!((answered.status, answered.text().as_str()), (201, "from the origin"));
    assert_eq!(answered.header("x-origin"), Some("yes"));
    // The slot comes back once the answer is sent, which the client may see first.
    let deadline = std::time::Instant::now() + wait;
    while http(&addr, "GET", "/now", &[("x-user-id", "ann")]).0 == 429 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    seen.recv_timeout(wait).unwrap();
    let third = send("three");
    seen.recv_timeout(wait).unwrap();
    let (status, _, _) = http(&addr, "GET", "/orders", &[("x-user-id", "ann")]);
    assert_eq!(status, 429, "second and third in flight");
    // A client that goes away while its request is at the origin gives its slot back.
    release.send(()).unwrap();
    assert_eq!(second.join().unwrap().status, 201);
    let mut leaving = std::net::TcpStream::connect(&addr).unwrap();
    std::io::Write::write_all(&mut leaving, b"GET /slow HTTP/1.1\r\nhost: x\r\nx-user-id: ann\r\n\r\n").unwrap();
    seen.recv_timeout(wait).unwrap();
    drop(leaving);
    let deadline = std::time::Instant::now() + wait;
    let freed = loop {
        let (status, _, _) = http(&addr, "GET", "/now", &[("x-user-id", "ann")]);
        if status != 429 || std::time::Instant::now() > deadline {
            break status;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_ne!(freed, 429, "the slot of the client that left came back");
    for _ in 0..3 {
        let _ = release.send(());
    }
    assert_eq!(third.join().unwrap().status, 201);
}

/// An upstream that cannot be reached: the admitted request gets a 502 saying so.
#[test]
fn an_upstream_that_cannot_be_reached_is_a_502() {
    let rules = rules_file("upstream-down", r#"{"rules": []}"#);
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let (_gateway, addr, _) = start_with(&rules, false, &["--upstream", &closed]);
    let (status, _, body) = http(&addr, "GET", "/x", &[]);
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("the upstream did not answer"), "{body}");
}

/// `--host nginx`: the host follows ngx_wasm_module's rules, and a rules change is a reload —
/// fresh VMs and counters — while the VMs before it serve the requests they hold to their end.
#[test]
fn under_nginx_a_rules_change_is_a_reload_and_held_requests_are_served() {
    let doc = |extra: &str| {
        format!(
            r#"{{"identity": {{"user": {{"header": "x-user-id"}}}},
                "rules": [{{"name": "daily", "key": ["user"], "match": {{"path": "/now/d"}},
                           "limit": {{"requests": 2, "per": "1d"}}}}{extra}]}}"#
        )
    };
    let rules = rules_file("nginx-reload", &doc(""));
    let (upstream, seen, release) = held_upstream();
    let (_gateway, addr, _) = start_with(&rules, false, &["--host", "nginx", "--upstream", &upstream]);
    for expected in [201, 201, 429] {
        assert_eq!(http(&addr, "GET", "/now/d", &[("x-user-id", "ann")]).0, expected);
    }
    for _ in 0..2 {
        seen.recv_timeout(Duration::from_secs(10)).unwrap();
    }
    assert!(seen.try_recv().is_err(), "the refused request did not reach the origin");
    // Two requests at the origin when the rules change.
    let held: Vec<_> = (0..2)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                ratewall_host::http::request(&addr, "GET", "/slow", &[("x-user-id", "bob")], &[])
                    .map_or(0, |r| r.status)
            })
        })
        .collect();
    for _ in 0..2 {
        seen.recv_timeout(Duration::from_secs(10)).unwrap();
    }
    let more =
        r#", {"name": "more", "key": ["user"], "match": {"path": "/now/m"}, "limit": {"requests": 1, "per": "1m"}}"#;
    std::fs::write(&rules, doc(more)).unwrap();
    // After the reload the counters start over, as NGINX's do (under Envoy they are kept).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let again = loop {
        let status = http(&addr, "GET", "/now/d", &[("x-user-id", "ann")]).0;
        if status == 201 || std::time::Instant::now() > deadline {
            break status;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(again, 201);
    assert_eq!(http(&addr, "GET", "/now/m", &[("x-user-id", "ann")]).0, 201, "the new rules are in force");
    assert_eq!(http(&addr, "GET", "/now/m", &[("x-user-id", "ann")]).0, 429);
    // The VMs before the reload send on the answers to the requests they held.
    release.send(()).unwrap();
    release.send(()).unwrap();
    let statuses: Vec<u16> = held.into_iter().map(|c| c.join().unwrap()).collect();
    assert_eq!(statuses, [201, 201]);
}

/// An upstream on a port of its own that answers each request, once its head is read, as
/// `answer` does with the head and the connection.
fn upstream_answering(answer: impl Fn(&[u8], &mut std::net::TcpStream) + Send + Sync + 'static) -> String {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let answer = std::sync::Arc::new(answer);
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let answer = std::sync::Arc::clone(&answer);
            std::thread::spawn(move || {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = stream.read(&mut buf).unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                }
                answer(&got, &mut stream);
            });
        }
    });
    addr
}

/// An upstream answering by path, as written: an interim 100 before its answer, a HEAD's
/// length, a 204, fields named in `Connection`, an 8 MiB body.
fn scripted_upstream() -> String {
    upstream_answering(|got, stream| {
        let head = String::from_utf8_lossy(got).to_string();
        let answer: Vec<u8> = if head.starts_with("GET /interim ") {
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec()
        } else if head.starts_with("HEAD /head ") {
            b"HTTP/1.1 200 OK\r\ncontent-length: 12345\r\n\r\n".to_vec()
        } else if head.starts_with("GET /nothing ") {
            b"HTTP/1.1 204 No Content\r\n\r\n".to_vec()
        } else if head.starts_with("GET /hop ") {
            let saw = if head.to_lowercase().contains("x-drop-me") { "dropped: no" } else { "dropped: yes" };
            let length = saw.len();
            format!("HTTP/1.1 200 OK\r\nconnection: close, x-hop\r\nx-hop: 1\r\nx-end: 2\r\ncontent-length: {length}\r\n\r\n{saw}")
                .into_bytes()
        } else {
            let mut big = b"HTTP/1.1 200 OK\r\ncontent-length: 8388608\r\n\r\n".to_vec();
            big.resize(big.len() + (8 << 20), b'x');
            big
        };
        let _ = std::io::Write::write_all(stream, &answer);
    })
}

/// What an upstream answers reaches the client as a proxy passes it on: the final answer past
/// an interim one, a HEAD's and a 204's lengths as RFC 9110 has them, fields named in
/// `Connection` dropped both ways; and a client that does not read its answer holds up no
/// other request.
#[test]
fn an_upstreams_answers_are_passed_on_as_a_proxy_passes_them() {
    let rules = rules_file("upstream-answers", r#"{"rules": []}"#);
    let upstream = scripted_upstream();
    let (_gateway, addr, _) = start_with(&rules, false, &["--upstream", &upstream, "--workers", "1"]);
    let interim = raw(&addr, b"GET /interim HTTP/1.1\r\nhost: x\r\n\r\n");
    assert!(interim.starts_with("HTTP/1.1 200 OK\r\n") && interim.ends_with("\r\n\r\nok"), "{interim}");
    let head = raw(&addr, b"HEAD /head HTTP/1.1\r\nhost: x\r\n\r\n");
    assert!(head.contains("content-length: 12345\r\n") && head.ends_with("\r\n\r\n"), "{head}");
    let nothing = raw(&addr, b"GET /nothing HTTP/1.1\r\nhost: x\r\n\r\n");
    assert!(nothing.starts_with("HTTP/1.1 204 No Content\r\n"), "{nothing}");
    assert!(!nothing.to_lowercase().contains("content-length"), "{nothing}");
    let hop = raw(&addr, b"GET /hop HTTP/1.1\r\nhost: x\r\nconnection: x-drop-me\r\nx-drop-me: 1\r\n\r\n");
    assert!(hop.ends_with("dropped: yes") && hop.contains("x-end: 2\r\n") && !hop.contains("x-hop"), "{hop}");
    // A client that asks for 8 MiB and reads none of it: the one worker VM serves on.
    let mut stuck = std::net::TcpStream::connect(&addr).unwrap();
    std::io::Write::write_all(&mut stuck, b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let after = raw(&addr, b"GET /interim HTTP/1.1\r\nhost: x\r\n\r\n");
    assert!(after.ends_with("\r\n\r\nok"), "{after}");
    drop(stuck);
}

/// An upstream that answers `/stream` with a chunked body whose last chunk it sends only once
/// told to (`go`), `/short` with a body shorter than its length, and `/close` with a body that
/// runs to the connection's close under a reason phrase of its own.
fn streaming_upstream() -> (String, std::sync::mpsc::Sender<()>) {
    use std::io::Write;
    let (go, went) = std::sync::mpsc::channel::<()>();
    let went = std::sync::Mutex::new(went);
    let addr = upstream_answering(move |got, stream| {
        if got.starts_with(b"GET /stream ") {
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n");
            let _ = went.lock().unwrap().recv_timeout(Duration::from_secs(20));
            let _ = stream.write_all(b"4\r\nlast\r\n0\r\nx-trailer: t\r\n\r\n");
        } else if got.starts_with(b"GET /bare ") {
            let _ = stream.write_all(
                b"HTTP/1.1 200 OK\ntransfer-encoding: chunked\n\n5;x=1\nhello\n0\ncontent-length: 99\nbad trailer\nx-t: 1\n\n",
            );
        } else if got.starts_with(b"GET /plus ") {
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n+5\r\nhello\r\n0\r\n\r\n");
        } else if got.starts_with(b"GET /short ") {
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc");
        } else {
            let _ = stream.write_all(b"HTTP/1.1 200 Fine Thanks\r\n\r\nuntil the close");
        }
    });
    (addr, go)
}

/// An upstream's body is passed on as it comes, not held whole first (a body of any size, or
/// one that never ends, takes a buffer's worth of the gateway's memory): the client reads the
/// first chunk while the origin has not sent the last. A body cut short at the origin reaches
/// the client cut short, never as a whole answer; a body that runs to the close, and the
/// origin's reason phrase, pass as they are.
#[test]
fn an_upstreams_body_is_passed_on_as_it_comes() {
    use std::io::{Read, Write};
    let rules = rules_file("upstream-stream", r#"{"rules": []}"#);
    let (upstream, go) = streaming_upstream();
    let (_gateway, addr, _) = start_with(&rules, false, &["--upstream", &upstream, "--workers", "1"]);
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(5).any(|w| w == b"first") {
        let n = s.read(&mut buf).expect("the first chunk before the origin sent the last");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    go.send(()).unwrap();
    s.read_to_end(&mut got).unwrap();
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 200 OK\r\n") && got.contains("transfer-encoding: chunked\r\n"), "{got}");
    assert!(got.ends_with("\r\n\r\n5\r\nfirst\r\n4\r\nlast\r\n0\r\nx-trailer: t\r\n\r\n"), "{got}");
    let short = raw(&addr, b"GET /short HTTP/1.1\r\nhost: x\r\n\r\n");
    assert!(short.contains("content-length: 10\r\n") && short.ends_with("\r\n\r\nabc"), "{short}");
    let close = raw(&addr, b"GET /close HTTP/1.1\r\nhost: x\r\n\r\n");
    assert!(close.starts_with("HTTP/1.1 200 Fine Thanks\r\n") && close.ends_with("\r\n\r\nuntil the close"), "{close}");
    assert!(!close.to_lowercase().contains("content-length"), "{close}");
    // Chunks are framed anew: CRLF, sizes in hex alone, trailers that may be trailers; to an
    // HTTP/1.0 client, the data alone up to the close.
    let bare = raw(&addr, b"GET /bare HTTP/1.1\r\nhost: x\r\n\r\n");
    assert!(bare.ends_with("\r\n\r\n5\r\nhello\r\n0\r\nx-t: 1\r\n\r\n"), "{bare}");
    let old = raw(&addr, b"GET /bare HTTP/1.0\r\nhost: x\r\n\r\n");
    assert!(old.ends_with("\r\n\r\nhello") && !old.contains("transfer-encoding"), "{old}");
    let plus = raw(&addr, b"GET /plus HTTP/1.1\r\nhost: x\r\n\r\n");
    assert!(plus.ends_with("\r\n\r\n"), "a size that is not hex ends the answer there: {plus}");
}

/// Requests whose framing or routing is in doubt are refused as RFC 9112 has a server refuse
/// them (a proxy that passed them on would let its origin read them otherwise).
#[test]
fn requests_in_doubt_are_refused() {
    let rules = rules_file("doubt", r#"{"rules": []}"#);
    let (upstream, _go) = streaming_upstream();
    let (_gateway, addr, _) = start_with(&rules, false, &["--upstream", &upstream]);
    let status = |bytes: &[u8]| raw(&addr, bytes).split(' ').nth(1).unwrap_or_default().to_owned();
    let cases: [(&[u8], &str); 14] = [
        (b"GET /x HTTP/1.1\r\nhost: x\r\nx-a: a\rx-evil: 1\r\n\r\n", "400"),
        (b"GET /x HTTP/1.1\r\nhost: x\r\nx-a: a\x00b\r\n\r\n", "400"),
        (b"GET /x HTTP/1.1\r\nhost: x\r\nx a: b\r\n\r\n", "400"),
        (b"GET /x HTTP/1.1\r\nhost: x\r\nno colon\r\n\r\n", "400"),
        (b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: +1\r\n\r\na", "400"),
        (b"GET /x y HTTP/1.1\r\nhost: x\r\n\r\n", "400"),
        (b"GET /x http/1.1\r\nhost: x\r\n\r\n", "400"),
        (b"GET /x HTTP/2.0\r\nhost: x\r\n\r\n", "505"),
        (b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nab", "400"),
        (b"GET /x HTTP/1.1\r\nhost: x\r\nhost: y\r\n\r\n", "400"),
        (b"GET /x HTTP/1.1\r\nx-a: 1\r\n\r\n", "400"),
        (b"GET /x HTTP/1.1\r\nhost: x\r\nx-a: 1\r\n  folded\r\n\r\n", "400"),
        (b"GET /x HTTP/1.1\r\nhost: x\r\nx-a : 1\r\n\r\n", "400"),
        (b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n0\r\n\r\n", "411"),
    ];
    for (request, expected) in cases {
        assert_eq!(status(request), expected, "{}", String::from_utf8_lossy(request));
    }
    // Two equal lengths, an HTTP/1.0 request without a host, and an absolute-form target
    // naming its authority are fine.
    assert_eq!(status(b"POST /close HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ncontent-length: 1\r\n\r\na"), "200");
    assert_eq!(status(b"GET /close HTTP/1.0\r\n\r\n"), "200");
    assert_eq!(status(b"GET http://x/close HTTP/1.1\r\n\r\n"), "200");
}

/// A client that goes away while the origin pauses in the middle of its body gives its
/// `concurrent` slot back within a few seconds, not once a write to it fails after the
/// origin's next bytes (20 s here).
#[test]
fn a_client_leaving_in_the_middle_of_a_paused_body_gives_its_slot_back() {
    use std::io::{Read, Write};
    let rules = in_flight_per_user("upstream-leaving", 1);
    let upstream = upstream_answering(|got, stream| {
        if got.starts_with(b"GET /drip ") {
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\na");
            std::thread::sleep(Duration::from_secs(20));
            let _ = stream.write_all(b"bc");
        } else {
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
        }
    });
    let (_gateway, addr, _) = start_with(&rules, false, &["--upstream", &upstream]);
    let mut first = std::net::TcpStream::connect(&addr).unwrap();
    first.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    first.write_all(b"GET /drip HTTP/1.1\r\nhost: x\r\nx-user-id: ann\r\n\r\n").unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.ends_with(b"\r\n\r\na") {
        let n = first.read(&mut buf).unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(http(&addr, "GET", "/now", &[("x-user-id", "ann")]).0, 429, "its slot is held while it reads");
    drop(first);
    let left = std::time::Instant::now();
    while http(&addr, "GET", "/now", &[("x-user-id", "ann")]).0 != 200 {
        assert!(left.elapsed() < Duration::from_secs(8), "the slot came back within seconds of the client leaving");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Under NGINX, the VMs before a reload keep their own shared data to the end of the requests
/// they hold: their concurrency slots go back there, not into the new VMs' counts. (They went
/// into the new ones: two new requests at the origin, and a third was admitted once the old
/// ones' clients left.)
#[test]
fn under_nginx_requests_held_across_a_reload_give_their_slots_back_to_their_own_generation() {
    let doc = |extra: &str| {
        format!(
            r#"{{"identity": {{"user": {{"header": "x-user-id"}}}},
                "rules": [{{"name": "flight", "key": ["user"], "limit": {{"concurrent": 2}}}}{extra}]}}"#
        )
    };
    let rules = rules_file("nginx-generations", &doc(""));
    let (upstream, seen, _release) = held_upstream();
    let (_gateway, addr, _) =
        start_with(&rules, false, &["--host", "nginx", "--workers", "1", "--upstream", &upstream]);
    let wait = Duration::from_secs(10);
    let open = || {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        std::io::Write::write_all(&mut s, b"GET /slow HTTP/1.1\r\nhost: x\r\nx-user-id: ann\r\n\r\n").unwrap();
        // At the origin (the requests that watch for the reload reach it too, answered at once).
        while !seen.recv_timeout(wait).unwrap().starts_with("GET /slow ") {}
        s
    };
    let old = [open(), open()];
    assert_eq!(http(&addr, "GET", "/now", &[("x-user-id", "ann")]).0, 429);
    let more =
        r#", {"name": "more", "key": ["user"], "match": {"path": "/now/m"}, "limit": {"requests": 100, "per": "1m"}}"#;
    std::fs::write(&rules, doc(more)).unwrap();
    let deadline = std::time::Instant::now() + wait;
    loop {
        let (status, headers, _) = http(&addr, "GET", "/now/m", &[("x-user-id", "ann")]);
        let reloaded = header(&headers, "ratelimit-policy").is_some_and(|p| p.contains("more"));
        if status == 201 && reloaded || std::time::Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let new = [open(), open()];
    assert_eq!(http(&addr, "GET", "/now", &[("x-user-id", "ann")]).0, 429, "two in flight since the reload");
    drop(old);
    std::thread::sleep(Duration::from_millis(500));
    let status = http(&addr, "GET", "/now", &[("x-user-id", "ann")]).0;
    drop(new);
    assert_eq!(status, 429, "two new requests still at the origin: a third is refused");
}
