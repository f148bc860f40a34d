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

/// Loads `data.path`, tokenizes every prompt (through the chat template, with
/// `data.chat_template_kwargs`, when asked or when the row holds messages) and applies
/// `data.max_prompt_length_policy`.
pub fn load(cfg: &PpoConfig, tok: &Tokenizer) -> Result<Prompts> {
    let ds = PromptDataset::load(&cfg.data).map_err(|e| Error::invalid(e.to_string()))?;
    let max_len = cfg.actor_rollout.max_prompt_length as usize;
    let vars = cfg.data.chat_template_vars();
    let mut encoded = Vec::with_capacity(ds.records.len());
    for r in &ds.records {
        let (display, ids) = match &r.content {
            PromptContent::Text(t) if cfg.data.apply_chat_template => (
                t.clone(),
                tok.encode_chat_with(&[ChatMessage::user(t.clone())], true, &vars),
            ),
            PromptContent::Text(t) => (t.clone(), tok.encode(t, true)),
            PromptContent::Messages(m) => (
                m.iter()
                    .rev()
                    .find(|m| m.role == "user")
                    .map(|m| m.content.clone())
                    .unwrap_or_default(),
                tok.encode_chat_with(&to_chat(m), true, &vars),
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

/// One line of the fixed-responses file, by how it names its prompt and response.
#[derive(Debug, Clone, PartialEq)]
pub enum FixedResponse {
    /// `{"prompt": ..., "response": ...}`: the response is tokenized, EOS appended.
    Text(String),
    /// `{"prompt_ids": [...], "response_ids": [...]}`: the exact tokens, used as they are
    /// (no tokenizer round trip, no EOS added), for alignment with another implementation.
    Ids(Vec<u32>),
}

/// `actor_rollout.fixed_responses_file`, by prompt text and by prompt token ids: one
/// response per prompt (every sample of its group gets it), or one per sample of a GRPO/RLOO
/// group (`"responses"` / a list of `"response_ids"` lists), so that a group step can be
/// compared with another implementation on fixed completions.
#[derive(Debug, Default)]
pub struct FixedResponses {
    by_text: HashMap<String, Vec<String>>,
    by_ids: HashMap<Vec<u32>, Vec<Vec<u32>>>,
}

/// The `sample`-th of a prompt's responses; a single response serves every sample.
fn pick<T: Clone>(list: &[T], sample: usize) -> Option<T> {
    match list {
        [one] => Some(one.clone()),
        _ => list.get(sample).cloned(),
    }
}

impl FixedResponses {
    /// The response for sample `sample` of a dataset prompt's group: by its token ids first,
    /// then by its text.
    pub fn get(&self, prompt: &Prompt, sample: usize) -> Option<FixedResponse> {
        match self.by_ids.get(&prompt.ids) {
            Some(l) => pick(l, sample).map(FixedResponse::Ids),
            None => self
                .by_text
                .get(&prompt.display)
                .and_then(|l| pick(l, sample))
                .map(FixedResponse::Text),
        }
    }

    /// How many responses the file gives a prompt (none: not in the file).
    pub fn count(&self, prompt: &Prompt) -> Option<usize> {
        self.by_ids
            .get(&prompt.ids)
            .map(Vec::len)
            .or_else(|| self.by_text.get(&prompt.display).map(Vec::len))
    }

    /// Number of lines read.
    pub fn len(&self) -> usize {
        self.by_text.len() + self.by_ids.len()
    }

    /// Whether the file had no line.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn ids_field(
    v: &serde_json::Value,
    key: &str,
    vocab: usize,
    at: &dyn Fn() -> String,
) -> Result<Vec<u32>> {
    let arr = v[key].as_array().ok_or_else(|| {
        Error::invalid(format!("{}: \"{key}\" must be an array of token ids", at()))
    })?;
    if arr.is_empty() {
        return Err(Error::invalid(format!(
            "{}: \"{key}\" is empty; give at least one token id",
            at()
        )));
    }
    arr.iter()
        .enumerate()
        .map(|(j, x)| match x.as_u64() {
            Some(id) if (id as u128) < vocab as u128 => Ok(id as u32),
            Some(id) => Err(Error::invalid(format!(
                "{}: \"{key}\"[{j}] = {id} is outside the tokenizer's vocabulary \
                 (ids 0..{vocab}); regenerate the ids with the policy's tokenizer",
                at()
            ))),
            None => Err(Error::invalid(format!(
                "{}: \"{key}\"[{j}] = {x} is not a token id (a non-negative integer)",
                at()
            ))),
        })
        .collect()
}

/// `"response_ids"`: one list of token ids, or a list of such lists (one per sample).
fn response_ids_field(
    v: &serde_json::Value,
    vocab: usize,
    at: &dyn Fn() -> String,
) -> Result<Vec<Vec<u32>>> {
    match v["response_ids"].as_array() {
        Some(a) if !a.is_empty() && a.iter().all(|x| x.is_array()) => a
            .iter()
            .enumerate()
            .map(|(k, x)| {
                let one = serde_json::json!({ "response_ids": x });
                ids_field(&one, "response_ids", vocab, &|| {
                    format!("{}, response {k}", at())
                })
            })
            .collect(),
        _ => Ok(vec![ids_field(v, "response_ids", vocab, at)?]),
    }
}

/// Reads `actor_rollout.fixed_responses_file`: JSONL lines of either
/// `{"prompt": ..., "response": ...}` (text) or `{"prompt_ids": [...], "response_ids": [...]}`
/// (token ids, each below `vocab`, the tokenizer's vocabulary size); for a group of samples
/// per prompt, `"responses": [...]` or `"response_ids": [[...], [...]]` give one per sample.
/// A prompt matches a dataset row by its token ids (after the chat template) or by its
/// text; errors name the file and line.
pub fn load_fixed_responses(path: &Path, vocab: usize) -> Result<FixedResponses> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::io(
            format!(
                "reading actor_rollout.fixed_responses_file {}",
                path.display()
            ),
            e,
        )
    })?;
    let mut out = FixedResponses::default();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{} line {}", path.display(), i + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| Error::invalid(format!("{}: {e}", at())))?;
        if v.get("prompt_ids").is_some() || v.get("response_ids").is_some() {
            let p = ids_field(&v, "prompt_ids", vocab, &at)?;
            let r = response_ids_field(&v, vocab, &at)?;
            out.by_ids.insert(p, r);
            continue;
        }
        let list: Option<Vec<String>> = v["responses"].as_array().and_then(|a| {
            a.iter()
                .map(|x| x.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .filter(|l| !l.is_empty())
        });
        match (v["prompt"].as_str(), v["response"].as_str(), list) {
            (Some(p), Some(r), None) => {
                out.by_text.insert(p.to_string(), vec![r.to_string()]);
            }
            (Some(p), None, Some(l)) => {
                out.by_text.insert(p.to_string(), l);
            }
            _ => {
                return Err(Error::invalid(format!(
                    "{}: expected {{\"prompt\": string, \"response\": string}}, \
                     {{\"prompt\": string, \"responses\": [strings, one per sample]}} or \
                     {{\"prompt_ids\": [ids], \"response_ids\": [ids] or [[ids], ...]}}",
                    at()
                )))
            }
        }
    }
    Ok(out)
}

/// The committed tiny tokenizer with Qwen3's chat template (rlhf-tokenizer's fixtures),
/// written in `dir`: a template that reads `enable_thinking`.
#[cfg(test)]
pub(crate) fn qwen3_test_tokenizer(dir: &Path) -> Tokenizer {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../rlhf-tokenizer/tests/fixtures");
    let src = fixtures.join("tokenizer");
    std::fs::copy(src.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    let cfg = std::fs::read_to_string(src.join("tokenizer_config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    let template = std::fs::read_to_string(fixtures.join("qwen3_chat_template.jinja")).unwrap();
    cfg["chat_template"] = serde_json::Value::String(template);
    let cfg = serde_json::to_string(&cfg).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), cfg).unwrap();
    Tokenizer::from_dir(dir).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `data.chat_template_kwargs` reaches the rendered prompts, text and messages alike:
    /// with Qwen3's template and `enable_thinking: false` each ends with an empty think block
    /// after the assistant header, without it with the header alone.
    #[test]
    fn chat_template_kwargs_reach_the_rendered_prompts() {
        let dir = tempfile::tempdir().unwrap();
        let tok = qwen3_test_tokenizer(dir.path());
        let data = dir.path().join("prompts.jsonl");
        std::fs::write(
            &data,
            "{\"prompt\": \"2+3=\"}\n{\"prompt\": [{\"role\": \"user\", \"content\": \"4+4=\"}]}\n",
        )
        .unwrap();
        let mut cfg = PpoConfig::default();
        cfg.data.path = data.display().to_string();
        cfg.data.apply_chat_template = true;
        let texts = |cfg: &PpoConfig| -> Vec<String> {
            let p = super::load(cfg, &tok).unwrap();
            assert_eq!(p.prompts.len(), 2);
            p.prompts
                .iter()
                .map(|p| tok.decode(&p.ids, false).unwrap())
                .collect()
        };
        for t in texts(&cfg) {
            assert!(t.ends_with("=<|im_end|>\n<|im_start|>assistant\n"), "{t:?}");
        }
        cfg.data.chat_template_kwargs.insert(
            "enable_thinking".into(),
            rlhf_config::TemplateValue::Bool(false),
        );
        for t in texts(&cfg) {
            assert!(
                t.ends_with("=<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
                "{t:?}"
            );
        }
    }

    fn prompt(display: &str, ids: &[u32]) -> Prompt {
        Prompt {
            display: display.into(),
            ids: ids.to_vec(),
            source_row: 1,
            ground_truth: None,
        }
    }

    fn load(text: &str) -> Result<FixedResponses> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("fixed.jsonl");
        std::fs::write(&p, text).unwrap();
        load_fixed_responses(&p, 320)
    }

    #[test]
    fn text_and_token_id_lines_are_both_read() {
        let f = load(concat!(
            "{\"prompt\": \"2+3=\", \"response\": \" 5.\"}\n",
            "\n",
            "{\"prompt_ids\": [57, 74, 33], \"response_ids\": [302, 201, 2]}\n",
        ))
        .unwrap();
        assert_eq!(f.len(), 2);
        assert_eq!(
            f.get(&prompt("2+3=", &[9, 9]), 0),
            Some(FixedResponse::Text(" 5.".into()))
        );
        // One response serves every sample of the group.
        assert_eq!(
            f.get(&prompt("2+3=", &[9, 9]), 3),
            Some(FixedResponse::Text(" 5.".into()))
        );
        // Matched by ids whatever the text; ids win over text.
        assert_eq!(
            f.get(&prompt("2+3=", &[57, 74, 33]), 0),
            Some(FixedResponse::Ids(vec![302, 201, 2]))
        );
        assert_eq!(f.get(&prompt("other", &[57, 74]), 0), None);
    }

    #[test]
    fn a_group_gets_one_response_per_sample() {
        let f = load(concat!(
            "{\"prompt\": \"2+3=\", \"responses\": [\" 5.\", \" five\"]}\n",
            "{\"prompt_ids\": [57, 74], \"response_ids\": [[302, 2], [201]]}\n",
        ))
        .unwrap();
        let text = prompt("2+3=", &[9, 9]);
        assert_eq!(f.count(&text), Some(2));
        assert_eq!(f.get(&text, 1), Some(FixedResponse::Text(" five".into())));
        assert_eq!(f.get(&text, 2), None);
        let ids = prompt("x", &[57, 74]);
        assert_eq!(f.get(&ids, 0), Some(FixedResponse::Ids(vec![302, 2])));
        assert_eq!(f.get(&ids, 1), Some(FixedResponse::Ids(vec![201])));
        let e = load("{\"prompt_ids\": [1], \"response_ids\": [[5], [999]]}\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 1, response 1: \"response_ids\"[0] = 999 is outside"),
            "{e}"
        );
        let e = load("{\"prompt\": \"a\", \"responses\": []}\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("one per sample"), "{e}");
    }

    #[test]
    fn bad_token_ids_are_refused_with_the_line() {
        let cases = [
            (
                "{\"prompt_ids\": [1, 2], \"response_ids\": [5, 320]}",
                "line 1: \"response_ids\"[1] = 320 is outside the tokenizer's vocabulary (ids 0..320)",
            ),
            (
                "{\"prompt_ids\": [1, -2], \"response_ids\": [5]}",
                "line 1: \"prompt_ids\"[1] = -2 is not a token id",
            ),
            (
                "{\"prompt_ids\": [1], \"response_ids\": []}",
                "line 1: \"response_ids\" is empty",
            ),
            (
                "{\"prompt_ids\": [1], \"response_ids\": \"5 6\"}",
                "line 1: \"response_ids\" must be an array of token ids",
            ),
            (
                "{\"prompt_ids\": [1, 99999999999], \"response_ids\": [5]}",
                "\"prompt_ids\"[1] = 99999999999 is outside",
            ),
            (
                "{\"prompt\": \"a\"}",
                "line 1: expected {\"prompt\": string, \"response\": string}, {\"prompt\": string, \"responses\"",
            ),
        ];
        for (line, want) in cases {
            let e = load(&format!(
                "{{\"prompt\": \"ok\", \"response\": \"x\"}}\n{line}\n"
            ))
            .unwrap_err()
            .to_string();
            let want = want.replace("line 1", "line 2");
            assert!(e.contains(&want), "{line}: {e}");
            assert!(e.contains("fixed.jsonl"), "{e}");
        }
    }
}
