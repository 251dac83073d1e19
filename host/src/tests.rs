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
