"""``torch.compile`` of a Megatron transformer layer (``trainer.backend.compile``), with its input in one layout.

Dynamo guards on every stride of a layer's ``hidden_states`` ``[s, b, h]``, also on the stride of a size-1
dimension, which no computation reads. A packed micro-batch is one sequence of ``s`` tokens (``b = 1``), and
the first layer gets Megatron's embedding output, a transposed view whose ``b`` stride is ``s * h``, while every
later layer gets a fresh tensor whose ``b`` stride is ``h``: each compiled frame of the layer (and of the frames
after its graph breaks) compiled once for each layout, and again for each once the token count changed. The
wrapper hands every layer the ``(h, h, 1)`` layout (a view: no copy), and, where the token count changes with
every micro-batch (packed sequences), marks it symbolic from the first call, so each frame compiles once
instead of static first and symbolic after (bench/RESULTS.md: a colocated run's first train step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def compiled_layer(forward: Callable[..., Any], symbolic_tokens: bool) -> Callable[..., Any]:
    """``forward`` (a transformer layer's bound ``forward``) compiled, called with its ``hidden_states``
    (keyword or first positional) ``[s, b, h]`` in the standard layout when ``b == 1``, and ``s`` marked
    symbolic with ``symbolic_tokens``."""
    import torch

    compiled = torch.compile(forward)

    def run(*args: Any, **kwargs: Any) -> Any:
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = _standard(kwargs["hidden_states"], symbolic_tokens)
        elif args:
            args = (_standard(args[0], symbolic_tokens), *args[1:])
        if symbolic_tokens:
            _symbolic_tokens(kwargs)
        return compiled(*args, **kwargs)

    return run


def _standard(hidden: Any, symbolic_tokens: bool) -> Any:
    import torch

    if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
        if hidden.shape[1] == 1:  # [s, 1, h] with strides (h, h, 1), whatever the size-1 dimension's was
            hidden = hidden.squeeze(1).unsqueeze(1)
        if symbolic_tokens:
            torch._dynamo.maybe_mark_dynamic(hidden, 0)
    return hidden


def _symbolic_tokens(kwargs: dict[str, Any]) -> None:
    """The layer's other inputs, which change with every packed micro-batch too, symbolic from the first call:
    the first dimension of its tensors (the rotary table, ``[longest sample, 1, 1, d]``) and the packed
    sequences' boundaries (``cu_seqlens``, one more than the micro-batch's samples)."""
    import torch

    for value in kwargs.values():
        if isinstance(value, torch.Tensor) and value.dim():
            torch._dynamo.maybe_mark_dynamic(value, 0)
    packed = kwargs.get("packed_seq_params")
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        value = getattr(packed, name, None)
        if isinstance(value, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(value, 0)
