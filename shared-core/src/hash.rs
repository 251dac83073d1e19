//! A stable, dependency-free hash for configuration strings, limit fingerprints and long key
//! parts (never for anything a client could profit from colliding without knowing a secret).

/// 64-bit FNV-1a of `bytes`, continuing from `state` (start with [`FNV_OFFSET`]).
pub const fn fnv1a_from(mut state: u64, bytes: &[u8]) -> u64 {
    let mut i = 0;
    while i < bytes.len() {
        state = (state ^ bytes[i] as u64).wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    state
}

/// FNV-1a's initial state.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// 64-bit FNV-1a of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    fnv1a_from(FNV_OFFSET, bytes)
}
