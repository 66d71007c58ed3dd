"""The engine-backend contract: a live server of the backend speaks SGLang's protocol as posttrain uses it.

Subclass :class:`EngineContract` and supply an ``engine_backend`` fixture (an instance, configured to run
on this machine). The contract starts the backend's server (``launch(slot)``, as the fleet would) on a
tiny random Qwen3 checkpoint (:mod:`posttrain.testing.tiny`) once per test session, or uses the
backend's ``urls()`` when it gives running servers; a backend with ``waits_for_checkpoint`` is launched before
that checkpoint exists, which is then renamed into place (as a run does). It checks:

- ``/health``, ``/health_generate``, ``/model_info`` (``/get_model_info``) with ``model_path`` and
  ``tokenizer_path``, ``/server_info`` (``/get_server_info``): what the fleet, the generators and
  sglang-router read;
- ``/generate`` with one prompt and with a list: ``output_ids``, ``meta_info.output_token_logprobs`` as
  ``[logprob, token_id, None]`` triples, ``finish_reason`` (``stop`` or ``length``), ``weight_version``;
- greedy decoding equals HF ``transformers`` on the served checkpoint, with the same log-probs
  (``log_softmax(z)[token]``, to ``1e-3``), and repeats exactly; ``sampling_seed`` repeats a sampled answer;
  ``stop_token_ids`` stop (the stop token is the last output id); a bad request is a 4xx, not a crash;
- sglang-router fronts the server;
- (``disk`` in ``weight_sync_modes``) ``/update_weights_from_disk`` with other weights changes the
  log-probs to the new checkpoint's and reports the given ``weight_version`` (restored afterwards);
- (``starts_without_weights``, with ``disk``) a server started on the model's config and tokenizer alone
  serves the weights of its first update exactly.
"""

from __future__ import annotations

import json
import math
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from posttrain.testing.contracts.common import ComponentContract

PROMPTS = [[5, 6, 7, 8], [20, 21], [40, 41, 42, 43, 44, 45]]
_LIVE: dict[Any, "LiveEngine"] = {}  # (backend class, config) -> a server started once per session


@dataclass
class LiveEngine:
    """A running server of the backend under test: its URL and the checkpoint it serves."""

    url: str
    model_path: str
    workdir: Path
    server: Any = None  # a ManagedServer when the contract started it
    api_key: str | None = None  # the key every request carries (SGLang's Authorization: Bearer)

    def get(self, path: str) -> tuple[int, Any]:
        return _http(self.url + path, api_key=self.api_key)

    def post(self, path: str, payload: Any) -> tuple[int, Any]:
        return _http(self.url + path, payload, api_key=self.api_key)

    def generate(self, input_ids: Any, **sampling: Any) -> Any:
        status, body = self.post("/generate", {"input_ids": input_ids, "sampling_params": sampling,
                                               "return_logprob": True})
        assert status == 200, f"/generate answered HTTP {status}: {body}"
        return body


def _http(url: str, payload: Any = None, timeout: float = 120.0, api_key: str | None = None) -> tuple[int, Any]:
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw) if raw.strip() else None
    except ValueError:
        return status, raw.decode(errors="replace")


def _start(backend: Any, workdir: Path) -> LiveEngine:
    from posttrain.testing.tiny import make_tiny_checkpoint

    urls = backend.urls()
    if urls is not None:
        if not urls:
            pytest.skip(f"engine backend {backend.name!r} gives no running servers: configure their URLs")
        key = backend.api_key()
        status, info = _http(urls[0].rstrip("/") + "/model_info", api_key=key)
        assert status == 200 and isinstance(info, dict), f"{urls[0]}/model_info: HTTP {status}: {info}"
        return LiveEngine(urls[0].rstrip("/"), info["model_path"], workdir, api_key=key)
    ckpt = workdir / "tiny-qwen3"
    pending = bool(backend.waits_for_checkpoint)  # then launched first, as a run does, and the checkpoint renamed in
    log = workdir / "engine.log"
    server, key = _server(backend, ckpt, log, model_pending=pending)
    try:
        if pending:
            server.start(wait=False)
            make_tiny_checkpoint(f"{ckpt}.partial", "qwen3")
            os.replace(f"{ckpt}.partial", ckpt)
            server.wait_ready()
        else:
            make_tiny_checkpoint(ckpt, "qwen3")
            server.start()
    except Exception as exc:
        tail = log.read_text()[-3000:] if log.exists() else ""
        raise AssertionError(f"{backend.name}: the engine server did not become ready ({exc}); log:\n{tail}") from None
    return LiveEngine(server.base_url, str(ckpt), workdir, server, api_key=key)


