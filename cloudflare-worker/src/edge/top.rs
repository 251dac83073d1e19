//! Who the edge is limiting, for the whole edge: each isolate counts its rules' allowed and
//! denied requests and its denied keys (a denial answered from the blocked-key cache
//! included) in isolate memory, and reports them in the background, at most once per
//! report interval, to one admin Durable Object ([`ADMIN_OBJECT`]), which merges the
//! isolates' reports into bounded time buckets: `GET /_ratewall/top` and
//! `GET /_ratewall/series` read them there.
//!
//! Costs: a decided check adds to a few integers and, when denied, to its rule's bounded
//! summary ([`Summary`], at most 64 keys); no request makes an object call for it — one
//! report per isolate per interval while it has traffic. Memory: per isolate, per rule one
//! summary and at most [`PENDING_SECONDS`] seconds of counts; at the admin object at most
//! [`MAX_RULES`] rules, each with a fixed number of buckets. Keys are counter keys until a
//! report is made, then their shown form ([`render`]): a secret value is only ever its keyed
//! hash, as in the filter and the store.

use super::hex;
use ratewall_core::algo::Nanos;
use ratewall_core::eval::{Check, CheckResult, Outcome, Tally};
use ratewall_core::sync::{RuleTop, TopSection};
use ratewall_core::topk::windows::Windows;
pub use ratewall_core::topk::windows::{Second, Window, SERIES};
use ratewall_core::topk::{bounded_key, node_bit, render, Admitted, Lately, Summary, CAPACITY};
use ratewall_core::{Config, SECOND};
use serde_json::{json, Value};
use std::rc::Rc;

/// The Durable Object that merges the isolates' reports.
pub const ADMIN_OBJECT: &str = "t:top";
/// How often an isolate reports, by default (the `TOP_REPORT_SECONDS` var sets it).
pub const REPORT_EVERY: Nanos = 5 * SECOND;
/// A scheduled report not taken this long after its time is taken as lost.
pub const LOST_AFTER: Nanos = 30 * SECOND;
/// How long after it was first taken a report whose call failed is still sent again.
pub const RETRY_FOR: Nanos = 60 * SECOND;
/// Seconds of per-second counts an isolate keeps between reports (past it, the last second
/// takes the counts).
pub const PENDING_SECONDS: usize = 64;
/// Most rules the admin object tracks (past it, a rule first heard later takes the place of
/// one not heard of for an hour, or is not tracked).
pub const MAX_RULES: usize = 64;
/// Filter nodes whose latest batch `seq` the admin object remembers.
pub const MAX_NODES: usize = 10_000;

/// One rule's counts in an isolate since its last report.
#[derive(Clone, Debug, Default)]
struct Pending {
    allowed: u64,
    denied: u64,
    shadow: u64,
    /// Denied (and shadow-denied) counter keys.
    top: Option<Summary>,
    series: Vec<Second>,
}

impl Pending {
    fn second(&mut self, sec: u64) -> Option<&mut Second> {
        let last = self.series.last().map(|s| s.0);
        // Time that goes backwards counts in the latest second; a full list in its last.
        if last.is_none_or(|l| sec > l) && self.series.len() < PENDING_SECONDS {
            self.series.push((sec, 0, 0, 0));
        }
        self.series.last_mut()
    }
}

/// An isolate's report: per rule its counts and top keys (shown form), and its counts per
/// second.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// The isolate's node id (its bit marks the keys it saw).
    pub node: u64,
    /// For a filter node's batch, its `seq` (a retried batch is merged once); 0 for an
    /// isolate's report.
    pub seq: u64,
    /// Per rule: counts and top denied keys.
    pub section: TopSection,
    /// Per rule, in the order of `section`'s: counts per second, oldest first.
    pub series: Vec<Vec<Second>>,
}

impl Report {
    fn to_json(&self) -> Value {
        let mut section = Vec::new();
        self.section.encode_into(&mut section);
        let series: Vec<Value> =
            self.series.iter().map(|s| json!(s.iter().map(|e| [e.0, e.1, e.2, e.3]).collect::<Vec<_>>())).collect();
        json!({"node": self.node, "seq": self.seq, "top": hex(&section), "series": series})
    }

