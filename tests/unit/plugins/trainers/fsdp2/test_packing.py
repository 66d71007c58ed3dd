"""Sequence packing in the fsdp2 trainer: packed rows give the padded rows' log-probs, entropy and step (qwen3, llama
and two HF-only architectures with sliding windows), a sample is blind to the samples packed beside it, micro-batches
keep to max_tokens_per_micro_batch with one count on every rank, and an architecture that cannot pack is refused
(true) or padded with one line (auto)."""

from __future__ import annotations

import logging

import pytest
import torch

from posttrain.plugins.trainers.fsdp2 import packing, parallel

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=0,
            eos_token_id=0, tie_word_embeddings=False)
# HF-only architectures (no spec of their own: the generic hf spec trains them), with windows shorter than the samples
HF_ONLY = {"mistral": dict(sliding_window=4),
           "gemma3_text": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                               query_pre_attn_scalar=24)}


def _hf_checkpoint(root, model_type: str, **extra):
    import transformers

    from posttrain.core.char_tokenizer import make_tokenizer

    out = root / model_type
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **extra})
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(out))
    make_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_ckpts):
    """``make(family, packing, **trainer keys) -> (model, run, plugins)``: fsdp2 models of one checkpoint per family."""
    from posttrain.core.config import Selection
    from posttrain.core.plugins import load_plugins
    from posttrain.testing.contracts.trainer import run_config

    torch.set_num_threads(1)
    plugins = load_plugins(autoload=False)
    cls = plugins.registry("trainers")["fsdp2"]
    root = tmp_path_factory.mktemp("hf-only")
    paths = {name: _hf_checkpoint(root, name, **extra) for name, extra in HF_ONLY.items()}

    def make(family: str, sequence_packing, **trainer):
        backend = cls(cls.Config(sequence_packing=sequence_packing))
        run = run_config(backend, **trainer)
        if family in paths:
            hf = plugins.models["hf"]
            run.model = Selection("models", "hf", hf.Config(path=str(paths[family]), dtype="float32"), cls=hf)
        else:
            run.model.config.path = str(tiny_ckpts(family))
        return backend.build(run.model.create(plugins), run), run, plugins

    return make


