"""Weights from trainer to engines, by HF name, over SGLang's weight-update endpoints.

Two sides of one protocol (the same one real SGLang servers speak):

**Trainer side** (:class:`WeightSender`, used by the training loop)::

    sender = WeightSender(["http://127.0.0.1:30001", ...], backend="gloo")  # "nccl" on GPUs
    sender.init()                               # POST /init_weights_update_group to every engine,
                                                # joins the group as rank 0 (engines: ranks 1..)
    sender.send(buckets, version=3)             # buckets: iterable of [(hf_name, tensor), ...]
    sender.update_from_disk("/ckpt/hf-step3", version=3)   # the universal fallback
    sender.update_from_tensors([(hf_name, tensor), ...], version=3)  # colocated: CUDA IPC handles, a
                                                                      # bucket per call
    sender.destroy()

For each bucket ``send`` POSTs ``/update_weights_from_distributed {names, dtypes, shapes, group_name,
weight_version}`` to every engine and, while those requests wait, broadcasts the bucket's tensors from
rank 0 in the order of ``names``. With ``flat=True`` (engines whose backend sets ``flat_weight_buckets``:
posttrain's local engine; Gloo groups only) the request adds ``load_format: "flattened_bucket"`` and the
bucket travels as one ``uint8`` broadcast laid out by :func:`flat_layout` (a Gloo broadcast costs ~0.2 ms
each however small: 25 tensors one by one took 3.6-6.7 ms, one flat bucket 0.2-0.35 ms). Tensors must be
on the backend's device (CPU for Gloo, CUDA for NCCL) and already in HF layout (full, unsharded). The group is a standalone process group (its own TCP store),
so it coexists with the trainer's default ``torch.distributed`` group.

**Engine side** (:class:`ReceiverGroup`, used by the local engine server): joins the group at
``rank_offset`` and receives a bucket into fresh tensors.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from posttrain.core.watchdog import waiting_on

DEFAULT_GROUP = "weight_update_group"


def _dtype(name: str):
    import torch

    name = name.removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _is_loopback(address: str) -> bool:
    import ipaddress

    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def open_group(backend: str, master_address: str, master_port: int, world_size: int, rank: int,
               group_name: str = DEFAULT_GROUP, timeout_s: float = 30.0):
    """A standalone process group (not the default group): rank 0 hosts the TCP store.

    ``timeout_s`` bounds every collective: a member that died mid-update makes the others fail after it
    (and the trainer rebuild the group) instead of hanging; a broadcast of many GB takes well under it.

    Rank 0's store listens on ``master_address`` only (a socket bound there and handed to the store),
    and with a loopback master Gloo's transport is bound to 127.0.0.1 too, so a single-machine group
    never listens beyond loopback.
    """
    import socket

    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    listener = None
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((master_address, int(master_port)))
        listener.listen()
    try:
        store = dist.TCPStore(master_address, int(master_port), world_size, rank == 0, timeout=timeout,
                              **({"master_listen_fd": listener.fileno()} if listener else {}))
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    if listener is not None:
        # the store's server owns the descriptor now and closes it when the store goes: a socket object
        # still holding it would close it a second time, by then perhaps another file's descriptor
        listener.detach()
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        loopback = _is_loopback(master_address)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if loopback
                         else dist.ProcessGroupGloo.create_default_device()]
        group = dist.ProcessGroupGloo(store, rank, world_size, opts)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    else:
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    _KEEP[id(group)] = store  # the store (and its listening socket) must live as long as the group
    return group


_KEEP: dict[int, Any] = {}


def close_group(group) -> None:
    """Drop the store kept for ``group`` (its listening socket closes with the last reference to it)."""
    _KEEP.pop(id(group), None)


def broadcast(group, tensor) -> None:
    """Broadcast ``tensor`` in place from rank 0 of ``group``."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


FLAT = "flattened_bucket"
_FLAT_ALIGN = 16  # bytes: every tensor of a flat bucket starts where any dtype may be viewed


