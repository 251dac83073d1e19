//! The Worker's logic without the runtime, so it is unit-tested natively: rules that keep
//! their last good version, a request's checks, the blocked-key cache, the local fallback,
//! a request's decisions from its objects' answers and the refunds they owe, the messages
//! between the Worker and its Durable Objects, the isolate's metrics; the counter object
//! ([`object`]) and `/v1/sync` ([`store`]).

pub mod admin;
pub mod grants;
pub mod object;
pub mod store;
pub mod top;

use grants::Answer;

use ratewall_core::algo::{Algorithm, Decision, Limit, Nanos, State};
use ratewall_core::eval::{Check, CheckOutcome, CheckResult, Outcome, Skip, StoreError, Tally};
use ratewall_core::glob::normalize_path;
use ratewall_core::key::{client_ip, ip_key, parse_ip};
use ratewall_core::rules::{FailurePolicy, Mode};
use ratewall_core::sync::Applied;
pub use ratewall_core::sync::{hex, unhex};
use ratewall_core::{Config, ConfigError, Request};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::rc::Rc;

/// Nanoseconds per millisecond (the Workers clock's resolution).
pub const MS: Nanos = 1_000_000;

/// The rules in force, and the text they came from.
#[derive(Default)]
pub struct Rules {
    config: Option<Rc<Config>>,
    source: Vec<u8>,
    /// The last document rejected (each is reported once).
    last_rejected: Option<Vec<u8>>,
    /// The deployment's secret secret identity values are hashed under when the document
    /// sets no `identity.hash_key` (see [`Rules::keyed_by`]).
    deployment_secret: String,
}

/// What offering a rules document did, for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Offered {
    /// The same text as in force, or a rejection already reported: nothing to say.
    Unchanged,
    /// Now in force.
    Loaded(String),
    /// Rejected, for the first time (the rules in force stay).
    Rejected(String),
}

impl Rules {
    /// Loads `doc` unless it is the text already in force. A bad document is rejected as a
    /// whole and the rules in force stay. Returns whether the rules changed. Bytes, as read:
    /// a document that is not UTF-8 is refused as the filter and `ratewall check` refuse it
    /// (read as text, its bad bytes became U+FFFD and it went into force).
    pub fn load(&mut self, doc: &[u8]) -> Result<bool, ConfigError> {
        if self.config.is_some() && doc == self.source {
            return Ok(false);
        }
        let mut config = Config::parse(doc)?;
        config.identity.key_by_secret(&self.deployment_secret);
        self.config = Some(Rc::new(config));
        self.source = doc.to_owned();
        Ok(true)
    }

    /// Rules whose secret identity values, when the document sets no `identity.hash_key`,
    /// are hashed under a key derived from `secret` (the Worker's `RATEWALL_SYNC_SECRET`,
    /// else its admin token) rather than the key built into ratewall, which anyone can hash
    /// guesses under. Derived as a filter derives it from its `sync.secret`, so filter nodes
    /// syncing to the Worker show a value under the same hash.
    pub fn keyed_by(secret: &str) -> Rules {
        Rules { deployment_secret: secret.trim().to_owned(), ..Rules::default() }
    }

    /// Sets the deployment secret of [`Rules::keyed_by`] for the documents loaded from now on.
    pub fn set_deployment_secret(&mut self, secret: &str) {
        self.deployment_secret = secret.trim().to_owned();
    }

    /// Offers `doc`, read from `origin`, counting what happened in `metrics`.
    pub fn offer(&mut self, doc: &[u8], origin: &str, metrics: &mut Metrics) -> Offered {
        match self.load(doc) {
            Ok(true) => {
                metrics.rules_loaded += 1;
                self.last_rejected = None;
                Offered::Loaded(format!("ratewall: rules loaded from {origin}"))
            }
            Ok(false) => Offered::Unchanged,
            Err(_) if self.last_rejected.as_deref() == Some(doc) => Offered::Unchanged,
            Err(e) => {
                metrics.rules_rejected += 1;
                self.last_rejected = Some(doc.to_owned());
                let kept = if self.config.is_some() { "the previous rules stay in force" } else { "no rules" };
                Offered::Rejected(format!("ratewall: rules from {origin} rejected: {e}; {kept}"))
            }
        }
    }

    /// Whether `doc` is the text of the rules in force.
    pub fn in_force(&self, doc: &[u8]) -> bool {
        self.config.is_some() && self.source == doc
    }

    /// The rules in force, if a good document was ever loaded.
    pub fn current(&self) -> Option<Rc<Config>> {
        self.config.clone()
    }

    /// Whether a document was rejected and none was ever loaded: requests pass without limits
    /// (counted in `ratewall_config_rejected`).
    pub fn rejected_without_rules(&self) -> bool {
        self.config.is_none() && self.last_rejected.is_some()
    }
}

/// The counters a request must pass, from its method, URL path and headers. The client IP is
/// `CF-Connecting-IP` (set by Cloudflare, not by the client); without it, `X-Forwarded-For`
/// under `identity.ip.trusted_hops`.
pub fn checks_for(
    config: &Config,
    method: &str,
    path: &str,
    header: &dyn Fn(&str) -> Option<String>,
) -> (Vec<Check>, Vec<(usize, Skip)>) {
    let path = normalize_path(path.as_bytes());
    let values: Vec<Option<String>> =
        config.identity.headers.iter().map(|(_, h)| header(h).filter(|v| !v.is_empty())).collect();
    let headers: Vec<Option<&[u8]>> = values.iter().map(|v| v.as_deref().map(str::as_bytes)).collect();
    let src = config.identity.ip;
    let ip = match header("cf-connecting-ip").and_then(|v| parse_ip(v.trim().as_bytes())) {
        Some(ip) => Some(ip),
        None => client_ip(None, header("x-forwarded-for").as_deref().map(str::as_bytes), &src),
    }
    .map(|ip| ip_key(ip, &src));
    config.checks(&Request { method, path: &path, headers: &headers, ip: ip.as_deref() })
}

/// Counter objects a deployment spreads its counters over when `COUNTER_SHARDS` is not set.
/// A counter object costs a read, an alarm, a write and a delete over its life, and an
/// isolate sends one report per object per interval whatever the counters in it: per-IP rules
/// (most keys cold) cost an object and a call per key without shards. A shard serializes its
/// counters' calls, so an `exact` rule's checks (one call each) are bounded by a shard's
/// request rate: `COUNTER_SHARDS = "0"` gives each counter its own object (README, "The
/// Worker").
pub const DEFAULT_SHARDS: u32 = 16;

/// The Durable Object that holds `key`'s counter: shard `s:<n>` of `shards` (by the key's
/// FNV-1a hash, so every isolate and every version of the Worker agrees), or, with `shards`
/// 0, the counter's own object, named by the key's hex.
pub fn object_name(key: &[u8], shards: u32) -> String {
    if shards == 0 {
        return format!("c:{}", hex(key));
    }
    // FNV-1a, written out: the shard of a key must never change between builds, which a
    // std `Hasher` does not promise.
    let hash = key.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3));
    format!("s:{}", hash % u64::from(shards))
}

/// The storage key of `key`'s counter inside its object.
pub fn storage_key(key: &[u8]) -> String {
    format!("c:{}", hex(key))
}

/// Counter calls to one object, each on its counter's key: the message body (JSON).
pub fn encode_batch(calls: &[(Vec<u8>, Call)]) -> String {
    let calls: Vec<Value> = calls.iter().map(|(key, call)| json!({"key": hex(key), "call": call.value()})).collect();
    json!({ "batch": calls }).to_string()
}

/// Parses [`encode_batch`]; `None` when it is not a batch of counter calls (a registry call
/// in a batch is not one).
pub fn decode_batch(body: &str) -> Option<Vec<(Vec<u8>, Call)>> {
    let v: Value = serde_json::from_str(body).ok()?;
    v.get("batch")?
        .as_array()?
        .iter()
        .map(|c| {
            let key = unhex(c.get("key")?.as_str()?.as_bytes())?;
            let call = Call::from_value(c.get("call")?)?;
            call.limit().is_some().then_some((key, call))
        })
        .collect()
}

