//! `ratewall-gateway`: ratewall running locally. An HTTP/1.1 server on 127.0.0.1 whose every
//! request goes through the built filter (`dist/ratewall_filter.wasm`) in the wasmtime
//! proxy-wasm host — several worker VMs sharing one node's counters, as in Envoy — and, when
//! admitted, to a small built-in demo origin or to `--upstream`, an HTTP/1.1 origin of the
//! user's (a request a leaky bucket queues is forwarded
//! when the filter resumes it in its turn, while its worker serves others). Each connection's
//! request is read on a thread of its own, and the worker VMs take only complete requests, so
//! a slow or idle client holds up no worker. The rules file is watched and pushed to the VMs
//! when it changes, as an xDS config push would be; a bad file is rejected and the last good
//! rules stay.
//!
//! `ratewall-gateway [--rules FILE] [--port N] [--workers N] [--store HOST:PORT]... [--wasm FILE]
//! [--upstream HOST:PORT]` (default port 8080, or a free one when 8080 is taken; `--port 0` always picks a free one;
//! the filter from `--wasm`, else `dist/ratewall_filter.wasm` under the working directory, else
//! the build tree's). With
//! `--store` (a ratewall-store, or the Worker's sync endpoint) and a `sync` section in the
//! rules, the gateway is one node of a fleet: its VMs tick, and their sync calls go over HTTP
//! to the stores (the next one when one fails), as Envoy sends them to the sync cluster.

use ratewall_host::{FilterResult, Forward, HttpRequest, Node, Plugin, Profile, Started, Vm};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use upstream::{Outbound, Upstreamed, UPSTREAM_TIMEOUT};

mod upstream;

const USAGE: &str =
    "usage: ratewall-gateway [--rules FILE] [--port N] [--workers N] [--store HOST:PORT]... [--wasm FILE] [--upstream HOST:PORT] [--host envoy|nginx]
  --rules FILE       the rules document, watched and pushed on change (default examples/rules.json)
  --wasm FILE        the built filter (default dist/ratewall_filter.wasm here, else the build tree's)
  --port N           the port on 127.0.0.1 (not given: 8080, or a free one when 8080 is taken; 0: a
                     free one; a port given that is taken is an error)
  --workers N        worker VMs sharing the node's counters, 1 to 64 (default 2)
  --store HOST:PORT  a ratewall-store, or the Worker's sync endpoint, this node syncs to (with a
                     `sync` section in the rules); several: the next when one fails
  --upstream HOST:PORT  the HTTP/1.1 origin admitted requests go to (default: a built-in demo
                     origin that answers at once); a request is in flight until its response
                     is sent, as a concurrency limit counts it
  --host envoy|nginx  the proxy whose proxy-wasm rules the host follows (default envoy): nginx is
                     ngx_wasm_module's (shared data, ticks, http calls as it runs them), and a
                     rules change is a reload: fresh VMs and counters, as `nginx -s reload`";

struct Args {
    rules: String,
    port: Option<u16>,
    workers: usize,
    stores: Vec<String>,
    wasm: Option<String>,
    upstream: Option<String>,
    profile: Profile,
}

/// Most worker VMs (each a wasm instance and a thread).
const MAX_WORKERS: usize = 64;

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        rules: "examples/rules.json".into(),
        port: None,
        workers: 2,
        stores: Vec::new(),
        wasm: None,
        upstream: None,
        profile: Profile::Envoy,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--rules" => a.rules = value()?,
            "--port" => a.port = Some(value()?.parse().map_err(|e| format!("--port: {e}"))?),
            "--workers" => {
                let v = value()?;
                a.workers =
                    v.parse().ok().filter(|n| (1..=MAX_WORKERS).contains(n)).ok_or_else(|| {
                        format!("--workers: {v:?} is not a number of worker VMs from 1 to {MAX_WORKERS}")
                    })?;
            }
            "--store" => a.stores.push(value()?),
            "--wasm" => a.wasm = Some(value()?),
            "--upstream" => a.upstream = Some(value()?),
            "--host" => {
                a.profile = match value()?.as_str() {
                    "envoy" => Profile::Envoy,
                    "nginx" => Profile::NGINX,
                    other => return Err(format!("--host: {other:?} is neither envoy nor nginx")),
                }
            }
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    Ok(a)
}

/// Logs to stderr, ignoring write errors: a closed stderr must not take the gateway down.
fn log(message: &str) {
    let _ = writeln!(std::io::stderr(), "ratewall-gateway: {message}");
}

fn wall_clock() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// The current rules document and its generation, shared by the workers, and the node the
/// VMs of that generation run on (under NGINX a reload brings a node of its own: its VMs'
/// shared data starts empty, while the VMs before it keep theirs to the end of the requests
/// they hold, as NGINX's old workers keep the old zone).
struct Rules {
    document: Mutex<Vec<u8>>,
    generation: AtomicU64,
    node: Mutex<Node>,
}

impl Rules {
    fn node(&self) -> Node {
        self.node.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

fn main() {
    if std::env::args().skip(1).any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return;
    }
    if let Err(e) = serve() {
        log(&e);
        std::process::exit(1);
    }
}

fn serve() -> Result<(), String> {
    let args = parse_args()?;
    let document = std::fs::read(&args.rules).map_err(|e| format!("{}: {e}", args.rules))?;
    match ratewall_core::Config::parse(&document) {
        Err(e) => return Err(format!("{}: {e}", args.rules)),
        // Rules that sync with no store to sync to: every call fails, and `closed` rules
        // answer 503. Said, not refused: the gateway serves on (open rules on their share).
        Ok(c) if c.sync.is_some() && args.stores.is_empty() => log(&format!(
            "{}: the rules have a sync section but no --store was given: every sync fails, and \
             closed rules answer 503 (give --store HOST:PORT, or drop the section)",
            args.rules
        )),
        // A store given to rules that do not sync: each gateway limits on its own.
        Ok(c) if c.sync.is_none() && !args.stores.is_empty() => log(&format!(
            "{}: --store was given but the rules have no sync section: nothing is synced, and each \
             gateway holds the limits on its own (add a sync section: docs/sync-protocol.md)",
            args.rules
        )),
        Ok(_) => {}
    }
    let plugin = filter(args.wasm.as_deref())?;
    let node = Node::with_profile(wall_clock(), args.profile);
    let rules = Arc::new(Rules {
        document: Mutex::new(document),
        generation: AtomicU64::new(0),
        node: Mutex::new(node.clone()),
    });
    // The default port is 8080; when it is taken, any free port (the address is printed).
    let listener = match args.port {
        Some(port) => TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("127.0.0.1:{port}: {e}"))?,
        None => TcpListener::bind(("127.0.0.1", 8080))
            .or_else(|_| TcpListener::bind(("127.0.0.1", 0)))
            .map_err(|e| format!("127.0.0.1: {e}"))?,
    };
    let addr = listener.local_addr().map_err(|e| e.to_string())?;

