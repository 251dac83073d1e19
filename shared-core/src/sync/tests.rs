//! The protocol's unit tests.

use super::*;
use crate::algo::{Algorithm, Limit, Nanos, State, SECOND};
use alloc::collections::BTreeMap;
use alloc::vec;
use alloc::vec::Vec;

fn limit() -> Limit {
    Limit::new(Algorithm::SlidingWindow, 100, 60 * SECOND, None).unwrap()
}

fn req(node: u64, seq: u64, units: u64) -> SyncRequest {
    SyncRequest { node, seq, sent: NOW, deltas: vec![Delta { key: b"k".to_vec(), limit: limit(), units }], ask: false }
}

const NOW: Nanos = 1_700_000_000 * SECOND;
const MS_: Nanos = 1_000_000;

#[test]
fn the_longest_answer_fits_its_bound() {
    let key = vec![7u8; MAX_KEY];
    let g = Grant { key: key.clone(), remaining: u64::MAX, grant: u64::MAX, reset_after: u64::MAX, lease: u64::MAX };
    let resp = SyncResponse {
        seq: u64::MAX,
        now: u64::MAX,
        nodes: u32::MAX,
        grants: vec![g.clone(), g.clone()],
        failed: vec![],
    };
    assert!(resp.encode().len() <= SyncResponse::max_len([MAX_KEY, MAX_KEY].into_iter()));
    // A failed delta's grant holds zeros: the failed section fits in what it leaves, with any
    // number of them among any number of deltas.
    for n in [1usize, 2, 130, 500] {
        for failing in [1, n / 2, n] {
            let failed: Vec<u32> = (0..failing.max(1) as u32).map(|i| i * (n as u32 / failing.max(1) as u32)).collect();
            let zero = Grant { remaining: 0, grant: 0, reset_after: 0, lease: 0, ..g.clone() };
            let grants = (0..n as u32).map(|i| if failed.contains(&i) { zero.clone() } else { g.clone() }).collect();
            let resp = SyncResponse { seq: u64::MAX, now: u64::MAX, nodes: u32::MAX, grants, failed };
            assert!(resp.encode().len() <= SyncResponse::max_len(core::iter::repeat_n(MAX_KEY, n)), "{n} {failing}");
        }
    }
    let empty = SyncResponse { seq: u64::MAX, now: u64::MAX, nodes: u32::MAX, grants: vec![], failed: vec![] };
    assert!(empty.encode().len() <= SyncResponse::max_len(core::iter::empty()));
}

#[test]
fn hex_round_trips_and_rejects_garbage() {
    assert_eq!(hex(&[0, 0xab, 7]), "00ab07");
    assert_eq!(unhex(b"00AB07"), Some(vec![0, 0xab, 7]));
    assert_eq!(unhex(b"0g"), None);
    assert_eq!(unhex(b"abc"), None);
}

#[test]
fn messages_round_trip_and_trailing_bytes_are_errors() {
    let r = req(7, 9, 3);
    assert_eq!(SyncRequest::decode(&r.encode()), Ok(r.clone()));
    let mut long = r.encode();
    long.push(0);
    assert!(SyncRequest::decode(&long).is_err());
    // A top section follows a batch, never an ask.
    let mut with_top = r.encode();
    TopSection { rules: vec![] }.encode_into(&mut with_top);
    assert!(SyncRequest::decode_with_top(&with_top).is_ok_and(|(_, top)| top.is_some()));
    let ask = SyncRequest { ask: true, ..r.clone() };
    let mut ask_with_top = ask.encode();
    TopSection { rules: vec![] }.encode_into(&mut ask_with_top);
    assert!(SyncRequest::decode(&ask_with_top).is_err());
    let resp = SyncResponse {
        seq: 9,
        now: NOW,
        nodes: 3,
        grants: vec![Grant { key: b"k".to_vec(), remaining: 5, grant: 2, reset_after: 7, lease: 9 }],
        failed: vec![],
    };
    assert_eq!(SyncResponse::decode(&resp.encode()), Ok(resp.clone()));
    assert!(SyncResponse::decode(&r.encode()).is_err(), "a request is not a response");
}

#[test]
fn an_answer_lists_the_deltas_it_could_not_apply_and_refuses_a_bad_list() {
    let g = |k: &[u8]| Grant { key: k.to_vec(), remaining: 0, grant: 0, reset_after: 0, lease: 0 };
    let resp = SyncResponse { seq: 4, now: NOW, nodes: 2, grants: vec![g(b"a"), g(b"b"), g(b"c")], failed: vec![0, 2] };
    let bytes = resp.encode();
    assert_eq!(SyncResponse::decode(&bytes), Ok(resp.clone()));
    // Without any, the answer is the one a store without the section gives.
    let plain = SyncResponse { failed: vec![], ..resp.clone() };
    assert_eq!(bytes.len(), plain.encode().len() + 4);
    assert_eq!(bytes.get(..plain.encode().len()), Some(plain.encode().as_slice()));
    let with = |list: &[u64]| {
        let mut b = plain.encode();
        b.push(FAILED_SECTION);
        crate::encoding::put_varint(&mut b, list.len() as u64);
        for i in list {
            crate::encoding::put_varint(&mut b, *i);
        }
        SyncResponse::decode(&b)
    };
    assert!(with(&[0, 2]).is_ok());
    assert!(with(&[3]).is_err(), "an index past the grants");
    assert!(with(&[2, 0]).is_err(), "not ascending");
    assert!(with(&[1, 1]).is_err(), "named twice");
    let mut trailing = bytes;
    trailing.push(0);
    assert!(SyncResponse::decode(&trailing).is_err());
}

#[test]
fn a_delta_costs_a_few_bytes() {
    let r = SyncRequest {
        node: 1,
        seq: 1,
        sent: NOW,
        deltas: vec![Delta { key: vec![b'x'; 24], limit: limit(), units: 12 }; 100],
        ask: false,
    };
    let per_delta = (r.encode().len() - 14) / 100;
    assert!(per_delta <= 36, "{per_delta} bytes per delta for a 24-byte key");
}

#[test]
fn forged_or_tampered_batches_are_refused() {
    let mut s = Store::new(100, 10 * SECOND);
    let body = req(1, 1, 5).encode();
    let tag = sign(b"secret", &body);
    assert_eq!(s.handle_signed(NOW, b"other", &body, &tag), Err(SyncError::Unauthorized));
    let mut tampered = body.clone();
    if let Some(last) = tampered.last_mut() {
        *last = 99;
    }
    assert_eq!(s.handle_signed(NOW, b"secret", &tampered, &tag), Err(SyncError::Unauthorized));
    assert!(s.handle_signed(NOW, b"secret", &body, &tag).is_ok());
    assert_eq!(s.peek(b"k", NOW).map(|d| d.remaining), Some(95));
}

/// `req` signed with `b"secret"`: (body, tag).
fn signed(r: &SyncRequest) -> (Vec<u8>, Vec<u8>) {
    let body = r.encode();
    let tag = sign(b"secret", &body).to_vec();
    (body, tag)
}

#[test]
fn a_captured_batch_replayed_after_its_seq_is_forgotten_is_refused_and_counts_nothing() {
    // A fixed window of an hour: what is counted stays counted over the test's 65 s.
    let hour = Limit::new(Algorithm::FixedWindow, 100, 3600 * SECOND, None).unwrap();
    let at = |node, units, sent| SyncRequest {
        sent,
        deltas: vec![Delta { key: b"k".to_vec(), limit: hour, units }],
        ..req(node, 1, 0)
    };
    let later = NOW + 65 * SECOND;
    let mut s = Store::new(100, 2 * SECOND);
    let (body, tag) = signed(&at(1, 25, NOW));
    assert!(s.handle_signed(NOW, b"secret", &body, &tag).is_ok());
    // Another node syncs the counter 65 s later: the counter and the registry forget node 1.
    let (other, other_tag) = signed(&at(2, 0, later));
    assert!(s.handle_signed(later, b"secret", &other, &other_tag).is_ok());
    assert_eq!(s.peek(b"k", later).map(|d| d.remaining), Some(75));
    // The captured batch, sent again byte for byte: its time gives it away.
    let replayed = s.handle_signed(later, b"secret", &body, &tag);
    assert_eq!(replayed, Err(SyncError::Skewed { sent: NOW, now: later }));
    assert_eq!(replayed.unwrap_err().status(), 422);
    assert_eq!(s.peek(b"k", later).map(|d| d.remaining), Some(75), "25 units, counted once");
    // Without its time checked, the same batch would have counted again: the store forgot it.
    assert!(s.handle(later, &at(1, 25, NOW)).is_ok());
    assert_eq!(s.peek(b"k", later).map(|d| d.remaining), Some(50));
}

