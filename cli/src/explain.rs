//! `ratewall explain`: what the rules do with one request.

use crate::describe::{limit_as_written, limit_json, limit_text, match_as_written};
use crate::{load, Failure};
use ratewall_core::eval::{Check, Request, Skip};
use ratewall_core::glob::normalize_path;
use ratewall_core::key::{client_key, parse_ip};
use ratewall_core::rules::{Dimension, Rule};
use ratewall_core::sync::hex;
use ratewall_core::Config;
use serde_json::{json, Value};
use std::path::Path;

/// A request in the terms the core takes: the normalized path, the identity headers' values
/// (by identity index), the client IP's key.
pub struct Parts {
    pub path: String,
    pub values: Vec<Option<Vec<u8>>>,
    pub ip: Option<String>,
}

impl Parts {
    /// `headers` (name, value) as a proxy passes them; `peer` the address the request came
    /// from. The client IP is found as the filter finds it (`X-Forwarded-For` counted from
    /// its right end by `trusted_hops`, repeated fields joined).
    pub fn new(config: &Config, path: &str, headers: &[(String, String)], peer: Option<&str>) -> Parts {
        let values = config
            .identity
            .headers
            .iter()
            .map(|(_, h)| {
                headers
                    .iter()
                    .find(|(n, v)| n.eq_ignore_ascii_case(h) && !v.is_empty())
                    .map(|(_, v)| v.as_bytes().to_vec())
            })
            .collect();
        let xff: Vec<&str> = headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("x-forwarded-for"))
            .map(|(_, v)| v.as_str())
            .collect();
        let xff = (!xff.is_empty() && config.identity.ip.trusted_hops > 0).then(|| xff.join(", "));
        let src = config.identity.ip;
        let ip = client_key(|| peer.and_then(|p| parse_ip(p.as_bytes())), xff.as_deref().map(str::as_bytes), &src)
            .map(|k| k.into_owned());
        let path = normalize_path(crate::logformat::origin_form(path.as_bytes())).into_owned();
        Parts { path, values, ip }
    }

    /// The identity headers' values as the core takes them ([`Request::headers`]).
    pub fn header_values(&self) -> Vec<Option<&[u8]>> {
        self.values.iter().map(|v| v.as_deref()).collect()
    }

    /// The core's view of the request (`values`: from [`Parts::header_values`]).
    pub fn request<'a>(&'a self, method: &'a str, values: &'a [Option<&'a [u8]>]) -> Request<'a> {
        Request { method, path: &self.path, headers: values, ip: self.ip.as_deref() }
    }

    /// The plan whose limit `rule` applies to the request, as the core finds it
    /// ([`Rule::limit_for`] of the `plan` dimension's value): `None` for the rule's default
    /// limit (no plan value, or one the rule has no limit of its own for).
    pub fn plan<'r>(&self, config: &Config, rule: &'r Rule) -> Option<&'r str> {
        let value = config.identity.header_index("plan").and_then(|i| self.values.get(i)).and_then(|v| v.as_deref())?;
        rule.plans.iter().find(|(name, _)| name.as_bytes() == value).map(|(name, _)| name.as_str())
    }

    /// The client address's key as shown: as in [`Parts::key_text`], only as its keyed hash
    /// when the `ip` dimension is secret.
    pub fn ip_text(&self, config: &Config) -> Option<String> {
        let ip = self.ip.as_deref()?;
        if !config.identity.is_secret(Dimension::Ip) {
            return Some(ip.to_owned());
        }
        let mut out = String::new();
        ratewall_core::key::push_hashed(&mut out, config.identity.hash_key.hash(ip.as_bytes()));
        Some(out)
    }

    /// The rule's key as `dimension=value` pairs, shown as everywhere else
    /// ([`ratewall_core::topk::render`] of `Check::key`): secret and overlong values only as
    /// their keyed hash, and a key longer than [`ratewall_core::topk::MAX_KEY`] cut as
    /// [`ratewall_core::topk::bounded_key`] cuts it.
    pub fn key_text(&self, config: &Config, rule: &Rule) -> String {
        let identity = &config.identity;
        let mut out = String::new();
        for (i, d) in rule.key.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let v: &[u8] = match d {
                Dimension::Header(h) => self.values.get(*h).and_then(|v| v.as_deref()).unwrap_or_default(),
                Dimension::Ip => self.ip.as_deref().map(str::as_bytes).unwrap_or_default(),
            };
            out.push_str(identity.name(*d));
            out.push('=');
            if identity.is_secret(*d) || v.len() > ratewall_core::eval::MAX_PART {
                ratewall_core::key::push_hashed(&mut out, identity.hash_key.hash(v));
            } else {
                ratewall_core::key::push_value(&mut out, v);
            }
        }
        ratewall_core::topk::bounded_key(out, &identity.hash_key)
    }
}

/// Parses `name: value` header arguments. A malformed one is named by its position, not
/// echoed: it may be an API key typed without its colon.
pub fn parse_headers(args: &[String]) -> Result<Vec<(String, String)>, Failure> {
    args.iter()
        .enumerate()
        .map(|(i, h)| match h.split_once(':') {
            // A name is a token, as a request's header names are (`x user` is none: no
            // request could carry it).
            // A value is what a field may hold: no control character but a tab (a line break
            // would end it). Not echoed either: it may be a key.
            Some((_, v)) if v.bytes().any(|b| (b < 0x20 && b != b'\t') || b == 0x7f) => Err(Failure::Usage(format!(
                "-H (header argument {}): the value holds a control character, which no request could carry",
                i + 1
            ))),
            Some((n, v)) if ratewall_core::rules::is_token(n.trim().as_bytes()) => {
                Ok((n.trim().to_ascii_lowercase(), v.trim().to_owned()))
            }
            _ => Err(Failure::Usage(format!("-H (header argument {}): expected 'name: value'", i + 1))),
        })
        .collect()
}