    // Each connection's request is read and parsed on a thread of its own, so a slow or idle
    // client holds only that thread; the worker VMs take complete requests from the queue
    // and keep ticking meanwhile.
    let queue = Arc::new(Queue::default());
    for w in 0..args.workers {
        let doc = rules.document.lock().map_err(|e| e.to_string())?.clone();
        let vm = Vm::start(&plugin, &node, &doc).map_err(|e| format!("worker {w}: {e}"))?;
        let (queue, rules, stores) = (Arc::clone(&queue), Arc::clone(&rules), args.stores.clone());
        let (upstream, plugin) = (args.upstream.clone(), plugin.clone());
        std::thread::Builder::new()
            .name(format!("worker-{w}"))
            .spawn(move || work(w, vm, (&queue, &rules), &stores, (&plugin, upstream.as_deref())))
            .map_err(|e| format!("worker {w}: {e}"))?;
    }
    watch(args.rules.clone(), Arc::clone(&rules));

    // Written with errors ignored: a closed stdout must not take the gateway down.
    let banner = format!(
        "ratewall is running at http://{addr}  (rules: {}, {} worker VM{}, origin: {})\n\
         \x20 the RateLimit fields:  curl -si http://{addr}/v1/things -H 'x-api-key: demo'\n\
         \x20 a 429 after 10 logins: for i in $(seq 11); do curl -s -o /dev/null -w '%{{http_code}} ' -X POST http://{addr}/v1/auth/login; done; echo\n\
         \x20 metrics:               curl -s http://{addr}/_ratewall/metrics\n\
         Ctrl-C stops it.\n",
        args.rules,
        args.workers,
        if args.workers == 1 { "" } else { "s" },
        args.upstream.as_deref().map_or_else(|| "the built-in demo".to_owned(), |u| format!("http://{u}"))
    );
    let mut out = std::io::stdout();
    let _ = out.write_all(banner.as_bytes()).and_then(|_| out.flush());
    let reading = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming().flatten() {
        accept(stream, &queue, &rules.node(), &reading);
    }
    Ok(())
}

/// One worker VM's loop: runs the requests it takes from the queue through the filter, ticks
/// at the filter's period, gives back the turns of waiting requests whose client went away,
/// answers the waiting requests the filter resumed, and the upstream's answers. Under NGINX a
/// rules change is a reload: a fresh VM takes the new requests, and the one before serves the
/// requests it holds to their end, as an old NGINX worker does.
fn work<'a>(
    w: usize,
    vm: Vm,
    (queue, rules): (&Arc<Queue>, &Rules),
    stores: &[String],
    (plugin, upstream): (&Plugin, Option<&'a str>),
) {
    let origin = || -> Origin<'a> { Origin { upstream, inbox: Arc::default(), queue: Arc::clone(queue) } };
    let mut current = Served::new(vm, rules.node(), origin());
    let mut draining: Vec<Served> = Vec::new();
    let mut seen = 0;
    // The rules pushed since this VM was last configured, if any (as an xDS push reaches a
    // proxy's VMs before the next request they handle; a reload, NGINX's new workers).
    let mut configure = |current: &mut Served<'a>, draining: &mut Vec<Served<'a>>| {
        let generation = rules.generation.load(Ordering::SeqCst);
        if generation == seen {
            return;
        }
        seen = generation;
        let Ok(doc) = rules.document.lock().map(|d| d.clone()) else { return };
        if !current.node.profile().is_nginx() {
            let _ = current.vm.configure(&doc);
            return;
        }
        let node = rules.node();
        match Vm::start(plugin, &node, &doc) {
            Ok(vm) => {
                let old = std::mem::replace(current, Served::new(vm, node, origin()));
                if old.holds_requests() {
                    draining.push(old);
                }
            }
            Err(e) => log(&format!("worker {w}: the reload's VM did not start, the previous one serves on: {e}")),
        }
    };
    loop {
        configure(&mut current, &mut draining);
        // With a tick period (sync on, or rules that shape), wait for a request at most until
        // the next tick is due; with requests held, at most until their connections are
        // looked at again.
        let period = current.period();
        let mut wait = (!period.is_zero()).then(|| period.saturating_sub(current.last_tick.elapsed()));
        if current.holds_requests() || !draining.is_empty() {
            wait = Some(wait.map_or(RECHECK, |d| d.min(RECHECK)));
        }
        let answered = || current.origin.inbox.has_answers() || draining.iter().any(|d| d.origin.inbox.has_answers());
        if let Some(request) = queue.pop(wait, &answered) {
            // A push made while this worker waited applies to the request that woke it.
            configure(&mut current, &mut draining);
            current.node.set_time(wall_clock());
            match handle(&mut current.vm, request, stores, &current.origin) {
                Ok(Next::Waiting(paused)) => current.waiting.push(paused),
                Ok(Next::Flying(f)) => current.flying.push(f),
                Ok(Next::Answered) => {}
                Err(e) => log(&format!("worker {w}: {e}")),
            }
        }
        current.step(w, stores);
        for old in &mut draining {
            old.step(w, stores);
        }
        draining.retain(Served::holds_requests);
        // What the filter logs, as a proxy writes its log: the VMs share their node's.
        for node in std::iter::once(&current.node).chain(draining.iter().map(|d| &d.node)) {
            for (level, line) in node.take_logs() {
                log(&format!("filter ({}): {line}", level_name(level)));
            }
        }
    }
}

/// A worker VM and the requests it holds: paused until their turn (a leaky bucket's queue),
/// answered when the filter resumes them from its tick, as Envoy forwards them then; and sent
/// to the upstream, until its answer is sent on or their client goes away.
struct Served<'a> {
    vm: Vm,
    node: Node,
    origin: Origin<'a>,
    waiting: Vec<Waiting>,
    flying: Vec<Flying>,
    last_tick: Instant,
}

impl<'a> Served<'a> {
    /// A VM on `node` that holds no request yet.
    fn new(vm: Vm, node: Node, origin: Origin<'a>) -> Served<'a> {
        Served { vm, node, origin, waiting: Vec::new(), flying: Vec::new(), last_tick: Instant::now() }
    }

    fn holds_requests(&self) -> bool {
        !self.waiting.is_empty() || !self.flying.is_empty()
    }

    /// The filter's tick period (zero: none).
    fn period(&self) -> Duration {
        Duration::from_millis(u64::from(self.vm.tick_period_ms()))
    }

    /// Ticks when due, and moves the requests it holds on.
    fn step(&mut self, w: usize, stores: &[String]) {
        let period = self.period();
        if !period.is_zero() && self.last_tick.elapsed() >= period {
            self.last_tick = Instant::now();
            self.node.set_time(wall_clock());
            if let Err(e) = self.vm.tick().and_then(|_| exchange(&mut self.vm, stores)) {
                log(&format!("worker {w}: tick: {e}"));
            }
        }
        let waiting = leave(&mut self.vm, std::mem::take(&mut self.waiting), w);
        self.waiting = resume(&mut self.vm, waiting, w, &self.origin, &mut self.flying);
        self.flying = landed(&mut self.vm, std::mem::take(&mut self.flying), &self.origin, w);
    }
}

/// A proxy-wasm log level's name.
fn level_name(level: i32) -> &'static str {
    match level {
        0 => "trace",
        1 => "debug",
        2 => "info",
        3 => "warn",
        4 => "error",
        _ => "critical",
    }
}

