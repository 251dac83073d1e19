//! The JSON Schema (2020-12) of the rules document, with the descriptions an editor shows on
//! hover. Committed as `rules.schema.json` (a test holds it current); the parser in
//! `ratewall-core` stays the authority, and a test holds the two to the same fields.

use serde_json::{json, Value};

/// A duration above zero (the parser refuses `0s` wherever it takes one); the upper bounds of
/// each field are in its description.
const DURATION: &str = "^0*[1-9][0-9]*(ms|s|m|h|d)$";

/// `MAX_REQUESTS`: the most `requests`, `burst`, `delay` and `cost` can be.
const MAX_REQUESTS: u64 = 4_294_967_295;

/// The algorithms a rate limit may name.
const ALGORITHMS: [&str; 5] = ["token_bucket", "sliding_window", "fixed_window", "sliding_log", "leaky_bucket"];

/// `sync.cluster` as the parser takes it (`ratewall_core::rules::check_cluster`): an Envoy
/// cluster name, or a `host:port` ngx_wasm_module can parse.
const CLUSTER: &str = concat!(
    r"^(?:[^:\s\x00-\x1f\x7f-\x9f]+",
    r"|(?:[A-Za-z0-9_][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_][A-Za-z0-9_-]*)*\.?|\[[0-9A-Fa-f:.]+\])",
    r":(?:[1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5]))$"
);

/// An HTTP method as the parser takes it (`ratewall_core::rules::is_token`): an RFC 9110 token.
const METHOD: &str = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$";

fn duration(description: &str) -> Value {
    json!({"type": "string", "pattern": DURATION, "description": format!("{description} A whole number above 0 and a unit: ms, s, m, h or d (\"100ms\", \"60s\", \"1h\").")})
}

/// What a rate limit object may hold when `algorithm` is the one it runs (`None`: no
/// algorithm written, by the limit or its rule: a token bucket with `burst`, else a sliding
/// window), as `Limit::new` and `Limit::with_delay` take it: `burst` at least 1 for a token
/// bucket and none for the windows and the log, `delay` above 0 only for a leaky bucket, at most
/// 10,000 `requests` for the log.
fn under(algorithm: Option<&str>) -> Value {
    let no_delay = json!({"maximum": 0, "description": "Above 0 only for leaky_bucket."});
    match algorithm {
        Some("leaky_bucket") => json!({"properties": {"burst": {"maximum": MAX_REQUESTS - 1}}}),
        Some("sliding_log") => {
            json!({"properties": {"requests": {"maximum": 10000}, "burst": false, "delay": no_delay}})
        }
        Some("sliding_window" | "fixed_window") => json!({"properties": {"burst": false, "delay": no_delay}}),
        _ => json!({"properties": {"burst": {"minimum": 1}, "delay": no_delay}}),
    }
}

/// The name in `$defs` of what a limit holds under `algorithm` (`None`: none named).
fn def_name(prefix: &str, algorithm: Option<&str>) -> String {
    format!("{prefix}_{}", algorithm.unwrap_or("default"))
}

/// A reference to `$defs`' `name`.
fn def_ref(name: &str) -> Value {
    json!({"$ref": format!("#/$defs/{name}")})
}

/// Whether a rule or limit object names `algorithm`.
fn names(algorithm: &str) -> Value {
    json!({"required": ["algorithm"], "properties": {"algorithm": {"const": algorithm}}})
}

/// What a limit of a rule (its `limit`, or a plan's) may hold when the rule names `algorithm`
/// (`None`: it names none), which the limit runs unless it names its own: [`under`] it; and a
/// rule that names one has no concurrent limit. A plan's `"unlimited"` passes.
fn inherited(algorithm: Option<&str>) -> Value {
    let own = json!({"if": {"type": "object", "not": {"required": ["algorithm"]}}, "then": def_ref(&def_name("as", algorithm))});
    match algorithm {
        Some(_) => json!({"allOf": [own, {"not": {"type": "object", "required": ["concurrent"]}}]}),
        None => own,
    }
}

