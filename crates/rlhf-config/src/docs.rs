//! The generated key reference (`configs/README.md`).
//!
//! Keys and defaults come from the schema (the default config serialized), so
//! they cannot drift; the one-line docs come from [`KEY_DOCS`] and, for the
//! training keys, from their rustdoc. A test fails when a schema key has no
//! doc, when a doc names no key, or when the committed file differs.

use std::collections::BTreeMap;

use serde_norway::Value;

use crate::config::TrainingConfig;
use crate::load::{config_schema, ROLE_SECTIONS};
use crate::model::ModelConfig;

/// One-line docs of every non-training key, by full path.
pub const KEY_DOCS: &[(&str, &str)] = &[
    ("trainer", "What the job trains: ppo (RL from a reward), sft (the actor on completions or chats), reward (a reward model on preference pairs) or dpo (the actor on preference pairs, algorithm.loss_type)."),
    ("resource_pool.device", "Device kind every role runs on: GPU, NPU or CPU (the cluster resource name)."),
    ("resource_pool.device_memory_gb", "Memory of one device in GiB; `check` warns when a role's estimate exceeds it."),
    ("resource_pool.actor_rollout", "Devices of the actor; must equal num_gpus_for_train + num_gpus_for_infer."),
    ("resource_pool.ref", "Devices of the reference model."),
    ("resource_pool.critic", "Devices of the critic (its data-parallel ranks); unused without GAE."),
    ("resource_pool.reward", "Devices of the reward role (0 for rule or HTTP rewards)."),
    ("resource_pool.colocate", "Every role shares the same devices (one pool as large as the largest role, fractional bundles), and each actor trainer rank generates with its own weights (no copy, no weight sync); needs num_gpus_for_infer = num_gpus_for_train."),
    ("algorithm.scale_rewards", "GRPO: divide the group-centred scores by the group's std (group), the batch's std (batch) or not at all (none), as TRL's scale_rewards; grpo only."),
    ("algorithm.adv_estimator", "Advantage estimator: gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax."),
    ("algorithm.gamma", "Discount factor."),
    ("algorithm.lam", "GAE lambda."),
    ("algorithm.kl_penalty", "Per-token KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3)."),
    ("algorithm.kl_ctrl.type", "KL coefficient controller: fixed or adaptive."),
    ("algorithm.kl_ctrl.kl_coef", "Initial (or constant) KL coefficient."),
    ("algorithm.kl_ctrl.target_kl", "Adaptive controller: the KL it steers towards."),
    ("algorithm.kl_ctrl.horizon", "Adaptive controller: samples over which the error is corrected."),
    ("algorithm.use_kl_in_reward", "Subtract kl_coef x KL from the per-token reward."),
    ("algorithm.missing_eos_penalty", "Subtracted from the score of a response without EOS (null = off)."),
    ("algorithm.reward_clip", "Clip scores to [-reward_clip, reward_clip] (null = off)."),
    ("algorithm.whiten_rewards", "Whiten per-token rewards over the batch."),
    ("algorithm.whiten_advantages", "Whiten GAE advantages over the batch."),
    ("algorithm.norm_adv_by_std_in_grpo", "GRPO: divide by the group std (false = Dr. GRPO)."),
    ("algorithm.grpo_epsilon", "GRPO: added to the group std before dividing."),
    ("algorithm.loss_type", "trainer dpo: sigmoid (DPO), ipo, simpo (no reference) or kto (each completion against a batch KL estimate), as TRL computes them."),
    ("algorithm.beta", "trainer dpo: inverse temperature of the implicit reward (TRL's beta; IPO's tau)."),
    ("algorithm.label_smoothing", "trainer dpo: assumed share of flipped labels (cDPO), in [0, 0.5); sigmoid and simpo only."),
    ("algorithm.simpo_gamma", "trainer dpo, simpo: target reward margin gamma."),
    ("algorithm.desirable_weight", "trainer dpo, kto: weight of the chosen (desirable) completions."),
    ("algorithm.undesirable_weight", "trainer dpo, kto: weight of the rejected (undesirable) completions."),
    ("algorithm.center_rewards_coefficient", "trainer reward: adds this x mean((chosen + rejected)^2) to the loss to keep scores centred (null = off)."),
    ("algorithm.dynamic_sampling.enable", "DAPO's dynamic sampling: drop groups whose responses all score alike (no group-relative advantage) and generate more prompts until the batch is full; needs num_samples_per_step >= 2 and a group estimator (grpo, rloo, ...)."),
    ("algorithm.dynamic_sampling.metric", "What must differ within a group: score (the final score, after overlong shaping) or accuracy (right/wrong from reward.rule math or exact_match)."),
    ("algorithm.dynamic_sampling.max_num_gen_batches", "Generation rounds of training.global_batch_size prompts per batch, the first included (verl's default 10)."),
    ("algorithm.dynamic_sampling.when_exhausted", "When the rounds run out: train (on the kept groups, topped up with the latest dropped ones; logged as rollout/padded_groups) or fail."),
    ("algorithm.overlong_buffer.enable", "DAPO's overlong reward shaping: a soft penalty for responses that run into actor_rollout.max_response_length."),
    ("algorithm.overlong_buffer.len", "Tokens before the limit where the penalty starts; it grows linearly to penalty_factor at the limit."),
    ("algorithm.overlong_buffer.penalty_factor", "The penalty at the full length (DAPO: 1.0)."),
    ("algorithm.mask_truncated_completions", "Leave responses without EOS (cut at the length limit) out of the policy loss, as TRL; their scores still enter the advantages."),
    ("algorithm.score_placement", "Where the score enters the token rewards: last_token (the last response token, verl) or trl (one slot past it, values and the value loss extended by that slot, as TRL's PPOTrainer; gae only)."),
    ("actor_rollout.model", "A model named in `defaults`, a path to an HF model directory, or a Hugging Face repo id (`owner/name`, `owner/name@revision`) that each role process finds in its node's HF cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`) or downloads into it (not with `HF_HUB_OFFLINE=1`)."),
    ("actor_rollout.do_sample", "Sample during rollout; false decodes greedily (precision alignment)."),
    ("actor_rollout.temperature", "Sampling temperature."),
    ("actor_rollout.top_p", "Nucleus sampling threshold (1.0 = off)."),
    ("actor_rollout.top_k", "Top-k sampling (0 = off)."),
    ("actor_rollout.max_prompt_length", "Longest prompt in tokens; longer ones follow data.max_prompt_length_policy."),
    ("actor_rollout.max_response_length", "Most tokens generated per response."),
    ("actor_rollout.num_samples_per_step", "Responses sampled per prompt (the group size of GRPO / RLOO)."),
    ("actor_rollout.ppo_mini_batch_size", "Sequences per actor optimizer step; divides the rollout batch."),
    ("actor_rollout.ppo_epochs", "Passes of the actor over each rollout batch."),
    ("actor_rollout.shuffle_minibatch", "Shuffle sequences between actor mini-batches."),
    ("actor_rollout.num_gpus_for_train", "Data-parallel trainer ranks of the actor."),
    ("actor_rollout.num_gpus_for_infer", "Rollout (generation) ranks of the actor."),
    ("actor_rollout.clip_ratio", "PPO clip range epsilon."),
    ("actor_rollout.clip_ratio_low", "Lower clip range (null = clip_ratio)."),
    ("actor_rollout.clip_ratio_high", "Upper clip range (null = clip_ratio)."),
    ("actor_rollout.clip_ratio_c", "Dual-clip bound for negative advantages, > 1 (null = off, TRL's loss)."),
    ("actor_rollout.loss_agg_mode", "Token loss reduction: token-mean (TRL bnpo; dapo over the global batch), seq-mean-token-sum, seq-mean-token-mean (TRL grpo), seq-mean-token-sum-norm (TRL dr_grpo)."),
    ("actor_rollout.policy_loss", "Per-token objective: ppo (clipped surrogate), cispo (capped, detached weight times the log-prob) or sapo (SAPO's soft gate), as TRL's GRPO."),
    ("actor_rollout.importance_sampling_level", "Importance ratio per token, or per sequence (GSPO: exp of the mean log-ratio over the response)."),
    ("actor_rollout.cispo_clip_max", "cispo: upper bound on the importance weight (TRL's epsilon_high for cispo), > 1."),
    ("actor_rollout.sapo_temperature_pos", "sapo: gate temperature where the advantage is positive, > 0."),
    ("actor_rollout.sapo_temperature_neg", "sapo: gate temperature elsewhere, > 0."),
    ("actor_rollout.loss_scale_factor", "seq-mean-token-sum-norm only: the constant each sequence's token sum is divided by (TRL's max_completion_length); default max_response_length."),
    ("actor_rollout.entropy_coeff", "Weight of the entropy bonus."),
    ("actor_rollout.use_kl_loss", "Add a KL-to-reference loss term (GRPO style)."),
    ("actor_rollout.kl_loss_coef", "Weight of that KL loss."),
    ("actor_rollout.kl_loss_type", "KL estimator of that KL loss."),
    ("actor_rollout.fixed_responses_file", "Precision alignment: JSONL of fixed responses replacing generation, lines {\"prompt\", \"response\"} (text) or {\"prompt_ids\", \"response_ids\"} (exact token ids) (null = generate)."),
    ("actor_rollout.hybrid_engine", "Under resource_pool.colocate: the rollout ranks are the actor trainer processes and generate with their weights (true: one copy, no weight sync), or processes of their own on the same devices, given the weights after every update through shared memory (CUDA IPC on GPUs) (false: a second copy of the policy on the devices, in processes of their own)."),
    ("actor_rollout.engine", "The rollout ranks' engine: candle (our own generation loop, no Python) or vllm (each rollout rank runs a vLLM server as its child, token ids in and out, weights reloaded after every update; the worker needs --vllm-python or RLHF_VLLM_PYTHON). docs/vllm.md."),
    ("actor_rollout.vllm.gpu_memory_utilization", "engine=vllm on GPUs: the share of the rollout GPU's memory vLLM takes for weights, activations and KV cache (0, 1]."),
    ("actor_rollout.vllm.kv_cache_gb", "engine=vllm on the CPU: the KV cache of vLLM's CPU build in whole GiB (VLLM_CPU_KVCACHE_SPACE)."),
    ("actor_rollout.vllm.max_num_seqs", "engine=vllm: most sequences the server runs at once."),
    ("actor_rollout.vllm.enable_prefix_caching", "engine=vllm: reuse the KV cache of a shared prompt prefix, so a group of num_samples_per_step samples computes its prompt once."),
    ("actor_rollout.vllm.extra_args", "engine=vllm: further engine arguments, each --name or --name=value, from a fixed list of tuning flags (docs/vllm.md); arguments that load code or files are refused."),
    ("actor_rollout.vllm.start_timeout_s", "engine=vllm: seconds a server may take to load and get healthy before the role fails (its last output lines shown)."),
    ("actor_rollout.vllm.request_timeout_s", "engine=vllm: seconds one generation request may take."),
    ("actor_rollout.offload", "Colocated trainer (resource_pool.colocate): AdamW's moments move to host memory before each generation and back at the next update, freeing 8 bytes per parameter of device memory while generating; needs resource_pool.colocate with actor_rollout.hybrid_engine."),
    ("actor_rollout.lora.rank", "LoRA rank of the actor (0 = off: the full model trains). On: the base is frozen in the compute dtype, only the adapters train and sync to the rollout, checkpoints hold PEFT adapters (`rlhf merge-lora` writes a merged model)."),
    ("actor_rollout.lora.alpha", "LoRA alpha: the adapters' update is scaled by alpha / rank."),
    ("actor_rollout.lora.dropout", "LoRA dropout (PEFT's `lora_dropout`): the share of each adapter's inputs zeroed in a training step, the rest scaled by 1/(1-p); masks are drawn from the seed, step and rows, so a resumed run draws the same ones. Trainer sft only (PPO and DPO compare passes over the same tokens, and run with dropout off as TRL does)."),
    ("actor_rollout.lora.target_modules", "Linear modules that get adapters: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or all-linear."),
    ("actor_rollout.async.mode", "sync (generate, train, sync weights), one_step_off (the next batch is generated while this one trains, with weights one version old) or bounded (the rollout runs up to max_staleness batches ahead; weights sync every max_staleness steps)."),
    ("actor_rollout.async.max_staleness", "Most policy versions a sample may lag the trainer (bounded mode's depth); older samples are dropped and counted in rollout/dropped."),
    ("actor_rollout.async.is_cap", "Async modes: the PPO loss of each token is multiplied by the importance weight pi_old / pi_behaviour truncated at this cap (>= 1)."),
    ("ref.model", "Model name, path or Hugging Face repo id (empty = the actor's model)."),
    ("critic.model", "Model name, path or Hugging Face repo id (empty = the actor's model with a fresh value head)."),
    ("critic.cliprange_value", "Value clip range around the rollout values."),
    ("critic.vf_coef", "Weight of the value loss."),
    ("critic.loss_agg_mode", "Value loss reduction (as actor_rollout.loss_agg_mode)."),
    ("critic.critic_mini_batch_size", "Sequences per critic optimizer step; divides the rollout batch."),
    ("critic.critic_update_epochs", "Passes of the critic over each rollout batch."),
    ("critic.shuffle_minibatch", "Shuffle sequences between critic mini-batches."),
    ("critic.lora.rank", "LoRA rank of the critic (0 = off); the value head trains in full (PEFT's modules_to_save)."),
    ("critic.lora.alpha", "LoRA alpha of the critic's adapters."),
    ("critic.lora.dropout", "LoRA dropout of the critic; 0 (the critic trains in PPO, which runs with dropout off)."),
    ("critic.lora.target_modules", "Linear modules of the critic that get adapters (as actor_rollout.lora.target_modules)."),
    ("reward.kind", "How responses are scored: model, rule or http."),
    ("reward.model", "Reward model name, path or Hugging Face repo id (kind: model)."),
    ("reward.rule", "Built-in rule (kind: rule): contains_digit, length, exact_match (the trimmed response equals ground_truth) or math (the last \\boxed{} or last number of the response equals ground_truth as a number: integers, decimals, a/b, \\frac{a}{b}; else as text; no answer scores reward.no_answer_score)."),
    ("reward.format_score", "rule math: the score of a response whose answer was found but is wrong (a format reward; right answers score 1)."),
    ("reward.no_answer_score", "rule math: the score of a response with no answer to find (counted as reward/no_answer)."),
    ("reward.url", "Scoring endpoint, http:// or https:// (kind: http)."),
    ("reward.timeout_s", "Timeout of one scoring call in seconds (kind: http)."),
    ("data.path", "Prompt dataset file (JSONL or Parquet)."),
    ("data.format", "auto (from the extension), jsonl or parquet."),
    ("data.prompt_key", "Prompt column: a string, or a list of {role, content} messages."),
    ("data.messages_key", "Chat-messages column; read instead of prompt_key when set."),
    ("data.ground_truth_key", "Reference-answer column (string or number), sent to the reward as `ground_truth` (rules exact_match and math)."),
    ("data.completion_key", "trainer sft: column with the completion the loss covers (text, or a list of messages after a message-list prompt)."),
    ("data.chosen_key", "trainer reward / dpo: column with the preferred answer (text or messages)."),
    ("data.rejected_key", "trainer reward / dpo: column with the dispreferred answer; without a prompt column, two chats' shared leading turns are the prompt."),
    ("data.margin_key", "trainer reward: column with a per-pair margin the chosen score must clear (null = none)."),
    ("data.apply_chat_template", "Render prompts with the model's chat template (always for messages)."),
    ("data.chat_template_kwargs", "Extra chat template variables, as transformers' apply_chat_template(**kwargs), e.g. {enable_thinking: false} for Qwen3 (an empty think block closes the prompt); booleans, numbers or strings; an override sets one: data.chat_template_kwargs.enable_thinking=false."),
    ("data.max_prompt_length_policy", "Prompts over actor_rollout.max_prompt_length: truncate (keep the last tokens) or skip."),
    ("data.shuffle", "Reshuffle the prompts every epoch."),
    ("data.seed", "Shuffle seed (null = training.seed)."),
    ("data.bad_rows", "Rows that fail to parse: skip (count, report, drop) or fail."),
    ("data.eval_path", "trainer reward / dpo: held-out pairs (same format as path) scored every eval_every steps and at the last step, logged as eval/* (null = no eval)."),
    ("data.eval_every", "Steps between evals on data.eval_path."),
    ("data.packing", "trainer sft: pack examples into rows of max_prompt_length + max_response_length tokens (best-fit decreasing), each attending only to itself; global_batch_size then counts packed rows."),
    ("checkpoint.dir", "Directory of step_N/ checkpoints."),
    ("checkpoint.save_steps", "Save every N steps (0 = only at the end)."),
    ("checkpoint.keep_last", "Keep the newest N checkpoints (0 = all)."),
    ("checkpoint.resume", "latest, a checkpoint path, or null to start fresh."),
    ("checkpoint.memory_snapshot", "Also hold every checkpoint in the memory of another node's worker (the same node's on a one-node cluster): an automatic restart then loads each part from there, falling back to checkpoint.dir part by part when a copy is missing (its node died too). The snapshot is pushed after the files are on disk; each worker keeps the newest committed one per job, within rlhf-worker --snapshot-memory-gb."),
    ("logging.metrics_file", "JSONL file with one metrics record per step."),
    ("logging.samples_file", "JSONL file with the sample tables."),
    ("logging.ledger_file", "JSONL ledger of the prompts each step consumed: {step, epoch, position, trained (the dataset rows, numbered from 1, of the prompts trained on), dropped (those dynamic sampling filtered out), surplus (those it generated beyond the full batch)}, one line per step, kept exactly once across restarts and resumes as the metrics file is (empty = none; PPO-family jobs)."),
    ("logging.sample_every", "Print and save a (query, response, score) table every N steps (0 = never)."),
    ("logging.sample_rows", "Rows per sample table."),
    ("logging.progress", "Show a progress bar with ETA and key metrics."),
    ("logging.tensorboard_dir", "Directory of TensorBoard event files, one scalar per metric and step plus the sample tables as text (empty = off); set, it turns the tensorboard backend on even if logging.backends does not list it. Each start writes a new event file that hides the points of later steps in the older files (a resumed run keeps the steps up to its checkpoint, a fresh run none), so each step shows once."),
    ("logging.backends", "Where metrics go: jsonl (logging.metrics_file and logging.samples_file; `rlhf-head job status` and the dashboard read that metrics file) and/or tensorboard (needs logging.tensorboard_dir). A list without jsonl writes no JSONL files."),
    ("fault_tolerance.max_restarts", "Automatic restarts when a role process or its node dies: every role is placed again and reloads the newest complete checkpoint (from the start without one), then the run goes on; 0 = fail at the first death (continue by hand with --resume latest)."),
    ("fault_tolerance.restart_backoff_s", "Seconds to wait between a death and the restart."),
];

