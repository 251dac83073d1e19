//! Multi-rule evaluation: which rules a request meets, under which keys, and the combined
//! verdict. Every matching rule is evaluated; a request rejected by one enforcing rule
//! consumes nothing from the rules that admitted it (their units are refunded).

use crate::algo::{Decision, Limit, Nanos, State};
use crate::rules::{Config, Dimension, FailurePolicy, Mode, PlanLimit};
use alloc::vec::Vec;

/// What a wrapper extracted from a request.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// The HTTP method.
    pub method: &'a str,
    /// The path after [`crate::glob::normalize_path`].
    pub path: &'a str,
    /// Values of `config.identity.headers`, in that order (`None` when absent or empty).
    pub headers: &'a [Option<&'a [u8]>],
    /// The client IP after [`crate::key::ip_key`], when known.
    pub ip: Option<&'a str>,
}

/// One counter a request must pass: a rule under one key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    /// Index of the rule in `config.rules`.
    pub rule: usize,
    /// The limit that applies (the plan's, or the rule's default).
    pub limit: Limit,
    /// Units this request consumes.
    pub cost: u64,
    /// The counter's identity: [`KEY_VERSION`], the rule name, the limit's fingerprint and
    /// the key parts (see [`Config::checks`]).
    pub key: Vec<u8>,
}

/// Why a matching rule did not count a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    /// The request lacks a dimension the rule keys on.
    Unkeyed,
    /// The request's plan is unlimited under this rule.
    Unlimited,
}

/// Key parts longer than this are replaced by a hash, bounding key size.
pub const MAX_PART: usize = 254;
/// The first byte of every counter key: the key format's version. (Keys of the first format
/// began with the rule name's length, 1 to 64, so no new key equals an old one.)
pub const KEY_VERSION: u8 = 0x82;
/// The length byte that marks a part replaced by its hash.
pub const HASHED_PART: u8 = 0xff;

impl Config {
    /// The checks a request must pass, and the matching rules that skip it.
    ///
    /// A counter key is `KEY_VERSION | len | rule name | fingerprint (8, LE) | parts`, each
    /// part `len (0..=254) | bytes`, or `0xff | hash (8, LE)` for a secret part or one longer
    /// than [`MAX_PART`] (the identity's keyed hash, [`crate::key::HashKey`]: no secret value
    /// is in a key, so none travels in a sync batch or is stored). The limit's fingerprint makes each limit of a rule (each plan, each
    /// version pushed) a counter of its own.
    #[must_use]
    pub fn checks(&self, req: &Request<'_>) -> (Vec<Check>, Vec<(usize, Skip)>) {
        self.checks_of(req, &self.matching(req.method, req.path))
    }

    /// Indices of the rules whose `match` a request meets, in rule order.
    pub fn matching(&self, method: &str, path: &str) -> Vec<usize> {
        self.rules.iter().enumerate().filter(|(_, r)| r.matcher.matches(method, path)).map(|(i, _)| i).collect()
    }

    /// [`Config::checks`] for the rules `matching` already found (so a wrapper that first
    /// asks which identity the matching rules need matches each rule once).
    pub fn checks_of(&self, req: &Request<'_>, matching: &[usize]) -> (Vec<Check>, Vec<(usize, Skip)>) {
        let mut checks = Vec::with_capacity(matching.len());
        let mut skipped = Vec::new();
        // A value is read without the whitespace around it (HTTP's optional whitespace, which
        // Envoy's codec strips and workerd passes on): `gold ` is the plan `gold`, and `alice `
        // is `alice`, not a fresh counter of its own.
        let header = |i: usize| req.headers.get(i).copied().flatten().map(<[u8]>::trim_ascii);
        let plan = self.identity.header_index("plan").and_then(header);
        // A secret or long header value is hashed once per request, however many rules key on
        // it, and only when one does.
        let mut hashed: Vec<Option<u64>> = Vec::new();
        let identity = &self.identity;
        'rules: for &i in matching {
            let Some(rule) = self.rules.get(i) else {
                continue;
            };
            let limit = match rule.limit_for(plan) {
                PlanLimit::Unlimited => {
                    skipped.push((i, Skip::Unlimited));
                    continue;
                }
                PlanLimit::Limited(l) => l,
            };
            let mut key = Vec::with_capacity(80);
            key.push(KEY_VERSION);
            push_part(&mut key, rule.name.as_bytes(), None);
            key.extend_from_slice(&limit.fingerprint().to_le_bytes());
            for dim in &rule.key {
                let value = match dim {
                    Dimension::Ip => req.ip.map(str::as_bytes),
                    Dimension::Header(h) => header(*h),
                };
                match value {
                    Some(v) if !v.is_empty() => {
                        let hash = (v.len() > MAX_PART || identity.is_secret(*dim)).then(|| match dim {
                            Dimension::Header(h) => {
                                if hashed.len() <= *h {
                                    hashed.resize(h + 1, None);
                                }
                                let slot = hashed.get_mut(*h);
                                match slot {
                                    Some(Some(known)) => *known,
                                    Some(slot) => *slot.insert(identity.hash_key.hash(v)),
                                    None => identity.hash_key.hash(v),
                                }
                            }
                            Dimension::Ip => identity.hash_key.hash(v),
                        });
                        push_part(&mut key, v, hash);
                    }
                    _ => {
                        skipped.push((i, Skip::Unkeyed));
                        continue 'rules;
                    }
                }
            }
            checks.push(Check { rule: i, limit, cost: rule.cost, key });
        }
        (checks, skipped)
    }
}

