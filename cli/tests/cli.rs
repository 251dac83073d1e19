//! The `ratewall` binary as an operator meets it (exit codes, text and JSON), and the schema
//! against the parser: every document the parser accepts the schema accepts, and documents
//! with wrong types, unknown fields or bad durations are rejected by both.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_core::Config;
use serde_json::{json, Value};
use std::io::Write;
use std::process::{Command, Output};

mod common;
use common::{ratewall, ratewall_with, root, temp};

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn check_lists_the_rules_of_a_good_document() {
    let o = ratewall(&["check", &root("examples/rules.json")]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in [
        "valid, 3 rules",
        "holds-per-user",
        "POST /v1/events/*/holds",
        "burst 200",
        "limit: 5 per 60s (sliding_window)",
        "plan partner: 10000 per 60s (sliding_window)",
        "plan internal: unlimited",
        "on store failure closed",
    ] {
        assert!(out.contains(needle), "{needle} missing from:\n{out}");
    }
    let o = ratewall(&["check", "--json", &root("examples/rules.json")]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["valid"], true);
    assert_eq!(
        v["rules"][1]["limit"],
        json!({"requests": 1000, "per": "60s", "algorithm": "token_bucket", "burst": 200}),
        "per as the document writes it"
    );
    assert_eq!(v["rules"][1]["plans"]["partner"]["per"], "60s");
    assert_eq!(v["rules"][1]["plans"]["internal"], "unlimited");
    assert_eq!(v["rules"][2]["key"], json!(["ip"]));
    // The same document after a byte order mark (an editor's) reads and shows the same.
    let text = std::fs::read_to_string(root("examples/rules.json")).unwrap();
    let bom = temp("bom-rules.json", &format!("\u{feff}{text}"));
    let o = ratewall(&["check", &bom]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stdout(&o).replace(&bom, "X"), out.replace(&root("examples/rules.json"), "X"));
}

#[test]
fn check_names_the_field_of_a_bad_document_and_exits_1() {
    let bad = temp("bad.json", r#"{"rules":[{"name":"x","key":["nobody"],"limit":{"requests":1,"per":"1s"}}]}"#);
    let o = ratewall(&["check", &bad]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).starts_with("rules[0].key[0]: "), "{}", stderr(&o));
    let o = ratewall(&["check", "--json", &bad]);
    assert_eq!(o.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((v["valid"].clone(), v["errors"][0]["path"].clone()), (json!(false), json!("rules[0].key[0]")));
    // Every bad rule is named, each on its line, in one run.
    let two = temp(
        "two-bad.json",
        r#"{"identity": {"user": {"header": "x-user-id"}}, "rules": [
             {"name": "a", "key": ["user"], "limit": {"requests": 5, "per": "5 minutes"}},
             {"name": "b", "key": ["user"], "limit": {"requests": 5, "per": "1m"}},
             {"name": "c", "key": ["nobody"], "limit": {"requests": 5, "per": "1m"}}]}"#,
    );
    let o = ratewall(&["check", &two]);
    assert_eq!(o.status.code(), Some(1));
    let lines: Vec<String> = stderr(&o).lines().map(|l| l.split(':').next().unwrap_or("").to_owned()).collect();
    assert_eq!(lines, ["rules[0].limit.per", "rules[2].key[0]"], "{}", stderr(&o));
    // A number past 64 bits is said once, as written, in the first rule and in any other.
    let big = temp(
        "numbers-past-64-bits.json",
        r#"{"rules": [{"name": "a", "key": ["user"], "limit": {"requests": 18446744073709551616, "per": "1s"}},
                      {"name": "b", "key": ["user"], "limit": {"requests": 18446744073709551617, "per": "1s"}}]}"#,
    );
    let o = ratewall(&["check", &big]);
    let text = stderr(&o);
    let said: Vec<&str> = text.lines().map(|l| l.rsplit(' ').next().unwrap_or("")).collect();
    assert_eq!(said, ["18446744073709551616", "18446744073709551617"], "{text}");
    // A fault beside the rules (an unknown member, a bad `response`) is said, and each bad rule
    // all the same, whichever comes first in the file.
    let beside = temp(
        "beside.json",
        r#"{"foo": 1, "rules": [{"name": "a", "key": ["ip"], "limit": {"requests": 0, "per": "1s"}},
                                {"name": "b", "key": ["ip"], "limit": {"requests": 1, "per": "x"}}],
            "response": {"legacy_headers": 1}}"#,
    );
    let text = stderr(&ratewall(&["check", &beside]));
    let paths: Vec<&str> = text.lines().map(|l| l.split(':').next().unwrap_or("")).collect();
    assert_eq!(paths, ["foo", "response.legacy_headers", "rules[0].limit.requests", "rules[1].limit.per"], "{text}");
    // A fault with a place is said once, at its place in the file, whichever copy of the
    // document finds it (members left out before and after the one at fault).
    let placed = temp(
        "placed.json",
        "{\"foo\": 1,\n \"bar\": 2,\n \"rules\": [\n  {\"name\": \"a\", \"key\": [\"ip\"], \"limit\": {\"requests\": 0, \"per\": \"1s\"}},\n  {\"name\": \"b\", \"key\": [\"ip\"], \"limit\": {\"requests\": 1, \"per\": \"1s\", \"per\": \"2s\"}}],\n \"sync\": {\"secret\": \"s1-0123456789abcdef\", \"secret\": \"s2-0123456789abcdef\"},\n \"baz\": 3}",
    );
    let text = stderr(&ratewall(&["check", &placed]));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 6, "{text}");
    assert!(
        lines.iter().any(|l| l.starts_with("rules[1].limit.per: duplicate key \"per\" at line 5 column ")),
        "{text}"
    );
    assert!(lines.iter().any(|l| l.starts_with("sync.secret: duplicate key \"secret\" at line 6 column ")), "{text}");
    assert!(!text.contains("at line 1 ") && !text.contains("0123456789abcdef"), "{text}");
    // A member named twice is left out whole, both times: the rules are judged all the same.
    let twice = temp(
        "twice.json",
        r#"{"foo": 1, "foo": 2, "rules": [{"name": "a", "key": ["ip"], "limit": {"requests": 0, "per": "1s"}},
                                          {"name": "b", "key": ["ip"], "limit": {"requests": 1, "per": "1x"}}]}"#,
    );
    let text = stderr(&ratewall(&["check", &twice]));
    let paths: Vec<&str> = text.lines().map(|l| l.split(':').next().unwrap_or("")).collect();
    assert_eq!(paths, ["foo", "rules[0].limit.requests", "rules[1].limit.per"], "{text}");
    let o = ratewall(&["check", "/no/such/file.json"]);
    assert_eq!(o.status.code(), Some(2), "an unreadable file is a usage error");
    assert_eq!(ratewall(&["frobnicate"]).status.code(), Some(2));
}

#[test]
fn check_rejects_a_sync_cluster_no_host_could_call() {
    let doc =
        |cluster: &str| json!({"rules": [], "sync": {"cluster": cluster, "secret": "0123456789abcdef"}}).to_string();
    for (cluster, says) in [
        ("https://store.example.com", "sync.cluster: \"https://store.example.com\" is a URL"),
        ("store:80x", "sync.cluster: \"store:80x\" has no valid port"),
    ] {
        let o = ratewall(&["check", &temp("cluster.json", &doc(cluster))]);
        assert_eq!(o.status.code(), Some(1), "{cluster}");
        assert!(stderr(&o).starts_with(says), "{cluster}: {}", stderr(&o));
    }
    for cluster in ["ratewall_store", "127.0.0.1:8090"] {
        let o = ratewall(&["check", &temp("cluster.json", &doc(cluster))]);
        assert_eq!(o.status.code(), Some(0), "{cluster}: {}", stderr(&o));
    }
}

