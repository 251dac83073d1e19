//! `POST /json`: envoyproxy/ratelimit's JSON twin of `ShouldRateLimit` — a `RateLimitRequest`
//! in proto3 JSON in, the `RateLimitResponse` in proto3 JSON out (200, or 429 over the
//! limit). Written over `serde_json::Value` because the generated types carry no serde
//! support; field names are accepted in lowerCamelCase and as in the `.proto`, unknown ones
//! refused, and `null` for any field is that field not set (its default), as proto3 JSON
//! parsers do.

use super::config::Unit;
use super::{Answer, Call, Code, Descriptor, Refusal};
use serde_json::{json, Map, Value};

/// Largest `POST /json` body, bytes (2 MiB): a larger one is refused as malformed (400).
pub const MAX_BODY: usize = 2 << 20;

/// A JSON value whose objects name each field once: proto3 JSON parsers refuse a field given
/// twice (`serde_json::Value` keeps the last, so a call could be read differently from what
/// any other service would read).
struct Strict(Value);

impl<'de> serde::Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Strict, D::Error> {
        d.deserialize_any(StrictVisitor)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = Strict;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, b: bool) -> Result<Strict, E> {
        Ok(Strict(Value::Bool(b)))
    }
    fn visit_i64<E>(self, n: i64) -> Result<Strict, E> {
        Ok(Strict(Value::from(n)))
    }
    fn visit_u64<E>(self, n: u64) -> Result<Strict, E> {
        Ok(Strict(Value::from(n)))
    }
    fn visit_f64<E>(self, n: f64) -> Result<Strict, E> {
        Ok(Strict(serde_json::Number::from_f64(n).map_or(Value::Null, Value::Number)))
    }
    fn visit_str<E>(self, s: &str) -> Result<Strict, E> {
        Ok(Strict(Value::String(s.to_owned())))
    }
    fn visit_string<E>(self, s: String) -> Result<Strict, E> {
        Ok(Strict(Value::String(s)))
    }
    fn visit_unit<E>(self) -> Result<Strict, E> {
        Ok(Strict(Value::Null))
    }
    fn visit_none<E>(self) -> Result<Strict, E> {
        Ok(Strict(Value::Null))
    }
    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Strict, D::Error> {
        serde::Deserialize::deserialize(d)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Strict, A::Error> {
        let mut out = Vec::new();
        while let Some(Strict(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Strict(Value::Array(out)))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Strict, A::Error> {
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            if out.contains_key(&k) {
                return Err(serde::de::Error::custom(format!("field '{k}' given twice")));
            }
            let Strict(v) = map.next_value()?;
            out.insert(k, v);
        }
        Ok(Strict(Value::Object(out)))
    }
}

/// Notes a field read under its `name` (either of its spellings): `Err` when it was already.
fn once(seen: &mut Vec<&'static str>, name: &'static str) -> Result<(), String> {
    if seen.contains(&name) {
        return Err(format!("field '{name}' given twice (as lowerCamelCase and as in the .proto)"));
    }
    seen.push(name);
    Ok(())
}

/// Reads a proto3 JSON `RateLimitRequest`.
pub fn call_of(body: &[u8]) -> Result<Call, String> {
    let Strict(v) =
        serde_json::from_slice(body).map_err(|e| if e.is_data() { e.to_string() } else { format!("not JSON: {e}") })?;
    let obj = v.as_object().ok_or("a RateLimitRequest is a JSON object")?;
    let mut call = Call::default();
    let mut seen = Vec::new();
    for (k, v) in obj {
        match k.as_str() {
            "domain" => call.domain = string(v, "domain")?,
            "descriptors" => {
                for (i, d) in list(v, "descriptors")?.iter().enumerate() {
                    call.descriptors.push(descriptor(d).map_err(|e| format!("descriptors[{i}]: {e}"))?);
                }
            }
            "hitsAddend" | "hits_addend" => {
                once(&mut seen, "hitsAddend")?;
                call.hits_addend = u32::try_from(uint(v, "hitsAddend")?).map_err(|_| "hitsAddend is over 2^32")?
            }
            other => return Err(format!("unknown field '{other}' in RateLimitRequest")),
        }
    }
    Ok(call)
}

fn descriptor(v: &Value) -> Result<Descriptor, String> {
    let obj = v.as_object().ok_or("a descriptor is an object")?;
    let mut d = Descriptor::default();
    let mut seen = Vec::new();
    for (k, v) in obj {
        match k.as_str() {
            "entries" => {
                for (i, e) in list(v, "entries")?.iter().enumerate() {
                    let e = e.as_object().ok_or_else(|| format!("entries[{i}] is not an object"))?;
                    let (mut key, mut value) = (String::new(), String::new());
                    for (f, x) in e {
                        match f.as_str() {
                            "key" => key = string(x, "key")?,
                            "value" => value = string(x, "value")?,
                            other => return Err(format!("entries[{i}]: unknown field '{other}'")),
                        }
                    }
                    d.entries.push((key, value));
                }
            }
            // A message field set to null: not set.
            "limit" if v.is_null() => {}
            "limit" => {
                let l = v.as_object().ok_or("limit is not an object")?;
                let (mut rpu, mut unit) = (0u32, 0i32);
                let mut seen = Vec::new();
                for (f, x) in l {
                    match f.as_str() {
                        "requestsPerUnit" | "requests_per_unit" => {
                            once(&mut seen, "requestsPerUnit")?;
                            rpu = u32::try_from(uint(x, "requestsPerUnit")?)
                                .map_err(|_| "requestsPerUnit is over 2^32")?
                        }
                        "unit" => unit = unit_of(x)?,
                        other => return Err(format!("limit: unknown field '{other}'")),
                    }
                }
                d.limit = Some((rpu, unit));
            }
            "hitsAddend" | "hits_addend" => {
                once(&mut seen, "hitsAddend")?;
                // A UInt64Value: the number itself (or null: not set).
                if !v.is_null() {
                    d.hits_addend = Some(uint(v, "hitsAddend")?);
                }
            }
            "isNegativeHits" | "is_negative_hits" => {
                once(&mut seen, "isNegativeHits")?;
                if v.as_bool() == Some(true) {
                    return Err("isNegativeHits is not supported".into());
                }
            }
            other => return Err(format!("unknown field '{other}'")),
        }
    }
    Ok(d)
}

fn string(v: &Value, what: &str) -> Result<String, String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        _ => Err(format!("{what} is not a string")),
    }
}

