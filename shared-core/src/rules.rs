//! The rules document (docs/rules.md) parsed and validated once into typed rules.
//!
//! Parsing is total: any input yields a [`Config`] or a [`ConfigError`] naming the field path
//! and the reason (`rules[2].limit.per: "6O s" is not a duration`), never a panic.

use crate::algo::{Algorithm, Limit, LimitError, Nanos, MAX_PER, MAX_REQUESTS};
use crate::glob::PathPattern;
use crate::json::{Map, Value};
pub use crate::key::IpSource;
use alloc::borrow::ToOwned;
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;

/// A rejected rules document: the field path and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// Where in the document, e.g. `rules[2].limit.per`; empty for the document itself.
    pub path: String,
    /// What is wrong there.
    pub reason: String,
}

impl core::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.reason)
        } else {
            write!(f, "{}: {}", self.path, self.reason)
        }
    }
}

impl core::error::Error for ConfigError {}

/// A value of the document as a message shows it: in quotes, control characters, quotes and
/// backslashes escaped (a message is one line a terminal shows as it is), and cut after 64
/// characters.
fn quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len().min(80) + 2);
    out.push('"');
    for (i, c) in s.chars().enumerate() {
        if i == 64 {
            out.push('…');
            break;
        }
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            c if c.is_control() => out.extend(c.escape_unicode()),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Why a rule's name is refused beside another's.
const USED: &str = "is used by another rule (names are compared in lowercase, with - and . as _, as metrics show them)";

/// A rule's name as metrics show it: `[a-z0-9_]`, every other character `_`.
pub fn metric_form(name: &str) -> String {
    name.chars().map(metric_char).collect()
}

fn same_metric_name(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.chars().zip(b.chars()).all(|(x, y)| metric_char(x) == metric_char(y))
}

fn metric_char(c: char) -> char {
    if c.is_ascii_alphanumeric() {
        c.to_ascii_lowercase()
    } else {
        '_'
    }
}

fn err<T>(path: &str, reason: impl Into<String>) -> Result<T, ConfigError> {
    // A path names the document's own keys (an unknown field, a plan): shown as `quoted` shows
    // values, without the quotes, when it has a character a terminal would act on.
    let path = if path.chars().any(char::is_control) || path.len() > 256 {
        let q = quoted(path);
        q.trim_matches('"').to_owned()
    } else {
        path.to_owned()
    };
    Err(ConfigError { path, reason: reason.into() })
}

/// A whole validated rules document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Where identity dimensions come from.
    pub identity: Identity,
    /// The rules, in document order.
    pub rules: Vec<Rule>,
    /// Response options.
    pub response: ResponseOptions,
    /// Options for the proxy-wasm filter (ignored by the Worker).
    pub filter: FilterOptions,
    /// Where the filter syncs its deltas (none: each proxy limits on its own).
    pub sync: Option<SyncOptions>,
}

/// Where each identity dimension is read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Header-sourced dimensions: (dimension name, lower-case header name).
    pub headers: Vec<(String, String)>,
    /// How the client IP is found.
    pub ip: IpSource,
    /// Which of [`Identity::headers`] are secret (same order): their values are counted and
    /// shown only as a keyed hash (`api_key` is secret unless it says `"secret": false`).
    pub secret: Vec<bool>,
    /// Whether the client IP is secret.
    pub ip_secret: bool,
    /// The key of the hash secret values are counted and shown by ([`crate::key::HashKey`]).
    pub hash_key: crate::key::HashKey,
    /// Where [`Identity::hash_key`] came from.
    pub hash_key_source: HashKeySource,
}

/// Where the key that hashes secret identity values comes from: the same on every node of a
/// deployment, so each node counts and shows a value under the same hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashKeySource {
    /// `identity.hash_key`.
    HashKey,
    /// Derived from `sync.secret`.
    SyncSecret,
    /// Neither is set: a key built into ratewall, which anyone can hash guesses under.
    BuiltIn,
}

impl Identity {
    /// Hashes secret values under a key derived from a deployment's shared `secret` (a
    /// filter's `sync.secret`, a Worker's `RATEWALL_SYNC_SECRET`), unless the document set
    /// `identity.hash_key`, or `secret` is empty: every node given the same secret then
    /// shows and counts a value under the same hash.
    pub fn key_by_secret(&mut self, secret: &str) {
        if self.hash_key_source == HashKeySource::BuiltIn && !secret.is_empty() {
            self.hash_key = crate::key::HashKey::derive(secret.as_bytes());
            self.hash_key_source = HashKeySource::SyncSecret;
        }
    }

    /// The index in [`Identity::headers`] of a header dimension.
    pub fn header_index(&self, dimension: &str) -> Option<usize> {
        self.headers.iter().position(|(d, _)| d == dimension)
    }

    /// Whether a dimension's values are secret.
    pub fn is_secret(&self, dim: Dimension) -> bool {
        match dim {
            Dimension::Ip => self.ip_secret,
            Dimension::Header(i) => self.secret.get(i).copied().unwrap_or(true),
        }
    }

    /// A dimension's name (`ip`, or the header dimension's).
    pub fn name(&self, dim: Dimension) -> &str {
        match dim {
            Dimension::Ip => "ip",
            Dimension::Header(i) => self.headers.get(i).map_or("?", |(n, _)| n.as_str()),
        }
    }
}

/// One identity dimension a rule keys on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dimension {
    /// A header source, by index into [`Identity::headers`].
    Header(usize),
    /// The client IP.
    Ip,
}

/// Whether a rule rejects or only reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Rejects requests over the limit.
    Enforce,
    /// Counts and reports "would reject", never rejects.
    Shadow,
}

/// What a rule does when its counter store is unreachable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Keep serving, degraded to a local limit.
    Open,
    /// Reject.
    Closed,
}

/// The limit that applies to a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanLimit {
    /// A limit of its own.
    Limited(Limit),
    /// Not limited by this rule.
    Unlimited,
}

/// Which requests a rule applies to.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Matcher {
    /// Path pattern; `None` matches every path.
    pub path: Option<PathPattern>,
    /// Upper-case methods; empty matches every method.
    pub methods: Vec<String>,
}

impl Matcher {
    /// Whether a request with this method and normalized path matches.
    pub fn matches(&self, method: &str, normalized_path: &str) -> bool {
        (self.methods.is_empty() || self.methods.iter().any(|m| m.eq_ignore_ascii_case(method)))
            && self.path.as_ref().is_none_or(|p| p.matches(normalized_path))
    }
}

/// One validated rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Unique name: `[A-Za-z0-9_.-]{1,64}`, safe in headers and metric names.
    pub name: String,
    /// Which requests it applies to.
    pub matcher: Matcher,
    /// The identity dimensions of its key (a composite key when several).
    pub key: Vec<Dimension>,
    /// The default limit.
    pub limit: Limit,
    /// Per-plan overrides: (plan name, limit), in document order (at most [`MAX_PLANS`]).
    pub plans: Vec<(String, PlanLimit)>,
    /// Units one matching request consumes.
    pub cost: u64,
    /// Enforce or shadow.
    pub mode: Mode,
    /// What happens when the store fails.
    pub on_store_failure: FailurePolicy,
    /// Every request is decided by the global counter itself (the Cloudflare Worker asks the
    /// key's Durable Object each time) instead of spending a grant held locally. Default:
    /// true for `on_store_failure: "closed"` rules, false otherwise.
    pub exact: bool,
    /// Its `RateLimit-Policy` item under the default limit, rendered once.
    pub policy_item: String,
}

impl Rule {
    /// The limit for a request on `plan` (the default when the plan has no override).
    pub fn limit_for(&self, plan: Option<&[u8]>) -> PlanLimit {
        plan.and_then(|p| self.plans.iter().find(|(name, _)| name.as_bytes() == p))
            .map_or(PlanLimit::Limited(self.limit), |(_, l)| *l)
    }
}

/// Response options.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ResponseOptions {
    /// Also send `X-RateLimit-Limit/Remaining/Reset`.
    pub legacy_headers: bool,
}

/// Options of the proxy-wasm filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FilterOptions {
    /// Tracked (rule, key) entries in the node's fixed-size shared-data table.
    pub slots: u32,
    /// Compare-and-swap attempts per counter before the failure policy applies.
    pub cas_retries: u32,
    /// Secret that keys the table's hash, so clients cannot aim at one bucket.
    pub hash_seed: u64,
}

impl Default for FilterOptions {
    fn default() -> Self {
        FilterOptions { slots: 65_536, cas_retries: 32, hash_seed: 0 }
    }
}