fn limit(description: &str) -> Value {
    let rate = json!({
        "type": "object",
        "description": description,
        "additionalProperties": false,
        "required": ["requests", "per"],
        "properties": {
            "requests": {"type": "integer", "minimum": 1, "maximum": MAX_REQUESTS, "description": "Units admitted per period (at most 4,294,967,295; 10,000 for sliding_log)."},
            "per": duration("The period (1ms to 366d)."),
            "burst": {"type": "integer", "minimum": 0, "maximum": MAX_REQUESTS, "description": "Token bucket capacity (at least 1; default: requests; setting it alone selects the token bucket), or how many requests a leaky bucket queues (default 0; below 4,294,967,295); no other algorithm takes one. A token bucket refills whole within 100 years (burst × per / requests)."},
            "delay": {"type": "integer", "minimum": 0, "maximum": MAX_REQUESTS, "description": "leaky_bucket only: how many of the queued requests go at once, like NGINX limit_req delay= (default 0, at most burst)."},
            "algorithm": {"$ref": "#/$defs/algorithm"}
        },
        // Its own algorithm's terms; a rule's algorithm, which it runs when it names none, is
        // held at the rule.
        "allOf": ALGORITHMS.iter().map(|a| json!({"if": names(a), "then": def_ref(&def_name("as", Some(a)))})).collect::<Vec<_>>()
    });
    let concurrent = json!({
        "type": "object",
        "description": format!("{description} At most this many requests of a key in flight."),
        "additionalProperties": false,
        "required": ["concurrent"],
        "properties": {
            "concurrent": {"type": "integer", "minimum": 1, "maximum": 10000, "description": "Requests in flight at once (per proxy in the filter, global in the Worker); over it: 429 with Retry-After: 1."},
            "hold_max": duration("A slot not given back within this is released anyway (default 60s; 1ms to 1h).")
        }
    });
    json!({"description": description, "oneOf": [rate, concurrent]})
}

