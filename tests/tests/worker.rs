//! The Worker in real workerd (`wrangler dev --local` from wrangler.toml, the built
//! `dist/worker/`): limits, plans, composite keys, multi-rule no-charge, headers parsed back
//! with a Structured Fields parser, shadow, hot-reloaded rules, restarts, and `/v1/sync`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_core::sync::{hex, sign, unhex, verify, Delta, SyncRequest, SyncResponse};
use ratewall_core::{Config, Request};
use ratewall_tests::conformance::wall_clock;
use ratewall_tests::http::Response;
use ratewall_tests::workerd::Workerd;
use sfv::{BareItem, Parser};
use std::time::Duration;

const RULES: &str = r#"{
  "identity": {
    "user": {"header": "x-user-id"}, "api_key": {"header": "x-api-key"},
    "partner": {"header": "x-partner-id"}, "plan": {"header": "x-plan"},
    "ip": {"trusted_hops": 1, "ipv6_prefix": 64}
  },
  "rules": [
    {"name": "user", "match": {"path": "/u/*"}, "key": ["user"], "limit": {"requests": 3, "per": "60s"}},
    {"name": "ip", "match": {"path": "/ip/*"}, "key": ["ip"], "limit": {"requests": 3, "per": "60s"}},
    {"name": "key", "match": {"path": "/k/*"}, "key": ["api_key"], "limit": {"requests": 2, "per": "60s"},
     "plans": {"partner": {"requests": 5, "per": "60s"}, "internal": "unlimited"}},
    {"name": "partner", "match": {"path": "/p/*"}, "key": ["partner"], "limit": {"requests": 3, "per": "1h"}},
    {"name": "combo", "match": {"path": "/c/*"}, "key": ["api_key", "ip"], "limit": {"requests": 2, "per": "60s"}},
    {"name": "roomy", "match": {"path": "/m/*"}, "key": ["user"], "limit": {"requests": 5, "per": "60s"}},
    {"name": "tight", "match": {"path": "/m/*", "method": "POST"}, "key": ["user"], "limit": {"requests": 1, "per": "60s"}},
    {"name": "watch", "match": {"path": "/s/*"}, "key": ["user"], "mode": "shadow", "limit": {"requests": 1, "per": "60s"}},
    {"name": "bucket", "match": {"path": "/tb/*"}, "key": ["user"], "limit": {"requests": 60, "per": "60s", "burst": 2}},
    {"name": "strict", "match": {"path": "/cl/*"}, "key": ["user"], "on_store_failure": "closed", "limit": {"requests": 3, "per": "60s"}},
    {"name": "shape", "match": {"path": "/q/*"}, "key": ["user"], "limit": {"requests": 5, "per": "1s", "burst": 5, "algorithm": "leaky_bucket"}},
    {"name": "flight", "match": {"path": "/f/*"}, "key": ["user"], "limit": {"concurrent": 2, "hold_max": "30s"}},
    {"name": "window", "match": {"path": "/fw/*"}, "key": ["user"], "algorithm": "fixed_window", "limit": {"requests": 3, "per": "2s"}},
    {"name": "denials", "match": {"path": "/dn/*"}, "key": ["user"], "limit": {"requests": 2, "per": "60s"}},
    {"name": "refill", "match": {"path": "/tb3/*"}, "key": ["user"], "limit": {"requests": 1, "per": "3s", "burst": 3}},
    {"name": "burst-sw", "match": {"path": "/bs/*"}, "key": ["user"], "limit": {"requests": 100, "per": "60s"}},
    {"name": "burst-tb", "match": {"path": "/bt/*"}, "key": ["user"], "limit": {"requests": 100, "per": "60s", "burst": 100}},
    {"name": "burst-fw", "match": {"path": "/bf/*"}, "key": ["user"], "algorithm": "fixed_window", "limit": {"requests": 100, "per": "60s"}},
    {"name": "burst-sl", "match": {"path": "/bl/*"}, "key": ["user"], "algorithm": "sliding_log", "limit": {"requests": 100, "per": "60s"}},
    {"name": "log5", "match": {"path": "/sl5/*"}, "key": ["user"], "algorithm": "sliding_log", "limit": {"requests": 5, "per": "3s"}},
    {"name": "log10x2", "match": {"path": "/sl10/*"}, "key": ["user"], "algorithm": "sliding_log", "cost": 2, "limit": {"requests": 10, "per": "3s"}},
    {"name": "bucket10x2", "match": {"path": "/tb10/*"}, "key": ["user"], "cost": 2, "limit": {"requests": 10, "per": "3s", "burst": 10}},
    {"name": "window10x2", "match": {"path": "/sw10/*"}, "key": ["user"], "cost": 2, "limit": {"requests": 10, "per": "3s"}},
    {"name": "rA", "match": {"path": "/rx/b"}, "key": ["user"], "exact": true, "limit": {"requests": 1, "per": "1d", "burst": 1}},
    {"name": "rB", "match": {"path": "/rx/*"}, "key": ["user"], "limit": {"requests": 2, "per": "1d", "burst": 2}}
  ]
}"#;

const SECRET: &str = "test-sync-secret";

fn compact(json: &str) -> String {
    serde_json::from_str::<serde_json::Value>(json).unwrap().to_string()
}

fn start(extra: &[(&str, &str)]) -> Workerd {
    let rules = compact(RULES);
    let mut vars = vec![("RATEWALL_RULES", rules.as_str()), ("RATEWALL_SYNC_SECRET", SECRET)];
    vars.extend_from_slice(extra);
    Workerd::start(&vars).unwrap()
}

fn statuses(w: &Workerd, method: &str, path: &str, headers: &[(&str, &str)], n: usize) -> Vec<u16> {
    (0..n)
        .map(|_| {
            let r = w.request(method, path, headers, &[]);
            // Status 0 is no HTTP answer at all: say why, with what the runtime logged.
            assert_ne!(r.status, 0, "{method} {path}: {}\n{}", r.text(), w.log());
            r.status
        })
        .collect()
}

/// `RateLimit` parsed as a Structured Fields list: (policy, r, t).
fn ratelimit(r: &Response) -> Vec<(String, i64, i64)> {
    let Some(v) = r.header("ratelimit") else { return Vec::new() };
    Parser::new(v)
        .parse::<sfv::List>()
        .unwrap()
        .into_iter()
        .map(|m| match m {
            sfv::ListEntry::Item(item) => {
                let name = match &item.bare_item {
                    BareItem::String(s) => s.as_str().to_owned(),
                    other => panic!("policy name is not a string: {other:?}"),
                };
                let int = |k: &str| match item.params.get(k) {
                    Some(BareItem::Integer(i)) => i64::from(*i),
                    other => panic!("{k} is {other:?} in {v}"),
                };
                (name, int("r"), int("t"))
            }
            other => panic!("inner list in RateLimit: {other:?}"),
        })
        .collect()
}