/// Appends one key part: its length and bytes, or, given its keyed hash (a secret value, or
/// one past [`MAX_PART`]), the marker and the hash.
fn push_part(key: &mut Vec<u8>, part: &[u8], hash: Option<u64>) {
    match (hash, u8::try_from(part.len())) {
        (None, Ok(n)) if usize::from(n) <= MAX_PART => {
            key.push(n);
            key.extend_from_slice(part);
        }
        (hash, _) => {
            key.push(HASHED_PART);
            key.extend_from_slice(&hash.unwrap_or_else(|| crate::hash::fnv1a(part)).to_le_bytes());
        }
    }
}

/// What a counter update stores: the new state and the units it charged (`None`: nothing).
pub type Write = Option<(State, u64)>;

/// Where counters live: proxy-wasm shared data, a test map, ...
pub trait Counters {
    /// Atomically reads the state for `check`, runs `f` on it, and stores the state `f`
    /// returns (`None`: leave it unchanged). `f` may run several times (compare-and-swap
    /// retries).
    ///
    /// `f`'s second argument is the counter's *allowance*: units a global store lets this
    /// node admit before it syncs again (`u64::MAX`: no such cap). `f` returns with the state
    /// the units it charged: a store that tracks an allowance takes them off it. (A denial
    /// may store a state moved back after a clock step, charging nothing.)
    fn update(&mut self, check: &Check, now: Nanos, f: &mut dyn FnMut(&State, u64) -> Write) -> Result<(), StoreError>;

    /// Gives back the units `check` took at `now` (its request was rejected by another rule).
    fn refund(&mut self, check: &Check, now: Nanos) -> Result<(), StoreError> {
        self.update(check, now, &mut |s, _| Some((check.limit.refund(s, now, check.cost), 0)))
    }
}

/// How long a client denied by an exhausted allowance is told to wait: the next sync brings
/// a new one.
pub const ALLOWANCE_RETRY: Nanos = crate::algo::SECOND;

/// The counter store could not be used for a check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// Compare-and-swap retries ran out under contention.
    Contention,
    /// The store is unreachable or returned garbage.
    Unavailable,
}

impl core::fmt::Display for StoreError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            StoreError::Contention => "compare-and-swap retries ran out under contention",
            StoreError::Unavailable => "the counter store is unreachable or answered garbage",
        })
    }
}

impl core::error::Error for StoreError {}

/// What happened to one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckResult {
    /// The limit decided.
    Decided(Decision),
    /// The store failed; the rule's failure policy applied.
    Failed(StoreError, FailurePolicy),
}

/// The result of one check, with its rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckOutcome {
    /// Index of the rule.
    pub rule: usize,
    /// The rule's mode.
    pub mode: Mode,
    /// The rule's limit for this request.
    pub limit: Limit,
    /// What happened.
    pub result: CheckResult,
}

impl CheckOutcome {
    /// Whether this check, as enforced, rejects the request.
    pub fn rejects(&self) -> bool {
        self.mode == Mode::Enforce
            && match self.result {
                CheckResult::Decided(d) => !d.allowed,
                CheckResult::Failed(_, policy) => policy == FailurePolicy::Closed,
            }
    }
    /// Whether a shadow rule would have rejected.
    pub fn would_reject(&self) -> bool {
        self.mode == Mode::Shadow && matches!(self.result, CheckResult::Decided(d) if !d.allowed)
    }
}

