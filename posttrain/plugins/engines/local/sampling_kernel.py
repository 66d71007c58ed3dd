"""One pass over a decode step's logits for the two uniform sampling cases of ``sampling.sample_tokens``:
every row greedy, or every row sampled at one temperature ``T`` with no truncation and no seed.

For a row of logits ``z`` (``[V]``, any float dtype, read once and upcast to float32) and ``s = z / T``
(``s = z`` when greedy, whose log-prob is at ``T = 1``)::

    greedy:   token = argmax_v z_v                    (the first index among equal maxima, as torch's)
    sampled:  token = argmax_v (s_v + g_v),  g_v = -log(-log u_v),  u_v ~ U(0, 1)
    logprob = s_token - logsumexp(s)

The sampled token is the Gumbel-max draw: it picks ``v`` with probability ``softmax(s)_v``, the same
distribution as ``torch.multinomial(softmax(s))`` (not the same draws: ``u`` comes from Triton's Philox
generator keyed by a seed drawn from torch's CUDA generator, so ``torch.manual_seed`` still makes a run
repeat). The torch path writes the whole ``[B, V]`` float32 log-softmax and reads it again (about 0.2 ms
per step at 256 x 151,936 on an H200); this kernel reads the logits once and writes ``B`` numbers.

Grid ``(B, C)``: program ``(b, c)`` walks chunk ``c`` of row ``b`` in blocks of ``BLOCK`` and keeps per
lane a running max and sum of ``exp`` (an online logsumexp) and the best key with its index; it writes
one partial per (row, chunk), and :func:`_merge_kernel` combines a row's ``C`` partials and gathers
``z_token``. ``C`` is chosen from the batch size so small batches still fill the GPU.

:func:`fused_sample_available`: CUDA and Triton present (``sampling`` then takes this path by default).
"""

from __future__ import annotations

import functools

import torch

from posttrain.plugins.engines.local.decode_kernel import sm_count

try:  # optional dependency: CPU-only installs have no triton
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - a missing or broken triton only disables the kernel
    triton = tl = None

BLOCK = 4096  # logits per loop iteration of one program
_INT32_MAX = 2**31 - 1


