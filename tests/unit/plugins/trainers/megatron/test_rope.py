"""The THD rotary that replaces Megatron's for packed micro-batches (issue 17): the same values, and one
compiled graph for any set of sample lengths (Megatron's splits by host lengths: a recompile per set)."""

from __future__ import annotations

import pytest
import torch

from posttrain.plugins.trainers.megatron import rope

pytestmark = pytest.mark.usefixtures("megatron_tp1")

LENGTH_SETS = ([5, 3, 9], [1, 12], [7, 7, 2, 4], [16], [2, 3, 5, 7, 11])


def _packed(lengths, heads=4, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(sum(lengths), heads, dim, generator=g)
    angles = torch.arange(max(lengths))[:, None] * (1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))[None]
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # [max_s, 1, 1, d], Megatron's layout
    return x, cu, freqs


def test_positions_restart_at_every_sample():
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert rope.thd_positions(cu, 8).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    empty = torch.tensor([0, 0, 2, 2, 5], dtype=torch.int32)  # empty samples first and inside
    assert rope.thd_positions(empty, 5).tolist() == [0, 1, 0, 1, 2]
    assert rope.thd_positions(torch.tensor([0, 4]), 4).tolist() == [0, 1, 2, 3]


def test_one_graph_serves_every_number_of_samples_a_micro_batch():
    """The trainer marks the token count and ``cu_seqlens`` symbolic from the first call (``compiled.py``). The
    positions once came from the slice ``cu_seqlens[1:-1]``, of one element for two samples, which Dynamo
    guards apart: a layer compiled at three samples or more recompiled at the first two-sample micro-batch (an
    H100 run's train phase of 21 s instead of 7.6) and again at one sample. AOTAutograd's tracing (which
    raised that guard) counts the graphs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(lambda cu, x: rope.thd_positions(cu, x.shape[0]) + x, backend="aot_eager", fullgraph=True)
    for lengths in ([5, 7, 3, 9], [4, 6, 2], [10, 3], [13], [6, 0, 7]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        x = torch.zeros(sum(lengths), dtype=torch.int64)
        torch._dynamo.maybe_mark_dynamic(cu, 0)
        torch._dynamo.maybe_mark_dynamic(x, 0)
        want = torch.cat([torch.arange(n) for n in lengths])
        assert torch.equal(fn(cu, x), want), lengths
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("lengths", LENGTH_SETS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_equals_megatrons_thd_rotary(lengths, interleaved):
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    x, cu, freqs = _packed(lengths)
    want = _apply_rotary_pos_emb_thd(x, cu, freqs, rotary_interleaved=interleaved,
                                     cp_group=parallel_state.get_context_parallel_group())
    got = rope.apply_rotary_pos_emb_thd(x, cu, freqs, rotary_interleaved=interleaved)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_one_graph_serves_every_set_of_lengths():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    fn = torch.compile(rope.apply_rotary_pos_emb_thd, backend=counter, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(0)
    more = [torch.randint(2, 20, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(10)]
    for lengths in (*LENGTH_SETS, *more):
        x, cu, freqs = _packed(lengths)
        torch.testing.assert_close(fn(x, cu, freqs), rope.apply_rotary_pos_emb_thd(x, cu, freqs))
    # one graph, plus one for a one-sample micro-batch (dynamo specializes a dimension of size 1)
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles for {len(LENGTH_SETS) + 10} sets of lengths"


def test_the_trainer_routes_packed_attention_through_it(tiny_ckpts):
    from megatron.core.transformer import attention

    from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer
    from tests.unit.plugins.trainers.megatron.train_helpers import spec_for, trainer_configs

    MegatronTrainer(spec_for("qwen3", tiny_ckpts("qwen3")), **trainer_configs(sequence_packing=True, attention="sdpa"))
    assert attention.apply_rotary_pos_emb is rope._apply_rotary_pos_emb
