//! Hostile input against the built filter, counted in guest instructions (a metered plugin:
//! exact, the same on every run). On Envoy a callback that runs long is a worker thread
//! stalled for that long, so each test bounds what one client request, one rules push or one
//! store answer can cost, and checks that a rejected document leaves the rules in force.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_core::sync::{hex, sign, SyncRequest};
use ratewall_tests::host::{filter_wasm_path, HttpRequest, Node, Plugin, Vm};
use serde_json::{json, Value};

const SECOND: u64 = 1_000_000_000;
const T0: u64 = 1_700_000_000 * SECOND;
const SECRET: &str = "a-shared-secret-of-32-characters";

fn metered() -> Plugin {
    Plugin::metered(&std::fs::read(filter_wasm_path()).unwrap()).unwrap()
}

fn rules(list: Value) -> Value {
    json!({
        "identity": {"user": {"header": "x-user-id"}, "api_key": {"header": "x-api-key"}},
        "rules": list,
    })
}

/// Guest instructions `f` costs the VM.
fn cost(vm: &mut Vm, f: impl FnOnce(&mut Vm)) -> u64 {
    let before = vm.fuel_used();
    f(vm);
    vm.fuel_used() - before
}

#[test]
fn double_stars_against_a_long_path_cost_a_linear_scan() {
    let doc = rules(json!([
        {"name": "a", "match": {"path": "/**/**/x"}, "key": ["user"], "limit": {"requests": 5, "per": "1s"}},
        {"name": "b", "match": {"path": "/api/**/users/**/export"}, "key": ["user"], "limit": {"requests": 5, "per": "1s"}},
        {"name": "c", "match": {"path": "/**/**/**/x"}, "key": ["user"], "limit": {"requests": 5, "per": "1s"}},
    ]));
    let mut vm = Vm::start(&metered(), &Node::new(T0), doc.to_string().as_bytes()).unwrap();
    // 20 KB paths, inside Envoy's default header limit: they backtracked for 10^9 to 10^10
    // instructions (and trapped at 300 segments for three `**`). Now the cost is linear in
    // the path: measured ~560 instructions a byte for the three rules, most of it
    // normalizing the path (its trailing `/` takes the slow path) and ~140 a segment per rule.
    let a_path = |n: usize| format!("/{}", "a/".repeat(n));
    let users = |n: usize| format!("/api/{}", "users/".repeat(n));
    let mut u = 0;
    for (short, long) in [(a_path(5_000), a_path(10_000)), (users(1_750), users(3_500))] {
        let mut spend = |path: &str| {
            u += 1;
            let req = HttpRequest::new("GET", path).header("x-user-id", format!("u{u}"));
            cost(&mut vm, |vm| assert!(vm.request(&req).unwrap().passed))
        };
        let (a, b) = (spend(&short), spend(&long));
        assert!(b < 1_000 * long.len() as u64, "{b} instructions for a {}-byte path", long.len());
        assert!(b * 10 < a * 23, "twice the path cost {a} -> {b}: not linear");
    }
    // And matching still means what it meant.
    let hit = HttpRequest::new("GET", format!("{}x", a_path(10_000)).as_str()).header("x-user-id", "v");
    assert!((0..8).filter(|_| vm.request(&hit).unwrap().passed).count() == 5);
}

