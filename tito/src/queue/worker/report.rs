//! A worker's report: who runs it and what its handlers did in the last minutes, written to
//! `{queue}:report:{worker}` about every [`REPORT_EVERY`] and when the worker stops, so an
//! operator (the dashboard, `tito queue stats`) sees handler figures, hosts and ages without a
//! metrics backend.
//!
//! The report is advisory: a write that fails is logged and tried again at the next interval,
//! and nothing reads it to decide anything. Reports not written for [`REPORT_KEPT`] are deleted
//! by the next worker that starts on the queue.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::TitoResult;
use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::keys;
use crate::queue::Queue;

/// How often a running worker writes its report.
pub const REPORT_EVERY: Duration = Duration::from_secs(10);

/// How many minutes of handler figures a report keeps (the current, partial minute first).
pub const REPORT_MINUTES: usize = 10;

/// How long a report nobody writes is kept (a worker that stopped, or whose process died).
pub const REPORT_KEPT: Duration = Duration::from_secs(3600);

/// How many stale reports a starting worker deletes at most (the rest go at later starts).
const STALE_SWEEP: usize = 256;

/// The handlers of one worker in one minute.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MinuteFigures {
    /// The minute (Unix seconds / 60, by the worker's clock).
    pub minute: u64,
    /// Handler runs that ended in this minute.
    pub runs: u64,
    /// Of those, the ones that failed (an error, a panic or a timeout).
    pub failed: u64,
    /// Their run time, summed (ms).
    pub total_ms: u64,
    /// The longest of them (ms).
    pub max_ms: u64,
}

impl MinuteFigures {
    /// Adds another minute's figures to these.
    pub fn add(&mut self, other: &MinuteFigures) {
        self.runs += other.runs;
        self.failed += other.failed;
        self.total_ms += other.total_ms;
        self.max_ms = self.max_ms.max(other.max_ms);
    }

    /// The mean run time (ms), if anything ran.
    pub fn mean_ms(&self) -> Option<u64> {
        (self.runs > 0).then(|| self.total_ms / self.runs)
    }
}

/// A worker's report as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerReport {
    /// The worker's id (the holder its leases name).
    pub worker: String,
    /// The process that runs it: `pid N on HOST`.
    pub runner: String,
    /// When the worker wrote its first report (engine time, Unix ms).
    pub started_ms: u64,
    /// When it wrote this one (engine time, Unix ms).
    pub written_ms: u64,
    /// The worker stopped (shut down) after writing it.
    pub stopped: bool,
    /// Its handlers in the last [`REPORT_MINUTES`] minutes, newest first; minutes without runs
    /// are left out.
    pub minutes: Vec<MinuteFigures>,
}

impl WorkerReport {
    /// The figures of the minutes at or after `since_minute`, summed.
    pub fn since(&self, since_minute: u64) -> MinuteFigures {
        let mut sum = MinuteFigures {
            minute: since_minute,
            ..MinuteFigures::default()
        };
        for minute in self.minutes.iter().filter(|m| m.minute >= since_minute) {
            sum.add(minute);
        }
        sum
    }
}

/// Handler runs of one worker, per minute; shared by the worker loop and its handler tasks.
#[derive(Debug, Default)]
pub(crate) struct Figures {
    minutes: Mutex<VecDeque<MinuteFigures>>,
}

impl Figures {
    /// Records one handler run that took `took` and failed or not.
    pub fn record(&self, took: Duration, failed: bool) {
        let minute = (chrono::Utc::now().timestamp().max(0) as u64) / 60;
        let ms = crate::util::millis(took);
        let mut minutes = crate::util::lock(&self.minutes);
        if minutes.front().is_none_or(|m| m.minute < minute) {
            minutes.push_front(MinuteFigures {
                minute,
                ..MinuteFigures::default()
            });
            minutes.truncate(REPORT_MINUTES);
        }
        // A clock that stepped back files the run under the newest minute.
        let current = minutes.front_mut().expect("a minute was just pushed");
        current.runs += 1;
        current.failed += u64::from(failed);
        current.total_ms = current.total_ms.saturating_add(ms);
        current.max_ms = current.max_ms.max(ms);
    }

    fn snapshot(&self) -> Vec<MinuteFigures> {
        let now = (chrono::Utc::now().timestamp().max(0) as u64) / 60;
        let oldest = now.saturating_sub(REPORT_MINUTES as u64 - 1);
        let minutes = crate::util::lock(&self.minutes);
        minutes
            .iter()
            .filter(|m| m.minute >= oldest)
            .cloned()
            .collect()
    }
}

/// Writes one worker's report.
pub(crate) struct Reporter {
    worker: String,
    pub figures: Arc<Figures>,
    started_ms: Option<u64>,
    next: Instant,
}

