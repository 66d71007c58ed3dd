"""``MoEGPTSpec``: the Megatron mapping of mixture-of-experts decoders (Qwen3-MoE, GLM-4.5/4.6).

A MoE layer replaces the dense MLP by ``E`` experts (each a SwiGLU MLP of width ``F = moe_ffn``), a
router and, in some families, shared experts that every token goes through::

    logits = x W_r^T                                  # [n, E]   (router, ``mlp.gate.weight`` in HF)
    idx, w = route(logits)                            # [n, k] expert ids and their weights
    y      = sum_j w_j * expert_{idx_j}(x)  (+ shared(x))

``route`` per family (:meth:`MoEGPTSpec.router_config` gives Megatron's fields):

- Qwen3-MoE: ``p = softmax(logits)``, top-k of ``p``; ``norm_topk_prob`` renormalizes the k weights
  to sum to 1, which is Megatron's ``moe_router_pre_softmax=False`` (softmax over the top-k logits);
  without it ``pre_softmax=True`` keeps the unnormalized probabilities.
- GLM-4.5: ``s = sigmoid(logits)``; experts are chosen by ``s + b`` (``e_score_correction_bias``, an
  aux-loss-free balancing bias) within the ``topk_group`` best of ``n_group`` groups, weighted by ``s``
  renormalized over the k, times ``routed_scaling_factor``. Megatron: ``score_function=sigmoid``,
  ``expert_bias`` (a buffer), ``moe_router_num_groups``/``group_topk``, ``topk_scaling_factor``. HF
  scores a group by its top-2 experts, Megatron by its top ``k / topk_group``: specs refuse a config
  where the two differ (both GLM-4.5 presets use one group, where they agree trivially).

Megatron parameters of MoE layer ``L`` (local spec, ``SequentialMLP``'s expert parameters; names are *global*:
expert ``e`` is ``local_experts.e`` whichever EP rank holds it, see ``model.megatron_params``):

    decoder.layers.L.mlp.router.weight                                [E, H]   <- mlp.gate.weight
    decoder.layers.L.mlp.router.expert_bias                           [E]      <- mlp.gate.e_score_correction_bias
    decoder.layers.L.mlp.experts.local_experts.e.linear_fc1.weight    [2F, H]  <- experts.e.{gate,up}_proj
    decoder.layers.L.mlp.experts.local_experts.e.linear_fc2.weight    [H, F]   <- experts.e.down_proj
    decoder.layers.L.mlp.shared_experts.linear_fc{1,2}.weight                  <- shared_experts.*

(``expert_bias`` is a buffer, not a parameter: it is loaded and exported like one, never trained by
gradients; Megatron moves it by ``moe_router_bias_update_rate`` from the token counts, 0 by default
here as in slime's GLM recipes.) Layers listed as dense (GLM's first ``first_k_dense_replace``, Qwen3's
``mlp_only_layers``) keep the dense names and ``intermediate_size``.

Tokens reach their experts through Megatron's all-to-all dispatcher (per-rank token counts may differ,
as data-parallel ranks' micro-batches do; the all-gather one needs equal counts). Experts are
:class:`~posttrain.plugins.trainers.megatron.grouped_experts.GroupedExperts`: ``SequentialMLP``'s
parameters (the names above), every local expert's GEMMs in one grouped matmul (``torch._grouped_mm``,
no Transformer Engine or ``grouped_gemm`` package needed). ``moe_grouped_gemm`` (True here;
``trainer.backend.megatron.moe_grouped_gemm: false``) switches back to ``SequentialMLP``'s per-expert loop.
"""

from __future__ import annotations

import re
from typing import Any

from posttrain.core.errors import UsageError
from posttrain.plugins.trainers.megatron.spec import DenseGPTSpec

_MOE = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.(router\.weight|router\.expert_bias|"
                  r"experts\.local_experts\.(\d+)\.linear_fc([12])\.weight|shared_experts\.linear_fc([12])\.weight)$")


