"""``mode: sft`` end to end through ``rl-cli run``: no engine starts, the tiny random model learns the
quickstart task from labelled answers (greedy accuracy through the local engine), eval loss, HF export,
and a resumed run that repeats the uninterrupted one."""

import asyncio
import json

import pytest

from tests.conftest import ROOT
from tests.integration.test_loop import jsonl, rl_cli

pytestmark = pytest.mark.slow
SFT = ROOT / "examples" / "sft-then-rl" / "sft.yaml"
# the whole task per step, warm-up then cosine decay: 80 steps reach it from random init
LEARN = ["trainer.global_batch_size=100", "trainer.micro_batch_size=100", "trainer.lr=2e-2",
         "trainer.lr_warmup_steps=10", "trainer.lr_decay_style=cosine", "trainer.lr_decay_steps=80"]


async def _greedy_accuracy(url: str, tokenizer, api_key: str | None = None) -> float:
    from posttrain.core.rollout.client import EngineClient

    rows = [json.loads(line) for line in (ROOT / "examples" / "quickstart" / "prompts.jsonl").read_text().splitlines()]
    async with EngineClient(url, api_key=api_key) as engine:
        outs = await asyncio.gather(*[engine.generate(input_ids=tokenizer.encode(r["prompt"], add_special_tokens=False),
                                                      sampling_params={"temperature": 0.0, "max_new_tokens": 1})
                                      for r in rows])
    return sum(o["text"] == r["label"] for o, r in zip(outs, rows)) / len(rows)


def test_sft_learns_the_quickstart_task_without_engines(tmp_path):
    from transformers import AutoTokenizer

    from posttrain.testing.engine import start_local_engine

    run = tmp_path / "sft"
    out = rl_cli(SFT, "--run-dir", run, *LEARN, "data.epochs=80", "checkpoint.interval=40", "eval.interval=40",
                 f"eval.datasets=[{{name: train, path: {ROOT / 'examples' / 'sft-then-rl' / 'sft.jsonl'}}}]")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 81))
    assert not list((run / "logs").glob("engine-*")) and not (run / "logs" / "router.log").exists()
    assert rows[0]["train/loss"] > 3.0 and rows[-1]["train/loss"] < 0.2  # from ~ln(128) to the labels
    assert rows[39]["eval/train/loss"] > rows[79]["eval/train/loss"]
    assert [p.name for p in (run / "checkpoints").glob("step_*")] and (run / "hf-final" / "config.json").exists()
    server = start_local_engine(run / "hf-final", tmp_path)
    try:
        accuracy = asyncio.run(_greedy_accuracy(server.base_url, AutoTokenizer.from_pretrained(run / "hf-final"),
                                                server.api_key))
    finally:
        server.stop()
    assert accuracy >= 0.95


def test_resumed_sft_repeats_the_uninterrupted_run(tmp_path):
    args = [SFT, "trainer.global_batch_size=40", "trainer.micro_batch_size=40", "checkpoint.interval=2"]
    whole = tmp_path / "whole"
    assert rl_cli(*args, "mode.max_steps=5", "--run-dir", whole).returncode == 0
    part = tmp_path / "part"
    assert rl_cli(*args, "mode.max_steps=3", "--run-dir", part).returncode == 0  # checkpoints after steps 2, 3
    (part / "checkpoints" / "latest").write_text("step_000002")  # as if killed during step 3
    out = rl_cli(SFT, "--resume", part, "mode.max_steps=5")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    resumed, uninterrupted = jsonl(part / "metrics.jsonl"), jsonl(whole / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 6))
    for a, b in zip(resumed, uninterrupted):
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
