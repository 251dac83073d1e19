//! The built filter (`dist/ratewall_filter.wasm`) in the wasmtime proxy-wasm host: several
//! VMs per node sharing counters through shared data with Envoy's CAS semantics, driven by
//! a virtual clock.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_tests::host::{FilterResult, HttpRequest, Node, Plugin, Profile, Vm};
use serde_json::{json, Value};

const SECOND: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SECOND;
const EXAMPLE: &str = include_str!("../../examples/rules.json");

fn plugin() -> Plugin {
    Plugin::filter().unwrap_or_else(|e| panic!("{e}"))
}

/// A node at T0 behaving as `profile`, with `vms` VMs configured with `rules`.
fn node(profile: Profile, rules: &Value, vms: usize) -> (Node, Vec<Vm>) {
    let node = Node::with_profile(T0, profile);
    let doc = rules.to_string();
    let vms = (0..vms).map(|_| Vm::start(&plugin(), &node, doc.as_bytes()).unwrap()).collect();
    (node, vms)
}

fn rules(list: Value) -> Value {
    json!({
        "identity": {
            "user": {"header": "x-user-id"}, "api_key": {"header": "x-api-key"},
            "plan": {"header": "x-plan"}, "ip": {"trusted_hops": 1, "ipv6_prefix": 64}
        },
        "rules": list,
    })
}

fn user(name: &str) -> HttpRequest {
    HttpRequest::new("GET", "/v1/things").header("x-user-id", name)
}

fn admitted(vm: &mut Vm, req: &HttpRequest, n: usize) -> usize {
    (0..n).filter(|_| vm.request(req).unwrap().passed).count()
}

fn limits_hold_across_the_vms_of_one_node(p: Profile) {
    let (_, mut vms) =
        node(p, &rules(json!([{"name": "u", "key": ["user"], "limit": {"requests": 10, "per": "60s"}}])), 4);
    let req = user("alice");
    let passed = (0..40).filter(|i| vms[i % 4].request(&req).unwrap().passed).count();
    assert_eq!(passed, 10);
}

fn concurrent_worker_threads_never_over_admit(p: Profile) {
    // Real threads, one VM each, racing on one key: CAS must make the limit exact.
    for round in 0..10 {
        let (node, vms) =
            node(p, &rules(json!([{"name": "u", "key": ["user"], "limit": {"requests": 25, "per": "60s"}}])), 4);
        let handles: Vec<_> =
            vms.into_iter().map(|mut vm| std::thread::spawn(move || admitted(&mut vm, &user("racer"), 20))).collect();
        let total: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(total, 25, "round {round}");
        assert!(node.metric("ratewall_table_cas_conflicts") >= 0);
    }
}

#[test]
fn the_host_reproduces_envoys_unprotected_first_insert() {
    // Two writers both read NotFound; the second unconditional write silently wins. The
    // filter avoids this by creating its table keys at configure time.
    let node = Node::new(T0);
    assert_eq!(node.shared_get("k"), None);
    assert_eq!(node.set_shared("k", b"from-a", 0), 0);
    assert_eq!(node.set_shared("k", b"from-b", 0), 0, "cas 0 on an existing key is unconditional");
    assert_eq!(node.shared_get("k").as_deref(), Some(&b"from-b"[..]));
    assert_eq!(node.set_shared("k", b"stale", 12345), 8, "a stale cas is a CasMismatch");
    let (_, vms) = node_with_table();
    drop(vms);
}

fn node_with_table() -> (Node, Vec<Vm>) {
    let (node, mut vms) =
        node(Profile::Envoy, &rules(json!([{"name": "u", "key": ["user"], "limit": {"requests": 1, "per": "1s"}}])), 1);
    assert_eq!(node.shared_data_size().0, 0, "configure touches no shared data");
    // Every bucket key exists once the first request is counted.
    assert!(vms[0].request(&user("first")).unwrap().passed);
    let (keys, _) = node.shared_data_size();
    assert_eq!(keys, 65_536 / 8);
    (node, vms)
}

fn a_denied_request_charges_no_other_rule(p: Profile) {
    let (_, mut vms) = node(
        p,
        &rules(json!([
            {"name": "roomy", "key": ["user"], "limit": {"requests": 3, "per": "60s"}},
            {"name": "holds", "match": {"path": "/v1/holds", "method": "POST"}, "key": ["user"], "limit": {"requests": 1, "per": "60s"}}
        ])),
        1,
    );
    let vm = &mut vms[0];
    let hold = HttpRequest::new("POST", "/v1/holds").header("x-user-id", "u");
    assert!(vm.request(&hold).unwrap().passed);
    for _ in 0..10 {
        let r = vm.request(&hold).unwrap();
        assert_eq!(r.status, 429);
    }
    // "roomy" was charged by the one admitted hold only: two more GETs pass, then 429.
    let get = HttpRequest::new("GET", "/v1/other").header("x-user-id", "u");
    assert_eq!(admitted(vm, &get, 5), 2);
}

