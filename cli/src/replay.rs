//! `ratewall replay`: a log of requests through the core on the log's own clock.

use crate::explain::Parts;
use crate::logformat::{self, Entry, LogFormat, Syntax, Template, Wanted};
use crate::{load, Failure};
use ratewall_core::eval::{evaluate, Check, CheckResult, Skip, Tally};
use ratewall_core::glob::normalize_path;
use ratewall_core::key::{client_key, parse_ip, IpSource};
use ratewall_core::rules::Rule;
use ratewall_core::{Algorithm, Config, Nanos};
use serde_json::{json, Value};
use std::borrow::Cow;
use std::collections::{BinaryHeap, HashMap};
use std::io::{BufRead, BufReader, IsTerminal, Read, Write as _};
use std::path::Path;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;

/// A hash map with foldhash's hasher: the counters are looked up once or twice per log line,
/// where SipHash was ~5 % of a replay (perf). Keys come from a log the operator chose to
/// replay, not from a live attacker, so flooding resistance is not what this map needs.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// `--format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FormatChoice {
    /// Tell the formats apart from the first lines.
    Auto,
    /// NGINX: `combined`, or the `--log-format` given.
    Nginx,
    /// Envoy: its default access-log format, or the `--log-format` given.
    Envoy,
    /// JSON lines: `{"ts", "method", "path", "headers", "ip", "duration_ms"}`.
    Jsonl,
}

/// What `ratewall replay` was asked.
pub struct Options<'a> {
    pub rules: &'a Path,
    pub log: &'a Path,
    pub format: FormatChoice,
    pub log_format: Option<&'a str>,
    pub top: usize,
    pub json: bool,
}

/// Lines longer than this are reported and skipped (their text is not kept), so one endless
/// line cannot grow the replay's memory.
const MAX_LINE: usize = 1 << 20;
/// How many unreadable lines are shown (all are counted).
const SHOWN_BAD: usize = 20;
/// Lines some format reads, in order, before `auto` decides the format.
const SNIFF_LINES: usize = 16;
/// Most lines read before `auto` decides, however few of them a format reads.
const SNIFF_MAX: usize = 1024;
/// Rejected keys tracked per rule; past it the least rejected half is dropped (the report
/// says so). Keeps a flood of distinct rejected clients from growing the replay.
const MAX_KEYS: usize = 1 << 16;
/// Rejected keys tracked over all the rules: each rule keeps at most its part of these (but
/// at least [`MIN_KEYS`]), so a document of many rules does not multiply [`MAX_KEYS`] (50
/// per-IP rules over 400,000 clients took 698 MB).
const MAX_KEYS_IN_ALL: usize = 1 << 18;
/// Rejected keys any rule may track.
const MIN_KEYS: usize = 1 << 10;
/// How long a request waits for those that started before it, where the log gives
/// durations ([`Counting`]); a line at most this much older than the clock is replayed at the
/// clock (see [`clock`]).
const REORDER_SLACK: Nanos = 60 * ratewall_core::algo::SECOND;

/// The time a request that started at `ts` and ended at `end` is replayed at, and the
/// replay's clock after it. A proxy's clock never goes back, but a log's lines can: Envoy
/// writes a request's `START_TIME` when it completes (NGINX its end, which replay takes
/// `$request_time` back), so a slow request is logged after later ones, and merged logs
/// interleave. The core takes a time before a counter's own as a clock step back and moves the
/// counter back with it, which forgets what it counted; so a request that started at most
/// [`REORDER_SLACK`] before the clock, or ended no further back (a slow one, logged when it
/// completed), is replayed at the clock. One further back starts the clock over from it, with
/// fresh counters (logs joined out of order, `zcat access.log.*.gz`), rather than piling that
/// stretch onto one instant; `None` then.
fn clock(now: Nanos, ts: Nanos, end: Nanos) -> Option<Nanos> {
    match now.checked_sub(ts) {
        None | Some(0) => Some(ts),
        Some(back) if back <= REORDER_SLACK || now.saturating_sub(end) <= REORDER_SLACK => Some(now),
        Some(_) => None,
    }
}

/// A concurrency slot a replayed request holds until it ends.
struct Held {
    /// When the request ended: the slot is given back once the clock reaches it.
    end: Nanos,
    /// When it was taken (the time the request was replayed at).
    taken: Nanos,
    cost: u64,
    limit: ratewall_core::Limit,
    key: Vec<u8>,
}

/// Ordered by end time, the earliest the greatest: a [`BinaryHeap`] of them gives the next
/// slot to give back.
impl Ord for Held {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.end.cmp(&self.end)
    }
}

impl PartialOrd for Held {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Held {
    fn eq(&self, other: &Self) -> bool {
        self.end == other.end
    }
}

impl Eq for Held {}

/// One rule's counts.
#[derive(Default)]
struct Counts {
    /// Requests the rule let through: counted and allowed, or on a plan it leaves unlimited.
    allowed: u64,
    /// Of `allowed`, the requests whose plan the rule leaves unlimited (counted by no limit).
    unlimited: u64,
    rejected: u64,
    shadow_rejected: u64,
    unkeyed: u64,
    /// Of `allowed`, the requests a leaky bucket admitted to wait their turn.
    delayed: u64,
    /// Rejections (or shadow "would reject"s) per counter key, with the key as the report
    /// shows it (rendered once per key, not per line).
    by_key: FastMap<Vec<u8>, (u64, String)>,
    /// Whether less rejected keys were dropped to stay within the rule's part of
    /// [`MAX_KEYS_IN_ALL`].
    pruned: bool,
}

/// How a rejected counter key reads in the report (`user=alice`, `ip=203.0.113.7`): the
/// one place the replay renders a key, from the identity of the first request rejected
/// under it.
fn render_key(config: &Config, rule: &Rule, values: Vec<Option<Vec<u8>>>, ip: Option<String>) -> String {
    Parts { path: String::new(), values, ip }.key_text(config, rule)
}

/// The replay's counters: a hash map updated in place (the core's `MemoryCounters` is a
/// B-tree that clones the key on every write), each state with the time from which it is
/// equivalent to a fresh one, so idle counters can be forgotten.
#[derive(Default)]
struct Counters {
    map: FastMap<Vec<u8>, (ratewall_core::State, Nanos)>,
    /// The size at which idle counters are next swept out.
    sweep_at: usize,
}

impl ratewall_core::eval::Counters for Counters {
    fn update(
        &mut self,
        check: &Check,
        _now: Nanos,
        f: &mut dyn FnMut(&ratewall_core::State, u64) -> ratewall_core::eval::Write,
    ) -> Result<(), ratewall_core::eval::StoreError> {
        match self.map.get_mut(check.key.as_slice()) {
            Some((state, idle)) => {
                if let Some((next, _)) = f(state, u64::MAX) {
                    *idle = check.limit.idle_at(&next);
                    *state = next;
                }
            }
            None => {
                if let Some((next, _)) = f(&ratewall_core::State::Fresh, u64::MAX) {
                    let idle = check.limit.idle_at(&next);
                    self.map.insert(check.key.clone(), (next, idle));
                }
            }
        }
        Ok(())
    }
}

impl Counters {
    /// Gives back a concurrency slot taken at `taken` under `key` (a request that ended). A
    /// counter already forgotten holds nothing to give back.
    fn release(&mut self, key: &[u8], limit: &ratewall_core::Limit, taken: Nanos, cost: u64) {
        if let Some((state, idle)) = self.map.get_mut(key) {
            let next = limit.refund(state, taken, cost);
            *idle = limit.idle_at(&next);
            *state = next;
        }
    }

