use super::*;
use crate::eval::Request;
use alloc::collections::BTreeMap;
use alloc::format;
use alloc::string::ToString;
use alloc::vec;
use proptest::prelude::*;

fn exact(stream: &[(u8, u64)]) -> BTreeMap<Vec<u8>, u64> {
    let mut m = BTreeMap::new();
    for &(k, w) in stream {
        *m.entry(vec![k]).or_insert(0) += w;
    }
    m
}

fn summarize(stream: &[(u8, u64)], k: usize) -> Summary {
    let mut s = Summary::new(k);
    for &(key, w) in stream {
        s.add(&[key], w, 0, 0);
    }
    s
}

/// The summary's promises against the exact counts of the stream it summarizes.
fn holds_its_bounds(s: &Summary, truth: &BTreeMap<Vec<u8>, u64>) -> Result<(), TestCaseError> {
    let total: u64 = truth.values().sum();
    prop_assert_eq!(s.total(), total);
    prop_assert!(s.entries().len() <= s.capacity());
    prop_assert!(s.error() <= total / (s.capacity() as u64 + 1), "error {} total {}", s.error(), total);
    for (key, &t) in truth {
        let c = s.count(key);
        prop_assert!(c <= t, "listed {c} above the true {t}");
        prop_assert!(t - c <= s.error(), "listed {c}, true {t}, error {}", s.error());
        if t * (s.capacity() as u64 + 1) > total {
            prop_assert!(c > 0, "a key with {t} of {total} is not listed");
        }
    }
    Ok(())
}

/// Skewed streams: key `i` drawn with weight falling off like a Zipf law, weights 1 to 4.
fn stream() -> impl Strategy<Value = Vec<(u8, u64)>> {
    proptest::collection::vec((0u32..10_000, 1u64..5), 0..600)
        .prop_map(|v| v.into_iter().map(|(r, w)| ((10_000 / (r + 1)).min(255) as u8 ^ (r % 7) as u8, w)).collect())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn counts_stay_within_the_stated_error(s in stream(), k in 1usize..24) {
        holds_its_bounds(&summarize(&s, k), &exact(&s))?;
    }

    #[test]
    fn merged_summaries_keep_the_bound_of_the_whole_stream(s in stream(), k in 1usize..24, a in 0usize..600, b in 0usize..600) {
        let (a, b) = (a.min(s.len()), b.min(s.len()));
        let (a, b) = (a.min(b), a.max(b));
        let parts: Vec<Summary> = [&s[..a], &s[a..b], &s[b..]].iter().map(|p| summarize(p, k)).collect();
        let truth = exact(&s);
        let mut left = parts[0].clone();
        left.merge(&parts[1]);
        left.merge(&parts[2]);
        let mut right = parts[1].clone();
        right.merge(&parts[2]);
        let mut right_first = parts[0].clone();
        right_first.merge(&right);
        holds_its_bounds(&left, &truth)?;
        holds_its_bounds(&right_first, &truth)?;
        // Associative on the listed set: every key past the bound is listed by both groupings.
        let total: u64 = truth.values().sum();
        for (key, &t) in &truth {
            if t * (k as u64 + 1) > total {
                prop_assert!(left.count(key) > 0 && right_first.count(key) > 0);
            }
        }
        // Commutative, exactly.
        let mut ab = parts[0].clone();
        ab.merge(&parts[1]);
        let mut ba = parts[1].clone();
        ba.merge(&parts[0]);
        prop_assert_eq!(ab, ba);
    }

    #[test]
    fn a_summary_reads_back_as_written(s in stream(), k in 1usize..24) {
        let mut sum = summarize(&s, k);
        sum.add(b"nodes", 3, 7, node_bit(42));
        let mut out = Vec::new();
        sum.encode(&mut out);
        let mut r = Reader { bytes: &out, pos: 0 };
        prop_assert_eq!(Summary::decode(&mut r, MAX_KEY).unwrap(), sum);
        prop_assert_eq!(r.pos, out.len());
    }

    #[test]
    fn garbage_never_decodes_into_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = Summary::decode(&mut Reader { bytes: &bytes, pos: 0 }, MAX_KEY);
    }
}

