//! Optimizer state off the accelerator between updates (`actor_rollout.offload`): a
//! colocated trainer generates on the same device it trains on, and AdamW's two f32 moments
//! (8 bytes per parameter, twice a bf16 model) are the largest thing it does not need while
//! generating. They go to host memory before generation and come back at the next update.
//! Gradients need no such move: they live only inside an update and are freed at its end.

use candle_core::{Device, Tensor, Var};

use super::{AdamW, Moments};
use crate::error::Result;

/// Bytes of a parameter's two moments.
fn moment_bytes(m: &Tensor, v: &Tensor) -> u64 {
    ((m.elem_count() + v.elem_count()) * m.dtype().size_in_bytes()) as u64
}

impl AdamW {
    /// Moves the moments kept on an accelerator to host memory; returns the bytes moved
    /// (0 when they already are there, as on a CPU device). [`AdamW::step`] brings them back
    /// by itself.
    pub fn offload(&mut self) -> Result<u64> {
        self.move_moments(|_| Device::Cpu)
    }

    /// Brings offloaded moments back to their parameters' device; returns the bytes moved.
    pub fn reload(&mut self) -> Result<u64> {
        self.move_moments(|var| var.device().clone())
    }

    /// Moves every parameter's device-kept moments to `to(parameter)` where they are not
    /// there yet; returns the bytes moved.
    fn move_moments(&mut self, to: impl Fn(&Var) -> Device) -> Result<u64> {
        let mut bytes = 0u64;
        for s in self.slots.iter_mut() {
            let to = to(&s.var);
            if let Moments::Device { m, v } = &mut s.moments {
                if !m.device().same_device(&to) {
                    bytes += moment_bytes(m, v);
                    *m = m.to_device(&to)?;
                    *v = v.to_device(&to)?;
                }
            }
        }
        Ok(bytes)
    }

    /// Bytes of moments now in host memory that belong on an accelerator.
    pub fn offloaded_bytes(&self) -> u64 {
        self.slots
            .iter()
            .map(|s| match &s.moments {
                Moments::Device { m, v } if !m.device().same_device(s.var.device()) => {
                    moment_bytes(m, v)
                }
                _ => 0,
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::super::{AdamWConfig, Gradients};
    use super::*;

    /// Two optimizers over the same bf16 parameters, one offloaded before every step:
    /// the same updates, bit for bit. On a GPU (the `cuda` feature with a device present)
    /// the moments really leave the device and come back; on the CPU nothing moves.
    fn same_updates(device: &Device) -> Result<u64> {
        let init = Tensor::arange(0f32, 12.0, device)?
            .reshape((3, 4))?
            .affine(0.1, -0.5)?
            .to_dtype(DType::BF16)?;
        let (a, b) = (Var::from_tensor(&init)?, Var::from_tensor(&init)?);
        let cfg = AdamWConfig {
            lr: 0.05,
            weight_decay: 0.01,
            ..AdamWConfig::default()
        };
        let mut plain = AdamW::new(vec![("w".into(), a.clone())], cfg.clone())?;
        let mut off = AdamW::new(vec![("w".into(), b.clone())], cfg)?;
        let mut moved = 0;
        for step in 0..3 {
            moved += off.offload()?;
            assert_eq!(off.offloaded_bytes() > 0, !device.is_cpu());
            let g = Tensor::full(0.25f32 * (step as f32 + 1.0), (3, 4), device)?
                .to_dtype(DType::BF16)?;
            let mut grads = Gradients::default();
            grads.grads.insert("w".into(), g);
            plain.step(&grads)?;
            off.step(&grads)?;
            assert_eq!(off.offloaded_bytes(), 0, "step brings the moments back");
        }
        let (x, y) = (
            a.as_tensor()
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?,
            b.as_tensor()
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?,
        );
        assert_eq!(x, y);
        assert_ne!(
            x,
            init.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?
        );
        Ok(moved)
    }

    #[test]
    fn offloaded_moments_give_the_same_updates() -> Result<()> {
        assert_eq!(same_updates(&Device::Cpu)?, 0, "nothing moves on the CPU");
        Ok(())
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn offloaded_moments_leave_the_gpu_and_come_back() -> Result<()> {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: skipped");
            return Ok(());
        };
        // 3x4 parameters, two f32 moments, offloaded three times.
        assert_eq!(same_updates(&gpu)?, 3 * 2 * 12 * 4);
        Ok(())
    }
}
