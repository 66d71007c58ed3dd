"""Deterministic GPU kernels for the trainer, so a seeded run repeats step for step on CUDA.

On the CPU every kernel the trainer uses already repeats. On CUDA some do not, by default:

- the embedding backward (``F.embedding``: Megatron's ``VocabParallelEmbedding`` uses it unless the
  TransformerConfig's ``deterministic_mode`` is set, which switches it to indexing);
- SDPA's memory-efficient and flash backward kernels (they split the key dimension and add with atomics
  unless deterministic algorithms are asked for);
- ``index_add_``/``scatter_add_``-style accumulation, which take sort-based paths when asked.

:func:`use_deterministic_kernels` asks for all of them: ``torch.use_deterministic_algorithms(True,
warn_only=True)`` (an op with no deterministic CUDA kernel warns once instead of failing the run: the
GPU test records which, if any) and cuBLAS's fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, read when its
first handle is made). The trainer sets Megatron's ``deterministic_mode`` beside it.
"""

from __future__ import annotations

import os


def use_deterministic_kernels() -> None:
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