fn list<'a>(v: &'a Value, what: &str) -> Result<&'a [Value], String> {
    match v {
        Value::Array(a) => Ok(a),
        Value::Null => Ok(&[]),
        _ => Err(format!("{what} is not a list")),
    }
}

/// A proto3 JSON unsigned integer: a number or a string holding one, in any form proto3's
/// JSON mapping accepts (`2`, `"2"`, `2.0`, `2e0`, `"2e0"`), as long as its value is a whole
/// number.
fn uint(v: &Value, what: &str) -> Result<u64, String> {
    let not = || format!("{what} is not an unsigned integer");
    let whole = |f: f64| {
        // Up to 2^53: every such whole number is exact in an f64.
        (f.is_finite() && f >= 0.0 && f.fract() == 0.0 && f <= 9_007_199_254_740_992.0).then_some(f as u64)
    };
    match v {
        Value::Number(n) => n.as_u64().or_else(|| n.as_f64().and_then(whole)).ok_or_else(not),
        Value::String(s) => s.parse().ok().or_else(|| s.parse().ok().and_then(whole)).ok_or_else(not),
        Value::Null => Ok(0),
        _ => Err(not()),
    }
}

fn unit_of(v: &Value) -> Result<i32, String> {
    match v {
        Value::Null => Ok(0),
        Value::String(s) if s == "UNKNOWN" => Ok(0),
        Value::String(s) => Unit::from_name(s).map(Unit::proto).ok_or_else(|| format!("unknown unit '{s}'")),
        Value::Number(n) => n.as_i64().and_then(|n| i32::try_from(n).ok()).ok_or_else(|| "unknown unit".into()),
        _ => Err("unit is not a string".into()),
    }
}

