//! The built filter under the host's ngx_wasm_module profile: what NGINX does differently
//! (fatal configure results, no `shm_kv`, the tick period from the root only, resumption only
//! from a request's own context, `cas = 0` as "only if absent", reloads with fresh shared data
//! and VMs, `host:port` callouts, no scoped properties outside a request) never takes it down.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_core::sync::Store;
use ratewall_tests::host::{HttpRequest, Node, Plugin, Profile, Started, Vm};
use ratewall_tests::sim::{answer_from, request_with, SECRET};
use serde_json::{json, Value};

const SECOND: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;
const T0: u64 = 1_800_000_000 * SECOND;

fn plugin() -> Plugin {
    Plugin::filter().unwrap_or_else(|e| panic!("{e}"))
}

fn user_rules(requests: u64) -> Value {
    json!({
        "identity": {"user": {"header": "x-user-id"}},
        "rules": [{"name": "u", "key": ["user"], "limit": {"requests": requests, "per": "60s"}}]
    })
}

const BAD: &str = r#"{"identity": {"user": {"header": "x-user-id"}}, "rules": [{"name": "u", "key": ["user"], "limit": {"requests": 5, "per": "6O s"}}]}"#;

fn user(name: &str) -> HttpRequest {
    HttpRequest::new("GET", "/v1/things").header("x-user-id", name)
}

fn admitted(vm: &mut Vm, req: &HttpRequest, n: usize) -> usize {
    (0..n).filter(|_| vm.request(req).unwrap().passed).count()
}

/// `n` workers of `node`, started with `doc` (each a fresh VM, as NGINX starts them).
fn workers(node: &Node, doc: &str, n: usize) -> Vec<Vm> {
    (0..n).map(|_| Vm::start(&plugin(), node, doc.as_bytes()).unwrap()).collect()
}

fn errors(node: &Node) -> Vec<String> {
    node.logs().into_iter().filter(|(l, _)| *l >= 4).map(|(_, m)| m).collect()
}

#[test]
fn a_bad_document_at_a_cold_start_leaves_every_worker_serving_and_says_why() {
    let node = Node::with_profile(T0, Profile::NGINX);
    // Fatal to the worker before (on_configure false): Vm::start failed.
    let mut vms = workers(&node, BAD, 2);
    for vm in &mut vms {
        assert_eq!(admitted(vm, &user("a"), 10), 10, "open: requests pass without limits");
        assert!(vm.trapped().is_none());
    }
    assert_eq!(node.metric("ratewall_config_rejected"), 20, "every such request counted");
    let errs = errors(&node);
    assert!(errs.iter().any(|m| m.contains("no rules in force") && m.contains("rules[0].limit.per")), "{errs:?}");
    // Said again at the ticks while no rules are in force, at most every 10 s.
    let before = errors(&node).len();
    node.advance(11 * SECOND);
    vms[0].tick().unwrap();
    vms[0].request(&user("a")).unwrap();
    assert_eq!(errors(&node).len(), before + 1);
}