    /// Forgets the counters idle since `before`, once the map has doubled since the last
    /// sweep: memory follows the keys active within their windows, not the log's length.
    fn sweep(&mut self, before: Nanos) {
        if self.map.len() < self.sweep_at.max(1 << 16) {
            return;
        }
        self.map.retain(|_, (_, idle)| *idle > before);
        self.sweep_at = self.map.len() * 2;
    }
}

/// A chunk of lines as a keying worker leaves them, in flat vectors (one allocation each per
/// batch, reused: the counting stage sends batches back to the worker that filled them, which
/// empties them, so memory is freed by the thread that allocated it).
#[derive(Default)]
struct Batch {
    recs: Vec<Rec>,
    /// The requests' checks, in order (`Rec::Request::checks` of them per request).
    checks: Vec<Check>,
    /// The matching rules that skipped each request.
    skipped: Vec<(usize, Skip)>,
    /// Per request, `identity headers + 1` spans into `text`: the identity values, then the
    /// client address's key (`None`: absent).
    spans: Vec<Option<(u32, u32)>>,
    text: Vec<u8>,
    /// Why `Rec::Bad` lines are not requests, by their index in the chunk (at most
    /// [`SHOWN_BAD`] per chunk: more are never shown).
    bad: Vec<(usize, String)>,
}

impl Batch {
    fn clear(&mut self) {
        self.recs.clear();
        self.checks.clear();
        self.skipped.clear();
        self.spans.clear();
        self.text.clear();
        self.bad.clear();
    }

    fn span(&mut self, v: Option<&[u8]>) {
        let span = v.and_then(|v| {
            let start = u32::try_from(self.text.len()).ok()?;
            self.text.extend_from_slice(v);
            Some((start, u32::try_from(self.text.len()).ok()?))
        });
        self.spans.push(span);
    }
}

#[derive(Clone, Copy)]
enum Rec {
    Blank,
    /// Not a request (the reason is in `Batch::bad` for the chunk's first [`SHOWN_BAD`]).
    Bad,
    Request {
        ts: Nanos,
        /// How long it took, if the log says.
        duration: Option<Nanos>,
        checks: u32,
        skipped: u32,
    },
}

/// What the reading stage needs.
struct Reader<'a> {
    config: &'a Config,
    wanted: Wanted,
}

/// The formats to try: the one asked for, or for `auto` every one (JSON lines, Envoy's
/// default, NGINX `combined`), or the `--log-format` given in its syntax.
fn candidates(choice: FormatChoice, log_format: Option<&str>, wanted: &Wanted) -> Result<Vec<LogFormat>, Failure> {
    let template = |syntax: Syntax, default: &str, name: &str| {
        let (name, text) = match log_format {
            Some(f) => (format!("{} --log-format", if syntax == Syntax::Nginx { "nginx" } else { "envoy" }), f),
            None => (name.to_owned(), default),
        };
        Template::compile(&name, text, syntax, wanted)
            // A format string of the operator's: a line matches all of it or is unreadable. So
            // does a line of Envoy's default format: Envoy writes header values as they came,
            // so one with `" "` in it shifts the fields after it, and the line, read with what
            // it appends left alone, keyed its request on an address its client chose. And a
            // line of NGINX's `main`, which is `combined` with one field more: only a line
            // that has it is read as `main`.
            .map(|t| if log_format.is_some() || text != logformat::NGINX_COMBINED { t.whole_lines() } else { t })
            .map(LogFormat::Text)
            .map_err(|e| {
                // A format of the other syntax than `--format` names: say so, not only what
                // the string lacks in this one's.
                let named =
                    |s: Syntax| if s == Syntax::Nginx { "nginx ($name variables)" } else { "envoy (%OPERATORS%)" };
                match log_format.map(Syntax::guess).filter(|g| *g != syntax) {
                    Some(other) => Failure::Usage(format!(
                        "--log-format: {e}; it is written in the syntax of {}, and --format {} reads {}",
                        named(other),
                        if syntax == Syntax::Nginx { "nginx" } else { "envoy" },
                        named(syntax)
                    )),
                    // Both syntaxes in one string: the one read finds what it needs written in
                    // the other's ("no time" beside a `$time_local`).
                    None if log_format.is_some_and(logformat::mixes_syntaxes) => Failure::Usage(format!(
                        "--log-format: {e}; it mixes NGINX $variables and Envoy %OPERATORS%, and was read as {}: \
                         a format is written in one of them",
                        named(syntax)
                    )),
                    None => Failure::Usage(format!("--log-format: {e}")),
                }
            })
    };
    Ok(match (choice, log_format) {
        (FormatChoice::Jsonl, Some(_)) => {
            return Err(Failure::Usage("--log-format is for --format nginx or envoy, not jsonl".to_owned()))
        }
        (FormatChoice::Jsonl, None) => vec![LogFormat::Jsonl],
        (FormatChoice::Nginx, Some(_)) => vec![template(Syntax::Nginx, "", "")?],
        // `main` first: a log of it reads as `combined` too, with its client's address left out.
        (FormatChoice::Nginx, None) => vec![
            template(Syntax::Nginx, logformat::NGINX_MAIN, "nginx main")?,
            template(Syntax::Nginx, logformat::NGINX_COMBINED, "nginx combined")?,
        ],
        (FormatChoice::Envoy, _) => vec![template(Syntax::Envoy, logformat::ENVOY_DEFAULT, "envoy default")?],
        (FormatChoice::Auto, Some(f)) => {
            let syntax = Syntax::guess(f);
            vec![template(syntax, "", "")?]
        }
        (FormatChoice::Auto, None) => vec![
            LogFormat::Jsonl,
            template(Syntax::Envoy, logformat::ENVOY_DEFAULT, "envoy default")?,
            template(Syntax::Nginx, logformat::NGINX_MAIN, "nginx main")?,
            template(Syntax::Nginx, logformat::NGINX_COMBINED, "nginx combined")?,
        ],
    })
}

impl Reader<'_> {
    /// Reads a chunk's lines into `batch`.
    fn chunk(&self, format: &LogFormat, chunk: &Chunk, batch: &mut Batch) {
        for (i, &(start, end, whole)) in chunk.lines.iter().enumerate() {
            let text = chunk.text.get(start as usize..end as usize).unwrap_or_default();
            if let Err(why) = self.line(format, text, whole, batch) {
                if batch.bad.len() < SHOWN_BAD {
                    batch.bad.push((i, why));
                }
                batch.recs.push(Rec::Bad);
            }
        }
    }

    /// Reads one line into `batch`; `Err`: why it is not a request.
    fn line(&self, format: &LogFormat, text: &[u8], whole: bool, batch: &mut Batch) -> Result<(), String> {
        let text = unmarked(text);
        if !whole {
            return Err(format!("longer than {} MiB, skipped", MAX_LINE >> 20));
        }
        if text.trim_ascii().is_empty() {
            batch.recs.push(Rec::Blank);
            return Ok(());
        }
        let entry = match format.read(&self.wanted, text) {
            Ok(e) => e,
            // A line the one-pass reading does not take (a field of another type) is read as a
            // JSON value, which takes what it can and says what is wrong.
            Err(_) if matches!(format, LogFormat::Jsonl) => json_value_entry(self.config, text)?,
            Err(why) => return Err(why),
        };
        // A target that is no path (`PRI * HTTP/2.0`, a scanner's bytes NGINX answered 400
        // itself) is no request a proxy hands its filter: counted, it stood for traffic the
        // rules never see. `OPTIONS *` is one.
        let target = crate::logformat::origin_form(&entry.path);
        let options = entry.method.as_deref().is_some_and(|m| m.eq_ignore_ascii_case("OPTIONS"));
        let a_path = target.starts_with(b"/") || (options && target == b"*");
        if !a_path {
            return Err(format!(
                "the request's target is not a path ({}): not a request a proxy passes on",
                crate::logformat::bytes(target.len())
            ));
        }
        self.request(&entry, batch);
        Ok(())
    }

    /// Keys a request: its counter checks, and its identity for rendering keys.
    fn request(&self, e: &Entry<'_>, batch: &mut Batch) {
        let config = self.config;
        let method = match e.method.as_deref() {
            None | Some("") => Cow::Borrowed("GET"),
            Some(m) if m.bytes().any(|b| b.is_ascii_lowercase()) => Cow::Owned(m.to_ascii_uppercase()),
            Some(m) => Cow::Borrowed(m),
        };
        let path = normalize_path(crate::logformat::origin_form(&e.path));
        let values: Vec<Option<&[u8]>> = e.headers.iter().map(|v| v.as_deref().filter(|v| !v.is_empty())).collect();
        let ip = client(&config.identity.ip, e.peer.as_deref(), e.xff.as_deref());
        let req = ratewall_core::Request { method: &method, path: &path, headers: &values, ip: ip.as_deref() };
        let (mut checks, mut skipped) = config.checks(&req);
        let (n_checks, n_skipped) = (checks.len(), skipped.len());
        batch.checks.append(&mut checks);
        batch.skipped.append(&mut skipped);
        for v in &values {
            batch.span(*v);
        }
        batch.span(ip.as_deref().map(str::as_bytes));
        batch.recs.push(Rec::Request {
            ts: e.ts,
            duration: e.duration,
            checks: u32::try_from(n_checks).unwrap_or(u32::MAX),
            skipped: u32::try_from(n_skipped).unwrap_or(u32::MAX),
        });
    }
}

