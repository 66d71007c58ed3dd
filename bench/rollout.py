"""Decode throughput of the local engine against HF ``generate`` on the same model and batch, one JSON line per variant.

    python bench/rollout.py                         # CPU, tiny Qwen3 (2 layers, hidden 64)
    python bench/rollout.py --device cuda --shape qwen3-1.7b --prompts 256 --prompt-len 128 --new-tokens 256

Both sides generate exactly ``new_tokens`` per prompt greedily (EOS ignored) from random prompts of
``prompt_len`` tokens; throughput is ``prompts x new_tokens / wall time`` (prefill included), after one
warm-up round each. The engine runs in-process (the scheduler thread and model runner the HTTP server
uses, without HTTP); ``--cuda-graphs`` (default on CUDA) captures its decode step.

Decode levers (``RunnerTuning`` fields): ``--decode-attention sdpa|bmm``, ``--compile``
(``--compile-mode``). ``--variants`` measures several in one call on the same built model, one JSON line
each, e.g. ``--variants sdpa,bmm,sdpa+compile,bmm+compile,sdpa+eager``: ``+``-joined words among
``sdpa``/``bmm`` (attention), ``compile``/``autotune`` (torch.compile, default or
max-autotune-no-cudagraphs mode), ``eager``/``graphs`` (CUDA graphs off/on), ``sync``/``overlap``,
``unfused``/``fused`` (projections), ``torchsample``/``fusedsample`` (torch's sampling or the Triton kernel),
``prefill8k``/``prefill32k`` (prompt tokens per prefill batch), ``floatlogits`` (the decode step's logits in
float32, not the model's dtype as the engine server takes them on a GPU), ``stepsample``/``aftersample``
(uniform batches sampled inside the decode step's graph, or by the kernel's own launches after it),
``stages2``/``stages3``/``stages4`` (pipeline stages of the triton decode attention), ``group1``/``2``/``4``/``8``/``16`` (its slots
per program), ``block32``/``64``/``128``, ``warps1``/``2``/``4``/``8`` (its positions per iteration, its warps),
``poshost``/``posdevice`` (the overlapped engine copies every step's positions to the device, or not where the
last graph moved them on), ``switch100us`` (the timed run under a GIL switch interval of 0.1 ms, not 5), ``moekernel``/``moehf`` (a MoE
model's routing and experts through the engine's Triton kernels, ``moe_kernel``: fused softmax top-k, two grouped
GEMM launches; or transformers' own experts),
``samplerBxWxP`` (the one-pass sampler's launch: logits per iteration, warps, programs per SM, set in
``sampling_kernel`` for this variant only, e.g. ``sampler2048x8x8``); unnamed
levers take the engine's defaults. A variant that fails prints
its line with ``error`` and the next one still runs. The HF baseline (unless ``--skip-hf``) runs once,
first, and its numbers go on every line.

``--profile`` adds where the time goes, in ms: ``decode_ms`` (the model's decode step alone at the full
batch and the mean context: graph replay, or the eager forward without graphs), ``decode_eager_ms``
(the eager forward too, when graphs are on: the difference is launch overhead), ``sampling_ms`` (greedy
sampling plus the device-to-host copy on full-batch logits), ``decode_sampled_ms`` (the step with its greedy
sampling inside, where the kernel runs), and from the timed run's engine steps
(``perf_counter`` around each phase, averaged over decode steps): ``step_ms`` (the whole step), split into
``step_launch_ms`` (host prep, H2D copy, enqueueing the forward), ``step_sample_ms`` (sampling and the
D2H copy, which waits for the device) and ``step_advance_ms`` (Python bookkeeping); ``mean_batch``,
``decode_steps``, ``prefill_s``; ``trace_gpu_busy`` and ``trace_ms_per_step``: one more engine run of
``--new-tokens`` under ``torch.profiler`` (device activity only), the fraction of its decode window in which
some kernel or copy ran (below 1: the device waited) and the window per decode step; ``trace_gap_us_per_step``
(the idle microseconds per step between consecutive device operations, by the names around each gap, top 10)
and ``trace_op_us_per_step`` (each operation's own time per step, top 10).
Every line also has where the timed run's wall time went outside the steps (``submit_ms``, ``admit_wait_ms``,
``between_steps_ms``, ``answer_ms``, ``answer_wake_ms``: :func:`run_outside_steps`) and ``engine_handoff_ms`` (a call
into the idle engine thread and back).
``--kernel-tables DIR`` writes a ``torch.profiler`` op table of a few eager decode steps per variant to
``DIR/<variant>.txt`` (inside a CUDA graph the ops are not visible), and one of a prefill batch as the engine
forms it to ``DIR/<variant>.prefill.txt``.

Memory-bandwidth bound (``--bandwidth-gbs``, default the card's datasheet figure where :data:`DATASHEET_GBS` names
it, 4800 for an H200 and 3350 for an H100 SXM, none on CPU or another card): each
decode step must read every weight once plus the KV cache of every running sequence, so
``bound = prompts / ((weight_bytes + kv_bytes_per_token x prompts x mean_context) / bandwidth)`` with
``mean_context = prompt_len + new_tokens / 2``; ``fraction_of_bound = engine_tok_s / bound``.
``weight_bytes`` (``decode_weight_bytes`` in the line) counts what a step reads (:func:`decode_read_bytes`):
an untied input embedding only its ``prompts`` rows, and for a MoE the routed experts that the batch's
tokens reach, expected ``E (1 - (1 - k/E)^prompts)`` per layer (``experts_read_per_layer``): at 256
prompts with top-8 of 128 that is all 128, so the bound counts every expert's weights each step; the
run's own last decode step's count is ``experts_hit_last_step``.

MoE: ``--shape qwen3-30b-a3b --layers N`` (``transformers.Qwen3MoeConfig``, random init; the engine runs
HF's grouped expert matmuls), ``--shape tiny-moe`` on the CPU.

Target on one H200, Qwen3-1.7B shape, 256 x 128 prompt tokens, 256 new tokens: >= 56k tok/s (half
the bandwidth bound with the prefill counted; ``target_tok_s``/``target_met`` appear only on an H200).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import threading
import time

SHAPES = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False),
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       tie_word_embeddings=True, rope_theta=1000000.0),
    # MoE shapes (transformers.Qwen3MoeConfig): 8 experts of width 32, 2 per token
    "tiny-moe": dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                          tie_word_embeddings=False, rope_theta=1000000.0),
}


DATASHEET_GBS = {"H200": 4800.0, "H100 80GB HBM3": 3350.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0}  # vendor's GB/s


def datasheet_bandwidth_gbs(device_name: str) -> float | None:
    """The memory bandwidth (GB/s) the vendor gives for the card named ``device_name``, or None if unknown."""
    return next((gbs for card, gbs in DATASHEET_GBS.items() if card in device_name), None)


def shape_config(shape: str, layers: int | None = None):
    """The ``transformers`` config of ``shape`` (``Qwen3MoeConfig`` for a MoE shape), cut to ``layers``."""
    import transformers

    kw = {**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})}
    cls = transformers.Qwen3MoeConfig if "num_experts" in kw else transformers.Qwen3Config
    return cls(**kw, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def build_model(shape: str, device: str, dtype, layers: int | None = None):
    import torch
    import transformers

    torch.manual_seed(0)
    config = shape_config(shape, layers)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def decode_read_bytes(model, batch: int) -> dict:
    """Weight bytes one decode step at ``batch`` running sequences reads (the bandwidth bound's numerator,
    KV cache aside): every matmul weight once, the input embedding only its ``batch`` rows (an untied table
    is not read whole; a tied one is, as the output layer), and of each MoE layer's ``E`` routed experts
    the expected number that at least one of the ``batch`` tokens picks with top-``k`` routing, taken as
    uniform and independent: ``E (1 - (1 - k/E)^batch)`` (at batch 256, top-8 of 128: 128.0, i.e. every
    expert; at batch 1: 8). Returns ``{weight_bytes, experts_read_per_layer}`` (the latter None if dense)."""
    cfg = model.config
    params = dict(model.named_parameters())
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    experts = int(getattr(cfg, "num_experts", 0) or 0)
    k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
    read = 0.0
    expert_bytes = 0
    for name, p in params.items():
        if p is embed and not tied:
            read += size(p) * min(batch, p.shape[0]) / p.shape[0]
        elif ".mlp.experts." in name:  # stacked [E, ...] tensors of one layer's routed experts
            expert_bytes += size(p)
        else:
            read += size(p)
    hit = experts * (1 - (1 - k / experts) ** batch) if experts else None
    if experts:
        read += expert_bytes * hit / experts
    return {"weight_bytes": int(read), "experts_read_per_layer": None if hit is None else round(hit, 2)}


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_engine(engine, prompts, new_tokens: int, marks: dict | None = None) -> float:
    """Generate for every prompt; return the wall seconds from the first submit to the last answer
    (``marks``: also ``start``, ``submitted``, ``answered`` and ``end``, ``perf_counter`` stamps of the first submit,
    the last submit, the last answer's callback in the engine thread and this thread's return from its wait).

    The prompts are queued while the engine is paused, so it admits them the same way every run
    (prefill batches of its token budget): the batch buckets then repeat run to run, and the warm-up
    runs have compiled and captured every shape the timed run meets. Submitting into a running engine
    instead lets it start on the first few prompts, at sizes that vary with thread timing."""
    from posttrain.plugins.engines.local.sampling import parse_sampling

    params = parse_sampling({"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True})
    done = threading.Event()  # set by the last answer: one wake-up, not one GIL hand-off per answer
    lengths, stamps = [], {}

    def finished(out):
        lengths.append(len(out["output_ids"]))
        if len(lengths) == len(prompts):
            stamps["answered"] = time.perf_counter()
            done.set()

    engine.pause(mode="in_place")
    start = time.perf_counter()
    engine.submit_many([(p, params, finished, None, -1) for p in prompts])  # one queue item, as a /generate
    submitted = time.perf_counter()
    engine.resume()
    done.wait()
    end = time.perf_counter()
    elapsed = end - start
    if marks is not None:
        marks.update(start=start, submitted=submitted, end=end, answered=stamps["answered"])
    assert all(n == new_tokens for n in lengths), "every request must produce new_tokens tokens"
    return elapsed


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_outside_steps(stats, marks: dict) -> dict:
    """Where a timed run's wall time went outside the engine's steps, in ms: ``submit_ms`` (the submits),
    ``admit_wait_ms`` (the last submit to the first prefill), ``between_steps_ms`` (the engine's loop between
    its steps: the span from the first prefill to the last step less their own times), ``answer_ms`` (the
    last step's end to the last answer) and of it ``answer_wake_ms`` (the last answer's callback to the waiting
    thread's return)."""
    if not stats.started:
        return {}
    inside = stats.prefill_s + stats.decode_s
    ms = lambda s: round(1e3 * s, 2)  # noqa: E731
    return {"submit_ms": ms(marks["submitted"] - marks["start"]), "admit_wait_ms": ms(stats.started - marks["submitted"]),
            "between_steps_ms": ms(stats.ended - stats.started - inside), "answer_ms": ms(marks["end"] - stats.ended),
            "answer_wake_ms": ms(marks["end"] - marks["answered"])}


def run_hf(model, prompts, new_tokens: int, device: str) -> float:
    import torch

    ids = torch.tensor(prompts, device=device)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    sync(device)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - start


VARIANT_WORDS = {"sdpa": {"decode_attention": "sdpa"}, "bmm": {"decode_attention": "bmm"},
                 "triton": {"decode_attention": "triton"},
                 "compile": {"compile": True, "compile_mode": "default"},
                 "autotune": {"compile": True, "compile_mode": "max-autotune-no-cudagraphs"},
                 "eager": {"cuda_graphs": False}, "graphs": {"cuda_graphs": True},
                 "sync": {"overlap": False}, "overlap": {"overlap": True},
                 "unfused": {"fuse_projections": False}, "fused": {"fuse_projections": True},
                 "torchsample": {"fused_sampling": False}, "fusedsample": {"fused_sampling": True},
                 "prefill8k": {"prefill_tokens": 8192}, "prefill32k": {"prefill_tokens": 32768},
                 "floatlogits": {"float_logits": True},
                 # rollout.exact (core.exact): patches the shared model's norms, activations and MoE blocks, so an
                 # exact variant runs after the others (--exact appends one)
                 "exact": {"exact": True, "fused_sampling": False, "cuda_graphs": False, "compile": False},
                 "stepsample": {"sample_in_step": True}, "aftersample": {"sample_in_step": False},
                 **{f"stages{n}": {"attention_launch": {"num_stages": n}} for n in (2, 3, 4)},
                 **{f"group{p}": {"attention_launch": {"slots_per_program": p}} for p in (1, 2, 4, 8, 16)},
                 **{f"block{n}": {"attention_launch": {"block_n": n}} for n in (32, 64, 128)},
                 **{f"warps{w}": {"attention_launch": {"num_warps": w}} for w in (1, 2, 4, 8)},
                 "poshost": {"device_positions": False}, "posdevice": {"device_positions": True},
                 "switch100us": {"switch_interval": 1e-4},
                 "moekernel": {"moe_kernel": True}, "moehf": {"moe_kernel": False}}
ENGINE_OPTIONS = ("overlap", "fused_sampling", "prefill_tokens", "sample_in_step",
                  "device_positions")  # BatchEngine's; the rest are RunnerTuning fields


def parse_variant(name: str, defaults: dict) -> dict:
    """``"bmm+compile"`` -> ``RunnerTuning`` and engine options (``decode_attention``, ``compile``, ``compile_mode``,
    ``cuda_graphs``) over ``defaults``."""
    opts = dict(defaults)
    for word in name.split("+"):
        launch = word.removeprefix("sampler").split("x")
        if word.startswith("sampler") and len(launch) == 3 and all(x.isdigit() for x in launch):
            opts["sample_launch"] = dict(zip(("BLOCK", "NUM_WARPS", "PROGRAMS_PER_SM"), map(int, launch)))
            continue
        if word not in VARIANT_WORDS:
            raise ValueError(f"variant {name!r}: unknown word {word!r}; valid: {', '.join(VARIANT_WORDS)}, "
                             "samplerBxWxP")
        for key, value in VARIANT_WORDS[word].items():  # launch settings add up: group8+block128
            opts[key] = {**opts.get(key, {}), **value} if key == "attention_launch" else value
    return opts


@contextlib.contextmanager
def sample_launch(launch: dict | None):
    """The one-pass sampler's launch defaults (``sampling_kernel.BLOCK``, ``NUM_WARPS``, ``PROGRAMS_PER_SM``) set
    to ``launch`` for one variant (``samplerBxWxP``), put back afterwards."""
    if not launch:
        yield
        return
    from posttrain.plugins.engines.local import sampling_kernel

    saved = {k: getattr(sampling_kernel, k) for k in launch}
    for k, v in launch.items():
        setattr(sampling_kernel, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(sampling_kernel, k, v)


def time_ms(fn, device: str, iters: int = 20, warmup: int = 3) -> float:
    """Mean wall milliseconds of ``fn()`` over ``iters`` back-to-back calls (synced at both ends only,
    so on CUDA it is device time whenever the host enqueues faster than the device runs)."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return round(1e3 * (time.perf_counter() - start) / iters, 3)


def profile_runner(runner, batch: int, position: int, device: str, prompt_len: int = 0, budget: int = 8192,
                   fused: bool | None = None) -> dict:
    """Decode step alone, eager forward, and sampling alone at ``batch`` slots all at ``position``; one
    prefill batch as the engine forms it (``prefill_batch_prompts`` distinct prompts of ``prompt_len``
    tokens, the engine's token ``budget``) in ``prefill_batch_ms``; sampling as the engine does (``fused``).
    Run in the engine thread while the engine is idle: it writes K/V into idle slots."""
    import torch

    from posttrain.plugins.engines.local.sampling import fused_temperature, parse_sampling, sample_tokens, to_host

    tokens = torch.randint(1, runner.vocab_size, (batch,), device=device)
    positions = torch.full((batch,), position, device=device)
    out = {"decode_ms": time_ms(lambda: runner.decode(tokens, positions, max_position=position), device)}
    if runner.cuda_graphs:
        span = runner._span(position + 1)  # the graph's span, so both attend over the same window
        out["decode_eager_ms"] = time_ms(lambda: runner._decode_eager(tokens, positions, span), device)
    logits = runner.decode(tokens, positions, max_position=position).clone()
    params = [parse_sampling({"temperature": 0})] * batch
    out["sampling_ms"] = time_ms(lambda: to_host(*sample_tokens(logits, params, fused=fused)), device)
    if fused_temperature(params, fused, runner.device) is not None:  # the step with its sampling (graphed)
        out["decode_sampled_ms"] = time_ms(lambda: runner.decode_sampled(tokens, positions, 0.0, position), device)
    if prompt_len:
        prompts = prefill_prompts(runner, batch, prompt_len, budget)
        n = len(prompts)
        out["prefill_batch_prompts"] = n
        out["prefill_batch_ms"] = time_ms(lambda: runner.prefill(list(range(n)), prompts), device, iters=5, warmup=1)
    return out


def prefill_prompts(runner, prompts: int, prompt_len: int, budget: int) -> list[list[int]]:
    """One prefill batch as the engine forms it: as many distinct random prompts of ``prompt_len`` tokens as the
    ``budget`` of prompt tokens holds (at least one, at most ``prompts``)."""
    import torch

    n = max(1, min(prompts, budget // max(1, prompt_len)))
    return torch.randint(1, runner.vocab_size, (n, prompt_len)).tolist()


def _op_table(prof, cuda: bool) -> str:
    averages = prof.key_averages()
    for key in (["self_device_time_total", "self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
        try:  # the device-time column's name changed across torch versions
            return averages.table(sort_by=key, row_limit=40)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=40)


def prefill_table(runner, prompts: int, prompt_len: int, budget: int, device: str, path: str) -> None:
    """Write ``torch.profiler``'s op table of one prefill batch as the engine forms it (``budget`` prompt
    tokens of distinct random prompts) to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    batch = prefill_prompts(runner, prompts, prompt_len, budget)
    n = len(batch)
    runner.prefill(list(range(n)), batch)
    sync(device)
    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        runner.prefill(list(range(n)), batch)
        sync(device)
    with open(path, "w") as f:
        f.write(_op_table(prof, cuda))


def device_events(prof) -> list[tuple[float, float, str]]:
    """``(start us, end us, name)`` of every kernel and copy ``prof`` (``torch.profiler``) saw on the device, in order."""
    import torch

    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)


def timeline(events, start: float, end: float, per: int = 1, top: int = 10) -> dict:
    """Where the device spent ``[start, end]`` (us): ``busy`` (the fraction in which some kernel or copy ran),
    ``gaps`` (idle us between consecutive operations, by the pair of names around each, per ``per``, the
    ``top`` largest) and ``ops`` (each operation's own us, likewise)."""
    busy, cursor = 0.0, start
    gaps: dict[str, float] = {}
    own: dict[str, float] = {}
    last_end, last_name = None, None
    for a, b, name in events:
        if b <= start or a >= end:
            continue
        a0, b0 = max(a, cursor), min(b, end)
        if b0 > a0:  # the union of the intervals
            busy += b0 - a0
            cursor = b0
        own[name[:60]] = own.get(name[:60], 0.0) + (min(b, end) - max(a, start))
        if last_end is not None and a > last_end:
            key = f"{last_name[:40]} -> {name[:40]}"
            gaps[key] = gaps.get(key, 0.0) + a - last_end
        if last_end is None or b > last_end:
            last_end, last_name = b, name
    ranked = lambda d: {k: round(v / per, 2) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]}  # noqa: E731
    return {"busy": round(busy / (end - start), 4) if end > start else None, "gaps": ranked(gaps), "ops": ranked(own)}


