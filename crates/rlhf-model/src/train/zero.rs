//! ZeRO stages 1 and 2 on the optimizer's side: each data-parallel rank keeps AdamW's
//! moments (8 of the 16 bytes a trained f32 parameter costs) for one contiguous range of the
//! flattened parameters only. Under stage 1 every rank computes the whole all-reduced
//! gradient; under stage 2 it receives only its range of it (a reduce-scatter,
//! [`AdamW::step_owned`]). Every rank holds the whole model, steps its range, and the group
//! exchanges the stepped ranges. What crosses ranks is plain `f32` vectors in a fixed order
//! (every parameter flattened, end to end), so the collectives live with the communicator
//! and the per-rank checkpoint shards with the roles (rlhf-roles), and this file only cuts,
//! reads and writes those vectors. AdamW is elementwise, so a sharded step gives bit for bit
//! the weights of an unsharded one on the same gradients.

use std::ops::Range;

use candle_core::{DType, Tensor, Var};

use super::{AdamW, AdamWConfig, Moments};
use crate::error::{Error, Result};

/// The part of each parameter (by element of the flattened parameter) that `rank` of `world`
/// owns: the parameters laid end to end and cut into `world` equal contiguous ranges (the
/// first `total % world` ranks one element longer). Ranges may be empty.
pub fn partition(sizes: &[usize], rank: usize, world: usize) -> Vec<Range<usize>> {
    let Range { start: lo, end: hi } = span(sizes.iter().sum(), rank, world);
    let mut off = 0;
    sizes
        .iter()
        .map(|&n| {
            let (a, b) = (lo.clamp(off, off + n), hi.clamp(off, off + n));
            off += n;
            (a - (off - n))..(b - (off - n))
        })
        .collect()
}

/// The elements of `total` (the parameters end to end) that `rank` of `world` owns.
pub fn span(total: usize, rank: usize, world: usize) -> Range<usize> {
    let bound = |r: usize| r * (total / world) + r.min(total % world);
    bound(rank)..bound(rank + 1)
}

/// A tensor's values as `f32`, flattened, in host memory.
pub(crate) fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

impl AdamW {
    /// The elements of the flattened parameters (laid end to end) this optimizer owns: all
    /// of them unless sharded.
    pub fn owned_span(&self) -> Range<usize> {
        self.span.clone()
    }

    /// Sets the moments of this optimizer's elements ([`AdamW::owned_span`], in that order)
    /// and the step count: how a checkpoint written in per-rank shards is read back, by any
    /// number of ranks.
    pub fn load_owned_moments(&mut self, m: &[f32], v: &[f32], step: usize) -> Result<()> {
        let n = self.owned_len();
        if m.len() != n || v.len() != n {
            return Err(Error::InvalidArgument(format!(
                "moments of {} and {} elements for the {n} this optimizer owns",
                m.len(),
                v.len()
            )));
        }
        let mut off = 0;
        for s in self.slots.iter_mut() {
            let k = s.owned.len();
            let (ms, vs) = (&m[off..off + k], &v[off..off + k]);
            match &mut s.moments {
                Moments::Host { m, v } => {
                    m.copy_from_slice(ms);
                    v.copy_from_slice(vs);
                }
                Moments::Device { m, v } => {
                    *m = Tensor::from_slice(ms, k, s.var.device())?;
                    *v = Tensor::from_slice(vs, k, s.var.device())?;
                }
            }
            off += k;
        }
        self.step = step;
        Ok(())
    }

    /// Elements this optimizer owns, over all parameters.
    pub fn owned_len(&self) -> usize {
        self.slots.iter().map(|s| s.owned.len()).sum()
    }

    /// The stepped parameters in the order every flattened vector lays them out: name and
    /// element count.
    pub fn param_sizes(&self) -> impl Iterator<Item = (&str, usize)> {
        self.slots
            .iter()
            .map(|s| (s.name.as_str(), s.var.elem_count()))
    }

    /// The parameter whose element is number `i` of this optimizer's own ones
    /// ([`AdamW::owned_span`]), for errors about a shard of gradients.
    pub fn owned_name_at(&self, i: usize) -> Option<&str> {
        let mut off = 0;
        for s in &self.slots {
            off += s.owned.len();
            if i < off {
                return Some(&s.name);
            }
        }
        None
    }

    /// Elements of every parameter (of the whole parameters, over a ZeRO-3 model's pieces).
    pub fn total_len(&self) -> usize {
        self.whole
            .unwrap_or_else(|| self.slots.iter().map(|s| s.var.elem_count()).sum())
    }

