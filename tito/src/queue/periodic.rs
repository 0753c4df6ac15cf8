//! Periodic jobs: a schedule (a fixed interval, or a cron expression in a time zone) that
//! publishes one event per tick to a queue.
//!
//! Any number of processes may run the same schedules ([`run_periodic`],
//! [`Workers::spawn_periodic`](crate::Workers::spawn_periodic)): each tick is published in a
//! transaction that also moves the schedule's stored cursor (`{queue}:periodic:{name}`) past it,
//! so a tick is published exactly once however many run, across restarts and crashes, and its
//! event id (`periodic:{name}:{tick}`) makes a second publication a duplicate anyway. Time is
//! the engine's (PD's timestamps on TiKV), so skewed host clocks do not publish early.
//!
//! Missed ticks (no runner was up, or the store was unreachable): only the latest tick that is
//! due is published, once, when a runner next looks; the earlier ones are skipped and counted
//! in the log. A schedule seen for the first time starts at its next tick (nothing from before
//! it existed is published).

use std::sync::Arc;
use std::time::Duration;

use chrono::{TimeZone, Utc};
use serde::{Deserialize, Serialize};

use super::Queue;
use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::event::QueueEvent;
use crate::keys;
use crate::runtime::Shutdown;

/// How long one tick's transaction may take before the runner gives up on it (and tries again):
/// a stalled store never stalls the schedule for good.
pub const TICK_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest a runner sleeps without looking at its schedules again.
const MAX_SLEEP: Duration = Duration::from_secs(60);

/// When a schedule fires.
#[derive(Clone)]
pub struct Schedule {
    name: String,
    when: When,
}

#[derive(Clone)]
enum When {
    Every(u64),
    Cron(Arc<dyn CronIn>),
}

impl std::fmt::Debug for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let when = match &self.when {
            When::Every(secs) => format!("every {secs} s"),
            When::Cron(cron) => cron.describe(),
        };
        f.debug_struct("Schedule")
            .field("name", &self.name)
            .field("when", &when)
            .finish()
    }
}

/// A cron expression evaluated in a time zone.
trait CronIn: Send + Sync {
    /// The latest tick at or before `at` (Unix s).
    fn latest(&self, at: i64) -> Option<i64>;
    /// The first tick after `after` (Unix s).
    fn next(&self, after: i64) -> Option<i64>;
    fn describe(&self) -> String;
}

struct CronTz<Tz: TimeZone> {
    expression: String,
    cron: croner::Cron,
    tz: Tz,
}

impl<Tz> CronIn for CronTz<Tz>
where
    Tz: TimeZone + Send + Sync + std::fmt::Debug,
    Tz::Offset: Send + Sync,
{
    fn latest(&self, at: i64) -> Option<i64> {
        let at = self.tz.timestamp_opt(at, 0).single()?;
        let found = self.cron.find_previous_occurrence(&at, true).ok()?;
        Some(found.timestamp())
    }

    fn next(&self, after: i64) -> Option<i64> {
        let after = self.tz.timestamp_opt(after, 0).single()?;
        let found = self.cron.find_next_occurrence(&after, false).ok()?;
        Some(found.timestamp())
    }

    fn describe(&self) -> String {
        format!("cron {:?} in {:?}", self.expression, self.tz)
    }
}

fn check_name(name: &str) -> TitoResult<()> {
    if name.is_empty() || name.len() > 256 {
        return Err(TitoError::invalid_argument(format!(
            "a schedule's name holds 1 to 256 bytes; {} given",
            name.len()
        )));
    }
    Ok(())
}

/// The longest interval [`Schedule::every`] accepts: 366 days. A longer one is a mistake (use a
/// cron expression for yearly jobs), and its ticks would overflow the schedule's arithmetic.
pub const MAX_INTERVAL: Duration = Duration::from_secs(366 * 24 * 60 * 60);

