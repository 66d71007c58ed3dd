"""``rl-cli doctor --engines``: start the run's engines (and router) and make a weight round trip to each.

The engines start from the model's HF checkpoint (``model.path``; a preset model gets a random one here,
as a run's trainer would write); every tensor, scaled by 1.5 so a push that did not land shows, goes out
the way the run pushes (``rollout.weight_sync``: a Gloo/NCCL group, CUDA IPC handles, or disk), and each
engine's backend reads it back (``check_weights``: checksums of every tensor on posttrain's engine,
sampled rows on SGLang).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from posttrain.core.interfaces import Finding


def hf_checkpoint(cfg: Any, plugins: Any, out: Path) -> str:
    """The model's HF checkpoint directory: ``model.path``, or a random-init one of the preset in ``out``."""
    spec = cfg.model.create(plugins)
    if spec.config.path:
        return str(spec.config.path)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per finding
    hf = dict(spec.hf_config())
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    torch.manual_seed(cfg.seed)
    AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.config.dtype)).save_pretrained(str(out))
    if spec.config.tokenizer == "char":
        from posttrain.core.char_tokenizer import make_tokenizer

        make_tokenizer(out)
    elif spec.config.tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(spec.config.tokenizer).save_pretrained(str(out))
    return str(out)


def push(sender: Any, mode: str, named: list[tuple[str, Any]], on_gpu: bool, tmp: Path) -> None:
    """``named`` to every engine of ``sender`` by ``mode`` (weight version 1)."""
    if mode == "disk":
        from safetensors.torch import save_file

        (tmp / "pushed").mkdir()
        save_file(dict(named), str(tmp / "pushed" / "model.safetensors"))
        sender.update_from_disk(str(tmp / "pushed"), version=1)
        return
    tensors = [(n, t.cuda() if on_gpu else t) for n, t in named]
    if mode == "tensor":
        sender.update_from_tensors(tensors, version=1)
        return
    sender.init()
    try:
        sender.send([tensors], version=1)
    finally:
        sender.destroy()


def round_trip(cfg: Any, plugins: Any) -> list[Finding]:
    import torch
    from safetensors.torch import load_file

    from posttrain.core.rollout.fleet import EngineFleet

    backend = cfg.rollout.engine.create(plugins)
    mode = cfg.weight_sync_mode()  # as the run resolves it: its placement, its engines' device
    with tempfile.TemporaryDirectory(prefix="posttrain-doctor-") as tmp:
        tmp = Path(tmp)
        model_dir = hf_checkpoint(cfg, plugins, tmp / "hf")
        fleet = EngineFleet(cfg.rollout, cfg.resources, backend, model_dir, log_dir=tmp / "logs", seed=cfg.seed)
        t0 = time.perf_counter()
        try:
            fleet.start()
        except Exception as exc:
            return [Finding(False, "engines", f"did not start: {exc}")]
        out = [Finding(True, "engines", f"{len(fleet.engine_urls)} started{' behind the router' if fleet.router else ''} "
                                        f"in {time.perf_counter() - t0:.1f} s")]
        try:
            named = {}
            for f in sorted(Path(model_dir).glob("*.safetensors")):
                named.update(load_file(str(f)))
            pushed = [(n, t * 1.5) for n, t in sorted(named.items())]
            on_gpu = backend.on_gpu(cfg.resources) and torch.cuda.is_available()
            t0 = time.perf_counter()
            push(fleet.weight_sender(backend="nccl" if on_gpu else "gloo"), mode, pushed, on_gpu, tmp)
            took = time.perf_counter() - t0
            for url in fleet.engine_urls:
                problem = backend.check_weights(url, fleet.api_key, [pushed])
                out.append(Finding(problem is None, f"engine {url}", problem or (
                    f"weight round trip by {mode}: {len(pushed)} tensors pushed in {took:.2f} s and read back equal")))
        except Exception as exc:
            out.append(Finding(False, "engines", f"weight round trip by {mode} failed: {exc}"))
        finally:
            fleet.stop()
    return out
