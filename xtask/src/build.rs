//! `cargo xtask build`: the filter (exports trimmed, wasm-opt), the core probe and the
//! Worker bundle into `dist/`.

use crate::toolchain::*;
use crate::*;
use std::path::Path;
use std::process::Command;

/// The worker-build release that matches the `worker` crate in Cargo.lock.
pub(crate) const WORKER_BUILD: &str = "0.8.7";
/// wasm-opt over the filter: the features rustc's wasm32 target enables, no debug info.
/// GUFA (whole-program flow analysis: values that are constants, code no value reaches) and
/// a second `-Oz` over its result: measured −1.3 KB, no slower.
pub(crate) const WASM_OPT_FLAGS: &[&str] = &[
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

/// Builds the wasm artifacts: `dist/ratewall_filter.wasm`, and the core probe that CI checks.
pub(crate) fn build() -> Result<()> {
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
    // Made beside it and renamed over it once optimized: a copy or deploy taken meanwhile
    // gets the last whole filter, never an empty or unoptimized one.
    let making = dist.join("ratewall_filter.wasm.new");
    std::fs::write(&making, trimmed).map_err(|e| format!("{}: {e}", making.display()))?;
    optimize(&making);
    std::fs::rename(&making, &filter).map_err(|e| format!("{}: {e}", filter.display()))?;
    let probe = root().join("target/wasm/ratewall_core_probe.wasm");
    std::fs::copy(out.join("ratewall_core_probe.wasm"), &probe).map_err(|e| format!("copying the core probe: {e}"))?;
    let size = std::fs::metadata(&filter).map(|m| m.len()).unwrap_or(0);
    eprintln!("xtask: built {} ({size} bytes)", filter.display());
    build_worker(&tc)
}

/// SDK callbacks the filter never needs: see [`build`].
pub(crate) fn unused_export(name: &str) -> bool {
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
pub(crate) fn leb(bytes: &[u8], i: &mut usize) -> Result<u64> {
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

pub(crate) fn put_leb(out: &mut Vec<u8>, mut v: u64) {
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
pub(crate) fn drop_exports(wasm: &[u8], drop: impl Fn(&str) -> bool) -> Result<Vec<u8>> {
    let mut out = wasm.get(..8).ok_or("not a wasm module")?.to_vec();
    let mut i = 8;
    while i < wasm.len() {
        let id = *wasm.get(i).ok_or("truncated wasm section")?;
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

/// wasm-opt over the Worker (wasm-bindgen's output): the features it uses (exception
/// handling and reference types among them), no debug info. Measured: 1,220,620 → 899,802
/// bytes, 406 → 356 KB gzipped. `--low-memory-unused` lets it fold address arithmetic into
/// loads' and stores' offsets: rustc's wasm32 layout puts the stack first, growing down from
/// 1 MiB, and the data above it, so the lowest KiB is reached only by a stack 1023 KiB deep
/// (measured: 1,001,405 → 991,121 bytes).
pub(crate) const WORKER_WASM_OPT_FLAGS: &[&str] = &[
    "-Oz",
    "--low-memory-unused",
    "--enable-exception-handling",
    "--enable-reference-types",
    "--enable-bulk-memory",
    "--enable-sign-ext",
    "--enable-mutable-globals",
    "--enable-nontrapping-float-to-int",
    "--enable-multivalue",
    "--strip-debug",
    "--strip-producers",
];

/// Runs binaryen's wasm-opt (npm `binaryen`, pinned in package-lock.json) over the filter in
/// place. Without Node the filter is still built, only larger, and xtask says so.
pub(crate) fn optimize(wasm: &Path) {
    optimize_with(wasm, WASM_OPT_FLAGS);
}

/// [`optimize`] with `flags`.
fn optimize_with(wasm: &Path, flags: &[&str]) {
    let wasm_opt = root().join("node_modules/binaryen/bin/wasm-opt");
    let ok = npm_tools().is_ok()
        && Command::new(&wasm_opt).args(flags).arg(wasm).arg("-o").arg(wasm).status().is_ok_and(|s| s.success());
    if !ok {
        eprintln!("xtask: wasm-opt (npm binaryen) did not run; {} is not size-optimized", wasm.display());
    }
}

/// Builds the Worker with worker-build (wasm-bindgen at the version in Cargo.lock, esbuild
/// from npm, no wasm-opt download) into dist/worker/, the bundle wrangler.toml deploys, then
/// runs npm binaryen's wasm-opt over its wasm.
pub(crate) fn build_worker(tc: &Toolchain) -> Result<()> {
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
        // worker-build builds with the release profile; the Worker takes the wasm profile's
        // whole-program LTO in one codegen unit, as the filter does. Measured after wasm-opt:
        // 1,017,789 → 898,432 bytes, 397,014 → 360,664 gzipped.
        .env("CARGO_PROFILE_RELEASE_LTO", "fat")
        .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "1")
        .env("CARGO_TARGET_DIR", root().join("target/wasm")))?;
    let dist = root().join("dist/worker");
    std::fs::create_dir_all(&dist).map_err(|e| format!("{}: {e}", dist.display()))?;
    // Made beside the bundle and renamed into it once optimized (the wasm first, then the
    // script that loads it): a copy or `wrangler deploy` taken meanwhile gets a whole bundle,
    // never an empty wasm (wasm-opt writes its output from the start).
    let making = |file: &str| dist.join(format!("{file}.new"));
    for file in ["index.js", "index_bg.wasm"] {
        std::fs::copy(crate_dir.join("build").join(file), making(file))
            .map_err(|e| format!("copying the Worker's {file}: {e}"))?;
    }
    optimize_with(&making("index_bg.wasm"), WORKER_WASM_OPT_FLAGS);
    for file in ["index_bg.wasm", "index.js"] {
        std::fs::rename(making(file), dist.join(file)).map_err(|e| format!("dist/worker/{file}: {e}"))?;
    }
    let size = std::fs::metadata(dist.join("index_bg.wasm")).map(|m| m.len()).unwrap_or(0);
    eprintln!("xtask: built {} ({size} bytes of wasm)", dist.display());
    Ok(())
}
