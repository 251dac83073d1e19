//! `ratewall replay`: a log of requests through the core on the log's own clock.

use crate::explain::Parts;
use crate::{load, Failure};
use ratewall_core::eval::{evaluate, Check, Skip, Tally};
use ratewall_core::Config;
use ratewall_core::Nanos;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, IsTerminal, Read};
use std::path::Path;

/// One rule's counts.
#[derive(Default, Clone)]
struct Counts {
    allowed: u64,
    rejected: u64,
    shadow_rejected: u64,
    unkeyed: u64,
    /// Rejections (or shadow "would reject"s) per counter key, with the key as
    /// `dimension=value` pairs (worked out once per key, not per line).
    by_key: HashMap<Vec<u8>, (u64, String)>,
}

/// A log line's time: RFC 3339 (`2026-12-01T10:00:00.250Z`), or a number of seconds since
/// the epoch (fractions allowed).
pub fn timestamp(v: &Value) -> Option<Nanos> {
    match v {
        Value::String(s) => rfc3339(s),
        Value::Number(n) => epoch_seconds(&n.to_string()),
        _ => None,
    }
}

fn rfc3339(s: &str) -> Option<Nanos> {
    let t = chrono::DateTime::parse_from_rfc3339(s).ok()?;
    u64::try_from(t.timestamp_nanos_opt()?).ok()
}

/// Seconds since the epoch written in decimal, exact to the nanosecond (the text, not a
/// float: an f64 has 16 digits).
fn epoch_seconds(text: &str) -> Option<Nanos> {
    let (secs, frac) = text.split_once('.').unwrap_or((text, ""));
    if secs.is_empty() || !secs.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let secs: u64 = secs.parse().ok()?;
    let mut nanos = 0u64;
    for i in 0..9 {
        nanos = nanos * 10 + frac.as_bytes().get(i).map_or(0, |b| u64::from(b - b'0'));
    }
    secs.checked_mul(1_000_000_000)?.checked_add(nanos)
}

/// One log line, borrowed from its text where it can be (a string with escapes is copied).
/// Lines this does not take (a field of another type) are read again as a `Value`, which
/// says what is wrong with them.
#[derive(serde::Deserialize)]
struct Fields<'a> {
    #[serde(borrow)]
    ts: Option<&'a RawValue>,
    #[serde(borrow, default)]
    method: Option<Cow<'a, str>>,
    #[serde(borrow)]
    path: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    headers: Option<&'a RawValue>,
    #[serde(borrow, default)]
    ip: Option<Cow<'a, str>>,
}

