//! A [`Model`] under ZeRO stage 3: sharding it, and the decoder and head each call computes
//! with (the model's own, or a shell around the edges gathered for that call).

use std::sync::Arc;

use candle_core::{Device, Tensor};
use rlhf_collective::Communicator;

use super::{Comm, Zero3};
use crate::error::{Error, Result};
use crate::model::{Head, Model, ModelKind};
use crate::transformer::{Linear, Transformer};
use crate::weights::ParamStore;

/// The decoder and head one call computes with.
pub(crate) enum Parts<'a> {
    Own(&'a Transformer, &'a Head),
    Gathered(Box<(Transformer, Head)>),
}

impl Parts<'_> {
    pub fn body(&self) -> &Transformer {
        match self {
            Parts::Own(b, _) => b,
            Parts::Gathered(g) => &g.0,
        }
    }

    pub fn head(&self) -> &Head {
        match self {
            Parts::Own(_, h) => h,
            Parts::Gathered(g) => &g.1,
        }
    }
}

impl Model {
    /// Shards this model's parameters across the group of `comm` (ZeRO stage 3, see
    /// [`crate::zero3`]): every rank keeps only its piece of each parameter, and from now on
    /// [`Model::vars`] are those pieces, so an AdamW over them is the sharded optimizer. Every
    /// rank of the group must call it on the same model (the same weights, as loaded from one
    /// checkpoint or seed). Only a trainable model can be sharded. A LoRA model's frozen base
    /// is sharded too (its pieces in the compute dtype, gathered for each computation); only
    /// its adapters (and a value or score head) train, and their pieces are the variables.
    pub fn into_zero3(self, comm: Box<dyn Communicator>) -> Result<Self> {
        self.shard_zero3(Comm::Own(comm), false, None)
    }

    /// [`Model::into_zero3`] as `rank` of `world`, with no communicator of its own: every call
    /// that needs the group runs inside [`Zero3::lend`] (a role process lends its group's).
    /// With `offload_params` the pieces are kept in host memory (`training.offload_params`).
    pub fn into_zero3_lent(self, rank: usize, world: usize, offload_params: bool) -> Result<Self> {
        self.shard_zero3(Comm::Lent { rank, world }, offload_params, None)
    }

    /// [`Model::into_zero3_lent`] of a model loaded in host memory, computing on `device`:
    /// the pieces go there (or stay in host memory with `offload_params`), so the device
    /// never holds the whole model, only what a call gathers.
    pub fn into_zero3_lent_on(
        self,
        rank: usize,
        world: usize,
        offload_params: bool,
        device: &Device,
    ) -> Result<Self> {
        if !self.device().is_cpu() {
            return Err(Error::InvalidArgument(format!(
                "ZeRO-3 onto {device:?}: load the model in host memory first (it is on {:?})",
                self.device()
            )));
        }
        self.shard_zero3(Comm::Lent { rank, world }, offload_params, Some(device))
    }

    fn shard_zero3(mut self, comm: Comm, offload: bool, target: Option<&Device>) -> Result<Self> {
        self.check_shardable()?;
        if self.lora.is_some() {
            // Taken from the whole base while it is still here.
            self.fingerprint = Some(self.base_fingerprint()?);
        }
        let frozen = self
            .params
            .vars()
            .into_iter()
            .filter(|(name, _)| self.params.is_base(name))
            .map(|(name, _)| name)
            .collect();
        let z = Zero3::new(
            self.params.vars(),
            self.config.num_hidden_layers,
            comm,
            offload,
            target,
            self.body.compute_dtype(),
            &frozen,
        )?;
        self.adopt_zero3(z)
    }

    /// Whether this model can be sharded (ZeRO stage 3): trainable, not yet.
    pub(super) fn check_shardable(&self) -> Result<()> {
        if !self.is_trainable() {
            return Err(Error::InvalidArgument(
                "ZeRO stage 3 shards a trained model's parameters; this model is frozen \
                 (load it with trainable: true)"
                    .into(),
            ));
        }
        if self.zero3().is_some() {
            return Err(Error::InvalidArgument(
                "this model is already sharded (ZeRO stage 3)".into(),
            ));
        }
        Ok(())
    }

