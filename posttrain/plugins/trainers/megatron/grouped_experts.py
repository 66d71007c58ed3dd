"""``GroupedExperts``: all local experts of a MoE layer in two grouped matmuls, no Transformer Engine.

Megatron's ``SequentialMLP`` runs ``E`` local experts one after another, each its own ``fc1``, SwiGLU,
prob-scaling and ``fc2`` (five or more kernels per expert: 640+ launches per layer at 128 experts, most
of them tiny elementwise ones). Here the dispatcher's permuted tokens (sorted by local expert,
``x [N, H]``, counts ``c [E]``, offsets ``o = cumsum(c)``) go through::

    h = x_e W1_e^T                   for the rows of each expert e   [N, 2F]   (one grouped GEMM)
    a = p * silu(h[:, :F]) * h[:, F:]                                 [N, F]    (one pass)
    y = a_e W2_e^T                                                    [N, H]    (one grouped GEMM)

and backward, with ``g = dL/dy``, ``s = silu(h_gate) * h_up`` (recomputed from ``h``)::

    dW2_e = g_e^T a_e,  da = g_e W2_e,  dp = sum_f da * s,  ds = p * da,
    dh = [ds * h_up * silu'(h_gate), ds * silu(h_gate)],  dW1_e = dh_e^T x_e,  dx = dh_e W1_e

(four grouped GEMMs). The GEMMs are ``torch._grouped_mm`` where it has a kernel (CUDA bf16 on sm80+,
and the CPU), else a loop over the experts' row blocks. The activation and its backward run in fp32,
one Triton kernel each on CUDA (:mod:`~posttrain.plugins.trainers.megatron.swiglu`).

Weights, state-dict keys and sharded checkpoints are ``SequentialMLP``'s, unchanged (this class *is*
one): ``local_experts.e.linear_fc1.weight [2F/tp, H]`` and ``linear_fc2.weight [H, F/tp]``, so HF
conversion, export, EP/expert-TP sharding and the optimizer see the same parameters. The forward
stacks them (``[E, 2F, H]``, ``[E, H, F]``: one copy of the layer's expert weights, freed after each
GEMM) and the backward stacks them again instead of keeping the stack alive between the passes.
Saved for backward: ``x``, ``h`` and ``p`` (``SequentialMLP`` keeps ``a`` too).

The token permutation stays Megatron's all-to-all dispatcher's (EP and expert TP work unchanged; with
expert TP each rank's ``y`` is a partial sum the dispatcher reduces, exactly as for ``SequentialMLP``).
``config.moe_grouped_gemm`` chooses: True (the MoE specs' default) runs the grouped path, False runs
``SequentialMLP``'s loop (``trainer.backend.megatron.moe_grouped_gemm: false``). Configs the grouped
path does not cover (expert biases, a non-SwiGLU activation, fp8, probs applied on the input) also run
the loop.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from posttrain.plugins.trainers.megatron.swiglu import swiglu_backward, swiglu_forward


def _kernel_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: bf16 on CUDA or a float CPU tensor, every
    leading stride a multiple of 16 bytes, and at least one row."""
    if not hasattr(torch, "_grouped_mm") or a.numel() == 0 or b.numel() == 0:
        return False
    if a.is_cuda:
        if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or torch.cuda.get_device_capability(a.device)[0] < 8:
            return False
    elif a.device.type != "cpu":
        return False
    align = 16 // a.element_size()
    return all(max(t.stride()[-2:]) % align == 0 for t in (a, b))


def gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, counts: list[int], kernel: bool = True) -> torch.Tensor:
    """``[N, K] x [E, K, M] -> [N, M]``: rows ``offs[e-1]:offs[e]`` of ``x`` times ``w[e]``."""
    if kernel and _kernel_ok(x, w):
        return torch._grouped_mm(x, w, offs=offs)
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(x[start:start + n], w[e], out=out[start:start + n])
        start += n
    return out


