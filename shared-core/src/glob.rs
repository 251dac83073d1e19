//! Path patterns (`/v1/events/*/holds`, `/v1/*`) and path normalization.
//!
//! Semantics: a `*` segment matches exactly one path segment, except as the last segment,
//! where it matches one or more (so `/v1/*` covers everything below `/v1`). `**` matches any
//! number of segments, including none. A `*` inside a segment (`*.json`) matches within that
//! segment. Matching is on the normalized path, so `//v1/./auth/login/?x=1` and
//! `/v1/auth/%6Cogin` cannot slip past a rule for `/v1/auth/login`.

use alloc::borrow::Cow;
use alloc::string::String;
use alloc::vec::Vec;

/// At most this many pattern segments follow a `**` before the next one (or the end): they are
/// tried at every depth the `**` reaches, so a path segment is compared against at most this
/// many of a pattern's segments (a `**` followed by 250 segments took 47 ms to refuse a path
/// of 4,000 segments, natively, for each rule that had one).
pub const MAX_AFTER_ANY_DEPTH: usize = 16;

/// A compiled path pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathPattern {
    segments: Vec<Segment>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Literal(String),
    /// A glob within one segment, split at its `*`s.
    Glob(Vec<String>),
    Any,
    AnyDepth,
}

impl PathPattern {
    /// Compiles a pattern; it must start with `/`.
    pub fn parse(pattern: &str) -> Result<PathPattern, &'static str> {
        if !pattern.starts_with('/') {
            return Err("must start with /");
        }
        if pattern.len() > 1024 {
            return Err("is longer than 1024 bytes");
        }
        if pattern.contains(['?', '#']) {
            return Err("must not contain a query or fragment");
        }
        let normalized = normalize_path(pattern.as_bytes());
        let mut segments: Vec<Segment> = Vec::new();
        for s in split(&normalized) {
            let seg = match s {
                "*" => Segment::Any,
                "**" => Segment::AnyDepth,
                s if s.contains('*') => Segment::Glob(s.split('*').map(String::from).collect()),
                s => Segment::Literal(String::from(s)),
            };
            // `**/**` is `**`.
            if !(matches!(seg, Segment::AnyDepth) && matches!(segments.last(), Some(Segment::AnyDepth))) {
                segments.push(seg);
            }
        }
        // A last `*` is one or more segments: `*/**`.
        if matches!(segments.last(), Some(Segment::Any)) {
            segments.push(Segment::AnyDepth);
        }
        // Segments since the latest `**`.
        let mut after: Option<usize> = None;
        for seg in &segments {
            after = match seg {
                Segment::AnyDepth => Some(0),
                _ => after.map(|n| n + 1),
            };
            if after.is_some_and(|n| n > MAX_AFTER_ANY_DEPTH) {
                return Err("has more than 16 segments after a `**` (before the next `**` or the end)");
            }
        }
        Ok(PathPattern { segments })
    }

    /// Whether a normalized path matches. Allocation-free: it runs for every rule on every
    /// request.
    ///
    /// Linear in the path for any pattern: `**` is matched like `*` in a wildcard string
    /// match, by the greedy two-pointer algorithm (on a mismatch, only the latest `**` takes
    /// one more segment and matching resumes after it). That is exact here because every
    /// other pattern segment matches exactly one path segment, so an earlier `**` never needs
    /// to give back what a later one can take. Each path segment is compared against at most
    /// the pattern segments between two `**`s, so the cost is O(path × pattern) with no
    /// backtracking, whatever the `**`s; and since at most [`MAX_AFTER_ANY_DEPTH`] segments
    /// follow a `**`, at most that many comparisons per path segment.
    pub fn matches(&self, normalized_path: &str) -> bool {
        let pat = &self.segments;
        let mut path = normalized_path.trim_start_matches('/');
        let mut p = 0;
        // The latest `**` seen: the pattern index after it, and the path where it stopped.
        let mut star: Option<(usize, &str)> = None;
        while !path.is_empty() {
            // What follows the path's first segment when the pattern's next one matches it.
            let step = match pat.get(p) {
                Some(Segment::AnyDepth) => {
                    p += 1;
                    star = Some((p, path));
                    continue;
                }
                // The common case, a literal, without searching for the next `/` first.
                Some(Segment::Literal(l)) => match path.strip_prefix(l.as_str()) {
                    Some("") => Some(""),
                    Some(t) => t.strip_prefix('/'),
                    None => None,
                },
                Some(Segment::Any) => Some(split_segment(path).1),
                Some(Segment::Glob(parts)) => {
                    let (seg, tail) = split_segment(path);
                    glob_matches(parts, seg).then_some(tail)
                }
                None => None,
            };
            if let Some(tail) = step {
                p += 1;
                path = tail;
                continue;
            }
            // Mismatch: the latest `**` takes one more segment, or there is none to.
            match star {
                Some((after, from)) => {
                    let rest = split_segment(from).1;
                    star = Some((after, rest));
                    p = after;
                    path = rest;
                }
                None => return false,
            }
        }
        pat.get(p..).unwrap_or(&[]).iter().all(|s| matches!(s, Segment::AnyDepth))
    }
}

