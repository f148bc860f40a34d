//! The policy loss of the GRPO family (`ppo`, `cispo`, `sapo` at the token or sequence
//! level, every aggregation) on the CPU as one kernel that returns the aggregated loss and
//! its finished gradient w.r.t. the log-probs.
//!
//! Why: the trainer needs both, and as a chain of candle ops every step of the loss is a
//! pass over memory into a fresh buffer, repeated by the backward pass (at 256 x 4096 tokens
//! the op chains of GSPO and SAPO ran ~20x slower than PyTorch). Here the aggregation's
//! weights come from one pass over the mask, then each row is read once (twice more from
//! cache at the sequence level, where every token's loss depends on the whole row), the
//! per-token math runs branch-free over lanes of 8 tokens so that the compiler vectorizes it
//! (with AVX2 where the CPU has it), and the gradient is written finished. A custom op hands
//! the scalar loss to candle; its backward returns the gradient. The op chains in `loss.rs`
//! and `objective.rs` stay the path of other devices, and the tests hold this against them.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

use super::{pick_clamp, pick_max, sel, split_rows};
use crate::config::PolicyLossConfig;
use crate::masked::{row_sums, Terms};
use crate::names::{ImportanceSamplingLevel, LossAggMode, PolicyLoss};

/// Tokens per step of the inner loops; the per-lane partial sums vectorize.
const LANES: usize = 8;
/// Tokens whose `f32` lane sums are folded into `f64` at a time.
const BLOCK: usize = 256;
/// The log-ratio is clamped to this before `exp`, as the op chains do.
const BOUND: f32 = 20.0;

/// `exp(x)` within 2 ulp for `x` in [-87, 88] (clamped there), after Cephes' `expf`: no call
/// and no branch, so the loops over it vectorize.
#[inline(always)]
#[allow(clippy::excessive_precision)]
fn exp_f32(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // round(x / ln 2) with the 1.5 * 2^23 trick: the sum's low mantissa bits hold it
    let t = x * std::f32::consts::LOG2_E + 12_582_912.0;
    let n = t - 12_582_912.0;
    let r = (x - n * 0.693_359_375) - n * -2.121_944_40e-4;
    let p = ((((1.987_569_150e-4 * r + 1.398_199_951e-3) * r + 8.333_451_907e-3) * r
        + 4.166_579_589e-2)
        * r
        + 1.666_666_546e-1)
        * r
        + 5.000_000_120e-1;
    let y = p * r * r + r + 1.0;
    let e = (t.to_bits() as i32)
        .wrapping_sub(0x4B40_0000)
        .wrapping_add(127);
    y * f32::from_bits((e as u32) << 23)
}

/// One token's loss as a function of its importance ratio `r` (and, for CISPO, its
/// log-prob `lp`), with both derivatives and the diagnostics' flags.
#[derive(Clone, Copy)]
struct Tok {
    value: f32,
    d_ratio: f32,
    d_logp: f32,
    clipped: bool,
    lower: bool,
}

/// The constants say which parts of [`Tok`] an objective uses, so that the kernels leave
/// out the others (adding a constant 0 to an accumulator is not free in IEEE arithmetic).
trait Objective: Copy + Send + Sync {
    /// Whether the loss reaches the log-probs through the ratio (not for CISPO, whose
    /// weight is detached).
    const THROUGH_RATIO: bool;
    /// Whether it depends on the log-probs directly (CISPO).
    const DIRECT: bool;
    /// Whether it clips (`clipped`), and has a dual clip (`lower`).
    const CLIPS: bool;
    const DUAL: bool;
    fn tok(self, r: f32, lp: f32, a: f32) -> Tok;
}

/// `max(-A r, -A clip(r, lo, hi))`, candle's tie rules (a tie splits the gradient).
#[derive(Clone, Copy)]
struct Ppo {
    lo: f32,
    hi: f32,
}

impl Ppo {
    #[inline(always)]
    fn clip1(self, r: f32, a: f32) -> (f32, f32) {
        let na = -a;
        let (cr, dcr) = pick_clamp(r, self.lo, self.hi, 1.0);
        pick_max((na * r, na), (na * cr, na * dcr))
    }

    #[inline(always)]
    fn clipped(self, r: f32, a: f32) -> bool {
        ((a < 0.0) & (r < self.lo)) | ((a > 0.0) & (r > self.hi))
    }
}

