//! A small JSON reader for the rules document.
//!
//! Hand-written instead of `serde_json` for size: the rules are read once per configuration,
//! yet `serde_json`'s generic `Value` machinery (its parser, `BTreeMap`, float formatting and
//! parsing tables) was about 45 KB of the proxy-wasm filter, whose budget is 200 KB. This
//! reader is total (any input gives a value or an error with line and column, never a panic),
//! bounded in nesting depth, and keeps only what rule validation needs: numbers are exact
//! integers or their original text.

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

/// Deepest nesting accepted (serde_json's default too).
const MAX_DEPTH: usize = 128;
/// Objects up to this many members are checked for a repeated key as they are read.
const SCAN_MEMBERS: usize = 8;

/// The index of the first name that an earlier one repeats: O(n) expected, through an
/// open-addressing table of FNV-1a hashes. (Sorting was measured at +14 KB of filter wasm
/// for its two instantiations, a `BTreeSet` at about 8 KB; this is a few hundred bytes.)
pub(crate) fn first_repeat(names: &[&str]) -> Option<usize> {
    let mask = names.len().saturating_mul(2).next_power_of_two().max(2) - 1;
    // Slot: index + 1 of the name it holds (0: empty).
    let mut slots: Vec<usize> = alloc::vec![0; mask + 1];
    for (i, name) in names.iter().enumerate() {
        let mut at = crate::hash::fnv1a(name.as_bytes()) as usize;
        loop {
            at &= mask;
            let slot = slots.get_mut(at)?;
            if *slot == 0 {
                *slot = i + 1;
                break;
            }
            if names.get(*slot - 1) == Some(name) {
                return Some(i);
            }
            at += 1;
        }
    }
    None
}

/// A JSON number: exact when it is an integer that fits, else its text.
#[derive(Clone, Debug, PartialEq)]
pub enum Number {
    /// A non-negative integer.
    Unsigned(u64),
    /// A negative integer.
    Negative(i64),
    /// Anything else (fractions, exponents, out of range), as written.
    Other(String),
}

/// A JSON value. Objects keep their members in document order; a repeated key is an error.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `null`.
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// A number.
    Number(Number),
    /// A string.
    String(String),
    /// An array.
    Array(Vec<Value>),
    /// An object.
    Object(Map),
}

/// An object's members.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Map(Vec<(String, Value)>);

impl Map {
    /// The member named `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Member names, in document order.
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.0.iter().map(|(k, _)| k)
    }

    /// Members, in document order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Value)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    /// How many members.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// No members.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<'a> IntoIterator for &'a Map {
    type Item = (&'a String, &'a Value);
    type IntoIter = core::iter::Map<core::slice::Iter<'a, (String, Value)>, fn(&'a (String, Value)) -> Self::Item>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

impl Value {
    /// The value as a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Number(Number::Unsigned(n)) => Some(*n),
            _ => None,
        }
    }

    /// The value as a non-negative integer, also when written with a fraction or an exponent
    /// that leave it whole (`5.0`, `1e3`, `2.50e1`): JSON Schema's `"type": "integer"` takes
    /// those. Worked out on the digits, not through a float, so `5.0000000000000001` is not
    /// taken for 5.
    pub fn as_whole(&self) -> Option<u64> {
        match self {
            Value::Number(Number::Unsigned(n)) => Some(*n),
            // `-0`.
            Value::Number(Number::Negative(0)) => Some(0),
            Value::Number(Number::Other(text)) => whole(text),
            _ => None,
        }
    }
}

