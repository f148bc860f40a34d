//! The API half of a [`VllmServer`]: generation token in and token out, teacher-forced
//! log-probs, and the in-place weight reload, over the server's Unix socket. Starting,
//! watching and ending the process is the parent module's.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rlhf_model::{FinishReason, GeneratedSequence, Generation, GenerationConfig};
use serde_json::{json, Value};

use super::{http, VllmServer, SERVED_NAME};
use crate::error::{Error, Result};

impl VllmServer {
    /// Generates one response per prompt row. Consecutive rows with the same prompt (a
    /// GRPO group) go as one request with `n` samples, so the engine computes the prompt
    /// once; all requests are in flight at once, for the engine to batch. `gen.temperature`
    /// 0 is greedy, one request per row. Each request's seed comes from `gen.seed` and the
    /// request's index, and vLLM derives the `n` samples' streams from it.
    pub fn generate(&mut self, prompts: &[Vec<u32>], gen: &GenerationConfig) -> Result<Generation> {
        let greedy = gen.temperature <= 0.0;
        let mut groups: Vec<(usize, usize)> = Vec::new(); // (first row, rows)
        for (i, p) in prompts.iter().enumerate() {
            match groups.last_mut() {
                Some((first, n)) if !greedy && prompts[*first] == *p => *n += 1,
                _ => groups.push((i, 1)),
            }
        }
        let stop: Vec<u32> = gen
            .eos_token_ids
            .iter()
            .chain(&gen.stop_token_ids)
            .copied()
            .collect();
        let bodies: Vec<Value> = groups
            .iter()
            .enumerate()
            .map(|(g, &(first, n))| {
                json!({
                    "model": SERVED_NAME,
                    "prompt": prompts[first],
                    "n": n,
                    "max_tokens": gen.max_new_tokens,
                    "min_tokens": gen.min_new_tokens,
                    "temperature": if greedy { 0.0 } else { gen.temperature },
                    "top_p": gen.top_p,
                    "top_k": if gen.top_k == 0 { -1 } else { gen.top_k as i64 },
                    "seed": request_seed(gen.seed, g),
                    "stop_token_ids": stop,
                    "logprobs": 0,
                    "return_token_ids": true,
                    "skip_special_tokens": false,
                })
            })
            .collect();
        let answers = self.post_all(&bodies);
        let mut sequences = Vec::with_capacity(prompts.len());
        for (&(first, n), answer) in groups.iter().zip(answers) {
            let v = answer?;
            let samples = parse_choices(&v, n, gen.max_new_tokens, self.settings.vocab_size)?;
            for (k, (token_ids, logprobs, finish_reason)) in samples.into_iter().enumerate() {
                sequences.push(GeneratedSequence {
                    prompt_index: first + k,
                    sample_index: 0,
                    prompt_ids: prompts[first + k].clone(),
                    token_ids,
                    logprobs,
                    finish_reason,
                });
            }
        }
        Ok(Generation {
            sequences,
            pad_token_id: gen
                .pad_token_id
                .or(gen.eos_token_ids.first().copied())
                .unwrap_or(0),
            max_new_tokens: gen.max_new_tokens,
        })
    }

    /// Posts every body to `/v1/completions` at once (for the engine to batch) and returns
    /// the answers in order; a failed exchange is said as the server's death when it died.
    fn post_all(&mut self, bodies: &[Value]) -> Vec<Result<Value>> {
        let within = self.settings.request_timeout;
        let (socket, key) = (&self.socket, &self.api_key);
        let answers: Vec<Result<http::Answer>> = std::thread::scope(|s| {
            let handles: Vec<_> = bodies
                .iter()
                .map(|b| {
                    s.spawn(move || {
                        let bytes = b.to_string().into_bytes();
                        http::request(socket, "POST", "/v1/completions", key, Some(&bytes), within)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::internal("a vLLM request thread panicked")))
                })
                .collect()
        });
        answers
            .into_iter()
            .map(|a| {
                let a = a.map_err(|e| self.explain(e))?;
                self.answer(&a, "a completions request")
            })
            .collect()
    }

