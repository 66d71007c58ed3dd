"""An SGLang-protocol engine server over plain HF ``transformers``: what the ``hf_generate`` backend starts.

``python -m posttrain_thirdparty.hf_server MODEL_DIR --port P [--host H] [--device cpu] [--max-batch-size N]``

Endpoints (paths, bodies and answers as SGLang's ``http_server``; what posttrain's client and
sglang-router use):

- ``POST /generate`` ``{input_ids | text, sampling_params, return_logprob, rid}``, one prompt or a list
  -> ``{text, output_ids, meta_info: {id, finish_reason: {type: stop|length, ...}, prompt_tokens,
  completion_tokens, weight_version, output_token_logprobs: [[logprob, token_id, null], ...]}}``
  (a list for a list). ``sampling_params``: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
  ``max_new_tokens``, ``stop_token_ids``, ``sampling_seed``, ``ignore_eos``, ``skip_special_tokens``;
  anything else is HTTP 400.
- ``GET /health``, ``GET /health_generate`` (a one-token generation), ``GET /model_info``
  (``/get_model_info``), ``GET /server_info`` (``/get_server_info``), ``GET /get_weight_version``,
  ``POST /flush_cache``;
- ``POST /update_weights_from_disk {model_path, weight_version}``: the safetensors of an HF checkpoint
  directory replace the weights (names must match; the tied ``lm_head`` may be absent).

Generation is HF's forward pass with its KV cache (``past_key_values``), a batch at a time: requests that
arrive while a batch decodes wait for the next one (no continuous batching). Prompts are left-padded with
an attention mask and position ids. Each row samples with its own ``torch.Generator``:

- greedy (``temperature == 0`` or ``top_k == 1``): ``argmax z``, log-prob ``log_softmax(z)[token]``;
- else ``p = softmax(z / T)``, truncated to ``top_k`` / ``top_p`` / ``min_p`` and renormalized; the
  reported log-prob is ``log_softmax(z / T)[token]`` before truncation (as SGLang reports it).

A row with ``sampling_seed`` ``s`` seeds its generator with ``s``; in a list request whose one shared
``sampling_params`` carries ``s``, row ``j`` gets ``s + j`` (so a group's samples differ), as posttrain's
local engine does. A seeded row's draws depend on nothing but its seed and its logits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "stop_token_ids": None,
    "sampling_seed": None, "ignore_eos": False, "skip_special_tokens": True, "no_stop_trim": False,
}
# /generate fields honoured here. sglang-router re-sends every GenerateReqInput field, so the others are
# accepted when they are off (None, false, 0, -1, empty) or at their default; anything else is HTTP 400.
GENERATE_KEYS = {"text", "input_ids", "sampling_params", "return_logprob", "rid"}
OFF_VALUES = (None, False, 0, -1, "", [], {})
DEFAULT_OK = {"log_metrics": True}


class BadRequest(ValueError):
    """Answered with HTTP 400 ``{"error": {"message": ...}}``; the server keeps serving."""


@dataclass
class Row:
    """One prompt of a request, decoded as one row of a batch."""

    prompt: list[int]
    params: dict[str, Any]
    return_logprob: bool
    rid: str
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.params["temperature"] == 0.0 or self.params["top_k"] == 1


def parse_sampling(raw: Any) -> dict[str, Any]:
    """SGLang ``sampling_params`` validated into a full dict; :class:`BadRequest` names the bad key."""
    raw = {k: v for k, v in (raw or {}).items() if v is not None} if isinstance(raw, dict) else raw
    if not isinstance(raw, dict):
        raise BadRequest(f"sampling_params: expected an object, got {type(raw).__name__}")
    if raw.get("stop"):
        raise BadRequest("sampling_params.stop: stop strings are not supported by hf_generate; use stop_token_ids")
    unknown = sorted(k for k in raw if k not in SAMPLING_DEFAULTS and k != "stop")
    if unknown:
        raise BadRequest(f"sampling_params: unknown field(s) {', '.join(unknown)}")
    p = {**SAMPLING_DEFAULTS, **raw}
    for key in ("max_new_tokens", "top_k"):
        if isinstance(p[key], bool) or not isinstance(p[key], int):
            raise BadRequest(f"sampling_params.{key}: expected an integer, got {p[key]!r}")
    for key in ("temperature", "top_p", "min_p"):
        if isinstance(p[key], bool) or not isinstance(p[key], (int, float)):
            raise BadRequest(f"sampling_params.{key}: expected a number, got {p[key]!r}")
        p[key] = float(p[key])
    if p["max_new_tokens"] < 0 or p["temperature"] < 0 or not 0 < p["top_p"] <= 1 or not 0 <= p["min_p"] <= 1:
        raise BadRequest("sampling_params: need max_new_tokens >= 0, temperature >= 0, 0 < top_p <= 1, "
                         "0 <= min_p <= 1")
    if p["top_k"] == 0 or p["top_k"] < -1:
        raise BadRequest(f"sampling_params.top_k: must be -1 (off) or >= 1, got {p['top_k']}")
    ids = p["stop_token_ids"] or []
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise BadRequest("sampling_params.stop_token_ids: expected a list of integers")
    p["stop_token_ids"] = ids
    seed = p["sampling_seed"]
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"sampling_params.sampling_seed: expected an integer, got {seed!r}")
    return p


def pick(logits: torch.Tensor, row: Row) -> tuple[int, float]:
    """One token of ``row`` from its next-token ``logits [V]`` (float32) and its log-prob."""
    p = row.params
    if row.greedy:
        logp = torch.log_softmax(logits, -1)
        token = int(logits.argmax())
        return token, float(logp[token])
    logp = torch.log_softmax(logits / p["temperature"], -1)
    probs = logp.exp()
    if p["top_k"] > 0 or p["top_p"] < 1.0 or p["min_p"] > 0.0:
        ordered, order = probs.sort(descending=True)
        keep = torch.ones_like(ordered, dtype=torch.bool)
        if p["top_k"] > 0:
            keep[p["top_k"]:] = False
        keep &= (ordered.cumsum(0) - ordered) <= p["top_p"]  # mass strictly above each token
        keep &= ordered >= p["min_p"] * ordered[0]
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order, ordered * keep)
    token = int(torch.multinomial(probs, 1, generator=row.generator))
    return token, float(logp[token])


class HFGenerator:
    """An ``AutoModelForCausalLM`` decoding batches of rows; weights replaceable between batches."""

    def __init__(self, model_dir: str, device: str = "cpu"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir, self.device = str(Path(model_dir).resolve()), torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype="auto").to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        eos = self.model.config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer.eos_token_id is not None:
            self.eos.add(self.tokenizer.eos_token_id)
        self.vocab_size = int(self.model.config.vocab_size)
        self.context_length = int(getattr(self.model.config, "max_position_embeddings", 4096))
        self.weight_version = "0"
        self.lock = threading.Lock()  # one batch or one weight update at a time

    @torch.no_grad()
    def decode(self, rows: list[Row]) -> None:
        """Fill every row's ``output``, ``logprobs`` and ``finish``."""
        with self.lock:
            width = max(len(r.prompt) for r in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for i, r in enumerate(rows):  # left padding: every row's next token is the last column
                ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
                mask[i, width - len(r.prompt):] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            cache = None
            live = [r for r in rows if not self._finished(r)]
            while live:
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                                 use_cache=True)
                cache, logits = out.past_key_values, out.logits[:, -1].float().cpu()
                step = torch.zeros(len(rows), dtype=torch.long)
                for i, r in enumerate(rows):
                    if r.finish is None:
                        token, lp = pick(logits[i], r)
                        r.output.append(token)
                        r.logprobs.append(lp)
                        step[i] = token
                        self._finished(r)
                live = [r for r in rows if r.finish is None]
                ids = step[:, None].to(self.device)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                positions = positions[:, -1:] + 1

    def _finished(self, r: Row) -> bool:
        p, n = r.params, len(r.output)
        if n and (r.output[-1] in p["stop_token_ids"] or (not p["ignore_eos"] and r.output[-1] in self.eos)):
            r.finish = {"type": "stop", "matched": r.output[-1]}
        elif n >= p["max_new_tokens"] or len(r.prompt) + n >= self.context_length:
            r.finish = {"type": "length", "length": n}
        return r.finish is not None

    def load(self, path: str) -> int:
        """Replace the weights with ``path``'s safetensors (an HF checkpoint directory); tensors loaded."""
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise BadRequest(f"model_path: no *.safetensors files in {path}")
        named: dict[str, torch.Tensor] = {}
        for f in files:
            named.update(load_file(str(f)))
        own = self.model.state_dict()
        unknown = sorted(set(named) - set(own))
        missing = sorted(set(own) - set(named) - ({"lm_head.weight"} if self.model.config.tie_word_embeddings else set()))
        if unknown or missing:
            raise BadRequest(f"update_weights_from_disk: unknown tensors {unknown[:3]}, missing {missing[:3]}")
        bad = [n for n, t in named.items() if t.shape != own[n].shape]
        if bad:
            raise BadRequest(f"update_weights_from_disk: {bad[0]} has shape {tuple(named[bad[0]].shape)}, "
                             f"the model {tuple(own[bad[0]].shape)}")
        with self.lock, torch.no_grad():
            for name, tensor in named.items():
                own[name].copy_(tensor)
        return len(named)