/// The non-negative whole number `text` (a valid JSON number) is, if it is one that fits.
fn whole(text: &str) -> Option<u64> {
    let (mantissa, exponent) = match text.find(['e', 'E']) {
        Some(at) => (text.get(..at)?, text.get(at + 1..)?.parse::<i64>().ok()?),
        None => (text, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if let Some(magnitude) = int.strip_prefix('-') {
        // `-0` (`-0.0`, `-0e5`) is the whole number 0; any other negative number is none.
        let zero = |d: &str| d.bytes().all(|b| b == b'0');
        return (zero(magnitude) && zero(frac)).then_some(0);
    }
    // The digits, with the point `frac.len()` places from the end, times 10^exponent: their
    // trailing zeros move into the exponent.
    let digits = [int, frac].concat();
    let significant = digits.trim_start_matches('0').trim_end_matches('0');
    if significant.is_empty() {
        return Some(0);
    }
    let trailing = digits.len() - digits.trim_end_matches('0').len();
    let scale = exponent.checked_sub(i64::try_from(frac.len()).ok()?)?.checked_add(i64::try_from(trailing).ok()?)?;
    // Digits left after the point that are not zeros: not whole.
    let scale = u32::try_from(scale).ok()?;
    significant.parse::<u64>().ok()?.checked_mul(10u64.checked_pow(scale)?)
}

/// Why a document is not JSON, and where (1-based line and column, in bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    /// What was wrong.
    pub reason: &'static str,
    /// Line.
    pub line: usize,
    /// Column.
    pub column: usize,
    /// The key named twice, for a duplicate key.
    pub key: Option<String>,
    /// For a duplicate key, the object that names it twice, as a path from the document's
    /// top (`rules[0].limit`; empty for the top object).
    pub path: String,
}

impl Error {
    /// The error as seen from the member `name` of an object (a duplicate key's path grows).
    fn in_member(mut self, name: &str) -> Error {
        if self.key.is_some() {
            self.path = join(name, &self.path);
        }
        self
    }

    /// The error as seen from item `i` of an array.
    fn in_item(mut self, i: usize) -> Error {
        if self.key.is_some() {
            self.path = join(&format!("[{i}]"), &self.path);
        }
        self
    }

    /// The duplicate key's own path (`rules[0].limit.per`).
    pub fn key_path(&self) -> String {
        self.key.as_deref().map_or_else(|| self.path.clone(), |k| join(&self.path, k))
    }
}

/// `outer` then `inner` as one path: `a.b`, `a[0]`, `[0].b`.
fn join(outer: &str, inner: &str) -> String {
    match (outer.is_empty(), inner.is_empty() || inner.starts_with('[')) {
        (true, _) => inner.into(),
        (false, true) => format!("{outer}{inner}"),
        (false, false) => format!("{outer}.{inner}"),
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.key {
            Some(k) => write!(f, "{} {k:?} at line {} column {}", self.reason, self.line, self.column),
            None => write!(f, "{} at line {} column {}", self.reason, self.line, self.column),
        }
    }
}

impl core::error::Error for Error {}

/// Parses one JSON document (surrounding whitespace allowed, nothing else).
pub fn parse(input: &[u8]) -> Result<Value, Error> {
    let mut p = Parser { s: input, i: 0 };
    if let Err(e) = core::str::from_utf8(input) {
        p.i = e.valid_up_to();
        return Err(p.error("invalid UTF-8"));
    }
    let v = p.value(0)?;
    p.skip_ws();
    if p.i < p.s.len() {
        return Err(p.error("trailing characters"));
    }
    Ok(v)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn error(&self, reason: &'static str) -> Error {
        let before = self.s.get(..self.i).unwrap_or(self.s);
        let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
        let column = before.iter().rev().take_while(|&&b| b != b'\n').count() + 1;
        Error { reason, line, column, key: None, path: String::new() }
    }

    fn duplicate(&self, key: &str) -> Error {
        Error { key: Some(key.into()), ..self.error("duplicate key") }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    fn literal(&mut self, word: &'static [u8], v: Value) -> Result<Value, Error> {
        if self.s.get(self.i..self.i + word.len()) == Some(word) {
            self.i += word.len();
            Ok(v)
        } else {
            Err(self.error("expected a value"))
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value, Error> {
        self.skip_ws();
        match self.peek() {
            None => Err(self.error("EOF while parsing a value")),
            Some(b'n') => self.literal(b"null", Value::Null),
            Some(b't') => self.literal(b"true", Value::Bool(true)),
            Some(b'f') => self.literal(b"false", Value::Bool(false)),
            Some(b'"') => self.string().map(Value::String),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(b'[') if depth < MAX_DEPTH => self.array(depth + 1),
            Some(b'{') if depth < MAX_DEPTH => self.object(depth + 1),
            Some(b'[' | b'{') => Err(self.error("nested too deeply")),
            Some(_) => Err(self.error("expected a value")),
        }
    }

    fn array(&mut self, depth: usize) -> Result<Value, Error> {
        self.i += 1;
        let mut items = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(Value::Array(items));
        }
        loop {
            let item = self.value(depth).map_err(|e| e.in_item(items.len()))?;
            items.push(item);
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(Value::Array(items));
                }
                _ => return Err(self.error("expected `,` or `]`")),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<Value, Error> {
        self.i += 1;
        let mut members: Vec<(String, Value)> = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Ok(Value::Object(Map(members)));
        }
        loop {
            self.skip_ws();
            if self.peek() != Some(b'"') {
                return Err(self.error("expected a string key"));
            }
            let key = self.string()?;
            self.skip_ws();
            if self.peek() != Some(b':') {
                return Err(self.error("expected `:`"));
            }
            self.i += 1;
            // A repeated key is an error: readers disagree on which value wins (this one
            // kept the last, others keep the first), so a rules document that means two
            // things to two tools is rejected. Found here in a small object; a larger one is
            // checked once, through a hash table, when it ends (a scan per member made a
            // 10,000-key object quadratic).
            if members.len() < SCAN_MEMBERS && members.iter().any(|(k, _)| *k == key) {
                return Err(self.duplicate(&key));
            }
            let v = self.value(depth).map_err(|e| e.in_member(&key))?;
            members.push((key, v));
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    if members.len() > SCAN_MEMBERS {
                        let names: Vec<&str> = members.iter().map(|(k, _)| k.as_str()).collect();
                        if let Some(i) = first_repeat(&names) {
                            return Err(self.duplicate(names.get(i).copied().unwrap_or_default()));
                        }
                    }
                    self.i += 1;
                    return Ok(Value::Object(Map(members)));
                }
                _ => return Err(self.error("expected `,` or `}`")),
            }
        }
    }

    fn number(&mut self) -> Result<Value, Error> {
        let start = self.i;
        let negative = self.peek() == Some(b'-');
        if negative {
            self.i += 1;
        }
        let int_start = self.i;
        let digits = |p: &mut Self| {
            let from = p.i;
            while let Some(b'0'..=b'9') = p.peek() {
                p.i += 1;
            }
            p.i - from
        };
        let n = digits(self);
        if n == 0 || (n > 1 && self.s.get(int_start) == Some(&b'0')) {
            return Err(self.error("invalid number"));
        }
        let mut integer = true;
        if self.peek() == Some(b'.') {
            self.i += 1;
            integer = false;
            if digits(self) == 0 {
                return Err(self.error("invalid number"));
            }
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.i += 1;
            integer = false;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            if digits(self) == 0 {
                return Err(self.error("invalid number"));
            }
        }
        let text = core::str::from_utf8(self.s.get(start..self.i).unwrap_or_default()).unwrap_or_default();
        let exact = match (integer, negative) {
            (true, false) => text.parse().ok().map(Number::Unsigned),
            (true, true) => text.parse().ok().map(Number::Negative),
            _ => None,
        };
        Ok(Value::Number(exact.unwrap_or_else(|| Number::Other(text.into()))))
    }

    fn hex4(&mut self) -> Result<u32, Error> {
        let mut v = 0u32;
        for _ in 0..4 {
            let d = match self.peek() {
                Some(c @ b'0'..=b'9') => c - b'0',
                Some(c @ b'a'..=b'f') => c - b'a' + 10,
                Some(c @ b'A'..=b'F') => c - b'A' + 10,
                _ => return Err(self.error("invalid \\u escape")),
            };
            v = v * 16 + u32::from(d);
            self.i += 1;
        }
        Ok(v)
    }

    fn string(&mut self) -> Result<String, Error> {
        self.i += 1;
        let mut out = String::new();
        loop {
            // Copy the run up to the next quote, backslash or control character at once.
            let run = self.s.get(self.i..).unwrap_or_default();
            let n = run.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20).unwrap_or(run.len());
            // The whole input is valid UTF-8 and the run stops at ASCII bytes, so this holds.
            out.push_str(core::str::from_utf8(run.get(..n).unwrap_or_default()).unwrap_or_default());
            self.i += n;
            match self.peek() {
                None => return Err(self.error("EOF while parsing a string")),
                Some(b'"') => {
                    self.i += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    self.i += 1;
                    let c = match self.peek() {
                        Some(b'"') => '"',
                        Some(b'\\') => '\\',
                        Some(b'/') => '/',
                        Some(b'b') => '\u{8}',
                        Some(b'f') => '\u{c}',
                        Some(b'n') => '\n',
                        Some(b'r') => '\r',
                        Some(b't') => '\t',
                        Some(b'u') => {
                            self.i += 1;
                            let hi = self.hex4()?;
                            let code = if (0xD800..0xDC00).contains(&hi) {
                                if self.s.get(self.i..self.i + 2) != Some(b"\\u") {
                                    return Err(self.error("lone leading surrogate in \\u escape"));
                                }
                                self.i += 2;
                                let lo = self.hex4()?;
                                if !(0xDC00..0xE000).contains(&lo) {
                                    return Err(self.error("invalid surrogate pair in \\u escape"));
                                }
                                0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                            } else {
                                hi
                            };
                            out.push(char::from_u32(code).ok_or_else(|| self.error("invalid \\u escape"))?);
                            continue;
                        }
                        _ => return Err(self.error("invalid escape")),
                    };
                    out.push(c);
                    self.i += 1;
                }
                Some(_) => return Err(self.error("control character in a string")),
            }
        }
    }
}