/// The schema as a value.
pub fn schema() -> Value {
    let mut schema = json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://github.com/ratewall/ratewall/rules.schema.json",
        "title": "ratewall rules",
        "description": "Rate-limit rules for ratewall's proxy-wasm filter, Cloudflare Worker and CLI. Unknown fields are errors, and so is a key repeated in one object. ratewall also refuses what this schema cannot say: a key dimension that is neither ip nor one identity defines, two rules of one name, a leaky bucket's delay above its burst, a cost above a limit's capacity, a token bucket that takes over 100 years to refill, durations past their field's range (per at most 366d), a match path over 1,024 bytes or with more than 16 segments after a **, numbers that are not whole as written (1.5, and 5.0000000000000001, which a float reads as 5; 5.0 and 1e3 are whole, and taken), and a document over 1 MiB. Per-plan limits need a plan dimension under identity (the default identity has one).",
        "type": "object",
        "additionalProperties": false,
        "required": ["rules"],
        "properties": {
            "$schema": {"type": "string", "description": "This schema, for editors (a string, which ratewall does not read)."},
            "identity": {
                "type": "object",
                "description": "Where each identity dimension comes from: at most 64 header dimensions, ip, and hash_key. Default: user (x-user-id), api_key (x-api-key), partner (x-partner-id), plan (x-plan), and ip from the peer address.",
                "maxProperties": 66,
                // 64 header dimensions, and ip and hash_key when present (`MAX_DIMENSIONS`).
                "if": {"required": ["ip", "hash_key"]},
                "else": {
                    "if": {"anyOf": [{"required": ["ip"]}, {"required": ["hash_key"]}]},
                    "then": {"maxProperties": 65},
                    "else": {"maxProperties": 64}
                },
                "propertyNames": {"pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                "properties": {
                    "ip": {
                        "type": "object",
                        "description": "The client IP dimension.",
                        "additionalProperties": false,
                        "properties": {
                            "trusted_hops": {"type": "integer", "minimum": 0, "maximum": 16, "description": "Proxies in front whose X-Forwarded-For entries are trusted; 0 (default) keys on the peer address."},
                            "ipv6_prefix": {"type": "integer", "minimum": 1, "maximum": 128, "description": "IPv6 clients are keyed by this prefix (default 64)."},
                            "ipv4_prefix": {"type": "integer", "minimum": 1, "maximum": 32, "description": "IPv4 clients are keyed by this prefix (default 32)."},
                            "secret": {"type": "boolean", "description": "Count and show client addresses only as a keyed hash (#3f9a1c2e). Default false."}
                        }
                    },
                    "hash_key": {"type": "string", "minLength": 16, "description": "The deployment's key for hashing secret identity values (the same on every node). Default: derived from sync.secret, else a built-in key anyone can hash guesses with."}
                },
                "additionalProperties": {
                    "type": "object",
                    "description": "A dimension read from a request header. A dimension named plan selects per-plan limits.",
                    "additionalProperties": false,
                    "required": ["header"],
                    "properties": {
                        "header": {"type": "string", "pattern": "^[!#$%&'*+.^_`|~0-9A-Za-z-]+$", "description": "The header's name (case-insensitive)."},
                        "secret": {"type": "boolean", "description": "Count and show this dimension's values only as a keyed hash (api_key=#3f9a1c2e): no value appears in logs, metrics, sync batches, the store or admin endpoints. Default: true for api_key, false otherwise."}
                    }
                }
            },
            "rules": {
                "type": "array",
                "description": "Every matching rule is evaluated; a request is rejected if any enforcing rule rejects it, and then consumes nothing from the others.",
                "maxItems": 1000,
                "items": {"$ref": "#/$defs/rule"}
            },
            "response": {
                "type": "object",
                "description": "The client contract's options.",
                "additionalProperties": false,
                "properties": {"legacy_headers": {"type": "boolean", "description": "Also send X-RateLimit-Limit / -Remaining / -Reset (default false)."}}
            },
            "filter": {
                "type": "object",
                "description": "The proxy-wasm filter's counter table.",
                "additionalProperties": false,
                "properties": {
                    "slots": {"type": "integer", "minimum": 64, "maximum": 1048576, "description": "Counters the table holds (default 65,536), in buckets of 8."},
                    "cas_retries": {"type": "integer", "minimum": 1, "maximum": 1000, "description": "Compare-and-swap attempts per counter under contention."},
                    "hash_seed": {"description": "Keys the table's hash, so clients cannot aim their keys at one bucket: a whole number from 0 to 18,446,744,073,709,551,615, or a string.", "type": ["integer", "string"], "minimum": 0, "maximum": u64::MAX}
                }
            },
            "sync": {
                "type": "object",
                "description": "Share limits across proxies through a global store (filter only; omit it and each proxy limits on its own).",
                "additionalProperties": false,
                "required": ["cluster", "secret"],
                "properties": {
                    "cluster": {"type": "string", "minLength": 1, "pattern": CLUSTER, "description": "The upstream that reaches the store: an Envoy cluster name (no ':', no white space), or under NGINX (ngx_wasm_module) the store's host:port — a hostname the wasm{} block's resolver finds, an IPv4 address or an [IPv6] address, and a port from 1 to 65535; not a URL, not an upstream {} block."},
                    "authority": {"type": "string", "pattern": "^[!-~]+$", "description": "The :authority of sync calls (default: the cluster): visible ASCII, without spaces."},
                    "path": {"type": "string", "pattern": "^/[!-~]*$", "description": "The store's path, starting with / (default /v1/sync): visible ASCII, without spaces."},
                    "secret": {"type": "string", "minLength": 16, "description": "The HMAC secret shared with the store (never logged)."},
                    "interval": duration("Time between batches (default 100ms; 10ms to 60s)."),
                    "timeout": duration("Deadline of one sync call (default 50ms; 1ms to 10s). Set it above the store's round trip."),
                    "nodes": {"type": "integer", "minimum": 1, "maximum": 100000, "description": "Proxies to assume until the store reports how many there are (default 1)."},
                    "stale_after": duration("Global data older than this is stale: rules fall back to their on_store_failure policy (default 1s; 10ms to 1h)."),
                    "max_wait": duration("The longest a request waits for an ask to the store (default: timeout; 1ms to 10s).")
                }
            }
        },
        "allOf": [
            // Per-plan limits need a plan dimension: the default identity has one.
            {
                "if": {"required": ["identity"], "properties": {"identity": {"not": {"required": ["plan"]}}}},
                "then": {"properties": {"rules": {"items": {"not": {"required": ["plans"]}}}}}
            },
            // Without identity, the dimensions are the default ones.
            {
                "if": {"not": {"required": ["identity"]}},
                "then": {"properties": {"rules": {"items": {"properties": {"key": {"items": {"enum": ["user", "api_key", "partner", "plan", "ip"]}}}}}}}
            }
        ],
        "$defs": {
            "algorithm": {
                "enum": ["token_bucket", "sliding_window", "fixed_window", "sliding_log", "leaky_bucket"],
                "description": "token_bucket (GCRA; the default with burst), sliding_window (the default), fixed_window, sliding_log (counted per eighth of per, up to 10,000 per period), or leaky_bucket (queues: excess requests wait their turn, one per per/requests, up to burst of them)."
            },
            "rule": {
                "type": "object",
                "description": "One limit on the requests it matches, per key.",
                "additionalProperties": false,
                "required": ["name", "key", "limit"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$", "description": "Unique, compared in lowercase with - and . as _ (as metrics show it); names the policy in RateLimit headers and metrics."},
                    "description": {"type": "string", "description": "Free text for people."},
                    "match": {
                        "type": "object",
                        "description": "Which requests the rule applies to (default: all).",
                        "additionalProperties": false,
                        "properties": {
                            "path": {"type": "string", "pattern": "^/[^?#]*$", "maxLength": 1024, "description": "A path pattern, without a query or fragment (at most 1,024 bytes): a * segment matches one segment (as the last one, one or more: /v1/* covers everything below /v1), ** any number of segments (at most 16 segments may follow a ** before the next one or the end), a * inside a segment (*.json) part of one. Matching is on the normalized path."},
                            "method": {
                                "description": "An HTTP method or a list of them (default: any).",
                                "oneOf": [
                                    {"type": "string", "pattern": METHOD},
                                    {"type": "array", "minItems": 1, "maxItems": 32, "uniqueItems": true, "items": {"type": "string", "pattern": METHOD}}
                                ]
                            }
                        }
                    },
                    "key": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": 65,
                        "uniqueItems": true,
                        "description": "The identity dimensions counted together (a composite key when several), e.g. [\"api_key\", \"ip\"]: ip, or a dimension identity defines.",
                        "items": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$", "not": {"const": "hash_key"}}
                    },
                    "limit": limit("The default limit."),
                    "algorithm": {"$ref": "#/$defs/algorithm"},
                    "plans": {
                        "type": "object",
                        "description": "Per-plan limits, by the value of the plan dimension (which identity must define).",
                        "maxProperties": 1000,
                        "additionalProperties": {
                            "oneOf": [limit("This plan's limit."), {"const": "unlimited", "description": "Not limited by this rule."}]
                        }
                    },
                    "cost": {"type": "integer", "minimum": 0, "maximum": MAX_REQUESTS, "description": "Units one matching request consumes (default 1; at most a limit's capacity)."},
                    "mode": {"enum": ["enforce", "shadow"], "description": "enforce (default) rejects; shadow only counts and logs what it would reject."},
                    "on_store_failure": {"enum": ["open", "closed"], "description": "When the counter store fails: open (default) admits, closed answers 503."},
                    "exact": {"type": "boolean", "description": "Decide every request at the global counter (the Worker asks the key's Durable Object each time) instead of spending a grant held locally. Default: true for on_store_failure closed rules, false otherwise."}
                },
                // The rule's algorithm, for its limits that name none.
                "allOf": ALGORITHMS
                    .iter()
                    .map(|a| {
                        let limit = def_ref(&def_name("in_rule", Some(a)));
                        json!({"if": names(a), "then": {"properties": {"limit": limit, "plans": {"additionalProperties": limit}}}})
                    })
                    .chain([{
                        let limit = def_ref(&def_name("in_rule", None));
                        json!({"if": {"not": {"required": ["algorithm"]}}, "then": {"properties": {"limit": limit, "plans": {"additionalProperties": limit}}}})
                    }])
                    .collect::<Vec<_>>()
            }
        }
    });
    // What a rate limit holds under each algorithm, named once for the limits to refer to.
    if let Some(defs) = schema["$defs"].as_object_mut() {
        for a in ALGORITHMS.iter().copied().map(Some).chain([None]) {
            defs.insert(def_name("as", a), under(a));
            defs.insert(def_name("in_rule", a), inherited(a));
        }
    }
    schema
}

