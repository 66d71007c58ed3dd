"""Chunked vocab-parallel log-probs and entropy: exact against log_softmax, less memory."""

from __future__ import annotations

import pytest
import torch

from posttrain.plugins.trainers.megatron.logprobs import vocab_parallel_log_probs

from tests.unit.plugins.trainers.megatron.train_helpers import PeakMemory

pytestmark = pytest.mark.usefixtures("megatron_tp1")


def _plain(hidden, weight, targets, vocab_size):
    logits = (hidden @ weight[:vocab_size].t()).float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_equals_log_softmax_and_gather(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=g, dtype=torch.float64).float()
    weight = torch.randn(256, 16, generator=g)  # 130 real rows + 126 padding rows (nonzero on purpose)
    targets = torch.randint(0, 130, (50,), generator=g)
    lp, ent = vocab_parallel_log_probs(hidden, weight, targets, vocab_size=130, chunk_size=chunk,
                                       with_entropy=True)
    ref_lp, ref_ent = _plain(hidden, weight, targets, 130)
    assert (lp - ref_lp).abs().max() < 1e-5
    assert (ent - ref_ent).abs().max() < 1e-5
    lp_only, none = vocab_parallel_log_probs(hidden, weight, targets, vocab_size=130, chunk_size=chunk)
    assert none is None and torch.equal(lp_only, lp)


def test_gradients_equal_the_unchunked_gradients():
    g = torch.Generator().manual_seed(1)
    h1 = torch.randn(40, 8, generator=g, requires_grad=True)
    w1 = torch.randn(64, 8, generator=g, requires_grad=True)
    h2, w2 = h1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    targets = torch.randint(0, 64, (40,), generator=g)
    lp, ent = vocab_parallel_log_probs(h1, w1, targets, vocab_size=64, chunk_size=9, with_entropy=True)
    (lp.sum() + 0.3 * ent.sum()).backward()
    ref_lp, ref_ent = _plain(h2, w2, targets, 64)
    (ref_lp.sum() + 0.3 * ref_ent.sum()).backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-5) and torch.allclose(w1.grad, w2.grad, atol=1e-5)


def test_peak_memory_is_below_the_unchunked_version_for_a_32k_vocab():
    """Recomputing: under half the plain version's peak. Keeping the logits (one fp32 copy on CPU):
    still at least half a logits tensor below it (the plain version holds logits and log-softmax)."""
    g = torch.Generator().manual_seed(2)
    tokens, vocab, dim = 256, 32_768, 32
    hidden = torch.randn(tokens, dim, generator=g, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=g)

    def run(fn):
        hidden.grad = weight.grad = None
        with PeakMemory() as meter:
            lp, ent = fn()
            (lp.sum() + ent.sum()).backward()
        return meter.peak, lp.detach()

    chunked_peak, lp = run(lambda: vocab_parallel_log_probs(hidden, weight, targets, vocab_size=vocab,
                                                            chunk_size=32, with_entropy=True))
    kept_peak, kept_lp = run(lambda: vocab_parallel_log_probs(hidden, weight, targets, vocab_size=vocab,
                                                              chunk_size=32, with_entropy=True, recompute=False))
    plain_peak, ref = run(lambda: _plain(hidden, weight, targets, vocab))
    assert (lp - ref).abs().max() < 1e-4 and (kept_lp - ref).abs().max() < 1e-4
    full_logits = tokens * vocab * 4
    assert plain_peak >= full_logits  # the meter sees the [N, V] fp32 logits of the plain version
    assert chunked_peak < plain_peak / 2, (chunked_peak, plain_peak)
    assert kept_peak < plain_peak - full_logits / 2, (kept_peak, plain_peak)


@pytest.mark.parametrize("with_entropy", [True, False])
def test_kept_logits_path_matches_the_recomputing_path(with_entropy):
    g = torch.Generator().manual_seed(3)
    h1 = torch.randn(40, 8, generator=g, requires_grad=True)
    w1 = torch.randn(96, 8, generator=g, requires_grad=True)  # 70 real rows + 26 padding rows
    h2, w2 = h1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    targets = torch.randint(0, 70, (40,), generator=g)
    coef = torch.randn(40, generator=g)  # a non-uniform upstream gradient, as a PPO loss gives
    out = []
    for h, w, recompute in ((h1, w1, False), (h2, w2, True)):
        lp, ent = vocab_parallel_log_probs(h, w, targets, vocab_size=70, chunk_size=9, with_entropy=with_entropy,
                                           recompute=recompute)
        loss = (coef * lp).sum() + (0.3 * (coef * ent).sum() if with_entropy else 0.0)
        loss.backward()
        out.append((lp.detach(), None if ent is None else ent.detach()))
    assert torch.allclose(out[0][0], out[1][0], atol=1e-6)
    if with_entropy:
        assert torch.allclose(out[0][1], out[1][1], atol=1e-5)
    assert torch.allclose(h1.grad, h2.grad, atol=1e-5), (h1.grad - h2.grad).abs().max()
    assert torch.allclose(w1.grad, w2.grad, atol=1e-5), (w1.grad - w2.grad).abs().max()
    assert w1.grad[70:].abs().max() == 0  # padding rows get no gradient