/// How far ahead a cron expression must fire at least once: eight years, so that February 29
/// (at most eight years apart, around 2100) is accepted and February 30 is refused.
pub const CRON_HORIZON: Duration = Duration::from_secs((8 * 366 + 1) * 24 * 60 * 60);

impl Schedule {
    /// Every `interval`, at multiples of it since the Unix epoch (`every(name, 1 hour)` fires
    /// on the hour, UTC). Refused with [`TitoError::InvalidArgument`] naming the schedule: an
    /// interval that is not a whole number of seconds, zero, or over [`MAX_INTERVAL`].
    pub fn every(name: impl Into<String>, interval: Duration) -> TitoResult<Schedule> {
        let name = name.into();
        check_name(&name)?;
        if interval.as_secs() == 0 || interval.subsec_nanos() != 0 || interval > MAX_INTERVAL {
            return Err(TitoError::invalid_argument(format!(
                "schedule {name:?}: an interval is a whole number of seconds, from one second to \
                 {} days (MAX_INTERVAL); {interval:?} given",
                MAX_INTERVAL.as_secs() / 86_400
            )));
        }
        Ok(Schedule {
            name,
            when: When::Every(interval.as_secs()),
        })
    }

    /// On a cron expression in UTC: five fields (minute, hour, day of month, month, day of
    /// week) or six with seconds first, as `croner` reads them (`"0 9 * * MON-FRI"`), or one of
    /// its nicknames (`"@daily"`).
    pub fn cron(name: impl Into<String>, expression: &str) -> TitoResult<Schedule> {
        Self::cron_in(name, expression, Utc)
    }

    /// On a cron expression in the time zone `tz` (any chrono time zone: `chrono::FixedOffset`,
    /// or `chrono_tz::Tz` for named zones with daylight saving).
    ///
    /// Refused with [`TitoError::InvalidArgument`] naming the schedule: an expression that does
    /// not parse, one with other than five or six fields (a year field is not taken), and one
    /// that does not fire within [`CRON_HORIZON`] from now (`"0 0 30 2 *"`, February 30th, never
    /// does; `"0 0 29 2 *"` is accepted).
    pub fn cron_in<Tz>(name: impl Into<String>, expression: &str, tz: Tz) -> TitoResult<Schedule>
    where
        Tz: TimeZone + Send + Sync + std::fmt::Debug + 'static,
        Tz::Offset: Send + Sync,
    {
        let name = name.into();
        check_name(&name)?;
        let bad = |why: String| {
            Err(TitoError::invalid_argument(format!(
                "schedule {name:?}: {expression:?} {why}"
            )))
        };
        let fields = expression.split_whitespace().count();
        if !expression.trim_start().starts_with('@') && !(5..=6).contains(&fields) {
            return bad(format!(
                "has {fields} fields; a cron expression has five (minute, hour, day of month, \
                 month, day of week) or six (seconds first)"
            ));
        }
        let parser = croner::parser::CronParser::builder()
            .year(croner::parser::Year::Disallowed)
            .build();
        let cron = match parser.parse(expression) {
            Ok(cron) => cron,
            Err(err) => return bad(format!("is not a cron expression: {err}")),
        };
        let cron = CronTz {
            expression: expression.to_string(),
            cron,
            tz,
        };
        let now = Utc::now().timestamp();
        let horizon = now.saturating_add(CRON_HORIZON.as_secs() as i64);
        if cron.next(now).is_none_or(|next| next > horizon) {
            return bad(format!(
                "never fires in the next {} years (a date that does not exist?)",
                CRON_HORIZON.as_secs() / (365 * 86_400)
            ));
        }
        Ok(Schedule {
            name,
            when: When::Cron(Arc::new(cron)),
        })
    }

    /// The schedule's name (part of its tick's event id and of its cursor's key).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// When it fires, in words: `every 3600 s`, `cron "0 9 * * *" in UTC`.
    pub fn describe(&self) -> String {
        match &self.when {
            When::Every(secs) => format!("every {secs} s"),
            When::Cron(cron) => cron.describe(),
        }
    }

