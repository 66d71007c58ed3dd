"""What the local engine's scheduler keeps per request, per launched step, and per phase of its steps."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.plugins.engines.local.sampling import RequestSampling

TOTALS = ("prefill_steps", "prefill_s", "decode_steps", "decode_rows", "decode_s")  # StepStats.totals' keys


@dataclass
class StepStats:
    """Wall time of the engine's steps, summed since the last :meth:`reset` (engine thread only; read
    it through ``call_in_engine`` so a step is never half counted).

    A decode step is ``launch`` (gather tokens/positions, copy them to the device, run or enqueue the
    forward pass), ``sample`` (sampling and the device-to-host copy of its result, which waits for
    the device to finish the step) and ``advance`` (append tokens, check stops, complete requests).
    With overlap, ``launch`` also enqueues the sampling and ``sample`` is the wait for the step's tokens
    (the host's work on the previous step hides the rest of it).
    """

    decode_steps: int = 0
    decode_rows: int = 0  # running requests summed over decode steps (mean batch = rows / steps)
    decode_s: float = 0.0
    launch_s: float = 0.0
    sample_s: float = 0.0
    advance_s: float = 0.0
    prefill_steps: int = 0
    prefill_s: float = 0.0
    position_copies: int = 0  # overlapped decode steps that copied their positions to the device
    started: float = 0.0  # perf_counter at the start of the first prefill since the reset (0: none yet)
    ended: float = 0.0  # perf_counter at the end of the last prefill or decode step
    # since the engine started, kept by reset(): what /get_server_info reports (``totals``), and a run's
    # metrics turn into per-step figures (core.metrics.ServerMetrics)
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TOTALS, 0.0))

    def reset(self) -> None:
        totals = self.totals
        self.__init__()
        self.totals = totals

    def add_prefill(self, start: float) -> None:
        """One prefill batch that began at ``start`` (``perf_counter``) and ends now."""
        self.ended = time.perf_counter()
        self.started = self.started or start
        self.prefill_steps += 1
        self.prefill_s += self.ended - start
        self.totals["prefill_steps"] += 1
        self.totals["prefill_s"] += self.ended - start

    def add_decode(self, rows: int, launch: float, sample: float, advance: float) -> None:
        """One decode step of ``rows`` requests and its phases' seconds (it ends now)."""
        self.ended = time.perf_counter()
        self.decode_steps += 1
        self.decode_rows += rows
        self.decode_s += launch + sample + advance
        self.totals["decode_steps"] += 1
        self.totals["decode_rows"] += rows
        self.totals["decode_s"] += launch + sample + advance
        self.launch_s += launch
        self.sample_s += sample
        self.advance_s += advance

    def summary(self) -> dict[str, float]:
        """Mean milliseconds per decode step for each phase, the mean batch, and prefill totals."""
        n = max(self.decode_steps, 1)
        return {"decode_steps": self.decode_steps, "mean_batch": round(self.decode_rows / n, 1),
                "step_ms": round(1e3 * self.decode_s / n, 3), "launch_ms": round(1e3 * self.launch_s / n, 3),
                "sample_ms": round(1e3 * self.sample_s / n, 3), "advance_ms": round(1e3 * self.advance_s / n, 3),
                "prefill_steps": self.prefill_steps, "prefill_s": round(self.prefill_s, 3),
                "position_copies": self.position_copies}


@dataclass
class Request:
    """One generation request inside the engine."""

    rid: str
    prompt_ids: list[int]
    sampling: RequestSampling
    return_logprob: bool
    on_done: Callable[[dict[str, Any]], None]
    logprob_start_len: int = -1  # >= 0 with return_logprob: log-probs of the prompt's tokens from there on
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float] | None = None
    slot: int = -1
    finish: dict[str, Any] | None = None
    text_cut: int | None = None  # char offset of a matched stop string (trimmed unless no_stop_trim)
    text: str | None = None  # the answer's text, when decoded with others of its step (else at completion)
    error: str | None = None  # this request alone broke a step (the server answers HTTP 400)
    created: float = field(default_factory=time.monotonic)
    return_routed_experts: bool = False
    routed: list[Any] = field(default_factory=list)  # device tensors [rows, L, k]: the prompt's, then one per step
    launched: int = 0  # overlap: output tokens sampled so far, on the host or still on the device