    fn from_json(v: &Value) -> Option<Report> {
        let node = v.get("node")?.as_u64()?;
        let bytes = super::unhex(v.get("top")?.as_str()?.as_bytes())?;
        let section = TopSection::decode(&bytes).ok()?;
        let mut series = Vec::new();
        for list in v.get("series")?.as_array()? {
            let list = list.as_array()?;
            if list.len() > PENDING_SECONDS || series.len() >= MAX_RULES {
                return None;
            }
            let mut s = Vec::with_capacity(list.len());
            for e in list {
                let e = e.as_array()?;
                let n = |i: usize| e.get(i).and_then(Value::as_u64);
                s.push((n(0)?, n(1)?, n(2)?, n(3)?));
            }
            series.push(s);
        }
        let seq = v.get("seq").map_or(Some(0), Value::as_u64)?;
        Some(Report { node, seq, section, series })
    }
}

/// What an isolate has counted since its last report.
#[derive(Default)]
pub struct IsolateTop {
    /// The rules the pending counts are indexed by.
    under: Option<Rc<Config>>,
    rules: Vec<Pending>,
    /// Counts made under rules no longer in force, already in their shown form.
    carried: Option<Report>,
    any: bool,
    /// When the report scheduled is due (none scheduled: `None`).
    scheduled: Option<Nanos>,
    last_sent: Nanos,
    /// The number of the last report taken (reports are numbered from 1, so the admin
    /// object merges a retried one once), and when it was first taken.
    seq: u64,
    first_taken: Nanos,
    /// A report whose call failed, sent again (as it was) before any newer one, for at most
    /// [`RETRY_FOR`] after it was first taken.
    unsent: Option<Report>,
    /// Per rule, units admitted on keys not listed: a key's entry, once it is denied, counts
    /// those admitted before too (in earlier reports' intervals included), as the filter's
    /// and the store's do.
    admitted: Vec<Admitted>,
    /// Per rule, the keys this isolate denied, or admitted with nothing left, in the last
    /// minute (their `fnv1a`, and the second it last did), at most [`CAPACITY`]: units admitted
    /// to one of them are reported at once, as its entry's, with or without a denial in that
    /// report (else they waited for a denial here that may never come: another isolate may be
    /// the one denying the client).
    limited_lately: Vec<Lately>,
}

/// How long (s) a key an isolate found at its limit has the units it is admitted reported at
/// once.
const LIMITED_LATELY_S: u64 = 60;

/// Notes `key` found at its limit at unix second `sec`.
fn note_limited(lately: Option<&mut Lately>, key: &[u8], sec: u64) {
    if let Some(l) = lately {
        l.note(&[ratewall_core::key::fnv1a(key)], sec);
    }
}