    /// The latest tick at or before `at` (Unix s).
    fn latest(&self, at: i64) -> Option<i64> {
        match &self.when {
            When::Every(secs) => {
                let secs = *secs as i64;
                Some(at - at.rem_euclid(secs))
            }
            When::Cron(cron) => cron.latest(at),
        }
    }

    /// The first tick after `after` (Unix s).
    fn next(&self, after: i64) -> Option<i64> {
        match &self.when {
            When::Every(secs) => {
                let secs = *secs as i64;
                Some(after - after.rem_euclid(secs) + secs)
            }
            When::Cron(cron) => cron.next(after),
        }
    }
}

/// A schedule and what each of its ticks publishes: an event whose key is the schedule's name,
/// whose payload is a clone of `payload`, due at the tick, with the id `periodic:{name}:{tick}`.
#[derive(Clone, Debug)]
pub struct PeriodicJob<T> {
    schedule: Schedule,
    payload: T,
}

impl<T> PeriodicJob<T> {
    /// Publishes `payload` at every tick of `schedule`.
    pub fn new(schedule: Schedule, payload: T) -> Self {
        PeriodicJob { schedule, payload }
    }
}

/// The event id of `schedule`'s tick at `tick` (Unix s).
pub fn tick_id(schedule: &str, tick: i64) -> String {
    format!("periodic:{schedule}:{tick}")
}

/// A schedule's stored cursor: the last tick published, and for operators what the schedule
/// is, its next tick and who wrote the cursor last (absent in cursors written before they were
/// kept).
#[derive(Serialize, Deserialize)]
struct Cursor {
    last: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    schedule: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    next: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    runner: Option<String>,
}

impl Cursor {
    fn at(schedule: &Schedule, last: i64) -> Self {
        Cursor {
            last,
            schedule: Some(schedule.describe()),
            next: schedule.next(last),
            runner: Some(crate::util::runner().to_string()),
        }
    }
}

/// What one look at a schedule did.
enum Looked {
    /// Published the tick (and skipped this many earlier ones).
    Published(i64, u64),
    /// Nothing due (or another runner published it).
    Nothing,
}

/// Refuses two jobs of one name with [`TitoError::InvalidArgument`] naming the name: a
/// schedule's name is its cursor's key and part of its ticks' event ids, so two jobs of one
/// name would share one cursor and one tick would publish only one of them.
pub(crate) fn check_job_names<T>(queue: &str, jobs: &[PeriodicJob<T>]) -> TitoResult<()> {
    let mut names = std::collections::BTreeSet::new();
    for job in jobs {
        if !names.insert(job.schedule.name.as_str()) {
            return Err(TitoError::invalid_argument(format!(
                "queue {queue:?} has two periodic jobs named {:?}: give each schedule a name of \
                 its own (the name keys its cursor and its ticks' event ids)",
                job.schedule.name
            )));
        }
    }
    Ok(())
}

/// Publishes every due tick of `jobs` to `queue` until `shutdown` resolves (see the module
/// docs). Refuses at once, with [`TitoError::InvalidArgument`] and before it writes anything,
/// two jobs with one name, a queue handle whose configuration is bad, and one whose partition
/// count contradicts the queue's stored one.
///
/// The returned future is `Send + 'static`: spawn it (`tokio::spawn(run_periodic(..))`), or
/// await it in place.
pub fn run_periodic<E, T>(
    queue: Arc<Queue<E>>,
    jobs: Vec<PeriodicJob<T>>,
    shutdown: impl Shutdown,
) -> futures::future::BoxFuture<'static, TitoResult<()>>
where
    E: TitoEngine,
    T: Serialize + Clone + Send + Sync + 'static,
{
    // Boxed here, where the engine is generic: the compiler proves the loop `Send` once,
    // instead of at each call site with a concrete engine (where it trips over higher-ranked
    // lifetimes).
    Box::pin(periodic_loop(queue, jobs, shutdown))
}

