//! The engine on the fake host, without sync: rules, identity, the table, metrics, replies.

use super::*;
use crate::host::Level;

const RULES: &str = r#"{
  "identity": {"user": {"header": "x-user-id"}, "plan": {"header": "x-plan"}, "ip": {"trusted_hops": 1}},
  "rules": [
    {"name": "user", "match": {"path": "/u/*"}, "key": ["user"], "limit": {"requests": 3, "per": "60s"}},
    {"name": "ip", "match": {"path": "/ip/*"}, "key": ["ip"], "limit": {"requests": 2, "per": "60s"}},
    {"name": "roomy", "match": {"path": "/m/*"}, "key": ["user"], "limit": {"requests": 5, "per": "60s"}},
    {"name": "tight", "match": {"path": "/m/*", "method": "POST"}, "key": ["user"], "limit": {"requests": 1, "per": "60s"}},
    {"name": "watch", "match": {"path": "/s/*"}, "key": ["user"], "mode": "shadow", "limit": {"requests": 1, "per": "60s"}},
    {"name": "strict", "match": {"path": "/cl/*"}, "key": ["user"], "on_store_failure": "closed", "limit": {"requests": 3, "per": "60s"}},
    {"name": "plan-d.x", "match": {"path": "/k/*"}, "key": ["user"], "limit": {"requests": 2, "per": "60s"},
     "plans": {"partner": {"requests": 4, "per": "60s"}, "internal": "unlimited"}}
  ]
}"#;

pub(super) fn header<'a>(r: &'a Reply, name: &str) -> Option<&'a str> {
    r.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

#[test]
fn admits_up_to_the_limit_then_answers_429_with_retry_after_and_counts_it() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 4), [200, 200, 200, 429]);
    let r = reply(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")]);
    assert_eq!(r.status, 429);
    let retry: u64 = header(&r, "retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    assert!(r.body.contains("\"violated-policies\":[\"user\"]"), "{}", r.body);
    assert_eq!(header(&r, "ratelimit-policy"), Some("\"user\";q=3;w=60"));
    assert_eq!(h.metric("ratewall_rule_user_allowed"), 3);
    assert_eq!(h.metric("ratewall_rule_user_rejected"), 2);
}

#[test]
fn each_key_has_its_own_counter_and_an_unkeyed_request_is_not_counted() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 3), [200; 3]);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "bob")], 1), [200]);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[], 5), [200; 5]);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "")], 1), [200], "an empty value is no value");
    assert_eq!(h.metric("ratewall_rule_user_unkeyed"), 6);
    assert_eq!(statuses(&e, &h, "GET", "/other", &[("x-user-id", "ann")], 1), [200], "no rule matches");
}

#[test]
fn a_passing_reply_carries_the_fields_of_the_most_restrictive_policy() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    let r = reply(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")]);
    assert!(r.passes());
    // The window is the clock's minute (T0 is 20 s into one): the unit spent weighs on the
    // sliding window until just past the minute's end, so the quota is whole in 41 s.
    assert_eq!(header(&r, "ratelimit"), Some("\"user\";r=2;t=41"));
    assert!(r.body.is_empty());
}

#[test]
fn a_denial_charges_no_other_rule() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    let carol = [("x-user-id", "carol")];
    assert_eq!(statuses(&e, &h, "POST", "/m/x", &carol, 4), [200, 429, 429, 429]);
    // roomy: 5 − the one admitted POST; the three denied by "tight" were refunded.
    let r = reply(&e, &h, "GET", "/m/x", &carol);
    assert!(header(&r, "ratelimit").unwrap().starts_with("\"roomy\";r=3;t="), "{r:?}");
}

