#!/usr/bin/env python3
"""Reference renders of Qwen3's chat template by transformers' own apply_chat_template
(crates/rlhf-tokenizer/tests/fixtures/qwen3_chat_template.json), which
crates/rlhf-tokenizer/tests/chat_template_reference.rs compares byte for byte with our
minijinja renderer.

The tokenizer is the committed tiny BPE (crates/rlhf-tokenizer/tests/fixtures/tokenizer)
with Qwen/Qwen3-0.6B's template (tests/fixtures/qwen3_chat_template.jinja) as its chat
template. Every case goes through PreTrainedTokenizerFast.apply_chat_template(tokenize=False)
with its tools and its extra template variables (`enable_thinking`), so the special tokens,
the sandboxed jinja2 environment, `tojson` and the `tools` / `documents` defaults are all
transformers' own.

The cases cover a single user turn, system + user, with and without the generation prompt,
enable_thinking true / false / absent, an earlier assistant turn whose <think>...</think> the
template strips, a last assistant turn that keeps it, `reasoning_content`, tool calls (object
and string arguments, with and without text, after thinking) and tool responses.

Dict keys of every input are sorted: our renderer holds messages and tools as serde_json
maps, which keep their keys sorted, so a template printing a whole dict (`tool | tojson`)
prints it in sorted order where transformers keeps Python's insertion order. Sorted inputs
make both orders the same (the fixture's notes say so).

Run: python3 scripts/chat_template_reference.py (needs transformers and jinja2; no network).
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import transformers
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "crates/rlhf-tokenizer/tests/fixtures"
TEMPLATE = FIXTURES / "qwen3_chat_template.jinja"
OUT = FIXTURES / "qwen3_chat_template.json"


def msg(role: str, content: str, **extra) -> dict:
    return {"role": role, "content": content, **extra}


def call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city (température in °C or °F)",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]

SYSTEM = msg("system", "You are a careful assistant.")
ASK = msg("user", "What is 2+3?")
THOUGHT = msg("assistant", "<think>\nTwo plus three.\nThat makes five.\n</think>\n\nIt is 5.")
WEATHER = msg("user", "Weather and time in Paris?")

# (name, messages, tools, add_generation_prompt, extra template variables)
CASES = [
    ("single_user_turn", [ASK], None, True, {}),
    ("system_and_user", [SYSTEM, ASK], None, True, {}),
    ("no_generation_prompt", [SYSTEM, ASK, msg("assistant", "It is 5.")], None, False, {}),
    ("thinking_disabled", [ASK], None, True, {"enable_thinking": False}),
    ("thinking_enabled", [SYSTEM, ASK], None, True, {"enable_thinking": True}),
    (
        "enable_thinking_only_changes_the_generation_prompt",
        [ASK, msg("assistant", "It is 5.")],
        None,
        False,
        {"enable_thinking": False},
    ),
    (
        "earlier_thinking_is_stripped",
        [SYSTEM, ASK, THOUGHT, msg("user", "And 4+4?")],
        None,
        True,
        {},
    ),
    (
        "earlier_thinking_is_stripped_with_thinking_disabled",
        [ASK, THOUGHT, msg("user", "And 4+4?"), msg("assistant", "8"), msg("user", "And 1+1?")],
        None,
        True,
        {"enable_thinking": False},
    ),
    ("last_turn_keeps_its_thinking", [ASK, THOUGHT], None, False, {}),
    (
        "last_turn_without_thinking_gets_an_empty_block",
        [ASK, msg("assistant", "It is 5.")],
        None,
        False,
        {},
    ),
    (
        "reasoning_content",
        [ASK, msg("assistant", "It is 5.", reasoning_content="\nTwo plus three is five.\n")],
        None,
        False,
        {},
    ),
    (
        "earlier_reasoning_content_is_dropped",
        [
            ASK,
            msg("assistant", "It is 5.", reasoning_content="Two plus three is five."),
            msg("user", "And 4+4?"),
        ],
        None,
        True,
        {},
    ),
    (
        "tool_call_and_tool_response",
        [
            SYSTEM,
            WEATHER,
            msg("assistant", "", tool_calls=[call("get_weather", {"city": "Paris", "unit": "c"})]),
            msg("tool", '{"temperature": 21, "sky": "clear"}'),
        ],
        TOOLS,
        True,
        {},
    ),
    (
        "tool_calls_with_text_string_arguments_and_two_responses",
        [
            WEATHER,
            msg(
                "assistant",
                "I will look both up.",
                tool_calls=[
                    call("get_weather", {"city": "Paris"}),
                    call("get_time", '{"city": "Paris"}'),
                ],
            ),
            msg("tool", "21 °C, clear"),
            msg("tool", "14:05"),
            msg("assistant", "It is 21 °C and 14:05 in Paris."),
        ],
        TOOLS,
        False,
        {"enable_thinking": False},
    ),
    (
        "tool_call_after_thinking",
        [
            WEATHER,
            msg(
                "assistant",
                "<think>\nI need the weather tool.\n</think>\n\n",
                tool_calls=[call("get_weather", {"city": "Paris"})],
            ),
            msg("tool", "21 °C, clear"),
        ],
        TOOLS,
        True,
        {},
    ),
    ("unicode_text", [msg("user", "Café naïve 🙂 — 日本語?")], None, True, {}),
]


def sorted_keys(v):
    return json.loads(json.dumps(v, sort_keys=True))


def main() -> None:
    template = TEMPLATE.read_text()
    tok = AutoTokenizer.from_pretrained(FIXTURES / "tokenizer")
    cases = []
    for name, messages, tools, agp, extra in CASES:
        messages, tools, extra = sorted_keys(messages), sorted_keys(tools), sorted_keys(extra)
        text = tok.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=agp,
            **extra,
        )
        assert isinstance(text, str), type(text)
        cases.append(
            {
                "name": name,
                "messages": messages,
                "tools": tools,
                "add_generation_prompt": agp,
                "kwargs": extra,
                "text": text,
            }
        )
    out = {
        "notes": (
            "Rendered by scripts/chat_template_reference.py: transformers' "
            "PreTrainedTokenizerFast.apply_chat_template(tokenize=False) of the committed tiny "
            "tokenizer (tests/fixtures/tokenizer) with qwen3_chat_template.jinja as chat_template, "
            "tools=<tools>, add_generation_prompt=<add_generation_prompt> and **<kwargs>. Input "
            "dict keys are sorted (our renderer keeps JSON object keys sorted)."
        ),
        "versions": {"transformers": transformers.__version__, "jinja2": jinja2.__version__},
        "template": TEMPLATE.name,
        "cases": cases,
    }
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
