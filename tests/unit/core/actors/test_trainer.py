"""``TrainerRole.memory_stats``: the figures the loop logs as ``perf/trainer_*`` on a GPU, among them the two counts
that explain a slow train phase (the allocator's retries, the graphs Dynamo compiled). The CUDA allocator's
figures are given here (no GPU in CI); the compiles are Dynamo's own, counted as they happen."""

from __future__ import annotations

import torch

from posttrain.core.actors.trainer import TrainerRole


def _on_a_gpu(monkeypatch, retries: int = 0) -> dict[str, float]:
    """``memory_stats`` as a GPU process answers it (CUDA seen only during the call: Dynamo asks too)."""
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
        m.setattr(torch.cuda, "memory_allocated", lambda: 2**29)
        m.setattr(torch.cuda, "memory_reserved", lambda: 2**30)
        m.setattr(torch.cuda, "memory_stats", lambda: {"num_alloc_retries": retries})
        return object.__new__(TrainerRole).memory_stats()  # the process's state, not the role's


def test_the_figures_on_a_gpu_include_the_allocators_retries(monkeypatch):
    stats = _on_a_gpu(monkeypatch, retries=4)
    assert stats["peak_gib"] == 3.0 and stats["allocated_gib"] == 0.5 and stats["reserved_gib"] == 1.0
    assert stats["alloc_retries"] == 4.0


def test_compiled_graphs_count_each_compile_and_recompile_of_this_process(monkeypatch):
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.relu(x) * 2, backend="eager")
    before = _on_a_gpu(monkeypatch)["compiled_graphs"]
    fn(torch.randn(4))
    first = _on_a_gpu(monkeypatch)["compiled_graphs"]
    fn(torch.randn(4))  # the same shape: no compile
    assert _on_a_gpu(monkeypatch)["compiled_graphs"] == first == before + 1
    fn(torch.randn(4, 3))  # another rank: the guards fail, a recompile
    assert _on_a_gpu(monkeypatch)["compiled_graphs"] == first + 1


def test_on_the_cpu_there_are_no_figures():
    assert object.__new__(TrainerRole).memory_stats() == {}
