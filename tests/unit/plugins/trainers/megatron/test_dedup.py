"""Samples with the same inputs run the layers once (trainers/megatron/dedup.py): the same log-probs,
losses and updated weights as running every row, with the layers seeing only the distinct rows."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.train_batch import TrainBatch
from posttrain.plugins.trainers.megatron.dedup import distinct_rows
from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

from tests.unit.plugins.trainers.megatron.train_helpers import local_loss, spec_for, trainer_configs

P1, P2, P3 = [5, 6, 7], [8, 9, 10, 11], [12, 13]
# GRPO groups: one-token answers of P1 (1 distinct input), two-token answers of P2 (inputs P2 + first
# token: 2 distinct), P3's answers all distinct
SAMPLES = ([P1 + [a] for a in (20, 21, 20, 22)] + [P2 + r for r in ([30, 31], [30, 32], [33, 31])]
           + [P3 + r for r in ([40, 41, 42], [40, 43, 42])])
PROMPTS = [3] * 4 + [4] * 3 + [2] * 2
DISTINCT = 1 + 2 + 2


def test_distinct_rows_keeps_one_row_per_input_the_loss_reads():
    batch = TrainBatch.from_lists(SAMPLES, PROMPTS)
    rows, inverse = distinct_rows(batch.tokens, batch.lengths)
    assert rows.shape == (DISTINCT, batch.tokens.shape[1])
    for b, n in enumerate(batch.lengths.tolist()):  # every sample's read inputs are its row's
        assert torch.equal(rows[inverse[b], :n - 1], batch.tokens[b, :n - 1])
    assert inverse[:4].unique().numel() == 1 and inverse[4:7].unique().numel() == 2
    same, none = distinct_rows(batch.tokens[[0, 4, 7]], batch.lengths[[0, 4, 7]])
    assert none is None and torch.equal(same, batch.tokens[[0, 4, 7]])
    # equal read inputs but different lengths are different rows (a shorter sample's last token is unread)
    rows, inverse = distinct_rows(torch.tensor([[1, 2, 3, 0], [1, 2, 3, 4]]), torch.tensor([3, 4]))
    assert inverse is None and rows.shape[0] == 2


def _trainer(tiny_ckpts, dedup, **kw):
    configs = trainer_configs(lr=1e-3, micro_batch_size=9, global_batch_size=9, sequence_packing=False,
                              entropy_coef=0.01, dedup_inputs=dedup, **kw)
    return MegatronTrainer(spec_for("qwen3", tiny_ckpts("qwen3")), **configs)


def _rows_seen(trainer):
    seen = []
    trainer.gpt.decoder.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs["hidden_states"].shape[1]),
                                                  with_kwargs=True)
    return seen


@pytest.mark.usefixtures("megatron_tp1")
def test_deduplicated_step_equals_the_full_one(tiny_ckpts):
    full, dedup = _trainer(tiny_ckpts, False), _trainer(tiny_ckpts, True)
    seen_full, seen_dedup = _rows_seen(full), _rows_seen(dedup)
    batch = TrainBatch.from_lists(SAMPLES, PROMPTS)
    batch.advantages = torch.randn(len(SAMPLES), 1, generator=torch.Generator().manual_seed(0)) * batch.response_mask

    (lp_f, ent_f), (lp_d, ent_d) = full.log_probs(batch, with_entropy=True), dedup.log_probs(batch, with_entropy=True)
    assert (lp_f - lp_d).abs().max() < 1e-6 and (ent_f - ent_d).abs().max() < 1e-6
    batch.old_log_probs = None
    m_f, kept_f, _ = full.train_step(batch, local_loss, keep_log_probs=True)
    m_d, kept_d, _ = dedup.train_step(batch, local_loss, keep_log_probs=True)
    assert seen_full == [len(SAMPLES)] * 2 and seen_dedup == [DISTINCT] * 2  # log_probs, then the train forward
    assert (kept_f - kept_d).abs().max() < 1e-6
    for key in ("loss", "grad_norm", "entropy"):
        assert m_d[key] == pytest.approx(m_f[key], abs=1e-6), key
    params_f, params_d = dict(full.gpt.named_parameters()), dict(dedup.gpt.named_parameters())
    # Adam's first step moves each weight by ~lr (1e-3) whatever the gradient's size: float order shows at 1e-6
    assert max((params_f[n] - params_d[n]).abs().max().item() for n in params_f) < 1e-5
    assert any((p - q).abs().max() > 0 for p, q in zip(params_f.values(), _trainer(tiny_ckpts, False).gpt.parameters()))


@pytest.mark.usefixtures("megatron_tp1")
@pytest.mark.parametrize("name, kw", [("qwen3", dict(sequence_packing=True, attention="sdpa")),
                                      ("qwen3", dict(megatron={"hidden_dropout": 0.1})), ("qwen3_moe", {})],
                         ids=["packed", "dropout", "moe"])
def test_dedup_stays_off_where_rows_are_not_alone_in_what_they_see(tiny_ckpts, name, kw):
    configs = trainer_configs(lr=1e-3, micro_batch_size=9, global_batch_size=9, dedup_inputs=True,
                              **{"sequence_packing": False, **kw})
    assert _trainer(tiny_ckpts, True)._dedup  # the control: a dense model in padded rows deduplicates
    assert not MegatronTrainer(spec_for(name, tiny_ckpts(name)), **configs)._dedup