/// How a proxy-wasm filter node syncs with the global store (docs/sync-protocol.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncOptions {
    /// The upstream the store is reached through: an Envoy cluster name, or under NGINX
    /// (ngx_wasm_module) the store's `host:port` (an IP, or a name its resolver finds). A
    /// value with a `:` is a `host:port` ([`check_cluster`]).
    pub cluster: String,
    /// The `:authority` of sync requests (default: the cluster name).
    pub authority: String,
    /// The store's path (default `/v1/sync`).
    pub path: String,
    /// The shared HMAC secret (never logged).
    pub secret: String,
    /// Time between batches (default 100 ms).
    pub interval: Nanos,
    /// Deadline of one sync call (default 50 ms).
    pub timeout: Nanos,
    /// Nodes assumed before the store has reported how many there are (default 1).
    pub nodes: u32,
    /// Global data older than this is stale: rules degrade to their failure policy
    /// (default 1 s).
    pub stale_after: Nanos,
    /// The longest a request waits, paused, for an ask to the store (default: `timeout`).
    /// Past it the request gets the decision it would have got without the ask, and the VM
    /// stops asking for a while (docs/sync-protocol.md).
    pub max_wait: Nanos,
}

fn duration_field(v: &Value, path: &str, min: Nanos, max: Nanos) -> Result<Nanos, ConfigError> {
    let s = string(v, path)?;
    match parse_duration(s) {
        Some(d) if (min..=max).contains(&d) => Ok(d),
        // The range, as `per`'s message states its own.
        Some(_) => err(path, format!("{} must be between {} and {}", quoted(s), written(min), written(max))),
        None => err(path, format!("{} is not a duration (like 50ms, 1s)", quoted(s))),
    }
}

/// A duration as a document writes it, in the largest unit that gives a whole number, as the
/// schema states the ranges (minutes as seconds): `10ms`, `60s`, `1h`.
fn written(d: Nanos) -> String {
    let units = [("d", 86_400_000_000_000), ("h", 3_600_000_000_000), ("s", 1_000_000_000)];
    match units.iter().find(|(_, scale)| d.is_multiple_of(*scale) && d >= *scale) {
        Some((unit, scale)) => format!("{}{unit}", d / scale),
        None => format!("{}ms", d / 1_000_000),
    }
}

/// Checks `sync.cluster`: an Envoy cluster name (no `:`, no white space or control
/// character), or — any value with a `:`, which the filter hands ngx_wasm_module as the call's
/// upstream — a `host:port` it can parse: a hostname or IPv4 address, or an IPv6 address in
/// brackets, then a port from 1 to 65535. Anything else (`https://store`, `store:80x`) would
/// fail ngx_wasm_module's URL parsing inside every sync call.
pub fn check_cluster(cluster_as_written: &str) -> Result<(), String> {
    const HOST_PORT: &str = "give an Envoy cluster name, or under NGINX the store's host:port";
    // Checked as written, shown without what a URL's `user:password@` holds: a credential.
    let cluster = without_userinfo(cluster_as_written);
    let cluster = cluster.as_str();
    if cluster != cluster_as_written {
        return Err(format!("{cluster:?} is a URL with credentials: {HOST_PORT} (no scheme, no path)"));
    }
    let Some((host, port)) = cluster.rsplit_once(':') else {
        if cluster.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(format!("{cluster:?} is no cluster name (it has white space or a control character)"));
        }
        return Ok(());
    };
    if cluster.contains("://") {
        return Err(format!("{cluster:?} is a URL: {HOST_PORT} (no scheme, no path)"));
    }
    let valid_port =
        !port.is_empty() && port.len() <= 5 && !port.starts_with('0') && port.bytes().all(|b| b.is_ascii_digit());
    if !valid_port || !port.parse::<u32>().is_ok_and(|p| (1..=65_535).contains(&p)) {
        return Err(format!("{cluster:?} has no valid port ({HOST_PORT}, the port from 1 to 65535)"));
    }
    let name = |h: &str| {
        // A fully qualified name may end with a dot.
        let h = h.strip_suffix('.').unwrap_or(h);
        !h.is_empty()
            && h.split('.').all(|label| {
                !label.is_empty()
                    && !label.starts_with('-')
                    && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            })
    };
    let v6 = |h: &str| {
        h.strip_prefix('[').and_then(|h| h.strip_suffix(']')).is_some_and(|a| {
            a.bytes().all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
                && matches!(crate::key::parse_ip(a.as_bytes()), Some(core::net::IpAddr::V6(_)))
        })
    };
    if !name(host) && !v6(host) {
        return Err(format!(
            "{cluster:?} has no valid host ({HOST_PORT}: a hostname, an IPv4 address, or an IPv6 address in brackets)"
        ));
    }
    Ok(())
}

/// `s` with a URL's user information (what comes before its host's `@`) shown as `…`.
fn without_userinfo(s: &str) -> String {
    let start = s.find("://").map_or(0, |i| i + 3);
    let host_end = s.get(start..).and_then(|r| r.find(['/', '?', '#'])).map_or(s.len(), |i| start + i);
    match s.get(start..host_end).and_then(|authority| authority.rfind('@')) {
        Some(at) => format!("{}…{}", s.get(..start).unwrap_or(""), s.get(start + at..).unwrap_or("")),
        None => s.to_owned(),
    }
}

fn parse_sync(v: &Value) -> Result<SyncOptions, ConfigError> {
    let o = object(v, "sync")?;
    known_fields(
        o,
        "sync",
        &["cluster", "authority", "path", "secret", "interval", "timeout", "nodes", "stale_after", "max_wait"],
    )?;
    let text = |name: &str| -> Result<Option<String>, ConfigError> {
        o.get(name).map(|v| string(v, &format!("sync.{name}")).map(String::from)).transpose()
    };
    let cluster = text("cluster")?.filter(|c| !c.is_empty()).ok_or_else(|| ConfigError {
        path: "sync.cluster".into(),
        reason: "is required: the upstream that reaches the store".into(),
    })?;
    check_cluster(&cluster).map_err(|reason| ConfigError { path: "sync.cluster".into(), reason })?;
    // Counted in characters, as the message and the schema's `minLength` count.
    let secret = text("secret")?.filter(|c| c.chars().count() >= 16).ok_or_else(|| ConfigError {
        path: "sync.secret".into(),
        reason: "is required and must be at least 16 characters".into(),
    })?;
    const MS: Nanos = 1_000_000;
    let interval = o.get("interval").map(|v| duration_field(v, "sync.interval", 10 * MS, 60_000 * MS)).transpose()?;
    let interval = interval.unwrap_or(100 * MS);
    let timeout = o.get("timeout").map(|v| duration_field(v, "sync.timeout", MS, 10_000 * MS)).transpose()?;
    let stale =
        o.get("stale_after").map(|v| duration_field(v, "sync.stale_after", 10 * MS, 3_600_000 * MS)).transpose()?;
    let nodes = o.get("nodes").map(|v| bounded(v, "sync.nodes", 1, 100_000)).transpose()?;
    let max_wait = o.get("max_wait").map(|v| duration_field(v, "sync.max_wait", MS, 10_000 * MS)).transpose()?;
    let timeout = timeout.unwrap_or(50 * MS);
    let path = text("path")?.unwrap_or_else(|| "/v1/sync".into());
    if !path.starts_with('/') {
        return err("sync.path", format!("{} must start with /", quoted(&path)));
    }
    // Both go into the sync requests' pseudo-headers as they are: visible ASCII only (a space,
    // a line break or a control would make a request the proxy refuses, or another header).
    let visible = |v: &str| !v.is_empty() && v.bytes().all(|b| b.is_ascii_graphic());
    if !visible(&path) {
        return err("sync.path", format!("{} must be visible ASCII, without spaces", quoted(&path)));
    }
    let authority = text("authority")?.unwrap_or_else(|| cluster.clone());
    if !visible(&authority) {
        return err("sync.authority", format!("{} must be a host (visible ASCII, without spaces)", quoted(&authority)));
    }
    Ok(SyncOptions {
        authority,
        path,
        cluster,
        secret,
        interval,
        timeout,
        nodes: nodes.map_or(1, |n| n as u32),
        stale_after: stale.unwrap_or(1000 * MS),
        max_wait: max_wait.unwrap_or(timeout),
    })
}

