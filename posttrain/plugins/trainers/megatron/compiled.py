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
    (keyword or first positional) ``[s, b, h]`` in the standard layout when ``b == 1``, and with
    ``symbolic_tokens`` the first dimension of its tensor inputs and the ``cu_seqlens`` symbolic."""
    import torch

    compiled = torch.compile(forward)

    def run(*args: Any, **kwargs: Any) -> Any:
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = _standard(kwargs["hidden_states"])
        elif args:
            args = (_standard(args[0]), *args[1:])
        if symbolic_tokens:
            _symbolic_tokens((*args, *kwargs.values()), kwargs.get("packed_seq_params"))
        return compiled(*args, **kwargs)

    return run


def _standard(hidden: Any) -> Any:
    """``hidden`` ``[s, 1, h]`` with strides ``(h, h, 1)``, whatever the size-1 dimension's was (a view)."""
    import torch

    if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] == 1:
        return hidden.squeeze(1).unsqueeze(1)
    return hidden


def _symbolic_tokens(inputs: tuple[Any, ...], packed: Any) -> None:
    """The inputs that change with every packed micro-batch, symbolic from the first call: the first dimension
    of each tensor (``hidden_states``' token count, the rotary table's ``[longest sample, 1, 1, d]``) and the
    packed sequences' boundaries (``cu_seqlens``, one more than the micro-batch's samples)."""
    import torch

    boundaries = (getattr(packed, name, None) for name in ("cu_seqlens_q", "cu_seqlens_kv"))
    for value in (*inputs, *boundaries):
        if isinstance(value, torch.Tensor) and value.dim():
            torch._dynamo.maybe_mark_dynamic(value, 0)