/// Requests read and parsed, waiting for a worker VM: any worker takes the next one.
#[derive(Default)]
struct Queue {
    requests: Mutex<VecDeque<Request>>,
    /// The bytes of the queued requests' bodies (changed under the lock of `requests`).
    bytes: AtomicUsize,
    ready: Condvar,
}

/// Most requests waiting for a worker VM, and most bytes of their bodies: past either, a
/// request read whole gets a 503 (the workers are behind), so memory stays bounded however
/// fast requests come.
const MAX_QUEUED: usize = 4096;
const MAX_QUEUED_BYTES: usize = 64 << 20;

impl Queue {
    /// Queues `request` for a worker; given back when the queue is full.
    fn push(&self, request: Request) -> Option<Request> {
        let mut requests = self.requests.lock().unwrap_or_else(PoisonError::into_inner);
        let size = request.body.as_ref().map_or(0, Vec::len);
        let bytes = self.bytes.load(Ordering::SeqCst);
        if requests.len() >= MAX_QUEUED || bytes.saturating_add(size) > MAX_QUEUED_BYTES {
            return Some(request);
        }
        self.bytes.store(bytes + size, Ordering::SeqCst);
        requests.push_back(request);
        drop(requests);
        self.ready.notify_one();
        None
    }

    /// Wakes the workers waiting for a request, for them to look at their upstream answers.
    fn wake(&self) {
        let _held = self.requests.lock().unwrap_or_else(PoisonError::into_inner);
        self.ready.notify_all();
    }

    /// The next request, waiting for one at most `wait` (`None`: as long as it takes), or
    /// none as soon as `woken` holds (looked at under the queue's lock, which [`Queue::wake`]
    /// takes: no wake is missed).
    fn pop(&self, wait: Option<Duration>, woken: &dyn Fn() -> bool) -> Option<Request> {
        let deadline = wait.and_then(|w| Instant::now().checked_add(w));
        let mut requests = self.requests.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(request) = requests.pop_front() {
                let size = request.body.as_ref().map_or(0, Vec::len);
                self.bytes.store(self.bytes.load(Ordering::SeqCst).saturating_sub(size), Ordering::SeqCst);
                return Some(request);
            }
            if woken() {
                return None;
            }
            requests = match (wait, deadline) {
                (None, _) => self.ready.wait(requests).unwrap_or_else(PoisonError::into_inner),
                (Some(_), Some(deadline)) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    self.ready.wait_timeout(requests, left).unwrap_or_else(PoisonError::into_inner).0
                }
                (Some(_), None) => return None,
            };
        }
    }
}

/// At most this many connections are read at once; beyond, a connection gets a 503. Each is
/// a thread meanwhile (with a small stack, [`SMALL_STACK`]): a client that opens many and
/// sends nothing holds them until the head's 10 s are over.
const MAX_READING: usize = 4096;

/// The stack of a thread that only reads, parses and writes HTTP (the OS default is 8 MiB of
/// address space each).
const SMALL_STACK: usize = 256 * 1024;

/// Starts reading a new connection's request on a thread of its own, which hands it to the
/// queue once complete (or answers it itself: a malformed request, the metrics).
fn accept(mut stream: TcpStream, queue: &Arc<Queue>, node: &Node, reading: &Arc<AtomicUsize>) {
    if reading.fetch_add(1, Ordering::SeqCst) >= MAX_READING {
        reading.fetch_sub(1, Ordering::SeqCst);
        let _ = respond(&mut stream, 503, &[], b"too many connections\n");
        return;
    }
    let (queue, node, count) = (Arc::clone(queue), node.clone(), Arc::clone(reading));
    let spawned = std::thread::Builder::new().name("reader".into()).stack_size(SMALL_STACK).spawn(move || {
        let head = read_request(stream);
        count.fetch_sub(1, Ordering::SeqCst);
        match head {
            Head::Request(mut r) if r.path.split('?').next() == Some("/_ratewall/metrics") => {
                // Prometheus text, each metric typed as the filter defined it.
                let mut text = String::new();
                for m in node.metrics() {
                    let kind = match m.kind {
                        0 => "counter",
                        1 => "gauge",
                        _ => "untyped",
                    };
                    text.push_str(&format!("# TYPE {} {kind}\n{} {}\n", m.name, m.name, m.value));
                }
                let content_type = "text/plain; version=0.0.4; charset=utf-8";
                let _ = respond(&mut r.stream, 200, &[("content-type".into(), content_type.into())], text.as_bytes());
            }
            Head::Request(r) => {
                if let Some(mut r) = queue.push(r) {
                    let text = b"the gateway's workers are behind: too many requests wait for one\n";
                    let _ = respond(&mut r.stream, 503, &[("retry-after".into(), "1".into())], text);
                }
            }
            Head::Refused(mut stream, status, body) => {
                if respond(&mut stream, status, &[], body.as_bytes()).is_ok() {
                    linger(stream);
                }
            }
            Head::Gone => {}
        }
    });
    if let Err(e) = spawned {
        reading.fetch_sub(1, Ordering::SeqCst);
        log(&format!("reading a connection: {e}"));
    }
}

/// The filter: `--wasm`'s file, else `dist/ratewall_filter.wasm` under the working directory
/// (a copy of the binary and `dist/` run anywhere), else the build tree's.
fn filter(wasm: Option<&str>) -> Result<Plugin, String> {
    let here = std::path::Path::new("dist/ratewall_filter.wasm");
    let path = match wasm {
        Some(p) => std::path::PathBuf::from(p),
        None if here.is_file() => here.to_path_buf(),
        None => return Plugin::filter().map_err(|e| e.to_string()),
    };
    let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    Plugin::from_bytes(&bytes).map_err(|e| format!("{}: {e:#}", path.display()))
}

/// How often the rules file is read for changes.
const WATCH_EVERY: Duration = Duration::from_millis(250);

/// How long a rules file that does not parse must stay as it is before it is said to be
/// rejected: a file being written reads as bad for a moment (`gen > rules.json` empties it
/// first, then writes once the generator has run).
const SETTLE: Duration = Duration::from_secs(1);

