"""Decode levers of the local engine: ``bmm`` vs ``sdpa`` attention, ``torch.compile`` of the per-layer
decode parts, the sampling fast paths and the engine's step timings, and ``bench/rollout.py --variants``.

Everything runs in float32 on CPU, where the variants must agree to float rounding with each other and
with HF's own forward / greedy ``generate``."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import threading

import pytest
import torch

from posttrain.plugins.engines.local.engine import BatchEngine
from posttrain.plugins.engines.local.model_runner import ModelRunner, RunnerTuning
from posttrain.plugins.engines.local.sampling import (_sample_mixed, parse_sampling, sample_tokens, to_host, uniform_temperature)

from tests.conftest import ROOT

PROMPTS = {0: [5, 6, 7, 8, 9], 2: [10, 11], 3: [12, 13, 14]}  # slot 1 idle: a hole below busy slots


def hf_next_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def decode_steps(runner: ModelRunner, steps: int = 3, hint: bool = True):
    """Prefill ``PROMPTS`` over a cache full of garbage, then ``steps`` greedy decode steps.
    Returns the per-step logits ``[nb, V]`` and each slot's sequence."""
    runner.k_cache.normal_(generator=torch.Generator().manual_seed(3))  # stale entries past every position
    runner.v_cache.normal_(generator=torch.Generator().manual_seed(4))
    logits = runner.prefill(list(PROMPTS), list(PROMPTS.values()))
    seqs = {s: p + [int(logits[i].argmax())] for i, (s, p) in enumerate(PROMPTS.items())}
    outs = []
    nb = max(PROMPTS) + 1
    for _ in range(steps):
        tokens = torch.tensor([seqs[s][-1] if s in seqs else 0 for s in range(nb)])
        positions = torch.tensor([len(seqs[s]) - 1 if s in seqs else 0 for s in range(nb)])
        out = runner.decode(tokens, positions, max_position=int(positions.max()) if hint else None)
        outs.append(out.clone())
        for s in seqs:
            seqs[s].append(int(out[s].argmax()))
    return outs, seqs


