"""Unit-test fixtures: tiny HF checkpoints built in code (``tiny_ckpt``, ``tiny_ckpts``), HF's model of the Qwen3
one, a local engine server subprocess, a scripted SGLang-protocol engine, and one Megatron parallel state per test
process. Session fixtures are built on first use, so a test that needs none of them pays nothing."""

from __future__ import annotations

import os

import pytest
from aiohttp import web

from posttrain.testing.engine import start_local_engine

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from posttrain.testing.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3", family="qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_b(tmp_path_factory):
    """Same shape, other random weights (the 'trained' weights of the weight-update tests)."""
    from posttrain.testing.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_b") / "qwen3", family="qwen3", seed=1)


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory):
    """``family -> HF checkpoint dir`` (qwen3, qwen2, llama, glm4, qwen3_moe, glm4_moe, deepseek_v3), made once per session
    on demand."""
    from posttrain.testing.tiny import make_tiny_checkpoint

    made = {}

    def get(family: str):
        if family not in made:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            made[family] = make_tiny_checkpoint(out, family)
        return made[family]

    return get


@pytest.fixture(scope="session")
def megatron_tp1():
    """torch.distributed (gloo, one process) + Megatron parallel state with TP=1, for the whole session."""
    import torch

    torch.set_num_threads(1)
    from posttrain.plugins.trainers.megatron.model import init_parallel

    init_parallel(1, 1, seed=0)
    yield


@pytest.fixture(scope="session")
def hf_model(tiny_ckpt):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def engine_server(tiny_ckpt, tmp_path_factory):
    server = start_local_engine(tiny_ckpt, tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def engine_url(engine_server):
    return engine_server.base_url


@pytest.fixture(scope="session")
def engine_key(engine_server):
    """The session engine's API key (every endpoint but /health* needs it)."""
    return engine_server.api_key


class ScriptedEngine:
    """SGLang-protocol /generate answering from a script (one entry per call), recording the inputs."""

    def __init__(self, tokenizer, model_path, script):
        self.tokenizer, self.model_path, self.script, self.inputs = tokenizer, model_path, list(script), []

    async def generate(self, request):
        body = await request.json()
        self.inputs.append(body["input_ids"])
        text = self.script.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return web.json_response({"text": text, "output_ids": ids, "meta_info": {
            "id": "x", "finish_reason": {"type": "stop", "matched": "</tool_call>"}, "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids), "weight_version": "2",
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}})

    async def model_info(self, request):
        return web.json_response({"model_path": self.model_path, "tokenizer_path": self.model_path})


@pytest.fixture
async def scripted(tiny_ckpt):
    from transformers import AutoTokenizer

    from posttrain.core.rollout.client import EngineClient
    from posttrain.core.rollout.procs import free_port

    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt))
    holder = {}

    async def start(script):
        eng = ScriptedEngine(tok, str(tiny_ckpt), script)
        app = web.Application()
        app.router.add_post("/generate", eng.generate)
        app.router.add_get("/get_model_info", eng.model_info)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        holder["runner"] = runner
        return eng, EngineClient(f"http://127.0.0.1:{port}"), tok

    yield start
    if "runner" in holder:
        await holder["runner"].cleanup()
