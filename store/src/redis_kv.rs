//! [`Kv`] on Redis or Valkey: one multiplexed connection per process (a `ConnectionManager`
//! that reconnects by itself, or a Cluster connection), the three scripts invoked by SHA and
//! reloaded on `NOSCRIPT` (a restart or a failover empties the script cache).

use crate::{
    Cas, Kv, Presence, Unheard, APPEND, CAS, CLOSE, LOW_KEYS, MANY, NODE_TTL, PRESENT, PRESENT_KEY, PROBE, PROBE_KEY,
    READ, READ_AFTER, REGISTRY, REGISTRY_KEYS, REGISTRY_TYPES,
};
use ratewall_core::sync::{
    CUT_OFF_SILENCE, MAX_ASKS_REMEMBERED, MAX_HEARD_LATELY, MAX_NODES, MAX_REQUEST_SKEW, SEQ_MEMORY,
};
use ratewall_core::Nanos;
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{Script, Value};

/// A connection to a single server or a Cluster.
#[derive(Clone)]
pub enum Conn {
    /// One server (reconnecting).
    Single(ConnectionManager),
    /// A Cluster (commands routed by key slot).
    Cluster(ClusterConnection),
}

/// Redis as the store's [`Kv`].
#[derive(Clone)]
pub struct RedisKv {
    conn: std::sync::Arc<std::sync::RwLock<Conn>>,
    /// A Cluster's seed nodes (empty for a single server), to connect again from.
    cluster: std::sync::Arc<Vec<String>>,
    /// Since when every call has failed, and when the connection was last replaced.
    failing: std::sync::Arc<std::sync::Mutex<Failing>>,
    read: Script,
    cas: Script,
    registry: Script,
    close: Script,
    present: Script,
    probe: Script,
    append: Script,
    read_after: Script,
    many: Script,
    /// Reads and compare-and-sets on their way to a single server, sent together
    /// ([`RedisKv::flush`]).
    waiting: std::sync::Arc<std::sync::Mutex<Vec<Waiting>>>,
    /// The nodes the registry last named as heard lately, and when: named again at most every
    /// [`LATELY_EVERY`], for they are up to [`MAX_HEARD_LATELY`] ids per call.
    lately: std::sync::Arc<std::sync::Mutex<Lately>>,
}

/// A read or compare-and-set waiting for the next [`MANY`] call: the key, its arguments and
/// where its answer goes.
type Waiting = (String, Vec<Vec<u8>>, tokio::sync::oneshot::Sender<Result<Answered, String>>);

/// A key's part of a [`MANY`] answer: its status, its value (or what it holds instead) and
/// the server's clock.
type Answered = (i64, Option<Vec<u8>>, Nanos);

/// Since when calls have gone with none succeeding (`None`: the last one succeeded), and when
/// a new Cluster connection was last asked for.
type Failing = (Option<std::time::Instant>, Option<std::time::Instant>);

/// How long every call on a Cluster connection fails before it is replaced by a new one from
/// the seed nodes: a connection whose view of the Cluster went stale in a failover can stay
/// so, answering nothing, while a new one finds the promoted replicas at once.
const REPLACE_AFTER: std::time::Duration = std::time::Duration::from_secs(3);

/// A connection to a Cluster, each node's connect and each answer bounded as the single
/// server's are (without, one node that stopped answering held up every call).
async fn cluster_connection(urls: &[String]) -> Result<ClusterConnection, String> {
    let client = redis::cluster::ClusterClientBuilder::new(urls.to_vec())
        .connection_timeout(std::time::Duration::from_millis(500))
        .response_timeout(std::time::Duration::from_millis(500))
        .build()
        .map_err(|e| e.to_string())?;
    client.get_async_connection().await.map_err(|e| {
        let e = e.to_string();
        // A server that is no Cluster node says "cluster support disabled": say what to do.
        if e.to_ascii_lowercase().contains("cluster support disabled") {
            format!("{e}: this Redis is no Cluster node; start the store without --cluster")
        } else {
            e
        }
    })
}

/// Whether the server on `conn` is a Cluster node (`INFO cluster`), if it tells (`INFO` may be
/// renamed or refused to the store's user).
async fn cluster_enabled(conn: &mut ConnectionManager) -> Option<bool> {
    let info: String = redis::cmd("INFO").arg("cluster").query_async(conn).await.ok()?;
    info.lines().find_map(|l| l.trim().strip_prefix("cluster_enabled:")).map(|v| v.trim() == "1")
}