/// The client address's key, found as the filter finds it: `X-Forwarded-For` counted from its
/// right end by `trusted_hops`, else the peer.
fn client<'a>(src: &IpSource, peer: Option<&'a str>, xff: Option<&'a [u8]>) -> Option<Cow<'a, str>> {
    let xff = xff.filter(|_| src.trusted_hops > 0);
    match (xff, peer) {
        // The peer alone, read as a one-entry list with one trusted hop: the same key, and
        // borrowed when the address is already its own key (a dotted quad at /32).
        (None, Some(p)) if !p.contains(',') => {
            client_key(|| None, Some(p.as_bytes()), &IpSource { trusted_hops: 1, ..*src })
        }
        _ => client_key(|| peer.and_then(|p| parse_ip(p.as_bytes())), xff, src),
    }
}

/// A JSON line read as a `Value`: slower, and it says what is wrong.
fn json_value_entry<'a>(config: &Config, text: &[u8]) -> Result<Entry<'a>, String> {
    let value: Value = serde_json::from_slice(text).map_err(|e| format!("not JSON: {e}"))?;
    let needs = || "needs \"ts\" (RFC 3339 or epoch seconds) and \"path\"".to_owned();
    // A field that is there but cannot be read is named, with its kind or length (not its text).
    let ts = match &value["ts"] {
        Value::Null => return Err(needs()),
        v => timestamp(v).ok_or_else(|| match v {
            Value::String(s) => {
                format!("cannot read \"ts\" ({}; RFC 3339 or epoch seconds)", logformat::bytes(s.len()))
            }
            Value::Number(_) => "cannot read \"ts\" (a number; epoch seconds from 1970)".to_owned(),
            other => format!("\"ts\" is {}, not a time (RFC 3339 or epoch seconds)", kind(other)),
        })?,
    };
    let path = match &value["path"] {
        Value::String(p) => p,
        Value::Null => return Err(needs()),
        other => return Err(format!("\"path\" is {}, not a string", kind(other))),
    };
    let method = match &value["method"] {
        Value::Null => None,
        Value::String(m) if logformat::method(m.as_bytes()).is_some() => Some(Cow::Owned(m.clone())),
        Value::String(m) => return Err(format!("cannot read the method ({})", logformat::bytes(m.len()))),
        other => return Err(format!("\"method\" is {}, not a string", kind(other))),
    };
    let peer = match &value["ip"] {
        Value::Null => None,
        Value::String(ip) if parse_ip(ip.as_bytes()).is_some() => Some(Cow::Owned(ip.clone())),
        Value::String(ip) => return Err(format!("cannot read the client address ({})", logformat::bytes(ip.len()))),
        other => return Err(format!("\"ip\" is {}, not a string", kind(other))),
    };
    let duration = match &value["duration_ms"] {
        Value::Null => None,
        v @ (Value::String(_) | Value::Number(_)) => {
            let text = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
            let d = logformat::duration(text.as_bytes(), logformat::Unit::Millis);
            let bad = || format!("cannot read \"duration_ms\" ({}; milliseconds)", logformat::bytes(text.len()));
            Some(d.ok_or_else(bad)?)
        }
        other => return Err(format!("\"duration_ms\" is {}, not a number", kind(other))),
    };
    let hs = headers(&value["headers"])?;
    let first =
        |h: &str| hs.iter().find(|(n, v)| n == h && !v.is_empty()).map(|(_, v)| Cow::Owned(v.as_bytes().to_vec()));
    let xff: Vec<&str> = hs.iter().filter(|(n, _)| n == "x-forwarded-for").map(|(_, v)| v.as_str()).collect();
    Ok(Entry {
        ts,
        duration,
        method,
        path: Cow::Owned(path.as_bytes().to_vec()),
        headers: config.identity.headers.iter().map(|(_, h)| first(h)).collect(),
        xff: (!xff.is_empty()).then(|| Cow::Owned(xff.join(", ").into_bytes())),
        peer,
    })
}

/// A header's name as a message shows it: as written when it is one (a token of at most 64
/// bytes), else only its length; never a value.
fn header_name(name: &str) -> String {
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if (1..=64).contains(&name.len()) && name.bytes().all(token) {
        format!("{name:?}")
    } else {
        format!("a header name of {}", logformat::bytes(name.len()))
    }
}

/// What a JSON value is, for a message (never the value: a header's may be a secret).
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A line's time as a JSON value: RFC 3339 (`2026-12-01T10:00:00.250Z`), or seconds since
/// the epoch (fractions allowed), a number or a string.
pub fn timestamp(v: &Value) -> Option<Nanos> {
    match v {
        Value::String(s) => logformat::time_string(s),
        Value::Number(n) => logformat::epoch_seconds(n.to_string().as_bytes()),
        _ => None,
    }
}

/// A line's headers as a JSON value: an object of name → value (a string, or a list of
/// strings for a field sent several times), or a list of `[name, value]` pairs of strings;
/// `null` (for the headers or a value) is absent. `Err`: the value is of another shape (the
/// message names the header, never its value).
fn headers(v: &Value) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    match v {
        Value::Null => {}
        Value::Array(pairs) => {
            for p in pairs {
                match p.as_array().map(Vec::as_slice) {
                    Some([Value::String(n), Value::String(val)]) => out.push((n.to_ascii_lowercase(), val.clone())),
                    Some([Value::String(_), Value::Null]) => {}
                    _ => return Err(format!("\"headers\" has {}, not a [name, value] pair of strings", kind(p))),
                }
            }
        }
        Value::Object(o) => {
            for (name, value) in o {
                let bad = |what: &Value| format!("\"headers\": {} is {}, not a string", header_name(name), kind(what));
                match value {
                    Value::String(s) => out.push((name.to_ascii_lowercase(), s.clone())),
                    Value::Null => {}
                    Value::Array(a) => {
                        for s in a {
                            let s = s.as_str().ok_or_else(|| bad(s))?;
                            out.push((name.to_ascii_lowercase(), s.to_owned()));
                        }
                    }
                    other => return Err(bad(other)),
                }
            }
        }
        other => return Err(format!("\"headers\" is {}, not an object or a list of [name, value] pairs", kind(other))),
    }
    Ok(out)
}