/// Polls the rules file and publishes a new generation when it changes and parses.
fn watch(path: String, rules: Arc<Rules>) {
    std::thread::spawn(move || {
        let mut last = std::fs::read(&path).unwrap_or_default();
        // A content that did not parse, and since when the file has held it.
        let mut bad: Option<(Vec<u8>, std::time::Instant)> = None;
        // Said once while the file cannot be read (removed, or its rights taken away).
        let mut unreadable = false;
        loop {
            std::thread::sleep(WATCH_EVERY);
            let doc = match std::fs::read(&path) {
                Ok(doc) => doc,
                Err(e) => {
                    if !unreadable {
                        log(&format!("{path} cannot be read, keeping the previous rules: {e}"));
                    }
                    unreadable = true;
                    continue;
                }
            };
            if std::mem::take(&mut unreadable) && doc == last {
                log(&format!("{path} can be read again; its rules are the ones in force"));
            }
            if doc == last {
                // Back to the rules in force: a bad content seen on the way is forgotten (else
                // the same passing state, met again later, was said rejected at once).
                bad = None;
                continue;
            }
            // Taken once it reads the same twice, not while an editor is still writing it.
            std::thread::sleep(WATCH_EVERY / 5);
            if std::fs::read(&path).ok().as_ref() != Some(&doc) {
                continue;
            }
            match ratewall_core::Config::parse(&doc) {
                Ok(_) => {
                    (last, bad) = (doc.clone(), None);
                    if let Ok(mut d) = rules.document.lock() {
                        *d = doc;
                    }
                    // Under NGINX, a reload: the new VMs' node, its shared data empty.
                    let current = rules.node();
                    if current.profile().is_nginx() {
                        let fresh = Node::with_profile(wall_clock(), current.profile());
                        *rules.node.lock().unwrap_or_else(PoisonError::into_inner) = fresh;
                    }
                    rules.generation.fetch_add(1, Ordering::SeqCst);
                    log(&format!("{path} changed; rules reloaded"));
                }
                Err(e) => match &bad {
                    Some((held, since)) if *held == doc => {
                        if since.elapsed() >= SETTLE {
                            (last, bad) = (doc, None);
                            log(&format!("{path} rejected, keeping the previous rules: {e}"));
                        }
                    }
                    _ => bad = Some((doc, std::time::Instant::now())),
                },
            }
        }
    });
}

/// Makes the HTTP calls the VM dispatched (sync batches, asks) to the stores, the next store
/// when one fails, and delivers each answer (signature header included) to the VM.
fn exchange(vm: &mut Vm, stores: &[String]) -> ratewall_host::Result<()> {
    for c in vm.take_callouts() {
        let tag =
            c.headers.iter().find(|(k, _)| k == "x-ratewall-signature").map(|(_, v)| v.clone()).unwrap_or_default();
        let tag = String::from_utf8_lossy(&tag).into_owned();
        let path = c
            .headers
            .iter()
            .find(|(k, _)| k == ":path")
            .map_or("/v1/sync".into(), |(_, v)| String::from_utf8_lossy(v).into_owned());
        let headers = [("x-ratewall-signature", tag.as_str()), ("content-type", "application/octet-stream")];
        // An ask answered 503 is not sent to the next store: that store may have taken it all
        // the same (its deadline passed at Redis after the write), and the next refuses its
        // number as answered already (409). One that had no answer goes on, as an Envoy
        // cluster's retry on a connection failure would: with one of two stores dead, half
        // the asks failed, and a `closed` rule answered 503 to 9 requests in 10 with the
        // other store healthy (should the dead store have taken it, the next store's 409 is
        // decided on what the node holds). A batch is tried on the next store either way: its
        // `seq` makes a second send count nothing twice.
        let ask = ratewall_core::sync::SyncRequest::decode_prefix(&c.body).is_ok_and(|(r, _)| r.ask);
        let answer = answer_from((stores.len(), c.token as usize, !ask), |i| {
            let within = Duration::from_millis(u64::from(c.timeout_ms.max(1)));
            ratewall_host::http::request_within(stores.get(i)?, ("POST", &path), &headers, &c.body, within).ok()
        });
        match answer {
            Some(r) => {
                let sig = r.header("x-ratewall-signature").unwrap_or_default().as_bytes().to_vec();
                vm.respond(&c, r.status, &[("x-ratewall-signature", &sig)], r.body)?;
            }
            None => vm.deliver(&c, None)?,
        }
    }
    Ok(())
}

/// The answer a call gets from `count` stores, tried in turn from `first` (`call(i)` asks
/// store `i`; None: no answer, a connection failure or timeout), the next one tried when one
/// gives no answer or, `past_503`, answers 503: the first other answer, or, when every store
/// that answered said 503, the last such answer, delivered as Envoy delivers it. Only no
/// answer from any store is delivered as none (a failed call): the filter takes that for a
/// store out of reach and stops the whole VM asking for a while, whereas a 503 fails only its
/// own call — as an ask naming a counter the store cannot read does (docs/sync-protocol.md).
/// Delivered as none, that one counter's asks had every other counter's `closed` requests
/// answered 503 for a second after each.
fn answer_from(
    (count, first, past_503): (usize, usize, bool),
    mut call: impl FnMut(usize) -> Option<ratewall_host::http::Response>,
) -> Option<ratewall_host::http::Response> {
    let mut failed = None;
    for i in 0..count {
        match call((first + i) % count) {
            Some(r) if r.status == 503 && past_503 => failed = Some(r),
            Some(r) => return Some(r),
            None => {}
        }
    }
    failed
}

/// How often a worker looks at its waiting requests' connections (and, without a tick, at
/// the requests themselves).
const RECHECK: Duration = Duration::from_millis(5);

/// A request paused until its turn in a leaky bucket's queue, with its connection (made
/// non-blocking, to look whether the client went away).
struct Waiting {
    ctx: u32,
    stream: TcpStream,
    method: String,
    path: String,
    /// What is sent to the upstream once the filter resumes it (none for the demo origin).
    out: Option<Outbound>,
}

/// Whether the client of a waiting request went away: its connection was closed or reset.
/// Bytes sent ahead (a pipelined request) do not count as leaving.
fn gone(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    match stream.peek(&mut byte) {
        Ok(n) => n == 0,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted
        ),
    }
}

/// Ends the streams of the waiting requests whose client went away, as a proxy resets them,
/// so the filter gives their turns back; returns the others.
fn leave(vm: &mut Vm, waiting: Vec<Waiting>, worker: usize) -> Vec<Waiting> {
    let (left, still): (Vec<Waiting>, Vec<Waiting>) = waiting.into_iter().partition(|w| gone(&w.stream));
    for w in left {
        if let Err(e) = vm.abort(w.ctx) {
            log(&format!("worker {worker}: {e}"));
        }
    }
    still
}

