//! Authentication: HMAC-SHA256 tags over encoded bodies, and their hex form.

use alloc::vec::Vec;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Lower-case hex, as signatures travel in the `x-ratewall-signature` header.
pub fn hex(bytes: &[u8]) -> alloc::string::String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = alloc::string::String::with_capacity(bytes.len() * 2);
    for b in bytes {
        for d in [b >> 4, b & 15] {
            s.push(char::from(DIGITS.get(usize::from(d)).copied().unwrap_or(b'0')));
        }
    }
    s
}

/// Parses [`hex`] (either case); `None` on an odd length or a non-hex digit.
pub fn unhex(s: &[u8]) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    s.chunks(2)
        .map(|p| {
            let d = |c: u8| char::from(c).to_digit(16);
            Some((d(*p.first()?)? * 16 + d(*p.get(1)?)?) as u8)
        })
        .collect()
}

/// HMAC-SHA256 of `body` under `secret`.
pub fn sign(secret: &[u8], body: &[u8]) -> [u8; 32] {
    // HMAC accepts keys of any length, so `new_from_slice` cannot fail.
    match Hmac::<Sha256>::new_from_slice(secret) {
        Ok(mut mac) => {
            mac.update(body);
            mac.finalize().into_bytes().into()
        }
        Err(_) => [0; 32],
    }
}

/// Whether `tag` is the HMAC-SHA256 of `body` under `secret` (constant-time comparison).
pub fn verify(secret: &[u8], body: &[u8], tag: &[u8]) -> bool {
    match Hmac::<Sha256>::new_from_slice(secret) {
        Ok(mut mac) => {
            mac.update(body);
            mac.verify_slice(tag).is_ok()
        }
        Err(_) => false,
    }
}