#[test]
fn limits_per_user_ip_api_key_partner_and_composite_keys_with_plans() {
    let w = start(&[]);
    let alice = [("x-user-id", "alice")];
    assert_eq!(statuses(&w, "GET", "/u/x", &alice, 4), [200, 200, 200, 429]);
    assert_eq!(statuses(&w, "GET", "/u/x", &[("x-user-id", "bob")], 1), [200], "users are counted apart");
    assert_eq!(statuses(&w, "GET", "/u/x", &[], 5), [200; 5], "no user: the rule does not count it");
    assert!(w.metric("ratewall_rule_unkeyed{rule=\"user\"}") >= 5);

    let ip = |a: &'static str| [("cf-connecting-ip", a)];
    assert_eq!(statuses(&w, "GET", "/ip/x", &ip("203.0.113.7"), 4), [200, 200, 200, 429]);
    assert_eq!(statuses(&w, "GET", "/ip/x", &ip("203.0.113.8"), 1), [200]);
    assert_eq!(statuses(&w, "GET", "/ip/x", &ip("2001:db8:0:1::1"), 3), [200; 3]);
    assert_eq!(statuses(&w, "GET", "/ip/x", &ip("2001:db8:0:1:ffff::2"), 1), [429], "one IPv6 /64 is one client");
    let spoof = [("cf-connecting-ip", "203.0.113.7"), ("x-forwarded-for", "198.51.100.1")];
    assert_eq!(statuses(&w, "GET", "/ip/x", &spoof, 1), [429], "X-Forwarded-For does not override CF-Connecting-IP");

    assert_eq!(statuses(&w, "GET", "/k/x", &[("x-api-key", "k1")], 3), [200, 200, 429]);
    let partner_plan = [("x-api-key", "k2"), ("x-plan", "partner")];
    assert_eq!(statuses(&w, "GET", "/k/x", &partner_plan, 6), [200, 200, 200, 200, 200, 429], "partner plan: 5");
    let internal = [("x-api-key", "k3"), ("x-plan", "internal")];
    assert_eq!(statuses(&w, "GET", "/k/x", &internal, 8), [200; 8], "internal plan: unlimited");

    let partner = [("x-partner-id", "acme")];
    assert_eq!(statuses(&w, "GET", "/p/x", &partner, 4), [200, 200, 200, 429]);

    let combo = |key: &'static str, addr: &'static str| [("x-api-key", key), ("cf-connecting-ip", addr)];
    assert_eq!(statuses(&w, "GET", "/c/x", &combo("a", "192.0.2.1"), 3), [200, 200, 429]);
    assert_eq!(statuses(&w, "GET", "/c/x", &combo("a", "192.0.2.2"), 1), [200], "same key, other IP");
    assert_eq!(statuses(&w, "GET", "/c/x", &combo("b", "192.0.2.1"), 1), [200], "same IP, other key");
}

#[test]
fn responses_follow_the_client_contract_and_denials_charge_no_other_rule() {
    let w = start(&[]);
    let carol = [("x-user-id", "carol")];
    ratewall_tests::clear_of_a_window_edge(Duration::from_secs(60), Duration::from_secs(10));
    // Allowed: RateLimit fields on the origin's answer.
    let r = w.request("POST", "/m/x", &carol, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("ratewall demo origin"));
    let policy = r.header("ratelimit-policy").unwrap();
    let list = Parser::new(policy).parse::<sfv::List>().unwrap();
    assert_eq!(list.len(), 2, "every enforcing policy");
    let fields = ratelimit(&r);
    assert_eq!((fields[0].0.as_str(), fields[0].1), ("tight", 0), "the most restrictive policy first");
    assert_eq!((fields[1].0.as_str(), fields[1].1), ("roomy", 4));
    // Denied by "tight" three times: "roomy" must not be charged for them.
    for _ in 0..3 {
        let r = w.request("POST", "/m/x", &carol, &[]);
        assert_eq!(r.status, 429);
        let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
        assert!((1..=60).contains(&retry), "Retry-After {retry}");
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        let problem: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(problem["status"], 429);
        assert_eq!(problem["violated-policies"], serde_json::json!(["tight"]));
        assert_eq!(ratelimit(&r)[0].1, 0);
    }
    // Refunds run after the 429 is sent; give them a moment.
    std::thread::sleep(Duration::from_millis(500));
    let r = w.request("GET", "/m/x", &carol, &[]);
    assert_eq!(r.status, 200);
    assert_eq!(ratelimit(&r)[0].0, "roomy");
    assert_eq!(ratelimit(&r)[0].1, 3, "roomy: 5 - the admitted POST - this GET");

    // Shadow: never rejects, counts what it would have rejected.
    assert_eq!(statuses(&w, "GET", "/s/x", &carol, 4), [200; 4]);
    assert_eq!(w.metric("ratewall_rule_shadow_rejected{rule=\"watch\"}"), 3);
    // The scrape is valid Prometheus text. Its counters keep the names operators and checks
    // already read (`ratewall_object_calls`, not `…_total`): that lint is the one allowed.
    let scrape = w.request("GET", "/_ratewall/metrics", &[], &[]).text();
    match ratewall_tests::promtool_problems(&scrape) {
        Some(problems) => {
            let other: Vec<&String> =
                problems.iter().filter(|p| !p.contains("should have \"_total\" suffix")).collect();
            assert!(other.is_empty(), "promtool check metrics: {other:?}\n{scrape}");
        }
        None => println!("promtool is not installed here: the scrape's format is not checked"),
    }

    // A client that waits exactly Retry-After is allowed (token bucket, 1 per second, burst 2).
    let dave = [("x-user-id", "dave")];
    assert_eq!(statuses(&w, "GET", "/tb/x", &dave, 3), [200, 200, 429]);
    let r = w.request("GET", "/tb/x", &dave, &[]);
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    std::thread::sleep(Duration::from_secs(retry));
    assert_eq!(w.request("GET", "/tb/x", &dave, &[]).status, 200);
}

