"""The ``hf`` engine's HTTP server: SGLang's native API over :class:`~.generator.HFGenerator` (aiohttp).

``python -m posttrain.plugins.engines.hf.server MODEL_DIR --port P [--device cpu] [--dtype auto]
[--max-batch-size N] [--load-format dummy]``; the API key comes from ``POSTTRAIN_ENGINE_API_KEY``.

Endpoints (SGLang's paths, bodies and answers, as posttrain's client and sglang-router use them):

- ``POST /generate {text | input_ids, sampling_params, return_logprob, rid}``, one prompt or a list ->
  ``{text, output_ids, meta_info: {id, finish_reason, prompt_tokens, completion_tokens, cached_tokens,
  weight_version, output_token_logprobs: [[logprob, token_id, null], ...]}}`` (a list for a list). A list
  with one ``sampling_params`` carrying ``sampling_seed: s`` seeds row ``j`` with ``s + j``;
- ``GET /health``, ``/health_generate`` (a one-token generation), ``/model_info``, ``/server_info`` (and
  their ``/get_*`` aliases), ``/get_weight_version``, ``/flush_cache``;
- ``POST /abort_request {rid | abort_all}``, ``/pause_generation``, ``/continue_generation``;
- ``POST /update_weights_from_disk {model_path}``, ``/init_weights_update_group``,
  ``/update_weights_from_distributed``, ``/destroy_weights_update_group``, ``/update_weights_from_tensor``
  (each with an optional ``weight_version``; all or nothing), ``GET /weights_checksum``;
- ``POST /release_memory_occupation``, ``/resume_memory_occupation``: on a GPU the weights go to host
  memory and back (the KV cache lives only while a batch decodes); on the CPU they stay.

Every endpoint but ``/health*`` needs ``Authorization: Bearer KEY`` (HTTP 401 otherwise). Bad input is
HTTP 400 ``{"error": {"message": ...}}`` and the server keeps serving. Requests that arrive while a
batch decodes wait for the next batch (no continuous batching: this engine is the slow, universal one).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import os
from pathlib import Path
from typing import Any

from aiohttp import web

from posttrain.core.types import row_seed
from posttrain.plugins.engines.hf.generator import HFGenerator, Row
from posttrain.plugins.engines.hf.weights import BODY_LIMIT, WeightEndpoints, read_body
from posttrain.plugins.engines.local.bodies import BadRequest

GENERATE_KEYS = {"text", "input_ids", "sampling_params", "return_logprob", "rid", "stream", "image_data"}
OFF_VALUES = (None, False, 0, -1, "", [], {})  # other GenerateReqInput fields are accepted when off
DEFAULT_OK = {"log_metrics": True}


class Server:
    """Requests queue up; one task hands batches of rows to the generator's thread."""

    def __init__(self, gen: HFGenerator, host: str, port: int, max_batch_size: int = 256, api_key: str | None = None):
        self.gen, self.host, self.port, self.max_batch_size, self.api_key = gen, host, port, max_batch_size, api_key
        self.queue: asyncio.Queue | None = None
        self.running = asyncio.Event()  # cleared by /pause_generation
        self.count = 0
        self.weights = WeightEndpoints(self)
        self.released: list[str] = []

    # ------------------------------------------------------------------ batching
    async def _run(self, rows: list[Row]) -> list[Row]:
        done = asyncio.get_running_loop().create_future()
        await self.queue.put((rows, done))
        return await done

    async def _batcher(self, app: web.Application) -> Any:
        self.queue = asyncio.Queue()
        self.running.set()

        async def loop() -> None:
            while True:
                waiting = [await self.queue.get()]
                while not self.queue.empty() and sum(len(r) for r, _ in waiting) < self.max_batch_size:
                    waiting.append(self.queue.get_nowait())
                await self.running.wait()
                try:
                    await asyncio.to_thread(self.gen.decode, [row for rows, _ in waiting for row in rows])
                except Exception as exc:  # a failed batch fails its requests, not the server
                    for _, fut in waiting:
                        fut.done() or fut.set_exception(exc)
                    continue
                finally:
                    self.gen.aborted.clear()
                for rows, fut in waiting:
                    fut.done() or fut.set_result(rows)

        task = asyncio.ensure_future(loop())
        yield
        task.cancel()

    # ------------------------------------------------------------------ /generate
    def _prompt(self, text: Any, ids: Any) -> list[int]:
        if ids is None:
            if not isinstance(text, str):
                raise BadRequest("text: expected a string")
            ids = self.gen.tokenizer.encode(text, add_special_tokens=False)
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest("input_ids: expected a non-empty list of integers")
        if not all(0 <= t < self.gen.vocab_size for t in ids):
            raise BadRequest(f"input_ids: token ids must be in [0, {self.gen.vocab_size})")
        if len(ids) >= self.gen.context_length:
            raise BadRequest(f"the prompt has {len(ids)} tokens; the context length is {self.gen.context_length}")
        return list(ids)

    def _rows(self, body: dict[str, Any]) -> tuple[list[Row], bool, bool]:
        """The request's rows, whether it was a list, and ``return_logprob``."""
        from posttrain.plugins.engines.local.sampling import SamplingError, parse_sampling

        extra = sorted(k for k in body if k not in GENERATE_KEYS and body[k] not in OFF_VALUES
                       and not (k in DEFAULT_OK and body[k] == DEFAULT_OK[k]))
        if extra or body.get("stream"):
            raise BadRequest(f"unknown or unsupported field(s): {', '.join(extra or ['stream'])}")
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("give exactly one of `text` and `input_ids`")
        batched = isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
        prompts = (text if text is not None else ids) if batched else [text if text is not None else ids]
        if not prompts:
            raise BadRequest("empty batch")
        sp = body.get("sampling_params")
        try:
            params = [parse_sampling(s) for s in sp] if isinstance(sp, list) else [parse_sampling(sp)] * len(prompts)
        except SamplingError as exc:
            raise BadRequest(str(exc)) from None
        if len(params) != len(prompts):
            raise BadRequest(f"sampling_params: {len(params)} entries for {len(prompts)} prompts")
        if batched and not isinstance(sp, list) and params[0].sampling_seed is not None:
            from dataclasses import replace

            params = [replace(p, sampling_seed=row_seed(p.sampling_seed, j)) for j, p in enumerate(params)]
        return_logprob = body.get("return_logprob", False)
        if not isinstance(return_logprob, bool):
            raise BadRequest("return_logprob: expected true or false")
        rid = body.get("rid")
        rids = rid if isinstance(rid, list) else [rid] * len(prompts)
        images = self._image_data(body.get("image_data"), batched, len(prompts))
        rows = []
        for prompt, p, r, im in zip(prompts, params, rids, images):
            self.count += 1
            row = Row(self._prompt(prompt if text is not None else None, prompt if ids is not None else None),
                      p, str(r or f"hf-{self.count}"))
            if im:
                self._add_images(row, im)
            rows.append(row)
        return rows, batched, return_logprob

    def _image_data(self, data: Any, batched: bool, n: int) -> list[list[str]]:
        """SGLang's ``image_data`` as one list of image references per prompt: a batch takes one entry per prompt
        (a reference or a list), a single prompt a reference or a list."""
        if data in OFF_VALUES:
            return [[] for _ in range(n)]
        if self.gen.vision is None:
            raise BadRequest(f"image_data: {self.gen.config.model_type} is not a vision-language model")
        entries = data if batched else [data]
        if not isinstance(entries, list) or len(entries) != n:
            raise BadRequest(f"image_data: expected one entry per prompt ({n})")
        out = [e if isinstance(e, list) else [] if e is None else [e] for e in entries]
        if not all(isinstance(ref, str) for refs in out for ref in refs):
            raise BadRequest("image_data: expected image references (file paths, URLs or base64 strings)")
        return out

    def _add_images(self, row: Row, images: list[str]) -> None:
        """The row's prompt with its image tokens expanded (counted from the images' sizes; the pixels come in the
        decode thread) and its images; a 400 names an image that cannot be read or a prompt that does not fit."""
        try:
            row.prompt = self.gen.vision.expand(row.prompt, images, pixels=False)[0]
        except (OSError, ValueError) as exc:
            raise BadRequest(f"image_data: {exc}") from None
        if len(row.prompt) >= self.gen.context_length:
            raise BadRequest(f"the prompt has {len(row.prompt)} tokens with its images; the context length is "
                             f"{self.gen.context_length}")
        row.images = list(images)

    def _answer(self, r: Row, return_logprob: bool) -> dict[str, Any]:
        meta = {"id": r.rid, "finish_reason": r.finish, "prompt_tokens": len(r.prompt),
                "completion_tokens": len(r.output), "cached_tokens": 0, "weight_version": self.gen.weight_version}
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.logprobs, r.output)]
        return {"text": self.gen.text(r), "output_ids": list(r.output), "meta_info": meta}

    async def generate(self, request: web.Request) -> web.Response:
        rows, batched, return_logprob = self._rows(await read_body(request))
        outs = [self._answer(r, return_logprob) for r in await self._run(rows)]
        return web.json_response(outs if batched else outs[0])

    # ------------------------------------------------------------------ control
    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        self.gen.aborted.add("" if body.get("abort_all") else str(body.get("rid", "")))
        return web.json_response({"success": True})

    async def pause_generation(self, request: web.Request) -> web.Response:
        self.running.clear()  # the batch decoding now finishes; the next waits
        return web.json_response({"success": True})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.running.set()
        return web.json_response({"success": True})

    async def release_memory(self, request: web.Request) -> web.Response:
        if self.gen.device.type == "cuda" and not self.released:
            await asyncio.to_thread(self.gen.move, "cpu")
            self.released = ["weights"]
        return web.json_response({"success": True})

    async def resume_memory(self, request: web.Request) -> web.Response:
        if self.released:
            await asyncio.to_thread(self.gen.move, self.gen.device)
            self.released = []
        return web.json_response({"success": True})

    # ------------------------------------------------------------------ info
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        from posttrain.plugins.engines.local.sampling import parse_sampling

        await self._run([Row([0], parse_sampling({"max_new_tokens": 1, "temperature": 0}), "health")])
        return web.Response(status=200)

    def _info(self) -> dict[str, Any]:
        cfg = self.gen.config
        return {"model_path": self.gen.model_dir, "tokenizer_path": self.gen.model_dir, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.gen.weight_version,
                "model_type": cfg.model_type, "architectures": getattr(cfg, "architectures", None)}

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self._info())

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({**self._info(), "host": self.host, "port": self.port, "device": str(self.gen.device),
                                  "dtype": str(self.gen.dtype).removeprefix("torch."), "tp_size": 1, "dp_size": 1,
                                  "context_length": self.gen.context_length, "version": "posttrain-hf",
                                  "max_running_requests": self.max_batch_size, "internal_states": [{}]})

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.gen.weight_version})

    async def flush_cache(self, request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.\n")  # no cache outlives a batch

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=BODY_LIMIT)
        app.cleanup_ctx.append(self._batcher)
        r = app.router
        for path, fn in (("/health", self.health), ("/health_generate", self.health_generate),
                         ("/model_info", self.model_info), ("/get_model_info", self.model_info),
                         ("/server_info", self.server_info), ("/get_server_info", self.server_info),
                         ("/get_weight_version", self.weight_version), ("/flush_cache", self.flush_cache)):
            r.add_get(path, fn)
            r.add_post(path, fn)
        for path, fn in (("/generate", self.generate), ("/abort_request", self.abort_request),
                         ("/pause_generation", self.pause_generation), ("/continue_generation", self.continue_generation),
                         ("/release_memory_occupation", self.release_memory),
                         ("/resume_memory_occupation", self.resume_memory)):
            r.add_post(path, fn)
        self.weights.add_to(r)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.api_key and not request.path.startswith("/health"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return web.json_response({"error": {"message": "Unauthorized: this engine needs Authorization: "
                                                               "Bearer <its API key>"}}, status=401)
        try:
            return await handler(request)
        except (BadRequest, ValueError) as exc:
            return web.json_response({"error": {"message": str(exc)}, "success": False, "message": str(exc)},
                                     status=getattr(exc, "status", 400))


def main(argv: list[str] | None = None) -> None:
    import torch

    from posttrain.core.rollout.backend import API_KEY_ENV

    parser = argparse.ArgumentParser(description="posttrain's hf engine: SGLang's HTTP API over HF transformers")
    parser.add_argument("model_dir")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--context-length", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: build from config.json alone; the weights come with the first update")
    parser.add_argument("--seed", type=int, default=0, help="seeds the draws of requests without sampling_seed")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    if not (Path(args.model_dir) / "config.json").is_file():
        raise SystemExit(f"{args.model_dir}: not an HF checkpoint directory (no config.json)")
    gen = HFGenerator(args.model_dir, args.device, args.dtype, from_config=args.load_format == "dummy",
                      context_length=args.context_length)
    server = Server(gen, args.host, args.port, args.max_batch_size, api_key=os.environ.pop(API_KEY_ENV, None) or None)
    print(f"hf engine serving {gen.model_dir} ({gen.config.model_type}, {gen.dtype}) on "
          f"http://{args.host}:{args.port}", flush=True)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
