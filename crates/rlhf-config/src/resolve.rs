//! What a loaded config resolves to beyond its sections: each role's training settings
//! (`training` with the role's overrides), its model (a `defaults` name, a directory or a
//! Hugging Face repo id, with the architecture when known), and paths made absolute against
//! the directory a run starts from.

use std::path::PathBuf;

use crate::config::{PpoConfig, RewardKind, RoleKind, TrainerKind, TrainingConfig};
use crate::model::ModelConfig;

/// Where a role's model comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct RoleModel {
    /// The name as written in the config (a `defaults` name or a path).
    pub name: String,
    /// HF model directory, when known.
    pub path: Option<PathBuf>,
    /// Architecture, when known (from `defaults` or the directory's config.json).
    pub arch: Option<ModelConfig>,
}

impl PpoConfig {
    /// Training settings of a role: `training` with the role's overrides applied.
    pub fn resolved(&self, role: RoleKind) -> TrainingConfig {
        let o = match role {
            RoleKind::ActorRollout => &self.actor_rollout.overrides,
            RoleKind::Ref => &self.ref_.overrides,
            RoleKind::Critic => &self.critic.overrides,
            RoleKind::Reward => &self.reward.overrides,
        };
        self.training.merged(o)
    }

    /// Prompts per step (`training.global_batch_size` as the actor resolves it).
    pub fn prompts_per_step(&self) -> u32 {
        self.resolved(RoleKind::ActorRollout).global_batch_size
    }

    /// Sequences per step: prompts per step × `actor_rollout.num_samples_per_step`.
    pub fn rollout_batch_size(&self) -> u64 {
        self.actor_rollout
            .rollout_batch_size(self.prompts_per_step())
    }

    /// Seed of the prompt shuffle: `data.seed`, else `training.seed`.
    pub fn data_seed(&self) -> u64 {
        self.data.seed.unwrap_or(self.training.seed)
    }

    /// Devices the resource pool gives a role.
    pub fn devices(&self, role: RoleKind) -> u32 {
        match role {
            RoleKind::ActorRollout => self.resource_pool.actor_rollout,
            RoleKind::Ref => self.resource_pool.ref_,
            RoleKind::Critic => self.resource_pool.critic,
            RoleKind::Reward => self.resource_pool.reward,
        }
    }

    /// A role's processes that hold devices (one bundle each): its ranks, except that
    /// colocated rollout ranks live in the trainer processes; 0 for a role without devices
    /// (a rule or HTTP reward, whose one process runs on the node's CPU).
    pub fn role_processes(&self, role: RoleKind) -> u32 {
        if !self.role_enabled(role) {
            return 0;
        }
        match role {
            // The other stages have trainer ranks only.
            RoleKind::ActorRollout if self.hybrid_engine() || self.trainer != TrainerKind::Ppo => {
                self.actor_rollout.num_gpus_for_train.max(1)
            }
            RoleKind::Ref if self.ref_in_trainer() => 0,
            _ => self.devices(role),
        }
    }

    /// Whether the rollout ranks are the actor trainer processes, generating with their
    /// weights (`resource_pool.colocate` with `actor_rollout.hybrid_engine`, the default).
    /// A colocated job without it shares the devices but keeps rollout processes of its own,
    /// which receive the weights after every update.
    pub fn hybrid_engine(&self) -> bool {
        self.resource_pool.colocate && self.actor_rollout.hybrid_engine
    }

    /// With LoRA on the actor and no other reference model, the reference policy is the
    /// actor's base with the adapters switched off: each actor trainer rank serves it from
    /// its own weights, so the reference has no process, device or copy of its own
    /// (`resource_pool.ref` goes unused).
    pub fn ref_in_trainer(&self) -> bool {
        self.actor_rollout.lora.is_on()
            && (self.ref_.model.is_empty() || self.ref_.model == self.actor_rollout.model)
    }