impl Objective for Ppo {
    const THROUGH_RATIO: bool = true;
    const DIRECT: bool = false;
    const CLIPS: bool = true;
    const DUAL: bool = false;

    #[inline(always)]
    fn tok(self, r: f32, _lp: f32, a: f32) -> Tok {
        let (value, d_ratio) = self.clip1(r, a);
        Tok {
            value,
            d_ratio,
            d_logp: 0.0,
            clipped: self.clipped(r, a),
            lower: false,
        }
    }
}

/// [`Ppo`] bounded by `-A c` where `A < 0` (verl's dual clip).
#[derive(Clone, Copy)]
struct PpoDual {
    ppo: Ppo,
    c: f32,
}

impl Objective for PpoDual {
    const THROUGH_RATIO: bool = true;
    const DIRECT: bool = false;
    const CLIPS: bool = true;
    const DUAL: bool = true;

    #[inline(always)]
    fn tok(self, r: f32, _lp: f32, a: f32) -> Tok {
        let (c1, dc1) = self.ppo.clip1(r, a);
        let pg3 = -a * self.c;
        let neg = a < 0.0;
        let v = sel(c1 > pg3, pg3, c1);
        let d = sel(c1 < pg3, dc1, sel(c1 > pg3, 0.0, 0.5 * dc1));
        Tok {
            value: sel(neg, v, c1),
            d_ratio: sel(neg, d, dc1),
            d_logp: 0.0,
            clipped: self.ppo.clipped(r, a),
            lower: neg & (c1 > pg3),
        }
    }
}

/// TRL's `-sg(min(r, cap)) * A * logp`.
#[derive(Clone, Copy)]
struct Cispo {
    cap: f32,
}

impl Objective for Cispo {
    const THROUGH_RATIO: bool = false;
    const DIRECT: bool = true;
    const CLIPS: bool = true;
    const DUAL: bool = false;

    #[inline(always)]
    fn tok(self, r: f32, lp: f32, a: f32) -> Tok {
        let weight = sel(r < self.cap, r, self.cap);
        let d_logp = -(weight * a);
        Tok {
            value: d_logp * lp,
            d_ratio: 0.0,
            d_logp,
            clipped: (a > 0.0) & (r > self.cap),
            lower: false,
        }
    }
}

/// TRL's `-A * sigmoid(tau (r - 1)) * 4 / tau`, `tau` by the sign of `A`.
#[derive(Clone, Copy)]
struct Sapo {
    tau_pos: f32,
    tau_neg: f32,
    /// `4 / tau_pos`, `4 / tau_neg`.
    scale_pos: f32,
    scale_neg: f32,
}

impl Sapo {
    fn new(tau_pos: f32, tau_neg: f32) -> Self {
        Self {
            tau_pos,
            tau_neg,
            scale_pos: 4.0 / tau_pos,
            scale_neg: 4.0 / tau_neg,
        }
    }
}

impl Objective for Sapo {
    const THROUGH_RATIO: bool = true;
    const DIRECT: bool = false;
    const CLIPS: bool = false;
    const DUAL: bool = false;

    #[inline(always)]
    fn tok(self, r: f32, _lp: f32, a: f32) -> Tok {
        let pos = a > 0.0;
        let tau = sel(pos, self.tau_pos, self.tau_neg);
        // sigmoid(x) = 1 / (1 + e^-x), 1 - sigmoid(x) = e^-x / (1 + e^-x); e^-x stays finite
        let e = exp_f32(-(tau * (r - 1.0)));
        let s = 1.0 / (1.0 + e);
        let gate = sel(pos, self.scale_pos, self.scale_neg) * s;
        Tok {
            value: -(gate * a),
            d_ratio: -(a * (4.0 * s * (e * s))),
            d_logp: 0.0,
            clipped: false,
            lower: false,
        }
    }
}

/// Per-lane `f32` partial sums of one block. Terms are masked by multiplying with the 0/1
/// mask (checked before the pass), as the op chains do: selects feeding an accumulator
/// became masked stores to memory, several times slower.
#[derive(Default, Clone, Copy)]
struct Lanes {
    loss: [f32; LANES],
    clip: [f32; LANES],
    lower: [f32; LANES],
    approxkl: [f32; LANES],
    neg_kl: [f32; LANES],
    ratio: [f32; LANES],
    /// Masked sum of the entropies.
    entropy: [f32; LANES],
    /// The sequence level's token derivatives w.r.t. the shared ratio.
    d_ratio: [f32; LANES],
    /// The sequence level's advantages times 0: 0 unless one is NaN or infinite.
    probe: [f32; LANES],
}