fn plans_raise_the_limit_and_internal_is_unlimited(p: Profile) {
    let (node, mut vms) = node(p, &serde_json::from_str(EXAMPLE).unwrap(), 2);
    let free = HttpRequest::new("GET", "/v1/x").header("x-api-key", "free");
    let partner = HttpRequest::new("GET", "/v1/x").header("x-api-key", "p").header("x-plan", "partner");
    let internal = HttpRequest::new("GET", "/v1/x").header("x-api-key", "i").header("x-plan", "internal");
    assert_eq!(admitted(&mut vms[0], &free, 300), 200, "burst of 200");
    assert_eq!(admitted(&mut vms[1], &partner, 300), 300);
    assert_eq!(admitted(&mut vms[0], &internal, 3000), 3000);
    let r = vms[1].request(&partner).unwrap();
    assert!(r.header("RateLimit-Policy").unwrap().contains("q=10000"));
    assert_eq!(node.metric("ratewall_rule_api_key_rejected"), 100);
}

fn shadow_rules_count_and_log_but_never_reject(p: Profile) {
    let (node, mut vms) = node(
        p,
        &rules(json!([{"name": "trial", "mode": "shadow", "key": ["user"], "limit": {"requests": 2, "per": "60s"}}])),
        1,
    );
    assert_eq!(admitted(&mut vms[0], &user("s"), 10), 10);
    assert_eq!(node.metric("ratewall_rule_trial_shadow_rejected"), 8);
    assert!(node.logs().iter().any(|(_, l)| l.contains("shadow rule \"trial\" would reject")));
}

#[test]
fn a_bad_config_is_rejected_and_the_old_rules_stay() {
    let (node, mut vms) = node(
        Profile::Envoy,
        &rules(json!([{"name": "u", "key": ["user"], "limit": {"requests": 2, "per": "60s"}}])),
        1,
    );
    let bad = rules(json!([{"name": "u", "key": ["user"], "limit": {"requests": 5, "per": "6O s"}}])).to_string();
    // Never refused to the proxy (on NGINX a refusal is fatal to the worker): said in the log.
    assert!(vms[0].configure(bad.as_bytes()).unwrap());
    assert!(vms[0].configure(b"{not json").unwrap());
    let logs = node.logs();
    assert!(
        logs.iter().any(|(lvl, l)| *lvl >= 3 && l.contains("rules[0].limit.per: \"6O s\" is not a duration")),
        "{logs:?}"
    );
    assert_eq!(admitted(&mut vms[0], &user("x"), 5), 2, "the previous limit of 2 still holds");
}

