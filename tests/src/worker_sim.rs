//! The Worker's isolate grants on a virtual clock, without a runtime: isolates (each the
//! Worker's own [`Grants`]) send one hot key's requests to one counter [`Object`], the same
//! logic the Durable Object runs. Every call reaches the object after half a round trip and
//! its answer the isolate after the other half; background reports run as the glue runs them
//! (woken when [`Grants::schedule`] says, one report per wake, then [`REPORT_EVERY`], or one
//! at once). No request waits: [`Grants::check`] decides each at once.
//!
//! Each decision is judged against a per-request limiter fed the requests actually admitted:
//! an admission it would deny is over-admitted, a denial it would admit is false.

use ratewall_core::algo::{Algorithm, Limit, Nanos, State, SECOND};
use ratewall_worker::edge::grants::{Grants, Schedule, REPORT_EVERY};
use ratewall_worker::edge::object::Object;
use ratewall_worker::edge::Call;
use std::collections::BTreeMap;

/// One scenario.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Its name in figure lines.
    pub name: &'static str,
    /// Isolates sending the key's requests (isolate `i` gets a share ∝ `1 / (i + 1)`).
    pub isolates: usize,
    /// The limit per window.
    pub limit: u64,
    /// The limit's algorithm (a token bucket's burst is `limit`).
    pub algorithm: Algorithm,
    /// The window.
    pub window: Nanos,
    /// Offered requests per window, as a multiple of the limit.
    pub load: f64,
    /// Requests come in bursts of this many to one isolate, 1 ms apart (1: one at a time).
    pub burst: u64,
    /// Windows simulated.
    pub windows: u64,
    /// The round trip between an isolate and the object.
    pub rtt: Nanos,
    /// The RNG seed.
    pub seed: u64,
    /// Requests stay on one isolate (drawn by share) for this long on average, then move on
    /// (`None`: each request's isolate drawn on its own).
    pub sticky: Option<Nanos>,
}

/// What a scenario measured.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Mean over windows of the admissions a per-request limiter would have denied ÷ limit,
    /// in % (for a fixed window: max(0, admitted − limit) ÷ limit).
    pub overadmission_pct: f64,
    /// Denials a per-request limiter would have admitted ÷ requests, in % (for a fixed
    /// window: denials while the window's count was under the limit).
    pub false_denial_pct: f64,
    /// Object calls (requests' and reports') per 1,000 admitted requests.
    pub calls_per_1000_admitted: f64,
    /// Requests offered.
    pub requests: u64,
    /// Requests admitted.
    pub admitted: u64,
}

/// A client's bursts: 20 requests 1 ms apart to one of three isolates, two and a half bursts
/// a minute on average on a limit of 100 a minute (sliding window), at a round trip of 2 ms
/// (local workerd's): the object's first answer comes during a burst.
pub fn bursts() -> Scenario {
    Scenario {
        name: "bursts",
        isolates: 3,
        limit: 100,
        algorithm: Algorithm::SlidingWindow,
        window: 60 * SECOND,
        load: 0.5,
        burst: 20,
        windows: 5,
        rtt: 2 * 1_000_000,
        seed: 7,
        sticky: None,
    }
}

/// One client at 0.8 × a limit of 1,000 per 10 s (fixed window) whose requests stay on one
/// of 20 isolates (drawn by the Zipf shares) for 5 s on average, then move on, as a
/// keep-alive connection's do.
pub fn sticky5s() -> Scenario {
    Scenario { name: "sticky5s_under", load: 0.8, windows: 12, sticky: Some(5 * SECOND), ..zipf20() }
}

/// The 20-isolate Zipf scenario of the figures.
pub fn zipf20() -> Scenario {
    Scenario {
        name: "zipf20",
        isolates: 20,
        limit: 1000,
        algorithm: Algorithm::FixedWindow,
        window: 10 * SECOND,
        load: 1.5,
        burst: 1,
        windows: 6,
        rtt: 20 * 1_000_000,
        seed: 7,
        sticky: None,
    }
}

const KEY: &[u8] = b"hot";

enum Event {
    Arrive(usize),
    /// A report reaches the object; `looping`: the background task's (else a one-off).
    AtObject {
        isolate: usize,
        call: Call,
        sent: Nanos,
        looping: bool,
    },
    Answer {
        isolate: usize,
        call: Call,
        reply: String,
        sent: Nanos,
        looping: bool,
    },
    /// The background task wakes.
    Wake(usize),
    /// A one-off report is sent.
    Once(usize),
}

struct World {
    queue: BTreeMap<(Nanos, u64), Event>,
    n: u64,
    admitted: BTreeMap<u64, u64>,
    /// Admissions the reference would have denied, per window.
    over: BTreeMap<u64, u64>,
    false_denials: u64,
    /// A per-request limiter's state, fed the requests admitted.
    reference: State,
}

impl World {
    fn push(&mut self, at: Nanos, e: Event) {
        self.n += 1;
        self.queue.insert((at, self.n), e);
    }

    fn decided(&mut self, s: &Scenario, limit: &Limit, at: Nanos, allowed: bool) {
        let (exact, _) = limit.decide(&self.reference, at, 1);
        if allowed {
            *self.admitted.entry(at / s.window).or_insert(0) += 1;
            if !exact.allowed {
                *self.over.entry(at / s.window).or_insert(0) += 1;
            }
            self.reference = limit.consume(&self.reference, at, 1);
        } else if exact.allowed {
            self.false_denials += 1;
        }
    }
}

