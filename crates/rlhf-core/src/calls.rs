//! The driver ↔ role batch calls as types: one request and one response type per call
//! (generate, log-probs, values, scores, each update), converted to and from the wire
//! batch ([`DataBatch`]) here and nowhere else. Both sides build and read these structs;
//! tensor names exist only in this file.
//!
//! Shapes: B rows, P = max_prompt_length, R = max_response_length. Ids and masks travel
//! as I64, everything else as F32. A response carries the rows of its request, in order,
//! so the driver's split → fan-out → concatenate keeps working on the wire batch.

use std::collections::BTreeMap;

use serde_json::json;

use crate::batch::{DataBatch, TensorData};
use crate::error::{Error, Result};
use crate::role::{RoleKind, RolePart};
pub use rlhf_proto::BatchCall;

mod stage;
mod wire;
pub use stage::{PreferenceUpdateRequest, RewardModelUpdateRequest, SftUpdateRequest};
use wire::{put, put_strings, Reader};
pub use wire::{Elem, Mat};

/// A type that is one call's request or response on the wire.
pub trait Wire: Sized {
    fn to_batch(&self) -> Result<DataBatch>;
    /// `call` names the call in errors.
    fn from_batch(call: BatchCall, b: &DataBatch) -> Result<Self>;
}

/// A request: which RPC it is and what it answers.
pub trait RoleCall: Wire {
    const CALL: BatchCall;
    type Response: Wire;
}

/// Left-padded prompts `[B, P]`.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub prompt_ids: Mat<i64>,
    pub prompt_mask: Mat<i64>,
    /// The PPO step; with `seed` it picks each rank's sampling stream.
    pub step: u64,
    /// The job seed: rank r of the rollout samples with `stream_seed(seed, step, r)`.
    pub seed: u64,
}

/// Right-padded responses `[B, R]` with the log-probs of the policy that sampled them
/// (behaviour log-probs) and that policy's version per row.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateResponse {
    pub responses: Mat<i64>,
    /// 1.0 on response tokens (through the first EOS), 0.0 on padding.
    pub response_mask: Mat<f32>,
    pub behaviour_log_probs: Mat<f32>,
    /// The weights version (the step of the last sync) each row was sampled with.
    pub policy_version: Vec<u64>,
}

/// Whole sequences `[B, P+R]`: the prompt (left-padded) then the response (right-padded).
#[derive(Debug, Clone, PartialEq)]
pub struct Sequences {
    pub input_ids: Mat<i64>,
    pub attention_mask: Mat<i64>,
    /// R: the last `response_len` columns are the response.
    pub response_len: usize,
}

/// Log-probs (and entropies) of the response tokens under a policy.
#[derive(Debug, Clone, PartialEq)]
pub struct LogProbsRequest(pub Sequences);

#[derive(Debug, Clone, PartialEq)]
pub struct LogProbsResponse {
    pub log_probs: Mat<f32>,
    pub entropy: Mat<f32>,
}

/// The critic's values of the states before each response token.
#[derive(Debug, Clone, PartialEq)]
pub struct ValuesRequest(pub Sequences);

#[derive(Debug, Clone, PartialEq)]
pub struct ValuesResponse {
    pub values: Mat<f32>,
}

/// One score per sequence: rules read the texts, reward models the token ids.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoresRequest {
    pub seq: Sequences,
    pub prompt_text: Vec<String>,
    pub response_text: Vec<String>,
    /// Reference answers, where the dataset has them (`data.ground_truth_key`).
    pub ground_truth: Option<Vec<Option<String>>>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ScoresResponse {
    pub scores: Vec<f32>,
    /// Per row, what a verifying rule (`math`, `exact_match`) decided; `None` from rules
    /// that only score, endpoints and reward models.
    pub verdicts: Option<Vec<Verdict>>,
}

/// A verifying reward's decision on one response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The final answer equals the ground truth.
    Right,
    /// An answer was found and differs.
    Wrong,
    /// No answer could be found (no `\boxed{}`, no number): scored as configured, counted.
    NoAnswer,
}

impl Verdict {
    /// The wire's code: 1 right, 0 wrong, -1 no answer.
    fn code(self) -> f32 {
        match self {
            Verdict::Right => 1.0,
            Verdict::Wrong => 0.0,
            Verdict::NoAnswer => -1.0,
        }
    }

    fn from_code(x: f32) -> Option<Self> {
        [Verdict::Right, Verdict::Wrong, Verdict::NoAnswer]
            .into_iter()
            .find(|v| v.code() == x)
    }
}

