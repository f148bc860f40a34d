//! Parameter gradients produced by checkpointed layers, waiting for [`Gradients::backward`].
//!
//! A checkpointed decoder layer (`training.gradient_checkpointing`) is one custom op whose
//! input is the layer's input only: candle asks its backward for that input's gradient and
//! nothing else. The backward recomputes the layer and gets its parameters' gradients too;
//! they are parked here, keyed by the parameter's tensor id, and
//! [`Gradients::backward`](crate::Gradients::backward) adds them to what candle's backward
//! found. Keys are tensor ids, unique per process, so models training on different threads
//! never see each other's entries.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId};

fn pending() -> &'static Mutex<HashMap<TensorId, Tensor>> {
    static PENDING: OnceLock<Mutex<HashMap<TensorId, Tensor>>> = OnceLock::new();
    PENDING.get_or_init(|| Mutex::new(HashMap::new()))
}

fn lock() -> candle_core::Result<std::sync::MutexGuard<'static, HashMap<TensorId, Tensor>>> {
    pending()
        .lock()
        .map_err(|_| candle_core::Error::Msg("checkpoint gradients: lock poisoned".into()))
}

/// Adds the gradients `grads` holds for `params` to the pending ones.
pub(crate) fn stash(params: &[Tensor], grads: &GradStore) -> candle_core::Result<()> {
    let mut map = lock()?;
    for p in params {
        if let Some(g) = grads.get(p) {
            let sum = crate::train::add_to(map.remove(&p.id()), g.clone())?;
            map.insert(p.id(), sum);
        }
    }
    Ok(())
}

/// Takes the pending gradient of one parameter.
pub(crate) fn take(param: &Tensor) -> candle_core::Result<Option<Tensor>> {
    Ok(lock()?.remove(&param.id()))
}
