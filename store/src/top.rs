//! The fleet's top offenders and traffic: each batch's optional top section merged per rule
//! into bounded time buckets (the last minute, the last hour, a per-second series over 15
//! minutes), and the nodes heard from — the batches this store process answered, and those
//! its peers on the same Redis answered.
//!
//! Store processes behind one load balancer each hear part of the fleet. Every process cuts
//! what it heard into a *share* once per [`SHARE_EVERY`] (the sections merged per second, and
//! the nodes it heard) and appends it to one Redis stream ([`SHARED_STREAM`], about
//! [`SHARED_LEN`] entries, expiring an hour after the last write); a process with an admin
//! listener reads its peers' shares from the stream and merges them into its own view, so any
//! of them answers for the whole fleet, a share interval or so behind.
//!
//! The process's own decisions — the rate limit service's ([`crate::rls`]) — are heard the same
//! way: [`Top::decided`] adds each call's outcome to a section of the current second, which is
//! merged like a batch's (and shared with the peers) once that second is over, or when the
//! views are read. That section lists every rule of the process's configuration
//! ([`Top::configured`]) in its order, as a proxy's lists its document's, so that every
//! process that merges it lists them in that order.
//!
//! Memory is bounded whatever the traffic: at most [`MAX_RULES`] rules, each with a fixed
//! number of buckets holding a summary of at most [`KEPT`] keys
//! ([`ratewall_core::topk::windows`]), at most [`MAX_NODES`] nodes (and as many peers' views
//! of nodes; the fleet is listed as at most [`MAX_NODES`], the ones heard of most lately), at
//! most [`OUTBOX_SECONDS`] seconds of sections waiting to be shared, and one
//! second of the process's own decisions (at most [`MAX_RULES`] rules of [`KEPT`] keys).

use ratewall_core::encoding::{put_varint, Reader};
use ratewall_core::sync::{RuleTop, TopSection};
use ratewall_core::topk::windows::Windows;
pub use ratewall_core::topk::windows::{Window, SERIES};
use ratewall_core::topk::{Admitted, Summary};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The Redis stream the store processes share what they heard on.
pub const SHARED_STREAM: &str = "rw:{top}:shared";
/// About how many shares the stream keeps (trimmed as it grows).
pub const SHARED_LEN: u64 = 4096;
/// How long the stream lives after its last write, ms.
pub const SHARED_TTL_MS: u64 = 3_600_000;
/// How often a process shares what it heard, and reads its peers' shares.
pub const SHARE_EVERY: Duration = Duration::from_secs(1);
/// Most seconds of sections a process keeps waiting to be shared (while Redis cannot take
/// them); the oldest go first.
pub const OUTBOX_SECONDS: usize = 30;
/// Most shares read from the stream per interval.
pub const READ_PER_INTERVAL: usize = 1024;
/// The version byte of a share.
const SHARE_VERSION: u8 = 2;
/// Most peer processes whose latest share number a process remembers.
const MAX_PEERS: usize = 1024;

/// Most rules tracked (past it, a rule first heard later takes the place of one not heard of
/// for an hour, or is not tracked).
pub const MAX_RULES: usize = 256;
/// Most nodes tracked (the longest unheard is forgotten first).
pub const MAX_NODES: usize = 10_000;
/// Nodes unheard this long are forgotten.
pub const NODE_TTL: Duration = Duration::from_secs(600);
/// A node unheard this long is silent: 0 batches a second (the dashboard's `SILENT_S`; a live
/// node sends a heartbeat at least every few seconds).
pub const SILENT: Duration = Duration::from_secs(10);
/// Keys a bucket's summary keeps: four times a proxy's, since a bucket merges the whole
/// fleet's batches and its error bound is a share of everything they denied.
pub const KEPT: usize = 4 * ratewall_core::topk::CAPACITY;

/// A node as one process heard it (this one, or a peer in its latest share).
#[derive(Clone, Debug)]
struct Seen {
    last_seen: Instant,
    /// Batches per second, a moving average.
    rate: f64,
    rtt: Duration,
    degraded: bool,
}

/// A node as this process heard it.
#[derive(Clone, Debug)]
struct Node {
    seen: Seen,
    /// The last seq whose section was counted (a retried batch is not counted again).
    counted_seq: u64,
    /// The unix second that section was counted in (0: none yet).
    counted_at: u64,
    /// Whether a batch of the node's failed here since then: the next section counted holds
    /// what it decided meanwhile (a heartbeat or a repeated batch answered in between does
    /// not say otherwise).
    failed_since: bool,
}

#[derive(Debug)]
struct Inner {
    /// The rules' buckets (and the latest unix second seen: time that goes backwards is
    /// clamped to it).
    windows: Windows,
    nodes: HashMap<u64, Node>,
    /// Sections heard and not shared yet, merged per unix second.
    outbox: BTreeMap<u64, TopSection>,
    /// When the last share was cut: the nodes heard since go in the next.
    shared_at: Option<Instant>,
    /// Peers' views of nodes, by (peer process, node).
    remote: HashMap<(u64, u64), Seen>,
    /// A share whose write failed: written again, as it is, before any other.
    pending: Option<Share>,
    /// The number of the last share cut.
    seq: u64,
    /// Per peer process, the number of the latest share merged.
    merged: HashMap<u64, u64>,
    /// The process's own decisions of one unix second: the second, and per rule its place in
    /// the configuration and its counts.
    own: Option<(u64, Vec<(usize, RuleTop)>)>,
    /// The names of the rules the process decides by ([`Top::configured`]), in their
    /// configuration's order: each second's own section lists them all, idle ones with nothing
    /// counted, so every process that merges it (a peer without the configuration included)
    /// lists them in that order.
    roster: Vec<String>,
    /// Per rule (by name, at most [`MAX_RULES`]), units admitted for keys its summary of the
    /// second did not list: a key's first denial brings them ([`Admitted`]).
    admitted: HashMap<String, Admitted>,
}

