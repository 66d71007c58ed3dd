"""local/compiling.py: what a compiling runner sets for its process before anything compiles."""

from __future__ import annotations

import os

import pytest
import torch

from posttrain.plugins.engines.local import compiling


def test_a_cuda_runner_pins_tritons_cache_to_inductors(monkeypatch, tmp_path):
    """Inductor points ``TRITON_CACHE_DIR`` at its own cache only once it builds a kernel, so the engine's own
    Triton kernels compiled before that were cached elsewhere; pinned first, Triton's cache manager (which
    reads the variable at each compile) stores every kernel in Inductor's directory for this device."""
    triton_cache = pytest.importorskip("triton.runtime.cache")
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    compiling.one_triton_cache(torch.device("cpu"))
    assert "TRITON_CACHE_DIR" not in os.environ  # Inductor's CPU kernels are C++: nothing to pin
    compiling.prepare(torch.device("cuda", 1), shapes=10)
    assert os.environ["TRITON_CACHE_DIR"] == triton_cache_dir(1) == str(tmp_path / "inductor" / "triton" / "1")
    assert triton_cache.get_cache_manager("0" * 64).cache_dir.startswith(str(tmp_path / "inductor" / "triton" / "1"))


def test_a_cache_the_user_named_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    compiling.one_triton_cache(torch.device("cuda", 0))
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