#[test]
fn rules_reload_from_kv_and_a_bad_document_keeps_the_last_good_rules() {
    let w = start(&[("RULES_REFRESH_SECONDS", "1")]);
    let erin = [("x-user-id", "erin")];
    assert_eq!(statuses(&w, "GET", "/u/x", &erin, 4), [200, 200, 200, 429]);
    let one_per_hour = r#"{"identity":{"user":{"header":"x-user-id"}},"rules":[{"name":"kv","key":["user"],"limit":{"requests":1,"per":"1h"}}]}"#;
    w.kv_put("rules", one_per_hour).unwrap();
    let wait_for = |probe: &dyn Fn() -> bool| {
        for _ in 0..60 {
            if probe() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        false
    };
    assert!(
        wait_for(&|| ratelimit(&w.request("GET", "/any", &[("x-user-id", "probe")], &[]))
            .first()
            .is_some_and(|p| p.0 == "kv")),
        "the KV rules never took effect:\n{}",
        w.log()
    );
    w.kv_put("rules", r#"{"rules":[{"name":"bad","key":["nobody"],"limit":{"requests":1,"per":"1s"}}]}"#).unwrap();
    // Rules are re-read on requests (at most once a second here).
    let rejected = || {
        w.request("GET", "/any", &[("x-user-id", "probe2")], &[]);
        w.log().contains("rules from KV RATEWALL_KV/rules rejected")
    };
    assert!(wait_for(&rejected), "{}", w.log());
    assert!(w.log().contains("rules[0].key"), "the error names the field:\n{}", w.log());
    assert_eq!(statuses(&w, "GET", "/any", &[("x-user-id", "frank")], 2), [200, 429], "the last good rules stay");
    assert!(w.metric("ratewall_rules_rejected") >= 1);
    // A new isolate, started while KV holds the bad document, takes the last good one too
    // (not the var's, which would admit 3 on /u/*).
    let mut w = w;
    w.restart().unwrap();
    let kv_rule = || ratelimit(&w.request("GET", "/u/x", &[("x-user-id", "probe3")], &[])).first().map(|p| p.0.clone());
    assert_eq!(kv_rule().as_deref(), Some("kv"), "{}", w.log());
    assert_eq!(statuses(&w, "GET", "/u/x", &[("x-user-id", "gail")], 2), [200, 429]);
}

#[test]
fn counter_state_survives_a_runtime_restart_within_the_flush_bound() {
    let mut w = start(&[]);
    let gina = [("x-user-id", "gina")];
    // The rule's window is 60 s; the requests, the pause and the restart stay inside one.
    ratewall_tests::clear_of_a_window_edge(Duration::from_secs(60), Duration::from_secs(20));
    assert_eq!(statuses(&w, "GET", "/u/x", &gina, 3), [200, 200, 200]);
    // The counter object writes its state at most 1 s after a change (the stated bound).
    std::thread::sleep(Duration::from_millis(2500));
    w.restart().unwrap();
    // The restarted isolate is new to gina's counter: its first request is decided at once
    // (as a fresh counter) and reported. Once the object has answered, the isolate holds
    // the object's count: 3 before the restart, so the limit.
    let _ = statuses(&w, "GET", "/u/x", &gina, 1);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(statuses(&w, "GET", "/u/x", &gina, 2), [429, 429], "the limit survived the restart");
    assert_eq!(statuses(&w, "GET", "/u/x", &[("x-user-id", "hank")], 1), [200]);
}

#[test]
fn cold_keys_share_their_objects_reports_and_each_keeps_its_own_limit() {
    let w = start(&[("COUNTER_SHARDS", "2")]);
    ratewall_tests::clear_of_a_window_edge(Duration::from_secs(60), Duration::from_secs(10));
    let before = w.metric("ratewall_object_calls");
    let users: Vec<String> = (0..60).map(|i| format!("cold{i}")).collect();
    let user = |i: usize| [("x-user-id", users[i].as_str())];
    for i in 0..60 {
        assert_eq!(statuses(&w, "GET", "/u/x", &user(i), 1), [200]);
    }
    // Their reports land: one call per object per interval, whatever the counters in it.
    std::thread::sleep(Duration::from_millis(1500));
    let calls = w.metric("ratewall_object_calls") - before;
    assert!(calls < 30, "{calls} object calls for 60 cold counters on 2 objects");
    // Each user's limit (3 a minute) is its own: after the pause, a burst of three gets the
    // limit's rest, two, then a 429.
    for i in 0..5 {
        assert_eq!(statuses(&w, "GET", "/u/x", &user(i), 3), [200, 200, 429], "cold{i}");
    }
    assert_eq!(statuses(&w, "GET", "/u/x", &user(59), 1), [200]);
}

/// Sleeps until `lead` before the next edge of `per`-long windows of the wall clock.
fn before_a_window_edge(per: Duration, lead: Duration) {
    let per = per.as_nanos();
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let left = per - since_epoch % per;
    let lead = lead.as_nanos();
    let wait = if left > lead { left - lead } else { left + per - lead };
    std::thread::sleep(Duration::from_nanos(u64::try_from(wait).unwrap()));
}

#[test]
fn requests_at_a_fixed_windows_end_are_not_counted_in_the_next_window() {
    // One shard object, kept busy by other clients: its reports ride one task, every 250 ms,
    // so units admitted at a window's end reach the object after the window ended.
    let w = start(&[("COUNTER_SHARDS", "1")]);
    let per = Duration::from_secs(2);
    let done = std::sync::atomic::AtomicBool::new(false);
    let (mut checked, mut failed) = (0, Vec::new());
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0.. {
                if done.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                w.request("GET", "/u/x", &[("x-user-id", &format!("busy{i}"))], &[]);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        // Rounds until fifteen clients were refused before their window's end: on a slow
        // machine fewer of a round's ten get there within the last 150 ms.
        for round in 0..8 {
            if checked >= 15 {
                break;
            }
            // Ten clients, each sending in a window's last 150 ms until refused.
            before_a_window_edge(per, Duration::from_millis(150));
            let edge = wall_clock() / per.as_nanos() as u64 + 1;
            let clients: Vec<_> = (0..10u64)
                .map(|i| {
                    let w = &w;
                    s.spawn(move || {
                        std::thread::sleep(Duration::from_millis(i * 5));
                        let user = format!("edge{round}-{i}");
                        let h = [("x-user-id", user.as_str())];
                        let mut codes = Vec::new();
                        while codes.len() < 5 {
                            let r = w.request("GET", "/fw/x", &h, &[]);
                            codes.push(r.status);
                            if r.status == 429 {
                                // Refused in the window it started in: the window's rest.
                                if wall_clock() / per.as_nanos() as u64 >= edge {
                                    return None;
                                }
                                let wait: u64 = r.header("retry-after").unwrap().parse().unwrap();
                                std::thread::sleep(Duration::from_secs(wait));
                                let next = statuses(w, "GET", "/fw/x", &h, 4);
                                let bad = next != [200, 200, 200, 429];
                                return Some(bad.then(|| format!("{user}: {codes:?} then {next:?}")));
                            }
                        }
                        None
                    })
                })
                .collect();
            for c in clients {
                if let Some(r) = c.join().unwrap() {
                    checked += 1;
                    failed.extend(r);
                }
            }
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    // A client that waits exactly Retry-After gets the next window's whole quota.
    assert!(checked >= 15, "only {checked} clients were refused before their window's end");
    assert!(failed.is_empty(), "{} of {checked}: {failed:?}", failed.len());
}

#[test]
fn a_client_that_spends_a_token_bucket_and_waits_its_retry_after_is_admitted() {
    let w = start(&[]);
    // Thirty clients at once, each spending its burst of three until refused, then waiting
    // exactly the Retry-After it got (until its first token comes back).
    let failed: Vec<String> = std::thread::scope(|s| {
        let clients: Vec<_> = (0..30u64)
            .map(|i| {
                let w = &w;
                s.spawn(move || {
                    let user = format!("refill{i}");
                    let h = [("x-user-id", user.as_str())];
                    let mut codes = Vec::new();
                    let refused = loop {
                        let r = w.request("GET", "/tb3/x", &h, &[]);
                        codes.push(r.status);
                        if r.status != 200 || codes.len() > 4 {
                            break r;
                        }
                    };
                    let wait: u64 = refused.header("retry-after").map_or(0, |v| v.parse().unwrap());
                    std::thread::sleep(Duration::from_secs(wait));
                    let again = w.request("GET", "/tb3/x", &h, &[]);
                    let fine = codes == [200, 200, 200, 429] && (1..=3).contains(&wait) && again.status == 200;
                    (!fine).then(|| format!("{user}: {codes:?}, Retry-After {wait}, then {}", again.status))
                })
            })
            .collect();
        clients.into_iter().filter_map(|c| c.join().unwrap()).collect()
    });
    assert!(failed.is_empty(), "{} of 30: {failed:?}", failed.len());
}

#[test]
fn unreachable_counter_objects_fail_open_to_a_local_limit_or_closed_with_503() {
    // A binding that does not exist: every Durable Object call fails.
    let w = start(&[("COUNTER_BINDING", "NO_SUCH_BINDING")]);
    let kim = [("x-user-id", "kim")];
    assert_eq!(statuses(&w, "GET", "/u/x", &kim, 4), [200, 200, 200, 429], "open: the isolate's local limit");
    let r = w.request("GET", "/cl/x", &kim, &[]);
    assert_eq!(r.status, 503, "closed: {}", r.text());
    assert!(r.header("retry-after").is_some());
    // The closed rule's take, and the open rule's reports in the background.
    let failures = (0..40).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        w.metric("ratewall_object_failures") >= 3
    });
    assert!(failures, "{}", w.metric("ratewall_object_failures"));
    assert!(w.metric("ratewall_rule_store_failed{rule=\"strict\"}") >= 1);
    // Decided on the isolate's own count while the reports fail: degraded, and counted so.
    assert_eq!(statuses(&w, "GET", "/u/x", &kim, 1), [429]);
    assert!(w.metric("ratewall_rule_store_failed{rule=\"user\"}") >= 1);
    // A concurrency limit decided by the isolate's fallback gives each slot back when the
    // response completes: one request after another never runs out of its two.
    assert_eq!(statuses(&w, "GET", "/f/x", &kim, 5), [200; 5]);
    // wrangler relays the Worker's console a little later.
    let logged = (0..40).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        w.log().contains("counter object failed")
    });
    assert!(logged, "failures are logged:\n{}", w.log());
}

