"""Per-request sampling for the local engine: SGLang's ``sampling_params``, parsed and applied in a batch.

Every row of a decode batch carries its own temperature ``T``, ``top_p``, ``top_k`` and ``min_p``.
For a row of logits ``z`` (``[V]``):

- greedy when ``T == 0`` (or ``top_k == 1``): ``token = argmax z``, ``logprob = log_softmax(z)[token]``;
- otherwise ``p = softmax(z / T)``; the candidate set keeps the ``top_k`` most likely tokens, the
  smallest prefix of the sorted distribution whose mass reaches ``top_p``, and tokens with
  ``p >= min_p * max(p)``; the token is drawn from ``p`` renormalized over that set.

The returned log-prob is ``log_softmax(z / T)[token]``: the temperature-scaled distribution *before*
truncation, as SGLang reports it, so a trainer recomputing ``log_softmax(logits / T)`` gets the same
number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

INT64 = 2**63
MIN_TEMPERATURE = 1e-5  # below it (but above 0) logits / T overflow float32; 0 means greedy

# SGLang's SamplingParams fields this engine honours, with their defaults. Anything else in a request
# is rejected with HTTP 400 unless it is in IGNORED_SAMPLING_KEYS (accepted and without effect here).
SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
    "stop": None, "stop_token_ids": None, "ignore_eos": False, "skip_special_tokens": True,
    "no_stop_trim": False, "sampling_seed": None, "min_new_tokens": 0,
}
IGNORED_SAMPLING_KEYS = {"spaces_between_special_tokens", "stream_interval"}  # formatting and streaming only
# SGLang fields that change what is sampled, which this engine does not implement: accepted only with the value
# that asks for nothing (a client may send the defaults explicitly), refused otherwise, naming the field
NEUTRAL_SAMPLING: dict[str, Any] = {"n": 1, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                                    "repetition_penalty": 1.0, "logit_bias": {}, "custom_params": {}}


class SamplingError(ValueError):
    """A bad ``sampling_params`` value: the server answers HTTP 400 with this message."""


@dataclass
class RequestSampling:
    """Validated sampling parameters of one request."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    min_new_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def parse_sampling(raw: Any) -> RequestSampling:
    """Validate SGLang ``sampling_params`` (a mapping); raise :class:`SamplingError` naming the key."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SamplingError(f"sampling_params: expected an object, got {type(raw).__name__}")
    raw = {k: v for k, v in raw.items() if v is not None}  # explicit nulls (routers re-serialize) mean default
    unknown = [k for k in raw if k not in SAMPLING_DEFAULTS and k not in IGNORED_SAMPLING_KEYS
               and k not in NEUTRAL_SAMPLING]
    if unknown:
        raise SamplingError(f"sampling_params: unknown field(s) {', '.join(sorted(unknown))}")
    _refuse_unimplemented(raw)
    vals = {k: raw.get(k, v) for k, v in SAMPLING_DEFAULTS.items()}
    for k, low in (("max_new_tokens", 0), ("top_k", -1), ("min_new_tokens", 0)):
        _integer(k, vals[k], low)
    for k in ("temperature", "top_p", "min_p"):
        if isinstance(vals[k], bool) or not isinstance(vals[k], (int, float)):
            raise SamplingError(f"sampling_params.{k}: expected a number, got {vals[k]!r}")
        vals[k] = float(vals[k])
        if not math.isfinite(vals[k]):
            raise SamplingError(f"sampling_params.{k}: must be a finite number, got {vals[k]}")
    t = vals["temperature"]
    if t < 0 or 0 < t < MIN_TEMPERATURE:  # logits / 1e-300 overflow to inf, and softmax to NaN
        raise SamplingError(f"sampling_params.temperature: must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {t}")
    if not 0.0 < vals["top_p"] <= 1.0:
        raise SamplingError(f"sampling_params.top_p: must be in (0, 1], got {vals['top_p']}")
    if vals["top_k"] == 0 or vals["top_k"] < -1:
        raise SamplingError(f"sampling_params.top_k: must be -1 (off) or >= 1, got {vals['top_k']}")
    if not 0.0 <= vals["min_p"] <= 1.0:
        raise SamplingError(f"sampling_params.min_p: must be in [0, 1], got {vals['min_p']}")
    if vals["min_new_tokens"] > vals["max_new_tokens"]:
        raise SamplingError(f"sampling_params.min_new_tokens: {vals['min_new_tokens']} exceeds max_new_tokens "
                            f"{vals['max_new_tokens']}")
    stop = vals["stop"]
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise SamplingError("sampling_params.stop: expected a string or a list of non-empty strings")
    ids = vals["stop_token_ids"] or []
    if not isinstance(ids, list):
        raise SamplingError("sampling_params.stop_token_ids: expected a list of integers")
    for i in ids:
        _integer("stop_token_ids", i, low=0)
    if vals["sampling_seed"] is not None:
        _integer("sampling_seed", vals["sampling_seed"], low=-INT64)
    for k in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
        if not isinstance(vals[k], bool):
            raise SamplingError(f"sampling_params.{k}: expected true or false, got {vals[k]!r}")
    vals["stop"], vals["stop_token_ids"] = list(stop), list(ids)
    return RequestSampling(**vals)


def _refuse_unimplemented(raw: dict[str, Any]) -> None:
    """A :data:`NEUTRAL_SAMPLING` field with another value than its neutral one is a :class:`SamplingError`."""
    for k, neutral in NEUTRAL_SAMPLING.items():
        if k in raw and not (raw[k] == neutral and type(raw[k]) in (type(neutral), int) and raw[k] is not True):
            raise SamplingError(f"sampling_params.{k}: {raw[k]!r} is not supported by this engine (only "
                                f"{neutral!r}){' -- send that many requests instead' if k == 'n' else ''}")


def parse_sampling_rows(raws: list[Any]) -> list[RequestSampling]:
    """:func:`parse_sampling` of every row of a batch (``[n]`` mappings -> ``[n]`` parameters). A row equal
    to the row before it but for ``sampling_seed`` (a coalesced batch: one seed per row) reuses that
    row's parse with its own seed, which alone is checked; values count as equal only with the same type
    (``True`` is not ``1``), so a row is refused exactly when its own parse would refuse it."""
    out: list[RequestSampling] = []
    prev_raw: Any = None
    for raw in raws:
        if out and _same_but_seed(raw, prev_raw):
            seed = raw.get("sampling_seed")
            if seed is not None:
                _integer("sampling_seed", seed, low=-INT64)
            prev = out[-1]
            if seed != prev.sampling_seed:  # the row before's fields, this seed (no __init__: ~5x cheaper)
                prev = object.__new__(RequestSampling)
                prev.__dict__ = {**out[-1].__dict__, "sampling_seed": seed}
            out.append(prev)
            continue
        out.append(parse_sampling(raw))
        prev_raw = raw
    return out


def _same_but_seed(raw: Any, prev: Any) -> bool:
    if raw is prev:
        return True
    if not isinstance(raw, dict) or not isinstance(prev, dict) or raw.keys() != prev.keys():
        return False
    for k, v in raw.items():
        w = prev[k]
        if v is w or k == "sampling_seed":
            continue
        if type(v) is not type(w) or (v != w if not isinstance(v, (list, dict)) else repr(v) != repr(w)):
            return False
    return True


def _integer(key: str, value: Any, low: int) -> None:
    """``value`` is an int in ``[low, 2**63)``: the engine hands ids, seeds and ``top_k`` to int64 tensors,
    where a larger one overflows inside a decode step."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(f"sampling_params.{key}: expected an integer, got {value!r}")
    if not low <= value < INT64:
        raise SamplingError(f"sampling_params.{key}: must be in [{low}, 2**63), got {value}")


