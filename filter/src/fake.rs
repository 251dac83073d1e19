//! An in-memory [`Host`] for the logic's unit tests, with Envoy's shared-data rules: a
//! missing key reads as not found, a write without a CAS is unconditional, a write with one
//! fails with a mismatch once the key has changed, and every write bumps the key's CAS.
//! Several fakes can share one shared-data map (the VMs of one node), each with its own
//! clock, metrics, logs and queue of dispatched calls.

use crate::host::{Host, Level, SetError};
use ratewall_core::sync::{hex, sign, Store, SyncResponse};
use ratewall_core::Nanos;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

/// The node's shared data: key → (value, CAS).
#[derive(Debug, Default)]
pub struct Shared {
    map: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
}

/// One call the logic dispatched.
#[derive(Clone, Debug)]
pub struct Call {
    pub token: u32,
    pub upstream: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub timeout: Nanos,
}

impl Call {
    /// A header of the call.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// A fake VM.
#[derive(Debug)]
pub struct FakeHost {
    pub now: Cell<Nanos>,
    pub headers: RefCell<Vec<(String, String)>>,
    pub peer: RefCell<Option<String>>,
    pub node_id: Vec<u8>,
    pub shared: Rc<RefCell<Shared>>,
    /// Metric name → (is a gauge, value).
    metrics: RefCell<Vec<(String, bool, u64)>>,
    pub logs: RefCell<Vec<(Level, String)>>,
    pub calls: RefCell<Vec<Call>>,
    next_token: Cell<u32>,
    /// Fault injection: every conditional write fails with a CAS mismatch.
    pub cas_always_fails: Cell<bool>,
    /// ngx_wasm_module's shared data: a set with CAS 0 writes only a key that is absent
    /// (Envoy's writes unconditionally).
    pub nginx_cas: Cell<bool>,
    /// Fault injection: the next this many conditional writes fail with a CAS mismatch (a
    /// concurrent writer), after changing nothing.
    pub cas_conflicts: Cell<u32>,
    /// Fault injection: every shared-data read and write fails.
    pub shared_broken: Cell<bool>,
    /// Fault injection: dispatch refuses every call.
    pub refuse_calls: Cell<bool>,
    /// Behave as a host that resumes a paused request only from its own callbacks
    /// (ngx_wasm_module), not from the root's tick.
    pub no_root_resume: Cell<bool>,
    /// The header map leaves the pseudo-headers out (as some hosts do); they are still
    /// found by name.
    pub map_omits_pseudo: Cell<bool>,
}

/// 2023-11-14, in ns: a clock far from zero, as real ones are.
pub const T0: Nanos = 1_700_000_000_000_000_000;
/// One millisecond.
pub const MS: Nanos = 1_000_000;

impl FakeHost {
    /// A VM of a new node.
    pub fn new() -> FakeHost {
        FakeHost::joining(Rc::new(RefCell::new(Shared::default())))
    }

    /// Another VM of the node whose shared data is `shared`.
    pub fn joining(shared: Rc<RefCell<Shared>>) -> FakeHost {
        FakeHost {
            now: Cell::new(T0),
            headers: RefCell::new(Vec::new()),
            peer: RefCell::new(None),
            node_id: b"node-1".to_vec(),
            shared,
            metrics: RefCell::new(Vec::new()),
            logs: RefCell::new(Vec::new()),
            calls: RefCell::new(Vec::new()),
            next_token: Cell::new(0),
            cas_always_fails: Cell::new(false),
            nginx_cas: Cell::new(false),
            cas_conflicts: Cell::new(0),
            shared_broken: Cell::new(false),
            refuse_calls: Cell::new(false),
            no_root_resume: Cell::new(false),
            map_omits_pseudo: Cell::new(false),
        }
    }

    /// Moves the clock on.
    pub fn advance(&self, by: Nanos) {
        self.now.set(self.now.get() + by);
    }

    /// Sets the request's headers (pseudo-headers included), replacing the last request's.
    pub fn request(&self, method: &str, path: &str, headers: &[(&str, &str)]) {
        let mut h = vec![(":method".to_owned(), method.to_owned()), (":path".to_owned(), path.to_owned())];
        h.extend(headers.iter().map(|(n, v)| (n.to_ascii_lowercase(), (*v).to_owned())));
        *self.headers.borrow_mut() = h;
    }

    /// A metric's value (0 when never defined or touched).
    pub fn metric(&self, name: &str) -> u64 {
        self.metrics.borrow().iter().find(|(n, _, _)| n == name).map_or(0, |m| m.2)
    }

    /// Whether some log line contains `text`.
    pub fn logged(&self, text: &str) -> bool {
        self.logs.borrow().iter().any(|(_, l)| l.contains(text))
    }

    /// Takes the calls dispatched so far.
    pub fn take_calls(&self) -> Vec<Call> {
        std::mem::take(&mut *self.calls.borrow_mut())
    }

    /// A shared-data value.
    pub fn shared_value(&self, key: &str) -> Option<Vec<u8>> {
        self.shared.borrow().map.get(key).map(|(v, _)| v.clone())
    }

    /// Defines (or finds) a metric, a gauge or a counter.
    fn define(&self, name: &str, gauge: bool) -> Option<u32> {
        let mut m = self.metrics.borrow_mut();
        if let Some(i) = m.iter().position(|(n, _, _)| n == name) {
            return u32::try_from(i).ok();
        }
        m.push((name.to_owned(), gauge, 0));
        u32::try_from(m.len() - 1).ok()
    }

    /// Drops a shared-data key, as a host whose store is full evicts one (NGINX's `shm_kv`).
    pub fn evict(&self, key: &str) {
        self.shared.borrow_mut().map.remove(key);
    }

