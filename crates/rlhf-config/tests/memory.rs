//! The per-device memory estimate of `rlhf-head check`: dtype, mixed precision, LM-head
//! chunking and activation checkpointing each move the numbers they should.

use std::path::{Path, PathBuf};

use rlhf_config::{load, MemoryRow, PpoConfig, RoleKind};

fn configs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs")
}

/// The 7B config with plain data-parallel trainers (it ships with ZeRO-3): what the
/// estimate's parts are checked against.
fn qwen7b(overrides: &[&str]) -> PpoConfig {
    let plain = [
        "training.zero_stage=0",
        "actor_rollout.offload_params=false",
    ];
    let o: Vec<String> = plain
        .iter()
        .chain(overrides)
        .map(|s| s.to_string())
        .collect();
    load(&configs(), "ppo_qwen25_7b", &o).unwrap()
}

fn row(cfg: &PpoConfig, label: &str) -> MemoryRow {
    cfg.memory_estimate()
        .into_iter()
        .find(|r| r.label == label)
        .unwrap_or_else(|| panic!("no row {label}"))
}

#[test]
fn memory_estimate_is_sane() {
    let q = qwen7b(&[]);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let train = row(&q, "actor_rollout/train");
    // 7.6 B parameters under bf16 mixed precision: f32 master weights (28.4 GiB) plus the
    // bf16 copy the forward computes with (14.2 GiB).
    assert!(
        (42.0..44.0).contains(&gib(train.weights)),
        "{}",
        gib(train.weights)
    );
    assert_eq!(train.weights, 6 * train.params);
    // f32 gradients, twice: a rank's mini-batch takes several micro-batches here, and the
    // running sum and one micro-batch's gradients exist together. One micro-batch per
    // mini-batch holds one set.
    assert_eq!(train.gradients, 8 * train.params);
    let per_rank = q.actor_rollout.ppo_mini_batch_size / q.actor_rollout.num_gpus_for_train;
    let one = qwen7b(&[&format!("training.micro_batch_size={per_rank}")]);
    assert_eq!(row(&one, "actor_rollout/train").gradients, 4 * train.params);
    assert_eq!(train.optimizer, 8 * train.params);
    // ZeRO stage 1 shares the moments among the trainer ranks; a role override applies to
    // that role only.
    let z = qwen7b(&["training.zero_stage=1"]);
    let ranks = u64::from(z.actor_rollout.num_gpus_for_train);
    assert!(ranks > 1);
    let zt = row(&z, "actor_rollout/train");
    assert_eq!(zt.optimizer, (8 * train.params).div_ceil(ranks));
    assert_eq!((zt.weights, zt.gradients), (train.weights, train.gradients));
    // Stage 2 also keeps only a share of the summed gradient: one whole micro-batch
    // gradient plus the share, against two whole ones while micro-batches accumulate.
    let z2 = row(&qwen7b(&["training.zero_stage=2"]), "actor_rollout/train");
    assert_eq!(z2.optimizer, zt.optimizer);
    assert_eq!(
        z2.gradients,
        4 * train.params + (4 * train.params).div_ceil(ranks)
    );
    assert!(z2.gradients < train.gradients);
    let zc = qwen7b(&["critic.zero_stage=1"]);
    assert_eq!(row(&zc, "actor_rollout/train").optimizer, train.optimizer);
    assert!(row(&zc, "critic").optimizer < row(&q, "critic").optimizer);
    // Offloaded moments leave the device.
    let off = qwen7b(&["training.offload_optimizer=true"]);
    assert_eq!(row(&off, "actor_rollout/train").optimizer, 0);
    assert_eq!(row(&off, "actor_rollout/train").gradients, train.gradients);
    let infer = row(&q, "actor_rollout/infer");
    // Frozen: bf16 weights. KV: 28 layers x 2 x 4 kv heads x 128 x 2048 tokens x 2 B for
    // each of the 256 sequences over 2 rollout ranks.
    assert_eq!(infer.weights, 2 * infer.params);
    assert_eq!(infer.kv_cache, 28 * 2 * 4 * 128 * 2048 * (256 / 2) * 2);
    assert_eq!(infer.optimizer, 0);
    let critic = row(&q, "critic");
    assert!(critic.params < train.params, "the critic has no LM head");
    // f32 everywhere: the frozen weights double, the trained ones lose the bf16 copy.
    let f = qwen7b(&["training.bf16=false"]);
    assert_eq!(row(&f, "actor_rollout/infer").weights, 2 * infer.weights);
    assert_eq!(row(&f, "actor_rollout/train").weights, 4 * train.params);
    // Activations grow with the micro batch.
    let big = qwen7b(&["actor_rollout.micro_batch_size=4"]);
    assert!(row(&big, "actor_rollout/train").activations > 3 * train.activations);

    // 7B plain data parallel does not fit an 80 GiB card: warned, not refused.
    let small = qwen7b(&["resource_pool.device_memory_gb=80"]);
    let warnings = small.memory_warnings();
    assert!(
        warnings.iter().any(|w| w.contains("actor_rollout/train")),
        "{warnings:?}"
    );
    let l = load(&configs(), "ppo_llama32_1b", &[]).unwrap();
    assert!(l.memory_warnings().is_empty(), "{:?}", l.memory_warnings());
}

