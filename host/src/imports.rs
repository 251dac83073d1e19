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
            lock(&c.data().node.state.logs).push((level, msg));
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
        |mut c: Caller<'_, VmState>, period: i32| -> i32 {
            c.data_mut().tick_period_ms = period as u32;
            status::OK
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_buffer_bytes",
        |mut c: Caller<'_, VmState>, kind: i32, start: i32, max: i32, ret_ptr: i32, ret_size: i32| -> Result<i32> {
            let data = match kind {
                BUFFER_PLUGIN_CONFIGURATION => c.data().plugin_config.clone(),
                BUFFER_VM_CONFIGURATION => Vec::new(),
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
            let parts: Vec<&[u8]> = path.split(|&b| b == 0).collect();
            let value = match parts.as_slice() {
                [b"source", b"address"] => c.data().source_address.clone().map(String::into_bytes),
                [b"plugin_root_id"] | [b"plugin_name"] => Some(b"ratewall".to_vec()),
                [b"node", b"id"] => c.data().node.state.id.get().map(|s| s.clone().into_bytes()),
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
            with_memory(&mut c, |mem, s| {
                let (key, value) = (text(guest_slice(mem, kp, kl)?), guest_slice(mem, vp, vl)?);
                Ok(s.node.shared_set(&key, value, cas as u32))
            })
        },
    )?;
    Ok(())
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
            c.data_mut().local_replies.insert(ctx, LocalReply { status: code as u32, headers, body });
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
        c.data_mut().effective_context = ctx as u32;
        status::OK
    })?;
    linker.func_wrap("env", "proxy_continue_stream", |mut c: Caller<'_, VmState>, _t: i32| -> i32 {
        let ctx = c.data().effective_context;
        c.data_mut().resumed.insert(ctx);
        status::OK
    })?;
    linker.func_wrap("env", "proxy_close_stream", |_c: Caller<'_, VmState>, _t: i32| -> i32 { status::OK })?;
    linker.func_wrap("env", "proxy_done", |_c: Caller<'_, VmState>| -> i32 { status::OK })?;
    Ok(())
}

/// Counters and gauges, one registry per node.
fn metrics(linker: &mut Linker<VmState>) -> Result<()> {
    linker.func_wrap(
        "env",
        "proxy_define_metric",
        |mut c: Caller<'_, VmState>, kind: i32, np: i32, nl: i32, ret: i32| -> Result<i32> {
            let name = read_str(&mut c, np, nl)?;
            let id = {
                let mut metrics = lock(&c.data().node.state.metrics);
                match metrics.iter().position(|m| m.name == name) {
                    Some(i) => i,
                    None => {
                        metrics.push(Metric { name, kind, value: 0 });
                        metrics.len() - 1
                    }
                }
            };
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
