//! Redis in memory, for the unit tests of the sync endpoint and the rate limit service: a
//! clock the test sets, a key whose next write fails, an outage switch and an operation count.

#![allow(clippy::unwrap_used)]

use crate::{Cas, Kv, Presence, Unheard, NODE_TTL};
use ratewall_core::sync::{Registry, SyncError, CUT_OFF_SILENCE, MAX_REQUEST_SKEW};
use ratewall_core::Nanos;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// A stream's entries: id (1, 2, ...) and payload.
pub(crate) type Stream = Vec<(u64, Vec<u8>)>;

#[derive(Default)]
pub(crate) struct FakeKv {
    pub values: Mutex<HashMap<String, Vec<u8>>>,
    pub registry: Mutex<Registry>,
    pub now: AtomicU64,
    pub fail_next_write_of: Mutex<Option<String>>,
    pub down: AtomicBool,
    pub ops: AtomicUsize,
    /// Streams: entries with their ids (1, 2, ...).
    pub streams: Mutex<HashMap<String, Stream>>,
    /// The rate limit service's processes: node → last heard.
    pub present: Mutex<HashMap<u64, Nanos>>,
    /// The counters too low for an initial share, and their version.
    pub low: Mutex<(u64, HashMap<String, Nanos>)>,
    /// How long a compare-and-set's reply takes after its write (ms): Redis wrote in time,
    /// its answer came late.
    pub cas_reply_delay_ms: AtomicU64,
}

impl FakeKv {
    fn op(&self) -> Result<Nanos, String> {
        self.ops.fetch_add(1, Ordering::Relaxed);
        if self.down.load(Ordering::Relaxed) {
            return Err("down".into());
        }
        Ok(self.now.load(Ordering::Relaxed))
    }
}

impl Kv for FakeKv {
    async fn read(&self, key: &str) -> Result<(Option<Vec<u8>>, Nanos), String> {
        let now = self.op()?;
        Ok((self.values.lock().unwrap().get(key).cloned(), now))
    }
    async fn cas(
        &self,
        key: &str,
        old: Option<&[u8]>,
        new: &[u8],
        _ttl_ms: u64,
        deadline_ms: u64,
    ) -> Result<Cas, String> {
        let now = self.op()?;
        if deadline_ms > 0 && now / 1_000_000 > deadline_ms {
            return Err("past its deadline".into());
        }
        if self.fail_next_write_of.lock().unwrap().take_if(|k| k == key).is_some() {
            return Err("connection reset".into());
        }
        {
            let mut values = self.values.lock().unwrap();
            if values.get(key).map(Vec::as_slice) != old {
                return Ok(Cas::Changed(values.get(key).cloned(), now));
            }
            values.insert(key.to_owned(), new.to_vec());
        }
        let delay = self.cas_reply_delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
        }
        Ok(Cas::Written(now))
    }
    async fn heard(&self, node: u64, seq: u64, batch: bool, sent: Nanos) -> Result<(u32, Vec<u64>), Unheard> {
        let now = self.now.load(Ordering::Relaxed);
        if sent.abs_diff(now) > MAX_REQUEST_SKEW {
            return Err(Unheard::Skewed(now));
        }
        let mut registry = self.registry.lock().unwrap();
        let nodes = registry.heard(now, node, (seq, !batch, sent), NODE_TTL).map_err(|e| match e {
            SyncError::Stale { last } => Unheard::Older(last),
            SyncError::Repeated { .. } => Unheard::Repeated,
            e => Unheard::Failed(e.to_string()),
        })?;
        Ok((nodes, registry.heard_within(now, CUT_OFF_SILENCE)))
    }
    async fn close(&self, node: u64, seq: u64) -> Result<(), String> {
        self.op()?;
        self.registry.lock().unwrap().close(node, seq);
        Ok(())
    }
    async fn present(&self, node: u64, low: &[(String, Nanos)], seen: &str) -> Result<Presence, String> {
        let now = self.op()?;
        let mut present = self.present.lock().unwrap();
        present.insert(node, now);
        present.retain(|_, at| now.saturating_sub(*at) < NODE_TTL);
        let (version, set) = &mut *self.low.lock().unwrap();
        for (key, until) in low {
            if set.get(key).is_none_or(|t| t < until) {
                set.insert(key.clone(), *until);
                *version += 1;
            }
        }
        set.retain(|_, until| *until > now);
        let low = (version.to_string() != seen)
            .then(|| (version.to_string(), set.iter().map(|(k, t)| (k.clone(), *t)).collect()));
        Ok(Presence { processes: u32::try_from(present.len()).unwrap(), now, low })
    }
    async fn ping(&self) -> Result<(), String> {
        self.op().map(|_| ())
    }
    async fn append(&self, key: &str, payload: &[u8], len: u64, _ttl_ms: u64) -> Result<(), String> {
        self.op()?;
        let mut streams = self.streams.lock().unwrap();
        let s = streams.entry(key.to_owned()).or_default();
        let id = s.last().map_or(1, |e| e.0 + 1);
        s.push((id, payload.to_vec()));
        let excess = s.len().saturating_sub(len as usize);
        s.drain(..excess);
        Ok(())
    }
    async fn read_after(&self, key: &str, after: Option<&str>, count: usize) -> Result<(String, Vec<Vec<u8>>), String> {
        self.op()?;
        let streams = self.streams.lock().unwrap();
        let s = streams.get(key).map(Vec::as_slice).unwrap_or_default();
        let Some(after) = after else { return Ok((s.last().map_or(0, |e| e.0).to_string(), Vec::new())) };
        let from: u64 = after.parse().map_err(|_| "bad id")?;
        let read: Vec<_> = s.iter().filter(|e| e.0 > from).take(count).collect();
        let last = read.last().map_or(from, |e| e.0);
        Ok((last.to_string(), read.into_iter().map(|e| e.1.clone()).collect()))
    }
}