async fn periodic_loop<E, T>(
    queue: Arc<Queue<E>>,
    jobs: Vec<PeriodicJob<T>>,
    shutdown: impl Shutdown,
) -> TitoResult<()>
where
    E: TitoEngine,
    T: Serialize + Clone + Send + Sync + 'static,
{
    check_job_names(queue.label(), &jobs)?;
    queue.check_config()?;
    // A partition count that contradicts the queue's stored one is a mistake in the program:
    // refused before any cursor is written, as a worker refuses it. (An unreachable store is
    // passing: the ticks retry.)
    if let Err(err @ TitoError::InvalidArgument(_)) = super::worker::check_partitions(&queue).await
    {
        return Err(err);
    }
    let stop = shutdown.wait();
    tokio::pin!(stop);
    loop {
        let mut sleep = MAX_SLEEP;
        for job in &jobs {
            match tokio::time::timeout(TICK_TIMEOUT, look(&queue, job)).await {
                Ok(Ok((Looked::Published(tick, skipped), next))) => {
                    if skipped > 0 {
                        tracing::warn!(schedule = %job.schedule.name, tick, skipped, "periodic job: missed ticks skipped; published the latest");
                    } else {
                        tracing::debug!(schedule = %job.schedule.name, tick, "periodic job published");
                    }
                    sleep = sleep.min(next);
                }
                Ok(Ok((Looked::Nothing, next))) => sleep = sleep.min(next),
                Ok(Err(err)) => {
                    tracing::warn!(schedule = %job.schedule.name, error = %err, "periodic job: publishing a tick failed; trying again");
                    sleep = sleep.min(Duration::from_secs(1));
                }
                Err(_) => {
                    tracing::warn!(schedule = %job.schedule.name, timeout = ?TICK_TIMEOUT, "periodic job: publishing a tick stalled; trying again");
                    sleep = sleep.min(Duration::from_secs(1));
                }
            }
        }
        tokio::select! {
            biased;
            _ = &mut stop => return Ok(()),
            _ = tokio::time::sleep(sleep) => {}
        }
    }
}

/// Looks at one job in one transaction: publishes its latest due tick if the cursor has not
/// passed it. Returns what it did and how long until its next tick.
async fn look<E, T>(queue: &Queue<E>, job: &PeriodicJob<T>) -> TitoResult<(Looked, Duration)>
where
    E: TitoEngine,
    T: Serialize + Clone + Send + Sync + 'static,
{
    let schedule = &job.schedule;
    let cursor_key = keys::periodic_key(queue.root(), &schedule.name);
    let (looked, now_ms) = queue
        .engine()
        .transaction(|tx| {
            let cursor_key = cursor_key.clone();
            async move {
                let now_ms = engine::version_millis(tx.start_version());
                let now = (now_ms / 1000) as i64;
                let Some(latest) = schedule.latest(now) else {
                    return Ok((Looked::Nothing, now_ms));
                };
                let cursor = match tx.get(cursor_key.as_bytes()).await? {
                    Some(bytes) => Some(
                        serde_json::from_slice::<Cursor>(&bytes)
                            .map_err(|err| {
                                TitoError::Integrity(format!("periodic cursor {cursor_key}: {err}"))
                            })?
                            .last,
                    ),
                    None => None,
                };
                let Some(last) = cursor else {
                    // First seen: start from now (the next tick is the first published).
                    tx.put(
                        cursor_key.into_bytes(),
                        serde_json::to_vec(&Cursor::at(schedule, latest))?,
                    )
                    .await?;
                    return Ok((Looked::Nothing, now_ms));
                };
                if latest <= last {
                    return Ok((Looked::Nothing, now_ms));
                }
                let skipped = skipped_between(schedule, last, latest);
                let mut event = QueueEvent::new(schedule.name.clone(), job.payload.clone(), latest);
                event.id = tick_id(&schedule.name, latest);
                queue.publish_in_tx(&event, &tx).await?;
                tx.put(
                    cursor_key.into_bytes(),
                    serde_json::to_vec(&Cursor::at(schedule, latest))?,
                )
                .await?;
                Ok::<_, TitoError>((Looked::Published(latest, skipped), now_ms))
            }
        })
        .await?;
    let now = (now_ms / 1000) as i64;
    let next = schedule
        .next(now)
        .unwrap_or(now + MAX_SLEEP.as_secs() as i64);
    // A moment past the tick's second, by the engine's clock.
    let wait_ms = (next.saturating_mul(1000) as u64)
        .saturating_sub(now_ms)
        .saturating_add(5);
    Ok((looked, Duration::from_millis(wait_ms).min(MAX_SLEEP)))
}

