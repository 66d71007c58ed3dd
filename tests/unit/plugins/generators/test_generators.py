"""Generators against engines: single_turn on the real local engine, multi_turn's tool loop and loss mask.

A random tiny model never writes tool calls, so the tool loop is driven by a scripted server that speaks
SGLang's /generate protocol (it stands in for a model that has learned to call tools) and, separately,
run end to end on the real local engine."""

from __future__ import annotations

import json

import pytest

from posttrain.core.rollout.client import EngineClient
from posttrain.core.types import Sample, SampleStatus, SamplingParams
from posttrain.plugins.generators.multi_turn import MultiTurn
from posttrain.plugins.generators.single_turn import SingleTurn
from posttrain.plugins.tools.calculator import calculator
from posttrain.plugins.tools.local_search import search
from posttrain.testing.contracts.generator import GeneratorContract


class TestSingleTurnContract(GeneratorContract):
    @pytest.fixture
    def generator(self):
        return SingleTurn()


class TestMultiTurnContract(GeneratorContract):
    @pytest.fixture
    def generator(self):
        return MultiTurn(tools={"calculator": calculator})


async def test_single_turn_fills_tokens_logprobs_mask_and_status(engine_url, engine_key, hf_model):
    from posttrain.testing.engine import hf_greedy

    group = [Sample(prompt="2+2=", group_index=3), Sample(prompt=[{"role": "user", "content": "hi"}], group_index=3)]
    async with EngineClient(engine_url, api_key=engine_key) as engine:
        out = await SingleTurn()(group, engine, SamplingParams(temperature=0.0, max_new_tokens=6,
                                                               extra={"ignore_eos": True}))
    assert len(out) == 2 and all(s.group_index == 3 for s in out)
    for s in out:
        assert s.response_length == 6 and len(s.loss_mask) == 6 == len(s.rollout_log_probs) and all(s.loss_mask)
        assert s.status is SampleStatus.TRUNCATED and s.finish_reason == "length"
        assert s.tokens[-6:] == hf_greedy(hf_model, s.tokens[:-6], 6)
    assert "<|im_start|>" not in out[0].response and out[1].prompt_length > 10  # chat template applied


def call(name, **args):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


async def test_multi_turn_mask_is_one_exactly_on_model_tokens(scripted):
    turns = ["Let me compute. " + call("calculator", expression="6*7"),
             "Now search. " + call("search", query="capital of France") + call("calculator", expression="1/0"),
             "The answer is 42, Paris."]
    eng, client, tok = await scripted(list(turns))
    gen = MultiTurn(MultiTurn.Config(max_turns=4), tools={"calculator": calculator, "search": search})
    [s] = await gen([Sample(prompt="What is 6*7?")], client, SamplingParams(max_new_tokens=1000))
    await client.close()

    model_ids = [tok.encode(t, add_special_tokens=False) for t in turns]
    response = s.tokens[s.prompt_length:]
    assert len(response) == s.response_length == len(s.loss_mask) == len(s.rollout_log_probs)
    # walk the response: model turn, environment block, model turn, environment block, model turn
    pos, env_blocks = 0, []
    for i, ids in enumerate(model_ids):
        assert response[pos:pos + len(ids)] == ids and s.loss_mask[pos:pos + len(ids)] == [1] * len(ids)
        assert s.rollout_log_probs[pos:pos + len(ids)] == [-0.5] * len(ids)
        pos += len(ids)
        if i < len(model_ids) - 1:
            end = pos
            while end < len(response) and s.loss_mask[end] == 0:
                end += 1
            env_blocks.append(tok.decode(response[pos:end]))
            pos = end
    assert pos == len(response)
    assert sum(s.loss_mask) == sum(map(len, model_ids))
    assert "<tool_response>\n42\n</tool_response>" in env_blocks[0]
    assert "Paris: Paris is the capital of France." in env_blocks[1]
    assert "error: ZeroDivisionError" in env_blocks[1]  # a failing tool answers with its error text
    assert eng.inputs[1] == s.tokens[: s.prompt_length + len(model_ids[0]) + len(tok.encode(env_blocks[0]))]
    assert s.status is SampleStatus.COMPLETED and s.weight_version == 2 and s.metadata["turns"] == 3


async def test_multi_turn_reports_unknown_tools_and_bad_json_to_the_model(scripted):
    eng, client, tok = await scripted(["<tool_call>{oops</tool_call>" + call("nope", x=1), "done"])
    [s] = await MultiTurn(tools={"calculator": calculator})([Sample(prompt="q")], client, SamplingParams(max_new_tokens=1000))
    await client.close()
    assert "malformed tool call" in s.response and "unknown tool 'nope'" in s.response


async def test_multi_turn_on_the_real_engine_masks_only_generated_tokens(engine_url, engine_key):
    async with EngineClient(engine_url, api_key=engine_key) as engine:
        out = await MultiTurn(tools={"calculator": calculator})(
            [Sample(prompt="hello"), Sample(prompt="1+1")], engine, SamplingParams(max_new_tokens=20))
    for s in out:
        assert s.response_length <= 20 and len(s.loss_mask) == s.response_length
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)


def test_tools_registered_and_calculator_is_safe(plugins):
    assert {"calculator", "search"} <= set(plugins.tools)
    assert calculator("(2 + 3) * 4") == "20" and calculator("7 / 2") == "3.5"
    with pytest.raises(ValueError):
        calculator("__import__('os').system('true')")
    assert search("highest mountain").startswith("Mount Everest")


async def test_multi_turn_takes_its_tools_from_the_plugin_registry(scripted):
    eng, client, tok = await scripted([call("calculator", expression="2**10"), "ok"])
    from posttrain.core.plugins import load_plugins

    gen = MultiTurn(MultiTurn.Config(tools=["calculator"]))
    gen.bind(load_plugins())
    [s] = await gen([Sample(prompt="q")], client, SamplingParams(max_new_tokens=500))
    await client.close()
    assert "<tool_response>\n1024\n</tool_response>" in s.response
    assert set(gen.tools()) == {"calculator"}


async def test_a_slow_tool_times_out_into_error_text():
    import asyncio

    from posttrain.core.rollout.tools import ToolCall, run_tool

    async def slow(**_):
        await asyncio.sleep(5)

    assert "timed out" in await run_tool(ToolCall("slow", {}), {"slow": slow}, timeout_s=0.05)
    assert "unknown tool" in await run_tool(ToolCall("x", {}), {}, timeout_s=1)