#[test]
fn chunking_and_checkpointing_lower_the_activation_estimate() {
    let seq = ["actor_rollout.micro_batch_size=4"];
    let whole = qwen7b(&[seq[0], "training.logits_chunk_size=0"]);
    let chunked = qwen7b(&[seq[0], "training.logits_chunk_size=512"]);
    let both = qwen7b(&[
        seq[0],
        "training.logits_chunk_size=512",
        "training.gradient_checkpointing=true",
    ]);
    let v = 152_064u64; // Qwen2.5-7B's vocabulary
    let tokens = 4 * 2048u64;
    let (w, c, b) = (
        row(&whole, "actor_rollout/train").activations,
        row(&chunked, "actor_rollout/train").activations,
        row(&both, "actor_rollout/train").activations,
    );
    // The LM-head term: 3 f32 copies of the logits of the whole micro-batch, or of one chunk.
    assert_eq!(w - c, 3 * (tokens - 512) * v * 4);
    // Checkpointing keeps one [mb, s, h] input per layer instead of ~(34 + 5 a s / h) / 2.
    assert!(b * 10 < c, "checkpointed {b} vs plain {c}");
    // The critic has no LM head: chunking does not change it, checkpointing does.
    assert_eq!(
        row(&whole, "critic").activations,
        row(&chunked, "critic").activations
    );
    assert!(row(&both, "critic").activations < row(&chunked, "critic").activations);
    // The reference's forward holds two f32 copies of a chunk's logits.
    let r = |cfg: &PpoConfig| {
        cfg.memory_estimate()
            .into_iter()
            .find(|r| r.role == RoleKind::Ref)
            .unwrap()
            .activations
    };
    assert!(r(&chunked) < r(&whole));
}

#[test]
fn the_half_billion_config_fits_its_gpus_in_bf16() {
    let q = load(&configs(), "ppo_qwen25_05b", &[]).unwrap();
    let m = &q.models["qwen25_05b"];
    // Qwen2.5-0.5B: 494,032,768 parameters (q/k/v bias, tied head).
    assert_eq!(m.lm_params(), 494_032_768);
    assert!(q.training.bf16);
    assert_eq!(q.resource_pool.device, rlhf_config::DeviceKind::Gpu);
    assert!(q.memory_warnings().is_empty(), "{:?}", q.memory_warnings());
    let train = row(&q, "actor_rollout/train");
    // 22 bytes per parameter: f32 master + bf16 copy + f32 gradients (the running sum and
    // one micro-batch's) + two f32 moments.
    assert_eq!(
        train.weights + train.gradients + train.optimizer,
        22 * train.params
    );
}