#[test]
fn a_shadow_rule_never_rejects_but_counts_and_logs_what_it_would_have_rejected() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    assert_eq!(statuses(&e, &h, "GET", "/s/x", &[("x-user-id", "sam")], 3), [200; 3]);
    assert_eq!(h.metric("ratewall_rule_watch_shadow_rejected"), 2);
    assert!(h.logged("shadow rule \"watch\" would reject GET /s/x"));
    // On busy traffic, at most 10 such lines a second; the next says how many were not logged.
    let lines = |h: &FakeHost| h.logs.borrow().iter().filter(|(_, l)| l.contains("would reject")).count();
    h.advance(1_000 * MS);
    let before = lines(&h);
    statuses(&e, &h, "GET", "/s/x", &[("x-user-id", "sam")], 30);
    assert_eq!(h.metric("ratewall_rule_watch_shadow_rejected"), 32, "every one counted");
    assert_eq!(lines(&h) - before, crate::engine::SHADOW_LINES_PER_SECOND as usize);
    h.advance(1_000 * MS);
    statuses(&e, &h, "GET", "/s/x", &[("x-user-id", "sam")], 1);
    assert!(h.logged("would reject GET /s/x (20 more such lines not logged before this one)"));
}

#[test]
fn plans_choose_the_limit_and_unlimited_plans_are_not_counted() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    assert_eq!(statuses(&e, &h, "GET", "/k/x", &[("x-user-id", "a")], 3), [200, 200, 429]);
    let partner = [("x-user-id", "b"), ("x-plan", "partner")];
    assert_eq!(statuses(&e, &h, "GET", "/k/x", &partner, 5), [200, 200, 200, 200, 429]);
    let internal = [("x-user-id", "c"), ("x-plan", "internal")];
    assert_eq!(statuses(&e, &h, "GET", "/k/x", &internal, 10), [200; 10]);
}

#[test]
fn metric_names_are_made_safe() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    let _ = reply(&e, &h, "GET", "/k/x", &[("x-user-id", "a")]);
    assert_eq!(h.metric("ratewall_rule_plan_d_x_allowed"), 1);
}

#[test]
fn the_vms_of_one_node_share_their_counters_through_shared_data() {
    let a = FakeHost::new();
    let b = FakeHost::joining(a.shared.clone());
    let (ea, eb) = (engine(&a, RULES), engine(&b, RULES));
    let ann = [("x-user-id", "ann")];
    assert_eq!(statuses(&ea, &a, "GET", "/u/x", &ann, 2), [200, 200]);
    assert_eq!(statuses(&eb, &b, "GET", "/u/x", &ann, 2), [200, 429], "the other VM sees the first two");
}

#[test]
fn the_client_ip_is_the_trusted_hop_of_x_forwarded_for_and_repeated_fields_are_one_list() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    *h.peer.borrow_mut() = Some("10.0.0.1:5000".into());
    let xff = |v: &'static str| [("x-forwarded-for", v)];
    assert_eq!(statuses(&e, &h, "GET", "/ip/x", &xff("198.51.100.1, 203.0.113.7"), 3), [200, 200, 429]);
    assert_eq!(
        statuses(&e, &h, "GET", "/ip/x", &xff("192.0.2.9, 203.0.113.7"), 1),
        [429],
        "only the trusted hop counts"
    );
    // A client that rotates a spoofed first line cannot escape: the lines are one list.
    let rotated = [("x-forwarded-for", "192.0.2.1"), ("x-forwarded-for", "203.0.113.7")];
    assert_eq!(statuses(&e, &h, "GET", "/ip/x", &rotated, 1), [429]);
    assert_eq!(statuses(&e, &h, "GET", "/ip/x", &xff("203.0.113.8"), 1), [200]);
}

