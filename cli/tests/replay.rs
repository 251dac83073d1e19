//! `ratewall replay` of real access-log formats: NGINX `combined` and `log_format` strings,
//! Envoy's default format and format strings, against the JSON lines of the same traffic;
//! unreadable lines; a gigabyte log through a pipe in bounded memory.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use std::fmt::Write as _;
use std::io::Write;
use std::process::{Command, Stdio};

mod common;
use common::{ratewall, root, temp};

/// The report of a replay that read every line, as JSON.
fn replay_json(args: &[&str]) -> Value {
    let mut all = vec!["replay", "--json"];
    all.extend_from_slice(args);
    let o = ratewall(&all);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Per rule: allowed, rejected, unkeyed and the top rejected keys.
fn per_rule(v: &Value) -> Vec<Value> {
    v["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| json!([r["name"], r["allowed"], r["rejected"], r["unkeyed"], r["top_rejected_keys"]]))
        .collect()
}

const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];

/// One request of the generated traffic: its second (since 2026-12-01T10:00:00Z), method,
/// path and client address.
struct Req {
    second: u64,
    method: &'static str,
    path: String,
    ip: String,
}

/// Logins from a few heavy clients and many light ones, holds and API calls, IPv4 and IPv6,
/// over ten minutes, several requests per second.
fn traffic() -> Vec<Req> {
    (0..6000u64)
        .map(|i| {
            let ip = match i % 7 {
                0..=2 => "203.0.113.7".to_owned(),
                3 => format!("2001:db8:{}::{}", i % 3, i % 11),
                _ => format!("198.51.100.{}", i % 40),
            };
            let (method, path) = match i % 5 {
                0 => ("POST", format!("/v1/events/{}/holds", i % 9)),
                1 => ("GET", "/v1/items?page=2".to_owned()),
                _ => ("POST", "/v1/auth/login".to_owned()),
            };
            Req { second: i / 10, method, path, ip }
        })
        .collect()
}

fn clock(second: u64) -> (u64, u64, u64) {
    let minute = second / 60;
    (10 + minute / 60, minute % 60, second % 60)
}

#[test]
fn nginx_combined_and_envoy_logs_of_the_same_traffic_count_as_the_json_lines_log() {
    let rules = root("examples/rules.json");
    let (mut jsonl, mut nginx, mut envoy) = (String::new(), String::new(), String::new());
    for r in traffic() {
        let (h, m, s) = clock(r.second);
        writeln!(
            jsonl,
            r#"{{"ts": "2026-12-01T{h:02}:{m:02}:{s:02}Z", "method": "{}", "path": "{}", "ip": "{}"}}"#,
            r.method, r.path, r.ip
        )
        .unwrap();
        writeln!(
            nginx,
            r#"{} - - [01/{}/2026:{h:02}:{m:02}:{s:02} +0000] "{} {} HTTP/1.1" 200 17 "-" "Mozilla/5.0 (X11; Linux x86_64)""#,
            r.ip, MONTHS[11], r.method, r.path
        )
        .unwrap();
        // Envoy's default format; its X-Forwarded-For ends with the peer it appended.
        writeln!(
            envoy,
            r#"[2026-12-01T{h:02}:{m:02}:{s:02}.000Z] "{} {} HTTP/1.1" 200 - 0 17 3 2 "{}" "curl/8.5.0" "6f1c-{}" "api.example.com" "10.0.0.9:8080""#,
            r.method, r.path, r.ip, r.second
        )
        .unwrap();
    }
    let want = replay_json(&["--format", "jsonl", &rules, &temp("same.jsonl", &jsonl)]);
    assert_eq!(want["requests"], 6000);
    let login = &want["rules"][2];
    assert!(login["rejected"].as_u64().unwrap() > 1000, "the heavy client is limited: {want}");
    assert_eq!(login["top_rejected_keys"][0]["key"], "ip=203.0.113.7", "{want}");
    let (nginx, envoy) = (temp("same.nginx", &nginx), temp("same.envoy", &envoy));
    for (args, format) in [
        (vec!["--format", "nginx", &rules, &nginx], "nginx combined"),
        (vec![&rules, &nginx], "nginx combined"),
        (vec!["--format", "envoy", &rules, &envoy], "envoy default"),
        (vec![&rules, &envoy], "envoy default"),
    ] {
        let got = replay_json(&args);
        assert_eq!(got["format"], format, "{args:?}");
        assert_eq!(got["requests"], want["requests"], "{args:?}");
        assert_eq!(per_rule(&got), per_rule(&want), "{args:?}");
    }
    // A client's X-Forwarded-For of its own making, written by Envoy as it came: the line is
    // unreadable, not keyed on the address the client put first.
    let forged = concat!(
        r#"[2026-12-01T10:00:00.200Z] "POST /v1/auth/login HTTP/1.1" 200 - 0 42 3 2 "1.1.1.1" "2.2.2.2, 203.0.113.9" "#,
        r#""curl" "id2" "api.example.com" "10.0.0.5:8080""#,
        "\n"
    );
    let got = replay_json(&["--format", "envoy", &rules, &temp("forged.envoy", forged)]);
    assert_eq!((got["requests"].as_u64(), got["invalid_lines"].as_u64()), (Some(0), Some(1)), "{got}");
    let auto = replay_json(&[&rules, &temp("auto.jsonl", &jsonl)]);
    assert_eq!(auto["format"], "jsonl");
    // A log some tool wrote with a byte order mark first reads the same, its first line too.
    for (name, log) in [("bom.jsonl", &jsonl), ("bom.nginx", &std::fs::read_to_string(&nginx).unwrap())] {
        let got = replay_json(&[&rules, &temp(name, &format!("\u{feff}{log}"))]);
        assert_eq!((got["requests"].clone(), per_rule(&got)), (want["requests"].clone(), per_rule(&want)), "{name}");
    }
}

#[test]
fn a_custom_log_format_feeds_the_identity_headers() {
    let rules = root("examples/rules.json");
    let (mut jsonl, mut nginx, mut envoy) = (String::new(), String::new(), String::new());
    // 1,400 API calls in one second: key k1 sends 1,000 of them (over its burst of 200),
    // k2 and k3 200 each; a tenth carry no key.
    for i in 0..1400u64 {
        let key = match i % 7 {
            0..=4 => "k1",
            5 => "k2",
            _ => "k3",
        };
        let key = if i % 10 == 9 { "-" } else { key };
        let headers = if key == "-" { json!({}) } else { json!({"x-api-key": key}) };
        writeln!(
            jsonl,
            "{}",
            json!({"ts": format!("2026-12-01T10:00:00.{:03}Z", i % 1000), "method": "GET", "path": "/v1/items", "headers": headers, "ip": "192.0.2.1"})
        )
        .unwrap();
        writeln!(
            nginx,
            r#"192.0.2.1 [2026-12-01T10:00:00+00:00] 1796119200.{:03} "GET /v1/items HTTP/2.0" 200 key="{key}" ua="-""#,
            i % 1000
        )
        .unwrap();
        writeln!(envoy, "{}.{:03} GET /v1/items {key} 192.0.2.1:5123", 1_796_119_200, i % 1000).unwrap();
    }
    let want = replay_json(&[&rules, &temp("keys.jsonl", &jsonl)]);
    let api = &want["rules"][1];
    assert_eq!(api["name"], "api-key");
    assert_eq!(api["unkeyed"], 140);
    assert!(api["rejected"].as_u64().unwrap() > 0, "{want}");
    // api_key is a secret dimension: shown only as its keyed hash, never as written.
    let shown = api["top_rejected_keys"][0]["key"].as_str().unwrap();
    assert!(shown.starts_with("api_key=#") && shown.len() == "api_key=#".len() + 8, "{want}");
    assert!(!want.to_string().contains("k1"), "the key never appears as written: {want}");
    // `$msec` gives the time here: the last time variable of a format wins.
    let got = replay_json(&[
        "--log-format",
        r#"$remote_addr [$time_iso8601] $msec "$request" $status key="$http_x_api_key" ua="$http_user_agent""#,
        &rules,
        &temp("keys.nginx", &nginx),
    ]);
    assert_eq!(got["format"], "nginx --log-format");
    assert_eq!(per_rule(&got), per_rule(&want));
    let got = replay_json(&[
        "--format",
        "envoy",
        "--log-format",
        "%START_TIME(%s.%3f)% %REQ(:METHOD)% %REQ(:PATH)% %REQ(X-API-KEY)% %DOWNSTREAM_REMOTE_ADDRESS%",
        &rules,
        &temp("keys.envoy", &envoy),
    ]);
    assert_eq!(got["format"], "envoy --log-format");
    assert_eq!(per_rule(&got), per_rule(&want));
    // Without the header in the format, the rule cannot key the requests.
    let got = replay_json(&[
        "--log-format",
        r#"$remote_addr [$time_iso8601] $msec "$request" $status key="$http_x_other" ua="$http_user_agent""#,
        &rules,
        &temp("keys2.nginx", &nginx),
    ]);
    assert_eq!(got["rules"][1]["unkeyed"], 1400);
    // A format the replay cannot use is a usage error that says why.
    let o = ratewall(&["replay", "--log-format", "$remote_addr $status", &rules, &temp("x.log", "")]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no time"), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn unreadable_lines_are_counted_and_shown_with_their_numbers() {
    let rules = root("examples/rules.json");
    let good = r#"198.51.100.4 - - [01/Dec/2026:10:00:00 +0000] "POST /v1/auth/login HTTP/1.1" 401 0 "-" "-""#;
    let mut log = String::new();
    for n in 1..=40 {
        let line = match n {
            3 => "\u{16}\u{3}\u{1} garbage".to_owned(),
            7 => r#"198.51.100.4 - - [31/Feb/2026:10:00:00 +0000] "GET / HTTP/1.1" 200 0 "-" "-""#.to_owned(),
            9 => r#"198.51.100.4 - - [01/Dec/2026:10:00:00 +0000] "-" 400 0 "-" "-""#.to_owned(),
            20..=40 if n % 2 == 0 => "not a log line".to_owned(),
            _ => good.to_owned(),
        };
        writeln!(log, "{line}").unwrap();
    }
    let path = temp("bad.log", &log);
    let o = ratewall(&["replay", "--format", "nginx", &rules, &path]);
    assert_eq!(o.status.code(), Some(0), "unreadable lines are a finding, reported, never fatal");
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(out.starts_with("26 requests replayed"), "{out}");
    assert!(out.contains("40 lines, 14 invalid"), "{out}");
    assert!(out.contains("login-per-ip: allowed 10, rejected 16"), "{out}");
    for n in [3, 7, 9, 20, 22] {
        assert!(err.contains(&format!("bad.log:{n}: ")), "line {n} not named:\n{err}");
    }
    assert!(err.contains("bad.log:7: cannot read the time at column 19 (26 bytes)\n"), "{err}");
    assert!(err.contains("14 log lines could not be read"), "{err}");
    // `auto` reads the log as NGINX all the same: most of its first lines are.
    let o = ratewall(&["replay", &rules, &path]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("read as nginx combined"));
    // Many bad lines: the first 20 are shown, all are counted.
    let junk = temp("junk.log", &"junk\n".repeat(1000));
    let o = ratewall(&["replay", "--format", "jsonl", &rules, &junk]);
    assert_eq!(o.status.code(), Some(0));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.lines().count(), 21, "{err}");
    assert!(err.contains("junk.log:20: not JSON") && !err.contains("junk.log:21:"), "{err}");
    assert!(err.ends_with("1000 log lines could not be read\n"), "{err}");
}

#[test]
fn a_line_that_does_not_match_the_log_format_given_is_unreadable_not_replayed() {
    let rules = root("examples/rules.json");
    let format = r#"$remote_addr [$time_iso8601] "$request" key="$http_x_api_key""#;
    let good = |n: u32| format!(r#"192.0.2.1 [2026-12-01T10:00:{n:02}+00:00] "GET /v1/items HTTP/1.1" key="k1""#);
    let mut log = String::new();
    for n in 1..=10 {
        let line = match n {
            // Another format's line, one with more after the format's end, one whose address
            // is none: none of them is a request of this log.
            3 => r#"192.0.2.1 - - [01/Dec/2026:10:00:00 +0000] "GET /v1/items HTTP/1.1" 200 0 "-" "-""#.to_owned(),
            5 => format!("{} 200 0.004 \"sk_live_0123456789\"", good(n)),
            8 => good(n).replacen("192.0.2.1", "somebody", 1),
            _ => good(n),
        };
        writeln!(log, "{line}").unwrap();
    }
    let o = ratewall(&["replay", "--json", "--log-format", format, &rules, &temp("mixed.nginx", &log)]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let got: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((got["requests"].clone(), got["invalid_lines"].clone()), (json!(7), json!(3)), "{got}");
    let numbers: Vec<u64> = got["invalid"].as_array().unwrap().iter().map(|b| b["line"].as_u64().unwrap()).collect();
    assert_eq!(numbers, [3, 5, 8], "the JSON names them too: {got}");
    assert!(!got.to_string().contains("sk_live"), "{got}");
    assert_eq!(got["rules"][1]["allowed"], 7, "{got}");
    let err = String::from_utf8_lossy(&o.stderr);
    for n in [3, 5, 8] {
        assert!(err.contains(&format!("mixed.nginx:{n}: ")), "line {n} not named:\n{err}");
    }
    assert!(err.contains("3 log lines could not be read"), "{err}");
    assert!(!err.contains("sk_live"), "what follows the format is not echoed: it may be a secret\n{err}");
    // A format string of the other syntax than --format says: told so.
    let log = temp("syntax.log", &format!("{}\n", good(1)));
    for (given, other, says) in
        [("envoy", format, "the syntax of nginx"), ("nginx", "%START_TIME% %REQ(:PATH)%", "the syntax of envoy")]
    {
        let o = ratewall(&["replay", "--format", given, "--log-format", other, &rules, &log]);
        assert_eq!(o.status.code(), Some(2));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(says) && err.contains(&format!("--format {given} reads")), "{err}");
    }
    // Both syntaxes in one string: told so, not only that the time is missing.
    let o = ratewall(&[
        "replay",
        "--log-format",
        r#"$remote_addr [$time_local] "$request" %REQ(X-API-KEY)%"#,
        &rules,
        &log,
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("mixes NGINX $variables and Envoy %OPERATORS%"), "{err}");
}

/// A header's value with a space runs, in a format string's line, into the fields after it:
/// the message about the line names the field it ran into, never the text, so a secret
/// header's value appears nowhere, in the report or in the messages.
#[test]
fn a_secret_header_value_that_runs_into_the_next_field_is_never_shown() {
    let rules = temp(
        "authorization.json",
        &json!({"identity": {"auth": {"header": "authorization", "secret": true}},
                "rules": [{"name": "per-auth", "key": ["auth"], "limit": {"requests": 1, "per": "1s"}}]})
        .to_string(),
    );
    let token = "sk_live_4eC39HqLyjWDarjtT1zdp7dc";
    let envoy = temp("authorization.envoy", &format!("[2026-12-01T10:00:00.000Z] GET /v1/x Bearer {token} 12\n"));
    let nginx = temp(
        "authorization.nginx",
        &format!("192.0.2.1 [2026-12-01T10:00:00+00:00] \"GET /v1/x HTTP/1.1\" Bearer {token} 0.012\n"),
    );
    for (log, format) in [
        (&envoy, "[%START_TIME%] %REQ(:METHOD)% %REQ(:PATH)% %REQ(AUTHORIZATION)% %DURATION%"),
        (&nginx, r#"$remote_addr [$time_iso8601] "$request" $http_authorization $request_time"#),
    ] {
        for json in [false, true] {
            let mut args = vec!["replay", &rules, log, "--log-format", format];
            if json {
                args.push("--json");
            }
            let o = ratewall(&args);
            let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
            assert_eq!(o.status.code(), Some(0), "{format}: {err}");
            assert!(err.contains(":1: cannot read the duration at column "), "{format}: {err}");
            for part in [token, "4eC39HqLyjWDarjtT1zdp7dc", "sk_live"] {
                assert!(!out.contains(part) && !err.contains(part), "{format}: a secret shown\n{out}\n{err}");
            }
        }
    }
}

/// `%START_TIME(…)%` reads a line's time by its format, whose extent in the line is the
/// format's, spaces included; a time without `%z` is UTC.
#[test]
fn a_start_time_is_read_by_its_format_spaces_and_all() {
    let rules = root("examples/rules.json");
    let one = temp("start-time.envoy", "2026/12/01T10:00:00+0000 /v1/x 1.2.3.4:5\n");
    let got = replay_json(&[
        &rules,
        &one,
        "--log-format",
        "%START_TIME(%Y/%m/%dT%H:%M:%S%z)% %REQ(:PATH)% %DOWNSTREAM_REMOTE_ADDRESS%",
    ]);
    assert_eq!((got["requests"].clone(), got["invalid_lines"].clone()), (json!(1), json!(0)), "{got}");
    // Twelve logins from one address, a second apart: login-per-ip (10 a minute) admits ten,
    // whichever way the time is written.
    for (i, (time, written)) in [
        ("%Y/%m/%dT%H:%M:%S%z", "2026/12/01T11:00:{s}+0100"),
        ("%d/%b/%Y:%H:%M:%S %z", "01/Dec/2026:10:00:{s} +0000"),
        ("%Y-%m-%d %H:%M:%S", "2026-12-01 10:00:{s}"),
        ("%F %T.%f", "2026-12-01 10:00:{s}.250000000"),
        ("%s.%3f", "17961192{s}.250"),
    ]
    .into_iter()
    .enumerate()
    {
        let log: String = (0..12)
            .map(|s| format!("{} /v1/auth/login 198.51.100.4:5123\n", written.replace("{s}", &format!("{s:02}"))))
            .collect();
        let format = format!("%START_TIME({time})% %REQ(:PATH)% %DOWNSTREAM_REMOTE_ADDRESS%");
        let got = replay_json(&[&rules, &temp(&format!("start-time-{i}.envoy"), &log), "--log-format", &format]);
        assert_eq!((got["requests"].clone(), got["invalid_lines"].clone()), (json!(12), json!(0)), "{time}: {got}");
        let login = got["rules"].as_array().unwrap().iter().find(|r| r["name"] == "login-per-ip").unwrap().clone();
        assert_eq!((login["allowed"].clone(), login["rejected"].clone()), (json!(10), json!(2)), "{time}: {got}");
    }
    // A specifier replay cannot read is a usage error that names it.
    let o = ratewall(&["replay", &rules, &one, "--log-format", "%START_TIME(%Y-%m-%d %k)% %REQ(:PATH)%"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("%k is not a time specifier"), "{o:?}");
}

/// Peak resident memory of a live process, in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A gigabyte of NGINX `combined` lines through a pipe, nearly every line from a new client
/// (2.4 million counters, over 250 MiB, if none were forgotten) with a few heavy ones: the
/// replay's peak memory stays far below what keeping them would take.
#[test]
fn a_gigabyte_log_streams_in_bounded_memory() {
    const GIB: u64 = 1 << 30;
    let rules = root("examples/rules.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratewall"))
        .args(["replay", "--json", "--format", "nginx", &rules, "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = std::io::BufWriter::with_capacity(1 << 20, child.stdin.take().unwrap());
    let (mut written, mut lines, mut early_peak) = (0u64, 0u64, 0u64);
    let mut line = String::with_capacity(160);
    while written < GIB {
        // 1,000 lines per second of log time; a new client address on every line but every
        // tenth, which comes from one of three heavy clients.
        let i = lines;
        let (h, m, s) = clock(i / 1000);
        line.clear();
        if i % 10 == 0 {
            write!(line, "203.0.113.{}", i % 3).unwrap();
        } else {
            write!(line, "10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255).unwrap();
        }
        writeln!(
            line,
            r#" - - [01/Dec/2026:{h:02}:{m:02}:{s:02} +0000] "POST /v1/auth/login HTTP/1.1" 200 512 "https://shop.example.com/account/login?return_to=%2Fcheckout%2Fcart%3Fpromo%3Dwinter-sale-2026%26items%3D3&utm_source=newsletter&utm_medium=email&utm_campaign=december" "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/131.0.0.0 Safari/537.36 Edg/131.0.0.0 (replay test client; +https://example.com/bot)""#
        )
        .unwrap();
        stdin.write_all(line.as_bytes()).unwrap();
        written += line.len() as u64;
        lines += 1;
        if early_peak == 0 && written >= 256 << 20 {
            stdin.flush().unwrap();
            early_peak = peak_rss_kib(child.id());
        }
    }
    stdin.flush().unwrap();
    // Still running (its input is open): its peak so far.
    let peak = peak_rss_kib(child.id());
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], lines);
    let login = &v["rules"][2];
    assert_eq!(login["top_rejected_keys"][0]["key"].as_str().unwrap().split('.').next(), Some("ip=203"), "{v}");
    eprintln!(
        "figure: replay_1gib_peak_rss = {} MiB ({} MiB after 256 MiB, {lines} lines)",
        peak >> 10,
        early_peak >> 10
    );
    assert!(peak < 192 << 10, "peak {peak} KiB after 1 GiB ({early_peak} KiB after 256 MiB)");
}

/// Envoy logs a request's start time when it completes: a slow request comes after later ones.
/// It is counted when it started, before them, as the proxy counted it; a stretch of log
/// further back (files joined out of order) is replayed on its own clock, and the report says
/// the clock started over.
#[test]
fn a_line_logged_out_of_order_does_not_make_a_counter_forget() {
    for algorithm in ["sliding_window", "token_bucket", "fixed_window", "sliding_log"] {
        let rules = temp(
            &format!("reorder-{algorithm}.json"),
            &json!({"identity": {"user": {"header": "x-user-id"}},
                    "rules": [{"name": "u", "key": ["user"], "algorithm": algorithm,
                               "limit": {"requests": 3, "per": "1s"}}]})
            .to_string(),
        );
        let line = |ms: u64| {
            format!(
                "[2026-12-01T10:00:{:02}.{:03}Z] \"GET /v1/x HTTP/1.1\" 200 - 0 17 3 2 \"203.0.113.7\" \"curl/8.5.0\" \"id\" \"api.example.com\" \"10.0.0.9:8080\"\n",
                ms / 1000,
                ms % 1000
            )
        };
        // Three at 10:00:30.1, one that started 1.6 s earlier (written after them), then one at
        // 10:00:30.2: in the order they started, the limit of 3 a second admits the early one
        // and the three, not the last (counted as written, the early one was refused too).
        let log: String = [30_100, 30_100, 30_100, 28_500, 30_200].into_iter().map(line).collect();
        // Envoy's default format, with the user's header where X-Forwarded-For is.
        let format = r#"[%START_TIME%] "%REQ(:METHOD)% %REQ(:PATH)% %PROTOCOL%" %RESPONSE_CODE% %RESPONSE_FLAGS% %BYTES_RECEIVED% %BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% "%REQ(X-USER-ID)%" "%REQ(USER-AGENT)%" "%REQ(X-REQUEST-ID)%" "%REQ(:AUTHORITY)%" "%UPSTREAM_HOST%""#;
        let got = replay_json(&["--log-format", format, &rules, &temp(&format!("reorder-{algorithm}.envoy"), &log)]);
        assert_eq!(first_rule(&got, &["allowed", "rejected"]), [json!(4), json!(1), json!(0)], "{algorithm}: {got}");
        // The same second an hour earlier, after a line two minutes on (the earlier stretch
        // comes further back than replay waits for): its own clock, its own three.
        let later: String = [30_100, 30_100, 30_100, 30_100].into_iter().map(line).collect();
        let on = line(30_100).replace("T10:00", "T10:02");
        let earlier = later.replace("T10:", "T09:");
        let got = replay_json(&[
            "--log-format",
            format,
            &rules,
            &temp(&format!("joined-{algorithm}.envoy"), &(later.clone() + &on + &earlier)),
        ]);
        assert_eq!(first_rule(&got, &["allowed", "rejected"]), [json!(7), json!(2), json!(1)], "{algorithm}: {got}");
        // Right after it, the same: the later stretch is counted whole, then the earlier one
        // on its own clock.
        let got = replay_json(&[
            "--log-format",
            format,
            &rules,
            &temp(&format!("swapped-{algorithm}.envoy"), &(later + &earlier)),
        ]);
        assert_eq!(first_rule(&got, &["allowed", "rejected"]), [json!(6), json!(2), json!(1)], "{algorithm}: {got}");
    }
}

/// A rules document of one rule `name` keyed on the peer's address, with `limit`.
fn one_ip_rule(file: &str, name: &str, limit: Value) -> String {
    let doc =
        json!({"identity": {"ip": {"trusted_hops": 0}}, "rules": [{"name": name, "key": ["ip"], "limit": limit}]});
    temp(file, &doc.to_string())
}

/// The first rule's `fields` in a replay's JSON report, then the report's `clock_restarts`.
fn first_rule(got: &Value, fields: &[&str]) -> Vec<Value> {
    fields.iter().map(|f| got["rules"][0][*f].clone()).chain([got["clock_restarts"].clone()]).collect()
}

/// A leaky bucket's requests that wait their turn are counted as delayed, as the filter's
/// `…_delayed` metric counts them: 1 a second, burst 3, ten at once: the first goes at once,
/// three wait, six are refused.
#[test]
fn a_leaky_buckets_waiting_requests_are_reported_delayed() {
    let rules =
        one_ip_rule("leaky.json", "l", json!({"requests": 1, "per": "1s", "burst": 3, "algorithm": "leaky_bucket"}));
    let log: String =
        (0..10).map(|_| "{\"ts\": \"2026-12-01T10:00:00Z\", \"path\": \"/a\", \"ip\": \"203.0.113.7\"}\n").collect();
    let got = replay_json(&[&rules, &temp("leaky.jsonl", &log)]);
    assert_eq!(
        first_rule(&got, &["allowed", "delayed", "rejected"]),
        [json!(4), json!(3), json!(6), json!(0)],
        "{got}"
    );
}

/// Rotated logs read newest first (`zcat -f access.log*`), with durations: the newer stretch is
/// counted whole, its last minute included, before the older one starts the clock over (that
/// last minute, still waiting for earlier starts, had been counted after the older stretch,
/// against its counters).
#[test]
fn a_stretch_of_log_from_earlier_comes_after_the_one_before_is_counted_whole() {
    let rules = one_ip_rule("stretch.json", "h", json!({"requests": 100, "per": "1h", "algorithm": "fixed_window"}));
    let line = |hh: u32, mm: u32, ss: u32| {
        format!(
            "{{\"ts\": \"2026-12-01T{hh:02}:{mm:02}:{ss:02}Z\", \"path\": \"/a\", \"ip\": \"203.0.113.7\", \"duration_ms\": 5}}\n"
        )
    };
    let mut log = String::new();
    (0..90).for_each(|i| log += &line(11, i / 60, i % 60));
    (0..20).for_each(|i| log += &line(11, 30, i));
    (0..5).for_each(|i| log += &line(9, 0, i));
    let got = replay_json(&[&rules, &temp("stretch.jsonl", &log)]);
    assert_eq!(first_rule(&got, &["allowed", "rejected"]), [json!(105), json!(10), json!(1)], "{got}");
}

/// NGINX writes a line when its request completes: a long export that started first is
/// written last. With `$request_time` in the format, replay counts it when it started, so it
/// holds the one slot of a `concurrent: 1` limit and the short requests meanwhile are refused,
/// as the proxy refused them.
#[test]
fn a_request_written_when_it_completed_holds_its_slot_from_its_start() {
    let rules = one_ip_rule("slot.json", "c", json!({"concurrent": 1}));
    // 0.1 s requests ending at 1, 2 and 3 s; then the export, 10 s from 0 s, ending at 10 s.
    let line = |end: u32, path: &str, took: &str| {
        format!("203.0.113.7 [2026-12-01T10:00:{end:02}+00:00] \"GET {path} HTTP/1.1\" 200 {took}\n")
    };
    let log = [line(1, "/a", "0.100"), line(2, "/b", "0.100"), line(3, "/c", "0.100"), line(10, "/export", "10.000")]
        .concat();
    let format = r#"$remote_addr [$time_iso8601] "$request" $status $request_time"#;
    let got = replay_json(&["--log-format", format, &rules, &temp("slot.log", &log)]);
    assert_eq!(first_rule(&got, &["allowed", "rejected"]), [json!(1), json!(3), json!(0)], "{got}");
}

/// Per rule by name: (allowed, rejected).
fn allowed_rejected(v: &Value) -> Vec<(String, u64, u64)> {
    v["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (r["name"].as_str().unwrap().to_owned(), r["allowed"].as_u64().unwrap(), r["rejected"].as_u64().unwrap())
        })
        .collect()
}

/// A request holds its concurrency slot from when it is replayed until it ends, as the log's
/// duration says (JSON lines' `duration_ms`, NGINX's `$request_time`, Envoy's `%DURATION%`), in
/// every format alike; a log that gives no duration holds no slot past a request's instant.
#[test]
fn a_concurrency_slot_is_held_for_the_requests_logged_duration() {
    let rules = temp(
        "inflight.json",
        &json!({"rules": [{"name": "one", "key": ["ip"], "limit": {"concurrent": 1}},
                          {"name": "two", "key": ["ip"], "limit": {"concurrent": 2}}]})
        .to_string(),
    );
    // 30 requests from one client, one every 5 s, each taking 7 s: never more than two in
    // flight; one at a time admits every other one.
    let (mut jsonl, mut bare, mut nginx, mut envoy) = (String::new(), String::new(), String::new(), String::new());
    for i in 0..30u64 {
        let start = 1_796_119_200 + 5 * i;
        let (h, m, s) = clock(5 * i);
        writeln!(jsonl, r#"{{"ts": {start}, "path": "/a", "ip": "203.0.113.7", "duration_ms": 7000}}"#).unwrap();
        writeln!(bare, r#"{{"ts": {start}, "path": "/a", "ip": "203.0.113.7"}}"#).unwrap();
        // NGINX writes the time the request completed.
        writeln!(nginx, r#"203.0.113.7 {}.000 7.000 "GET /a HTTP/1.1""#, start + 7).unwrap();
        writeln!(
            envoy,
            r#"[2026-12-01T{h:02}:{m:02}:{s:02}.000Z] "GET /a HTTP/1.1" 200 - 0 17 7000 2 "203.0.113.7" "curl/8.5.0" "id" "api.example.com" "10.0.0.9:8080""#
        )
        .unwrap();
    }
    let want = vec![("one".to_owned(), 15, 15), ("two".to_owned(), 30, 0)];
    let got = replay_json(&[&rules, &temp("inflight.jsonl", &jsonl)]);
    assert_eq!(allowed_rejected(&got), want, "{got}");
    let got = replay_json(&[
        "--log-format",
        r#"$remote_addr $msec $request_time "$request""#,
        &rules,
        &temp("inflight.nginx", &nginx),
    ]);
    assert_eq!(allowed_rejected(&got), want, "{got}");
    let got = replay_json(&["--format", "envoy", &rules, &temp("inflight.envoy", &envoy)]);
    assert_eq!(allowed_rejected(&got), want, "{got}");
    // Without durations, no request is in flight when the next one comes.
    let got = replay_json(&[&rules, &temp("bare.jsonl", &bare)]);
    assert_eq!(allowed_rejected(&got), vec![("one".to_owned(), 30, 0), ("two".to_owned(), 30, 0)], "{got}");
}

/// Slots are given back in the order the requests end, whatever order they started in; one
/// held past `hold_max` is let go then, as the core lets it go.
#[test]
fn concurrency_slots_are_given_back_in_the_order_requests_end() {
    let rules = |name: &str, limit: Value| {
        temp(
            name,
            &json!({"identity": {"user": {"header": "x-user-id"}},
                    "rules": [{"name": "c", "key": ["user"], "limit": limit}]})
            .to_string(),
        )
    };
    let line = |at: f64, ms: u64| {
        format!(
            r#"{{"ts": {}, "path": "/a", "headers": {{"x-user-id": "a"}}, "duration_ms": {ms}}}"#,
            1_796_119_200.0 + at
        )
    };
    let log = [
        // Two in flight until 10 s and 11 s: the next two are refused; at 10 s one is free, at
        // 10.5 s none, at 11 s one again.
        line(0.0, 10_000),
        line(1.0, 10_000),
        line(2.0, 1_000),
        line(5.0, 1_000),
        line(10.0, 5_000),
        line(10.5, 1_000),
        line(11.0, 1_000),
        line(20.0, 1_000),
    ]
    .join("\n");
    let got = replay_json(&[&rules("c2.json", json!({"concurrent": 2})), &temp("ends.jsonl", &log)]);
    assert_eq!(allowed_rejected(&got), vec![("c".to_owned(), 5, 3)], "{got}");
    let log = [line(0.0, 60_000), line(5.0, 1_000), line(11.0, 1_000)].join("\n");
    let got =
        replay_json(&[&rules("c1.json", json!({"concurrent": 1, "hold_max": "10s"})), &temp("hold_max.jsonl", &log)]);
    assert_eq!(allowed_rejected(&got), vec![("c".to_owned(), 2, 1)], "{got}");
}

/// JSON lines whose fields are not what the format says, and text lines whose client is a
/// Unix socket's peer, are unreadable: counted and shown with their numbers, never replayed.
#[test]
fn json_fields_of_the_wrong_kind_and_unix_socket_peers_make_lines_unreadable() {
    let rules = root("examples/rules.json");
    let good = r#"{"ts": 1796119200, "path": "/v1/items", "headers": {"x-api-key": "k1"}, "ip": "192.0.2.1"}"#;
    let bad = [
        r#""ip": "not-an-ip""#,
        r#""ip": """#,
        r#""ip": 5"#,
        r#""method": "SEC RET""#,
        r#""method": """#,
        r#""method": 5"#,
        r#""headers": "x-api-key: sk_live_0123""#,
        r#""headers": {"x-api-key": 5}"#,
        r#""duration_ms": "a while""#,
    ];
    let mut log = String::new();
    for field in bad {
        writeln!(log, "{good}").unwrap();
        writeln!(log, r#"{{"ts": 1796119201, "path": "/v1/items", {field}}}"#).unwrap();
    }
    let o = ratewall(&["replay", "--json", &rules, &temp("fields.jsonl", &log)]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let got: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((got["requests"].clone(), got["invalid_lines"].clone()), (json!(9), json!(9)), "{got}");
    let err = String::from_utf8_lossy(&o.stderr);
    for n in (2..=18).step_by(2) {
        assert!(err.contains(&format!("fields.jsonl:{n}: ")), "line {n} not named:\n{err}");
    }
    assert!(!err.contains("sk_live"), "a header's value is never shown\n{err}");
    // NGINX writes `unix:` for a Unix socket's peer: no address to key it by.
    let line =
        |peer: &str| format!(r#"{peer} - - [01/Dec/2026:10:00:00 +0000] "GET /v1/items HTTP/1.1" 200 0 "-" "-""#);
    let log = [line("192.0.2.1"), line("unix:"), line("-"), line("192.0.2.1")].join("\n");
    let o = ratewall(&["replay", "--json", "--format", "nginx", &rules, &temp("unix.nginx", &log)]);
    let got: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((got["requests"].clone(), got["invalid_lines"].clone()), (json!(3), json!(1)), "{got}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("unix.nginx:2: "), "{}", String::from_utf8_lossy(&o.stderr));
}

/// A rules file `name`: one rule, `ip`, 2 requests a minute per client address (a fixed
/// window), the address found `trusted_hops` from the right of `X-Forwarded-For`.
fn two_a_minute_per_ip(name: &str, trusted_hops: u8) -> String {
    temp(
        name,
        &format!(
            r#"{{"identity":{{"ip":{{"trusted_hops":{trusted_hops}}}}},"rules":[{{"name":"ip","key":["ip"],"algorithm":"fixed_window","limit":{{"requests":2,"per":"60s"}}}}]}}"#
        ),
    )
}

/// A line whose request target is no path (`PRI * HTTP/2.0`, which NGINX answers 400 itself)
/// is no request the filter sees: unreadable, not counted. `OPTIONS *` is one.
#[test]
fn a_target_that_is_no_path_is_not_a_request() {
    let rules = two_a_minute_per_ip("target-rules.json", 0);
    let line =
        |request: &str| format!("203.0.113.7 - - [06/Dec/2026:10:00:01 +0000] \"{request}\" 400 0 \"-\" \"-\"\n");
    let log = [line("PRI * HTTP/2.0"), line("OPTIONS * HTTP/1.1"), line("GET /a HTTP/1.1")].concat();
    let got = replay_json(&[&rules, &temp("target.log", &log)]);
    assert_eq!((got["requests"].as_u64(), got["invalid_lines"].as_u64()), (Some(2), Some(1)), "{got}");
    assert!(got["invalid"][0]["reason"].as_str().unwrap().contains("not a path"), "{got}");
}

/// A rotated log as logrotate leaves it, gzip-compressed (and two of them joined by `cat`),
/// replays as the text does; another compression is named, with the tool to read it through
/// (its bytes were each an unreadable line, the replay of nothing ending well).
#[test]
fn a_gzip_compressed_log_replays_as_its_text() {
    use flate2::{write::GzEncoder, Compression};
    let rules = two_a_minute_per_ip("gz-rules.json", 0);
    let mut text = String::new();
    for s in 1..=5 {
        writeln!(text, r#"203.0.113.7 - - [06/Dec/2026:10:00:0{s} +0000] "GET /a HTTP/1.1" 200 5 "-" "curl""#).unwrap();
    }
    let gzip = |t: &str| {
        let mut e = GzEncoder::new(Vec::new(), Compression::default());
        e.write_all(t.as_bytes()).unwrap();
        e.finish().unwrap()
    };
    let dir = std::env::temp_dir().join(format!("ratewall-gz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let one = dir.join("access.log.1.gz");
    std::fs::write(&one, gzip(&text)).unwrap();
    let two = dir.join("joined.gz");
    std::fs::write(&two, [gzip(&text), gzip(&text)].concat()).unwrap();
    let plain = replay_json(&[&rules, &temp("gz-plain.log", &text)]);
    let rules_of = |v: &Value| v["rules"].clone();
    assert_eq!(rules_of(&replay_json(&[&rules, one.to_str().unwrap()])), rules_of(&plain));
    let joined = replay_json(&[&rules, two.to_str().unwrap()]);
    assert_eq!(
        (joined["rules"][0]["allowed"].as_u64(), joined["rules"][0]["rejected"].as_u64()),
        (Some(2), Some(8)),
        "{joined}"
    );
    // Zeros after the last member (a copy that left them), or text appended: ignored, said,
    // as gzip does; a member cut short is an error still.
    let padded = dir.join("padded.gz");
    std::fs::write(&padded, [gzip(&text), vec![0; 8]].concat()).unwrap();
    let o = ratewall(&["replay", "--json", &rules, padded.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    assert_eq!(rules_of(&serde_json::from_slice(&o.stdout).unwrap()), rules_of(&plain));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not gzip: ignored"), "{o:?}");
    let cut = dir.join("cut.gz");
    let whole = gzip(&text);
    std::fs::write(&cut, &whole[..whole.len() - 12]).unwrap();
    assert_eq!(ratewall(&["replay", &rules, cut.to_str().unwrap()]).status.code(), Some(2));
    let zstd = dir.join("access.log.zst");
    std::fs::write(&zstd, b"\x28\xb5\x2f\xfd rest of a zstd frame").unwrap();
    let o = ratewall(&["replay", &rules, zstd.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("zstd-compressed: read it through zstdcat"), "{o:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A log in the `main` format of the `nginx.conf` NGINX ships (its container image logs with it)
/// is read as `main`, by `auto` and `--format nginx`: behind a load balancer its clients are the
/// `X-Forwarded-For` it ends with, which `combined` leaves out (every request was the balancer's).
/// A `combined` log is still read as `combined`.
#[test]
fn nginx_main_logs_are_keyed_on_the_forwarded_for_they_end_with() {
    let rules = two_a_minute_per_ip("main-rules.json", 1);
    let mut main = String::new();
    let mut combined = String::new();
    for s in 0..6 {
        let head = format!(r#"10.0.0.9 - - [06/Dec/2026:10:00:0{s} +0000] "GET /a HTTP/1.1" 200 5 "-" "curl/8""#);
        writeln!(main, r#"{head} "203.0.113.{}""#, s % 3).unwrap();
        writeln!(combined, "{head}").unwrap();
    }
    let (main, combined) = (temp("main.log", &main), temp("combined.log", &combined));
    for args in [vec![&rules[..], &main[..]], vec!["--format", "nginx", &rules, &main]] {
        let v = replay_json(&args);
        assert_eq!(v["format"], "nginx main", "{v}");
        let r = &v["rules"][0];
        assert_eq!((r["allowed"].as_u64(), r["rejected"].as_u64()), (Some(6), Some(0)), "three clients, two each: {v}");
    }
    let v = replay_json(&[&rules, &combined]);
    assert_eq!(v["format"], "nginx combined", "{v}");
    let r = &v["rules"][0];
    assert_eq!((r["allowed"].as_u64(), r["rejected"].as_u64()), (Some(2), Some(4)), "the balancer alone: {v}");
    // One line of a `main` log without its last field is unreadable, not a reason to read
    // the whole log as `combined`.
    let text = std::fs::read_to_string(&main).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    let short = r#"10.0.0.9 - - [06/Dec/2026:10:00:06 +0000] "GET /a HTTP/1.1" 200 5 "-" "curl/8""#;
    lines.insert(2, short);
    let v = replay_json(&[&rules, &temp("main-short.log", &(lines.join("\n") + "\n"))]);
    assert_eq!((v["format"].as_str(), v["invalid_lines"].as_u64()), (Some("nginx main"), Some(1)), "{v}");
    assert_eq!((v["rules"][0]["allowed"].as_u64(), v["rules"][0]["rejected"].as_u64()), (Some(6), Some(0)), "{v}");
}

/// Lines no format reads before a log's requests (a banner, junk) do not decide its format:
/// twenty of them first had it read as `combined`, every request unreadable.
#[test]
fn auto_looks_past_lines_no_format_reads() {
    let rules = two_a_minute_per_ip("junk-rules.json", 0);
    let mut log = String::new();
    for i in 0..20 {
        writeln!(log, "-- rotated {i} --").unwrap();
    }
    for s in 0..5 {
        writeln!(log, r#"{{"ts": "2026-12-06T10:00:0{s}Z", "path": "/a", "ip": "203.0.113.7"}}"#).unwrap();
    }
    let v = replay_json(&[&rules, &temp("junk.jsonl", &log)]);
    assert_eq!(
        (v["format"].as_str(), v["requests"].as_u64(), v["invalid_lines"].as_u64()),
        (Some("jsonl"), Some(5), Some(20))
    );
    assert_eq!((v["rules"][0]["allowed"].as_u64(), v["rules"][0]["rejected"].as_u64()), (Some(2), Some(3)), "{v}");
}
