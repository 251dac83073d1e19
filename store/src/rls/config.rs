//! envoyproxy/ratelimit's YAML configuration, read as it is, validated once into typed rules,
//! and its matching: a request descriptor's most specific match at the descriptor's depth.
//!
//! The format (envoyproxy/ratelimit's README, "The configuration format"): a `domain` and a
//! tree of `descriptors`, each with a `key`, an optional `value` (`*` matches any run of
//! characters), an optional `rate_limit` {`unit`, `requests_per_unit`, `name`, `unlimited`,
//! `replaces`}, `shadow_mode` and nested `descriptors`. Its other keys are accepted with its
//! meaning: `share_threshold` (the values a wildcard matches share one counter),
//! `detailed_metric` and `value_to_metric` (metric naming: ratewall's metrics are per rule,
//! so they change nothing), `metadata` (read, not returned). ratewall's additions are
//! opt-in: `algorithm` in a `rate_limit` (`fixed_window`, the default and envoyproxy/
//! ratelimit's, `sliding_window` or `token_bucket`) and `exact` (in a `rate_limit` or on its
//! descriptor: decided at Redis on every call instead of from this process's grant).
//!
//! Any other key is an error, reported with its file, line and reason; so are an empty key
//! or domain, a duplicate descriptor or domain, an unknown unit, a unit beside
//! `unlimited: true`, and the other mistakes envoyproxy/ratelimit refuses.

use ratewall_core::{Algorithm, Limit, Nanos, SECOND};
use serde::de::{self, Visitor};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A configuration mistake: where and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The file.
    pub file: String,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// 1-based column, when known.
    pub column: Option<usize>,
    /// What is wrong.
    pub reason: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.line, self.column) {
            (Some(l), Some(c)) => write!(f, "{}:{l}:{c}: {}", self.file, self.reason),
            (Some(l), None) => write!(f, "{}:{l}: {}", self.file, self.reason),
            _ => write!(f, "{}: {}", self.file, self.reason),
        }
    }
}

impl std::error::Error for ConfigError {}

/// A rate limit's unit, as envoyproxy/ratelimit (and `rls.proto`) define them: a month is 30
/// days, a year 365.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    /// 1 s.
    Second,
    /// 60 s.
    Minute,
    /// 3,600 s.
    Hour,
    /// 86,400 s.
    Day,
    /// 7 days.
    Week,
    /// 30 days.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    /// The unit named `s` (any case, as envoyproxy/ratelimit upper-cases it).
    pub fn from_name(s: &str) -> Option<Unit> {
        Some(match s.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            "year" => Unit::Year,
            _ => return None,
        })
    }

    /// `rls.proto`'s `RateLimit.Unit` number (`UNKNOWN` = 0 is not a unit).
    pub fn from_proto(n: i32) -> Option<Unit> {
        Some(match n {
            1 => Unit::Second,
            2 => Unit::Minute,
            3 => Unit::Hour,
            4 => Unit::Day,
            5 => Unit::Month,
            6 => Unit::Year,
            7 => Unit::Week,
            _ => return None,
        })
    }

    /// Its `rls.proto` number.
    pub fn proto(self) -> i32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 2,
            Unit::Hour => 3,
            Unit::Day => 4,
            Unit::Month => 5,
            Unit::Year => 6,
            Unit::Week => 7,
        }
    }

    /// Its name as `rls.proto` spells it (proto3 JSON).
    pub fn proto_name(self) -> &'static str {
        match self {
            Unit::Second => "SECOND",
            Unit::Minute => "MINUTE",
            Unit::Hour => "HOUR",
            Unit::Day => "DAY",
            Unit::Week => "WEEK",
            Unit::Month => "MONTH",
            Unit::Year => "YEAR",
        }
    }

    /// Its length.
    pub fn nanos(self) -> Nanos {
        let day = 86_400 * SECOND;
        match self {
            Unit::Second => SECOND,
            Unit::Minute => 60 * SECOND,
            Unit::Hour => 3_600 * SECOND,
            Unit::Day => day,
            Unit::Week => 7 * day,
            Unit::Month => 30 * day,
            Unit::Year => 365 * day,
        }
    }
}