fn code(c: Code) -> &'static str {
    match c {
        Code::Ok => "OK",
        Code::OverLimit => "OVER_LIMIT",
    }
}

/// A proto3 JSON `Duration`: seconds with 0, 3, 6 or 9 fractional digits and an `s`.
pub fn duration(n: ratewall_core::Nanos) -> String {
    let (s, ns) = (n / ratewall_core::SECOND, n % ratewall_core::SECOND);
    match ns {
        0 => format!("{s}s"),
        ns if ns % 1_000_000 == 0 => format!("{s}.{:03}s", ns / 1_000_000),
        ns if ns % 1_000 == 0 => format!("{s}.{:06}s", ns / 1_000),
        ns => format!("{s}.{ns:09}s"),
    }
}

/// An answer as a proto3 JSON `RateLimitResponse` (fields at their default omitted).
pub fn response_of(a: &Answer) -> Value {
    let statuses: Vec<Value> = a
        .statuses
        .iter()
        .map(|s| {
            let mut o = Map::new();
            o.insert("code".into(), json!(code(s.code)));
            if let Some(l) = &s.current_limit {
                let mut limit = Map::new();
                if !l.name.is_empty() {
                    limit.insert("name".into(), json!(l.name));
                }
                if l.requests_per_unit != 0 {
                    limit.insert("requestsPerUnit".into(), json!(l.requests_per_unit));
                }
                let unit = Unit::from_proto(l.unit).map_or("UNKNOWN", Unit::proto_name);
                limit.insert("unit".into(), json!(unit));
                o.insert("currentLimit".into(), Value::Object(limit));
            }
            if s.limit_remaining != 0 {
                o.insert("limitRemaining".into(), json!(s.limit_remaining));
            }
            if let Some(d) = s.duration_until_reset {
                o.insert("durationUntilReset".into(), json!(duration(d)));
            }
            Value::Object(o)
        })
        .collect();
    let mut out = Map::new();
    out.insert("overallCode".into(), json!(code(a.overall_code)));
    out.insert("statuses".into(), Value::Array(statuses));
    if !a.headers.is_empty() {
        let headers: Vec<Value> = a.headers.iter().map(|(k, v)| json!({"key": k, "value": v})).collect();
        out.insert("responseHeadersToAdd".into(), Value::Array(headers));
    }
    Value::Object(out)
}

