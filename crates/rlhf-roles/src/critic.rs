//! The critic engine: values of the states before each response token, and value epochs
//! over this rank's shard (the same update loop as the policy, with the value loss).

use candle_core::{DType, Device, Tensor};
use rlhf_algo::{metric, value_loss, LossAggMode, ValueLossConfig};
use rlhf_collective::Communicator;
use rlhf_config::{EngineSpec, RoleSpec, Shapes};
use rlhf_core::calls::candle::mat_f32;
use rlhf_core::calls::{CriticUpdateRequest, UpdateResponse, ValuesRequest, ValuesResponse};
use rlhf_model::{Batch, LoadOptions, Model, ModelKind};

use crate::convert::{self, check_finite_masked, chunked, sequences, tokens};
use crate::engine::Values;
use crate::error::Result;
use crate::policy::wrong_engine;
use crate::train::{self, MicroOut, Prepared, StepNames, Train, TrainState};

/// The trainable value model of one critic rank.
pub struct Critic {
    pub state: TrainState,
    pub shapes: Shapes,
    pub loss: ValueLossConfig,
}

/// A critic update's tensors on the device.
pub struct CriticBatch {
    ids: Tensor,
    mask: Tensor,
    value_mask: Tensor,
    old: Tensor,
    returns: Tensor,
}

/// Values `[B, R]`: the value of the state before response token `t` (position P+t-1).
fn response_values(model: &Model, shapes: Shapes, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let batch = Batch::from_mask(ids.clone(), mask.clone())?;
    let v = model.values(&batch)?;
    Ok(v.narrow(1, shapes.prompt_len - 1, shapes.response_len)?)
}

impl Critic {
    pub fn new(spec: &RoleSpec, device: &Device) -> Result<Self> {
        let EngineSpec::Critic { train, loss } = &spec.engine else {
            return Err(wrong_engine(spec, "a critic"));
        };
        let load_opts =
            convert::load_options(spec, device, LoadOptions::training(ModelKind::Value));
        Ok(Self {
            state: TrainState::load(
                &spec.slot,
                spec.model_dir()?,
                load_opts,
                train,
                spec.micro_batch_rows,
                spec.seed,
                spec.tokenizer_dir.clone(),
            )?,
            shapes: spec.shapes,
            loss: loss.clone(),
        })
    }

    /// Value epochs over this rank's shard.
    pub fn update(
        &mut self,
        comm: &mut dyn Communicator,
        req: &CriticUpdateRequest,
    ) -> Result<UpdateResponse> {
        train::update(self, comm, req)
    }
}

impl Values for Critic {
    fn values(&self, req: &ValuesRequest) -> Result<ValuesResponse> {
        let model = &self.state.model;
        let (ids, mask) = sequences("ComputeValues", &req.0, self.shapes, model.device())?;
        let out = chunked(req.0.rows(), self.state.settings.micro_batch_rows, |idx| {
            let v = response_values(
                model,
                self.shapes,
                &convert::rows(&ids, idx)?,
                &convert::rows(&mask, idx)?,
            )?;
            Ok(vec![v.detach()])
        })?;
        Ok(ValuesResponse {
            values: mat_f32(&out[0], "values")?,
        })
    }
}

impl Train for Critic {
    type Request = CriticUpdateRequest;
    type Batch = CriticBatch;
    const NAMES: StepNames = StepNames {
        grad_norm: metric::CRITIC_GRAD_NORM,
        lr: metric::CRITIC_LR,
        variance: None,
    };

    fn state(&self) -> &TrainState {
        &self.state
    }

    fn state_mut(&mut self) -> &mut TrainState {
        &mut self.state
    }

    fn agg_mode(&self) -> LossAggMode {
        self.loss.loss_agg_mode
    }

    fn prepare(&self, req: &CriticUpdateRequest) -> Result<Prepared<CriticBatch>> {
        const CALL: &str = "UpdateCritic";
        let device = self.state.model.device();
        let (who, step, shapes) = (&self.state.who, req.step, self.shapes);
        let (ids, mask) = sequences(CALL, &req.seq, shapes, device)?;
        let b = req.seq.rows();
        let host_mask = req.value_mask.data.clone();
        let value_mask = tokens(CALL, "value_mask", &req.value_mask, b, shapes, device)?;
        check_finite_masked("values", &req.values, &host_mask, who, step)?;
        check_finite_masked("returns", &req.returns, &host_mask, who, step)?;
        Ok(Prepared {
            batch: CriticBatch {
                ids,
                mask,
                value_mask,
                old: tokens(CALL, "values", &req.values, b, shapes, device)?,
                returns: tokens(CALL, "returns", &req.returns, b, shapes, device)?,
            },
            mask: host_mask,
            width: shapes.response_len,
            step,
        })
    }

    fn micro_loss(&self, model: &Model, b: &CriticBatch, idx: &[usize]) -> Result<MicroOut> {
        let m = convert::rows(&b.value_mask, idx)?;
        let v = response_values(
            model,
            self.shapes,
            &convert::rows(&b.ids, idx)?,
            &convert::rows(&b.mask, idx)?,
        )?;
        let out = value_loss(
            &v,
            &convert::rows(&b.old, idx)?,
            &convert::rows(&b.returns, idx)?,
            &m,
            &self.loss,
        )?;
        let vpred = rlhf_algo::masked_mean(&v.detach(), &m)?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
        Ok(MicroOut {
            loss: out.weighted_loss,
            stats: vec![
                (
                    metric::LOSS_VALUE_AVG,
                    out.loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
                ),
                (metric::VAL_CLIPFRAC_AVG, out.clipfrac),
                (metric::VAL_VPRED, vpred),
            ],
        })
    }
}
