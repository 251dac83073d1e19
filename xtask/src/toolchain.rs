//! The wasm32 toolchain and the tools the build needs: rustup's target or Debian's
//! `rustc-web`, apt-get packages, cargo-installed tools pinned by Cargo.lock, npm tools.

use crate::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// How wasm32 is compiled on this machine.
pub(crate) enum Toolchain {
    /// rustup's toolchain with its wasm32 target.
    Rustup,
    /// Debian's rustc-web with the standard library built from rust-web-src.
    Debian,
}

pub(crate) fn rustup_has_target() -> bool {
    Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).lines().any(|l| l.trim() == WASM_TARGET))
}

pub(crate) fn debian_ready() -> bool {
    Path::new("/usr/bin/rustc").exists()
        && Path::new("/usr/lib/llvm-16/bin/wasm-ld").exists()
        && Path::new("/usr/lib/rustlib/src/rust/library").exists()
}

pub(crate) fn toolchain() -> Result<Toolchain> {
    if rustup_has_target() {
        return Ok(Toolchain::Rustup);
    }
    if Command::new("rustup").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok() {
        eprintln!("xtask: adding rustup's {WASM_TARGET} target (60 s at most)");
        let added =
            run_with_timeout(Command::new("rustup").args(["target", "add", WASM_TARGET]), Duration::from_secs(60));
        if added == Some(true) && rustup_has_target() {
            return Ok(Toolchain::Rustup);
        }
        eprintln!(
            "xtask: rustup could not add {WASM_TARGET} ({}); trying Debian's rustc-web",
            if added.is_none() { "timed out" } else { "refused" }
        );
    }
    if debian_ready() {
        return Ok(Toolchain::Debian);
    }
    if apt_install(&["rustc-web", "cargo-web", "rust-web-src", "lld-16"]) && debian_ready() {
        return Ok(Toolchain::Debian);
    }
    Err(format!(
        "no wasm32 compiler. Install one of:\n  rustup target add {WASM_TARGET}\n  apt-get install rustc-web cargo-web rust-web-src lld-16   (Debian/Ubuntu)"
    ))
}

/// Installs Debian packages with apt-get (as root, where apt-get exists); whether it did.
pub(crate) fn apt_install(packages: &[&str]) -> bool {
    let is_root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0"));
    if !is_root || !Path::new("/usr/bin/apt-get").exists() {
        return false;
    }
    eprintln!("xtask: installing {} with apt-get", packages.join(" "));
    let apt = |args: &[&str]| {
        run_with_timeout(
            Command::new("apt-get").args(args).env("DEBIAN_FRONTEND", "noninteractive"),
            Duration::from_secs(600),
        )
    };
    let install: Vec<&str> = ["install", "-y"].into_iter().chain(packages.iter().copied()).collect();
    apt(&["update"]) == Some(true) && apt(&install) == Some(true)
}

/// The wasm build command for a toolchain; the wasm target dir is separate from the native one.
pub(crate) fn wasm_cargo(tc: &Toolchain) -> Command {
    let target_dir = root().join("target/wasm");
    let mut cmd = match tc {
        Toolchain::Rustup => Command::new(cargo()),
        Toolchain::Debian => {
            let mut c = Command::new("/usr/bin/cargo");
            let path = std::env::var("PATH").unwrap_or_default();
            c.env("PATH", format!("/usr/bin:{path}")).env("RUSTC", "/usr/bin/rustc").env("RUSTC_BOOTSTRAP", "1");
            c
        }
    };
    cmd.current_dir(root())
        .arg("build")
        .args(["--target", WASM_TARGET, "--profile", "wasm-release", "--target-dir"])
        .arg(target_dir)
        // A lower inlining threshold than opt-level 3's: measured, it cut the filter by 21 KB
        // (to under the 200 KB target) at no measurable per-request cost; 40 and below cost
        // ~6 % per request (BENCHMARKS.md).
        .arg("--config")
        .arg(format!("target.{WASM_TARGET}.rustflags=[\"-C\", \"llvm-args=-inline-threshold=60\"]"));
    if let Toolchain::Debian = tc {
        cmd.args(["-Zbuild-std=std,panic_abort", "--config"])
            .arg(format!("target.{WASM_TARGET}.linker=\"/usr/lib/llvm-16/bin/wasm-ld\""));
    }
    cmd
}

/// The version of a package in Cargo.lock.
pub(crate) fn lock_version(name: &str) -> Option<String> {
    let lock = std::fs::read_to_string(root().join("Cargo.lock")).ok()?;
    let mut lines = lock.lines();
    while let Some(line) = lines.next() {
        if line.trim() == format!("name = \"{name}\"") {
            let v = lines.next()?.trim().strip_prefix("version = \"")?.strip_suffix('"')?;
            return Some(v.to_owned());
        }
    }
    None
}

/// A cargo-installed tool in target/tools at exactly `version` (installed once, ~5 min).
pub(crate) fn tool(krate: &str, bin: &str, version: &str) -> Result<PathBuf> {
    let dir = root().join("target/tools");
    let path = dir.join("bin").join(bin);
    let current =
        Command::new(&path).arg("--version").output().ok().map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    if current.is_some_and(|v| v.split_whitespace().any(|w| w == version)) {
        return Ok(path);
    }
    eprintln!("xtask: installing {krate} {version} into {} (once)", dir.display());
    // Not --locked: a version pinned in its lockfile is missing from the registry here.
    run(Command::new(cargo())
        .args(["install", "--quiet", "--force", &format!("{krate}@{version}"), "--root"])
        .arg(&dir))?;
    Ok(path)
}

/// wrangler, esbuild and workerd from the npm registry, pinned by package-lock.json.
pub(crate) fn npm_tools() -> Result<()> {
    if ["node_modules/.bin/wrangler", "node_modules/binaryen/bin/wasm-opt"].iter().all(|p| root().join(p).exists()) {
        return Ok(());
    }
    run(Command::new("npm").current_dir(root()).args(["ci", "--no-audit", "--no-fund", "--loglevel=error"]))
        .map_err(|e| format!("{e}\nThe Worker's tools need Node.js ≥ 20 and npm (https://nodejs.org)"))
}
