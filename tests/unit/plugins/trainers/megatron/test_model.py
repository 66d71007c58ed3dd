"""GPTModel from a spec + HF weights: logits equal transformers', conversions round-trip exactly."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.errors import UsageError
from posttrain.plugins.trainers.megatron import model as M

from tests.unit.plugins.trainers.megatron.train_helpers import spec_for

pytestmark = pytest.mark.usefixtures("megatron_tp1")


def _hf_logits(path, ids):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(ids).logits


def _megatron(family, path, attention="sdpa"):
    spec = spec_for(family, path)
    hf = spec.hf_config()
    model = M.build_gpt(spec, hf, dtype="float32", attention=attention, init_weights=False)
    M.load_hf(model, spec, hf, path)
    return spec, hf, model.eval()


@pytest.mark.parametrize("family,attention", [("qwen3", "sdpa"), ("qwen3", "local"), ("qwen2", "sdpa"),
                                              ("llama", "sdpa"), ("glm4", "sdpa")])
def test_megatron_logits_equal_hf_logits(tiny_ckpts, family, attention):
    path = tiny_ckpts(family)
    _, hf, model = _megatron(family, path, attention)
    ids = torch.randint(0, hf["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(13).unsqueeze(0).expand(2, -1)
    mask = torch.triu(torch.ones(13, 13, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        ours = model(ids, positions, attention_mask=mask)[..., : hf["vocab_size"]]
    theirs = _hf_logits(path, ids)
    assert theirs.abs().max() > 0.05  # the comparison is not between two near-zero tensors
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "glm4"])
def test_hf_megatron_hf_is_bit_exact_and_loadable(tiny_ckpts, tmp_path, family):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = tiny_ckpts(family)
    spec, hf, model = _megatron(family, path)
    out = M.save_hf(model, spec, hf, tmp_path / "hf", source_dir=path)
    original, written = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(original) == sorted(written)
    assert all(torch.equal(original[k], written[k]) for k in original)
    assert (out / "tokenizer.json").is_file()
    AutoModelForCausalLM.from_pretrained(str(out))  # transformers accepts config + weights


def test_a_perturbed_weight_changes_the_logits(tiny_ckpts):
    """The equality above is not vacuous: one changed qkv entry moves the logits past the tolerance."""
    path = tiny_ckpts("qwen3")
    _, hf, model = _megatron("qwen3", path)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        M.megatron_params(model)["decoder.layers.0.self_attention.linear_qkv.weight"][0, 0] += 1.0
        ours = model(ids, torch.arange(9)[None], attention_mask=None)[..., :128]
    assert (ours - _hf_logits(path, ids)).abs().max().item() > 1e-3


def test_loading_checks_coverage_and_shapes(tiny_ckpts, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tiny_ckpts("qwen2")
    spec = spec_for("qwen2", path)
    hf = spec.hf_config()
    model = M.build_gpt(spec, hf, dtype="float32", init_weights=False)
    broken = tmp_path / "extra"
    broken.mkdir()
    state = load_file(str(path / "model.safetensors"))
    (broken / "config.json").write_text((path / "config.json").read_text())
    save_file({**state, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, str(broken / "model.safetensors"))
    with pytest.raises(UsageError, match="not used by spec 'qwen2'"):
        M.load_hf(model, spec, hf, broken)
    state.pop("model.layers.1.self_attn.q_proj.bias")
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(UsageError, match="q_proj.bias.*missing"):
        M.load_hf(model, spec, hf, broken)
    with pytest.raises(UsageError, match="no \\*.safetensors"):
        M.load_hf(model, spec, hf, tmp_path)


@pytest.mark.parametrize("tp_vocab", [130])
def test_tied_embeddings_and_padded_vocab(tmp_path, tp_vocab):
    """vocab 130 pads to 256 rows; tied output layer: logits, log-probs and the round trip still exact."""
    from safetensors.torch import load_file

    from posttrain.core.config import TrainerConfig
    from posttrain.core.train_batch import TrainBatch
    from posttrain.plugins.trainers.megatron.convert import verify_checkpoint
    from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer
    from posttrain.testing.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "tied", "qwen2", vocab_size=tp_vocab, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    spec = spec_for("qwen2", path)
    result = verify_checkpoint(spec, path, seq_len=12)
    assert result["passed"] and result["round_trip_exact"], result
    trainer = MegatronTrainer(spec, TrainerConfig(micro_batch_size=2, global_batch_size=2))
    assert trainer.gpt.embedding.word_embeddings.weight.shape[0] == 256
    ids = [5, 129, 17, 128, 3, 77]
    lp = trainer.log_probs(TrainBatch.from_lists([ids], [1]))[0][0]
    logp = torch.log_softmax(_hf_logits(path, torch.tensor([ids]))[0], -1)
    assert (lp[1:] - logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)).abs().max() < 1e-5
    exported = dict(kv for bucket in trainer.export_hf() for kv in bucket)
    assert "lm_head.weight" not in exported and exported["model.embed_tokens.weight"].shape[0] == tp_vocab
