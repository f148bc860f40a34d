//! Input checks shared by every public function.
//!
//! The checks run on the tensor's own device: a finiteness test is one
//! reduction (`x - x` is NaN exactly where `x` is NaN or infinite), and only when
//! it fails is the tensor copied to the host to find the first bad element.

use candle_core::{CpuStorage, DType, Storage, StorageRef, Tensor};

use crate::error::{AlgoError, Result};

/// Multi-index of the flat position `flat` in a row-major tensor of shape `dims`.
pub(crate) fn unravel(mut flat: usize, dims: &[usize]) -> Vec<usize> {
    let mut index = vec![0; dims.len()];
    for (i, &d) in dims.iter().enumerate().rev() {
        if d > 0 {
            index[i] = flat % d;
            flat /= d;
        }
    }
    index
}

pub(crate) fn check_f32(name: &'static str, t: &Tensor) -> Result<()> {
    if t.dtype() != DType::F32 {
        return Err(AlgoError::DType {
            tensor: name,
            got: format!("{:?}", t.dtype()),
        });
    }
    Ok(())
}

/// Checks that `t` is a 2-D f32 tensor and returns `(batch, len)`.
pub(crate) fn check_2d(name: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    check_f32(name, t)?;
    match t.dims() {
        &[b, l] => Ok((b, l)),
        d => Err(AlgoError::BadRank {
            tensor: name,
            expected: "a 2-D tensor [batch, response_len]",
            got: d.to_vec(),
        }),
    }
}

/// Checks that `t` is a 1-D f32 tensor of length `batch`.
pub(crate) fn check_batch_vec(name: &'static str, t: &Tensor, batch: usize) -> Result<()> {
    check_f32(name, t)?;
    match t.dims() {
        &[b] if b == batch => Ok(()),
        &[_] => Err(AlgoError::ShapeMismatch {
            tensor: name,
            got: t.dims().to_vec(),
            other: "the batch size of response_mask",
            expected: vec![batch],
        }),
        d => Err(AlgoError::BadRank {
            tensor: name,
            expected: "a 1-D tensor [batch]",
            got: d.to_vec(),
        }),
    }
}

pub(crate) fn check_same_shape(
    name: &'static str,
    t: &Tensor,
    other_name: &'static str,
    other: &Tensor,
) -> Result<()> {
    check_f32(name, t)?;
    if t.dims() != other.dims() {
        return Err(AlgoError::ShapeMismatch {
            tensor: name,
            got: t.dims().to_vec(),
            other: other_name,
            expected: other.dims().to_vec(),
        });
    }
    Ok(())
}

/// 0 for a finite `x`, NaN for a NaN or an infinity: summed over a slice, a finiteness test
/// in plain arithmetic, which vectorizes (a search for the first bad element does not).
#[inline(always)]
pub(crate) fn finite_probe(x: f32) -> f32 {
    x * 0.0
}

/// Whether every element is finite ([`finite_probe`] summed in lanes).
fn all_finite(data: &[f32]) -> bool {
    let (chunks, tail) = data.as_chunks::<8>();
    let mut probe = [0f32; 8];
    for ch in chunks {
        for c in 0..8 {
            probe[c] += finite_probe(ch[c]);
        }
    }
    for (c, &x) in tail.iter().enumerate() {
        probe[c] += finite_probe(x);
    }
    probe.iter().all(|&p| p == 0.0)
}

/// Finds the first NaN or infinity in a host slice.
pub(crate) fn find_non_finite(name: &'static str, data: &[f32], dims: &[usize]) -> Result<()> {
    if all_finite(data) {
        return Ok(());
    }
    if let Some(pos) = data.iter().position(|v| !v.is_finite()) {
        let v = data[pos];
        let kind = if v.is_nan() {
            "NaN"
        } else if v > 0.0 {
            "inf"
        } else {
            "-inf"
        };
        return Err(AlgoError::NonFinite {
            tensor: name,
            kind,
            index: unravel(pos, dims),
        });
    }
    Ok(())
}

/// Checks that every element of `t` is finite.
pub(crate) fn check_finite(name: &'static str, t: &Tensor) -> Result<()> {
    let t = t.detach();
    if t.device().is_cpu() {
        // On the host a scan of the buffer is cheaper than two tensor ops.
        let data = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        return find_non_finite(name, &data, t.dims());
    }
    check_finite_on_device(name, &t)
}

/// The accelerator path of [`check_finite`]: one reduction, and a host copy
/// only when it finds something.
pub(crate) fn check_finite_on_device(name: &'static str, t: &Tensor) -> Result<()> {
    let probe = t
        .sub(t)?
        .sum_all()?
        .to_dtype(DType::F32)?
        .to_scalar::<f32>()?;
    if probe == 0.0 {
        return Ok(());
    }
    let data = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    find_non_finite(name, &data, t.dims())
}

