//! The syncer on the fake host, answered by the core's reference store: leases, outboxes,
//! batches and their retries, the breaker, degraded mode, asks, reconfiguration.

use super::*;
use crate::fake::{answer, signed, Call};
use crate::host::Level;
use ratewall_core::eval::Request;
use ratewall_core::sync::{Delta, Store, SyncRequest, SyncResponse, MAX_REQUEST_SKEW, RETRY_HORIZON};

const SECRET: &str = "0123456789abcdef";

fn rules(limit: u64, nodes: u32) -> String {
    rules_with(limit, nodes, "")
}

/// [`rules`] with more `sync` fields (`extra`: `"name": value, ` pairs).
fn rules_with(limit: u64, nodes: u32, extra: &str) -> String {
    format!(
        r#"{{"identity": {{"user": {{"header": "x-user-id"}}}},
  "rules": [
    {{"name": "user", "match": {{"path": "/u/*"}}, "key": ["user"], "limit": {{"requests": {limit}, "per": "60s"}}}},
    {{"name": "strict", "match": {{"path": "/cl/*"}}, "key": ["user"], "on_store_failure": "closed",
      "limit": {{"requests": {limit}, "per": "60s"}}}},
    {{"name": "exact", "match": {{"path": "/ex/*"}}, "key": ["user"], "exact": true,
      "limit": {{"requests": {limit}, "per": "60s"}}}}
  ],
  "sync": {{{extra}"cluster": "store", "secret": "{SECRET}", "interval": "100ms", "timeout": "50ms", "stale_after": "1s", "nodes": {nodes}}}}}"#
    )
}

/// A path of the rule that is `"exact": true` (a spent grant asks the store).
const EXACT: &str = "/ex/x";
/// A path of the rule that is not (a spent grant admits on the overdraft, never waits).
const NO_WAIT: &str = "/u/x";

fn store() -> Store {
    Store::new(10_000, 2_000 * MS)
}

/// The counter key of `user` under the rule of `path`.
fn key_of(e: &Engine, path: &str, user: &str) -> Vec<u8> {
    let headers = [Some(user.as_bytes())];
    let (checks, _) = e.config().checks(&Request { method: "GET", path, headers: &headers, ip: None });
    checks[0].key.clone()
}

/// Units the store has counted on a key (its limit less what remains).
fn counted(store: &Store, e: &Engine, path: &str, user: &str, now: Nanos) -> u64 {
    store.peek(&key_of(e, path, user), now).map_or(0, |d| d.limit - d.remaining)
}

/// Answers every call the host dispatched from `store`; returns how many.
fn serve(store: &mut Store, e: &Engine, h: &FakeHost) -> usize {
    let calls = h.take_calls();
    for c in &calls {
        let (status, tag, body) = answer(store, h.now(), SECRET, c);
        e.on_sync_response(h, c.token, status, tag.as_deref(), &body);
    }
    calls.len()
}

/// Fails every call the host dispatched (a timeout); returns how many.
fn fail(e: &Engine, h: &FakeHost) -> usize {
    let calls = h.take_calls();
    for c in &calls {
        e.on_sync_response(h, c.token, 0, None, &[]);
    }
    calls.len()
}

/// `n` rounds of a tick whose calls all fail, 100 ms apart: the calls each round made.
fn failed_ticks(e: &Engine, h: &FakeHost, n: usize) -> Vec<usize> {
    (0..n)
        .map(|_| {
            e.on_tick(h);
            let calls = fail(e, h);
            h.advance(100 * MS);
            calls
        })
        .collect()
}

/// The value of the sync key ending in `suffix` (the keys of one store's sync share a prefix).
fn synced(h: &FakeHost, suffix: &str) -> Option<Vec<u8>> {
    let key = h.shared_keys().into_iter().find(|k| k.starts_with("rw1/sync/") && k.ends_with(suffix))?;
    h.shared_value(&key)
}

fn batch(c: &Call) -> SyncRequest {
    batch_of(&c.body)
}

fn batch_of(body: &[u8]) -> SyncRequest {
    SyncRequest::decode(body).unwrap()
}

use ratewall_core::Nanos;

#[test]
fn the_vms_of_a_node_take_their_own_outboxes_and_one_of_them_syncs() {
    let a = FakeHost::new();
    let b = FakeHost::joining(a.shared.clone());
    let (ea, eb) = (engine(&a, &rules(100, 1)), engine(&b, &rules(100, 1)));
    assert_eq!(ea.tick_interval(), Some(100 * MS));
    let _ = reply(&ea, &a, "GET", "/u/x", &[("x-user-id", "ann")]);
    let _ = reply(&eb, &b, "GET", "/u/x", &[("x-user-id", "ann")]);
    ea.on_tick(&a);
    eb.on_tick(&b);
    assert_eq!(a.take_calls().len(), 1, "the first VM to tick holds the lease");
    assert!(b.take_calls().is_empty());
    assert!(synced(&a, "/outw/1").is_some_and(|v| !v.is_empty()), "the second VM published to its outbox");
}

#[test]
fn documents_sharing_a_store_sync_with_the_longest_timeout_any_of_them_sets() {
    // Two `proxy_wasm` documents on one NGINX, the store 0.4 s away: one says a 2 s timeout,
    // the other keeps the default. They sync as one node, and its batches wait 2 s whichever
    // VM holds the lease; through the default's 50 ms every batch failed, and the first's
    // `closed` rule answered 503 to every request.
    let a = FakeHost::new();
    let b = FakeHost::joining(a.shared.clone());
    let mut s = store();
    let slow = rules(100, 1).replace(r#""timeout": "50ms""#, r#""timeout": "2s""#);
    let (ea, eb) = (engine(&a, &rules(100, 1)), engine(&b, &slow));
    // One interval: each VM ticks (the first holds the lease), the store answers what came.
    let mut interval = |vms: &[(&Engine, &FakeHost)], user: &str| -> Vec<Nanos> {
        let mut timeouts = Vec::new();
        for &(e, h) in vms {
            let _ = reply(e, h, "GET", "/u/x", &[("x-user-id", user)]);
            e.on_tick(h);
            for c in h.take_calls() {
                timeouts.push(c.timeout);
                let (status, tag, body) = answer(&mut s, h.now(), SECRET, &c);
                e.on_sync_response(h, c.token, status, tag.as_deref(), &body);
            }
        }
        // Far from the limit, deltas go every other interval.
        for (_, h) in vms {
            h.advance(200 * MS);
        }
        timeouts
    };
    let both = [(&ea, &a), (&eb, &b)];
    // The first batch went before the second document had said its timeout.
    assert_eq!(interval(&both, "ann"), [50 * MS]);
    assert_eq!(interval(&both, "bob"), [2_000 * MS], "one batch, with the longer deadline");
    // Once the second document is gone (3 intervals unsaid), so is its deadline.
    let first = [(&ea, &a)];
    let timeouts: Vec<Nanos> = (0..5).flat_map(|_| interval(&first, "cy")).collect();
    assert_eq!(timeouts.last(), Some(&(50 * MS)), "{timeouts:?}");
}

#[test]
fn a_batch_is_signed_addressed_and_counted_by_the_store() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    let mut s = store();
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 5), [200; 5]);
    e.on_tick(&h);
    let calls = h.take_calls();
    let c = &calls[0];
    assert_eq!(
        (c.upstream.as_str(), c.header(":path"), c.header(":authority")),
        ("store", Some("/v1/sync"), Some("store"))
    );
    assert_eq!(c.timeout, 50 * MS);
    let b = batch(c);
    assert_eq!((b.seq, b.ask, b.deltas.len(), b.deltas[0].units), (1, false, 1, 5));
    let (status, tag, body) = answer(&mut s, h.now(), SECRET, c);
    assert_eq!(status, 200);
    e.on_sync_response(&h, c.token, status, tag.as_deref(), &body);
    assert_eq!(counted(&s, &e, "/u/x", "ann", h.now()), 5);
    assert_eq!(h.metric("ratewall_sync_ok"), 1);
}

#[test]
fn a_vm_that_does_not_sync_hands_its_units_over_through_its_outbox() {
    let a = FakeHost::new();
    let b = FakeHost::joining(a.shared.clone());
    let (ea, eb) = (engine(&a, &rules(100, 1)), engine(&b, &rules(100, 1)));
    let mut s = store();
    ea.on_tick(&a); // a holds the lease
    serve(&mut s, &ea, &a);
    assert_eq!(statuses(&eb, &b, "GET", "/u/x", &[("x-user-id", "ann")], 3), [200; 3]);
    // Another VM keeps writing the outbox: b's publish retries past the conflicts.
    b.cas_conflicts.set(3);
    eb.on_tick(&b);
    assert!(b.take_calls().is_empty());
    a.advance(100 * MS);
    ea.on_tick(&a);
    serve(&mut s, &ea, &a);
    assert_eq!(counted(&s, &ea, "/u/x", "ann", a.now()), 3);
}

#[test]
fn units_a_vm_could_not_publish_are_kept_for_its_next_tick() {
    let a = FakeHost::new();
    let b = FakeHost::joining(a.shared.clone());
    let (ea, eb) = (engine(&a, &rules(100, 1)), engine(&b, &rules(100, 1)));
    let mut s = store();
    ea.on_tick(&a);
    serve(&mut s, &ea, &a);
    assert_eq!(statuses(&eb, &b, "GET", "/u/x", &[("x-user-id", "ann")], 4), [200; 4]);
    b.cas_always_fails.set(true);
    eb.on_tick(&b);
    b.cas_always_fails.set(false);
    for _ in 0..2 {
        a.advance(100 * MS);
        b.advance(100 * MS);
        ea.on_tick(&a);
        serve(&mut s, &ea, &a);
    }
    assert_eq!(counted(&s, &ea, "/u/x", "ann", a.now()), 0, "not published yet");
    eb.on_tick(&b);
    a.advance(100 * MS);
    ea.on_tick(&a);
    serve(&mut s, &ea, &a);
    assert_eq!(counted(&s, &ea, "/u/x", "ann", a.now()), 4, "published once, none lost");
}

#[test]
fn the_lease_passes_to_another_vm_when_its_holder_stops() {
    let a = FakeHost::new();
    let b = FakeHost::joining(a.shared.clone());
    let (ea, eb) = (engine(&a, &rules(100, 1)), engine(&b, &rules(100, 1)));
    ea.on_tick(&a);
    assert_eq!(a.take_calls().len(), 1);
    // a stops ticking; its lease runs for three intervals.
    for _ in 0..2 {
        b.advance(100 * MS);
        eb.on_tick(&b);
        assert!(b.take_calls().is_empty(), "the lease still holds");
    }
    b.advance(200 * MS);
    eb.on_tick(&b);
    assert_eq!(b.take_calls().len(), 1, "b took the lease over");
    a.advance(400 * MS);
    ea.on_tick(&a);
    assert!(a.take_calls().is_empty(), "and a does not take it back while b holds it");
}

#[test]
fn a_failed_batch_is_retried_with_the_same_seq_and_counted_once() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    let mut s = store();
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 5), [200; 5]);
    e.on_tick(&h);
    let first = h.take_calls().remove(0);
    // The store applied it, but the answer was lost.
    let _ = answer(&mut s, h.now(), SECRET, &first);
    e.on_sync_response(&h, first.token, 0, None, &[]);
    assert_eq!(h.metric("ratewall_sync_failed"), 1);
    h.advance(100 * MS);
    e.on_tick(&h);
    let again = h.take_calls().remove(0);
    assert_eq!(again.body, first.body, "the same batch, the same seq");
    let (status, tag, body) = answer(&mut s, h.now(), SECRET, &again);
    e.on_sync_response(&h, again.token, status, tag.as_deref(), &body);
    assert_eq!(counted(&s, &e, "/u/x", "ann", h.now()), 5, "counted once");
    // Far from its limit, the next batch goes two intervals later.
    h.advance(200 * MS);
    let _ = reply(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")]);
    e.on_tick(&h);
    assert_eq!(batch(&h.take_calls()[0]).seq, 2, "the next batch moves on");
}

#[test]
fn three_failures_open_the_breaker_and_a_success_closes_it() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    let mut s = store();
    assert_eq!(failed_ticks(&e, &h, 3), [1, 1, 1]);
    assert_eq!(h.metric("ratewall_sync_breaker_open"), 1);
    assert_eq!(h.metric("ratewall_sync_failed"), 3);
    e.on_tick(&h);
    assert!(h.take_calls().is_empty(), "open: no call");
    h.advance(500 * MS);
    e.on_tick(&h);
    assert_eq!(serve(&mut s, &e, &h), 1, "half-open after the backoff");
    assert_eq!(h.metric("ratewall_sync_breaker_open"), 0);
    assert_eq!(h.metric("ratewall_sync_ok"), 1);
    let warned =
        h.logs.borrow().iter().filter(|(l, m)| *l == Level::Warn && m.contains("sync to store failed")).count();
    assert_eq!(warned, 2, "the first failure and the breaker's opening are logged, not every one");
}

#[test]
fn a_store_that_refuses_the_signature_is_said_to_differ_in_its_secret() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 1), [200]);
    e.on_tick(&h);
    for c in h.take_calls() {
        e.on_sync_response(&h, c.token, 401, None, b"missing or invalid x-ratewall-signature");
    }
    assert!(h.logged("sync.secret is not the store's RATEWALL_SYNC_SECRET"));
}

#[test]
fn the_breaker_backs_off_longer_while_failures_go_on() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    let mut sent_at = Vec::new();
    for _ in 0..600 {
        e.on_tick(&h);
        if fail(&e, &h) > 0 {
            sent_at.push(h.now());
        }
        h.advance(100 * MS);
    }
    let gaps: Vec<Nanos> = sent_at.windows(2).map(|w| (w[1] - w[0]) / MS).collect();
    assert_eq!(&gaps[..3], [100, 100, 500], "{gaps:?}");
    assert!(gaps.windows(2).all(|w| w[1] >= w[0]), "{gaps:?}");
    assert!(gaps.iter().any(|g| *g >= 4_000), "{gaps:?}");
    // At most 8 s: a store back after a long outage is tried within them.
    assert!(gaps.iter().all(|g| *g <= 8_100) && gaps.iter().rev().take(3).all(|g| *g >= 8_000), "{gaps:?}");
}

/// A clock that stepped back (put right after running a minute ahead) while the breaker was
/// open: the breaker stays open no longer than its backoff, not until the clock catches up
/// with the instant it was opened at (it had stayed open 30 s after the store answered again).
#[test]
fn a_clock_put_back_keeps_the_breaker_open_no_longer_than_its_backoff() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    let mut s = store();
    failed_ticks(&e, &h, 4);
    assert_eq!(h.metric("ratewall_sync_breaker_open"), 1);
    h.now.set(h.now() - 60_000 * MS);
    e.on_tick(&h);
    assert!(h.take_calls().is_empty(), "still open: its backoff");
    h.advance(1_000 * MS);
    e.on_tick(&h);
    assert_eq!(serve(&mut s, &e, &h), 1, "half-open after the backoff (1 s after 4 failures)");
    assert_eq!(h.metric("ratewall_sync_breaker_open"), 0);
}

#[test]
fn a_batch_failing_past_the_retry_horizon_is_dropped_and_its_units_counted() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 7), [200; 7]);
    let start = h.now();
    while h.now() - start <= RETRY_HORIZON + 31_000 * MS {
        e.on_tick(&h);
        fail(&e, &h);
        h.advance(100 * MS);
    }
    assert_eq!(h.metric("ratewall_sync_dropped_units"), 7);
    assert!(h.logged("failed for 25 s and was dropped (7 admitted units the store may not have counted)"));
    // A heartbeat failing as long loses nothing, and is not worth the warning.
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    let start = h.now();
    while h.now() - start <= RETRY_HORIZON + 31_000 * MS {
        e.on_tick(&h);
        fail(&e, &h);
        h.advance(100 * MS);
    }
    assert!(h.metric("ratewall_sync_failed") > 0);
    assert!(!h.logged("failed for 25 s"));
}

