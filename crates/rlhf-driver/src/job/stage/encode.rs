//! Stage datasets as tokens: each SFT example or preference answer becomes a prompt (left of
//! the P prompt columns) and a completion (the R response columns) with the mask of the
//! tokens its loss covers. Chats go through the model's chat template one turn at a time: a
//! turn's tokens are what it adds to the rendering of the turns before it, so an assistant
//! turn's tokens (its answer and end marker) are trained and the template's headers are not.

use std::collections::{BTreeMap, BTreeSet};

use rlhf_config::data::stage::{Reply, SftExample};
use rlhf_config::data::{ChatMessage as DataMessage, PromptContent};
use rlhf_config::PpoConfig;
use rlhf_core::calls::{Mat, Sequences};
use rlhf_core::{Error, Result};
use rlhf_tokenizer::{ChatMessage, Tokenizer};

/// A prompt and a completion in tokens, with the completion tokens the loss covers.
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    pub prompt: Vec<u32>,
    pub completion: Vec<u32>,
    pub loss: Vec<bool>,
}

/// Tokens cut to fit the job's shapes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Cuts {
    /// Prompts cut at the front to `max_prompt_length`.
    pub prompts: usize,
    /// Completions cut at the end to `max_response_length`.
    pub completions: usize,
}

fn chat(msgs: &[DataMessage]) -> Vec<ChatMessage> {
    msgs.iter()
        .map(|m| ChatMessage::new(m.role.clone(), m.content.clone()))
        .collect()
}

pub struct Encoder<'a> {
    pub tok: &'a Tokenizer,
    pub apply_chat_template: bool,
    /// Extra chat template variables (`data.chat_template_kwargs`).
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    pub origin: &'a str,
}

impl Encoder<'_> {
    fn fail(&self, row: usize, what: &str, e: impl std::fmt::Display) -> Error {
        Error::invalid(format!("{} row {row}: {what}: {e}", self.origin))
    }

    /// The prompt of a text prompt: through the chat template as a user turn when asked.
    fn text_prompt(&self, row: usize, text: &str) -> Result<Vec<u32>> {
        let ids = if self.apply_chat_template {
            self.tok.encode_chat_with(
                &[ChatMessage::user(text.to_string())],
                true,
                &self.chat_template_kwargs,
            )
        } else {
            self.tok.encode(text, true)
        };
        ids.map_err(|e| self.fail(row, "cannot tokenize the prompt", e))
    }

    /// A text completion: its tokens and EOS (or, with the chat template, the assistant turn
    /// the template renders after the user's).
    fn text_completion(&self, row: usize, prompt: &str, text: &str) -> Result<Encoded> {
        if self.apply_chat_template {
            let turns = [
                DataMessage {
                    role: "user".into(),
                    content: prompt.into(),
                },
                DataMessage {
                    role: "assistant".into(),
                    content: text.into(),
                },
            ];
            return self.turns(row, &turns, 1, 1);
        }
        let mut completion = self
            .tok
            .encode(text, false)
            .map_err(|e| self.fail(row, "cannot tokenize the completion", e))?;
        completion.extend(self.tok.eos_token_id());
        Ok(Encoded {
            prompt: self.text_prompt(row, prompt)?,
            loss: vec![true; completion.len()],
            completion,
        })
    }

    /// A chat split at turn `split` (the first turn of the completion); the loss covers the
    /// assistant turns at or after `train_from`.
    fn turns(
        &self,
        row: usize,
        msgs: &[DataMessage],
        split: usize,
        train_from: usize,
    ) -> Result<Encoded> {
        let all = chat(msgs);
        let render = |n: usize, gen: bool| {
            self.tok
                .encode_chat_with(&all[..n], gen, &self.chat_template_kwargs)
                .map_err(|e| self.fail(row, "cannot render the chat template", e))
        };
        let prompt = render(split, true)?;
        let (mut completion, mut loss) = (Vec::new(), Vec::new());
        let mut prev = prompt.clone();
        for j in split..all.len() {
            // A user turn followed by an answer renders with the generation prompt, so the
            // assistant header belongs to it (untrained), as in the prompt.
            let gen = all[j].role != "assistant" && j + 1 < all.len();
            let cur = render(j + 1, gen)?;
            if !cur.starts_with(&prev) {
                return Err(self.fail(
                    row,
                    "the chat template",
                    format!("rendering turn {j} changes the tokens of the turns before it, so its tokens cannot be told apart; train on text prompt/completion rows instead"),
                ));
            }
            let trained = all[j].role == "assistant" && j >= train_from;
            loss.extend(std::iter::repeat_n(trained, cur.len() - prev.len()));
            completion.extend_from_slice(&cur[prev.len()..]);
            prev = cur;
        }
        Ok(Encoded {
            prompt,
            completion,
            loss,
        })
    }

    pub fn sft(&self, row: usize, ex: &SftExample) -> Result<Encoded> {
        match ex {
            SftExample::Text { prompt, completion } => {
                self.text_completion(row, prompt, completion)
            }
            SftExample::Chat {
                messages,
                train_from,
            } => {
                // The prompt ends before the first trained assistant turn.
                let split = messages
                    .iter()
                    .enumerate()
                    .position(|(i, m)| i >= *train_from && m.role == "assistant")
                    .ok_or_else(|| {
                        self.fail(row, "the chat", "has no assistant turn to train on")
                    })?;
                self.turns(row, messages, split, *train_from)
            }
        }
    }

    /// One answer of a pair after its prompt; the loss covers the whole answer.
    pub fn answer(&self, row: usize, prompt: &PromptContent, reply: &Reply) -> Result<Encoded> {
        let mut e = match (prompt, reply) {
            (PromptContent::Text(p), Reply::Text(r)) => self.text_completion(row, p, r)?,
            (PromptContent::Messages(p), Reply::Messages(r)) => {
                let mut all = p.clone();
                all.extend(r.iter().cloned());
                self.turns(row, &all, p.len(), p.len())?
            }
            _ => {
                return Err(self.fail(
                    row,
                    "the pair",
                    "mixes a text prompt with message answers (or the reverse)",
                ))
            }
        };
        e.loss.iter_mut().for_each(|l| *l = true);
        Ok(e)
    }
}

