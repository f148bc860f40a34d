//! A ZeRO-3 model's pieces read straight from a checkpoint: each rank reads only its own
//! ranges of the memory-mapped safetensors files, so no rank ever holds the whole model, on a
//! first load or when a checkpoint's weights are restored. Sharding a loaded model
//! ([`Model::into_zero3_lent_on`]) holds all of it, in `f32`, in every rank's host memory
//! first: 28 GB per rank for a 7B model, times the ranks of a node.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Var};

use super::{Comm, Placement, Zero3};
use crate::error::{Error, Result};
use crate::load::LoadOptions;
use crate::model::Model;
use crate::weights::{Deferred, WeightFiles};

/// Where a piece comes from.
enum Source {
    /// A parameter the load made (a fresh value head): cut from it.
    Made(Var),
    /// A parameter of the checkpoint: its range read from the file.
    File(Deferred),
}

impl Model {
    /// Loads the HF model directory `dir` as rank `rank` of a ZeRO-3 group of `world`
    /// (as [`Model::into_zero3_lent_on`] of [`Model::load`] gives), reading only this rank's
    /// piece of each parameter out of the files. Pieces go to `opts.device`, or stay in host
    /// memory with `offload_params`.
    pub fn load_zero3(
        dir: impl AsRef<Path>,
        opts: &LoadOptions,
        rank: usize,
        world: usize,
        offload_params: bool,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let (config, files, generation_raw) = Self::open_dir(dir)?;
        let host = opts.clone().with_device(Device::Cpu);
        let (model, deferred) = Self::build_in(&config, Some(&files), &host, true)?;
        let mut model = model.with_source(dir, generation_raw);
        model.check_shardable()?;
        // A LoRA model's frozen base: the deferred parameters loaded as base, and any made.
        let mut frozen: BTreeMap<String, candle_core::DType> = deferred
            .iter()
            .filter_map(|(name, d)| Some((name.clone(), d.frozen?)))
            .collect();
        for (name, var) in model.params.vars() {
            if model.params.is_base(&name) {
                frozen.insert(name, var.dtype());
            }
        }
        if model.lora.is_some() {
            // Of the base in the files, the pages of a few samples only.
            let fingerprint = model.fingerprint_from(|name, n| match deferred.get(name) {
                Some(d) => {
                    // Rounded through the dtype the whole load keeps it in, as there.
                    let len = d.shape.iter().product::<usize>().min(n);
                    let t = files.read_range(&d.src, 0..len)?;
                    Ok(Some(t.to_dtype(d.frozen.unwrap_or(model.dtype()))?))
                }
                None => model.first_values(name, n),
            })?;
            model.fingerprint = Some(fingerprint);
        }
        let mut sources: BTreeMap<String, Source> = deferred
            .into_iter()
            .map(|(name, d)| (name, Source::File(d)))
            .collect();
        for (name, var) in model.params.vars() {
            sources.insert(name, Source::Made(var));
        }
        let params = sources
            .iter()
            .map(|(name, s)| {
                let shape = match s {
                    Source::Made(v) => v.dims().to_vec(),
                    Source::File(d) => d.shape.clone(),
                };
                (name.clone(), shape)
            })
            .collect();
        let sources: Vec<Source> = sources.into_values().collect();
        let at = Placement {
            num_layers: config.num_hidden_layers,
            offload: offload_params,
            device: opts.device.clone(),
            dtype: model.dtype(),
            compute: model.body.compute_dtype(),
            frozen,
        };
        let z =
            Zero3::from_source(
                params,
                at,
                Comm::Lent { rank, world },
                |k, _, range| match &sources[k] {
                    Source::Made(v) => super::shard::cut(v, range),
                    Source::File(d) => files.read_range(&d.src, range),
                },
            )?;
        drop(sources);
        model.adopt_zero3(z)
    }

    /// Restores a ZeRO-3 model's weights from the HF model directory `dir` (a checkpoint's
    /// model), reading only this rank's pieces. Every parameter is checked (present, its
    /// shape) before any is set, so a bad checkpoint changes nothing.
    pub fn load_zero3_weights(&self, dir: impl AsRef<Path>) -> Result<()> {
        let z = self.zero3().ok_or_else(|| {
            Error::InvalidArgument("load_zero3_weights on a model that is not sharded".into())
        })?;
        z.load_pieces(&WeightFiles::open(dir.as_ref())?)
    }
}

impl Zero3 {
    /// Sets this rank's piece of every parameter from `files`, after checking them all
    /// (present, their shape, a dtype a parameter can have).
    fn load_pieces(&self, files: &WeightFiles) -> Result<()> {
        let st = self.lock()?;
        let trained = || st.pieces.iter().filter(|p| p.trainable);
        for p in trained() {
            files.check_shape(&p.name, &p.shape)?;
            files.dtype(&p.name)?;
        }
        for p in trained() {
            let mine = p.ranges[self.rank].clone();
            if mine.is_empty() {
                // Nothing of it here (and casting an empty tensor on a CUDA device fails).
                continue;
            }
            let piece = files
                .read_range(&p.name, mine)?
                .to_dtype(p.var.dtype())?
                .reshape(p.var.shape())?
                .to_device(p.var.device())?;
            p.var.set(&piece)?;
        }
        Ok(())
    }
}
