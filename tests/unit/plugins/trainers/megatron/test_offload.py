"""The trainer's state in host memory and back (``resources.offload_trainer``): storages freed and restored in
place, and a Megatron trainer that trains on after the round trip exactly as one that never left."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.config import TrainerConfig
from posttrain.core.train_batch import TrainBatch
from posttrain.plugins.trainers.megatron.offload import HostOffload, state_parts, torch_optimizers
from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

from tests.conftest import ROOT
from tests.unit.plugins.trainers.megatron.train_helpers import local_loss, spec_for

pytestmark = pytest.mark.usefixtures("megatron_tp1")


def test_storages_are_freed_and_come_back_in_place():
    buffer = torch.arange(12, dtype=torch.float32)
    first, second = buffer[:6], buffer[6:].view(2, 3)  # two views of one storage: moved once
    weight = torch.nn.Parameter(torch.randn(3, 4))
    grad = torch.ones(5)
    before = weight.detach().clone()
    host = HostOffload(torch.device("cpu"))
    freed = host.offload([first, second, weight], drop=[grad, first])  # in both: kept
    assert freed == 12 * 4 + 12 * 4 + 5 * 4
    assert [t.untyped_storage().nbytes() for t in (buffer, weight, grad)] == [0, 0, 0]
    assert host.offloaded
    with pytest.raises(RuntimeError, match="already offloaded"):
        host.offload([weight])
    assert host.onload() == freed and not host.offloaded
    assert torch.equal(buffer, torch.arange(12, dtype=torch.float32)) and torch.equal(second[1], buffer[9:])
    assert torch.equal(weight.detach(), before) and weight.requires_grad
    assert torch.equal(grad, torch.zeros(5))  # dropped: zeros, not its old values
    buffer_at = host._host.data_ptr()
    host.offload([first, weight])
    host.onload()
    assert host._host.data_ptr() == buffer_at and host._host.numel() == 12 * 4 + 12 * 4  # host memory reused


def test_a_copy_out_ahead_of_the_offload_is_used_until_a_write_drops_it():
    state = torch.arange(6, dtype=torch.float32)
    host = HostOffload(torch.device("cpu"))
    assert not host.copy_out([state])  # never offloaded: no buffer to copy into
    host.offload([state])
    host.onload()
    assert host.copy_out([state]) and not host.copy_out([state, torch.ones(1)])  # other storages: not ahead
    state.add_(100)  # a write the copy does not see, announced by no wait(writes=True): the offload keeps the copy
    host.offload([state])
    host.onload()
    assert torch.equal(state, torch.arange(6, dtype=torch.float32))
    assert host.copy_out([state])
    host.wait(writes=True)  # what a load or an optimizer step calls first: the copy is dropped
    state.add_(100)
    host.offload([state])
    host.onload()
    assert torch.equal(state, torch.arange(6, dtype=torch.float32) + 100)


def test_tensors_on_other_devices_and_empty_storages_are_left_alone():
    host = HostOffload(torch.device("meta"))
    cpu = torch.ones(3)
    assert host.offload([cpu, torch.empty(0, device="meta")]) == 0
    assert cpu.untyped_storage().nbytes() == 12 and not host.offloaded


def test_a_device_without_an_index_is_the_current_one(monkeypatch):
    """``HostOffload(torch.device("cuda"))`` compares tensors' devices (``cuda:N``) with ``cuda:<current>``: with a
    bare ``cuda`` it matched none and moved nothing (found on an H100, 2026-12-05)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert HostOffload(torch.device("cuda")).device == torch.device("cuda", 3)
    assert HostOffload(torch.device("cuda", 1)).device == torch.device("cuda", 1)
    assert HostOffload(torch.device("cpu")).device == torch.device("cpu")


