#!/usr/bin/env python3
"""Build the tiny reference fixtures for crates/rlhf-model tests.

Writes, under crates/rlhf-model/tests/fixtures/ (or --out):
  tokenizer/           tiny byte-level BPE tokenizer with a ChatML-style chat template
  tiny-llama/          LlamaForCausalLM, untied embeddings, config in the `rope_parameters` form
  tiny-llama3-rope/    LlamaForCausalLM, llama3 rope scaling, tied embeddings, sharded weights,
                       config in the legacy top-level `rope_theta` / `rope_scaling` form
  tiny-qwen2/          Qwen2ForCausalLM (q/k/v biases, tied embeddings), legacy top-level `rope_theta`
  tiny-qwen3/          Qwen3ForCausalLM (per-head q/k RMSNorm, head_dim 32 != hidden/heads 16,
                       untied embeddings)
  tiny-llama-reward/   LlamaForSequenceClassification with num_labels=1 (`score.weight`)
  reference.json       logits, log-probs, entropies, greedy continuations, rewards, tokenizer checks

Everything is seeded; rerunning on the same library versions writes the same numbers.
`--only qwen3` adds (or rewrites) tiny-qwen3 alone, with the committed tokenizer, and keeps
every other entry of reference.json as it is.
Run through scripts/model_fixtures.sh, which creates the virtual environment.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import torch
import tokenizers
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SEED = 1234
VOCAB_SIZE = 320
EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIALS = [EOT, IM_START, IM_END]

# A Qwen-like ChatML template: a default system turn when none is given, one block per message,
# and the assistant header when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs.
A small model learns to answer questions. The user asks and the assistant answers politely.
You are a helpful assistant. Please answer the question in one short sentence.
What is the capital of France? The capital of France is Paris.
What is two plus two? Two plus two is four. Three plus three is six.
The policy generates a response, the reward model scores it, and the critic predicts the value.
Reinforcement learning from human feedback trains the policy with proximal policy optimization.
The weather today is sunny and warm. Tomorrow it will rain in the morning and clear up later.
She reads a book about the history of the sea, the ships, and the people who sailed them.
Numbers like 1, 2, 3, 10, 42 and 100 appear in text; so do symbols such as #, @, % and &.
Hello world! Hello there. How are you today? I am fine, thank you, and you?
The system prompt sets the tone; the user turn asks; the assistant turn replies.
Café, naïve, résumé and jalapeño are words with accents. Emoji like 🙂 also appear.
"""

CHAT_WORDS = "system user assistant " * 20


def set_seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)


def build_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = (CORPUS + "\n" + CHAT_WORDS).splitlines() * 4
    tok.train_from_iterator(lines, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=128,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    fast.save_pretrained(out_dir)
    place_chat_template(out_dir, "inline")
    # Reload through the Auto class, exactly as a user of the fixture would.
    return AutoTokenizer.from_pretrained(out_dir)


def common_cfg(tok, **over):
    cfg = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        # A wider init than the default 0.02 makes logits peaked enough that greedy picks
        # are separated by a clear margin and f32 rounding cannot flip them.
        initializer_range=0.1,
        bos_token_id=tok.convert_tokens_to_ids(EOT),
        eos_token_id=tok.convert_tokens_to_ids(EOT),
        pad_token_id=tok.convert_tokens_to_ids(EOT),
        attn_implementation="eager",
    )
    cfg.update(over)
    return cfg


def rope_kwargs(theta: float, scaling: dict | None):
    """Pass RoPE settings in whichever form the installed transformers expects."""
    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        params = {"rope_type": "default", "rope_theta": theta}
        if scaling is not None:
            params = dict(scaling)
            params["rope_theta"] = theta
        return {"rope_parameters": params}
    kw = {"rope_theta": theta}
    if scaling is not None:
        kw["rope_scaling"] = dict(scaling)
    return kw


