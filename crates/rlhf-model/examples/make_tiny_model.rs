//! Builds `models/tiny`, the demo policy of `configs/ppo_tiny.yaml`, deterministically (seeded):
//! a byte-level BPE tokenizer trained on the SFT text and the prompts (digits always single
//! tokens, `<|endoftext|>` = EOS = pad), then a 2-layer Llama trained by supervised fine-tuning
//! on `data/sft_tiny.txt` (prompt, continuation) pairs whose numbers are mostly spelled out, so
//! that sampled responses contain a digit only sometimes: the rule reward `contains_digit` then
//! has room to climb.
//!
//! ```text
//! cargo run --release -p rlhf-model --example make_tiny_model -- models/tiny
//! cargo run --release -p rlhf-model --example make_tiny_model -- models/tiny --check-learnable
//! ```
//!
//! Options: `--sft FILE` (default data/sft_tiny.txt), `--prompts FILE` (default
//! data/prompts_tiny.jsonl), `--steps N` (SFT steps), `--seed N`, `--eval-only` (measure the
//! digit rate of an existing directory), `--check-learnable` (after building or with
//! `--eval-only`: a short REINFORCE run on the digit reward that prints the rate per step; the
//! model directory is not changed), `--rl-lr X`, `--rl-steps N`, `--rl-prompts N`,
//! `--rl-samples N`, `--rl-updates N` (optimizer steps per sampled batch).

use std::path::{Path, PathBuf};
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rlhf_model::{
    generate, AdamW, AdamWConfig, Batch, Config, Device, GenerationConfig, Gradients, LoadOptions,
    LrSchedule, LrScheduler, Model, ModelKind, Tensor, Tokenizer,
};
use serde_json::json;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    TokenizerBuilder,
};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const EOS: &str = "<|endoftext|>";
/// 256 byte tokens + EOS + merges.
const VOCAB_SIZE: usize = 384;
const MAX_NEW_TOKENS: usize = 16;
/// Raw prompt in, response out: the same text the PPO demo feeds with `apply_chat_template:
/// false`, for tools that do ask for a chat template.
const CHAT_TEMPLATE: &str = "{% for message in messages %}{% if message['role'] != 'assistant' %}{{ message['content'] }}{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}";

struct Args {
    out: PathBuf,
    sft: PathBuf,
    prompts: PathBuf,
    steps: usize,
    seed: u64,
    eval_only: bool,
    check_learnable: bool,
    rl_lr: f64,
    rl_steps: usize,
    rl_prompts: usize,
    rl_samples: usize,
    rl_updates: usize,
}

fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

fn parse_args() -> AnyResult<Args> {
    let mut a = Args {
        out: PathBuf::new(),
        sft: repo_path("data/sft_tiny.txt"),
        prompts: repo_path("data/prompts_tiny.jsonl"),
        steps: 700,
        seed: 42,
        eval_only: false,
        check_learnable: false,
        rl_lr: 1e-3,
        rl_steps: 30,
        rl_prompts: 16,
        rl_samples: 4,
        rl_updates: 1,
    };
    let mut out = None;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value (see the example's doc comment)"))
        };
        match arg.as_str() {
            "--sft" => a.sft = value("--sft")?.into(),
            "--prompts" => a.prompts = value("--prompts")?.into(),
            "--steps" => a.steps = value("--steps")?.parse()?,
            "--seed" => a.seed = value("--seed")?.parse()?,
            "--rl-lr" => a.rl_lr = value("--rl-lr")?.parse()?,
            "--rl-steps" => a.rl_steps = value("--rl-steps")?.parse()?,
            "--rl-prompts" => a.rl_prompts = value("--rl-prompts")?.parse()?,
            "--rl-samples" => a.rl_samples = value("--rl-samples")?.parse()?,
            "--rl-updates" => a.rl_updates = value("--rl-updates")?.parse()?,
            "--eval-only" => a.eval_only = true,
            "--check-learnable" => a.check_learnable = true,
            s if s.starts_with("--") => return Err(format!("unknown option {s}").into()),
            s => out = Some(PathBuf::from(s)),
        }
    }
    a.out = out.ok_or("usage: make_tiny_model OUT_DIR [options]; e.g. models/tiny")?;
    if a.rl_samples < 2 || a.rl_prompts == 0 || a.rl_updates == 0 {
        return Err(
            "--rl-samples must be >= 2 (the baseline needs a second sample), \
                    --rl-prompts and --rl-updates >= 1"
                .into(),
        );
    }
    Ok(a)
}