@pytest.fixture(scope="module")
def hf(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()


# -- attention variants --------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_bmm_and_sdpa_agree_with_each_other_and_with_hf(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from posttrain.testing.tiny import make_tiny_checkpoint

    torch.set_num_threads(1)
    ckpt = make_tiny_checkpoint(tmp_path / family, family=family, seed=2)
    hf_model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    sdpa_out, seqs = decode_steps(ModelRunner(ckpt, max_slots=4, context_length=64, tuning=RunnerTuning(decode_attention="sdpa")))
    bmm_out, bmm_seqs = decode_steps(ModelRunner(ckpt, max_slots=4, context_length=64, tuning=RunnerTuning(decode_attention="bmm")))
    assert bmm_seqs == seqs
    for a, b in zip(sdpa_out, bmm_out):
        for s in PROMPTS:
            torch.testing.assert_close(a[s], b[s], atol=1e-5, rtol=1e-5)
    for step, out in enumerate(bmm_out):
        for s in PROMPTS:
            ids = seqs[s][: len(PROMPTS[s]) + 1 + step]  # the tokens fed up to this step
            torch.testing.assert_close(out[s], hf_next_logits(hf_model, ids), atol=1e-4, rtol=1e-4)


def test_bmm_full_span_equals_the_tight_span(tiny_ckpt):
    """CUDA graphs attend over a fixed span; stale cache entries past each position must not matter."""
    r = ModelRunner(tiny_ckpt, max_slots=4, context_length=64, tuning=RunnerTuning(decode_attention="bmm"))
    r.k_cache.normal_()
    r.v_cache.normal_()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    tokens, positions = torch.tensor([20, 21]), torch.tensor([3, 5])
    r.prefill([0, 1], prompts)
    tight = r._decode_eager(tokens, positions, span=6)
    r.prefill([0, 1], prompts)
    full = r._decode_eager(tokens, positions, span=r.context_length)
    torch.testing.assert_close(tight, full, atol=1e-5, rtol=1e-5)


def test_bmm_reads_the_cache_in_place(tiny_ckpt):
    """Merging ``nb`` and ``Hkv`` of the sliced cache must be a view, not a per-layer copy of the cache."""
    r = ModelRunner(tiny_ckpt, max_slots=4, context_length=64, tuning=RunnerTuning(decode_attention="bmm"))
    k = r.k_cache[0, :3, :, :10]
    merged = k.reshape(3 * r.num_kv_heads, 10, r.head_dim)
    assert merged.data_ptr() == k.data_ptr() and merged._base is not None


def test_max_position_hint_changes_nothing(tiny_ckpt):
    a, _ = decode_steps(ModelRunner(tiny_ckpt, max_slots=4, context_length=64), hint=True)
    b, _ = decode_steps(ModelRunner(tiny_ckpt, max_slots=4, context_length=64), hint=False)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_bad_lever_values_are_rejected(tiny_ckpt):
    with pytest.raises(ValueError, match="decode_attention"):
        ModelRunner(tiny_ckpt, max_slots=2, context_length=32, tuning=RunnerTuning(decode_attention="flash"))
    with pytest.raises(ValueError, match="compile_mode"):
        ModelRunner(tiny_ckpt, max_slots=2, context_length=32, tuning=RunnerTuning(compile=True, compile_mode="fast"))
    with pytest.raises(ValueError, match="attention_launch: unknown keys \\['stages'\\]"):
        ModelRunner(tiny_ckpt, max_slots=2, context_length=32, tuning=RunnerTuning(attention_launch={"stages": 3}))


def test_autotune_mode_leaves_the_prefill_on_the_default_mode(tiny_ckpt):
    """Under max-autotune only the decode step's parts autotune; the prefill compiles its own default-mode
    parts (its timings at thousands of rows cost minutes and chose cuBLAS on an H200). Default mode: shared."""
    tuned = ModelRunner(tiny_ckpt, max_slots=2, context_length=32, tuning=RunnerTuning(compile=True, compile_mode="max-autotune-no-cudagraphs"))
    assert tuned._prefill_parts[0] is not tuned._project  # the first layer's Q/K/V part of the decode step
    plain = ModelRunner(tiny_ckpt, max_slots=2, context_length=32, tuning=RunnerTuning(compile=True))
    assert plain._prefill_parts[0] is plain._project


# -- the engine with each variant against HF generate ----------------------------------------------
def run_engine(runner, prompts, params):
    """Generate for ``prompts`` on a fresh engine; returns the outputs (in order) and the step stats."""
    engine = BatchEngine(runner, None, [0])
    outs, done = [None] * len(prompts), threading.Semaphore(0)
    for i, p in enumerate(prompts):
        engine.submit(p, params, True, lambda o, i=i: (outs.__setitem__(i, o), done.release()))
    for _ in prompts:
        assert done.acquire(timeout=60)
    stats = engine.call_in_engine(engine.stats.summary)
    engine.shutdown()
    return outs, stats


@pytest.mark.parametrize("attention", ["sdpa", "bmm"])
def test_engine_greedy_matches_hf_generate(attention, tiny_ckpt, hf):
    from posttrain.testing.engine import hf_greedy

    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17]]
    runner = ModelRunner(tiny_ckpt, max_slots=4, context_length=64, tuning=RunnerTuning(decode_attention=attention))
    params = parse_sampling({"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    outs, stats = run_engine(runner, prompts, params)
    for p, out in zip(prompts, outs):
        ids = out["output_ids"]
        assert ids == hf_greedy(hf, p, 6)
        with torch.no_grad():
            logits = hf(torch.tensor([p + ids])).logits[0, len(p) - 1:-1]
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert stats["decode_steps"] >= 5 and stats["prefill_steps"] >= 1 and stats["step_ms"] > 0
    assert stats["mean_batch"] > 1


# -- torch.compile ------------------------------------------------------------------------------------
COMPILER_MISSING = ("InvalidCxxCompiler", "CppCompileError", "C++ compiler", "Failed to find C compiler")


def compile_unavailable(device: str = "cpu") -> str | None:
    """Why ``torch.compile`` cannot run here, or ``None``. Only a missing or broken C/C++ compiler
    (Inductor's CPU backend and Triton's launcher need one) counts; any other failure is raised."""
    try:
        torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(4, device=device))
    except Exception as exc:  # inspected, and re-raised unless it is the missing compiler
        text = repr(exc)
        if any(word in text for word in COMPILER_MISSING):
            return f"torch.compile has no working C/C++ compiler here: {text[:200]}"
        raise
    return None


@pytest.mark.parametrize(("attention", "fuse"), [  # one test each: ~10 s of compiling apiece
    ("sdpa", False), ("bmm", False), ("sdpa", True)])
def test_compiled_decode_matches_eager(tiny_ckpt, attention, fuse):
    """Compiled per-layer parts (joined between attentions, with combo kernels) give the eager logits, for both
    attentions, at a power-of-two batch (4 slots) and at a batch padded to its bucket (3 slots -> 4)."""
    reason = compile_unavailable()
    if reason:
        pytest.skip(reason)
    torch.set_num_threads(1)
    eager = ModelRunner(tiny_ckpt, max_slots=4, context_length=64)
    compiled = ModelRunner(tiny_ckpt, max_slots=4, context_length=64,
                           tuning=RunnerTuning(decode_attention=attention, compile=True, fuse_projections=fuse))
    a, seqs_a = decode_steps(eager, steps=2)
    b, seqs_b = decode_steps(compiled, steps=2)
    assert seqs_a == seqs_b
    for x, y in zip(a, b):
        for s in PROMPTS:
            torch.testing.assert_close(x[s], y[s], atol=1e-5, rtol=1e-5)
    # a batch that is not a power of two (3 slots -> bucket 4) goes through the padded path
    tokens, positions = torch.tensor([20, 21, 22]), torch.tensor([6, 3, 4])
    torch.testing.assert_close(compiled.decode(tokens, positions), eager.decode(tokens, positions),
                               atol=1e-5, rtol=1e-5)


# -- on CUDA: the levers inside CUDA graphs, and bf16 ---------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant", ["sdpa", "bmm", "triton", "sdpa+compile", "bmm+compile"])
def test_graphed_variants_equal_eager_sdpa_on_cuda(variant, tiny_ckpt):
    opts = {"decode_attention": variant.split("+")[0], "compile": variant.endswith("+compile")}
    if opts["compile"] and (reason := compile_unavailable("cuda")):
        pytest.skip(reason)
    ref = ModelRunner(tiny_ckpt, device="cuda", dtype="float32", max_slots=8, context_length=300)
    graphed = ModelRunner(tiny_ckpt, device="cuda", dtype="float32", max_slots=8, context_length=300,
                          cuda_graphs=True, **opts)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    for r in (ref, graphed):
        r.prefill([0, 1, 2], prompts)
    tokens = torch.tensor([20, 21, 22], device="cuda")
    positions = torch.tensor([3, 2, 5], device="cuda")
    for step in range(3):  # replays, with positions moving
        a = ref.decode(tokens, positions + step)
        b = graphed.decode(tokens, positions + step, max_position=5 + step)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert graphed._graphs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("attention", ["sdpa", "bmm"])
def test_bf16_graphed_attention_matches_float32(attention, tiny_ckpt):
    """bf16 with CUDA graphs, each attention, against the float32 eager step: log-probs to bf16 precision."""
    ref = ModelRunner(tiny_ckpt, device="cuda", dtype="float32", max_slots=4, context_length=300)
    r = ModelRunner(tiny_ckpt, device="cuda", dtype="bfloat16", max_slots=4, context_length=300, tuning=RunnerTuning(cuda_graphs=True, decode_attention=attention))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 8, [8, 9] * 20]
    for x in (ref, r):
        x.prefill([0, 1], prompts)
    tokens, positions = torch.tensor([20, 21], device="cuda"), torch.tensor([64, 40], device="cuda")
    a = torch.log_softmax(ref.decode(tokens, positions), -1)
    b = torch.log_softmax(r.decode(tokens, positions), -1)
    torch.testing.assert_close(a, b, atol=5e-2, rtol=0)


