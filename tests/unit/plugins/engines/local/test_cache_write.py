"""A prefill's keys and values into the slot cache (``cache_write``): the Triton kernel under the interpreter
and on CUDA against the torch copies, and the runner's prefill through either path."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from posttrain.plugins.engines.local.cache_write import write_prompt_kv_reference

from tests.conftest import run_triton_interpreted


def cases(device="cpu"):
    """``(k, v, k_cache, v_cache, slots, rows)``: ``[n, Hkv, T, D]`` views of ``[n, T, Hkv, D]`` projections, a
    ``[N, Hkv, S, D]`` cache layer full of noise; batch prompts repeating distinct ones into scattered slots, and
    distinct prompts into consecutive slots."""
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype, (n, hkv, width, d, slots, rows) in ((torch.float32, (3, 2, 70, 24, [5, 0, 3, 6, 1], [0, 1, 1, 2, 0])),
                                                    (torch.bfloat16, (4, 4, 33, 64, [2, 3, 4, 5], [0, 1, 2, 3]))):
        k = torch.randn(n, width, hkv, d, generator=g).to(dtype).transpose(1, 2)
        v = torch.randn(n, width, hkv, d, generator=g).to(dtype).transpose(1, 2)
        caches = [torch.randn(8, hkv, width + 9, d, generator=g).to(dtype) for _ in range(2)]
        out.append([t.to(device) for t in (k, v, *caches)] + [torch.tensor(slots, device=device),
                                                               torch.tensor(rows, device=device)])
    return out


def test_reference_writes_each_slot_its_prompts_rows_and_nothing_else():
    for k, v, k_cache, v_cache, slots, rows in cases():
        before = [k_cache.clone(), v_cache.clone()]
        write_prompt_kv_reference(k, v, k_cache, v_cache, slots, rows)
        width = k.shape[2]
        for cache, x, old in ((k_cache, k, before[0]), (v_cache, v, before[1])):
            for slot, row in zip(slots.tolist(), rows.tolist()):
                assert torch.equal(cache[slot, :, :width], x[row]) and torch.equal(cache[slot, :, width:], old[slot, :, width:])
            untouched = [s for s in range(cache.shape[0]) if s not in slots.tolist()]
            assert torch.equal(cache[untouched], old[untouched])


INTERPRETED = """
import torch
from posttrain.plugins.engines.local.cache_write import write_prompt_kv, write_prompt_kv_reference
from tests.unit.plugins.engines.local.test_cache_write import cases

for k, v, k_cache, v_cache, slots, rows in cases():
    want = [k_cache.clone(), v_cache.clone()]
    write_prompt_kv_reference(k, v, *want, slots, rows)
    write_prompt_kv(k, v, k_cache, v_cache, slots, rows)
    assert torch.equal(k_cache, want[0]) and torch.equal(v_cache, want[1])
    try:
        write_prompt_kv(k, v[:, :1], k_cache, v_cache, slots, rows)
    except ValueError as exc:
        assert "do not fit" in str(exc)
    else:
        raise AssertionError("a v of another shape was taken")
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_under_the_triton_interpreter_equals_the_torch_copies():
    run_triton_interpreted(INTERPRETED)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_cuda_equals_the_torch_copies():
    from posttrain.plugins.engines.local.cache_write import write_prompt_kv

    for k, v, k_cache, v_cache, slots, rows in cases("cuda"):
        want = [k_cache.clone(), v_cache.clone()]
        write_prompt_kv_reference(k, v, *want, slots, rows)
        write_prompt_kv(k, v, k_cache, v_cache, slots, rows)
        assert torch.equal(k_cache, want[0]) and torch.equal(v_cache, want[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runner_prefill_through_the_kernel_fills_the_cache_as_torch_does(tiny_ckpt):
    """A CUDA runner writes a prefill's keys and values with the kernel; one switched to torch's copies (its
    ``prefill_kv_kernel`` set off) fills the same cache rows and gives the same logits."""
    from posttrain.plugins.engines.local.model_runner import ModelRunner

    prompts = [[5, 6, 7, 8, 9], [10, 11], [5, 6, 7, 8, 9], [12, 13, 14]]  # a repeat, ragged lengths
    runners = [ModelRunner(tiny_ckpt, device="cuda", dtype="bfloat16", max_slots=8, context_length=32)
               for _ in range(2)]
    assert runners[0].prefill_kv_kernel
    runners[1].prefill_kv_kernel = False  # read at every prefill
    logits = [r.prefill([6, 1, 3, 4], prompts) for r in runners]
    assert torch.equal(logits[0], logits[1])
    for name in ("k_cache", "v_cache"):
        assert torch.equal(getattr(runners[0], name)[:, [6, 1, 3, 4], :, :5], getattr(runners[1], name)[:, [6, 1, 3, 4], :, :5])


def test_a_cpu_runner_prefills_through_torchs_copies(tiny_ckpt):
    """The Triton cache write runs on CUDA only: a CPU runner takes torch's copies."""
    from posttrain.plugins.engines.local.model_runner import ModelRunner

    assert not ModelRunner(tiny_ckpt, max_slots=2, context_length=16).prefill_kv_kernel
