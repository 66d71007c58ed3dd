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
  ``"cuda"`` to the CPU (needed for pipeline parallelism on CPU);
- MoE's all-to-all token dispatcher makes a side ``torch.cuda.Stream`` for its device-to-host copies
  of the token counts and waits on an event of it: on CPU the copies are no-ops (the counts already
  are host tensors), so ``torch.cuda.Stream``/``current_stream``/``stream`` become inert stand-ins; and
  its ``maybe_move_tensor_to_cpu(t, as_numpy=True)`` leaves a CPU tensor a tensor, which
  ``all_to_all_single`` refuses as split sizes: inside the dispatcher module it returns the numpy array
  a GPU run gets.

:func:`install` is idempotent and does nothing when ``torch.cuda.is_available()``.

Without CUDA, Megatron's fused elementwise functions (its ``jit_fuser``: ``torch.compile`` on 38 of them, decorated
as ``megatron.core`` imports) stay eager (:func:`eager_fusers_without_cuda`). Wrapping them takes 1.3 of the 2.5 s that
importing ``megatron.core`` takes on a 2-core CPU (Inductor's configuration, 38 wrappers), and a CPU run calls none of
them (the default spec fuses no bias, dropout or cross entropy; where one would run, Inductor's C++ compile of it
would cost more than it saves). The quickstart starts that much sooner.

One stand-in applies on GPUs too, whenever Transformer Engine is absent (:func:`install_without_te`):
``megatron.core.transformer.moe.moe_utils`` imports ``te_general_gemm`` and the fused MoE kernels
inside a ``try`` and tests ``te_general_gemm is not None`` later, but never binds the names when the
import fails (a ``NameError`` in the router's gating). They are bound to None, which selects
Megatron's plain-torch paths. Likewise multi-latent attention sees ``HAVE_TE`` true when the mock
stand-ins of TE's classes import, and calls ``isinstance`` on one of them: its flag is set to False.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys

_INSTALLED = False


class _CPUStream:
    """A CUDA stream stand-in: work on the CPU is already ordered, so waits and events do nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None) -> "_CPUStream":
        return self  # an "event" whose synchronize() returns at once

    def synchronize(self) -> None:
        pass


_DEFAULT_STREAM = _CPUStream()


def _host_splits(move):
    """Megatron's ``maybe_move_tensor_to_cpu``, returning a numpy array for ``as_numpy`` on CPU too."""

    def wrapped(tensor, as_numpy=False, record_stream=False):
        import torch

        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return wrapped


def cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def install() -> bool:
    """Patch ``torch.cuda`` for CPU use; return True if the shims are (now) active."""
    global _INSTALLED
    import torch

    install_without_te()
    if torch.cuda.is_available():
        return False
    if not _INSTALLED:
        # "cpu" is accepted wherever Megatron passes the result as a `device=` argument.
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
        torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
        from megatron.core.pipeline_parallel import schedules

        schedules.torch = _TorchWithCPUZeros()
        torch.cuda.Stream = _CPUStream  # type: ignore[assignment, misc]
        torch.cuda.current_stream = lambda device=None: _DEFAULT_STREAM  # type: ignore[assignment]
        torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
        from megatron.core.transformer.moe import token_dispatcher

        token_dispatcher.maybe_move_tensor_to_cpu = _host_splits(token_dispatcher.maybe_move_tensor_to_cpu)
        _INSTALLED = True
    return True


_TE_NAMES = ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
             "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
             "fused_topk_with_score_function", "fused_unpermute")


def install_without_te() -> None:
    """Bind Megatron's optional TE kernel names to None in ``moe_utils`` when TE is not installed."""
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", True):
        for name in _TE_NAMES:
            if not hasattr(moe_utils, name):
                setattr(moe_utils, name, None)
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer import multi_latent_attention as mla

    if not te_ext.HAVE_TE:  # MLA imports TE's classes (mock stand-ins then) and tests isinstance on them
        mla.HAVE_TE = False


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


def _identity_compile(model=None, **options):
    """``torch.compile``'s two call forms (``compile(fn)``, ``compile(**options)(fn)``), compiling nothing."""
    return model if model is not None else (lambda fn: fn)


class _EagerFusers(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` once, and has its package run its imports with ``torch.compile`` as the identity when
    CUDA is absent: the functions it decorates then, and later ones through the ``jit_fuser`` it keeps, stay plain."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "megatron.core":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_eager(module) -> None:
            import torch

            if torch.cuda.is_available():
                return exec_module(module)
            compile_ = torch.compile
            torch.compile = _identity_compile
            try:
                exec_module(module)
            finally:
                torch.compile = compile_

        loader.exec_module = exec_eager
        return spec


def eager_fusers_without_cuda() -> None:
    """Before ``megatron.core`` is imported: without CUDA, its ``jit_fuser`` functions stay eager (module docstring).
    Idempotent; nothing once ``megatron.core`` is imported (the functions are compiled lazily then, as Megatron has
    them). Checks CUDA only as ``megatron.core`` imports, so this costs no ``import torch`` now."""
    if "megatron.core" not in sys.modules and not any(isinstance(f, _EagerFusers) for f in sys.meta_path):
        sys.meta_path.insert(0, _EagerFusers())
