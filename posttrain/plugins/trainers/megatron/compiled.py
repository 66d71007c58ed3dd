"""``torch.compile`` of a Megatron transformer layer (``trainer.backend.compile``), with its input in one layout.

Dynamo guards on every stride of a layer's ``hidden_states`` ``[s, b, h]``, also on the stride of a size-1
dimension, which no computation reads. A packed micro-batch is one sequence of ``s`` tokens (``b = 1``), and
the first layer gets Megatron's embedding output, a transposed view whose ``b`` stride is ``s * h``, while every
later layer gets a fresh tensor whose ``b`` stride is ``h``: each compiled frame of the layer (and of the frames
after its graph breaks) compiled once for each layout, and again for each once the token count changed. The
wrapper hands every layer the ``(h, h, 1)`` layout, and, where the token count changes with every micro-batch
(packed sequences), marks it symbolic from the first call, so each frame compiles once instead of static first
and symbolic after (a colocated run's first train step). The first layer's input is given as a
tensor that is not a view (Megatron's ``make_viewless_tensor``: the same memory, no copy): Dynamo guards on a
view's base too, and the embedding's base (``[s, 1, h]`` with a ``b`` stride of ``s * h`` in training) failed the
guard of every later layer's input, a recompile of both once a micro-batch met a new guard.

The layers compile with Inductor's ``triton.mix_order_reduction_non_strict_mode``. Its default (strict) fuses a
norm's two backward reductions (over each token's channels, over the tokens for the weight's gradient) only
when the tensor is large enough, and that size check becomes a guard on the symbolic token count: on an H100 at
Qwen3-1.7B, ``5120 <= tokens``, so the first micro-batch of fewer than 5120 tokens (a step's last, under
``trainer.max_tokens_per_micro_batch``) recompiled every layer frame mid-run, a train phase four times its
usual length. Non-strict, the choice does not depend on the size and leaves no guard.

Megatron-core 0.16's ``RowParallelLinear.forward`` (the attention's output projection, the MLP's down projection)
hands its matmul ``tp_group=None``, so every call asks ``get_tensor_model_parallel_group_if_none`` for the default
group, which on rank 0 issues a ``DeprecationWarning`` first: ``warnings.warn`` is a graph break, twice a layer, and
each projection's frame then compiled once for each weight shape. :func:`quiet_group_lookups` gives Megatron's
modules the same lookup without the warning (rank 0 then compiles the graphs every other rank already does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def compiled_layer(forward: Callable[..., Any], symbolic_tokens: bool) -> Callable[..., Any]:
    """``forward`` (a transformer layer's bound ``forward``) compiled, called with its ``hidden_states``
    (keyword or first positional) ``[s, b, h]`` in the standard layout when ``b == 1``, and with
    ``symbolic_tokens`` the first dimension of its tensor inputs and the ``cu_seqlens`` symbolic."""
    import torch

    quiet_group_lookups()
    compiled = torch.compile(forward, options=inductor_options())

    def run(*args: Any, **kwargs: Any) -> Any:
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = _standard(kwargs["hidden_states"])
        elif args:
            args = (_standard(args[0]), *args[1:])
        if symbolic_tokens:
            _symbolic_tokens((*args, *kwargs.values()), kwargs.get("packed_seq_params"))
        return compiled(*args, **kwargs)

    return run


def inductor_options() -> dict[str, Any]:
    """Inductor's options for a compiled layer: mix-order reductions without their size guard (module docstring),
    where this torch has the option."""
    import torch._inductor.config as inductor

    return {"triton.mix_order_reduction_non_strict_mode": True} if hasattr(
        inductor.triton, "mix_order_reduction_non_strict_mode") else {}


def _standard(hidden: Any) -> Any:
    """``hidden`` ``[s, 1, h]`` with strides ``(h, h, 1)``, whatever the size-1 dimension's was, and not a view (its
    memory, no copy; gradients pass through unchanged); other tensors as they are."""
    import torch

    if not (isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] == 1):
        return hidden
    if hidden.stride(1) != hidden.shape[2] * hidden.stride(2):  # s * h out of the embedding; h out of a layer
        hidden = hidden.squeeze(1).unsqueeze(1)
    if hidden._base is None:
        return hidden
    from megatron.core.utils import make_viewless_tensor

    return make_viewless_tensor(hidden, requires_grad=hidden.requires_grad, keep_graph=True)


def _symbolic_tokens(inputs: tuple[Any, ...], packed: Any) -> None:
    """The inputs that change with every packed micro-batch, symbolic from the first call: the first dimension
    of each tensor (``hidden_states``' token count, the rotary table's ``[longest sample, 1, 1, d]``) and the
    packed sequences' boundaries (``cu_seqlens``, one more than the micro-batch's samples)."""
    import torch

    boundaries = (getattr(packed, name, None) for name in ("cu_seqlens_q", "cu_seqlens_kv"))
    for value in (*inputs, *boundaries):
        if isinstance(value, torch.Tensor) and value.dim():
            torch._dynamo.maybe_mark_dynamic(value, 0)


def quiet_group_lookups() -> int:
    """Replace ``get_tensor_model_parallel_group_if_none`` in every loaded ``megatron`` module that imported it by
    the same lookup without its deprecation warning (the module docstring says why); returns how many modules
    were changed (0 once done, or with a Megatron that has no such function)."""
    import sys

    import torch

    from megatron.core import parallel_state, utils

    original = getattr(utils, "get_tensor_model_parallel_group_if_none", None)
    if original is None or getattr(original, "quiet", False):
        return 0

    def group_if_none(tp_group, is_expert=False, check_initialized=True):
        """Megatron's ``get_tensor_model_parallel_group_if_none``: ``tp_group``, else the default (expert)
        tensor-parallel group once ``torch.distributed`` and Megatron's groups exist."""
        if tp_group is None and torch.distributed.is_initialized() and parallel_state.is_initialized():
            if is_expert:
                return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
            return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)
        return original(tp_group, is_expert=is_expert, check_initialized=check_initialized)

    group_if_none.quiet, group_if_none.original = True, original
    changed = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and getattr(module, "get_tensor_model_parallel_group_if_none", None) is original:
            module.get_tensor_model_parallel_group_if_none = group_if_none
            changed += 1
    return changed
