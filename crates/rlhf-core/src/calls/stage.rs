//! The calls of the stages beside PPO (`trainer: sft | reward | dpo`): one optimizer step on
//! completion tokens or on preference pairs, as typed requests and their wire batches.

use serde_json::json;

use super::wire::{put, Reader};
use super::{BatchCall, Mat, RoleCall, Sequences, UpdateResponse, Wire};
use crate::batch::{DataBatch, TensorData};
use crate::error::Result;

/// `trainer: sft`: one optimizer step on the completion tokens of `seq` (the prompt
/// left-padded in the first P columns, the completion right-padded in the last R).
#[derive(Debug, Clone, PartialEq)]
pub struct SftUpdateRequest {
    pub seq: Sequences,
    /// `[B, R]`: 1.0 on the completion tokens the loss covers (a chat's assistant turns).
    pub loss_mask: Mat<f32>,
    pub step: u64,
}

/// `trainer: dpo`: one optimizer step on preference pairs; row i of `chosen` and of
/// `rejected` share a prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct PreferenceUpdateRequest {
    pub chosen: Sequences,
    /// `[B, R]`: 1.0 on the chosen completion's tokens.
    pub chosen_mask: Mat<f32>,
    pub rejected: Sequences,
    pub rejected_mask: Mat<f32>,
    /// The reference's summed log-probs of each completion (every loss but SimPO).
    pub ref_chosen: Option<Vec<f32>>,
    pub ref_rejected: Option<Vec<f32>>,
    /// KTO's KL estimate over mismatched pairs (KTO only).
    pub kto_kl: Option<f64>,
    pub step: u64,
}

/// `trainer: reward`: one Bradley–Terry optimizer step on preference pairs, scored at each
/// sequence's last token.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardModelUpdateRequest {
    pub chosen: Sequences,
    pub rejected: Sequences,
    /// Per-pair margin the chosen score must clear (the data's `margin` column).
    pub margin: Option<Vec<f32>>,
    pub step: u64,
}

impl Wire for SftUpdateRequest {
    fn to_batch(&self) -> Result<DataBatch> {
        let mut b = DataBatch::new();
        self.seq.put(&mut b)?;
        put(&mut b, "loss_mask", &self.loss_mask)?;
        b.meta.insert("step".into(), json!(self.step));
        Ok(b)
    }
    fn from_batch(call: BatchCall, b: &DataBatch) -> Result<Self> {
        let r = Reader::new(call, b)?;
        Ok(Self {
            seq: Sequences::read(&r)?,
            loss_mask: r.mat("loss_mask")?,
            step: r.u64("step")?,
        })
    }
}

impl RoleCall for SftUpdateRequest {
    const CALL: BatchCall = BatchCall::UpdateSft;
    type Response = UpdateResponse;
}

fn put_vec(b: &mut DataBatch, name: &str, v: &[f32]) -> Result<()> {
    b.tensors
        .insert(name.into(), TensorData::from_f32(vec![v.len()], v)?);
    Ok(())
}

fn opt_vec(r: &Reader<'_>, b: &DataBatch, name: &str) -> Result<Option<Vec<f32>>> {
    if b.tensors.contains_key(name) {
        r.vec(name).map(Some)
    } else {
        Ok(None)
    }
}

impl Wire for PreferenceUpdateRequest {
    fn to_batch(&self) -> Result<DataBatch> {
        let mut b = DataBatch::new();
        self.chosen.put_as(&mut b, "chosen_")?;
        self.rejected.put_as(&mut b, "rejected_")?;
        put(&mut b, "chosen_mask", &self.chosen_mask)?;
        put(&mut b, "rejected_mask", &self.rejected_mask)?;
        if let Some(v) = &self.ref_chosen {
            put_vec(&mut b, "ref_chosen", v)?;
        }
        if let Some(v) = &self.ref_rejected {
            put_vec(&mut b, "ref_rejected", v)?;
        }
        if let Some(kl) = self.kto_kl {
            b.meta.insert("kto_kl".into(), json!(kl));
        }
        b.meta.insert("step".into(), json!(self.step));
        Ok(b)
    }
    fn from_batch(call: BatchCall, b: &DataBatch) -> Result<Self> {
        let r = Reader::new(call, b)?;
        let kto_kl = match b.meta.get("kto_kl") {
            None => None,
            Some(v) => Some(
                v.as_f64()
                    .ok_or_else(|| r.fail(format!("meta 'kto_kl' must be a number, got {v}")))?,
            ),
        };
        Ok(Self {
            chosen: Sequences::read_as(&r, "chosen_")?,
            rejected: Sequences::read_as(&r, "rejected_")?,
            chosen_mask: r.mat("chosen_mask")?,
            rejected_mask: r.mat("rejected_mask")?,
            ref_chosen: opt_vec(&r, b, "ref_chosen")?,
            ref_rejected: opt_vec(&r, b, "ref_rejected")?,
            kto_kl,
            step: r.u64("step")?,
        })
    }
}

impl RoleCall for PreferenceUpdateRequest {
    const CALL: BatchCall = BatchCall::UpdatePreference;
    type Response = UpdateResponse;
}

impl Wire for RewardModelUpdateRequest {
    fn to_batch(&self) -> Result<DataBatch> {
        let mut b = DataBatch::new();
        self.chosen.put_as(&mut b, "chosen_")?;
        self.rejected.put_as(&mut b, "rejected_")?;
        if let Some(m) = &self.margin {
            put_vec(&mut b, "margin", m)?;
        }
        b.meta.insert("step".into(), json!(self.step));
        Ok(b)
    }
    fn from_batch(call: BatchCall, b: &DataBatch) -> Result<Self> {
        let r = Reader::new(call, b)?;
        Ok(Self {
            chosen: Sequences::read_as(&r, "chosen_")?,
            rejected: Sequences::read_as(&r, "rejected_")?,
            margin: opt_vec(&r, b, "margin")?,
            step: r.u64("step")?,
        })
    }
}

impl RoleCall for RewardModelUpdateRequest {
    const CALL: BatchCall = BatchCall::UpdateRewardModel;
    type Response = UpdateResponse;
}