def test_the_parts_of_a_model_in_megatrons_ddp_wrapper_are_found(monkeypatch):
    """Megatron's DDP (the GPU path's wrapper) keeps its parameter and gradient buffers in a list attribute named
    ``buffers``, which shadows ``nn.Module.buffers``: the model's weights, buffers and ``main_grad`` views are still
    found and moved (a real wrapper, built on the CPU here)."""
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # where the wrapper puts its buffers
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    module.register_buffer("scale", torch.full((4,), 2.0))
    ddp = DistributedDataParallel(config=TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2),
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=module)
    assert isinstance(ddp.buffers, list)  # the shadowing
    parts = state_parts(SimpleNamespace(model=ddp, value_head=None, optimizer=None, _snapshots=SimpleNamespace(saved={})))
    assert {id(t) for t in parts["weights"]} == {id(t) for t in (*module.parameters(), module.scale)}
    main_grads = [p.main_grad for p in module.parameters()]
    assert all(any(g is m for g in parts["grads"]) for m in main_grads)
    before = [t.detach().clone() for t in parts["weights"]]
    for g in main_grads:
        g.fill_(1.0)
    host = HostOffload(torch.device("cpu"))
    host.offload(parts["weights"], drop=[g for g in parts["grads"] if g is not None])
    assert all(t.untyped_storage().nbytes() == 0 for t in (*parts["weights"], *main_grads))
    host.onload()
    assert all(torch.equal(t, b) for t, b in zip(parts["weights"], before))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in main_grads)  # dropped: back as zeros


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lists = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 12, 7, 10)]
    batch = TrainBatch.from_lists(lists, [3, 4, 2, 5])
    batch.advantages = torch.randn(len(lists), 1, generator=g) * batch.response_mask
    return batch


def _stepped(*trainers) -> TrainBatch:
    """A batch, and each trainer one step into it (Adam's moments exist)."""
    batch = _batch()
    for trainer in trainers:
        batch.old_log_probs = trainer.log_probs(batch)[0]
        trainer.train_step(batch, local_loss)
    return batch


def _bf16_trainer(tiny_ckpts):
    """bf16 weights with fp32 masters, Adam's moments and the reference snapshot: every kind of state."""
    spec = spec_for("qwen3", tiny_ckpts("qwen3"), dtype="bfloat16")
    return MegatronTrainer(spec, TrainerConfig(lr=1e-3, micro_batch_size=2, global_batch_size=4, log_kl=True))


def test_a_trainer_offloaded_between_steps_trains_on_bit_for_bit(tiny_ckpts):
    if torch.cuda.is_available():
        pytest.skip("the CPU path's state (torch AdamW, fp32 masters); tests/gpu covers Megatron's optimizer")
    moved, twin = _bf16_trainer(tiny_ckpts), _bf16_trainer(tiny_ckpts)
    batch = _stepped(moved, twin)
    every = [t for tensors in state_parts(moved).values() for t in tensors]
    kinds = _kinds(moved)
    assert all(kinds.values()) and all(g is not None for g in kinds["grads"])
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in every if t is not None}
    assert moved.offload() == sum(storages.values())  # each storage once, however many views it has
    for kind, tensors in kinds.items():  # every kind of state left the device (here: its CPU storage)
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors), kind
    moved.onload()
    metrics = [trainer.train_step(batch, local_loss) for trainer in (moved, twin)]
    assert metrics[0]["offload_pin_s"] >= 0 and "offload_pin_s" not in metrics[1]  # the host buffers made, once
    assert "offload_pin_s" not in moved.train_step(batch, local_loss) | twin.train_step(batch, local_loss)
    assert all(torch.equal(a, b) for a, b in zip(moved._masters, twin._masters))
    assert all(torch.equal(a, b) for a, b in zip(moved.model.parameters(), twin.model.parameters()))
    assert torch.equal(moved.log_probs(batch, weights="ref")[0], twin.log_probs(batch, weights="ref")[0])


def _kinds(trainer) -> dict[str, list[torch.Tensor]]:
    """Each part of ``trainer.backend.offload_parts`` -> the tensors it moves (on the CPU path: masters and AdamW)."""
    return {"weights": list(trainer.model.parameters()), "reference": list(trainer._snapshots.saved["ref"].values()),
            "optimizer": trainer._masters + [v for s in trainer.optimizer.state.values() for v in s.values()],
            "grads": [p.grad for p in trainer._params()] + [m.grad for m in trainer._masters]}


