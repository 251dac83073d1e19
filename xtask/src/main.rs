//! ratewall's task runner: `cargo xtask <build|test|dev|bench>`.
//!
//! It sets up what a fresh machine lacks (the wasm32 target: rustup's when it can be had
//! within a short timeout, else Debian's `rustc-web` with `-Zbuild-std`), builds the wasm
//! artifacts into `dist/`, and runs the tests, the local gateway or the benchmarks.

mod build;
mod run;
mod test;
mod toolchain;

use build::build;
use run::{dev, fleet, gateway};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};
use test::{bench, test};

const WASM_TARGET: &str = "wasm32-unknown-unknown";
const USAGE: &str = "usage: cargo xtask <command>

  dev      build, then run ratewall locally: the Worker in workerd (wrangler dev) on 127.0.0.1
           with the example rules in front of a built-in demo origin (--port N)
  gateway  build, then run the proxy-wasm filter locally: an HTTP gateway on 127.0.0.1 that
           serves every request through the built filter (--port N, --rules FILE)
  fleet    build, then run a local fleet: Redis, two ratewall-store processes on it, and three
           gateway nodes (the built filter in the wasmtime host) syncing to them
  test     build, then run every test
  build    build the wasm artifacts into dist/ (the filter, and the Worker in dist/worker/)
  bench    build, then run the benchmarks and print their figures";

type Result<T> = std::result::Result<T, String>;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest = args.get(1..).unwrap_or_default();
    let result = match args.first().map(String::as_str) {
        Some("build") => build(),
        Some("test") => build().and_then(|_| test()),
        Some("dev") => build().and_then(|_| dev(rest)),
        Some("gateway") => build().and_then(|_| gateway(rest)),
        Some("fleet") => build().and_then(|_| fleet()),
        Some("bench") => build().and_then(|_| bench(rest)),
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("+ {cmd:?}");
    let status = cmd.status().map_err(|e| format!("could not start {cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed ({status})"))
    }
}

/// Runs a command with a deadline; `None` when it did not finish in time (it is killed).
fn run_with_timeout(cmd: &mut Command, limit: Duration) -> Option<bool> {
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().ok()?;
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status.success()),
            Ok(None) if start.elapsed() < limit => std::thread::sleep(Duration::from_millis(100)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}
