//! A stable, dependency-free hash for configuration strings and long key parts (never for
//! anything a client could profit from colliding without knowing a secret).

/// 64-bit FNV-1a of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The key of the hash secret identity values are counted and shown by: SipHash-2-4 keys
/// derived from a deployment's secret with HMAC-SHA-256, so every node of the deployment
/// agrees and nobody without the secret can hash a guess to find a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HashKey(u64, u64);

impl HashKey {
    /// The key derived from `secret`.
    pub fn derive(secret: &[u8]) -> HashKey {
        use hmac::{Hmac, Mac};
        let mac = match Hmac::<sha2::Sha256>::new_from_slice(secret) {
            Ok(mut mac) => {
                mac.update(b"ratewall identity hash v1");
                mac.finalize().into_bytes()
            }
            // HMAC takes keys of any length: not reached.
            Err(_) => Default::default(),
        };
        let word = |i: usize| {
            let mut w = [0u8; 8];
            if let Some(b) = mac.get(i..i + 8) {
                w.copy_from_slice(b);
            }
            u64::from_le_bytes(w)
        };
        HashKey(word(0), word(8))
    }

    /// The keyed hash of `value`.
    pub fn hash(&self, value: &[u8]) -> u64 {
        use core::hash::Hasher;
        let mut h = siphasher::sip::SipHasher24::new_with_keys(self.0, self.1);
        h.write(value);
        h.finish()
    }
}
