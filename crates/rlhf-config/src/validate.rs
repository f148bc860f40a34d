//! Load-time validation: every rule runs, every failure is reported with the
//! keys and numbers involved and what to change.

use crate::config::{LogBackend, PpoConfig, RewardKind, RoleKind, TrainerKind};
use crate::error::{ConfigError, Result};

/// Runs every rule; `Err(Invalid)` lists all failures at once.
pub fn validate(cfg: &PpoConfig, origin: &str) -> Result<()> {
    let errors = problems(cfg);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            origin: origin.into(),
            errors,
        })
    }
}

/// Every failed rule, one message each (empty when the config is valid).
pub fn problems(cfg: &PpoConfig) -> Vec<String> {
    let mut e = Vec::new();
    e.extend(zero_problems(cfg));
    if cfg.data.packing && cfg.trainer != TrainerKind::Sft {
        e.push(format!(
            "data.packing packs SFT examples into rows, and this job is trainer {}; remove data.packing (or set trainer: sft)",
            cfg.trainer
        ));
    }
    if cfg.trainer != TrainerKind::Ppo {
        if cfg.actor_rollout.engine == crate::RolloutEngine::Vllm {
            e.push(format!(
                "actor_rollout.engine=vllm generates the rollout of RL training, but trainer {} generates nothing; set actor_rollout.engine=candle (the default)",
                cfg.trainer
            ));
        }
        e.extend(stage_problems(cfg));
        return e;
    }
    let a = &cfg.actor_rollout;
    let c = &cfg.critic;
    let pool = &cfg.resource_pool;
    let actor_t = cfg.resolved(RoleKind::ActorRollout);
    let critic_t = cfg.resolved(RoleKind::Critic);
    let prompts = actor_t.global_batch_size;
    let rollout = cfg.rollout_batch_size();

    // Sizes that everything else divides by.
    for (key, v) in [
        (
            "training.global_batch_size (as resolved for actor_rollout)",
            u64::from(prompts),
        ),
        (
            "actor_rollout.num_samples_per_step",
            u64::from(a.num_samples_per_step),
        ),
        (
            "actor_rollout.ppo_mini_batch_size",
            u64::from(a.ppo_mini_batch_size),
        ),
        ("actor_rollout.ppo_epochs", u64::from(a.ppo_epochs)),
        (
            "actor_rollout.num_gpus_for_train",
            u64::from(a.num_gpus_for_train),
        ),
        (
            "actor_rollout.num_gpus_for_infer",
            u64::from(a.num_gpus_for_infer),
        ),
        (
            "actor_rollout.max_prompt_length",
            u64::from(a.max_prompt_length),
        ),
        (
            "actor_rollout.max_response_length",
            u64::from(a.max_response_length),
        ),
        ("training.train_iters", actor_t.train_iters),
    ] {
        if v == 0 {
            e.push(format!("{key} must be > 0"));
        }
    }
    for role in RoleKind::ALL {
        let t = cfg.resolved(role);
        if t.micro_batch_size == 0 {
            e.push(format!("{role}: micro_batch_size must be > 0 (training.micro_batch_size or {role}.micro_batch_size)"));
        }
        if t.seq_length == 0 {
            e.push(format!("{role}: seq_length must be > 0"));
        }
        let total = u64::from(a.max_prompt_length) + u64::from(a.max_response_length);
        if cfg.role_enabled(role)
            && !(role == RoleKind::Reward && cfg.reward.kind != RewardKind::Model)
            && u64::from(t.seq_length) < total
        {
            e.push(format!(
                "{role}: seq_length ({}) < actor_rollout.max_prompt_length ({}) + actor_rollout.max_response_length ({}) = {total}; raise seq_length (training or {role}) to at least {total}",
                t.seq_length, a.max_prompt_length, a.max_response_length
            ));
        }
        if !(t.lr.is_finite() && t.lr >= 0.0) {
            e.push(format!(
                "{role}: lr ({}) must be a finite number >= 0",
                t.lr
            ));
        }
        if !(t.min_lr.is_finite() && t.min_lr >= 0.0 && t.min_lr <= t.lr) {
            e.push(format!(
                "{role}: min_lr ({}) must be between 0 and lr ({})",
                t.min_lr, t.lr
            ));
        }
        for (k, v) in [("adam_beta1", t.adam_beta1), ("adam_beta2", t.adam_beta2)] {
            if !(0.0..1.0).contains(&v) {
                e.push(format!("{role}: {k} ({v}) must be in [0, 1)"));
            }
        }
        if !positive(t.adam_eps) {
            e.push(format!("{role}: adam_eps ({}) must be > 0", t.adam_eps));
        }
        if !non_negative(t.weight_decay) || !non_negative(t.clip_grad) {
            e.push(format!(
                "{role}: weight_decay ({}) and clip_grad ({}) must be >= 0",
                t.weight_decay, t.clip_grad
            ));
        }
    }

    // Actor batch arithmetic.
    if a.ppo_mini_batch_size > 0 && !rollout.is_multiple_of(u64::from(a.ppo_mini_batch_size)) {
        e.push(format!(
            "rollout batch = training.global_batch_size ({prompts}) x actor_rollout.num_samples_per_step ({}) = {rollout} is not divisible by actor_rollout.ppo_mini_batch_size ({}); use a mini batch that divides {rollout}",
            a.num_samples_per_step, a.ppo_mini_batch_size
        ));
    }
    let actor_step = u64::from(actor_t.micro_batch_size) * u64::from(a.num_gpus_for_train);
    if actor_step > 0 && !u64::from(a.ppo_mini_batch_size).is_multiple_of(actor_step) {
        e.push(format!(
            "actor_rollout.ppo_mini_batch_size ({}) is not divisible by micro_batch_size ({}) x actor_rollout.num_gpus_for_train ({}) = {actor_step}; every trainer rank needs whole micro batches",
            a.ppo_mini_batch_size, actor_t.micro_batch_size, a.num_gpus_for_train
        ));
    }
    if a.num_gpus_for_infer > 0 && !rollout.is_multiple_of(u64::from(a.num_gpus_for_infer)) {
        e.push(format!(
            "rollout batch ({rollout} = {prompts} prompts x {} samples) is not divisible by actor_rollout.num_gpus_for_infer ({}); each rollout rank must get the same number of sequences",
            a.num_samples_per_step, a.num_gpus_for_infer
        ));
    }
    let split = a.num_gpus_for_train + a.num_gpus_for_infer;
    if split != pool.actor_rollout {
        e.push(format!(
            "actor_rollout.num_gpus_for_train ({}) + actor_rollout.num_gpus_for_infer ({}) = {split} != resource_pool.actor_rollout ({}); make them equal",
            a.num_gpus_for_train, a.num_gpus_for_infer, pool.actor_rollout
        ));
    }
    if a.offload && !cfg.hybrid_engine() {
        e.push(
            "actor_rollout.offload: true moves the trainer's optimizer state off the device while that device generates, which happens only when the trainer generates itself (resource_pool.colocate: true with actor_rollout.hybrid_engine: true); set resource_pool.colocate=true with actor_rollout.hybrid_engine=true (the default), or actor_rollout.offload=false".to_string(),
        );
    }
    e.extend(a.async_.problems());
    if a.engine == crate::RolloutEngine::Vllm {
        e.extend(a.vllm.problems());
        if cfg.hybrid_engine() {
            e.push(
                "actor_rollout.engine=vllm runs a vLLM server in each rollout rank's own process, but resource_pool.colocate with actor_rollout.hybrid_engine: true makes the trainer processes generate with their own weights; set actor_rollout.hybrid_engine=false (rollout processes of their own, weights reloaded after each update) or resource_pool.colocate=false".to_string(),
            );
        }
        if a.fixed_responses_file
            .as_deref()
            .is_some_and(|f| !f.is_empty())
        {
            e.push(
                "actor_rollout.fixed_responses_file replaces generation, so actor_rollout.engine=vllm would start servers that never generate; drop one of the two".to_string(),
            );
        }
    }
    e.extend(a.lora.problems("actor_rollout.lora"));
    e.extend(cfg.critic.lora.problems("critic.lora"));
    e.extend(lora_dropout_problem(
        cfg.trainer,
        "actor_rollout.lora",
        &a.lora,
    ));
    e.extend(lora_dropout_problem(
        cfg.trainer,
        "critic.lora",
        &cfg.critic.lora,
    ));
    e.extend(cfg.fault_tolerance.problems());
    if a.async_.is_async() && pool.colocate {
        e.push(format!(
            "actor_rollout.async.mode={} overlaps generation with training on separate ranks, but resource_pool.colocate: true runs both on the same device with the same weights, one after the other; set resource_pool.colocate=false or actor_rollout.async.mode=sync",
            a.async_.mode
        ));
    }
    if a.async_.is_async()
        && a.fixed_responses_file
            .as_deref()
            .is_some_and(|f| !f.is_empty())
    {
        e.push(format!(
            "actor_rollout.async.mode={} overlaps generation with training, but actor_rollout.fixed_responses_file replaces generation; set actor_rollout.async.mode=sync",
            a.async_.mode
        ));
    }
    if cfg.hybrid_engine() && a.num_gpus_for_infer != a.num_gpus_for_train {
        e.push(format!(
            "resource_pool.colocate with actor_rollout.hybrid_engine: every actor trainer rank generates with its own weights, so actor_rollout.num_gpus_for_infer ({}) must equal actor_rollout.num_gpus_for_train ({}) (or set actor_rollout.hybrid_engine=false for rollout processes of their own)",
            a.num_gpus_for_infer, a.num_gpus_for_train
        ));
    }
    if cfg.algorithm.adv_estimator.needs_groups() && a.num_samples_per_step < 2 {
        e.push(format!(
            "algorithm.adv_estimator = {} compares responses within a group: actor_rollout.num_samples_per_step ({}) must be >= 2",
            cfg.algorithm.adv_estimator, a.num_samples_per_step
        ));
    }

    // Critic batch arithmetic.
    if cfg.role_enabled(RoleKind::Critic) {
        if pool.critic == 0 {
            e.push(format!(
                "algorithm.adv_estimator = {} needs a critic, but resource_pool.critic is 0",
                cfg.algorithm.adv_estimator
            ));
        }
        if c.critic_mini_batch_size == 0 || c.critic_update_epochs == 0 {
            e.push(format!(
                "critic.critic_mini_batch_size ({}) and critic.critic_update_epochs ({}) must be > 0",
                c.critic_mini_batch_size, c.critic_update_epochs
            ));
        } else {
            if !rollout.is_multiple_of(u64::from(c.critic_mini_batch_size)) {
                e.push(format!(
                    "rollout batch = training.global_batch_size ({prompts}) x actor_rollout.num_samples_per_step ({}) = {rollout} is not divisible by critic.critic_mini_batch_size ({})",
                    a.num_samples_per_step, c.critic_mini_batch_size
                ));
            }
            let step = u64::from(critic_t.micro_batch_size) * u64::from(pool.critic.max(1));
            if step > 0 && !u64::from(c.critic_mini_batch_size).is_multiple_of(step) {
                e.push(format!(
                    "critic.critic_mini_batch_size ({}) is not divisible by micro_batch_size ({}) x resource_pool.critic ({}) = {step}",
                    c.critic_mini_batch_size, critic_t.micro_batch_size, pool.critic
                ));
            }
        }
        if let Err(err) = c.value_loss().validate() {
            e.push(format!("critic: {err}"));
        }
    }

    // A LoRA actor's reference needs no devices: the trainers serve it.
    if pool.ref_ == 0 && !cfg.ref_in_trainer() && (cfg.algorithm.use_kl_in_reward || a.use_kl_loss)
    {
        e.push("resource_pool.ref is 0 but the KL penalty needs reference log-probs (algorithm.use_kl_in_reward or actor_rollout.use_kl_loss); give the reference devices, or train the actor with LoRA (actor_rollout.lora.rank > 0) so that its base serves as the reference".into());
    }

    // Sampling.
    if a.do_sample && !(a.temperature > 0.0 && a.temperature.is_finite()) {
        e.push(format!(
            "actor_rollout.temperature ({}) must be > 0 when do_sample is true",
            a.temperature
        ));
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        e.push(format!(
            "actor_rollout.top_p ({}) must be in (0, 1]",
            a.top_p
        ));
    }
    if let Err(err) = a.policy_loss().validate() {
        e.push(format!("actor_rollout: {err}"));
    }
    if let Err(err) = cfg.algorithm.validate() {
        e.push(err.to_string());
    }

    // Models and their context length.
    if a.model.is_empty() {
        e.push("actor_rollout.model is empty; name a model from `defaults`, give an HF model directory or a Hugging Face repo id (owner/name)".into());
    }
    let total = u64::from(a.max_prompt_length) + u64::from(a.max_response_length);
    for role in RoleKind::ALL {
        if !cfg.role_enabled(role) {
            continue;
        }
        if let Some(m) = cfg.role_model(role) {
            if let Some(arch) = &m.arch {
                if total > arch.max_position_embeddings {
                    e.push(format!(
                        "{role}: actor_rollout.max_prompt_length ({}) + actor_rollout.max_response_length ({}) = {total} exceeds max_position_embeddings ({}) of model '{}'",
                        a.max_prompt_length, a.max_response_length, arch.max_position_embeddings, m.name
                    ));
                }
            }
        }
    }
    for entry in &cfg.defaults {
        for name in entry.model.names() {
            if !cfg.models.contains_key(name) {
                e.push(format!(
                    "defaults names model '{name}' but it was not loaded"
                ));
            }
        }
    }

    // Reward.
    let r = &cfg.reward;
    match r.kind {
        RewardKind::Model => {
            if r.model.is_empty() {
                e.push("reward.kind is model but reward.model is empty; name a reward model, or use reward.kind: rule with reward.rule".into());
            }
            if pool.reward == 0 {
                e.push("reward.kind is model but resource_pool.reward is 0".into());
            }
        }
        RewardKind::Rule if r.rule.is_empty() => {
            e.push("reward.kind is rule but reward.rule is empty; name a built-in rule".into());
        }
        RewardKind::Rule
            if matches!(r.rule.as_str(), "exact_match" | "math")
                && cfg.data.ground_truth_key.is_none() =>
        {
            e.push(format!("reward.rule is {} but data.ground_truth_key is not set; name the dataset column with the reference answers", r.rule));
        }
        RewardKind::Http => {
            if !(r.url.starts_with("http://") || r.url.starts_with("https://")) {
                e.push(format!(
                    "reward.kind is http but reward.url ('{}') is not an http:// or https:// URL",
                    r.url
                ));
            }
            if !(r.timeout_s > 0.0 && r.timeout_s.is_finite()) {
                e.push(format!("reward.timeout_s ({}) must be > 0", r.timeout_s));
            }
        }
        RewardKind::Rule => {}
    }
    for (key, v) in [
        ("reward.format_score", r.format_score),
        ("reward.no_answer_score", r.no_answer_score),
    ] {
        if !v.is_finite() {
            e.push(format!("{key} ({v}) must be a finite number"));
        } else if v != 0.0 && !(r.kind == RewardKind::Rule && r.rule == "math") {
            e.push(format!(
                "{key} ({v}) only applies to reward.rule math, but the reward is {}; remove it",
                reward_name(r)
            ));
        }
    }
    e.extend(dapo_problems(cfg));

    // Data, checkpoints, pool.
    if cfg.data.path.is_empty() {
        e.push("data.path is empty; point it at a JSONL or Parquet prompt file".into());
    }
    if cfg.data.prompt_key.is_empty() && cfg.data.messages_key.is_none() {
        e.push(
            "data.prompt_key is empty and data.messages_key is unset; name the prompt column"
                .into(),
        );
    }
    if cfg.checkpoint.dir.is_empty() {
        e.push("checkpoint.dir is empty".into());
    }
    let logging = &cfg.logging;
    if logging.backends.contains(&LogBackend::Tensorboard) && logging.tensorboard_dir.is_empty() {
        e.push("logging.backends lists tensorboard but logging.tensorboard_dir is empty; set logging.tensorboard_dir to the directory of the event files (e.g. logging.tensorboard_dir=runs/my_job) or remove tensorboard from logging.backends".into());
    }
    if !(pool.device_memory_gb > 0.0 && pool.device_memory_gb.is_finite()) {
        e.push(format!(
            "resource_pool.device_memory_gb ({}) must be > 0",
            pool.device_memory_gb
        ));
    }
    e
}

