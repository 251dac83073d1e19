//! Text helpers of the request path: bytes as `str` without a full UTF-8 pass for ASCII,
//! and decimal numbers without `core::fmt`. A leaf: it imports nothing from the crate.

use alloc::string::String;

/// `bytes` as text. ASCII — header names, numbers, addresses, most paths — passes a much
/// simpler test than full UTF-8 validation, which costs several times more on short strings
/// on the request path; anything else is validated in full.
pub fn text(bytes: &[u8]) -> Option<&str> {
    if bytes.is_ascii() {
        // SAFETY: every ASCII byte sequence is valid UTF-8.
        Some(unsafe { core::str::from_utf8_unchecked(bytes) })
    } else {
        core::str::from_utf8(bytes).ok()
    }
}

/// `v` in decimal ASCII digits, written into `buf` (no allocation).
pub fn digits(mut v: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        if let Some(b) = buf.get_mut(i) {
            *b = b'0' + (v % 10) as u8;
        }
        v /= 10;
        if v == 0 || i == 0 {
            break;
        }
    }
    buf.get(i..).unwrap_or(&[])
}

/// Appends `v` in decimal (`core::fmt` costs several times more on this hot path).
pub fn push_decimal(out: &mut String, v: u64) {
    let mut buf = [0u8; 20];
    // ASCII digits: always valid UTF-8, appended at once rather than char by char.
    out.push_str(text(digits(v, &mut buf)).unwrap_or(""));
}

/// `v` in decimal, as a new string.
pub fn decimal(v: u64) -> String {
    let mut s = String::with_capacity(20);
    push_decimal(&mut s, v);
    s
}
