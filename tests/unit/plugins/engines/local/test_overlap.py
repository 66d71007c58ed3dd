"""The overlapped scheduler (``BatchEngine(overlap=True)``, the GPU default) gives the answers of the
synchronous one: step N + 1 is launched from the device-side tokens before step N lands, requests that
reach their length are not launched again, and a request that stops on a token drops the token its
extra step drew. On a CPU the ops run eagerly, so the same code path runs here, in order."""

from __future__ import annotations

import threading

import pytest

from posttrain.plugins.engines.local.engine import BatchEngine
from posttrain.plugins.engines.local.model_runner import ModelRunner
from posttrain.plugins.engines.local.sampling import RequestSampling

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17], [18, 19, 20], [21, 22], [23], [24, 25, 26]]


def generate(runner, requests, overlap: bool, abort_after: str | None = None):
    """Submit ``requests`` (``(prompt, sampling)``) at once to a fresh engine; return the answers in order
    and the engine's step stats. ``abort_after``: abort that request id once the first answer is in."""
    engine = BatchEngine(runner, None, [0], overlap=overlap)
    outs, done = [None] * len(requests), threading.Semaphore(0)

    def on_done(i):
        def f(out):
            outs[i] = out
            if abort_after is not None:
                engine.abort(abort_after)
            done.release()
        return f

    try:
        engine.pause(mode="in_place")  # admitted the same way in both modes
        for i, (prompt, sampling) in enumerate(requests):
            engine.submit(prompt, sampling, True, on_done(i), rid=f"r{i}")
        engine.resume()
        for _ in requests:
            assert done.acquire(timeout=60)
        stats = engine.call_in_engine(engine.stats.summary)
    finally:
        engine.shutdown()
    return outs, stats


def answers(outs):
    """Tokens and finish reasons (exact), and log-probs (a step's batch may hold one extra row in overlap
    mode, which moves float32 matmul rounding in the last digits)."""
    return [(o["output_ids"], o["meta_info"]["finish_reason"]) for o in outs]


