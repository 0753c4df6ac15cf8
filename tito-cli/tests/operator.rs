//! The operator tools against seeded stores: the `tito` binary (a real process on a real
//! embedded store, and against an endpoint that does not answer), and the admin dashboard
//! served on loopback and read by headless Chromium (Debian's `chromium`; `TITO_CHROMIUM`
//! names another binary), with screenshots under `target/tmp/dashboard/`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{Request, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tito::backend::embedded::Embedded;
use tito::inbox::Inbox;
use tito::kv::Kv;
use tito::queue::run_worker;
use tito::{
    Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, QueueOwner, TitoEngine, TitoModel,
    TitoTransaction, WorkerConfig,
};
use tower::ServiceExt;

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "user")]
#[tito(index = "user_by_team: team")]
struct User {
    id: String,
    team: String,
    email: String,
}

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(inbox)]
#[tito(table = "job")]
struct Job {
    id: String,
    #[tito(group)]
    queue: String,
    #[tito(priority)]
    priority: i64,
    #[tito(retry_after)]
    retry_after: i64,
    #[tito(attempt)]
    attempt: i64,
    #[tito(processed_at)]
    processed_at: Option<i64>,
    #[tito(locked_until)]
    locked_until: Option<i64>,
    #[tito(payload)]
    payload: BTreeMap<String, String>,
}

/// A table whose model changed shape: version 1 as first written, version 2 (the text in
/// lines) as deployed now; an empty text has no lines and does not convert.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "note")]
struct NoteV1 {
    id: String,
    text: String,
}

#[derive(tito::TitoShape, Serialize, Deserialize)]
#[tito(version = 1)]
struct NoteShape1 {
    id: String,
    text: String,
}

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(
    table = "note",
    version = 2,
    from = "NoteShape1",
    upgrade = "note_lines"
)]
struct Note {
    id: String,
    lines: Vec<String>,
}

fn note_lines(v1: NoteShape1) -> Result<Note, String> {
    if v1.text.is_empty() {
        return Err("an empty note has no lines".into());
    }
    Ok(Note {
        id: v1.id,
        lines: v1.text.lines().map(str::to_string).collect(),
    })
}

const USERS: usize = 30;
const DUE_NOW: usize = 12;
const DUE_LATER: usize = 5;

/// Seeds every kind of thing the tools show: users with an index, a default queue with a late
/// backlog, future work, an owner and a malformed row, a `mail` queue whose events completed,
/// an inbox with ready, delayed and dead-lettered rows, kv entries.
async fn seed<E: TitoEngine>(db: &E) {
    let users = db.clone().model::<User>();
    for i in 0..USERS {
        users
            .build(User {
                id: format!("u{i:02}"),
                team: if i % 3 == 0 { "red" } else { "blue" }.into(),
                email: format!("u{i}@example.com"),
            })
            .await
            .unwrap();
    }
    let queue = Queue::new(db.clone(), QueueConfig::new(4, Duration::from_secs(3600)));
    let now = chrono::Utc::now().timestamp();
    for i in 0..DUE_NOW {
        let mut event = QueueEvent::new(
            format!("order:{i}"),
            serde_json::json!({ "n": i }),
            now - 120,
        );
        if i < 3 {
            event = event.with_owner(QueueOwner::new("tenant", "acme"));
        }
        queue
            .publish(event.with_id(format!("due-{i}")))
            .await
            .unwrap();
    }
    for i in 0..DUE_LATER {
        let event = QueueEvent::new(
            format!("later:{i}"),
            serde_json::json!({ "n": i }),
            now + 3600,
        );
        queue
            .publish(event.with_id(format!("later-{i}")))
            .await
            .unwrap();
    }
    // A pending row that is not an invocation, in partition 0.
    let root = tito::keys::queue_root(None);
    let tx = db.begin().await.unwrap();
    let key = tito::keys::pending_key(&root, 0, (now - 60) as u64, 1, "broken");
    tx.put(key.into_bytes(), b"{not an invocation".to_vec())
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // The `mail` queue: two events, run to completion by a worker.
    let mail = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)).topic("mail"),
    ));
    for i in 0..2 {
        mail.publish(QueueEvent::new(format!("m{i}"), i, now - 5))
            .await
            .unwrap();
    }
    let (stop, shutdown) = tokio::sync::watch::channel(false);
    let worker = tokio::spawn(run_worker(
        mail.clone(),
        WorkerConfig::new(0..2).max_idle_backoff(Duration::from_millis(20)),
        |_event: QueueEvent<i64>| async { Ok(QueueHandlerOutcome::Acknowledge) },
        shutdown,
    ));
    let deadline = Instant::now() + Duration::from_secs(20);
    while mail.completed_count().await.unwrap() < 2 {
        assert!(Instant::now() < deadline, "the mail worker did not finish");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();

    // The `flaky` queue: two events whose only attempt failed, now dead.
    let flaky = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)).topic("flaky"),
    ));
    for i in 0..2 {
        flaky
            .publish(QueueEvent::new(format!("f{i}"), i, now - 5).with_id(format!("flaky-{i}")))
            .await
            .unwrap();
    }
    let (stop, shutdown) = tokio::sync::watch::channel(false);
    let worker = tokio::spawn(run_worker(
        flaky.clone(),
        WorkerConfig::new(0..2)
            .max_idle_backoff(Duration::from_millis(20))
            .failure_policy(tito::queue::FailurePolicy::new(1)),
        |_event: QueueEvent<i64>| async {
            Err(tito::TitoError::handler("the mail server said no"))
        },
        shutdown,
    ));
    let deadline = Instant::now() + Duration::from_secs(20);
    while flaky.dead(None, 10).await.unwrap().len() < 2 {
        assert!(Instant::now() < deadline, "the flaky worker did not finish");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();

    // The inbox: 3 ready and 1 delayed in `mail`, 1 out of attempts in `mail-dead`.
    let jobs = db.clone().model::<Job>();
    let host_ms = chrono::Utc::now().timestamp_millis();
    for (id, group, retry_after, attempt) in [
        ("j1", "mail", 0, 0),
        ("j2", "mail", 0, 1),
        ("j3", "mail", 0, 0),
        ("j4", "mail", host_ms + 3_600_000, 2),
        ("j5", "mail-dead", 0, 5),
    ] {
        jobs.build(Job {
            id: id.into(),
            queue: group.into(),
            retry_after,
            attempt,
            payload: BTreeMap::from([("to".to_string(), format!("{id}@example.com"))]),
            ..Job::default()
        })
        .await
        .unwrap();
    }

    // Notes written by the first code, then rewritten to version 2 by the next: one stays.
    let notes = db.clone().model::<NoteV1>();
    for (id, text) in [("n1", "a\nb"), ("n2", ""), ("n3", "c")] {
        notes
            .build(NoteV1 {
                id: id.into(),
                text: text.into(),
            })
            .await
            .unwrap();
    }
    let next = db.clone().model::<Note>();
    next.schema().await.unwrap();
    tito::schema::set_write_grace(db, Duration::from_millis(1)).unwrap();
    tito::schema::allow_shape_version(db, "note", 2)
        .await
        .unwrap();
    let done = next
        .rewrite_shapes(tito::schema::RewriteOptions::default(), |_| {})
        .await
        .unwrap();
    assert_eq!((done.rewritten, done.unconvertible.count), (2, 1));

    let kv = Kv::new(db.clone());
    for i in 0..3 {
        kv.put(
            "sessions",
            &format!("s{i}"),
            &serde_json::json!({ "user": i }),
            None,
            None,
        )
        .await
        .unwrap();
    }
}

fn tito() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tito"))
}

fn run(args: &[&str]) -> Output {
    tito().args(args).output().expect("the tito binary runs")
}