#[test]
fn a_bad_push_on_envoy_keeps_limiting_on_the_last_good_rules_in_the_new_root_context() {
    // Envoy starts a new root context in the running VM for every new document; it must serve
    // the last good rules, not none (and not the 503 of `without_rules: closed`).
    let good = rules(json!([{"name": "u", "key": ["user"], "limit": {"requests": 2, "per": "60s"}}])).to_string();
    let bad = good.replace("60s", "6O s");
    for requests_before in [true, false] {
        let node = Node::new(T0);
        let mut vms: Vec<Vm> = (0..2)
            .map(|_| {
                Vm::start_with_vm_config(&plugin(), &node, br#"{"without_rules": "closed"}"#, good.as_bytes()).unwrap()
            })
            .collect();
        if requests_before {
            assert!(vms[0].request(&user("x")).unwrap().passed);
        }
        for vm in &mut vms {
            // The filter never refuses a document (see glue.rs): the canary accepts, and a new
            // root context takes over.
            assert!(vm.configure(bad.as_bytes()).unwrap());
            assert_ne!(vm.root_contexts(), [1], "a new root context");
        }
        let passed = admitted(&mut vms[1], &user("x"), 3) + admitted(&mut vms[0], &user("x"), 3);
        assert_eq!(
            passed,
            if requests_before { 1 } else { 2 },
            "the limit of 2 still holds (requests before: {requests_before})"
        );
        assert_eq!(node.metric("ratewall_config_rejected"), 0, "no request went without rules");
        let logs = node.logs();
        assert!(
            logs.iter().any(|(lvl, l)| *lvl >= 3
                && l.contains("rules[0].limit.per: \"6O s\" is not a duration")
                && l.contains("keeping the previous rules")),
            "{logs:?}"
        );
        assert!(!logs.iter().any(|(_, l)| l.contains("no rules in force")), "{logs:?}");
        // A good push after it takes effect.
        let looser = good.replace("\"requests\":2", "\"requests\":3");
        assert!(vms[0].configure(looser.as_bytes()).unwrap());
        assert_eq!(admitted(&mut vms[0], &user("y"), 5), 3);
    }
}

#[test]
fn a_pushed_config_takes_effect_without_a_restart() {
    let (_, mut vms) = node(
        Profile::Envoy,
        &rules(json!([{"name": "u", "key": ["user"], "limit": {"requests": 2, "per": "60s"}}])),
        1,
    );
    assert_eq!(admitted(&mut vms[0], &user("a"), 5), 2);
    let looser = rules(json!([{"name": "u2", "key": ["user"], "limit": {"requests": 4, "per": "60s"}}])).to_string();
    assert!(vms[0].configure(looser.as_bytes()).unwrap());
    assert_eq!(admitted(&mut vms[0], &user("a"), 10), 4);
}

/// A push that takes a rule out sets its gauges to 0: nothing would set them again, and an
/// alert on one (`limited_keys`, `in_flight`) would fire for as long as the proxy runs.
#[test]
fn a_push_that_takes_a_rule_out_sets_its_gauges_to_zero() {
    let doc = |rules_list: Value| rules(rules_list).to_string();
    let u = json!({"name": "u", "match": {"path": "/u/*"}, "key": ["user"], "limit": {"requests": 1, "per": "60s"}});
    let c = json!({"name": "c", "match": {"path": "/c/*"}, "key": ["user"], "limit": {"concurrent": 5}});
    let kept =
        json!({"name": "kept", "match": {"path": "/k/*"}, "key": ["user"], "limit": {"requests": 1, "per": "60s"}});
    let (node, mut vms) = node(Profile::Envoy, &rules(json!([u, c, kept])), 1);
    let vm = &mut vms[0];
    for path in ["/u/x", "/k/x"] {
        let req = HttpRequest::new("GET", path).header("x-user-id", "a");
        assert_eq!(admitted(vm, &req, 3), 1);
    }
    let held = HttpRequest::new("GET", "/c/x").header("x-user-id", "a");
    for _ in 0..2 {
        assert!(matches!(vm.begin_forwarded(&held).unwrap(), ratewall_host::Forward::Upstream(_)));
    }
    vm.tick().unwrap();
    let gauges = |node: &Node| {
        ["u_limited_keys", "c_in_flight", "kept_limited_keys"].map(|g| node.metric(&format!("ratewall_rule_{g}")))
    };
    assert_eq!(gauges(&node), [1, 2, 1]);
    assert!(vm.configure(doc(json!([kept])).as_bytes()).unwrap());
    vm.tick().unwrap();
    assert_eq!(gauges(&node), [0, 0, 1], "the rules taken out at 0, the one kept as it was");
}

fn forwarded_for_entries_cannot_dodge_the_per_ip_limit(p: Profile) {
    let (_, mut vms) = node(p, &serde_json::from_str(EXAMPLE).unwrap(), 1);
    let mut passed = 0;
    for i in 0..30 {
        // The load balancer (trusted hop) appends the real client; the client prepends junk.
        let xff = format!("198.51.100.{i}, 10.9.{i}.1, 203.0.113.9");
        let req = HttpRequest::new("POST", "/v1/auth/login").header("x-forwarded-for", xff).from_addr("10.0.0.2:5555");
        passed += usize::from(vms[0].request(&req).unwrap().passed);
    }
    assert_eq!(passed, 10);
}

#[test]
fn under_envoys_connection_manager_trusted_hops_counts_envoys_own_append() {
    // Envoy with `use_remote_address: true` appends its downstream peer to X-Forwarded-For
    // before any filter runs, so under it `trusted_hops` is the proxies in front plus one: the
    // rules in envoy-config/envoy.yaml use 2 for one load balancer.
    let logins = |hops: u32, req: &dyn Fn(usize) -> HttpRequest| {
        let mut rules: Value = serde_json::from_str(EXAMPLE).unwrap();
        rules["identity"]["ip"]["trusted_hops"] = json!(hops);
        let (_, mut vms) = node(Profile::Envoy, &rules, 1);
        vms[0].append_peer_to_xff_as_envoy();
        (0..15).map(|i| usize::from(vms[0].request(&req(i)).unwrap().passed)).sum::<usize>()
    };
    // One load balancer (10.0.0.2) in front, which appended the client it saw; the client
    // rotates a spoofed entry of its own. One client: its 10 logins a minute.
    let one_client = |i: usize| {
        HttpRequest::new("POST", "/v1/auth/login")
            .header("x-forwarded-for", format!("198.51.100.{i}, 203.0.113.9"))
            .from_addr("10.0.0.2:5555")
    };
    assert_eq!(logins(2, &one_client), 10, "one client");
    // Fifteen clients behind that load balancer: each its own counter, not the balancer's.
    let many = |i: usize| {
        HttpRequest::new("POST", "/v1/auth/login")
            .header("x-forwarded-for", format!("203.0.113.{i}"))
            .from_addr("10.0.0.2:5555")
    };
    assert_eq!(logins(2, &many), 15, "each client its own counter");
    // Counting only the load balancer would key on Envoy's append, the balancer itself: every
    // client shares one counter (the trap the configuration avoids).
    assert_eq!(logins(1, &many), 10);
    // No proxy in front: Envoy's append is the client (1 hop); what it claims is not read.
    let direct = |i: usize| {
        HttpRequest::new("POST", "/v1/auth/login")
            .header("x-forwarded-for", format!("198.51.100.{i}"))
            .from_addr("203.0.113.9:4444")
    };
    assert_eq!(logins(1, &direct), 10);
    assert_eq!(logins(0, &direct), 10, "or the peer address, with 0");
}

fn ipv6_clients_are_limited_by_prefix(p: Profile) {
    let (_, mut vms) = node(p, &serde_json::from_str(EXAMPLE).unwrap(), 1);
    let passed = (0..30)
        .filter(|i| {
            let xff = format!("2001:db8:aa:bb:{i:x}::1");
            vms[0].request(&HttpRequest::new("POST", "/v1/auth/login").header("x-forwarded-for", xff)).unwrap().passed
        })
        .count();
    assert_eq!(passed, 10, "one /64 is one client");
}

fn disguised_paths_do_not_escape_a_rule(p: Profile) {
    let (_, mut vms) = node(p, &serde_json::from_str(EXAMPLE).unwrap(), 1);
    let paths = [
        "/v1/auth/login",
        "/v1/auth/login/",
        "//v1/auth/login",
        "/v1/./auth/login",
        "/v1/auth/%6Cogin",
        "/v1/auth/login?x=1",
    ];
    let passed = (0..24)
        .filter(|i| {
            vms[0].request(&HttpRequest::new("POST", paths[i % paths.len()]).from_addr("192.0.2.50:1")).unwrap().passed
        })
        .count();
    assert_eq!(passed, 10);
}

fn requests_missing_a_key_dimension_are_not_counted_but_are_measured(p: Profile) {
    let (node, mut vms) =
        node(p, &rules(json!([{"name": "u", "key": ["user"], "limit": {"requests": 1, "per": "60s"}}])), 1);
    assert_eq!(admitted(&mut vms[0], &HttpRequest::new("GET", "/"), 5), 5);
    assert_eq!(node.metric("ratewall_rule_u_unkeyed"), 5);
}

fn hostile_requests_never_trap(p: Profile) {
    let (_, mut vms) = node(p, &serde_json::from_str(EXAMPLE).unwrap(), 1);
    let vm = &mut vms[0];
    let big = vec![b'a'; 64 * 1024];
    let mut many = HttpRequest::new("POST", "/v1/auth/login");
    for i in 0..5000 {
        many = many.header(&format!("x-h{i}"), "v");
    }
    let cases = vec![
        HttpRequest::new("GET", "/v1/x").header("x-api-key", [0xff, 0xfe, 0x00, 0x80]),
        HttpRequest::new("GET", "/v1/x").header("x-api-key", &big).header("x-user-id", &big).header("x-plan", &big),
        HttpRequest::new("POST", "/v1/events/\u{0}/holds").header("x-user-id", [0xc3, 0x28]),
        HttpRequest::new("POST", "/v1/auth/login").header("x-forwarded-for", &big),
        HttpRequest::new("POST", "/v1/auth/login").header("x-forwarded-for", ",,,[::1,999.999.1.1, :::: , \u{7f}"),
        HttpRequest::new("POST", "/v1/auth/login").from_addr("not an address"),
        HttpRequest { headers: vec![], source_address: None },
        HttpRequest::new("\u{ff}\u{0}", &String::from_utf8_lossy(&big)),
        HttpRequest::new("GET", "%%%/../../..%2").header("x-plan", "internal"),
        many,
    ];
    for (i, req) in cases.iter().enumerate() {
        let r = vm.request(req).unwrap_or_else(|e| panic!("case {i} trapped: {e}"));
        assert!(r.status == 200 || r.status == 429, "case {i}: {}", r.status);
    }
}

/// The seed trace through the filter: 10 per second, 10 requests at 0.99 s, 10 at 1.01 s.
fn the_seed_trace_through_the_filter(p: Profile) {
    for (algorithm, expected) in
        [("fixed_window", 20), ("sliding_log", 10), ("token_bucket", 10), ("sliding_window", 11)]
    {
        let rule =
            json!([{"name": "seed", "algorithm": algorithm, "key": ["user"], "limit": {"requests": 10, "per": "1s"}}]);
        let (node, mut vms) = node(p, &rules(rule), 2);
        // Start on a second boundary so windows are aligned as in the trace.
        node.set_time(T0 + 990 * MS);
        let mut passed = admitted(&mut vms[0], &user("s"), 10);
        node.set_time(T0 + 1010 * MS);
        passed += admitted(&mut vms[1], &user("s"), 10);
        assert_eq!(passed, expected, "{algorithm}");
    }
}

fn waiting_exactly_retry_after_is_enough(p: Profile) {
    for algorithm in ["fixed_window", "sliding_log", "token_bucket", "sliding_window"] {
        let rule =
            json!([{"name": "w", "algorithm": algorithm, "key": ["user"], "limit": {"requests": 3, "per": "10s"}}]);
        let (node, mut vms) = node(p, &rules(rule), 1);
        node.set_time(T0 + 4321 * MS);
        assert_eq!(admitted(&mut vms[0], &user("w"), 3), 3);
        let r: FilterResult = vms[0].request(&user("w")).unwrap();
        assert_eq!(r.status, 429);
        let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
        // Retry-After is rounded up to whole seconds, so the wait may be a little long, never
        // short (the core's property tests pin the exact nanosecond boundary).
        node.advance(retry * SECOND);
        assert!(vms[0].request(&user("w")).unwrap().passed, "{algorithm}: waited Retry-After = {retry}s");
    }
}

fn allowed_responses_carry_parseable_ratelimit_fields(p: Profile) {
    let (_, mut vms) = node(p, &serde_json::from_str(EXAMPLE).unwrap(), 1);
    let r = vms[0]
        .request(&HttpRequest::new("POST", "/v1/events/9/holds").header("x-user-id", "u").header("x-api-key", "k"))
        .unwrap();
    assert!(r.passed);
    let policy: sfv::List = sfv::Parser::new(r.header("ratelimit-policy").unwrap()).parse().unwrap();
    let state: sfv::List = sfv::Parser::new(r.header("ratelimit").unwrap()).parse().unwrap();
    // Both rules that counted it, the most restrictive first.
    assert_eq!(policy.len(), 2);
    assert_eq!(state.len(), 2);
    assert!(r.header("ratelimit").unwrap().starts_with("\"holds-per-user\";r=4;t="));
    assert!(r.header("ratelimit").unwrap().contains(", \"api-key\";r=199;t="), "{:?}", r.header("ratelimit"));
}

fn memory_stays_bounded_under_a_flood_of_distinct_keys_and_a_limited_client_stays_limited(p: Profile) {
    let doc = json!({
        "identity": {"ip": {"trusted_hops": 1}},
        "filter": {"slots": 4096, "hash_seed": "test-secret"},
        "rules": [{"name": "ip", "key": ["ip"], "limit": {"requests": 5, "per": "60s"}}]
    });
    let (node, mut vms) = node(p, &doc, 1);
    let victim = HttpRequest::new("GET", "/").header("x-forwarded-for", "203.0.113.200");
    assert_eq!(admitted(&mut vms[0], &victim, 10), 5);
    let (keys_before, bytes_before) = node.shared_data_size();
    let mut memory_warm = 0;
    for i in 0..100_000u32 {
        let ip = format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255);
        // Header maps of every size, small and large, through the guest's allocator.
        let pad = "p".repeat((i as usize * 37) % 700);
        let r =
            vms[0].request(&HttpRequest::new("GET", "/").header("x-forwarded-for", ip).header("x-pad", pad)).unwrap();
        assert!(r.passed);
        if i % 10_000 == 0 {
            node.advance(MS);
        }
        if i == 1_000 {
            memory_warm = vms[0].memory_bytes();
        }
    }
    assert_eq!(vms[0].memory_bytes(), memory_warm, "the guest's memory must not grow with traffic");
    let (keys, bytes) = node.shared_data_size();
    assert_eq!(keys, keys_before, "no shared-data key per client");
    assert!(bytes <= 4096 * 32 + 512 * 24, "{bytes} bytes for 4096 slots (was {bytes_before} empty)");
    assert!(!vms[0].request(&victim).unwrap().passed, "the flood must not evict a limited client into a fresh budget");
}