/// When the nodes heard lately were last named, and the nodes.
type Lately = (Option<std::time::Instant>, std::sync::Arc<Vec<u64>>);

/// How long the nodes heard lately are reused for the batches after them: each call naming
/// them all would cost a fleet's store calls its size in ids; reused a quarter of a second, a
/// node is taken as heard lately up to [`CUT_OFF_SILENCE`] and that long more.
const LATELY_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

impl RedisKv {
    /// Connects: to `urls[0]`, or with `cluster` to the Cluster those nodes belong to.
    pub async fn connect(urls: &[String], cluster: bool) -> Result<RedisKv, String> {
        let conn = if cluster {
            Conn::Cluster(cluster_connection(urls).await?)
        } else {
            let url = urls.first().ok_or("no --redis URL")?;
            let client = redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
            let config = redis::aio::ConnectionManagerConfig::new()
                .set_connection_timeout(Some(std::time::Duration::from_millis(500)))
                .set_response_timeout(Some(std::time::Duration::from_millis(500)))
                .set_number_of_retries(1);
            let mut single = ConnectionManager::new_with_config(client, config).await.map_err(|e| e.to_string())?;
            // A Cluster node taken for a single server answers the keys of its own slots and
            // refuses the others (MOVED): some batches would count and others fail, while the
            // registry's slot may look healthy.
            if cluster_enabled(&mut single).await == Some(true) {
                return Err("this Redis is a Cluster node (cluster_enabled:1): start the store with --cluster, its nodes as --redis seeds".to_owned());
            }
            Conn::Single(single)
        };
        Ok(RedisKv {
            conn: std::sync::Arc::new(std::sync::RwLock::new(conn)),
            cluster: std::sync::Arc::new(if cluster { urls.to_vec() } else { Vec::new() }),
            failing: Default::default(),
            read: Script::new(READ),
            cas: Script::new(CAS),
            registry: Script::new(REGISTRY),
            close: Script::new(CLOSE),
            present: Script::new(PRESENT),
            probe: Script::new(PROBE),
            append: Script::new(APPEND),
            read_after: Script::new(READ_AFTER),
            many: Script::new(MANY),
            waiting: Default::default(),
            lately: Default::default(),
        })
    }

    /// Redis's `maxmemory-policy` (on a Cluster, one node's), if it tells: `CONFIG` may be
    /// renamed or refused to the store's user.
    pub async fn eviction_policy(&self) -> Option<String> {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET").arg("maxmemory-policy");
        let reply: Result<Vec<String>, _> = match self.conn().ok()? {
            Conn::Single(mut c) => cmd.query_async(&mut c).await,
            Conn::Cluster(mut c) => cmd.query_async(&mut c).await,
        };
        reply.ok()?.into_iter().nth(1)
    }

    /// The connection calls go on now.
    fn conn(&self) -> Result<Conn, String> {
        self.conn.read().map(|c| c.clone()).map_err(|_| "the Redis connection is unusable".to_owned())
    }

    /// Notes a call about to go. On a Cluster, once no call has succeeded for [`REPLACE_AFTER`]
    /// since one was first tried (calls that fail, or hang until their caller gives up), a new
    /// connection is made in the background and takes the old one's place.
    fn going(&self) {
        let Ok(mut f) = self.failing.lock() else { return };
        let now = std::time::Instant::now();
        let since = *f.0.get_or_insert(now);
        let asked_lately = f.1.is_some_and(|at| now.duration_since(at) < REPLACE_AFTER);
        if self.cluster.is_empty() || now.duration_since(since) < REPLACE_AFTER || asked_lately {
            return;
        }
        f.1 = Some(now);
        let (urls, conn) = (std::sync::Arc::clone(&self.cluster), std::sync::Arc::clone(&self.conn));
        tokio::spawn(async move {
            match cluster_connection(&urls).await {
                Ok(c) => {
                    if let Ok(mut slot) = conn.write() {
                        *slot = Conn::Cluster(c);
                    }
                    crate::log_line!("ratewall-store: no Redis Cluster call succeeded for 3 s: the connection is replaced by a new one");
                }
                Err(e) => crate::log_line!("ratewall-store: a new Redis Cluster connection failed: {e}"),
            }
        });
    }

