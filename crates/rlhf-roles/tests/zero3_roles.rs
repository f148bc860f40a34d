//! ZeRO stage 3 beyond SFT (`training.zero_stage: 3`): PPO's policy and critic, whose
//! inference calls (log-probs, values) gather every layer from the group and so keep the
//! ranks in step even when their rows differ ([`rlhf_roles::zero::lockstep`]), whose updates
//! end with plain data parallelism's weights, and whose trainer ranks gather the whole policy
//! for a weight sync to a rollout; and the DPO and reward-model trainers, whose two sides of
//! each pair go through one model call.

mod common;

use std::thread;

use common::*;
use rlhf_collective::Communicator;
use rlhf_config::TrainerKind;
use rlhf_core::batch::{DataBatch, TensorData};
use rlhf_core::calls::{Mat, PreferenceUpdateRequest, RewardModelUpdateRequest, Sequences};
use rlhf_core::{RoleKind, RolePart};
use rlhf_roles::{zero, PreferenceTrainer, RewardModelTrainer};

type Params = Vec<(String, Vec<f32>)>;

fn rows(b: &DataBatch, r: std::ops::Range<usize>) -> DataBatch {
    b.select(&r.collect::<Vec<_>>()).unwrap()
}

fn f32s(b: &DataBatch, name: &str) -> Vec<f32> {
    b.tensors[name].to_f32().unwrap()
}

/// A stage-3 model's whole weights, gathered from its group (every rank calls this).
fn gathered(model: &rlhf_model::Model, comm: &mut dyn Communicator) -> Params {
    match model.zero3() {
        Some(z) => z
            .lend(comm, |_| z.gather_all())
            .unwrap()
            .unwrap()
            .into_iter()
            .map(|(n, x)| (n, x.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect(),
        None => params(model),
    }
}

/// What one rank of a PPO run of `ranks()` computed: its log-probs and values (before the
/// updates), and the policy and critic weights after two updates of each.
struct PpoRank {
    log_probs: Vec<f32>,
    /// With LoRA: the reference log-probs, the actor's base with its adapters off.
    reference: Vec<f32>,
    values: Vec<f32>,
    policy: Params,
    critic: Params,
}

/// The PPO batch (8 sequences) with old log-probs, advantages, values and returns from one
/// plain rank, so every run below trains on the same numbers.
fn ppo_batch(cfg: &rlhf_config::PpoConfig) -> DataBatch {
    let seqs = sequences(&LENS, 33);
    let t = trainer(cfg, 0, 1);
    let lp = f32s(&log_probs_of(&t, &seqs).unwrap(), "log_probs");
    let mut b = actor_batch(&seqs, &lp, 4);
    let c = critic(cfg, 0, 1);
    let values = values_of(&c, &seqs).unwrap().tensors["values"].clone();
    let returns: Vec<f32> = values
        .to_f32()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, x)| x + ((i * 7) % 5) as f32 * 0.3 - 0.6)
        .collect();
    b.tensors.insert("values".into(), values);
    b.tensors.insert(
        "returns".into(),
        TensorData::from_f32(vec![LENS.len(), R], &returns).unwrap(),
    );
    b
}