/// Whether a single-segment pattern (`*`, a literal, a glob) matches one path segment.
#[cfg(test)]
fn segment_matches(pat: &Segment, seg: &str) -> bool {
    match pat {
        Segment::Literal(l) => l == seg,
        Segment::Any => true,
        Segment::Glob(parts) => glob_matches(parts, seg),
        Segment::AnyDepth => false,
    }
}

fn split(path: &str) -> impl Iterator<Item = &str> {
    path.split('/').filter(|s| !s.is_empty())
}

/// The first segment of `path` and what follows its `/` (a byte scan: `str::split_once`
/// sets up a general searcher, which costs more than these short segments).
fn split_segment(path: &str) -> (&str, &str) {
    match path.bytes().position(|b| b == b'/') {
        Some(i) => (path.get(..i).unwrap_or(path), path.get(i + 1..).unwrap_or("")),
        None => (path, ""),
    }
}

fn glob_matches(parts: &[String], mut s: &str) -> bool {
    let (Some(first), Some(last)) = (parts.first(), parts.last()) else {
        return true;
    };
    let Some(rest) = s.strip_prefix(first.as_str()) else {
        return false;
    };
    s = rest;
    let middle = parts.get(1..parts.len().saturating_sub(1)).unwrap_or(&[]);
    for p in middle {
        // A plain window scan: `str::find`'s two-way searcher is ~1.5 KB of filter wasm, and
        // these are short parts of one segment.
        let p = p.as_bytes();
        match s.as_bytes().windows(p.len().max(1)).position(|w| w == p) {
            Some(i) if !p.is_empty() => s = s.get(i + p.len()..).unwrap_or(""),
            _ if p.is_empty() => {}
            _ => return false,
        }
    }
    parts.len() > 1 && s.len() >= last.len() && s.ends_with(last.as_str())
}

/// Normalizes a request path for matching: drops the query and fragment, decodes
/// percent-encoded unreserved characters and writes the other escapes' hex digits in upper
/// case (RFC 3986 6.2.2: `%2f` is `%2F`), reads `\` as `/` and percent-encodes what a URL
/// parser encodes in a path (non-ASCII bytes, controls, space, `"`, `<`, `>`, `{`, `}`, the
/// backquote: `/é` is `/%C3%A9`), as a Worker's runtime hands its path over — so both
/// spellings of a path are one — collapses repeated `/`, resolves `.` and `..`, and drops a
/// trailing `/`. The result is ASCII, whatever bytes came in.
pub fn normalize_path(raw: &[u8]) -> Cow<'_, str> {
    let end = raw.iter().position(|&b| b == b'?' || b == b'#').unwrap_or(raw.len());
    let raw = raw.get(..end).unwrap_or(raw);
    // Fast path, the common case: already normal, borrowed as it is.
    if is_normal(raw) {
        if let Some(s) = crate::text::text(raw) {
            return Cow::Borrowed(s);
        }
    }
    Cow::Owned(normalized(raw))
}

