//! Moving a store: `tito store copy FROM TO` and `tito store verify A B`, between any two
//! engines, named by store specs (`embedded:DIR`, `sqlite:DIR`, `tikv:PD[,PD..]` with
//! `?keyspace=NAME&ca=FILE&cert=FILE&key=FILE`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tito::Embedded;
use tito::store::{CopyOptions, Existing, VerifyOptions};

use crate::rerun::quote;
use crate::{Failure, Outcome, bar, print};

/// What a store spec names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Spec {
    Embedded(PathBuf),
    Sqlite(PathBuf),
    Tikv {
        endpoints: Vec<String>,
        keyspace: Option<String>,
        tls: Option<[PathBuf; 3]>,
    },
}

const SPEC_FORMS: &str = "embedded:DIR, sqlite:DIR or tikv:HOST:PORT[,HOST:PORT..] (with \
                          ?keyspace=NAME and ca=FILE&cert=FILE&key=FILE for TLS)";

impl Spec {
    pub(crate) fn parse(spec: &str) -> Result<Spec, Failure> {
        let refuse =
            |why: &str| Failure(format!("store {spec:?}: {why}; a store reads {SPEC_FORMS}"));
        let (kind, rest) = spec
            .split_once(':')
            .ok_or_else(|| refuse("no engine named"))?;
        match kind {
            "embedded" | "sqlite" if rest.is_empty() => Err(refuse("no directory")),
            "embedded" => Ok(Spec::Embedded(rest.into())),
            "sqlite" => Ok(Spec::Sqlite(rest.into())),
            "tikv" => {
                let (endpoints, query) = rest.split_once('?').unwrap_or((rest, ""));
                let endpoints: Vec<String> = endpoints
                    .split(',')
                    .filter(|e| !e.is_empty())
                    .map(str::to_string)
                    .collect();
                if endpoints.is_empty() {
                    return Err(refuse("no PD endpoint"));
                }
                let (mut keyspace, mut ca, mut cert, mut key) = (None, None, None, None);
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    let (name, value) = pair
                        .split_once('=')
                        .ok_or_else(|| refuse(&format!("{pair:?} is not NAME=VALUE")))?;
                    let slot = match name {
                        "keyspace" => &mut keyspace,
                        "ca" => &mut ca,
                        "cert" => &mut cert,
                        "key" => &mut key,
                        other => return Err(refuse(&format!("no option {other:?}"))),
                    };
                    if value.is_empty() {
                        return Err(refuse(&format!("{name} is empty")));
                    }
                    *slot = Some(value.to_string());
                }
                let tls = match (ca, cert, key) {
                    (None, None, None) => None,
                    (Some(ca), Some(cert), Some(key)) => Some([ca.into(), cert.into(), key.into()]),
                    _ => return Err(refuse("TLS takes three files: ca, cert and key together")),
                };
                Ok(Spec::Tikv {
                    endpoints,
                    keyspace,
                    tls,
                })
            }
            other => Err(refuse(&format!("no engine {other:?}"))),
        }
    }
}

/// A store opened from a spec.
pub(crate) enum Opened {
    Embedded(Embedded),
    #[cfg(feature = "sqlite")]
    Sqlite(tito::backend::sqlite::Sqlite),
    #[cfg(feature = "tikv")]
    Tikv(tito::TiKV),
}

/// Runs `$body` with `$db` bound to the opened store, whatever its engine.
macro_rules! with_store {
    ($opened:expr, $db:ident => $body:expr) => {
        match $opened {
            Opened::Embedded($db) => $body,
            #[cfg(feature = "sqlite")]
            Opened::Sqlite($db) => $body,
            #[cfg(feature = "tikv")]
            Opened::Tikv($db) => $body,
        }
    };
}

