//! The small host interface the filter logic needs; the proxy-wasm glue implements it, and
//! the unit tests (`filter/src/tests/`) use the in-memory fake of `filter/src/fake.rs`.

use ratewall_core::Nanos;

/// A shared-data write that did not happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetError {
    /// The value changed since it was read.
    CasMismatch,
    /// Any other host failure.
    Other,
}

impl std::fmt::Display for SetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SetError::CasMismatch => "the shared-data value changed since it was read",
            SetError::Other => "the host refused the shared-data call",
        })
    }
}

impl std::error::Error for SetError {}

/// Log levels, as proxy-wasm numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Debug.
    Debug,
    /// Info.
    Info,
    /// Warn.
    Warn,
    /// Error.
    Error,
}

/// What the filter needs from its host.
pub trait Host {
    /// Wall-clock time, nanoseconds since the epoch.
    fn now(&self) -> Nanos;
    /// All request headers in one call, serialized as proxy-wasm serializes a header map
    /// (read with [`header`]); empty when the host has none. One host call instead of one per
    /// header: each host call that returns data costs a round trip into the guest's allocator.
    fn request_headers(&self) -> Vec<u8>;
    /// One request header by name (used only for a pseudo-header the map lacks).
    fn request_header(&self, name: &str) -> Option<Vec<u8>>;
    /// A host property such as `["source", "address"]`.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
    /// Shared data: the value (None when the key does not exist) and its CAS token.
    fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), SetError>;
    /// Shared data: a write, conditional on `cas` when given.
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError>;
    /// Defines (or finds) a counter metric.
    fn define_counter(&self, name: &str) -> Option<u32>;
    /// Adds to a counter metric.
    fn increment(&self, metric: u32, by: u64);
    /// Defines (or finds) a gauge metric.
    fn define_gauge(&self, name: &str) -> Option<u32>;
    /// Sets a gauge.
    fn set_gauge(&self, metric: u32, value: u64);
    /// A metric's value (None: the host cannot say). Metrics outlive a trapped instance.
    fn metric_value(&self, metric: u32) -> Option<u64>;
    /// Whether a request paused now can be resumed later from the root context's tick
    /// (Envoy), rather than only from one of its own callbacks (ngx_wasm_module).
    fn resumes_waiters(&self) -> bool {
        true
    }
    /// Sends an HTTP request to an upstream; the answer arrives later, by its token.
    fn dispatch(&self, upstream: &str, headers: &[(&str, &str)], body: &[u8], timeout: Nanos) -> Option<u32>;
    /// Logs a line.
    fn log(&self, level: Level, message: &str);
}

/// The first value of header `name` (ASCII case-insensitive) in a serialized proxy-wasm
/// header map: see [`headers`]. (The filter reads all its headers at once; for tests.)
#[cfg(test)]
fn header<'a>(map: &'a [u8], name: &str) -> Option<&'a [u8]> {
    let mut out = [None];
    let _ = headers(map, &HeaderNames::new(vec![String::from(name)]), &mut out, &mut Vec::new());
    let [value] = out;
    value
}

/// Header names to look up, indexed by length: most headers of a request have a length no
/// wanted name has, and are passed over at once.
#[derive(Debug)]
pub struct HeaderNames {
    names: Vec<String>,
    /// A bit for the name (of the first 32) whose repeated fields [`headers`] joins.
    all_fields: u32,
    /// Bit `i` of `by_len[n]`: `names[i]` (i < 32, non-empty) is `n` bytes long.
    by_len: [u32; 64],
    /// Some wanted name is beyond the index (past 32 names, or 64 bytes and longer).
    unindexed: bool,
}

impl HeaderNames {
    /// The lookup for `names` (lower-case; an empty name is not wanted).
    pub fn new(names: Vec<String>) -> HeaderNames {
        let mut by_len = [0u32; 64];
        let mut unindexed = false;
        for (i, name) in names.iter().enumerate().filter(|(_, n)| !n.is_empty()) {
            match (by_len.get_mut(name.len()), u32::try_from(i).ok().and_then(|i| 1u32.checked_shl(i))) {
                (Some(bits), Some(bit)) => *bits |= bit,
                _ => unindexed = true,
            }
        }
        HeaderNames { names, all_fields: 0, by_len, unindexed }
    }

