//! The leaky bucket in the built filter: a burst of requests at one instant spread over a
//! node's VMs, the node's virtual clock stepped by 1 ms with every VM ticking at the period
//! it asked for, and each paused request's resumption recorded. Shared by the tests (the
//! behaviour) and the filter bench (the figures).

use crate::host::{Node, Plugin, Started, Vm};
use wasmtime::Result;

/// Nanoseconds per millisecond.
pub const MS: u64 = 1_000_000;

/// What one burst came to.
#[derive(Clone, Debug, Default)]
pub struct Burst {
    /// Requests that passed at once (when they arrived).
    pub at_once: usize,
    /// Requests forwarded after waiting: when (ns after the burst), in order.
    pub forwarded: Vec<u64>,
    /// Their `RateLimit` fields, in the same order.
    pub forwarded_fields: Vec<Option<String>>,
    /// Requests rejected with 429, and their `Retry-After`.
    pub rejected: Vec<Option<String>>,
    /// The paused requests' contexts, per VM (those still waiting at the end).
    pub waiting: usize,
}

/// The rules of the figures: 5 per second, a queue of `burst`, `delay` of them at once.
pub fn rules(burst: u64, delay: u64) -> String {
    serde_json::json!({
        "identity": {"user": {"header": "x-user-id"}},
        "rules": [{"name": "shape", "key": ["user"],
                   "limit": {"requests": 5, "per": "1s", "burst": burst, "delay": delay, "algorithm": "leaky_bucket"}}]
    })
    .to_string()
}

/// A node at `t0` with `vms` VMs configured with `doc`.
pub fn node(plugin: &Plugin, doc: &str, vms: usize, t0: u64) -> Result<(Node, Vec<Vm>)> {
    let node = Node::new(t0);
    let vms = (0..vms).map(|_| Vm::start(plugin, &node, doc.as_bytes())).collect::<Result<Vec<_>>>()?;
    Ok((node, vms))
}

/// Sends `n` requests of one user at once (round-robin over the VMs), then steps the clock
/// 1 ms at a time for `run_ms`, ticking each VM whose tick period is due, and records when
/// each paused request was resumed. `abort`: the indices (in arrival order) of paused
/// requests whose client leaves at once.
pub fn burst(node: &Node, vms: &mut [Vm], n: usize, run_ms: u64, abort: &[usize]) -> Result<Burst> {
    let start = node.now();
    let req = crate::host::HttpRequest::new("GET", "/q").header("x-user-id", "burst");
    let mut out = Burst::default();
    let mut paused: Vec<(usize, u32)> = Vec::new();
    let mut arrival = 0;
    for i in 0..n {
        let v = i % vms.len();
        match vms[v].begin(&req)? {
            Started::Done(r) if r.passed => out.at_once += 1,
            Started::Done(r) => out.rejected.push(r.header("retry-after").map(str::to_owned)),
            Started::Paused(ctx) => {
                if abort.contains(&arrival) {
                    vms[v].abort(ctx)?;
                } else {
                    paused.push((v, ctx));
                }
                arrival += 1;
            }
        }
    }
    // Each VM's ticks run on their own phase (a proxy's tick timer starts when it was set),
    // so turns do not fall on ticks by construction.
    let mut last_tick: Vec<u64> = (0..vms.len() as u64).map(|v| start - (1 + v * 2) % 5 * MS).collect();
    for _ in 0..run_ms {
        node.advance(MS);
        let now = node.now();
        for (v, vm) in vms.iter_mut().enumerate() {
            let period = u64::from(vm.tick_period_ms()) * MS;
            if period > 0 && now - last_tick[v] >= period {
                last_tick[v] = now;
                vm.tick()?;
            }
        }
        let mut still = Vec::new();
        for (v, ctx) in paused {
            match vms[v].finish(ctx)? {
                Some(r) if r.passed => {
                    out.forwarded.push(now - start);
                    out.forwarded_fields.push(r.header("ratelimit").map(str::to_owned));
                }
                Some(_) => out.rejected.push(None),
                None => still.push((v, ctx)),
            }
        }
        paused = still;
    }
    out.waiting = paused.len();
    Ok(out)
}
