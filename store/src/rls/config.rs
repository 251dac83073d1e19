//! envoyproxy/ratelimit's YAML configuration, read as it is, validated once into typed rules,
//! and its matching: a request descriptor's most specific match at the descriptor's depth.
//!
//! The format (envoyproxy/ratelimit's README, "The configuration format"): a `domain` and a
//! tree of `descriptors`, each with a `key`, an optional `value` (`*` matches any run of
//! characters), an optional `rate_limit` {`unit`, `requests_per_unit`, `name`, `unlimited`,
//! `replaces`}, `shadow_mode`, `quota_mode` and nested `descriptors`. Its other keys are
//! accepted with its meaning: `share_threshold` (the values a wildcard matches share one counter),
//! `detailed_metric` and `value_to_metric` (metric naming: ratewall's metrics are per rule,
//! so they change nothing), `metadata` (read, not returned). ratewall's additions are
//! opt-in: `algorithm` in a `rate_limit` (`fixed_window`, the default and envoyproxy/
//! ratelimit's, `sliding_window` or `token_bucket`) and `exact` (in a `rate_limit` or on its
//! descriptor: decided at Redis on every call instead of from this process's grant), and
//! `secret` on a descriptor (its values are shown among the top offenders only as keyed
//! hashes; [`secret_by_default`] says which keys are without it).
//!
//! The file is read as envoyproxy/ratelimit's YAML library (yaml.v2) reads it: its first
//! document only; a scalar as written (`+15551234567` stays that text); booleans and counts as
//! YAML 1.1 reads them (`shadow_mode: yes`, `off`; `requests_per_unit: 10_000`, `017`, octal);
//! a float value (`value: 1.5` unquoted) an error; merge keys (`<<: *anchor`) in document
//! order; a `rate_limit` without `requests_per_unit` is 0 (every hit over the limit). A key it knows where that key is not read (`name` on a descriptor,
//! `shadow_mode` in a `rate_limit`) is skipped, as there, with a warning
//! ([`RlsConfig::warnings`]). A key unknown anywhere is an error, reported with its file, line
//! and reason; so are an empty key or domain, a duplicate descriptor or domain, an unknown
//! unit, a unit beside `unlimited: true`, and the other mistakes envoyproxy/ratelimit refuses.

use ratewall_core::key::HashKey;
use ratewall_core::{Algorithm, Limit, Nanos, SECOND};
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
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
    /// `quota_mode`: over its limit, its status says so, but the call is over the limit only
    /// when an enforced limit that is not a quota is, or every quota of the call is.
    pub quota: bool,
    /// `rate_limit.replaces`: the names of the limits this one drops from a call.
    pub replaces: Vec<String>,
    /// The core limit (None: unlimited, or `requests_per_unit: 0`, which denies every hit).
    pub limit: Option<Limit>,
    /// Decided at Redis on every call.
    pub exact: bool,
    /// The rule's name among the top offenders (`GET /v1/top`): `policy`, or `DOMAIN
    /// (override)` for a request's `limit` override (one per domain, whatever the values), cut
    /// to the 64 bytes a sync batch's top section carries.
    pub top_name: String,
    /// Its place in the configuration, in file order (`usize::MAX`: an override).
    pub order: usize,
}

/// How a request's `limit` override is named where its runtime values are not shown (a metric's
/// `rule` label, the top offenders' rule).
pub const OVERRIDE: &str = "(override)";

/// Longest rule name among the top offenders (a top section's).
pub const MAX_TOP_NAME: usize = 64;

/// `name` as the top offenders name a rule: itself, or when longer than [`MAX_TOP_NAME`]
/// bytes its start and `#` with 8 hex digits of a hash of the whole (two long names stay
/// apart).
fn top_name(name: &str) -> String {
    if name.len() <= MAX_TOP_NAME {
        return name.to_owned();
    }
    let mut cut = MAX_TOP_NAME - 9;
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut out = String::with_capacity(MAX_TOP_NAME);
    out.push_str(name.get(..cut).unwrap_or(""));
    ratewall_core::key::push_hashed(&mut out, ratewall_core::key::fnv1a(name.as_bytes()));
    out
}

impl Rule {
    /// The `rls.proto` `RateLimit` this rule reports (`current_limit`).
    pub fn unit_proto(&self) -> i32 {
        self.unit.map_or(0, Unit::proto)
    }

    /// A rule for a request descriptor's `limit` override: a fixed window, enforced, no name,
    /// its policy named `shown`.
    pub fn overriding(
        domain: &str,
        full_key: String,
        shown: &str,
        requests_per_unit: u32,
        unit: Unit,
    ) -> Result<Rule, String> {
        let limit = core_limit(Algorithm::FixedWindow, requests_per_unit, unit)?;
        Ok(Rule {
            domain: domain.to_owned(),
            top_name: top_name(&format!("{domain} {OVERRIDE}")),
            order: usize::MAX,
            policy: policy_name(shown),
            full_key,
            name: String::new(),
            unit: Some(unit),
            requests_per_unit,
            unlimited: false,
            shadow: false,
            quota: false,
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
    /// Its values are secret: shown only as keyed hashes.
    secret: bool,
}

/// What a request descriptor matched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Matched {
    /// The rule.
    pub rule: Arc<Rule>,
    /// Per entry of the descriptor, the value its counter is keyed by when not its own (a
    /// `share_threshold` wildcard's pattern).
    pub shared: Vec<Option<String>>,
    /// Per entry of the descriptor, whether its value is secret (`secret` on the descriptor
    /// it matched, else [`secret_by_default`]).
    pub secret: Vec<bool>,
}

/// Whether a descriptor key's values are secret when its descriptor does not say: a key
/// whose name, in any case, contains what credentials are named by — `key` (`api_key`,
/// `x-api-key`, `access-key`; but not Envoy's `generic_key`, whose value is the route's
/// constant), `token`, `secret`, `auth`, `session`, `passw`, `cookie`, `jwt` or `credential`.
/// Shown as a hash, a value that is not secret only loses readability; shown as it is, a
/// secret is out.
pub fn secret_by_default(key: &str) -> bool {
    const PARTS: [&[u8]; 9] =
        [b"key", b"token", b"secret", b"auth", b"session", b"passw", b"cookie", b"jwt", b"credential"];
    let key = key.as_bytes();
    if key.eq_ignore_ascii_case(b"generic_key") {
        return false;
    }
    // Compared byte by byte (no allocation: it runs for every entry of a call no rule matched).
    PARTS.iter().any(|p| key.windows(p.len()).any(|w| w.eq_ignore_ascii_case(p)))
}

/// A validated configuration: its domains.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RlsConfig {
    /// Each domain's descriptors, and the file it is in.
    domains: BTreeMap<String, (Level, String)>,
    /// Every rule, in file order (for `ratewall check` and the metrics).
    pub rules: Vec<Arc<Rule>>,
    /// What the files say that is not read, as envoyproxy/ratelimit does not read it either: a
    /// known key where it does not belong, the documents after a file's first.
    pub warnings: Vec<ConfigError>,
    /// The key a secret value written in the files is shown by in the rules' names: the
    /// deployment's ([`RlsConfig::load_keyed`]); without one, a key of no secret.
    shown_by: Option<HashKey>,
}

impl RlsConfig {
    /// Reads `path`: one YAML file, or every `*.yaml` / `*.yml` file in a directory (dotfiles
    /// skipped, in name order; a domain may appear in one file only).
    ///
    /// A directory without such a file is an error, not a configuration of no limit: a service
    /// started on it would answer every call OK, and a reload of it (files being replaced)
    /// keeps the last good configuration.
    pub fn load(path: &Path) -> Result<RlsConfig, ConfigError> {
        RlsConfig::load_keyed(path, None)
    }

    /// [`RlsConfig::load`], a secret value written in the files shown in the rules' names
    /// (policy names, metrics, top offenders, errors) as `#` and 8 hex digits of its hash
    /// under `key` (the deployment's): an `api_key` descriptor's `value` is as secret in the
    /// configuration as in a call.
    pub fn load_keyed(path: &Path, key: Option<HashKey>) -> Result<RlsConfig, ConfigError> {
        let mut config = RlsConfig { shown_by: key, ..RlsConfig::default() };
        let files = files(path)?;
        if files.is_empty() {
            return Err(no_yaml(path));
        }
        for file in files {
            let name = file.display().to_string();
            let text = read_at_most(&file).map_err(|reason| ConfigError {
                file: name.clone(),
                line: None,
                column: None,
                reason,
            })?;
            config.add(&name, &text)?;
        }
        Ok(config)
    }

    /// Parses one file's text (named `file` in errors) into a configuration.
    pub fn parse(file: &str, text: &str) -> Result<RlsConfig, ConfigError> {
        RlsConfig::parse_keyed(file, text, None)
    }