/// The verdict on a request.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Outcome {
    /// Whether any enforcing rule rejected.
    pub rejected: bool,
    /// Every matching, keyed rule's result, in rule order.
    pub checks: Vec<CheckOutcome>,
    /// Matching rules that did not count the request.
    pub skipped: Vec<(usize, Skip)>,
}

/// What one rule did with one request: the events both wrappers count per rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tally {
    /// Enforced and allowed (a shadow rule that would have allowed counts here too).
    Allowed,
    /// Enforced and rejected.
    Rejected,
    /// A shadow rule that would have rejected.
    ShadowRejected,
    /// Matched, but the request lacks a dimension the rule keys on.
    Unkeyed,
    /// The counter store failed (the rule's failure policy decided).
    Failed(StoreError),
}

impl Outcome {
    /// The outcome as of `wait` later, for a request a leaky bucket holds that long before it
    /// is forwarded: each decision's reset that much nearer, so its fields say when the
    /// bucket drains from the moment the client gets them.
    pub fn waited(&mut self, wait: Nanos) {
        for c in &mut self.checks {
            if let CheckResult::Decided(d) = &mut c.result {
                d.reset_after = d.reset_after.saturating_sub(wait);
            }
        }
    }

    /// Per rule (by index), what it did with the request: one event per decided or failed
    /// check, in rule order, then one per rule `skipped` as unkeyed. The one tally the filter
    /// and the Worker count their per-rule metrics from.
    pub fn tally<'a>(&'a self, skipped: &'a [(usize, Skip)]) -> impl Iterator<Item = (usize, Tally)> + 'a {
        let checks = self.checks.iter().map(|c| {
            let t = match c.result {
                CheckResult::Decided(_) if c.would_reject() => Tally::ShadowRejected,
                CheckResult::Decided(d) if !d.allowed => Tally::Rejected,
                CheckResult::Decided(_) => Tally::Allowed,
                CheckResult::Failed(e, _) => Tally::Failed(e),
            };
            (c.rule, t)
        });
        let unkeyed = skipped.iter().filter(|(_, why)| *why == Skip::Unkeyed).map(|(rule, _)| (*rule, Tally::Unkeyed));
        checks.chain(unkeyed)
    }
}

/// Evaluates `checks` against `counters` at `now`.
///
/// Checks run in rule order and consume as they go. Once an enforcing rule rejects, the later
/// checks only peek (so the response can name every violated policy), and the units already
/// consumed are refunded.
pub fn evaluate(config: &Config, checks: &[Check], counters: &mut dyn Counters, now: Nanos) -> Outcome {
    let mut out = Outcome { checks: Vec::with_capacity(checks.len()), ..Outcome::default() };
    // Which checks consumed: a bit per check, with a list only past 64 checks (no allocation
    // on the request path in practice).
    let mut consumed_bits = 0u64;
    let mut consumed_more: Vec<usize> = Vec::new();
    for (i, check) in checks.iter().enumerate() {
        let Some(rule) = config.rules.get(check.rule) else {
            continue;
        };
        let peek_only = out.rejected;
        let mut decision = None;
        let res = counters.update(check, now, &mut |state, allowance| {
            let (mut d, next) = check.limit.decide(state, now, check.cost);
            let limit_denied = !d.allowed;
            if d.allowed && check.cost > allowance {
                d = Decision {
                    allowed: false,
                    remaining: d.remaining.min(allowance),
                    retry_after: Some(ALLOWANCE_RETRY),
                    ..d
                };
            }
            decision = Some(d);
            if d.allowed && !peek_only && check.cost > 0 {
                Some((next, check.cost))
            } else if limit_denied && next != *state {
                // A state moved back after a clock step: stored, so that waiting helps.
                Some((next, 0))
            } else {
                None
            }
        });
        let result = match (res, decision) {
            (Ok(()), Some(d)) => {
                if d.allowed && !peek_only && check.cost > 0 {
                    if i < 64 {
                        consumed_bits |= 1u64 << i;
                    } else {
                        consumed_more.push(i);
                    }
                }
                CheckResult::Decided(d)
            }
            (Ok(()), None) => CheckResult::Failed(StoreError::Unavailable, rule.on_store_failure),
            (Err(e), _) => CheckResult::Failed(e, rule.on_store_failure),
        };
        let co = CheckOutcome { rule: check.rule, mode: rule.mode, limit: check.limit, result };
        out.rejected |= co.rejects();
        out.checks.push(co);
    }
    if out.rejected {
        let low = (0..checks.len().min(64)).filter(|i| consumed_bits & (1u64 << i) != 0);
        for i in low.chain(consumed_more) {
            if let Some(check) = checks.get(i) {
                // A failed refund leaves the units spent: conservative, never over-admits.
                let _ = counters.refund(check, now);
            }
        }
    }
    out
}