#[test]
fn without_trusted_hops_the_peer_address_is_the_client() {
    let h = FakeHost::new();
    let doc = RULES.replace(r#""ip": {"trusted_hops": 1}"#, r#""ip": {"trusted_hops": 0}"#);
    let e = engine(&h, &doc);
    *h.peer.borrow_mut() = Some("203.0.113.7:443".into());
    let spoof = [("x-forwarded-for", "198.51.100.1")];
    assert_eq!(statuses(&e, &h, "GET", "/ip/x", &spoof, 3), [200, 200, 429]);
    *h.peer.borrow_mut() = Some("203.0.113.8:443".into());
    assert_eq!(statuses(&e, &h, "GET", "/ip/x", &spoof, 1), [200], "X-Forwarded-For is ignored");
    *h.peer.borrow_mut() = None;
    assert_eq!(statuses(&e, &h, "GET", "/ip/x", &[], 3), [200; 3], "no address: not counted");
    assert!(h.metric("ratewall_rule_ip_unkeyed") >= 3);
}

#[test]
fn pseudo_headers_missing_from_the_map_are_read_by_name() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    h.map_omits_pseudo.set(true);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 4), [200, 200, 200, 429]);
    assert_eq!(statuses(&e, &h, "POST", "/m/x", &[("x-user-id", "bo")], 2), [200, 429], "the method too");
}

#[test]
fn cas_contention_past_the_retries_fails_the_check_by_its_policy() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    let ann = [("x-user-id", "ann")];
    let _ = reply(&e, &h, "GET", "/u/x", &ann); // the bucket exists from here on
    let _ = reply(&e, &h, "GET", "/cl/x", &ann);
    h.cas_always_fails.set(true);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 5), [200; 5], "open: admitted");
    assert_eq!(h.metric("ratewall_rule_user_cas_exhausted"), 5);
    let r = reply(&e, &h, "GET", "/cl/x", &ann);
    assert_eq!(r.status, 503, "closed: refused");
    assert_eq!(header(&r, "retry-after"), Some("1"));
    h.cas_always_fails.set(false);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 3), [200, 200, 429], "nothing was lost or reset");
}

#[test]
fn a_few_cas_conflicts_are_retried_and_counted() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    let ann = [("x-user-id", "ann")];
    let _ = reply(&e, &h, "GET", "/u/x", &ann);
    h.cas_conflicts.set(2);
    assert_eq!(reply(&e, &h, "GET", "/u/x", &ann).status, 200);
    assert_eq!(h.metric("ratewall_table_cas_conflicts"), 2);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 2), [200, 429], "the conflicted request counted once");
}

#[test]
fn broken_shared_data_fails_open_rules_open_and_closed_rules_with_503() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    h.shared_broken.set(true);
    let ann = [("x-user-id", "ann")];
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 4), [200; 4]);
    assert_eq!(statuses(&e, &h, "GET", "/cl/x", &ann, 1), [503]);
    assert_eq!(h.metric("ratewall_rule_user_store_failed"), 4);
    assert_eq!(h.metric("ratewall_rule_strict_store_failed"), 1);
}

#[test]
fn a_corrupt_bucket_is_counted_and_replaced() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    let ann = [("x-user-id", "ann")];
    let _ = reply(&e, &h, "GET", "/u/x", &ann);
    for key in h.shared_keys() {
        h.shared_set(&key, b"\xff garbage", None).unwrap();
    }
    assert_eq!(reply(&e, &h, "GET", "/u/x", &ann).status, 200);
    assert!(h.metric("ratewall_table_corrupt") >= 1);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 3), [200, 200, 429], "counting goes on");
}

#[test]
fn counters_the_host_dropped_are_counted_and_said_once_a_minute() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    let ann = [("x-user-id", "ann")];
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 3), [200, 200, 200]);
    assert_eq!(h.metric("ratewall_table_lost"), 0, "a table just created has lost nothing");
    for key in h.shared_keys().iter().filter(|k| k.starts_with("rw1/")) {
        h.evict(key);
    }
    // Its count is gone with its bucket (the client is under its limit again): said, not hidden.
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 1), [200]);
    assert!(h.metric("ratewall_table_lost") >= 1);
    let said =
        |h: &FakeHost| h.logs.borrow().iter().filter(|(_, l)| l.contains("counters were dropped by the host")).count();
    assert_eq!(said(&h), 1);
    for key in h.shared_keys().iter().filter(|k| k.starts_with("rw1/")) {
        h.evict(key);
    }
    let _ = statuses(&e, &h, "GET", "/u/x", &ann, 1);
    assert_eq!(said(&h), 1, "once a minute");
}

