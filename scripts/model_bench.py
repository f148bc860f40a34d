#!/usr/bin/env python3
"""PyTorch/transformers baseline for the rlhf-model bench (CPU by default, or a GPU).

Builds a random LlamaForCausalLM or Qwen2ForCausalLM from the given sizes and measures:
  - batched greedy generation (prompt-len tokens in, exactly new-tokens out) at each batch size;
  - forward log-probs without gradients of a train-batch x train-seq batch (tokens/s);
  - one training step (forward + backward + AdamW) on a train-batch x train-seq batch.

Prints one JSON line per measurement, the same shapes as
`cargo run --release -p rlhf-model --example model_bench` (which takes the same flags):
  {"bench":"generate","batch":1,"tokens_per_s":...}
  {"bench":"generate","batch":16,"tokens_per_s":...}
  {"bench":"log_probs","tokens_per_s":...}
  {"bench":"train_step","seconds":...,"tokens_per_s":...}
Run through scripts/model_bench.sh, which also runs the Rust side and prints the ratios.

--device cpu|cuda:N picks the device (GPU timings are taken between torch.cuda.synchronize()
calls). --dtype bf16 generates and computes log-probs with a bf16 model and trains f32
weights under bf16 autocast (what the Rust side's mixed precision does). --family qwen2 uses
Qwen2 (q/k/v biases, its defaults); --tie ties the input and output embeddings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-seq", type=int, default=128)
    ap.add_argument("--batches", type=str, default="1,16", help="generation batch sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="timed repetitions; the median is reported")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = every core)")
    ap.add_argument("--device", type=str, default="cpu", help="cpu or cuda:N")
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32",
                    help="bf16: bf16 model for generation and log-probs, bf16 autocast over f32 weights for training")
    ap.add_argument("--family", choices=("llama", "qwen2"), default="llama")
    ap.add_argument("--tie", action="store_true", help="tied input/output embeddings")
    args = ap.parse_args()
    if args.device != "cpu" and not (args.device == "cuda" or args.device.startswith("cuda:")):
        ap.error(f"--device expects cpu or cuda:N, got {args.device!r}")
    if args.vocab < 3:
        ap.error("--vocab must be at least 3 (ids 0 and 1 are pad and eos)")
    if args.train_seq < 2:
        ap.error("--train-seq must be at least 2 (log-probs score tokens 1..T)")
    return args


def build(args: argparse.Namespace):
    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.prompt_len + args.new_tokens, args.train_seq),
        tie_word_embeddings=args.tie,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    if args.family == "qwen2":
        # Qwen2's defaults: q/k/v biases, rms_norm_eps 1e-6, no sliding window.
        cfg = Qwen2Config(rms_norm_eps=1e-6, use_sliding_window=False, **common)
        return Qwen2ForCausalLM(cfg).float()
    cfg = LlamaConfig(rms_norm_eps=1e-5, **common)
    return LlamaForCausalLM(cfg).float()


def synchronizer(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def median_time(fn, repeats: int, sync) -> float:
    fn()  # warm-up: allocator, thread pool, lazy init, kernel selection
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_generate(model, args, batch: int, device: torch.device, sync) -> dict:
    model.eval()
    gen = torch.Generator().manual_seed(batch)
    # Ids from 2 up: never the eos id, so nothing stops early (min_new_tokens also forbids it).
    prompt = torch.randint(2, args.vocab, (batch, args.prompt_len), generator=gen).to(device)
    mask = torch.ones_like(prompt)
    gcfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        eos_token_id=1,
        pad_token_id=0,
    )

    def run():
        with torch.inference_mode():
            out = model.generate(input_ids=prompt, attention_mask=mask, generation_config=gcfg)
        assert out.shape == (batch, args.prompt_len + args.new_tokens), out.shape

    secs = median_time(run, args.repeats, sync)
    return {"bench": "generate", "batch": batch, "tokens_per_s": batch * args.new_tokens / secs}


def bench_log_probs(model, args, device: torch.device, sync) -> dict:
    """Log-probs of tokens 1..T given their prefixes, no gradients (reference / old-policy
    log-probs in PPO): full-vocabulary log-softmax in f32, gathered at the next tokens."""
    model.eval()
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(2, args.vocab, (args.train_batch, args.train_seq), generator=gen).to(device)
    mask = torch.ones_like(ids)

    def run():
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            total = lp.sum().item()  # a read back to the host: also waits for the GPU
        assert math.isfinite(total), total

    secs = median_time(run, args.repeats, sync)
    return {"bench": "log_probs", "tokens_per_s": args.train_batch * args.train_seq / secs}


def bench_train(model, args, device: torch.device, sync) -> dict:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), weight_decay=0.01)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(2, args.vocab, (args.train_batch, args.train_seq), generator=gen).to(device)

    def autocast():
        if args.dtype == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return nullcontext()

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)

    secs = median_time(step, args.repeats, sync)
    return {"bench": "train_step", "seconds": secs, "tokens_per_s": args.train_batch * args.train_seq / secs}


def main() -> None:
    args = parse()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit(f"error: --device {args.device}: torch {torch.__version__} sees no CUDA GPU")
        if device.index is not None:
            torch.cuda.set_device(device)
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    sync = synchronizer(device)

    # Generation and log-probs: the frozen model, in bf16 under --dtype bf16.
    gen_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = build(args).to(device=device, dtype=gen_dtype)
    n_params = sum(p.numel() for p in model.parameters())
    where = f"{threads} threads" if device.type == "cpu" else f"{args.device} ({torch.cuda.get_device_name(device)})"
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {where}, {args.dtype}, "
        f"{args.family} {'tied' if args.tie else 'untied'}, {n_params / 1e6:.1f}M parameters",
        file=sys.stderr,
    )
    for b in (int(x) for x in args.batches.split(",") if x):
        print(json.dumps(bench_generate(model, args, b, device, sync)), flush=True)
    print(json.dumps(bench_log_probs(model, args, device, sync)), flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # Training: f32 weights (and AdamW state), bf16 autocast under --dtype bf16.
    model = build(args).to(device)
    print(json.dumps(bench_train(model, args, device, sync)), flush=True)


if __name__ == "__main__":
    main()