def gpu_busy(engine, prompts, new_tokens: int) -> dict:
    """One more engine run under ``torch.profiler`` (device activity only, so the host's pace is barely
    touched): the fraction of the decode window (the run's last ``decode_steps x step_ms``, after its
    prefill) in which a kernel or copy ran, and the window per decode step."""
    from torch.profiler import ProfilerActivity, profile

    engine.call_in_engine(engine.stats.reset)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_engine(engine, prompts, new_tokens)
        sync("cuda")
    stats = engine.call_in_engine(engine.stats.summary)
    events = device_events(prof)
    if not events:
        return {}
    # the decode window: the run's last ``decode_steps x step_ms`` (host-timed), after its prefill
    steps = max(1, int(stats["decode_steps"]))
    end = max(b for _, b, _ in events)
    start = max(events[0][0], end - 1e3 * stats["step_ms"] * steps)  # profiler times are in us
    # where the device waits: idle time per step between consecutive operations, by the pair of names around
    # it, and the operations' own time per step
    seen = timeline(events, start, end, per=steps)
    return {"trace_gpu_busy": seen["busy"], "trace_ms_per_step": round((end - start) / 1e3 / steps, 3),
            "trace_gap_us_per_step": seen["gaps"], "trace_op_us_per_step": seen["ops"]}


