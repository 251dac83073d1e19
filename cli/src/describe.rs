//! `ratewall check`: a rules document's rules, as text or JSON.

use crate::{load, Failure};
use ratewall_core::algo::{Algorithm, Limit, Nanos};
use ratewall_core::rules::{Dimension, FailurePolicy, HashKeySource, Mode, PlanLimit, Rule};
use ratewall_core::Config;
use serde_json::{json, Value};
use std::path::Path;

/// A duration in the rules document's terms (`1m`, `1h`, `100ms`), in the largest unit that
/// divides it: for one the document does not write (a default `hold_max`).
pub fn duration(ns: Nanos) -> String {
    const UNITS: [(Nanos, &str); 5] = [
        (86_400_000_000_000, "d"),
        (3_600_000_000_000, "h"),
        (60_000_000_000, "m"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
    ];
    for (scale, unit) in UNITS {
        if ns >= scale && ns.is_multiple_of(scale) {
            return format!("{}{unit}", ns / scale);
        }
    }
    format!("{ns}ns")
}

/// A plan's name as the terminal may be given it: quoted and escaped (as `explain` shows it)
/// when it holds a control character, which could otherwise paint lines of its own.
pub fn plan_shown(name: &str) -> std::borrow::Cow<'_, str> {
    if name.chars().any(char::is_control) {
        format!("{name:?}").into()
    } else {
        name.into()
    }
}

/// A path pattern as the terminal may be given it: its control characters percent-encoded, as
/// a URL parser writes them (the pattern means the same).
pub fn pattern_shown(pattern: &str) -> std::borrow::Cow<'_, str> {
    if !pattern.chars().any(char::is_control) {
        return pattern.into();
    }
    let mut out = String::with_capacity(pattern.len() + 8);
    for c in pattern.chars() {
        if c.is_control() {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    out.into()
}

/// Whether the filter holds rule `r` exact: an enforced rule of a counted limit (a shadow rule
/// never waits on a rule that never rejects; a concurrency count is the proxy's own).
pub fn held_exact(r: &Rule) -> bool {
    r.exact && r.mode == Mode::Enforce && r.limit.algorithm() != Algorithm::Concurrent
}

/// A limit's period (`per`, a concurrent limit's `hold_max`) as the document writes it
/// (`60s` stays `60s`), from `written`, the limit's object in the document
/// ([`limit_as_written`]); one it does not write in the largest unit that divides it.
pub fn period(l: &Limit, written: &Value) -> String {
    let field = if l.algorithm() == Algorithm::Concurrent { "hold_max" } else { "per" };
    match written[field].as_str() {
        Some(w) => w.to_owned(),
        // The default `hold_max`, as the documentation and the schema write it.
        None if field == "hold_max" && l.per() == 60 * ratewall_core::SECOND => "60s".to_owned(),
        None => duration(l.per()),
    }
}

/// The object of the document that writes rule `i`'s limit for `plan` (`None`: its default
/// limit).
pub fn limit_as_written<'a>(doc: &'a Value, i: usize, plan: Option<&str>) -> &'a Value {
    let rule = &doc["rules"][i];
    match plan {
        Some(p) => &rule["plans"][p],
        None => &rule["limit"],
    }
}

/// A limit in words: `5 per 60s`, with its burst and algorithm (`written`: its object in the
/// document, [`limit_as_written`]).
pub fn limit_text(l: &Limit, written: &Value) -> String {
    if l.algorithm() == Algorithm::Concurrent {
        return format!("{} in flight (held at most {})", l.requests(), period(l, written));
    }
    let mut s = format!("{} per {} ({}", l.requests(), period(l, written), l.algorithm().as_str());
    match (l.algorithm(), l.burst()) {
        (Algorithm::LeakyBucket, Some(b)) => s.push_str(&format!(", burst {b}, delay {}", l.delay())),
        (_, Some(b)) => s.push_str(&format!(", burst {b}")),
        _ => {}
    }
    s.push(')');
    s
}

/// A limit as JSON, in the document's terms (`written`: its object in the document,
/// [`limit_as_written`]).
pub fn limit_json(l: &Limit, written: &Value) -> Value {
    if l.algorithm() == Algorithm::Concurrent {
        return json!({"concurrent": l.requests(), "hold_max": period(l, written)});
    }
    let mut v = json!({"requests": l.requests(), "per": period(l, written), "algorithm": l.algorithm().as_str()});
    if let Some(b) = l.burst() {
        v["burst"] = json!(b);
    }
    if l.delay() > 0 {
        v["delay"] = json!(l.delay());
    }
    v
}

/// The names of a rule's key dimensions.
pub fn key_names(config: &Config, rule: &Rule) -> Vec<String> {
    rule.key
        .iter()
        .map(|d| match d {
            Dimension::Header(i) => config.identity.headers.get(*i).map_or_else(|| "?".to_owned(), |(n, _)| n.clone()),
            Dimension::Ip => "ip".to_owned(),
        })
        .collect()
}

/// The names of a rule's key dimensions, secret ones marked (`api_key (secret)`).
fn key_names_marked(config: &Config, rule: &Rule) -> Vec<String> {
    rule.key
        .iter()
        .zip(key_names(config, rule))
        .map(|(d, n)| if config.identity.is_secret(*d) { format!("{n} (secret)") } else { n })
        .collect()
}