#[test]
fn a_bucket_a_newer_vm_wrote_is_left_as_it_is() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    let ann = [("x-user-id", "ann")];
    let _ = reply(&e, &h, "GET", "/u/x", &ann);
    let newer = b"\x0a a later encoding".to_vec();
    for key in h.shared_keys() {
        h.shared_set(&key, &newer, None).unwrap();
    }
    // Decided as a store failure (the rule is open: admitted), and not overwritten.
    assert_eq!(reply(&e, &h, "GET", "/u/x", &ann).status, 200);
    assert_eq!(h.metric("ratewall_rule_user_store_failed"), 1);
    assert!(h.shared_keys().iter().all(|k| h.shared_value(k) == Some(newer.clone())));
    assert_eq!(h.metric("ratewall_table_corrupt"), 0);
}

#[test]
fn a_bad_document_is_an_error_that_names_the_field() {
    let h = FakeHost::new();
    let err =
        Engine::configure(&h, br#"{"rules":[{"name":"x","key":["nobody"],"limit":{"requests":1,"per":"1s"}}]}"#, None)
            .unwrap_err();
    assert_eq!(err.path, "rules[0].key[0]");
    assert!(Engine::configure(&h, b"{ broken", None).is_err());
}

#[test]
fn a_pushed_document_with_the_same_limits_keeps_the_counts() {
    let h = FakeHost::new();
    let first = engine(&h, RULES);
    let ann = [("x-user-id", "ann")];
    assert_eq!(statuses(&first, &h, "GET", "/u/x", &ann, 2), [200, 200]);
    let second = Engine::configure(&h, RULES.as_bytes(), Some(&first)).unwrap();
    assert_eq!(statuses(&second, &h, "GET", "/u/x", &ann, 2), [200, 429]);
}

#[test]
fn a_changed_limit_starts_a_counter_of_its_own() {
    let h = FakeHost::new();
    let first = engine(&h, RULES);
    let ann = [("x-user-id", "ann")];
    assert_eq!(statuses(&first, &h, "GET", "/u/x", &ann, 4), [200, 200, 200, 429]);
    let doc = RULES.replace(r#""requests": 3, "per": "60s""#, r#""requests": 4, "per": "60s""#);
    let second = Engine::configure(&h, doc.as_bytes(), Some(&first)).unwrap();
    assert_eq!(statuses(&second, &h, "GET", "/u/x", &ann, 5), [200, 200, 200, 200, 429]);
}

#[test]
fn a_resized_table_clears_the_old_one() {
    let h = FakeHost::new();
    let first = engine(&h, RULES);
    let _ = reply(&first, &h, "GET", "/u/x", &[("x-user-id", "ann")]);
    let old: Vec<String> =
        h.shared_keys().into_iter().filter(|k| h.shared_value(k).is_some_and(|v| !v.is_empty())).collect();
    assert!(!old.is_empty());
    let doc = RULES.replacen('{', r#"{"filter": {"slots": 4096},"#, 1);
    let _second = Engine::configure(&h, doc.as_bytes(), Some(&first)).unwrap();
    for k in &old {
        assert_eq!(h.shared_value(k).as_deref(), Some(&[][..]), "{k} still holds entries");
    }
}

#[test]
fn a_clock_that_steps_back_is_clamped_and_never_resets_a_counter() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    let ann = [("x-user-id", "ann")];
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 3), [200; 3]);
    h.now.set(T0 - 3_600 * 1_000 * MS);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 1), [429], "an hour back: still counted");
    h.now.set(0);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 1), [429], "the epoch: still counted");
    h.now.set(T0 + 61_000 * MS);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 1), [200], "the window passed");
}

#[test]
fn a_window_later_the_client_is_admitted_again() {
    let h = FakeHost::new();
    let e = engine(&h, RULES);
    let ann = [("x-user-id", "ann")];
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 4), [200, 200, 200, 429]);
    let retry: u64 = header(&reply(&e, &h, "GET", "/u/x", &ann), "retry-after").unwrap().parse().unwrap();
    h.advance(retry * 1_000 * MS);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 1), [200], "waiting Retry-After is enough");
}

