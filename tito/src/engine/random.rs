//! Randomness for jitter and marker nonces: splitmix64 from a seed (repeatable runs), or the
//! standard library's randomly keyed hasher. No extra dependency.

use std::hash::{BuildHasher, Hasher};

/// splitmix64's finalizer: a well-spread number from a seed.
pub(crate) fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A random number from the standard library's randomly keyed hasher: enough for jitter, and
/// no extra dependency.
pub(crate) fn random_u64() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(0x9e37_79b9_7f4a_7c15);
    hasher.finish()
}
