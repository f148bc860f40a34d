//! ZeRO stages 1 and 2 in process (`training.zero_stage`): sharded AdamW state (and, for 2,
//! sharded gradients) steps and saves like plain data parallelism, and the per-rank
//! checkpoint shards read back into any rank count.

mod common;

use common::*;
use rlhf_config::TrainerKind;
use rlhf_core::calls::{Mat, Sequences, SftUpdateRequest};
use rlhf_core::{RoleKind, RolePart};
use rlhf_roles::SftTrainer;

/// The SFT update request of `rows` of the batch.
fn rows_of(
    seq: &Sequences,
    mask: &Mat<f32>,
    rows: std::ops::Range<usize>,
    step: u64,
) -> SftUpdateRequest {
    fn pick<T: Copy>(m: &Mat<T>, rows: &std::ops::Range<usize>) -> Mat<T> {
        let data = rows.clone().flat_map(|i| m.row(i).to_vec()).collect();
        Mat::new(rows.len(), m.cols, data).unwrap()
    }
    SftUpdateRequest {
        seq: Sequences {
            input_ids: pick(&seq.input_ids, &rows),
            attention_mask: pick(&seq.attention_mask, &rows),
            response_len: R,
        },
        loss_mask: pick(mask, &rows),
        step,
    }
}

type Params = Vec<(String, Vec<f32>)>;

/// SFT ranks over `cuts` of the batch (rank r gets rows `cuts[r]..cuts[r + 1]`) at ZeRO
/// `stage`, three steps; each rank's parameters and the elements its AdamW owns. With `save`,
/// the checkpoint goes there (rank 0's whole, or every rank's shard).
fn train_ranks(
    stage: u32,
    cuts: &[usize],
    micro: u32,
    save: Option<&std::path::Path>,
) -> Vec<(Params, usize)> {
    train_ranks_with(stage, cuts, micro, save, |_| {})
}

/// LoRA adapters on three modules, with dropout (SFT's, drawn from the seed, step and rows).
fn lora_on(cfg: &mut rlhf_config::PpoConfig) {
    let l = &mut cfg.actor_rollout.lora;
    l.rank = 4;
    l.alpha = 8.0;
    l.dropout = 0.1;
    l.target_modules = vec!["q_proj".into(), "v_proj".into(), "down_proj".into()];
}