/// Reads the next line into `buf` without its line end: `None` at the end of the input,
/// `Some(false)` for a line longer than [`MAX_LINE`] (its rest is read past, not kept).
fn next_line(r: &mut impl BufRead, buf: &mut Vec<u8>) -> std::io::Result<Option<bool>> {
    buf.clear();
    let (mut any, mut whole) = (false, true);
    loop {
        let chunk = match r.fill_buf() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if chunk.is_empty() {
            break;
        }
        any = true;
        let (take, ends) = match memchr::memchr(b'\n', chunk) {
            Some(i) => (i, true),
            None => (chunk.len(), false),
        };
        let room = MAX_LINE.saturating_sub(buf.len());
        whole &= take <= room;
        buf.extend_from_slice(chunk.get(..take.min(room)).unwrap_or_default());
        r.consume(take + usize::from(ends));
        if ends {
            break;
        }
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(any.then_some(whole))
}

/// Lines as read, for a keying worker: their text and, per line, its span and whether it is
/// whole (a line longer than [`MAX_LINE`] is not).
#[derive(Default)]
struct Chunk {
    text: Vec<u8>,
    lines: Vec<(u32, u32, bool)>,
}

/// Lines per chunk (and per batch).
const CHUNK_LINES: usize = 1024;

impl Chunk {
    fn push(&mut self, line: &[u8], whole: bool) {
        let start = self.text.len();
        self.text.extend_from_slice(line);
        let span = (u32::try_from(start).unwrap_or(u32::MAX), u32::try_from(self.text.len()).unwrap_or(u32::MAX));
        self.lines.push((span.0, span.1, whole));
    }
}

/// Reads the first lines (for `auto`).
fn sniff(reader: &mut impl BufRead, name: &str, readable: impl Fn(&[u8]) -> bool) -> Result<Chunk, Failure> {
    let (mut first, mut buf) = (Chunk::default(), Vec::new());
    let (mut lines, mut read) = (0, 0);
    // Lines no format reads (a banner, a log's junk before its requests) do not count towards
    // the sample, up to [`SNIFF_MAX`] lines: 16 of them first had every format read nothing,
    // and the log was read as `combined`, every request unreadable.
    while lines < SNIFF_LINES && read < SNIFF_MAX {
        match next_line(reader, &mut buf) {
            Ok(Some(whole)) => {
                read += 1;
                lines += usize::from(!buf.trim_ascii().is_empty() && readable(unmarked(&buf)));
                first.push(&buf, whole);
            }
            Ok(None) => break,
            Err(e) => return Err(Failure::Usage(format!("reading {name}: {e}"))),
        }
    }
    Ok(first)
}

/// The splitting stage: the input cut into chunks of whole lines (`first` the lines already
/// read), dealt to the keying workers in turn. A read error ends it, sent to the worker whose
/// turn it is.
fn split(mut reader: impl BufRead, first: Chunk, to: &[SyncSender<Result<Chunk, String>>], name: &str) {
    let mut buf = Vec::new();
    let mut chunk = first;
    for turn in (0..to.len()).cycle() {
        let Some(tx) = to.get(turn) else { return };
        while chunk.lines.len() < CHUNK_LINES {
            match next_line(&mut reader, &mut buf) {
                Ok(Some(whole)) => chunk.push(&buf, whole),
                Ok(None) => {
                    let _ = tx.send(Ok(chunk));
                    return;
                }
                Err(e) => {
                    let _ = tx.send(Err(format!("reading {name}: {e}")));
                    return;
                }
            }
        }
        if tx.send(Ok(std::mem::take(&mut chunk))).is_err() {
            return;
        }
    }
}

/// A keying worker: each chunk it is dealt, read and keyed into a batch (an emptied one the
/// counting stage gave back when there is one).
fn key_chunks(
    r: &Reader<'_>,
    format: &LogFormat,
    from: &Receiver<Result<Chunk, String>>,
    to: &SyncSender<Result<Batch, String>>,
    spare: &Receiver<Batch>,
) {
    for chunk in from {
        let out = chunk.map(|chunk| {
            let mut batch = spare.try_recv().unwrap_or_default();
            batch.clear();
            r.chunk(format, &chunk, &mut batch);
            batch
        });
        if to.send(out).is_err() {
            return;
        }
    }
}

/// A line without the UTF-8 byte order mark some tools write before a file's first line.
fn unmarked(line: &[u8]) -> &[u8] {
    line.strip_prefix(b"\xef\xbb\xbf").unwrap_or(line)
}

/// The format `auto` picks: the candidate that reads the most of the first lines (the earlier
/// on a tie); with none reading any, the one the first line's look suggests, so its errors are
/// in the right terms.
fn pick(candidates: Vec<LogFormat>, wanted: &Wanted, first: &[&[u8]]) -> Option<LogFormat> {
    if candidates.len() == 1 {
        return candidates.into_iter().next();
    }
    let reads = |f: &LogFormat| first.iter().filter(|l| f.read(wanted, l).is_ok()).count();
    let best = candidates.iter().map(reads).max().unwrap_or(0);
    // `combined` reads a `main` line too (what follows its fields is left), and `main` no line
    // of `combined`: a log most of whose lines `main` reads is `main`, its other lines
    // unreadable (one line without the field had every request keyed on the load balancer).
    if let Some(main) = candidates.iter().position(|f| f.name() == "nginx main") {
        if best > 0 && candidates.get(main).map_or(0, reads) * 2 > best {
            return candidates.into_iter().nth(main);
        }
    }
    if best > 0 {
        return candidates.into_iter().find(|f| reads(f) == best);
    }
    let look = first.iter().map(|l| l.trim_ascii()).find(|l| !l.is_empty()).and_then(|l| l.first().copied());
    let want = match look {
        Some(b'{') => "jsonl",
        Some(b'[') => "envoy default",
        _ => "nginx combined",
    };
    let at = candidates.iter().position(|f| f.name() == want).unwrap_or(0);
    candidates.into_iter().nth(at)
}

/// `input` as buffered text: a gzip stream (a log rotated by logrotate, `access.log.2.gz`;
/// several members, as `cat a.gz b.gz` makes, read as one) decompressed; an error naming the
/// tool to pipe it through for other compressions, whose bytes would otherwise each be an
/// unreadable line. Plain text is read through the one buffer its first bytes were looked at
/// in.
fn decompressed(
    input: Box<dyn Read + Send>,
    name: &str,
    trailing: &Trailing,
) -> Result<Box<dyn BufRead + Send>, Failure> {
    const BUFFER: usize = 1 << 20;
    let mut raw = BufReader::with_capacity(BUFFER, input);
    let head = raw.fill_buf().map_err(|e| Failure::Usage(format!("cannot read {name}: {e}")))?;
    if head.starts_with(&[0x1f, 0x8b]) {
        let members = Members { member: Some(flate2::bufread::GzDecoder::new(raw)), trailing: Arc::clone(trailing) };
        return Ok(Box::new(BufReader::with_capacity(BUFFER, members)));
    }
    let other =
        [(&b"\x28\xb5\x2f\xfd"[..], "zstd", "zstdcat"), (b"BZh", "bzip2", "bzcat"), (b"\xfd7zXZ\0", "xz", "xzcat")];
    if let Some((_, what, tool)) = other.iter().find(|(magic, _, _)| head.starts_with(magic)) {
        let how = if name == "-" {
            format!("`… | {tool} | ratewall replay RULES -`")
        } else {
            format!("`{tool} {name} | ratewall replay RULES -`")
        };
        return Err(Failure::Usage(format!("{name} is {what}-compressed: read it through {tool} ({how})")));
    }
    Ok(Box::new(raw))
}

/// Whether a gzip file went on past its last member with bytes that begin no other.
type Trailing = Arc<std::sync::atomic::AtomicBool>;

/// A gzip file's members one after another (`cat a.gz b.gz`), then its end. Bytes after a
/// member that begin no other (zeros a copy left, text appended) end it, as gzip takes them
/// (it warns, and so does replay), where a decoder of members read them as a broken one and
/// the whole replay failed. A member cut short is still an error.
struct Members<R: BufRead> {
    member: Option<flate2::bufread::GzDecoder<R>>,
    trailing: Trailing,
}

impl<R: BufRead> Read for Members<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let Some(member) = self.member.as_mut() else { return Ok(0) };
            let n = member.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            // The member ended: another begins, or the file ends here.
            let Some(member) = self.member.take() else { return Ok(0) };
            let mut rest = member.into_inner();
            let head = rest.fill_buf()?;
            if head.is_empty() {
                return Ok(0);
            }
            if head.first() != Some(&0x1f) || head.get(1).is_some_and(|b| *b != 0x8b) {
                self.trailing.store(true, std::sync::atomic::Ordering::Relaxed);
                return Ok(0);
            }
            self.member = Some(flate2::bufread::GzDecoder::new(rest));
        }
    }
}