def sample_tokens(logits, params: list[RequestSampling], steps: list[int] | None = None,
                  fused: bool | None = None):
    """Pick one token per row and its log-prob under ``softmax(logits / T)``.

    :param logits: ``[B, V]`` float logits of the next token.
    :param params: ``B`` per-row parameters.
    :param steps: per-row count of tokens the request has generated so far; needed only for rows with
        a ``sampling_seed`` (their draw is a function of ``(seed, step)``, see :func:`seeded_uniform`).
    :param fused: take the one-pass Triton kernel (``sampling_kernel``) for an all-greedy batch or one
        sampled at one temperature without truncation or seeds; None: wherever it can run (CUDA with
        Triton). Its greedy tokens are torch's; its sampled ones follow the same distribution through
        other draws (an inverse-CDF draw instead of ``multinomial``).
    :returns: ``(tokens [B] int64, logprobs [B] float32)``, on the logits' device.

    The path is chosen from the Python parameters, never from device values (that would be a
    device-to-host sync per step): a batch that is all greedy, or all sampled at one temperature
    without truncation or seeds, needs no per-row tensors built from Python lists.
    """
    import torch

    temperature = uniform_temperature(params)
    seeded = any(p.sampling_seed is not None for p in params)
    if temperature is not None and not seeded and fused_kernel_on(fused, logits.device):
        from posttrain.plugins.engines.local.sampling_kernel import fused_sample

        return fused_sample(logits if logits.stride(-1) == 1 else logits.contiguous(), temperature)
    logits = logits.float()
    if temperature == 0.0:  # every row greedy (seeds do not matter): argmax, log-prob at T = 1
        logprobs = _log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
    elif temperature is not None and not seeded:
        logprobs = _log_softmax(logits / temperature, dim=-1)
        tokens = torch.multinomial(logprobs.exp(), 1).squeeze(1)
    else:
        return _sample_mixed(logits, params, steps)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def fused_temperature(params: list[RequestSampling], fused: bool | None, device) -> float | None:
    """The temperature at which ``sampling_kernel.fused_sample`` draws this batch (``0.0``: greedy), or
    None where the batch takes the torch paths: mixed rows, truncation or seeds, ``fused`` False, or (``fused``
    None) off CUDA or without Triton. A function of the Python parameters only (no device value is read)."""
    if not fused_kernel_on(fused, device):  # the cheap checks first: the rows are scanned only where it can run
        return None
    temperature = uniform_temperature(params)
    if temperature is None or any(p.sampling_seed is not None for p in params):
        return None
    return temperature


