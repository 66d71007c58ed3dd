"""The one-pass sampling kernel (``posttrain.plugins.engines.local.sampling_kernel``) behind
``sample_tokens(..., fused=...)``.

On CPU: ``sample_tokens`` keeps the torch path unless asked (the CPU quickstart's draws are unchanged),
and, where ``triton`` is installed, the kernel under the Triton interpreter: greedy tokens equal torch's
argmax (ties to the first index, across chunks too), log-probs equal ``log_softmax``, each sampled token is
the inverse CDF of ``softmax(z / T)`` at its row's uniform (read back through ``tl.rand``: an exact check, where a
frequency count needed thousands of interpreted rows for a 5% tolerance). On CUDA (``gpu``): the same at the
Qwen3 vocabulary and a decode batch of 256, through ``sample_tokens``' default."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from posttrain.plugins.engines.local import sampling
from posttrain.plugins.engines.local.sampling import parse_sampling, sample_tokens

from tests.conftest import run_triton_interpreted


def test_cpu_tensors_keep_the_torch_path(monkeypatch):
    calls = []
    import posttrain.plugins.engines.local.sampling_kernel as kernel

    monkeypatch.setattr(kernel, "fused_sample", lambda *a, **kw: calls.append(1))
    logits = torch.randn(4, 50)
    tokens, logprobs = sample_tokens(logits, [parse_sampling({"temperature": 0})] * 4)
    assert not calls and torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])
    greedy = [parse_sampling({"temperature": 0})] * 4
    assert sampling.fused_temperature(greedy, None, logits.device) is None
    assert sampling.fused_temperature(greedy, True, logits.device) == 0.0
    hot = [parse_sampling({"temperature": 0.7})] * 4
    assert sampling.fused_temperature(hot, True, "cpu") == 0.7 and sampling.fused_temperature(hot, False, "cuda") is None
    seeded = [parse_sampling({"temperature": 0.7, "sampling_seed": 3})] * 4
    assert sampling.fused_temperature(seeded, True, "cuda") is None  # seeded rows draw from their own seed
    mixed = hot[:2] + [parse_sampling({"temperature": 0.7, "top_p": 0.9})] * 2
    assert sampling.fused_temperature(mixed, True, "cuda") is None


def test_the_kernel_needs_triton_when_it_is_missing():
    import posttrain.plugins.engines.local.sampling_kernel as kernel

    if kernel.triton is None:
        with pytest.raises(RuntimeError, match="triton"):
            kernel.fused_sample(torch.zeros(2, 8), 0.0)
    else:
        with pytest.raises(ValueError, match="unit stride"):
            kernel.fused_sample(torch.zeros(8, 2).t(), 0.0)


INTERPRETED = textwrap.dedent("""
    import torch
    from posttrain.plugins.engines.local import sampling_kernel as sk
    from posttrain.plugins.engines.local.sampling import parse_sampling, sample_tokens
    import triton
    import triton.language as tl


    @triton.jit
    def _uniforms(SEED, OUT, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(OUT + offs, tl.rand(tl.load(SEED), offs), mask=offs < n)


    def uniforms(seed, rows):  # the uniform the kernel draws for each of rows rows under seed: tl.rand(seed, row)
        out = torch.empty(rows)
        _uniforms[(1,)](seed, out, rows, BLOCK=triton.next_power_of_2(rows))
        return out


    def check_draws(tokens, s, u):
        # each row's token is the first v with cumsum(softmax(s))_v > u_row: the inverse CDF, exactly (rows within
        # float32 rounding of a step of the CDF are left out, and there must be few)
        cdf = torch.softmax(s.double(), -1).cumsum(-1)
        want = torch.searchsorted(cdf, u.double(), right=True).clamp(max=len(s) - 1)
        clear = (cdf[None, :] - u.double()[:, None]).abs().min(-1).values > 1e-5
        assert clear.float().mean() > 0.95 and torch.equal(tokens[clear], want[clear]), (tokens, want)

    torch.manual_seed(0)
    # greedy over three chunks of one row (V = 10000 > 2 * BLOCK), ties to the first index, across chunks too
    logits = torch.randn(5, 10000)
    logits[0, 100] = logits[0, 9000] = 50.0  # equal maxima in the first and the last chunk
    logits[1, 7000] = logits[1, 7001] = 60.0  # equal maxima side by side
    logits[2, 9999] = 70.0  # the last entry
    for x in (logits, logits.to(torch.bfloat16)):
        tokens, logprobs = sample_tokens(x, [parse_sampling({"temperature": 0})] * 5, fused=True)
        assert torch.equal(tokens, x.float().argmax(-1)), tokens
        assert tokens[:3].tolist() == [100, 7000, 9999]
        ref = torch.log_softmax(x.float(), -1).gather(1, tokens[:, None])[:, 0]
        torch.testing.assert_close(logprobs, ref, atol=1e-5, rtol=1e-5)
    # chunks of two blocks: ties between a program's two blocks keep the first
    B = 1024
    wide = torch.randn(300, 3 * B + 100)  # 300 rows at 4 programs an SM: two chunks a row, of two blocks each
    wide[0, 10] = wide[0, 10 + B] = 50.0  # one lane, both blocks of one program
    wide[1, 5 + 2 * B] = wide[1, 5 + 3 * B] = 50.0  # the second chunk, its partial second block
    wide[2, -1] = 60.0
    assert sk._chunks(300, wide.shape[1], torch.device("cpu"), B, 4)[1] == 2 * B
    tokens, logprobs = sk.fused_sample(wide, 0.0, block=B, programs_per_sm=4)
    assert torch.equal(tokens, wide.argmax(-1)) and tokens[:3].tolist() == [10, 5 + 2 * B, wide.shape[1] - 1]
    torch.testing.assert_close(logprobs, torch.log_softmax(wide, -1).gather(1, tokens[:, None])[:, 0], atol=1e-5,
                               rtol=1e-5)
    # sampled at T = 0.7: each row's token is the inverse CDF of softmax(z / T) at the row's uniform, its log-prob
    # log_softmax(z / T) there; sample_tokens draws the seed from torch's generator, so re-seeding repeats it
    z = torch.tensor([1.0, 0.2, -1.0, 2.0, 0.0, -3.0, 1.5])
    rows = 256
    torch.manual_seed(3)
    tokens, logprobs = sample_tokens(z.expand(rows, 7).contiguous(), [parse_sampling({"temperature": 0.7})] * rows,
                                     fused=True)
    torch.manual_seed(3)
    check_draws(tokens, z / 0.7, uniforms(torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64), rows))
    assert len(set(tokens.tolist())) >= 5  # the uniforms spread the rows over the likely tokens
    torch.testing.assert_close(logprobs, torch.log_softmax(z / 0.7, -1)[tokens], atol=1e-5, rtol=1e-5)
    # across chunks (three of 1024 a row here), a chunk of no mass between them, -inf never drawn
    sparse = torch.full((3000,), float("-inf"))
    sparse[100], sparse[2900], sparse[2950] = 1.0, 1.5, 0.0  # chunk 1 (1024 .. 2047) holds only -inf
    rows, seed = 96, torch.tensor([99])
    assert sk._chunks(rows, 3000, torch.device("cpu"), 256, 2) == (3, 1024)
    tokens, logprobs = sk.fused_sample(sparse.expand(rows, 3000).contiguous(), 1.0, seed=seed, block=256,
                                       programs_per_sm=2)
    check_draws(tokens, sparse, uniforms(seed, rows))
    assert set(tokens.tolist()) == {100, 2900, 2950}
    torch.testing.assert_close(logprobs, torch.log_softmax(sparse, -1)[tokens], atol=1e-5, rtol=1e-5)
    # the same seed, the same draws; another seed, other draws
    seed, few = torch.tensor([1234]), z.expand(64, 7).contiguous()
    a, b = sk.fused_sample(few, 1.0, seed=seed)[0], sk.fused_sample(few, 1.0, seed=seed)[0]
    c = sk.fused_sample(few, 1.0, seed=seed + 1)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)
    # a logit's uniform depends on (seed, row, index) only: other blocks and chunks, the same draws
    wide_z = torch.randn(64, 300)
    draws = [sk.fused_sample(wide_z, 1.0, seed=seed, block=b, programs_per_sm=p)[0] for b, p in ((16, 64), (512, 1))]
    assert sk._chunks(64, 300, torch.device("cpu"), 16, 64)[0] > 1 and torch.equal(draws[0], draws[1])
    assert len(set(draws[0].tolist())) > 20  # not one token for every row: the rows draw apart
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_under_the_triton_interpreter():
    run_triton_interpreted(INTERPRETED)


