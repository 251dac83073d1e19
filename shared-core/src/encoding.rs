//! The versioned byte encoding of [`State`], shared by proxy-wasm shared data and Durable
//! Object storage.
//!
//! Layout: `version (1) | tag (1) | fields`, little-endian:
//!
//! | tag | state          | fields                                   | bytes |
//! |-----|----------------|------------------------------------------|-------|
//! | 0   | fresh          | —                                        | 2     |
//! | 1   | token bucket   | `tat: u64`                               | 10    |
//! | 2   | sliding window | `window: u64, prev: u32, curr: u32`      | 18    |
//! | 3   | fixed window   | `window: u64, count: u32`                | 14    |
//! | 5   | sliding log    | `newest: varint, slots: varint` (a bit per slot holding units), one `varint` count per such slot | ≤ 29 under a limit of ≤ 10,000 |
//!
//! Tag 4 (an exact log, one timestamp per unit) is no longer written or read.
//!
//! Decoding returns the bytes it consumed, so encodings can be concatenated.

use crate::algo::{State, LOG_SLOTS};
use alloc::vec::Vec;

/// The encoding's version byte.
pub const VERSION: u8 = 1;

/// Why bytes are not a valid state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// Fewer bytes than the layout needs.
    Truncated,
    /// A version this build does not know.
    Version(u8),
    /// An unknown state tag.
    Tag(u8),
    /// A sliding log longer than any limit allows, or not in time order.
    BadLog,
    /// A field that is not one of its values: what it is.
    Invalid(&'static str),
}

impl core::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            DecodeError::Truncated => f.write_str("the bytes are truncated"),
            DecodeError::Version(v) => write!(f, "unknown encoding version {v}"),
            DecodeError::Tag(t) => write!(f, "unknown tag {t}"),
            DecodeError::BadLog => f.write_str("a sliding log is too long or out of order"),
            DecodeError::Invalid(what) => write!(f, "invalid {what}"),
        }
    }
}

impl core::error::Error for DecodeError {}

impl State {
    /// Appends this state's encoding to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.push(VERSION);
        match self {
            State::Fresh => out.push(0),
            State::TokenBucket { tat } => {
                out.push(1);
                out.extend_from_slice(&tat.to_le_bytes());
            }
            State::SlidingWindow { window, prev, curr } => {
                out.push(2);
                out.extend_from_slice(&window.to_le_bytes());
                out.extend_from_slice(&prev.to_le_bytes());
                out.extend_from_slice(&curr.to_le_bytes());
            }
            State::FixedWindow { window, count } => {
                out.push(3);
                out.extend_from_slice(&window.to_le_bytes());
                out.extend_from_slice(&count.to_le_bytes());
            }
            State::SlidingLog { newest, counts } => {
                // Tag 5: the slot index, a bit per slot holding units, then their counts.
                out.push(5);
                put_varint(out, *newest);
                let bits = counts.iter().enumerate().fold(0u64, |b, (i, &c)| if c > 0 { b | 1 << i } else { b });
                put_varint(out, bits);
                for &c in counts.iter().filter(|&&c| c > 0) {
                    put_varint(out, u64::from(c));
                }
            }
        }
    }

    /// This state's encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(18);
        self.encode_into(&mut out);
        out
    }

    /// Decodes a state from the front of `bytes`; returns it and the bytes consumed.
    pub fn decode(bytes: &[u8]) -> Result<(State, usize), DecodeError> {
        let mut r = Reader { bytes, pos: 0 };
        let version = r.u8()?;
        if version != VERSION {
            return Err(DecodeError::Version(version));
        }
        let state = match r.u8()? {
            0 => State::Fresh,
            1 => State::TokenBucket { tat: r.u64()? },
            2 => State::SlidingWindow { window: r.u64()?, prev: r.u32()?, curr: r.u32()? },
            3 => State::FixedWindow { window: r.u64()?, count: r.u32()? },
            // Tag 4 was the exact log of one timestamp per unit, unbounded in size; its keys
            // changed with the counter-key format, so no such state is read any more.
            5 => {
                let newest = r.varint()?;
                let bits = r.varint()?;
                if bits >> LOG_SLOTS != 0 {
                    return Err(DecodeError::BadLog);
                }
                let mut counts = [0u16; LOG_SLOTS];
                for (i, c) in counts.iter_mut().enumerate() {
                    if bits & (1 << i) != 0 {
                        *c = u16::try_from(r.varint()?).map_err(|_| DecodeError::BadLog)?;
                    }
                }
                State::SlidingLog { newest, counts }
            }
            tag => return Err(DecodeError::Tag(tag)),
        };
        Ok((state, r.pos))
    }
}

/// Appends `v` as a LEB128 varint.
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A bounds-checked little-endian reader over a byte slice.
pub struct Reader<'a> {
    /// The bytes read.
    pub bytes: &'a [u8],
    /// The position of the next byte.
    pub pos: usize,
}

impl<'a> Reader<'a> {
    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or(DecodeError::Truncated)?;
        let s = self.bytes.get(self.pos..end).ok_or(DecodeError::Truncated)?;
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }
    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// A LEB128 varint; one of more than 64 bits is malformed (never read as its low bits).
    pub fn varint(&mut self) -> Result<u64, DecodeError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            // The tenth byte holds the 64th bit alone.
            if shift == 63 && b > 1 {
                return Err(DecodeError::Invalid("varint (over 64 bits)"));
            }
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(DecodeError::Invalid("varint (over 10 bytes)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_varint_over_64_bits_is_malformed() {
        let read = |b: &[u8]| Reader { bytes: b, pos: 0 }.varint();
        assert_eq!(read(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]), Ok(u64::MAX));
        assert_eq!(read(&[0x85, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00]), Ok(5));
        // 5 + 2^64: it was read as 5.
        assert!(read(&[0x85, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x02]).is_err());
        assert!(read(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]).is_err());
        assert!(read(&[0x80; 11]).is_err());
    }

    #[test]
    fn window_states_fit_in_18_bytes() {
        assert_eq!(State::TokenBucket { tat: u64::MAX }.encode().len(), 10);
        assert_eq!(State::SlidingWindow { window: 1, prev: 2, curr: 3 }.encode().len(), 18);
        assert_eq!(State::FixedWindow { window: 1, count: 2 }.encode().len(), 14);
        // A log under the largest limit it takes, every slot full, its slot index 7 bytes
        // long (a 1 ms window in 2026): 29 bytes.
        let full = State::SlidingLog { newest: 14_000_000_000_000, counts: [10_000; crate::algo::LOG_SLOTS] };
        assert!(core::mem::size_of::<State>() <= 32, "{} bytes", core::mem::size_of::<State>());
        assert_eq!(full.encode().len(), 29);
    }

    #[test]
    fn concatenated_states_decode_in_order() {
        let a = State::SlidingLog { newest: 1 << 40, counts: [0, 3, 0, 0, 1, 0, 0, 0, 200] };
        let b = State::FixedWindow { window: 7, count: 3 };
        let mut bytes = a.encode();
        b.encode_into(&mut bytes);
        let (da, n) = State::decode(&bytes).unwrap();
        let (db, m) = State::decode(&bytes[n..]).unwrap();
        assert_eq!((da, db, n + m), (a, b, bytes.len()));
    }

    #[test]
    fn unknown_version_and_tag_are_errors() {
        assert_eq!(State::decode(&[2, 1]), Err(DecodeError::Version(2)));
        assert_eq!(State::decode(&[1, 9]), Err(DecodeError::Tag(9)));
        assert_eq!(State::decode(&[1, 1, 0]), Err(DecodeError::Truncated));
    }
}
