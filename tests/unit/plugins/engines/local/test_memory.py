"""Engine memory release/resume in stable mode (``memory.EngineMemory.make_stable`` over
``vmm.StableBuffer``), on the CPU: the CUDA driver's VMM calls cannot run here, so a stand-in keeps their
contract (an address range reserved once; physical memory created, mapped, unmapped and released; unmapped
bytes are garbage, freshly mapped ones undefined). The same path on a real GPU, graphs included, is in
``tests/unit/plugins/engines/local/test_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from posttrain.plugins.engines.local.memory import EngineMemory
from posttrain.plugins.engines.local.model_runner import ModelRunner
from posttrain.plugins.engines.local.vmm import StableBuffer, VmmError


class StandInDriver:
    """VMM's contract on host memory: ``reserve`` gives an address range (a host tensor) that never moves;
    ``unmap`` makes its bytes garbage (0xFF: NaN in any float dtype), ``map`` makes them undefined (0xAB)."""

    granule = 4096

    def __init__(self):
        self.device = 0
        self.ranges: dict[int, torch.Tensor] = {}
        self.mapped: dict[int, int] = {}  # ptr -> handle
        self.live_handles: set[int] = set()
        self.calls: list[str] = []
        self._next = 1

    def granularity(self):
        return self.granule

    def reserve(self, size):
        assert size % self.granule == 0
        t = torch.full((size,), 0xFF, dtype=torch.uint8)
        self.ranges[t.data_ptr()] = t
        return t.data_ptr()

    def create(self, size):
        self.calls.append("create")
        self._next += 1
        self.live_handles.add(self._next)
        return self._next

    def map(self, ptr, size, handle):
        assert ptr not in self.mapped and handle in self.live_handles and size == self.ranges[ptr].numel()
        self.calls.append("map")
        self.mapped[ptr] = handle
        self.ranges[ptr].fill_(0xAB)

    def unmap(self, ptr, size):
        assert ptr in self.mapped
        self.calls.append("unmap")
        del self.mapped[ptr]
        self.ranges[ptr].fill_(0xFF)

    def release(self, handle):
        assert handle not in self.mapped.values()
        self.live_handles.remove(handle)

    def free_address(self, ptr, size):
        del self.ranges[ptr]

    def tensor_of(self, ptr, nbytes, device):
        return self.ranges[ptr][:nbytes]

    def buffer(self, nbytes):
        return StableBuffer(nbytes, self, tensor_of=self.tensor_of)


def _decode_logits(r: ModelRunner) -> torch.Tensor:
    r.prefill([0, 1], [[3, 4, 5], [6, 7]])
    return r.decode(torch.tensor([8, 9]), torch.tensor([3, 2]))


def _addresses(r: ModelRunner) -> list[int]:
    return [p.data_ptr() for p in r.model.parameters()] + [r.k_cache.data_ptr(), r.v_cache.data_ptr()]


@pytest.mark.parametrize("tied", [False, True])
def test_stable_memory_keeps_every_address_and_value_across_release_and_resume(tiny_ckpt, tmp_path, tied):
    from posttrain.testing.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "tied", tie_word_embeddings=True) if tied else tiny_ckpt
    r = ModelRunner(ckpt, max_slots=2, context_length=32)
    before = _decode_logits(r).clone()
    state = {n: t.clone() for n, t in r.model.state_dict().items()}
    driver = StandInDriver()
    mem = EngineMemory(r)
    assert mem.make_stable(driver.buffer) is None and mem.stable
    torch.testing.assert_close(_decode_logits(r), before, rtol=0, atol=0)  # moved bit for bit
    if tied:
        assert r.model.lm_head.weight.data_ptr() == r.model.model.embed_tokens.weight.data_ptr()
    addresses = _addresses(r)
    inside = [p for p in addresses if any(b <= p < b + t.numel() for b, t in driver.ranges.items())]
    assert inside == addresses  # every weight and both caches live in the reserved ranges

    for round_ in range(2):
        mem.release({"weights", "kv_cache"})
        assert mem.released == {"weights", "kv_cache"} and not driver.mapped  # physical memory given back
        assert r.k_cache is None and all(not p.is_cuda for p in r.model.parameters())
        # while released the weights are the host copy (the device range is garbage now)
        for name, t in r.model.state_dict().items():
            torch.testing.assert_close(t, state[name], rtol=0, atol=0, msg=f"{name} released, round {round_}")
        mem.resume({"weights", "kv_cache"})
        assert not mem.released and len(driver.mapped) == 2
        assert _addresses(r) == addresses  # same addresses: graphs captured over them stay valid
        assert int(r.k_cache.count_nonzero()) == 0 and int(r.v_cache.count_nonzero()) == 0  # cache back zeroed
        torch.testing.assert_close(_decode_logits(r), before, rtol=0, atol=0)


def test_weights_loaded_while_released_survive_resume(runner_pair):
    r, other = runner_pair
    mem = EngineMemory(r)
    assert mem.make_stable(StandInDriver().buffer) is None
    mem.release({"weights"})
    assert r.load_weights(dict(other.model.state_dict())) > 0  # lands in the host copy
    mem.resume({"weights"})
    for name, t in other.model.state_dict().items():
        torch.testing.assert_close(r.model.state_dict()[name], t, rtol=0, atol=0, msg=name)


def test_kv_cache_alone_is_released_and_weights_stay_mapped(tiny_ckpt):
    r = ModelRunner(tiny_ckpt, max_slots=2, context_length=32)
    driver = StandInDriver()
    mem = EngineMemory(r)
    mem.make_stable(driver.buffer)
    weights_ptr = next(r.model.parameters()).data_ptr()
    mem.release({"kv_cache"})
    assert len(driver.mapped) == 1 and r.k_cache is None and next(r.model.parameters()).data_ptr() == weights_ptr
    mem.resume({"kv_cache"})
    assert driver.calls.count("map") == 3 and driver.calls.count("unmap") == 1


def test_a_failed_map_releases_its_physical_memory():
    class Refusing(StandInDriver):
        def map(self, ptr, size, handle):
            raise VmmError("cuMemMap failed: CUDA_ERROR_NOT_SUPPORTED (801)")

    driver = Refusing()
    with pytest.raises(VmmError, match="cuMemMap"):
        driver.buffer(10)
    assert not driver.live_handles


def test_plain_cpu_memory_has_no_stable_mode_and_says_why(tiny_ckpt):
    mem = EngineMemory(ModelRunner(tiny_ckpt, max_slots=1, context_length=16))
    assert "CUDA" in mem.make_stable()
    assert not mem.stable and mem.stats() == {"released": [], "stable": False}


@pytest.fixture()
def runner_pair(tiny_ckpt, tiny_ckpt_b):
    return ModelRunner(tiny_ckpt, max_slots=2, context_length=32), ModelRunner(tiny_ckpt_b, max_slots=1, context_length=16)