/// `ratewall replay`.
pub fn replay(o: &Options<'_>) -> Result<(), Failure> {
    if crate::is_stdin(o.rules) && crate::is_stdin(o.log) {
        return Err(Failure::Usage("the rules document and the log cannot both be standard input (\"-\")".to_owned()));
    }
    let (_, config) = load(o.rules)?;
    let wanted = Wanted::new(config.identity.headers.iter().map(|(_, h)| h.clone()).collect());
    let candidates = candidates(o.format, o.log_format, &wanted)?;
    let input: Box<dyn Read + Send> = if crate::is_stdin(o.log) {
        Box::new(std::io::stdin())
    } else {
        Box::new(
            std::fs::File::open(o.log).map_err(|e| Failure::Usage(format!("cannot read {}: {e}", o.log.display())))?,
        )
    };
    let name = o.log.display().to_string();
    let trailing = Trailing::default();
    let mut input = decompressed(input, &name, &trailing)?;
    let first =
        sniff(&mut input, &name, |l| candidates.len() == 1 || candidates.iter().any(|f| f.read(&wanted, l).is_ok()))?;
    let sample: Vec<&[u8]> = first
        .lines
        .iter()
        .map(|&(a, b, _)| unmarked(first.text.get(a as usize..b as usize).unwrap_or_default()))
        .collect();
    let format = pick(candidates, &wanted, &sample).ok_or_else(|| Failure::Usage("no log format".to_owned()))?;
    let reader = Reader { config: &config, wanted };
    let mut counting = Counting::new(&config);
    let (mut lines, mut invalid) = (0u64, 0u64);
    let mut shown = Vec::new();
    // The same lines' numbers and reasons, for `--json`.
    let mut bad: Vec<(u64, String)> = Vec::new();
    let progress = std::io::stderr().is_terminal();
    let started = std::time::Instant::now();
    let heads = config.identity.headers.len() + 1;
    // Stages on their own threads, in order: one cuts the input into chunks of lines, workers
    // read and key the chunks (format, identity, counter keys: most of the work) in turn, and
    // this thread runs their requests through the counters on the log's own clock, taking the
    // workers' batches in the order the chunks were dealt.
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8));
    let mut chunks_tx = Vec::new();
    let mut batches_rx = Vec::new();
    let mut spares_tx = Vec::new();
    std::thread::scope(|scope| -> Result<(), Failure> {
        let (reader, format) = (&reader, &format);
        for _ in 0..workers {
            let (chunk_tx, chunk_rx) = std::sync::mpsc::sync_channel(4);
            let (batch_tx, batch_rx) = std::sync::mpsc::sync_channel(4);
            let (spare_tx, spare_rx) = std::sync::mpsc::sync_channel::<Batch>(4);
            scope.spawn(move || key_chunks(reader, format, &chunk_rx, &batch_tx, &spare_rx));
            chunks_tx.push(chunk_tx);
            batches_rx.push(batch_rx);
            spares_tx.push(spare_tx);
        }
        let name = &name;
        scope.spawn(move || split(input, first, &chunks_tx, name));
        'batches: for turn in (0..workers).cycle() {
            let (Some(rx), Some(back)) = (batches_rx.get(turn), spares_tx.get(turn)) else { break };
            let Ok(item) = rx.recv() else { break 'batches };
            let batch = item.map_err(Failure::Usage)?;
            for (i, why) in &batch.bad {
                if shown.len() < SHOWN_BAD {
                    let line = lines + *i as u64 + 1;
                    shown.push(format!("{name}:{line}: {why}"));
                    bad.push((line, why.to_string()));
                }
            }
            let (mut c0, mut s0, mut v0) = (0usize, 0usize, 0usize);
            for rec in &batch.recs {
                lines += 1;
                let (ts, duration, n_checks, n_skipped) = match *rec {
                    Rec::Blank => continue,
                    Rec::Bad => {
                        invalid += 1;
                        continue;
                    }
                    Rec::Request { ts, duration, checks, skipped } => (ts, duration, checks as usize, skipped as usize),
                };
                let checks = batch.checks.get(c0..c0 + n_checks).unwrap_or_default();
                let skipped = batch.skipped.get(s0..s0 + n_skipped).unwrap_or_default();
                let spans = batch.spans.get(v0..v0 + heads).unwrap_or_default();
                (c0, s0, v0) = (c0 + n_checks, s0 + n_skipped, v0 + heads);
                let values = Values::Spans(spans, &batch.text);
                counting.arrive(Arrival { ts, duration, checks, skipped, values });
            }
            counting.sweep();
            if progress && lines / 100_000 != (lines - batch.recs.len() as u64) / 100_000 {
                let _ = write!(
                    std::io::stderr().lock(),
                    "\rreplayed {lines} lines in {:.1} s",
                    started.elapsed().as_secs_f64()
                );
            }
            let _ = back.try_send(batch);
        }
        Ok(())
    })?;
    if progress && lines >= 100_000 {
        tell!();
    }
    counting.finish();
    let Counting { counts, requests, rejected, restarts, .. } = counting;
    report(o, &config, &counts, (lines, requests, rejected, invalid), (format.name(), restarts), &bad);
    if trailing.load(std::sync::atomic::Ordering::Relaxed) {
        tell!("{name}: what follows its last gzip member is not gzip: ignored (gzip ignores it too)");
    }
    // Unreadable lines are a finding of the replay, reported, not a failure of it.
    if invalid > 0 {
        shown.push(format!("{} could not be read", plural(invalid, "log line")));
        let mut err = std::io::stderr().lock();
        for line in shown {
            let _ = writeln!(err, "{line}");
        }
    }
    Ok(())
}

/// Where a request's identity values are: spans of a batch's text (a request counted as it
/// arrives), or its own copies (one that waited its turn).
enum Values<'a> {
    Spans(&'a [Option<(u32, u32)>], &'a [u8]),
    Owned(&'a [Option<Vec<u8>>]),
}

impl Values<'_> {
    /// Each identity value, then the client address's key.
    fn owned(&self) -> Vec<Option<Vec<u8>>> {
        match self {
            Values::Spans(spans, text) => spans
                .iter()
                .map(|s| s.and_then(|(a, b)| text.get(a as usize..b as usize)).map(<[u8]>::to_vec))
                .collect(),
            Values::Owned(v) => v.to_vec(),
        }
    }
}

/// A request as read: when it started, how long it took (if the log says), its checks, the
/// rules that skipped it, and its identity values.
struct Arrival<'a> {
    ts: Nanos,
    duration: Option<Nanos>,
    checks: &'a [Check],
    skipped: &'a [(usize, Skip)],
    values: Values<'a>,
}

/// A request waiting for the requests that started before it, which the log may write after
/// it: [`Counting`] counts them in the order they started.
struct Waiting {
    ts: Nanos,
    /// Its place in the log, among requests that started at the same time.
    seq: u64,
    duration: Nanos,
    checks: Vec<Check>,
    skipped: Vec<(usize, Skip)>,
    values: Vec<Option<Vec<u8>>>,
}

impl Waiting {
    /// About how many bytes it holds.
    fn bytes(&self) -> usize {
        let checks: usize = self.checks.iter().map(|c| std::mem::size_of::<Check>() + c.key.len()).sum();
        let values: usize = self.values.iter().map(|v| 24 + v.as_ref().map_or(0, Vec::len)).sum();
        std::mem::size_of::<Self>() + checks + values + self.skipped.len() * 16
    }
}

/// The earliest to start (then the first in the log) the greatest: a [`BinaryHeap`] of them
/// gives the next to count.
impl Ord for Waiting {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.ts, other.seq).cmp(&(self.ts, self.seq))
    }
}

impl PartialOrd for Waiting {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Waiting {
    fn eq(&self, other: &Self) -> bool {
        (self.ts, self.seq) == (other.ts, other.seq)
    }
}

impl Eq for Waiting {}

/// Most requests held back for those that started before them, and most bytes they hold
/// (their checks' keys and identity values: a request of a document of many rules holds a
/// check per rule); past either, the earliest are counted (a later line that started before
/// them is then counted late, as [`clock`] says).
const MAX_WAITING: usize = 1 << 18;
const MAX_WAITING_BYTES: usize = 64 << 20;

/// The counting stage: requests through the counters on the log's own clock, in the order
/// they started. A proxy writes a request's line when it completes (NGINX its end, with
/// `$request_time`; Envoy its `START_TIME`), so a slow request's line comes after those of
/// requests that started after it; counted as its line came, it was counted late (a request
/// that started in the last window, counted in this one; a long export counted after the
/// short requests it held a slot against). So where lines give durations, a request waits
/// until the latest end read is [`REORDER_SLACK`] past its start (or [`MAX_WAITING`] wait):
/// the lines still to come hold no request that started before it unless it took longer than
/// that. (Waiting only as long as the longest duration read so far left the first slow
/// request of a log, the one that matters, counted late.) A log without durations is counted
/// as read.
struct Counting<'a> {
    config: &'a Config,
    counts: Vec<Counts>,
    counters: Counters,
    /// The concurrency slots of requests still in flight, the earliest to end first.
    held: BinaryHeap<Held>,
    /// The replay's clock.
    now: Nanos,
    requests: u64,
    rejected: u64,
    /// Times the clock started over (a request further back than [`REORDER_SLACK`]).
    restarts: u64,
    waiting: BinaryHeap<Waiting>,
    /// About how many bytes the requests waiting hold.
    waiting_bytes: usize,
    seq: u64,
    /// The latest end read, and whether any line said how long its request took.
    latest_end: Nanos,
    durations: bool,
    /// Rejected keys each rule tracks: its part of [`MAX_KEYS_IN_ALL`].
    keys_kept: usize,
}

