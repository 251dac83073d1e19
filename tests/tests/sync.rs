//! Cross-replica sync through the built filter: several nodes of several VMs, the reference
//! store behind the host's callouts (`ratewall_tests::sim`), and the failure modes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_core::SECOND;
use ratewall_tests::host::{HttpRequest, Node, Plugin, Vm};
use ratewall_tests::sim::{run, Faults, Scenario, Spread, SECRET};

fn small(name: &'static str) -> Scenario {
    Scenario {
        name,
        nodes: 4,
        vms: 2,
        keys: 3,
        limit: 100,
        window: 10 * SECOND,
        load: 1.5,
        windows: 2,
        spread: Spread::Zipf,
        skew: 0,
        faults: Faults::default(),
        faults_from: 1,
        seed: 42,
        algorithm: "fixed_window",
        duration: None,
    }
}

#[test]
fn a_synced_fleet_holds_one_global_limit() {
    let r = run(&small("healthy")).unwrap();
    println!("{r:?}");
    // Without sync each of the 4 nodes would admit up to the limit: up to 300% over.
    assert!(r.overadmission_max_pct <= 2.0, "{r:?}");
    assert!(r.false_denial_pct <= 5.0, "{r:?}");
    assert!(r.calls_per_node_per_sec <= 10.5, "one batch per node per interval: {r:?}");
}

#[test]
fn duplicated_and_reordered_answers_never_count_twice() {
    let s = Scenario { faults: Faults { duplicate: true, reorder: true, ..Faults::default() }, ..small("dup") };
    let r = run(&s).unwrap();
    assert!(r.overadmission_max_pct <= 2.0, "{r:?}");
}

#[test]
fn skewed_clocks_still_share_one_limit() {
    let r = run(&Scenario { skew: 500_000_000, ..small("skew") }).unwrap();
    assert!(r.overadmission_max_pct <= 5.0, "{r:?}");
}

fn sync_rules(policy: &str) -> String {
    serde_json::json!({
        "identity": {"user": {"header": "x-user-id"}},
        "rules": [{"name": "r", "key": ["user"], "on_store_failure": policy,
                   "limit": {"requests": 100, "per": "60s"}}],
        "filter": {"slots": 256},
        "sync": {"cluster": "store", "secret": SECRET, "interval": "100ms", "timeout": "50ms",
                 "stale_after": "500ms", "nodes": 4}
    })
    .to_string()
}

#[test]
fn one_vm_per_node_syncs_and_another_takes_over_when_it_stops() {
    let node = Node::new(1_800_000_000 * SECOND);
    let config = sync_rules("open");
    let mut vms: Vec<Vm> =
        (0..3).map(|_| Vm::start(&Plugin::filter().unwrap(), &node, config.as_bytes()).unwrap()).collect();
    let mut senders = std::collections::BTreeSet::new();
    for _ in 0..5 {
        node.advance(100_000_000);
        let mut calls = 0;
        for (i, vm) in vms.iter_mut().enumerate() {
            vm.tick().unwrap();
            for c in vm.take_callouts() {
                calls += 1;
                senders.insert(i);
                assert_eq!(c.upstream, "store");
                assert!(c.headers.iter().any(|(k, _)| k == "x-ratewall-signature"), "batches are signed");
                vm.deliver(&c, None).unwrap();
            }
        }
        assert!(calls <= 1, "one batch per node per interval, not one per VM");
    }
    assert_eq!(senders.len(), 1, "one lease holder: {senders:?}");
    let holder = *senders.iter().next().unwrap();
    // The holder stops ticking (its worker died): after the lease expires, another syncs.
    let mut others = std::collections::BTreeSet::new();
    for _ in 0..10 {
        node.advance(100_000_000);
        for (i, vm) in vms.iter_mut().enumerate().filter(|(i, _)| *i != holder) {
            vm.tick().unwrap();
            for c in vm.take_callouts() {
                others.insert(i);
                vm.deliver(&c, None).unwrap();
            }
        }
    }
    assert_eq!(others.len(), 1, "exactly one successor: {others:?}");
    assert!(node.metric("ratewall_sync_failed") > 0);
    assert_eq!(node.metric("ratewall_sync_breaker_open"), 1, "failures in a row open the breaker");
}

fn unreachable_store(policy: &str) -> (Node, Vm) {
    let node = Node::new(1_800_000_000 * SECOND);
    let mut vm = Vm::start(&Plugin::filter().unwrap(), &node, sync_rules(policy).as_bytes()).unwrap();
    // Two seconds of failed syncs: past stale_after.
    for _ in 0..20 {
        node.advance(100_000_000);
        vm.tick().unwrap();
        for c in vm.take_callouts() {
            vm.deliver(&c, None).unwrap();
        }
    }
    (node, vm)
}

#[test]
fn with_the_store_unreachable_open_rules_limit_locally_to_a_share_and_closed_rules_reject() {
    let (node, mut vm) = unreachable_store("open");
    let req = HttpRequest::new("GET", "/").header("x-user-id", "u");
    let admitted = (0..100).filter(|_| vm.request(&req).unwrap().passed).count();
    assert_eq!(admitted, 25, "open: limit / nodes (100 / 4) on this node");
    assert!(node.metric("ratewall_sync_degraded_requests") >= 100);
    assert!(node.metric("ratewall_sync_staleness_ms") >= 1000);

    let (node, mut vm) = unreachable_store("closed");
    let r = vm.request(&req).unwrap();
    assert_eq!(r.status, 503, "closed: reject while the global data is stale");
    assert!(r.header("retry-after").is_some());
    assert!(node.metric("ratewall_sync_degraded_requests") >= 1);
}

