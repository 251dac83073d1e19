//! The fleet's top offenders and traffic as this store process heard them: each batch's
//! optional top section merged per rule into bounded time buckets (the last minute, the last
//! hour, a per-second series over 15 minutes), and the nodes heard from.
//!
//! Memory is bounded whatever the traffic: at most [`MAX_RULES`] rules, each with a fixed
//! number of buckets holding a summary of at most [`KEPT`] keys, and at most [`MAX_NODES`]
//! nodes.

use ratewall_core::sync::TopSection;
use ratewall_core::topk::{node_count, Summary};
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
/// Entries `top` lists at most.
pub const LISTED: usize = 20;
/// Seconds of the per-second series.
pub const SERIES: usize = 900;

/// A window's buckets: how long each is and how many there are.
const MINUTE: (u64, usize) = (5, 12);
const HOUR: (u64, usize) = (300, 12);

/// What one bucket of time counted.
#[derive(Clone, Debug, Default)]
struct Bucket {
    /// Its index (unix seconds / bucket length); 0: never used.
    at: u64,
    allowed: u64,
    denied: u64,
    shadow: u64,
    top: Option<Summary>,
}

impl Bucket {
    fn add(&mut self, at: u64, allowed: u64, denied: u64, shadow: u64, top: Option<&Summary>) {
        if self.at != at {
            *self = Bucket { at, ..Bucket::default() };
        }
        self.allowed = self.allowed.saturating_add(allowed);
        self.denied = self.denied.saturating_add(denied);
        self.shadow = self.shadow.saturating_add(shadow);
        if let Some(t) = top.filter(|t| !t.is_empty()) {
            self.top.get_or_insert_with(|| Summary::new(KEPT)).merge(t);
        }
    }
}

/// One rule's buckets.
#[derive(Debug)]
struct Rule {
    name: String,
    minute: Vec<Bucket>,
    hour: Vec<Bucket>,
    /// Per second: (unix second, allowed, denied, shadow).
    series: Vec<(u64, u64, u64, u64)>,
}

impl Rule {
    fn new(name: String) -> Rule {
        Rule {
            name,
            minute: vec![Bucket::default(); MINUTE.1],
            hour: vec![Bucket::default(); HOUR.1],
            series: vec![(0, 0, 0, 0); SERIES],
        }
    }
}

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

#[derive(Debug, Default)]
struct Inner {
    rules: Vec<Rule>,
    nodes: HashMap<u64, Node>,
    /// The latest unix second seen (time that goes backwards is clamped to it).
    now: u64,
}

/// The process's view of the fleet.
#[derive(Debug, Default)]
pub struct Top {
    inner: Mutex<Inner>,
}

/// Which window `top` answers for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// The last minute.
    Minute,
    /// The last hour.
    Hour,
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
        inner.now = inner.now.max(unix);
        let t = inner.now;
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
        for r in &section.rules {
            let i = match inner.rules.iter().position(|x| x.name == r.rule) {
                Some(i) => i,
                None if inner.rules.len() < MAX_RULES => {
                    inner.rules.push(Rule::new(r.rule.clone()));
                    inner.rules.len() - 1
                }
                None => continue,
            };
            let Some(rule) = inner.rules.get_mut(i) else { continue };
            for (buckets, (len, count)) in [(&mut rule.minute, MINUTE), (&mut rule.hour, HOUR)] {
                let at = t / len;
                if let Some(b) = buckets.get_mut((at % count as u64) as usize) {
                    b.add(at, r.allowed, r.denied, r.shadow_denied, Some(&r.top));
                }
            }
            if let Some(s) = rule.series.get_mut((t % SERIES as u64) as usize) {
                if s.0 != t {
                    *s = (t, 0, 0, 0);
                }
                s.1 = s.1.saturating_add(r.allowed);
                s.2 = s.2.saturating_add(r.denied);
                s.3 = s.3.saturating_add(r.shadow_denied);
            }
        }
    }

    /// `GET /v1/top`: per rule (or only `rule`), its counts and top denied keys over the
    /// window.
    pub fn top(&self, rule: Option<&str>, window: Window) -> Value {
        self.top_at(unix_now(), rule, window)
    }

    /// [`Top::top`] at a given unix second (tests).
    pub fn top_at(&self, unix: u64, rule: Option<&str>, window: Window) -> Value {
        let Ok(inner) = self.inner.lock() else { return json!({"window_s": 0, "rules": []}) };
        let t = unix.max(inner.now);
        let (len, count) = if window == Window::Minute { MINUTE } else { HOUR };
        let window_s = len * count as u64;
        let first = (t / len).saturating_sub(count as u64 - 1);
        let rules: Vec<Value> = inner
            .rules
            .iter()
            .filter(|r| rule.is_none_or(|n| n == r.name))
            .map(|r| {
                let buckets = if window == Window::Minute { &r.minute } else { &r.hour };
                let (mut allowed, mut denied, mut shadow, mut top) = (0u64, 0u64, 0u64, Summary::new(KEPT));
                for b in buckets.iter().filter(|b| b.at >= first && b.at <= t / len) {
                    allowed = allowed.saturating_add(b.allowed);
                    denied = denied.saturating_add(b.denied);
                    shadow = shadow.saturating_add(b.shadow);
                    if let Some(s) = &b.top {
                        top.merge(s);
                    }
                }
                let entries: Vec<Value> = top
                    .top(LISTED)
                    .into_iter()
                    .map(|e| {
                        json!({"key": String::from_utf8_lossy(&e.key), "denied": e.denied, "allowed": e.allowed,
                               "nodes": node_count(e.nodes)})
                    })
                    .collect();
                json!({"rule": r.name, "allowed": allowed, "denied": denied, "shadow_denied": shadow, "top": entries})
            })
            .collect();
        json!({"window_s": window_s, "rules": rules})
    }

    /// `GET /v1/series`: per rule, per-second counts over the last 15 minutes, oldest first.
    pub fn series(&self, rule: Option<&str>) -> Value {
        self.series_at(unix_now(), rule)
    }

    /// [`Top::series`] at a given unix second (tests).
    pub fn series_at(&self, unix: u64, rule: Option<&str>) -> Value {
        let Ok(inner) = self.inner.lock() else { return json!({"step_s": 1, "end_unix_s": unix, "rules": []}) };
        let end = unix.max(inner.now);
        let rules: Vec<Value> = inner
            .rules
            .iter()
            .filter(|r| rule.is_none_or(|n| n == r.name))
            .map(|r| {
                let (mut a, mut d, mut s) = (Vec::new(), Vec::new(), Vec::new());
                for sec in (end + 1).saturating_sub(SERIES as u64)..=end {
                    let e = r.series.get((sec % SERIES as u64) as usize).filter(|e| e.0 == sec);
                    let (x, y, z) = e.map_or((0, 0, 0), |e| (e.1, e.2, e.3));
                    a.push(x);
                    d.push(y);
                    s.push(z);
                }
                json!({"rule": r.name, "allowed": a, "denied": d, "shadow_denied": s})
            })
            .collect();
        json!({"step_s": 1, "end_unix_s": end, "rules": rules})
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
    use ratewall_core::topk::node_bit;

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