fn when_cas_never_succeeds_open_rules_serve_and_closed_rules_reject_with_503(p: Profile) {
    let doc = json!({
        "identity": {"user": {"header": "x-user-id"}},
        "filter": {"cas_retries": 3},
        "rules": [
            {"name": "soft", "match": {"path": "/soft"}, "key": ["user"], "limit": {"requests": 1, "per": "60s"}},
            {"name": "hard", "match": {"path": "/hard"}, "key": ["user"], "limit": {"requests": 1, "per": "60s"}, "on_store_failure": "closed"}
        ]
    });
    let (node, mut vms) = node(p, &doc, 1);
    node.fail_every_cas(true);
    let soft = HttpRequest::new("GET", "/soft").header("x-user-id", "u");
    let hard = HttpRequest::new("GET", "/hard").header("x-user-id", "u");
    assert_eq!(admitted(&mut vms[0], &soft, 3), 3, "open: keep serving while the counter store fails");
    let r = vms[0].request(&hard).unwrap();
    assert_eq!(r.status, 503, "closed: reject while the counter store fails");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let problem: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(problem["policies"], json!(["hard"]));
    assert_eq!(node.metric("ratewall_rule_soft_cas_exhausted"), 3);
    assert_eq!(node.metric("ratewall_rule_hard_cas_exhausted"), 1);
    // When the store recovers, limits apply again.
    node.fail_every_cas(false);
    assert_eq!(admitted(&mut vms[0], &hard, 3), 1);
}

