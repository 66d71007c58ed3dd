"""The slot-cache forward passes against HF's own forward: batched prefill, decode with idle slots,
and the full-span decode that CUDA graphs capture (run eagerly here on CPU)."""

from __future__ import annotations

import pytest
import torch

from posttrain.plugins.engines.local.model_runner import ModelRunner


@pytest.fixture(scope="module")
def runner(tiny_ckpt):
    torch.set_num_threads(1)
    return ModelRunner(tiny_ckpt, max_slots=4, context_length=64)


def hf_next_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "glm4"])
def test_prefill_and_decode_match_hf_for_each_family(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from posttrain.testing.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / family, family=family, seed=2)
    r = ModelRunner(ckpt, max_slots=4, context_length=64)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    prompts = {0: [5, 6, 7, 8, 9], 2: [10, 11]}  # slot 1 stays idle: a hole below the highest busy slot
    logits = r.prefill(list(prompts), list(prompts.values()))
    for row, (slot, p) in enumerate(prompts.items()):
        torch.testing.assert_close(logits[row], hf_next_logits(hf, p), atol=1e-4, rtol=1e-4)
    seqs = {s: p + [int(logits[i].argmax())] for i, (s, p) in enumerate(prompts.items())}
    for _ in range(3):
        tokens = torch.tensor([seqs[0][-1], 0, seqs[2][-1]])
        positions = torch.tensor([len(seqs[0]) - 1, 0, len(seqs[2]) - 1])
        out = r.decode(tokens, positions)
        for slot in (0, 2):
            torch.testing.assert_close(out[slot], hf_next_logits(hf, seqs[slot]), atol=1e-4, rtol=1e-4)
            seqs[slot].append(int(out[slot].argmax()))


def test_full_span_decode_equals_the_tight_span(runner):
    """CUDA graphs attend over a fixed span; stale cache entries past each position must not matter."""
    runner.k_cache.normal_()  # garbage everywhere, as after earlier requests
    runner.v_cache.normal_()
    runner.prefill([0, 1], [[5, 6, 7], [8, 9, 10, 11, 12]])
    tokens, positions = torch.tensor([20, 21]), torch.tensor([3, 5])
    tight = runner._decode_eager(tokens, positions, span=6)
    runner.prefill([0, 1], [[5, 6, 7], [8, 9, 10, 11, 12]])  # same state again (decode wrote position 3/5)
    full = runner._decode_eager(tokens, positions, span=runner.context_length)
    torch.testing.assert_close(tight, full, atol=1e-5, rtol=1e-5)


def test_a_shared_prompt_is_run_once_and_fills_every_slot_that_holds_it(runner):
    """A group's samples share their prompt: the prefill runs each distinct prompt once, yet every slot
    gets its K/V, every row its logits and prompt log-probs, as if each had been run alone."""
    a, b = [5, 6, 7, 8], [9, 10]
    runner.k_cache.normal_()
    runner.v_cache.normal_()
    logits, scored = runner.prefill_scored([3, 0, 2, 1], [a, b, a, a], [0, None, 1, None])
    alone = {}
    for slot, p in ((3, a), (0, b)):  # each distinct prompt by itself, into a spare copy of the cache
        k, v = runner.k_cache.clone(), runner.v_cache.clone()
        alone[tuple(p)] = (runner.prefill_scored([slot], [p], [0])[0][0], runner.k_cache[:, slot, :, :len(p)].clone())
        runner.k_cache.copy_(k), runner.v_cache.copy_(v)
    for row, (slot, p) in enumerate(zip([3, 0, 2, 1], [a, b, a, a])):
        want_logits, want_k = alone[tuple(p)]
        torch.testing.assert_close(logits[row], want_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runner.k_cache[:, slot, :, :len(p)], want_k, atol=1e-5, rtol=1e-5)
    assert len(scored[0]) == len(a) - 1 and len(scored[2]) == len(a) - 2 and scored[1] is None
    assert scored[0][1:] == pytest.approx(scored[2], abs=1e-6)  # the same prompt, scored from position 1


def test_load_weights_is_all_or_nothing(runner, tiny_ckpt):
    """Every name, shape and dtype is checked before the first copy: a bad update changes nothing."""
    before = runner.weight_checksums()
    names = list(runner.model.state_dict())
    good = {n: torch.ones_like(t) for n, t in runner.model.state_dict().items()}
    for bad, fragment in (({**good, "no.such.weight": torch.zeros(1)}, "unknown weight name 'no.such.weight'"),
                          ({**good, names[-1]: torch.zeros(3, 3, 3)}, "does not match"),
                          ({**good, names[-1]: torch.zeros(good[names[-1]].shape, dtype=torch.int64)},
                           "not a floating-point")):
        with pytest.raises(ValueError, match=fragment):
            runner.load_weights(bad)
        assert runner.weight_checksums() == before
    with pytest.raises(ValueError, match=f"covers 1 of {len(names)} tensors"):
        runner.load_weights({names[0]: good[names[0]]}, require_all=True)
    assert runner.load_weights(good, require_all=True) == len(good)
    assert runner.weight_checksums() != before
    from safetensors.torch import load_file

    restore = load_file(str(tiny_ckpt / "model.safetensors"))
    runner.load_weights(restore, require_all=True)
    assert runner.weight_checksums() == before