impl<'a> Counting<'a> {
    fn new(config: &'a Config) -> Counting<'a> {
        Counting {
            config,
            counts: config.rules.iter().map(|_| Counts::default()).collect(),
            counters: Counters::default(),
            held: BinaryHeap::new(),
            now: 0,
            requests: 0,
            rejected: 0,
            restarts: 0,
            waiting: BinaryHeap::new(),
            waiting_bytes: 0,
            seq: 0,
            latest_end: 0,
            durations: false,
            keys_kept: (MAX_KEYS_IN_ALL / config.rules.len().max(1)).clamp(MIN_KEYS, MAX_KEYS),
        }
    }

    /// How far before the latest end read a request must have started to be counted.
    fn lag(&self) -> Nanos {
        if self.durations {
            REORDER_SLACK
        } else {
            0
        }
    }

    /// A request read: counted now, or when the requests that may have started before it
    /// have been read.
    fn arrive(&mut self, a: Arrival<'_>) {
        let duration = a.duration.unwrap_or(0);
        let end = a.ts.saturating_add(duration);
        // A request that ended further back than the lines still waiting can wait for: a
        // stretch of log from earlier (`zcat -f access.log*` reads the newest first). The
        // stretch before it is counted whole first, in its order, then this one is waited
        // for on its own clock (else the one before's last minute, still waiting, was
        // counted after it, against its counters).
        if end.saturating_add(REORDER_SLACK) < self.latest_end {
            self.finish();
            self.latest_end = end;
        }
        self.latest_end = self.latest_end.max(end);
        self.durations |= a.duration.is_some();
        let ready = |c: &Self, ts: Nanos| ts.saturating_add(c.lag()) <= c.latest_end;
        if self.waiting.is_empty() && ready(self, a.ts) {
            self.count(a.ts, duration, a.checks, a.skipped, &a.values);
            return;
        }
        self.seq += 1;
        let w = Waiting {
            ts: a.ts,
            seq: self.seq,
            duration,
            checks: a.checks.to_vec(),
            skipped: a.skipped.to_vec(),
            values: a.values.owned(),
        };
        self.waiting_bytes += w.bytes();
        self.waiting.push(w);
        let full = |c: &Self| c.waiting.len() > MAX_WAITING || c.waiting_bytes > MAX_WAITING_BYTES;
        while self.waiting.peek().is_some_and(|w| ready(self, w.ts) || full(self)) {
            self.count_next();
        }
    }

    /// Counts the earliest request waiting.
    fn count_next(&mut self) {
        if let Some(w) = self.waiting.pop() {
            self.waiting_bytes = self.waiting_bytes.saturating_sub(w.bytes());
            self.count(w.ts, w.duration, &w.checks, &w.skipped, &Values::Owned(&w.values));
        }
    }

    /// The log has ended: every request waiting is counted.
    fn finish(&mut self) {
        while !self.waiting.is_empty() {
            self.count_next();
        }
    }

    /// Forgets the counters that are as a fresh one would be by the clock: the clock never
    /// goes back but to start over, with fresh counters, so what they held counts for
    /// nothing any more. (Kept a minute longer, 50 per-IP rules of a second held 6 million
    /// counters, 730 MB, at 2,000 lines a second.)
    fn sweep(&mut self) {
        self.counters.sweep(self.now);
    }

    /// Runs a request that started at `ts` through the counters.
    fn count(&mut self, ts: Nanos, duration: Nanos, checks: &[Check], skipped: &[(usize, Skip)], values: &Values<'_>) {
        let config = self.config;
        let end = ts.saturating_add(duration);
        self.now = clock(self.now, ts, end).unwrap_or_else(|| {
            self.counters = Counters::default();
            self.held.clear();
            self.restarts += 1;
            ts
        });
        let now = self.now;
        // The requests that ended by now give their slots back, in the order they ended.
        while self.held.peek().is_some_and(|h| h.end <= now) {
            if let Some(h) = self.held.pop() {
                self.counters.release(&h.key, &h.limit, h.taken, h.cost);
            }
        }
        let outcome = evaluate(config, checks, &mut self.counters, now);
        if !outcome.rejected {
            hold(&mut self.held, &mut self.counters, checks, &outcome, now, end);
            // A leaky bucket's admitted request that waits its turn, as the filter counts it.
            for (c, o) in checks.iter().zip(&outcome.checks) {
                let CheckResult::Decided(d) = o.result else { continue };
                if c.limit.algorithm() == Algorithm::LeakyBucket && d.allowed && c.limit.wait(&d, c.cost) > 0 {
                    if let Some(n) = self.counts.get_mut(c.rule) {
                        n.delayed += 1;
                    }
                }
            }
        }
        self.requests += 1;
        self.rejected += u64::from(outcome.rejected);
        for (rule, tally) in outcome.tally(skipped) {
            let (Some(c), Some(r)) = (self.counts.get_mut(rule), config.rules.get(rule)) else { continue };
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
                    if let Some(e) = c.by_key.get_mut(key.as_slice()) {
                        e.0 += 1;
                        continue;
                    }
                    let mut values = values.owned();
                    let ip = values.pop().flatten().map(|v| String::from_utf8_lossy(&v).into_owned());
                    let shown = render_key(config, r, values, ip);
                    c.by_key.insert(key.clone(), (1, shown));
                    if c.by_key.len() > self.keys_kept {
                        prune(c);
                    }
                }
                Tally::Failed(_) => {}
            }
        }
        // A plan the rule leaves unlimited: the rule lets the request through.
        for (rule, _) in skipped.iter().filter(|(_, why)| *why == Skip::Unlimited) {
            if let Some(c) = self.counts.get_mut(*rule) {
                c.allowed += 1;
                c.unlimited += 1;
            }
        }
    }
}

/// Keeps the concurrency slots an admitted request took (replayed at `now`, ended at `end`)
/// until it ends: given back at once when it has ended already (a log that gives no duration
/// says nothing of how long a request held its slot, so it holds none past its own instant),
/// kept for the clock to reach `end` else. A slot the core frees by itself before `end`
/// (`hold_max` after it was taken) is not kept.
fn hold(
    held: &mut BinaryHeap<Held>,
    counters: &mut Counters,
    checks: &[Check],
    outcome: &ratewall_core::eval::Outcome,
    now: Nanos,
    end: Nanos,
) {
    for (check, co) in checks.iter().zip(&outcome.checks) {
        let taken = matches!(co.result, CheckResult::Decided(d) if d.allowed) && check.cost > 0;
        if !taken || check.limit.algorithm() != Algorithm::Concurrent {
            continue;
        }
        if end <= now {
            counters.release(&check.key, &check.limit, now, check.cost);
        } else if end - now < check.limit.per() {
            held.push(Held { end, taken: now, cost: check.cost, limit: check.limit, key: check.key.clone() });
        }
    }
}

/// Drops the less rejected half of a rule's keys: the more rejected half is kept, and of keys
/// rejected as often as the last of it, as many as fill it (keeping only those above the
/// median dropped every key when most were rejected as often as the most rejected).
fn prune(c: &mut Counts) {
    let mut n: Vec<u64> = c.by_key.values().map(|(n, _)| *n).collect();
    n.sort_unstable_by(|a, b| b.cmp(a));
    let keep = n.len() / 2;
    let cut = n.get(keep.saturating_sub(1)).copied().unwrap_or(0);
    let mut at_cut = keep.saturating_sub(n.iter().take(keep).filter(|&&x| x > cut).count());
    c.by_key.retain(|_, (n, _)| {
        let kept = *n > cut || (*n == cut && at_cut > 0);
        if *n == cut && kept {
            at_cut -= 1;
        }
        kept
    });
    c.pruned = true;
}

