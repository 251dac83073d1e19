//! `cargo xtask dev`, `gateway` and `fleet`: ratewall running locally, its children stopped
//! with it.

use crate::test::*;
use crate::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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
pub(crate) fn forward_signals_to(child: &std::process::Child) {
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
pub(crate) fn free_port(want: u16) -> u16 {
    let bind = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).ok().and_then(|l| l.local_addr().ok());
    bind(want).or_else(|| bind(0)).map_or(want, |a| a.port())
}

/// Runs the Worker in local workerd through wrangler, in front of the built-in demo origin.
pub(crate) fn dev(args: &[String]) -> Result<()> {
    let want = args
        .iter()
        .position(|a| a == "--port")
        .and_then(|i| args.get(i + 1))
        .and_then(|p| p.parse().ok())
        .unwrap_or(8787);
    let port = free_port(want);
    // Fresh secrets per run: the sync store's (filter fleets in this dev setup use it) and the
    // admin routes' (the dashboard).
    let random = || {
        use std::io::Read;
        let mut bytes = [0u8; 16];
        let _ = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    let (secret, admin) = (random(), random());
    // Kept in files only the user can read, and named in the output by their paths: a secret
    // is never printed.
    let state = root().join("target/dev-state");
    let keep = |name: &str, value: &str| -> Result<String> {
        std::fs::create_dir_all(&state).map_err(|e| format!("{}: {e}", state.display()))?;
        let path = state.join(name);
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut f = options.open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        // A file left by an earlier run keeps its mode through `open`: set it again.
        #[cfg(unix)]
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        std::io::Write::write_all(&mut f, value.as_bytes()).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(path.display().to_string())
    };
    let (secret_file, admin_file) = (keep("sync-secret", &secret)?, keep("admin-token", &admin)?);
    // wrangler reads them from a file too: on its command line (`--var`) any local user could
    // read them with `ps`.
    let env_file = keep("worker.env", &format!("RATEWALL_SYNC_SECRET={secret}\nRATEWALL_ADMIN_TOKEN={admin}\n"))?;
    let mut child = Command::new(root().join("node_modules/.bin/wrangler"))
        .current_dir(root())
        .args(["dev", "--local", "--ip", "127.0.0.1", "--port", &port.to_string(), "--persist-to", "target/dev-state"])
        .args(["--env-file", &env_file])
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
  the dashboard (who is being limited, for the whole edge; the admin token is in
  {admin_file}), its address, and its JSON:
    echo \"{url}/_ratewall/?token=$(cat '{admin_file}')\"
    curl -s -H \"authorization: Bearer $(cat '{admin_file}')\" {url}/_ratewall/top
  filter fleets sync to POST {url}/v1/sync with the secret in {secret_file}

Ctrl-C stops it.\n"
    );
    let status = child.wait().map_err(|e| e.to_string())?;
    if status.success() || status.code().is_none() {
        Ok(())
    } else {
        Err(format!("wrangler dev exited with {status}"))
    }
}

pub(crate) fn gateway(args: &[String]) -> Result<()> {
    let mut cmd = Command::new(cargo());
    cmd.current_dir(root()).args(["run", "--quiet", "-p", "ratewall-gateway", "--"]);
    if !args.iter().any(|a| a == "--rules") {
        cmd.args(["--rules", "examples/rules.json"]);
    }
    cmd.args(args);
    eprintln!("+ {cmd:?}");
    let mut child = cmd.spawn().map_err(|e| format!("could not start the gateway: {e}"))?;
    // `cargo run` execs the gateway in its own process: a signal to xtask reaches it too.
    forward_signals_to(&child);
    let status = child.wait().map_err(|e| e.to_string())?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("the gateway exited with {status}"))
    }
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
pub(crate) fn fleet_child(cmd: &mut Command, slot: usize) -> Result<std::process::Child> {
    let child = cmd.spawn().map_err(|e| format!("could not start {cmd:?}: {e}"))?;
    if let Some(s) = FLEET.get(slot) {
        s.store(i32::try_from(child.id()).unwrap_or(0), std::sync::atomic::Ordering::SeqCst);
    }
    Ok(child)
}

/// The first line a child prints that contains `http://`, and the address after it.
pub(crate) fn announced(child: &mut std::process::Child) -> Result<String> {
    announced_all(child, 1).map(|mut a| a.remove(0))
}

