//! Small helpers every layer uses, written once: a lock that ignores poisoning, a saturating
//! millisecond count and this process's name.

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

/// This process, as a schedule's cursor and a worker's report name it: `pid N on HOST`.
pub(crate) fn runner() -> &'static str {
    static RUNNER: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    RUNNER.get_or_init(|| {
        let host = std::fs::read_to_string("/etc/hostname")
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .or_else(|| std::env::var("HOSTNAME").ok())
            .or_else(|| std::env::var("COMPUTERNAME").ok())
            .unwrap_or_else(|| "an unnamed host".into());
        format!("pid {} on {host}", std::process::id())
    })
}
