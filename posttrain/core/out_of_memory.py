"""A trainer pass that runs out of GPU memory ends the run with one line that says what it tried to allocate,
what the device held, and which config keys make the pass smaller, with their values: the core's micro-batch keys
and the backend's own (``TrainerBackend.memory_keys``). It is a :class:`~posttrain.core.errors.RunFailed`: exit
code 1, no traceback (``--debug`` shows it), and ``rl-cli run --resume`` continues from the last checkpoint."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from posttrain.core.errors import RunFailed

TOKENS, SAMPLES = "trainer.max_tokens_per_micro_batch", "trainer.micro_batch_size"


def config_value(config: dict[str, Any], dotted: str) -> Any:
    """``config["a"]["b"]`` for ``"a.b"``; None where a part is missing."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def device_text() -> str:
    """``cuda:0 held 73.4 GiB (this process's tensors), 1.2 of 79.2 GiB free`` for the current device; empty
    without CUDA (or when the driver cannot say)."""
    import torch

    if not torch.cuda.is_available():
        return ""
    index = torch.cuda.current_device()
    try:
        free, total = torch.cuda.mem_get_info(index)
    except RuntimeError:
        return ""
    held = torch.cuda.memory_allocated(index)
    return f"cuda:{index} held {held / 2**30:.1f} GiB (this process's tensors), {free / 2**30:.1f} of " \
           f"{total / 2**30:.1f} GiB free"


def out_of_memory_text(what: str, exc: BaseException, config: dict[str, Any], backend_keys: Sequence[str] = (),
                       device: str = "") -> str:
    """The one line for ``exc`` (PyTorch's out-of-memory error) raised in the trainer's ``what`` pass. The core key
    named is the one that bounds a pass: the token budget when there is one (the sample count then does not)."""
    asked = re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]?i?B)", str(exc))
    facts = [f"tried to allocate {asked.group(1)}" if asked else "", device]
    core = TOKENS if config_value(config, TOKENS) is not None else SAMPLES
    keys = [f"{key} ({config_value(config, key)})" for key in (core, *backend_keys)
            if config_value(config, key) is not None]
    return (f"trainer: out of GPU memory in the {what} pass" + (f" ({'; '.join(f for f in facts if f)})"
            if any(facts) else "") + (f"; smaller passes take less: {', '.join(keys)}" if keys else "")
            + "; rl-cli run --resume RUN_DIR continues from the last checkpoint")


@contextmanager
def passes_report_memory(what: str, run: Any, backend_keys: Sequence[str] = ()) -> Iterator[None]:
    """Inside, PyTorch's out-of-memory error becomes a :class:`RunFailed` with :func:`out_of_memory_text`
    (``run``: the RunConfig, read only then)."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise RunFailed(out_of_memory_text(what, exc, run.to_dict(), backend_keys, device_text())) from exc
