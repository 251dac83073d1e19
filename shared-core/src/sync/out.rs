//! Counters a store found out of quota: named to every node with each batch answer.

#[cfg(doc)]
use super::counter::Counter;

use super::wire::Grant;
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

    /// Appends to a batch answer's `grants` (those of its deltas, keyed by `asked`) the
    /// counters out at `now` that the batch did not name; forgets the ones out no longer.
    pub fn name(&mut self, now: Nanos, asked: &[&[u8]], grants: &mut Vec<Grant>) {
        self.entries.retain(|(_, until)| *until > now);
        for (key, until) in &self.entries {
            if asked.contains(&key.as_slice()) {
                continue;
            }
            grants.push(Grant { key: key.clone(), remaining: 0, grant: 0, reset_after: until - now, lease: 0 });
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
        let mut grants = vec![];
        out.name(now, asked, &mut grants);
        assert!(grants.iter().all(|g| g.remaining == 0 && g.grant == 0 && g.lease == 0));
        grants.into_iter().map(|g| (g.key, g.reset_after)).collect()
    }

    #[test]
    fn counters_out_are_named_until_a_unit_is_free_again_and_not_to_the_batch_that_reported_them() {
        let mut out = Out::default();
        out.note(b"a", Some(500), 1_000);
        out.note(b"b", Some(100), 1_000);
        out.note(b"c", None, 1_000);
        assert_eq!(named(&mut out, 1_050, &[]), [(b"a".to_vec(), 450), (b"b".to_vec(), 50)]);
        assert_eq!(named(&mut out, 1_050, &[b"a"]), [(b"b".to_vec(), 50)], "a batch's own counters have their grants");
        assert_eq!(named(&mut out, 1_100, &[]), [(b"a".to_vec(), 400)], "b has a unit again");
        out.note(b"a", None, 1_200);
        assert!(named(&mut out, 1_200, &[]).is_empty(), "a is no longer out");
    }

    #[test]
    fn at_most_the_latest_max_out_are_named() {
        let mut out = Out::default();
        for i in 0..(MAX_OUT as u32 + 10) {
            out.note(&i.to_le_bytes(), Some(1_000), 0);
        }
        let names = named(&mut out, 1, &[]);
        assert_eq!(names.len(), MAX_OUT);
        assert_eq!(names[0].0, 10u32.to_le_bytes().to_vec(), "the oldest went first");
    }
}