/// The most rejected keys of a rule, as shown.
fn top_of(c: &Counts, top: usize) -> Vec<(String, u64)> {
    // Counters of one identity under two limits (a plan change) are one key to a reader.
    let mut by_text: HashMap<&str, u64> = HashMap::new();
    for (n, text) in c.by_key.values() {
        *by_text.entry(text).or_default() += n;
    }
    let mut keys: Vec<(&str, u64)> = by_text.into_iter().collect();
    keys.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    keys.into_iter().take(top).map(|(k, n)| (k.to_owned(), n)).collect()
}

fn report(
    o: &Options<'_>,
    config: &Config,
    counts: &[Counts],
    totals: (u64, u64, u64, u64),
    (format, restarts): (&str, u64),
    bad: &[(u64, String)],
) {
    let (lines, requests, rejected, invalid) = totals;
    if o.json {
        let rules: Vec<Value> = config
            .rules
            .iter()
            .zip(counts)
            .map(|(r, c)| {
                let keys: Vec<Value> =
                    top_of(c, o.top).into_iter().map(|(k, n)| json!({"key": k, "rejected": n})).collect();
                // Every field always, so a script reads one shape.
                json!({"name": r.name, "allowed": c.allowed, "unlimited": c.unlimited, "delayed": c.delayed, "rejected": c.rejected,
                       "shadow_rejected": c.shadow_rejected, "unkeyed": c.unkeyed, "top_rejected_keys": keys,
                       "top_rejected_keys_approximate": c.pruned})
            })
            .collect();
        say!(
            "{}",
            json!({"lines": lines, "requests": requests, "rejected": rejected, "invalid_lines": invalid,
                   "invalid": bad.iter().map(|(line, why)| json!({"line": line, "reason": why})).collect::<Vec<_>>(),
                   "format": format, "clock_restarts": restarts, "rules": rules})
        );
        return;
    }
    say!(
        "{} replayed, {rejected} rejected ({}, {invalid} invalid; read as {format})",
        plural(requests, "request"),
        plural(lines, "line")
    );
    if restarts > 0 {
        say!(
            "(the log's clock went back more than a minute {}: the counters started over from each such line)",
            plural(restarts, "time")
        );
    }
    for (r, c) in config.rules.iter().zip(counts) {
        let shadow = if c.shadow_rejected > 0 {
            format!(", would reject {} (shadow)", c.shadow_rejected)
        } else {
            String::new()
        };
        let unlimited =
            if c.unlimited > 0 { format!(" ({} on an unlimited plan)", c.unlimited) } else { String::new() };
        let unlimited = if c.delayed > 0 { format!("{unlimited} ({} delayed)", c.delayed) } else { unlimited };
        say!("- {}: allowed {}{unlimited}, rejected {}{shadow}, unkeyed {}", r.name, c.allowed, c.rejected, c.unkeyed);
        if c.pruned {
            say!("    (more keys rejected than are tracked: the least rejected were not)");
        }
        for (k, n) in top_of(c, o.top) {
            say!("    {n:>8}  {k}");
        }
    }
}

