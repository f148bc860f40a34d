//! Plans for collectives whose ranks contribute unequal blocks, cut into one step per rank
//! (a broadcast from it, or a reduce to it), as PyTorch's ProcessGroupNCCL runs an
//! all_gather of unequal sizes. Why: ZeRO ranks own contiguous slices of the flattened
//! model, so a layer or a bucket usually sits on one rank; NCCL's equal-block all_gather
//! then pads every rank's block to the largest and stages `world × largest` bytes (Qwen2.5-7B
//! at ZeRO stage 3 on 4 ranks: four times each layer). Per-rank steps stage the payload
//! itself, reduced or broadcast in place, never more. The plan is pure so it is tested on
//! real model layouts without a GPU; the nccl backend's all_gather and reduce_scatter run it.

#![cfg_attr(not(feature = "nccl"), allow(dead_code))]

/// One rank's block: on every rank at `offset..offset + len` of the whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Step {
    /// The rank the block comes from (gather) or goes to (reduce-scatter).
    pub root: usize,
    pub offset: usize,
    pub len: usize,
}

/// The steps of one uneven collective, in rank order; ranks with an empty block have none,
/// and every rank derives the same plan from the same lengths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UnevenPlan {
    pub steps: Vec<Step>,
    /// Each rank's block length, by rank.
    pub lens: Vec<usize>,
    /// The whole: every block end to end.
    pub payload: usize,
}

impl UnevenPlan {
    pub(crate) fn new(lens: &[usize]) -> Self {
        let mut offset = 0;
        let mut steps = Vec::new();
        for (root, &len) in lens.iter().enumerate() {
            if len > 0 {
                steps.push(Step { root, offset, len });
            }
            offset += len;
        }
        Self {
            steps,
            lens: lens.to_vec(),
            payload: offset,
        }
    }

    /// Where `rank`'s block sits in the whole.
    pub(crate) fn offset_of(&self, rank: usize) -> usize {
        self.lens[..rank].iter().sum()
    }

    /// Device bytes (in elements) an all-gather by this plan stages: the whole, into which
    /// each step broadcasts its block in place.
    pub(crate) fn gather_staging(&self) -> usize {
        self.payload
    }

