"""``rollout.check_weights``: after a push, every engine must hold exactly the tensors the trainer sent.

The local engine reports a SHA-256 per tensor (``GET /weights_checksum``: the bytes of each tensor in the
engine's dtype, row-major); the trainer hashes what it sent cast to that dtype, so equal digests mean
bit-equal weights. Engines without that endpoint are checked by their backend (SGLang: sampled tensors
through ``/get_weights_by_name``). A mismatch stops the run with :class:`WeightMismatch` naming the first
differing tensor; it is not retried like a failed push.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any


class WeightMismatch(Exception):
    """An engine holds other weights than the trainer pushed."""


def tensor_digest(tensor: Any, dtype: str) -> str:
    """SHA-256 of ``tensor``'s bytes in ``dtype`` (``"bfloat16"``, ...), as the local engine computes it."""
    import torch

    # a copy: numpy() marks the storage it reads as not resizable, and a CPU tensor's view would be the
    # trainer's own parameter (whose storage an offload frees: offload.HostOffload)
    data = tensor.detach().to(getattr(torch, dtype)).to("cpu", copy=True).reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


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
