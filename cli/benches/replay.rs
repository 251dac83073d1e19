//! `ratewall replay` of a generated 1,000,000-line log, timed end to end (the release binary
//! reading the file): `figure: replay_lines_per_sec`. Only under `cargo bench` (which passes
//! `--bench`); `cargo test --all-targets` skips it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::io::Write;
use std::time::Instant;

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let lines = 1_000_000u64;
    let dir = std::env::temp_dir().join(format!("ratewall-replay-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("log.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&log).unwrap());
    for i in 0..lines {
        // A millisecond apart; 5,000 users, 100 API keys, 50,000 addresses; a third are holds.
        let (method, path) = if i % 3 == 0 {
            ("POST", format!("/v1/events/{}/holds", i % 50))
        } else {
            ("GET", "/v1/auth/login".to_owned())
        };
        writeln!(
            f,
            r#"{{"ts": {}.{:03}, "method": "{method}", "path": "{path}", "headers": {{"x-user-id": "u{}", "x-api-key": "k{}"}}, "ip": "198.51.{}.{}"}}"#,
            1_796_119_200 + i / 1000,
            i % 1000,
            i % 5000,
            i % 100,
            i % 200,
            i % 250
        )
        .unwrap();
    }
    drop(f);
    let rules = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/rules.json");
    let start = Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ratewall"))
        .args(["replay", "--json", rules])
        .arg(&log)
        .output()
        .unwrap();
    let secs = start.elapsed().as_secs_f64();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], lines);
    println!("figure: replay_lines_per_sec = {:.0} lines/s", lines as f64 / secs);
    println!("figure: replay_seconds_1m_lines = {secs:.2} s");
    let _ = std::fs::remove_dir_all(&dir);
}
