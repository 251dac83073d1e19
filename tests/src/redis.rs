//! Real Redis servers for the store's tests: `redis-server` (Debian's package; `cargo xtask
//! test` installs it when missing) on a free loopback port with a directory of its own and
//! no persistence, stopped by its PID when dropped; and a 3-primary Cluster of them.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `redis-server`.
pub struct Redis {
    child: Option<Child>,
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: PathBuf,
    cluster: bool,
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Runs `redis-cli -p port args…`; its output.
pub fn cli(port: u16, args: &[&str]) -> Result<String, String> {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .map_err(|e| format!("redis-cli: {e} (install Debian's redis-server, or run `cargo xtask test`)"))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Redis {
    /// Starts a server (`cluster`: with `--cluster-enabled yes`).
    pub fn start(cluster: bool) -> Result<Redis, String> {
        let port = free_port().map_err(|e| e.to_string())?;
        let dir = std::env::temp_dir().join(format!("ratewall-redis-{}-{port}", std::process::id()));
        let mut r = Redis { child: None, port, dir, cluster };
        r.launch()?;
        Ok(r)
    }

    fn launch(&mut self) -> Result<(), String> {
        let _ = std::fs::remove_dir_all(&self.dir);
        std::fs::create_dir_all(&self.dir).map_err(|e| e.to_string())?;
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if self.cluster {
            cmd.args(["--cluster-enabled", "yes", "--cluster-config-file"]).arg(self.dir.join("nodes.conf"));
        }
        let child = cmd
            .spawn()
            .map_err(|e| format!("redis-server: {e} (install Debian's redis-server, or run `cargo xtask test`)"))?;
        self.child = Some(child);
        let start = Instant::now();
        while cli(self.port, &["ping"]).map_or(true, |o| !o.contains("PONG")) {
            if start.elapsed() > Duration::from_secs(10) {
                return Err(format!("redis-server on port {} did not answer", self.port));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// `redis://127.0.0.1:port`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's process id, while it runs (to pause it with SIGSTOP: a server that no
    /// longer answers but keeps its connections).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops the server (SIGKILL: nothing is saved, as in a crash).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port, empty.
    pub fn restart(&mut self) -> Result<(), String> {
        self.stop();
        self.launch()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A 3-primary Redis Cluster on loopback.
pub struct Cluster {
    /// Its nodes.
    pub nodes: Vec<Redis>,
}

impl Cluster {
    /// Starts three cluster-enabled servers and joins them (slots split in three).
    pub fn start() -> Result<Cluster, String> {
        let nodes: Vec<Redis> = (0..3).map(|_| Redis::start(true)).collect::<Result<_, _>>()?;
        let ranges = [(0, 5460), (5461, 10922), (10923, 16383)];
        for (n, (lo, hi)) in nodes.iter().zip(ranges) {
            cli(n.port, &["cluster", "addslotsrange", &lo.to_string(), &hi.to_string()])?;
        }
        let first = nodes.first().ok_or("no nodes")?.port;
        for n in nodes.iter().skip(1) {
            cli(n.port, &["cluster", "meet", "127.0.0.1", &first.to_string()])?;
        }
        let start = Instant::now();
        while !nodes.iter().all(|n| cli(n.port, &["cluster", "info"]).is_ok_and(|o| o.contains("cluster_state:ok"))) {
            if start.elapsed() > Duration::from_secs(20) {
                return Err("the Redis Cluster did not form".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Cluster { nodes })
    }

    /// The nodes' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Redis::url).collect()
    }
}