/// `(prompt, continuation)` pairs: one per line, tab-separated, `#` comments.
fn read_pairs(path: &Path) -> AnyResult<Vec<(String, String)>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read SFT pairs {}: {e}", path.display()))?;
    let mut pairs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let (p, c) = line.split_once('\t').ok_or_else(|| {
            format!(
                "{}:{}: expected `prompt<TAB>continuation`",
                path.display(),
                i + 1
            )
        })?;
        pairs.push((p.to_string(), c.to_string()));
    }
    if pairs.is_empty() {
        return Err(format!("{} holds no SFT pairs", path.display()).into());
    }
    Ok(pairs)
}

fn read_prompts(path: &Path) -> AnyResult<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read prompts {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| format!("{}:{}: not JSON ({e})", path.display(), i + 1))?;
        let p = v
            .get("prompt")
            .and_then(|p| p.as_str())
            .ok_or_else(|| format!("{}:{}: no string key \"prompt\"", path.display(), i + 1))?;
        out.push(p.to_string());
    }
    Ok(out)
}

/// Trains and saves tokenizer.json + tokenizer_config.json into `dir`.
fn build_tokenizer(dir: &Path, texts: &[String]) -> AnyResult<()> {
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(VOCAB_SIZE)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from(EOS, true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    // Digits are split one by one before the byte-level split, so no merge can span two
    // digits: every digit is its own token and the digit reward is visible token by token.
    let pre: PreTokenizerWrapper = Sequence::new(vec![
        Digits::new(true).into(),
        ByteLevel::new(false, true, true).into(),
    ])
    .into();
    let mut tok = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_pre_tokenizer(Some(pre))
    .with_decoder(Some(ByteLevel::default().into()))
    .build()
    .map_err(|e| format!("cannot build the tokenizer: {e}"))?;
    tok.train(&mut trainer, texts.iter())
        .map_err(|e| format!("cannot train the tokenizer: {e}"))?;
    let tok: tokenizers::Tokenizer = tok.into();
    tok.save(dir.join("tokenizer.json"), true)
        .map_err(|e| format!("cannot save the tokenizer: {e}"))?;
    let cfg = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": null,
        "model_max_length": 128,
        "padding_side": "left",
        "clean_up_tokenization_spaces": false,
        "chat_template": CHAT_TEMPLATE,
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&cfg)? + "\n",
    )?;
    Ok(())
}

fn model_config(vocab_size: usize, eos: u32) -> AnyResult<Config> {
    Ok(Config::from_json(&json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
        "attention_bias": false,
        "mlp_bias": false,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "initializer_range": 0.02,
    }))?)
}

/// One tokenized example: prompt ids, then response ids ending with EOS.
struct Example {
    ids: Vec<u32>,
    prompt_len: usize,
}

/// Mean log-prob of the response tokens: loss = -that.
fn sft_loss(model: &Model, rows: &[&Example], pad: u32) -> AnyResult<Tensor> {
    let seqs: Vec<Vec<u32>> = rows.iter().map(|e| e.ids.clone()).collect();
    let t = seqs.iter().map(Vec::len).max().unwrap_or(0);
    let batch = Batch::left_padded(&seqs, pad, &Device::Cpu)?;
    let lp = model.token_log_probs(&batch, 1.0)?;
    // Entry j of a row predicts token j + 1 of the padded row.
    let mut mask = vec![0f32; rows.len() * (t - 1)];
    for (r, e) in rows.iter().enumerate() {
        let offset = t - e.ids.len();
        for k in e.prompt_len..e.ids.len() {
            mask[r * (t - 1) + offset + k - 1] = 1.0;
        }
    }
    let n: f32 = mask.iter().sum();
    let mask = Tensor::from_vec(mask, (rows.len(), t - 1), &Device::Cpu)?;
    Ok(((lp * mask)?.sum_all()? / f64::from(n))?.neg()?)
}