impl Opened {
    /// Opens a store: an existing one (`create` false), or one made when missing.
    #[cfg_attr(not(feature = "tikv"), allow(unused_variables))]
    async fn open(spec: &Spec, create: bool, timeout: Duration) -> Result<Opened, Failure> {
        match spec {
            Spec::Embedded(dir) => {
                let options =
                    tito::backend::embedded::EmbeddedOptions::new().create_if_missing(create);
                let db = Embedded::open_with(dir, options)
                    .await
                    .map_err(|err| Failure(format!("{}: {err}", dir.display())))?;
                Ok(Opened::Embedded(db))
            }
            #[cfg(feature = "sqlite")]
            Spec::Sqlite(dir) => {
                use tito::backend::sqlite::Sqlite;
                if !create && !Sqlite::is_store(dir) {
                    return Err(Failure(format!(
                        "{} is not a SQLite Tito store (no {} in it); nothing was created",
                        dir.display(),
                        tito::backend::sqlite::DATABASE_FILE
                    )));
                }
                let db = Sqlite::open(dir)
                    .await
                    .map_err(|err| Failure(format!("{}: {err}", dir.display())))?;
                Ok(Opened::Sqlite(db))
            }
            #[cfg(not(feature = "sqlite"))]
            Spec::Sqlite(_) => Err(Failure(
                "this tito was built without SQLite (tito-cli's `sqlite` feature)".into(),
            )),
            #[cfg(feature = "tikv")]
            Spec::Tikv {
                endpoints,
                keyspace,
                tls,
            } => {
                let args = crate::cli::StoreArgs {
                    path: None,
                    url: None,
                    token: None,
                    pd: Some(endpoints.clone()),
                    keyspace: keyspace.clone(),
                    tls_ca: tls.as_ref().map(|t| t[0].clone()),
                    tls_cert: tls.as_ref().map(|t| t[1].clone()),
                    tls_key: tls.as_ref().map(|t| t[2].clone()),
                };
                Ok(Opened::Tikv(
                    crate::connect_tikv(endpoints, &args, timeout).await?,
                ))
            }
            #[cfg(not(feature = "tikv"))]
            Spec::Tikv { .. } => Err(Failure(
                "this tito was built without TiKV (tito-cli's `tikv` feature)".into(),
            )),
        }
    }

    /// Opens two stores: the first an existing one, the second made when missing if `create`;
    /// the first is closed again when the second cannot be opened.
    async fn open_pair(
        (first, second): (&Spec, &Spec),
        create: bool,
        timeout: Duration,
    ) -> Result<(Opened, Opened), Failure> {
        let first = Opened::open(first, false, timeout).await?;
        match Opened::open(second, create, timeout).await {
            Ok(second) => Ok((first, second)),
            Err(err) => {
                first.close().await;
                Err(err)
            }
        }
    }

    /// Closes a local store so the next command opens it at once.
    async fn close(self) {
        match self {
            Opened::Embedded(db) => {
                let _ = db.close().await;
            }
            #[cfg(feature = "sqlite")]
            Opened::Sqlite(db) => {
                let _ = db.close().await;
            }
            #[cfg(feature = "tikv")]
            Opened::Tikv(_) => {}
        }
    }
}

/// `tito store copy`.
pub(crate) struct CopyArgs {
    pub from: String,
    pub to: String,
    pub existing: Existing,
    pub batch: usize,
    pub rate: Option<u64>,
    pub count: bool,
    pub holders: bool,
}