/// The HTTP status and body of a `POST /json` answer.
pub fn http(result: &Result<Answer, Refusal>) -> (u16, Vec<u8>) {
    match result {
        Ok(a) => {
            let status = if a.overall_code == Code::OverLimit { 429 } else { 200 };
            (status, response_of(a).to_string().into_bytes())
        }
        Err(Refusal::Invalid(why)) => (400, json!({"error": why}).to_string().into_bytes()),
        Err(Refusal::Unavailable(why)) => (503, json!({"error": why}).to_string().into_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_reads_in_both_spellings() {
        let c = call_of(br#"{"domain":"d","hits_addend":2,"descriptors":[{"entries":[{"key":"k","value":"v"}],"hitsAddend":"0","limit":{"requests_per_unit":5,"unit":"MINUTE"}}]}"#).unwrap();
        assert_eq!(c.domain, "d");
        assert_eq!(c.hits_addend, 2);
        let d = &c.descriptors[0];
        assert_eq!(d.entries, vec![("k".to_owned(), "v".to_owned())]);
        assert_eq!(d.hits_addend, Some(0));
        assert_eq!(d.limit, Some((5, 2)));
    }

    #[test]
    fn null_is_a_field_not_set() {
        let c = call_of(br#"{"domain":"d","hitsAddend":null,"descriptors":[{"entries":[{"key":"k","value":null}],"limit":null,"hitsAddend":null,"isNegativeHits":null}]}"#).unwrap();
        assert_eq!((c.domain.as_str(), c.hits_addend), ("d", 0));
        let d = &c.descriptors[0];
        assert_eq!((d.entries.clone(), d.limit, d.hits_addend), (vec![("k".to_owned(), String::new())], None, None));
        let c =
            call_of(br#"{"domain":"d","descriptors":[{"entries":null,"limit":{"requestsPerUnit":null,"unit":null}}]}"#)
                .unwrap();
        assert_eq!((c.descriptors[0].entries.len(), c.descriptors[0].limit), (0, Some((0, 0))));
        let c = call_of(br#"{"domain":null,"descriptors":null}"#).unwrap();
        assert_eq!((c.domain.as_str(), c.descriptors.len()), ("", 0));
        // An element of a list is a value, not a field: null there is not a message.
        assert!(call_of(br#"{"domain":"d","descriptors":[null]}"#).is_err());
        assert!(call_of(br#"{"domain":"d","descriptors":[{"entries":[null]}]}"#).is_err());
    }

    #[test]
    fn integers_read_in_every_form_proto3_json_accepts() {
        for n in ["2", "\"2\"", "2.0", "2e0", "\"2e0\"", "\"2.0\"", "0.2e1"] {
            let body = format!(
                r#"{{"domain":"d","hitsAddend":{n},"descriptors":[{{"hitsAddend":{n},"limit":{{"requestsPerUnit":{n},"unit":"SECOND"}}}}]}}"#
            );
            let c = call_of(body.as_bytes()).unwrap_or_else(|e| panic!("{n}: {e}"));
            assert_eq!(
                (c.hits_addend, c.descriptors[0].hits_addend, c.descriptors[0].limit),
                (2, Some(2), Some((2, 1))),
                "{n}"
            );
        }
        for n in ["2.5", "-1", "\"-1\"", "1e300", "\"NaN\"", "\"inf\"", "\"two\"", "true", "[]"] {
            let body = format!(r#"{{"domain":"d","hitsAddend":{n}}}"#);
            assert!(call_of(body.as_bytes()).unwrap_err().contains("hitsAddend"), "{n}");
        }
    }

    #[test]
    fn unknown_fields_are_refused() {
        assert!(call_of(br#"{"domain":"d","extra":1}"#).unwrap_err().contains("extra"));
        assert!(call_of(br#"{"descriptors":[{"entries":[{"key":"k","val":"v"}]}]}"#).unwrap_err().contains("val"));
    }

    #[test]
    fn a_field_given_twice_is_refused() {
        for (body, field) in [
            (&br#"{"domain":"zz","descriptors":[],"domain":"t"}"#[..], "'domain' given twice"),
            (br#"{"descriptors":[{"entries":[],"entries":[{"key":"k"}]}]}"#, "'entries' given twice"),
            (br#"{"descriptors":[{"entries":[{"key":"a","key":"b"}]}]}"#, "'key' given twice"),
            (br#"{"hitsAddend":1,"hits_addend":2}"#, "'hitsAddend' given twice"),
            (
                br#"{"descriptors":[{"limit":{"requestsPerUnit":1,"requests_per_unit":2}}]}"#,
                "'requestsPerUnit' given twice",
            ),
        ] {
            let e = call_of(body).unwrap_err();
            assert!(e.contains(field) && !e.starts_with("not JSON"), "{e}");
        }
        assert!(call_of(b"{\"domain\":").unwrap_err().starts_with("not JSON"));
    }

    #[test]
    fn durations_are_proto3_json() {
        assert_eq!(duration(3 * ratewall_core::SECOND), "3s");
        assert_eq!(duration(1_500_000_000), "1.500s");
        assert_eq!(duration(1), "0.000000001s");
    }
}