/// Answers the waiting requests the filter resumed (forwarded: to `flying` when they go to an
/// upstream) or replied to; returns the others, still waiting.
fn resume(
    vm: &mut Vm,
    waiting: Vec<Waiting>,
    worker: usize,
    origin: &Origin,
    flying: &mut Vec<Flying>,
) -> Vec<Waiting> {
    let mut still = Vec::new();
    for mut w in waiting {
        if let Some(out) = w.out.take() {
            let next = match vm.resumed(w.ctx) {
                Ok(Some(f)) => forward(vm, f, (w.stream, &w.method, &w.path), out, origin),
                Ok(None) => {
                    still.push(Waiting { out: Some(out), ..w });
                    continue;
                }
                Err(e) => Err(e.to_string()),
            };
            match next {
                Ok(Next::Flying(f)) => flying.push(f),
                Ok(_) => {}
                Err(e) => log(&format!("worker {worker}: {e}")),
            }
            continue;
        }
        match vm.finish(w.ctx) {
            Ok(Some(result)) => {
                let answered = w
                    .stream
                    .set_nonblocking(false)
                    .map_err(|e| e.to_string())
                    .and_then(|()| answer(&mut w.stream, &result, &w.method, &w.path));
                if let Err(e) = answered {
                    log(&format!("worker {worker}: {e}"));
                }
            }
            Ok(None) => still.push(w),
            Err(e) => log(&format!("worker {worker}: {e}")),
        }
    }
    still
}

/// A request read off its connection, as the filter is handed it.
struct Request {
    stream: TcpStream,
    method: String,
    /// The target in origin form (`/path?query`): the filter's `:path`.
    path: String,
    req: HttpRequest,
    /// The body, when it was whole within [`MAX_BODY`] and sent with a length (`None`: over
    /// it, or chunked; the demo origin reads none, an upstream is not sent it).
    body: Option<Vec<u8>>,
    /// Whether the client speaks HTTP/1.0 (an upstream's chunked answer is sent it decoded).
    http10: bool,
    /// Whether its body was sent chunked (an upstream is sent only a body with a length).
    chunked: bool,
}

/// The largest request body the gateway sends an upstream.
const MAX_BODY: usize = 1 << 20;

/// What reading a connection gave.
enum Head {
    /// A complete request.
    Request(Request),
    /// A request refused before the filter: its status and body.
    Refused(TcpStream, u16, &'static str),
    /// Nothing to answer: the client sent nothing, or went away.
    Gone,
}

/// The most a request's head (request line and header section) may take.
const MAX_HEAD: usize = 64 * 1024;

/// How long a client has to send its request's head and body.
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a request's body has to come, once its head has.
const BODY_TIMEOUT: Duration = Duration::from_secs(60);

/// A connection read until a deadline: each read waits at most for what is left of it.
struct Deadline {
    stream: TcpStream,
    until: Instant,
}

impl Read for Deadline {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

/// Whether `b` may be in a token (RFC 9110 5.6.2): a method, a field name.
fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A line [`read_line`] read, without its line ending (CRLF, or a bare LF).
fn without_eol(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r\n").or_else(|| line.strip_suffix(b"\n")).unwrap_or(line)
}

/// A header line's name, as written, and its value, without the colon and the whitespace
/// around it.
fn field(line: &[u8]) -> Option<(&[u8], &[u8])> {
    let colon = line.iter().position(|&b| b == b':')?;
    Some((line.get(..colon)?, line.get(colon + 1..)?.trim_ascii()))
}

/// Reads up to and including the next `\n` into `line`, taking at most `budget` bytes (less
/// what it takes): false when the budget ran out, or the stream ended, first.
fn read_line(reader: &mut impl BufRead, line: &mut Vec<u8>, budget: &mut usize) -> std::io::Result<bool> {
    loop {
        let available = reader.fill_buf()?;
        if available.is_empty() {
            return Ok(false);
        }
        let end = available.iter().position(|&b| b == b'\n').map(|i| i + 1);
        let n = end.unwrap_or(available.len()).min(*budget);
        line.extend_from_slice(available.get(..n).unwrap_or_default());
        reader.consume(n);
        *budget -= n;
        if end == Some(n) {
            return Ok(true);
        }
        if *budget == 0 {
            return Ok(false);
        }
    }
}

/// The path and query of a request target in origin form (`/path?q`), and the authority an
/// absolute-form target (`http://host/path?q`, as sent to a proxy) names; `None` for a
/// target of neither form (`*` stays as it is).
fn origin_form(target: &str) -> Option<(String, Option<String>)> {
    if target.starts_with('/') || target == "*" {
        return Some((target.to_owned(), None));
    }
    let (scheme, rest) = target.split_once("://")?;
    let mut chars = scheme.chars();
    let scheme_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    if !scheme_ok {
        return None;
    }
    let rest = rest.split('#').next().unwrap_or_default();
    let (authority, path) = rest.find(['/', '?']).map_or((rest, ""), |i| rest.split_at(i));
    let host = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    if host.is_empty() {
        return None;
    }
    let path = if path.starts_with('/') { path.to_owned() } else { format!("/{path}") };
    Some((path, Some(host.to_owned())))
}

/// Reads and parses one request off a new connection: its request line, header section
/// (at most [`MAX_HEAD`] bytes in all) and body, within [`READ_TIMEOUT`].
/// A request whose head could not be read: a client too slow gets a 408, one gone nothing.
fn unread(stream: TcpStream, e: &std::io::Error) -> Head {
    match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
            Head::Refused(stream, 408, "request timeout\n")
        }
        _ => Head::Gone,
    }
}