#[test]
fn an_unreachable_origin_is_a_502_with_a_problem_body_and_the_slot_comes_back() {
    let w = start(&[("ORIGIN_URL", "http://127.0.0.1:1")]);
    let ann = [("x-user-id", "ann")];
    for _ in 0..3 {
        let r = w.request("GET", "/f/x", &ann, &[]);
        assert_eq!(r.status, 502, "{}", r.text());
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        assert!(r.text().contains("\"status\":502"), "{}", r.text());
        // It was admitted and counted: its client sees its budget, as on any answer.
        assert!(r.header("ratelimit-policy").is_some_and(|p| p.contains("\"flight\"")), "{:?}", r.headers);
        assert!(r.header("ratelimit").is_some_and(|p| p.contains("\"flight\"")), "{:?}", r.headers);
    }
    // Its concurrency slot was given back each time (a limit of 2: the third still got
    // through to the origin, which failed).
    assert_eq!(w.metric("ratewall_rule_allowed{rule=\"flight\"}"), 3);
    assert_eq!(w.metric("ratewall_rule_rejected{rule=\"flight\"}"), 0);
}

/// The counter key the rules give a request (what a filter node sends in its deltas).
fn key_of(path: &str, user: &str) -> (Vec<u8>, ratewall_core::Limit) {
    let config = Config::parse(RULES.as_bytes()).unwrap();
    let headers: Vec<Option<&[u8]>> =
        config.identity.headers.iter().map(|(d, _)| (d == "user").then_some(user.as_bytes())).collect();
    let (checks, _) = config.checks(&Request { method: "GET", path, headers: &headers, ip: None });
    (checks[0].key.clone(), checks[0].limit)
}

fn post_sync(w: &Workerd, body: &[u8], tag: Option<String>) -> Response {
    let mut headers = vec![("content-type", "application/octet-stream")];
    if let Some(t) = &tag {
        headers.push(("x-ratewall-signature", t.as_str()));
    }
    w.request("POST", "/v1/sync", &headers, body)
}

/// `METRICS_NEED_TOKEN = "on"`: the metrics route answers only the admin token (401 with
/// another or none; 404 while no token is set), the admin routes' way.
#[test]
fn the_metrics_route_can_be_closed_to_all_but_the_admin_token() {
    let token = "an admin token of 16+";
    let w = start(&[("METRICS_NEED_TOKEN", "on"), ("RATEWALL_ADMIN_TOKEN", token)]);
    let scrape = |auth: Option<&str>| {
        let value = auth.map(|t| format!("Bearer {t}"));
        let headers: Vec<(&str, &str)> = value.iter().map(|v| ("authorization", v.as_str())).collect();
        w.request("GET", "/_ratewall/metrics", &headers, &[])
    };
    assert_eq!(scrape(None).status, 401);
    assert_eq!(scrape(Some("not the token at all")).status, 401);
    let r = scrape(Some(token));
    assert_eq!(r.status, 200);
    assert!(r.text().contains("ratewall_"), "{}", r.text());
    let w = start(&[("METRICS_NEED_TOKEN", "on")]);
    assert_eq!(w.request("GET", "/_ratewall/metrics", &[], &[]).status, 404);
}

/// While the sync secret is rotated (`RATEWALL_SYNC_SECRET_PREVIOUS`), a node still on the
/// one going out is counted and answered signed with it; a node on neither is refused.
#[test]
fn a_node_still_on_the_secret_being_rotated_out_is_answered_with_it() {
    const OLD: &str = "the sync secret going out";
    let w = start(&[("RATEWALL_SYNC_SECRET_PREVIOUS", OLD)]);
    let (key, limit) = key_of("/u/x", "rotating");
    for (seq, secret, status) in [(1, SECRET, 200), (2, OLD, 200), (3, "a secret of neither kind", 401)] {
        let batch = SyncRequest {
            node: 78,
            seq,
            sent: wall_clock(),
            deltas: vec![Delta { key: key.clone(), limit, units: 1 }],
            ask: false,
        };
        let body = batch.encode();
        let r = post_sync(&w, &body, Some(hex(&sign(secret.as_bytes(), &body))));
        assert_eq!(r.status, status, "seq {seq}: {}", r.text());
        if status == 200 {
            let sig = unhex(r.header("x-ratewall-signature").unwrap().as_bytes()).unwrap();
            assert!(verify(secret.as_bytes(), &r.body, &sig), "seq {seq}: answered with the secret it came with");
        }
    }
}

