//! The rate limit service front: Envoy's `ShouldRateLimit` (`rls.proto` v3) answered from
//! envoyproxy/ratelimit's configuration ([`config`]) with the store's counters in Redis.
//!
//! Each matched descriptor is one counter — a Redis key holding the core's `sync::Counter`,
//! changed by the same compare-and-swap of the core's pure transitions the sync endpoint
//! uses. A call is decided in two steps: every limited descriptor takes its hits; when the
//! call is over the limit (an enforced limit that is not a quota is over, or every quota of
//! the call is, as envoyproxy/ratelimit decides), the ones that took are given back, so a
//! denied request charges no descriptor. Descriptors not configured `exact` are decided from
//! this process's grants ([`lease`]), like a proxy's; `exact` ones at Redis on every call.
//!
//! The gRPC server ([`grpc`]) and `POST /json` ([`json`]) are two encodings of the same
//! [`Call`] and [`Answer`]. Each call's outcome is heard by the store's top offenders
//! ([`crate::top`]), per rule, under the client's key with its values hashed.

pub mod config;
pub mod grpc;
pub mod json;
pub mod lease;
pub mod metrics;

use crate::{redis_key, Cas, Kv, Store, ANSWER_MARGIN, CAS_ATTEMPTS, KNOWN};
use config::{Matched, RlsConfig, Rule, Unit};
use ratewall_core::response::{ceil_secs, policy_item, push_decimal, push_state_item};
use ratewall_core::sync::{hex, sign, Counter, RETRY_HORIZON, SEQ_MEMORY};
use ratewall_core::{Decision, Limit, Nanos};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// A counter's value as this process last wrote it, the key's clock then, and when (ours).
type Known = (Vec<u8>, Nanos, std::time::Instant);

/// Per descriptor of a call, the rule it selects and how it matched (None: no limit applies).
type Resolved = Vec<Option<(Arc<Rule>, Option<Matched>)>>;

/// One request descriptor: its entries, its `limit` override and its `hits_addend`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Descriptor {
    /// `(key, value)` pairs, outermost first.
    pub entries: Vec<(String, String)>,
    /// `limit` override: requests per unit and the `rls.proto` unit number.
    pub limit: Option<(u32, i32)>,
    /// Its own `hits_addend` (0 allowed: a check that takes nothing).
    pub hits_addend: Option<u64>,
}

/// A `ShouldRateLimit` call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Call {
    /// `domain`.
    pub domain: String,
    /// `descriptors`.
    pub descriptors: Vec<Descriptor>,
    /// `hits_addend` (0: 1).
    pub hits_addend: u32,
}

/// `rls.proto`'s `Code`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// `OK`.
    Ok,
    /// `OVER_LIMIT`.
    OverLimit,
}

/// The limit a status reports (`current_limit`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CurrentLimit {
    /// `name`.
    pub name: String,
    /// `requests_per_unit`.
    pub requests_per_unit: u32,
    /// `unit` (`rls.proto` number).
    pub unit: i32,
}

/// One descriptor's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// `code`.
    pub code: Code,
    /// `current_limit` (None: no limit applies).
    pub current_limit: Option<CurrentLimit>,
    /// `limit_remaining`.
    pub limit_remaining: u32,
    /// `duration_until_reset`.
    pub duration_until_reset: Option<Nanos>,
}

/// The answer to a [`Call`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// `overall_code`.
    pub overall_code: Code,
    /// `statuses`, one per descriptor.
    pub statuses: Vec<Status>,
    /// `response_headers_to_add`.
    pub headers: Vec<(&'static str, String)>,
}

/// Why a call got no answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The call is malformed (gRPC `INVALID_ARGUMENT`, `/json` 400).
    Invalid(String),
    /// Redis did not answer within the deadline (gRPC `UNAVAILABLE`, `/json` 503).
    Unavailable(String),
}

/// Most descriptors one call may carry.
pub const MAX_DESCRIPTORS: usize = 64;
/// Most entries one descriptor may carry.
pub const MAX_ENTRIES: usize = 32;
/// Longest key or value a counter is named by as it is: a longer one is named by its keyed
/// hash (a call is never refused for a long value — Envoy would then let it through — and
/// what a counter's name holds stays bounded).
pub const MAX_TEXT: usize = 4096;

/// What one limited descriptor is decided against.
struct Check {
    /// The descriptors it decides: one, or every one of a call that names its counter (a call
    /// may name one counter more than once, as two of Envoy's `rate_limits` actions that
    /// produce the same entries do: their hits are taken as one, and refused as one).
    indices: Vec<usize>,
    rule: Arc<Rule>,
    hits: u64,
    /// The counter's Redis key.
    rkey: String,
}

/// The time from `now` until `limit` is fully restored after decision `d` (its
/// `duration_until_reset`). A fixed window's end and a token bucket's time to be full are the
/// decision's `reset_after`; a sliding window's units count on through the next window,
/// weighed down as it passes, so it is restored once what it counts weighs nothing: the
/// window's end plus the part of the next window over which the units spent (taken as all
/// spent in this window: the latest that can be) fade to none — 0 when it counts none.
fn until_restored(limit: Limit, d: &Decision, now: Nanos) -> Nanos {
    if limit.algorithm() != ratewall_core::Algorithm::SlidingWindow {
        return d.reset_after;
    }
    let spent = d.limit.saturating_sub(d.remaining);
    if spent == 0 {
        return 0;
    }
    let w = limit.per().max(1);
    // The least time `e` into the next window at which floor(spent * (w - e) / w) is 0.
    let fade = w - (w - 1) / spent;
    (w - now % w).saturating_add(fade).max(d.reset_after)
}

