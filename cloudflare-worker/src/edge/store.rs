//! `POST /v1/sync` without the runtime: the checks a batch passes before any object sees it,
//! the calls it makes, and the signed answer assembled from the objects' replies
//! (docs/sync-protocol.md). The glue only makes the calls.

use super::{decode_applied, decode_heard, decode_out_for, hex, unhex, Call, NOT_APPLIED};
use ratewall_core::algo::Nanos;
use ratewall_core::sync::{reason, sign, Grant, Out, SyncError, SyncRequest, SyncResponse};

/// A batch may name at most this many counters: each is one Durable Object call, and a
/// Worker invocation has a bounded number of subrequests. Filters split larger batches.
pub const MAX_SYNC_DELTAS: usize = 500;
/// Fewest characters of a sync secret (a filter's `sync.secret` and ratewall-store's alike).
pub const MIN_SECRET: usize = 16;
/// Largest sync body accepted.
pub const MAX_SYNC_BODY: usize = 1 << 20;

/// A refused or failed sync call: the status and the message the node gets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// HTTP status.
    pub status: u16,
    /// Plain-text reason (never the secret).
    pub message: String,
}

fn refuse(status: u16, message: impl Into<String>) -> Refusal {
    Refusal { status, message: message.into() }
}

/// Checks a sync call before any object sees it: the store is configured, the body is
/// within bounds, signed with the secret (`tag`: the `x-ratewall-signature` header), of this
/// protocol version (415), well formed (400), names at most [`MAX_SYNC_DELTAS`] counters,
/// and was made within `MAX_REQUEST_SKEW` of `now`, the isolate's clock (422: a captured
/// request replayed later, or a node whose clock is off).
pub fn check(secret: &str, tag: Option<&str>, body: &[u8], now: Nanos) -> Result<SyncRequest, Refusal> {
    if secret.is_empty() {
        return Err(refuse(
            503,
            "sync is disabled: set RATEWALL_SYNC_SECRET (wrangler secret put RATEWALL_SYNC_SECRET)",
        ));
    }
    if secret.chars().count() < MIN_SECRET {
        // As ratewall-store refuses to start on one, and a filter's `sync.secret` is refused.
        return Err(refuse(503, "sync is disabled: RATEWALL_SYNC_SECRET is shorter than 16 characters"));
    }
    if body.len() > MAX_SYNC_BODY {
        return Err(refuse(413, reason::too_large(MAX_SYNC_BODY)));
    }
    let tag = tag.and_then(|t| unhex(t.trim().as_bytes())).unwrap_or_default();
    let batch = SyncRequest::verified(secret.as_bytes(), body, &tag, None).map_err(|e| match e {
        SyncError::Unauthorized => refuse(401, reason::UNSIGNED),
        SyncError::Malformed(d) => refuse(400, reason::malformed(d)),
        e => refuse(e.status(), e.to_string()),
    })?;
    if batch.deltas.len() > MAX_SYNC_DELTAS {
        return Err(refuse(413, reason::too_many(MAX_SYNC_DELTAS)));
    }
    batch.check_time(now).map_err(|e| refuse(e.status(), e.to_string()))?;
    Ok(batch)
}

/// [`check`] under the secret in force or, while it is rotated, the one going out (`previous`,
/// empty when unset, docs/operations.md): the batch and the secret it was signed with, which
/// its answer is signed with too. A previous secret too short to be one is said (503) where it
/// would be tried, as ratewall-store refuses to start on it, rather than dropped in silence
/// (its batches would get 401 with no word why).
pub fn check_rotating<'s>(
    secret: &'s str,
    previous: &'s str,
    tag: Option<&str>,
    body: &[u8],
    now: Nanos,
) -> Result<(&'s str, SyncRequest), Refusal> {
    match check(secret, tag, body, now) {
        Ok(b) => Ok((secret, b)),
        Err(r) if r.status == 401 && !previous.is_empty() => {
            if previous.chars().count() < MIN_SECRET {
                return Err(refuse(
                    503,
                    "sync is disabled: RATEWALL_SYNC_SECRET_PREVIOUS is shorter than 16 characters",
                ));
            }
            check(previous, tag, body, now).map(|b| (previous, b)).map_err(|_| r)
        }
        Err(r) => Err(r),
    }
}

