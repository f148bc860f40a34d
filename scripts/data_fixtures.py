#!/usr/bin/env python3
"""Write the Parquet fixture that crates/rlhf-config/tests/data.rs reads: a prompt dataset
written by pyarrow, the writer behind HF `datasets.Dataset.to_parquet`, so the Rust reader is
checked against files another implementation made (snappy pages, dictionary encoding, several
row groups, nulls, a verl-style list of {role, content} messages, a reference-answer column).

Writes crates/rlhf-config/tests/fixtures/pyarrow_prompts.parquet and, beside it,
pyarrow_prompts.json: the rows as pyarrow reads them back, for the test to compare with.
Also pyarrow_pairs.parquet: preference pairs in TRL's conversational format (a message-list
prompt, chosen and rejected; a margin column), for crates/rlhf-config/tests/stage_data.rs.
Run: scripts/ref-venv.sh scripts/data_fixtures.py
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUT = Path(__file__).resolve().parent.parent / "crates/rlhf-config/tests/fixtures"

ROWS = [
    {"prompt": "2+3=", "messages": [{"role": "user", "content": "2+3="}], "answer": "5", "id": 0},
    {
        "prompt": "Count to five:",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Count to five:"},
        ],
        "answer": "1 2 3 4 5",
        "id": 1,
    },
    {"prompt": None, "messages": None, "answer": None, "id": 2},
    {"prompt": "Écris un nombre 🙂", "messages": [{"role": "user", "content": "Écris un nombre 🙂"}], "answer": "7", "id": 3},
    {"prompt": "2+3=", "messages": [{"role": "user", "content": "2+3="}], "answer": "5", "id": 4},
]


def turn(role, content):
    return {"role": role, "content": content}


PAIRS = [
    {
        "prompt": [turn("system", "Be brief."), turn("user", "2+3=")],
        "chosen": [turn("assistant", "5")],
        "rejected": [turn("assistant", "six")],
        "margin": 1.5,
    },
    {
        "prompt": [turn("user", "Écris un nombre 🙂")],
        "chosen": [turn("assistant", "7")],
        "rejected": [turn("assistant", "sept")],
        "margin": 0.25,
    },
    # A bad row: chosen and rejected are identical.
    {
        "prompt": [turn("user", "1+1=")],
        "chosen": [turn("assistant", "2")],
        "rejected": [turn("assistant", "2")],
        "margin": 0.0,
    },
]


def write_pairs(msg) -> None:
    schema = pa.schema([("prompt", msg), ("chosen", msg), ("rejected", msg), ("margin", pa.float64())])
    path = OUT / "pyarrow_pairs.parquet"
    pq.write_table(pa.Table.from_pylist(PAIRS, schema=schema), path, row_group_size=2, compression="snappy")
    print(f"wrote {path}")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    msg = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    write_pairs(msg)
    schema = pa.schema([("prompt", pa.string()), ("messages", msg), ("answer", pa.string()), ("id", pa.int64())])
    table = pa.Table.from_pylist(ROWS, schema=schema)
    path = OUT / "pyarrow_prompts.parquet"
    pq.write_table(table, path, row_group_size=2, compression="snappy", use_dictionary=True)
    back = pq.read_table(path).to_pylist()
    meta = pq.ParquetFile(path).metadata
    info = {
        "writer": meta.created_by,
        "row_groups": meta.num_row_groups,
        "rows": back,
    }
    (OUT / "pyarrow_prompts.json").write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {path} ({meta.num_row_groups} row groups, {meta.created_by})")


if __name__ == "__main__":
    main()