use ratewall_core::{Nanos, SECOND};

const LEAKY: &str = r#"{
  "identity": {"user": {"header": "x-user-id"}},
  "rules": [
    {"name": "shape", "match": {"path": "/q/*"}, "key": ["user"],
     "limit": {"requests": 5, "per": "1s", "burst": 5, "algorithm": "leaky_bucket"}},
    {"name": "cap", "match": {"path": "/q/capped"}, "key": ["user"], "limit": {"requests": 3, "per": "60s"}}
  ]
}"#;

/// What the engine says to one request: `Ok(wait in ms)` for a pass (0: at once), `Err(status)`.
fn shaped(e: &Engine, h: &FakeHost, path: &str) -> Result<Nanos, u16> {
    h.request("GET", path, &[("x-user-id", "ann")]);
    let now = h.now();
    match e.on_request(h) {
        Verdict::Reply(r) | Verdict::Hold(r, _) if r.passes() => Ok(0),
        Verdict::Reply(r) | Verdict::Hold(r, _) => Err(r.status),
        Verdict::Wait(w) => Ok((w.until - now) / 1_000_000),
        Verdict::Ask(_) => panic!("no sync here"),
    }
}

#[test]
fn a_leaky_bucket_queues_a_burst_in_turns_and_rejects_past_its_queue() {
    let h = FakeHost::new();
    let e = engine(&h, LEAKY);
    let out: Vec<Result<Nanos, u16>> = (0..12).map(|_| shaped(&e, &h, "/q/x")).collect();
    let mut expected: Vec<Result<Nanos, u16>> = (0..6).map(|i| Ok(i * 200)).collect();
    expected.extend([Err(429); 6]);
    assert_eq!(out, expected);
    assert_eq!(h.metric("ratewall_rule_shape_delayed"), 5);
    assert_eq!(h.metric("ratewall_rule_shape_queue_full"), 6);
    h.request("GET", "/q/x", &[("x-user-id", "ann")]);
    let r = current(&e, &h);
    assert_eq!(header(&r, "retry-after"), Some("1"), "a place frees in 200 ms, rounded up");
}

/// A request that waits its turn goes with its `RateLimit` fields as of when it goes: `t`
/// that much nearer (it said the bucket drained a wait later than it did).
#[test]
fn a_waiting_requests_fields_are_as_of_when_it_goes() {
    let doc = LEAKY.replace(r#""requests": 5, "per": "1s", "burst": 5"#, r#""requests": 1, "per": "3s", "burst": 5"#);
    let h = FakeHost::new();
    let e = engine(&h, &doc);
    let t = |r: &ratewall_core::Reply| header(r, "ratelimit").unwrap().split(";t=").nth(1).unwrap().to_owned();
    h.request("GET", "/q/x", &[("x-user-id", "ann")]);
    let first = current(&e, &h);
    assert_eq!(t(&first), "3", "the bucket drains 3 s on");
    h.request("GET", "/q/x", &[("x-user-id", "ann")]);
    let Verdict::Wait(w) = e.on_request(&h) else { panic!("queued") };
    assert_eq!(w.until - h.now(), 3 * SECOND);
    // It goes 3 s on, when the bucket holds it alone: drained 3 s after that.
    assert_eq!(t(&w.reply), "3", "{:?}", w.reply.headers);
}

#[test]
fn a_waiter_that_goes_away_gives_its_turn_back_and_a_rejection_elsewhere_takes_no_turn() {
    let h = FakeHost::new();
    let e = engine(&h, LEAKY);
    assert_eq!(shaped(&e, &h, "/q/x"), Ok(0));
    h.request("GET", "/q/x", &[("x-user-id", "ann")]);
    let Verdict::Wait(w) = e.on_request(&h) else { panic!("queued") };
    assert_eq!(shaped(&e, &h, "/q/x"), Ok(400));
    // The 200 ms waiter leaves: the next request takes a turn 400 ms out, not 600.
    e.give_back(&h, w);
    assert_eq!(shaped(&e, &h, "/q/x"), Ok(400));
    // "cap" rejects its fourth request: the leaky bucket's turn is refunded with it.
    let h = FakeHost::new();
    let e = engine(&h, LEAKY);
    for _ in 0..3 {
        assert!(shaped(&e, &h, "/q/capped").is_ok());
        h.advance(SECOND);
    }
    assert_eq!(shaped(&e, &h, "/q/capped"), Err(429));
    assert_eq!(shaped(&e, &h, "/q/x"), Ok(0), "the rejected request took no turn");
}

const CONCURRENT: &str = r#"{
  "identity": {"user": {"header": "x-user-id"}},
  "rules": [
    {"name": "flight", "match": {"path": "/slow/*"}, "key": ["user"], "limit": {"concurrent": 2, "hold_max": "10s"}},
    {"name": "cap", "match": {"path": "/slow/capped"}, "key": ["user"], "limit": {"requests": 1, "per": "60s"}}
  ]
}"#;