/// Finite and > 0 (false for NaN).
/// DAPO's dynamic sampling and overlong shaping against the rollout they act on.
fn dapo_problems(cfg: &PpoConfig) -> Vec<String> {
    let mut e = Vec::new();
    let a = &cfg.actor_rollout;
    let alg = &cfg.algorithm;
    let ds = &alg.dynamic_sampling;
    if ds.enable {
        if a.num_samples_per_step < 2 {
            e.push(format!(
                "algorithm.dynamic_sampling.enable drops groups whose responses all score alike, but actor_rollout.num_samples_per_step is {}: there are no groups; sample 2 or more responses per prompt (DAPO uses 16) or turn dynamic sampling off",
                a.num_samples_per_step
            ));
        }
        if a.fixed_responses_file
            .as_deref()
            .is_some_and(|f| !f.is_empty())
        {
            e.push("algorithm.dynamic_sampling.enable generates more prompts when groups are dropped, but actor_rollout.fixed_responses_file replaces generation; turn one of them off".into());
        }
        let verifying = cfg.reward.kind == RewardKind::Rule
            && matches!(cfg.reward.rule.as_str(), "math" | "exact_match");
        if ds.metric == rlhf_algo::FilterMetric::Accuracy && !verifying {
            e.push(format!(
                "algorithm.dynamic_sampling.metric is accuracy, which needs a reward that says right or wrong (reward.kind rule with rule math or exact_match), but the reward is {}; use metric score",
                reward_name(&cfg.reward)
            ));
        }
    }
    let ob = &alg.overlong_buffer;
    if ob.enable && ob.len >= a.max_response_length {
        e.push(format!(
            "algorithm.overlong_buffer.len ({}) must be below actor_rollout.max_response_length ({}): the penalty starts that many tokens before the limit (DAPO: a quarter of it)",
            ob.len, a.max_response_length
        ));
    }
    e
}

