//! ratewall-store as its users run it — the built binary on loopback, over real Redis
//! servers (and a real 3-primary Cluster) that the tests start and stop by PID.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_core::sync::{hex, sign, Delta, SyncRequest};
use ratewall_core::{Algorithm, Limit, SECOND};
use ratewall_tests::conformance::{
    comparable, key, replay_after_the_seq_memory, sequences, version_1_batch, wall_clock, Http, Reference, SyncStore,
    SECRET,
};
use ratewall_tests::http;
use ratewall_tests::redis::{cli, Cluster, Redis};
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `ratewall-store`, stopped (SIGKILL) when dropped.
struct StoreProcess {
    child: Child,
    addr: String,
    /// Where its log (stderr) goes.
    log: std::path::PathBuf,
}

impl StoreProcess {
    fn start(redis: &[String], cluster: bool) -> StoreProcess {
        StoreProcess::start_with(SECRET, redis, cluster)
    }

    fn start_with(secret: &str, redis: &[String], cluster: bool) -> StoreProcess {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ratewall-store"));
        cmd.env("RATEWALL_SYNC_SECRET", secret).args(["--listen", "127.0.0.1:0", "--deadline-ms", "300"]);
        for r in redis {
            cmd.args(["--redis", r]);
        }
        if cluster {
            cmd.arg("--cluster");
        }
        static STARTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log =
            std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("store-{}-{n}.log", std::process::id()));
        let stderr = std::fs::File::create(&log).unwrap();
        let mut child = cmd.stdout(Stdio::piped()).stderr(stderr).spawn().unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr = line.split("http://").nth(1).and_then(|s| s.split_whitespace().next()).unwrap().to_owned();
        assert!(!line.contains(secret), "the secret is never logged: {line}");
        StoreProcess { child, addr, log }
    }

    /// What it has logged so far.
    fn logged(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its log once it says `what` (within 5 s; the log as it is then, if not).
    fn logged_once_it_says(&self, what: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !self.logged().contains(what) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.logged()
    }

    fn get(&self, path: &str) -> http::Response {
        http::request(&self.addr, "GET", path, &[], &[]).unwrap()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for StoreProcess {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.log);
    }
}

fn big() -> Limit {
    Limit::new(Algorithm::FixedWindow, 1_000_000, 3600 * SECOND, None).unwrap()
}

fn post(addr: &str, body: &[u8], signature: Option<&str>) -> http::Response {
    let headers: Vec<(&str, &str)> = signature.map(|s| ("x-ratewall-signature", s)).into_iter().collect();
    http::request(addr, "POST", "/v1/sync", &headers, body).unwrap()
}

/// Units counted on `k` so far, read through a 0-unit batch of a probe node.
fn counted(addr: &str, k: &[u8], probe_seq: u64) -> u64 {
    let probe = SyncRequest {
        node: 7_777,
        seq: probe_seq,
        sent: 0,
        deltas: vec![Delta { key: k.to_vec(), limit: big(), units: 0 }],
        ask: false,
    };
    let (status, resp) = Http(addr).call(&probe);
    assert_eq!(status, 200);
    1_000_000 - resp.unwrap().grants[0].remaining
}