#[test]
fn a_failed_batch_is_given_up_once_a_store_would_refuse_it_for_its_time() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 7), [200; 7]);
    let start = h.now();
    let mut bodies = Vec::new();
    while h.now() - start <= MAX_REQUEST_SKEW + 31_000 * MS {
        e.on_tick(&h);
        for c in h.take_calls() {
            if batch(&c).seq == 1 {
                bodies.push((h.now(), c.body.clone()));
            }
            e.on_sync_response(&h, c.token, 0, None, &[]);
        }
        h.advance(100 * MS);
    }
    // Every retry is the same body, made when the batch was: none is sent once that time is
    // further from the node's clock than a store accepts.
    assert!(bodies.len() > 3);
    assert!(bodies.iter().all(|(_, b)| *b == bodies[0].1));
    assert_eq!(batch_of(&bodies[0].1).sent, start);
    assert!(bodies.iter().all(|(at, _)| at - start <= MAX_REQUEST_SKEW), "{:?}", bodies.last().map(|b| b.0 - start));
    assert_eq!(h.metric("ratewall_sync_dropped_units"), 7);
}

/// Answers every call the host dispatched from `store`, whose clock is `skew` ahead of the
/// node's (behind, when negative); returns the statuses.
fn serve_skewed(store: &mut Store, e: &Engine, h: &FakeHost, skew: i64) -> Vec<u32> {
    let calls = h.take_calls();
    let mut statuses = Vec::new();
    for c in &calls {
        let (status, tag, body) = answer(store, h.now().saturating_add_signed(skew), SECRET, c);
        e.on_sync_response(h, c.token, status, tag.as_deref(), &body);
        statuses.push(status);
    }
    statuses
}

#[test]
fn a_node_whose_clock_is_within_the_bound_of_the_stores_is_served() {
    for skew in [-20_000 * MS as i64, 20_000 * MS as i64] {
        let h = FakeHost::new();
        let e = engine(&h, &rules(100, 1));
        let mut s = store();
        assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 5), [200; 5]);
        e.on_tick(&h);
        assert_eq!(serve_skewed(&mut s, &e, &h, skew), [200], "store {skew} ns from the node");
        assert_eq!(counted(&s, &e, "/u/x", "ann", h.now().saturating_add_signed(skew)), 5);
        assert_eq!((h.metric("ratewall_sync_ok"), h.metric("ratewall_sync_refused_stale")), (1, 0));
    }
}

#[test]
fn a_node_whose_clock_is_beyond_the_bound_is_refused_counts_it_logs_once_and_degrades() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(10, 2));
    let mut s = store();
    // The store's clock is 30 s ahead of this node's: every request is refused, 422.
    let skew = 30_000 * MS as i64;
    // For 40 s: long enough for the breaker's backoff to have grown past 2 s.
    let refused = refused_for_time(&mut s, &e, &h, skew, 400);
    assert!(refused >= 3);
    assert_eq!(h.metric("ratewall_sync_refused_stale"), refused, "every refusal is counted");
    assert_eq!(h.metric("ratewall_sync_ok"), 0);
    assert_eq!(counted(&s, &e, "/u/x", "bob", h.now().saturating_add_signed(skew)), 0, "nothing was applied");
    let lines: Vec<String> = h
        .logs
        .borrow()
        .iter()
        .filter(|(_, m)| m.contains("refuses this node's sync requests"))
        .map(|l| l.1.clone())
        .collect();
    assert_eq!(lines.len(), 1, "logged once, not per batch: {lines:?}");
    assert!(
        lines[0].contains("more than 25 s") && lines[0].contains("30.000 s behind the store's clock"),
        "{}",
        lines[0]
    );
    assert!(!lines[0].contains(SECRET));
    // Degraded: the view is stale, so open rules limit to their share, closed ones refuse.
    let ann = [("x-user-id", "ann")];
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 6), [200, 200, 200, 200, 200, 429], "10 / 2 nodes locally");
    assert_eq!(reply(&e, &h, "GET", "/cl/x", &ann).status, 503);
    assert!(h.metric("ratewall_sync_degraded_requests") >= 7);
    // Once the clocks agree, the next batch is served within 2 s (the store answered: the
    // breaker's backoff does not hold it), and a later refusal is logged again. Here the
    // node's clock was the one behind, and is put forward; a clock that was ahead and is put
    // back: below.
    let took = until_served(&mut s, &e, &h);
    assert_eq!(h.metric("ratewall_sync_ok"), 1);
    assert!(took <= 2_000 * MS, "served {} ms after the clocks agreed", took / MS);
    // Heartbeats carry the node's clock too.
    for _ in 0..10 {
        e.on_tick(&h);
        serve_skewed(&mut s, &e, &h, -skew);
        h.advance(100 * MS);
    }
    let logged = h.logs.borrow().iter().filter(|(_, m)| m.contains("refuses this node's sync requests")).count();
    assert_eq!(logged, 2);
}

/// A node whose clock ran 60 s ahead for 40 s, its batches refused for their time, then put
/// back: sync resumes within 2 s (it resumed when the breaker's grown backoff, 30 s, ran out).
#[test]
fn a_node_whose_clock_ahead_is_put_back_syncs_again_within_two_seconds() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(10, 2));
    let mut s = store();
    let ahead = 60_000 * MS;
    h.now.set(h.now() + ahead);
    refused_for_time(&mut s, &e, &h, -(ahead as i64), 400);
    h.now.set(h.now() - ahead);
    let took = until_served(&mut s, &e, &h);
    assert_eq!(h.metric("ratewall_sync_ok"), 1);
    assert!(took <= 2_000 * MS, "served {} ms after the clock was put back", took / MS);
}

/// A node 30 s ahead of the store's clock: a batch's retries repeat its time, so each is taken
/// once that time is within the store's 25 s (some 5 s after it was made), and the next one
/// is refused again. The refusal is said once, not again after each batch so taken.
#[test]
fn a_node_ahead_of_the_bound_says_the_refusal_once_though_aged_retries_are_taken() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(10, 2));
    let mut s = store();
    let mut got = Vec::new();
    for _ in 0..400 {
        let _ = reply(&e, &h, "GET", "/u/x", &[("x-user-id", "bob")]);
        e.on_tick(&h);
        got.extend(serve_skewed(&mut s, &e, &h, -30_000 * MS as i64));
        h.advance(100 * MS);
    }
    assert!(got.contains(&200) && got.iter().filter(|st| **st == 422).count() >= 3, "{got:?}");
    assert_eq!(h.logs.borrow().iter().filter(|(_, m)| m.contains("refuses this node's sync requests")).count(), 1);
}

/// `ticks` rounds 100 ms apart of a request and a tick, every batch refused for its time by
/// `s` (its clock `skew` from the node's); how many were refused.
fn refused_for_time(s: &mut Store, e: &Engine, h: &FakeHost, skew: i64, ticks: usize) -> u64 {
    let mut refused = 0;
    for _ in 0..ticks {
        let _ = reply(e, h, "GET", "/u/x", &[("x-user-id", "bob")]);
        e.on_tick(h);
        let got = serve_skewed(s, e, h, skew);
        assert!(got.iter().all(|st| *st == 422), "{got:?}");
        refused += got.len() as u64;
        h.advance(100 * MS);
    }
    refused
}

/// Ticks 100 ms apart until `s` (on the node's clock) serves a batch; how long that took.
fn until_served(s: &mut Store, e: &Engine, h: &FakeHost) -> Nanos {
    let from = h.now();
    for _ in 0..400 {
        e.on_tick(h);
        if serve_skewed(s, e, h, 0).contains(&200) {
            break;
        }
        h.advance(100 * MS);
    }
    h.now() - from
}

#[test]
fn an_ask_refused_for_its_time_is_counted_and_the_vm_stops_asking_for_a_while() {
    let h = FakeHost::new();
    let (e, mut s) = spent_grant(&h);
    let asking = burst_until_ask(&e, &h).expect("an ask");
    let c = h.take_calls().into_iter().find(|c| c.token == asking.token).unwrap();
    assert!(batch(&c).ask);
    assert_eq!(batch(&c).sent, h.now(), "an ask carries the node's clock");
    let (status, tag, body) = answer(&mut s, h.now() + 40_000 * MS, SECRET, &c);
    assert_eq!(status, 422);
    let r = e.on_ask_response(&h, asking, status, tag.as_deref(), &body).into_reply();
    assert_eq!(r.status, 200, "decided as while the store is out of reach: an open rule's local share");
    assert_eq!(h.metric("ratewall_sync_refused_stale"), 1);
    assert!(!h.logged("refuses this node's sync requests"), "said by the syncing VM's batches, once per node");
    assert!(!asks_once(&e, &h), "no ask while backing off");
}

/// Under ngx_wasm_module only the answer to a request's own call resumes it, and a call that
/// times out ends the request with no response: an ask's deadline is then a second at least,
/// not `max_wait` (50 ms here).
#[test]
fn where_only_its_own_answer_resumes_a_request_an_ask_waits_a_second_at_least() {
    for (no_root_resume, deadline) in [(false, 50 * MS), (true, crate::sync::ASK_DEADLINE_UNRESUMED)] {
        let h = FakeHost::new();
        h.no_root_resume.set(no_root_resume);
        let (e, _s) = spent_grant(&h);
        let asking = burst_until_ask(&e, &h).expect("an ask");
        let c = h.take_calls().into_iter().find(|c| c.token == asking.token).unwrap();
        assert_eq!(c.timeout, deadline);
    }
}

/// One request of `ann` on the exact rule: whether it asked (the ask is then given up).
fn asks_once(e: &Engine, h: &FakeHost) -> bool {
    h.request("GET", EXACT, &[("x-user-id", "ann")]);
    let asked = matches!(e.on_request(h), Verdict::Ask(_));
    if asked {
        let _ = h.take_calls();
        e.ask_abandoned();
    }
    asked
}

#[test]
fn a_409_gives_the_batch_up_and_the_next_batch_has_a_new_seq() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    let _ = reply(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")]);
    e.on_tick(&h);
    let c = h.take_calls().remove(0);
    e.on_sync_response(&h, c.token, 409, None, &[]);
    assert_eq!(h.metric("ratewall_sync_failed"), 1);
    let _ = reply(&e, &h, "GET", "/u/x", &[("x-user-id", "bob")]);
    h.advance(100 * MS);
    e.on_tick(&h);
    let next = batch(&h.take_calls()[0]);
    assert_eq!(next.seq, 2);
    assert_eq!(next.deltas.len(), 1, "only bob's: the refused batch is not resent");
}

#[test]
fn answers_that_are_unsigned_wrongly_signed_garbled_or_for_another_seq_are_refused() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    let mut s = store();
    let _ = reply(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")]);
    let bad = |c: &Call, s: &mut Store, which: usize| -> (u32, Option<Vec<u8>>, Vec<u8>) {
        let (status, tag, body) = answer(s, T0, SECRET, c);
        let _ = tag;
        match which {
            0 => (status, None, body),
            1 => (status, Some(b"00".repeat(32)), body),
            2 => signed("another secret!!", &SyncResponse::decode(&body).unwrap()),
            3 => {
                let garbled = b"\x01\x02garbage".to_vec();
                (
                    200,
                    Some(
                        ratewall_core::sync::hex(&ratewall_core::sync::sign(SECRET.as_bytes(), &garbled)).into_bytes(),
                    ),
                    garbled,
                )
            }
            _ => {
                let mut r = SyncResponse::decode(&body).unwrap();
                r.seq += 7;
                signed(SECRET, &r)
            }
        }
    };
    for which in 0..5 {
        e.on_tick(&h);
        let c = h.take_calls().remove(0);
        let (status, tag, body) = bad(&c, &mut s, which);
        e.on_sync_response(&h, c.token, status, tag.as_deref(), &body);
        assert_eq!(h.metric("ratewall_sync_failed"), which as u64 + 1, "answer {which} was accepted");
        assert_eq!(h.metric("ratewall_sync_ok"), 0);
        h.advance(2_000 * MS); // past the breaker's backoff
    }
    assert!(h.logged("answer not signed with the shared secret"));
}

#[test]
fn an_answer_whose_clock_is_more_than_300_s_away_is_refused() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    let mut s = store();
    e.on_tick(&h);
    let c = h.take_calls().remove(0);
    let (_, _, body) = answer(&mut s, T0, SECRET, &c);
    let mut r = SyncResponse::decode(&body).unwrap();
    r.now = T0 + 400_000 * MS;
    let (status, tag, body) = signed(SECRET, &r);
    e.on_sync_response(&h, c.token, status, tag.as_deref(), &body);
    assert_eq!(h.metric("ratewall_sync_ok"), 0);
    assert!(h.logged("more than 300 s away"));
}

#[test]
fn the_answer_cap_covers_only_the_batch_in_flight() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    let _ = reply(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")]);
    e.on_tick(&h);
    let c = h.take_calls().remove(0);
    let cap = e.answer_cap(c.token);
    assert_eq!(cap, SyncResponse::max_len([key_of(&e, "/u/x", "ann").len()].into_iter()));
    assert_eq!(e.answer_cap(c.token + 1), 0);
    // A late answer to an unknown call changes nothing.
    e.on_sync_response(&h, c.token + 1, 0, None, &[]);
    assert_eq!(h.metric("ratewall_sync_failed"), 0);
    assert!(e.answer_cap(c.token) > 0, "still in flight");
}

#[test]
fn without_the_store_open_rules_limit_to_their_share_and_closed_rules_refuse() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(10, 2));
    h.refuse_calls.set(true);
    for _ in 0..12 {
        e.on_tick(&h);
        h.advance(100 * MS);
    }
    let ann = [("x-user-id", "ann")];
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 6), [200, 200, 200, 200, 200, 429], "10 / 2 nodes locally");
    let r = reply(&e, &h, "GET", "/cl/x", &ann);
    assert_eq!(r.status, 503);
    assert_eq!(h.metric("ratewall_sync_degraded_requests"), 7);
    assert!(h.metric("ratewall_sync_failed") >= 3, "dispatch refusals count as failures");
    assert!(h.metric("ratewall_sync_staleness_ms") >= 1_000);
}

/// Two proxies share a small limit evenly, a few units each, and the store goes away: in the
/// outage the pair admits the limit, not more. (The first proxy's share was measured when the
/// store had counted its first unit alone, 100 %, and the pair admitted 14 of 10.)
#[test]
fn two_proxies_that_lose_the_store_after_a_few_units_admit_the_limit_between_them() {
    let (hosts, engines) = fleet(2, &rules(10, 2));
    let mut s = store();
    let ann = [("x-user-id", "ann")];
    let mut admitted = 0;
    let tick = |s: &mut Store| {
        for (h, e) in hosts.iter().zip(&engines) {
            h.advance(50 * MS);
            e.on_tick(h);
            serve(s, e, h);
        }
    };
    for round in 0..4 {
        let i = round % 2;
        admitted += usize::from(reply(&engines[i], &hosts[i], "GET", NO_WAIT, &ann).status == 200);
        for _ in 0..3 {
            tick(&mut s);
        }
    }
    assert_eq!(admitted, 4);
    for _ in 0..4 {
        tick(&mut s);
    }
    // The store is gone: calls fail until the view is stale.
    for _ in 0..15 {
        for (h, e) in hosts.iter().zip(&engines) {
            h.advance(100 * MS);
            e.on_tick(h);
            fail(e, h);
        }
    }
    for round in 0..20 {
        let i = round % 2;
        admitted += usize::from(reply(&engines[i], &hosts[i], "GET", NO_WAIT, &ann).status == 200);
    }
    assert_eq!(
        hosts[0].metric("ratewall_sync_degraded_requests") + hosts[1].metric("ratewall_sync_degraded_requests"),
        20
    );
    assert!(admitted <= 10, "{admitted} admitted of 10");
    assert!(admitted >= 9, "{admitted} admitted of 10");
}

#[test]
fn the_view_the_syncing_vm_writes_keeps_every_vm_fresh() {
    view_keeps_every_vm_fresh(false);
}

#[test]
fn under_ngx_wasm_modules_shared_data_the_view_keeps_every_vm_fresh_too() {
    // There a write with CAS 0 only creates a key: a view written so stayed as first written.
    view_keeps_every_vm_fresh(true);
}

