"""One pass over a decode step's logits for the two uniform sampling cases of ``sampling.sample_tokens``:
every row greedy, or every row sampled at one temperature ``T`` with no truncation and no seed.

For a row of logits ``z`` (``[V]``, any float dtype, read once and upcast to float32) and ``s = z / T``
(``s = z`` when greedy, whose log-prob is at ``T = 1``)::

    greedy:   token = argmax_v z_v                    (the first index among equal maxima, as torch's)
    sampled:  token = min { v : sum_{w <= v} exp(s_w - m) > u * sum_w exp(s_w - m) },  u ~ U(0, 1)
    logprob = s_token - logsumexp(s)                  (m = max_v s_v)

The sampled token is an inverse-CDF draw: it picks ``v`` with probability ``softmax(s)_v``, the same
distribution as ``torch.multinomial(softmax(s))`` (not the same draws: ``u`` comes from Triton's Philox
generator keyed by a seed drawn from torch's CUDA generator, so ``torch.manual_seed`` still makes a run
repeat). It needs one random number a row; the Gumbel-max draw it replaced (``argmax s_v - log(-log u_v)``)
needed one a logit and two logs, and was bound by them: 240 us against 43 greedy at 256 x 151,936 on an
H200. The torch path writes the whole ``[B, V]`` float32 log-softmax and reads it again (about 0.2 ms per
step there); these kernels read the logits once (a sampled row reads one chunk twice) and write ``B``
numbers.

Grid ``(B, C)``: program ``(b, c)`` walks chunk ``c`` of row ``b`` in blocks of ``BLOCK`` and keeps per
lane a running max and sum of ``exp`` (an online logsumexp), and when greedy the best logit with its index;
it writes one partial per (row, chunk). :func:`_merge_kernel` combines a row's ``C`` partials: greedy, it
gathers ``z_token`` and is done; sampled, it draws ``u`` and finds the chunk where the running sum of the
chunks' ``exp`` mass passes ``u * total``, and :func:`_pick_kernel` walks that one chunk of each row for the
index where its own running sum passes the rest. ``C`` is chosen from the batch size so small batches still
fill the GPU.

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

# launch defaults: the fastest of a grid at 256 x 151,936 bf16 on an H200 at a temperature (32 programs an SM: one
# program walks a row's picked chunk, so smaller chunks win), a little slower than 16 an SM when greedy
BLOCK = 1024  # logits per loop iteration of one program
NUM_WARPS = 4
PROGRAMS_PER_SM = 32  # programs aimed at per SM: sets the chunks of a row
_INT32_MAX = 2**31 - 1


@functools.lru_cache(maxsize=1)
def fused_sample_available() -> bool:
    """True when CUDA is present and ``triton`` imported."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _chunk_kernel(LOGITS, PART_M, PART_L, PART_K, PART_I, stride_row, vocab, chunk, temp,
                      SAMPLE: tl.constexpr, BLOCK: tl.constexpr):
        """Row ``b``, chunk ``c``: partial ``(max s, sum exp(s - max))``, and when greedy ``(best z, its index)``."""
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
            if not SAMPLE:
                take = s > best  # strict: a lane keeps its earliest index among equal logits
                best_i = tl.where(take, offs, best_i)
                best = tl.where(take, s, best)
        row_m = tl.max(m, 0)
        out = row.to(tl.int64) * chunks + c
        tl.store(PART_M + out, row_m)
        tl.store(PART_L + out, tl.sum(l * tl.exp(m - row_m), 0))
        if not SAMPLE:
            row_best = tl.max(best, 0)
            tl.store(PART_K + out, row_best)
            tl.store(PART_I + out, tl.min(tl.where(best == row_best, best_i, 2147483647), 0))  # the first index

    @triton.jit
    def _merge_kernel(LOGITS, SEED, PART_M, PART_L, PART_K, PART_I, TOKENS, LOGPROBS, stride_row, chunks, temp,
                      SAMPLE: tl.constexpr, CHUNKS_PAD: tl.constexpr):
        """Row ``b``: combine its chunks. Greedy: gather ``z_token``, write the token and ``z_token -
        logsumexp(z)``. Sampled: draw ``u``, and leave for :func:`_pick_kernel` the chunk ``c`` where the
        chunks' running ``exp`` mass (relative to ``m``) passes ``u * total`` (in ``PART_I[b, 0]``), what is left
        of ``u * total`` at its start (``PART_K[b, 0]``), ``m`` (``PART_M[b, 0]``) and ``log total``
        (``PART_L[b, 0]``), each row's first partial being read before it is overwritten."""
        row = tl.program_id(0)
        offs = tl.arange(0, CHUNKS_PAD)
        mask = offs < chunks
        at = row.to(tl.int64) * chunks + offs
        m = tl.load(PART_M + at, mask=mask, other=-1.0e30)
        l = tl.load(PART_L + at, mask=mask, other=0.0)
        row_m = tl.max(m, 0)
        w = l * tl.exp(m - row_m)  # each chunk's mass, relative to the row's max
        total = tl.sum(w, 0)
        first = row.to(tl.int64) * chunks
        if SAMPLE:
            target = tl.rand(tl.load(SEED), row) * total
            hit = (tl.cumsum(w, 0) > target) & mask & (w > 0)
            pick = tl.min(tl.where(hit, offs, CHUNKS_PAD), 0)
            # rounding can leave the target past the last sum: the last chunk with any mass then
            pick = tl.where(pick == CHUNKS_PAD, tl.max(tl.where(mask & (w > 0), offs, 0), 0), pick)
            tl.store(PART_I + first, pick)
            tl.store(PART_K + first, target - tl.sum(tl.where(offs < pick, w, 0.0), 0))
            tl.store(PART_M + first, row_m)
            tl.store(PART_L + first, tl.log(total))
        else:
            k = tl.load(PART_K + at, mask=mask, other=float("-inf"))
            i = tl.load(PART_I + at, mask=mask, other=2147483647)
            best = tl.max(k, 0)
            token = tl.min(tl.where(k == best, i, 2147483647), 0)  # chunks in order: the first index overall
            z = tl.load(LOGITS + row.to(tl.int64) * stride_row + token).to(tl.float32)
            tl.store(TOKENS + row, token.to(tl.int64))
            tl.store(LOGPROBS + row, z - row_m - tl.log(total))

    @triton.jit
    def _pick_kernel(LOGITS, PART_M, PART_L, PART_K, PART_I, TOKENS, LOGPROBS, stride_row, vocab, chunk, chunks,
                     temp, BLOCK: tl.constexpr):
        """Row ``b`` (sampled): walk the chunk :func:`_merge_kernel` picked for the first index where the chunk's
        running ``exp(s - m)`` passes what is left of the target (rounding past its end: the chunk's last index
        with any mass), write it and ``s_token - m - log total``."""
        row = tl.program_id(0)
        first = row.to(tl.int64) * chunks
        c = tl.load(PART_I + first)
        rest = tl.load(PART_K + first)
        row_m = tl.load(PART_M + first)
        log_total = tl.load(PART_L + first)
        base = LOGITS + row.to(tl.int64) * stride_row
        lanes = tl.arange(0, BLOCK)
        lo = c * chunk
        hi = tl.minimum(lo + chunk, vocab)
        running = 0.0
        token = 2147483647
        last = lo
        for start in range(lo, hi, BLOCK):
            offs = start + lanes
            mask = offs < hi
            s = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) / temp
            x = tl.exp(s - row_m)  # masked lanes: 0
            passed = ((running + tl.cumsum(x, 0)) > rest) & (x > 0)
            token = tl.minimum(token, tl.min(tl.where(passed, offs, 2147483647), 0))
            last = tl.maximum(last, tl.max(tl.where(x > 0, offs, 0), 0))
            running += tl.sum(x, 0)
        token = tl.where(token == 2147483647, last, token)
        z = tl.load(base + token).to(tl.float32) / temp
        tl.store(TOKENS + row, token.to(tl.int64))
        tl.store(LOGPROBS + row, z - row_m - log_total)


