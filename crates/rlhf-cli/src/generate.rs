//! `rlhf generate`: completions from a causal LM checkpoint.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context};
use clap::{Args, ValueEnum};
use rlhf_model::hub::{Error as HubError, Hub};
use rlhf_model::{
    generate, ChatMessage, FinishReason, GeneratedSequence, GenerationConfig, LoadOptions, Model,
    Tokenizer,
};
use serde_json::{json, Value};

/// How completions are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// The completion text; several completions are separated by a line `---`.
    Text,
    /// One JSON object per completion (JSON Lines): index (of the prompt), sample, prompt (the
    /// text given to the tokenizer, after the chat template), prompt_token_ids (as fed, after
    /// any truncation), completion_token_ids (up to and including a stop token), text (special
    /// tokens skipped), logprobs (one per completion token, at the sampling temperature; 1 when
    /// greedy) and finish_reason ("stop" or "length").
    Json,
}

/// Arguments of `rlhf generate`.
#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    /// HF model directory (config.json, safetensors weights, tokenizer.json), or a Hugging
    /// Face repo id (`owner/name`, `owner/name@revision`) looked up in the local HF cache
    /// (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`) and downloaded
    /// into it when missing, unless `HF_HUB_OFFLINE=1`.
    #[arg(long, value_name = "DIR|OWNER/NAME")]
    pub model: String,

    /// One prompt.
    #[arg(
        long,
        value_name = "TEXT",
        conflicts_with = "prompts",
        required_unless_present = "prompts"
    )]
    pub prompt: Option<String>,

    /// JSON Lines file of prompts: each line a JSON string, {"prompt": "..."} or
    /// {"messages": [{"role": "...", "content": "..."}, ...]} (the last needs --chat).
    #[arg(long, value_name = "FILE.jsonl")]
    pub prompts: Option<PathBuf>,

    /// Render prompts with the tokenizer's chat template (a plain prompt becomes one user turn)
    /// and add the generation prompt.
    #[arg(long)]
    pub chat: bool,

    /// System message put before each conversation (with --chat).
    #[arg(long, value_name = "TEXT", requires = "chat")]
    pub system: Option<String>,

    /// Most tokens generated per completion.
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub max_new_tokens: usize,

    /// Stop tokens are not sampled before this many tokens.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub min_new_tokens: usize,

    /// Sampling temperature; 0 is greedy. Default: the checkpoint's generation_config.json
    /// (greedy when it does not set do_sample).
    #[arg(long, value_name = "T")]
    pub temperature: Option<f64>,

    /// Nucleus sampling mass in (0, 1]. Default: the checkpoint's generation_config.json, else 1.
    #[arg(long, value_name = "P")]
    pub top_p: Option<f64>,

    /// Keep only the k most likely tokens (0 disables). Default: generation_config.json, else 0.
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,

    /// Completions per prompt.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub n: usize,

    /// Random seed: the same seed and arguments give the same completions.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Extra stop token (a token of the vocabulary, e.g. "<|im_end|>"); repeatable.
    #[arg(long = "stop-token", value_name = "TOKEN")]
    pub stop_tokens: Vec<String>,

    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub format: OutputFormat,

    /// Keep the last tokens of a prompt that does not fit in the context with max_new_tokens,
    /// instead of refusing it.
    #[arg(long)]
    pub truncate_prompt: bool,

    /// Prompts generated together in one batch.
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub batch_size: usize,

    /// Where to compute: `cpu`, or `cuda:N` (a build with the `cuda` feature).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: DeviceArg,

    /// Weights and activations dtype.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    pub dtype: DtypeArg,
}

/// `--device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceArg {
    Cpu,
    Cuda(usize),
}

/// `--dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DtypeArg {
    F32,
    Bf16,
    F16,
}