fn view_keeps_every_vm_fresh(nginx: bool) {
    let a = FakeHost::new();
    let b = FakeHost::joining(a.shared.clone());
    a.nginx_cas.set(nginx);
    b.nginx_cas.set(nginx);
    let (ea, eb) = (engine(&a, &rules(10, 2)), engine(&b, &rules(10, 2)));
    let mut s = store();
    for _ in 0..20 {
        ea.on_tick(&a);
        serve(&mut s, &ea, &a);
        eb.on_tick(&b);
        assert!(b.take_calls().is_empty());
        a.advance(100 * MS);
        b.advance(100 * MS);
    }
    // An exact rule's first request asks (or, stale, would be decided degraded).
    b.request("GET", "/cl/x", &[("x-user-id", "ann")]);
    let _ = eb.on_request(&b);
    assert_eq!(b.metric("ratewall_sync_degraded_requests"), 0, "b is fresh on a's answers");
    assert!(b.metric("ratewall_sync_staleness_ms") <= 500, "at most a heartbeat period behind");
}

#[test]
fn recovered_units_are_sent_after_an_outage() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    let mut s = store();
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 3), [200; 3]);
    h.refuse_calls.set(true);
    for _ in 0..15 {
        e.on_tick(&h);
        h.advance(100 * MS);
    }
    h.refuse_calls.set(false);
    for _ in 0..40 {
        e.on_tick(&h);
        serve(&mut s, &e, &h);
        h.advance(100 * MS);
    }
    assert_eq!(counted(&s, &e, "/u/x", "ann", h.now()), 3, "kept while refused, counted once after");
}

#[test]
fn with_nothing_to_report_a_heartbeat_goes_every_third_of_stale_after() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    let mut s = store();
    let mut calls = 0;
    for _ in 0..30 {
        e.on_tick(&h);
        calls += serve(&mut s, &e, &h);
        h.advance(100 * MS);
    }
    // 3 s at one heartbeat per 333 ms (rounded up to whole ticks: every 400 ms).
    assert!((7..=10).contains(&calls), "{calls} calls in 3 s");
}

#[test]
fn far_from_the_limit_deltas_go_every_other_interval() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100_000, 1));
    let mut s = store();
    let mut calls = 0;
    for i in 0..40 {
        let _ = reply(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")]);
        e.on_tick(&h);
        let n = serve(&mut s, &e, &h);
        if i >= 10 {
            calls += n;
        }
        h.advance(100 * MS);
    }
    assert!((10..=16).contains(&calls), "{calls} batches in 30 intervals");
    assert_eq!(counted(&s, &e, "/u/x", "ann", h.now()) + 1, 40, "all but the last request's units are in");
}

#[test]
fn a_denied_counter_is_reported_with_zero_units_to_ask_for_a_fresh_grant() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(2, 1));
    let mut s = store();
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 2), [200, 200]);
    e.on_tick(&h);
    serve(&mut s, &e, &h);
    h.advance(100 * MS);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 1), [429]);
    e.on_tick(&h);
    let b = batch(&h.take_calls()[0]);
    assert_eq!(b.deltas.len(), 1);
    assert_eq!(b.deltas[0].units, 0);
}

#[test]
fn a_pushed_config_keeps_the_node_id_and_the_sequence() {
    let h = FakeHost::new();
    let first = engine(&h, &rules(100, 1));
    let mut s = store();
    let _ = reply(&first, &h, "GET", "/u/x", &[("x-user-id", "ann")]);
    first.on_tick(&h);
    let before = batch(&h.take_calls()[0]);
    // The answer never came back before the push; the new engine carries the batch on.
    let second = Engine::configure(&h, rules(200, 1).as_bytes(), Some(&first)).unwrap();
    h.advance(400 * MS);
    second.on_tick(&h);
    let calls = h.take_calls();
    let after = batch(&calls[0]);
    assert_eq!(after.node, before.node, "the same node to the store");
    let (status, tag, body) = answer(&mut s, h.now(), SECRET, &calls[0]);
    second.on_sync_response(&h, calls[0].token, status, tag.as_deref(), &body);
    assert!(after.seq >= before.seq);
    let _ = reply(&second, &h, "GET", "/u/x", &[("x-user-id", "bob")]);
    h.advance(200 * MS);
    second.on_tick(&h);
    let next = batch(&h.take_calls()[0]);
    assert_eq!((next.node, next.seq), (before.node, after.seq + 1));
}

#[test]
fn every_proxy_and_every_start_has_its_own_node_id() {
    let a = FakeHost::new();
    let mut b = FakeHost::new();
    b.node_id = b"node-2".to_vec();
    let c = FakeHost::new();
    c.advance(1);
    let ids: Vec<u64> = [&a, &b, &c]
        .into_iter()
        .map(|h| {
            let e = engine(h, &rules(100, 1));
            e.on_tick(h);
            batch(&h.take_calls()[0]).node
        })
        .collect();
    assert!(ids[0] != ids[1] && ids[0] != ids[2] && ids[1] != ids[2], "{ids:?}");
}

#[test]
fn too_many_counters_pending_drops_units_and_counts_them() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    h.refuse_calls.set(true);
    let n = crate::sync::MAX_PENDING + 50;
    for i in 0..n {
        let user = format!("u{i}");
        let _ = reply(&e, &h, "GET", "/u/x", &[("x-user-id", user.as_str())]);
    }
    assert_eq!(h.metric("ratewall_sync_dropped_units"), 50);
}

/// A node that synced a slow start for `ann` on the exact rule: its grant is about what its
/// rate spends in a lease, and the store has far more quota left.
fn spent_grant(h: &FakeHost) -> (Engine, Store) {
    spent_grant_with(h, &rules(1_000, 1))
}

/// [`spent_grant`] under the rules `doc`.
fn spent_grant_with(h: &FakeHost, doc: &str) -> (Engine, Store) {
    let e = engine(h, doc);
    let mut s = store();
    // A slow start: the store grants about what the node's rate spends in a lease.
    for _ in 0..5 {
        let _ = exact_request(&e, h, &mut s);
        e.on_tick(h);
        serve(&mut s, &e, h);
        h.advance(100 * MS);
    }
    (e, s)
}

/// Requests for `ann` until one asks (`None`: one was denied first, or none asked).
fn burst_until_ask(e: &Engine, h: &FakeHost) -> Option<crate::engine::Asking> {
    for _ in 0..5_000 {
        h.request("GET", EXACT, &[("x-user-id", "ann")]);
        match e.on_request(h) {
            Verdict::Ask(a) => return Some(a),
            Verdict::Reply(r) | Verdict::Hold(r, _) if r.status == 200 => {}
            _ => return None,
        }
    }
    None
}

#[test]
fn a_spent_grant_with_quota_left_at_the_store_asks_and_the_answer_admits() {
    let h = FakeHost::new();
    let (e, mut s) = spent_grant(&h);
    let (asks, granted) = (h.metric("ratewall_sync_asks"), h.metric("ratewall_sync_asks_granted"));
    let asking = burst_until_ask(&e, &h).expect("the node asked");
    assert!(asking.answer_cap() > 0);
    let calls = h.take_calls();
    assert_eq!(calls.len(), 1);
    let ask = batch(&calls[0]);
    assert!(ask.ask);
    assert_eq!(ask.deltas[0].units, 1);
    let before = counted(&s, &e, EXACT, "ann", h.now());
    let (status, tag, body) = answer(&mut s, h.now(), SECRET, &calls[0]);
    let r = e.on_ask_response(&h, asking, status, tag.as_deref(), &body).into_reply();
    assert_eq!(r.status, 200);
    assert_eq!(h.metric("ratewall_sync_asks"), asks + 1);
    assert_eq!(h.metric("ratewall_sync_asks_granted"), granted + 1);
    assert!(counted(&s, &e, EXACT, "ann", h.now()) > before, "the store took the request's unit");
}

/// An ask whose answer comes after its lease (a store further than a second away) still
/// admits the request it took units for: they were counted for it.
#[test]
fn an_ask_answered_after_its_lease_admits_the_request_it_was_counted_for() {
    let h = FakeHost::new();
    // The view stays fresh while the ask waits (a `stale_after` past its round trip).
    let (e, mut s) = spent_grant_with(
        &h,
        &rules_with(1_000, 1, r#""max_wait": "5s", "#)
            .replace(r#""timeout": "50ms", "stale_after": "1s""#, r#""timeout": "5s", "stale_after": "20s""#),
    );
    let asking = burst_until_ask(&e, &h).expect("the node asked");
    let calls = h.take_calls();
    let before = counted(&s, &e, EXACT, "ann", h.now());
    h.advance(1_500 * MS);
    let (status, tag, body) = answer(&mut s, h.now(), SECRET, &calls[0]);
    let r = e.on_ask_response(&h, asking, status, tag.as_deref(), &body).into_reply();
    assert_eq!(counted(&s, &e, EXACT, "ann", h.now()), before + 1, "the store took the request's unit");
    assert_eq!(r.status, 200, "and the request has it");
}

/// An exact fixed window spent by other nodes: the ask is refused, and the denial says the
/// wait until the window ends (a client that waits it is admitted), not a spent grant's
/// second after which it was refused again.
#[test]
fn an_ask_refused_for_a_spent_fixed_window_says_the_wait_until_its_end() {
    let h = FakeHost::new();
    // 10 s into a minute's window.
    let second = ratewall_core::SECOND;
    h.advance(60 * second - h.now() % (60 * second) + 10 * second);
    let e = engine(&h, &rules(5, 2).replace(r#""exact": true,"#, r#""exact": true, "algorithm": "fixed_window","#));
    let mut s = store();
    let headers = [Some(&b"ann"[..])];
    let (checks, _) = e.config().checks(&Request { method: "GET", path: EXACT, headers: &headers, ip: None });
    let spend = SyncRequest {
        node: 77,
        seq: 1,
        sent: h.now(),
        deltas: vec![Delta { key: checks[0].key.clone(), limit: checks[0].limit, units: 5 }],
        ask: false,
    };
    s.handle(h.now(), &spend).unwrap();
    let asking = burst_until_ask(&e, &h).expect("the first request asks");
    let calls = h.take_calls();
    let (status, tag, body) = answer(&mut s, h.now(), SECRET, &calls[0]);
    let r = e.on_ask_response(&h, asking, status, tag.as_deref(), &body).into_reply();
    assert_eq!(r.status, 429);
    assert_eq!(super::engine::header(&r, "retry-after"), Some("50"), "{:?}", r.headers);
    // The next one, a second later, without asking: 49.
    h.advance(second);
    h.request("GET", EXACT, &[("x-user-id", "ann")]);
    let r = e.on_request(&h).into_reply();
    assert_eq!((r.status, super::engine::header(&r, "retry-after")), (429, Some("49")));
}

/// An exact sliding window of 5 a minute, one client on one proxy: the sixth request's
/// `Retry-After` covers the store's lag (it counts units spent from a grant when their batch
/// arrives), so a client that waits exactly that long is admitted (it was refused once more
/// with `Retry-After: 1`).
#[test]
fn a_client_that_waits_an_exact_sliding_windows_retry_after_is_admitted() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(5, 1));
    let mut s = store();
    for i in 0..5 {
        assert!(exact_request(&e, &h, &mut s).0, "request {i}");
        h.advance(100 * MS);
        e.on_tick(&h);
        serve(&mut s, &e, &h);
    }
    h.request("GET", EXACT, &[("x-user-id", "ann")]);
    let r = e.on_request(&h).into_reply();
    assert_eq!(r.status, 429);
    let wait: u64 = super::engine::header(&r, "retry-after").unwrap().parse().unwrap();
    // The proxy syncs meanwhile, as it would.
    let until = h.now() + wait * ratewall_core::SECOND;
    while h.now() + 100 * MS <= until {
        h.advance(100 * MS);
        e.on_tick(&h);
        serve(&mut s, &e, &h);
    }
    h.advance(until - h.now());
    assert_eq!(exact_request(&e, &h, &mut s), (true, true), "admitted on an ask after waiting {wait} s");
}

/// An exact sliding window of 5 a minute spent over three nodes, a client's requests going
/// to each in turn: the sixth is refused with the wait until a unit is free at the store (it
/// said 1 s, and a client that waited it was refused again), and a client that waits it is
/// admitted.
#[test]
fn an_ask_refused_for_a_spent_sliding_window_says_the_wait_until_a_unit_is_free() {
    let (hosts, engines) = fleet(3, &rules(5, 3));
    let mut s = store();
    let tick = |s: &mut Store| tick_fleet(&hosts, &engines, s);
    for i in 0..5 {
        assert!(exact_request(&engines[i % 3], &hosts[i % 3], &mut s).0, "request {i}");
        tick(&mut s);
    }
    let (b, hb) = (&engines[5 % 3], &hosts[5 % 3]);
    hb.request("GET", EXACT, &[("x-user-id", "ann")]);
    let r = match b.on_request(hb) {
        Verdict::Ask(asking) => {
            let calls = hb.take_calls();
            let (status, tag, body) = answer(&mut s, hb.now(), SECRET, &calls[0]);
            b.on_ask_response(hb, asking, status, tag.as_deref(), &body).into_reply()
        }
        v => v.into_reply(),
    };
    assert_eq!(r.status, 429);
    let wait: u64 = super::engine::header(&r, "retry-after").unwrap().parse().unwrap();
    assert!(wait > 10, "a unit comes back at the store only tens of seconds on: {wait}");
    let until = hb.now() + wait * ratewall_core::SECOND;
    while hb.now() + 200 * MS <= until {
        tick(&mut s);
    }
    for h in &hosts {
        h.advance(until - hb.now());
    }
    assert!(exact_request(b, hb, &mut s).0, "admitted after waiting {wait} s");
}

/// Every node of a fleet ticks 100 ms on, its calls answered by `store`.
fn tick_fleet(hosts: &[FakeHost], engines: &[Engine], store: &mut Store) {
    for (h, e) in hosts.iter().zip(engines) {
        h.advance(100 * MS);
        e.on_tick(h);
        serve(store, e, h);
    }
}

/// A rules document of one exact rule `x` keyed by user: `limit` per `per` of `algorithm`
/// (`burst`: more limit fields, `, "burst": 3`), syncing to two nodes.
fn small_exact(algorithm: &str, limit: u64, per: &str, burst: &str) -> String {
    format!(
        r#"{{"identity": {{"user": {{"header": "x-user-id"}}}},
  "rules": [{{"name": "x", "key": ["user"], "exact": true, "algorithm": "{algorithm}",
             "limit": {{"requests": {limit}, "per": "{per}"{burst}}}}}],
  "sync": {{"cluster": "store", "secret": "{SECRET}", "interval": "100ms", "timeout": "50ms", "stale_after": "1s", "nodes": 2}}}}"#
    )
}

/// A request of `user` to `/a` on the node of `h` and `e`, its ask (if it asks) answered at
/// once from `store`.
fn asked_at_once(store: &mut Store, h: &FakeHost, e: &Engine, user: &str) -> ratewall_core::Reply {
    h.request("GET", "/a", &[("x-user-id", user)]);
    match e.on_request(h) {
        Verdict::Ask(asking) => {
            let calls = h.take_calls();
            let c = calls.last().expect("an ask call");
            let (status, tag, body) = answer(store, h.now(), SECRET, c);
            e.on_ask_response(h, asking, status, tag.as_deref(), &body).into_reply()
        }
        v => v.into_reply(),
    }
}

/// Ticks every node every 100 ms, answered from `store`, up to `until`, and sets every clock
/// at `until`.
fn sync_until(hosts: &[FakeHost], engines: &[Engine], store: &mut Store, until: Nanos) {
    while hosts[0].now() + 100 * MS <= until {
        for (h, e) in hosts.iter().zip(engines) {
            h.advance(100 * MS);
            e.on_tick(h);
            serve(store, e, h);
        }
    }
    for h in hosts {
        h.advance(until - h.now());
    }
}

/// The `Retry-After` of a 429 that says a real wait (more than a spent grant's 1 s), in s.
fn real_wait(r: &ratewall_core::Reply) -> Option<u64> {
    let wait: u64 = super::engine::header(r, "retry-after")?.parse().ok()?;
    (r.status == 429 && wait > 1).then_some(wait)
}