fn read_request(stream: TcpStream) -> Head {
    let Ok(read_half) = stream.try_clone() else {
        return Head::Gone;
    };
    let _ = stream.set_write_timeout(Some(READ_TIMEOUT));
    let until = Instant::now().checked_add(READ_TIMEOUT).unwrap_or_else(Instant::now);
    let mut reader = BufReader::new(Deadline { stream: read_half, until });
    let mut budget = MAX_HEAD;
    let mut line = Vec::new();
    match read_line(&mut reader, &mut line, &mut budget) {
        Ok(true) => {}
        Ok(false) if budget == 0 => return Head::Refused(stream, 414, "request line too long\n"),
        Ok(false) if line.is_empty() => return Head::Gone,
        Ok(false) => return Head::Refused(stream, 400, "bad request\n"),
        Err(e) => return unread(stream, &e),
    }
    let Ok(line) = std::str::from_utf8(&line) else {
        return Head::Refused(stream, 400, "bad request: the request line is not UTF-8\n");
    };
    // `method SP target SP HTTP/1.x` (RFC 9112 3), the method a token.
    let mut parts = line.trim_end_matches(['\r', '\n']).split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Head::Refused(stream, 400, "bad request: not a request line (method, target, version)\n");
    };
    if method.is_empty() || !method.bytes().all(is_token) {
        return Head::Refused(stream, 400, "bad request: a method that is not a token\n");
    }
    let http10 = match version {
        "HTTP/1.1" => false,
        "HTTP/1.0" => true,
        v if v.starts_with("HTTP/") && !v.starts_with("HTTP/1.") => {
            return Head::Refused(stream, 505, "HTTP version not supported: the gateway speaks HTTP/1.1\n");
        }
        _ => return Head::Refused(stream, 400, "bad request: the version is neither HTTP/1.1 nor HTTP/1.0\n"),
    };
    let Some((path, authority)) = origin_form(target) else {
        return Head::Refused(stream, 400, "bad request: the target is neither a path nor an absolute URI\n");
    };
    let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let mut req = HttpRequest::new(method, &path).from_addr(&peer);
    req.headers.retain(|(k, _)| k != ":authority");
    // The authority of an absolute-form target replaces the Host field (RFC 9112, 3.2.2).
    if let Some(authority) = &authority {
        req.headers.push((":authority".into(), authority.as_bytes().to_vec()));
    }
    // The content-length given, and how many host fields.
    let (mut lengths, mut hosts) = (None::<Vec<u8>>, 0);
    let mut chunked = false;
    let mut expects = false;
    loop {
        let mut h = Vec::new();
        match read_line(&mut reader, &mut h, &mut budget) {
            Ok(true) => {}
            Ok(false) if budget == 0 => {
                return Head::Refused(stream, 431, "request header fields too large\n");
            }
            Ok(false) => return Head::Refused(stream, 400, "bad request: the header section is cut short\n"),
            Err(e) => return unread(stream, &e),
        }
        if h == b"\r\n" || h == b"\n" {
            break;
        }
        let h = without_eol(&h);
        // What RFC 9112 has a server refuse: a line folded onto the one before (5.2), and
        // whitespace between a field's name and its colon (5.1).
        if h.first().is_some_and(u8::is_ascii_whitespace) {
            return Head::Refused(stream, 400, "bad request: a header line folded onto the one before\n");
        }
        let Some((name, value)) = field(h) else {
            return Head::Refused(stream, 400, "bad request: a header line without a colon\n");
        };
        if name.last().is_some_and(u8::is_ascii_whitespace) {
            return Head::Refused(stream, 400, "bad request: whitespace before a header field's colon\n");
        }
        // A name is a token; a value holds no CR, LF or NUL (RFC 9110 5.1, 5.5), which an
        // origin could read as the end of a line.
        if name.is_empty() || !name.iter().copied().all(is_token) {
            return Head::Refused(stream, 400, "bad request: a header field name that is not a token\n");
        }
        if h.iter().any(|b| matches!(b, b'\r' | b'\n' | 0)) {
            return Head::Refused(stream, 400, "bad request: a CR, LF or NUL in a header field's value\n");
        }
        let name = String::from_utf8_lossy(name).trim().to_ascii_lowercase();
        let value = value.to_vec();
        if name == "content-length" {
            // Two lengths that differ leave the body's end in doubt (RFC 9112 6.3).
            if lengths.as_ref().is_some_and(|l| *l != value) {
                return Head::Refused(stream, 400, "bad request: content-length fields that differ\n");
            }
            lengths = Some(value.clone());
        }
        hosts += usize::from(name == "host");
        if hosts > 1 {
            return Head::Refused(stream, 400, "bad request: more than one host field\n");
        }
        if name == "transfer-encoding" {
            chunked = true;
        }
        if name == "expect" && value.eq_ignore_ascii_case(b"100-continue") {
            expects = true;
        }
        if name == "host" {
            if authority.is_none() {
                req.headers.push((":authority".into(), value));
            }
            continue;
        }
        req.headers.push((name, value));
    }
    // The body's length: digits only (a `+` or a list is not a length); none, no body.
    let content_length = match &lengths {
        None => Some(0),
        Some(v) => Some(v)
            .filter(|v| !v.is_empty() && v.iter().all(u8::is_ascii_digit))
            .and_then(|v| String::from_utf8_lossy(v).parse().ok()),
    };
    let Some(length) = content_length else {
        return Head::Refused(stream, 400, "bad request: its content-length is not a number\n");
    };
    if hosts == 0 && authority.is_none() && !http10 {
        return Head::Refused(stream, 400, "bad request: an HTTP/1.1 request without a host field\n");
    }
    // A client that waits to be told to send its body (curl does, past 1 KiB) is told at once.
    if expects && length > 0 && length <= MAX_BODY && !chunked {
        let mut told = &stream;
        let _ = told.write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
    }
    // The body has a minute of its own (1 MiB at 18 KB/s), as NGINX's `client_body_timeout`.
    reader.get_mut().until = Instant::now().checked_add(BODY_TIMEOUT).unwrap_or_else(Instant::now);
    let mut body = vec![0u8; length.min(MAX_BODY)];
    match reader.read_exact(&mut body) {
        Ok(()) => {}
        Err(e) if matches!(e.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock) => {
            return Head::Refused(stream, 408, "request timeout: the body did not come within a minute\n");
        }
        Err(_) => return Head::Gone,
    }
    let whole = length <= MAX_BODY && !chunked;
    Head::Request(Request {
        stream,
        method: method.to_owned(),
        path,
        req,
        body: whole.then_some(body),
        http10,
        chunked,
    })
}

/// Closes a connection answered before its request was read to the end, as NGINX's lingering
/// close does: the rest the client sends is read and dropped for a while first, since closing
/// with bytes unread resets the connection, and the reset can destroy the answer before the
/// client reads it.
fn linger(stream: TcpStream) {
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let until = Instant::now().checked_add(Duration::from_secs(2)).unwrap_or_else(Instant::now);
    let mut rest = Deadline { stream, until }.take(1 << 20);
    let _ = std::io::copy(&mut rest, &mut std::io::sink());
}

/// Runs a request through the filter: answered now, or (`Some`) paused until its turn,
/// answered by [`resume`].
fn handle(vm: &mut Vm, request: Request, stores: &[String], origin: &Origin) -> Result<Next, String> {
    let Request { mut stream, method, path, req, body, http10, chunked } = request;
    if origin.upstream.is_some() {
        let Some(body) = body else {
            let text: &[u8] = b"the gateway sends an upstream a body of at most 1 MiB, with a content-length\n";
            return respond(&mut stream, if chunked { 411 } else { 413 }, &[], text).map(|()| Next::Answered);
        };
        let out = Outbound::of(&req, body, http10);
        let next = match vm.begin_forwarded(&req).map_err(|e| e.to_string())? {
            Forward::Paused(ctx) => {
                exchange(vm, stores).map_err(|e| e.to_string())?;
                match vm.resumed(ctx).map_err(|e| e.to_string())? {
                    Some(next) => next,
                    None => return park(vm, ctx, stream, (method, path), Some(out)),
                }
            }
            next => next,
        };
        return forward(vm, next, (stream, &method, &path), out, origin);
    }
    // A request the filter pauses waits for its ask to the store, as in Envoy, or for its
    // turn in a leaky bucket's queue (the filter resumes it from a later tick).
    let result = match vm.begin(&req).map_err(|e| e.to_string())? {
        Started::Done(r) => r,
        Started::Paused(ctx) => {
            exchange(vm, stores).map_err(|e| e.to_string())?;
            match vm.finish(ctx).map_err(|e| e.to_string())? {
                Some(r) => r,
                None => return park(vm, ctx, stream, (method, path), None),
            }
        }
    };
    answer(&mut stream, &result, &method, &path).map(|()| Next::Answered)
}