impl IsolateTop {
    /// Counts a request's `outcome` (its `checks`, at `t`) under `config`. A denial answered
    /// from the blocked-key cache is counted as any other.
    pub fn count(&mut self, config: &Rc<Config>, checks: &[Check], outcome: &Outcome, t: Nanos) {
        if !self.under.as_ref().is_some_and(|u| Rc::ptr_eq(u, config)) {
            // The rules changed: what was counted under the old ones is shown with them.
            if let Some(old) = self.render(0) {
                let carried = self.carried.get_or_insert_with(Report::default);
                carried.section.rules.extend(old.section.rules);
                carried.series.extend(old.series);
                carried.section.rules.truncate(MAX_RULES);
                carried.series.truncate(MAX_RULES);
            }
            self.rules = vec![Pending::default(); config.rules.len()];
            self.admitted = vec![Admitted::default(); config.rules.len()];
            self.limited_lately = vec![Lately::new(LIMITED_LATELY_S, CAPACITY); config.rules.len()];
            self.under = Some(Rc::clone(config));
        }
        let sec = t / SECOND;
        for (rule, tally) in outcome.tally(&[]) {
            let Some(p) = self.rules.get_mut(rule) else { continue };
            let check = checks.iter().find(|c| c.rule == rule);
            let denied = match tally {
                // A request another rule rejected was admitted by none: its units were given
                // back (as the filter's sections count only the units it reports).
                Tally::Allowed if outcome.rejected => continue,
                Tally::Allowed => {
                    let units = check.map_or(1, |c| c.cost);
                    p.allowed = p.allowed.saturating_add(units);
                    if let Some(c) = check {
                        // Admitted with nothing left: the counter is at its limit, and another
                        // isolate may deny the client next.
                        let spent = outcome
                            .checks
                            .iter()
                            .any(|x| x.rule == rule && matches!(x.result, CheckResult::Decided(d) if d.remaining == 0));
                        if spent {
                            note_limited(self.limited_lately.get_mut(rule), &c.key, sec);
                        }
                        let lately = || {
                            let h = ratewall_core::key::fnv1a(&c.key);
                            self.limited_lately.get(rule).is_some_and(|l| l.holds(h, sec))
                        };
                        // Admitted units of a key already listed (side information), or found
                        // at its limit lately; of one not listed yet, kept until it is.
                        match p.top.as_mut().filter(|t| t.count(&c.key) > 0) {
                            Some(top) => top.add(&c.key, 0, c.cost, 0),
                            None if lately() => {
                                let before = self.admitted.get_mut(rule).map_or(0, |a| a.take(&c.key, sec));
                                let top = p.top.get_or_insert_with(|| Summary::new(CAPACITY));
                                top.add_admitted(&c.key, c.cost.saturating_add(before), 0);
                            }
                            None => {
                                if let Some(a) = self.admitted.get_mut(rule) {
                                    a.note(&c.key, c.cost, sec);
                                }
                            }
                        }
                    }
                    if let Some(s) = p.second(sec) {
                        s.1 = s.1.saturating_add(units);
                    }
                    false
                }
                Tally::Rejected => {
                    p.denied = p.denied.saturating_add(1);
                    if let Some(s) = p.second(sec) {
                        s.2 = s.2.saturating_add(1);
                    }
                    true
                }
                Tally::ShadowRejected => {
                    p.shadow = p.shadow.saturating_add(1);
                    if let Some(s) = p.second(sec) {
                        s.3 = s.3.saturating_add(1);
                    }
                    true
                }
                Tally::Unkeyed | Tally::Failed(_) => continue,
            };
            if let (true, Some(c)) = (denied, check) {
                let before = self.admitted.get_mut(rule).map_or(0, |a| a.take(&c.key, sec));
                p.top.get_or_insert_with(|| Summary::new(CAPACITY)).add(&c.key, 1, before, 0);
                note_limited(self.limited_lately.get_mut(rule), &c.key, sec);
            }
            self.any = true;
        }
    }

    /// Whether counts wait to be reported.
    pub fn pending(&self) -> bool {
        self.any || self.carried.is_some() || self.unsent.is_some()
    }

    /// How long until the next report should go, if the glue should schedule one now (none
    /// is scheduled and counts wait): `every` after the last one. Marks it scheduled. A
    /// report still not taken [`LOST_AFTER`] past its time was lost with its background task
    /// (the runtime ends them): another is scheduled.
    /// `every` is asked for only then, so a request that finds a report scheduled reads no
    /// setting.
    pub fn schedule(&mut self, now: Nanos, every: impl FnOnce() -> Nanos) -> Option<Nanos> {
        if self.scheduled.is_some_and(|due| now < due.saturating_add(LOST_AFTER)) || !self.pending() {
            return None;
        }
        let due = self.last_sent.saturating_add(every()).max(now);
        self.scheduled = Some(due);
        Some(due - now)
    }

    /// The report of everything counted since the last one, as `node` (`None`: nothing),
    /// starting the next interval at `now`.
    pub fn take(&mut self, node: u64, now: Nanos) -> Option<Report> {
        self.scheduled = None;
        self.last_sent = now;
        if let Some(unsent) = self.unsent.take() {
            return Some(unsent);
        }
        let mut report = self.render(node).unwrap_or_default();
        if let Some(c) = self.carried.take() {
            report.section.rules.extend(c.section.rules);
            report.series.extend(c.series);
        }
        report.node = node;
        if report.section.rules.is_empty() {
            return None;
        }
        let bit = node_bit(node);
        for r in &mut report.section.rules {
            let keys: Vec<Vec<u8>> = r.top.entries().iter().map(|e| e.key.clone()).collect();
            for k in keys {
                r.top.add(&k, 0, 0, bit);
            }
        }
        self.seq += 1;
        self.first_taken = now;
        report.seq = self.seq;
        Some(report)
    }

