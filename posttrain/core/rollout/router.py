"""Launch the real ``sglang-router`` (PyPI ``sglang-router``, a Rust binary behind a Python CLI) in front of
engines, and register engines with it at run time.

The command line is ``python -m sglang_router.launch_router --worker-urls URL... --host H --port P
--policy POLICY --model-path DIR`` plus any extra ``--router-*`` options (passed without the prefix).
``--model-path`` matters: the router loads a tokenizer from it, and nothing can be downloaded here, so
point it at the local checkpoint directory. Workers are added while it runs with ``POST /workers
{"url": ...}`` and removed with ``DELETE /workers/{id}`` (ids from ``GET /workers``); it health-checks
workers and retries failed requests on another worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from posttrain.core.rollout.procs import free_port, spawn, stop_process, wait_http_ok


class RouterProcess:
    """One ``sglang_router.launch_router`` process bound to ``host:port``."""

    def __init__(self, worker_urls: list[str], host: str = "127.0.0.1", port: int | None = None,
                 model_path: str | None = None, policy: str = "round_robin", extra_args: list[str] | tuple = (),
                 log_path: str | Path | None = None):
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.host, self.port = host, port or free_port(host)
        self.model_path, self.policy, self.extra_args = model_path, policy, list(extra_args)
        self.log_path = log_path
        self.prometheus_port = free_port(host)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", self.host, "--port", str(self.port),
               "--policy", self.policy, "--log-level", "warn",
               # its metrics exporter binds 0.0.0.0:29000 by default: keep it on loopback, on a free port
               "--prometheus-host", self.host, "--prometheus-port", str(self.prometheus_port)]
        if self.worker_urls:
            cmd += ["--worker-urls", *self.worker_urls]
        if self.model_path:
            cmd += ["--model-path", str(self.model_path)]
        return cmd + self.extra_args

    def start(self, timeout_s: float = 120.0) -> RouterProcess:
        """Start the router and wait until every initial worker is registered and healthy."""
        self.proc = spawn(self.command(), self.log_path, {"RUST_LOG": os.environ.get("RUST_LOG", "warn")})
        try:
            wait_http_ok(self.url + "/health", timeout_s, self.proc)
            self.wait_workers(len(self.worker_urls), timeout_s)
        except Exception:
            self.stop()
            raise
        return self

    def workers(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(self.url + "/workers", timeout=10) as resp:
            return json.loads(resp.read())["workers"]

    def wait_workers(self, n: int, timeout_s: float = 60.0) -> None:
        """Wait until at least ``n`` workers are registered and healthy."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sum(1 for w in self.workers() if w.get("is_healthy")) >= n:
                return
            time.sleep(0.5)
        raise TimeoutError(f"router at {self.url}: fewer than {n} healthy workers after {timeout_s:.0f} s")

    def add_worker(self, url: str, wait_s: float = 60.0) -> None:
        """Register an engine at run time (``POST /workers``) and wait until the router lists it healthy."""
        url = url.rstrip("/")
        req = urllib.request.Request(self.url + "/workers", data=json.dumps({"url": url}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(req, timeout=10).read()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if any(w["url"] == url and w.get("is_healthy") for w in self.workers()):
                return
            time.sleep(0.5)
        raise TimeoutError(f"router at {self.url}: worker {url} not healthy after {wait_s:.0f} s")

    def remove_worker(self, url: str) -> None:
        """Deregister an engine (``DELETE /workers/{id}``)."""
        for w in self.workers():
            if w["url"] == url.rstrip("/"):
                req = urllib.request.Request(f"{self.url}/workers/{w['id']}", method="DELETE")
                urllib.request.urlopen(req, timeout=10).read()

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def __enter__(self) -> RouterProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
