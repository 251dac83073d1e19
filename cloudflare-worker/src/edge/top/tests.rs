use super::*;
use crate::edge::{cached_denials, checks_for, BlockedCache, Rules};
use ratewall_core::algo::Decision;
use ratewall_core::eval::{combine, StoreError};

const RULES: &str = r#"{
  "identity": {"user": {"header": "x-user-id"}, "api_key": {"header": "x-api-key"},
               "hash_key": "this deployment's hash key"},
  "rules": [
    {"name": "per-key", "key": ["api_key"], "limit": {"requests": 2, "per": "60s"}},
    {"name": "watch", "key": ["user"], "mode": "shadow", "limit": {"requests": 1, "per": "60s"}}
  ]}"#;

const T: Nanos = 1_800_000_000 * SECOND;

fn config(doc: &str) -> Rc<Config> {
    let mut r = Rules::default();
    r.load(doc.as_bytes()).unwrap();
    r.current().unwrap()
}

fn checks(c: &Config, key: &str, user: &str) -> Vec<Check> {
    let (checks, _) = checks_for(c, "GET", "/x", &|h: &str| match h {
        "x-api-key" => Some(key.to_owned()),
        "x-user-id" => Some(user.to_owned()),
        _ => None,
    });
    checks
}

fn decided(allowed: bool) -> Result<Decision, StoreError> {
    Ok(Decision { allowed, limit: 2, remaining: 0, reset_after: SECOND, retry_after: (!allowed).then_some(SECOND) })
}

#[test]
fn denials_count_whoever_answered_them_and_secrets_show_only_as_their_hash() {
    let c = config(RULES);
    let mut top = IsolateTop::default();
    let heavy = checks(&c, "sk_live_heavy", "ann");
    // Two allowed, one denied by the counter object, then denials from the blocked cache.
    for allowed in [true, true, false] {
        let (o, _) = combine(&c, &heavy, &[decided(allowed), decided(true)]);
        top.count(&c, &heavy, &o, T);
    }
    let mut cache = BlockedCache::new(10);
    cache.insert(&heavy[0].key, T, 1, decided(false).unwrap());
    for i in 0..7 {
        let o = cached_denials(&c, &heavy, T + i * SECOND / 10, &mut cache);
        assert!(o.rejected);
        top.count(&c, &heavy, &o, T + SECOND);
    }
    let light = checks(&c, "sk_live_light", "bob");
    let (o, _) = combine(&c, &light, &[decided(false), decided(false)]);
    top.count(&c, &light, &o, T + SECOND);

    assert_eq!(top.schedule(T, || REPORT_EVERY), Some(0), "an isolate's first report goes at once");
    assert_eq!(top.schedule(T, || REPORT_EVERY), None, "one report at a time");
    let r = top.take(7, T + 5 * SECOND).unwrap();
    assert!(!top.pending(), "a report takes everything");
    assert_eq!(top.schedule(T + 6 * SECOND, || REPORT_EVERY), None, "nothing to report");
    let (o, _) = combine(&c, &light, &[decided(false), decided(false)]);
    top.count(&c, &light, &o, T + 6 * SECOND);
    assert_eq!(top.schedule(T + 6 * SECOND, || REPORT_EVERY), Some(4 * SECOND), "one report per interval");
    assert_eq!(top.schedule(T + 30 * SECOND, || REPORT_EVERY), None, "scheduled");
    assert_eq!(
        top.schedule(T + 10 * SECOND + LOST_AFTER, || REPORT_EVERY),
        Some(0),
        "a lost report is scheduled again"
    );
    let per_key = &r.section.rules[0];
    assert_eq!((per_key.rule.as_str(), per_key.allowed, per_key.denied, per_key.shadow_denied), ("per-key", 2, 9, 0));
    let listed = per_key.top.top(2);
    let shown = String::from_utf8(listed[0].key.clone()).unwrap();
    assert!(shown.starts_with("api_key=#") && shown.len() == "api_key=#".len() + 8, "{shown}");
    assert_eq!((listed[0].denied, listed[1].denied), (8, 1));
    assert_eq!((listed[0].allowed, listed[1].allowed), (2, 0), "units admitted before a key's first denial count");
    assert_eq!(listed[0].nodes, ratewall_core::topk::node_bit(7));
    let watch = &r.section.rules[1];
    // Admitted twice: the third request it allowed was rejected by the other rule.
    assert_eq!((watch.allowed, watch.shadow_denied), (2, 1), "a shadow rule is not served from the cache");
    assert_eq!(watch.top.top(1)[0].key, b"user=bob", "shadow denials are listed too");
    assert_eq!(r.series[0], [(T / SECOND, 2, 1, 0), (T / SECOND + 1, 0, 8, 0)]);
    let body = TopCall::Report(r.clone()).encode();
    assert!(!body.contains("sk_live"), "{body}");
    assert_eq!(TopCall::decode(&body), Some(TopCall::Report(r)));
}

