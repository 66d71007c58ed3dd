"""Stand-ins that let Megatron-core 0.16.1 run on CPU with gloo (CI, laptops). Inactive with CUDA.

Found by trying it (DESIGN.md, "Training: Megatron-core"):

- rotary embeddings call ``torch.cuda.current_device()`` to place ``inv_freq``: on CPU it must name the
  CPU device instead of raising;
- dist-checkpointing calls ``torch.cuda.synchronize()`` around writes: a no-op on CPU;
- the model-parallel RNG tracker must be created with ``inference_rng_tracker=True`` (no CUDA RNG
  state to fork; dropout is 0 in every spec, so the tracker is never asked for randomness);
- with pipeline parallelism and tied embeddings, GPTModel moves the shared weight with
  ``tensor.cuda()`` before syncing the two stages' copies: on CPU, ``Tensor.cuda`` returns the tensor;
- the pipeline schedules count tokens in ``torch.zeros(..., device="cuda")``: inside
  ``megatron.core.pipeline_parallel.schedules`` only, ``torch`` is a view of torch whose ``zeros`` maps
  ``"cuda"`` to the CPU (needed for pipeline parallelism on CPU).

:func:`install` is idempotent and does nothing when ``torch.cuda.is_available()``.
"""

from __future__ import annotations

_INSTALLED = False


def cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def install() -> bool:
    """Patch ``torch.cuda`` for CPU use; return True if the shims are (now) active."""
    global _INSTALLED
    import torch

    if torch.cuda.is_available():
        return False
    if not _INSTALLED:
        # "cpu" is accepted wherever Megatron passes the result as a `device=` argument.
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
        torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
        from megatron.core.pipeline_parallel import schedules

        schedules.torch = _TorchWithCPUZeros()
        _INSTALLED = True
    return True


def init_rng(seed: int) -> None:
    """Seed torch and Megatron's model-parallel RNG tracker (the CPU-safe way when CUDA is absent)."""
    import torch
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


class _TorchWithCPUZeros:
    """``torch``, except that ``zeros(..., device="cuda")`` allocates on the CPU."""

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        import torch

        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)
