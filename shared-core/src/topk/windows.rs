//! Who a fleet is limiting, over time: the top sections a store or the Worker's admin object
//! hears, merged per rule into bounded buckets (the last minute in 5 s buckets, the last hour in
//! 5 min buckets, a per-second series over 15 minutes), and rendered as the admin JSON of
//! `GET /v1/top` and `GET /v1/series` (docs/admin-api.md). The caller gives the time in unix
//! seconds; time that goes backwards is clamped to the latest seen.
//!
//! Memory is bounded whatever the traffic: at most `max_rules` rules, each with a fixed number
//! of buckets holding a summary of at most `kept` keys.

use super::{node_count, Summary};
use crate::sync::TopSection;
use alloc::format;
use alloc::string::String;
use alloc::vec;
use alloc::vec::Vec;
use serde_json::{json, Value};

/// Entries `top` lists per rule at most.
pub const LISTED: usize = 20;
/// Seconds of the per-second series.
pub const SERIES: usize = 900;
/// The minute's buckets: how long each is (seconds) and how many there are.
const MINUTE: (u64, usize) = (5, 12);
/// The hour's buckets.
const HOUR: (u64, usize) = (300, 12);
/// The seconds the hour's buckets span.
const HOUR_SPAN: u64 = HOUR.0 * HOUR.1 as u64;

/// One second of a rule's series: (unix second, allowed, denied, shadow denied).
pub type Second = (u64, u64, u64, u64);

/// Which window `top` answers for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// The last minute.
    Minute,
    /// The last hour.
    Hour,
}

impl Window {
    /// `1m` or `1h` (absent: the minute).
    pub fn parse(v: Option<&str>) -> Result<Window, String> {
        match v {
            None | Some("1m") => Ok(Window::Minute),
            Some("1h") => Ok(Window::Hour),
            Some(other) => Err(format!("window: {other:?} is not 1m or 1h")),
        }
    }

    /// How [`Window::parse`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            Window::Minute => "1m",
            Window::Hour => "1h",
        }
    }

    fn buckets(self) -> (u64, usize) {
        match self {
            Window::Minute => MINUTE,
            Window::Hour => HOUR,
        }
    }
}

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

/// One rule's buckets and series.
#[derive(Debug)]
struct Rule {
    name: String,
    minute: Vec<Bucket>,
    hour: Vec<Bucket>,
    series: Vec<Second>,
    /// The unix second it was last heard of.
    heard: u64,
}

impl Rule {
    fn new(name: &str, heard: u64) -> Rule {
        Rule {
            name: name.into(),
            minute: vec![Bucket::default(); MINUTE.1],
            hour: vec![Bucket::default(); HOUR.1],
            series: vec![(0, 0, 0, 0); SERIES],
            heard,
        }
    }
}

/// The rules heard of, in the order of the last section that named them (first heard, for
/// those it did not name).
#[derive(Debug)]
pub struct Windows {
    rules: Vec<Rule>,
    max_rules: usize,
    /// Keys a bucket's summary keeps.
    kept: usize,
    /// The latest unix second seen.
    now: u64,
}

impl Windows {
    /// Empty; past `max_rules` rules, a rule first heard later takes the place of one not heard
    /// of for an hour (none shows in any window any more), or is not tracked.
    pub fn new(max_rules: usize, kept: usize) -> Windows {
        Windows { rules: Vec::new(), max_rules, kept, now: 0 }
    }

    /// Whether as many rules are tracked as may be: a rule first heard now may not be.
    pub fn full(&self) -> bool {
        self.rules.len() >= self.max_rules
    }

    /// Whether a rule was heard of within the hour before `unix`: the windows still show
    /// something.
    pub fn holds(&self, unix: u64) -> bool {
        let since = unix.max(self.now).saturating_sub(HOUR_SPAN);
        self.rules.iter().any(|r| r.heard > since)
    }

    /// Notes the time `unix` (seconds) and answers the clamped time.
    pub fn clock(&mut self, unix: u64) -> u64 {
        self.now = self.now.max(unix);
        self.now
    }

    /// Merges `section`, heard at `unix`. `seconds[i]`, when given and not empty, spreads the
    /// `i`-th rule's counts over the seconds they were decided in (a second ahead of this clock
    /// counts now; one older than the series, not); else they count in the second heard.
    pub fn add(&mut self, unix: u64, section: &TopSection, seconds: &[Vec<Second>]) {
        let t = self.clock(unix);
        self.put(t, section, seconds);
    }

    /// Merges `section`, of the second `unix`, which may be before the latest seen (what a
    /// peer heard then, read only now: a store process that starts reads the whole shared
    /// stream): it counts in that second's buckets while the windows keep them, and in none
    /// once they do not. [`Windows::add`] counts a second before the latest in the latest:
    /// for sections heard now, on a clock that went backwards.
    pub fn add_past(&mut self, unix: u64, section: &TopSection) {
        self.clock(unix);
        self.put(unix, section, &[]);
    }

