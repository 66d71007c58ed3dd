"""On a GPU, every estimator, loss and correction gives the CPU result (run by the lead on GPU machines)."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.plugins import load_plugins
from posttrain.testing.contracts.correction import make_log_probs
from posttrain.testing.contracts.estimator import make_batch
from posttrain.testing.contracts.loss import make_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PLUGINS = load_plugins(autoload=False)  # posttrain's own: a third-party plugin installed changes nothing


def _to(batch, device):
    fields = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in vars(batch).items() if k != "metadata"}
    return type(batch)(**fields, metadata={k: v.to(device) for k, v in batch.metadata.items()})


@pytest.mark.parametrize("name", sorted(PLUGINS.estimators))
def test_estimator_on_cuda_matches_cpu(name):
    cls = PLUGINS.estimators[name]
    est = cls(cls.Config())
    batch = make_batch(critic=cls.needs.critic)
    adv, ret = est.advantages(batch)
    adv_c, ret_c = est.advantages(_to(batch, "cuda"))
    torch.testing.assert_close(adv_c.cpu(), adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret_c.cpu(), ret, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(PLUGINS.losses))
def test_loss_on_cuda_matches_cpu(name):
    cls = PLUGINS.losses[name]
    loss_fn = cls(cls.Config())
    lp, old, adv, mask = make_inputs()
    value, _ = loss_fn(lp, old, adv, mask)
    value.backward()
    lp_c = lp.detach().cuda().requires_grad_(True)
    value_c, _ = loss_fn(lp_c, old.cuda(), adv.cuda(), mask.cuda())
    value_c.backward()
    torch.testing.assert_close(value_c.cpu(), value, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lp_c.grad.cpu(), lp.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(PLUGINS.corrections))
def test_correction_on_cuda_matches_cpu(name):
    cls = PLUGINS.corrections[name]
    correction = cls(cls.Config())
    train, rollout, mask = make_log_probs()
    w, _ = correction(train, rollout, mask)
    w_c, _ = correction(train.detach().cuda(), rollout.cuda(), mask.cuda())
    torch.testing.assert_close(w_c.cpu(), w, atol=1e-6, rtol=1e-5)