/// One configured limit: a descriptor's `rate_limit`, or a request's `limit` override.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// The domain it belongs to.
    pub domain: String,
    /// envoyproxy/ratelimit's key for it, `domain.key_value.key…` (its metrics' name).
    pub full_key: String,
    /// `rate_limit.name` (empty: none).
    pub name: String,
    /// The policy name in `RateLimit` / `RateLimit-Policy` fields: `name`, else `full_key`,
    /// reduced to the characters an sf-string carries without escapes.
    pub policy: String,
    /// `rate_limit.unit` (None: unlimited).
    pub unit: Option<Unit>,
    /// `rate_limit.requests_per_unit`.
    pub requests_per_unit: u32,
    /// `rate_limit.unlimited`.
    pub unlimited: bool,
    /// `shadow_mode`: reported, never enforced.
    pub shadow: bool,
    /// `rate_limit.replaces`: the names of the limits this one drops from a call.
    pub replaces: Vec<String>,
    /// The core limit (None: unlimited, or `requests_per_unit: 0`, which denies every hit).
    pub limit: Option<Limit>,
    /// Decided at Redis on every call.
    pub exact: bool,
}

impl Rule {
    /// The `rls.proto` `RateLimit` this rule reports (`current_limit`).
    pub fn unit_proto(&self) -> i32 {
        self.unit.map_or(0, Unit::proto)
    }

    /// A rule for a request descriptor's `limit` override: a fixed window, enforced, no name.
    pub fn overriding(domain: &str, full_key: String, requests_per_unit: u32, unit: Unit) -> Result<Rule, String> {
        let limit = core_limit(Algorithm::FixedWindow, requests_per_unit, unit)?;
        Ok(Rule {
            domain: domain.to_owned(),
            policy: policy_name(&full_key),
            full_key,
            name: String::new(),
            unit: Some(unit),
            requests_per_unit,
            unlimited: false,
            shadow: false,
            replaces: Vec::new(),
            limit,
            exact: false,
        })
    }
}

fn core_limit(algorithm: Algorithm, requests_per_unit: u32, unit: Unit) -> Result<Option<Limit>, String> {
    if requests_per_unit == 0 {
        return Ok(None);
    }
    Limit::new(algorithm, u64::from(requests_per_unit), unit.nanos(), None).map(Some).map_err(|e| e.to_string())
}

/// `s` with every character an sf-string would need escaped, or cannot carry, replaced by `_`.
fn policy_name(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_graphic() && c != '"' && c != '\\' || c == ' ' { c } else { '_' }).collect()
}

/// One level of a domain's descriptor tree.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Level {
    /// By `key` or `key_value` (envoyproxy/ratelimit's composite key).
    entries: HashMap<String, Entry>,
    /// The wildcard entries' composite keys split on `*`, in file order.
    wildcards: Vec<(String, Vec<String>)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    rule: Option<Arc<Rule>>,
    children: Level,
    /// `share_threshold`: the wildcard value every match counts under.
    shared: Option<String>,
}

/// What a request descriptor matched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Matched {
    /// The rule.
    pub rule: Arc<Rule>,
    /// Per entry of the descriptor, the value its counter is keyed by when not its own (a
    /// `share_threshold` wildcard's pattern).
    pub shared: Vec<Option<String>>,
}

/// A validated configuration: its domains.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RlsConfig {
    domains: BTreeMap<String, Level>,
    /// Every rule, in file order (for `ratewall check` and the metrics).
    pub rules: Vec<Arc<Rule>>,
}

impl RlsConfig {
    /// Reads `path`: one YAML file, or every `*.yaml` / `*.yml` file in a directory (dotfiles
    /// skipped, in name order; a domain may appear in one file only).
    pub fn load(path: &Path) -> Result<RlsConfig, ConfigError> {
        let mut config = RlsConfig::default();
        for file in files(path)? {
            let name = file.display().to_string();
            let text = std::fs::read_to_string(&file).map_err(|e| ConfigError {
                file: name.clone(),
                line: None,
                column: None,
                reason: e.to_string(),
            })?;
            config.add(&name, &text)?;
        }
        Ok(config)
    }

