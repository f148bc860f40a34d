#!/usr/bin/env python3
"""Reference numbers for DAPO's overlong reward shaping
(crates/rlhf-algo/tests/fixtures/overlong.json), computed by TRL 1.16's own
`trl.rewards.get_soft_overlong_punishment` (Eq. 13 of the DAPO paper) for several limits,
buffer lengths and completion lengths on both sides of the buffer. rlhf-algo's
`overlong_penalty` at `penalty_factor` 1 must give the same values.

Run: python3 -m pip install torch trl==1.16.0; python3 scripts/overlong_reference.py
"""

import json
from pathlib import Path

import trl
from trl.rewards import get_soft_overlong_punishment

OUT = Path(__file__).resolve().parent.parent / "crates/rlhf-algo/tests/fixtures/overlong.json"


def main() -> None:
    cases = []
    for max_len, cache in [(16, 4), (100, 20), (20480, 4096), (7, 1), (10, 9)]:
        lengths = sorted({0, 1, max_len - cache - 1, max_len - cache, max_len - cache + 1,
                          max_len - cache // 2, max_len - 1, max_len} - {-1})
        fn = get_soft_overlong_punishment(max_completion_len=max_len, soft_punish_cache=cache)
        rewards = fn([[1] * n for n in lengths])
        cases.append({"max_len": max_len, "buffer": cache, "lengths": lengths,
                      "rewards": [float(r) for r in rewards]})
    OUT.write_text(json.dumps({"trl_version": trl.__version__, "cases": cases}, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
