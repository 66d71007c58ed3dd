"""The pieces together: a jsonl dataset -> DataBuffer -> a generator stand-in -> RewardRunner -> dynamic
sampling with nonzero_std -> a full batch, and the buffer state a checkpoint would save."""

import json

from posttrain.core.buffer import DataBuffer, collect_groups
from posttrain.core.config import load_config
from posttrain.core.data import load_prompts
from posttrain.core.plugins import load_plugins
from posttrain.core.rewards import RewardRunner, reward_metrics
from posttrain.core.types import SampleStatus


async def test_dataset_to_rewarded_filtered_batch(tmp_path):
    rows = [{"question": f"{i} + {i} = ?", "answer": str(2 * i)} for i in range(12)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plugins = load_plugins()
    cfg = load_config(None, plugins=plugins, data={
        "seed": 1, "estimator": "grpo",
        "data": {"path": str(path), "input_key": "question", "label_key": "answer", "over_sampling_batch_size": 4},
        "rollout": {"rollout_batch_size": 3, "n_samples_per_prompt": 4}, "trainer": {"global_batch_size": 12, "micro_batch_size": 4},
        "rewards": [{"name": "math", "weight": 1.0}, {"name": "length", "weight": 1.0, "per_token": 0.01}],
        "filters": ["nonzero_std"], "reward_runner": {"concurrency": 8}})
    dataset = load_prompts(cfg.data)
    buffer = DataBuffer.from_config(cfg, dataset)
    runner = RewardRunner.from_config(cfg, plugins)
    filters = [c.create(plugins) for c in cfg.filters]

    async def rollout(group):  # a generator stand-in: prompts with an even first number get mixed answers
        first = int(group[0].prompt.split()[0])
        for j, s in enumerate(group):
            right = j % 2 == 0 if first % 2 == 0 else True
            s.response = f"\\boxed{{{int(s.label) + (0 if right else 1)}}}"
            s.response_length, s.status = len(s.response), SampleStatus.COMPLETED
        await runner.score_groups([group])
        return group

    batch, metrics = await collect_groups(buffer, rollout, cfg.rollout.rollout_batch_size, filters,
                                          cfg.data.over_sampling_batch_size, cfg.data.max_sampled_groups)
    await runner.aclose()
    assert len(batch) == 3 and all(len(g) == 4 for g in batch)
    assert all(int(g[0].prompt.split()[0]) % 2 == 0 for g in batch)  # all-correct groups were dropped
    assert metrics["dynamic_sampling/drop/nonzero_std/all_correct"] >= 1
    for g in batch:
        assert [s.reward_parts["math"] for s in g] == [1.0, 0.0, 1.0, 0.0]
        assert g[0].reward == 1.0 - 0.01 * g[0].response_length
    summary = reward_metrics(batch)
    assert summary["reward/math"] == 0.5 and summary["reward/failed"] == 0.0
    state = json.loads(json.dumps(buffer.state_dict()))
    assert state["epoch"] == 0 and state["offset"] + len(state["returned"]) <= 12