impl Reporter {
    pub fn new(worker: &str) -> Self {
        Reporter {
            worker: worker.to_string(),
            figures: Arc::default(),
            started_ms: None,
            next: Instant::now(),
        }
    }

    /// Writes the report when it is due (at once the first time, then every [`REPORT_EVERY`]).
    pub async fn write_if_due<E: TitoEngine>(&mut self, queue: &Queue<E>) {
        if Instant::now() >= self.next {
            self.write(queue, false).await;
        }
    }

    /// Writes the report now; `stopped` when the worker is done.
    pub async fn write<E: TitoEngine>(&mut self, queue: &Queue<E>, stopped: bool) {
        self.next = Instant::now() + REPORT_EVERY;
        let first = self.started_ms.is_none();
        let root = queue.root().to_string();
        let key = report_key(&root, &self.worker);
        let minutes = self.figures.snapshot();
        let (worker, started) = (self.worker.clone(), self.started_ms);
        let written: TitoResult<u64> = queue
            .engine()
            .transaction(|tx| {
                let (root, key, worker, minutes) =
                    (root.clone(), key.clone(), worker.clone(), minutes.clone());
                async move {
                    let now_ms = engine::version_millis(tx.start_version());
                    if first {
                        sweep_stale(&tx, &root, &key, now_ms).await?;
                    }
                    let report = WorkerReport {
                        worker,
                        runner: crate::util::runner().to_string(),
                        started_ms: started.unwrap_or(now_ms),
                        written_ms: now_ms,
                        stopped,
                        minutes,
                    };
                    tx.put(key.into_bytes(), serde_json::to_vec(&report)?)
                        .await?;
                    Ok::<_, crate::TitoError>(report.started_ms)
                }
            })
            .await;
        match written {
            Ok(started_ms) => self.started_ms = Some(started_ms),
            Err(err) => tracing::debug!(
                queue = %queue.label(),
                worker = %self.worker,
                error = %err,
                "a worker's report was not written; it is tried again later"
            ),
        }
    }
}

/// Deletes up to [`STALE_SWEEP`] reports of the queue not written for [`REPORT_KEPT`] (never
/// `own`, and never one that does not parse as a report: that is left for an operator).
async fn sweep_stale<X: TitoTransaction>(
    tx: &X,
    root: &str,
    own: &str,
    now_ms: u64,
) -> TitoResult<()> {
    let prefix = report_prefix(root);
    let end = keys::prefix_end(prefix.clone());
    let kept_ms = REPORT_KEPT.as_millis() as u64;
    for (key, value) in tx
        .scan(prefix.as_bytes(), end.as_bytes(), STALE_SWEEP)
        .await?
    {
        if key == own.as_bytes() {
            continue;
        }
        if let Ok(report) = serde_json::from_slice::<WorkerReport>(&value)
            && now_ms.saturating_sub(report.written_ms) > kept_ms
        {
            tx.delete(key).await?;
        }
    }
    Ok(())
}

/// `{queue}:report:{worker}`: a worker's report.
pub(crate) fn report_key(root: &str, worker: &str) -> String {
    let mut key = report_prefix(root);
    keys::encode_bounded(worker, &mut key);
    key
}

/// `{queue}:report:`, every worker report of a queue.
pub(crate) fn report_prefix(root: &str) -> String {
    format!("{root}:report:")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_sum_runs_failures_and_times_per_minute() {
        let figures = Figures::default();
        figures.record(Duration::from_millis(10), false);
        figures.record(Duration::from_millis(30), true);
        let minutes = figures.snapshot();
        assert_eq!(minutes.len(), 1);
        let m = &minutes[0];
        assert_eq!((m.runs, m.failed, m.total_ms, m.max_ms), (2, 1, 40, 30));
        assert_eq!(m.mean_ms(), Some(20));
        assert_eq!(MinuteFigures::default().mean_ms(), None);
    }

    #[test]
    fn a_report_sums_the_minutes_asked_for() {
        let minute = |minute, runs, failed| MinuteFigures {
            minute,
            runs,
            failed,
            total_ms: runs * 5,
            max_ms: 7,
        };
        let report = WorkerReport {
            worker: "w".into(),
            runner: "pid 1 on h".into(),
            started_ms: 0,
            written_ms: 0,
            stopped: false,
            minutes: vec![minute(100, 4, 1), minute(98, 2, 2), minute(90, 50, 0)],
        };
        let sum = report.since(96);
        assert_eq!(
            (sum.runs, sum.failed, sum.total_ms, sum.max_ms),
            (6, 3, 30, 7)
        );
        assert_eq!(report.since(101).runs, 0);
    }
}