#[test]
fn a_request_within_the_skew_bound_is_applied_and_one_beyond_it_is_refused() {
    for (sent, applied) in [
        (NOW - MAX_REQUEST_SKEW, true),
        (NOW + MAX_REQUEST_SKEW, true),
        (NOW - MAX_REQUEST_SKEW - 1, false),
        (NOW + MAX_REQUEST_SKEW + 1, false),
    ] {
        for ask in [false, true] {
            let mut s = Store::new(100, 2 * SECOND);
            let (body, tag) = signed(&SyncRequest { sent, ask, ..req(1, 1, 5) });
            let r = s.handle_signed(NOW, b"secret", &body, &tag);
            assert_eq!(r.is_ok(), applied, "sent {sent}, ask {ask}: {r:?}");
            let counted = s.peek(b"k", NOW).map_or(0, |d| d.limit - d.remaining);
            assert_eq!(counted, if applied { 5 } else { 0 }, "sent {sent}, ask {ask}");
            if !applied {
                assert_eq!(r, Err(SyncError::Skewed { sent, now: NOW }));
            }
        }
    }
    // A heartbeat too.
    let mut s = Store::new(100, 2 * SECOND);
    let (body, tag) = signed(&SyncRequest { sent: NOW - 30 * SECOND, deltas: vec![], ..req(1, 1, 0) });
    assert!(matches!(s.handle_signed(NOW, b"secret", &body, &tag), Err(SyncError::Skewed { .. })));
}

#[test]
fn every_refusal_reason_fits_what_a_node_reads_of_an_answer() {
    let longest = [
        SyncError::Stale { last: u64::MAX },
        SyncError::Malformed(crate::encoding::DecodeError::BadLog),
        SyncError::Unauthorized,
        SyncError::Skewed { sent: u64::MAX, now: 0 },
        SyncError::Version(1),
        SyncError::Version(255),
    ];
    for e in longest {
        // The stores prefix a malformed batch's reason with "malformed batch: ".
        assert!(alloc::format!("malformed batch: {e}").len() <= MAX_REASON, "{e}");
    }
    assert!(SyncResponse::max_len(core::iter::empty()) >= MAX_REASON, "a heartbeat's refusal is read");
}

#[test]
fn a_refusal_for_time_says_which_way_and_by_how_much() {
    let behind = SyncError::Skewed { sent: NOW - 40 * SECOND - 5_000_000, now: NOW };
    let text = alloc::format!("{behind}");
    assert!(text.contains("40.005 s behind the store's clock (1700000000.000 s)"), "{text}");
    assert!(text.contains("more than 25 s"), "{text}");
    let ahead = alloc::format!("{}", SyncError::Skewed { sent: NOW + 30 * SECOND, now: NOW });
    assert!(ahead.contains("30.000 s ahead of"), "{ahead}");
}

#[test]
fn a_request_of_the_previous_version_is_refused_as_such() {
    // Version 1: a batch (kind 1) of node 1, seq 1, one delta, and no time after the seq.
    let mut v1 = vec![1u8, 1, 1, 1, 1, 1, b'k'];
    super::wire::put_limit(&mut v1, &limit());
    crate::encoding::put_varint(&mut v1, 5);
    let mut s = Store::new(100, 2 * SECOND);
    let tag = sign(b"secret", &v1);
    let r = s.handle_signed(NOW, b"secret", &v1, &tag);
    assert_eq!(r, Err(SyncError::Version(1)));
    assert_eq!(r.unwrap_err().status(), 415);
    assert!(alloc::format!("{}", SyncError::Version(1)).contains("version 1 (requests without a time)"));
    // Unsigned, it is refused as any unsigned body is.
    assert_eq!(s.handle_signed(NOW, b"secret", &v1, &[0; 32]), Err(SyncError::Unauthorized));
    assert!(s.is_empty());
}

#[test]
fn a_signed_body_that_is_no_batch_is_malformed_not_of_another_version() {
    let mut v3 = req(1, 1, 5).encode();
    v3[0] = 3;
    let mut v0 = req(1, 1, 5).encode();
    v0[0] = 0;
    for body in [&b"hello"[..], b"{\"x\":1}", b"\xff", &v3, &v0] {
        let tag = sign(b"secret", body);
        let r = SyncRequest::verified(b"secret", body, &tag, Some(NOW));
        assert!(matches!(r, Err(SyncError::Malformed(_))), "{body:?}: {r:?}");
        assert_eq!(r.unwrap_err().status(), 400, "{body:?}");
    }
    // Only the earlier version is refused as a version.
    let mut v1 = vec![1u8, 1, 1, 1, 1, 1, b'k'];
    super::wire::put_limit(&mut v1, &limit());
    crate::encoding::put_varint(&mut v1, 5);
    let tag = sign(b"secret", &v1);
    assert_eq!(SyncRequest::verified(b"secret", &v1, &tag, Some(NOW)), Err(SyncError::Version(1)));
}

#[test]
fn a_key_length_of_2_pow_40_is_refused_as_too_long_not_as_unreadable() {
    // A batch whose one key claims 2^40 bytes: past a wasm32 `usize` (the Worker), which read
    // it as another reason than a 64-bit store.
    let body = [2u8, 1, 42, 1, 0, 1, 0x80, 0x80, 0x80, 0x80, 0x80, 0x20, b'a', b'b', b'c'];
    let e = SyncRequest::decode(&body).unwrap_err();
    assert_eq!(e, crate::encoding::DecodeError::Invalid("length (a key or name too long)"));
}

#[test]
fn a_batch_that_names_a_counter_twice_is_malformed_and_counts_nothing() {
    let d = |key: &[u8], units| Delta { key: key.to_vec(), limit: limit(), units };
    let r = SyncRequest { deltas: vec![d(b"k", 2), d(b"j", 1), d(b"k", 3)], ..req(1, 1, 0) };
    let (body, tag) = signed(&r);
    let mut s = Store::new(100, 2 * SECOND);
    let refused = s.handle_signed(NOW, b"secret", &body, &tag);
    assert_eq!(
        refused,
        Err(SyncError::Malformed(crate::encoding::DecodeError::Invalid("batch: a counter is named twice")))
    );
    assert_eq!(refused.unwrap_err().status(), 400);
    assert!(s.is_empty());
    let once = SyncRequest { deltas: vec![d(b"k", 2), d(b"j", 1)], ..req(1, 1, 0) };
    assert_eq!(SyncRequest::decode(&once.encode()), Ok(once));
}