/// A sliding window of 5 a minute (a rule that is not exact) spent by one client, on one
/// proxy and over three in turn: the denial says the wait until a unit is free at the store,
/// and a client that waits exactly that long is admitted at once — on the unit that came back,
/// taken on an overdraft of one, with no answer to wait for (it was refused with
/// `Retry-After: 1`: the node held no grant for the unit until its next answer).
#[test]
fn a_client_that_waits_a_spent_sliding_windows_retry_after_is_admitted_without_waiting() {
    // (nodes, limit, nodes the client's requests go to in turn). At 2 a minute the node's own
    // count denies the third request, by the limit itself rather than by the store's answer.
    // (Over two nodes in turn, the second spends its initial share blind, the fleet admits
    // three, and the wait the third request was told was the store's for two: the overshoot
    // of a rule that is not exact; an exact rule's is none.)
    // With `quick`, the second request comes before the node's first answer (denied: the
    // initial share is spent), as a client's burst does.
    for (n, limit, to, quick) in
        [(1, 5, 1, false), (3, 5, 3, false), (1, 2, 1, false), (2, 2, 1, false), (2, 2, 1, true)]
    {
        let (hosts, engines) = fleet(n, &rules(limit, n as u32));
        let mut s = store();
        let tick = |s: &mut Store| tick_fleet(&hosts, &engines, s);
        let send = |i: usize| {
            hosts[i % to].request("GET", NO_WAIT, &[("x-user-id", "ann")]);
            engines[i % to].on_request(&hosts[i % to]).into_reply()
        };
        let mut i = 0;
        let wait = loop {
            let r = send(i);
            i += 1;
            if quick && i == 1 {
                for h in &hosts {
                    h.advance(50 * MS);
                }
                continue;
            }
            tick(&mut s);
            if let Some(wait) = real_wait(&r) {
                break wait;
            }
            assert!(i < 40, "{n} nodes, {to} in turn: never told the real wait");
        };
        assert!(wait > 10, "{n} nodes, {to} in turn: a unit comes back only tens of seconds on: {wait}");
        let until = hosts[0].now() + wait * ratewall_core::SECOND;
        while hosts[0].now() + 200 * MS <= until {
            tick(&mut s);
        }
        for h in &hosts {
            h.advance(until - h.now());
        }
        let calls = hosts.iter().map(|h| h.take_calls().len()).sum::<usize>();
        let r = send(i);
        assert_eq!(r.status, 200, "{n} nodes, {to} in turn: admitted after waiting {wait} s: {:?}", r.headers);
        // At once: on what the node holds, not on a call.
        assert_eq!(hosts.iter().map(|h| h.take_calls().len()).sum::<usize>(), 0, "{calls}");
        // The unit is counted at the store with the next batch, and the next request is
        // refused (one unit came back, and it is taken).
        tick(&mut s);
        tick(&mut s);
        assert_eq!(send(i + 1).status, 429, "{n} nodes, {to} in turn");
    }
}

/// A fixed window (a rule that is not exact) a client spent partly on one proxy and then on
/// another alone: once the store's answer left no quota beyond that proxy's grant, its first
/// denial says the wait to the window's end, and a client that waits it is admitted. (It said
/// a spent grant's second, and the client that waited it was refused again, told then the
/// 50-odd seconds left.)
#[test]
fn a_client_that_waits_a_spent_fixed_windows_first_retry_after_is_admitted() {
    let doc = rules(6, 2).replacen(
        r#""key": ["user"], "limit": {"requests": 6, "per": "60s"}}"#,
        r#""key": ["user"], "algorithm": "fixed_window", "limit": {"requests": 6, "per": "60s"}}"#,
        1,
    );
    assert!(doc.contains("fixed_window"));
    let (hosts, engines) = fleet(2, &doc);
    let mut s = store();
    // Clear of a window's edge: 5 s into a minute.
    let into = hosts[0].now() % (60 * ratewall_core::SECOND);
    for h in &hosts {
        h.advance((65 * ratewall_core::SECOND - into) % (60 * ratewall_core::SECOND));
    }
    tick_fleet(&hosts, &engines, &mut s);
    let send = |i: usize| {
        hosts[i].request("GET", NO_WAIT, &[("x-user-id", "ann")]);
        engines[i].on_request(&hosts[i]).into_reply()
    };
    let mut admitted = 0;
    for _ in 0..2 {
        admitted += usize::from(send(1).status == 200);
        tick_fleet(&hosts, &engines, &mut s);
    }
    // Then on the other proxy, requests 50 ms apart, the proxies syncing between every other.
    let mut i = 0;
    let refused = loop {
        let r = send(0);
        i += 1;
        match r.status {
            429 if admitted >= 6 => break r,
            429 => {}
            _ => admitted += 1,
        }
        for h in &hosts {
            h.advance(50 * MS);
        }
        if i % 2 == 0 {
            tick_fleet(&hosts, &engines, &mut s);
        }
        assert!(i < 40, "never refused");
    };
    let wait: u64 = super::engine::header(&refused, "retry-after").unwrap().parse().unwrap();
    assert!(wait > 1, "the first denial says the window's end: {:?}", refused.headers);
    let until = hosts[0].now() + wait * ratewall_core::SECOND;
    while hosts[0].now() + 200 * MS <= until {
        tick_fleet(&hosts, &engines, &mut s);
    }
    for h in &hosts {
        h.advance(until - h.now());
    }
    assert_eq!(send(0).status, 200, "admitted after waiting {wait} s");
}

/// An ask that fails (here: timed out) is a store failure for its request: an `open` rule
/// decides it on the node's local share (a fresh client is not told it is over its limit), a
/// `closed` one rejects it with 503; and while the VM backs off, its requests are decided so
/// at once, without a call.
#[test]
fn a_failed_ask_decides_the_request_as_the_rules_store_failure_policy_says() {
    for (path, status) in [(EXACT, 200), ("/cl/x", 503)] {
        let h = FakeHost::new();
        let (e, _s) = spent_grant_with(&h, &rules(1_000, 1));
        let granted = h.metric("ratewall_sync_asks_granted");
        let degraded = h.metric("ratewall_sync_degraded_requests");
        let asking = (0..5_000)
            .find_map(|_| {
                h.request("GET", path, &[("x-user-id", "ann")]);
                match e.on_request(&h) {
                    Verdict::Ask(a) => Some(a),
                    _ => None,
                }
            })
            .expect("the node asked");
        let _ = h.take_calls();
        let r = e.on_ask_response(&h, asking, 0, None, &[]).into_reply();
        assert_eq!(r.status, status, "{path}");
        // Said, once a minute at most (under NGINX the metrics are not to be read).
        let said = |h: &FakeHost| h.logs.borrow().iter().filter(|(_, l)| l.contains("an ask to store failed")).count();
        assert_eq!(said(&h), 1, "{:?}", h.logs.borrow());
        assert_eq!(h.metric("ratewall_sync_asks_granted"), granted);
        assert_eq!(h.metric("ratewall_sync_degraded_requests"), degraded + 1);
        h.request("GET", path, &[("x-user-id", "ann")]);
        let next = e.on_request(&h).into_reply();
        assert_eq!((next.status, h.take_calls().len()), (status, 0), "{path}: decided at once, no call");
    }
}

/// An ask the store answers 503 because the counter it names is unreadable to it ("an ask
/// names a stored counter that is unreadable; nothing is taken and it is kept") fails its own
/// request only: a `closed` rule answers it 503, and another client's next request on the same
/// rule asks as before. No answer at all (a store out of reach) still stops the VM asking, its
/// `closed` requests answered 503 at once.
#[test]
fn an_ask_refused_for_an_unreadable_counter_fails_only_its_own_request() {
    const UNREADABLE: &[u8] = b"an ask names a stored counter that is unreadable; nothing is taken and it is kept";
    let until_ask = |e: &Engine, h: &FakeHost, user: &str| {
        for _ in 0..5_000 {
            h.request("GET", "/cl/x", &[("x-user-id", user)]);
            match e.on_request(h) {
                Verdict::Ask(a) => return Ok(a),
                v => {
                    let r = v.into_reply();
                    if r.status != 200 {
                        return Err(r.status);
                    }
                }
            }
        }
        Err(0)
    };
    for (status, body, bystander_asks) in [(503, UNREADABLE, true), (0, &b""[..], false)] {
        let h = FakeHost::new();
        let (e, _s) = spent_grant_with(&h, &rules(1_000, 1));
        let victim = until_ask(&e, &h, "eve").expect("the victim's request asked");
        let _ = h.take_calls();
        h.advance(5 * MS);
        let r = e.on_ask_response(&h, victim, status, None, body).into_reply();
        assert_eq!(r.status, 503, "status {status}: the victim's request, as its closed rule says");
        h.advance(100 * MS);
        let bystander = until_ask(&e, &h, "ann");
        let _ = h.take_calls();
        if bystander_asks {
            assert!(bystander.is_ok(), "status {status}: the other client asks, got {:?}", bystander.err());
        } else {
            assert_eq!(bystander.err(), Some(503), "status {status}: no answer, the store out of reach");
        }
    }
}

/// An ask a store refuses as answered already (409: its copy went through another store) is
/// decided on what the node holds: a `closed` rule's request is denied as over its grant (429),
/// not answered 503 as with the store out of reach.
#[test]
fn an_ask_answered_already_is_decided_on_what_the_node_holds() {
    let h = FakeHost::new();
    let (e, _s) = spent_grant_with(&h, &rules(1_000, 1));
    let asking = loop {
        h.request("GET", "/cl/x", &[("x-user-id", "eve")]);
        match e.on_request(&h) {
            Verdict::Ask(a) => break a,
            v => assert_eq!(v.into_reply().status, 200),
        }
    };
    let _ = h.take_calls();
    h.advance(5 * MS);
    let r = e.on_ask_response(&h, asking, 409, None, b"ask 7 of node 1 was answered already").into_reply();
    assert_eq!(r.status, 429, "{:?}", r.headers);
    assert!(r.headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("retry-after")));
}

/// Asks on their way together fail together when the store stalls: they are one failure
/// (the VM stops asking for 1 s), not one each (12 in one stall of 1 s had kept a worker from
/// asking for 30 s); an ask sent after the backoff still doubles it.
#[test]
fn asks_that_fail_together_back_off_as_one_failure() {
    let h = FakeHost::new();
    let (e, mut s) = spent_grant(&h);
    // Time passes with the batches answered: the view stays fresh.
    let pass = |s: &mut Store, ms: u64| {
        for _ in 0..ms / 100 {
            h.advance(100 * MS);
            e.on_tick(&h);
            serve(s, &e, &h);
        }
    };
    let mut paused = vec![burst_until_ask(&e, &h).expect("the node asked")];
    for _ in 0..5 {
        h.request("GET", EXACT, &[("x-user-id", "ann")]);
        if let Verdict::Ask(a) = e.on_request(&h) {
            paused.push(a);
        }
    }
    assert_eq!(paused.len(), 6, "six asks in flight");
    let _ = h.take_calls();
    h.advance(50 * MS);
    for a in paused {
        let _ = e.on_ask_response(&h, a, 0, None, &[]);
    }
    // Whether 20 requests make no ask.
    let quiet = || {
        let asks = h.metric("ratewall_sync_asks");
        for _ in 0..20 {
            h.request("GET", EXACT, &[("x-user-id", "ann")]);
            let _ = e.on_request(&h);
        }
        h.metric("ratewall_sync_asks") == asks
    };
    assert!(quiet(), "backing off");
    pass(&mut s, 1_000);
    let asking = burst_until_ask(&e, &h).expect("asks again after 1 s, not 32");
    let _ = h.take_calls();
    let _ = e.on_ask_response(&h, asking, 0, None, &[]);
    pass(&mut s, 1_500);
    assert!(quiet(), "a failure after the backoff doubles it: 2 s");
    pass(&mut s, 600);
    assert!(burst_until_ask(&e, &h).is_some());
}

#[test]
fn asks_in_flight_are_bounded_and_an_abandoned_one_frees_its_place() {
    let h = FakeHost::new();
    let (e, _s) = spent_grant(&h);
    let mut paused = vec![burst_until_ask(&e, &h).expect("the node asked")];
    // Every further request asks too while its grant is spent, up to the bound.
    let last = loop {
        h.request("GET", EXACT, &[("x-user-id", "ann")]);
        match e.on_request(&h) {
            Verdict::Ask(a) => paused.push(a),
            v => break v.into_reply(),
        }
        assert!(paused.len() <= 1_000, "unbounded asks");
    };
    assert_eq!(last.status, 429, "past the bound: decided at once");
    assert_eq!(paused.len(), crate::sync::MAX_ASKS as usize);
    e.ask_abandoned();
    h.request("GET", EXACT, &[("x-user-id", "ann")]);
    assert!(matches!(e.on_request(&h), Verdict::Ask(_)), "a place was freed");
}

#[test]
fn an_ask_is_not_made_while_the_breaker_is_open() {
    let h = FakeHost::new();
    let (e, _s) = spent_grant(&h);
    let mut failures = 0;
    while failures < 3 {
        h.advance(100 * MS);
        e.on_tick(&h);
        failures += fail(&e, &h);
    }
    assert_eq!(h.metric("ratewall_sync_breaker_open"), 1);
    let asks = h.metric("ratewall_sync_asks");
    assert!(burst_until_ask(&e, &h).is_none(), "no ask into an open breaker");
    assert_eq!(h.metric("ratewall_sync_asks"), asks);
}

#[test]
fn an_ask_waits_at_most_max_wait() {
    let h = FakeHost::new();
    let (e, _s) = spent_grant_with(&h, &rules_with(1_000, 1, r#""max_wait": "7ms", "#));
    let _asking = burst_until_ask(&e, &h).expect("the node asked");
    let calls = h.take_calls();
    assert_eq!(calls[0].timeout, 7 * MS, "the ask's deadline is max_wait (batches keep the 50 ms timeout)");
}

/// An ask times out after `silent` intervals with no batch answered (a batch failing in each,
/// below the breaker's three), then a batch is answered at once: whether the next request
/// that needs an ask asks.
fn asks_after_a_failed_ask_and_an_answered_batch(silent: u64) -> bool {
    let h = FakeHost::new();
    let (e, mut s) = spent_grant(&h);
    for i in 0..silent {
        h.advance(100 * MS);
        if i < 2 {
            e.on_tick(&h);
            fail(&e, &h);
        }
    }
    let asking = burst_until_ask(&e, &h).expect("the node asked");
    let _ = h.take_calls();
    let _ = e.on_ask_response(&h, asking, 0, None, &[]);
    h.advance(100 * MS);
    e.on_tick(&h);
    serve(&mut s, &e, &h);
    burst_until_ask(&e, &h).is_some()
}

/// Asks that failed while the store was out of reach (no batch answered for 300 ms) resume
/// with the first batch answered in time: after an outage, closed rules had answered 503 for
/// as long as the asks' backoff lasted. Asks that time out while batches are answered (a
/// store slow on asks alone) keep backing off.
#[test]
fn asks_that_failed_in_an_outage_resume_once_a_batch_is_answered_and_others_back_off() {
    assert!(asks_after_a_failed_ask_and_an_answered_batch(3), "asked again once the store answered");
    assert!(!asks_after_a_failed_ask_and_an_answered_batch(0), "no ask within its backoff");
}

#[test]
fn a_vm_whose_asks_time_out_stops_asking_for_a_while() {
    let h = FakeHost::new();
    let (e, mut s) = spent_grant(&h);
    let headers = [Some(&b"ann"[..])];
    let (checks, _) = e.config().checks(&Request { method: "GET", path: EXACT, headers: &headers, ip: None });
    let ann = Delta { key: checks[0].key.clone(), limit: checks[0].limit, units: 1 };
    // Time passes with the batches answered (the view stays fresh), and another node spends
    // on the counter: this node's grant (renewed meanwhile, and all its bursts spend) is a
    // share, not all that remains, so it may still ask.
    let mut other = 0;
    let mut pass = |s: &mut Store, ms: u64| {
        for _ in 0..ms / 100 {
            h.advance(100 * MS);
            e.on_tick(&h);
            serve(s, &e, &h);
            other += 1;
            s.handle(
                h.now(),
                &SyncRequest { node: 999, seq: other, sent: h.now(), deltas: vec![ann.clone()], ask: false },
            )
            .unwrap();
        }
    };
    let asks = h.metric("ratewall_sync_asks");
    let asking = burst_until_ask(&e, &h).expect("the node asked");
    let _ = h.take_calls();
    // The store is further than max_wait: the host times the ask out, and the request is
    // decided on the node's local share (an open rule).
    assert_eq!(e.on_ask_response(&h, asking, 0, None, &[]).into_reply().status, 200);
    assert!(!asks_once(&e, &h), "no ask for a second: decided at once");
    assert_eq!(h.metric("ratewall_sync_asks"), asks + 1);
    pass(&mut s, 1_000);
    let asking = burst_until_ask(&e, &h).expect("it tries again after 1 s");
    let _ = h.take_calls();
    let _ = e.on_ask_response(&h, asking, 0, None, &[]);
    pass(&mut s, 1_500);
    assert!(!asks_once(&e, &h), "then waits 2 s");
    pass(&mut s, 600);
    assert!(burst_until_ask(&e, &h).is_some());
}

/// Runs ticks every 100 ms for `ms`, answering every call from `store`; the keys each
/// batch named with 0 units, by the time (ms since `from`) it was sent.
fn renewals(e: &Engine, h: &FakeHost, s: &mut Store, ms: u64) -> Vec<(u64, Vec<Vec<u8>>)> {
    let from = h.now();
    let mut out = Vec::new();
    for _ in 0..ms / 100 {
        h.advance(100 * MS);
        e.on_tick(h);
        for c in h.take_calls() {
            let b = batch(&c);
            let zeros: Vec<Vec<u8>> = b.deltas.iter().filter(|d| d.units == 0).map(|d| d.key.clone()).collect();
            if !zeros.is_empty() {
                out.push(((h.now() - from) / MS, zeros));
            }
            let (status, tag, body) = answer(s, h.now(), SECRET, &c);
            e.on_sync_response(h, c.token, status, tag.as_deref(), &body);
        }
    }
    out
}

/// A node that admitted 3 requests of `ann` under a limit of `limit` and synced them.
fn three_synced(limit: u64) -> (FakeHost, Engine, Store) {
    let h = FakeHost::new();
    let e = engine(&h, &rules(limit, 1));
    let mut s = store();
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 3), [200; 3]);
    e.on_tick(&h);
    assert_eq!(serve(&mut s, &e, &h), 1);
    (h, e, s)
}

