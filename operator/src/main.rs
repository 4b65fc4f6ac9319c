//! `sbmesh-operator`: see `sbmesh-operator --help` and docs/reference.md#operator-commands.

#![warn(clippy::too_many_lines)]
// Only the code that ships is held to it: the build without tests checks
// every function of it, so test builds need not.
#![cfg_attr(test, allow(clippy::too_many_lines))]

use std::process::ExitCode;

use clap::Parser;
use sbmesh_operator::cli::{Cli, Command};

fn main() -> ExitCode {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Crds => sbmesh_operator::crd::command(),
        Command::Install(args) => sbmesh_operator::install::command(&args),
        Command::Render(args) => sbmesh_operator::render::command(&args),
        Command::Inject(args) => sbmesh_operator::inject::command(&args),
        Command::Run(args) => sbmesh_operator::run::command(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
