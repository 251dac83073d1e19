//! Who the proxy is limiting: each rule's denied (and shadow "would deny") requests, counted
//! per VM on the request path at a few hundred instructions, merged on the tick into one
//! bounded summary per rule in shared data, reported in sync batches or logged once a minute.
//!
//! A denial costs a hash of its counter key and one slot of a small two-way table, whose
//! slots keep a key's recent heat across ticks; an admitted request costs nothing. On each
//! tick every VM merges its table's denials into its rules' shared summaries
//! ([`ratewall_core::topk::Summary`], at most 64 keys each, whatever the traffic) with
//! compare-and-swap. With sync a rule's summary runs on from tick to tick (its weights halved
//! each minute), so a key denied a little on each VM in each tick stays listed and counted;
//! each batch carries what every listed key gained since the batch before. Summaries hold
//! counter keys, which carry no secret value
//! (secret parts are keyed hashes); keys are shown ([`ratewall_core::topk::render`]) only when
//! logged or sent.

use crate::host::{Host, Level, SetError};
use ratewall_core::encoding::{put_varint, Reader};
use ratewall_core::rules::Config;
use ratewall_core::sync::{Delta, RuleTop, TopSection};
use ratewall_core::topk::{bounded_key, node_bit, render, Distinct, Summary};
use ratewall_core::Nanos;
use std::cell::RefCell;

/// Slots of a VM's table of recent denials (direct-mapped by key hash).
/// Documents of up to this many rules list their idle rules too in each batch's top section
/// (about 70 bytes each at most), so that the store lists every rule in the document's order;
/// longer ones list the rules that decided something, in that order, keeping the section's
/// 32 KiB for their counts and keys.
const IDLE_LISTED_UP_TO: usize = 64;
const SLOTS: usize = 256;
/// How often the proxy logs each rule's top denied keys when it has no store.
pub const LOG_EVERY: Nanos = 60 * ratewall_core::SECOND;
/// How often a proxy without a store ticks to merge its VMs' denials.
pub const TICK: Nanos = ratewall_core::SECOND;
/// Keys a log line names.
const LOGGED: usize = 5;
/// Counters per rule whose units asks took are kept, between batches, for the keys a batch
/// lists (an exact rule's admitted units travel in no delta); longer keys are not kept.
const PAID_KEYS: usize = 32;
const PAID_KEY_MAX: usize = 256;

/// Adds `units` under `key` to `into`, at most [`PAID_KEYS`] keys of at most
/// [`PAID_KEY_MAX`] bytes (others are not kept: their units still count in the rule's).
fn add_paid(into: &mut Vec<(Vec<u8>, u64)>, key: &[u8], units: u64) {
    if let Some(e) = into.iter_mut().find(|(k, _)| k.as_slice() == key) {
        e.1 = e.1.saturating_add(units);
    } else if into.len() < PAID_KEYS && key.len() <= PAID_KEY_MAX {
        into.push((key.to_vec(), units));
    }
}

/// Shared keys a rule's summary may take: its name's hash picks where it looks first, so rules
/// of several documents on one proxy (NGINX's `proxy_wasm` directives, filters sharing a
/// `vm_id`) keep theirs apart, and the keys stay bounded whatever rules come and go (shared
/// data has no delete).
const SHARED_KEYS: u64 = 1024;
/// Keys a rule's summary looks at, from the one its name's hash picks: a name whose first key
/// another rule holds takes the next free one (or one left by a rule no tick has seen for a
/// while). Past them, two names on one key take turns (each finds the other's and starts
/// afresh): with one key per name, 9 of 250 rules in one document shared a key with another
/// and each such pair lost all but one's denials.
const PROBES: u64 = 16;

fn shared_key(name: &str, probe: u64) -> String {
    let first = ratewall_core::key::fnv1a(name.as_bytes()) % SHARED_KEYS;
    format!("rw1/top/{}", (first + probe) % SHARED_KEYS)
}

/// Where rule `name`'s shared state is: its key, value (`None`: none there yet, or another
/// rule's that it takes over) and CAS. The key holding `name`; else the first of its
/// [`PROBES`] keys that is empty or holds a state no tick has rolled for a while (`now`); else
/// its first key.
fn locate(host: &dyn Host, name: &str, now: Nanos) -> Option<(String, Option<Shared>, Option<u32>)> {
    let mut free = None;
    for probe in 0..PROBES {
        let key = shared_key(name, probe);
        let Ok((value, cas)) = host.shared_get(&key) else { return None };
        let state = value.as_deref().and_then(Shared::decode);
        match state {
            Some(s) if s.name == name => return Some((key, Some(s), cas)),
            Some(s) if now.saturating_sub(s.minute_start) < LOG_EVERY + LOG_EVERY / 4 => {}
            // Nothing there, or a state left behind: free for this name.
            other => {
                let empty = other.is_none();
                free = free.or(Some((key, cas)));
                // No name past an empty key: states are only ever written into free keys.
                if empty {
                    break;
                }
            }
        }
    }
    match free {
        Some((key, cas)) => Some((key, None, cas)),
        None => {
            let key = shared_key(name, 0);
            let (_, cas) = host.shared_get(&key).ok()?;
            Some((key, None, cas))
        }
    }
}

