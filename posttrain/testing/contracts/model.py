"""The model-spec contract: every spec's ``tiny`` preset converts HF -> Megatron -> HF bit-exactly (specs with a
Megatron mapping, ``ModelSpec.has_megatron_mapping``; a ``generic`` spec such as ``hf`` has none).

The checks need no Megatron process: a random ``transformers`` model is built from the preset's
config, every Megatron parameter the spec names is assembled from its HF sources with ``to_megatron``,
and ``to_hf`` must give back exactly the tensors it came from, covering every HF tensor once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.testing.contracts.common import ComponentContract


def tiny_hf_state(spec):
    """``(hf_config dict, {hf_name: tensor})`` of a random HF model built from the spec's tiny preset, as
    its checkpoint holds them (``save_pretrained``: transformers 5 keeps MoE experts stacked in memory but
    writes one tensor per expert, the hub layout specs map)."""
    import tempfile

    import torch
    import transformers
    from safetensors.torch import load_file

    hf = dict(type(spec).presets["tiny"])
    kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "architectures", "torch_dtype")}
    config = transformers.AutoConfig.for_model(hf["model_type"], **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        saved = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            saved.update(load_file(str(f)))
    state = {k: v for k, v in saved.items() if not k.endswith("rotary_emb.inv_freq")}
    if hf.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    return hf, state


class ModelSpecContract(ComponentContract):
    """Supply a ``model_spec`` fixture (an instance built with its default ``Config``)."""

    @pytest.fixture
    def component(self, model_spec):
        return model_spec

    def test_has_tiny_preset_and_model_types(self, model_spec):
        cls = type(model_spec)
        assert "tiny" in cls.presets, f"{cls.__name__} needs a `tiny` preset (tests and the CPU quickstart)"
        assert cls.model_types or cls.generic, f"{cls.__name__} must list the HF model_type values it accepts"
        for name, hf in cls.presets.items():
            for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
                assert isinstance(hf.get(key), int) and hf[key] > 0, f"preset {name}: {key} missing"

    def test_tiny_round_trip_is_bit_exact(self, model_spec):
        import torch

        pytest.importorskip("transformers")
        if not model_spec.has_megatron_mapping():
            pytest.skip(f"{type(model_spec).__name__} has no Megatron mapping (trained by backends that build HF models)")
        hf, state = tiny_hf_state(model_spec)
        seen: dict[str, torch.Tensor] = {}
        for mname in model_spec.megatron_names(hf):
            sources = model_spec.hf_sources(hf, mname)
            full = model_spec.to_megatron(hf, mname, [state[s] for s in sources])
            back = dict(model_spec.to_hf(hf, mname, full))
            assert sorted(back) == sorted(sources), f"{mname}: to_hf names {sorted(back)} != sources {sources}"
            for name, tensor in back.items():
                assert name not in seen, f"{name} produced twice"
                assert torch.equal(tensor, state[name]), f"{mname} -> {name} does not round-trip exactly"
                seen[name] = tensor
        assert set(seen) == set(state), f"HF tensors never mapped: {sorted(set(state) - set(seen))[:5]}"

    def test_chat_template_is_token_in_token_out(self, model_spec):
        """The family's chat template (``posttrain.testing.chat_templates``) renders random multi-turn conversations
        with tool calls incrementally exactly as whole (``posttrain.testing.chat_conformance``)."""
        from posttrain.testing.chat_conformance import check_template
        from posttrain.testing.chat_templates import FAMILY_OF, TEMPLATES, chat_tokenizer

        families = {FAMILY_OF[t] for t in type(model_spec).model_types if t in FAMILY_OF}
        if not families:
            pytest.skip(f"{type(model_spec).__name__}: no chat template of its family in posttrain.testing")
        for family in sorted(families):
            problems = check_template(chat_tokenizer(family), conversations=8, max_calls=TEMPLATES[family][2])
            assert not problems, f"{family}: " + "\n".join(problems[:5])