fn stdout_json(output: &Output) -> Value {
    assert!(
        output.status.success(),
        "tito failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|err| {
        panic!(
            "not JSON ({err}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Asserts that a command failed with status 1 and said `says` on stderr.
fn refused_with(output: &Output, says: &str) {
    assert_eq!(output.status.code(), Some(1), "{}", stderr(output));
    assert!(stderr(output).contains(says), "{}", stderr(output));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_reads_a_seeded_store() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap().to_string();
    {
        let db = Embedded::open(dir.path()).await.unwrap();
        seed(&db).await;
        db.close().await.unwrap();
    }
    let store = ["--path", path.as_str()];
    reads_a_seeded_store(&store, &run_line);
}

/// The token the live applications of these tests set.
const TOKEN: &str = "a-token-of-this-test-app";

/// An application that holds its embedded store and serves its admin router (with `tool`'s
/// commands, behind [`TOKEN`]) on a runtime of its own, as a service does; stopped and its
/// store closed on drop.
struct LiveApp {
    url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LiveApp {
    fn start(dir: &std::path::Path, seeded: bool, tool: fn() -> tito_cli::Tool) -> LiveApp {
        let dir = dir.to_path_buf();
        let (url_tx, url_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let db = Embedded::open(&dir).await.unwrap();
                if seeded {
                    seed(&db).await;
                }
                let commands = tool().commands(db.clone());
                let admin = tito_admin::Admin::new(db.clone())
                    .commands(TOKEN, commands)
                    .unwrap();
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let addr = listener.local_addr().unwrap();
                url_tx.send(format!("http://{addr}/ops/tito")).unwrap();
                let app = axum::Router::new().merge(admin.mount("/ops/tito"));
                tito_admin::serve(listener, app, async move {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
                db.close().await.unwrap();
            });
        });
        let url = url_rx.recv().expect("the application starts");
        LiveApp {
            url,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for LiveApp {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The tool a live application mounts: the stock commands and this test's models.
fn app_tool() -> tito_cli::Tool {
    tito_cli::Tool::new().model::<User>().inbox::<Job>()
}

/// A line printed for a person, run with the live application's token in the environment.
fn run_line_with_token(line: &str) -> Output {
    let words = shlex::split(line).unwrap_or_else(|| panic!("no shell splits {line:?}"));
    assert_eq!(words[0], "tito", "{line}");
    tito()
        .env("TITO_TOKEN", TOKEN)
        .args(&words[1..])
        .output()
        .expect("the tito binary runs")
}

#[test]
fn the_cli_reads_a_live_application_through_its_admin_router() {
    let dir = tempfile::tempdir().unwrap();
    let app = LiveApp::start(dir.path(), true, app_tool);
    // The store is held: the path is refused, and the hint names --url.
    let held = run(&["--path", dir.path().to_str().unwrap(), "queue", "ls"]);
    refused_with(&held, "held by another process");
    assert!(stderr(&held).contains("tito --url"), "{}", stderr(&held));
    let store = ["--url", app.url.as_str()];
    reads_a_seeded_store(&store, &run_line_with_token);
}

/// The seeded store read and operated through `store` (`--path DIR` or `--url URL`), its
/// printed lines run with `run_line`.
fn reads_a_seeded_store(store: &[&str], run_line: &dyn Fn(&str) -> Output) {
    let prefix = store.join(" ");
    let at = |args: &[&str]| {
        let mut all = store.to_vec();
        all.extend_from_slice(args);
        run_line(&format!(
            "tito {}",
            all.iter()
                .map(|w| shlex::try_quote(w).unwrap().into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        ))
    };

    // A mistyped topic is refused by every queue command, never answered as an empty queue;
    // so is a partition the queue does not have.
    for args in [
        &["queue", "dead", "--topic", "mial"][..],
        &["queue", "peek", "--topic", "mial"],
        &["queue", "limits", "--topic", "mial"],
        &["queue", "aside", "--topic", "mial"],
        &["queue", "schedules", "--topic", "mial"],
        &["queue", "stats", "--topic", "mial"],
        &["queue", "retry-dead", "x", "--topic", "mial"],
        &["--json", "queue", "dead", "--topic", "mial"],
    ] {
        refused_with(&at(args), "no queue \"mial\" in this store (its queues: ");
    }
    refused_with(
        &at(&["queue", "peek", "--topic", "flaky", "--partition", "99"]),
        "no partition 99",
    );

    let tables = stdout_json(&at(&["table", "ls", "--json"]));
    let rows: BTreeMap<String, u64> = tables
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["table"].as_str().unwrap().to_string(),
                t["rows"]["value"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        BTreeMap::from([
            ("job".into(), 5),
            ("note".into(), 3),
            ("user".into(), USERS as u64)
        ])
    );

    // Dead invocations: listed; a discard asks for --yes; a retry moves one back.
    let dead = stdout_json(&at(&["queue", "dead", "--topic", "flaky", "--json"]));
    let ids: Vec<&str> = dead
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["flaky-0", "flaky-1"]);
    let text =
        String::from_utf8_lossy(&at(&["queue", "dead", "--topic", "flaky"]).stdout).into_owned();
    assert!(text.contains("1 attempts"), "{text}");
    assert!(text.contains("the mail server said no"), "{text}");
    // The answer names its queue, and its hints carry the flags they need.
    assert!(
        text.starts_with("queue flaky: 2 dead invocations\nflaky-0  key "),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "retry: tito {prefix} queue retry-dead --topic flaky flaky-0"
        )),
        "{text}"
    );
    let refused = at(&["queue", "discard-dead", "--topic", "flaky", "flaky-1"]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(stderr(&refused).contains("--yes"), "{}", stderr(&refused));
    let discarded = stdout_json(&at(&[
        "queue",
        "discard-dead",
        "--topic",
        "flaky",
        "flaky-1",
        "--yes",
        "--json",
    ]));
    assert_eq!(discarded["discarded"], true);
    let retried = stdout_json(&at(&[
        "queue",
        "retry-dead",
        "--topic",
        "flaky",
        "flaky-0",
        "--json",
    ]));
    assert_eq!(retried["retried"], true);
    // Following the hint for an invocation that is no longer dead changes nothing: said so,
    // with a non-zero exit status.
    let again = at(&["queue", "retry-dead", "--topic", "flaky", "flaky-0"]);
    refused_with(&again, "queue flaky: flaky-0: not dead (nothing moved");
    let gone = at(&[
        "queue",
        "discard-dead",
        "--topic",
        "flaky",
        "flaky-1",
        "--yes",
    ]);
    assert_eq!(gone.status.code(), Some(1), "{}", stderr(&gone));
    let stats =
        String::from_utf8_lossy(&at(&["queue", "stats", "--topic", "flaky"]).stdout).into_owned();
    assert!(
        stats.contains("1 due now") && stats.contains("0 dead"),
        "{stats}"
    );

    // Pause and resume: stored, shown by stats; a mistyped topic or partition is refused.
    let paused = stdout_json(&at(&[
        "queue",
        "pause",
        "--topic",
        "flaky",
        "--why",
        "mail server down",
        "--json",
    ]));
    assert_eq!(paused["paused"], true);
    let stats =
        String::from_utf8_lossy(&at(&["queue", "stats", "--topic", "flaky"]).stdout).into_owned();
    assert!(stats.contains("PAUSED: mail server down"), "{stats}");
    let json = stdout_json(&at(&["queue", "stats", "--topic", "flaky", "--json"]));
    assert_eq!(json["paused"]["queue"]["why"], "mail server down");
    let typo = at(&["queue", "pause", "--topic", "flakey"]);
    refused_with(&typo, "no queue \"flakey\" in this store (its queues: ");
    let beyond = at(&["queue", "pause", "--topic", "flaky", "--partition", "999"]);
    refused_with(
        &beyond,
        "queue \"flaky\" has 2 partitions (0 to 1): no partition 999",
    );
    let resumed = stdout_json(&at(&["queue", "resume", "--topic", "flaky", "--json"]));
    assert_eq!(resumed["resumed"], true);
    let again = at(&["queue", "resume", "--topic", "flaky"]);
    refused_with(&again, "was not paused");

    // Limits: set, shown by `limits` and `stats`, lifted; bad rates and zero refused.
    let none =
        String::from_utf8_lossy(&at(&["queue", "limits", "--topic", "flaky"]).stdout).into_owned();
    assert!(none.contains("no limits"), "{none}");
    let set = stdout_json(&at(&[
        "queue",
        "limits",
        "--topic",
        "flaky",
        "--key-concurrency",
        "1",
        "--rate",
        "100/1m",
        "--json",
    ]));
    assert_eq!(set["limits"]["key_concurrency"], 1);
    assert_eq!(set["limits"]["rate"]["starts"], 100);
    assert_eq!(set["limits"]["rate"]["per"], 60_000);
    let stats =
        String::from_utf8_lossy(&at(&["queue", "stats", "--topic", "flaky"]).stdout).into_owned();
    assert!(
        stats.contains("LIMITS: per key 1") && stats.contains("rate 100 per 1 m"),
        "{stats}"
    );
    for (bad, says) in [
        ("100", "is not a rate"),
        ("100/1w", "is not a rate"),
        ("x/1s", "is not a rate"),
        ("0/1s", "must allow 1 to 1000"),
        ("5/0s", "the interval must be"),
    ] {
        let out = at(&["queue", "limits", "--topic", "flaky", "--rate", bad]);
        assert_eq!(out.status.code(), Some(1), "{bad}");
        assert!(stderr(&out).contains(says), "{bad}: {}", stderr(&out));
    }
    let zero = at(&["queue", "limits", "--topic", "flaky", "--concurrency", "0"]);
    assert!(stderr(&zero).contains("pause it"), "{}", stderr(&zero));
    let lifted =
        String::from_utf8_lossy(&at(&["queue", "limits", "--topic", "flaky", "--none"]).stdout)
            .into_owned();
    assert!(lifted.contains("no limits"), "{lifted}");

    let row = stdout_json(&at(&["table", "get", "user", "u03", "--json"]));
    assert_eq!(row["value"]["team"], "red");
    let missing = at(&["table", "get", "user", "nobody"]);
    refused_with(&missing, "no row \"nobody\"");
    // Shape versions: every row of version 1, which writers may write; a version no code
    // declared cannot be allowed, and allowing the one in force changes nothing.
    let versions = stdout_json(&at(&["table", "versions", "user", "--json"]));
    assert_eq!(
        versions["rows"]["1"].as_u64(),
        Some(USERS as u64),
        "{versions}"
    );
    assert_eq!(versions["shapes"]["writable"], 1, "{versions}");
    let text = String::from_utf8_lossy(&at(&["table", "versions", "user"]).stdout).into_owned();
    assert!(
        text.contains("writers may write version 1") && text.contains("version 1  "),
        "{text}"
    );
    refused_with(
        &at(&["table", "allow-version", "user", "2"]),
        "no code of shape version 2",
    );
    refused_with(
        &at(&["table", "allow-version", "user", "1"]),
        "nothing changed",
    );
    // A table rewritten to version 2 with a row no conversion reads: counted and named.
    let versions = stdout_json(&at(&["table", "versions", "note", "--json"]));
    assert_eq!(versions["rows"]["1"], 1, "{versions}");
    assert_eq!(versions["rows"]["2"], 2, "{versions}");
    assert_eq!(versions["rewrite"]["target"], 2, "{versions}");
    let left = tito::keys::row_key("note", "n2");
    assert_eq!(
        versions["rewrite"]["unconvertible"]["first"][0]["key"],
        left.as_str()
    );
    assert_eq!(versions["rewrite"]["unconvertible"]["first"][0]["id"], "n2");
    let text = String::from_utf8_lossy(&at(&["table", "versions", "note"]).stdout).into_owned();
    assert!(
        text.contains("rewrite to version 2: finished, 3 rows read of about 3, 2 rewritten")
            && text.contains("rows no code that ran the rewrite reads: 1")
            && text.contains(
                "id n2 (version 1): the conversion from version 1 to 2 refused it: an empty \
                 note has no lines"
            ),
        "{text}"
    );

    // Paging: 30 rows by 8, following the printed cursors.
    let mut cursor: Option<String> = None;
    let mut seen = 0;
    loop {
        let mut args = vec!["table", "scan", "user", "--limit", "8", "--json"];
        if let Some(c) = &cursor {
            args.extend_from_slice(&["--cursor", c]);
        }
        let page = stdout_json(&at(&args));
        seen += page["items"].as_array().unwrap().len();
        match page["cursor"].as_str() {
            Some(next) => cursor = Some(next.to_string()),
            None => break,
        }
    }
    assert_eq!(seen, USERS);
    let text = String::from_utf8_lossy(&at(&["table", "scan", "user", "--limit", "2"]).stdout)
        .into_owned();
    assert!(
        text.contains("u00") && text.contains(" --cursor c2."),
        "{text}"
    );
    // The next page's line, run as printed, reads the next page.
    let next = line_after(&text, "next page: ");
    let second = String::from_utf8_lossy(&run_line(&next).stdout).into_owned();
    assert!(
        second.starts_with("u02") && second.contains("next page: "),
        "{next}: {second}"
    );

    let status = stdout_json(&at(&["index", "status", "user", "--json"]));
    assert_eq!(status["schema"]["indexes"][0]["name"], "user_by_team");
    assert_eq!(status["schema"]["indexes"][0]["state"], "ready");

    let queues = stdout_json(&at(&["queue", "ls", "--json"]));
    let labels: Vec<&str> = queues
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["label"].as_str().unwrap())
        .collect();
    assert_eq!(labels, ["default", "flaky", "mail"]);

    // Several queues and no --topic: the answer lists them instead of reading the default.
    for command in [
        &["queue", "stats"][..],
        &["queue", "schedules"],
        &["queue", "peek"],
    ] {
        let out = at(command);
        assert_eq!(out.status.code(), Some(1), "{command:?}");
        assert!(
            stderr(&out).contains("this store has 3 queues (default, flaky, mail)"),
            "{command:?}: {}",
            stderr(&out)
        );
    }
    let stats = stdout_json(&at(&["queue", "stats", "--topic", "default", "--json"]));
    // The seeded backlog plus the malformed row (a pending key like the others).
    assert_eq!(stats["due_now"]["value"], DUE_NOW as u64 + 1);
    assert_eq!(stats["future"]["value"], DUE_LATER as u64);
    let text =
        String::from_utf8_lossy(&at(&["queue", "stats", "--topic", "default"]).stdout).into_owned();
    assert!(
        text.contains("queue default: 13 due now, 5 due later"),
        "{text}"
    );
    let schedules = String::from_utf8_lossy(&at(&["queue", "schedules", "--topic", "mail"]).stdout)
        .into_owned();
    assert!(
        schedules.starts_with("queue mail: no periodic schedule"),
        "{schedules}"
    );

    let peek = stdout_json(&at(&[
        "queue",
        "peek",
        "--topic",
        "default",
        "--partition",
        "0",
        "--limit",
        "100",
        "--json",
    ]));
    let malformed: Vec<&Value> = peek["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| !r["malformed"].is_null())
        .collect();
    assert_eq!(malformed.len(), 1, "{peek}");
    assert_eq!(malformed[0]["raw"], "{not an invocation");
    let completed = stdout_json(&at(&[
        "queue",
        "peek",
        "--topic",
        "mail",
        "--completed",
        "--json",
    ]));
    assert_eq!(completed["items"].as_array().unwrap().len(), 2);

    let namespaces = stdout_json(&at(&["kv", "ls", "--json"]));
    assert_eq!(namespaces[0]["namespace"], "sessions");
    assert_eq!(namespaces[0]["keys"]["value"], 3);
    let entry = stdout_json(&at(&["kv", "get", "sessions", "s1", "--json"]));
    assert_eq!(entry["value"]["user"], 1);
    let list = stdout_json(&at(&["kv", "list", "sessions", "--limit", "2", "--json"]));
    assert_eq!(list["entries"].as_array().unwrap().len(), 2);

    let key = tito::keys::row_key("user", "a:b");
    let decoded = stdout_json(&run(&["keys", "decode", &key, "--json"]));
    assert_eq!(decoded, serde_json::json!(["table", "user", "a:b"]));
    // The quoted form other commands print, of a text key and of one that is not UTF-8 (as
    // `store verify` names it), its own help's example included.
    let quoted = tito::keys::display_key(key.as_bytes());
    let decoded = stdout_json(&run(&["keys", "decode", &quoted, "--json"]));
    assert_eq!(decoded, serde_json::json!(["table", "user", "a:b"]));
    for (printed, segments) in [
        (r#""\xff\u{1}k""#, serde_json::json!([r#""\xff\u{1}k""#])),
        (r#""x:\xfe\0\"""#, serde_json::json!(["x", r#""\xfe\0\"""#])),
    ] {
        let decoded = run(&["keys", "decode", printed, "--json"]);
        assert!(decoded.status.success(), "{printed}: {}", stderr(&decoded));
        assert_eq!(stdout_json(&decoded), segments, "{printed}");
    }

    // Bad input is refused with the library's message.
    let zero = at(&["table", "scan", "user", "--limit", "0"]);
    assert_eq!(zero.status.code(), Some(1));
    assert!(stderr(&zero).contains("1 to 1000"), "{}", stderr(&zero));
    let forged = at(&["table", "scan", "user", "--cursor", "c1.zz"]);
    assert!(
        stderr(&forged).contains("malformed cursor"),
        "{}",
        stderr(&forged)
    );

    // gc with no retention deletes the two completed mail rows.
    let gc = stdout_json(&at(&["gc", "--retention", "0", "--json"]));
    assert_eq!(gc["queue mail"], 2, "{gc}");
    let again = stdout_json(&at(&["queue", "stats", "--topic", "mail", "--json"]));
    assert_eq!(again["completed"]["value"], 0);

    // Cancel by id and by owner; the completed rows say so.
    let one = stdout_json(&at(&[
        "queue", "cancel", "--topic", "default", "later-0", "--why", "typo", "--json",
    ]));
    assert_eq!(one["cancelled"], true);
    assert_eq!(one["queue"], "default");
    let again = at(&["queue", "cancel", "--topic", "default", "later-0"]);
    refused_with(&again, "queue default: later-0: not pending");
    let cancel_owner = [
        "queue",
        "cancel-owner",
        "--topic",
        "default",
        "tenant",
        "acme",
    ];
    let why = ["--why", "account closed", "--json"];
    let owner = stdout_json(&at(&[&cancel_owner[..], &why[..]].concat()));
    assert_eq!(owner["cancelled"], 3);
    // Nothing left to cancel.
    refused_with(&at(&cancel_owner), "no pending invocation of tenant/acme");
    let history = String::from_utf8_lossy(
        &at(&["queue", "peek", "--topic", "default", "--completed"]).stdout,
    )
    .into_owned();
    assert!(
        history.starts_with("queue default, completed rows"),
        "{history}"
    );
    assert!(history.contains("CANCELLED: typo"), "{history}");
    assert_eq!(
        history.matches("CANCELLED: account closed").count(),
        3,
        "{history}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_reads_a_tikv_cluster() {
    let cluster = tito_tikv_test_server::TestCluster::start().await.unwrap();
    let endpoint = cluster.pd_endpoints()[0].clone();
    let db = tito::backend::tikv::TiKV::connect(vec![endpoint.clone()])
        .await
        .unwrap();
    seed(&db).await;
    let at = move |args: &[&str]| {
        let mut all = vec!["--pd".to_string(), endpoint.clone()];
        all.extend(args.iter().map(|a| a.to_string()));
        // The test server is served by this runtime: wait for the process off its threads.
        tokio::task::spawn_blocking(move || tito().args(&all).output().unwrap())
    };
    let tables = stdout_json(&at(&["table", "ls", "--json"]).await.unwrap());
    assert_eq!(tables.as_array().unwrap().len(), 3, "{tables}");
    let stats = stdout_json(
        &at(&["queue", "stats", "--topic", "default", "--json"])
            .await
            .unwrap(),
    );
    assert_eq!(stats["due_now"]["value"], DUE_NOW as u64 + 1);
    assert_eq!(stats["future"]["value"], DUE_LATER as u64);
    let entry = stdout_json(
        &at(&["kv", "get", "sessions", "s2", "--json"])
            .await
            .unwrap(),
    );
    assert_eq!(entry["value"]["user"], 2);
    let status = stdout_json(&at(&["index", "status", "user", "--json"]).await.unwrap());
    assert_eq!(status["schema"]["indexes"][0]["state"], "ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_reads_one_keyspace_and_refuses_half_a_tls_setup() {
    use tito::backend::tikv::{TiKV, TiKVOptions};
    let cluster = tito_tikv_test_server::TestCluster::start().await.unwrap();
    cluster.create_keyspace("alpha");
    cluster.create_keyspace("beta");
    let endpoint = cluster.pd_endpoints()[0].clone();
    let alpha = TiKV::connect_with(
        vec![endpoint.clone()],
        TiKVOptions::default().keyspace("alpha"),
    )
    .await
    .unwrap();
    seed(&alpha).await;
    let at = move |args: &[&str]| {
        let mut all = vec!["--pd".to_string(), endpoint.clone()];
        all.extend(args.iter().map(|a| a.to_string()));
        tokio::task::spawn_blocking(move || tito().args(&all).output().unwrap())
    };
    let tables = stdout_json(
        &at(&["--keyspace", "alpha", "table", "ls", "--json"])
            .await
            .unwrap(),
    );
    assert_eq!(tables.as_array().unwrap().len(), 3, "{tables}");
    let empty = stdout_json(
        &at(&["--keyspace", "beta", "table", "ls", "--json"])
            .await
            .unwrap(),
    );
    assert_eq!(empty.as_array().unwrap().len(), 0, "{empty}");
    let missing = at(&["--keyspace", "gamma", "table", "ls"]).await.unwrap();
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        stderr(&missing).contains("has no keyspace \"gamma\""),
        "{}",
        stderr(&missing)
    );
    assert!(
        !stderr(&missing).contains("does not answer"),
        "{}",
        stderr(&missing)
    );
    // A name PD cannot hold is refused before any connection: even with no PD at that address.
    let bad = tokio::task::spawn_blocking(|| {
        tito()
            .args([
                "--pd",
                "127.0.0.1:1",
                "--keyspace",
                "no spaces",
                "table",
                "ls",
            ])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    let text = stderr(&bad);
    assert!(text.contains("is not a keyspace name"), "{text}");
    assert!(
        !text.contains("connect") && !text.contains("answer"),
        "{text}"
    );
    let half = at(&["--tls-ca", "ca.pem", "table", "ls"]).await.unwrap();
    assert_eq!(half.status.code(), Some(1));
    assert!(
        stderr(&half).contains("--tls-ca, --tls-cert and --tls-key together"),
        "{}",
        stderr(&half)
    );
    let embedded = run(&["--path", "x", "--keyspace", "alpha", "table", "ls"]);
    assert_eq!(embedded.status.code(), Some(2), "a keyspace is TiKV's");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_explains_a_held_store_an_absent_one_and_a_silent_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let db = Embedded::open(dir.path()).await.unwrap();
    let held = run(&["--path", dir.path().to_str().unwrap(), "table", "ls"]);
    assert_eq!(held.status.code(), Some(1));
    let message = stderr(&held);
    assert!(message.contains("held by another process"), "{message}");
    assert!(message.contains("tito_admin::Admin"), "{message}");
    db.close().await.unwrap();

    let absent = run(&["--path", "/nonexistent/tito-store", "table", "ls"]);
    assert_eq!(absent.status.code(), Some(1));
    assert!(
        stderr(&absent).contains("is not an embedded Tito store: it does not exist"),
        "{}",
        stderr(&absent)
    );
    assert!(!std::path::Path::new("/nonexistent/tito-store").exists());

    let none = run(&["table", "ls"]);
    assert_eq!(none.status.code(), Some(1));
    assert!(stderr(&none).contains("--path DIR"), "{}", stderr(&none));
    let both = run(&["--path", "x", "--pd", "y:1", "table", "ls"]);
    assert_eq!(both.status.code(), Some(2), "clap refuses both stores");

    // An address nothing listens on (bound, then released).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("127.0.0.1:{port}");
    let started = Instant::now();
    let silent = run(&["--pd", &endpoint, "--timeout", "2", "queue", "ls"]);
    let took = started.elapsed();
    assert_eq!(silent.status.code(), Some(1));
    assert!(stderr(&silent).contains(&endpoint), "{}", stderr(&silent));
    assert!(
        took < Duration::from_secs(30),
        "answered within the timeout: {took:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// The dashboard
// ---------------------------------------------------------------------------------------------

fn chromium() -> PathBuf {
    if let Some(path) = std::env::var_os("TITO_CHROMIUM") {
        return PathBuf::from(path);
    }
    for candidate in ["/usr/bin/chromium", "/usr/bin/chromium-browser"] {
        if Path::new(candidate).exists() {
            return PathBuf::from(candidate);
        }
    }
    panic!(
        "the dashboard test needs headless Chromium: install Debian's `chromium` package \
         (`apt-get install chromium`; .ci/run does) or set TITO_CHROMIUM to a Chromium binary"
    );
}

/// Runs headless Chromium on `url` with `extra` arguments; returns its stdout.
fn chromium_run(url: &str, extra: &[String]) -> (String, String) {
    let profile = tempfile::tempdir().unwrap();
    let output = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(url)
        .output()
        .expect("chromium starts");
    assert!(
        output.status.success(),
        "chromium failed on {url}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The page's DOM after Chromium loaded it, and a screenshot of it saved as `name`.png.
fn browse(base: &str, path: &str, name: &str) -> String {
    let url = format!("{base}{path}");
    let (dom, _) = chromium_run(&url, &["--dump-dom".to_string()]);
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard");
    std::fs::create_dir_all(&shots).unwrap();
    let file = shots.join(format!("{name}.png"));
    let (_, log) = chromium_run(
        &url,
        &[
            format!("--screenshot={}", file.display()),
            "--window-size=1280,1100".to_string(),
        ],
    );
    let size = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
    let log: Vec<&str> = log.lines().filter(|l| !l.contains("dbus")).collect();
    assert!(
        size > 10_000,
        "a screenshot of {url} at {} ({size} bytes): {}",
        file.display(),
        log.join("\n")
    );
    dom
}

/// A dashboard served on loopback for the browser, until `stop`.
struct Served {
    /// `http://ADDR` and the mount path.
    base: String,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Served {
    async fn start(app: axum::Router, mount: &str) -> Served {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(tito_admin::serve(listener, app, async {
            let _ = stopped.await;
        }));
        Served {
            base: format!("http://{addr}{mount}"),
            stop,
            server,
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.server.await.unwrap().unwrap();
    }
}

/// The text of the first element carrying `attribute` after `anchor` in `dom`.
fn figure_after(dom: &str, anchor: &str, attribute: &str) -> String {
    let from = dom
        .find(anchor)
        .unwrap_or_else(|| panic!("{anchor} in the page:\n{dom}"));
    let rest = &dom[from..];
    let at = rest
        .find(attribute)
        .unwrap_or_else(|| panic!("{attribute} after {anchor}"));
    let rest = &rest[at..];
    let open = rest.find('>').unwrap() + 1;
    let close = rest[open..].find('<').unwrap() + open;
    rest[open..close].trim().to_string()
}

fn admin(db: &Embedded) -> axum::Router {
    let inbox = Arc::new(Inbox::<_, Job>::new(db.clone()).unwrap());
    tito_admin::Admin::new(db.clone())
        .inbox(inbox, &["mail", "mail-dead"])
        .model::<User>()
        .router()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_the_seeded_figures_in_a_browser() {
    let chromium = chromium();
    assert!(chromium.exists(), "{}", chromium.display());
    let dir = tempfile::tempdir().unwrap();
    let db = Embedded::open(dir.path()).await.unwrap();
    let seeded = Instant::now();
    seed(&db).await;
    // The overview says which queue has dead rows, what is paused and the limits in use.
    tito::queue::pause(&db, Some("mail"), Some(1), "smtp down")
        .await
        .unwrap();
    tito::queue::set_limits(
        &db,
        Some("flaky"),
        tito::queue::Limits::none().concurrency(3),
    )
    .await
    .unwrap();

    // Mounted under a prefix, as an application would.
    let app = axum::Router::new().merge(
        tito_admin::Admin::new(db.clone())
            .inbox(
                Arc::new(Inbox::<_, Job>::new(db.clone()).unwrap()),
                &["mail", "mail-dead"],
            )
            .model::<User>()
            .mount("/tito"),
    );
    let served = Served::start(app, "/tito").await;
    let base = served.base.clone();

    let pages = tokio::task::spawn_blocking(move || {
        [
            ("", "overview"),
            ("/queue", "queue"),
            ("/queue?partition=0", "queue-partition-0"),
            ("/queue?topic=flaky", "queue-flaky"),
            ("/inbox?table=job&group=mail", "inbox"),
            ("/inbox?table=job&group=mail-dead", "inbox-dead"),
            ("/table?name=user", "table"),
            ("/table?name=note", "table-note"),
            ("/kv?namespace=sessions", "kv"),
        ]
        .map(|(path, name)| (name, browse(&base, path, name)))
    })
    .await
    .unwrap();
    let page = |name: &str| pages.iter().find(|(n, _)| *n == name).unwrap().1.clone();

    let overview = page("overview");
    assert_eq!(
        figure_after(
            &overview,
            "data-queue=\"default\"",
            "data-figure=\"due-now\""
        ),
        (DUE_NOW + 1).to_string()
    );
    assert_eq!(
        figure_after(&overview, "data-table=\"user\"", "data-figure=\"rows\""),
        USERS.to_string()
    );
    assert_eq!(
        figure_after(
            &overview,
            "data-inbox=\"job/mail\"",
            "data-figure=\"ready\""
        ),
        "3"
    );
    assert_eq!(
        figure_after(
            &overview,
            "data-namespace=\"sessions\"",
            "data-figure=\"keys\""
        ),
        "3"
    );
    let flaky = |figure: &str| {
        figure_after(
            &overview,
            "data-queue=\"flaky\"",
            &format!("data-figure=\"{figure}\""),
        )
    };
    assert_eq!(flaky("dead"), "2");
    assert_eq!(flaky("state"), "running");
    assert_eq!(flaky("limits"), "0 of 3 running");
    let mail = overview
        .split("data-queue=\"mail\"")
        .nth(1)
        .and_then(|row| row.split("</tr>").next())
        .unwrap();
    assert!(mail.contains("1 partition paused"), "{mail}");
    assert!(mail.contains("(1: smtp down)"), "{mail}");
    // The links resolve under the mount point.
    assert!(overview.contains("<base href=\"/tito/\">"), "{overview}");
    assert!(
        overview.contains("<a href=\"/tito\">Overview</a>"),
        "{overview}"
    );

    // The operator's forms, rendered by the browser: every queue action, and the dead ones
    // where there are dead invocations.
    let flaky = page("queue-flaky");
    for form in [
        "pause",
        "resume",
        "cancel",
        "cancel-owner",
        "limits",
        "set-aside",
        "retry-all-dead",
        "discard-all-dead",
    ] {
        assert!(
            flaky.contains(&format!("action=\"queue-action\" id=\"{form}\"")),
            "{form}: {flaky}"
        );
    }
    assert!(
        flaky.contains("value=\"3\""),
        "the limit in use fills its field"
    );

    let queue = page("queue");
    assert!(
        !queue.contains("id=\"retry-all-dead\""),
        "no dead, no button"
    );
    assert_eq!(
        figure_after(&queue, "<main>", "data-figure=\"due-now\""),
        "13"
    );
    assert_eq!(
        figure_after(&queue, "<main>", "data-figure=\"due-later\""),
        "5"
    );
    assert_eq!(
        figure_after(&queue, "<main>", "data-figure=\"paused\""),
        "no"
    );
    // The oldest was due two minutes before the seed began: late by that and the time since.
    let late = figure_after(&queue, "<main>", "data-figure=\"late\"");
    let late_s = late
        .split_once("m ")
        .and_then(|(m, s)| {
            Some(m.parse::<u64>().ok()? * 60 + s.trim_end_matches('s').parse::<u64>().ok()?)
        })
        .unwrap_or_else(|| panic!("minutes and seconds: {late}"));
    let since = seeded.elapsed().as_secs();
    assert!(
        (120..=122 + since).contains(&late_s),
        "the oldest is two minutes late, plus the {since} s since the seed: {late}"
    );
    let partition0 = page("queue-partition-0");
    assert!(
        partition0.contains("data-malformed"),
        "the broken row is shown"
    );
    assert!(partition0.contains("{not an invocation"));

    let inbox = page("inbox");
    assert_eq!(figure_after(&inbox, "<main>", "data-figure=\"ready\""), "3");
    assert_eq!(
        figure_after(&inbox, "<main>", "data-figure=\"delayed\""),
        "1"
    );
    let dead = page("inbox-dead");
    assert!(dead.contains("data-row=\"j5\""), "{dead}");
    assert!(
        dead.contains("move to mail"),
        "the requeue action is offered"
    );

    let table = page("table");
    assert_eq!(figure_after(&table, "<main>", "data-figure=\"rows\""), "30");
    assert_eq!(
        figure_after(
            &table,
            "data-index=\"user_by_team\"",
            "data-figure=\"state\""
        ),
        "ready"
    );
    assert!(table.contains("Start an audit"));
    // Rows by shape version and the rewrite's progress, as bars with their numbers.
    let note = page("table-note");
    assert!(
        note.contains("<progress id=\"share-1\" max=\"3\" value=\"1\"")
            && note.contains("1 of 3 rows (33%)"),
        "{note}"
    );
    assert!(
        note.contains("<progress id=\"share-2\" max=\"3\" value=\"2\"")
            && note.contains("2 of 3 rows (67%)"),
        "{note}"
    );
    assert!(
        note.contains("<progress id=\"rewrite-progress\" max=\"3\" value=\"3\"")
            && note.contains("3 of 3 rows read (100%)"),
        "{note}"
    );
    let kv = page("kv");
    for key in ["s0", "s1", "s2"] {
        assert!(kv.contains(&format!("data-key=\"{key}\"")), "{key}");
    }

    served.stop().await;
}

/// Sends one request to the router, from `peer` when given.
async fn send(
    router: &axum::Router,
    request: Request<Body>,
    peer: Option<&str>,
) -> (StatusCode, String) {
    let mut request = request;
    if let Some(peer) = peer {
        let addr: SocketAddr = peer.parse().unwrap();
        request.extensions_mut().insert(ConnectInfo(addr));
    }
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), 1 << 24)
        .await
        .unwrap();
    (status, String::from_utf8_lossy(&body).into_owned())
}

fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

fn post(path: &str, form: &str) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/x-www-form-urlencoded")
        .header("host", "127.0.0.1:8080")
        .body(Body::from(form.to_string()))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_guards_access_and_confirms_and_logs_actions() {
    let dir = tempfile::tempdir().unwrap();
    let db = Embedded::open(dir.path()).await.unwrap();
    seed(&db).await;
    let router = admin(&db);
    let local = Some("127.0.0.1:50000");

    // No hook: loopback peers only; an unknown peer is refused too.
    assert_eq!(send(&router, get("/"), local).await.0, StatusCode::OK);
    assert_eq!(
        send(&router, get("/"), Some("[::1]:5")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&router, get("/"), Some("10.1.2.3:5")).await.0,
        StatusCode::FORBIDDEN
    );
    let (status, unknown) = send(&router, get("/api/overview"), None).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    // Served without connect info: the refusal says why, and how to serve it.
    assert!(unknown.contains("peer address is unknown"), "{unknown}");
    assert!(
        unknown.contains("into_make_service_with_connect_info"),
        "{unknown}"
    );
    // A hook decides alone, whatever the peer.
    let hooked = tito_admin::Admin::new(db.clone())
        .authorize(|r| r.headers().get("x-token").is_some_and(|t| t == "s3cret"))
        .router();
    let with_token = Request::get("/")
        .header("x-token", "s3cret")
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        send(&hooked, with_token, Some("10.1.2.3:5")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&hooked, get("/"), local).await.0,
        StatusCode::FORBIDDEN
    );

    // JSON twins carry the same figures.
    let (status, body) = send(&router, get("/api/queue"), local).await;
    assert_eq!(status, StatusCode::OK);
    let queue: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(queue["overview"]["due_now"]["value"], 13);
    let (status, body) = send(&router, get("/api/queue?partition=9"), local).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, _) = send(&router, get("/api/queue?topic=nope"), local).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, body) = send(
        &router,
        get("/api/inbox?table=job&group=mail&state=zzz"),
        local,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");

    // Erasing an owner: a confirmation first, nothing deleted; then with confirm=yes.
    let (status, body) = send(&router, post("/erase-owner", "kind=tenant&id=acme"), local).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("name=\"confirm\" value=\"yes\""), "{body}");
    let (_, body) = send(&router, get("/api/queue"), local).await;
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["overview"]["due_now"]["value"],
        13
    );
    let (status, body) = send(
        &router,
        post("/erase-owner", "kind=tenant&id=acme&confirm=yes"),
        local,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("3 invocations deleted"), "{body}");
    let (_, body) = send(&router, get("/api/queue"), local).await;
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["overview"]["due_now"]["value"],
        10
    );
    let (status, _) = send(
        &router,
        post("/erase-owner", "kind=&id=acme&confirm=yes"),
        local,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    // A post from another origin is refused.
    let mut cross = post("/erase-owner", "kind=tenant&id=acme&confirm=yes");
    cross
        .headers_mut()
        .insert("origin", "http://evil.example".parse().unwrap());
    assert_eq!(send(&router, cross, local).await.0, StatusCode::FORBIDDEN);

    // Moving the dead-lettered row back to ready.
    let (status, body) = send(
        &router,
        post("/requeue", "table=job&id=j5&group=mail&confirm=yes"),
        local,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (_, body) = send(
        &router,
        get("/api/inbox?table=job&group=mail&state=ready"),
        local,
    )
    .await;
    let inbox: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(inbox["counts"]["ready"], 4);
    let j5 = inbox["rows"]["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == "j5")
        .expect("j5 is ready in mail");
    assert_eq!(j5["attempt"], 0);
    let (status, _) = send(
        &router,
        post("/requeue", "table=job&id=nope&group=mail&confirm=yes"),
        local,
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // An audit of the registered model; an unregistered table cannot be audited.
    let (status, body) = send(&router, post("/audit", "table=user&confirm=yes"), local).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("clean: 30 rows"), "{body}");
    let (_, body) = send(&router, get("/api/table?name=user"), local).await;
    let table: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(table["last_audit"]["rows"], 30);
    let (status, _) = send(&router, post("/audit", "table=job&confirm=yes"), local).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // A table's shape versions and its rewrite, with the row it left.
    let (_, body) = send(&router, get("/table?name=note"), local).await;
    assert!(
        body.contains("data-figure=\"writable\">2<")
            && body.contains("data-figure=\"rewrite\">finished<")
            && body.contains("rows no code that ran the rewrite reads: 1")
            && body.contains("id <code>n2</code> (version 1)"),
        "{body}"
    );
    let (_, body) = send(&router, get("/api/table?name=note"), local).await;
    let table: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(table["shapes"]["rows"]["2"], 2, "{table}");

    // Dead invocations: counted, listed with their error, retried and discarded after a
    // confirmation each.
    let (_, body) = send(&router, get("/api/queue?topic=flaky"), local).await;
    let flaky: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(flaky["overview"]["dead"]["value"], 2);
    assert_eq!(flaky["dead"][0]["id"], "flaky-0");
    assert_eq!(flaky["dead"][0]["attempts"], 1);
    assert!(
        flaky["dead"][0]["error"]
            .as_str()
            .unwrap()
            .contains("the mail server said no"),
        "{flaky}"
    );
    let (status, page) = send(&router, get("/queue?topic=flaky"), local).await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains("data-dead=\"flaky-1\""), "{page}");
    // Limits: none, then set and shown with how close the queue is.
    assert!(page.contains("data-figure=\"limits\">—<"), "{page}");
    let limits = tito::queue::Limits::none().key_concurrency(2);
    tito::queue::set_limits(&db, Some("flaky"), limits)
        .await
        .unwrap();
    let (_, page) = send(&router, get("/queue?topic=flaky"), local).await;
    assert!(page.contains("2 per key (busiest 0)"), "{page}");
    let (_, body) = send(&router, get("/api/queue?topic=flaky"), local).await;
    let flaky: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(flaky["overview"]["limits"]["limits"]["key_concurrency"], 2);
    assert_eq!(flaky["schedules"], serde_json::json!([]));
    tito::queue::set_limits(&db, Some("flaky"), tito::queue::Limits::none())
        .await
        .unwrap();
    assert!(page.contains("action=\"dead-retry\""), "{page}");
    let (status, body) = send(
        &router,
        post("/dead-retry", "topic=flaky&id=flaky-0"),
        local,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("name=\"confirm\" value=\"yes\""), "{body}");
    let (status, body) = send(
        &router,
        post("/dead-retry", "topic=flaky&id=flaky-0&confirm=yes"),
        local,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("pending again"), "{body}");
    let (status, body) = send(
        &router,
        post("/dead-discard", "topic=flaky&id=flaky-1&confirm=yes"),
        local,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("discarded"), "{body}");
    let (status, body) = send(
        &router,
        post("/dead-discard", "topic=flaky&id=flaky-1&confirm=yes"),
        local,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("not dead"), "{body}");
    let (_, body) = send(&router, get("/api/queue?topic=flaky"), local).await;
    let flaky: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(flaky["overview"]["dead"]["value"], 0);
    assert_eq!(flaky["overview"]["due_now"]["value"], 1);

    // Every action that ran is logged, newest first, with its peer.
    let (_, body) = send(&router, get("/api/actions"), local).await;
    let actions: Value = serde_json::from_str(&body).unwrap();
    let names: Vec<&str> = actions
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["action"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "dead-discard",
            "dead-discard",
            "dead-retry",
            "audit",
            "requeue",
            "erase-owner"
        ]
    );
    assert_eq!(actions[0]["peer"], "127.0.0.1:50000");
}

/// `TITO_DASHBOARD_EVENTS=100000 cargo test -p tito-cli --release --test operator -- --ignored
/// --nocapture dashboard_pages_at_size`: times every page on a store with that many pending
/// events (server-side read time, through the router).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a sizing run; prints figures"]
async fn dashboard_pages_at_size() {
    let events: usize = std::env::var("TITO_DASHBOARD_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let dir = tempfile::tempdir().unwrap();
    let db = Embedded::open(dir.path()).await.unwrap();
    seed(&db).await;
    let queue = Queue::new(db.clone(), QueueConfig::new(4, Duration::from_secs(3600)));
    let now = chrono::Utc::now().timestamp();
    let started = Instant::now();
    for chunk in 0..events.div_ceil(1000) {
        let tx = db.begin().await.unwrap();
        for i in chunk * 1000..((chunk + 1) * 1000).min(events) {
            let due = if i % 2 == 0 { now - 600 } else { now + 600 };
            let event = QueueEvent::new(format!("k{i}"), i, due).with_id(format!("bulk-{i}"));
            queue.publish_in_tx(&event, &tx).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
    println!(
        "seeded {events} pending events in {:.1?}",
        started.elapsed()
    );
    let router = admin(&db);
    for path in [
        "/",
        "/queue",
        "/queue?partition=3",
        "/api/queue",
        "/inbox?table=job&group=mail",
        "/table?name=user",
        "/kv?namespace=sessions",
    ] {
        let mut times = Vec::new();
        for _ in 0..5 {
            let started = Instant::now();
            let (status, _) = send(&router, get(path), Some("127.0.0.1:1")).await;
            assert_eq!(status, StatusCode::OK, "{path}");
            times.push(started.elapsed().as_secs_f64() * 1000.0);
        }
        times.sort_by(f64::total_cmp);
        println!(
            "{path:<32} median {:>8.1} ms   min {:>8.1} ms   max {:>8.1} ms",
            times[2], times[0], times[4]
        );
    }
}

/// The same table as `User`, one deploy later: it adds a unique email index.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "user")]
#[tito(index = "user_by_team: team")]
#[tito(unique_index = "user_by_email: email")]
struct UserV2 {
    id: String,
    team: String,
    email: String,
}

fn tool() -> tito_cli::Tool {
    tito_cli::Tool::new()
        .model::<UserV2>()
        .inbox::<Job>()
        .write_grace(Duration::from_millis(20))
}

async fn execute(path: &str, args: &[&str]) -> Result<String, String> {
    let mut all = vec!["--path", path];
    all.extend_from_slice(args);
    tool().execute(all).await
}

async fn execute_json(path: &str, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let out = execute(path, &all)
        .await
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?} is not JSON ({e}): {out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_with_the_models_builds_audits_repairs_and_shows_inboxes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap().to_string();
    {
        let db = Embedded::open(dir.path()).await.unwrap();
        seed(&db).await;
        db.close().await.unwrap();
    }
    // The stock binary has no model: it says how to get one.
    let stock = run(&["--path", &path, "audit", "user"]);
    assert_eq!(stock.status.code(), Some(1));
    assert!(
        stderr(&stock).contains("tito_cli::Tool::new().model::<YourModel>()"),
        "{}",
        stderr(&stock)
    );

    // The new index is registered as building on first use and built by the tool.
    let built = execute_json(&path, &["index", "build", "user"]).await;
    assert_eq!(built["rows"], USERS as u64, "{built}");
    assert_eq!(
        built["finished"],
        serde_json::json!(["build user_by_email"])
    );
    let status = execute_json(&path, &["index", "status", "user"]).await;
    let states: BTreeMap<String, String> = status["schema"]["indexes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            (
                i["name"].as_str().unwrap().into(),
                i["state"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        states,
        BTreeMap::from([
            ("user_by_email".into(), "ready".into()),
            ("user_by_team".into(), "ready".into())
        ])
    );
    // Nothing is building now: naming an index that is not building is refused.
    let refused = execute(&path, &["index", "build", "user", "user_by_email"]).await;
    assert!(refused.unwrap_err().contains("is not building"));
    let refused = execute(&path, &["index", "drop", "user", "user_by_team"]).await;
    assert!(refused.unwrap_err().contains("is not dropping"));

    let clean = execute_json(&path, &["audit", "user"]).await;
    assert_eq!(clean["rows"], USERS as u64);
    assert!(
        clean["findings"]
            .as_object()
            .unwrap()
            .values()
            .all(|f| f["count"] == 0),
        "{clean}"
    );

    // One index entry lost behind Tito's back: the audit finds it, the repair puts it back.
    {
        let db = Embedded::open(dir.path()).await.unwrap();
        let prefix = tito::keys::index_prefix("user", "user_by_email", &[]).unwrap();
        let end = tito::keys::prefix_end(prefix.clone());
        let tx = db.begin().await.unwrap();
        let rows = tx.scan(prefix.as_bytes(), end.as_bytes(), 1).await.unwrap();
        tx.delete(rows[0].0.clone()).await.unwrap();
        tx.commit().await.unwrap();
        db.close().await.unwrap();
    }
    let found = execute_json(&path, &["audit", "user"]).await;
    let total: u64 = found["findings"]
        .as_object()
        .unwrap()
        .values()
        .map(|f| f["count"].as_u64().unwrap())
        .sum();
    assert_eq!(total, 1, "{found}");
    let text = execute(&path, &["repair", "user"]).await.unwrap();
    assert!(text.starts_with("repair of user: 30 rows"), "{text}");
    let again = execute_json(&path, &["audit", "user"]).await;
    assert!(
        again["findings"]
            .as_object()
            .unwrap()
            .values()
            .all(|f| f["count"] == 0),
        "{again}"
    );
    let status = execute(&path, &["index", "status", "user"]).await.unwrap();
    assert!(status.contains("last audit: 30 rows"), "{status}");

    // Inboxes, through the registered model.
    let stats = execute_json(&path, &["inbox", "stats", "job", "--group", "mail"]).await;
    assert_eq!(
        (stats["ready"].as_u64(), stats["delayed"].as_u64()),
        (Some(3), Some(1))
    );
    let dead = execute_json(&path, &["inbox", "dead", "job", "--group", "mail-dead"]).await;
    assert_eq!(dead["rows"]["items"][0]["id"], "j5");
    assert_eq!(dead["rows"]["items"][0]["attempt"], 5);
    let unknown = execute(&path, &["inbox", "stats", "email", "--group", "x"]).await;
    assert!(unknown.unwrap_err().contains("no inbox model"));
    // Bad usage is reported, not a panic.
    assert!(execute(&path, &["index", "frobnicate"]).await.is_err());
}

/// A directory that is not a store (a mistyped path, someone's notes) is refused by every
/// command and left as it was; a file is refused too.
#[test]
fn the_cli_never_turns_a_directory_into_a_store() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "mine").unwrap();
    let path = dir.path().to_str().unwrap();
    let listing = || {
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    for args in [
        &["table", "ls"][..],
        &["queue", "stats", "--json"][..],
        &["kv", "ls"][..],
        &["gc"][..],
    ] {
        let mut all = vec!["--path", path];
        all.extend_from_slice(args);
        let out = run(&all);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(
            stderr(&out).contains("holds no store (no manifest/ in it); nothing was created"),
            "{args:?}: {}",
            stderr(&out)
        );
        assert_eq!(listing(), vec!["notes.txt".to_string()], "{args:?}");
    }
    let file = dir.path().join("notes.txt");
    let out = run(&["--path", file.to_str().unwrap(), "table", "ls"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("it is not a directory"),
        "{}",
        stderr(&out)
    );
}

/// `tito ... | head -2`: a reader that goes away ends the command quietly, without a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_pipe_ends_the_output_quietly() {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = Embedded::open(dir.path()).await.unwrap();
        seed(&db).await;
        db.close().await.unwrap();
    }
    let mut child = tito()
        .args([
            "--path",
            dir.path().to_str().unwrap(),
            "queue",
            "stats",
            "--topic",
            "default",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The reader closes its end before the tool writes anything.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert!(!err.contains("panicked"), "{err}");
    assert!(!err.contains("Broken pipe"), "{err}");
    assert_eq!(out.status.code(), Some(0), "{err}");
}

/// Mounted as the guide's operating chapter shows, the mount path answers with its slash too (a
/// redirect to the overview); pages and the access rule work under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_answers_at_its_mount_path_with_and_without_a_slash() {
    let dir = tempfile::tempdir().unwrap();
    let db = Embedded::open(dir.path()).await.unwrap();
    seed(&db).await;
    let inbox = Arc::new(Inbox::<_, Job>::new(db.clone()).unwrap());
    for mount in ["/tito", "/tito/"] {
        let admin = tito_admin::Admin::new(db.clone())
            .inbox(inbox.clone(), &["mail"])
            .model::<User>();
        let app = axum::Router::new().merge(admin.mount(mount));
        let local = Some("127.0.0.1:50000");
        let (status, body) = send(&app, get("/tito"), local).await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("<base href=\"/tito/\">"), "{body}");
        assert!(body.contains("data-queue=\"default\""));
        let response = app.clone().oneshot(get("/tito/")).await.unwrap();
        assert_eq!(response.status(), StatusCode::PERMANENT_REDIRECT);
        assert_eq!(response.headers()["location"], "/tito");
        let (status, _) = send(&app, get("/tito/queue"), local).await;
        assert_eq!(status, StatusCode::OK);
        let (status, _) = send(&app, get("/tito"), Some("10.1.2.3:5")).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
    }
    let admin = tito_admin::Admin::new(db.clone());
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| admin.mount("tito")));
    assert!(
        refused.is_err(),
        "a path without its leading slash is refused"
    );
    db.close().await.unwrap();
}

/// The queue page runs a queue: pause and resume (the queue, a partition), cancel one
/// invocation and an owner's, set and lift limits, set a row aside, retry and discard every
/// dead invocation. Each asks for confirmation first (and does nothing then), refuses another
/// origin, checks its input, and is logged; its effect is read back through the runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_runs_a_queue() {
    use tito::TitoError;
    use tito::inspect::QueueState;
    use tito::queue as q;
    let dir = tempfile::tempdir().unwrap();
    let db = Embedded::open(dir.path()).await.unwrap();
    seed(&db).await;
    let router = admin(&db);
    let local = Some("127.0.0.1:50000");
    let act = |form: &str| {
        let (router, form) = (router.clone(), form.to_string());
        async move {
            let (status, unconfirmed) = send(&router, post("/queue-action", &form), local).await;
            assert_eq!(status, StatusCode::OK, "{form}: {unconfirmed}");
            assert!(
                unconfirmed.contains("name=\"confirm\" value=\"yes\""),
                "{form}: {unconfirmed}"
            );
            let mut cross = post("/queue-action", &format!("{form}&confirm=yes"));
            cross
                .headers_mut()
                .insert("origin", "http://evil.example".parse().unwrap());
            assert_eq!(send(&router, cross, local).await.0, StatusCode::FORBIDDEN);
            // Without an Origin, a foreign Referer or a browser's cross-site mark is refused too.
            for (name, value) in [
                ("referer", "http://evil.example/page"),
                ("sec-fetch-site", "cross-site"),
                ("sec-fetch-site", "same-site"),
            ] {
                let mut cross = post("/queue-action", &format!("{form}&confirm=yes"));
                cross.headers_mut().insert(name, value.parse().unwrap());
                assert_eq!(
                    send(&router, cross, local).await.0,
                    StatusCode::FORBIDDEN,
                    "{name}: {value}"
                );
            }
            let (status, done) = send(
                &router,
                post("/queue-action", &format!("{form}&confirm=yes")),
                local,
            )
            .await;
            assert_eq!(status, StatusCode::OK, "{form}: {done}");
            done
        }
    };

    // Pause a partition, then the queue; the confirmation alone paused nothing.
    let paused = |db: Embedded| async move { q::paused(&db, Some("flaky")).await.unwrap() };
    let done = act("action=pause&topic=flaky&partition=1&why=smtp+down").await;
    assert!(done.contains("partition 1: paused"), "{done}");
    let now = paused(db.clone()).await;
    assert!(now.queue.is_none());
    assert_eq!(now.partitions[&1].why, "smtp down");
    let (_, page) = send(&router, get("/queue?topic=flaky"), local).await;
    assert!(
        page.contains("data-figure=\"paused\">1 partition (1: smtp down)<"),
        "the queue page says why: {page}"
    );
    act("action=pause&topic=flaky&why=all+down").await;
    assert!(paused(db.clone()).await.queue.is_some());
    act("action=resume&topic=flaky").await;
    act("action=resume&topic=flaky&partition=1").await;
    let now = paused(db.clone()).await;
    assert!(now.queue.is_none() && now.partitions.is_empty());

    // Limits: set, shown on the form, lifted with every field blank.
    act("action=limits&topic=flaky&concurrency=3&key_concurrency=1&rate=100%2F1m").await;
    let usage = q::limit_usage(&db, Some("flaky")).await.unwrap();
    assert_eq!(usage.limits.concurrency, Some(3));
    assert_eq!(usage.limits.key_concurrency, Some(1));
    assert_eq!(usage.limits.rate.unwrap().starts, 100);
    let (_, page) = send(&router, get("/queue?topic=flaky"), local).await;
    assert!(
        page.contains("name=\"concurrency\" placeholder=\"concurrency\" size=\"11\" value=\"3\""),
        "{page}"
    );
    act("action=limits&topic=flaky&concurrency=&rate=").await;
    assert!(
        q::limit_usage(&db, Some("flaky"))
            .await
            .unwrap()
            .limits
            .is_none()
    );

    // Cancel one invocation, then an owner's work (the default queue's seeded rows).
    let done = act("action=cancel&id=later-0&why=typo").await;
    assert!(done.contains("cancelled"), "{done}");
    let done = act("action=cancel&id=later-0").await;
    assert!(done.contains("not pending (nothing cancelled)"), "{done}");
    let done = act("action=cancel-owner&kind=tenant&owner=acme&why=closed").await;
    assert!(done.contains("3 pending invocations cancelled"), "{done}");

    // Set a pending row aside by its key.
    let page = tito::inspect::queue_scan(&db, None, QueueState::Pending(0), None, 100)
        .await
        .unwrap();
    let key = page
        .items
        .iter()
        .find(|row| row.event.is_some())
        .unwrap()
        .key
        .clone();
    let form = format!("action=set-aside&key={}&why=bad", urlencode(&key));
    let done = act(&form).await;
    assert!(done.contains("set aside"), "{done}");
    let aside = tito::inspect::queue_aside(&db, None, None, 10)
        .await
        .unwrap();
    assert_eq!(aside.items.len(), 1);

    // Every dead invocation: retried (both flaky rows pending again), then none to discard.
    assert_eq!(
        q::dead(&db, Some("flaky"), None, 10).await.unwrap().len(),
        2
    );
    let done = act("action=retry-all-dead&topic=flaky").await;
    assert!(done.contains("2 pending again"), "{done}");
    assert!(
        q::dead(&db, Some("flaky"), None, 10)
            .await
            .unwrap()
            .is_empty()
    );
    let done = act("action=discard-all-dead&topic=flaky").await;
    assert!(done.contains("0 discarded"), "{done}");

    // Bad input is refused before any confirmation.
    for (form, says) in [
        ("action=frobnicate", "no queue action"),
        ("action=pause&partition=x", "whole number"),
        ("action=pause&topic=flaky&partition=99", "partition"),
        ("action=cancel", "an event id is needed"),
        ("action=cancel-owner&kind=tenant", "an owner id is needed"),
        ("action=limits&topic=flaky&rate=100", "is not a rate"),
        ("action=limits&topic=flaky&concurrency=0", "pause it"),
        ("action=set-aside", "the key of a pending row is needed"),
    ] {
        let confirmed = format!("{form}&confirm=yes");
        let (status, body) = send(&router, post("/queue-action", &confirmed), local).await;
        assert!(
            status.is_client_error() || status.is_server_error(),
            "{form}: {status}"
        );
        assert!(body.contains(says), "{form}: {body}");
    }

    // Pending rows show their urgency, their attempt and the last error; each worker holding
    // leases is shown once, with the partitions it holds.
    let retrying = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)).topic("retrying"),
    ));
    retrying
        .publish(
            QueueEvent::now("r", 1u32)
                .with_id("r-1")
                .with_urgency(7)
                .with_owner(tito::QueueOwner::new("mailer", "r-owner")),
        )
        .await
        .unwrap();
    let mut workers = tito::Workers::new();
    let policy =
        q::FailurePolicy::new(5).backoff(Duration::from_secs(3600), Duration::from_secs(3600));
    workers.spawn_worker(
        retrying.clone(),
        WorkerConfig::new(0..2)
            .worker_id("w-1")
            .failure_policy(policy),
        |_: QueueEvent<u32>| async {
            Err::<QueueHandlerOutcome<u32>, _>(TitoError::handler("smtp 451"))
        },
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let page = loop {
        let path = format!(
            "/queue?topic=retrying&partition={}",
            tito::queue::partition_for("r", 2)
        );
        let (_, page) = send(&router, get(&path), local).await;
        if page.contains("last error: handler error: smtp 451") {
            break page;
        }
        assert!(Instant::now() < deadline, "no failed attempt shown: {page}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    workers.shutdown().await.unwrap();
    assert!(page.contains("data-figure=\"urgency\">7<"), "{page}");
    assert!(page.contains("data-figure=\"attempt\">2<"), "{page}");
    assert_eq!(page.matches("data-holder=\"w-1\"").count(), 1, "{page}");
    assert!(page.contains("data-figure=\"held\">2<"), "{page}");
    // The stopped worker's report: its process and host, its one failed run, summed in the
    // handler figures.
    let (_, page) = send(&router, get("/queue?topic=retrying"), local).await;
    let runner = format!("data-figure=\"runner\">pid {} on ", std::process::id());
    assert!(page.contains(&runner), "{page}");
    assert!(page.contains("(stopped)"), "{page}");
    assert!(
        page.contains("data-figure=\"failed\">1 (100.0%)<"),
        "{page}"
    );
    assert!(page.contains("data-figure=\"runs\">1<"), "{page}");

    // Find by event id or by business key, from any partition's page.
    for (find, found) in [("r-1", 1), ("r", 1), ("nobody", 0), ("mailer%3Ar-owner", 1)] {
        let other = 1 - tito::queue::partition_for("r", 2);
        let path = format!("/queue?topic=retrying&partition={other}&find={find}");
        let (_, page) = send(&router, get(&path), local).await;
        assert!(
            page.contains(&format!("data-figure=\"found\">{found} found")),
            "{find}: {page}"
        );
        assert_eq!(page.contains("data-event=\"r-1\""), found == 1, "{find}");
    }

    // Under a per-key limit, a key whose slot is taken is shown at its limit while its
    // handler runs.
    let slow = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(1, Duration::from_secs(3600)).topic("slow"),
    ));
    for n in 0..2u32 {
        slow.publish(QueueEvent::now("k", n)).await.unwrap();
    }
    slow.set_limits(q::Limits::none().key_concurrency(1))
        .await
        .unwrap();
    // Handlers wait for permits: none until the page was read.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let mut workers = tito::Workers::new();
    let held = gate.clone();
    workers.spawn_worker(
        slow.clone(),
        WorkerConfig::new(0..1),
        move |_: QueueEvent<u32>| {
            let held = held.clone();
            async move {
                let _permit = held.acquire().await;
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let page = loop {
        let (_, page) = send(&router, get("/queue?topic=slow"), local).await;
        if page.contains("data-key=\"k\"") {
            break page;
        }
        assert!(Instant::now() < deadline, "no key shown running: {page}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(page.contains("at its limit of 1"), "{page}");
    gate.add_permits(2);
    workers.shutdown().await.unwrap();

    // Every action is in the log, with its result.
    let (_, log) = send(&router, get("/api/actions"), local).await;
    for action in [
        "queue-pause",
        "queue-resume",
        "queue-limits",
        "queue-cancel",
        "queue-cancel-owner",
        "queue-set-aside",
        "queue-retry-all-dead",
        "queue-discard-all-dead",
    ] {
        assert!(log.contains(&format!("\"{action}\"")), "{action}: {log}");
    }
    db.close().await.unwrap();
}

/// `application/x-www-form-urlencoded` for a value.
fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Driving the dashboard in Chromium: the DevTools protocol over a pipe (fd 3 in, fd 4 out,
// messages ending in NUL), so forms are filled and submitted by the browser itself, with its
// own Origin header and navigation.
// ---------------------------------------------------------------------------------------------

struct Browser {
    child: std::process::Child,
    to: std::io::PipeWriter,
    from: std::io::BufReader<std::io::PipeReader>,
    next_id: u64,
    session: String,
    _profile: tempfile::TempDir,
}

impl Browser {
    fn start() -> Browser {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let profile = tempfile::tempdir().unwrap();
        let (child_reads, to) = std::io::pipe().unwrap();
        let (from, child_writes) = std::io::pipe().unwrap();
        let (r, w) = (child_reads.as_raw_fd(), child_writes.as_raw_fd());
        let mut command = Command::new(chromium());
        command
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--remote-debugging-pipe",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        // SAFETY: between fork and exec only async-signal-safe calls (fcntl, dup2, close) run.
        // The pipe's ends may themselves be fds 3 or 4 (the test process opens and closes
        // files on other threads): each is first copied above them, so that neither `dup2`
        // overwrites the other end, and `dup2` onto a different fd always clears the
        // close-on-exec flag (`dup2(3, 3)` would keep it, and Chromium would start without
        // its pipe).
        unsafe {
            command.pre_exec(move || {
                let (r, w) = (
                    libc::fcntl(r, libc::F_DUPFD, 10),
                    libc::fcntl(w, libc::F_DUPFD, 10),
                );
                if r < 0 || w < 0 || libc::dup2(r, 3) < 0 || libc::dup2(w, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(r);
                libc::close(w);
                Ok(())
            });
        }
        let child = command.spawn().expect("chromium starts");
        drop((child_reads, child_writes));
        let mut browser = Browser {
            child,
            to,
            from: std::io::BufReader::new(from),
            next_id: 0,
            session: String::new(),
            _profile: profile,
        };
        let target = browser.call(
            "Target.createTarget",
            serde_json::json!({"url": "about:blank"}),
        );
        let attached = browser.call(
            "Target.attachToTarget",
            serde_json::json!({"targetId": target["targetId"], "flatten": true}),
        );
        browser.session = attached["sessionId"].as_str().unwrap().to_string();
        browser.call("Page.enable", serde_json::json!({}));
        browser
    }

    fn send(&mut self, method: &str, params: serde_json::Value) -> u64 {
        use std::io::Write;
        self.next_id += 1;
        let mut message =
            serde_json::json!({"id": self.next_id, "method": method, "params": params});
        if !self.session.is_empty() {
            message["sessionId"] = self.session.clone().into();
        }
        let mut bytes = serde_json::to_vec(&message).unwrap();
        bytes.push(0);
        self.to.write_all(&bytes).unwrap();
        self.next_id
    }

    /// The next message from the browser (a reply or an event).
    fn receive(&mut self) -> serde_json::Value {
        use std::io::BufRead;
        let mut bytes = Vec::new();
        let read = self.from.read_until(0, &mut bytes).unwrap();
        assert!(read > 0, "chromium closed its pipe");
        bytes.pop();
        serde_json::from_slice(&bytes).unwrap()
    }

    /// Sends a command and returns its result (events that arrive meanwhile are dropped).
    fn call(&mut self, method: &str, params: serde_json::Value) -> serde_json::Value {
        let id = self.send(method, params);
        loop {
            let message = self.receive();
            if message["id"].as_u64() == Some(id) {
                assert!(message.get("error").is_none(), "{method}: {message}");
                return message["result"].clone();
            }
        }
    }

    /// Runs `expression` and waits for the page load it starts (a navigation or a form post).
    fn and_wait_for_load(&mut self, method: &str, params: serde_json::Value) {
        let id = self.send(method, params);
        let (mut replied, mut loaded) = (false, false);
        while !(replied && loaded) {
            let message = self.receive();
            if message["id"].as_u64() == Some(id) {
                assert!(message.get("error").is_none(), "{method}: {message}");
                if let Some(thrown) = message["result"].get("exceptionDetails") {
                    panic!("{method}: {thrown}");
                }
                replied = true;
            }
            if message["method"] == "Page.loadEventFired" {
                loaded = true;
            }
        }
    }

    fn open(&mut self, url: &str) -> String {
        self.and_wait_for_load("Page.navigate", serde_json::json!({"url": url}));
        self.dom()
    }

    fn dom(&mut self) -> String {
        let result = self.call(
            "Runtime.evaluate",
            serde_json::json!({"expression": "document.documentElement.outerHTML", "returnByValue": true}),
        );
        result["result"]["value"].as_str().unwrap().to_string()
    }

    /// Fills the form with id `form` on the page shown, clicks its button, and on the
    /// confirmation page that follows clicks "Yes, do it". Returns the confirmation page and
    /// the page the action answered with.
    fn submit(&mut self, form: &str, fields: &[(&str, &str)]) -> (String, String) {
        let mut script = format!(
            "const f = document.getElementById({});",
            serde_json::json!(form)
        );
        for (name, value) in fields {
            script.push_str(&format!(
                "f.querySelector('[name=' + {} + ']').value = {};",
                serde_json::json!(name),
                serde_json::json!(value)
            ));
        }
        script.push_str("f.querySelector('button').click();");
        self.and_wait_for_load(
            "Runtime.evaluate",
            serde_json::json!({"expression": script}),
        );
        let confirmation = self.dom();
        self.and_wait_for_load(
            "Runtime.evaluate",
            serde_json::json!({"expression": "document.getElementById('confirm').click()"}),
        );
        (confirmation, self.dom())
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every operator action of the queue page, filled in and submitted in Chromium, confirmed on
/// the confirmation page, and read back through the runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_runs_a_queue_from_a_browser() {
    use tito::queue as q;
    let dir = tempfile::tempdir().unwrap();
    let db = Embedded::open(dir.path()).await.unwrap();
    let queue = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)).topic("ops"),
    ));
    let owner = tito::QueueOwner::new("account", "9");
    for n in 0..4u32 {
        let mut event = QueueEvent::now(format!("k{n}"), n).with_id(format!("e{n}"));
        if n >= 2 {
            event = event.with_owner(owner.clone());
        }
        queue.publish(event).await.unwrap();
    }
    // Two dead invocations (a worker whose policy gives up at once), for retry and discard.
    let dead = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(1, Duration::from_secs(3600)).topic("ops-dead"),
    ));
    let fail = |_: QueueEvent<u32>| async {
        Err::<QueueHandlerOutcome<u32>, _>(tito::TitoError::handler("no"))
    };
    for n in 0..2u32 {
        let event = QueueEvent::now("d", n).with_max_attempts(1);
        dead.publish(event).await.unwrap();
    }
    let drained = q::testing::drain(dead.clone(), fail).await.unwrap();
    assert_eq!(drained.dead, 2);

    let app = tito_admin::Admin::new(db.clone()).router();
    let served = Served::start(app, "").await;
    let base = served.base.clone();
    let pending_key = {
        let partition = tito::queue::partition_for("k1", 2);
        let page = tito::inspect::queue_scan(
            &db,
            Some("ops"),
            tito::inspect::QueueState::Pending(partition),
            None,
            100,
        )
        .await
        .unwrap();
        page.items
            .into_iter()
            .find(|r| r.event.as_ref().is_some_and(|e| e.id == "e1"))
            .unwrap()
            .key
    };

    let ops = format!("{base}/queue?topic=ops");
    let dead_page = format!("{base}/queue?topic=ops-dead");
    let answers = tokio::task::spawn_blocking(move || {
        let mut b = Browser::start();
        let mut answers = Vec::new();
        let mut act = |b: &mut Browser, page: &str, form: &str, fields: &[(&str, &str)]| {
            b.open(page);
            let (confirmation, done) = b.submit(form, fields);
            answers.push((form.to_string(), confirmation, done));
        };
        act(
            &mut b,
            &ops,
            "pause",
            &[("partition", "1"), ("why", "disk full")],
        );
        act(&mut b, &ops, "pause", &[("why", "all stop")]);
        act(&mut b, &ops, "resume", &[]);
        act(
            &mut b,
            &ops,
            "limits",
            &[("concurrency", "3"), ("rate", "50/1m")],
        );
        act(
            &mut b,
            &ops,
            "cancel",
            &[("id", "e0"), ("why", "not wanted")],
        );
        act(
            &mut b,
            &ops,
            "cancel-owner",
            &[("kind", "account"), ("owner", "9"), ("why", "closed")],
        );
        act(
            &mut b,
            &ops,
            "set-aside",
            &[("key", &pending_key), ("why", "look later")],
        );
        act(&mut b, &dead_page, "retry-all-dead", &[]);
        answers
    })
    .await
    .unwrap();
    for (form, confirmation, done) in &answers {
        assert!(
            confirmation.contains("id=\"confirm\""),
            "{form}: {confirmation}"
        );
        assert!(!done.contains("id=\"confirm\""), "{form} was done: {done}");
        assert!(!done.contains("Forbidden"), "{form}: {done}");
    }

    // Each action's effect, read through the runtime.
    let paused = q::paused(&db, Some("ops")).await.unwrap();
    assert!(paused.queue.is_none(), "resumed");
    assert_eq!(paused.partitions[&1].why, "disk full");
    let usage = q::limit_usage(&db, Some("ops")).await.unwrap();
    assert_eq!(usage.limits.concurrency, Some(3));
    assert_eq!(usage.limits.rate.unwrap().starts, 50);
    let settled = |id: &'static str| {
        let queue = queue.clone();
        async move {
            q::testing::settled(&queue, id, Duration::from_millis(1))
                .await
                .unwrap()
        }
    };
    let cancelled = |s: q::testing::Settled| match s {
        q::testing::Settled::Completed { cancelled } => cancelled,
        other => panic!("not completed: {other:?}"),
    };
    assert_eq!(
        cancelled(settled("e0").await).as_deref(),
        Some("not wanted")
    );
    for id in ["e2", "e3"] {
        assert_eq!(
            cancelled(settled(id).await).as_deref(),
            Some("closed"),
            "{id}"
        );
    }
    let aside = tito::inspect::queue_aside(&db, Some("ops"), None, 100)
        .await
        .unwrap();
    assert_eq!(aside.items.len(), 1, "e1 set aside");
    assert_eq!(dead.dead(None, 10).await.unwrap().len(), 0, "dead retried");
    assert_eq!(
        support_pending(&dead).await,
        2,
        "retried rows are pending again"
    );

    // Discard: make them dead again, then discard all from the browser.
    let drained = q::testing::drain(dead.clone(), fail).await.unwrap();
    assert_eq!(drained.dead, 2, "retried rows keep their attempts");
    assert_eq!(dead.dead(None, 10).await.unwrap().len(), 2);
    let dead_page = format!("{base}/queue?topic=ops-dead");
    tokio::task::spawn_blocking(move || {
        let mut b = Browser::start();
        b.open(&dead_page);
        let (confirmation, _) = b.submit("discard-all-dead", &[]);
        assert!(confirmation.contains("id=\"confirm\""), "{confirmation}");
    })
    .await
    .unwrap();
    assert_eq!(
        dead.dead(None, 10).await.unwrap().len(),
        0,
        "dead discarded"
    );
    assert_eq!(support_pending(&dead).await, 0);

    served.stop().await;
    db.close().await.unwrap();
}

async fn support_pending<E: tito::TitoEngine>(queue: &Queue<E>) -> usize {
    let mut total = 0;
    for p in 0..queue.config().partitions {
        total += queue.pending_count(p).await.unwrap();
    }
    total
}

// ---------------------------------------------------------------------------------------------
// Lines printed for a person to run, refusals that name what they are about, and the
// dashboard's checks before a confirmation.
// ---------------------------------------------------------------------------------------------

/// Runs a line the tool printed as a shell would: split into words (quotes honoured), `tito`
/// being this build's binary.
fn run_line(line: &str) -> Output {
    let words = shlex::split(line).unwrap_or_else(|| panic!("no shell splits {line:?}"));
    assert_eq!(words[0], "tito", "{line}");
    tito()
        .args(&words[1..])
        .output()
        .expect("the tito binary runs")
}

/// The rest of the first line of `text` that follows `label`.
fn line_after(text: &str, label: &str) -> String {
    let at = text
        .find(label)
        .unwrap_or_else(|| panic!("no {label:?} in {text}"));
    text[at + label.len()..]
        .lines()
        .next()
        .unwrap()
        .trim()
        .to_string()
}

/// Publishes one event per id on the queue `topic` and lets a worker whose every attempt fails
/// under a one-attempt policy move them to the dead state.
async fn make_dead(db: &Embedded, topic: Option<&str>, ids: &[String]) {
    let mut config = QueueConfig::new(2, Duration::from_secs(3600));
    config.topic = topic.map(str::to_string);
    let queue = Arc::new(Queue::new(db.clone(), config));
    for id in ids {
        queue
            .publish(QueueEvent::now(format!("k-{id}"), 1u32).with_id(id.clone()))
            .await
            .unwrap();
    }
    let mut workers = tito::Workers::new();
    workers.spawn_worker(
        queue.clone(),
        WorkerConfig::new(0..2)
            .max_idle_backoff(Duration::from_millis(20))
            .failure_policy(tito::queue::FailurePolicy::new(1)),
        |_: QueueEvent<u32>| async {
            Err::<QueueHandlerOutcome<u32>, _>(tito::TitoError::handler("no"))
        },
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let dead = tito::inspect::queue_dead_count(db, topic, 10_000)
            .await
            .unwrap();
        if dead.value as usize >= ids.len() {
            break;
        }
        assert!(Instant::now() < deadline, "not every event went dead");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    workers.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_printed_command_line_runs_as_printed() {
    // Store A: the queue without a topic beside a queue whose topic is `default` and one with
    // a space; store B: the queue without a topic beside `mail`. Both under a path with a space.
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("store a");
    let b = dir.path().join("store b");
    {
        let db = Embedded::open(&a).await.unwrap();
        make_dead(&db, None, &["d-0".into(), "it's".into()]).await;
        make_dead(&db, Some("default"), &["n-0".into()]).await;
        make_dead(&db, Some("two words"), &["w-0".into(), "-w-1".into()]).await;
        // A pending row a worker noted as undecodable.
        let queue = Queue::new(
            db.clone(),
            QueueConfig::new(2, Duration::from_secs(3600)).topic("two words"),
        );
        let published = queue.publish(QueueEvent::now("odd", "text")).await.unwrap();
        for more in ["more 1", "more 2"] {
            queue.publish(QueueEvent::now("odd", more)).await.unwrap();
        }
        let root = tito::keys::queue_root(Some("two words"));
        let note = tito::keys::undecodable_key(&root, &published.key).unwrap();
        let tx = db.begin().await.unwrap();
        tx.put(
            note.into_bytes(),
            br#"{"type_name":"u32","error":"not a number"}"#.to_vec(),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        db.close().await.unwrap();
    }
    {
        let db = Embedded::open(&b).await.unwrap();
        make_dead(&db, None, &["b-0".into(), "b-1".into()]).await;
        make_dead(&db, Some("mail"), &["m-0".into()]).await;
        db.close().await.unwrap();
    }
    let at = |store: &Path, args: &[&str]| {
        let mut all = vec!["--path", store.to_str().unwrap()];
        all.extend_from_slice(args);
        run(&all)
    };
    let text = |out: Output| {
        assert!(out.status.success(), "{}", stderr(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };

    // Store A: `''` names the queue without a topic, `default` the queue of that topic.
    let listed = text(at(&a, &["queue", "ls"]));
    for name in ["\n''", "\ndefault", "\n'two words'"] {
        assert!(listed.contains(name), "{name}: {listed}");
    }
    let several = at(&a, &["queue", "stats"]);
    refused_with(&several, "(--topic '' for the queue without a topic)");
    let stats = text(at(&a, &["queue", "stats", "--topic", "", "--json"]));
    assert!(stats.contains("\"dead\""), "{stats}");
    let without = text(at(&a, &["queue", "dead", "--topic", ""]));
    assert!(
        without.starts_with("queue '': ") && without.contains("d-0"),
        "{without}"
    );
    let named = text(at(&a, &["queue", "dead", "--topic", "default"]));
    assert!(
        named.starts_with("queue default: ") && named.contains("n-0"),
        "{named}"
    );
    // Every command that takes --topic takes `''`.
    for args in [
        &["queue", "stats"][..],
        &["queue", "peek"],
        &["queue", "dead"],
        &["queue", "schedules"],
        &["queue", "limits"],
        &["queue", "aside"],
    ] {
        let out = at(&a, &[args, &["--topic", ""]].concat());
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    }
    for args in [
        &["queue", "retry-dead", "nobody"][..],
        &["queue", "discard-dead", "nobody", "--yes"],
        &["queue", "cancel", "nobody"],
        &["queue", "cancel-owner", "k", "nobody"],
        &["queue", "resume"],
    ] {
        // Refused as changing nothing, on the queue without a topic (not as an unknown queue).
        refused_with(&at(&a, &[args, &["--topic", ""]].concat()), "queue '': ");
    }
    let paused = at(&a, &["queue", "pause", "--topic", ""]);
    assert!(paused.status.success(), "{}", stderr(&paused));
    assert!(text(at(&a, &["queue", "resume", "--topic", ""])).contains("resumed"));

    // The hints of `queue dead`, followed as printed: each retry and discard line.
    let retry = line_after(&without, "retry: ");
    assert!(retry.contains("--topic ''"), "{retry}");
    assert!(text(run_line(&retry)).contains("pending again"), "{retry}");
    let discard = line_after(&without[without.find("it's").unwrap()..], "discard: ");
    assert!(text(run_line(&discard)).contains("discarded"), "{discard}");
    // A topic with a space, an id that starts with a dash.
    let spaced = text(at(&a, &["queue", "dead", "--topic", "two words"]));
    let retry = line_after(&spaced[spaced.find("-w-1").unwrap()..], "retry: ");
    assert!(retry.contains("--topic 'two words' -- -w-1"), "{retry}");
    assert!(text(run_line(&retry)).contains("pending again"), "{retry}");
    // "Run again with --yes", followed as printed.
    let asked = at(
        &a,
        &["queue", "discard-dead", "--topic", "two words", "w-0"],
    );
    assert_eq!(asked.status.code(), Some(1));
    let again = line_after(&stderr(&asked), "run again with --yes: ");
    assert!(text(run_line(&again)).contains("discarded"), "{again}");
    // "... lists the dead", followed as printed.
    let gone = at(&a, &["queue", "retry-dead", "--topic", "", "d-0"]);
    let list = line_after(&stderr(&gone), "(nothing moved; `");
    let list = list.split('`').next().unwrap();
    assert!(text(run_line(list)).starts_with("queue '': "), "{list}");
    // The line that sets an undecodable row aside.
    let partition = tito::queue::partition_for("odd", 2).to_string();
    let peek = text(at(
        &a,
        &[
            "queue",
            "peek",
            "--topic",
            "two words",
            "--partition",
            &partition,
        ],
    ));
    // The next page of a peek, a page at a time.
    let first = text(at(
        &a,
        &[
            "queue",
            "peek",
            "--topic",
            "two words",
            "--partition",
            &partition,
            "--limit",
            "1",
        ],
    ));
    let next = line_after(&first, "next page: ");
    assert!(next.contains("--topic 'two words'"), "{next}");
    let second = text(run_line(&next));
    assert!(
        second.starts_with("queue 'two words', partition ") && second.contains("next page: "),
        "{second}"
    );
    let aside = line_after(&peek, "set it aside: ");
    assert!(text(run_line(&aside)).contains("set aside"), "{aside}");

    // Store B: the default queue among several is named in every hint.
    let dead = text(at(&b, &["queue", "dead", "--topic", "default"]));
    let retry = line_after(&dead, "retry: ");
    assert!(retry.contains("--topic default"), "{retry}");
    assert!(text(run_line(&retry)).contains("pending again"), "{retry}");
    let asked = at(&b, &["queue", "discard-dead", "--topic", "default", "b-1"]);
    let again = line_after(&stderr(&asked), "run again with --yes: ");
    assert!(text(run_line(&again)).contains("discarded"), "{again}");
    let again = run_line(&again);
    let list = line_after(&stderr(&again), "(nothing deleted; `");
    assert!(text(run_line(list.split('`').next().unwrap())).starts_with("queue default: "));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_name_the_queue_and_say_what_was_expected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap().to_string();
    {
        let db = Embedded::open(dir.path()).await.unwrap();
        make_dead(&db, Some("flaky"), &["f-0".into()]).await;
        let users = db.clone().model::<User>();
        for i in 0..7 {
            users
                .build(User {
                    id: format!("u{i}"),
                    team: "red".into(),
                    email: format!("u{i}@example.com"),
                })
                .await
                .unwrap();
        }
        // A rewrite that found every row in its version already.
        users
            .rewrite_shapes(tito::schema::RewriteOptions::default(), |_| {})
            .await
            .unwrap();
        db.close().await.unwrap();
    }
    let at = |args: &[&str]| {
        let mut all = vec!["--path", path.as_str()];
        all.extend_from_slice(args);
        run(&all)
    };
    // A partition the queue lacks: the same words from pause, resume and peek.
    for command in ["pause", "resume", "peek"] {
        refused_with(
            &at(&["queue", command, "--topic", "flaky", "--partition", "99"]),
            "queue \"flaky\" has 2 partitions (0 to 1): no partition 99",
        );
    }
    // Refusals passed through from the library name the queue.
    let long = "x".repeat(5000);
    for (args, says) in [
        (
            &["queue", "limits", "--concurrency", "0"][..],
            "queue \"flaky\": Limits::concurrency is 0",
        ),
        (
            &["queue", "limits", "--key-rate", "5/9d"],
            "queue \"flaky\": Limits::key_rate counts starts over 9 d; the interval must be \
             from 1 s to 1 d",
        ),
        (
            &["queue", "pause", "--why", &long],
            "queue \"flaky\": a pause's reason holds at most",
        ),
        (
            &["queue", "cancel", "f-0", "--why", &long],
            "queue \"flaky\": a cancellation's reason holds at most",
        ),
    ] {
        refused_with(&at(&[args, &["--topic", "flaky"]].concat()), says);
    }
    // A mistyped or cut-short key is the operator's mistake, and the answer says what a key
    // looks like.
    let root = tito::keys::queue_root(Some("flaky"));
    let whole = tito::keys::pending_key(&root, 1, 1_700_000_000, 7, "e-1");
    for key in [
        "nonsense".to_string(),
        whole[..whole.len() - 6].to_string(),
        whole.replace(":pending:", ":pendin:"),
    ] {
        let out = at(&["queue", "set-aside", "--topic", "flaky", &key]);
        refused_with(&out, "invalid argument: queue \"flaky\": ");
        assert!(
            stderr(&out).contains("such a key reads queue@flaky:pending:PPPP:"),
            "{}",
            stderr(&out)
        );
        assert!(!stderr(&out).contains("integrity"), "{}", stderr(&out));
    }
    // A mistyped table is not an empty one.
    refused_with(
        &at(&["table", "versions", "usr"]),
        "no table \"usr\" in this store (its tables: user)",
    );
    // A rewrite that changed nothing says so.
    let out = at(&["table", "versions", "user"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains(
            "no row needed a rewrite: the last run to version 1 found all 7 rows read in that \
             version already"
        ) && !text.contains("rewritten"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_timeouts_and_write_graces_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap().to_string();
    {
        let db = Embedded::open(dir.path()).await.unwrap();
        make_dead(&db, None, &["x".into()]).await;
        db.close().await.unwrap();
    }
    for timeout in ["0", "3601"] {
        let out = run(&["--path", &path, "--timeout", timeout, "queue", "ls"]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(
            stderr(&out).contains(&format!("{timeout} is not in 1..=3600")),
            "{}",
            stderr(&out)
        );
    }
    assert!(
        run(&["--path", &path, "--timeout", "3600", "queue", "ls"])
            .status
            .success()
    );
    let refused = tito_cli::Tool::new()
        .write_grace(Duration::from_secs(3601))
        .execute(["--path", path.as_str(), "queue", "ls"])
        .await
        .unwrap_err();
    assert!(refused.contains("write grace"), "{refused}");
}

/// Posts `form` to the queue page's actions from loopback, as this dashboard's own page does.
async fn queue_post(router: &axum::Router, form: &str) -> (StatusCode, String) {
    send(router, post("/queue-action", form), Some("127.0.0.1:50000")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_refuses_what_can_never_succeed_before_confirming() {
    let db = Embedded::temporary().await.unwrap();
    make_dead(&db, Some("flaky"), &["f-0".into()]).await;
    let router = tito_admin::Admin::new(db.clone()).router();
    let root = tito::keys::queue_root(Some("flaky"));
    let whole = tito::keys::pending_key(&root, 1, 1_700_000_000, 7, "e-1");
    let cut = urlencode(&whole[..whole.len() - 6]);
    let beyond = tito::keys::pending_key(&root, 9, 1_700_000_000, 7, "e-1");
    let long = "x".repeat(2000);
    for (form, says) in [
        (
            "action=pause&topic=flaky&partition=99".to_string(),
            "queue \"flaky\" has 2 partitions (0 to 1): no partition 99",
        ),
        (
            "action=resume&topic=flaky&partition=99".to_string(),
            "no partition 99",
        ),
        (
            "action=limits&topic=flaky&concurrency=0".to_string(),
            "queue \"flaky\": Limits::concurrency is 0",
        ),
        (
            "action=limits&topic=flaky&rate=0%2F1s".to_string(),
            "Limits::rate allows 0 starts",
        ),
        (
            "action=limits&topic=flaky&key_concurrency=5000".to_string(),
            "Limits::key_concurrency is 5000",
        ),
        (
            "action=limits&topic=flaky&key_rate=5%2F9d".to_string(),
            "counts starts over 9 d",
        ),
        (
            format!("action=pause&topic=flaky&why={long}"),
            "queue \"flaky\": a pause's reason holds at most",
        ),
        (
            format!("action=cancel&topic=flaky&id=f-0&why={long}"),
            "queue \"flaky\": a cancellation's reason holds at most",
        ),
        (
            "action=set-aside&topic=flaky&key=nonsense".to_string(),
            "such a key reads",
        ),
        (
            format!("action=set-aside&topic=flaky&key={cut}"),
            "such a key reads",
        ),
        // Well formed, in a partition the queue lacks: it can never name a row.
        (
            format!("action=set-aside&topic=flaky&key={}", urlencode(&beyond)),
            "queue \"flaky\" has 2 partitions (0 to 1): no partition 9",
        ),
    ] {
        // Not asked to confirm: refused at once, as bad input.
        let (status, body) = queue_post(&router, &form).await;
        let body = body.replace("&quot;", "\"").replace("&#39;", "'");
        assert_eq!(status, StatusCode::BAD_REQUEST, "{form}: {body}");
        assert!(body.contains(says), "{form}: {body}");
        assert!(!body.contains("name=\"confirm\""), "{form}: {body}");
        // Posted as confirmed (a forged or stale confirmation page): the same refusal.
        let (status, body) = queue_post(&router, &format!("{form}&confirm=yes")).await;
        let body = body.replace("&quot;", "\"").replace("&#39;", "'");
        assert_eq!(status, StatusCode::BAD_REQUEST, "{form}: {body}");
        assert!(body.contains(says), "{form}: {body}");
    }
    // The library call refuses the same key with the same words, and a well-formed key in a
    // partition the queue has that names no row moves nothing.
    let refused = tito::queue::set_aside(&db, Some("flaky"), &beyond, "x")
        .await
        .unwrap_err();
    assert!(
        matches!(refused, tito::TitoError::InvalidArgument(_))
            && refused.to_string().contains("no partition 9"),
        "{refused}"
    );
    assert!(
        !tito::queue::set_aside(&db, Some("flaky"), &whole, "x")
            .await
            .unwrap()
    );
    // Nothing was changed.
    assert!(
        tito::queue::paused(&db, Some("flaky"))
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        tito::queue::limits(&db, Some("flaky"))
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_rates_exactly_and_an_unchanged_form_keeps_them() {
    use tito::queue::{Limits, Rate};
    let db = Embedded::temporary().await.unwrap();
    make_dead(&db, Some("flaky"), &["f-0".into()]).await;
    let limits = Limits::none()
        .concurrency(2)
        .rate(Rate::new(10, Duration::from_millis(1500)))
        .key_rate(Rate::new(5, Duration::from_secs(5400)));
    tito::queue::set_limits(&db, Some("flaky"), limits.clone())
        .await
        .unwrap();
    let router = tito_admin::Admin::new(db.clone()).router();
    let (_, page) = send(&router, get("/queue?topic=flaky"), Some("127.0.0.1:50000")).await;
    let value = |name: &str| {
        let at = page
            .find(&format!("name=\"{name}\""))
            .unwrap_or_else(|| panic!("no {name} field: {page}"));
        let rest = &page[at..];
        let open = rest.find("value=\"").unwrap() + "value=\"".len();
        rest[open..open + rest[open..].find('"').unwrap()].to_string()
    };
    assert_eq!(value("rate"), "10 per 1.5 s");
    assert_eq!(value("key_rate"), "5 per 1.5 h");
    assert!(
        page.contains("rate 10 per 1.5 s") && page.contains("per-key rate 5 per 1.5 h"),
        "{page}"
    );
    // The form sent back with only the concurrency changed: the rates stay exactly as they were.
    let form = format!(
        "action=limits&topic=flaky&concurrency=3&key_concurrency={}&rate={}&key_rate={}",
        urlencode(&value("key_concurrency")),
        urlencode(&value("rate")),
        urlencode(&value("key_rate")),
    );
    let (status, asked) = queue_post(&router, &form).await;
    assert_eq!(status, StatusCode::OK, "{asked}");
    assert!(
        asked.contains("Set concurrency 3, rate 10 per 1.5 s, per-key rate 5 per 1.5 h on"),
        "{asked}"
    );
    let (status, done) = queue_post(&router, &format!("{form}&confirm=yes")).await;
    assert_eq!(status, StatusCode::OK, "{done}");
    let stored = tito::queue::limits(&db, Some("flaky")).await.unwrap();
    assert_eq!(stored, limits.concurrency(3));
    let (_, log) = send(&router, get("/api/actions"), Some("127.0.0.1:50000")).await;
    assert!(log.contains("per-key rate 5 per 1.5 h"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_refuses_a_post_no_page_of_its_own_sent() {
    let db = Embedded::temporary().await.unwrap();
    make_dead(&db, Some("flaky"), &["f-0".into()]).await;
    let router = tito_admin::Admin::new(db.clone()).router();
    let mut request = post("/queue-action", "action=pause&topic=flaky&confirm=yes");
    request
        .headers_mut()
        .insert("sec-fetch-site", "none".parse().unwrap());
    let (status, body) = send(&router, request, Some("127.0.0.1:50000")).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert!(
        tito::queue::paused(&db, Some("flaky"))
            .await
            .unwrap()
            .is_empty()
    );
    // The dashboard's own page posts same-origin, and that is applied.
    let mut request = post("/queue-action", "action=pause&topic=flaky&confirm=yes");
    request
        .headers_mut()
        .insert("sec-fetch-site", "same-origin".parse().unwrap());
    let (status, body) = send(&router, request, Some("127.0.0.1:50000")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_all_dead_runs_in_bounded_batches_and_says_what_is_left() {
    let db = Embedded::temporary().await.unwrap();
    let ids: Vec<String> = (0..tito_admin::DEAD_BATCH + 30)
        .map(|i| format!("d-{i:03}"))
        .collect();
    make_dead(&db, Some("flaky"), &ids).await;
    let router = tito_admin::Admin::new(db.clone()).router();
    let (status, first) =
        queue_post(&router, "action=retry-all-dead&topic=flaky&confirm=yes").await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert!(first.contains("100 pending again, 30 left."), "{first}");
    let dead = tito::inspect::queue_dead_count(&db, Some("flaky"), 1000)
        .await
        .unwrap();
    assert_eq!(dead.value, 30);
    // The page continues: its form posts the next batch, already confirmed, with the progress.
    let at = first
        .find("id=\"continue\"")
        .expect("a form for the next batch");
    assert!(first[at..].contains("Continue: the next 30"), "{first}");
    let mut fields = Vec::new();
    let mut rest = &first[at..first[at..].find("</form>").unwrap() + at];
    while let Some(i) = rest.find("name=\"") {
        rest = &rest[i + 6..];
        let name = &rest[..rest.find('"').unwrap()];
        let v = rest.find("value=\"").unwrap() + 7;
        let value = &rest[v..v + rest[v..].find('"').unwrap()];
        fields.push(format!("{name}={}", urlencode(value)));
    }
    let (status, second) = queue_post(&router, &fields.join("&")).await;
    assert_eq!(status, StatusCode::OK, "{second}");
    assert!(
        second.contains("30 pending again (130 in all), none left."),
        "{second}"
    );
    assert!(!second.contains("id=\"continue\""), "{second}");
    let dead = tito::inspect::queue_dead_count(&db, Some("flaky"), 1000)
        .await
        .unwrap();
    assert_eq!(dead.value, 0);
    let (_, log) = send(&router, get("/api/actions"), Some("127.0.0.1:50000")).await;
    assert!(log.contains("100 pending again, 30 left"), "{log}");
}

/// A store with the queue without a topic and a queue whose topic is `default`: the dashboard
/// names them apart in its listing, its titles, its confirmations and its action log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_tells_the_queue_without_a_topic_from_one_named_default() {
    let db = Embedded::temporary().await.unwrap();
    for topic in [None, Some("default")] {
        let mut config = QueueConfig::new(2, Duration::from_secs(3600));
        config.topic = topic.map(str::to_string);
        Queue::new(db.clone(), config)
            .publish(QueueEvent::now("k", 1u32))
            .await
            .unwrap();
    }
    let router = tito_admin::Admin::new(db.clone()).router();
    let local = Some("127.0.0.1:50000");
    let (_, overview) = send(&router, get("/"), local).await;
    assert!(overview.contains("<em>no topic</em>"), "{overview}");
    assert!(overview.contains(">default</a>"), "{overview}");
    let (_, page) = send(&router, get("/queue"), local).await;
    assert!(page.contains("Queue without a topic"), "{page}");
    let (_, page) = send(&router, get("/queue?topic=default"), local).await;
    assert!(page.contains("Queue default"), "{page}");
    let (_, asked) = queue_post(&router, "action=pause&topic=&why=maint").await;
    let asked = asked.replace("&quot;", "\"");
    assert!(asked.contains("the queue without a topic"), "{asked}");
    for topic in ["", "default"] {
        let form = format!("action=pause&topic={topic}&why=maint&confirm=yes");
        let (status, body) = queue_post(&router, &form).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let (_, body) = send(&router, get("/api/actions"), local).await;
    let actions: Value = serde_json::from_str(&body).unwrap();
    let targets: Vec<String> = actions
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.to_string())
        .collect();
    assert_eq!(targets.len(), 2, "{targets:?}");
    assert!(targets[0].contains("queue \\\"default\\\""), "{targets:?}");
    assert!(
        targets[1].contains("the queue without a topic"),
        "{targets:?}"
    );
    assert!(!targets[1].contains("\\\"default\\\""), "{targets:?}");
}

/// `tito store copy` moves a seeded embedded store (a directory with a space in its name) to
/// SQLite and to a TiKV test server; `tito store verify` agrees, and names what differs once
/// the copy changes; the printed "check it with" line runs as printed; a destination that holds
/// data is refused until --resume or --overwrite; bad specs are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_copies_a_store_between_engines_and_verifies_it() {
    let dir = tempfile::tempdir().unwrap();
    let source_dir = dir.path().join("the app");
    let source = Embedded::open(&source_dir).await.unwrap();
    seed(&source).await;
    source.close().await.unwrap();
    drop(source);
    let from = format!("embedded:{}", source_dir.display());
    let to_sqlite = format!("sqlite:{}", dir.path().join("moved").display());

    let copied = run(&["store", "copy", &from, &to_sqlite]);
    assert!(copied.status.success(), "{}", stderr(&copied));
    let text = String::from_utf8_lossy(&copied.stdout).into_owned();
    assert!(
        text.contains("copied ") && text.contains(" 0 deleted"),
        "{text}"
    );
    let check = run_line(&line_after(&text, "check it with:"));
    assert!(check.status.success(), "{}", stderr(&check));
    assert!(String::from_utf8_lossy(&check.stdout).contains("0 keys differ"));

    // Into a store that holds data: refused, then a catch-up pass writes nothing.
    refused_with(&run(&["store", "copy", &from, &to_sqlite]), "holds data");
    let again = stdout_json(&run(&[
        "store", "copy", "--resume", &from, &to_sqlite, "--json",
    ]));
    assert_eq!(again["keys_written"], 0, "{again}");
    assert_eq!(again["keys_deleted"], 0, "{again}");

    // A run of leases longer than the batch (a worker's, left by a crash) is read past: the
    // copy carries every key after it, and verify agrees (round-six defect 1).
    let source = Embedded::open(&source_dir).await.unwrap();
    source
        .transaction(|tx| async move {
            for p in 0..12 {
                tx.put(format!("queue:lease:{p:04}").into_bytes(), b"w".to_vec())
                    .await?;
            }
            Ok::<_, tito::TitoError>(())
        })
        .await
        .unwrap();
    source.close().await.unwrap();
    drop(source);
    let small = run(&[
        "store",
        "copy",
        "--overwrite",
        "--batch",
        "3",
        &from,
        &to_sqlite,
    ]);
    assert!(small.status.success(), "{}", stderr(&small));
    let check = run(&["store", "verify", &from, &to_sqlite]);
    assert!(check.status.success(), "{}", stderr(&check));
    assert!(
        String::from_utf8_lossy(&check.stdout).contains("0 keys differ"),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );

    // To TiKV, then a difference there is named.
    let cluster = tito_tikv_test_server::TestCluster::start().await.unwrap();
    let to_tikv = format!("tikv:{}", cluster.pd_endpoints().join(","));
    let copied = stdout_json(&run(&["store", "copy", &to_sqlite, &to_tikv, "--json"]));
    assert!(copied["keys_written"].as_u64().unwrap() > 0, "{copied}");
    let tikv = tito::TiKV::connect(cluster.pd_endpoints()).await.unwrap();
    let model = tikv.clone().model::<User>();
    model.delete_by_id("u03").await.unwrap();
    let differs = run(&["store", "verify", &from, &to_tikv]);
    refused_with(&differs, "only in");
    assert!(stderr(&differs).contains("u;0;3"), "{}", stderr(&differs));
    let overwritten = run(&["store", "copy", "--overwrite", &from, &to_tikv]);
    assert!(overwritten.status.success(), "{}", stderr(&overwritten));
    assert!(run(&["store", "verify", &to_tikv, &from]).status.success());

    // Bad input.
    for (args, says) in [
        (
            vec!["store", "copy", "nowhere", &to_sqlite],
            "no engine named",
        ),
        (
            vec!["store", "copy", "mysql:x", &to_sqlite],
            "no engine \"mysql\"",
        ),
        (
            vec!["store", "copy", &from, &from],
            "both the source and the destination",
        ),
        (
            vec!["store", "copy", "embedded:/nonexistent/x", &to_sqlite],
            "not an embedded Tito store",
        ),
        (vec!["store", "verify", &from, "tikv:"], "no PD endpoint"),
        (
            vec!["store", "copy", &from, "tikv:h:1?ca=a"],
            "TLS takes three files",
        ),
        (
            vec!["--path", "x", "store", "verify", &from, &to_sqlite],
            "leave out --path",
        ),
    ] {
        refused_with(&run(&args), says);
    }
    let zero = run(&["store", "copy", "--batch", "0", &from, &to_sqlite]);
    assert_eq!(zero.status.code(), Some(2), "{}", stderr(&zero));
}

/// A backup from the dashboard while writers run: confirmed, run in the background with its
/// progress on `/backup` and `/api/backup`, refused while one runs; the backup opens as a
/// store that holds every write acknowledged before it started, and audits clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_backs_a_live_store_up_and_the_backup_restores() {
    let dir = tempfile::tempdir().unwrap();
    let db = Embedded::open(dir.path().join("store")).await.unwrap();
    let backups = dir.path().join("backups");
    let local = Some("127.0.0.1:50000");
    // Not enabled: the page says how; the action is refused.
    let plain = tito_admin::Admin::new(db.clone()).router();
    let (_, page) = send(&plain, get("/backup"), local).await;
    assert!(page.contains("Admin::backups"), "{page}");
    let (status, refused) = send(&plain, post("/backup", "confirm=yes"), local).await;
    assert_ne!(status, StatusCode::OK);
    assert!(refused.contains("not enabled"), "{refused}");

    let users = db.clone().model::<User>();
    for i in 0..2000 {
        users
            .build(User {
                id: format!("u{i}"),
                team: format!("t{}", i % 5),
                email: format!("u{i}@example.com"),
            })
            .await
            .unwrap();
    }
    let acknowledged = Arc::new(std::sync::Mutex::new(Vec::<usize>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (users, acknowledged, stop) = (users.clone(), acknowledged.clone(), stop.clone());
        tokio::spawn(async move {
            let mut i = 10_000;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                users
                    .build(User {
                        id: format!("u{i}"),
                        team: "late".into(),
                        email: format!("u{i}@example.com"),
                    })
                    .await
                    .unwrap();
                acknowledged.lock().unwrap().push(i);
                i += 1;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let router = tito_admin::Admin::new(db.clone())
        .backups(&backups)
        .router();
    let (_, confirm) = send(&router, post("/backup", ""), local).await;
    assert!(confirm.contains("Yes, do it"), "{confirm}");
    let before: Vec<usize> = acknowledged.lock().unwrap().clone();
    let (status, started) = send(&router, post("/backup", "confirm=yes"), local).await;
    assert_eq!(status, StatusCode::OK, "{started}");
    assert!(started.contains("runs in the background"), "{started}");
    // Finished: the JSON says where, and how many keys.
    let deadline = Instant::now() + Duration::from_secs(60);
    let last = loop {
        let (_, body) = send(&router, get("/api/backup"), local).await;
        let status: Value = serde_json::from_str(&body).unwrap();
        if status["running"].is_null() && !status["last"].is_null() {
            break status["last"].clone();
        }
        if !status["running"].is_null() {
            // One at a time.
            let (_, again) = send(&router, post("/backup", "confirm=yes"), local).await;
            assert!(
                again.contains("a backup is running") || again.contains("started"),
                "{again}"
            );
        }
        assert!(Instant::now() < deadline, "the backup did not end: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    writer.await.unwrap();
    assert_eq!(last["ok"], Value::Bool(true), "{last}");
    assert!(last["keys"].as_u64().unwrap() > 2000 * 3, "{last}");
    let (_, page) = send(&router, get("/backup"), local).await;
    assert!(page.contains("Back up now"), "{page}");
    let (_, actions) = send(&router, get("/api/actions"), local).await;
    assert!(actions.contains("\"backup\""), "{actions}");

    let restored = Embedded::open(last["path"].as_str().unwrap())
        .await
        .unwrap();
    let model = restored.clone().model::<User>();
    for i in (0..2000).chain(before.iter().copied()) {
        assert!(
            model.get(&format!("u{i}")).await.unwrap().is_some(),
            "user {i}, acknowledged before the backup"
        );
    }
    let audit = model.audit(|_| {}).await.unwrap();
    assert!(audit.is_clean(), "{audit:?}");
}

// ---------------------------------------------------------------------------------------------
// `tito --url`: the commands of a running application, through its admin router.
// ---------------------------------------------------------------------------------------------

/// A raw request to a live application's router: (status, body).
fn http(url: &str, method: &str, path: &str, headers: &[&str], body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").unwrap();
    let (authority, base) = rest.split_at(rest.find('/').unwrap());
    let mut stream = std::net::TcpStream::connect(authority).unwrap();
    let mut request = format!("{method} {base}{path} HTTP/1.1\r\nHost: {authority}\r\n");
    for header in headers {
        request.push_str(header);
        request.push_str("\r\n");
    }
    request.push_str(&format!(
        "Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    ));
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response[9..12].parse().unwrap();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

#[test]
fn tito_url_runs_the_models_commands_in_the_application_and_refuses_without_its_token() {
    let dir = tempfile::tempdir().unwrap();
    let app = LiveApp::start(dir.path(), true, app_tool);
    let url = app.url.as_str();
    let with_token = |args: &[&str]| {
        let mut all = vec!["--url", url];
        all.extend_from_slice(args);
        tito().env("TITO_TOKEN", TOKEN).args(&all).output().unwrap()
    };

    // The application's models: audits, repairs, index status and inboxes run there.
    let audit = stdout_json(&with_token(&["audit", "user", "--json"]));
    assert_eq!(audit["rows"], USERS as u64, "{audit}");
    let repair = with_token(&["repair", "user"]);
    assert!(
        String::from_utf8_lossy(&repair.stdout).starts_with("repair of user: 30 rows"),
        "{}",
        stderr(&repair)
    );
    let status = stdout_json(&with_token(&["index", "status", "user", "--json"]));
    assert_eq!(status["schema"]["indexes"][0]["state"], "ready");
    let inbox = stdout_json(&with_token(&[
        "inbox", "stats", "job", "--group", "mail", "--json",
    ]));
    assert_eq!(inbox["ready"], 3, "{inbox}");
    refused_with(
        &with_token(&["audit", "note"]),
        "has no model in this binary",
    );
    // --token works as TITO_TOKEN does.
    let given = tito()
        .args(["--url", url, "--token", TOKEN, "queue", "ls", "--json"])
        .env_remove("TITO_TOKEN")
        .output()
        .unwrap();
    assert_eq!(stdout_json(&given).as_array().unwrap().len(), 3);

    // A confirmation: asked for with a line that runs as printed, with the token from the
    // environment (never in the line).
    let ask = with_token(&["queue", "discard-dead", "--topic", "flaky", "flaky-1"]);
    assert_eq!(ask.status.code(), Some(1));
    let line = line_after(&stderr(&ask), "run again with --yes: ");
    assert!(line.starts_with(&format!("tito --url {url} ")), "{line}");
    assert!(!line.contains(TOKEN), "{line}");
    let done = run_line_with_token(&line);
    assert!(done.status.success(), "{line}: {}", stderr(&done));
    refused_with(&run_line_with_token(&line), "not dead");

    // Refusals, each saying what to do.
    let bare = tito()
        .args(["--url", url, "queue", "ls"])
        .env_remove("TITO_TOKEN")
        .output()
        .unwrap();
    refused_with(&bare, "give the application's token in TITO_TOKEN");
    let wrong = tito()
        .args(["--url", url, "queue", "ls"])
        .env("TITO_TOKEN", "not-the-token-of-this-app")
        .output()
        .unwrap();
    refused_with(&wrong, "the token is not this application's");
    let https = url.replace("http://", "https://");
    refused_with(&with_token_at(&https, &["queue", "ls"]), "plain HTTP");
    let elsewhere = url.replace("/ops/tito", "/tito");
    let missing = with_token_at(&elsewhere, &["queue", "ls"]);
    refused_with(&missing, "no Tito admin router at");
    // The hint names the mount path on the host, not under the address that was wrong.
    assert!(
        !stderr(&missing).contains("/tito/tito"),
        "{}",
        stderr(&missing)
    );
    refused_with(
        &with_token(&["store", "verify", "embedded:/a", "embedded:/b"]),
        "leave out --path, --pd and --url",
    );
    refused_with(&with_token(&["serve"]), "serves its own dashboard");
    // --token anywhere on the line; an empty one is no token; without --url it is refused.
    let late = tito()
        .args(["--url", url, "queue", "ls", "--json", "--token", TOKEN])
        .env_remove("TITO_TOKEN")
        .output()
        .unwrap();
    assert_eq!(stdout_json(&late).as_array().unwrap().len(), 3);
    let empty = tito()
        .args(["--url", url, "--token", "", "queue", "ls"])
        .env_remove("TITO_TOKEN")
        .output()
        .unwrap();
    refused_with(&empty, "give the application's token in TITO_TOKEN");
    let stray = run(&["--path", "/x", "--token", TOKEN, "queue", "ls"]);
    refused_with(&stray, "--token goes with --url");
    let mixed = run(&["--url", url, "--path", "/x", "queue", "ls"]);
    assert_eq!(mixed.status.code(), Some(2), "{}", stderr(&mixed));
    let closed = with_token_at("http://127.0.0.1:9/tito", &["queue", "ls"]);
    refused_with(
        &closed,
        "cannot reach the admin router at http://127.0.0.1:9/tito",
    );

    // The router itself: the command endpoint takes the token only (a loopback peer without
    // it is refused); the versioned API says what it serves; each command is in the actions.
    // The unversioned paths answer as the versioned ones, token rule and all.
    let bearer = format!("Authorization: Bearer {TOKEN}");
    for command in ["/api/v1/command", "/api/command"] {
        let post = |headers: &[&str], body: &str| http(url, "POST", command, headers, body);
        let (code, body) = post(&[], r#"{"args":["queue","ls"]}"#);
        assert_eq!(code, 401, "{command}: {body}");
        let (code, body) = post(&[&bearer], "{not json");
        assert_eq!(code, 400, "{command}: {body}");
        let (code, body) = post(
            &[&bearer],
            r#"{"args":["queue","stats","--topic","two words"]}"#,
        );
        assert_eq!(code, 200, "{command}: {body}");
        let reply: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(reply["exit"], 1, "{command}: {reply}");
        // Commands that need no store, and those that name their own, answer in words there
        // too: nothing an operator sends panics.
        let (code, body) = post(
            &[&bearer],
            r#"{"args":["keys","decode","\"table:user:a;<;1\"","--json"]}"#,
        );
        assert_eq!(code, 200, "{command}: {body}");
        let reply: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(reply["exit"], 0, "{command}: {reply}");
        let decoded: Value = serde_json::from_str(reply["stdout"].as_str().unwrap()).unwrap();
        assert_eq!(decoded, serde_json::json!(["table", "user", "a:1"]));
        let (_, body) = post(
            &[&bearer],
            r#"{"args":["store","verify","embedded:/a","embedded:/b"]}"#,
        );
        let reply: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(reply["exit"], 1, "{command}: {reply}");
    }
    for info_path in ["/api/v1", "/api"] {
        let (code, body) = http(url, "GET", info_path, &[], "");
        assert_eq!(code, 200, "{info_path}: {body}");
        let info: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            (info["api"].as_u64(), info["commands"].as_bool()),
            (Some(1), Some(true))
        );
    }
    let (code, v1) = http(url, "GET", "/api/v1/actions", &[], "");
    assert_eq!(code, 200, "{v1}");
    let actions: Value = serde_json::from_str(&v1).unwrap();
    let lines: Vec<&str> = actions
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["action"] == "command")
        .map(|a| a["target"].as_str().unwrap())
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l.ends_with("queue discard-dead --topic flaky --yes flaky-1")),
        "{lines:?}"
    );
    assert!(lines.iter().all(|l| !l.contains(TOKEN)), "{lines:?}");
    // Logged as a shell reads it back: which words were one argument shows.
    assert!(
        lines.contains(&"queue stats --topic 'two words'"),
        "{lines:?}"
    );
    let (_, unversioned) = http(url, "GET", "/api/overview", &[], "");
    let (_, versioned) = http(url, "GET", "/api/v1/overview", &[], "");
    let keys = |text: &str| {
        serde_json::from_str::<Value>(text)
            .unwrap()
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(keys(&unversioned), keys(&versioned));
}

fn with_token_at(url: &str, args: &[&str]) -> Output {
    let mut all = vec!["--url", url];
    all.extend_from_slice(args);
    tito().env("TITO_TOKEN", TOKEN).args(&all).output().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_without_commands_or_with_a_weak_token_runs_none() {
    let db = tito::backend::memory::Memory::new();
    let short = tito_admin::Admin::new(db.clone())
        .commands("short", tito_cli::Tool::new().commands(db.clone()))
        .err()
        .unwrap();
    assert!(short.to_string().contains("at least 16"), "{short}");
    let spaced = tito_admin::Admin::new(db.clone())
        .commands(
            " a-token-with-a-space ",
            tito_cli::Tool::new().commands(db.clone()),
        )
        .err()
        .unwrap();
    assert!(spaced.to_string().contains("printable ASCII"), "{spaced}");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = tito_admin::Admin::new(db).mount("/tito");
    let server = tokio::spawn(tito_admin::serve(listener, router, std::future::pending()));
    let url = format!("http://{addr}/tito");
    let refused = tokio::task::spawn_blocking(move || with_token_at(&url, &["queue", "ls"]))
        .await
        .unwrap();
    refused_with(
        &refused,
        "runs no commands: it enables them with Admin::commands",
    );
    server.abort();
}

/// `tito workflow` and `tito batch`: list (following the printed next-page line as printed),
/// show with each step's state and result, cancel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_lists_shows_and_cancels_workflows_and_batches() {
    use tito::queue::graph::{Batch, Graphs, StepName, Workflow};
    let dir = tempfile::tempdir().unwrap();
    {
        let db = Embedded::open(dir.path()).await.unwrap();
        let graphs = Graphs::new(db.clone());
        let queue = tito::Queue::new(
            db.clone(),
            QueueConfig::new(2, Duration::from_secs(3600)).topic("steps"),
        );
        for id in ["order 1", "order 2", "order 3"] {
            let mut workflow = Workflow::new(id);
            workflow.step(
                &StepName::<()>::new("charge"),
                &queue,
                QueueEvent::now("k", 1u32),
            );
            workflow
                .step(
                    &StepName::<()>::new("ship"),
                    &queue,
                    QueueEvent::now("k", 2u32),
                )
                .after(["charge"]);
            graphs.publish_workflow(&workflow).await.unwrap();
        }
        let batch = Batch::new("import 1");
        let children: Vec<_> = (0..3u32)
            .map(|n| QueueEvent::now(format!("k{n}"), n))
            .collect();
        graphs
            .publish_batch(&batch, &queue, &children)
            .await
            .unwrap();
        db.close().await.unwrap();
    }
    let path = dir.path().to_str().unwrap().to_string();
    let at = |args: &[&str]| {
        let mut all = vec!["--path", path.as_str()];
        all.extend_from_slice(args);
        run(&all)
    };
    let text = |output: Output| {
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let first = text(at(&["workflow", "ls", "--limit", "2"]));
    assert!(
        first.contains("order 1") && first.contains("order 2"),
        "{first}"
    );
    let next = line_after(&first, "next page: ");
    let second = text(run_line(&next));
    assert!(
        second.contains("order 3") && !second.contains("order 1"),
        "{next}: {second}"
    );
    assert!(second.contains("(last page)"), "{second}");
    let shown = text(at(&["workflow", "show", "order 2"]));
    assert!(shown.contains("ship [steps "), "{shown}");
    assert!(
        shown.contains("after charge: waiting for charge"),
        "{shown}"
    );
    assert!(
        shown.contains("charge [steps") && shown.contains("pending (attempt 1)"),
        "{shown}"
    );
    let json = stdout_json(&at(&["workflow", "show", "order 2", "--json"]));
    assert_eq!(json["steps"][1]["state"]["waiting"]["on"][0], "charge");
    let cancelled = text(at(&["workflow", "cancel", "order 2", "--why", "withdrawn"]));
    assert!(
        cancelled.contains("cancelled 2 steps of workflow order 2"),
        "{cancelled}"
    );
    let shown = text(at(&["workflow", "show", "order 2"]));
    assert!(
        shown.contains("2 cancelled") && shown.contains("cancelled: withdrawn"),
        "{shown}"
    );
    let missing = at(&["workflow", "show", "order 9"]);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no workflow \"order 9\""));
    let batches = text(at(&["batch", "ls"]));
    assert!(
        batches.contains("import 1") && batches.contains("closed"),
        "{batches}"
    );
    let shown = text(at(&["batch", "show", "import 1"]));
    assert!(shown.contains("added 3, open 3, completed 0"), "{shown}");
    let cancelled = text(at(&["batch", "cancel", "import 1"]));
    assert!(
        cancelled.contains("cancelled 3 children of batch import 1"),
        "{cancelled}"
    );
    let shown = text(at(&["batch", "show", "import 1"]));
    assert!(
        shown.contains("open 0, completed 0, cancelled 3"),
        "{shown}"
    );
    // gc keeps finished graphs younger than --graph-retention (whatever --retention says of
    // completed rows), and deletes them past it.
    let kept = stdout_json(&at(&[
        "gc",
        "--retention",
        "0",
        "--graph-retention",
        "3600",
        "--json",
    ]));
    assert_eq!(
        (&kept["finished workflows"], &kept["finished batches"]),
        (&serde_json::json!(0), &serde_json::json!(0)),
        "{kept}"
    );
    let gone = stdout_json(&at(&["gc", "--graph-retention", "0", "--json"]));
    assert_eq!(gone["finished batches"], 1, "{gone}");
    assert_eq!(gone["finished workflows"], 1, "{gone}");
    assert!(!at(&["batch", "show", "import 1"]).status.success());
}

/// The dashboard's graphs: the list, a workflow drawn as an inline SVG (a node per step,
/// coloured by its state, an edge per dependency, the state and result in each node's title)
/// with the steps' table, a batch's counts and callbacks, their JSON twins, and unknown ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_draws_workflows_and_shows_batches() {
    use tito::queue::graph::{Batch, Graphs, StepName, Workflow};
    let dir = tempfile::tempdir().unwrap();
    let db = Embedded::open(dir.path()).await.unwrap();
    let graphs = Graphs::new(db.clone());
    let queue = tito::Queue::new(
        db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)).topic("steps"),
    );
    let mut workflow = Workflow::new("order <7>");
    for (name, after) in [
        ("charge", vec![]),
        ("reserve", vec!["charge"]),
        ("receipt", vec!["charge"]),
        ("notify", vec!["reserve", "receipt"]),
    ] {
        workflow
            .step(
                &StepName::<()>::new(name),
                &queue,
                QueueEvent::now("k", 1u32),
            )
            .after(after);
    }
    graphs.publish_workflow(&workflow).await.unwrap();
    let children: Vec<_> = (0..3u32)
        .map(|n| QueueEvent::now(format!("k{n}"), n))
        .collect();
    graphs
        .publish_batch(&Batch::new("import 1"), &queue, &children)
        .await
        .unwrap();
    queue.cancel(&children[0].id, "not needed").await.unwrap();
    let router = tito_admin::Admin::new(db.clone()).router();
    let local = Some("127.0.0.1:50000");

    let (status, list) = send(&router, get("/graphs"), local).await;
    assert_eq!(status, StatusCode::OK, "{list}");
    assert!(
        list.contains("href=\"workflow?id=order%20%3C7%3E\""),
        "{list}"
    );
    assert!(list.contains("data-batch=\"import 1\""), "{list}");
    let (status, page) = send(&router, get("/workflow?id=order%20%3C7%3E"), local).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(page.contains("<svg id=\"workflow-graph\""), "{page}");
    assert_eq!(page.matches("<g class=\"step ").count(), 4, "{page}");
    assert_eq!(page.matches("<line class=\"edge\"").count(), 4, "{page}");
    assert!(
        page.contains(
            "data-step=\"charge\" data-state=\"pending\"><title>charge: pending, attempt 1</title>"
        ),
        "{page}"
    );
    assert!(
        page.contains("data-step=\"notify\" data-state=\"waiting\"><title>notify: waiting for reserve, receipt</title>"),
        "{page}"
    );
    // The name is escaped wherever it is shown.
    assert!(
        page.contains("Workflow order &lt;7&gt;") && !page.contains("order <7>"),
        "{page}"
    );
    let (_, body) = send(&router, get("/api/workflow?id=order%20%3C7%3E"), local).await;
    let json: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json["steps"][3]["state"]["waiting"]["on"][1], "receipt");
    // A cancel shows in the colours.
    graphs
        .cancel_workflow("order <7>", "withdrawn")
        .await
        .unwrap();
    let (_, page) = send(&router, get("/workflow?id=order%20%3C7%3E"), local).await;
    assert_eq!(
        page.matches("data-state=\"cancelled\"><title>").count(),
        4,
        "{page}"
    );
    let (_, batch) = send(&router, get("/batch?id=import%201"), local).await;
    assert!(batch.contains("data-figure=\"added\">3<"), "{batch}");
    assert!(batch.contains("data-figure=\"cancelled\">1<"), "{batch}");
    assert!(batch.contains("data-figure=\"open\">2<"), "{batch}");
    let (status, _) = send(&router, get("/workflow?id=nope"), local).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // The JSON routes answer their failures in JSON, and a missing id says how to ask.
    for (path, status_wanted, says) in [
        (
            "/api/batch?id=nope",
            StatusCode::NOT_FOUND,
            "no batch \\\"nope\\\"",
        ),
        (
            "/api/workflow?id=nope",
            StatusCode::NOT_FOUND,
            "no workflow",
        ),
        ("/api/workflow?id=", StatusCode::BAD_REQUEST, "is empty"),
        (
            "/api/workflow",
            StatusCode::BAD_REQUEST,
            "/workflow?id=<id>",
        ),
    ] {
        let (status, body) = send(&router, get(path), local).await;
        assert_eq!(status, status_wanted, "{path}: {body}");
        let error: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(
            error["error"]
                .as_str()
                .unwrap()
                .contains(&says.replace('\\', "")),
            "{path}: {body}"
        );
    }
    let (status, page) = send(&router, get("/batch"), local).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(page.contains("/batch?id=&lt;id&gt;"), "{page}");
}

/// A queue's hour drawn by the browser: the five charts of the queue and of one partition,
/// from a report of a worker that ran the last fifty minutes (written as a worker writes it)
/// and from a real worker that runs now; every bar and point says its number, the page
/// refreshes itself unless told not to, and the JSON API answers the same figures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_draw_a_queues_last_hour_in_a_browser() {
    use tito::queue::{DepthSample, MinuteFigures, PartitionRuns, WorkerReport};
    let dir = tempfile::tempdir().unwrap();
    let db = Embedded::open(dir.path()).await.unwrap();
    let root = tito::keys::queue_root(Some("charts"));
    let queue = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(4, Duration::from_secs(3600)).topic("charts"),
    ));
    // Fifty minutes of an earlier worker: partition p ran `runs(ago, p)` handlers in the minute
    // `ago` minutes back, one of them failed every third minute, and its depth was sampled.
    let now_ms = chrono::Utc::now().timestamp_millis() as u64;
    let now_min = now_ms / 60_000;
    let runs = |ago: u64, p: u32| (ago % 7) + u64::from(p) + 1;
    let minutes: Vec<MinuteFigures> = (2..=50u64)
        .map(|ago| {
            let partitions: Vec<PartitionRuns> = (0..4u32)
                .map(|p| PartitionRuns {
                    partition: p,
                    runs: runs(ago, p),
                    failed: u64::from(ago % 3 == 0),
                    total_ms: runs(ago, p) * 20,
                    max_ms: 40 + ago,
                    late_total_ms: runs(ago, p) * 100,
                    late_max_ms: 500 + ago,
                })
                .collect();
            let mut figures = MinuteFigures {
                minute: now_min - ago,
                ..MinuteFigures::default()
            };
            for p in &partitions {
                figures.add(&p.figures(figures.minute));
            }
            figures.partitions = partitions;
            figures.depth = (0..4u32)
                .map(|p| DepthSample {
                    partition: p,
                    due: ago + u64::from(p),
                    more: false,
                    oldest_late_s: ago,
                    at_ms: (now_min - ago) * 60_000 + 5_000,
                })
                .collect();
            figures
        })
        .rev()
        .collect();
    let report = WorkerReport {
        worker: "earlier".into(),
        runner: "pid 1 on elsewhere".into(),
        started_ms: now_ms - 3_000_000,
        written_ms: now_ms,
        stopped: true,
        minutes,
    };
    let tx = db.begin().await.unwrap();
    tx.put(
        format!("{root}:report:earlier").into_bytes(),
        serde_json::to_vec(&report).unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    // A real worker now: twelve events, every fourth failing for good.
    for n in 0..12u32 {
        queue
            .publish(QueueEvent::now(format!("key-{n}"), n))
            .await
            .unwrap();
    }
    let mut workers = tito::Workers::new();
    workers.spawn_worker(
        queue.clone(),
        WorkerConfig::new(0..4)
            .failure_policy(tito::queue::FailurePolicy::new(1))
            .max_idle_backoff(Duration::from_millis(20)),
        |event: QueueEvent<u32>| async move {
            if event.payload.is_multiple_of(4) {
                return Err(tito::TitoError::InvalidArgument(
                    "every fourth fails".into(),
                ));
            }
            Ok(QueueHandlerOutcome::Acknowledge)
        },
    );
    let settled = || async {
        let o = tito::inspect::queue_overview(&db, Some("charts"))
            .await
            .unwrap();
        o.completed.value + o.dead.value == 12
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !settled().await {
        assert!(Instant::now() < deadline, "the twelve events settled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    workers.shutdown().await.unwrap();

    // The JSON API: the seeded minutes and the real worker's twelve, each counted once.
    let router = tito_admin::Admin::new(db.clone()).router();
    let local = Some("127.0.0.1:50000");
    let (status, body) = send(&router, get("/api/charts?topic=charts"), local).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let data: Value = serde_json::from_str(&body).unwrap();
    let hour = data["minutes"].as_array().unwrap();
    assert_eq!(hour.len(), 60);
    let sum = |field: &str| hour.iter().map(|m| m[field].as_u64().unwrap()).sum::<u64>();
    let seeded_runs: u64 = (2..=50u64)
        .flat_map(|ago| (0..4u32).map(move |p| runs(ago, p)))
        .sum();
    let seeded_failed: u64 = (2..=50u64).filter(|ago| ago % 3 == 0).count() as u64 * 4;
    assert_eq!(sum("runs"), seeded_runs + 12);
    assert_eq!(sum("failed"), seeded_failed + 3);
    let parts = data["partitions"].as_array().unwrap();
    assert_eq!(parts.len(), 4);
    let (status, body) = send(&router, get("/api/charts?topic=charts&partition=2"), local).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let two: Value = serde_json::from_str(&body).unwrap();
    let seeded_two: u64 = (2..=50u64).map(|ago| runs(ago, 2)).sum();
    let two_runs: u64 = two["minutes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["runs"].as_u64().unwrap())
        .sum();
    assert!(
        (seeded_two..=seeded_two + 12).contains(&two_runs),
        "partition 2: {two_runs} runs, {seeded_two} seeded"
    );
    // Bad input is refused with what to give instead.
    // Bad input is refused with what to give instead, as JSON from the API and as a page.
    for (path, says) in [
        (
            "/charts?topic=charts&partition=4",
            "queue &quot;charts&quot; has partitions 0 to 3",
        ),
        (
            "/api/charts?topic=charts&partition=4",
            r#"queue \"charts\" has partitions 0 to 3"#,
        ),
        (
            "/api/charts?topic=charts&partition=-1",
            "has partitions 0 to 3",
        ),
        (
            "/api/charts?topic=charts&partition=4294967296",
            "has partitions 0 to 3",
        ),
        (
            "/api/charts?topic=charts&partition=abc",
            "has partitions 0 to 3",
        ),
        ("/api/charts?topic=charts&refresh=2", "5 to 3600, or 0"),
        ("/api/charts?topic=charts&refresh=-5", "5 to 3600, or 0"),
        (
            "/api/charts?topic=charts&refresh=99999999999999999999999",
            "5 to 3600, or 0",
        ),
        ("/api/charts?topic=charts&refresh=5.0", "5 to 3600, or 0"),
        (
            "/api/charts?topic=nope",
            r#"no queue \"nope\" in this store (its queues: queue \"charts\")"#,
        ),
        (
            "/api/charts?topic=",
            "the queue without a topic is not in this store (its queues: queue",
        ),
        (
            "/api/queue?topic=charts&partition=x",
            "give a partition number of the queue",
        ),
        (
            "/api/queue?topic=nope",
            r#"no queue \"nope\" in this store (its queues"#,
        ),
    ] {
        let (status, body) = send(&router, get(path), local).await;
        assert!(status.is_client_error(), "{path}: {status} {body}");
        assert!(body.contains(says), "{path}: {body}");
        if path.starts_with("/api/") {
            let error: Value =
                serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"));
            assert!(error["error"].is_string(), "{path}: {body}");
        }
    }

    // An index caught mid-build: ten users, then a deploy adds a unique index, built one
    // batch of four rows.
    let users = db.clone().model::<User>();
    for n in 0..10 {
        users
            .build(User {
                id: format!("u{n}"),
                team: "t".into(),
                email: format!("u{n}@example.com"),
            })
            .await
            .unwrap();
    }
    tito::schema::set_write_grace(&db, Duration::from_millis(1)).unwrap();
    let next = db.clone().model::<UserV2>();
    next.schema().await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let step = next.schema_step(4).await.unwrap();
    assert_eq!(
        (step.index.as_deref(), step.handled, step.finished),
        (Some("user_by_email"), 4, false)
    );

    // The browser.
    let app = axum::Router::new().merge(tito_admin::Admin::new(db.clone()).mount("/tito"));
    let served = Served::start(app, "/tito").await;
    let base = served.base.clone();
    let pages = tokio::task::spawn_blocking(move || {
        [
            ("/charts?topic=charts", "charts"),
            (
                "/charts?topic=charts&partition=2&refresh=0",
                "charts-partition-2",
            ),
            ("", "overview-with-sparklines"),
            ("/table?name=user", "table-mid-build"),
        ]
        .map(|(path, name)| (name, browse(&base, path, name)))
    })
    .await
    .unwrap();
    let page = |name: &str| pages.iter().find(|(n, _)| *n == name).unwrap().1.clone();
    let charts = page("charts");
    for chart in [
        "throughput",
        "failures",
        "depth",
        "lateness",
        "handler-time",
    ] {
        let at = charts
            .find(&format!("data-chart=\"{chart}\""))
            .unwrap_or_else(|| panic!("chart {chart}: {charts}"));
        let figure = &charts[at..at + charts[at..].find("</figure>").unwrap()];
        assert!(figure.contains("<svg"), "{chart}");
        assert!(
            figure.contains("<table class=\"numbers\""),
            "{chart} has its numbers"
        );
        assert!(
            figure.matches("data-minute=").count() >= 2 * 49,
            "{chart}: a mark and a row per seeded minute"
        );
    }
    // Minute by minute, each mark carries the figure the report holds: ten minutes back,
    // partitions ran 4 + 10 % 7 * 4 + 6 runs (one failed in minutes divisible by three).
    let ten = now_min - 10;
    let ten_runs: u64 = (0..4).map(|p| runs(10, p)).sum();
    let mark = |chart: &str, minute: u64| -> String {
        let at = charts.find(&format!("data-chart=\"{chart}\"")).unwrap();
        let figure = &charts[at..];
        let tag = format!("data-minute=\"{minute}\" data-value=\"");
        let from = figure
            .find(&tag)
            .unwrap_or_else(|| panic!("{chart} minute {minute}"))
            + tag.len();
        figure[from..from + figure[from..].find('"').unwrap()].to_string()
    };
    assert_eq!(mark("throughput", ten), ten_runs.to_string());
    assert_eq!(
        mark("failures", ten - 2),
        "4",
        "minute 12 back: one failure a partition"
    );
    assert_eq!(mark("depth", ten), (10 + 11 + 12 + 13).to_string());
    assert_eq!(mark("handler-time", ten), "20", "20 ms a run");
    assert_eq!(mark("lateness", ten), "100", "100 ms late a run");
    // In words, for screen readers and at a glance.
    assert!(
        charts.contains("handled: ") && charts.contains(" in all, at most "),
        "{charts}"
    );
    assert!(charts.contains("<meta http-equiv=\"refresh\" content=\"15\">"));
    // The partitions' table links each partition's charts.
    for p in 0..4 {
        assert!(
            charts.contains(&format!("href=\"charts?topic=charts&amp;partition={p}\"")),
            "partition {p}: {charts}"
        );
    }
    let two = page("charts-partition-2");
    assert!(
        !two.contains("http-equiv=\"refresh\""),
        "refresh=0 stops it"
    );
    let at = two.find("data-chart=\"throughput\"").unwrap();
    let tag = format!("data-minute=\"{ten}\" data-value=\"");
    let from = two[at..].find(&tag).unwrap() + at + tag.len();
    let value = &two[from..from + two[from..].find('"').unwrap()];
    assert_eq!(value, runs(10, 2).to_string(), "partition 2's own figure");
    let overview = page("overview-with-sparklines");
    let row = overview
        .split("data-queue=\"charts\"")
        .nth(1)
        .and_then(|row| row.split("</tr>").next())
        .unwrap();
    assert!(row.contains("class=\"spark\""), "{row}");
    assert!(row.contains("href=\"charts?topic=charts\""), "{row}");

    // The index being built: its state, and its progress as a bar with its numbers.
    let table = page("table-mid-build");
    assert_eq!(
        figure_after(
            &table,
            "data-index=\"user_by_email\"",
            "data-figure=\"state\""
        ),
        "building"
    );
    let row = table
        .split("data-index=\"user_by_email\"")
        .nth(1)
        .and_then(|row| row.split("</tr>").next())
        .unwrap();
    assert!(
        row.contains("<progress id=\"progress-user_by_email\" max=\"10\" value=\"4\"")
            && row.contains("4 of 10 rows (40%)"),
        "{row}"
    );

    // Screenshots for the documentation, when asked: TITO_DOC_SCREENSHOTS=docs/images.
    if let Ok(dir) = std::env::var("TITO_DOC_SCREENSHOTS") {
        let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard");
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(dir);
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["charts", "charts-partition-2"] {
            std::fs::copy(
                shots.join(format!("{name}.png")),
                dir.join(format!("dashboard-{name}.png")),
            )
            .unwrap();
        }
    }
    served.stop().await;
    db.close().await.unwrap();

    // `tito queue stats` prints the same hour: in all and per partition.
    let path = dir.path().to_str().unwrap();
    let text = execute(path, &["queue", "stats", "--topic", "charts"])
        .await
        .unwrap();
    let line = line_after(&text, "the last hour: ");
    assert!(
        line.starts_with(&format!(
            "{} runs, {} failed, mean ",
            seeded_runs + 12,
            seeded_failed + 3
        )),
        "{text}"
    );
    assert!(line.contains(" ms late on average, at most "), "{text}");
    let header = text.lines().find(|l| l.contains("PARTITION")).unwrap();
    assert!(
        header.contains("RUNS 1H") && header.contains("FAILED 1H"),
        "{text}"
    );
    let mut per_partition = 0;
    for p in 0..4u32 {
        let row: Vec<&str> = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(&p.to_string()))
            .unwrap_or_else(|| panic!("partition {p}: {text}"))
            .split_whitespace()
            .collect();
        let seeded: u64 = (2..=50u64).map(|ago| runs(ago, p)).sum();
        let ran: u64 = row[4].parse().unwrap();
        assert!(
            (seeded..=seeded + 12).contains(&ran),
            "partition {p}: {text}"
        );
        per_partition += ran;
    }
    assert_eq!(per_partition, seeded_runs + 12, "{text}");
}
