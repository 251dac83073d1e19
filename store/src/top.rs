//! The fleet's top offenders and traffic as this store process heard them: each batch's
//! optional top section merged per rule into bounded time buckets (the last minute, the last
//! hour, a per-second series over 15 minutes), and the nodes heard from.
//!
//! Memory is bounded whatever the traffic: at most [`MAX_RULES`] rules, each with a fixed
//! number of buckets holding a summary of at most [`KEPT`] keys
//! ([`ratewall_core::topk::windows`]), and at most [`MAX_NODES`] nodes.

use ratewall_core::sync::TopSection;
use ratewall_core::topk::windows::Windows;
pub use ratewall_core::topk::windows::{Window, SERIES};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Most rules tracked (past it, rules first heard later are not).
pub const MAX_RULES: usize = 256;
/// Most nodes tracked (the longest unheard is forgotten first).
pub const MAX_NODES: usize = 10_000;
/// Nodes unheard this long are forgotten.
pub const NODE_TTL: Duration = Duration::from_secs(600);
/// Keys a bucket's summary keeps: four times a proxy's, since a bucket merges the whole
/// fleet's batches and its error bound is a share of everything they denied.
pub const KEPT: usize = 4 * ratewall_core::topk::CAPACITY;

/// A node as heard from.
#[derive(Clone, Debug)]
struct Node {
    last_seen: Instant,
    /// Batches per second, a moving average.
    rate: f64,
    rtt: Duration,
    degraded: bool,
    /// The last seq whose section was counted (a retried batch is not counted again).
    counted_seq: u64,
}

#[derive(Debug)]
struct Inner {
    /// The rules' buckets (and the latest unix second seen: time that goes backwards is
    /// clamped to it).
    windows: Windows,
    nodes: HashMap<u64, Node>,
}

/// The process's view of the fleet.
#[derive(Debug)]
pub struct Top {
    inner: Mutex<Inner>,
}