/// Sums over a row, or over a thread's rows.
#[derive(Default, Clone, Copy)]
struct Sums {
    loss: f64,
    /// Sum of the token derivatives w.r.t. a shared (sequence-level) ratio.
    d_ratio: f64,
    clip: f64,
    lower: f64,
    approxkl: f64,
    neg_kl: f64,
    ratio: f64,
    /// Masked sum of the entropies.
    entropy: f64,
    probe: f64,
}

impl Sums {
    /// Takes the lanes by value: a reference would keep them in memory, not in registers.
    #[inline(always)]
    fn fold(&mut self, l: Lanes) {
        let s = |x: [f32; LANES]| x.iter().map(|&v| f64::from(v)).sum::<f64>();
        self.loss += s(l.loss);
        self.clip += s(l.clip);
        self.lower += s(l.lower);
        self.approxkl += s(l.approxkl);
        self.neg_kl += s(l.neg_kl);
        self.ratio += s(l.ratio);
        self.entropy += s(l.entropy);
        self.d_ratio += s(l.d_ratio);
        self.probe += s(l.probe);
    }
}

/// The per-chunk work of one pass: reads a lane-sized chunk of each of the five inputs
/// (log-probs, old log-probs, advantages, mask, entropies), adds to the lane sums and writes
/// a chunk of output. A trait, not a closure, so that it inlines
/// into the AVX2 copies of the row kernels.
trait Step {
    fn step(&mut self, l: &mut Lanes, ins: [&[f32; LANES]; 5], out: &mut [f32; LANES]);
}

/// `step` over the lane-sized chunks of `ins` (and of `out`, all of one length), folding the
/// lane sums into `sums` every [`BLOCK`] tokens; the tail runs as a chunk padded with zeros
/// (the mask's zeros leave the sums alone).
#[inline(always)]
fn drive<S: Step>(ins: [&[f32]; 5], out: &mut [f32], sums: &mut Sums, mut step: S) {
    let parts = ins.map(<[f32]>::as_chunks::<LANES>);
    let chunks = parts.map(|p| p.0);
    let (out_chunks, out_tail) = out.as_chunks_mut::<LANES>();
    let per = BLOCK / LANES;
    for (b, outs) in out_chunks.chunks_mut(per).enumerate() {
        let mut lanes = Lanes::default();
        for (j, o) in outs.iter_mut().enumerate() {
            let j = b * per + j;
            step.step(&mut lanes, chunks.map(|c| &c[j]), o);
        }
        sums.fold(lanes);
    }
    if !out_tail.is_empty() {
        let pad = |s: &[f32]| {
            let mut a = [0f32; LANES];
            a[..s.len()].copy_from_slice(s);
            a
        };
        let tails = parts.map(|p| pad(p.1));
        let mut o = [0f32; LANES];
        let mut lanes = Lanes::default();
        let [a, b, c, d, e] = &tails;
        step.step(&mut lanes, [a, b, c, d, e], &mut o);
        let k = out_tail.len();
        out_tail.copy_from_slice(&o[..k]);
        sums.fold(lanes);
    }
}

/// The inputs of one batch, `[rows, width]` row-major.
pub(crate) struct Inputs<'a> {
    pub logp: &'a [f32],
    pub old: &'a [f32],
    pub adv: &'a [f32],
    pub mask: &'a [f32],
    /// Token entropies to aggregate like the loss (not differentiated).
    pub entropy: Option<&'a [f32]>,
    pub width: usize,
}

/// What [`policy_loss_host`] returns.
pub(crate) struct Output {
    /// d loss / d logp, `[rows, width]`.
    pub grad: Vec<f32>,
    pub loss: f64,
    /// `(clipfrac, clipfrac_lower, approxkl, ppo_kl, ratio_mean)`.
    pub stats: [f64; 5],
    pub entropy: Option<f64>,
}

/// A thread's share of the rows: the aggregated sums and the sequence-level shares.
#[derive(Default, Clone, Copy)]
struct Part {
    sums: Sums,
    entropy: f64,
    seq_clip: f64,
    seq_lower: f64,
}