/// What one of the process's own decisions (a rate limit service call) did under one rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decided<'a> {
    /// The rule's name ([`crate::rls::config::Rule::top_name`]).
    pub rule: &'a str,
    /// The rule's place in the configuration: the rules are listed in that order.
    pub order: usize,
    /// The client's shown key (never a secret value).
    pub key: &'a [u8],
    /// Units admitted under the rule (0: none).
    pub allowed: u64,
    /// What the rule did with the request.
    pub outcome: Outcome,
}

/// Whether a rule denied a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Within its limit.
    Within,
    /// Over its limit, and the request was denied for it.
    Denied,
    /// Over its limit, not enforced (shadow mode; a quota while another quota of the call had
    /// room): it would have denied the request.
    ShadowDenied,
}

/// The process's view of the fleet.
#[derive(Debug)]
pub struct Top {
    inner: Mutex<Inner>,
    /// This process's id on the shared stream.
    process: u64,
}

impl Default for Top {
    fn default() -> Self {
        use std::hash::BuildHasher as _;
        let process = std::collections::hash_map::RandomState::new().hash_one((std::process::id(), unix_now()));
        Top {
            inner: Mutex::new(Inner {
                windows: Windows::new(MAX_RULES, KEPT),
                nodes: HashMap::new(),
                outbox: BTreeMap::new(),
                shared_at: None,
                remote: HashMap::new(),
                pending: None,
                seq: 0,
                merged: HashMap::new(),
                own: None,
                roster: Vec::new(),
                admitted: HashMap::new(),
            }),
            process: process.max(1),
        }
    }
}

/// Queues `section`, heard at `unix`, to be shared: the oldest seconds go past
/// [`OUTBOX_SECONDS`].
fn queue(outbox: &mut BTreeMap<u64, TopSection>, unix: u64, section: &TopSection) {
    outbox.entry(unix).or_default().absorb(section, (MAX_RULES, Some(KEPT)));
    while outbox.len() > OUTBOX_SECONDS {
        outbox.pop_first();
    }
}

/// A share: what one process heard in one interval.
#[derive(Debug, Default, PartialEq)]
pub struct Share {
    /// The process that heard it.
    pub process: u64,
    /// Its number among the process's shares (from 1; 0: of a version without numbers). A
    /// share whose write to Redis timed out is written again under its number, and a copy
    /// that Redis ran all the same (after a pause) is merged once.
    pub seq: u64,
    /// Sections, merged per unix second.
    pub seconds: Vec<(u64, TopSection)>,
    /// Nodes: id, last heard (unix ms), batches per second, last round trip, degraded.
    pub nodes: Vec<(u64, u64, f64, Duration, bool)>,
}