/// The names `config`'s rules are listed under among the top offenders, in its order: every
/// rule that limits (an `unlimited` one is counted in the metrics only).
fn listed(config: &RlsConfig) -> impl Iterator<Item = &str> {
    config.rules.iter().filter(|r| !r.unlimited).map(|r| r.top_name.as_str())
}

/// The rate limit service over a store's Redis.
pub struct Rls<K> {
    store: Arc<Store<K>>,
    config: RwLock<Arc<RlsConfig>>,
    /// Where the configuration is read from (None: given in memory).
    path: Option<PathBuf>,
    stamp: Mutex<config::Stamp>,
    /// Keys counter names (descriptor values may be secrets: Redis sees only a keyed hash).
    secret: Vec<u8>,
    /// Keys the hash that ends a long `limit` override's policy name.
    hash_key: ratewall_core::key::HashKey,
    /// Per rule and per domain counts.
    pub metrics: metrics::RlsMetrics,
    /// Counters being updated by this process (calls on one counter take turns here, so
    /// compare-and-swap conflicts come only from other processes).
    busy: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// The value this process last wrote to each counter and the key's clock then: the next
    /// update goes straight to the compare-and-set. At most [`KNOWN`] counters.
    known: Mutex<HashMap<String, Known>>,
    /// This process's grants.
    pub leases: lease::Leases,
}