    /// The same names, with `names[i]` the one whose repeated fields [`headers`] joins.
    pub fn reporting_repeats_of(mut self, i: usize) -> HeaderNames {
        let wanted = self.names.get(i).is_some_and(|n| !n.is_empty());
        self.all_fields = match (wanted, u32::try_from(i).ok().and_then(|i| 1u32.checked_shl(i))) {
            (true, Some(bit)) => bit,
            _ => 0,
        };
        self
    }

    /// How many names there are (wanted or not).
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

/// The first value of each header `names[i]` (ASCII case-insensitive) into `out[i]`, in one
/// pass over a serialized proxy-wasm header map: a little-endian u32 count, then a (name
/// length, value length) u32 pair per header, then each name and each value followed by a
/// NUL. A malformed map reads as having no more headers.
///
/// For the one name of [`HeaderNames::reporting_repeats_of`], every field counts: when it
/// occurs more than once, `joined` receives all its values, comma-separated (RFC 9110 reads
/// repeated fields as one list), and the call returns true. For the other names the pass
/// ends once all are found.
pub fn headers<'a>(map: &'a [u8], names: &HeaderNames, out: &mut [Option<&'a [u8]>], joined: &mut Vec<u8>) -> bool {
    let mut repeated = false;
    let word = |at: usize| -> Option<usize> {
        let b: [u8; 4] = map.get(at..at.checked_add(4)?)?.try_into().ok()?;
        Some(u32::from_le_bytes(b) as usize)
    };
    let Some(count) = word(0) else { return false };
    let Some(mut data) = count.checked_mul(8).and_then(|n| n.checked_add(4)) else { return false };
    // A name whose every field counts is never done with.
    let mut missing = names.names.iter().filter(|n| !n.is_empty()).count() + names.all_fields.count_ones() as usize;
    // Proxies hand names over lower-case, so an exact match is tried before the
    // case-insensitive one.
    let all_fields = names.all_fields;
    let mut try_slot = |key: &[u8], value: &'a [u8], j: usize| -> bool {
        if let (Some(slot), Some(name)) = (out.get_mut(j), names.names.get(j)) {
            let bit = u32::try_from(j).ok().and_then(|j| 1u32.checked_shl(j)).unwrap_or(0);
            if slot.is_some() && all_fields & bit == 0 {
                return false;
            }
            if !name.is_empty()
                && name.len() == key.len()
                && (key == name.as_bytes() || key.eq_ignore_ascii_case(name.as_bytes()))
            {
                if let Some(first) = slot {
                    if !repeated {
                        joined.clear();
                        joined.extend_from_slice(first);
                        repeated = true;
                    }
                    joined.push(b',');
                    joined.extend_from_slice(value);
                    return false;
                }
                *slot = Some(value);
                return true;
            }
        }
        false
    };
    for i in 0..count {
        if missing == 0 {
            break;
        }
        let (Some(n), Some(v)) = (word(4 + 8 * i), word(8 + 8 * i)) else { break };
        let Some(key) = data.checked_add(n).and_then(|end| map.get(data..end)) else { break };
        let value_at = data + n + 1;
        let Some(value) = value_at.checked_add(v).and_then(|end| map.get(value_at..end)) else { break };
        data = value_at + v + 1;
        if names.unindexed {
            for j in 0..names.names.len() {
                missing -= usize::from(try_slot(key, value, j));
            }
        } else {
            let mut bits = names.by_len.get(key.len()).copied().unwrap_or(0);
            while bits != 0 {
                missing -= usize::from(try_slot(key, value, bits.trailing_zeros() as usize));
                bits &= bits - 1;
            }
        }
    }
    repeated
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    /// A header map as a host serializes it ([`crate::fake::header_map`], typed so that byte
    /// literals of any length fit).
    fn serialize_headers(pairs: &[(&str, &[u8])]) -> Vec<u8> {
        crate::fake::header_map(pairs)
    }