@functools.lru_cache(maxsize=1)
def fused_sample_available() -> bool:
    """True when CUDA is present and ``triton`` imported."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _chunk_kernel(LOGITS, SEED, PART_M, PART_L, PART_K, PART_I, stride_row, vocab, chunk, temp,
                      SAMPLE: tl.constexpr, BLOCK: tl.constexpr):
        """Row ``b``, chunk ``c``: partial ``(max s, sum exp(s - max), best key, its index)``."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        chunks = tl.num_programs(1)
        lo = c * chunk
        hi = tl.minimum(lo + chunk, vocab)
        lanes = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], -1.0e30, tl.float32)  # finite: exp(m - m_new) is never NaN
        l = tl.zeros([BLOCK], tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        base = LOGITS + row.to(tl.int64) * stride_row
        if SAMPLE:
            seed = tl.load(SEED) + row
        for start in range(lo, hi, BLOCK):
            offs = start + lanes
            mask = offs < hi
            s = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
            if SAMPLE:
                s = s / temp
            # one exp per element: with d = s - m, the new (m, l) is (m, l + e^d) when d <= 0 and
            # (s, l e^-d + 1) when d > 0, both from e = exp(-|d|) (masked lanes: d = -inf, e = 0)
            d = s - m
            e = tl.exp(-tl.abs(d))
            l = tl.where(d > 0, l * e + 1.0, l + e)
            m = tl.maximum(m, s)
            if SAMPLE:
                u = tl.maximum(tl.rand(seed, offs), 1.0e-12)
                key = s - tl.log(-tl.log(u))
            else:
                key = s
            key = tl.where(mask, key, float("-inf"))
            take = key > best  # strict: a lane keeps its earliest index among equal keys
            best_i = tl.where(take, offs, best_i)
            best = tl.where(take, key, best)
        row_m = tl.max(m, 0)
        row_l = tl.sum(l * tl.exp(m - row_m), 0)
        row_best = tl.max(best, 0)
        row_i = tl.min(tl.where(best == row_best, best_i, 2147483647), 0)  # the first index of the best key
        out = row.to(tl.int64) * chunks + c
        tl.store(PART_M + out, row_m)
        tl.store(PART_L + out, row_l)
        tl.store(PART_K + out, row_best)
        tl.store(PART_I + out, row_i)

    @triton.jit
    def _merge_kernel(LOGITS, PART_M, PART_L, PART_K, PART_I, TOKENS, LOGPROBS, stride_row, chunks, temp,
                      SAMPLE: tl.constexpr, CHUNKS_PAD: tl.constexpr):
        """Row ``b``: combine its chunks, gather ``z_token``, write the token and ``s_token - logsumexp(s)``."""
        row = tl.program_id(0)
        offs = tl.arange(0, CHUNKS_PAD)
        mask = offs < chunks
        at = row.to(tl.int64) * chunks + offs
        m = tl.load(PART_M + at, mask=mask, other=-1.0e30)
        l = tl.load(PART_L + at, mask=mask, other=0.0)
        k = tl.load(PART_K + at, mask=mask, other=float("-inf"))
        i = tl.load(PART_I + at, mask=mask, other=2147483647)
        row_m = tl.max(m, 0)
        total = tl.sum(l * tl.exp(m - row_m), 0)
        best = tl.max(k, 0)
        token = tl.min(tl.where(k == best, i, 2147483647), 0)  # chunks in order: the first index overall
        z = tl.load(LOGITS + row.to(tl.int64) * stride_row + token).to(tl.float32)
        if SAMPLE:
            z = z / temp
        tl.store(TOKENS + row, token.to(tl.int64))
        tl.store(LOGPROBS + row, z - row_m - tl.log(total))


def _chunks(rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """``(chunks, chunk)`` per row: about four programs per SM in all, each at least one ``BLOCK``."""
    sms = sm_count(device)
    blocks = -(-vocab // BLOCK)
    chunks = max(1, min(-(-4 * sms // max(rows, 1)), blocks, 64))
    chunk = -(-blocks // chunks) * BLOCK
    return -(-vocab // chunk), chunk


def fused_sample(logits: torch.Tensor, temperature: float, seed: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[B, V]`` (float32/bf16/fp16, unit stride along ``V``) -> ``(tokens [B] int64,
    logprobs [B] float32)`` on the logits' device: greedy when ``temperature == 0``, else the Gumbel-max
    draw at ``temperature`` (module docstring). ``seed``: a one-element int64 device tensor keying the
    draw (default: drawn from torch's generator of that device, no host sync). Two launches, no sync,
    no allocation beyond ``B x C`` partials and the outputs."""
    if triton is None:
        raise RuntimeError("fused_sample needs triton")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits: expected [B, V] with unit stride along V, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    rows, vocab = logits.shape
    if vocab > _INT32_MAX:
        raise ValueError(f"vocabulary of {vocab} does not fit int32 indices")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    device = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    if rows == 0:
        return tokens, logprobs
    sample = temperature > 0
    if sample and seed is None:
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)
    chunks, chunk = _chunks(rows, vocab, device)
    parts = [torch.empty(rows * chunks, dtype=dt, device=device)
             for dt in (torch.float32, torch.float32, torch.float32, torch.int32)]
    temp = float(temperature) if sample else 1.0
    seed_arg = seed if sample else tokens  # unread when greedy
    _chunk_kernel[(rows, chunks)](logits, seed_arg, *parts, logits.stride(0), vocab, chunk, temp,
                                  SAMPLE=sample, BLOCK=BLOCK, num_warps=8)
    _merge_kernel[(rows,)](logits, *parts, tokens, logprobs, logits.stride(0), chunks, temp,
                           SAMPLE=sample, CHUNKS_PAD=max(2, 1 << (chunks - 1).bit_length()), num_warps=1)
    return tokens, logprobs
