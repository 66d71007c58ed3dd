"""A decoder layer of the local engine split at its attention, as plain functions of their inputs.

``model_runner`` runs a step as ``project_qkv`` (input norm, Q/K/V, Qwen3's Q/K norms, rotary), its own
attention over the slot cache, then ``finish_layer`` (output projection, residuals, MLP). The functions
hold no runner state, so ``torch.compile`` reuses one compiled graph for every layer (the layer's
parameters are graph inputs). The transformers modules of the checkpoint's own class do the work
(Llama, Qwen2, Qwen3, GLM-4 with its sandwich norms and half-dim rotary, Qwen3-MoE, GLM-4.5).

The joined parts (``ModelRunner(join_layers=True)``, on with ``compile``) cut the step at the attentions
only: :func:`finish_then_project` is one layer's end and the next layer's start, :func:`finish_then_head`
the last layer's end with the final norm and output layer, :func:`embed_and_rotary` the step's start. Run
eagerly they are the same ops in the same order as the separate parts; compiled, each is one graph, so
the residual add that ends a layer fuses into the norm that starts the next (one kernel and one round
trip of the hidden state fewer per layer) and the final norm and rotary tables are fused kernels instead
of eager chains of small ones.
"""

from __future__ import annotations

import sys

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
    (GLM-4.5). The same sum as the block's own ``forward`` (Qwen3-MoE, GLM-4.5). ``gate_up``: a dense
    SwiGLU's ``down(act(gate(x)) * up(x))`` with gate and up as one matmul.
    ``x`` ``[n, q, hidden]`` -> ``(y [n, q, hidden], ids [n * q, k] or None)``."""
    if gate_up is not None:
        gate, up = run_fused(gate_up, x)
        return mlp.down_proj(mlp.act_fn(gate) * up), None
    if not hasattr(mlp, "experts"):
        return mlp(x), None
    flat = x.reshape(-1, x.shape[-1])
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
    Given the plain parts they are the joined step, compiled as one graph each; given separately compiled
    parts, the unjoined step (with the head eager)."""
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
