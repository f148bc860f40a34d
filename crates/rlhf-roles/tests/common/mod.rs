//! Shared test fixtures: configs over the tiny models of rlhf-model and synthetic batches.
#![allow(dead_code)]

use std::path::PathBuf;

use rlhf_config::PpoConfig;
use rlhf_core::batch::{DataBatch, TensorData};
use rlhf_roles::weights::host_params;

pub mod peak;
pub mod serve;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../rlhf-model/tests/fixtures")
        .join(name)
}

pub const P: usize = 6;
pub const R: usize = 5;

/// A config over tiny-llama with an SGD-like AdamW (eps 1.0): Adam's first step is
/// sign(g) * lr for a small eps, which would hide how the gradients were combined.
pub fn config() -> PpoConfig {
    let mut cfg = PpoConfig::default();
    cfg.resource_pool.device = rlhf_config::DeviceKind::Cpu;
    let model = fixture("tiny-llama").display().to_string();
    cfg.actor_rollout.model = model.clone();
    cfg.ref_.model = model.clone();
    cfg.critic.model = model;
    cfg.actor_rollout.max_prompt_length = P as u32;
    cfg.actor_rollout.max_response_length = R as u32;
    cfg.actor_rollout.ppo_mini_batch_size = 8;
    cfg.actor_rollout.ppo_epochs = 1;
    cfg.actor_rollout.shuffle_minibatch = false;
    cfg.actor_rollout.do_sample = false;
    cfg.actor_rollout.temperature = 1.0;
    cfg.critic.critic_mini_batch_size = 8;
    cfg.critic.critic_update_epochs = 1;
    cfg.critic.shuffle_minibatch = false;
    cfg.training.micro_batch_size = 2;
    cfg.training.global_batch_size = 8;
    cfg.actor_rollout.num_samples_per_step = 1;
    cfg.training.lr = 0.5;
    cfg.training.adam_eps = 1.0;
    cfg.training.weight_decay = 0.0;
    cfg.training.clip_grad = 1.0;
    cfg.training.seed = 7;
    cfg.training.train_iters = 10;
    cfg
}

/// Tiny deterministic pseudo-random numbers.
pub struct Lcg(pub u64);
impl Lcg {
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    pub fn unit(&mut self) -> f32 {
        (self.next() % 10_000) as f32 / 10_000.0
    }
}

/// `rows` sequences [P+R]: prompts of 2..=P tokens left-padded, responses of the given
/// lengths right-padded; ids in 1..320.
pub fn sequences(resp_lens: &[usize], seed: u64) -> DataBatch {
    let mut rng = Lcg(seed);
    let b = resp_lens.len();
    let t = P + R;
    let mut ids = vec![0i64; b * t];
    let mut am = vec![0i64; b * t];
    let mut rm = vec![0f32; b * R];
    for (i, &rl) in resp_lens.iter().enumerate() {
        let pl = 2 + (rng.next() as usize) % (P - 1);
        for j in P - pl..P {
            ids[i * t + j] = 1 + (rng.next() % 319) as i64;
            am[i * t + j] = 1;
        }
        for k in 0..rl {
            ids[i * t + P + k] = 1 + (rng.next() % 319) as i64;
            am[i * t + P + k] = 1;
            rm[i * R + k] = 1.0;
        }
    }
    DataBatch::new()
        .with_tensor("input_ids", TensorData::from_i64(vec![b, t], &ids).unwrap())
        .with_tensor(
            "attention_mask",
            TensorData::from_i64(vec![b, t], &am).unwrap(),
        )
        .with_tensor(
            "response_mask",
            TensorData::from_f32(vec![b, R], &rm).unwrap(),
        )
}

/// An UpdateActor batch: old log-probs from `log_probs` shifted a little (so the ratio is
/// not 1 everywhere) and mixed-sign advantages.
pub fn actor_batch(seqs: &DataBatch, log_probs: &[f32], seed: u64) -> DataBatch {
    let mut rng = Lcg(seed);
    let b = seqs.len().unwrap();
    let old: Vec<f32> = log_probs
        .iter()
        .map(|&x| x + (rng.unit() - 0.5) * 0.3)
        .collect();
    let w = log_probs.len() / b;
    let adv: Vec<f32> = (0..b * w).map(|_| (rng.unit() - 0.5) * 2.0).collect();
    let mut out = seqs.clone();
    out.tensors.insert(
        "old_log_probs".into(),
        TensorData::from_f32(vec![b, w], &old).unwrap(),
    );
    out.tensors.insert(
        "advantages".into(),
        TensorData::from_f32(vec![b, w], &adv).unwrap(),
    );
    out.meta.insert("step".into(), serde_json::json!(1));
    out
}

