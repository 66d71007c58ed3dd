"""The engine server against clients that would hog it: a stalled body, an idle connection, and a large batch in
front of a small request (admission is round-robin across requests)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from posttrain.core.rollout.client import EngineClient
from posttrain.plugins.engines.local.requests import FairQueue, Request
from posttrain.plugins.engines.local.sampling import parse_sampling
from posttrain.testing.engine import start_local_engine

TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def engine(tiny_ckpt, tmp_path_factory):
    server = start_local_engine(tiny_ckpt, tmp_path_factory.mktemp("logs"), max_running_requests=4,
                                request_timeout_s=TIMEOUT_S)
    yield server
    server.stop()


def _connect(url: str) -> socket.socket:
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _read_until_closed(sock: socket.socket, within: float) -> tuple[bytes, float]:
    start, data = time.monotonic(), b""
    sock.settimeout(within)
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def test_a_body_that_stalls_gets_408_and_its_connection_closed(engine):
    sock = _connect(engine.base_url)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
                 + f"Authorization: Bearer {engine.api_key}\r\n\r\n".encode() + b'{"input_ids": [1,')
    data, took = _read_until_closed(sock, 4 * TIMEOUT_S)
    assert data.startswith(b"HTTP/1.1 408") and b"not received within 2 s" in data, data[:300]
    assert TIMEOUT_S * 0.9 < took < 3 * TIMEOUT_S


def test_an_idle_connection_is_closed(engine):
    sock = _connect(engine.base_url)
    data, took = _read_until_closed(sock, 6 * TIMEOUT_S)
    assert data == b"" and took < 4 * TIMEOUT_S


async def test_a_small_request_is_not_starved_by_a_large_batch(engine):
    long = {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True}
    async with EngineClient(engine.base_url, api_key=engine.api_key) as client:
        start = time.monotonic()
        batch = asyncio.create_task(client.request("POST", "/generate", {"input_ids": [[5, 6, 7]] * 24,
                                                                          "sampling_params": long}))  # 6 waves
        await asyncio.sleep(0.3)
        small_start = time.monotonic()
        await client.generate(input_ids=[9, 9], sampling_params={"temperature": 0.0, "max_new_tokens": 2})
        small_s = time.monotonic() - small_start
        await batch
        batch_s = time.monotonic() - start
    # first-come-first-served would admit it after 20 of the batch's rows (5 of its 6 waves: ~80% of its time)
    assert small_s < 0.4 * batch_s, (small_s, batch_s)


def test_the_queue_admits_round_robin_across_submissions_and_in_order_within_one():
    sampling = parse_sampling({})
    rows = lambda tag, n: [Request(f"{tag}{i}", [1], sampling, False, lambda _: None, -1) for i in range(n)]  # noqa: E731
    q = FairQueue()
    q.add(rows("a", 4))
    q.add(rows("b", 1))
    q.add(rows("c", 2))
    assert len(q) == 7 and [r.rid for r in q] == ["a0", "a1", "a2", "a3", "b0", "c0", "c1"]
    order = [q.popleft().rid for _ in range(3)]
    q.add(rows("d", 1))
    order += [q.popleft().rid for _ in range(len(q))]
    assert order == ["a0", "b0", "c0", "a1", "c1", "d0", "a2", "a3"] and not q
    q.add(rows("e", 3))
    next(iter(q)).finish = {"type": "abort"}
    q.drop_finished()
    assert [r.rid for r in q] == ["e1", "e2"] and len(q) == 2
