"""Test helpers for anything that needs a rollout engine: a local engine server on a free loopback port,
and HF ``generate``'s greedy continuation to compare against."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

ENGINE_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def start_local_engine(model_dir: str | Path, log_dir: str | Path | None = None, api_key: str | None = None,
                       **options):
    """Start ``rl-cli engine serve model_dir`` on a free 127.0.0.1 port and wait for ``/health_generate``.

    Returns a started :class:`~posttrain.core.rollout.procs.ManagedServer` (``.base_url``, ``.api_key``:
    the key its clients send, a fresh random one unless given; call ``.stop()``). Options are ``engine serve``
    flags by name: the ``local`` engine backend's config fields (from the plugin registry, checked by its schema;
    defaults: ``context_length=256, max_running_requests=8``) and the server's own (``load_format``,
    ``warm_sampling``, ``wait_for_model``).
    """
    import secrets

    from posttrain.core.rollout.backend import API_KEY_ENV
    from posttrain.core.rollout.procs import ManagedServer, free_port

    api_key = api_key or secrets.token_urlsafe(16)
    options.setdefault("context_length", 256)
    options.setdefault("max_running_requests", 8)
    backend, server_options = local_backend(options)
    log_dir = str(log_dir) if log_dir else tempfile.mkdtemp(prefix="posttrain-engine-log-")
    for attempt in range(3):
        # free_port() is free when asked, not when the engine binds it: another test process (xdist) may
        # take it in between, and the engine then exits "address already in use"; a fresh port, again
        port = free_port()
        log = os.path.join(log_dir, f"engine-{port}.log")
        server = ManagedServer(backend.serve_command(str(model_dir), port, **server_options), f"http://127.0.0.1:{port}",
                               log_path=log, env={**ENGINE_ENV, API_KEY_ENV: api_key}, ready_timeout_s=120)
        server.api_key = api_key
        try:
            return server.start()
        except RuntimeError as exc:  # the process exited before it answered
            tail = Path(log).read_text(errors="replace")[-2000:] if os.path.exists(log) else ""
            if "address already in use" in tail and attempt < 2:
                continue
            raise RuntimeError(f"{exc}; engine log {log}:\n{tail}") from None


def local_backend(options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The ``local`` engine backend from the plugin registry, configured with those of ``options`` that are fields
    of its ``Config`` (built through ``posttrain.core.schema``: a bad value is a ValueError naming it), and the
    options left for the server."""
    from posttrain.core.plugins import load_plugins
    from posttrain.core.schema import build

    cls = load_plugins().engines.get_or_raise("local")
    names = {f.name for f in dataclasses.fields(cls.Config)}
    config, errors = build(cls.Config, {k: v for k, v in options.items() if k in names}, "local engine")
    if errors:
        raise ValueError("; ".join(errors))
    return cls(config), {k: v for k, v in options.items() if k not in names}


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF ``generate``'s greedy continuation of ``prompt`` for exactly ``n`` tokens (EOS does not stop it)."""
    import torch

    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0, min_new_tokens=n)
    return out[0, len(prompt):].tolist()