/// The reward as a config names it: `rule math`, `http`, `model`.
fn reward_name(r: &crate::config::RewardConfig) -> String {
    match r.kind {
        RewardKind::Rule => format!("rule {}", r.rule),
        RewardKind::Http => "http".into(),
        RewardKind::Model => "model".into(),
    }
}

fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

/// Finite and >= 0 (false for NaN).
fn non_negative(x: f64) -> bool {
    x.is_finite() && x >= 0.0
}

/// The rules of the other stages (`trainer: sft | reward | dpo`): sizes, ranks that divide
/// the batch, the trained role's model and the reference a DPO loss needs.
/// LoRA dropout trains SFT only: PPO, DPO and reward training run with dropout off, as TRL's
/// trainers do, because they compare log-probs of the same tokens from different passes.
fn lora_dropout_problem(
    trainer: TrainerKind,
    section: &str,
    lora: &crate::LoraOptions,
) -> Option<String> {
    (lora.is_on() && lora.dropout > 0.0 && trainer != TrainerKind::Sft).then(|| {
        format!(
            "{section}.dropout {} with trainer {trainer}: dropout trains SFT only; {trainer} \
             compares log-probs of the same tokens from different passes, which dropout would \
             make differ (TRL turns dropout off for it too); set {section}.dropout=0",
            lora.dropout
        )
    })
}

