"""Launch the real ``sglang-router`` (PyPI ``sglang-router``, a Rust binary behind a Python CLI) in front of
engines, and register engines with it at run time.

The command line is ``python -m sglang_router.launch_router --worker-urls URL... --host H --port P
--policy POLICY --model-path DIR`` plus any extra ``--router-*`` options (passed without the prefix).
``--model-path`` matters: the router loads a tokenizer from it, and nothing can be downloaded here, so
point it at the local checkpoint directory. Workers are added while it runs with ``POST /workers
{"url": ...}`` and removed with ``DELETE /workers/{id}`` (ids from ``GET /workers``); it health-checks
workers and retries failed requests on another worker.

With the run's API key the router runs as ``python -m posttrain.core.rollout.router`` (the same options):
that entry reads the key from the environment and hands it to sglang-router as ``api_key``, never on a
command line. sglang-router 0.3.2 then (read from its source and checked against it) requires
``Authorization: Bearer KEY`` on everything but ``/health*`` (``/generate``, ``/workers``, ...), and
sends the key to its workers: on their registration probes and with every forwarded request (plus the
client's own header, so a worker sees the key twice). A worker added at run time gets the key in the
``POST /workers`` body (``api_key``); without it the router probes that worker unauthenticated.
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

from posttrain.core.rollout.backend import API_KEY_ENV
from posttrain.core.errors import RunFailed
from posttrain.core.rollout.procs import free_port, port_free, spawn, stop_process, wait_http_ok, where_logged


class RouterProcess:
    """One ``sglang_router.launch_router`` process bound to ``host:port``."""

    def __init__(self, worker_urls: list[str], host: str = "127.0.0.1", port: int | None = None,
                 model_path: str | None = None, policy: str = "round_robin", extra_args: list[str] | tuple = (),
                 log_path: str | Path | None = None, api_key: str | None = None):
        if any(a.split("=")[0] in ("--api-key", "--router-api-key") for a in extra_args):
            raise ValueError("rollout.router_args: --api-key is the run's engine key, set by posttrain")
        self.api_key = api_key
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.host, self.port, self._own_port = host, port or free_port(host), port is None
        self.model_path, self.policy, self.extra_args = model_path, policy, list(extra_args)
        self.log_path = log_path
        self.prometheus_port = free_port(host)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        entry = "posttrain.core.rollout.router" if self.api_key else "sglang_router.launch_router"
        cmd = [sys.executable, "-m", entry, "--host", self.host, "--port", str(self.port),
               "--policy", self.policy, "--log-level", "warn",
               # its metrics exporter binds 0.0.0.0:29000 by default: keep it on loopback, on a free port
               "--prometheus-host", self.host, "--prometheus-port", str(self.prometheus_port)]
        if self.worker_urls:
            cmd += ["--worker-urls", *self.worker_urls]
        if self.model_path:
            cmd += ["--model-path", str(self.model_path)]
        return cmd + self.extra_args

    def start(self, timeout_s: float = 120.0, attempts: int = 3) -> RouterProcess:
        """Start the router and wait until every initial worker is registered and healthy. Its ports come from
        ``free_port`` moments before it binds them, and another process (a parallel run, an xdist worker) may take
        one in between: a router that failed while another process holds one of its ports starts again on fresh
        ports, up to ``attempts`` times (a port given to it is kept), as the fleet's engines do."""
        env = {"RUST_LOG": os.environ.get("RUST_LOG", "warn"), **({API_KEY_ENV: self.api_key} if self.api_key else {})}
        for attempt in range(attempts):
            self.proc = spawn(self.command(), self.log_path, env)
            try:
                wait_http_ok(self.url + "/health", timeout_s, self.proc)
                self.wait_workers(len(self.worker_urls), timeout_s)
                return self
            except (RuntimeError, TimeoutError) as exc:  # it exited, or never answered: one line naming its log
                self.stop()
                taken = not (port_free(self.url) and port_free(f"http://{self.host}:{self.prometheus_port}"))
                if attempt + 1 < attempts and taken:
                    self.port = free_port(self.host) if self._own_port else self.port
                    self.prometheus_port = free_port(self.host)
                    continue
                raise RunFailed(f"router: {exc}{where_logged(self.log_path)}") from exc
            except Exception:
                self.stop()
                raise
        return self

    def _call(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
        try:
            return json.loads(body) if body else None
        except ValueError:  # a plain-text answer
            return body.decode(errors="replace")

    def workers(self) -> list[dict[str, Any]]:
        return self._call("GET", "/workers")["workers"]

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
        self._call("POST", "/workers", {"url": url, **({"api_key": self.api_key} if self.api_key else {})})
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
                self._call("DELETE", f"/workers/{w['id']}")

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def __enter__(self) -> RouterProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m posttrain.core.rollout.router OPTIONS``: ``sglang_router.launch_router OPTIONS`` with its
    ``api_key`` read from the environment (``POSTTRAIN_ENGINE_API_KEY``), which is then cleared."""
    from sglang_router.launch_router import launch_router, parse_router_args

    from posttrain.core.rollout.procs import exit_with_parent

    exit_with_parent()
    args = parse_router_args(sys.argv[1:] if argv is None else argv)
    args.api_key = os.environ.pop(API_KEY_ENV, "") or None
    launch_router(args)


if __name__ == "__main__":
    main()