class Server:
    """The aiohttp application: requests queue up; one task hands batches of rows to the generator."""

    def __init__(self, generator: HFGenerator, host: str, port: int, max_batch_size: int = 256):
        self.gen, self.host, self.port, self.max_batch_size = generator, host, port, max_batch_size
        self.queue: asyncio.Queue | None = None
        self.count = 0

    async def _run(self, rows: list[Row]) -> list[Row]:
        done = asyncio.get_running_loop().create_future()
        await self.queue.put((rows, done))
        return await done

    async def _batcher(self, app: web.Application) -> Any:
        self.queue = asyncio.Queue()

        async def loop():
            while True:
                waiting = [await self.queue.get()]
                while not self.queue.empty() and sum(len(r) for r, _ in waiting) < self.max_batch_size:
                    waiting.append(self.queue.get_nowait())
                try:
                    await asyncio.to_thread(self.gen.decode, [row for rows, _ in waiting for row in rows])
                except Exception as exc:  # a failed batch fails its requests, not the server
                    for _, fut in waiting:
                        fut.done() or fut.set_exception(exc)
                    continue
                for rows, fut in waiting:
                    fut.done() or fut.set_result(rows)

        task = asyncio.ensure_future(loop())
        yield
        task.cancel()

    def _answer(self, r: Row) -> dict[str, Any]:
        text = self.gen.tokenizer.decode(r.output, skip_special_tokens=r.params["skip_special_tokens"])
        meta = {"id": r.rid, "finish_reason": r.finish, "prompt_tokens": len(r.prompt),
                "completion_tokens": len(r.output), "cached_tokens": 0, "weight_version": self.gen.weight_version}
        if r.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.logprobs, r.output)]
        return {"text": text, "output_ids": list(r.output), "meta_info": meta}

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

    async def generate(self, request: web.Request) -> web.Response:
        body = await _json(request)
        extra = sorted(k for k in body if k not in GENERATE_KEYS and body[k] not in OFF_VALUES
                       and not (k in DEFAULT_OK and body[k] == DEFAULT_OK[k]))
        if extra:
            raise BadRequest(f"unknown or unsupported field(s): {', '.join(extra)}")
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("give exactly one of `text` and `input_ids`")
        batched = isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
        prompts = (text if text is not None else ids) if batched else [text if text is not None else ids]
        if not prompts:
            raise BadRequest("empty batch")
        n, sp = len(prompts), body.get("sampling_params")
        params = [parse_sampling(s) for s in sp] if isinstance(sp, list) else [parse_sampling(sp)] * n
        if len(params) != n:
            raise BadRequest(f"sampling_params: {len(params)} entries for {n} prompts")
        if batched and not isinstance(sp, list) and params[0]["sampling_seed"] is not None:
            params = [{**p, "sampling_seed": p["sampling_seed"] + j} for j, p in enumerate(params)]
        return_logprob = body.get("return_logprob", False)
        if not isinstance(return_logprob, bool):
            raise BadRequest("return_logprob: expected true or false")
        rids = body.get("rid") if isinstance(body.get("rid"), list) else [body.get("rid")] * n
        rows = []
        for prompt, p, rid in zip(prompts, params, rids):
            self.count += 1
            gen = torch.Generator().manual_seed(p["sampling_seed"] if p["sampling_seed"] is not None
                                                else int(torch.randint(0, 2**62, ()).item()))
            rows.append(Row(self._prompt(prompt if text is not None else None, prompt if ids is not None else None),
                            p, return_logprob, str(rid or self.count), generator=gen))
        outs = [self._answer(r) for r in await self._run(rows)]
        return web.json_response(outs if batched else outs[0])

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        await self._run([Row([0], parse_sampling({"max_new_tokens": 1, "temperature": 0}), False, "health")])
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.gen.model.config
        return web.json_response({"model_path": self.gen.model_dir, "tokenizer_path": self.gen.model_dir,
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": self.gen.weight_version, "model_type": cfg.model_type,
                                  "architectures": getattr(cfg, "architectures", None)})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.gen.model_dir, "tokenizer_path": self.gen.model_dir,
                                  "host": self.host, "port": self.port, "device": str(self.gen.device),
                                  "tp_size": 1, "dp_size": 1, "context_length": self.gen.context_length,
                                  "max_running_requests": self.max_batch_size, "version": "hf-generate",
                                  "weight_version": self.gen.weight_version, "internal_states": [{}]})

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.gen.weight_version})

    async def flush_cache(self, request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.\n")  # no cache outlives a batch

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _json(request)
        path = body.get("model_path")
        if not isinstance(path, str):
            raise BadRequest("model_path: expected a directory path")
        count = await asyncio.to_thread(self.gen.load, path)
        version = body.get("weight_version")
        current = self.gen.weight_version
        self.gen.weight_version = str(version) if version is not None else (
            str(int(current) + 1) if current.isdigit() else "1")
        return web.json_response({"success": True, "num_paused_requests": 0,
                                  "message": f"Succeeded to update model weights: {count} tensors "
                                             f"(version {self.gen.weight_version})"})

    def app(self) -> web.Application:
        @web.middleware
        async def errors(request: web.Request, handler):
            try:
                return await handler(request)
            except BadRequest as exc:
                return web.json_response({"error": {"message": str(exc)}, "success": False, "message": str(exc)},
                                         status=400)

        app = web.Application(middlewares=[errors], client_max_size=1 << 28)
        app.cleanup_ctx.append(self._batcher)
        r = app.router
        for path, fn in (("/health", self.health), ("/health_generate", self.health_generate),
                         ("/model_info", self.model_info), ("/get_model_info", self.model_info),
                         ("/server_info", self.server_info), ("/get_server_info", self.server_info),
                         ("/get_weight_version", self.weight_version), ("/flush_cache", self.flush_cache)):
            r.add_get(path, fn)
            r.add_post(path, fn)
        r.add_post("/generate", self.generate)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        return app


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read() or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body: malformed JSON ({exc})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body: expected a JSON object, got {type(body).__name__}")
    return body


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="SGLang-protocol server over HF transformers")
    parser.add_argument("model_dir")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="seeds the draws of requests without sampling_seed")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    server = Server(HFGenerator(args.model_dir, args.device), args.host, args.port, args.max_batch_size)
    print(f"hf_generate serving {server.gen.model_dir} on http://{args.host}:{args.port}", flush=True)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
