"""The remote reward against a live HTTP server on 127.0.0.1 that fails, hangs and recovers."""

import asyncio
import socket

import pytest
from aiohttp import web

from posttrain.core.selection import Selection
from posttrain.core.plugins import load_plugins
from posttrain.core.rewards import RewardError, RewardRunner
from posttrain.core.types import Sample, SampleStatus

PLUGINS = load_plugins()
Remote = PLUGINS.rewards["remote"]


class Server:
    """A reward server: score 1.0 when response == label. ``plan`` scripts the next answers."""

    def __init__(self):
        self.plan: list[str] = []  # "500", "hang", "garbage", "404"; empty = answer normally
        self.requests, self.in_flight, self.max_in_flight = [], 0, 0
        self.delay = 0.0

    async def handle(self, request):
        body = await request.json()
        self.requests.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            action = self.plan.pop(0) if self.plan else "ok"
            if action == "hang":
                await asyncio.sleep(30)
            if action in ("500", "404"):
                return web.Response(status=int(action), text="nope")
            if action == "garbage":
                return web.Response(text="<html>")
            await asyncio.sleep(self.delay)
            return web.json_response({"score": float(body["response"] == body["label"]), "judge_len": 3})
        finally:
            self.in_flight -= 1


@pytest.fixture
async def server():
    srv = Server()
    app = web.Application()
    app.router.add_post("/reward", srv.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a free port on loopback only
    site = web.SockSite(runner, sock)
    await site.start()
    srv.url = f"http://127.0.0.1:{sock.getsockname()[1]}/reward"
    yield srv
    await runner.cleanup()


def make(url, **kw):
    kw = {"timeout": 0.3, "retries": 2, "backoff": 0.01, "backoff_max": 0.02, **kw}
    return Remote(Remote.Config(url=url, **kw))


def sample(response="4", label="4", i=0):
    return Sample(prompt=[{"role": "user", "content": "2+2?"}], response=response, label=label,
                  metadata={"task": "add"}, index=i)


async def test_posts_the_sample_and_reads_the_score(server):
    reward = make(server.url)
    assert await reward(sample()) == {"score": 1.0, "judge_len": 3.0, "failed": 0.0}
    assert await reward(sample("5")) == {"score": 0.0, "judge_len": 3.0, "failed": 0.0}
    assert server.requests[0] == {"prompt": [{"role": "user", "content": "2+2?"}], "response": "4", "label": "4",
                                  "metadata": {"task": "add"}}
    await reward.aclose()


async def test_failures_then_recovery_are_retried(server):
    reward = make(server.url)
    server.plan = ["500", "hang"]  # a server error, then a hang past the timeout, then it recovers
    assert (await reward(sample()))["score"] == 1.0 and len(server.requests) == 3 and reward.failures == 0
    await reward.aclose()


async def test_after_the_last_retry_the_failure_reward_is_given_and_counted(server):
    reward = make(server.url, failure_reward=-1.0)
    server.plan = ["hang", "hang", "hang"]
    assert await reward(sample()) == {"score": -1.0, "failed": 1.0}
    assert reward.failures == 1 and len(server.requests) == 3
    server.plan = ["404"]  # a client error is not retried
    assert (await reward(sample()))["failed"] == 1.0 and len(server.requests) == 4
    server.plan = ["garbage"]
    assert (await reward(sample()))["failed"] == 1.0 and reward.failures == 3
    await reward.aclose()


async def test_server_down_and_on_error_raise(server):
    dead = server.url.replace(server.url.split(":")[2].split("/")[0], "1")  # port 1: nothing listens
    reward = make(dead, retries=1)
    assert (await reward(sample()))["failed"] == 1.0
    raising = make(server.url, on_error="raise", retries=0)
    server.plan = ["500"]
    with pytest.raises(RuntimeError, match="failed for sample 0 after 1 attempt.*HTTP 500"):
        await raising(sample())
    await reward.aclose()
    await raising.aclose()


async def test_through_the_runner_concurrency_and_metrics(server):
    server.delay = 0.05
    comp = Selection("rewards", "remote", Remote.Config(url=server.url, concurrency=3, timeout=2.0), 1.0)
    runner = RewardRunner([comp], PLUGINS, concurrency=64)
    groups = [[sample(str(i % 2), "0", i) for i in range(j * 4, j * 4 + 4)] for j in range(3)]
    server.plan = ["500"]
    metrics = await runner.score_groups(groups)
    await runner.aclose()
    assert server.max_in_flight <= 3 and len(server.requests) == 13
    assert metrics["reward/remote"] == 0.5 and metrics["reward/remote/failed"] == 0.0
    assert [s.reward for s in groups[0]] == [1.0, 0.0, 1.0, 0.0]


async def test_runner_on_error_raise_with_a_raising_remote(server):
    comp = Selection("rewards", "remote", Remote.Config(url=server.url, retries=0, on_error="raise"), 1.0)
    server.plan = ["500"]
    group = [sample(i=0), sample(i=1)]
    runner = RewardRunner([comp], PLUGINS)
    metrics = await runner.score_groups([group])  # the runner's default marks the sample failed
    assert metrics["reward/failed"] == 1.0 and sum(s.status == SampleStatus.FAILED for s in group) == 1
    server.plan = ["500"]
    strict = RewardRunner([comp], PLUGINS, on_error="raise")
    with pytest.raises(RewardError, match="HTTP 500"):
        await strict.score_groups([[sample(i=5)]])
    await runner.aclose()
    await strict.aclose()
