"""The openai_agent generator: agents written with the official openai client against its endpoint, in front of
a real local engine (a tiny random Qwen3 with a tool-calling chat template) and, for tool calls a random model
never writes, an engine that answers from a script."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from posttrain.core.rollout.client import EngineClient
from posttrain.core.types import Sample, SampleStatus, SamplingParams
from posttrain.plugins.generators.openai_agent import OpenAIAgent

openai = pytest.importorskip("openai")  # the test extra has it

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    from posttrain.testing.chat_templates import chat_tokenizer
    from posttrain.testing.engine import start_local_engine
    from posttrain.testing.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("agent") / "qwen3", family="qwen3", seed=0)
    chat_tokenizer("qwen3", vocab_size=128).save_pretrained(str(ckpt))
    server = start_local_engine(ckpt, context_length=512, max_running_requests=256)
    yield server
    server.stop()


class Recording:
    """An engine client that keeps every /generate's input ids and answer (the test's view of the engine)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, input_ids, **kw):
        out = await self.engine.generate(input_ids=input_ids, **kw)
        self.calls.append((list(input_ids), out))
        return out


def run(gen, group, server, sampling=None, record=False):
    async def go():
        async with EngineClient(server.base_url, api_key=server.api_key) as client:
            engine = Recording(client) if record else client
            out = await gen(group, engine, sampling or SamplingParams(temperature=1.0, max_new_tokens=128, seed=0))
            await gen._endpoint.stop()
            return out, engine
    return asyncio.run(go())


async def three_turns(base_url, api_key, sample):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": sample.prompt}]
    for k in range(3):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"again {k}"})
    return r.choices[0].message.content or ""


def test_incremental_tokens_are_the_engines_and_only_model_tokens_train(engine_server):
    gen = OpenAIAgent(OpenAIAgent.Config(), agent=three_turns)
    out, engine = run(gen, [Sample(prompt=f"{i}+2=", index=i) for i in range(2)], engine_server, record=True)
    assert len(out) == 2 and len(engine.calls) == 6
    for s in out:
        assert s.status is not SampleStatus.FAILED, s.error
        mine = [(ids, o) for ids, o in engine.calls if s.tokens[:len(ids)] == ids]
        assert len(mine) == 3, ("every request's input is a prefix of the sample's running token list", s.metadata,
                                [len(ids) for ids, _ in engine.calls], len(s.tokens), s.prompt_length)
        model = set()
        for ids, o in mine:
            new = [t for _, t, _ in o["meta_info"]["output_token_logprobs"]]
            assert s.tokens[len(ids):len(ids) + len(new)] == new, "the engine's tokens, never re-tokenized"
            at = len(ids) - s.prompt_length
            assert s.loss_mask[at:at + len(new)] == [1] * len(new)
            assert s.rollout_log_probs[at:at + len(new)] == [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
            model |= set(range(at, at + len(new)))
        assert all(m == (i in model) for i, m in enumerate(s.loss_mask)), "system/user/template tokens masked out"
        assert s.metadata["rollout_means"]["turns_per_sample"] == 3
    sums = out[0].metadata["rollout_sums"]
    assert sums == {"agent_failed": 0, "retokenization_mismatch": 0, "agent_branches": 0, "template_prefix_breaks": 0}


def test_endpoint_speaks_openai_auth_stream_completions_models(engine_server):
    seen = {}

    async def agent(base_url, api_key, sample):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
        seen["models"] = [m.id for m in (await client.models.list()).data]
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=base_url, api_key="wrong").models.list()
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], n=2)
        stream = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4, stream=True)
        seen["chunks"] = [c async for c in stream]
        c1 = await client.completions.create(model="policy", prompt="3+4=", max_tokens=3)
        c2 = await client.completions.create(model="policy", prompt="3+4=" + c1.choices[0].text + "\n5+5=", max_tokens=3)
        return c2.choices[0].text

    gen = OpenAIAgent(OpenAIAgent.Config(), agent=agent)
    out, _ = run(gen, [Sample(prompt="p")], engine_server)
    assert len(out) == 2, "the chat turn and the completions are two token lists (branches)"
    s = out[0]
    assert seen["models"] == ["policy"]
    assert seen["chunks"][-1].choices[0].finish_reason in ("stop", "length")
    assert s.status is not SampleStatus.FAILED, s.error
    # the chat turn, then the completions: a new (text) conversation is a branch, the second prompt extends it
    assert s.metadata["rollout_sums"]["agent_branches"] == 1 and s.metadata["rollout_means"]["turns_per_sample"] == 3
    assert s.metadata["rollout_sums"]["retokenization_mismatch"] == 0
    text = out[1]
    assert text.prompt_length == 4, "the completions branch starts from its prompt '3+4='"
    mask = "".join(map(str, text.loss_mask))
    assert mask.strip("1") == "00000" and mask.startswith("1") and mask.endswith("1"), \
        "completion, the appended '\\n5+5=' (masked), completion: the second prompt extended the first"


