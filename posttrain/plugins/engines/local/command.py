"""``rl-cli engine serve``: the local engine's server (SGLang's HTTP API over a HF checkpoint), a command
this plugin adds through ``posttrain_register_commands`` like any third-party plugin would."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import sys
import typing
from pathlib import Path
from typing import Any

import typer

from posttrain.core.errors import UsageError

app = typer.Typer(help="Serve a HF checkpoint over SGLang's native HTTP API (CPU, or one GPU).",
                  no_args_is_help=True)


LOAD_FORMATS = ("auto", "dummy")  # SGLang's names for the two it shares with this server


class HTTP2ProbeFilter(logging.Filter):
    """Drops aiohttp's traceback for an HTTP/2 connection preface (``PRI * HTTP/2.0``).

    sglang-router probes every worker for gRPC by opening an HTTP/2 connection; our HTTP/1.1 server
    answers 400, which is the right answer ("no gRPC here"), and the router goes on over HTTP/1.1. But
    aiohttp logs each such request as "Error handling request" with a traceback ending in
    ``BadHttpMessage: Pause on PRI/Upgrade``, which read like a crash in every engine log. Only that
    exact case is dropped; every other bad request is still logged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and type(exc).__name__ == "BadHttpMessage" and "PRI/Upgrade" in str(exc))


def quiet_http2_probes() -> None:
    logging.getLogger("aiohttp.server").addFilter(HTTP2ProbeFilter())


def config_parameters() -> list[inspect.Parameter]:
    """One ``--name`` option per field of the local backend's ``Config`` (bools as ``--name/--no-name``), for
    ``serve``'s signature: each option's help, type and choices come from the field; left out, the option is None
    and the field keeps the dataclass's default (read when ``serve`` runs, not here)."""
    from posttrain.plugins.engines.local.options import EngineOptions

    hints = typing.get_type_hints(EngineOptions)
    params = []
    for f in dataclasses.fields(EngineOptions):
        tp, flag = hints[f.name], "--" + f.name.replace("_", "-")
        choices = typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else ()
        text = f.metadata.get("help", "") + (f" (one of: {', '.join(map(str, choices))})" if choices else "")
        decls = (f"{flag}/--no-{flag[2:]}",) if tp is bool else (flag,)
        kind = tp if tp in (bool, int, float) else str
        option = typer.Option(None, *decls, help=text, show_default=str(f.default))
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=typing.Optional[kind]))  # Typer reads Optional, not X | None
    return params


def engine_config(given: dict[str, Any]) -> Any:
    """The local backend's ``Config`` from ``serve``'s options (None: not given, the field's default), built and
    checked by ``posttrain.core.schema`` as a run's ``rollout.engine`` section is; a bad value is a one-line
    :class:`UsageError` naming its option."""
    from posttrain.core.schema import build
    from posttrain.plugins.engines.local.options import EngineOptions

    config, errors = build(EngineOptions, {k: v for k, v in given.items() if v is not None}, "")
    if errors:
        names = {f.name for f in dataclasses.fields(EngineOptions)}
        raise UsageError("; ".join(_as_flag(e, names) for e in errors))
    return config


def _as_flag(error: str, names: set[str]) -> str:
    """``"max_running_requests: ..."`` -> ``"--max-running-requests: ..."`` (a schema error, named as the option)."""
    key, sep, rest = error.partition(":")
    return f"--{key.replace('_', '-')}:{rest}" if sep and key in names else error


