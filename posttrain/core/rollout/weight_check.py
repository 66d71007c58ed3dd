"""``rollout.check_weights``: after a push, every engine must hold exactly the tensors the trainer sent.

The local engine reports a SHA-256 per tensor (``GET /weights_checksum``: the bytes of each tensor in the
engine's dtype, row-major); the trainer hashes what it sent cast to that dtype, so equal digests mean
bit-equal weights. Engines without that endpoint are checked by their backend (SGLang: sampled tensors
through ``/get_weights_by_name``). A mismatch stops the run with :class:`WeightMismatch` naming the first
differing tensor; it is not retried like a failed push.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from typing import Any

_STACKED_EXPERTS = re.compile(r"^(.+\.experts)\.(gate_up_proj|down_proj)$")


class WeightMismatch(Exception):
    """An engine holds other weights than the trainer pushed."""


def tensor_digest(tensor: Any, dtype: str | None = None) -> str:
    """SHA-256 of ``tensor``'s bytes in ``dtype`` (``"bfloat16"``, ...; None: its own), as engines compute it."""
    import torch

    # a copy: numpy() marks the storage it reads as not resizable, and a CPU tensor's view would be the
    # trainer's own parameter (whose storage an offload frees: offload.HostOffload)
    tensor = tensor.detach() if dtype is None else tensor.detach().to(getattr(torch, dtype))
    data = tensor.to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def tensor_digests(named: dict[str, Any]) -> dict[str, str]:
    """``{name: sha256}`` of every tensor's bytes as held (its dtype, row-major), with every stacked MoE expert
    tensor also under its per-expert checkpoint names (:func:`with_expert_views`): an engine's
    ``/weights_checksum``, which the trainer's per-expert (Megatron) or stacked (transformers) names both find."""
    return {name: tensor_digest(t) for name, t in with_expert_views(named).items()}


def with_expert_views(named: dict[str, Any]) -> dict[str, Any]:
    """``named`` plus, for each of transformers' stacked expert tensors (``<p>.experts.gate_up_proj [E, 2F, H]``:
    gate rows then up rows; ``<p>.experts.down_proj [E, H, F]``), the per-expert tensors checkpoints hold:
    ``<p>.experts.<e>.gate_proj.weight = gate_up_proj[e, :F]``, ``up_proj.weight = gate_up_proj[e, F:]``,
    ``down_proj.weight = down_proj[e]`` (views)."""
    out = dict(named)
    for name, t in named.items():
        m = _STACKED_EXPERTS.match(name)
        if m is None or t.dim() != 3:
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
            else:
                half = t.shape[1] // 2
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = t[e, :half], t[e, half:]
    return out


def engine_checksums(url: str, api_key: str | None, timeout: float = 300.0) -> dict[str, Any] | None:
    """``{"dtype", "weight_version", "checksums": {name: sha256}}`` from the engine, or None when it has
    no ``/weights_checksum`` (HTTP 404)."""
    from posttrain.core.rollout.weight_sync import post_json

    try:
        return post_json(url + "/weights_checksum", timeout=timeout, api_key=api_key, method="GET")
    except RuntimeError as exc:
        if ": HTTP 404:" in str(exc):
            return None
        raise


def first_mismatch(buckets: Iterable[list[tuple[str, Any]]], report: dict[str, Any]) -> str | None:
    """The first tensor of ``buckets`` whose digest differs from the engine's ``report`` (None: all equal)."""
    sums, dtype = report["checksums"], report["dtype"]
    for bucket in buckets:
        for name, tensor in bucket:
            if name not in sums:
                return f"tensor {name}: the engine has no tensor of that name"
            if tensor_digest(tensor, dtype) != sums[name]:
                return f"tensor {name}: its {dtype} bytes differ from what was pushed"
    return None