/// `resource_pool.colocate`: every process of ppo_tiny (the actor's trainer hosting its
/// rollout, the reference, the critic) takes a third of the one device the plan needs.
#[test]
fn a_colocated_job_plans_shares_of_one_device() {
    let o = |v: &[&str]| -> Vec<String> { v.iter().map(|s| s.to_string()).collect() };
    let cfg = load(&configs(), "ppo_tiny", &o(&["resource_pool.colocate=true"])).unwrap();
    assert!(rlhf_config::problems(&cfg).is_empty());
    assert_eq!(cfg.colocated_devices(), 1);
    assert_eq!(cfg.role_bundles(RoleKind::ActorRollout), (1, 0.333));
    assert_eq!(cfg.role_bundles(RoleKind::Ref), (1, 0.333));
    assert_eq!(cfg.role_bundles(RoleKind::Reward).0, 0);
    let one = [(
        "n1".to_string(),
        std::collections::BTreeMap::from([("CPU".to_string(), 1.0)]),
    )];
    let plan = cfg.placement_plan(&one).unwrap();
    assert!(plan.to_string().contains("1 x 0.333"), "{plan}");
    // Without colocation the same job needs four slots.
    let plain = load(&configs(), "ppo_tiny", &[]).unwrap();
    let err = plain.placement_plan(&one).unwrap_err().to_string();
    assert!(err.contains("CPU"), "{err}");
    // Rollout ranks must match trainer ranks: each trainer hosts one.
    let bad = load(
        &configs(),
        "ppo_tiny",
        &o(&[
            "resource_pool.colocate=true",
            "resource_pool.actor_rollout=3",
            "actor_rollout.num_gpus_for_infer=2",
        ]),
    );
    let msg = match bad {
        Ok(c) => rlhf_config::problems(&c).join("\n"),
        Err(e) => e.to_string(),
    };
    assert!(msg.contains("num_gpus_for_infer (2) must equal"), "{msg}");
}

/// `actor_rollout.hybrid_engine=false`: a colocated job whose rollout ranks are processes of
/// their own on the shared devices. ppo_tiny's four processes (actor trainer, actor rollout,
/// reference, critic) take a quarter of its one device each; the rollout and the trainer
/// join the weights group (the sync goes between them); every phase counts the rollout's
/// copy of the weights; offload (which needs the trainer to generate) is refused by name.
#[test]
fn a_colocated_job_without_the_hybrid_engine_shares_the_device_with_rollout_processes() {
    let o = |v: &[&str]| -> Vec<String> { v.iter().map(|s| s.to_string()).collect() };
    let split = [
        "resource_pool.colocate=true",
        "actor_rollout.hybrid_engine=false",
    ];
    let cfg = load(&configs(), "ppo_tiny", &o(&split)).unwrap();
    assert!(rlhf_config::problems(&cfg).is_empty());
    assert!(!cfg.hybrid_engine());
    assert_eq!(cfg.colocated_devices(), 1);
    assert_eq!(cfg.role_processes(RoleKind::ActorRollout), 2);
    assert_eq!(cfg.role_bundles(RoleKind::ActorRollout), (2, 0.25));
    assert_eq!(cfg.role_bundles(RoleKind::Critic), (1, 0.25));
    let one = [(
        "n1".to_string(),
        std::collections::BTreeMap::from([("CPU".to_string(), 1.0)]),
    )];
    let plan = cfg.placement_plan(&one).unwrap();
    assert!(plan.to_string().contains("2 x 0.25"), "{plan}");

    let q = load(&configs(), "ppo_qwen25_05b", &o(&split)).unwrap();
    let hybrid = load(
        &configs(),
        "ppo_qwen25_05b",
        &o(&["resource_pool.colocate=true"]),
    )
    .unwrap();
    let infer = q
        .memory_estimate()
        .into_iter()
        .find(|r| r.label == "actor_rollout/infer")
        .unwrap();
    assert!(infer.weights > 0);
    for (a, b) in q.colocated_phases().iter().zip(hybrid.colocated_phases()) {
        assert_eq!(a.weights, b.weights + infer.weights, "{}", a.label);
    }

    let mut with_offload = split.to_vec();
    with_offload.push("actor_rollout.offload=true");
    let msg = match load(&configs(), "ppo_tiny", &o(&with_offload)) {
        Ok(c) => rlhf_config::problems(&c).join("\n"),
        Err(e) => e.to_string(),
    };
    assert!(
        msg.contains("actor_rollout.offload") && msg.contains("hybrid_engine"),
        "{msg}"
    );
}