/// A time as written in a line: a JSON string (RFC 3339) or number (epoch seconds).
fn raw_timestamp(raw: &RawValue) -> Option<Nanos> {
    let text = raw.get();
    if text.starts_with('"') {
        return rfc3339(&serde_json::from_str::<Cow<'_, str>>(text).ok()?);
    }
    epoch_seconds(text)
}

/// Headers as written in a line: an object (values a string or a list of strings); any
/// other form is read as a `Value` by [`headers`].
fn raw_headers(raw: Option<&RawValue>) -> Vec<(String, String)> {
    let Some(raw) = raw else { return Vec::new() };
    let parsed = raw
        .get()
        .starts_with('{')
        .then(|| serde_json::from_str::<BTreeMap<Cow<'_, str>, &RawValue>>(raw.get()).ok())
        .flatten();
    let Some(map) = parsed else {
        return serde_json::from_str::<Value>(raw.get()).map(|v| headers(&v)).unwrap_or_default();
    };
    let mut out = Vec::with_capacity(map.len());
    for (name, value) in map {
        let name = name.to_ascii_lowercase();
        if value.get().starts_with('"') {
            if let Ok(v) = serde_json::from_str::<Cow<'_, str>>(value.get()) {
                out.push((name, v.into_owned()));
            }
        } else if let Ok(list) = serde_json::from_str::<Vec<Value>>(value.get()) {
            out.extend(list.iter().filter_map(Value::as_str).map(|s| (name.clone(), s.to_owned())));
        }
    }
    out
}

/// A line's headers: an object of name → value (a string, or a list of strings for a field
/// sent several times), or a list of `[name, value]` pairs.
fn headers(v: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if let Some(pairs) = v.as_array() {
        for p in pairs {
            if let (Some(n), Some(val)) = (p[0].as_str(), p[1].as_str()) {
                out.push((n.to_ascii_lowercase(), val.to_owned()));
            }
        }
    }
    if let Some(o) = v.as_object() {
        for (name, value) in o {
            match value {
                Value::String(s) => out.push((name.to_ascii_lowercase(), s.clone())),
                Value::Array(a) => {
                    out.extend(a.iter().filter_map(Value::as_str).map(|s| (name.to_ascii_lowercase(), s.to_owned())))
                }
                _ => {}
            }
        }
    }
    out
}

/// The replay's counters: a hash map updated in place, without the key clone on every write
/// that the core's `MemoryCounters` (a B-tree) makes. The counting stage is not the
/// replay's bottleneck (the reading stage is), so this shows in CPU time, not wall time.
#[derive(Default)]
struct Counters(HashMap<Vec<u8>, ratewall_core::State>);

impl ratewall_core::eval::Counters for Counters {
    fn update(
        &mut self,
        check: &Check,
        _now: Nanos,
        f: &mut dyn FnMut(&ratewall_core::State, u64) -> ratewall_core::eval::Write,
    ) -> Result<(), ratewall_core::eval::StoreError> {
        match self.0.get_mut(&check.key) {
            Some(state) => {
                if let Some((next, _)) = f(state, u64::MAX) {
                    *state = next;
                }
            }
            None => {
                if let Some((next, _)) = f(&ratewall_core::State::Fresh, u64::MAX) {
                    self.0.insert(check.key.clone(), next);
                }
            }
        }
        Ok(())
    }
}

/// A log line as the reading stage leaves it.
enum Line {
    /// Empty.
    Blank,
    /// Not a request: why, with its place.
    Bad(String),
    /// A request: its time, its identity and the counters it checks.
    Request { ts: Nanos, parts: Parts, checks: Vec<Check>, skipped: Vec<(usize, Skip)> },
}

/// Reads one line (`n`: its number in `name`).
fn read_line(config: &Config, name: &str, n: u64, text: &str) -> Line {
    if text.trim().is_empty() {
        return Line::Blank;
    }
    let typed = serde_json::from_str::<Fields<'_>>(text).ok().and_then(|l| {
        let ts = l.ts.and_then(raw_timestamp)?;
        Some((ts, l.path?, l.method, raw_headers(l.headers), l.ip))
    });
    // A line the typed reading does not take (a field of another type) is read as a JSON
    // value, which takes what it can and says what is wrong.
    let value;
    let (ts, path, method, hs, ip) = match typed {
        Some(t) => t,
        None => {
            value = match serde_json::from_str::<Value>(text) {
                Ok(v) => v,
                Err(e) => return Line::Bad(format!("{name}:{n}: not JSON: {e}")),
            };
            let (Some(ts), Some(path)) = (timestamp(&value["ts"]), value["path"].as_str()) else {
                return Line::Bad(format!("{name}:{n}: needs \"ts\" (RFC 3339 or epoch seconds) and \"path\""));
            };
            let method = value["method"].as_str().map(Cow::Borrowed);
            (ts, Cow::Borrowed(path), method, headers(&value["headers"]), value["ip"].as_str().map(Cow::Borrowed))
        }
    };
    let method = method.as_deref().unwrap_or("GET").to_ascii_uppercase();
    let parts = Parts::new(config, &path, &hs, ip.as_deref());
    let values = parts.header_values();
    let (checks, skipped) = config.checks(&parts.request(&method, &values));
    Line::Request { ts, parts, checks, skipped }
}

