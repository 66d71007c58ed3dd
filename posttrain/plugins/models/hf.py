"""The generic ``hf`` model spec: any HF causal LM, its architecture read from the checkpoint's ``config.json``.

``model: {name: hf, path: DIR}`` trains and serves whatever ``DIR/config.json`` describes (gemma3, phi3,
mistral, olmo2, granite, starcoder2, gpt_neox, qwen2_moe, ...): a trainer backend that builds models from
the HF config (``fsdp2``) builds it with ``AutoModelForCausalLM``, and the ``hf`` engine serves it. The
Megatron backend needs a per-family weight mapping and refuses this spec. ``model.overrides`` cuts the
checkpoint's shape like any spec's (``{num_hidden_layers: 4}``); without ``path`` the ``tiny`` preset (a
Mistral-shaped model of the tiny width) is used.
"""

from __future__ import annotations

from typing import Any

from posttrain import hookimpl
from posttrain.core.model_spec import ModelSpec


class HFSpec(ModelSpec):
    """Any ``AutoModelForCausalLM`` checkpoint; ``generic``: it claims no ``model_type`` of its own (a
    checkpoint's type still selects its family's spec where one exists, e.g. in ``rl-cli models convert``)."""

    name = "hf"
    generic = True
    hf_architecture = ""  # the checkpoint's own config.json names it (architectures)
    presets = {
        "tiny": dict(model_type="mistral", architectures=["MistralForCausalLM"], vocab_size=128, hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                     hidden_act="silu", sliding_window=None, tie_word_embeddings=False, bos_token_id=0,
                     eos_token_id=0, torch_dtype="float32"),
    }

    def check_config(self, run: Any = None, plugins: Any = None) -> list[str]:
        errors = super().check_config(run, plugins)
        if not errors and self.config.path:
            from posttrain.core.model_spec import read_hf_config

            try:
                hf = read_hf_config(self.config.path)
            except Exception as exc:  # noqa: BLE001 - reported as the path's config error
                return [f"model.path: {exc}"]
            if not hf.get("model_type"):
                errors.append(f"model.path: {self.config.path}/config.json names no model_type")
        return errors


@hookimpl
def posttrain_register_models(registry):
    registry.add(HFSpec)
