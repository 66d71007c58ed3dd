"""Helpers the training tests share (imported by name: the tests folders are not packages)."""

from __future__ import annotations

SPEC_OF_FAMILY = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama3", "glm4": "glm4", "qwen3_moe": "qwen3_moe",
                  "glm4_moe": "glm4_moe", "deepseek_v3": "deepseek_v3"}


def spec_for(family: str, path=None, dtype: str = "float32"):
    from posttrain.core.plugins import load_plugins

    cls = load_plugins().registry("model")[SPEC_OF_FAMILY[family]]
    return cls(cls.Config(path=str(path) if path else None, dtype=dtype))


def seeded_spec(tied: bool = False):
    """The qwen3 tiny preset without a checkpoint (weights drawn from the seed), optionally with tied
    embeddings."""
    spec = spec_for("qwen3")
    hf = {**spec.hf_config(), "tie_word_embeddings": tied}
    spec.hf_config = lambda: dict(hf)
    return spec


def local_loss(log_probs, old_log_probs, advantages, response_mask, is_weights=None, global_tokens=None,
               global_seqs=None):
    """PPO-clip with token-mean over ``global_tokens`` (the Algorithms issue's contract, kept local)."""
    import torch

    ratio = torch.exp(log_probs - old_log_probs)
    if is_weights is not None:
        advantages = advantages * is_weights
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.28) * advantages)
    denom = global_tokens if global_tokens is not None else response_mask.sum()
    loss = -(surrogate * response_mask).sum() / denom
    return loss, {"ratio": float((ratio.detach() * response_mask).sum() / response_mask.sum().clamp(min=1))}


class PeakMemory:
    """Peak bytes of live tensors created while active (CPU too), via a TorchDispatchMode.

    Each op's outputs are counted once per storage until the tensor object that carried them is freed;
    views of a freed tensor are not tracked, so the figure is a lower bound, fine for comparing two
    computations that differ by a large tensor.
    """

    def __init__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        meter = self
        self.live = self.peak = 0
        self._seen: set[int] = set()

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                import torch

                for t in tree_flatten(out)[0]:
                    if not isinstance(t, torch.Tensor):
                        continue
                    key = t.untyped_storage().data_ptr()
                    n = t.untyped_storage().nbytes()
                    if key in meter._seen or n == 0:
                        continue
                    meter._seen.add(key)
                    meter.live += n
                    meter.peak = max(meter.peak, meter.live)
                    weakref.finalize(t, meter._free, key, n)
                return out

        self._mode = _Mode()

    def _free(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def tp_batch():
    """The fixed batch the TP=2 worker and the TP=1 test both use (with advantages)."""
    import torch

    from posttrain.core.train_batch import TrainBatch

    g = torch.Generator().manual_seed(11)
    lists = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 12, 7, 10)]
    batch = TrainBatch.from_lists(lists, [3, 4, 2, 5])
    batch.advantages = torch.randn(4, 1, generator=g) * batch.response_mask
    return batch


def trainer_configs(**kw):
    """``MegatronTrainer(spec, **trainer_configs(lr=..., tp=2))``: one flat keyword set split into the run's
    ``trainer`` section (``config``) and the Megatron backend's own (``backend``)."""
    from dataclasses import fields

    from posttrain.core.config import TrainerConfig
    from posttrain.plugins.trainers.megatron import MegatronBackend

    own = {f.name for f in fields(MegatronBackend.Config)}
    return {"config": TrainerConfig(**{k: v for k, v in kw.items() if k not in own}),
            "backend": MegatronBackend.Config(**{k: v for k, v in kw.items() if k in own})}


def torchrun(script: str, *args: str, timeout: float = 240, nproc: int = 2) -> None:
    """``SCRIPT args`` (a worker script in this folder) under ``torchrun --nproc_per_node NPROC`` (Gloo on CPU); asserts
    it exits 0."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master_port", str(port), str(here / script), *args],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
