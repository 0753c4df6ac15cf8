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

/// Exponential backoff with jitter: after failure number `attempt` (from 1), a delay drawn
/// uniformly from the upper half of `min(max, initial * 2^(attempt-1))`, from `seed`'s fixed
/// sequence when given (runs under simulated time), else from the process's randomness.
pub(crate) fn jittered_backoff(
    initial: std::time::Duration,
    max: std::time::Duration,
    attempt: u32,
    seed: Option<u64>,
) -> std::time::Duration {
    let exp = attempt.saturating_sub(1).min(30);
    let ceiling = initial.saturating_mul(1 << exp).min(max);
    let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
    if nanos == 0 {
        return std::time::Duration::ZERO;
    }
    let half = nanos / 2;
    let random = match seed {
        Some(seed) => splitmix(seed ^ u64::from(attempt)),
        None => random_u64(),
    };
    std::time::Duration::from_nanos(half + random % (nanos - half).max(1))
}
