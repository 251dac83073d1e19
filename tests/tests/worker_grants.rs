//! The Worker's isolate grants against one counter object, on a virtual clock: the logic the
//! Worker and its Durable Object run, without a runtime (`ratewall_tests::worker_sim`).

use ratewall_tests::worker_sim::{run, zipf20};

#[test]
fn twenty_isolates_share_one_hot_key_within_the_stated_bounds() {
    let s = zipf20();
    let r = run(&s);
    println!("{r:?}");
    assert_eq!(r.requests, 9000);
    // No request waits: past its grant an isolate admits on its overdraft (one unrepaid,
    // at most `overdraft_cap` units) while its copy of the counter shows units no grant
    // holds. Over-admission comes from those and from units spent while a report is out
    // (goal: ≤ 1 %; measured 0.87 % for this seed).
    assert!(r.overadmission_pct <= 1.0, "{r:?}");
    // Denials while the counter had room: an isolate whose grant and overdraft are spent
    // until its report's answer, near the limit (goal: ≤ 1 %; measured 0.86 %).
    assert!(r.false_denial_pct <= 1.0, "{r:?}");
    // Reports go when a grant runs low, and every interval per isolate near the quota's
    // end (measured 313; 447 with a report every interval throughout).
    assert!(r.calls_per_1000_admitted < 350.0, "{r:?}");
}
