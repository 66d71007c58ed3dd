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


async def test_greedy_matches_hf_generate_token_for_token(engine_url, engine_key, hf_model):
    async with EngineClient(engine_url, api_key=engine_key) as engine:  # all at once: they share decode batches
        outs = await asyncio.gather(*[engine.generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS])
    for prompt, out in zip(PROMPTS, outs):
        assert out["output_ids"] == hf_greedy(hf_model, prompt, 12)
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 12}
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 12
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_match_a_forward_pass(engine_url, engine_key, hf_model, temperature):
    import torch

    sp = {"temperature": temperature, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 3}
    async with EngineClient(engine_url, api_key=engine_key) as engine:
        outs = await asyncio.gather(*[engine.generate(input_ids=p, sampling_params=sp) for p in PROMPTS[:3]])
    for prompt, out in zip(PROMPTS, outs):
        tokens, lps = tokens_and_logprobs(out)
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        ref = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(lps), ref, atol=1e-4), (lps, ref.tolist())


async def test_sampling_seed_is_reproducible_and_text_input_works(engine_url, engine_key, tiny_ckpt):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tiny_ckpt)).encode("hello", add_special_tokens=False)
    sp = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "min_p": 0.01, "max_new_tokens": 10, "sampling_seed": 7,
          "ignore_eos": True}
    async with EngineClient(engine_url, api_key=engine_key) as engine:
        a = await engine.generate(text="hello", sampling_params=sp)
        b = await engine.generate(text="hello", sampling_params=sp)
        c = await engine.generate(input_ids=ids, sampling_params=sp)
    assert a["output_ids"] == b["output_ids"], (a["output_ids"], b["output_ids"])
    assert a["output_ids"] == c["output_ids"]  # text is tokenized to the same ids
    assert a["meta_info"]["prompt_tokens"] == 5


async def test_stop_token_and_stop_string(engine_url, engine_key, hf_model):
    prompt = PROMPTS[0]
    greedy = hf_greedy(hf_model, prompt, 12)
    stop_tok = greedy[4]
    first = greedy.index(stop_tok)
    async with EngineClient(engine_url, api_key=engine_key) as engine:
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


async def test_client_takes_sampling_params_objects(engine_url, engine_key, hf_model):
    from posttrain.core.types import SamplingParams

    async with EngineClient(engine_url, api_key=engine_key) as engine:
        out = await engine.generate(input_ids=PROMPTS[3], sampling_params=SamplingParams(
            temperature=0.0, max_new_tokens=12, extra={"ignore_eos": True}))
    assert out["output_ids"] == hf_greedy(hf_model, PROMPTS[3], 12)


async def test_batched_request_returns_a_list(engine_url, engine_key, hf_model):
    async with EngineClient(engine_url, api_key=engine_key) as engine:
        outs = await engine.request("POST", "/generate", {"input_ids": PROMPTS[:2], "sampling_params": GREEDY})
    assert [o["output_ids"] for o in outs] == [hf_greedy(hf_model, p, 12) for p in PROMPTS[:2]]


async def test_abort_request_ends_in_flight_requests_with_abort(engine_url, engine_key):
    long = {"temperature": 1.0, "max_new_tokens": 240, "ignore_eos": True}
    async with EngineClient(engine_url, api_key=engine_key) as engine:
        one = asyncio.create_task(engine.generate(input_ids=[5, 6], sampling_params=long, rid="victim"))
        rest = [asyncio.create_task(engine.generate(input_ids=[7, 8], sampling_params=long)) for _ in range(3)]
        for _ in range(500):  # until all four reached the engine (bounded: 5 s)
            state = (await engine.get_server_info())["internal_states"][0]
            if state["num_requests"] >= 4:
                break
            await asyncio.sleep(0.01)
        assert state["num_running_reqs"] + state["num_waiting_reqs"] == state["num_requests"] == 4  # queue depths
        await engine.abort_request(rid="victim")
        out = await one
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["meta_info"]["id"] == "victim" and out["meta_info"]["completion_tokens"] < 240
        await engine.abort_request(abort_all=True)
        for r in await asyncio.gather(*rest):
            assert r["meta_info"]["finish_reason"]["type"] == "abort"
            assert len(r["meta_info"]["output_token_logprobs"]) == r["meta_info"]["completion_tokens"]