/// A request's verdict: its status and the slots it holds.
fn held(e: &Engine, h: &FakeHost, path: &str) -> (u16, Option<crate::engine::Slots>, Reply) {
    h.request("GET", path, &[("x-user-id", "ann")]);
    match e.on_request(h) {
        Verdict::Hold(r, s) => (r.status, Some(s), r),
        Verdict::Reply(r) => (r.status, None, r),
        _ => panic!("no wait or ask here"),
    }
}

#[test]
fn a_concurrency_limit_holds_slots_until_requests_end_and_frees_them_after_hold_max() {
    let h = FakeHost::new();
    let e = engine(&h, CONCURRENT);
    let (s1, a, _) = held(&e, &h, "/slow/x");
    let (s2, b, _) = held(&e, &h, "/slow/x");
    let (s3, c, r) = held(&e, &h, "/slow/x");
    assert_eq!((s1, s2, s3), (200, 200, 429));
    assert!(a.is_some() && b.is_some() && c.is_none(), "a rejected request holds nothing");
    assert_eq!(header(&r, "retry-after"), Some("1"));
    assert_eq!(header(&r, "ratelimit-policy"), Some("\"flight\";q=2;qu=\"concurrent-requests\""));
    assert_eq!(h.metric("ratewall_rule_flight_in_flight"), 2);
    // One ends: its slot is free.
    e.release(&h, a.unwrap());
    assert_eq!(h.metric("ratewall_rule_flight_in_flight"), 1);
    let (s4, d, _) = held(&e, &h, "/slow/x");
    assert_eq!(s4, 200);
    // Two releases are lost: by hold_max the slots free.
    drop((b, d));
    h.advance(10 * SECOND);
    assert_eq!(held(&e, &h, "/slow/x").0, 200);
}

#[test]
fn a_slot_taken_by_a_request_another_rule_rejects_is_given_back() {
    let h = FakeHost::new();
    let e = engine(&h, CONCURRENT);
    let (ok, slots, _) = held(&e, &h, "/slow/capped");
    assert_eq!(ok, 200);
    assert_eq!(held(&e, &h, "/slow/capped").0, 429, "cap rejects the second");
    // The rejected one took no slot: one more fits beside the first.
    let (s, more, _) = held(&e, &h, "/slow/x");
    assert_eq!(s, 200);
    assert_eq!(held(&e, &h, "/slow/x").0, 429, "two in flight");
    drop((slots, more));
}

/// A waiting request's turn as the root's tick sees it now, in ms after the burst.
fn turn_ms(e: &Engine, h: &FakeHost, w: &crate::engine::Waiting, t0: Nanos) -> Nanos {
    (e.turn(h, w.turns(), w.until) - t0) / MS
}

