"""Checkpoints of the ``fsdp2`` trainer: the training state for resume, and the HF export.

``save(model, dir)``: the sharded weights, AdamW's state and the reference weights through
``torch.distributed.checkpoint`` (each rank writes its shards; the metadata records every tensor's global
shape), and ``trainer.json`` ``{"step"}`` from rank 0. ``load`` reads them back at the loading group's
size: DCP reshards, so a run saved at data-parallel size 2 resumes at 1 or 4 with the same state.

``save_hf(model, dir)``: ``config.json`` (architecture, ``dtype`` = the spec's) and ``model.safetensors``
of the full weights in the spec's dtype, written by rank 0 after every rank helped gather them. With LoRA
the weights are the merged ones and ``adapter/`` holds the adapter in peft's format (``adapter_config.json``,
``adapter_model.safetensors``; ``PeftModel.from_pretrained(base, dir / "adapter")``). It is a subdirectory
because transformers' ``from_pretrained`` takes a directory holding ``adapter_config.json`` for an adapter to
load on its base model, not for the merged model beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


import torch.distributed as dist

ADAPTER_DIR = "adapter"


def _options(model: Any) -> Any:
    """LoRA: the frozen base stays out (rebuilt from the spec at load), so a checkpoint holds the adapters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen_out = model.lora is not None
    return StateDictOptions(ignore_frozen_params=frozen_out, strict=not frozen_out)


def _state(model: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optim = get_state_dict(model.model, model.optimizer, options=_options(model))
    state = {"model": weights, "optim": optim}
    for tag, tensors in model._snapshots.items():
        state[f"snapshot/{tag}"] = {str(i): t for i, t in enumerate(tensors)}
    return state


def save(model: Any, ckpt_dir: str | Path) -> None:
    import torch.distributed.checkpoint as dcp

    path = Path(ckpt_dir)
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(_state(model), checkpoint_id=str(path / "dcp"))
    if dist.get_rank() == 0:
        (path / "trainer.json").write_text(json.dumps({"step": model.step, "backend": "fsdp2"}))
    dist.barrier()


def load(model: Any, ckpt_dir: str | Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from posttrain.core.errors import UsageError

    path = Path(ckpt_dir)
    if not (path / "trainer.json").is_file():
        raise UsageError(f"{path}: not an fsdp2 trainer checkpoint (no trainer.json)")
    state = _state(model)
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(model.model, model.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options(model))
    for tag, tensors in model._snapshots.items():  # loaded in place (DCP fills the tensors it is given)
        model._snapshots[tag] = [state[f"snapshot/{tag}"][str(i)] for i in range(len(tensors))]
    model.step = int(json.loads((path / "trainer.json").read_text())["step"])


def save_hf(model: Any, out_dir: str | Path) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    named = {name: t.to("cpu").contiguous() for name, t in model._full_named()}
    adapters = None if model.lora is None else {
        name: t.to("cpu") for name, t in model._full_named("adapters", scaling=1.0)}
    if dist.get_rank() != 0:
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = model.model.config.to_dict()
    config["architectures"] = [model.architecture]
    config["dtype"] = str(model.dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    config["use_cache"] = True
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(named, str(out / "model.safetensors"), metadata={"format": "pt"})
    if adapters is not None:
        from posttrain.core.lora import write_peft_adapter

        write_peft_adapter(out / ADAPTER_DIR, adapters, model.lora, model.spec.config.path)
    return out


