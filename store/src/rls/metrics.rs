//! The rate limit service's counts at the store's `GET /metrics`: per domain calls and a
//! latency histogram, per rule hits within the limit, over it, over it in shadow mode and
//! near it. Labels are the configuration's names only (never a descriptor's runtime value),
//! so the series are bounded by the configuration.

use super::config::{RlsConfig, Rule};
use super::{Answer, Code, Refusal};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Latency buckets, seconds.
pub const BUCKETS: [f64; 11] = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25];

/// What one descriptor's check did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Within the limit.
    Ok,
    /// Within it, with under a fifth of the quota left.
    NearLimit,
    /// Over it, enforced.
    OverLimit,
    /// Over it, in shadow mode (answered OK).
    Shadow,
    /// An unlimited descriptor.
    Unlimited,
}

/// Hits counted for one rule.
#[derive(Debug, Default)]
pub struct RuleCounts {
    /// Hits checked.
    pub total: AtomicU64,
    /// Hits over the limit (enforced).
    pub over_limit: AtomicU64,
    /// Hits over the limit in shadow mode.
    pub shadow: AtomicU64,
    /// Hits within the limit with under a fifth of it left.
    pub near_limit: AtomicU64,
    /// Hits within the limit (near it or not, and unlimited ones).
    pub within_limit: AtomicU64,
}

/// Calls of one domain.
#[derive(Debug, Default)]
struct DomainCounts {
    ok: AtomicU64,
    over_limit: AtomicU64,
    invalid: AtomicU64,
    unavailable: AtomicU64,
    /// Per bucket of [`BUCKETS`] (and +Inf), then the sum in µs.
    latency: [AtomicU64; BUCKETS.len() + 1],
    latency_sum_us: AtomicU64,
}

/// The service's metrics.
#[derive(Debug, Default)]
pub struct RlsMetrics {
    rules: Mutex<BTreeMap<(String, String), Arc<RuleCounts>>>,
    domains: Mutex<BTreeMap<String, Arc<DomainCounts>>>,
    /// Configurations loaded after the first.
    pub config_loads: AtomicU64,
    /// Configurations refused (the last good one stayed).
    pub config_errors: AtomicU64,
}

/// The rule label of hits under a request's `limit` override (its key holds runtime values).
pub use super::config::OVERRIDE;

impl RlsMetrics {
    /// Metrics for `config`'s rules.
    pub fn new(config: &RlsConfig) -> RlsMetrics {
        let m = RlsMetrics::default();
        m.set_rules(config);
        m
    }

    /// Keeps the series of `config`'s rules and domains (and forgets those it no longer has).
    pub fn set_rules(&self, config: &RlsConfig) {
        if let Ok(mut rules) = self.rules.lock() {
            let mut next = BTreeMap::new();
            for r in &config.rules {
                let key = (r.domain.clone(), r.full_key.clone());
                let counts = rules.get(&key).cloned().unwrap_or_default();
                next.insert(key, counts);
            }
            for d in config.domains() {
                let key = (d.to_owned(), OVERRIDE.to_owned());
                let counts = rules.get(&key).cloned().unwrap_or_default();
                next.insert(key, counts);
            }
            *rules = next;
        }
        if let Ok(mut domains) = self.domains.lock() {
            let mut next = BTreeMap::new();
            for d in config.domains().chain([""]) {
                next.insert(d.to_owned(), domains.get(d).cloned().unwrap_or_default());
            }
            *domains = next;
        }
    }

    /// Counts `hits` of `rule` with `outcome`.
    pub fn count(&self, rule: &Rule, hits: u64, outcome: Outcome) {
        let Ok(rules) = self.rules.lock() else { return };
        let counts = rules
            .get(&(rule.domain.clone(), rule.full_key.clone()))
            .or_else(|| rules.get(&(rule.domain.clone(), OVERRIDE.to_owned())))
            .cloned();
        drop(rules);
        let Some(c) = counts else { return };
        // A descriptor's `hits_addend` may be any u64 (a request header can give it): counted
        // as it is, one call would pin the counters at their most for good. At most a
        // request's own (u32) addend, 2^32 calls each counting the most fill them.
        let hits = hits.min(u64::from(u32::MAX));
        add(&c.total, hits);
        match outcome {
            Outcome::OverLimit => add(&c.over_limit, hits),
            Outcome::Shadow => add(&c.shadow, hits),
            Outcome::NearLimit => {
                add(&c.near_limit, hits);
                add(&c.within_limit, hits);
            }
            Outcome::Ok | Outcome::Unlimited => add(&c.within_limit, hits),
        }
    }

