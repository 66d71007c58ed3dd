"""A decoder layer of the local engine split at its attention, as plain functions of their inputs.

``model_runner`` runs a step as ``project_qkv`` (input norm, Q/K/V, Qwen3's Q/K norms, rotary), its own
attention over the slot cache, then ``finish_layer`` (output projection, residuals, MLP). The functions
hold no runner state, so ``torch.compile`` reuses one compiled graph for every layer (the layer's
parameters are graph inputs). The transformers modules of the checkpoint's own class do the work
(Llama, Qwen2, Qwen3, GLM-4 with its sandwich norms and half-dim rotary, Qwen3-MoE, GLM-4.5; DeepSeek-V3's
latent attention is ``mla``'s, its MoE MLP :func:`finish_layer`'s).

The decode step runs through the joined parts, which cut it at the attentions
only: :func:`finish_then_project` is one layer's end and the next layer's start, :func:`finish_then_head`
the last layer's end with the final norm and output layer, :func:`embed_and_rotary` the step's start. Run
eagerly they are the same ops in the same order as the separate parts; compiled, each is one graph, so
the residual add that ends a layer fuses into the norm that starts the next (one kernel and one round
trip of the hidden state fewer per layer) and the final norm and rotary tables are fused kernels instead
of eager chains of small ones.
"""

from __future__ import annotations

import sys

from posttrain.plugins.engines.local import moe_kernel
from posttrain.plugins.engines.local.fused import Fused, run_fused


def project_qkv(layer, h, cos, sin, rope, qkv: Fused | None = None):
    """A decoder layer up to its attention: input norm, Q/K/V projections, Qwen3's Q/K norms, rotary.

    ``h`` ``[n, q, hidden]``; ``cos``/``sin`` ``[n, q, D]`` -> ``q`` ``[n, H, q, D]``, ``k``/``v``
    ``[n, Hkv, q, D]``. ``qkv``: the three projections as one matmul (``fused.layer_parts``), else one
    module each.
    """
    attn = layer.self_attn
    n, q_len, _ = h.shape
    x = layer.input_layernorm(h)
    shape = (n, q_len, -1, attn.head_dim)
    if qkv is None:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    else:
        q, k, v = run_fused(qkv, x)
    q, k = q.view(shape), k.view(shape)
    v = v.view(shape).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm on queries and keys before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v


def project_raw(layer, h, cos, sin, rope, qkv: Fused | None = None):
    """:func:`project_qkv` without Qwen3's Q/K norms and the rotary, which the Triton decode attention then
    applies as it loads ``q`` and this step's ``k`` (``ModelRunner(rope_in_attention=True)``,
    ``decode_kernel.Rope``): ``h`` ``[n, q, hidden]`` -> ``q`` ``[n, H, q, D]``, ``k``/``v`` ``[n, Hkv, q, D]``
    (views of the projections). ``cos``, ``sin``, ``rope``: unused (the signature is :func:`project_qkv`'s)."""
    attn = layer.self_attn
    n, q_len, _ = h.shape
    x = layer.input_layernorm(h)
    q, k, v = (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)) if qkv is None else run_fused(qkv, x)
    shape = (n, q_len, -1, attn.head_dim)
    return q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)