#[test]
fn the_admin_object_merges_the_isolates_over_the_window() {
    let c = config(RULES);
    let mut agg = Aggregate::default();
    let unix = T / SECOND;
    for node in [1u64, 2] {
        let mut top = IsolateTop::default();
        let k = checks(&c, "sk_live_heavy", "ann");
        for _ in 0..5 {
            let (o, _) = combine(&c, &k, &[decided(false), decided(true)]);
            top.count(&c, &k, &o, T);
        }
        let read = TopCall::Top { window: Window::Minute, rule: None, report: top.take(node, T) };
        let v: Value = serde_json::from_str(&agg.handle(TopCall::decode(&read.encode()).unwrap(), unix)).unwrap();
        assert_eq!(v["rules"][0]["denied"], 5 * node);
    }
    let v = agg.top(unix, Some("per-key"), Window::Minute);
    assert_eq!(v["window_s"], 60);
    let r = &v["rules"][0];
    assert_eq!((r["rule"].clone(), r["allowed"].clone(), r["denied"].clone()), (json!("per-key"), json!(0), json!(10)));
    assert_eq!(r["top"][0]["denied"], 10);
    assert_eq!(r["top"][0]["nodes"], 2, "two isolates saw it");
    assert_eq!(agg.top(unix + 61, None, Window::Minute)["rules"][0]["denied"], 0, "a minute later");
    assert_eq!(agg.top(unix + 61, None, Window::Hour)["rules"][0]["denied"], 10);
    let s = agg.series(unix + 1, Some("per-key"));
    let denied = s["rules"][0]["denied"].as_array().unwrap();
    assert_eq!((denied.len(), denied[SERIES - 2].clone()), (SERIES, json!(10)));
    assert_eq!(s["end_unix_s"], unix + 1);
    // The other rule allowed them all, but each was rejected: it admitted nothing.
    let watch = agg.series(unix + 1, Some("watch"));
    let admitted: u64 = watch["rules"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["allowed"].as_array().cloned().unwrap_or_default())
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(admitted, 0);
    // A report without seconds of its own (from a filter's section) counts at its arrival.
    let section = TopSection {
        rules: vec![RuleTop {
            rule: "per-key".into(),
            allowed: 3,
            denied: 0,
            shadow_denied: 0,
            top: Summary::default(),
        }],
    };
    let batch = Report { node: 3, seq: 9, section, series: vec![] };
    agg.add(unix + 2, &batch);
    agg.add(unix + 2, &batch);
    assert_eq!(
        agg.series(unix + 2, Some("per-key"))["rules"][0]["allowed"][SERIES - 1],
        3,
        "a retried batch counts once"
    );
    assert_eq!(TopCall::decode(&TopCall::Report(batch.clone()).encode()), Some(TopCall::Report(batch)));
}