/// How many ticks lie strictly between `last` and `latest` (counted up to 10,000).
fn skipped_between(schedule: &Schedule, last: i64, latest: i64) -> u64 {
    let mut skipped = 0;
    let mut at = last;
    while skipped < 10_000 {
        match schedule.next(at) {
            Some(next) if next < latest => {
                skipped += 1;
                at = next;
            }
            _ => break,
        }
    }
    skipped
}

/// A schedule as stored: its name, the last tick published (Unix s), and what its runner last
/// recorded: the schedule, the next tick and which process published.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ScheduleView {
    /// The schedule's name.
    pub name: String,
    /// The last tick published (or, for a schedule never fired yet, the tick it started after).
    pub last_tick: i64,
    /// The schedule as its runner last ran it (`every 3600 s`, `cron "0 9 * * *" in UTC`).
    pub schedule: Option<String>,
    /// The tick after the last one (Unix s).
    pub next_tick: Option<i64>,
    /// The runner that wrote the cursor last (`pid N on HOST`).
    pub runner: Option<String>,
}

/// The schedules that have run on the queue named `topic`, by name (their stored cursors; a
/// schedule's definition lives in the code that runs it).
pub async fn schedules<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
) -> TitoResult<Vec<ScheduleView>> {
    let root = keys::queue_root(topic);
    let prefix = format!("{root}:periodic:");
    let end = keys::prefix_end(prefix.clone());
    let rows = engine::read_only(db, async |tx| {
        tx.scan(prefix.as_bytes(), end.as_bytes(), 10_000).await
    })
    .await?;
    rows.into_iter()
        .map(|(key, value)| {
            let text = keys::key_str(&key)?;
            let name = keys::decode_str(&text[prefix.len()..])?;
            let cursor: Cursor = serde_json::from_slice(&value)
                .map_err(|err| TitoError::Integrity(format!("periodic cursor {text}: {err}")))?;
            Ok(ScheduleView {
                name,
                last_tick: cursor.last,
                schedule: cursor.schedule,
                next_tick: cursor.next,
                runner: cursor.runner,
            })
        })
        .collect()
}