#[test]
fn a_delta_for_a_concurrency_limit_is_malformed() {
    let concurrent = Limit::new(Algorithm::Concurrent, 2, 60 * SECOND, None).unwrap();
    let r = SyncRequest { deltas: vec![Delta { key: b"k".to_vec(), limit: concurrent, units: 1 }], ..req(1, 1, 0) };
    let (body, tag) = signed(&r);
    let mut s = Store::new(100, 2 * SECOND);
    let refused = s.handle_signed(NOW, b"secret", &body, &tag);
    assert_eq!(refused, Err(SyncError::Malformed(crate::encoding::DecodeError::Invalid("limit algorithm"))));
    assert_eq!(refused.unwrap_err().status(), 400);
    assert!(s.is_empty());
    // A window whose capacity is not its requests is no limit a node applies.
    let sliding = Limit::new(Algorithm::SlidingWindow, 5, 60 * SECOND, None).unwrap();
    let good = SyncRequest { deltas: vec![Delta { key: b"k".to_vec(), limit: sliding, units: 1 }], ..req(1, 1, NOW) };
    let mut odd = good.encode();
    let at = odd.len() - 2;
    assert_eq!(odd.get(at), Some(&5), "the capacity, before the units");
    odd[at] = 7;
    assert_eq!(
        SyncRequest::decode(&odd),
        Err(crate::encoding::DecodeError::Invalid("limit (a window's capacity is its requests)"))
    );
    assert_eq!(SyncRequest::decode(&good.encode()), Ok(good));
    // The codes 0-4 decode.
    for a in Algorithm::ALL.iter().filter(|a| **a != Algorithm::Concurrent) {
        let l = Limit::new(*a, 2, 60 * SECOND, None).unwrap();
        let r = SyncRequest { deltas: vec![Delta { key: b"k".to_vec(), limit: l, units: 1 }], ..req(1, 1, 0) };
        assert_eq!(SyncRequest::decode(&r.encode()), Ok(r));
    }
}

#[test]
fn a_retried_batch_is_never_counted_twice_and_old_ones_are_refused() {
    let mut s = Store::new(100, 10 * SECOND);
    let first = s.handle(NOW, &req(1, 5, 10)).unwrap();
    let retry = s.handle(NOW + SECOND, &req(1, 5, 10)).unwrap();
    // The same grant, on what remains of its lease, at the store's clock now.
    let (a, b) = (&first.grants[0], &retry.grants[0]);
    assert_eq!((b.grant, b.remaining, b.lease, retry.now), (a.grant, a.remaining, a.lease - SECOND, NOW + SECOND));
    assert_eq!(s.peek(b"k", NOW).map(|d| d.remaining), Some(90));
    s.handle(NOW, &req(1, 6, 1)).unwrap();
    assert_eq!(s.handle(NOW, &req(1, 5, 10)), Err(SyncError::Stale { last: 6 }));
    assert_eq!(s.peek(b"k", NOW).map(|d| d.remaining), Some(89));
}

#[test]
fn a_late_retry_is_recognized_after_other_nodes_synced_and_quiet_spells() {
    // The Worker forgot a node's seq once it had been quiet for 2 s while another node
    // synced the counter: the retry counted twice. Now it is remembered for SEQ_MEMORY,
    // longer than the filter retries (RETRY_HORIZON).
    let ttl = 2 * SECOND;
    for wait in [SECOND + SECOND / 2, 5 * SECOND / 2, 6 * SECOND, RETRY_HORIZON] {
        let mut s = Store::new(100, ttl);
        s.handle(NOW, &req(1, 1, 5)).unwrap();
        s.handle(NOW + wait / 2, &req(2, 1, 0)).unwrap();
        s.handle(NOW + wait, &req(2, 2, 0)).unwrap();
        let before = s.peek(b"k", NOW + wait).map(|d| d.remaining);
        s.handle(NOW + wait, &req(1, 1, 5)).unwrap();
        assert_eq!(s.peek(b"k", NOW + wait).map(|d| d.remaining), before, "repeat after {wait} ns");
    }
}

#[test]
fn more_nodes_than_the_old_share_cap_keep_their_seq() {
    let mut s = Store::new(100, 2 * SECOND);
    for node in 1..=100u64 {
        s.handle(NOW + node, &req(node, 1, 0)).unwrap();
    }
    s.handle(NOW, &req(1000, 1, 1)).unwrap();
    for node in 1..=100u64 {
        s.handle(NOW + 200, &req(node, 2, 0)).unwrap();
    }
    // Node 1000's retry, after 100 other nodes.
    s.handle(NOW + 300, &req(1000, 1, 1)).unwrap();
    assert_eq!(s.peek(b"k", NOW + 300).map(|d| d.remaining), Some(99));
}

#[test]
fn nodes_are_the_fleet_heard_from_even_in_a_heartbeat() {
    let mut s = Store::new(100, 2 * SECOND);
    for node in 1..=3 {
        assert_eq!(s.handle(NOW, &req(node, 1, 1)).unwrap().nodes, node as u32);
    }
    let heartbeat = SyncRequest { node: 1, seq: 2, sent: NOW, deltas: vec![], ask: false };
    assert_eq!(s.handle(NOW + SECOND, &heartbeat).unwrap().nodes, 3);
    // Past the node TTL only the sender counts.
    let heartbeat = SyncRequest { node: 1, seq: 3, sent: NOW, deltas: vec![], ask: false };
    assert_eq!(s.handle(NOW + 4 * SECOND, &heartbeat).unwrap().nodes, 1);
}

#[test]
fn an_asks_remaining_is_after_its_units() {
    let mut s = Store::new(100, 2 * SECOND);
    s.handle(NOW, &req(1, 1, 90)).unwrap();
    let ask = SyncRequest {
        node: 2,
        seq: 1,
        sent: NOW,
        deltas: vec![Delta { key: b"k".to_vec(), limit: limit(), units: 3 }],
        ask: true,
    };
    // Past node 1's lease, its grant no longer holds the last 10 units.
    let r = s.handle(NOW + 3 * SECOND, &ask).unwrap();
    assert!(r.grants[0].grant >= 3, "{r:?}");
    assert_eq!(r.grants[0].remaining, 7);
}

#[test]
fn grants_never_promise_more_than_remains_and_follow_traffic() {
    let mut s = Store::new(100, 10 * SECOND);
    let mut grants = BTreeMap::new();
    // Node 1 sends 9x the traffic of node 2 and node 3.
    for round in 1..=3 {
        for (node, units) in [(1u64, 9u64), (2, 1), (3, 1)] {
            let r = s.handle(NOW + round, &req(node, round, units)).unwrap();
            grants.insert(node, r.grants[0].grant);
        }
    }
    let remaining = s.peek(b"k", NOW + 3).unwrap().remaining;
    assert_eq!(remaining, 100 - 33);
    assert!(grants.values().sum::<u64>() <= remaining, "{grants:?} vs {remaining}");
    assert!(grants[&1] > 4 * grants[&2], "{grants:?}");
}

#[test]
fn an_ask_neither_checks_nor_moves_the_batch_sequence() {
    let mut s = Store::new(100, 10 * SECOND);
    s.handle(NOW, &req(1, 5, 10)).unwrap();
    let ask = SyncRequest { ask: true, ..req(1, 0, 1) };
    assert_eq!(SyncRequest::decode(&ask.encode()), Ok(ask.clone()));
    let answer = s.handle(NOW, &ask).unwrap();
    assert!(answer.grants[0].grant >= 1, "{answer:?}");
    assert_eq!(s.peek(b"k", NOW).map(|d| d.remaining), Some(89), "the asked unit is counted");
    assert_eq!(s.handle(NOW, &req(1, 5, 10)).unwrap().seq, 5, "batch 5 is still the last one");
    assert!(s.handle(NOW, &req(1, 6, 0)).is_ok());
}

#[test]
fn grants_on_lease_never_sum_past_what_remains_and_asks_take_only_free_units() {
    let small = Limit::new(Algorithm::FixedWindow, 10, 60 * SECOND, None).unwrap();
    let mut c = Counter::new(small);
    let mut held = 0;
    c.take(small, NOW, 5);
    for node in 1..=5 {
        held += c.apply(small, NOW, node, 1, 0, 10 * SECOND).grant;
    }
    let remaining = c.limit.decide(&c.state, NOW, 0).0.remaining;
    assert_eq!(remaining, 5);
    assert!(held <= remaining, "{held} granted of {remaining}");
    // Asks take what no grant holds, counting it at once, and no more.
    let mut taken = 0;
    for node in 1..=10 {
        let a = c.ask(small, NOW, node, 1, 1, 10 * SECOND);
        assert!(a.grant == 0 || a.grant >= 1);
        taken += u64::from(a.grant > 0);
    }
    assert_eq!(taken, remaining - held, "exactly the free units");
    assert_eq!(c.limit.decide(&c.state, NOW, 0).0.remaining, held, "asked units are counted at once");
}