# -- on CUDA ---------------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_on_cuda_equals_torch(dtype):
    logits = (torch.randn(256, 151936, device="cuda") * 3).to(dtype)
    logits[0, 5] = logits[0, 150000] = 100.0
    params = [parse_sampling({"temperature": 0})] * 256
    tokens, logprobs = sample_tokens(logits, params)  # the default on CUDA: the kernel
    ref_tokens, ref_logprobs = sample_tokens(logits, params, fused=False)
    assert torch.equal(tokens, ref_tokens) and int(tokens[0]) == 5
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_sampled_on_cuda_follows_the_softmax():
    torch.manual_seed(0)
    z = torch.randn(64, device="cuda") * 2
    rows = 20000
    params = [parse_sampling({"temperature": 1.3})] * rows
    tokens, logprobs = sample_tokens(z.expand(rows, 64).contiguous(), params)
    p = torch.softmax(z / 1.3, -1)
    freq = torch.bincount(tokens, minlength=64).float() / rows
    assert (freq - p).abs().max() < 0.015
    torch.testing.assert_close(logprobs, torch.log_softmax(z / 1.3, -1)[tokens], atol=1e-5, rtol=1e-5)
    torch.manual_seed(1)
    a = sample_tokens(z.expand(rows, 64).contiguous(), params)[0]
    torch.manual_seed(1)
    assert torch.equal(a, sample_tokens(z.expand(rows, 64).contiguous(), params)[0])  # torch's seed repeats it