impl fmt::Display for Value {
    /// Compact JSON, for error messages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Null => f.write_str("null"),
            Value::Bool(b) => write!(f, "{b}"),
            Value::Number(Number::Unsigned(n)) => write!(f, "{n}"),
            Value::Number(Number::Negative(n)) => write!(f, "{n}"),
            Value::Number(Number::Other(t)) => f.write_str(t),
            Value::String(s) => write_string(f, s),
            Value::Array(a) => {
                f.write_str("[")?;
                for (i, v) in a.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{v}")?;
                }
                f.write_str("]")
            }
            Value::Object(m) => {
                f.write_str("{")?;
                for (i, (k, v)) in m.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write_string(f, k)?;
                    write!(f, ":{v}")?;
                }
                f.write_str("}")
            }
        }
    }
}

/// Writes `s` as a JSON string literal.
pub fn write_string(f: &mut impl fmt::Write, s: &str) -> fmt::Result {
    f.write_char('"')?;
    for c in s.chars() {
        match c {
            '"' => f.write_str("\\\"")?,
            '\\' => f.write_str("\\\\")?,
            '\n' => f.write_str("\\n")?,
            '\r' => f.write_str("\\r")?,
            '\t' => f.write_str("\\t")?,
            c if (c as u32) < 0x20 => write!(f, "\\u{:04x}", c as u32)?,
            c => f.write_char(c)?,
        }
    }
    f.write_char('"')
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]
    use super::*;
    use alloc::string::ToString;
    use proptest::prelude::*;

    #[test]
    fn reads_what_serde_json_reads() {
        let docs = [
            r#"{"a": [1, -2, 3.5, 1e3, true, false, null, "x\"y\\z\u00e9\ud83d\ude00\n"], "b": {}}"#,
            " [ ] ",
            "18446744073709551615",
            "18446744073709551616",
            "-9223372036854775808",
            r#""\/\b\f\r\t""#,
        ];
        for d in docs {
            let ours = parse(d.as_bytes()).unwrap();
            let theirs: serde_json::Value = serde_json::from_str(d).unwrap();
            let again: serde_json::Value = serde_json::from_str(&ours.to_string()).unwrap();
            // Same value, modulo serde_json's float rounding of non-integers.
            assert_eq!(serde_json::to_string(&again).unwrap(), serde_json::to_string(&theirs).unwrap(), "{d}");
        }
        assert_eq!(parse(br#"{"k": 1, "k": 2}"#).unwrap_err().reason, "duplicate key");
        assert_eq!(parse(b"18446744073709551615").unwrap().as_u64(), Some(u64::MAX));
        assert_eq!(parse(b"5.0").unwrap().as_u64(), None);
        let whole = |d: &str| parse(d.as_bytes()).unwrap().as_whole();
        for (d, n) in [
            ("5.0", 5),
            ("5", 5),
            ("1e3", 1000),
            ("2.50e1", 25),
            ("100e-2", 1),
            ("0.0", 0),
            ("0e5", 0),
            ("-0", 0),
            ("-0.0", 0),
            ("-0e5", 0),
        ] {
            assert_eq!(whole(d), Some(n), "{d}");
        }
        assert_eq!(whole("18446744073709551615.0"), Some(u64::MAX));
        for d in [
            "5.5",
            "5.0000000000000001",
            "1e-1",
            "-1.0",
            "-0.5",
            "-1e-9",
            "18446744073709551616.0",
            "1e20",
            "\"5\"",
            "1e99999999999999999999",
        ] {
            assert_eq!(whole(d), None, "{d}");
        }
        assert_eq!(parse(b"-1").unwrap().as_u64(), None);
        // serde_json reads -0 as a float, so it is no whole number for either reader.
        assert_eq!(parse(b"-0").unwrap().as_u64(), None);
    }

    #[test]
    fn rejects_what_serde_json_rejects_with_a_position() {
        let bad: [&[u8]; 17] = [
            b"",
            b"{",
            b"[1,]",
            b"{\"a\":1,}",
            b"01",
            b"1.",
            b"-",
            b"1e",
            b"tru",
            b"\"abc",
            b"\"\\x\"",
            b"\"\\ud800\"",
            b"\"a\nb\"",
            b"{1:2}",
            b"[1] x",
            b"\"\xff\"",
            b"{\"a\" 1}",
        ];
        for d in bad {
            assert!(serde_json::from_slice::<serde_json::Value>(d).is_err(), "{d:?}");
            let e = parse(d).unwrap_err();
            assert!(e.line >= 1 && e.column >= 1, "{d:?}");
        }
        let e = parse(b"{\n  \"a\": [1,\n   x]}").unwrap_err();
        assert_eq!((e.line, e.column), (3, 4), "{e}");
    }

    #[test]
    fn depth_is_bounded() {
        let deep = "[".repeat(100_000);
        assert_eq!(parse(deep.as_bytes()).unwrap_err().reason, "nested too deeply");
        let ok = "[".repeat(100) + &"]".repeat(100);
        assert!(parse(ok.as_bytes()).is_ok());
    }

    proptest! {
        #[test]
        fn any_bytes_give_a_value_or_an_error(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse(&bytes);
        }

        #[test]
        fn agrees_with_serde_json_on_validity(s in "[\\[\\]{}\",:0-9a-z\\\\ .e+-]{0,40}") {
            let ours = parse(s.as_bytes());
            let theirs = serde_json::from_str::<serde_json::Value>(&s).is_ok();
            // serde_json takes a repeated key (the last wins); this reader refuses it.
            if ours.as_ref().is_err_and(|e| e.reason == "duplicate key") {
                prop_assert!(theirs, "{}", s);
            } else {
                prop_assert_eq!(ours.is_ok(), theirs, "{}", s);
            }
        }
    }

    #[test]
    fn a_wide_object_parses_in_linear_time_and_repeats_are_found_anywhere() {
        let members: Vec<alloc::string::String> = (0..20_000).map(|i| alloc::format!("\"k{i}\":{i}")).collect();
        let doc = alloc::format!("{{{}}}", members.join(","));
        let Value::Object(m) = parse(doc.as_bytes()).unwrap() else { panic!() };
        assert_eq!(m.len(), 20_000);
        let repeated = alloc::format!("{{{},\"k3\":0}}", members.join(","));
        assert_eq!(parse(repeated.as_bytes()).unwrap_err().reason, "duplicate key");
    }
}
