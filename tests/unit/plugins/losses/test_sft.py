"""The SFT loss through the Megatron trainer on a packed batch equals the cross-entropy computed by hand
from HF transformers' logits, with the SFT data path's masks (prompt and user turns left out)."""

from __future__ import annotations

import pytest
import torch

from posttrain.plugins.losses.sft import SFTLoss
from posttrain.plugins.modes.sft import SFTMode
from posttrain.plugins.modes.sft.data import encode_row, to_batch
from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

from tests.unit.plugins.trainers.megatron.train_helpers import spec_for, trainer_configs

pytestmark = pytest.mark.usefixtures("megatron_tp1")


def _examples(tokenizer):
    from posttrain.core.config import DataConfig

    data, mode = DataConfig(), SFTMode.Config()
    single, _ = encode_row({"prompt": "3+4=", "response": "7"}, data, mode, tokenizer)
    chat, _ = encode_row({"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
                                       {"role": "user", "content": "2+7="}, {"role": "assistant", "content": "9"}]},
                         data, mode, tokenizer)
    return single, chat


def test_masks_cover_the_response_and_the_assistant_turns_only(tiny_ckpts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_ckpts("qwen3")))
    single, chat = _examples(tok)
    trained = lambda e: tok.decode([t for t, m in zip(e.tokens, e.mask) if m])  # noqa: E731
    assert trained(single) == "7<|endoftext|>"  # the response and EOS; the prompt is never trained
    assert tok.decode(single.tokens) == "3+4=7<|endoftext|>"
    # both assistant turns with their end-of-turn marker; user turns and "<|im_start|>assistant\n" masked
    assert trained(chat) == "2<|im_end|>\n9<|im_end|>\n"
    assert tok.decode(chat.tokens).count("<|im_start|>assistant\n") == 2


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_sft_loss_on_a_packed_batch_equals_the_hand_computed_cross_entropy(tiny_ckpts, aggregation):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_ckpts("qwen3")
    tok = AutoTokenizer.from_pretrained(str(path))
    examples = _examples(tok)
    batch = to_batch(list(examples))
    trainer = MegatronTrainer(spec_for("qwen3", path), **trainer_configs(
        lr=1e-3, global_batch_size=2, micro_batch_size=2, sequence_packing=True, attention="sdpa"))
    metrics = trainer.train_step(batch, SFTLoss(SFTLoss.Config(aggregation=aggregation)))

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    per_sample = []  # (sum of -log p over trained tokens, trained tokens), one forward pass per sample
    for e in examples:
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([e.tokens])).logits[0].float(), -1)
        nll = [-logp[t - 1, e.tokens[t]].item() for t in range(1, len(e.tokens)) if e.mask[t]]
        per_sample.append((sum(nll), len(nll)))
    if aggregation == "token-mean":
        expected = sum(s for s, _ in per_sample) / sum(n for _, n in per_sample)
    else:
        expected = sum(s / n for s, n in per_sample) / len(per_sample)
    assert metrics["loss"] == pytest.approx(expected, abs=1e-5)
    assert metrics["pg/pg_loss"] == pytest.approx(expected, abs=1e-5)
    # the step moved the weights towards the labels: the same batch scores better afterwards
    assert trainer.train_step(batch, SFTLoss(SFTLoss.Config(aggregation=aggregation)))["loss"] < expected
