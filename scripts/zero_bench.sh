#!/usr/bin/env bash
# ZeRO and LoRA bench (training.zero_stage, actor_rollout.lora.rank): SFT on two trainer ranks
# for two models, the tiny one (models/tiny) and a ~57M-parameter Llama made here with random
# weights (hidden 768, 8 layers, the tiny tokenizer), each with the whole AdamW state per rank
# (zero_stage 0), the moments sharded (1), moments and summed gradients sharded (2), the
# parameters sharded too (3: a layer gathered at a time), LoRA rank 8 (stage 0) and LoRA
# rank 8 at stage 3 (the frozen base sharded too). Two micro-batches per step, so gradients
# accumulate. Rounds alternate the
# variants to spread machine noise. Prints per model and variant the median step time, its
# ratio to stage 0, and the peak resident memory of the largest process of the run (a trainer
# rank: the ranks are alike, and the head holds no model), with its ratio to stage 0. Stages 1
# to 3 must log the losses of stage 0 (float rounding apart), and LoRA at stage 3 those of
# LoRA at stage 0.
# Usage: scripts/zero_bench.sh [STEPS] [ROUNDS]   (defaults 6 and 2)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-6}
rounds=${2:-2}
cargo build --release --workspace --bins
# The binaries this build just made, wherever CARGO_TARGET_DIR puts them.
rel="${CARGO_TARGET_DIR:-target}/release"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# The ~57M model: random f32 weights (std 0.02, norms 1), written a tensor at a time.
python3 - "$out/m57" <<'PY'
import array, json, os, random, struct, sys
d = sys.argv[1]
os.makedirs(d)
H, L, I, V = 768, 8, 2048, 384
cfg = json.load(open("models/tiny/config.json"))
cfg.update(hidden_size=H, num_hidden_layers=L, intermediate_size=I, vocab_size=V,
           num_attention_heads=12, num_key_value_heads=12, head_dim=64)
json.dump(cfg, open(f"{d}/config.json", "w"), indent=1)
for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
    open(f"{d}/{f}", "wb").write(open(f"models/tiny/{f}", "rb").read())
t = [("model.embed_tokens.weight", [V, H]), ("lm_head.weight", [V, H]), ("model.norm.weight", [H])]
for l in range(L):
    p = f"model.layers.{l}"
    t += [(f"{p}.input_layernorm.weight", [H]), (f"{p}.post_attention_layernorm.weight", [H])]
    t += [(f"{p}.self_attn.{n}_proj.weight", [H, H]) for n in "qkvo"]
    t += [(f"{p}.mlp.gate_proj.weight", [I, H]), (f"{p}.mlp.up_proj.weight", [I, H]),
          (f"{p}.mlp.down_proj.weight", [H, I])]
header, off = {}, 0
for n, s in t:
    b = 4 * s[0] * (s[1] if len(s) > 1 else 1)
    header[n] = {"dtype": "F32", "shape": s, "data_offsets": [off, off + b]}
    off += b
h = json.dumps(header).encode()
h += b" " * (-len(h) % 8)
rng = random.Random(7)
with open(f"{d}/model.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h)
    for n, s in t:
        k = s[0] * (s[1] if len(s) > 1 else 1)
        if n.endswith("norm.weight"):
            a = array.array("f", [1.0]) * k
        else:
            # Uniform on +-0.0346 has std 0.02.
            raw = array.array("H", rng.randbytes(2 * k))
            a = array.array("f", [(x / 65535.0 - 0.5) * 0.0693 for x in raw])
        f.write(a.tobytes())
print(f"made {d}: {off / 4 / 1e6:.1f}M parameters")
PY

variants=(zero0 zero1 zero2 zero3 lora8 lora8z3)
args_of() {
  case $1 in
    zero0) echo training.zero_stage=0 ;;
    zero1) echo training.zero_stage=1 ;;
    zero2) echo training.zero_stage=2 ;;
    zero3) echo training.zero_stage=3 ;;
    lora8) echo actor_rollout.lora.rank=8 actor_rollout.lora.alpha=16 ;;
    lora8z3) echo actor_rollout.lora.rank=8 actor_rollout.lora.alpha=16 training.zero_stage=3 ;;
  esac
}
for model in tiny m57; do
  path=models/tiny
  [ "$model" = m57 ] && path=$out/m57
  common=(training.train_iters="$steps" logging.progress=false checkpoint.save_steps=0
    resource_pool.actor_rollout=2 actor_rollout.num_gpus_for_train=2
    training.global_batch_size=8 training.micro_batch_size=2 "actor_rollout.model=$path")
  for r in $(seq 1 "$rounds"); do
    for v in "${variants[@]}"; do
      # A fresh Python per run: RUSAGE_CHILDREN's peak then covers this run's processes only.
      # shellcheck disable=SC2046
      python3 -c '
import resource, subprocess, sys
with open(sys.argv[1], "w") as log:
    rc = subprocess.run(sys.argv[3:], stdout=log, stderr=subprocess.STDOUT).returncode
open(sys.argv[2], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(rc)' "$out/run.log" "$out/$model.$v.$r.rss" \
        "$rel"/rlhf-head run --config-name sft_tiny "${common[@]}" $(args_of "$v") \
        "checkpoint.dir=$out/ckpt" "logging.metrics_file=$out/$model.$v.$r.jsonl" \
        "logging.samples_file=$out/samples.jsonl" || { cat "$out/run.log"; exit 1; }
    done
  done
done
python3 - "$out" "$rounds" "${variants[@]}" <<'PY'
import json, statistics as st, sys
out, rounds, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for model in ["tiny", "m57"]:
    runs = {v: [[json.loads(l) for l in open(f"{out}/{model}.{v}.{i}.jsonl")]
                for i in range(1, rounds + 1)] for v in variants}
    for base, v in [("zero0", "zero1"), ("zero0", "zero2"), ("zero0", "zero3"),
                    ("lora8", "lora8z3")]:
        for a, b in zip(runs[base], runs[v]):
            for x, y in zip(a, b):
                u, w = x["train/loss"], y["train/loss"]
                assert abs(u - w) <= 1e-4 * (1 + abs(u)), f"{model} {v}: loss {w} vs {u}"
    # The first step warms caches.
    step = {v: st.median(x["timing_s/step"] for r in runs[v] for x in r[1:]) for v in variants}
    rss = {v: max(int(open(f"{out}/{model}.{v}.{i}.rss").read())
                  for i in range(1, rounds + 1)) / 1024 for v in variants}
    print(f"{model}: 2 trainer ranks, 8 rows per step in 2 micro-batches per rank")
    for v in variants:
        print(f"  {v:7s} median step {step[v]:8.4f} s ({step[v] / step['zero0']:.3f}x)   "
              f"peak RSS per rank {rss[v]:7.0f} MiB ({rss[v] / rss['zero0']:.3f}x)")
print("stages 1 to 3 logged the losses of stage 0 at every step, LoRA at stage 3 those of "
      "LoRA at stage 0")
PY
