//! Runs the built Worker (`dist/worker/`, from `wrangler.toml`) in real local workerd through
//! the project's pinned wrangler: a fresh state directory per instance, readiness awaited,
//! stopped by its PID (SIGTERM, which stops workerd too) when dropped.

use crate::http;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A running `wrangler dev --local`.
pub struct Workerd {
    child: Option<Child>,
    /// `127.0.0.1:port`.
    pub addr: String,
    /// Its `--persist-to` directory (Durable Object and KV state).
    pub state: PathBuf,
    log: PathBuf,
    vars: Vec<(String, String)>,
    /// A wrangler config of its own (wrangler.toml and more), if any.
    config: Option<PathBuf>,
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn wrangler() -> Result<PathBuf, String> {
    let bin = root().join("node_modules/.bin/wrangler");
    let bundle = root().join("dist/worker/index.js");
    if !bin.exists() || !bundle.exists() {
        return Err("the Worker is not built: run `cargo xtask build` (it also installs wrangler from npm)".into());
    }
    Ok(bin)
}

static INSTANCES: AtomicU32 = AtomicU32::new(0);

impl Workerd {
    /// Starts the Worker with `vars` overriding wrangler.toml's, in a fresh state directory.
    pub fn start(vars: &[(&str, &str)]) -> Result<Workerd, String> {
        Workerd::start_with(vars, "")
    }

    /// Starts the Worker as [`Workerd::start`] does, with `extra` appended to wrangler.toml
    /// (more bindings, e.g. a `[[ratelimits]]` one).
    pub fn start_with(vars: &[(&str, &str)], extra: &str) -> Result<Workerd, String> {
        let n = INSTANCES.fetch_add(1, Ordering::Relaxed);
        let state = root().join(format!("target/workerd-tests/{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(&state).map_err(|e| e.to_string())?;
        let vars = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let config = if extra.is_empty() {
            None
        } else {
            // A copy beside the original, so that its relative paths mean the same.
            let base = std::fs::read_to_string(root().join("wrangler.toml")).map_err(|e| e.to_string())?;
            let path = root().join(format!(".wrangler-test-{}-{n}.toml", std::process::id()));
            std::fs::write(&path, format!("{base}\n{extra}\n")).map_err(|e| e.to_string())?;
            Some(path)
        };
        let mut w = Workerd { child: None, addr: String::new(), log: state.join("wrangler.log"), state, vars, config };
        w.launch()?;
        Ok(w)
    }

    /// Starts wrangler on free ports; again on others (up to 3 times) when a port it was
    /// given, or one of its own, was taken meanwhile by another process of the machine.
    fn launch(&mut self) -> Result<(), String> {
        let mut tries = 0;
        loop {
            match self.launch_once() {
                Err(e) if tries < 2 && e.contains("Address already in use") => tries += 1,
                other => return other,
            }
        }
    }

    fn launch_once(&mut self) -> Result<(), String> {
        let port = free_port().map_err(|e| e.to_string())?;
        // Parallel instances must not share the inspector's default port (9229).
        let inspector = free_port().map_err(|e| e.to_string())?;
        let log = std::fs::File::create(&self.log).map_err(|e| e.to_string())?;
        let mut cmd = Command::new(wrangler()?);
        cmd.current_dir(root())
            .args(["dev", "--local", "--ip", "127.0.0.1", "--port", &port.to_string()])
            .args(["--inspector-port", &inspector.to_string(), "--persist-to"])
            .arg(self.state.join("data"))
            .env("WRANGLER_SEND_METRICS", "false")
            .env("WRANGLER_HIDE_BANNER", "true")
            .env("CLOUDFLARE_CF_FETCH_ENABLED", "false")
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        for (k, v) in &self.vars {
            cmd.arg("--var").arg(format!("{k}:{v}"));
        }
        if let Some(config) = &self.config {
            cmd.arg("--config").arg(config);
        }
        self.child = Some(cmd.spawn().map_err(|e| format!("could not start wrangler: {e}"))?);
        self.addr = format!("127.0.0.1:{port}");
        let start = Instant::now();
        loop {
            // Up once ratewall answers (a metrics route that needs a token answers 401 or 404).
            if http::request(&self.addr, "GET", "/_ratewall/metrics", &[], &[])
                .is_ok_and(|r| matches!(r.status, 200 | 401 | 404))
            {
                return Ok(());
            }
            let exited = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || start.elapsed() > Duration::from_secs(90) {
                self.stop();
                return Err(format!("wrangler dev did not become ready; its log:\n{}", self.log()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops the runtime: SIGTERM to wrangler's PID, SIGKILL after 10 s.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Stops and starts again on the same state directory.
    pub fn restart(&mut self) -> Result<(), String> {
        self.stop();
        self.launch()
    }

    /// Everything wrangler and the Worker logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Writes a key of the local `RATEWALL_KV` namespace (as `wrangler kv key put --local`).
    pub fn kv_put(&self, key: &str, value: &str) -> Result<(), String> {
        let out = Command::new(wrangler()?)
            .current_dir(root())
            .args(["kv", "key", "put", "--local", "--binding", "RATEWALL_KV", "--persist-to"])
            .arg(self.state.join("data"))
            .args([key, value])
            .env("WRANGLER_SEND_METRICS", "false")
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("wrangler kv key put failed: {}", String::from_utf8_lossy(&out.stderr)))
        }
    }

    /// One request to the Worker.
    pub fn request(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> http::Response {
        match http::request(&self.addr, method, path, headers, body) {
            Ok(r) => r,
            Err(e) => http::Response { status: 0, headers: Vec::new(), body: e.to_string().into_bytes() },
        }
    }

    /// A metric of the isolate (`/_ratewall/metrics`), 0 when absent.
    pub fn metric(&self, line_prefix: &str) -> u64 {
        let text = self.request("GET", "/_ratewall/metrics", &[], &[]).text();
        text.lines().find_map(|l| l.strip_prefix(line_prefix)?.trim().parse().ok()).unwrap_or(0)
    }
}

impl Drop for Workerd {
    fn drop(&mut self) {
        self.stop();
        if let Some(config) = &self.config {
            let _ = std::fs::remove_file(config);
        }
    }
}