def _batch(lengths: list[int], seed: int = 0):
    from posttrain.core.train_batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(1, 100, (n,), generator=g).tolist() for n in lengths]
    batch = TrainBatch.from_lists(tokens, [max(1, n // 2) for n in lengths])
    batch.advantages = torch.linspace(1.0, -1.0, len(lengths))[:, None] * batch.response_mask
    return batch


@pytest.mark.parametrize("family", ["qwen3", "llama", *HF_ONLY])
def test_packed_log_probs_and_entropy_equal_padded(setup, family):
    """Rows of at most 24 tokens (lengths 2..13, past the HF-only models' 4-token windows) against padded rows."""
    batch = _batch([9, 3, 13, 6, 2, 11])
    packed, _, _ = setup(family, "auto", max_tokens_per_micro_batch=24)
    padded, _, _ = setup(family, False, max_tokens_per_micro_batch=24)
    assert packed.packed and not padded.packed
    assert packed.model.config._attn_implementation == packing.ATTENTION
    lp, ent = packed.log_probs(batch, with_entropy=True)
    ref_lp, ref_ent = padded.log_probs(batch, with_entropy=True)
    assert (lp - ref_lp).abs().max() < 1e-5 and (ent - ref_ent).abs().max() < 1e-5
    assert lp.abs().sum() > 0 and torch.equal(lp == 0, ref_lp == 0), "the same columns hold values"


def test_packed_step_equals_padded_step(setup):
    """A step over micro-batches of at most 14 tokens (packed: two samples a row; padded: count x longest) at a sampling
    temperature, with KL and entropy terms: the same metrics, weights and log-probs after it."""
    from posttrain.testing.contracts.trainer import contract_batch, hf_weights

    out = []
    for mode in (True, False):
        model, run, plugins = setup("qwen3", mode, max_tokens_per_micro_batch=14)
        batch = contract_batch()
        batch.temperature = 0.7
        batch.old_log_probs, batch.ref_log_probs = (lp := model.log_probs(batch)[0]), lp - 0.01
        metrics = model.train_step(batch, run.loss.create(plugins))
        out.append((metrics, hf_weights(model), model.log_probs(batch)[0], lp))
    (m, w, after, before), (ref_m, ref_w, ref_after, ref_before) = out
    assert m.keys() == ref_m.keys()
    for k in ("loss", "grad_norm", "kl", "entropy"):
        assert abs(m[k] - ref_m[k]) <= 1e-5 * max(1.0, abs(ref_m[k])), f"{k}: {m[k]} != {ref_m[k]}"
    # Adam's first update is about lr (1e-2) per weight, its sign set by gradients near 0 too: 1e-3 of one step
    assert max(float((w[k] - ref_w[k]).abs().max()) for k in w) < 1e-5
    assert (after - ref_after).abs().max() < 1e-5 and (after - before).abs().max() > 1e-3, "the step moved"


def test_a_sample_is_blind_to_the_samples_packed_beside_it(setup):
    """Sample 0's log-probs alone, beside one sample and beside another (one row each time) agree to float32 noise;
    the neighbours' own log-probs differ."""
    from posttrain.core.train_batch import TrainBatch

    model, _, _ = setup("mistral", True, micro_batch_size=4)
    a, b, c = (_batch([n], seed).tokens[0].tolist() for n, seed in ((10, 1), (7, 2), (12, 3)))
    results = [model.log_probs(TrainBatch.from_lists(rows, [2] * len(rows)))[0]
               for rows in ([a], [b, a], [c, a, b])]
    alone, beside_b, beside_cb = results[0][0], results[1][1], results[2][1]
    assert (beside_b[:10] - alone).abs().max() < 1e-6 and (beside_cb[:10] - alone).abs().max() < 1e-6
    assert (results[1][0, :7] - results[2][2, :7]).abs().max() < 1e-6, "b, at the start or the end of a row"


def test_packed_micro_batches_keep_to_the_token_cap_and_the_ranks_count(monkeypatch):
    from posttrain.core.train_batch import TrainBatch

    lengths = [30, 5, 22, 9, 17, 3, 40, 11]
    for cap in (40, 45, 64, 100, 200):
        shares = parallel.capped_split(lengths, cap)
        loads = [sum(lengths[i] for i in s) for s in shares]
        assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
        assert all(load <= cap for load in loads), (cap, loads)
        assert len(shares) >= -(-sum(lengths) // cap)
    assert parallel.capped_split([50, 10, 10], 20) == [[0], [1, 2]], "a sample past the cap goes alone"
    part = TrainBatch(tokens=torch.ones(len(lengths), 40, dtype=torch.long), lengths=torch.tensor(lengths),
                      response_mask=torch.ones(len(lengths), 40))
    monkeypatch.setattr(parallel, "rank_size", lambda: (0, 1))  # one rank: no process group needed
    mine = parallel.micro_batches(part, 2, 64, packed=True)
    assert len(mine) == len(parallel.capped_split(lengths, 64)) and all(real for _, real in mine)
    # another rank needs 6 passes: this one runs 6, every real one within the cap, all its samples once
    monkeypatch.setattr(parallel, "rank_size", lambda: (0, 2))
    monkeypatch.setattr(parallel, "all_max", lambda value: max(value, 6))
    agreed = parallel.micro_batches(part, 2, 64, packed=True)
    real = [index for index, is_real in agreed if is_real]
    assert len(agreed) == 6 and sorted(i for s in real for i in s) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in s) <= 64 for s in real)
    monkeypatch.setattr(parallel, "all_max", lambda value: max(value, 10))  # more passes than samples: reruns
    assert [real for _, real in parallel.micro_batches(part, 2, 64, packed=True)] == [True] * 8 + [False] * 2
    # where the balanced split at the agreed count would break the cap, the rank halves its own shares instead
    halves = parallel._split_largest([[0, 1, 2], [3, 4]], lengths, 4)
    assert sorted(sorted(s) for s in halves) == [[0], [1], [2], [3, 4]], "57 tokens, then 27 of 27 vs 26"
    assert parallel._split_largest([[0], [1]], lengths, 5) == [[0], [1]], "one sample a share: no more to split"


def _hf(model_type: str, **extra) -> dict:
    import transformers

    return {**transformers.AutoConfig.for_model(model_type, **{**TINY, **extra}).to_dict(), "model_type": model_type}


# spec families (posttrain.testing.tiny's configs) and HF-only types (TINY plus these keys)
CAN_PACK = {"qwen3": None, "llama": None, "qwen3_moe": None, "deepseek_v3": None, "glm4_moe": None,
            "mistral": dict(sliding_window=4), "phi3": {}, "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512)}
CANNOT_PACK = {"gemma2": ({}, "soft-capping"), "gpt_oss": (dict(num_local_experts=4), "sinks"),
               "lfm2": (dict(layer_types=["conv", "full_attention"]), "conv layers mix tokens outside attention"),
               "qwen3_next": (dict(layer_types=["linear_attention", "full_attention"]), "linear_attention layers"),
               "falcon_h1": ({}, "does not hand its attention the sample offsets")}


@pytest.mark.parametrize("model_type", CAN_PACK)
def test_architectures_that_can_pack_give_each_sample_its_own_logits(model_type):
    """transformers' own model with the varlen attention, on one packed row of three samples: each sample's logits
    equal those of the sample alone (GQA, sliding window, MLA's narrower value heads, learned absolute positions)."""
    import transformers

    from posttrain.core.train_batch import pack

    from posttrain.testing.tiny import tiny_config

    extra = CAN_PACK[model_type]
    hf = tiny_config(model_type).to_dict() if extra is None else _hf(model_type, **extra)
    assert packing.cannot_pack(hf) is None
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf)).eval()
    lengths = torch.tensor([7, 11, 3])
    tokens = torch.randint(1, 100, (3, 11))
    with torch.no_grad():
        alone = [model(input_ids=tokens[b, :n][None], use_cache=False).logits[0] for b, n in enumerate(lengths)]
        packing.register()
        model.set_attn_implementation(packing.ATTENTION)
        row = model(**packing.forward_kwargs(pack(tokens, lengths)), use_cache=False).logits[0]
    assert max(float((a - p).abs().max()) for a, p in zip(alone, torch.split(row, lengths.tolist()))) < 1e-5


@pytest.mark.parametrize("model_type", CANNOT_PACK)
def test_architectures_that_cannot_pack_say_why(model_type):
    extra, reason = CANNOT_PACK[model_type]
    assert reason in (packing.cannot_pack(_hf(model_type, **extra)) or "")


def test_vision_language_models_and_unknown_types_cannot_pack():
    from posttrain.testing.tiny import tiny_vlm_config

    assert "vision-language" in packing.cannot_pack(tiny_vlm_config().to_dict())
    assert "no modeling code" in packing.cannot_pack({"model_type": "no_such_model"})
    assert packing.modeling_source("gemma3_text") == packing.modeling_source("gemma3"), "found by its config file"


def test_sequence_packing_true_on_a_model_that_cannot_pack_is_a_config_error_and_auto_pads(tmp_path, caplog):
    """model.path to a qwen3_next config (linear-attention layers): ``true`` is one config error naming the key and the
    reason; ``auto`` passes the check with one line saying packing is off, and ``false`` says nothing."""
    import json

    from posttrain.core.config import load_config
    from posttrain.core.errors import ConfigError
    from posttrain.core.plugins import load_plugins
    from posttrain.testing.contracts.trainer import RUN

    hf = _hf("qwen3_next", **CANNOT_PACK["qwen3_next"][0])
    (tmp_path / "config.json").write_text(json.dumps(hf))
    plugins = load_plugins(autoload=False)

    def check(setting):
        data = {**RUN, "model": {"name": "hf", "path": str(tmp_path), "tokenizer": "char"},
                "trainer": {**RUN["trainer"], "backend": {"name": "fsdp2", "sequence_packing": setting}}}
        return load_config(None, data=data, plugins=plugins)

    with pytest.raises(ConfigError) as caught:
        check(True)
    errors = [e for e in caught.value.errors if "sequence_packing" in e]
    assert errors == [f"trainer.backend.sequence_packing: qwen3_next cannot pack: {packing.cannot_pack(hf)}; "
                      f"set it to false (or auto)"], caught.value.errors
    packing._said.clear()
    with caplog.at_level(logging.WARNING, logger="posttrain.trainer"):
        check("auto")
        check("auto")
        check(False)
    lines = [r.getMessage() for r in caplog.records if "sequence_packing" in r.getMessage()]
    assert lines == ["trainer.backend.sequence_packing: auto -> off for qwen3_next: its linear_attention layers mix "
                     "tokens outside attention, across sample boundaries"]


def test_the_config_check_imports_no_torch():
    """``auto`` decides at the config check from config.json and transformers' source text: the driver has not
    imported torch then (it starts engines first)."""
    import subprocess
    import sys

    code = ("import sys\nfrom posttrain.core.config import load_config\nfrom posttrain.core.plugins import load_plugins\n"
            "from posttrain.testing.contracts.trainer import RUN\n"
            "run = load_config(None, data={**RUN, 'trainer': {**RUN['trainer'], 'backend': {'name': 'fsdp2'}}}, "
            "plugins=load_plugins(autoload=False))\n"
            "print('BACKEND', run.trainer.backend.config.sequence_packing)\n"
            "print('HEAVY', sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "BACKEND auto" in out.stdout and "HEAVY []" in out.stdout, out.stdout[-500:] + out.stderr[-2000:]