impl<K: Kv> Rls<K> {
    /// A service over `store`'s Redis answering from `config`, read from `path` (reloaded
    /// by [`Rls::reload`]); counter names are keyed by `secret`.
    pub fn new(store: Arc<Store<K>>, config: RlsConfig, path: Option<PathBuf>, secret: &[u8]) -> Rls<K> {
        let stamp = path.as_deref().map(config::stamp).unwrap_or_default();
        store.top.configured(listed(&config));
        Rls {
            store,
            metrics: metrics::RlsMetrics::new(&config),
            config: RwLock::new(Arc::new(config)),
            path,
            stamp: Mutex::new(stamp),
            secret: secret.to_vec(),
            hash_key: ratewall_core::key::HashKey::derive(secret),
            busy: Mutex::default(),
            known: Mutex::default(),
            leases: lease::Leases::new(),
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<RlsConfig> {
        match self.config.read() {
            Ok(c) => Arc::clone(&c),
            Err(e) => Arc::clone(&e.into_inner()),
        }
    }

    /// Reads the configuration again if its files changed. `Ok(true)`: a new one is in force;
    /// `Err`: the files are bad and the last good configuration stays.
    pub fn reload(&self) -> Result<bool, config::ConfigError> {
        let Some(path) = &self.path else { return Ok(false) };
        let now = config::stamp(path);
        {
            let Ok(mut last) = self.stamp.lock() else { return Ok(false) };
            if *last == now {
                return Ok(false);
            }
            *last = now;
        }
        match RlsConfig::load_keyed(path, Some(self.hash_key)) {
            Ok(c) => {
                self.metrics.set_rules(&c);
                self.store.top.configured(listed(&c));
                if let Ok(mut slot) = self.config.write() {
                    *slot = Arc::new(c);
                }
                self.metrics.config_loads.fetch_add(1, Ordering::Relaxed);
                Ok(true)
            }
            Err(e) => {
                self.metrics.config_errors.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// Answers a call within the store's deadline.
    pub async fn should_rate_limit(&self, call: &Call) -> Result<Answer, Refusal> {
        let started = std::time::Instant::now();
        let deciding = CALL_STARTED.scope(started, self.decide(call));
        let result = match tokio::time::timeout(self.store.deadline, deciding).await {
            Ok(r) => r,
            Err(_) => {
                self.store.metrics.redis_errors.fetch_add(1, Ordering::Relaxed);
                Err(Refusal::Unavailable(
                    "Redis could not be reached or did not answer within the deadline (down, slow or paused; on a \
                     Cluster, also a slot migrating or a primary failing over)"
                        .into(),
                ))
            }
        };
        let known = self.config().has_domain(&call.domain);
        self.metrics.observe(if known { &call.domain } else { "" }, started.elapsed(), &result);
        result
    }

    /// The Redis key of a descriptor's counter under `limit`: its domain, its entries (a shared
    /// wildcard's by its pattern) and the limit's algorithm and window, so that two limits on
    /// the same entries (an override beside the configured limit, or two overrides of other
    /// units) count apart, as envoyproxy/ratelimit's keys (which carry the window's start) do.
    /// A limit changed to another number of requests per window keeps its count.
    fn counter_key(
        &self,
        domain: &str,
        entries: &[(String, String)],
        matched: Option<&Matched>,
        limit: Limit,
    ) -> String {
        // Length-prefixed, so no two descriptors share a name; a part over MAX_TEXT bytes is
        // its keyed hash behind a length no shorter part has.
        let mut name = Vec::with_capacity(64);
        let mut push = |s: &str| {
            if s.len() > MAX_TEXT {
                name.extend_from_slice(&u32::MAX.to_le_bytes());
                name.extend_from_slice(&sign(&self.secret, s.as_bytes()));
            } else {
                name.extend_from_slice(&(s.len() as u32).to_le_bytes());
                name.extend_from_slice(s.as_bytes());
            }
        };
        push("rls");
        push(domain);
        for (i, (k, v)) in entries.iter().enumerate() {
            push(k);
            let shared = matched.and_then(|m| m.shared.get(i)).and_then(Option::as_deref);
            push(shared.unwrap_or(v));
        }
        push(limit.algorithm().as_str());
        push(&limit.per().to_string());
        let tag = sign(&self.secret, &name);
        redis_key(tag.get(..16).unwrap_or(&tag))
    }

    /// The rules a call's descriptors select (envoyproxy/ratelimit's: a `limit` override in a
    /// known domain, else the configuration's match; then `replaces` drops the limits named).
    fn resolve(&self, call: &Call) -> Result<Resolved, Refusal> {
        if call.domain.is_empty() {
            return Err(Refusal::Invalid("rate limit domain must not be empty".into()));
        }
        if call.descriptors.is_empty() {
            return Err(Refusal::Invalid("rate limit descriptor list must not be empty".into()));
        }
        if call.descriptors.len() > MAX_DESCRIPTORS {
            return Err(Refusal::Invalid(format!("a call carries at most {MAX_DESCRIPTORS} descriptors")));
        }
        let config = self.config();
        let known_domain = config.has_domain(&call.domain);
        let mut rules = Vec::with_capacity(call.descriptors.len());
        for (i, d) in call.descriptors.iter().enumerate() {
            if d.entries.len() > MAX_ENTRIES {
                return Err(Refusal::Invalid(format!("descriptors[{i}] has more than {MAX_ENTRIES} entries")));
            }
            if !known_domain {
                rules.push(None);
                continue;
            }
            if let Some((rpu, unit)) = d.limit {
                let unit = Unit::from_proto(unit)
                    .ok_or_else(|| Refusal::Invalid(format!("descriptors[{i}].limit: unknown unit {unit}")))?;
                // Counted under the request's values (Redis sees only a keyed hash of the key);
                // named in the response's headers by their keyed hashes, as a value may be a
                // secret (an API key): `domain.key_#3f9a1c2e`.
                let (mut key, mut shown) = (call.domain.clone(), call.domain.clone());
                for (k, v) in &d.entries {
                    for s in [&mut key, &mut shown] {
                        s.push('.');
                        s.push_str(k);
                    }
                    if !v.is_empty() {
                        key.push('_');
                        key.push_str(v);
                        shown.push('_');
                        ratewall_core::key::push_hashed(&mut shown, self.hash_key.hash(v.as_bytes()));
                    }
                }
                // Cut, with a keyed hash of the whole, when long.
                let key = ratewall_core::topk::bounded_key(key, &self.hash_key);
                let shown = ratewall_core::topk::bounded_key(shown, &self.hash_key);
                let rule = Rule::overriding(&call.domain, key, &shown, rpu, unit)
                    .map_err(|e| Refusal::Invalid(format!("descriptors[{i}].limit: {e}")))?;
                rules.push(Some((Arc::new(rule), None)));
                continue;
            }
            let entries: Vec<(&str, &str)> = d.entries.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            rules.push(config.find(&call.domain, &entries).map(|m| (Arc::clone(&m.rule), Some(m))));
        }
        let replaced: Vec<&str> =
            rules.iter().flatten().flat_map(|(r, _)| r.replaces.iter().map(String::as_str)).collect();
        let mut out = Vec::with_capacity(rules.len());
        for r in &rules {
            out.push(match r {
                Some((rule, _)) if !rule.name.is_empty() && replaced.contains(&rule.name.as_str()) => None,
                other => other.clone(),
            });
        }
        Ok(out)
    }

    async fn decide(&self, call: &Call) -> Result<Answer, Refusal> {
        let rules = self.resolve(call)?;
        let mut statuses: Vec<Status> =
            vec![
                Status { code: Code::Ok, current_limit: None, limit_remaining: 0, duration_until_reset: None };
                call.descriptors.len()
            ];
        let mut checks = Vec::new();
        let mut decisions: Vec<Option<(Arc<Rule>, Decision)>> = vec![None; call.descriptors.len()];
        let mut matches: Vec<Option<Matched>> = vec![None; call.descriptors.len()];
        for (i, (d, r)) in call.descriptors.iter().zip(rules).enumerate() {
            let Some((rule, matched)) = r else { continue };
            if let Some(slot) = matches.get_mut(i) {
                slot.clone_from(&matched);
            }
            let hits = d.hits_addend.unwrap_or(u64::from(call.hits_addend.max(1)));
            if rule.unlimited {
                if let Some(s) = statuses.get_mut(i) {
                    s.limit_remaining = u32::MAX;
                }
                self.metrics.count(&rule, hits, metrics::Outcome::Unlimited);
                continue;
            }
            match rule.limit {
                Some(limit) => {
                    let rkey = self.counter_key(&call.domain, &d.entries, matched.as_ref(), limit);
                    // Taken one after the other, one descriptor's refusal was remembered for
                    // its counter after the others' hits were taken, and once they were given
                    // back, a call of one hit was refused for 50 ms with every unit free.
                    match checks.iter_mut().find(|c: &&mut Check| c.rkey == rkey && *c.rule == *rule) {
                        Some(same) => {
                            same.hits = same.hits.saturating_add(hits);
                            same.indices.push(i);
                        }
                        None => checks.push(Check { indices: vec![i], rule, hits, rkey }),
                    }
                }
                None => {
                    // `requests_per_unit: 0`: every hit is over the limit.
                    let per = rule.unit.map_or(1, Unit::nanos);
                    let now = wall_clock();
                    let reset_after = per - now % per;
                    let decision =
                        Decision { allowed: hits == 0, limit: 0, remaining: 0, reset_after, retry_after: None };
                    if let Some(slot) = decisions.get_mut(i) {
                        *slot = Some((rule, decision));
                    }
                }
            }
        }
        // Every limited descriptor takes its hits at once.
        let taken = futures_util::future::join_all(checks.iter().map(|c| self.take(c))).await;
        let mut failed = None;
        let mut charged = Vec::new();
        // When each descriptor was decided (on the clock it was decided by).
        let mut decided_at: Vec<Nanos> = vec![0; call.descriptors.len()];
        for (c, t) in checks.iter().zip(taken) {
            match t {
                Ok((d, at, from)) => {
                    if d.allowed && c.hits > 0 {
                        charged.push((c, at, from));
                    }
                    for &i in &c.indices {
                        if let Some(slot) = decided_at.get_mut(i) {
                            *slot = at;
                        }
                        if let Some(slot) = decisions.get_mut(i) {
                            *slot = Some((Arc::clone(&c.rule), d));
                        }
                    }
                }
                Err(e) => failed = Some(e),
            }
        }
        let verdict = Verdict::of(decisions.iter().flatten().map(|(r, d)| (r.as_ref(), d)));
        if failed.is_some() || verdict.over {
            // Given back: a denied (or failed) call charges no descriptor.
            let gone =
                futures_util::future::join_all(charged.iter().map(|(c, at, from)| self.give_back(c, *at, *from))).await;
            for ((c, _, _), g) in charged.iter().zip(gone) {
                if g.is_err() {
                    continue;
                }
                for &i in &c.indices {
                    if let Some(Some((rule, d))) = decisions.get_mut(i) {
                        d.remaining = d.remaining.saturating_add(c.hits).min(d.limit);
                        if let Some(l) = rule.limit {
                            d.reset_after = lease::reset_after_given_back(l, d.reset_after, c.hits);
                        }
                    }
                }
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        let mut violated = Vec::new();
        let mut enforced: Vec<(&Rule, Decision)> = Vec::new();
        let mut retry: Option<u64> = None;
        let mut quota_retry: Option<u64> = None;
        // Per descriptor the rule decided something for: its index, units admitted, what it
        // did, the client's key.
        let mut heard: Vec<(usize, u64, crate::top::Outcome, String)> = Vec::new();
        for (i, slot) in decisions.iter().enumerate() {
            let Some((rule, d)) = slot else { continue };
            let hits =
                call.descriptors.get(i).and_then(|x| x.hits_addend).unwrap_or(u64::from(call.hits_addend.max(1)));
            let over = !d.allowed;
            let outcome = match (over, rule.shadow) {
                (true, true) => metrics::Outcome::Shadow,
                (true, false) => metrics::Outcome::OverLimit,
                (false, _) if d.remaining.saturating_mul(5) < d.limit => metrics::Outcome::NearLimit,
                _ => metrics::Outcome::Ok,
            };
            self.metrics.count(rule, hits, outcome);
            let at = decided_at.get(i).copied().unwrap_or(0);
            let restored = rule.limit.map_or(d.reset_after, |l| until_restored(l, d, at));
            if let Some(s) = statuses.get_mut(i) {
                // A quota over its limit says so, whether or not the call is over.
                s.code = if over && !rule.shadow { Code::OverLimit } else { Code::Ok };
                s.current_limit = Some(CurrentLimit {
                    name: rule.name.clone(),
                    requests_per_unit: rule.requests_per_unit,
                    unit: rule.unit_proto(),
                });
                s.limit_remaining = u32::try_from(d.remaining).unwrap_or(u32::MAX);
                // Whole seconds, rounded up, as envoyproxy/ratelimit answers (and as `t=`).
                s.duration_until_reset = Some(ceil_secs(restored).saturating_mul(ratewall_core::SECOND));
            }
            // Who is being limited: this rule's count of the call, under the client's key.
            let top = match (over, verdict.denies(rule)) {
                (true, true) => crate::top::Outcome::Denied,
                (true, false) => crate::top::Outcome::ShadowDenied,
                (false, _) => crate::top::Outcome::Within,
            };
            let admitted = if over || verdict.over { 0 } else { hits };
            if top != crate::top::Outcome::Within || admitted > 0 {
                let entries = call.descriptors.get(i).map_or(&[][..], |x| x.entries.as_slice());
                let matched = matches.get(i).and_then(Option::as_ref);
                heard.push((i, admitted, top, self.shown_key(entries, matched)));
            }
            if !verdict.denies(rule) && (over || rule.shadow) {
                // Shadow, or a quota over its limit beside one with room: not in the answer's
                // fields.
                continue;
            }
            if over {
                // A call that never fits (more hits than the limit) is told the quota's reset,
                // as its `duration_until_reset` and `t=` say, not a whole window.
                let wait = ceil_secs(d.retry_after.unwrap_or(restored)).max(1);
                let slot = if rule.quota { &mut quota_retry } else { &mut retry };
                *slot = Some(match (*slot, rule.quota) {
                    (Some(w), true) => w.min(wait),
                    (Some(w), false) => w.max(wait),
                    (None, _) => wait,
                });
                violated.push((rule.as_ref(), *d));
            } else {
                enforced.push((rule.as_ref(), *d));
            }
        }
        let decided: Vec<crate::top::Decided<'_>> = heard
            .iter()
            .filter_map(|(i, allowed, outcome, key)| {
                let (rule, _) = decisions.get(*i)?.as_ref()?;
                Some(crate::top::Decided {
                    rule: &rule.top_name,
                    order: rule.order,
                    key: key.as_bytes(),
                    allowed: *allowed,
                    outcome: *outcome,
                })
            })
            .collect();
        self.store.top.decided(&decided);
        let overall_code = if verdict.over { Code::OverLimit } else { Code::Ok };
        // Allowed: every enforced limit, the most restrictive first (least remaining, then
        // longest reset), as the filter answers. Over: the limits it is over for; it fits
        // once every one of them that is not a quota has room, and one of the quotas does.
        enforced.sort_by(|(_, a), (_, b)| ratewall_core::response::most_restrictive_first(a, b));
        let headers = if verdict.over {
            let wait = retry.into_iter().chain(quota_retry).max().unwrap_or(1);
            fields(Some(wait), &violated)
        } else {
            fields(None, &enforced)
        };
        Ok(Answer { overall_code, statuses, headers })
    }

    /// The client's key among the top offenders: the descriptor's entries as `key=value`,
    /// joined by `,` in order, a shared wildcard's value as its pattern (the counter it counts
    /// in), a secret one (`secret: true` on its descriptor, or a key secret by default: an API
    /// key) only as `#` and 8 hex digits of its keyed hash; cut, with a hash of the whole, past
    /// 160 bytes.
    fn shown_key(&self, entries: &[(String, String)], matched: Option<&Matched>) -> String {
        let mut out = String::with_capacity(16 * entries.len());
        for (i, (k, v)) in entries.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            ratewall_core::key::push_value(&mut out, k.as_bytes());
            out.push('=');
            let shown = matched.and_then(|m| m.shared.get(i)).and_then(Option::as_deref).unwrap_or(v);
            let secret = match matched {
                Some(m) => m.secret.get(i).copied().unwrap_or(true),
                None => config::secret_by_default(k),
            };
            if secret {
                ratewall_core::key::push_hashed(&mut out, self.hash_key.hash(shown.as_bytes()));
            } else {
                ratewall_core::key::push_value(&mut out, shown.as_bytes());
            }
        }
        ratewall_core::topk::bounded_key(out, &self.hash_key)
    }

    /// Takes a check's hits (exact: at Redis; else from this process's grant, or by an ask
    /// at Redis). Returns the decision, the time then (taken at Redis: the counter's clock;
    /// from a grant: ours) and where they were taken.
    async fn take(&self, c: &Check) -> Result<(Decision, Nanos, lease::Source), Refusal> {
        let Some(limit) = c.rule.limit else {
            return Err(Refusal::Invalid("no limit".into()));
        };
        let hits = c.hits;
        if c.rule.exact {
            let (d, at) = self
                .update(&c.rkey, limit, move |counter, now| {
                    let d = counter.take(limit, now, hits);
                    ((d, now), d.allowed && hits > 0)
                })
                .await?;
            return Ok((d, at, lease::Source::Redis));
        }
        let now = wall_clock();
        if let Some(d) =
            self.leases.take(&c.rkey, limit, hits, now).or_else(|| self.leases.cold(&c.rkey, limit, hits, now))
        {
            return Ok((d, now, lease::Source::Grant));
        }
        let node = self.leases.node;
        if let Some(b) = self.leases.unanswered(&c.rkey, now) {
            // Spent on an initial share that Redis has not counted yet: counted first (its
            // answer is this process's grant), so that nothing is asked for twice.
            let batch = (limit, b.seq, b.units, b.since);
            let synced = |r| self.leases.reported(&c.rkey, b.seq, &r, now);
            let release = b.release;
            self.update_then(
                &c.rkey,
                limit,
                move |counter, now| lease::reported(counter, now, node, batch, release),
                synced,
            )
            .await?;
            let now = wall_clock();
            if let Some(d) = self.leases.take(&c.rkey, limit, hits, now) {
                return Ok((d, now, lease::Source::Grant));
            }
        }
        // What the grant holds is spent on the call, and only the rest asked for: the grant is
        // held against this process's ask.
        let part = self.leases.take_part(&c.rkey, limit, hits, now);
        let rest = hits - part;
        // Given back unless the ask takes the rest, however the call ends: a call dropped at
        // its deadline (answered UNAVAILABLE) or whose client went away took nothing.
        let mut lent = Lent { leases: &self.leases, rkey: &c.rkey, part, at: self.leases.on_counter(&c.rkey, now) };
        let ask = self.leases.next_ask();
        let unreported = self.leases.unreported(&c.rkey, now);
        // The ask's leases count from when it was sent, so that they end here before Redis's.
        let asked = |(a, at, retry, low)| {
            self.leases.note_low(&c.rkey, low);
            (self.leases.answered(&c.rkey, limit, (rest, part), &a, retry, now), at)
        };
        let answer = self
            .update_then(
                &c.rkey,
                limit,
                move |counter, at| {
                    // Read in turn (what changes it is noted in turn), as of the call's start.
                    let mine = self.leases.holding(&c.rkey, now);
                    let (a, retry) = ask_at(counter, at, (node, ask, mine), rest, unreported);
                    ((a, at, retry, lease::low_until(counter, at)), a.counted)
                },
                asked,
            )
            .await;
        let ((d, from), at) = answer?;
        if d.allowed {
            lent.part = 0;
        }
        let from = match from {
            lease::Source::Redis if part > 0 => lease::Source::Split(part),
            from => from,
        };
        // Taken from a grant: at our clock, as every call taken there.
        let at = if from == lease::Source::Grant { now } else { at };
        Ok((d, at, from))
    }

    /// Gives back hits taken at `at` where they were taken.
    async fn give_back(&self, c: &Check, at: Nanos, from: lease::Source) -> Result<(), Refusal> {
        let (mine, theirs) = match from {
            lease::Source::Grant => (c.hits, 0),
            lease::Source::Redis => (0, c.hits),
            lease::Source::Split(part) => (part, c.hits.saturating_sub(part)),
        };
        self.give_back_units(c, (mine, theirs), at, from == lease::Source::Grant).await
    }

    /// Gives back `mine` units of check `c` taken from this process's grant (to it, or at
    /// Redis when they were reported already) and `theirs` taken at Redis, as of `at` (`ours`:
    /// on this process's clock).
    async fn give_back_units(
        &self,
        c: &Check,
        (mine, theirs): (u64, u64),
        at: Nanos,
        ours: bool,
    ) -> Result<(), Refusal> {
        let Some(limit) = c.rule.limit else { return Ok(()) };
        let mut hits = theirs;
        if mine > 0 && !self.leases.give_back(&c.rkey, mine) {
            hits = hits.saturating_add(mine);
        }
        if hits == 0 {
            return Ok(());
        }
        // Reported already: given back at Redis, as of when they were taken on its clock.
        let at = if ours { self.leases.on_counter(&c.rkey, at) } else { at };
        self.update(&c.rkey, limit, move |counter, now| {
            counter.refund(limit, now, at, hits);
            ((), true)
        })
        .await?;
        self.leases.refunded(&c.rkey, hits);
        Ok(())
    }

    /// One counter's compare-and-swap loop: the value (the one this process last wrote, else
    /// read), `f` — the core's transition — on it, and a write if `f` says so and the value is
    /// still the one it ran on, else `f` again on what Redis holds.
    pub(crate) async fn update<R>(
        &self,
        rkey: &str,
        limit: Limit,
        f: impl Fn(&mut Counter, Nanos) -> (R, bool),
    ) -> Result<R, Refusal> {
        self.update_then(rkey, limit, f, |r| r).await
    }

    /// [`Rls::update`], with `then` run on its result before another call of this process
    /// may change the counter: what this process notes of Redis's answers (its grants, the
    /// units given to its asks) it notes in the order Redis gave them.
    pub(crate) async fn update_then<R, T>(
        &self,
        rkey: &str,
        limit: Limit,
        f: impl Fn(&mut Counter, Nanos) -> (R, bool),
        then: impl FnOnce(R) -> T,
    ) -> Result<T, Refusal> {
        let turn = self.busy.lock().ok().map(|mut b| Arc::clone(b.entry(rkey.to_owned()).or_default()));
        let in_turn = match &turn {
            Some(t) => Some(t.lock().await),
            None => None,
        };
        let result = self.update_locked(rkey, limit, f).await;
        match &result {
            Ok(_) => self.leases.reached(true),
            Err(Refusal::Unavailable(_)) => self.leases.reached(false),
            Err(_) => {}
        }
        let result = result.map(then);
        drop(in_turn);
        if let Ok(mut busy) = self.busy.lock() {
            if busy.get(rkey).is_some_and(|t| Arc::strong_count(t) <= 2) {
                busy.remove(rkey);
            }
        }
        result
    }

    async fn update_locked<R>(
        &self,
        rkey: &str,
        limit: Limit,
        f: impl Fn(&mut Counter, Nanos) -> (R, bool),
    ) -> Result<R, Refusal> {
        let m = &self.store.metrics;
        let unavailable = || {
            m.redis_errors.fetch_add(1, Ordering::Relaxed);
            Refusal::Unavailable("Redis failed".into())
        };
        let mut current = self.known.lock().ok().and_then(|k| {
            k.get(rkey).map(|(v, t, at)| {
                let since = u64::try_from(at.elapsed().as_nanos()).unwrap_or(u64::MAX);
                (Some(v.clone()), t.saturating_add(since))
            })
        });
        // Whether `current` is this process's last write rather than what Redis answered.
        let mut remembered = current.is_some();
        for _ in 0..CAS_ATTEMPTS {
            let from_memory = std::mem::take(&mut remembered);
            let (stored, raw) = match current.take() {
                Some(c) => c,
                None => self.store.kv.read(rkey).await.map_err(|_| unavailable())?,
            };
            let now = self.leases.run_at(rkey, raw);
            let mut counter = match &stored {
                None => Counter::new(limit),
                Some(bytes) => match Counter::decode(limit, bytes) {
                    Ok(c) => c,
                    Err(e) => {
                        // Kept as it is: a counter is never reset because it could not be read.
                        self.store.said_unreadable(rkey, &e.to_string());
                        return Err(Refusal::Unavailable(format!("a stored counter is unreadable ({e}); it is kept")));
                    }
                },
            };
            // A process admits nothing while Redis does not answer it: one silent on the
            // counter has stopped spending there, and nothing is held for it as for a proxy
            // cut off from its store, which admits its part on its own.
            counter.heard_all();
            let (r, write) = f(&mut counter, now);
            let observed = || self.leases.observed(rkey, raw, wall_clock(), lease::ran(&counter, now));
            if !write && from_memory {
                // No compare-and-set checks a decision that writes nothing (a refusal, a look
                // with no hits): made on this process's last write, it could be stale (another
                // process wrote since) or answered with Redis gone. Made again on what Redis
                // holds.
                continue;
            }
            if !write {
                observed();
                return Ok(r);
            }
            // Kept while anything in it matters (the state, grants, remembered seqs), and a
            // retry horizon on top, as the sync endpoint keeps its counters.
            let idle = counter.idle_at().saturating_sub(counter.last_seen).max(SEQ_MEMORY);
            let ttl_ms = (idle.saturating_add(RETRY_HORIZON) / 1_000_000).max(1);
            let new = counter.encode();
            // Not written once the call has been answered UNAVAILABLE: Redis, paused with this
            // on its socket, would run it when it answers again, and count a call that took
            // nothing (Envoy failing closed denied it).
            // What is left of the call's deadline once Redis's clock was read, less a margin for
            // the answer's way back: on Redis's clock, no later than the call's own deadline
            // (from `raw` plus the whole deadline, a compare-and-set run after a stall could
            // take a unit for a call already answered UNAVAILABLE).
            let left = CALL_STARTED
                .try_with(|s| self.store.deadline.saturating_sub(s.elapsed()))
                .unwrap_or(self.store.deadline)
                .saturating_sub(ANSWER_MARGIN);
            let deadline = u64::try_from(left.as_nanos()).unwrap_or(u64::MAX);
            let deadline_ms = raw.saturating_add(deadline) / 1_000_000;
            match self.store.kv.cas(rkey, stored.as_deref(), &new, ttl_ms, deadline_ms).await {
                Ok(Cas::Written(at)) => {
                    observed();
                    if let Ok(mut known) = self.known.lock() {
                        if known.len() >= KNOWN && !known.contains_key(rkey) {
                            known.clear();
                        }
                        known.insert(rkey.to_owned(), (new, at, std::time::Instant::now()));
                    }
                    m.counter_writes.fetch_add(1, Ordering::Relaxed);
                    return Ok(r);
                }
                Ok(Cas::Changed(value, at)) => {
                    m.cas_conflicts.fetch_add(1, Ordering::Relaxed);
                    current = Some((value, at));
                }
                Err(_) => {
                    if let Ok(mut known) = self.known.lock() {
                        known.remove(rkey);
                    }
                    return Err(unavailable());
                }
            }
        }
        m.cas_exhausted.fetch_add(1, Ordering::Relaxed);
        Err(Refusal::Unavailable("a counter was too contended".into()))
    }

    /// The store the service runs on.
    pub fn store(&self) -> &Store<K> {
        &self.store
    }

    /// A short hex digest naming a counter in logs (never the descriptor's values).
    pub fn digest(&self, rkey: &str) -> String {
        hex(rkey.as_bytes()).chars().take(12).collect()
    }
}

tokio::task_local! {
    /// When the call being decided began ([`Rls::should_rate_limit`]).
    static CALL_STARTED: std::time::Instant;
}

/// Units a call took from its grant before it asked Redis for the rest ([`lease::Leases::take_part`]):
/// given back when it is dropped still holding them (`part`), as a call refused, failed, or
/// dropped unanswered is.
struct Lent<'a> {
    leases: &'a lease::Leases,
    rkey: &'a str,
    part: u64,
    /// When they were taken (the counter's clock).
    at: Nanos,
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        if self.part > 0 {
            self.leases.give_back_or_owe(self.rkey, self.part, self.at);
        }
    }
}

/// This process's (`node`'s) ask number `ask` for `hits` on `counter` at `now`, holding `mine`
/// of its grants and `unreported` units: the answer, with the counter's own reset where it is
/// refused (the core's says when the ask could be taken, which this process's view of the
/// counter would read as its reset), and a refused call's wait ([`retry_after`]).
pub(crate) fn ask_at(
    counter: &mut Counter,
    now: Nanos,
    (node, ask, mine): (u64, u64, u64),
    hits: u64,
    unreported: u64,
) -> (ratewall_core::sync::Applied, Option<Nanos>) {
    let limit = counter.limit;
    let a = counter.ask_holding(limit, now, (node, ask, mine), hits, crate::NODE_TTL);
    if a.counted {
        return (a, None);
    }
    let retry = if hits == 0 { None } else { retry_after(counter, now, hits, (node, unreported)) };
    let whole = limit.decide(&counter.state, now.max(counter.last_seen), 0).0.reset_after;
    (ratewall_core::sync::Applied { reset_after: whole, ..a }, retry)
}

/// How long a call of `hits` refused by an ask at `now` waits until it would fit: until the
/// counter's state, with the `unreported` units this process (`node`) admitted from its grant
/// counted, and what the other processes' grants hold taken as spent (they may be, and
/// reported only with their next batches), has room for it (a fixed window whose quota is
/// spent: the window's end), and no sooner than [`Counter::retry_after`] (the grants held
/// lapse). That one alone counts every grant as free once its lease ends, though its units
/// were spent: it answered a second or two while the window had minutes left (with three
/// processes, a client that waited it was refused again). None: the call never fits.
fn retry_after(counter: &Counter, now: Nanos, hits: u64, (node, unreported): (u64, u64)) -> Option<Nanos> {
    let now = now.max(counter.last_seen);
    let limit = counter.limit;
    let others = counter.held_by_others(now, node);
    let spent = limit.consume(&counter.state, now, unreported.saturating_add(others));
    let (alone, _) = limit.decide(&spent, now, hits);
    let held = counter.retry_after(now, hits);
    if alone.allowed {
        held
    } else {
        alone.retry_after.map(|r| r.max(held.unwrap_or(0)))
    }
}

/// The wall clock, ns since the Unix epoch (0 if before it).
pub fn wall_clock() -> Nanos {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// `RateLimit-Policy` and `RateLimit` (and `Retry-After`, whole seconds, when given) for
/// `policies`, as the core renders them for the filter: `"name";q=Q;w=W` and `"name";r=R;t=T`.
/// A policy named twice (one rule matched by two descriptors of the call, on one counter or
/// two) is listed once, where it first comes, with its most restrictive decision: two items
/// of one name would say two different things of one policy.
fn fields(retry: Option<u64>, policies: &[(&Rule, Decision)]) -> Vec<(&'static str, String)> {
    let mut headers = Vec::with_capacity(3);
    if policies.is_empty() {
        return headers;
    }
    let mut once: Vec<(&Rule, Decision)> = Vec::with_capacity(policies.len());
    for (rule, d) in policies {
        match once.iter_mut().find(|(r, _)| r.policy == rule.policy) {
            Some((_, kept)) => {
                if ratewall_core::response::most_restrictive_first(d, kept) == std::cmp::Ordering::Less {
                    *kept = *d;
                }
            }
            None => once.push((rule, *d)),
        }
    }
    let policies = once.as_slice();
    if let Some(retry) = retry {
        let mut v = String::new();
        push_decimal(&mut v, retry);
        headers.push(("Retry-After", v));
    }
    let mut policy = String::with_capacity(64 * policies.len());
    let mut state = String::with_capacity(64 * policies.len());
    for (i, (rule, d)) in policies.iter().enumerate() {
        if i > 0 {
            policy.push_str(", ");
            state.push_str(", ");
        }
        match &rule.limit {
            Some(limit) => policy.push_str(&policy_item(&rule.policy, d.limit, limit)),
            None => {
                policy.push('"');
                policy.push_str(&rule.policy);
                policy.push_str("\";q=0;w=");
                push_decimal(&mut policy, window(rule));
            }
        }
        push_state_item(&mut state, &rule.policy, d.remaining, d.reset_after);
    }
    headers.push(("RateLimit-Policy", policy));
    headers.push(("RateLimit", state));
    headers
}

/// Whether a call is over the limit, as envoyproxy/ratelimit decides it: when a limit that is
/// neither shadow nor quota is over, or when the call has quotas and every one of them is over
/// (a shadow quota over its limit counts as one with room: its status is OK).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Verdict {
    /// The call is over the limit.
    over: bool,
    /// Every quota of the call is over (none: false).
    quotas_over: bool,
}

impl Verdict {
    fn of<'a>(decisions: impl Iterator<Item = (&'a Rule, &'a Decision)>) -> Verdict {
        let (mut enforced_over, mut quotas, mut quotas_over) = (false, 0usize, 0usize);
        for (rule, d) in decisions {
            let over = !d.allowed && !rule.shadow;
            if rule.quota {
                quotas += 1;
                quotas_over += usize::from(over);
            } else {
                enforced_over |= over;
            }
        }
        let all_quotas = quotas > 0 && quotas == quotas_over;
        Verdict { over: enforced_over || all_quotas, quotas_over: all_quotas }
    }

    /// Whether `rule`, over its limit, is one the call is denied for.
    fn denies(&self, rule: &Rule) -> bool {
        !rule.shadow && (!rule.quota || self.quotas_over)
    }
}

/// A rule's window, whole seconds.
fn window(rule: &Rule) -> u64 {
    ceil_secs(rule.unit.map_or(ratewall_core::SECOND, Unit::nanos)).max(1)
}

/// Reloads `rls`'s configuration every `every` while the process runs, logging a refused
/// file with its file, line and reason, and a new configuration's warnings.
pub async fn watch<K: Kv>(rls: Arc<Rls<K>>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match rls.reload() {
            Ok(true) => {
                crate::log_line!("ratewall-store: rate limit configuration reloaded");
                for w in &rls.config().warnings {
                    crate::log_line!("ratewall-store: rate limit configuration: {w}");
                }
            }
            Ok(false) => {}
            Err(e) => {
                crate::log_line!("ratewall-store: rate limit configuration refused, the last good one stays: {e}")
            }
        }
    }
}

#[cfg(test)]
mod tests;
