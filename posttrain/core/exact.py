"""Batch-invariant arithmetic for exactly on-policy runs (``rollout.exact``): the engine and the trainer call
these same functions, so a sampled token's log-prob is the same float on both sides, bit for bit.

A float sum depends on the order of its terms, and a matmul library picks that order by shape: one decode row
is a matrix-vector product (another kernel than the trainer's thousand-row GEMM), a fused Q/K/V projection has
another column count than three separate ones, a padded vocabulary is wider than the engine's. Here every
reduction has a fixed order that depends on neither:

- :func:`bmm` (and :func:`mm`): ``[B, M, K] @ [B, K, N]`` cut into fixed tiles ``[ROWS, K] @ [K, COLS]`` (rows and
  columns zero-padded to the tile), all run as one batched matmul of that one shape. Element ``(i, j)`` is then
  the same tile kernel's dot product of row ``i`` and column ``j`` whatever ``M``, ``N`` or the other rows are.
  On CUDA with Triton the tiles are one kernel of fixed blocks (:mod:`posttrain.core.exact_kernel`) whose
  ``K`` loop runs in order, no split-K.
- :func:`row_sum`: ``sum_k x_k`` as blocks of ``SUM_BLOCK`` terms (each a tile dot with ones) added left to
  right. Zero padding adds exact zeros, so a padded vocabulary or a longer key span gives the same sum.
- :func:`attention`: ``softmax(q k^T * scale) v`` over keys ``j <= pos(q)``, computed as
  ``m = max_j s_j``, ``e_j = exp(s_j - m)`` (exactly 0 where masked), then key blocks of ``KEY_BLOCK`` added
  left to right: ``o = sum_b (e_b @ [v_b, 1]) ; o[:D] / o[D]``. The engine's prefill, its decode over a KV
  cache span of any length and the trainer's causal forward thus reduce in the same order.
- :func:`rms_norm`, :func:`silu`, :func:`log_softmax`: fixed formulas over the above (fp32 inside).
- :func:`moe`: a MoE layer's routed experts summed in ascending expert id, plus its shared experts; the weights
  (:func:`routing_weights`) and the choice (:func:`choose_experts`) follow a :class:`Routing` (softmax or sigmoid
  scores, renormalized, scaled, group-limited).

Elementwise ops (``exp``, ``log``, ``rsqrt``, ``+``, ``*``, ``/``) give the same value for an element wherever
it sits; torch's fused ``sigmoid``/``silu`` do not on the CPU (their vectorized and scalar tails differ), so
:func:`silu` is ``x / (1 + exp(-x))`` and :func:`sigmoid` ``1 / (1 + exp(-x))``.

:func:`mode` is a torch dispatch mode under which every ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` goes through
:func:`bmm`, so unmodified layers (``nn.Linear``, Megatron's parallel linears) become batch-invariant; their
backward passes run outside it. It refuses fused attention kernels, which would break the guarantee silently.
:func:`enable` marks the process as exact (read by samplers through :func:`enabled`).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ROWS = 16  # tile rows (M)
COLS = 16  # tile columns (N)
SUM_BLOCK = 64  # terms per block of row_sum
KEY_BLOCK = 16  # keys per block of attention

_STATE = threading.local()
_ENABLED = False


def enable(on: bool = True) -> None:
    """Mark this process as running exact mode (engines' samplers then use :func:`log_softmax`)."""
    global _ENABLED
    _ENABLED = bool(on)


def enabled() -> bool:
    """Whether :func:`enable` was called in this process."""
    return _ENABLED


def _raw_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The library's own batched matmul, even under :func:`mode`."""
    _STATE.raw = getattr(_STATE, "raw", 0) + 1
    try:
        if a.is_cuda:
            from posttrain.core.exact_kernel import tiled_bmm, triton_ok

            if triton_ok():
                return tiled_bmm(a, b)
        return torch.bmm(a, b)
    finally:
        _STATE.raw -= 1


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [B, M, K] @ b [B, K, N] -> [B, M, N]`` (the inputs' dtype), each element computed by one fixed-shape
    tile product ``[ROWS, K] @ [K, COLS]``: batch-invariant in ``M``, ``N`` and ``B``."""
    bsz, m, k = a.shape
    n = b.shape[2]
    mp, np_ = -(-m // ROWS) * ROWS, -(-n // COLS) * COLS
    if a.is_cuda:  # the Triton kernel's blocks are the tiles: no copies
        from posttrain.core.exact_kernel import triton_ok

        if triton_ok():
            return _raw_bmm(a, b)
    a = F.pad(a, (0, 0, 0, mp - m)) if mp > m else a
    b = F.pad(b, (0, np_ - n)) if np_ > n else b
    nr, nc = mp // ROWS, np_ // COLS
    at = a.reshape(bsz, nr, 1, ROWS, k).expand(bsz, nr, nc, ROWS, k).reshape(-1, ROWS, k)
    bt = b.reshape(bsz, k, nc, COLS).permute(0, 2, 1, 3).unsqueeze(1).expand(bsz, nr, nc, k, COLS)
    out = _raw_bmm(at, bt.reshape(-1, k, COLS))  # [bsz * nr * nc, ROWS, COLS]
    out = out.view(bsz, nr, nc, ROWS, COLS).permute(0, 1, 3, 2, 4).reshape(bsz, mp, np_)
    return out[:, :m, :n]


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` through :func:`bmm`."""
    return bmm(a.unsqueeze(0), b.unsqueeze(0))[0]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T (+ bias)`` through :func:`mm` -> ``[..., N]``."""
    out = mm(x.reshape(-1, x.shape[-1]), weight.t()).reshape(*x.shape[:-1], weight.shape[0])
    return out + bias if bias is not None else out


def _zero_tail_safe(x: torch.Tensor) -> bool:
    """Whether :func:`bmm` on ``x``'s device sums ``K`` in fixed chunks from 0 (the Triton kernel): one product over a
    zero-padded ``K`` then equals the blocked sums, with no loop over blocks."""
    if not x.is_cuda:
        return False
    from posttrain.core.exact_kernel import triton_ok

    return triton_ok()


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """``sum_k x[..., k]`` -> ``[..., 1]``: blocks of ``SUM_BLOCK`` terms (one tile dot with ones each, zero
    padded) added left to right, so trailing zeros never change the sum (on CUDA one product of the kernel's
    in-order chunks, which has the same property)."""
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    if _zero_tail_safe(flat):
        return mm(flat, flat.new_ones(k, 1)).reshape(*x.shape[:-1], 1)
    kp = -(-k // SUM_BLOCK) * SUM_BLOCK
    if kp > k:
        flat = F.pad(flat, (0, kp - k))
    ones = flat.new_ones(SUM_BLOCK, 1)
    acc = None
    for at in range(0, kp, SUM_BLOCK):
        part = mm(flat[:, at:at + SUM_BLOCK], ones)
        acc = part if acc is None else acc + part
    return acc.reshape(*x.shape[:-1], 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))``, the mean over the last dim in fp32 (:func:`row_sum`), rounded
    to ``x``'s dtype before the weight (HF's order)."""
    x32 = x.float()
    y = x32 * torch.rsqrt(row_sum(x32 * x32) / x.shape[-1] + eps)
    return weight * y.to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x / (1 + exp(-x))``: the same value for an element wherever it sits in a tensor."""
    return x / (1.0 + torch.exp(-x))


def log_softmax(z: torch.Tensor) -> torch.Tensor:
    """``z - lse`` with ``lse = m + log(row_sum(exp(z - m)))``, ``m = max z``, over the last dim (fp32)."""
    z = z.float()
    m = z.amax(-1, keepdim=True)
    return z - (m + torch.log(row_sum(torch.exp(z - m))))


def softmax(z: torch.Tensor) -> torch.Tensor:
    """``exp(z - m) / row_sum(exp(z - m))`` over the last dim, fp32."""
    z = z.float()
    e = torch.exp(z - z.amax(-1, keepdim=True))
    return e / row_sum(e)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))``: the same value for an element wherever it sits (torch's fused ``sigmoid`` on a CPU
    gives elements in a vector's scalar tail another last bit)."""
    return 1.0 / (1.0 + torch.exp(-x))


@dataclass(frozen=True)
class Routing:
    """How a MoE layer's router turns logits ``[m, E]`` into the experts of each token and their weights.

    ``score``: ``softmax`` (Qwen3-MoE) or ``sigmoid`` (GLM-4.5, DeepSeek-V3). ``normalize``: the chosen experts'
    scores divided by their sum (``norm_topk_prob``). ``scale``: then times ``routed_scaling_factor``.
    ``groups``/``group_top_k``: the experts are ``groups`` equal groups and a token chooses only within the
    ``group_top_k`` groups of largest top-2 score sum (``n_group``/``topk_group``). ``fp32``: the router's matmul
    runs in fp32 (GLM's and DeepSeek's routers; Qwen3-MoE's runs in the model's dtype)."""

    top_k: int
    score: str = "softmax"
    normalize: bool = True
    scale: float = 1.0
    groups: int = 1
    group_top_k: int = 1
    fp32: bool = False

    def __post_init__(self):
        if self.score not in ("softmax", "sigmoid"):
            raise ValueError(f"exact mode: router score function {self.score!r} is not covered (softmax, sigmoid)")


def router_logits(x: torch.Tensor, weight: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``x [m, H] @ weight [E, H]^T -> [m, E]`` through :func:`linear`, in fp32 when ``routing.fp32``."""
    return linear(x.float(), weight.float()) if routing.fp32 else linear(x, weight)


def router_scores(logits: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``softmax(logits)`` (:func:`softmax`) or ``sigmoid(logits)`` (:func:`sigmoid`), fp32, ``[m, E]``."""
    return softmax(logits) if routing.score == "softmax" else sigmoid(logits.float())


def choose_experts(logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``top_k`` experts of each token -> ids ``[m, k]`` long: the largest ``c = score + bias`` (``bias [E]``,
    e.g. ``e_score_correction_bias``, steers the choice only). With groups, HF's group-limited rule: a group's
    score is the sum of its two largest ``c``; only the ``group_top_k`` best groups' experts compete."""
    c = router_scores(logits, routing)
    c = c + bias.float() if bias is not None else c
    if routing.groups > 1:
        m, e = c.shape
        per = c.view(m, routing.groups, e // routing.groups)
        best = per.topk(min(2, per.shape[-1]), dim=-1).values.sum(-1)  # [m, groups]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(routing.group_top_k, -1).indices, True)
        c = c.masked_fill(~keep.repeat_interleave(e // routing.groups, 1), float("-inf"))
    return c.topk(routing.top_k, dim=-1).indices


def chosen_mask(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Expert ids ``[m, k]`` -> ``[m, E]`` bool, True at each token's chosen experts."""
    return torch.zeros(ids.shape[0], num_experts, dtype=torch.bool, device=ids.device).scatter_(1, ids, True)


def routing_weights(logits: torch.Tensor, chosen: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Each token's weight of each expert, ``[m, E]`` fp32, 0 where not ``chosen [m, E]``::

        w = score(logits) where chosen, else 0
        w = w / row_sum(w)            (routing.normalize)
        w = w * routing.scale         (routing.scale != 1)

    The experts are the engine's choice (or, under routing replay, the trainer's replay of it): the weights are a
    function of the logits at them alone, differentiable in ``logits``."""
    w = torch.where(chosen, router_scores(logits, routing), 0.0)
    if routing.normalize:
        w = w / row_sum(w)
    return w * routing.scale if routing.scale != 1.0 else w


def moe(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, expert, shared=None) -> torch.Tensor:
    """A MoE layer's output for tokens ``x [m, H]``, the experts each token goes to, ``chosen [m, E]`` bool, and
    their weights ``weights [m, E]`` (:func:`routing_weights`)::

        y = sum_e w_e * expert(e, x)     over the chosen experts in ascending id, from 0
        y = y + shared(x)                (shared experts, ungated: GLM-4.5, DeepSeek-V3)

    ``expert(e, rows [r, H]) -> [r, H]``, ``shared(x [m, H]) -> [m, H]``. Each token's sum runs in expert-id order,
    whatever order a top-k or a dispatcher lists its experts in; differentiable in ``x``, ``weights`` and the
    experts' weights."""
    out = x.new_zeros(x.shape)
    for e in range(chosen.shape[1]):
        rows = chosen[:, e].nonzero()[:, 0]
        if rows.numel():
            out = out.index_add(0, rows, expert(e, x[rows]) * weights[rows, e, None].to(x.dtype))
    return out + shared(x) if shared is not None else out


def swiglu_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate) * up)`` with ``[gate; up] = gate_up [2F, H]`` (gate rows first), ``down [H, F]``."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(silu(gate) * up, down)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """:func:`swiglu_expert` with the gate ``[F, H]`` and up ``[F, H]`` projections apart: the same bits, since
    :func:`linear`'s element ``(i, j)`` does not depend on the other columns."""
    return linear(silu(linear(x, gate)) * linear(x, up), down)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention by position: query ``i`` of row ``b`` (at position ``q_pos[b, i]``) attends to keys
    ``j <= q_pos[b, i]``. ``q [B, H, Sq, D]``, ``k [B, Hkv, Sk, D]``, ``v [B, Hkv, Sk, Dv]`` (key ``j`` at position
    ``j``; GQA: query head ``h`` reads KV head ``h // (H / Hkv)``; ``Dv`` may differ from ``D``, as in multi-head
    latent attention), ``q_pos [B, Sq]`` int -> ``[B, H, Sq, Dv]`` in ``q``'s dtype.

    fp32 inside: ``s = (q k^T) * scale`` (:func:`bmm`), masked to ``-inf``; ``e = exp(s - max s)``; then key
    blocks of ``KEY_BLOCK`` from position 0: ``acc += e_b @ [v_b, 1]`` (numerator and denominator in one
    :func:`bmm`); ``o = acc[:Dv] / acc[Dv]``. Masked keys add exact zeros, so the result does not depend on how
    many keys past ``q_pos`` are present (a decode's cache span, a padded training row)."""
    bsz, heads, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    skp = -(-sk // KEY_BLOCK) * KEY_BLOCK
    kf, vf = k.float(), v.float()
    if heads != hkv:
        kf, vf = kf.repeat_interleave(heads // hkv, 1), vf.repeat_interleave(heads // hkv, 1)
    if skp > sk:
        kf, vf = F.pad(kf, (0, 0, 0, skp - sk)), F.pad(vf, (0, 0, 0, skp - sk))
    vf = torch.cat([vf, vf.new_ones(*vf.shape[:-1], 1)], -1)  # [B, H, Skp, Dv + 1]: the denominator's column
    s = bmm(q.float().reshape(bsz * heads, sq, d), kf.reshape(bsz * heads, skp, d).transpose(1, 2)) * scale
    allowed = torch.arange(skp, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [B, Sq, Skp]
    s = s.view(bsz, heads, sq, skp).masked_fill(~allowed[:, None], float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True)).reshape(bsz * heads, sq, skp)
    vf = vf.reshape(bsz * heads, skp, dv + 1)
    if _zero_tail_safe(vf):  # the kernel's K chunks are the key blocks: one product
        acc = bmm(e, vf)
        return (acc[..., :dv] / acc[..., dv:]).reshape(bsz, heads, sq, dv).to(q.dtype)
    acc = None
    for at in range(0, skp, KEY_BLOCK):
        part = bmm(e[:, :, at:at + KEY_BLOCK], vf[:, at:at + KEY_BLOCK])
        acc = part if acc is None else acc + part
    out = acc[..., :dv] / acc[..., dv:]
    return out.reshape(bsz, heads, sq, dv).to(q.dtype)


def align_inv_freq(inv_freq: torch.Tensor, base: float) -> bool:
    """Overwrite a rotary table's ``inv_freq [D/2]`` with ``1 / base^(2i / D)`` computed on the CPU in fp32 (HF's and
    Megatron's formula): a table computed on a GPU may differ from one computed on the CPU in the last bit of
    ``pow``. Only where it already holds that formula to 1e-5 (a scaled or partial rotary is left alone); returns
    whether it was written."""
    dim = 2 * inv_freq.numel()
    want = 1.0 / (float(base) ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    if not torch.allclose(inv_freq.detach().float().cpu(), want, rtol=1e-5, atol=0.0):
        return False
    with torch.no_grad():
        inv_freq.copy_(want.to(inv_freq.device, inv_freq.dtype))
    return True


class RMSNormForward:
    """A norm module's ``forward`` replaced by :func:`rms_norm` with its own weight and epsilon."""

    def __init__(self, module: torch.nn.Module, eps: float):
        self.module, self.eps = module, float(eps)

    def __call__(self, x, *args, **kwargs):
        return rms_norm(x, self.module.weight, self.eps)


def is_rms_norm(module: torch.nn.Module) -> bool:
    """An RMSNorm by class (torch's, transformers', Megatron's wrappers): a ``[d]`` weight, no bias, an epsilon."""
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    return ("RMSNorm" in name and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and getattr(module, "bias", None) is None and norm_eps(module) is not None)


def norm_eps(module: torch.nn.Module) -> float | None:
    """The epsilon an RMSNorm module adds (``variance_epsilon``, ``eps`` or ``epsilon``; torch's None: its dtype's)."""
    for attr in ("variance_epsilon", "eps", "epsilon"):
        if hasattr(module, attr):
            eps = getattr(module, attr)
            if eps is None and isinstance(module, torch.nn.RMSNorm):
                return float(torch.finfo(module.weight.dtype).eps)
            return float(eps) if isinstance(eps, (int, float)) else None
    return None


def patch_norms(model: torch.nn.Module) -> int:
    """Every RMSNorm of ``model`` (:func:`is_rms_norm`) computes :func:`rms_norm`; returns how many."""
    count = 0
    for module in model.modules():
        if is_rms_norm(module):
            module.forward = RMSNormForward(module, norm_eps(module))
            count += 1
    return count


_REFUSED = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_fused_rms_norm")


class _ExactMode(TorchDispatchMode):
    """mm / addmm / bmm / baddbmm through :func:`bmm`; fused attention kernels refused."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_STATE, "raw", 0):
            return func(*args, **kwargs)
        aten = torch.ops.aten
        if func is aten.mm.default:
            return mm(*args)
        if func is aten.bmm.default:
            return bmm(*args)
        if func in (aten.addmm.default, aten.baddbmm.default):
            bias, a, b = args[:3]
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            out = mm(a, b) if func is aten.addmm.default else bmm(a, b)
            out = out if alpha == 1 else out * alpha
            return out if beta == 0 else out + (bias if beta == 1 else bias * beta)
        if any(part in str(func) for part in _REFUSED):
            raise RuntimeError(f"exact mode: {func} is not batch-invariant; this path has no exact version")
        return func(*args, **kwargs)


def mode():
    """A context under which matmuls are batch-invariant (see the module docstring)."""
    return _ExactMode()


def maybe(on: bool):
    """:func:`mode` when ``on``, else a no-op context."""
    return _ExactMode() if on else contextlib.nullcontext()