def prefill_busy(runner, prompts: int, prompt_len: int, budget: int) -> dict:
    """One prefill batch as the engine forms it (``budget`` prompt tokens of distinct random prompts) under
    ``torch.profiler``: its wall ms, the fraction of it the device was busy, and where it idled (us by the
    operations around each gap). Run in the engine thread while it is idle."""
    from torch.profiler import ProfilerActivity, profile

    batch = prefill_prompts(runner, prompts, prompt_len, budget)
    n = len(batch)
    runner.prefill(list(range(n)), batch)
    sync("cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        runner.prefill(list(range(n)), batch)
        sync("cuda")
        wall = time.perf_counter() - t0
    events = device_events(prof)
    if not events:
        return {}
    seen = timeline(events, events[0][0], max(b for _, b, _ in events), top=8)
    kernels = sum(b - a for a, b, _ in events)
    return {"prefill_wall_ms": round(1e3 * wall, 2), "prefill_device_ms": round(kernels / 1e3, 2),
            "prefill_busy": seen["busy"], "prefill_gap_us": seen["gaps"]}


def step_io(runner, batch: int, position: int, device: str) -> dict:
    """The overlapped engine's step as it runs in a batch decoding in lockstep, timed back to back:
    ``step_io_ms`` (positions copied from pinned host memory into the step buffer, the graphed step with its
    sampling, its ``[2, B]`` result copied into pinned host memory, an event) against ``step_graph_ms`` (the same
    graph alone, timed just before and after it and averaged: the GPU's clocks move with its power draw, and this
    runs after a prefill, so ``decode_sampled_ms`` from earlier is no baseline): the difference is what the copies
    cost between graphs."""
    import torch

    from posttrain.plugins.engines.local.sampling import to_host_pinned

    positions = [position] * batch
    host = torch.empty(2 * batch, dtype=torch.float64, pin_memory=True).view(2, batch)

    def graph():
        runner.step_positions[:batch].fill_(position)  # a device op: no host copy
        return runner.decode_sampled(runner.step_tokens[:batch], runner.step_positions[:batch], 0.0, position,
                                     packed=True)

    def one():
        runner.step_positions[:batch].copy_(to_host_pinned(positions, device), non_blocking=True)
        out = runner.decode_sampled(runner.step_tokens[:batch], runner.step_positions[:batch], 0.0, position,
                                    packed=True)
        host.copy_(out, non_blocking=True)
        torch.cuda.Event().record()

    before = time_ms(graph, device)
    io = time_ms(one, device)
    return {"step_io_ms": io, "step_graph_ms": round((before + time_ms(graph, device)) / 2, 3)}


def kernel_table(runner, batch: int, position: int, device: str, path: str) -> None:
    """Write ``torch.profiler``'s op table of 3 eager decode steps (plus sampling) to ``path``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from posttrain.plugins.engines.local.sampling import parse_sampling, sample_tokens, to_host

    tokens = torch.randint(1, runner.vocab_size, (batch,), device=device)
    positions = torch.full((batch,), position, device=device)
    params = [parse_sampling({"temperature": 0})] * batch
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    runner._decode_eager(tokens, positions, position + 1)  # first-call costs stay out of the table
    with profile(activities=activities) as prof:
        for _ in range(3):
            logits = runner._decode_eager(tokens, positions, position + 1)
            to_host(*sample_tokens(logits, params))
        sync(device)
    with open(path, "w") as f:
        f.write(_op_table(prof, cuda))


def experts_hit(routed) -> float | None:
    """Mean over MoE layers of the distinct experts that ``routed`` (``[n, L, k]`` expert ids of one
    forward pass, -1 on dense layers) sends tokens to."""
    if routed is None:
        return None
    per_layer = routed.reshape(-1, routed.shape[-2], routed.shape[-1]).transpose(0, 1).reshape(routed.shape[-2], -1)
    counts = [int((ids[ids >= 0]).unique().numel()) for ids in per_layer]
    counts = [c for c in counts if c]
    return round(sum(counts) / len(counts), 2) if counts else None


def bench_variant(model, prompts: list[list[int]], args, name: str, opts: dict, out: dict) -> None:
    """Build a runner with ``opts`` around ``model``, warm it up, time one full run into ``out``; with
    ``--profile``, add the step breakdown and the decode/sampling timings. ``out`` is filled as results
    come, so a later failure keeps what was measured; a failing profile only adds ``profile_error``.
    The runner is freed afterwards."""
    import torch

    from posttrain.plugins.engines.local.engine import BatchEngine
    from posttrain.plugins.engines.local.model_runner import ModelRunner, RunnerTuning

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    context = args.prompt_len + args.new_tokens + 1
    position = args.prompt_len + args.new_tokens // 2  # the run's mean context, for the profile
    tuning = {k: v for k, v in opts.items() if k not in (*ENGINE_OPTIONS, "switch_interval", "sample_launch")}
    tuning.setdefault("float_logits", not args.device.startswith("cuda"))  # as the engine server runs it
    runner = ModelRunner(None, device=args.device, dtype=dtype, max_slots=args.prompts, context_length=context,
                         tuning=RunnerTuning(**tuning), model=model)
    engine = BatchEngine(runner, tokenizer=None, eos_token_ids=[], **{k: opts.get(k) for k in ENGINE_OPTIONS})
    out.update(overlap=engine.overlap, fused_groups=runner.fused_groups, prefill_tokens=engine.prefill_tokens,
               fused_sampling=engine.fused_sampling,
               sample_in_step=engine.sample_in_step, rope_in_attention=runner.rope_in_attention,
               moe_kernel_blocks=runner.moe_kernel_blocks)
    try:
        from torch._dynamo.utils import counters

        graphs_before = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        run_engine(engine, prompts, min(args.new_tokens, 8))  # warm-up: kernels, allocator, graphs, compiles
        out["first_run_s"] = round(time.perf_counter() - start, 3)
        run_engine(engine, prompts, args.new_tokens)  # warm-up at full size (the graphs of the longer spans)
        out["warmup_s"] = round(time.perf_counter() - start, 3)
        out["compiled_graphs"] = counters["stats"]["unique_graphs"] - graphs_before
        engine.call_in_engine(engine.stats.reset)
        marks: dict = {}
        switch = sys.getswitchinterval()
        if opts.get("switch_interval"):  # the interpreter's GIL switch interval for the timed run only
            sys.setswitchinterval(opts["switch_interval"])
        try:
            engine_s = run_engine(engine, prompts, args.new_tokens, marks)
        finally:
            sys.setswitchinterval(switch)
        # a hand-off to the idle engine thread and back (call_in_engine), median of 5: the wake-up latency that
        # answer_wake_ms also pays
        out["engine_handoff_ms"] = round(1e3 * sorted(_timed(lambda: engine.call_in_engine(lambda: None))
                                                       for _ in range(5))[2], 3)
        out.update(engine_s=round(engine_s, 3), engine_tok_s=round(len(prompts) * args.new_tokens / engine_s, 1))
        out.update(run_outside_steps(engine.call_in_engine(lambda: engine.stats), marks))
        if runner.moe_top_k:  # the routing of the run's last decode step: how many experts it read
            out["experts_hit_last_step"] = engine.call_in_engine(lambda: experts_hit(runner.routed_experts))
        if args.profile:
            stats = engine.call_in_engine(engine.stats.summary)
            out.update(step_ms=stats["step_ms"], step_launch_ms=stats["launch_ms"], position_copies=stats["position_copies"],
                       step_sample_ms=stats["sample_ms"], step_advance_ms=stats["advance_ms"],
                       mean_batch=stats["mean_batch"], decode_steps=stats["decode_steps"], prefill_s=stats["prefill_s"])
            try:
                out.update(engine.call_in_engine(lambda: profile_runner(
                    runner, len(prompts), position, args.device, args.prompt_len, engine.prefill_tokens,
                    engine.fused_sampling)))
            except Exception as exc:  # instrumentation must not cost the throughput numbers
                out["profile_error"] = repr(exc)[:300]
            if args.device.startswith("cuda"):
                try:
                    if runner.cuda_graphs and engine.fused_sampling is not False:
                        out.update(engine.call_in_engine(lambda: step_io(runner, len(prompts), position, args.device)))
                    out.update(engine.call_in_engine(lambda: prefill_busy(runner, len(prompts), args.prompt_len,
                                                                          engine.prefill_tokens)))
                    out.update(gpu_busy(engine, prompts, args.new_tokens))
                except Exception as exc:
                    out["trace_error"] = repr(exc)[:300]
        if args.kernel_tables:
            os.makedirs(args.kernel_tables, exist_ok=True)
            path = os.path.join(args.kernel_tables, f"{name}.txt")
            try:
                engine.call_in_engine(lambda: kernel_table(runner, len(prompts), position, args.device, path))
                engine.call_in_engine(lambda: prefill_table(runner, len(prompts), args.prompt_len, engine.prefill_tokens,
                                                            args.device, path.removesuffix(".txt") + ".prefill.txt"))
            except Exception as exc:
                out["kernel_table_error"] = repr(exc)[:300]
    finally:
        engine.shutdown()
        engine = runner = None  # their GPU memory back before the next variant (closures above share the names)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="cut the shape to its first N layers")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--cuda-graphs", default=None, action=argparse.BooleanOptionalAction)
    ap.add_argument("--decode-attention", default="sdpa", choices=["auto", "sdpa", "bmm", "triton"])
    ap.add_argument("--compile", action="store_true", help="torch.compile the per-layer decode parts")
    ap.add_argument("--compile-mode", default="default", choices=["default", "max-autotune-no-cudagraphs"])
    ap.add_argument("--variants", default=None,
                    help="comma-separated variants, e.g. sdpa,bmm,bmm+compile (overrides the flags above)")
    ap.add_argument("--profile", action="store_true", help="add decode_ms, step_ms and their breakdown")
    ap.add_argument("--kernel-tables", default=None, metavar="DIR", help="write profiler op tables here")
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth for the bound (GB/s)")
    ap.add_argument("--skip-hf", action="store_true", help="measure the engine only")
    ap.add_argument("--exact", action="store_true", help="also the exact-mode engine (rollout.exact), measured last "
                                                         "in the same call: decode tok/s against the default's")
    args = ap.parse_args()

    import torch

    cuda = args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    dtype = torch.bfloat16 if cuda else torch.float32
    defaults = {"decode_attention": args.decode_attention, "compile": args.compile, "compile_mode": args.compile_mode,
                "cuda_graphs": cuda if args.cuda_graphs is None else args.cuda_graphs, "fuse_projections": None}
    names = args.variants.split(",") if args.variants else [
        args.decode_attention + ("+compile" if args.compile else "")]
    if args.exact:
        names.append("exact")
    names.sort(key=lambda n: "exact" in n.split("+"))  # exact patches the shared model: after the others
    try:
        variants = [(name, parse_variant(name, defaults)) for name in names]
    except ValueError as exc:
        ap.error(str(exc))
    device_name = torch.cuda.get_device_name() if cuda else ""
    bandwidth = args.bandwidth_gbs if args.bandwidth_gbs is not None else datasheet_bandwidth_gbs(device_name)
    model = build_model(args.shape, args.device, dtype, args.layers)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
    total = args.prompts * args.new_tokens

    common = {"bench": "rollout", "device": device_name if cuda else f"cpu {platform.machine()} "
              f"{torch.get_num_threads()} threads", "shape": args.shape, "layers": model.config.num_hidden_layers,
              "dtype": str(dtype).removeprefix("torch."),
              "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    hf: dict = {}
    if not args.skip_hf:  # first, once: its numbers go on every variant's line
        run_hf(model, prompts, min(args.new_tokens, 8), args.device)  # warm-up
        hf_s = run_hf(model, prompts, args.new_tokens, args.device)
        hf = {"hf_generate_s": round(hf_s, 3), "hf_generate_tok_s": round(total / hf_s, 1)}
        if cuda:
            torch.cuda.empty_cache()
    cfg = model.config
    read = decode_read_bytes(model, args.prompts)
    weight_bytes = read["weight_bytes"]
    common.update(params=sum(p.numel() for p in model.parameters()), decode_weight_bytes=weight_bytes,
                  experts_read_per_layer=read["experts_read_per_layer"])
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    mean_context = args.prompt_len + args.new_tokens / 2
    bound = None
    if bandwidth:
        bound_step_s = (weight_bytes + kv_per_token * args.prompts * mean_context) / (bandwidth * 1e9)
        bound = args.prompts / bound_step_s

    for name, opts in variants:
        result = dict(common, variant=name, decode_attention=opts["decode_attention"], compile=opts["compile"],
                      compile_mode=opts["compile_mode"] if opts["compile"] else None, cuda_graphs=opts["cuda_graphs"],
                      fuse_projections=opts["fuse_projections"])
        try:
            with sample_launch(opts.get("sample_launch")):
                bench_variant(model, prompts, args, name, opts, result)
        except Exception as exc:  # one broken lever must not hide the others' numbers
            result["error"] = repr(exc)[:500]
        result.update(hf)
        tok_s = result.get("engine_tok_s")
        if hf and tok_s:
            result["speedup"] = round(tok_s / hf["hf_generate_tok_s"], 2)
        if bound:
            result.update(bandwidth_gbs=bandwidth, bandwidth_bound_tok_s=round(bound, 1))
            if tok_s:
                result["fraction_of_bound"] = round(tok_s / bound, 3)
                result["bound_step_ms"] = round(1e3 * args.prompts / bound, 3)
        if args.shape == "qwen3-1.7b" and "H200" in device_name and tok_s:
            result["target_tok_s"] = 56000  # one H200: half the bandwidth bound, prefill counted
            result["target_met"] = tok_s >= 56000
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