pub(crate) async fn copy(args: CopyArgs, json: bool, timeout: Duration) -> Outcome {
    let (from_spec, to_spec) = (Spec::parse(&args.from)?, Spec::parse(&args.to)?);
    if from_spec == to_spec {
        return Err(Failure(format!(
            "{} is both the source and the destination",
            args.from
        )));
    }
    let mut options = CopyOptions::new()
        .batch(args.batch)
        .existing(args.existing)
        .count_first(args.count)
        .holders(args.holders);
    if let Some(rate) = args.rate {
        options = options.keys_per_second(rate);
    }
    let (from, to) = Opened::open_pair((&from_spec, &to_spec), true, timeout).await?;
    let started = Instant::now();
    let progress = bar(None, json, "copying".into());
    let result = with_store!(&from, a => with_store!(&to, b => {
        tito::store::copy(a, b, options.clone(), |p| {
            if let Some(total) = p.total_keys {
                progress.set_length(total);
            }
            progress.set_position(p.keys_read);
            progress.set_message(format!(
                "copying: {} written, {} deleted, {:.1} MiB",
                p.keys_written,
                p.keys_deleted,
                p.bytes_written as f64 / (1 << 20) as f64
            ));
        })
        .await
    }));
    progress.finish_and_clear();
    from.close().await;
    to.close().await;
    let report = result.map_err(|err| {
        let mut text = err.to_string();
        if !text.contains("resume") {
            text.push_str(&format!(
                "; what was copied stays; continue with: {}",
                command_line(&["store", "copy", "--resume", &args.from, &args.to])
            ));
        }
        Failure(text)
    })?;
    let secs = started.elapsed().as_secs_f64();
    let p = &report.progress;
    print(json, &report, || {
        format!(
            "copied {} keys ({} written, {} deleted, {:.1} MiB) in {secs:.1} s ({:.0} keys/s){}; \
             the destination's clock waited {} ms\ncheck it with: {}",
            p.keys_read,
            p.keys_written,
            p.keys_deleted,
            p.bytes_written as f64 / (1 << 20) as f64,
            p.keys_read as f64 / secs.max(1e-9),
            if p.resumed { ", resumed" } else { "" },
            report.clock_waited_ms,
            command_line(&["store", "verify", &args.from, &args.to])
        )
    })
}

/// `tito store verify`: exit status 1 when the stores differ.
pub(crate) async fn verify(
    a: String,
    b: String,
    options: VerifyOptions,
    json: bool,
    timeout: Duration,
) -> Outcome {
    let (spec_a, spec_b) = (Spec::parse(&a)?, Spec::parse(&b)?);
    let (opened_a, opened_b) = Opened::open_pair((&spec_a, &spec_b), false, timeout).await?;
    let progress = bar(None, json, "comparing".into());
    let mut differing_ranges = Vec::new();
    let result = with_store!(&opened_a, x => with_store!(&opened_b, y => {
        tito::store::verify(x, y, options.clone(), |range| {
            progress.inc(range.count_a);
            if !range.equal() && differing_ranges.len() < 10 {
                differing_ranges.push(range.clone());
            }
        })
        .await
    }));
    progress.finish_and_clear();
    opened_a.close().await;
    opened_b.close().await;
    let report = result?;
    let text = || {
        let mut lines = vec![format!(
            "{}: {} keys ({:.1} MiB), {}: {} keys; {} ranges compared, {} differ; {} keys differ",
            a,
            report.keys_a,
            report.bytes_a as f64 / (1 << 20) as f64,
            b,
            report.keys_b,
            report.ranges,
            report.ranges_differing,
            report.differing_keys
        )];
        for range in &differing_ranges {
            lines.push(format!(
                "range {} .. {}: {} keys against {}",
                range.first, range.last, range.count_a, range.count_b
            ));
        }
        for difference in &report.first_differences {
            lines.push(match difference {
                tito::store::Difference::OnlyInA(key) => format!("only in {a}: {key}"),
                tito::store::Difference::OnlyInB(key) => format!("only in {b}: {key}"),
                tito::store::Difference::Changed(key) => format!("different values: {key}"),
            });
        }
        lines.join("\n")
    };
    if report.equal() {
        print(json, &report, text)
    } else if json {
        Err(Failure(
            serde_json::to_string_pretty(&report).unwrap_or_default(),
        ))
    } else {
        Err(Failure(text()))
    }
}

/// A `tito` command line, quoted to run as printed.
fn command_line(words: &[&str]) -> String {
    std::iter::once("tito".to_string())
        .chain(words.iter().map(|w| quote(w)))
        .collect::<Vec<_>>()
        .join(" ")
}
