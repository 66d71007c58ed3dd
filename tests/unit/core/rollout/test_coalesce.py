"""``CoalescingEngine``: the /generate calls of one event-loop turn go out as one request, each caller gets
its own rows (seeds kept row by row), cancellation and refusals stay per caller; and on the real local
engine a coalesced seeded rollout draws exactly the tokens of one request per group."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from posttrain.core.rollout.client import EngineClient, EngineRequestError
from posttrain.core.rollout.coalesce import CoalescingEngine
from posttrain.core.types import Sample, SamplingParams
from posttrain.plugins.generators.single_turn import SingleTurn

from tests.conftest import ROOT


class FakeClient:
    """Answers /generate row by row with the row's prompt and seed; records every body it got."""

    def __init__(self, hold: asyncio.Event | None = None, refuse_prompt: int | None = None):
        self.bodies: list[dict] = []
        self.hold, self.refuse_prompt = hold, refuse_prompt
        self.cancelled = self.encoded = 0
        self.base_url = "http://fake"

    async def request(self, method, path, payload=None):
        if isinstance(payload, bytes):  # a merged body, encoded once
            payload = json.loads(payload)
            self.encoded += 1
        self.bodies.append(payload)
        try:
            if self.hold is not None:
                await self.hold.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        ids = payload["input_ids"]
        batched = isinstance(ids[0], list)
        rows = ids if batched else [ids]
        if self.refuse_prompt is not None and any(r[0] == self.refuse_prompt for r in rows):
            raise EngineRequestError(path, 400, "bad prompt")
        sp = payload.get("sampling_params") or {}
        outs = []
        for j, row in enumerate(rows):
            s = sp[j] if isinstance(sp, list) else sp
            seed = s.get("sampling_seed")
            if seed is not None and batched and not isinstance(sp, list):
                seed += j  # the local engine's rule for a shared seeded dict
            outs.append({"prompt": row, "seed": seed, "logprob": payload.get("return_logprob")})
        return outs if batched else outs[0]

    async def get_model_info(self):
        return {"model_path": "x"}


def body(prompt, n=1, seed=None, **extra):
    sp = {"max_new_tokens": 1, **({"sampling_seed": seed} if seed is not None else {})}
    ids = [[prompt, 1]] * n if n > 1 else [prompt, 1]
    return {"input_ids": ids, "sampling_params": sp, "return_logprob": True, **extra}


async def test_requests_of_one_turn_go_as_one_and_each_caller_gets_its_rows_and_seeds():
    fake = FakeClient()
    engine = CoalescingEngine(fake, max_rows=64, seed_rows=True)
    outs = await asyncio.gather(engine.request("POST", "/generate", body(10, n=3, seed=100)),
                                engine.request("POST", "/generate", body(20, n=2, seed=500)),
                                engine.request("POST", "/generate", body(30, seed=7)))
    assert len(fake.bodies) == 1 and engine.merged == 1 and engine.parts == 3
    sent = fake.bodies[0]
    assert [r[0] for r in sent["input_ids"]] == [10, 10, 10, 20, 20, 30]
    assert [s["sampling_seed"] for s in sent["sampling_params"]] == [100, 101, 102, 500, 501, 7]
    assert [o["seed"] for o in outs[0]] == [100, 101, 102] and [o["seed"] for o in outs[1]] == [500, 501]
    assert isinstance(outs[2], dict) and outs[2]["seed"] == 7 and outs[2]["prompt"] == [30, 1]
    assert all(o["prompt"][0] == 10 for o in outs[0]) and all(o["prompt"][0] == 20 for o in outs[1])


async def test_a_merged_body_goes_encoded_unless_a_float_is_not_finite():
    fake = FakeClient()
    engine = CoalescingEngine(fake, max_rows=64, seed_rows=True)
    await asyncio.gather(*[engine.request("POST", "/generate", body(i, n=2, seed=i)) for i in range(3)])
    assert fake.encoded == 1
    nan = body(9, n=2)
    nan["sampling_params"]["temperature"] = float("nan")
    await asyncio.gather(engine.request("POST", "/generate", nan), engine.request("POST", "/generate", body(8)))
    assert fake.encoded == 1 and math.isnan(fake.bodies[-1]["sampling_params"][0]["temperature"])  # as made


async def test_shared_unseeded_params_stay_one_dict_and_other_fields_keep_requests_apart():
    fake = FakeClient()
    engine = CoalescingEngine(fake, max_rows=64)
    a, b, c = await asyncio.gather(engine.request("POST", "/generate", body(1, n=2)),
                                   engine.request("POST", "/generate", body(2, n=2)),
                                   engine.request("POST", "/generate", body(3, n=2, return_logprob=False)))
    assert len(fake.bodies) == 2
    merged = next(b for b in fake.bodies if len(b["input_ids"]) == 4)
    assert merged["sampling_params"] == {"max_new_tokens": 1}  # one dict, not one per row
    assert [o["logprob"] for o in c] == [False, False] and [o["logprob"] for o in a + b] == [True] * 4


