"""``ModelSpec``: one HF model family, as every trainer and engine backend sees it.

A model-spec plugin (``posttrain/plugins/models/<family>.py``) registers a subclass with
``posttrain_register_models``. The backend-independent part lives here: the HF ``model_type`` values a
spec accepts, ``presets`` (real ``config.json`` shapes by name, and a ``tiny`` one for CPU tests),
``hf_config()`` (the preset's or checkpoint's ``config.json`` with ``model.overrides`` on top, e.g.
``{num_hidden_layers: 8}`` to cut a real shape to one GPU) and the checkpoint lookup. A trainer backend adds its own mapping on top: Megatron's is
:class:`posttrain.plugins.trainers.megatron.spec.DenseGPTSpec` (TransformerConfig, layer spec, weight
mapping per Megatron parameter), which the built-in dense families subclass. An engine backend serves
the HF checkpoint a spec describes (``hf_architecture``).

This module is import-light (no torch).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from posttrain.core.errors import ConfigError, UsageError, did_you_mean, unknown
from posttrain.core.interfaces import Component
from posttrain.core.schema import option

DTYPES = ("float32", "bfloat16", "float16")


class ModelSpec(Component):
    """Base of every model spec; see the module docstring for the interface."""

    name = ""
    model_types: tuple[str, ...] = ()
    presets: dict[str, dict[str, Any]] = {}
    hf_architecture = ""  # e.g. "Qwen3ForCausalLM": written to config.json by save_hf
    # True for a spec that takes any architecture from its checkpoint's config.json (model_types then empty)
    generic = False

    @dataclass
    class Config:
        preset: str = option("tiny", help="a preset shape (see `rl-cli models list`); ignored when `path` is set")
        path: str | None = option(None, help="an HF checkpoint directory (config.json + *.safetensors)")
        dtype: Literal["float32", "bfloat16", "float16"] = option("bfloat16", help="parameter dtype")
        make_vocab_size_divisible_by: int = option(128, ge=1, help="vocab padding multiple (times TP)")
        tokenizer: str | None = option(None, help="tokenizer directory (default: `path`); 'char' builds posttrain's "
                                                  "character-level tokenizer (for the tiny presets)")
        overrides: dict[str, Any] = option(default_factory=dict,
                                           help="HF config.json keys set on top of the preset's or checkpoint's "
                                                "config, e.g. {num_hidden_layers: 6} (a preset cut to fit a "
                                                "benchmark); each key must already be in that config")

    # ---------------------------------------------------------------- HF config
    def hf_config(self) -> dict[str, Any]:
        """The HF ``config.json`` mapping: read from ``config.path`` or the named preset, with
        ``config.overrides`` applied on top. Every role builds its model from this mapping (the trainer,
        and the engines through the trainer's HF export), so an override cuts every copy the same way."""
        hf = self._base_hf_config()
        errors = override_errors(hf, self.config.overrides, self._source())
        if errors:
            raise ConfigError(errors)
        hf.update(copy.deepcopy(self.config.overrides))
        return hf

    def _base_hf_config(self) -> dict[str, Any]:
        if self.config.path:
            return read_hf_config(self.config.path)
        if self.config.preset not in self.presets:
            raise ConfigError([f"model.preset: {unknown('preset', self.config.preset, self.presets)}"])
        return copy.deepcopy(self.presets[self.config.preset])

    def _source(self) -> str:
        return str(self.config.path) if self.config.path else f"preset {self.config.preset!r}"

    def check_config(self, run: Any = None, plugins: Any = None) -> list[str]:
        """Config-time errors (``RunConfig.component_errors`` asks): an unknown ``model.preset``, an
        ``model.overrides`` key the preset's or checkpoint's config does not have. A ``model.path``
        without a ``config.json`` is left to the preflight's path check."""
        if self.config.path and not (Path(self.config.path).expanduser() / "config.json").is_file():
            return []
        try:
            return override_errors(self._base_hf_config(), self.config.overrides, self._source())
        except (ConfigError, UsageError) as exc:
            return list(getattr(exc, "errors", None) or [str(exc)])

    def padded_vocab_size(self, hf: dict[str, Any], tp: int = 1) -> int:
        multiple = self.config.make_vocab_size_divisible_by * tp
        return -(-int(hf["vocab_size"]) // multiple) * multiple

    def tied(self, hf: dict[str, Any]) -> bool:
        return bool(hf.get("tie_word_embeddings", False))

    # ---------------------------------------------------------------- Megatron side
    @classmethod
    def has_megatron_mapping(cls) -> bool:
        """Whether the spec maps its family to Megatron (implements :meth:`transformer_config` and the weight
        mapping below): what the Megatron trainer backend needs."""
        return cls.transformer_config is not ModelSpec.transformer_config

    def transformer_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        """``TransformerConfig`` keyword arguments (architecture only; the trainer adds parallelism/dtype)."""
        raise NotImplementedError

    def layer_spec(self, hf: dict[str, Any], core_attention: Any = None) -> Any:
        raise NotImplementedError

    def gpt_model_kwargs(self, hf: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments of ``GPTModel`` besides config, spec and vocab size."""
        raise NotImplementedError

    # ---------------------------------------------------------------- weight mapping (unsharded)
    def megatron_names(self, hf: dict[str, Any]) -> list[str]:
        raise NotImplementedError

    def hf_sources(self, hf: dict[str, Any], mname: str) -> list[str]:
        raise NotImplementedError

    def to_megatron(self, hf: dict[str, Any], mname: str, tensors: list[Any]) -> Any:
        raise NotImplementedError

    def to_hf(self, hf: dict[str, Any], mname: str, tensor: Any) -> list[tuple[str, Any]]:
        raise NotImplementedError


def override_errors(hf: dict[str, Any], overrides: dict[str, Any], what: str = "the model") -> list[str]:
    """One ``model.overrides.<key>: ...`` error per override key that ``hf`` (``what``'s config, the one
    it overrides) lacks: a misspelled key would otherwise be written to config.json and ignored."""
    return [f"model.overrides.{key}: not a key of the HF config of {what}.{did_you_mean(key, sorted(hf))}"
            for key in overrides if key not in hf]


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of an HF checkpoint directory, with a one-line error when it is missing or broken."""
    p = Path(path) / "config.json"
    if not p.is_file():
        raise UsageError(f"{path}: not an HF checkpoint directory (no config.json)")
    try:
        hf = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"{p}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    # transformers 5 nests rope parameters; flatten the one field every dense family needs.
    rope = hf.get("rope_parameters") or {}
    if "rope_theta" not in hf and isinstance(rope, dict) and "rope_theta" in rope:
        hf["rope_theta"] = rope["rope_theta"]
    if "partial_rotary_factor" not in hf and isinstance(rope, dict) and "partial_rotary_factor" in rope:
        hf["partial_rotary_factor"] = rope["partial_rotary_factor"]
    return hf


def spec_for_model_type(registry: Any, model_type: str) -> type:
    """The registered spec class that accepts HF ``model_type`` (``config.json``), or a UsageError."""
    for name in sorted(registry):
        if model_type in getattr(registry[name], "model_types", ()):
            return registry[name]
    every = sorted({t for n in registry for t in getattr(registry[n], "model_types", ())})
    raise UsageError(unknown("HF model_type", model_type, every, " (no model spec accepts it)"))


def spec_for_checkpoint(registry: Any, path: str | Path, **config: Any) -> ModelSpec:
    """A spec instance for the HF checkpoint at ``path``, chosen by its ``config.json`` ``model_type``."""
    hf = read_hf_config(path)
    if "model_type" not in hf:
        raise UsageError(f"{path}/config.json: no `model_type`; choose the model spec by name")
    cls = spec_for_model_type(registry, hf["model_type"])
    return cls(cls.Config(path=str(path), **config))



def presets_table(specs: Iterable[type]) -> list[dict[str, Any]]:
    """Rows ``{family, preset, layers, hidden, heads, kv_heads, ffn, vocab, params, active_params}`` for
    `rl-cli models list` (``ffn``: the dense MLP width; MoE presets add ``experts``, e.g. ``128x768 top-8``)."""
    rows = []
    for cls in specs:
        for preset, hf in cls.presets.items():
            rows.append({"family": cls.name, "preset": preset, "layers": hf["num_hidden_layers"],
                         "hidden": hf["hidden_size"], "heads": hf["num_attention_heads"],
                         "kv_heads": hf.get("num_key_value_heads", hf["num_attention_heads"]),
                         "ffn": hf["intermediate_size"], "vocab": hf["vocab_size"],
                         "experts": (f"{num_experts(hf)}x{hf['moe_intermediate_size']} top-{hf['num_experts_per_tok']}"
                                     if num_experts(hf) else ""),
                         "params": count_params(hf, cls), "active_params": count_params(hf, cls, active=True)})
    return rows


def num_experts(hf: dict[str, Any]) -> int:
    """Routed experts per MoE layer from an HF config (the families name the count differently), 0 if dense."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0)


def moe_layer_flags(hf: dict[str, Any]) -> list[bool]:
    """Per decoder layer, whether HF builds a MoE MLP there: not among the first ``first_k_dense_replace``
    (GLM, DeepSeek), not in ``mlp_only_layers``, and on every ``decoder_sparse_step``-th layer (Qwen)."""
    if not num_experts(hf):
        return [False] * int(hf["num_hidden_layers"])
    first = int(hf.get("first_k_dense_replace", 0) or 0)
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return [i >= first and i not in dense and (i + 1) % step == 0 for i in range(int(hf["num_hidden_layers"]))]


def count_params(hf: dict[str, Any], cls: type | None = None, active: bool = False) -> int:
    """Parameter count of a decoder from its HF config (embeddings counted once when tied); MoE layers count
    their router, every routed expert (``active``: the ``num_experts_per_tok`` a token uses) and shared
    experts. Multi-token-prediction layers and biases are not counted. A vision-language config (``text_config``
    and ``vision_config``) counts its language model and its vision tower (:func:`vision_params`)."""
    if hf.get("text_config") and hf.get("vision_config"):
        text = {"tie_word_embeddings": hf.get("tie_word_embeddings"), **hf["text_config"]}
        return count_params(text, cls, active) + vision_params(hf["vision_config"])
    h, layers, ffn, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"], hf["vocab_size"]
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads", heads)
    hd = hf.get("head_dim") or h // heads
    attn = h * hd * (heads + 2 * groups) + heads * hd * h
    if hf.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv, latent norms
        qk, rank, q_rank = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], hf["kv_lora_rank"], hf.get("q_lora_rank")
        q = (h * q_rank + q_rank + q_rank * heads * qk) if q_rank else h * heads * qk
        attn = (q + h * (rank + hf["qk_rope_head_dim"]) + rank + rank * heads * (hf["qk_nope_head_dim"] + hf["v_head_dim"])
                + heads * hf["v_head_dim"] * h)
    moe = moe_layer_flags(hf)
    experts = num_experts(hf)
    used = int(hf.get("num_experts_per_tok", 0) or 0) if active else experts
    moe_mlp = (3 * h * int(hf.get("moe_intermediate_size", 0) or 0) * (used + int(hf.get("n_shared_experts", 0) or 0))
               + experts * h) if experts else 0
    mlps = sum(moe_mlp if m else 3 * h * ffn for m in moe)
    embed = vocab * h * (1 if hf.get("tie_word_embeddings") else 2)
    return layers * (attn + 2 * h) + mlps + embed + h


def vision_params(vision: dict[str, Any]) -> int:
    """Parameters of a Qwen2-VL-family vision tower from its ``vision_config``: the patch embedding
    (``C x t x p^2 -> h``), ``depth`` blocks (attention ``4 h^2``, a gated MLP ``3 h f`` or a plain one ``2 h f``,
    two norms) and the merger (``m^2 h -> m^2 h -> out``). Biases are not counted."""
    h, depth = vision.get("hidden_size") or vision.get("embed_dim"), vision.get("depth", 0)
    ffn = vision.get("intermediate_size") or int(h * vision.get("mlp_ratio", 4))
    patch = vision.get("in_channels", 3) * vision.get("temporal_patch_size", 2) * vision.get("patch_size", 14) ** 2
    merged = h * vision.get("spatial_merge_size", 2) ** 2
    gated = 3 if "hidden_act" in vision and vision["hidden_act"] == "silu" else 2
    out = vision.get("out_hidden_size") or vision.get("hidden_size")
    return patch * h + depth * (4 * h * h + gated * h * ffn + 2 * h) + merged * merged + merged * out + h
