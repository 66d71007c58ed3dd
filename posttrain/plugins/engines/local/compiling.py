"""``torch.compile`` as the local engine's decode and prefill parts use it (``RunnerTuning.compile``): one
graph per part, Inductor's options, the row count symbolic from the first call, room in Dynamo's recompile limit
for every batch bucket, and one Triton cache for the process."""

from __future__ import annotations

import os

import torch


def batch_marked(fn):
    """``fn`` with dimension 0 of each tensor argument marked dynamic before the call (every decode and prefill
    part's tensors lead with the row count): Dynamo compiles it once with that size symbolic, where automatic
    dynamic shapes compile the first size seen statically and recompile at the second."""
    def call(*args):
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.dim():
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return fn(*args)

    return call


def compiled(fn, mode: str, combo: bool = False):
    """``fn`` under ``torch.compile``: one graph (``fullgraph``), no Inductor CUDA graphs (ours wrap the
    whole step), and the row count symbolic from the first call (:func:`batch_marked`), so one version serves
    every bucket. (Static shapes compiled once per bucket, each a few seconds on an H200, so a colocated step
    that first met a bucket took seconds longer than the others.) Each CUDA graph still captures the kernels at
    its own bucket's size. ``combo``: Inductor's combo kernels (independent kernels of one graph, such as the Q
    and the K norm with their rotary, launched as one)."""
    if not combo:
        return batch_marked(torch.compile(fn, fullgraph=True, dynamic=None, mode=None if mode == "default" else mode))
    from torch._inductor import list_mode_options

    modes = dict(list_mode_options(mode)) if mode != "default" else {}
    return batch_marked(torch.compile(fn, fullgraph=True, dynamic=None, options={**modes, "combo_kernels": True}))


def raise_recompile_limit(shapes: int) -> None:
    """Dynamo stops compiling a function after ``recompile_limit`` versions (8 by default) and runs it
    eagerly from then on; decode needs one per batch bucket (10 for 512 slots), and runners of other
    dtypes or devices in the same process add theirs to the same functions: leave room for several."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), 4 * shapes))


def one_triton_cache(device: torch.device) -> None:
    """Every Triton kernel this process compiles cached in one place: Inductor's (``triton/<device index>`` in
    its cache directory), unless ``TRITON_CACHE_DIR`` says otherwise. Inductor sets ``TRITON_CACHE_DIR`` only
    when it first builds a kernel of its own; the engine's own kernels (the decode attention, the sampler)
    compiled before that went to Triton's default cache, those after it to Inductor's, and which came first
    differed between a cold start and a warm one. A warm start then missed the cache and compiled the small
    batch buckets' attention kernels again, over a second each."""
    if device.type == "cuda" and "TRITON_CACHE_DIR" not in os.environ:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(device.index or 0)


def prepare(device: torch.device, shapes: int) -> None:
    """What a compiling runner on ``device`` sets for its process before anything compiles: room for ``shapes``
    versions of each part (:func:`raise_recompile_limit`) and one Triton cache (:func:`one_triton_cache`)."""
    raise_recompile_limit(shapes)
    one_triton_cache(device)
