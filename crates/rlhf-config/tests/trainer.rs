//! `trainer`: which roles each stage runs and which engine each rank gets, the checks of the
//! stages' shapes and of the DPO/RM keys, and each stage's memory rows.

use std::path::Path;

use rlhf_config::{load, EngineSpec, PpoConfig, RoleKind, RoleSpec, TrainerKind};
use rlhf_core::{RolePart, RoleSlot};

fn tiny(overrides: &[&str]) -> rlhf_config::Result<PpoConfig> {
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    load(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs"),
        "ppo_tiny",
        &o,
    )
}

fn engine(cfg: &PpoConfig, kind: RoleKind, part: RolePart) -> rlhf_config::Result<EngineSpec> {
    let slot = RoleSlot {
        kind,
        part,
        rank: 0,
        world_size: 2,
    };
    Ok(RoleSpec::resolve(cfg, slot)?.engine)
}

#[test]
fn each_stage_runs_its_roles_with_its_engine() {
    let mut cfg = tiny(&[]).unwrap();
    assert_eq!(cfg.trainer, TrainerKind::Ppo);
    cfg.trainer = TrainerKind::Sft;
    let on = |cfg: &PpoConfig| -> Vec<RoleKind> {
        RoleKind::ALL
            .into_iter()
            .filter(|r| cfg.role_enabled(*r))
            .collect()
    };
    assert_eq!(on(&cfg), [RoleKind::ActorRollout]);
    let e = engine(&cfg, RoleKind::ActorRollout, RolePart::Train).unwrap();
    let EngineSpec::Sft { train } = e else {
        panic!("{e:?}")
    };
    // One optimizer step per step: the global batch, split over the 2 ranks.
    assert_eq!(train.epochs, 1);
    assert_eq!(
        train.mini_batch_rows,
        cfg.training.global_batch_size as usize / 2
    );
    let err = engine(&cfg, RoleKind::ActorRollout, RolePart::Infer)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no rollout ranks"), "{err}");

    cfg.trainer = TrainerKind::Dpo;
    cfg.algorithm.beta = 0.3;
    assert_eq!(on(&cfg), [RoleKind::ActorRollout, RoleKind::Ref]);
    match engine(&cfg, RoleKind::ActorRollout, RolePart::Train).unwrap() {
        EngineSpec::Preference { loss, .. } => assert_eq!(loss.beta, 0.3),
        e => panic!("{e:?}"),
    }
    cfg.algorithm.loss_type = rlhf_algo::PreferenceLoss::Simpo;
    assert_eq!(on(&cfg), [RoleKind::ActorRollout], "SimPO has no reference");

    cfg.trainer = TrainerKind::Reward;
    cfg.reward.kind = rlhf_config::RewardKind::Model;
    cfg.reward.model = cfg.actor_rollout.model.clone();
    assert_eq!(on(&cfg), [RoleKind::Reward]);
    let spec = RoleSpec::resolve(
        &cfg,
        RoleSlot {
            kind: RoleKind::Reward,
            part: RolePart::Whole,
            rank: 0,
            world_size: 1,
        },
    )
    .unwrap();
    assert!(matches!(spec.engine, EngineSpec::RewardModel { .. }));
    assert_eq!(spec.comms, [rlhf_core::CommGroup::RewardDp]);
}

#[test]
fn memory_rows_follow_the_stage() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let tiny = root.join("models/tiny").display().to_string();
    let load = |name: &str| {
        let mut cfg = load(&root.join("configs"), name, &[]).unwrap();
        // The architecture comes from config.json: the model by its absolute path.
        for m in [
            &mut cfg.actor_rollout.model,
            &mut cfg.ref_.model,
            &mut cfg.critic.model,
            &mut cfg.reward.model,
        ] {
            if m.as_str() == "models/tiny" {
                *m = tiny.clone();
            }
        }
        cfg
    };
    let labels = |cfg: &PpoConfig| -> Vec<String> {
        cfg.memory_estimate().into_iter().map(|r| r.label).collect()
    };
    // No rollout rows: the other stages have trainer ranks only.
    assert_eq!(labels(&load("dpo_tiny")).len(), 2);
    assert_eq!(labels(&load("sft_tiny")).len(), 1);
    let actor_rows = |cfg: &PpoConfig| {
        cfg.memory_estimate()
            .into_iter()
            .filter(|r| r.role == RoleKind::ActorRollout)
            .count()
    };
    assert_eq!(actor_rows(&load("ppo_tiny")), 2);
    assert_eq!(actor_rows(&load("dpo_tiny")), 1);
    let rm = load("rm_tiny").memory_estimate();
    assert_eq!(rm.len(), 1);
    assert!(rm[0].gradients > 0 && rm[0].optimizer > 0, "{:?}", rm[0]);
    let ppo = load("ppo_tiny").memory_estimate();
    let reward = ppo.iter().find(|r| r.label == "reward");
    assert!(reward.is_none_or(|r| r.gradients == 0));
}