/// The loss, its gradient and the diagnostics of `cfg` over `inp`, or `None` when the mask
/// is not 0/1 or selects nothing or an input holds a NaN or an infinity (the caller's
/// checked path then names the fault).
pub(crate) fn policy_loss_host(inp: &Inputs<'_>, cfg: &PolicyLossConfig) -> Option<Output> {
    let lo = (1.0 - cfg.low()) as f32;
    let hi = (1.0 + cfg.high()) as f32;
    let ppo = Ppo { lo, hi };
    match cfg.policy_loss {
        PolicyLoss::Ppo => match cfg.clip_ratio_c {
            Some(c) => run(inp, cfg, PpoDual { ppo, c: c as f32 }),
            None => run(inp, cfg, ppo),
        },
        PolicyLoss::Cispo => run(
            inp,
            cfg,
            Cispo {
                cap: cfg.cispo_clip_max as f32,
            },
        ),
        PolicyLoss::Sapo => {
            let (pos, neg) = (cfg.sapo_temperature_pos, cfg.sapo_temperature_neg);
            run(inp, cfg, Sapo::new(pos as f32, neg as f32))
        }
    }
}

/// Valid tokens of each row, or `None` when the mask is not 0/1.
fn row_counts(mask: &[f32], width: usize) -> Option<Vec<usize>> {
    let mut bad = 0f64;
    let mut counts = Vec::with_capacity(mask.len() / width);
    for row in mask.chunks_exact(width) {
        let [n, off] = row_sums([row], &MaskTerms);
        bad += off;
        counts.push(n as usize);
    }
    (bad == 0.0).then_some(counts)
}

fn run<O: Objective>(inp: &Inputs<'_>, cfg: &PolicyLossConfig, obj: O) -> Option<Output> {
    let width = inp.width;
    let counts = row_counts(inp.mask, width)?;
    let n: usize = counts.iter().sum();
    let seqs = counts.iter().filter(|&&k| k > 0).count();
    if n == 0 {
        return None;
    }
    // d loss / d (row's token loss), from the aggregation
    let (n_f, s_f) = (n as f64, seqs as f64);
    let weights: Vec<f64> = counts
        .iter()
        .map(|&k| match cfg.loss_agg_mode {
            LossAggMode::TokenMean => 1.0 / n_f,
            LossAggMode::SeqMeanTokenSum => 1.0 / s_f,
            LossAggMode::SeqMeanTokenMean => 1.0 / ((k as f64 + 1e-8) * s_f),
            LossAggMode::SeqMeanTokenSumNorm => {
                1.0 / (s_f * cfg.loss_scale_factor.unwrap_or(width as f64))
            }
        })
        .collect();
    let sequence = cfg.importance_sampling_level == ImportanceSamplingLevel::Sequence;
    let rows = counts.len();
    let mut grad = vec![0f32; rows * width];
    let parts = split_rows(rows, width, &mut grad, |span, g| {
        let first = span.start;
        let mut part = Part::default();
        for (j, g) in g.chunks_exact_mut(width).enumerate() {
            let i = first + j;
            let span = i * width..(i + 1) * width;
            let row = Row {
                lp: &inp.logp[span.clone()],
                old: &inp.old[span.clone()],
                adv: &inp.adv[span.clone()],
                mask: &inp.mask[span.clone()],
                entropy: &inp.entropy.unwrap_or(inp.mask)[span],
                count: counts[i],
                weight: weights[i],
            };
            let s = dispatch_row(obj, sequence, &row, g);
            part.sums.loss += weights[i] * s.loss;
            part.entropy += weights[i] * s.entropy;
            part.sums.clip += s.clip;
            part.sums.lower += s.lower;
            part.sums.approxkl += s.approxkl;
            part.sums.neg_kl += s.neg_kl;
            part.sums.ratio += s.ratio;
            part.sums.probe += s.probe;
            if counts[i] > 0 {
                part.seq_clip += s.clip / counts[i] as f64;
                part.seq_lower += s.lower / counts[i] as f64;
            }
        }
        part
    });
    let mut t = Part::default();
    for p in parts {
        t.sums.loss += p.sums.loss;
        t.sums.clip += p.sums.clip;
        t.sums.lower += p.sums.lower;
        t.sums.approxkl += p.sums.approxkl;
        t.sums.neg_kl += p.sums.neg_kl;
        t.sums.ratio += p.sums.ratio;
        t.sums.probe += p.sums.probe;
        t.entropy += p.entropy;
        t.seq_clip += p.seq_clip;
        t.seq_lower += p.seq_lower;
    }
    // A NaN or an infinity in any input, masked or not, makes one of these sums NaN or
    // infinite: log-probs through `approxkl` (`0.5 diff^2 m`), advantages through the loss
    // (`value m`: every objective scales A by a positive weight), entropies through theirs
    // (`0 * inf` is NaN). A sum that overflows only sends the batch to the checked path.
    if ![t.sums.loss, t.sums.approxkl, t.entropy, t.sums.probe]
        .iter()
        .all(|x| x.is_finite())
    {
        return None;
    }
    let (clip, lower) = if sequence {
        (t.seq_clip / s_f, t.seq_lower / s_f)
    } else {
        (t.sums.clip / n_f, t.sums.lower / n_f)
    };
    Some(Output {
        grad,
        loss: t.sums.loss,
        stats: [
            clip,
            lower,
            t.sums.approxkl / n_f,
            -t.sums.neg_kl / n_f,
            t.sums.ratio / n_f,
        ],
        entropy: inp.entropy.map(|_| t.entropy),
    })
}