#[test]
fn sync_is_authenticated_idempotent_and_shares_the_edge_limit() {
    let w = start(&[]);
    let (key, limit) = key_of("/u/x", "ivy");
    let batch = SyncRequest {
        node: 77,
        seq: 1,
        sent: wall_clock(),
        deltas: vec![Delta { key: key.clone(), limit, units: 2 }],
        ask: false,
    };
    let body = batch.encode();
    assert_eq!(post_sync(&w, &body, None).status, 401, "unauthenticated");
    assert_eq!(post_sync(&w, &body, Some(hex(&sign(b"wrong secret", &body)))).status, 401, "forged");
    let mut tampered = body.clone();
    *tampered.last_mut().unwrap() = 3;
    assert_eq!(post_sync(&w, &tampered, Some(hex(&sign(SECRET.as_bytes(), &body)))).status, 401, "tampered");
    assert_eq!(w.metric("ratewall_sync_failed"), 3);

    let tag = Some(hex(&sign(SECRET.as_bytes(), &body)));
    let first = post_sync(&w, &body, tag.clone());
    assert_eq!(first.status, 200, "{}", first.text());
    let sig = unhex(first.header("x-ratewall-signature").unwrap().as_bytes()).unwrap();
    assert!(verify(SECRET.as_bytes(), &first.body, &sig), "the store signs its answer");
    let resp = SyncResponse::decode(&first.body).unwrap();
    assert_eq!((resp.seq, resp.grants.len(), resp.grants[0].remaining), (1, 1, 1));
    // A retried batch (same node, same seq) is never counted twice.
    let retry = SyncResponse::decode(&post_sync(&w, &body, tag).body).unwrap();
    let view = |r: &SyncResponse| r.grants.iter().map(|g| (g.remaining, g.grant)).collect::<Vec<_>>();
    assert_eq!(view(&retry), view(&resp));
    // The filter fleet's 2 units and the edge share one limit of 3. The edge's isolate is
    // new to the counter: its first request is decided at once (as a fresh counter) and
    // reported; once the object has answered, the isolate holds the fleet's count.
    let ivy = [("x-user-id", "ivy")];
    assert_eq!(statuses(&w, "GET", "/u/x", &ivy, 1), [200]);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(statuses(&w, "GET", "/u/x", &ivy, 2), [429, 429], "the edge counts the fleet's units");
    assert_eq!(w.request("POST", "/v1/sync", &[], b"garbage").status, 401);
    let get = w.request("GET", "/v1/sync", &[], b"");
    assert_eq!(get.status, 405, "the sync path is the store's: not passed on to the origin");
    assert!(!get.text().is_empty() && !get.text().contains("origin"), "{}", get.text());

    // An ask (a paused request's units, taken at once) from another node on a fresh counter.
    ratewall_tests::clear_of_a_window_edge(Duration::from_secs(60), Duration::from_secs(5));
    let (ava, limit) = key_of("/u/x", "ava");
    let ask = SyncRequest {
        node: 78,
        seq: 1,
        sent: wall_clock(),
        deltas: vec![Delta { key: ava, limit, units: 1 }],
        ask: true,
    }
    .encode();
    let answer = post_sync(&w, &ask, Some(hex(&sign(SECRET.as_bytes(), &ask))));
    assert_eq!(answer.status, 200, "{}", answer.text());
    let given = SyncResponse::decode(&answer.body).unwrap();
    let (held, lease) = (given.grants[0].grant, given.grants[0].lease);
    assert!((1..=3).contains(&held) && lease > 0, "{given:?}");
    // The asked unit is counted at once, and the units given with it are node 78's while
    // its lease lasts: once the edge's isolate has the object's answer, it admits past its
    // own grant only units no grant holds, and at most one overdraft unit (the cap at a
    // limit of 3) before an answer finds room for it.
    let ava = [("x-user-id", "ava")];
    let started = std::time::Instant::now();
    let mut during = statuses(&w, "GET", "/u/x", &ava, 1);
    std::thread::sleep(Duration::from_millis(150));
    during.extend(statuses(&w, "GET", "/u/x", &ava, 4));
    assert!(started.elapsed() < Duration::from_nanos(lease), "the checks ran while the lease lasted");
    let admitted = during.iter().filter(|s| **s == 200).count() as u64;
    assert!(admitted + held <= 3 + 1, "edge {during:?} beside {held} held by node 78");
    // Once the lease is over, what node 78 did not report spending is free again: the
    // fleet reaches its limit, and no further.
    std::thread::sleep(Duration::from_nanos(lease) + Duration::from_millis(200));
    let mut after = statuses(&w, "GET", "/u/x", &ava, 1);
    std::thread::sleep(Duration::from_millis(150));
    after.extend(statuses(&w, "GET", "/u/x", &ava, 3));
    let total = 1 + admitted + after.iter().filter(|s| **s == 200).count() as u64;
    assert!((3..=4).contains(&total), "node 78's unit, the edge {during:?} then {after:?}");
}

/// Runs scenario `s`'s filter fleet against the Worker as its store (its rules, signed with
/// its secret): the Worker, and the fleet's report.
fn fleet_run(s: &ratewall_tests::sim::Scenario) -> (Workerd, ratewall_tests::sim::Report) {
    let doc = ratewall_tests::sim::rules(s);
    let w = Workerd::start(&[("RATEWALL_RULES", doc.as_str()), ("RATEWALL_SYNC_SECRET", ratewall_tests::sim::SECRET)])
        .unwrap();
    let r = ratewall_tests::sim::run_with(s, &ratewall_tests::sim::Backend::Http(&w.addr)).unwrap();
    println!("{r:?}");
    (w, r)
}

/// End to end, a node cut off: three filter nodes syncing to the Worker in workerd, the
/// busiest of them unable to reach it from the second window on — the counter's object holds
/// its part of the quota, as ratewall-store does.
#[test]
fn a_filter_node_cut_off_from_the_worker_has_its_part_held() {
    let (w, r) = fleet_run(&ratewall_tests::sim::cut_off("worker_cut_off"));
    // Without the hold, 13 % on average and 20 % in the worst window (the reference store).
    assert!(r.overadmission_pct <= 6.0, "{r:?}\n{}", w.log());
    assert!(r.overadmission_max_pct <= 10.0, "{r:?}");
    // Past its share the node cut off denies on its own, though the fleet may be under the
    // limit: these runs are paced in real time, so the figure moves between runs (3.9-10.8 %
    // run alone; 25.3 % once in the whole suite, the other tests' workerd sharing the two
    // cores). A hold of more than the node's part would deny far more: the bound is for that.
    assert!(r.false_denial_pct <= 35.0, "{r:?}");
}

/// End to end: filter nodes (the built filter in the wasmtime host) sync over real HTTP to the
/// Worker in workerd; the fleet holds one global limit, and the Worker's edge shares it.
#[test]
fn filter_nodes_syncing_to_the_worker_share_one_global_limit() {
    let (w, r) = fleet_run(&ratewall_tests::sim::end_to_end("worker_e2e"));
    // Without sync, 3 nodes would admit up to 3 × 40 per user: 200% over.
    assert!(r.overadmission_max_pct <= 7.5, "at most 3 units over a limit of 40: {r:?}\n{}", w.log());
    assert!(w.metric("ratewall_sync_ok") > 0);
    // The edge sees the fleet's admissions: the same user is over the limit there too (once
    // the isolate, new to the counter, has the object's answer to its first request).
    let _ = w.request("GET", "/", &[("x-user-id", "user-0")], &[]);
    std::thread::sleep(Duration::from_millis(500));
    let edge = w.request("GET", "/", &[("x-user-id", "user-0")], &[]);
    assert_eq!(edge.status, 429, "{}", edge.text());
}

/// End to end, past the quota: three filter nodes on one counter, syncing over real HTTP to
/// the Worker in workerd, offered 3× the limit — no request waits for the store, and the
/// fleet admits within the written bound (docs/sync-protocol.md, "The error bound").
#[test]
fn filter_nodes_past_the_quota_decide_at_once_against_the_worker_within_the_written_bound() {
    use ratewall_tests::sim::{bound_pct, past_the_quota};
    let s = past_the_quota("worker_past_the_quota");
    let (w, r) = fleet_run(&s);
    assert_eq!(r.paused_pct, 0.0, "no request waited: {r:?}");
    assert!(r.overadmission_max_pct <= bound_pct(&s), "over the bound {:.1} %: {r:?}\n{}", bound_pct(&s), w.log());
    assert!(r.admitted >= 108, "the fleet admitted about the limit in each window: {r:?}");
    assert!(w.metric("ratewall_sync_ok") > 0);
}

#[test]
fn wrangler_deploy_dry_run_uploads_the_built_worker_with_its_bindings() {
    let root = ratewall_tests::workerd::root();
    let out = std::env::temp_dir().join(format!("ratewall-dry-run-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let run = std::process::Command::new(root.join("node_modules/.bin/wrangler"))
        .current_dir(&root)
        .args(["deploy", "--dry-run", "--outdir"])
        .arg(&out)
        .env("WRANGLER_SEND_METRICS", "false")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "{text}");
    for binding in
        ["env.RATEWALL_COUNTER (RateLimitCounter)", "Durable Object", "env.RATEWALL_KV", "env.RATEWALL_RULES"]
    {
        assert!(text.contains(binding), "{binding} missing from:\n{text}");
    }
    // What would be uploaded is what `cargo xtask build` built.
    let built = std::fs::read(root.join("dist/worker/index_bg.wasm")).unwrap();
    let uploaded = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "wasm"))
        .map(|p| std::fs::read(p).unwrap());
    assert_eq!(uploaded.as_ref().map(Vec::len), Some(built.len()));
    assert!(uploaded == Some(built), "the dry run bundles another wasm than dist/worker's");
    let _ = std::fs::remove_dir_all(&out);
}