/// `training.zero_stage` of every role the job trains: 0 to 3, and 3 (parameters sharded
/// too, a LoRA model's frozen base included) for the policy of a PPO job only when not under
/// the hybrid engine (whose rollout would generate with the sharded weights).
fn zero_problems(cfg: &PpoConfig) -> Vec<String> {
    let trained: &[RoleKind] = match cfg.trainer {
        TrainerKind::Ppo => &[RoleKind::ActorRollout, RoleKind::Critic],
        TrainerKind::Sft | TrainerKind::Dpo => &[RoleKind::ActorRollout],
        TrainerKind::Reward => &[RoleKind::Reward],
    };
    let mut e = Vec::new();
    for &role in trained {
        let z = cfg.resolved(role).zero_stage;
        if z > 3 {
            e.push(format!(
                "{role}: training.zero_stage {z} is not a ZeRO stage: use 3 (parameters, gradients and AdamW state sharded across the role's data-parallel ranks), 2 (gradients and AdamW state), 1 (AdamW state only) or 0"
            ));
        } else if z != 3 && cfg.resolved(role).offload_params {
            e.push(format!(
                "{role}: training.offload_params keeps ZeRO-3's parameter pieces in host memory, and training.zero_stage is {z}; set training.zero_stage=3 or remove training.offload_params"
            ));
        } else if z == 3
            && role == RoleKind::ActorRollout
            && cfg.trainer == TrainerKind::Ppo
            && cfg.hybrid_engine()
        {
            e.push(format!(
                "{role}: training.zero_stage 3 shards the policy's weights across the trainer ranks, and the hybrid engine (resource_pool.colocate with actor_rollout.hybrid_engine) generates with the trainer's own weights; set actor_rollout.hybrid_engine=false (the rollout keeps a copy of its own on the same devices, synced after every update) or use zero_stage 2"
            ));
        }
    }
    e
}

