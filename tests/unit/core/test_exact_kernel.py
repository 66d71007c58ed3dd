"""core.exact_kernel's Triton matmul under the Triton interpreter on CPU tensors: its indexing and masking
(ragged M, N, K; strided operands; a zero tail of K changing nothing), and exact.bmm / row_sum / attention
taking it (the CUDA path's logic); on a GPU, tests/gpu/test_exact.py runs it compiled."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import run_triton_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

INTERPRETED = r"""
import torch
from posttrain.core import exact, exact_kernel

assert exact_kernel.triton_ok()
g = torch.Generator().manual_seed(0)
a, b = torch.randn(2, 70, 40, generator=g), torch.randn(2, 40, 67, generator=g)
full = exact_kernel.tiled_bmm(a, b)
torch.testing.assert_close(full, a @ b, rtol=1e-5, atol=1e-4)
assert torch.equal(exact_kernel.tiled_bmm(a[:, 3:4], b[:, :, 5:9]), full[:, 3:4, 5:9])  # one row, few columns
at = a.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, other strides
assert torch.equal(exact_kernel.tiled_bmm(at, b), full)
padded = exact_kernel.tiled_bmm(torch.cat([a, torch.zeros(2, 70, 50)], 2), torch.cat([b, torch.randn(2, 50, 67)], 1))
assert torch.equal(padded, full)  # a zero tail of K adds exact zeros
# exact's CUDA path, taken here because the interpreter counts as a device for it
exact._zero_tail_safe = lambda x: True
exact.bmm = exact_kernel.tiled_bmm
ex = exact
z = torch.randn(3, 100, generator=g)
assert torch.equal(ex.row_sum(z), ex.row_sum(torch.cat([z, torch.zeros(3, 60)], 1)))
q, k, v = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(3))
whole = ex.attention(q, k, v, torch.arange(20)[None], 0.3)
torch.testing.assert_close(whole, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
                           rtol=1e-5, atol=1e-5)
span_k, span_v = torch.randn(1, 2, 48, 8, generator=g), torch.randn(1, 2, 48, 8, generator=g)
span_k[:, :, :12], span_v[:, :, :12] = k[:, :, :12], v[:, :, :12]
step = ex.attention(q[:, :, 11:12], span_k, span_v, torch.tensor([[11]]), 0.3)
assert torch.equal(step[:, :, 0], whole[:, :, 11])
print("ok")
"""


def test_kernel_under_the_interpreter():
    run_triton_interpreted(INTERPRETED)