/// The reading stage: every line of `input`, in batches, in order; a read error ends it.
fn read_lines(
    config: &Config,
    name: &str,
    input: Box<dyn Read + Send>,
    tx: &std::sync::mpsc::SyncSender<Result<Vec<Line>, String>>,
) {
    const BATCH: usize = 1024;
    let mut reader = BufReader::new(input);
    let (mut text, mut n, mut batch) = (String::new(), 0u64, Vec::with_capacity(BATCH));
    loop {
        text.clear();
        match reader.read_line(&mut text) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                let _ = tx.send(Err(format!("reading {name}: {e}")));
                return;
            }
        }
        n += 1;
        batch.push(read_line(config, name, n, &text));
        if batch.len() == BATCH && tx.send(Ok(std::mem::replace(&mut batch, Vec::with_capacity(BATCH)))).is_err() {
            return;
        }
    }
    let _ = tx.send(Ok(batch));
}

/// `ratewall replay`.
pub fn replay(rules: &Path, log: &Path, top: usize, as_json: bool) -> Result<(), Failure> {
    let (_, config) = load(rules)?;
    let input: Box<dyn Read + Send> = if log.as_os_str() == "-" {
        Box::new(std::io::stdin())
    } else {
        Box::new(std::fs::File::open(log).map_err(|e| Failure::Usage(format!("cannot read {}: {e}", log.display())))?)
    };
    let mut counts = vec![Counts::default(); config.rules.len()];
    let mut counters = Counters::default();
    let (mut lines, mut requests, mut rejected) = (0u64, 0u64, 0u64);
    let mut bad = Vec::new();
    let progress = std::io::stderr().is_terminal();
    let started = std::time::Instant::now();
    let name = log.display().to_string();
    // Two stages on two threads, in order: one reads and keys the lines (JSON, identity,
    // counter keys), the other runs them through the counters on their own clock.
    let (tx, rx) = std::sync::mpsc::sync_channel::<Result<Vec<Line>, String>>(8);
    std::thread::scope(|scope| -> Result<(), Failure> {
        let config = &config;
        let name = &name;
        scope.spawn(move || read_lines(config, name, input, &tx));
        for batch in rx {
            for line in batch.map_err(Failure::Usage)? {
                lines += 1;
                let (ts, parts, checks, skipped) = match line {
                    Line::Blank => continue,
                    Line::Bad(why) => {
                        bad.push(why);
                        continue;
                    }
                    Line::Request { ts, parts, checks, skipped } => (ts, parts, checks, skipped),
                };
                let outcome = evaluate(config, &checks, &mut counters, ts);
                requests += 1;
                rejected += u64::from(outcome.rejected);
                for (rule, tally) in outcome.tally(&skipped) {
                    let (Some(c), Some(r)) = (counts.get_mut(rule), config.rules.get(rule)) else { continue };
                    match tally {
                        Tally::Allowed => c.allowed += 1,
                        Tally::Unkeyed => c.unkeyed += 1,
                        Tally::Rejected | Tally::ShadowRejected => {
                            if tally == Tally::Rejected {
                                c.rejected += 1;
                            } else {
                                c.shadow_rejected += 1;
                            }
                            let Some(key) = checks.iter().find(|k| k.rule == rule).map(|k| &k.key) else { continue };
                            match c.by_key.get_mut(key) {
                                Some(e) => e.0 += 1,
                                None => {
                                    c.by_key.insert(key.clone(), (1, parts.key_text(config, r)));
                                }
                            }
                        }
                        Tally::Failed(_) => {}
                    }
                }
                if progress && lines.is_multiple_of(100_000) {
                    eprint!("\rreplayed {lines} lines in {:.1} s", started.elapsed().as_secs_f64());
                }
            }
        }
        Ok(())
    })?;
    if progress && lines >= 100_000 {
        eprintln!();
    }
    let top_of = |c: &Counts| {
        // Counters of one identity under two limits (a plan change) are one key to a reader.
        let mut by_text: HashMap<&str, u64> = HashMap::new();
        for (n, text) in c.by_key.values() {
            *by_text.entry(text).or_default() += n;
        }
        let mut keys: Vec<(&str, u64)> = by_text.into_iter().collect();
        keys.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        keys.into_iter().take(top).map(|(k, n)| (k.to_owned(), n)).collect::<Vec<_>>()
    };
    if as_json {
        let rules: Vec<Value> = config
            .rules
            .iter()
            .zip(&counts)
            .map(|(r, c)| {
                let keys: Vec<Value> = top_of(c).into_iter().map(|(k, n)| json!({"key": k, "rejected": n})).collect();
                json!({"name": r.name, "allowed": c.allowed, "rejected": c.rejected, "shadow_rejected": c.shadow_rejected,
                       "unkeyed": c.unkeyed, "top_rejected_keys": keys})
            })
            .collect();
        say!(
            "{}",
            json!({"lines": lines, "requests": requests, "rejected": rejected, "invalid_lines": bad.len(), "rules": rules})
        );
    } else {
        say!("{requests} requests replayed, {rejected} rejected ({} lines, {} invalid)", lines, bad.len());
        for (r, c) in config.rules.iter().zip(&counts) {
            let shadow = if c.shadow_rejected > 0 {
                format!(", would reject {} (shadow)", c.shadow_rejected)
            } else {
                String::new()
            };
            say!("- {}: allowed {}, rejected {}{shadow}, unkeyed {}", r.name, c.allowed, c.rejected, c.unkeyed);
            for (k, n) in top_of(c) {
                say!("    {n:>8}  {k}");
            }
        }
    }
    if bad.is_empty() {
        Ok(())
    } else {
        let total = bad.len();
        let mut lines: Vec<String> = bad.into_iter().take(20).collect();
        lines.push(format!("{total} log line{} could not be read", if total == 1 { "" } else { "s" }));
        Err(Failure::Invalid(lines))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn headers_are_an_object_or_a_list_of_pairs() {
        let want = vec![("x-a".to_owned(), "1".to_owned()), ("x-a".to_owned(), "2".to_owned())];
        assert_eq!(headers(&json!({"X-A": ["1", "2"]})), want);
        assert_eq!(headers(&json!([["X-A", "1"], ["x-a", "2"], ["bad"], 7])), want);
        assert!(headers(&json!("x")).is_empty());
    }

    #[test]
    fn timestamps_are_rfc3339_or_epoch_seconds() {
        let t = timestamp(&json!("2026-12-01T10:00:00.250Z")).unwrap();
        assert_eq!(t, 1_796_119_200_250_000_000);
        assert_eq!(timestamp(&json!("2026-12-01T11:00:00.250+01:00")), Some(t));
        assert_eq!(timestamp(&json!(1_796_119_200.25)), Some(t));
        assert_eq!(timestamp(&json!("yesterday")), None);
        assert_eq!(timestamp(&json!(-1)), None);
        assert_eq!(timestamp(&json!(null)), None);
    }

    /// The typed, borrowing reading of a line agrees with the `Value` reading.
    #[test]
    fn the_fast_reading_of_a_line_agrees_with_the_value_reading() {
        // Read from the text, epoch seconds are exact to the nanosecond (a `Value` holds an
        // f64, which keeps 16 digits).
        let raw: &RawValue = serde_json::from_str("1796119200.123456789").unwrap();
        assert_eq!(raw_timestamp(raw), Some(1_796_119_200_123_456_789));
        for ts in [r#""2026-12-01T10:00:00.250Z""#, "1796119200.25", "1796119200", "-1", r#""no""#] {
            let raw: &RawValue = serde_json::from_str(ts).unwrap();
            let v: Value = serde_json::from_str(ts).unwrap();
            assert_eq!(raw_timestamp(raw), timestamp(&v), "{ts}");
        }
        for hs in [
            r#"{"X-A": ["1", "2"], "x-user-id": "u\u0031"}"#,
            r#"[["X-A", "1"], ["x-a", "2"], ["bad"], 7]"#,
            r#"{"x-n": 5, "x-l": ["a", 3]}"#,
            r#""x""#,
        ] {
            let raw: &RawValue = serde_json::from_str(hs).unwrap();
            let v: Value = serde_json::from_str(hs).unwrap();
            assert_eq!(raw_headers(Some(raw)), headers(&v), "{hs}");
        }
    }
}