    /// The shared-data keys.
    pub fn shared_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.shared.borrow().map.keys().cloned().collect();
        keys.sort();
        keys
    }
}

/// `headers` serialized as proxy-wasm serializes a header map (what [`crate::host::headers`]
/// reads).
pub fn header_map<N: AsRef<str>, V: AsRef<[u8]>>(headers: &[(N, V)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(headers.len() as u32).to_le_bytes());
    for (n, v) in headers {
        out.extend_from_slice(&(n.as_ref().len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.as_ref().len() as u32).to_le_bytes());
    }
    for (n, v) in headers {
        out.extend_from_slice(n.as_ref().as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_ref());
        out.push(0);
    }
    out
}

/// Answers a dispatched sync call from a reference store, as a signed 200: (status, tag,
/// body), or the store's refusal: its status and reason.
pub fn answer(store: &mut Store, now: Nanos, secret: &str, call: &Call) -> (u32, Option<Vec<u8>>, Vec<u8>) {
    let tag = call.header("x-ratewall-signature").and_then(|t| ratewall_core::sync::unhex(t.as_bytes()));
    match store.handle_signed(now, secret.as_bytes(), &call.body, &tag.unwrap_or_default()) {
        Ok(body) => (200, Some(hex(&sign(secret.as_bytes(), &body)).into_bytes()), body),
        Err(e) => (u32::from(e.status()), None, e.to_string().into_bytes()),
    }
}

/// A signed answer made up by the test.
pub fn signed(secret: &str, resp: &SyncResponse) -> (u32, Option<Vec<u8>>, Vec<u8>) {
    let body = resp.encode();
    (200, Some(hex(&sign(secret.as_bytes(), &body)).into_bytes()), body)
}

impl Host for FakeHost {
    fn now(&self) -> Nanos {
        self.now.get()
    }
    fn request_headers(&self) -> Vec<u8> {
        let headers = self.headers.borrow();
        let kept: Vec<(String, String)> =
            headers.iter().filter(|(n, _)| !(self.map_omits_pseudo.get() && n.starts_with(':'))).cloned().collect();
        header_map(&kept)
    }
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        self.headers.borrow().iter().find(|(n, _)| n == name).map(|(_, v)| v.clone().into_bytes())
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        match path {
            ["source", "address"] => self.peer.borrow().clone().map(String::into_bytes),
            ["node", "id"] => Some(self.node_id.clone()),
            _ => None,
        }
    }
    fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), SetError> {
        if self.shared_broken.get() {
            return Err(SetError::Other);
        }
        Ok(match self.shared.borrow().map.get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        })
    }
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        if self.shared_broken.get() {
            return Err(SetError::Other);
        }
        let cas = cas.filter(|c| *c != 0);
        if cas.is_none() && self.nginx_cas.get() && self.shared.borrow().map.contains_key(key) {
            return Err(SetError::CasMismatch);
        }
        if cas.is_some() && self.cas_always_fails.get() {
            return Err(SetError::CasMismatch);
        }
        if cas.is_some() && self.cas_conflicts.get() > 0 {
            self.cas_conflicts.set(self.cas_conflicts.get() - 1);
            // A concurrent writer got there first: the key's CAS moves on.
            let mut s = self.shared.borrow_mut();
            s.next_cas = s.next_cas.wrapping_add(1).max(1);
            let next = s.next_cas;
            if let Some(e) = s.map.get_mut(key) {
                e.1 = next;
            }
            return Err(SetError::CasMismatch);
        }
        let mut s = self.shared.borrow_mut();
        s.next_cas = s.next_cas.wrapping_add(1).max(1);
        let next = s.next_cas;
        match s.map.get_mut(key) {
            Some(e) if cas.is_some_and(|c| c != e.1) => Err(SetError::CasMismatch),
            Some(e) => {
                *e = (value.to_vec(), next);
                Ok(())
            }
            None => {
                s.map.insert(key.to_owned(), (value.to_vec(), next));
                Ok(())
            }
        }
    }
    fn define_counter(&self, name: &str) -> Option<u32> {
        self.define(name, false)
    }
    fn increment(&self, metric: u32, by: u64) {
        if let Some(m) = self.metrics.borrow_mut().get_mut(metric as usize) {
            assert!(!m.1, "increment of gauge {}", m.0);
            m.2 += by;
        }
    }
    fn define_gauge(&self, name: &str) -> Option<u32> {
        self.define(name, true)
    }
    fn set_gauge(&self, metric: u32, value: u64) {
        if let Some(m) = self.metrics.borrow_mut().get_mut(metric as usize) {
            assert!(m.1, "set_gauge of counter {}", m.0);
            m.2 = value;
        }
    }
    fn metric_value(&self, metric: u32) -> Option<u64> {
        self.metrics.borrow().get(metric as usize).map(|m| m.2)
    }
    fn resumes_waiters(&self) -> bool {
        !self.no_root_resume.get()
    }
    fn dispatch(&self, upstream: &str, headers: &[(&str, &str)], body: &[u8], timeout: Nanos) -> Option<u32> {
        if self.refuse_calls.get() {
            return None;
        }
        let token = self.next_token.get() + 1;
        self.next_token.set(token);
        self.calls.borrow_mut().push(Call {
            token,
            upstream: upstream.to_owned(),
            headers: headers.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())).collect(),
            body: body.to_vec(),
            timeout,
        });
        Some(token)
    }
    fn log(&self, level: Level, message: &str) {
        self.logs.borrow_mut().push((level, message.to_owned()));
    }
}