/// Combines decisions taken independently — in parallel, one per check, each consuming when
/// it allowed (a Durable Object per counter) — into the verdict. Returns it with the indices of
/// the checks whose units must be given back because the request is rejected.
pub fn combine(config: &Config, checks: &[Check], results: &[Result<Decision, StoreError>]) -> (Outcome, Vec<usize>) {
    let mut out = Outcome { checks: Vec::with_capacity(checks.len()), ..Outcome::default() };
    let mut consumed = Vec::new();
    for (i, (check, res)) in checks.iter().zip(results).enumerate() {
        let Some(rule) = config.rules.get(check.rule) else {
            continue;
        };
        let result = match *res {
            Ok(d) => {
                if d.allowed && check.cost > 0 {
                    consumed.push(i);
                }
                CheckResult::Decided(d)
            }
            Err(e) => CheckResult::Failed(e, rule.on_store_failure),
        };
        let co = CheckOutcome { rule: check.rule, mode: rule.mode, limit: check.limit, result };
        out.rejected |= co.rejects();
        out.checks.push(co);
    }
    if !out.rejected {
        consumed.clear();
    }
    (out, consumed)
}

/// Counters in a plain in-memory map: for tests and single-process tools. Unbounded: every
/// key stays, so never use it for untrusted traffic.
#[derive(Clone, Debug, Default)]
pub struct MemoryCounters(alloc::collections::BTreeMap<Vec<u8>, State>);

impl MemoryCounters {
    /// The state stored for a key (fresh when none).
    pub fn get(&self, key: &[u8]) -> State {
        self.0.get(key).cloned().unwrap_or_default()
    }
}