def to_legacy_rope(cfg_path: Path) -> None:
    """Rewrite config.json into the legacy form: top-level rope_theta (+ rope_scaling)."""
    cfg = json.loads(cfg_path.read_text())
    params = cfg.pop("rope_parameters", None)
    if params is None:
        return
    params = dict(params)
    cfg["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = params
    else:
        cfg["rope_scaling"] = None
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def to_new_rope(cfg_path: Path) -> None:
    """Rewrite config.json into the `rope_parameters` form."""
    cfg = json.loads(cfg_path.read_text())
    if "rope_parameters" in cfg:
        return
    params = {"rope_type": "default"}
    scaling = cfg.pop("rope_scaling", None)
    if scaling:
        params = dict(scaling)
    params["rope_theta"] = cfg.pop("rope_theta")
    cfg["rope_parameters"] = params
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def rope_form(cfg_path: Path) -> str:
    cfg = json.loads(cfg_path.read_text())
    if "rope_parameters" in cfg and "rope_theta" not in cfg:
        return "rope_parameters"
    if "rope_theta" in cfg and "rope_parameters" not in cfg:
        return "legacy"
    return "mixed"


def place_chat_template(out_dir: Path, where: str) -> None:
    """Put the chat template where checkpoints keep it.

    where: "inline" (a `chat_template` key in tokenizer_config.json, the form most hub
    checkpoints use), "file" (chat_template.jinja, what transformers 5 writes) or "none"
    (a tokenizer without a template, for the `--chat` error path).
    """
    jinja = out_dir / "chat_template.jinja"
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # The generic class name loads in transformers 4.x and 5.x alike.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    # Load-time arguments that save_pretrained echoes back; they say nothing about the tokenizer.
    for key in ("is_local", "local_files_only", "name_or_path"):
        cfg.pop(key, None)
    if where == "inline":
        cfg["chat_template"] = jinja.read_text()
        jinja.unlink()
    elif where == "none":
        jinja.unlink()
        cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    again = AutoTokenizer.from_pretrained(out_dir)
    if where == "none":
        assert not again.chat_template, out_dir
    else:
        assert again.chat_template == CHAT_TEMPLATE, (out_dir, again.chat_template)


def save_model(model, tok, out_dir: Path, gen_cfg: GenerationConfig, chat: str, **save_kw) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True, **save_kw)
    tok.save_pretrained(out_dir)
    place_chat_template(out_dir, chat)
    gen_cfg.save_pretrained(out_dir)