    /// This model computing with the sharded parameters `z` (its own become placeholders).
    pub(super) fn adopt_zero3(mut self, z: Zero3) -> Result<Self> {
        let z = Arc::new(z);
        self.params = ParamStore::from_pieces(z.piece_vars()?);
        let empty = Tensor::zeros(0, z.dtype(), z.device())?;
        self.head = match &self.head {
            Head::Lm(_) => Head::Lm(empty),
            Head::Value(l) => Head::Value(Linear::plain(
                empty.clone(),
                l.b.as_ref().map(|_| empty.clone()),
            )),
            Head::Score(_) => Head::Score(Linear::plain(empty, None)),
        };
        self.body = self.body.into_sharded(z, self.lora.clone())?;
        Ok(self)
    }

    /// The ZeRO-3 parameters, when this model is sharded ([`Model::into_zero3`]).
    pub fn zero3(&self) -> Option<&Arc<Zero3>> {
        self.body.zero3()
    }

    /// The decoder and head for one call: the model's own, or (ZeRO-3) a shell holding the
    /// edge parameters gathered for this call (a collective).
    pub(crate) fn parts(&self) -> Result<Parts<'_>> {
        let Some(z) = self.zero3() else {
            return Ok(Parts::Own(&self.body, &self.head));
        };
        let mut edges = z.gather_edges()?;
        let mut take = |name: &str| {
            edges.remove(name).ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
                location: "the gathered ZeRO-3 edge parameters".to_string(),
            })
        };
        let embed = take("model.embed_tokens.weight")?;
        let norm = take("model.norm.weight")?;
        let head = match &self.head {
            Head::Lm(_) if self.kind == ModelKind::CausalLm && self.config.tie_word_embeddings => {
                Head::Lm(embed.clone())
            }
            Head::Lm(_) => Head::Lm(take("lm_head.weight")?),
            Head::Value(l) => Head::Value(Linear::plain(
                take("score.weight")?,
                l.b.as_ref().map(|_| take("score.bias")).transpose()?,
            )),
            Head::Score(_) => Head::Score(Linear::plain(take("score.weight")?, None)),
        };
        Ok(Parts::Gathered(Box::new((
            self.body.with_edges(embed, norm),
            head,
        ))))
    }

    /// A model call with no rows of its own, outside a training pass: the same collectives as
    /// one inference forward (the edges, then every layer), for a rank whose group makes more
    /// calls than its rows need ([`Zero3::calls`]). Nothing is computed that anyone reads.
    pub fn zero3_idle_forward(&self) -> Result<()> {
        let z = self.zero3().ok_or_else(|| {
            Error::InvalidArgument("an idle ZeRO-3 forward on a model that is not sharded".into())
        })?;
        if z.in_pass() {
            return Err(Error::InvalidArgument(
                "an idle ZeRO-3 forward inside a training pass; use zero3_idle_pass".into(),
            ));
        }
        let dev = z.device().clone();
        let ids = Tensor::new(&[[0u32]], &dev)?;
        let mask = Tensor::new(&[[1u32]], &dev)?;
        self.hidden(&ids, &mask, &ids, None)?;
        Ok(())
    }

    /// A training pass with no rows of its own, for a rank whose group runs more passes than
    /// it has micro-batches: the same collectives as a pass of one forward call (the edges,
    /// every layer forward and backward, the gradients' reduce-scatters), with a zero loss,
    /// so it adds nothing to the group's gradients.
    pub fn zero3_idle_pass(&self) -> Result<()> {
        let z = self.zero3().ok_or_else(|| {
            Error::InvalidArgument("an idle ZeRO-3 pass on a model that is not sharded".into())
        })?;
        let dev = z.device().clone();
        let ids = Tensor::new(&[[0u32, 0]], &dev)?;
        let mask = Tensor::new(&[[1u32, 1]], &dev)?;
        let pos = Tensor::new(&[[0u32, 1]], &dev)?;
        z.begin_pass()?;
        let run = || -> Result<Tensor> {
            let h = self.hidden(&ids, &mask, &pos, None)?;
            super::zero_loss(&h.sum_all()?)
        };
        match run() {
            Ok(loss) => z.backward(&loss),
            Err(e) => {
                z.abort_pass()?;
                Err(e)
            }
        }
    }
}