#[test]
fn a_deployment_that_wants_it_closed_gets_503_without_valid_rules() {
    let node = Node::with_profile(T0, Profile::NGINX);
    let mut vm = Vm::start_with_vm_config(&plugin(), &node, br#"{"without_rules": "closed"}"#, BAD.as_bytes()).unwrap();
    let r = vm.request(&user("a")).unwrap();
    assert_eq!((r.status, r.header("retry-after")), (503, Some("10")));
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(node.metric("ratewall_config_rejected"), 1);
    // A typo in that VM configuration is taken as closed, and said at error level: it let
    // every request through with a warning.
    let node = Node::with_profile(T0, Profile::NGINX);
    let mut vm = Vm::start_with_vm_config(&plugin(), &node, br#"{"without_rules": "clsoed"}"#, BAD.as_bytes()).unwrap();
    assert_eq!(vm.request(&user("a")).unwrap().status, 503);
    let errs = errors(&node);
    assert!(errs.iter().any(|m| m.contains("not understood") && m.contains("taken as closed")), "{errs:?}");
}

#[test]
fn a_bad_document_at_a_reload_keeps_nginx_serving_and_a_good_one_brings_the_limits_back() {
    let node = Node::with_profile(T0, Profile::NGINX);
    let good = user_rules(3).to_string();
    let mut vms = workers(&node, &good, 2);
    assert_eq!(admitted(&mut vms[0], &user("a"), 5), 3);
    // nginx -s reload with a typo: fresh workers, fresh VMs, no previous rules to keep.
    node.reload();
    let mut vms = workers(&node, BAD, 2);
    assert_eq!(admitted(&mut vms[1], &user("a"), 5), 5);
    node.reload();
    let mut vms = workers(&node, &good, 2);
    let passed = (0..6).filter(|i| vms[i % 2].request(&user("a")).unwrap().passed).count();
    assert_eq!(passed, 3, "the good document's limit, across both workers");
    assert_eq!(node.metric("ratewall_config_rejected"), 5, "ngx_wasm_module keeps its metrics across a reload");
}

#[test]
fn without_shm_kv_one_instance_traps_and_the_rest_serve_open_and_say_so() {
    let node = Node::with_profile(T0, Profile::Nginx { shm_kv: false });
    // Configure makes no shared-data call (a trap there is fatal to the worker): this failed
    // before, at Vm::start.
    let mut first = Vm::start(&plugin(), &node, user_rules(3).to_string().as_bytes()).unwrap();
    // The first shared-data call traps; ngx_wasm_module discards that instance.
    assert!(first.request(&user("a")).is_err());
    assert!(first.trapped().unwrap().contains("could not resolve namespace"));
    // Its successors (a recycled instance, the other workers) know from the host's metrics,
    // once the trapped probe is older than a probe still in progress could be.
    node.advance(2 * SECOND);
    let mut vms = workers(&node, &user_rules(3).to_string(), 2);
    for vm in &mut vms {
        assert_eq!(admitted(vm, &user("a"), 5), 5);
        vm.tick().unwrap();
        assert!(vm.trapped().is_none());
    }
    assert_eq!(node.metric("ratewall_config_rejected"), 10);
    assert!(errors(&node).iter().any(|m| m.contains("shm_kv")), "{:?}", errors(&node));
}

/// The filter's limit on probes taken to be in progress at once: as many instances may trap.
const PROBES_IN_FLIGHT: usize = 3;

fn traps(vms: &[Vm]) -> usize {
    vms.iter().filter(|v| v.trapped().is_some()).count()
}

#[test]
fn without_shm_kv_requests_in_the_first_second_cost_a_few_traps_then_pass_and_a_reload_with_it_brings_limits_back() {
    let node = Node::with_profile(T0, Profile::Nginx { shm_kv: false });
    let doc = user_rules(3).to_string();
    // Traffic already arriving at the start: each request whose instance trapped is retried
    // on a fresh one (as ngx_wasm_module recreates a trapped worker's instance), within the
    // first second. Before, every fresh instance probed again and trapped: every request
    // failed, without end.
    let mut instances = workers(&node, &doc, 1);
    let (mut failed, mut passed) = (0, 0);
    for i in 0..40 {
        if instances.last().unwrap().trapped().is_some() {
            instances.push(Vm::start(&plugin(), &node, doc.as_bytes()).unwrap());
        }
        node.advance(10 * MS);
        match instances.last_mut().unwrap().request(&user(&format!("u{}", i % 2))) {
            Ok(r) => passed += usize::from(r.passed && r.status == 200),
            Err(_) => failed += 1,
        }
    }
    assert!(failed <= PROBES_IN_FLIGHT && failed == traps(&instances), "{failed} failed, {} traps", traps(&instances));
    assert_eq!(passed, 40 - failed, "then service without limits");
    // Ticks within the next minute do not probe again.
    let vm = instances.last_mut().unwrap();
    for _ in 0..50 {
        node.advance(SECOND);
        vm.tick().unwrap();
    }
    assert!(vm.trapped().is_none());
    // `shm_kv` added, `nginx -s reload`: the metrics zone (with the trap's marker) is kept.
    node.reload_as(Profile::NGINX);
    let mut vms = workers(&node, &doc, 2);
    assert_eq!(admitted(&mut vms[0], &user("a"), 5), 5, "no limits until a tick probes again");
    node.advance(11 * SECOND);
    for vm in &mut vms {
        vm.tick().unwrap();
    }
    assert_eq!(traps(&vms), 0);
    let passed = (0..8).filter(|i| vms[i % 2].request(&user("b")).unwrap().passed).count();
    assert_eq!(passed, 3, "the limits are back, across both workers");
}

/// The leaky bucket of 5 per second with a queue of 5.
fn shaping() -> String {
    ratewall_tests::shaping::rules(5, 0)
}

#[test]
fn leaky_bucket_requests_that_would_wait_get_a_429_with_a_true_retry_after_never_a_trap() {
    let node = Node::with_profile(T0, Profile::NGINX);
    let mut vms = workers(&node, &shaping(), 2);
    // The tick period was set once, from the root, at configure (a request setting it trapped).
    assert_eq!(vms[0].tick_period_ms(), 5);
    let req = HttpRequest::new("GET", "/q").header("x-user-id", "burst");
    let mut statuses = Vec::new();
    for i in 0..8 {
        match vms[i % 2].begin(&req).unwrap() {
            Started::Done(r) => statuses.push((r.status, r.header("retry-after").map(str::to_owned))),
            Started::Paused(_) => panic!("request {i} paused: on NGINX nothing would resume it"),
        }
    }
    assert_eq!(statuses[0], (200, None));
    assert!(statuses[1..].iter().all(|s| *s == (429, Some("1".to_owned()))), "{statuses:?}");
    for _ in 0..50 {
        node.advance(MS);
        for vm in &mut vms {
            vm.tick().unwrap();
        }
    }
    assert!(vms.iter().all(|vm| vm.trapped().is_none()));
    // Retry-After is true: 1 s on, the next request passes at once.
    node.advance(SECOND);
    assert!(vms[1].request(&req).unwrap().passed);
    assert_eq!(node.metric("ratewall_waits_refused"), 7);
}

#[test]
fn delay_still_passes_part_of_a_burst_at_once_on_nginx() {
    let node = Node::with_profile(T0, Profile::NGINX);
    let mut vms = workers(&node, &ratewall_tests::shaping::rules(10, 3), 1);
    let req = HttpRequest::new("GET", "/q").header("x-user-id", "burst");
    assert_eq!(admitted(&mut vms[0], &req, 12), 4, "the conforming one and delay = 3");
}

/// `r` of a response's `RateLimit` field, and its `t`.
fn r_and_t(r: &ratewall_tests::host::FilterResult) -> (u64, u64) {
    let field = r.header("ratelimit").unwrap_or_default();
    let param = |name: &str| {
        field.split(';').find_map(|p| p.trim().strip_prefix(name)?.parse::<u64>().ok()).unwrap_or(u64::MAX)
    };
    (param("r="), param("t="))
}

#[test]
fn on_nginx_a_leaky_buckets_ratelimit_counts_what_passes_at_once_and_a_refused_turn_is_not_in_its_reset() {
    let node = Node::with_profile(T0, Profile::NGINX);
    let mut vms = workers(&node, &ratewall_tests::shaping::rules(10, 3), 1);
    let req = HttpRequest::new("GET", "/q").header("x-user-id", "burst");
    // The conforming request and `delay` = 3 pass at once; each says how many more will.
    let passed: Vec<u64> = (0..4)
        .map(|_| {
            let r = vms[0].request(&req).unwrap();
            assert!(r.passed);
            r_and_t(&r).0
        })
        .collect();
    assert_eq!(passed, [3, 2, 1, 0]);
    let refused = vms[0].request(&req).unwrap();
    assert_eq!(refused.status, 429);
    // Its policy is that token bucket's: 5 a second, at most 4 at once.
    assert_eq!(refused.header("ratelimit-policy"), Some("\"shape\";q=5;w=1"));
    // One per 10 s with a queue of 3: the one that passes says none more will; the next would
    // wait 10 s for its turn, and is told so by both fields (the bucket's reset no longer
    // counts the turn given back).
    let doc = json!({
        "identity": {"user": {"header": "x-user-id"}},
        "rules": [{"name": "slow", "key": ["user"],
                   "limit": {"requests": 1, "per": "10s", "burst": 3, "algorithm": "leaky_bucket"}}]
    });
    let mut vms = workers(&node, &doc.to_string(), 1);
    let first = vms[0].request(&req).unwrap();
    assert!(first.passed);
    assert_eq!(r_and_t(&first), (0, 10));
    let refused = vms[0].request(&req).unwrap();
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("retry-after"), Some("10"));
    assert_eq!(r_and_t(&refused), (0, 10));
}

#[test]
fn workers_racing_to_create_the_table_log_nothing_and_limits_hold() {
    for round in 0..3 {
        let node = Node::with_profile(T0, Profile::NGINX);
        let doc = user_rules(25).to_string();
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (node, doc) = (node.clone(), doc.clone());
                std::thread::spawn(move || {
                    let mut vm = Vm::start(&plugin(), &node, doc.as_bytes()).unwrap();
                    admitted(&mut vm, &user("racer"), 20)
                })
            })
            .collect();
        let total: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(total, 25, "round {round}");
        let noise: Vec<_> = node.logs().into_iter().filter(|(l, _)| *l >= 3).collect();
        assert!(noise.is_empty(), "round {round}: {noise:?}");
    }
}