#[test]
fn memory_stays_bounded_whatever_the_rules_and_the_seconds() {
    let mut agg = Aggregate::default();
    for i in 0..(MAX_RULES + 20) {
        let rules =
            vec![RuleTop { rule: format!("r{i}"), allowed: 1, denied: 0, shadow_denied: 0, top: Summary::default() }];
        agg.add(1_800_000_000, &Report { node: 1, seq: 0, section: TopSection { rules }, series: vec![] });
    }
    assert_eq!(agg.top(1_800_000_000, None, Window::Hour)["rules"].as_array().unwrap().len(), MAX_RULES);
    let c = config(RULES);
    // The document's rules, heard of or not, are not listed as having counted nothing once
    // the object tracks all it may (it may have dropped their counts); before, they are.
    let names = |agg: &Aggregate, zeros: bool| -> Vec<String> {
        let v = if zeros { agg.top(1_800_000_000, None, Window::Hour) } else { agg.series(1_800_000_000, None) };
        let v = in_document_order(Some(&c), None, v, zeros);
        v["rules"].as_array().unwrap().iter().map(|r| r["rule"].as_str().unwrap().to_owned()).collect()
    };
    for zeros in [true, false] {
        assert!(!names(&agg, zeros).iter().any(|n| n == "per-key" || n == "watch"), "{zeros}");
        assert_eq!(names(&Aggregate::default(), zeros), ["per-key", "watch"]);
    }
    let mut top = IsolateTop::default();
    let k = checks(&c, "a", "b");
    for s in 0..(PENDING_SECONDS as u64 * 3) {
        let (o, _) = combine(&c, &k, &[decided(true), decided(true)]);
        top.count(&c, &k, &o, T + s * SECOND);
        // Time going backwards counts in the latest second.
        top.count(&c, &k, &o, T);
    }
    let r = top.take(1, T).unwrap();
    assert_eq!(r.series[0].len(), PENDING_SECONDS);
    assert_eq!(r.series[0].iter().map(|s| s.1).sum::<u64>(), PENDING_SECONDS as u64 * 6);
    assert!(TopCall::decode(r#"{"op":"top_report","report":{"node":1,"top":"zz","series":[]}}"#).is_none());
}

#[test]
fn a_report_of_more_rules_than_the_object_tracks_is_one_it_takes() {
    let rules: Vec<String> = (0..MAX_RULES + 1)
        .map(|i| format!(r#"{{"name": "r{i:03}", "key": ["user"], "limit": {{"requests": 1, "per": "60s"}}}}"#))
        .collect();
    let c =
        config(&format!(r#"{{"identity": {{"user": {{"header": "x-user-id"}}}}, "rules": [{}]}}"#, rules.join(",")));
    let mut top = IsolateTop::default();
    let k = checks(&c, "a", "wu");
    let (o, _) = combine(&c, &k, &vec![decided(false); k.len()]);
    top.count(&c, &k, &o, T);
    let r = top.take(1, T).unwrap();
    assert_eq!(r.series.len(), MAX_RULES);
    assert_eq!(r.section.rules.first().map(|r| r.rule.as_str()), Some("r000"));
    let call = TopCall::Report(r);
    assert_eq!(TopCall::decode(&call.encode()), Some(call), "the object takes it");
}

#[test]
fn counts_made_under_rules_since_replaced_are_reported_under_those() {
    let old = config(RULES);
    let mut top = IsolateTop::default();
    let k = checks(&old, "sk_live_x", "ann");
    let (o, _) = combine(&old, &k, &[decided(false), decided(true)]);
    top.count(&old, &k, &o, T);
    let new = config(&RULES.replace("per-key", "renamed"));
    let k2 = checks(&new, "sk_live_x", "ann");
    let (o, _) = combine(&new, &k2, &[decided(false), decided(true)]);
    top.count(&new, &k2, &o, T);
    let r = top.take(1, T).unwrap();
    let names: Vec<&str> = r.section.rules.iter().map(|r| r.rule.as_str()).collect();
    // The rule that allowed the requests the other rejected admitted nothing: not listed.
    assert_eq!(names, ["renamed", "per-key"]);
    assert_eq!(r.series.len(), 2);
    assert!(r.section.rules.iter().all(|x| x.top.entries().iter().all(|e| !e.key.windows(7).any(|w| w == b"sk_live"))));
}

#[test]
fn answers_list_the_documents_rules_in_order_then_the_fleets() {
    let c = config(RULES);
    let answer = json!({"window_s": 60, "rules": [
        {"rule": "fleet-only", "denied": 1}, {"rule": "watch", "denied": 2}]});
    let v = in_document_order(Some(&c), None, answer.clone(), true);
    assert_eq!(v["rules"][0], json!({"rule": "per-key", "allowed": 0, "denied": 0, "shadow_denied": 0, "top": []}));
    assert_eq!(v["rules"][1]["denied"], 2);
    assert_eq!(v["rules"][2]["rule"], "fleet-only", "a rule only a syncing fleet reports comes after the document's");
    assert_eq!(v["rules"].as_array().unwrap().len(), 3);
    assert_eq!(in_document_order(Some(&c), Some("watch"), answer.clone(), false)["rules"].as_array().unwrap().len(), 1);
    let series = in_document_order(Some(&c), None, answer.clone(), false);
    assert_eq!(series["rules"].as_array().unwrap().len(), 3, "an idle rule's series too");
    assert_eq!(series["rules"][0]["rule"], "per-key");
    assert_eq!(series["rules"][0]["denied"].as_array().map(Vec::len), Some(ratewall_core::topk::windows::SERIES));
    assert!(series["rules"][0]["denied"].as_array().unwrap().iter().all(|v| v == 0));
    assert_eq!(in_document_order(Some(&c), Some("fleet-only"), answer.clone(), true)["rules"][0]["denied"], 1);
    assert_eq!(in_document_order(Some(&c), Some("nope"), answer.clone(), true)["rules"], json!([]));
    assert_eq!(in_document_order(None, None, answer.clone(), true), answer);
    assert_eq!(Window::parse(Some("1d")), Err("window: \"1d\" is not 1m or 1h".into()));
}

#[test]
fn a_report_whose_call_failed_goes_again_first_and_counts_once() {
    let c = config(RULES);
    let (mut top, mut agg) = (IsolateTop::default(), Aggregate::default());
    let k = checks(&c, "sk_live_heavy", "ann");
    let deny = |top: &mut IsolateTop, n: usize, t: Nanos| {
        for _ in 0..n {
            let (o, _) = combine(&c, &k, &[decided(false), decided(true)]);
            top.count(&c, &k, &o, t);
        }
    };
    let unix = T / SECOND;
    let denied = |agg: &Aggregate| agg.top(unix, Some("per-key"), Window::Minute)["rules"][0]["denied"].clone();

    deny(&mut top, 4, T);
    let first = top.take(7, T).unwrap();
    // The call timed out after the object had merged it.
    agg.add(unix, &first);
    assert!(top.failed(first.clone(), T + SECOND));
    deny(&mut top, 2, T + 2 * SECOND);
    assert!(top.pending());
    let again = top.take(7, T + 5 * SECOND).unwrap();
    assert_eq!(again, first, "the failed report goes as it was, before the newer counts");
    agg.add(unix, &again);
    assert_eq!(denied(&agg), 4, "merged once");
    let next = top.take(7, T + 10 * SECOND).unwrap();
    assert!(next.seq > first.seq);
    agg.add(unix, &next);
    assert_eq!(denied(&agg), 6, "the counts made meanwhile follow");

    // A report failing for longer than RETRY_FOR is given up.
    deny(&mut top, 1, T + 11 * SECOND);
    let late = top.take(7, T + 11 * SECOND).unwrap();
    assert!(top.failed(late.clone(), T + 12 * SECOND));
    let late = top.take(7, T + 20 * SECOND).unwrap();
    assert!(!top.failed(late, T + 11 * SECOND + RETRY_FOR));
    assert!(!top.pending());
}

/// A client admitted in one report's interval and denied in a later one is listed with what
/// it was admitted before its first denial (each interval's report kept its own before).
#[test]
fn admissions_in_an_earlier_report_count_for_a_keys_first_denial() {
    let c = config(RULES);
    let mut top = IsolateTop::default();
    let heavy = checks(&c, "sk_live_heavy", "ann");
    for _ in 0..2 {
        // Admitted with quota left: nothing says the client is limited yet.
        let (o, _) = combine(&c, &heavy, &[Ok(Decision { remaining: 1, ..decided(true).unwrap() }), decided(true)]);
        top.count(&c, &heavy, &o, T);
    }
    let first = top.take(7, T + 5 * SECOND).unwrap();
    assert_eq!(first.section.rules[0].top.entries().len(), 0, "not listed before a denial");
    let (o, _) = combine(&c, &heavy, &[decided(false), decided(true)]);
    top.count(&c, &heavy, &o, T + 6 * SECOND);
    let second = top.take(7, T + 10 * SECOND).unwrap();
    let listed = second.section.rules[0].top.top(1);
    assert_eq!((listed[0].denied, listed[0].allowed), (1, 2));
}

#[test]
fn units_admitted_to_a_key_after_its_denial_count_in_its_entry_without_another_denial() {
    // Two a minute: two allowed and one denied, then two allowed a window later in a report
    // with no denial. The key's entry counts the four.
    let c = config(RULES);
    let mut agg = Aggregate::default();
    let mut top = IsolateTop::default();
    let k = checks(&c, "sk_live_heavy", "ann");
    for allowed in [true, true, false] {
        let (o, _) = combine(&c, &k, &[decided(allowed), decided(true)]);
        top.count(&c, &k, &o, T);
    }
    let first = top.take(1, T + SECOND).unwrap();
    for _ in 0..2 {
        let (o, _) = combine(&c, &k, &[decided(true), decided(true)]);
        top.count(&c, &k, &o, T + 11 * SECOND);
    }
    let second = top.take(1, T + 12 * SECOND).unwrap();
    assert_eq!(second.section.rules[0].top.top(5).len(), 0, "no denial, so nothing listed by it alone");
    for (r, at) in [(first, T + SECOND), (second, T + 12 * SECOND)] {
        let call = TopCall::decode(&TopCall::Report(r).encode()).unwrap();
        agg.handle(call, at / SECOND);
    }
    let v = agg.top(T / SECOND + 12, Some("per-key"), Window::Minute);
    let entry = &v["rules"][0]["top"][0];
    assert_eq!((entry["denied"].as_u64(), entry["allowed"].as_u64()), (Some(1), Some(4)), "{v}");
    assert_eq!(v["rules"][0]["allowed"], 4);
}

#[test]
fn a_client_one_isolate_admitted_to_its_limit_and_another_denied_counts_both_isolates() {
    // Two a minute: isolate 1 admits both (the second with nothing left), isolate 2 denies the
    // third. The entry counts the two admitted, and both isolates.
    let c = config(RULES);
    let mut agg = Aggregate::default();
    let k = checks(&c, "sk_live_heavy", "ann");
    let with_left = |allowed: bool, remaining: u64| -> Result<Decision, StoreError> {
        Ok(Decision { remaining, ..decided(allowed).unwrap() })
    };
    let mut first = IsolateTop::default();
    for remaining in [1, 0] {
        let (o, _) = combine(&c, &k, &[with_left(true, remaining), decided(true)]);
        first.count(&c, &k, &o, T);
    }
    let mut second = IsolateTop::default();
    let (o, _) = combine(&c, &k, &[decided(false), decided(true)]);
    second.count(&c, &k, &o, T);
    for r in [first.take(1, T + SECOND).unwrap(), second.take(2, T + SECOND).unwrap()] {
        agg.handle(TopCall::decode(&TopCall::Report(r).encode()).unwrap(), T / SECOND + 1);
    }
    let v = agg.top(T / SECOND + 1, Some("per-key"), Window::Minute);
    let entry = &v["rules"][0]["top"][0];
    assert_eq!(
        (entry["denied"].as_u64(), entry["allowed"].as_u64(), entry["nodes"].as_u64()),
        (Some(1), Some(2), Some(2)),
        "{v}"
    );
}
