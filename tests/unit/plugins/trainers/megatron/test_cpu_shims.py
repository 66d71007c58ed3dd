"""The CPU stand-ins for Megatron-core (``cpu_shims``) that act before Megatron is imported."""

import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

PROBE = """
import sys, torch
compile_ = torch.compile
import posttrain.plugins.trainers.megatron  # the plugin's entry module: what a run loads before any trainer
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu
from posttrain.plugins.trainers.megatron import cpu_shims
assert torch.compile is compile_, "torch.compile is not given back"
assert jit.jit_fuser is cpu_shims._identity_compile, jit.jit_fuser
swiglu = fused_bias_swiglu.bias_swiglu
assert getattr(swiglu, "_torchdynamo_orig_callable", None) is None, "a compiled wrapper"
x = torch.randn(3, 8)
assert torch.equal(swiglu(x, torch.zeros(8)), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
print("eager")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in acts without CUDA only")
def test_megatrons_fused_functions_stay_eager_on_the_cpu():
    """Without CUDA, ``megatron.core`` imports with its ``jit_fuser`` as the identity (torch.compile given back
    after), so its fused functions are the plain ones and give their plain results (a fresh interpreter: this one
    may have imported Megatron already)."""
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "eager", out.stdout[-2000:] + out.stderr[-3000:]
