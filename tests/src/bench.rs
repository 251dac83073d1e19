//! Helpers for the benchmarks: where criterion writes, reading its medians back, and the
//! `figure: <name> = <value> <unit>` lines that BENCHMARKS.md records.

use std::path::PathBuf;

/// criterion's output directory (`target/criterion`).
pub fn criterion_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/criterion")
}

/// The median (ns) criterion measured for `group/bench` in this run, if it ran.
pub fn median_ns(id: &str) -> Option<f64> {
    let path = criterion_dir().join(id).join("new/estimates.json");
    let modified = std::fs::metadata(&path).and_then(|m| m.modified()).ok()?;
    // Only figures from this run: a stale file from an earlier run is ignored.
    if modified.elapsed().map_or(true, |age| age.as_secs() > 600) {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
    v["median"]["point_estimate"].as_f64()
}

/// Prints one figure line.
pub fn figure(name: &str, value: f64, unit: &str) {
    let shown = if value >= 100.0 { format!("{value:.0}") } else { format!("{value:.3}") };
    println!("figure: {name} = {shown} {unit}");
}