def dir_size(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def r7(x) -> list | float:
    """Round floats to 7 significant digits (f32 carries about 7)."""
    arr = np.asarray(x, dtype=np.float64)
    flat = [float(f"{v:.7g}") for v in arr.reshape(-1)]
    return np.array(flat).reshape(arr.shape).tolist()


def left_pad(tok, texts):
    pad = tok.pad_token_id
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    t_max = max(len(x) for x in ids)
    input_ids = [[pad] * (t_max - len(x)) + x for x in ids]
    mask = [[0] * (t_max - len(x)) + [1] * len(x) for x in ids]
    return ids, torch.tensor(input_ids), torch.tensor(mask)


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


PROMPTS = [
    "The fox",
    "Hello world!",
    "The capital of France",
]

REWARD_TEXTS = [
    "Two plus two is four.",
    "The capital of France is Paris.",
    "Hello world!",
]


@torch.no_grad()
def causal_reference(model, tok, name: str, new_tokens: int = 8) -> dict:
    model.eval()
    ids, input_ids, mask = left_pad(tok, PROMPTS)
    pos = position_ids_from_mask(mask)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=pos).logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    target = input_ids[:, 1:]
    next_lp = logp[:, :-1, :].gather(-1, target.unsqueeze(-1)).squeeze(-1)
    logp_t = torch.log_softmax(logits / 0.7, dim=-1)
    next_lp_t = logp_t[:, :-1, :].gather(-1, target.unsqueeze(-1)).squeeze(-1)
    probs = torch.softmax(logits, dim=-1)
    entropy = -(probs * logp).sum(-1)

    # Greedy through HF generate on the left-padded batch (stops on EOS, pads the rest).
    gen_cfg = copy.deepcopy(model.generation_config)
    gen_cfg.do_sample = False
    gen_cfg.max_new_tokens = new_tokens
    gen_cfg.pad_token_id = tok.pad_token_id
    out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=gen_cfg)
    hf_new = out[:, input_ids.shape[1]:]

    # The same greedy decode by hand, full forward each step, no stop tokens: checks that
    # generate used the position ids we wrote and gives the margin between the two best logits.
    cur_ids, cur_mask = input_ids.clone(), mask.clone()
    manual, margins = [], []
    for _ in range(new_tokens):
        p = position_ids_from_mask(cur_mask)
        lg = model(input_ids=cur_ids, attention_mask=cur_mask, position_ids=p).logits[:, -1, :]
        top2 = lg.topk(2, dim=-1).values
        margins.append((top2[:, 0] - top2[:, 1]).min().item())
        nxt = lg.argmax(-1, keepdim=True)
        manual.append(nxt)
        cur_ids = torch.cat([cur_ids, nxt], dim=1)
        cur_mask = torch.cat([cur_mask, torch.ones_like(nxt)], dim=1)
    manual = torch.cat(manual, dim=1)

    eos_ids = gen_cfg.eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    for b in range(manual.shape[0]):
        for j in range(new_tokens):
            assert hf_new[b, j].item() == manual[b, j].item(), (name, b, j, hf_new[b], manual[b])
            if manual[b, j].item() in eos_ids:
                break
    min_margin = min(margins)
    assert min_margin > 1e-3, f"{name}: greedy margin {min_margin} too small; change the seed"

    return {
        "prompts": PROMPTS,
        "prompt_token_ids": ids,
        "pad_token_id": tok.pad_token_id,
        "input_ids": input_ids.tolist(),
        "attention_mask": mask.tolist(),
        "position_ids": pos.tolist(),
        "logits_shape": list(logits.shape),
        "logits": r7(logits.numpy()),
        "next_token_logprobs": r7(next_lp.numpy()),
        "next_token_logprobs_temp_0_7": r7(next_lp_t.numpy()),
        "entropy": r7(entropy.numpy()),
        "greedy_new_tokens": new_tokens,
        "greedy_eos_token_ids": sorted(eos_ids),
        "greedy_hf_generate": hf_new.tolist(),
        "greedy_no_stop": manual.tolist(),
        "greedy_min_top2_logit_margin": float(f"{min_margin:.4g}"),
    }


@torch.no_grad()
def reward_reference(model, tok) -> dict:
    model.eval()
    pad = tok.pad_token_id
    ids = [tok.encode(t, add_special_tokens=False) for t in REWARD_TEXTS]
    for x in ids:
        assert pad not in x
    t_max = max(len(x) for x in ids)
    res = {"texts": REWARD_TEXTS, "token_ids": ids, "pad_token_id": pad}
    for side in ("left", "right"):
        if side == "left":
            input_ids = [[pad] * (t_max - len(x)) + x for x in ids]
            mask = [[0] * (t_max - len(x)) + [1] * len(x) for x in ids]
        else:
            input_ids = [x + [pad] * (t_max - len(x)) for x in ids]
            mask = [[1] * len(x) + [0] * (t_max - len(x)) for x in ids]
        input_ids, mask = torch.tensor(input_ids), torch.tensor(mask)
        pos = position_ids_from_mask(mask)
        scores = model(input_ids=input_ids, attention_mask=mask, position_ids=pos).logits
        assert scores.shape == (len(ids), 1), scores.shape
        res[f"{side}_padded"] = {
            "input_ids": input_ids.tolist(),
            "attention_mask": mask.tolist(),
            "position_ids": pos.tolist(),
            "scores": r7(scores[:, 0].numpy()),
        }
    a = np.array(res["left_padded"]["scores"])
    b = np.array(res["right_padded"]["scores"])
    assert np.abs(a - b).max() < 1e-4, (a, b)
    return res


