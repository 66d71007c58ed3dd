"""The fsdp2 trainer's packed rows on CUDA: torch's varlen flash kernel (bf16) against one SDPA per sample in float32,
forward and backward (GQA, a sliding window, value heads narrower than the query's), and the trainer's packed
log-probs against its padded ones in bf16.

    python -m pytest -q tests/gpu/test_fsdp2_packing_gpu.py      # on a CUDA machine; skipped elsewhere
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("window, dv", [(None, 64), (48, 64), (None, 48)])
def test_the_varlen_kernel_matches_one_sdpa_per_sample(window, dv):
    from posttrain.plugins.trainers.fsdp2 import packing

    assert packing._flash_varlen() is not None, "this torch has no torch.nn.attention.varlen"
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [37, 300, 5, 129, 1]
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q = torch.randn(1, 8, n, 64, device="cuda", generator=g, requires_grad=True)
    k = torch.randn(1, 2, n, 64, device="cuda", generator=g, requires_grad=True)
    v = torch.randn(1, 2, n, dv, device="cuda", generator=g, requires_grad=True)
    kwargs = {"cu_seq_lens_q": cu, "max_length_q": max(lengths), "sliding_window": window, "scaling": 0.1}
    out, _ = packing.varlen_attention(None, *(t.bfloat16() for t in (q, k, v)), None, **kwargs)
    ref, _ = packing.varlen_attention(None, q, k, v, None, **kwargs)  # float32: one SDPA per sample
    assert out.shape == ref.shape == (1, n, 8, dv) and out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 2e-2
    grad = torch.randn(ref.shape, device="cuda", generator=g)
    flash_grads = torch.autograd.grad(out.float(), (q, k, v), grad)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(flash_grads, ref_grads):
        assert (a - b).abs().max() < 5e-2 * max(1.0, float(b.abs().max()))


def test_packed_log_probs_match_padded_in_bf16(tmp_path):
    from posttrain.core.plugins import load_plugins
    from posttrain.core.train_batch import TrainBatch
    from posttrain.testing.contracts.trainer import run_config
    from posttrain.testing.tiny import make_tiny_checkpoint

    plugins = load_plugins(autoload=False)
    cls = plugins.registry("trainers")["fsdp2"]
    g = torch.Generator().manual_seed(0)
    lengths = [9, 30, 3, 17, 64, 12]
    batch = TrainBatch.from_lists([torch.randint(1, 100, (n,), generator=g).tolist() for n in lengths], [2] * 6)
    ckpt, results = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3"), []
    for mode in (True, False):
        backend = cls(cls.Config(sequence_packing=mode, param_dtype="bfloat16"))
        run = run_config(backend, max_tokens_per_micro_batch=64)
        run.model.config.path = str(ckpt)
        model = backend.build(run.model.create(plugins), run)
        assert model.packed is mode
        results.append(model.log_probs(batch, with_entropy=True))
    (lp, ent), (ref_lp, ref_ent) = results
    assert (lp - ref_lp).abs().max() < 5e-2 and (ent - ref_ent).abs().max() < 5e-2
    assert (lp - ref_lp).abs().mean() < 5e-3