    /// Devices a colocated job uses in all: the largest role's (without the hybrid engine,
    /// the actor's trainer and rollout ranks count apart: rank i of each shares a device).
    pub fn colocated_devices(&self) -> u32 {
        RoleKind::ALL
            .iter()
            .map(|&r| match r {
                RoleKind::ActorRollout
                    if !self.hybrid_engine() && self.trainer == TrainerKind::Ppo =>
                {
                    let a = &self.actor_rollout;
                    a.num_gpus_for_train.max(a.num_gpus_for_infer).max(1)
                }
                _ => self.role_processes(r),
            })
            .max()
            .unwrap_or(0)
            .max(1)
    }

    /// How a role is placed: the number of bundles (one per process) and the amount of
    /// `resource_pool.device` each holds: 1, or under `colocate` the share of a device that
    /// spreads every process of the job evenly over [`PpoConfig::colocated_devices`]
    /// (rounded down to a thousandth, so the shares of one device never add up past 1).
    pub fn role_bundles(&self, role: RoleKind) -> (u32, f64) {
        let n = self.role_processes(role);
        if !self.resource_pool.colocate {
            return (n, 1.0);
        }
        let total: u32 = RoleKind::ALL.iter().map(|&r| self.role_processes(r)).sum();
        let share = f64::from(self.colocated_devices()) / f64::from(total.max(1));
        (n, ((share * 1000.0).floor() / 1000.0).clamp(0.001, 1.0))
    }

    /// Whether the job runs this role at all (no critic without GAE, no reward
    /// model process needed for devices when the reward is a rule or HTTP).
    pub fn role_enabled(&self, role: RoleKind) -> bool {
        match (self.trainer, role) {
            (TrainerKind::Ppo, RoleKind::Critic) => self.algorithm.adv_estimator.needs_critic(),
            (TrainerKind::Ppo, _) => true,
            (TrainerKind::Sft, r) => r == RoleKind::ActorRollout,
            (TrainerKind::Reward, r) => r == RoleKind::Reward,
            (TrainerKind::Dpo, RoleKind::ActorRollout) => true,
            (TrainerKind::Dpo, RoleKind::Ref) => self.algorithm.loss_type.needs_reference(),
            (TrainerKind::Dpo, _) => false,
        }
    }

    /// The model a role loads, resolved against `defaults` (empty names of
    /// ref and critic fall back to the actor's model). `None` for a reward
    /// that is not a model.
    pub fn role_model(&self, role: RoleKind) -> Option<RoleModel> {
        let name = match role {
            RoleKind::ActorRollout => self.actor_rollout.model.clone(),
            RoleKind::Ref if self.ref_.model.is_empty() => self.actor_rollout.model.clone(),
            RoleKind::Ref => self.ref_.model.clone(),
            RoleKind::Critic if self.critic.model.is_empty() => self.actor_rollout.model.clone(),
            RoleKind::Critic => self.critic.model.clone(),
            RoleKind::Reward if self.reward.kind != RewardKind::Model => return None,
            RoleKind::Reward => self.reward.model.clone(),
        };
        if name.is_empty() {
            return None;
        }
        if let Some(m) = self.models.get(&name) {
            return Some(RoleModel {
                name,
                path: m.path.as_ref().map(PathBuf::from),
                arch: Some(m.clone()),
            });
        }
        let path = PathBuf::from(&name);
        let arch = ModelConfig::from_hf_dir(&cached_dir(&path)).ok();
        Some(RoleModel {
            name,
            path: Some(path),
            arch,
        })
    }