def fused_kernel_on(fused: bool | None, device) -> bool:
    """Whether the one-pass kernel may draw on ``device``: ``fused`` True, or None on CUDA with Triton."""
    if fused is not None:
        return bool(fused)
    if not _on_cuda(device):
        return False
    from posttrain.plugins.engines.local.sampling_kernel import fused_sample_available

    return fused_sample_available()


def uniform_temperature(params: list[RequestSampling]) -> float | None:
    """``0.0`` when every row is greedy; ``T`` when every row samples at temperature ``T`` with no
    top-p / top-k / min-p; ``None`` otherwise (mixed rows, truncation, or an empty batch)."""
    if not params:
        return None
    if all(p.greedy for p in params):
        return 0.0
    t = params[0].temperature
    if all(p.temperature == t and not p.greedy and p.top_p >= 1.0 and p.top_k <= 0 and p.min_p <= 0.0
           for p in params):
        return t
    return None


_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer hash (xor-shift-multiply rounds) on an int64 tensor holding values < 2**32.
    Multipliers stay below 2**31 so no product overflows int64."""
    for mult in (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39):
        x = x ^ (x >> 16)
        x = (x * mult) & _MASK32
    return x ^ (x >> 15)


def seeded_uniform(seeds, steps, vocab: int):
    """Uniform draws in (0, 1) of shape ``[B, V]``, a pure function of ``(seed, step, token id)``.

    ``seeds`` and ``steps`` are ``[B]`` int64. A counter-based hash rather than a ``torch.Generator``
    per row: the draw for a request does not depend on which other requests share its batch, its slot,
    or the device, so a seeded request reproduces exactly under any scheduling (SGLang's
    ``sampling_seed`` makes the same promise with its own hash). One vectorized pass for the batch.
    """
    import torch

    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    row = _mix32((seeds & _MASK32) ^ _mix32(((seeds >> 32) & _MASK32) ^ (steps * 0x3C6EF372 & _MASK32)))
    h = _mix32(row[:, None] ^ ((ids[None, :] * 0x61C88647) & _MASK32))
    return (h.to(torch.float64) + 0.5) / 2.0**32


def _sample_mixed(logits, params: list[RequestSampling], steps: list[int] | None):
    """The general path: per-row temperatures, truncation and seeds; greedy rows mixed in.
    ``logits`` ``[B, V]`` float32 -> ``(tokens [B], logprobs [B])``. At least one row is not greedy.

    Seeded rows draw by the exponential race ``argmax_v p_v / E_v`` with ``E_v = -log U_v`` (the
    Gumbel-max trick), ``U`` from :func:`seeded_uniform`; that picks ``v`` with probability ``p_v``.
    """
    import torch

    device = logits.device
    temps = to_device([p.temperature if not p.greedy else 1.0 for p in params], device)
    logprobs = _log_softmax(logits / temps[:, None], dim=-1)
    probs = logprobs.exp()
    if any(p.top_p < 1.0 or p.top_k > 0 or p.min_p > 0.0 for p in params if not p.greedy):
        probs = _truncate(probs, params)
    rows = [i for i, p in enumerate(params) if p.sampling_seed is not None and not p.greedy]
    tokens = torch.multinomial(probs, 1).squeeze(1) if len(rows) < len(params) else None
    if rows:
        if steps is None:
            raise ValueError("sample_tokens: rows with a sampling_seed need their steps")
        index = to_device(rows, device)
        seeds = to_device([params[i].sampling_seed for i in rows], device, torch.int64)
        step = to_device([steps[i] for i in rows], device, torch.int64)
        race = probs[index].double() / -torch.log(seeded_uniform(seeds, step, probs.shape[1]))
        drawn = race.argmax(dim=-1)
        tokens = drawn if tokens is None else tokens.index_copy(0, index, drawn)
    if any(p.greedy for p in params):
        greedy = to_device([p.greedy for p in params], device)
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _log_softmax(x, dim: int = -1):
    """``torch.log_softmax`` over the last dim, or ``exact.log_softmax`` in an exact-mode engine (the trainer's
    arithmetic, bit for bit)."""
    import torch

    from posttrain.core import exact

    return exact.log_softmax(x) if exact.enabled() else torch.log_softmax(x, dim=dim)


def to_device(values: list, device, dtype=None):
    """A host list as a tensor on ``device`` without a stream sync: on CUDA through pinned memory and an
    async copy (``torch.tensor(values, device="cuda")`` copies from pageable memory, which waits for the
    stream to drain: that would stall an overlapped engine until the step in flight ends)."""
    return to_host_pinned(values, device, dtype).to(device, non_blocking=True)


def to_host_pinned(values: list, device, dtype=None):
    """A host list as a CPU tensor, pinned where ``device`` is CUDA: the source of an async copy
    (``dst.copy_(src, non_blocking=True)``; torch keeps a pinned block until the copies that read it ran)."""
    import torch

    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory() if _on_cuda(device) else host


def _on_cuda(device) -> bool:
    """``device`` (a ``torch.device`` or a string such as ``"cuda:1"``) is a CUDA device."""
    return getattr(device, "type", str(device).split(":")[0]) == "cuda"


def packed(tokens, logprobs):
    """``tokens`` ``[B]`` int64 and ``logprobs`` ``[B]`` float32 as one ``[2, B]`` float64 tensor, for one
    device-to-host copy: float64 holds token ids (< 2**53) and float32 values exactly."""
    import torch

    return torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)])


def to_host(tokens, logprobs) -> tuple[list[int], list[float]]:
    """``tokens`` ``[B]`` int64 and ``logprobs`` ``[B]`` float32 as Python lists, with one device-to-host
    copy (:func:`packed`)."""
    both = packed(tokens, logprobs).tolist()
    return [int(t) for t in both[0]], both[1]


def _truncate(probs, params: list[RequestSampling]):
    """Zero the tokens outside each row's top-k / top-p / min-p set (``probs`` ``[B, V]``)."""
    import torch

    device = probs.device
    top_p = to_device([p.top_p for p in params], device)
    top_k = to_device([p.top_k if p.top_k > 0 else probs.shape[1] for p in params], device)
    min_p = to_device([p.min_p for p in params], device)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=device)[None, :]
    cum_before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above this token
    keep = (rank < top_k[:, None]) & (cum_before <= top_p[:, None])  # SGLang drops cum_before > top_p
    keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    keep[:, 0] = True  # the most likely token always survives
    sorted_p = sorted_p * keep
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)