/// Rows packed into the job's `[B, P + R]` layout: prompts left-padded (cut at the front when
/// longer), completions right-padded (cut at the end), and each completion's loss mask.
pub fn pack(
    rows: &[&Encoded],
    cfg: &PpoConfig,
    pad: u32,
    cuts: &mut Cuts,
) -> Result<(Sequences, Mat<f32>)> {
    let p = cfg.actor_rollout.max_prompt_length as usize;
    let r = cfg.actor_rollout.max_response_length as usize;
    let b = rows.len();
    let mut ids = Mat::filled(b, p + r, i64::from(pad));
    let mut attn = Mat::filled(b, p + r, 0i64);
    let mut loss = Mat::filled(b, r, 0f32);
    for (i, e) in rows.iter().enumerate() {
        let (prompt, completion, flags) = fitted(e, cfg, cuts)?;
        let off = p - prompt.len();
        for (j, &t) in prompt.iter().enumerate() {
            ids.row_mut(i)[off + j] = i64::from(t);
            attn.row_mut(i)[off + j] = 1;
        }
        for (k, (&t, &l)) in completion.iter().zip(flags).enumerate() {
            ids.row_mut(i)[p + k] = i64::from(t);
            attn.row_mut(i)[p + k] = 1;
            loss.row_mut(i)[k] = f32::from(u8::from(l));
        }
    }
    Ok((
        Sequences {
            input_ids: ids,
            attention_mask: attn,
            response_len: r,
        },
        loss,
    ))
}