def flat_layout(dtypes: list[str], shapes: list[list[int]]) -> tuple[list[int], int]:
    """Byte offsets of the tensors of a flat bucket and its total size: tensor ``i`` (``dtypes[i]``,
    ``shapes[i]``) takes ``numel * itemsize`` bytes from ``offsets[i]``, each start rounded up to 16."""
    offsets, at = [], 0
    for dtype, shape in zip(dtypes, shapes):
        offsets.append(at)
        at += -(-math.prod(shape) * _dtype(dtype).itemsize // _FLAT_ALIGN) * _FLAT_ALIGN
    return offsets, at


class ReceiverGroup:
    """The engine's membership in a weight-update group."""

    def __init__(self, group: Any, group_name: str, backend: str, device: str):
        self.group, self.group_name, self.backend, self.device = group, group_name, backend, device

    @classmethod
    def open(cls, master_address: str, master_port: int, rank_offset: int, world_size: int,
             group_name: str = DEFAULT_GROUP, backend: str = "nccl", device: str = "cpu") -> ReceiverGroup:
        group = open_group(backend, master_address, master_port, world_size, rank_offset, group_name)
        return cls(group, group_name, backend, device if backend == "nccl" else "cpu")

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                load_format: str | None = None) -> dict[str, Any]:
        """Receive one bucket: ``names[i]`` gets a tensor of ``dtypes[i]`` and ``shapes[i]``; with
        ``load_format="flattened_bucket"`` all of them arrive as one ``uint8`` broadcast (views of it)."""
        import torch

        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) differ in length")
        if load_format not in (None, FLAT):
            raise ValueError(f"load_format: expected {FLAT!r} or none, got {load_format!r}")
        import contextlib

        out = {}
        # NCCL binds its communicator to the current device, which is per thread: name it explicitly
        on_gpu = str(self.device).startswith("cuda")
        with torch.cuda.device(self.device) if on_gpu else contextlib.nullcontext():
            if load_format == FLAT:
                offsets, total = flat_layout(dtypes, shapes)
                flat = torch.empty(total, dtype=torch.uint8, device=self.device)
                broadcast(self.group, flat)
                for name, dtype, shape, at in zip(names, dtypes, shapes, offsets):
                    d = _dtype(dtype)
                    n = math.prod(shape) * d.itemsize
                    out[name] = flat[at:at + n].view(d).view(tuple(shape))
                return out
            for name, dtype, shape in zip(names, dtypes, shapes):
                t = torch.empty(tuple(shape), dtype=_dtype(dtype), device=self.device)
                broadcast(self.group, t)
                out[name] = t
        return out


