"""The local engine's decode step in CUDA graphs: one graph per (power-of-two batch bucket, 256-token span
bucket, sampling temperature or None), captured the first time a step meets its key and replayed after; the
first step at a temperature captures every batch bucket at once (:func:`warm`).

Every graph reads its inputs from slices of the runner's step buffers (``ModelRunner.step_tokens`` /
``step_positions``) and writes into one memory pool (``ModelRunner._graph_pool``: graphs never run at the
same time). A graph with a temperature also draws the step's tokens (``sampling_kernel.fused_sample``) and
leaves them in ``step_tokens``, the next step's input; every graph then adds one to ``step_positions[:bucket]``,
so a caller whose rows all move on by one position (the overlapped engine, mostly) needs no copy of positions
before the next replay.
"""

from __future__ import annotations

import sys
import time

import torch


def draw_into(logits: torch.Tensor, temperature: float, next_tokens: torch.Tensor):
    """The fused draw of ``logits`` ``[n, V]`` at ``temperature``, also written into ``next_tokens`` ``[n]``:
    ``(tokens, logprobs, [2, n] float64 of both)`` (``ModelRunner.decode_sampled``)."""
    from posttrain.plugins.engines.local.sampling import packed
    from posttrain.plugins.engines.local.sampling_kernel import fused_sample

    sampled, logprobs = fused_sample(logits, temperature)
    next_tokens.copy_(sampled)
    return sampled, logprobs, packed(sampled, logprobs)


def replay(runner, tokens, positions, need: int, temperature: float | None = None):
    """``runner``'s decode step of ``tokens``/``positions`` ``[nb]`` (``need``: the longest context) through
    its graph, captured first if new: ``temperature`` None returns ``(logits, routing)``; a float,
    ``((tokens, logprobs, [2, nb] float64 of both), routing)`` of the graph's own fused sampling. Views of the
    graph's static outputs: read them before the next step."""
    nb = tokens.shape[0]
    bucket = runner._bucket(nb)
    key = (bucket, runner._span(need), temperature)
    if key not in runner._graphs and temperature not in runner._warmed:
        warm(runner, key[1], temperature, needed=bucket)
    if key not in runner._graphs:
        capture(runner, *key)
    graph, static = runner._graphs[key]
    for name, given in (("tokens", tokens), ("positions", positions)):
        if given.data_ptr() != static[name].data_ptr():  # not already the step buffer's own slice
            static[name][:nb].copy_(given)
    if bucket > nb:
        static["positions"][nb:].zero_()
    graph.replay()
    if temperature is None:
        return static["logits"][:nb], static["routing"]
    return (static["sampled"][:nb], static["logprobs"][:nb], static["packed"][:, :nb]), static["routing"]


def buckets(runner) -> list[int]:
    """Every batch bucket of ``runner`` (``ModelRunner._bucket``'s values), largest first: ``max_slots``, then
    the powers of two below it down to the smallest bucket (1, or 2 for a compiled runner)."""
    out, b = [runner.max_slots], runner._bucket(1)
    while b < runner.max_slots:
        out.append(b)
        b *= 2
    return sorted(set(out), reverse=True)


def warm(runner, span: int, temperature: float | None, needed: int) -> None:
    """The first step at ``temperature`` (None: the logits graphs) captures every batch bucket's graph at
    ``span``. What a smaller bucket compiles (the attention's slots per program, its sequence splits, the
    sampler's chunk count: Triton kernels of their own) is then compiled at the run's first step, not when a
    later step's tail first shrinks into that bucket (over a second each, mid-run). A graph at another span,
    met later, reuses the compiled kernels.

    A bucket other than ``needed`` (the bucket of the step that asked) that runs out of GPU memory is skipped
    with a line on stderr: the step goes on, and that bucket is captured if a later step needs it (and fails
    then as a lazy capture would). Out of memory at ``needed`` is raised: the step itself cannot run."""
    runner._warmed.add(temperature)
    for bucket in buckets(runner):
        if (bucket, span, temperature) in runner._graphs:
            continue
        try:
            capture(runner, bucket, span, temperature)
        except torch.cuda.OutOfMemoryError:
            if bucket == needed:
                raise
            print(f"skipped the warm capture of the decode graph of {bucket} slots x {span} positions: out of GPU "
                  f"memory (captured if a step needs it)", file=sys.stderr, flush=True)


def capture(runner, bucket: int, span: int, temperature: float | None = None) -> None:
    """Capture ``runner``'s decode step of ``bucket`` slots over ``span`` positions (and its fused sampling at
    ``temperature``, unless None) into ``runner._graphs`` (one line on stderr each, with its seconds: the
    engine log then shows what a slow step captured; counted in ``runner.graph_totals``, which a run's metrics
    report per step)."""
    def step():
        logits = runner._decode_eager(static["tokens"], static["positions"], span)
        drawn = None if temperature is None else draw_into(logits, temperature, static["tokens"])
        static["positions"].add_(1)  # the next step's positions, for rows that move on by one
        return logits, drawn

    t0 = time.perf_counter()
    static = {"tokens": runner.step_tokens[:bucket], "positions": runner.step_positions[:bucket]}
    # The warm-up runs for real, each time at position 0 of slots 0 .. bucket-1 (what the step buffers hold
    # now may be a caller's last step, one position on): it writes K/V there, which may belong to requests in
    # flight, (sampling) draws over the step's input tokens, and moves the positions on. Keep all three and
    # put them back afterwards.
    k_cache, v_cache = runner.k_cache, runner.v_cache
    saved = (k_cache[:, :bucket, :, 0].clone(), v_cache[:, :bucket, :, 0].clone(), static["tokens"].clone(),
             static["positions"].clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels (and torch.compile) outside the graph
                static["positions"].zero_()
                step()
    finally:  # also after a failed warm-up (out of memory): the requests in flight keep their rows
        torch.cuda.current_stream().wait_stream(stream)
        k_cache[:, :bucket, :, 0] = saved[0]
        v_cache[:, :bucket, :, 0] = saved[1]
        static["tokens"].copy_(saved[2])
        static["positions"].copy_(saved[3])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=runner._graph_pool):
        static["logits"], drawn = step()
        static["routing"] = runner._step_routing
    if drawn is not None:
        static["sampled"], static["logprobs"], static["packed"] = drawn
    runner._graphs[(bucket, span, temperature)] = (graph, static)
    seconds = time.perf_counter() - t0
    runner.graph_totals["graph_captures"] += 1
    runner.graph_totals["graph_capture_s"] += seconds
    what = "" if temperature is None else f" sampling at temperature {temperature:g}"
    print(f"captured the decode graph of {bucket} slots x {span} positions{what} in {seconds:.2f} s",
          file=sys.stderr, flush=True)