/// The refusal of a batch whose declared length (`content-length`) is over the bound, before
/// its body is read: 413, as for a body read whole (or sync's own 503 when disabled). Read
/// first, a body declared at 100 GB held the call until the runtime gave up on it.
pub fn declared_too_large(secret: &str, content_length: Option<&str>) -> Option<Refusal> {
    let declared: u64 = content_length?.trim().parse().ok()?;
    if declared <= MAX_SYNC_BODY as u64 {
        return None;
    }
    let disabled = check(secret, None, &[], 0).err().filter(|r| r.status == 503);
    Some(disabled.unwrap_or_else(|| refuse(413, reason::too_large(MAX_SYNC_BODY))))
}

/// Whether `batch` is an ask one of whose counters could not be read ([`NOT_APPLIED`]): it
/// fails whole.
fn unreadable_ask(batch: &SyncRequest, replies: &[Option<String>]) -> bool {
    batch.ask && replies.iter().any(|r| r.as_deref() == Some(NOT_APPLIED))
}

/// The registry call a batch or ask makes (a batch's first: an older `seq` is refused before
/// any counter sees it; an ask's alongside its counters).
pub fn heard_call(batch: &SyncRequest) -> Call {
    Call::Heard { node: batch.node, seq: batch.seq, ask: batch.ask, sent: batch.sent }
}

/// The registry call that closes `batch` when its answer names counters it could not apply
/// ([`Call::Close`]): a copy of it, applied once such a counter could be read, would count
/// the units its node sends again under a later `seq`.
pub fn close_call(batch: &SyncRequest, replies: &[Option<String>]) -> Option<Call> {
    (!batch.ask && replies.iter().any(|r| r.as_deref() == Some(NOT_APPLIED)))
        .then_some(Call::Close { node: batch.node, seq: batch.seq })
}

/// The counter calls of a batch or ask: (counter key, call), one per delta.
pub fn counter_calls(batch: &SyncRequest) -> Vec<(&[u8], Call)> {
    batch
        .deltas
        .iter()
        .map(|d| {
            let call = if batch.ask {
                Call::Ask { limit: d.limit, node: batch.node, ask: batch.seq, units: d.units }
            } else {
                Call::Apply { limit: d.limit, node: batch.node, seq: batch.seq, units: d.units }
            };
            (d.key.as_slice(), call)
        })
        .collect()
}

/// What the registry's answer means for a batch or ask (`answer`: its body, `None` when the
/// call failed): the nodes heard from, or the refusal — 409 for a batch `seq` older than the
/// node's latest or an ask already answered (a replay), 503 when the registry could not say
/// (a batch is retried with the same `seq`; an ask's request is decided on what its node
/// holds).
pub fn registry_verdict(batch: &SyncRequest, answer: Option<&str>) -> Result<Option<u32>, Refusal> {
    match answer.and_then(decode_heard) {
        Some(Ok(n)) => Ok(Some(n)),
        Some(Err(SyncError::Stale { last })) => Err(refuse(409, reason::older(batch.seq, last))),
        Some(Err(e @ SyncError::Repeated { .. })) => Err(refuse(409, e.to_string())),
        _ => Err(refuse(503, reason::REGISTRY_FAILED)),
    }
}

/// The calls that give back what an ask's counters took when the ask fails whole (one of its
/// counters could not be read): the units each counter that answered took for it, as of
/// `now`. A request whose ask failed is decided as a store failure, and those units would
/// otherwise be counted for no request.
pub fn ask_refunds(batch: &SyncRequest, replies: &[Option<String>], now: Nanos) -> Vec<(Vec<u8>, Call)> {
    if !unreadable_ask(batch, replies) {
        return Vec::new();
    }
    batch
        .deltas
        .iter()
        .zip(replies)
        .filter(|(_, r)| r.as_deref().and_then(decode_applied).is_some_and(|a| a.counted))
        .map(|(d, _)| (d.key.clone(), Call::Refund { limit: d.limit, cost: d.units, at: now }))
        .collect()
}