/// Where rule `name`'s shared state is, when it has one: its key, state and CAS.
fn find(host: &dyn Host, name: &str) -> Option<(String, Shared, Option<u32>)> {
    // (At time 0 no other rule's state is taken as left behind: only `name`'s is found.)
    let (key, state, cas) = locate(host, name, 0)?;
    Some((key, state?, cas))
}

/// A recent denial of one counter.
#[derive(Debug)]
struct Slot {
    hash: u64,
    rule: usize,
    key: Vec<u8>,
    /// Denials since the last tick.
    denied: u64,
    /// Its denials in [`HEAT`]ths, halved at every tick: how often it is denied lately.
    heat: u32,
}

/// One denial's heat: a key denied once and never again holds its slot for five ticks.
const HEAT: u32 = 16;

/// One VM's denials since its last tick.
#[derive(Debug, Default)]
struct Local {
    slots: Vec<Option<Slot>>,
    /// Per rule: keys evicted from `slots`, and denials, shadow denials, distinct keys.
    rules: Vec<LocalRule>,
    any: bool,
}

#[derive(Debug, Default, Clone)]
struct LocalRule {
    spilled: Option<Summary>,
    denied: u64,
    shadow: u64,
    distinct: Distinct,
    /// Units admitted that an ask took at the store (with sync): in no delta; and per
    /// counter key (some of them, [`add_paid`]).
    paid: u64,
    paid_keys: Vec<(Vec<u8>, u64)>,
}

/// One rule's state in shared data.
#[derive(Debug, Default, PartialEq)]
struct Shared {
    name: String,
    /// The minute being counted: its start, denials, distinct keys (and the last minute's).
    minute_start: Nanos,
    minute: Summary,
    previous: Distinct,
    current: Distinct,
    /// Since the last batch (with sync): denials, shadow denials, units admitted that asks
    /// took at the store.
    pending_denied: u64,
    pending_shadow: u64,
    pending_paid: u64,
    pending_paid_keys: Vec<(Vec<u8>, u64)>,
    /// With sync, the listed count of each key of `minute` (by [`hash`]) when the last batch
    /// took them, sorted: a batch carries what each key gained since.
    reported: Vec<(u64, u64)>,
}

impl Shared {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(512);
        put_varint(&mut out, self.name.len() as u64);
        out.extend_from_slice(self.name.as_bytes());
        put_varint(&mut out, self.minute_start);
        for d in [&self.previous, &self.current] {
            for w in d.0 {
                out.extend_from_slice(&w.to_le_bytes());
            }
        }
        self.minute.encode(&mut out);
        put_varint(&mut out, self.pending_denied);
        put_varint(&mut out, self.pending_shadow);
        put_varint(&mut out, self.reported.len() as u64);
        for (h, n) in &self.reported {
            out.extend_from_slice(&h.to_le_bytes());
            put_varint(&mut out, *n);
        }
        put_varint(&mut out, self.pending_paid);
        put_varint(&mut out, self.pending_paid_keys.len() as u64);
        for (k, n) in &self.pending_paid_keys {
            put_varint(&mut out, k.len() as u64);
            out.extend_from_slice(k);
            put_varint(&mut out, *n);
        }
        out
    }

    /// What each listed key gained since the last batch took them: its listed count less the
    /// one reported then (all of it for a key listed since, or listed anew after it was
    /// dropped, which restarted its count below the one reported).
    fn gained(&self) -> Summary {
        let mut out = Summary::default();
        for e in self.minute.entries() {
            let h = hash(&e.key);
            let before = match self.reported.binary_search_by(|(k, _)| k.cmp(&h)) {
                Ok(i) => self.reported.get(i).map_or(0, |(_, n)| *n),
                Err(_) => 0,
            };
            let gain = if before <= e.denied { e.denied - before } else { e.denied };
            if gain > 0 {
                out.add(&e.key, gain, 0, 0);
            }
        }
        out
    }

    fn decode(bytes: &[u8]) -> Option<Shared> {
        let mut r = Reader { bytes, pos: 0 };
        let n = usize::try_from(r.varint().ok()?).ok()?;
        let name = String::from_utf8(r.take(n).ok()?.to_vec()).ok()?;
        let minute_start = r.varint().ok()?;
        let mut distinct = [Distinct::default(), Distinct::default()];
        for d in &mut distinct {
            for w in d.0.iter_mut() {
                *w = u64::from_le_bytes(r.take(8).ok()?.try_into().ok()?);
            }
        }
        let [previous, current] = distinct;
        let minute = Summary::decode(&mut r, ratewall_core::sync::MAX_KEY).ok()?;
        let (pending_denied, pending_shadow) = (r.varint().ok()?, r.varint().ok()?);
        let n = usize::try_from(r.varint().ok()?).ok().filter(|n| *n <= minute.capacity())?;
        let mut reported = Vec::with_capacity(n);
        for _ in 0..n {
            reported.push((u64::from_le_bytes(r.take(8).ok()?.try_into().ok()?), r.varint().ok()?));
        }
        // Absent from an older VM's state (during an upgrade).
        let pending_paid = if r.pos < bytes.len() { r.varint().ok()? } else { 0 };
        let mut pending_paid_keys = Vec::new();
        if r.pos < bytes.len() {
            let n = usize::try_from(r.varint().ok()?).ok().filter(|n| *n <= PAID_KEYS)?;
            for _ in 0..n {
                let len = usize::try_from(r.varint().ok()?).ok().filter(|l| *l <= PAID_KEY_MAX)?;
                let k = r.take(len).ok()?.to_vec();
                pending_paid_keys.push((k, r.varint().ok()?));
            }
        }
        (r.pos == bytes.len()).then_some(Shared {
            name,
            minute_start,
            minute,
            previous,
            current,
            pending_denied,
            pending_shadow,
            pending_paid,
            pending_paid_keys,
            reported,
        })
    }
}

