"""The local engine server against HF: greedy tokens, log-probs, stops, abort, pause, bad input."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from posttrain.core.rollout.client import EngineClient, EngineRequestError, tokens_and_logprobs
from posttrain.testing.engine import hf_greedy

PROMPTS = [[5, 6, 7, 8], [40, 41], [60, 70, 80, 90, 11, 12, 13], [99], [20, 21, 22]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


async def test_greedy_matches_hf_generate_token_for_token(engine_url, hf_model):
    async with EngineClient(engine_url) as engine:  # all at once: they share decode batches
        outs = await asyncio.gather(*[engine.generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS])
    for prompt, out in zip(PROMPTS, outs):
        assert out["output_ids"] == hf_greedy(hf_model, prompt, 12)
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 12}
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 12
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_match_a_forward_pass(engine_url, hf_model, temperature):
    import torch

    sp = {"temperature": temperature, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 3}
    async with EngineClient(engine_url) as engine:
        outs = await asyncio.gather(*[engine.generate(input_ids=p, sampling_params=sp) for p in PROMPTS[:3]])
    for prompt, out in zip(PROMPTS, outs):
        tokens, lps = tokens_and_logprobs(out)
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        ref = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(lps), ref, atol=1e-4), (lps, ref.tolist())


async def test_sampling_seed_is_reproducible_and_text_input_works(engine_url, tiny_ckpt):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tiny_ckpt)).encode("hello", add_special_tokens=False)
    sp = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "min_p": 0.01, "max_new_tokens": 10, "sampling_seed": 7,
          "ignore_eos": True}
    async with EngineClient(engine_url) as engine:
        a = await engine.generate(text="hello", sampling_params=sp)
        b = await engine.generate(text="hello", sampling_params=sp)
        c = await engine.generate(input_ids=ids, sampling_params=sp)
    assert a["output_ids"] == b["output_ids"], (a["output_ids"], b["output_ids"])
    assert a["output_ids"] == c["output_ids"]  # text is tokenized to the same ids
    assert a["meta_info"]["prompt_tokens"] == 5


async def test_stop_token_and_stop_string(engine_url, hf_model):
    prompt = PROMPTS[0]
    greedy = hf_greedy(hf_model, prompt, 12)
    stop_tok = greedy[4]
    first = greedy.index(stop_tok)
    async with EngineClient(engine_url) as engine:
        out = await engine.generate(input_ids=prompt, sampling_params={**GREEDY, "stop_token_ids": [stop_tok]})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
        assert out["output_ids"] == greedy[: first + 1]  # the stop token is kept in output_ids

        full = await engine.generate(input_ids=prompt, sampling_params=GREEDY)
        text = full["text"]
        stop = text[3:5]
        at = text.find(stop)
        trimmed = await engine.generate(input_ids=prompt, sampling_params={**GREEDY, "stop": [stop]})
        kept = await engine.generate(input_ids=prompt, sampling_params={**GREEDY, "stop": stop, "no_stop_trim": True})
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert trimmed["text"] == text[:at]
    assert kept["text"] == text[: at + len(stop)]


async def test_client_takes_sampling_params_objects(engine_url, hf_model):
    from posttrain.core.types import SamplingParams

    async with EngineClient(engine_url) as engine:
        out = await engine.generate(input_ids=PROMPTS[3], sampling_params=SamplingParams(
            temperature=0.0, max_new_tokens=12, extra={"ignore_eos": True}))
    assert out["output_ids"] == hf_greedy(hf_model, PROMPTS[3], 12)


async def test_batched_request_returns_a_list(engine_url, hf_model):
    async with EngineClient(engine_url) as engine:
        outs = await engine.request("POST", "/generate", {"input_ids": PROMPTS[:2], "sampling_params": GREEDY})
    assert [o["output_ids"] for o in outs] == [hf_greedy(hf_model, p, 12) for p in PROMPTS[:2]]


async def test_abort_request_ends_in_flight_requests_with_abort(engine_url):
    long = {"temperature": 1.0, "max_new_tokens": 240, "ignore_eos": True}
    async with EngineClient(engine_url) as engine:
        one = asyncio.create_task(engine.generate(input_ids=[5, 6], sampling_params=long, rid="victim"))
        rest = [asyncio.create_task(engine.generate(input_ids=[7, 8], sampling_params=long)) for _ in range(3)]
        for _ in range(500):  # until all four reached the engine (bounded: 5 s)
            if (await engine.get_server_info())["internal_states"][0]["num_requests"] >= 4:
                break
            await asyncio.sleep(0.01)
        await engine.abort_request(rid="victim")
        out = await one
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["meta_info"]["id"] == "victim" and out["meta_info"]["completion_tokens"] < 240
        await engine.abort_request(abort_all=True)
        for r in await asyncio.gather(*rest):
            assert r["meta_info"]["finish_reason"]["type"] == "abort"
            assert len(r["meta_info"]["output_token_logprobs"]) == r["meta_info"]["completion_tokens"]


async def test_pause_in_place_holds_requests_until_continue(engine_url, hf_model):
    async with EngineClient(engine_url) as engine:
        await engine.pause_generation(mode="in_place")
        task = asyncio.create_task(engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY))
        await asyncio.sleep(0.5)
        assert not task.done()
        assert await engine.health_generate()  # a paused server is alive, not dead
        await engine.continue_generation()
        out = await asyncio.wait_for(task, 30)
    assert out["output_ids"] == hf_greedy(hf_model, PROMPTS[1], 12)


def _post_raw(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "malformed JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (json.dumps({"input_ids": [1, 2], "bogus": 1}).encode(), "bogus"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}).encode(), "max_new_tokens"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"temprature": 1}}).encode(), "temprature"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}).encode(), "top_p"),
    (json.dumps({"input_ids": list(range(1, 100)) * 3}).encode(), "context length"),
    (json.dumps({"input_ids": [1, 100000]}).encode(), "outside the vocabulary"),
    (json.dumps({"text": "a", "input_ids": [1]}).encode(), "exactly one"),
    (json.dumps({"input_ids": [1], "return_routed_experts": True}).encode(), "no MoE layers"),
])
def test_bad_input_is_a_400_and_the_server_keeps_serving(engine_url, body, fragment):
    status, answer = _post_raw(engine_url, body)
    assert status == 400
    assert fragment in answer["error"]["message"]
    status, ok = _post_raw(engine_url, json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}).encode())
    assert status == 200 and len(ok["output_ids"]) <= 2


async def test_client_raises_on_400_without_retrying(engine_url):
    async with EngineClient(engine_url) as engine:
        with pytest.raises(EngineRequestError) as err:
            await engine.generate(input_ids=[1], sampling_params={"max_new_tokens": -5})
    assert err.value.status == 400 and "max_new_tokens" in err.value.message


async def test_info_endpoints_answer_like_sglang(engine_url, tiny_ckpt):
    async with EngineClient(engine_url) as engine:
        info = await engine.get_model_info()
        server = await engine.get_server_info()
        assert await engine.health_generate()
        assert "Cache flushed" in await engine.flush_cache()
        version = await engine.get_weight_version()
    assert info["model_path"] == str(tiny_ckpt.resolve()) and info["is_generation"] is True
    assert server["model_path"] == info["model_path"] and server["context_length"] == 256
    assert version == info["weight_version"]


async def test_client_retries_connection_errors_then_gives_up():
    from posttrain.core.rollout.procs import free_port

    client = EngineClient(f"http://127.0.0.1:{free_port()}", max_retries=2, backoff_s=0.01)
    with pytest.raises(ConnectionError, match="3 attempt"):
        await client.generate(input_ids=[1])
    await client.close()


async def test_release_and_resume_memory_keep_the_engine_serving(engine_url, hf_model):
    async with EngineClient(engine_url) as engine:
        assert (await engine.release_memory_occupation())["success"]
        assert (await engine.resume_memory_occupation())["success"]
        out = await engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert out["output_ids"] == hf_greedy(hf_model, PROMPTS[0], 12)


async def test_generate_while_released_is_refused_until_resumed(engine_url, hf_model):
    async with EngineClient(engine_url) as engine:
        assert (await engine.release_memory_occupation(["kv_cache"]))["success"]
        with pytest.raises(EngineRequestError, match="400.*resume_memory_occupation"):
            await engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        info = await engine.get_server_info()
        assert info["internal_states"][0]["memory"]["released"] == ["kv_cache"]
        with pytest.raises(EngineRequestError, match="400.*tags"):
            await engine.resume_memory_occupation(["kv"])
        assert (await engine.resume_memory_occupation(["kv_cache"]))["success"]
        out = await engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert out["output_ids"] == hf_greedy(hf_model, PROMPTS[0], 12)


async def test_interrupt_resends_requests_stuck_on_a_dead_worker():
    """A router keeps waiting on a dead worker's connection: ``interrupt()`` cancels the attempt in flight
    and the request goes out again (here to a server whose first answer never comes)."""
    from aiohttp import web

    from posttrain.core.rollout.procs import free_port

    calls, gone = [], asyncio.Event()

    async def generate(request):
        calls.append(await request.json())
        if len(calls) == 1:
            await gone.wait()  # the dead worker: no answer, no error (until the test ends)
        return web.json_response({"text": "", "output_ids": [7], "meta_info": {"finish_reason": {"type": "length"}}})

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with EngineClient(f"http://127.0.0.1:{port}", backoff_s=0.01) as engine:
            task = asyncio.ensure_future(engine.generate(input_ids=[1, 2]))
            while not calls:
                await asyncio.sleep(0.01)
            assert engine.interrupt() == 1
            out = await asyncio.wait_for(task, 10)
        assert out["output_ids"] == [7] and len(calls) == 2 and calls[0] == calls[1]
        assert engine.interrupt() == 0  # nothing in flight any more
    finally:
        gone.set()
        await runner.cleanup()