/// A leaky bucket in real workerd: 12 requests at once at 5/s with a queue of 5. One goes at
/// once, five are forwarded at their turns (200 ms apart, never early), six are rejected at
/// once. The tolerance for lateness is generous: local workerd on a loaded machine.
#[test]
fn a_leaky_bucket_forwards_a_burst_in_turns_and_rejects_past_its_queue() {
    let w = start(&[]);
    // Warm the isolate and the object's first load.
    assert_eq!(w.request("GET", "/q/x", &[("x-user-id", "warm")], &[]).status, 200);
    let start = std::time::Instant::now();
    let mut done: Vec<(u16, u128, Option<String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..12)
            .map(|_| {
                let w = &w;
                s.spawn(move || {
                    let r = w.request("GET", "/q/x", &[("x-user-id", "queue")], &[]);
                    (r.status, start.elapsed().as_millis(), r.header("ratelimit").map(str::to_owned))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    done.sort_by_key(|(status, at, _)| (*status, *at));
    let statuses: Vec<u16> = done.iter().map(|(s, _, _)| *s).collect();
    assert_eq!(statuses, [[200; 6].as_slice(), [429; 6].as_slice()].concat(), "{done:?}");
    // Each is forwarded with its fields as of then: the bucket drains 200 ms after the last
    // of them goes (`t=1`, rounded up), not 1.2 s after the last was queued (`t=2`).
    for (_, at, field) in done.iter().filter(|(s, _, _)| *s == 200) {
        assert_eq!(field.as_deref().and_then(|f| f.split(";t=").nth(1)), Some("1"), "went at {at} ms: {done:?}");
    }
    let passed: Vec<u128> = done.iter().filter(|(s, _, _)| *s == 200).map(|(_, at, _)| *at).collect();
    // The turns are the object's (200 ms from the first's decision); the first answer's own
    // latency is not theirs, so the first queued one is checked against it loosely and the
    // others against the first queued one, whose answer took the same path.
    assert!(passed[1] + 60 >= passed[0] + 200, "the first queued request went early: {done:?}");
    let first = passed[1];
    for (i, at) in passed.iter().enumerate().skip(2) {
        let turn = first + 200 * (i as u128 - 1);
        assert!(*at + 20 >= turn, "request {i} went at {at} ms, before its turn at {turn} ms: {done:?}");
        assert!(*at <= turn + 400, "request {i} went at {at} ms, long after its turn at {turn} ms: {done:?}");
    }
}

/// An origin on loopback that answers every request with `answer`: its first `at_once` bytes
/// at once, the rest after `delay`.
fn origin(answer: &'static [u8], at_once: usize, delay: Duration) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                use std::io::{Read, Write};
                let mut stream = stream;
                let mut buf = [0u8; 4096];
                let _ = stream.read(&mut buf);
                let (first, rest) = answer.split_at(at_once.min(answer.len()));
                let _ = stream.write_all(first).and_then(|()| stream.flush());
                std::thread::sleep(delay);
                let _ = stream.write_all(rest);
            });
        }
    });
    format!("http://{addr}")
}

/// An origin that answers every request after `delay` — or, `headers_first`, its headers and
/// the first byte of its body at once and the rest after `delay`.
fn slow_origin(delay: Duration, headers_first: bool) -> String {
    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok";
    origin(OK, if headers_first { OK.len() - 1 } else { 0 }, delay)
}

/// An origin on loopback that records each request's head (up to its blank line) and answers
/// 200.
fn recording_origin() -> (String, std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = heads.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let seen = seen.clone();
            std::thread::spawn(move || {
                use std::io::{Read, Write};
                let mut stream = stream;
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                seen.lock().unwrap().push(head);
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok");
            });
        }
    });
    (format!("http://{addr}"), heads)
}

/// Whatever method a client sends (WebDAV's PROPFIND, a cache's PURGE, QUERY), the origin
/// gets it as sent and rules match it by its own name; header values that are not UTF-8
/// reach the origin byte for byte, and the runtime logs none of them. (workers-rs reads a
/// method it does not name as GET: such requests were counted as GETs and answered 502, a
/// GET with a body being no request; header values were read into strings and set again,
/// their bytes replaced, and the runtime logged each value it was given, API keys included.)
#[test]
fn any_method_and_header_bytes_reach_the_origin_as_the_client_sent_them() {
    let (to, heads) = recording_origin();
    let doc = compact(
        r#"{"identity": {"user": {"header": "x-user-id"}, "api_key": {"header": "x-api-key"}},
            "rules": [{"name": "purge", "match": {"path": "/pg/*", "method": "PURGE"}, "key": ["user"], "limit": {"requests": 1, "per": "60s"}},
                      {"name": "gets", "match": {"path": "/pg/*", "method": "GET"}, "key": ["user"], "limit": {"requests": 1, "per": "60s"}}]}"#,
    );
    let w = Workerd::start(&[
        ("RATEWALL_RULES", doc.as_str()),
        ("RATEWALL_SYNC_SECRET", SECRET),
        ("ORIGIN_URL", to.as_str()),
    ])
    .unwrap();
    let raw = |head: &[u8]| -> String {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&w.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.write_all(head).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    };
    for method in ["PROPFIND", "QUERY"] {
        let r = w.request(method, "/any", &[("x-user-id", "dav")], b"<propfind/>");
        assert_eq!(r.status, 200, "{method}: {}\n{}", r.text(), w.log());
    }
    // PURGE is counted by the PURGE rule, and not by the GET one.
    let purges = statuses(&w, "PURGE", "/pg/x", &[("x-user-id", "cdn")], 2);
    assert_eq!(purges, [200, 429], "{}", w.log());
    assert_eq!(statuses(&w, "GET", "/pg/x", &[("x-user-id", "cdn")], 1), [200]);
    let key = b"caf\xe9-Secret-\xc3\xa9";
    let mut head =
        b"GET /bytes HTTP/1.1\r\nhost: w\r\nconnection: close\r\nx-note: \xff\xfe\xc3\x28\r\nx-api-key: ".to_vec();
    head.extend_from_slice(key);
    head.extend_from_slice(b"\r\n\r\n");
    let answer = raw(&head);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}\n{}", w.log());
    let heads = heads.lock().unwrap().clone();
    let methods: Vec<String> =
        heads.iter().map(|h| String::from_utf8_lossy(h).split(' ').next().unwrap_or("").to_owned()).collect();
    for method in ["PROPFIND", "QUERY", "PURGE"] {
        assert!(methods.iter().any(|m| m == method), "{method} reached the origin as another: {methods:?}");
    }
    let bytes = heads.iter().find(|h| h.starts_with(b"GET /bytes")).expect("the request reached the origin");
    let has = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
    assert!(has(b": \xff\xfe\xc3\x28\r\n"), "{}", String::from_utf8_lossy(bytes));
    assert!(has(&[b": ".as_slice(), key.as_slice(), b"\r\n"].concat()), "{}", String::from_utf8_lossy(bytes));
    let log = w.log();
    assert!(!log.contains("Secret"), "{log}");
}

/// The origin's redirect reaches the client as it is: the Worker does not follow it.
#[test]
fn an_origins_redirect_goes_to_the_client() {
    let to = origin(
        b"HTTP/1.1 302 Found\r\nlocation: /v1/target\r\nset-cookie: session=1\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
        usize::MAX,
        Duration::ZERO,
    );
    let w = start(&[("ORIGIN_URL", to.as_str())]);
    let r = w.request("GET", "/u/x", &[("x-user-id", "rita")], &[]);
    assert_eq!(r.status, 302, "{}", r.text());
    assert_eq!(r.header("location"), Some("/v1/target"));
    assert_eq!(r.header("set-cookie"), Some("session=1"));
    assert!(r.header("ratelimit").is_some(), "an admitted response carries the RateLimit fields");
}