    /// The resolved config as YAML (what `check` prints).
    pub fn to_yaml(&self) -> String {
        serde_norway::to_string(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }

    /// The resolved config as YAML without what this job's trainer never reads: the sections
    /// of roles it does not run, and the `algorithm` keys of the other trainers (a PPO job
    /// shows no DPO `beta`).
    pub fn to_yaml_used(&self) -> String {
        use serde_norway::Value;
        let mut v = match serde_norway::to_value(self) {
            Ok(v) => v,
            Err(e) => return format!("# cannot render config: {e}\n"),
        };
        const PREFERENCE: [&str; 6] = [
            "loss_type",
            "beta",
            "label_smoothing",
            "simpo_gamma",
            "desirable_weight",
            "undesirable_weight",
        ];
        const REWARD_MODEL: [&str; 1] = ["center_rewards_coefficient"];
        if let Value::Mapping(top) = &mut v {
            for role in RoleKind::ALL {
                if !self.role_enabled(role) {
                    top.remove(role.as_str());
                }
            }
            let keep: Option<&[&str]> = match self.trainer {
                TrainerKind::Ppo => None,
                TrainerKind::Dpo => Some(&PREFERENCE),
                TrainerKind::Reward => Some(&REWARD_MODEL),
                TrainerKind::Sft => Some(&[]),
            };
            if let Some(Value::Mapping(alg)) = top.get_mut("algorithm") {
                alg.retain(|k, _| {
                    let k = k.as_str().unwrap_or_default();
                    match keep {
                        Some(keep) => keep.contains(&k),
                        None => !PREFERENCE.contains(&k) && !REWARD_MODEL.contains(&k),
                    }
                });
                if alg.is_empty() {
                    top.remove("algorithm");
                }
            }
        }
        serde_norway::to_string(&v).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }
}

/// Where `config.json` of a model path is on this machine, without downloading: the
/// directory itself, or the cached snapshot of a Hub repo id (the directory as given when
/// the cache does not hold it, so that reading it fails as before).
fn cached_dir(path: &std::path::Path) -> PathBuf {
    let located = path
        .to_str()
        .map(|s| rlhf_hub::Hub::from_env().locate(s, rlhf_hub::Need::Config));
    match located {
        Some(Ok(rlhf_hub::Located::Cached { dir, .. })) => dir,
        _ => path.to_path_buf(),
    }
}

impl PpoConfig {
    /// Makes every file path of the job absolute against `base` (the directory the job was
    /// started from), so the config means the same thing in a role process, in a job the
    /// head runs, or on another node with the same shared filesystem. Model names that are
    /// keys of `models` (from `defaults`) are left alone; their `path` is resolved instead.
    /// A model or tokenizer path that does not exist under `base` but is a Hugging Face repo
    /// id (`owner/name[@revision]`) stays the id: each role process resolves it through its
    /// own node's HF cache.
    pub fn absolutize_paths(&mut self, base: &std::path::Path) {
        fn abs(base: &std::path::Path, p: &mut String) {
            if !p.is_empty() && std::path::Path::new(p.as_str()).is_relative() {
                *p = base.join(p.as_str()).to_string_lossy().into_owned();
            }
        }
        fn abs_or_repo_id(base: &std::path::Path, p: &mut String) {
            if !rlhf_hub::is_repo_id(p) || base.join(p.as_str()).exists() {
                abs(base, p);
            }
        }
        let models: Vec<String> = self.models.keys().cloned().collect();
        let model = |p: &mut String| {
            if !models.contains(p) {
                abs_or_repo_id(base, p);
            }
        };
        model(&mut self.actor_rollout.model);
        model(&mut self.ref_.model);
        model(&mut self.critic.model);
        model(&mut self.reward.model);
        for m in self.models.values_mut() {
            if let Some(p) = m.path.as_mut() {
                abs_or_repo_id(base, p);
            }
        }
        if let Some(p) = self.training.tokenizer_name_or_path.as_mut() {
            abs_or_repo_id(base, p);
        }
        for o in [
            &mut self.actor_rollout.overrides,
            &mut self.ref_.overrides,
            &mut self.critic.overrides,
            &mut self.reward.overrides,
        ] {
            if let Some(Some(p)) = o.tokenizer_name_or_path.as_mut() {
                abs_or_repo_id(base, p);
            }
        }
        if let Some(p) = self.actor_rollout.fixed_responses_file.as_mut() {
            abs(base, p);
        }
        abs(base, &mut self.data.path);
        if let Some(p) = self.data.eval_path.as_mut() {
            abs(base, p);
        }
        abs(base, &mut self.checkpoint.dir);
        if let Some(p) = self.checkpoint.resume.as_mut() {
            if p != "latest" {
                abs(base, p);
            }
        }
        abs(base, &mut self.logging.metrics_file);
        abs(base, &mut self.logging.samples_file);
        abs(base, &mut self.logging.tensorboard_dir);
    }
}

#[cfg(test)]
mod absolutize_tests {
    #[test]
    fn relative_paths_become_absolute_and_model_names_stay() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let mut cfg = crate::load(&dir, "ppo_tiny", &[]).unwrap();
        cfg.absolutize_paths(std::path::Path::new("/base"));
        // No /base/models/tiny: the name stays, as a Hugging Face repo id would.
        assert_eq!(cfg.actor_rollout.model, "models/tiny");
        assert_eq!(cfg.data.path, "/base/data/prompts_tiny.jsonl");
        assert_eq!(cfg.checkpoint.dir, "/base/checkpoints/ppo_tiny");
        assert_eq!(
            cfg.logging.metrics_file,
            "/base/logs/ppo_tiny/metrics.jsonl"
        );
        assert_eq!(
            cfg.training.tokenizer_name_or_path.as_deref(),
            Some("models/tiny")
        );
        // Under the repository root models/tiny exists, and becomes absolute.
        let root = dir.join("..");
        let mut cfg = crate::load(&dir, "ppo_tiny", &[]).unwrap();
        cfg.absolutize_paths(&root);
        assert_eq!(
            std::path::Path::new(&cfg.actor_rollout.model),
            root.join("models/tiny")
        );
        assert_eq!(
            cfg.training
                .tokenizer_name_or_path
                .map(std::path::PathBuf::from),
            Some(root.join("models/tiny"))
        );
        let mut big = crate::load(&dir, "ppo_llama32_1b", &[]).unwrap();
        let names: Vec<String> = big.models.keys().cloned().collect();
        big.absolutize_paths(std::path::Path::new("/base"));
        if names.contains(&big.actor_rollout.model) {
            assert!(!big.actor_rollout.model.starts_with("/base"));
        }
        for m in big.models.values() {
            if let Some(p) = &m.path {
                assert!(
                    std::path::Path::new(p).is_absolute() || rlhf_hub::is_repo_id(p),
                    "{p}"
                );
            }
        }
    }