def tokenizer_reference(tok) -> dict:
    strings = [
        "Hello world!",
        "The quick brown fox jumps over the lazy dog.",
        "  two  spaces, tabs\tand\nnewlines",
        "Café naïve 🙂 42",
        "<|im_start|>user\nHi there<|im_end|>",
        "zebra xylophone",
    ]
    encodings = []
    for s in strings:
        ids = tok.encode(s, add_special_tokens=False)
        encodings.append({"text": s, "ids": ids, "decoded": tok.decode(ids)})
    convs = {
        "two_turns_default_system": [
            {"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "Two plus two is four."},
            {"role": "user", "content": "And three plus three?"},
        ],
        "two_turns_with_system": [
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"},
        ],
    }
    chats = []
    for name, msgs in convs.items():
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        assert ids == tok.encode(text, add_special_tokens=False), name
        chats.append({"name": name, "messages": msgs, "add_generation_prompt": True, "text": text, "ids": ids})
    return {
        "vocab_size": len(tok),
        "special_tokens": {s: tok.convert_tokens_to_ids(s) for s in SPECIALS},
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "encode_without_special_tokens": encodings,
        "chat_template": chats,
    }


def check_reload(cls, path: Path, model, tok) -> None:
    """The saved directory (after any config rewrite) must load back with identical logits."""
    again = cls.from_pretrained(path, attn_implementation="eager")
    again.eval()
    _, input_ids, mask = left_pad(tok, PROMPTS)
    pos = position_ids_from_mask(mask)
    with torch.no_grad():
        a = model(input_ids=input_ids, attention_mask=mask, position_ids=pos).logits
        b = again(input_ids=input_ids, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(a, b), f"{path}: reloaded logits differ by {(a - b).abs().max()}"


def qwen3_fixture(tok, out: Path) -> dict:
    """tiny-qwen3: per-head RMSNorm on q and k (random weights, so the test sees whether they
    are applied), head_dim 32 with 4 heads on hidden 64, no q/k/v bias, untied embeddings."""
    set_seed(SEED + 4)
    im_end = tok.convert_tokens_to_ids(IM_END)
    eot = tok.convert_tokens_to_ids(EOT)
    cfg = Qwen3Config(**common_cfg(tok, tie_word_embeddings=False, head_dim=32, use_sliding_window=False),
                      **rope_kwargs(1_000_000.0, None))
    model = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    d = out / "tiny-qwen3"
    save_model(model, tok, d, GenerationConfig(bos_token_id=eot, eos_token_id=[eot, im_end], pad_token_id=eot), chat="inline")
    check_reload(AutoModelForCausalLM, d, model, tok)
    model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
    return {"architecture": "Qwen3ForCausalLM", "rope_config_form": rope_form(d / "config.json"),
            **causal_reference(model, tok, "tiny-qwen3")}


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=root / "crates/rlhf-model/tests/fixtures")
    ap.add_argument("--only", choices=["qwen3"], help="add one model to the existing fixtures")
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    if args.only == "qwen3":
        tok = PreTrainedTokenizerFast.from_pretrained(out / "tokenizer")
        reference = json.loads((out / "reference.json").read_text())
        reference["models"]["tiny-qwen3"] = qwen3_fixture(tok, out)
        reference.setdefault("versions_tiny_qwen3", {
            "torch": torch.__version__, "transformers": transformers.__version__})
        (out / "reference.json").write_text(json.dumps(reference, separators=(",", ":")) + "\n")
        print(f"tiny-qwen3: {dir_size(out / 'tiny-qwen3') / 1024:.0f} KiB")
        return

    tok = build_tokenizer(out / "tokenizer")
    vocab = len(tok)
    eot = tok.convert_tokens_to_ids(EOT)
    im_end = tok.convert_tokens_to_ids(IM_END)
    reference = {
        "generated_by": "scripts/model_fixtures.py",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "seed": SEED,
        "notes": [
            "Batches are left-padded; position_ids = clamp(cumsum(attention_mask) - 1, min=0).",
            "Logits at pad positions (attention_mask == 0) depend on how fully masked rows are "
            "handled and are not meant to be compared; compare positions where the mask is 1.",
            "next_token_logprobs[b][t] = log_softmax(logits[b][t])[input_ids[b][t+1]], shape [B, T-1]; "
            "the _temp_0_7 variant divides logits by 0.7 first. entropy[b][t] is over softmax(logits[b][t]).",
            "greedy_hf_generate: transformers generate(do_sample=False) on the left-padded batch with the "
            "model's generation_config (stops on its eos ids and pads the rest with pad_token_id). "
            "greedy_no_stop: the same greedy decode without stopping; identical up to the first eos.",
            "Reward scores are read at the last non-pad token; rows are given both left- and right-padded "
            "and agree within 1e-4.",
            "Floats are rounded to 7 significant digits.",
        ],
        "tokenizer": tokenizer_reference(tok),
        "models": {},
    }

    # tiny-llama: untied embeddings, default rope; config kept in the rope_parameters form.
    set_seed(SEED)
    cfg = LlamaConfig(**common_cfg(tok, tie_word_embeddings=False), **rope_kwargs(10000.0, None))
    model = LlamaForCausalLM(cfg).float()
    d = out / "tiny-llama"
    save_model(model, tok, d, GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot), chat="file")
    to_new_rope(d / "config.json")
    check_reload(AutoModelForCausalLM, d, model, tok)
    model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
    reference["models"]["tiny-llama"] = {"architecture": "LlamaForCausalLM", "rope_config_form": rope_form(d / "config.json"),
                                         **causal_reference(model, tok, "tiny-llama")}

    # tiny-llama3-rope: llama3 rope scaling, tied embeddings, sharded, legacy config form.
    set_seed(SEED + 1)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    cfg = LlamaConfig(**common_cfg(tok, tie_word_embeddings=True), **rope_kwargs(10000.0, scaling))
    model = LlamaForCausalLM(cfg).float()
    d = out / "tiny-llama3-rope"
    save_model(model, tok, d, GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot),
               chat="file", max_shard_size="150KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    n_shards = len(set(index["weight_map"].values()))
    assert n_shards >= 2, n_shards
    to_legacy_rope(d / "config.json")
    check_reload(AutoModelForCausalLM, d, model, tok)
    model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
    reference["models"]["tiny-llama3-rope"] = {"architecture": "LlamaForCausalLM", "rope_config_form": rope_form(d / "config.json"),
                                               "num_shards": n_shards, **causal_reference(model, tok, "tiny-llama3-rope")}

    # tiny-qwen2: q/k/v biases, tied embeddings, rope_theta 1e6, legacy config form, eos list.
    set_seed(SEED + 2)
    cfg = Qwen2Config(**common_cfg(tok, tie_word_embeddings=True, use_sliding_window=False),
                      **rope_kwargs(1_000_000.0, None))
    model = Qwen2ForCausalLM(cfg).float()
    # HF initialises biases to zero; random biases make the test see whether they are applied.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.1)
    d = out / "tiny-qwen2"
    save_model(model, tok, d, GenerationConfig(bos_token_id=eot, eos_token_id=[eot, im_end], pad_token_id=eot), chat="inline")
    to_legacy_rope(d / "config.json")
    check_reload(AutoModelForCausalLM, d, model, tok)
    model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
    reference["models"]["tiny-qwen2"] = {"architecture": "Qwen2ForCausalLM", "rope_config_form": rope_form(d / "config.json"),
                                         **causal_reference(model, tok, "tiny-qwen2")}

    reference["models"]["tiny-qwen3"] = qwen3_fixture(tok, out)

    # tiny-llama-reward: score head, one label.
    set_seed(SEED + 3)
    cfg = LlamaConfig(**common_cfg(tok, tie_word_embeddings=False, num_labels=1), **rope_kwargs(10000.0, None))
    model = LlamaForSequenceClassification(cfg).float()
    d = out / "tiny-llama-reward"
    save_model(model, tok, d, GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot), chat="none")
    check_reload(AutoModelForSequenceClassification, d, model, tok)
    model = AutoModelForSequenceClassification.from_pretrained(d, attn_implementation="eager")
    reference["reward"] = {"model": "tiny-llama-reward", "architecture": "LlamaForSequenceClassification",
                           "rope_config_form": rope_form(d / "config.json"), **reward_reference(model, tok)}

    forms = {m["rope_config_form"] for m in reference["models"].values()}
    assert {"legacy", "rope_parameters"} <= forms, forms

    (out / "reference.json").write_text(json.dumps(reference, separators=(",", ":")) + "\n")
    for sub in sorted(p for p in out.iterdir() if p.is_dir()):
        print(f"{sub.name}: {dir_size(sub) / 1024:.0f} KiB")
    print(f"reference.json: {(out / 'reference.json').stat().st_size / 1024:.0f} KiB")
    print(f"vocab size {vocab}")


if __name__ == "__main__":
    main()