#[test]
fn when_a_waiter_leaves_the_waiters_behind_it_move_up_and_none_share_a_turn() {
    // Two VMs of one node; the burst arrives on both. #0 goes at once, #1..#5 wait; #2 (400
    // ms) leaves; #6 arrives after. Before: #3 600, #4 800, #5 1000 and #6 1000 too.
    let a = FakeHost::new();
    let b = FakeHost::joining(a.shared.clone());
    let (ea, eb) = (engine(&a, LEAKY), engine(&b, LEAKY));
    let t0 = a.now.get();
    let mut waiting = Vec::new();
    for i in 0..6 {
        let (e, h) = if i % 2 == 0 { (&ea, &a) } else { (&eb, &b) };
        h.request("GET", "/q/x", &[("x-user-id", "ann")]);
        match e.on_request(h) {
            Verdict::Wait(w) => waiting.push(w),
            Verdict::Reply(r) => assert_eq!((i, r.status), (0, 200)),
            other => panic!("{other:?}"),
        }
    }
    let gone = waiting.remove(1);
    a.advance(100 * MS);
    b.advance(100 * MS);
    eb.give_back(&b, gone);
    b.request("GET", "/q/x", &[("x-user-id", "ann")]);
    let Verdict::Wait(last) = eb.on_request(&b) else { panic!("#6 waits") };
    waiting.push(last);
    let turns: Vec<Nanos> = waiting.iter().map(|w| turn_ms(&ea, &a, w, t0)).collect();
    assert_eq!(turns, [200, 400, 600, 800, 1000]);
    // A waiter that leaves after one moved up moves those behind it up again.
    let gone = waiting.remove(2);
    ea.give_back(&a, gone);
    let turns: Vec<Nanos> = waiting.iter().map(|w| turn_ms(&eb, &b, w, t0)).collect();
    assert_eq!(turns, [200, 400, 600, 800]);
}

#[test]
fn where_the_host_cannot_resume_a_waiter_it_is_refused_with_its_turn_as_retry_after() {
    let h = FakeHost::new();
    h.no_root_resume.set(true);
    let e = engine(&h, LEAKY);
    assert_eq!(shaped(&e, &h, "/q/x"), Ok(0), "a conforming request passes at once");
    h.request("GET", "/q/x", &[("x-user-id", "ann")]);
    let r = current(&e, &h);
    assert_eq!((r.status, header(&r, "retry-after")), (429, Some("1")), "never a wait, never a 500");
    assert_eq!(h.metric("ratewall_waits_refused"), 1);
    // It took no turn: waiting its Retry-After, it passes at once; sooner, not.
    h.advance(100 * MS);
    assert_eq!(shaped(&e, &h, "/q/x"), Err(429));
    h.advance(900 * MS);
    assert_eq!(shaped(&e, &h, "/q/x"), Ok(0));
}

#[test]
fn where_the_host_cannot_resume_a_waiter_a_client_that_waits_its_retry_after_passes_whatever_its_cost() {
    // Requests of 2 and 3 units: a full queue's 429 said when the request would fit the
    // queue, where such a host passes only what goes at once; waiting it, the client was
    // refused again.
    for (cost, rule) in [
        (2, r#""requests": 1, "per": "1s", "burst": 3, "delay": 1"#),
        (3, r#""requests": 2, "per": "1s", "burst": 6, "delay": 2"#),
    ] {
        let doc = format!(
            r#"{{"identity": {{"user": {{"header": "x-user-id"}}}}, "rules": [{{"name": "lb", "match": {{"path": "/q/*"}},
                "key": ["user"], "cost": {cost}, "limit": {{{rule}, "algorithm": "leaky_bucket"}}}}]}}"#
        );
        let h = FakeHost::new();
        h.no_root_resume.set(true);
        let e = engine(&h, &doc);
        let mut refused = 0;
        for i in 0..40 {
            h.request("GET", "/q/x", &[("x-user-id", "ann")]);
            let r = current(&e, &h);
            match header(&r, "retry-after") {
                None => assert_eq!(r.status, 200, "cost {cost}, request {i}"),
                Some(wait) => {
                    assert_eq!(r.status, 429);
                    refused += 1;
                    h.advance(wait.parse::<u64>().unwrap() * 1_000_000_000);
                    h.request("GET", "/q/x", &[("x-user-id", "ann")]);
                    let again = current(&e, &h);
                    assert_eq!(again.status, 200, "cost {cost}, request {i}: waited {wait} s");
                }
            }
            h.advance(300 * MS);
        }
        assert!(refused > 5, "cost {cost}: {refused}");
    }
}