/// One row of the batch and its aggregation weight.
struct Row<'a> {
    lp: &'a [f32],
    old: &'a [f32],
    adv: &'a [f32],
    mask: &'a [f32],
    /// The entropies, or the mask standing in (summed, not reported) when there are none.
    entropy: &'a [f32],
    count: usize,
    weight: f64,
}

impl<'a> Row<'a> {
    fn inputs(&self) -> [&'a [f32]; 5] {
        [self.lp, self.old, self.adv, self.mask, self.entropy]
    }
}

/// The sequence level's first pass: the row's log-ratio sum, the per-token diagnostics'
/// sums (`approxkl`, the clamped log-ratio) and the masked entropy sum.
struct LogRatioTerms;

impl Terms<4, 4> for LogRatioTerms {
    #[inline(always)]
    fn terms(&self, [x, o, m, h]: [f32; 4]) -> [f32; 4] {
        let diff = x - o;
        let (nk, _) = pick_clamp(diff, -BOUND, BOUND, 1.0);
        [diff * m, 0.5 * diff * diff * m, nk * m, h * m]
    }
}

/// A mask's sum and a sum that is 0 only when every value is 0 or 1 (`|m - m^2|`, NaN
/// included).
struct MaskTerms;

impl Terms<1, 2> for MaskTerms {
    #[inline(always)]
    fn terms(&self, [m]: [f32; 1]) -> [f32; 2] {
        [m, (m - m * m).abs()]
    }
}

/// Per-token ratios: loss, gradient (times the row's weight `w`) and diagnostics.
struct TokenStep<O> {
    obj: O,
    w: f32,
}

impl<O: Objective> Step for TokenStep<O> {
    #[inline(always)]
    fn step(&mut self, l: &mut Lanes, ins: [&[f32; LANES]; 5], g: &mut [f32; LANES]) {
        let [lp, old, adv, mask, ent] = ins;
        for c in 0..LANES {
            let (x, o, a, h) = (lp[c], old[c], adv[c], ent[c]);
            let m = mask[c];
            let diff = x - o;
            let (nk, dnk) = pick_clamp(diff, -BOUND, BOUND, 1.0);
            let r = exp_f32(nk);
            let t = self.obj.tok(r, x, a);
            let d = match (O::DIRECT, O::THROUGH_RATIO) {
                (true, true) => t.d_logp + t.d_ratio * (r * dnk),
                (true, false) => t.d_logp,
                (false, _) => t.d_ratio * (r * dnk),
            };
            g[c] = self.w * m * d;
            l.loss[c] += t.value * m;
            if O::CLIPS {
                l.clip[c] += sel(t.clipped, m, 0.0);
            }
            if O::DUAL {
                l.lower[c] += sel(t.lower, m, 0.0);
            }
            l.approxkl[c] += 0.5 * diff * diff * m;
            l.neg_kl[c] += nk * m;
            l.ratio[c] += r * m;
            l.entropy[c] += h * m;
        }
    }
}

/// The sequence level's second pass at the row's ratio `r`: loss, the derivatives w.r.t.
/// `r` (summed), the clip counts and the direct gradient (times the row's weight `w`).
struct SharedRatioStep<O> {
    obj: O,
    r: f32,
    w: f32,
}

