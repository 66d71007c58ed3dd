"""Model FLOPs of a train step and the devices' peaks, for ``perf/mfu`` (model FLOPs utilization).

Per sample of ``s`` tokens (prompt + response), the forward pass of a decoder-only transformer with
``L`` layers, hidden ``h``, ``a`` query heads and ``k`` key/value heads of width ``d``, MLP width ``f``
(gated: three matrices; MoE layers: the router and the ``e`` routed experts each token uses, plus
shared experts, see :func:`active_matmul_params`) and vocabulary ``V`` takes::

    matmul = 2 s (sum over layers (h a d + 2 h k d + a d h + mlp_active) + h V)   # every linear layer, lm head
    attn   = 2 s^2 L a d                                                 # QK^T and AV (4 s^2 a d), causal half

and a train step three times that (backward = 2 x forward), no recomputation counted (model FLOPs, not
hardware FLOPs: Megatron's and NeMo's convention). Embedding lookups and norms are not counted; of a
vision-language model (a ``text_config`` beside a ``vision_config``) only the language model is.

Peaks are dense bf16 tensor-core TFLOP/s from the vendors' sheets, by device name; ``trainer.peak_tflops``
overrides them. A CPU has no such table entry (its peak depends on the part, cores and vector units) and
reports no ``perf/mfu`` unless ``trainer.peak_tflops`` is given.
"""

from __future__ import annotations

from typing import Any

PEAK_TFLOPS = {  # dense bf16, vendor data sheets (SXM parts); matched as substrings of the CUDA device name
    "H200": 989.0, "H100": 989.0, "H800": 989.0, "H20": 148.0, "GH200": 989.0, "B200": 2250.0, "B300": 2250.0,
    "A100": 312.0, "A800": 312.0, "L40S": 362.0, "L40": 181.0, "A10": 125.0, "L4": 121.0,
}


def active_matmul_params(hf: dict[str, Any]) -> tuple[int, int]:
    """``(active, total)`` matmul parameters of one token's forward pass: attention projections, the MLP
    of each layer and the output layer (the embedding lookup is not a matmul).

    A MoE layer (:func:`moe_layer_flags`: not among GLM's ``first_k_dense_replace`` first layers, not in
    Qwen's ``mlp_only_layers``, on every ``decoder_sparse_step``-th layer) counts its router ``E x h``,
    ``k = num_experts_per_tok`` routed experts and ``n_shared_experts`` shared ones, each a SwiGLU of width
    ``F = moe_intermediate_size`` (``3 h F``): active ``E h + (k + s) 3 h F``, total ``E h + (E + s) 3 h F``.
    A dense layer counts ``3 h intermediate_size``."""
    from posttrain.core.model_spec import moe_layer_flags, num_experts

    hf = hf.get("text_config") or hf
    h, ffn, vocab = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    hd = hf.get("head_dim") or h // heads
    attn = h * hd * (heads + 2 * groups) + heads * hd * h
    experts, topk = num_experts(hf), int(hf.get("num_experts_per_tok", 0) or 0)
    shared, moe_ffn = int(hf.get("n_shared_experts", 0) or 0), int(hf.get("moe_intermediate_size", 0) or 0)
    active = total = vocab * h
    for moe in moe_layer_flags(hf):
        if moe:
            active += attn + experts * h + (topk + shared) * 3 * h * moe_ffn
            total += attn + experts * h + (experts + shared) * 3 * h * moe_ffn
        else:
            active += attn + 3 * h * ffn
            total += attn + 3 * h * ffn
    return active, total


def forward_flops(hf: dict[str, Any], lengths: list[int]) -> float:
    """Forward model FLOPs over samples of ``lengths`` tokens under HF config ``hf`` (module docstring):
    ``2 x`` :func:`active_matmul_params` per token plus the causal attention matmuls."""
    hf = hf.get("text_config") or hf
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    d = hf.get("head_dim") or hf["hidden_size"] // heads
    tokens, squares = sum(lengths), sum(s * s for s in lengths)
    return 2.0 * tokens * active_matmul_params(hf)[0] + 2.0 * squares * layers * heads * d


def train_flops(hf: dict[str, Any], lengths: list[int]) -> float:
    """Model FLOPs of one train step (forward + backward) over samples of ``lengths`` tokens."""
    return 3.0 * forward_flops(hf, lengths)


def peak_flops(device: Any, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one ``device`` (a ``torch.device``): ``override_tflops`` if given, else the table's
    entry for a CUDA device's name; None when unknown (CPUs)."""
    if override_tflops:
        return override_tflops * 1e12
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "GH200" before "H200", "L40S" before "L40"
        if key in name:
            return PEAK_TFLOPS[key] * 1e12
    return None


def throughput_metrics(train_metrics: dict[str, float], tokens: int, step_s: float, train_s: float,
                       devices: int) -> dict[str, float]:
    """``perf/tokens_per_s_per_gpu``: prompt + response tokens trained per second of the whole step, per
    device of the run (NeMo-RL's form; trainer ranks on CPU), and ``perf/mfu``: the train step's model
    FLOPs over (train seconds x peak x trainer devices). Pops ``model_flops``/``peak_flops``/``devices``
    (what :meth:`TrainerRole.train` reports) from ``train_metrics``."""
    flops, peak = train_metrics.pop("model_flops", None), train_metrics.pop("peak_flops", None)
    ranks = int(train_metrics.pop("devices", 1) or 1)
    out = {"perf/tokens_per_s_per_gpu": tokens / max(step_s, 1e-9) / max(devices, 1)}
    if flops and peak:
        out["perf/mfu"] = flops / (max(train_s, 1e-9) * peak * ranks)
        out["perf/train_tflops_per_gpu"] = flops / max(train_s, 1e-9) / ranks / 1e12
    return out
