"""Eval during training: each ``eval.datasets`` entry is generated with its own sampling and scored with
the run's rewards; logged as ``eval/<name>/reward_mean`` (and the other reward parts), and
``eval/<name>/weight_version``: the oldest weight version among the eval's tokens."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

from posttrain.core.config import DataConfig
from posttrain.core.data import load_prompts
from posttrain.core.rewards import reward_metrics
from posttrain.core.types import Sample


async def evaluate(cfg: Any, engine: Any, generator: Any, rewards: Any, base_dir: Path,
                   tokenizer: Any = None) -> dict[str, float]:
    """``eval/<name>/...`` metrics of every eval set; ``tokenizer`` renders chat templates
    (``apply_chat_template: true``)."""
    out: dict[str, float] = {}
    for ds in cfg.eval.datasets:
        data = DataConfig(path=ds.path, input_key=ds.input_key, label_key=ds.label_key,
                          metadata_key=ds.metadata_key, apply_chat_template=ds.apply_chat_template, shuffle=False,
                          system_prompt=cfg.data.system_prompt if ds.system_prompt is None else ds.system_prompt)
        rows = load_prompts(data, tokenizer=tokenizer, base_dir=base_dir).rows[: ds.limit]
        sampling = dataclasses.replace(cfg.rollout.sampling_params(seed=cfg.seed), temperature=ds.temperature,
                                       top_p=ds.top_p, max_new_tokens=ds.max_new_tokens or cfg.rollout.max_new_tokens)
        groups = [[Sample(prompt=r.prompt, label=r.label, metadata=dict(r.metadata), group_index=g, index=i)
                   for i in range(ds.n_samples_per_prompt)] for g, r in enumerate(rows)]
        groups = list(await asyncio.gather(*[generator(g, engine, sampling) for g in groups]))
        await rewards.score_groups(groups)
        for key, value in reward_metrics(groups).items():
            out[f"eval/{ds.name}/{key.removeprefix('reward/')}"] = value
        out[f"eval/{ds.name}/reward_mean"] = out.get(f"eval/{ds.name}/total", 0.0)
        # the oldest weights any eval token came from (fully_async runs eval right after a push)
        out[f"eval/{ds.name}/weight_version"] = float(min((s.oldest_version for g in groups for s in g), default=0))
    return out
