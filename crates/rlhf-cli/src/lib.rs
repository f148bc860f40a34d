//! The `rlhf` user tool. `rlhf generate` loads an HF checkpoint directory with
//! `rlhf-model` and prints completions for one prompt or a JSONL file of prompts, as plain
//! text or one JSON object per completion: the quick check of a checkpoint after training.
//!
//! `main.rs` only parses the command line and reports errors; everything else lives here so
//! that tests can call it.

pub mod generate;

use std::io::Write;

use clap::{Parser, Subcommand};

pub use generate::{GenerateArgs, OutputFormat};

/// Command line of the `rlhf` binary.
#[derive(Debug, Parser)]
#[command(
    name = "rlhf",
    version,
    about = "RLHF tools: generate from a checkpoint"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print completions of prompts with a causal LM checkpoint (an HF model directory).
    Generate(GenerateArgs),
}

/// Runs a parsed command, writing its output to `out`.
pub fn run(cli: Cli, out: &mut dyn Write) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(args) => generate::run(&args, out),
    }
}

/// One line for stderr: the error and its causes, with any newline inside them flattened.
pub fn error_line(err: &anyhow::Error) -> String {
    let text = format!("{err:#}");
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}