/// A concurrency limit in real workerd: with a slow origin, two requests of a key are in
/// flight at once and the third is rejected; once they end, the slots are free again. A slot
/// is held until the response has completed, not only until the origin's headers came: with
/// bodies that take 1.5 s, the third request at 0.7 s is rejected too.
#[test]
fn a_concurrency_limit_counts_requests_in_flight_across_the_edge() {
    for headers_first in [false, true] {
        let origin = slow_origin(Duration::from_millis(1500), headers_first);
        let w = start(&[("ORIGIN_URL", origin.as_str())]);
        let who = [("x-user-id", "flyer")];
        let results: Vec<Response> = std::thread::scope(|s| {
            let first: Vec<_> = (0..2)
                .map(|_| {
                    let w = &w;
                    s.spawn(move || w.request("GET", "/f/x", &who, &[]))
                })
                .collect();
            // Both are in flight (the origin holds them) when the third comes.
            std::thread::sleep(Duration::from_millis(700));
            let third = w.request("GET", "/f/x", &who, &[]);
            let mut out: Vec<Response> = first.into_iter().map(|h| h.join().unwrap()).collect();
            out.push(third);
            out
        });
        let statuses: Vec<u16> = results.iter().map(|r| r.status).collect();
        assert_eq!(statuses, [200, 200, 429], "headers first: {headers_first}; {}", w.log());
        let rejected = &results[2];
        assert_eq!(rejected.header("retry-after"), Some("1"));
        assert_eq!(rejected.header("ratelimit-policy"), Some("\"flight\";q=2;qu=\"concurrent-requests\""));
        // Both ended: their slots come back (given back just after each response).
        std::thread::sleep(Duration::from_millis(1100));
        let again: Vec<u16> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|_| {
                    let w = &w;
                    s.spawn(move || w.request("GET", "/f/x", &who, &[]).status)
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(again, [200, 200], "headers first: {headers_first}");
    }
}

/// Every 429 a rule sends counts in its `ratewall_rule_rejected`, as the filter's per-rule
/// metric counts it; `ratewall_rule_cached_denials` is the part of them the blocked-key cache
/// answered.
#[test]
fn every_denial_a_client_sees_counts_in_its_rules_rejected_metric() {
    let w = start(&[]);
    let rejected = || w.metric("ratewall_rule_rejected{rule=\"denials\"}");
    let cached = || w.metric("ratewall_rule_cached_denials{rule=\"denials\"}");
    let (rejected_before, cached_before) = (rejected(), cached());
    let lou = [("x-user-id", "lou")];
    assert_eq!(statuses(&w, "GET", "/dn/x", &lou, 7), [200, 200, 429, 429, 429, 429, 429]);
    let from_cache = cached() - cached_before;
    assert_eq!(rejected() - rejected_before, 5, "{from_cache} of them from the cache");
    assert!((1..=4).contains(&from_cache), "the cache answered the denials after the first: {from_cache}");
}

/// A rules var that does not parse (`per` is not a duration).
const BAD_RULES: &str = r#"{"rules":[{"name":"x","key":["ip"],"limit":{"requests":1,"per":"6O s"}}]}"#;

/// Waits (up to 4 s) for `text` in what the runtime logged; wrangler relays it a little later.
fn logged(w: &Workerd, text: &str) -> bool {
    (0..40).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        w.log().contains(text)
    })
}

/// A Worker whose var does not parse keeps the deployment's last good rules, which it keeps
/// in KV whichever way they came (here, the var it had before); with none kept, requests pass
/// without limits, and each is counted in `ratewall_config_rejected`.
#[test]
fn a_bad_rules_var_falls_back_to_the_last_good_rules_or_is_counted_when_there_are_none() {
    let mut good = start(&[]);
    assert_eq!(statuses(&good, "GET", "/u/x", &[("x-user-id", "jo")], 1), [200]);
    good.stop();
    let mut bad = Workerd::start(&[("RATEWALL_RULES", BAD_RULES), ("RATEWALL_SYNC_SECRET", SECRET)]).unwrap();
    for _ in 0..4 {
        let r = bad.request("GET", "/u/x", &[("x-user-id", "jo")], &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("ratelimit"), None, "no rules in force");
    }
    assert_eq!(bad.metric("ratewall_config_rejected"), 4, "{}", bad.log());
    assert!(logged(&bad, "rules from var RATEWALL_RULES rejected: rules[0].limit.per"), "{}", bad.log());
    // The bad var on the state of the deployment whose var was good.
    bad.stop();
    let data = bad.state.join("data");
    std::fs::remove_dir_all(&data).unwrap();
    let copied = std::process::Command::new("cp").arg("-a").arg(good.state.join("data")).arg(&data).status().unwrap();
    assert!(copied.success());
    bad.restart().unwrap();
    let kit = [("x-user-id", "kit")];
    assert_eq!(statuses(&bad, "GET", "/u/x", &kit, 4), [200, 200, 200, 429], "{}", bad.log());
    assert_eq!(bad.metric("ratewall_config_rejected"), 0);
    assert!(logged(&bad, "rules loaded from KV RATEWALL_KV/rules.last_good"), "{}", bad.log());
}

