#!/usr/bin/env python3
"""Build the LoRA reference fixtures for crates/rlhf-model tests, with the real `peft`.

Writes, under crates/rlhf-model/tests/fixtures/lora/ (or --out):
  tiny-llama-adapter/         PEFT LoRA adapter (CAUSAL_LM) on ../tiny-llama: r=4, alpha=8,
                              every linear layer of the decoder, random A and B
  tiny-qwen2-adapter/         the same on ../tiny-qwen2 (q/k/v biases, tied embeddings),
                              r=2, alpha=6, use_rslora (scale alpha/sqrt(r)), q/k/v/o only
  tiny-llama-critic-adapter/  PEFT LoRA adapter (TOKEN_CLS) on tiny-llama as
                              LlamaForTokenClassification (num_labels=1): q/v adapters plus the
                              `score` head in modules_to_save (PEFT saves it as
                              base_model.model.score.{weight,bias})
  reference.safetensors       on reference.json's left-padded batch of each base model:
                              `<name>.logits` with the adapter, `<name>.base_logits` with it
                              disabled, `<name>.merged_logits` after merge_and_unload(), and
                              `critic.values` ([B, T] token values of the critic adapter)
  reference.json              what was computed with which versions

Why: our adapters must be what `peft` writes and reads (key names, adapter_config.json), and
our LoRA forward and merge must give PEFT's numbers. Seeded; the same library versions
rewrite the same files. Needs torch, transformers and peft (no network: the bases are the
committed fixtures).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

SEED = 4321
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def randomize_lora(model: torch.nn.Module, gen: torch.Generator) -> None:
    """PEFT starts B at zero (the adapter is a no-op); the fixtures need both factors random."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def adapter(model, cfg: LoraConfig, gen, where: Path, base: str):
    """`model` with random adapters of `cfg`, saved by peft to `where` (the base named
    relative to the fixture, the targets sorted, peft's README left out); in eval mode."""
    model.eval()
    pm = get_peft_model(model, cfg)
    randomize_lora(pm, gen)
    pm.eval()
    pm.save_pretrained(where)
    acfg = json.loads((where / "adapter_config.json").read_text())
    acfg["base_model_name_or_path"] = f"../../{base}"
    # peft writes a set: sorted, so reruns write the same file.
    acfg["target_modules"] = sorted(acfg["target_modules"])
    (where / "adapter_config.json").write_text(json.dumps(acfg, indent=2, sort_keys=True) + "\n")
    readme = where / "README.md"
    if readme.exists():
        readme.unlink()
    return pm


def batch(reference: dict, base: str):
    m = reference["models"][base]
    ids = torch.tensor(m["input_ids"], dtype=torch.long)
    mask = torch.tensor(m["attention_mask"], dtype=torch.long)
    pos = torch.tensor(m["position_ids"], dtype=torch.long)
    return ids, mask, pos


def lm_case(fixtures: Path, out: Path, reference: dict, base: str, cfg: LoraConfig, gen, tensors: dict) -> dict:
    model = AutoModelForCausalLM.from_pretrained(fixtures / base, dtype=torch.float32)
    name = f"{base}-adapter"
    pm = adapter(model, cfg, gen, out / name, base)
    ids, mask, pos = batch(reference, base)
    with torch.no_grad():
        tensors[f"{base}.logits"] = pm(input_ids=ids, attention_mask=mask, position_ids=pos).logits.contiguous()
        with pm.disable_adapter():
            tensors[f"{base}.base_logits"] = pm(input_ids=ids, attention_mask=mask, position_ids=pos).logits.contiguous()
        merged = pm.merge_and_unload()
        tensors[f"{base}.merged_logits"] = merged(input_ids=ids, attention_mask=mask, position_ids=pos).logits.contiguous()
    return {"adapter": name, "base": base, "r": cfg.r, "lora_alpha": cfg.lora_alpha,
            "use_rslora": cfg.use_rslora, "target_modules": sorted(cfg.target_modules)}


def critic_case(fixtures: Path, out: Path, reference: dict, gen, tensors: dict) -> dict:
    base = "tiny-llama"
    model = AutoModelForTokenClassification.from_pretrained(fixtures / base, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=gen) * 0.1)
        model.score.bias.copy_(torch.randn(model.score.bias.shape, generator=gen) * 0.1)
    cfg = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="TOKEN_CLS")
    name = "tiny-llama-critic-adapter"
    pm = adapter(model, cfg, gen, out / name, base)
    ids, mask, pos = batch(reference, base)
    with torch.no_grad():
        values = pm(input_ids=ids, attention_mask=mask, position_ids=pos).logits.squeeze(-1)
    tensors["critic.values"] = values.contiguous()
    return {"adapter": name, "base": base, "task_type": "TOKEN_CLS", "r": 4, "lora_alpha": 16,
            "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["score"]}


def main() -> None:
    here = Path(__file__).resolve().parent.parent
    fixtures_default = here / "crates" / "rlhf-model" / "tests" / "fixtures"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=fixtures_default, help="the committed base fixtures")
    ap.add_argument("--out", type=Path, default=fixtures_default / "lora")
    args = ap.parse_args()
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    reference = json.loads((args.fixtures / "reference.json").read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    cases = [
        lm_case(args.fixtures, args.out, reference, "tiny-llama",
                LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR, task_type="CAUSAL_LM"), gen, tensors),
        lm_case(args.fixtures, args.out, reference, "tiny-qwen2",
                LoraConfig(r=2, lora_alpha=6, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                           task_type="CAUSAL_LM"), gen, tensors),
        critic_case(args.fixtures, args.out, reference, gen, tensors),
    ]
    save_file({k: v.float() for k, v in tensors.items()}, str(args.out / "reference.safetensors"), metadata={"format": "pt"})
    meta = {
        "generated_by": "scripts/lora_fixtures.py",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        "seed": SEED,
        "cases": cases,
        "notes": "Batches are reference.json's left-padded ones for each base model (position ids "
                 "passed explicitly). Logits at pad positions are not meant to be compared. "
                 "critic.values = the TOKEN_CLS model's logits squeezed to [B, T].",
    }
    (args.out / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {args.out}: {', '.join(c['adapter'] for c in cases)}, reference.safetensors")


if __name__ == "__main__":
    main()
