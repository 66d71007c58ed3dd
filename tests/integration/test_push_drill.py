"""Drill: the engine is killed in the middle of a weight push, five times; the run must always go on.

Real parts throughout: the Megatron trainer role (CPU), a local engine behind the real sglang-router
(the fleet of the quickstart config), the Gloo weight-update group, and the loop's own push
(``posttrain.core.rollout.supervise.push_weights``). The only instrument is where the kill happens: the
trainer's bucket stream SIGKILLs the engine after its first bucket went out, so every drill kills
mid-push, not at a guessed moment. On the third drill the engine's port is taken while it is down, so
the fleet must restart it on a fresh port. After each push a generation through the router must answer
with the pushed weight version within a bounded time.
"""

import asyncio
import os
import signal
import socket
import time

import pytest

from tests.integration.test_loop import QUICKSTART, SMALL

pytestmark = pytest.mark.slow


def test_engine_killed_during_the_push_five_times_never_hangs_the_run(tmp_path):
    from posttrain.core.actors.engines import EngineRole
    from posttrain.core.actors.trainer import TrainerRole
    from posttrain.core.config import load_config
    from posttrain.core.rollout.supervise import push_weights

    cfg = load_config(QUICKSTART, [*SMALL, "rollout.weight_sync_timeout_s=5", "rollout.max_new_tokens=4",
                                      "rollout.use_router=true"])  # the drill checks what the router holds
    trainer = TrainerRole(cfg.to_dict())
    init_dir = trainer.save_hf(str(tmp_path / "hf-init"))
    engines = EngineRole(cfg.to_dict(), init_dir, str(tmp_path / "logs"))
    fleet = engines.fleet
    trainer.connect_engines(engines.urls()[1], api_key=engines.api_key())
    real_export, drill = trainer.policy.export_hf, {"kill": False, "squat": None}

    def export_killing_the_engine(bucket_bytes):
        named = [t for bucket in real_export(bucket_bytes) for t in bucket]
        yield named[:4]  # the first bucket reaches the engine ...
        if drill["kill"]:  # ... then it dies, with the rest of the push still to come
            drill["kill"] = False
            server = fleet.servers[0]
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)
            if drill["squat"] is not None:  # its port is taken before it can come back
                drill["squat"].setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
                drill["squat"].bind(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1])))
                drill["squat"].listen()
        for i in range(4, len(named), 4):
            yield named[i:i + 4]

    trainer.policy.export_hf = export_killing_the_engine

    async def generate():
        async with fleet.client() as client:
            return await asyncio.wait_for(client.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2}), 60)

    started, urls = time.monotonic(), []
    try:
        for version in range(1, 6):
            drill["kill"] = True
            drill["squat"] = socket.socket() if version == 3 else None
            t0 = time.monotonic()
            restarted, *_ = push_weights(trainer, engines, version, str(tmp_path / "hf-latest"))
            assert len(restarted) == 1, f"drill {version}: the killed engine was not restarted"
            out = asyncio.run(generate())
            assert out["meta_info"]["weight_version"] == str(version), f"drill {version}: the push did not land"
            # bounded: an engine restart and a retried push, never the 600 s HTTP timeout of before
            assert time.monotonic() - t0 < 120, f"drill {version} took {time.monotonic() - t0:.0f} s"
            print(f"drill {version}: {time.monotonic() - t0:.1f} s", flush=True)
            urls.append(fleet.engine_urls[0])
            if drill["squat"] is not None:
                drill["squat"].close()
        assert urls[2] != urls[1], "the engine whose port was taken must come back on a fresh port"
        assert fleet.router is not None and [w["url"] for w in fleet.router.workers()] == [urls[-1]]
        print(f"5 drills: {time.monotonic() - started:.1f} s", flush=True)
    finally:
        trainer.close()
        engines.close()
