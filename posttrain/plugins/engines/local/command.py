"""``rl-cli engine serve``: the local engine's server (SGLang's HTTP API over a HF checkpoint), a command
this plugin adds through ``posttrain_register_commands`` like any third-party plugin would."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import typer

from posttrain.core.errors import UsageError

app = typer.Typer(help="Serve a HF checkpoint over SGLang's native HTTP API (CPU, or one GPU).",
                  no_args_is_help=True)


DECODE_ATTENTION = ("auto", "sdpa", "bmm", "triton")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")  # model_runner.COMPILE_MODES, without importing torch here
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


@app.command()
def serve(model_dir: Path = typer.Argument(..., help="HF checkpoint directory (config.json, *.safetensors, tokenizer)",
                                           show_default=False),
          port: int = typer.Option(30000, "--port", help="TCP port"),
          host: str = typer.Option("127.0.0.1", "--host", help="address to bind (loopback by default)"),
          device: str = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N"),
          dtype: str = typer.Option("auto", "--dtype", help="auto (float32 on CPU; on GPU the checkpoint's torch_dtype, else bfloat16) | float32 | bfloat16 | float16"),
          max_running_requests: int = typer.Option(32, "--max-running-requests", help="KV-cache slots (requests decoded together)"),
          context_length: int = typer.Option(0, "--context-length", help="tokens per request (prompt + output); 0: the model's max_position_embeddings, at most 4096"),
          cuda_graphs: bool = typer.Option(False, "--cuda-graphs", help="capture the decode step in CUDA graphs (GPU only)"),
          decode_attention: str = typer.Option("auto", "--decode-attention", help="decode attention: auto (triton on a GPU, else sdpa) | sdpa | bmm | triton"),
          compile: bool = typer.Option(False, "--compile", help="torch.compile the decode step's layer parts (fused norms, rotary, SwiGLU)"),
          compile_mode: str = typer.Option("default", "--compile-mode", help="with --compile: default | max-autotune-no-cudagraphs (Triton matmul templates timed against cuBLAS; longer start)"),
          stable_memory: bool = typer.Option(False, "--stable-memory", help="GPU: weights and KV cache at fixed virtual addresses (CUDA VMM), so memory release keeps the CUDA graphs"),
          no_overlap: bool = typer.Option(False, "--no-overlap", help="GPU: wait for each decode step's tokens before launching the next (default: launch step N + 1 first)"),
          no_fused_sampling: bool = typer.Option(False, "--no-fused-sampling", help="GPU: draw with torch (multinomial) instead of the one-pass Triton kernel (inverse-CDF, same distribution)"),
          prefill_tokens: int = typer.Option(0, "--prefill-tokens", help="prompt tokens per prefill batch (bounds its activation memory); 0: 8192 on CPU, 32768 on GPU"),
          no_api_key: bool = typer.Option(False, "--no-api-key", help="serve without an API key: any process that reaches the port may load weights (and run code) in the engine"),
          load_format: str = typer.Option("auto", "--load-format", help="auto: the weights in MODEL_DIR | dummy: the model built from its config.json with zero weights, none read (a run pushes every weight before it generates; until a push has written them all, /generate is refused after the first push)"),
          warm_sampling: str = typer.Option("", "--warm-sampling", help="a JSON sampling_params object: before serving, one two-token generation with it compiles the decode step and captures its CUDA graphs for that sampling (a run's GPU engines get its rollout's); empty: at the first request"),
          wait_for_model: float = typer.Option(0, "--wait-for-model", help="seconds to wait for MODEL_DIR to appear (a run starts its engines while the trainer writes their checkpoint; torch and transformers are imported meanwhile); 0: it must exist")) -> None:
    """Serve MODEL_DIR: /generate, /health_generate, abort/pause, weight updates, /model_info, /server_info.

    Clients must send ``Authorization: Bearer KEY`` with the key in the environment variable
    POSTTRAIN_ENGINE_API_KEY (never on the command line, where other users can read it)."""
    if wait_for_model < 0:
        raise UsageError(f"--wait-for-model: must be >= 0 seconds, got {wait_for_model:g}")
    if load_format not in LOAD_FORMATS:
        raise UsageError(f"--load-format: expected {' or '.join(LOAD_FORMATS)}, got {load_format!r}")
    weights = load_format != "dummy"
    if not wait_for_model:
        check_checkpoint(model_dir, weights)
    if not 0 < port < 65536:
        raise UsageError(f"--port: {port} is not a TCP port")
    if max_running_requests < 1:
        raise UsageError("--max-running-requests: must be >= 1")
    if prefill_tokens < 0:
        raise UsageError(f"--prefill-tokens: must be >= 0, got {prefill_tokens}")
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise UsageError(f"--dtype: expected auto, float32, bfloat16 or float16, got {dtype!r}")
    if compile_mode not in COMPILE_MODES:
        raise UsageError(f"--compile-mode: expected {', '.join(COMPILE_MODES)}, got {compile_mode!r}")
    if decode_attention not in DECODE_ATTENTION:
        raise UsageError(f"--decode-attention: expected {', '.join(DECODE_ATTENTION)}, got {decode_attention!r}")
    if device != "cpu" and not device.startswith("cuda"):
        raise UsageError(f"--device: expected cpu or cuda[:N], got {device!r}")
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

    run(str(model_dir), host=host, port=port, waited_s=waited_s, device=device, dtype=dtype,
        max_running_requests=max_running_requests, context_length=context_length or None, cuda_graphs=cuda_graphs,
        decode_attention=decode_attention, compile=compile, stable_memory=stable_memory, overlap=not no_overlap,
        api_key=api_key, fused_sampling=not no_fused_sampling, prefill_tokens=prefill_tokens or None,
        compile_mode=compile_mode, from_config=not weights, warm_sampling=warm)
    # Stopped (SIGTERM/SIGINT) and shut down (the engine thread joined): nothing is left to write, so skip the
    # interpreter's teardown, which frees every model object (a run's stop waits for it) and, after settle_heap
    # froze the heap, has triton's bindings print leak reports.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
    CPU (3-4 s of 4, bench/RESULTS.md), and they run while the trainer builds."""
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