/// PPO epochs of the policy over this rank's shard.
#[derive(Debug, Clone, PartialEq)]
pub struct ActorUpdateRequest {
    pub seq: Sequences,
    pub response_mask: Mat<f32>,
    pub old_log_probs: Mat<f32>,
    pub advantages: Mat<f32>,
    /// Only with `actor_rollout.use_kl_loss`.
    pub ref_log_probs: Option<Mat<f32>>,
    pub step: u64,
}

/// Value epochs of the critic over this rank's shard.
#[derive(Debug, Clone, PartialEq)]
pub struct CriticUpdateRequest {
    pub seq: Sequences,
    /// Where the critic fits values: the response, plus the score's slot with TRL's
    /// score placement.
    pub value_mask: Mat<f32>,
    pub values: Mat<f32>,
    pub returns: Mat<f32>,
    pub step: u64,
}

/// An update's metrics (no rows).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct UpdateResponse {
    pub metrics: BTreeMap<String, f64>,
}

/// Addresses a batch to one role part of a process that may host several engines.
pub fn set_target(b: &mut DataBatch, kind: RoleKind, part: RolePart) {
    b.meta.insert("target_role".into(), json!(kind.as_str()));
    b.meta.insert("target_part".into(), json!(part.as_str()));
}

/// The role part a batch is addressed to, if it names one.
pub fn target(b: &DataBatch) -> Result<Option<(RoleKind, RolePart)>> {
    let (Some(k), Some(p)) = (b.meta.get("target_role"), b.meta.get("target_part")) else {
        return Ok(None);
    };
    match (k.as_str(), p.as_str()) {
        (Some(k), Some(p)) => Ok(Some((k.parse()?, p.parse()?))),
        _ => Err(Error::invalid(format!(
            "batch target {k} / {p} is not a role and part name"
        ))),
    }
}

