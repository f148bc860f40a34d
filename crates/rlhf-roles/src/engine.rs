//! Engines and what they can do. An engine is one loaded role part (a trainer, a rollout,
//! a reference policy, a critic, a reward); a [`crate::RoleHost`] holds several on one
//! device and routes each typed call to the engine of the addressed slot through the
//! capability it needs. Two engines may share one model (`Arc<Model>`): the hybrid engine,
//! where the rollout generates with the trainer's weights and needs no sync.

use std::sync::Arc;

use rlhf_core::calls::{
    GenerateRequest, GenerateResponse, LogProbsRequest, LogProbsResponse, ScoresRequest,
    ScoresResponse, ValuesRequest, ValuesResponse,
};
use rlhf_model::Model;

use crate::critic::Critic;
use crate::error::Result;
use crate::policy::{RefPolicy, Rollout, Trainer};
use crate::reward::Reward;
use crate::stages::{PreferenceTrainer, RewardModelTrainer, SftTrainer};

/// Samples responses to prompts.
pub trait Generate {
    fn generate(&self, rank: u32, req: &GenerateRequest) -> Result<GenerateResponse>;
}

/// Log-probs (and entropies) of the response tokens.
pub trait LogProbs {
    fn log_probs(&self, req: &LogProbsRequest) -> Result<LogProbsResponse>;
}

/// Values of the states before each response token.
pub trait Values {
    fn values(&self, req: &ValuesRequest) -> Result<ValuesResponse>;
}

/// One score per sequence.
pub trait Score {
    fn score(&self, req: &ScoresRequest) -> Result<ScoresResponse>;
}

/// One loaded role part.
pub enum Engine {
    Trainer(Box<Trainer>),
    Rollout(Box<Rollout>),
    Ref(Box<RefPolicy>),
    Critic(Box<Critic>),
    Reward(Box<Reward>),
    Sft(Box<SftTrainer>),
    Preference(Box<PreferenceTrainer>),
    RewardModel(Box<RewardModelTrainer>),
}

impl Engine {
    pub fn as_generate(&self) -> Option<&dyn Generate> {
        match self {
            Engine::Rollout(r) => Some(r.as_ref()),
            _ => None,
        }
    }

    pub fn as_log_probs(&self) -> Option<&dyn LogProbs> {
        match self {
            Engine::Trainer(t) => Some(t.as_ref()),
            Engine::Rollout(r) => Some(r.as_ref()),
            Engine::Ref(r) => Some(r.as_ref()),
            Engine::Sft(t) => Some(t.as_ref()),
            Engine::Preference(t) => Some(t.as_ref()),
            _ => None,
        }
    }

    pub fn as_values(&self) -> Option<&dyn Values> {
        match self {
            Engine::Critic(c) => Some(c.as_ref()),
            _ => None,
        }
    }

    pub fn as_score(&self) -> Option<&dyn Score> {
        match self {
            Engine::Reward(r) => Some(r.as_ref()),
            Engine::RewardModel(r) => Some(r.as_ref()),
            _ => None,
        }
    }

    /// The state of a trainable engine (its model, optimizer and version), for checkpoints.
    pub fn train_state(&self) -> Option<&crate::train::TrainState> {
        match self {
            Engine::Trainer(t) => Some(&t.state),
            Engine::Critic(c) => Some(&c.state),
            Engine::Sft(t) => Some(&t.state),
            Engine::Preference(t) => Some(&t.state),
            Engine::RewardModel(t) => Some(&t.state),
            Engine::Rollout(_) | Engine::Ref(_) | Engine::Reward(_) => None,
        }
    }

    /// The same, to update or restore.
    pub fn train_state_mut(&mut self) -> Option<&mut crate::train::TrainState> {
        match self {
            Engine::Trainer(t) => Some(&mut t.state),
            Engine::Critic(c) => Some(&mut c.state),
            Engine::Sft(t) => Some(&mut t.state),
            Engine::Preference(t) => Some(&mut t.state),
            Engine::RewardModel(t) => Some(&mut t.state),
            Engine::Rollout(_) | Engine::Ref(_) | Engine::Reward(_) => None,
        }
    }

    /// The model the engine computes with (`None` for rule and HTTP rewards).
    pub fn model(&self) -> Option<&Arc<Model>> {
        match self {
            Engine::Trainer(t) => Some(&t.state.model),
            Engine::Rollout(r) => Some(&r.model),
            Engine::Ref(r) => Some(&r.model),
            Engine::Critic(c) => Some(&c.state.model),
            Engine::Reward(r) => r.model(),
            Engine::Sft(t) => Some(&t.state.model),
            Engine::Preference(t) => Some(&t.state.model),
            Engine::RewardModel(t) => Some(&t.state.model),
        }
    }

    /// The weights version the engine holds (the step of the last sync or update).
    pub fn version(&self) -> u64 {
        match self {
            Engine::Trainer(t) => t.state.version,
            Engine::Rollout(r) => r.version,
            Engine::Critic(c) => c.state.version,
            Engine::Sft(t) => t.state.version,
            Engine::Preference(t) => t.state.version,
            Engine::RewardModel(t) => t.state.version,
            Engine::Ref(_) | Engine::Reward(_) => 0,
        }
    }
}
