"""The embedded local engine's HTTP server: SGLang's native API over a HF checkpoint (aiohttp).

``rl-cli engine serve MODEL_DIR --port P`` runs :func:`serve`. Endpoints (same paths, bodies and
answers as ``sglang.srt.entrypoints.http_server``):

- ``POST /generate`` ``{text | input_ids, sampling_params, return_logprob, rid, return_routed_experts}``
  (single or batched) -> ``{text, output_ids, meta_info: {id, finish_reason, prompt_tokens,
  completion_tokens, cached_tokens, weight_version, output_token_logprobs: [[logprob, token_id, null], ...],
  routed_experts}}`` (``routed_experts``: MoE models, base64 int32 ``[prompt + output - 1, layers, top_k]``,
  see ``engine.encode_routed_experts``); with ``return_logprob`` and ``logprob_start_len: s >= 0`` also
  ``input_token_logprobs``: one ``[logprob, token_id, null]`` per prompt token from position ``s`` on, the
  first with logprob null, as SGLang answers (``max_new_tokens: 0`` only scores: a teacher's log-probs of
  a student's sample)
- ``GET /health``, ``GET /health_generate`` (runs a one-token generation), ``GET|POST /flush_cache``
- ``POST /abort_request {rid, abort_all}``, ``POST /pause_generation {mode}``, ``POST /continue_generation``
- ``GET /model_info`` (``/get_model_info``), ``GET /server_info`` (``/get_server_info``),
  ``GET /get_weight_version``
- ``POST /update_weights_from_disk {model_path, weight_version}``,
  ``POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
  backend}``, ``POST /update_weights_from_distributed {names, dtypes, shapes, group_name,
  weight_version}``, ``POST /destroy_weights_update_group {group_name}``,
  ``POST /update_weights_from_tensor {serialized_named_tensors, weight_version}`` (colocated; a pickle,
  as in SGLang), ``GET /weights_checksum`` (see ``weight_routes``)
- ``POST /release_memory_occupation``, ``POST /resume_memory_occupation`` (GPU: weights and KV cache
  move to host memory and back)

Every endpoint except ``/health*`` needs ``Authorization: Bearer KEY`` with the server's API key
(SGLang's ``--api-key`` convention; HTTP 401 otherwise): the weight endpoints load files and unpickle
bodies, so only the run that started the engine may call them. ``rl-cli engine serve`` reads the key
from the environment (``POSTTRAIN_ENGINE_API_KEY``), never from its command line.

Bad input (malformed or too deeply nested JSON, unknown fields, sampling values the engine cannot run or
does not implement -- ``n`` other than 1, penalties, ``logit_bias``: refused by name, never ignored --,
contradictory ones such as ``min_new_tokens > max_new_tokens``, weight-group arguments no group can
have, a prompt as long as the context) is answered with HTTP 400 ``{"error": {"message": ...}}``, a body
over its endpoint's limit with 413, a body that does not arrive within ``request_timeout_s`` with 408
(and its connection closed; idle connections are closed after the same time), and the server keeps
serving: a request that breaks a step on its own fails alone (400), the others in the batch go on.
Requests are admitted round-robin across ``/generate`` calls (``requests.FairQueue``), so a large batch
does not make a small request wait for all its rows. Prompts are tokenized off the event loop, so
``/health`` stays responsive. A client that disconnects aborts its request.

Where we differ from SGLang: a batched ``/generate`` whose one ``sampling_params`` has a ``sampling_seed``
``s`` seeds row ``j`` with ``s + j`` (SGLang seeds every row with ``s``, so identical prompts would give
identical samples). Seeded runs send a group of samples as one request this way. SGLang answers
``return_routed_experts`` only when started with ``--enable-return-routed-experts``; this server always
does for a MoE model (and answers 400 for a dense one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from posttrain.core import jsonio
from posttrain.core.gcutil import settle_heap
from posttrain.core.types import row_seed

from posttrain.plugins.engines.local.bodies import (GENERATE_BODY_LIMIT, SMALL_BODY_LIMIT, WEIGHTS_BODY_LIMIT,
                                                   BadRequest, TooSlow,
                                                   read_json)
from posttrain.plugins.engines.local.memory import MEMORY_TAGS, EngineMemory
from posttrain.plugins.engines.local.sampling import SamplingError, parse_sampling, parse_sampling_rows
from posttrain.plugins.engines.local.weight_routes import WeightRoutes

if TYPE_CHECKING:
    from posttrain.plugins.engines.local.options import EngineOptions
    from posttrain.plugins.engines.local.model_runner import RunnerTuning

log = logging.getLogger("posttrain.engine")

# GenerateReqInput fields: honoured here, or accepted when they carry their default (a router or client
# may send them explicitly). Anything else is a 400.
GENERATE_KEYS = {"text", "input_ids", "sampling_params", "return_logprob", "rid", "logprob_start_len",
                 "return_routed_experts"}
DEFAULT_OK = {"stream": False, "top_logprobs_num": 0, "return_text_in_logprobs": False,
              "lora_path": None, "image_data": None, "audio_data": None, "video_data": None,
              "custom_logit_processor": None, "return_hidden_states": False, "bootstrap_host": None,
              "bootstrap_port": None, "bootstrap_room": None, "token_ids_logprob": None, "input_embeds": None,
              "data_parallel_rank": None, "return_routed_experts": False, "modalities": None,
              "session_params": None, "log_metrics": True, "background": False, "model": None,
              "no_logs": False, "return_bytes": False, "return_entropy": False}


MAX_CHARS_PER_TOKEN = 16  # a text prompt longer than this x the context is refused untokenized
WARM_UP_TIMEOUT_S = 600  # compiles and captures of a large model (seconds)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}, "success": False, "message": message}, status=status)


def runner_tuning(config: EngineOptions) -> RunnerTuning:
    """The model runner's tuning from the backend's config (the fields of the same names); float32 logits off a
    GPU only (a GPU engine's sampling upcasts the model's dtype itself)."""
    from posttrain.plugins.engines.local.model_runner import RunnerTuning

    return RunnerTuning(decode_attention=config.decode_attention, compile=config.compile,
                        compile_mode=config.compile_mode, cuda_graphs=config.cuda_graphs,
                        float_logits=not config.device.startswith("cuda"), exact=config.exact,
                        moe_kernel=config.moe_kernel)


class EngineServer:
    """Holds the engine, tokenizer and server args; builds the aiohttp application."""

    def __init__(self, model_dir: str, config: EngineOptions, host: str = "127.0.0.1", port: int = 30000,
                 api_key: str | None = None, generate_body_limit: int = GENERATE_BODY_LIMIT, from_config: bool = False,
                 warm_sampling: dict[str, Any] | None = None):
        """Serve ``model_dir`` as ``config`` says (``rl-cli engine serve``'s options, the local backend's
        ``Config``); ``from_config``: the model built from its ``config.json`` with zero weights (``--load-format
        dummy``); ``warm_sampling``: the sampling of the warm-up generation (with ``config.warm_up``)."""
        from transformers import AutoTokenizer

        from posttrain.plugins.engines.local.engine import BatchEngine
        from posttrain.plugins.engines.local.model_runner import ModelRunner

        self.model_dir = str(Path(model_dir).resolve())
        self.config, self.host, self.port, self.device = config, host, port, config.device
        t0 = time.perf_counter()
        self.startup_s: dict[str, float] = {}  # seconds of each part of the start (the serving line, /server_info)
        self._first_health: float | None = None  # when the first /health_generate came
        self.runner = ModelRunner(self.model_dir, device=config.device, dtype=config.dtype,
                                  max_slots=config.max_running_requests, context_length=config.context_length or None,
                                  tuning=runner_tuning(config), from_config=from_config)
        t1 = time.perf_counter()
        self.startup_s["model"] = t1 - t0
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.startup_s["tokenizer"] = time.perf_counter() - t1
        eos = self.runner.hf_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos.append(self.tokenizer.eos_token_id)
        on_gpu = self.runner.device.type == "cuda"
        self.engine = BatchEngine(self.runner, self.tokenizer, eos, overlap=config.overlap and on_gpu,
                                  fused_sampling=None if config.fused_sampling and not config.exact else False,
                                  prefill_tokens=config.prefill_tokens or None)
        self.api_key = api_key
        self.generate_body_limit = generate_body_limit
        self.weights = WeightRoutes(self)
        self.memory = EngineMemory(self.runner)
        stable_memory = config.stable_memory and on_gpu
        if stable_memory:  # before the first request: graphs are captured over the stable addresses
            t2 = time.perf_counter()
            why = self.engine.call_in_engine(self.memory.make_stable)
            self.startup_s["stable_memory"] = time.perf_counter() - t2
            if why:
                log.warning("stable memory off (%s): CUDA graphs are recaptured after every memory release", why)
        # not where the driver refused stable memory: each release drops the graphs, and the first rollout recaptures
        if config.warm_up and warm_sampling is not None and (self.memory.stable or not stable_memory):
            t3 = time.perf_counter()
            self._warm_up(warm_sampling)
            self.startup_s["warm_up"] = time.perf_counter() - t3
        self.released = False
        self._ready: list[tuple[asyncio.Future, dict[str, Any]]] = []  # finished, not yet handed to the loop
        self._ready_lock = threading.Lock()
        self._wake_pending = False
        self.server_args = self._server_args(from_config, warm_sampling)

    def _server_args(self, from_config: bool, warm_sampling: dict[str, Any] | None) -> dict[str, Any]:
        """``/server_info``'s settings: SGLang's names where it has them, each as this server runs it."""
        cfg = self.config
        return {
            "model_path": self.model_dir, "tokenizer_path": self.model_dir, "host": self.host, "port": self.port,
            "device": cfg.device, "dtype": str(self.runner.dtype).removeprefix("torch."),
            "context_length": self.runner.context_length, "max_running_requests": cfg.max_running_requests,
            "tp_size": 1, "dp_size": 1, "cuda_graphs": self.runner.cuda_graphs,
            "stable_memory": self.memory.stable, "overlap": self.engine.overlap,
            "prefill_tokens": self.engine.prefill_tokens, "fused_sampling": cfg.fused_sampling,
            "decode_attention": self.runner.decode_attention, "moe_kernel_blocks": self.runner.moe_kernel_blocks,
            "compile": cfg.compile, "compile_mode": cfg.compile_mode,
            "skip_tokenizer_init": False, "load_format": "dummy" if from_config else "auto",
            "warm_sampling": warm_sampling,
        }

    def _warm_up(self, sampling: dict[str, Any]) -> None:
        """One two-token generation with ``sampling`` (``--warm-sampling``, a run's rollout sampling) before the
        server answers: the prefill's and the decode step's compiles, and every batch bucket's CUDA graph for that
        sampling (``graphs.warm``), run now rather than in the first rollout, which they would make many seconds
        longer than the next. A disaggregated run's engines start while its trainer builds, so
        there they cost nothing. Stop strings are dropped and EOS ignored: both tokens are generated."""
        done, box = threading.Event(), {}
        params = parse_sampling({**sampling, "max_new_tokens": 2, "ignore_eos": True, "stop": None,
                                 "stop_token_ids": None})
        self.engine.submit([0, 1], params, False, lambda out: (box.update(out), done.set()))
        if not done.wait(WARM_UP_TIMEOUT_S):
            raise RuntimeError(f"the warm-up generation (--warm-sampling) did not end in {WARM_UP_TIMEOUT_S} s")
        finish = box.get("meta_info", {}).get("finish_reason") or {}
        if "error" in box or finish.get("type") == "abort":  # a failed engine step aborts its requests
            raise RuntimeError(f"the warm-up generation (--warm-sampling) failed: "
                               f"{box.get('error') or finish.get('message')}")

    # -- helpers --------------------------------------------------------------------------------
    async def read_json(self, request: web.Request, required: bool = True, limit: int = SMALL_BODY_LIMIT) -> dict[str, Any]:
        """:func:`~posttrain.plugins.engines.local.bodies.read_json` within this server's ``request_timeout_s``."""
        return await read_json(request, self.config.request_timeout_s, required, limit)

    def _prompt(self, text: Any, input_ids: Any) -> list[int]:
        if input_ids is not None:
            if not isinstance(input_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
                raise BadRequest("input_ids: expected a list of integers")
            bad = [t for t in input_ids if not 0 <= t < self.runner.vocab_size]
            if bad:
                raise BadRequest(f"input_ids: token id {bad[0]} is outside the vocabulary [0, {self.runner.vocab_size})")
            ids = list(input_ids)
        elif isinstance(text, str):
            if len(text) > MAX_CHARS_PER_TOKEN * self.runner.context_length:
                raise BadRequest(f"text: {len(text)} characters; at most {MAX_CHARS_PER_TOKEN} x the context length "
                                 f"({self.runner.context_length} tokens) are tokenized")
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            raise BadRequest("text: expected a string")
        if not ids:
            raise BadRequest("the prompt is empty")
        if len(ids) >= self.runner.context_length:
            raise BadRequest(f"the prompt has {len(ids)} tokens; the context length is {self.runner.context_length}")
        return ids

    @staticmethod
    def _logprob_starts(value: Any, prompts: list[list[int]]) -> list[int]:
        """``logprob_start_len`` (one int, or one per prompt of a batch) checked against each prompt:
        ``-1`` (the default: no input log-probs) or ``0 <= s < len(prompt)``, as SGLang requires."""
        values = value if isinstance(value, list) else [value] * len(prompts)
        if len(values) != len(prompts):
            raise BadRequest(f"logprob_start_len: {len(values)} values for {len(prompts)} prompts")
        for v, ids in zip(values, prompts):
            if isinstance(v, bool) or not isinstance(v, int) or not -1 <= v < len(ids):
                raise BadRequest(f"logprob_start_len: expected -1 or an integer in [0, {len(ids)}) "
                                 f"(the prompt length), got {v!r}")
        return values

    def _deliver(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: dict[str, Any]) -> None:
        """Engine thread: hand ``result`` to ``fut``. Results of one engine step wake the event loop once
        (one ``call_soon_threadsafe`` per batch of finished requests, not one per request)."""
        with self._ready_lock:
            self._ready.append((fut, result))
            wake, self._wake_pending = not self._wake_pending, True
        if wake:
            loop.call_soon_threadsafe(self._flush_ready)

    def _flush_ready(self) -> None:
        with self._ready_lock:
            ready, self._ready, self._wake_pending = self._ready, [], False
        for fut, result in ready:
            if not fut.done():
                fut.set_result(result)

    async def _run_one(self, ids: list[int], sampling, return_logprob: bool, rid: str | None,
                       logprob_start_len: int = -1, return_routed_experts: bool = False) -> dict[str, Any]:
        return (await self._run_rows([ids], [sampling], return_logprob, [rid], [logprob_start_len],
                                     return_routed_experts))[0]

    # -- endpoints ------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        body = await self.read_json(request, limit=self.generate_body_limit)
        unknown = sorted(k for k in body if k not in GENERATE_KEYS and not (k in DEFAULT_OK and body[k] == DEFAULT_OK[k]))
        if unknown:
            raise BadRequest(f"unknown or unsupported field(s): {', '.join(f'{k}={body[k]!r}' for k in unknown)}")
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise BadRequest("give exactly one of `text` and `input_ids`")
        batched = isinstance(text, list) or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list))
        texts = text if isinstance(text, list) else [text]
        ids_list = input_ids if batched and input_ids is not None else [input_ids]
        n = len(texts) if text is not None else len(ids_list)
        if batched and n == 0:
            raise BadRequest("empty batch")
        sp = body.get("sampling_params")
        sps = sp if isinstance(sp, list) else [sp] * n
        if len(sps) != n:
            raise BadRequest(f"sampling_params: {len(sps)} entries for {n} prompts")
        rids = body.get("rid")
        rids = rids if isinstance(rids, list) else [rids] * n
        if len(rids) != n:
            raise BadRequest(f"rid: {len(rids)} ids for {n} prompts")
        return_logprob = body.get("return_logprob", False)
        if not isinstance(return_logprob, bool):
            raise BadRequest("return_logprob: expected true or false")
        routed = body.get("return_routed_experts", False)
        if not isinstance(routed, bool):
            raise BadRequest("return_routed_experts: expected true or false")
        if routed and not self.runner.moe_top_k:
            raise BadRequest("return_routed_experts: the model has no MoE layers")
        if self.released:
            raise BadRequest(f"engine memory is released ({', '.join(sorted(self.memory.released))}): "
                             "POST /resume_memory_occupation first")
        self._check_weights_written()
        try:  # one shared sampling_params is parsed once
            params = parse_sampling_rows(sps) if isinstance(sp, list) else [parse_sampling(sp)] * n
        except SamplingError as exc:
            raise BadRequest(str(exc)) from None
        if batched and not isinstance(sp, list) and params[0].sampling_seed is not None:
            # One shared sampling_params with a seed: row j draws with seed + j, so the samples of one
            # prompt differ (sglang-router forwards one sampling_params per request). SGLang would give
            # every row the seed itself.
            params = [dataclasses.replace(p, sampling_seed=row_seed(p.sampling_seed, j)) for j, p in enumerate(params)]
        def build():
            return [self._prompt(texts[i] if text is not None else None,
                                 ids_list[i] if input_ids is not None else None) for i in range(n)]

        # tokenizing a long text must not stall the event loop; token ids are only checked (no thread hop)
        prompts = build() if text is None else await asyncio.to_thread(build)
        starts = self._logprob_starts(body.get("logprob_start_len", -1), prompts)
        outs = await self._run_rows(prompts, params, return_logprob, rids, starts, routed)
        return web.Response(body=jsonio.dumps_bytes(outs if batched else outs[0]), content_type="application/json")

    def _check_weights_written(self) -> None:
        """A server started without weights (``--load-format dummy``) generates from zero ones until its first
        weight update (the start's own ``/health_generate``), and after one only once updates have written every
        tensor: a push that missed one would otherwise sample from a partly zeroed model, silently."""
        missing = self.runner.unwritten_weights() if self.runner.weight_updates else []
        if missing:
            raise BadRequest(f"this engine started without weights (--load-format dummy) and the weight updates since "
                             f"have not written {len(missing)} of its tensors: {', '.join(missing[:3])}"
                             f"{' ...' if len(missing) > 3 else ''}; push every tensor before generating")

    async def _run_rows(self, prompts, params, return_logprob: bool, rids, starts, routed: bool) -> list[dict]:
        """Every row of one ``/generate`` into the engine at once (``submit_many``), one future each (no task per row); a
        gone client aborts the rows still running; a row that broke an engine step fails the request."""
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in prompts]
        submitted = []
        try:
            submitted = self.engine.submit_many(
                [(ids, sampling, functools.partial(self._deliver, loop, fut), rid, start)
                 for ids, sampling, rid, start, fut in zip(prompts, params, rids, starts, futs)],
                return_logprob, routed)
            outs = await asyncio.gather(*futs)
        except asyncio.CancelledError:
            for rid in submitted:
                self.engine.abort(rid)
            raise
        for out in outs:
            if "error" in out:  # this request alone broke an engine step
                raise BadRequest(out["error"])
        return outs

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.engine.alive:
            return web.Response(status=503, text="engine thread is dead")
        if self.engine.paused or self.released:
            return web.Response(status=200)
        start = time.perf_counter()
        self._first_health = self._first_health or start  # a check that timed out still counts from its start
        try:
            await asyncio.wait_for(self._run_one([0], parse_sampling({"max_new_tokens": 1, "temperature": 0}),
                                                 False, None), timeout=60)
        except asyncio.TimeoutError:
            return web.Response(status=503, text="health generation timed out")
        if "first_generation" not in self.startup_s:  # a run's readiness check: its prefill's compiles, on a GPU
            self.startup_s["first_generation"] = took = time.perf_counter() - self._first_health
            print(f"first generation (the fleet's readiness check) in {took:.1f} s", flush=True)
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        # There is no prefix cache to flush; the KV slots are private to their request.
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self.read_json(request, required=False)
        self.engine.abort(str(body.get("rid") or ""), bool(body.get("abort_all", False)))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self.read_json(request, required=False)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode: expected abort, retract or in_place, got {mode!r}")
        await asyncio.to_thread(self.engine.pause, mode)
        return web.json_response({"success": True, "message": "Generation paused."})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return web.json_response({"success": True, "message": "Generation continued."})

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.runner.hf_config
        return web.json_response({
            "model_path": self.model_dir, "tokenizer_path": self.model_dir, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.engine.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": cfg.model_type, "architectures": getattr(cfg, "architectures", None)})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({**self.server_args, "version": "posttrain-local-engine",
                                  "weight_version": self.engine.weight_version, "startup_s": self.startup_s,
                                  "internal_states": [{"num_requests": self.engine.num_requests,
                                                       **self.engine.queue_depths,
                                                       "memory": self.memory.stats(),
                                                       "steps": self.engine.steps,
                                                       "totals": await self._totals()}]})

    async def _totals(self) -> dict[str, float]:
        """The engine's work since start (a run logs the differences per step), read between two engine steps:
        a step answers its requests before it is counted, so a client that just got its answer would otherwise
        read totals one step short. A busy or dead engine thread: read as they are."""
        def read() -> dict[str, float]:
            return {**self.engine.stats.totals, **self.runner.graph_totals}

        if self.engine.alive:
            try:
                return await asyncio.to_thread(self.engine.call_in_engine, read, 10.0)
            except TimeoutError:
                pass
        return read()

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def release_memory(self, request: web.Request) -> web.Response:
        """SGLang's ``/release_memory_occupation``: ``tags`` (``weights``, ``kv_cache``; default both).
        Weights go to pinned host memory, the KV cache is dropped; the engine must be idle."""
        tags = await self._tags(request)
        if self.engine.num_requests:
            return _error(400, f"release_memory_occupation: {self.engine.num_requests} request(s) in flight")
        await asyncio.to_thread(self.engine.call_in_engine, lambda: self.memory.release(tags))
        self.released = bool(self.memory.released)
        return web.json_response({"success": True, "message": f"released {', '.join(sorted(tags))}"})

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        await asyncio.to_thread(self.engine.call_in_engine, lambda: self.memory.resume(tags))
        self.released = bool(self.memory.released)
        return web.json_response({"success": True, "message": f"resumed {', '.join(sorted(tags))}"})

    async def _tags(self, request: web.Request) -> set[str]:
        body = await self.read_json(request, required=False)
        tags = body.get("tags") or list(MEMORY_TAGS)
        if not isinstance(tags, list) or not set(tags) <= set(MEMORY_TAGS):
            raise BadRequest(f"tags: expected a list of {', '.join(MEMORY_TAGS)}, got {tags!r}")
        return set(tags)

    def app(self) -> web.Application:
        @web.middleware
        async def auth(request: web.Request, handler):
            # SGLang's rule: /health* answers anyone; everything else needs the key. Every Authorization
            # header must carry it (sglang-router sends its worker key and the client's header both).
            if self.api_key is not None and not request.path.startswith("/health"):
                given = request.headers.getall("Authorization", [])
                want = f"Bearer {self.api_key}".encode()
                if not given or not all(hmac.compare_digest(g.encode(), want) for g in given):
                    return _error(401, "Unauthorized: this engine needs Authorization: Bearer <its API key>")
            return await handler(request)

        @web.middleware
        async def errors(request: web.Request, handler):
            try:
                if request.path == "/generate":  # cancelled when its client disconnects: aborts its requests
                    return await handler(request)
                return await asyncio.shield(handler(request))  # a weight update finishes once started
            except BadRequest as exc:
                response = _error(exc.status, str(exc))
                if isinstance(exc, TooSlow):
                    response.force_close()
                return response
            except RecursionError:  # a body nested just under the parser's limit, walked by a handler
                return _error(400, "request body: JSON nested too deeply")

        # lingering_time: after a 408 the rest of a stalled body is awaited 1 s at most, not aiohttp's 10 s
        app = web.Application(middlewares=[auth, errors], client_max_size=WEIGHTS_BODY_LIMIT,
                              handler_args={"lingering_time": 1.0})
        r = app.router
        r.add_post("/generate", self.generate)
        for path, fn in (("/health", self.health), ("/health_generate", self.health_generate),
                         ("/flush_cache", self.flush_cache), ("/model_info", self.model_info),
                         ("/get_model_info", self.model_info), ("/server_info", self.server_info),
                         ("/get_server_info", self.server_info), ("/get_weight_version", self.weight_version)):
            r.add_get(path, fn)
            r.add_post(path, fn)
        for path, fn in (("/abort_request", self.abort_request), ("/pause_generation", self.pause_generation),
                         ("/continue_generation", self.continue_generation),
                         ("/release_memory_occupation", self.release_memory),
                         ("/resume_memory_occupation", self.resume_memory)):
            r.add_post(path, fn)
        self.weights.add_to(r)
        app.on_shutdown.append(lambda _: asyncio.to_thread(self.engine.shutdown))
        return app


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: ``/proc``), or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as stat:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, after the name
        with open("/proc/uptime") as uptime:
            return float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def startup_text(parts: dict[str, float], age_s: float | None) -> str:
    """``ready after 24.1 s: waiting for the checkpoint 3.0 s, model 10.3 s, ...`` (what the rest, imports and
    the process's own start, took is the difference); empty without the age."""
    if age_s is None:
        return ""
    names = {"waited": "waiting for the checkpoint", "model": "model", "tokenizer": "tokenizer",
             "stable_memory": "stable memory", "warm_up": "warm-up"}
    shown = ", ".join(f"{names.get(k, k)} {v:.1f} s" for k, v in parts.items())
    return f"ready after {age_s:.1f} s" + (f": {shown}" if shown else "")


def serve(model_dir: str, config: EngineOptions, host: str = "127.0.0.1", port: int = 30000,
          waited_s: float | None = None, **kwargs: Any) -> None:
    """Run the server until interrupted (``rl-cli engine serve``; ``config`` and ``kwargs``: :class:`EngineServer`'s);
    ``waited_s``: how long the command waited for ``model_dir`` to appear (``--wait-for-model``; reported with the
    start's other parts)."""
    server = EngineServer(model_dir, config, host=host, port=port, **kwargs)
    server.startup_s = {**({"waited": waited_s} if waited_s is not None else {}), **server.startup_s}
    settle_heap()  # the model and its modules leave the collector; a request's objects die unscanned
    ready = startup_text(server.startup_s, process_age_s())
    weights = " (zero weights until the first push)" if kwargs.get("from_config") else ""
    print(f"posttrain engine serving {server.model_dir}{weights} on http://{host}:{port}"
          f"{'' if server.api_key else ' WITHOUT an API key (any local process may load weights into it)'}"
          f"{f' ({ready})' if ready else ''}", flush=True)
    web.run_app(server.app(), host=host, port=port, print=None, access_log=None, handler_cancellation=True,
                keepalive_timeout=config.request_timeout_s)
