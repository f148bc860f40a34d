//! The reward role: built-in rules, an HTTP endpoint, or a reward model.

use std::time::Duration;

use std::sync::Arc;

use candle_core::Device;
use rlhf_config::{EngineSpec, RewardSpec, RoleSpec, Shapes};
use rlhf_core::calls::{ScoresRequest, ScoresResponse, Verdict};
use rlhf_model::{Batch, LoadOptions, Model, ModelKind};
use serde_json::{json, Value};

use crate::convert::{self, sequences};
use crate::engine::Score;
use crate::error::{Ctx, Error, Result};
use crate::policy::wrong_engine;

/// The built-in rules, by config name (`reward.rule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// 1.0 when the response contains an ASCII digit, else 0.0.
    ContainsDigit,
    /// Response characters / 100, capped at 1.0.
    Length,
    /// 1.0 when the trimmed response equals the row's `ground_truth` column.
    ExactMatch,
    /// 1.0 when the response's final answer (its last `\boxed{}`, else its last number)
    /// equals the row's `ground_truth` as a number or as text ([`crate::math_answer`]); a
    /// response without an answer scores 0.
    Math,
}

impl Rule {
    pub const NAMES: &'static [&'static str] = &["contains_digit", "length", "exact_match", "math"];

    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "contains_digit" => Ok(Rule::ContainsDigit),
            "length" => Ok(Rule::Length),
            "exact_match" => Ok(Rule::ExactMatch),
            "math" => Ok(Rule::Math),
            other => Err(Error::invalid(format!(
                "unknown reward.rule '{other}'; built-in rules: {}",
                Self::NAMES.join(", ")
            ))),
        }
    }

    /// Scores of `responses` and, for the verifying rules, each response's verdict;
    /// `ground_truth` is the column of that name when the batch has it. `math` scores a right
    /// answer 1, a wrong one `scoring.format_score` and none `scoring.no_answer_score`.
    pub fn score(
        self,
        responses: &[String],
        ground_truth: Option<&[Option<String>]>,
        scoring: MathScoring,
    ) -> Result<(Vec<f32>, Option<Vec<Verdict>>)> {
        match self {
            Rule::ContainsDigit => Ok((
                responses
                    .iter()
                    .map(|r| f32::from(u8::from(r.chars().any(|c| c.is_ascii_digit()))))
                    .collect(),
                None,
            )),
            Rule::Length => Ok((
                responses
                    .iter()
                    .map(|r| (r.chars().count() as f32 / 100.0).min(1.0))
                    .collect(),
                None,
            )),
            Rule::ExactMatch | Rule::Math => {
                let name = if self == Rule::Math {
                    "math"
                } else {
                    "exact_match"
                };
                let gt = ground_truth.ok_or_else(|| {
                    Error::invalid(format!(
                        "reward.rule {name} needs a 'ground_truth' column in the \
                         ComputeScores batch; put the answers in the prompt dataset's \
                         ground_truth field (data.ground_truth_key)"
                    ))
                })?;
                if gt.len() != responses.len() {
                    return Err(Error::invalid(format!(
                        "column 'ground_truth' has {} rows but there are {} responses",
                        gt.len(),
                        responses.len()
                    )));
                }
                let verdicts: Vec<Verdict> = responses
                    .iter()
                    .zip(gt)
                    .map(|(r, g)| {
                        // A row without a reference answer cannot be right.
                        let Some(want) = g else { return Verdict::Wrong };
                        let right = match self {
                            Rule::Math => crate::math_answer::is_correct(r, want),
                            _ => Some(r.trim() == want.trim()),
                        };
                        match right {
                            Some(true) => Verdict::Right,
                            Some(false) => Verdict::Wrong,
                            None => Verdict::NoAnswer,
                        }
                    })
                    .collect();
                let scores = verdicts
                    .iter()
                    .map(|v| match v {
                        Verdict::Right => 1.0,
                        Verdict::Wrong => scoring.format_score as f32,
                        Verdict::NoAnswer => scoring.no_answer_score as f32,
                    })
                    .collect();
                Ok((scores, Some(verdicts)))
            }
        }
    }
}

/// The `math` rule's scores of a wrong answer and of none (`reward.format_score`,
/// `reward.no_answer_score`); 0 and 0 by default.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MathScoring {
    pub format_score: f64,
    pub no_answer_score: f64,
}