#[test]
fn a_host_that_lists_headers_without_pseudo_headers_still_matches_method_and_path() {
    let r = rules(json!([
        {"name": "posts", "match": {"path": "/v1/*", "method": "POST"}, "key": ["user"],
         "limit": {"requests": 1, "per": "1h"}}
    ]));
    let (_node, mut vms) = node(Profile::Envoy, &r, 1);
    let vm = &mut vms[0];
    vm.list_headers_without_pseudo_headers();
    let post = HttpRequest::new("POST", "/v1/things").header("x-user-id", "u");
    assert_eq!(admitted(vm, &post, 3), 1, ":method and :path are read one by one when the listing lacks them");
    assert_eq!(admitted(vm, &HttpRequest::new("GET", "/v1/things").header("x-user-id", "u"), 2), 2);
}

fn many_identity_headers_and_many_matching_rules_all_count(p: Profile) {
    // 20 identity headers and 20 rules that all match: past what the filter keeps on its
    // stack (13 identity headers, 16 matching rules).
    let identity: serde_json::Map<String, Value> =
        (0..20).map(|i| (format!("d{i}"), json!({"header": format!("X-Dim-{i}")}))).collect();
    let list: Vec<Value> = (0..20)
        .map(
            |i| json!({"name": format!("r{i}"), "key": [format!("d{i}")], "limit": {"requests": 20 - i, "per": "60s"}}),
        )
        .collect();
    let (_, mut vms) = node(p, &json!({"identity": identity, "rules": list}), 1);
    let mut req = HttpRequest::new("GET", "/any");
    for i in 0..20 {
        req = req.header(&format!("x-dim-{i}"), format!("v{i}"));
    }
    assert!(vms[0].request(&req).unwrap().passed);
    // The tightest rule is the last, r19 (1 request), keyed on the last header: it rejects,
    // and every other rule still has quota left.
    let r = vms[0].request(&req).unwrap();
    assert_eq!(r.status, 429);
    assert!(String::from_utf8_lossy(&r.body).contains("\"violated-policies\":[\"r19\"]"), "{:?}", r);
    // Without the first and last headers, r0 and r19 skip the request; the tightest left is
    // r18 (2 requests: one spent, the rejected one's refunded).
    let mut partial = HttpRequest::new("GET", "/any");
    for i in 1..19 {
        partial = partial.header(&format!("x-dim-{i}"), format!("v{i}"));
    }
    let r = vms[0].request(&partial).unwrap();
    assert!(r.passed, "{r:?}");
    assert!(r.header("ratelimit").unwrap().starts_with("\"r18\";r=0;"), "{r:?}");
}

