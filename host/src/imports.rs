//! The `env.proxy_*` imports, by ABI area.

use crate::abi::*;
use crate::memory::*;
use crate::node::*;
use crate::vm::*;
use crate::wasi::define_wasi;
use std::sync::atomic::Ordering;
use wasmtime::{bail, Caller, Linker, Module, Result, Val};

pub(crate) fn define_imports(linker: &mut Linker<VmState>, module: &Module) -> Result<()> {
    // First a stub for everything the module imports (gRPC, queues, foreign functions answer
    // Unimplemented; WASI gets shims); the real host calls below then replace the stubs.
    for import in module.imports() {
        let (m, n) = (import.module(), import.name());
        let Some(ty) = import.ty().func().cloned() else {
            continue;
        };
        let name = format!("{m}.{n}");
        if m == "env" {
            linker.func_new(m, n, ty, move |_c, _args, results| {
                if let Some(r) = results.first_mut() {
                    *r = Val::I32(status::UNIMPLEMENTED);
                }
                Ok(())
            })?;
        } else if m.starts_with("wasi") {
            define_wasi(linker, m, n, ty)?;
        } else {
            bail!("the module imports {name}, which no proxy provides");
        }
    }
    linker.allow_shadowing(true);
    context(linker)?;
    shared_data(linker)?;
    calls(linker)?;
    metrics(linker)?;
    nginx_unimplemented(linker, module)?;
    Ok(())
}

/// Whether the VM's node behaves as ngx_wasm_module.
fn nginx(c: &Caller<'_, VmState>) -> bool {
    c.data().node.profile().is_nginx()
}