impl Share {
    /// `version | process | seq | seconds: (unix | len | section) | nodes: (id | unix ms |
    /// rate × 1000 | rtt µs | degraded)`, varints (version 1 had no `seq`).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![SHARE_VERSION];
        put_varint(&mut out, self.process);
        put_varint(&mut out, self.seq);
        put_varint(&mut out, self.seconds.len() as u64);
        for (unix, section) in &self.seconds {
            let mut body = Vec::new();
            section.encode_into(&mut body);
            put_varint(&mut out, *unix);
            put_varint(&mut out, body.len() as u64);
            out.extend_from_slice(&body);
        }
        put_varint(&mut out, self.nodes.len() as u64);
        for (id, seen_ms, rate, rtt, degraded) in &self.nodes {
            put_varint(&mut out, *id);
            put_varint(&mut out, *seen_ms);
            put_varint(&mut out, (rate * 1000.0).round() as u64);
            put_varint(&mut out, u64::try_from(rtt.as_micros()).unwrap_or(u64::MAX));
            out.push(u8::from(*degraded));
        }
        out
    }

    /// Reads [`Share::encode`]'s form; anything else is an error.
    pub fn decode(bytes: &[u8]) -> Result<Share, String> {
        let bad = |e: ratewall_core::encoding::DecodeError| format!("share: {e:?}");
        let mut r = Reader { bytes, pos: 0 };
        let version = r.take(1).map_err(bad)?;
        if version != [SHARE_VERSION] && version != [1] {
            return Err(format!("share: version {version:?}"));
        }
        let process = r.varint().map_err(bad)?;
        let seq = if version == [1] { 0 } else { r.varint().map_err(bad)? };
        let n = r.varint().map_err(bad)?;
        let mut seconds = Vec::new();
        for _ in 0..n.min(OUTBOX_SECONDS as u64 + 1) {
            let unix = r.varint().map_err(bad)?;
            let len = usize::try_from(r.varint().map_err(bad)?).map_err(|_| "share: length".to_owned())?;
            seconds.push((unix, TopSection::decode(r.take(len).map_err(bad)?).map_err(bad)?));
        }
        let n = r.varint().map_err(bad)?;
        let mut nodes = Vec::new();
        for _ in 0..n.min(MAX_NODES as u64) {
            let (id, seen_ms, rate, rtt) = (r.varint(), r.varint(), r.varint(), r.varint());
            let degraded = r.take(1).map_err(bad)? != [0];
            nodes.push((
                id.map_err(bad)?,
                seen_ms.map_err(bad)?,
                rate.map_err(bad)? as f64 / 1000.0,
                Duration::from_micros(rtt.map_err(bad)?),
                degraded,
            ));
        }
        if r.pos != bytes.len() {
            return Err("share: trailing bytes".into());
        }
        Ok(Share { process, seq, seconds, nodes })
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl Inner {
    /// Merges the process's own decisions of a second before `unix` (all of them with `all`),
    /// as a batch's section heard then: every rule of the roster in its order (as a proxy's
    /// section lists every rule of its document), then the others decided (the overrides) in
    /// their order.
    fn own_until(&mut self, unix: u64, all: bool) {
        if !self.own.as_ref().is_some_and(|(at, _)| all || *at < unix) {
            return;
        }
        let Some((at, mut rules)) = self.own.take() else { return };
        rules.sort_by_key(|(order, _)| *order);
        let mut decided: HashMap<String, RuleTop> = HashMap::with_capacity(rules.len());
        let mut others = Vec::new();
        let in_roster: std::collections::HashSet<&str> = self.roster.iter().map(String::as_str).collect();
        for (_, r) in rules {
            if in_roster.contains(r.rule.as_str()) {
                decided.insert(r.rule.clone(), r);
            } else {
                others.push(r);
            }
        }
        let idle = |name: &String| RuleTop {
            rule: name.clone(),
            allowed: 0,
            denied: 0,
            shadow_denied: 0,
            top: Summary::new(KEPT),
        };
        let listed = self.roster.iter().map(|name| decided.remove(name).unwrap_or_else(|| idle(name)));
        let section = TopSection { rules: listed.chain(others).take(MAX_RULES).collect() };
        self.windows.add_past(at, &section);
        queue(&mut self.outbox, at, &section);
    }
}

/// Each rule's counts in `section` spread evenly over the unix seconds `from..=to` (the
/// remainder in the last ones), as [`Windows::add`] takes them.
fn spread(section: &TopSection, from: u64, to: u64) -> Vec<Vec<ratewall_core::topk::windows::Second>> {
    // At most the per-second series' length: older seconds are not shown anyway.
    let from = from.max(to.saturating_sub(ratewall_core::topk::windows::SERIES as u64 - 1));
    let k = to - from + 1;
    let part = |total: u64, i: u64| total / k + u64::from(i >= k - total % k);
    section
        .rules
        .iter()
        .map(|r| (0..k).map(|i| (from + i, part(r.allowed, i), part(r.denied, i), part(r.shadow_denied, i))).collect())
        .collect()
}

/// How far past this process's clock a peer's share may name its second (processes' clocks
/// disagree by milliseconds, a stalled write by up to the seconds it is retried).
const MAX_SHARE_AHEAD_S: u64 = 60;

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
        let t = inner.windows.clock(unix);
        inner.own_until(t, false);
        if inner.nodes.len() >= MAX_NODES && !inner.nodes.contains_key(&node) {
            inner.nodes.retain(|_, n| now.saturating_duration_since(n.seen.last_seen) < NODE_TTL);
            let by_age = inner.nodes.iter().map(|(id, n)| (n.seen.last_seen, *id));
            for id in least_lately(by_age, (inner.nodes.len() + 1).saturating_sub(MAX_NODES)) {
                inner.nodes.remove(&id);
            }
        }
        let n = inner.nodes.entry(node).or_insert(Node {
            seen: Seen { last_seen: now, rate: 0.0, rtt, degraded: false },
            counted_seq: 0,
            counted_at: 0,
            failed_since: false,
        });
        let gap = now.saturating_duration_since(n.seen.last_seen).as_secs_f64();
        // An exponentially weighted rate over about 5 s.
        if gap > 0.0 {
            let w = (-gap / 5.0).exp();
            n.seen.rate = n.seen.rate * w + (1.0 - w) / gap;
        }
        (n.seen.last_seen, n.seen.rtt, n.seen.degraded) = (now, rtt, !ok);
        n.failed_since |= !ok;
        let Some(section) = section.filter(|_| ok && seq > n.counted_seq) else { return };
        n.counted_seq = seq;
        let was_failing = std::mem::take(&mut n.failed_since);
        let t = inner.windows.clock(unix);
        // The first section after batches failed here (Redis down, say) holds what the node
        // decided since its last one counted: spread over those seconds, not a spike in this one.
        let since = std::mem::replace(&mut n.counted_at, t);
        let seconds = if was_failing && since > 0 && t > since.saturating_add(1) {
            spread(section, since + 1, t)
        } else {
            Vec::new()
        };
        inner.windows.add(t, section, &seconds);
        queue(&mut inner.outbox, t, section);
    }

    /// This process's id on the shared stream.
    pub fn process(&self) -> u64 {
        self.process
    }

    /// The rules the process decides by ([`Top::decided`]), named, in their configuration's
    /// order (a name met again keeps its first place; at most [`MAX_RULES`]): from the next
    /// second it decides anything in on, its own section lists every one of them in that order,
    /// so the peers that merge it list them so too.
    pub fn configured<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        let mut roster: Vec<String> = Vec::new();
        let mut met = std::collections::HashSet::new();
        for name in names {
            if roster.len() >= MAX_RULES {
                break;
            }
            if met.insert(name) {
                roster.push(name.to_owned());
            }
        }
        if let Ok(mut inner) = self.inner.lock() {
            inner.roster = roster;
        }
    }

    /// The outcome of one of this process's own decisions (a rate limit service call), per
    /// rule that decided it: its rule's counts (units admitted, requests denied, requests a
    /// rule not enforced would have denied), and its key's in the rule's summary, where this
    /// process is its node.
    pub fn decided(&self, decisions: &[Decided<'_>]) {
        self.decided_at(unix_now(), decisions);
    }

    /// [`Top::decided`] at a given unix second (tests).
    pub fn decided_at(&self, unix: u64, decisions: &[Decided<'_>]) {
        if decisions.is_empty() {
            return;
        }
        let Ok(mut inner) = self.inner.lock() else { return };
        let inner = &mut *inner;
        let t = inner.windows.clock(unix);
        inner.own_until(t, false);
        let Inner { own, admitted, .. } = inner;
        let (_, rules) = own.get_or_insert_with(|| (t, Vec::new()));
        let bit = ratewall_core::topk::node_bit(self.process);
        for d in decisions {
            let i = match rules.iter().position(|(_, r)| r.rule == d.rule) {
                Some(i) => i,
                None if rules.len() < MAX_RULES => {
                    let r = RuleTop {
                        rule: d.rule.to_owned(),
                        allowed: 0,
                        denied: 0,
                        shadow_denied: 0,
                        top: Summary::new(KEPT),
                    };
                    rules.push((d.order, r));
                    rules.len() - 1
                }
                None => continue,
            };
            let Some((_, r)) = rules.get_mut(i) else { continue };
            r.allowed = r.allowed.saturating_add(d.allowed);
            let denied = match d.outcome {
                Outcome::Within => 0,
                Outcome::Denied => {
                    r.denied = r.denied.saturating_add(1);
                    1
                }
                Outcome::ShadowDenied => {
                    r.shadow_denied = r.shadow_denied.saturating_add(1);
                    1
                }
            };
            // Admitted units of a key not listed wait for its first denial (at most
            // `MAX_RULES` rules' worth: the rules' own list is bounded so too). The rule's name
            // is copied only for its first units kept, not on every call.
            let allowed = if denied > 0 {
                d.allowed.saturating_add(admitted.get_mut(d.rule).map_or(0, |w| w.take(d.key, t)))
            } else if d.allowed == 0 || r.top.count(d.key) > 0 {
                d.allowed
            } else {
                if let Some(w) = admitted.get_mut(d.rule) {
                    w.note(d.key, d.allowed, t);
                } else if admitted.len() < MAX_RULES {
                    admitted.entry(d.rule.to_owned()).or_default().note(d.key, d.allowed, t);
                }
                0
            };
            r.top.add(d.key, denied, allowed, bit);
        }
    }

    /// What this process heard since the last share (None: nothing), taken out; give it back
    /// with [`Top::unshared`] when it could not be written.
    pub fn take_share(&self) -> Option<Share> {
        self.take_share_at(unix_now(), Instant::now())
    }

    /// [`Top::take_share`] at a given time (tests).
    pub fn take_share_at(&self, unix: u64, now: Instant) -> Option<Share> {
        let Ok(mut inner) = self.inner.lock() else { return None };
        let inner = &mut *inner;
        inner.own_until(unix, false);
        if let Some(pending) = inner.pending.take() {
            return Some(pending);
        }
        let since = inner.shared_at.replace(now);
        let nodes: Vec<_> = inner
            .nodes
            .iter()
            .map(|(id, n)| (id, &n.seen))
            .filter(|(_, n)| since.is_none_or(|at| n.last_seen > at))
            .map(|(id, n)| {
                let ago = now.saturating_duration_since(n.last_seen).as_millis();
                let seen_ms = (unix.saturating_mul(1000)).saturating_sub(u64::try_from(ago).unwrap_or(u64::MAX));
                (*id, seen_ms, n.rate, n.rtt, n.degraded)
            })
            .collect();
        let seconds: Vec<_> = std::mem::take(&mut inner.outbox).into_iter().collect();
        if seconds.is_empty() && nodes.is_empty() {
            return None;
        }
        inner.seq += 1;
        Some(Share { process: self.process, seq: inner.seq, seconds, nodes })
    }

    /// Gives back a share [`Top::take_share`] took whose write failed: the next share is this
    /// one again, under its number, so that peers merge it once whether or not Redis ran the
    /// write that failed (one that timed out may run later, when a paused Redis resumes).
    pub fn unshared(&self, share: Share) {
        let Ok(mut inner) = self.inner.lock() else { return };
        inner.pending = Some(share);
    }

    /// Merges a peer's share read from the stream (this process's own are skipped: they are
    /// in already).
    pub fn merge_share(&self, share: &Share) {
        self.merge_share_at(share, unix_now(), Instant::now());
    }

    /// [`Top::merge_share`] at a given time (tests).
    pub fn merge_share_at(&self, share: &Share, unix: u64, now: Instant) {
        if share.process == self.process {
            return;
        }
        let Ok(mut inner) = self.inner.lock() else { return };
        let inner = &mut *inner;
        // A process writes its shares in order, each again until Redis takes it: one whose
        // number is not past the latest merged is a copy.
        if share.seq > 0 {
            if inner.merged.get(&share.process).is_some_and(|last| share.seq <= *last) {
                return;
            }
            if inner.merged.len() >= MAX_PEERS && !inner.merged.contains_key(&share.process) {
                inner.merged.clear();
            }
            inner.merged.insert(share.process, share.seq);
        }
        // A second far past this process's clock (a share garbled in Redis, or a peer's clock
        // years ahead) would move every window there, leaving the admin routes empty.
        for (sec, section) in share.seconds.iter().filter(|(sec, _)| *sec <= unix.saturating_add(MAX_SHARE_AHEAD_S)) {
            inner.windows.add_past(*sec, section);
        }
        for &(id, seen_ms, rate, rtt, degraded) in &share.nodes {
            let ago = Duration::from_millis(unix.saturating_mul(1000).saturating_sub(seen_ms));
            let last_seen = now.checked_sub(ago).unwrap_or(now);
            inner.remote.insert((share.process, id), Seen { last_seen, rate, rtt, degraded });
        }
        // Past the bound, the views heard of least lately go (at once, not one by one).
        if inner.remote.len() > MAX_NODES {
            inner.remote.retain(|_, r| now.saturating_duration_since(r.last_seen) < NODE_TTL);
            let by_age = inner.remote.iter().map(|(k, r)| (r.last_seen, *k));
            for key in least_lately(by_age, inner.remote.len().saturating_sub(MAX_NODES)) {
                inner.remote.remove(&key);
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
        let Ok(mut inner) = self.inner.lock() else { return json!({"window_s": 0, "rules": []}) };
        inner.own_until(unix, true);
        inner.windows.top(unix, rule, window)
    }

    /// `GET /v1/series`: per rule, per-second counts over the last 15 minutes, oldest first.
    pub fn series(&self, rule: Option<&str>) -> Value {
        self.series_at(unix_now(), rule)
    }

    /// [`Top::series`] at a given unix second (tests).
    pub fn series_at(&self, unix: u64, rule: Option<&str>) -> Value {
        let Ok(mut inner) = self.inner.lock() else { return json!({"step_s": 1, "end_unix_s": unix, "rules": []}) };
        inner.own_until(unix, true);
        inner.windows.series(unix, rule)
    }

    /// `GET /v1/fleet`'s nodes: id, seconds since last heard, batches per second, the last
    /// batch's time in this store, and whether its last batch failed here; at most
    /// [`MAX_NODES`], those heard of most lately.
    /// Nodes heard by several processes are listed once: the batches each process heard
    /// added up, the rest from the one that heard the node last.
    pub fn fleet(&self) -> Vec<Value> {
        let Ok(inner) = self.inner.lock() else { return Vec::new() };
        let now = Instant::now();
        // A process's rate of a node it stopped hearing decays as the rate itself would, to
        // none once the node is silent (as the dashboard shows it: unheard for `SILENT`).
        let decayed = |rate: f64, last_seen: Instant| {
            let unheard = now.saturating_duration_since(last_seen);
            if unheard >= SILENT {
                return 0.0;
            }
            rate * (-unheard.as_secs_f64() / 5.0).exp()
        };
        let mut nodes: BTreeMap<u64, Seen> = BTreeMap::new();
        let own = inner.nodes.iter().map(|(id, n)| (*id, &n.seen));
        let peers = inner.remote.iter().map(|((_, id), r)| (*id, r));
        for (id, r) in own.chain(peers).filter(|(_, r)| now.saturating_duration_since(r.last_seen) < NODE_TTL) {
            let rate = decayed(r.rate, r.last_seen);
            let e = nodes.entry(id).or_insert(Seen { rate: 0.0, ..r.clone() });
            e.rate += rate;
            if r.last_seen >= e.last_seen {
                (e.last_seen, e.rtt, e.degraded) = (r.last_seen, r.rtt, r.degraded);
            }
        }
        // At most as many as one process keeps of its own: those heard of most lately.
        let by_age = nodes.iter().map(|(id, n)| (n.last_seen, *id));
        for id in least_lately(by_age, nodes.len().saturating_sub(MAX_NODES)) {
            nodes.remove(&id);
        }
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

/// The `n` keys of `by_age` (when each was last heard of, and its key) heard of least lately.
fn least_lately<K: Ord + Copy>(by_age: impl Iterator<Item = (Instant, K)>, n: usize) -> Vec<K> {
    if n == 0 {
        return Vec::new();
    }
    let mut all: Vec<(Instant, K)> = by_age.collect();
    if n < all.len() {
        all.select_nth_unstable(n);
        all.truncate(n);
    }
    all.into_iter().map(|(_, k)| k).collect()
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
    fn a_silent_node_sends_no_batches_a_second() {
        let top = Top::default();
        let now = Instant::now();
        let (lately, long_ago) = (now - Duration::from_secs(1), now - SILENT - Duration::from_secs(1));
        for (node, at) in [(1, lately), (2, long_ago)] {
            // Ten batches a second, then nothing.
            for i in 0..50u32 {
                top.heard_at(
                    1_000,
                    at - Duration::from_millis(100) * (50 - i),
                    node,
                    u64::from(i),
                    true,
                    Duration::ZERO,
                    None,
                );
            }
        }
        let fleet = top.fleet();
        let rate = |i: usize| fleet[i]["batches_per_s"].as_f64().unwrap();
        assert!(rate(0) > 1.0, "{fleet:?}");
        assert_eq!(rate(1), 0.0, "{fleet:?}");
    }

    #[test]
    fn what_a_node_decided_while_its_batches_failed_is_spread_over_those_seconds() {
        let top = Top::default();
        let now = Instant::now();
        let t = 1_800_000_000;
        top.heard_at(t, now, 1, 1, true, Duration::ZERO, Some(&section("r", &[("user=a", 4)], 1)));
        // Redis down for 19 s: the node's batches fail here, its section runs on.
        for i in 1..20 {
            top.heard_at(t + i, now, 1, 1 + i, false, Duration::ZERO, Some(&section("r", &[("user=a", 1)], 1)));
        }
        // Redis back: an idle VM's heartbeat, and a copy of a batch Redis took before it went
        // away, are answered before the batch that holds what the node decided meanwhile.
        top.heard_at(t + 20, now, 1, 18, true, Duration::ZERO, None);
        top.heard_at(t + 20, now, 1, 1, true, Duration::ZERO, Some(&section("r", &[("user=a", 4)], 1)));
        top.heard_at(t + 20, now, 1, 20, true, Duration::ZERO, Some(&section("r", &[("user=a", 40)], 1)));
        let series = top.series_at(t + 21, None);
        let denied: Vec<u64> =
            series["rules"][0]["denied"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        let last = &denied[SERIES - 22..];
        assert_eq!(last[0], 4, "the first batch, in its second");
        assert!(last[1..21].iter().all(|d| *d == 2), "40 over the 20 seconds since: {last:?}");
        assert_eq!(denied.iter().sum::<u64>(), 44, "nothing counted twice or lost");
        assert_eq!(top.top_at(t + 21, Some("r"), Window::Minute)["rules"][0]["denied"], 44);
        // A node that was idle, not failing, sends what it decided just now: counted now.
        top.heard_at(t + 100, now, 1, 21, true, Duration::ZERO, Some(&section("r", &[("user=a", 5)], 1)));
        let series = top.series_at(t + 101, None);
        assert_eq!(series["rules"][0]["denied"][SERIES - 2], 5);
    }

    #[test]
    fn a_share_reads_back_as_written_and_garbage_does_not_read() {
        let top = Top::default();
        let now = Instant::now();
        let t = 1_800_000_000;
        top.heard_at(t, now, 4, 1, true, Duration::from_micros(1500), Some(&section("r", &[("user=a", 3)], 4)));
        top.heard_at(t + 1, now, 4, 2, true, Duration::from_micros(1500), Some(&section("r", &[("user=a", 2)], 4)));
        let share = top.take_share_at(t + 1, now).unwrap();
        assert_eq!(share.seconds.len(), 2);
        assert_eq!(share.nodes.len(), 1);
        let bytes = share.encode();
        assert_eq!(Share::decode(&bytes).unwrap(), share);
        assert!(top.take_share_at(t + 2, now).is_none(), "nothing new since");
        for cut in 0..bytes.len() {
            assert!(Share::decode(&bytes[..cut]).is_err());
        }
        assert!(Share::decode(&[bytes.as_slice(), &[0]].concat()).is_err());
    }

    #[test]
    fn a_share_whose_write_failed_is_written_again_as_it_was_and_merged_once() {
        let (a, b) = (Top::default(), Top::default());
        let now = Instant::now();
        let t = 1_800_000_000;
        a.heard_at(t, now, 1, 1, true, Duration::ZERO, Some(&section("r", &[("user=a", 10)], 1)));
        let first = a.take_share_at(t, now).unwrap();
        let copy = Share::decode(&first.encode()).unwrap();
        // The write timed out (Redis paused), and Redis ran it when it resumed: peers read it.
        a.unshared(first);
        b.merge_share_at(&copy, t, now);
        // More is heard meanwhile; the next share is the failed one again, as it was.
        a.heard_at(t + 1, now, 1, 2, true, Duration::ZERO, Some(&section("r", &[("user=a", 4)], 1)));
        let again = a.take_share_at(t + 1, now).unwrap();
        assert_eq!(again, copy);
        b.merge_share_at(&again, t + 1, now);
        let next = a.take_share_at(t + 2, now).unwrap();
        assert_eq!(next.seq, copy.seq + 1);
        b.merge_share_at(&next, t + 2, now);
        assert_eq!(b.top_at(t + 2, None, Window::Minute)["rules"][0]["denied"], 14, "10 and 4, each once");
    }

    /// Two processes at `t`: `a` heard user=a denied 10 times from node 1, `b` 5 from node 2.
    fn two_processes(t: u64, now: Instant) -> (Top, Top) {
        let (a, b) = (Top::default(), Top::default());
        a.heard_at(t, now, 1, 1, true, Duration::ZERO, Some(&section("r", &[("user=a", 10)], 1)));
        b.heard_at(t, now, 2, 1, true, Duration::ZERO, Some(&section("r", &[("user=a", 5)], 2)));
        (a, b)
    }

    #[test]
    fn a_process_that_reads_old_shares_counts_them_in_their_seconds() {
        let now = Instant::now();
        let t = 1_800_000_000;
        let (a, b) = (Top::default(), Top::default());
        a.heard_at(t, now, 1, 1, true, Duration::ZERO, Some(&section("r", &[("user=a", 3)], 1)));
        let old = a.take_share_at(t, now).unwrap();
        // `b` starts 66 s later, hears a batch, then reads the stream from its start.
        b.heard_at(t + 66, now, 2, 1, true, Duration::ZERO, Some(&section("r", &[("user=b", 1)], 2)));
        b.merge_share_at(&old, t + 66, now);
        let minute = b.top_at(t + 66, Some("r"), Window::Minute);
        assert_eq!(minute["rules"][0]["denied"], 1, "only the last minute's: {minute}");
        assert_eq!(b.top_at(t + 66, Some("r"), Window::Hour)["rules"][0]["denied"], 4);
        let series = b.series_at(t + 66, Some("r"));
        let denied = &series["rules"][0]["denied"];
        assert_eq!((denied[SERIES - 67].clone(), denied[SERIES - 1].clone()), (json!(3), json!(1)), "{series}");
    }

    #[test]
    fn a_share_of_a_second_far_ahead_is_not_merged() {
        let now = Instant::now();
        let t = 1_800_000_000;
        let (a, b) = two_processes(t, now);
        let mut share = a.take_share_at(t, now).unwrap();
        for (sec, _) in &mut share.seconds {
            *sec = u64::MAX;
        }
        b.merge_share_at(&share, t, now);
        assert_eq!(b.top_at(t, None, Window::Minute)["rules"][0]["denied"], 5);
        assert_eq!(b.series_at(t + 1, None)["rules"][0]["denied"][SERIES - 2], 5);
    }

    #[test]
    fn a_peers_share_adds_its_nodes_and_counts_and_a_processs_own_is_not_merged_again() {
        let now = Instant::now();
        let t = 1_800_000_000;
        let (a, b) = two_processes(t, now);
        let share = a.take_share_at(t, now).unwrap();
        a.merge_share_at(&share, t, now);
        b.merge_share_at(&share, t, now);
        assert_eq!(a.top_at(t, None, Window::Minute)["rules"][0]["denied"], 10);
        let v = b.top_at(t, None, Window::Minute);
        assert_eq!(v["rules"][0]["top"][0], json!({"key": "user=a", "denied": 15, "allowed": 2, "nodes": 2}));
        assert_eq!(b.fleet().len(), 2);
        // A node both processes hear is listed once.
        let again = Share {
            process: a.process(),
            seq: 2,
            seconds: Vec::new(),
            nodes: vec![(2, t * 1000, 3.0, Duration::ZERO, false)],
        };
        b.merge_share_at(&again, t, now);
        assert_eq!(b.fleet().len(), 2);
    }

    /// Nodes heard by this process and by its peers are listed as at most [`MAX_NODES`], those
    /// heard of most lately: a flood of node ids through one process does not list twice the
    /// bound, nor hide the nodes heard since.
    #[test]
    fn the_fleet_lists_at_most_its_bound_of_nodes_those_heard_of_most_lately() {
        let now = Instant::now();
        let t = 1_800_000_000;
        let top = Top::default();
        for id in 0..MAX_NODES as u64 {
            top.heard_at(t, now, id, 1, true, Duration::ZERO, None);
        }
        // A peer's view of as many other nodes, heard of a second later; then of more again.
        let later = |from: u64, n: u64, ms: u64, seq: u64| Share {
            process: 7,
            seq,
            seconds: Vec::new(),
            nodes: (from..from + n).map(|id| (id, t * 1000 + ms, 1.0, Duration::ZERO, false)).collect(),
        };
        top.merge_share_at(&later(1_000_000, MAX_NODES as u64, 1000, 1), t + 1, now + Duration::from_secs(1));
        let listed = top.fleet();
        assert_eq!(listed.len(), MAX_NODES);
        assert!(listed.iter().all(|n| n["id"].as_str().unwrap() >= "00000000000f4240"), "the later ones");
        top.merge_share_at(&later(2_000_000, 10, 2000, 2), t + 2, now + Duration::from_secs(2));
        assert!(top.inner.lock().unwrap().remote.len() <= MAX_NODES);
        let listed = top.fleet();
        assert_eq!(listed.len(), MAX_NODES);
        assert!(listed.iter().any(|n| n["id"] == "00000000001e8480"), "the node heard of last is listed");
    }

    #[test]
    fn the_processs_own_decisions_count_as_a_section_and_are_shared() {
        let top = Top::default();
        let now = Instant::now();
        let t = 1_800_000_000;
        let d = |rule: &'static str, order: usize, key: &'static str, allowed: u64, outcome: Outcome| Decided {
            rule,
            order,
            key: key.as_bytes(),
            allowed,
            outcome,
        };
        top.decided_at(
            t,
            &[d("b", 1, "k=#00000001", 0, Outcome::Denied), d("a", 0, "k=#00000002", 2, Outcome::Within)],
        );
        top.decided_at(
            t,
            &[d("b", 1, "k=#00000001", 0, Outcome::Denied), d("b", 1, "k=#00000003", 0, Outcome::ShadowDenied)],
        );
        // The key is listed: what it is admitted counts for it too.
        top.decided_at(t, &[d("b", 1, "k=#00000001", 5, Outcome::Within)]);
        let v = top.top_at(t, None, Window::Minute);
        let rules = v["rules"].as_array().unwrap();
        assert_eq!((rules[0]["rule"].clone(), rules[0]["allowed"].clone()), (json!("a"), json!(2)), "{v}");
        let b = &rules[1];
        assert_eq!(
            (b["allowed"].clone(), b["denied"].clone(), b["shadow_denied"].clone()),
            (json!(5), json!(2), json!(1))
        );
        assert_eq!(b["top"][0], json!({"key": "k=#00000001", "denied": 2, "allowed": 5, "nodes": 1}));
        assert_eq!(b["top"][1]["key"], "k=#00000003");
        // Read once, counted once; what follows in the same second adds to it.
        top.decided_at(t, &[d("b", 1, "k=#00000001", 0, Outcome::Denied)]);
        assert_eq!(top.top_at(t + 1, Some("b"), Window::Minute)["rules"][0]["denied"], 3);
        assert_eq!(top.series_at(t + 1, Some("b"))["rules"][0]["denied"][SERIES - 2], 3);
        // The peers hear it in this process's share.
        let share = top.take_share_at(t + 1, now).unwrap();
        let shared: u64 = share.seconds.iter().flat_map(|(_, s)| &s.rules).map(|r| r.denied).sum();
        assert_eq!((shared, share.nodes.len()), (3, 0), "no node: the process decided them itself");
        // A second not yet read is shared once it is over.
        top.decided_at(t + 2, &[d("a", 0, "k=#00000002", 0, Outcome::Denied)]);
        assert!(top.take_share_at(t + 2, now).is_none());
        assert_eq!(top.take_share_at(t + 3, now).unwrap().seconds.len(), 1);
    }

    /// `top` lists at most 20 keys, by denials, the most first.
    #[test]
    fn at_most_20_keys_are_listed_the_most_denied_first() {
        let top = Top::default();
        let t = 1_800_000_000;
        let keys: Vec<String> = (0..25).map(|i| format!("k=#{i:08}")).collect();
        for (i, k) in keys.iter().enumerate() {
            for _ in 0..=i {
                top.decided_at(
                    t,
                    &[Decided { rule: "r", order: 0, key: k.as_bytes(), allowed: 0, outcome: Outcome::Denied }],
                );
            }
        }
        let v = top.top_at(t + 1, Some("r"), Window::Minute);
        let listed: Vec<u64> =
            v["rules"][0]["top"].as_array().unwrap().iter().map(|e| e["denied"].as_u64().unwrap()).collect();
        assert_eq!(listed, (6..=25).rev().collect::<Vec<u64>>(), "{v}");
    }

    /// A client admitted for a while and then denied is listed with what it was admitted
    /// before its first denial, in earlier seconds too (it was listed with 0).
    #[test]
    fn a_keys_admissions_before_its_first_denial_count_for_it() {
        let top = Top::default();
        let t = 1_800_000_000;
        let d = |key: &'static str, allowed: u64, outcome: Outcome| Decided {
            rule: "r",
            order: 0,
            key: key.as_bytes(),
            allowed,
            outcome,
        };
        for s in 0..10 {
            top.decided_at(t + s, &[d("k=a", 1, Outcome::Within), d("k=b", 1, Outcome::Within)]);
        }
        top.decided_at(t + 10, &[d("k=a", 0, Outcome::Denied)]);
        top.decided_at(t + 11, &[d("k=a", 0, Outcome::Denied)]);
        let v = top.top_at(t + 12, Some("r"), Window::Minute);
        let r = &v["rules"][0];
        assert_eq!((r["allowed"].clone(), r["denied"].clone()), (json!(20), json!(2)), "{v}");
        assert_eq!(r["top"], json!([{"key": "k=a", "denied": 2, "allowed": 10, "nodes": 1}]), "{v}");
    }

    #[test]
    fn a_peer_lists_the_configured_rules_in_the_configurations_order_whatever_order_they_were_decided_in() {
        let (rls, peer) = (Top::default(), Top::default());
        rls.configured(["api.a", "api.b", "api.a", "api.c"]);
        let now = Instant::now();
        let t = 1_800_000_000;
        let d = |rule: &'static str, order: usize| Decided {
            rule,
            order,
            key: b"user=x",
            allowed: 0,
            outcome: Outcome::Denied,
        };
        // Decided last rule first, one a second, and an override.
        rls.decided_at(t, &[d("api (override)", usize::MAX), d("api.c", 3)]);
        rls.decided_at(t + 1, &[d("api.a", 0)]);
        rls.decided_at(t + 2, &[d("api.b", 1)]);
        let share = rls.take_share_at(t + 3, now).unwrap();
        peer.merge_share_at(&share, t + 3, now);
        for top in [&peer, &rls] {
            let v = top.top_at(t + 3, None, Window::Minute);
            let names: Vec<&str> = v["rules"].as_array().unwrap().iter().map(|r| r["rule"].as_str().unwrap()).collect();
            assert_eq!(names, ["api.a", "api.b", "api.c", "api (override)"], "{v}");
            let denied: Vec<u64> =
                v["rules"].as_array().unwrap().iter().map(|r| r["denied"].as_u64().unwrap()).collect();
            assert_eq!(denied, [1, 1, 1, 1], "idle rows add nothing");
        }
    }

    #[test]
    fn the_processs_own_rules_are_bounded_too() {
        let top = Top::default();
        let names: Vec<String> = (0..MAX_RULES + 10).map(|i| format!("r{i}")).collect();
        let decided: Vec<Decided<'_>> = names
            .iter()
            .enumerate()
            .map(|(i, n)| Decided { rule: n, order: i, key: b"k=#00000001", allowed: 0, outcome: Outcome::Denied })
            .collect();
        top.decided_at(1_800_000_000, &decided);
        let v = top.top_at(1_800_000_000, None, Window::Minute);
        assert_eq!(v["rules"].as_array().unwrap().len(), MAX_RULES);
        // And say so: a rule heard of from now on may be counted nowhere.
        assert_eq!((v["full"].clone(), top.series_at(1_800_000_000, None)["full"].clone()), (json!(true), json!(true)));
        assert!(Top::default().top_at(1_800_000_000, None, Window::Minute).get("full").is_none());
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
