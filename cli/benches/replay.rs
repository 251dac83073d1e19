//! `ratewall replay` of generated 1,000,000-line logs of the same traffic, timed end to end
//! (the release binary reading the file), in one run: JSON lines
//! (`figure: replay_lines_per_sec`) and NGINX `combined` (`figure: replay_nginx_lines_per_sec`).
//! Only under `cargo bench` (which passes `--bench`); `cargo test --all-targets` skips it.

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
    let nginx = dir.join("log.nginx");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&log).unwrap());
    let mut g = std::io::BufWriter::new(std::fs::File::create(&nginx).unwrap());
    const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    for i in 0..lines {
        // A millisecond apart; 5,000 users, 100 API keys, 50,000 addresses; a third are holds.
        let (method, path) = if i % 3 == 0 {
            ("POST", format!("/v1/events/{}/holds", i % 50))
        } else {
            ("GET", "/v1/auth/login".to_owned())
        };
        let (secs, ip) = (1_796_119_200 + i / 1000, format!("198.51.{}.{}", i % 200, i % 250));
        writeln!(
            f,
            r#"{{"ts": {secs}.{:03}, "method": "{method}", "path": "{path}", "headers": {{"x-user-id": "u{}", "x-api-key": "k{}"}}, "ip": "{ip}"}}"#,
            i % 1000,
            i % 5000,
            i % 100,
        )
        .unwrap();
        // The same requests as NGINX writes them (`combined`: no identity headers, whole seconds).
        let t = chrono::DateTime::from_timestamp(secs as i64, 0).unwrap().naive_utc();
        use chrono::{Datelike, Timelike};
        writeln!(
            g,
            r#"{ip} - - [{:02}/{}/{}:{:02}:{:02}:{:02} +0000] "{method} {path} HTTP/1.1" 200 {} "https://example.com/" "Mozilla/5.0 (X11; Linux x86_64; rv:128.0) Gecko/20100101 Firefox/128.0""#,
            t.day(),
            MONTHS[t.month0() as usize],
            t.year(),
            t.hour(),
            t.minute(),
            t.second(),
            i % 9000
        )
        .unwrap();
    }
    drop((f, g));
    let rules = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/rules.json");
    let run = |format: &str, log: &std::path::Path| {
        let start = Instant::now();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ratewall"))
            .args(["replay", "--json", "--format", format, rules])
            .arg(log)
            .output()
            .unwrap();
        let secs = start.elapsed().as_secs_f64();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["requests"], lines);
        secs
    };
    let secs = run("jsonl", &log);
    println!("figure: replay_lines_per_sec = {:.0} lines/s", lines as f64 / secs);
    println!("figure: replay_seconds_1m_lines = {secs:.2} s");
    let secs = run("nginx", &nginx);
    println!("figure: replay_nginx_lines_per_sec = {:.0} lines/s", lines as f64 / secs);
    let _ = std::fs::remove_dir_all(&dir);
}
