//! `cargo xtask test` and `cargo xtask bench`: Redis for the store's tests, Chromium for the
//! dashboard's, the suite, and its summary line.

use crate::toolchain::*;
use crate::*;
use std::process::{Command, Stdio};

/// Redis for the store's tests: `redis-server` and `redis-cli` from PATH, else Debian's
/// `redis-server` package installed with apt-get (as root), from the package registry only.
pub(crate) fn redis() -> Result<()> {
    let have =
        |bin: &str| Command::new(bin).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok();
    if have("redis-server") && have("redis-cli") {
        return Ok(());
    }
    if apt_install(&["redis-server"]) && have("redis-server") {
        return Ok(());
    }
    Err("the store's tests need Redis: install it (apt-get install redis-server) and run again".into())
}

/// promtool, which the tests run over the Worker's and the store's metrics (Debian's
/// `prometheus` package; without it those checks say they were skipped).
fn promtool() {
    let have = Command::new("promtool").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok();
    if !have && !apt_install(&["--no-install-recommends", "prometheus"]) {
        eprintln!("xtask: no promtool (apt-get install prometheus): the metrics format checks are skipped");
    }
}

/// A real browser for the dashboard's tests: Debian's `chromium` (installed with apt-get, as
/// root, from the package registry) and `playwright-core` from npm, pinned in
/// package-lock.json (it drives that Chromium and never downloads one).
fn browser() -> Result<()> {
    let chromium = std::path::Path::new("/usr/bin/chromium");
    let installed = chromium.exists() || (apt_install(&["--no-install-recommends", "chromium"]) && chromium.exists());
    if !installed {
        return Err("the dashboard's tests need Chromium: install it (apt-get install chromium) and run again".into());
    }
    if !root().join("node_modules/playwright-core/package.json").exists() {
        run(Command::new("npm").current_dir(root()).env("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1").args([
            "ci",
            "--no-audit",
            "--no-fund",
            "--loglevel=error",
        ]))
        .map_err(|e| format!("{e}\nthe dashboard's tests need playwright-core from npm (Node.js >= 20)"))?;
    }
    Ok(())
}

pub(crate) fn test() -> Result<()> {
    redis()?;
    promtool();
    browser()?;
    let (mut passed, mut failed) = (0u64, 0u64);
    // Doc tests first, so the closing summary is the whole run's.
    for kind in ["--doc", "--all-targets"] {
        let mut cmd = Command::new(cargo());
        cmd.current_dir(root()).args(["test", "--workspace", "--exclude", "ratewall-core-probe", kind]);
        let (p, f, ok) = run_counting(&mut cmd)?;
        passed += p;
        failed += f;
        if !ok {
            println!("tests: {passed} passed, {failed} failed");
            return Err(format!("{cmd:?} failed"));
        }
    }
    println!("tests: {passed} passed, {failed} failed");
    Ok(())
}

/// Runs `cargo test`, echoing its output, and sums its `test result:` lines.
pub(crate) fn run_counting(cmd: &mut Command) -> Result<(u64, u64, bool)> {
    eprintln!("+ {cmd:?}");
    let mut child = cmd.stdout(Stdio::piped()).spawn().map_err(|e| format!("could not start {cmd:?}: {e}"))?;
    let (mut passed, mut failed) = (0, 0);
    if let Some(out) = child.stdout.take() {
        use std::io::BufRead;
        for line in std::io::BufReader::new(out).lines().map_while(std::result::Result::ok) {
            println!("{line}");
            if let Some(rest) = line.strip_prefix("test result: ") {
                let count = |word: &str| {
                    rest.split(';')
                        .find_map(|part| part.trim().strip_suffix(word)?.trim().rsplit(' ').next()?.parse::<u64>().ok())
                };
                passed += count(" passed").unwrap_or(0);
                failed += count(" failed").unwrap_or(0);
            }
        }
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    Ok((passed, failed, status.success()))
}

pub(crate) fn bench(args: &[String]) -> Result<()> {
    run(Command::new(cargo()).current_dir(root()).args(["bench", "-p", "ratewall-tests"]).args(args))
}