def test_tied_weights_are_covered_by_either_name(tmp_path):
    from posttrain.testing.tiny import make_tiny_checkpoint

    tied = ModelRunner(make_tiny_checkpoint(tmp_path / "tied", tie_word_embeddings=True), max_slots=1, context_length=16)
    state = tied.model.state_dict()
    assert len(tied.required_weights()) == len(state) - 1
    for dropped in ("lm_head.weight", "model.embed_tokens.weight"):
        assert tied.load_weights({n: t for n, t in state.items() if n != dropped}, require_all=True) == len(state) - 1


def test_a_request_that_breaks_a_step_fails_alone(runner):
    """A request whose own parameters break the batched draw (here a NaN temperature, which the server
    refuses, handed to the engine directly) ends with an error; the requests beside it go on."""
    import threading

    from posttrain.plugins.engines.local.engine import BatchEngine
    from posttrain.plugins.engines.local.sampling import RequestSampling

    engine = BatchEngine(runner, None, [])
    results, done = {}, threading.Event()

    def submit(name, sampling):
        def on_done(result):
            results[name] = result
            if len(results) == 3:
                done.set()
        engine.submit([5, 6, 7], sampling, True, on_done, rid=name)

    try:
        submit("good_a", RequestSampling(max_new_tokens=6, temperature=1.0, ignore_eos=True))
        submit("bad", RequestSampling(max_new_tokens=6, temperature=float("nan"), top_k=5, ignore_eos=True))
        submit("good_b", RequestSampling(max_new_tokens=6, temperature=0.0, ignore_eos=True))
        assert done.wait(60)
    finally:
        engine.shutdown()
    assert "error" in results["bad"] and results["bad"]["meta_info"]["finish_reason"]["type"] == "abort"
    for name in ("good_a", "good_b"):
        assert "error" not in results[name]
        assert results[name]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        assert len(results[name]["output_ids"]) == 6


def test_auto_dtype_follows_the_checkpoint_on_a_gpu_and_is_float32_on_the_cpu(tmp_path):
    """A float32 policy is sampled in float32 on a GPU too (issue 24: a bf16 engine copy of a float32
    trainer parted from its log-probs by ~1e-3); a bf16 checkpoint or one that names no dtype runs bf16."""
    import json

    import torch

    from posttrain.plugins.engines.local.model_runner import resolve_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for named, expected in (("float32", "float32"), ("bfloat16", "bfloat16"), (None, "bfloat16")):
        (tmp_path / "config.json").write_text(json.dumps({} if named is None else {"torch_dtype": named}))
        assert resolve_dtype("auto", cuda, str(tmp_path)) == expected
        assert resolve_dtype("auto", cpu, str(tmp_path)) == "float32"
        assert resolve_dtype("float16", cuda, str(tmp_path)) == "float16"
    assert resolve_dtype("auto", cuda, None) == "bfloat16"


def test_cache_copies_move_whole_words_and_keep_every_bit():
    """``as_words``: a bf16 ``[n, Hkv, T, D]`` view of ``[n, T, Hkv, D]`` projections copies into the slot
    cache as 8-byte words, bit for bit (slices and ``index_copy_``); what is not whole words stays as it is."""
    from posttrain.plugins.engines.local.cache_write import as_words

    cache = torch.zeros(4, 2, 10, 8, dtype=torch.bfloat16)
    x = torch.randn(3, 6, 2, 8).to(torch.bfloat16).transpose(1, 2)
    assert as_words(x).dtype == torch.int64 and as_words(x).shape == (3, 2, 6, 2)
    as_words(cache[1:4, :, :6]).copy_(as_words(x))
    assert torch.equal(cache[1:4, :, :6], x) and not cache[0].any()
    other = torch.zeros_like(cache)
    as_words(other[:, :, :6]).index_copy_(0, torch.tensor([0, 2, 3]), as_words(x))
    assert torch.equal(other[torch.tensor([0, 2, 3]), :, :6], x)
    for odd in (torch.randn(3, 2, 6, 3), torch.randn(2, 5, dtype=torch.float64), torch.randn(4, 8).to(torch.bfloat16)[:, 1:5]):
        assert as_words(odd) is odd  # 12-byte rows, 8-byte elements, an offset of one bf16 element


def test_a_half_precision_engine_keeps_float32_buffers_as_transformers_does(tmp_path):
    """The weights in bf16, the rotary table (and a router's expert bias) in float32: a bf16 ``inv_freq`` puts a
    position's angle off by up to 2^-9 of itself, where the trainer's table is float32."""
    from transformers import AutoModelForCausalLM

    from posttrain.testing.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "glm4_moe", family="glm4_moe", seed=1)
    r = ModelRunner(ckpt, dtype="bfloat16", max_slots=1, context_length=32)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16)
    buffers = dict(r.model.named_buffers())
    assert buffers and {n: b.dtype for n, b in buffers.items()} == {n: b.dtype for n, b in hf.named_buffers()}
    assert buffers["model.rotary_emb.inv_freq"].dtype == torch.float32
    assert {p.dtype for p in r.model.parameters()} == {torch.bfloat16}
