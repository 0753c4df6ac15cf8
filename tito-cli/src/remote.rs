//! `tito --url`: a command line run in a running application, through its admin router.
//!
//! The client posts the command line (without the token) to `{url}/api/v1/command` with
//! `Authorization: Bearer TOKEN`; the application's [`Remote`] (from `Tool::commands`) parses
//! it with this same command line and runs it on the application's store, and the reply
//! carries what the command printed and its exit status. The hints a command prints name the
//! router (`tito --url URL ...`), never the token.

use std::ffi::OsString;
use std::time::Duration;

use futures::future::BoxFuture;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tito::TitoEngine;
use tito_admin::{CommandReply, CommandRequest};

use crate::cli::{Cli, Command};
use crate::{Ended, Failure, Tool, execute};

tokio::task_local! {
    /// Set while a command runs for `tito --url`: progress bars are not drawn on the
    /// application's terminal.
    static REMOTE: ();
}

/// Whether the command running on this task came through an admin router.
pub(crate) fn running_remotely() -> bool {
    REMOTE.try_with(|_| ()).is_ok()
}

/// The runner `Tool::commands` returns.
pub(crate) struct Remote<E: TitoEngine>(pub(crate) std::sync::Arc<(Tool, E)>);

impl<E: TitoEngine> tito_admin::Commands for Remote<E> {
    fn run(&self, args: Vec<String>) -> BoxFuture<'_, CommandReply> {
        let remote = Remote(self.0.clone());
        Box::pin(async move {
            // The commands' futures are not `Send` for every lifetime the compiler asks about
            // (references held across awaits in generic code), so one runs on a blocking
            // thread of the application's runtime, driven by that runtime.
            let runtime = tokio::runtime::Handle::current();
            let ran = tokio::task::spawn_blocking(move || {
                runtime.block_on(REMOTE.scope((), remote.reply(args)))
            })
            .await;
            ran.unwrap_or_else(|err| reply(1, String::new(), format!("the command stopped: {err}")))
        })
    }
}

fn reply(exit: u8, stdout: String, stderr: String) -> CommandReply {
    CommandReply {
        exit,
        stdout,
        stderr,
    }
}

impl<E: TitoEngine> Remote<E> {
    async fn reply(&self, args: Vec<String>) -> CommandReply {
        let cli = match <Cli as clap::Parser>::try_parse_from(
            std::iter::once("tito".to_string()).chain(args),
        ) {
            Ok(cli) => cli,
            // --help and --version are "errors" clap prints on stdout, with status 0.
            Err(err) if !err.use_stderr() => {
                return reply(0, err.render().to_string(), String::new());
            }
            Err(err) => return reply(2, String::new(), err.render().to_string()),
        };
        match self.run(cli).await {
            Ok(out) => reply(0, out, String::new()),
            Err(Failure(message)) => reply(1, String::new(), message),
        }
    }

    async fn run(&self, cli: Cli) -> crate::Outcome {
        if cli.store.path.is_some() || cli.store.pd.is_some() {
            return Err(Failure(
                "a command sent to an application runs on the application's store: leave out \
                 --path and --pd"
                    .into(),
            ));
        }
        match &cli.command {
            Command::Store(_) => {
                return Err(Failure(
                    "tito store names its own stores (embedded:DIR, tikv:HOST:PORT): run it \
                     where they are reachable, without --url (a live embedded store is backed \
                     up from the dashboard's Backup page)"
                        .into(),
                ));
            }
            Command::Serve { .. } => {
                return Err(Failure(
                    "this application serves its own dashboard: open the router's address".into(),
                ));
            }
            _ => {}
        }
        let (tool, db) = &*self.0;
        let typed = tool.typing(db)?;
        execute(db.clone(), &typed, cli).await
    }
}

/// `args` without the token (`--token T`, `--token=T`) and as text: the rest goes to the
/// application, which logs command lines.
pub(crate) fn without_token(args: Vec<OsString>) -> Result<Vec<String>, Ended> {
    let mut out = Vec::with_capacity(args.len());
    let mut words = args.into_iter();
    while let Some(word) = words.next() {
        let word = word.into_string().map_err(|w| {
            Ended::Failed(format!(
                "{}: not UTF-8, which a command sent with --url must be",
                w.to_string_lossy()
            ))
        })?;
        if word == "--" {
            out.push(word);
            for rest in words.by_ref() {
                out.push(rest.into_string().map_err(|w| {
                    Ended::Failed(format!(
                        "{}: not UTF-8, which a command sent with --url must be",
                        w.to_string_lossy()
                    ))
                })?);
            }
            break;
        }
        if word == "--token" {
            words.next();
            continue;
        }
        if word.starts_with("--token=") {
            continue;
        }
        out.push(word);
    }
    Ok(out)
}