    /// A report [`IsolateTop::take`] gave whose call failed at `now`: it goes again, first,
    /// with the next one due, unless [`RETRY_FOR`] has passed since it was first taken. (Its
    /// call may have reached the admin object all the same: its number makes the retry
    /// count once.) False when it is given up: its counts are not in the admin object's.
    pub fn failed(&mut self, report: Report, now: Nanos) -> bool {
        let retry = report.seq == self.seq && now.saturating_sub(self.first_taken) < RETRY_FOR;
        if retry {
            self.unsent = Some(report);
        }
        retry
    }

    /// The pending counts in their shown form, emptied.
    fn render(&mut self, node: u64) -> Option<Report> {
        let config = self.under.as_ref()?;
        if !std::mem::take(&mut self.any) {
            return None;
        }
        let mut report = Report { node, ..Report::default() };
        for (rule, p) in config.rules.iter().zip(self.rules.iter_mut()) {
            let p = std::mem::take(p);
            // At most the rules the object tracks, the first that counted anything in the
            // document's order: a report of more is one it refuses (and the reads that carry
            // it, every one after).
            if (p.allowed == 0 && p.denied == 0 && p.shadow == 0) || report.series.len() >= MAX_RULES {
                continue;
            }
            let top = p.top.map_or_else(
                || Summary::new(CAPACITY),
                |t| {
                    t.map_keys(|k| {
                        let (_, shown) = render(config, k)?;
                        Some(bounded_key(shown, &config.identity.hash_key).into_bytes())
                    })
                },
            );
            report.section.rules.push(RuleTop {
                rule: rule.name.clone(),
                allowed: p.allowed,
                denied: p.denied,
                shadow_denied: p.shadow,
                top,
            });
            report.series.push(p.series);
        }
        Some(report)
    }
}

/// A call to the admin object: an isolate's report, or a read (which may carry the reading
/// isolate's own report first, so that what it counted is in the answer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TopCall {
    /// Merge a report.
    Report(Report),
    /// `GET /_ratewall/top`.
    Top { window: Window, rule: Option<String>, report: Option<Report> },
    /// `GET /_ratewall/series`.
    Series { rule: Option<String>, report: Option<Report> },
}

impl TopCall {
    /// The message body (JSON).
    pub fn encode(&self) -> String {
        let report = |r: &Option<Report>| r.as_ref().map_or(Value::Null, Report::to_json);
        match self {
            TopCall::Report(r) => json!({"op": "top_report", "report": r.to_json()}),
            TopCall::Top { window, rule, report: r } => {
                json!({"op": "top_read", "window": window.name(), "rule": rule, "report": report(r)})
            }
            TopCall::Series { rule, report: r } => json!({"op": "series_read", "rule": rule, "report": report(r)}),
        }
        .to_string()
    }

    /// Parses a message body; `None` when it is not a valid admin call.
    pub fn decode(body: &str) -> Option<TopCall> {
        let v: Value = serde_json::from_str(body).ok()?;
        let report = match v.get("report") {
            None | Some(Value::Null) => None,
            Some(r) => Some(Report::from_json(r)?),
        };
        let rule = match v.get("rule") {
            None | Some(Value::Null) => None,
            Some(r) => Some(r.as_str()?.to_owned()),
        };
        match v.get("op")?.as_str()? {
            "top_report" => Some(TopCall::Report(report?)),
            "top_read" => Some(TopCall::Top { window: Window::parse(v.get("window")?.as_str()).ok()?, rule, report }),
            "series_read" => Some(TopCall::Series { rule, report }),
            _ => None,
        }
    }
}

/// The admin object's view of the edge: the isolates' reports merged per rule into bounded
/// buckets (the last minute, the last hour, a per-second series over 15 minutes). Soft
/// state, in the object's memory: a restart of the object starts it empty.
#[derive(Debug)]
pub struct Aggregate {
    /// The rules' buckets (and the latest unix second seen: time that goes backwards is
    /// clamped to it).
    windows: Windows,
    /// Per filter node, the latest batch `seq` merged (at most [`MAX_NODES`]).
    seqs: std::collections::HashMap<u64, u64>,
}

impl Default for Aggregate {
    fn default() -> Self {
        Aggregate { windows: Windows::new(MAX_RULES, CAPACITY), seqs: Default::default() }
    }
}