fn parse_device(s: &str) -> Result<DeviceArg, String> {
    match s {
        "cpu" => Ok(DeviceArg::Cpu),
        "cuda" => Ok(DeviceArg::Cuda(0)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(DeviceArg::Cuda)
            .ok_or_else(|| format!("'{s}' is not a device; use cpu or cuda:N (e.g. cuda:0)")),
    }
}

impl DeviceArg {
    /// Opens the device; a GPU in a build without CUDA is an error naming the rebuild.
    pub fn open(self) -> anyhow::Result<rlhf_model::Device> {
        match self {
            DeviceArg::Cpu => Ok(rlhf_model::Device::Cpu),
            DeviceArg::Cuda(i) if !cfg!(feature = "cuda") => bail!(
                "--device cuda:{i}: this rlhf binary was built without the `cuda` feature; \
                 rebuild it with `cargo build --release -p rlhf-cli --features cuda`"
            ),
            DeviceArg::Cuda(i) => rlhf_model::Device::new_cuda(i).map_err(|e| {
                let e = e.to_string();
                anyhow!(
                    "--device cuda:{i}: cannot open the GPU: {}; check the NVIDIA driver with \
                     nvidia-smi and that GPU {i} exists",
                    e.lines().next().unwrap_or_default()
                )
            }),
        }
    }
}

/// A prompt as read from the command line or a JSONL file.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Messages(Vec<ChatMessage>),
}

/// Parses a JSON Lines prompt file; blank lines are skipped.
pub fn parse_prompts_jsonl(text: &str, path: &Path) -> anyhow::Result<Vec<PromptInput>> {
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let where_ = || format!("{} line {}", path.display(), i + 1);
        let value: Value = serde_json::from_str(line)
            .map_err(|e| anyhow!("{}: not valid JSON ({e})", where_()))?;
        let prompt = match &value {
            Value::String(s) => PromptInput::Text(s.clone()),
            Value::Object(obj) => match (obj.get("prompt"), obj.get("messages")) {
                (Some(Value::String(s)), None) => PromptInput::Text(s.clone()),
                (None, Some(msgs @ Value::Array(_))) => {
                    let msgs: Vec<ChatMessage> =
                        serde_json::from_value(msgs.clone()).map_err(|e| {
                            anyhow!(
                                "{}: \"messages\" must be a list of {{\"role\", \"content\"}} \
                                 objects with string values ({e})",
                                where_()
                            )
                        })?;
                    PromptInput::Messages(msgs)
                }
                _ => bail!(
                    "{}: expected a JSON string, {{\"prompt\": \"...\"}} or {{\"messages\": [...]}}",
                    where_()
                ),
            },
            _ => bail!(
                "{}: expected a JSON string, {{\"prompt\": \"...\"}} or {{\"messages\": [...]}}",
                where_()
            ),
        };
        prompts.push(prompt);
    }
    if prompts.is_empty() {
        bail!("{} holds no prompts", path.display());
    }
    Ok(prompts)
}

fn read_prompts(args: &GenerateArgs) -> anyhow::Result<Vec<PromptInput>> {
    if let Some(p) = &args.prompt {
        return Ok(vec![PromptInput::Text(p.clone())]);
    }
    let path = args
        .prompts
        .as_ref()
        .ok_or_else(|| anyhow!("give a prompt with --prompt TEXT or --prompts FILE.jsonl"))?;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read prompts file {}", path.display()))?;
    parse_prompts_jsonl(&text, path)
}

/// The architecture named in `config.json`, to refuse reward and value models early with a
/// message about what they are rather than a missing `lm_head` tensor.
fn check_causal_lm(dir: &Path) -> anyhow::Result<()> {
    let path = dir.join("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        // Model::load names the missing file.
        return Ok(());
    };
    let Ok(cfg) = serde_json::from_str::<Value>(&text) else {
        return Ok(());
    };
    if let Some(arch) = cfg
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
    {
        if arch.ends_with("ForSequenceClassification") || arch.ends_with("ForTokenClassification") {
            bail!(
                "{} is a {arch} (reward or value model); rlhf generate needs a causal LM \
                 checkpoint (*ForCausalLM)",
                dir.display()
            );
        }
    }
    Ok(())
}

/// A prompt ready for the model.
struct Prepared {
    text: String,
    ids: Vec<u32>,
}

