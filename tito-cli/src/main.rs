//! The stock `tito` binary: every command that needs no model type (see [`tito_cli::Tool`] to
//! build one with your models).

fn main() -> std::process::ExitCode {
    tito_cli::Tool::new().main()
}