    /// Notes how a call went: one that succeeded clears [`RedisKv::going`]'s watch.
    fn went<T, E>(&self, result: &Result<T, E>) {
        if result.is_ok() {
            if let Ok(mut f) = self.failing.lock() {
                f.0 = None;
            }
        }
    }

    /// Sends every read and compare-and-set waiting as one [`MANY`] call and hands each its
    /// answer. Run as a task of its own, spawned by the first to wait: it runs once the task
    /// that spawned it yields, so a batch's counters, which reach their read or
    /// compare-and-set in one poll of the batch, go in one call (a Redis round trip and
    /// command for the batch rather than one per counter), and no request that goes away can
    /// strand the others.
    async fn flush(self) {
        let waiting = match self.waiting.lock() {
            Ok(mut w) => std::mem::take(&mut *w),
            Err(_) => return,
        };
        if waiting.is_empty() {
            return;
        }
        let mut inv = self.many.prepare_invoke();
        for (key, args, _) in &waiting {
            inv.key(key.as_str());
            for a in args {
                inv.arg(a.as_slice());
            }
        }
        let parts = match self.call(&inv).await {
            Ok(Value::Array(parts)) => Ok(parts),
            Ok(_) => Err("unexpected reply to the read and compare-and-set script".to_owned()),
            Err(e) => Err(e),
        };
        let now = parts.as_ref().map_err(Clone::clone).and_then(|p| clock(p.first(), p.get(1)));
        for (i, (_, _, answer)) in waiting.into_iter().enumerate() {
            let result = match (&parts, &now) {
                (Ok(p), Ok(now)) => match p.get(2 + 2 * i).and_then(int) {
                    Some(status) => Ok((
                        status,
                        match p.get(3 + 2 * i) {
                            Some(Value::BulkString(b)) => Some(b.clone()),
                            _ => None,
                        },
                        *now,
                    )),
                    None => Err("unexpected reply to the read and compare-and-set script".to_owned()),
                },
                (Err(e), _) | (_, Err(e)) => Err(e.clone()),
            };
            // A caller that has gone (its request timed out) retries under its seq.
            let _ = answer.send(result);
        }
    }

    /// Queues `args` on `key` for the next [`MANY`] call (spawning it when first) and waits
    /// for its answer.
    async fn along(&self, key: &str, args: Vec<Vec<u8>>) -> Result<Answered, String> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        let first = match self.waiting.lock() {
            Ok(mut w) => {
                w.push((key.to_owned(), args, answer));
                w.len() == 1
            }
            Err(_) => return Err("the Redis call queue is unusable".into()),
        };
        if first {
            tokio::spawn(self.clone().flush());
        }
        answered.await.unwrap_or_else(|_| Err("the call was not sent".into()))
    }

    async fn run(&self, script: &Script, keys: &[&str], args: &[Vec<u8>]) -> Result<Value, String> {
        let mut inv = script.prepare_invoke();
        for k in keys {
            inv.key(*k);
        }
        for a in args {
            inv.arg(a.as_slice());
        }
        self.call(&inv).await
    }

    /// Runs `inv` on the connection in use, noting how it went ([`RedisKv::going`]).
    async fn call(&self, inv: &redis::ScriptInvocation<'_>) -> Result<Value, String> {
        self.going();
        let reply = match self.conn()? {
            Conn::Single(mut c) => invoke(inv, &mut c).await,
            Conn::Cluster(mut c) => invoke(inv, &mut c).await,
        };
        self.went(&reply);
        reply
    }
}

/// Runs a script by SHA, loading it on `NOSCRIPT`.
async fn invoke<C: ConnectionLike + Send>(inv: &redis::ScriptInvocation<'_>, conn: &mut C) -> Result<Value, String> {
    inv.invoke_async::<Value>(conn).await.map_err(|e| e.to_string())
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

/// A reply's string (or integer, as text).
fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        Value::Double(d) => Some(d.to_string()),
        _ => None,
    }
}

/// Redis `TIME` (seconds, microseconds) in ns.
fn clock(secs: Option<&Value>, micros: Option<&Value>) -> Result<Nanos, String> {
    let secs = secs.and_then(int).ok_or("no TIME")?;
    let micros = micros.and_then(int).ok_or("no TIME")?;
    Ok(u64::try_from(secs)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(micros).unwrap_or(0).saturating_mul(1_000)))
}

