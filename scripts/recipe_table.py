"""README's table of the committed recipe plans: per recipe and device count, the recommended mode and its predicted
ratio to sync, and in parentheses a faster mode the run leaves out and why (refused as configured, or does not fit).

  python scripts/recipe_table.py    (after bash recipes/make_plans.sh; prints the markdown rows)
"""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ("qwen2_5_1_5b_gsm8k", "qwen2_5_1_5b_gsm8k_ppo", "qwen2_5_7b_gsm8k", "qwen2_5_7b_math", "qwen3_4b_dapo_math",
           "qwen3_8b_dapo_math")
LABEL = {"qwen2_5_1_5b_gsm8k_ppo": "qwen2_5_1_5b_gsm8k_ppo (gae, n=1)"}
COLUMNS = (("npu", 8), ("npu", 16), ("cuda", 8), ("cuda", 16))
LINE = re.compile(r"^\s*\d+ devices: (\w+) \([^)]*\) predicted ([\d.]+x) sync's tokens/s; (.*)$")


def cell(plan: str) -> str:
    for line in open(plan).read().splitlines():
        m = LINE.match(line)
        if not m:
            continue
        mode, ratio, rest = m.groups()
        text = f"{mode} {ratio}"
        faster = re.search(r"(\w+) would be faster but (the run refuses it|does not fit)", rest)
        if faster:
            other = faster.group(1)
            rate = re.search(rf"\b{other}(?: \d+\+\d+)? ([\d.]+x)", rest)
            why = "refused" if faster.group(2).startswith("the run") else "does not fit"
            text += f" ({other} {rate.group(1) if rate else '?'} {why})"
        return text
    return "no recommendation"


def main() -> None:
    print("| recipe (async.sh) | " + " | ".join(f"{d} {n}" for d, n in COLUMNS) + " |")
    print("| --- |" + " ---: |" * len(COLUMNS))
    for name in RECIPES:
        cells = [cell(os.path.join(ROOT, "recipes", name, f"plan_{d}_{n}.txt")) for d, n in COLUMNS]
        print(f"| {LABEL.get(name, name)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