# -- sampling fast paths ------------------------------------------------------------------------------
def test_uniform_temperature_decides_the_path_from_python_params():
    g, t1, t7 = parse_sampling({"temperature": 0}), parse_sampling({}), parse_sampling({"temperature": 0.7})
    assert uniform_temperature([g, parse_sampling({"top_k": 1})]) == 0.0
    assert uniform_temperature([t7, t7]) == 0.7
    assert uniform_temperature([t1, t7]) is None
    assert uniform_temperature([g, t1]) is None
    assert uniform_temperature([parse_sampling({"top_p": 0.9})]) is None
    assert uniform_temperature([parse_sampling({"min_p": 0.1})]) is None
    assert uniform_temperature([]) is None


@contextlib.contextmanager
def no_host_reads():
    """Make any tensor-value-to-Python conversion (``bool(t)``, ``t.item()``, ``t.tolist()``) fail: on a
    GPU each is a device-to-host sync."""
    def refuse(*_a, **_k):
        raise AssertionError("the fast path read a tensor value on the host")

    with pytest.MonkeyPatch.context() as mp:
        for name in ("__bool__", "item", "tolist"):
            mp.setattr(torch.Tensor, name, refuse)
        yield


def test_fast_paths_read_nothing_back_and_match_the_general_path():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    greedy = [parse_sampling({"temperature": 0})] * 8
    with no_host_reads():
        tokens, lps = sample_tokens(logits, greedy)
    ref_tokens, ref_lps = _sample_mixed(logits, greedy, None)  # all rows greedy: where() picks argmax
    assert torch.equal(tokens, logits.argmax(-1)) and torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(lps, ref_lps, atol=0, rtol=0)

    hot = [parse_sampling({"temperature": 0.7})] * 8
    torch.manual_seed(5)
    with no_host_reads():
        tokens, lps = sample_tokens(logits, hot)
    torch.manual_seed(5)
    ref_tokens, ref_lps = _sample_mixed(logits, hot, None)
    assert torch.equal(tokens, ref_tokens)  # the same draws from the same RNG state
    torch.testing.assert_close(lps, ref_lps, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lps, torch.log_softmax(logits / 0.7, -1).gather(1, tokens[:, None]).squeeze(1))