def test_edited_history_starts_a_counted_branch(engine_server):
    async def agent(base_url, api_key, sample):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
        msgs = [{"role": "user", "content": "first"}]
        r = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=4)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        await client.chat.completions.create(model="policy", messages=msgs, max_tokens=4)  # extends: no branch
        msgs[0]["content"] = "edited"
        await client.chat.completions.create(model="policy", messages=msgs, max_tokens=4)  # edited: a branch
        return "done"

    gen = OpenAIAgent(OpenAIAgent.Config(), agent=agent)
    out, _ = run(gen, [Sample(prompt="p", group_index=3)], engine_server)
    assert out[0].metadata["rollout_sums"]["agent_branches"] == 1
    assert len(out) == 2 and all(s.group_index == 3 and s.response == "done" for s in out), "each branch a sample"
    assert out[1].loss_mask[0] == 1 and out[1].prompt_length > out[0].prompt_length - 10


class ScriptedEngine:
    """SGLang-protocol answers from a script of texts (a random model never writes a tool call)."""

    def __init__(self, tokenizer, path, script):
        self.tokenizer, self.path, self.script, self.inputs = tokenizer, str(path), list(script), []
        self.base_url, self.api_key = f"scripted://{id(self)}", None

    async def get_model_info(self):
        return {"model_path": self.path}

    async def generate(self, input_ids, sampling_params, **kw):
        self.inputs.append(list(input_ids))
        ids = self.tokenizer.encode(self.script.pop(0), add_special_tokens=False)
        return {"text": "", "output_ids": ids, "meta_info": {
            "output_token_logprobs": [[-0.25, t, None] for t in ids], "finish_reason": {"type": "stop"},
            "weight_version": "3"}}


