//! WASI shims for wasm32-wasip1 builds.

use crate::memory::*;
use crate::vm::*;
use wasmtime::{bail, Caller, Linker, Result, Val};

/// Minimal WASI shims for wasm32-wasip1 builds: output goes to the node log, the clock is
/// the virtual one, and the rest reports ENOSYS.
pub(crate) fn define_wasi(linker: &mut Linker<VmState>, m: &str, n: &str, ty: wasmtime::FuncType) -> Result<()> {
    const ENOSYS: i32 = 52;
    match n {
        "fd_write" => {
            linker.func_wrap(
                m,
                n,
                |mut c: Caller<'_, VmState>, _fd: i32, iovs: i32, len: i32, ret: i32| -> Result<i32> {
                    let mut total = 0u32;
                    let mut text = Vec::new();
                    for i in 0..len {
                        let iov = read(&mut c, iovs + i * 8, 8)?;
                        let (p, l) = (
                            u32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]),
                            u32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]),
                        );
                        text.extend(read(&mut c, p as i32, l as i32)?);
                        total += l;
                    }
                    c.data().node.state.log(2, String::from_utf8_lossy(&text).into_owned());
                    write_u32(&mut c, ret, total)?;
                    Ok(0)
                },
            )?;
        }
        "clock_time_get" => {
            linker.func_wrap(m, n, |mut c: Caller<'_, VmState>, _id: i32, _prec: i64, ret: i32| -> Result<i32> {
                let now = c.data().node.now();
                write_u64(&mut c, ret, now)?;
                Ok(0)
            })?;
        }
        "environ_sizes_get" | "args_sizes_get" => {
            linker.func_wrap(m, n, |mut c: Caller<'_, VmState>, a: i32, b: i32| -> Result<i32> {
                write_u32(&mut c, a, 0)?;
                write_u32(&mut c, b, 0)?;
                Ok(0)
            })?;
        }
        "proc_exit" => {
            linker
                .func_wrap(m, n, |_c: Caller<'_, VmState>, code: i32| -> Result<()> { bail!("proc_exit({code})") })?;
        }
        _ => {
            linker.func_new(m, n, ty, move |_c, _args, results| {
                if let Some(r) = results.first_mut() {
                    *r = Val::I32(ENOSYS);
                }
                Ok(())
            })?;
        }
    }
    Ok(())
}