/// `senders` concurrent nodes, `batches` each, naming every key, spread over `addrs`; each
/// retries a failed batch with the same seq. Returns the units acknowledged with a 200.
fn load(addrs: &[&str], keys: &[Vec<u8>], senders: u64, batches: u64, node_base: u64) -> u64 {
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..senders)
            .map(|sender| {
                scope.spawn(move || {
                    let mut acked = 0;
                    for seq in 1..=batches {
                        let units = 1 + (sender + seq) % 4;
                        let deltas = keys.iter().map(|k| Delta { key: k.clone(), limit: big(), units }).collect();
                        let req = SyncRequest { node: node_base + sender, seq, sent: 0, deltas, ask: false };
                        for attempt in 0..20 {
                            let addr = addrs[((sender + seq + attempt) as usize) % addrs.len()];
                            if Http(addr).call(&req).0 == 200 {
                                acked += units;
                                break;
                            }
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                    acked
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    })
}

#[test]
fn refuses_to_start_without_a_secret_or_a_port() {
    let redis = Redis::start(false).unwrap();
    let run = |secret: Option<&str>, listen: &str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ratewall-store"));
        cmd.env_remove("RATEWALL_SYNC_SECRET").args(["--listen", listen, "--redis", &redis.url()]);
        if let Some(s) = secret {
            cmd.env("RATEWALL_SYNC_SECRET", s);
        }
        cmd.stdout(Stdio::null()).stderr(Stdio::null()).status().unwrap()
    };
    assert!(!run(None, "127.0.0.1:0").success(), "no secret");
    assert!(!run(Some("too-short"), "127.0.0.1:0").success(), "a secret under 16 characters");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    assert!(!run(Some(SECRET), &format!("127.0.0.1:{port}")).success(), "a port that cannot be bound");
    // `--help` is not a mistake: the usage on stdout, exit 0; an unknown flag exits 2.
    let help = Command::new(env!("CARGO_BIN_EXE_ratewall-store")).arg("--help").output().unwrap();
    assert!(help.status.success() && String::from_utf8_lossy(&help.stdout).contains("--rls-config"), "{help:?}");
    let bogus = Command::new(env!("CARGO_BIN_EXE_ratewall-store")).arg("--bogus").output().unwrap();
    assert_eq!(bogus.status.code(), Some(2));
    // Flags that would start a store that never serves, or serve otherwise than asked.
    let url = redis.url();
    for (args, why) in [
        (vec!["--listen", "127.0.0.1:0", "--redis", "http://x"], "not a Redis URL"),
        (vec!["--listen", "127.0.0.1:0", "--listen", "127.0.0.1:0", "--redis", url.as_str()], "is given twice"),
        (vec!["--listen", "127.0.0.1:0", "--redis", url.as_str(), "--redis", url.as_str()], "add --cluster"),
        (vec!["--listen", "127.0.0.1:0", "--redis", url.as_str(), "--deadline-ms", "0"], "from 1 to 60000"),
        (vec!["--listen", "127.0.0.1:0", "--redis", url.as_str(), "--deadline-ms", "18446744073709551615"], "from 1"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ratewall-store"))
            .env("RATEWALL_SYNC_SECRET", SECRET)
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains(why), "{args:?}: {out:?}");
        assert!(!String::from_utf8_lossy(&out.stdout).contains("listening"), "{args:?}: {out:?}");
    }
    // A listener that cannot be bound after the main one: no "listening" said first.
    let out = Command::new(env!("CARGO_BIN_EXE_ratewall-store"))
        .env("RATEWALL_SYNC_SECRET", SECRET)
        .args(["--listen", "127.0.0.1:0", "--redis", &url, "--admin", &format!("127.0.0.1:{port}")])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(!String::from_utf8_lossy(&out.stdout).contains("listening"), "{out:?}");
}

/// `cmd` (the store, or what runs it) started on a Redis that cannot be reached: the store
/// once it listens, and its stderr.
fn without_redis(mut cmd: Command) -> (StoreProcess, std::process::ChildStderr) {
    let mut child = cmd
        .env("RATEWALL_SYNC_SECRET", SECRET)
        .args(["--listen", "127.0.0.1:0", "--deadline-ms", "50", "--redis", "redis://127.0.0.1:1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.split("http://").nth(1).and_then(|s| s.split_whitespace().next()).unwrap().to_owned();
    (StoreProcess { child, addr, log: std::path::PathBuf::new() }, err)
}

#[test]
fn a_store_whose_log_pipe_has_closed_keeps_serving() {
    // Redis unreachable: the store says so on stderr at once, and again as calls fail.
    let (mut store, err) = without_redis(Command::new(env!("CARGO_BIN_EXE_ratewall-store")));
    drop(err);
    let req = SyncRequest {
        node: 1,
        seq: 1,
        sent: 0,
        deltas: vec![Delta { key: b"k".to_vec(), limit: big(), units: 1 }],
        ask: false,
    };
    for _ in 0..3 {
        assert_eq!(Http(&store.addr).call(&req).0, 503);
    }
    assert_eq!(store.get("/healthz").status, 503);
    assert!(store.child.try_wait().unwrap().is_none(), "the store is still up");
}

/// Connections held open past the most the store keeps (its file descriptors' limit less
/// those kept for the rest) do not stop it: a new one past them is closed at once, and once
/// some end the store answers again. (20,000 idle connections took every file descriptor,
/// and the store answered no one until they closed.)
#[test]
fn idle_connections_past_its_limit_are_closed_at_once_and_the_store_serves_again() {
    // 656 file descriptors: at most 144 connections (256 kept for the rest, 256 for the admin
    // listener).
    let mut sh = Command::new("sh");
    sh.arg("-c")
        .arg("ulimit -Sn 656 && ulimit -Hn 656 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_ratewall-store"));
    let (store, err) = without_redis(sh);
    let held: Vec<std::net::TcpStream> =
        (0..200).filter_map(|_| std::net::TcpStream::connect(&store.addr).ok()).collect();
    // The store has taken them in (or closed them) by the time one asks again.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let started = std::time::Instant::now();
    let r = http::request(&store.addr, "GET", "/healthz", &[], &[]);
    assert!(r.is_err(), "past the limit, closed: {r:?}");
    assert!(started.elapsed() < std::time::Duration::from_secs(2), "at once");
    drop(held);
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(store.get("/healthz").status, 503, "answered again (Redis unreachable)");
    drop(store);
    let mut log = String::new();
    std::io::Read::read_to_string(&mut std::io::BufReader::new(err), &mut log).unwrap();
    assert!(log.contains("144 connections open, the most it keeps"), "{log}");
}

#[test]
fn answers_every_sequence_as_the_reference_store_does() {
    let redis = Redis::start(false).unwrap();
    let store = StoreProcess::start(&[redis.url()], false);
    let run = format!("s{}", std::process::id());
    let ours = comparable(sequences(&run, &mut Http(&store.addr)));
    let reference = comparable(sequences(&run, &mut Reference::new()));
    for ((name, ours), (_, theirs)) in ours.iter().zip(&reference) {
        assert_eq!(ours, theirs, "{name}: ratewall-store and the reference store disagree");
    }
    assert_eq!(store.get("/healthz").status, 200);
    // The sequences' refusals for time (batches, a heartbeat, an ask) and for shape are
    // counted by status.
    let metrics = store.get("/metrics").text();
    assert!(metrics.contains("ratewall_store_sync_failed_total{status=\"422\"} 4\n"), "{metrics}");
    assert!(metrics.contains("ratewall_store_sync_failed_total{status=\"415\"} 1\n"), "{metrics}");
}

/// Waits out the store's 60 s `seq` memory on Redis's clock (61 s): no virtual clock
/// reaches inside Redis.
#[test]
fn a_batch_replayed_after_its_seq_is_forgotten_is_refused_and_counts_nothing() {
    let redis = Redis::start(false).unwrap();
    let store = StoreProcess::start(&[redis.url()], false);
    let run = format!("p{}", std::process::id());
    let seen = replay_after_the_seq_memory(&run, &mut Http(&store.addr));
    let statuses: Vec<u16> = seen.iter().map(|s| s.status).collect();
    assert_eq!(statuses, [200, 200, 422, 200], "the replay is refused for its time");
    assert_eq!((seen[1].remaining.as_slice(), seen[3].remaining.as_slice()), (&[75][..], &[75][..]), "counted once");
    assert_eq!(seen, replay_after_the_seq_memory(&run, &mut Reference::new()));
}

#[test]
fn two_store_processes_on_one_redis_count_every_acknowledged_unit_once() {
    let redis = Redis::start(false).unwrap();
    let (a, b) = (StoreProcess::start(&[redis.url()], false), StoreProcess::start(&[redis.url()], false));
    let run = format!("c{}", std::process::id());
    // One hot counter and many: every unit acknowledged is counted, exactly.
    for keys in [vec![key(&run, "hot")], (0..40).map(|i| key(&run, &format!("k{i}"))).collect::<Vec<_>>()] {
        let acked = load(&[&a.addr, &b.addr], &keys, 8, 12, 100 + keys.len() as u64 * 100);
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(
                counted(&a.addr, k, 1 + i as u64 + keys.len() as u64 * 1000),
                acked,
                "{}",
                String::from_utf8_lossy(k)
            );
        }
    }
    let metrics = a.get("/metrics").text() + &b.get("/metrics").text();
    assert!(metrics.contains("# TYPE ratewall_store_cas_conflicts_total counter"), "{metrics}");
    let exhausted: u64 = metrics
        .lines()
        .filter_map(|l| l.strip_prefix("ratewall_store_cas_exhausted_total "))
        .map(|v| v.parse::<u64>().unwrap())
        .sum();
    println!("cas exhausted: {exhausted}");
}

#[test]
fn a_store_killed_mid_run_loses_no_acknowledged_unit() {
    let redis = Redis::start(false).unwrap();
    let mut a = StoreProcess::start(&[redis.url()], false);
    let b = StoreProcess::start(&[redis.url()], false);
    let run = format!("k{}", std::process::id());
    let keys: Vec<Vec<u8>> = (0..5).map(|i| key(&run, &format!("k{i}"))).collect();
    let (a_addr, b_addr) = (a.addr.clone(), b.addr.clone());
    let acked = std::thread::scope(|scope| {
        let load = scope.spawn(|| load(&[&a_addr, &b_addr], &keys, 6, 25, 300));
        std::thread::sleep(Duration::from_millis(300));
        a.kill();
        load.join().unwrap()
    });
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(counted(&b.addr, k, 1 + i as u64), acked);
    }
}

/// A Redis that answers `PING` but refuses writes serves no batch: the store's health says
/// so, with Redis's reason, until it takes writes again.
#[test]
fn a_redis_that_refuses_writes_is_unhealthy_with_its_reason() {
    let redis = Redis::start(false).unwrap();
    let store = StoreProcess::start(&[redis.url()], false);
    assert_eq!(store.get("/healthz").status, 200);
    let refusals: [(&[&str], &[&str], &str); 2] = [
        (&["config", "set", "maxmemory", "1"], &["config", "set", "maxmemory", "0"], "oom"),
        (&["replicaof", "127.0.0.1", "1"], &["replicaof", "no", "one"], "read only"),
    ];
    for (refuse, undo, reason) in refusals {
        cli(redis.port, refuse).unwrap();
        let r = store.get("/healthz");
        assert_eq!(r.status, 503, "{reason}");
        assert!(r.text().to_lowercase().contains(reason), "{reason}: {}", r.text());
        cli(redis.port, undo).unwrap();
        assert_eq!(store.get("/healthz").status, 200, "{reason} undone");
    }
    // A value of another type on a key of the node registry fails every batch: health names
    // the key, and both come back once it is deleted.
    let run = format!("j{}", std::process::id());
    let batch = |seq: u64| SyncRequest {
        node: 7,
        seq,
        sent: 0,
        deltas: vec![Delta { key: key(&run, "k"), limit: big(), units: 1 }],
        ask: false,
    };
    assert_eq!(Http(&store.addr).call(&batch(1)).0, 200);
    cli(redis.port, &["del", "rw:{registry}:seen"]).unwrap();
    cli(redis.port, &["set", "rw:{registry}:seen", "junk"]).unwrap();
    assert_eq!(Http(&store.addr).call(&batch(2)).0, 503);
    let r = store.get("/healthz");
    assert_eq!(r.status, 503);
    assert!(r.text().contains("rw:{registry}:seen holds a string"), "{}", r.text());
    cli(redis.port, &["del", "rw:{registry}:seen"]).unwrap();
    assert_eq!(store.get("/healthz").status, 200);
    assert_eq!(Http(&store.addr).call(&batch(2)).0, 200);
    assert_eq!(counted(&store.addr, &key(&run, "k"), 1), 2);
    assert!(!store.logged().contains("maxmemory-policy"), "noeviction: no warning");
    // A policy that evicts counters is warned of at start.
    cli(redis.port, &["config", "set", "maxmemory-policy", "volatile-lru"]).unwrap();
    let warned = StoreProcess::start(&[redis.url()], false);
    assert!(warned.logged().contains("maxmemory-policy is volatile-lru"), "{}", warned.logged());
}

#[test]
fn redis_gone_answers_503_within_the_deadline_and_service_resumes_when_it_is_back() {
    let mut redis = Redis::start(false).unwrap();
    let store = StoreProcess::start(&[redis.url()], false);
    let run = format!("f{}", std::process::id());
    let k = key(&run, "k");
    let req = |seq: u64, units: u64| SyncRequest {
        node: 1,
        seq,
        sent: 0,
        deltas: vec![Delta { key: k.clone(), limit: big(), units }],
        ask: false,
    };
    assert_eq!(Http(&store.addr).call(&req(1, 2)).0, 200);
    // The script cache emptied (as by a restart or failover): the next batch still works.
    cli(redis.port, &["script", "flush"]).unwrap();
    assert_eq!(Http(&store.addr).call(&req(2, 3)).0, 200);
    assert_eq!(counted(&store.addr, &k, 1), 5);
    redis.stop();
    let started = Instant::now();
    assert_eq!(Http(&store.addr).call(&req(3, 1)).0, 503, "Redis is gone");
    assert!(started.elapsed() < Duration::from_secs(3), "503 took {:?}", started.elapsed());
    assert_eq!(store.get("/healthz").status, 503);
    redis.restart().unwrap();
    let mut back = false;
    for _ in 0..100 {
        if Http(&store.addr).call(&req(3, 1)).0 == 200 {
            back = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(back, "the store did not resume once Redis was back");
    assert_eq!(store.get("/healthz").status, 200);
    let metrics = store.get("/metrics").text();
    assert!(metrics.contains("ratewall_store_sync_failed_total{status=\"503\"}"), "{metrics}");
    match ratewall_tests::promtool_problems(&metrics) {
        Some(problems) => assert!(problems.is_empty(), "promtool check metrics: {problems:?}\n{metrics}"),
        None => println!("promtool is not installed here: the scrape's format is not checked"),
    }
}

#[test]
fn a_counter_the_store_cannot_read_is_kept_and_named_failed_and_the_rest_of_the_batch_counts() {
    let redis = Redis::start(false).unwrap();
    let store = StoreProcess::start(&[redis.url()], false);
    let run = format!("u{}", std::process::id());
    let (good, bad) = (key(&run, "good"), key(&run, "bad"));
    // As a newer store's counter reads to an older one, or a damaged value.
    let bad_redis = format!("rw:{{{}}}", hex(&bad));
    assert_eq!(cli(redis.port, &["set", &bad_redis, "written by a newer store"]).unwrap().trim(), "OK");
    let batch = |seq: u64| SyncRequest {
        node: 1,
        seq,
        sent: 0,
        deltas: vec![
            Delta { key: bad.clone(), limit: big(), units: 3 },
            Delta { key: good.clone(), limit: big(), units: 4 },
        ],
        ask: false,
    };
    let (status, resp) = Http(&store.addr).call(&batch(1));
    assert_eq!(status, 200, "one unreadable counter does not fail its batch");
    let resp = resp.unwrap();
    assert_eq!(resp.failed, vec![0]);
    assert_eq!((resp.grants[0].remaining, resp.grants[0].grant, resp.grants[1].remaining), (0, 0, 1_000_000 - 4));
    assert_eq!(cli(redis.port, &["get", &bad_redis]).unwrap().trim(), "written by a newer store", "kept as it was");
    assert!(store.get("/metrics").text().contains("ratewall_store_unreadable_counters_total 1\n"));
    // An ask naming it fails whole, and its other counter takes nothing for it.
    let sent = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let ask = SyncRequest { ask: true, node: 3, sent, ..batch(1) };
    let answer = post(&store.addr, &ask.encode(), Some(&hex(&sign(SECRET.as_bytes(), &ask.encode()))));
    assert_eq!((answer.status, answer.text()), (503, ratewall_core::sync::reason::UNREADABLE_ASK.to_owned()));
    assert_eq!(counted(&store.addr, &good, 1), 4, "the ask took nothing");
    // Said once for both reads, with the key to find it by.
    let said: Vec<String> = store.logged().lines().filter(|l| l.contains("unreadable")).map(str::to_owned).collect();
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(said[0].contains(&bad_redis) && said[0].contains("deleted"), "{said:?}");
    // Once it is readable (here: gone, as when it expires), the node's next batch (a new seq)
    // carries its units again, and they count once; the other counter's are not sent again.
    cli(redis.port, &["del", &bad_redis]).unwrap();
    // A copy of the batch that named it failed (a replay, or a duplicate on its way) counts
    // nothing now that it could be read: its units are the node's to send again, once.
    let (status, _) = Http(&store.addr).call(&batch(1));
    assert_eq!(status, 409, "a batch answered with a failed counter is closed");
    let again = SyncRequest { deltas: vec![Delta { key: bad.clone(), limit: big(), units: 3 }], ..batch(2) };
    let (status, resp) = Http(&store.addr).call(&again);
    assert_eq!((status, resp.unwrap().failed), (200, vec![]));
    assert_eq!((counted(&store.addr, &bad, 2), counted(&store.addr, &good, 3)), (3, 4));
    // A key of another type where a counter would be: as unreadable, on a single server and
    // on a Cluster alike (where the one-call-per-batch path is not taken).
    let cluster = Cluster::start().unwrap();
    let on_cluster = StoreProcess::start(&cluster.urls(), true);
    for (addr, port) in [(&store.addr, redis.port), (&on_cluster.addr, 0)] {
        let other = key(&run, &format!("hash{port}"));
        let other_redis = format!("rw:{{{}}}", hex(&other));
        let hset = ["-c", "hset", &other_redis, "f", "v"];
        match port {
            0 => assert!(cluster.urls().iter().any(|u| {
                let p: u16 = u.rsplit(':').next().unwrap().parse().unwrap();
                cli(p, &hset).unwrap().trim() == "1"
            })),
            p => assert_eq!(cli(p, &hset[1..]).unwrap().trim(), "1"),
        }
        let fresh = key(&run, &format!("fresh{port}"));
        let req = SyncRequest {
            node: 2,
            seq: 1 + u64::from(port),
            sent: 0,
            deltas: vec![
                Delta { key: other, limit: big(), units: 3 },
                Delta { key: fresh.clone(), limit: big(), units: 5 },
            ],
            ask: false,
        };
        let (status, resp) = Http(addr).call(&req);
        assert_eq!((status, resp.map(|r| r.failed)), (200, Some(vec![0])), "{addr}");
        assert_eq!(counted(addr, &fresh, 10 + u64::from(port)), 5);
    }
}

#[test]
fn unsigned_forged_malformed_and_oversized_calls_are_refused() {
    let redis = Redis::start(false).unwrap();
    let store = StoreProcess::start(&[redis.url()], false);
    let req = SyncRequest {
        node: 1,
        seq: 1,
        sent: wall_clock(),
        deltas: vec![Delta { key: b"k".to_vec(), limit: big(), units: 1 }],
        ask: false,
    };
    let body = req.encode();
    assert_eq!(post(&store.addr, &body, None).status, 401, "unsigned");
    assert_eq!(post(&store.addr, &body, Some(&hex(&sign(b"another secret", &body)))).status, 401, "forged");
    // Another method or path: a plain-text reason too.
    for (method, path, status) in [("GET", "/v1/sync", 405), ("POST", "/v1/sync/", 404), ("GET", "/nothing", 404)] {
        let r = http::request(&store.addr, method, path, &[], &[]).unwrap();
        assert_eq!(r.status, status, "{method} {path}");
        assert!(!r.text().is_empty(), "{method} {path}: a reason");
        if status == 405 {
            assert!(r.headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("allow") && v == "POST"), "{:?}", r.headers);
        }
    }
    assert_eq!(post(&store.addr, &body, Some(&"0".repeat(64))).status, 401, "a well-formed wrong signature");
    // Two signature fields, a good one among them: refused, as the Worker refuses them.
    let good = hex(&sign(SECRET.as_bytes(), &body));
    let bad = "0".repeat(64);
    for pair in [[good.as_str(), bad.as_str()], [bad.as_str(), good.as_str()], [good.as_str(), good.as_str()]] {
        let headers = pair.map(|v| ("x-ratewall-signature", v));
        let r = http::request(&store.addr, "POST", "/v1/sync", &headers, &body).unwrap();
        assert_eq!(r.status, 401, "{pair:?}");
    }
    let garbage = b"\x02\x01garbage";
    assert_eq!(post(&store.addr, garbage, Some(&hex(&sign(SECRET.as_bytes(), garbage)))).status, 400, "signed garbage");
    for other in [&b"hello"[..], b"{\"x\":1}"] {
        assert_eq!(post(&store.addr, other, Some(&hex(&sign(SECRET.as_bytes(), other)))).status, 400, "no batch");
    }
    let mut trailing = body.clone();
    trailing.push(0);
    assert_eq!(post(&store.addr, &trailing, Some(&hex(&sign(SECRET.as_bytes(), &trailing)))).status, 400);
    let huge = vec![0u8; (1 << 20) + 10];
    let r = post(&store.addr, &huge, Some(&hex(&sign(SECRET.as_bytes(), &huge))));
    assert_eq!(r.status, 413, "over 1 MiB");
    assert!(r.text().contains("a body is at most 1048576 bytes"), "{}", r.text());
    // A client that sends its whole body before it reads (as most do) reads the 413: the body
    // is read on and thrown away. (Answered with it unread, the connection was closed under
    // the client's writes and the answer lost.)
    let four_mib = vec![0u8; 4 << 20];
    for _ in 0..5 {
        assert_eq!(post(&store.addr, &four_mib, Some("00")).status, 413);
    }
    // Declared past what is read on: refused at once, before any of the body is sent.
    let mut raw = std::net::TcpStream::connect(&store.addr).unwrap();
    raw.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
    std::io::Write::write_all(&mut raw, b"POST /v1/sync HTTP/1.1\r\nhost: s\r\ncontent-length: 99999999\r\n\r\n")
        .unwrap();
    let mut head = [0u8; 12];
    std::io::Read::read_exact(&mut raw, &mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 413");
    let old = version_1_batch(1, 1, b"k", 1);
    let r = post(&store.addr, &old, Some(&hex(&sign(SECRET.as_bytes(), &old))));
    assert_eq!(r.status, 415, "the previous protocol version");
    assert!(r.text().contains("version 1 (requests without a time) is not spoken here"), "{}", r.text());
    let many = SyncRequest {
        node: 1,
        seq: 1,
        sent: wall_clock(),
        deltas: (0..501).map(|i| Delta { key: format!("k{i}").into_bytes(), limit: big(), units: 1 }).collect(),
        ask: false,
    }
    .encode();
    assert_eq!(post(&store.addr, &many, Some(&hex(&sign(SECRET.as_bytes(), &many)))).status, 413, "over 500 counters");
    // Every refusal is counted, the body cut off at the listener's limit included.
    let metrics = store.get("/metrics").text();
    assert!(metrics.contains("ratewall_store_sync_failed_total{status=\"413\"} 8\n"), "{metrics}");
    // None of it counted anything, and the store still serves.
    assert_eq!(counted(&store.addr, b"k", 1), 0);
}

#[test]
fn a_three_primary_cluster_holds_counters_over_its_slots() {
    let cluster = Cluster::start().unwrap();
    let (a, b) = (StoreProcess::start(&cluster.urls(), true), StoreProcess::start(&cluster.urls(), true));
    let run = format!("x{}", std::process::id());
    let keys: Vec<Vec<u8>> = (0..30).map(|i| key(&run, &format!("k{i}"))).collect();
    let acked = load(&[&a.addr, &b.addr], &keys, 6, 8, 500);
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(counted(&a.addr, k, 1 + i as u64), acked);
    }
    // The counters are spread over all three primaries.
    let per_node: Vec<u64> =
        cluster.nodes.iter().map(|n| cli(n.port, &["dbsize"]).unwrap().trim().parse().unwrap()).collect();
    assert!(per_node.iter().all(|&n| n > 0), "{per_node:?}");
    assert_eq!(a.get("/healthz").status, 200);
    // A Cluster node taken for a single server (no --cluster): unhealthy, and the log says why,
    // rather than some batches counting and others failing on MOVED.
    for url in cluster.urls() {
        unhealthy_saying(&[url], false, "start the store with --cluster");
    }
}

/// A single server taken for a Cluster (--cluster): the log says to start without it.
#[test]
fn a_single_server_taken_for_a_cluster_is_said_to_be_one() {
    let redis = Redis::start(false).unwrap();
    unhealthy_saying(&[redis.url()], true, "start the store without --cluster");
}

/// A store started on `redis` (a Cluster's nodes with `cluster`) answers `/healthz` 503 and
/// its log says `what`.
fn unhealthy_saying(redis: &[String], cluster: bool, what: &str) {
    let store = StoreProcess::start(redis, cluster);
    assert_eq!(store.get("/healthz").status, 503);
    let log = store.logged_once_it_says(what);
    assert!(log.contains(what), "{log}");
}

/// End to end, past the quota: three filter nodes on one counter, syncing over real HTTP to
/// ratewall-store on Redis, offered 3× the limit — no request waits for the store, and the
/// fleet admits within the written bound (docs/sync-protocol.md, "The error bound").
#[test]
fn filter_nodes_past_the_quota_decide_at_once_within_the_written_bound() {
    use ratewall_tests::sim::{bound_pct, past_the_quota, run_with, Backend};
    let redis = Redis::start(false).unwrap();
    let store = StoreProcess::start_with(ratewall_tests::sim::SECRET, &[redis.url()], false);
    let s = past_the_quota("store_past_the_quota");
    let r = run_with(&s, &Backend::Http(&store.addr)).unwrap();
    println!("{r:?}");
    assert_eq!(r.paused_pct, 0.0, "no request waited: {r:?}");
    assert!(r.overadmission_max_pct <= bound_pct(&s), "over the bound {:.1} %: {r:?}", bound_pct(&s));
    assert!(r.admitted >= 108, "the fleet admitted about the limit in each window: {r:?}");
}

/// End to end, a node cut off: three filter nodes syncing over real HTTP to ratewall-store on
/// Redis, the busiest of them unable to reach it from the second window on — the store holds
/// its part of the quota, so the other two do not admit it again.
#[test]
fn a_filter_node_cut_off_from_the_store_has_its_part_held() {
    use ratewall_tests::sim::{cut_off, run_with, Backend};
    let redis = Redis::start(false).unwrap();
    let store = StoreProcess::start_with(ratewall_tests::sim::SECRET, &[redis.url()], false);
    let r = run_with(&cut_off("store_cut_off"), &Backend::Http(&store.addr)).unwrap();
    println!("{r:?}");
    // Without the hold, 13 % on average and 20 % in the worst window (the reference store).
    assert!(r.overadmission_pct <= 6.0, "{r:?}");
    assert!(r.overadmission_max_pct <= 10.0, "{r:?}");
    // Past its share the node cut off denies on its own, though the fleet may be under the
    // limit: these runs are paced in real time, so the figure moves between runs — 8.6–10.8 %
    // in most, 20.6 % in about one of four (with the store of the commit before as well),
    // as when the node keeps to a smaller cap than its measured share; not traced further.
    assert!(r.false_denial_pct <= 25.0, "{r:?}");
}

/// End to end, a client whose connection moves from node to node: the node it left is
/// silent on its counter as a node cut off is, but Redis's registry still hears it, so the
/// store holds nothing for it and the client keeps its limit.
#[test]
fn a_client_that_moves_between_filter_nodes_keeps_its_limit() {
    use ratewall_tests::sim::{bound_pct, moving_client, run_with, Backend};
    let redis = Redis::start(false).unwrap();
    let store = StoreProcess::start_with(ratewall_tests::sim::SECRET, &[redis.url()], false);
    let s = moving_client("store_moving_client");
    let r = run_with(&s, &Backend::Http(&store.addr)).unwrap();
    println!("{r:?}");
    // With its part held as a node cut off's, 169 of the 240 the limit allows; without, 220
    // (the rest are a node new to the counter late in a window denying on its overdraft
    // until its grant comes).
    assert!(r.admitted >= 200, "about the limit in each window: {r:?}");
    assert!(r.overadmission_max_pct <= bound_pct(&s), "{r:?}");
}

/// End to end: filter nodes (the built filter in the wasmtime host) sync over real HTTP to
/// ratewall-store on Redis; the fleet holds one global limit, as it does against the Worker.
#[test]
fn filter_nodes_syncing_to_the_store_share_one_global_limit() {
    use ratewall_tests::sim::{end_to_end, rules, run_with, Backend};
    let redis = Redis::start(false).unwrap();
    // The simulation signs with its own secret.
    let store = StoreProcess::start_with(ratewall_tests::sim::SECRET, &[redis.url()], false);
    let s = end_to_end("store_e2e");
    let _ = rules(&s);
    let r = run_with(&s, &Backend::Http(&store.addr)).unwrap();
    println!("{r:?}");
    // Without sync, 3 nodes would admit up to 3 × 40 per user: 200% over.
    assert!(r.overadmission_max_pct <= 7.5, "at most 3 units over a limit of 40: {r:?}");
    assert!(r.calls_per_node_per_sec > 1.0, "the nodes synced: {r:?}");
}

#[test]
fn the_node_registry_keeps_at_most_its_most_nodes_the_longest_unheard_forgotten() {
    let redis = Redis::start(false).unwrap();
    let now_ms = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis().to_string();
    // The registry script as the store runs it, remembering at most 3 nodes.
    let heard = |node: &str| {
        let mut args = vec!["EVAL", ratewall_store::REGISTRY, "4"];
        args.extend(ratewall_store::REGISTRY_KEYS);
        let sent = now_ms();
        args.extend([node, "00000000000000000001", "1", "2000", "60000", &sent, "25000", "1000", "0", "1000", "3"]);
        cli(redis.port, &args).unwrap()
    };
    for node in ["1", "2", "3", "4", "5"] {
        heard(node);
        std::thread::sleep(Duration::from_millis(3));
    }
    let seen = cli(redis.port, &["ZRANGE", ratewall_store::REGISTRY_KEYS[1], "0", "-1"]).unwrap();
    assert_eq!(seen.split_whitespace().collect::<Vec<_>>(), ["3", "4", "5"], "{seen}");
    let seqs = cli(redis.port, &["HKEYS", ratewall_store::REGISTRY_KEYS[0]]).unwrap();
    let mut seqs: Vec<&str> = seqs.split_whitespace().collect();
    seqs.sort_unstable();
    assert_eq!(seqs, ["3", "4", "5"]);
}

/// Batches that name one counter at once are applied together, one compare-and-swap for all
/// that wait, and each is counted once, its retries too: with a write each, 200 at once on one
/// hot counter queued past the deadline and most were answered 503 with Redis healthy.
#[test]
fn many_batches_at_once_on_one_counter_are_written_together_and_counted_once() {
    let redis = Redis::start(false).unwrap();
    let store = StoreProcess::start(&[redis.url()], false);
    let k = key(&format!("g{}", std::process::id()), "hot");
    let writes = || -> u64 {
        let m = store.get("/metrics").text();
        m.lines().find_map(|l| l.strip_prefix("ratewall_store_state_writes_total ")).unwrap().parse().unwrap()
    };
    let before = writes();
    let senders = 200u64;
    let barrier = std::sync::Barrier::new(senders as usize);
    let acked: u64 = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..senders)
            .map(|sender| {
                let (k, addr, barrier) = (&k, &store.addr, &barrier);
                scope.spawn(move || {
                    let req = SyncRequest {
                        node: 20_000 + sender,
                        seq: 1,
                        sent: 0,
                        deltas: vec![Delta { key: k.clone(), limit: big(), units: 1 + sender % 3 }],
                        ask: false,
                    };
                    barrier.wait();
                    // A batch past the deadline (a machine busy with more than this test) is
                    // sent again, as a node sends it: the same seq, counted once.
                    let mut status = Http(addr).call(&req).0;
                    for _ in 0..40 {
                        if status != 503 {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(50));
                        status = Http(addr).call(&req).0;
                    }
                    assert_eq!(status, 200, "a healthy Redis answers every batch");
                    1 + sender % 3
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    let written = writes() - before;
    assert!(written < senders, "{written} writes for {senders} batches on one counter");
    assert_eq!(counted(&store.addr, &k, 1), acked);
}