/// `check` on a colocated job reports what one device holds in each phase: every role's
/// resident state (the rollout's weights are the trainer's, counted once) plus the phase's
/// transient part, and warns on the phases, not on roles that no longer have devices of
/// their own.
#[test]
fn a_colocated_job_is_estimated_per_phase() {
    let plain = load(&configs(), "ppo_qwen25_05b", &[]).unwrap();
    assert!(plain.colocated_phases().is_empty());
    let o = |v: &[&str]| -> Vec<String> { v.iter().map(|s| s.to_string()).collect() };
    let q = load(
        &configs(),
        "ppo_qwen25_05b",
        &o(&["resource_pool.colocate=true"]),
    )
    .unwrap();
    let phases = q.colocated_phases();
    let labels: Vec<&str> = phases.iter().map(|r| r.label.as_str()).collect();
    assert_eq!(
        labels,
        ["colocated/generate", "colocated/forward", "colocated/train"]
    );
    let roles = q.memory_estimate();
    let by = |l: &str| roles.iter().find(|r| r.label == l).unwrap().clone();
    let (train, infer, critic) = (
        by("actor_rollout/train"),
        by("actor_rollout/infer"),
        by("critic"),
    );
    let resident: u64 = roles
        .iter()
        .filter(|r| r.label != "actor_rollout/infer")
        .map(|r| r.weights + r.gradients + r.optimizer)
        .sum();
    let gen = &phases[0];
    assert_eq!(gen.weights + gen.gradients + gen.optimizer, resident);
    assert_eq!(gen.kv_cache, infer.kv_cache);
    assert_eq!(
        phases[2].activations,
        train.activations + critic.activations
    );
    assert!(phases.iter().all(|p| p.total() > train.total()));
    // On a 24 GiB card the phases do not fit; the warning names the phase.
    let small = load(
        &configs(),
        "ppo_qwen25_05b",
        &o(&[
            "resource_pool.colocate=true",
            "resource_pool.device_memory_gb=24",
        ]),
    )
    .unwrap();
    let w = small.memory_warnings();
    assert!(w.iter().any(|w| w.contains("colocated/")), "{w:?}");
    assert!(
        !w.iter().any(|w| w.contains("actor_rollout/infer")),
        "{w:?}"
    );
    let report = q.check_report(&[], false);
    assert!(report.contains("colocated/train"), "{report}");

    // actor_rollout.offload: the actor's optimizer state and gradients are off the device
    // while it generates, and only then.
    let off = load(
        &configs(),
        "ppo_qwen25_05b",
        &o(&["resource_pool.colocate=true", "actor_rollout.offload=true"]),
    )
    .unwrap();
    assert!(rlhf_config::problems(&off).is_empty());
    let offp = off.colocated_phases();
    assert_eq!(
        gen.total() - offp[0].total(),
        train.optimizer + train.gradients
    );
    assert!(train.optimizer > 0);
    assert_eq!(offp[2].total(), phases[2].total());
    // Without colocation there is no generation on the trainer's device to make room for.
    let lone = load(
        &configs(),
        "ppo_qwen25_05b",
        &o(&["actor_rollout.offload=true"]),
    );
    let msg = match lone {
        Ok(c) => rlhf_config::problems(&c).join("\n"),
        Err(e) => e.to_string(),
    };
    assert!(
        msg.contains("actor_rollout.offload") && msg.contains("resource_pool.colocate=true"),
        "{msg}"
    );
}

/// LoRA: the base is held frozen at the compute dtype and only the adapters train; the
/// reference of a LoRA actor is its base with the adapters off and costs nothing of its own.
#[test]
fn lora_trains_only_the_adapters_and_the_reference_is_free() {
    let full = qwen7b(&[]);
    let l = qwen7b(&[
        "actor_rollout.lora.rank=8",
        "actor_rollout.lora.target_modules=[q_proj,v_proj]",
        "critic.lora.rank=16",
    ]);
    let (ft, lt) = (
        row(&full, "actor_rollout/train"),
        row(&l, "actor_rollout/train"),
    );
    // Qwen2.5-7B: 28 layers, hidden 3584, 28 query / 4 KV heads of 128: q_proj 3584 -> 3584,
    // v_proj 3584 -> 512; r = 8.
    let a: u64 = 28 * 8 * ((3584 + 3584) + (3584 + 512));
    assert_eq!(lt.gradients, 8 * a); // several micro-batches per mini-batch
    assert_eq!(lt.optimizer, 8 * a);
    // bf16 base (2 bytes) plus the f32 master and bf16 copy of the adapters.
    assert_eq!(lt.weights, 2 * lt.params + 6 * a);
    assert!(
        lt.total() * 2 < ft.total(),
        "{} vs {}",
        lt.total(),
        ft.total()
    );
    let critic = row(&l, "critic");
    assert!(critic.optimizer < row(&full, "critic").optimizer / 50);
    let r = row(&l, "ref");
    assert_eq!(r.total(), 0);
    assert!(r.model.contains("adapters off"), "{}", r.model);
    assert!(l.ref_in_trainer() && !full.ref_in_trainer());
    // A reference model of its own is still loaded as one.
    let other = qwen7b(&["actor_rollout.lora.rank=8", "ref.model=qwen25_7b_rm"]);
    assert!(!other.ref_in_trainer());
}