#[test]
fn a_recent_counters_grant_is_renewed_before_it_lapses_and_a_quiet_ones_is_not() {
    let (h, e, mut s) = three_synced(100);
    let ann = key_of(&e, "/u/x", "ann");
    // Far from its limit, the grant is leased for 2 s: the node renews it (a 0-unit delta)
    // within the last two intervals and a round trip before it ends, with no request.
    let renewed = renewals(&e, &h, &mut s, 2_000);
    assert!(!renewed.is_empty() && renewed.iter().all(|(_, k)| k == std::slice::from_ref(&ann)), "{renewed:?}");
    assert!(renewed[0].0 >= 1_500 && renewed[0].0 < 2_000, "renewed at {} ms", renewed[0].0);
    // A request after the first lease's end is admitted on the renewed grant, with no ask.
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 1), [200]);
    assert!(h.take_calls().is_empty(), "no ask");
    // Quiet for 5 s (counted in whole seconds: up to 6), the counter is no longer renewed.
    let later = renewals(&e, &h, &mut s, 12_000);
    assert!(!later.is_empty() && later.iter().all(|(at, _)| *at <= 6_100), "{later:?}");
}

/// Answers every call the host dispatched from `store`, except that the counter `unreadable`
/// is named in the answer's failed section (its stored value unreadable to the store), not
/// applied; returns the units it refused.
fn serve_unreadable(store: &mut Store, e: &Engine, h: &FakeHost, unreadable: &[u8]) -> u64 {
    let mut refused = 0;
    for c in h.take_calls() {
        let mut req = batch(&c);
        let at = req.deltas.iter().position(|d| d.key == unreadable);
        let taken = at.map(|i| req.deltas.remove(i));
        let mut resp = store.handle(h.now(), &req).unwrap();
        if let (Some(i), Some(d)) = (at, taken) {
            refused += d.units;
            resp.grants.insert(i, ratewall_core::sync::Grant::unapplied(&d.key));
            resp.failed = vec![i as u32];
        }
        let (status, tag, body) = signed(SECRET, &resp);
        e.on_sync_response(h, c.token, status, tag.as_deref(), &body);
    }
    refused
}

#[test]
fn a_counter_the_store_could_not_apply_is_sent_again_and_the_rest_of_the_answer_is_taken() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    let mut s = store();
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 3), [200; 3]);
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "bob")], 4), [200; 4]);
    let ann = key_of(&e, "/u/x", "ann");
    e.on_tick(&h);
    assert_eq!(serve_unreadable(&mut s, &e, &h, &ann), 3);
    assert_eq!((counted(&s, &e, "/u/x", "ann", h.now()), counted(&s, &e, "/u/x", "bob", h.now())), (0, 4));
    assert_eq!(h.metric("ratewall_sync_unapplied_counters"), 1);
    assert_eq!(h.metric("ratewall_sync_failed"), 0, "the batch itself was answered");
    assert!(h.logged("could not apply 1 counter(s)"));
    // The next batch (a new seq) carries ann's units again, and only hers: bob's were counted.
    let mut calls = Vec::new();
    for _ in 0..20 {
        if !calls.is_empty() {
            break;
        }
        h.advance(100 * MS);
        e.on_tick(&h);
        calls = h.take_calls();
    }
    let next = batch(&calls[0]);
    assert_eq!(next.seq, 2);
    assert_eq!(next.deltas.iter().find(|d| d.key == ann).map(|d| d.units), Some(3));
    assert!(next.deltas.iter().all(|d| d.key == ann || d.units == 0), "{:?}", next.deltas);
    for c in &calls {
        let (status, tag, body) = answer(&mut s, h.now(), SECRET, c);
        e.on_sync_response(&h, c.token, status, tag.as_deref(), &body);
    }
    assert_eq!((counted(&s, &e, "/u/x", "ann", h.now()), counted(&s, &e, "/u/x", "bob", h.now())), (3, 4));
    // A counter no store can read: its units go out again for as long as a failed batch's
    // would, then are dropped and counted so; never counted twice meanwhile.
    assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "cat")], 2), [200; 2]);
    let cat = key_of(&e, "/u/x", "cat");
    let start = h.now();
    let mut refused = 0;
    while h.now() - start <= 30_000 * MS {
        e.on_tick(&h);
        refused += serve_unreadable(&mut s, &e, &h, &cat);
        h.advance(100 * MS);
    }
    assert!(refused >= 4, "sent again: {refused}");
    assert_eq!(h.metric("ratewall_sync_dropped_units"), 2);
    assert_eq!(counted(&s, &e, "/u/x", "cat", h.now()), 0);
    assert_eq!(h.metric("ratewall_sync_failed"), 0);
}

#[test]
fn a_counter_granted_nothing_while_quota_remains_is_renewed_at_the_next_batch() {
    for (grant, renewed_at) in [(0, Some(100)), (5, None)] {
        let h = FakeHost::new();
        let e = engine(&h, &rules(100, 1));
        let mut s = store();
        assert_eq!(statuses(&e, &h, "GET", "/u/x", &[("x-user-id", "ann")], 3), [200; 3]);
        e.on_tick(&h);
        let c = h.take_calls().remove(0);
        let (_, _, body) = answer(&mut s, h.now(), SECRET, &c);
        let mut r = SyncResponse::decode(&body).unwrap();
        // Other nodes' grants hold what remains: the store grants this node `grant`, for 2 s.
        for g in &mut r.grants {
            (g.grant, g.lease) = (grant, 2_000 * MS);
        }
        assert!(r.grants.iter().all(|g| g.remaining > 50));
        let (status, tag, body) = signed(SECRET, &r);
        e.on_sync_response(&h, c.token, status, tag.as_deref(), &body);
        let renewed = renewals(&e, &h, &mut s, 500);
        let ann = key_of(&e, "/u/x", "ann");
        assert_eq!(renewed.first().map(|(at, k)| (*at, k.clone())), renewed_at.map(|at| (at, vec![ann])), "{grant}");
    }
}

#[test]
fn units_admitted_while_a_batch_is_on_its_way_are_taken_from_the_grant_its_answer_brings() {
    // (the grant answered, requests admitted between the batch's cut and its answer, then
    // admitted on the grant and the overdraft of 1): a grant of 1, room the store found for
    // the node, is kept.
    for (grant, on_the_way, then) in [(10, 4, 6 + 1), (10, 0, 10 + 1), (1, 4, 1 + 1)] {
        let h = FakeHost::new();
        let e = engine(&h, &rules(100, 1));
        let mut s = store();
        let ann = [("x-user-id", "ann")];
        assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, 3), [200; 3]);
        e.on_tick(&h);
        let c = h.take_calls().remove(0);
        assert_eq!(statuses(&e, &h, "GET", "/u/x", &ann, on_the_way), vec![200; on_the_way]);
        let (_, _, body) = answer(&mut s, h.now(), SECRET, &c);
        let mut r = SyncResponse::decode(&body).unwrap();
        for g in &mut r.grants {
            (g.grant, g.lease) = (grant, 2_000 * MS);
        }
        let (status, tag, body) = signed(SECRET, &r);
        e.on_sync_response(&h, c.token, status, tag.as_deref(), &body);
        let after = statuses(&e, &h, "GET", "/u/x", &ann, 20);
        assert_eq!(after.iter().take_while(|s| **s == 200).count(), then, "{grant} {on_the_way}: {after:?}");
    }
}

#[test]
fn units_counted_unreported_are_at_most_those_admitted_since_the_last_answer() {
    use crate::sync::unreported;
    // (admitted since the last answer, found unreported then, in this batch)
    assert_eq!(unreported(5, 0, 3), 2);
    assert_eq!(unreported(5, 2, 3), 4);
    assert_eq!(unreported(1, 0, 4), 0);
    // Ten units lost with a batch given up weigh on one answer, as no more than it admitted.
    assert_eq!(unreported(2, 10, 0), 2);
    assert_eq!(unreported(0, 2, 0), 0);
}

#[test]
fn a_counter_whose_quota_is_spent_is_not_renewed() {
    let (h, e, mut s) = three_synced(3);
    // The answer showed nothing left: a renewal could gain nothing.
    assert_eq!(renewals(&e, &h, &mut s, 3_000), []);
}

#[test]
fn a_vm_whose_ask_timed_out_asks_no_more_while_batches_take_longer_than_max_wait() {
    let h = FakeHost::new();
    let e = engine(&h, &rules_with(1_000, 1, r#""max_wait": "7ms", "#));
    let mut s = store();
    // Another node spends on the counter too, so this one's grant is a share and it may ask.
    let headers = [Some(&b"ann"[..])];
    let (checks, _) = e.config().checks(&Request { method: "GET", path: EXACT, headers: &headers, ip: None });
    let delta = Delta { key: checks[0].key.clone(), limit: checks[0].limit, units: 1 };
    let other = std::cell::Cell::new(0);
    let spend = |s: &mut Store| {
        other.set(other.get() + 1);
        let batch = SyncRequest { node: 999, seq: other.get(), sent: h.now(), deltas: vec![delta.clone()], ask: false };
        s.handle(h.now(), &batch).unwrap();
    };
    // Each batch's answer comes 10 ms after it was sent: an ask's would come after the
    // request stopped waiting for it.
    let slow = |s: &mut Store, ms: u64| {
        for _ in 0..ms / 100 {
            let _ = exact_request(&e, &h, s);
            e.on_tick(&h);
            let calls = h.take_calls();
            h.advance(10 * MS);
            for c in &calls {
                let (status, tag, body) = answer(s, h.now(), SECRET, c);
                e.on_sync_response(&h, c.token, status, tag.as_deref(), &body);
            }
            h.advance(90 * MS);
            spend(s);
        }
    };
    slow(&mut s, 500);
    let view = synced(&h, "/view").unwrap();
    assert_eq!(u64::from_le_bytes(view[20..28].try_into().unwrap()), 10 * MS, "the view carries the round trip");
    // Batches alone do not stop asks (a store may answer a one-delta ask sooner)...
    let asks = h.metric("ratewall_sync_asks");
    let asking = burst_until_ask(&e, &h).expect("the node asked");
    let _ = h.take_calls();
    let _ = e.on_ask_response(&h, asking, 0, None, &[]);
    // ...but once one timed out, no ask while they stay that slow, past the 1 s backoff.
    slow(&mut s, 1_500);
    assert!(burst_until_ask(&e, &h).is_none(), "decided at once");
    assert_eq!(h.metric("ratewall_sync_asks"), asks + 1);
    // Nearer again, it asks.
    for _ in 0..3 {
        h.advance(100 * MS);
        e.on_tick(&h);
        serve(&mut s, &e, &h);
        spend(&mut s);
    }
    assert!(burst_until_ask(&e, &h).is_some());
}

/// A node that synced a slow start for `ann` on the rule that is not exact, answered by
/// `store`.
fn slow_start(e: &Engine, h: &FakeHost, store: &mut Store) {
    let ann = [("x-user-id", "ann")];
    for _ in 0..5 {
        let _ = reply(e, h, "GET", NO_WAIT, &ann);
        e.on_tick(h);
        serve(store, e, h);
        h.advance(100 * MS);
    }
}

/// Requests for `ann` on the rule that is not exact until one is denied (at most 5,000): how
/// many were admitted. None may wait.
fn burst_until_denied(e: &Engine, h: &FakeHost) -> u64 {
    let mut admitted = 0;
    for _ in 0..5_000 {
        h.request("GET", NO_WAIT, &[("x-user-id", "ann")]);
        match e.on_request(h) {
            Verdict::Reply(r) | Verdict::Hold(r, _) if r.status == 200 => admitted += 1,
            Verdict::Reply(r) => {
                assert_eq!(r.status, 429);
                return admitted;
            }
            v => panic!("a request that is not exact waited: {v:?}"),
        }
    }
    admitted
}

#[test]
fn near_the_quotas_end_the_overdraft_is_given_with_the_chance_the_store_had_units_for_it() {
    let given =
        |beyond: u64| (0..5_000).filter(|&d| crate::sync::overdraft(200, 20, 5 + beyond, 5, false, d) > 0).count();
    assert_eq!(given(0), 0, "nothing beyond the grant: no overdraft");
    assert_eq!(given(1), 1_000, "one unit beyond: a fifth of the answers");
    assert_eq!(given(2), 2_000);
    assert_eq!(given(4), 4_000);
    assert_eq!(given(5), 5_000, "five or more: every answer");
    assert_eq!(crate::sync::overdraft(200, 20, 100, 5, false, 0), 1, "at most max(1, 200 / 100 / 20)");
    assert_eq!(crate::sync::overdraft(200, 20, 100, 0, true, 0), 0, "overdrawn and not repaid: none");
}

#[test]
fn a_spent_grant_admits_within_the_overdraft_without_a_call() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(1_000, 1));
    let mut s = store();
    slow_start(&e, &h, &mut s);
    let held = e.table().grant(&h, &key_of(&e, NO_WAIT, "ann")).expect("a grant");
    assert!(held.more && held.over > 0, "the store had quota beyond the grant: {held:?}");
    // The grant, then the overdraft, with no ask and no call; then a denial.
    let admitted = burst_until_denied(&e, &h);
    assert_eq!(admitted, u64::from(held.units + held.over), "{held:?}");
    assert!(h.take_calls().is_empty(), "no call on the request path");
    assert_eq!(h.metric("ratewall_sync_asks"), 0);
}

#[test]
fn the_overdraft_is_reported_and_repaid_from_what_the_store_grants_next() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(1_000, 1));
    let mut s = store();
    slow_start(&e, &h, &mut s);
    let before = counted(&s, &e, NO_WAIT, "ann", h.now());
    let admitted = burst_until_denied(&e, &h);
    h.advance(100 * MS);
    e.on_tick(&h);
    serve(&mut s, &e, &h);
    // The store counted every unit admitted, the overdraft's too...
    assert_eq!(counted(&s, &e, NO_WAIT, "ann", h.now()), before + admitted);
    // ...so the next grant and overdraft come out of what remains after them.
    let next = e.table().grant(&h, &key_of(&e, NO_WAIT, "ann")).expect("a grant");
    assert!(u64::from(next.units + next.over) <= 1_000 - before - admitted, "{next:?}");
}

/// `n` nodes (each a host with its own shared data and node id), an engine on each for `doc`.
fn fleet(n: usize, doc: &str) -> (Vec<FakeHost>, Vec<Engine>) {
    let hosts: Vec<FakeHost> = (0..n)
        .map(|i| {
            let mut h = FakeHost::new();
            h.node_id = format!("node-{i}").into_bytes();
            h
        })
        .collect();
    let engines = hosts.iter().map(|h| engine(h, doc)).collect();
    (hosts, engines)
}