/// How a rule's document shows the counter keys its shared state lists (by [`hash`]), in a
/// shared key of its own ([`shown_key`]; the state's encoding is unchanged, so VMs of an
/// earlier version sharing the data keep reading it): a VM of another document that syncs
/// through the same lease lists the rule's keys so in its batches ([`Top::section`]).
#[derive(Debug, Default, PartialEq)]
struct ShownKeys {
    name: String,
    keys: Vec<(u64, Vec<u8>)>,
}

/// Where rule `name`'s [`ShownKeys`] are (two names on one key take turns).
fn shown_key(name: &str) -> String {
    format!("rw1/top/shown/{}", ratewall_core::key::fnv1a(name.as_bytes()) % SHARED_KEYS)
}

impl ShownKeys {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        put_varint(&mut out, self.name.len() as u64);
        out.extend_from_slice(self.name.as_bytes());
        put_varint(&mut out, self.keys.len() as u64);
        for (h, k) in &self.keys {
            out.extend_from_slice(&h.to_le_bytes());
            put_varint(&mut out, k.len() as u64);
            out.extend_from_slice(k);
        }
        out
    }

    fn decode(bytes: &[u8]) -> Option<ShownKeys> {
        let mut r = Reader { bytes, pos: 0 };
        let n = usize::try_from(r.varint().ok()?).ok()?;
        let name = String::from_utf8(r.take(n).ok()?.to_vec()).ok()?;
        let n = usize::try_from(r.varint().ok()?).ok().filter(|n| *n <= SHOWN_KEYS)?;
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            let h = u64::from_le_bytes(r.take(8).ok()?.try_into().ok()?);
            let len = usize::try_from(r.varint().ok()?).ok().filter(|l| *l <= ratewall_core::topk::MAX_KEY)?;
            keys.push((h, r.take(len).ok()?.to_vec()));
        }
        (r.pos == bytes.len()).then_some(ShownKeys { name, keys })
    }

    /// Rule `name`'s, as stored (none: none stored, or another rule's on its key).
    fn of(host: &dyn Host, name: &str) -> Vec<(u64, Vec<u8>)> {
        match host.shared_get(&shown_key(name)) {
            Ok((Some(v), _)) => ShownKeys::decode(&v).filter(|s| s.name == name).map(|s| s.keys).unwrap_or_default(),
            _ => Vec::new(),
        }
    }
}

/// Most keys a [`ShownKeys`] holds: a summary's, and the keys of asks kept beside it.
const SHOWN_KEYS: usize = 64 + PAID_KEYS;

/// Keeps rule `name`'s [`ShownKeys`] to the keys `s` lists, each shown by `config` (the rule's
/// own document): written only when a key listed has no shown form yet.
fn show_keys(host: &dyn Host, config: &Config, name: &str, s: &Shared) {
    let listed: Vec<(u64, &[u8])> = s
        .minute
        .entries()
        .iter()
        .map(|e| e.key.as_slice())
        .chain(s.pending_paid_keys.iter().map(|(k, _)| k.as_slice()))
        .map(|k| (hash(k), k))
        .take(SHOWN_KEYS)
        .collect();
    let key = shown_key(name);
    for _ in 0..4 {
        let Ok((value, cas)) = host.shared_get(&key) else { return };
        let mut keys =
            value.as_deref().and_then(ShownKeys::decode).filter(|s| s.name == name).map(|s| s.keys).unwrap_or_default();
        if listed.iter().all(|(h, _)| keys.iter().any(|(k, _)| k == h)) {
            return;
        }
        keys.retain(|(h, _)| listed.iter().any(|(k, _)| k == h));
        for (h, k) in &listed {
            if keys.iter().any(|(s, _)| s == h) {
                continue;
            }
            if let Some((_, shown)) = render(config, k) {
                keys.push((*h, bounded_key(shown, &config.identity.hash_key).into_bytes()));
            }
        }
        let shown = ShownKeys { name: name.to_owned(), keys };
        match host.shared_set(&key, &shown.encode(), cas) {
            Err(SetError::CasMismatch) => continue,
            _ => return,
        }
    }
}

