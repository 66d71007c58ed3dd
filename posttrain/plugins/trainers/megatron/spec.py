"""``ModelSpec``: the mapping between one HF model family and Megatron-core.

A spec plugin (``posttrain/plugins/models/<family>.py``) subclasses :class:`DenseGPTSpec` (or
:class:`posttrain.core.model_spec.ModelSpec` for something else) and says, per family:

- which HF ``model_type`` values it accepts, and ``presets``: real ``config.json`` shapes by name;
- ``transformer_config(hf)``: the Megatron ``TransformerConfig`` fields for that HF config;
- ``layer_spec(hf, core_attention)``: the Megatron layer ``ModuleSpec``;
- the weight mapping, **one Megatron parameter at a time** (so conversion streams and MoE specs can
  override per parameter): ``hf_sources(hf, mname) -> [hf names]``,
  ``to_megatron(hf, mname, [tensors]) -> tensor`` and ``to_hf(hf, mname, tensor) -> [(hf name, tensor)]``.
  Tensors here are *unsharded* (TP=1) Megatron tensors; TP sharding is generic
  (:mod:`posttrain.plugins.trainers.megatron.convert`), with one family-independent exception: a gated MLP's fused
  ``linear_fc1`` is sharded gate and up separately.

Layout facts the mapping relies on (Megatron-core 0.16, local/TE specs alike):

- ``linear_qkv.weight [ng * (np/ng + 2) * hd, h]``: per query group ``g``, its ``np/ng`` query heads,
  then its key head, then its value head (HF keeps ``q_proj [np*hd, h]``, ``k_proj``, ``v_proj`` apart).
- ``linear_fc1.weight [2 * ffn, h]``: gate rows, then up rows (HF ``gate_proj``, ``up_proj``).
- Embedding and output layer rows are padded to ``padded_vocab_size(hf, tp)``; padding rows are zero
  and are dropped on the way back to HF.

MoE families (:class:`~posttrain.plugins.trainers.megatron.moe_spec.MoEGPTSpec`) add expert parameters by
overriding the three mapping methods and ``layer_spec``; ``megatron_names(hf)`` lists the parameters a spec
expects, so loading checks coverage.

This module is import-light (torch and Megatron are imported inside methods).
"""

from __future__ import annotations

import re
from typing import Any