async def test_pause_in_place_holds_requests_until_continue(engine_url, engine_key, hf_model):
    async with EngineClient(engine_url, api_key=engine_key) as engine:
        await engine.pause_generation(mode="in_place")
        task = asyncio.create_task(engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY))
        await asyncio.sleep(0.5)
        assert not task.done()
        assert await engine.health_generate()  # a paused server is alive, not dead
        await engine.continue_generation()
        out = await asyncio.wait_for(task, 30)
    assert out["output_ids"] == hf_greedy(hf_model, PROMPTS[1], 12)


def _post_raw(url: str, key: str | None, body: bytes, path: str = "/generate") -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + path, data=body, headers=headers)
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
    # the fault probe's step-crashers: each used to abort every request in flight
    (b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}', "finite"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"temperature": 1e-300}}).encode(), "greedy) or >= 1e-05"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"sampling_seed": 2**63}}).encode(), "sampling_seed"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"top_k": 2**63}}).encode(), "top_k"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [2**64]}}).encode(), "stop_token_ids"),
    (b'{"input_ids": [1, 2], "sampling_params": {"top_p": Infinity}}', "top_p"),
    (json.dumps({"input_ids": [1], "return_routed_experts": True}).encode(), "no MoE layers"),
    # the second probe's: a parser's recursion, and sampling the engine would have ignored silently
    (b'{"input_ids": [1, 2], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"input_ids": [1, 2], "sampling_params": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001, "nested too deeply"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"n": 5}}).encode(), "sampling_params.n: 5 is not supported"),
    (b'{"input_ids": [1, 2], "sampling_params": {"frequency_penalty": NaN}}', "sampling_params.frequency_penalty"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.3}}).encode(), "repetition_penalty"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"logit_bias": {"5": 3.0}}}).encode(), "logit_bias"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}}).encode(),
     "min_new_tokens: 5 exceeds max_new_tokens 2"),
])
def test_bad_input_is_a_400_and_the_server_keeps_serving(engine_url, engine_key, body, fragment):
    status, answer = _post_raw(engine_url, engine_key, body)
    assert status == 400
    assert fragment in answer["error"]["message"]
    status, ok = _post_raw(engine_url, engine_key, json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}).encode())
    assert status == 200 and len(ok["output_ids"]) <= 2


def test_neutral_values_of_fields_the_engine_does_not_implement_are_accepted(engine_url, engine_key):
    neutral = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {},
               "max_new_tokens": 2}
    status, answer = _post_raw(engine_url, engine_key, json.dumps({"input_ids": [1, 2], "sampling_params": neutral})
                               .encode())
    assert status == 200 and len(answer["output_ids"]) <= 2


@pytest.mark.parametrize("change, fragment", [
    ({"world_size": -1}, "world_size: -1"), ({"backend": "bogus"}, "backend: 'bogus'"),
    ({"rank_offset": 0}, "rank_offset: 0"), ({"rank_offset": 2}, "rank_offset: 2"),
    ({"master_port": 70000}, "master_port: 70000"), ({"world_size": "2"}, "world_size: expected an integer"),
])
def test_weight_group_arguments_are_refused_before_any_connection_is_tried(engine_url, engine_key, change, fragment):
    import time

    body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, **change}
    start = time.monotonic()
    status, answer = _post_raw(engine_url, engine_key, json.dumps(body).encode(), "/init_weights_update_group")
    assert status == 400 and fragment in answer["error"]["message"], answer
    assert time.monotonic() - start < 5  # no rendezvous was tried (it waits 30 s for the trainer)