/// PPO's trained roles at ZeRO `stage`, rank r on rows `cuts[r]..cuts[r + 1]`, with 2-row
/// micro-batches: log-probs and values, then two actor and two critic updates. With `lora`,
/// both train LoRA adapters, and the reference log-probs come from the actor's base.
fn ppo_ranks(stage: u32, cuts: &[usize], lora: bool) -> Vec<PpoRank> {
    let mut cfg = config();
    cfg.training.zero_stage = stage;
    if lora {
        for l in [&mut cfg.actor_rollout.lora, &mut cfg.critic.lora] {
            l.rank = 4;
            l.alpha = 8.0;
            l.target_modules = vec!["q_proj".into(), "v_proj".into(), "down_proj".into()];
        }
    }
    let batch = ppo_batch(&config());
    let world = cuts.len() - 1;
    let handles: Vec<_> = group(world)
        .into_iter()
        .zip(group(world))
        .enumerate()
        .map(|(rank, (mut ca, mut cc))| {
            let cfg = cfg.clone();
            let shard = rows(&batch, cuts[rank]..cuts[rank + 1]);
            thread::spawn(move || {
                let mut t = trainer(&cfg, rank, world);
                let mut c = critic(&cfg, rank, world);
                assert_eq!(t.state.model.zero3().is_some(), stage == 3);
                assert_eq!(c.state.model.zero3().is_some(), stage == 3);
                // The calls the rows need: ceil(rows / micro-batch), as the role host plans.
                let planned = shard.len().unwrap().div_ceil(2);
                let lp = zero::lockstep(&t.state.model.clone(), &mut ca, planned, "lp", || {
                    log_probs_of(&t, &shard)
                })
                .unwrap();
                let values = zero::lockstep(&c.state.model.clone(), &mut cc, planned, "v", || {
                    values_of(&c, &shard)
                })
                .unwrap();
                let reference = if lora {
                    let model = t.state.model.clone();
                    let s = spec(
                        &cfg,
                        RoleKind::Ref,
                        RolePart::Whole,
                        rank as u32,
                        world as u32,
                    );
                    let r = rlhf_roles::RefPolicy::sharing(&s, model.clone()).unwrap();
                    let out = zero::lockstep(&model, &mut ca, planned, "ref", || {
                        log_probs_of(&r, &shard)
                    });
                    f32s(&out.unwrap(), "log_probs")
                } else {
                    Vec::new()
                };
                for step in 1..=2u64 {
                    let mut s = shard.clone();
                    s.meta.insert("step".into(), serde_json::json!(step));
                    t.upd(&mut ca, &s).unwrap();
                    c.upd(&mut cc, &s).unwrap();
                }
                PpoRank {
                    log_probs: f32s(&lp, "log_probs"),
                    reference,
                    values: f32s(&values, "values"),
                    policy: gathered(&t.state.model, &mut ca),
                    critic: gathered(&c.state.model, &mut cc),
                }
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol, "{what}[{i}]: {x} vs {y}");
    }
}

/// Two stage-3 ranks with 5 and 3 rows (3 and 2 model calls of 2 rows: rank 1 joins rank 0's
/// third call with an idle one) answer the log-probs and values one unsharded rank gives for
/// the same rows, and after two actor and two critic updates hold plain data parallelism's
/// weights on the same split (AdamW with eps 1.0 here: a lost or doubled micro-batch moves a
/// weight by ~lr/2 = 0.25).
#[test]
fn ppo_policy_and_critic_at_stage_3_compute_and_train_like_plain_data_parallel() {
    let cuts = [0, 5, 8];
    let plain = ppo_ranks(0, &cuts, false);
    let zero3 = ppo_ranks(3, &cuts, false);
    same_ppo_ranks(&plain, &zero3);
    // The updates moved the weights: the comparison above is not of two untouched models.
    let start = params(&trainer(&config(), 0, 1).state.model);
    assert!(max_rel_diff(&plain[0].policy, &start).0 > 1e-2);
}

/// Stage 3 with LoRA on the actor and the critic (the 7B-on-two-cards setup): the
/// frozen bases are sharded too, and two ranks with 5 and 3 rows answer the log-probs, the
/// values and the reference log-probs (the actor's base, adapters off) that plain data
/// parallelism gives, and end two updates of each with its adapters and value head.
#[test]
fn ppo_with_lora_at_stage_3_computes_and_trains_like_plain_data_parallel() {
    let cuts = [0, 5, 8];
    let plain = ppo_ranks(0, &cuts, true);
    let zero3 = ppo_ranks(3, &cuts, true);
    same_ppo_ranks(&plain, &zero3);
    for r in &zero3 {
        assert_eq!(r.reference.len(), r.log_probs.len());
        // Only the adapters (and the critic's value head) train, and they moved.
        for (what, trained) in [("policy", &r.policy), ("critic", &r.critic)] {
            assert!(trained
                .iter()
                .all(|(n, _)| n.contains("lora_") || n.starts_with("score")));
            let moved = trained
                .iter()
                .filter(|(n, _)| n.contains("lora_B"))
                .flat_map(|(_, v)| v)
                .fold(0f32, |m, x| m.max(x.abs()));
            assert!(moved > 1e-3, "{what}: the adapters moved by {moved}");
        }
    }
    // Before any update the adapters (B = 0) change nothing: the reference, computed with
    // them off, is the policy's log-probs bit for bit.
    let d = plain[0]
        .reference
        .iter()
        .zip(&plain[0].log_probs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(d == 0.0, "the reference is {d} off the untrained policy");
}

/// Stage 3's ranks against plain data parallelism's, rank by rank.
fn same_ppo_ranks(plain: &[PpoRank], zero3: &[PpoRank]) {
    for (rank, (p, z)) in plain.iter().zip(zero3).enumerate() {
        close(
            &z.reference,
            &p.reference,
            1e-5,
            &format!("rank {rank} reference log-probs"),
        );
        close(
            &z.log_probs,
            &p.log_probs,
            1e-5,
            &format!("rank {rank} log-probs"),
        );
        close(&z.values, &p.values, 1e-5, &format!("rank {rank} values"));
        for (what, a, b) in [
            ("policy", &z.policy, &p.policy),
            ("critic", &z.critic, &p.critic),
        ] {
            assert_eq!(a.len(), b.len(), "rank {rank} {what}: the same parameters");
            let (d, name) = max_rel_diff(a, b);
            assert!(
                d < 1e-4,
                "rank {rank} {what}: stage 3 vs plain differ by {d} at {name}"
            );
        }
    }
}

/// A lockstep call that a rank refuses before its first model call (a request of the wrong
/// shape) fails on that rank only, promptly: it still makes the calls the group agreed on,
/// so the other rank's log-probs come back.
#[test]
fn a_refused_call_at_stage_3_does_not_leave_the_group_waiting() {
    let mut cfg = config();
    cfg.training.zero_stage = 3;
    let seqs = sequences(&LENS, 5);
    let handles: Vec<_> = group(2)
        .into_iter()
        .enumerate()
        .map(|(rank, mut comm)| {
            let cfg = cfg.clone();
            let mut shard = rows(&seqs, rank * 4..rank * 4 + 4);
            if rank == 1 {
                // Prompt and response no longer add up to the model's sequence shape.
                shard
                    .meta
                    .insert("response_length".into(), serde_json::json!(R + 3));
            }
            thread::spawn(move || {
                let t = trainer(&cfg, rank, 2);
                let start = std::time::Instant::now();
                let out = zero::lockstep(&t.state.model.clone(), &mut comm, 2, "lp", || {
                    log_probs_of(&t, &shard)
                });
                (out.map(|b| f32s(&b, "log_probs")), start.elapsed())
            })
        })
        .collect();
    let outs: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let (ok, refused) = (&outs[0], &outs[1]);
    assert!(refused.0.is_err(), "rank 1's request was malformed");
    let want = f32s(
        &log_probs_of(&trainer(&config(), 0, 1), &rows(&seqs, 0..4)).unwrap(),
        "log_probs",
    );
    close(ok.0.as_ref().unwrap(), &want, 1e-5, "rank 0 log-probs");
    assert!(ok.1.as_secs() < 20, "rank 0 waited {:?}", ok.1);
}

/// Two stage-3 trainer ranks gather their whole policy for a weight sync, a layer at a time;
/// rank 0 sends each as it comes to a rollout, which ends with the trained weights and the
/// checksum of what was sent (that of the whole gathered weights).
#[test]
fn stage_3_trainer_ranks_gather_the_policy_for_the_weight_sync() {
    sync_from_stage_3(false);
}

/// The same with LoRA: the trainer ranks gather only the adapters (their frozen base is
/// sharded and never changes), and a rollout holding the base receives them.
#[test]
fn stage_3_trainer_ranks_with_lora_sync_only_the_adapters() {
    sync_from_stage_3(true);
}

fn sync_from_stage_3(lora: bool) {
    let mut cfg = config();
    cfg.training.zero_stage = 3;
    if lora {
        let l = &mut cfg.actor_rollout.lora;
        l.rank = 4;
        l.alpha = 8.0;
        l.target_modules = vec!["q_proj".into(), "up_proj".into()];
    }
    let batch = ppo_batch(&config());
    let mut dp = group(2);
    let mut weights = group(2);
    let (w1, mut w0) = (weights.pop().unwrap(), weights.pop().unwrap());
    let (d1, mut d0) = (dp.pop().unwrap(), dp.pop().unwrap());
    let rollout_side = {
        let cfg = cfg.clone();
        thread::spawn(move || {
            let mut w1 = w1;
            let mut r = rollout(&cfg);
            let (_, sum) = r.recv_weights(&mut w1, 9, 4096).unwrap();
            assert_eq!(r.checksum().unwrap(), sum);
            (params(&r.model), sum, r.version)
        })
    };
    let helper = {
        let cfg = cfg.clone();
        let shard = rows(&batch, 4..8);
        thread::spawn(move || {
            let mut d1 = d1;
            let mut t = trainer(&cfg, 1, 2);
            t.upd(&mut d1, &shard).unwrap();
            // Rank 1's part of the sync: the gathers only.
            let z = t.state.model.zero3().unwrap().clone();
            z.lend(&mut d1, |_| z.gather_all_for_others())
                .unwrap()
                .unwrap();
            // Then the gather rank 0 compares with, and the checksum of the whole weights.
            let all = gathered(&t.state.model, &mut d1);
            assert!(!all.is_empty());
            let sum = z.lend(&mut d1, |_| z.gathered_checksum());
            sum.unwrap().unwrap()
        })
    };
    let mut t = trainer(&cfg, 0, 2);
    t.upd(&mut d0, &rows(&batch, 0..4)).unwrap();
    // Rank 0 sends each layer as the group gathers it.
    let (stats, sent) = t
        .send_weights_sharded(&mut d0, &mut w0, 9, 4096)
        .unwrap()
        .unwrap();
    assert!(stats.buckets > 1, "{} buckets", stats.buckets);
    let z = t.state.model.zero3().unwrap().clone();
    let whole = z.lend(&mut d0, |_| z.gather_all()).unwrap().unwrap();
    // The checksum of the whole weights, hashed a layer at a time as the group gathers them.
    let hashed = z.lend(&mut d0, |_| z.gathered_checksum()).unwrap().unwrap();
    let helper_hashed = helper.join().unwrap();
    assert_eq!(
        hashed,
        rlhf_roles::weights::tensors_checksum(&whole).unwrap()
    );
    assert_eq!(helper_hashed, hashed);
    let (got, sum, version) = rollout_side.join().unwrap();
    assert_eq!((sum, version), (sent, 9));
    assert_eq!(sent, rlhf_roles::weights::tensors_checksum(&whole).unwrap());
    let whole: Params = whole
        .into_iter()
        .map(|(n, x)| (n, x.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    assert_eq!(got.len(), whole.len(), "every parameter sent");
    assert_eq!(whole.iter().all(|(n, _)| n.contains(".lora_")), lora);
    let (d, name) = max_rel_diff(&got, &whole);
    assert!(d == 0.0, "the rollout's weights differ by {d} at {name}");
    // And they are the trained ones, not the checkpoint the rollout loaded.
    let start = params(&rollout(&cfg).model);
    assert!(max_rel_diff(&got, &start).0 > 1e-2);
}

/// Rows `r` of typed sequences or of a mask.
fn pick<T: Copy>(m: &Mat<T>, r: std::ops::Range<usize>) -> Mat<T> {
    Mat::new(r.len(), m.cols, r.flat_map(|i| m.row(i).to_vec()).collect()).unwrap()
}

fn pick_seq(s: &Sequences, r: std::ops::Range<usize>) -> Sequences {
    Sequences {
        input_ids: pick(&s.input_ids, r.clone()),
        attention_mask: pick(&s.attention_mask, r),
        response_len: s.response_len,
    }
}

/// DPO (sigmoid, against fixed reference sums) or a reward model on 8 pairs split 5/3 over
/// two ranks at ZeRO `stage`, 2-pair micro-batches (rank 1 joins rank 0's third training pass
/// with an idle one): each rank's whole weights after two steps.
fn pair_ranks(kind: TrainerKind, stage: u32) -> Vec<Params> {
    let (chosen, chosen_mask) = seqs(&LENS, 3);
    let (rejected, rejected_mask) = seqs(&[2, 5, 1, 4, 3, 5, 2, 4], 4);
    let cuts = [0usize, 5, 8];
    let handles: Vec<_> = group(2)
        .into_iter()
        .enumerate()
        .map(|(rank, mut comm)| {
            let r = cuts[rank]..cuts[rank + 1];
            let refs = |k: usize| (0..r.len()).map(|i| -3.0 - ((i + k) % 4) as f32).collect();
            let dpo = PreferenceUpdateRequest {
                chosen: pick_seq(&chosen, r.clone()),
                chosen_mask: pick(&chosen_mask, r.clone()),
                rejected: pick_seq(&rejected, r.clone()),
                rejected_mask: pick(&rejected_mask, r.clone()),
                ref_chosen: Some(refs(0)),
                ref_rejected: Some(refs(1)),
                kto_kl: None,
                step: 0,
            };
            let rm = RewardModelUpdateRequest {
                chosen: dpo.chosen.clone(),
                rejected: dpo.rejected.clone(),
                margin: None,
                step: 0,
            };
            thread::spawn(move || {
                let mut cfg = stage_config(kind);
                cfg.training.zero_stage = stage;
                cfg.training.micro_batch_size = 2;
                cfg.reward.kind = rlhf_config::RewardKind::Model;
                cfg.reward.model = fixture("tiny-llama").display().to_string();
                let dev = candle_core::Device::Cpu;
                if kind == TrainerKind::Reward {
                    let s = spec(&cfg, RoleKind::Reward, RolePart::Whole, rank as u32, 2);
                    let mut t = RewardModelTrainer::new(&s, &dev).unwrap();
                    assert_eq!(t.state.model.zero3().is_some(), stage == 3);
                    for step in 1..=2 {
                        t.update(&mut comm, &RewardModelUpdateRequest { step, ..rm.clone() })
                            .unwrap();
                    }
                    gathered(&t.state.model, &mut comm)
                } else {
                    let s = spec(
                        &cfg,
                        RoleKind::ActorRollout,
                        RolePart::Train,
                        rank as u32,
                        2,
                    );
                    let mut t = PreferenceTrainer::new(&s, &dev).unwrap();
                    assert_eq!(t.state.model.zero3().is_some(), stage == 3);
                    for step in 1..=2 {
                        t.update(
                            &mut comm,
                            &PreferenceUpdateRequest {
                                step,
                                ..dpo.clone()
                            },
                        )
                        .unwrap();
                    }
                    gathered(&t.state.model, &mut comm)
                }
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// `training.zero_stage: 3` for DPO and reward models: the chosen and rejected sides go
/// through one model call per training pass, and two sharded ranks with unequal pairs end
/// two steps with plain data parallelism's weights (lr 0.05, eps 1e-8: a lost micro-batch
/// moves weights by about lr).
#[test]
fn dpo_and_reward_models_at_stage_3_train_like_plain_data_parallel() {
    for kind in [TrainerKind::Dpo, TrainerKind::Reward] {
        let plain = pair_ranks(kind, 0);
        let zero3 = pair_ranks(kind, 3);
        for rank in 0..2 {
            let (d, name) = max_rel_diff(&zero3[rank], &plain[rank]);
            assert!(
                d < 2e-3,
                "{kind} rank {rank}: stage 3 vs plain differ by {d} at {name}"
            );
        }
    }
}