/// One-line docs of the model file keys.
pub const MODEL_KEY_DOCS: &[(&str, &str)] = &[
    (
        "path",
        "HF model directory (weights, config.json, tokenizer), or a Hugging Face repo id (`owner/name[@revision]`) resolved through the local HF cache.",
    ),
    ("model_type", "HF model_type (llama, qwen2, ...)."),
    ("hidden_size", "Width of the residual stream."),
    ("num_hidden_layers", "Decoder layers."),
    ("num_attention_heads", "Query heads."),
    (
        "num_key_value_heads",
        "Key/value heads (null = num_attention_heads).",
    ),
    (
        "head_dim",
        "Per-head width (null = hidden_size / num_attention_heads).",
    ),
    ("intermediate_size", "MLP inner width."),
    ("vocab_size", "Vocabulary size."),
    (
        "max_position_embeddings",
        "Longest sequence the positions support; prompt + response must fit.",
    ),
    (
        "tie_word_embeddings",
        "The LM head shares the embedding matrix.",
    ),
    ("attention_bias", "q/k/v projections carry a bias (Qwen2)."),
    ("rope_theta", "RoPE base."),
    ("rms_norm_eps", "RMSNorm epsilon."),
];

/// Every leaf key of `v`, as (dotted path, value).
pub fn leaves(v: &Value) -> Vec<(String, Value)> {
    fn walk(v: &Value, prefix: &str, out: &mut Vec<(String, Value)>) {
        match v {
            Value::Mapping(m) if !m.is_empty() => {
                for (k, child) in m {
                    let k = k.as_str().unwrap_or_default();
                    let p = if prefix.is_empty() {
                        k.to_string()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(child, &p, out);
                }
            }
            other => out.push((prefix.to_string(), other.clone())),
        }
    }
    let mut out = Vec::new();
    walk(v, "", &mut out);
    out
}

fn inline(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::String(s) if s.is_empty() => "\"\"".into(),
        // Flow style, as a list is written in an override: `[a, b]`.
        Value::Sequence(items) => format!(
            "[{}]",
            items.iter().map(inline).collect::<Vec<_>>().join(", ")
        ),
        other => serde_norway::to_string(other)
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
    }
}

