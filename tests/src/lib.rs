//! `ratewall-tests`: runs ratewall's *built* wasm for real.
//!
//! - [`host`]: the proxy-wasm ABI v0.2.1 host on wasmtime (crate `ratewall-host`, in
//!   `host/`: nodes of several VMs sharing one shared-data store with Envoy's CAS semantics,
//!   a virtual clock, metrics, callouts).
//! - `tests/`: the filter's behaviour through that host; `benches/`: benchmarks.
//! - [`workerd`]: the built Worker in real local workerd (wrangler dev), over [`http`];
//!   [`worker_sim`]: the Worker's isolate grants against one counter object on a virtual
//!   clock (its logic natively, no runtime).
//! - [`browser`]: headless Chromium driven by playwright-core, for the dashboard page.
//! - [`conformance`]: the sync protocol's call sequences, for every store; [`redis`]: Redis
//!   servers and Clusters on loopback for the store's tests, stopped by PID.
//! - The local HTTP gateway that serves through the filter is its own crate (`gateway/`).

pub mod bench;
pub mod browser;
pub mod conformance;
pub mod redis;
pub mod shaping;
pub mod sim;
pub mod workerd;
pub mod worker_sim;

/// The proxy-wasm host (crate `ratewall-host`), under its old path.
pub use ratewall_host as host;
/// The loopback HTTP client (in `ratewall-host`).
pub use ratewall_host::http;

/// Waits, if need be, until the wall clock is at least `span` before the end of a fixed
/// window of length `per` (windows start at multiples of `per` since the Unix epoch, as the
/// core's sliding-window counter has them). A test that expects a counter to hold across a
/// pause must not straddle a window edge: there the previous window's weight drops below
/// its count (`floor(3 · (1 − ε)) = 2`), and a fourth request is rightly admitted.
pub fn clear_of_a_window_edge(per: std::time::Duration, span: std::time::Duration) {
    let per_ns = per.as_nanos().max(1);
    let Ok(since_epoch) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) else { return };
    let left = per_ns - since_epoch.as_nanos() % per_ns;
    if left < span.as_nanos() {
        std::thread::sleep(std::time::Duration::from_nanos(u64::try_from(left).unwrap_or(0) + 50_000_000));
    }
}

/// What `promtool check metrics` says of a Prometheus text scrape: `None` when this machine
/// has no promtool (`cargo xtask test` installs Debian's `prometheus` package, which brings
/// it), else its problem lines (empty when it passes).
pub fn promtool_problems(scrape: &str) -> Option<Vec<String>> {
    use std::io::Write;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .ok()?;
    child.stdin.take()?.write_all(scrape.as_bytes()).ok()?;
    let out = child.wait_with_output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let problems: Vec<String> = text.lines().filter(|l| !l.trim().is_empty()).map(str::to_owned).collect();
    if !out.status.success() && problems.is_empty() {
        return Some(vec![format!("promtool exited with {}", out.status)]);
    }
    Some(problems)
}