/// Rules with a `sync` section naming the store as NGINX must: `host:port`.
fn synced(requests: u64) -> String {
    json!({
        "identity": {"user": {"header": "x-user-id"}},
        "rules": [{"name": "r", "key": ["user"], "algorithm": "fixed_window",
                   "limit": {"requests": requests, "per": "60s"}}],
        "filter": {"slots": 256},
        "sync": {"cluster": "127.0.0.1:8090", "secret": SECRET, "interval": "100ms", "stale_after": "1s", "nodes": 4}
    })
    .to_string()
}

/// One interval: the clock moves on, every VM ticks, `store` answers each call.
fn synced_tick(node: &Node, vms: &mut [Vm], store: &mut Store) {
    node.advance(100 * MS);
    for vm in vms.iter_mut() {
        vm.tick().unwrap();
        for c in vm.take_callouts() {
            assert_eq!(c.upstream, "127.0.0.1:8090");
            answer_from(store, node.now(), vm, &c).unwrap();
        }
    }
}

/// `n` requests of the client "spender", taking the workers in turn, an interval after each;
/// how many passed.
fn spend(node: &Node, vms: &mut [Vm], store: &mut Store, n: usize) -> usize {
    (0..n)
        .filter(|i| {
            let passed =
                request_with(Some(store), node.now(), &mut vms[i % vms.len()], &user("spender")).unwrap().passed;
            synced_tick(node, vms, store);
            passed
        })
        .count()
}