impl Kv for RedisKv {
    async fn read(&self, key: &str) -> Result<(Option<Vec<u8>>, Nanos), String> {
        // On a single server: with the others waiting, in one call.
        if self.cluster.is_empty() {
            return match self.along(key, vec![b"r".to_vec()]).await? {
                (2, value, now) => Ok((value, now)),
                _ => Err("unexpected reply to the read script".into()),
            };
        }
        let Value::Array(parts) = self.run(&self.read, &[key], &[]).await? else {
            return Err("unexpected reply to the read script".into());
        };
        let value = match parts.first() {
            Some(Value::BulkString(b)) => Some(b.clone()),
            _ => None,
        };
        Ok((value, clock(parts.get(1), parts.get(2))?))
    }

    async fn cas(
        &self,
        key: &str,
        old: Option<&[u8]>,
        new: &[u8],
        ttl_ms: u64,
        deadline_ms: u64,
    ) -> Result<Cas, String> {
        let has_old = if old.is_some() { b"1".to_vec() } else { b"0".to_vec() };
        let (old, new, ttl) = (old.unwrap_or_default().to_vec(), new.to_vec(), ttl_ms.to_string().into_bytes());
        // Without a deadline, on a single server: with the others waiting, in one call.
        if deadline_ms == 0 && self.cluster.is_empty() {
            return match self.along(key, vec![b"c".to_vec(), old, new, ttl, has_old]).await? {
                (1, _, now) => Ok(Cas::Written(now)),
                (0, value, now) => Ok(Cas::Changed(value, now)),
                _ => Err("unexpected reply to the compare-and-set script".into()),
            };
        }
        let args = [old, new, ttl, has_old, deadline_ms.to_string().into_bytes()];
        let Value::Array(parts) = self.run(&self.cas, &[key], &args).await? else {
            return Err("unexpected reply to the compare-and-set script".into());
        };
        let now = clock(parts.get(2), parts.get(3))?;
        match parts.first().and_then(int) {
            Some(1) => Ok(Cas::Written(now)),
            Some(2) => Err("the compare-and-set ran past its deadline: nothing written".into()),
            Some(0) => Ok(Cas::Changed(
                match parts.get(1) {
                    Some(Value::BulkString(b)) => Some(b.clone()),
                    _ => None,
                },
                now,
            )),
            _ => Err("unexpected reply to the compare-and-set script".into()),
        }
    }

    async fn heard(&self, node: u64, seq: u64, batch: bool, sent: Nanos) -> Result<(u32, Vec<u64>), Unheard> {
        let cached = self.lately.lock().ok().and_then(|l| match l.0 {
            Some(at) if at.elapsed() < LATELY_EVERY => Some(std::sync::Arc::clone(&l.1)),
            _ => None,
        });
        let args = [
            node.to_string().into_bytes(),
            format!("{seq:020}").into_bytes(),
            if batch { b"1".to_vec() } else { b"0".to_vec() },
            (NODE_TTL / 1_000_000).to_string().into_bytes(),
            (SEQ_MEMORY / 1_000_000).to_string().into_bytes(),
            (sent / 1_000_000).to_string().into_bytes(),
            (MAX_REQUEST_SKEW / 1_000_000).to_string().into_bytes(),
            (CUT_OFF_SILENCE / 1_000_000).to_string().into_bytes(),
            (if cached.is_some() { 0 } else { MAX_HEARD_LATELY }).to_string().into_bytes(),
            MAX_ASKS_REMEMBERED.to_string().into_bytes(),
            MAX_NODES.to_string().into_bytes(),
        ];
        let unexpected = || Unheard::Failed("unexpected reply to the registry script".into());
        let Value::Array(parts) = self.run(&self.registry, &REGISTRY_KEYS, &args).await.map_err(Unheard::Failed)?
        else {
            return Err(unexpected());
        };
        match parts.first().and_then(int) {
            Some(-1) => {
                // A closed batch's `seq` has a `c` after it ([`CLOSE`]).
                let last = match parts.get(1) {
                    Some(Value::BulkString(b)) => {
                        std::str::from_utf8(b).ok().and_then(|s| s.trim_end_matches('c').parse().ok())
                    }
                    _ => None,
                };
                Err(Unheard::Older(last.unwrap_or(0)))
            }
            Some(-3) => Err(Unheard::Repeated),
            Some(-2) => {
                let now_ms = parts.get(1).and_then(int).and_then(|ms| u64::try_from(ms).ok());
                Err(now_ms.map_or_else(unexpected, |ms| Unheard::Skewed(ms.saturating_mul(1_000_000))))
            }
            Some(n) => {
                // Ids a node could not have sent are skipped: the list only spares nodes. In id
                // order, as counters read it (sorted here once, not by each counter).
                let mut lately: Vec<u64> = parts
                    .iter()
                    .skip(2)
                    .filter_map(|v| match v {
                        Value::BulkString(b) => std::str::from_utf8(b).ok().and_then(|s| s.parse().ok()),
                        _ => None,
                    })
                    .collect();
                lately.sort_unstable();
                let lately = match cached {
                    Some(list) => list.to_vec(),
                    None => {
                        if let Ok(mut l) = self.lately.lock() {
                            *l = (Some(std::time::Instant::now()), std::sync::Arc::new(lately.clone()));
                        }
                        lately
                    }
                };
                Ok((u32::try_from(n).unwrap_or(u32::MAX), lately))
            }
            None => Err(unexpected()),
        }
    }