def serve(model_dir: Path = typer.Argument(..., help="HF checkpoint directory (config.json, *.safetensors, tokenizer)",
                                           show_default=False),
          port: int = typer.Option(30000, "--port", help="TCP port"),
          host: str = typer.Option("127.0.0.1", "--host", help="address to bind (loopback by default)"),
          no_api_key: bool = typer.Option(False, "--no-api-key", help="serve without an API key: any process that reaches the port may load weights (and run code) in the engine"),
          load_format: str = typer.Option("auto", "--load-format", help="auto: the weights in MODEL_DIR | dummy: the model built from its config.json with zero weights, none read (a run pushes every weight before it generates; until a push has written them all, /generate is refused after the first push)"),
          warm_sampling: str = typer.Option("", "--warm-sampling", help="a JSON sampling_params object: before serving (with --warm-up), one two-token generation with it compiles the decode step and captures its CUDA graphs for that sampling (a run's GPU engines get its rollout's); empty: at the first request"),
          wait_for_model: float = typer.Option(0, "--wait-for-model", help="seconds to wait for MODEL_DIR to appear (a run starts its engines while the trainer writes their checkpoint; torch and transformers are imported meanwhile); 0: it must exist"),
          **options: Any) -> None:
    """Serve MODEL_DIR: /generate, /health_generate, abort/pause, weight updates, /model_info, /server_info.

    The engine's options are the local backend's (a run's rollout.engine section), one flag each.
    Clients must send ``Authorization: Bearer KEY`` with the key in the environment variable
    POSTTRAIN_ENGINE_API_KEY (never on the command line, where other users can read it)."""
    config = engine_config(options)
    if wait_for_model < 0:
        raise UsageError(f"--wait-for-model: must be >= 0 seconds, got {wait_for_model:g}")
    if load_format not in LOAD_FORMATS:
        raise UsageError(f"--load-format: expected {' or '.join(LOAD_FORMATS)}, got {load_format!r}")
    weights = load_format != "dummy"
    if not wait_for_model:
        check_checkpoint(model_dir, weights)
    if not 0 < port < 65536:
        raise UsageError(f"--port: {port} is not a TCP port")
    warm = warm_sampling_params(warm_sampling)
    quiet_http2_probes()
    from posttrain.core.rollout.backend import API_KEY_ENV
    from posttrain.core.rollout.procs import exit_with_parent

    exit_with_parent()  # started by a run: gone with it, whatever thread started it

    api_key = os.environ.pop(API_KEY_ENV, "") or None  # popped: nothing this process starts inherits it
    if api_key is None and not no_api_key:
        raise UsageError(f"set {API_KEY_ENV} to the API key clients will send (Authorization: Bearer KEY), "
                         "or pass --no-api-key to serve without one")
    waited_s = None
    if wait_for_model:  # started beside the trainer that writes it: the imports run meanwhile
        waited_s = wait_for_checkpoint(model_dir, wait_for_model)
        check_checkpoint(model_dir, weights)
    from posttrain.plugins.engines.local.server import serve as run

    run(str(model_dir), config, host=host, port=port, waited_s=waited_s, api_key=api_key, from_config=not weights,
        warm_sampling=warm)
    # Stopped (SIGTERM/SIGINT) and shut down (the engine thread joined): nothing is left to write, so skip the
    # interpreter's teardown, which frees every model object (a run's stop waits for it) and, after settle_heap
    # froze the heap, has triton's bindings print leak reports.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_own = [p for p in inspect.signature(serve, eval_str=True).parameters.values() if p.kind is not p.VAR_KEYWORD]
serve.__signature__ = inspect.Signature([*_own, *config_parameters()])  # what Typer reads
app.command()(serve)


def warm_sampling_params(text: str) -> dict | None:
    """``--warm-sampling``'s JSON object, checked as ``/generate`` checks ``sampling_params`` (one-line errors)."""
    if not text:
        return None
    import json

    from posttrain.plugins.engines.local.sampling import SamplingError, parse_sampling

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--warm-sampling: not JSON ({exc})") from None
    try:
        parse_sampling(value)
    except SamplingError as exc:
        raise UsageError(f"--warm-sampling: {exc}") from None
    return value


def check_checkpoint(model_dir: Path, weights: bool = True) -> None:
    """A one-line error for a ``model_dir`` without ``config.json`` or, when its ``weights`` are read, without
    safetensors files."""
    if not (model_dir / "config.json").is_file():
        raise UsageError(f"{model_dir}: not a HF checkpoint directory (no config.json)")
    if weights and not any(model_dir.glob("*.safetensors")):
        raise UsageError(f"{model_dir}: no *.safetensors weights")


def wait_for_checkpoint(model_dir: Path, timeout_s: float, poll_s: float = 0.02) -> float:
    """Import what loading a checkpoint needs (torch, transformers' model and tokenizer machinery, the engine),
    then wait up to ``timeout_s`` for ``model_dir`` to appear; returns the seconds waited. The run's trainer writes
    it under another name and renames it in, so a directory that exists is whole. The imports take most of an engine's start on a
    CPU, and they run while the trainer builds."""
    import time

    import torch  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401

    import posttrain.plugins.engines.local.engine  # noqa: F401
    import posttrain.plugins.engines.local.model_runner  # noqa: F401
    import posttrain.plugins.engines.local.server  # noqa: F401

    start = time.monotonic()
    deadline = start + timeout_s
    while not model_dir.is_dir():
        if time.monotonic() > deadline:
            raise UsageError(f"{model_dir}: the checkpoint did not appear within --wait-for-model {timeout_s:g} s")
        time.sleep(poll_s)
    return time.monotonic() - start
