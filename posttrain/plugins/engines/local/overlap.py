"""The local engine's overlap mode: decode step N + 1 runs on the device while the host lands step N.

The sampled tokens of a step stay on the device as the next step's input (the runner's ``step_tokens``,
one per slot), so a step is launched without waiting for the previous one's tokens; those come back
through pinned memory with an async copy and a CUDA event, and the host appends them, checks stops and
answers requests while the device runs the next step (SGLang's overlap scheduler does the same).
Positions need no tokens: each request moves one position per step. A request whose last token is
sampled (its ``max_new_tokens`` or the context is reached) is not launched again; one that stops on a
token is decoded once more on the device, and that token is dropped when it lands. A batch the one-pass
sampler can draw (all greedy, or one temperature without truncation or seeds) is sampled inside the
runner's step (``ModelRunner.decode_sampled``: in its CUDA graph), with no sampler launches after it.
A graphed step also moves the runner's ``step_positions`` on by one (``graphs``): when every row of the next
step is one position further, as in a batch decoding in lockstep, no positions are copied to the device
(``device_positions``).
"""

from __future__ import annotations

import time
from typing import Any

from posttrain.plugins.engines.local.requests import InFlight, Request


class OverlappedDecode:
    """The overlap half of a :class:`~posttrain.plugins.engines.local.engine.BatchEngine`'s decode: the
    step in flight, the device-side next tokens and two pinned host buffers. Engine thread only."""

    def __init__(self, engine: Any, device_positions: bool = True):
        """``device_positions``: with CUDA graphs, skip the positions' host-to-device copy when the last graph
        left them in place (every row one further)."""
        self.engine = engine
        self.inflight: InFlight | None = None
        self._hosts: list[Any] = []  # two pinned [2 * max_slots] float64, used in turn
        self.device_positions = device_positions
        self._advanced: list[int] | None = None  # what the last graph left in step_positions[:nb], if known

    def step(self) -> None:
        """Launch a decode step from the device-side tokens, then land the step launched before it."""
        import torch

        from posttrain.plugins.engines.local.sampling import (fused_temperature, packed, sample_tokens, to_device,
                                                              to_host_pinned)

        t0 = time.perf_counter()
        engine, runner = self.engine, self.engine.runner
        limit = runner.context_length
        # a request whose last token is already sampled (its length or the context is reached) is not
        # launched again: it finishes when that token lands
        reqs = [r for _, r in sorted(engine._running.items())
                if r.launched < r.sampling.max_new_tokens and len(r.prompt_ids) + r.launched < limit]
        if not reqs:
            return self.land_inflight()
        slots = [r.slot for r in reqs]
        nb = slots[-1] + 1
        positions = [0] * nb
        for r in reqs:
            positions[r.slot] = len(r.prompt_ids) + r.launched - 1
        device = runner.device
        tokens = self._device_tokens()  # the runner's step_tokens: each slot's next input, in place
        params = [r.sampling for r in reqs]
        index = to_device(slots, device) if len(slots) != nb else None
        temperature = fused_temperature(params, engine.fused_sampling, device) if engine.sample_in_step else None
        step_positions = runner.step_positions[:nb]
        if positions != self._advanced:  # else the last graph left them there
            step_positions.copy_(to_host_pinned(positions, device), non_blocking=True)
            engine.stats.position_copies += 1
        self._advanced = [p + 1 for p in positions] if self.device_positions and runner.advances_positions else None
        host, top = self._host_buffer(len(reqs)), max(positions)
        if temperature is not None:  # a uniform batch: sampled inside the runner's step (its CUDA graph),
            # which also leaves the tokens in place as the next step's input
            out = runner.decode_sampled(tokens[:nb], step_positions, temperature, max_position=top, packed=True)
        else:
            out = runner.decode(tokens[:nb], step_positions, max_position=top)
        engine._keep_routing(slots, reqs)
        if temperature is not None:
            host.copy_(out if index is None else out[:, index], non_blocking=True)
        else:
            logits = out if index is None else out[index]
            try:
                sampled, logprobs = sample_tokens(logits, params, [r.launched for r in reqs], fused=engine.fused_sampling)
            except Exception:  # a row's own parameters break the batched draw: this step goes the synchronous way
                self._advanced = None
                self.land_inflight()
                kept, host_tokens, host_logprobs = engine._sample_isolated(reqs, logits)
                engine._advance(kept, host_tokens, host_logprobs)
                self.put_next_tokens(kept, host_tokens)
                return
            if index is None:
                tokens[:nb].copy_(sampled)
            else:
                tokens.index_copy_(0, index, sampled)
            host.copy_(packed(sampled, logprobs), non_blocking=True)
        ready = None
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        for r in reqs:
            r.launched += 1
        previous, self.inflight = self.inflight, InFlight(reqs, host, ready, time.perf_counter() - t0)
        engine.release_answered()  # the requests answered by the last landing, freed while this step runs
        if previous is not None:
            self._land(previous)

    def drop_inflight(self) -> None:
        """Forget the step in flight without landing it (a failed step: its requests are answered with the error),
        and what the last graph left in the positions."""
        self.inflight, self._advanced = None, None

    def land_inflight(self) -> None:
        """Land the step in flight, if any (before calls, pauses and idle waits: what runs then may replay
        graphs or move buffers, so the next step copies its positions again)."""
        self._advanced = None
        if self.inflight is not None:
            step, self.inflight = self.inflight, None
            self._land(step)

    def _land(self, step: InFlight) -> None:
        """Wait for ``step``'s tokens and append them; rows that finished or were aborted while it ran
        (a stop token one step earlier, an abort) drop theirs."""
        t0 = time.perf_counter()
        if step.ready is not None:
            step.ready.synchronize()
        tokens, logprobs = step.host.tolist()
        t1 = time.perf_counter()
        live = [i for i, r in enumerate(step.reqs) if r.finish is None]
        self.engine._advance([step.reqs[i] for i in live], [int(tokens[i]) for i in live], [logprobs[i] for i in live])
        self.engine.stats.add_decode(len(step.reqs), step.launch_s, t1 - t0, time.perf_counter() - t1)

    def _device_tokens(self):
        return self.engine.runner.step_tokens

    def put_next_tokens(self, reqs: list[Request], tokens: list[int]) -> None:
        """Write tokens known on the host (a prefill's first token) as their slots' next decode input."""
        import torch

        live = [(r.slot, t) for r, t in zip(reqs, tokens) if r.finish is None]
        for r in reqs:
            r.launched = len(r.output_ids)
        if live:
            both = torch.tensor(list(zip(*live)), device=self.engine.runner.device)  # [2, n]: one copy
            self._device_tokens()[both[0]] = both[1]

    def _host_buffer(self, n: int):
        """``[2, n]`` float64 host memory for a step's tokens and log-probs; two buffers used in turn (one
        may still be filled by the step in flight)."""
        import torch

        if not self._hosts:
            pin = self.engine.runner.device.type == "cuda"
            self._hosts = [torch.empty(2 * self.engine.runner.max_slots, dtype=torch.float64, pin_memory=pin)
                           for _ in range(2)]
        self._hosts.reverse()
        return self._hosts[0][: 2 * n].view(2, n)