/// The doc of a job-config key, if any.
pub fn doc_of(path: &str) -> Option<String> {
    let training: BTreeMap<&str, String> = TrainingConfig::key_docs().into_iter().collect();
    if let Some(k) = path.strip_prefix("training.") {
        return training.get(k).cloned();
    }
    if let Some((section, k)) = path.split_once('.') {
        if ROLE_SECTIONS.contains(&section) && training.contains_key(k) {
            return Some(format!(
                "RoleKind override of `training.{k}` (unset = inherit)."
            ));
        }
    }
    KEY_DOCS
        .iter()
        .find(|(p, _)| *p == path)
        .map(|(_, d)| d.to_string())
}

/// The markdown of `configs/README.md`.
pub fn config_reference_markdown() -> String {
    let mut s = String::new();
    s.push_str(
        "# PPO job config keys\n\n\
         <!-- Generated by `cargo run -p rlhf-config --example gen_config_docs`; do not edit.\n     \
         A test in crates/rlhf-config fails when this file drifts from the code. -->\n\n\
         A job config is `configs/<name>.yaml`, chosen with `--config-name <name>` (no `.yaml`)\n\
         and `--config-dir` (default `configs`). `key.path=value` arguments override any key,\n\
         e.g. `actor_rollout.ppo_epochs=2 algorithm.kl_ctrl.kl_coef=0.1`. Unknown keys are\n\
         rejected with the closest valid key; batch-size divisibility, device counts and\n\
         lengths are checked at load and every failure is listed with its numbers.\n\n\
         Sections: `defaults` (model files), `training` (shared defaults), `resource_pool`,\n\
         `algorithm`, `actor_rollout`, `ref`, `critic`, `reward`, `data`, `checkpoint`, `logging`.\n\
         Each role section (`actor_rollout`, `ref`, `critic`, `reward`) may also set any\n\
         `training` key to override it for that role only. Relative paths (models, data,\n\
         checkpoints, logs) are relative to the directory the job is started from.\n\n\
         ## defaults\n\n\
         ```yaml\ndefaults:\n  - model: llama32_1b        # loads configs/model/llama32_1b.yaml\n```\n\n\
         A role's `model` is a name listed in `defaults`, a path to an HF model directory\n\
         (then its `config.json` gives the architecture when present), or a Hugging Face repo\n\
         id such as `Qwen/Qwen2.5-0.5B-Instruct` (`@revision` for a branch, tag or commit).\n\
         An id is looked up in each node's local HF cache (`$HF_HUB_CACHE`, else\n\
         `$HF_HOME/hub`, else `~/.cache/huggingface/hub`, the layout `huggingface-cli download`\n\
         writes) by the role process that loads it, and downloaded into that cache when missing\n\
         (config, tokenizer files, safetensors weights) unless `HF_HUB_OFFLINE=1`. A relative\n\
         path that does not exist under the start directory but is a valid id is taken as the id.\n\n",
    );
    let schema = config_schema();
    let mut section = String::new();
    for (path, default) in leaves(&schema) {
        let sec = path.split('.').next().unwrap_or_default().to_string();
        let is_role_training = path
            .split_once('.')
            .is_some_and(|(s, k)| ROLE_SECTIONS.contains(&s) && TrainingConfig::KEYS.contains(&k));
        if is_role_training {
            continue;
        }
        if sec != section {
            section = sec;
            s.push_str(&format!(
                "## {section}\n\n| key | default | meaning |\n| --- | --- | --- |\n"
            ));
        }
        let doc = doc_of(&path).unwrap_or_else(|| "(undocumented)".into());
        s.push_str(&format!("| `{path}` | `{}` | {doc} |\n", inline(&default)));
    }
    // A blank line ends each table before the next section header.
    s = s.replace("|\n## ", "|\n\n## ");
    s.push_str(
        "\n## Model files (`configs/model/<name>.yaml`)\n\n\
         Hugging Face `config.json` names. Required unless a default is shown.\n\n\
         | key | default | meaning |\n| --- | --- | --- |\n",
    );
    let model_schema = serde_norway::to_value(ModelConfig::default()).unwrap_or(Value::Null);
    for (path, _) in leaves(&model_schema) {
        let default = match path.as_str() {
            "path"
            | "model_type"
            | "num_key_value_heads"
            | "head_dim"
            | "rope_theta"
            | "rms_norm_eps" => "null",
            "tie_word_embeddings" | "attention_bias" => "false",
            _ => "required",
        };
        let doc = MODEL_KEY_DOCS
            .iter()
            .find(|(k, _)| *k == path)
            .map(|(_, d)| *d)
            .unwrap_or("(undocumented)");
        s.push_str(&format!("| `{path}` | `{default}` | {doc} |\n"));
    }
    s
}