    /// Elements a reduce-scatter by this plan stages on `rank`: the whole input, reduced in
    /// place to each block's owner in turn (the owner's result lands in its own block).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn reduce_scatter_staging(&self, _rank: usize) -> usize {
        self.payload
    }

    /// What NCCL's equal-block all_gather stages: every block padded to the largest, once
    /// per rank, plus this rank's padded block as input.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn padded_gather_staging(&self) -> usize {
        let block = self.lens.iter().copied().max().unwrap_or(0);
        block * self.lens.len() + block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The elements of `total` that `rank` of `world` owns: ZeRO's contiguous equal cut
    /// (the first `total % world` ranks one longer), as rlhf_model::train::zero::span.
    fn span(total: usize, rank: usize, world: usize) -> std::ops::Range<usize> {
        let bound = |r: usize| r * (total / world) + r.min(total % world);
        bound(rank)..bound(rank + 1)
    }

    /// A decoder-only model's parameters in layout order, as units a ZeRO-3 pass gathers
    /// whole: the edges (embeddings, final norm, LM head) and each layer.
    struct Shape {
        vocab: usize,
        hidden: usize,
        layers: usize,
        kv_dim: usize,
        inter: usize,
        qkv_bias: bool,
    }

    impl Shape {
        /// Qwen2.5-7B: q/k/v biases, 4 KV heads of 128, untied head.
        fn qwen2_7b() -> Self {
            Shape {
                vocab: 152_064,
                hidden: 3584,
                layers: 28,
                kv_dim: 512,
                inter: 18_944,
                qkv_bias: true,
            }
        }

        /// Llama-3-8B: no biases, 8 KV heads of 128, untied head.
        fn llama3_8b() -> Self {
            Shape {
                vocab: 128_256,
                hidden: 4096,
                layers: 32,
                kv_dim: 1024,
                inter: 14_336,
                qkv_bias: false,
            }
        }

        /// (unit name, its parameter sizes) in layout order.
        fn units(&self) -> Vec<(String, Vec<usize>)> {
            let (h, kv) = (self.hidden, self.kv_dim);
            let bias = |n: usize| if self.qkv_bias { n } else { 0 };
            let layer = vec![
                h,
                h * h + bias(h),
                kv * h + bias(kv),
                kv * h + bias(kv),
                h * h,
                h,
                self.inter * h,
                self.inter * h,
                h * self.inter,
            ];
            let mut out = vec![("embed".to_string(), vec![self.vocab * h])];
            for l in 0..self.layers {
                out.push((format!("layer {l}"), layer.clone()));
            }
            out.push(("norm+head".to_string(), vec![h, self.vocab * h]));
            out
        }
    }

    /// Each rank's share of every unit, under ZeRO's cut of the whole model over `world`.
    fn shares(shape: &Shape, world: usize) -> Vec<(String, Vec<usize>)> {
        let units = shape.units();
        let total: usize = units.iter().flat_map(|(_, s)| s).sum();
        let mut at = 0;
        units
            .into_iter()
            .map(|(name, sizes)| {
                let n: usize = sizes.iter().sum();
                let lens = (0..world)
                    .map(|r| {
                        let own = span(total, r, world);
                        own.end.min(at + n).saturating_sub(own.start.max(at))
                    })
                    .collect();
                at += n;
                (name, lens)
            })
            .collect()
    }

    /// Runs `plan` as every rank would (each step's root broadcasts into its range) and
    /// returns what one rank ends with.
    fn simulate(plan: &UnevenPlan, blocks: &[Vec<u8>]) -> Vec<u8> {
        let mut out = vec![0u8; plan.gather_staging()];
        for s in &plan.steps {
            out[s.offset..s.offset + s.len].copy_from_slice(&blocks[s.root]);
        }
        out
    }

    #[test]
    fn a_plan_puts_each_rank_s_block_at_its_offset_and_skips_empty_ones() {
        let p = UnevenPlan::new(&[3, 0, 5, 2]);
        assert_eq!(
            p.steps,
            vec![
                Step {
                    root: 0,
                    offset: 0,
                    len: 3
                },
                Step {
                    root: 2,
                    offset: 3,
                    len: 5
                },
                Step {
                    root: 3,
                    offset: 8,
                    len: 2
                },
            ]
        );
        assert_eq!((p.payload, p.offset_of(2), p.offset_of(3)), (10, 3, 8));
        let blocks: Vec<Vec<u8>> = p
            .lens
            .iter()
            .enumerate()
            .map(|(r, &n)| vec![r as u8; n])
            .collect();
        assert_eq!(simulate(&p, &blocks), blocks.concat());
        assert!(UnevenPlan::new(&[0, 0]).steps.is_empty());
    }

    /// Real layouts at N = 2 and 4, bf16: every gather unit's plan rebuilds the unit, and
    /// stages at most the payload plus one block (a reduce-scatter) where the padded
    /// all_gather stages `N × largest` (plus its input): for a unit on one rank, N times
    /// the payload.
    #[test]
    fn on_llama_and_qwen2_layouts_staging_never_exceeds_payload_plus_one_block() {
        for (model, shape) in [
            ("Qwen2.5-7B", Shape::qwen2_7b()),
            ("Llama-3-8B", Shape::llama3_8b()),
        ] {
            for world in [2usize, 4] {
                let mut whole_on_one = 0;
                let (mut planned, mut padded) = (0u128, 0u128);
                for (unit, lens) in shares(&shape, world) {
                    let bytes: Vec<usize> = lens.iter().map(|n| n * 2).collect();
                    let p = UnevenPlan::new(&bytes);
                    let largest = *bytes.iter().max().unwrap();
                    assert_eq!(p.payload, bytes.iter().sum::<usize>(), "{model} {unit}");
                    assert!(p.gather_staging() <= p.payload + largest, "{model} {unit}");
                    for r in 0..world {
                        assert!(
                            p.reduce_scatter_staging(r) <= p.payload + largest,
                            "{model} N={world} {unit} rank {r}"
                        );
                    }
                    let covered: usize = p.steps.iter().map(|s| s.len).sum();
                    assert_eq!(covered, p.payload, "{model} {unit}: every byte once");
                    if p.steps.len() == 1 {
                        whole_on_one += 1;
                        assert_eq!(p.padded_gather_staging(), (world + 1) * p.payload);
                    }
                    planned += p.gather_staging() as u128;
                    padded += p.padded_gather_staging() as u128;
                }
                // Most units sit on one rank: the padded gather stages N+1 times their size.
                assert!(
                    whole_on_one * 2 > shape.layers,
                    "{model} N={world}: {whole_on_one} units on one rank"
                );
                assert!(
                    padded > planned * world as u128 * 9 / 10,
                    "{model} N={world}: padded {padded} vs planned {planned}"
                );
            }
        }
    }

    /// The gather that motivated this: one Qwen2.5-7B layer (233 M parameters, 466 MB in
    /// bf16) on one of 4 ranks. The padded all_gather stages 4 × 466 MB plus its input;
    /// the plan, the layer once.
    #[test]
    fn a_qwen2_layer_on_one_of_four_ranks_stages_once_not_four_times() {
        let shape = Shape::qwen2_7b();
        let layer: usize = shape.units()[1].1.iter().sum::<usize>() * 2;
        assert_eq!(layer, 466_115_584);
        let p = UnevenPlan::new(&[0, layer, 0, 0]);
        assert_eq!(p.gather_staging(), layer);
        assert_eq!(p.padded_gather_staging(), 5 * layer);
    }

    /// The reduce-scatter the nccl backend runs by a plan, simulated: each step reduces its
    /// range of every rank's buffer into the owner's copy (in place), so every rank's
    /// segment ends as the sum of all ranks' copies of it, for uneven counts with an empty
    /// segment.
    #[test]
    fn a_reduce_scatter_by_plan_leaves_each_rank_the_reduction_of_its_segment() {
        let counts = [3usize, 0, 5, 2];
        let total: usize = counts.iter().sum();
        let inputs: Vec<Vec<f32>> = (0..4)
            .map(|r| (0..total).map(|i| (r * 100 + i) as f32).collect())
            .collect();
        let mut bufs = inputs.clone();
        let p = UnevenPlan::new(&counts);
        for s in &p.steps {
            let sum: Vec<f32> = (s.offset..s.offset + s.len)
                .map(|i| inputs.iter().map(|b| b[i]).sum())
                .collect();
            bufs[s.root][s.offset..s.offset + s.len].copy_from_slice(&sum);
        }
        for (r, &n) in counts.iter().enumerate() {
            let at = p.offset_of(r);
            let want: Vec<f32> = (at..at + n)
                .map(|i| inputs.iter().map(|b| b[i]).sum())
                .collect();
            assert_eq!(&bufs[r][at..at + n], want.as_slice(), "rank {r}");
        }
        assert_eq!(p.reduce_scatter_staging(2), total);
    }
}