    #[test]
    fn hub_repo_ids_stay_ids_and_paths_that_are_not_ids_become_absolute() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let mut cfg = crate::load(
            &dir,
            "ppo_tiny",
            &[
                "actor_rollout.model=Qwen/Qwen2.5-0.5B-Instruct".to_string(),
                "ref.model=Qwen/Qwen2.5-0.5B-Instruct@v1.0".to_string(),
                "critic.model=../critic".to_string(),
                "training.tokenizer_name_or_path=gpt2".to_string(),
            ],
        )
        .unwrap();
        cfg.absolutize_paths(std::path::Path::new("/base"));
        assert_eq!(cfg.actor_rollout.model, "Qwen/Qwen2.5-0.5B-Instruct");
        assert_eq!(cfg.ref_.model, "Qwen/Qwen2.5-0.5B-Instruct@v1.0");
        assert_eq!(cfg.critic.model, "/base/../critic");
        assert_eq!(cfg.training.tokenizer_name_or_path.as_deref(), Some("gpt2"));
        // A relative directory that exists under the base wins over the id reading.
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(tmp.path().join("Qwen/Qwen2.5-0.5B-Instruct")).unwrap();
        let mut cfg = crate::load(
            &dir,
            "ppo_tiny",
            &["actor_rollout.model=Qwen/Qwen2.5-0.5B-Instruct".to_string()],
        )
        .unwrap();
        cfg.absolutize_paths(tmp.path());
        assert_eq!(
            std::path::Path::new(&cfg.actor_rollout.model),
            tmp.path().join("Qwen/Qwen2.5-0.5B-Instruct")
        );
    }
}
