"""The flash-decoding attention of ``decode_attention="triton"`` (``posttrain.plugins.engines.local.decode_kernel``).

On CPU: the torch reference against masked SDPA (the ``sdpa`` decode path's grouping), the runner with
``decode_attention="triton"`` (which falls back to the reference) against the ``sdpa`` runner and HF
``generate``, and, where ``triton`` is installed, the kernel itself under the Triton interpreter.
On CUDA (``gpu``): the kernel against the reference in float32 and bf16 up to the Qwen3-1.7B decode shape,
inside a CUDA graph replayed with new lengths, and the graphed runner against ``sdpa`` token for token."""

from __future__ import annotations

import importlib.util
import textwrap
import threading

import pytest
import torch
import torch.nn.functional as F

from posttrain.plugins.engines.local import decode_kernel
from posttrain.plugins.engines.local.decode_kernel import decode_attention_reference, triton_available
from posttrain.plugins.engines.local.model_runner import ModelRunner, RunnerTuning

from tests.conftest import run_triton_interpreted

PROMPTS = {0: [5, 6, 7, 8, 9], 2: [10, 11], 3: [12, 13, 14]}  # slot 1 idle: a hole below busy slots


def masked_sdpa(q, k, v, lengths, scale):
    """The ``sdpa`` decode path's attention: the ``G`` query heads of a KV head as ``G`` query rows,
    a boolean mask of the positions below each slot's length. ``q`` ``[nb, H, D]`` -> ``[nb, H, D]``."""
    nb, heads, d = q.shape
    hkv, span = k.shape[1], k.shape[2]
    qg = q.reshape(nb, hkv, heads // hkv, d)
    allowed = (torch.arange(span, device=k.device)[None, :] < lengths[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=allowed, scale=scale).reshape(nb, heads, d)


def cache_views(layers, slots, hkv, s_max, d, nb, span, dtype=torch.float32, device="cpu", seed=0):
    """``k, v`` ``[nb, Hkv, span, D]``: strided views ``cache[1, :nb, :, :span]`` of a bigger
    ``[L, N, Hkv, S_max, D]`` cache full of random values (the entries past each length are garbage)."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (layers, slots, hkv, s_max, d)
    k_cache = torch.randn(shape, generator=g, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=g, device=device).to(dtype)
    return k_cache[1, :nb, :, :span], v_cache[1, :nb, :, :span]


def ragged_lengths(nb, span, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, span + 1, (nb,), generator=g)
    lengths[0] = 1  # the first decode step after a one-token prompt
    lengths[-1] = span  # the longest slot fills the span
    return lengths.to(device)


# -- the reference on CPU ----------------------------------------------------------------------------
@pytest.mark.parametrize("nb,heads,hkv,d,span", [
    (3, 4, 4, 16, 9),  # G = 1
    (5, 8, 4, 32, 40),  # G = 2
    (4, 16, 4, 64, 70),  # G = 4
    (7, 16, 8, 128, 130),  # the Qwen3-1.7B head layout
    (1, 2, 1, 8, 1),  # one slot, one position
])
def test_reference_equals_masked_sdpa(nb, heads, hkv, d, span):
    k, v = cache_views(2, nb + 3, hkv, span + 17, d, nb, span)
    assert k.storage_offset() > 0  # a view into the middle of the cache, read in place
    q = torch.randn(nb, heads, 1, d, generator=torch.Generator().manual_seed(1))
    lengths = ragged_lengths(nb, span)
    scale = d ** -0.5
    out = decode_attention_reference(q, k, v, lengths, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out[:, :, 0], masked_sdpa(q[:, :, 0], k, v, lengths, scale), atol=1e-5, rtol=1e-5)
    # the 3-D query form, and int32 lengths, give the same rows
    out3 = decode_attention_reference(q[:, :, 0], k, v, lengths.to(torch.int32), scale)
    assert out3.shape == (nb, heads, d)
    torch.testing.assert_close(out3, out[:, :, 0], atol=0, rtol=0)


def test_reference_reads_nothing_past_each_length():
    k, v = cache_views(2, 4, 2, 32, 16, 4, 32, seed=3)
    q = torch.randn(4, 4, 16)
    lengths = torch.tensor([1, 5, 17, 32])
    before = decode_attention_reference(q, k, v, lengths, 0.25)
    for i, n in enumerate(lengths.tolist()):
        k[i, :, n:] = 1e4  # huge stale entries: they would dominate any softmax that saw them
        v[i, :, n:] = -1e4
    torch.testing.assert_close(decode_attention_reference(q, k, v, lengths, 0.25), before, atol=0, rtol=0)


def test_reference_rows_without_positions_are_zero_and_long_lengths_clamp():
    k, v = cache_views(2, 3, 2, 8, 16, 3, 8, seed=4)
    q = torch.randn(3, 4, 16)
    out = decode_attention_reference(q, k, v, torch.tensor([0, 8, -2]), 0.25)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    torch.testing.assert_close(decode_attention_reference(q, k, v, torch.tensor([0, 100, 0]), 0.25)[1], out[1])


def test_reference_writes_the_new_row_then_attends_to_it():
    """``k_new``/``v_new``: the same cache and output as writing them at ``lengths - 1`` first; a slot
    with no valid position writes nothing."""
    k, v = cache_views(2, 4, 2, 32, 16, 4, 32, seed=5)
    q = torch.randn(4, 4, 1, 16)
    k_new, v_new = torch.randn(4, 2, 1, 16), torch.randn(4, 2, 1, 16)
    lengths = torch.tensor([1, 9, 0, 32])
    k2, v2 = k.clone(), v.clone()
    for i, n in enumerate(lengths.tolist()):
        if n:
            k2[i, :, n - 1], v2[i, :, n - 1] = k_new[i, :, 0], v_new[i, :, 0]
    expected = decode_attention_reference(q, k2, v2, lengths, 0.25)
    out = decode_attention_reference(q, k, v, lengths, 0.25, k_new=k_new, v_new=v_new)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    with pytest.raises(ValueError, match="k_new"):
        decode_attention_reference(q, k, v, lengths, 0.25, k_new=torch.zeros(4, 3, 16), v_new=v_new)


def test_reference_rotates_raw_projections_as_the_checkpoint_does(hf_model):
    """``rope=``: the reference norms and rotates raw ``q``/``k_new`` as Qwen3's own ``q_norm``/``k_norm`` and
    ``apply_rotary_pos_emb`` do, then attends exactly as over the rotated inputs; the cache gets the rotated key."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    attn = hf_model.model.layers[0].self_attn
    d, nb = attn.head_dim, 3
    g = torch.Generator().manual_seed(2)
    q, k_new, v_new = (torch.randn(nb, h, 1, d, generator=g) for h in (4, 2, 2))
    positions = torch.tensor([[4], [0], [9]])
    cos, sin = hf_model.model.rotary_emb(q, positions)  # [nb, 1, D]
    with torch.no_grad():
        want_q, want_k = apply_rotary_pos_emb(attn.q_norm(q), attn.k_norm(k_new), cos, sin)
    rope = decode_kernel.Rope(cos, sin, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon)
    torch.testing.assert_close(decode_kernel.rotate_reference(q[:, :, 0], rope, rope.q_norm), want_q[:, :, 0],
                               atol=1e-6, rtol=1e-6)
    k, v = cache_views(2, 4, 2, 16, d, nb, 12, seed=6)
    lengths = positions[:, 0] + 1
    k2, v2 = k.clone(), v.clone()
    expected = decode_attention_reference(want_q, k2, v2, lengths, 0.25, k_new=want_k, v_new=v_new)
    out = decode_attention_reference(q, k, v, lengths, 0.25, k_new=k_new, v_new=v_new, rope=rope)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, k2, atol=1e-6, rtol=1e-6)
    plain = decode_kernel.Rope(cos, sin)  # no norms (Llama): the rotary alone
    torch.testing.assert_close(decode_kernel.rotate_reference(q[:, :, 0], plain, None),
                               apply_rotary_pos_emb(q, k_new, cos, sin)[0][:, :, 0], atol=1e-6, rtol=1e-6)


def test_rope_operands_are_checked():
    k = torch.zeros(2, 2, 8, 16)
    q, k_new = torch.zeros(2, 4, 16), torch.zeros(2, 2, 16)
    lengths = torch.ones(2, dtype=torch.long)
    rope = decode_kernel.Rope(torch.zeros(2, 16), torch.zeros(2, 16))
    with pytest.raises(ValueError, match="needs k_new"):
        decode_attention_reference(q, k, k, lengths, 1.0, rope=rope)
    for bad, match in ((rope._replace(cos=torch.zeros(3, 16)), r"\[2, 16\]"),
                       (rope._replace(q_norm=torch.ones(16)), "go together"),
                       (rope._replace(q_norm=torch.ones(8), k_norm=torch.ones(8)), "norm weight")):
        with pytest.raises(ValueError, match=match):
            decode_attention_reference(q, k, k.clone(), lengths, 1.0, k_new=k_new, v_new=k_new, rope=bad)


def test_reference_rejects_mismatched_shapes():
    k = torch.zeros(2, 2, 4, 16)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention_reference(torch.zeros(2, 3, 16), k, k, torch.ones(2, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="lengths"):
        decode_attention_reference(torch.zeros(2, 4, 16), k, k, torch.ones(3, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="one query token"):
        decode_attention_reference(torch.zeros(2, 4, 2, 16), k, k, torch.ones(2, dtype=torch.long), 1.0)


def test_grouped_programs_halve_until_they_fill_the_gpu_and_reject_bad_settings():
    """``slots_per_program``: the launch plan (shapes only, so no GPU is needed) keeps P where the
    programs fill an H200's 132 SMs, halves it where they would not, and names a bad setting."""
    cpu = torch.device("cpu")  # plans there are an H200's (decode_kernel.sm_count)
    assert decode_kernel._plan_group(256, 8, 2, cpu, 8, None) == 8  # 32 x 8 = 256 programs
    assert decode_kernel._plan_group(64, 8, 2, cpu, 8, None) == 2  # 32 x 8 programs: 256 would be 64
    assert decode_kernel._plan_group(16, 8, 2, cpu, 8, None) == 1  # 128 programs: per-slot (and split)
    assert decode_kernel._plan_group(16, 8, 2, cpu, 8, 1) == 8  # one split asked for: kept
    assert decode_kernel._plan_group(256, 8, 2, cpu, None, None) == decode_kernel.GROUP_SLOTS == 8  # the default
    assert decode_kernel._plan_group(256, 4, 16, cpu, None, None) == 4  # at most 64 query rows
    assert decode_kernel._plan_group(256, 8, 2, cpu, None, 3) == 1  # the default yields to the splits asked for
    for bad in (3, 0, 64):
        with pytest.raises(ValueError, match="slots_per_program"):
            decode_kernel._plan_group(256, 8, 2, cpu, bad, None)
    with pytest.raises(ValueError, match="num_splits=2"):
        decode_kernel._plan_group(256, 8, 2, cpu, 4, 2)


def test_triton_is_not_available_without_cuda():
    if not torch.cuda.is_available():
        assert not triton_available()


# -- the runner on CPU (the reference fallback) ---------------------------------------------------------
def decode_steps(runner: ModelRunner, steps: int = 3):
    """Prefill ``PROMPTS`` over a cache of garbage, then ``steps`` greedy steps; per-step logits and sequences."""
    runner.k_cache.normal_(generator=torch.Generator().manual_seed(3))
    runner.v_cache.normal_(generator=torch.Generator().manual_seed(4))
    logits = runner.prefill(list(PROMPTS), list(PROMPTS.values()))
    seqs = {s: p + [int(logits[i].argmax())] for i, (s, p) in enumerate(PROMPTS.items())}
    nb, outs = max(PROMPTS) + 1, []
    for _ in range(steps):
        tokens = torch.tensor([seqs[s][-1] if s in seqs else 0 for s in range(nb)], device=runner.device)
        positions = torch.tensor([len(seqs[s]) - 1 if s in seqs else 0 for s in range(nb)], device=runner.device)
        out = runner.decode(tokens, positions, max_position=int(positions.max()))
        outs.append(out.clone())
        for s in seqs:
            seqs[s].append(int(out[s].argmax()))
    return outs, seqs


def test_triton_runner_on_cpu_equals_sdpa(tiny_ckpt):
    torch.set_num_threads(1)
    ref, seqs = decode_steps(ModelRunner(tiny_ckpt, max_slots=4, context_length=64, tuning=RunnerTuning(decode_attention="sdpa")))
    got, got_seqs = decode_steps(ModelRunner(tiny_ckpt, max_slots=4, context_length=64, tuning=RunnerTuning(decode_attention="triton")))
    assert got_seqs == seqs
    for a, b in zip(ref, got):
        for s in PROMPTS:  # busy slots only: the idle slot 1 attends to its stale position 0
            torch.testing.assert_close(b[s], a[s], atol=1e-5, rtol=1e-5)
        assert torch.isfinite(b).all()


def test_triton_engine_greedy_matches_hf_generate_on_cpu(tiny_ckpt, hf_model):
    from posttrain.plugins.engines.local.engine import BatchEngine
    from posttrain.plugins.engines.local.sampling import parse_sampling
    from posttrain.testing.engine import hf_greedy

    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17]]
    runner = ModelRunner(tiny_ckpt, max_slots=4, context_length=64, tuning=RunnerTuning(decode_attention="triton"))
    params = parse_sampling({"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    engine = BatchEngine(runner, None, [0])
    outs, done = [None] * len(prompts), threading.Semaphore(0)
    for i, p in enumerate(prompts):
        engine.submit(p, params, True, lambda o, i=i: (outs.__setitem__(i, o), done.release()))
    try:
        for _ in prompts:
            assert done.acquire(timeout=60)
    finally:
        engine.shutdown()
    for p, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(hf_model, p, 6)


def test_runner_rotating_in_the_attention_equals_the_separate_rotary(tiny_ckpt):
    """``rope_in_attention``: raw projections into the attention (here its reference, as on a CPU), the same
    logits, tokens and cache as Qwen3's norms and rotary run before it; off by default on a CPU."""
    on = ModelRunner(tiny_ckpt, max_slots=4, context_length=64, tuning=RunnerTuning(decode_attention="triton", rope_in_attention=True))
    off = ModelRunner(tiny_ckpt, max_slots=4, context_length=64, tuning=RunnerTuning(decode_attention="triton"))
    assert on.rope_in_attention and not off.rope_in_attention
    (a, seqs_a), (b, seqs_b) = decode_steps(on), decode_steps(off)
    assert seqs_a == seqs_b
    for x, y in zip(a, b):
        for s in PROMPTS:
            torch.testing.assert_close(x[s], y[s], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(on.k_cache, off.k_cache, atol=1e-5, rtol=1e-5)
    assert torch.equal(on.v_cache, off.v_cache)


def test_rope_in_attention_refuses_what_it_cannot_rotate(tiny_ckpt, tmp_path):
    """GLM-4's half-dim interleaved rotary is refused by probing it (not by name); so is a path without the
    kernel's cache write; a Llama checkpoint (no Q/K norms) is taken."""
    from posttrain.testing.tiny import make_tiny_checkpoint

    glm = make_tiny_checkpoint(tmp_path / "glm4", family="glm4", seed=0)
    with pytest.raises(ValueError, match="rope_in_attention: .*rotary"):
        ModelRunner(glm, max_slots=2, context_length=32, tuning=RunnerTuning(decode_attention="triton", rope_in_attention=True))
    with pytest.raises(ValueError, match="rope_in_attention: it needs decode_attention=.triton."):
        ModelRunner(tiny_ckpt, max_slots=2, context_length=32, tuning=RunnerTuning(decode_attention="sdpa", rope_in_attention=True))
    llama = make_tiny_checkpoint(tmp_path / "llama", family="llama", seed=0)
    on = ModelRunner(llama, max_slots=4, context_length=64, tuning=RunnerTuning(decode_attention="triton", rope_in_attention=True))
    off = ModelRunner(llama, max_slots=4, context_length=64, tuning=RunnerTuning(decode_attention="triton"))
    (a, seqs_a), (b, seqs_b) = decode_steps(on), decode_steps(off)
    assert seqs_a == seqs_b
    torch.testing.assert_close(a[-1][0], b[-1][0], atol=1e-5, rtol=1e-5)


def test_runner_accepts_triton_and_still_rejects_unknown(tiny_ckpt):
    assert ModelRunner(tiny_ckpt, max_slots=2, context_length=32, tuning=RunnerTuning(decode_attention="triton")).decode_attention == "triton"
    with pytest.raises(ValueError, match="decode_attention"):
        ModelRunner(tiny_ckpt, max_slots=2, context_length=32, tuning=RunnerTuning(decode_attention="flash"))


# -- the kernel under the Triton interpreter (CPU, where triton is installed) ------------------------------
INTERPRETED = textwrap.dedent("""
    import torch
    from posttrain.plugins.engines.local import decode_kernel as dk

    torch.manual_seed(0)
    cases = [  # nb, H, Hkv, D, span, splits, dtype (no bf16: the interpreter's bf16 tl.dot is wrong)
        (3, 4, 2, 64, 70, None, torch.float32), (5, 8, 8, 128, 200, 1, torch.float32),
        (4, 8, 2, 32, 300, 3, torch.float32), (2, 6, 2, 24, 50, None, torch.float32),
        (3, 16, 8, 128, 260, None, torch.float16), (6, 4, 1, 64, 129, 2, torch.float16)]
    for nb, heads, hkv, d, span, splits, dtype in cases:
        big_k = torch.randn(2, nb + 2, hkv, span + 40, d).to(dtype)
        big_v = torch.randn(2, nb + 2, hkv, span + 40, d).to(dtype)
        k, v = big_k[1, :nb, :, :span], big_v[1, :nb, :, :span]
        q = torch.randn(nb, heads, 1, d).to(dtype)
        lengths = torch.randint(1, span + 1, (nb,))
        lengths[0], lengths[-1] = 1, span
        out = dk.decode_attention(q, k, v, lengths, d ** -0.5, num_splits=splits)
        ref = dk.decode_attention_reference(q, k, v, lengths, d ** -0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert out.shape == q.shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    for nb, heads, hkv, d, span, splits, dtype in cases:  # the new keys and values written by the kernel
        k, v = torch.randn(nb, hkv, span, d).to(dtype), torch.randn(nb, hkv, span, d).to(dtype)
        q = torch.randn(nb, heads, 1, d).to(dtype)
        k_new, v_new = torch.randn(nb, hkv, 1, d).to(dtype), torch.randn(nb, hkv, 1, d).to(dtype)
        lengths = torch.randint(1, span + 1, (nb,))
        lengths[0], lengths[-1] = 1, span
        k2, v2 = k.clone(), v.clone()
        ref = dk.decode_attention_reference(q, k2, v2, lengths, d ** -0.5, k_new=k_new, v_new=v_new)
        out = dk.decode_attention(q, k, v, lengths, d ** -0.5, num_splits=splits, k_new=k_new, v_new=v_new)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        assert torch.equal(k, k2) and torch.equal(v, v2), "the kernel wrote the cache as the reference does"
    groups = [(3, 4, 2, 64, 70, 2, torch.float32), (9, 16, 8, 128, 130, 8, torch.float16),
              (6, 4, 1, 64, 129, 16, torch.float32), (7, 12, 4, 32, 90, 4, torch.float32)]
    for nb, heads, hkv, d, span, group, dtype in groups:  # slots sharing a program: one loop over their positions
        k, v = torch.randn(nb, hkv, span, d).to(dtype), torch.randn(nb, hkv, span, d).to(dtype)
        q = torch.randn(nb, heads, 1, d).to(dtype)
        lengths = torch.randint(1, span + 1, (nb,))
        lengths[0], lengths[-1], lengths[2] = 1, span, 0  # one slot with nothing to read
        assert dk._plan_group(nb, hkv, heads // hkv, k.device, group, None) == 1  # a small batch splits instead
        out = dk.decode_attention(q, k, v, lengths, d ** -0.5, slots_per_program=group, num_splits=1)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out.float(), dk.decode_attention_reference(q, k, v, lengths, d ** -0.5).float(),
                                   atol=tol, rtol=tol)
        lengths[2] = 5
        k_new, v_new = torch.randn(nb, hkv, 1, d).to(dtype), torch.randn(nb, hkv, 1, d).to(dtype)
        k2, v2 = k.clone(), v.clone()
        ref = dk.decode_attention_reference(q, k2, v2, lengths, d ** -0.5, k_new=k_new, v_new=v_new)
        out = dk.decode_attention(q, k, v, lengths, d ** -0.5, k_new=k_new, v_new=v_new, slots_per_program=group,
                                  num_splits=1)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        assert torch.equal(k, k2) and torch.equal(v, v2), "the grouped kernel wrote the cache as the reference does"
    rotated = [  # nb, H, Hkv, D, span, splits, slots per program, dtype, Q/K norms: raw q and k_new, rotated in
        (3, 4, 2, 64, 70, None, None, torch.float32, True), (5, 8, 8, 32, 50, 1, None, torch.float32, False),
        (4, 8, 2, 32, 100, 3, None, torch.float32, True), (9, 16, 8, 64, 60, 1, 8, torch.float32, True),
        (7, 12, 4, 32, 40, 1, 4, torch.float16, False), (6, 4, 1, 64, 45, 2, None, torch.float16, True),
        (5, 8, 4, 48, 60, None, None, torch.float32, True), (9, 8, 4, 48, 30, 1, 4, torch.float32, True)]  # D < tile
    for nb, heads, hkv, d, span, splits, group, dtype, norms in rotated:
        k, v = torch.randn(nb, hkv, span, d).to(dtype), torch.randn(nb, hkv, span, d).to(dtype)
        q = torch.randn(nb, heads, 1, d).to(dtype)
        k_new, v_new = torch.randn(nb, hkv, 1, d).to(dtype), torch.randn(nb, hkv, 1, d).to(dtype)
        angle = torch.rand(nb, 1, d) * 6
        weights = (torch.rand(d).to(dtype) + 0.5, torch.rand(d).to(dtype) + 0.5) if norms else (None, None)
        rope = dk.Rope(angle.cos().to(dtype), angle.sin().to(dtype), *weights, 1e-6)
        lengths = torch.randint(1, span + 1, (nb,))
        lengths[0], lengths[-1] = 1, span
        k2, v2 = k.clone(), v.clone()
        ref = dk.decode_attention_reference(q, k2, v2, lengths, d ** -0.5, k_new=k_new, v_new=v_new, rope=rope)
        out = dk.decode_attention(q, k, v, lengths, d ** -0.5, num_splits=splits, k_new=k_new, v_new=v_new, rope=rope,
                                  slots_per_program=group)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(k.float(), k2.float(), atol=tol, rtol=tol)  # the rotated key, cached
        assert torch.equal(v, v2)
    k, v = torch.randn(3, 2, 40, 64), torch.randn(3, 2, 40, 64)
    q = torch.randn(3, 4, 64)
    for splits in (1, 2):  # no valid position (0, negative): zeros; past the span: clamped
        out = dk.decode_attention(q, k, v, torch.tensor([0, 100, -3], dtype=torch.int32), 0.1, num_splits=splits)
        assert torch.isfinite(out).all() and not out[0].any() and not out[2].any()
        torch.testing.assert_close(out[1], dk.decode_attention_reference(q, k, v, torch.tensor([0, 40, 0]), 0.1)[1],
                                   atol=1e-5, rtol=1e-5)
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_under_the_triton_interpreter():
    """The kernel's index, mask, online-softmax and split-merge logic on CPU tensors (``TRITON_INTERPRET=1``
    must be set before the kernel is defined: a fresh process)."""
    run_triton_interpreted(INTERPRETED)


# -- the kernel on CUDA --------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_triton_is_available_on_cuda():
    assert triton_available(), "CUDA is present but triton did not import"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("nb,heads,hkv,d,span,splits", [
    (256, 16, 8, 128, 640, None),  # Qwen3-1.7B decode: 2048 programs, one pass
    (256, 16, 8, 128, 384, 1),
    (3, 16, 8, 128, 640, None),  # a small batch: split into chunks, then merged
    (2, 16, 8, 128, 2048, 7),
    (5, 8, 8, 64, 300, None),  # G = 1
    (9, 8, 2, 256, 130, 2),  # G = 4, D = 256
    (4, 12, 4, 96, 77, None),  # G = 3 (padded), D = 96 (padded to 128)
    (1, 2, 1, 16, 1, None),  # one position
])
def test_kernel_matches_reference(nb, heads, hkv, d, span, splits, dtype, tol):
    if not triton_available():
        pytest.skip("triton did not import")
    k, v = cache_views(2, nb + 1, hkv, span + 64, d, nb, span, dtype=dtype, device="cuda")
    q = torch.randn(nb, heads, 1, d, device="cuda").to(dtype)
    lengths = ragged_lengths(nb, span, device="cuda")
    scale = d ** -0.5
    out = decode_kernel.decode_attention(q, k, v, lengths, scale, num_splits=splits)
    ref = decode_attention_reference(q, k, v, lengths, scale)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    out3 = decode_kernel.decode_attention(q[:, :, 0], k, v, lengths.to(torch.int32), scale, num_splits=splits)
    torch.testing.assert_close(out3, out[:, :, 0], atol=0, rtol=0)
    if splits in (None, 1) and 8 * heads // hkv <= decode_kernel.MAX_GROUP_ROWS:  # slots sharing programs
        for group in (1, 2, 8):  # 1: one program per slot
            grouped = decode_kernel.decode_attention(q, k, v, lengths, scale, num_splits=1, slots_per_program=group)
            torch.testing.assert_close(grouped.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("nb,heads,hkv,d,span,splits", [
    (256, 16, 8, 128, 640, None), (3, 16, 8, 128, 640, None), (9, 8, 2, 256, 130, 2), (4, 12, 4, 96, 77, None)])
def test_kernel_writes_the_new_keys_and_values(nb, heads, hkv, d, span, splits, dtype, tol):
    """``k_new``/``v_new``: the kernel's cache afterwards equals the reference's bit for bit (one slot per
    program writes its row), and its output matches, also replayed in a CUDA graph with new lengths."""
    if not triton_available():
        pytest.skip("triton did not import")
    k, v = cache_views(2, nb + 1, hkv, span + 64, d, nb, span, dtype=dtype, device="cuda")
    q = torch.randn(nb, heads, 1, d, device="cuda").to(dtype)
    k_new, v_new = (torch.randn(nb, hkv, 1, d, device="cuda").to(dtype) for _ in range(2))
    lengths = ragged_lengths(nb, span, device="cuda")
    scale = d ** -0.5
    k2, v2 = k.clone(), v.clone()
    ref = decode_attention_reference(q, k2, v2, lengths, scale, k_new=k_new, v_new=v_new)
    out = decode_kernel.decode_attention(q, k, v, lengths, scale, num_splits=splits, k_new=k_new, v_new=v_new)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    if splits is None:  # slots sharing programs (the slot's first query row writes its K/V)
        for group in (1, 4):
            other = decode_kernel.decode_attention(q, k, v, lengths, scale, num_splits=1, slots_per_program=group,
                                                   k_new=k_new, v_new=v_new)
            torch.testing.assert_close(other.float(), ref.float(), atol=tol, rtol=tol)
            assert torch.equal(k, k2) and torch.equal(v, v2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_kernel.decode_attention(q, k, v, lengths, scale, num_splits=splits, k_new=k_new, v_new=v_new)
    lengths.copy_(ragged_lengths(nb, span, device="cuda", seed=7))
    k_new.normal_()
    k2, v2 = k.clone(), v.clone()
    graph.replay()
    torch.cuda.synchronize()
    ref = decode_attention_reference(q, k2, v2, lengths, scale, k_new=k_new, v_new=v_new)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert torch.equal(k, k2) and torch.equal(v, v2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("nb,splits,group,norms", [
    (256, None, None, True), (256, None, 1, False), (5, None, None, True), (9, 3, None, True), (64, 1, 4, True)])
def test_kernel_rotates_raw_queries_and_keys(nb, splits, group, norms, dtype, tol):
    """``rope=`` at the Qwen3-1.7B head layout: raw ``q``/``k_new`` normed and rotated in the kernel equal the
    reference (output and the cached key), the grouped and per-slot kernels and the split one, and in a CUDA
    graph replayed with new lengths and new tables."""
    if not triton_available():
        pytest.skip("triton did not import")
    heads, hkv, d, span = 16, 8, 128, 400
    k, v = cache_views(2, nb + 1, hkv, span + 64, d, nb, span, dtype=dtype, device="cuda")
    q = torch.randn(nb, heads, 1, d, device="cuda").to(dtype)
    k_new, v_new = (torch.randn(nb, hkv, 1, d, device="cuda").to(dtype) for _ in range(2))
    angle = torch.rand(nb, 1, d, device="cuda") * 6
    weights = (torch.rand(d, device="cuda").to(dtype) + 0.5 for _ in range(2)) if norms else (None, None)
    rope = decode_kernel.Rope(angle.cos().to(dtype), angle.sin().to(dtype), *weights, 1e-6)
    lengths = ragged_lengths(nb, span, device="cuda")
    scale = d ** -0.5

    def run():
        return decode_kernel.decode_attention(q, k, v, lengths, scale, num_splits=splits, k_new=k_new, v_new=v_new,
                                              slots_per_program=group, rope=rope)

    def check(out, before):  # against the reference run on the cache as it was before
        k2, v2 = before[0].clone(), before[1].clone()
        ref = decode_attention_reference(q, k2, v2, lengths, scale, k_new=k_new, v_new=v_new, rope=rope)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(k.float(), k2.float(), atol=tol, rtol=tol)  # the rotated key, cached
        assert torch.equal(v, v2)

    before = (k.clone(), v.clone())
    check(run(), before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    lengths.copy_(ragged_lengths(nb, span, device="cuda", seed=7))
    angle.uniform_(0, 6)
    rope.cos.copy_(angle.cos()), rope.sin.copy_(angle.sin())
    before = (k.clone(), v.clone())
    graph.replay()
    torch.cuda.synchronize()
    check(out, before)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_rows_without_positions_are_finite(splits):
    if not triton_available():
        pytest.skip("triton did not import")
    k, v = cache_views(2, 4, 2, 300, 128, 4, 256, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(4, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([0, 256, -1, 1000], device="cuda")  # none, all, negative, past the span
    out = decode_kernel.decode_attention(q, k, v, lengths, 128 ** -0.5, num_splits=splits)
    assert torch.isfinite(out).all()
    assert not out[0].any() and not out[2].any()
    ref = decode_attention_reference(q, k, v, lengths, 128 ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_kernel_reads_a_large_cache_through_64_bit_offsets():
    """A cache view whose last slots start past 2**31 elements of its base pointer."""
    if not triton_available():
        pytest.skip("triton did not import")
    hkv, s_max, d, span = 8, 4096, 128, 256
    slots = 2**31 // (hkv * s_max * d) + 2  # 1026 slots: 8.6 GB in bf16
    cache = torch.zeros((slots, hkv, s_max, d), dtype=torch.bfloat16, device="cuda")
    cache[:, :, :2 * span].normal_()
    k, v = cache[:, :, :span], cache[:, :, span:2 * span]
    assert (slots - 1) * k.stride(0) > 2**31
    q = torch.randn(slots, 16, 1, d, device="cuda", dtype=torch.bfloat16)
    lengths = torch.randint(1, 9, (slots,), device="cuda")
    lengths[-1] = span
    out = decode_kernel.decode_attention(q, k, v, lengths, d ** -0.5)
    ref = decode_attention_reference(q, k, v, lengths, d ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("nb", [256, 4])  # one pass, and the split + merge pass
def test_kernel_in_a_cuda_graph_follows_new_lengths(nb):
    if not triton_available():
        pytest.skip("triton did not import")
    heads, hkv, d, span = 16, 8, 128, 512
    k, v = cache_views(2, nb, hkv, 640, d, nb, span, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(nb, heads, 1, d, device="cuda", dtype=torch.bfloat16)
    lengths = ragged_lengths(nb, span, device="cuda")
    scale = d ** -0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        decode_kernel.decode_attention(q, k, v, lengths, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_kernel.decode_attention(q, k, v, lengths, scale)
    for seed in range(3):  # new lengths (shorter and longer) and new queries, same graph
        lengths.copy_(ragged_lengths(nb, span, device="cuda", seed=10 + seed))
        if seed == 2:
            lengths[1] = 0
        q.normal_()
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_attention_reference(q, k, v, lengths, scale)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def greedy_tokens(runner: ModelRunner, prompts: list[list[int]], steps: int):
    """Greedy decode of ``prompts`` in slots ``0 ..``: the generated tokens and the per-step logits."""
    n = len(prompts)
    logits = runner.prefill(list(range(n)), prompts)
    tokens = logits.argmax(-1)
    positions = torch.tensor([len(p) for p in prompts], device=runner.device)
    out, all_logits = [tokens.tolist()], []
    for _ in range(steps):
        logits = runner.decode(tokens, positions, max_position=int(positions.max()))
        all_logits.append(logits.clone())
        tokens = logits.argmax(-1)
        positions = positions + 1
        out.append(tokens.tolist())
    return out, all_logits


@pytest.mark.gpu
@needs_cuda
def test_graphed_triton_runner_greedy_equals_sdpa(tiny_ckpt, monkeypatch):
    if not triton_available():
        pytest.skip("triton did not import")
    calls = []
    kernel = decode_kernel.decode_attention
    monkeypatch.setattr(decode_kernel, "decode_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15] * 40, [16, 17]]  # 5 slots: bucket 8 pads 3
    ref = ModelRunner(tiny_ckpt, device="cuda", dtype="float32", max_slots=8, context_length=300, tuning=RunnerTuning(decode_attention="sdpa", cuda_graphs=True))
    got = ModelRunner(tiny_ckpt, device="cuda", dtype="float32", max_slots=8, context_length=300, tuning=RunnerTuning(decode_attention="triton", cuda_graphs=True))
    ref_tokens, ref_logits = greedy_tokens(ref, prompts, 20)
    got_tokens, got_logits = greedy_tokens(got, prompts, 20)
    assert got._graphs and calls  # the kernel ran (warm-up and capture), then graph replays
    assert got_tokens == ref_tokens
    for a, b in zip(ref_logits, got_logits):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_bf16_graphed_triton_matches_float32(tiny_ckpt):
    """bf16, CUDA graphs, a span crossing the 256 bucket, against the float32 eager sdpa step."""
    if not triton_available():
        pytest.skip("triton did not import")
    ref = ModelRunner(tiny_ckpt, device="cuda", dtype="float32", max_slots=4, context_length=512)
    r = ModelRunner(tiny_ckpt, device="cuda", dtype="bfloat16", max_slots=4, context_length=512, tuning=RunnerTuning(cuda_graphs=True, decode_attention="triton"))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 8, [8, 9] * 20, [3] * 300]
    for x in (ref, r):
        x.prefill([0, 1, 2], prompts)
    tokens, positions = torch.tensor([20, 21, 22], device="cuda"), torch.tensor([64, 40, 300], device="cuda")
    a = torch.log_softmax(ref.decode(tokens, positions), -1)
    b = torch.log_softmax(r.decode(tokens, positions, max_position=300), -1)
    torch.testing.assert_close(a, b, atol=5e-2, rtol=0)