async def test_what_cannot_merge_goes_exactly_as_it_was_made():
    fake = FakeClient()
    engine = CoalescingEngine(fake, max_rows=64, seed_rows=False)
    alone = [body(1, n=2, seed=9),  # a shared seed, engines that do not seed by row: their own rule
             {**body(2), "rid": "r2"}, {"text": "hi", "sampling_params": {}}]
    lone = body(3, n=2)
    fake_text = asyncio.ensure_future(engine.request("POST", "/generate", alone[2]))
    fake_text.cancel()  # the fake cannot answer text; only what was sent matters
    await asyncio.gather(*[engine.request("POST", "/generate", b) for b in alone[:2]], return_exceptions=True)
    await engine.request("POST", "/generate", lone)
    assert fake.bodies[:2] == alone[:2] and fake.bodies[-1] is lone  # unchanged, one request each
    assert engine.merged == 0


async def test_max_rows_splits_the_turn_into_several_requests():
    fake = FakeClient()
    engine = CoalescingEngine(fake, max_rows=4)
    outs = await asyncio.gather(*[engine.request("POST", "/generate", body(i, n=2)) for i in range(5)])
    assert [len(b["input_ids"]) for b in fake.bodies] == [4, 4, 2]
    assert [o[0]["prompt"][0] for o in outs] == list(range(5))


async def test_a_cancelled_caller_leaves_the_others_and_the_last_one_cancels_the_request():
    hold = asyncio.Event()
    fake = FakeClient(hold)
    engine = CoalescingEngine(fake, max_rows=64)
    a = asyncio.ensure_future(engine.request("POST", "/generate", body(1, n=2)))
    b = asyncio.ensure_future(engine.request("POST", "/generate", body(2, n=2)))
    await asyncio.sleep(0.01)
    a.cancel()
    await asyncio.sleep(0.01)
    assert fake.cancelled == 0  # b still waits on it
    hold.set()
    assert [o["prompt"][0] for o in await b] == [2, 2] and a.cancelled()

    hold.clear()
    c = asyncio.ensure_future(engine.request("POST", "/generate", body(3, n=2)))
    d = asyncio.ensure_future(engine.request("POST", "/generate", body(4, n=2)))
    await asyncio.sleep(0.01)
    c.cancel()
    d.cancel()
    await asyncio.sleep(0.01)
    assert fake.cancelled == 1  # every caller gone: the merged request is cancelled (the engine aborts it)


async def test_a_merged_request_cancelled_from_outside_cancels_its_callers():
    hold = asyncio.Event()
    engine = CoalescingEngine(FakeClient(hold), max_rows=64)
    callers = [asyncio.ensure_future(engine.request("POST", "/generate", body(i, n=2))) for i in range(2)]
    await asyncio.sleep(0.01)
    [task] = engine._tasks
    task.cancel()
    done = await asyncio.wait_for(asyncio.gather(*callers, return_exceptions=True), 2.0)  # not left waiting
    assert all(isinstance(d, asyncio.CancelledError) for d in done)


async def test_a_refused_part_fails_alone():
    fake = FakeClient(refuse_prompt=2)
    engine = CoalescingEngine(fake, max_rows=64)
    a, b = await asyncio.gather(engine.request("POST", "/generate", body(1, n=2)),
                                engine.request("POST", "/generate", body(2, n=2)), return_exceptions=True)
    assert [o["prompt"][0] for o in a] == [1, 1]
    assert isinstance(b, EngineRequestError) and b.status == 400


async def test_other_calls_pass_through():
    engine = CoalescingEngine(FakeClient(), max_rows=8)
    assert await engine.get_model_info() == {"model_path": "x"} and engine.base_url == "http://fake"
    with pytest.raises(ValueError):
        CoalescingEngine(FakeClient(), max_rows=0)


async def test_coalesced_seeded_groups_draw_the_tokens_of_one_request_per_group(engine_url, engine_key):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3, seed=11, seed_rows=True)
    generator = SingleTurn()

    def groups():
        return [[Sample(prompt=f"{a}+{b}=", index=4 * (3 * a + b) + j, group_index=3 * a + b) for j in range(4)]
                for a in range(3) for b in range(3)]

    async with EngineClient(engine_url, api_key=engine_key) as client:
        plain = await asyncio.gather(*[generator(g, client, sampling) for g in groups()])
        engine = CoalescingEngine(client, max_rows=64, seed_rows=True)
        merged = await asyncio.gather(*[generator(g, engine, sampling) for g in groups()])
    assert engine.merged == 1 and engine.parts == 9
    for g0, g1 in zip(plain, merged):
        assert [s.tokens for s in g0] == [s.tokens for s in g1]
        for s0, s1 in zip(g0, g1):
            assert s0.rollout_log_probs == pytest.approx(s1.rollout_log_probs, abs=1e-5)


def test_the_quickstart_coalesces_on_an_engine_that_seeds_by_row():
    from posttrain.core.config import load_config
    from posttrain.core.plugins import load_plugins

    plugins = load_plugins(autoload=False)
    cfg = load_config(ROOT / "examples" / "quickstart.yaml", [], plugins)
    assert cfg.rollout.coalesce_rows == 2048 and cfg.rollout.seeds_batch_rows
    assert cfg.rollout.sampling_params(seed=0).seed_rows
    off = load_config(ROOT / "examples" / "quickstart.yaml", ["rollout.coalesce_rows=0"], plugins)
    assert off.rollout.coalesce_rows == 0
