//! Command lines for a person to run: hints ("retry: tito ..."), "run again with --yes" lines.
//!
//! Every such line runs as printed: it names the store as this command was given it (`--path`,
//! or `--pd` with its keyspace, TLS files and timeout), names the queue whenever a command
//! takes one (also the default queue among several), and quotes every word a POSIX shell would
//! split or expand (a topic with a space, an event id with a quote). A positional argument
//! that starts with `-` goes after `--`, and an option's value that does is joined to its
//! option (`--topic=-x`), so neither is read as an option.

use crate::cli::StoreArgs;

/// How this command reached its store, as the first words of the lines it prints.
#[derive(Clone, Debug, Default)]
pub(crate) struct Rerun {
    store: Vec<String>,
}

impl Rerun {
    /// The store arguments of this command line (`timeout` only when not the default).
    pub(crate) fn new(store: &StoreArgs, timeout: u64) -> Self {
        let mut words = Vec::new();
        if let Some(path) = &store.path {
            words.push("--path".to_string());
            words.push(path.to_string_lossy().into_owned());
        }
        if let Some(url) = &store.url {
            // Never the token: it comes from TITO_TOKEN, or is typed again.
            words.push("--url".to_string());
            words.push(url.clone());
        }
        if let Some(pd) = &store.pd {
            words.push("--pd".to_string());
            words.push(pd.join(","));
        }
        if let Some(keyspace) = &store.keyspace {
            words.push("--keyspace".to_string());
            words.push(keyspace.clone());
        }
        for (flag, file) in [
            ("--tls-ca", &store.tls_ca),
            ("--tls-cert", &store.tls_cert),
            ("--tls-key", &store.tls_key),
        ] {
            if let Some(file) = file {
                words.push(flag.to_string());
                words.push(file.to_string_lossy().into_owned());
            }
        }
        if (store.pd.is_some() || store.url.is_some()) && timeout != crate::cli::DEFAULT_TIMEOUT {
            words.push("--timeout".to_string());
            words.push(timeout.to_string());
        }
        Rerun { store: words }
    }

    /// `tito {store} {command} {options} [--] {positionals}`, each word quoted for a shell. An
    /// option's value that starts with `-` is joined to its option (`--topic=-x`), so it is not
    /// read as an option of its own.
    pub(crate) fn line(&self, command: &[&str], options: &[&str], positionals: &[&str]) -> String {
        let mut words: Vec<String> = vec!["tito".to_string()];
        let mut rest = self
            .store
            .iter()
            .map(String::as_str)
            .chain(command.iter().copied())
            .chain(options.iter().copied());
        while let Some(word) = rest.next() {
            if TAKES_A_VALUE.contains(&word)
                && let Some(value) = rest.next()
            {
                if value.starts_with('-') {
                    words.push(format!("{word}={value}"));
                } else {
                    words.push(word.to_string());
                    words.push(value.to_string());
                }
            } else {
                words.push(word.to_string());
            }
        }
        if positionals.iter().any(|p| p.starts_with('-')) {
            words.push("--".to_string());
        }
        words.extend(positionals.iter().map(|w| w.to_string()));
        words.iter().map(|w| quote(w)).collect::<Vec<_>>().join(" ")
    }
}

/// The options of the lines printed that take a value (the next word).
const TAKES_A_VALUE: &[&str] = &[
    "--path",
    "--url",
    "--pd",
    "--keyspace",
    "--tls-ca",
    "--tls-cert",
    "--tls-key",
    "--timeout",
    "--topic",
    "--why",
    "--after",
    "--limit",
    "--cursor",
    "--partition",
    "--prefix",
    "--group",
];

/// `word` as a POSIX shell reads it back: as it is when every character is plain, else in
/// single quotes (a quote inside written `'\''`).
pub(crate) fn quote(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./:@%+=,".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        return word.to_string();
    }
    format!("'{}'", word.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_quoted_only_when_a_shell_would_change_them() {
        assert_eq!(quote("mail"), "mail");
        assert_eq!(quote("queue:pending:0003:x"), "queue:pending:0003:x");
        assert_eq!(quote("two words"), "'two words'");
        assert_eq!(quote(""), "''");
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote("$HOME"), "'$HOME'");
        assert_eq!(quote("~x"), "'~x'");
    }

    #[test]
    fn a_positional_that_looks_like_an_option_goes_after_two_dashes() {
        let rerun = Rerun {
            store: vec!["--path".into(), "my store".into()],
        };
        assert_eq!(
            rerun.line(&["queue", "retry-dead"], &["--topic", "a b"], &["-x"]),
            "tito --path 'my store' queue retry-dead --topic 'a b' -- -x"
        );
        assert_eq!(
            rerun.line(&["queue", "dead"], &["--topic", "-t", "--after", "--"], &[]),
            "tito --path 'my store' queue dead --topic=-t --after=--"
        );
    }
}