#[test]
fn a_quiet_nodes_grant_lapses_with_its_lease_and_frees_its_units() {
    let l = Limit::new(Algorithm::FixedWindow, 100, 60 * SECOND, None).unwrap();
    let mut c = Counter::new(l);
    let first = c.apply(l, NOW, 1, 1, 40, 10 * SECOND);
    assert!(first.grant > 0 && first.lease > 0 && first.lease <= MAX_LEASE, "{first:?}");
    // While node 1's grant is on lease, node 2 cannot ask for those units.
    let free_now = 60 - first.grant;
    let mut asked = 0;
    for n in 1.. {
        if c.ask(l, NOW, 2, n, 1, 10 * SECOND).grant == 0 {
            break;
        }
        asked += 1;
        assert!(asked <= free_now, "asks reached units node 1 holds");
    }

    // Once the lease is over (node 2 asks, so the rule is exact: and the grace for node 1's
    // report), node 1's units are free again.
    let later = NOW + first.lease + REPORT_GRACE + 1;
    assert!(c.ask(l, later, 2, 1000, 1, 10 * SECOND).grant > 0, "a lapsed grant locks nothing");
}

#[test]
fn a_node_that_says_what_it_holds_is_not_refused_for_its_own_units_it_cannot_spend() {
    // One node, 50 a minute (it asks: the rule is exact). Its report was granted the rest;
    // the grant's lease ended with 3 of it spent, which the node will report. Within the
    // report's grace the store still holds the whole grant: an ask that says the node holds
    // only those 3 fits beside them; a plain one is refused for the node's own units.
    let l = Limit::new(Algorithm::FixedWindow, 50, 60 * SECOND, None).unwrap();
    let ttl = 10 * SECOND;
    let mut c = Counter::new(l);
    assert!(c.ask(l, NOW, 1, 1, 1, ttl).grant >= 1);
    let report = c.report_counted(l, (NOW + 10 * MS_, NOW), (1, 1, 9), ttl, true);
    assert!(report.grant > 20 && report.lease > 0, "{report:?}");
    let lapsed = NOW + 10 * MS_ + report.lease + REPORT_GRACE / 2;
    let plain = c.clone().ask(l, lapsed, 1, 2, 1, ttl);
    assert_eq!(plain.grant, 0, "{plain:?}");
    let a = c.ask_holding(l, lapsed, (1, 2, 3), 1, ttl);
    assert!(a.grant >= 1 && a.counted, "{a:?}");
    // Another node's ask is still held off what the first may have spent.
    let free = 50 - 10 - 3 - a.grant;
    assert_eq!(c.ask(l, lapsed + MS_, 2, 1, free + 1, ttl).grant, 0);
}

#[test]
fn an_ask_after_a_nodes_grant_lapsed_does_not_hold_that_grant_again() {
    // One node, 3 a minute: its batch reported 1 and was granted the other 2; it went quiet
    // past the lease, then asks for 1 unit, then 1 more: both fit (3 in all), as the
    // limit alone allows. Extending its lease for the first ask held the old grant again,
    // and the second was refused.
    let l = Limit::new(Algorithm::SlidingWindow, 3, 60 * SECOND, None).unwrap();
    let ttl = 10 * SECOND;
    let mut c = Counter::new(l);
    let first = c.apply(l, NOW, 1, 1, 1, ttl);
    assert_eq!(first.grant, 2, "{first:?}");
    let later = NOW + first.lease + REPORT_GRACE + 6 * SECOND;
    assert_eq!(c.ask(l, later, 1, 1, 1, ttl).grant, 1, "the first of the burst");
    assert!(c.ask(l, later + 1, 1, 2, 1, ttl).grant >= 1, "the second: 2 of 3 counted");
    assert_eq!(c.ask(l, later + 2, 1, 3, 1, ttl).grant, 0, "the fourth in all: over the limit");
}

#[test]
fn on_an_exact_rules_counter_a_lapsed_grant_stays_held_until_its_nodes_report_can_arrive() {
    let l = Limit::new(Algorithm::FixedWindow, 100, 60 * SECOND, None).unwrap();
    let ttl = 10 * SECOND;
    let mut c = Counter::new(l);
    let first = c.apply(l, NOW, 1, 1, 0, ttl);
    assert!(first.grant > 0 && first.lease > 0, "{first:?}");
    let held_by_1 = |c: &Counter, at| c.outstanding(at, None) - c.outstanding(at, Some(1));
    let lapsed = NOW + first.lease + 1;
    // Nobody asks: the rule is not exact, and the grant lapses with its lease.
    assert_eq!(held_by_1(&c.clone(), lapsed), 0);
    // A node asks: the rule is exact. Node 1 may have spent its grant just before the lease
    // ended; until its batch can have reported it, the units stay held.
    assert!(c.ask(l, NOW, 2, 1, 1, ttl).grant > 0);
    assert_eq!(held_by_1(&c, lapsed), first.grant);
    assert_eq!(held_by_1(&c, NOW + first.lease + REPORT_GRACE + 1), 0, "then they are free");
    // Node 1's batch reports what it spent and replaces the grant.
    let report = c.apply(l, lapsed, 1, 2, first.grant, ttl);
    assert_eq!(held_by_1(&c, lapsed), report.grant);
    // A refused ask waits for the grace too.
    let window_end = 60 * SECOND - NOW % (60 * SECOND);
    let mut c = Counter::new(l);
    c.take(l, NOW, 50);
    let held = c.apply(l, NOW, 1, 1, 0, ttl);
    assert!(c.ask(l, NOW, 2, 1, 1, ttl).grant > 0);
    let free = c.limit.decide(&c.state, NOW, 0).0.remaining - c.outstanding(NOW, None);
    assert_eq!(c.ask(l, NOW, 3, 1, free + 1, ttl).grant, 0);
    let first_lapse = held.lease.min(ASK_LEASE);
    assert_eq!(c.retry_after(NOW, free + 1), Some((first_lapse + REPORT_GRACE).min(window_end)));
}

#[test]
fn near_an_exact_counters_end_an_ask_takes_only_what_it_asked_for() {
    // 200 a minute, three nodes asking in turn. The first, alone on the counter, gets a share
    // beside its unit; once fewer than two units per node are left, an ask gets only its
    // unit, and none is refused while a unit given beside another sat in its grant.
    let l = Limit::new(Algorithm::SlidingWindow, 200, 60 * SECOND, None).unwrap();
    let ttl = 10 * SECOND;
    let mut c = Counter::new(l);
    c.take(l, NOW, 194);
    let first = c.ask(l, NOW, 1, 1, 1, ttl);
    assert!(first.grant > 1, "{first:?}");
    let held = first.grant - 1;
    let asks: Vec<u64> = (2..=6).map(|node| c.ask(l, NOW, node, 1, 1, ttl).grant).collect();
    // 5 left after the first ask, `held` of them in its grant: every other one goes to an ask.
    let granted = 5 - held as usize;
    assert!(asks.iter().take(granted).all(|&g| g == 1), "{asks:?}");
    assert!(asks.iter().skip(granted).all(|&g| g == 0), "{asks:?}");
}

/// A limit slower than one unit per longest lease is taken by asks alone: none gets units
/// beside its own, so none sits in one node's grant.
#[test]
fn a_slow_exact_limit_gives_only_the_asked_units() {
    let l = Limit::new(Algorithm::SlidingWindow, 5, 60 * SECOND, None).unwrap();
    let mut c = Counter::new(l);
    let grants: Vec<u64> = (1..=6).map(|node| c.ask(l, NOW, node, 1, 1, 10 * SECOND).grant).collect();
    assert_eq!(grants, [1, 1, 1, 1, 1, 0]);
}