impl Default for Top {
    fn default() -> Self {
        Top { inner: Mutex::new(Inner { windows: Windows::new(MAX_RULES, KEPT), nodes: HashMap::new() }) }
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl Top {
    /// A batch from `node` answered (`ok`: 200) after `rtt`, with its top section if any.
    pub fn heard(&self, node: u64, seq: u64, ok: bool, rtt: Duration, section: Option<&TopSection>) {
        self.heard_at(unix_now(), Instant::now(), node, seq, ok, rtt, section);
    }

    /// [`Top::heard`] at a given time (tests).
    #[allow(clippy::too_many_arguments)]
    pub fn heard_at(
        &self,
        unix: u64,
        now: Instant,
        node: u64,
        seq: u64,
        ok: bool,
        rtt: Duration,
        section: Option<&TopSection>,
    ) {
        let Ok(mut inner) = self.inner.lock() else { return };
        let inner = &mut *inner;
        inner.windows.clock(unix);
        if inner.nodes.len() >= MAX_NODES && !inner.nodes.contains_key(&node) {
            inner.nodes.retain(|_, n| now.saturating_duration_since(n.last_seen) < NODE_TTL);
            if inner.nodes.len() >= MAX_NODES {
                if let Some(oldest) = inner.nodes.iter().min_by_key(|(_, n)| n.last_seen).map(|(k, _)| *k) {
                    inner.nodes.remove(&oldest);
                }
            }
        }
        let n =
            inner.nodes.entry(node).or_insert(Node { last_seen: now, rate: 0.0, rtt, degraded: false, counted_seq: 0 });
        let gap = now.saturating_duration_since(n.last_seen).as_secs_f64();
        // An exponentially weighted rate over about 5 s.
        if gap > 0.0 {
            let w = (-gap / 5.0).exp();
            n.rate = n.rate * w + (1.0 - w) / gap;
        }
        (n.last_seen, n.rtt, n.degraded) = (now, rtt, !ok);
        let Some(section) = section.filter(|_| ok && seq > n.counted_seq) else { return };
        n.counted_seq = seq;
        inner.windows.add(unix, section, &[]);
    }

    /// `GET /v1/top`: per rule (or only `rule`), its counts and top denied keys over the
    /// window.
    pub fn top(&self, rule: Option<&str>, window: Window) -> Value {
        self.top_at(unix_now(), rule, window)
    }

    /// [`Top::top`] at a given unix second (tests).
    pub fn top_at(&self, unix: u64, rule: Option<&str>, window: Window) -> Value {
        let Ok(inner) = self.inner.lock() else { return json!({"window_s": 0, "rules": []}) };
        inner.windows.top(unix, rule, window)
    }

    /// `GET /v1/series`: per rule, per-second counts over the last 15 minutes, oldest first.
    pub fn series(&self, rule: Option<&str>) -> Value {
        self.series_at(unix_now(), rule)
    }

    /// [`Top::series`] at a given unix second (tests).
    pub fn series_at(&self, unix: u64, rule: Option<&str>) -> Value {
        let Ok(inner) = self.inner.lock() else { return json!({"step_s": 1, "end_unix_s": unix, "rules": []}) };
        inner.windows.series(unix, rule)
    }

    /// `GET /v1/fleet`'s nodes: id, seconds since last heard, batches per second, the last
    /// batch's time in this store, and whether its last batch failed here.
    pub fn fleet(&self) -> Vec<Value> {
        let Ok(inner) = self.inner.lock() else { return Vec::new() };
        let now = Instant::now();
        let mut nodes: Vec<(&u64, &Node)> =
            inner.nodes.iter().filter(|(_, n)| now.saturating_duration_since(n.last_seen) < NODE_TTL).collect();
        nodes.sort_by_key(|(id, _)| **id);
        nodes
            .into_iter()
            .map(|(id, n)| {
                let seen = now.saturating_duration_since(n.last_seen).as_secs_f64();
                json!({"id": format!("{id:016x}"), "last_seen_s": (seen * 10.0).round() / 10.0,
                       "batches_per_s": (n.rate * 10.0).round() / 10.0,
                       "rtt_ms": (n.rtt.as_secs_f64() * 10_000.0).round() / 10.0, "degraded": n.degraded})
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use ratewall_core::sync::RuleTop;
    use ratewall_core::topk::{node_bit, Summary};

    fn section(rule: &str, keys: &[(&str, u64)], node: u64) -> TopSection {
        let mut top = Summary::default();
        for (k, n) in keys {
            top.add(k.as_bytes(), *n, 1, node_bit(node));
        }
        let denied = keys.iter().map(|(_, n)| n).sum();
        TopSection { rules: vec![RuleTop { rule: rule.into(), allowed: 10, denied, shadow_denied: 0, top }] }
    }

    #[test]
    fn the_fleets_sections_merge_per_rule_over_the_window() {
        let top = Top::default();
        let now = Instant::now();
        let t = 1_800_000_000;
        for node in 1..=3u64 {
            let s = section("api-key", &[("api_key=#00000001", 30), ("ip=203.0.113.7", node)], node);
            top.heard_at(t, now, node, 1, true, Duration::from_millis(1), Some(&s));
        }
        // A retried batch (the same seq) is not counted again.
        let again = section("api-key", &[("api_key=#00000001", 30)], 1);
        top.heard_at(t, now, 1, 1, true, Duration::from_millis(1), Some(&again));
        let v = top.top_at(t, None, Window::Minute);
        assert_eq!(v["window_s"], 60);
        let r = &v["rules"][0];
        assert_eq!(
            (r["rule"].clone(), r["allowed"].clone(), r["denied"].clone()),
            (json!("api-key"), json!(30), json!(96))
        );
        assert_eq!(r["top"][0], json!({"key": "api_key=#00000001", "denied": 90, "allowed": 3, "nodes": 3}));
        assert_eq!(r["top"][1]["denied"], 6);
        // A minute later the minute is empty; the hour still has it.
        let later = top.top_at(t + 61, Some("api-key"), Window::Minute);
        assert_eq!(later["rules"][0]["denied"], 0);
        assert_eq!(top.top_at(t + 61, Some("api-key"), Window::Hour)["rules"][0]["denied"], 96);
        assert_eq!(top.top_at(t, Some("nope"), Window::Minute)["rules"], json!([]));
        let series = top.series_at(t + 1, None);
        let denied = series["rules"][0]["denied"].as_array().unwrap();
        assert_eq!(denied.len(), SERIES);
        assert_eq!((denied[SERIES - 2].clone(), denied[SERIES - 1].clone()), (json!(96), json!(0)));
        assert_eq!(top.fleet().len(), 3);
    }

    #[test]
    fn memory_stays_bounded_whatever_the_rules_and_nodes() {
        let top = Top::default();
        let now = Instant::now();
        for i in 0..(MAX_RULES as u64 + 50) {
            let s = section(&format!("rule-{i}"), &[("k", 1)], i);
            top.heard_at(1_800_000_000, now, i, 1, true, Duration::ZERO, Some(&s));
        }
        assert_eq!(top.top_at(1_800_000_000, None, Window::Hour)["rules"].as_array().unwrap().len(), MAX_RULES);
    }
}