/// `n` and a noun, in the plural unless `n` is 1.
fn plural(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn pruning_keeps_the_more_rejected_half_of_the_keys_ties_included() {
        let mut c = Counts::default();
        for i in 0..10u64 {
            c.by_key.insert(i.to_be_bytes().to_vec(), (1, format!("user={i}")));
        }
        c.by_key.insert(b"mallory".to_vec(), (4, "user=mallory".into()));
        prune(&mut c);
        assert_eq!(c.by_key.len(), 5);
        assert_eq!(c.by_key.get(b"mallory".as_slice()).map(|v| v.0), Some(4));
        assert!(c.pruned);
        // Counts apart: the half above the cut.
        let mut c = Counts::default();
        for i in 0..8u64 {
            c.by_key.insert(i.to_be_bytes().to_vec(), (i, format!("user={i}")));
        }
        prune(&mut c);
        let mut kept: Vec<u64> = c.by_key.values().map(|v| v.0).collect();
        kept.sort_unstable();
        assert_eq!(kept, [4, 5, 6, 7]);
    }

    #[test]
    fn headers_are_an_object_or_a_list_of_pairs_of_strings() {
        let want = vec![("x-a".to_owned(), "1".to_owned()), ("x-a".to_owned(), "2".to_owned())];
        assert_eq!(headers(&json!({"X-A": ["1", "2"], "x-b": null})).unwrap(), want);
        assert_eq!(headers(&json!([["X-A", "1"], ["x-a", "2"], ["x-b", null]])).unwrap(), want);
        assert_eq!(headers(&json!(null)).unwrap(), vec![]);
        for bad in [
            json!("x-api-key: secret"),
            json!(7),
            json!({"x-api-key": 5}),
            json!({"x-api-key": ["a", 5]}),
            json!({"x-api-key": {"v": "secret"}}),
            json!([["x-a", "1"], ["bad"]]),
            json!([["x-a", "1", "2"]]),
            json!([7]),
            json!([["x-a", 5]]),
        ] {
            let e = headers(&bad).err().unwrap_or_else(|| panic!("{bad}"));
            assert!(!e.contains("secret"), "a header's value is never shown: {e}");
        }
    }

    #[test]
    fn timestamps_are_rfc3339_or_epoch_seconds() {
        let t = timestamp(&json!("2026-12-01T10:00:00.250Z")).unwrap();
        assert_eq!(t, 1_796_119_200_250_000_000);
        assert_eq!(timestamp(&json!("2026-12-01T11:00:00.250+01:00")), Some(t));
        assert_eq!(timestamp(&json!(1_796_119_200.25)), Some(t));
        assert_eq!(timestamp(&json!("1796119200.25")), Some(t));
        assert_eq!(timestamp(&json!("1796119200")), Some(t - 250_000_000));
        assert_eq!(timestamp(&json!("")), None);
        assert_eq!(timestamp(&json!("-1")), None);
        assert_eq!(timestamp(&json!("1.2.3")), None);
        assert_eq!(timestamp(&json!("yesterday")), None);
        assert_eq!(timestamp(&json!(-1)), None);
        assert_eq!(timestamp(&json!(null)), None);
    }

    fn config() -> Config {
        Config::parse(
            br#"{"identity": {"user": {"header": "x-user-id"}, "api_key": {"header": "x-api-key"}, "ip": {"trusted_hops": 1}},
                 "rules": [{"name": "r", "key": ["user"], "limit": {"requests": 1, "per": "1s"}}]}"#,
        )
        .unwrap()
    }

    /// The one-pass reading of a JSON line agrees with the `Value` reading.
    #[test]
    fn the_fast_reading_of_a_json_line_agrees_with_the_value_reading() {
        let config = config();
        let wanted = Wanted::new(config.identity.headers.iter().map(|(_, h)| h.clone()).collect());
        for line in [
            r#"{"ts": "2026-12-01T10:00:00.250Z", "path": "/a", "headers": {"X-User-Id": ["1", "2"], "x-api-key": "k\u0031"}}"#,
            r#"{"ts": 1796119200.25, "method": "post", "path": "/a?q", "ip": "198.51.100.7"}"#,
            r#"{"ts": "1796119200", "path": "/a"}"#,
            r#"{"ts": "1796119200.123", "path": "/a"}"#,
            r#"{"ts": "1796119200.123\u0034", "path": "/a"}"#,
            r#"{"ts": 1796119200, "path": "/a", "headers": [["X-User-Id", "u"], ["x-user-id", "v"], ["x-n", null]]}"#,
            r#"{"ts": 1796119200, "path": "/a", "headers": {"x-user-id": "", "X-USER-ID": "w", "x-forwarded-for": ["1.2.3.4", "5.6.7.8"]}}"#,
            r#"{"ts": 1796119200, "path": "/a", "headers": {"x-n": null, "x-user-id": ["a"]}, "extra": {"x": [1]}}"#,
            r#"{"ts": 1796119200, "path": "/a", "headers": null, "method": null, "ip": null, "duration_ms": null}"#,
            r#"{"ts": 1796119200, "path": "/a", "duration_ms": 12.5, "ip": "2001:db8::1"}"#,
            r#"{"ts": 1796119200, "path": "/a", "duration_ms": "1500"}"#,
        ] {
            let fast = LogFormat::Jsonl.read(&wanted, line.as_bytes()).unwrap();
            let slow = json_value_entry(&config, line.as_bytes()).unwrap();
            assert_eq!(fast.ts, slow.ts, "{line}");
            assert_eq!(fast.duration, slow.duration, "{line}");
            assert_eq!(fast.method, slow.method, "{line}");
            assert_eq!(fast.path, slow.path, "{line}");
            assert_eq!(fast.headers, slow.headers, "{line}");
            assert_eq!(fast.xff, slow.xff, "{line}");
            assert_eq!(fast.peer, slow.peer, "{line}");
        }
        // Read from the text, epoch seconds are exact to the nanosecond.
        let e = LogFormat::Jsonl.read(&wanted, br#"{"ts": 1796119200.123456789, "path": "/"}"#).unwrap();
        assert_eq!(e.ts, 1_796_119_200_123_456_789);
        // Epoch seconds in a string read as in a number.
        let e = LogFormat::Jsonl.read(&wanted, br#"{"ts": "1796119200.123", "path": "/"}"#).unwrap();
        assert_eq!(e.ts, 1_796_119_200_123_000_000);
        // A field of another type is for the `Value` reading.
        assert!(LogFormat::Jsonl.read(&wanted, br#"{"ts": 1, "path": 5}"#).is_err());
        let e = LogFormat::Jsonl.read(&wanted, br#"{"ts": 1, "path": "/", "duration_ms": 12.5}"#).unwrap();
        assert_eq!(e.duration, Some(12_500_000));
    }

    /// A JSON line with a field of the wrong type or value is no request to either reading.
    #[test]
    fn a_json_line_with_a_field_that_is_no_such_thing_is_unreadable_to_both_readings() {
        let config = config();
        let wanted = Wanted::new(config.identity.headers.iter().map(|(_, h)| h.clone()).collect());
        for (field, why) in [
            (r#""ip": "not-an-ip""#, "client address"),
            (r#""ip": """#, "client address"),
            (r#""ip": 5"#, "\"ip\" is a number"),
            (r#""ip": "unix:""#, "client address"),
            (r#""method": "SEC RET""#, "method"),
            (r#""method": """#, "method"),
            (r#""method": 5"#, "\"method\" is a number"),
            (r#""headers": "x-api-key: K""#, "\"headers\" is a string"),
            (r#""headers": {"x-api-key": 5}"#, "\"x-api-key\" is a number"),
            (r#""headers": {"x-other": true}"#, "\"x-other\" is a boolean"),
            (r#""headers": {"x-user-id": ["u", 5]}"#, "\"x-user-id\" is a number"),
            (r#""headers": [["x-user-id"]]"#, "pair"),
            (r#""headers": [7]"#, "pair"),
            (r#""duration_ms": -5"#, "duration_ms"),
            (r#""duration_ms": "soon""#, "duration_ms"),
            (r#""duration_ms": [5]"#, "duration_ms"),
        ] {
            let line = format!(r#"{{"ts": 1796119200, "path": "/a", {field}}}"#);
            assert!(LogFormat::Jsonl.read(&wanted, line.as_bytes()).is_err(), "{line}");
            let e = json_value_entry(&config, line.as_bytes()).err().unwrap_or_else(|| panic!("{line}"));
            assert!(e.contains(why), "{line}: {e}");
            // The field and its length, never its text: a log's field may hold anything.
            for text in ["not-an-ip", "unix:", "SEC RET", "soon", "x-api-key: K"] {
                assert!(!e.contains(text), "{line}: {e}");
            }
        }
        // A header is named when its name is one; anything else, only by its length.
        for (headers, says) in [
            (r#"{"x-api-key": 5}"#, r#""x-api-key" is a number"#),
            (r#"{"Bearer sk_live_0123": 5}"#, "a header name of 19 bytes is a number"),
        ] {
            let line = format!(r#"{{"ts": 1796119200, "path": "/a", "headers": {headers}}}"#);
            let e = json_value_entry(&config, line.as_bytes()).err().unwrap_or_else(|| panic!("{line}"));
            assert!(e.contains(says), "{line}: {e}");
        }
    }

    /// A `ts` or `path` that is there but cannot be read is named as such, not as missing.
    #[test]
    fn a_json_line_says_which_of_ts_and_path_it_cannot_read() {
        let config = config();
        for (fields, says) in [
            (r#""ts": "yesterday", "path": "/a""#, r#"cannot read "ts" (9 bytes; RFC 3339 or epoch seconds)"#),
            (r#""ts": -5, "path": "/a""#, r#"cannot read "ts" (a number; epoch seconds from 1970)"#),
            (r#""ts": [1], "path": "/a""#, r#""ts" is a list, not a time"#),
            (r#""ts": 1796119200, "path": 5"#, r#""path" is a number, not a string"#),
            (r#""path": "/a""#, r#"needs "ts""#),
            (r#""ts": null, "path": "/a""#, r#"needs "ts""#),
            (r#""ts": 1796119200"#, r#"needs "ts""#),
        ] {
            let line = format!("{{{fields}}}");
            let e = json_value_entry(&config, line.as_bytes()).err().unwrap_or_else(|| panic!("{line}"));
            assert!(e.contains(says) && !e.contains("yesterday"), "{line}: {e}");
        }
    }

    #[test]
    fn a_request_that_ended_near_the_clock_is_replayed_at_it_however_long_it_took() {
        let (s, now) = (ratewall_core::SECOND, 1_000_000 * ratewall_core::SECOND);
        assert_eq!(clock(now, now + s, now + s), Some(now + s));
        assert_eq!(clock(now, now - 30 * s, now - 30 * s), Some(now));
        // Two minutes long, ended just now: late, not from another stretch of log.
        assert_eq!(clock(now, now - 120 * s, now - s), Some(now));
        assert_eq!(clock(now, now - 120 * s, now - 90 * s), None);
        assert_eq!(clock(now, now - 120 * s, now - 120 * s), None);
    }

    #[test]
    fn the_peer_alone_gives_the_key_the_filter_would() {
        let src = IpSource { trusted_hops: 1, ipv6_prefix: 64, ipv4_prefix: 32 };
        for peer in ["198.51.100.7", "2001:db8:1:2:3:4:5:6", "010.1.1.1", "not an address", "1.2.3.4, 5.6.7.8"] {
            let slow = parse_ip(peer.as_bytes()).map(|ip| ratewall_core::key::ip_key(ip, &src));
            assert_eq!(client(&src, Some(peer), None).map(Cow::into_owned), slow, "{peer}");
        }
        let v4_24 = IpSource { ipv4_prefix: 24, ..src };
        assert_eq!(client(&v4_24, Some("198.51.100.7"), None).as_deref(), Some("198.51.100.0/24"));
        assert_eq!(client(&src, Some("10.0.0.1"), Some(b"203.0.113.9")).as_deref(), Some("203.0.113.9"));
        let none = IpSource { trusted_hops: 0, ..src };
        assert_eq!(client(&none, Some("10.0.0.1"), Some(b"203.0.113.9")).as_deref(), Some("10.0.0.1"));
    }

    #[test]
    fn a_line_longer_than_the_cap_is_skipped_and_the_next_is_read() {
        let mut text = vec![b'x'; MAX_LINE + 10];
        text.extend_from_slice(b"\nnext\r\n");
        let mut r = BufReader::with_capacity(4096, &text[..]);
        let mut buf = Vec::new();
        assert_eq!(next_line(&mut r, &mut buf).unwrap(), Some(false));
        assert_eq!(buf.len(), MAX_LINE);
        assert_eq!(next_line(&mut r, &mut buf).unwrap(), Some(true));
        assert_eq!(buf, b"next");
        assert_eq!(next_line(&mut r, &mut buf).unwrap(), None);
    }
}