/// An object's reply to a counter call it did not apply because the counter's stored value
/// could not be read (it stays unloaded, and is kept): unlike a failed call (`None`), certain
/// to have counted nothing, so a sync batch names that counter failed and answers the rest.
pub const NOT_APPLIED: &str = r#"{"not_applied":true}"#;

/// An object's answers to a batch, in its order (`None`: that counter's call failed).
pub fn encode_replies(replies: &[Option<String>]) -> String {
    json!({ "replies": replies }).to_string()
}

/// Parses [`encode_replies`] for a batch of `n` calls.
pub fn decode_replies(body: &str, n: usize) -> Option<Vec<Option<String>>> {
    let v: Value = serde_json::from_str(body).ok()?;
    let mut replies = Vec::with_capacity(n);
    for r in v.get("replies")?.as_array()? {
        replies.push(match r {
            Value::Null => None,
            Value::String(s) => Some(s.clone()),
            _ => return None,
        });
    }
    (replies.len() == n).then_some(replies)
}

/// The Durable Object that holds the sync store's [`ratewall_core::sync::Registry`]: the
/// nodes heard from (the `nodes` every answer reports) and each node's latest batch `seq`.
pub const REGISTRY_OBJECT: &str = "n:registry";

/// A call from the Worker to a counter's Durable Object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    /// Decide a request of `cost` units; consume them when allowed.
    Take { limit: Limit, cost: u64 },
    /// Give back `cost` units taken at `at` (the object's clock, from [`Taken::now`]).
    Refund { limit: Limit, cost: u64, at: Nanos },
    /// Add a filter node's delta (`POST /v1/sync`).
    Apply { limit: Limit, node: u64, seq: u64, units: u64 },
    /// Answer a filter node's ask (number `ask`) for `units` now (`POST /v1/sync`, an ask).
    Ask { limit: Limit, node: u64, ask: u64, units: u64 },
    /// To the registry object: a node's batch `seq` (or an ask) was heard.
    Heard { node: u64, seq: u64, ask: bool, sent: Nanos },
    /// To the registry object: a node's batch `seq` was answered with counters it could not
    /// apply; a repeat of it is refused ([`ratewall_core::sync::Registry::close`]).
    Close { node: u64, seq: u64 },
    /// An isolate's own traffic ([`grants`]): the `units` it admitted from its grant since
    /// its last report, as its batch `seq` (0: no report), then, when the grant that report
    /// brings does not cover it, its ask number `ask` for `cost` units for the request that
    /// waits (0: no request). `at`: when the first of the units was admitted (the isolate's
    /// clock; 0: not known): the object counts them as of then, as the isolate's copy of the
    /// counter did (a token bucket counted later is behind the `Retry-After` the isolate gave),
    /// and a fixed window's units of a window that has ended in none. `refund`: units of the
    /// isolate's earlier reports to give back (another rule rejected their requests), counted
    /// from `refund_at`; given back once, with the report (a repeat of it gives nothing).
    /// `idle`: the isolate has stopped seeing requests on the counter and gives its grant
    /// back (the report, once counted, brings none, and its traffic stops weighing in the
    /// others' shares). Answered with [`grants::Spent`].
    Spend {
        limit: Limit,
        node: u64,
        seq: u64,
        units: u64,
        ask: u64,
        cost: u64,
        at: Nanos,
        refund: u64,
        refund_at: Nanos,
        idle: bool,
    },
}

/// A counter object's stored value: the counter's encoding in hex, then `/` and the limit it
/// was written under (so an alarm after a restart can judge it idle without a call).
pub fn stored_value(counter: &ratewall_core::sync::Counter) -> String {
    format!("{}/{}", hex(&counter.encode()), limit_json(&counter.limit))
}

/// Parses [`stored_value`] (or a value of the older form, the hex alone, under `limit`).
pub fn parse_stored(value: &str, limit: Option<Limit>) -> Result<ratewall_core::sync::Counter, String> {
    let (counter, stored_limit) = match value.split_once('/') {
        Some((c, l)) => {
            let l =
                serde_json::from_str(l).ok().and_then(|v: Value| limit_from(&v)).ok_or("its limit is unreadable")?;
            (c, l)
        }
        None => (value, limit.ok_or("it names no limit")?),
    };
    let bytes = unhex(counter.as_bytes()).ok_or("it is not hex")?;
    ratewall_core::sync::Counter::decode(limit.unwrap_or(stored_limit), &bytes).map_err(|e| e.to_string())
}

fn limit_json(l: &Limit) -> Value {
    if l.delay() > 0 {
        return json!([l.algorithm().as_str(), l.requests(), l.per(), l.capacity(), l.delay()]);
    }
    json!([l.algorithm().as_str(), l.requests(), l.per(), l.capacity()])
}

fn limit_from(v: &Value) -> Option<Limit> {
    let a = v.as_array()?;
    let algorithm = Algorithm::from_name(a.first()?.as_str()?)?;
    let (requests, per, capacity) = (a.get(1)?.as_u64()?, a.get(2)?.as_u64()?, a.get(3)?.as_u64()?);
    let delay = a.get(4).map_or(Some(0), Value::as_u64)?;
    Limit::from_capacity(algorithm, requests, per, capacity).ok()?.with_delay(delay).ok()
}

fn u64_field(v: &Value, name: &str) -> Option<u64> {
    v.get(name)?.as_u64()
}

impl Call {
    /// The message body (JSON).
    pub fn encode(&self) -> String {
        self.value().to_string()
    }

    /// The message as JSON.
    fn value(&self) -> Value {
        match self {
            Call::Take { limit, cost } => json!({"op": "take", "limit": limit_json(limit), "cost": cost}),
            Call::Refund { limit, cost, at } => {
                json!({"op": "refund", "limit": limit_json(limit), "cost": cost, "at": at})
            }
            Call::Apply { limit, node, seq, units } => {
                json!({"op": "apply", "limit": limit_json(limit), "node": node, "seq": seq, "units": units})
            }
            Call::Ask { limit, node, ask, units } => {
                json!({"op": "ask", "limit": limit_json(limit), "node": node, "ask": ask, "units": units})
            }
            Call::Heard { node, seq, ask, sent } => {
                json!({"op": "heard", "node": node, "seq": seq, "ask": ask, "sent": sent})
            }
            Call::Close { node, seq } => json!({"op": "close", "node": node, "seq": seq}),
            Call::Spend { limit, node, seq, units, ask, cost, at, refund, refund_at, idle } => json!({"op": "spend",
                "limit": limit_json(limit), "node": node, "seq": seq, "units": units, "ask": ask, "cost": cost, "at": at,
                "refund": refund, "refund_at": refund_at, "idle": idle}),
        }
    }

    /// The limit a counter call applies (`None` for the registry's).
    pub fn limit(&self) -> Option<Limit> {
        match self {
            Call::Take { limit, .. }
            | Call::Refund { limit, .. }
            | Call::Apply { limit, .. }
            | Call::Ask { limit, .. }
            | Call::Spend { limit, .. } => Some(*limit),
            Call::Heard { .. } | Call::Close { .. } => None,
        }
    }

    /// Parses a message body; `None` when it is not a valid call.
    pub fn decode(body: &str) -> Option<Call> {
        Call::from_value(&serde_json::from_str(body).ok()?)
    }