def assert_same(over, sync):
    assert answers(over) == answers(sync)
    for a, b in zip(over, sync):
        lp = [[x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in (a, b)]
        assert lp[0] == pytest.approx(lp[1], abs=1e-5)


@pytest.fixture(scope="module")
def runner(tiny_ckpt):
    # fewer slots than requests: later ones are admitted into slots freed while a step is in flight
    return ModelRunner(tiny_ckpt, max_slots=3, context_length=24)


def mixed_requests(vocab: int):
    """Greedy and seeded rows; lengths, a stop token that some rows hit, and a context end."""
    out = []
    for i, p in enumerate(PROMPTS):
        sampling = RequestSampling(max_new_tokens=3 + 2 * (i % 4), temperature=0.0 if i % 2 else 0.9,
                                   sampling_seed=None if i % 2 else 100 + i, ignore_eos=True)
        if i % 3 == 0:  # stop on tokens that some step draws (each seeded row draws from the whole vocab)
            sampling.stop_token_ids = list(range(0, vocab, 3))
        out.append((p, sampling))
    out.append(([30] * 20, RequestSampling(max_new_tokens=50, temperature=0.0, ignore_eos=True)))  # the context ends it
    return out


def test_overlap_answers_token_for_token_like_the_synchronous_engine(runner):
    requests = mixed_requests(runner.vocab_size)
    sync, sync_stats = generate(runner, requests, overlap=False)
    over, over_stats = generate(runner, requests, overlap=True)
    assert_same(over, sync)
    kinds = {o["meta_info"]["finish_reason"]["type"] for o in sync}
    assert kinds == {"stop", "length"}  # both ways of ending are exercised
    assert sync[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}  # 20 + 4 = the context
    # every decode step of the synchronous engine ran in the overlapped one; the extra ones are steps
    # launched for rows that had already stopped on a token (at most one per such row)
    stopped = sum(o["meta_info"]["finish_reason"]["type"] == "stop" for o in sync)
    assert sync_stats["decode_steps"] <= over_stats["decode_steps"] <= sync_stats["decode_steps"] + stopped


def test_overlap_launches_no_step_past_a_requests_length(runner):
    """Rows that end by length are never decoded beyond it: the step count equals the synchronous one."""
    requests = [(p, RequestSampling(max_new_tokens=5, temperature=0.0, ignore_eos=True)) for p in PROMPTS[:3]]
    sync, sync_stats = generate(runner, requests, overlap=False)
    over, over_stats = generate(runner, requests, overlap=True)
    assert_same(over, sync)
    assert over_stats["decode_steps"] == sync_stats["decode_steps"] == 4  # 5 tokens: 1 from prefill, 4 decoded


def test_overlap_drops_the_tokens_of_a_request_aborted_in_flight(runner):
    requests = [([5, 6], RequestSampling(max_new_tokens=2, temperature=0.0, ignore_eos=True)),
                ([7, 8], RequestSampling(max_new_tokens=20, temperature=0.0, ignore_eos=True))]
    full, _ = generate(runner, requests, overlap=False)
    outs, _ = generate(runner, requests, overlap=True, abort_after="r1")
    aborted = outs[1]
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    n = len(aborted["output_ids"])
    assert 0 < n < 20 and aborted["output_ids"] == full[1]["output_ids"][:n]
    assert len(aborted["meta_info"]["output_token_logprobs"]) == n


def test_a_call_in_the_engine_lands_the_step_in_flight_first(runner):
    """``call_in_engine`` (weight loads, memory release) runs with no decode step pending on the device."""
    engine = BatchEngine(runner, None, [0], overlap=True)
    seen, done = [], threading.Event()
    try:
        engine.submit([5, 6, 7], RequestSampling(max_new_tokens=12, temperature=0.0, ignore_eos=True), False,
                      lambda out: done.set())
        while not done.is_set():
            seen.append(engine.call_in_engine(lambda: engine._overlap.inflight is None))
        assert done.wait(60)
    finally:
        engine.shutdown()
    assert seen and all(seen)


class GraphLike(ModelRunner):
    """A CPU runner that leaves ``step_positions`` one further after each step, as a CUDA graph's step does."""

    advances_positions = True

    def _decode(self, tokens, positions, max_position, temperature=None):
        out = super()._decode(tokens, positions, max_position, temperature)
        self.step_positions[: self._bucket(tokens.shape[0])].add_(1)
        return out


def test_rows_moving_on_together_copy_no_positions(tiny_ckpt):
    """``device_positions``: a step whose rows all moved on by one since the last (the graph moved them on)
    copies no positions to the device, and the answers stay the synchronous engine's; a row set that
    changes (a request stops launching) copies them again."""
    runner = GraphLike(tiny_ckpt, max_slots=8, context_length=64)
    greedy = RequestSampling(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    lockstep = [(p, greedy) for p in PROMPTS[:4]]
    over, stats = generate(runner, lockstep, overlap=True)
    assert stats["decode_steps"] == 5 and stats["position_copies"] == 1  # the next four found them in place
    sync, _ = generate(ModelRunner(tiny_ckpt, max_slots=8, context_length=64), lockstep, overlap=False)
    assert_same(over, sync)
    staggered = [(p, RequestSampling(temperature=0.0, max_new_tokens=n, ignore_eos=True))
                 for p, n in zip(PROMPTS[:4], (6, 6, 4, 2))]  # the last slots stop first: no holes below busy ones
    over, stats = generate(runner, staggered, overlap=True)
    assert stats["position_copies"] == 3  # the first step, and after each of the two shorter requests' last
    sync, _ = generate(ModelRunner(tiny_ckpt, max_slots=8, context_length=64), staggered, overlap=False)
    assert_same(over, sync)
    staggered = [(p, RequestSampling(temperature=0.0, max_new_tokens=n, ignore_eos=True))
                 for p, n in zip(PROMPTS[:4], (2, 6, 6, 6))]  # slot 0 stops first: its idle row stays at 0
    over, stats = generate(runner, staggered, overlap=True)
    assert stats["position_copies"] == 5  # the graph moved the idle row on: every step copies again
    sync, _ = generate(ModelRunner(tiny_ckpt, max_slots=8, context_length=64), staggered, overlap=False)
    assert_same(over, sync)
    plain = ModelRunner(tiny_ckpt, max_slots=8, context_length=64)  # no graphs: every step copies
    assert not plain.advances_positions
    assert generate(plain, lockstep, overlap=True)[1]["position_copies"] == 5


def test_overlap_reports_the_routed_experts_of_the_tokens_read_and_no_more(tmp_path):
    """A MoE row that stops on a token is decoded once more on the device; its answer still holds one
    routing row per token the model read (prompt + output - 1), equal to the synchronous engine's."""
    import base64

    import numpy as np

    from posttrain.testing.tiny import make_tiny_checkpoint

    moe = ModelRunner(make_tiny_checkpoint(tmp_path / "moe", family="qwen3_moe", seed=3), max_slots=3, context_length=24)
    requests = mixed_requests(moe.vocab_size)[:6]

    def routed(out):
        rows = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
        return rows.reshape(-1, moe.num_layers, moe.moe_top_k)

    results = {}
    for overlap in (False, True):
        engine = BatchEngine(moe, None, [0], overlap=overlap)
        outs, done = [None] * len(requests), threading.Semaphore(0)
        try:
            for i, (prompt, sampling) in enumerate(requests):
                engine.submit(prompt, sampling, True, lambda o, i=i: (outs.__setitem__(i, o), done.release()),
                              return_routed_experts=True)
            for _ in requests:
                assert done.acquire(timeout=60)
        finally:
            engine.shutdown()
        results[overlap] = outs
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in results[True])
    for (prompt, _), a, b in zip(requests, results[True], results[False]):
        assert a["output_ids"] == b["output_ids"]
        assert routed(a).shape[0] == len(prompt) + len(a["output_ids"]) - 1
        assert (routed(a) == routed(b)).all()


def test_a_paused_engine_is_woken_by_resume_not_by_each_submit(runner):
    """Requests queued while paused wait for ``resume()``, which wakes the engine once for all of them (a
    wake per submit hands the GIL to the engine thread and back 256 times in a benchmark's submits)."""

    class CountingEvent(threading.Event):
        sets = 0

        def set(self):
            CountingEvent.sets += 1
            super().set()

    engine = BatchEngine(runner, None, [0], overlap=True)
    answered, done = [], threading.Event()
    try:
        engine.pause(mode="in_place")
        engine._wake = CountingEvent()
        for i, p in enumerate(PROMPTS[:4]):
            engine.submit(p, RequestSampling(max_new_tokens=3, temperature=0.0, ignore_eos=True), False,
                          lambda out: (answered.append(out), len(answered) == 4 and done.set()), rid=f"r{i}")
        assert CountingEvent.sets == 0 and engine.paused
        engine.resume()
        assert done.wait(60)
        assert CountingEvent.sets >= 1 and all(len(o["output_ids"]) == 3 for o in answered)
        engine.submit(PROMPTS[0], RequestSampling(max_new_tokens=1), False, lambda out: None)
        assert CountingEvent.sets >= 2  # a running engine is woken by a submit again
    finally:
        engine.shutdown()


@pytest.mark.parametrize("overlap", [True, False])
def test_answered_requests_are_freed_after_the_answers_not_kept(runner, overlap):
    """The engine holds answered requests past their answers (freeing a batch's token lists holds the GIL, which
    delayed the waiting thread) and drops them at the next step's launch or once idle: none is kept for good."""
    import time
    import weakref

    engine = BatchEngine(runner, None, [0], overlap=overlap)
    refs, held, done = [], [], threading.Event()

    def on_done(out):  # in the engine thread; the three (one per slot) finish in one step
        refs.append(len(out["output_ids"]))
        if len(refs) == 3:
            held.extend(weakref.ref(r) for r in engine._answered)
            done.set()

    try:
        engine.pause(mode="in_place")  # admitted together, so they finish together
        for p in PROMPTS[:3]:
            engine.submit(p, RequestSampling(max_new_tokens=4, temperature=0.0, ignore_eos=True), False, on_done)
        engine.resume()
        assert done.wait(60) and refs == [4, 4, 4]
        assert len(held) == 2, "the requests answered before the last are still held when it is answered"
        deadline = time.monotonic() + 10
        while any(r() is not None for r in held) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(r() is None for r in held), "an answered request was never freed"
    finally:
        engine.shutdown()


def test_rows_submitted_together_are_admitted_in_one_prefill(runner):
    """``submit_many`` (the server's path for a batched ``/generate``): one queue item, so a running engine admits
    all rows in one prefill instead of starting on the first few while the rest arrive."""
    engine = BatchEngine(runner, None, [0], overlap=True)
    outs, done = {}, threading.Event()

    def on_done(i):
        def f(out):
            outs[i] = out
            if len(outs) == 3:
                done.set()
        return f

    try:
        engine.call_in_engine(engine.stats.reset)
        rids = engine.submit_many([(p, RequestSampling(max_new_tokens=2, temperature=0.0, ignore_eos=True), on_done(i),
                                    f"row{i}", -1) for i, p in enumerate(PROMPTS[:3])], return_logprob=True)
        assert rids == ["row0", "row1", "row2"] and done.wait(60)
        stats = engine.call_in_engine(engine.stats.summary)
        assert stats["prefill_steps"] == 1 and all(len(outs[i]["output_ids"]) == 2 for i in range(3))
        assert all(len(outs[i]["meta_info"]["output_token_logprobs"]) == 2 for i in range(3))
    finally:
        engine.shutdown()
