//! The host's own tests: the semantics a filter can observe, through a small guest written
//! in WAT (shared data, metrics, the clock, header maps, local replies) and directly (the
//! map codec).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use crate::memory::{deserialize_map, serialize_map};
use crate::{HttpRequest, Node, Plugin, Vm};
use wasmtime::Val;

/// A guest whose exports call one host function each and return its status; results land
/// at fixed addresses (value pointer 100, size 104, CAS 108, metric id 200, time 400).
const GUEST: &str = r#"(module
  (import "env" "proxy_get_shared_data" (func $get (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_shared_data" (func $set (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_define_metric" (func $define (param i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_increment_metric" (func $inc (param i32 i64) (result i32)))
  (import "env" "proxy_record_metric" (func $record (param i32 i64) (result i32)))
  (import "env" "proxy_get_current_time_nanoseconds" (func $now (param i32) (result i32)))
  (import "env" "proxy_get_header_map_value" (func $header (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_send_local_response" (func $reply (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_grpc_call" (func $grpc (param i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 2)
  (data (i32.const 0) "k")
  (data (i32.const 8) "z")
  (data (i32.const 16) "v1")
  (data (i32.const 24) "v2")
  (data (i32.const 32) "hits")
  (data (i32.const 48) "x-deny")
  (data (i32.const 64) "no")
  (global $bump (mut i32) (i32.const 32768))
  (func (export "malloc") (param $n i32) (result i32) (local $p i32)
    global.get $bump local.set $p
    global.get $bump local.get $n i32.add global.set $bump
    local.get $p)
  (func (export "get") (param $k i32) (result i32) (call $get (local.get $k) (i32.const 1) (i32.const 100) (i32.const 104) (i32.const 108)))
  (func (export "set") (param $k i32) (param $v i32) (param $cas i32) (result i32)
    (call $set (local.get $k) (i32.const 1) (local.get $v) (i32.const 2) (local.get $cas)))
  (func (export "value_byte") (result i32) (i32.load8_u (i32.load (i32.const 100))))
  (func (export "value_size") (result i32) (i32.load (i32.const 104)))
  (func (export "cas") (result i32) (i32.load (i32.const 108)))
  (func (export "define") (param $kind i32) (result i32) (drop (call $define (local.get $kind) (i32.const 32) (i32.const 4) (i32.const 200))) (i32.load (i32.const 200)))
  (func (export "inc") (param $id i32) (param $by i64) (result i32) (call $inc (local.get $id) (local.get $by)))
  (func (export "record") (param $id i32) (param $v i64) (result i32) (call $record (local.get $id) (local.get $v)))
  (func (export "now") (result i64) (drop (call $now (i32.const 400))) (i64.load (i32.const 400)))
  (func (export "grpc") (result i32) (call $grpc (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0)))
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
  ;; A request with an x-deny header gets a local 429; the rest continue.
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
    (if (i32.eqz (call $header (i32.const 0) (i32.const 48) (i32.const 6) (i32.const 300) (i32.const 304)))
      (then (drop (call $reply (i32.const 429) (i32.const 0) (i32.const 0) (i32.const 64) (i32.const 2) (i32.const 512) (i32.const 4) (i32.const -1)))))
    (i32.const 0))
  (func (export "proxy_on_response_headers") (param i32 i32 i32) (result i32) (i32.const 0))
  (func (export "proxy_on_done") (param i32) (result i32) (i32.const 1))
  (func (export "proxy_on_log") (param i32))
  (func (export "proxy_on_delete") (param i32)))"#;

fn vm(node: &Node) -> Vm {
    let plugin = Plugin::from_bytes(GUEST.as_bytes()).unwrap();
    Vm::start(&plugin, node, b"{}").unwrap()
}

fn call(vm: &mut Vm, name: &str, args: &[Val]) -> i64 {
    match vm.call(name, args).unwrap().first() {
        Some(Val::I32(v)) => i64::from(*v),
        Some(Val::I64(v)) => *v,
        other => panic!("{name} returned {other:?}"),
    }
}

const OK: i64 = 0;
const NOT_FOUND: i64 = 1;
const CAS_MISMATCH: i64 = 8;
const UNIMPLEMENTED: i64 = 12;
// Addresses of the guest's data: keys "k" and "z", values "v1" and "v2".
const K: i32 = 0;
const Z: i32 = 8;
const V1: i32 = 16;
const V2: i32 = 24;

#[test]
fn shared_data_has_envoys_semantics() {
    let node = Node::new(1);
    let mut vm = vm(&node);
    assert_eq!(call(&mut vm, "get", &[Val::I32(K)]), NOT_FOUND, "a missing key reads as NotFound");
    assert_eq!(call(&mut vm, "set", &[Val::I32(K), Val::I32(V1), Val::I32(0)]), OK);
    assert_eq!(call(&mut vm, "get", &[Val::I32(K)]), OK);
    assert_eq!((call(&mut vm, "value_size", &[]), call(&mut vm, "value_byte", &[])), (2, i64::from(b'v')));
    let first = call(&mut vm, "cas", &[]);
    assert_ne!(first, 0);
    assert_eq!(call(&mut vm, "set", &[Val::I32(K), Val::I32(V2), Val::I32(first as i32 + 1)]), CAS_MISMATCH);
    assert_eq!(call(&mut vm, "set", &[Val::I32(K), Val::I32(V2), Val::I32(first as i32)]), OK, "the CAS read");
    call(&mut vm, "get", &[Val::I32(K)]);
    let second = call(&mut vm, "cas", &[]);
    assert_ne!(second, first, "every set bumps the CAS");
    assert_eq!(call(&mut vm, "set", &[Val::I32(K), Val::I32(V1), Val::I32(first as i32)]), CAS_MISMATCH);
    assert_eq!(call(&mut vm, "set", &[Val::I32(K), Val::I32(V1), Val::I32(0)]), OK, "cas 0 is unconditional");
    assert_eq!(
        call(&mut vm, "set", &[Val::I32(Z), Val::I32(V1), Val::I32(12345)]),
        OK,
        "a missing key is inserted whatever the CAS"
    );
    assert_eq!(node.shared_get("z").as_deref(), Some(&b"v1"[..]));
}

#[test]
fn the_vms_of_a_node_share_data_and_nodes_do_not() {
    let node = Node::new(1);
    let (mut a, mut b) = (vm(&node), vm(&node));
    call(&mut a, "set", &[Val::I32(K), Val::I32(V2), Val::I32(0)]);
    assert_eq!(call(&mut b, "get", &[Val::I32(K)]), OK);
    let mut other = vm(&Node::new(1));
    assert_eq!(call(&mut other, "get", &[Val::I32(K)]), NOT_FOUND);
}

#[test]
fn cas_faults_hit_conditional_writes_only() {
    let node = Node::new(1);
    let mut vm = vm(&node);
    call(&mut vm, "set", &[Val::I32(K), Val::I32(V1), Val::I32(0)]);
    call(&mut vm, "get", &[Val::I32(K)]);
    let cas = call(&mut vm, "cas", &[]) as i32;
    node.fail_every_cas(true);
    assert_eq!(call(&mut vm, "set", &[Val::I32(K), Val::I32(V2), Val::I32(cas)]), CAS_MISMATCH);
    assert_eq!(call(&mut vm, "set", &[Val::I32(K), Val::I32(V2), Val::I32(0)]), OK);
    assert_eq!(node.set_shared("k", b"v9", 0), 0);
}

#[test]
fn metrics_are_defined_once_per_name_and_counted_per_node() {
    let node = Node::new(1);
    let (mut a, mut b) = (vm(&node), vm(&node));
    let id = call(&mut a, "define", &[Val::I32(0)]);
    assert_eq!(call(&mut b, "define", &[Val::I32(0)]), id, "the same name, the same metric");
    assert_eq!(call(&mut a, "inc", &[Val::I32(id as i32), Val::I64(3)]), OK);
    assert_eq!(call(&mut b, "inc", &[Val::I32(id as i32), Val::I64(4)]), OK);
    assert_eq!(node.metric("hits"), 7);
    assert_ne!(call(&mut a, "inc", &[Val::I32(9_999), Val::I64(1)]), OK, "an unknown id is refused");
}

#[test]
fn the_clock_is_the_nodes_virtual_one() {
    let node = Node::new(1_000);
    let mut vm = vm(&node);
    assert_eq!(call(&mut vm, "now", &[]), 1_000);
    node.advance(5);
    assert_eq!(call(&mut vm, "now", &[]), 1_005);
}

#[test]
fn unimplemented_imports_answer_unimplemented() {
    let mut vm = vm(&Node::new(1));
    assert_eq!(call(&mut vm, "grpc", &[]), UNIMPLEMENTED);
}

#[test]
fn request_headers_reach_the_guest_and_local_replies_come_back() {
    let mut vm = vm(&Node::new(1));
    let passed = vm.request(&HttpRequest::new("GET", "/")).unwrap();
    assert!(passed.passed);
    assert_eq!(passed.status, 200);
    let denied = vm.request(&HttpRequest::new("GET", "/").header("X-Deny", "1")).unwrap();
    assert!(!denied.passed);
    assert_eq!((denied.status, denied.body.as_slice()), (429, &b"no"[..]));
}

#[test]
fn a_trap_leaves_the_vm_unusable() {
    let mut vm = vm(&Node::new(1));
    // Reading a value through a pointer past memory traps.
    assert!(vm.call("set", &[Val::I32(K), Val::I32(1 << 30), Val::I32(0)]).is_err());
    let again = vm.call("get", &[Val::I32(K)]).unwrap_err();
    assert!(again.to_string().contains("unusable"), "{again}");
}

#[test]
fn header_maps_round_trip_and_malformed_ones_are_errors() {
    let pairs =
        vec![(":path".to_owned(), b"/x".to_vec()), ("x-a".to_owned(), Vec::new()), ("x-b".to_owned(), vec![0, 255])];
    let mut bytes = Vec::new();
    serialize_map(&pairs, &mut bytes);
    assert_eq!(deserialize_map(&bytes).unwrap(), pairs);
    assert_eq!(deserialize_map(&[]).unwrap(), Vec::new());
    // (The last value's terminating NUL is not needed to read it.)
    for cut in 1..bytes.len() - 1 {
        assert!(deserialize_map(&bytes[..cut]).is_err(), "truncated at {cut}");
    }
    // A count no map of these bytes can hold: an error, not a huge allocation.
    assert!(deserialize_map(&[0xff, 0xff, 0xff, 0xff, 1, 0, 0, 0]).is_err());
    let mut huge = vec![1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff];
    huge.extend_from_slice(b"a\0b\0");
    assert!(deserialize_map(&huge).is_err());
}

/// A guest for the ngx_wasm_module profile: each export calls one host function from the
/// context it is called in (the root's configure and tick, or a request's headers) and
/// returns its status. Request headers: `x-op` picks what the request callback does.
const PROFILE_GUEST: &str = r#"(module
  (import "env" "proxy_get_shared_data" (func $get (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_shared_data" (func $set (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_tick_period_milliseconds" (func $tick (param i32) (result i32)))
  (import "env" "proxy_set_effective_context" (func $effective (param i32) (result i32)))
  (import "env" "proxy_continue_stream" (func $continue (param i32) (result i32)))
  (import "env" "proxy_get_property" (func $property (param i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_http_call" (func $call (param i32 i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_done" (func $done (result i32)))
  (import "env" "proxy_get_header_map_value" (func $header (param i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 2)
  (data (i32.const 0) "k")
  (data (i32.const 16) "v1")
  (data (i32.const 32) "node\00id")
  (data (i32.const 48) "plugin_name")
  (data (i32.const 64) "store")
  (data (i32.const 80) "127.0.0.1:8090")
  (data (i32.const 96) "x-op")
  (data (i32.const 128) "\00\00\00\00")
  (global $bump (mut i32) (i32.const 32768))
  (global $status (mut i32) (i32.const -1))
  (func (export "malloc") (param $n i32) (result i32) (local $p i32)
    global.get $bump local.set $p
    global.get $bump local.get $n i32.add global.set $bump
    local.get $p)
  (func (export "status") (result i32) (global.get $status))
  (func (export "get") (result i32) (call $get (i32.const 0) (i32.const 1) (i32.const 200) (i32.const 204) (i32.const 208)))
  (func (export "set") (param $cas i32) (result i32) (call $set (i32.const 0) (i32.const 1) (i32.const 16) (i32.const 2) (local.get $cas)))
  (func (export "cas") (result i32) (i32.load (i32.const 208)))
  (func (export "tick") (param $ms i32) (result i32) (call $tick (local.get $ms)))
  (func (export "node_id") (result i32) (call $property (i32.const 32) (i32.const 7) (i32.const 200) (i32.const 204)))
  (func (export "plugin_name") (result i32) (call $property (i32.const 48) (i32.const 11) (i32.const 200) (i32.const 204)))
  (func (export "call_named") (result i32)
    (call $call (i32.const 64) (i32.const 5) (i32.const 128) (i32.const 4) (i32.const 0) (i32.const 0) (i32.const 128) (i32.const 4) (i32.const 1000) (i32.const 300)))
  (func (export "call_address") (result i32)
    (call $call (i32.const 80) (i32.const 14) (i32.const 128) (i32.const 4) (i32.const 0) (i32.const 0) (i32.const 128) (i32.const 4) (i32.const 1000) (i32.const 300)))
  (func (export "done") (result i32) (call $done))
  ;; Resume context $ctx from here: switch to it, then continue.
  (func (export "resume") (param $ctx i32) (result i32)
    (drop (call $effective (local.get $ctx)))
    (call $continue (i32.const 0)))
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
  ;; x-op: "t" sets the tick period from the request; "p" reads node.id; else pause.
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32) (local $op i32)
    (if (i32.eqz (call $header (i32.const 0) (i32.const 96) (i32.const 4) (i32.const 300) (i32.const 304)))
      (then (local.set $op (i32.load8_u (i32.load (i32.const 300))))))
    (if (i32.eq (local.get $op) (i32.const 116)) (then (global.set $status (call $tick (i32.const 5))) (return (i32.const 0))))
    (if (i32.eq (local.get $op) (i32.const 112)) (then (global.set $status (call $property (i32.const 32) (i32.const 7) (i32.const 200) (i32.const 204))) (return (i32.const 0))))
    (i32.const 1))
  (func (export "proxy_on_response_headers") (param i32 i32 i32) (result i32) (i32.const 0))
  (func (export "proxy_on_done") (param i32) (result i32) (i32.const 1))
  (func (export "proxy_on_log") (param i32))
  (func (export "proxy_on_delete") (param i32)))"#;

fn profile_vm(node: &Node) -> Vm {
    let plugin = Plugin::from_bytes(PROFILE_GUEST.as_bytes()).unwrap();
    Vm::start(&plugin, node, b"{}").unwrap()
}

const INTERNAL_FAILURE: i64 = 10;

#[test]
fn nginx_reads_cas_zero_as_only_if_absent_and_a_missing_key_takes_only_zero() {
    let node = Node::with_profile(1, crate::Profile::NGINX);
    let mut vm = profile_vm(&node);
    assert_eq!(call(&mut vm, "set", &[Val::I32(7)]), CAS_MISMATCH, "a missing key takes cas 0 only");
    assert_eq!(call(&mut vm, "set", &[Val::I32(0)]), OK, "cas 0 creates");
    assert_eq!(call(&mut vm, "set", &[Val::I32(0)]), CAS_MISMATCH, "cas 0 on an existing key is refused");
    assert_eq!(call(&mut vm, "get", &[]), OK);
    let cas = call(&mut vm, "cas", &[]) as i32;
    assert_eq!(call(&mut vm, "set", &[Val::I32(cas)]), OK, "the CAS read");
    // Envoy: cas 0 is unconditional.
    let mut envoy = profile_vm(&Node::new(1));
    assert_eq!(call(&mut envoy, "set", &[Val::I32(0)]), OK);
    assert_eq!(call(&mut envoy, "set", &[Val::I32(0)]), OK);
}

#[test]
fn nginx_without_shm_kv_traps_on_shared_data() {
    let node = Node::with_profile(1, crate::Profile::Nginx { shm_kv: false });
    let mut vm = profile_vm(&node);
    let e = vm.call("get", &[]).unwrap_err();
    assert!(e.to_string().contains("could not resolve namespace"), "{e}");
    assert!(vm.trapped().is_some(), "the instance is discarded");
    let mut vm = profile_vm(&node);
    assert!(vm.call("set", &[Val::I32(0)]).is_err());
}

#[test]
fn nginx_sets_the_tick_period_from_the_root_only_and_once() {
    let node = Node::with_profile(1, crate::Profile::NGINX);
    let mut vm = profile_vm(&node);
    // From a request's context: a trap that discards the instance.
    let r = vm.begin(&HttpRequest::new("GET", "/").header("x-op", "t"));
    assert!(r.unwrap_err().to_string().contains("can only set tick_period in root context"));
    assert!(vm.trapped().is_some());
    // From the root: once; a non-zero period replacing another traps, 0 then a period does not.
    let mut vm = profile_vm(&node);
    assert_eq!(call(&mut vm, "tick", &[Val::I32(5)]), OK);
    assert_eq!(call(&mut vm, "tick", &[Val::I32(0)]), OK);
    assert_eq!(call(&mut vm, "tick", &[Val::I32(100)]), OK);
    assert!(vm.call("tick", &[Val::I32(5)]).unwrap_err().to_string().contains("tick_period already set"));
    // Envoy: any context, any time.
    let mut envoy = profile_vm(&Node::new(1));
    assert!(matches!(envoy.begin(&HttpRequest::new("GET", "/").header("x-op", "t")), Ok(crate::Started::Done(_))));
    assert_eq!(call(&mut envoy, "tick", &[Val::I32(7)]), OK);
    assert_eq!(envoy.tick_period_ms(), 7);
}

#[test]
fn nginx_resumes_a_request_only_from_its_own_context() {
    for (profile, resumed) in [(crate::Profile::Envoy, true), (crate::Profile::NGINX, false)] {
        let node = Node::with_profile(1, profile);
        let mut vm = profile_vm(&node);
        let crate::Started::Paused(ctx) = vm.begin(&HttpRequest::new("GET", "/")).unwrap() else { panic!("paused") };
        // From the root (a tick): set_effective_context, then continue_stream.
        vm.store.data_mut().current = 1;
        vm.store.data_mut().effective_context = 1;
        assert_eq!(call(&mut vm, "resume", &[Val::I32(ctx as i32)]), OK, "accepted on both");
        assert_eq!(vm.finish(ctx).unwrap().is_some(), resumed, "{profile:?}");
    }
}

#[test]
fn nginx_has_no_scoped_properties_outside_a_request_and_no_node_id() {
    let node = Node::with_profile(1, crate::Profile::NGINX);
    let mut vm = profile_vm(&node);
    assert_eq!(call(&mut vm, "node_id", &[]), INTERNAL_FAILURE);
    assert!(node
        .logs()
        .iter()
        .any(|(l, m)| *l == 4 && m.contains("cannot get scoped properties outside of a request")));
    assert_eq!(call(&mut vm, "plugin_name", &[]), OK, "a plain property is there");
    let mut envoy = profile_vm(&Node::new(1));
    assert_eq!(call(&mut envoy, "node_id", &[]), OK);
    assert!(vm.request(&HttpRequest::new("GET", "/").header("x-op", "p")).unwrap().passed);
    assert_eq!(call(&mut vm, "status", &[]), NOT_FOUND, "in a request: no node.id on NGINX");
}

#[test]
fn nginx_calls_host_port_only_and_traps_on_what_it_does_not_implement() {
    let node = Node::with_profile(1, crate::Profile::NGINX);
    let mut vm = profile_vm(&node);
    assert_eq!(call(&mut vm, "call_named", &[]), INTERNAL_FAILURE, "an Envoy cluster name");
    assert_eq!(call(&mut vm, "call_address", &[]), OK);
    assert_eq!(vm.take_callouts()[0].upstream, "127.0.0.1:8090");
    assert!(vm.call("done", &[]).unwrap_err().to_string().contains("not yet implemented"));
    let mut envoy = profile_vm(&Node::new(1));
    assert_eq!(call(&mut envoy, "call_named", &[]), OK);
    assert_eq!(call(&mut envoy, "done", &[]), OK);
}

#[test]
fn an_nginx_reload_brings_fresh_shared_data_and_envoy_keeps_it() {
    for (profile, kept) in [(crate::Profile::Envoy, true), (crate::Profile::NGINX, false)] {
        let node = Node::with_profile(1, profile);
        assert_eq!(node.set_shared("k", b"v", 0), 0);
        node.reload();
        assert_eq!(node.shared_get("k").is_some(), kept, "{profile:?}");
    }
}

/// A guest that counts its configurations: `on_configure` refuses a configuration of 5 bytes
/// (`false`) and records the root context it ran in; every request pauses; the last context
/// deleted and the last root ticked are kept.
const PUSH_GUEST: &str = r#"(module
  (memory (export "memory") 1)
  (global $bump (mut i32) (i32.const 1024))
  (global $configured (mut i32) (i32.const 0))
  (global $root (mut i32) (i32.const 0))
  (global $deleted (mut i32) (i32.const 0))
  (global $ticked (mut i32) (i32.const 0))
  (func (export "malloc") (param $n i32) (result i32) (local $p i32)
    global.get $bump local.set $p
    global.get $bump local.get $n i32.add global.set $bump
    local.get $p)
  (func (export "configured") (result i32) (global.get $configured))
  (func (export "root") (result i32) (global.get $root))
  (func (export "deleted") (result i32) (global.get $deleted))
  (func (export "ticked") (result i32) (global.get $ticked))
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_configure") (param $root i32) (param $size i32) (result i32)
    (global.set $configured (i32.add (global.get $configured) (i32.const 1)))
    (global.set $root (local.get $root))
    (i32.ne (local.get $size) (i32.const 5)))
  (func (export "proxy_on_tick") (param $root i32) (global.set $ticked (local.get $root)))
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_response_headers") (param i32 i32 i32) (result i32) (i32.const 0))
  (func (export "proxy_on_done") (param i32) (result i32) (i32.const 1))
  (func (export "proxy_on_log") (param i32))
  (func (export "proxy_on_delete") (param $ctx i32) (global.set $deleted (local.get $ctx))))"#;

fn push_vm(node: &Node, config: &[u8]) -> wasmtime::Result<Vm> {
    Vm::start(&Plugin::from_bytes(PUSH_GUEST.as_bytes()).unwrap(), node, config)
}

#[test]
fn an_envoy_push_starts_a_new_root_context_in_the_running_instance_and_the_old_one_ends_once_drained() {
    let node = Node::new(1);
    let mut vm = push_vm(&node, b"{\"v\":1}").unwrap();
    assert_eq!(vm.root_contexts(), [1]);
    assert_eq!(call(&mut vm, "configured", &[]), 1, "the canary ran in an instance of its own");
    let crate::Started::Paused(held) = vm.begin(&HttpRequest::new("GET", "/")).unwrap() else { panic!("paused") };
    assert!(vm.configure(b"{\"v\":2}").unwrap());
    // The same instance, a new root context; the old one lives while its request does.
    assert_eq!(call(&mut vm, "configured", &[]), 2);
    let second = call(&mut vm, "root", &[]) as u32;
    assert!(second > held, "a new context id");
    assert_eq!(vm.root_contexts(), [1, second]);
    let crate::Started::Paused(next) = vm.begin(&HttpRequest::new("GET", "/")).unwrap() else { panic!("paused") };
    vm.tick().unwrap();
    assert_eq!(call(&mut vm, "ticked", &[]), i64::from(second), "new requests and ticks go to the new root");
    vm.abort(held).unwrap();
    assert_eq!(call(&mut vm, "deleted", &[]), 1, "drained: the old root context ends");
    assert_eq!(vm.root_contexts(), [second]);
    // The configuration in force: nothing is called.
    assert!(vm.configure(b"{\"v\":2}").unwrap());
    assert_eq!(call(&mut vm, "configured", &[]), 2);
    // Back to a configuration whose root context still lives: it is current again, as is.
    assert!(vm.configure(b"{\"v\":3}").unwrap());
    assert_eq!(call(&mut vm, "configured", &[]), 3);
    assert!(vm.configure(b"{\"v\":2}").unwrap());
    assert_eq!(call(&mut vm, "configured", &[]), 3, "its root context is reused");
    assert_eq!(vm.root_contexts().last(), Some(&second));
    vm.abort(next).unwrap();
}

#[test]
fn envoy_refuses_a_push_its_canary_refuses_and_the_running_root_context_serves_on() {
    let node = Node::new(1);
    let mut vm = push_vm(&node, b"{}").unwrap();
    assert!(!vm.configure(b"false").unwrap(), "refused by the canary");
    assert_eq!(call(&mut vm, "configured", &[]), 1, "the running instance never saw it");
    assert_eq!(vm.root_contexts(), [1]);
    assert!(!vm.configure(b"false").unwrap(), "the verdict is cached");
    let e = push_vm(&Node::new(1), b"false").err().unwrap();
    assert!(e.to_string().contains("canary"), "Envoy creates no filter from it: {e}");
    let e = push_vm(&Node::with_profile(1, crate::Profile::NGINX), b"false").err().unwrap();
    assert!(e.to_string().contains("fatal code 2"), "{e}");
    let mut nginx = push_vm(&Node::with_profile(1, crate::Profile::NGINX), b"{}").unwrap();
    assert!(nginx.configure(b"{\"v\":2}").is_err(), "ngx_wasm_module configures a VM once");
}

#[test]
fn a_nodes_log_lines_stay_bounded_and_are_taken_once() {
    let node = Node::new(0);
    for i in 0..(crate::node::MAX_LOGS + 10) {
        node.state.log(2, format!("line {i}"));
    }
    let kept = node.logs();
    assert!(kept.len() <= crate::node::MAX_LOGS, "{} lines kept", kept.len());
    assert_eq!(kept.last().map(|(_, l)| l.clone()), Some(format!("line {}", crate::node::MAX_LOGS + 9)));
    assert_eq!(node.take_logs().len(), kept.len());
    assert!(node.take_logs().is_empty(), "taken once");
}
