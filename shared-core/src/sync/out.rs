//! Counters a store found out of quota: named to every node with each batch answer.

#[cfg(doc)]
use super::counter::Counter;

use super::wire::{Grant, SyncRequest, SyncResponse};
use crate::algo::Nanos;
use alloc::vec::Vec;

/// Most counters a store names as out in one answer (the most recently found).
pub const MAX_OUT: usize = 32;

/// Counters a store has recently found with not one unit left, and until when (its clock).
///
/// Every batch answer names them after the grants of the batch's own deltas, as grants of 0
/// units with 0 remaining and `reset_after` the time until one unit is free again, leased
/// for 0. A node meeting such a counter with no grant of its own (for the first time, or in
/// a new window) denies rather than admit on an initial share or an overdraft the counter
/// no longer has: otherwise every node that meets a spent counter late in its window admits
/// its one overdraft unit on it (docs/sync-protocol.md, "Counters named out"). Nodes of an
/// earlier version read the grants of their own deltas only, and ignore the rest.
#[derive(Clone, Debug, Default)]
pub struct Out {
    /// (counter key, out until), oldest first.
    entries: Vec<(Vec<u8>, Nanos)>,
}

impl Out {
    /// Notes the counter `key` as a delta or ask at `now` left it: out for `out_for` (see
    /// [`Counter::out_for`]), or, `None`, not out.
    pub fn note(&mut self, key: &[u8], out_for: Option<Nanos>, now: Nanos) {
        self.entries.retain(|(k, _)| k != key);
        if let Some(after) = out_for {
            if self.entries.len() >= MAX_OUT {
                self.entries.remove(0);
            }
            self.entries.push((key.to_vec(), now.saturating_add(after)));
        }
    }

    /// Names, in the answer `resp` to the batch `req` (after the grants of its deltas), the
    /// counters out at `now` that the batch did not name, the latest found first, as many as
    /// fit in the longest answer a node accepts for that batch
    /// ([`SyncResponse::max_len`]): a node of an earlier version, which reads only its own
    /// grants, reads the answer still. Forgets the counters out no longer. An ask's answer
    /// names none.
    pub fn name(&mut self, now: Nanos, req: &SyncRequest, resp: &mut SyncResponse) {
        self.entries.retain(|(_, until)| *until > now);
        if req.ask {
            return;
        }
        let cap = SyncResponse::max_len(req.deltas.iter().map(|d| d.key.len()));
        // The answer so far, and 2 bytes for the count's varint growing.
        let mut room = cap.saturating_sub(resp.encode().len().saturating_add(2));
        for (key, until) in self.entries.iter().rev() {
            if req.deltas.iter().any(|d| d.key == *key) {
                continue;
            }
            // The key with its length, three one-byte zeros and the time until it is free.
            let size = key.len().saturating_add(3 + 3 + 10);
            if size > room {
                break;
            }
            room -= size;
            resp.grants.push(Grant { key: key.clone(), remaining: 0, grant: 0, reset_after: until - now, lease: 0 });
        }
    }

    /// Counters out now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    fn named(out: &mut Out, now: Nanos, asked: &[&[u8]]) -> Vec<(Vec<u8>, Nanos)> {
        let limit = crate::algo::Limit::new(crate::algo::Algorithm::FixedWindow, 10, 1_000, None).unwrap();
        let deltas = asked.iter().map(|k| super::super::Delta { key: k.to_vec(), limit, units: 1 }).collect();
        let req = SyncRequest { node: 1, seq: 1, sent: now, deltas, ask: false };
        let grants =
            asked.iter().map(|k| Grant { key: k.to_vec(), remaining: 5, grant: 1, reset_after: 9, lease: 9 }).collect();
        let mut resp = SyncResponse { seq: 1, now, nodes: 1, grants, failed: Vec::new() };
        out.name(now, &req, &mut resp);
        let cap = SyncResponse::max_len(req.deltas.iter().map(|d| d.key.len()));
        assert!(resp.encode().len() <= cap, "within what a node accepts");
        let extra = resp.grants.split_off(asked.len());
        assert!(extra.iter().all(|g| g.remaining == 0 && g.grant == 0 && g.lease == 0));
        extra.into_iter().map(|g| (g.key, g.reset_after)).collect()
    }

    #[test]
    fn counters_out_are_named_until_a_unit_is_free_again_and_not_to_the_batch_that_reported_them() {
        let mut out = Out::default();
        out.note(b"a", Some(500), 1_000);
        out.note(b"b", Some(100), 1_000);
        out.note(b"c", None, 1_000);
        assert_eq!(named(&mut out, 1_050, &[]), [(b"b".to_vec(), 50), (b"a".to_vec(), 450)], "the latest first");
        assert_eq!(named(&mut out, 1_050, &[b"a"]), [(b"b".to_vec(), 50)], "a batch's own counters have their grants");
        assert_eq!(named(&mut out, 1_100, &[]), [(b"a".to_vec(), 400)], "b has a unit again");
        out.note(b"a", None, 1_200);
        assert!(named(&mut out, 1_200, &[]).is_empty(), "a is no longer out");
    }

    #[test]
    fn at_most_the_latest_max_out_are_kept_and_as_many_named_as_fit() {
        let mut out = Out::default();
        for i in 0..(MAX_OUT as u32 + 10) {
            out.note(&i.to_le_bytes(), Some(1_000), 0);
        }
        assert_eq!(out.len(), MAX_OUT);
        // A heartbeat's answer may be 512 bytes: as many 4-byte keys as fit.
        let names = named(&mut out, 1, &[]);
        assert_eq!(names.len(), (512 - 12) / 20);
        assert_eq!(names[0].0, (MAX_OUT as u32 + 9).to_le_bytes().to_vec(), "the latest first");
        // A batch of long keys has room for more.
        let long: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; 200]).collect();
        let asked: Vec<&[u8]> = long.iter().map(|k| k.as_slice()).collect();
        assert_eq!(named(&mut out, 1, &asked).len(), MAX_OUT);
    }
}