#[test]
fn stage_keys_and_shapes_are_checked() {
    // ppo_tiny's actor has a rollout rank: not a shape for SFT.
    let err = tiny(&["trainer=sft"]).unwrap_err().to_string();
    assert!(
        err.contains("trainer sft has no rollout ranks: resource_pool.actor_rollout (2)"),
        "{err}"
    );
    assert!(tiny(&["trainer=sft", "resource_pool.actor_rollout=1"]).is_ok());
    let err = tiny(&["trainer=reward"]).unwrap_err().to_string();
    assert!(err.contains("reward.kind=model"), "{err}");
    let err = tiny(&[
        "trainer=dpo",
        "resource_pool.actor_rollout=1",
        "resource_pool.ref=0",
    ])
    .unwrap_err()
    .to_string();
    assert!(err.contains("needs the reference policy"), "{err}");
    // LoRA dropout trains SFT only; PPO and DPO refuse it by key, and a bad value is named.
    let sft = ["trainer=sft", "resource_pool.actor_rollout=1"];
    let lora = [
        "actor_rollout.lora.rank=8",
        "actor_rollout.lora.dropout=0.1",
    ];
    assert!(tiny(&[&sft[..], &lora[..]].concat()).is_ok());
    let err = tiny(&lora).unwrap_err().to_string();
    assert!(
        err.contains("actor_rollout.lora.dropout 0.1 with trainer ppo")
            && err.contains("actor_rollout.lora.dropout=0"),
        "{err}"
    );
    let err = tiny(&["critic.lora.rank=8", "critic.lora.dropout=0.05"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("critic.lora.dropout 0.05 with trainer ppo"),
        "{err}"
    );
    let dpo = [
        "trainer=dpo",
        "resource_pool.actor_rollout=1",
        lora[0],
        lora[1],
    ];
    let err = tiny(&dpo).unwrap_err().to_string();
    assert!(err.contains("with trainer dpo"), "{err}");
    let err = tiny(
        &[
            &sft[..],
            &[
                "actor_rollout.lora.rank=8",
                "actor_rollout.lora.dropout=1.0",
            ],
        ]
        .concat(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("actor_rollout.lora: dropout must be in [0, 1)"),
        "{err}"
    );
    // ZeRO: every stage is built for every trained role, with or without LoRA; 3 for the
    // PPO policy without the hybrid engine; the rest is refused by key and role.
    assert!(tiny(&["training.zero_stage=1"]).is_ok());
    assert!(tiny(&["training.zero_stage=2"]).is_ok());
    assert!(tiny(&["training.zero_stage=3"]).is_ok());
    assert!(tiny(&["critic.zero_stage=3"]).is_ok());
    for name in ["dpo_tiny", "rm_tiny"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let cfg = load(&dir, name, &["training.zero_stage=3".to_string()]);
        assert!(cfg.is_ok(), "{name}: {:?}", cfg.err());
    }
    assert!(tiny(&[
        "training.zero_stage=3",
        "resource_pool.colocate=true",
        "actor_rollout.hybrid_engine=false"
    ])
    .is_ok());
    let err = tiny(&["training.zero_stage=3", "resource_pool.colocate=true"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("actor_rollout: training.zero_stage 3 shards the policy's weights")
            && err.contains("set actor_rollout.hybrid_engine=false"),
        "{err}"
    );
    // The critic is not the hybrid engine's concern.
    assert!(tiny(&["critic.zero_stage=3", "resource_pool.colocate=true"]).is_ok());
    let err = tiny(&["training.zero_stage=4"]).unwrap_err().to_string();
    assert!(err.contains("zero_stage 4 is not a ZeRO stage"), "{err}");
    let sft_ranks = ["trainer=sft", "resource_pool.actor_rollout=1"];
    assert!(tiny(&[&sft_ranks[..], &["training.zero_stage=3"]].concat()).is_ok());
    assert!(tiny(
        &[
            &sft_ranks[..],
            &["training.zero_stage=3", "actor_rollout.lora.rank=8"],
        ]
        .concat(),
    )
    .is_ok());
    assert!(tiny(&["critic.zero_stage=3", "critic.lora.rank=8"]).is_ok());
    let err = tiny(&[&sft_ranks[..], &["training.offload_params=true"]].concat())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("training.offload_params keeps ZeRO-3's parameter pieces"),
        "{err}"
    );
    assert!(tiny(
        &[
            &sft_ranks[..],
            &["training.zero_stage=3", "training.offload_params=true"]
        ]
        .concat()
    )
    .is_ok());
    // Packing is SFT's: refused by key for PPO and the pair trainers.
    for t in ["trainer=ppo", "trainer=dpo"] {
        let err = tiny(&[t, "data.packing=true", "resource_pool.actor_rollout=1"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("data.packing packs SFT examples"),
            "{t}: {err}"
        );
    }
    assert!(tiny(&[
        "trainer=sft",
        "resource_pool.actor_rollout=1",
        "data.packing=true"
    ])
    .is_ok());
    let err = tiny(&[
        "trainer=sft",
        "resource_pool.actor_rollout=3",
        "actor_rollout.num_gpus_for_train=3",
    ])
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("not divisible by actor_rollout.num_gpus_for_train (3)"),
        "{err}"
    );
    let err = tiny(&["trainer=rm"]).unwrap_err().to_string();
    assert!(err.contains("trainer"), "{err}");
    let err = tiny(&["algorithm.beta=0"]).unwrap_err().to_string();
    assert!(err.contains("algorithm.beta"), "{err}");
    let err = tiny(&["algorithm.loss_type=kto", "algorithm.label_smoothing=0.1"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("algorithm.label_smoothing"), "{err}");
    let err = tiny(&["algorithm.loss_type=orpo"]).unwrap_err().to_string();
    assert!(err.contains("orpo") && err.contains("simpo"), "{err}");
}