/// What a worker holds of a request once it has run through the filter.
enum Next {
    /// Answered, and done with.
    Answered,
    /// Paused until its turn.
    Waiting(Waiting),
    /// Sent to the upstream.
    Flying(Flying),
}

/// A paused request, waiting with its connection watched.
fn park(
    vm: &mut Vm,
    ctx: u32,
    stream: TcpStream,
    (method, path): (String, String),
    out: Option<Outbound>,
) -> Result<Next, String> {
    if let Err(e) = stream.set_nonblocking(true) {
        // Not able to watch the connection: the request gives its turn back.
        vm.abort(ctx).map_err(|e| e.to_string())?;
        return Err(e.to_string());
    }
    Ok(Next::Waiting(Waiting { ctx, stream, method, path, out }))
}

/// Where a worker's admitted requests go: the upstream (none: the demo origin), and where
/// the upstream's answers come back to it.
struct Origin<'a> {
    upstream: Option<&'a str>,
    inbox: Arc<Inbox>,
    queue: Arc<Queue>,
}

/// What comes back to a worker for its requests at the upstream, by context, as it comes.
#[derive(Default)]
struct Inbox(Mutex<Vec<(u32, Landed)>>);

/// What came back for a request at the upstream.
enum Landed {
    /// The upstream's answer, or why there is none.
    Answer(Result<Upstreamed, String>),
    /// The answer was sent on to the client, or the client went away meanwhile.
    Sent,
}

impl Inbox {
    fn has_answers(&self) -> bool {
        !self.0.lock().unwrap_or_else(PoisonError::into_inner).is_empty()
    }

    fn take(&self) -> Vec<(u32, Landed)> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn put(&self, ctx: u32, landed: Landed, queue: &Queue) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push((ctx, landed));
        queue.wake();
    }
}

/// Most requests at the upstream, or whose answers are being sent, at once over the gateway
/// (each a thread meanwhile): past them a request the filter admitted gets a 503.
const MAX_AT_UPSTREAM: usize = 4096;

/// Requests at the upstream now, and answers being sent.
static AT_UPSTREAM: AtomicUsize = AtomicUsize::new(0);
static SENDING: AtomicUsize = AtomicUsize::new(0);

/// A request sent to the upstream: in flight until its answer is sent on, or its client goes.
struct Flying {
    ctx: u32,
    /// Whether its client speaks HTTP/1.0.
    http10: bool,
    /// None once its answer is being sent, on a thread of its own.
    stream: Option<TcpStream>,
    method: String,
}

/// What a worker does with a request the filter answered or passed: the answer sent, or the
/// request sent to the upstream on a thread of its own, whose answer comes to the worker's
/// inbox.
fn forward(
    vm: &mut Vm,
    next: Forward,
    (mut stream, method, path): (TcpStream, &str, &str),
    out: Outbound,
    origin: &Origin,
) -> Result<Next, String> {
    let ctx = match next {
        Forward::Answered(r) => return answer(&mut stream, &r, method, path).map(|()| Next::Answered),
        Forward::Paused(ctx) => return park(vm, ctx, stream, (method.to_owned(), path.to_owned()), Some(out)),
        Forward::Upstream(ctx) => ctx,
    };
    let flying = Flying { ctx, http10: out.http10, stream: Some(stream), method: method.to_owned() };
    if AT_UPSTREAM.fetch_add(1, Ordering::SeqCst) + SENDING.load(Ordering::SeqCst) >= MAX_AT_UPSTREAM {
        AT_UPSTREAM.fetch_sub(1, Ordering::SeqCst);
        let text = format!("{MAX_AT_UPSTREAM} requests are at the upstream or being answered already\n");
        return deliver(vm, flying, Ok(Upstreamed::own(503, text)), origin).map(Next::Flying);
    }
    let upstream = origin.upstream.unwrap_or_default().to_owned();
    let (inbox, queue, sent) =
        (Arc::clone(&origin.inbox), Arc::clone(&origin.queue), (method.to_owned(), path.to_owned()));
    let spawned = std::thread::Builder::new().name("upstream".into()).stack_size(SMALL_STACK).spawn(move || {
        let answer = upstream::fetch(&upstream, (&sent.0, &sent.1), &out).map_err(|e| match e.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
                format!("no answer within {} s", UPSTREAM_TIMEOUT.as_secs())
            }
            _ => e.to_string(),
        });
        AT_UPSTREAM.fetch_sub(1, Ordering::SeqCst);
        inbox.put(ctx, Landed::Answer(answer), &queue);
    });
    if let Err(e) = spawned {
        AT_UPSTREAM.fetch_sub(1, Ordering::SeqCst);
        return deliver(vm, flying, Err(format!("the gateway could not send it: {e}")), origin).map(Next::Flying);
    }
    if let Some(Err(e)) = flying.stream.as_ref().map(|s| s.set_nonblocking(true)) {
        log(&format!("a request at the upstream: its client's connection cannot be watched ({e})"));
    }
    Ok(Next::Flying(flying))
}

/// Sends on the upstream's answers that came, ends the streams of requests whose answer was
/// sent, and of those whose client went away while at the upstream (a concurrency slot goes
/// back then, as Envoy resets the stream); returns the requests still in flight.
fn landed(vm: &mut Vm, flying: Vec<Flying>, origin: &Origin, worker: usize) -> Vec<Flying> {
    let mut came = origin.inbox.take();
    let mut still = Vec::new();
    for f in flying {
        let done = match came.iter().position(|(ctx, _)| *ctx == f.ctx).map(|i| came.swap_remove(i).1) {
            Some(Landed::Answer(answer)) => match deliver(vm, f, answer, origin) {
                Ok(sending) => {
                    still.push(sending);
                    continue;
                }
                Err(e) => Err(e),
            },
            Some(Landed::Sent) => vm.done(f.ctx).map_err(|e| e.to_string()),
            None if f.stream.as_ref().is_some_and(gone) => vm.abort(f.ctx).map_err(|e| e.to_string()),
            None => {
                still.push(f);
                continue;
            }
        };
        if let Err(e) = done {
            log(&format!("worker {worker}: {e}"));
        }
    }
    still
}