impl<O: Objective> Step for SharedRatioStep<O> {
    #[inline(always)]
    fn step(&mut self, l: &mut Lanes, ins: [&[f32; LANES]; 5], g: &mut [f32; LANES]) {
        let [lp, _, adv, mask, _] = ins;
        for c in 0..LANES {
            let m = mask[c];
            let a = adv[c];
            let t = self.obj.tok(self.r, lp[c], a);
            g[c] = if O::DIRECT {
                self.w * m * t.d_logp
            } else {
                0.0
            };
            l.loss[c] += t.value * m;
            if O::THROUGH_RATIO {
                l.d_ratio[c] += t.d_ratio * m;
            }
            if O::CLIPS {
                l.clip[c] += sel(t.clipped, m, 0.0);
            }
            if O::DUAL {
                l.lower[c] += sel(t.lower, m, 0.0);
            }
            // Redundant with the loss's own check; without it the release build's vectorizer
            // left this loop scalar (1.5x slower for the whole GSPO step).
            l.probe[c] += a * 0.0;
        }
    }
}

/// One row: its sums, with the gradient written to `g`, and when given the masked sum of its
/// entropies.
#[inline(always)]
fn row_kernel<O: Objective>(obj: O, sequence: bool, row: &Row<'_>, g: &mut [f32]) -> Sums {
    if sequence {
        sequence_row(obj, row, g)
    } else {
        token_row(obj, row, g)
    }
}

// The row kernel is compiled twice: for the baseline target and, picked at run time, with
// AVX2 (twice the vector width).

fn dispatch_row<O: Objective>(obj: O, sequence: bool, row: &Row<'_>, g: &mut [f32]) -> Sums {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { row_kernel_avx2(obj, sequence, row, g) };
    }
    row_kernel(obj, sequence, row, g)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn row_kernel_avx2<O: Objective>(obj: O, sequence: bool, row: &Row<'_>, g: &mut [f32]) -> Sums {
    row_kernel(obj, sequence, row, g)
}

/// A row with per-token ratios.
#[inline(always)]
fn token_row<O: Objective>(obj: O, row: &Row<'_>, g: &mut [f32]) -> Sums {
    let mut sums = Sums::default();
    let step = TokenStep {
        obj,
        w: row.weight as f32,
    };
    drive(row.inputs(), g, &mut sums, step);
    sums
}

/// A row with GSPO's ratio: `exp` of the mean log-ratio over the row's valid tokens, shared
/// by all of them, so each token's gradient collects the whole row's.
#[inline(always)]
fn sequence_row<O: Objective>(obj: O, row: &Row<'_>, g: &mut [f32]) -> Sums {
    let [log_ratio, approxkl, neg_kl, entropy] =
        row_sums([row.lp, row.old, row.mask, row.entropy], &LogRatioTerms);
    let mut sums = Sums {
        approxkl,
        neg_kl,
        entropy,
        ..Sums::default()
    };
    // TRL: (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    let len = row.count.max(1) as f64;
    let mean = (log_ratio / len) as f32;
    let (log_w, d_log_w) = pick_clamp(mean, -BOUND, BOUND, 1.0);
    let r = log_w.exp();
    sums.ratio = f64::from(r) * row.count as f64;
    let w = row.weight as f32;
    let mut tok = Sums::default();
    drive(row.inputs(), g, &mut tok, SharedRatioStep { obj, r, w });
    if O::THROUGH_RATIO && tok.d_ratio != 0.0 {
        // d mean / d logp = mask / len; d r / d mean = r (inside the clamp)
        let shared = (row.weight * tok.d_ratio * f64::from(r * d_log_w) / len) as f32;
        for (gk, &m) in g.iter_mut().zip(row.mask) {
            *gk += shared * m;
        }
    }
    sums.loss = tok.loss;
    sums.clip = tok.clip;
    sums.lower = tok.lower;
    sums.probe = tok.probe;
    sums
}

/// The aggregated loss as a candle op on the log-probs: forward the precomputed value,
/// backward the precomputed gradient (scaled by the incoming one).
pub(crate) struct LossWithGrad {
    pub loss: f32,
    pub grad: Tensor,
}

impl CustomOp1 for LossWithGrad {
    fn name(&self) -> &'static str {
        "rlhf-algo-policy-loss"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![self.loss]), Shape::from(())))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let scale = grad_res.to_dtype(DType::F32)?;
        if scale.to_scalar::<f32>()? == 1.0 {
            // the common case: the loss is the graph's root
            return Ok(Some(self.grad.clone()));
        }
        Ok(Some(self.grad.broadcast_mul(&scale)?))
    }
}