async def test_a_bad_request_fails_alone_while_others_are_in_flight(engine_url, engine_key):
    long = {"temperature": 1.0, "max_new_tokens": 120, "ignore_eos": True}
    async with EngineClient(engine_url, api_key=engine_key) as engine:
        running = [asyncio.ensure_future(engine.generate(input_ids=p, sampling_params=long)) for p in PROMPTS[:3]]
        for bad in ({"temperature": float("nan")}, {"temperature": 1e-300}, {"sampling_seed": 2**63},
                    {"top_k": 2**63}, {"min_p": float("inf")}):
            with pytest.raises(EngineRequestError) as err:
                await engine.generate(input_ids=[1, 2], sampling_params=bad)
            assert err.value.status == 400
        outs = await asyncio.wait_for(asyncio.gather(*running), 120)
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * 3
    assert all(o["meta_info"]["completion_tokens"] == 120 for o in outs)


async def test_a_batch_seeded_at_the_int64_edge_runs(engine_url, engine_key):
    """Row j of a batch draws with seed + j, wrapped into int64: the last valid seed cannot overflow."""
    seeded = {"temperature": 1.0, "max_new_tokens": 3, "sampling_seed": 2**63 - 1}
    async with EngineClient(engine_url, api_key=engine_key) as engine:
        outs = await engine.request("POST", "/generate", {"input_ids": [[5, 6]] * 3, "sampling_params": seeded})
    assert [len(o["output_ids"]) for o in outs] == [3, 3, 3]


async def test_a_huge_prompt_is_refused_and_health_stays_responsive(engine_url, engine_key):
    """30 MB of text used to hold the event loop for minutes (tokenized there; 1 GiB bodies accepted)."""
    import time

    import aiohttp

    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {engine_key}"}) as http:
        async def health_ms():
            t0 = time.perf_counter()
            async with http.get(engine_url + "/health") as resp:
                assert resp.status == 200
            return 1e3 * (time.perf_counter() - t0)

        t0 = time.perf_counter()
        try:
            async with http.post(engine_url + "/generate", json={"text": "7+" * 15_000_000}) as resp:
                status, body = resp.status, await resp.json()
            assert status == 413 and "takes at most" in body["error"]["message"]
        except aiohttp.ClientError:  # the server may close the upload it refused; it must stay up
            pass
        assert time.perf_counter() - t0 < 30
        assert await health_ms() < 2000
        long_text = "7+" * 3000  # under the body limit, over 16 x the context: refused untokenized
        async with http.post(engine_url + "/generate", json={"text": long_text}) as resp:
            assert resp.status == 400 and "are tokenized" in (await resp.json())["error"]["message"]


async def test_a_client_that_disconnects_aborts_its_request(engine_url, engine_key):
    """The engine holds the request (paused in place) while its client leaves: the request must go."""
    import aiohttp

    async with EngineClient(engine_url, api_key=engine_key) as engine:
        async def in_flight():
            return (await engine.get_server_info())["internal_states"][0]["num_requests"]

        await engine.pause_generation(mode="in_place")
        try:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {engine_key}"}) as http:
                post = asyncio.ensure_future(http.post(engine_url + "/generate", json={"input_ids": [5, 6]}))
                for _ in range(500):
                    if await in_flight():
                        break
                    await asyncio.sleep(0.01)
                assert await in_flight() == 1
                post.cancel()  # the client goes away while the engine holds its request
            for _ in range(500):
                if await in_flight() == 0:
                    break
                await asyncio.sleep(0.01)
            assert await in_flight() == 0, "the engine kept a request whose client left"
        finally:
            await engine.continue_generation()