def test_offload_parts_move_only_their_own_state_and_training_goes_on_bit_for_bit(tiny_ckpts):
    if torch.cuda.is_available():
        pytest.skip("the CPU path's state (torch AdamW, fp32 masters)")
    moved, twin = _bf16_trainer(tiny_ckpts), _bf16_trainer(tiny_ckpts)
    batch = _stepped(moved, twin)
    for parts in (["weights"], ["reference"], ["optimizer"], ["grads"], ["optimizer", "grads"]):
        moved.backend.offload_parts = parts
        kinds = _kinds(moved)
        assert all(kinds.values()) and all(g is not None for g in kinds["grads"])
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for p in parts for t in kinds[p]}
        want = sum(storages.values())
        assert moved.offload() == want
        for kind, tensors in kinds.items():
            assert all((t.untyped_storage().nbytes() == 0) == (kind in parts) for t in tensors), (parts, kind)
        moved.onload()
        metrics = [trainer.train_step(batch, local_loss) for trainer in (moved, twin)]
        assert ("offload_wait_s" in metrics[0]) == ("optimizer" in parts) and "offload_wait_s" not in metrics[1]
        assert all(torch.equal(a, b) for a, b in zip(moved._masters, twin._masters)), parts
        assert all(torch.equal(a, b) for a, b in zip(moved.model.parameters(), twin.model.parameters())), parts
    assert torch.equal(moved.log_probs(batch, weights="ref")[0], twin.log_probs(batch, weights="ref")[0])


def test_an_optimizer_that_steps_the_weights_themselves_leaves_them_with_the_weights(tiny_ckpts):
    """fp32 weights have no master copies: AdamW's parameters are the model's own, so ``optimizer`` moves only
    Adam's moments, and the weights stay on the device unless ``weights`` is asked too."""
    spec = spec_for("qwen3", tiny_ckpts("qwen3"), dtype="float32")
    trainer = MegatronTrainer(spec, TrainerConfig(lr=1e-3, micro_batch_size=2, global_batch_size=4))
    if trainer._masters is not None or trainer.megatron_optimizer:
        pytest.skip("the CPU path at fp32 (torch AdamW over the model's own parameters)")
    _stepped(trainer)
    adam = [v for s in trainer.optimizer.state.values() for v in s.values()]  # step counters too
    trainer.backend.offload_parts = ["optimizer"]
    want = sum(v.untyped_storage().nbytes() for v in adam)
    assert trainer.offload() == want > 0
    assert all(p.untyped_storage().nbytes() > 0 for p in trainer.model.parameters())
    assert all(v.untyped_storage().nbytes() == 0 for v in adam)
    trainer.onload()