/// [`train_ranks`] with `tune` applied to every rank's config.
fn train_ranks_with(
    stage: u32,
    cuts: &[usize],
    micro: u32,
    save: Option<&std::path::Path>,
    tune: fn(&mut rlhf_config::PpoConfig),
) -> Vec<(Params, usize)> {
    let (seq, mask) = seqs(&LENS, 5);
    let world = cuts.len() - 1;
    let comms = group(world);
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, mut c)| {
            let req = rows_of(&seq, &mask, cuts[rank]..cuts[rank + 1], 0);
            let save = save.map(|d| d.to_path_buf());
            std::thread::spawn(move || {
                let mut cfg = stage_config(TrainerKind::Sft);
                cfg.training.zero_stage = stage;
                cfg.training.weight_decay = 0.01;
                cfg.training.micro_batch_size = micro;
                cfg.training.clip_grad = 0.5;
                tune(&mut cfg);
                let mut t = sft_trainer(&cfg, rank, world);
                assert_eq!(t.state.optim.opt.shard().is_some(), stage >= 1 && world > 1);
                assert_eq!(t.state.model.zero3().is_some(), stage == 3);
                for step in 1..=3 {
                    let mut r = req.clone();
                    r.step = step;
                    t.update(&mut c, &r).unwrap();
                }
                // Plain: rank 0 saves it all; sharded: every rank saves its shard (and, at
                // stage 3, takes part in gathering the weights rank 0 writes).
                // Stage 3's rank 0 writes the weights beside `dir` as the group gathers them,
                // and the image moves the file into place.
                let mut saved = None;
                if let Some(dir) = save.filter(|_| rank == 0 || t.state.optim.opt.shard().is_some())
                {
                    let image = t.state.capture_checkpoint_in(&mut c, Some(&dir)).unwrap();
                    saved = Some(image.checksum().unwrap());
                    image.write(&dir).unwrap();
                    let left = rlhf_roles::spill::spills(&dir);
                    assert!(left.is_empty(), "{left:?} are left");
                }
                let weights = match t.state.model.zero3() {
                    Some(z) => {
                        let whole = z.lend(&mut c, |_| z.gather_all()).unwrap().unwrap();
                        if let (0, Some(sum)) = (rank, saved) {
                            let want = rlhf_roles::weights::tensors_checksum(&whole).unwrap();
                            assert_eq!(sum, want, "the saved weights' checksum");
                        }
                        whole
                            .into_iter()
                            .map(|(n, x)| (n, x.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
                            .collect()
                    }
                    None => params(&t.state.model),
                };
                (weights, t.state.optim.opt.owned_len())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// What stages 2 and 3 are held to: 1, 2 and 4 ranks end three steps with one unsharded
/// rank's weights (within float rounding); 5 rows against 3 with 2-row micro-batches (rank 1
/// has one micro-batch less in the first mini-batch and none in the second) match plain data
/// parallelism on the same split; and one plain rank resumes their checkpoint with rank 0's
/// weights. Returns that checkpoint (in `tmp`) and the plain rank's answered checksum.
fn sharded_like_one_rank(stage: u32, tmp: &std::path::Path) -> (std::path::PathBuf, u64) {
    let one = train_ranks(0, &[0, 8], 1, None);
    let total = one[0].1;
    for cuts in [&[0, 8][..], &[0, 4, 8], &[0, 2, 4, 6, 8]] {
        let got = train_ranks(stage, cuts, 1, None);
        assert_eq!(got.iter().map(|g| g.1).sum::<usize>(), total, "{cuts:?}");
        for (rank, (p, _)) in got.iter().enumerate() {
            let (diff, name) = max_rel_diff(p, &one[0].0);
            assert!(
                diff < 2e-3,
                "{cuts:?} rank {rank}: zero {stage} vs one rank differ by {diff} at {name}"
            );
        }
    }
    let dir = tmp.join(format!("zero{stage}"));
    let plain = train_ranks(0, &[0, 5, 8], 2, None);
    let zero = train_ranks(stage, &[0, 5, 8], 2, Some(&dir));
    for rank in 0..2 {
        let (diff, name) = max_rel_diff(&zero[rank].0, &plain[rank].0);
        assert!(diff < 2e-3, "rank {rank}: {diff} at {name}");
    }
    let cfg = stage_config(TrainerKind::Sft);
    let s = spec(&cfg, RoleKind::ActorRollout, RolePart::Train, 0, 1);
    let mut t = SftTrainer::new(&s, &candle_core::Device::Cpu).unwrap();
    let checksum = t.state.load_checkpoint(&dir).unwrap();
    assert_eq!(t.state.optim.opt.steps(), 3 * 2);
    let (diff, name) = max_rel_diff(&params(&t.state.model), &zero[0].0);
    assert!(diff == 0.0, "{diff} at {name}");
    (dir, checksum)
}

/// `training.zero_stage: 2`: 1, 2 and 4 ranks that keep only their share of the AdamW state
/// and of the summed gradient (reduce-scattered every micro-batch, with accumulation and
/// clipping) end three steps with the weights of one unsharded rank on the whole batch, up
/// to float rounding (the sums run in another order, and Adam with eps 1e-8 magnifies it
/// where a gradient is near zero: plain 2-rank data parallelism differs from one rank by
/// 1.8e-4 here, stage 2 by 3.1e-4; a lost or doubled micro-batch moves weights by lr = 0.05). Ranks with unequal rows, where one
/// runs micro-batches the other does not have, match plain data parallelism on the same
/// split. Their checkpoint is the sharded one stage 1 writes: a plain rank resumes from it.
#[test]
fn zero_stage_2_ends_with_the_weights_of_one_unsharded_rank() {
    let tmp = tempfile::tempdir().unwrap();
    sharded_like_one_rank(2, tmp.path());
}

/// `training.zero_stage: 3`: 1, 2 and 4 SFT ranks that keep only their pieces of the
/// parameters (each layer gathered for its forward and again for its backward, which
/// reduce-scatters its gradients), of the summed gradient and of the AdamW state end three
/// steps with the weights of one unsharded rank, within the rounding stage 2 shows. Ranks
/// with unequal rows, where one joins the other's micro-batches with idle passes, match plain
/// data parallelism on the same split. Their checkpoint is a whole HF model plus the optimizer
/// shards stages 1 and 2 write: a plain rank resumes from it with rank 0's weights, and two
/// stage-3 ranks load it back and answer the saved whole model's checksum.
#[test]
fn zero_stage_3_ends_with_the_weights_of_one_unsharded_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, want) = sharded_like_one_rank(3, tmp.path());
    assert!(dir.join("model.safetensors").is_file());
    resumes_on_two_stage_3_ranks(&dir, &stage_config(TrainerKind::Sft), want);
}

/// Two SFT ranks of `cfg` at stage 3 load the checkpoint in `dir`: each answers `want`, its
/// checksum, and holds its 3 x 2 optimizer steps.
fn resumes_on_two_stage_3_ranks(dir: &std::path::Path, cfg: &rlhf_config::PpoConfig, want: u64) {
    let handles: Vec<_> = group(2)
        .into_iter()
        .enumerate()
        .map(|(rank, mut c)| {
            let (dir, mut cfg) = (dir.to_path_buf(), cfg.clone());
            std::thread::spawn(move || {
                cfg.training.zero_stage = 3;
                let mut t = sft_trainer(&cfg, rank, 2);
                let got = t.state.load_checkpoint_in(&dir, &mut c).unwrap();
                (got, t.state.optim.opt.steps())
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), (want, 3 * 2));
    }
}

/// `training.zero_stage: 3` with LoRA (dropout on): the frozen base is sharded too, and two
/// ranks with 5 and 3 rows end three steps with the adapters stage 2 gives on the same split
/// (whose optimizer layout over the adapters is the same: every rank owns as many elements).
/// Their checkpoint is a PEFT adapter plus the optimizer shards: one plain LoRA rank resumes
/// it with rank 0's adapters, and two stage-3 ranks load it back and answer its checksum.
#[test]
fn zero_stage_3_with_lora_trains_saves_and_resumes_like_stage_2() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("zero3-lora");
    let stage2 = train_ranks_with(2, &[0, 5, 8], 2, None, lora_on);
    let stage3 = train_ranks_with(3, &[0, 5, 8], 2, Some(&dir), lora_on);
    for (rank, (z2, z3)) in stage2.iter().zip(&stage3).enumerate() {
        assert_eq!(z3.1, z2.1, "rank {rank}: AdamW owns the same elements");
        assert_eq!(z3.0.len(), z2.0.len(), "rank {rank}: the same parameters");
        assert!(
            z3.0.iter().all(|(n, _)| n.contains(".lora_")),
            "adapters only"
        );
        let (diff, name) = max_rel_diff(&z3.0, &z2.0);
        assert!(
            diff < 2e-3,
            "rank {rank}: stage 3 vs 2 differ by {diff} at {name}"
        );
    }
    assert!(dir.join("adapter_model.safetensors").is_file());
    assert!(
        !dir.join("model.safetensors").exists(),
        "the base is not saved"
    );
    let mut cfg = stage_config(TrainerKind::Sft);
    lora_on(&mut cfg);
    let s = spec(&cfg, RoleKind::ActorRollout, RolePart::Train, 0, 1);
    let mut t = SftTrainer::new(&s, &candle_core::Device::Cpu).unwrap();
    let untrained = params(&t.state.model);
    assert!(
        max_rel_diff(&untrained, &stage3[0].0).0 > 1e-2,
        "training moved the adapters"
    );
    let want = t.state.load_checkpoint(&dir).unwrap();
    assert_eq!(t.state.optim.opt.steps(), 3 * 2);
    let (diff, name) = max_rel_diff(&params(&t.state.model), &stage3[0].0);
    assert!(diff == 0.0, "{diff} at {name}");
    resumes_on_two_stage_3_ranks(&dir, &cfg, want);
}

/// `training.zero_stage: 1`: two SFT ranks that each keep half of the AdamW state end every
/// step with exactly the weights of two ranks that keep all of it (AdamW is elementwise), and
/// their checkpoint (one shard per rank) holds exactly the unsharded optimizer state: one
/// unsharded rank and three sharded ranks read it back.
#[test]
fn zero_stage_1_steps_and_saves_exactly_like_plain_data_parallel() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |zero: u32| {
        let dir = tmp.path().join(format!("zero{zero}"));
        (train_ranks(zero, &[0, 4, 8], 2, Some(&dir)), dir)
    };
    let (plain, plain_dir) = run(0);
    let (zero, zero_dir) = run(1);
    for rank in 0..2 {
        let (diff, name) = max_rel_diff(&zero[rank].0, &plain[rank].0);
        assert!(
            diff == 0.0,
            "rank {rank}: zero 1 vs 0 differ by {diff} at {name}"
        );
    }
    // Each sharded rank held about half of the moments.
    let total = plain[0].1;
    assert_eq!(zero[0].1 + zero[1].1, total);
    assert!(
        zero[0].1.abs_diff(zero[1].1) <= 1,
        "{} + {}",
        zero[0].1,
        zero[1].1
    );
    // The gathered checkpoint is the unsharded one, byte for byte in its optimizer file,
    // and one plain rank resumes from it.
    let cfg = stage_config(TrainerKind::Sft);
    let s = spec(&cfg, RoleKind::ActorRollout, RolePart::Train, 0, 1);
    let load = |dir: &std::path::Path| {
        let mut t = SftTrainer::new(&s, &candle_core::Device::Cpu).unwrap();
        t.state.load_checkpoint(dir).unwrap();
        t
    };
    let (one, reference) = (load(&zero_dir), load(&plain_dir));
    let state = |t: &SftTrainer| {
        let (tensors, step) = t.state.optim.opt.state().unwrap();
        let v: Vec<(String, Vec<f32>)> = tensors
            .into_iter()
            .map(|(n, x)| (n, x.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect();
        (v, step)
    };
    let ((a, sa), (b, sb)) = (state(&one), state(&reference));
    assert_eq!(sa, sb);
    for ((na, va), (nb, vb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        let first = va
            .iter()
            .zip(vb)
            .position(|(x, y)| x.to_bits() != y.to_bits());
        assert!(
            first.is_none(),
            "{na} differs at {first:?}: {:?}",
            first.map(|i| (va[i], vb[i]))
        );
    }
    let (diff, name) = max_rel_diff(&params(&one.state.model), &plain[0].0);
    assert!(diff == 0.0, "{diff} at {name}");
    assert!(zero_dir
        .with_file_name("zero1.rank-1")
        .join("manifest.json")
        .is_file());
    assert!(!zero_dir.join("optimizer.safetensors").exists());
    // Three sharded ranks: each reads its range out of the two shards.
    let whole: Vec<f32> = {
        let (tensors, _) = reference.state.optim.opt.state().unwrap();
        let mut cfg = stage_config(TrainerKind::Sft);
        cfg.training.zero_stage = 1;
        let s = spec(&cfg, RoleKind::ActorRollout, RolePart::Train, 0, 1);
        let t = SftTrainer::new(&s, &candle_core::Device::Cpu).unwrap();
        let names: Vec<String> = t.state.model.vars().into_iter().map(|(n, _)| n).collect();
        names
            .iter()
            .flat_map(|n| {
                let (_, x) = tensors
                    .iter()
                    .find(|(k, _)| *k == format!("exp_avg.{n}"))
                    .unwrap();
                x.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            })
            .collect()
    };
    let mut joined = Vec::new();
    for rank in 0..3 {
        let mut cfg = stage_config(TrainerKind::Sft);
        cfg.training.zero_stage = 1;
        cfg.training.global_batch_size = 9;
        let s = spec(&cfg, RoleKind::ActorRollout, RolePart::Train, rank, 3);
        let mut t = SftTrainer::new(&s, &candle_core::Device::Cpu).unwrap();
        t.state.load_checkpoint(&zero_dir).unwrap();
        assert_eq!(t.state.optim.opt.steps(), 3);
        joined.extend(t.state.optim.opt.owned_moments().unwrap().0);
    }
    assert_eq!(joined, whole);
    // A missing shard is named.
    std::fs::remove_dir_all(zero_dir.with_file_name("zero1.rank-1")).unwrap();
    let mut t = SftTrainer::new(&s, &candle_core::Device::Cpu).unwrap();
    let e = t.state.load_checkpoint(&zero_dir).unwrap_err().to_string();
    assert!(e.contains("rank 1") && e.contains("zero1.rank-1"), "{e}");
}

/// `training.zero_stage: 3` with NaN weights (rank 1's pieces, so every gathered layer on
/// both ranks): the group fails the update together, naming the NaN, with no rank left in a
/// collective its peer gave up (a collective mismatch or timeout would say so); the next
/// update of the same ranks starts clean and fails the same way.
#[test]
fn zero_stage_3_fails_together_on_nan_weights() {
    let (seq, mask) = seqs(&LENS, 5);
    let handles: Vec<_> = group(2)
        .into_iter()
        .enumerate()
        .map(|(rank, mut c)| {
            let req = rows_of(&seq, &mask, rank * 4..rank * 4 + 4, 1);
            std::thread::spawn(move || {
                let mut cfg = stage_config(TrainerKind::Sft);
                cfg.training.zero_stage = 3;
                let mut t = sft_trainer(&cfg, rank, 2);
                let z = t.state.model.zero3().unwrap().clone();
                let whole = z.lend(&mut c, |_| z.gather_all()).unwrap().unwrap();
                if rank == 1 {
                    // Rank 1's pieces become NaN, and so every gathered layer on both ranks.
                    let nan: Vec<_> = whole
                        .iter()
                        .map(|(n, w)| (n.clone(), (w.ones_like().unwrap() * f64::NAN).unwrap()))
                        .collect();
                    t.state.model.set_weights(&nan).unwrap();
                }
                (0..2)
                    .map(|_| match t.update(&mut c, &req) {
                        Ok(_) => panic!("rank {rank}: a NaN loss updated"),
                        Err(e) => e.to_string(),
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for h in handles {
        for e in h.join().unwrap() {
            assert!(e.contains("NaN") || e.contains("non-finite"), "{e}");
            assert!(!e.contains("timed out"), "{e}");
            assert!(!e.contains("mismatch"), "{e}");
        }
    }
}