/// Largest table the filter accepts (entries): 131,072 shared-data keys, all created when
/// the rules load (2^24 was accepted before, and creating its 2 M keys never finished).
pub const MAX_SLOTS: u32 = 1 << 20;
/// Largest rules document accepted, in bytes (parsing is linear; this bounds its cost).
pub const MAX_DOCUMENT: usize = 1 << 20;
/// Most rules in a document.
pub const MAX_RULES: usize = 1_000;
/// Most plans one rule may name.
pub const MAX_PLANS: usize = 1_000;
/// Most header identity dimensions (each is a header every request is searched for); `ip`
/// comes on top.
pub const MAX_DIMENSIONS: usize = 64;
/// Most methods one rule may list.
pub const MAX_METHODS: usize = 32;

impl Config {
    /// Parses and validates a rules document.
    pub fn parse(json: &[u8]) -> Result<Config, ConfigError> {
        if json.len() > MAX_DOCUMENT {
            return too_many("", json.len(), "bytes", MAX_DOCUMENT);
        }
        // A UTF-8 byte order mark, as some editors write first, is no part of the document.
        let json = json.strip_prefix(b"\xef\xbb\xbf").unwrap_or(json);
        let value = match crate::json::parse(json) {
            Ok(v) => v,
            // Valid JSON, but a document that means two things to two readers.
            Err(e) if e.key.is_some() => {
                return err(&e.key_path(), format!("{e} (a key may appear once in an object)"));
            }
            Err(e) => return err("", format!("not valid JSON: {e}")),
        };
        Config::from_value(&value)
    }

    /// Validates an already-parsed JSON document.
    pub fn from_value(doc: &Value) -> Result<Config, ConfigError> {
        let top = object(doc, "")?;
        known_fields(top, "", &["$schema", "identity", "rules", "response", "filter", "sync"])?;
        // `$schema` names the document's JSON Schema for editors; it is not a setting, and
        // its value is not read, but it is a string, as the schema says.
        if let Some(v) = top.get("$schema") {
            string(v, "$schema")?;
        }
        let identity = parse_identity(top.get("identity"))?;
        let rules_v = match top.get("rules") {
            Some(Value::Array(a)) => a,
            Some(_) => return err("rules", "must be an array of rules"),
            None => return err("rules", "is required"),
        };
        if rules_v.len() > MAX_RULES {
            return too_many("rules", rules_v.len(), "rules", MAX_RULES);
        }
        let mut rules: Vec<Rule> = Vec::with_capacity(rules_v.len());
        for (i, r) in rules_v.iter().enumerate() {
            let path = format!("rules[{i}]");
            let rule = parse_rule(r, &path, &identity)?;
            // A scan while there are few rules; past that, one sorted check below.
            // Names are told apart as metrics name them (`x-y` and `X_y` are one name).
            if rules.len() < 16 && rules.iter().any(|o| same_metric_name(&o.name, &rule.name)) {
                return err(&format!("{path}.name"), format!("{} {USED}", quoted(&rule.name)));
            }
            rules.push(rule);
        }
        let forms: Vec<String> =
            if rules.len() > 16 { rules.iter().map(|r| metric_form(&r.name)).collect() } else { Vec::new() };
        let names: Vec<&str> = forms.iter().map(String::as_str).collect();
        if let Some(i) = crate::json::first_repeat(&names) {
            let name = rules.get(i).map_or("", |r| r.name.as_str());
            return err(&format!("rules[{i}].name"), format!("{} {USED}", quoted(name)));
        }
        let mut response = ResponseOptions::default();
        if let Some(v) = top.get("response") {
            let o = object(v, "response")?;
            known_fields(o, "response", &["legacy_headers"])?;
            if let Some(b) = o.get("legacy_headers") {
                response.legacy_headers = boolean(b, "response.legacy_headers")?;
            }
        }
        let mut filter = FilterOptions::default();
        if let Some(v) = top.get("filter") {
            let o = object(v, "filter")?;
            known_fields(o, "filter", &["slots", "cas_retries", "hash_seed"])?;
            if let Some(v) = o.get("slots") {
                filter.slots = bounded(v, "filter.slots", 64, u64::from(MAX_SLOTS))? as u32;
            }
            if let Some(v) = o.get("cas_retries") {
                filter.cas_retries = bounded(v, "filter.cas_retries", 1, 1000)? as u32;
            }
            if let Some(v) = o.get("hash_seed") {
                filter.hash_seed = match v {
                    Value::String(s) => crate::hash::fnv1a(s.as_bytes()),
                    // A secret (docs/rules.md): its value is not shown, not even when refused.
                    Value::Number(_) => v.as_whole().ok_or_else(|| ConfigError {
                        path: "filter.hash_seed".into(),
                        reason: format!(
                            "must be a string or a whole number from 0 to {} (its value is not shown)",
                            u64::MAX
                        ),
                    })?,
                    _ => return err("filter.hash_seed", "must be a string or an integer"),
                };
            }
        }
        let sync = top.get("sync").map(parse_sync).transpose()?;
        let mut identity = identity;
        if let Some(s) = &sync {
            identity.key_by_secret(&s.secret);
        }
        Ok(Config { identity, rules, response, filter, sync })
    }
}

/// A document (or part) larger than what the filter can build within its budget.
fn too_many<T>(path: &str, n: usize, what: &str, max: usize) -> Result<T, ConfigError> {
    err(path, format!("has {n} {what}; at most {max} are accepted"))
}

fn object<'a>(v: &'a Value, path: &str) -> Result<&'a Map, ConfigError> {
    match v {
        Value::Object(m) => Ok(m),
        other => err(path, format!("must be an object, not {}", kind(other))),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_owned()
    } else {
        format!("{path}.{field}")
    }
}

fn known_fields(m: &Map, path: &str, known: &[&str]) -> Result<(), ConfigError> {
    for k in m.keys() {
        if !known.contains(&k.as_str()) {
            return err(&join(path, k), format!("unknown field (expected one of: {})", known.join(", ")));
        }
    }
    Ok(())
}

fn string<'a>(v: &'a Value, path: &str) -> Result<&'a str, ConfigError> {
    match v {
        Value::String(s) => Ok(s),
        other => err(path, format!("must be a string, not {}", kind(other))),
    }
}

fn boolean(v: &Value, path: &str) -> Result<bool, ConfigError> {
    match v {
        Value::Bool(b) => Ok(*b),
        other => err(path, format!("must be true or false, not {}", kind(other))),
    }
}

fn bounded(v: &Value, path: &str, min: u64, max: u64) -> Result<u64, ConfigError> {
    // `5.0` and `1e3` are whole numbers, as the schema's `"type": "integer"` takes them.
    match v.as_whole() {
        Some(n) if (min..=max).contains(&n) => Ok(n),
        Some(n) => err(path, format!("{n} is out of range ({min} to {max})")),
        None => err(path, format!("must be a whole number from {min} to {max}, not {}", shown(v))),
    }
}

/// A value as a message shows it: its JSON text, cut after 64 characters (a number of half a
/// million digits is not copied into the line).
fn shown(v: &Value) -> String {
    let text = alloc::format!("{v}");
    match text.char_indices().nth(64) {
        Some((at, _)) => alloc::format!("{}…", text.get(..at).unwrap_or_default()),
        None => text,
    }
}

/// Parses a duration string: a whole number and a unit of `ms`, `s`, `m`, `h` or `d`. One
/// written well but too long for nanoseconds reads as the longest (`u64::MAX`), so a range
/// check says it is out of range rather than no duration.
pub fn parse_duration(s: &str) -> Option<Nanos> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    let (num, unit) = s.split_at(digits);
    if num.is_empty() {
        return None;
    }
    let scale: u64 = match unit {
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        "d" => 86_400_000_000_000,
        _ => return None,
    };
    Some(num.parse::<u64>().unwrap_or(u64::MAX).saturating_mul(scale))
}

const DEFAULT_HEADERS: [(&str, &str); 4] =
    [("user", "x-user-id"), ("api_key", "x-api-key"), ("partner", "x-partner-id"), ("plan", "x-plan")];

/// Whether a dimension is secret when its source does not say: `api_key` is.
fn secret_by_default(dim: &str) -> bool {
    dim == "api_key"
}

/// Shortest `identity.hash_key` accepted.
pub const MIN_HASH_KEY: usize = 16;