def test_seeded_rows_at_one_temperature_take_the_seeded_path():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1)).repeat(2, 1)
    p = [parse_sampling({"temperature": 0.9, "sampling_seed": 3})] * 2
    a = [sample_tokens(logits, p, [step, step])[0].tolist() for step in range(5)]
    torch.manual_seed(123)  # the global RNG plays no part
    b = [sample_tokens(logits, p, [step, step])[0].tolist() for step in range(5)]
    assert a == b and all(x == y for x, y in a)  # same seed, logits and step: same token in both rows


def test_to_host_is_exact_for_large_ids_and_float32_logprobs():
    tokens = torch.tensor([0, 151935, 2**31 + 7])
    lps = torch.tensor([-0.1, -12.345678, -1e-8], dtype=torch.float32)
    ids, values = to_host(tokens, lps)
    assert ids == [0, 151935, 2**31 + 7] and all(isinstance(i, int) for i in ids)
    assert values == lps.tolist()
    assert math.isclose(values[1], -12.345678, rel_tol=1e-6)


# -- the benchmark ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_prints_one_json_line_per_variant_with_profile():
    cmd = [sys.executable, str(ROOT / "bench" / "rollout.py"), "--skip-hf", "--profile", "--variants", "sdpa,bmm",
           "--prompts", "4", "--prompt-len", "8", "--new-tokens", "8"]
    # the repository first on the path: posttrain may be installed (venv) or only on PYTHONPATH (GPU runs)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin", "PYTHONPATH": path}, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.strip().splitlines()]
    assert [r["variant"] for r in lines] == ["sdpa", "bmm"]
    for r in lines:
        assert "error" not in r, r
        assert r["engine_tok_s"] > 0 and r["decode_ms"] > 0 and r["step_ms"] > 0 and r["sampling_ms"] > 0
        assert r["decode_attention"] == r["variant"]


def bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_rollout", ROOT / "bench" / "rollout.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_bound_takes_the_cards_own_bandwidth():
    """The bound on an H100 is its 3.35 TB/s, not the H200's 4.8 (a run on an H100 once reported 0.41 of an
    H200's bound); a card the table lacks gets no bound unless ``--bandwidth-gbs`` gives one."""
    bench = bench_module()
    assert bench.datasheet_bandwidth_gbs("NVIDIA H200") == 4800.0
    assert bench.datasheet_bandwidth_gbs("NVIDIA H100 80GB HBM3") == 3350.0
    assert bench.datasheet_bandwidth_gbs("NVIDIA H100 PCIe") == 2000.0
    assert bench.datasheet_bandwidth_gbs("NVIDIA A100-SXM4-80GB") is None


def test_bench_sampler_launch_words_set_the_kernel_defaults_for_one_variant_only():
    from posttrain.plugins.engines.local import sampling_kernel

    bench = bench_module()
    opts = bench.parse_variant("triton+sampler2048x8x16", {})
    assert opts["decode_attention"] == "triton"
    assert opts["sample_launch"] == {"BLOCK": 2048, "NUM_WARPS": 8, "PROGRAMS_PER_SM": 16}
    before = (sampling_kernel.BLOCK, sampling_kernel.NUM_WARPS, sampling_kernel.PROGRAMS_PER_SM)
    with pytest.raises(RuntimeError, match="inside"), bench.sample_launch(opts["sample_launch"]):
        assert (sampling_kernel.BLOCK, sampling_kernel.NUM_WARPS, sampling_kernel.PROGRAMS_PER_SM) == (2048, 8, 16)
        raise RuntimeError("inside")  # a failing variant puts the defaults back too
    assert (sampling_kernel.BLOCK, sampling_kernel.NUM_WARPS, sampling_kernel.PROGRAMS_PER_SM) == before
    with pytest.raises(ValueError, match="sampler2048x8"):
        bench.parse_variant("triton+sampler2048x8", {})


@pytest.fixture
def compile_counter(monkeypatch):
    """``torch.compile`` through Dynamo's counting backend (fresh caches): ``.frame_count`` is the compiles so far.
    The counting backend takes no Inductor options (combo kernels): they are Inductor's, not Dynamo's."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter, real = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "options": None, "backend": counter}))
    torch.set_num_threads(1)
    return counter


@pytest.mark.parametrize("fuse", [False, True])
def test_compiled_decode_compiles_a_few_times_for_every_batch_bucket(tiny_ckpt, compile_counter, fuse):
    """Automatic dynamic shapes: the batch buckets 2, 4, 8 cost at most three compiles of each compiled
    part (one row pads to two, a size Dynamo would compile apart), not one per bucket, and
    every bucket still gives the eager logits; with fused projections (their weights passed in) too. The
    step has four parts (the embedding with the rotary tables, the first layer's start, each layer's end
    with the next one's start, the last layer's end with the head)."""
    eager = ModelRunner(tiny_ckpt, max_slots=8, context_length=64)
    compiled = ModelRunner(tiny_ckpt, max_slots=8, context_length=64,
                           tuning=RunnerTuning(compile=True, fuse_projections=fuse))
    rows, step = [], compiled._decode_eager
    compiled._decode_eager = lambda tokens, *rest: rows.append(tokens.shape[0]) or step(tokens, *rest)
    for nb in (1, 2, 3, 5, 8, 4):  # buckets 2 (one row padded to two), 2, 4, 8, 8, 4
        for r in (eager, compiled):  # fresh slots: a padded step writes position 0 of the idle ones
            r.prefill(list(range(8)), [[5 + i, 6, 7] for i in range(8)])
        tokens, positions = torch.arange(20, 20 + nb), torch.full((nb,), 3)
        torch.testing.assert_close(compiled.decode(tokens, positions), eager.decode(tokens, positions),
                                   atol=1e-5, rtol=1e-5, msg=f"batch {nb}")
    assert rows == [2, 2, 4, 8, 8, 4]  # never a batch of one: Dynamo would compile it apart
    parts = 4
    frames = compile_counter.frame_count
    assert parts <= frames <= 3 * parts, f"{frames} compiles for 3 buckets of {parts} parts"


def test_a_symbolic_batch_compiles_each_decode_part_once(tiny_ckpt, compile_counter):
    """A warm capture meets the largest bucket first. Each of the step's four parts compiles once there, its row
    count symbolic, and the later buckets (the largest again among them) compile nothing more (static, each part
    would compile again at the next bucket). Every bucket gives the eager logits."""
    eager = ModelRunner(tiny_ckpt, max_slots=8, context_length=64)
    compiled = ModelRunner(tiny_ckpt, max_slots=8, context_length=64, tuning=RunnerTuning(compile=True))
    counts = []
    for nb in (8, 4, 2, 8):
        for r in (eager, compiled):
            r.prefill(list(range(8)), [[5 + i, 6, 7] for i in range(8)])
        before = compile_counter.frame_count  # the prefill's own compiles are not the decode step's
        tokens, positions = torch.arange(20, 20 + nb), torch.full((nb,), 3)
        torch.testing.assert_close(compiled.decode(tokens, positions), eager.decode(tokens, positions),
                                   atol=1e-5, rtol=1e-5, msg=f"batch {nb}")
        counts.append(compile_counter.frame_count - before)
    assert counts == [4, 0, 0, 0], f"decode compiles at buckets 8, 4, 2, 8: {counts}"


def test_compiled_prefill_matches_eager_and_compiles_once_for_every_width(tiny_ckpt, compile_counter):
    """With ``compile`` the prefill runs the compiled layer parts with the prompt count and width symbolic:
    prompts of new widths and counts reuse one version (no compile per width), and the logits and the
    cache entries equal the eager prefill's."""
    eager = ModelRunner(tiny_ckpt, max_slots=8, context_length=64)
    compiled = ModelRunner(tiny_ckpt, max_slots=8, context_length=64, tuning=RunnerTuning(compile=True))
    seen = []
    for n, width in ((2, 3), (3, 5), (4, 9), (5, 4), (2, 12)):
        prompts = [[5 + i + j for j in range(width - i % 2)] for i in range(n)]  # ragged: right padding too
        a, b = eager.prefill(list(range(n)), prompts), compiled.prefill(list(range(n)), prompts)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=f"{n} prompts of width {width}")
        torch.testing.assert_close(compiled.k_cache[:, :n, :, :width], eager.k_cache[:, :n, :, :width], atol=1e-5, rtol=1e-5)
        seen.append(compile_counter.frame_count)
    assert seen[0] >= 1 and seen[-1] == seen[0], f"compiles after each prefill: {seen}"