/// Where secret values' hash key comes from, when a rule keys on a secret dimension.
fn hash_key_source(config: &Config) -> Option<&'static str> {
    let secret = config.rules.iter().any(|r| r.key.iter().any(|d| config.identity.is_secret(*d)));
    secret.then_some(match config.identity.hash_key_source {
        HashKeySource::HashKey => "identity.hash_key",
        HashKeySource::SyncSecret if config.sync.is_some() => "sync.secret",
        // Without `sync`, the key is the deployment's, read from the environment as a Worker
        // reads it (see `deployment_secret`).
        HashKeySource::SyncSecret => "the environment's RATEWALL_SYNC_SECRET (else RATEWALL_ADMIN_TOKEN)",
        HashKeySource::BuiltIn => "built-in",
    })
}

/// The rule's `match` as written (path pattern, methods).
pub fn match_as_written(doc: &Value, i: usize) -> (Option<String>, Vec<String>) {
    let m = &doc["rules"][i]["match"];
    let path = m["path"].as_str().map(str::to_owned);
    let methods = match &m["method"] {
        Value::String(s) => vec![s.to_ascii_uppercase()],
        Value::Array(a) => a.iter().filter_map(Value::as_str).map(str::to_ascii_uppercase).collect(),
        _ => Vec::new(),
    };
    (path, methods)
}

fn mode(r: &Rule) -> &'static str {
    if r.mode == Mode::Shadow {
        "shadow"
    } else {
        "enforce"
    }
}

fn failure(r: &Rule) -> &'static str {
    if r.on_store_failure == FailurePolicy::Closed {
        "closed"
    } else {
        "open"
    }
}

/// One rule as JSON.
pub fn rule_json(doc: &Value, config: &Config, i: usize, r: &Rule) -> Value {
    let (path, methods) = match_as_written(doc, i);
    let plans: serde_json::Map<String, Value> = r
        .plans
        .iter()
        .map(|(name, l)| {
            let v = match l {
                PlanLimit::Limited(l) => limit_json(l, limit_as_written(doc, i, Some(name))),
                PlanLimit::Unlimited => json!("unlimited"),
            };
            (name.clone(), v)
        })
        .collect();
    json!({
        "name": r.name,
        "match": {"path": path, "methods": methods},
        "key": key_names(config, r),
        "limit": limit_json(&r.limit, limit_as_written(doc, i, None)),
        "plans": plans,
        "cost": r.cost,
        "mode": mode(r),
        "on_store_failure": failure(r),
        "exact": held_exact(r),
    })
}

/// `ratewall check`.
pub fn check(path: &Path, as_json: bool) -> Result<(), Failure> {
    let (doc, config) = match load(path) {
        Ok(l) => l,
        Err(Failure::Invalid(lines)) if as_json => {
            let errors: Vec<Value> = lines
                .iter()
                .map(|l| {
                    let (p, r) = l.split_once(": ").unwrap_or(("", l));
                    json!({"path": p, "reason": r})
                })
                .collect();
            say!("{}", json!({"valid": false, "errors": errors}));
            return Err(Failure::Invalid(lines));
        }
        Err(e) => return Err(e),
    };
    if as_json {
        let rules: Vec<Value> = config.rules.iter().enumerate().map(|(i, r)| rule_json(&doc, &config, i, r)).collect();
        let mut out = json!({"valid": true, "rules": rules, "sync": config.sync.is_some()});
        if let Some(source) = hash_key_source(&config) {
            out["secret_hash_key"] = json!(source);
        }
        say!("{out}");
        return Ok(());
    }
    say!("{}: valid, {} rule{}", path.display(), config.rules.len(), if config.rules.len() == 1 { "" } else { "s" });
    for (i, r) in config.rules.iter().enumerate() {
        let (pattern, methods) = match_as_written(&doc, i);
        let methods = if methods.is_empty() { "any method".to_owned() } else { methods.join(",") };
        say!("- {}", r.name);
        say!("    match: {methods} {}", pattern.as_deref().map_or("any path".into(), pattern_shown));
        say!("    key:   {}", key_names_marked(&config, r).join(" + "));
        say!(
            "    limit: {}{}",
            limit_text(&r.limit, limit_as_written(&doc, i, None)),
            if r.cost == 1 { String::new() } else { format!(", cost {}", r.cost) }
        );
        for (name, l) in &r.plans {
            match l {
                PlanLimit::Limited(l) => {
                    say!("    plan {}: {}", plan_shown(name), limit_text(l, limit_as_written(&doc, i, Some(name))))
                }
                PlanLimit::Unlimited => say!("    plan {}: unlimited", plan_shown(name)),
            }
        }
        say!(
            "    mode:  {}, on store failure {}{}",
            mode(r),
            failure(r),
            // Without `sync` there is no global counter to wait for.
            if held_exact(r) && config.sync.is_some() {
                ", exact (admits only units the global counter granted; may wait for it)"
            } else {
                ""
            }
        );
    }
    if config.sync.is_some() {
        say!("sync: on (limits are shared across proxies through the global store)");
    }
    match hash_key_source(&config) {
        Some("built-in") => say!(
            "secret values: shown as #hash under ratewall's built-in key, which anyone can hash guesses with; set identity.hash_key (or sync.secret)"
        ),
        Some(source) => say!("secret values: counted and shown only as a hash keyed by {source}"),
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duration_not_written_reads_in_its_largest_unit() {
        assert_eq!(duration(60_000_000_000), "1m");
        assert_eq!(duration(90_000_000_000), "90s");
        assert_eq!(duration(3_600_000_000_000), "1h");
        assert_eq!(duration(100_000_000), "100ms");
        assert_eq!(duration(1_500), "1500ns");
        for s in ["1s", "250ms", "2h", "7d", "45m"] {
            assert_eq!(duration(ratewall_core::rules::parse_duration(s).unwrap_or(0)), s);
        }
    }
}
