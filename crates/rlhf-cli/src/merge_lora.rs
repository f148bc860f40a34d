//! `rlhf merge-lora`: a LoRA adapter (a LoRA run's checkpoint, or one `peft` saved) folded
//! into its base model and written as a plain HF model directory, `W + (alpha / r) B A` for
//! every adapted layer: what `peft`'s `merge_and_unload()` gives, loadable by transformers,
//! `rlhf generate` and the roles without any LoRA support.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use rlhf_model::lora::{LoraConfig, ADAPTER_CONFIG_FILE};
use rlhf_model::{LoadOptions, Model, ModelKind};

/// Arguments of `rlhf merge-lora`.
#[derive(Debug, Clone, Args)]
pub struct MergeLoraArgs {
    /// The base model's HF directory: the model the adapter was trained on.
    #[arg(long, value_name = "DIR")]
    pub base: PathBuf,

    /// The adapter directory (adapter_config.json + adapter_model.safetensors), e.g.
    /// checkpoints/<job>/global_step_40/actor of a run with actor_rollout.lora.rank > 0.
    #[arg(long, value_name = "DIR")]
    pub adapter: PathBuf,

    /// Where the merged model is written. It must not exist yet (or be an empty directory):
    /// nothing is ever overwritten.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

/// The head an adapter was trained with, from PEFT's `task_type`.
fn head_of(adapter: &Path, raw: &serde_json::Value) -> anyhow::Result<ModelKind> {
    match raw.get("task_type").and_then(|v| v.as_str()) {
        None | Some("CAUSAL_LM") => Ok(ModelKind::CausalLm),
        Some("TOKEN_CLS") => Ok(ModelKind::Value),
        Some("SEQ_CLS") => Ok(ModelKind::Reward),
        Some(other) => bail!(
            "{}: task_type {other:?} is not one this tool merges (CAUSAL_LM, TOKEN_CLS for a \
             critic, SEQ_CLS for a reward model)",
            adapter.join(ADAPTER_CONFIG_FILE).display()
        ),
    }
}

pub fn run(args: &MergeLoraArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    if args.out.exists() {
        let empty = args.out.is_dir()
            && std::fs::read_dir(&args.out)
                .with_context(|| format!("reading {}", args.out.display()))?
                .next()
                .is_none();
        if !empty {
            bail!(
                "--out {} already exists and is not empty; merge-lora never overwrites, name a \
                 new directory",
                args.out.display()
            );
        }
    }
    let (cfg, raw) = LoraConfig::from_adapter_dir(&args.adapter)
        .with_context(|| format!("--adapter {}", args.adapter.display()))?;
    let kind = head_of(&args.adapter, &raw)?;
    let opts = LoadOptions::inference().with_kind(kind);
    let model = Model::load_with_adapter(&args.base, &args.adapter, &opts).with_context(|| {
        format!(
            "loading the adapter {} onto --base {}",
            args.adapter.display(),
            args.base.display()
        )
    })?;
    let tokenizer = [&args.adapter, &args.base]
        .into_iter()
        .find(|d| d.join("tokenizer.json").is_file())
        .map(PathBuf::as_path);
    let image = model.merged_image(tokenizer)?;
    // Written beside the target and renamed into place: an interrupted merge leaves no
    // half-written model at --out.
    let parent = args
        .out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let staging = tempfile::Builder::new()
        .prefix(".merge-lora-")
        .tempdir_in(parent)
        .with_context(|| format!("creating a staging directory in {}", parent.display()))?;
    image
        .write(staging.path())
        .with_context(|| format!("writing the merged model to {}", staging.path().display()))?;
    if args.out.exists() {
        std::fs::remove_dir(&args.out)
            .with_context(|| format!("replacing the empty {}", args.out.display()))?;
    }
    let staged = staging.keep();
    std::fs::rename(&staged, &args.out)
        .with_context(|| format!("moving the merged model to {}", args.out.display()))?;
    let adapted = model
        .vars()
        .iter()
        .filter(|(n, _)| n.ends_with(".lora_A.weight"))
        .count();
    writeln!(
        out,
        "merged {} (r={}, alpha={}, {adapted} adapted layers) into {} -> {} ({} tensors)",
        args.adapter.display(),
        cfg.rank,
        cfg.alpha,
        args.base.display(),
        args.out.display(),
        image.tensors.len()
    )?;
    Ok(())
}