/// `http://HOST[:PORT][/PATH]` as (authority, path without a trailing slash).
fn parse_url(url: &str) -> Result<(String, String), Ended> {
    let bad = |why: &str| {
        Ended::Failed(format!(
            "--url {url}: {why} (give the address the application's admin router is mounted \
             at, as http://HOST:PORT/PATH)"
        ))
    };
    if url.starts_with("https://") {
        return Err(Ended::Failed(format!(
            "--url {url}: tito speaks plain HTTP to an admin router; reach one behind TLS \
             through a tunnel on this machine (ssh -L 8080:localhost:8080 HOST, then --url \
             http://127.0.0.1:8080/PATH)"
        )));
    }
    let Some(rest) = url.strip_prefix("http://") else {
        return Err(bad("not an http:// address"));
    };
    let (authority, path) = match rest.find(['/', '?', '#']) {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    if authority.is_empty() || authority.contains('@') {
        return Err(bad("no host, or credentials in the address"));
    }
    if path.contains(['?', '#']) {
        return Err(bad("a query or fragment"));
    }
    Ok((
        authority.to_string(),
        path.trim_end_matches('/').to_string(),
    ))
}

/// Posts `args` to the admin router at `url`; returns what the command printed, or its
/// failure with the exit status it had.
pub(crate) async fn send(
    url: &str,
    token: Option<&str>,
    args: Vec<String>,
    timeout: Duration,
) -> Result<String, Ended> {
    let (authority, path) = parse_url(url)?;
    let Some(token) = token else {
        return Err(Ended::Failed(format!(
            "the admin router at {url} runs commands for its token holders only: give the \
             application's token in TITO_TOKEN (or --token TOKEN)"
        )));
    };
    let unreachable =
        |why: String| Ended::Failed(format!("cannot reach the admin router at {url}: {why}"));
    let stream =
        match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(&authority)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(err)) => return Err(unreachable(err.to_string())),
            Err(_) => return Err(unreachable(format!("no connection within {timeout:?}"))),
        };
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|err| unreachable(err.to_string()))?;
    let driver = tokio::spawn(connection);
    let body = serde_json::to_vec(&CommandRequest { args })
        .map_err(|err| Ended::Failed(err.to_string()))?;
    let request = hyper::Request::post(format!("{path}/api/v1/command"))
        .header(hyper::header::HOST, &authority)
        .header(hyper::header::AUTHORIZATION, format!("Bearer {token}"))
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|err| {
            Ended::Failed(format!(
                "the token or the address cannot be sent in a request: {err}"
            ))
        })?;
    // No time limit on the answer: a command (an index build, a repair) may run for long.
    let response = sender
        .send_request(request)
        .await
        .map_err(|err| unreachable(err.to_string()))?;
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|err| unreachable(err.to_string()))?
        .to_bytes();
    driver.abort();
    if status.is_success() {
        let reply: CommandReply = serde_json::from_slice(&bytes).map_err(|err| {
            Ended::Failed(format!(
                "the router at {url} answered, but not as a Tito admin router ({err})"
            ))
        })?;
        return match reply.exit {
            0 => Ok(reply.stdout.trim_end_matches('\n').to_string()),
            2 => Err(Ended::Usage(reply.stderr)),
            _ => Err(Ended::Failed(reply.stderr)),
        };
    }
    let said = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_string));
    Err(Ended::Failed(match (status.as_u16(), said) {
        (_, Some(said)) => format!("the admin router at {url} said: {said}"),
        (404 | 405, None) => format!(
            "no Tito admin router at {url} (it answered {status}): give --url the address of \
             the path the application mounts the router at, on its host (a router mounted with \
             Admin::mount(\"/tito\") is at {}/tito)",
            origin(url)
        ),
        (_, None) => format!(
            "the admin router at {url} answered {status}: {}",
            String::from_utf8_lossy(&bytes).trim()
        ),
    }))
}

/// `scheme://host:port` of `url`, without its path.
fn origin(url: &str) -> &str {
    let after_scheme = url.find("://").map_or(0, |at| at + 3);
    match url[after_scheme..].find('/') {
        Some(path) => &url[..after_scheme + path],
        None => url.trim_end_matches('/'),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_router_is_hinted_at_the_hosts_root() {
        assert_eq!(
            origin("http://127.0.0.1:8080/admin"),
            "http://127.0.0.1:8080"
        );
        assert_eq!(origin("http://host/ops/tito/"), "http://host");
        assert_eq!(origin("http://host:9"), "http://host:9");
        assert_eq!(origin("http://host/"), "http://host");
    }

    #[test]
    fn the_token_never_leaves_in_the_command_line() {
        let args = |words: &[&str]| words.iter().map(OsString::from).collect::<Vec<_>>();
        let kept = without_token(args(&[
            "--url",
            "http://h/t",
            "--token",
            "s3cret",
            "queue",
            "cancel",
            "--token=x",
            "--",
            "--token",
            "id",
        ]))
        .ok()
        .unwrap_or_default();
        assert_eq!(
            kept,
            [
                "--url",
                "http://h/t",
                "queue",
                "cancel",
                "--",
                "--token",
                "id"
            ]
        );
    }

    #[test]
    fn addresses_are_read_or_refused() {
        let parsed = |url: &str| parse_url(url).map_err(|e| format!("{e:?}"));
        assert_eq!(
            parsed("http://127.0.0.1:80/tito/"),
            Ok(("127.0.0.1:80".into(), "/tito".into()))
        );
        assert_eq!(parsed("http://h:1"), Ok(("h:1".into(), String::new())));
        for (bad, says) in [
            ("https://h/tito", "plain HTTP"),
            ("h:80/tito", "not an http:// address"),
            ("http:///tito", "no host"),
            ("http://u:p@h/tito", "credentials"),
            ("http://h/tito?x=1", "a query"),
        ] {
            let err = parsed(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