/// Rank `rank`'s sampling stream at `step` of a job seeded with `seed` (splitmix64 over the
/// three, so streams are independent per step and rank).
pub fn stream_seed(seed: u64, step: u64, rank: u64) -> u64 {
    let mut z =
        seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ rank.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Wire for GenerateRequest {
    fn to_batch(&self) -> Result<DataBatch> {
        let mut b = DataBatch::new();
        put(&mut b, "prompt_ids", &self.prompt_ids)?;
        put(&mut b, "prompt_mask", &self.prompt_mask)?;
        b.meta.insert("step".into(), json!(self.step));
        b.meta.insert("seed".into(), json!(self.seed));
        Ok(b)
    }
    fn from_batch(call: BatchCall, b: &DataBatch) -> Result<Self> {
        let r = Reader::new(call, b)?;
        Ok(Self {
            prompt_ids: r.mat("prompt_ids")?,
            prompt_mask: r.mat("prompt_mask")?,
            step: r.u64("step")?,
            seed: r.u64("seed")?,
        })
    }
}

impl RoleCall for GenerateRequest {
    const CALL: BatchCall = BatchCall::Generate;
    type Response = GenerateResponse;
}

impl Wire for GenerateResponse {
    fn to_batch(&self) -> Result<DataBatch> {
        let mut b = DataBatch::new();
        put(&mut b, "responses", &self.responses)?;
        put(&mut b, "response_mask", &self.response_mask)?;
        put(&mut b, "behaviour_log_probs", &self.behaviour_log_probs)?;
        let v: Vec<i64> = self.policy_version.iter().map(|&v| v as i64).collect();
        b.tensors.insert(
            "policy_version".into(),
            TensorData::from_i64(vec![v.len()], &v)?,
        );
        Ok(b)
    }
    fn from_batch(call: BatchCall, b: &DataBatch) -> Result<Self> {
        let r = Reader::new(call, b)?;
        let policy_version = r
            .vec::<i64>("policy_version")?
            .into_iter()
            .map(|v| {
                u64::try_from(v).map_err(|_| r.fail(format!("policy_version {v} is negative")))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            responses: r.mat("responses")?,
            response_mask: r.mat("response_mask")?,
            behaviour_log_probs: r.mat("behaviour_log_probs")?,
            policy_version,
        })
    }
}

impl Sequences {
    pub(in crate::calls) fn put(&self, b: &mut DataBatch) -> Result<()> {
        self.put_as(b, "")
    }

    /// Under names with `prefix` (`chosen_`, `rejected_`), for calls with two sets.
    pub(in crate::calls) fn put_as(&self, b: &mut DataBatch, prefix: &str) -> Result<()> {
        put(b, &format!("{prefix}input_ids"), &self.input_ids)?;
        put(b, &format!("{prefix}attention_mask"), &self.attention_mask)?;
        b.meta
            .insert(format!("{prefix}response_length"), json!(self.response_len));
        Ok(())
    }

    pub(in crate::calls) fn read(r: &Reader<'_>) -> Result<Self> {
        Self::read_as(r, "")
    }

    pub(in crate::calls) fn read_as(r: &Reader<'_>, prefix: &str) -> Result<Self> {
        let s = Self {
            input_ids: r.mat(&format!("{prefix}input_ids"))?,
            attention_mask: r.mat(&format!("{prefix}attention_mask"))?,
            response_len: r.u64(&format!("{prefix}response_length"))? as usize,
        };
        if s.attention_mask.cols != s.input_ids.cols {
            return Err(r.fail(format!(
                "attention_mask has {} columns but input_ids has {}",
                s.attention_mask.cols, s.input_ids.cols
            )));
        }
        if s.response_len == 0 || s.response_len >= s.input_ids.cols {
            return Err(r.fail(format!(
                "response_length {} does not fit sequences of {} columns",
                s.response_len, s.input_ids.cols
            )));
        }
        Ok(s)
    }

    pub fn rows(&self) -> usize {
        self.input_ids.rows
    }

    /// P: the prompt columns.
    pub fn prompt_len(&self) -> usize {
        self.input_ids.cols - self.response_len
    }
}

/// `LogProbsRequest` and `ValuesRequest` are sequences and nothing else.
macro_rules! sequences_call {
    ($req:ident, $call:expr, $resp:ty) => {
        impl Wire for $req {
            fn to_batch(&self) -> Result<DataBatch> {
                let mut b = DataBatch::new();
                self.0.put(&mut b)?;
                Ok(b)
            }
            fn from_batch(call: BatchCall, b: &DataBatch) -> Result<Self> {
                Ok(Self(Sequences::read(&Reader::new(call, b)?)?))
            }
        }
        impl RoleCall for $req {
            const CALL: BatchCall = $call;
            type Response = $resp;
        }
    };
}
sequences_call!(
    LogProbsRequest,
    BatchCall::ComputeLogProbs,
    LogProbsResponse
);
sequences_call!(ValuesRequest, BatchCall::ComputeValues, ValuesResponse);

impl Wire for LogProbsResponse {
    fn to_batch(&self) -> Result<DataBatch> {
        let mut b = DataBatch::new();
        put(&mut b, "log_probs", &self.log_probs)?;
        put(&mut b, "entropy", &self.entropy)?;
        Ok(b)
    }
    fn from_batch(call: BatchCall, b: &DataBatch) -> Result<Self> {
        let r = Reader::new(call, b)?;
        Ok(Self {
            log_probs: r.mat("log_probs")?,
            entropy: r.mat("entropy")?,
        })
    }
}

impl Wire for ValuesResponse {
    fn to_batch(&self) -> Result<DataBatch> {
        let mut b = DataBatch::new();
        put(&mut b, "values", &self.values)?;
        Ok(b)
    }
    fn from_batch(call: BatchCall, b: &DataBatch) -> Result<Self> {
        Ok(Self {
            values: Reader::new(call, b)?.mat("values")?,
        })
    }
}

impl Wire for ScoresRequest {
    fn to_batch(&self) -> Result<DataBatch> {
        let mut b = DataBatch::new();
        self.seq.put(&mut b)?;
        put_strings(&mut b, "prompt_text", self.prompt_text.iter().map(Some));
        put_strings(&mut b, "response_text", self.response_text.iter().map(Some));
        if let Some(gt) = &self.ground_truth {
            put_strings(&mut b, "ground_truth", gt.iter().map(Option::as_ref));
        }
        Ok(b)
    }
    fn from_batch(call: BatchCall, b: &DataBatch) -> Result<Self> {
        let r = Reader::new(call, b)?;
        Ok(Self {
            seq: Sequences::read(&r)?,
            prompt_text: r.strings("prompt_text")?,
            response_text: r.strings("response_text")?,
            ground_truth: r.opt_strings("ground_truth")?,
        })
    }
}

impl RoleCall for ScoresRequest {
    const CALL: BatchCall = BatchCall::ComputeScores;
    type Response = ScoresResponse;
}

impl Wire for ScoresResponse {
    fn to_batch(&self) -> Result<DataBatch> {
        let mut b = DataBatch::new().with_tensor(
            "scores",
            TensorData::from_f32(vec![self.scores.len()], &self.scores)?,
        );
        if let Some(v) = &self.verdicts {
            let codes: Vec<f32> = v.iter().map(|v| v.code()).collect();
            b = b.with_tensor("verdicts", TensorData::from_f32(vec![codes.len()], &codes)?);
        }
        Ok(b)
    }
    fn from_batch(call: BatchCall, b: &DataBatch) -> Result<Self> {
        let r = Reader::new(call, b)?;
        let verdicts = if b.tensors.contains_key("verdicts") {
            let codes: Vec<f32> = r.vec("verdicts")?;
            Some(
                codes
                    .into_iter()
                    .enumerate()
                    .map(|(i, x)| {
                        Verdict::from_code(x).ok_or_else(|| {
                            Error::invalid(format!(
                                "ComputeScores: verdict code {x} in row {i} is none of 1, 0, -1"
                            ))
                        })
                    })
                    .collect::<Result<_>>()?,
            )
        } else {
            None
        };
        Ok(Self {
            scores: r.vec("scores")?,
            verdicts,
        })
    }
}

impl Wire for ActorUpdateRequest {
    fn to_batch(&self) -> Result<DataBatch> {
        let mut b = DataBatch::new();
        self.seq.put(&mut b)?;
        put(&mut b, "response_mask", &self.response_mask)?;
        put(&mut b, "old_log_probs", &self.old_log_probs)?;
        put(&mut b, "advantages", &self.advantages)?;
        if let Some(rp) = &self.ref_log_probs {
            put(&mut b, "ref_log_probs", rp)?;
        }
        b.meta.insert("step".into(), json!(self.step));
        Ok(b)
    }
    fn from_batch(call: BatchCall, b: &DataBatch) -> Result<Self> {
        let r = Reader::new(call, b)?;
        Ok(Self {
            seq: Sequences::read(&r)?,
            response_mask: r.mat("response_mask")?,
            old_log_probs: r.mat("old_log_probs")?,
            advantages: r.mat("advantages")?,
            ref_log_probs: r.opt_mat("ref_log_probs")?,
            step: r.u64("step")?,
        })
    }
}

impl RoleCall for ActorUpdateRequest {
    const CALL: BatchCall = BatchCall::UpdateActor;
    type Response = UpdateResponse;
}

impl Wire for CriticUpdateRequest {
    fn to_batch(&self) -> Result<DataBatch> {
        let mut b = DataBatch::new();
        self.seq.put(&mut b)?;
        put(&mut b, "value_mask", &self.value_mask)?;
        put(&mut b, "values", &self.values)?;
        put(&mut b, "returns", &self.returns)?;
        b.meta.insert("step".into(), json!(self.step));
        Ok(b)
    }
    fn from_batch(call: BatchCall, b: &DataBatch) -> Result<Self> {
        let r = Reader::new(call, b)?;
        Ok(Self {
            seq: Sequences::read(&r)?,
            value_mask: r.mat("value_mask")?,
            values: r.mat("values")?,
            returns: r.mat("returns")?,
            step: r.u64("step")?,
        })
    }
}

impl RoleCall for CriticUpdateRequest {
    const CALL: BatchCall = BatchCall::UpdateCritic;
    type Response = UpdateResponse;
}

impl Wire for UpdateResponse {
    fn to_batch(&self) -> Result<DataBatch> {
        let mut b = DataBatch::new();
        for (k, v) in &self.metrics {
            b.meta.insert(k.clone(), json!(v));
        }
        Ok(b)
    }
    fn from_batch(call: BatchCall, b: &DataBatch) -> Result<Self> {
        let metrics = b
            .meta
            .iter()
            .map(|(k, v)| {
                // serde_json writes non-finite floats as null: keep them visible as NaN so the
                // driver's divergence check sees them.
                let x = if v.is_null() {
                    Some(f64::NAN)
                } else {
                    v.as_f64()
                };
                x.map(|x| (k.clone(), x)).ok_or_else(|| {
                    Error::invalid(format!(
                        "{} answer: metric '{k}' is {v}, not a number",
                        call.name()
                    ))
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self { metrics })
    }
}

#[cfg(feature = "candle")]
pub mod candle;
#[cfg(test)]
mod tests;
