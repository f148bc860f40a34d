//! What a ZeRO-3 gather sends: each rank's pieces as little-endian values, `f32` (exact),
//! or the 16-bit dtype the model computes in, which halves the bytes of every gather a
//! computation makes and changes nothing it computes (each use casts the weights to that
//! dtype first). Whole-model gathers (saves, weight syncs, checksums) stay `f32`.

use candle_core::{DType, Device, Tensor};
use rlhf_collective::as_bytes;

use super::Piece;
use crate::error::Result;
use crate::train::host_f32 as host;

/// The values of whole parameters as they come off the wire, each rank's pieces decoded
/// straight into them: `f32`, or (a model computing in 16 bits) that compute dtype.
pub(super) enum Whole {
    F32(Vec<f32>),
    Bf16(Vec<half::bf16>),
    F16(Vec<half::f16>),
}

impl Whole {
    pub(super) fn with_capacity(wire: DType, n: usize) -> Self {
        match wire {
            DType::BF16 => Whole::Bf16(Vec::with_capacity(n)),
            DType::F16 => Whole::F16(Vec::with_capacity(n)),
            _ => Whole::F32(Vec::with_capacity(n)),
        }
    }

    /// Appends the little-endian values in `bytes`.
    pub(super) fn extend(&mut self, bytes: &[u8]) {
        let two = |c: &[u8]| u16::from_le_bytes([c[0], c[1]]);
        match self {
            Whole::F32(v) => v.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
            Whole::Bf16(v) => {
                v.extend(bytes.chunks_exact(2).map(|c| half::bf16::from_bits(two(c))))
            }
            Whole::F16(v) => v.extend(bytes.chunks_exact(2).map(|c| half::f16::from_bits(two(c)))),
        }
    }

    pub(super) fn into_tensor(self, shape: &[usize], on: &Device) -> Result<Tensor> {
        Ok(match self {
            Whole::F32(v) => Tensor::from_vec(v, shape, on)?,
            Whole::Bf16(v) => Tensor::from_vec(v, shape, on)?,
            Whole::F16(v) => Tensor::from_vec(v, shape, on)?,
        })
    }
}

/// This rank's pieces `which` as `wire` values, little-endian bytes, end to end.
pub(super) fn wire_bytes(pieces: &[Piece], which: &[usize], wire: DType) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    for &k in which {
        let t = pieces[k].var.as_tensor();
        // A rank's piece of a parameter can be empty; a cast of an empty tensor on a CUDA
        // device is a launch of no blocks, which the driver refuses (an invalid value).
        if t.elem_count() == 0 {
            continue;
        }
        match wire {
            DType::BF16 => {
                let v = t.to_dtype(wire)?.flatten_all()?.to_vec1::<half::bf16>()?;
                out.extend(v.iter().flat_map(|x| x.to_bits().to_le_bytes()));
            }
            DType::F16 => {
                let v = t.to_dtype(wire)?.flatten_all()?.to_vec1::<half::f16>()?;
                out.extend(v.iter().flat_map(|x| x.to_bits().to_le_bytes()));
            }
            _ => out.extend_from_slice(as_bytes(&host(t)?)),
        }
    }
    Ok(out)
}