/// Runs the upstream's answer to a request (a 502 when there was none) through the filter's
/// `on_response_headers`, and sends it to the client on a thread of its own (a client slow to
/// read holds up no worker); the request is in flight until that thread says it is sent.
fn deliver(vm: &mut Vm, mut f: Flying, answer: Result<Upstreamed, String>, origin: &Origin) -> Result<Flying, String> {
    let answer = answer.unwrap_or_else(|e| Upstreamed::own(502, format!("the upstream did not answer: {e}\n")));
    let headers = vm.upstream_response(f.ctx, answer.status, &answer.headers).map_err(|e| e.to_string())?;
    let Some(mut stream) = f.stream.take() else { return Ok(f) };
    let (ctx, head_only, http10) = (f.ctx, f.method.eq_ignore_ascii_case("HEAD"), f.http10);
    let (inbox, queue) = (Arc::clone(&origin.inbox), Arc::clone(&origin.queue));
    SENDING.fetch_add(1, Ordering::SeqCst);
    let spawned = std::thread::Builder::new().name("sender".into()).stack_size(SMALL_STACK).spawn(move || {
        let _ = stream.set_nonblocking(false).and_then(|()| stream.set_write_timeout(Some(UPSTREAM_TIMEOUT)));
        let _ = upstream::send_on(&mut stream, answer, &headers, (head_only, http10));
        SENDING.fetch_sub(1, Ordering::SeqCst);
        inbox.put(ctx, Landed::Sent, &queue);
    });
    if let Err(e) = spawned {
        SENDING.fetch_sub(1, Ordering::SeqCst);
        vm.done(ctx).map_err(|e| e.to_string())?;
        return Err(format!("sending an answer: {e}"));
    }
    Ok(f)
}

/// A status's reason phrase (RFC 9110 15), empty for one not listed (the phrase is optional).
fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        206 => "Partial Content",
        301 => "Moved Permanently",
        302 => "Found",
        303 => "See Other",
        304 => "Not Modified",
        307 => "Temporary Redirect",
        308 => "Permanent Redirect",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        414 => "URI Too Long",
        422 => "Unprocessable Content",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "",
    }
}

/// What the filter decided for a request: its local reply, or the demo origin's answer.
fn answer(stream: &mut TcpStream, result: &FilterResult, method: &str, target: &str) -> Result<(), String> {
    // A HEAD response carries its headers (the length a GET's body would have) and no body
    // (RFC 9110 9.3.2).
    let send = if method.eq_ignore_ascii_case("HEAD") { Body::LengthOnly } else { Body::Sent };
    if !result.passed {
        return respond_with(stream, result.status as u16, &result.headers, &result.body, send);
    }
    // The demo origin.
    let origin = format!("{{\"ok\":true,\"method\":\"{method}\",\"path\":{:?}}}\n", target);
    let mut headers = result.headers.clone();
    headers.push(("content-type".into(), "application/json".into()));
    respond_with(stream, 200, &headers, origin.as_bytes(), send)
}

/// Whether a response's body is sent, or only its length (a HEAD request's).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Body {
    Sent,
    LengthOnly,
}

fn respond(stream: &mut TcpStream, status: u16, headers: &[(String, String)], body: &[u8]) -> Result<(), String> {
    respond_with(stream, status, headers, body, Body::Sent)
}

fn respond_with(
    stream: &mut TcpStream,
    status: u16,
    headers: &[(String, String)],
    body: &[u8],
    send: Body,
) -> Result<(), String> {
    let reason = reason(status);
    let mut out = format!("HTTP/1.1 {status} {reason}\r\n");
    for (k, v) in headers {
        if k.eq_ignore_ascii_case("content-length") || k.starts_with(':') {
            continue;
        }
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str(&format!("content-length: {}\r\nconnection: close\r\n\r\n", body.len()));
    let body = if send == Body::Sent { body } else { &[] };
    stream.write_all(out.as_bytes()).and_then(|_| stream.write_all(body)).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::{answer_from, Queue, Request, MAX_BODY, MAX_QUEUED_BYTES};
    use ratewall_host::HttpRequest;

    /// Requests wait for a worker only up to the queue's bytes: past them a request is given
    /// back (to be answered 503), and taking one makes room again.
    #[test]
    fn the_queue_of_requests_is_bounded_by_their_bytes() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let request = || Request {
            stream: stream.try_clone().unwrap(),
            method: "POST".into(),
            path: "/".into(),
            req: HttpRequest::new("POST", "/"),
            body: Some(vec![0; MAX_BODY]),
            http10: false,
            chunked: false,
        };
        let queue = Queue::default();
        for _ in 0..MAX_QUEUED_BYTES / MAX_BODY {
            assert!(queue.push(request()).is_none());
        }
        assert!(queue.push(request()).is_some(), "over the queue's bytes");
        assert!(queue.pop(Some(std::time::Duration::ZERO), &|| false).is_some());
        assert!(queue.push(request()).is_none(), "room again once one was taken");
    }
    use ratewall_host::http::Response;

    fn answered(status: u16, body: &str) -> Option<Response> {
        Some(Response { status, headers: Vec::new(), body: body.as_bytes().to_vec() })
    }

    /// A store's 503 (an ask naming a counter it cannot read: "an ask names a stored counter
    /// that is unreadable; nothing is taken and it is kept") reaches the filter as a 503, as
    /// Envoy delivers it, not as no answer at all: the filter takes no answer for a store out
    /// of reach, and stops the whole VM asking (every other counter's `closed` requests
    /// answered 503) for a second.
    #[test]
    fn a_503_from_every_store_is_delivered_not_taken_for_no_answer() {
        const UNREADABLE: &str = "an ask names a stored counter that is unreadable; nothing is taken and it is kept";
        let one = answer_from((1, 7, true), |_| answered(503, UNREADABLE));
        let one = one.map(|r| (r.status, r.text()));
        assert_eq!(one, Some((503, UNREADABLE.to_owned())), "one store answering 503");
        // Several stores: the next is tried on a 503 (and on no answer); the last 503 is
        // delivered when none answered otherwise.
        let mut tried = Vec::new();
        let all = answer_from((3, 1, true), |i| {
            tried.push(i);
            if i == 0 {
                None
            } else {
                answered(503, &format!("store {i}"))
            }
        });
        assert_eq!(tried, [1, 2, 0]);
        assert_eq!(all.map(|r| (r.status, r.text())), Some((503, "store 2".to_owned())));
        // A store that answers otherwise is taken, past a 503 before it.
        let ok = answer_from((2, 0, true), |i| if i == 0 { answered(503, "") } else { answered(200, "ok") });
        assert_eq!(ok.map(|r| r.status), Some(200));
        // No store answering at all is still no answer (the filter's "store out of reach").
        assert!(answer_from((2, 0, true), |_| None).is_none());
        // An ask: its 503 is delivered, no other store tried after it; past a store that gave
        // no answer (dead), the next.
        let mut tried = Vec::new();
        let one = answer_from((3, 4, false), |i| {
            tried.push(i);
            answered(503, "")
        });
        assert_eq!((tried, one.map(|r| r.status)), (vec![1], Some(503)));
        let mut tried = Vec::new();
        let next = answer_from((3, 4, false), |i| {
            tried.push(i);
            if i == 1 {
                None
            } else {
                answered(200, "ok")
            }
        });
        assert_eq!((tried, next.map(|r| r.status)), (vec![1, 2], Some(200)));
        assert!(answer_from((0, 0, true), |_| answered(200, "")).is_none());
    }
}