    async fn close(&self, node: u64, seq: u64) -> Result<(), String> {
        let args = [node.to_string().into_bytes(), format!("{seq:020}").into_bytes()];
        self.run(&self.close, &REGISTRY_KEYS[..1], &args).await.map(|_| ())
    }

    async fn present(&self, node: u64, low: &[(String, Nanos)], seen: &str) -> Result<Presence, String> {
        let mut args = vec![
            node.to_string().into_bytes(),
            (NODE_TTL / 1_000_000).to_string().into_bytes(),
            seen.as_bytes().to_vec(),
        ];
        for (key, until) in low {
            args.push(key.as_bytes().to_vec());
            args.push(until.div_ceil(1_000_000).to_string().into_bytes());
        }
        let unexpected = || "unexpected reply to the presence script".to_owned();
        let keys = [PRESENT_KEY, LOW_KEYS[0], LOW_KEYS[1]];
        let Value::Array(parts) = self.run(&self.present, &keys, &args).await? else {
            return Err(unexpected());
        };
        let processes = parts.first().and_then(int).and_then(|n| u32::try_from(n).ok()).ok_or_else(unexpected)?;
        let now = clock(parts.get(1), parts.get(2))?;
        let version = parts.get(3).and_then(text).ok_or_else(unexpected)?;
        let low = if version == seen {
            None
        } else {
            let entries = parts.get(4..).unwrap_or_default().chunks(2).filter_map(|pair| match pair {
                [key, until] => {
                    let ms = text(until)?.parse::<f64>().ok()?;
                    Some((text(key)?, (ms.max(0.0) as u64).saturating_mul(1_000_000)))
                }
                _ => None,
            });
            Some((version, entries.collect()))
        };
        Ok(Presence { processes, now, low })
    }

    async fn ping(&self) -> Result<(), String> {
        // On a Cluster, at the registry's slot, which every batch needs (its primary down,
        // nothing can be answered).
        let keys = [PROBE_KEY, REGISTRY_KEYS[0], REGISTRY_KEYS[1], REGISTRY_KEYS[2], REGISTRY_KEYS[3]];
        let types = REGISTRY_TYPES.map(|t| t.as_bytes().to_vec());
        self.run(&self.probe, &keys, &types).await.map(|_| ())
    }

    async fn append(&self, key: &str, payload: &[u8], len: u64, ttl_ms: u64) -> Result<(), String> {
        let args = [payload.to_vec(), len.to_string().into_bytes(), ttl_ms.to_string().into_bytes()];
        self.run(&self.append, &[key], &args).await.map(|_| ())
    }

    async fn read_after(&self, key: &str, after: Option<&str>, count: usize) -> Result<(String, Vec<Vec<u8>>), String> {
        let args = [after.unwrap_or_default().as_bytes().to_vec(), count.to_string().into_bytes()];
        let Value::Array(parts) = self.run(&self.read_after, &[key], &args).await? else {
            return Err("unexpected reply to the stream read".into());
        };
        let mut parts = parts.into_iter().map(|v| match v {
            Value::BulkString(b) => Ok(b),
            Value::SimpleString(s) => Ok(s.into_bytes()),
            other => Err(format!("unexpected entry in the stream read: {other:?}")),
        });
        let last = parts.next().ok_or("empty reply to the stream read")??;
        let last = String::from_utf8(last).map_err(|_| "a stream id that is not text")?;
        Ok((last, parts.collect::<Result<_, _>>()?))
    }
}