fn stage_problems(cfg: &PpoConfig) -> Vec<String> {
    let mut e = Vec::new();
    let a = &cfg.actor_rollout;
    if cfg.trainer != TrainerKind::Reward {
        e.extend(a.lora.problems("actor_rollout.lora"));
        e.extend(lora_dropout_problem(
            cfg.trainer,
            "actor_rollout.lora",
            &a.lora,
        ));
    }
    let pool = &cfg.resource_pool;
    let trainer = cfg.trainer;
    let (role, ranks, ranks_key) = match trainer {
        TrainerKind::Reward => (RoleKind::Reward, pool.reward, "resource_pool.reward"),
        _ => (
            RoleKind::ActorRollout,
            a.num_gpus_for_train,
            "actor_rollout.num_gpus_for_train",
        ),
    };
    let t = cfg.resolved(role);
    for (key, v) in [
        ("training.global_batch_size", u64::from(t.global_batch_size)),
        ("training.train_iters", t.train_iters),
        ("training.micro_batch_size", u64::from(t.micro_batch_size)),
        (
            "actor_rollout.max_prompt_length",
            u64::from(a.max_prompt_length),
        ),
        (
            "actor_rollout.max_response_length",
            u64::from(a.max_response_length),
        ),
        (ranks_key, u64::from(ranks)),
    ] {
        if v == 0 {
            e.push(format!("trainer {trainer}: {key} must be > 0"));
        }
    }
    if ranks > 0 && !t.global_batch_size.is_multiple_of(ranks) {
        e.push(format!(
            "trainer {trainer}: training.global_batch_size ({}) is not divisible by {ranks_key} ({ranks}); every rank gets the same number of rows",
            t.global_batch_size
        ));
    }
    let total = u64::from(a.max_prompt_length) + u64::from(a.max_response_length);
    if u64::from(t.seq_length) < total {
        e.push(format!(
            "{role}: seq_length ({}) < actor_rollout.max_prompt_length + max_response_length = {total}; raise seq_length to at least {total}",
            t.seq_length
        ));
    }
    match trainer {
        TrainerKind::Reward
            if cfg.reward.kind != RewardKind::Model || cfg.reward.model.is_empty() =>
        {
            e.push("trainer reward trains reward.model: set reward.kind=model and reward.model to the model to start from (an SFT model; its score head starts fresh)".to_string());
        }
        TrainerKind::Reward => {}
        _ if !pool.colocate && pool.actor_rollout != a.num_gpus_for_train => {
            e.push(format!(
                "trainer {trainer} has no rollout ranks: resource_pool.actor_rollout ({}) must equal actor_rollout.num_gpus_for_train ({})",
                pool.actor_rollout, a.num_gpus_for_train
            ));
        }
        _ => {}
    }
    if trainer == TrainerKind::Dpo
        && cfg.algorithm.loss_type.needs_reference()
        && pool.ref_ == 0
        && !cfg.ref_in_trainer()
    {
        e.push(format!(
            "algorithm.loss_type {} needs the reference policy: set resource_pool.ref to at least 1 (or train LoRA adapters, whose base is the reference), or use loss_type simpo",
            cfg.algorithm.loss_type
        ));
    }
    e
}