def gmm_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, counts: list[int],
              kernel: bool = True) -> torch.Tensor:
    """``[K, N] x [N, M] -> [E, K, M]``: per expert ``a[:, rows_e] @ b[rows_e]`` (zeros for an expert
    with no rows), the weight gradient of a grouped GEMM."""
    if kernel and _kernel_ok(a, b):
        return torch._grouped_mm(a, b, offs=offs)
    out = a.new_zeros(len(counts), a.shape[0], b.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(a[:, start:start + n], b[start:start + n], out=out[e])
        start += n
    return out


class GroupedSwiGLUExperts(torch.autograd.Function):
    """``(x [N, H], p [N], counts [E] (CPU int), kernel, *W1 (E x [2F, H]), *W2 (E x [H, F])) -> y [N, H]``:
    the module docstring's forward and backward; gradients for ``x``, ``p`` and every weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor, kernel: bool,
                *weights: torch.Tensor) -> torch.Tensor:
        n_exp = len(weights) // 2
        count_list = [int(c) for c in counts.tolist()]
        offs = torch.cumsum(counts, 0).to(torch.int32).to(x.device, non_blocking=True)
        h = gmm(x, torch.stack(weights[:n_exp]).transpose(1, 2), offs, count_list, kernel)  # [N, 2F]
        a = swiglu_forward(h, probs)  # [N, F]
        y = gmm(a, torch.stack(weights[n_exp:]).transpose(1, 2), offs, count_list, kernel)  # [N, H]
        ctx.save_for_backward(x, probs, h, offs, *weights)
        ctx.counts, ctx.kernel, ctx.n_exp = count_list, kernel, n_exp
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, probs, h, offs, *weights = ctx.saved_tensors
        counts, kernel, n_exp = ctx.counts, ctx.kernel, ctx.n_exp
        dy = dy.contiguous()
        w1, w2 = torch.stack(weights[:n_exp]), torch.stack(weights[n_exp:])  # [E, 2F, H], [E, H, F]
        da = gmm(dy, w2, offs, counts, kernel)  # [N, F]
        del w2
        a, dh, dprobs = swiglu_backward(h, probs, da)  # [N, F], [N, 2F], [N]
        del da
        dw2 = gmm_wgrad(dy.t(), a, offs, counts, kernel)  # [E, H, F]
        del a
        dw1 = gmm_wgrad(dh.t(), x, offs, counts, kernel)  # [E, 2F, H]
        dx = gmm(dh, w1, offs, counts, kernel)  # [N, H]
        dws = [*dw1.unbind(0), *dw2.unbind(0)]
        _add_to_main_grads(weights, dws)
        return (dx, dprobs, None, None, *dws)


def _add_to_main_grads(weights: tuple[torch.Tensor, ...], grads: list[torch.Tensor]) -> None:
    """Accumulate the experts' weight gradients into Megatron DDP's fp32 ``main_grad`` buffers in one
    foreach call and mark them added (``grad_added_to_main_grad``, as Megatron's fused weight-gradient
    linears do), so DDP's per-parameter hook skips its own ``add_``. Without DDP (the CPU trainer) the
    parameters have no ``main_grad`` and autograd accumulates ``.grad`` as usual."""
    if not all(hasattr(w, "main_grad") and hasattr(w, "grad_added_to_main_grad")
               and not getattr(w, "zero_out_wgrad", False) for w in weights):
        return
    torch._foreach_add_([w.main_grad for w in weights], grads)
    for w in weights:
        w.grad_added_to_main_grad = True


class GroupedExperts(SequentialMLP):
    """``SequentialMLP``'s parameters and checkpoints, the experts' GEMMs grouped (module docstring).

    ``forward(x [N, H] sorted by local expert, tokens_per_expert [E], probs [N]) -> (y [N, H], None)``.
    ``kernel=False`` keeps the grouped formulation but loops over experts for the GEMMs (tests)."""

    kernel = True

    def __init__(self, num_local_experts: int, config: Any, submodules: Any, pg_collection: Any = None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        cfg = self.config
        self.grouped = bool(getattr(cfg, "moe_grouped_gemm", False)) and cfg.gated_linear_unit \
            and cfg.activation_func is F.silu and not cfg.add_bias_linear and not cfg.moe_apply_probs_on_input \
            and not getattr(cfg, "fp8", None) and not getattr(cfg, "fp4", None) \
            and getattr(cfg, "activation_func_clamp_value", None) is None \
            and not getattr(cfg, "glu_linear_offset", 0.0)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        if not self.grouped:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        counts = torch.as_tensor(tokens_per_expert).detach().to("cpu", torch.int64)
        weights = [e.linear_fc1.weight for e in self.local_experts] + [e.linear_fc2.weight for e in self.local_experts]
        y = GroupedSwiGLUExperts.apply(permuted_local_hidden_states, permuted_probs, counts, self.kernel, *weights)
        return y, None
