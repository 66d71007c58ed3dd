"""Writes the quickstart task: every "a+b=" with a, b in 0..9, labelled with the last digit of a + b.

    python examples/quickstart/make_prompts.py   # -> examples/quickstart/prompts.jsonl (100 prompts)
"""

import json
from pathlib import Path

out = Path(__file__).with_name("prompts.jsonl")
with out.open("w") as f:
    for a in range(10):
        for b in range(10):
            f.write(json.dumps({"prompt": f"{a}+{b}=", "label": str((a + b) % 10)}) + "\n")
print(f"wrote {out}")