/// Why a rule of the document does not match `method` on `path`.
fn mismatch(doc: &Value, i: usize, rule: &Rule, method: &str, path: &str) -> Option<String> {
    if rule.matcher.matches(method, path) {
        return None;
    }
    let (pattern, methods) = match_as_written(doc, i);
    let method_ok =
        rule.matcher.methods.is_empty() || rule.matcher.methods.iter().any(|m| m.eq_ignore_ascii_case(method));
    Some(if method_ok {
        format!("the path does not match {}", crate::describe::pattern_shown(&pattern.unwrap_or_default()))
    } else {
        format!("the method is not {}", methods.join(" or "))
    })
}

/// `ratewall explain`.
pub fn explain(
    rules: &Path,
    method: &str,
    path: &str,
    header_args: &[String],
    peer: Option<&str>,
    as_json: bool,
) -> Result<(), Failure> {
    let (doc, config) = load(rules)?;
    let headers = parse_headers(header_args)?;
    // A mistyped address would explain a request with no client address, as if it were right.
    if let Some(ip) = peer.filter(|ip| parse_ip(ip.as_bytes()).is_none()) {
        return Err(Failure::Usage(format!("--ip {ip:?}: not an IP address")));
    }
    // As the rules write methods: a token (a typo would explain a request no client sends).
    if !ratewall_core::rules::is_token(method.as_bytes()) {
        return Err(Failure::Usage(format!("--method {method:?}: not an HTTP method")));
    }
    let method = method.to_ascii_uppercase();
    // As replay takes a log's targets: a path, an absolute URI (whose path is matched), or
    // OPTIONS's `*`.
    if !crate::logformat::origin_form(path.as_bytes()).starts_with(b"/") && path != "*" {
        return Err(Failure::Usage(format!(
            "--path {path:?}: not a path (one starts with `/`; an absolute URI or `*` are taken too): no proxy passes such a target on"
        )));
    }
    let parts = Parts::new(&config, path, &headers, peer);
    let matching = config.matching(&method, &parts.path);
    let values = parts.header_values();
    let req = parts.request(&method, &values);
    let (checks, skipped) = config.checks_of(&req, &matching);
    let mut out = Vec::new();
    // Per counted rule, its limit in words (the text report's).
    let mut limits: Vec<String> = Vec::new();
    for (i, rule) in config.rules.iter().enumerate() {
        let check: Option<&Check> = checks.iter().find(|c| c.rule == i);
        let plan = parts.plan(&config, rule);
        let entry = if let Some(why) = mismatch(&doc, i, rule, &method, &parts.path) {
            json!({"name": rule.name, "matches": false, "counted": false, "why": why})
        } else if let Some(c) = check {
            let written = limit_as_written(&doc, i, plan);
            let limit = limit_text(&c.limit, written);
            limits.push(match plan {
                Some(p) => format!("plan {p:?} limit {limit}"),
                None if !rule.plans.is_empty() => format!("default limit {limit}"),
                None => format!("limit {limit}"),
            });
            json!({"name": rule.name, "matches": true, "counted": true, "key": parts.key_text(&config, rule),
                   "counter": hex(&c.key), "plan": plan, "limit": limit_json(&c.limit, written), "cost": c.cost,
                   "mode": if rule.mode == ratewall_core::rules::Mode::Shadow { "shadow" } else { "enforce" }})
        } else if skipped.iter().any(|&(r, why)| r == i && why == Skip::Unlimited) {
            let why = format!("its plan {:?} is unlimited under this rule", plan.unwrap_or_default());
            json!({"name": rule.name, "matches": true, "counted": false, "plan": plan, "why": why})
        } else {
            let missing: Vec<String> = rule
                .key
                .iter()
                .filter_map(|d| match d {
                    Dimension::Header(h) if parts.values.get(*h).is_none_or(Option::is_none) => {
                        config.identity.headers.get(*h).map(|(n, hdr)| format!("{n} (header {hdr})"))
                    }
                    Dimension::Ip if parts.ip.is_none() => Some("ip (no client address)".to_owned()),
                    _ => None,
                })
                .collect();
            let why = format!("the request has no {}", missing.join(" and "));
            json!({"name": rule.name, "matches": true, "counted": false, "why": why})
        };
        out.push(entry);
    }
    // A secret client address shows only as its keyed hash, as in the keys.
    let client_ip = parts.ip_text(&config);
    if as_json {
        let v = json!({"method": method, "path": parts.path, "client_ip": client_ip, "rules": out});
        say!("{v}");
        return Ok(());
    }
    say!("{method} {} (client ip {})", parts.path, client_ip.as_deref().unwrap_or("unknown"));
    let mut limits = limits.iter();
    for e in &out {
        let name = e["name"].as_str().unwrap_or("");
        match (e["matches"].as_bool(), e["counted"].as_bool()) {
            (Some(true), Some(true)) => {
                let limit = limits.next().map_or("", String::as_str);
                let cost = e["cost"].as_u64().filter(|&c| c != 1).map(|c| format!(", cost {c}")).unwrap_or_default();
                let shadow = if e["mode"] == "shadow" { " (shadow: never rejects)" } else { "" };
                say!("  counts    {name}: key {}, {limit}{cost}{shadow}", e["key"].as_str().unwrap_or(""));
                say!("            counter {}", e["counter"].as_str().unwrap_or(""));
            }
            (Some(true), _) => say!("  skips     {name}: {}", e["why"].as_str().unwrap_or("")),
            _ => say!("  no match  {name}: {}", e["why"].as_str().unwrap_or("")),
        }
    }
    Ok(())
}