impl crate::Workers {
    /// Starts [`run_periodic`] in this set. `queue` is a queue handle (`Arc<Queue<E>>`) or a
    /// [`TopicQueue`](super::TopicQueue) (its declared jobs:
    /// [`TopicQueue::periodic_jobs`](super::TopicQueue::periodic_jobs)); on a topic queue, jobs
    /// of another payload type do not compile.
    pub fn spawn_periodic<E, T>(
        &mut self,
        queue: impl super::WorkerQueue<E, T>,
        jobs: Vec<PeriodicJob<T>>,
    ) -> &mut Self
    where
        E: TitoEngine,
        T: Serialize + Clone + Send + Sync + 'static,
    {
        let queue = queue.into_queue();
        self.spawn(|stop| run_periodic(queue, jobs, stop))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_tick_at_multiples_of_themselves() {
        let hourly = Schedule::every("h", Duration::from_secs(3600)).unwrap();
        assert_eq!(hourly.latest(7_200), Some(7_200));
        assert_eq!(hourly.latest(7_199), Some(3_600));
        assert_eq!(hourly.next(7_200), Some(10_800));
        assert_eq!(hourly.next(7_199), Some(7_200));
        assert_eq!(skipped_between(&hourly, 0, 36_000), 9);
    }

    #[test]
    fn cron_ticks_follow_the_time_zone() {
        // 09:00 at UTC+2 is 07:00 UTC.
        let tz = chrono::FixedOffset::east_opt(2 * 3600).unwrap();
        let nine = Schedule::cron_in("nine", "0 9 * * *", tz).unwrap();
        let day = 86_400;
        let at = 20 * day + 8 * 3600; // 08:00 UTC on day 20
        assert_eq!(nine.latest(at), Some(20 * day + 7 * 3600));
        assert_eq!(nine.next(at), Some(21 * day + 7 * 3600));
        let utc = Schedule::cron("nine-utc", "0 9 * * *").unwrap();
        assert_eq!(utc.latest(at), Some(19 * day + 9 * 3600));
    }

    /// Refused with `InvalidArgument`, the message naming the schedule.
    fn refused(schedule: TitoResult<Schedule>, name: &str) {
        match schedule {
            Err(TitoError::InvalidArgument(message)) => {
                assert!(message.contains(&format!("{name:?}")), "{message}")
            }
            other => panic!("{name}: {other:?}"),
        }
    }

    #[test]
    fn intervals_go_up_to_the_maximum() {
        let longest = Schedule::every("longest", MAX_INTERVAL).unwrap();
        let secs = MAX_INTERVAL.as_secs() as i64;
        assert_eq!(longest.next(secs), Some(2 * secs));
        assert_eq!(longest.latest(2 * secs - 1), Some(secs));
        refused(
            Schedule::every("one over", MAX_INTERVAL + Duration::from_secs(1)),
            "one over",
        );
        refused(
            Schedule::every("forever", Duration::from_secs(u64::MAX)),
            "forever",
        );
        refused(Schedule::every("zero", Duration::ZERO), "zero");
    }

    #[test]
    fn cron_expressions_have_five_or_six_fields_and_fire() {
        Schedule::cron("five", "0 9 * * *").unwrap();
        Schedule::cron("six", "30 0 9 * * *").unwrap();
        Schedule::cron("nickname", "@daily").unwrap();
        refused(Schedule::cron("four", "0 9 * *"), "four");
        refused(Schedule::cron("seven", "0 0 9 * * * 2030"), "seven");
        refused(Schedule::cron("eight", "0 0 9 * * * 2030 1"), "eight");
        // February 29th fires in leap years; February 30th and April 31st never.
        let leap = Schedule::cron("leap", "0 0 29 2 *").unwrap();
        let next = leap.next(Utc::now().timestamp()).unwrap();
        let date = Utc.timestamp_opt(next, 0).single().unwrap();
        assert_eq!(date.format("%m-%d").to_string(), "02-29");
        refused(Schedule::cron("feb 30", "0 0 30 2 *"), "feb 30");
        refused(Schedule::cron("apr 31", "0 0 31 4 *"), "apr 31");
        refused(
            Schedule::cron_in(
                "feb 30 at +2",
                "0 0 30 2 *",
                chrono::FixedOffset::east_opt(7200).unwrap(),
            ),
            "feb 30 at +2",
        );
    }

    #[test]
    fn bad_schedules_are_refused() {
        for bad in [
            Schedule::every("a", Duration::ZERO),
            Schedule::every("a", Duration::from_millis(1500)),
            Schedule::every("", Duration::from_secs(1)),
            Schedule::cron("a", "not cron"),
            Schedule::cron("a", "61 * * * *"),
        ] {
            assert!(matches!(bad, Err(TitoError::InvalidArgument(_))), "{bad:?}");
        }
    }
}
