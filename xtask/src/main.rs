//! ratewall's task runner: `cargo xtask <build|test|dev|bench>`.
//!
//! It sets up what a fresh machine lacks (the wasm32 target: rustup's when it can be had
//! within a short timeout, else Debian's `rustc-web` with `-Zbuild-std`), builds the wasm
//! artifacts into `dist/`, and runs the tests, the local gateway or the benchmarks.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

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

/// The worker-build release that matches the `worker` crate in Cargo.lock.
const WORKER_BUILD: &str = "0.8.7";
/// wasm-opt over the filter: the features rustc's wasm32 target enables, no debug info.
/// GUFA (whole-program flow analysis: values that are constants, code no value reaches) and
/// a second `-Oz` over its result: measured −1.3 KB, no slower.
const WASM_OPT_FLAGS: &[&str] = &[
    "-Oz",
    "--gufa",
    "-Oz",
    "--enable-bulk-memory",
    "--enable-sign-ext",
    "--enable-mutable-globals",
    "--enable-nontrapping-float-to-int",
    "--strip-debug",
    "--strip-producers",
];

type Result<T> = std::result::Result<T, String>;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("build") => build(),
        Some("test") => build().and_then(|_| test()),
        Some("dev") => build().and_then(|_| dev(&args[1..])),
        Some("gateway") => build().and_then(|_| gateway(&args[1..])),
        Some("fleet") => build().and_then(|_| fleet()),
        Some("bench") => build().and_then(|_| bench(&args[1..])),
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

/// How wasm32 is compiled on this machine.
enum Toolchain {
    /// rustup's toolchain with its wasm32 target.
    Rustup,
    /// Debian's rustc-web with the standard library built from rust-web-src.
    Debian,
}

fn rustup_has_target() -> bool {
    Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).lines().any(|l| l.trim() == WASM_TARGET))
}

fn debian_ready() -> bool {
    Path::new("/usr/bin/rustc").exists()
        && Path::new("/usr/lib/llvm-16/bin/wasm-ld").exists()
        && Path::new("/usr/lib/rustlib/src/rust/library").exists()
}