impl Aggregate {
    /// Whether the windows still show anything at `unix` (a rule heard of within the hour).
    pub fn holds(&self, unix: u64) -> bool {
        self.windows.holds(unix)
    }

    /// Merges `report`, received at `unix` (seconds).
    pub fn add(&mut self, unix: u64, report: &Report) {
        if report.seq > 0 {
            if self.seqs.get(&report.node).is_some_and(|s| *s >= report.seq) {
                return;
            }
            if self.seqs.len() >= MAX_NODES && !self.seqs.contains_key(&report.node) {
                // Forgetting the nodes only risks counting a retried batch's section twice.
                self.seqs.clear();
            }
            self.seqs.insert(report.node, report.seq);
        }
        self.windows.add(unix, &report.section, &report.series);
    }

    /// Handles an admin call at `unix` (seconds): the answer body.
    pub fn handle(&mut self, call: TopCall, unix: u64) -> String {
        match call {
            TopCall::Report(r) => {
                self.add(unix, &r);
                String::from("{}")
            }
            TopCall::Top { window, rule, report } => {
                if let Some(r) = report {
                    self.add(unix, &r);
                }
                self.top(unix, rule.as_deref(), window).to_string()
            }
            TopCall::Series { rule, report } => {
                if let Some(r) = report {
                    self.add(unix, &r);
                }
                self.series(unix, rule.as_deref()).to_string()
            }
        }
    }

    /// Per rule (or only `rule`), its counts and top denied keys over the window: the JSON of
    /// ratewall-store's `GET /v1/top`.
    pub fn top(&self, unix: u64, rule: Option<&str>, window: Window) -> Value {
        self.windows.top(unix, rule, window)
    }

    /// Per rule (or only `rule`), per-second counts over the last 15 minutes, oldest first:
    /// the JSON of ratewall-store's `GET /v1/series`.
    pub fn series(&self, unix: u64, rule: Option<&str>) -> Value {
        self.windows.series(unix, rule)
    }
}

/// The admin object's answer with its rules in `config`'s document order (`rule`: only that
/// one), then the rules heard of that the document does not name, as they were heard: a
/// filter fleet's that syncs here, or a rule renamed within the window. A rule of the
/// document the object has not heard of is listed with nothing counted: with `zeros`, as a
/// `top` answer lists it; else as a `series` answer does, each second 0 (as the store's
/// `/v1/series` lists an idle rule, so the dashboard draws it rather than "no data") — unless
/// the object tracks as many rules as it may ([`MAX_RULES`]): then it may have counted such a
/// rule's traffic nowhere, and the rule is left out (not shown as counting nothing).
pub fn in_document_order(config: Option<&Config>, rule: Option<&str>, mut answer: Value, zeros: bool) -> Value {
    // Read, not removed: the answer keeps it (removing a key from a JSON map took ~19 KB of
    // the Worker's wasm).
    let full = answer.get("full").and_then(Value::as_bool).unwrap_or(false);
    let Some(config) = config else { return answer };
    let mut heard: Vec<Value> = match answer.get_mut("rules").map(Value::take) {
        Some(Value::Array(a)) => a,
        _ => Vec::new(),
    };
    heard.retain(|h| rule.is_none_or(|n| h.get("rule").and_then(Value::as_str) == Some(n)));
    let mut rules = Vec::new();
    for r in config.rules.iter().filter(|r| rule.is_none_or(|n| n == r.name)) {
        match heard.iter().position(|h| h.get("rule").and_then(Value::as_str) == Some(r.name.as_str())) {
            Some(i) => rules.push(heard.remove(i)),
            None if full => {}
            None if zeros => {
                rules.push(json!({"rule": r.name, "allowed": 0, "denied": 0, "shadow_denied": 0, "top": []}));
            }
            None => {
                let none = vec![0u8; ratewall_core::topk::windows::SERIES];
                rules.push(json!({"rule": r.name, "allowed": none, "denied": none, "shadow_denied": none}));
            }
        }
    }
    rules.append(&mut heard);
    if let Some(obj) = answer.as_object_mut() {
        obj.insert("rules".into(), Value::Array(rules));
    }
    answer
}

#[cfg(test)]
mod tests;