def tensor_buckets(named: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterable[list[tuple[str, Any]]]:
    """``named`` tensors grouped, in order, into lists of at most ``bucket_bytes`` (a larger tensor gets its own):
    what a trainer backend's weight export yields, one bucket per push call."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def read_safetensors(files: Iterable[Any]) -> dict[str, Any]:
    """Every tensor of these ``*.safetensors`` files by name (an engine's ``update_weights_from_disk``)."""
    from safetensors.torch import load_file

    named: dict[str, Any] = {}
    for f in files:
        named.update(load_file(str(f)))
    return named


def serialize_named_tensors(named: list[tuple[str, Any]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(named, output_str=True)`` format: base64 of a pickle.

    CUDA tensors travel as CUDA IPC handles (``ForkingPickler``; the receiver must be on the same host
    and the sender must keep the tensors alive until the call returns); CPU tensors by value.
    """
    import base64
    import io
    import pickle

    if any(getattr(t, "is_cuda", False) for _, t in named):
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers the CUDA IPC reductions)

        buf = io.BytesIO()
        ForkingPickler(buf).dump(list(named))
        data = buf.getvalue()
    else:
        data = pickle.dumps([(n, t.detach().contiguous()) for n, t in named])
    return base64.b64encode(data).decode()


def deserialize_named_tensors(data: str | bytes) -> list[tuple[str, Any]]:
    """The inverse of :func:`serialize_named_tensors` (a pickle: only accept it from trusted senders)."""
    import base64
    import pickle

    import torch.multiprocessing  # noqa: F401  (rebuild functions for shared tensors)

    raw = base64.b64decode(data) if isinstance(data, str) else data
    named = pickle.loads(raw)
    if not isinstance(named, (list, tuple)) or not all(isinstance(x, (list, tuple)) and len(x) == 2 for x in named):
        raise ValueError("serialized_named_tensors: expected a list of (name, tensor) pairs")
    return [(str(n), t) for n, t in named]


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer KEY`` for an engine's (or the router's) API key; nothing without one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def post_json(url: str, payload: dict[str, Any] | None = None, timeout: float = 600.0,
              api_key: str | None = None, method: str = "POST") -> dict[str, Any]:
    """POST (or GET, without a body) JSON and return the decoded answer within ``timeout`` seconds; an
    HTTP error raises ``RuntimeError`` with its body."""
    data = json.dumps(payload or {}).encode() if method == "POST" else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **auth_headers(api_key)})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read().decode()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None
    try:
        return json.loads(body) if body else {}
    except json.JSONDecodeError:
        return {"message": body}


class WeightSender:
    """Rank 0 of a weight-update group spanning the trainer and every engine (see the module doc)."""

    def __init__(self, engine_urls: list[str], backend: str = "gloo", master_address: str = "127.0.0.1",
                 master_port: int | None = None, group_name: str = DEFAULT_GROUP, ranks_per_engine: int = 1,
                 timeout_s: float = 300.0, api_key: str | None = None, flat: bool = False):
        """``timeout_s`` bounds every HTTP call and every collective of a push: an engine that dies
        mid-push fails it within that time (the loop then restarts the engine and pushes again).
        ``flat``: every engine takes ``load_format: "flattened_bucket"`` (used on Gloo only: NCCL's
        per-tensor cost is small beside the GPU-sized buckets it moves)."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.backend, self.master_address, self.group_name = backend, master_address, group_name
        self.master_port = master_port or _free_port(master_address)
        self.ranks_per_engine = ranks_per_engine
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.flat = bool(flat) and backend == "gloo"
        self.group = None

    @property
    def world_size(self) -> int:
        return 1 + self.ranks_per_engine * len(self.engine_urls)

    def _fan_out(self, path: str, payloads: list[dict[str, Any]], during=None) -> list[dict[str, Any]]:
        """POST ``payloads[i]`` to engine ``i`` in threads, run ``during()`` meanwhile, check every answer."""
        results: list[Any] = [None] * len(self.engine_urls)

        def call(i: int) -> None:
            try:
                results[i] = post_json(self.engine_urls[i] + path, payloads[i], self.timeout_s, self.api_key)
            except Exception as exc:
                results[i] = exc

        threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(self.engine_urls))]
        what = f"{path} with {', '.join(self.engine_urls)} (group {self.group_name}; rollout.weight_sync_timeout_s " \
               f"= {self.timeout_s:g})"
        with waiting_on("collective", what):
            for t in threads:
                t.start()
            error = None
            try:
                if during is not None:
                    during()
            except Exception as exc:
                error = exc
            deadline = time.monotonic() + self.timeout_s  # one bound for all, not one per engine
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
        results = [TimeoutError(f"no answer within {self.timeout_s:.0f} s") if r is None else r for r in results]
        failed = [f"{self.engine_urls[i]}{path}: {r}" for i, r in enumerate(results)
                  if isinstance(r, Exception) or not (isinstance(r, dict) and r.get("success", True))]
        if error is not None or failed:
            raise RuntimeError("; ".join(([f"sender: {error!r}"] if error else []) + failed))
        return results

    def init(self) -> None:
        """Create the group: every engine joins at its rank offset, the caller as rank 0."""
        payloads = [{"master_address": self.master_address, "master_port": self.master_port,
                     "rank_offset": 1 + i * self.ranks_per_engine, "world_size": self.world_size,
                     "group_name": self.group_name, "backend": self.backend} for i in range(len(self.engine_urls))]

        def join() -> None:
            self.group = open_group(self.backend, self.master_address, self.master_port, self.world_size, 0,
                                    self.group_name, self.timeout_s)

        self._fan_out("/init_weights_update_group", payloads, during=join)

    def send(self, buckets: Iterable[list[tuple[str, Any]]], version: int | str | None = None,
             flush_cache: bool = True) -> None:
        """Broadcast each bucket ``[(hf_name, tensor), ...]``; the engines' ``weight_version`` becomes ``version``."""
        if self.group is None:
            raise RuntimeError("WeightSender.send() before init()")
        for bucket in buckets:
            bucket = list(bucket)
            meta = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                    "flush_cache": flush_cache, "weight_version": None if version is None else str(version)}
            if self.flat:
                meta["load_format"] = FLAT

            def bcast(bucket=bucket, meta=meta) -> None:  # (bound now, though _fan_out calls it at once)
                if self.flat:
                    return broadcast(self.group, _flatten(bucket, meta["dtypes"], meta["shapes"]))
                for _, tensor in bucket:
                    broadcast(self.group, tensor.detach().contiguous())

            self._fan_out("/update_weights_from_distributed", [meta] * len(self.engine_urls), during=bcast)

    def update_from_disk(self, model_dir: str, version: int | str | None = None) -> None:
        """Every engine reloads its weights from an HF checkpoint directory."""
        payload = {"model_path": str(model_dir), "weight_version": None if version is None else str(version)}
        self._fan_out("/update_weights_from_disk", [payload] * len(self.engine_urls))

    def update_from_tensors(self, named: list[tuple[str, Any]], version: int | str | None = None) -> None:
        """Colocated engines (same host): ``/update_weights_from_tensor`` with the tensors serialized
        (CUDA IPC handles for GPU tensors, values for CPU tensors)."""
        payload = {"serialized_named_tensors": [serialize_named_tensors(named)] * self.ranks_per_engine,
                   "load_format": None, "flush_cache": True,
                   "weight_version": None if version is None else str(version)}
        self._fan_out("/update_weights_from_tensor", [payload] * len(self.engine_urls))

    def destroy(self) -> None:
        if self.group is None:
            return
        self._fan_out("/destroy_weights_update_group", [{"group_name": self.group_name}] * len(self.engine_urls))
        close_group(self.group)
        self.group = None


def _flatten(bucket: list[tuple[str, Any]], dtypes: list[str], shapes: list[list[int]]):
    """The bucket's tensors as one ``uint8`` tensor laid out by :func:`flat_layout` (on their device)."""
    import torch

    offsets, total = flat_layout(dtypes, shapes)
    flat = torch.empty(total, dtype=torch.uint8, device=bucket[0][1].device if bucket else "cpu")
    for (_, t), at in zip(bucket, offsets):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[at:at + raw.numel()].copy_(raw)
    return flat


def _free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
