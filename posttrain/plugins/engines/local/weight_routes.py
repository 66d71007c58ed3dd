"""The local engine server's weight endpoints (SGLang's paths and bodies), kept apart from the server class.

- ``POST /update_weights_from_disk {model_path, weight_version}``: every ``*.safetensors`` file of the
  directory; the files must cover every tensor of the model (tied weights by either name);
- ``POST /init_weights_update_group``, ``/update_weights_from_distributed``, ``/destroy_weights_update_group``:
  a torch.distributed group with the trainer (Gloo on CPU, NCCL on GPUs), a bucket per call;
- ``POST /update_weights_from_tensor {serialized_named_tensors}``: SGLang's colocated format, a pickle
  (CUDA IPC handles on GPUs). Unpickling runs code, so like every endpoint but ``/health*`` it is served
  only to callers holding the run's API key;
- ``GET /weights_checksum``: SHA-256 of every tensor as the engine holds it (``rollout.check_weights``).

Every update is all or nothing (:meth:`ModelRunner.load_weights` checks every name, shape and dtype
before the first copy) and runs in the engine thread between two decode steps; the weight version
changes only after a complete update.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web

from posttrain.core.rollout.weight_sync import read_safetensors

from posttrain.plugins.engines.local.bodies import WEIGHTS_BODY_LIMIT, BadRequest


class WeightRoutes:
    """Handlers bound to an :class:`~posttrain.plugins.engines.local.server.EngineServer`."""

    def __init__(self, server: Any):
        self.server = server
        self.receiver = None  # ReceiverGroup of the current weight-update group

    @property
    def engine(self):
        return self.server.engine

    async def _load(self, named: dict[str, Any], require_all: bool = False) -> int:
        runner = self.server.runner
        return await asyncio.to_thread(self.engine.call_in_engine,
                                       lambda: runner.load_weights(named, require_all=require_all))

    def _bump_version(self, version: Any) -> str:
        current = self.engine.weight_version
        self.engine.weight_version = str(version) if version is not None else (
            str(int(current) + 1) if current.isdigit() else "1")
        return self.engine.weight_version

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await self.server.read_json(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not Path(path).is_dir():
            raise BadRequest(f"model_path: expected a checkpoint directory, got {path!r}")
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise BadRequest(f"model_path: no *.safetensors files in {path}")

        try:
            named = await asyncio.to_thread(read_safetensors, files)
            count = await self._load(named, require_all=True)
        except Exception as exc:  # unreadable files, or names/shapes that are not this model's
            raise BadRequest(f"update_weights_from_disk {path}: {exc}") from None
        if body.get("abort_all_requests"):
            self.engine.abort(abort_all=True)
        version = self._bump_version(body.get("weight_version"))
        return web.json_response({"success": True, "num_paused_requests": 0,
                                  "message": f"Succeeded to update model weights (version {version}); "
                                             f"{count} tensors loaded"})

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        from posttrain.core.rollout.weight_sync import ReceiverGroup
        body = await self.server.read_json(request)
        address, port, offset, world, name, backend = group_arguments(body)
        try:
            self.receiver = await asyncio.to_thread(ReceiverGroup.open, address, port, offset, world, name, backend,
                                                    self.server.device)
        except Exception as exc:
            raise BadRequest(f"init_weights_update_group failed: {exc}") from None
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await self.server.read_json(request)
        if self.receiver is None:
            raise BadRequest("no weight update group: call /init_weights_update_group first")
        try:
            named = await asyncio.to_thread(self.receiver.receive, body["names"], body["dtypes"], body["shapes"],
                                            body.get("load_format"))
            await self._load(named)
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise BadRequest(f"update_weights_from_distributed: {exc}") from None
        version = self._bump_version(body.get("weight_version"))
        return web.json_response({"success": True, "message": f"Succeeded to update weights (version {version})."})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """SGLang's colocated path: ``serialized_named_tensors`` holds one serialized list per TP rank."""
        from posttrain.core.rollout.weight_sync import deserialize_named_tensors

        body = await self.server.read_json(request, limit=WEIGHTS_BODY_LIMIT)
        data = body.get("serialized_named_tensors")
        if not isinstance(data, list) or not data or not isinstance(data[0], str):
            raise BadRequest("serialized_named_tensors: expected a list of serialized strings (one per TP rank)")
        if body.get("load_format") not in (None, "direct"):
            raise BadRequest(f"load_format: {body['load_format']!r} is not supported (only the default)")
        try:
            named = await asyncio.to_thread(deserialize_named_tensors, data[0])
            await self._load(dict(named))
        except Exception as exc:
            raise BadRequest(f"update_weights_from_tensor: {exc}") from None
        version = self._bump_version(body.get("weight_version"))
        return web.json_response({"success": True, "message": f"Succeeded to update weights (version {version})."})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        from posttrain.core.rollout.weight_sync import close_group

        if self.receiver is not None:
            close_group(self.receiver.group)
        self.receiver = None
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def weights_checksum(self, request: web.Request) -> web.Response:
        """``{"weight_version", "dtype", "checksums": {hf_name: sha256 hex}}``, taken between two steps."""
        runner = self.server.runner
        sums = await asyncio.to_thread(self.engine.call_in_engine, runner.weight_checksums)
        return web.json_response({"weight_version": self.engine.weight_version,
                                  "dtype": str(runner.dtype).removeprefix("torch."), "checksums": sums})

    def add_to(self, router: web.UrlDispatcher) -> None:
        for path, fn in (("/update_weights_from_disk", self.update_weights_from_disk),
                         ("/init_weights_update_group", self.init_weights_update_group),
                         ("/update_weights_from_distributed", self.update_weights_from_distributed),
                         ("/update_weights_from_tensor", self.update_weights_from_tensor),
                         ("/destroy_weights_update_group", self.destroy_weights_update_group)):
            router.add_post(path, fn)
        router.add_get("/weights_checksum", self.weights_checksum)


GROUP_BACKENDS = ("nccl", "gloo")


def group_arguments(body: dict[str, Any]) -> tuple[str, int, int, int, str, str]:
    """``/init_weights_update_group``'s arguments, checked before any connection is tried (a 400 naming the
    field, not a rendezvous that times out): ``(master_address, master_port, rank_offset, world_size,
    group_name, backend)``; the trainer is rank 0 and this engine's ranks start at ``rank_offset >= 1``."""
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
    if missing:
        raise BadRequest(f"missing field(s): {', '.join(missing)}")
    ints = {}
    for key in ("master_port", "rank_offset", "world_size"):
        value = body[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(f"{key}: expected an integer, got {value!r}")
        ints[key] = value
    port, offset, world = ints["master_port"], ints["rank_offset"], ints["world_size"]
    if not 1 <= port <= 65535:
        raise BadRequest(f"master_port: {port} is not a TCP port (1-65535)")
    if world < 2:
        raise BadRequest(f"world_size: {world}; a weight-update group holds the trainer and at least one engine rank")
    if not 1 <= offset < world:
        raise BadRequest(f"rank_offset: {offset}; this engine's ranks start after the trainer's rank 0 and below "
                         f"world_size {world}")
    address, name = body["master_address"], body.get("group_name", "weight_update_group")
    if not isinstance(address, str) or not address:
        raise BadRequest(f"master_address: expected a host name or address, got {address!r}")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"group_name: expected a non-empty string, got {name!r}")
    backend = body.get("backend", "nccl")
    if backend not in GROUP_BACKENDS:
        raise BadRequest(f"backend: {backend!r} is not one of {', '.join(GROUP_BACKENDS)}")
    return address, port, offset, world, name, backend