#[test]
fn a_token_buckets_initial_share_splits_its_burst_not_its_rate() {
    // 1,000 a minute with a burst of 200, on 3 nodes: before any answer a node admits its
    // share of the 200 the bucket holds, not of the 1,000.
    let doc = rules(1_000, 3).replacen(
        r#""requests": 1000, "per": "60s"}"#,
        r#""requests": 1000, "per": "60s", "burst": 200}"#,
        1,
    );
    let h = FakeHost::new();
    let e = engine(&h, &doc);
    let admitted = statuses(&e, &h, "GET", NO_WAIT, &[("x-user-id", "ann")], 120).iter().filter(|s| **s == 200).count();
    assert_eq!(admitted, 200 / 3);
}

/// Every node ticks every 100 ms for `ms`, its calls answered from `store`.
fn tick_all(hosts: &[FakeHost], engines: &[Engine], store: &mut Store, ms: u64) {
    for _ in 0..ms / 100 {
        for (h, e) in hosts.iter().zip(engines) {
            h.advance(100 * MS);
            e.on_tick(h);
            serve(store, e, h);
        }
    }
}

#[test]
fn a_node_that_met_a_spent_fixed_window_only_in_denials_starts_the_next_window_on_its_initial_share() {
    let doc =
        rules(1, 2).replace(r#""limit": {"requests": 1,"#, r#""algorithm": "fixed_window", "limit": {"requests": 1,"#);
    let (hosts, engines) = fleet(2, &doc);
    let mut s = store();
    let user = [("x-user-id", "ann")];
    // Into the first quarter of a minute (T0 is 20 s into one).
    tick_all(&hosts, &engines, &mut s, 41_000);
    // Node b spends the counter's one unit and reports it; node a hears it is out.
    assert_eq!(statuses(&engines[1], &hosts[1], "GET", NO_WAIT, &user, 1), [200]);
    tick_all(&hosts, &engines, &mut s, 300);
    // Node a's requests are denied: it holds an answer on the counter, and nothing of its own.
    assert_eq!(statuses(&engines[0], &hosts[0], "GET", NO_WAIT, &user, 1), [429]);
    tick_all(&hosts, &engines, &mut s, 300);
    assert_eq!(statuses(&engines[0], &hosts[0], "GET", NO_WAIT, &user, 1), [429]);
    // In the next minute, before any answer on the counter, node a starts on its initial
    // share: the answer it held was the last minute's.
    tick_all(&hosts, &engines, &mut s, 60_000);
    assert_eq!(statuses(&engines[0], &hosts[0], "GET", NO_WAIT, &user, 1), [200]);
}

#[test]
fn nodes_that_over_spend_are_held_to_the_bound() {
    // Three nodes on one counter of 100, each admitting all it may every interval: the
    // fleet admits at most the limit plus each node's overdraft (max(1, 100 / 100 / 3) = 1).
    let (hosts, engines) = fleet(3, &rules(100, 3));
    let mut s = store();
    // Each node's first request is counted by the store before the bursts: from then on
    // every node spends grants, not an initial share the store has not counted.
    let mut admitted = 0;
    for (e, h) in engines.iter().zip(&hosts) {
        admitted += u64::from(reply(e, h, "GET", NO_WAIT, &[("x-user-id", "ann")]).status == 200);
        e.on_tick(h);
        serve(&mut s, e, h);
    }
    // Every interval each node spends all it may before any of them syncs — but the first,
    // which spends what it holds only at the end, while the others keep spending.
    for round in 0..40 {
        for (i, (e, h)) in engines.iter().zip(&hosts).enumerate() {
            if i > 0 || round == 0 || round == 5 {
                admitted += burst_until_denied(e, h);
            }
        }
        for (e, h) in engines.iter().zip(&hosts) {
            h.advance(100 * MS);
            e.on_tick(h);
            serve(&mut s, e, h);
        }
    }
    assert!((100..=100 + 3).contains(&admitted), "admitted {admitted}");
}

/// Decides one request for `ann` on the exact rule, answering its ask (if it asks) from
/// `store`: whether it passed, and whether it asked.
fn exact_request(e: &Engine, h: &FakeHost, store: &mut Store) -> (bool, bool) {
    h.request("GET", EXACT, &[("x-user-id", "ann")]);
    match e.on_request(h) {
        Verdict::Reply(r) | Verdict::Hold(r, _) => (r.status == 200, false),
        Verdict::Ask(asking) => {
            let calls = h.take_calls();
            assert_eq!(calls.len(), 1);
            let (status, tag, body) = answer(store, h.now(), SECRET, &calls[0]);
            (e.on_ask_response(h, asking, status, tag.as_deref(), &body).into_reply().status == 200, true)
        }
        Verdict::Wait(w) => panic!("unexpected wait until {}", w.until),
    }
}

#[test]
fn units_an_ask_took_at_the_store_are_counted_allowed_in_the_top_section() {
    // They travel in no delta (the store counted them as it answered the ask), yet the rule
    // admitted them: `/v1/top` and the dashboard count them.
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    let mut s = store();
    assert_eq!(exact_request(&e, &h, &mut s), (true, true));
    let mut allowed = 0;
    for _ in 0..3 {
        h.advance(200 * MS);
        e.on_tick(&h);
        for c in h.take_calls() {
            if let Ok((_, Some(top))) = SyncRequest::decode_with_top(&c.body) {
                let names: Vec<&str> = top.rules.iter().map(|r| r.rule.as_str()).collect();
                assert_eq!(names, ["user", "strict", "exact"], "every rule, in the document's order");
                allowed += top.rules.iter().filter(|r| r.rule == "exact").map(|r| r.allowed).sum::<u64>();
            }
            let (status, tag, body) = answer(&mut s, h.now(), SECRET, &c);
            e.on_sync_response(&h, c.token, status, tag.as_deref(), &body);
        }
    }
    assert_eq!(allowed, 1);
}

#[test]
fn an_exact_rules_first_request_on_each_node_asks_rather_than_spend_a_share_the_store_never_granted() {
    // Three nodes, an exact limit of 2, requests on a counter none has synced: each node's
    // first asks, and the fleet admits the limit, no more. (On an initial share each node's
    // first would pass unasked: three through a limit of two.)
    let (hosts, engines) = fleet(3, &rules(2, 3));
    let mut s = store();
    let mut admitted = 0;
    for (e, h) in engines.iter().zip(&hosts) {
        let (passed, asked) = exact_request(e, h, &mut s);
        assert!(asked, "the first request of an exact rule did not ask");
        admitted += u32::from(passed);
    }
    for _ in 0..3 {
        for (e, h) in engines.iter().zip(&hosts) {
            admitted += u32::from(exact_request(e, h, &mut s).0);
        }
    }
    assert_eq!(admitted, 2);
}

#[test]
fn a_rule_that_is_not_exact_never_asks_and_an_exact_one_still_does() {
    let h = FakeHost::new();
    let (e, _s) = spent_grant(&h);
    let asks = h.metric("ratewall_sync_asks");
    let _ = burst_until_denied(&e, &h);
    assert_eq!(h.metric("ratewall_sync_asks"), asks);
    assert!(burst_until_ask(&e, &h).is_some(), "the exact rule asks");
}

/// A node of two on one rule of `limit` (the rule's limit object, as JSON) keyed by user, its
/// store, and ann's counter key and limit: for the degraded-share tests.
fn share_node(limit: &str) -> (FakeHost, Engine, Store, Vec<u8>, ratewall_core::Limit) {
    let doc = format!(
        r#"{{"identity": {{"user": {{"header": "x-user-id"}}}},
  "rules": [{{"name": "user", "key": ["user"], {limit}}}],
  "sync": {{"cluster": "store", "secret": "{SECRET}", "interval": "100ms", "timeout": "50ms", "stale_after": "1s", "nodes": 2}}}}"#
    );
    let h = FakeHost::new();
    let e = engine(&h, &doc);
    let key = key_of(&e, "/", "ann");
    let limit = e.config().rules[0].limit;
    (h, e, store(), key, limit)
}

#[test]
fn without_the_store_a_node_keeps_to_its_measured_share_window_after_window() {
    let (h, e, mut s, key, limit) =
        share_node(r#""algorithm": "fixed_window", "limit": {"requests": 100, "per": "10s"}"#);
    let ann = [("x-user-id", "ann")];
    while !h.now().is_multiple_of(10_000 * MS) {
        h.advance(100 * MS);
    }
    // Healthy: this node admits 3 of every 10 units the counter spends, another node 7.
    for seq in 1..=8 {
        let r: Vec<_> = (0..3).map(|_| reply(&e, &h, "GET", "/", &ann)).collect();
        assert!(r.iter().all(|r| r.status == 200), "{seq}: {:?}", r.last());
        let deltas = vec![Delta { key: key.clone(), limit, units: 7 }];
        s.handle(h.now(), &SyncRequest { node: 999, seq, sent: h.now(), deltas, ask: false }).unwrap();
        e.on_tick(&h);
        serve(&mut s, &e, &h);
        h.advance(100 * MS);
    }
    // The store goes away; degraded, window after window, the node admits its share of 30 %
    // (with its margin), not half of the limit.
    h.refuse_calls.set(true);
    for window in 0..2 {
        while !h.now().is_multiple_of(10_000 * MS) {
            h.advance(100 * MS);
            e.on_tick(&h);
            let _ = fail(&e, &h);
        }
        let admitted = statuses(&e, &h, "GET", "/", &ann, 60).iter().filter(|s| **s == 200).count();
        assert!((30..=33).contains(&admitted), "window {window}: {admitted}");
        h.advance(100 * MS);
    }
    assert!(h.metric("ratewall_sync_degraded_requests") >= 120);
}

#[test]
fn without_the_store_a_node_keeps_a_token_bucket_to_its_measured_share() {
    // A bucket of 20 refilled at 10 a second (its quota, 100 per 10 s, above its burst),
    // spent at its rate by two nodes: this one 3 of every 10 units, another 7. Then the store
    // goes away: this node admits its share of the bucket and of the rate, with its margin.
    // (Measured against the quota rather than the burst, its share read as nearly all of the
    // counter's traffic, and three gateways each admitted the whole rate in an outage; read
    // off the node's own bucket, whose tokens come back at the whole rate, it read low: 11
    // admitted here.)
    let (h, e, mut s, key, limit) = share_node(r#""limit": {"requests": 100, "per": "10s", "burst": 20}"#);
    let ann = [("x-user-id", "ann")];
    let mut admitted = 0;
    // The bucket drained first, then 5 s at its rate (one unit every 100 ms).
    for seq in 1..=60u64 {
        let want: usize = if seq <= 2 { 10 } else { 1 };
        let mine = if seq <= 2 { 3 } else { usize::from(seq % 10 < 3) };
        admitted += statuses(&e, &h, "GET", "/", &ann, mine).iter().filter(|s| **s == 200).count();
        let deltas = vec![Delta { key: key.clone(), limit, units: (want - mine) as u64 }];
        s.handle(h.now(), &SyncRequest { node: 999, seq, sent: h.now(), deltas, ask: false }).unwrap();
        e.on_tick(&h);
        serve(&mut s, &e, &h);
        h.advance(100 * MS);
    }
    assert!(admitted > 15, "healthy: {admitted}");
    h.refuse_calls.set(true);
    for _ in 0..15 {
        h.advance(100 * MS);
        e.on_tick(&h);
        let _ = fail(&e, &h);
    }
    // 10 s degraded, a request every 10 ms: about 30 % of 10 units a second and of the
    // bucket.
    let mut degraded = 0;
    for _ in 0..1000 {
        degraded += statuses(&e, &h, "GET", "/", &ann, 1).iter().filter(|s| **s == 200).count();
        h.advance(10 * MS);
        if h.now().is_multiple_of(100 * MS) {
            e.on_tick(&h);
            let _ = fail(&e, &h);
        }
    }
    assert!((20..=3 * 10 * 21 / 20 + 7).contains(&degraded), "degraded: {degraded} in 10 s");
}

#[test]
fn a_node_that_heard_a_counter_is_out_of_quota_denies_its_first_request_on_it() {
    // Two nodes, a limit of 2: the first spends ann's quota and reports it; the second's
    // heartbeat answer names ann's counter out, so its first request on it is denied rather
    // than admitted on an initial share (or, late in a fixed window, an overdraft) of quota
    // the counter no longer has.
    let (hosts, engines) = fleet(2, &rules(2, 2));
    let (a, ha, b, hb) = (&engines[0], &hosts[0], &engines[1], &hosts[1]);
    let mut s = store();
    let ann = [("x-user-id", "ann")];
    for (e, h) in engines.iter().zip(&hosts) {
        e.on_tick(h);
        serve(&mut s, e, h);
    }
    for _ in 0..5 {
        let _ = reply(a, ha, "GET", NO_WAIT, &ann);
        for h in &hosts {
            h.advance(100 * MS);
        }
        a.on_tick(ha);
        serve(&mut s, a, ha);
    }
    assert!(counted(&s, a, NO_WAIT, "ann", ha.now()) >= 2);
    hb.advance(400 * MS);
    b.on_tick(hb);
    assert!(serve(&mut s, b, hb) > 0, "a heartbeat");
    assert_eq!(reply(b, hb, "GET", NO_WAIT, &ann).status, 429);
    // Another client of the rule is not out: the node admits it on its initial share.
    assert_eq!(reply(b, hb, "GET", NO_WAIT, &[("x-user-id", "bob")]).status, 200);
}

#[test]
fn a_clock_that_steps_back_an_hour_keeps_ticking_and_syncing_and_is_not_fresh_on_old_answers() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(100, 1));
    let mut st = store();
    let user = [("x-user-id", "back")];
    statuses(&e, &h, "GET", NO_WAIT, &user, 3);
    for _ in 0..5 {
        h.advance(100 * MS);
        e.on_tick(&h);
        serve(&mut st, &e, &h);
    }
    assert!(e.tick_due(h.now()));
    h.now.set(h.now() - 3_600_000 * MS);
    assert!(e.tick_due(h.now()), "a tick is due now, not in an hour");
    // The store stops answering: the node's last answer is an hour ahead of its clock, and
    // must not keep it fresh for that hour.
    let before = h.metric("ratewall_sync_degraded_requests");
    let mut calls = 0;
    for _ in 0..5 {
        h.advance(100 * MS);
        e.on_tick(&h);
        calls += fail(&e, &h);
    }
    assert!(calls >= 1, "batches go on after the step back");
    statuses(&e, &h, "GET", NO_WAIT, &user, 1);
    assert_eq!(
        h.metric("ratewall_sync_degraded_requests"),
        before + 1,
        "degraded, not fresh on an answer from the future"
    );
    // The store answers again: fresh again at once.
    for _ in 0..10 {
        h.advance(100 * MS);
        e.on_tick(&h);
        serve(&mut st, &e, &h);
    }
    statuses(&e, &h, "GET", NO_WAIT, &user, 1);
    assert_eq!(h.metric("ratewall_sync_degraded_requests"), before + 1);
    assert!(counted(&st, &e, NO_WAIT, "back", h.now()) >= 3, "the units admitted before the step were counted");
}

