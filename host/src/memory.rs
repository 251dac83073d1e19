//! Guest memory and the proxy-wasm map codec: reading and writing through guest pointers,
//! returning bytes through the guest's allocator, (de)serializing header maps.

use crate::abi::*;
use crate::vm::*;
use wasmtime::{bail, format_err, Caller, Extern, Memory, Result};

pub(crate) fn memory(caller: &mut Caller<'_, VmState>) -> Result<Memory> {
    if let Some(m) = caller.data().memory {
        return Ok(m);
    }
    match caller.get_export("memory") {
        Some(Extern::Memory(m)) => Ok(m),
        _ => bail!("the module exports no memory"),
    }
}

/// Reads guest memory `ptr..ptr+len`; sizes are u32 on wasm32 (`-1` means `u32::MAX`).
pub(crate) fn read(caller: &mut Caller<'_, VmState>, ptr: i32, len: i32) -> Result<Vec<u8>> {
    let mem = memory(caller)?;
    let (ptr, len) = (ptr as u32 as usize, len as u32 as usize);
    mem.data(&caller)
        .get(ptr..ptr.checked_add(len).ok_or_else(|| format_err!("overflow"))?)
        .map(<[u8]>::to_vec)
        .ok_or_else(|| format_err!("guest pointer {ptr}+{len} out of bounds"))
}

/// Guest memory `ptr..ptr+len`, borrowed (no copy) beside the VM's state.
pub(crate) fn guest_slice(mem: &[u8], ptr: i32, len: i32) -> Result<&[u8]> {
    let (ptr, len) = (ptr as u32 as usize, len as u32 as usize);
    mem.get(ptr..ptr.checked_add(len).ok_or_else(|| format_err!("overflow"))?)
        .ok_or_else(|| format_err!("guest pointer {ptr}+{len} out of bounds"))
}

/// Runs `f` on guest memory and the VM state at once, so keys and values are read in place.
pub(crate) fn with_memory<R>(
    caller: &mut Caller<'_, VmState>,
    f: impl FnOnce(&[u8], &mut VmState) -> Result<R>,
) -> Result<R> {
    let mem = memory(caller)?;
    let (data, state) = mem.data_and_store_mut(caller);
    f(data, state)
}

/// Guest bytes as text, as the proxy would treat a key (invalid UTF-8 replaced).
pub(crate) fn text(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    match std::str::from_utf8(bytes) {
        Ok(s) => std::borrow::Cow::Borrowed(s),
        Err(_) => String::from_utf8_lossy(bytes),
    }
}

pub(crate) fn read_str(caller: &mut Caller<'_, VmState>, ptr: i32, len: i32) -> Result<String> {
    let bytes = read(caller, ptr, len)?;
    Ok(String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
}

/// A header name from guest memory, lower-cased as the proxy keeps names (one allocation).
pub(crate) fn read_name(caller: &mut Caller<'_, VmState>, ptr: i32, len: i32) -> Result<String> {
    let mut name = read_str(caller, ptr, len)?;
    name.make_ascii_lowercase();
    Ok(name)
}

pub(crate) fn write_u32(caller: &mut Caller<'_, VmState>, ptr: i32, v: u32) -> Result<()> {
    let mem = memory(caller)?;
    mem.write(caller, ptr as u32 as usize, &v.to_le_bytes())?;
    Ok(())
}

pub(crate) fn write_u64(caller: &mut Caller<'_, VmState>, ptr: i32, v: u64) -> Result<()> {
    let mem = memory(caller)?;
    mem.write(caller, ptr as u32 as usize, &v.to_le_bytes())?;
    Ok(())
}

/// Copies `data` into a buffer the guest allocates (at exactly `data.len()` bytes, since the
/// SDK frees it as a `Vec` of that capacity), then stores its address and size. Memory may
/// grow during the allocation, so no view of it is held across the call.
pub(crate) fn return_bytes(caller: &mut Caller<'_, VmState>, data: &[u8], ret_ptr: i32, ret_size: i32) -> Result<()> {
    // Taken out and put back rather than cloned: a TypedFunc clone costs a type-registry
    // refcount round trip on every host call that returns data.
    let alloc = match caller.data_mut().alloc.take() {
        Some(a) => a,
        None => ["malloc", "proxy_on_memory_allocate"]
            .iter()
            .find_map(|n| caller.get_export(n).and_then(Extern::into_func))
            .ok_or_else(|| format_err!("the module exports no allocator"))?
            .typed::<i32, i32>(&caller)?,
    };
    let addr = if data.is_empty() { Ok(0) } else { alloc.call(&mut *caller, data.len() as i32) };
    caller.data_mut().alloc = Some(alloc);
    let addr = addr?;
    if !data.is_empty() {
        if addr == 0 {
            bail!("guest allocation of {} bytes failed", data.len());
        }
        let mem = memory(caller)?;
        mem.write(&mut *caller, addr as u32 as usize, data)?;
    }
    write_u32(caller, ret_ptr, addr as u32)?;
    write_u32(caller, ret_size, data.len() as u32)
}

/// Answers a getter: NotFound for `None`, else the bytes copied into the guest and Ok.
pub(crate) fn reply_bytes(
    caller: &mut Caller<'_, VmState>,
    value: Option<Vec<u8>>,
    ret_ptr: i32,
    ret_size: i32,
) -> Result<i32> {
    match value {
        None => Ok(status::NOT_FOUND),
        Some(v) => {
            return_bytes(caller, &v, ret_ptr, ret_size)?;
            Ok(status::OK)
        }
    }
}

/// The proxy-wasm header map encoding, into `out` (cleared first; its capacity is reused).
pub(crate) fn serialize_map(pairs: &[(String, Vec<u8>)], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(4 + pairs.iter().map(|(k, v)| 10 + k.len() + v.len()).sum::<usize>());
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
}

/// Decodes [`serialize_map`]'s encoding; a truncated map is an error (never a panic, and
/// never an allocation larger than the bytes given, whatever count a guest claims).
pub(crate) fn deserialize_map(bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>> {
    let u32_at = |at: usize| -> Result<usize> {
        let b = bytes.get(at..at + 4).ok_or_else(|| format_err!("header map truncated"))?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    let n = u32_at(0)?;
    let mut p = n.checked_mul(8).and_then(|b| b.checked_add(4)).ok_or_else(|| format_err!("header map truncated"))?;
    // Each pair takes at least 10 bytes (two lengths, two NULs).
    let mut out = Vec::with_capacity(n.min(bytes.len() / 10));
    for i in 0..n {
        let (kl, vl) = (u32_at(4 + i * 8)?, u32_at(8 + i * 8)?);
        let truncated = || format_err!("header map truncated");
        let k = bytes.get(p..p.checked_add(kl).ok_or_else(truncated)?).ok_or_else(truncated)?;
        p = p.saturating_add(kl).saturating_add(1);
        let v = bytes.get(p..p.checked_add(vl).ok_or_else(truncated)?).ok_or_else(truncated)?;
        p = p.saturating_add(vl).saturating_add(1);
        out.push((String::from_utf8_lossy(k).into_owned(), v.to_vec()));
    }
    Ok(out)
}

pub(crate) fn map_for(state: &mut VmState, map_type: i32) -> Option<&mut Vec<(String, Vec<u8>)>> {
    match map_type {
        MAP_REQUEST_HEADERS => Some(&mut state.request_headers),
        MAP_RESPONSE_HEADERS => Some(&mut state.response_headers),
        MAP_HTTP_CALL_RESPONSE_HEADERS => state.call_response.as_mut().map(|(h, _)| h),
        _ => None,
    }
}