fn toolchain() -> Result<Toolchain> {
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
fn apt_install(packages: &[&str]) -> bool {
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
fn wasm_cargo(tc: &Toolchain) -> Command {
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

/// Builds the wasm artifacts: `dist/ratewall_filter.wasm`, and the core probe that CI checks.
fn build() -> Result<()> {
    let tc = toolchain()?;
    run(wasm_cargo(&tc).args(["-p", "ratewall-filter", "-p", "ratewall-core-probe"]))?;
    let out = root().join("target/wasm").join(WASM_TARGET).join("wasm-release");
    let dist = root().join("dist");
    std::fs::create_dir_all(&dist).map_err(|e| format!("{}: {e}", dist.display()))?;
    let filter = dist.join("ratewall_filter.wasm");
    let built = std::fs::read(out.join("ratewall_filter.wasm")).map_err(|e| format!("reading the filter: {e}"))?;
    // The SDK exports callbacks for things a plugin starts itself — gRPC calls, foreign
    // functions, shared queues — and for network (L4) filters. The filter starts none of the
    // first and is an HTTP filter, so no host calls them (hosts treat a missing callback as a
    // no-op), and without the exports wasm-opt drops the dispatch code behind them.
    let unused = |name: &str| unused_export(name);
    let trimmed = drop_exports(&built, unused)?;
    std::fs::write(&filter, trimmed).map_err(|e| format!("{}: {e}", filter.display()))?;
    optimize(&filter);
    let probe = root().join("target/wasm/ratewall_core_probe.wasm");
    std::fs::copy(out.join("ratewall_core_probe.wasm"), &probe).map_err(|e| format!("copying the core probe: {e}"))?;
    let size = std::fs::metadata(&filter).map(|m| m.len()).unwrap_or(0);
    eprintln!("xtask: built {} ({size} bytes)", filter.display());
    build_worker(&tc)
}

/// SDK callbacks the filter never needs: see [`build`].
fn unused_export(name: &str) -> bool {
    const NETWORK: [&str; 5] = [
        "proxy_on_new_connection",
        "proxy_on_downstream_data",
        "proxy_on_downstream_connection_close",
        "proxy_on_upstream_data",
        "proxy_on_upstream_connection_close",
    ];
    name.starts_with("proxy_on_grpc_")
        || name == "proxy_on_foreign_function"
        || name == "proxy_on_queue_ready"
        || NETWORK.contains(&name)
}

/// Reads an unsigned LEB128 number at `*i`.
fn leb(bytes: &[u8], i: &mut usize) -> Result<u64> {
    let (mut value, mut shift) = (0u64, 0);
    loop {
        let b = *bytes.get(*i).ok_or("truncated wasm")?;
        *i += 1;
        value |= u64::from(b & 0x7f) << shift;
        if b < 0x80 {
            return Ok(value);
        }
        shift += 7;
        if shift > 63 {
            return Err("bad LEB128 in wasm".into());
        }
    }
}

fn put_leb(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

/// A copy of a wasm module without the exports `drop` names (everything else byte for byte).
fn drop_exports(wasm: &[u8], drop: impl Fn(&str) -> bool) -> Result<Vec<u8>> {
    let mut out = wasm.get(..8).ok_or("not a wasm module")?.to_vec();
    let mut i = 8;
    while i < wasm.len() {
        let id = wasm[i];
        i += 1;
        let size = leb(wasm, &mut i)? as usize;
        let body = wasm.get(i..i + size).ok_or("truncated wasm section")?;
        i += size;
        if id != 7 {
            out.push(id);
            put_leb(&mut out, size as u64);
            out.extend_from_slice(body);
            continue;
        }
        let (mut j, mut kept, mut entries) = (0, 0u64, Vec::new());
        for _ in 0..leb(body, &mut j)? {
            let start = j;
            let len = leb(body, &mut j)? as usize;
            let name = body.get(j..j + len).ok_or("truncated export name")?;
            j += len + 1;
            leb(body, &mut j)?;
            if !drop(&String::from_utf8_lossy(name)) {
                entries.extend_from_slice(body.get(start..j).ok_or("truncated export")?);
                kept += 1;
            }
        }
        let mut section = Vec::new();
        put_leb(&mut section, kept);
        section.extend_from_slice(&entries);
        out.push(7);
        put_leb(&mut out, section.len() as u64);
        out.extend_from_slice(&section);
    }
    Ok(out)
}

/// Runs binaryen's wasm-opt (npm `binaryen`, pinned in package-lock.json) over the filter in
/// place. Without Node the filter is still built, only larger, and xtask says so.
fn optimize(wasm: &Path) {
    let wasm_opt = root().join("node_modules/binaryen/bin/wasm-opt");
    let ok = npm_tools().is_ok()
        && Command::new(&wasm_opt)
            .args(WASM_OPT_FLAGS)
            .arg(wasm)
            .arg("-o")
            .arg(wasm)
            .status()
            .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("xtask: wasm-opt (npm binaryen) did not run; {} is not size-optimized", wasm.display());
    }
}

/// The version of a package in Cargo.lock.
fn lock_version(name: &str) -> Option<String> {
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
fn tool(krate: &str, bin: &str, version: &str) -> Result<PathBuf> {
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
fn npm_tools() -> Result<()> {
    if ["node_modules/.bin/wrangler", "node_modules/binaryen/bin/wasm-opt"].iter().all(|p| root().join(p).exists()) {
        return Ok(());
    }
    run(Command::new("npm").current_dir(root()).args(["ci", "--no-audit", "--no-fund", "--loglevel=error"]))
        .map_err(|e| format!("{e}\nThe Worker's tools need Node.js ≥ 20 and npm (https://nodejs.org)"))
}

/// Builds the Worker with worker-build (wasm-bindgen at the version in Cargo.lock, esbuild
/// from npm, no wasm-opt download) into dist/worker/, the bundle wrangler.toml deploys.
fn build_worker(tc: &Toolchain) -> Result<()> {
    if !matches!(tc, Toolchain::Rustup) {
        return Err("the Worker is built with rustup's wasm32 target (worker-build checks for it); \
                    install rustup and run `rustup target add wasm32-unknown-unknown`"
            .into());
    }
    let bindgen_version = lock_version("wasm-bindgen").ok_or("Cargo.lock names no wasm-bindgen")?;
    let bindgen = tool("wasm-bindgen-cli", "wasm-bindgen", &bindgen_version)?;
    let worker_build = tool("worker-build", "worker-build", WORKER_BUILD)?;
    npm_tools()?;
    let crate_dir = root().join("cloudflare-worker");
    run(Command::new(worker_build)
        .current_dir(&crate_dir)
        .arg("--release")
        .env("WASM_BINDGEN_BIN", bindgen)
        .env("ESBUILD_BIN", root().join("node_modules/@esbuild/linux-x64/bin/esbuild"))
        .env("CARGO_TARGET_DIR", root().join("target/wasm")))?;
    let dist = root().join("dist/worker");
    std::fs::create_dir_all(&dist).map_err(|e| format!("{}: {e}", dist.display()))?;
    for file in ["index.js", "index_bg.wasm"] {
        std::fs::copy(crate_dir.join("build").join(file), dist.join(file))
            .map_err(|e| format!("copying the Worker's {file}: {e}"))?;
    }
    let size = std::fs::metadata(dist.join("index_bg.wasm")).map(|m| m.len()).unwrap_or(0);
    eprintln!("xtask: built {} ({size} bytes of wasm)", dist.display());
    Ok(())
}

/// Redis for the store's tests: `redis-server` and `redis-cli` from PATH, else Debian's
/// `redis-server` package installed with apt-get (as root), from the package registry only.
fn redis() -> Result<()> {
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

fn test() -> Result<()> {
    redis()?;
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
fn run_counting(cmd: &mut Command) -> Result<(u64, u64, bool)> {
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

/// The child `dev` runs, for the signal handler.
static CHILD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn forward(signal: libc::c_int) {
    let pid = CHILD.load(std::sync::atomic::Ordering::SeqCst);
    // SAFETY: kill and _exit are async-signal-safe; pid is a child we started.
    unsafe {
        if pid > 0 {
            libc::kill(pid, libc::SIGTERM);
        }
        libc::_exit(128 + signal);
    }
}

/// Stops `child` too when xtask is stopped by a signal (Ctrl-C reaches the whole process
/// group anyway; a SIGTERM to xtask's PID alone would otherwise orphan wrangler).
fn forward_signals_to(child: &std::process::Child) {
    CHILD.store(i32::try_from(child.id()).unwrap_or(0), std::sync::atomic::Ordering::SeqCst);
    let handler = forward as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: installs a handler that only calls async-signal-safe functions.
    unsafe {
        libc::signal(libc::SIGTERM, handler);
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGHUP, handler);
    }
}

/// A free TCP port on 127.0.0.1, preferring `want`.
fn free_port(want: u16) -> u16 {
    let bind = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).ok().and_then(|l| l.local_addr().ok());
    bind(want).or_else(|| bind(0)).map_or(want, |a| a.port())
}

/// Runs the Worker in local workerd through wrangler, in front of the built-in demo origin.
fn dev(args: &[String]) -> Result<()> {
    let want = args
        .iter()
        .position(|a| a == "--port")
        .and_then(|i| args.get(i + 1))
        .and_then(|p| p.parse().ok())
        .unwrap_or(8787);
    let port = free_port(want);
    // A fresh secret per run for the sync store; filter fleets in this dev setup use it.
    let secret = {
        use std::io::Read;
        let mut bytes = [0u8; 16];
        let _ = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    let mut child = Command::new(root().join("node_modules/.bin/wrangler"))
        .current_dir(root())
        .args(["dev", "--local", "--ip", "127.0.0.1", "--port", &port.to_string(), "--persist-to", "target/dev-state"])
        .args(["--var", &format!("RATEWALL_SYNC_SECRET:{secret}")])
        .env("WRANGLER_SEND_METRICS", "false")
        .env("WRANGLER_HIDE_BANNER", "true")
        .env("CLOUDFLARE_CF_FETCH_ENABLED", "false")
        .spawn()
        .map_err(|e| format!("could not start wrangler: {e}"))?;
    forward_signals_to(&child);
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if start.elapsed() > Duration::from_secs(60) || child.try_wait().ok().flatten().is_some() {
            let _ = child.kill();
            return Err("wrangler dev did not start (see its output above)".into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let url = format!("http://127.0.0.1:{port}");
    println!(
        "\nratewall is running at {url} (the Worker in local workerd, rules from wrangler.toml, demo origin)

  see the RateLimit fields, then a 429 with Retry-After after 5 holds per user:
    for i in 1 2 3 4 5 6; do curl -si -X POST -H 'x-user-id: alice' {url}/v1/events/42/holds | grep -iE '^(HTTP|ratelimit|retry-after)'; done
  per IP (10 logins a minute):
    curl -si -H 'cf-connecting-ip: 203.0.113.7' {url}/v1/auth/login
  metrics of this isolate:
    curl -s {url}/_ratewall/metrics
  sync secret for filter fleets (POST {url}/v1/sync): {secret}

Ctrl-C stops it.\n"
    );
    let status = child.wait().map_err(|e| e.to_string())?;
    if status.success() || status.code().is_none() {
        Ok(())
    } else {
        Err(format!("wrangler dev exited with {status}"))
    }
}

fn gateway(args: &[String]) -> Result<()> {
    let mut cmd = Command::new(cargo());
    cmd.current_dir(root()).args(["run", "--quiet", "-p", "ratewall-tests", "--bin", "ratewall-gateway", "--"]);
    if !args.iter().any(|a| a == "--rules") {
        cmd.args(["--rules", "examples/rules.json"]);
    }
    run(cmd.args(args))
}

/// Children of `fleet`, stopped when xtask is stopped by a signal.
static FLEET: [std::sync::atomic::AtomicI32; 8] = [const { std::sync::atomic::AtomicI32::new(0) }; 8];

extern "C" fn stop_fleet(signal: libc::c_int) {
    for pid in &FLEET {
        let pid = pid.load(std::sync::atomic::Ordering::SeqCst);
        // SAFETY: kill and _exit are async-signal-safe; the pids are children we started.
        unsafe {
            if pid > 0 {
                libc::kill(pid, libc::SIGTERM);
            }
        }
    }
    // SAFETY: async-signal-safe.
    unsafe { libc::_exit(128 + signal) }
}

/// A started child of the fleet, registered for [`stop_fleet`].
fn fleet_child(cmd: &mut Command, slot: usize) -> Result<std::process::Child> {
    let child = cmd.spawn().map_err(|e| format!("could not start {cmd:?}: {e}"))?;
    if let Some(s) = FLEET.get(slot) {
        s.store(i32::try_from(child.id()).unwrap_or(0), std::sync::atomic::Ordering::SeqCst);
    }
    Ok(child)
}

/// The first line a child prints that contains `http://`, and the address after it.
fn announced(child: &mut std::process::Child) -> Result<String> {
    use std::io::BufRead;
    let out = child.stdout.take().ok_or("no stdout")?;
    let mut lines = std::io::BufReader::new(out).lines();
    let line = lines.by_ref().map_while(std::result::Result::ok).find(|l| l.contains("http://")).ok_or("it exited")?;
    // Keep draining its output, so it never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    line.split("http://").nth(1).and_then(|s| s.split_whitespace().next()).map(str::to_owned).ok_or("no address".into())
}

/// Redis, two ratewall-store processes on it, three gateway nodes syncing to them.
fn fleet() -> Result<()> {
    redis()?;
    run(Command::new(cargo()).current_dir(root()).args([
        "build",
        "--quiet",
        "-p",
        "ratewall-store",
        "-p",
        "ratewall-tests",
        "--bin",
        "ratewall-store",
        "--bin",
        "ratewall-gateway",
    ]))?;
    let dir = root().join("target/fleet");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let handler = stop_fleet as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: installs a handler that only calls async-signal-safe functions.
    unsafe {
        libc::signal(libc::SIGTERM, handler);
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGHUP, handler);
    }
    let redis_port = free_port(6390);
    let mut redis = fleet_child(
        Command::new("redis-server")
            .args([
                "--port",
                &redis_port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
            ])
            .arg(&dir)
            .stdout(Stdio::null()),
        0,
    )?;
    let secret = {
        use std::io::Read;
        let mut bytes = [0u8; 16];
        let _ = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    let bin = root().join("target/debug");
    let redis_url = format!("redis://127.0.0.1:{redis_port}");
    let mut children = Vec::new();
    let mut stores = Vec::new();
    for i in 0..2 {
        let mut c = fleet_child(
            Command::new(bin.join("ratewall-store"))
                .env("RATEWALL_SYNC_SECRET", &secret)
                .args(["--listen", "127.0.0.1:0", "--redis", &redis_url])
                .stdout(Stdio::piped()),
            1 + i,
        )?;
        stores.push(announced(&mut c)?);
        children.push(c);
    }
    // The example rules, with a sync section pointing at the stores.
    let example = std::fs::read_to_string(root().join("examples/rules.json")).map_err(|e| e.to_string())?;
    let sync = format!(
        r#",
  "sync": {{ "cluster": "ratewall_store", "secret": "{secret}", "interval": "100ms", "timeout": "50ms", "nodes": 3 }}
}}"#
    );
    let rules = example
        .trim_end()
        .strip_suffix('}')
        .map(|head| {
            format!(
                "{}{sync}
",
                head.trim_end()
            )
        })
        .ok_or("examples/rules.json does not end with }")?;
    let rules_path = dir.join("rules.json");
    std::fs::write(&rules_path, rules).map_err(|e| e.to_string())?;
    let mut gateways = Vec::new();
    for i in 0..3 {
        let mut cmd = Command::new(bin.join("ratewall-gateway"));
        cmd.current_dir(root()).arg("--rules").arg(&rules_path).args(["--port", "0"]).stdout(Stdio::piped());
        for s in &stores {
            cmd.args(["--store", s]);
        }
        let mut c = fleet_child(&mut cmd, 3 + i)?;
        gateways.push(announced(&mut c)?);
        children.push(c);
    }
    let [g1, g2, g3] = [&gateways[0], &gateways[1], &gateways[2]];
    println!(
        "
ratewall fleet: Redis on 127.0.0.1:{redis_port}, ratewall-store on {} and {}, gateways:
  http://{g1}   http://{g2}   http://{g3}

  one limit of 5 holds a minute per user, shared by all three gateways (each alone would
  admit 5, the three 15; the fleet admits at most 5 — a last unit may sit on one gateway's
  grant for up to its 2 s lease):
    for g in {g1} {g2} {g3} {g1} {g2} {g3} {g1}; do curl -s -o /dev/null -w \"$g %{{http_code}}\\n\" -X POST -H 'x-user-id: alice' http://$g/v1/events/42/holds; sleep 0.3; done
  the stores' view:    curl -s http://{}/metrics | grep -v '^#'
  a gateway's sync:    curl -s http://{g1}/_ratewall/metrics | grep sync

Ctrl-C stops it all.
",
        stores[0], stores[1], stores[0]
    );
    let status = redis.wait().map_err(|e| e.to_string())?;
    for mut c in children {
        let _ = c.kill();
    }
    Err(format!("redis-server exited ({status})"))
}

fn bench(args: &[String]) -> Result<()> {
    run(Command::new(cargo()).current_dir(root()).args(["bench", "-p", "ratewall-tests"]).args(args))
}