fn parse_identity(v: Option<&Value>) -> Result<Identity, ConfigError> {
    let mut ip = IpSource { trusted_hops: 0, ipv6_prefix: 64, ipv4_prefix: 32 };
    let builtin = crate::key::HashKey::derive(b"");
    let Some(v) = v else {
        let headers: Vec<(String, String)> =
            DEFAULT_HEADERS.iter().map(|(d, h)| ((*d).to_owned(), (*h).to_owned())).collect();
        let secret = headers.iter().map(|(d, _)| secret_by_default(d)).collect();
        return Ok(Identity {
            headers,
            ip,
            secret,
            ip_secret: false,
            hash_key: builtin,
            hash_key_source: HashKeySource::BuiltIn,
        });
    };
    let m = object(v, "identity")?;
    // `hash_key` is the hashes' key and `ip` the client address: every other member is a
    // header dimension.
    let headers_n = m.len() - usize::from(m.get("hash_key").is_some()) - usize::from(m.get("ip").is_some());
    if headers_n > MAX_DIMENSIONS {
        return too_many("identity", headers_n, "header dimensions", MAX_DIMENSIONS);
    }
    let (mut headers, mut secret, mut ip_secret) = (Vec::new(), Vec::new(), false);
    let (mut hash_key, mut hash_key_source) = (builtin, HashKeySource::BuiltIn);
    for (dim, src) in m {
        let path = format!("identity.{dim}");
        if dim == "hash_key" {
            // Never a dimension: a `hash_key` of another type is a mistake, not a header source.
            let k = string(src, &path)?;
            // Counted in characters, as the message and the schema's `minLength` count.
            if k.chars().count() < MIN_HASH_KEY {
                return err(&path, format!("must be at least {MIN_HASH_KEY} characters"));
            }
            hash_key = crate::key::HashKey::derive(k.as_bytes());
            hash_key_source = HashKeySource::HashKey;
            continue;
        }
        let secret_field = |o: &Map| o.get("secret").map(|b| boolean(b, &format!("{path}.secret"))).transpose();
        if dim == "ip" {
            let o = object(src, &path)?;
            known_fields(o, &path, &["trusted_hops", "ipv6_prefix", "ipv4_prefix", "secret"])?;
            ip_secret = secret_field(o)?.unwrap_or(false);
            if let Some(h) = o.get("trusted_hops") {
                ip.trusted_hops = bounded(h, &format!("{path}.trusted_hops"), 0, 16)? as u8;
            }
            if let Some(p) = o.get("ipv6_prefix") {
                ip.ipv6_prefix = bounded(p, &format!("{path}.ipv6_prefix"), 1, 128)? as u8;
            }
            if let Some(p) = o.get("ipv4_prefix") {
                ip.ipv4_prefix = bounded(p, &format!("{path}.ipv4_prefix"), 1, 32)? as u8;
            }
            continue;
        }
        if !valid_name(dim) {
            return err(&path, "dimension names use only A-Z a-z 0-9 _ . - (1 to 64 characters)");
        }
        let o = object(src, &path)?;
        known_fields(o, &path, &["header", "secret"])?;
        secret.push(secret_field(o)?.unwrap_or_else(|| secret_by_default(dim)));
        let header = match o.get("header") {
            Some(h) => string(h, &format!("{path}.header"))?,
            None => return err(&format!("{path}.header"), "is required"),
        };
        if header.is_empty() || !header.bytes().all(is_token_char) {
            return err(&format!("{path}.header"), format!("{} is not a valid header name", quoted(header)));
        }
        headers.push((dim.clone(), header.to_ascii_lowercase()));
    }
    Ok(Identity { headers, ip, secret, ip_secret, hash_key, hash_key_source })
}

fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn valid_name(s: &str) -> bool {
    (1..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
}

/// The fields a rule may have.
pub const RULE_FIELDS: [&str; 11] =
    ["name", "match", "key", "limit", "plans", "algorithm", "cost", "mode", "on_store_failure", "exact", "description"];

fn parse_rule(v: &Value, path: &str, identity: &Identity) -> Result<Rule, ConfigError> {
    let m = object(v, path)?;
    known_fields(m, path, &RULE_FIELDS)?;
    let name = match m.get("name") {
        Some(n) => string(n, &join(path, "name"))?,
        None => return err(&join(path, "name"), "is required"),
    };
    if !valid_name(name) {
        return err(&join(path, "name"), format!("{} must be 1 to 64 of A-Z a-z 0-9 _ . -", quoted(name)));
    }
    let matcher = match m.get("match") {
        None => Matcher::default(),
        Some(v) => parse_match(v, &join(path, "match"))?,
    };
    let key_path = join(path, "key");
    let key = match m.get("key") {
        Some(Value::Array(dims)) if !dims.is_empty() => {
            let mut key = Vec::with_capacity(dims.len());
            for (i, d) in dims.iter().enumerate() {
                let p = format!("{key_path}[{i}]");
                let d = string(d, &p)?;
                let dim = if d == "ip" {
                    Dimension::Ip
                } else {
                    match identity.header_index(d) {
                        Some(i) => Dimension::Header(i),
                        None => return err(&p, format!("{} is not a dimension defined under identity", quoted(d))),
                    }
                };
                if key.contains(&dim) {
                    return err(&p, format!("{} appears twice", quoted(d)));
                }
                key.push(dim);
            }
            key
        }
        Some(_) => return err(&key_path, "must be a non-empty array of identity dimensions"),
        None => return err(&key_path, "is required"),
    };
    let algorithm = m.get("algorithm").map(|a| parse_algorithm(a, &join(path, "algorithm"))).transpose()?;
    let limit = match m.get("limit") {
        Some(l) => parse_limit(l, &join(path, "limit"), algorithm)?,
        None => return err(&join(path, "limit"), "is required"),
    };
    let mut plans = Vec::new();
    if let Some(p) = m.get("plans") {
        let pp = join(path, "plans");
        if identity.header_index("plan").is_none() {
            return err(&pp, "needs a \"plan\" dimension under identity");
        }
        let o = object(p, &pp)?;
        if o.len() > MAX_PLANS {
            return too_many(&pp, o.len(), "plans", MAX_PLANS);
        }
        for (plan, l) in o {
            let lp = format!("{pp}.{plan}");
            let pl = match l {
                Value::String(s) if s == "unlimited" => PlanLimit::Unlimited,
                Value::Object(_) => PlanLimit::Limited(parse_limit(l, &lp, algorithm)?),
                _ => return err(&lp, "must be a limit object or \"unlimited\""),
            };
            plans.push((plan.clone(), pl));
        }
    }
    let cost = match m.get("cost") {
        None => 1,
        Some(c) => bounded(c, &join(path, "cost"), 0, MAX_REQUESTS)?,
    };
    // Each limit in force, named as the message says it: the rule's own, or a plan's.
    let limits = core::iter::once((None, limit)).chain(plans.iter().filter_map(|(plan, l)| match l {
        PlanLimit::Limited(l) => Some((Some(plan), *l)),
        PlanLimit::Unlimited => None,
    }));
    for (plan, l) in limits {
        if cost > l.capacity() {
            let whose = match plan {
                None => String::from("the rule's limit"),
                Some(p) => format!("plan {}'s limit", quoted(p)),
            };
            return err(&join(path, "cost"), format!("{cost} exceeds {whose}, of capacity {}", l.capacity()));
        }
    }
    let mode = match m.get("mode") {
        None => Mode::Enforce,
        Some(v) => match string(v, &join(path, "mode"))? {
            "enforce" => Mode::Enforce,
            "shadow" => Mode::Shadow,
            s => return err(&join(path, "mode"), format!("{} is not \"enforce\" or \"shadow\"", quoted(s))),
        },
    };
    let on_store_failure = match m.get("on_store_failure") {
        None => FailurePolicy::Open,
        Some(v) => match string(v, &join(path, "on_store_failure"))? {
            "open" => FailurePolicy::Open,
            "closed" => FailurePolicy::Closed,
            s => return err(&join(path, "on_store_failure"), format!("{} is not \"open\" or \"closed\"", quoted(s))),
        },
    };
    let exact = match m.get("exact") {
        None => on_store_failure == FailurePolicy::Closed,
        Some(v) => boolean(v, &join(path, "exact"))?,
    };
    if let Some(d) = m.get("description") {
        string(d, &join(path, "description"))?;
    }
    let policy_item = crate::field::policy_item(name, limit.quota(), &limit);
    Ok(Rule { name: name.to_owned(), matcher, key, limit, plans, cost, mode, on_store_failure, exact, policy_item })
}

fn parse_match(v: &Value, path: &str) -> Result<Matcher, ConfigError> {
    let m = object(v, path)?;
    known_fields(m, path, &["path", "method"])?;
    let pattern = match m.get("path") {
        None => None,
        Some(p) => {
            let pp = join(path, "path");
            let s = string(p, &pp)?;
            match PathPattern::parse(s) {
                Ok(p) => Some(p),
                Err(why) => return err(&pp, format!("{} {why}", quoted(s))),
            }
        }
    };
    let mp = join(path, "method");
    let mut methods = Vec::new();
    match m.get("method") {
        None => {}
        Some(Value::String(s)) => methods.push(method(s, &mp)?),
        Some(Value::Array(a)) if a.len() > MAX_METHODS => return too_many(&mp, a.len(), "methods", MAX_METHODS),
        // An empty list would read as "any method", the opposite of what it says.
        Some(Value::Array(a)) if a.is_empty() => return err(&mp, "must name at least one method (omit it for any)"),
        Some(Value::Array(a)) => {
            for (i, s) in a.iter().enumerate() {
                let p = format!("{mp}[{i}]");
                let m = method(string(s, &p)?, &p)?;
                // Matched without regard to case: `["GET", "get"]` names one method twice.
                if methods.contains(&m) {
                    return err(&p, format!("{} appears twice", quoted(&m)));
                }
                methods.push(m);
            }
        }
        Some(other) => return err(&mp, format!("must be a method or a list of methods, not {}", kind(other))),
    }
    Ok(Matcher { path: pattern, methods })
}

/// Whether `t` is an RFC 9110 token (letters, digits and ``!#$%&'*+-.^_`|~``): what an HTTP
/// method (`M-SEARCH`, `BPROPFIND`) and a header's name are.
pub fn is_token(t: &[u8]) -> bool {
    !t.is_empty() && t.iter().all(|&b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn method(s: &str, path: &str) -> Result<String, ConfigError> {
    if !is_token(s.as_bytes()) {
        return err(path, format!("{} is not an HTTP method", quoted(s)));
    }
    Ok(s.to_ascii_uppercase())
}

/// An algorithm's name; the error lists [`Algorithm::ALL`].
fn parse_algorithm(v: &Value, path: &str) -> Result<Algorithm, ConfigError> {
    let s = string(v, path)?;
    Algorithm::from_name(s).filter(|a| *a != Algorithm::Concurrent).ok_or_else(|| ConfigError {
        path: path.into(),
        reason: format!("{} is not one of {}", quoted(s), crate::algo::ALGORITHM_NAMES),
    })
}

/// `{"concurrent": N, "hold_max": "60s"}`: at most N requests in flight, a slot held at
/// most `hold_max` (1 ms to 1 h).
fn parse_concurrent(m: &Map, n: &Value, path: &str, algorithm: Option<Algorithm>) -> Result<Limit, ConfigError> {
    for other in ["requests", "per", "burst", "delay", "algorithm"] {
        if m.get(other).is_some() {
            return err(&join(path, other), "does not go with concurrent");
        }
    }
    if algorithm.is_some() {
        return err(path, "a concurrent limit takes no algorithm");
    }
    let n = bounded(n, &join(path, "concurrent"), 1, crate::algo::MAX_SLIDING_LOG_REQUESTS)?;
    let hold = match m.get("hold_max") {
        None => 60 * crate::algo::SECOND,
        Some(h) => duration_field(h, &join(path, "hold_max"), 1_000_000, 3600 * crate::algo::SECOND)?,
    };
    Limit::new(Algorithm::Concurrent, n, hold, None).or_else(|_| err(path, "is not a valid concurrent limit"))
}

fn parse_limit(v: &Value, path: &str, algorithm: Option<Algorithm>) -> Result<Limit, ConfigError> {
    let m = object(v, path)?;
    known_fields(m, path, &["requests", "per", "burst", "delay", "algorithm", "concurrent", "hold_max"])?;
    if let Some(n) = m.get("concurrent") {
        return parse_concurrent(m, n, path, algorithm);
    }
    if m.get("hold_max").is_some() {
        return err(&join(path, "hold_max"), "applies only to a concurrent limit");
    }
    let requests = match m.get("requests") {
        Some(r) => bounded(r, &join(path, "requests"), 1, MAX_REQUESTS)?,
        None => return err(&join(path, "requests"), "is required"),
    };
    let per_path = join(path, "per");
    let per = match m.get("per") {
        Some(Value::String(s)) => match parse_duration(s) {
            Some(d) if d > 0 && d <= MAX_PER => d,
            Some(_) => return err(&per_path, format!("{} must be between 1ms and 366d", quoted(s))),
            None => {
                return err(&per_path, format!("{} is not a duration (like 500ms, 1s, 60s, 1m, 1h, 1d)", quoted(s)))
            }
        },
        Some(other) => return err(&per_path, format!("must be a duration string like \"60s\", not {}", kind(other))),
        None => return err(&per_path, "is required"),
    };
    let burst = match m.get("burst") {
        None => None,
        // 0 is a leaky bucket's queue of none (a token bucket's 0 is refused below).
        Some(b) => Some(bounded(b, &join(path, "burst"), 0, MAX_REQUESTS)?),
    };
    let delay = match m.get("delay") {
        None => 0,
        Some(d) => bounded(d, &join(path, "delay"), 0, MAX_REQUESTS)?,
    };
    let algorithm = match m.get("algorithm") {
        Some(a) => parse_algorithm(a, &join(path, "algorithm"))?,
        None => algorithm.unwrap_or(if burst.is_some() { Algorithm::TokenBucket } else { Algorithm::SlidingWindow }),
    };
    Limit::new(algorithm, requests, per, burst).and_then(|l| l.with_delay(delay)).or_else(|e| match e {
        LimitError::Requests(n) => err(
            &join(path, "requests"),
            format!(
                "{n} is out of range for {} (at most {})",
                algorithm.as_str(),
                if algorithm == Algorithm::SlidingLog { crate::algo::MAX_SLIDING_LOG_REQUESTS } else { MAX_REQUESTS }
            ),
        ),
        LimitError::Per(_) => err(&per_path, "must be between 1ms and 366d"),
        LimitError::Burst(why) => err(&join(path, "burst"), why.to_string()),
        LimitError::Delay(why) => err(&join(path, "delay"), why.to_string()),
        LimitError::Rate => err(
            &join(path, "requests"),
            format!("{requests} is over one per nanosecond of `per`, the finest rate a bucket keeps"),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) const EXAMPLE: &str = include_str!("../../examples/rules.json");

    #[test]
    fn design_example_parses() {
        let c = Config::parse(EXAMPLE.as_bytes()).unwrap();
        assert_eq!(c.rules.len(), 3);
        assert_eq!(c.rules[0].limit.algorithm(), Algorithm::SlidingWindow);
        assert_eq!(c.rules[1].limit.algorithm(), Algorithm::TokenBucket);
        assert_eq!(c.rules[1].limit.capacity(), 200);
        assert_eq!(c.rules[1].limit_for(Some(b"internal")), PlanLimit::Unlimited);
        assert_eq!(c.rules[2].on_store_failure, FailurePolicy::Closed);
        assert!(c.rules[2].exact && !c.rules[0].exact, "exact by default only where the store failing closes");
        assert_eq!(c.identity.ip.trusted_hops, 1);
    }

    #[test]
    fn a_cost_over_a_limits_capacity_names_that_limit() {
        let parse = |rule: &str| {
            let doc = format!(r#"{{"identity":{{"plan":{{"header":"x-plan"}}}},"rules":[{rule}]}}"#);
            Config::parse(doc.as_bytes()).map(|_| ()).map_err(|e| e.to_string())
        };
        let plan = r#"{"name":"a","key":["ip"],"cost":7,"limit":{"requests":10,"per":"1m"},"plans":{"p":{"requests":5,"per":"1m"}}}"#;
        assert_eq!(parse(plan), Err(r#"rules[0].cost: 7 exceeds plan "p"'s limit, of capacity 5"#.into()));
        let own = r#"{"name":"a","key":["ip"],"cost":7,"limit":{"requests":5,"per":"1m"}}"#;
        assert_eq!(parse(own), Err("rules[0].cost: 7 exceeds the rule's limit, of capacity 5".into()));
    }

    #[test]
    fn the_leaky_bucket_takes_nginx_burst_and_delay() {
        let limit = |l: &str| {
            let doc = format!(r#"{{"rules":[{{"name":"a","key":["ip"],"limit":{l}}}]}}"#);
            Config::parse(doc.as_bytes()).map(|c| c.rules[0].limit).map_err(|e| e.to_string())
        };
        // NGINX `rate=5r/s burst=10 delay=3`.
        let l = limit(r#"{"requests":5,"per":"1s","burst":10,"delay":3,"algorithm":"leaky_bucket"}"#).unwrap();
        assert_eq!((l.algorithm(), l.burst(), l.delay()), (Algorithm::LeakyBucket, Some(10), 3));
        let l = limit(r#"{"requests":5,"per":"1s","algorithm":"leaky_bucket"}"#).unwrap();
        assert_eq!((l.burst(), l.delay()), (Some(0), 0), "no queue by default");
        assert_eq!(
            limit(r#"{"requests":5,"per":"1s","burst":2,"delay":3,"algorithm":"leaky_bucket"}"#),
            Err("rules[0].limit.delay: must be at most burst".into())
        );
        assert_eq!(
            limit(r#"{"requests":5,"per":"1s","delay":1}"#),
            Err("rules[0].limit.delay: applies only to leaky_bucket".into())
        );
        // A bucket steps in whole nanoseconds: a faster rate would be kept at one per ns.
        assert_eq!(
            limit(r#"{"requests":4294967295,"per":"1ms","burst":4,"algorithm":"leaky_bucket"}"#),
            Err("rules[0].limit.requests: 4294967295 is over one per nanosecond of `per`, the finest rate a bucket keeps"
                .into())
        );
        assert!(limit(r#"{"requests":1000000,"per":"1ms","burst":4,"algorithm":"leaky_bucket"}"#).is_ok());
        assert!(limit(r#"{"requests":4294967295,"per":"1ms"}"#).is_ok(), "a window counts any rate");
        assert_eq!(
            limit(r#"{"requests":5,"per":"1s","burst":0}"#),
            Err("rules[0].limit.burst: must be at least 1".into()),
            "a token bucket of no capacity"
        );
    }

    #[test]
    fn a_concurrent_limit_is_slots_held_at_most_hold_max() {
        let rule = |l: &str, extra: &str| {
            let doc = format!(r#"{{"rules":[{{"name":"a","key":["ip"],"limit":{l}{extra}}}]}}"#);
            Config::parse(doc.as_bytes()).map(|c| c.rules[0].clone()).map_err(|e| e.to_string())
        };
        let r = rule(r#"{"concurrent":10}"#, "").unwrap();
        assert_eq!(
            (r.limit.algorithm(), r.limit.requests(), r.limit.per()),
            (Algorithm::Concurrent, 10, 60 * crate::algo::SECOND)
        );
        assert_eq!(r.policy_item, r#""a";q=10;qu="concurrent-requests""#);
        assert_eq!(rule(r#"{"concurrent":2,"hold_max":"5s"}"#, "").unwrap().limit.per(), 5 * crate::algo::SECOND);
        assert_eq!(
            rule(r#"{"concurrent":2,"per":"1s"}"#, ""),
            Err("rules[0].limit.per: does not go with concurrent".into())
        );
        assert_eq!(
            rule(r#"{"concurrent":2}"#, r#","algorithm":"token_bucket""#),
            Err("rules[0].limit: a concurrent limit takes no algorithm".into())
        );
        assert_eq!(
            rule(r#"{"requests":2,"per":"1s","hold_max":"5s"}"#, ""),
            Err("rules[0].limit.hold_max: applies only to a concurrent limit".into())
        );
        assert!(rule(r#"{"requests":2,"per":"1s","algorithm":"concurrent"}"#, "")
            .unwrap_err()
            .contains("is not one of"));
        assert!(rule(r#"{"concurrent":0}"#, "").is_err());
    }

    #[test]
    fn exact_is_a_boolean_that_overrides_the_default() {
        let rule = |extra: &str| {
            let doc =
                format!(r#"{{"rules":[{{"name":"a","key":["ip"],"limit":{{"requests":1,"per":"1s"}}{extra}}}]}}"#);
            Config::parse(doc.as_bytes()).map(|c| c.rules[0].exact)
        };
        assert_eq!(rule(r#","exact":true"#), Ok(true));
        assert_eq!(rule(r#","on_store_failure":"closed","exact":false"#), Ok(false));
        assert_eq!(rule(r#","on_store_failure":"closed""#), Ok(true));
        assert_eq!(rule(""), Ok(false));
        assert_eq!(
            rule(r#","exact":"yes""#).unwrap_err().to_string(),
            "rules[0].exact: must be true or false, not a string"
        );
    }

    fn error_of(doc: &str) -> String {
        Config::parse(doc.as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn errors_name_the_field_and_the_reason() {
        let doc = r#"{"rules":[{"name":"a","key":["ip"],"limit":{"requests":1,"per":"1s"}},
            {"name":"b","key":["ip"],"limit":{"requests":1,"per":"1s"}},
            {"name":"c","key":["ip"],"limit":{"requests":5,"per":"6O s"}}]}"#;
        assert_eq!(error_of(doc), r#"rules[2].limit.per: "6O s" is not a duration (like 500ms, 1s, 60s, 1m, 1h, 1d)"#);
        // A number too large for a count is shown cut, not copied whole into the line.
        let huge = format!(
            r#"{{"rules":[{{"name":"a","key":["ip"],"limit":{{"requests":{},"per":"1s"}}}}]}}"#,
            "9".repeat(100_000)
        );
        let e = error_of(&huge);
        assert!(
            e.starts_with("rules[0].limit.requests: must be a whole number") && e.ends_with("9…") && e.len() < 200,
            "{e}"
        );
        assert_eq!(
            error_of(r#"{"rules":[{"name":"a","key":["ip"],"limit":{"requests":0,"per":"1s"}}]}"#),
            "rules[0].limit.requests: 0 is out of range (1 to 4294967295)"
        );
        assert_eq!(
            error_of(r#"{"rules":[{"name":"a","key":["nobody"],"limit":{"requests":1,"per":"1s"}}]}"#),
            r#"rules[0].key[0]: "nobody" is not a dimension defined under identity"#
        );
        assert!(error_of(r#"{"rules":[{"name":"a","key":["ip"],"limit":{"requests":1,"per":"1s","burts":3}}]}"#)
            .starts_with("rules[0].limit.burts: unknown field"));
        assert!(error_of("{").starts_with("not valid JSON"));
        assert_eq!(error_of("[]"), "must be an object, not an array");
        assert_eq!(
            error_of(
                r#"{"rules":[{"name":"a","key":["ip"],"match":{"method":[]},"limit":{"requests":1,"per":"1s"}}]}"#
            ),
            "rules[0].match.method: must name at least one method (omit it for any)"
        );
        // Two names metrics would show as one.
        let two = |a: &str, b: &str| {
            format!(
                r#"{{"rules":[{{"name":"{a}","key":["ip"],"limit":{{"requests":1,"per":"1s"}}}},
                {{"name":"{b}","key":["ip"],"limit":{{"requests":1,"per":"1s"}}}}]}}"#
            )
        };
        assert!(error_of(&two("x-y", "X_y")).starts_with(r#"rules[1].name: "X_y" is used by another rule"#));
        assert!(Config::parse(two("x-y", "x-z").as_bytes()).is_ok());
        let many: Vec<String> = (0..20)
            .map(|i| format!(r#"{{"name":"r.{i}","key":["ip"],"limit":{{"requests":1,"per":"1s"}}}}"#))
            .chain(core::iter::once(r#"{"name":"R_7","key":["ip"],"limit":{"requests":1,"per":"1s"}}"#.into()))
            .collect();
        let doc = format!(r#"{{"rules":[{}]}}"#, many.join(","));
        assert!(error_of(&doc).contains("is used by another rule"), "{}", error_of(&doc));
        // A message is one line, whatever the document holds.
        let odd = r#"{"rules":[{"name":"a\u001b[31m\nb\"c","key":["ip"],"limit":{"requests":1,"per":"1s"}}]}"#;
        assert_eq!(error_of(odd), r#"rules[0].name: "a\u{1b}[31m\u{a}b\"c" must be 1 to 64 of A-Z a-z 0-9 _ . -"#);
        let long = format!(
            r#"{{"rules":[{{"name":"{}","key":["ip"],"limit":{{"requests":1,"per":"1s"}}}}]}}"#,
            "n".repeat(5000)
        );
        assert!(error_of(&long).len() < 200, "{}", error_of(&long));
        let key = r#"{"rules":[{"name":"a","key":["ip"],"limit":{"requests":1,"per":"1s","\u0007":1}}]}"#;
        assert!(error_of(key).starts_with(r#"rules[0].limit.\u{7}: unknown field"#), "{}", error_of(key));
    }

    #[test]
    fn documents_past_what_can_be_built_are_refused_fast() {
        let rule = |i: usize| format!(r#"{{"name":"r{i}","key":["user"],"limit":{{"requests":1,"per":"1s"}}}}"#);
        let many: Vec<String> = (0..=MAX_RULES).map(rule).collect();
        let doc = format!(r#"{{"rules":[{}]}}"#, many.join(","));
        assert!(error_of(&doc).starts_with("rules: has 1001 rules"), "{}", error_of(&doc));
        let ok: Vec<String> = (0..MAX_RULES).map(rule).collect();
        assert!(Config::parse(format!(r#"{{"rules":[{}]}}"#, ok.join(",")).as_bytes()).is_ok());
        let plans: Vec<String> = (0..=MAX_PLANS).map(|i| format!(r#""p{i}":"unlimited""#)).collect();
        let doc = format!(
            r#"{{"rules":[{{"name":"r","key":["user"],"limit":{{"requests":1,"per":"1s"}},"plans":{{{}}}}}]}}"#,
            plans.join(",")
        );
        assert!(error_of(&doc).starts_with("rules[0].plans: has 1001 plans"), "{}", error_of(&doc));
        let huge = format!(r#"{{"rules":[],"x":"{}"}}"#, "a".repeat(MAX_DOCUMENT));
        assert!(error_of(&huge).contains("bytes; at most 1048576"), "{}", error_of(&huge));
        let slots = r#"{"rules":[],"filter":{"slots":16777216}}"#;
        assert!(error_of(slots).starts_with("filter.slots"), "{}", error_of(slots));
        let twice = r#"{"rules":[],"rules":[]}"#;
        assert!(error_of(twice).contains("duplicate key \"rules\" at line 1"), "{}", error_of(twice));
        assert!(!error_of(twice).contains("not valid JSON"), "{}", error_of(twice));
        assert!(error_of(twice).starts_with("rules: "), "{}", error_of(twice));
        // A key named twice deeper in is named by its path, as any other field is.
        let nested = r#"{"rules":[{"name":"a","key":["ip"],"limit":{"requests":5,"per":"60s","per":"1s"}}]}"#;
        assert!(error_of(nested).starts_with("rules[0].limit.per: duplicate key \"per\""), "{}", error_of(nested));
        let listed = r#"{"identity":{"ip":{"trusted_hops":1}},"rules":[{"name":"a","key":["ip"],"limit":{"requests":5,"per":"60s"}},{"name":"b","name":"c"}]}"#;
        assert!(error_of(listed).starts_with("rules[1].name: "), "{}", error_of(listed));
        // A byte order mark before the document is no part of it.
        assert!(Config::parse(b"\xef\xbb\xbf{\"rules\":[]}").is_ok());
    }

    #[test]
    fn hash_key_and_schema_are_strings_never_a_dimension() {
        let rule = r#""rules":[{"name":"r","key":["ip"],"limit":{"requests":1,"per":"1s"}}]"#;
        assert_eq!(
            error_of(&format!(r#"{{"identity":{{"hash_key":{{"header":"x-h"}}}},{rule}}}"#)),
            "identity.hash_key: must be a string, not an object"
        );
        let doc = r#"{"identity":{"hash_key":{"header":"x-h"}},
            "rules":[{"name":"r","key":["hash_key"],"limit":{"requests":1,"per":"1s"}}]}"#;
        assert!(error_of(doc).starts_with("identity.hash_key: must be a string"), "{}", error_of(doc));
        assert_eq!(
            error_of(&format!(r#"{{"identity":{{"hash_key":12345678901234567890}},{rule}}}"#)),
            "identity.hash_key: must be a string, not a number"
        );
        let c = Config::parse(format!(r#"{{"identity":{{"hash_key":"sixteen chars at least"}},{rule}}}"#).as_bytes());
        assert_eq!(c.unwrap().identity.hash_key_source, HashKeySource::HashKey);
        assert_eq!(error_of(&format!(r#"{{"$schema":5,{rule}}}"#)), "$schema: must be a string, not a number");
        assert!(Config::parse(format!(r#"{{"$schema":"./rules.schema.json",{rule}}}"#).as_bytes()).is_ok());
    }

    #[test]
    fn identity_has_at_most_64_header_dimensions_and_ip() {
        let doc = |headers: usize, ip: bool, hash_key: bool| {
            let mut members: Vec<String> = (0..headers).map(|i| format!(r#""d{i}":{{"header":"x-d{i}"}}"#)).collect();
            if ip {
                members.push(r#""ip":{"trusted_hops":1}"#.to_owned());
            }
            if hash_key {
                members.push(r#""hash_key":"sixteen chars at least""#.to_owned());
            }
            let key: Vec<String> =
                (0..headers).map(|i| format!(r#""d{i}""#)).chain(ip.then(|| r#""ip""#.to_owned())).collect();
            format!(
                r#"{{"identity":{{{}}},"rules":[{{"name":"r","key":[{}],"limit":{{"requests":1,"per":"1s"}}}}]}}"#,
                members.join(","),
                key.join(",")
            )
        };
        for (ip, hash_key) in [(false, false), (true, false), (false, true), (true, true)] {
            let c = Config::parse(doc(MAX_DIMENSIONS, ip, hash_key).as_bytes()).unwrap();
            assert_eq!(c.rules[0].key.len(), MAX_DIMENSIONS + usize::from(ip));
            assert_eq!(
                error_of(&doc(MAX_DIMENSIONS + 1, ip, hash_key)),
                "identity: has 65 header dimensions; at most 64 are accepted",
                "ip {ip}, hash_key {hash_key}"
            );
        }
    }

    #[test]
    fn plans_are_found_by_name_among_many() {
        let plans: Vec<String> = (0..500).map(|i| format!(r#""p{i}":{{"requests":{},"per":"1s"}}"#, i + 1)).collect();
        let doc = format!(
            r#"{{"rules":[{{"name":"r","key":["user"],"limit":{{"requests":9999,"per":"1s"}},"plans":{{{}}}}}]}}"#,
            plans.join(",")
        );
        let c = Config::parse(doc.as_bytes()).unwrap();
        for i in [0usize, 7, 250, 499] {
            let PlanLimit::Limited(l) = c.rules[0].limit_for(Some(format!("p{i}").as_bytes())) else { panic!() };
            assert_eq!(l.requests(), i as u64 + 1);
        }
        let PlanLimit::Limited(l) = c.rules[0].limit_for(Some(b"nope")) else { panic!() };
        assert_eq!(l.requests(), 9999);
    }

    #[test]
    fn sync_options_are_validated_and_defaulted() {
        let doc = |sync: &str| format!(r#"{{"rules":[],"sync":{sync}}}"#);
        let c = Config::parse(doc(r#"{"cluster":"store","secret":"0123456789abcdef"}"#).as_bytes()).unwrap();
        let s = c.sync.unwrap();
        assert_eq!((s.authority.as_str(), s.path.as_str(), s.interval, s.nodes), ("store", "/v1/sync", 100_000_000, 1));
        // A URL's credentials are not shown back.
        let e =
            Config::parse(doc(r#"{"cluster":"http://ops:hunter2hunter2@h:1","secret":"0123456789abcdef"}"#).as_bytes())
                .unwrap_err();
        assert!(
            e.to_string().starts_with("sync.cluster: \"http://…@h:1\"") && !e.to_string().contains("hunter2"),
            "{e}"
        );
        let e = Config::parse(doc(r#"{"cluster":"ops:pw@h:1","secret":"0123456789abcdef"}"#).as_bytes()).unwrap_err();
        assert!(!e.to_string().contains("pw"), "{e}");
        let e = Config::parse(doc(r#"{"cluster":"store","secret":"short"}"#).as_bytes()).unwrap_err();
        assert_eq!(e.path, "sync.secret");
        let e = Config::parse(doc(r#"{"cluster":"s","secret":"0123456789abcdef","interval":"1ms"}"#).as_bytes());
        assert_eq!(e.unwrap_err().path, "sync.interval");
        assert!(Config::parse(br#"{"rules":[]}"#).unwrap().sync.is_none());
        assert_eq!((s.timeout, s.max_wait), (50_000_000, 50_000_000), "max_wait defaults to the call deadline");
        let c = Config::parse(
            doc(r#"{"cluster":"s","secret":"0123456789abcdef","max_wait":"5ms","timeout":"80ms"}"#).as_bytes(),
        );
        let s = c.unwrap().sync.unwrap();
        assert_eq!((s.timeout, s.max_wait), (80_000_000, 5_000_000));
        let e = Config::parse(doc(r#"{"cluster":"s","secret":"0123456789abcdef","max_wait":"soon"}"#).as_bytes());
        assert_eq!(e.unwrap_err().path, "sync.max_wait");
    }

    /// A duration out of its field's range is refused with the range, as `per` states its own.
    #[test]
    fn a_duration_out_of_range_says_the_range() {
        let sync = |field: &str| {
            let doc = format!(r#"{{"rules":[],"sync":{{"cluster":"s","secret":"0123456789abcdef",{field}}}}}"#);
            Config::parse(doc.as_bytes()).unwrap_err().to_string()
        };
        assert_eq!(sync(r#""interval":"61s""#), r#"sync.interval: "61s" must be between 10ms and 60s"#);
        assert_eq!(sync(r#""timeout":"0ms""#), r#"sync.timeout: "0ms" must be between 1ms and 10s"#);
        assert_eq!(sync(r#""stale_after":"5ms""#), r#"sync.stale_after: "5ms" must be between 10ms and 1h"#);
        assert_eq!(sync(r#""max_wait":"11s""#), r#"sync.max_wait: "11s" must be between 1ms and 10s"#);
        let doc = r#"{"rules":[{"name":"c","key":["ip"],"limit":{"concurrent":1,"hold_max":"2h"}}]}"#;
        let e = Config::parse(doc.as_bytes()).unwrap_err().to_string();
        assert_eq!(e, r#"rules[0].limit.hold_max: "2h" must be between 1ms and 1h"#);
        assert_eq!((written(1_500_000_000), written(90 * 60 * 1_000_000_000)), ("1500ms".into(), "5400s".into()));
    }

    /// `filter.hash_seed` is a secret: a value refused is not shown in the error.
    #[test]
    fn a_refused_hash_seed_is_not_shown() {
        for seed in ["12345678901234567.5", "-12345678901234567", "123456789012345678901"] {
            let doc = format!(r#"{{"rules":[],"filter":{{"hash_seed":{seed}}}}}"#);
            let e = Config::parse(doc.as_bytes()).unwrap_err();
            assert_eq!(e.path, "filter.hash_seed");
            assert!(!e.reason.contains("12345678901234567"), "{e}");
        }
        let doc = r#"{"rules":[],"filter":{"hash_seed":12345678901234567.0}}"#;
        assert_eq!(Config::parse(doc.as_bytes()).unwrap().filter.hash_seed, 12_345_678_901_234_567);
    }

    #[test]
    fn a_sync_path_starts_with_a_slash() {
        let doc = |path: &str| {
            format!(r#"{{"rules":[],"sync":{{"cluster":"s","secret":"0123456789abcdef","path":{path:?}}}}}"#)
        };
        for bad in ["", "v1/sync", "http://store/v1/sync"] {
            assert_eq!(error_of(&doc(bad)), format!("sync.path: {} must start with /", quoted(bad)), "{bad:?}");
        }
        let c = Config::parse(doc("/ratewall/sync").as_bytes()).unwrap();
        assert_eq!(c.sync.unwrap().path, "/ratewall/sync");
        // Both go into a request's pseudo-headers as written: no line break may smuggle one in.
        for bad in ["/v1/sync\r\nx: y", "/v1 sync"] {
            assert!(error_of(&doc(bad)).starts_with("sync.path: "), "{bad:?}");
        }
        let with = |authority: &str| {
            format!(r#"{{"rules":[],"sync":{{"cluster":"s","secret":"0123456789abcdef","authority":{authority:?}}}}}"#)
        };
        for bad in ["", "a\r\nx: y", "store host"] {
            assert!(error_of(&with(bad)).starts_with("sync.authority: "), "{bad:?}");
        }
        assert_eq!(
            Config::parse(with("store.internal:8090").as_bytes()).unwrap().sync.unwrap().authority,
            "store.internal:8090"
        );
    }

    /// The secrets' minimums are characters, as their messages and the schema's `minLength`
    /// say; a match path's maximum is bytes, as its message says.
    #[test]
    fn secrets_are_measured_in_characters_and_a_match_path_in_bytes() {
        let rule = r#""rules":[{"name":"r","key":["ip"],"limit":{"requests":1,"per":"1s"}}]"#;
        let hash_key = |k: &str| format!(r#"{{"identity":{{"hash_key":"{k}"}},{rule}}}"#);
        // Eight two-byte characters: 16 bytes, 8 characters.
        let (eight, sixteen) = ("é".repeat(8), "é".repeat(16));
        assert_eq!(error_of(&hash_key(&eight)), "identity.hash_key: must be at least 16 characters");
        assert!(Config::parse(hash_key(&sixteen).as_bytes()).is_ok());
        let sync = |secret: &str| format!(r#"{{"rules":[],"sync":{{"cluster":"s","secret":"{secret}"}}}}"#);
        assert_eq!(error_of(&sync(&eight)), "sync.secret: is required and must be at least 16 characters");
        assert!(Config::parse(sync(&sixteen).as_bytes()).is_ok());
        let path = |p: &str| {
            format!(
                r#"{{"rules":[{{"name":"r","key":["ip"],"match":{{"path":"{p}"}},"limit":{{"requests":1,"per":"1s"}}}}]}}"#
            )
        };
        assert!(Config::parse(path(&format!("/{}", "é".repeat(511))).as_bytes()).is_ok(), "1,023 bytes");
        // 513 characters, 1,025 bytes.
        let long = format!("/{}", "é".repeat(512));
        assert_eq!(error_of(&path(&long)), format!("rules[0].match.path: {} is longer than 1024 bytes", quoted(&long)));
    }

    #[test]
    fn a_sync_cluster_is_an_envoy_cluster_name_or_a_host_and_port_nginx_can_parse() {
        let cluster = |c: &str| {
            let doc = format!(r#"{{"rules":[],"sync":{{"cluster":{c:?},"secret":"0123456789abcdef"}}}}"#);
            Config::parse(doc.as_bytes()).map(|c| c.sync.map(|s| s.cluster))
        };
        for good in [
            "ratewall_store",
            "outbound|8090||store.ns.svc.cluster.local",
            "127.0.0.1:8090",
            "store:80",
            "store.internal.:65535",
            "ratewall-store.example.com:443",
            "[::1]:8090",
            "[2001:db8::7]:1",
        ] {
            assert_eq!(cluster(good), Ok(Some(good.to_owned())), "{good}");
        }
        for (bad, says) in [
            ("https://store", "is a URL"),
            ("http://127.0.0.1:8090", "is a URL"),
            ("store:80x", "no valid port"),
            ("store:", "no valid port"),
            ("store:0", "no valid port"),
            ("store:08090", "no valid port"),
            ("store:65536", "no valid port"),
            ("store:+80", "no valid port"),
            ("store:8090/v1/sync", "no valid port"),
            (":8090", "no valid host"),
            ("::1:8090", "no valid host"),
            ("[::1]x:8090", "no valid host"),
            ("[not-v6]:8090", "no valid host"),
            ("[[::1]]:8090", "no valid host"),
            ("my store:80", "no valid host"),
            ("a..b:80", "no valid host"),
            ("-store:80", "no valid host"),
            ("my store", "no cluster name"),
            ("store\n", "no cluster name"),
        ] {
            let e = cluster(bad).unwrap_err();
            assert_eq!(e.path, "sync.cluster", "{bad}");
            assert!(e.reason.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn durations_take_every_documented_unit() {
        for (s, n) in [
            ("500ms", 500_000_000),
            ("1s", 1_000_000_000),
            ("60s", 60_000_000_000),
            ("1m", 60_000_000_000),
            ("1h", 3_600_000_000_000),
            ("1d", 86_400_000_000_000),
        ] {
            assert_eq!(parse_duration(s), Some(n), "{s}");
        }
        for s in ["", "s", "1", "1.5s", "-1s", "1 s", "1S", "99999999999999999999x"] {
            assert_eq!(parse_duration(s), None, "{s}");
        }
        assert_eq!(parse_duration("99999999999999999999s"), Some(u64::MAX), "out of range, not malformed");
        assert_eq!(parse_duration("18446744073710ms"), Some(u64::MAX));
    }

    #[test]
    fn methods_are_tokens_named_once() {
        let with = |m: &str| {
            format!(
                r#"{{"rules":[{{"name":"a","key":["ip"],"match":{{"method":{m}}},"limit":{{"requests":1,"per":"1s"}}}}]}}"#
            )
        };
        let c = Config::parse(with(r#"["M-SEARCH","get","PROPFIND"]"#).as_bytes()).unwrap();
        assert_eq!(c.rules[0].matcher.methods, ["M-SEARCH", "GET", "PROPFIND"]);
        assert!(c.rules[0].matcher.matches("m-search", "/"));
        assert_eq!(error_of(&with(r#"["GET","get"]"#)), r#"rules[0].match.method[1]: "GET" appears twice"#);
        for bad in [r#""GET /""#, r#""G(ET""#, r#""""#, r#""GÉT""#] {
            assert!(error_of(&with(bad)).ends_with("is not an HTTP method"), "{bad}");
        }
    }
}
