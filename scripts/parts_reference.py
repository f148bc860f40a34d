#!/usr/bin/env python3
"""The ops of one training step timed alone in PyTorch, as `model_bench --parts` does for
rlhf-model: forward and forward + backward of each op of a decoder layer and of the LM head,
at a model's shape, bf16 autocast over f32 weights (what the Rust side's mixed precision
does). Why: a whole step says how far apart the two are, this says where.

    python3 scripts/parts_reference.py --device cuda:0 --hidden 896 --heads 14 --kv-heads 2 \
        --intermediate 4864 --vocab 151936 --train-batch 8 --train-seq 512

Prints one JSON line per op with the same names as `model_bench --parts`.
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in [("--hidden", 896), ("--heads", 14), ("--kv-heads", 2),
                          ("--intermediate", 4864), ("--vocab", 151936),
                          ("--train-batch", 8), ("--train-seq", 512), ("--repeats", 5)]:
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--device", default="cuda:0")
    return ap.parse_args()


def median_ms(fn, repeats, sync):
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def main():
    a = parse()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    b, t, h, i, v = a.train_batch, a.train_seq, a.hidden, a.intermediate, a.vocab
    nh, nkv = a.heads, a.kv_heads
    d = h // nh
    rows = b * t
    bf = torch.bfloat16

    def act(*shape):
        return (torch.randn(*shape, device=dev) * 0.02).to(bf).requires_grad_(True)

    def weight(*shape):
        return (torch.randn(*shape, device=dev) * 0.02).requires_grad_(True)

    def part(name, fwd):
        def f_only():
            with torch.autocast(dev.type, dtype=bf):
                fwd()

        def f_and_b():
            with torch.autocast(dev.type, dtype=bf):
                y = fwd()
            y.float().sum().backward()

        out = {"bench": "part_torch", "name": name,
               "forward_ms": round(median_ms(f_only, a.repeats, sync), 3),
               "forward_backward_ms": round(median_ms(f_and_b, a.repeats, sync), 3)}
        print(json.dumps(out), flush=True)

    x, xi, up = act(b, t, h), act(b, t, i), act(b, t, i)
    w_up, w_down, w_norm = weight(i, h), weight(h, i), weight(h)
    xd, wd = x.detach().reshape(rows, h), w_up.detach().to(bf)
    ms = median_ms(lambda: xd @ wd.t(), a.repeats, sync)
    print(json.dumps({"bench": "part_torch", "name": f"matmul [{rows}, {h}] x [{h}, {i}] (no graph)",
                      "forward_ms": round(ms, 3), "forward_backward_ms": None}))
    part(f"linear {h} -> {i}", lambda: F.linear(x, w_up))
    part(f"linear {i} -> {h}", lambda: F.linear(xi, w_down))

    def rms_norm():
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(bf) * w_norm.to(bf)

    w_gate = weight(i, h)
    part(f"gate + up {h} -> {i} with SwiGLU", lambda: F.silu(F.linear(x, w_gate)) * F.linear(x, w_up))
    part("rms_norm", rms_norm)
    part("swiglu", lambda: F.silu(xi) * up)
    q = act(b, nh, t, d)
    cos, sin = torch.randn(b, 1, t, d, device=dev).to(bf), torch.randn(b, 1, t, d, device=dev).to(bf)

    def rope():
        q1, q2 = q[..., : d // 2], q[..., d // 2:]
        return q * cos + torch.cat((-q2, q1), dim=-1) * sin

    part("rope (queries)", rope)
    k, vv = act(b, nkv, t, d), act(b, nkv, t, d)
    part("attention core",
         lambda: F.scaled_dot_product_attention(q, k, vv, is_causal=True, enable_gqa=True))
    qp, kp, vp = act(b, t, nh * d), act(b, t, nkv * d), act(b, t, nkv * d)

    def rot(z):
        z1, z2 = z[..., : d // 2], z[..., d // 2:]
        return z * cos + torch.cat((-z2, z1), dim=-1) * sin

    def block():
        qh = rot(qp.reshape(b, t, nh, d).transpose(1, 2))
        kh = rot(kp.reshape(b, t, nkv, d).transpose(1, 2))
        vh = vp.reshape(b, t, nkv, d).transpose(1, 2)
        y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        return y.transpose(1, 2).reshape(b, t, nh * d)

    part("attention block (RoPE, heads, core)", block)
    part("residual add", lambda: x + x)
    part("heads reshape + transpose", lambda: x.reshape(b, t, nh, d).transpose(1, 2).contiguous())
    w_head = weight(v, h)
    targets = (torch.arange(rows, device=dev) * 7919 % v).reshape(b, t)

    def head():
        logits = F.linear(x, w_head)
        return torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    part(f"lm head {h} -> {v} + log-probs", head)
    logits = act(b, t, v)
    part("log-probs kernel alone",
         lambda: torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    part("embedding lookup", lambda: F.embedding(targets.flatten(), w_head).sum(-1, keepdim=True))


if __name__ == "__main__":
    main()