/// [`normalize_path`] of a path that is not normal already: out of line, so that the common
/// case stays small where it is inlined.
#[cold]
#[inline(never)]
fn normalized(raw: &[u8]) -> String {
    let mut decoded = Vec::with_capacity(raw.len());
    let mut i = 0;
    while let Some(&b) = raw.get(i) {
        if b == b'%' {
            if let (Some(h), Some(l)) = (raw.get(i + 1).and_then(hex), raw.get(i + 2).and_then(hex)) {
                let c = h * 16 + l;
                if c.is_ascii_alphanumeric() || b"-._~".contains(&c) {
                    decoded.push(c);
                    i += 3;
                    continue;
                }
            } else {
                // A stray `%` becomes `%25`, so decoding cannot splice a new escape out of it
                // (`%6%62` would otherwise become `%6b`, which a second decode reads as `k`):
                // the result is a fixed point, whatever decodes it again downstream.
                decoded.extend_from_slice(b"%25");
                i += 1;
                continue;
            }
        }
        match b {
            b'%' => {
                // An escape kept: its hex digits in upper case.
                decoded.push(b'%');
                for d in raw.get(i + 1..i + 3).unwrap_or_default() {
                    decoded.push(d.to_ascii_uppercase());
                }
                i += 3;
                continue;
            }
            b'\\' => decoded.push(b'/'),
            _ if encoded(b) => {
                let digit = |d: u8| if d < 10 { b'0' + d } else { b'A' + d - 10 };
                decoded.extend_from_slice(&[b'%', digit(b >> 4), digit(b & 15)]);
            }
            _ => decoded.push(b),
        }
        i += 1;
    }
    let text = String::from_utf8_lossy(&decoded);
    let mut out: Vec<&str> = Vec::new();
    for seg in text.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            s => out.push(s),
        }
    }
    let mut path = String::with_capacity(text.len() + 1);
    for s in &out {
        path.push('/');
        path.push_str(s);
    }
    if path.is_empty() {
        path.push('/');
    }
    path
}

/// Whether a path (without query) is already normal: starts with `/`, no `%`, no empty, `.`
/// or `..` segment, no trailing `/` (except the root).
fn is_normal(raw: &[u8]) -> bool {
    if raw == b"/" {
        return true;
    }
    raw.first() == Some(&b'/')
        && !raw.iter().any(|&b| b == b'%' || b == b'\\' || encoded(b))
        && raw.get(1..).is_some_and(|rest| rest.split(|&b| b == b'/').all(|seg| !matches!(seg, b"" | b"." | b"..")))
}

/// Whether a URL parser percent-encodes `b` in a path (WHATWG's path percent-encode set).
/// (Written as a range and a list, it ran ~120 fewer guest instructions per request than as
/// one `matches!` of the bytes kept.)
fn encoded(b: u8) -> bool {
    !(0x21..0x7f).contains(&b) || b"\"<>`{}".contains(&b)
}