/// The tests that run under both hosts' rules: `envoy::NAME` and `nginx::NAME`.
macro_rules! under_both_profiles {
    ($($name:ident),* $(,)?) => {
        mod envoy {
            $(#[test] fn $name() { super::$name(super::Profile::Envoy) })*
        }
        mod nginx {
            $(#[test] fn $name() { super::$name(super::Profile::NGINX) })*
        }
    };
}

under_both_profiles!(
    limits_hold_across_the_vms_of_one_node,
    concurrent_worker_threads_never_over_admit,
    a_denied_request_charges_no_other_rule,
    plans_raise_the_limit_and_internal_is_unlimited,
    shadow_rules_count_and_log_but_never_reject,
    forwarded_for_entries_cannot_dodge_the_per_ip_limit,
    ipv6_clients_are_limited_by_prefix,
    disguised_paths_do_not_escape_a_rule,
    requests_missing_a_key_dimension_are_not_counted_but_are_measured,
    hostile_requests_never_trap,
    the_seed_trace_through_the_filter,
    waiting_exactly_retry_after_is_enough,
    allowed_responses_carry_parseable_ratelimit_fields,
    memory_stays_bounded_under_a_flood_of_distinct_keys_and_a_limited_client_stays_limited,
    when_cas_never_succeeds_open_rules_serve_and_closed_rules_reject_with_503,
    many_identity_headers_and_many_matching_rules_all_count,
);

mod shaping {
    use super::*;
    use ratewall_tests::shaping::{burst, node, rules};

    /// The turn of the `i`th queued request (from 0) at 5 per second.
    fn turn(i: usize) -> u64 {
        200 * MS * (i as u64 + 1)
    }

    #[test]
    fn a_burst_is_queued_in_turns_across_vms_and_rejected_past_the_queue() {
        let (node, mut vms) = node(&plugin(), &rules(5, 0), 3, T0).unwrap();
        let b = burst(&node, &mut vms, 12, 1500, &[]).unwrap();
        assert_eq!(b.at_once, 1, "{b:?}");
        assert_eq!(b.forwarded.len(), 5, "{b:?}");
        for (i, at) in b.forwarded.iter().enumerate() {
            assert!(*at >= turn(i), "request {i} forwarded at {at} ns, before its turn: {b:?}");
            assert!(*at <= turn(i) + 10 * MS, "request {i} forwarded more than 10 ms late: {b:?}");
        }
        assert_eq!(b.rejected, vec![Some("1".to_owned()); 6], "a place frees within a second");
        assert_eq!(node.metric("ratewall_rule_shape_delayed"), 5);
        assert_eq!(node.metric("ratewall_rule_shape_queue_full"), 6);
        for vm in &vms {
            assert_eq!(vm.tick_period_ms(), 5, "the root's tick, set once at configure");
        }
    }

    #[test]
    fn a_request_that_waited_its_turn_says_the_places_left_when_it_goes() {
        // A queue of 5 at 5 a second, 12 requests at once: the k-th queued goes at k × 200 ms,
        // when k places are free (those behind it still hold theirs). Its fields as of its
        // admission said 5 - k were: a client trusting them found the queue full.
        let (node, mut vms) = node(&plugin(), &rules(5, 0), 2, T0).unwrap();
        let b = burst(&node, &mut vms, 12, 1500, &[]).unwrap();
        assert_eq!(b.forwarded.len(), 5, "{b:?}");
        let fields: Vec<&str> = b.forwarded_fields.iter().map(|f| f.as_deref().unwrap_or("")).collect();
        assert_eq!(
            fields,
            ["\"shape\";r=1;t=1", "\"shape\";r=2;t=1", "\"shape\";r=3;t=1", "\"shape\";r=4;t=1", "\"shape\";r=5;t=1"]
        );
    }

    #[test]
    fn delay_lets_part_of_the_queue_through_at_once() {
        // NGINX `burst=10 delay=3`: 3 of the queued go at once, 7 wait, 1 of 12 is rejected.
        let (node, mut vms) = node(&plugin(), &rules(10, 3), 2, T0).unwrap();
        let b = burst(&node, &mut vms, 12, 2000, &[]).unwrap();
        assert_eq!((b.at_once, b.forwarded.len(), b.rejected.len()), (4, 7, 1), "{b:?}");
        for (i, at) in b.forwarded.iter().enumerate() {
            assert!((turn(i)..=turn(i) + 10 * MS).contains(at), "{i}: {at}: {b:?}");
        }
    }

    #[test]
    fn a_waiter_whose_client_leaves_gives_its_turn_to_the_next() {
        let (node, mut vms) = node(&plugin(), &rules(5, 0), 2, T0).unwrap();
        let b = burst(&node, &mut vms, 12, 1500, &[0]).unwrap();
        // The first queued request left: the next took its turn, and one more fit the queue.
        assert_eq!((b.at_once, b.forwarded.len(), b.rejected.len()), (1, 5, 5), "{b:?}");
        assert!((turn(0)..=turn(0) + 10 * MS).contains(&b.forwarded[0]), "{b:?}");
    }

    /// Steps the clock 1 ms at a time until `until` (ns after T0), every VM ticking at the
    /// period it set; records when each paused `(vm, ctx, number)` goes.
    fn run_until(
        node: &Node,
        vms: &mut [Vm],
        paused: &mut Vec<(usize, u32, usize)>,
        went: &mut Vec<(usize, u64)>,
        until: u64,
    ) {
        while node.now() - T0 < until {
            node.advance(MS);
            for vm in vms.iter_mut() {
                let period = u64::from(vm.tick_period_ms()) * MS;
                if period > 0 && (node.now() - T0).is_multiple_of(period) {
                    vm.tick().unwrap();
                }
            }
            paused.retain(|(v, ctx, n)| match vms[*v].finish(*ctx).unwrap() {
                Some(r) => {
                    assert!(r.passed);
                    went.push((*n, node.now() - T0));
                    false
                }
                None => true,
            });
        }
    }

    #[test]
    fn when_a_waiter_leaves_the_waiters_behind_it_move_up_and_never_two_go_in_one_interval() {
        // #0 goes at once, #1..#5 wait on two VMs; #2 (due at 400 ms) leaves at 100 ms; #6
        // arrives at 150 ms. Before: #3 600, #4 800, #5 1000 and #6 1000 too.
        let (node, mut vms) = node(&plugin(), &rules(5, 0), 2, T0).unwrap();
        let req = HttpRequest::new("GET", "/q").header("x-user-id", "trace");
        let (mut paused, mut went) = (Vec::new(), Vec::new());
        for i in 0..6 {
            match vms[i % 2].begin(&req).unwrap() {
                ratewall_tests::host::Started::Paused(ctx) => paused.push((i % 2, ctx, i)),
                ratewall_tests::host::Started::Done(r) => assert!(i == 0 && r.passed, "{i}: {r:?}"),
            }
        }
        run_until(&node, &mut vms, &mut paused, &mut went, 100 * MS);
        let (v, ctx, _) = paused.remove(1);
        vms[v].abort(ctx).unwrap();
        run_until(&node, &mut vms, &mut paused, &mut went, 150 * MS);
        match vms[0].begin(&req).unwrap() {
            ratewall_tests::host::Started::Paused(ctx) => paused.push((0, ctx, 6)),
            other => panic!("#6 waits: {other:?}"),
        }
        run_until(&node, &mut vms, &mut paused, &mut went, 1500 * MS);
        let numbers: Vec<usize> = went.iter().map(|(n, _)| *n).collect();
        assert_eq!(numbers, [1, 3, 4, 5, 6], "{went:?}");
        for ((n, at), turn) in went.iter().zip([200, 400, 600, 800, 1000]) {
            assert!((turn * MS..=turn * MS + 10 * MS).contains(at), "#{n} went at {} ms: {went:?}", at / MS);
        }
        for pair in went.windows(2) {
            assert!(pair[1].1 - pair[0].1 >= 190 * MS, "two in one interval: {went:?}");
        }
    }

    #[test]
    fn requests_waiting_through_a_rules_push_still_go_at_their_turns() {
        let (node, mut vms) = node(&plugin(), &rules(5, 0), 2, T0).unwrap();
        let req = HttpRequest::new("GET", "/q").header("x-user-id", "push");
        let mut paused = Vec::new();
        for i in 0..4 {
            if let ratewall_tests::host::Started::Paused(ctx) = vms[i % 2].begin(&req).unwrap() {
                paused.push((i % 2, ctx));
            }
        }
        assert_eq!(paused.len(), 3);
        // A push that adds a rule and keeps this one: the waiters keep their turns.
        let mut doc: Value = serde_json::from_str(&rules(5, 0)).unwrap();
        doc["rules"].as_array_mut().unwrap().push(
            json!({"name": "other", "match": {"path": "/o/*"}, "key": ["user"], "limit": {"requests": 1, "per": "1s"}}),
        );
        for vm in &mut vms {
            assert!(vm.configure(doc.to_string().as_bytes()).unwrap());
            assert_eq!(vm.tick_period_ms(), 5, "still ticking for its waiters");
        }
        let mut went = Vec::new();
        for _ in 0..700 {
            node.advance(MS);
            for vm in vms.iter_mut() {
                vm.tick().unwrap();
            }
            paused.retain(|(v, ctx)| match vms[*v].finish(*ctx).unwrap() {
                Some(r) => {
                    assert!(r.passed);
                    went.push(node.now() - T0);
                    false
                }
                None => true,
            });
        }
        assert_eq!(went.len(), 3, "all three went: {went:?}");
        for (i, at) in went.iter().enumerate() {
            assert!((turn(i)..=turn(i) + 10 * MS).contains(at), "{i}: {at}");
        }
    }
}

mod concurrency {
    use super::*;
    use ratewall_tests::host::Started;

    fn flight(n: u64, hold: &str) -> Value {
        rules(json!([{"name": "flight", "key": ["user"], "limit": {"concurrent": n, "hold_max": hold}}]))
    }

    /// Starts a request held in flight: its context, or the status it was answered with.
    fn open(vm: &mut Vm, who: &str) -> Result<u32, FilterResult> {
        match vm.begin_in_flight(&user(who)).unwrap() {
            Started::Paused(ctx) => Ok(ctx),
            Started::Done(r) => Err(r),
        }
    }

    under_both_profiles!(slots_are_shared_by_the_vms_and_freed_on_completion_on_reset_and_after_hold_max);

    fn slots_are_shared_by_the_vms_and_freed_on_completion_on_reset_and_after_hold_max(p: Profile) {
        let (node, mut vms) = node(p, &flight(2, "10s"), 3);
        let a = open(&mut vms[0], "ann").unwrap();
        let b = open(&mut vms[1], "ann").unwrap();
        let r = open(&mut vms[2], "ann").unwrap_err();
        assert_eq!((r.status, r.header("retry-after")), (429, Some("1")), "two in flight across the VMs");
        assert_eq!(r.header("ratelimit-policy"), Some("\"flight\";q=2;qu=\"concurrent-requests\""));
        assert!(open(&mut vms[2], "bob").is_ok(), "another key has its own slots");
        assert_eq!(node.metric("ratewall_rule_flight_in_flight"), 1, "bob's, as last seen");
        // Completion frees a slot.
        assert!(vms[0].finish_upstream(a).unwrap().passed);
        let c = open(&mut vms[2], "ann").unwrap();
        // So does a reset stream.
        vms[1].abort(b).unwrap();
        let d = open(&mut vms[0], "ann").unwrap();
        assert!(open(&mut vms[1], "ann").is_err(), "c and d in flight");
        // Releases lost (a proxy that never ends them): free by hold_max.
        let _ = (c, d);
        node.advance(10 * SECOND);
        assert!(open(&mut vms[1], "ann").is_ok());
    }
}

/// On NGINX a leaky bucket is a token bucket of `delay + 1` at its drain rate, and its
/// `RateLimit-Policy` says so: 1 a second over a window of 9 s holds the 9 that go at once.
#[test]
fn on_nginx_a_leaky_buckets_policy_is_its_drain_rate_over_what_goes_at_once() {
    let doc = rules(json!([{"name": "slow", "key": ["user"],
        "limit": {"requests": 1, "per": "1s", "burst": 12, "delay": 8, "algorithm": "leaky_bucket"}}]));
    let (_, mut vms) = node(Profile::NGINX, &doc, 1);
    let req = user("lee");
    for i in 0..10u64 {
        let r = vms[0].request(&req).unwrap();
        assert_eq!(r.passed, i < 9, "request {i}");
        assert_eq!(r.header("ratelimit-policy"), Some(r#""slow";q=9;w=9"#), "request {i}");
        let remaining = r.header("ratelimit").and_then(|s| s.split(";r=").nth(1)?.split(';').next()?.parse().ok());
        assert_eq!(remaining, Some(8u64.saturating_sub(i)), "request {i}");
    }
}