#[test]
fn sync_to_a_host_port_store_starts_without_an_error_line() {
    let node = Node::with_profile(T0, Profile::NGINX);
    let mut store = Store::new(1000, 10 * SECOND);
    let mut vms = workers(&node, &synced(10), 2);
    for _ in 0..3 {
        synced_tick(&node, &mut vms, &mut store);
    }
    assert_eq!(admitted(&mut vms[0], &user("a"), 2), 2);
    synced_tick(&node, &mut vms, &mut store);
    assert!(node.metric("ratewall_sync_ok") > 0, "batches reached the store");
    assert!(errors(&node).is_empty(), "{:?}", errors(&node));
}

#[test]
fn after_a_reload_a_client_that_spent_its_quota_is_denied_once_the_first_batch_is_answered() {
    let node = Node::with_profile(T0 + 10 * SECOND, Profile::NGINX);
    let mut store = Store::new(1000, 10 * SECOND);
    let doc = synced(5);
    let mut vms = workers(&node, &doc, 2);
    synced_tick(&node, &mut vms, &mut store);
    assert_eq!(spend(&node, &mut vms, &mut store, 12), 5, "the quota, spent");
    // nginx -s reload: fresh shm_kv, fresh VMs; the local count is gone.
    node.reload();
    assert_eq!(node.shared_get("rw1/32/0"), None);
    let mut vms = workers(&node, &doc, 2);
    synced_tick(&node, &mut vms, &mut store);
    // Until the store has answered for this counter the new workers admit on an initial
    // share (limit / nodes = 1), as a node that has just joined does; that unit goes out in
    // the next batch.
    let first = request_with(Some(&mut store), node.now(), &mut vms[0], &user("spender")).unwrap();
    synced_tick(&node, &mut vms, &mut store);
    synced_tick(&node, &mut vms, &mut store);
    for i in 0..6 {
        let r = request_with(Some(&mut store), node.now(), &mut vms[i % 2], &user("spender")).unwrap();
        assert_eq!(r.status, 429, "request {i} after the reload: the store still counts the quota spent");
        synced_tick(&node, &mut vms, &mut store);
    }
    assert!(first.passed || first.status == 429);
    // Another client has its quota.
    let r = request_with(Some(&mut store), node.now(), &mut vms[0], &user("fresh")).unwrap();
    assert!(r.passed);
}

