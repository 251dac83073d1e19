//! Top offenders on the fake host: the VMs' denials merged per proxy, logged once a minute
//! without a store, carried in sync batches with one, never a secret value.

use super::*;
use crate::fake::answer;
use ratewall_core::sync::{Store, SyncRequest};

const KEY: &str = "sk_live_TOPSECRET";

fn rules(sync: &str) -> String {
    format!(
        r#"{{"identity": {{"api_key": {{"header": "x-api-key"}}, "hash_key": "the deployment's hash key"}},
  "rules": [
    {{"name": "idle", "match": {{"path": "/idle/*"}}, "key": ["api_key"], "limit": {{"requests": 2, "per": "60s"}}}},
    {{"name": "api-key", "key": ["api_key"], "limit": {{"requests": 2, "per": "60s"}}}},
    {{"name": "watch", "key": ["api_key"], "mode": "shadow", "limit": {{"requests": 1, "per": "60s"}}}}
  ]{sync}}}"#
    )
}

fn shown(e: &Engine, key: &str) -> String {
    let headers = [Some(key.as_bytes())];
    let req = ratewall_core::eval::Request { method: "GET", path: "/", headers: &headers, ip: None };
    let (checks, _) = e.config().checks(&req);
    ratewall_core::topk::render(e.config(), &checks[0].key).unwrap().1
}

#[test]
fn a_proxy_without_a_store_logs_each_rules_top_denied_keys_once_a_minute() {
    let a = FakeHost::new();
    let b = FakeHost::joining(a.shared.clone());
    let (ea, eb) = (engine(&a, &rules("")), engine(&b, &rules("")));
    assert_eq!(ea.tick_interval(), Some(crate::top::TICK), "ticks without a store");
    statuses(&ea, &a, "GET", "/", &[("x-api-key", KEY)], 20);
    statuses(&eb, &b, "GET", "/", &[("x-api-key", KEY)], 10);
    statuses(&eb, &b, "GET", "/", &[("x-api-key", "light")], 5);
    ea.on_tick(&a);
    eb.on_tick(&b);
    assert_eq!(b.metric("ratewall_rule_api_key_limited_keys"), 2, "the VM that merged last saw both keys");
    assert!(!a.logged("top denied"), "not before the minute is over");
    for h in [&a, &b] {
        h.advance(61_000 * MS);
    }
    ea.on_tick(&a);
    eb.on_tick(&b);
    let lines: Vec<String> = a
        .logs
        .borrow()
        .iter()
        .chain(b.logs.borrow().iter())
        .map(|(_, l)| l.clone())
        .filter(|l| l.contains("top denied"))
        .collect();
    let heavy = shown(&ea, KEY);
    let light = shown(&ea, "light");
    assert!(lines.contains(&format!("ratewall: top denied [api-key] {heavy} 28, {light} 3")), "{lines:?}");
    assert!(lines.iter().any(|l| l.starts_with("ratewall: top denied [watch] ")), "shadow denials are listed too");
    assert_eq!(lines.len(), 2, "one line per rule per proxy: {lines:?}");
    let everything: String = a.logs.borrow().iter().chain(b.logs.borrow().iter()).map(|(_, l)| l.clone()).collect();
    assert!(!everything.contains("TOPSECRET"), "{everything}");
    // A quiet minute logs nothing.
    for h in [&a, &b] {
        h.advance(61_000 * MS);
    }
    ea.on_tick(&a);
    eb.on_tick(&b);
    let after = a.logs.borrow().iter().chain(b.logs.borrow().iter()).filter(|(_, l)| l.contains("top denied")).count();
    assert_eq!(after, 2);
}