fn sft(
    config: &Config,
    examples: &[Example],
    steps: usize,
    seed: u64,
    pad: u32,
) -> AnyResult<Model> {
    let mut opts = LoadOptions::training(ModelKind::CausalLm);
    opts.seed = seed;
    let model = Model::random(config, &opts)?;
    let vars = model.vars();
    let lr = LrScheduler::new(
        3e-3,
        steps / 20,
        steps,
        LrSchedule::Cosine { min_lr_ratio: 0.1 },
    );
    let mut opt = AdamW::new(
        vars.clone(),
        AdamWConfig {
            lr: lr.base_lr,
            weight_decay: 0.01,
            ..AdamWConfig::default()
        },
    )?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let batch_size = 32;
    let mut order: Vec<usize> = (0..examples.len()).collect();
    let mut cursor = order.len();
    let start = Instant::now();
    let mut recent = 0.0;
    for step in 0..steps {
        let mut rows = Vec::with_capacity(batch_size);
        while rows.len() < batch_size {
            if cursor == order.len() {
                order.shuffle(&mut rng);
                cursor = 0;
            }
            rows.push(&examples[order[cursor]]);
            cursor += 1;
        }
        let loss = sft_loss(&model, &rows, pad)?;
        let mut grads = Gradients::backward(&loss, &vars)?;
        grads.clip_global_norm(1.0)?;
        opt.set_learning_rate(lr.lr_at(step));
        opt.step(&grads)?;
        recent += loss.to_scalar::<f32>()? as f64;
        if (step + 1) % 100 == 0 || step + 1 == steps {
            let k = if (step + 1) % 100 == 0 {
                100
            } else {
                (step + 1) % 100
            };
            println!(
                "sft step {:>4}/{steps}: loss {:.3} ({:.1}s)",
                step + 1,
                recent / k as f64,
                start.elapsed().as_secs_f64()
            );
            recent = 0.0;
        }
    }
    Ok(model)
}

fn gen_config(eos: u32, seed: u64, n: usize) -> GenerationConfig {
    GenerationConfig {
        max_new_tokens: MAX_NEW_TOKENS,
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        n,
        seed,
        eos_token_ids: vec![eos],
        pad_token_id: Some(eos),
        ..GenerationConfig::default()
    }
}

fn contains_digit(s: &str) -> bool {
    s.bytes().any(|b| b.is_ascii_digit())
}

/// Mean `contains_digit` over `n` samples of each prompt (temperature 1, 16 new tokens).
fn digit_rate(
    policy: &Model,
    tok: &Tokenizer,
    prompts: &[Vec<u32>],
    eos: u32,
    seed: u64,
    n: usize,
) -> AnyResult<(f64, Vec<String>)> {
    let out = generate(policy, prompts, &gen_config(eos, seed, n))?;
    let mut hits = 0;
    let mut texts = Vec::new();
    for s in &out.sequences {
        let text = tok.decode(&s.token_ids, true)?;
        hits += usize::from(contains_digit(&text));
        texts.push(text);
    }
    Ok((hits as f64 / out.sequences.len() as f64, texts))
}

/// REINFORCE with a per-prompt leave-one-out baseline on the digit reward; prints the digit
/// rate per step and returns (before, after) rates over all prompts x 4 samples. With
/// `--rl-updates k` each batch takes k optimizer steps (as PPO's epochs x mini-batches do,
/// without the ratio clip).
fn check_learnable(
    dir: &Path,
    tok: &Tokenizer,
    prompts: &[Vec<u32>],
    eos: u32,
    args: &Args,
) -> AnyResult<(f64, f64)> {
    let actor = Model::load(dir, &LoadOptions::training(ModelKind::CausalLm))?;
    let policy = Model::load(dir, &LoadOptions::inference())?;
    let vars = actor.vars();
    let mut opt = AdamW::new(
        vars.clone(),
        AdamWConfig {
            lr: args.rl_lr,
            ..AdamWConfig::default()
        },
    )?;
    let eval_seed = 7;
    let (before, _) = digit_rate(&policy, tok, prompts, eos, eval_seed, 4)?;
    println!(
        "REINFORCE: lr {}, {} steps, {} prompts x {} samples and {} update(s) per step",
        args.rl_lr, args.rl_steps, args.rl_prompts, args.rl_samples, args.rl_updates
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed + 1);
    let samples = args.rl_samples;
    for step in 0..args.rl_steps {
        let picked: Vec<Vec<u32>> = (0..args.rl_prompts)
            .map(|_| prompts[rng.random_range(0..prompts.len())].clone())
            .collect();
        let out = generate(
            &policy,
            &picked,
            &gen_config(eos, 1000 + step as u64, samples),
        )?;
        let rewards: Vec<f64> = out
            .sequences
            .iter()
            .map(|s| {
                Ok(f64::from(u8::from(contains_digit(
                    &tok.decode(&s.token_ids, true)?,
                ))))
            })
            .collect::<AnyResult<_>>()?;
        let rate = rewards.iter().sum::<f64>() / rewards.len() as f64;
        // Leave-one-out baseline within each prompt's group of samples.
        let adv: Vec<f64> = rewards
            .chunks(samples)
            .flat_map(|g| {
                let sum: f64 = g.iter().sum();
                g.iter()
                    .map(move |r| r - (sum - r) / (samples - 1) as f64)
                    .collect::<Vec<_>>()
            })
            .collect();
        let seqs: Vec<Vec<u32>> = out
            .sequences
            .iter()
            .map(|s| s.prompt_ids.iter().chain(&s.token_ids).copied().collect())
            .collect();
        let t = seqs.iter().map(Vec::len).max().unwrap_or(0);
        let batch = Batch::left_padded(&seqs, eos, &Device::Cpu)?;
        let mut w = vec![0f32; seqs.len() * (t - 1)];
        for (r, s) in out.sequences.iter().enumerate() {
            let offset = t - seqs[r].len();
            for k in s.prompt_ids.len()..seqs[r].len() {
                w[r * (t - 1) + offset + k - 1] = (adv[r] / seqs.len() as f64) as f32;
            }
        }
        let w = Tensor::from_vec(w, (seqs.len(), t - 1), &Device::Cpu)?;
        for _ in 0..args.rl_updates {
            let lp = actor.token_log_probs(&batch, 1.0)?;
            let loss = (lp * &w)?.sum_all()?.neg()?;
            let mut grads = Gradients::backward(&loss, &vars)?;
            grads.clip_global_norm(1.0)?;
            opt.step(&grads)?;
        }
        policy.set_weights(&actor.named_tensors())?;
        println!("rl step {:>2}: batch digit rate {rate:.3}", step + 1);
    }
    let (after, texts) = digit_rate(&policy, tok, prompts, eos, eval_seed, 4)?;
    println!("samples after REINFORCE:");
    for t in texts.iter().step_by(37).take(6) {
        println!("  {t:?}");
    }
    Ok((before, after))
}

