//! Prompts for the loop: the dataset tokenized once at start, the length policy applied,
//! and the fixed-responses file of precision-alignment mode.

use std::collections::HashMap;
use std::path::Path;

use rlhf_config::data::{
    apply_length_policy, LengthDecision, LengthSummary, PromptContent, PromptDataset,
};
use rlhf_config::PpoConfig;
use rlhf_core::{Error, Result};
use rlhf_tokenizer::{ChatMessage, Tokenizer};

/// A prompt ready for rollout.
#[derive(Debug, Clone)]
pub struct Prompt {
    /// Text shown in the sample table (the prompt, or the last user message).
    pub display: String,
    pub ids: Vec<u32>,
    /// Row in the dataset file, for messages.
    pub source_row: usize,
    /// Reference answer (`data.ground_truth_key`), sent to the reward as `ground_truth`.
    pub ground_truth: Option<String>,
}

pub struct Prompts {
    pub prompts: Vec<Prompt>,
    pub length: LengthSummary,
    /// Rows skipped as unparsable (`data.bad_rows: skip`): where and why.
    pub bad_rows: Vec<String>,
    pub rows: usize,
}

fn to_chat(msgs: &[rlhf_config::data::ChatMessage]) -> Vec<ChatMessage> {
    msgs.iter()
        .map(|m| ChatMessage::new(m.role.clone(), m.content.clone()))
        .collect()
}

/// Loads `data.path`, tokenizes every prompt (through the chat template when asked or when
/// the row holds messages) and applies `data.max_prompt_length_policy`.
pub fn load(cfg: &PpoConfig, tok: &Tokenizer) -> Result<Prompts> {
    let ds = PromptDataset::load(&cfg.data).map_err(|e| Error::invalid(e.to_string()))?;
    let max_len = cfg.actor_rollout.max_prompt_length as usize;
    let mut encoded = Vec::with_capacity(ds.records.len());
    for r in &ds.records {
        let (display, ids) = match &r.content {
            PromptContent::Text(t) if cfg.data.apply_chat_template => (
                t.clone(),
                tok.encode_chat(&[ChatMessage::user(t.clone())], true),
            ),
            PromptContent::Text(t) => (t.clone(), tok.encode(t, true)),
            PromptContent::Messages(m) => (
                m.iter()
                    .rev()
                    .find(|m| m.role == "user")
                    .map(|m| m.content.clone())
                    .unwrap_or_default(),
                tok.encode_chat(&to_chat(m), true),
            ),
        };
        let ids = ids.map_err(|e| {
            Error::invalid(format!(
                "{} row {}: cannot tokenize the prompt: {e}",
                cfg.data.path, r.source_row
            ))
        })?;
        encoded.push((display, ids, r.source_row, r.ground_truth.clone()));
    }
    let lengths: Vec<usize> = encoded.iter().map(|(_, ids, _, _)| ids.len()).collect();
    let (decisions, length) =
        apply_length_policy(&lengths, max_len, cfg.data.max_prompt_length_policy);
    let prompts: Vec<Prompt> = encoded
        .into_iter()
        .zip(decisions)
        .filter_map(|((display, ids, source_row, ground_truth), d)| match d {
            LengthDecision::Keep => Some(Prompt {
                display,
                ids,
                source_row,
                ground_truth,
            }),
            LengthDecision::TruncateFront(n) => Some(Prompt {
                display,
                ids: ids[n..].to_vec(),
                source_row,
                ground_truth,
            }),
            LengthDecision::Skip => None,
        })
        .collect();
    if prompts.is_empty() {
        return Err(Error::invalid(format!(
            "{}: no prompt left after data.max_prompt_length_policy=skip with actor_rollout.max_prompt_length={max_len} ({} rows); raise the limit or use truncate",
            cfg.data.path, ds.report.loaded
        )));
    }
    if prompts.iter().any(|p| p.ids.is_empty()) {
        return Err(Error::invalid(format!(
            "{}: a prompt tokenizes to zero tokens; every prompt needs at least one",
            cfg.data.path
        )));
    }
    Ok(Prompts {
        prompts,
        length,
        bad_rows: ds
            .report
            .bad
            .iter()
            .map(|b| format!("{}: {}", b.location, b.reason))
            .collect(),
        rows: ds.report.rows,
    })
}

/// `actor_rollout.fixed_responses_file`: JSONL of `{"prompt": ..., "response": ...}`; the
/// response of a prompt replaces generation (precision-alignment mode).
pub fn load_fixed_responses(path: &Path) -> Result<HashMap<String, String>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::io(
            format!(
                "reading actor_rollout.fixed_responses_file {}",
                path.display()
            ),
            e,
        )
    })?;
    let mut out = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| Error::invalid(format!("{} line {}: {e}", path.display(), i + 1)))?;
        match (v["prompt"].as_str(), v["response"].as_str()) {
            (Some(p), Some(r)) => {
                out.insert(p.to_string(), r.to_string());
            }
            _ => {
                return Err(Error::invalid(format!(
                    "{} line {}: expected {{\"prompt\": string, \"response\": string}}",
                    path.display(),
                    i + 1
                )))
            }
        }
    }
    Ok(out)
}
