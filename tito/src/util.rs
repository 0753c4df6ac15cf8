//! Small helpers every layer uses, written once: a lock that ignores poisoning and a saturating
//! millisecond count.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Locks `mutex`, taking the value over from a thread that panicked while holding it: every
/// value Tito keeps behind a mutex (caches, registries, counters) stays valid between
/// statements, so a panic elsewhere must not make it unusable.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `duration` in whole milliseconds, `u64::MAX` when it does not fit.
pub(crate) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