/// So is a small one, whatever its pace: the first node to ask is given no tokens beside its
/// own, and the second node's ask is not refused for them.
#[test]
fn a_small_exact_limit_gives_only_the_asked_units() {
    for l in [
        Limit::new(Algorithm::TokenBucket, 1, 2 * SECOND, Some(3)).unwrap(),
        Limit::new(Algorithm::FixedWindow, 3, 5 * SECOND, None).unwrap(),
        Limit::new(Algorithm::SlidingWindow, 10, SECOND, None).unwrap(),
    ] {
        let mut c = Counter::new(l);
        let cap = l.capacity();
        let grants: Vec<u64> = (1..=cap + 1).map(|node| c.ask(l, NOW, node % 2, node, 1, 10 * SECOND).grant).collect();
        let mut want = vec![1; cap as usize];
        want.push(0);
        assert_eq!(grants, want, "{l:?}");
    }
    // Past it, the first asker is given units beside its own as before.
    let l = Limit::new(Algorithm::FixedWindow, 11, 5 * SECOND, None).unwrap();
    assert!(Counter::new(l).ask(l, NOW, 1, 1, 1, 10 * SECOND).grant > 1);
}

#[test]
fn a_duplicated_ask_is_answered_again_and_takes_nothing_more() {
    let l = Limit::new(Algorithm::FixedWindow, 100, 60 * SECOND, None).unwrap();
    let mut c = Counter::new(l);
    let first = c.ask(l, NOW, 2, 5, 1, 10 * SECOND);
    assert!(first.grant >= 1 && first.counted);
    let again = c.ask(l, NOW + 1, 2, 5, 1, 10 * SECOND);
    assert_eq!((again.grant, again.counted, again.remaining), (first.grant, false, 99));
    assert!(c.ask(l, NOW + 2, 2, 6, 1, 10 * SECOND).counted, "the next ask is a new one");
}

#[test]
fn leases_shorten_as_the_quota_runs_out_at_the_fleets_rate() {
    let l = Limit::new(Algorithm::FixedWindow, 1000, 60 * SECOND, None).unwrap();
    let mut c = Counter::new(l);
    let mut leases = Vec::new();
    // 100 units per second reported, from t = 0 to t = 9 s.
    for i in 0..10u64 {
        leases.push(c.apply(l, NOW + i * SECOND, 1, i + 1, 100, 10 * SECOND).lease);
    }
    assert!(leases.windows(2).all(|w| w[1] <= w[0]), "{leases:?}");
    assert_eq!(leases[0], MAX_LEASE, "{leases:?}");
    // 100 units left at 100 per second (up to 200 counted at a second's edge): at most
    // half a second.
    assert!(leases[8] > 0 && leases[8] <= SECOND / 2, "{leases:?}");
    assert_eq!(leases[9], 0, "nothing left: no lease");
}

#[test]
fn a_counter_applies_each_nodes_batch_once_and_keeps_it_across_encoding() {
    let mut c = Counter::new(limit());
    let first = c.apply(limit(), NOW, 1, 7, 10, SECOND);
    assert!(first.counted);
    assert_eq!(first.remaining, 90);
    let again = c.apply(limit(), NOW + 1, 1, 7, 10, SECOND);
    assert_eq!((again.counted, again.grant, again.remaining), (false, first.grant, 90));
    let older = c.apply(limit(), NOW + 2, 1, 6, 10, SECOND);
    assert_eq!((older.counted, older.grant, older.remaining), (false, 0, 90));
    let mut restored = Counter::decode(limit(), &c.encode()).unwrap();
    assert_eq!(restored, c);
    assert!(!restored.apply(limit(), NOW + 3, 1, 7, 10, SECOND).counted, "a restart forgets no batch");
    assert!(restored.apply(limit(), NOW + 3, 2, 7, 5, SECOND).counted, "another node's seq is its own");
    assert!(Counter::decode(limit(), &c.encode()[..3]).is_err());
    // Asks, a lease and the rate survive a restart too.
    assert!(restored.ask(limit(), NOW + 4, 3, 1, 1, SECOND).grant > 0);
    assert_eq!(Counter::decode(limit(), &restored.encode()).unwrap(), restored);
    // A counter stored before the exactness flag reads as not exact (until the next ask).
    let v2 = restored.encode_version(2);
    let mut old = Counter::decode(limit(), &v2).unwrap();
    assert!(restored.exact && !old.exact);
    old.exact = true;
    assert_eq!(old, restored.without_parts());
    // One stored before nodes' parts were kept reads with none known.
    assert_eq!(Counter::decode(limit(), &restored.encode_version(4)).unwrap(), restored.without_parts());
    assert_ne!(restored, restored.without_parts(), "its filter nodes have parts");
    // One stored before units in flight were held reads with none held.
    let mut held = restored.clone();
    held.shares[0].flight = 3;
    let old = Counter::decode(limit(), &held.encode_version(3)).unwrap();
    assert_eq!((old.shares[0].flight, Counter::decode(limit(), &held.encode()).unwrap().shares[0].flight), (0, 3));
    // A counter stored by the version before leases reads with its grants leased.
    let mut v1 = vec![1u8];
    State::Fresh.encode_into(&mut v1);
    v1.extend_from_slice(&[5, 1, 9, 3, 2, 4, 5]);
    let old = Counter::decode(limit(), &v1).unwrap();
    assert_eq!(old.shares.len(), 1);
    assert_eq!(old.outstanding(5, None), 4);
}

#[test]
fn a_counter_never_lets_time_run_backwards() {
    let mut c = Counter::new(limit());
    assert!(c.take(limit(), NOW, 100).allowed);
    // A clock 30 s behind must not find the window fresher than it is.
    let d = c.take(limit(), NOW - 30 * SECOND, 1);
    assert!(!d.allowed);
    assert_eq!(c.last_seen, NOW);
    c.refund(limit(), NOW, NOW, 100);
    assert!(c.take(limit(), NOW, 1).allowed, "a refund gives the units back");
}

/// A clock that jumped ahead (further than [`CLOCK_CORRECTION`]) and was put back: the
/// counter takes the clock back and keeps its counts, in now's window; the client is then
/// limited as the window says, not until the clock catches up with the jump.
#[test]
fn a_clock_put_back_after_a_jump_ahead_is_taken_with_the_counts_kept() {
    let l = Limit::new(Algorithm::FixedWindow, 5, 60 * SECOND, None).unwrap();
    let start = NOW - NOW % (60 * SECOND) + 5 * SECOND;
    let mut c = Counter::new(l);
    for _ in 0..5 {
        assert!(c.take(l, start + 300 * SECOND, 1).allowed, "while the clock is 5 minutes ahead");
    }
    // Put back: the 5 units count in now's window.
    let d = c.take(l, start + 10 * SECOND, 1);
    assert!(!d.allowed);
    assert_eq!(c.last_seen, start + 10 * SECOND);
    assert_eq!(d.retry_after, Some(45 * SECOND), "until now's window ends");
    assert!(c.take(l, start + 60 * SECOND, 1).allowed, "the next window, not 5 minutes on");
    // A step back within it stays clamped.
    let mut c = Counter::new(l);
    assert!(c.take(l, start + 30 * SECOND, 5).allowed);
    assert!(!c.take(l, start + 30 * SECOND - CLOCK_CORRECTION, 1).allowed);
    assert_eq!(c.last_seen, start + 30 * SECOND);
}

#[test]
fn memory_is_bounded_by_max_counters() {
    let mut s = Store::new(10, 10 * SECOND);
    for i in 0..1000u64 {
        let d = Delta { key: i.to_le_bytes().to_vec(), limit: limit(), units: 1 };
        s.handle(NOW + i, &SyncRequest { node: 1, seq: i + 1, sent: NOW, deltas: vec![d], ask: false }).unwrap();
    }
    assert_eq!(s.len(), 10);
}