@dataclass
class InFlight:
    """A launched decode step whose tokens have not reached the host (overlap mode)."""

    reqs: list[Request]  # its rows, in slot order
    host: Any  # [2, len(reqs)] float64 in pinned memory: tokens, log-probs (an async copy fills it)
    ready: Any  # CUDA event recorded after that copy; None on a CPU engine (the copy is done on return)
    launch_s: float


def input_logprobs(req: Request) -> list[list[Any]]:
    """SGLang's ``input_token_logprobs``: ``[logprob, token_id, None]`` for each prompt token from
    ``logprob_start_len`` on, the first with logprob None (SGLang computes none for it); empty for the
    default ``-1`` (or an aborted request that never ran its prefill)."""
    if req.logprob_start_len < 0 or req.input_logprobs is None:
        return []
    ids = req.prompt_ids[req.logprob_start_len:]
    return [[None, ids[0], None]] + [[lp, t, None] for lp, t in zip(req.input_logprobs, ids[1:])]


def check_finish(req: Request, tok: int, eos_token_ids: set[int], tokenizer: Any, context_length: int) -> None:
    """Set ``req.finish`` (and ``req.text_cut`` for a stop string) if ``tok``, its newest token, ends it: a stop
    token or EOS (unless ``ignore_eos``) once ``min_new_tokens`` are out, a stop string ending in the newest
    token, ``max_new_tokens``, or the context's end."""
    s = req.sampling
    n = len(req.output_ids)
    if n >= s.min_new_tokens:
        if tok in s.stop_token_ids or (not s.ignore_eos and tok in eos_token_ids):
            req.finish = {"type": "stop", "matched": tok}
            return
        if s.stop and tokenizer is not None:
            # Only a stop string that ends in the newest token can be new: decode a short tail of
            # tokens (cheap) and look there; decode everything only on a hit, to find the cut.
            window = max(map(len, s.stop)) + 8
            tail = tokenizer.decode(req.output_ids[-window:], skip_special_tokens=s.skip_special_tokens)
            if any(stop in tail for stop in s.stop):
                text = tokenizer.decode(req.output_ids, skip_special_tokens=s.skip_special_tokens)
                hits = [(text.find(stop), stop) for stop in s.stop if stop in text]
                at, stop = min(hits)
                req.finish = {"type": "stop", "matched": stop}
                req.text_cut = at if not s.no_stop_trim else at + len(stop)
                return
    if n >= s.max_new_tokens:
        req.finish = {"type": "length", "length": s.max_new_tokens}
    elif len(req.prompt_ids) + n >= context_length:
        req.finish = {"type": "length", "length": n}


class FairQueue:
    """Requests waiting for a slot, admitted round-robin across submissions (one ``/generate``'s rows are one
    submission): a large batch takes the free slots while it is alone, and a small request that arrives behind
    it gets the next free slot instead of waiting for every row of the batch. Within a submission, rows keep
    their order. Engine thread only."""

    def __init__(self) -> None:
        self._groups: deque[deque[Request]] = deque()
        self._count = 0

    def add(self, requests: list[Request]) -> None:
        if requests:
            self._groups.append(deque(requests))
            self._count += len(requests)

    def popleft(self) -> Request:
        group = self._groups.popleft()
        req = group.popleft()
        if group:
            self._groups.append(group)  # its next row waits for one of every other submission's
        self._count -= 1
        return req

    def drop_finished(self) -> None:
        """Forget requests that finished while waiting (aborted)."""
        kept = (deque(r for r in g if r.finish is None) for g in self._groups)
        self._groups = deque(g for g in kept if g)
        self._count = sum(len(g) for g in self._groups)

    def clear(self) -> None:
        self._groups.clear()
        self._count = 0

    def __iter__(self):
        return (r for g in self._groups for r in g)

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0
