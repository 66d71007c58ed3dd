"""Input log-probs (SGLang's ``logprob_start_len``): the local engine scores a prompt's own tokens, as a
teacher scores a student's sample, equal to the model's forward pass (fp32)."""

from __future__ import annotations

import asyncio

import pytest

from posttrain.core.rollout.client import EngineClient, EngineRequestError

SAMPLES = [[5, 6, 7, 8, 30, 31, 32], [40, 41, 42], [60, 70, 80, 90, 11, 12, 13, 14, 15], [99, 3]]
SCORE = {"temperature": 0.0, "max_new_tokens": 0}


def _forward_logprobs(hf_model, ids):
    """``log p(ids[t] | ids[:t])`` for ``t = 1 .. len - 1`` from the HF model (fp32)."""
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    return [logp[t - 1, ids[t]].item() for t in range(1, len(ids))]


async def test_teacher_query_equals_the_forward_pass(engine_url, engine_key, hf_model):
    samples = SAMPLES * 5  # more than the engine's 8 slots: scoring-only prefills, then the waiting ones
    async with EngineClient(engine_url, api_key=engine_key) as engine:  # all at once: they share prefill batches
        outs = await asyncio.gather(*[engine.generate(input_ids=ids, sampling_params=SCORE, logprob_start_len=0)
                                      for ids in samples])
    for ids, out in zip(samples, outs):
        entries = out["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in entries] == ids and entries[0][0] is None  # SGLang: no value for the first
        assert [lp for lp, _, _ in entries[1:]] == pytest.approx(_forward_logprobs(hf_model, ids), abs=1e-5)
        assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        assert out["meta_info"]["output_token_logprobs"] == []


async def test_a_start_inside_the_prompt_and_generation_in_the_same_request(engine_url, engine_key, hf_model):
    ids = SAMPLES[2]
    async with EngineClient(engine_url, api_key=engine_key) as engine:
        scored, plain = await asyncio.gather(
            engine.generate(input_ids=ids, sampling_params={"temperature": 0.0, "max_new_tokens": 3,
                                                            "ignore_eos": True}, logprob_start_len=5),
            engine.generate(input_ids=ids, sampling_params={"temperature": 0.0, "max_new_tokens": 3,
                                                            "ignore_eos": True}))
    entries = scored["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in entries] == ids[5:] and entries[0][0] is None
    assert [lp for lp, _, _ in entries[1:]] == pytest.approx(_forward_logprobs(hf_model, ids)[5:], abs=1e-5)
    assert scored["output_ids"] == plain["output_ids"]  # scoring the prompt leaves generation alone
    assert plain["meta_info"]["input_token_logprobs"] == []  # the default -1: none


async def test_batched_request_with_one_start_per_prompt(engine_url, engine_key, hf_model):
    async with EngineClient(engine_url, api_key=engine_key) as engine:
        outs = await engine.request("POST", "/generate", {"input_ids": SAMPLES[:2], "sampling_params": SCORE,
                                                          "return_logprob": True, "logprob_start_len": [1, 0]})
    assert [t for _, t, _ in outs[0]["meta_info"]["input_token_logprobs"]] == SAMPLES[0][1:]
    assert [lp for lp, _, _ in outs[1]["meta_info"]["input_token_logprobs"][1:]] == pytest.approx(
        _forward_logprobs(hf_model, SAMPLES[1]), abs=1e-5)


@pytest.mark.parametrize("start", [3, -2, 1.5, True])
async def test_a_start_outside_the_prompt_is_a_bad_request(engine_url, engine_key, start):
    async with EngineClient(engine_url, api_key=engine_key) as engine:
        with pytest.raises(EngineRequestError) as info:
            await engine.generate(input_ids=[1, 2, 3], sampling_params=SCORE, logprob_start_len=start)
    assert info.value.status == 400 and "logprob_start_len" in info.value.message


async def test_the_teacher_scores_a_samples_response_tokens(engine_url, engine_key, hf_model):
    from posttrain.core.estimator_inputs import estimator_metadata
    from posttrain.core.rollout.teacher import Teacher, add_teacher_log_probs
    from posttrain.core.types import Sample

    samples = [Sample(prompt="", tokens=ids, response_length=n) for ids, n in zip(SAMPLES[:3], (3, 1, 4))]
    failed = Sample(prompt="", tokens=[7, 8], response_length=0)  # nothing generated: not scored
    async with EngineClient(engine_url, api_key=engine_key) as client:
        await add_teacher_log_probs(samples + [failed], Teacher(client))
    for s in samples:
        forward = _forward_logprobs(hf_model, s.tokens)[-s.response_length:]
        assert s.metadata["teacher_log_probs"] == pytest.approx(forward, abs=1e-5)
    assert "teacher_log_probs" not in failed.metadata
    teacher = estimator_metadata(samples)["teacher_log_probs"]  # [B, T], aligned with the trainer's batch
    assert teacher.shape == (3, 9) and teacher[0, :4].abs().sum() == 0 and teacher[1, 3:].abs().sum() == 0
    assert teacher[2, 5:].tolist() == pytest.approx(samples[2].metadata["teacher_log_probs"], abs=1e-6)


def test_teacher_and_student_must_share_a_tokenizer(tiny_ckpt, tmp_path):
    from transformers import AutoTokenizer

    from posttrain.core.errors import UsageError
    from posttrain.core.rollout.teacher import check_same_tokenizer

    check_same_tokenizer(str(tiny_ckpt), str(tiny_ckpt))
    other = AutoTokenizer.from_pretrained(str(tiny_ckpt))
    other.add_tokens(["<extra>"])
    other.save_pretrained(tmp_path)
    with pytest.raises(UsageError, match=r"teacher: its tokenizer .* is not the student's .*: 1 of 108 tokens"):
        check_same_tokenizer(str(tiny_ckpt), str(tmp_path))