@pytest.mark.gpu
@needs_cuda
def test_a_runner_without_float_logits_hands_the_kernel_bf16(tiny_ckpt):
    """``float_logits=False`` (the engine server's choice on a GPU): the graphed decode step returns the
    model's bf16 logits, whose float32 upcast is the float32 runner's output, and the kernel samples
    them to the same tokens and log-probs."""
    from posttrain.plugins.engines.local.model_runner import ModelRunner, RunnerTuning

    runners = [ModelRunner(tiny_ckpt, device="cuda", dtype="bfloat16", max_slots=4, context_length=64, tuning=RunnerTuning(cuda_graphs=True, decode_attention="triton", float_logits=f)) for f in (True, False)]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    outs = []
    for r in runners:
        r.prefill([0, 1, 2], prompts)
        outs.append(r.decode(torch.tensor([3, 4, 5], device="cuda"), torch.tensor([3, 2, 4], device="cuda"), 4).clone())
    assert outs[0].dtype == torch.float32 and outs[1].dtype == torch.bfloat16
    assert torch.equal(outs[1].float(), outs[0])
    params = [parse_sampling({"temperature": 0})] * 3
    a, b = sample_tokens(outs[0], params), sample_tokens(outs[1], params)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# -- sampling inside the runner's step (ModelRunner.decode_sampled, the overlapped engine's uniform batches) ---