    fn put(&mut self, at: u64, section: &TopSection, seconds: &[Vec<Second>]) {
        let t = self.now;
        for (n, r) in section.rules.iter().enumerate() {
            let i = match self.rules.iter().position(|x| x.name == r.rule) {
                Some(i) => i,
                None => {
                    if self.rules.len() >= self.max_rules {
                        // Full: a rule not heard of for longer than every window shows (one
                        // renamed or removed since) makes room; else this one is not tracked.
                        let idle =
                            self.rules.iter().enumerate().filter(|(_, x)| x.heard.saturating_add(HOUR_SPAN) <= t);
                        let Some(oldest) = idle.min_by_key(|(_, x)| x.heard).map(|(i, _)| i) else { continue };
                        self.rules.remove(oldest);
                    }
                    self.rules.push(Rule::new(&r.rule, at));
                    self.rules.len() - 1
                }
            };
            let Some(rule) = self.rules.get_mut(i) else { continue };
            rule.heard = rule.heard.max(at);
            for (buckets, (len, count)) in [(&mut rule.minute, MINUTE), (&mut rule.hour, HOUR)] {
                // `at <= t`. A bucket older than those kept would take a newer one's place.
                let (bucket, latest) = (at / len, t / len);
                if latest - bucket >= count as u64 {
                    continue;
                }
                let Some(b) = buckets.get_mut((bucket % count as u64) as usize) else { continue };
                if b.at != bucket {
                    *b = Bucket { at: bucket, ..Bucket::default() };
                }
                b.allowed = b.allowed.saturating_add(r.allowed);
                b.denied = b.denied.saturating_add(r.denied);
                b.shadow = b.shadow.saturating_add(r.shadow_denied);
                if !r.top.is_empty() {
                    b.top.get_or_insert_with(|| Summary::new(self.kept)).merge_keeping(&r.top);
                }
            }
            let own = [(at, r.allowed, r.denied, r.shadow_denied)];
            let spread = seconds.get(n).map(Vec::as_slice).filter(|s| !s.is_empty()).unwrap_or(&own);
            for &(sec, a, d, s) in spread {
                let sec = sec.min(t);
                // `sec <= t`: no overflow, whatever clock a peer's share set (`t` near u64::MAX).
                if t - sec >= SERIES as u64 {
                    continue;
                }
                if let Some(e) = rule.series.get_mut((sec % SERIES as u64) as usize) {
                    if e.0 != sec {
                        *e = (sec, 0, 0, 0);
                    }
                    e.1 = e.1.saturating_add(a);
                    e.2 = e.2.saturating_add(d);
                    e.3 = e.3.saturating_add(s);
                }
            }
        }
        self.order_as(section);
    }

    /// Puts the rules `section` names in its order (a filter lists its document's rules in
    /// the document's order), in the places they hold among the others: the rules are listed
    /// in the order of the document the last batch came from.
    fn order_as(&mut self, section: &TopSection) {
        let rank = |name: &str| section.rules.iter().position(|r| r.rule == name);
        let places: Vec<usize> =
            self.rules.iter().enumerate().filter(|(_, r)| rank(&r.name).is_some()).map(|(i, _)| i).collect();
        let mut named: Vec<Rule> = Vec::with_capacity(places.len());
        for &i in places.iter().rev() {
            named.push(self.rules.remove(i));
        }
        named.sort_by_key(|r| rank(&r.name));
        for (&i, r) in places.iter().zip(named) {
            self.rules.insert(i, r);
        }
    }

    /// The most keys any bucket's summary holds.
    #[cfg(test)]
    pub(crate) fn largest_summary(&self) -> usize {
        let buckets = self.rules.iter().flat_map(|r| r.minute.iter().chain(&r.hour));
        buckets.filter_map(|b| b.top.as_ref()).map(|t| t.entries().len()).max().unwrap_or(0)
    }

    fn named<'a>(&'a self, rule: Option<&'a str>) -> impl Iterator<Item = &'a Rule> + 'a {
        self.rules.iter().filter(move |r| rule.is_none_or(|n| n == r.name))
    }

    /// `GET /v1/top` at `unix`: per rule (or only `rule`), its counts and top denied keys over
    /// the window, most denied first.
    pub fn top(&self, unix: u64, rule: Option<&str>, window: Window) -> Value {
        let t = unix.max(self.now);
        let (len, count) = window.buckets();
        let first = (t / len).saturating_sub(count as u64 - 1);
        let rules: Vec<Value> = self
            .named(rule)
            .map(|r| {
                let buckets = if window == Window::Minute { &r.minute } else { &r.hour };
                let (mut allowed, mut denied, mut shadow, mut top) = (0u64, 0u64, 0u64, Summary::new(self.kept));
                for b in buckets.iter().filter(|b| b.at >= first && b.at <= t / len) {
                    allowed = allowed.saturating_add(b.allowed);
                    denied = denied.saturating_add(b.denied);
                    shadow = shadow.saturating_add(b.shadow);
                    if let Some(s) = &b.top {
                        top.merge_keeping(s);
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
        self.noting_full(json!({"window_s": len * count as u64, "rules": rules}))
    }

    /// `answer`, marked `"full": true` when as many rules are tracked as may be: a rule first
    /// heard now may be counted nowhere, and a reader knows why it is missing.
    fn noting_full(&self, mut answer: Value) -> Value {
        if let (true, Some(obj)) = (self.full(), answer.as_object_mut()) {
            obj.insert("full".into(), Value::Bool(true));
        }
        answer
    }

    /// `GET /v1/series` at `unix`: per rule (or only `rule`), per-second counts over the last
    /// 15 minutes, oldest first.
    pub fn series(&self, unix: u64, rule: Option<&str>) -> Value {
        let end = unix.max(self.now);
        let rules: Vec<Value> = self
            .named(rule)
            .map(|r| {
                let (mut a, mut d, mut s) = (Vec::new(), Vec::new(), Vec::new());
                for sec in end.saturating_sub(SERIES as u64 - 1)..=end {
                    let e = r.series.get((sec % SERIES as u64) as usize).filter(|e| e.0 == sec);
                    let (x, y, z) = e.map_or((0, 0, 0), |e| (e.1, e.2, e.3));
                    a.push(x);
                    d.push(y);
                    s.push(z);
                }
                json!({"rule": r.name, "allowed": a, "denied": d, "shadow_denied": s})
            })
            .collect();
        self.noting_full(json!({"step_s": 1, "end_unix_s": end, "rules": rules}))
    }
}