    /// Counts a call of `domain` ("" for one not configured) and its latency.
    pub fn observe(&self, domain: &str, took: Duration, result: &Result<Answer, Refusal>) {
        let Some(d) = self.domains.lock().ok().and_then(|d| d.get(domain).cloned()) else { return };
        let c = match result {
            Ok(a) if a.overall_code == Code::Ok => &d.ok,
            Ok(_) => &d.over_limit,
            Err(Refusal::Invalid(_)) => &d.invalid,
            Err(Refusal::Unavailable(_)) => &d.unavailable,
        };
        c.fetch_add(1, Ordering::Relaxed);
        let secs = took.as_secs_f64();
        let bucket = BUCKETS.iter().position(|b| secs <= *b).unwrap_or(BUCKETS.len());
        if let Some(b) = d.latency.get(bucket) {
            b.fetch_add(1, Ordering::Relaxed);
        }
        add(&d.latency_sum_us, u64::try_from(took.as_micros()).unwrap_or(u64::MAX));
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let rules: Vec<_> =
            self.rules.lock().map(|r| r.iter().map(|(k, v)| (k.clone(), Arc::clone(v))).collect()).unwrap_or_default();
        let domains: Vec<_> = self
            .domains
            .lock()
            .map(|d| d.iter().map(|(k, v)| (k.clone(), Arc::clone(v))).collect())
            .unwrap_or_default();
        for (name, help, pick) in [
            ("ratewall_rls_hits_total", "Hits checked per domain and rule.", 0),
            ("ratewall_rls_over_limit_total", "Hits over the limit, enforced.", 1),
            ("ratewall_rls_shadow_mode_total", "Hits over the limit in shadow mode (answered OK).", 2),
            ("ratewall_rls_near_limit_total", "Hits within the limit with under a fifth of it left.", 3),
            ("ratewall_rls_within_limit_total", "Hits within the limit.", 4),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for ((domain, rule), c) in &rules {
                let v = [&c.total, &c.over_limit, &c.shadow, &c.near_limit, &c.within_limit];
                let n = v.get(pick).map_or(0, |a| a.load(Ordering::Relaxed));
                let _ = writeln!(out, "{name}{{domain=\"{}\",rule=\"{}\"}} {n}", label(domain), label(rule));
            }
        }
        let name = "ratewall_rls_calls_total";
        let _ = writeln!(out, "# HELP {name} ShouldRateLimit calls per domain (\"\": not configured) and result.");
        let _ = writeln!(out, "# TYPE {name} counter");
        for (domain, d) in &domains {
            for (result, v) in
                [("ok", &d.ok), ("over_limit", &d.over_limit), ("invalid", &d.invalid), ("unavailable", &d.unavailable)]
            {
                let n = v.load(Ordering::Relaxed);
                let _ = writeln!(out, "{name}{{domain=\"{}\",result=\"{result}\"}} {n}", label(domain));
            }
        }
        let name = "ratewall_rls_latency_seconds";
        let _ = writeln!(out, "# HELP {name} ShouldRateLimit latency per domain.\n# TYPE {name} histogram");
        for (domain, d) in &domains {
            let dl = label(domain);
            let mut cumulative = 0;
            for (i, b) in d.latency.iter().enumerate() {
                cumulative += b.load(Ordering::Relaxed);
                match BUCKETS.get(i) {
                    Some(le) => {
                        let _ = writeln!(out, "{name}_bucket{{domain=\"{dl}\",le=\"{le}\"}} {cumulative}");
                    }
                    None => {
                        let _ = writeln!(out, "{name}_bucket{{domain=\"{dl}\",le=\"+Inf\"}} {cumulative}");
                    }
                }
            }
            let sum = d.latency_sum_us.load(Ordering::Relaxed) as f64 / 1e6;
            let _ = writeln!(out, "{name}_sum{{domain=\"{dl}\"}} {sum}\n{name}_count{{domain=\"{dl}\"}} {cumulative}");
        }
        for (name, help, v) in [
            ("ratewall_rls_config_loads_total", "Rate limit configurations reloaded.", &self.config_loads),
            (
                "ratewall_rls_config_errors_total",
                "Rate limit configurations refused (the last good one stayed).",
                &self.config_errors,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", v.load(Ordering::Relaxed));
        }
        out
    }
}

/// Adds `n` to a counter, stopping at `u64::MAX`: a call's hits are up to 2^64 - 1 (its
/// `hits_addend`), and a counter must never go down by wrapping.
fn add(counter: &AtomicU64, n: u64) {
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_add(n)));
}

/// A Prometheus label value, escaped.
fn label(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_huge_hits_addend_leaves_the_counts_counting() {
        let config = RlsConfig::parse(
            "t.yaml",
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        )
        .unwrap();
        let m = RlsMetrics::new(&config);
        let rule = &config.rules[0];
        let value = |m: &RlsMetrics, name: &str| {
            let series = format!("{name}{{domain=\"d\",rule=\"{}\"}} ", rule.full_key);
            let text = m.render();
            text.lines()
                .find(|l| l.starts_with(&series))
                .and_then(|l| l.rsplit(' ').next())
                .unwrap()
                .parse::<u64>()
                .unwrap()
        };
        for _ in 0..2 {
            m.count(rule, u64::MAX - 1, Outcome::OverLimit);
        }
        let most = 2 * u64::from(u32::MAX);
        assert_eq!(value(&m, "ratewall_rls_over_limit_total"), most);
        // Later hits still count.
        m.count(rule, 1, Outcome::OverLimit);
        m.count(rule, 1, Outcome::Ok);
        assert_eq!(value(&m, "ratewall_rls_hits_total"), most + 2);
        assert_eq!(value(&m, "ratewall_rls_over_limit_total"), most + 1);
        assert_eq!(value(&m, "ratewall_rls_within_limit_total"), 1);
        // And a counter that did fill stops there, never wrapping to small.
        let c = AtomicU64::new(u64::MAX - 1);
        add(&c, 5);
        assert_eq!(c.load(Ordering::Relaxed), u64::MAX);
    }
}