    /// Parses one file's text (named `file` in errors) into a configuration.
    pub fn parse(file: &str, text: &str) -> Result<RlsConfig, ConfigError> {
        let mut config = RlsConfig::default();
        config.add(file, text)?;
        Ok(config)
    }

    /// The domains, in name order.
    pub fn domains(&self) -> impl Iterator<Item = &str> {
        self.domains.keys().map(String::as_str)
    }

    /// Whether `domain` is configured.
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    fn add(&mut self, file: &str, text: &str) -> Result<(), ConfigError> {
        let at = |e: serde_norway::Error| {
            let loc = e.location();
            let mut reason = e.to_string();
            // The location is given apart; the message need not say it again.
            if let Some(i) = reason.find(" at line ") {
                reason.truncate(i);
            }
            ConfigError {
                file: file.to_owned(),
                line: loc.as_ref().map(|l| l.line()),
                column: loc.as_ref().map(|l| l.column()),
                reason,
            }
        };
        if text.trim().is_empty() {
            return Err(ConfigError {
                file: file.to_owned(),
                line: None,
                column: None,
                reason: "the file is empty; it needs a domain".into(),
            });
        }
        let raw: RawFile = serde_norway::from_str(text).map_err(at)?;
        let domain_line = text.lines().position(|l| l.trim_start().starts_with("domain")).map(|i| i + 1);
        let whole = |reason: String| ConfigError { file: file.to_owned(), line: domain_line, column: None, reason };
        let domain = raw.domain.map(|d| d.0).unwrap_or_default();
        if domain.is_empty() {
            return Err(whole("config file cannot have empty domain".into()));
        }
        if self.domains.contains_key(&domain) {
            return Err(whole(format!("duplicate domain '{domain}' (each domain is in one file)")));
        }
        let mut level = Level::default();
        let mut rules = Vec::new();
        build(&mut level, &domain, &format!("{domain}."), raw.descriptors, &mut rules).map_err(
            |(reason, key, nth)| {
                // Which descriptor, found in the text (serde keeps no positions past parsing): the
                // `nth` line naming `key`.
                let line = text
                    .lines()
                    .enumerate()
                    .filter(|(_, l)| {
                        let l = l.trim_start().trim_start_matches("- ").trim();
                        let named = l.strip_prefix("key:").map(|v| v.trim().trim_matches(|c| c == '"' || c == '\''));
                        named == Some(key.as_str())
                    })
                    .nth(nth)
                    .map(|(i, _)| i + 1)
                    .or(domain_line);
                ConfigError { file: file.to_owned(), line, column: None, reason }
            },
        )?;
        self.rules.extend(rules);
        self.domains.insert(domain, level);
        Ok(())
    }

    /// The rule a request descriptor's entries (`(key, value)`) select in `domain`, as
    /// envoyproxy/ratelimit selects it: at each level the entry's `key_value`, else the first
    /// wildcard entry that matches it, else its `key` alone; a rule only at the level of the
    /// descriptor's last entry. None: no limit applies (unmatched, or a descriptor with
    /// neither limit nor children).
    pub fn find(&self, domain: &str, entries: &[(&str, &str)]) -> Option<Matched> {
        let mut level = self.domains.get(domain)?;
        let mut shared = vec![None; entries.len()];
        for (i, (key, value)) in entries.iter().enumerate() {
            let composite = format!("{key}_{value}");
            let mut found = level.entries.get(&composite);
            let mut by_wildcard = false;
            if found.is_none() {
                if let Some((k, _)) = level.wildcards.iter().find(|(_, parts)| wildcard_match(parts, &composite)) {
                    found = level.entries.get(k);
                    by_wildcard = true;
                }
            }
            let entry = match found {
                Some(e) => e,
                None => level.entries.get(*key)?,
            };
            if by_wildcard {
                if let (Some(slot), Some(pattern)) = (shared.get_mut(i), &entry.shared) {
                    *slot = Some(pattern.clone());
                }
            }
            if i + 1 == entries.len() {
                return entry.rule.as_ref().map(|r| Matched { rule: Arc::clone(r), shared });
            }
            if entry.children.entries.is_empty() {
                return None;
            }
            level = &entry.children;
        }
        None
    }
}