def _server(backend: Any, model_path: Path, log: Path, **slot: Any) -> tuple[Any, str]:
    """``backend``'s server for engine 0 on ``model_path`` (``slot``: more ``EngineSlot`` fields), not started, and
    its API key."""
    import secrets

    from posttrain.core.config import ResourcesConfig
    from posttrain.core.rollout.backend import EngineSlot, gpu_ids
    from posttrain.core.rollout.procs import ManagedServer, free_port
    from posttrain.testing.engine import ENGINE_ENV

    resources, port = ResourcesConfig(), free_port()
    key = secrets.token_urlsafe(16)  # as the fleet makes one per run
    launch = backend.launch(EngineSlot(index=0, port=port, host="127.0.0.1", model_path=str(model_path), seed=0,
                                       resources=resources, api_key=key, **slot,
                                       gpus=gpu_ids(resources, 0) if backend.on_gpu(resources) else []))
    server = ManagedServer(launch.command, f"http://127.0.0.1:{port}", log_path=log, env={**ENGINE_ENV, **launch.env},
                           ready_timeout_s=300, health_path=launch.health_path)
    return server, key


def live_engine(backend: Any, request: Any, tmp_path_factory: Any) -> LiveEngine:
    """``backend``'s server, started once per pytest session per (backend class, config) and stopped at the
    session's end (``request``, ``tmp_path_factory``: the pytest fixtures)."""
    key = (type(backend), repr(backend.config))
    if key not in _LIVE:
        _LIVE[key] = live = _start(backend, tmp_path_factory.mktemp(f"engine-{backend.name}"))

        def stop():
            _LIVE.pop(key, None)
            if live.server is not None:
                live.server.stop()

        request.config.add_cleanup(stop)
    return _LIVE[key]


def _hf_log_probs(model_path: str, prompt: list[int], output: list[int]) -> list[float]:
    """``log_softmax(z)[token]`` of each output token under HF ``transformers`` on ``model_path``."""
    import torch

    model = _hf_model(model_path)
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


_HF: dict[str, Any] = {}


def _hf_model(path: str) -> Any:
    if path not in _HF:
        from transformers import AutoModelForCausalLM

        _HF[path] = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    return _HF[path]


def _tokens(answer: dict[str, Any]) -> tuple[list[int], list[float]]:
    triples = answer["meta_info"]["output_token_logprobs"]
    return [int(t[1]) for t in triples], [float(t[0]) for t in triples]