def rope_in_attention_refusal(model, layers) -> str | None:
    """Why the decode attention cannot apply these layers' Q/K norms and rotary itself (``decode_kernel.Rope``:
    HF's ``rotate_half`` rotary over the whole head, per-head RMSNorms of weight ``[D]`` or none), or None
    when it can. Checked on the modules themselves (a few tiny calls), not by model name: a checkpoint whose
    rotary or norm computes something else (GLM's partial rotary, a norm over all heads) is refused."""
    import torch

    attn = layers[0].self_attn
    d = attn.head_dim
    try:
        weight = model.model.embed_tokens.weight
        probe = torch.zeros(1, 1, weight.shape[1], dtype=weight.dtype, device=weight.device)
        cos, _ = model.model.rotary_emb(probe, torch.zeros(1, 1, dtype=torch.long, device=weight.device))
        if cos.shape[-1] != d:
            return f"the rotary tables are {cos.shape[-1]} wide, not the head's {d}"
        g = torch.Generator().manual_seed(0)
        q, k, cos, sin = (torch.randn(shape, generator=g) for shape in ((1, 2, 1, d), (1, 1, 1, d), (1, 1, d), (1, 1, d)))
        got_q, got_k = rotary_of(model)(q, k, cos, sin)
        half = d // 2
        want = lambda x: x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]  # noqa: E731
        if not (torch.allclose(got_q, want(q), atol=1e-5) and torch.allclose(got_k, want(k), atol=1e-5)):
            return "the checkpoint's rotary is not rotate_half over the whole head"
    except Exception as exc:  # noqa: BLE001 - an unexpected rotary is a refusal, not a crash
        return f"its rotary could not be probed ({exc!r})"
    for i, layer in enumerate(layers):
        norms = [getattr(layer.self_attn, name, None) for name in ("q_norm", "k_norm")]
        if norms == [None, None]:
            continue
        eps = [None if n is None else rms_norm_eps(n, d) for n in norms]
        if None in eps or eps[0] != eps[1]:
            return f"layer {i}'s Q/K norms are not per-head RMSNorms of one epsilon"
    return None


def norm_epsilon(norm):
    """The epsilon a HF RMSNorm module adds (``variance_epsilon`` or ``eps``), or None."""
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", None))


def rms_norm_eps(norm, d: int) -> float | None:
    """The epsilon of ``norm`` if it is a per-head RMSNorm (weight ``[d]``, ``x * rsqrt(mean(x^2) + eps)``
    rounded to ``x``'s dtype, times the weight), else None; tried on one random row."""
    import torch

    weight = getattr(norm, "weight", None)
    eps = norm_epsilon(norm)
    if weight is None or tuple(weight.shape) != (d,) or not isinstance(eps, float):
        return None
    x = torch.randn(2, d, generator=torch.Generator().manual_seed(1)).to(device=weight.device, dtype=weight.dtype)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).float() * weight.float()
    with torch.no_grad():
        return eps if torch.allclose(norm(x).float(), want, atol=1e-2, rtol=1e-2) else None