/// envoyproxy/ratelimit's wildcard match of `value` against a pattern split on `*`: each `*`
/// matches any run of characters (none included).
fn wildcard_match(parts: &[String], value: &str) -> bool {
    let [first, middle @ .., last] = parts else {
        return parts.first().is_some_and(|p| p == value);
    };
    let fixed: usize = parts.iter().map(String::len).sum();
    if value.len() < fixed || !value.starts_with(first.as_str()) || !value.ends_with(last.as_str()) {
        return false;
    }
    let mut rest = value.get(first.len()..value.len() - last.len()).unwrap_or("");
    for part in middle {
        match rest.find(part.as_str()) {
            Some(i) => rest = rest.get(i + part.len()..).unwrap_or(""),
            None => return false,
        }
    }
    true
}

/// A mistake found past parsing: the reason, and the descriptor's key with how many earlier
/// descriptors of that key come before it in the file (to find its line).
type BuildError = (String, String, usize);

fn build(
    level: &mut Level,
    domain: &str,
    parent: &str,
    descriptors: Vec<RawDescriptor>,
    rules: &mut Vec<Arc<Rule>>,
) -> Result<(), BuildError> {
    for d in descriptors {
        // Descriptors of this key met so far, in file order (an approximation for nested
        // trees: enough to point at the right line in the common case).
        let seen = level.entries.keys().filter(|k| *k == &d.key || k.starts_with(&format!("{}_", d.key))).count();
        let composite = match &d.value {
            Some(v) if !v.0.is_empty() => format!("{}_{}", d.key, v.0),
            _ => d.key.clone(),
        };
        let full_key = format!("{parent}{composite}");
        if level.entries.contains_key(&composite) {
            return Err((format!("duplicate descriptor composite key '{full_key}'"), d.key, seen));
        }
        let rule = match d.rate_limit {
            None => None,
            Some(r) => {
                let exact = r.exact || d.exact;
                let unit = r.unit;
                let limit = match unit {
                    Some(u) if !r.unlimited => core_limit(r.algorithm, r.requests_per_unit, u)
                        .map_err(|e| (format!("{full_key}: rate_limit: {e}"), d.key.clone(), seen))?,
                    _ => None,
                };
                let rule = Arc::new(Rule {
                    domain: domain.to_owned(),
                    policy: policy_name(if r.name.is_empty() { &full_key } else { &r.name }),
                    full_key: full_key.clone(),
                    name: r.name,
                    unit,
                    requests_per_unit: r.requests_per_unit,
                    unlimited: r.unlimited,
                    shadow: d.shadow_mode,
                    replaces: r.replaces,
                    limit,
                    exact,
                });
                rules.push(Arc::clone(&rule));
                Some(rule)
            }
        };
        let shared = if d.share_threshold {
            if !composite.contains('*') {
                let why = format!(
                    "share_threshold can only be used with wildcard values (containing '*'), but found key '{composite}'"
                );
                return Err((why, d.key, seen));
            }
            d.value.as_ref().map(|v| v.0.clone())
        } else {
            None
        };
        if composite.contains('*') {
            level.wildcards.push((composite.clone(), composite.split('*').map(str::to_owned).collect()));
        }
        let mut children = Level::default();
        build(&mut children, domain, &format!("{full_key}."), d.descriptors, rules)?;
        level.entries.insert(composite, Entry { rule, children, shared });
    }
    Ok(())
}