#[test]
fn documents_syncing_to_two_stores_on_one_proxy_sync_each_to_its_own() {
    // As two NGINX proxy_wasm directives: one shared data, two stores.
    let a = FakeHost::new();
    let b = FakeHost::joining(a.shared.clone());
    let other = rules(100, 1).replace(r#""cluster": "store""#, r#""cluster": "other-store""#);
    let (ea, eb) = (engine(&a, &rules(100, 1)), engine(&b, &other));
    let _ = reply(&ea, &a, "GET", "/u/x", &[("x-user-id", "ann")]);
    let _ = reply(&eb, &b, "GET", "/u/x", &[("x-user-id", "bob")]);
    ea.on_tick(&a);
    eb.on_tick(&b);
    let (ca, cb) = (a.take_calls(), b.take_calls());
    assert_eq!((ca.len(), cb.len()), (1, 1), "each document's VM syncs to its own store");
    assert_eq!(ca[0].upstream, "store");
    assert_eq!(cb[0].upstream, "other-store");
    assert_eq!(batch(&ca[0]).deltas.len(), 1, "ann's units only");
    assert_eq!(batch(&cb[0]).deltas.len(), 1, "bob's units only");
    assert_ne!(batch(&ca[0]).deltas[0].key, batch(&cb[0]).deltas[0].key);
}

#[test]
fn a_denied_key_of_an_exact_rule_shows_the_units_its_asks_took_as_allowed() {
    let h = FakeHost::new();
    let e = engine(&h, &rules(2, 1));
    let mut s = store();
    let outcomes: Vec<(bool, bool)> = (0..3).map(|_| exact_request(&e, &h, &mut s)).collect();
    assert_eq!(outcomes.iter().map(|o| o.0).collect::<Vec<_>>(), [true, true, false], "{outcomes:?}");
    let mut entries = Vec::new();
    for _ in 0..3 {
        h.advance(200 * MS);
        e.on_tick(&h);
        for c in h.take_calls() {
            if let Ok((_, Some(top))) = SyncRequest::decode_with_top(&c.body) {
                for r in top.rules.iter().filter(|r| r.rule == "exact") {
                    entries.extend(r.top.entries().iter().map(|x| (x.denied, x.allowed)));
                }
            }
            let (status, tag, body) = answer(&mut s, h.now(), SECRET, &c);
            e.on_sync_response(&h, c.token, status, tag.as_deref(), &body);
        }
    }
    assert_eq!(entries, [(1, 2)], "ann: denied once, admitted twice through asks");
}

#[test]
fn a_burst_after_a_pause_longer_than_the_lease_gets_the_limits_rest_not_short_denials() {
    // 3 a minute (a sliding window), one node: one request, synced; a pause; then three at
    // once before the next answer. Whether the grant was renewed through the pause (up to
    // 5-6 s after the request) or lapsed (10 s, 30 s), the node answers as its limiter alone
    // does: 200, 200, then the limit's own 429.
    let ann = [("x-user-id", "ann")];
    let alone = r#"{"identity": {"user": {"header": "x-user-id"}},
  "rules": [{"name": "user", "match": {"path": "/u/*"}, "key": ["user"], "limit": {"requests": 3, "per": "60s"}}]}"#;
    for pause in [1_500, 5_000, 10_000, 30_000] {
        let h = FakeHost::new();
        let e = engine(&h, &rules(3, 1));
        let mut s = store();
        assert_eq!(statuses(&e, &h, "GET", NO_WAIT, &ann, 1), [200]);
        for _ in 0..pause / 100 {
            h.advance(100 * MS);
            e.on_tick(&h);
            for c in h.take_calls() {
                let (status, tag, body) = answer(&mut s, h.now(), SECRET, &c);
                assert_eq!(SyncResponse::decode(&body).unwrap().nodes, 1, "the store knows this node only");
                e.on_sync_response(&h, c.token, status, tag.as_deref(), &body);
            }
        }
        let held = e.table().grant(&h, &key_of(&e, NO_WAIT, "ann")).expect("an answer");
        assert_eq!(held.units_at(h.now()) == 0, pause >= 10_000, "{pause}: {held:?}");
        let burst: Vec<Reply> = (0..3).map(|_| reply(&e, &h, "GET", NO_WAIT, &ann)).collect();
        let got: Vec<u16> = burst.iter().map(|r| r.status).collect();
        assert_eq!(got, [200, 200, 429], "{pause}: {held:?}");
        let retry = burst[2].headers.iter().find(|(n, _)| *n == "Retry-After").map(|(_, v)| v.as_str());
        assert!(retry.and_then(|v| v.parse::<u64>().ok()).is_some_and(|s| s > 1), "the limit's denial: {retry:?}");
        assert!(h.take_calls().is_empty(), "no call on the request path");
        // As the node's limiter alone decides.
        let local = FakeHost::new();
        let le = engine(&local, alone);
        assert_eq!(statuses(&le, &local, "GET", NO_WAIT, &ann, 1), [200]);
        local.advance(pause * MS);
        assert_eq!(statuses(&le, &local, "GET", NO_WAIT, &ann, 3), got);
        // The next answer counts them, and the limit holds.
        h.advance(100 * MS);
        e.on_tick(&h);
        serve(&mut s, &e, &h);
        assert_eq!(counted(&s, &e, NO_WAIT, "ann", h.now()), 3);
        assert_eq!(statuses(&e, &h, "GET", NO_WAIT, &ann, 2), [429, 429]);
    }
}

/// A fixed window's units that the next batch would report only after their window ended
/// are not reported: the store would count them in the next window.
#[test]
fn a_fixed_windows_units_are_reported_only_while_their_window_lasts() {
    let doc = rules(100, 1).replacen(
        r#""limit": {"requests": 100, "per": "60s"}"#,
        r#""algorithm": "fixed_window", "limit": {"requests": 100, "per": "1s"}"#,
        1,
    );
    assert!(doc.contains("fixed_window"));
    let h = FakeHost::new();
    let e = engine(&h, &doc);
    let mut s = store();
    // A request at the window's start, reported; two in its last 50 ms, whose batch goes
    // after its end.
    assert_eq!(statuses(&e, &h, "GET", NO_WAIT, &[("x-user-id", "ann")], 1), [200]);
    h.advance(100 * MS);
    e.on_tick(&h);
    serve(&mut s, &e, &h);
    h.advance(850 * MS);
    assert_eq!(statuses(&e, &h, "GET", NO_WAIT, &[("x-user-id", "ann")], 2), [200; 2]);
    h.advance(100 * MS);
    e.on_tick(&h);
    let calls = h.take_calls();
    let units: Vec<u64> = batch(&calls[0]).deltas.iter().map(|d| d.units).collect();
    assert_eq!(units, [0], "a renewal, without the ended window's units");
    for c in &calls {
        let (status, tag, body) = answer(&mut s, h.now(), SECRET, c);
        e.on_sync_response(&h, c.token, status, tag.as_deref(), &body);
    }
    // The new window's requests are reported, and the store counts only them.
    assert_eq!(statuses(&e, &h, "GET", NO_WAIT, &[("x-user-id", "ann")], 2), [200; 2]);
    for _ in 0..2 {
        h.advance(100 * MS);
        e.on_tick(&h);
        serve(&mut s, &e, &h);
    }
    assert_eq!(counted(&s, &e, NO_WAIT, "ann", h.now()), 2);
}

/// The outboxes of VMs of an earlier version (without windows) are drained too.
#[test]
fn units_in_an_outbox_of_an_earlier_version_are_reported() {
    let a = FakeHost::new();
    let b = FakeHost::joining(a.shared.clone());
    let (ea, eb) = (engine(&a, &rules(100, 1)), engine(&b, &rules(100, 1)));
    let mut s = store();
    assert_eq!(statuses(&eb, &b, "GET", NO_WAIT, &[("x-user-id", "ann")], 1), [200]);
    eb.on_tick(&b);
    serve(&mut s, &eb, &b);
    let outbox = a.shared_keys().into_iter().find(|k| k.contains("/outw/")).unwrap();
    let plain = outbox.replace("/outw/", "/out/");
    let limit =
        ratewall_core::Limit::new(ratewall_core::Algorithm::SlidingWindow, 100, 60 * ratewall_core::SECOND, None)
            .unwrap();
    let old = SyncRequest::encode_parts(0, 0, 0, &[Delta { key: key_of(&ea, NO_WAIT, "ann"), limit, units: 4 }], false);
    a.shared_set(&plain, &old, None).unwrap();
    a.advance(200 * MS);
    b.advance(200 * MS);
    eb.on_tick(&b);
    serve(&mut s, &eb, &b);
    assert_eq!(counted(&s, &ea, NO_WAIT, "ann", a.now()), 5, "the request and the old outbox's four");
    assert!(a.shared_value(&plain).is_some_and(|v| v.is_empty()), "drained");
}

/// A counter the store named out of quota is denied until the store has a unit again (here
/// the fixed window's end), not for a spent grant's second: a client that waits its
/// `Retry-After` is admitted.
/// Another node (99) reports `units` on ann's counter of the fixed window of 10 a minute
/// ([`fixed_rules`]).
fn another_node_spends(s: &mut Store, e: &Engine, h: &FakeHost, units: u64) {
    let limit =
        ratewall_core::Limit::new(ratewall_core::Algorithm::FixedWindow, 10, 60 * ratewall_core::SECOND, None).unwrap();
    let other = SyncRequest {
        node: 99,
        seq: 1,
        sent: h.now(),
        deltas: vec![Delta { key: key_of(e, NO_WAIT, "ann"), limit, units }],
        ask: false,
    };
    s.handle(h.now(), &other).unwrap();
}

#[test]
fn a_counter_named_out_is_denied_until_its_window_ends() {
    let doc = fixed_rules(10, 2);
    let h = FakeHost::new();
    let e = engine(&h, &doc);
    let mut s = store();
    let ann = [("x-user-id", "ann")];
    assert_eq!(statuses(&e, &h, "GET", NO_WAIT, &ann, 1), [200]);
    h.advance(100 * MS);
    e.on_tick(&h);
    serve(&mut s, &e, &h);
    // Another node spends the rest of the window's quota.
    another_node_spends(&mut s, &e, &h, 9);
    // Within a few intervals the node's answers say so (each VM reads the counters named out
    // on its tick), and its denials wait for the window's end.
    let mut denied = None;
    for _ in 0..20 {
        h.advance(100 * MS);
        e.on_tick(&h);
        serve(&mut s, &e, &h);
        let r = reply(&e, &h, "GET", NO_WAIT, &ann);
        if r.status == 429 && super::engine::header(&r, "retry-after") != Some("1") {
            denied = Some(r);
            break;
        }
    }
    let r = denied.expect("a denial with the window's Retry-After");
    let retry: u64 = super::engine::header(&r, "retry-after").unwrap().parse().unwrap();
    let window_left =
        (60 * ratewall_core::SECOND - h.now() % (60 * ratewall_core::SECOND)).div_ceil(ratewall_core::SECOND);
    assert_eq!(retry, window_left, "the window's rest, not a second");
    // Waiting exactly that long is enough.
    for _ in 0..retry * 10 {
        h.advance(100 * MS);
        e.on_tick(&h);
        serve(&mut s, &e, &h);
    }
    assert_eq!(statuses(&e, &h, "GET", NO_WAIT, &ann, 1), [200]);
}

/// Answers every call the host dispatched from `store` over a round trip of `rtt`: the store
/// reads its clock half way, the answers arrive at the end.
fn serve_over(store: &mut Store, e: &Engine, h: &FakeHost, rtt: Nanos) {
    let calls = h.take_calls();
    h.advance(rtt / 2);
    let answers: Vec<_> = calls.iter().map(|c| (c.token, answer(store, h.now(), SECRET, c))).collect();
    h.advance(rtt - rtt / 2);
    for (token, (status, tag, body)) in answers {
        e.on_sync_response(h, token, status, tag.as_deref(), &body);
    }
}

#[test]
fn a_fixed_window_turns_for_the_node_when_it_turns_at_the_store() {
    let doc = fixed_rules(10, 2);
    let (window, rtt) = (60 * ratewall_core::SECOND, 40 * MS);
    let h = FakeHost::new();
    // Two seconds before a window's end, a store 40 ms away.
    h.advance(window - h.now() % window - 2 * ratewall_core::SECOND);
    let e = engine(&h, &doc);
    let mut s = store();
    let ann = [("x-user-id", "ann")];
    assert_eq!(statuses(&e, &h, "GET", NO_WAIT, &ann, 1), [200]);
    e.on_tick(&h);
    serve_over(&mut s, &e, &h, rtt);
    // Another node spends the rest of the window's quota; the node's answers say so.
    another_node_spends(&mut s, &e, &h, 9);
    while h.now() % window < window - 200 * MS {
        h.advance(100 * MS - rtt);
        e.on_tick(&h);
        serve_over(&mut s, &e, &h, rtt);
    }
    assert_eq!(statuses(&e, &h, "GET", NO_WAIT, &ann, 1), [429], "the window is spent");
    // 10 ms into the next window (at the store's clock as at the node's) the counter has its
    // quota back: the node's view of the store's clock is not half a round trip behind.
    h.advance(window - h.now() % window + 10 * MS);
    let r = reply(&e, &h, "GET", NO_WAIT, &ann);
    assert_eq!(r.status, 200, "{:?}", r.headers);
}