/// Parameters of a model as (name, values).
pub fn params(model: &rlhf_model::Model) -> Vec<(String, Vec<f32>)> {
    host_params(model)
        .unwrap()
        .into_iter()
        .map(|p| (p.name, p.data))
        .collect()
}

/// Largest |a - b| / (|b| + 1e-2) over all parameters, with its name.
pub fn max_rel_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> (f32, String) {
    let mut worst = (0f32, String::new());
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        for (x, y) in va.iter().zip(vb) {
            let d = (x - y).abs() / (y.abs() + 1e-2);
            if d > worst.0 || d.is_nan() {
                worst = (d, na.clone());
            }
        }
    }
    worst
}

// ---------------------------------------------------------------------------------------
// Engines from a config the way the driver builds them (a RoleSpec per rank), and their
// calls over wire batches: each batch goes through the typed request of its call
// (`rlhf_core::calls`), so these tests also cover the decoding the role server does.

use candle_core::Device;
use rlhf_config::RoleSpec;
use rlhf_core::calls::{
    ActorUpdateRequest, CriticUpdateRequest, GenerateRequest, LogProbsRequest, RoleCall,
    ScoresRequest, ValuesRequest, Wire,
};
use rlhf_core::{RoleKind, RolePart, RoleSlot};
use rlhf_roles::{Critic, Generate, LogProbs, RefPolicy, Reward, Rollout, Score, Trainer, Values};

pub fn spec(cfg: &PpoConfig, kind: RoleKind, part: RolePart, rank: u32, world: u32) -> RoleSpec {
    let slot = RoleSlot {
        kind,
        part,
        rank,
        world_size: world,
    };
    RoleSpec::resolve(cfg, slot).unwrap()
}

pub fn trainer(cfg: &PpoConfig, rank: usize, world: usize) -> Trainer {
    let s = spec(
        cfg,
        RoleKind::ActorRollout,
        RolePart::Train,
        rank as u32,
        world as u32,
    );
    Trainer::new(&s, &Device::Cpu).unwrap()
}

pub fn critic(cfg: &PpoConfig, rank: usize, world: usize) -> Critic {
    let s = spec(
        cfg,
        RoleKind::Critic,
        RolePart::Whole,
        rank as u32,
        world as u32,
    );
    Critic::new(&s, &Device::Cpu).unwrap()
}

pub fn rollout(cfg: &PpoConfig) -> Rollout {
    let s = spec(cfg, RoleKind::ActorRollout, RolePart::Infer, 0, 1);
    Rollout::new(&s, &Device::Cpu).unwrap()
}

pub fn reference(cfg: &PpoConfig) -> RefPolicy {
    let s = spec(cfg, RoleKind::Ref, RolePart::Whole, 0, 1);
    RefPolicy::new(&s, &Device::Cpu).unwrap()
}

pub fn reward(cfg: &PpoConfig) -> rlhf_roles::Result<Reward> {
    let slot = RoleSlot {
        kind: RoleKind::Reward,
        part: RolePart::Whole,
        rank: 0,
        world_size: 1,
    };
    Reward::new(&RoleSpec::resolve(cfg, slot)?, &Device::Cpu)
}

/// A wire batch as the typed request of `R` (the geometry meta filled in when absent; a
/// critic batch's `response_mask` is its value mask).
pub fn typed<R: RoleCall>(b: &DataBatch) -> rlhf_roles::Result<R> {
    let mut b = b.clone();
    let r = b.tensors.get("response_mask").map_or(R, |t| t.shape[1]);
    b.meta
        .entry("response_length".to_string())
        .or_insert(serde_json::json!(r));
    b.meta
        .entry("step".to_string())
        .or_insert(serde_json::json!(0));
    b.meta
        .entry("seed".to_string())
        .or_insert(serde_json::json!(0));
    if R::CALL == rlhf_core::calls::BatchCall::UpdateCritic {
        if let Some(m) = b.tensors.remove("response_mask") {
            b.tensors.insert("value_mask".into(), m);
        }
    }
    Ok(R::from_batch(R::CALL, &b)?)
}