async def calculator_loop(base_url, api_key, sample):
    """The example's agent shape: offer the calculator, run what the model calls, answer."""
    from posttrain.plugins.tools.calculator import calculator

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    messages = [{"role": "user", "content": sample.prompt}]
    for _ in range(4):
        msg = (await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)).choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return msg.content
        for call in msg.tool_calls:
            result = calculator(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def test_tool_calls_parsed_and_tool_results_masked(tmp_path):
    from posttrain.testing.chat_templates import chat_tokenizer

    tok = chat_tokenizer("qwen3", vocab_size=128)
    tok.save_pretrained(str(tmp_path))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>'
    engine = ScriptedEngine(tok, tmp_path, [call, "5<|im_end|>"])
    gen = OpenAIAgent(OpenAIAgent.Config(), agent=calculator_loop)

    async def go():
        out = await gen([Sample(prompt="2+3=")], engine, SamplingParams(max_new_tokens=200))
        await gen._endpoint.stop()
        return out

    (s,) = asyncio.run(go())
    assert s.response == "5" and s.status is SampleStatus.COMPLETED and s.weight_version == 3
    assert s.metadata["rollout_means"]["tool_calls_per_sample"] == 1
    assert s.metadata["rollout_sums"]["retokenization_mismatch"] == 0
    first, second = (tok.encode(t, add_special_tokens=False) for t in (call, "5<|im_end|>"))
    assert engine.inputs[1] == s.tokens[:len(engine.inputs[1])] == engine.inputs[0] + first + tok.encode(
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False), "the tool result rendered by the template after the model's exact tokens"
    response = s.tokens[s.prompt_length:]
    assert response == first + response[len(first):-len(second)] + second
    assert s.loss_mask == [1] * len(first) + [0] * (len(response) - len(first) - len(second)) + [1] * len(second)
    assert s.rollout_log_probs == [-0.25 if m else 0.0 for m in s.loss_mask]


def test_raising_hanging_and_over_budget_agents_fail_alone(engine_server):
    async def agent(base_url, api_key, sample):
        if sample.index == 0:
            raise ValueError("boom")
        if sample.index == 1:
            await asyncio.sleep(1000)
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        for _ in range(3 if sample.index == 2 else 1):
            try:
                r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}],
                                                         max_tokens=2)
            except openai.BadRequestError:
                pass  # an agent that swallows the refusal still fails
        return r.choices[0].message.content

    from posttrain.core.batching import generator_metrics

    gen = OpenAIAgent(OpenAIAgent.Config(timeout_s=3.0, max_turns=2), agent=agent)
    t0 = time.monotonic()
    out, _ = run(gen, [Sample(prompt="q", index=i) for i in range(4)], engine_server)
    assert time.monotonic() - t0 < 20, "a hung agent costs its timeout, not the step"
    assert [s.status for s in out] == [SampleStatus.FAILED] * 3 + [SampleStatus.COMPLETED]
    assert "raised ValueError: boom" in out[0].error and "timed out" in out[1].error
    assert "max_turns=2" in out[2].error and out[3].response_length > 0
    m = generator_metrics([out])
    assert m["rollout/agent_failed"] == 3 and m["rollout/turns_per_sample"] == (0 + 0 + 2 + 1) / 4


def test_256_concurrent_conversations(engine_server):
    async def agent(base_url, api_key, sample):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=120)
        msgs = [{"role": "user", "content": sample.prompt}]
        r = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=4)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
        r = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=4)
        return r.choices[0].message.content or ""

    gen = OpenAIAgent(OpenAIAgent.Config(), agent=agent)
    out, engine = run(gen, [Sample(prompt=f"{i}+{i}=", index=i) for i in range(256)], engine_server, record=True)
    assert len(out) == 256 and all(s.status is not SampleStatus.FAILED for s in out), [s.error for s in out][:3]
    assert len(engine.calls) == 512
    assert all(s.metadata["rollout_means"]["turns_per_sample"] == 2 and sum(s.loss_mask) > 0 for s in out)
    assert sum(s.metadata["rollout_sums"]["retokenization_mismatch"] for s in out) == 0
    assert sum(s.metadata["rollout_sums"]["agent_branches"] for s in out) == 0


def test_config_errors_name_the_key():
    from posttrain.core.plugins import load_plugins

    errors = OpenAIAgent(OpenAIAgent.Config(agent="nope", tool_format="xml")).check_config(None, load_plugins())
    assert errors[0].startswith("generator.agent: unknown agent 'nope'") and "chat" in errors[0]
    assert errors[1].startswith("generator.tool_format: unknown format 'xml'")


def test_one_sample_per_turn(tmp_path):
    from posttrain.testing.chat_templates import chat_tokenizer

    tok = chat_tokenizer("qwen3", vocab_size=128)
    tok.save_pretrained(str(tmp_path))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call><|im_end|>'
    engine = ScriptedEngine(tok, tmp_path, [call, "42<|im_end|>"])
    gen = OpenAIAgent(OpenAIAgent.Config(samples="turn"), agent=calculator_loop)

    async def go():
        out = await gen([Sample(prompt="6*7=", group_index=5)], engine, SamplingParams(max_new_tokens=200))
        await gen._endpoint.stop()
        return out

    first, second = asyncio.run(go())
    assert first.tokens == engine.inputs[0] + tok.encode(call, add_special_tokens=False)
    assert second.tokens[:second.prompt_length] == engine.inputs[1], "turn 2's prompt: all before it, as sent"
    assert first.loss_mask == [1] * first.response_length and second.loss_mask == [1] * second.response_length
    assert first.response == second.response == "42" and first.group_index == second.group_index == 5
