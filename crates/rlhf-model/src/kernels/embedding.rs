//! The token embedding of a training step: rows of the (f32 master) table gathered, then cast
//! to the compute dtype, with a backward of its own.
//!
//! candle's backward of `index_select` is an `index_add` into a zero-filled table-sized
//! gradient, and its CUDA kernel gives each column one thread that walks every token in turn:
//! at Qwen2.5-0.5B's shape (896 columns, 4,096 tokens, a 152k x 896 table) that took ~10 ms of
//! a 120 ms step. The kernel here gives each token's row a block, and the first row of each id
//! sums all of that id's rows in token order: deterministic, and with no atomics.

use super::*;
use crate::replay;

/// The `[v, h]` table gradient from ids `[n]` and row gradients `[n, h]`.
struct EmbeddingBwd {
    v: usize,
}

fn embedding_bwd<T: Real>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    v: usize,
) -> CResult<(CpuStorage, Shape)> {
    let ids = u32_data(s1, l1, "embedding_bwd")?;
    let g = data::<T>(s2, l2, "embedding_bwd")?;
    let n = ids.len();
    if n == 0 || !g.len().is_multiple_of(n) {
        return Err(err(format!(
            "embedding_bwd: {n} ids for gradients of shape {:?}",
            l2.dims()
        )));
    }
    let h = g.len() / n;
    let mut out = vec![T::zero(); v * h];
    for (r, &id) in ids.iter().enumerate() {
        let id = id as usize;
        if id >= v {
            continue;
        }
        for (o, &x) in out[id * h..(id + 1) * h]
            .iter_mut()
            .zip(&g[r * h..(r + 1) * h])
        {
            *o = o.add(x);
        }
    }
    Ok((T::wrap(out), Shape::from((v, h))))
}

impl CustomOp2 for EmbeddingBwd {
    fn name(&self) -> &'static str {
        "fused-embedding-bwd"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &Cs, l1: &Layout, s2: &Cs, l2: &Layout) -> CResult<(Cs, Shape)> {
        cuda::embedding_bwd((s1, l1), (s2, l2), self.v)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        dispatch!(s2, self.name(), embedding_bwd, s1, l1, s2, l2, self.v)
    }
}

/// Rows `ids` `[n]` of the table `w` `[v, h]`, as `[n, h]` in `dtype`; differentiable in `w`
/// (the gradient comes back in `w`'s dtype).
pub(crate) fn embedding(w: &Tensor, ids: &Tensor, dtype: DType) -> CResult<Tensor> {
    let ids = ids.to_dtype(DType::U32)?.contiguous()?.flatten_all()?;
    let out = w.detach().index_select(&ids, 0)?.to_dtype(dtype)?;
    let v = w.dim(0)?;
    replay::attach1("fused-embedding", w, &out, move |w, g| {
        let dw = ids.apply_op2_no_bwd(&g.detach().contiguous()?, &EmbeddingBwd { v })?;
        Ok(Some(dw.to_dtype(w.dtype())?))
    })
    .map_err(|e| err(e.to_string()))
}