#[test]
fn a_document_too_large_to_build_is_refused_fast_and_the_rules_in_force_stay() {
    let good = rules(json!([{"name": "u", "key": ["user"], "limit": {"requests": 2, "per": "60s"}}]));
    let mut vm = Vm::start(&metered(), &Node::new(T0), good.to_string().as_bytes()).unwrap();
    let alice = HttpRequest::new("GET", "/").header("x-user-id", "alice");
    assert!(vm.request(&alice).unwrap().passed);
    let wide: serde_json::Map<String, Value> = (0..10_000).map(|i| (format!("k{i}"), json!(i))).collect();
    let mut unknown = good.clone();
    unknown["rules"][0]["x"] = Value::Object(wide.clone());
    let mut many_rules = good.clone();
    many_rules["rules"] = (0..8_000)
        .map(|i| json!({"name": format!("r{i}"), "key": ["user"], "limit": {"requests": 1, "per": "1s"}}))
        .collect();
    let mut many_plans = good.clone();
    many_plans["identity"]["plan"] = json!({"header": "x-plan"});
    many_plans["rules"][0]["plans"] = (0..5_000).map(|i| (format!("p{i}"), json!("unlimited"))).collect();
    let mut huge_table = good.clone();
    huge_table["filter"] = json!({"slots": 1u64 << 24});
    let repeated = format!("{{{},{}}}", &good.to_string()[1..good.to_string().len() - 1], r#""rules":[]"#);
    for (what, doc) in [
        ("an unknown field of 10,000 keys", unknown.to_string()),
        ("8,000 rules", many_rules.to_string()),
        ("5,000 plans", many_plans.to_string()),
        ("2^24 slots", huge_table.to_string()),
        ("a repeated key", repeated),
    ] {
        let mut loaded = true;
        let spent = cost(&mut vm, |vm| loaded = vm.configure(doc.as_bytes()).unwrap());
        // The filter never refuses a configuration (a refusal stops NGINX): a bad document is
        // said at error level and the rules in force stay, as checked below.
        let _ = loaded;
        // Linear in the document (measured ~210 instructions a byte, most of it reading the
        // JSON): a 1 MiB document, the largest accepted, stays well under 10^9.
        assert!(spent < 400 * doc.len() as u64 + 1_000_000, "{what}: {spent} instructions for {} bytes", doc.len());
        // The rules in force are still the good ones.
        let fresh = HttpRequest::new("GET", "/").header("x-user-id", what);
        let policy = vm.request(&fresh).unwrap().header("ratelimit-policy").map(str::to_owned);
        assert_eq!(policy.as_deref(), Some("\"u\";q=2;w=60"), "{what}: the previous rules were lost");
    }
    // And their counters: alice has one request left, then a 429.
    assert_eq!((0..3).map(|_| vm.request(&alice).unwrap().passed).collect::<Vec<_>>(), [true, false, false]);
}

#[test]
fn the_largest_table_accepted_is_built_within_a_callback_budget() {
    let doc = rules(json!([{"name": "u", "key": ["user"], "limit": {"requests": 2, "per": "60s"}}]));
    let mut doc = doc;
    doc["filter"] = json!({"slots": ratewall_core::rules::MAX_SLOTS});
    let node = Node::new(T0);
    let mut vm = Vm::start(&metered(), &node, br#"{"rules":[]}"#).unwrap();
    let mut loaded = false;
    // The table is created by the first call after configure (no shared data is touched at
    // configure, where a host without it would trap).
    let spent = cost(&mut vm, |vm| {
        loaded = vm.configure(doc.to_string().as_bytes()).unwrap();
        let _ = vm.request(&HttpRequest::new("GET", "/").header("x-user-id", "a"));
    });
    assert!(loaded);
    assert!(spent < 1_000_000_000, "{spent} instructions to create the largest table");
    assert!(node.shared_data_size().0 >= (ratewall_core::rules::MAX_SLOTS / 8) as usize);
}

#[test]
fn a_long_identity_is_hashed_once_however_many_rules_key_on_it() {
    let list: Vec<Value> = (0..1_000)
        .map(|i| json!({"name": format!("r{i}"), "key": ["api_key"], "limit": {"requests": 100, "per": "60s"}}))
        .collect();
    let mut vm = Vm::start(&metered(), &Node::new(T0), rules(json!(list)).to_string().as_bytes()).unwrap();
    let short = HttpRequest::new("GET", "/").header("x-api-key", "k");
    let long_key = "k".repeat(60 * 1024);
    let long = HttpRequest::new("GET", "/").header("x-api-key", long_key.as_str());
    vm.request(&short).unwrap();
    vm.request(&long).unwrap();
    let with_short = cost(&mut vm, |vm| assert!(vm.request(&short).unwrap().passed));
    let with_long = cost(&mut vm, |vm| assert!(vm.request(&long).unwrap().passed));
    // A 60 KiB value was FNV-hashed per matching rule: 2·10^9 instructions for 1,000 rules.
    // Once per request it is some 10^6 on top of what the rules cost anyway.
    assert!(with_long < with_short + 3_000_000, "short key {with_short}, 60 KiB key {with_long}");
}

#[test]
fn an_oversized_store_answer_is_refused_unread() {
    let mut doc = rules(json!([{"name": "u", "key": ["user"], "limit": {"requests": 100, "per": "60s"}}]));
    doc["sync"] = json!({"cluster": "store", "secret": SECRET, "interval": "100ms"});
    let node = Node::new(T0);
    let mut vm = Vm::start(&metered(), &node, doc.to_string().as_bytes()).unwrap();
    assert!(vm.request(&HttpRequest::new("GET", "/").header("x-user-id", "u")).unwrap().passed);
    node.advance(SECOND / 10);
    vm.tick().unwrap();
    let calls = vm.take_callouts();
    let call = calls.first().expect("a batch");
    assert_eq!(SyncRequest::decode(&call.body).unwrap().deltas.len(), 1);
    // 16 MB with a well-formed (but wrong) signature: hashing it cost 122 instructions a byte.
    let body = vec![0u8; 16 << 20];
    let fake = "0".repeat(64);
    let spent = cost(&mut vm, |vm| vm.respond(call, 200, &[("x-ratewall-signature", fake.as_bytes())], body).unwrap());
    assert!(spent < 1_000_000, "{spent} instructions for a 16 MB answer");
    assert_eq!(node.metric("ratewall_sync_failed"), 1, "the oversized answer counts as a failed sync");
    assert!(node.logs().iter().any(|(_, l)| l.contains("refused unread")), "{:?}", node.logs());
}

#[test]
fn a_signed_store_clock_far_from_ours_is_refused() {
    let mut doc = rules(json!([{"name": "u", "key": ["user"], "algorithm": "fixed_window",
                                "limit": {"requests": 3, "per": "1s"}}]));
    doc["sync"] = json!({"cluster": "store", "secret": SECRET, "interval": "100ms", "nodes": 1});
    let node = Node::new(T0);
    let mut vm = Vm::start(&Plugin::filter().unwrap(), &node, doc.to_string().as_bytes()).unwrap();
    let user = HttpRequest::new("GET", "/").header("x-user-id", "u");
    assert!(vm.request(&user).unwrap().passed);
    let mut store = ratewall_core::sync::Store::new(100, 10 * SECOND);
    // A store whose (signed) clock claims a year from now, then the end of time.
    for store_now in [node.now() + 366 * 86_400 * SECOND, u64::MAX] {
        node.advance(SECOND / 10);
        vm.tick().unwrap();
        for c in vm.take_callouts() {
            let req = SyncRequest::decode(&c.body).unwrap();
            let out = store.handle(store_now, &req).unwrap().encode();
            let sig = hex(&sign(SECRET.as_bytes(), &out));
            vm.respond(&c, 200, &[("x-ratewall-signature", sig.as_bytes())], out).unwrap();
        }
    }
    assert!(node.metric("ratewall_sync_failed") >= 1, "{:?}", node.logs());
    // The windows are still today's: after a second the client has its quota back, and is
    // never told to wait for years.
    node.advance(2 * SECOND);
    let r = vm.request(&user).unwrap();
    assert!(r.passed, "{:?}", r.header("retry-after"));
    for _ in 0..5 {
        if let Some(wait) = vm.request(&user).unwrap().header("retry-after") {
            assert!(wait.parse::<u64>().unwrap() <= 2, "told to wait {wait} s");
        }
    }
}

#[test]
fn repeated_forwarded_for_fields_cannot_rotate_past_a_per_ip_limit() {
    let doc = json!({
        "identity": {"ip": {"trusted_hops": 1}},
        "rules": [{"name": "ip", "key": ["ip"], "limit": {"requests": 3, "per": "60s"}}]
    });
    let mut vm = Vm::start(&Plugin::filter().unwrap(), &Node::new(T0), doc.to_string().as_bytes()).unwrap();
    // The trusted proxy appended 203.0.113.7 on a line of its own; the client's spoofed line
    // comes first and changes every time.
    let passed = (0..10)
        .filter(|i| {
            let req = HttpRequest::new("GET", "/")
                .header("x-forwarded-for", format!("10.9.8.{i}"))
                .header("x-forwarded-for", "203.0.113.7");
            vm.request(&req).unwrap().passed
        })
        .count();
    assert_eq!(passed, 3);
}

#[test]
fn table_resizes_leave_bounded_shared_data() {
    let doc = |slots: u32| {
        let mut d = rules(json!([{"name": "u", "key": ["user"], "limit": {"requests": 5, "per": "60s"}}]));
        d["filter"] = json!({"slots": slots});
        d.to_string()
    };
    let node = Node::new(T0);
    let mut vm = Vm::start(&Plugin::filter().unwrap(), &node, doc(4096).as_bytes()).unwrap();
    let fill = |vm: &mut Vm| {
        for i in 0..2_000 {
            vm.request(&HttpRequest::new("GET", "/").header("x-user-id", format!("u{i}"))).unwrap();
        }
    };
    fill(&mut vm);
    let (_, one_table) = node.shared_data_size();
    // An operator pushes one size after another, back and forth.
    for slots in [5_000, 8_192, 65_536, 4_096, 100_000, 5_000, 4_096] {
        assert!(vm.configure(doc(slots).as_bytes()).unwrap());
        fill(&mut vm);
    }
    let (keys, bytes) = node.shared_data_size();
    // Sizes are powers of two of buckets (512, 1,024, 8,192, 16,384 here), so the keys of
    // every table ever made are at most twice the largest's; the tables no longer in use
    // hold no entries.
    assert!(keys <= 2 * 16_384 + 16, "{keys} keys");
    assert!(bytes < one_table + 40 * keys, "{bytes} B after the resizes, {one_table} B for one table");
    // The table in force still counts.
    let u = HttpRequest::new("GET", "/").header("x-user-id", "u0");
    assert_eq!((0..8).filter(|_| vm.request(&u).unwrap().passed).count(), 4);
}