fn prepare(
    prompts: &[PromptInput],
    tokenizer: &Tokenizer,
    args: &GenerateArgs,
) -> anyhow::Result<Vec<Prepared>> {
    let mut out = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let prepared = if args.chat {
            let mut msgs = Vec::new();
            if let Some(sys) = &args.system {
                msgs.push(ChatMessage::system(sys.clone()));
            }
            match p {
                PromptInput::Text(t) => msgs.push(ChatMessage::user(t.clone())),
                PromptInput::Messages(m) => msgs.extend(m.iter().cloned()),
            }
            let text = tokenizer
                .apply_chat_template(&msgs, true)
                .with_context(|| format!("prompt {i}"))?;
            // The template writes the special tokens itself.
            let ids = tokenizer.encode(&text, false)?;
            Prepared { text, ids }
        } else {
            match p {
                PromptInput::Text(t) => Prepared {
                    text: t.clone(),
                    // As transformers' tokenizer(prompt): the post-processor adds BOS if the
                    // tokenizer has one.
                    ids: tokenizer.encode(t, true)?,
                },
                PromptInput::Messages(_) => bail!(
                    "prompt {i} is a list of chat messages; pass --chat to render it with the \
                     chat template"
                ),
            }
        };
        if prepared.ids.is_empty() {
            bail!("prompt {i} is empty after tokenization");
        }
        out.push(prepared);
    }
    Ok(out)
}

fn generation_config(
    model: &Model,
    tokenizer: &Tokenizer,
    args: &GenerateArgs,
) -> anyhow::Result<GenerationConfig> {
    let mut cfg = model.generation_config().clone();
    cfg.max_new_tokens = args.max_new_tokens;
    cfg.min_new_tokens = args.min_new_tokens;
    if let Some(t) = args.temperature {
        cfg.temperature = t;
    }
    if let Some(p) = args.top_p {
        cfg.top_p = p;
    }
    if let Some(k) = args.top_k {
        cfg.top_k = k;
    }
    cfg.n = args.n;
    cfg.seed = args.seed;
    cfg.truncate_prompts = args.truncate_prompt;
    if cfg.pad_token_id.is_none() {
        cfg.pad_token_id = tokenizer.pad_token_id();
    }
    if cfg.eos_token_ids.is_empty() {
        cfg.eos_token_ids.extend(tokenizer.eos_token_id());
    }
    for tok in &args.stop_tokens {
        let id = tokenizer.token_to_id(tok).ok_or_else(|| {
            anyhow!(
                "--stop-token {tok:?} is not a token of the vocabulary in {}",
                tokenizer.dir().join("tokenizer.json").display()
            )
        })?;
        cfg.stop_token_ids.push(id);
    }
    if cfg.temperature < 0.0 || !cfg.temperature.is_finite() {
        bail!(
            "--temperature must be >= 0 (0 = greedy), got {}",
            cfg.temperature
        );
    }
    if !(cfg.top_p > 0.0 && cfg.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", cfg.top_p);
    }
    if cfg.n == 0 {
        bail!("--n must be at least 1");
    }
    if cfg.min_new_tokens > cfg.max_new_tokens {
        bail!(
            "--min-new-tokens ({}) exceeds --max-new-tokens ({})",
            cfg.min_new_tokens,
            cfg.max_new_tokens
        );
    }
    let context = cfg
        .max_context
        .unwrap_or(model.config().max_position_embeddings);
    if cfg.max_new_tokens >= context {
        bail!(
            "--max-new-tokens {} leaves no room for the prompt: the model's context is {context} \
             tokens",
            cfg.max_new_tokens
        );
    }
    Ok(cfg)
}

fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop(_) => "stop",
        FinishReason::Length => "length",
    }
}

/// The model directory `--model` names: an existing directory as it is, else a Hub repo id
/// through the local HF cache (downloaded when missing and online; progress on stderr).
fn resolve_model(spec: &str) -> anyhow::Result<PathBuf> {
    let hub = Hub::from_env().with_log(|msg| eprintln!("{msg}"));
    match hub.resolve_model(spec) {
        Ok(dir) => Ok(dir),
        // A path that does not exist: say so plainly rather than why it is not a repo id.
        Err(HubError::InvalidSpec { .. })
            if spec.starts_with('/') || spec.starts_with('.') || spec.contains('\\') =>
        {
            bail!(
                "model directory {spec} does not exist (expected an HF checkpoint directory \
                 with config.json, or a Hugging Face repo id such as owner/name)"
            )
        }
        Err(e) => Err(e.into()),
    }
}

