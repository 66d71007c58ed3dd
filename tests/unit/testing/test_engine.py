"""The tests' engine helper survives a port taken between ``free_port()`` and the engine's bind (two xdist
workers starting engines at once): it starts again on a fresh port instead of failing the test."""

from __future__ import annotations

import socket

from posttrain.core.rollout import procs
from posttrain.testing.engine import start_local_engine


def test_a_port_taken_before_the_bind_gets_a_fresh_one(tiny_ckpt, tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    real, first = procs.free_port, iter([busy])  # the first port handed out is already taken
    monkeypatch.setattr(procs, "free_port", lambda host="127.0.0.1": next(first, None) or real(host))
    server = start_local_engine(tiny_ckpt, tmp_path)
    try:
        assert not server.base_url.endswith(f":{busy}")
        assert "address already in use" in (tmp_path / f"engine-{busy}.log").read_text()
    finally:
        server.stop()
        taken.close()