/// The calls ngx_wasm_module declares but does not implement: they trap ("NYI") under its
/// profile; under Envoy's they keep their stubs.
fn nginx_unimplemented(linker: &mut Linker<VmState>, module: &Module) -> Result<()> {
    const NYI: [&str; 11] = [
        "proxy_done",
        "proxy_close_stream",
        "proxy_get_status",
        "proxy_resume_downstream",
        "proxy_resume_upstream",
        "proxy_continue_response",
        "proxy_grpc_call",
        "proxy_grpc_stream",
        "proxy_grpc_send",
        "proxy_grpc_cancel",
        "proxy_grpc_close",
    ];
    for import in module.imports() {
        let (m, n) = (import.module(), import.name());
        let Some(ty) = import.ty().func().cloned() else { continue };
        if m != "env" || !NYI.contains(&n) {
            continue;
        }
        let name = n.to_owned();
        linker.func_new(m, n, ty, move |c, _args, results| {
            if nginx(&c) {
                bail!("[wasm] {name}: function not yet implemented");
            }
            if let Some(r) = results.first_mut() {
                // Envoy's answers: proxy_done and proxy_close_stream succeed.
                let ok = name == "proxy_done" || name == "proxy_close_stream";
                *r = Val::I32(if ok { status::OK } else { status::UNIMPLEMENTED });
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// Logs, the clock and ticks, buffers, header maps and properties: what a context reads
/// and writes of its own request and configuration.
fn context(linker: &mut Linker<VmState>) -> Result<()> {
    linker.func_wrap(
        "env",
        "proxy_log",
        |mut c: Caller<'_, VmState>, level: i32, ptr: i32, len: i32| -> Result<i32> {
            let msg = read_str(&mut c, ptr, len)?;
            c.data().node.state.log(level, msg);
            Ok(status::OK)
        },
    )?;
    linker.func_wrap("env", "proxy_get_log_level", |mut c: Caller<'_, VmState>, ret: i32| -> Result<i32> {
        write_u32(&mut c, ret, 0)?;
        Ok(status::OK)
    })?;
    linker.func_wrap(
        "env",
        "proxy_get_current_time_nanoseconds",
        |mut c: Caller<'_, VmState>, ret: i32| -> Result<i32> {
            let now = c.data().node.now();
            write_u64(&mut c, ret, now)?;
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_tick_period_milliseconds",
        |mut c: Caller<'_, VmState>, period: i32| -> Result<i32> {
            // Envoy: the period of the calling context's root context, from any context.
            let root = c.data().root_of(c.data().current);
            if nginx(&c) {
                // ngx_proxy_wasm_hfuncs_set_tick_period: root context only, and once.
                if !c.data().is_root(c.data().current) {
                    bail!("[wasm] can only set tick_period in root context");
                }
                if period != 0 && c.data().tick_periods.get(&root).is_some_and(|p| *p != 0) {
                    bail!("[wasm] tick_period already set");
                }
            }
            c.data_mut().tick_periods.insert(root, period as u32);
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_buffer_bytes",
        |mut c: Caller<'_, VmState>, kind: i32, start: i32, max: i32, ret_ptr: i32, ret_size: i32| -> Result<i32> {
            let data = match kind {
                BUFFER_PLUGIN_CONFIGURATION => c.data().plugin_config.clone(),
                BUFFER_VM_CONFIGURATION => c.data().vm_config.clone(),
                BUFFER_HTTP_CALL_RESPONSE_BODY => match &c.data().call_response {
                    Some((_, body)) => body.clone(),
                    None => return Ok(status::NOT_FOUND),
                },
                _ => return Ok(status::NOT_FOUND),
            };
            let start = (start as u32 as usize).min(data.len());
            let end = start.saturating_add(max as u32 as usize).min(data.len());
            return_bytes(&mut c, &data[start..end], ret_ptr, ret_size)?;
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_header_map_pairs",
        |mut c: Caller<'_, VmState>, map_type: i32, ret_ptr: i32, ret_size: i32| -> Result<i32> {
            let omit = c.data().pairs_without_pseudo_headers && map_type == MAP_REQUEST_HEADERS;
            let mut bytes = std::mem::take(&mut c.data_mut().scratch);
            let Some(map) = map_for(c.data_mut(), map_type) else {
                return Ok(status::NOT_FOUND);
            };
            if omit {
                let kept: Vec<_> = map.iter().filter(|(k, _)| !k.starts_with(':')).cloned().collect();
                serialize_map(&kept, &mut bytes);
            } else {
                serialize_map(map, &mut bytes);
            }
            let r = return_bytes(&mut c, &bytes, ret_ptr, ret_size);
            c.data_mut().scratch = bytes;
            r.map(|()| status::OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_header_map_pairs",
        |mut c: Caller<'_, VmState>, map_type: i32, ptr: i32, len: i32| -> Result<i32> {
            let pairs = deserialize_map(&read(&mut c, ptr, len)?)?;
            let Some(map) = map_for(c.data_mut(), map_type) else {
                return Ok(status::NOT_FOUND);
            };
            *map = pairs;
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_header_map_value",
        |mut c: Caller<'_, VmState>, map_type: i32, kp: i32, kl: i32, ret_ptr: i32, ret_size: i32| -> Result<i32> {
            let key = read_name(&mut c, kp, kl)?;
            let value =
                map_for(c.data_mut(), map_type).and_then(|m| m.iter().find(|(k, _)| *k == key).map(|(_, v)| v.clone()));
            reply_bytes(&mut c, value, ret_ptr, ret_size)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_remove_header_map_value",
        |mut c: Caller<'_, VmState>, map_type: i32, kp: i32, kl: i32| -> Result<i32> {
            let key = read_name(&mut c, kp, kl)?;
            if let Some(map) = map_for(c.data_mut(), map_type) {
                map.retain(|(k, _)| *k != key);
            }
            Ok(status::OK)
        },
    )?;
    for (name, replace) in [("proxy_replace_header_map_value", true), ("proxy_add_header_map_value", false)] {
        linker.func_wrap(
            "env",
            name,
            move |mut c: Caller<'_, VmState>, map_type: i32, kp: i32, kl: i32, vp: i32, vl: i32| -> Result<i32> {
                let key = read_name(&mut c, kp, kl)?;
                let value = read(&mut c, vp, vl)?;
                let Some(map) = map_for(c.data_mut(), map_type) else {
                    return Ok(status::NOT_FOUND);
                };
                if replace {
                    map.retain(|(k, _)| *k != key);
                }
                map.push((key, value));
                Ok(status::OK)
            },
        )?;
    }
    linker.func_wrap(
        "env",
        "proxy_get_property",
        |mut c: Caller<'_, VmState>, pp: i32, pl: i32, ret_ptr: i32, ret_size: i32| -> Result<i32> {
            let path = read(&mut c, pp, pl)?;
            let parts: Vec<&[u8]> = path.split(|&b| b == 0).filter(|p| !p.is_empty()).collect();
            let nginx = nginx(&c);
            if nginx && c.data().is_root(c.data().current) && parts.len() > 1 {
                // ngx_proxy_wasm_properties_get: a dotted path needs a request.
                let line = "[wasm] cannot get scoped properties outside of a request".to_owned();
                c.data().node.state.log(4, line);
                return Ok(status::INTERNAL_FAILURE);
            }
            let value = match parts.as_slice() {
                [b"source", b"address"] => c.data().source_address.clone().map(String::into_bytes),
                [b"plugin_root_id"] | [b"plugin_name"] => Some(b"ratewall".to_vec()),
                // ngx_wasm_module has no `node.id` (it maps `node` to "not supported").
                [b"node", b"id"] if !nginx => c.data().node.state.id.get().map(|s| s.clone().into_bytes()),
                [b"ngx", b"nginx_version"] if nginx => Some(b"1.27.4".to_vec()),
                _ => None,
            };
            reply_bytes(&mut c, value, ret_ptr, ret_size)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_property",
        |_c: Caller<'_, VmState>, _a: i32, _b: i32, _d: i32, _e: i32| -> i32 { status::OK },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_buffer_bytes",
        |_c: Caller<'_, VmState>, _a: i32, _b: i32, _d: i32, _e: i32, _f: i32| -> i32 { status::BAD_ARGUMENT },
    )?;
    Ok(())
}

/// Shared data, with Envoy's semantics ([`crate::Node::shared_get`]).
fn shared_data(linker: &mut Linker<VmState>) -> Result<()> {
    linker.func_wrap(
        "env",
        "proxy_get_shared_data",
        |mut c: Caller<'_, VmState>, kp: i32, kl: i32, ret_ptr: i32, ret_size: i32, ret_cas: i32| -> Result<i32> {
            no_shm_kv(&c, "getting value from")?;
            // Copied out under the lock into the VM's scratch buffer (no allocation), then into
            // the guest's: the guest's allocator runs in between.
            let mut value = std::mem::take(&mut c.data_mut().scratch);
            let found = with_memory(&mut c, |mem, s| {
                let key = text(guest_slice(mem, kp, kl)?);
                Ok(lock(&s.node.state.shared).get(key.as_ref()).map(|(v, cas)| {
                    value.clear();
                    value.extend_from_slice(v);
                    *cas
                }))
            });
            let r = match found {
                Ok(Some(cas)) => return_bytes(&mut c, &value, ret_ptr, ret_size)
                    .and_then(|()| write_u32(&mut c, ret_cas, cas))
                    .map(|()| status::OK),
                Ok(None) => Ok(status::NOT_FOUND),
                Err(e) => Err(e),
            };
            c.data_mut().scratch = value;
            r
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_shared_data",
        |mut c: Caller<'_, VmState>, kp: i32, kl: i32, vp: i32, vl: i32, cas: i32| -> Result<i32> {
            no_shm_kv(&c, "setting value in")?;
            with_memory(&mut c, |mem, s| {
                let (key, value) = (text(guest_slice(mem, kp, kl)?), guest_slice(mem, vp, vl)?);
                Ok(s.node.shared_set(&key, value, cas as u32))
            })
        },
    )?;
    Ok(())
}

/// ngx_wasm_module without a `shm_kv` zone: every shared-data call traps.
fn no_shm_kv(c: &Caller<'_, VmState>, what: &str) -> Result<()> {
    if c.data().node.profile() == (crate::Profile::Nginx { shm_kv: false }) {
        bail!("[wasm] failed {what} shm (could not resolve namespace)");
    }
    Ok(())
}

/// ngx_wasm_module's upstream of `proxy_http_call`: `host:port`, the host an IP address or a
/// name its resolver looks up (not an `upstream {}` block).
fn nginx_upstream(upstream: &str) -> bool {
    let (host, port) = match upstream.rsplit_once(':') {
        Some((h, p)) => (h.trim_start_matches('[').trim_end_matches(']'), p),
        None => return false,
    };
    let name = !host.is_empty()
        && host
            .split('.')
            .all(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') && !l.starts_with('-'));
    (host.parse::<std::net::IpAddr>().is_ok() || name) && port.parse::<u16>().is_ok_and(|p| p > 0)
}

/// Local replies, dispatched HTTP calls, and stream control.
fn calls(linker: &mut Linker<VmState>) -> Result<()> {
    linker.func_wrap(
        "env",
        "proxy_send_local_response",
        |mut c: Caller<'_, VmState>,
         code: i32,
         _dp: i32,
         _dl: i32,
         bp: i32,
         bl: i32,
         hp: i32,
         hl: i32,
         _grpc: i32|
         -> Result<i32> {
            let body = read(&mut c, bp, bl)?;
            let headers = deserialize_map(&read(&mut c, hp, hl)?)?
                .into_iter()
                .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
                .collect();
            let ctx = c.data().effective_context;
            // ngx_wasm_module gives a local response sent in the answer to a call that failed
            // a body buffer the call's closing socket then empties: NGINX sends nothing at all
            // ("zero size buf in writer"); the client sees the connection closed.
            let failed_call = c.data().call_response.as_ref().is_some_and(|(h, _)| h.is_empty());
            let reply = if nginx(&c) && failed_call && !body.is_empty() {
                LocalReply { status: 0, headers: Vec::new(), body: Vec::new() }
            } else {
                LocalReply { status: code as u32, headers, body }
            };
            c.data_mut().local_replies.insert(ctx, reply);
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_http_call",
        |mut c: Caller<'_, VmState>,
         up: i32,
         ul: i32,
         hp: i32,
         hl: i32,
         bp: i32,
         bl: i32,
         _tp: i32,
         _tl: i32,
         timeout: i32,
         ret: i32|
         -> Result<i32> {
            let upstream = read_str(&mut c, up, ul)?;
            if nginx(&c) && !nginx_upstream(&upstream) {
                let line = format!("[wasm] dispatch failed: invalid host \"{upstream}\" (expected host:port)");
                c.data().node.state.log(4, line);
                return Ok(status::INTERNAL_FAILURE);
            }
            let headers = deserialize_map(&read(&mut c, hp, hl)?)?;
            let body = read(&mut c, bp, bl)?;
            let token = c.data().node.state.next_token.fetch_add(1, Ordering::SeqCst) + 1;
            let context = c.data().effective_context;
            c.data_mut().callouts.push(Callout { token, context, upstream, headers, body, timeout_ms: timeout as u32 });
            write_u32(&mut c, ret, token)?;
            Ok(status::OK)
        },
    )?;
    linker.func_wrap("env", "proxy_set_effective_context", |mut c: Caller<'_, VmState>, ctx: i32| -> i32 {
        // ngx_wasm_module accepts the call and does nothing.
        if !nginx(&c) {
            c.data_mut().effective_context = ctx as u32;
        }
        status::OK
    })?;
    linker.func_wrap("env", "proxy_continue_stream", |mut c: Caller<'_, VmState>, _t: i32| -> i32 {
        // Envoy resumes the effective context; ngx_wasm_module the request whose callback
        // runs (from the root's tick, none).
        let ctx = if nginx(&c) { c.data().current } else { c.data().effective_context };
        if !c.data().is_root(ctx) {
            c.data_mut().resumed.insert(ctx);
        }
        status::OK
    })?;
    Ok(())
}

/// Counters and gauges, one registry per node.
fn metrics(linker: &mut Linker<VmState>) -> Result<()> {
    linker.func_wrap(
        "env",
        "proxy_define_metric",
        |mut c: Caller<'_, VmState>, kind: i32, np: i32, nl: i32, ret: i32| -> Result<i32> {
            let name = read_str(&mut c, np, nl)?;
            let id = lock(&c.data().node.state.metrics).define(name, kind);
            write_u32(&mut c, ret, id as u32)?;
            Ok(status::OK)
        },
    )?;
    linker.func_wrap("env", "proxy_increment_metric", |c: Caller<'_, VmState>, id: i32, by: i64| -> i32 {
        match lock(&c.data().node.state.metrics).get_mut(id as u32 as usize) {
            Some(m) => {
                m.value = m.value.saturating_add(by);
                status::OK
            }
            None => status::NOT_FOUND,
        }
    })?;
    linker.func_wrap("env", "proxy_record_metric", |c: Caller<'_, VmState>, id: i32, v: i64| -> i32 {
        match lock(&c.data().node.state.metrics).get_mut(id as u32 as usize) {
            Some(m) => {
                m.value = v;
                status::OK
            }
            None => status::NOT_FOUND,
        }
    })?;
    linker.func_wrap("env", "proxy_get_metric", |mut c: Caller<'_, VmState>, id: i32, ret: i32| -> Result<i32> {
        let v = lock(&c.data().node.state.metrics).get(id as u32 as usize).map(|m| m.value);
        match v {
            Some(v) => {
                write_u64(&mut c, ret, v as u64)?;
                Ok(status::OK)
            }
            None => Ok(status::NOT_FOUND),
        }
    })?;
    Ok(())
}