/// The signed answer (body, signature header) from the counters' replies (`None`: that
/// call failed), in delta order. Any failed counter fails the whole call with 503: counters
/// apply each (node, seq) once, so the node's retry of the whole batch never counts twice.
/// A counter whose object could not read it ([`NOT_APPLIED`]: certain to have counted
/// nothing) is named in a batch's failed section instead, and the rest answered.
/// `nodes` is the registry's count; only if it failed (an ask), the most any counter saw.
/// A batch's answer also names the counters this isolate's sync calls found out of quota
/// (`out`; see [`Out`]).
pub fn answer(
    secret: &str,
    batch: &SyncRequest,
    replies: &[Option<String>],
    nodes: Option<u32>,
    now: Nanos,
    out: &mut Out,
) -> Result<(Vec<u8>, String), Refusal> {
    if unreadable_ask(batch, replies) {
        // The units its other counters took go back ([`ask_refunds`]).
        return Err(refuse(503, reason::UNREADABLE_ASK));
    }
    let mut grants = Vec::with_capacity(replies.len());
    let mut failed = Vec::new();
    let mut per_counter = 1;
    for (i, (d, reply)) in batch.deltas.iter().zip(replies).enumerate() {
        if !batch.ask && reply.as_deref() == Some(NOT_APPLIED) {
            failed.push(u32::try_from(i).unwrap_or(u32::MAX));
            grants.push(Grant::unapplied(&d.key));
            continue;
        }
        let Some(a) = reply.as_deref().and_then(decode_applied) else {
            return Err(refuse(503, "a counter object failed; retry the batch with the same seq"));
        };
        per_counter = per_counter.max(a.nodes);
        grants.push(Grant::from_applied(&d.key, &a));
    }
    if grants.len() != batch.deltas.len() {
        return Err(refuse(503, "a counter object did not answer; retry the batch with the same seq"));
    }
    for (d, reply) in batch.deltas.iter().zip(replies).filter(|(_, r)| r.as_deref() != Some(NOT_APPLIED)) {
        out.note(&d.key, reply.as_deref().and_then(decode_out_for), now);
    }
    let mut resp = SyncResponse { seq: batch.seq, now, nodes: nodes.unwrap_or(per_counter), grants, failed };
    out.name(now, batch, &mut resp);
    let body = resp.encode();
    let tag = hex(&sign(secret.as_bytes(), &body));
    Ok((body, tag))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edge::object::Object;
    use ratewall_core::algo::{Algorithm, Limit};
    use ratewall_core::sync::{verify, Delta};
    use ratewall_core::SECOND;

    const SECRET: &str = "0123456789abcdef";

    #[test]
    fn a_batch_declared_over_the_bound_is_refused_before_its_body_is_read() {
        let over = (MAX_SYNC_BODY + 1).to_string();
        assert_eq!(declared_too_large(SECRET, Some(&over)).map(|r| r.status), Some(413));
        assert_eq!(declared_too_large(SECRET, Some("99999999999999999999999")), None, "unreadable: left to the body");
        assert_eq!(declared_too_large(SECRET, Some(&MAX_SYNC_BODY.to_string())), None);
        assert_eq!(declared_too_large(SECRET, None), None);
        assert_eq!(declared_too_large("", Some(&over)).map(|r| r.status), Some(503), "sync disabled says so first");
    }
    const T: Nanos = 1_700_000_000 * SECOND;

    fn batch(seq: u64, ask: bool) -> SyncRequest {
        let limit = Limit::new(Algorithm::SlidingWindow, 100, 60 * SECOND, None).unwrap();
        SyncRequest { node: 9, seq, sent: T, ask, deltas: vec![Delta { key: b"k1".to_vec(), limit, units: 5 }] }
    }

    fn signed(b: &SyncRequest) -> (Vec<u8>, String) {
        let body = b.encode();
        let tag = hex(&sign(SECRET.as_bytes(), &body));
        (body, tag)
    }

    #[test]
    fn while_the_secret_is_rotated_a_batch_signed_with_the_one_going_out_is_taken_with_it() {
        let (body, tag) = signed(&batch(1, false));
        let now = "the secret now in force";
        let (used, b) = check_rotating(now, SECRET, Some(&tag), &body, T).unwrap();
        assert_eq!((used, b.seq), (SECRET, 1));
        assert_eq!(check_rotating(SECRET, "", Some(&tag), &body, T).unwrap().0, SECRET);
        assert_eq!(check_rotating(now, "", Some(&tag), &body, T).unwrap_err().status, 401, "none set");
        let r = check_rotating(now, "another one going out", Some(&tag), &body, T).unwrap_err();
        assert_eq!(r.status, 401, "signed with neither");
        let r = check_rotating(now, "tiny-pw", Some(&tag), &body, T).unwrap_err();
        assert_eq!(r.status, 503, "a previous secret too short is said: {}", r.message);
        assert!(r.message.contains("RATEWALL_SYNC_SECRET_PREVIOUS") && !r.message.contains("tiny-pw"));
    }

    #[test]
    fn a_signed_batch_passes_and_everything_else_is_refused_with_its_status() {
        let (body, tag) = signed(&batch(1, false));
        assert_eq!(check(SECRET, Some(&tag), &body, T).unwrap().seq, 1);
        assert_eq!(check(SECRET, Some(&format!(" {tag} ")), &body, T).map(|b| b.seq), Ok(1), "whitespace is trimmed");
        assert_eq!(check("", Some(&tag), &body, T).unwrap_err().status, 503);
        let short = "s3cr3t";
        let r = check(short, Some(&hex(&sign(short.as_bytes(), &body))), &body, T).unwrap_err();
        assert_eq!(r.status, 503, "a secret under 16 characters is none: {}", r.message);
        assert!(!r.message.contains(short));
        assert_eq!(check(SECRET, None, &body, T).unwrap_err().status, 401);
        assert_eq!(check(SECRET, Some("zz"), &body, T).unwrap_err().status, 401);
        assert_eq!(check("another secret!!", Some(&tag), &body, T).unwrap_err().status, 401);
        // A refusal says what is wrong with the batch, not with a counter's state.
        let (mut odd, _) = signed(&batch(1, false));
        if let Some(kind) = odd.get_mut(1) {
            *kind = 9;
        }
        let r = check(SECRET, Some(&hex(&sign(SECRET.as_bytes(), &odd))), &odd, T).unwrap_err();
        assert_eq!((r.status, r.message.as_str()), (400, "malformed batch: invalid message kind"));
        let garbled = b"\x02\x09nonsense".to_vec();
        let gtag = hex(&sign(SECRET.as_bytes(), &garbled));
        let r = check(SECRET, Some(&gtag), &garbled, T).unwrap_err();
        assert_eq!(r.status, 400);
        assert!(r.message.starts_with("malformed batch"), "{}", r.message);
        for other in [&b"hello"[..], b"{\"x\":1}"] {
            let otag = hex(&sign(SECRET.as_bytes(), other));
            let r = check(SECRET, Some(&otag), other, T).unwrap_err();
            assert_eq!(r.status, 400, "a signed body that is no batch: {}", r.message);
        }
        let big = vec![0u8; MAX_SYNC_BODY + 1];
        assert_eq!(check(SECRET, Some(&tag), &big, T).unwrap_err().status, 413);
        let mut many = batch(1, false);
        let d = many.deltas[0].clone();
        many.deltas = (0..=MAX_SYNC_DELTAS).map(|i| Delta { key: format!("k{i}").into_bytes(), ..d.clone() }).collect();
        let (body, tag) = signed(&many);
        assert_eq!(check(SECRET, Some(&tag), &body, T).unwrap_err().status, 413);
    }

    #[test]
    fn a_request_too_far_from_the_isolates_clock_or_of_the_old_version_is_refused_apart() {
        for ask in [false, true] {
            let (body, tag) = signed(&SyncRequest { sent: T - 26 * SECOND, ..batch(1, ask) });
            let r = check(SECRET, Some(&tag), &body, T).unwrap_err();
            assert_eq!(r.status, 422);
            assert!(r.message.contains("26.000 s behind the store's clock"), "{}", r.message);
            let (body, tag) = signed(&SyncRequest { sent: T + 25 * SECOND, ..batch(1, ask) });
            assert!(check(SECRET, Some(&tag), &body, T).is_ok(), "within the bound");
        }
        let mut v1 = batch(1, false).encode();
        v1[0] = 1;
        let tag = hex(&sign(SECRET.as_bytes(), &v1));
        let r = check(SECRET, Some(&tag), &v1, T).unwrap_err();
        assert_eq!(r.status, 415);
        assert!(r.message.contains("version 1 (requests without a time) is not spoken here"), "{}", r.message);
        // A concurrency delta (code 5) is malformed.
        let concurrent = Limit::new(Algorithm::Concurrent, 2, 60 * SECOND, None).unwrap();
        let mut b = batch(1, false);
        b.deltas[0].limit = concurrent;
        let (body, tag) = signed(&b);
        assert_eq!(check(SECRET, Some(&tag), &body, T).unwrap_err().status, 400);
    }

    #[test]
    fn a_batch_applies_and_an_ask_asks() {
        let b = batch(3, false);
        assert_eq!(heard_call(&b), Call::Heard { node: 9, seq: 3, ask: false, sent: b.sent });
        assert!(matches!(counter_calls(&b)[0], (b"k1", Call::Apply { node: 9, seq: 3, units: 5, .. })));
        let a = batch(4, true);
        assert!(matches!(counter_calls(&a)[0], (b"k1", Call::Ask { node: 9, ask: 4, units: 5, .. })));
    }

    #[test]
    fn the_registry_refuses_an_old_batch_and_a_repeated_ask() {
        let mut registry = Object::default();
        let heard = |o: &mut Object, b: &SyncRequest| o.handle(heard_call(b), T).map(|h| h.reply);
        let b5 = batch(5, false);
        assert_eq!(registry_verdict(&b5, heard(&mut registry, &b5).as_deref()), Ok(Some(1)));
        let b4 = batch(4, false);
        let r = registry_verdict(&b4, heard(&mut registry, &b4).as_deref()).unwrap_err();
        assert_eq!(r.status, 409);
        assert_eq!(registry_verdict(&b5, None).unwrap_err().status, 503, "a failed registry fails a batch");
        assert_eq!(registry_verdict(&batch(1, true), None).unwrap_err().status, 503, "and an ask");
        // Asks of the node numbered 1 and 2, then a copy of the first: a replay.
        let (a1, a2) = (batch(1, true), batch(2, true));
        assert_eq!(registry_verdict(&a1, heard(&mut registry, &a1).as_deref()), Ok(Some(1)));
        assert_eq!(registry_verdict(&a2, heard(&mut registry, &a2).as_deref()), Ok(Some(1)));
        let r = registry_verdict(&a1, heard(&mut registry, &a1).as_deref()).unwrap_err();
        assert_eq!(r.status, 409);
        assert!(r.message.contains("ask 1 of this node was already answered"), "{}", r.message);
    }

    #[test]
    fn the_answer_is_signed_and_any_failed_counter_fails_it() {
        let b = batch(2, false);
        let mut counter = Object::default();
        let (key, call) = counter_calls(&b).remove(0);
        assert_eq!(key, b"k1");
        counter.load(None, call.limit()).unwrap();
        let reply = counter.handle(call, T).map(|h| h.reply);
        let (body, tag) = answer(SECRET, &b, std::slice::from_ref(&reply), Some(3), T, &mut Out::default()).unwrap();
        assert!(verify(SECRET.as_bytes(), &body, &unhex(tag.as_bytes()).unwrap()));
        let resp = SyncResponse::decode(&body).unwrap();
        assert_eq!((resp.seq, resp.now, resp.nodes, resp.grants.len()), (2, T, 3, 1));
        assert_eq!(resp.grants[0].remaining, 95);
        assert_eq!(answer(SECRET, &b, &[None], Some(3), T, &mut Out::default()).unwrap_err().status, 503);
        assert_eq!(answer(SECRET, &b, &[Some("{}".into())], Some(3), T, &mut Out::default()).unwrap_err().status, 503);
        assert_eq!(
            answer(SECRET, &b, &[], Some(3), T, &mut Out::default()).unwrap_err().status,
            503,
            "a missing reply"
        );
        let (body, _) = answer(SECRET, &b, std::slice::from_ref(&reply), None, T, &mut Out::default()).unwrap();
        assert_eq!(SyncResponse::decode(&body).unwrap().nodes, 1, "without the registry: what the counters saw");
        // A counter its object could not read counted nothing: named failed, the rest answered.
        let two = SyncRequest {
            deltas: vec![b.deltas[0].clone(), Delta { key: b"k2".to_vec(), ..b.deltas[0].clone() }],
            ..b.clone()
        };
        let (body, _) =
            answer(SECRET, &two, &[reply.clone(), Some(NOT_APPLIED.into())], Some(3), T, &mut Out::default()).unwrap();
        let resp = SyncResponse::decode(&body).unwrap();
        assert_eq!(
            (resp.failed.as_slice(), resp.grants[0].remaining, resp.grants[1].grant),
            ([1u32].as_slice(), 95, 0)
        );
        // Such a batch is closed at the registry before it is answered: a copy of it, once the
        // counter could be read, would count the units the node sends again.
        let failed = [reply.clone(), Some(NOT_APPLIED.into())];
        let mut registry = Object::default();
        for c in [heard_call(&two), close_call(&two, &failed).unwrap()] {
            registry.handle(c, T).unwrap();
        }
        let again = registry.handle(heard_call(&two), T).unwrap();
        assert_eq!(decode_heard(&again.reply), Some(Err(ratewall_core::sync::SyncError::Stale { last: two.seq })));
        assert_eq!(close_call(&two, &[reply.clone(), reply.clone()]), None, "nothing failed: nothing to close");
        // An ask holds no acknowledged units: it fails whole, with ratewall-store's words, and
        // what its other counters took goes back.
        let ask = SyncRequest { ask: true, ..two };
        let mut first = Object::default();
        let (_, ask_call) = counter_calls(&ask).remove(0);
        first.load(None, ask_call.limit()).unwrap();
        let took = first.handle(ask_call, T).map(|h| h.reply);
        let replies = [took, Some(NOT_APPLIED.into())];
        let r = answer(SECRET, &ask, &replies, Some(3), T, &mut Out::default()).unwrap_err();
        assert_eq!((r.status, r.message.as_str()), (503, reason::UNREADABLE_ASK));
        let refunds = ask_refunds(&ask, &replies, T);
        assert_eq!(refunds.len(), 1);
        let (key, refund) = refunds.into_iter().next().unwrap();
        assert_eq!(key, b"k1");
        first.handle(refund, T).unwrap();
        let (_, peek) = counter_calls(&batch(3, false)).remove(0);
        let Call::Apply { limit, .. } = peek else { panic!() };
        let after = first.handle(Call::Apply { limit, node: 10, seq: 1, units: 0 }, T).map(|h| h.reply).unwrap();
        assert_eq!(decode_applied(&after).unwrap().remaining, 100, "nothing of the ask stays taken");
        assert!(ask_refunds(&b, &[None], T).is_empty(), "a batch is never refunded so");
    }

    #[test]
    fn a_batch_answer_names_the_counters_found_out_of_quota() {
        let mut out = Out::default();
        let mut counter = Object::default();
        let spend =
            SyncRequest { deltas: vec![Delta { units: 100, ..batch(1, false).deltas[0].clone() }], ..batch(1, false) };
        let (_, call) = counter_calls(&spend).remove(0);
        counter.load(None, call.limit()).unwrap();
        let reply = counter.handle(call, T).map(|h| h.reply);
        answer(SECRET, &spend, &[reply], Some(2), T, &mut out).unwrap();
        // Another node's heartbeat hears of it.
        let heartbeat = SyncRequest { node: 10, deltas: vec![], ..batch(1, false) };
        let (body, _) = answer(SECRET, &heartbeat, &[], Some(2), T + SECOND, &mut out).unwrap();
        let resp = SyncResponse::decode(&body).unwrap();
        assert_eq!(resp.grants.len(), 1, "{resp:?}");
        let g = &resp.grants[0];
        assert_eq!((g.key.as_slice(), g.remaining, g.grant, g.lease), (&b"k1"[..], 0, 0, 0));
        assert!(g.reset_after > 0);
    }
}
