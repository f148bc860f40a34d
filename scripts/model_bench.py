#!/usr/bin/env python3
"""PyTorch/transformers baseline for the rlhf-model CPU bench.

Builds a random LlamaForCausalLM from the given sizes and measures, on CPU:
  - batched greedy generation (prompt-len tokens in, exactly new-tokens out) at batch 1 and 16;
  - one training step (forward + backward + AdamW) on a train-batch x train-seq batch.

Prints one JSON line per measurement, the same shapes as
`cargo run --release -p rlhf-model --example model_bench`:
  {"bench":"generate","batch":1,"tokens_per_s":...}
  {"bench":"generate","batch":16,"tokens_per_s":...}
  {"bench":"train_step","seconds":...}
Run through scripts/model_bench.sh, which also runs the Rust side and prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM


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
    return ap.parse_args()


def build(args: argparse.Namespace) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.prompt_len + args.new_tokens, args.train_seq),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).float()


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up: allocator, thread pool, lazy init
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_generate(model, args, batch: int) -> dict:
    model.eval()
    gen = torch.Generator().manual_seed(batch)
    # Ids from 2 up: never the eos id, so nothing stops early (min_new_tokens also forbids it).
    prompt = torch.randint(2, args.vocab, (batch, args.prompt_len), generator=gen)
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

    secs = median_time(run, args.repeats)
    return {"bench": "generate", "batch": batch, "tokens_per_s": batch * args.new_tokens / secs}


def bench_train(model, args) -> dict:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), weight_decay=0.01)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(2, args.vocab, (args.train_batch, args.train_seq), generator=gen)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)

    secs = median_time(step, args.repeats)
    return {"bench": "train_step", "seconds": secs}


def main() -> None:
    args = parse()
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    model = build(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {threads} threads, "
        f"{n_params / 1e6:.1f}M parameters",
        file=sys.stderr,
    )
    for b in (int(x) for x in args.batches.split(",") if x):
        print(json.dumps(bench_generate(model, args, b)), flush=True)
    print(json.dumps(bench_train(model, args)), flush=True)


if __name__ == "__main__":
    main()