/// `data.packing`: the examples (by token count) placed into rows of `len` tokens, best-fit
/// decreasing (longest first, each into the fullest row it still fits, TRL's `bfd`). Rows are
/// in the order they were opened, each row's examples in the order they were placed; the
/// plan depends only on the lengths, so a resumed job packs the same rows.
pub fn plan_packing(lens: &[usize], len: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by(|&a, &b| lens[b].cmp(&lens[a]).then(a.cmp(&b)));
    let mut rows: Vec<Vec<usize>> = Vec::new();
    // Free space -> the rows with exactly that much left (the lowest index first).
    let mut free: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    for i in order {
        let need = lens[i].min(len);
        let fit = free
            .range(need..)
            .next()
            .map(|(&room, set)| (room, set.first().copied()));
        let (row, room) = match fit {
            Some((room, Some(row))) => {
                let set = free.get_mut(&room).expect("listed");
                set.remove(&row);
                if set.is_empty() {
                    free.remove(&room);
                }
                (row, room)
            }
            _ => {
                rows.push(Vec::new());
                (rows.len() - 1, len)
            }
        };
        rows[row].push(i);
        free.entry(room - need).or_default().insert(row);
    }
    rows
}

/// A fitted example: prompt tokens, completion tokens and their loss flags.
type Fitted<'a> = (&'a [u32], &'a [u32], &'a [bool]);

/// An example cut to the job's shapes: its prompt's last P tokens, its completion's first R
/// tokens with their loss flags (the cuts `pack` and `pack_rows` make). A row whose prompt
/// tokenized to nothing is refused, naming `data.path`.
fn fitted<'a>(e: &'a Encoded, cfg: &PpoConfig, cuts: &mut Cuts) -> Result<Fitted<'a>> {
    let p = cfg.actor_rollout.max_prompt_length as usize;
    let r = cfg.actor_rollout.max_response_length as usize;
    if e.prompt.is_empty() {
        return Err(Error::invalid(format!(
            "a row has an empty prompt after tokenization ({})",
            cfg.data.path
        )));
    }
    cuts.prompts += usize::from(e.prompt.len() > p);
    cuts.completions += usize::from(e.completion.len() > r);
    let n = e.completion.len().min(r);
    Ok((
        &e.prompt[e.prompt.len().saturating_sub(p)..],
        &e.completion[..n],
        &e.loss[..n],
    ))
}

/// The token count of an example once cut to the job's shapes (what packing places).
pub fn fitted_len(e: &Encoded, cfg: &PpoConfig) -> usize {
    let p = cfg.actor_rollout.max_prompt_length as usize;
    let r = cfg.actor_rollout.max_response_length as usize;
    e.prompt.len().min(p) + e.completion.len().min(r)
}