/// Metric ids.
#[derive(Debug, Default)]
struct Metrics {
    limited_keys: Vec<Option<u32>>,
    evictions: Option<u32>,
}

/// A VM's part in its proxy's top offenders.
#[derive(Debug)]
pub struct Top {
    local: RefCell<Local>,
    metrics: Metrics,
    /// Whether batches carry the summaries (else the proxy logs them).
    synced: bool,
    /// When a VM with no new denials next looks at the shared state (minutes to roll over).
    idle_until: std::cell::Cell<Nanos>,
    /// Per rule, units the syncing VM's batches reported for keys not listed yet: a key's
    /// first denial brings them, so that its entry counts what the client was admitted before.
    admitted: RefCell<Vec<ratewall_core::topk::Admitted>>,
    /// The same, per rule of the other documents that sync through the same lease.
    foreign: RefCell<std::collections::HashMap<String, ratewall_core::topk::Admitted>>,
    /// When this VM last said its rules' names in [`NAMES_KEY`].
    named_at: std::cell::Cell<Nanos>,
    /// Its sync's namespace (empty without sync).
    ns: String,
}

/// The shared key (under the sync's [`crate::sync::namespace`]) naming the rules of every
/// document on the proxy that syncs to one store, each with when a VM of its document last
/// said it (seconds): the VM holding that sync's lease lists in its batches the rules of the
/// documents that share the lease as well as its own.
const NAMES_KEY: &str = "/top-names";
/// Most rule names [`NAMES_KEY`] keeps (the longest unsaid go first).
const MAX_NAMES: usize = 256;
/// How often a VM says its rules' names, and how long a name unsaid is kept.
const NAMES_EVERY: Nanos = 10 * ratewall_core::SECOND;
const NAMES_KEPT: Nanos = 6 * NAMES_EVERY;

/// The names [`NAMES_KEY`] holds, with when each was last said (seconds).
fn decode_names(bytes: &[u8]) -> Vec<(String, u64)> {
    let mut r = Reader { bytes, pos: 0 };
    let mut out = Vec::new();
    while r.pos < bytes.len() && out.len() < MAX_NAMES {
        let Some(name) = r
            .varint()
            .ok()
            .and_then(|n| usize::try_from(n).ok())
            .and_then(|n| r.take(n).ok())
            .and_then(|b| String::from_utf8(b.to_vec()).ok())
        else {
            break;
        };
        let Ok(at) = r.varint() else { break };
        out.push((name, at));
    }
    out
}

fn encode_names(names: &[(String, u64)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, at) in names {
        put_varint(&mut out, name.len() as u64);
        out.extend_from_slice(name.as_bytes());
        put_varint(&mut out, *at);
    }
    out
}

/// The rule names of the documents that sync through one lease ([`NAMES_KEY`] under `ns`).
fn names(host: &dyn Host, ns: &str) -> Vec<String> {
    match host.shared_get(&format!("{ns}{NAMES_KEY}")) {
        Ok((Some(v), _)) => decode_names(&v).into_iter().map(|(n, _)| n).collect(),
        _ => Vec::new(),
    }
}