#[test]
fn an_exact_rules_request_waits_for_its_ask_and_resumes_from_its_own_context_even_after_a_reload() {
    let node = Node::with_profile(T0 + 10 * SECOND, Profile::NGINX);
    let mut store = Store::new(1000, 10 * SECOND);
    let doc = synced(3).replace(r#""key":["user"]"#, r#""exact":true,"key":["user"]"#);
    assert!(doc.contains(r#""exact":true"#));
    let mut vms = workers(&node, &doc, 2);
    synced_tick(&node, &mut vms, &mut store);
    // The first request of an exact rule asks: paused, its call to `host:port`, then resumed
    // by the answer in its own context (ngx_wasm_module resumes no other way).
    let Started::Paused(ctx) = vms[0].begin(&user("spender")).unwrap() else {
        panic!("an exact rule's first request did not ask")
    };
    let calls = vms[0].take_callouts();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].upstream, "127.0.0.1:8090");
    answer_from(&mut store, node.now(), &mut vms[0], &calls[0]).unwrap();
    assert!(vms[0].finish(ctx).unwrap().unwrap().passed);
    assert_eq!(1 + spend(&node, &mut vms, &mut store, 6), 3, "the quota, no more");
    // nginx -s reload: fresh shm_kv and VMs. The exact rule spends no share the store did not
    // grant, so the spent client is denied from the first request on.
    node.reload();
    let mut vms = workers(&node, &doc, 2);
    synced_tick(&node, &mut vms, &mut store);
    for i in 0..4 {
        let r = request_with(Some(&mut store), node.now(), &mut vms[i % 2], &user("spender")).unwrap();
        assert_eq!(r.status, 429, "request {i} after the reload");
    }
    assert!(errors(&node).is_empty(), "{:?}", errors(&node));
}

/// ngx_wasm_module runs on a request paused in NGINX's rewrite phase when it came on a
/// kept-alive connection: its response comes while its ask is out (and the worker can crash
/// when the answer comes). The filter says so with the fix, and from then on no request of
/// the proxy — this worker's or another's — waits for an ask.
#[test]
fn a_request_the_host_ran_on_while_it_asked_says_the_fix_and_no_request_waits_after() {
    let node = Node::with_profile(T0 + 10 * SECOND, Profile::NGINX);
    let mut store = Store::new(1000, 10 * SECOND);
    let doc = synced(3).replace(r#""key":["user"]"#, r#""exact":true,"key":["user"]"#);
    let mut vms = workers(&node, &doc, 2);
    synced_tick(&node, &mut vms, &mut store);
    let Started::Paused(ctx) = vms[0].begin(&user("a")).unwrap() else { panic!("an exact rule's request did not ask") };
    let calls = vms[0].take_callouts();
    assert_eq!(calls.len(), 1);
    assert!(errors(&node).is_empty(), "{:?}", errors(&node));
    // The upstream's response, the ask still out.
    vms[0].run_on(ctx).unwrap();
    let errs = errors(&node);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(errs[0].contains("proxy_wasm_request_headers_in_access on;"), "{errs:?}");
    answer_from(&mut store, node.now(), &mut vms[0], &calls[0]).unwrap();
    synced_tick(&node, &mut vms, &mut store);
    // Every worker now decides an exact rule's request at once, as with the store out of reach
    // (the rule is open: admitted on the node's share), and sends no ask.
    for (i, who) in ["b", "c", "d"].iter().enumerate() {
        let vm = &mut vms[i % 2];
        assert!(matches!(vm.begin(&user(who)).unwrap(), Started::Done(_)), "{who} waited");
        assert!(vm.take_callouts().is_empty(), "{who} asked");
    }
    assert_eq!(errors(&node).len(), 1, "said once");
    assert!(vms.iter().all(|vm| vm.trapped().is_none()));
}

/// An ask that fails late (no answer within its deadline) on a `closed` rule: the 503 reaches
/// the client. ngx_wasm_module empties the body buffer of a local response sent in the answer
/// to a failed call, and NGINX then sent nothing at all; the filter sends that one without a
/// body.
#[test]
fn a_closed_rules_ask_that_fails_late_still_answers_503() {
    let node = Node::with_profile(T0 + 10 * SECOND, Profile::NGINX);
    let mut store = Store::new(1000, 10 * SECOND);
    let doc = synced(3).replace(r#""key":["user"]"#, r#""on_store_failure":"closed","key":["user"]"#);
    let mut vms = workers(&node, &doc, 1);
    synced_tick(&node, &mut vms, &mut store);
    let Started::Paused(ctx) = vms[0].begin(&user("a")).unwrap() else { panic!("a closed rule's request did not ask") };
    let calls = vms[0].take_callouts();
    assert_eq!(calls.len(), 1);
    vms[0].deliver(&calls[0], None).unwrap();
    let r = vms[0].finish(ctx).unwrap().unwrap();
    assert_eq!(r.status, 503, "{r:?}");
    assert!(r.header("retry-after").is_some(), "{r:?}");
}