/// Checks a 0/1 mask on the host; returns the number of valid positions.
pub(crate) fn check_mask_host(name: &'static str, data: &[f32], dims: &[usize]) -> Result<usize> {
    // Counted in lanes that vectorize (`|m - m^2|` is 0 exactly for 0 and 1); the scan
    // below finds what is wrong, if anything.
    let (chunks, tail) = data.as_chunks::<8>();
    let (mut ones, mut other) = ([0f64; 8], [0f64; 8]);
    for block in chunks.chunks(1 << 16) {
        // f32 counts are exact to 2^24 per lane
        let (mut o, mut x) = ([0f32; 8], [0f32; 8]);
        for ch in block {
            for c in 0..8 {
                o[c] += ch[c];
                x[c] += (ch[c] - ch[c] * ch[c]).abs();
            }
        }
        for c in 0..8 {
            ones[c] += f64::from(o[c]);
            other[c] += f64::from(x[c]);
        }
    }
    for (c, &v) in tail.iter().enumerate() {
        ones[c] += f64::from(v);
        other[c] += f64::from((v - v * v).abs());
    }
    if other.iter().all(|&x| x == 0.0) {
        let count = ones.iter().map(|&x| x as usize).sum::<usize>();
        if count > 0 {
            return Ok(count);
        }
    }
    let mut count = 0usize;
    for (i, &v) in data.iter().enumerate() {
        if v == 1.0 {
            count += 1;
        } else if v != 0.0 {
            return Err(AlgoError::NonBinaryMask {
                tensor: name,
                value: v,
                index: unravel(i, dims),
            });
        }
    }
    if count == 0 {
        return Err(AlgoError::EmptyMask { tensor: name });
    }
    Ok(count)
}

/// Checks a 0/1 mask (on its device unless it lives on the host); returns the
/// number of valid positions.
pub(crate) fn check_mask(name: &'static str, mask: &Tensor) -> Result<usize> {
    check_2d(name, mask)?;
    let mask = mask.detach();
    if mask.device().is_cpu() {
        let data = mask.flatten_all()?.to_vec1::<f32>()?;
        return check_mask_host(name, &data, mask.dims());
    }
    check_mask_on_device(name, &mask)
}

/// The accelerator path of [`check_mask`].
pub(crate) fn check_mask_on_device(name: &'static str, mask: &Tensor) -> Result<usize> {
    // m * (m - 1) is zero exactly for m in {0, 1}; NaN also makes it non-zero.
    let off = mask
        .mul(&mask.affine(1.0, -1.0)?)?
        .abs()?
        .sum_all()?
        .to_scalar::<f32>()?;
    if off != 0.0 {
        let data = mask.flatten_all()?.to_vec1::<f32>()?;
        return check_mask_host(name, &data, mask.dims());
    }
    let count = mask.sum_all()?.to_scalar::<f32>()?;
    if count == 0.0 {
        return Err(AlgoError::EmptyMask { tensor: name });
    }
    Ok(count as usize)
}

/// Full check of a `[batch, len]` tensor against the response mask.
pub(crate) fn check_token_tensor(name: &'static str, t: &Tensor, mask: &Tensor) -> Result<()> {
    check_same_shape(name, t, "response_mask", mask)?;
    check_finite(name, t)
}

/// Copies a 2-D f32 tensor to a flat host vector.
pub(crate) fn host_vec(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

pub(crate) fn check_positive(key: &'static str, v: f64) -> Result<()> {
    if !(v.is_finite() && v > 0.0) {
        return Err(AlgoError::InvalidConfig {
            key,
            value: v.to_string(),
            reason: "must be a finite number > 0".into(),
        });
    }
    Ok(())
}

pub(crate) fn check_non_negative(key: &'static str, v: f64) -> Result<()> {
    if !(v.is_finite() && v >= 0.0) {
        return Err(AlgoError::InvalidConfig {
            key,
            value: v.to_string(),
            reason: "must be a finite number >= 0".into(),
        });
    }
    Ok(())
}

pub(crate) fn check_unit_interval(key: &'static str, v: f64) -> Result<()> {
    if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
        return Err(AlgoError::InvalidConfig {
            key,
            value: v.to_string(),
            reason: "must lie in [0, 1]".into(),
        });
    }
    Ok(())
}

/// `x` clamped to `[lo, hi]` from differentiable ops. candle's scalar `clamp`
/// broadcasts a 0-d tensor and takes a slow strided path; full tensors keep the
/// binary ops contiguous.
pub(crate) fn clamp(x: &Tensor, lo: f32, hi: f32) -> Result<Tensor> {
    let lo = Tensor::full(lo, x.shape(), x.device())?;
    let hi = Tensor::full(hi, x.shape(), x.device())?;
    Ok(x.maximum(&lo)?.minimum(&hi)?)
}

/// A tensor's `f32` elements on the host, in row-major order: borrowed from the storage of
/// a contiguous `f32` CPU tensor (no copy; the storage stays read-locked while the view
/// lives, so drop it before running ops on the same tensor), copied otherwise.
pub(crate) enum HostSlice<'a> {
    Borrowed {
        guard: StorageRef<'a>,
        start: usize,
        end: usize,
    },
    Owned(Vec<f32>),
}

