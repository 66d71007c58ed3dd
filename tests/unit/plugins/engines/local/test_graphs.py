"""The decode step's CUDA graph bookkeeping (``posttrain.plugins.engines.local.graphs``): which graphs a step
captures. On CPU the capture itself is replaced by one that records its key (a CUDA graph needs CUDA); the
keys come from the runner's own ``_bucket`` and ``_span``. The captures themselves run in the GPU tests
(``test_sampling_kernel.py``, ``test_decode_variants.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from posttrain.plugins.engines.local import graphs
from posttrain.plugins.engines.local.model_runner import ModelRunner, RunnerTuning


class _Graph:
    def replay(self):
        pass


def _runner(max_slots: int, compiled: bool = False):
    runner = SimpleNamespace(max_slots=max_slots, context_length=600, _graphs={}, _warmed=set(), compile=compiled)
    runner._bucket = ModelRunner._bucket.__get__(runner)
    runner._span = ModelRunner._span.__get__(runner)
    return runner


@pytest.fixture
def captured(monkeypatch):
    keys = []

    def capture(runner, bucket, span, temperature=None):
        keys.append((bucket, span, temperature))
        static = {"tokens": torch.zeros(bucket, dtype=torch.long), "positions": torch.zeros(bucket, dtype=torch.long),
                  "logits": torch.zeros(bucket, 3), "routing": None}
        if temperature is not None:
            static.update(sampled=torch.zeros(bucket, dtype=torch.long), logprobs=torch.zeros(bucket),
                          packed=torch.zeros(2, bucket, dtype=torch.float64))
        runner._graphs[(bucket, span, temperature)] = (_Graph(), static)

    monkeypatch.setattr(graphs, "capture", capture)
    return keys


def _step(runner, rows: int, need: int, temperature=None):
    ids = torch.zeros(rows, dtype=torch.long)
    return graphs.replay(runner, ids, ids.clone(), need, temperature)


def test_buckets_are_the_runners_own_largest_first():
    assert graphs.buckets(_runner(12)) == [12, 8, 4, 2, 1]
    assert graphs.buckets(_runner(8)) == [8, 4, 2, 1]
    assert graphs.buckets(_runner(1)) == [1]
    for compiled in (False, True):
        runner = _runner(12, compiled)
        assert sorted({runner._bucket(n) for n in range(1, 13)}, reverse=True) == graphs.buckets(runner)


def test_a_compiled_runner_has_no_bucket_of_one_row():
    """Dynamo compiles a size-1 batch apart from every other size: a compiled runner pads one row to two."""
    assert graphs.buckets(_runner(12, compiled=True)) == [12, 8, 4, 2]
    assert graphs.buckets(_runner(1, compiled=True)) == [1]  # one slot: nothing to pad into
    runner = _runner(12, compiled=True)
    assert [runner._bucket(n) for n in (1, 2, 3, 9, 12)] == [2, 2, 4, 12, 12]


def test_warm_graphs_of_a_compiled_runner_skip_the_one_row_bucket(captured):
    runner = _runner(12, compiled=True)
    (sampled, logprobs, both), _ = _step(runner, 1, 10, temperature=1.0)
    assert captured == [(12, 256, 1.0), (8, 256, 1.0), (4, 256, 1.0), (2, 256, 1.0)]
    assert sampled.shape == logprobs.shape == (1,) and both.shape == (2, 1)  # the one real row of bucket 2


def test_the_first_step_at_a_temperature_captures_every_bucket(captured):
    runner = _runner(12)
    logits, _ = _step(runner, 5, 10)
    assert logits.shape == (5, 3)
    assert captured == [(12, 256, None), (8, 256, None), (4, 256, None), (2, 256, None), (1, 256, None)]
    _step(runner, 3, 10)  # a smaller batch at that span: captured already
    assert len(captured) == 5
    _step(runner, 3, 300)  # another span: that bucket alone (its kernels compiled by then)
    assert captured[5:] == [(4, 512, None)]
    _step(runner, 7, 10, temperature=1.0)  # a temperature met for the first time: every bucket again
    assert captured[6:] == [(12, 256, 1.0), (8, 256, 1.0), (4, 256, 1.0), (2, 256, 1.0), (1, 256, 1.0)]
    assert runner._warmed == {None, 1.0}


@pytest.fixture
def short_of_memory(monkeypatch, captured):
    """Captures of the buckets in ``full`` run out of GPU memory (the rest record their keys, as ``captured``)."""
    full = set()
    record = graphs.capture

    def capture(runner, bucket, span, temperature=None):
        if bucket in full:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory capturing {bucket} slots")
        record(runner, bucket, span, temperature)

    monkeypatch.setattr(graphs, "capture", capture)
    return full


def test_warm_captures_skip_other_buckets_that_run_out_of_memory(short_of_memory, captured, capsys):
    runner = _runner(12)
    short_of_memory.update({12, 8, 1})
    logits, _ = _step(runner, 3, 10)  # bucket 4: the step runs; 12, 8 and 1 skipped with a line each
    assert logits.shape == (3, 3)
    assert captured == [(4, 256, None), (2, 256, None)]
    err = capsys.readouterr().err
    assert "skipped the warm capture of the decode graph of 12 slots x 256 positions: out of GPU memory" in err
    assert "of 8 slots" in err and "of 1 slots" in err
    short_of_memory.clear()  # memory freed later: a step of 7 rows captures bucket 8 then
    _step(runner, 7, 10)
    assert captured[2:] == [(8, 256, None)]


def test_out_of_memory_at_the_steps_own_bucket_is_raised(short_of_memory, captured):
    runner = _runner(12)
    short_of_memory.update({12, 8, 4})
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _step(runner, 3, 10)  # its own bucket (4) cannot be captured: the step fails, as a lazy capture would
    assert captured == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_warm_up_that_runs_out_of_memory_puts_the_cache_and_step_buffers_back(tiny_ckpt, monkeypatch):
    """On CUDA: a capture whose warm-up runs out of memory after it wrote K/V at position 0 of slots
    0 .. bucket-1 (where requests in flight may live) puts those rows and the step buffers back before raising."""
    runner = ModelRunner(tiny_ckpt, device="cuda", dtype="float32", max_slots=4, context_length=64, tuning=RunnerTuning(decode_attention="triton", cuda_graphs=True))
    runner.prefill([0, 1], [[5, 6, 7], [8, 9]])
    runner.step_tokens[:4] = torch.tensor([20, 21, 22, 23], device="cuda")
    runner.step_positions[:4] = torch.tensor([3, 2, 9, 9], device="cuda")
    before = [t.clone() for t in (runner.k_cache, runner.v_cache, runner.step_tokens, runner.step_positions)]
    real, calls = runner._decode_eager, []

    def decode_then_fail(*args):
        calls.append(1)
        out = real(*args)  # writes the warm-up's K/V at position 0 of slots 0..3
        if len(calls) == 2:
            torch.cuda.synchronize()
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return out

    monkeypatch.setattr(runner, "_decode_eager", decode_then_fail)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        graphs.capture(runner, 4, 64, 0.0)  # greedy: the warm-up's draws also overwrite the step's tokens
    torch.cuda.synchronize()
    after = (runner.k_cache, runner.v_cache, runner.step_tokens, runner.step_positions)
    for name, a, b in zip(("k_cache", "v_cache", "step_tokens", "step_positions"), before, after):
        assert torch.equal(a, b), name
    assert (4, 64, 0.0) not in runner._graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_captures_leave_the_step_and_the_cache_as_they_were(tiny_ckpt):
    """On CUDA: the first graphed step at a temperature captures every bucket (each capture's warm-up runs for
    real over slots 0 .. bucket-1 and puts back what it overwrote), and its draws and the smaller batch's after
    it equal those of a runner capturing each bucket at its first step (its temperature marked warmed already)."""
    kw = dict(device="cuda", dtype="bfloat16", max_slots=8, context_length=64,
              tuning=RunnerTuning(decode_attention="triton", cuda_graphs=True))
    lazy, graphed = ModelRunner(tiny_ckpt, **kw), ModelRunner(tiny_ckpt, **kw)
    lazy._warmed.add(0.0)
    prompts = [[5 + i, 6, 7] for i in range(6)]
    tokens, positions = torch.arange(20, 26, device="cuda"), torch.full((6,), 3, device="cuda")
    draws = []
    for r in (lazy, graphed):
        r.prefill(list(range(6)), prompts)
        first = r.decode_sampled(tokens, positions, 0.0, 3)[0].clone()
        second = r.decode_sampled(first[:3], positions[:3] + 1, 0.0, 4)[0].clone()  # bucket 4, captured already
        draws.append((first, second))
    assert {k[0] for k in graphed._graphs if k[2] == 0.0} == {8, 4, 2, 1} and graphed._warmed == {0.0}
    assert {k[0] for k in lazy._graphs} == {8, 4}
    assert graphed.graph_totals["graph_captures"] == 4 and graphed.graph_totals["graph_capture_s"] > 0
    for a, b in zip(*draws):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_compiled_graphed_step_of_one_row_runs_in_the_two_row_graph(tiny_ckpt):
    """On CUDA, compiled: the warm captures stop at two rows, and a step of one row (padded to two) gives the
    eager step's logits for it (the pad row writes position 0 of slot 1, idle in an engine's step)."""
    kw = {"device": "cuda", "dtype": "float32", "max_slots": 8, "context_length": 64}
    eager = ModelRunner(tiny_ckpt, **kw, tuning=RunnerTuning(decode_attention="triton"))
    graphed = ModelRunner(tiny_ckpt, **kw, tuning=RunnerTuning(decode_attention="triton", cuda_graphs=True, compile=True))
    for r in (eager, graphed):
        r.prefill([0, 1], [[5, 6, 7], [8, 9]])
    tokens, positions = torch.tensor([20, 21], device="cuda"), torch.tensor([3, 2], device="cuda")
    torch.testing.assert_close(graphed.decode(tokens, positions, 3), eager.decode(tokens, positions), atol=1e-4,
                               rtol=1e-4)
    one = graphed.decode(tokens[:1], positions[:1] + 1, 4)  # slot 0 alone
    torch.testing.assert_close(one, eager.decode(tokens[:1], positions[:1] + 1), atol=1e-4, rtol=1e-4)
    assert one.shape[0] == 1 and {k[0] for k in graphed._graphs} == {8, 4, 2}