#[test]
fn without_evictions_merging_is_exact_and_associative() {
    let a = summarize(&[(1, 5), (2, 1)], 8);
    let b = summarize(&[(2, 2), (3, 9)], 8);
    let c = summarize(&[(1, 1), (4, 4)], 8);
    let mut ab_c = a.clone();
    ab_c.merge(&b);
    ab_c.merge(&c);
    let mut bc = b.clone();
    bc.merge(&c);
    let mut a_bc = a.clone();
    a_bc.merge(&bc);
    assert_eq!(ab_c, a_bc);
    assert_eq!((ab_c.count(&[1]), ab_c.count(&[2]), ab_c.count(&[3]), ab_c.error()), (6, 3, 9, 0));
    let top: Vec<&[u8]> = ab_c.top(2).iter().map(|e| e.key.as_slice()).collect();
    assert_eq!(top, [&[3u8][..], &[1u8][..]]);
}

#[test]
fn a_flood_of_distinct_keys_stays_bounded() {
    let mut s = Summary::new(CAPACITY);
    for i in 0u32..100_000 {
        s.add(&i.to_le_bytes(), 1, 0, 0);
        s.add(b"heavy", 1, 0, 0);
    }
    assert!(s.entries().len() <= CAPACITY);
    assert!(s.count(b"heavy") >= 100_000 - s.error());
    assert_eq!(s.top(1)[0].key, b"heavy");
    assert!(s.evictions() > 0);
}

#[test]
fn distinct_keys_are_estimated_within_a_few_percent() {
    for n in [0u64, 1, 10, 100, 500, 1000] {
        let mut d = Distinct::default();
        for i in 0..n {
            d.add(crate::hash::HashKey::derive(b"k").hash(&i.to_le_bytes()));
        }
        let e = d.estimate();
        assert!(e.abs_diff(n) * 100 <= n * 8 + 1, "{n} distinct estimated {e}");
    }
    assert_eq!(node_count(node_bit(1) | node_bit(2) | node_bit(3)), 3);
}

const RULES: &str = r#"{
  "identity": {
    "api_key": { "header": "x-api-key" },
    "user": { "header": "x-user-id" },
    "token": { "header": "x-token", "secret": true },
    "ip": { "trusted_hops": 1, "ipv6_prefix": 64 },
    "hash_key": "a deployment's own hash key"
  },
  "rules": [
    { "name": "per-user", "key": ["user"], "limit": { "requests": 5, "per": "60s" } },
    { "name": "per-ip", "key": ["ip"], "limit": { "requests": 5, "per": "60s" } },
    { "name": "api-key", "key": ["api_key", "ip"], "limit": { "requests": 5, "per": "60s" } },
    { "name": "token", "key": ["token"], "limit": { "requests": 5, "per": "60s" } }
  ]
}"#;

fn shown(config: &Config, rule: &str, headers: [Option<&str>; 3], ip: Option<&str>) -> (Vec<u8>, String) {
    let headers: Vec<Option<&[u8]>> = headers.iter().map(|h| h.map(str::as_bytes)).collect();
    let req = Request { method: "GET", path: "/", headers: &headers, ip };
    let (checks, _) = config.checks(&req);
    let i = config.rules.iter().position(|r| r.name == rule).unwrap();
    let check = checks.into_iter().find(|c| c.rule == i).unwrap();
    let (index, text) = render(config, &check.key).unwrap();
    assert_eq!(index, i);
    (check.key, text)
}

#[test]
fn keys_show_as_pairs_in_the_rules_key_order_with_secrets_hashed() {
    let c = Config::parse(RULES.as_bytes()).unwrap();
    let (_, user) = shown(&c, "per-user", [None, Some("alice"), None], None);
    assert_eq!(user, "user=alice");
    let (_, ip) = shown(&c, "per-ip", [None, None, None], Some("203.0.113.7"));
    assert_eq!(ip, "ip=203.0.113.7");
    let v6 = crate::key::ip_key("2001:db8:1:2:aaaa::1".parse().unwrap(), &c.identity.ip);
    let (_, ip6) = shown(&c, "per-ip", [None, None, None], Some(&v6));
    assert_eq!(ip6, "ip=2001:db8:1:2::/64");
    let (key, both) = shown(&c, "api-key", [Some("sk_live_SECRET"), None, None], Some("203.0.113.7"));
    let hash = c.identity.hash_key.hash(b"sk_live_SECRET");
    assert_eq!(both, format!("api_key=#{:08x},ip=203.0.113.7", hash >> 32));
    assert!(!key.windows(6).any(|w| w == b"SECRET"), "the counter key holds no secret value");
    let (key, token) = shown(&c, "token", [None, None, Some("tok-SECRET")], None);
    assert!(token.starts_with("token=#") && token.len() == "token=#".len() + 8, "{token}");
    assert!(!key.windows(6).any(|w| w == b"SECRET"));
    let (_, odd) = shown(&c, "per-user", [None, Some("a,b=c d\u{e9}"), None], None);
    assert_eq!(odd, "user=a%2Cb%3Dc%20d%C3%A9");
}