#[test]
fn a_rules_push_keeps_the_node_identity_and_its_unsent_deltas() {
    use ratewall_core::sync::{hex, sign, unhex, Store, SyncRequest};
    let node = Node::new(1_800_000_000 * SECOND);
    let mut vm = Vm::start(&Plugin::filter().unwrap(), &node, sync_rules("open").as_bytes()).unwrap();
    let user = |u: &str| HttpRequest::new("GET", "/").header("x-user-id", u);
    let units = |req: &SyncRequest| req.deltas.iter().map(|d| d.units).sum::<u64>();
    for _ in 0..2 {
        assert!(vm.request(&user("a")).unwrap().passed);
    }
    node.advance(100_000_000);
    vm.tick().unwrap();
    let first = vm.take_callouts().pop().expect("a batch");
    let sent = SyncRequest::decode(&first.body).unwrap();
    assert_eq!(units(&sent), 2);
    vm.deliver(&first, None).unwrap(); // lost: it must be retried as it was
    assert!(vm.request(&user("b")).unwrap().passed); // pending in the VM

    // The rules are pushed again (a new limit, the same store).
    assert!(vm.configure(sync_rules("open").replace("100", "150").as_bytes()).unwrap());

    let mut store = Store::new(1000, 2 * SECOND);
    let mut batches = Vec::new();
    for _ in 0..5 {
        node.advance(100_000_000);
        vm.tick().unwrap();
        for c in vm.take_callouts() {
            let req = SyncRequest::decode(&c.body).unwrap();
            let tag = c.headers.iter().find(|(k, _)| k == "x-ratewall-signature").map(|(_, v)| v.clone()).unwrap();
            let out = store.handle_signed(node.now(), SECRET.as_bytes(), &c.body, &unhex(&tag).unwrap()).unwrap();
            let sig = hex(&sign(SECRET.as_bytes(), &out));
            vm.respond(&c, 200, &[("x-ratewall-signature", sig.as_bytes())], out).unwrap();
            batches.push(req);
        }
    }
    assert!(batches.len() >= 2, "{batches:?}");
    // The lost batch is resent unchanged: the same node id and seq, so a store that did get
    // it the first time would not count it twice.
    assert_eq!((batches[0].node, batches[0].seq, units(&batches[0])), (sent.node, sent.seq, 2));
    // The delta recorded before the push is sent after it, from the same node.
    assert!(batches.iter().all(|b| b.node == sent.node), "a new node id would count as an extra node");
    assert_eq!(batches.iter().map(units).sum::<u64>(), 3, "every admitted request reaches the store once");
}

#[test]
fn a_new_fixed_window_starts_on_a_fresh_share_not_the_last_windows_spent_grant() {
    use ratewall_core::sync::{hex, sign, unhex, Store};
    let config = serde_json::json!({
        "identity": {"user": {"header": "x-user-id"}},
        "rules": [{"name": "r", "key": ["user"], "algorithm": "fixed_window",
                   "limit": {"requests": 4, "per": "1s"}}],
        "sync": {"cluster": "store", "secret": SECRET, "interval": "100ms", "stale_after": "5s", "nodes": 2}
    })
    .to_string();
    // Start on a window boundary, as seen through the store's clock (the same clock here).
    let node = Node::new(1_800_000_000 * SECOND);
    let mut vm = Vm::start(&Plugin::filter().unwrap(), &node, config.as_bytes()).unwrap();
    let mut store = Store::new(1000, 10 * SECOND);
    let user = HttpRequest::new("GET", "/").header("x-user-id", "a");
    let mut sync = |vm: &mut Vm, node: &Node| {
        node.advance(100_000_000);
        vm.tick().unwrap();
        for c in vm.take_callouts() {
            let tag = c.headers.iter().find(|(k, _)| k == "x-ratewall-signature").map(|(_, v)| v.clone()).unwrap();
            let out = store.handle_signed(node.now(), SECRET.as_bytes(), &c.body, &unhex(&tag).unwrap()).unwrap();
            let sig = hex(&sign(SECRET.as_bytes(), &out));
            vm.respond(&c, 200, &[("x-ratewall-signature", sig.as_bytes())], out).unwrap();
        }
    };
    // Spend this window's quota through the grants, with syncs in between.
    let mut passed = 0;
    for _ in 0..4 {
        for _ in 0..3 {
            passed += u32::from(vm.request(&user).unwrap().passed);
        }
        sync(&mut vm, &node);
    }
    assert_eq!(passed, 4, "the global limit holds within the window");
    assert!(!vm.request(&user).unwrap().passed, "the grant is spent");
    // The next window, before any sync has answered in it: the spent grant belonged to the old
    // window, so the node admits on its initial share (4 / the 1 node the store has seen).
    node.advance(SECOND);
    let fresh: Vec<bool> = (0..5).map(|_| vm.request(&user).unwrap().passed).collect();
    assert_eq!(fresh, [true, true, true, true, false], "a fresh window's share, and no more");
}