#[test]
fn without_shared_data_the_engine_serves_open_counts_it_and_says_so() {
    // An earlier instance's first shared-data call never came back (it trapped: NGINX
    // without shm_kv): the counters the host keeps across instances say so.
    let h = FakeHost::new();
    let tried = h.define_counter("ratewall_shared_data_tried").unwrap();
    h.increment(tried, 1);
    let e = engine(&h, LEAKY);
    h.shared_broken.set(true);
    assert_eq!(statuses(&e, &h, "GET", "/q/x", &[("x-user-id", "ann")], 20), [200; 20]);
    assert_eq!(h.metric("ratewall_config_rejected"), 20);
    assert!(h.logs.borrow().iter().any(|(l, m)| *l == Level::Error && m.contains("shm_kv")), "{:?}", h.logs);
    assert!(h.shared_keys().is_empty(), "no shared-data call at all");
    // With shared data proven, the table is made at the first request, not at configure.
    let h = FakeHost::new();
    let e = engine(&h, LEAKY);
    assert!(h.shared_keys().is_empty(), "configure touches no shared data");
    assert_eq!(shaped(&e, &h, "/q/x"), Ok(0));
    assert!(h.shared_keys().len() > 1000);
}

#[test]
fn a_degraded_leaky_bucket_keeps_its_queue_scaled_with_its_rate() {
    use ratewall_core::{Algorithm, Limit};
    let leaky = Limit::new(Algorithm::LeakyBucket, 100, 60 * SECOND, Some(40)).unwrap().with_delay(20).unwrap();
    // A quarter of the traffic (with the 1/20 margin), or a fifth of it shared by 5 nodes.
    for (share, nodes, rate, queue, at_once) in [(u16::MAX / 4, 1, 26, 10, 5), (0, 5, 20, 8, 4)] {
        let l = crate::engine::share(leaky, share, nodes);
        assert_eq!(
            (l.algorithm(), l.requests(), l.burst(), l.delay()),
            (Algorithm::LeakyBucket, rate, Some(queue), at_once)
        );
    }
    // A bucket with no queue keeps none; a token bucket's burst scales.
    let strict = Limit::new(Algorithm::LeakyBucket, 100, 60 * SECOND, Some(0)).unwrap();
    assert_eq!(crate::engine::share(strict, 0, 4).burst(), Some(0));
    let bucket = Limit::new(Algorithm::TokenBucket, 100, 60 * SECOND, Some(40)).unwrap();
    assert_eq!(crate::engine::share(bucket, 0, 4).burst(), Some(10));
}

#[test]
fn a_vm_configuration_is_closed_open_or_not_understood() {
    use crate::engine::without_rules;
    assert_eq!(without_rules(br#"{"without_rules": "closed"}"#), Some(true));
    assert_eq!(without_rules(br#" {"without_rules":"open"} "#), Some(false));
    assert_eq!(without_rules(b""), Some(false), "none given: open, the default");
    assert_eq!(without_rules(b"  \n"), Some(false));
    // Not understood, and taken as closed by the glue: a typo never lets requests through unsaid.
    for bad in [
        &br#"{"without_rules": "clsoed"}"#[..],
        br#"{"without_rule": "closed"}"#,
        br#"{"without_rules": "closed", "x": 1}"#,
        br#"{"without_rules": true}"#,
        b"closed",
        br#"{"without_rules": "open""#,
    ] {
        assert_eq!(without_rules(bad), None, "{}", String::from_utf8_lossy(bad));
    }
}