async def test_server_info_totals_count_the_engines_work_since_start(engine_url, engine_key):
    """``internal_states[0].totals`` only grow: a batched request of three rows and 5 new tokens adds at least
    one prefill and the decode steps that ran its rows (a run's metrics report their differences per step)."""
    async with EngineClient(engine_url, api_key=engine_key) as engine:
        before = (await engine.get_server_info())["internal_states"][0]["totals"]
        await engine.generate(input_ids=PROMPTS[:3], sampling_params={**GREEDY, "max_new_tokens": 5})
        after = (await engine.get_server_info())["internal_states"][0]["totals"]
    assert set(after) == {"prefill_steps", "prefill_s", "decode_steps", "decode_rows", "decode_s", "graph_captures",
                          "graph_capture_s"}
    assert after["prefill_steps"] >= before["prefill_steps"] + 1 and after["prefill_s"] > before["prefill_s"]
    steps = after["decode_steps"] - before["decode_steps"]
    assert steps >= 4 and after["decode_s"] > before["decode_s"]  # the first token comes from the prefill
    assert after["decode_rows"] - before["decode_rows"] == 3 * steps  # the three rows run every step together
    assert after["graph_captures"] == before["graph_captures"] == 0  # no CUDA graphs on a CPU


async def test_server_info_says_how_long_each_part_of_the_start_took(engine_url, engine_key):
    async with EngineClient(engine_url, api_key=engine_key) as engine:
        startup = (await engine.get_server_info())["startup_s"]
    assert {"model", "tokenizer"} <= set(startup) and startup["model"] > 0 and startup["tokenizer"] >= 0
    # the fixture's start waited on /health_generate: the first one's seconds (a GPU's prefill compiles) are kept
    assert startup["first_generation"] > 0


def test_the_serving_line_names_the_starts_parts_and_the_process_age():
    from posttrain.plugins.engines.local.server import process_age_s, startup_text

    age = process_age_s()
    assert age is not None and 0 < age < 24 * 3600  # this test process, started moments (or minutes) ago
    assert startup_text({"waited": 3.04, "model": 10.26, "stable_memory": 1.0}, 24.12) == (
        "ready after 24.1 s: waiting for the checkpoint 3.0 s, model 10.3 s, stable memory 1.0 s")
    assert startup_text({}, 2.0) == "ready after 2.0 s" and startup_text({"model": 1.0}, None) == ""


async def test_an_engine_told_the_runs_sampling_decodes_with_it_before_it_answers(tiny_ckpt, tmp_path):
    """``--warm-sampling`` (what a run's GPU engines get): one two-token generation with the run's sampling runs
    before the server answers, so its decode step (compiles and CUDA graphs on a GPU) is ready for the first
    rollout. Without it, a started engine has decoded nothing (its readiness check asks for one token, which the
    prefill gives)."""
    from posttrain.testing.engine import start_local_engine

    sampling = {"temperature": 0.7, "top_p": 0.9, "stop": ["x"], "max_new_tokens": 64, "sampling_seed": 5}
    server = start_local_engine(tiny_ckpt, tmp_path, warm_sampling=json.dumps(sampling))
    try:
        async with EngineClient(server.base_url, api_key=server.api_key) as engine:
            info = await engine.get_server_info()
    finally:
        server.stop()
    assert info["warm_sampling"] == sampling and info["startup_s"]["warm_up"] > 0
    totals = info["internal_states"][0]["totals"]
    assert totals["decode_steps"] >= 1 and totals["prefill_steps"] >= 2  # the warm-up's, then the readiness check's


def test_engine_serve_refuses_warm_up_sampling_it_could_not_serve(tmp_path):
    import subprocess
    import sys

    (tmp_path / "config.json").write_text("{}")
    for value, message in (('{"temperature": -1}', "--warm-sampling: sampling_params.temperature: must be 0"),
                           ("{temperature", "--warm-sampling: not JSON")):
        out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "engine", "serve", str(tmp_path),
                              "--load-format", "dummy", "--no-api-key", "--warm-sampling", value],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_stall_report_reads_the_engines_queue_depths(engine_url, engine_key):
    from posttrain.core.watchdog import engine_queue_lines

    [line] = engine_queue_lines([engine_url], engine_key)
    assert line.startswith(f"engine {engine_url}: {{") and "'num_running_reqs': 0" in line
    assert "'num_waiting_reqs': 0" in line