    #[test]
    fn finds_the_first_value_case_insensitively() {
        let map = serialize_headers(&[(":path", b"/v1"), ("X-Api-Key", b"k1"), ("x-api-key", b"k2"), ("e", b"")]);
        assert_eq!(header(&map, ":path"), Some(&b"/v1"[..]));
        assert_eq!(header(&map, "x-api-key"), Some(&b"k1"[..]));
        assert_eq!(header(&map, "e"), Some(&b""[..]));
        assert_eq!(header(&map, "missing"), None);
    }

    #[test]
    fn finds_every_name_in_one_pass_indexed_or_not() {
        let long = "x-".repeat(40);
        let many: Vec<String> = (0..40).map(|i| format!("h-{i}")).collect();
        let mut pairs: Vec<(&str, &[u8])> = vec![(":path", b"/v1"), ("X-Api-Key", b"k1"), (long.as_str(), b"L")];
        pairs.extend(many.iter().map(|n| (n.as_str(), n.as_bytes())));
        let map = serialize_headers(&pairs);
        // Indexed: short names, fewer than 32; an empty name is not wanted.
        let names = HeaderNames::new(vec![":path".into(), String::new(), "x-api-key".into(), "absent".into()]);
        let mut out = [None; 4];
        let _ = headers(&map, &names, &mut out, &mut Vec::new());
        assert_eq!(out, [Some(&b"/v1"[..]), None, Some(&b"k1"[..]), None]);
        // Beyond the index: a 80-byte name, and more than 32 names.
        let mut wanted = many.clone();
        wanted.push(long.clone());
        let names = HeaderNames::new(wanted);
        let mut out = vec![None; names.len()];
        let _ = headers(&map, &names, &mut out, &mut Vec::new());
        for (i, n) in many.iter().enumerate() {
            assert_eq!(out[i], Some(n.as_bytes()));
        }
        assert_eq!(out[40], Some(&b"L"[..]));
    }

    #[test]
    fn a_field_sent_on_several_lines_is_one_list() {
        let map = serialize_headers(&[
            ("x-forwarded-for", b"1.1.1.1"),
            ("x-user-id", b"u"),
            ("X-Forwarded-For", b"2.2.2.2, 3.3.3.3"),
            ("x-user-id", b"v"),
            ("x-forwarded-for", b"4.4.4.4"),
        ]);
        let names = HeaderNames::new(vec!["x-forwarded-for".into(), "x-user-id".into()]).reporting_repeats_of(0);
        let (mut out, mut joined) = ([None; 2], Vec::new());
        assert!(headers(&map, &names, &mut out, &mut joined));
        assert_eq!(joined, b"1.1.1.1,2.2.2.2, 3.3.3.3,4.4.4.4");
        // Other names keep their first value; a single field joins nothing.
        assert_eq!(out, [Some(&b"1.1.1.1"[..]), Some(&b"u"[..])]);
        let once = serialize_headers(&[("x-forwarded-for", b"1.1.1.1"), ("x-user-id", b"u")]);
        let (mut out, mut joined) = ([None; 2], Vec::new());
        assert!(!headers(&once, &names, &mut out, &mut joined));
        assert!(joined.is_empty());
    }

    #[test]
    fn malformed_maps_never_panic() {
        let map = serialize_headers(&[("a", b"1"), ("b", b"2")]);
        for cut in 0..map.len() {
            let _ = header(&map[..cut], "b");
        }
        assert_eq!(header(&[0xff, 0xff, 0xff, 0xff], "a"), None);
        let mut lying = map.clone();
        lying[4] = 0xff;
        assert_eq!(header(&lying, "b"), None);
        for seed in 0..2000u32 {
            let junk: Vec<u8> =
                (0..(seed % 64)).map(|i| (seed.wrapping_mul(2654435761).rotate_left(i) & 0xff) as u8).collect();
            let _ = header(&junk, "a");
        }
    }
}