class EngineContract(ComponentContract):
    """Supply an ``engine_backend`` fixture (an instance of the backend, configured to run here)."""

    @pytest.fixture
    def component(self, engine_backend):
        return engine_backend

    @pytest.fixture
    def engine(self, engine_backend, request, tmp_path_factory) -> LiveEngine:
        return live_engine(engine_backend, request, tmp_path_factory)

    # ------------------------------------------------------------------ without a server
    def test_declares_weight_sync_modes(self, engine_backend):
        from posttrain.core.rollout.backend import WEIGHT_SYNC_MODES

        modes = tuple(engine_backend.weight_sync_modes)
        assert modes and set(modes) <= set(WEIGHT_SYNC_MODES), \
            f"weight_sync_modes {modes}: a non-empty subset of {WEIGHT_SYNC_MODES}"

    # ------------------------------------------------------------------ a live server
    def test_health_and_info_endpoints(self, engine):
        assert engine.get("/health")[0] == 200
        assert engine.get("/health_generate")[0] == 200
        for path in ("/model_info", "/get_model_info"):
            status, info = engine.get(path)
            assert status == 200 and isinstance(info, dict), f"{path}: HTTP {status}"
            assert (Path(info["model_path"]) / "config.json").is_file(), \
                f"{path}: model_path must be the served HF checkpoint directory (sglang-router loads it)"
            assert Path(info.get("tokenizer_path") or info["model_path"]).is_dir(), \
                f"{path}: generators load the tokenizer from tokenizer_path"
        for path in ("/server_info", "/get_server_info"):
            status, info = engine.get(path)
            assert status == 200 and isinstance(info, dict), f"{path}: HTTP {status}, a JSON object expected"

    def test_generate_answer_shape(self, engine):
        prompt = PROMPTS[0]
        out = engine.generate(prompt, temperature=0.0, max_new_tokens=6)
        assert {"text", "output_ids", "meta_info"} <= set(out), f"answer keys: {sorted(out)}"
        meta = out["meta_info"]
        triples = meta["output_token_logprobs"]
        assert 1 <= len(out["output_ids"]) <= 6
        assert all(len(t) == 3 and t[2] is None for t in triples), "output_token_logprobs: [logprob, id, None]"
        tokens, logprobs = _tokens(out)
        assert tokens == out["output_ids"], "output_token_logprobs covers output_ids, in order"
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs)
        reason = meta["finish_reason"]
        assert isinstance(reason, dict) and reason.get("type") in ("stop", "length"), f"finish_reason: {reason}"
        assert (reason["type"] == "length") == (len(tokens) == 6 and reason["type"] != "stop")
        assert isinstance(meta.get("weight_version"), str), "meta_info.weight_version: a string"

    def test_greedy_matches_transformers_and_repeats(self, engine):
        from posttrain.testing.engine import hf_greedy

        model = _hf_model(engine.model_path)
        for prompt in PROMPTS:
            out = engine.generate(prompt, temperature=0.0, max_new_tokens=8)
            tokens, logprobs = _tokens(out)
            expected = hf_greedy(model, prompt, 8)
            assert tokens == expected[:len(tokens)], f"greedy {tokens} != transformers {expected}"
            reference = _hf_log_probs(engine.model_path, prompt, tokens)
            assert max(abs(a - b) for a, b in zip(logprobs, reference)) < 1e-3, \
                "output_token_logprobs are log_softmax(logits)[token] of the served weights"
            again = engine.generate(prompt, temperature=0.0, max_new_tokens=8)
            assert _tokens(again)[0] == tokens, "greedy decoding repeats"

    def test_batched_request_matches_single_requests(self, engine):
        outs = engine.generate(PROMPTS, temperature=0.0, max_new_tokens=5)
        assert isinstance(outs, list) and len(outs) == len(PROMPTS), "a list of prompts gets a list of answers"
        for prompt, out in zip(PROMPTS, outs):
            single = engine.generate(prompt, temperature=0.0, max_new_tokens=5)
            assert _tokens(out)[0] == _tokens(single)[0], "batched and single greedy answers agree, in order"
            assert out["meta_info"]["prompt_tokens"] == len(prompt)

    def test_sampling_seed_repeats_a_sampled_answer(self, engine):
        params = dict(temperature=1.0, max_new_tokens=8)
        first = _tokens(engine.generate(PROMPTS[1], sampling_seed=1234, **params))[0]
        assert _tokens(engine.generate(PROMPTS[1], sampling_seed=1234, **params))[0] == first
        others = {tuple(_tokens(engine.generate(PROMPTS[1], sampling_seed=s, **params))[0]) for s in range(4)}
        assert len(others | {tuple(first)}) > 1, "different seeds draw different answers"

    def test_stop_token_ids_stop(self, engine):
        first = _tokens(engine.generate(PROMPTS[2], temperature=0.0, max_new_tokens=4))[0][0]
        out = engine.generate(PROMPTS[2], temperature=0.0, max_new_tokens=4, stop_token_ids=[first])
        assert out["output_ids"] == [first], "generation stops at a stop token (kept as the last output id)"
        assert out["meta_info"]["finish_reason"]["type"] == "stop"

    def test_bad_request_is_a_4xx_and_the_server_keeps_serving(self, engine):
        status, _ = engine.post("/generate", {"input_ids": PROMPTS[0], "sampling_params": {"temperature": -1.0}})
        assert 400 <= status < 500, f"a negative temperature: HTTP {status}, expected 4xx"
        status, _ = engine.post("/generate", {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": "x"}})
        assert 400 <= status < 500, f"a non-integer max_new_tokens: HTTP {status}, expected 4xx"
        assert engine.get("/health_generate")[0] == 200

    def test_sglang_router_fronts_it(self, engine):
        from posttrain.core.rollout.router import RouterProcess

        router = RouterProcess([engine.url], model_path=engine.model_path, log_path=engine.workdir / "router.log",
                               api_key=engine.api_key).start(timeout_s=120)
        try:
            status, out = _http(router.url + "/generate", {"input_ids": PROMPTS[0], "return_logprob": True,
                                                           "sampling_params": {"temperature": 0.0, "max_new_tokens": 4}},
                                api_key=engine.api_key)
        finally:
            router.stop()
        assert status == 200, f"through sglang-router: HTTP {status}: {out}"
        assert _tokens(out)[0] == _tokens(engine.generate(PROMPTS[0], temperature=0.0, max_new_tokens=4))[0]

    def test_weights_update_from_disk(self, engine, engine_backend, tmp_path):
        if "disk" not in engine_backend.weight_sync_modes:
            pytest.skip(f"{engine_backend.name} does not load weights from disk")
        import shutil

        import torch

        new_dir = tmp_path / "perturbed"
        model = _hf_model(engine.model_path)
        g = torch.Generator().manual_seed(0)
        state, seen = {}, set()
        for name, t in model.state_dict().items():  # tied tensors once: the checkpoint keeps them tied
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                state[name] = t + 0.5 * torch.randn(t.shape, generator=g)
        model.save_pretrained(str(new_dir), state_dict=state)
        for f in Path(engine.model_path).iterdir():  # tokenizer files: a checkpoint as a trainer writes it
            if f.is_file() and not f.name.endswith(".safetensors") and not (new_dir / f.name).exists():
                shutil.copy(f, new_dir / f.name)
        before = engine.generate(PROMPTS[0], temperature=0.0, max_new_tokens=4)
        old_version = before["meta_info"]["weight_version"]
        try:
            status, body = engine.post("/update_weights_from_disk", {"model_path": str(new_dir), "weight_version": "7"})
            assert status == 200 and body.get("success", True) is not False, f"update: HTTP {status}: {body}"
            after = engine.generate(PROMPTS[0], temperature=0.0, max_new_tokens=4)
            assert after["meta_info"]["weight_version"] == "7", "answers report the weight_version of the update"
            tokens, logprobs = _tokens(after)
            reference = _hf_log_probs(str(new_dir), PROMPTS[0], tokens)
            assert max(abs(a - b) for a, b in zip(logprobs, reference)) < 1e-3, "the new weights serve"
            old = _hf_log_probs(engine.model_path, PROMPTS[0], tokens)
            assert max(abs(a - b) for a, b in zip(logprobs, old)) > 1e-2, "the old weights no longer serve"
        finally:
            status, body = engine.post("/update_weights_from_disk", {"model_path": engine.model_path,
                                                                     "weight_version": old_version})
        assert status == 200, f"restoring the original weights: HTTP {status}: {body}"
        assert _tokens(engine.generate(PROMPTS[0], temperature=0.0, max_new_tokens=4)) == _tokens(before)

    def test_starts_without_weights_and_serves_its_first_push(self, engine, engine_backend, tmp_path):
        """``starts_without_weights``: a server launched with ``weights_from_push`` on a directory holding only
        ``config.json`` and the tokenizer (a run's ``hf-init``) answers its readiness check, and after one update
        that writes every weight serves them exactly (the update here: from disk)."""
        assert isinstance(engine_backend.starts_without_weights, bool), "starts_without_weights: True or False"
        if not engine_backend.starts_without_weights:
            return  # it reads its weights at start: a run writes them into hf-init for it
        if "disk" not in engine_backend.weight_sync_modes or engine.server is None:
            pytest.skip(f"{engine_backend.name}: no server of this contract's own, or no update from disk")
        import shutil

        files = tmp_path / "model-files"
        files.mkdir()
        for f in Path(engine.model_path).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                shutil.copy(f, files / f.name)
        server, key = _server(engine_backend, files, tmp_path / "engine.log", weights_from_push=True)
        try:
            server.start()
            live = LiveEngine(server.base_url, str(files), tmp_path, server, api_key=key)
            assert live.get("/health_generate")[0] == 200
            status, body = live.post("/update_weights_from_disk", {"model_path": engine.model_path,
                                                                   "weight_version": "1"})
            assert status == 200 and body.get("success", True) is not False, f"update: HTTP {status}: {body}"
            for prompt in PROMPTS:
                tokens, logprobs = _tokens(live.generate(prompt, temperature=0.0, max_new_tokens=6))
                reference = _hf_log_probs(engine.model_path, prompt, tokens)
                assert max(abs(a - b) for a, b in zip(logprobs, reference)) < 1e-3, "the pushed weights serve"
                assert tokens == _tokens(engine.generate(prompt, temperature=0.0, max_new_tokens=6))[0]
        finally:
            server.stop()