    /// The served model's log-probs of `ids[1..]`, each given the tokens before it
    /// (teacher-forced, temperature 1): a probe that tells which weights are served.
    pub fn prompt_log_probs(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let mut all = self.sequence_log_probs(&[ids.to_vec()])?;
        Ok(all.pop().unwrap_or_default())
    }

    /// [`Self::prompt_log_probs`] of several sequences at once. Always at temperature 1:
    /// vLLM computes prompt log-probs from the raw logits whatever the request's temperature
    /// (seen with vLLM 0.32: a request at 0.7 answered the temperature-1 values).
    pub fn sequence_log_probs(&mut self, seqs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let bodies: Vec<Value> = seqs
            .iter()
            .map(|ids| {
                json!({
                    "model": SERVED_NAME, "prompt": ids, "max_tokens": 1, "temperature": 1.0,
                    "prompt_logprobs": 0,
                })
            })
            .collect();
        let answers = self.post_all(&bodies);
        seqs.iter()
            .zip(answers)
            .map(|(ids, v)| prompt_logprobs_of(&v?, ids))
            .collect()
    }

    /// A directory for the safetensors of the next [`Self::reload`], inside the server's
    /// private directory (in shared memory where there is some).
    pub fn weights_dir(&self) -> PathBuf {
        self.dir.join("weights")
    }

    /// Replaces the served weights with the safetensors files in `weights_dir`: pause (no
    /// request is running), `reload_weights`, resume. A failed reload still resumes, and is
    /// an error. Returns the time it took.
    pub fn reload(&mut self, weights_dir: &Path) -> Result<Duration> {
        let t = Instant::now();
        let within = self.settings.start_timeout;
        self.post("/pause", &json!({}), within)?;
        let reloaded = self.post(
            "/collective_rpc",
            &json!({"method": "reload_weights", "kwargs": {"weights_path": weights_dir}}),
            within,
        );
        let resumed = self.post("/resume", &json!({}), within);
        reloaded.map_err(|e| {
            e.context(format!(
                "reloading the vLLM weights from {}",
                weights_dir.display()
            ))
        })?;
        resumed?;
        Ok(t.elapsed())
    }
}

/// The log-probs of `ids[1..]` in a completions answer's `prompt_logprobs` (keyed by the
/// token id at each position).
fn prompt_logprobs_of(v: &Value, ids: &[u32]) -> Result<Vec<f32>> {
    let list = v["choices"][0]["prompt_logprobs"]
        .as_array()
        .ok_or_else(|| Error::internal("vLLM returned no prompt_logprobs"))?;
    ids.iter()
        .enumerate()
        .skip(1)
        .map(|(i, id)| {
            list.get(i)
                .and_then(|e| e[id.to_string()]["logprob"].as_f64())
                .map(|x| x as f32)
                .ok_or_else(|| Error::internal(format!("vLLM's prompt_logprobs lack position {i}")))
        })
        .collect()
}