def rotary_of(model):
    """The checkpoint's own ``apply_rotary_pos_emb(q, k, cos, sin)`` (from its modeling module): GLM's
    rotate only part of each head (and dense GLM-4 interleaved pairs); Llama's is the fallback."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return getattr(sys.modules.get(type(model).__module__), "apply_rotary_pos_emb", apply_rotary_pos_emb)


def finish_layer(layer, h, o, gate_up: Fused | None = None):
    """The rest of a decoder layer: output projection, residual, post-attention norm, MLP, residual.

    ``h`` ``[n, q, hidden]`` (the layer's input), ``o`` ``[n, H, q, D]`` (attention output) ->
    ``(h [n, q, hidden], expert ids [n * q, k] or None)``: a MoE layer also returns the experts it routed
    each token to (the routed-experts answer of ``return_routed_experts``). ``gate_up``: a dense MLP's
    gate and up projections as one matmul.
    """
    n, q_len, _ = h.shape
    attn = layer.self_attn.o_proj(o.transpose(1, 2).reshape(n, q_len, -1))
    if hasattr(layer, "post_self_attn_layernorm"):  # GLM-4's sandwich norms after attention and the MLP
        h = h + layer.post_self_attn_layernorm(attn)
        y, experts = mlp_forward(layer.mlp, layer.post_attention_layernorm(h), gate_up)
        return h + layer.post_mlp_layernorm(y), experts
    h = h + attn
    y, experts = mlp_forward(layer.mlp, layer.post_attention_layernorm(h), gate_up)
    return h + y, experts


def mlp_forward(mlp, x, gate_up: Fused | None = None):
    """A dense MLP, or a HF MoE block run through its own parts so the routing is visible:
    ``mlp.gate(x) -> (logits, weights [m, k], ids [m, k])``, ``mlp.experts(x, ids, weights)`` (HF's
    ``grouped_mm`` implementation by default: experts' matmuls grouped by expert in one kernel, sorted
    by expert with no host sync, so it can be captured in a CUDA graph), plus ungated shared experts
    (GLM-4.5). The same sum as the block's own ``forward`` (Qwen3-MoE, GLM-4.5). A block tagged by
    ``moe_kernel.set_moe_kernel`` runs its routing and experts through ``moe_kernel`` instead (fused routing,
    two grouped-GEMM launches with the SwiGLU and routing weights inside). ``gate_up``: a dense
    SwiGLU's ``down(act(gate(x)) * up(x))`` with gate and up as one matmul.
    ``x`` ``[n, q, hidden]`` -> ``(y [n, q, hidden], ids [n * q, k] or None)``."""
    if gate_up is not None:
        gate, up = run_fused(gate_up, x)
        return mlp.down_proj(mlp.act_fn(gate) * up), None
    if not hasattr(mlp, "experts"):
        return mlp(x), None
    exact_moe = getattr(mlp, "exact_moe", None)  # exact mode (exact_mode.adopt): core.exact's MoE arithmetic
    if exact_moe is not None:
        return exact_moe(x)
    flat = x.reshape(-1, x.shape[-1])
    if getattr(mlp, moe_kernel.TAG, False):  # fused routing and grouped expert kernels (moe_kernel)
        y, ids = moe_kernel.moe_forward(mlp, flat)
        y = y.reshape(x.shape)
    else:
        _, weights, ids = mlp.gate(flat)
        y = mlp.experts(flat, ids, weights).reshape(x.shape)
    if hasattr(mlp, "shared_experts"):
        y = y + mlp.shared_experts(x)
    return y, ids


def embed_and_rotary(model, tokens, positions):
    """The step's start: ``model`` is the HF model's decoder stack (``embed_tokens``, ``rotary_emb``).
    ``tokens``/``positions`` ``[n, q]`` -> ``(h [n, q, hidden], cos, sin [n, q, D])``."""
    h = model.embed_tokens(tokens)
    cos, sin = model.rotary_emb(h, positions)
    return h, cos, sin


def through_parts(finish, project):
    """The decode step between two attentions, built from a ``finish`` part (:func:`finish_layer`'s
    signature) and a ``project`` part (:func:`project_qkv`'s): ``(finish_then_project, finish_then_head)``.
    Given the plain parts they are the joined step, compiled as one graph each."""
    def finish_then_project(layer, nxt, h, o, cos, sin, rope, gate_up=None, next_qkv=None):
        """``finish`` of ``layer``, then ``project`` of the next layer ``nxt`` on its output:
        ``(h [n, q, hidden], expert ids or None, q, k, v)``."""
        h, experts = finish(layer, h, o, gate_up)
        return (h, experts, *project(nxt, h, cos, sin, rope, next_qkv))

    def finish_then_head(layer, h, o, norm, head, float_logits, gate_up=None):
        """``finish`` of the last layer, then the final ``norm`` and the output layer ``head`` on the last
        position: ``(logits [n, V] (float32 with ``float_logits``, else the model's dtype), expert ids or None)``."""
        h, experts = finish(layer, h, o, gate_up)
        logits = head(norm(h[:, -1]))
        return (logits.float() if float_logits else logits), experts

    return finish_then_project, finish_then_head


finish_then_project, finish_then_head = through_parts(finish_layer, project_qkv)  # the joined step
finish_then_project_raw = through_parts(finish_layer, project_raw)[0]  # the same for rope_in_attention