    fn from_value(v: &Value) -> Option<Call> {
        if v.get("op")?.as_str()? == "heard" {
            let (node, seq) = (u64_field(v, "node")?, u64_field(v, "seq")?);
            // `sent` absent (a Worker of a version before it): the ask is not checked.
            let sent = v.get("sent").map_or(Some(0), Value::as_u64)?;
            return Some(Call::Heard { node, seq, ask: v.get("ask")?.as_bool()?, sent });
        }
        if v.get("op")?.as_str()? == "close" {
            return Some(Call::Close { node: u64_field(v, "node")?, seq: u64_field(v, "seq")? });
        }
        let limit = limit_from(v.get("limit")?)?;
        match v.get("op")?.as_str()? {
            "take" => Some(Call::Take { limit, cost: u64_field(v, "cost")? }),
            "refund" => Some(Call::Refund { limit, cost: u64_field(v, "cost")?, at: u64_field(v, "at")? }),
            "apply" => Some(Call::Apply {
                limit,
                node: u64_field(v, "node")?,
                seq: u64_field(v, "seq")?,
                units: u64_field(v, "units")?,
            }),
            "ask" => Some(Call::Ask {
                limit,
                node: u64_field(v, "node")?,
                ask: u64_field(v, "ask")?,
                units: u64_field(v, "units")?,
            }),
            "spend" => Some(Call::Spend {
                limit,
                node: u64_field(v, "node")?,
                seq: u64_field(v, "seq")?,
                units: u64_field(v, "units")?,
                ask: u64_field(v, "ask")?,
                cost: u64_field(v, "cost")?,
                // Absent from an isolate of a version before it: counted as they come.
                at: v.get("at").map_or(Some(0), Value::as_u64)?,
                // Absent from an isolate of a version before it: nothing to give back.
                refund: v.get("refund").map_or(Some(0), Value::as_u64)?,
                refund_at: v.get("refund_at").map_or(Some(0), Value::as_u64)?,
                // Absent from an isolate of a version before it: it keeps its grant.
                idle: v.get("idle").map_or(Some(false), Value::as_bool)?,
            }),
            _ => None,
        }
    }
}

/// A counter object's answer to [`Call::Take`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Taken {
    /// The decision.
    pub decision: Decision,
    /// The object's clock when it decided.
    pub now: Nanos,
}

impl Taken {
    /// The reply body (JSON).
    pub fn encode(&self) -> String {
        let d = &self.decision;
        json!({"allowed": d.allowed, "limit": d.limit, "remaining": d.remaining, "reset_after": d.reset_after,
               "retry_after": d.retry_after, "now": self.now})
        .to_string()
    }

    /// Parses a reply body.
    pub fn decode(body: &str) -> Option<Taken> {
        let v: Value = serde_json::from_str(body).ok()?;
        let decision = Decision {
            allowed: v.get("allowed")?.as_bool()?,
            limit: u64_field(&v, "limit")?,
            remaining: u64_field(&v, "remaining")?,
            reset_after: u64_field(&v, "reset_after")?,
            retry_after: v.get("retry_after").and_then(Value::as_u64),
        };
        Some(Taken { decision, now: u64_field(&v, "now")? })
    }
}

/// The registry's answer to [`Call::Heard`]: the nodes heard from, the node's latest `seq`
/// when the batch is older than it, or the number of an ask already answered.
pub fn encode_heard(r: Result<u32, ratewall_core::sync::SyncError>) -> String {
    match r {
        Ok(nodes) => json!({"nodes": nodes}),
        Err(ratewall_core::sync::SyncError::Stale { last }) => json!({"stale": last}),
        Err(ratewall_core::sync::SyncError::Repeated { ask }) => json!({"repeated": ask}),
        Err(_) => json!({}),
    }
    .to_string()
}

/// Parses [`encode_heard`]: `Ok(nodes)`, or the refusal ([`SyncError::Stale`] for an older
/// batch, [`SyncError::Repeated`] for an ask already answered).
///
/// [`SyncError::Stale`]: ratewall_core::sync::SyncError::Stale
/// [`SyncError::Repeated`]: ratewall_core::sync::SyncError::Repeated
pub fn decode_heard(body: &str) -> Option<Result<u32, ratewall_core::sync::SyncError>> {
    use ratewall_core::sync::SyncError;
    let v: Value = serde_json::from_str(body).ok()?;
    match (u64_field(&v, "nodes"), u64_field(&v, "stale"), u64_field(&v, "repeated")) {
        (Some(n), _, _) => Some(Ok(u32::try_from(n).unwrap_or(u32::MAX))),
        (None, Some(last), _) => Some(Err(SyncError::Stale { last })),
        (None, None, Some(ask)) => Some(Err(SyncError::Repeated { ask })),
        _ => None,
    }
}

/// Encodes a counter object's answer to [`Call::Apply`].
/// `out_for`: how long the counter is out of quota after the call
/// ([`ratewall_core::sync::Counter::out_for`]).
pub fn encode_applied(a: &Applied, out_for: Option<Nanos>) -> String {
    json!({"remaining": a.remaining, "grant": a.grant, "reset_after": a.reset_after, "lease": a.lease,
           "nodes": a.nodes, "counted": a.counted, "out_for": out_for})
    .to_string()
}

/// The `out_for` of an [`encode_applied`] answer (`None`: not out, or an object of an older
/// version).
pub fn decode_out_for(body: &str) -> Option<Nanos> {
    let v: Value = serde_json::from_str(body).ok()?;
    u64_field(&v, "out_for")
}

/// Parses [`encode_applied`].
pub fn decode_applied(body: &str) -> Option<Applied> {
    let v: Value = serde_json::from_str(body).ok()?;
    Some(Applied {
        remaining: u64_field(&v, "remaining")?,
        grant: u64_field(&v, "grant")?,
        reset_after: u64_field(&v, "reset_after")?,
        lease: u64_field(&v, "lease")?,
        nodes: u32::try_from(u64_field(&v, "nodes")?).ok()?,
        counted: v.get("counted")?.as_bool()?,
    })
}

#[derive(Clone, Copy, Debug)]
struct Blocked {
    at: Nanos,
    until: Nanos,
    cost: u64,
    decision: Decision,
}

/// Makes room for `key` in a map bounded to `cap` entries: when it is full and lacks `key`,
/// entries that are no longer `live` go, and if none could, all of them.
fn make_room<V>(map: &mut HashMap<Vec<u8>, V>, key: &[u8], cap: usize, live: impl Fn(&V) -> bool) {
    if map.len() >= cap && !map.contains_key(key) {
        map.retain(|_, v| live(v));
        if map.len() >= cap {
            map.clear();
        }
    }
}

/// "Blocked until" per counter, in isolate memory: a client over its limit is answered from
/// here until its retry time, at no Durable Object call.
///
/// Accuracy: a denied request consumes nothing, so skipping the object loses no count. What
/// the cache can do is keep denying until the retry time a client whose quota came back
/// early — by a refund, or a rules change that raised its limit. It never admits more.
pub struct BlockedCache {
    entries: HashMap<Vec<u8>, Blocked>,
    cap: usize,
}

impl BlockedCache {
    /// A cache holding at most `cap` blocked counters.
    pub fn new(cap: usize) -> BlockedCache {
        BlockedCache { entries: HashMap::new(), cap: cap.max(1) }
    }

    /// The cached denial of a request of `cost` units on `key` at `now`, if still blocked.
    pub fn get(&mut self, key: &[u8], now: Nanos, cost: u64) -> Option<Decision> {
        let b = *self.entries.get(key)?;
        if now >= b.until {
            self.entries.remove(key);
            return None;
        }
        // A cheaper request than the one denied may fit earlier: ask the object.
        if cost < b.cost {
            return None;
        }
        let waited = now.saturating_sub(b.at);
        Some(Decision {
            retry_after: Some(b.until - now),
            reset_after: b.decision.reset_after.saturating_sub(waited),
            ..b.decision
        })
    }

    /// Remembers a denial of `cost` units on `key` decided at `now`.
    pub fn insert(&mut self, key: &[u8], now: Nanos, cost: u64, decision: Decision) {
        let Some(retry) = decision.retry_after.filter(|_| !decision.allowed) else {
            return;
        };
        // Full of live entries, the cache starts over: forgetting them only costs object calls.
        make_room(&mut self.entries, key, self.cap, |b| b.until > now);
        self.entries.insert(key.to_vec(), Blocked { at: now, until: now.saturating_add(retry), cost, decision });
    }