#[test]
fn a_refused_asks_wait_is_the_sooner_of_the_state_freeing_units_and_the_grants_lapsing() {
    let l = Limit::new(Algorithm::FixedWindow, 10, 60 * SECOND, None).unwrap();
    let mut c = Counter::new(l);
    // All ten consumed: only the window's end frees a unit.
    c.take(l, NOW, 10);
    let window_end = 60 * SECOND - NOW % (60 * SECOND);
    assert_eq!(c.ask(l, NOW, 1, 1, 1, 10 * SECOND).grant, 0);
    assert_eq!(c.retry_after(NOW, 1), Some(window_end));
    assert_eq!(c.retry_after(NOW, 11), None, "never fits");

    // Six consumed, four held by a node's grant: free when that grant's lease ends.
    let mut c = Counter::new(l);
    c.take(l, NOW, 6);
    let held = c.apply(l, NOW, 7, 1, 0, 10 * SECOND);
    assert!(held.grant > 0 && held.lease > 0, "{held:?}");
    let refused = c.ask(l, NOW, 8, 1, 10 - 6 - held.grant + 1, 10 * SECOND);
    assert_eq!(refused.grant, 0);
    let wait = c.retry_after(NOW, 10 - 6 - held.grant + 1).unwrap();
    assert_eq!(wait, (held.lease + REPORT_GRACE).min(window_end));
    assert!(c.ask(l, NOW + wait, 8, 2, 10 - 6 - held.grant + 1, 10 * SECOND).grant > 0, "waiting it is enough");

    // Nothing held and room left: no wait.
    assert_eq!(Counter::new(l).retry_after(NOW, 1), Some(0));
}

#[test]
fn a_repeated_sized_ask_answers_what_is_left_of_its_hold() {
    let l = Limit::new(Algorithm::FixedWindow, 100, 60 * SECOND, None).unwrap();
    let mut c = Counter::new(l);
    let first = c.ask_sized(l, NOW, 2, 5, 1, 10 * SECOND);
    assert!(first.counted && first.lease > 0);
    let again = c.ask_sized(l, NOW + 10, 2, 5, 1, 10 * SECOND);
    assert!(!again.counted);
    assert_eq!(again.lease, first.lease - 10, "the same hold, not a new one");
}

#[test]
fn traffic_shares_weigh_units_per_second_however_often_a_node_syncs() {
    let l = Limit::new(Algorithm::FixedWindow, 10_000, 60 * SECOND, None).unwrap();
    let mut c = Counter::new(l);
    // Node 1 spends 10 units a second and syncs every 100 ms; node 2 spends 1 a second and
    // syncs every second. Halved per sync, both weighed about 2 units.
    let mut seq = (0, 0);
    for tenth in 1..=50u64 {
        seq.0 += 1;
        c.apply(l, NOW + tenth * SECOND / 10, 1, seq.0, 1, 10 * SECOND);
        if tenth % 10 == 0 {
            seq.1 += 1;
            c.apply(l, NOW + tenth * SECOND / 10, 2, seq.1, 1, 10 * SECOND);
        }
    }
    let at = NOW + 5 * SECOND + 1;
    let busy = c.apply(l, at, 1, seq.0 + 1, 0, 10 * SECOND).grant;
    let quiet = c.apply(l, at, 2, seq.1 + 1, 0, 10 * SECOND).grant;
    assert!(busy >= 5 * quiet.max(1), "busy {busy}, quiet {quiet}");
}

#[test]
fn a_share_under_one_unit_is_granted_with_that_chance() {
    // 20 active nodes of equal traffic, 10 units free: the last node's share is half a unit.
    // Rounded down, it was 0, and every request asked.
    let l = Limit::new(Algorithm::FixedWindow, 1_000, 60 * SECOND, None).unwrap();
    let trials = 400u64;
    let mut given = 0;
    for t in 0..trials {
        let at = NOW + t * 7_919;
        let mut c = Counter::new(l);
        c.take(l, at, 1_000);
        for node in 1..=19 {
            // Seen now, holding nothing: nothing remained.
            assert_eq!(c.apply(l, at, node, 1, 0, 10 * SECOND).grant, 0);
        }
        c.refund(l, at, at, 10);
        let g = c.apply(l, at, 100, 1, 0, 10 * SECOND).grant;
        assert!(g <= 1, "{g}");
        given += g;
    }
    assert!(given > trials * 3 / 10 && given < trials * 7 / 10, "{given} of {trials}");
}

#[test]
fn every_batch_answer_names_the_counters_found_out_of_quota_until_their_window_ends() {
    let fixed = Limit::new(Algorithm::FixedWindow, 10, 60 * SECOND, None).unwrap();
    let window_end = (NOW / (60 * SECOND) + 1) * 60 * SECOND;
    let mut store = Store::new(100, 2 * SECOND);
    let batch = |node: u64, seq: u64, deltas: Vec<Delta>| SyncRequest { node, seq, sent: NOW, deltas, ask: false };
    let spent = Delta { key: b"spent".to_vec(), limit: fixed, units: 10 };
    let other = Delta { key: b"other".to_vec(), limit: fixed, units: 3 };
    let resp = store.handle(NOW, &batch(1, 1, vec![spent.clone(), other])).unwrap();
    assert_eq!(resp.grants.len(), 2, "a batch's own counters have their grants, not names");
    // Another node's heartbeat (no deltas) hears that `spent` is out, until its window ends.
    let heard = store.handle(NOW + SECOND, &batch(2, 1, vec![])).unwrap();
    assert_eq!(heard.grants.len(), 1);
    let g = &heard.grants[0];
    assert_eq!((g.key.as_slice(), g.remaining, g.grant, g.lease), (&b"spent"[..], 0, 0, 0));
    assert_eq!(g.reset_after, window_end - (NOW + SECOND));
    // An ask's answer names nothing beyond its counters; the next window, nothing is out.
    let ask = SyncRequest { node: 2, seq: 1, sent: NOW, deltas: vec![spent], ask: true };
    assert_eq!(store.handle(NOW + SECOND, &ask).unwrap().grants.len(), 1);
    assert!(store.handle(window_end, &batch(2, 2, vec![])).unwrap().grants.is_empty());
}

#[test]
fn a_small_exact_limit_spread_over_nodes_admits_its_whole_quota_by_asks() {
    // 5 a minute, three nodes taking turns, each node's batch following its request. Every
    // ask within the quota is granted (and gives only the unit asked), the sixth refused.
    let small = Limit::new(Algorithm::SlidingWindow, 5, 60 * SECOND, None).unwrap();
    let mut c = Counter::new(small);
    let mut seqs = [0u64; 4];
    let mut granted = Vec::new();
    for i in 0..9u64 {
        let node = 1 + i % 3;
        let t = NOW + i * 300_000_000;
        granted.push(c.ask(small, t, node, i + 1, 1, 10 * SECOND).grant > 0);
        let seq = &mut seqs[node as usize];
        *seq += 1;
        assert_eq!(c.apply(small, t + 50_000_000, node, *seq, 0, 10 * SECOND).grant, 0);
    }
    assert_eq!(granted, [true, true, true, true, true, false, false, false, false]);
}

#[test]
fn a_node_that_reported_units_is_granted_a_unit_of_room_while_units_are_free() {
    // 20 active nodes; node 100 reports `units` with `free` units left beside the others'
    // grants (none): its share of them is under one unit.
    let l = Limit::new(Algorithm::FixedWindow, 1_000, 60 * SECOND, None).unwrap();
    let answer = |free: u64, units: u64, room: bool, t: u64| {
        let at = NOW + t * 7_919;
        let mut c = Counter::new(l);
        c.take(l, at, 1_000);
        for node in 1..=19 {
            assert_eq!(c.apply(l, at, node, 1, 0, 10 * SECOND).grant, 0);
        }
        c.refund(l, at, at, free + units);
        let a =
            if room { c.apply(l, at, 100, 1, units, 10 * SECOND) } else { c.report(l, at, 100, 1, units, 10 * SECOND) };
        assert_eq!(a.remaining, free);
        a.grant
    };
    assert!((0..200).all(|t| answer(ROOM_UNIT_FREE, 1, true, t) >= 1), "room: always a unit");
    // Fewer free, a node that reported nothing, or a report with no unit of room: its share,
    // drawn (often 0).
    assert!((0..200).any(|t| answer(ROOM_UNIT_FREE - 1, 1, true, t) == 0));
    assert!((0..200).any(|t| answer(ROOM_UNIT_FREE, 0, true, t) == 0));
    assert!((0..200).any(|t| answer(ROOM_UNIT_FREE, 1, false, t) == 0));
    assert!((0..200).all(|t| answer(ROOM_UNIT_FREE, 1, false, t) <= 1));
}