fn hex(b: &u8) -> Option<u8> {
    (*b as char).to_digit(16).map(|d| d as u8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::format;

    fn m(p: &str, path: &str) -> bool {
        PathPattern::parse(p).unwrap().matches(&normalize_path(path.as_bytes()))
    }

    /// Each segment after a `**` is tried at every depth it reaches: at most 16 of them, so a
    /// long path costs at most 16 comparisons a segment, whatever the pattern.
    #[test]
    fn at_most_sixteen_segments_follow_a_double_star() {
        let run = |n: usize| format!("/**{}", "/a*".repeat(n));
        assert!(PathPattern::parse(&run(16)).is_ok());
        assert!(PathPattern::parse(&run(17)).unwrap_err().contains("more than 16 segments after a `**`"));
        // Before the first `**` a pattern is matched once, from the start.
        assert!(PathPattern::parse(&format!("{}/**", "/a".repeat(40))).is_ok());
        // Counted from the latest `**`; a last `*` is `*/**`.
        assert!(PathPattern::parse(&format!("/**{}/**{}/*", "/a".repeat(16), "/b".repeat(15))).is_ok());
        // `a**` is a glob in one segment, not a `**`: `/**/a**/a**…` is one long run.
        assert!(PathPattern::parse(&format!("/{}/N*b", "**/a".repeat(250))).is_err());
    }

    #[test]
    fn star_is_one_segment_inside_and_the_rest_at_the_end() {
        assert!(m("/v1/events/*/holds", "/v1/events/42/holds"));
        assert!(!m("/v1/events/*/holds", "/v1/events/42/x/holds"));
        assert!(!m("/v1/events/*/holds", "/v1/events/holds"));
        assert!(m("/v1/*", "/v1/auth/login"));
        assert!(m("/v1/*", "/v1/x"));
        assert!(!m("/v1/*", "/v1"));
        assert!(!m("/v1/*", "/v2/x"));
        assert!(m("/v1/**/holds", "/v1/holds"));
        assert!(m("/v1/**/holds", "/v1/a/b/holds"));
        assert!(m("/files/*.json", "/files/a.json"));
        assert!(!m("/files/*.json", "/files/a.txt"));
    }

    /// The matcher before it was made linear: backtracking, O(segments^k) for k `**`s. The
    /// reference the linear one must agree with.
    fn reference(pat: &[Segment], path: &str) -> bool {
        let Some((first, rest)) = pat.split_first() else {
            return path.is_empty();
        };
        match first {
            Segment::AnyDepth => {
                let mut p = path;
                loop {
                    if reference(rest, p) {
                        return true;
                    }
                    if p.is_empty() {
                        return false;
                    }
                    p = split_segment(p).1;
                }
            }
            _ if path.is_empty() => false,
            one => {
                let (seg, tail) = split_segment(path);
                segment_matches(one, seg) && reference(rest, tail)
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 3000, ..Default::default() })]
        #[test]
        fn linear_matching_agrees_with_backtracking(
            pat in proptest::collection::vec(proptest::sample::select(alloc::vec!["a", "b", "*", "**", "a*", "*b", "a*b"]), 0..7),
            path in proptest::collection::vec(proptest::sample::select(alloc::vec!["a", "b", "ab", "ba", "aab"]), 0..9),
        ) {
            let pattern = alloc::format!("/{}", pat.join("/"));
            let path = alloc::format!("/{}", path.join("/"));
            let compiled = PathPattern::parse(&pattern).unwrap();
            let normalized = normalize_path(path.as_bytes());
            proptest::prop_assert_eq!(
                compiled.matches(&normalized),
                reference(&compiled.segments, normalized.trim_start_matches('/')),
                "{} against {}", pattern, path
            );
        }
    }

    #[test]
    fn many_double_stars_against_a_long_path_stay_linear() {
        // What backtracked for 10^9+ steps: the answers, at once.
        let long: alloc::string::String = "/a".repeat(10_000);
        assert!(!m("/**/**/x", &long));
        assert!(!m("/**/**/**/x", &long));
        assert!(m("/**/**/**/a", &long));
        let users = alloc::format!("/api{}", "/users".repeat(10_000));
        assert!(!m("/api/**/users/**/export", &users));
        assert!(m("/api/**/users/**/export", &alloc::format!("{users}/export")));
    }

    #[test]
    fn disguised_paths_still_match() {
        for p in [
            "/v1/auth/login/",
            "//v1//auth/login",
            "/v1/./auth/x/../login",
            "/v1/auth/%6Cogin",
            "/v1/auth/login?a=b",
            "/v1/auth/login#f",
        ] {
            assert!(m("/v1/auth/login", p), "{p}");
        }
        assert_eq!(normalize_path(b"/../../etc"), "/etc");
        assert_eq!(normalize_path(b"/a%2Fb"), "/a%2Fb");
        assert_eq!(normalize_path(b"/%6%62"), "/%256b");
        assert_eq!(normalize_path(b"/%256b"), "/%256b");
        assert_eq!(normalize_path(b"/100%"), "/100%25");
        assert_eq!(normalize_path(b""), "/");
        assert_eq!(normalize_path(b"/"), "/");
        assert_eq!(normalize_path(b"/v1/things?x"), "/v1/things");
        assert_eq!(normalize_path(b"/a/.b/..c"), "/a/.b/..c");
        assert_eq!(normalize_path(b"/a/\xff"), "/a/%FF");
    }

    /// What a Worker's runtime does to a path before ratewall reads it (WHATWG URL parsing:
    /// `\` is `/`, non-ASCII bytes and a few others percent-encoded) gives the same path as
    /// the request line a proxy hands over; and an escape's hex digits in either case are one
    /// (RFC 3986 6.2.2.1). Each spelling matched one side's rule and went past the other's.
    #[test]
    fn every_spelling_of_a_path_is_one() {
        for (raw, normal) in [
            (&b"/a\\b\\c"[..], "/a/b/c"),
            (b"/x/..\\f", "/f"),
            (b"/f\\", "/f"),
            ("/é/y".as_bytes(), "/%C3%A9/y"),
            (b"/%c3%a9/y", "/%C3%A9/y"),
            (b"/%C3%A9/y", "/%C3%A9/y"),
            (b"/s/%2f/x", "/s/%2F/x"),
            (b"/a b/{c}", "/a%20b/%7Bc%7D"),
            (b"/%7b", "/%7B"),
        ] {
            assert_eq!(normalize_path(raw), normal, "{raw:?}");
        }
        for (pattern, path) in
            [("/é/*", "/%c3%a9/x"), ("/%C3%A9/*", "/é/x"), ("/s/%2F/x", "/s/%2f/x"), ("/a/*/c", "/a\\b\\c")]
        {
            assert!(m(pattern, path), "{pattern} {path}");
        }
    }
}
