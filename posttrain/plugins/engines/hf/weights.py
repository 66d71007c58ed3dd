"""The ``hf`` engine's weight endpoints: SGLang's three update paths and posttrain's checksum.

- ``POST /update_weights_from_disk {model_path}``: every ``*.safetensors`` of an HF checkpoint directory;
  they must cover every tensor of the model (a tied output layer under either name);
- ``POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
  backend}``, ``/update_weights_from_distributed {names, dtypes, shapes, load_format}``,
  ``/destroy_weights_update_group``: a torch.distributed group with the trainer (Gloo on CPU, NCCL on
  GPUs; :class:`posttrain.core.rollout.weight_sync.ReceiverGroup`), one bucket per call;
- ``POST /update_weights_from_tensor {serialized_named_tensors}``: SGLang's colocated format, a pickle
  (CUDA IPC handles on GPUs); served only to callers holding the API key, like everything but ``/health*``;
- ``GET /weights_checksum``: ``{weight_version, dtype, checksums: {name: sha256}}``.

Each update is all or nothing (:meth:`HFGenerator.load_weights` checks names and shapes first), waits for
the batch decoding to end, and bumps ``weight_version`` (to the one given, else by one) only when complete.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web

from posttrain.core.rollout.weight_sync import read_safetensors

from posttrain.plugins.engines.local.bodies import BadRequest, read_json

BODY_LIMIT = 1 << 30  # weight updates by tensor carry whole buckets
BODY_SECONDS = 600.0  # a body must arrive within this (a stalled client gets 408)


async def read_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object (an empty body is ``{}``), within the limits above; :class:`BadRequest`
    (400, 408, 413) otherwise."""
    return await read_json(request, BODY_SECONDS, required=False, limit=BODY_LIMIT)


class WeightEndpoints:
    """Handlers bound to a :class:`~posttrain.plugins.engines.hf.server.Server`."""

    def __init__(self, server: Any):
        self.server = server
        self.receiver = None  # the ReceiverGroup of the open weight-update group

    @property
    def gen(self) -> Any:
        return self.server.gen

    def _bump(self, version: Any) -> str:
        current = self.gen.weight_version
        self.gen.weight_version = str(version) if version is not None else (
            str(int(current) + 1) if current.isdigit() else "1")
        return self.gen.weight_version

    async def _load(self, named: dict[str, Any], body: dict[str, Any], what: str, require_all: bool = False):

        try:
            count = await asyncio.to_thread(self.gen.load_weights, named, require_all)
        except (ValueError, RuntimeError, TypeError) as exc:
            raise BadRequest(f"{what}: {exc}") from None
        version = self._bump(body.get("weight_version"))
        return web.json_response({"success": True, "num_paused_requests": 0,
                                  "message": f"Succeeded to update model weights: {count} tensors (version {version})"})

    async def from_disk(self, request: web.Request) -> web.Response:

        body = await read_body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not Path(path).is_dir():
            raise BadRequest(f"model_path: expected a checkpoint directory, got {path!r}")
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise BadRequest(f"model_path: no *.safetensors files in {path}")

        return await self._load(await asyncio.to_thread(read_safetensors, files), body, f"update_weights_from_disk {path}",
                                require_all=True)

    async def init_group(self, request: web.Request) -> web.Response:
        from posttrain.core.rollout.weight_sync import ReceiverGroup

        body = await read_body(request)
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
        if missing:
            raise BadRequest(f"init_weights_update_group: missing field(s) {', '.join(missing)}")
        try:
            self.receiver = await asyncio.to_thread(
                ReceiverGroup.open, body["master_address"], int(body["master_port"]), int(body["rank_offset"]),
                int(body["world_size"]), body.get("group_name", "weight_update_group"), body.get("backend", "nccl"),
                str(self.gen.device))
        except Exception as exc:  # noqa: BLE001 - any rendezvous failure is the caller's to see
            raise BadRequest(f"init_weights_update_group failed: {exc}") from None
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def from_distributed(self, request: web.Request) -> web.Response:

        body = await read_body(request)
        if self.receiver is None:
            raise BadRequest("no weight update group: call /init_weights_update_group first")
        try:
            named = await asyncio.to_thread(self.receiver.receive, body["names"], body["dtypes"], body["shapes"],
                                            body.get("load_format"))
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise BadRequest(f"update_weights_from_distributed: {exc}") from None
        return await self._load(named, body, "update_weights_from_distributed")

    async def from_tensor(self, request: web.Request) -> web.Response:
        from posttrain.core.rollout.weight_sync import deserialize_named_tensors

        body = await read_body(request)
        data = body.get("serialized_named_tensors")
        if not isinstance(data, list) or not data or not isinstance(data[0], str):
            raise BadRequest("serialized_named_tensors: expected a list of serialized strings (one per TP rank)")
        if body.get("load_format") not in (None, "direct"):
            raise BadRequest(f"load_format: {body['load_format']!r} is not supported (only the default)")
        try:
            named = await asyncio.to_thread(deserialize_named_tensors, data[0])
        except Exception as exc:  # noqa: BLE001 - a bad pickle is the caller's error
            raise BadRequest(f"update_weights_from_tensor: {exc}") from None
        return await self._load(dict(named), body, "update_weights_from_tensor")

    async def destroy_group(self, request: web.Request) -> web.Response:
        from posttrain.core.rollout.weight_sync import close_group

        if self.receiver is not None:
            close_group(self.receiver.group)
        self.receiver = None
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def checksum(self, request: web.Request) -> web.Response:
        sums = await asyncio.to_thread(self.gen.weight_checksums)
        return web.json_response({"weight_version": self.gen.weight_version,
                                  "dtype": str(self.gen.dtype).removeprefix("torch."), "checksums": sums})

    def add_to(self, router: web.UrlDispatcher) -> None:
        for path, fn in (("/update_weights_from_disk", self.from_disk), ("/init_weights_update_group", self.init_group),
                         ("/update_weights_from_distributed", self.from_distributed),
                         ("/update_weights_from_tensor", self.from_tensor),
                         ("/destroy_weights_update_group", self.destroy_group)):
            router.add_post(path, fn)
        router.add_get("/weights_checksum", self.checksum)