from posttrain.core.errors import UsageError
from posttrain.core.model_spec import ModelSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class DenseGPTSpec(ModelSpec):
    """Llama-style decoder (RMSNorm, rotary, SwiGLU, GQA); families set the flags below.

    ``qk_norm``: per-head RMSNorm on q and k (Qwen3). ``qkv_bias``: biases on q/k/v (Qwen2, GLM-4).
    ``post_norms``: GLM-4's extra norms after attention and after the MLP (sandwich), as layer wrappers.
    ``fused_gate_up``: HF stores ``mlp.gate_up_proj`` (GLM-4) instead of ``gate_proj`` + ``up_proj``.
    """

    qk_norm = False
    qkv_bias = False
    post_norms = False
    fused_gate_up = False
    rotary_interleaved = False

    def head_dim(self, hf: dict[str, Any]) -> int:
        return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])

    def check_supported(self, hf: dict[str, Any]) -> None:
        """Refuse HF features this mapping does not reproduce (rather than train a different model)."""
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        kind = (scaling.get("rope_type") or scaling.get("type")) if isinstance(scaling, dict) else None
        if kind not in (None, "default"):
            raise UsageError(f"{self.name}: rope scaling {kind!r} is not supported by this spec")
        if hf.get("hidden_act", "silu") != "silu":
            raise UsageError(f"{self.name}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")
        if hf.get("use_sliding_window"):
            raise UsageError(f"{self.name}: sliding-window attention is not supported by this spec")

    def transformer_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        import torch.nn.functional as F

        self.check_supported(hf)
        return dict(
            num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
            num_attention_heads=hf["num_attention_heads"],
            num_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            kv_channels=self.head_dim(hf), ffn_hidden_size=hf["intermediate_size"],
            normalization="RMSNorm", layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            add_qkv_bias=self.qkv_bias, qk_layernorm=self.qk_norm, rotary_interleaved=self.rotary_interleaved,
            hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
            masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
            apply_rope_fusion=False,
        )

    def gpt_model_kwargs(self, hf: dict[str, Any]) -> dict[str, Any]:
        return dict(
            max_sequence_length=hf.get("max_position_embeddings", 4096), position_embedding_type="rope",
            rotary_base=int(hf.get("rope_theta", 10000)), rotary_percent=float(hf.get("partial_rotary_factor", 1.0)),
            share_embeddings_and_output_weights=self.tied(hf),
        )

    def layer_spec(self, hf: dict[str, Any], core_attention: Any = None) -> Any:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(qk_layernorm=self.qk_norm, normalization="RMSNorm")
        if core_attention is not None:
            spec.submodules.self_attention.submodules.core_attention = core_attention
        if self.post_norms:
            from posttrain.plugins.trainers.megatron.layers import with_post_norms

            spec = with_post_norms(spec)
        return spec

    # ------------------------------------------------------------ names
    def megatron_names(self, hf: dict[str, Any]) -> list[str]:
        names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
        if not self.tied(hf):
            names.append("output_layer.weight")
        per_layer = ["input_layernorm.weight", "self_attention.linear_qkv.weight",
                     "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight",
                     "mlp.linear_fc2.weight"]
        if self.qkv_bias:
            per_layer.append("self_attention.linear_qkv.bias")
        if self.qk_norm:
            per_layer += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
        if self.post_norms:
            per_layer += ["self_attention.post_norm.weight", "mlp.post_norm.weight"]
        return names + [f"decoder.layers.{i}.{p}" for i in range(hf["num_hidden_layers"]) for p in per_layer]

    _GLOBAL = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
               "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}

    def _layer_map(self) -> dict[str, list[str]]:
        """Megatron layer-local name -> HF layer-local names (in the order ``to_megatron`` fuses them)."""
        out = {
            "input_layernorm.weight": ["input_layernorm.weight"],
            "self_attention.linear_qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight"],
            "self_attention.linear_qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                               "self_attn.v_proj.bias"],
            "self_attention.q_layernorm.weight": ["self_attn.q_norm.weight"],
            "self_attention.k_layernorm.weight": ["self_attn.k_norm.weight"],
            "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
            "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
            "mlp.linear_fc1.weight": (["mlp.gate_up_proj.weight"] if self.fused_gate_up
                                      else ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
            "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
            "self_attention.post_norm.weight": ["post_self_attn_layernorm.weight"],
            "mlp.post_norm.weight": ["post_mlp_layernorm.weight"],
        }
        return out

    def hf_sources(self, hf: dict[str, Any], mname: str) -> list[str]:
        if mname in self._GLOBAL:
            if mname == "output_layer.weight" and self.tied(hf):
                return []
            return [self._GLOBAL[mname]]
        m = _LAYER.match(mname)
        if not m or m.group(2) not in self._layer_map():
            raise KeyError(f"{self.name}: no HF source for Megatron parameter {mname!r}")
        return [f"model.layers.{m.group(1)}.{n}" for n in self._layer_map()[m.group(2)]]

    # ------------------------------------------------------------ tensors
    def _qkv_dims(self, hf: dict[str, Any]) -> tuple[int, int, int]:
        heads = hf["num_attention_heads"]
        groups = hf.get("num_key_value_heads") or heads
        return heads, groups, self.head_dim(hf)

    def to_megatron(self, hf: dict[str, Any], mname: str, tensors: list[Any]) -> Any:
        import torch

        local = mname.split(".", 3)[-1] if mname.startswith("decoder.layers.") else mname
        if local in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            heads, groups, hd = self._qkv_dims(hf)
            q, k, v = tensors
            rest = q.shape[1:]
            q = q.reshape(groups, heads // groups * hd, *rest)
            k = k.reshape(groups, hd, *rest)
            v = v.reshape(groups, hd, *rest)
            return torch.cat([q, k, v], dim=1).reshape(-1, *rest).contiguous()
        if local == "mlp.linear_fc1.weight" and not self.fused_gate_up:
            return torch.cat(tensors, dim=0).contiguous()
        if mname in ("embedding.word_embeddings.weight", "output_layer.weight"):
            (w,) = tensors
            padded = self.padded_vocab_size(hf)
            if padded > w.shape[0]:
                w = torch.cat([w, w.new_zeros(padded - w.shape[0], *w.shape[1:])])
            return w.contiguous()
        (t,) = tensors
        return t

    def to_hf(self, hf: dict[str, Any], mname: str, tensor: Any) -> list[tuple[str, Any]]:
        sources = self.hf_sources(hf, mname)
        local = mname.split(".", 3)[-1] if mname.startswith("decoder.layers.") else mname
        if local in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            heads, groups, hd = self._qkv_dims(hf)
            rest = tensor.shape[1:]
            t = tensor.reshape(groups, (heads // groups + 2) * hd, *rest)
            q, k, v = t.split([heads // groups * hd, hd, hd], dim=1)
            parts = [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
            return [(n, p.contiguous()) for n, p in zip(sources, parts)]
        if local == "mlp.linear_fc1.weight" and not self.fused_gate_up:
            gate, up = tensor.chunk(2, dim=0)
            return [(sources[0], gate.contiguous()), (sources[1], up.contiguous())]
        if mname in ("embedding.word_embeddings.weight", "output_layer.weight"):
            out = [(sources[0], tensor[: int(hf["vocab_size"])].contiguous())]
            if mname == "embedding.word_embeddings.weight" and self.tied(hf):
                pass  # HF ties lm_head to embed_tokens itself; the checkpoint has no lm_head
            return out
        return [(sources[0], tensor)]
