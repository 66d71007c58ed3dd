"""The real sglang-router in front of two local engines: SGLang's response shape, runtime registration,
and every request answered when one engine is killed mid-run."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from posttrain.core.rollout.client import EngineClient
from posttrain.core.rollout.router import RouterProcess
from posttrain.testing.engine import hf_greedy, start_local_engine as start_engine


@pytest.mark.slow
async def test_router_routes_generate_and_survives_a_dead_engine(engine_url, engine_key, tiny_ckpt, hf_model, tmp_path):
    victim = start_engine(tiny_ckpt, str(tmp_path), api_key=engine_key)  # the router has one key for all
    router = RouterProcess([engine_url], model_path=str(tiny_ckpt), log_path=tmp_path / "router.log",
                           api_key=engine_key)
    try:
        await asyncio.to_thread(router.start, 90)
        await asyncio.to_thread(router.add_worker, victim.base_url)  # registered at run time
        assert {w["url"] for w in router.workers()} == {engine_url, victim.base_url}

        greedy = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
        async with EngineClient(router.url, max_retries=5, api_key=engine_key) as client:
            out = await client.generate(input_ids=[5, 6, 7], sampling_params=greedy)
            assert set(out) >= {"text", "output_ids", "meta_info"}
            assert set(out["meta_info"]) >= {"id", "finish_reason", "prompt_tokens", "completion_tokens",
                                             "weight_version", "output_token_logprobs"}
            assert out["output_ids"] == hf_greedy(hf_model, [5, 6, 7], 8)

            long = {"temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True}
            tasks = [asyncio.create_task(client.generate(input_ids=[5 + i, 6], sampling_params=long))
                     for i in range(16)]
            async with EngineClient(victim.base_url, api_key=engine_key) as direct:  # kill it while it holds requests
                for _ in range(200):
                    state = (await direct.get_server_info())["internal_states"][0]
                    if state["num_requests"] > 0:
                        break
                    await asyncio.sleep(0.01)
            assert state["num_requests"] > 0, "the router sent nothing to the second engine"
            os.killpg(victim.proc.pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        assert all(r["meta_info"]["completion_tokens"] == 200 for r in results)
    finally:
        router.stop()
        victim.stop()


@pytest.mark.slow
def test_a_router_whose_port_was_taken_starts_again_on_fresh_ports(engine_url, engine_key, tiny_ckpt, tmp_path):
    """Its ports come from ``free_port`` moments before it binds them: when another process took one meanwhile
    (here: its metrics port, held by a socket), the router exits with "Address already in use" and starts again."""
    import socket

    router = RouterProcess([engine_url], model_path=str(tiny_ckpt), log_path=tmp_path / "router.log", api_key=engine_key)
    with socket.socket() as taken:
        taken.bind((router.host, 0))
        taken.listen()
        router.prometheus_port = taken.getsockname()[1]
        try:
            router.start(90)
            assert router.prometheus_port != taken.getsockname()[1]
            assert [w["url"] for w in router.workers()] == [engine_url]
        finally:
            router.stop()
    assert "Address already in use" in (tmp_path / "router.log").read_text()


def test_router_command_line():
    r = RouterProcess(["http://127.0.0.1:1/", "http://127.0.0.1:2"], port=3000, model_path="/m",
                      extra_args=["--retry-max-retries", "7"])
    cmd = r.command()
    assert cmd[1:3] == ["-m", "sglang_router.launch_router"]
    keyed = RouterProcess(["http://127.0.0.1:1"], api_key="s3cret-key").command()
    assert keyed[1:3] == ["-m", "posttrain.core.rollout.router"]  # reads the key from its environment
    assert not any("s3cret" in a for a in keyed) and "--api-key" not in keyed
    with pytest.raises(ValueError, match="--api-key"):
        RouterProcess([], extra_args=["--api-key", "x"])
    i = cmd.index("--worker-urls")
    assert cmd[i + 1:i + 3] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert cmd[cmd.index("--port") + 1] == "3000" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--model-path") + 1] == "/m" and cmd[-2:] == ["--retry-max-retries", "7"]


def test_a_router_that_exits_while_starting_is_one_line_naming_its_log(tmp_path):
    """The real router, given an argument it does not know, exits at once: the start is a RunFailed (one line, exit
    code 1) with how it ended, its log and the log's last line (the router's own complaint); nothing is left."""
    from posttrain.core.errors import RunFailed

    router = RouterProcess(["http://127.0.0.1:1"], log_path=tmp_path / "router.log", extra_args=["--no-such-flag"])
    with pytest.raises(RunFailed) as caught:
        router.start(timeout_s=60)
    text = str(caught.value)
    assert caught.value.exit_code == 1 and "\n" not in text
    assert text.startswith("router: process exited with code ") and f"its log: {tmp_path / 'router.log'}: " in text
    assert "--no-such-flag" in text.split("its log: ")[1], text  # the router's last line names what it refused
    assert router.proc is None