#[test]
fn on_an_exact_sliding_windows_counter_a_unit_spent_while_a_batch_travels_stays_held_until_the_next() {
    const MS: Nanos = SECOND / 1000;
    let ttl = 10 * SECOND;
    let sliding = Limit::new(Algorithm::SlidingWindow, 100, 60 * SECOND, None).unwrap();
    let fixed = Limit::new(Algorithm::FixedWindow, 100, 60 * SECOND, None).unwrap();
    for l in [sliding, fixed] {
        let mut c = Counter::new(l);
        c.take(l, NOW, 95);
        let first = c.apply(l, NOW, 1, 1, 0, ttl);
        assert!(first.grant >= 2, "{first:?}");
        // A node asks: the rule is exact.
        assert!(c.ask(l, NOW, 2, 1, 1, ttl).grant > 0);
        // Node 1's next batch reports all but one unit of its grant: that one may be spent
        // while the batch travels, and the node keeps a unit of any grant above 0.
        let at = NOW + 100 * MS;
        let report = c.apply(l, at, 1, 2, first.grant - 1, ttl);
        assert_eq!(report.grant, 0, "the quota is near its end: {report:?}");
        let held_by_1 = |c: &Counter, t| c.outstanding(t, None) - c.outstanding(t, Some(1));
        let free = |c: &Counter, t| c.limit.decide(&c.state, t, 0).0.remaining.saturating_sub(c.outstanding(t, None));
        if l == sliding {
            assert_eq!(held_by_1(&c, at), 1, "{report:?}");
            // Not given to another node's ask meanwhile.
            let mut other = c.clone();
            assert_eq!(other.ask(l, at, 3, 1, free(&c, at) + 1, ttl).grant, 0);
            // Held until the node's next batch can have arrived, then its grant alone.
            assert_eq!(held_by_1(&c, at + REPORT_GRACE + 1), 0);
            // The next batch replaces the hold.
            let mut next = c.clone();
            let after = next.apply(l, at + 50 * MS, 1, 3, 1, ttl);
            assert_eq!(held_by_1(&next, at + 50 * MS), after.grant, "{after:?}");
            assert_eq!(Counter::decode(l, &c.encode()).unwrap(), c, "the hold survives encoding");
        } else {
            // A fixed window's count ends with its window: nothing is held beyond the grant.
            assert_eq!(held_by_1(&c, at), report.grant, "{report:?}");
        }
    }
}

/// A fixed window of 100 per 10 s, three filter nodes: node 1 carries half the traffic and
/// nodes 2 and 3 a quarter each through a window; then node 1 falls silent. Returns the
/// counter and the next window's start.
fn cut_off_fleet() -> (Counter, Limit, Nanos) {
    let limit = Limit::new(Algorithm::FixedWindow, 100, 10 * SECOND, None).unwrap();
    let mut c = Counter::new(limit);
    let start = NOW - NOW % (10 * SECOND);
    for seq in 1..=25u64 {
        let t = start + seq * 300 * MS_;
        c.apply(limit, t, 2, seq, 1, 2 * SECOND);
        c.apply(limit, t, 3, seq, 1, 2 * SECOND);
        c.apply(limit, t, 1, seq, 2, 2 * SECOND);
    }
    (c, limit, start + 10 * SECOND)
}

#[test]
fn a_filter_node_that_stops_reporting_while_the_others_go_on_has_its_share_held() {
    let (mut c, limit, t) = cut_off_fleet();
    // Node 1 falls silent; the others report 20 units over 3 s: at its share (half) it would
    // have had about 20 to report.
    for i in 1..=10u64 {
        let at = t + i * 300 * MS_;
        c.apply(limit, at, 2, 25 + i, 1, 2 * SECOND);
        c.apply(limit, at, 3, 25 + i, 1, 2 * SECOND);
    }
    let at = t + 3_100 * MS_;
    // Its half of the quota, with the margin a node out of reach admits on, is held: 20
    // counted, 80 remain, of which node 2 is granted no more than what is neither held for
    // node 1 nor by node 3's grant, and is told what remains beside the hold.
    let held = c.cut_off(at, None);
    assert!((48..=58).contains(&held), "held {held}");
    assert_eq!(c.cut_off(at, Some(2)), held);
    let a = c.apply(limit, at, 2, 36, 0, 2 * SECOND);
    assert!(a.grant + held <= 80, "granted {} beside {held} held", a.grant);
    assert_eq!(a.remaining, 80 - held);
    // Node 1 is heard again: nothing is held for it.
    c.apply(limit, at, 1, 26, 30, 2 * SECOND);
    assert_eq!(c.cut_off(at, None), 0);
}

#[test]
fn a_node_silent_on_a_counter_but_heard_on_others_is_not_held_for() {
    // Node 1's client moves to node 2: node 1 falls silent on this counter, node 2 reports
    // its traffic too, and the store still hears node 1 on other counters.
    let (mut c, limit, t) = cut_off_fleet();
    for i in 1..=10u64 {
        let at = t + i * 300 * MS_;
        c.heard_lately(&[3, 2, 1]);
        c.apply(limit, at, 2, 25 + i, 3, 2 * SECOND);
        c.apply(limit, at, 3, 25 + i, 1, 2 * SECOND);
    }
    let at = t + 3_100 * MS_;
    assert_eq!(c.cut_off(at, None), 0, "node 1 is heard: nothing held");
    let a = c.apply(limit, at, 2, 36, 0, 2 * SECOND);
    assert_eq!(a.remaining, 60, "all that remains is there to grant: {a:?}");
    // Where the store has not heard node 1 lately, or cannot say, its part is held.
    c.heard_lately(&[2, 3]);
    assert!(c.cut_off(at, None) >= 45, "held {}", c.cut_off(at, None));
    let unknown = Counter::decode(limit, &c.encode()).unwrap();
    assert_eq!(unknown.cut_off(at, None), c.cut_off(at, None), "what the store heard is not stored");
}

#[test]
fn a_silent_node_is_not_held_for_when_the_others_report_too_little_or_a_node_takes_its_traffic() {
    let (mut c, limit, t) = cut_off_fleet();
    // The others report 2 units in 3 s: node 1 would have had 2, too few to tell.
    c.apply(limit, t + 3 * SECOND, 2, 26, 1, 2 * SECOND);
    c.apply(limit, t + 3 * SECOND, 3, 26, 1, 2 * SECOND);
    assert_eq!(c.cut_off(t + 3 * SECOND, None), 0);
    // A node new to the counter (node 1 restarted under a new id) takes its traffic over:
    // what is held for node 1 goes as the newcomer's part grows.
    let mut held = Vec::new();
    for i in 1..=25u64 {
        let at = t + 3 * SECOND + i * 300 * MS_;
        c.apply(limit, at, 2, 26 + i, 1, 2 * SECOND);
        c.apply(limit, at, 3, 26 + i, 1, 2 * SECOND);
        c.apply(limit, at, 9, i, 2, 2 * SECOND);
        held.push(c.cut_off(at, None));
    }
    assert!(held.iter().all(|&h| h <= 50), "held {held:?}");
    assert!(held[24] <= 5, "held {held:?}");
}