/// The schema as printed and committed.
pub fn text() -> String {
    serde_json::to_string_pretty(&schema()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]
    use super::*;

    /// What the description says of numbers is what the parser does: it refuses a number that
    /// is not whole as written, and takes a whole one written with a fraction or an exponent.
    #[test]
    fn the_description_says_which_numbers_the_parser_refuses() {
        let description = schema()["description"].as_str().unwrap().to_owned();
        let doc = |n: &str| {
            format!(r#"{{"rules": [{{"name": "a", "key": ["ip"], "limit": {{"requests": {n}, "per": "1s"}}}}]}}"#)
        };
        for refused in ["1.5", "5.0000000000000001"] {
            assert!(description.contains(&format!("{refused},")), "{description}");
            assert!(ratewall_core::Config::parse(doc(refused).as_bytes()).is_err(), "{refused}");
        }
        for whole in ["5.0", "1e3"] {
            assert!(description.contains(&format!("{whole} ")), "{description}");
            let config = ratewall_core::Config::parse(doc(whole).as_bytes()).unwrap();
            assert_eq!(config.rules[0].limit.requests(), whole.parse::<f64>().unwrap() as u64, "{whole}");
        }
    }

    #[test]
    fn the_committed_schema_is_current() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../rules.schema.json");
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed.trim_end() == text(),
            "rules.schema.json is stale: run `cargo run -p ratewall-cli -- schema > rules.schema.json`"
        );
    }
}