/// Runs a scenario.
pub fn run(s: &Scenario) -> Report {
    let burst = (s.algorithm == Algorithm::TokenBucket).then_some(s.limit);
    let limit = Limit::new(s.algorithm, s.limit, s.window, burst).unwrap_or_else(|_| unreachable!());
    let start: Nanos = 1_700_000_000 * SECOND / s.window * s.window;
    let mut object = Object::default();
    let _ = object.load(None, Some(limit));
    let mut isolates: Vec<Grants> = (0..s.isolates).map(|i| Grants::new(i as u64 + 1, 1000)).collect();
    let mut w = World {
        queue: BTreeMap::new(),
        n: 0,
        admitted: BTreeMap::new(),
        over: BTreeMap::new(),
        false_denials: 0,
        reference: State::Fresh,
    };
    let mut rng = s.seed.max(1);
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let weights: Vec<f64> = (0..s.isolates).map(|i| 1.0 / (i as f64 + 1.0)).collect();
    let total: f64 = weights.iter().sum();
    let requests = (s.load * s.limit as f64 * s.windows as f64) as u64;
    let span = s.window * s.windows;
    let draw = |next: &mut dyn FnMut() -> u64| {
        let mut pick = (next() % 1_000_000) as f64 / 1_000_000.0 * total;
        for (i, wt) in weights.iter().enumerate() {
            if pick < *wt {
                return i;
            }
            pick -= wt;
        }
        s.isolates - 1
    };
    let mut arrivals: Vec<(Nanos, usize)> =
        (0..requests / s.burst.max(1)).map(|_| (start + next() % span, draw(&mut next))).collect();
    if let Some(stay) = s.sticky {
        // One client: its requests go to one isolate until it moves on.
        arrivals.sort_unstable();
        let mut moves_at = start;
        let mut isolate = 0;
        for a in arrivals.iter_mut() {
            if a.0 >= moves_at {
                isolate = a.1;
                let u = (next() % 1_000_000 + 1) as f64 / 1_000_001.0;
                moves_at = a.0 + (-u.ln() * stay as f64) as Nanos;
            }
            a.1 = isolate;
        }
    }
    for (at, isolate) in arrivals {
        for i in 0..s.burst.max(1) {
            w.push(at + i * 1_000_000, Event::Arrive(isolate));
        }
    }
    let (mut calls, mut reports) = (0u64, 0u64);
    let half = s.rtt / 2;
    while let Some(((t, _), e)) = w.queue.pop_first() {
        match e {
            Event::Arrive(i) => {
                let local = isolates[i].check(KEY, limit, 1, t);
                w.decided(s, &limit, t, local.decision().allowed);
                wake(&mut isolates[i], &mut w, i, t);
            }
            Event::AtObject { isolate, call, sent, looping } => {
                let reply = object.handle(call, t).map(|h| h.reply).unwrap_or_default();
                w.push(t + half, Event::Answer { isolate, call, reply, sent, looping });
            }
            Event::Answer { isolate, call, reply, sent, looping } => {
                isolates[isolate].answered(KEY, &call, Ok(&reply), sent, t);
                if looping {
                    // The glue's task sleeps, then reports again (or ends).
                    w.push(t + REPORT_EVERY, Event::Wake(isolate));
                }
            }
            Event::Wake(i) => {
                let object = isolates[i].object_of(KEY);
                match isolates[i].report(&object, t).map(|mut c| c.pop()) {
                    Some(Some((_, call))) => {
                        calls += 1;
                        reports += 1;
                        w.push(t + half, Event::AtObject { isolate: i, call, sent: t, looping: true });
                    }
                    // A report on its way (a one-off's), or units that wait for one to be due:
                    // the task sleeps, then looks again.
                    Some(None) => w.push(t + REPORT_EVERY, Event::Wake(i)),
                    None => {}
                }
            }
            Event::Once(i) => {
                let object = isolates[i].object_of(KEY);
                if let Some((_, call)) = isolates[i].report_once(&object, t).pop() {
                    calls += 1;
                    reports += 1;
                    w.push(t + half, Event::AtObject { isolate: i, call, sent: t, looping: false });
                }
            }
        }
    }
    let overs: Vec<f64> = (0..s.windows)
        .map(|k| w.over.get(&(start / s.window + k)).copied().unwrap_or(0) as f64 / s.limit as f64 * 100.0)
        .collect();
    let admitted: u64 = w.admitted.values().sum();
    if std::env::var("RATEWALL_SIM_DEBUG").is_ok() {
        let sum = |f: fn(&Grants) -> u64| isolates.iter().map(f).sum::<u64>();
        eprintln!(
            "calls {calls} (reports {reports}), windows {:?}, from grants {}, new {}, shares {}, overdrafts {}, short denials {}",
            w.admitted,
            sum(|g| g.local),
            sum(|g| g.first),
            sum(|g| g.shared),
            sum(|g| g.overdrafts),
            sum(|g| g.short)
        );
    }
    Report {
        overadmission_pct: overs.iter().sum::<f64>() / overs.len().max(1) as f64,
        false_denial_pct: w.false_denials as f64 / requests.max(1) as f64 * 100.0,
        calls_per_1000_admitted: calls as f64 * 1000.0 / admitted.max(1) as f64,
        requests,
        admitted,
    }
}

/// Starts isolate `i`'s background task when its grants say so.
fn wake(g: &mut Grants, w: &mut World, i: usize, t: Nanos) {
    match g.schedule(KEY, t) {
        Some((_, Schedule::Reports(d))) => w.push(t + d, Event::Wake(i)),
        Some((_, Schedule::Once)) => w.push(t, Event::Once(i)),
        None => {}
    }
}