#[test]
fn hashes_are_keyed_per_deployment() {
    let with = |extra: &str| {
        let doc = format!(
            r#"{{"identity":{{"api_key":{{"header":"x-api-key"}}{extra}}},"rules":[{{"name":"k","key":["api_key"],"limit":{{"requests":1,"per":"1s"}}}}]}}"#
        );
        let c = Config::parse(doc.as_bytes()).unwrap();
        let headers: Vec<Option<&[u8]>> = vec![Some(b"sk_live_1")];
        let (checks, _) = c.checks(&Request { method: "GET", path: "/", headers: &headers, ip: None });
        (render(&c, &checks[0].key).unwrap().1, c.identity.hash_key_source)
    };
    let (a, source) = with(r#","hash_key":"0123456789abcdef""#);
    assert_eq!(source, crate::rules::HashKeySource::HashKey);
    assert_eq!(a, with(r#","hash_key":"0123456789abcdef""#).0, "every node of a deployment agrees");
    assert_ne!(a, with(r#","hash_key":"another key, longer""#).0);
    let (builtin, source) = with("");
    assert_eq!(source, crate::rules::HashKeySource::BuiltIn);
    assert_ne!(a, builtin);
    let short = Config::parse(br#"{"identity":{"hash_key":"short"},"rules":[]}"#).unwrap_err();
    assert_eq!(short.to_string(), "identity.hash_key: must be at least 16 characters");
    let sync = r#"{"rules":[],"sync":{"cluster":"s","secret":"0123456789abcdef"}}"#;
    let c = Config::parse(sync.as_bytes()).unwrap();
    assert_eq!(c.identity.hash_key_source, crate::rules::HashKeySource::SyncSecret);
    assert_eq!(c.identity.hash_key, crate::key::HashKey::derive(b"0123456789abcdef"));
    let public = Config::parse(br#"{"identity":{"api_key":{"header":"k","secret":false}},"rules":[]}"#).unwrap();
    assert!(!public.identity.secret[0], "api_key may be declared public");
    assert!(Config::parse(br#"{"identity":{"user":{"header":"u"}},"rules":[]}"#).unwrap().identity.secret == [false]);
}

#[test]
fn long_keys_are_cut_and_keep_apart() {
    let k = crate::key::HashKey::derive(b"x");
    let a = bounded_key("a".repeat(400), &k);
    let b = bounded_key(format!("{}b", "a".repeat(399)), &k);
    assert!(a.len() <= MAX_KEY && b.len() <= MAX_KEY);
    assert_ne!(a, b);
    assert_eq!(bounded_key("user=bob".to_string(), &k), "user=bob");
}

fn batch() -> crate::sync::SyncRequest {
    let limit = crate::algo::Limit::new(crate::algo::Algorithm::FixedWindow, 5, crate::SECOND, None).unwrap();
    let delta = crate::sync::Delta { key: b"k".to_vec(), limit, units: 3 };
    crate::sync::SyncRequest { node: 7, seq: 9, sent: 0, deltas: vec![delta], ask: false }
}

#[test]
fn batches_are_read_with_and_without_a_top_section() {
    use crate::sync::{RuleTop, SyncRequest, TopSection};
    let req = batch();
    let plain = req.encode();
    assert_eq!(SyncRequest::decode_with_top(&plain).unwrap(), (req.clone(), None));
    let mut top = Summary::default();
    top.add(b"api_key=#3f9a1c2e", 30, 5, node_bit(7));
    let section = TopSection {
        rules: vec![RuleTop { rule: "api-key".into(), allowed: 1200, denied: 37, shadow_denied: 2, top }],
    };
    let mut with = plain.clone();
    section.encode_into(&mut with);
    assert_eq!(SyncRequest::decode(&with).unwrap(), req, "a store that reads only the batch still takes it");
    assert_eq!(SyncRequest::decode_with_top(&with).unwrap(), (req, Some(section)));
    let mut garbage = plain.clone();
    garbage.push(0x00);
    assert!(SyncRequest::decode(&garbage).is_err(), "other trailing bytes are still an error");
    let mut cut = with.clone();
    cut.pop();
    assert!(SyncRequest::decode(&cut).is_err());
}

#[test]
fn a_top_section_stays_within_its_byte_bound() {
    use crate::sync::{RuleTop, TopSection, MAX_TOP_SECTION};
    let rule =
        |r: usize, top: Summary| RuleTop { rule: format!("rule-{r}"), allowed: 1, denied: 2, shadow_denied: 0, top };
    let size = |top: &Summary| {
        let mut out = Vec::new();
        TopSection { rules: vec![rule(0, top.clone())] }.encode_into(&mut out);
        out.len()
    };
    // The first rule's entries fill the section to within a few bytes; the others' would
    // each fit alone.
    let mut first = Summary::new(crate::topk::MAX_CAPACITY);
    let mut i = 0u64;
    while size(&first) < MAX_TOP_SECTION - 400 {
        first.add(format!("user={}{i}", "x".repeat(140)).as_bytes(), i + 1, 0, 1);
        i += 1;
    }
    while size(&first) < MAX_TOP_SECTION - 40 {
        first.add(format!("u{i}").as_bytes(), i + 1, 0, 1);
        i += 1;
    }
    let mut rules = vec![rule(0, first)];
    for r in 1..40 {
        let mut top = Summary::default();
        for i in 0..8u64 {
            top.add(format!("user={}{i}", "x".repeat(140)).as_bytes(), i + 1, 0, 1);
        }
        rules.push(rule(r, top));
    }
    let section = TopSection { rules };
    let mut out = Vec::new();
    section.encode_into(&mut out);
    assert!(out.len() <= MAX_TOP_SECTION, "{}", out.len());
    let back = TopSection::decode(&out).unwrap();
    // Every rule's counts are there (room is kept for them first); a rule's entries go whole
    // or not at all; the first rule's do not leave room for the others' counts.
    assert_eq!(back.rules.len(), 40);
    for (b, r) in back.rules.iter().zip(&section.rules) {
        assert_eq!((&b.rule, b.allowed, b.denied), (&r.rule, 1, 2));
        assert!(b.top.is_empty() || *b == *r);
    }
    assert!(back.rules[0].top.is_empty());
    assert_eq!(back.rules[1], section.rules[1]);
}

#[test]
fn a_key_listed_since_its_first_denial_shows_its_exact_count_through_reductions() {
    let mut s = Summary::new(4);
    // The heavy key, then a flood of keys seen once each: every fifth key forces a
    // reduction, which lowers the heavy key's counter but not what it shows.
    s.add(b"heavy", 10, 0, 0);
    for i in 0u32..400 {
        s.add(&i.to_le_bytes(), 1, 0, 0);
        if i % 4 == 0 {
            s.add(b"heavy", 1, 0, 0);
        }
    }
    assert!(s.error() > 50, "the flood forced reductions: {}", s.error());
    assert_eq!(s.count(b"heavy"), 110);
    let mut other = Summary::new(4);
    other.add(b"heavy", 5, 0, 0);
    s.merge(&other);
    assert_eq!(s.count(b"heavy"), 115);
    let mut out = Vec::new();
    s.encode(&mut out);
    assert_eq!(Summary::decode(&mut Reader { bytes: &out, pos: 0 }, MAX_KEY).unwrap(), s);
}

#[test]
fn the_first_form_of_the_top_section_is_still_read() {
    use crate::encoding::put_varint;
    use crate::sync::{TopSection, TOP_SECTION_COUNTERS_ONLY};
    // One rule `rule` (7 allowed, 3 denied, 0 shadow) whose summary (capacity 64, total 3,
    // error 0, evictions 0) lists `user=a`: 3 denied, 2 allowed, node bits 1.
    let mut out = vec![TOP_SECTION_COUNTERS_ONLY, 1, 4];
    out.extend_from_slice(b"rule");
    for v in [7u64, 3, 0, 64, 3, 0, 0, 1, 6] {
        put_varint(&mut out, v);
    }
    out.extend_from_slice(b"user=a");
    put_varint(&mut out, 3);
    put_varint(&mut out, 2);
    out.extend_from_slice(&1u64.to_le_bytes());
    let back = TopSection::decode(&out).unwrap();
    let top = &back.rules[0].top;
    assert_eq!(top.count(b"user=a"), 3);
    assert_eq!(top.entries()[0].weight, 3);
    assert_eq!(top.entries()[0].allowed, 2);
}

#[test]
fn a_small_summary_takes_in_a_larger_one_without_growing_and_halving_drops_no_key() {
    let mut tick = Summary::new(256);
    for i in 0..200u32 {
        tick.add(format!("k{i}").as_bytes(), 1 + u64::from(i % 3), 0, 0);
    }
    let mut kept = Summary::new(8);
    kept.add(b"heavy", 50, 0, 0);
    kept.merge_keeping(&tick);
    assert_eq!(kept.capacity(), 8);
    assert!(kept.entries().len() <= 8);
    assert_eq!(kept.count(b"heavy"), 50, "a listed key keeps its count");
    let before: Vec<(Vec<u8>, u64)> = kept.entries().iter().map(|e| (e.key.clone(), e.denied)).collect();
    kept.halve_weights();
    let after: Vec<(Vec<u8>, u64)> = kept.entries().iter().map(|e| (e.key.clone(), e.denied)).collect();
    assert_eq!(before, after);
    assert!(kept.entries().iter().all(|e| e.weight >= 1 && e.weight <= e.denied));
    let heavy = kept.entries().iter().find(|e| e.key == b"heavy").unwrap();
    assert!(heavy.weight < 50 / 2 + 1);
}

/// A second at the end of time (a share read back from Redis names the second it was of):
/// `sec + SERIES` overflowed in `add`, then `end + 1` in `series`.
#[cfg(feature = "admin")]
#[test]
fn windows_take_a_second_at_the_end_of_time() {
    use crate::sync::{RuleTop, TopSection};
    let section = TopSection {
        rules: alloc::vec![RuleTop { rule: "r".into(), allowed: 1, denied: 0, shadow_denied: 0, top: Summary::new(4) }],
    };
    let mut w = super::windows::Windows::new(8, 8);
    w.add(u64::MAX, &section, &[]);
    assert_eq!(w.top(0, None, super::windows::Window::Minute)["rules"][0]["allowed"], 1);
    let series = w.series(0, None);
    assert_eq!(series["rules"][0]["allowed"].as_array().map(|a| a.iter().filter(|v| **v == 1).count()), Some(1));
}

#[cfg(feature = "admin")]
#[test]
fn the_windows_keep_their_bound_when_a_batch_brings_a_larger_summary() {
    use crate::sync::{RuleTop, TopSection};
    let mut big = Summary::new(1024);
    for i in 0..1000u32 {
        big.add(format!("user=u{i}").as_bytes(), 1 + u64::from(i % 40), 0, 0);
    }
    big.add(b"user=heavy", 100_000, 0, 0);
    let section = TopSection {
        rules: alloc::vec![RuleTop { rule: "r".into(), allowed: 0, denied: 1000, shadow_denied: 0, top: big }],
    };
    let mut w = super::windows::Windows::new(4, 16);
    w.add(1_000, &section, &[]);
    w.add(1_001, &section, &[]);
    let top = w.top(1_001, None, super::windows::Window::Minute);
    let listed = top["rules"][0]["top"].as_array().map_or(0, Vec::len);
    assert!((1..=16).contains(&listed), "{listed} keys listed from windows that keep 16: {top}");
    assert_eq!(top["rules"][0]["top"][0]["key"], "user=heavy");
    assert!(w.largest_summary() <= 16, "a bucket holds {} keys", w.largest_summary());
}

#[cfg(feature = "admin")]
#[test]
fn a_rule_not_heard_of_for_an_hour_makes_room_for_a_new_one_when_the_windows_are_full() {
    use crate::sync::{RuleTop, TopSection};
    let section = |name: &str| TopSection {
        rules: alloc::vec![RuleTop {
            rule: name.into(),
            allowed: 1,
            denied: 0,
            shadow_denied: 0,
            top: Summary::new(4)
        }],
    };
    let names = |w: &super::windows::Windows, t: u64| -> Vec<String> {
        let top = w.top(t, None, super::windows::Window::Hour);
        top["rules"]
            .as_array()
            .map_or_else(Vec::new, |r| r.iter().map(|x| x["rule"].as_str().unwrap_or("").into()).collect())
    };
    let mut w = super::windows::Windows::new(2, 4);
    assert!(!w.holds(10_000), "nothing heard of");
    w.add(10_000, &section("old"), &[]);
    w.add(10_000, &section("kept"), &[]);
    assert!(w.holds(10_000 + 3_599), "heard of within the hour");
    assert!(!w.holds(10_000 + 3_600), "an hour on, the windows show nothing");
    // Full, and both were heard within the hour: a third is not tracked.
    w.add(12_000, &section("kept"), &[]);
    w.add(13_000, &section("new"), &[]);
    assert_eq!(names(&w, 13_000), ["old", "kept"]);
    // "old" has not been heard of for an hour: "new" takes its place; "kept" stays.
    w.add(13_600, &section("new"), &[]);
    assert_eq!(names(&w, 13_600), ["kept", "new"]);
}

#[cfg(feature = "admin")]
#[test]
fn rules_are_listed_in_the_order_of_the_document_the_last_section_came_from() {
    use crate::sync::{RuleTop, TopSection};
    let section = |names: &[&str]| TopSection {
        rules: names
            .iter()
            .map(|n| RuleTop { rule: (*n).into(), allowed: 1, denied: 0, shadow_denied: 0, top: Summary::new(4) })
            .collect(),
    };
    let names = |w: &super::windows::Windows| -> Vec<String> {
        let top = w.top(10_000, None, super::windows::Window::Minute);
        top["rules"]
            .as_array()
            .map_or_else(Vec::new, |r| r.iter().map(|x| x["rule"].as_str().unwrap_or("").into()).collect())
    };
    let mut w = super::windows::Windows::new(8, 4);
    // Heard first: the third rule, then the first and the third.
    w.add(10_000, &section(&["login"]), &[]);
    w.add(10_000, &section(&["api-key", "login"]), &[]);
    assert_eq!(names(&w), ["api-key", "login"]);
    // A section with every rule of the document puts them all in its order (a rule new to the
    // store included); a rule only an older document had keeps its place.
    w.add(10_000, &section(&["retired"]), &[]);
    w.add(10_000, &section(&["holds", "api-key", "login"]), &[]);
    assert_eq!(names(&w), ["holds", "api-key", "retired", "login"]);
}

#[test]
fn admitted_units_wait_for_a_keys_first_denial_bounded_and_for_a_minute() {
    let mut a = Admitted::default();
    a.note(b"alice", 3, 100);
    a.note(b"alice", 2, 130);
    assert_eq!(a.take(b"alice", 150), 5);
    assert_eq!(a.take(b"alice", 150), 0, "taken out");
    a.note(b"bob", 4, 100);
    assert_eq!(a.take(b"bob", 100 + ADMITTED_FOR_S + 1), 0, "let go after a minute");
    // Full: a key bringing more takes the place of the one with the fewest units; one
    // bringing fewer is not kept.
    for i in 0..ADMITTED_KEYS {
        a.note(format!("k{i}").as_bytes(), 2 + i as u64, 200);
    }
    assert_eq!(a.len(), ADMITTED_KEYS);
    a.note(b"light", 1, 200);
    assert_eq!(a.take(b"light", 200), 0);
    a.note(b"heavy", 50, 200);
    assert_eq!(a.len(), ADMITTED_KEYS);
    assert_eq!(a.take(b"k0", 200), 0, "the fewest made room");
    assert_eq!(a.take(b"heavy", 200), 50);
    // Units let go weigh nothing: a new key takes their place.
    let mut b = Admitted::default();
    for i in 0..ADMITTED_KEYS {
        b.note(format!("k{i}").as_bytes(), 100, 0);
    }
    b.note(b"new", 1, 1_000);
    assert_eq!(b.take(b"new", 1_000), 1);
}

/// A node that admitted a client another node denied reports those units in an entry of
/// admitted units only: it travels, adds to the key's entry where the fleet lists it, and
/// lists no key on its own.
#[cfg(feature = "admin")]
#[test]
fn an_entry_of_admitted_units_only_adds_to_a_listed_key_and_lists_none() {
    use crate::sync::{RuleTop, TopSection};
    let section = |top: Summary| TopSection {
        rules: alloc::vec![RuleTop { rule: "r".into(), allowed: 5, denied: 0, shadow_denied: 0, top }],
    };
    let mut admitting = Summary::new(4);
    admitting.add_admitted(b"user=a", 5, node_bit(1));
    admitting.add_admitted(b"user=quiet", 2, node_bit(1));
    admitting.add(b"user=b", 1, 0, node_bit(1));
    let mut out = Vec::new();
    section(admitting.clone()).encode_into(&mut out);
    let back = TopSection::decode(&out).unwrap();
    assert_eq!(back.rules[0].top, admitting, "it travels as it was");
    assert_eq!(admitting.top(10).len(), 1, "only a denied key is listed");
    // An entry whose count was taken whole is still no encoding.
    let mut bad = Summary::new(4);
    bad.add(b"user=c", 1, 0, 0);
    let mut bytes = Vec::new();
    bad.encode(&mut bytes);
    *bytes.last_mut().unwrap() = 1;
    assert!(Summary::decode(&mut Reader { bytes: &bytes, pos: 0 }, MAX_KEY).is_err());

    let mut denying = Summary::new(4);
    denying.add(b"user=a", 3, 0, node_bit(2));
    let mut w = super::windows::Windows::new(8, 8);
    w.add(1_000, &section(admitting), &[]);
    w.add(1_001, &section(denying), &[]);
    let top = w.top(1_001, None, super::windows::Window::Minute);
    let listed = top["rules"][0]["top"].as_array().unwrap();
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert_eq!(listed[0]["key"], "user=a");
    assert_eq!((listed[0]["denied"].as_u64(), listed[0]["allowed"].as_u64()), (Some(3), Some(5)));
    assert_eq!(listed[0]["nodes"], 2, "the node that admitted it saw it too");
    assert_eq!(listed[1]["key"], "user=b");
    // A full summary keeps its denied keys: admitted units alone take no place from them.
    let mut full = Summary::new(2);
    full.add(b"x", 1, 0, 0);
    full.add(b"y", 1, 0, 0);
    full.add_admitted(b"z", 9, 0);
    assert_eq!(full.entries().len(), 2);
    let mut with_room = Summary::new(3);
    with_room.add_admitted(b"z", 9, 0);
    full.merge_keeping(&with_room);
    assert_eq!(full.entries().iter().map(|e| e.key.as_slice()).collect::<Vec<_>>(), [&b"x"[..], b"y"]);
    assert_eq!(full.evictions(), 0);
    full.halve_weights();
    with_room.halve_weights();
    assert_eq!(with_room.entries()[0].weight, 0, "halving gives no count to admitted units");
}

#[test]
fn lately_holds_a_key_for_its_span_and_at_most_its_cap_the_oldest_going_first() {
    let mut l = Lately::new(60, 2);
    l.note(&[1], 0);
    l.note(&[2], 10);
    assert!(l.holds(1, 59) && !l.holds(1, 60), "held for the span");
    l.note(&[1], 20);
    assert!(l.holds(1, 79), "noted again: held from then");
    l.note(&[3], 30);
    assert_eq!(l.held(30), [1, 3], "past the cap the oldest (2) went");
    assert_eq!(l.held(85), [3]);
}

/// A second before the latest seen counts in its own buckets through `add_past` (and in none
/// once they are gone), and in the latest through `add` (a clock that went backwards).
#[cfg(feature = "admin")]
#[test]
fn a_past_second_counts_in_its_own_buckets_and_a_clock_gone_back_in_the_latest() {
    use super::windows::{Window, Windows};
    use crate::sync::{RuleTop, TopSection};
    let section = |denied: u64| TopSection {
        rules: alloc::vec![RuleTop { rule: "r".into(), allowed: 0, denied, shadow_denied: 0, top: Summary::new(4) }],
    };
    let denied = |w: &Windows, window: Window| w.top(10_000, None, window)["rules"][0]["denied"].clone();
    let mut w = Windows::new(4, 4);
    w.add(10_000, &section(1), &[]);
    w.add_past(9_930, &section(10));
    assert_eq!((denied(&w, Window::Minute), denied(&w, Window::Hour)), (1.into(), 11.into()));
    w.add_past(10_000 - 3_600, &section(100));
    assert_eq!(denied(&w, Window::Hour), 11, "older than the hour: counted nowhere");
    w.add(9_990, &section(1000), &[]);
    assert_eq!(denied(&w, Window::Minute), 1001, "a clock gone back counts now");
    let series = w.series(10_000, None);
    let d = &series["rules"][0]["denied"];
    assert_eq!(
        (d[super::windows::SERIES - 71].clone(), d[super::windows::SERIES - 1].clone()),
        (10.into(), 1001.into())
    );
}
