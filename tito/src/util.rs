//! Small helpers every layer uses, written once: a lock that ignores poisoning, a saturating
//! millisecond count, a saturating deadline and this process's name.

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

/// How far ahead [`deadline_after`] puts a deadline that does not fit an `Instant`: about 30
/// years, as Tokio's own "far future".
const FAR_FUTURE: Duration = Duration::from_secs(30 * 365 * 24 * 60 * 60);

/// The instant `within` from now. A duration too long for an `Instant` (`Duration::MAX`, a
/// caller's "wait as long as it takes") gives a deadline far in the future instead of the
/// panic of `Instant + Duration`.
pub(crate) fn deadline_after(within: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(within)
        .or_else(|| now.checked_add(FAR_FUTURE))
        .unwrap_or(now)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn deadlines_saturate_instead_of_panicking() {
        let now = tokio::time::Instant::now();
        let soon = deadline_after(Duration::from_secs(2));
        assert!(soon >= now + Duration::from_secs(2) && soon < now + Duration::from_secs(60));
        for forever in [Duration::MAX, Duration::from_secs(u64::MAX / 2)] {
            assert!(deadline_after(forever) > now + Duration::from_secs(10 * 365 * 86_400));
        }
    }
}
