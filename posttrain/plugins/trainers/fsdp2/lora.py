"""LoRA for the ``fsdp2`` trainer, through peft: adapters on the HF model before it is sharded, and the
weights it exports under HF names.

``wrap(model, lora)`` returns peft's ``PeftModel`` with ``A [r, in]`` / ``B [out, r]`` on every linear named
in ``trainer.lora.target_modules``; only they require grad (FSDP2 shards frozen and trainable parameters
alike; the optimizer, gradient clipping and checkpoints take the trainable ones).

peft renames the module tree (``base_model.model.<hf>``, an adapted linear's weight under
``<module>.base_layer.weight``, its adapters under ``<module>.lora_A.default.weight``); :func:`hf_tensors`
maps it back and yields, from the full (gathered) tensors, one of three views (:mod:`posttrain.core.lora`):

- ``merged``: the HF checkpoint's tensors, ``W = W_base + (alpha / r) B @ A`` (export, ``save_hf``);
- ``base``: the frozen base weights, then every adapter pair (a first push: the engine keeps the base);
- ``adapters``: only the pairs ``<module>.lora_A.weight``, ``<module>.lora_B.weight`` (B scaled by alpha / r).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from posttrain.core.lora import LORA_A, LORA_B

PREFIX = "base_model.model."
VIEWS = ("merged", "base", "adapters")


def wrap(model: torch.nn.Module, lora: Any) -> torch.nn.Module:
    """``model`` with peft LoRA adapters (``lora``: the ``trainer.lora`` config); the base weights frozen."""
    import peft

    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=list(lora.target_modules), bias="none")
    return peft.get_peft_model(model, config)


def hf_name(name: str) -> tuple[str, str | None]:
    """``(HF name, None)`` of a peft state-dict name, or ``(<module>, "A" | "B")`` for an adapter tensor."""
    name = name.removeprefix(PREFIX)
    for part, kind in ((".lora_A.default.weight", "A"), (".lora_B.default.weight", "B")):
        if name.endswith(part):
            return name[: -len(part)], kind
    return name.replace(".base_layer.", "."), None


def hf_tensors(named: Iterator[tuple[str, Any]], view: str, scaling: float,
               gather: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` of ``view`` (see the module doc) from the peft model's ``named`` state-dict entries;
    ``gather(t)`` makes an entry full (called for every entry the view needs, in state-dict order on every rank,
    so it may be a collective). An adapted weight waits for its adapter pair (state-dict order: base, A, B)."""
    if view not in VIEWS:
        raise ValueError(f"view {view!r}: one of {', '.join(VIEWS)}")
    held: dict[str, torch.Tensor] = {}  # merged: an adapted weight's base, until its pair comes
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for raw, t in named:
        name, kind = hf_name(raw)
        if kind is None:
            if view == "adapters":
                continue
            if view == "merged" and raw.endswith(".base_layer.weight"):
                held[name] = gather(t)
            else:
                yield name, gather(t)
            continue
        pair = pairs.setdefault(name, {})
        pair[kind] = gather(t)
        if len(pair) < 2:
            continue
        pairs.pop(name)
        a, b = pair["A"], pair["B"]
        if view == "merged":
            base = held.pop(name + ".weight")
            yield name + ".weight", (base.float() + (b.float() * scaling) @ a.float()).to(base.dtype)
        else:
            yield name + LORA_A, a
            yield name + LORA_B, b * scaling