impl<'a> HostSlice<'a> {
    /// The view of `t` (any shape; an `f32` copy of other dtypes).
    pub(crate) fn new(t: &'a Tensor) -> Result<Self> {
        let (guard, layout) = t.storage_and_layout();
        let offsets = layout.contiguous_offsets();
        if let (Storage::Cpu(CpuStorage::F32(_)), Some((start, end))) = (&*guard, offsets) {
            return Ok(Self::Borrowed { guard, start, end });
        }
        drop(guard);
        let data = t
            .detach()
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        Ok(Self::Owned(data))
    }
}

impl std::ops::Deref for HostSlice<'_> {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            Self::Borrowed { guard, start, end } => match &**guard {
                Storage::Cpu(CpuStorage::F32(data)) => &data[*start..*end],
                // `new` borrows f32 CPU storage only
                _ => &[],
            },
            Self::Owned(data) => data,
        }
    }
}

/// A validated host copy of a CPU response mask, used to validate and copy
/// the token tensors of the same batch in one pass each.
pub(crate) struct HostMask {
    pub data: Vec<f32>,
    pub n: usize,
    dims: Vec<usize>,
}

impl HostMask {
    pub(crate) fn new(name: &'static str, mask: &Tensor) -> Result<Self> {
        check_2d(name, mask)?;
        let data = host_vec(&mask.detach())?;
        let n = check_mask_host(name, &data, mask.dims())?;
        Ok(Self {
            data,
            n,
            dims: mask.dims().to_vec(),
        })
    }

    /// Checks dtype, shape and finiteness of `t` and returns its host copy.
    pub(crate) fn token(&self, name: &'static str, t: &Tensor) -> Result<Vec<f32>> {
        check_f32(name, t)?;
        if t.dims() != self.dims.as_slice() {
            return Err(AlgoError::ShapeMismatch {
                tensor: name,
                got: t.dims().to_vec(),
                other: "response_mask",
                expected: self.dims.clone(),
            });
        }
        let data = host_vec(&t.detach())?;
        find_non_finite(name, &data, &self.dims)?;
        Ok(data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn unravel_row_major() {
        assert_eq!(unravel(0, &[4, 10]), vec![0, 0]);
        assert_eq!(unravel(37, &[4, 10]), vec![3, 7]);
        assert_eq!(unravel(5, &[6]), vec![5]);
    }

    #[test]
    fn finite_check_names_the_position() {
        let mut data = vec![0.5f32; 40];
        data[3 * 10 + 7] = f32::NAN;
        let t = Tensor::from_vec(data, (4, 10), &Device::Cpu).unwrap();
        let err = check_finite("values", &t).unwrap_err().to_string();
        assert_eq!(
            err.split(';').next().unwrap(),
            "values: contains NaN at [3, 7]"
        );
    }

    #[test]
    fn device_paths_agree_with_host_paths() {
        let dev = Device::Cpu;
        let ok = Tensor::from_vec(vec![0.5f32; 12], (3, 4), &dev).unwrap();
        assert!(check_finite_on_device("x", &ok).is_ok());
        for (v, kind) in [
            (f32::NAN, "NaN"),
            (f32::INFINITY, "inf"),
            (f32::NEG_INFINITY, "-inf"),
        ] {
            let mut d = vec![0.5f32; 12];
            d[6] = v;
            let t = Tensor::from_vec(d, (3, 4), &dev).unwrap();
            let err = check_finite_on_device("x", &t).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("x: contains {kind} at [1, 2]")),
                "{err}"
            );
        }
        let m = Tensor::from_vec(vec![1f32, 1.0, 0.0, 1.0, 0.0, 0.0], (2, 3), &dev).unwrap();
        assert_eq!(check_mask_on_device("m", &m).unwrap(), 3);
        let bad = Tensor::from_vec(vec![1f32, 2.0, 0.0, 1.0, 0.0, 0.0], (2, 3), &dev).unwrap();
        let err = check_mask_on_device("m", &bad).unwrap_err().to_string();
        assert!(err.contains("found 2 at [0, 1]"), "{err}");
        let z = Tensor::zeros((2, 3), DType::F32, &dev).unwrap();
        assert!(matches!(
            check_mask_on_device("m", &z),
            Err(AlgoError::EmptyMask { .. })
        ));
    }

    #[test]
    fn mask_check_rejects_non_binary_and_empty() {
        let t = Tensor::from_vec(vec![1f32, 0.5, 0.0, 1.0], (2, 2), &Device::Cpu).unwrap();
        let err = check_mask("response_mask", &t).unwrap_err().to_string();
        assert!(err.contains("0.5 at [0, 1]"), "{err}");
        let z = Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap();
        assert!(matches!(
            check_mask("response_mask", &z),
            Err(AlgoError::EmptyMask { .. })
        ));
        let ok = Tensor::from_vec(vec![1f32, 1.0, 0.0, 1.0], (2, 2), &Device::Cpu).unwrap();
        assert_eq!(check_mask("response_mask", &ok).unwrap(), 3);
    }
}