def _chunks(rows: int, vocab: int, device: torch.device, block: int = BLOCK,
            programs_per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int]:
    """``(chunks, chunk)`` per row: about ``programs_per_sm`` programs per SM in all, each at least one
    ``block``."""
    sms = sm_count(device)
    blocks = -(-vocab // block)
    chunks = max(1, min(-(-programs_per_sm * sms // max(rows, 1)), blocks, 64))
    chunk = -(-blocks // chunks) * block
    return -(-vocab // chunk), chunk


def fused_sample(logits: torch.Tensor, temperature: float, seed: torch.Tensor | None = None,
                 block: int | None = None, num_warps: int | None = None, programs_per_sm: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[B, V]`` (float32/bf16/fp16, unit stride along ``V``) -> ``(tokens [B] int64,
    logprobs [B] float32)`` on the logits' device: greedy when ``temperature == 0``, else the inverse-CDF
    draw at ``temperature`` (module docstring). ``seed``: a one-element int64 device tensor keying the
    draw (default: drawn from torch's generator of that device, no host sync). ``block``, ``num_warps``,
    ``programs_per_sm``: launch tuning (logits per loop iteration, a power of two >= 16; warps a program;
    the programs aimed at per SM, which sets the chunks a row; None: ``BLOCK``, ``NUM_WARPS``,
    ``PROGRAMS_PER_SM``). Two launches (three when sampled), no sync, no allocation beyond ``B x C`` partials
    and the outputs."""
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
    block = BLOCK if block is None else int(block)
    num_warps = NUM_WARPS if num_warps is None else int(num_warps)
    programs_per_sm = PROGRAMS_PER_SM if programs_per_sm is None else int(programs_per_sm)
    if block < 16 or block & (block - 1):
        raise ValueError(f"block: expected a power of two >= 16, got {block}")
    chunks, chunk = _chunks(rows, vocab, device, block, programs_per_sm)
    parts = [torch.empty(rows * chunks, dtype=dt, device=device)
             for dt in (torch.float32, torch.float32, torch.float32, torch.int32)]
    temp = float(temperature) if sample else 1.0
    seed_arg = seed if sample else tokens  # unread when greedy
    stride = logits.stride(0)
    _chunk_kernel[(rows, chunks)](logits, *parts, stride, vocab, chunk, temp, SAMPLE=sample, BLOCK=block,
                                  num_warps=num_warps)
    _merge_kernel[(rows,)](logits, seed_arg, *parts, tokens, logprobs, stride, chunks, temp,
                           SAMPLE=sample, CHUNKS_PAD=max(2, 1 << (chunks - 1).bit_length()), num_warps=1)
    if sample:
        _pick_kernel[(rows,)](logits, *parts, tokens, logprobs, stride, vocab, chunk, chunks, temp, BLOCK=block,
                              num_warps=num_warps)
    return tokens, logprobs
