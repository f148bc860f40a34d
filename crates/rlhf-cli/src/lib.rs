//! The `rlhf` user tool. `rlhf generate` loads an HF checkpoint directory with
//! `rlhf-model` and prints completions for one prompt or a JSONL file of prompts, as plain
//! text or one JSON object per completion: the quick check of a checkpoint after training.
//! `rlhf merge-lora` folds a LoRA adapter into its base model.
//!
//! `main.rs` only parses the command line and reports errors; everything else lives here so
//! that tests can call it.

pub mod generate;
pub mod merge_lora;

use std::io::Write;

use clap::{Parser, Subcommand};

pub use generate::{GenerateArgs, OutputFormat};
pub use merge_lora::MergeLoraArgs;

/// Command line of the `rlhf` binary.
#[derive(Debug, Parser)]
#[command(
    name = "rlhf",
    version,
    about = "RLHF tools: generate from a checkpoint, merge a LoRA adapter"
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
    /// Fold a LoRA adapter (a LoRA run's checkpoint or a peft adapter) into its base model
    /// and write a plain HF model directory.
    MergeLora(MergeLoraArgs),
}

/// Runs a parsed command, writing its output to `out`.
pub fn run(cli: Cli, out: &mut dyn Write) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(args) => generate::run(&args, out),
        Command::MergeLora(args) => merge_lora::run(&args, out),
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
