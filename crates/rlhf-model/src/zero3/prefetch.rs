//! Gathering the next decoder layer while the current one computes: in a forward the layer
//! after this one, in a backward the one before. The gather runs on a thread of its own; it
//! takes the model's state (and so the communicator) before [`Zero3::prefetch_layer`]
//! returns, so every rank makes its collectives in the same order whatever the threads do:
//! the prefetch comes right after the collective that started it, and whatever this thread
//! does next with the group waits for it. The result is picked up by the next
//! [`Zero3::gather_layer`] of that layer; one that is never asked for (a call that failed
//! halfway) is dropped there.

use std::sync::{mpsc, Arc};

use super::{Gathered, Zero3};
use crate::error::{Error, Result};

/// A layer's gather under way.
pub(super) struct Prefetch {
    layer: usize,
    vars: bool,
    result: mpsc::Receiver<Result<Gathered>>,
}

fn joined(p: Prefetch) -> Result<Gathered> {
    p.result.recv().map_err(|_| {
        Error::InvalidArgument("ZeRO-3: the prefetching thread stopped without a result".into())
    })?
}

type Job = Box<dyn FnOnce() + Send>;

/// The one thread that gathers ahead for a model, for as long as the model lives. One
/// long-lived thread, not one per layer: the allocator keeps an arena per thread, and what a
/// gather allocates is then reused by the next instead of piling up in new arenas.
pub(super) struct Worker(mpsc::Sender<Job>);

impl Worker {
    fn start() -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("zero3-prefetch".into())
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .map_err(|e| {
                Error::InvalidArgument(format!("ZeRO-3: starting a prefetch thread: {e}"))
            })?;
        Ok(Self(tx))
    }
}

impl Zero3 {
    /// Starts gathering layer `i` (as variables with `vars`) on another thread.
    pub(crate) fn prefetch_layer(self: &Arc<Self>, i: usize, vars: bool) -> Result<()> {
        // An earlier prefetch nobody asked for is finished first: its collective came first.
        if let Some(stale) = self.slot()?.take() {
            joined(stale)?;
        }
        let (locked, wait) = mpsc::channel::<()>();
        let (done, result) = mpsc::channel();
        let z = Arc::clone(self);
        let job: Job = Box::new(move || {
            let gather = || {
                let st = z.lock();
                let _ = locked.send(());
                let st = &mut *st?;
                let which = st.layers.get(i).cloned().ok_or_else(|| {
                    Error::InvalidArgument(format!("ZeRO-3: no layer {i} in this model"))
                })?;
                z.gather(st, &which, vars)
            };
            let _ = done.send(gather());
        });
        {
            let mut worker = self
                .worker
                .lock()
                .map_err(|_| Error::InvalidArgument("ZeRO-3 prefetch: lock poisoned".into()))?;
            if worker.is_none() {
                *worker = Some(Worker::start()?);
            }
            let sent = worker.as_ref().map(|w| w.0.send(job));
            if !matches!(sent, Some(Ok(()))) {
                return Err(Error::InvalidArgument(
                    "ZeRO-3: the prefetch thread is gone".into(),
                ));
            }
        }
        // The thread holds the state from here on (or failed to take it).
        let _ = wait.recv();
        *self.slot()? = Some(Prefetch {
            layer: i,
            vars,
            result,
        });
        Ok(())
    }

    /// The prefetched layer `i`, if that is what was prefetched (and the caller wants what a
    /// computation uses: `computing`); any other prefetch is finished and dropped.
    pub(super) fn take_prefetched(
        &self,
        i: usize,
        vars: bool,
        computing: bool,
    ) -> Result<Option<Gathered>> {
        let Some(p) = self.slot()?.take() else {
            return Ok(None);
        };
        // A prefetch gathers what a computation uses; an exact gather does not take it.
        let hit = p.layer == i && p.vars == vars && computing;
        let g = joined(p)?;
        Ok(hit.then_some(g))
    }

    fn slot(&self) -> Result<std::sync::MutexGuard<'_, Option<Prefetch>>> {
        self.prefetched
            .lock()
            .map_err(|_| Error::InvalidArgument("ZeRO-3 prefetch: lock poisoned".into()))
    }
}
