//! `trainer`: which roles each stage runs and which engine each rank gets, the DPO/RM keys'
//! checks, and the refusal of the stages whose job loop does not exist yet.

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
fn stage_keys_are_checked_and_stages_without_a_loop_are_refused() {
    let err = tiny(&["trainer=sft"]).unwrap_err().to_string();
    assert!(
        err.contains("trainer: sft cannot run as a job yet") && err.contains("trainer: ppo"),
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