/// Runs `rlhf generate`.
pub fn run(args: &GenerateArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    let prompts = read_prompts(args)?;
    let model_dir = resolve_model(&args.model)?;
    let tokenizer = Tokenizer::from_dir(&model_dir)?;
    if args.chat && tokenizer.chat_template().is_none() {
        bail!(
            "--chat: the tokenizer in {} has no chat template (no chat_template in \
             tokenizer_config.json, no chat_template.jinja); drop --chat to use the prompt as \
             plain text",
            model_dir.display()
        );
    }
    let prepared = prepare(&prompts, &tokenizer, args)?;
    check_causal_lm(&model_dir)?;
    let dtype = match args.dtype {
        DtypeArg::F32 => rlhf_model::DType::F32,
        DtypeArg::Bf16 => rlhf_model::DType::BF16,
        DtypeArg::F16 => rlhf_model::DType::F16,
    };
    let opts = LoadOptions::inference()
        .with_device(args.device.open()?)
        .with_dtype(dtype);
    let model = Model::load(&model_dir, &opts)?;
    let cfg = generation_config(&model, &tokenizer, args)?;

    let mut first = true;
    for (chunk_index, chunk) in prepared.chunks(args.batch_size).enumerate() {
        let offset = chunk_index * args.batch_size;
        let ids: Vec<Vec<u32>> = chunk.iter().map(|p| p.ids.clone()).collect();
        let mut chunk_cfg = cfg.clone();
        // Each batch draws its own stream, so that identical prompts in different batches do
        // not repeat each other's samples.
        chunk_cfg.seed = cfg.seed.wrapping_add(chunk_index as u64);
        let generation = generate(&model, &ids, &chunk_cfg).map_err(|e| match e {
            rlhf_model::Error::PromptTooLong {
                index,
                len,
                limit,
                context,
                max_new_tokens,
            } => anyhow!(
                "prompt {} has {len} tokens but only {limit} fit (context {context} minus \
                 --max-new-tokens {max_new_tokens}); shorten it, lower --max-new-tokens, or pass \
                 --truncate-prompt to keep its last {limit} tokens",
                offset + index
            ),
            other => anyhow::Error::new(other),
        })?;
        for seq in &generation.sequences {
            let prompt = &chunk[seq.prompt_index];
            write_sequence(out, args, &tokenizer, offset, prompt, seq, &mut first)?;
        }
    }
    out.flush().context("cannot write to stdout")?;
    Ok(())
}

fn write_sequence(
    out: &mut dyn Write,
    args: &GenerateArgs,
    tokenizer: &Tokenizer,
    offset: usize,
    prompt: &Prepared,
    seq: &GeneratedSequence,
    first: &mut bool,
) -> anyhow::Result<()> {
    let text = tokenizer.decode(&seq.token_ids, true)?;
    match args.format {
        OutputFormat::Json => {
            let obj = json!({
                "index": offset + seq.prompt_index,
                "sample": seq.sample_index,
                "prompt": prompt.text,
                "prompt_token_ids": seq.prompt_ids,
                "completion_token_ids": seq.token_ids,
                "text": text,
                "logprobs": seq.logprobs,
                "finish_reason": finish_reason(seq.finish_reason),
            });
            writeln!(out, "{obj}").context("cannot write to stdout")?;
        }
        OutputFormat::Text => {
            if !*first {
                writeln!(out, "---").context("cannot write to stdout")?;
            }
            writeln!(out, "{text}").context("cannot write to stdout")?;
        }
    }
    *first = false;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_accepts_strings_prompts_and_messages() {
        let text = "\"plain\"\n\n{\"prompt\": \"p2\"}\n{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n";
        let got = parse_prompts_jsonl(text, Path::new("p.jsonl")).unwrap();
        assert_eq!(
            got,
            vec![
                PromptInput::Text("plain".into()),
                PromptInput::Text("p2".into()),
                PromptInput::Messages(vec![ChatMessage::user("hi")]),
            ]
        );
    }

    #[test]
    fn jsonl_errors_name_file_and_line() {
        let err = parse_prompts_jsonl("\"ok\"\n{\"text\": 1}\n", Path::new("p.jsonl")).unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("p.jsonl line 2"), "{msg}");
        let err = parse_prompts_jsonl("\"ok\"\nnot json\n", Path::new("q.jsonl")).unwrap_err();
        assert!(format!("{err:#}").contains("q.jsonl line 2: not valid JSON"));
        let err = parse_prompts_jsonl(
            "{\"messages\": [{\"role\": \"user\"}]}",
            Path::new("m.jsonl"),
        )
        .unwrap_err();
        assert!(format!("{err:#}").contains("m.jsonl line 1: \"messages\""));
        let err = parse_prompts_jsonl("\n\n", Path::new("e.jsonl")).unwrap_err();
        assert!(format!("{err:#}").contains("e.jsonl holds no prompts"));
    }
}