    /// Forgets `key`'s denial: units went back to its counter from this isolate.
    pub fn forget(&mut self, key: &[u8]) {
        self.entries.remove(key);
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Counters in isolate memory for `open` rules while their Durable Object is unreachable:
/// each isolate enforces the rule's limit on its own, so the edge as a whole admits more than
/// the limit (up to limit × isolates serving the client) until the object is back.
pub struct LocalFallback {
    states: HashMap<Vec<u8>, (Limit, State)>,
    cap: usize,
}

impl LocalFallback {
    /// A fallback holding at most `cap` counters.
    pub fn new(cap: usize) -> LocalFallback {
        LocalFallback { states: HashMap::new(), cap: cap.max(1) }
    }

    /// Decides `check` locally at `now`.
    pub fn take(&mut self, check: &Check, now: Nanos) -> Decision {
        // Each entry is judged idle by its own limit (entries of several rules share the map).
        make_room(&mut self.states, &check.key, self.cap, |(limit, s)| limit.idle_at(s) > now);
        let (limit, state) = self.states.entry(check.key.clone()).or_insert_with(|| (check.limit, State::Fresh));
        *limit = check.limit;
        let (d, next) = check.limit.decide(state, now, check.cost);
        // A denial returns the state as it was, or moved back after a clock step.
        *state = next;
        d
    }

    /// Gives back what `check` took at `at` (a slot of a request in flight that completed, or
    /// units of a request another rule rejected).
    pub fn refund(&mut self, check: &Check, at: Nanos) {
        if let Some((limit, state)) = self.states.get_mut(&check.key) {
            *state = limit.refund(state, at, check.cost);
        }
    }
}

/// The checks of `among` that the isolate's [`LocalFallback`] decided: their object failed
/// (nothing charged there) and the rule is `open` (a decision came all the same).
pub fn decided_locally<'a>(
    checks: &'a [Check],
    among: &'a [usize],
    decisions: &'a [Result<Decision, StoreError>],
    charged: &'a [Option<Answer>],
) -> impl Iterator<Item = &'a Check> + 'a {
    among.iter().filter_map(move |&i| match (decisions.get(i), charged.get(i)) {
        (Some(Ok(_)), Some(None)) => checks.get(i),
        _ => None,
    })
}

/// Per-rule counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleCounts {
    /// Checks that allowed.
    pub allowed: u64,
    /// Checks that denied (enforcing rules): every denial a client was sent, the cached ones
    /// included.
    pub rejected: u64,
    /// Checks of shadow rules that would have denied.
    pub shadow_rejected: u64,
    /// Requests the rule matched but could not key.
    pub unkeyed: u64,
    /// Checks whose Durable Object failed (the failure policy applied).
    pub store_failed: u64,
    /// Of the denials, those answered from the blocked-key cache.
    pub cached_denials: u64,
    /// Leaky-bucket rules: requests that waited their turn, and rejections by a full queue.
    pub delayed: u64,
    pub queue_full: u64,
    /// Concurrency rules: requests of the last key checked in flight at its object (a gauge).
    pub in_flight: u64,
}