/// FNV-1a, 64-bit, with a final mix (its low bits pick the slot, its top bits the distinct
/// estimate's bit): the cheapest hash for a key already chosen by the rules.
fn hash(key: &[u8]) -> u64 {
    let h = ratewall_core::key::fnv1a(key);
    (h ^ (h >> 31)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

impl Top {
    /// Defines the metrics of `config`'s rules (their shared keys are made on the first tick
    /// that has something to merge: no shared data at configure).
    pub fn new(host: &dyn Host, config: &Config, metric: impl Fn(&str, &str) -> String) -> Top {
        let limited_keys = config.rules.iter().map(|r| host.define_gauge(&metric(&r.name, "limited_keys"))).collect();
        let metrics = Metrics { limited_keys, evictions: host.define_counter("ratewall_top_evictions") };
        let local = Local { slots: Vec::new(), rules: vec![LocalRule::default(); config.rules.len()], any: false };
        let admitted = RefCell::new(vec![ratewall_core::topk::Admitted::default(); config.rules.len()]);
        Top {
            local: RefCell::new(local),
            metrics,
            synced: config.sync.is_some(),
            idle_until: Default::default(),
            admitted,
            foreign: RefCell::default(),
            named_at: std::cell::Cell::new(0),
            ns: config.sync.as_ref().map(crate::sync::namespace).unwrap_or_default(),
        }
    }

    /// Says `config`'s rule names in [`NAMES_KEY`] (at most every [`NAMES_EVERY`]), dropping
    /// names no VM said for [`NAMES_KEPT`].
    fn say_names(&self, host: &dyn Host, config: &Config, now: Nanos) {
        if !self.synced || now.saturating_sub(self.named_at.get()) < NAMES_EVERY && self.named_at.get() <= now {
            return;
        }
        self.named_at.set(now);
        let now_s = now / ratewall_core::SECOND;
        let key = format!("{}{NAMES_KEY}", self.ns);
        for _ in 0..16 {
            let Ok((value, cas)) = host.shared_get(&key) else { return };
            let mut said = value.as_deref().map(decode_names).unwrap_or_default();
            said.retain(|(_, at)| now_s.saturating_sub(*at) < NAMES_KEPT / ratewall_core::SECOND && *at <= now_s + 60);
            for rule in &config.rules {
                match said.iter_mut().find(|(n, _)| *n == rule.name) {
                    Some(entry) => entry.1 = now_s,
                    None => said.push((rule.name.clone(), now_s)),
                }
            }
            if said.len() > MAX_NAMES {
                said.sort_by_key(|(_, at)| std::cmp::Reverse(*at));
                said.truncate(MAX_NAMES);
            }
            match host.shared_set(&key, &encode_names(&said), cas) {
                Err(SetError::CasMismatch) => continue,
                _ => return,
            }
        }
    }

    /// A request denied (or, `shadow`, that a shadow rule would deny) by `rule`, one of
    /// whose `checks` it is.
    pub fn denied_by(&self, rule: usize, checks: &[ratewall_core::eval::Check], shadow: bool) {
        if let Some(c) = checks.iter().find(|c| c.rule == rule) {
            self.denied(rule, &c.key, shadow);
        }
    }

    /// `units` admitted by `rule` under the counter `key` that an ask took at the store (they
    /// travel in no delta).
    pub fn paid(&self, rule: usize, key: &[u8], units: u64) {
        let Ok(mut local) = self.local.try_borrow_mut() else { return };
        if let Some(r) = local.rules.get_mut(rule) {
            r.paid = r.paid.saturating_add(units);
            add_paid(&mut r.paid_keys, key, units);
            local.any = true;
        }
    }

    /// A request denied (or, `shadow`, that a shadow rule would deny) by `rule` under the
    /// counter `key`.
    pub fn denied(&self, rule: usize, key: &[u8], shadow: bool) {
        let h = hash(key);
        let Ok(mut local) = self.local.try_borrow_mut() else { return };
        let local = &mut *local;
        let Some(r) = local.rules.get_mut(rule) else { return };
        local.any = true;
        if shadow {
            r.shadow += 1;
        } else {
            r.denied += 1;
        }
        r.distinct.add(h);
        if local.slots.is_empty() {
            local.slots.resize_with(SLOTS, || None);
        }
        // Two ways per set: a key keeps its slot against keys denied less often lately (its
        // heat outlives the tick), so a flood of distinct keys churns one way while a client
        // denied again and again — even once per tick, on each of several VMs — keeps the other.
        let set = (h as usize % (SLOTS / 2)) * 2;
        let Some([a, b]) = local.slots.get_mut(set..set + 2) else { return };
        for s in [&mut *a, &mut *b].into_iter().flatten() {
            if s.hash == h && s.rule == rule {
                s.denied += 1;
                s.heat = s.heat.saturating_add(HEAT);
                return;
            }
        }
        let heat = |s: &Option<Slot>| s.as_ref().map_or(0, |s| s.heat);
        let slot = if heat(a) < heat(b) { a } else { b };
        let new = Slot { hash: h, rule, key: key.to_vec(), denied: 1, heat: HEAT };
        // A key denied once, and never before in its slot's memory, goes uncounted in the
        // summary when another takes its slot (its denial stays in the rule's totals): a flood
        // of distinct keys then costs a slot each, not a summary update each. A key denied more
        // often keeps its count.
        if let Some(old) = slot.replace(new).filter(|o| o.denied > 1 || (o.denied == 1 && o.heat > HEAT)) {
            if let Some(r) = local.rules.get_mut(old.rule) {
                r.spilled.get_or_insert_with(|| Summary::new(SLOTS)).add(&old.key, old.denied, 0, 0);
            }
        }
    }

    /// Every VM, every tick: merges this VM's denials into the shared summaries; logs a
    /// rule's top denied keys when its minute is over (without a store), and sets the gauges.
    pub fn on_tick(&self, host: &dyn Host, config: &Config) {
        let now = host.now();
        let per_rule = {
            let Ok(mut l) = self.local.try_borrow_mut() else { return };
            if !l.any {
                drop(l);
                if now >= self.idle_until.get() || now < self.idle_until.get().saturating_sub(TICK) {
                    self.idle_until.set(now.saturating_add(TICK));
                    self.roll(host, config, now, None);
                }
                return;
            }
            let l = &mut *l;
            l.any = false;
            let n = l.rules.len();
            let mut per_rule = std::mem::replace(&mut l.rules, vec![LocalRule::default(); n]);
            // The table stays allocated for the next tick's denials; each key keeps its slot,
            // with its heat halved, until it cools down.
            for slot in l.slots.iter_mut() {
                let Some(s) = slot.as_mut() else { continue };
                if s.denied > 0 {
                    if let Some(r) = per_rule.get_mut(s.rule) {
                        r.spilled.get_or_insert_with(|| Summary::new(SLOTS)).add(&s.key, s.denied, 0, 0);
                    }
                }
                s.denied = 0;
                s.heat /= 2;
                if s.heat == 0 {
                    *slot = None;
                }
            }
            per_rule
        };
        self.roll(host, config, now, Some(&per_rule));
    }

    /// Merges `mine` (None: nothing) into each rule's shared state, rolling its minute over.
    fn roll(&self, host: &dyn Host, config: &Config, now: Nanos, mine: Option<&[LocalRule]>) {
        self.say_names(host, config, now);
        for (i, rule) in config.rules.iter().enumerate() {
            let add = mine.and_then(|m| m.get(i)).filter(|r| r.denied + r.shadow + r.paid > 0);
            for _ in 0..16 {
                let Some((key, found, cas)) = locate(host, &rule.name, now) else { break };
                let fresh = found.is_none();
                let mut s =
                    found.unwrap_or_else(|| Shared { name: rule.name.clone(), minute_start: now, ..Shared::default() });
                let mut line = None;
                // Time that goes backwards is clamped (saturating): a minute only ever ends.
                // (A minute that starts further ahead than a minute is from a clock that stepped
                // back: it ends now.)
                let rolled =
                    now.saturating_sub(s.minute_start) >= LOG_EVERY || s.minute_start > now.saturating_add(LOG_EVERY);
                // A minute that ended a while ago (ticks, every second, roll a minute over as it
                // ends) was left by a rule no tick saw since (taken out of the rules, and pushed
                // again now): its denials are not the last minute's, nor are its counts still to
                // report, so they are dropped unsaid.
                let stale = rolled && now.saturating_sub(s.minute_start) >= LOG_EVERY + LOG_EVERY / 4;
                if stale {
                    s = Shared { name: rule.name.clone(), minute_start: now, ..Shared::default() };
                }
                if rolled && !stale {
                    if !self.synced && !s.minute.is_empty() {
                        line = Some(log_line(config, &rule.name, &s.minute));
                    }
                    s.previous = s.current;
                    s.current = Distinct::default();
                    if self.synced {
                        // Batches carry what each key gained: the summary runs on (so a heavy
                        // key stays listed, counted from its first denials), its weights halved.
                        s.minute.halve_weights();
                    } else {
                        s.minute = Summary::default();
                    }
                    s.minute_start = now;
                }
                let before = s.minute.evictions();
                if let Some(a) = add {
                    if let Some(sp) = &a.spilled {
                        s.minute.merge_keeping(sp);
                    }
                    s.current.merge(&a.distinct);
                    if self.synced {
                        s.pending_denied = s.pending_denied.saturating_add(a.denied);
                        s.pending_shadow = s.pending_shadow.saturating_add(a.shadow);
                        s.pending_paid = s.pending_paid.saturating_add(a.paid);
                        for (k, n) in &a.paid_keys {
                            add_paid(&mut s.pending_paid_keys, k, *n);
                        }
                    }
                }
                if add.is_none() && !rolled && !fresh {
                    self.gauge(host, i, &s, now);
                    break;
                }
                match host.shared_set(&key, &s.encode(), cas) {
                    Ok(()) => {
                        if self.synced && add.is_some() {
                            show_keys(host, config, &rule.name, &s);
                        }
                        if let (Some(m), true) = (self.metrics.evictions, s.minute.evictions() > before) {
                            host.increment(m, s.minute.evictions() - before);
                        }
                        if let Some(line) = line {
                            host.log(Level::Info, &line);
                        }
                        self.gauge(host, i, &s, now);
                        break;
                    }
                    Err(SetError::CasMismatch) => continue,
                    Err(SetError::Other) => break,
                }
            }
        }
    }

    /// Sets rule `rule`'s `limited_keys` gauge to 0.
    pub fn zero_gauge(&self, host: &dyn Host, rule: usize) {
        if let Some(Some(id)) = self.metrics.limited_keys.get(rule) {
            host.set_gauge(*id, 0);
        }
    }

    /// Distinct keys denied over the last minute: the running minute's plus the share of the
    /// last one still inside the minute (the sliding-window estimate).
    fn gauge(&self, host: &dyn Host, rule: usize, s: &Shared, now: Nanos) {
        let Some(Some(id)) = self.metrics.limited_keys.get(rule) else { return };
        let into = now.saturating_sub(s.minute_start).min(LOG_EVERY);
        let prev = s.previous.estimate() as u128 * u128::from(LOG_EVERY - into) / u128::from(LOG_EVERY);
        host.set_gauge(*id, s.current.estimate().saturating_add(prev as u64));
    }

    /// The section a new batch ends with: per rule, in the document's order, its counts and
    /// top denied keys since the last batch (taken from shared data, so each goes in one
    /// batch), admitted units from the batch's `deltas`; then those of the rules of other
    /// documents on the proxy that sync through the same lease ([`NAMES_KEY`]), their keys
    /// shown as their own document showed them. A key this node denied in its running
    /// minute, or whose counter is in `limited` (`fnv1a` of counter keys the store's answers
    /// found at their limit, sorted), has its admitted units sent though the node denied it
    /// nothing since: another node may have, and the store's entry for the key counts them.
    pub fn section(
        &self,
        host: &dyn Host,
        config: &Config,
        node: u64,
        deltas: &[Delta],
        limited: &[u64],
    ) -> Option<TopSection> {
        let mut by_key: std::collections::HashMap<&[u8], u64> = std::collections::HashMap::new();
        // Per rule name, its admitted units in this batch, and per key.
        let mut units_of: std::collections::HashMap<&[u8], Units<'_>> = std::collections::HashMap::new();
        for d in deltas.iter().filter(|d| d.units > 0) {
            let name = d.key.get(2..2 + usize::from(*d.key.get(1)?)).unwrap_or_default();
            let (sum, keys) = units_of.entry(name).or_default();
            *sum = sum.saturating_add(d.units);
            keys.push((&d.key, d.units));
            by_key.insert(&d.key, d.units);
        }
        let batch = Batch { by_key: &by_key, limited, bit: node_bit(node), now_s: host.now() / ratewall_core::SECOND };
        let (mut rules, mut active) = (Vec::new(), false);
        let idle_listed = config.rules.len() <= IDLE_LISTED_UP_TO;
        for (i, rule) in config.rules.iter().enumerate() {
            let mut waiting = self.admitted.borrow_mut();
            let units = units_of.get(rule.name.as_bytes());
            let own = Shown::Own(config);
            if let Some((top, busy)) =
                self.rule_top(host, &rule.name, (units, own, idle_listed), waiting.get_mut(i), &batch)
            {
                active |= busy;
                rules.push(top);
            }
        }
        // The rules of the other documents syncing through this lease, listed when they have
        // something to report.
        if self.synced {
            let mut foreign = self.foreign.borrow_mut();
            let named = names(host, &self.ns);
            // What was kept for rules no document names any more goes with them.
            foreign.retain(|n, _| named.contains(n));
            for name in named.into_iter().filter(|n| !config.rules.iter().any(|r| r.name == *n)) {
                if !foreign.contains_key(&name) && foreign.len() >= MAX_NAMES {
                    continue;
                }
                let units = units_of.get(name.as_bytes());
                let waiting = foreign.entry(name.clone()).or_default();
                let stored = (units, Shown::Stored, true);
                if let Some((top, true)) = self.rule_top(host, &name, stored, Some(waiting), &batch) {
                    active = true;
                    rules.push(top);
                }
            }
        }
        // Every rule, in the document's order (an idle one with no counts, in a document of up
        // to `IDLE_LISTED_UP_TO` rules), so that the store lists them in that order; none when
        // no rule has anything to report.
        active.then_some(TopSection { rules })
    }

    /// Rule `name`'s part of a batch's section: its counts and top keys since the last batch,
    /// taken from its shared state; its `units` admitted in the batch (sum, per counter key),
    /// keys shown as `shown` says; listed though idle when `idle_listed`. With whether it has
    /// anything to report; None for an idle rule not listed.
    fn rule_top(
        &self,
        host: &dyn Host,
        name: &str,
        (units, shown, idle_listed): (Option<&Units<'_>>, Shown<'_>, bool),
        mut waiting: Option<&mut ratewall_core::topk::Admitted>,
        batch: &Batch<'_>,
    ) -> Option<(RuleTop, bool)> {
        let mut taken = None;
        // The keys this node denied in its running minute, and how its document shows keys.
        let mut denied_here = Summary::default();
        let stored = match shown {
            Shown::Own(_) => Vec::new(),
            Shown::Stored => ShownKeys::of(host, name),
        };
        for _ in 0..16 {
            let Some((key, mut s, cas)) = find(host, name) else { break };
            denied_here = s.minute.clone();
            let gained = s.gained();
            if gained.is_empty() && s.pending_denied == 0 && s.pending_shadow == 0 && s.pending_paid == 0 {
                break;
            }
            let t =
                (gained, s.pending_denied, s.pending_shadow, s.pending_paid, std::mem::take(&mut s.pending_paid_keys));
            (s.pending_denied, s.pending_shadow, s.pending_paid) = (0, 0, 0);
            s.reported = s.minute.entries().iter().map(|e| (hash(&e.key), e.denied)).collect();
            s.reported.sort_unstable();
            match host.shared_set(&key, &s.encode(), cas) {
                Ok(()) => {
                    taken = Some(t);
                    break;
                }
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Other) => break,
            }
        }
        let busy_top = taken.is_some();
        let (pending, denied, shadow, paid, paid_keys) = taken.unwrap_or_default();
        let rule_allowed = units.map_or(0, |u| u.0).saturating_add(paid);
        let busy = busy_top || rule_allowed > 0;
        if !busy && !idle_listed {
            return None;
        }
        // A counter key's shown form, as the store lists it.
        let shown = |k: &[u8]| match shown {
            Shown::Own(config) => {
                render(config, k).map(|(_, s)| bounded_key(s, &config.identity.hash_key).into_bytes())
            }
            Shown::Stored => stored.iter().find(|(h, _)| *h == hash(k)).map(|(_, s)| s.clone()),
        };
        let mut top = pending.map_keys(shown);
        // Admitted units per shown key, for the listed keys: this batch's, and those of
        // earlier ones kept for a key until its first denial.
        let mut admitted: std::collections::HashMap<Vec<u8>, u64> = std::collections::HashMap::new();
        for e in pending.entries() {
            let asked = paid_keys.iter().find(|(k, _)| *k == e.key).map_or(0, |(_, n)| *n);
            let before = waiting.as_mut().map_or(0, |w| w.take(&e.key, batch.now_s));
            let u =
                batch.by_key.get(e.key.as_slice()).copied().unwrap_or(0).saturating_add(asked).saturating_add(before);
            if let (true, Some(k)) = (u > 0, shown(&e.key)) {
                *admitted.entry(k).or_default() += u;
            }
        }
        // Admitted units of keys not denied in this batch: sent now for a key the fleet
        // may list (their entries carry no denial), else kept for the key's first denial.
        let mut alone: std::collections::HashMap<Vec<u8>, u64> = std::collections::HashMap::new();
        // (Another document's key its document has shown no form of yet stays kept: its units
        // go once it has one, with the key's first denial there.)
        let listable = |k: &[u8]| {
            (denied_here.count(k) > 0 || batch.limited.binary_search(&ratewall_core::key::fnv1a(k)).is_ok())
                && shown(k).is_some()
        };
        let mut send_alone = |k: &[u8], u: u64| {
            if let Some(k) = shown(k) {
                *alone.entry(k).or_default() += u;
            }
        };
        if let Some(w) = waiting {
            let in_batch = units.into_iter().flat_map(|u| u.1.iter().copied());
            for (k, u) in in_batch.chain(paid_keys.iter().map(|(k, u)| (k.as_slice(), *u))) {
                if pending.count(k) > 0 {
                    continue;
                }
                if listable(k) {
                    send_alone(k, u.saturating_add(w.take(k, batch.now_s)));
                } else {
                    w.note(k, u, batch.now_s);
                }
            }
            for (k, u) in w.take_where(batch.now_s, |k| listable(k)) {
                send_alone(&k, u);
            }
        }
        // Units taken for keys now listable left `waiting` for good: they go in this section,
        // so it goes though it has nothing else (a batch of renewals only, its answers having
        // found the key's counter at its limit, another node denying it).
        let busy = busy || !alone.is_empty();
        for (k, u) in admitted {
            top.set_allowed(&k, u);
        }
        for (k, u) in alone {
            top.add_admitted(&k, u, 0);
        }
        let keys: Vec<Vec<u8>> = top.entries().iter().map(|e| e.key.clone()).collect();
        for k in keys {
            top.add(&k, 0, 0, batch.bit);
        }
        Some((RuleTop { rule: name.to_owned(), allowed: rule_allowed, denied, shadow_denied: shadow, top }, busy))
    }
}

/// A rule's units admitted in a batch: in all, and per counter key.
type Units<'a> = (u64, Vec<(&'a [u8], u64)>);

/// What a batch's section is built from, for every rule.
struct Batch<'a> {
    by_key: &'a std::collections::HashMap<&'a [u8], u64>,
    limited: &'a [u64],
    bit: u64,
    now_s: u64,
}

/// How a rule's counter keys are shown: by the rules of this VM's document, or as the rule's
/// own document stored them ([`ShownKeys`]).
#[derive(Clone, Copy)]
enum Shown<'a> {
    Own(&'a Config),
    Stored,
}

/// `ratewall: top denied [api-key] api_key=#3f9a1c2e 1204, ip=203.0.113.7 88`.
fn log_line(config: &Config, rule: &str, minute: &Summary) -> String {
    let shown = minute.map_keys(|k| render(config, k).map(|(_, s)| bounded_key(s, &config.identity.hash_key).into()));
    let mut line = format!("ratewall: top denied [{rule}]");
    for (i, e) in shown.top(LOGGED).iter().enumerate() {
        line.push_str(if i == 0 { " " } else { ", " });
        line.push_str(&String::from_utf8_lossy(&e.key));
        line.push(' ');
        line.push_str(&e.denied.to_string());
    }
    line
}
