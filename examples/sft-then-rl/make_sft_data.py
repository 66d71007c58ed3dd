"""Writes the SFT data of the quickstart task: every "a+b=" (a, b in 0..9) with its correct answer, the
last digit of a + b, as prompt/response rows.

    python examples/sft-then-rl/make_sft_data.py   # -> examples/sft-then-rl/sft.jsonl (100 rows)
"""

import json
from pathlib import Path

out = Path(__file__).with_name("sft.jsonl")
with out.open("w") as f:
    for a in range(10):
        for b in range(10):
            f.write(json.dumps({"prompt": f"{a}+{b}=", "response": str((a + b) % 10)}) + "\n")
print(f"wrote {out}")
