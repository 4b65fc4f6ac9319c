//! `sbmesh-sidecar`: runs next to an sbproxy container and gives it a mesh,
//! ACME certificates and config reloads. See `sbmesh-sidecar --help`.

#![warn(clippy::too_many_lines)]
// Only the code that ships is held to it: the build without tests checks
// every function of it, so test builds need not.
#![cfg_attr(test, allow(clippy::too_many_lines))]

mod cli;
mod commands;
mod memory;
mod run;
mod settings;

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

/// Exit code of `run` for a configuration error.
const EXIT_CONFIG: u8 = 2;

fn main() -> ExitCode {
    memory::fixed_mmap_threshold();
    // One crypto provider for every TLS client in the process (rediss://,
    // object stores, ACME): aws-lc-rs. Installing twice is harmless.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let cli = cli::Cli::parse();
    match cli.command {
        cli::Command::Validate(args) => code(commands::validate(&args)),
        cli::Command::Keygen => match commands::keygen() {
            Ok(key) => {
                commands::print_out(&format!("{key}\n"));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        },
        cli::Command::Status(args) => {
            let out = commands::status_target(&args, &settings::process_env).and_then(
                |(url, credentials)| {
                    let (user, password) = credentials.unzip();
                    runtime().and_then(|rt| {
                        rt.block_on(commands::status(&url, user.as_deref(), password.as_deref()))
                    })
                },
            );
            match out {
                Ok(table) => {
                    commands::print_out(&table);
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        cli::Command::Run(args) => {
            let env = settings::process_env;
            let settings = match settings::resolve(&args, &env, &settings::system_hostname(&env)) {
                Ok(s) => s,
                Err(problems) => {
                    commands::print_out(&commands::render_problems(&problems));
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            init_logging(settings.log_format);
            for warning in &settings.warnings {
                tracing::warn!("{warning}");
            }
            match runtime().and_then(|rt| rt.block_on(run::run(settings))) {
                Ok(c) => code(c),
                Err(e) => {
                    tracing::error!("{e:#}");
                    eprintln!("error: {e:#}");
                    ExitCode::from(EXIT_CONFIG)
                }
            }
        }
    }
}

fn code(c: i32) -> ExitCode {
    ExitCode::from(u8::try_from(c).unwrap_or(1))
}

/// One thread runs every task: an idle sidecar waits on timers and sockets,
/// and a worker per core (plus its malloc arena and stack) only costs
/// memory. Blocking work (redb, file reads, DNS) still goes to the blocking
/// pool, so it never stalls the mesh.
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn init_logging(format: settings::LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        settings::LogFormat::Json => builder.json().init(),
        settings::LogFormat::Text => builder.init(),
    }
}