def test_a_save_or_a_load_right_after_an_onload_waits_for_the_optimizer_state(tiny_ckpts, tmp_path):
    """The optimizer's state comes back in the background (``offload_overlap``; off CUDA its copies run when awaited):
    a save awaits it (it writes that state), and so does a load (the late copies would overwrite what it loads)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU path's state; tests/gpu covers Megatron's optimizer")
    trainer = _bf16_trainer(tiny_ckpts)
    batch = _stepped(trainer)
    trainer.save(tmp_path / "stayed")
    trainer.offload()
    trainer.onload()
    trainer.save(tmp_path / "came_back")
    trainer.train_step(batch, local_loss)  # the state moves on ...
    trainer.offload()
    trainer.onload()
    trainer.load(tmp_path / "stayed")  # ... and a load takes it back
    loaded = []
    import warnings

    for ckpt in ("stayed", "came_back"):
        loaded.append(_bf16_trainer(tiny_ckpts))
        with warnings.catch_warnings(record=True) as seen:  # a resume prints no ShardedTensor deprecation
            warnings.simplefilter("always")
            loaded[-1].load(tmp_path / ckpt)
        assert not [w for w in seen if "ShardedTensor" in str(w.message)], [str(w.message) for w in seen]
    for t in (trainer, *loaded):
        t.train_step(batch, local_loss)
    for other in loaded:
        assert all(torch.equal(a, b) for a, b in zip(trainer._masters, other._masters))
        assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), other.model.parameters()))


def test_the_optimizer_state_leaves_with_the_push_and_a_load_takes_that_copy_back(tiny_ckpts, tmp_path, monkeypatch):
    """``offload_overlap``: once offloaded, the optimizer's state copied out after each step starts with the weight
    push (``export_hf``; off CUDA: then and there), so the offload after it copies only the rest; without a push the
    offload copies both. A load in between changes that state: the copy is dropped and the offload copies what was
    loaded."""
    if torch.cuda.is_available():
        pytest.skip("the CPU path's state; tests/gpu covers Megatron's optimizer")
    copies = []
    copy_out = HostOffload._copy_out
    monkeypatch.setattr(HostOffload, "_copy_out", lambda self, kept: (copies.append(self), copy_out(self, kept))[1])
    moved, twin = _bf16_trainer(tiny_ckpts), _bf16_trainer(tiny_ckpts)
    batch = _stepped(moved, twin)
    moved.save(tmp_path / "ckpt")
    moved.offload()
    moved.onload()
    rest, optimizer = moved._offload.rest, moved._offload.optimizer
    copies.clear()
    for t in (moved, twin):
        t.train_step(batch, local_loss)
    assert copies == []  # due, not started: the loop frees the trainer's cache before the push (a device-wide wait)
    list(moved.export_hf(1 << 30))  # the push
    assert copies == [optimizer]  # the optimizer's state, behind the push
    moved.offload()
    assert copies == [optimizer, rest]  # the offload copied only the rest
    moved.onload()
    copies.clear()
    for t in (moved, twin):
        t.train_step(batch, local_loss)
    moved.offload()  # no push this time
    assert copies == [rest, optimizer]
    moved.onload()
    for t in (moved, twin):
        t.train_step(batch, local_loss)
    assert all(torch.equal(a, b) for a, b in zip(moved._masters, twin._masters))
    list(moved.export_hf(1 << 30))
    moved.load(tmp_path / "ckpt")  # after the push's copy: the offload must copy the loaded state
    moved.offload()
    moved.onload()
    loaded = _bf16_trainer(tiny_ckpts)
    loaded.load(tmp_path / "ckpt")
    for t in (moved, loaded):
        t.train_step(batch, local_loss)
    assert all(torch.equal(a, b) for a, b in zip(moved._masters, loaded._masters))
    assert all(torch.equal(a, b) for a, b in zip(moved.model.parameters(), loaded.model.parameters()))


def test_the_state_moves_only_after_what_the_passes_copy_themselves(tiny_ckpts, monkeypatch):
    """A copy engine serves its direction's copies in order, so a pass's own small copies must be queued before the
    optimizer's state (20 GB at Qwen3-1.7B): each pass copies all its micro-batches to the device before the copies
    back may start, and the train step reads back what it returns (the kept log-probs) before its copy out starts,
    which waits for the weight push."""
    from posttrain.plugins.trainers.megatron import data_parallel, offload

    trainer = _bf16_trainer(tiny_ckpts)
    batch = _batch()
    events = []

    def recorded(owner, name, event):
        real = getattr(owner, name)

        def record(*args, **kwargs):
            events.append(event)
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, record)

    recorded(TrainBatch, "to", "to device")
    recorded(offload.TrainerOffload, "start", "state back")
    recorded(HostOffload, "copy_out", "state out")
    recorded(data_parallel, "gather", "read back")
    batch.old_log_probs = trainer.log_probs(batch)[0]
    assert events == ["to device", "to device", "state back", "read back"], events
    events.clear()
    trainer.offload()
    trainer.onload()
    trainer.train_step(batch, local_loss, keep_log_probs=True)
    assert events == ["to device", "to device", "state back", "read back"], events
    list(trainer.export_hf(1 << 30))
    assert events[-1] == "state out", events


def test_a_storage_that_cannot_be_resized_stays_where_it_is(caplog):
    shared = torch.ones(4)
    shared.numpy()  # numpy() marks the storage it reads as not resizable
    other = torch.ones(2)
    host = HostOffload(torch.device("cpu"))
    with caplog.at_level("WARNING", logger="posttrain.trainer"):
        assert host.offload([shared, other]) == 8
    assert "1 storages (0.0 MiB) cannot be freed in place and stay on cpu" in caplog.text
    assert shared.untyped_storage().nbytes() == 16 and other.untyped_storage().nbytes() == 0
    host.onload()
    assert torch.equal(shared, torch.ones(4)) and torch.equal(other, torch.ones(2))


def _deterministic_trainer(tiny_ckpts):
    """bf16 on a GPU: Megatron's DDP buffers and distributed optimizer, deterministic kernels (steps compared
    exactly)."""
    spec = spec_for("qwen3", tiny_ckpts("qwen3"), dtype="bfloat16")
    return MegatronTrainer(spec, TrainerConfig(lr=1e-3, micro_batch_size=2, global_batch_size=4, deterministic=True))


def _assert_same_step(moved, twin, batch) -> None:
    """One more train step on each, then their weights (as the push exports them) are equal bit for bit."""
    for t in (moved, twin):
        t.train_step(batch, local_loss)
    got = {k: v.clone() for b in moved.export_hf(1 << 20) for k, v in b}
    want = {k: v.clone() for b in twin.export_hf(1 << 20) for k, v in b}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("parts", [["weights", "reference", "optimizer", "grads"], ["optimizer", "grads"]])
def test_megatrons_optimizer_state_leaves_the_gpu_and_training_goes_on_unchanged(tiny_ckpts, parts):
    """On a GPU the state is Megatron's: DDP's contiguous parameter and gradient buffers, the distributed
    optimizer's fp32 shards, fused Adam's moments and step counters. What ``parts`` names leaves the device (the
    allocator's count drops by at least those bytes; the weights stay unless named) and the next steps equal those
    of a trainer that never offloaded."""
    moved, twin = _deterministic_trainer(tiny_ckpts), _deterministic_trainer(tiny_ckpts)
    assert moved.megatron_optimizer
    batch = _stepped(moved, twin)
    adam = [v for opt in torch_optimizers(moved.optimizer) for state in opt.state.values() for v in state.values()
            if torch.is_tensor(v) and v.is_cuda]
    assert adam
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    moved.backend.offload_parts = parts
    freed = moved.offload()
    assert before - torch.cuda.memory_allocated() >= freed > 0
    assert all((p.untyped_storage().nbytes() == 0) == ("weights" in parts) for p in moved.model.parameters())
    assert all(p.main_grad.untyped_storage().nbytes() == 0 for p in moved.model.parameters())
    assert all(v.untyped_storage().nbytes() == 0 for v in adam)
    moved.onload()
    _assert_same_step(moved, twin, batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_optimizer_state_moves_behind_other_work_and_is_awaited_where_it_is_needed(tiny_ckpts, monkeypatch):
    """``offload_overlap``, with the side stream held back ~1 s before each of its copies (a sleep queued there), and
    the freed memory scribbled over with NaNs after each offload (the storages come back in those cached blocks, so
    whatever read them before their copies landed would read NaNs, not old values still lying there):

    - the state comes back behind the passes: ``onload`` returns with its copies queued, and the optimizer step
      waits for them (``offload_wait_s``);
    - it leaves with the weight push: ``export_hf`` returns with that copy queued, and the offload waits for it before
      it frees the storages;

    and every step equals that of a trainer that never offloaded."""
    moved, twin = _deterministic_trainer(tiny_ckpts), _deterministic_trainer(tiny_ckpts)
    batch = _stepped(moved, twin)

    def held_back(copy):
        def copy_held_back(self, *args):
            if torch.cuda.current_stream(self.device) != torch.cuda.default_stream(self.device):
                torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles on the side stream, before its copies
            copy(self, *args)
        return copy_held_back

    for name in ("_copy_back", "_copy_out"):
        monkeypatch.setattr(HostOffload, name, held_back(getattr(HostOffload, name)))

    def offload_and_scribble():
        freed = moved.offload()
        junk = torch.full((freed,), 255, dtype=torch.uint8, device=moved.device)
        del junk

    def same_weights():
        got = {k: v.clone() for b in moved.export_hf(1 << 20) for k, v in b}
        want = {k: v.clone() for b in twin.export_hf(1 << 20) for k, v in b}
        return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)

    state = moved._offload.optimizer
    assert moved.backend.offload_overlap
    for step in range(2):
        offload_and_scribble()  # step 1: after the step's own copy, still queued
        moved.onload()
        assert state._pending and state._copied is None  # planned: they start once the step's inputs are queued
        metrics = [t.train_step(batch, local_loss) for t in (moved, twin)]
        assert metrics[0]["offload_wait_s"] > 0.1, metrics[0]  # the step waited for the held-back copies
        assert state._early is None, step  # the copy out waits for the push
        assert same_weights(), step  # export_hf: the push
        assert state._early is not None and not state._early[1].query(), step  # the copy out, queued


def test_the_first_offload_makes_adams_state_so_its_host_buffer_is_made_once(tiny_ckpts):
    """The loop offloads the trainer before its first step, when Adam has no moments yet: that offload makes them
    (zeros, as the first step would), so every later offload fills the same host buffer (on a GPU: pinned once, not
    pinned again after step 0), and the steps equal those of a trainer that never offloaded."""
    moved, twin = _deterministic_trainer(tiny_ckpts), _deterministic_trainer(tiny_ckpts)
    assert not any(opt.state for opt in torch_optimizers(moved.optimizer))
    moved.offload()
    host = moved._offload.optimizer._host
    moved.onload()
    batch = _stepped(moved, twin)
    moved.offload()
    assert moved._offload.optimizer._host is host
    moved.onload()
    _assert_same_step(moved, twin, batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_grown_state_replaces_its_pinned_buffer_instead_of_pinning_another_beside_it():
    """Storages that grew since the last offload need a larger host buffer: page-locked at its exact size
    (host_memory.py), and the old one unregistered before it goes (pinned memory the driver would keep otherwise)."""
    a, b = torch.full((3 << 20,), 2.0, device="cuda"), torch.full((5 << 20,), 3.0, device="cuda")
    host = HostOffload(torch.device("cuda"))
    host.offload([a])
    first = host._host
    assert first.is_pinned() and first.numel() == a.nbytes
    host.onload()
    host.offload([a, b])
    assert host._host.is_pinned() and host._host.numel() == a.nbytes + b.nbytes
    assert not first.is_pinned()  # still mapped (this test holds it), no longer registered
    host.onload()
    assert bool((a == 2).all()) and bool((b == 3).all())


def test_the_trainer_role_brings_its_models_back_for_a_call_and_a_save_leaves_them_away(tmp_path):
    """``TrainerRole``: the loop offloads it after the push; any call that needs the models brings them back, and
    a checkpoint saved while they are away (a step with nothing to train) sends them back after."""
    from posttrain.core.actors.trainer import TrainerRole
    from posttrain.core.config import load_config

    quickstart = ROOT / "examples" / "quickstart.yaml"
    role = TrainerRole(load_config(quickstart, ["resources.colocate=true", "resources.offload_trainer=true"]).to_dict())
    lists = [[1, 2, 3, 4, 5], [6, 7, 8]]
    batch = TrainBatch.from_lists(lists, [2, 1])
    before = role.log_probs(batch)
    params = list(role.policy.model.parameters())
    assert role.offload() > 0 and role.offloaded and role.offload() == 0.0  # a second offload: nothing left
    role.save(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "policy").exists()
    assert role.offloaded and all(p.untyped_storage().nbytes() == 0 for p in params)
    assert torch.equal(role.log_probs(batch), before) and not role.offloaded
