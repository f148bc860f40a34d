#!/usr/bin/env python3
"""Write data/math_tiny.jsonl, the prompts of configs/grpo_math_tiny.yaml: one-digit sums and
differences ("3+4=") with their answers in a ground_truth column, for the built-in `math` rule
reward. Small enough for the tiny CPU model to learn within a short GRPO run; deterministic, so
the committed file is what this script writes. Run: python3 scripts/math_data.py
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "data/math_tiny.jsonl"


def main() -> None:
    rows = []
    for a in range(10):
        for b in range(10):
            if a + b <= 9:
                rows.append({"prompt": f"{a}+{b}=", "ground_truth": str(a + b)})
            if a - b >= 0 and b > 0:
                rows.append({"prompt": f"{a}-{b}=", "ground_truth": str(a - b)})
    random.Random(7).shuffle(rows)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {OUT}")


if __name__ == "__main__":
    main()