#[test]
fn once_one_node_is_taken_as_cut_off_the_other_silent_ones_are_taken_at_fewer_units() {
    // Node 1 carries 40 % of the traffic, nodes 2, 3 and 4 20 % each, through a window.
    let limit = Limit::new(Algorithm::FixedWindow, 100, 10 * SECOND, None).unwrap();
    let mut c = Counter::new(limit);
    let start = NOW - NOW % (10 * SECOND);
    for seq in 1..=20u64 {
        let t = start + seq * 400 * MS_;
        for (node, units) in [(2, 1), (3, 1), (4, 1), (1, 2)] {
            c.apply(limit, t, node, seq, units, 2 * SECOND);
        }
    }
    // Nodes 1 and 4 fall silent; 2 and 3 report 14 units: node 1 would have had about 9 to
    // report (taken), node 4 about 3.5 (not enough alone, enough beside node 1).
    let t = start + 10 * SECOND;
    for i in 1..=7u64 {
        c.apply(limit, t + i * 300 * MS_, 2, 20 + i, 1, 2 * SECOND);
        c.apply(limit, t + i * 300 * MS_, 3, 20 + i, 1, 2 * SECOND);
    }
    let at = t + 2_200 * MS_;
    let both = c.cut_off(at, None);
    assert!((55..=70).contains(&both), "held {both} for 60 % of the traffic");
    // Node 1 is heard again: node 4 alone is not taken.
    c.apply(limit, at, 1, 21, 0, 2 * SECOND);
    assert_eq!(c.cut_off(at + 100 * MS_, None), 0);
}

#[test]
fn a_fixed_windows_units_reported_from_an_ended_window_count_in_none() {
    let fixed = Limit::new(Algorithm::FixedWindow, 10, 10 * SECOND, None).unwrap();
    let sliding = Limit::new(Algorithm::SlidingWindow, 10, 10 * SECOND, None).unwrap();
    let start = NOW - NOW % (10 * SECOND);
    assert_eq!(super::window_of(&fixed, start), super::window_of(&fixed, start + 10 * SECOND - 1));
    assert_eq!(super::window_of(&fixed, start) + 1, super::window_of(&fixed, start + 10 * SECOND));
    assert_eq!(super::window_of(&sliding, start), 0);
    let end = start + 10 * SECOND;
    assert_eq!(super::counted_units(&fixed, end - 1, end - 1, 3), 3, "in its window");
    assert_eq!(super::counted_units(&fixed, end - 1, end, 3), 0, "reported from an ended window");
    assert_eq!(super::counted_units(&fixed, end + 1, end, 3), 3, "a clock a little ahead");
    assert_eq!(super::counted_units(&fixed, 0, end, 3), 3, "made when not known");
    assert_eq!(super::counted_units(&sliding, end - 1, end + SECOND, 3), 3, "other algorithms count them");
}

#[test]
fn units_reported_late_are_counted_as_of_when_they_were_admitted() {
    // A token bucket of 3, one back every 3 s: three units admitted at NOW, reported 250 ms
    // later, leave the bucket as a limiter that took them at NOW would: one unit back at
    // NOW + 3 s, not 250 ms after.
    let l = Limit::new(Algorithm::TokenBucket, 1, 3 * SECOND, Some(3)).unwrap();
    let mut c = Counter::new(l);
    c.report_since(l, NOW + SECOND / 4, NOW, (1, 1, 3), 10 * SECOND);
    let (d, _) = l.decide(&c.state, NOW + 3 * SECOND, 1);
    assert!(d.allowed, "{d:?}");
    let mut late = Counter::new(l);
    late.report(l, NOW + SECOND / 4, 1, 1, 3, 10 * SECOND);
    assert!(!l.decide(&late.state, NOW + 3 * SECOND, 1).0.allowed, "counted at the report, it is behind");
    // Never before what the counter has seen: a later report from another node came first.
    let mut c = Counter::new(l);
    c.report(l, NOW + SECOND, 2, 1, 1, 10 * SECOND);
    c.report_since(l, NOW + 2 * SECOND, NOW, (1, 1, 2), 10 * SECOND);
    let mut same = Counter::new(l);
    same.report(l, NOW + SECOND, 2, 1, 3, 10 * SECOND);
    assert_eq!(c.state, same.state);
}

#[test]
fn a_grant_for_an_extreme_limit_and_delta_is_bounded_not_an_overflow() {
    // A limit no rules document gives (billions per nanosecond) but the wire carries, and a
    // delta of 2^31 units: the share's arithmetic saturates.
    let limit = Limit::new(Algorithm::FixedWindow, 4_294_967_292, 1, None).unwrap();
    let mut c = Counter::new(limit);
    let a = c.apply(limit, 35_209 * MS_, 1, 1, 1 << 31, 2_000 * MS_);
    assert!(a.grant <= a.remaining, "{a:?}");
    let a = c.apply(limit, 35_209 * MS_, 2, 1, 1 << 31, 2_000 * MS_);
    assert!(a.grant <= a.remaining, "{a:?}");
}

#[test]
fn an_isolate_first_to_report_after_a_quota_ran_out_gets_its_share_not_the_fleets() {
    // Twenty isolates spend a fixed window's quota, then fall quiet (they report only what
    // they admit); the next window's first report comes 4 s later, past `node_ttl`.
    let l = Limit::new(Algorithm::FixedWindow, 1000, 10 * SECOND, None).unwrap();
    let ttl = 2 * SECOND;
    let start = NOW / (10 * SECOND) * (10 * SECOND);
    let mut c = Counter::new(l);
    for node in 1..=20 {
        c.report(l, start + 6 * SECOND + node * MS_, node, 1, 49, ttl);
    }
    let next = start + 10 * SECOND;
    let isolate = c.report(l, next, 1, 2, 1, ttl);
    assert!(isolate.grant > 0 && isolate.grant <= 100, "about a twentieth of 1,000: {isolate:?}");
}

/// A batch closed once answered with counters it could not apply: a repeat of it is refused as
/// older, and the node's next batch is taken.
#[test]
fn a_closed_batch_is_refused_again_and_the_next_one_taken() {
    let mut r = Registry::default();
    assert!(r.heard(NOW, 7, (4, false, NOW), SECOND).is_ok());
    assert!(r.heard(NOW, 7, (4, false, NOW), SECOND).is_ok(), "a repeat of the latest is answered again");
    r.close(7, 3);
    assert!(r.heard(NOW, 7, (4, false, NOW), SECOND).is_ok(), "closing another seq closes nothing");
    r.close(7, 4);
    assert_eq!(r.heard(NOW, 7, (4, false, NOW), SECOND), Err(SyncError::Stale { last: 4 }));
    assert!(r.heard(NOW, 8, (4, false, NOW), SECOND).is_ok(), "another node's seq 4 is its own");
    assert!(r.heard(NOW, 7, (5, false, NOW), SECOND).is_ok());
    assert!(r.heard(NOW, 7, (5, false, NOW), SECOND).is_ok(), "the next is open");
}

/// Past the asks it may remember, a registry forgets the earliest by the time each was made
/// and refuses their nodes' asks made by then: a node whose clock runs 20 s ahead does not
/// take every other node's asks with it.
#[test]
fn asks_forgotten_for_room_raise_their_own_nodes_floor_only() {
    let mut r = Registry::default();
    let ask = |r: &mut Registry, node: u64, number: u64, sent: Nanos| r.heard(NOW, node, (number, true, sent), SECOND);
    assert!(ask(&mut r, 1, 1, NOW + 20 * SECOND).is_ok(), "a clock 20 s ahead");
    for i in 0..crate::sync::MAX_ASKS_REMEMBERED as u64 {
        assert!(ask(&mut r, 2, i, NOW + i).is_ok());
    }
    // Node 2's earliest ask was forgotten, and is refused; so are its asks made no later.
    assert_eq!(ask(&mut r, 2, 0, NOW), Err(SyncError::Repeated { ask: 0 }));
    assert_eq!(ask(&mut r, 2, 1_000_000, NOW), Err(SyncError::Repeated { ask: 1_000_000 }));
    // The others are not held back by it, nor by node 1's clock.
    assert!(ask(&mut r, 3, 1, NOW + SECOND).is_ok());
    assert!(ask(&mut r, 2, 1_000_001, NOW + SECOND).is_ok());
    assert_eq!(ask(&mut r, 1, 1, NOW + 20 * SECOND), Err(SyncError::Repeated { ask: 1 }), "remembered");
}