impl Counters for MemoryCounters {
    fn update(
        &mut self,
        check: &Check,
        _now: Nanos,
        f: &mut dyn FnMut(&State, u64) -> Write,
    ) -> Result<(), StoreError> {
        let s = self.get(&check.key);
        if let Some((n, _)) = f(&s, u64::MAX) {
            self.0.insert(check.key.clone(), n);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::MemoryCounters as MapCounters;

    fn config(rules: &str) -> Config {
        Config::parse(
            alloc::format!(
                r#"{{"identity":{{"user":{{"header":"x-user-id"}},"plan":{{"header":"x-plan"}}}},"rules":[{rules}]}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    fn user_headers<'a>(c: &Config, user: &'a [u8]) -> Vec<Option<&'a [u8]>> {
        c.identity.headers.iter().map(|(d, _)| (d == "user").then_some(user)).collect()
    }

    fn run(c: &Config, m: &mut MapCounters, user: &[u8], now: Nanos) -> Outcome {
        let headers = user_headers(c, user);
        let req = Request { method: "GET", path: "/a", headers: &headers, ip: None };
        let (checks, skipped) = c.checks(&req);
        let mut o = evaluate(c, &checks, m, now);
        o.skipped = skipped;
        o
    }

    #[test]
    fn a_rejected_request_charges_no_other_rule() {
        let c = config(
            r#"{"name":"roomy","key":["user"],"limit":{"requests":3,"per":"1m"}},
               {"name":"tight","key":["user"],"limit":{"requests":1,"per":"1m"}}"#,
        );
        let mut m = MapCounters::default();
        assert!(!run(&c, &mut m, b"u", 0).rejected);
        for _ in 0..5 {
            assert!(run(&c, &mut m, b"u", 1).rejected);
        }
        // "roomy" was charged once, by the one admitted request: two units are left.
        let headers = user_headers(&c, b"u");
        let (checks, _) = c.checks(&Request { method: "GET", path: "/a", headers: &headers, ip: None });
        let (d, _) = c.rules[0].limit.decide(&m.get(&checks[0].key), 2, 0);
        assert_eq!(d.remaining, 2);
    }

    #[test]
    fn refunds_reach_every_rule_past_sixty_four() {
        // 70 roomy rules then a tight one: a rejection refunds all 70 (the first 64 are
        // tracked in a bit set, the rest in a list).
        let roomy: Vec<alloc::string::String> = (0..70)
            .map(|i| alloc::format!(r#"{{"name":"r{i}","key":["user"],"limit":{{"requests":2,"per":"1m"}}}}"#))
            .collect();
        let c = config(&alloc::format!(
            r#"{},{{"name":"tight","key":["user"],"limit":{{"requests":1,"per":"1m"}}}}"#,
            roomy.join(",")
        ));
        let mut m = MapCounters::default();
        assert!(!run(&c, &mut m, b"u", 0).rejected);
        for _ in 0..3 {
            assert!(run(&c, &mut m, b"u", 1).rejected);
        }
        let headers = user_headers(&c, b"u");
        let (checks, _) = c.checks(&Request { method: "GET", path: "/a", headers: &headers, ip: None });
        for (i, check) in checks.iter().take(70).enumerate() {
            let (d, _) = check.limit.decide(&m.get(&check.key), 2, 0);
            assert_eq!(d.remaining, 1, "rule r{i} kept a unit of a rejected request");
        }
    }

    #[test]
    fn shadow_rules_report_but_never_reject() {
        let c = config(r#"{"name":"s","key":["user"],"mode":"shadow","limit":{"requests":1,"per":"1m"}}"#);
        let mut m = MapCounters::default();
        assert!(!run(&c, &mut m, b"u", 0).rejected);
        let o = run(&c, &mut m, b"u", 0);
        assert!(!o.rejected);
        assert!(o.checks[0].would_reject());
    }

    #[test]
    fn combined_parallel_decisions_refund_what_a_rejected_request_took() {
        let c = config(
            r#"{"name":"a","key":["user"],"limit":{"requests":3,"per":"1m"}},
               {"name":"b","key":["user"],"mode":"shadow","limit":{"requests":3,"per":"1m"}},
               {"name":"c","key":["user"],"on_store_failure":"closed","limit":{"requests":1,"per":"1m"}}"#,
        );
        let headers = user_headers(&c, b"u");
        let (checks, _) = c.checks(&Request { method: "GET", path: "/a", headers: &headers, ip: None });
        let ok = Decision { allowed: true, limit: 3, remaining: 2, reset_after: 1, retry_after: None };
        let no = Decision { allowed: false, limit: 1, remaining: 0, reset_after: 1, retry_after: Some(1) };
        let (o, refunds) = combine(&c, &checks, &[Ok(ok), Ok(ok), Ok(ok)]);
        assert!(!o.rejected);
        assert!(refunds.is_empty(), "an admitted request keeps what it took");
        let (o, refunds) = combine(&c, &checks, &[Ok(ok), Ok(ok), Ok(no)]);
        assert!(o.rejected);
        assert_eq!(refunds, [0, 1], "the rules that allowed give their units back");
        let (o, refunds) = combine(&c, &checks, &[Ok(ok), Ok(no), Err(StoreError::Unavailable)]);
        assert!(o.rejected, "a closed rule whose store failed rejects");
        assert_eq!(refunds, [0]);
        let (o, _) = combine(&c, &checks, &[Ok(ok), Ok(no), Ok(ok)]);
        assert!(!o.rejected, "a shadow rule never rejects");
        assert!(o.checks[1].would_reject());
    }

    /// Counters with a fixed allowance, as a synced store grants.
    struct Allowance(MapCounters, u64);

    impl Counters for Allowance {
        fn update(
            &mut self,
            check: &Check,
            now: Nanos,
            f: &mut dyn FnMut(&State, u64) -> Write,
        ) -> Result<(), StoreError> {
            let allowance = self.1;
            let mut charged = 0;
            let r = self.0.update(check, now, &mut |s, _| {
                let next = f(s, allowance);
                charged = next.as_ref().map_or(0, |(_, c)| *c);
                next
            });
            self.1 = self.1.saturating_sub(charged);
            r
        }
    }

    #[test]
    fn an_allowance_caps_what_the_limit_would_admit() {
        let c = config(r#"{"name":"r","key":["user"],"limit":{"requests":100,"per":"1m"}}"#);
        let headers = user_headers(&c, b"u");
        let (checks, _) = c.checks(&Request { method: "GET", path: "/a", headers: &headers, ip: None });
        let mut counters = Allowance(MapCounters::default(), 2);
        assert!(!evaluate(&c, &checks, &mut counters, 0).rejected);
        assert!(!evaluate(&c, &checks, &mut counters, 0).rejected);
        let o = evaluate(&c, &checks, &mut counters, 0);
        assert!(o.rejected, "the limit has room, the grant does not");
        match o.checks[0].result {
            CheckResult::Decided(d) => {
                assert_eq!((d.remaining, d.retry_after), (0, Some(ALLOWANCE_RETRY)));
            }
            other => panic!("{other:?}"),
        }
    }

    fn key_of(c: &Config, user: &[u8], plan: Option<&[u8]>) -> Vec<u8> {
        let headers: Vec<Option<&[u8]>> = c
            .identity
            .headers
            .iter()
            .map(|(d, _)| match d.as_str() {
                "user" => Some(user),
                "plan" => plan,
                _ => None,
            })
            .collect();
        let (checks, _) = c.checks(&Request { method: "GET", path: "/a", headers: &headers, ip: None });
        checks[0].key.clone()
    }

    #[test]
    fn key_parts_of_every_length_are_distinct() {
        let c = config(r#"{"name":"r","key":["user"],"limit":{"requests":1,"per":"1m"}}"#);
        let mut seen = alloc::collections::BTreeSet::new();
        for n in 250..262 {
            for b in [b'a', 0xff, 0] {
                let part = alloc::vec![b; n];
                assert!(seen.insert(key_of(&c, &part, None)), "{n} bytes of {b:#x} share a key");
            }
        }
        // Part lengths 254 and below are written as they are, longer ones as a hash.
        assert_eq!(key_of(&c, &[b'a'; 254], None).len(), 1 + 2 + 8 + 1 + 254);
        assert_eq!(key_of(&c, &[b'a'; 255], None).len(), 1 + 2 + 8 + 1 + 8);
        assert_eq!(key_of(&c, b"u", None)[0], KEY_VERSION);
    }

    #[test]
    fn each_limit_of_a_rule_is_its_own_counter() {
        let c = config(
            r#"{"name":"r","key":["user"],"limit":{"requests":2,"per":"1m"},
                "plans":{"gold":{"requests":30,"per":"1s"}}}"#,
        );
        // A plan and the default never share a counter: a client whose plan lapses is not
        // judged by the state its old plan wrote.
        assert_ne!(key_of(&c, b"u", Some(b"gold")), key_of(&c, b"u", None));
        // A push that changes the limit starts the rule's counters fresh; the same limit
        // pushed again keeps them.
        let pushed = config(r#"{"name":"r","key":["user"],"limit":{"requests":2,"per":"1h"}}"#);
        let same = config(r#"{"name":"r","key":["user"],"limit":{"requests":2,"per":"60s"}}"#);
        assert_ne!(key_of(&pushed, b"u", None), key_of(&c, b"u", None));
        assert_eq!(key_of(&same, b"u", None), key_of(&c, b"u", None));
    }

    #[test]
    fn whitespace_around_a_header_value_is_not_part_of_it() {
        let c = config(
            r#"{"name":"r","key":["user"],"limit":{"requests":2,"per":"1m"},
                "plans":{"gold":{"requests":30,"per":"1s"}}}"#,
        );
        // One client's counter however its value is padded (the Worker's runtime passes the
        // whitespace on: `alice ` had a fresh counter there), and its plan too.
        let plain = key_of(&c, b"alice", Some(b"gold"));
        assert_eq!(key_of(&c, b" alice \t", Some(b"gold\t")), plain);
        assert_ne!(key_of(&c, b"alice", None), plain);
        // Whitespace alone is no value: the rule does not count the request.
        let mut m = MapCounters::default();
        assert_eq!(run(&c, &mut m, b" \t ", 0).skipped, alloc::vec![(0, Skip::Unkeyed)]);
    }

    #[test]
    fn missing_dimension_skips_the_rule() {
        let c = config(r#"{"name":"s","key":["user"],"limit":{"requests":1,"per":"1m"}}"#);
        let mut m = MapCounters::default();
        for _ in 0..3 {
            let o = run(&c, &mut m, b"", 0);
            assert!(!o.rejected);
            assert_eq!(o.skipped, [(0, Skip::Unkeyed)]);
        }
    }
}