class MoEGPTSpec(DenseGPTSpec):
    """A dense decoder whose MLPs are (mostly) MoE layers; families set the flags below.

    ``score_function``: ``softmax`` (Qwen3-MoE) or ``sigmoid`` (GLM-4.5). ``expert_bias``: the router has
    HF's ``e_score_correction_bias``. ``shared_experts``: HF ``mlp.shared_experts`` (width
    ``moe_intermediate_size * n_shared_experts``). ``ignored_layers_from``: HF tensors of layers at or past
    ``num_hidden_layers`` (GLM's multi-token-prediction layers, which HF also skips) are not loaded.
    """

    score_function = "softmax"
    expert_bias = False
    shared_experts = False
    load_balancing_type = "aux_loss"
    multi_latent_attention = False

    # ------------------------------------------------------------ HF config, normalized
    def num_experts(self, hf: dict[str, Any]) -> int:
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if hf.get(key):
                return int(hf[key])
        raise UsageError(f"{self.name}: config.json names no expert count (num_experts / n_routed_experts)")

    def moe_layers(self, hf: dict[str, Any]) -> list[bool]:
        """``[num_hidden_layers]``: True where the layer is a MoE layer (HF's own rule per family)."""
        layers = int(hf["num_hidden_layers"])
        dense_first = int(hf.get("first_k_dense_replace", 0) or 0)
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        only_mlp = set(hf.get("mlp_only_layers") or [])
        return [i >= dense_first and i not in only_mlp and (i + 1) % step == 0 for i in range(layers)]

    def topk(self, hf: dict[str, Any]) -> int:
        return int(hf["num_experts_per_tok"])

    def router_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        """Megatron's router fields for this family (see the module docstring)."""
        if self.score_function == "softmax":
            return dict(moe_router_score_function="softmax",
                        moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", False)))
        if not hf.get("norm_topk_prob", True):
            raise UsageError(f"{self.name}: norm_topk_prob: false with sigmoid routing is not supported "
                             f"(Megatron renormalizes sigmoid top-k weights)")
        out: dict[str, Any] = dict(moe_router_score_function="sigmoid",
                                   moe_router_enable_expert_bias=self.expert_bias,
                                   moe_router_bias_update_rate=0.0, moe_router_dtype="fp32")
        scale = float(hf.get("routed_scaling_factor", 1.0) or 1.0)
        if scale != 1.0:
            out["moe_router_topk_scaling_factor"] = scale
        groups, group_topk = int(hf.get("n_group", 1) or 1), int(hf.get("topk_group", 1) or 1)
        if groups > 1:
            if self.topk(hf) // group_topk != 2:
                raise UsageError(f"{self.name}: n_group={groups} with topk_group={group_topk}: HF scores a group by "
                                 f"its top-2 experts, Megatron by its top k/topk_group="
                                 f"{self.topk(hf) // group_topk}; not supported")
            out.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
        return out

    def check_supported(self, hf: dict[str, Any]) -> None:
        super().check_supported(hf)
        experts, k = self.num_experts(hf), self.topk(hf)
        if not 1 <= k <= experts:
            raise UsageError(f"{self.name}: num_experts_per_tok={k} must be between 1 and the {experts} experts")

    # ------------------------------------------------------------ Megatron side
    def transformer_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        out = super().transformer_config(hf)
        moe = self.moe_layers(hf)
        out.update(
            num_moe_experts=self.num_experts(hf), moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
            moe_router_topk=self.topk(hf), moe_layer_freq=[int(m) for m in moe],
            moe_router_load_balancing_type=self.load_balancing_type, moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
            **self.router_config(hf),
        )
        if self.shared_experts:
            out["moe_shared_expert_intermediate_size"] = int(hf["moe_intermediate_size"]) * int(
                hf.get("n_shared_experts", 1) or 1)
        return out

    def layer_spec(self, hf: dict[str, Any], core_attention: Any = None) -> Any:
        """A ``TransformerBlockSubmodules`` with this pipeline stage's layers (dense or MoE each)."""
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

        from posttrain.plugins.trainers.megatron.grouped_experts import GroupedExperts

        def local(num_experts):
            spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                            qk_layernorm=self.qk_norm, normalization="RMSNorm",
                                            multi_latent_attention=self.multi_latent_attention)
            if core_attention is not None:
                spec.submodules.self_attention.submodules.core_attention = core_attention
            if num_experts:  # SequentialMLP's parameters, grouped GEMMs (config.moe_grouped_gemm picks)
                spec.submodules.mlp.submodules.experts.module = GroupedExperts
            return spec

        dense, moe = local(None), local(self.num_experts(hf))
        specs = [moe if m else dense for m in self.moe_layers(hf)]
        pp = parallel_state.get_pipeline_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
        rank = parallel_state.get_pipeline_model_parallel_rank() if pp > 1 else 0
        per_stage = len(specs) // pp
        return TransformerBlockSubmodules(layer_specs=specs[rank * per_stage:(rank + 1) * per_stage],
                                          layer_norm=LayerNormImpl)

    def layer_module_spec(self, hf: dict[str, Any], layer: int) -> Any:
        """The ``ModuleSpec`` of decoder layer ``layer`` (global number), whichever stage holds it: seeded
        initialization builds another stage's kind of layer from it (on the meta device) for its shapes."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from posttrain.plugins.trainers.megatron.grouped_experts import GroupedExperts

        moe = self.moe_layers(hf)[layer]
        spec = get_gpt_layer_local_spec(num_experts=self.num_experts(hf) if moe else None, moe_grouped_gemm=False,
                                        qk_layernorm=self.qk_norm, normalization="RMSNorm")
        if moe:
            spec.submodules.mlp.submodules.experts.module = GroupedExperts
        return spec

    # ------------------------------------------------------------ names
    def megatron_names(self, hf: dict[str, Any]) -> list[str]:
        names = super().megatron_names(hf)
        dense_mlp = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
        out = []
        for name in names:
            m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
            if m and m.group(2) in dense_mlp and self.moe_layers(hf)[int(m.group(1))]:
                if m.group(2) == dense_mlp[0]:  # the MoE parameters take the dense MLP's place, once
                    out += self._moe_names(hf, int(m.group(1)))
                continue
            out.append(name)
        return out

    def _moe_names(self, hf: dict[str, Any], layer: int) -> list[str]:
        p = f"decoder.layers.{layer}.mlp."
        names = [p + "router.weight"]
        if self.expert_bias:
            names.append(p + "router.expert_bias")
        for e in range(self.num_experts(hf)):
            names += [f"{p}experts.local_experts.{e}.linear_fc1.weight", f"{p}experts.local_experts.{e}.linear_fc2.weight"]
        if self.shared_experts:
            names += [p + "shared_experts.linear_fc1.weight", p + "shared_experts.linear_fc2.weight"]
        return names

    def buffer_names(self, hf: dict[str, Any]) -> list[str]:
        """Megatron *buffers* the checkpoint fills (not trained by the optimizer): the router expert bias."""
        return [n for n in self.megatron_names(hf) if n.endswith("router.expert_bias")]

    def hf_sources(self, hf: dict[str, Any], mname: str) -> list[str]:
        m = _MOE.match(mname)
        if not m:
            return super().hf_sources(hf, mname)
        p = f"model.layers.{m.group(1)}.mlp."
        what = m.group(2)
        if what == "router.weight":
            return [p + "gate.weight"]
        if what == "router.expert_bias":
            return [p + "gate.e_score_correction_bias"]
        if m.group(3) is not None:
            e = f"{p}experts.{m.group(3)}."
            return [e + "gate_proj.weight", e + "up_proj.weight"] if m.group(4) == "1" else [e + "down_proj.weight"]
        s = p + "shared_experts."
        return [s + "gate_proj.weight", s + "up_proj.weight"] if m.group(5) == "1" else [s + "down_proj.weight"]

    def ignored_hf_tensor(self, hf: dict[str, Any], name: str) -> bool:
        """HF tensors no Megatron parameter takes: layers past ``num_hidden_layers`` (GLM's MTP layers)."""
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        return bool(m) and int(m.group(1)) >= int(hf["num_hidden_layers"])

    # ------------------------------------------------------------ tensors
    def to_megatron(self, hf: dict[str, Any], mname: str, tensors: list[Any]) -> Any:
        import torch

        m = _MOE.match(mname)
        if not m:
            return super().to_megatron(hf, mname, tensors)
        if len(tensors) == 2:  # [gate; up]
            return torch.cat(tensors, dim=0).contiguous()
        (t,) = tensors
        return t

    def to_hf(self, hf: dict[str, Any], mname: str, tensor: Any) -> list[tuple[str, Any]]:
        m = _MOE.match(mname)
        if not m:
            return super().to_hf(hf, mname, tensor)
        sources = self.hf_sources(hf, mname)
        if len(sources) == 2:
            gate, up = tensor.chunk(2, dim=0)
            return [(sources[0], gate.contiguous()), (sources[1], up.contiguous())]
        return [(sources[0], tensor)]