def test_compiled_prefill_of_one_prompt_or_one_token_compiles_nothing_more(tiny_ckpt, compile_counter):
    """Dynamo compiles a size of one apart from its symbolic version: a compiled prefill of a lone prompt (one
    GRPO group admitted alone, mid-run) runs beside a copy of it, and one-token prompts are padded to two
    positions, so after the first prefill nothing compiles again; the logits and each prompt's cache rows
    equal the eager prefill's, and no other slot is written."""
    eager = ModelRunner(tiny_ckpt, max_slots=8, context_length=64)
    compiled = ModelRunner(tiny_ckpt, max_slots=8, context_length=64, tuning=RunnerTuning(compile=True))
    cases = [([0, 1], [[5, 6, 7], [8, 9, 10]]), ([2], [[11, 12, 13, 14]]), ([3, 4, 5], [[15], [16], [17]]),
             ([6], [[18]]), ([6, 7], [[19, 20], [19, 20]])]  # the last: one distinct prompt in two slots
    counts = []
    for slots, prompts in cases:
        untouched = compiled.k_cache[:, [s for s in range(8) if s not in slots]].clone()
        a, b = eager.prefill(slots, prompts), compiled.prefill(slots, prompts)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=f"prompts {prompts}")
        assert b.shape[0] == len(prompts)
        for slot, p in zip(slots, prompts):
            for cache in ("k_cache", "v_cache"):
                torch.testing.assert_close(getattr(compiled, cache)[:, slot, :, :len(p)],
                                           getattr(eager, cache)[:, slot, :, :len(p)], atol=1e-5, rtol=1e-5)
        assert torch.equal(compiled.k_cache[:, [s for s in range(8) if s not in slots]], untouched)
        counts.append(compile_counter.frame_count)
    assert counts[0] >= 1 and counts[-1] == counts[0], f"compiles after each prefill: {counts}"