/// The seed of the `g`-th request of a generation: vLLM seeds a request's `n` samples with
/// `seed + k`, so requests get seeds far apart (a SplitMix64 step of the pair).
fn request_seed(seed: u64, g: usize) -> u64 {
    let mut z = seed ^ (g as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    // vLLM takes a signed 64-bit seed.
    (z ^ (z >> 31)) >> 1
}

type Sample = (Vec<u32>, Vec<f32>, FinishReason);

/// The `n` choices of a completions answer, in index order: token ids (each below `vocab`),
/// their log-probs and why each ended.
fn parse_choices(v: &Value, n: usize, max_tokens: usize, vocab: usize) -> Result<Vec<Sample>> {
    let choices = v["choices"]
        .as_array()
        .ok_or_else(|| Error::internal("vLLM answered without choices"))?;
    if choices.len() != n {
        return Err(Error::internal(format!(
            "vLLM answered {} choices for n = {n}",
            choices.len()
        )));
    }
    let mut out: Vec<Option<Sample>> = vec![None; n];
    for c in choices {
        let i = c["index"].as_u64().map(|i| i as usize).filter(|&i| i < n);
        let i = i.ok_or_else(|| {
            Error::internal(format!("vLLM choice index {} out of range", c["index"]))
        })?;
        let ids: Vec<u32> = c["token_ids"]
            .as_array()
            .ok_or_else(|| Error::internal("vLLM answered without token_ids (return_token_ids)"))?
            .iter()
            .map(|t| match t.as_u64() {
                Some(id) if (id as u128) < vocab as u128 => Ok(id as u32),
                _ => Err(Error::invalid(format!(
                    "vLLM returned token id {t}, outside the tokenizer's vocabulary (0..{vocab}): \
                     is it serving another model than the trainer's?"
                ))),
            })
            .collect::<Result<_>>()?;
        let lps: Vec<f32> = c["logprobs"]["token_logprobs"]
            .as_array()
            .ok_or_else(|| Error::internal("vLLM answered without token_logprobs"))?
            .iter()
            .map(|x| x.as_f64().map(|x| x as f32).unwrap_or(f32::NEG_INFINITY))
            .collect();
        if ids.len() != lps.len() || ids.is_empty() && max_tokens > 0 || ids.len() > max_tokens {
            return Err(Error::internal(format!(
                "vLLM answered {} tokens with {} log-probs (max_tokens {max_tokens})",
                ids.len(),
                lps.len()
            )));
        }
        let finish = match c["finish_reason"].as_str() {
            Some("stop") => FinishReason::Stop(*ids.last().unwrap_or(&0)),
            Some("length") => FinishReason::Length,
            other => {
                return Err(Error::internal(format!(
                    "vLLM ended a sample with finish_reason {other:?}"
                )))
            }
        };
        out[i] = Some((ids, lps, finish));
    }
    out.into_iter()
        .enumerate()
        .map(|(i, s)| s.ok_or_else(|| Error::internal(format!("vLLM answered no choice {i}"))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_are_read_in_index_order_and_bad_ids_refused() {
        let v = json!({"choices": [
            {"index": 1, "token_ids": [5, 0], "logprobs": {"token_logprobs": [-0.5, -0.1]}, "finish_reason": "stop"},
            {"index": 0, "token_ids": [7, 8, 9], "logprobs": {"token_logprobs": [-1.0, -2.0, -3.0]}, "finish_reason": "length"},
        ]});
        let s = parse_choices(&v, 2, 3, 384).unwrap();
        assert_eq!(s[0].0, vec![7, 8, 9]);
        assert_eq!(s[0].2, FinishReason::Length);
        assert_eq!(
            (s[1].0.clone(), s[1].2),
            (vec![5, 0], FinishReason::Stop(0))
        );
        let bad = json!({"choices": [
            {"index": 0, "token_ids": [400], "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "stop"},
        ]});
        let e = parse_choices(&bad, 1, 3, 384).unwrap_err().to_string();
        assert!(e.contains("token id 400") && e.contains("0..384"), "{e}");
        assert!(parse_choices(&v, 3, 3, 384).is_err(), "n mismatch");
    }

    #[test]
    fn request_seeds_are_far_apart_and_fit_a_signed_64_bit_integer() {
        let seeds: Vec<u64> = (0..1000).map(|g| request_seed(42, g)).collect();
        for (i, a) in seeds.iter().enumerate() {
            assert!(*a <= i64::MAX as u64);
            for b in &seeds[i + 1..] {
                assert!(a.abs_diff(*b) > 1 << 20, "{a} {b}");
            }
        }
        assert_eq!(request_seed(42, 3), request_seed(42, 3));
    }
}
