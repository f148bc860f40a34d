#!/usr/bin/env python3
"""Write the shipped tiny data of the pipeline (data/pipeline/): SFT examples and preference
pairs (with a held-out quarter, pairs_eval.jsonl) over the demo prompts (data/prompts_tiny.jsonl), with a synthetic preference the tiny
model can learn: answers in digits are preferred over the same answers spelled out (what the
PPO demo's contains_digit rule rewards, so a reward model trained on the pairs can stand in
for the rule). Each prompt gives two pairs: the bare answers, and the answers in a sentence of
the kind the tiny policy writes ("It is 12." against "It is twelve."). A reward model reads a
sequence at its last token before the EOS (transformers' rule when the pad token is the EOS,
as in models/tiny), which in the policy's answers is mostly punctuation: the sentence pairs
teach it to judge the answer from there.

Run: python3 scripts/pipeline_data.py (standard library only; the output is committed).
"""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "data/pipeline"

ANSWERS = {
    "Count to five:": "1 2 3 4 5",
    "Write a number:": "7",
    "What is two plus two?": "4",
    "How many legs does a cat have?": "4",
    "Name a number between 1 and 10:": "6",
    "The year after 1999 is": "2000",
    "Write your favourite number:": "3",
    "How many days are in a week?": "7",
    "How many months are in a year?": "12",
    "Count down from three:": "3 2 1",
    "What comes after 8?": "9",
    "What comes before 4?": "3",
    "Double 6 is": "12",
    "Half of 10 is": "5",
    "How many fingers are on one hand?": "5",
    "Write the number ten in digits:": "10",
    "Give me a phone extension:": "42",
    "How many wheels does a bicycle have?": "2",
    "Pick a lucky number:": "7",
    "How many hours are in a day?": "24",
    "The number of sides of a triangle is": "3",
    "Write a large number:": "1000",
    "Count to three:": "1 2 3",
    "How old is a newborn baby in years?": "0",
    "List three numbers:": "4 8 15",
    "What is 100 minus 1?": "99",
    "How many minutes are in an hour?": "60",
    "A dozen is how many?": "12",
    "Write today's date in numbers:": "25 11",
    "How many seasons are in a year?": "4",
    "The first prime number is": "2",
    "How many continents are there?": "7",
    "Write an even number:": "8",
    "Write an odd number:": "9",
    "What is 3 squared?": "9",
    "Count to ten:": "1 2 3 4 5 6 7 8 9 10",
    "How many corners does a square have?": "4",
    "Add one to 41:": "42",
    "How many letters are in 'cat'?": "3",
}

# Sentences around an answer, in the style of the tiny policy's own answers.
SENTENCES = [" It is {}.", " {}!", " The answer is {}.", " That makes {}.", " It is {}!"]

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def words(n: int) -> str:
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    if n < 1000:
        rest = n % 100
        return ONES[n // 100] + " hundred" + ("" if rest == 0 else " and " + words(rest))
    if n == 1000:
        return "one thousand"
    if n == 2000:
        return "two thousand"
    raise ValueError(n)


def answer(prompt: str) -> str:
    if re.fullmatch(r"[\d+\-*]+=", prompt):
        return str(eval(prompt[:-1]))  # the demo's own arithmetic prompts
    return ANSWERS[prompt]


def main() -> None:
    prompts = [json.loads(line)["prompt"] for line in (ROOT / "data/prompts_tiny.jsonl").read_text().splitlines() if line.strip()]
    OUT.mkdir(parents=True, exist_ok=True)
    sft, pairs, held_out = [], [], []
    for i, p in enumerate(prompts):
        a = answer(p)
        spelled = " ".join(words(int(x)) for x in a.split())
        sft.append({"prompt": p, "completion": a})
        # Every fourth prompt is held out of the pairs: the eval split.
        split = held_out if i % 4 == 3 else pairs
        split.append({"prompt": p, "chosen": a, "rejected": spelled})
        frame = SENTENCES[i % len(SENTENCES)]
        split.append({"prompt": p, "chosen": frame.format(a), "rejected": frame.format(spelled)})
    for name, rows in [("sft.jsonl", sft), ("pairs.jsonl", pairs), ("pairs_eval.jsonl", held_out)]:
        (OUT / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {OUT / name} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
