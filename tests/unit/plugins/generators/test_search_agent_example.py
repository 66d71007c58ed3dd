"""examples/search-agent: the plugin file loads, the agent searches the local corpus, the reward scores it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from posttrain.core.types import Sample, SampleStatus, SamplingParams

from tests.conftest import ROOT

EXAMPLE = ROOT / "examples" / "search-agent"


@pytest.fixture(scope="module")
def example_plugins():
    from posttrain.core.plugins import load_plugins

    return load_plugins(plugin_files=[str(EXAMPLE / "search_agent.py")])


async def test_search_agent_searches_then_answers(scripted, example_plugins):
    turns = ["Let me look. <search>capital of France</search>", "<answer>Paris</answer>"]
    eng, client, tok = await scripted(list(turns))
    agent = example_plugins.generators["search_agent"]()
    [s] = await agent([Sample(prompt=[{"role": "user", "content": "Capital of France?"}], label="Paris")],
                      client, SamplingParams(max_new_tokens=300))
    await client.close()
    reward = example_plugins.rewards["search_answer"]()
    assert reward(s) == {"score": 1.0} and s.status is SampleStatus.COMPLETED
    model_tokens = sum(len(tok.encode(t, add_special_tokens=False)) for t in turns)
    assert sum(s.loss_mask) == model_tokens and len(s.loss_mask) > model_tokens
    assert "<information>Paris: Paris is the capital of France." in s.response
    zeros = [i for i, m in enumerate(s.loss_mask) if m == 0]
    assert "<information>" in tok.decode(s.tokens[s.prompt_length + zeros[0]: s.prompt_length + zeros[-1] + 1])


@pytest.mark.slow
def test_smoke_run_on_cpu():
    out = subprocess.run([sys.executable, str(EXAMPLE / "smoke.py"), "--smoke", "--max-new-tokens", "16"],
                         capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert '"ok": true' in out.stdout.splitlines()[-1]
