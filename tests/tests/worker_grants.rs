//! The Worker's isolate grants against one counter object, on a virtual clock: the logic the
//! Worker and its Durable Object run, without a runtime (`ratewall_tests::worker_sim`).

use ratewall_core::algo::Algorithm;
use ratewall_tests::worker_sim::{bursts, run, zipf20, Report, Scenario};

#[test]
fn twenty_isolates_share_one_hot_key_within_the_stated_bounds() {
    let s = zipf20();
    let r = run(&s);
    println!("{r:?}");
    assert_eq!(r.requests, 9000);
    // No request waits: past its grant an isolate admits on its overdraft (one unrepaid,
    // at most `overdraft_cap` units) while its copy of the counter shows units no grant
    // holds. Over-admission comes from those and from units spent while a report is out
    // (goal: ≤ 1 %; measured 0.85 % for this seed).
    assert!(r.overadmission_pct <= 1.0, "{r:?}");
    // Denials while the counter had room: an isolate whose grant and overdraft are spent
    // until its report's answer, near the limit (goal: ≤ 1 %; measured 0.96 %).
    assert!(r.false_denial_pct <= 1.0, "{r:?}");
    // Reports go when a grant runs low, and every interval per isolate near the quota's
    // end (measured 316; 447 with a report every interval throughout).
    assert!(r.calls_per_1000_admitted < 350.0, "{r:?}");
}

/// Means and worst seed over seeds 1-8 of 20 windows each (what `cargo bench --bench worker`
/// prints as `_seeds`): over-admission, its worst, false denials, their worst, calls per
/// 1,000 admitted.
fn over_seeds(s: &Scenario) -> [f64; 5] {
    let runs: Vec<Report> = (1..=8).map(|seed| run(&Scenario { seed, windows: 20, ..s.clone() })).collect();
    let mean = |f: fn(&Report) -> f64| runs.iter().map(f).sum::<f64>() / runs.len() as f64;
    let worst = |f: fn(&Report) -> f64| runs.iter().map(f).fold(0.0, f64::max);
    let figures = [
        mean(|r| r.overadmission_pct),
        worst(|r| r.overadmission_pct),
        mean(|r| r.false_denial_pct),
        worst(|r| r.false_denial_pct),
        mean(|r| r.calls_per_1000_admitted),
    ];
    println!(
        "{} {:?} rtt {} ms, seeds 1-8: over {:.2} % (worst {:.2} %), false denials {:.2} % (worst {:.2} %), {:.0} calls per 1,000 admitted",
        s.name,
        s.algorithm,
        s.rtt / 1_000_000,
        figures[0],
        figures[1],
        figures[2],
        figures[3],
        figures[4]
    );
    figures
}

#[test]
fn over_eight_seeds_twenty_isolates_stay_within_the_goals() {
    let [over, _, false_denials, _, _] = over_seeds(&zipf20());
    assert!(over <= 1.0 && false_denials <= 1.0, "{over} {false_denials}");
    let [over, _, _, _, _] = over_seeds(&Scenario { rtt: 80 * 1_000_000, ..zipf20() });
    assert!(over <= 1.0, "{over}");
}

/// A client's bursts of 20 at one of three isolates, with local workerd's round trip (2 ms):
/// the object's first answer comes during a burst, with a grant sized from the traffic the
/// object had seen. Before the isolates' shares, and decisions on the copy while an isolate
/// is the only node, the rest of such a burst went to the overdraft's one unit and short
/// denials: false denials 5.6 % for this seed (6.6 % over seeds 1-8); now 1.6 % (3.8 %),
/// 3.2 % (4.8 %) with shares alone. What is left is a burst at an isolate whose copy is
/// stale and shows under half the quota free (its overdraft, then short denials for a round
/// trip), and one while another isolate's grant holds the quota's rest.
#[test]
fn a_clients_bursts_are_not_cut_at_the_grant_the_object_sized() {
    let s = bursts();
    let r = run(&s);
    println!("{r:?}");
    over_seeds(&s);
    assert!(r.false_denial_pct <= 2.0, "{r:?}");
    assert!(r.overadmission_pct <= 1.0, "{r:?}");
    for algorithm in [Algorithm::TokenBucket, Algorithm::FixedWindow, Algorithm::SlidingLog] {
        let r = run(&Scenario { algorithm, ..bursts() });
        println!("{algorithm:?}: {r:?}");
        over_seeds(&Scenario { algorithm, ..bursts() });
    }
}

/// A client under its limit whose requests stay on one isolate at a time: the isolate it
/// leaves gives its grant back once idle (it held most of what remained, the only busy
/// node's share, for its lease, and was granted as much again at its next report), and the
/// isolate it moves to is held to its own grant, its one overdraft unit and short denials
/// until then.
#[test]
fn a_client_that_moves_between_isolates_keeps_its_limit() {
    let r = run(&ratewall_tests::worker_sim::sticky5s());
    println!("{r:?}");
    assert_eq!(r.overadmission_pct, 0.0, "{r:?}");
    // Measured 1.40 % (seed 7), 3.34 % before an isolate gave an idle grant back (about 13
    // denials per move at 80 requests a second).
    assert!(r.false_denial_pct <= 2.0, "{r:?}");
    // The same client on every isolate at once is denied once (0.01 %).
    let spread = run(&ratewall_tests::worker_sim::Scenario { sticky: None, ..ratewall_tests::worker_sim::sticky5s() });
    assert!(spread.false_denial_pct <= 0.05, "{spread:?}");
}