/// Packed rows in the `[B, P + R]` layout the SFT trainer takes for them: each row's examples
/// back to back (each cut as in [`pack`]), example k of a row marked with segment id k + 1 in
/// the attention mask (so it attends only to itself and its positions restart), pad after
/// the last one; `response_len` is `P + R - 1`, every token after the first, and the loss
/// mask covers the completion tokens.
pub fn pack_rows(
    rows: &[&[usize]],
    examples: &[Encoded],
    cfg: &PpoConfig,
    pad: u32,
    cuts: &mut Cuts,
) -> Result<(Sequences, Mat<f32>)> {
    let p = cfg.actor_rollout.max_prompt_length as usize;
    let r = cfg.actor_rollout.max_response_length as usize;
    let (b, len) = (rows.len(), p + r);
    let mut ids = Mat::filled(b, len, i64::from(pad));
    let mut attn = Mat::filled(b, len, 0i64);
    let mut loss = Mat::filled(b, len - 1, 0f32);
    for (i, row) in rows.iter().enumerate() {
        let mut off = 0;
        for (k, &ex) in row.iter().enumerate() {
            let (prompt, completion, flags) = fitted(&examples[ex], cfg, cuts)?;
            if off + prompt.len() + completion.len() > len {
                return Err(Error::internal(format!(
                    "packed row {i} overflows its {len} tokens"
                )));
            }
            for (j, &t) in prompt.iter().chain(completion).enumerate() {
                ids.row_mut(i)[off + j] = i64::from(t);
                attn.row_mut(i)[off + j] = k as i64 + 1;
            }
            // Token `c` is predicted at column `c - 1`; a completion token never starts a row.
            for (j, &l) in flags.iter().enumerate() {
                loss.row_mut(i)[off + prompt.len() + j - 1] = f32::from(u8::from(l));
            }
            off += prompt.len() + completion.len();
        }
    }
    Ok((
        Sequences {
            input_ids: ids,
            attention_mask: attn,
            response_len: len - 1,
        },
        loss,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> Tokenizer {
        Tokenizer::from_dir(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../rlhf-tokenizer/tests/fixtures/tokenizer"),
        )
        .unwrap()
    }

    fn turn(role: &str, content: &str) -> DataMessage {
        DataMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    fn trained_text(t: &Tokenizer, e: &Encoded) -> String {
        let ids: Vec<u32> = e
            .completion
            .iter()
            .zip(&e.loss)
            .filter(|(_, &l)| l)
            .map(|(&i, _)| i)
            .collect();
        t.decode(&ids, false).unwrap()
    }

    /// Only the assistant turns' own tokens (answer and end marker) are trained; the
    /// template's headers and the user's turns are not.
    #[test]
    fn chats_train_exactly_the_assistant_turns() {
        let t = tok();
        let enc = Encoder {
            tok: &t,
            apply_chat_template: true,
            chat_template_kwargs: Default::default(),
            origin: "chat.jsonl",
        };
        let chat = vec![
            turn("system", "Be brief."),
            turn("user", "2+3="),
            turn("assistant", "5"),
            turn("user", "and 4+4?"),
            turn("assistant", "8"),
        ];
        let e = enc
            .sft(
                1,
                &SftExample::Chat {
                    messages: chat.clone(),
                    train_from: 0,
                },
            )
            .unwrap();
        assert_eq!(trained_text(&t, &e), "5<|im_end|>\n8<|im_end|>\n");
        let whole = t.decode(&e.completion, false).unwrap();
        assert_eq!(
            whole,
            "5<|im_end|>\n<|im_start|>user\nand 4+4?<|im_end|>\n<|im_start|>assistant\n8<|im_end|>\n"
        );
        assert!(t
            .decode(&e.prompt, false)
            .unwrap()
            .ends_with("<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n"));
        // A conversational prompt + completion trains the completion's turn only.
        let e = enc
            .sft(
                1,
                &SftExample::Chat {
                    messages: chat,
                    train_from: 4,
                },
            )
            .unwrap();
        assert_eq!(trained_text(&t, &e), "8<|im_end|>\n");
    }

    /// `data.chat_template_kwargs` reaches the stage's chats: with Qwen3's template and
    /// `enable_thinking: false` the empty think block is part of the prompt (untrained), and
    /// without it the template writes the block into the answer's turn, which trains it.
    #[test]
    fn chat_template_kwargs_decide_what_the_completion_trains() {
        let dir = tempfile::tempdir().unwrap();
        let t = crate::prompts::qwen3_test_tokenizer(dir.path());
        let ex = SftExample::Text {
            prompt: "2+3=".into(),
            completion: "5".into(),
        };
        let encode = |vars: &str| {
            let enc = Encoder {
                tok: &t,
                apply_chat_template: true,
                chat_template_kwargs: serde_json::from_str(vars).unwrap(),
                origin: "sft.jsonl",
            };
            let e = enc.sft(1, &ex).unwrap();
            (t.decode(&e.prompt, false).unwrap(), trained_text(&t, &e))
        };
        let (prompt, trained) = encode("{}");
        assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt:?}");
        assert_eq!(trained, "<think>\n\n</think>\n\n5<|im_end|>\n");
        let (prompt, trained) = encode(r#"{"enable_thinking": false}"#);
        assert!(
            prompt.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
            "{prompt:?}"
        );
        assert_eq!(trained, "5<|im_end|>\n");
    }

    #[test]
    fn text_rows_end_with_eos_and_pack_into_the_job_shapes() {
        let t = tok();
        let enc = Encoder {
            tok: &t,
            apply_chat_template: false,
            chat_template_kwargs: Default::default(),
            origin: "sft.jsonl",
        };
        let ex = SftExample::Text {
            prompt: "one two three four five six".into(),
            completion: "seven eight nine".into(),
        };
        let e = enc.sft(3, &ex).unwrap();
        assert_eq!(e.completion.last().copied(), t.eos_token_id());
        assert!(e.loss.iter().all(|&l| l));
        let mut cfg = PpoConfig::default();
        cfg.actor_rollout.max_prompt_length = 3;
        cfg.actor_rollout.max_response_length = 2;
        let mut cuts = Cuts::default();
        let (seq, mask) = pack(&[&e], &cfg, 0, &mut cuts).unwrap();
        assert_eq!(
            cuts,
            Cuts {
                prompts: 1,
                completions: 1
            }
        );
        // The prompt keeps its last 3 tokens, the completion its first 2.
        let row: Vec<u32> = seq.input_ids.data.iter().map(|&x| x as u32).collect();
        assert_eq!(&row[..3], &e.prompt[e.prompt.len() - 3..]);
        assert_eq!(&row[3..], &e.completion[..2]);
        assert_eq!(mask.data, vec![1.0, 1.0]);
        assert_eq!(seq.attention_mask.data, vec![1; 5]);
    }

    /// Best-fit decreasing: every example in exactly one row, no row over its length, the
    /// longest first into the fullest row it fits, and the same plan every time.
    #[test]
    fn packing_plans_place_every_example_once_best_fit_decreasing() {
        let lens = [7, 3, 5, 2, 9, 4, 1, 6, 10, 12];
        let rows = plan_packing(&lens, 10);
        let mut seen: Vec<usize> = rows.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..lens.len()).collect::<Vec<_>>());
        for r in &rows {
            assert!(
                r.iter().map(|&i| lens[i].min(10)).sum::<usize>() <= 10,
                "{rows:?}"
            );
        }
        // 12 and 10 fill rows alone (12 is cut to 10); 9+1; 7+3; 6+4; 5+2 -> 6 rows.
        assert_eq!(rows.len(), 6, "{rows:?}");
        assert_eq!(rows[0], vec![9]);
        assert_eq!(rows[2], vec![4, 6]);
        assert_eq!(plan_packing(&lens, 10), rows);
        assert!(plan_packing(&[], 10).is_empty());
    }

    /// A packed row: examples back to back under segment ids 1, 2, ..., pad after; the loss
    /// column of a completion token is the one before it, and cuts are the unpacked ones.
    #[test]
    fn packed_rows_mark_segments_and_shift_the_loss_by_one() {
        let ex = |p: &[u32], c: &[u32], l: &[bool]| Encoded {
            prompt: p.to_vec(),
            completion: c.to_vec(),
            loss: l.to_vec(),
        };
        let examples = vec![
            ex(&[1, 2], &[3, 4], &[true, false]),
            ex(&[5], &[6, 7, 8], &[true, true, true]),
        ];
        let mut cfg = PpoConfig::default();
        cfg.actor_rollout.max_prompt_length = 4;
        cfg.actor_rollout.max_response_length = 6;
        let mut cuts = Cuts::default();
        let rows = [&[0usize, 1][..]];
        let (seq, loss) = pack_rows(&rows, &examples, &cfg, 0, &mut cuts).unwrap();
        assert_eq!(seq.response_len, 9);
        assert_eq!(seq.input_ids.data, vec![1, 2, 3, 4, 5, 6, 7, 8, 0, 0]);
        assert_eq!(seq.attention_mask.data, vec![1, 1, 1, 1, 2, 2, 2, 2, 0, 0]);
        // Tokens 3 (trained), 4 (not), 6, 7, 8 (trained) at columns 2, 3, 5, 6, 7, less one.
        assert_eq!(loss.data, vec![0., 1., 0., 0., 1., 1., 1., 0., 0.]);
        assert_eq!(cuts, Cuts::default());
        // Completions cut to max_response_length = 2, as unpacked; a plan that overflows a
        // row is refused.
        cfg.actor_rollout.max_response_length = 2;
        let (seq, _) = pack_rows(&[&[1][..]], &examples, &cfg, 0, &mut cuts).unwrap();
        assert_eq!(seq.input_ids.data, vec![5, 6, 7, 0, 0, 0]);
        assert_eq!(cuts.completions, 1);
        let e = pack_rows(&rows, &examples, &cfg, 0, &mut cuts).unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
        assert_eq!(fitted_len(&examples[1], &cfg), 3);
    }
}