/// `n` requests at once to `path` as `user`: their statuses and `RateLimit` fields.
fn at_once(w: &Workerd, path: &str, user: &str, n: usize) -> Vec<(u16, Option<String>)> {
    let gate = std::sync::Barrier::new(n);
    std::thread::scope(|s| {
        let all: Vec<_> = (0..n)
            .map(|_| {
                let gate = &gate;
                s.spawn(move || {
                    gate.wait();
                    let r = w.request("GET", path, &[("x-user-id", user)], &[]);
                    (r.status, r.header("ratelimit").map(str::to_owned))
                })
            })
            .collect();
        all.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A new client's 20 requests at once on a limit of 100 a minute are all admitted, on every
/// counting algorithm, and so are 20 more after a pause. The object's first answer comes
/// during the burst with a grant sized from one request; before the isolates' shares only 6
/// to 10 got through, the rest short denials (429, `Retry-After: 1`, `RateLimit` r=0).
#[test]
fn a_new_clients_burst_far_from_its_limit_is_admitted_whole() {
    let w = start(&[]);
    let mut failed = Vec::new();
    for (path, name) in [("/bs/x", "burst-sw"), ("/bt/x", "burst-tb"), ("/bf/x", "burst-fw"), ("/bl/x", "burst-sl")] {
        for pause in [Duration::from_millis(500), Duration::from_secs(2)] {
            let user = format!("{name}-{}", pause.as_millis());
            let first = at_once(&w, path, &user, 20);
            std::thread::sleep(pause);
            let next = at_once(&w, path, &user, 20);
            for (i, (status, fields)) in first.iter().chain(&next).enumerate() {
                if *status != 200 {
                    failed.push(format!("{user} request {i}: {status} {fields:?}"));
                }
            }
        }
    }
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(w.metric("ratewall_short_denials"), 0);
}

/// On rules decided on isolate grants, a client that spends its limit, is refused, and waits
/// exactly the `Retry-After` it got, is admitted: sliding logs, a token bucket and a sliding
/// window, costs 1 and 2, ten clients each, half of them sending back to back and half 600 ms
/// apart (before: some were refused again, with a short denial).
#[test]
fn a_client_that_waits_its_retry_after_is_admitted_on_grant_decided_rules() {
    let w = start(&[]);
    let failed: Vec<String> = std::thread::scope(|s| {
        let clients: Vec<_> = ["/sl5/x", "/sl10/x", "/tb10/x", "/sw10/x"]
            .into_iter()
            .flat_map(|path| (0..10).map(move |i| (path, i)))
            .map(|(path, i)| {
                let w = &w;
                s.spawn(move || {
                    let user = format!("wait{path}{i}");
                    let h = [("x-user-id", user.as_str())];
                    let mut codes = Vec::new();
                    let refused = loop {
                        let r = w.request("GET", path, &h, &[]);
                        codes.push(r.status);
                        if r.status != 200 {
                            break r;
                        }
                        if codes.len() > 20 {
                            // The limit comes back as fast as this client spends it.
                            return None;
                        }
                        std::thread::sleep(Duration::from_millis(if i % 2 == 0 { 0 } else { 600 }));
                    };
                    let wait: u64 = refused.header("retry-after").map_or(0, |v| v.parse().unwrap());
                    std::thread::sleep(Duration::from_secs(wait));
                    let again = w.request("GET", path, &h, &[]);
                    (again.status != 200).then(|| {
                        format!(
                            "{user}: {codes:?}, Retry-After {wait}, then {} {:?}",
                            again.status,
                            again.header("ratelimit")
                        )
                    })
                })
            })
            .collect();
        clients.into_iter().filter_map(|c| c.join().unwrap()).collect()
    });
    assert!(failed.is_empty(), "{} of 40: {failed:?}", failed.len());
    assert_eq!(w.metric("ratewall_short_denials"), 0);
}

/// A request an exact rule rejects costs the rules decided on the isolate's grants nothing,
/// though the isolate reported their units while the exact rule's object was asked: "rB"
/// (2 a day) keeps both its units for `/rx/a` after "rA" (1 a day) rejected a second
/// `/rx/b`, at the isolate and at the object (before: `/rx/a` got a 429 with `"rB";r=0`).
#[test]
fn a_request_an_exact_rule_rejects_costs_a_grant_decided_rule_nothing() {
    let w = start(&[]);
    let rex = [("x-user-id", "rex")];
    assert_eq!(statuses(&w, "GET", "/rx/b", &rex, 2), [200, 429]);
    // The refund runs after the 429 is sent.
    std::thread::sleep(Duration::from_millis(500));
    let r = w.request("GET", "/rx/a", &rex, &[]);
    assert_eq!(r.status, 200, "{:?}", r.header("ratelimit"));
    assert_eq!(ratelimit(&r)[0], ("rB".to_owned(), 0, ratelimit(&r)[0].2));
    // Once the reports have landed the isolate's copy is the object's count: two units, whose
    // first comes back in 12 h (three would be 24 h).
    std::thread::sleep(Duration::from_millis(1000));
    let r = w.request("GET", "/rx/a", &rex, &[]);
    assert_eq!(r.status, 429);
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!(retry <= 12 * 3600, "Retry-After {retry}: the object counts three units");
}

/// An origin that answers a request's `expect: 100-continue` with `100 Continue` before
/// reading its body (as HTTP/1.1 servers do), then `200` with the body's length.
fn continuing_origin() -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut stream = stream;
                let mut got = Vec::new();
                let mut buf = [0u8; 65536];
                let head_end = loop {
                    if let Some(p) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        break p + 4;
                    }
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                };
                let head = String::from_utf8_lossy(&got[..head_end]).to_ascii_lowercase();
                if head.contains("expect: 100-continue") {
                    let _ = stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
                }
                let length = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:").and_then(|v| v.trim().parse::<usize>().ok()));
                let mut body = got.len() - head_end;
                // A length, or a chunked body up to its last chunk.
                while length.map_or(!got.ends_with(b"0\r\n\r\n"), |l| body < l) {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            body += n;
                            got.extend_from_slice(&buf[..n]);
                        }
                    }
                }
                let text = format!("{body}");
                let answer =
                    format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}", text.len());
                let _ = stream.write_all(answer.as_bytes());
            });
        }
    });
    format!("http://{addr}")
}

/// POSTs `body` to the Worker with `expect: 100-continue`, sending the body once the Worker
/// answers `100 Continue` or after a second without (as curl does): the final status.
fn post_expecting_continue(w: &Workerd, path: &str, body: &[u8]) -> u16 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(&w.addr).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {}\r\nconnection: close\r\nx-user-id: poster\r\ncontent-length: {}\r\nexpect: 100-continue\r\n\r\n",
        w.addr,
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    if let Ok(n) = s.read(&mut buf) {
        got.extend_from_slice(&buf[..n]);
    }
    s.write_all(body).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    loop {
        // The first status that is not an interim one, once its head is complete.
        let text = String::from_utf8_lossy(&got).into_owned();
        let finals = text.split("HTTP/1.1 ").skip(1).filter_map(|r| {
            let status: u16 = r.get(..3)?.parse().ok()?;
            (status >= 200 && r.contains("\r\n\r\n")).then_some(status)
        });
        if let Some(status) = finals.into_iter().next() {
            return status;
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => panic!("no final answer: {text}"),
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// A client's `expect: 100-continue` (curl's, for a large body) does not reach the origin:
/// the Worker sends it the whole body, and the origin's answer comes back. Forwarded, the
/// origin answered `100 Continue`, which the runtime's `fetch` gave as the final answer, and
/// the Worker panicked passing it on (a 500 after about a second, the isolate started over).
#[test]
fn a_clients_expect_100_continue_is_not_forwarded_to_the_origin() {
    let origin = continuing_origin();
    let w = start(&[("ORIGIN_URL", origin.as_str())]);
    let body = vec![b'x'; 2_000_000];
    for _ in 0..2 {
        assert_eq!(post_expecting_continue(&w, "/u/x", &body), 200, "{}", w.log());
    }
    assert!(!w.log().contains("panicked"), "{}", w.log());
}

/// Whatever status an origin answers, the Worker does not panic: one it cannot pass on (an
/// interim `100 Continue`, or a `101 Switching Protocols` to a request that asked for no
/// upgrade) is its own 502 with a problem body, and the isolate keeps its memory (its
/// metrics count on).
#[test]
fn an_origin_status_that_cannot_be_passed_on_is_a_502_and_the_isolate_lives_on() {
    const CONTINUE_THEN_OK: &[u8] =
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok";
    const SWITCHING: &[u8] = b"HTTP/1.1 101 Switching Protocols\r\nconnection: close\r\n\r\n";
    for (answer, at_once, status) in [(CONTINUE_THEN_OK, 25, 100), (SWITCHING, SWITCHING.len(), 101)] {
        let to = origin(answer, at_once, Duration::from_secs(2));
        let w = start(&[("ORIGIN_URL", to.as_str())]);
        for i in 1..=3 {
            let r = w.request("GET", "/m/x", &[("x-user-id", "cont")], &[]);
            assert_eq!(r.status, 502, "{status}: {}", r.text());
            assert_eq!(r.header("content-type"), Some("application/problem+json"));
            assert!(r.text().contains("\"status\":502"), "{}", r.text());
            assert_eq!(w.metric("ratewall_rule_allowed{rule=\"roomy\"}"), i, "the isolate kept its memory");
        }
        assert!(logged(&w, &format!("the origin answered with status {status}")), "{}", w.log());
        assert!(!w.log().contains("panicked"), "{}", w.log());
    }
}