/// Scores from an HTTP endpoint: POST `{"prompts": [...], "responses": [...]}`, answer
/// `{"scores": [...]}` with one number per response.
#[derive(Debug, Clone)]
pub struct HttpReward {
    pub url: String,
    pub timeout: Duration,
}

impl HttpReward {
    pub fn new(url: &str, timeout_s: f64) -> Result<Self> {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(Error::invalid(format!(
                "reward.url '{url}' is not an http:// or https:// URL"
            )));
        }
        if !(timeout_s > 0.0 && timeout_s.is_finite()) {
            return Err(Error::invalid(format!(
                "reward.timeout_s ({timeout_s}) must be > 0"
            )));
        }
        Ok(Self {
            url: url.to_string(),
            timeout: Duration::from_secs_f64(timeout_s),
        })
    }

    fn fail(&self, reason: impl Into<String>) -> Error {
        Error::Http {
            url: self.url.clone(),
            reason: reason.into(),
        }
    }

    pub fn score(&self, prompts: &[String], responses: &[String]) -> Result<Vec<f32>> {
        let agent = ureq::AgentBuilder::new().timeout(self.timeout).build();
        let body = json!({ "prompts": prompts, "responses": responses }).to_string();
        let resp = agent
            .post(&self.url)
            .set("Content-Type", "application/json")
            .send_string(&body);
        let text = match resp {
            Ok(r) => r
                .into_string()
                .map_err(|e| self.fail(format!("reading the answer: {e}")))?,
            Err(ureq::Error::Status(code, r)) => {
                let detail = r.into_string().unwrap_or_default();
                let detail: String = detail.chars().take(300).collect();
                return Err(self.fail(format!("answered HTTP {code}: {detail}")));
            }
            Err(e) => {
                return Err(self.fail(format!(
                    "request failed (timeout {:.1} s): {e}",
                    self.timeout.as_secs_f64()
                )))
            }
        };
        let v: Value = serde_json::from_str(&text).map_err(|e| {
            let head: String = text.chars().take(200).collect();
            self.fail(format!("answer is not JSON ({e}): {head}"))
        })?;
        let scores = v.get("scores").and_then(Value::as_array).ok_or_else(|| {
            self.fail("answer has no \"scores\" array; expected {\"scores\": [numbers]}")
        })?;
        if scores.len() != responses.len() {
            return Err(self.fail(format!(
                "answer has {} scores for {} responses; expected one score per response",
                scores.len(),
                responses.len()
            )));
        }
        scores
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.as_f64()
                    .filter(|x| x.is_finite())
                    .map(|x| x as f32)
                    .ok_or_else(|| self.fail(format!("score {i} is {s}, not a finite number")))
            })
            .collect()
    }
}

/// How this process scores.
pub enum Reward {
    Rule(Rule, MathScoring),
    Http(HttpReward),
    Model {
        model: Arc<Model>,
        shapes: Shapes,
        micro: usize,
    },
}

impl Reward {
    pub fn new(spec: &RoleSpec, device: &Device) -> Result<Self> {
        let EngineSpec::Reward(r) = &spec.engine else {
            return Err(wrong_engine(spec, "a reward"));
        };
        match r {
            RewardSpec::Rule {
                rule,
                format_score,
                no_answer_score,
            } => Ok(Reward::Rule(
                Rule::parse(rule)?,
                MathScoring {
                    format_score: *format_score,
                    no_answer_score: *no_answer_score,
                },
            )),
            RewardSpec::Http { url, timeout_s } => {
                Ok(Reward::Http(HttpReward::new(url, *timeout_s)?))
            }
            RewardSpec::Model => {
                let dir = spec.model_dir()?;
                let opts = crate::convert::load_options(
                    spec,
                    device,
                    LoadOptions::inference().with_kind(ModelKind::Reward),
                );
                let model = Model::load(dir, &opts)
                    .with_ctx(|| format!("loading the reward model from {}", dir.display()))?;
                Ok(Reward::Model {
                    model: Arc::new(model),
                    shapes: spec.shapes,
                    micro: spec.micro_batch_rows,
                })
            }
        }
    }

    /// The reward model, when scores come from one.
    pub fn model(&self) -> Option<&Arc<Model>> {
        match self {
            Reward::Model { model, .. } => Some(model),
            _ => None,
        }
    }