/// The calls of the engines over wire batches, answers as wire batches (update metrics in
/// the meta).
pub trait WireCalls {
    fn upd(
        &mut self,
        comm: &mut dyn rlhf_collective::Communicator,
        b: &DataBatch,
    ) -> rlhf_roles::Result<DataBatch>;
}

impl WireCalls for Trainer {
    fn upd(
        &mut self,
        comm: &mut dyn rlhf_collective::Communicator,
        b: &DataBatch,
    ) -> rlhf_roles::Result<DataBatch> {
        Ok(self
            .update(comm, &typed::<ActorUpdateRequest>(b)?)?
            .to_batch()?)
    }
}

impl WireCalls for Critic {
    fn upd(
        &mut self,
        comm: &mut dyn rlhf_collective::Communicator,
        b: &DataBatch,
    ) -> rlhf_roles::Result<DataBatch> {
        Ok(self
            .update(comm, &typed::<CriticUpdateRequest>(b)?)?
            .to_batch()?)
    }
}

pub fn log_probs_of(e: &dyn LogProbs, b: &DataBatch) -> rlhf_roles::Result<DataBatch> {
    Ok(e.log_probs(&typed::<LogProbsRequest>(b)?)?.to_batch()?)
}

pub fn values_of(e: &dyn Values, b: &DataBatch) -> rlhf_roles::Result<DataBatch> {
    Ok(e.values(&typed::<ValuesRequest>(b)?)?.to_batch()?)
}

pub fn generate_with(e: &dyn Generate, b: &DataBatch) -> rlhf_roles::Result<DataBatch> {
    Ok(e.generate(0, &typed::<GenerateRequest>(b)?)?.to_batch()?)
}

pub fn scores_of(e: &dyn Score, b: &DataBatch) -> rlhf_roles::Result<DataBatch> {
    Ok(e.score(&typed::<ScoresRequest>(b)?)?.to_batch()?)
}

/// A group of `n` TCP communicators on localhost, one per rank.
pub fn group(n: usize) -> Vec<rlhf_collective::TcpCommunicator> {
    use rlhf_collective::{CommConfig, TcpCommunicator};
    TcpCommunicator::loopback_group(n, CommConfig::default()).unwrap()
}

// Stage engines (tests/stages.rs, tests/zero.rs).

pub fn single() -> rlhf_collective::TcpCommunicator {
    rlhf_collective::TcpCommunicator::single(rlhf_collective::CommConfig::default())
}

/// Typed sequences and their response mask from [`common::sequences`].
pub fn seqs(
    resp_lens: &[usize],
    seed: u64,
) -> (rlhf_core::calls::Sequences, rlhf_core::calls::Mat<f32>) {
    use rlhf_core::calls::{Mat, Sequences};
    let b: DataBatch = sequences(resp_lens, seed);
    let n = resp_lens.len();
    let mat_i = |name: &str| Mat::new(n, P + R, b.tensors[name].to_i64().unwrap()).unwrap();
    let seq = Sequences {
        input_ids: mat_i("input_ids"),
        attention_mask: mat_i("attention_mask"),
        response_len: R,
    };
    let mask = Mat::new(n, R, b.tensors["response_mask"].to_f32().unwrap()).unwrap();
    (seq, mask)
}

pub fn stage_config(trainer: rlhf_config::TrainerKind) -> PpoConfig {
    let mut cfg = config();
    cfg.trainer = trainer;
    cfg.training.lr = 0.05;
    cfg.training.adam_eps = 1e-8;
    cfg
}

pub const LENS: [usize; 8] = [5, 4, 5, 3, 1, 2, 4, 2];

/// SFT trainer rank `rank` of `world` of `cfg`'s actor, on the CPU.
pub fn sft_trainer(cfg: &PpoConfig, rank: usize, world: usize) -> rlhf_roles::SftTrainer {
    let s = spec(
        cfg,
        rlhf_core::RoleKind::ActorRollout,
        rlhf_core::RolePart::Train,
        rank as u32,
        world as u32,
    );
    rlhf_roles::SftTrainer::new(&s, &candle_core::Device::Cpu).unwrap()
}
