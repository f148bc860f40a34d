use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = rlhf_cli::Cli::parse();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match rlhf_cli::run(cli, &mut out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", rlhf_cli::error_line(&err));
            ExitCode::FAILURE
        }
    }
}