IN_STEP = textwrap.dedent("""
    import sys, threading
    import torch
    from posttrain.plugins.engines.local.engine import BatchEngine
    from posttrain.plugins.engines.local.model_runner import ModelRunner, RunnerTuning
    from posttrain.plugins.engines.local.sampling import RequestSampling

    torch.set_num_threads(1)
    runner = ModelRunner(sys.argv[1], max_slots=4, context_length=32)
    runner.prefill([0, 2], [[5, 6, 7], [8, 9]])
    tokens, positions = torch.tensor([3, 0, 4]), torch.tensor([3, 0, 2])
    logits = runner.decode(tokens, positions).clone()
    runner.prefill([0, 2], [[5, 6, 7], [8, 9]])  # the same cache again: the step rewrites position 3 / 2
    drawn, logprobs = runner.decode_sampled(tokens, positions, 0.0)
    assert torch.equal(drawn, logits.argmax(-1)), (drawn, logits.argmax(-1))
    ref = torch.log_softmax(logits, -1).gather(1, drawn[:, None])[:, 0]
    torch.testing.assert_close(logprobs, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(runner.step_tokens[:3], drawn)  # left in place as the next step's input
    runner.prefill([0, 2], [[5, 6, 7], [8, 9]])
    runner.step_tokens[:3], runner.step_positions[:3] = tokens, positions
    both = runner.decode_sampled(runner.step_tokens[:3], runner.step_positions[:3], 0.0, packed=True)
    assert both.dtype == torch.float64 and both.shape == (2, 3) and torch.equal(both[0].long(), drawn)
    torch.testing.assert_close(both[1].float(), ref, atol=1e-5, rtol=1e-5)

    def run(overlap, fused):  # greedy answers of the engine, and how often the runner sampled in its step
        calls, real = [], runner.decode_sampled
        runner.decode_sampled = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        engine = BatchEngine(runner, None, [0], overlap=overlap, fused_sampling=fused)
        outs, done = [], threading.Semaphore(0)
        try:
            engine.pause(mode="in_place")
            for i, p in enumerate([[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]]):
                s = RequestSampling(max_new_tokens=3 + i, temperature=0.0, ignore_eos=True)
                engine.submit(p, s, True, lambda o: (outs.append(o), done.release()), rid=f"r{i}")
            engine.resume()
            for _ in range(4):
                assert done.acquire(timeout=120)
        finally:
            engine.shutdown()
            runner.decode_sampled = real
        got = sorted((o["meta_info"]["id"], o["output_ids"], [x[0] for x in o["meta_info"]["output_token_logprobs"]])
                     for o in outs)
        return got, len(calls)

    (base, n0), (fused, n1) = run(False, False), run(True, True)
    assert n0 == 0 and n1 > 0, (n0, n1)
    for a, b in zip(base, fused):
        assert a[:2] == b[:2], (a, b)
        assert max(abs(x - y) for x, y in zip(a[2], b[2])) < 1e-4
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_in_step_sampling_under_the_triton_interpreter(tiny_ckpt):
    """``decode_sampled`` at temperature 0 is the argmax of ``decode``'s logits with their log-softmax, and
    the overlapped engine, which samples uniform batches through it, answers as the synchronous engine
    with torch's sampler does (ids and log-probs)."""
    run_triton_interpreted(IN_STEP, str(tiny_ckpt))


@pytest.mark.gpu
@needs_cuda
def test_graphed_in_step_sampling_on_cuda(tiny_ckpt):
    """Inside a CUDA graph: greedy draws equal the logits graph's argmax, one graph per temperature; at
    temperature 1 a replay draws new noise (the graph advances torch's generator), and the seed repeats."""
    from posttrain.plugins.engines.local.model_runner import ModelRunner, RunnerTuning

    r = ModelRunner(tiny_ckpt, device="cuda", dtype="bfloat16", max_slots=8, context_length=64,
                    tuning=RunnerTuning(cuda_graphs=True, decode_attention="triton"))
    r._warmed.update({None, 0.0})  # marked warmed: a bucket captured mid-run, below
    r.prefill(list(range(6)), [[5 + i, 6, 7] for i in range(6)])
    tokens, positions = torch.arange(20, 26, device="cuda"), torch.full((6,), 3, device="cuda")
    logits = r.decode(tokens, positions, 3).float().clone()
    drawn, logprobs = r.decode_sampled(tokens, positions, 0.0, 3)
    assert torch.equal(drawn, logits.argmax(-1))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, drawn[:, None])[:, 0], atol=1e-4, rtol=1e-4)
    assert {k[2] for k in r._graphs} == {None, 0.0}
    assert torch.equal(r.step_tokens[:6], drawn)  # the draw, in place as the next step's input
    # the step's own buffers as input (the overlapped engine's call: no copies); a new graph's capture
    # (a batch of 3: bucket 4) puts back the input tokens its warm-up overwrote before the replay reads them
    small = r.decode(tokens[:3], positions[:3], 3).float().argmax(-1)
    r.step_tokens[:3], r.step_positions[:3] = tokens[:3], positions[:3]
    both = r.decode_sampled(r.step_tokens[:3], r.step_positions[:3], 0.0, 3, packed=True)
    assert (4, 64, 0.0) in r._graphs and torch.equal(both[0].long(), small) and both.dtype == torch.float64
    assert torch.equal(r.step_tokens[:3], small)
    r.decode_sampled(tokens, positions, 1.0, 3)  # captures (its warm-up draws from the generator too)
    assert {k[2] for k in r._graphs} == {None, 0.0, 1.0}
    torch.manual_seed(5)
    draws = [r.decode_sampled(tokens, positions, 1.0, 3)[0].clone() for _ in range(8)]
    assert any(not torch.equal(draws[0], d) for d in draws[1:])
    torch.manual_seed(5)  # replays read the generator's state: the seed repeats them
    assert torch.equal(r.decode_sampled(tokens, positions, 1.0, 3)[0], draws[0])
