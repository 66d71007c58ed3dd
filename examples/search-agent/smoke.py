"""Run the search agent end to end on CPU: a tiny random Qwen3, the local engine, the agent, the reward.

    python examples/search-agent/smoke.py --smoke      # prints one JSON line; exit 0 when it all ran

A random model will not learn to search in a smoke run; this checks that the pieces fit: the plugin
file loads, the engine serves, the agent rolls out (loss mask 1 exactly on model tokens), rewards come back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


async def rollout(url: str, api_key: str, plugins, data: list[dict], max_new_tokens: int) -> list:
    from posttrain.core.rollout.client import EngineClient
    from posttrain.core.types import Sample, SamplingParams

    generator = plugins.generators["search_agent"]()
    reward = plugins.rewards["search_answer"]()
    group = [Sample(prompt=row["prompt"], label=row["label"], group_index=i) for i, row in enumerate(data)]
    async with EngineClient(url, api_key=api_key) as engine:
        samples = await generator(group, engine, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens))
    for s in samples:
        s.reward = reward(s)["score"]
    return samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny random model on CPU (the only mode for now)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()
    if not args.smoke:
        ap.error("only --smoke is supported here; use `rl-cli run config.yaml --plugin search_agent.py` to train")
    from posttrain.core.plugins import load_plugins
    from posttrain.testing.engine import start_local_engine
    from posttrain.testing.tiny import make_tiny_checkpoint

    plugins = load_plugins(plugin_files=[str(HERE / "search_agent.py")])
    data = [json.loads(line) for line in (HERE / "data.jsonl").read_text().splitlines() if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "qwen3")
        server = start_local_engine(ckpt, context_length=512)
        try:
            samples = asyncio.run(rollout(server.base_url, server.api_key, plugins, data, args.max_new_tokens))
        finally:
            server.stop()
    ok = all(len(s.loss_mask) == s.response_length > 0 for s in samples)
    print(json.dumps({"example": "search-agent", "samples": len(samples), "ok": ok,
                      "mean_reward": sum(s.reward for s in samples) / len(samples),
                      "statuses": sorted({s.status.value for s in samples})}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