/// A per-rule metric family: its name's tail, its help, its type and its value.
type Family = (&'static str, &'static str, &'static str, fn(&RuleCounts) -> u64);

/// The isolate's counters, rendered in the Prometheus text format at `/_ratewall/metrics`.
#[derive(Default)]
pub struct Metrics {
    /// Per rule name.
    pub rules: HashMap<String, RuleCounts>,
    /// Calls made to counter objects.
    pub object_calls: u64,
    /// Of which failed or timed out.
    pub object_failures: u64,
    /// Rules documents loaded.
    pub rules_loaded: u64,
    /// Rules documents rejected (the previous rules stayed).
    pub rules_rejected: u64,
    /// Requests passed without limits because a rules document was rejected and none was ever
    /// loaded (the filter's metric of that name).
    pub config_rejected: u64,
    /// `/v1/sync` batches applied.
    pub sync_ok: u64,
    /// `/v1/sync` batches refused (authentication, format) or failed.
    pub sync_failed: u64,
    /// Of which refused for their time: made further than `MAX_REQUEST_SKEW` from this
    /// isolate's clock (422: a node's clock is off, or a replay).
    pub sync_refused_stale: u64,
    /// Checks admitted from the isolate's grants, with no object call.
    pub grant_admissions: u64,
    /// Checks admitted past the isolate's grant: on its share, its copy or its overdraft, or
    /// on a counter new to it before the object's first answer.
    pub overdraft_admissions: u64,
    /// Checks denied in isolate memory while its copy of the counter had room (grant, share
    /// and overdraft spent until the next answer).
    pub short_denials: u64,
    /// Units admitted from grants whose report was given up.
    pub units_dropped: u64,
    /// Reports of who is being limited sent to the admin object, and of which failed.
    pub top_reports: u64,
    pub top_reports_failed: u64,
    /// Reports given up after their calls kept failing (their counts are not in
    /// /_ratewall/top).
    pub top_reports_dropped: u64,
    /// Requests whose client went away while they waited their leaky-bucket turn (every
    /// unit they took went back; they were not forwarded).
    pub queue_abandoned: u64,
}

impl Metrics {
    /// Counts a request's outcome per rule (`cached`: its denials came from the
    /// [`BlockedCache`]; they count as the rule's denials, and as its cached ones).
    pub fn count(&mut self, config: &Config, outcome: &Outcome, skipped: &[(usize, Skip)], cached: bool) {
        for c in &outcome.checks {
            let (Some(r), CheckResult::Decided(d)) = (config.rules.get(c.rule), c.result) else { continue };
            let m = self.rule(&r.name);
            match c.limit.algorithm() {
                Algorithm::LeakyBucket if !d.allowed => m.queue_full += 1,
                Algorithm::LeakyBucket if !outcome.rejected && c.limit.wait(&d, r.cost) > 0 => m.delayed += 1,
                Algorithm::Concurrent => m.in_flight = c.limit.requests().saturating_sub(d.remaining),
                _ => {}
            }
        }
        for (rule, tally) in outcome.tally(skipped) {
            let Some(r) = config.rules.get(rule) else { continue };
            let m = self.rule(&r.name);
            match tally {
                Tally::Allowed => m.allowed += 1,
                Tally::Rejected => {
                    m.rejected += 1;
                    m.cached_denials += u64::from(cached);
                }
                Tally::ShadowRejected => m.shadow_rejected += 1,
                Tally::Unkeyed => m.unkeyed += 1,
                Tally::Failed(_) => m.store_failed += 1,
            }
        }
    }

    /// The counts for one rule.
    pub fn rule(&mut self, name: &str) -> &mut RuleCounts {
        self.rules.entry(name.to_owned()).or_default()
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut names: Vec<&String> = self.rules.keys().collect();
        names.sort();
        // One family at a time, each with its HELP and TYPE (the text format wants a family's
        // samples together).
        const C: &str = "counter";
        let per_rule: [Family; 9] = [
            ("allowed", "Checks that allowed, per rule.", C, |c| c.allowed),
            (
                "rejected",
                "Checks of enforcing rules that denied (every denial sent, cached ones included), per rule.",
                C,
                |c| c.rejected,
            ),
            ("shadow_rejected", "Checks of shadow rules that would have denied, per rule.", C, |c| c.shadow_rejected),
            ("unkeyed", "Requests a rule matched but could not key, per rule.", C, |c| c.unkeyed),
            ("store_failed", "Checks whose counter object failed (the failure policy applied), per rule.", C, |c| {
                c.store_failed
            }),
            (
                "cached_denials",
                "Of the rejected checks, those answered from the isolate's blocked-key cache, per rule.",
                C,
                |c| c.cached_denials,
            ),
            ("delayed", "Requests a leaky-bucket rule queued for their turn, per rule.", C, |c| c.delayed),
            ("queue_full", "Requests a leaky-bucket rule rejected with its queue full, per rule.", C, |c| c.queue_full),
            ("in_flight", "Requests in flight of the key a concurrency rule last checked, per rule.", "gauge", |c| {
                c.in_flight
            }),
        ];
        for (what, help, kind, value) in per_rule {
            let _ = writeln!(out, "# HELP ratewall_rule_{what} {help}\n# TYPE ratewall_rule_{what} {kind}");
            for name in &names {
                if let Some(c) = self.rules.get(*name) {
                    let _ = writeln!(out, "ratewall_rule_{what}{{rule=\"{name}\"}} {}", value(c));
                }
            }
        }
        for (what, help, v) in [
            ("object_calls", "Calls from this isolate to counter objects.", self.object_calls),
            ("object_failures", "Calls to counter objects that failed or timed out.", self.object_failures),
            ("rules_loaded", "Rules documents loaded.", self.rules_loaded),
            ("rules_rejected", "Rules documents rejected (the previous rules stayed).", self.rules_rejected),
            (
                "config_rejected",
                "Requests passed without limits: a rules document was rejected and no good one was ever loaded.",
                self.config_rejected,
            ),
            ("sync_ok", "POST /v1/sync calls answered.", self.sync_ok),
            ("sync_failed", "POST /v1/sync calls refused or failed.", self.sync_failed),
            (
                "sync_refused_stale",
                "POST /v1/sync calls refused (422) for a time too far from the store's clock.",
                self.sync_refused_stale,
            ),
            (
                "grant_admissions",
                "Checks admitted from the isolate's grants, with no object call.",
                self.grant_admissions,
            ),
            (
                "overdraft_admissions",
                "Checks admitted past the isolate's grant (its share, its copy, its overdraft, or a counter new to it before the first answer), with no object call.",
                self.overdraft_admissions,
            ),
            (
                "short_denials",
                "Checks denied by the isolate while its copy of the counter had room (grant, share and overdraft spent).",
                self.short_denials,
            ),
            ("units_dropped", "Units admitted from grants whose report was given up.", self.units_dropped),
            ("top_reports", "Reports of the top denied keys sent to the admin object.", self.top_reports),
            (
                "top_reports_failed",
                "Reports of the top denied keys whose call failed (each is sent again, first, with the next report, for 60 s).",
                self.top_reports_failed,
            ),
            (
                "top_reports_dropped",
                "Reports of the top denied keys given up after their calls failed for 60 s (their counts are not in /_ratewall/top).",
                self.top_reports_dropped,
            ),
            (
                "queue_abandoned",
                "Requests whose client went away while they waited their leaky-bucket turn (their turn and units went back).",
                self.queue_abandoned,
            ),
        ] {
            let _ = writeln!(out, "# HELP ratewall_{what} {help}\n# TYPE ratewall_{what} counter\nratewall_{what} {v}");
        }
        out
    }
}

/// Denials still cached for the enforcing checks of a request (an outcome that rejects, or
/// an empty one: ask the objects).
pub fn cached_denials(config: &Config, checks: &[Check], t: Nanos, cache: &mut BlockedCache) -> Outcome {
    let mut out = Outcome::default();
    for c in checks {
        let Some(rule) = config.rules.get(c.rule).filter(|r| r.mode == Mode::Enforce) else { continue };
        if let Some(d) = cache.get(&c.key, t, c.cost) {
            out.checks.push(CheckOutcome {
                rule: c.rule,
                mode: rule.mode,
                limit: c.limit,
                result: CheckResult::Decided(d),
            });
            out.rejected = true;
        }
    }
    out
}

/// How long an admitted request waits before it is forwarded: its leaky-bucket rules' turn
/// (the longest of them; enforcing rules only).
pub fn wait_of(config: &Config, checks: &[Check], decisions: &[Result<Decision, StoreError>]) -> Nanos {
    checks
        .iter()
        .zip(decisions)
        .filter(|(c, _)| config.rules.get(c.rule).is_some_and(|r| r.mode == Mode::Enforce))
        .filter_map(|(c, d)| d.as_ref().ok().map(|d| c.limit.wait(d, c.cost)))
        .max()
        .unwrap_or(0)
}

/// The checks of concurrency rules (whose slots an admitted request gives back when it
/// ends), by index.
pub fn in_flight(checks: &[Check]) -> Vec<usize> {
    checks.iter().enumerate().filter(|(_, c)| c.limit.algorithm() == Algorithm::Concurrent).map(|(i, _)| i).collect()
}

/// A [`Call::Take`]'s answer (`Err`: the call failed; a garbled answer is a failure too).
pub fn take_answer(reply: Result<String, StoreError>) -> Result<Answer, StoreError> {
    reply.and_then(|body| Taken::decode(&body).map(Answer::Object).ok_or(StoreError::Unavailable))
}

/// A request's decisions from its checks' answers (`Err`: the object failed), in check
/// order, with how each was charged (for refunds). An `open` rule whose object failed is
/// decided by the isolate's [`LocalFallback`] (and counted as a store failure); a `closed`
/// one stays failed.
pub fn decisions(
    config: &Config,
    checks: &[Check],
    answers: Vec<Result<Answer, StoreError>>,
    t: Nanos,
    fallback: &mut LocalFallback,
    metrics: &mut Metrics,
) -> (Vec<Result<Decision, StoreError>>, Vec<Option<Answer>>) {
    let mut charged = Vec::with_capacity(checks.len());
    let mut out = Vec::with_capacity(checks.len());
    for (c, answer) in checks.iter().zip(answers) {
        let rule = config.rules.get(c.rule);
        match answer {
            Ok(a) => {
                charged.push(Some(a));
                out.push(Ok(a.decision()));
            }
            Err(e) => {
                charged.push(None);
                if rule.is_some_and(|r| r.on_store_failure == FailurePolicy::Open) {
                    metrics.rule(rule.map_or("", |r| r.name.as_str())).store_failed += 1;
                    out.push(Ok(fallback.take(c, t)));
                } else {
                    out.push(Err(e));
                }
            }
        }
    }
    (out, charged)
}

/// The log lines of a request's shadow rules that would have rejected it, as the filter
/// writes them (the path without its query).
pub fn shadow_lines(
    config: &Config,
    outcome: &Outcome,
    skipped: &[(usize, Skip)],
    method: &str,
    path: &str,
) -> Vec<String> {
    outcome
        .tally(skipped)
        .filter(|(_, t)| *t == Tally::ShadowRejected)
        .filter_map(|(rule, _)| config.rules.get(rule))
        .map(|r| format!("ratewall: shadow rule \"{}\" would reject {method} {path}", r.name))
        .collect()
}

/// Whether an origin's answer of `status` can be passed on to the client: a final status the
/// runtime can build a response with (200 to 599), or 101 to a request that asked to upgrade
/// (`upgrade`: it had an `Upgrade` header; the runtime's `fetch` then gives the WebSocket with
/// the 101). An interim status (`100 Continue`, which an origin sends for a request with
/// `Expect: 100-continue`), a 101 nobody asked for (the runtime refuses to build a response
/// with it, and the isolate started over), or one out of range, is answered with the Worker's
/// own 502.
pub fn passable_status(status: u16, upgrade: bool) -> bool {
    (status == 101 && upgrade) || (200..=599).contains(&status)
}

/// Whether a client's request header goes on to an `ORIGIN_URL` origin: all but `Expect`. The
/// Worker sends the origin the whole body it has, so it asks no leave to: forwarded, a
/// client's `Expect: 100-continue` (curl's for a body over 1 MB) had the origin answer
/// `100 Continue`, which the runtime's `fetch` gives as the final answer.
pub fn forwarded_header(name: &str) -> bool {
    !name.eq_ignore_ascii_case("expect")
}

/// Units to give back to the isolate's grant of a counter: (key, cost).
pub type GrantRefund = (Vec<u8>, u64);

/// The refunds a request owes (`refunds`: from [`ratewall_core::combine`]): units taken by
/// rules that allowed a request another rule rejected go back — to their objects, named
/// with the object's clock of the take, or to the isolate's grant (key, cost). A check whose
/// call failed owes nothing.
pub fn refund_calls(
    checks: &[Check],
    refunds: &[usize],
    charged: &[Option<Answer>],
) -> (Vec<(Vec<u8>, Call)>, Vec<GrantRefund>) {
    let (mut calls, mut grants) = (Vec::new(), Vec::new());
    for &i in refunds {
        let (Some(c), Some(Some(a))) = (checks.get(i), charged.get(i)) else { continue };
        match a {
            Answer::Object(t) => calls.push((c.key.clone(), Call::Refund { limit: c.limit, cost: c.cost, at: t.now })),
            Answer::Grant(_) => grants.push((c.key.clone(), c.cost)),
            Answer::Short(_) => {}
        }
    }
    (calls, grants)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratewall_core::rules::HashKeySource;
    use ratewall_core::SECOND;

    const RULES: &str = r#"{
      "identity": {"user": {"header": "x-user-id"}, "ip": {"trusted_hops": 1, "ipv6_prefix": 64}},
      "rules": [
        {"name": "per-user", "key": ["user"], "limit": {"requests": 2, "per": "60s"}},
        {"name": "per-ip", "match": {"path": "/login"}, "key": ["ip"], "limit": {"requests": 2, "per": "60s"}}
      ]}"#;

    /// An origin's interim or out-of-range status is not passed on (the runtime cannot
    /// build a response with it: workers-rs panicked, and the isolate started over).
    #[test]
    fn a_clients_expect_is_not_forwarded_to_the_origin() {
        assert!(!forwarded_header("Expect") && !forwarded_header("expect"));
        assert!(forwarded_header("content-length") && forwarded_header("x-user-id"));
    }

    #[test]
    fn only_a_final_status_or_a_websockets_upgrade_is_passed_on() {
        for status in [200, 204, 302, 404, 429, 503, 599] {
            assert!(passable_status(status, false) && passable_status(status, true), "{status}");
        }
        assert!(passable_status(101, true), "the answer to an upgrade");
        assert!(!passable_status(101, false), "a 101 nobody asked for");
        for status in [0, 100, 102, 103, 199, 600, 999] {
            assert!(!passable_status(status, true), "{status}");
        }
    }

    #[test]
    fn a_shadow_rule_that_would_reject_is_logged_as_the_filter_logs_it() {
        let doc = r#"{"identity": {"user": {"header": "x-user-id"}},
          "rules": [{"name": "watch", "key": ["user"], "mode": "shadow", "limit": {"requests": 1, "per": "60s"}}]}"#;
        let config = Config::parse(doc.as_bytes()).unwrap();
        let (checks, skipped) = checks_for(&config, "GET", "/a", &|h| (h == "x-user-id").then(|| "ann".to_owned()));
        let mut fallback = LocalFallback::new(10);
        let lines = |fallback: &mut LocalFallback| {
            let d = checks.iter().map(|c| Ok(fallback.take(c, SECOND))).collect::<Vec<_>>();
            let (outcome, _) = ratewall_core::eval::combine(&config, &checks, &d);
            assert!(!outcome.rejected, "a shadow rule never rejects");
            shadow_lines(&config, &outcome, &skipped, "GET", "/a")
        };
        assert!(lines(&mut fallback).is_empty());
        assert_eq!(lines(&mut fallback), ["ratewall: shadow rule \"watch\" would reject GET /a"]);
    }

    #[test]
    fn offered_rules_are_counted_and_each_rejection_reported_once() {
        let (mut r, mut m) = (Rules::default(), Metrics::default());
        let bad = r#"{"rules":[{"name":"x","key":["nobody"],"limit":{"requests":1,"per":"1s"}}]}"#;
        assert!(!r.rejected_without_rules(), "nothing offered yet");
        let Offered::Rejected(msg) = r.offer(bad.as_bytes(), "KV", &mut m) else { panic!() };
        assert!(msg.contains("rules[0].key") && msg.ends_with("no rules"), "{msg}");
        assert!(r.rejected_without_rules());
        assert_eq!(r.offer(bad.as_bytes(), "KV", &mut m), Offered::Unchanged, "reported once");
        assert!(matches!(r.offer(RULES.as_bytes(), "var", &mut m), Offered::Loaded(_)));
        assert!(!r.rejected_without_rules());
        assert_eq!(r.offer(RULES.as_bytes(), "var", &mut m), Offered::Unchanged);
        let Offered::Rejected(msg) = r.offer(bad.as_bytes(), "KV", &mut m) else {
            panic!("reported again after a good one")
        };
        assert!(msg.ends_with("the previous rules stay in force"), "{msg}");
        assert_eq!((m.rules_loaded, m.rules_rejected), (1, 2));
        assert_eq!(r.current().map(|c| c.rules.len()), Some(2));
    }

    /// A document that is not UTF-8 is refused as `ratewall check` and the filter refuse it,
    /// not read with its bad bytes made U+FFFD.
    #[test]
    fn a_document_that_is_not_utf8_is_refused_where_its_bytes_are() {
        let mut r = Rules::default();
        let mut doc = RULES.replacen('{', r#"{"$schema": "x","#, 1).into_bytes();
        let at = doc.iter().position(|b| *b == b'x').unwrap();
        doc[at] = 0xff;
        let err = r.load(&doc).unwrap_err();
        assert_eq!(err.to_string(), Config::parse(&doc).unwrap_err().to_string());
        assert!(err.to_string().contains("invalid UTF-8"), "{err}");
        assert!(r.current().is_none());
    }

    #[test]
    fn secret_values_hash_under_the_deployments_secret_unless_the_document_sets_a_key() {
        let mut builtin = Rules::default();
        builtin.load(RULES.as_bytes()).unwrap();
        let mut keyed = Rules::keyed_by("the sync secret of this deployment");
        keyed.load(RULES.as_bytes()).unwrap();
        let (b, k) = (builtin.current().unwrap(), keyed.current().unwrap());
        assert_eq!(b.identity.hash_key_source, HashKeySource::BuiltIn);
        assert_eq!(k.identity.hash_key_source, HashKeySource::SyncSecret);
        assert_ne!(k.identity.hash_key.hash(b"sk_live_1"), b.identity.hash_key.hash(b"sk_live_1"));
        // As a filter node syncing with the same secret derives it.
        let with_sync =
            RULES.replacen('{', r#"{"sync": {"cluster": "store", "secret": "the sync secret of this deployment"},"#, 1);
        let node = Config::parse(with_sync.as_bytes()).unwrap();
        assert_eq!(k.identity.hash_key.hash(b"sk_live_1"), node.identity.hash_key.hash(b"sk_live_1"));
        // A key the document sets wins.
        let doc = RULES.replacen(r#""identity": {"#, r#""identity": {"hash_key": "a key the operator chose","#, 1);
        let mut own = Rules::keyed_by("the sync secret of this deployment");
        own.load(doc.as_bytes()).unwrap();
        assert_eq!(own.current().unwrap().identity.hash_key_source, HashKeySource::HashKey);
    }

    #[test]
    fn a_bad_document_keeps_the_rules_in_force() {
        let mut r = Rules::default();
        assert_eq!(r.load(RULES.as_bytes()), Ok(true));
        assert_eq!(r.load(RULES.as_bytes()), Ok(false), "the same text is not parsed again");
        let err = r.load(r#"{"rules":[{"name":"x","key":["user"],"limit":{"requests":0,"per":"1s"}}]}"#.as_bytes());
        assert!(err.is_err());
        assert_eq!(r.current().map(|c| c.rules.len()), Some(2));
    }

    #[test]
    fn the_client_ip_is_cf_connecting_ip_and_ipv6_is_keyed_by_prefix() {
        let mut r = Rules::default();
        r.load(RULES.as_bytes()).unwrap();
        let c = r.current().unwrap();
        let key_of = |cf: Option<&str>, xff: Option<&str>| {
            let (checks, skipped) = checks_for(&c, "GET", "/login", &|h: &str| match h {
                "cf-connecting-ip" => cf.map(str::to_owned),
                "x-forwarded-for" => xff.map(str::to_owned),
                _ => None,
            });
            assert!(skipped.contains(&(0, Skip::Unkeyed)), "no user header: per-user does not count it");
            checks.first().map(|c| c.key.clone())
        };
        let a = key_of(Some("2001:db8:1:2:3:4:5:6"), Some("9.9.9.9"));
        let b = key_of(Some("2001:db8:1:2:ffff::1"), None);
        assert!(a.is_some());
        assert_eq!(a, b, "one /64, one key; a client's XFF does not override CF-Connecting-IP");
        assert_ne!(a, key_of(Some("2001:db8:1:3::1"), None));
        assert_eq!(key_of(None, None), None, "no IP at all: the rule does not count it");
    }

    #[test]
    fn calls_and_replies_round_trip() {
        let limit = Limit::new(Algorithm::TokenBucket, 10, 60 * SECOND, Some(3)).unwrap();
        for call in [
            Call::Take { limit, cost: 2 },
            Call::Refund { limit, cost: 2, at: u64::MAX - 1 },
            Call::Apply { limit, node: 1 << 60, seq: 9, units: 4 },
            Call::Ask { limit, node: 1 << 60, ask: 7, units: 1 },
            Call::Spend {
                limit,
                node: 3,
                seq: 4,
                units: 5,
                ask: 6,
                cost: 7,
                at: 8,
                refund: 9,
                refund_at: 10,
                idle: true,
            },
            Call::Take {
                limit: Limit::new(Algorithm::LeakyBucket, 5, SECOND, Some(10)).unwrap().with_delay(3).unwrap(),
                cost: 1,
            },
            Call::Take { limit: Limit::new(Algorithm::LeakyBucket, 5, SECOND, None).unwrap(), cost: 1 },
        ] {
            assert_eq!(Call::decode(&call.encode()), Some(call));
        }
        assert_eq!(Call::decode(r#"{"op":"take","limit":["token_bucket",0,1,1],"cost":1}"#), None);
        assert_eq!(Call::decode("garbage"), None);
        let t = Taken {
            decision: Decision { allowed: false, limit: 10, remaining: 0, reset_after: 5, retry_after: Some(7) },
            now: 1_700_000_000 * SECOND,
        };
        assert_eq!(Taken::decode(&t.encode()), Some(t));
        let a = Applied { remaining: 3, grant: 1, reset_after: 2, lease: 5, nodes: 4, counted: true };
        assert_eq!(decode_applied(&encode_applied(&a, Some(5))), Some(a));
        assert_eq!(decode_out_for(&encode_applied(&a, Some(5))), Some(5));
        assert_eq!(decode_out_for(&encode_applied(&a, None)), None);
    }

    #[test]
    fn the_blocked_cache_answers_until_the_retry_time_and_stays_bounded() {
        let mut cache = BlockedCache::new(2);
        let denied =
            Decision { allowed: false, limit: 5, remaining: 0, reset_after: 10 * SECOND, retry_after: Some(SECOND) };
        cache.insert(b"k", 0, 1, denied);
        let d = cache.get(b"k", SECOND / 2, 1).unwrap();
        assert_eq!(d.retry_after, Some(SECOND / 2));
        assert!(cache.get(b"k", SECOND / 2, 0).is_none(), "a cheaper request asks the object");
        assert!(cache.get(b"k", SECOND, 1).is_none(), "a client that waited Retry-After is not cached-denied");
        for i in 0..100u32 {
            cache.insert(&i.to_le_bytes(), 0, 1, denied);
        }
        assert!(cache.len() <= 2);
        let allowed = Decision { allowed: true, retry_after: None, ..denied };
        cache.insert(b"ok", 0, 1, allowed);
        assert!(cache.get(b"ok", 0, 1).is_none());
        // Units given back to a counter (a queued request whose client left): ask again.
        cache.insert(b"back", 0, 1, denied);
        cache.forget(b"back");
        assert!(cache.get(b"back", SECOND / 2, 1).is_none());
    }

    #[test]
    fn the_local_fallback_enforces_the_limit_in_bounded_memory() {
        let mut r = Rules::default();
        r.load(RULES.as_bytes()).unwrap();
        let c = r.current().unwrap();
        let mut local = LocalFallback::new(10);
        let check = |user: &str| {
            let (checks, _) = checks_for(&c, "GET", "/x", &|h: &str| (h == "x-user-id").then(|| user.to_owned()));
            checks.into_iter().next().unwrap()
        };
        let u = check("u");
        assert!(local.take(&u, 0).allowed);
        assert!(local.take(&u, 0).allowed);
        assert!(!local.take(&u, 0).allowed);
        for i in 0..1000 {
            local.take(&check(&i.to_string()), 0);
        }
        assert!(local.states.len() <= 10);
    }

    #[test]
    fn the_local_fallback_judges_each_counter_idle_by_its_own_limit() {
        let check = |key: &[u8], per: Nanos| Check {
            rule: 0,
            limit: Limit::new(Algorithm::SlidingWindow, 1, per, None).unwrap(),
            cost: 1,
            key: key.to_vec(),
        };
        let mut local = LocalFallback::new(2);
        let hourly = check(b"a", 3600 * SECOND);
        assert!(local.take(&hourly, 0).allowed);
        assert!(local.take(&check(b"b", SECOND), 0).allowed);
        // Room for a third counter: the idle per-second one goes, the hourly one stays.
        assert!(local.take(&check(b"c", SECOND), 3 * SECOND).allowed);
        assert!(!local.take(&hourly, 3 * SECOND).allowed, "the hourly client keeps its count");
    }

    #[test]
    fn stored_counters_name_their_limit() {
        let limit = Limit::new(Algorithm::FixedWindow, 5, SECOND, None).unwrap();
        let mut c = ratewall_core::sync::Counter::new(limit);
        c.take(limit, 7 * SECOND, 2);
        let v = stored_value(&c);
        assert_eq!(parse_stored(&v, None), Ok(c.clone()));
        assert_eq!(parse_stored(&v, Some(limit)), Ok(c.clone()));
        // The older form: the hex alone, read under the caller's limit.
        assert_eq!(parse_stored(&hex(&c.encode()), Some(limit)), Ok(c.clone()));
        assert!(parse_stored(&hex(&c.encode()), None).is_err());
        assert!(parse_stored("zz/[]", Some(limit)).is_err());
    }

    #[test]
    fn registry_calls_and_answers_round_trip() {
        let c = Call::Heard { node: 7, seq: u64::MAX, ask: true, sent: 5 };
        assert_eq!(Call::decode(&c.encode()), Some(c));
        assert_eq!(c.limit(), None);
        assert_eq!(decode_heard(&encode_heard(Ok(3))), Some(Ok(3)));
        for refused in
            [ratewall_core::sync::SyncError::Stale { last: 9 }, ratewall_core::sync::SyncError::Repeated { ask: 4 }]
        {
            assert_eq!(decode_heard(&encode_heard(Err(refused))), Some(Err(refused)));
        }
        // From a Worker of a version before the time: not checked.
        assert_eq!(
            Call::decode(r#"{"op":"heard","node":1,"seq":2,"ask":true}"#),
            Some(Call::Heard { node: 1, seq: 2, ask: true, sent: 0 })
        );
        assert_eq!(decode_heard("{}"), None);
    }

    #[test]
    fn counters_are_named_by_shard_or_by_the_keys_hex() {
        assert_eq!(object_name(&[0, 0xab, 7], 0), "c:00ab07");
        // FNV-1a: the empty key hashes to the offset basis, and a name never changes.
        assert_eq!(object_name(b"", 64), format!("s:{}", 0xcbf2_9ce4_8422_2325u64 % 64));
        assert_eq!(object_name(b"a", 1_000_000), format!("s:{}", 0xaf63_dc4c_8601_ec8cu64 % 1_000_000));
        let used: std::collections::HashSet<String> =
            (0..1000u32).map(|i| object_name(format!("ip:{i}").as_bytes(), 16)).collect();
        assert_eq!(used.len(), 16, "keys spread over every shard");
    }

    #[test]
    fn a_batch_and_its_replies_round_trip() {
        let limit = Limit::new(Algorithm::FixedWindow, 5, 1_000, None).unwrap();
        let calls = vec![
            (b"k1".to_vec(), Call::Take { limit, cost: 1 }),
            (
                vec![0, 255],
                Call::Spend {
                    limit,
                    node: 3,
                    seq: 9,
                    units: 2,
                    ask: 0,
                    cost: 0,
                    at: 0,
                    refund: 0,
                    refund_at: 0,
                    idle: false,
                },
            ),
        ];
        assert_eq!(decode_batch(&encode_batch(&calls)), Some(calls));
        let heard = r#"{"batch":[{"key":"00","call":{"op":"heard","node":1,"seq":1,"ask":false}}]}"#;
        assert_eq!(decode_batch(heard), None, "the registry's calls are not counter calls");
        assert_eq!(decode_batch(r#"{"batch":[{"key":"0","call":{}}]}"#), None);
        let replies = vec![Some("{}".to_owned()), None];
        assert_eq!(decode_replies(&encode_replies(&replies), 2), Some(replies));
        assert_eq!(decode_replies(r#"{"replies":["{}"]}"#, 2), None, "one per call");
        assert_eq!(decode_replies(r#"{"replies":[1]}"#, 1), None);
    }

    #[test]
    fn metrics_render_per_rule_lines() {
        let mut m = Metrics::default();
        m.rule("a").rejected += 2;
        m.rule("b").allowed += 1;
        m.object_calls = 3;
        let text = m.render();
        assert!(text.contains("ratewall_rule_rejected{rule=\"a\"} 2\n"), "{text}");
        // Every sample follows its family's HELP and TYPE, and a family's samples are together.
        let mut seen: Vec<&str> = Vec::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let family = line.split(['{', ' ']).next().unwrap();
            let kind = if family == "ratewall_rule_in_flight" { "gauge" } else { "counter" };
            assert!(text.contains(&format!("# TYPE {family} {kind}\n")), "{family}");
            assert!(text.contains(&format!("# HELP {family} ")), "{family}");
            if seen.last() != Some(&family) {
                assert!(!seen.contains(&family), "{family} is split:\n{text}");
                seen.push(family);
            }
        }
        assert!(text.contains("ratewall_object_calls 3\n"), "{text}");
    }

    /// Two rules over one request: "per-user" (2 per minute) and a closed and an open rule
    /// on /login.
    const TWO: &str = r#"{
      "identity": {"user": {"header": "x-user-id"}},
      "rules": [
        {"name": "open", "key": ["user"], "limit": {"requests": 2, "per": "60s"}},
        {"name": "closed", "key": ["user"], "on_store_failure": "closed", "limit": {"requests": 1, "per": "60s"}},
        {"name": "watch", "key": ["user"], "mode": "shadow", "limit": {"requests": 1, "per": "60s"}}
      ]}"#;

    fn two() -> (Rc<Config>, Vec<Check>, Vec<(usize, Skip)>) {
        let mut r = Rules::default();
        r.load(TWO.as_bytes()).unwrap();
        let c = r.current().unwrap();
        let (checks, skipped) = checks_for(&c, "GET", "/x", &|h: &str| (h == "x-user-id").then(|| "ann".to_owned()));
        (c, checks, skipped)
    }

    fn taken(allowed: bool, now: Nanos) -> Result<Answer, StoreError> {
        let decision = Decision {
            allowed,
            limit: 2,
            remaining: 0,
            reset_after: SECOND,
            retry_after: (!allowed).then_some(SECOND),
        };
        take_answer(Ok(Taken { decision, now }.encode()))
    }

    #[test]
    fn a_failed_object_falls_back_locally_for_open_rules_and_fails_closed_ones() {
        let (c, checks, _) = two();
        let (mut fallback, mut metrics) = (LocalFallback::new(10), Metrics::default());
        let answers =
            vec![Err(StoreError::Unavailable), Err(StoreError::Unavailable), take_answer(Ok("garbage".into()))];
        let (d, at) = decisions(&c, &checks, answers, 5 * SECOND, &mut fallback, &mut metrics);
        assert!(matches!(d[0], Ok(Decision { allowed: true, .. })), "open: the isolate's own limit");
        assert_eq!(d[1], Err(StoreError::Unavailable), "closed: failed");
        assert!(d[2].is_ok(), "a garbled answer is a failure; the shadow rule is open: local");
        assert_eq!(at, [None, None, None]);
        assert_eq!((metrics.rule("open").store_failed, metrics.rule("watch").store_failed), (1, 1));
        let answers = || vec![Err(StoreError::Unavailable), taken(true, 7), taken(true, 8)];
        let (d, _) = decisions(&c, &checks, answers(), 5 * SECOND, &mut fallback, &mut metrics);
        assert!(d[0].is_ok());
        let (d, _) = decisions(&c, &checks, answers(), 5 * SECOND, &mut fallback, &mut metrics);
        assert!(matches!(d[0], Ok(Decision { allowed: false, .. })), "the local limit is 2");
    }

    #[test]
    fn a_request_another_rule_rejects_refunds_what_it_took_at_the_objects_clock() {
        let (c, checks, skipped) = two();
        let (mut fallback, mut metrics) = (LocalFallback::new(10), Metrics::default());
        let grant = Decision { allowed: true, limit: 1, remaining: 0, reset_after: SECOND, retry_after: None };
        let answers = vec![taken(true, 11), taken(false, 12), taken(true, 13)];
        let (d, at) = decisions(&c, &checks, answers, 5 * SECOND, &mut fallback, &mut metrics);
        let (outcome, refunds) = ratewall_core::combine(&c, &checks, &d);
        assert!(outcome.rejected);
        let (calls, grants) = refund_calls(&checks, &refunds, &at);
        assert!(grants.is_empty());
        assert_eq!(calls.len(), 2, "the rules that took a unit, shadow included, as in the core: {calls:?}");
        assert_eq!((&calls[0].0, &calls[1].0), (&checks[0].key, &checks[2].key));
        assert!(matches!(calls[0].1, Call::Refund { cost: 1, at: 11, .. }));
        assert!(matches!(calls[1].1, Call::Refund { cost: 1, at: 13, .. }));
        assert_eq!(
            refund_calls(&checks, &refunds, &[None, None, None]),
            (vec![], vec![]),
            "a failed take owes nothing"
        );
        let spent = [Some(Answer::Grant(grant)), at[1], at[2]];
        let (calls, grants) = refund_calls(&checks, &refunds, &spent);
        assert_eq!(grants, [(checks[0].key.clone(), 1)], "a grant's unit goes back to the grant");
        assert_eq!(calls.len(), 1);
        metrics.count(&c, &outcome, &skipped, false);
        assert_eq!((metrics.rule("open").allowed, metrics.rule("closed").rejected), (1, 1));
        assert_eq!(metrics.rule("watch").allowed, 1);
    }

    #[test]
    fn cached_denials_answer_for_enforcing_rules_only_and_count_as_the_rules_denials() {
        let (c, checks, skipped) = two();
        let mut cache = BlockedCache::new(10);
        let denied = Decision {
            allowed: false,
            limit: 1,
            remaining: 0,
            reset_after: 30 * SECOND,
            retry_after: Some(30 * SECOND),
        };
        assert!(!cached_denials(&c, &checks, SECOND, &mut cache).rejected, "nothing cached");
        cache.insert(&checks[2].key, SECOND, 1, denied);
        assert!(!cached_denials(&c, &checks, SECOND, &mut cache).rejected, "a shadow rule's denial is not served");
        cache.insert(&checks[1].key, SECOND, 1, denied);
        let o = cached_denials(&c, &checks, 2 * SECOND, &mut cache);
        assert!(o.rejected);
        assert_eq!(o.checks.len(), 1);
        let CheckResult::Decided(d) = o.checks[0].result else { panic!() };
        assert_eq!(d.retry_after, Some(29 * SECOND), "the wait counts down");
        let mut m = Metrics::default();
        m.count(&c, &o, &skipped, true);
        assert_eq!((m.rule("closed").cached_denials, m.rule("closed").rejected), (1, 1), "a denial, from the cache");
        assert!(!cached_denials(&c, &checks, 31 * SECOND, &mut cache).rejected, "expired");
    }
}