    /// What was loaded, for InitRole.
    pub fn describe(&self) -> String {
        match self {
            Reward::Rule(r, _) => format!("rule:{r:?}"),
            Reward::Http(h) => format!("http:{}", h.url),
            Reward::Model { model, .. } => model
                .source_dir()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "reward model".into()),
        }
    }
}

impl Score for Reward {
    /// Rules read the response texts (and `ground_truth`), endpoints the prompt and
    /// response texts, reward models the token ids.
    fn score(&self, req: &ScoresRequest) -> Result<ScoresResponse> {
        let b = req.seq.rows();
        let (scores, verdicts) = match self {
            Reward::Rule(rule, scoring) => {
                rule.score(&req.response_text, req.ground_truth.as_deref(), *scoring)?
            }
            Reward::Http(h) => (h.score(&req.prompt_text, &req.response_text)?, None),
            Reward::Model {
                model,
                shapes,
                micro,
            } => {
                let (ids, mask) = sequences("ComputeScores", &req.seq, *shapes, model.device())?;
                let mut out = Vec::with_capacity(b);
                let all: Vec<usize> = (0..b).collect();
                for idx in all.chunks((*micro).max(1)) {
                    let batch =
                        Batch::from_mask(convert::rows(&ids, idx)?, convert::rows(&mask, idx)?)?;
                    let s = model.scores(&batch)?;
                    out.extend(s.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?);
                }
                (out, None)
            }
        };
        if scores.len() != b {
            return Err(Error::internal(format!(
                "{} scores for {b} rows",
                scores.len()
            )));
        }
        Ok(ScoresResponse { scores, verdicts })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_score_and_name_their_inputs() {
        let d = MathScoring::default();
        let scores = |rule: Rule, r: &[String], gt: Option<&[Option<String>]>| {
            rule.score(r, gt, d).unwrap().0
        };
        let r = vec![
            "no digits".to_string(),
            "answer: 42".into(),
            "x".repeat(250),
        ];
        assert_eq!(
            Rule::parse("contains_digit")
                .unwrap()
                .score(&r, None, d)
                .unwrap(),
            (vec![0.0, 1.0, 0.0], None)
        );
        assert_eq!(
            Rule::parse("length").unwrap().score(&r, None, d).unwrap().0,
            vec![0.09, 0.1, 1.0]
        );
        let gt = vec![Some("no digits".to_string()), Some("42".into()), None];
        let exact = Rule::parse("exact_match").unwrap();
        let r2 = vec![" no digits \n".to_string(), "answer: 42".into(), "".into()];
        assert_eq!(scores(exact, &r2, Some(&gt)), vec![1.0, 0.0, 0.0]);
        let err = exact.score(&r2, None, d).unwrap_err().to_string();
        assert!(err.contains("'ground_truth' column"), "{err}");
        // math: the final answer as a number, whatever surrounds it; none scores 0.
        let math = Rule::parse("math").unwrap();
        assert_eq!(
            scores(math, &r2, Some(&gt)),
            vec![0.0, 1.0, 0.0],
            "no answer in the text, 42 found, no ground truth"
        );
        let r3 = vec![
            "so \\boxed{\\frac{6}{8}}".to_string(),
            "3 or 4? 0.7".into(),
            "I do not know".into(),
        ];
        let gt3 = vec![
            Some("0.75".to_string()),
            Some("3/4".into()),
            Some("1".into()),
        ];
        assert_eq!(scores(math, &r3, Some(&gt3)), vec![1.0, 0.0, 0.0]);
        // A wrong answer and no answer score as configured, and the verdicts tell them apart.
        let graded = MathScoring {
            format_score: 0.1,
            no_answer_score: -0.5,
        };
        let (s, v) = math.score(&r3, Some(&gt3), graded).unwrap();
        assert_eq!(s, vec![1.0, 0.1, -0.5]);
        assert_eq!(
            v,
            Some(vec![Verdict::Right, Verdict::Wrong, Verdict::NoAnswer])
        );
        let (_, v) = exact.score(&r2, Some(&gt), graded).unwrap();
        assert_eq!(
            v,
            Some(vec![Verdict::Right, Verdict::Wrong, Verdict::Wrong])
        );
        let err = math.score(&r3, None, d).unwrap_err().to_string();
        assert!(err.contains("reward.rule math needs"), "{err}");
        let err = Rule::parse("regex").unwrap_err().to_string();
        assert!(
            err.contains("'regex'") && err.contains("contains_digit, length, exact_match, math"),
            "{err}"
        );
    }
}