/// The shipped LoRA config fits what it says: two 40 GB GPUs, every phase of a shared
/// device within device_memory_gb (the same 7B policy trained in full does not).
#[test]
fn the_7b_lora_config_fits_two_40gb_gpus() {
    let l = load(&configs(), "ppo_qwen25_7b_lora", &[]).unwrap();
    let warnings = l.memory_warnings();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(l.colocated_devices(), 2);
    let o = [
        "actor_rollout.lora.rank=0".into(),
        "resource_pool.ref=2".into(),
    ];
    let full = load(&configs(), "ppo_qwen25_7b_lora", &o).unwrap();
    assert!(!full.memory_warnings().is_empty());
}

/// The shipped 7B config fits what it says: one node of 8 x 80 GB GPUs with ZeRO-3 trainers
/// (the policy's pieces in host memory), every role within device_memory_gb; the same
/// layout with plain data-parallel trainers does not.
#[test]
fn the_7b_config_fits_eight_80gb_gpus_with_zero_3() {
    let q = load(&configs(), "ppo_qwen25_7b", &[]).unwrap();
    assert_eq!(q.resource_pool.device_memory_gb, 80.0);
    let devices: u32 = [
        RoleKind::ActorRollout,
        RoleKind::Ref,
        RoleKind::Critic,
        RoleKind::Reward,
    ]
    .into_iter()
    .map(|r| q.devices(r))
    .sum();
    assert_eq!(devices, 8);
    let warnings = q.memory_warnings();
    assert!(warnings.is_empty(), "{warnings:?}");
    for r in q.memory_estimate() {
        assert!(r.total() > 0, "{} has no estimate", r.label);
    }
    let plain = qwen7b(&[]);
    assert!(!plain.memory_warnings().is_empty());
}

/// ZeRO stage 3 (the SFT trainer): each rank holds its share of the weights and of the summed
/// gradient, plus what a pass gathers whole (the embeddings and LM head for the call, one
/// decoder layer), with the AdamW share of stages 1 and 2.
#[test]
fn zero_stage_3_shares_the_weights_and_the_gradients() {
    let sft = |stage: &[&str]| {
        let o: Vec<String> = [
            "trainer=sft",
            "actor_rollout.offload_params=false",
            "resource_pool.actor_rollout=8",
            "actor_rollout.num_gpus_for_train=8",
        ]
        .iter()
        .chain(stage)
        .map(|s| s.to_string())
        .collect();
        let cfg = load(&configs(), "ppo_qwen25_7b", &o).unwrap();
        row(&cfg, "actor_rollout/train")
    };
    let (z0, z1, z2, z3) = (
        sft(&["training.zero_stage=0"]),
        sft(&["training.zero_stage=1"]),
        sft(&["training.zero_stage=2"]),
        sft(&["training.zero_stage=3"]),
    );
    assert_eq!(z3.optimizer, z1.optimizer);
    assert!(z3.optimizer < z0.optimizer);
    // 7.6 B parameters on 8 ranks: an eighth of the (mixed-precision) weights, plus the
    // gathered edges (two 152k x 3584 matrices, 14 % of the model) with the all-gather's
    // buffer of them, and one of 28 layers with the next one gathered ahead.
    let share = z0.weights.div_ceil(8);
    assert!(
        z3.weights > share && z3.weights < share + z0.weights * 3 / 10,
        "{} vs {share}",
        z3.weights
    );
    assert!(
        z3.gradients < z2.gradients / 2,
        "{} vs {}",
        z3.gradients,
        z2.gradients
    );
    let total = |r: &MemoryRow| r.weights + r.gradients + r.optimizer;
    assert!(
        total(&z3) * 3 < total(&z0),
        "{} vs {}",
        total(&z3),
        total(&z0)
    );
    // `offload_params`: the pieces, their gradients and AdamW's moments leave the device;
    // what a pass gathers stays.
    let off = sft(&["training.zero_stage=3", "actor_rollout.offload_params=true"]);
    assert_eq!(off.optimizer, 0);
    assert!(off.weights > 0 && off.weights < z3.weights - share / 2);
    assert!(off.gradients > 0 && off.gradients < z3.gradients);
}