    /// AdamW over a ZeRO-3 model's pieces ([`crate::Model::vars`] after
    /// [`crate::Model::into_zero3`]), `rank` of `world`, of whole parameters of `total`
    /// elements: it steps its pieces whole, and its moments are exactly the range stages 1
    /// and 2 give this rank ([`AdamW::owned_span`]), so the three stages save and load the
    /// same per-rank optimizer shards.
    pub fn new_pieces(
        vars: Vec<(String, Var)>,
        cfg: AdamWConfig,
        rank: usize,
        world: usize,
        total: usize,
    ) -> Result<Self> {
        let mut o = Self::new(vars, cfg)?;
        let want = span(total, rank, world);
        let held = o.owned_len();
        if held != want.len() {
            return Err(Error::InvalidArgument(format!(
                "pieces of {held} elements for rank {rank} of {world} of {total}, whose range is {want:?}"
            )));
        }
        o.span = want;
        o.shard = (world > 1).then_some((rank, world));
        o.whole = Some(total);
        Ok(o)
    }

    /// This rank's range of parameters `which` (by position in [`AdamW::param_sizes`]), as
    /// `f32`, parameter after parameter: one bucket of the exchange after a sharded step.
    pub fn owned_values(&self, which: Range<usize>) -> Result<Vec<f32>> {
        let slots = self.slots.get(which.clone()).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "parameters {which:?} of an optimizer over {}",
                self.slots.len()
            ))
        })?;
        let mut out = Vec::with_capacity(slots.iter().map(|s| s.owned.len()).sum());
        for s in slots {
            if !s.owned.is_empty() {
                let p = s.var.as_tensor().flatten_all()?;
                let p = p.narrow(0, s.owned.start, s.owned.len())?;
                out.extend(host(&p)?);
            }
        }
        Ok(out)
    }

    /// Sets parameter `i` (by position in [`AdamW::param_sizes`]) to `values`, all of its
    /// elements in order.
    pub fn set_param_values(&mut self, i: usize, values: Vec<f32>) -> Result<()> {
        let s = self.slots.get(i).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "parameter {i} of an optimizer over {}",
                self.slots.len()
            ))
        })?;
        if values.len() != s.var.elem_count() {
            return Err(Error::InvalidArgument(format!(
                "{} values for {} of {} elements",
                values.len(),
                s.name,
                s.var.elem_count()
            )));
        }
        let t = Tensor::from_vec(values, s.var.shape(), s.var.device())?.to_dtype(s.var.dtype())?;
        s.var.set(&t)?;
        Ok(())
    }

    /// This rank's moments (first, second), each over its range, parameter after parameter.
    pub fn owned_moments(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut m_out, mut v_out) = (Vec::new(), Vec::new());
        for s in &self.slots {
            match &s.moments {
                Moments::Host { m, v } => {
                    m_out.extend_from_slice(m);
                    v_out.extend_from_slice(v);
                }
                Moments::Device { m, v } => {
                    m_out.extend(host(m)?);
                    v_out.extend(host(v)?);
                }
            }
        }
        Ok((m_out, v_out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_cover_every_element_once_in_rank_order() {
        let sizes = [5, 0, 3, 9, 1];
        let total: usize = sizes.iter().sum();
        for world in 1..=7 {
            let mut flat = Vec::new();
            for rank in 0..world {
                let parts = partition(&sizes, rank, world);
                let len: usize = parts.iter().map(|r| r.len()).sum();
                assert!(len == total / world || len == total / world + 1);
                let mut off = 0;
                for (r, &n) in parts.iter().zip(&sizes) {
                    assert!(r.end <= n);
                    flat.extend(r.clone().map(|i| off + i));
                    off += n;
                }
            }
            assert_eq!(flat, (0..total).collect::<Vec<_>>(), "world {world}");
        }
    }

    /// Two ranks stepping their halves and exchanging them end with the unsharded weights,
    /// bit for bit, over several steps (in-place host, copied host and device moments alike),
    /// whether a rank gets the whole gradient (stage 1) or only its share of it
    /// ([`AdamW::step_owned`], stage 2: rank 1 here); the gathered state is the unsharded
    /// one, and loads back into any sharding.
    #[test]
    fn sharded_steps_equal_the_unsharded_ones() -> Result<()> {
        use crate::train::{AdamWConfig, Gradients};
        use candle_core::{Device, Var};
        let dev = Device::Cpu;
        for (dtype, host_state) in [(DType::F32, false), (DType::F64, false), (DType::F64, true)] {
            let cfg = AdamWConfig {
                lr: 0.01,
                weight_decay: 0.1,
                host_state,
                ..AdamWConfig::default()
            };
            let init: Vec<(String, Tensor)> =
                [("a", vec![3usize, 4]), ("b", vec![5]), ("c", vec![2, 2])]
                    .into_iter()
                    .enumerate()
                    .map(|(i, (n, shape))| {
                        let len: usize = shape.iter().product();
                        let v: Vec<f32> = (0..len)
                            .map(|k| ((k * 7 + i * 3) % 11) as f32 * 0.1 - 0.4)
                            .collect();
                        (
                            n.to_string(),
                            Tensor::from_vec(v, shape, &dev)
                                .unwrap()
                                .to_dtype(dtype)
                                .unwrap(),
                        )
                    })
                    .collect();
            let vars = || -> Vec<(String, Var)> {
                init.iter()
                    .map(|(n, t)| (n.clone(), Var::from_tensor(t).unwrap()))
                    .collect()
            };
            let (full_vars, r0, r1) = (vars(), vars(), vars());
            let mut full = AdamW::new(full_vars.clone(), cfg.clone())?;
            let mut s0 = AdamW::new_sharded(r0.clone(), cfg.clone(), 0, 2)?;
            let mut s1 = AdamW::new_sharded(r1.clone(), cfg.clone(), 1, 2)?;
            assert_eq!(s0.owned_len() + s1.owned_len(), full.total_len());
            assert!(full.state().is_ok() && s0.state().is_err());
            for step in 0..4 {
                let loss = |vs: &[(String, Var)]| -> Result<Gradients> {
                    let mut total: Option<Tensor> = None;
                    for (i, (_, v)) in vs.iter().enumerate() {
                        let t = ((v.as_tensor().sqr()? * (1.0 + i as f64 + step as f64))?
                            .sum_all()?
                            + v.as_tensor().sum_all()?)?;
                        total = Some(match total {
                            Some(x) => (x + t)?,
                            None => t,
                        });
                    }
                    Gradients::backward(&total.unwrap(), vs)
                };
                full.step(&loss(&full_vars)?)?;
                s0.step(&loss(&r0)?)?;
                // Rank 1 gets only its share of the gradient, flattened end to end.
                let g1 = loss(&r1)?;
                let mut flat = Vec::new();
                for (n, _) in &r1 {
                    flat.extend(host(g1.get(n).unwrap())?);
                }
                assert!(s1.step_owned(&flat, 1.0).is_err(), "the whole gradient");
                s1.step_owned(&flat[s1.owned_span()], 1.0)?;
                // The exchange: each parameter's shares, joined in rank order.
                for i in 0..s0.param_sizes().count() {
                    let mut all = s0.owned_values(i..i + 1)?;
                    all.extend(s1.owned_values(i..i + 1)?);
                    s0.set_param_values(i, all.clone())?;
                    s1.set_param_values(i, all)?;
                }
            }
            for ((_, f), ((_, a), (_, b))) in full_vars.iter().zip(r0.iter().zip(&r1)) {
                let f = f
                    .as_tensor()
                    .flatten_all()?
                    .to_dtype(DType::F64)?
                    .to_vec1::<f64>()?;
                for x in [a, b] {
                    let x = x
                        .as_tensor()
                        .flatten_all()?
                        .to_dtype(DType::F64)?
                        .to_vec1::<f64>()?;
                    assert_eq!(f, x, "{dtype:?} host_state {host_state}");
                }
            }
            // The two shares, joined in rank order, are the unsharded state.
            let (m0, v0) = s0.owned_moments()?;
            let (m1, v1) = s1.owned_moments()?;
            let (m, v) = ([m0, m1].concat(), [v0, v1].concat());
            let (want, step) = full.state()?;
            assert_eq!(s0.steps(), step);
            let flat = |prefix: &str| -> Result<Vec<f32>> {
                let mut out = Vec::new();
                for (n, t) in &want {
                    if n.split_once('.').map(|(p, _)| p) == Some(prefix) {
                        out.extend(host(t)?);
                    }
                }
                Ok(out)
            };
            assert_eq!(m, flat("exp_avg")?);
            assert_eq!(v, flat("exp_avg_sq")?);
            // The whole state loads into a 3-way sharding: each rank keeps its range.
            let mut parts = Vec::new();
            for rank in 0..3 {
                let mut o = AdamW::new_sharded(vars(), cfg.clone(), rank, 3)?;
                o.load_state(&want, step)?;
                parts.push(o.owned_moments()?);
            }
            let m3: Vec<f32> = parts.iter().flat_map(|(m, _)| m.clone()).collect();
            assert_eq!(m3, m);
        }
        Ok(())
    }
}