/// The fixed-window rules of [`rules`] (the rule of [`NO_WAIT`] counts fixed windows).
fn fixed_rules(limit: u64, nodes: u32) -> String {
    rules(limit, nodes).replacen(
        &format!(r#""limit": {{"requests": {limit}, "per": "60s"}}"#),
        &format!(r#""algorithm": "fixed_window", "limit": {{"requests": {limit}, "per": "60s"}}"#),
        1,
    )
}

#[test]
fn a_request_admitted_past_its_grant_sends_the_next_batch_at_once() {
    let h = FakeHost::new();
    // Half a minute into a window: a counter new to the node is past the window's first
    // quarter, so its first request is admitted on an overdraft (no initial share).
    h.advance(60 * ratewall_core::SECOND - h.now() % (60 * ratewall_core::SECOND) + 30 * ratewall_core::SECOND);
    let e = engine(&h, &fixed_rules(100_000, 1));
    let mut s = store();
    let ann = [("x-user-id", "ann")];
    // Far from the limit, ann's deltas go every other interval.
    for _ in 0..12 {
        assert_eq!(statuses(&e, &h, "GET", NO_WAIT, &ann, 1), [200]);
        e.on_tick(&h);
        serve(&mut s, &e, &h);
        h.advance(100 * MS);
    }
    let mut sent = false;
    for _ in 0..3 {
        let _ = reply(&e, &h, "GET", NO_WAIT, &ann);
        e.on_tick(&h);
        sent = serve(&mut s, &e, &h) == 1;
        h.advance(100 * MS);
        if sent {
            break;
        }
    }
    assert!(sent, "a batch every other interval");
    let _ = reply(&e, &h, "GET", NO_WAIT, &ann);
    e.on_tick(&h);
    assert!(h.take_calls().is_empty(), "the interval after a batch, ann's units wait");
    h.advance(100 * MS);
    let _ = reply(&e, &h, "GET", NO_WAIT, &ann);
    e.on_tick(&h);
    assert_eq!(serve(&mut s, &e, &h), 1);
    // Bob's first request is admitted past any grant: the next tick sends it.
    assert_eq!(statuses(&e, &h, "GET", NO_WAIT, &[("x-user-id", "bob")], 1), [200]);
    h.advance(100 * MS);
    e.on_tick(&h);
    let calls = h.take_calls();
    assert_eq!(calls.len(), 1, "a batch at once");
    assert!(batch(&calls[0]).deltas.iter().any(|d| d.key == key_of(&e, NO_WAIT, "bob") && d.units == 1));
}

#[test]
fn a_vm_that_admits_past_its_grant_hands_the_unit_over_at_once() {
    let a = FakeHost::new();
    a.advance(60 * ratewall_core::SECOND - a.now() % (60 * ratewall_core::SECOND) + 30 * ratewall_core::SECOND);
    let b = FakeHost::joining(a.shared.clone());
    b.advance(a.now() - b.now());
    let (ea, eb) = (engine(&a, &fixed_rules(100, 1)), engine(&b, &fixed_rules(100, 1)));
    let mut s = store();
    ea.on_tick(&a); // a holds the lease
    serve(&mut s, &ea, &a);
    // b admits bob's first request on its overdraft and does not tick: a's next batch
    // carries the unit all the same.
    assert_eq!(statuses(&eb, &b, "GET", NO_WAIT, &[("x-user-id", "bob")], 1), [200]);
    a.advance(100 * MS);
    ea.on_tick(&a);
    serve(&mut s, &ea, &a);
    assert_eq!(counted(&s, &ea, NO_WAIT, "bob", a.now()), 1);
}

#[test]
fn a_unit_admitted_at_a_windows_end_is_not_counted_in_the_next_window_by_a_clock_read_early() {
    let (window, rtt) = (60 * ratewall_core::SECOND, 40 * MS);
    let h = FakeHost::new();
    h.advance(window - h.now() % window - 2 * ratewall_core::SECOND);
    let e = engine(&h, &fixed_rules(1_000, 1));
    let mut s = store();
    let ann = [("x-user-id", "ann")];
    // The way to the store takes 28 ms and the way back 12: the node's view of the store's
    // clock is 8 ms ahead of it.
    let serve_slow_out = |s: &mut Store| {
        let calls = h.take_calls();
        h.advance(28 * MS);
        let answers: Vec<_> = calls.iter().map(|c| (c.token, answer(s, h.now(), SECRET, c))).collect();
        h.advance(rtt - 28 * MS);
        for (token, (status, tag, body)) in answers {
            e.on_sync_response(&h, token, status, tag.as_deref(), &body);
        }
    };
    while h.now() % window < window - 150 * MS {
        assert_eq!(statuses(&e, &h, "GET", NO_WAIT, &ann, 1), [200]);
        e.on_tick(&h);
        serve_slow_out(&mut s);
        h.advance(100 * MS - rtt);
    }
    // 5 ms before the window's end at the store, 3 ms after it at the node.
    h.advance(window - h.now() % window - 5 * MS);
    assert_eq!(statuses(&e, &h, "GET", NO_WAIT, &ann, 1), [200]);
    h.advance(20 * MS);
    e.on_tick(&h);
    serve_slow_out(&mut s);
    assert_eq!(counted(&s, &e, NO_WAIT, "ann", h.now()), 0, "the last window's unit takes nothing from this one");
}

/// A proxy of two workers (two VMs sharing data) beside another proxy, one client whose burst
/// spends a sliding window or log of 2 per 10 s, at several points of the window: the third
/// request is denied by the proxy's own count, before the store has counted the second, and
/// a client that waits exactly the `Retry-After` it is told is admitted. (On a real NGINX of
/// two workers it was refused with `Retry-After: 1`: that denial's wait was the proxy's own,
/// without the lag of an answer, and a sliding log's store frees its units up to a slot later
/// than the proxy's count.)
#[test]
fn a_client_that_waits_its_retry_after_on_a_proxy_of_two_workers_is_admitted() {
    for algorithm in ["sliding_window", "sliding_log"] {
        for offset in [0u64, 1_200, 3_300, 5_100, 6_600, 8_700, 9_900] {
            let doc = rules(2, 2).replacen(
                r#""limit": {"requests": 2, "per": "60s"}}"#,
                &format!(r#""algorithm": "{algorithm}", "limit": {{"requests": 2, "per": "10s"}}}}"#),
                1,
            );
            let (h, other) = (FakeHost::new(), FakeHost::new());
            let both = |ns: u64| {
                h.advance(ns);
                other.advance(ns);
            };
            both(offset * MS);
            let vms = [engine(&h, &doc), engine(&h, &doc)];
            let e2 = engine(&other, &doc);
            let mut s = store();
            let tick = |s: &mut Store| {
                both(100 * MS);
                for e in &vms {
                    e.on_tick(&h);
                    serve(s, e, &h);
                }
                e2.on_tick(&other);
                serve(s, &e2, &other);
            };
            let send = |i: usize| {
                h.request("GET", NO_WAIT, &[("x-user-id", "ann")]);
                vms[i % 2].on_request(&h).into_reply()
            };
            // Two requests 50 ms apart between the proxy's ticks.
            let mut i = 0;
            let wait = loop {
                let r = send(i);
                i += 1;
                both(50 * MS);
                if i % 2 == 0 {
                    tick(&mut s);
                }
                if let Some(wait) = real_wait(&r) {
                    break wait;
                }
                assert!(i < 40, "{algorithm} at {offset} ms: never told the real wait");
            };
            let until = h.now() + wait * ratewall_core::SECOND;
            while h.now() + 200 * MS <= until {
                tick(&mut s);
            }
            both(until - h.now());
            let r = send(i);
            assert_eq!(r.status, 200, "{algorithm} at {offset} ms: admitted after waiting {wait} s: {:?}", r.headers);
        }
    }
}

/// Many clients refused at once on small exact limits, more than a store's answer names out:
/// each refusal says the wait the store gave its own ask, and each client that waits it is
/// admitted. (A VM's list of counters named out was full of other clients' and the newest
/// refusals were left out of it: their requests said a spent grant's `Retry-After: 1` and
/// were refused again after waiting it.)
#[test]
fn more_refused_clients_than_an_answer_names_each_say_their_own_wait() {
    for (algorithm, limit, per, burst) in [("token_bucket", 1, "2s", ", \"burst\": 3"), ("sliding_window", 3, "5s", "")]
    {
        let doc = small_exact(algorithm, limit, per, burst);
        let (hosts, engines) = fleet(2, &doc);
        let mut s = store();
        let send = |s: &mut Store, i: usize, user: &str| asked_at_once(s, &hosts[i], &engines[i], user);
        let clients = 2 * ratewall_core::sync::MAX_OUT + 8;
        let users: Vec<String> = (0..clients).map(|u| format!("user-{u}")).collect();
        // Each client's four requests over both proxies, the clients one after another within
        // one interval: three admitted, the fourth refused.
        let mut waits = Vec::new();
        for user in &users {
            let statuses: Vec<ratewall_core::Reply> = (0..4).map(|n| send(&mut s, n % 2, user)).collect();
            let refused = &statuses[3];
            assert_eq!(refused.status, 429, "{algorithm} {user}: {:?}", refused.headers);
            let wait: u64 = super::engine::header(refused, "retry-after").unwrap().parse().unwrap();
            waits.push(wait);
        }
        let first = waits[0];
        assert!(first > 1, "{algorithm}: {waits:?}");
        assert!(waits.iter().all(|w| *w == first), "{algorithm}: every client's wait is the store's: {waits:?}");
        sync_until(&hosts, &engines, &mut s, hosts[0].now() + first * ratewall_core::SECOND);
        for (u, user) in users.iter().enumerate() {
            let r = send(&mut s, u % 2, user);
            assert_eq!(r.status, 200, "{algorithm} {user} waited {first} s: {:?}", r.headers);
        }
    }
}

/// Exact limits of a few units, a client's requests over two proxies in turn: each is decided
/// at the global count (three admitted, then refused), and a refused client that waits exactly
/// its `Retry-After` is admitted, whichever proxy refused it.
#[test]
fn a_small_exact_limits_refusal_on_either_proxy_says_the_wait_a_client_is_then_admitted_after() {
    for (algorithm, limit, per, burst) in [
        ("token_bucket", 1, "2s", ", \"burst\": 3"),
        ("sliding_window", 3, "5s", ""),
        ("fixed_window", 3, "5s", ""),
        ("sliding_log", 3, "5s", ""),
    ] {
        let doc = small_exact(algorithm, limit, per, burst);
        for order in [[0, 1, 0, 1, 0, 1], [0, 1, 0, 0, 1, 1]] {
            let (hosts, engines) = fleet(2, &doc);
            let mut s = store();
            let send = |s: &mut Store, i: usize| asked_at_once(s, &hosts[i], &engines[i], "ann");
            let mut statuses = Vec::new();
            let mut refused = None;
            for &i in &order {
                let r = send(&mut s, i);
                statuses.push(r.status);
                if r.status == 429 && refused.is_none() {
                    let wait: u64 = super::engine::header(&r, "retry-after").unwrap().parse().unwrap();
                    refused = Some((i, wait));
                }
                for (h, e) in hosts.iter().zip(&engines) {
                    h.advance(10 * MS);
                    e.on_tick(h);
                    serve(&mut s, e, h);
                }
            }
            assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 3, "{algorithm} {order:?}: {statuses:?}");
            let (i, wait) = refused.unwrap();
            sync_until(&hosts, &engines, &mut s, hosts[0].now() + wait * ratewall_core::SECOND);
            let r = send(&mut s, i);
            assert_eq!(
                r.status, 200,
                "{algorithm} {order:?}: {statuses:?}, waited {wait} s on node {i}: {:?}",
                r.headers
            );
        }
    }
}

/// Two proxies on one client far past a token bucket (60 a minute, burst 20), one with two
/// thirds of the traffic, then the store goes away: in the outage the pair admits about the
/// bucket's rate between them, each on its share of it. (Shares read off the proxies' own
/// buckets, whose tokens come back at the whole rate, read a few hundredths each at the
/// limit: 4 a minute between them; or, after a burst, nearly all: each the whole rate.)
#[test]
fn two_proxies_past_a_token_bucket_admit_its_rate_between_them_while_the_store_is_away() {
    let doc = rules(10, 2).replacen(
        r#""limit": {"requests": 10, "per": "60s"}"#,
        r#""limit": {"requests": 60, "per": "60s", "burst": 20}"#,
        1,
    );
    assert!(doc.contains(r#""burst": 20"#));
    let (hosts, engines) = fleet(2, &doc);
    let mut s = store();
    let ann = [("x-user-id", "ann")];
    // 10 requests a second for 90 s (each proxy's tick and answer every 100 ms), 2 of 3 on
    // the first proxy; then 60 s more with every call failing.
    let mut admitted = [0u64; 2];
    for step in 0..1_500u64 {
        let store_up = step < 900;
        for (h, e) in hosts.iter().zip(&engines) {
            h.advance(100 * MS);
            e.on_tick(h);
            if store_up {
                serve(&mut s, e, h);
            } else {
                fail(e, h);
            }
        }
        let i = usize::from(step % 3 == 2);
        let ok = reply(&engines[i], &hosts[i], "GET", NO_WAIT, &ann).status == 200;
        if !store_up {
            admitted[i] += u64::from(ok);
        }
    }
    let outage: u64 = admitted.iter().sum();
    // 60 s at 1 a second, each share with its margin of 1/20th, from a bucket as nearly empty
    // as the store's was (each proxy's own state was about full: 81 admitted then).
    assert!(outage >= 50, "{admitted:?} admitted in 60 s of outage, against 60 a minute");
    assert!(outage <= 60 * 21 / 20 + 3, "{admitted:?} admitted in 60 s of outage, against 60 a minute");
    assert!(admitted[0] > admitted[1], "{admitted:?}: the first proxy had two thirds of the traffic");
}

#[test]
fn a_buckets_share_is_what_the_node_reported_of_what_the_fleet_took() {
    use crate::sync::bucket_share;
    use crate::table::Flow;
    use ratewall_core::SECOND;
    let limit = ratewall_core::Limit::new(ratewall_core::Algorithm::TokenBucket, 60, 60 * SECOND, Some(20)).unwrap();
    let t0: Nanos = 1_700_000_000 * SECOND;
    // A bucket kept 19 units short of full: the fleet takes its refill, one unit a second;
    // the node reports one of every three.
    let (mut flow, mut share) = bucket_share(limit, Flow::default(), (t0, 19 * SECOND, 0), 0);
    assert_eq!((flow.own, flow.all, share), (0, 0, 0), "the first answer only marks the bucket");
    for s in 1..=24u64 {
        (flow, share) = bucket_share(limit, flow, (t0 + s * SECOND, 19 * SECOND, u64::from(s % 3 == 0)), share);
    }
    // Measured over 8 s each time (8 units taken): 2, 3 and 3 of them the node's.
    assert!((18_000..21_000).contains(&share), "{share} of 65,535: about a third");
    // However far the fleet overdrew the bucket (none left, 35 units short), what it took counts.
    let (f, _) = bucket_share(limit, flow, (t0 + 25 * SECOND, 35 * SECOND, 16), share);
    assert_eq!(f.all / Flow::ONE, 17);
    // A clock that went back, or a gap past the bucket's time to fill, starts over.
    for at in [t0, t0 + 60 * SECOND] {
        let flow = f;
        let (f, s) = bucket_share(limit, flow, (at, 19 * SECOND, 5), share);
        assert_eq!((f.own, f.all, s), (0, 0, share));
    }
}

/// A shadow rule never holds a request for the store, so an exact one is decided as a rule
/// that is not: a client's first requests, before the store's answer, are not "would reject"
/// (every one was: an exact rule holds no grant before its first ask, and a shadow rule never
/// asks).
#[test]
fn an_exact_shadow_rule_does_not_say_would_reject_of_requests_the_store_would_admit() {
    let h = FakeHost::new();
    let doc = rules(5, 2).replace(r#""exact": true,"#, r#""exact": true, "mode": "shadow","#);
    let e = engine(&h, &doc);
    let mut s = store();
    for _ in 0..3 {
        e.on_tick(&h);
        serve(&mut s, &e, &h);
        h.advance(100 * MS);
    }
    assert_eq!(statuses(&e, &h, "GET", EXACT, &[("x-user-id", "dan")], 2), [200; 2]);
    assert_eq!(h.metric("ratewall_rule_exact_shadow_rejected"), 0);
    // Past the limit it says so, once the store has counted what the node admitted.
    for _ in 0..3 {
        e.on_tick(&h);
        serve(&mut s, &e, &h);
        h.advance(100 * MS);
    }
    assert_eq!(statuses(&e, &h, "GET", EXACT, &[("x-user-id", "dan")], 6), [200; 6]);
    let said = h.metric("ratewall_rule_exact_shadow_rejected");
    assert!((2..=4).contains(&said), "{said} of 8 would be rejected, 3 exactly");
}

/// Answers every call from `store` and adds each batch's top-section entry of `key` (its
/// allowed, denied and node bits) to `seen`.
fn serve_seeing(store: &mut Store, e: &Engine, h: &FakeHost, key: &[u8], seen: &mut (u64, u64, u64)) {
    for c in h.take_calls() {
        if let Ok((_, Some(top))) = SyncRequest::decode_with_top(&c.body) {
            for e in top.rules.iter().flat_map(|r| r.top.entries()).filter(|e| e.key == key) {
                seen.0 += e.allowed;
                seen.1 += e.denied;
                seen.2 |= e.nodes;
            }
        }
        let (status, tag, body) = answer(store, h.now(), SECRET, &c);
        e.on_sync_response(h, c.token, status, tag.as_deref(), &body);
    }
}

#[test]
fn a_node_that_admitted_a_client_another_denied_reports_what_it_admitted() {
    // Five a minute: ann's five go through one node, which denies her nothing; then she goes
    // to the other, which denies her. The key's entry counts the first node's five, and both
    // nodes (the first's units had waited for a denial of its own that never came).
    let (hosts, engines) = fleet(2, &rules(5, 2));
    let mut s = store();
    let mut seen = (0, 0, 0);
    let (mut admitted, mut denied) = (0, 0);
    for (i, n) in [(0, 5), (1, 3)] {
        let (e, h) = (&engines[i], &hosts[i]);
        for _ in 0..n {
            match reply(e, h, "GET", NO_WAIT, &[("x-user-id", "ann")]).status {
                200 => admitted += 1,
                _ => denied += 1,
            }
            for (e, h) in engines.iter().zip(&hosts) {
                h.advance(200 * MS);
                e.on_tick(h);
                serve_seeing(&mut s, e, h, b"user=ann", &mut seen);
            }
        }
    }
    for _ in 0..5 {
        for (e, h) in engines.iter().zip(&hosts) {
            h.advance(200 * MS);
            e.on_tick(h);
            serve_seeing(&mut s, e, h, b"user=ann", &mut seen);
        }
    }
    assert_eq!((admitted, denied), (5, 3));
    assert_eq!((seen.0, seen.1), (5, 3), "allowed and denied of the entry");
    assert_eq!(ratewall_core::topk::node_count(seen.2), 2, "both nodes saw her");
}

#[test]
fn units_admitted_to_a_client_after_its_denial_are_reported_without_another_denial() {
    // Five a minute, six requests (one denied), then two more a window later: the entry counts
    // all seven admitted, though no request of the later batches was denied.
    let (hosts, engines) = fleet(1, &rules(5, 1));
    let (e, h) = (&engines[0], &hosts[0]);
    let mut s = store();
    let mut seen = (0, 0, 0);
    let mut statuses = Vec::new();
    for (wait, n) in [(0, 6), (61_000 * MS, 2)] {
        h.advance(wait);
        for _ in 0..n {
            statuses.push(reply(e, h, "GET", NO_WAIT, &[("x-user-id", "ann")]).status);
            h.advance(200 * MS);
            e.on_tick(h);
            serve_seeing(&mut s, e, h, b"user=ann", &mut seen);
        }
        for _ in 0..5 {
            h.advance(200 * MS);
            e.on_tick(h);
            serve_seeing(&mut s, e, h, b"user=ann", &mut seen);
        }
    }
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 200, 200]);
    assert_eq!((seen.0, seen.1), (7, 1), "allowed and denied of the entry");
}