/// The YAML files `path` names.
fn files(path: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let name = path.display().to_string();
    let io = |e: std::io::Error| ConfigError { file: name.clone(), line: None, column: None, reason: e.to_string() };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir(path).map_err(io)? {
        let p = entry.map_err(io)?.path();
        let file = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let yaml = file.ends_with(".yaml") || file.ends_with(".yml");
        if yaml && !file.starts_with('.') && p.is_file() {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

/// The modification times and sizes of what `path` names, to see a change.
pub fn stamp(path: &Path) -> Vec<(PathBuf, Option<std::time::SystemTime>, u64)> {
    let mut out: Vec<_> = files(path)
        .unwrap_or_default()
        .into_iter()
        .map(|p| {
            let meta = std::fs::metadata(&p).ok();
            let (m, len) = (meta.as_ref().and_then(|m| m.modified().ok()), meta.map_or(0, |m| m.len()));
            (p, m, len)
        })
        .collect();
    if out.is_empty() {
        out.push((path.to_path_buf(), None, 0));
    }
    out
}

/// A scalar's text as written, as envoyproxy/ratelimit's YAML library reads it into a string
/// field: `+15551234567`, `0x1F`, `0o17`, `True` and `50.0.0.5` stay as they are (serde_norway
/// hands the scalar over untouched when asked for a string); a null (`~`, `null`, nothing) is
/// empty.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Text(String);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Text, D::Error> {
        struct Literal;
        impl<'de> Visitor<'de> for Literal {
            type Value = Text;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Text, E> {
                Ok(Text(v.to_owned()))
            }
        }
        struct OrNull;
        impl<'de> Visitor<'de> for OrNull {
            type Value = Text;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_none<E: de::Error>(self) -> Result<Text, E> {
                Ok(Text::default())
            }
            fn visit_unit<E: de::Error>(self) -> Result<Text, E> {
                Ok(Text::default())
            }
            fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Text, D::Error> {
                d.deserialize_str(Literal)
            }
        }
        d.deserialize_option(OrNull)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    domain: Option<Text>,
    #[serde(default, deserialize_with = "list")]
    descriptors: Vec<RawDescriptor>,
}

/// A list that may be written empty (`descriptors:` with nothing after it).
fn list<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    Ok(Option::<Vec<T>>::deserialize(d)?.unwrap_or_default())
}

#[derive(Deserialize)]
#[serde(try_from = "RawDescriptorFields")]
struct RawDescriptor {
    key: String,
    value: Option<Text>,
    rate_limit: Option<RawRateLimit>,
    descriptors: Vec<RawDescriptor>,
    shadow_mode: bool,
    share_threshold: bool,
    exact: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescriptorFields {
    #[serde(default)]
    key: Option<Text>,
    #[serde(default)]
    value: Option<Text>,
    #[serde(default)]
    rate_limit: Option<RawRateLimit>,
    #[serde(default, deserialize_with = "list")]
    descriptors: Vec<RawDescriptor>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    quota_mode: bool,
    #[serde(default)]
    detailed_metric: bool,
    #[serde(default)]
    value_to_metric: bool,
    #[serde(default)]
    share_threshold: bool,
    #[serde(default)]
    metadata: Option<serde_norway::Value>,
    #[serde(default)]
    exact: bool,
}

impl TryFrom<RawDescriptorFields> for RawDescriptor {
    type Error = String;
    fn try_from(d: RawDescriptorFields) -> Result<RawDescriptor, String> {
        let key = d.key.map(|k| k.0).unwrap_or_default();
        if key.is_empty() {
            return Err("descriptor has empty key".into());
        }
        if d.quota_mode {
            return Err(format!("descriptor '{key}': quota_mode is not supported by ratewall"));
        }
        // Metric naming and metadata only.
        let _ = (d.detailed_metric, d.value_to_metric, d.metadata);
        Ok(RawDescriptor {
            key,
            value: d.value,
            rate_limit: d.rate_limit,
            descriptors: d.descriptors,
            shadow_mode: d.shadow_mode,
            share_threshold: d.share_threshold,
            exact: d.exact,
        })
    }
}

#[derive(Deserialize)]
#[serde(try_from = "RawRateLimitFields")]
struct RawRateLimit {
    unit: Option<Unit>,
    requests_per_unit: u32,
    unlimited: bool,
    name: String,
    replaces: Vec<String>,
    algorithm: Algorithm,
    exact: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRateLimitFields {
    #[serde(default)]
    unit: Option<Text>,
    #[serde(default)]
    requests_per_unit: Option<u32>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: Option<Text>,
    #[serde(default, deserialize_with = "list")]
    replaces: Vec<RawReplace>,
    #[serde(default)]
    algorithm: Option<String>,
    #[serde(default)]
    exact: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReplace {
    #[serde(default)]
    name: Option<Text>,
}

impl TryFrom<RawRateLimitFields> for RawRateLimit {
    type Error = String;
    fn try_from(r: RawRateLimitFields) -> Result<RawRateLimit, String> {
        let unit_name = r.unit.map(|u| u.0).unwrap_or_default();
        let unit = Unit::from_name(&unit_name);
        if r.unlimited {
            if unit.is_some() {
                return Err("should not specify rate limit unit when unlimited".into());
            }
        } else if unit.is_none() {
            return Err(format!(
                "invalid rate limit unit '{unit_name}' (second, minute, hour, day, week, month or year)"
            ));
        }
        let name = r.name.map(|n| n.0).unwrap_or_default();
        let mut replaces = Vec::with_capacity(r.replaces.len());
        for p in r.replaces {
            let p = p.name.map(|n| n.0).unwrap_or_default();
            if p.is_empty() {
                return Err("should not have an empty replaces entry".into());
            }
            if p == name {
                return Err("replaces should not contain name of same descriptor".into());
            }
            replaces.push(p);
        }
        let algorithm = match r.algorithm.as_deref() {
            None | Some("fixed_window") => Algorithm::FixedWindow,
            Some("sliding_window") => Algorithm::SlidingWindow,
            Some("token_bucket") => Algorithm::TokenBucket,
            Some(other) => {
                return Err(format!("unknown algorithm '{other}' (fixed_window, sliding_window or token_bucket)"))
            }
        };
        if r.unlimited && r.algorithm.is_some() {
            return Err("an unlimited rate_limit takes no algorithm".into());
        }
        if !r.unlimited && r.requests_per_unit.is_none() {
            return Err("rate_limit needs requests_per_unit".into());
        }
        Ok(RawRateLimit {
            unit: if r.unlimited { None } else { unit },
            requests_per_unit: r.requests_per_unit.unwrap_or(0),
            unlimited: r.unlimited,
            name,
            replaces,
            algorithm,
            exact: r.exact,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> RlsConfig {
        RlsConfig::parse("t.yaml", text).unwrap()
    }

    fn rpu(c: &RlsConfig, domain: &str, entries: &[(&str, &str)]) -> Option<u32> {
        c.find(domain, entries).map(|m| m.rule.requests_per_unit)
    }

    #[test]
    fn nested_descriptors_match_at_the_request_depth() {
        let c = parse(
            "domain: messaging\ndescriptors:\n  - key: message_type\n    value: marketing\n    descriptors:\n      - key: to_number\n        rate_limit:\n          unit: day\n          requests_per_unit: 5\n  - key: to_number\n    rate_limit:\n      unit: day\n      requests_per_unit: 100\n",
        );
        assert_eq!(rpu(&c, "messaging", &[("message_type", "marketing"), ("to_number", "2061111111")]), Some(5));
        assert_eq!(rpu(&c, "messaging", &[("to_number", "2061111111")]), Some(100));
        assert_eq!(rpu(&c, "messaging", &[("message_type", "marketing")]), None);
        assert_eq!(rpu(&c, "messaging", &[("message_type", "other"), ("to_number", "1")]), None);
        assert_eq!(rpu(&c, "other", &[("to_number", "1")]), None);
    }

    #[test]
    fn a_key_value_match_wins_over_the_key_alone() {
        let c = parse(
            "domain: edge_proxy_per_ip\ndescriptors:\n  - key: remote_address\n    rate_limit:\n      unit: second\n      requests_per_unit: 10\n  - key: remote_address\n    value: 50.0.0.5\n    rate_limit:\n      unit: second\n      requests_per_unit: 0\n",
        );
        assert_eq!(rpu(&c, "edge_proxy_per_ip", &[("remote_address", "50.0.0.1")]), Some(10));
        assert_eq!(rpu(&c, "edge_proxy_per_ip", &[("remote_address", "50.0.0.5")]), Some(0));
    }

    #[test]
    fn a_request_deeper_than_the_configuration_matches_nothing() {
        let c = parse("domain: example4\ndescriptors:\n  - key: key\n    value: value\n    rate_limit:\n      requests_per_unit: 300\n      unit: second\n");
        assert_eq!(rpu(&c, "example4", &[("key", "value"), ("subkey", "subvalue")]), None);
        assert_eq!(rpu(&c, "example4", &[("key", "value")]), Some(300));
    }

    #[test]
    fn wildcards_match_anywhere_in_the_value() {
        let c = parse(
            "domain: d\ndescriptors:\n  - key: key1\n    value: value*\n    rate_limit: {unit: minute, requests_per_unit: 20}\n  - key: path\n    value: /api/*/action\n    rate_limit: {unit: minute, requests_per_unit: 21}\n  - key: route\n    value: /api/*/resource/*/action\n    rate_limit: {unit: minute, requests_per_unit: 22}\n",
        );
        assert_eq!(rpu(&c, "d", &[("key1", "value1")]), Some(20));
        assert_eq!(rpu(&c, "d", &[("key1", "value")]), Some(20));
        assert_eq!(rpu(&c, "d", &[("key1", "valu")]), None);
        assert_eq!(rpu(&c, "d", &[("path", "/api/123/action")]), Some(21));
        assert_eq!(rpu(&c, "d", &[("path", "/api/123/other")]), None);
        assert_eq!(rpu(&c, "d", &[("route", "/api/v1/resource/123/action")]), Some(22));
        assert_eq!(rpu(&c, "d", &[("route", "/api/v1/resource/123/other")]), None);
    }

    #[test]
    fn shared_wildcards_key_their_counter_by_the_pattern() {
        let c = parse("domain: d\ndescriptors:\n  - key: files\n    value: files/*\n    share_threshold: true\n    rate_limit: {unit: hour, requests_per_unit: 10}\n  - key: other\n    value: o/*\n    rate_limit: {unit: hour, requests_per_unit: 10}\n");
        assert_eq!(c.find("d", &[("files", "files/a.pdf")]).unwrap().shared, vec![Some("files/*".to_owned())]);
        assert_eq!(c.find("d", &[("other", "o/a")]).unwrap().shared, vec![None]);
    }

    #[test]
    fn unlimited_and_whitelisted_descriptors() {
        let c = parse("domain: internal\ndescriptors:\n  - key: ldap\n    rate_limit:\n      unlimited: true\n  - key: azure\n    rate_limit:\n      unit: minute\n      requests_per_unit: 100\n  - key: free\n");
        let ldap = c.find("internal", &[("ldap", "x")]).unwrap().rule;
        assert!(ldap.unlimited && ldap.limit.is_none());
        assert_eq!(rpu(&c, "internal", &[("azure", "x")]), Some(100));
        assert!(c.find("internal", &[("free", "x")]).is_none());
    }

    #[test]
    fn numbers_and_addresses_are_values() {
        let c = parse("domain: 7\ndescriptors:\n  - key: n\n    value: 2061234567\n    rate_limit: {unit: SECOND, requests_per_unit: 3}\n");
        assert_eq!(rpu(&c, "7", &[("n", "2061234567")]), Some(3));
    }

    #[test]
    fn ratewall_keys_are_opt_in() {
        let c = parse("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: sliding_window}\n  - key: b\n    exact: true\n    rate_limit: {unit: minute, requests_per_unit: 10}\n  - key: c\n    rate_limit: {unit: minute, requests_per_unit: 10}\n");
        let a = c.find("d", &[("a", "")]).unwrap().rule;
        assert_eq!(a.limit.unwrap().algorithm(), Algorithm::SlidingWindow);
        assert!(c.find("d", &[("b", "")]).unwrap().rule.exact);
        let plain = c.find("d", &[("c", "")]).unwrap().rule;
        assert_eq!(plain.limit.unwrap().algorithm(), Algorithm::FixedWindow);
        assert!(!plain.exact);
    }

    #[test]
    fn unquoted_scalars_keep_their_text() {
        let c = parse("domain: 0o17\ndescriptors:\n  - key: phone\n    value: +15551234567\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: hex\n    value: 0x1F\n    rate_limit: {unit: second, requests_per_unit: 2, name: 0x10}\n  - key: flag\n    value: True\n    rate_limit: {unit: second, requests_per_unit: 3}\n  - key: 0o17\n    rate_limit: {unit: second, requests_per_unit: 4}\n  - key: none\n    value: ~\n    rate_limit: {unit: second, requests_per_unit: 5}\n");
        assert_eq!(c.domains().collect::<Vec<_>>(), ["0o17"]);
        assert_eq!(rpu(&c, "0o17", &[("phone", "+15551234567")]), Some(1));
        assert_eq!(rpu(&c, "0o17", &[("phone", "15551234567")]), None);
        assert_eq!(rpu(&c, "0o17", &[("hex", "0x1F")]), Some(2));
        assert_eq!(rpu(&c, "0o17", &[("hex", "31")]), None);
        assert_eq!(c.find("0o17", &[("hex", "0x1F")]).unwrap().rule.name, "0x10");
        assert_eq!(rpu(&c, "0o17", &[("flag", "True")]), Some(3));
        assert_eq!(rpu(&c, "0o17", &[("flag", "true")]), None);
        assert_eq!(rpu(&c, "0o17", &[("0o17", "x")]), Some(4));
        assert_eq!(rpu(&c, "0o17", &[("none", "anything")]), Some(5), "a null value is none: the key alone");
        let e = error("domain: d\ndescriptors:\n  - key: a\n    value: [1, 2]\n");
        assert_eq!((e.line, e.column), (Some(4), Some(12)), "{e}");
    }

    fn error(text: &str) -> ConfigError {
        RlsConfig::parse("bad.yaml", text).unwrap_err()
    }

    #[test]
    fn an_unknown_key_is_an_error_with_its_line() {
        let e = error("domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      burst: 3\n");
        assert_eq!(e.line, Some(7), "{e}");
        assert!(e.reason.contains("unknown field `burst`"), "{e}");
        let e = error("domain: d\nfoo: 1\n");
        assert_eq!(e.line, Some(2), "{e}");
        assert!(e.to_string().starts_with("bad.yaml:2:"), "{e}");
    }

    #[test]
    fn mistakes_envoyproxy_ratelimit_refuses_are_errors() {
        for (text, why, line) in [
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n", "invalid rate limit unit 'fortnight'", 3),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      unlimited: true\n", "should not specify rate limit unit when unlimited", 3),
            ("domain: d\ndescriptors:\n  - value: a\n", "descriptor has empty key", 3),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, name: x, replaces: [{name: x}]}\n", "replaces should not contain name of same descriptor", 3),
            ("domain: d\ndescriptors:\n  - key: a\n    share_threshold: true\n", "share_threshold can only be used with wildcard", 3),
            ("domain: d\ndescriptors:\n  - key: a\n  - key: a\n", "duplicate descriptor composite key 'd.a'", 4),
            ("descriptors: []\n", "empty domain", 0),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: leaky}\n", "unknown algorithm 'leaky'", 3),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: -1}\n", "requests_per_unit", 4),
        ] {
            let e = error(text);
            assert!(e.reason.contains(why), "{text}: {e}");
            assert_eq!(e.line, Some(line).filter(|l| *l > 0), "{text}: {e}");
        }
    }

    #[test]
    fn a_domain_lives_in_one_file() {
        let mut c = RlsConfig::default();
        c.add("a.yaml", "domain: d\n").unwrap();
        let e = c.add("b.yaml", "domain: d\n").unwrap_err();
        assert_eq!(e.file, "b.yaml");
        assert!(e.reason.contains("duplicate domain 'd'"), "{e}");
    }

    #[test]
    fn policy_names_need_no_escapes() {
        assert_eq!(policy_name("d.key_va\"l\\ue\u{e9}"), "d.key_va_l_ue_");
    }
}