/// A rule taken out of the rules and pushed again later does not log its old denials as the
/// last minute's: what it left in shared data is dropped, and it counts afresh.
#[test]
fn a_rule_pushed_again_after_a_while_logs_only_its_new_denials() {
    let a = FakeHost::new();
    let e = engine(&a, &rules(""));
    statuses(&e, &a, "GET", "/", &[("x-api-key", "old")], 5);
    e.on_tick(&a);
    let without =
        rules("").replace(r#"{"name": "api-key", "key": ["api_key"], "limit": {"requests": 2, "per": "60s"}},"#, "");
    assert_ne!(without, rules(""));
    let pushed = Engine::configure(&a, without.as_bytes(), Some(&e)).unwrap();
    for _ in 0..85 {
        a.advance(1_000 * MS);
        pushed.on_tick(&a);
    }
    let back = Engine::configure(&a, rules("").as_bytes(), Some(&pushed)).unwrap();
    back.on_tick(&a);
    statuses(&back, &a, "GET", "/", &[("x-api-key", "new")], 4);
    back.on_tick(&a);
    a.advance(61_000 * MS);
    back.on_tick(&a);
    let lines: Vec<String> =
        a.logs.borrow().iter().map(|(_, l)| l.clone()).filter(|l| l.contains("top denied [api-key]")).collect();
    assert_eq!(lines, [format!("ratewall: top denied [api-key] {} 2", shown(&back, "new"))]);
}

/// Two VMs of one proxy with a `sync` section, and the store they sync to.
fn two_vms_syncing() -> (FakeHost, FakeHost, Engine, Engine, Store) {
    let sync = r#", "sync": {"cluster": "store", "secret": "0123456789abcdef", "interval": "100ms"}"#;
    let a = FakeHost::new();
    let b = FakeHost::joining(a.shared.clone());
    let (ea, eb) = (engine(&a, &rules(sync)), engine(&b, &rules(sync)));
    (a, b, ea, eb, Store::new(10_000, 2_000 * MS))
}

#[test]
fn batches_carry_each_rules_counts_and_top_keys_and_no_secret() {
    let (a, b, ea, eb, mut store) = two_vms_syncing();
    // First a grant, so the node decides locally.
    ea.on_tick(&a);
    for c in a.take_calls() {
        let (status, tag, body) = answer(&mut store, a.now(), "0123456789abcdef", &c);
        ea.on_sync_response(&a, c.token, status, tag.as_deref(), &body);
    }
    statuses(&ea, &a, "GET", "/", &[("x-api-key", KEY)], 8);
    statuses(&eb, &b, "GET", "/", &[("x-api-key", KEY)], 4);
    statuses(&eb, &b, "GET", "/", &[("x-api-key", "light")], 1);
    for h in [&a, &b] {
        h.advance(200 * MS);
    }
    eb.on_tick(&b);
    ea.on_tick(&a);
    let calls: Vec<_> = a.take_calls().into_iter().chain(b.take_calls()).collect();
    let sections: Vec<_> = calls.iter().filter_map(|c| SyncRequest::decode_with_top(&c.body).unwrap().1).collect();
    assert_eq!(sections.len(), 1, "{} calls", calls.len());
    // Every rule, in the document's order: the store lists them so.
    let names: Vec<&str> = sections[0].rules.iter().map(|r| r.rule.as_str()).collect();
    assert_eq!(names, ["idle", "api-key", "watch"]);
    assert_eq!((sections[0].rules[0].allowed, sections[0].rules[0].denied), (0, 0));
    let api = sections[0].rules.iter().find(|r| r.rule == "api-key").unwrap();
    let top = api.top.top(20);
    assert_eq!(top[0].key, shown(&ea, KEY).as_bytes());
    assert!(api.denied >= 8, "{api:?}");
    assert!(api.allowed >= 1, "{api:?}");
    for c in &calls {
        assert!(!c.body.windows(9).any(|w| w == b"TOPSECRET"), "no secret in a batch");
    }
    // The next batch carries only what is new.
    for h in [&a, &b] {
        h.advance(200 * MS);
    }
    ea.on_tick(&a);
    let again: Vec<_> =
        a.take_calls().iter().filter_map(|c| SyncRequest::decode_with_top(&c.body).unwrap().1).collect();
    assert!(again.iter().all(|s| s.rules.iter().all(|r| r.denied == 0)), "{again:?}");
}

#[test]
fn a_key_denied_once_per_interval_on_each_vm_among_many_keys_denied_once_is_counted_exactly() {
    let (a, b, ea, eb, mut store) = two_vms_syncing();
    let mut sync = |vms: [(&FakeHost, &Engine); 2]| {
        let mut sections = Vec::new();
        for (h, e) in vms {
            e.on_tick(h);
            for c in h.take_calls() {
                sections.extend(SyncRequest::decode_with_top(&c.body).unwrap().1);
                let (status, tag, body) = answer(&mut store, h.now(), "0123456789abcdef", &c);
                e.on_sync_response(h, c.token, status, tag.as_deref(), &body);
            }
        }
        sections
    };
    sync([(&a, &ea), (&b, &eb)]);
    statuses(&ea, &a, "GET", "/", &[("x-api-key", KEY)], 2);
    let heavy = shown(&ea, KEY);
    let (mut denied, mut listed) = (0, 0);
    for round in 0..12 {
        // On each VM, eighty keys denied once each (more than a summary keeps), and the heavy
        // key denied once: within any one interval it looks like the rest. Over the run it has
        // 1.2 % of the denials, under the 1 / 65 a summary of 64 keys is sure to list.
        for (h, e, vm) in [(&a, &ea, "a"), (&b, &eb, "b")] {
            for i in 0..80 {
                statuses(e, h, "GET", "/", &[("x-api-key", &format!("once-{round}-{vm}-{i}"))], 3);
            }
            denied += statuses(e, h, "GET", "/", &[("x-api-key", KEY)], 1).iter().filter(|s| **s == 429).count();
        }
        for h in [&a, &b] {
            h.advance(200 * MS);
        }
        for s in sync([(&a, &ea), (&b, &eb)]) {
            let api = s.rules.iter().find(|r| r.rule == "api-key").unwrap();
            listed += api.top.entries().iter().find(|x| x.key == heavy.as_bytes()).map_or(0, |x| x.denied);
        }
    }
    assert_eq!(denied, 24);
    // Its first denial on each VM looks like any one-off key's and may go uncounted.
    assert!(listed + 2 >= denied as u64, "{listed} of {denied} denials of the heavy key reach the store");
}

#[test]
fn two_documents_on_one_proxy_each_log_their_rules_top_denied_keys() {
    // As two NGINX proxy_wasm directives: one shared data, rules of different names at the
    // same places, each document's VM ticking every second.
    let a = FakeHost::new();
    let b = FakeHost::joining(a.shared.clone());
    let other = rules("")
        .replace("\"idle\"", "\"idle-b\"")
        .replace("\"api-key\"", "\"per-key\"")
        .replace("\"watch\"", "\"look\"");
    let (ea, eb) = (engine(&a, &rules("")), engine(&b, &other));
    statuses(&ea, &a, "GET", "/", &[("x-api-key", KEY)], 5);
    statuses(&eb, &b, "GET", "/", &[("x-api-key", KEY)], 5);
    for _ in 0..62 {
        ea.on_tick(&a);
        eb.on_tick(&b);
        for h in [&a, &b] {
            h.advance(1_000 * MS);
        }
    }
    let logged = |h: &FakeHost, rule: &str| {
        h.logs.borrow().iter().any(|(_, l)| l.starts_with(&format!("ratewall: top denied [{rule}] ")))
    };
    assert!(logged(&a, "api-key") || logged(&b, "api-key"), "{:?} {:?}", a.logs.borrow(), b.logs.borrow());
    assert!(logged(&a, "per-key") || logged(&b, "per-key"), "{:?} {:?}", a.logs.borrow(), b.logs.borrow());
}

#[test]
fn rules_whose_names_pick_one_shared_key_each_keep_their_denials() {
    // Nine rule names whose hashes pick one shared key, as "q016" … "q185" do.
    let first = |n: &str| ratewall_core::key::fnv1a(n.as_bytes()) % 1024;
    let target = first("q016");
    let names: Vec<String> = (0..100_000).map(|i| format!("q{i:03}")).filter(|n| first(n) == target).take(9).collect();
    assert_eq!(names.len(), 9);
    let list: Vec<String> = names
        .iter()
        .map(|n| format!(r#"{{"name": "{n}", "match": {{"path": "/{n}"}}, "key": ["api_key"], "limit": {{"requests": 1, "per": "60s"}}}}"#))
        .collect();
    let doc = format!(r#"{{"identity": {{"api_key": {{"header": "x-api-key"}}}}, "rules": [{}]}}"#, list.join(","));
    let h = FakeHost::new();
    let e = engine(&h, &doc);
    for n in &names {
        statuses(&e, &h, "GET", &format!("/{n}"), &[("x-api-key", "slow")], 3);
    }
    for _ in 0..62 {
        e.on_tick(&h);
        h.advance(1_000 * MS);
    }
    for n in &names {
        assert!(h.logged(&format!("ratewall: top denied [{n}] ")), "{n}: {:?}", h.logs.borrow());
    }
}

/// A client admitted in earlier batches and then denied is listed with what it was admitted
/// before its first denial: the batch with its first denial carries them (before, only the
/// units of that batch counted for it).
#[test]
fn a_keys_admissions_in_batches_before_its_first_denial_count_for_it() {
    let (a, _b, ea, _eb, mut store) = two_vms_syncing();
    let round = |store: &mut Store| -> Vec<ratewall_core::sync::TopSection> {
        a.advance(200 * MS);
        ea.on_tick(&a);
        let mut sections = Vec::new();
        for c in a.take_calls() {
            sections.extend(SyncRequest::decode_with_top(&c.body).unwrap().1);
            let (status, tag, body) = answer(store, a.now(), "0123456789abcdef", &c);
            ea.on_sync_response(&a, c.token, status, tag.as_deref(), &body);
        }
        sections
    };
    round(&mut store);
    let mut sections = Vec::new();
    for _ in 0..2 {
        assert_eq!(statuses(&ea, &a, "GET", "/", &[("x-api-key", KEY)], 1), [200]);
        sections.extend(round(&mut store));
    }
    assert_eq!(statuses(&ea, &a, "GET", "/", &[("x-api-key", KEY)], 2), [429, 429]);
    sections.extend(round(&mut store));
    // Each unit in one batch: the last one's answer found the counter at its limit, so its
    // units went at once (another node may have been denying the key), the rest with the
    // first denial.
    let entries = sections.iter().flat_map(|s| &s.rules).filter(|r| r.rule == "api-key").flat_map(|r| r.top.entries());
    let (denied, allowed) =
        entries.filter(|e| e.key == shown(&ea, KEY).as_bytes()).fold((0, 0), |(d, a), e| (d + e.denied, a + e.allowed));
    assert_eq!((denied, allowed), (2, 2), "{sections:?}");
}

/// A batch given up after failing for as long as a store accepts its time (25 s) takes its
/// top section with it no more: the next batch made carries it, so who was denied while the
/// store was out of reach is in the store's view once it answers again. (A Redis down for
/// 25 s or more had the denials of its first seconds missing for good.)
#[test]
fn the_top_counts_of_a_batch_given_up_go_with_the_next_batch() {
    let (a, _b, ea, _eb, mut store) = two_vms_syncing();
    ea.on_tick(&a);
    for c in a.take_calls() {
        let (status, tag, body) = answer(&mut store, a.now(), "0123456789abcdef", &c);
        ea.on_sync_response(&a, c.token, status, tag.as_deref(), &body);
    }
    let denied_in = |calls: &[crate::fake::Call]| -> u64 {
        calls
            .iter()
            .filter_map(|c| SyncRequest::decode_with_top(&c.body).unwrap().1)
            .flat_map(|s| s.rules.into_iter().filter(|r| r.rule == "api-key").map(|r| r.denied))
            .sum()
    };
    let denied = statuses(&ea, &a, "GET", "/", &[("x-api-key", KEY)], 8).iter().filter(|s| **s == 429).count();
    assert!(denied >= 5, "{denied}");
    // The store out of reach for 40 s: every call fails.
    for _ in 0..400 {
        a.advance(100 * MS);
        ea.on_tick(&a);
        for c in a.take_calls() {
            ea.on_sync_response(&a, c.token, 0, None, &[]);
        }
    }
    // Back (once the breaker lets a batch go): the batches it answers carry every denial once.
    let mut heard = 0;
    for _ in 0..600 {
        a.advance(100 * MS);
        ea.on_tick(&a);
        let calls = a.take_calls();
        for c in &calls {
            let (status, tag, body) = answer(&mut store, a.now(), "0123456789abcdef", c);
            if status == 200 {
                heard += denied_in(std::slice::from_ref(c));
            }
            ea.on_sync_response(&a, c.token, status, tag.as_deref(), &body);
        }
    }
    assert_eq!(heard, denied as u64);
}

/// For each VM in turn: its clock `by` on, its tick, and its batches answered by `store`, their
/// top sections kept in `sections`.
fn sync_round(
    store: &mut Store,
    vms: &[(&FakeHost, &Engine)],
    by: ratewall_core::Nanos,
    sections: &mut Vec<ratewall_core::sync::TopSection>,
) {
    for &(h, e) in vms {
        h.advance(by);
        e.on_tick(h);
        for c in h.take_calls() {
            sections.extend(SyncRequest::decode_with_top(&c.body).unwrap().1);
            let (status, tag, body) = answer(store, h.now(), "0123456789abcdef", &c);
            e.on_sync_response(h, c.token, status, tag.as_deref(), &body);
        }
    }
}

/// A key's units kept at one node until its first denial there go to the store when the
/// store's answers find its counter at its limit, though the batch then carries nothing else:
/// another node spent the quota, and the store's entry for the key counts both nodes' units.
/// (That batch's section was dropped when it had no other counts, and the units with it.)
#[test]
fn units_kept_for_a_key_go_with_a_batch_that_carries_nothing_else() {
    let sync = r#", "sync": {"cluster": "store", "secret": "0123456789abcdef", "interval": "100ms"}"#;
    let (a, b) = (FakeHost::new(), FakeHost::new());
    let (ea, eb) = (engine(&a, &rules(sync)), engine(&b, &rules(sync)));
    let mut store = Store::new(10_000, 2_000 * MS);
    let mut sections = Vec::new();
    let mut round = |store: &mut Store, h: &FakeHost, e: &Engine| sync_round(store, &[(h, e)], 200 * MS, &mut sections);
    for _ in 0..2 {
        round(&mut store, &a, &ea);
        round(&mut store, &b, &eb);
    }
    // One unit at each node: the second spends the quota of 2.
    assert_eq!(statuses(&ea, &a, "GET", "/", &[("x-api-key", KEY)], 1), [200]);
    round(&mut store, &a, &ea);
    assert_eq!(statuses(&eb, &b, "GET", "/", &[("x-api-key", KEY)], 1), [200]);
    for _ in 0..4 {
        round(&mut store, &b, &eb);
        round(&mut store, &a, &ea);
    }
    // Each node denies the key (past an overdraft unit, if it has one).
    let mut admitted = 2;
    for (e, h) in [(&ea, &a), (&eb, &b)] {
        let answered = statuses(e, h, "GET", "/", &[("x-api-key", KEY)], 2);
        assert_eq!(answered.last(), Some(&429), "{answered:?}");
        admitted += answered.iter().filter(|s| **s == 200).count() as u64;
    }
    for _ in 0..2 {
        round(&mut store, &a, &ea);
        round(&mut store, &b, &eb);
    }
    let entries = sections.iter().flat_map(|s| &s.rules).filter(|r| r.rule == "api-key").flat_map(|r| r.top.entries());
    let (denied, allowed) =
        entries.filter(|e| e.key == shown(&ea, KEY).as_bytes()).fold((0, 0), |(d, a), e| (d + e.denied, a + e.allowed));
    assert_eq!((denied, allowed), (4 - (admitted - 2), admitted), "{sections:?}");
}

/// Two documents on one proxy syncing to one store (NGINX `proxy_wasm` directives at two
/// locations): the VM that holds their lease carries both documents' rules in its batches'
/// sections, each key shown as its own document shows it. (Only the lease holder's document's
/// rules went: /v1/top listed the other's neither with its counts nor its keys.)
#[test]
fn the_lease_holders_batches_carry_every_documents_rules_that_share_its_lease() {
    let sync = r#", "sync": {"cluster": "store", "secret": "0123456789abcdef", "interval": "100ms"}"#;
    let a = FakeHost::new();
    let b = FakeHost::joining(a.shared.clone());
    let other = rules(sync)
        .replace("\"idle\"", "\"idle-b\"")
        .replace("\"api-key\"", "\"per-key\"")
        .replace("\"watch\"", "\"look\"")
        .replace("\"api_key\": {\"header\": \"x-api-key\"}", "\"api_key\": {\"header\": \"x-other-key\"}");
    let (ea, eb) = (engine(&a, &rules(sync)), engine(&b, &other));
    let mut store = Store::new(10_000, 2_000 * MS);
    let mut sections = Vec::new();
    let mut round = |store: &mut Store| sync_round(store, &[(&a, &ea), (&b, &eb)], 100 * MS, &mut sections);
    for _ in 0..3 {
        round(&mut store);
    }
    let a_said = statuses(&ea, &a, "GET", "/", &[("x-api-key", KEY)], 6);
    let b_said = statuses(&eb, &b, "GET", "/", &[("x-other-key", "other-client")], 6);
    for _ in 0..5 {
        round(&mut store);
    }
    let total = |rule: &str, key: &str| {
        let entries = sections.iter().flat_map(|s| &s.rules).filter(|r| r.rule == rule);
        let (allowed, denied) = entries.clone().fold((0, 0), |(a, d), r| (a + r.allowed, d + r.denied));
        let listed: u64 =
            entries.flat_map(|r| r.top.entries()).filter(|e| e.key == key.as_bytes()).map(|e| e.denied).sum();
        (allowed, denied, listed)
    };
    let count = |said: &[u16], status| said.iter().filter(|s| **s == status).count() as u64;
    let (a_denied, b_denied) = (count(&a_said, 429), count(&b_said, 429));
    assert!(a_denied > 0 && b_denied > 0, "{a_said:?} {b_said:?}");
    assert_eq!(total("api-key", &shown(&ea, KEY)), (count(&a_said, 200), a_denied, a_denied), "{sections:?}");
    assert_eq!(
        total("per-key", &shown(&eb, "other-client")),
        (count(&b_said, 200), b_denied, b_denied),
        "{sections:?}"
    );
    for s in &sections {
        let body = format!("{s:?}");
        assert!(!body.contains("TOPSECRET") && !body.contains("other-client"), "no secret value: {body}");
    }
}

/// As above, with the key's rule in a document that does not hold its proxy's lease: the units
/// that proxy kept for the key go once its own document has shown the key (its first denial
/// there), not lost when the store's answers find the counter at its limit before that.
#[test]
fn units_kept_for_another_documents_key_go_once_it_is_shown() {
    let sync = r#", "sync": {"cluster": "store", "secret": "0123456789abcdef", "interval": "100ms"}"#;
    let holder_rules = rules(sync)
        .replace("\"idle\"", "\"idle-h\"")
        .replace("\"api-key\"", "\"per-key-h\"")
        .replace("\"watch\"", "\"look-h\"");
    let h = FakeHost::new();
    let a = FakeHost::joining(h.shared.clone());
    let mut b = FakeHost::new();
    b.node_id = b"node-2".to_vec();
    let (eh, ea, eb) = (engine(&h, &holder_rules), engine(&a, &rules(sync)), engine(&b, &rules(sync)));
    let mut store = Store::new(10_000, 2_000 * MS);
    let mut sections = Vec::new();
    let mut round = |store: &mut Store| sync_round(store, &[(&h, &eh), (&a, &ea), (&b, &eb)], 100 * MS, &mut sections);
    for _ in 0..3 {
        round(&mut store);
    }
    let mut admitted = 0;
    let mut said = |e: &Engine, host: &FakeHost, n| {
        let answered = statuses(e, host, "GET", "/", &[("x-api-key", KEY)], n);
        admitted += answered.iter().filter(|s| **s == 200).count() as u64;
        answered
    };
    said(&ea, &a, 1);
    round(&mut store);
    said(&eb, &b, 1);
    for _ in 0..4 {
        round(&mut store);
    }
    // Both proxies deny the key (past an overdraft unit, if they have one).
    assert_eq!(said(&eb, &b, 2).last(), Some(&429));
    for _ in 0..2 {
        round(&mut store);
    }
    assert_eq!(said(&ea, &a, 2).last(), Some(&429));
    for _ in 0..3 {
        round(&mut store);
    }
    let entries = sections.iter().flat_map(|s| &s.rules).filter(|r| r.rule == "api-key").flat_map(|r| r.top.entries());
    let allowed: u64 = entries.filter(|e| e.key == shown(&ea, KEY).as_bytes()).map(|e| e.allowed).sum();
    assert_eq!(allowed, admitted, "{sections:?}");
}