fn main() -> AnyResult<()> {
    let args = parse_args()?;
    let prompts_text = read_prompts(&args.prompts)?;
    if !args.eval_only {
        let pairs = read_pairs(&args.sft)?;
        std::fs::create_dir_all(&args.out)
            .map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
        let start = Instant::now();
        let mut texts: Vec<String> = pairs.iter().map(|(p, c)| format!("{p} {c}")).collect();
        texts.extend(prompts_text.iter().cloned());
        build_tokenizer(&args.out, &texts)?;
        let tok = Tokenizer::from_dir(&args.out)?;
        let eos = tok
            .eos_token_id()
            .ok_or("the trained tokenizer lost its EOS token")?;
        let mut examples = Vec::with_capacity(pairs.len());
        for (p, c) in &pairs {
            let mut ids = tok.encode(p, false)?;
            let prompt_len = ids.len();
            ids.extend(tok.encode(&format!(" {c}"), false)?);
            ids.push(eos);
            examples.push(Example { ids, prompt_len });
        }
        let config = model_config(tok.vocab_size(), eos)?;
        println!(
            "tokenizer: vocab {} ({:.1}s); {} SFT examples",
            tok.vocab_size(),
            start.elapsed().as_secs_f64(),
            examples.len()
        );
        let model = sft(&config, &examples, args.steps, args.seed, eos)?;
        model.save(&args.out, None)?;
        let gen = json!({
            "eos_token_id": eos,
            "pad_token_id": eos,
            "do_sample": true,
            "temperature": 1.0,
            "top_k": 0,
            "top_p": 1.0,
            "max_new_tokens": MAX_NEW_TOKENS,
        });
        std::fs::write(
            args.out.join("generation_config.json"),
            serde_json::to_string_pretty(&gen)? + "\n",
        )?;
        println!(
            "saved {} in {:.1}s",
            args.out.display(),
            start.elapsed().as_secs_f64()
        );
    }

    let tok = Tokenizer::from_dir(&args.out)?;
    let eos = tok.eos_token_id().ok_or("the tokenizer has no EOS token")?;
    let policy = Model::load(&args.out, &LoadOptions::inference())?;
    let prompts: Vec<Vec<u32>> = prompts_text
        .iter()
        .map(|p| tok.encode(p, false))
        .collect::<rlhf_model::Result<_>>()?;
    let (rate, texts) = digit_rate(&policy, &tok, &prompts, eos, 7, 4)?;
    println!(
        "initial contains_digit over {} prompts x 4 samples (temperature 1.0, {MAX_NEW_TOKENS} new tokens): {rate:.3}",
        prompts.len()
    );
    for (i, t) in texts.iter().enumerate().step_by(23).take(8) {
        println!("  {:?} -> {t:?}", prompts_text[i / 4]);
    }
    if args.check_learnable {
        let (before, after) = check_learnable(&args.out, &tok, &prompts, eos, &args)?;
        println!("REINFORCE digit rate: {before:.3} -> {after:.3}");
    }
    Ok(())
}
