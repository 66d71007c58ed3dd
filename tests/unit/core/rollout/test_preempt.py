"""Partial rollouts over a real local engine server: a weight push in the middle of a response pauses the
engine (SGLang's /pause_generation, abort mode), loads the new weights, and the response goes on from its
partial tokens, re-prefilled under the new weights; each token's weight version is recorded and the
correction (TIS) reweights the tokens the old weights sampled."""

import asyncio

import pytest
import torch

from posttrain.core.rollout.client import EngineClient
from posttrain.core.rollout.preempt import PausableEngine
from posttrain.core.types import Sample, SamplingParams
from posttrain.plugins.corrections.tis import TIS
from posttrain.plugins.generators.single_turn import SingleTurn
from posttrain.testing.engine import start_local_engine

N = 400  # response tokens: long enough to be caught mid-way


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    server = start_local_engine(tiny_ckpt, tmp_path_factory.mktemp("partial"), context_length=512)
    yield server
    server.stop()


def token_log_probs(ckpt, tokens, start):
    """``log_softmax`` of each token from ``start`` on under the HF model of ``ckpt`` (temperature 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    lps = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return lps[start - 1:]


async def generate_across_a_push(server, client, partial, new_ckpt, version):
    """One sample of N tokens; a push of ``new_ckpt`` as ``version`` once the engine is 20 steps into it."""
    engine = PausableEngine(client, [server.base_url], partial=partial, api_key=server.api_key)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=N, extra={"ignore_eos": True}, seed=5)
    sample = Sample(prompt="1+2=", index=0)
    steps0 = (await client.get_server_info())["internal_states"][0]["steps"]
    task = asyncio.ensure_future(SingleTurn(SingleTurn.Config())([sample], engine, sampling))
    while (await client.get_server_info())["internal_states"][0]["steps"] < steps0 + 20:
        assert not task.done(), "the response ended before the push"
        await asyncio.sleep(0.002)
    async with engine.paused():
        await client.update_weights_from_disk(str(new_ckpt), weight_version=str(version))
    [sample] = await task
    await engine.close()
    return sample, engine.continued


async def test_response_spans_two_weight_versions_and_is_reweighted(server, tiny_ckpt, tiny_ckpt_b):
    async with EngineClient(server.base_url, api_key=server.api_key) as client:
        sample, continued = await generate_across_a_push(server, client, True, tiny_ckpt_b, 1)
        assert continued == 1 and sample.response_length == N and sample.status.value == "truncated"
        versions = sample.weight_versions
        assert len(versions) == N and set(versions) == {0, 1} and versions == sorted(versions), versions[:40]
        cut = versions.index(1)
        assert cut >= 20  # the tokens before the push were kept, not generated again
        # every token's rollout log-prob is the one of the weights that sampled it: the prefix under the old
        # weights, the rest under the new ones over the whole re-prefilled prefix
        rollout = torch.tensor(sample.rollout_log_probs)
        old = token_log_probs(tiny_ckpt, sample.tokens, sample.prompt_length)
        new = token_log_probs(tiny_ckpt_b, sample.tokens, sample.prompt_length)
        assert torch.allclose(rollout[:cut], old[:cut], atol=1e-3)
        assert torch.allclose(rollout[cut:], new[cut:], atol=1e-3)
        assert not torch.allclose(old[cut:], new[cut:], atol=1e-2)  # the two checkpoints do differ
        # the trainer holds the new weights: TIS weighs the new tokens 1, the old ones exp(new - old)
        weights, _ = TIS()(new[None], rollout[None], torch.ones(1, N))
        assert torch.allclose(weights[0, cut:], torch.ones(N - cut), atol=2e-3)
        assert torch.allclose(weights[0, :cut], (new[:cut] - old[:cut]).exp().clamp(0, 2), atol=2e-3)
        assert (weights[0, :cut] - 1).abs().mean() > 0.05

        # without partial rollouts the response starts over under the new weights
        restarted, continued = await generate_across_a_push(server, client, False, tiny_ckpt, 2)
        assert continued == 1 and restarted.response_length == N and set(restarted.weight_versions) == {2}
        lps = token_log_probs(tiny_ckpt, restarted.tokens, restarted.prompt_length)
        assert torch.allclose(torch.tensor(restarted.rollout_log_probs), lps, atol=1e-3)