#[test]
fn check_refuses_a_sync_path_without_a_slash_and_counts_secrets_in_characters() {
    for (doc, says) in [
        (
            json!({"rules": [], "sync": {"cluster": "s", "secret": "0123456789abcdef", "path": "v1/sync"}}),
            "sync.path: ",
        ),
        (json!({"rules": [], "sync": {"cluster": "s", "secret": "0123456789abcdef", "path": ""}}), "sync.path: "),
        // Eight characters of two bytes each.
        (
            json!({"rules": [], "identity": {"hash_key": "éééééééé"}}),
            "identity.hash_key: must be at least 16 characters",
        ),
        (json!({"rules": [], "sync": {"cluster": "s", "secret": "éééééééé"}}), "sync.secret: "),
    ] {
        let o = ratewall(&["check", &temp("lengths.json", &doc.to_string())]);
        assert_eq!(o.status.code(), Some(1), "{doc}: {}", stdout(&o));
        assert!(stderr(&o).starts_with(says), "{doc}: {}", stderr(&o));
    }
}

/// A rules document is read to its limit and no further: a file over it is refused as too
/// large, and so is a path that never ends, which is not read to its end.
#[test]
fn a_rules_document_is_read_no_further_than_its_limit() {
    let limit = ratewall_core::rules::MAX_DOCUMENT;
    let big = temp("big.json", &format!(r#"{{"rules": [], "x": "{}"}}"#, "a".repeat(limit)));
    let size = std::fs::metadata(&big).unwrap().len();
    let o = ratewall(&["check", &big]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stderr(&o), format!("(document): has {size} bytes; at most {limit} are accepted\n"));
    if !std::path::Path::new("/dev/zero").exists() {
        return;
    }
    // Under a 4 GiB address space, so that reading without a bound fails fast.
    let bounded = |args: &[&str]| {
        let script = r#"ulimit -v 4194304 && exec "$0" "$@""#;
        let o =
            Command::new("sh").arg("-c").arg(script).arg(env!("CARGO_BIN_EXE_ratewall")).args(args).output().unwrap();
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        let too_large = format!("(document): has more than {limit} bytes; at most {limit} are accepted\n");
        assert_eq!(stderr(&o), too_large, "{args:?}");
    };
    bounded(&["check", "/dev/zero"]);
    bounded(&["explain", "/dev/zero", "--path", "/"]);
    bounded(&["replay", "/dev/zero", &temp("zero.jsonl", "")]);
}

/// JSON is YAML too: a `.yaml` file that holds a JSON object with `rules` is a rules document,
/// and one without is the rate limit service's.
#[test]
fn check_tells_a_rules_document_from_a_rate_limit_service_file_by_its_content() {
    let rules = std::fs::read_to_string(root("examples/rules.json")).unwrap();
    for name in ["rules.yaml", "rules.YML"] {
        let o = ratewall(&["check", &temp(name, &rules)]);
        assert_eq!(o.status.code(), Some(0), "{name}: {}", stderr(&o));
        assert!(stdout(&o).contains("valid, 3 rules"), "{name}: {}", stdout(&o));
    }
    let bad = temp("bad-rules.yaml", r#"{"rules": [{"name": "x"}]}"#);
    let o = ratewall(&["check", &bad]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).starts_with("rules[0]."), "{}", stderr(&o));
    let rls = temp(
        "rls.yaml",
        r#"{"domain": "d", "descriptors": [{"key": "k", "rate_limit": {"unit": "second", "requests_per_unit": 1}}]}"#,
    );
    let o = ratewall(&["check", &rls]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("valid rate limit service configuration, 1 domain (d)"), "{}", stdout(&o));
    // Under another name, as the service reads it too.
    let conf = temp(
        "ratelimit.conf",
        "# the service's\ndomain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    );
    let o = ratewall(&["check", &conf]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("valid rate limit service configuration, 1 domain (d)"), "{}", stdout(&o));
    // However large (the service reads up to 16 MiB of it; a rules document is read to 1 MiB).
    let mut big = String::from("domain: big\ndescriptors:\n");
    for i in 0..30_000 {
        big.push_str(&format!("  - key: k{i}\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n"));
    }
    assert!(big.len() > 1 << 20);
    let o = ratewall(&["check", &temp("big-ratelimit.conf", &big)]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("valid rate limit service configuration, 1 domain (big)"), "{}", stdout(&o));
    let conf = temp("broken.conf", "domain: d\ndescriptors:\n  - kee: k\n");
    let o = ratewall(&["check", &conf]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("broken.conf:3:"), "{}", stderr(&o));
    // In a directory, such a file is one the service would read: refused, and named for what it is.
    let yaml = temp("rules-in-dir/r.yaml", &rules);
    let o = ratewall(&["check", yaml.trim_end_matches("/r.yaml")]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains(&format!("{yaml} is a rules document")), "{}", stderr(&o));
}

/// What a rules document under review writes reaches the terminal only as text: a pattern's
/// control characters percent-encoded, a plan name with one quoted and escaped, so a document
/// cannot paint lines (a limit it does not have) or send the terminal escapes.
#[test]
fn check_and_explain_show_control_characters_of_a_document_escaped() {
    let doc = json!({"identity": {"user": {"header": "x-user-id"}, "plan": {"header": "x-plan"}}, "rules": [{
        "name": "a", "key": ["user"], "match": {"path": "/v1/\u{1b}[31mRED\n    limit: 999 per 1s"},
        "limit": {"requests": 1, "per": "1s"},
        "plans": {"gold\n    plan platinum: unlimited": {"requests": 2, "per": "1s"}}}]});
    let rules = temp("controls.json", &doc.to_string());
    let o = ratewall(&["check", &rules]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(!out.contains('\u{1b}'), "{out}");
    assert!(out.contains("match: any method /v1/%1B[31mRED%0A    limit: 999 per 1s\n"), "{out}");
    assert!(out.contains(r#"plan "gold\n    plan platinum: unlimited": 2 per 1s"#), "{out}");
    assert_eq!(out.lines().filter(|l| l.trim_start().starts_with("limit:")).count(), 1, "one limit line: {out}");
    assert_eq!(out.lines().filter(|l| l.trim_start().starts_with("plan ")).count(), 1, "one plan line: {out}");
    let o = ratewall(&["explain", &rules, "--path", "/other", "-H", "x-user-id: u"]);
    assert!(stdout(&o).contains("does not match /v1/%1B[31mRED%0A"), "{}", stdout(&o));
    assert!(!stdout(&o).contains('\u{1b}'), "{}", stdout(&o));
}

/// `exact` is said of the rules the filter holds exact, and only with a store to wait for: not
/// of a shadow rule (it never rejects) or a concurrency rule (counted by its proxy alone).
#[test]
fn check_says_exact_only_of_rules_that_wait_for_the_global_counter() {
    let rules = |sync: bool| {
        let mut doc = json!({"rules": [
            {"name": "closed", "key": ["ip"], "on_store_failure": "closed", "limit": {"requests": 1, "per": "1s"}},
            {"name": "shadow", "key": ["ip"], "mode": "shadow", "exact": true, "limit": {"requests": 1, "per": "1s"}},
            {"name": "slots", "key": ["ip"], "on_store_failure": "closed", "limit": {"concurrent": 3}}]});
        if sync {
            doc["sync"] = json!({"cluster": "store", "secret": "0123456789abcdef"});
        }
        temp(if sync { "exact-sync.json" } else { "exact-local.json" }, &doc.to_string())
    };
    let o = ratewall(&["check", "--json", &rules(true)]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let exact: Vec<_> = v["rules"].as_array().unwrap().iter().map(|r| r["exact"].as_bool()).collect();
    assert_eq!(exact, [Some(true), Some(false), Some(false)], "{v}");
    let out = stdout(&ratewall(&["check", &rules(true)]));
    assert_eq!(out.matches("may wait for it").count(), 1, "{out}");
    assert!(out.contains("3 in flight (held at most 60s)"), "the default hold_max as documented: {out}");
    let out = stdout(&ratewall(&["check", &rules(false)]));
    assert!(!out.contains("may wait"), "no store to wait for: {out}");
}

/// A directory without a `.yaml` / `.yml` file holds no rate limit service configuration: not
/// a valid one of no domains. A rules document in it is named, to be checked as one.
#[test]
fn check_of_a_directory_without_a_configuration_fails() {
    let json = temp("no-yaml/rules.json", r#"{"rules": [{"name": "x"}]}"#);
    let dir = json.trim_end_matches("/rules.json").to_owned();
    let o = ratewall(&["check", &dir]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert_eq!(
        stderr(&o).trim_end(),
        format!("{dir}: no rate limit service configuration in it (no .yaml or .yml file); to check the rules document in it: ratewall check {json}")
    );
    let o = ratewall(&["check", "--json", &dir]);
    assert_eq!(o.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((v["valid"].as_bool(), v["errors"][0]["file"].as_str()), (Some(false), Some(dir.as_str())));
    std::fs::remove_file(&json).unwrap();
    let o = ratewall(&["check", &dir]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr(&o).trim_end(),
        format!("{dir}: no rate limit service configuration in it (no .yaml or .yml file)")
    );
}

#[test]
fn explain_shows_the_counter_key_the_core_uses_and_why_rules_do_not_apply() {
    let rules = root("examples/rules.json");
    let o = ratewall(&[
        "explain",
        "--json",
        &rules,
        "--method",
        "post",
        "--path",
        "/v1//events/42/./holds",
        "-H",
        "X-User-Id: alice",
        "--ip",
        "203.0.113.9",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["path"], "/v1/events/42/holds", "the path as normalized");
    let holds = &v["rules"][0];
    assert_eq!((holds["counted"].clone(), holds["key"].clone()), (json!(true), json!("user=alice")));
    // The counter key is the core's own for this request.
    let config = Config::parse(&std::fs::read(&rules).unwrap()).unwrap();
    let headers: Vec<Option<&[u8]>> =
        config.identity.headers.iter().map(|(d, _)| (d == "user").then_some(&b"alice"[..])).collect();
    let req = ratewall_core::Request {
        method: "POST",
        path: "/v1/events/42/holds",
        headers: &headers,
        ip: Some("203.0.113.9"),
    };
    let (checks, _) = config.checks(&req);
    assert_eq!(holds["counter"], ratewall_core::sync::hex(&checks[0].key));
    assert_eq!(v["rules"][1]["counted"], false);
    assert!(v["rules"][1]["why"].as_str().unwrap().contains("api_key"), "{v}");
    assert_eq!(v["rules"][2]["matches"], false);
    // Through a trusted proxy, the client is the address it appended.
    let o = ratewall(&[
        "explain",
        &rules,
        "--path",
        "/v1/auth/login",
        "-H",
        "x-forwarded-for: 198.51.100.7, 192.0.2.1",
        "--ip",
        "10.0.0.1",
    ]);
    let out = stdout(&o);
    assert!(out.contains("login-per-ip: key ip=192.0.2.1"), "{out}");
    let o = ratewall(&["explain", &rules, "--path", "/x", "-H", "no colon"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn replay_counts_on_the_logs_own_clock() {
    let rules = temp(
        "replay.json",
        r#"{"identity": {"user": {"header": "x-user-id"}},
            "rules": [{"name": "per-user", "key": ["user"], "limit": {"requests": 3, "per": "1m"}, "algorithm": "fixed_window"},
                      {"name": "watch", "key": ["user"], "mode": "shadow", "limit": {"requests": 1, "per": "1h"}}]}"#,
    );
    // Two users, 10 requests each a second apart in one minute, then one a minute later.
    let mut log = String::new();
    for i in 0..10 {
        for user in ["ann", "bob"] {
            log.push_str(&format!(
                "{{\"ts\": \"2026-12-01T10:00:{i:02}Z\", \"method\": \"GET\", \"path\": \"/a\", \"headers\": {{\"X-User-Id\": \"{user}\"}}}}\n"
            ));
        }
    }
    log.push_str("{\"ts\": 1796119260.5, \"path\": \"/a\", \"headers\": {\"x-user-id\": \"ann\"}}\n");
    log.push_str("{\"ts\": 1796119261, \"path\": \"/a\"}\n");
    let path = temp("log.jsonl", &log);
    let o = ratewall(&["replay", "--json", &rules, &path]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["requests"], 22);
    let r = &v["rules"][0];
    assert_eq!((r["allowed"].clone(), r["rejected"].clone(), r["unkeyed"].clone()), (json!(7), json!(14), json!(1)));
    assert_eq!(r["top_rejected_keys"], json!([{"key": "user=ann", "rejected": 7}, {"key": "user=bob", "rejected": 7}]));
    // The shadow rule never rejects: a rejected request counts for it what it saw.
    assert_eq!(v["rules"][1]["rejected"], 0);
    assert!(v["rules"][1]["shadow_rejected"].as_u64().unwrap() >= 4, "{v}");
    // A bad line is reported, with its number; the rest still counts.
    let path =
        temp("bad.jsonl", "{\"ts\": \"2026-12-01T10:00:00Z\", \"path\": \"/a\"}\nnot json\n{\"path\": \"/a\"}\n");
    let o = ratewall(&["replay", &rules, &path]);
    assert_eq!(o.status.code(), Some(0), "unreadable lines are reported, never fatal");
    assert!(stderr(&o).contains("bad.jsonl:2: not JSON"), "{}", stderr(&o));
    assert!(stderr(&o).contains("bad.jsonl:3: needs \"ts\""), "{}", stderr(&o));
    assert!(stdout(&o).contains("1 request replayed, 0 rejected (3 lines, 2 invalid;"), "{}", stdout(&o));
}

#[test]
fn replay_counts_the_requests_of_an_unlimited_plan_as_allowed() {
    let rules = root("examples/rules.json");
    let line = |ts: u64, plan: &str| {
        format!("{{\"ts\": {ts}, \"path\": \"/v1/items\", \"headers\": {{\"x-api-key\": \"k1\", \"x-plan\": \"{plan}\"}}}}\n")
    };
    let log: String =
        (0..3).map(|i| line(1_796_119_200 + i, "internal")).chain([line(1_796_119_203, "partner")]).collect();
    let log = temp("plans.jsonl", &log);
    let o = ratewall(&["replay", "--json", &rules, &log]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let api = &v["rules"][1];
    assert_eq!(api["name"], "api-key");
    assert_eq!(
        (api["allowed"].clone(), api["unlimited"].clone(), api["rejected"].clone(), api["unkeyed"].clone()),
        (json!(4), json!(3), json!(0), json!(0)),
        "{v}"
    );
    assert_eq!(v["rules"][0]["unlimited"], 0);
    let o = ratewall(&["replay", &rules, &log]);
    assert!(
        stdout(&o).contains("- api-key: allowed 4 (3 on an unlimited plan), rejected 0, unkeyed 0\n"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn secret_values_show_only_as_the_same_keyed_hash_in_explain_replay_and_the_core() {
    let doc = r#"{"identity": {"api_key": {"header": "x-api-key"}, "hash_key": "a deployment key, 16+"},
        "rules": [{"name": "k", "key": ["api_key"], "limit": {"requests": 1, "per": "1h"}}]}"#;
    let rules = temp("secret.json", doc);
    let config = Config::parse(doc.as_bytes()).unwrap();
    let headers: Vec<Option<&[u8]>> = vec![Some(b"sk_live_TOPSECRET")];
    let req = ratewall_core::Request { method: "GET", path: "/", headers: &headers, ip: None };
    let (checks, _) = config.checks(&req);
    let shown = ratewall_core::topk::render(&config, &checks[0].key).unwrap().1;
    assert!(shown.starts_with("api_key=#") && shown.len() == 17, "{shown}");
    let o = ratewall(&["explain", &rules, "--path", "/", "-H", "x-api-key: sk_live_TOPSECRET"]);
    let out = stdout(&o);
    assert!(out.contains(&shown) && !out.contains("TOPSECRET"), "{out}");
    let o = ratewall(&["explain", "--json", &rules, "--path", "/", "-H", "x-api-key: sk_live_TOPSECRET"]);
    assert!(!stdout(&o).contains("TOPSECRET") && !stdout(&o).contains(&ratewall_core::sync::hex(b"TOPSECRET")));
    let line = "{\"ts\": 1796119260, \"path\": \"/\", \"headers\": {\"x-api-key\": \"sk_live_TOPSECRET\"}}\n";
    let log = temp("secret.jsonl", &line.repeat(3));
    let o = ratewall(&["replay", "--json", &rules, &log]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["rules"][0]["top_rejected_keys"], json!([{"key": shown, "rejected": 2}]));
    assert!(!stdout(&o).contains("TOPSECRET"));
    let o = ratewall(&["check", &rules]);
    assert!(
        stdout(&o).contains("api_key (secret)") && stdout(&o).contains("keyed by identity.hash_key"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn a_secret_client_address_shows_in_explain_only_as_its_keyed_hash() {
    let rules = temp(
        "secret-ip.json",
        r#"{"identity": {"user": {"header": "x-user-id"}, "ip": {"secret": true}, "hash_key": "a deployment key, 16+"},
            "rules": [{"name": "per-ip", "key": ["ip"], "limit": {"requests": 1, "per": "1s"}}]}"#,
    );
    let args = ["explain", "--json", &rules, "--path", "/", "--ip", "198.51.100.7"];
    let o = ratewall(&args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let key = v["rules"][0]["key"].as_str().unwrap().to_owned();
    let hash = key.strip_prefix("ip=").unwrap();
    assert!(hash.starts_with('#') && hash.len() == 9, "{v}");
    assert_eq!(v["client_ip"], hash, "the address shows as the key shows it");
    assert!(!stdout(&o).contains("198.51.100"), "{}", stdout(&o));
    let o = ratewall(&["explain", &rules, "--path", "/", "--ip", "198.51.100.7"]);
    let out = stdout(&o);
    assert!(out.starts_with(&format!("GET / (client ip {hash})\n")), "{out}");
    assert!(!out.contains("198.51.100"), "{out}");
}

/// A Worker deployment whose rules set neither `identity.hash_key` nor `sync` keys its hashes
/// by its `RATEWALL_SYNC_SECRET` (else `RATEWALL_ADMIN_TOKEN`): given the same variable, the
/// CLI shows a value under that deployment's hash — the one filter nodes syncing to it with
/// that secret show.
#[test]
fn with_a_workers_secret_in_the_environment_the_cli_shows_that_deployments_hash() {
    let secret = "the deployment's sync secret";
    let rule = r#""rules": [{"name": "k", "key": ["api_key"], "limit": {"requests": 1, "per": "1h"}}]"#;
    let bare = temp("worker.json", &format!(r#"{{"identity": {{"api_key": {{"header": "x-api-key"}}}}, {rule}}}"#));
    let synced = temp(
        "synced.json",
        &format!(
            r#"{{"identity": {{"api_key": {{"header": "x-api-key"}}}}, {rule},
                "sync": {{"cluster": "store", "secret": "{secret}"}}}}"#
        ),
    );
    let shown = |o: Output| {
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(!stdout(&o).contains("TOPSECRET") && !stdout(&o).contains(secret));
        (v["rules"][0]["key"].clone(), v["rules"][0]["counter"].clone())
    };
    let args = |rules: &str| {
        ["explain", "--json", rules, "--path", "/", "-H", "x-api-key: sk_live_TOPSECRET"].map(str::to_owned)
    };
    let run =
        |env: &[(&str, &str)], rules: &str| shown(ratewall_with(env, &args(rules).each_ref().map(String::as_str)));
    let filter = run(&[], &synced);
    let builtin = run(&[], &bare);
    assert!(filter.0.as_str().is_some_and(|k| k.starts_with("api_key=#")), "{filter:?}");
    assert_ne!(filter, builtin);
    assert_eq!(run(&[("RATEWALL_SYNC_SECRET", secret)], &bare), filter);
    assert_eq!(run(&[("RATEWALL_ADMIN_TOKEN", secret)], &bare), filter);
    // The document's own key comes first, as in the Worker.
    assert_eq!(run(&[("RATEWALL_SYNC_SECRET", "another secret, 16+")], &synced), filter);
    // `check` names where the key came from: the environment, not a `sync.secret` the
    // document does not have.
    let checked = |env: &[(&str, &str)], rules: &str| stdout(&ratewall_with(env, &["check", rules]));
    let said = checked(&[("RATEWALL_SYNC_SECRET", secret)], &bare);
    assert!(said.contains("keyed by the environment's RATEWALL_SYNC_SECRET") && !said.contains(secret), "{said}");
    assert!(checked(&[], &synced).contains("keyed by sync.secret"));
}

/// A rate limit service configuration's secret values are shown by their hash under the
/// deployment's key; without it in the environment, `check` says the built-in key shows them.
#[test]
fn check_of_a_rate_limit_service_configuration_says_when_its_hashes_are_the_built_in_keys() {
    let yaml = temp(
        "secret-rls.yaml",
        "domain: api\ndescriptors:\n  - key: api_key\n    value: sk_live_WRITTEN\n    rate_limit: {unit: minute, requests_per_unit: 3}\n",
    );
    let bare = ratewall(&["check", &yaml]);
    assert_eq!(bare.status.code(), Some(0), "{}", stderr(&bare));
    assert!(stderr(&bare).contains("built-in key"), "{}", stderr(&bare));
    let keyed = ratewall_with(&[("RATEWALL_SYNC_SECRET", "the deployment's sync secret")], &["check", &yaml]);
    assert!(!stderr(&keyed).contains("built-in key"), "{}", stderr(&keyed));
    assert_ne!(stdout(&bare), stdout(&keyed));
    for o in [&bare, &keyed] {
        assert!(!stdout(o).contains("WRITTEN") && !stderr(o).contains("WRITTEN"));
    }
}

#[test]
fn replay_reads_a_log_on_standard_input() {
    let rules = root("examples/rules.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratewall"))
        .args(["replay", "--json", &rules, "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    for i in 0..12 {
        writeln!(stdin, "{{\"ts\": {}, \"path\": \"/v1/auth/login\", \"ip\": \"198.51.100.4\"}}", 1_796_119_200 + i)
            .unwrap();
    }
    drop(stdin);
    let o = child.wait_with_output().unwrap();
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let login = v["rules"].as_array().unwrap().iter().find(|r| r["name"] == "login-per-ip").unwrap().clone();
    assert_eq!((login["allowed"].clone(), login["rejected"].clone()), (json!(10), json!(2)));
}

/// Runs `ratewall` with `input` on its standard input.
fn ratewall_fed(args: &[&str], input: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratewall"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A command that refuses its arguments exits before it reads (`replay - -`): the pipe may
    // be closed by then, which its exit code, not this write, says.
    let _ = child.stdin.take().unwrap().write_all(input);
    child.wait_with_output().unwrap()
}

#[test]
fn check_and_explain_read_a_rules_document_on_standard_input() {
    let rules = std::fs::read(root("examples/rules.json")).unwrap();
    let from_file = ratewall(&["check", "--json", &root("examples/rules.json")]);
    let piped = ratewall_fed(&["check", "--json", "-"], &rules);
    assert_eq!(piped.status.code(), Some(0), "{}", stderr(&piped));
    assert_eq!(stdout(&piped), stdout(&from_file));
    // A pipe by its path (`ratewall check <(kubectl ...)`) is read once.
    let by_path = ratewall_fed(&["check", "--json", "/dev/stdin"], &rules);
    assert_eq!(by_path.status.code(), Some(0), "{}", stderr(&by_path));
    assert_eq!(stdout(&by_path), stdout(&from_file));
    let bad = ratewall_fed(&["check", "-"], br#"{"rules": [{"name": "x"}]}"#);
    assert_eq!(bad.status.code(), Some(1));
    assert!(stderr(&bad).contains("rules[0]"), "{}", stderr(&bad));
    let explained = ratewall_fed(&["explain", "-", "--path", "/v1/auth/login", "--ip", "198.51.100.4"], &rules);
    assert_eq!(explained.status.code(), Some(0), "{}", stderr(&explained));
    assert!(stdout(&explained).contains("login-per-ip"), "{}", stdout(&explained));
    // One standard input cannot be both.
    let both = ratewall_fed(&["replay", "-", "-"], &rules);
    assert_eq!(both.status.code(), Some(2));
    assert!(stderr(&both).contains("both be standard input"), "{}", stderr(&both));
}

#[test]
fn schema_prints_the_committed_schema() {
    let o = ratewall(&["schema"]);
    assert_eq!(o.status.code(), Some(0));
    let printed: Value = serde_json::from_slice(&o.stdout).unwrap();
    let committed: Value = serde_json::from_str(&std::fs::read_to_string(root("rules.schema.json")).unwrap()).unwrap();
    assert_eq!(printed, committed);
    assert_eq!(printed["$schema"], "https://json-schema.org/draft/2020-12/schema");
}

fn validator() -> jsonschema::Validator {
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(root("rules.schema.json")).unwrap()).unwrap();
    jsonschema::draft202012::new(&schema).unwrap()
}

/// Documents the parser accepts, covering every field.
fn good_documents() -> Vec<Value> {
    let mut docs: Vec<Value> = vec![
        serde_json::from_str(&std::fs::read_to_string(root("examples/rules.json")).unwrap()).unwrap(),
        json!({"rules": []}),
        json!({"$schema": "./rules.schema.json", "rules": [{"name": "a", "key": ["user"], "limit": {"requests": 1, "per": "1s"}}]}),
        json!({
            "identity": {"user": {"header": "x-user-id"}, "plan": {"header": "X-Plan"}, "ip": {"trusted_hops": 2, "ipv6_prefix": 56, "ipv4_prefix": 24}},
            "rules": [
                {"name": "a.b-c_d", "description": "every field", "match": {"path": "/v1/**/x/*.json", "method": ["get", "POST"]},
                 "key": ["user", "ip"], "limit": {"requests": 10, "per": "100ms", "burst": 20, "algorithm": "token_bucket"},
                 "plans": {"gold": {"requests": 100, "per": "1h"}, "free": "unlimited"}, "cost": 2, "mode": "shadow", "on_store_failure": "closed"},
                {"name": "log", "match": {"method": "DELETE"}, "key": ["ip"], "algorithm": "sliding_log", "limit": {"requests": 5, "per": "2d"}},
                {"name": "fw", "key": ["plan"], "limit": {"requests": 5, "per": "45m", "algorithm": "fixed_window"}, "cost": 0}
            ],
            "response": {"legacy_headers": true},
            "filter": {"slots": 4096, "cas_retries": 8, "hash_seed": "s3cret"},
            "sync": {"cluster": "store", "authority": "store.example", "path": "/v1/sync", "secret": "0123456789abcdef",
                     "interval": "200ms", "timeout": "80ms", "nodes": 12, "stale_after": "2s", "max_wait": "20ms"}
        }),
    ];
    for cluster in ["127.0.0.1:8090", "ratewall-store.internal:80", "[::1]:8090", "outbound|8090||store.svc"] {
        docs.push(json!({"rules": [], "sync": {"cluster": cluster, "secret": "0123456789abcdef"}}));
    }
    for algorithm in ["token_bucket", "sliding_window", "fixed_window", "sliding_log", "leaky_bucket"] {
        docs.push(json!({"rules": [{"name": "r", "key": ["api_key"], "algorithm": algorithm, "limit": {"requests": 7, "per": "7s"}}],
                         "filter": {"hash_seed": 42}}));
    }
    docs
}

#[test]
fn every_document_the_parser_accepts_the_schema_accepts() {
    let v = validator();
    for doc in good_documents() {
        Config::parse(doc.to_string().as_bytes()).unwrap_or_else(|e| panic!("the parser refused {doc}: {e}"));
        let errors: Vec<String> = v.iter_errors(&doc).map(|e| format!("{e} at {}", e.instance_path)).collect();
        assert!(errors.is_empty(), "the schema refused {doc}: {errors:?}");
    }
}

/// A document of one rule: `name` r keyed on `user` with `rule`'s fields (the default identity).
fn one_rule(rule: Value) -> Value {
    let mut r = json!({"name": "r", "key": ["user"]});
    r.as_object_mut().unwrap().extend(rule.as_object().unwrap().clone());
    json!({"rules": [r]})
}

/// Documents at the edges of what the parser takes: each algorithm's burst and delay, a
/// rule's algorithm under its limits' own, the largest numbers.
fn edge_documents() -> Vec<Value> {
    let mut docs = vec![
        one_rule(json!({"limit": {"requests": 5, "per": "1s", "burst": 10, "delay": 3, "algorithm": "leaky_bucket"}})),
        one_rule(json!({"limit": {"requests": 5, "per": "1s", "burst": 0, "delay": 0, "algorithm": "leaky_bucket"}})),
        one_rule(
            json!({"limit": {"requests": 5, "per": "1s", "burst": 4_294_967_294_u64}, "algorithm": "leaky_bucket"}),
        ),
        one_rule(json!({"limit": {"requests": 5, "per": "060s", "burst": 1, "delay": 0}})),
        one_rule(json!({"limit": {"requests": 5, "per": "1s", "delay": 0, "algorithm": "sliding_window"}})),
        one_rule(json!({"limit": {"requests": 10000, "per": "1d"}, "algorithm": "sliding_log",
                        "plans": {"gold": {"requests": 100_000, "per": "1s", "burst": 9, "algorithm": "token_bucket"},
                                  "free": "unlimited", "trial": {"requests": 10000, "per": "1h"}}})),
        one_rule(
            json!({"limit": {"requests": 100, "per": "1m"}, "algorithm": "fixed_window", "plans": {"free": "unlimited"}}),
        ),
        one_rule(json!({"limit": {"concurrent": 10000, "hold_max": "1h"}, "plans": {"gold": {"concurrent": 1}}})),
        one_rule(json!({"limit": {"requests": 4_294_967_295_u64, "per": "1s"}, "cost": 4_294_967_295_u64})),
        one_rule(json!({"limit": {"requests": 1, "per": "1s"}, "match": {"path": format!("/{}", "a".repeat(1023))}})),
        one_rule(json!({"limit": {"requests": 1, "per": "1s"}, "key": ["user", "api_key", "partner", "plan", "ip"]})),
    ];
    let mut seeded = one_rule(json!({"limit": {"requests": 1, "per": "1s"}}));
    set(&mut seeded, "/filter/hash_seed", json!(u64::MAX));
    docs.push(seeded);
    docs
}

#[test]
fn the_schema_takes_what_the_parser_takes_at_the_edges() {
    let v = validator();
    for doc in edge_documents() {
        Config::parse(doc.to_string().as_bytes()).unwrap_or_else(|e| panic!("the parser refused {doc}: {e}"));
        let errors: Vec<String> = v.iter_errors(&doc).map(|e| format!("{e} at {}", e.instance_path)).collect();
        assert!(errors.is_empty(), "the schema refused {doc}: {errors:?}");
    }
}

#[test]
fn the_schema_refuses_what_the_parser_refuses_of_algorithms_durations_and_bounds() {
    let v = validator();
    let limit = |l: Value| one_rule(json!({"limit": l}));
    let mut cases: Vec<(&str, Value)> = vec![
        ("a zero per", limit(json!({"requests": 1, "per": "0s"}))),
        ("a zero per in ms", limit(json!({"requests": 1, "per": "0ms"}))),
        ("a zero per of zeros", limit(json!({"requests": 1, "per": "000m"}))),
        ("a zero hold_max", limit(json!({"concurrent": 1, "hold_max": "0s"}))),
        ("a query in a path", one_rule(json!({"limit": {"requests": 1, "per": "1s"}, "match": {"path": "/a?b"}}))),
        ("a fragment in a path", one_rule(json!({"limit": {"requests": 1, "per": "1s"}, "match": {"path": "/a#b"}}))),
        (
            "a path over 1,024 bytes",
            one_rule(
                json!({"limit": {"requests": 1, "per": "1s"}, "match": {"path": format!("/{}", "a".repeat(1024))}}),
            ),
        ),
        (
            "a cost over 4,294,967,295",
            one_rule(json!({"limit": {"requests": 1, "per": "1s"}, "cost": 4_294_967_296_u64})),
        ),
        ("burst over 4,294,967,295", limit(json!({"requests": 1, "per": "1s", "burst": 4_294_967_296_u64}))),
        (
            "a leaky bucket's burst of 4,294,967,295",
            limit(json!({"requests": 1, "per": "1s", "burst": 4_294_967_295_u64, "algorithm": "leaky_bucket"})),
        ),
        ("sliding_log over 10,000", limit(json!({"requests": 10001, "per": "1s", "algorithm": "sliding_log"}))),
        (
            "a rule's sliding_log over 10,000",
            one_rule(json!({"limit": {"requests": 10001, "per": "1s"}, "algorithm": "sliding_log"})),
        ),
        (
            "a plan's sliding_log over 10,000",
            one_rule(
                json!({"limit": {"requests": 1, "per": "1s"}, "algorithm": "sliding_log", "plans": {"gold": {"requests": 10001, "per": "1s"}}}),
            ),
        ),
        (
            "burst with sliding_window",
            limit(json!({"requests": 1, "per": "1s", "burst": 2, "algorithm": "sliding_window"})),
        ),
        (
            "burst 0 with sliding_window",
            limit(json!({"requests": 1, "per": "1s", "burst": 0, "algorithm": "sliding_window"})),
        ),
        (
            "burst with a rule's fixed_window",
            one_rule(json!({"limit": {"requests": 1, "per": "1s", "burst": 2}, "algorithm": "fixed_window"})),
        ),
        (
            "burst in a plan of a rule's sliding_log",
            one_rule(
                json!({"limit": {"requests": 1, "per": "1s"}, "algorithm": "sliding_log", "plans": {"gold": {"requests": 1, "per": "1s", "burst": 3}}}),
            ),
        ),
        (
            "delay with token_bucket",
            limit(json!({"requests": 1, "per": "1s", "burst": 5, "delay": 1, "algorithm": "token_bucket"})),
        ),
        ("delay without an algorithm", limit(json!({"requests": 1, "per": "1s", "delay": 1}))),
        ("delay with a burst and no algorithm", limit(json!({"requests": 1, "per": "1s", "burst": 5, "delay": 1}))),
        (
            "delay with a rule's fixed_window",
            one_rule(json!({"limit": {"requests": 1, "per": "1s", "delay": 2}, "algorithm": "fixed_window"})),
        ),
        ("burst 0 without an algorithm", limit(json!({"requests": 1, "per": "1s", "burst": 0}))),
        (
            "burst 0 with a rule's token_bucket",
            one_rule(json!({"limit": {"requests": 1, "per": "1s", "burst": 0}, "algorithm": "token_bucket"})),
        ),
        (
            "a concurrent limit under a rule's algorithm",
            one_rule(json!({"limit": {"concurrent": 1}, "algorithm": "token_bucket"})),
        ),
        (
            "a concurrent plan under a rule's algorithm",
            one_rule(
                json!({"limit": {"requests": 1, "per": "1s"}, "algorithm": "sliding_window", "plans": {"gold": {"concurrent": 1}}}),
            ),
        ),
        (
            "a key dimension the default identity has not",
            one_rule(json!({"limit": {"requests": 1, "per": "1s"}, "key": ["nobody"]})),
        ),
    ];
    let mut hash_key = one_rule(json!({"limit": {"requests": 1, "per": "1s"}, "key": ["hash_key"]}));
    set(&mut hash_key, "/identity", json!({"user": {"header": "x-user-id"}, "hash_key": "sixteen chars at least"}));
    cases.push(("hash_key as a key dimension", hash_key));
    let mut no_plan = one_rule(json!({"limit": {"requests": 1, "per": "1s"}, "plans": {"gold": "unlimited"}}));
    set(&mut no_plan, "/identity", json!({"user": {"header": "x-user-id"}}));
    cases.push(("plans without a plan dimension", no_plan));
    let mut seeded = one_rule(json!({"limit": {"requests": 1, "per": "1s"}}));
    set(&mut seeded, "/filter/hash_seed", json!(-1));
    cases.push(("a negative hash_seed", seeded));
    let mut synced = one_rule(json!({"limit": {"requests": 1, "per": "1s"}}));
    set(&mut synced, "/sync", json!({"cluster": "store", "secret": "0123456789abcdef", "interval": "0ms"}));
    cases.push(("a zero sync interval", synced));
    for (what, doc) in cases {
        assert!(Config::parse(doc.to_string().as_bytes()).is_err(), "the parser accepted {what}: {doc}");
        assert!(!v.is_valid(&doc), "the schema accepted {what}: {doc}");
    }
}

/// Sets `doc` at a JSON pointer (creating objects on the way).
fn set(doc: &mut Value, pointer: &str, value: Value) {
    let mut at = doc;
    let parts: Vec<&str> = pointer.trim_start_matches('/').split('/').collect();
    for (i, p) in parts.iter().enumerate() {
        let last = i == parts.len() - 1;
        at = match at {
            Value::Array(a) => &mut a[p.parse::<usize>().unwrap()],
            Value::Object(o) if last => {
                o.insert((*p).to_owned(), value);
                return;
            }
            Value::Object(o) => o.entry((*p).to_owned()).or_insert(json!({})),
            _ => panic!("{pointer}"),
        };
    }
    *at = value;
}

#[test]
fn wrong_types_unknown_fields_and_bad_durations_are_rejected_by_both() {
    let v = validator();
    let base = good_documents()[3].clone();
    let mut cases: Vec<(String, Value)> = Vec::new();
    // Wrong types.
    for (ptr, bad) in [
        ("/rules", json!({})),
        ("/rules/0/name", json!(7)),
        ("/rules/0/key", json!("user")),
        ("/rules/0/limit/requests", json!("10")),
        ("/rules/0/limit/requests", json!(1.5)),
        ("/rules/0/limit/burst", json!(true)),
        ("/rules/0/cost", json!(-1)),
        ("/rules/0/mode", json!("loud")),
        ("/rules/0/on_store_failure", json!(false)),
        ("/rules/0/match/method", json!(3)),
        ("/rules/0/algorithm", json!("leaky")),
        ("/identity/ip/trusted_hops", json!(-1)),
        ("/identity/user/header", json!(["x"])),
        ("/identity/hash_key", json!({"header": "x-h"})),
        ("/$schema", json!(5)),
        ("/response/legacy_headers", json!("yes")),
        ("/filter/slots", json!(10)),
        ("/sync/nodes", json!(0)),
        ("/sync/secret", json!("short")),
        // Clusters ngx_wasm_module could not parse in a call, and no Envoy cluster name.
        ("/sync/cluster", json!("https://store")),
        ("/sync/cluster", json!("store:80x")),
        ("/sync/cluster", json!("store:70000")),
        ("/sync/cluster", json!("::1:8090")),
        ("/sync/cluster", json!("my store")),
        // A path that is not one.
        ("/sync/path", json!("v1/sync")),
        ("/sync/path", json!("")),
    ] {
        let mut d = base.clone();
        set(&mut d, ptr, bad.clone());
        cases.push((format!("{ptr} = {bad}"), d));
    }
    // Unknown fields, at every level.
    for ptr in [
        "/extra",
        "/rules/0/extra",
        "/rules/0/limit/extra",
        "/rules/0/match/extra",
        "/identity/ip/extra",
        "/identity/user/extra",
        "/response/extra",
        "/filter/extra",
        "/sync/extra",
        "/rules/0/plans/gold/extra",
    ] {
        let mut d = base.clone();
        set(&mut d, ptr, json!(1));
        cases.push((format!("{ptr} (unknown)"), d));
    }
    // Bad durations.
    for bad in ["60", "1 s", "1sec", "s", "-1s", "1.5s", "1S", ""] {
        for ptr in ["/rules/0/limit/per", "/sync/interval", "/sync/max_wait"] {
            let mut d = base.clone();
            set(&mut d, ptr, json!(bad));
            cases.push((format!("{ptr} = {bad:?}"), d));
        }
    }
    // Missing required fields.
    for ptr in ["/rules/0/name", "/rules/0/key", "/rules/0/limit", "/rules/0/limit/per", "/sync/cluster"] {
        let mut d = base.clone();
        let (parent, field) = ptr.rsplit_once('/').unwrap();
        d.pointer_mut(parent).unwrap().as_object_mut().unwrap().remove(field);
        cases.push((format!("{ptr} missing"), d));
    }
    assert!(cases.len() >= 50);
    for (what, doc) in cases {
        assert!(Config::parse(doc.to_string().as_bytes()).is_err(), "the parser accepted {what}");
        assert!(!v.is_valid(&doc), "the schema accepted {what}");
    }
}

/// A document whose identity has `headers` header dimensions (and `ip`, `hash_key` when
/// asked), with one rule keyed on all of its dimensions.
fn with_dimensions(headers: usize, ip: bool, hash_key: bool) -> Value {
    let mut identity = serde_json::Map::new();
    let mut key: Vec<Value> = Vec::new();
    for i in 0..headers {
        identity.insert(format!("d{i}"), json!({"header": format!("x-d{i}")}));
        key.push(json!(format!("d{i}")));
    }
    if ip {
        identity.insert("ip".to_owned(), json!({"trusted_hops": 1}));
        key.push(json!("ip"));
    }
    if hash_key {
        identity.insert("hash_key".to_owned(), json!("sixteen chars at least"));
    }
    json!({"identity": identity, "rules": [{"name": "r", "key": key, "limit": {"requests": 1, "per": "1s"}}]})
}

#[test]
fn the_schema_counts_identity_dimensions_and_key_parts_as_the_parser_does() {
    let v = validator();
    for (ip, hash_key) in [(false, false), (true, false), (false, true), (true, true)] {
        let most = with_dimensions(64, ip, hash_key);
        assert!(Config::parse(most.to_string().as_bytes()).is_ok(), "ip {ip}, hash_key {hash_key}");
        let errors: Vec<String> = v.iter_errors(&most).map(|e| format!("{e} at {}", e.instance_path)).collect();
        assert!(errors.is_empty(), "ip {ip}, hash_key {hash_key}: {errors:?}");
        let over = with_dimensions(65, ip, hash_key);
        assert!(Config::parse(over.to_string().as_bytes()).is_err(), "ip {ip}, hash_key {hash_key}");
        assert!(!v.is_valid(&over), "ip {ip}, hash_key {hash_key}");
    }
    // A key of every dimension: 64 headers and ip.
    assert_eq!(with_dimensions(64, true, false)["rules"][0]["key"].as_array().map(Vec::len), Some(65));
}

#[test]
fn check_of_a_rate_limit_service_file_shows_what_the_service_would_not_read() {
    let yaml = temp(
        "warned.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      shadow_mode: true\n  - key: b\n    rate_limit:\n      unlimited: true\n",
    );
    let o = ratewall(&["check", &yaml]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("`rate_limit.shadow_mode` is not read here"), "{}", stderr(&o));
    assert!(stdout(&o).contains("- d.b: unlimited\n"), "{}", stdout(&o));
    let o = ratewall(&["check", "--json", &yaml]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["warnings"][0]["line"], 3, "{v}");
    assert!(v["warnings"][0]["reason"].as_str().unwrap().contains("shadow_mode"), "{v}");
}

#[test]
fn a_malformed_header_argument_is_refused_without_echoing_its_value() {
    let rules = root("examples/rules.json");
    let o =
        ratewall(&["explain", &rules, "--path", "/v1/x", "-H", "x-user-id: a", "-H", "x-api-key sk_live_0123456789"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("header argument 2"), "{}", stderr(&o));
    assert!(!stderr(&o).contains("sk_live"), "{}", stderr(&o));
}

#[test]
fn explain_refuses_an_ip_that_is_no_address_and_a_method_that_is_none() {
    let rules = root("examples/rules.json");
    // An IP that is no address, nor a method no client sends.
    let refused = [
        ("--ip", &["203.0.113.300", "localhost", "2001:db8::1::2"][..], "not an IP address"),
        ("--method", &["G T", "", "GET/1", "G(T"][..], "not an HTTP method"),
    ];
    for (flag, values, why) in refused {
        for value in values {
            let o = ratewall(&["explain", &rules, "--path", "/v1/auth/login", flag, value]);
            assert_eq!(o.status.code(), Some(2), "{flag} {value:?}: {}", stdout(&o));
            assert!(stderr(&o).contains(why), "{flag} {value:?}: {}", stderr(&o));
        }
    }
    // A header no request could carry (a space in its name, a line break or another control
    // character in its value; the value not echoed).
    for header in ["x user: v", "x-api-key: SECRET\nZZ", "x-api-key: SECRET\u{1}", "x-api-key: SECRET\r"] {
        let o = ratewall(&["explain", &rules, "--path", "/v1/auth/login", "-H", header]);
        assert_eq!(o.status.code(), Some(2), "{header:?}: {}", stdout(&o));
        assert!(!stderr(&o).contains("SECRET"), "{}", stderr(&o));
    }
    let o = ratewall(&["explain", &rules, "--path", "/v1/auth/login", "-H", "x-api-key: a\tb"]);
    assert_eq!(o.status.code(), Some(0), "a tab is a value's: {}", stderr(&o));
    // A target that is not a path, as replay refuses it in a log; an absolute URI's path is matched.
    let o = ratewall(&["explain", &rules, "--path", "v1/auth/login"]);
    assert_eq!(o.status.code(), Some(2), "{}", stdout(&o));
    assert!(stderr(&o).contains("not a path"), "{}", stderr(&o));
    let o = ratewall(&["explain", &rules, "--path", "https://api.example.com/v1/auth/login"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).starts_with("GET /v1/auth/login "), "{}", stdout(&o));
    let o = ratewall(&["explain", &rules, "--path", "/v1/auth/login", "--ip", "2001:db8::1"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("key ip=2001:db8::/64"), "{}", stdout(&o));
    let o = ratewall(&["explain", &rules, "--path", "/v1/auth/login", "--method", "post"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn explain_names_the_plan_whose_limit_is_in_force() {
    let rules = root("examples/rules.json");
    let explain = |plan: &str, json: bool| {
        let header = format!("x-plan: {plan}");
        let mut args = vec!["explain", &rules, "--path", "/v1/items", "-H", "x-api-key: k1", "-H", &header];
        if json {
            args.insert(1, "--json");
        }
        let o = ratewall(&args);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        o
    };
    let api = |plan: &str| {
        let v: Value = serde_json::from_slice(&explain(plan, true).stdout).unwrap();
        v["rules"][1].clone()
    };
    assert_eq!(
        (api("partner")["plan"].clone(), api("partner")["limit"]["requests"].clone()),
        (json!("partner"), json!(10000))
    );
    assert_eq!((api("gold")["plan"].clone(), api("gold")["limit"]["requests"].clone()), (json!(null), json!(1000)));
    let internal = api("internal");
    assert_eq!((internal["counted"].clone(), internal["plan"].clone()), (json!(false), json!("internal")));
    assert_eq!(internal["why"], "its plan \"internal\" is unlimited under this rule");
    let text = |plan: &str| stdout(&explain(plan, false));
    assert!(
        text("partner").contains(", plan \"partner\" limit 10000 per 60s (sliding_window)\n"),
        "{}",
        text("partner")
    );
    assert!(text("gold").contains(", default limit 1000 per 60s (token_bucket, burst 200)\n"), "{}", text("gold"));
    assert_eq!(api("partner")["limit"]["per"], "60s", "per as the plan writes it");
    assert_eq!(api("gold")["limit"]["per"], "60s");
    assert!(text("internal").contains("skips     api-key: its plan \"internal\" is unlimited"), "{}", text("internal"));
}

#[test]
fn explain_text_says_a_rules_cost_and_shadow_mode() {
    let rules = temp(
        "cost.json",
        r#"{"identity": {"user": {"header": "x-user-id"}},
            "rules": [{"name": "heavy", "key": ["user"], "cost": 5, "limit": {"requests": 10, "per": "1s"}},
                      {"name": "trial", "key": ["user"], "mode": "shadow", "limit": {"requests": 1, "per": "1s"}},
                      {"name": "slots", "key": ["user"], "limit": {"concurrent": 2}},
                      {"name": "hourly", "key": ["user"], "limit": {"requests": 100, "per": "3600s", "algorithm": "fixed_window"}}]}"#,
    );
    let o = ratewall(&["explain", &rules, "--path", "/x", "-H", "x-user-id: u"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("heavy: key user=u, limit 10 per 1s (sliding_window), cost 5\n"), "{out}");
    assert!(
        out.contains("slots: key user=u, limit 2 in flight (held at most 60s)\n"),
        "a default hold_max, as documented: {out}"
    );
    assert!(out.contains("hourly: key user=u, limit 100 per 3600s (fixed_window)\n"), "{out}");
    assert!(out.contains("trial: key user=u, limit 1 per 1s (sliding_window) (shadow: never rejects)\n"), "{out}");
}

#[test]
fn output_that_cannot_be_written_is_a_failure_and_never_a_panic() {
    let full = || std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_ratewall")).arg("schema").stdout(full()).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "a schema lost to a full disk is no success: {}", stderr(&o));
    assert!(stderr(&o).contains("cannot write the output"), "{}", stderr(&o));
    let bad = temp(
        "unwritable.json",
        r#"{"rules": [{"name": "a", "key": ["ip"], "limit": {"requests": 5, "per": "6O s"}}]}"#,
    );
    let o = Command::new(env!("CARGO_BIN_EXE_ratewall")).args(["check", &bad]).stderr(full()).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "the document's verdict stands when its reasons cannot be written");
}

#[test]
fn replay_reads_an_absolute_form_request_as_its_path_and_cuts_long_keys_as_the_proxy_shows_them() {
    let rules = temp(
        "absolute.json",
        r#"{"identity": {"user": {"header": "x-user-id"}},
            "rules": [{"name": "abs", "match": {"path": "/v1/abs"}, "key": ["ip"], "limit": {"requests": 1, "per": "1m"}},
                      {"name": "long", "match": {"path": "/long"}, "key": ["user"], "limit": {"requests": 1, "per": "1m"}}]}"#,
    );
    // As NGINX's `$request` logs a request sent to a forward proxy.
    let line = |target: &str| {
        format!("192.0.2.1 - - [01/Dec/2026:10:00:00 +0000] \"GET {target} HTTP/1.1\" 200 3 \"-\" \"-\"\n")
    };
    let log = temp("absolute.log", &(line("http://example.com/v1/abs?x=1") + &line("HTTP://example.com:8080/v1/abs")));
    let o = ratewall(&["replay", "--json", &rules, &log]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((v["rules"][0]["allowed"].clone(), v["rules"][0]["rejected"].clone()), (json!(1), json!(1)), "{v}");
    let o = ratewall(&["explain", "--json", &rules, "--path", "http://example.com/v1/abs", "--ip", "192.0.2.1"]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["path"], "/v1/abs", "{v}");
    // A shown key over 160 bytes ends in `…#hash`, in the replay's report and in explain.
    let user = "u".repeat(200);
    let log = temp(
        "long.jsonl",
        &format!("{{\"ts\": 1796119200, \"path\": \"/long\", \"headers\": {{\"x-user-id\": \"{user}\"}}}}\n").repeat(2),
    );
    let o = ratewall(&["replay", "--json", &rules, &log]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let shown = v["rules"][1]["top_rejected_keys"][0]["key"].as_str().unwrap().to_owned();
    assert!(shown.len() <= ratewall_core::topk::MAX_KEY && shown.starts_with("user=uuu"), "{shown}");
    assert!(shown.contains("…#"), "{shown}");
    let header = format!("x-user-id: {user}");
    let o = ratewall(&["explain", &rules, "--path", "/long", "-H", &header]);
    assert!(stdout(&o).contains(&shown), "explain shows the key as the replay does: {}", stdout(&o));
}

/// `explain` and `replay` given a rate limit service configuration say what it is and which
/// command reads it (they said "not valid JSON" at its first byte).
#[test]
fn explain_and_replay_name_a_rate_limit_service_configuration_as_such() {
    let yaml = root("examples/ratelimit-config.yaml");
    let log = temp("rls-named.log", "");
    for args in [vec!["explain", &yaml, "--path", "/v1/x"], vec!["replay", &yaml, &log]] {
        let o = ratewall(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = stderr(&o);
        assert!(err.contains("reads as a rate limit service configuration") && err.contains("ratewall check"), "{err}");
    }
}