    /// [`RlsConfig::parse`] with secret values shown as [`RlsConfig::load_keyed`] shows them.
    pub fn parse_keyed(file: &str, text: &str, key: Option<HashKey>) -> Result<RlsConfig, ConfigError> {
        let mut config = RlsConfig { shown_by: key, ..RlsConfig::default() };
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
        // libyaml's scanner takes time in the flow nesting for every token (quadratic: 40,000
        // `[` took 17 s); nesting past the parser's recursion limit fails anyway, so it is
        // refused before it is scanned.
        if let Some(line) = too_deep(text) {
            return Err(ConfigError {
                file: file.to_owned(),
                line: Some(line),
                column: None,
                reason: format!("flow collections ([ ] and {{ }}) nested deeper than {MAX_FLOW_DEPTH}"),
            });
        }
        // The first document, as envoyproxy/ratelimit reads it; the others are not read.
        let mut documents = serde_norway::Deserializer::from_str(text);
        let Some(first) = documents.next() else {
            return Err(ConfigError {
                file: file.to_owned(),
                line: None,
                column: None,
                reason: "the file holds no YAML document".into(),
            });
        };
        let raw = RawFile::deserialize(first).map_err(at)?;
        // envoyproxy/ratelimit takes only strings, integers (of 64 bits, signed) and booleans
        // as values (its `validateYamlKeys`): a float, or an integer past `i64::MAX`, is an
        // error there, though its text would read as a string here.
        if let Some(document) = serde_norway::Deserializer::from_str(text).next() {
            if let Some((key, number)) =
                serde_norway::Value::deserialize(document).ok().as_ref().and_then(|v| leaf(v, ""))
            {
                let line = text.lines().position(|l| {
                    l.trim_start()
                        .trim_start_matches("- ")
                        .strip_prefix(key.as_str())
                        .and_then(|r| r.strip_prefix(':'))
                        .is_some_and(|r| r.trim().parse::<f64>().ok() == number.as_f64())
                });
                let line = line.map(|i| i + 1);
                return Err(ConfigError {
                    file: file.to_owned(),
                    line,
                    column: column_of_line(text, line, &key),
                    reason: format!(
                        "`{key}: {number}` is neither a string, an integer nor a boolean, which envoyproxy/ratelimit refuses (quote it to make it a string)"
                    ),
                });
            }
        }
        let warn =
            |line: Option<usize>, reason: String| ConfigError { file: file.to_owned(), line, column: None, reason };
        if documents.next().is_some() {
            let starts = text.lines().enumerate().filter(|(_, l)| l.starts_with("---")).map(|(i, _)| i + 1);
            let first_content = text.lines().position(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'));
            let opens = first_content.is_some_and(|i| text.lines().nth(i).is_some_and(|l| l.starts_with("---")));
            let line = starts.clone().nth(usize::from(opens));
            self.warnings.push(warn(line, "only the first YAML document of a file is read (as envoyproxy/ratelimit reads it); the others are ignored".into()));
        }
        for k in &raw.unread {
            let line = text.lines().position(|l| l.starts_with(&format!("{k}:"))).map(|i| i + 1);
            self.warnings.push(warn(
                line,
                format!("`{k}` is not read at the top of a file (envoyproxy/ratelimit ignores it there)"),
            ));
        }
        let domain_line = text.lines().position(|l| l.trim_start().starts_with("domain")).map(|i| i + 1);
        // The column of `token` on `line` (else of the line's first character), counted in
        // characters from 1.
        let column_of = |line: Option<usize>, token: &str| {
            let l = text.lines().nth(line?.checked_sub(1)?)?;
            let at = l.find(token).or_else(|| l.find(|c: char| !c.is_whitespace()))?;
            Some(l.get(..at)?.chars().count() + 1)
        };
        let whole = |reason: String| ConfigError {
            file: file.to_owned(),
            line: domain_line,
            column: column_of(domain_line, "domain"),
            reason,
        };
        let domain = raw.domain.map(|d| d.0).unwrap_or_default();
        if domain.is_empty() {
            return Err(whole("config file cannot have empty domain".into()));
        }
        if let Some((_, other)) = self.domains.get(&domain) {
            return Err(whole(format!("duplicate domain '{domain}': {other} has it too (each domain is in one file)")));
        }
        // Which descriptor, found in the text (serde keeps no positions past parsing): the
        // `nth` line naming `key`. The lines naming each key are found in one pass over the
        // text, when a first error or warning asks (not once for each: a file may warn of
        // every descriptor).
        let named_at: std::cell::OnceCell<HashMap<&str, Vec<usize>>> = std::cell::OnceCell::new();
        let line_of = |key: &str, nth: usize| {
            let named_at = named_at.get_or_init(|| {
                let mut at: HashMap<&str, Vec<usize>> = HashMap::new();
                for (i, l) in text.lines().enumerate() {
                    let l = l.trim_start().trim_start_matches("- ").trim();
                    if let Some(named) =
                        l.strip_prefix("key:").map(|v| v.trim().trim_matches(|c| c == '"' || c == '\''))
                    {
                        at.entry(named).or_default().push(i + 1);
                    }
                }
                at
            });
            named_at.get(key).and_then(|lines| lines.get(nth)).copied().or(domain_line)
        };
        let mut level = Level::default();
        // The rules of the files before this one first: a rule's place is its index.
        let mut rules = std::mem::take(&mut self.rules);
        let before = rules.len();
        let mut unread = Vec::new();
        let descriptors = raw.descriptors.unwrap_or_default();
        let mut policies = HashMap::new();
        let shown_by = self.shown_by.unwrap_or_else(|| HashKey::derive(b""));
        let out = (&mut rules, &mut policies, &mut unread, &shown_by);
        let built = build(&mut level, &domain, &format!("{domain}."), descriptors, out);
        if built.is_err() {
            rules.truncate(before);
        }
        self.rules = rules;
        built.map_err(|(reason, key, nth)| {
            let line = line_of(&key, nth);
            ConfigError { file: file.to_owned(), line, column: column_of(line, "key"), reason }
        })?;
        for (reason, key, nth) in unread {
            self.warnings.push(warn(line_of(&key, nth), reason));
        }
        self.domains.insert(domain, (level, file.to_owned()));
        Ok(())
    }

    /// The rule a request descriptor's entries (`(key, value)`) select in `domain`, as
    /// envoyproxy/ratelimit selects it: at each level the entry's `key_value`, else the first
    /// wildcard entry that matches it, else its `key` alone; a rule only at the level of the
    /// descriptor's last entry. None: no limit applies (unmatched, or a descriptor with
    /// neither limit nor children).
    pub fn find(&self, domain: &str, entries: &[(&str, &str)]) -> Option<Matched> {
        let mut level = &self.domains.get(domain)?.0;
        let mut shared = vec![None; entries.len()];
        let mut secret = vec![false; entries.len()];
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
            if let Some(slot) = secret.get_mut(i) {
                *slot = entry.secret;
            }
            if i + 1 == entries.len() {
                return entry.rule.as_ref().map(|r| Matched { rule: Arc::clone(r), shared, secret });
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

/// What [`build`] adds to: the rules, by index, each domain's rules by policy name (the
/// rules of one build are one domain's), and the fields not read; and the key secret values
/// are shown by.
type Out<'a> = (&'a mut Vec<Arc<Rule>>, &'a mut HashMap<String, Vec<usize>>, &'a mut Vec<BuildError>, &'a HashKey);

fn build(
    level: &mut Level,
    domain: &str,
    parent: &str,
    descriptors: Vec<RawDescriptor>,
    (rules, policies, unread, shown_by): Out<'_>,
) -> Result<(), BuildError> {
    let composites = descriptors.iter().map(|d| {
        let (key, value) = (d.key.as_ref().map_or("", |k| k.0.as_str()), d.value.as_ref().map_or("", |v| v.0.as_str()));
        composite_key(key, value)
    });
    let mut met = Met::new(composites.collect());
    for d in descriptors {
        let key = d.key.map(|k| k.0).unwrap_or_default();
        let value = d.value.map(|v| v.0).unwrap_or_default();
        // Descriptors of this key met so far, in file order (an approximation for nested
        // trees: enough to point at the right line in the common case).
        let seen = met.count(&key);
        let composite = composite_key(&key, &value);
        let secret = d.secret.map_or_else(|| secret_by_default(&key), |f| f.0);
        // Named without a secret value: it would be in every name the rule is known by, and
        // in every message about the descriptor.
        let shown = if secret && !value.is_empty() {
            let mut hashed = String::new();
            ratewall_core::key::push_hashed(&mut hashed, shown_by.hash(value.as_bytes()));
            composite_key(&key, &hashed)
        } else {
            composite.clone()
        };
        let full_key = format!("{parent}{shown}");
        if level.entries.contains_key(&composite) {
            return Err((format!("duplicate descriptor composite key '{full_key}'"), key, seen));
        }
        for k in &d.unread {
            let why = format!("{full_key}: `{k}` is not read here (envoyproxy/ratelimit ignores it)");
            unread.push((why, key.clone(), seen));
        }
        let rule = match d.limit {
            None => None,
            Some(r) => {
                let exact = r.exact || d.exact.is_some_and(|f| f.0);
                let unit = r.unit;
                let limit = match unit {
                    Some(u) if !r.unlimited => core_limit(r.algorithm, r.requests_per_unit, u)
                        .map_err(|e| (format!("{full_key}: rate_limit: {e}"), key.clone(), seen))?,
                    _ => None,
                };
                let (shadow, quota) = (d.shadow_mode.is_some_and(|f| f.0), d.quota_mode.is_some_and(|f| f.0));
                // Another limit of the domain whose policy reads the same (one `name` given to
                // two limits, or two names alike but for characters replaced) is told apart by
                // `~2`, `~3`…: merged into one item, one of the limits was not in the fields.
                // So is one that enforces otherwise (a `shadow_mode` limit beside an enforced
                // one): one rule among the top offenders would mix what each denied.
                let base = policy_name(if r.name.is_empty() { &full_key } else { &r.name });
                let other = |o: &Rule, policy: &str| {
                    o.domain == domain
                        && o.policy == policy
                        && (o.unit, o.requests_per_unit, o.limit, o.shadow, o.quota)
                            != (unit, r.requests_per_unit, limit, shadow, quota)
                };
                let mut policy = base.clone();
                for n in 2.. {
                    let named = policies.get(&policy).map_or(&[][..], Vec::as_slice);
                    if !named.iter().filter_map(|&i| rules.get(i)).any(|o| other(o, &policy)) {
                        break;
                    }
                    policy = format!("{base}~{n}");
                }
                policies.entry(policy.clone()).or_default().push(rules.len());
                // A name a limit of another domain (an earlier file's) is listed under already:
                // this domain's is listed as `DOMAIN NAME`, as an override is.
                let mut listed = top_name(&policy);
                if rules.iter().any(|o| o.domain != domain && o.top_name == listed) {
                    listed = top_name(&format!("{domain} {policy}"));
                }
                let rule = Arc::new(Rule {
                    domain: domain.to_owned(),
                    top_name: listed,
                    order: rules.len(),
                    policy,
                    full_key: full_key.clone(),
                    name: r.name,
                    unit,
                    requests_per_unit: r.requests_per_unit,
                    unlimited: r.unlimited,
                    shadow,
                    quota,
                    replaces: r.replaces,
                    limit,
                    exact,
                });
                rules.push(Arc::clone(&rule));
                Some(rule)
            }
        };
        let shared = if d.share_threshold.is_some_and(|f| f.0) {
            if !composite.contains('*') {
                let why = format!(
                    "share_threshold can only be used with wildcard values (containing '*'), but found key '{shown}'"
                );
                return Err((why, key, seen));
            }
            Some(value)
        } else {
            None
        };
        if composite.contains('*') {
            level.wildcards.push((composite.clone(), composite.split('*').map(str::to_owned).collect()));
        }
        let mut children = Level::default();
        let out = (&mut *rules, &mut *policies, &mut *unread, shown_by);
        build(&mut children, domain, &format!("{full_key}."), d.descriptors.unwrap_or_default(), out)?;
        met.add(&composite);
        level.entries.insert(composite, Entry { rule, children, shared, secret });
    }
    Ok(())
}

/// envoyproxy/ratelimit's composite key of a descriptor: `key`, or `key_value`.
fn composite_key(key: &str, value: &str) -> String {
    if value.is_empty() {
        key.to_owned()
    } else {
        format!("{key}_{value}")
    }
}

/// The composite keys of one level's descriptors met so far, to count those of a key (the
/// key itself, or one that starts with `key_`) in log n: a Fenwick tree of counts over the
/// level's composite keys in sorted order, where those that start with `key_` are one run
/// (from `key_` up to `key` and the byte after `_`, a backquote). A level of n descriptors
/// takes n·log n, not the n² of scanning those met for each.
struct Met {
    /// Every composite key of the level, sorted, once each.
    sorted: Vec<String>,
    /// The Fenwick tree: `tree[i - 1]` counts those met among `sorted[i - (i & -i)..i]`.
    tree: Vec<usize>,
}

impl Met {
    fn new(mut composites: Vec<String>) -> Met {
        composites.sort_unstable();
        composites.dedup();
        let tree = vec![0; composites.len()];
        Met { sorted: composites, tree }
    }

    /// Counts one more met of `composite` (one of the level's).
    fn add(&mut self, composite: &str) {
        let Ok(at) = self.sorted.binary_search_by(|s| s.as_str().cmp(composite)) else { return };
        let mut i = at + 1;
        while let Some(n) = self.tree.get_mut(i - 1) {
            *n += 1;
            i += i & i.wrapping_neg();
        }
    }

    /// How many met are among the first `end` in sorted order.
    fn before(&self, end: usize) -> usize {
        let (mut i, mut sum) = (end, 0);
        while i > 0 {
            sum += self.tree.get(i - 1).copied().unwrap_or(0);
            i -= i & i.wrapping_neg();
        }
        sum
    }

    /// How many met are `key` or start with `key_`.
    fn count(&self, key: &str) -> usize {
        let rank = |bound: &str| self.sorted.partition_point(|s| s.as_str() < bound);
        let exact = match self.sorted.binary_search_by(|s| s.as_str().cmp(key)) {
            Ok(at) => self.before(at + 1) - self.before(at),
            Err(_) => 0,
        };
        let (from, to) = (rank(&format!("{key}_")), rank(&format!("{key}`")));
        exact + self.before(to) - self.before(from)
    }
}

/// The most bytes one configuration file may hold: far past a real one (40,000 descriptors
/// take under 3 MiB), and a bound on what a path to an endless file (`/dev/zero`, a pipe) or a
/// mistaken one makes the service and `ratewall check` read.
pub const MAX_FILE: usize = 16 << 20;

/// Deepest nesting of flow collections read (serde_norway refuses past 128 levels anyway).
const MAX_FLOW_DEPTH: usize = 128;

/// The line (1-based) where `text`'s flow collections nest deeper than [`MAX_FLOW_DEPTH`], in
/// one linear pass. Brackets in comments and in quoted scalars (a quote that starts a token,
/// closed on its line) are not counted; brackets in plain or block scalars may be, which only
/// over-counts.
fn too_deep(text: &str) -> Option<usize> {
    let b = text.as_bytes();
    let (mut depth, mut line, mut i, mut plain) = (0usize, 1usize, 0usize, false);
    let space = |j: usize| b.get(j).is_none_or(|c| matches!(c, b' ' | b'\t' | b'\r' | b'\n'));
    while let Some(&c) = b.get(i) {
        match c {
            b'\n' => {
                line += 1;
                // A block scalar's line may begin with a quote; in a flow a plain scalar goes on.
                plain &= depth > 0;
            }
            b' ' | b'\t' | b'\r' => {}
            b'#' if i == 0 || space(i - 1) => {
                while b.get(i + 1).is_some_and(|c| *c != b'\n') {
                    i += 1;
                }
                plain = false;
            }
            b'"' | b'\'' if !plain => {
                // To its closing quote on this line; unclosed, it is read as text.
                let mut j = i + 1;
                let end = loop {
                    match b.get(j) {
                        None | Some(b'\n') => break None,
                        Some(b'\\') if c == b'"' => j += 1,
                        Some(b'\'') if c == b'\'' && b.get(j + 1) == Some(&b'\'') => j += 1,
                        Some(&q) if q == c => break Some(j),
                        _ => {}
                    }
                    j += 1;
                };
                if let Some(end) = end {
                    i = end;
                }
            }
            b'[' | b'{' => {
                plain = false;
                depth += 1;
                if depth > MAX_FLOW_DEPTH {
                    return Some(line);
                }
            }
            b']' | b'}' | b',' => {
                plain = false;
                if c != b',' {
                    depth = depth.saturating_sub(1);
                }
            }
            b':' if space(i + 1) || (depth > 0 && b.get(i + 1).is_some_and(|c| b",[]{}".contains(c))) => plain = false,
            b'-' | b'?' if !plain && space(i + 1) => {}
            _ => plain = true,
        }
        i += 1;
    }
    None
}

/// A file's text, read to at most [`MAX_FILE`] bytes and one more (never all of an endless
/// input): `Err` the reason when it cannot be read, holds more or is not UTF-8.
fn read_at_most(file: &Path) -> Result<String, String> {
    use std::io::Read as _;
    let f = std::fs::File::open(file).map_err(|e| e.to_string())?;
    let mut bytes = Vec::new();
    let limit = u64::try_from(MAX_FILE).unwrap_or(u64::MAX).saturating_add(1);
    f.take(limit).read_to_end(&mut bytes).map_err(|e| e.to_string())?;
    if bytes.len() > MAX_FILE {
        // A file says its size; what does not (a device, a pipe) is at least one byte over.
        let size = std::fs::metadata(file).ok().filter(std::fs::Metadata::is_file).map(|m| m.len());
        let has = size.map_or_else(|| format!("more than {MAX_FILE}"), |n| n.to_string());
        return Err(format!(
            "has {has} bytes; at most {MAX_FILE} ({} MiB) are read from a configuration file",
            MAX_FILE >> 20
        ));
    }
    // As `read_to_string` says it.
    String::from_utf8(bytes).map_err(|_| "stream did not contain valid UTF-8".to_owned())
}

/// The first value of `v` (under the key `key`) that is a float or an integer past
/// `i64::MAX`, with its key; `metadata` holds anything.
fn leaf(v: &serde_norway::Value, key: &str) -> Option<(String, serde_norway::Number)> {
    use serde_norway::Value;
    match v {
        Value::Number(n) if n.is_f64() || (n.is_u64() && n.as_i64().is_none()) => Some((key.to_owned(), n.clone())),
        Value::Mapping(m) => m.iter().find_map(|(k, v)| match k.as_str() {
            Some("metadata") => None,
            Some(k) => leaf(v, k),
            None => leaf(v, key),
        }),
        Value::Sequence(items) => items.iter().find_map(|v| leaf(v, key)),
        Value::Tagged(t) => leaf(&t.value, key),
        _ => None,
    }
}

/// The column of `token` on the 1-based `line` of `text`, counted in characters from 1.
fn column_of_line(text: &str, line: Option<usize>, token: &str) -> Option<usize> {
    let l = text.lines().nth(line?.checked_sub(1)?)?;
    Some(l.get(..l.find(token)?)?.chars().count() + 1)
}

/// The error for a directory without a `.yaml` / `.yml` file, pointing at a rules document
/// there, which is most likely what was meant.
fn no_yaml(path: &Path) -> ConfigError {
    let mut reason = "no rate limit service configuration in it (no .yaml or .yml file)".to_owned();
    let json = std::fs::read_dir(path).ok().and_then(|entries| {
        let mut json: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.extension().is_some_and(|e| e.eq_ignore_ascii_case("json")))
            .collect();
        json.sort();
        json.into_iter().next()
    });
    if let Some(json) = json {
        reason.push_str(&format!("; to check the rules document in it: ratewall check {}", json.display()));
    }
    ConfigError { file: path.display().to_string(), line: None, column: None, reason }
}

/// Directories below a configuration directory that are read (envoyproxy/ratelimit reads its
/// runtime directory's whole tree); deeper ones are not.
const MAX_DEPTH: usize = 8;

/// The YAML files `path` names: the file, or those in the directory and the directories below
/// it (to [`MAX_DEPTH`]), in path order, names starting with `.` left out (a Kubernetes
/// ConfigMap's `..data` and its timestamped twin hold the same files again). A symbolic link
/// to a directory below it is not followed, as envoyproxy/ratelimit's walk does not: one that
/// led back up read the same files again (a duplicate domain), and one out of the directory
/// had the tree above it walked.
pub fn files(path: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let name = path.display().to_string();
    let io = |e: std::io::Error| ConfigError { file: name.clone(), line: None, column: None, reason: e.to_string() };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out = Vec::new();
    let mut dirs = vec![(path.to_path_buf(), 0)];
    while let Some((dir, depth)) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).map_err(io)? {
            let entry = entry.map_err(io)?;
            let p = entry.path();
            let file = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if file.starts_with('.') {
                continue;
            }
            let linked = entry.file_type().map_err(io)?.is_symlink();
            if p.is_dir() && linked {
                continue;
            }
            if p.is_dir() {
                if depth < MAX_DEPTH {
                    dirs.push((p, depth + 1));
                }
            } else if (file.ends_with(".yaml") || file.ends_with(".yml")) && p.is_file() {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// What [`stamp`] sees of each file `path` names: its name, the file it resolves to through
/// symbolic links, its inode, modification time and size.
pub type Stamp = Vec<(PathBuf, Option<PathBuf>, u64, Option<std::time::SystemTime>, u64)>;

/// What `path` names, to see a change: a file edited, replaced by a rename, or swapped in by
/// moving a symbolic link (a Kubernetes ConfigMap's `..data`), even with the same size and
/// modification time as the one before.
pub fn stamp(path: &Path) -> Stamp {
    let mut out: Stamp = files(path)
        .unwrap_or_default()
        .into_iter()
        .map(|p| {
            let meta = std::fs::metadata(&p).ok();
            #[cfg(unix)]
            let inode = meta.as_ref().map_or(0, std::os::unix::fs::MetadataExt::ino);
            #[cfg(not(unix))]
            let inode = 0;
            let (m, len) = (meta.as_ref().and_then(|m| m.modified().ok()), meta.map_or(0, |m| m.len()));
            let real = std::fs::canonicalize(&p).ok();
            (p, real, inode, m, len)
        })
        .collect();
    if out.is_empty() {
        out.push((path.to_path_buf(), None, 0, None, 0));
    }
    out
}

/// Every key a value not read may hold: envoyproxy/ratelimit's (its `validKeys`, the first
/// [`KNOWN`] of them), then ratewall's additions.
const ANY_KEY: [&str; 19] = [
    "domain",
    "key",
    "value",
    "descriptors",
    "rate_limit",
    "unit",
    "requests_per_unit",
    "unlimited",
    "shadow_mode",
    "quota_mode",
    "name",
    "replaces",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
    "algorithm",
    "exact",
    "secret",
];

/// How many of [`ANY_KEY`] envoyproxy/ratelimit knows.
const KNOWN: usize = 16;

/// The keys envoyproxy/ratelimit knows. One of them where it does not belong (`name` on a
/// descriptor, `shadow_mode` in a `rate_limit`) is not read, as envoyproxy/ratelimit's YAML
/// library skips it, and is warned about; any other key is an error.
const KNOWN_KEYS: &[&str] = ANY_KEY.split_at(KNOWN).0;

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

/// A boolean as envoyproxy/ratelimit's YAML library (yaml.v2, YAML 1.1) reads one: `true` /
/// `false` in any of their cases, and `yes` / `no`, `y` / `n`, `on` / `off` (as `Yes`, `YES`,
/// …), which YAML 1.2 — and so serde_norway — takes for strings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Flag(bool);

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Flag, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Flag;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a boolean")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Flag, E> {
                Ok(Flag(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Flag, E> {
                match v {
                    "y" | "Y" | "yes" | "Yes" | "YES" | "true" | "True" | "TRUE" | "on" | "On" | "ON" => Ok(Flag(true)),
                    "n" | "N" | "no" | "No" | "NO" | "false" | "False" | "FALSE" | "off" | "Off" | "OFF" => {
                        Ok(Flag(false))
                    }
                    _ => Err(E::invalid_type(de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// A count (`requests_per_unit`) as yaml.v2 reads an integer: underscores are ignored, and
/// `0x`, `0o`, `0b` and a leading `0` (octal: `017` is 15) give its base; YAML 1.2 takes
/// `10_000` and `017` for strings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Count(u32);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Count, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Count;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an integer from 0 to 4294967295")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Count, E> {
                u32::try_from(v).map(Count).map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Count, E> {
                u32::try_from(v).map(Count).map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Count, E> {
                let digits: String = v.chars().filter(|c| *c != '_').collect();
                let plain = digits.strip_prefix('+').unwrap_or(&digits);
                let (radix, rest) = match plain.get(..2) {
                    Some("0x" | "0X") => (16, plain.get(2..)),
                    Some("0o" | "0O") => (8, plain.get(2..)),
                    Some("0b" | "0B") => (2, plain.get(2..)),
                    _ if plain.len() > 1 && plain.starts_with('0') => (8, plain.get(1..)),
                    _ => (10, Some(plain)),
                };
                rest.filter(|r| !r.is_empty() && !r.starts_with(['+', '-']))
                    .and_then(|r| u64::from_str_radix(r, radix).ok())
                    .map_or(Err(E::invalid_type(de::Unexpected::Str(v), &self)), |n| self.visit_u64(n))
            }
        }
        d.deserialize_any(V)
    }
}

/// A mapping key, as met in a mapping of some kind.
enum Key {
    /// One of the mapping's own.
    Own(&'static str),
    /// A key envoyproxy/ratelimit knows, where it is not read.
    Unread(String),
    /// `<<`: a YAML merge key.
    Merge,
}

/// Reads a mapping key among `own` (unknown anywhere: an error, at the key).
struct KeySeed(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Key;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Key, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = Key;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a key")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
        if v == "<<" {
            return Ok(Key::Merge);
        }
        if let Some(own) = self.0.iter().find(|k| **k == v) {
            return Ok(Key::Own(own));
        }
        if KNOWN_KEYS.contains(&v) {
            return Ok(Key::Unread(v.to_owned()));
        }
        Err(E::unknown_field(v, self.0))
    }
}

/// One kind of mapping of the format, read key by key as envoyproxy/ratelimit's YAML library
/// reads it into its struct: a key given twice, or by a merge (`<<: *anchor`), takes the last
/// value met (a `rate_limit` met again is merged into the one before, field by field).
trait Fields: Default {
    /// Its own keys.
    const KEYS: &'static [&'static str];
    /// Reads the value of its key `key`.
    fn read<'de, A: MapAccess<'de>>(&mut self, key: &'static str, map: &mut A) -> Result<(), A::Error>;
    /// Takes what a merged mapping sets.
    fn merge(&mut self, other: Self);
    /// Keys met that are not read here.
    fn unread(&mut self) -> &mut Vec<String>;
    /// Checks the whole mapping (merges done); an error points at the mapping.
    fn check(&mut self) -> Result<(), String> {
        Ok(())
    }
}

/// Reads a mapping of kind `T`; `check`: a whole one (not a part merged into another).
struct FieldsVisitor<T> {
    check: bool,
    kind: std::marker::PhantomData<T>,
}

impl<T> FieldsVisitor<T> {
    fn new(check: bool) -> FieldsVisitor<T> {
        FieldsVisitor { check, kind: std::marker::PhantomData }
    }
}

impl<'de, T: Fields> Visitor<'de> for FieldsVisitor<T> {
    type Value = T;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a mapping")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<T, A::Error> {
        let mut out = T::default();
        while let Some(key) = map.next_key_seed(KeySeed(T::KEYS))? {
            match key {
                Key::Own(k) => out.read(k, &mut map)?,
                Key::Unread(k) => {
                    map.next_value::<Unread>()?;
                    out.unread().push(k);
                }
                Key::Merge => {
                    let Merged(parts) = map.next_value::<Merged<T>>()?;
                    // Of a list of mappings, the earlier ones win: merged last.
                    for part in parts.into_iter().rev() {
                        out.merge(part);
                    }
                }
            }
        }
        if self.check {
            out.check().map_err(de::Error::custom)?;
        }
        Ok(out)
    }
}

/// A whole mapping of kind `T`.
fn fields<'de, D: serde::Deserializer<'de>, T: Fields>(d: D) -> Result<T, D::Error> {
    d.deserialize_map(FieldsVisitor::new(true))
}

/// The value of a merge key: a mapping, or a list of them, of kind `T`.
struct Merged<T>(Vec<T>);

impl<'de, T: Fields> Deserialize<'de> for Merged<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Merged<T>, D::Error> {
        struct Part<T>(std::marker::PhantomData<T>);
        impl<'de, T: Fields> DeserializeSeed<'de> for Part<T> {
            type Value = T;
            fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
                d.deserialize_map(FieldsVisitor::new(false))
            }
        }
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Fields> Visitor<'de> for V<T> {
            type Value = Merged<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a mapping or a list of mappings to merge")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Merged<T>, A::Error> {
                Ok(Merged(vec![FieldsVisitor::new(false).visit_map(map)?]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Merged<T>, A::Error> {
                let mut parts = Vec::new();
                while let Some(p) = seq.next_element_seed(Part(std::marker::PhantomData))? {
                    parts.push(p);
                }
                Ok(Merged(parts))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// A value not read (a known key where it does not belong), checked as envoyproxy/ratelimit
/// checks every value: a mapping's keys are known ones, a list's items are mappings.
struct Unread;

impl<'de> Deserialize<'de> for Unread {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Unread, D::Error> {
        d.deserialize_any(UnreadVisitor("a value"))
    }
}

/// Reads a value not read; `.0`: what it expects.
struct UnreadVisitor(&'static str);

impl<'de> Visitor<'de> for UnreadVisitor {
    type Value = Unread;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Unread, A::Error> {
        while let Some(key) = map.next_key_seed(KeySeed(&ANY_KEY))? {
            match key {
                // Arbitrary, as in envoyproxy/ratelimit.
                Key::Own("metadata") => {
                    map.next_value::<de::IgnoredAny>()?;
                }
                _ => {
                    map.next_value::<Unread>()?;
                }
            }
        }
        Ok(Unread)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Unread, A::Error> {
        struct Item;
        impl<'de> DeserializeSeed<'de> for Item {
            type Value = Unread;
            fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Unread, D::Error> {
                d.deserialize_map(UnreadVisitor("a mapping"))
            }
        }
        while seq.next_element_seed(Item)?.is_some() {}
        Ok(Unread)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Unread, E> {
        Ok(Unread)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Unread, E> {
        Ok(Unread)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Unread, E> {
        Ok(Unread)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Unread, E> {
        Ok(Unread)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Unread, E> {
        Ok(Unread)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Unread, E> {
        Ok(Unread)
    }
    fn visit_none<E: de::Error>(self) -> Result<Unread, E> {
        Ok(Unread)
    }
}

/// Sets `slot` to what `v` holds, if anything.
fn take<T>(slot: &mut Option<T>, v: Option<T>) {
    if v.is_some() {
        *slot = v;
    }
}

/// A file's first document.
#[derive(Default)]
struct RawFile {
    domain: Option<Text>,
    descriptors: Option<Vec<RawDescriptor>>,
    unread: Vec<String>,
}

impl Fields for RawFile {
    const KEYS: &'static [&'static str] = &["domain", "descriptors"];
    fn read<'de, A: MapAccess<'de>>(&mut self, key: &'static str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "domain" => self.domain = map.next_value()?,
            _ => self.descriptors = map.next_value()?,
        }
        Ok(())
    }
    fn merge(&mut self, o: RawFile) {
        take(&mut self.domain, o.domain);
        take(&mut self.descriptors, o.descriptors);
        self.unread.extend(o.unread);
    }
    fn unread(&mut self) -> &mut Vec<String> {
        &mut self.unread
    }
}

impl<'de> Deserialize<'de> for RawFile {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<RawFile, D::Error> {
        fields(d)
    }
}

/// One descriptor as written; [`Fields::check`] validates it and its `rate_limit`.
#[derive(Default)]
struct RawDescriptor {
    key: Option<Text>,
    value: Option<Text>,
    rate_limit: Option<RawRateLimitFields>,
    descriptors: Option<Vec<RawDescriptor>>,
    shadow_mode: Option<Flag>,
    quota_mode: Option<Flag>,
    share_threshold: Option<Flag>,
    exact: Option<Flag>,
    secret: Option<Flag>,
    unread: Vec<String>,
    /// The `rate_limit`, validated.
    limit: Option<RawRateLimit>,
}

impl Fields for RawDescriptor {
    const KEYS: &'static [&'static str] = &[
        "key",
        "value",
        "rate_limit",
        "descriptors",
        "shadow_mode",
        "quota_mode",
        "detailed_metric",
        "value_to_metric",
        "share_threshold",
        "metadata",
        "exact",
        "secret",
    ];
    fn read<'de, A: MapAccess<'de>>(&mut self, key: &'static str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "key" => self.key = map.next_value()?,
            "value" => self.value = map.next_value()?,
            "rate_limit" => match (self.rate_limit.as_mut(), map.next_value::<Option<RawRateLimitFields>>()?) {
                (Some(old), Some(new)) => old.merge(new),
                (_, new) => self.rate_limit = new,
            },
            "descriptors" => self.descriptors = map.next_value()?,
            "shadow_mode" => self.shadow_mode = map.next_value()?,
            "share_threshold" => self.share_threshold = map.next_value()?,
            "exact" => self.exact = map.next_value()?,
            "secret" => self.secret = map.next_value()?,
            "quota_mode" => self.quota_mode = map.next_value()?,
            // Metric naming and metadata only: read, they change nothing here.
            "metadata" => {
                map.next_value::<Option<serde_norway::Value>>()?;
            }
            _ => {
                map.next_value::<Option<bool>>()?;
            }
        }
        Ok(())
    }
    fn merge(&mut self, o: RawDescriptor) {
        take(&mut self.key, o.key);
        take(&mut self.value, o.value);
        match (self.rate_limit.as_mut(), o.rate_limit) {
            (Some(old), Some(new)) => old.merge(new),
            (_, new) => take(&mut self.rate_limit, new),
        }
        take(&mut self.descriptors, o.descriptors);
        take(&mut self.shadow_mode, o.shadow_mode);
        take(&mut self.quota_mode, o.quota_mode);
        take(&mut self.share_threshold, o.share_threshold);
        take(&mut self.exact, o.exact);
        take(&mut self.secret, o.secret);
        self.unread.extend(o.unread);
    }
    fn unread(&mut self) -> &mut Vec<String> {
        &mut self.unread
    }
    fn check(&mut self) -> Result<(), String> {
        if self.key.as_ref().is_none_or(|k| k.0.is_empty()) {
            return Err("descriptor has empty key".into());
        }
        if let Some(r) = self.rate_limit.take() {
            self.unread.extend(r.unread.iter().map(|k| format!("rate_limit.{k}")));
            self.unread.extend(
                r.replaces.iter().flatten().flat_map(|p| &p.unread).map(|k| format!("rate_limit.replaces.{k}")),
            );
            self.limit = Some(RawRateLimit::try_from(r)?);
        }
        Ok(())
    }
}

impl<'de> Deserialize<'de> for RawDescriptor {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<RawDescriptor, D::Error> {
        fields(d)
    }
}

/// A validated `rate_limit`.
struct RawRateLimit {
    unit: Option<Unit>,
    requests_per_unit: u32,
    unlimited: bool,
    name: String,
    replaces: Vec<String>,
    algorithm: Algorithm,
    exact: bool,
}

/// A `rate_limit` as written.
#[derive(Default)]
struct RawRateLimitFields {
    unit: Option<Text>,
    requests_per_unit: Option<Count>,
    unlimited: Option<Flag>,
    name: Option<Text>,
    replaces: Option<Vec<RawReplace>>,
    algorithm: Option<Text>,
    exact: Option<Flag>,
    unread: Vec<String>,
}

impl Fields for RawRateLimitFields {
    const KEYS: &'static [&'static str] =
        &["unit", "requests_per_unit", "unlimited", "name", "replaces", "algorithm", "exact"];
    fn read<'de, A: MapAccess<'de>>(&mut self, key: &'static str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "unit" => self.unit = map.next_value()?,
            "requests_per_unit" => self.requests_per_unit = map.next_value()?,
            "unlimited" => self.unlimited = map.next_value()?,
            "name" => self.name = map.next_value()?,
            "replaces" => self.replaces = map.next_value()?,
            "algorithm" => self.algorithm = map.next_value()?,
            _ => self.exact = map.next_value()?,
        }
        Ok(())
    }
    fn merge(&mut self, o: RawRateLimitFields) {
        take(&mut self.unit, o.unit);
        take(&mut self.requests_per_unit, o.requests_per_unit);
        take(&mut self.unlimited, o.unlimited);
        take(&mut self.name, o.name);
        take(&mut self.replaces, o.replaces);
        take(&mut self.algorithm, o.algorithm);
        take(&mut self.exact, o.exact);
        self.unread.extend(o.unread);
    }
    fn unread(&mut self) -> &mut Vec<String> {
        &mut self.unread
    }
}

impl<'de> Deserialize<'de> for RawRateLimitFields {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<RawRateLimitFields, D::Error> {
        d.deserialize_map(FieldsVisitor::new(false))
    }
}

/// A `replaces` entry.
#[derive(Default)]
struct RawReplace {
    name: Option<Text>,
    unread: Vec<String>,
}

impl Fields for RawReplace {
    const KEYS: &'static [&'static str] = &["name"];
    fn read<'de, A: MapAccess<'de>>(&mut self, _: &'static str, map: &mut A) -> Result<(), A::Error> {
        self.name = map.next_value()?;
        Ok(())
    }
    fn merge(&mut self, o: RawReplace) {
        take(&mut self.name, o.name);
        self.unread.extend(o.unread);
    }
    fn unread(&mut self) -> &mut Vec<String> {
        &mut self.unread
    }
}

impl<'de> Deserialize<'de> for RawReplace {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<RawReplace, D::Error> {
        fields(d)
    }
}

impl TryFrom<RawRateLimitFields> for RawRateLimit {
    type Error = String;
    fn try_from(r: RawRateLimitFields) -> Result<RawRateLimit, String> {
        let unit_name = r.unit.map(|u| u.0).unwrap_or_default();
        let unit = Unit::from_name(&unit_name);
        let unlimited = r.unlimited.is_some_and(|f| f.0);
        if unlimited {
            if unit.is_some() {
                return Err("should not specify rate limit unit when unlimited".into());
            }
        } else if unit.is_none() {
            return Err(format!(
                "invalid rate limit unit '{unit_name}' (second, minute, hour, day, week, month or year)"
            ));
        }
        let name = r.name.map(|n| n.0).unwrap_or_default();
        let mut replaces = Vec::new();
        for p in r.replaces.unwrap_or_default() {
            let p = p.name.map(|n| n.0).unwrap_or_default();
            if p.is_empty() {
                return Err("should not have an empty replaces entry".into());
            }
            if p == name {
                return Err("replaces should not contain name of same descriptor".into());
            }
            replaces.push(p);
        }
        let algorithm = match r.algorithm.as_ref().map(|a| a.0.as_str()) {
            None | Some("fixed_window") => Algorithm::FixedWindow,
            Some("sliding_window") => Algorithm::SlidingWindow,
            Some("token_bucket") => Algorithm::TokenBucket,
            Some(other) => {
                return Err(format!("unknown algorithm '{other}' (fixed_window, sliding_window or token_bucket)"))
            }
        };
        if unlimited && r.algorithm.is_some() {
            return Err("an unlimited rate_limit takes no algorithm".into());
        }
        Ok(RawRateLimit {
            unit: if unlimited { None } else { unit },
            // None: 0, as envoyproxy/ratelimit reads it — every hit is over the limit.
            requests_per_unit: r.requests_per_unit.map_or(0, |c| c.0),
            unlimited,
            name,
            replaces,
            algorithm,
            exact: r.exact.is_some_and(|f| f.0),
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
    fn booleans_and_integers_read_as_yaml_1_1_reads_them() {
        let c = parse(
            "domain: d\ndescriptors:\n  - key: a\n    shadow_mode: yes\n    rate_limit: {unit: second, requests_per_unit: 10_000}\n  - key: b\n    shadow_mode: Off\n    rate_limit: {unit: second, requests_per_unit: 017}\n  - key: c\n    quota_mode: ON\n    rate_limit: {unit: second, requests_per_unit: 0x1F}\n  - key: e\n    rate_limit: {unlimited: y}\n  - key: f\n    exact: n\n    rate_limit: {unit: second, requests_per_unit: 0b101}\n",
        );
        let rule = |k: &str| c.find("d", &[(k, "v")]).map(|m| m.rule).unwrap();
        assert_eq!((rule("a").requests_per_unit, rule("a").shadow), (10_000, true));
        assert_eq!((rule("b").requests_per_unit, rule("b").shadow), (15, false));
        assert_eq!((rule("c").requests_per_unit, rule("c").quota), (31, true));
        assert!(rule("e").unlimited);
        assert_eq!((rule("f").requests_per_unit, rule("f").exact), (5, false));
        for bad in [
            "shadow_mode: maybe",
            "shadow_mode: 1",
            "rate_limit: {unit: second, requests_per_unit: 0x}",
            "rate_limit: {unit: second, requests_per_unit: 09}",
            "rate_limit: {unit: second, requests_per_unit: 4294967296}",
            "rate_limit: {unit: second, requests_per_unit: -1}",
        ] {
            let text = format!("domain: d\ndescriptors:\n  - key: a\n    {bad}\n");
            assert!(RlsConfig::parse("t.yaml", &text).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_float_value_is_refused_as_envoyproxy_ratelimit_refuses_it_and_a_quoted_one_is_text() {
        let e = RlsConfig::parse("t.yaml", "domain: d\ndescriptors:\n  - key: version\n    value: 1.5\n    rate_limit: {unit: second, requests_per_unit: 1}\n").unwrap_err();
        assert_eq!((e.line, e.column), (Some(4), Some(5)));
        assert!(e.reason.contains("`value: 1.5` is neither a string"), "{}", e.reason);
        let e = RlsConfig::parse("t.yaml", "domain: d\ndescriptors:\n  - key: n\n    value: 9223372036854775808\n")
            .unwrap_err();
        assert_eq!(e.line, Some(4));
        let c = parse("domain: d\ndescriptors:\n  - key: version\n    value: '1.5'\n    metadata: {weight: 0.5}\n    rate_limit: {unit: second, requests_per_unit: 1}\n");
        assert_eq!(rpu(&c, "d", &[("version", "1.5")]), Some(1));
    }

    #[test]
    fn flow_collections_nested_past_the_parsers_limit_are_refused_before_they_are_scanned() {
        // 40,000 levels took libyaml's scanner 17 s (each token costs the depth it is at).
        let deep = format!("domain: d\ndescriptors: {}{}\n", "[".repeat(40_000), "]".repeat(40_000));
        let e = RlsConfig::parse("t.yaml", &deep).unwrap_err();
        assert_eq!(e.line, Some(2));
        assert!(e.reason.contains("nested deeper than 128"), "{}", e.reason);
        // Brackets in quoted values and comments are text.
        let c = parse(&format!(
            "domain: d # {open}\ndescriptors:\n  - key: k\n    value: \"{open}\"\n    rate_limit: {{unit: second, requests_per_unit: 2}}\n",
            open = "[".repeat(200)
        ));
        assert_eq!(rpu(&c, "d", &[("k", &"[".repeat(200))]), Some(2));
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

    #[test]
    fn a_known_key_out_of_place_is_not_read_and_warned_about() {
        let c = parse("domain: d\nname: top\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: b\n    name: not-here\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      shadow_mode: true\n      quota_mode: true\n      replaces: [{name: x, unit: second}]\n");
        let b = c.find("d", &[("b", "")]).unwrap().rule;
        assert!(!b.shadow, "shadow_mode in a rate_limit is not read");
        assert_eq!(b.replaces, ["x"]);
        let warned: Vec<(Option<usize>, &str)> = c.warnings.iter().map(|w| (w.line, w.reason.as_str())).collect();
        assert_eq!(
            warned,
            [
                (Some(2), "`name` is not read at the top of a file (envoyproxy/ratelimit ignores it there)"),
                (Some(6), "d.b: `name` is not read here (envoyproxy/ratelimit ignores it)"),
                (Some(6), "d.b: `rate_limit.shadow_mode` is not read here (envoyproxy/ratelimit ignores it)"),
                (Some(6), "d.b: `rate_limit.quota_mode` is not read here (envoyproxy/ratelimit ignores it)"),
                (Some(6), "d.b: `rate_limit.replaces.unit` is not read here (envoyproxy/ratelimit ignores it)"),
            ]
        );
        // What is not read is still checked as envoyproxy/ratelimit checks it.
        for (text, why, line) in [
            ("domain: d\nrate_limit:\n  burst: 1\n", "unknown field `burst`", 3),
            (
                "domain: d\ndescriptors:\n  - key: a\n    replaces: [x]\n",
                "invalid type: string \"x\", expected a mapping",
                4,
            ),
            ("domain: d\ndescriptors:\n  - key: a\n    algorithm: sliding_window\n", "unknown field `algorithm`", 4),
        ] {
            let e = error(text);
            assert!(e.reason.contains(why), "{text}: {e}");
            assert_eq!(e.line, Some(line), "{text}: {e}");
        }
    }

    #[test]
    fn merge_keys_merge_as_envoyproxy_ratelimit_reads_them() {
        let c = parse("domain: d\ndescriptors:\n  - key: a\n    rate_limit: &per_minute\n      unit: minute\n      requests_per_unit: 10\n  - key: b\n    rate_limit:\n      <<: *per_minute\n      requests_per_unit: 20\n  - &base\n    key: c\n    rate_limit: {unit: hour, requests_per_unit: 3}\n  - <<: *base\n    value: special\n  - key: e\n    <<: [{value: first}, {value: second, shadow_mode: true}]\n    rate_limit: {unit: day, requests_per_unit: 1}\n");
        let b = c.find("d", &[("b", "x")]).unwrap().rule;
        assert_eq!((b.unit, b.requests_per_unit), (Some(Unit::Minute), 20));
        let special = c.find("d", &[("c", "special")]).unwrap().rule;
        assert_eq!(
            (special.unit, special.requests_per_unit, special.full_key.as_str()),
            (Some(Unit::Hour), 3, "d.c_special")
        );
        let e = c.find("d", &[("e", "first")]).unwrap().rule;
        assert!(e.shadow, "the earlier mapping of a list wins, the later ones fill in");
        assert!(c.find("d", &[("e", "second")]).is_none());
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        let e = error("domain: d\ndescriptors:\n  - key: a\n    <<: 5\n");
        assert!(e.reason.contains("a mapping or a list of mappings to merge") && e.line == Some(4), "{e}");
    }

    #[test]
    fn a_rate_limit_without_requests_per_unit_denies_every_hit() {
        let c = parse("domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n");
        let a = c.find("d", &[("a", "x")]).unwrap().rule;
        assert_eq!((a.requests_per_unit, a.limit, a.unlimited), (0, None, false));
    }

    #[test]
    fn only_a_files_first_document_is_read() {
        let c = parse("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n---\ndomain: e\nbogus: [\n");
        assert_eq!(c.domains().collect::<Vec<_>>(), ["d"]);
        assert_eq!(c.warnings.len(), 1);
        assert_eq!(c.warnings[0].line, Some(5));
        assert!(c.warnings[0].reason.contains("only the first YAML document"), "{:?}", c.warnings);
        let c = parse("---\ndomain: d\n---\ndomain: e\n");
        assert_eq!((c.domains().collect::<Vec<_>>(), c.warnings[0].line), (vec!["d"], Some(3)));
    }

    #[test]
    fn a_descriptors_values_are_secret_when_it_says_or_by_its_keys_name() {
        let c = parse(
            "domain: d\ndescriptors:\n  - key: api_key\n    rate_limit: {unit: hour, requests_per_unit: 1}\n  - key: partner\n    secret: true\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 1}\n  - key: Authorization\n    secret: false\n    rate_limit: {unit: hour, requests_per_unit: 1}\n",
        );
        assert_eq!(c.find("d", &[("api_key", "k")]).unwrap().secret, [true]);
        assert_eq!(c.find("d", &[("partner", "p"), ("user", "u")]).unwrap().secret, [true, false]);
        assert_eq!(c.find("d", &[("Authorization", "a")]).unwrap().secret, [false], "said not");
        for (key, secret) in [
            ("X-API-KEY", true),
            ("x_api_key", true),
            ("token", true),
            ("refresh_token", true),
            ("client_secret", true),
            ("Private-Token", true),
            ("session_id", true),
            ("user", false),
            ("ip", false),
            ("remote_address", false),
            ("generic_key", false),
        ] {
            assert_eq!(secret_by_default(key), secret, "{key}");
        }
    }

    #[test]
    fn quota_mode_is_read_on_a_descriptor() {
        let c = parse("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: b\n    quota_mode: true\n    rate_limit: {unit: minute, requests_per_unit: 2}\n  - key: c\n    quota_mode: false\n    rate_limit: {unit: minute, requests_per_unit: 2}\n");
        assert!(!c.find("d", &[("a", "")]).unwrap().rule.quota);
        assert!(c.find("d", &[("b", "")]).unwrap().rule.quota);
        assert!(!c.find("d", &[("c", "")]).unwrap().rule.quota);
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        let e = error("domain: d\ndescriptors:\n  - key: a\n    quota_mode: sometimes\n");
        assert_eq!(e.line, Some(4), "{e}");
    }

    /// A file in the shape of envoyproxy/ratelimit's own example configuration: a leading
    /// document marker, `replaces` naming a limit of another branch and one no limit has,
    /// named limits, a blocklist of 0, shadow and unlimited leaves, `detailed_metric`, and
    /// quota-mode descriptors with `metadata`.
    const ENVOYPROXY_SHAPED: &str = include_str!("../../tests/data/envoyproxy-shaped.yaml");

    #[test]
    fn a_file_shaped_as_envoyproxy_ratelimits_example_loads() {
        let c = parse(ENVOYPROXY_SHAPED);
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        assert_eq!(c.rules.len(), 12);
        let primary = c.find("shop", &[("backend", "primary")]).unwrap().rule;
        assert!(primary.quota && !primary.shadow);
        assert_eq!((primary.unit, primary.requests_per_unit), (Some(Unit::Hour), 1));
        assert!(c.find("shop", &[("backend", "fallback")]).unwrap().rule.quota);
        let limited = c.find("shop", &[("buyer", "b"), ("item", "limited")]).unwrap().rule;
        assert_eq!((limited.name.as_str(), limited.quota), ("per_buyer", false));
        assert!(c.find("shop", &[("buyer", "b"), ("coupon", "trial")]).unwrap().rule.shadow);
        assert!(c.find("shop", &[("buyer", "b"), ("gift", "g")]).unwrap().rule.unlimited);
        assert_eq!(c.find("shop", &[("tier", "gold")]).unwrap().rule.replaces, ["per_buyer", "no_such_limit"]);
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
            // Where there is a line there is a column.
            assert_eq!(e.column.is_some(), line > 0, "{text}: {e}");
        }
        let e = error("domain: d\ndescriptors:\n  - key: a\n  - key: a\n");
        assert_eq!((e.line, e.column), (Some(4), Some(5)), "{e}");
    }

    /// The count of a key's descriptors met that points an error at its line is the one a
    /// scan of those met gives: the key itself, or a composite key that starts with `key_`.
    #[test]
    fn descriptors_met_are_counted_as_a_scan_counts_them() {
        let mut met: Vec<(&str, String)> = [
            ("user", "a"),
            ("user", ""),
            ("user_a_b", ""),
            ("user", "b_c"),
            ("users", "x"),
            ("user`", ""),
            ("use", "r_z"),
            ("", "q"),
            ("_", ""),
            ("user", "*"),
            ("a", "\u{e9}"),
            ("a_", ""),
        ]
        .map(|(k, v)| (k, v.to_owned()))
        .into();
        // And enough more (none twice, as a level has none), for a tree of some depth.
        let more = ["user", "user_a", "a", "b", "use", "_"];
        met.extend((0..300u32).map(|i| (more[(i * 7 % 6) as usize], ((i * 37) % 101).to_string())));
        let composites = met.iter().map(|(k, v)| composite_key(k, v)).collect();
        let mut counted = Met::new(composites);
        let keys = ["user", "user_a", "use", "users", "user`", "", "_", "a", "a_", "b"];
        for (n, (k, v)) in met.iter().enumerate() {
            for key in keys {
                let scan = met[..n]
                    .iter()
                    .map(|(k, v)| composite_key(k, v))
                    .filter(|c| c == key || c.starts_with(&format!("{key}_")))
                    .count();
                assert_eq!(counted.count(key), scan, "{key:?} after {n}");
            }
            counted.add(&composite_key(k, v));
        }
    }

    /// A file is read to its limit and no further: a path to an endless one is refused, not
    /// read until memory runs out.
    #[cfg(unix)]
    #[test]
    fn a_file_past_the_limit_is_refused() {
        let e = RlsConfig::load(Path::new("/dev/zero")).unwrap_err();
        assert_eq!(
            e.reason,
            format!("has more than {MAX_FILE} bytes; at most {MAX_FILE} (16 MiB) are read from a configuration file")
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_configmap_swap_to_a_file_of_the_same_size_and_time_is_seen() {
        let d = std::env::temp_dir().join(format!("ratewall-rls-swap-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        for v in ["..v1", "..v2"] {
            std::fs::create_dir_all(d.join(v)).unwrap();
        }
        let limit = |n: u32| {
            format!(
                "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {{unit: second, requests_per_unit: {n}}}\n"
            )
        };
        std::fs::write(d.join("..v1/d.yaml"), limit(2)).unwrap();
        std::fs::write(d.join("..v2/d.yaml"), limit(4)).unwrap();
        let when = std::fs::metadata(d.join("..v1/d.yaml")).unwrap().modified().unwrap();
        std::fs::File::options().write(true).open(d.join("..v2/d.yaml")).unwrap().set_modified(when).unwrap();
        std::os::unix::fs::symlink("..v1", d.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/d.yaml", d.join("d.yaml")).unwrap();
        let before = stamp(&d);
        assert_eq!(before, stamp(&d));
        // As kubelet swaps it: a new link renamed over `..data`.
        std::os::unix::fs::symlink("..v2", d.join("..data_tmp")).unwrap();
        std::fs::rename(d.join("..data_tmp"), d.join("..data")).unwrap();
        assert_ne!(before, stamp(&d));
        assert_eq!(rpu(&RlsConfig::load(&d).unwrap(), "d", &[("user", "u")]), Some(4));
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A link to a directory below the configuration's is not followed: one back up read the
    /// same file again (a duplicate domain), one out of it walked the tree above.
    #[cfg(unix)]
    #[test]
    fn links_to_directories_below_it_are_not_followed() {
        let d = std::env::temp_dir().join(format!("ratewall-rls-links-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("conf/a")).unwrap();
        std::fs::write(d.join("conf/a/x.yaml"), "domain: lp\n").unwrap();
        std::fs::write(d.join("outside.yaml"), "domain: outside\n").unwrap();
        std::os::unix::fs::symlink("..", d.join("conf/a/loop")).unwrap();
        std::os::unix::fs::symlink("../..", d.join("conf/a/up")).unwrap();
        // A link to a file is read as the file (a ConfigMap's).
        std::os::unix::fs::symlink("a/x.yaml", d.join("conf/linked.yml")).unwrap();
        assert_eq!(files(&d.join("conf")).unwrap(), [d.join("conf/a/x.yaml"), d.join("conf/linked.yml")]);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_directory_without_a_yaml_file_is_no_configuration() {
        let d = std::env::temp_dir().join(format!("ratewall-rls-empty-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("notes.txt"), "domain: d\n").unwrap();
        let e = RlsConfig::load(&d).unwrap_err();
        assert_eq!(e.reason, "no rate limit service configuration in it (no .yaml or .yml file)");
        std::fs::write(d.join("d.yml"), "domain: d\n").unwrap();
        assert_eq!(RlsConfig::load(&d).unwrap().domains().collect::<Vec<_>>(), ["d"]);
        // The directories below it too, as envoyproxy/ratelimit reads its runtime directory.
        std::fs::create_dir_all(d.join("team/a")).unwrap();
        std::fs::write(d.join("team/a/s.yaml"), "domain: s\n").unwrap();
        let mut domains: Vec<_> = RlsConfig::load(&d).unwrap().domains().map(str::to_owned).collect();
        domains.sort();
        assert_eq!(domains, ["d", "s"]);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_domain_lives_in_one_file() {
        let mut c = RlsConfig::default();
        c.add("a.yaml", "domain: d\n").unwrap();
        let e = c.add("b.yaml", "domain: d\n").unwrap_err();
        assert_eq!(e.file, "b.yaml");
        assert_eq!((e.line, e.column), (Some(1), Some(1)));
        assert_eq!(e.reason, "duplicate domain 'd': a.yaml has it too (each domain is in one file)");
    }

    #[test]
    fn top_names_are_bounded() {
        let long = "n".repeat(100);
        let shown = top_name(&long);
        assert_eq!(shown.len(), MAX_TOP_NAME);
        assert!(shown.starts_with("nnn") && shown[55..].starts_with('#'), "{shown}");
        assert_ne!(top_name(&format!("{long}x")), shown);
        assert_eq!(top_name("api.user"), "api.user");
        let c = parse("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: b\n    rate_limit: {unit: second, requests_per_unit: 1, name: named}\n");
        let names: Vec<(&str, usize)> = c.rules.iter().map(|r| (r.top_name.as_str(), r.order)).collect();
        assert_eq!(names, [("d.a", 0), ("named", 1)]);
    }

    #[test]
    fn limits_whose_policies_read_alike_are_told_apart() {
        let c = parse(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {name: same, unit: minute, requests_per_unit: 5}\n  - key: b\n    rate_limit: {name: same, unit: hour, requests_per_unit: 2}\n  - key: c\n    rate_limit: {name: same, unit: minute, requests_per_unit: 5}\n  - key: e\n    rate_limit: {name: 'p\"q', unit: minute, requests_per_unit: 5}\n  - key: f\n    rate_limit: {name: p_q, unit: hour, requests_per_unit: 100}\n",
        );
        let policy = |k: &str| c.find("d", &[(k, "x")]).map(|m| m.rule.policy.clone()).unwrap();
        // One name for the same limit is one policy; for another limit, another.
        assert_eq!([policy("a"), policy("b"), policy("c")], ["same", "same~2", "same"]);
        assert_eq!([policy("e"), policy("f")], ["p_q", "p_q~2"]);
    }

    #[test]
    fn limits_listed_alike_among_the_top_offenders_are_told_apart() {
        // A shadow limit named as an enforced one of the same quota: another policy, another rule.
        let text = "domain: DOM\ndescriptors:\n  - key: a\n    rate_limit: {name: same, unit: minute, requests_per_unit: 3}\n  - key: b\n    shadow_mode: true\n    rate_limit: {name: same, unit: minute, requests_per_unit: 3}\n  - key: c\n    rate_limit: {name: same, unit: minute, requests_per_unit: 3}\n";
        let mut c = RlsConfig::parse("one.yaml", &text.replace("DOM", "one")).unwrap();
        let listed = |c: &RlsConfig| c.rules.iter().map(|r| r.top_name.clone()).collect::<Vec<_>>();
        assert_eq!(listed(&c), ["same", "same~2", "same"]);
        // One name in two domains: the later file's listed with its domain.
        c.add("two.yaml", &text.replace("DOM", "two")).unwrap();
        assert_eq!(listed(&c), ["same", "same~2", "same", "two same", "two same~2", "two same"]);
        let policy = |k: &str| c.find("two", &[(k, "x")]).map(|m| m.rule.policy.clone()).unwrap();
        assert_eq!([policy("a"), policy("b")], ["same", "same~2"], "policies are the domain's own");
    }

    #[test]
    fn policy_names_need_no_escapes() {
        assert_eq!(policy_name("d.key_va\"l\\ue\u{e9}"), "d.key_va_l_ue_");
    }

    #[test]
    fn a_secret_value_written_in_the_file_is_named_by_its_keyed_hash() {
        let text = "domain: api
descriptors:
  - key: api_key
    value: sk_live_WRITTEN
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: tenant
    secret: true
    value: TENANT_WRITTEN
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 1}
  - key: path
    value: /public
    rate_limit: {unit: minute, requests_per_unit: 1}
";
        let key = HashKey::derive(b"a deployment's secret");
        let c = RlsConfig::parse_keyed("t.yaml", text, Some(key)).unwrap();
        let shown = |value: &str| {
            let mut s = String::new();
            ratewall_core::key::push_hashed(&mut s, key.hash(value.as_bytes()));
            s
        };
        let names: Vec<(&str, &str)> = c.rules.iter().map(|r| (r.full_key.as_str(), r.policy.as_str())).collect();
        let api = format!("api.api_key_{}", shown("sk_live_WRITTEN"));
        let tenant = format!("api.tenant_{}.user", shown("TENANT_WRITTEN"));
        assert_eq!(
            names,
            [
                (api.as_str(), api.as_str()),
                (tenant.as_str(), tenant.as_str()),
                ("api.path_/public", "api.path_/public")
            ]
        );
        // Matched by their values all the same.
        let matched = c.find("api", &[("api_key", "sk_live_WRITTEN")]);
        assert_eq!(matched.map(|m| m.rule.full_key.clone()).as_deref(), Some(api.as_str()));
        // And named so in a mistake's message.
        let dup = format!("{text}  - key: api_key\n    value: sk_live_WRITTEN\n");
        let e = RlsConfig::parse_keyed("t.yaml", &dup, Some(key)).unwrap_err();
        assert!(!e.to_string().contains("WRITTEN") && e.to_string().contains(&api), "{e}");
        // Every mistake's message about such a descriptor.
        let shared =
            "domain: api\ndescriptors:\n  - key: api_key\n    value: sk_live_WRITTEN\n    share_threshold: true\n";
        let e = RlsConfig::parse_keyed("t.yaml", shared, Some(key)).unwrap_err();
        assert!(!e.to_string().contains("WRITTEN") && e.to_string().contains(&shown("sk_live_WRITTEN")), "{e}");
    }
}