/// Stage 3 with LoRA (the seeds' 7B on two 40 GB cards): the frozen bf16 base is sharded too,
/// so each of two ranks holds half of it plus a gathered layer and the edges, where stage 2
/// holds all of it; the adapters' gradients and AdamW state stay small and sharded.
#[test]
fn zero_stage_3_with_lora_shares_the_frozen_base() {
    let at = |stage: &str| {
        let o: Vec<String> = [
            "trainer=sft",
            "resource_pool.actor_rollout=2",
            "actor_rollout.num_gpus_for_train=2",
            "actor_rollout.num_gpus_for_infer=0",
            stage,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let cfg = load(&configs(), "ppo_qwen25_7b_lora", &o).unwrap();
        row(&cfg, "actor_rollout/train")
    };
    let (z2, z3) = (at("training.zero_stage=2"), at("training.zero_stage=3"));
    // 7.6 B bf16 parameters: 15.2 GB whole, 7.6 GB a rank, plus what a pass gathers whole:
    // the edges (two 152k x 3584 matrices, 2.2 GB) with the all-gather's buffer of them, and
    // a layer with the next one.
    let base = z2.params * 2;
    let edges = 2 * 152_064 * 3_584 * 2;
    assert!(z2.weights > base, "{} vs {base}", z2.weights);
    assert!(
        z3.weights > base / 2 + 2 * edges && z3.weights < base / 2 + 3 * edges,
        "{} vs half of {base}",
        z3.weights
    );
    assert!(z3.weights < z2.weights, "{} vs {}", z3.weights, z2.weights);
    assert_eq!(
        z3.optimizer, z2.optimizer,
        "AdamW over the adapters, sharded"
    );
    assert!(
        z3.gradients <= z2.gradients,
        "{} vs {}",
        z3.gradients,
        z2.gradients
    );
    // The adapters are a small share: their gradients are far below the base.
    assert!(z3.gradients < base / 20, "{}", z3.gradients);
}

/// NCCL's own memory (`--comm-backend nccl`): 1 GiB per communicator of more than one rank
/// on a GPU. The actor's trainer rank 0 holds two (its data-parallel group and the weights
/// group to the rollout), a rollout rank one, a critic rank its data-parallel group's; a
/// group of one holds none; TCP and shared memory hold nothing on the device.
#[test]
fn nccl_communicators_are_counted_on_the_gpus_that_hold_them() {
    use rlhf_config::{Collectives, NCCL_COMM_BYTES};
    let q = qwen7b(&[]);
    assert!(q.actor_rollout.num_gpus_for_train > 1 && q.resource_pool.critic > 1);
    let rows = |cfg: &PpoConfig, c: Collectives| {
        cfg.memory_estimate_with(c)
            .into_iter()
            .map(|r| (r.label.clone(), r))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let host = rows(&q, Collectives::Host);
    let nccl = rows(&q, Collectives::Nccl);
    assert!(host.values().all(|r| r.comm == 0), "{host:?}");
    assert_eq!(nccl["actor_rollout/train"].comm, 2 * NCCL_COMM_BYTES);
    assert_eq!(nccl["actor_rollout/infer"].comm, NCCL_COMM_BYTES);
    assert_eq!(nccl["critic"].comm, NCCL_COMM_BYTES);
    assert_eq!(nccl["ref"].comm, 0);
    for (label, r) in &nccl {
        assert_eq!(
            r.total(),
            host[label].total() + r.comm,
            "{label}: the communicators add to the total"
        );
    }
    // One trainer rank: no data-parallel communicator, only the weights group.
    let one = qwen7b(&[
        "actor_rollout.num_gpus_for_train=1",
        "resource_pool.actor_rollout=3",
        "resource_pool.critic=1",
    ]);
    let one = rows(&one, Collectives::Nccl);
    assert_eq!(one["actor_rollout/train"].comm, NCCL_COMM_BYTES);
    assert_eq!(one["critic"].comm, 0);
    // The report shows the column and its verdict counts it.
    let report = q.check_report_with(&[], false, Collectives::Nccl);
    assert!(report.contains("nccl"), "{report}");
    assert!(report.contains("1 GiB per NCCL communicator"), "{report}");
    assert!(!q.check_report(&[], false).contains("per NCCL communicator"));
}
