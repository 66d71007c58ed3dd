"""Rewards used by the runner tests. A module of its own so spawned worker processes can import them."""

import asyncio
import os
from dataclasses import dataclass


class Boom:
    """Raises on 'boom', returns NaN on 'nan', inf on 'inf', a string on 'str', else 1.0."""

    name = "boom"

    @dataclass
    class Config:
        pass

    def __init__(self, config=None):
        self.config = config

    def __call__(self, sample):
        if sample.response == "boom":
            raise ValueError("kaboom")
        return {"nan": float("nan"), "inf": float("inf"), "str": "high"}.get(sample.response, 1.0)


class Pid:
    """The worker's process id as the score (tells where a sync reward ran)."""

    name = "pid"

    @dataclass
    class Config:
        pass

    def __init__(self, config=None):
        self.config = config

    def __call__(self, sample):
        return float(os.getpid())


class SlowAsync:
    """Sleeps, counting how many calls are in flight at once."""

    name = "slow_async"
    in_flight = 0
    max_in_flight = 0

    @dataclass
    class Config:
        delay: float = 0.02

    def __init__(self, config=None):
        self.config = config or self.Config()

    async def __call__(self, sample):
        cls = type(self)
        cls.in_flight += 1
        cls.max_in_flight = max(cls.max_in_flight, cls.in_flight)
        try:
            await asyncio.sleep(self.config.delay)
        finally:
            cls.in_flight -= 1
        return {"score": 0.5, "latency": self.config.delay}


class GroupRank:
    """Scores a whole group: the i-th sample of n gets i / (n - 1); 'short' returns too few scores."""

    name = "group_rank"
    scope = "group"

    @dataclass
    class Config:
        pass

    def __init__(self, config=None):
        self.config = config

    def __call__(self, group):
        n = len(group)
        if group[0].response == "short":
            return [0.0]
        return [i / max(1, n - 1) for i in range(n)]


class Die:
    """Kills its worker process on 'die' (a native crash or the OOM killer looks the same)."""

    name = "die"

    @dataclass
    class Config:
        pass

    def __init__(self, config=None):
        self.config = config

    def __call__(self, sample):
        if sample.response == "die":
            os._exit(3)
        return 1.0