/// The first `n` addresses a child prints (`http://ADDR` on lines of their own).
fn announced_all(child: &mut std::process::Child, n: usize) -> Result<Vec<String>> {
    use std::io::BufRead;
    let out = child.stdout.take().ok_or("no stdout")?;
    let mut lines = std::io::BufReader::new(out).lines();
    let mut found = Vec::new();
    while found.len() < n {
        let line =
            lines.by_ref().map_while(std::result::Result::ok).find(|l| l.contains("http://")).ok_or("it exited")?;
        let addr = line.split("http://").nth(1).and_then(|s| s.split(['/', ' ']).next()).ok_or("no address")?;
        found.push(addr.to_owned());
    }
    // Keep draining its output, so it never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    Ok(found)
}

/// Redis, two ratewall-store processes on it, three gateway nodes syncing to them.
pub(crate) fn fleet() -> Result<()> {
    redis()?;
    run(Command::new(cargo()).current_dir(root()).args([
        "build",
        "--quiet",
        "-p",
        "ratewall-store",
        "-p",
        "ratewall-gateway",
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
    let mut admin = String::new();
    for i in 0..2 {
        let mut cmd = Command::new(bin.join("ratewall-store"));
        cmd.env("RATEWALL_SYNC_SECRET", &secret).args(["--listen", "127.0.0.1:0", "--redis", &redis_url]);
        // The first store's admin listener, at loopback (no authentication).
        if i == 0 {
            cmd.args(["--admin", "127.0.0.1:0"]);
        }
        let mut c = fleet_child(cmd.stdout(Stdio::piped()), 1 + i)?;
        let mut addrs = announced_all(&mut c, if i == 0 { 2 } else { 1 })?.into_iter();
        stores.push(addrs.next().ok_or("no address")?);
        if let Some(a) = addrs.next() {
            admin = a;
        }
        children.push(c);
    }
    // The example rules, with a sync section pointing at the stores, and the holds exact: 5 a
    // minute across three gateways is where the no-wait overshoot (about one unit per gateway)
    // is a large part of the limit.
    let example = std::fs::read_to_string(root().join("examples/rules.json")).map_err(|e| e.to_string())?;
    let holds = r#""key": ["user"],"#;
    if !example.contains(holds) {
        return Err("examples/rules.json has no rule keyed on the user alone".into());
    }
    let example = example.replacen(holds, r#""key": ["user"], "exact": true,"#, 1);
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
    let [g1, g2, g3] = gateways.as_slice() else { return Err("three gateways did not start".into()) };
    let [s1, s2] = stores.as_slice() else { return Err("two stores did not start".into()) };
    println!(
        "
ratewall fleet: Redis on 127.0.0.1:{redis_port}, ratewall-store on {} and {}, gateways:
  http://{g1}   http://{g2}   http://{g3}

  one limit of 5 holds a minute per user, shared by all three gateways (each alone would
  admit 5, the three 15; the rule runs exact here, so the fleet admits at most 5 — a last
  unit may sit on one gateway's grant for up to its 2 s lease; rules that are not exact
  never wait and may admit about one more per gateway):
    for g in {g1} {g2} {g3} {g1} {g2} {g3} {g1}; do curl -s -o /dev/null -w \"$g %{{http_code}}\\n\" -X POST -H 'x-user-id: alice' http://$g/v1/events/42/holds; sleep 0.3; done
  the stores' view:    curl -s http://{}/metrics | grep -v '^#'
  who is limited:      http://{admin}/ (the dashboard), curl -s http://{admin}/v1/top
                       (the first store's admin listener, for the batches both stores answered)
  a gateway's sync:    curl -s http://{g1}/_ratewall/metrics | grep sync

Ctrl-C stops it all.
",
        s1, s2, s1
    );
    // Redis stopping is a failure to try, not the end of the fleet: the stores answer 503 and
    // the gateways run on their degraded limits until it is back.
    let status = redis.wait().map_err(|e| e.to_string())?;
    eprintln!(
        "xtask: redis-server exited ({status}); the fleet runs on without it (the stores answer 503, the \
         gateways decide on their own). To bring it back on the same port:\n  redis-server --port {redis_port} \
         --bind 127.0.0.1 --save '' --appendonly no\nCtrl-C stops the fleet."
    );
    let mut first_exit = None;
    for mut c in children {
        let status = c.wait().map_err(|e| e.to_string())?;
        first_exit.get_or_insert(status);
    }
    Err(format!("the fleet's processes exited ({})", first_exit.map_or_else(String::new, |s| s.to_string())))
}
