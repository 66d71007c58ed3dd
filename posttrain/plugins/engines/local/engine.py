"""The local engine's scheduler: continuous batching over :class:`ModelRunner` in one thread.

Requests arrive from the HTTP server (any thread) through :meth:`BatchEngine.submit`; the engine
thread loops:

1. take new requests and aborts; while paused, do nothing else;
2. admit waiting requests into free slots (one batched prefill per step) and sample their first token;
3. run one decode step for every running request and sample the next token per request;
4. finish requests on a stop token, a stop string, ``max_new_tokens``, the context end, or an abort,
   and hand each result to its callback.

Work that must not interleave with a forward pass (weight loads) goes through :meth:`call_in_engine`,
which runs a function in the engine thread between two steps.

A decode step keeps host work and device syncs low: one host-to-device copy for tokens and positions,
the attention span from Python ints (no ``positions.max()`` sync), a sampling path picked from the
Python parameters, and one device-to-host copy for the sampled tokens and their log-probs. An answer's
``output_token_logprobs`` are ``(logprob, id, None)`` tuples (JSON writes them as the protocol's arrays):
built in this thread between two steps, at a third of the cost of lists.
:class:`StepStats` (``engine.stats``) times each phase of every step with ``perf_counter``.

**Overlap** (``overlap=True``, the default on a GPU; module ``overlap``): step ``N + 1`` is launched from
the device-side tokens of step ``N`` before those reach the host, and the host lands step ``N`` while the
device runs ``N + 1``: the same answers (greedy and seeded rows token for token), each one step later.
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from posttrain.plugins.engines.local.overlap import OverlappedDecode
from posttrain.plugins.engines.local.requests import FairQueue, Request, StepStats, check_finish, input_logprobs
from posttrain.plugins.engines.local.texts import AnswerTexts

if TYPE_CHECKING:
    from posttrain.plugins.engines.local.sampling import RequestSampling


class BatchEngine:
    """Continuous-batching generation over a HF checkpoint. Thread-safe public methods."""

    def __init__(self, runner, tokenizer, eos_token_ids: list[int], overlap: bool | None = None,
                 fused_sampling: bool | None = None, prefill_tokens: int | None = None, sample_in_step=None,
                 device_positions: bool | None = None):
        """``overlap``: launch decode step N + 1 before step N's tokens reach the host (module docstring); None:
        on when the runner is on a GPU (on a CPU every op finishes before the next is issued). ``fused_sampling``:
        draw uniform batches with the one-pass Triton kernel (``sampling_kernel``; None: where it runs, CUDA);
        ``sample_in_step`` (None: on): with overlap, inside the runner's step (``ModelRunner.decode_sampled``).
        ``prefill_tokens``: prompt tokens per prefill batch (it bounds the prefill's activation memory; None:
        8,192 on a CPU, 32,768 on a GPU, where one batch of 256 prompts of 128 tokens prefills faster than four);
        ``device_positions`` (None: on): ``overlap.OverlappedDecode``'s."""
        self.runner, self.fused_sampling, self.sample_in_step = runner, fused_sampling, sample_in_step is not False
        on_gpu = runner.device.type == "cuda"
        self.prefill_tokens = (32768 if on_gpu else 8192) if prefill_tokens is None else int(prefill_tokens)
        if self.prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        on = on_gpu if overlap is None else bool(overlap)
        self._overlap = OverlappedDecode(self, device_positions is not False) if on else None
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.weight_version = "0"
        self._inbox: queue.Queue = queue.Queue()
        self._waiting = FairQueue()  # round-robin across submissions: a big batch cannot starve a small request
        self._running: dict[int, Request] = {}
        self._free_slots = list(range(runner.max_slots))
        self._abort_rids: set[str] = set()
        self._abort_all = False
        self._paused = False
        self._held = False  # pause() asked for and no resume() since: a submit need not wake the engine (resume does)
        self._calls: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="posttrain-engine", daemon=True)
        self.steps = 0
        self.stats = StepStats()
        self._ids = itertools.count()
        self._rid_prefix = uuid.uuid4().hex[:16]
        self.texts = AnswerTexts(tokenizer) if tokenizer is not None else None  # the answers' text
        # answered requests, freed after the next step's launch or once idle (release_answered): freeing a batch's
        # token lists (256 x 512 Python numbers) holds the GIL for milliseconds, which right after the answers
        # delayed the thread waiting for them by 3-5 ms on an H200's host
        self._answered: list[Request] = []
        self._thread.start()

    # -- public, any thread ---------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], sampling: RequestSampling, return_logprob: bool,
               on_done: Callable[[dict[str, Any]], None], rid: str | None = None, logprob_start_len: int = -1,
               return_routed_experts: bool = False) -> str:
        """Queue a request; ``on_done`` gets SGLang's answer. ``logprob_start_len >= 0`` (with
        ``return_logprob``) also scores the prompt's tokens from that position (``input_token_logprobs``);
        with ``max_new_tokens: 0`` that is all the request does (a teacher scoring a sample).
        ``return_routed_experts`` (MoE models): ``meta_info.routed_experts`` holds the expert ids of every
        token the model read."""
        return self.submit_many([(prompt_ids, sampling, on_done, rid, logprob_start_len)], return_logprob,
                                return_routed_experts)[0]

    def submit_many(self, rows: list[tuple], return_logprob: bool = False, return_routed_experts: bool = False
                    ) -> list[str]:
        """:meth:`submit` for several requests, ``rows`` of ``(prompt_ids, sampling, on_done, rid, logprob_start_len)``:
        one queue item and one wake-up for all, so the engine admits a ``/generate`` of many rows together rather
        than starting on the first few while the rest arrive (and trading the GIL with the submitter per row)."""
        reqs = [Request(rid or f"{self._rid_prefix}{next(self._ids)}", list(ids), sampling, return_logprob, on_done, start,
                        return_routed_experts=return_routed_experts)  # rid: unique per engine (uuid4 cost 5%)
                for ids, sampling, on_done, rid, start in rows]
        self._inbox.put(reqs)
        if not self._held:  # a paused engine only moves them to its queue: resume() wakes it once for all
            self._wake.set()
        return [r.rid for r in reqs]

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """End matching requests (queued or running) with finish reason ``abort``."""
        self._inbox.put(("abort", rid, abort_all))
        self._wake.set()

    def pause(self, mode: str = "abort") -> None:
        """Stop stepping. ``abort`` ends in-flight requests first; ``in_place``/``retract`` keep them."""
        if mode == "abort":
            self.abort(abort_all=True)
        self._held = True
        self._inbox.put(("pause", True))
        self._wake.set()
        self.call_in_engine(lambda: None)  # returns once the engine has taken the pause

    def resume(self) -> None:
        self._held = False
        self._inbox.put(("pause", False))
        self._wake.set()

    def call_in_engine(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn`` in the engine thread between two steps (runs even while paused); return its value."""
        done = threading.Event()
        box: dict[str, Any] = {}
        self._calls.put((fn, done, box))
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError("engine did not run the call in time")
        if "error" in box:
            raise box["error"]
        return box["value"]

    @property
    def num_requests(self) -> int:
        return len(self._running) + len(self._waiting) + self._inbox.qsize()

    @property
    def queue_depths(self) -> dict[str, int]:
        """Requests decoding now, and those waiting for a slot (queued or not yet taken in): a run's stall report
        reads them from ``/server_info``."""
        return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._waiting) + self._inbox.qsize()}

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def overlap(self) -> bool:
        return self._overlap is not None

    @property
    def paused(self) -> bool:
        return self._paused

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # -- engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        import torch

        torch.set_grad_enabled(False)
        while not self._stop:
            self._drain()
            if not self._calls.empty():
                self._land_inflight()  # calls (weight loads, memory release) see every step finished
                self._run_calls()
            if self._paused or not (self._waiting or self._running):
                self._land_inflight()
                self._wake.wait(0.05)
                self._wake.clear()
                self.release_answered()
                continue
            try:
                self._admit()
                if self._running:
                    self._decode()
            except Exception as exc:  # a failing step must answer its requests, not hang them
                import traceback

                print(f"engine step failed; aborting {len(self._running) + len(self._waiting)} request(s):\n"
                      f"{traceback.format_exc()}", file=sys.stderr, flush=True)
                if self._overlap is not None:
                    self._overlap.drop_inflight()
                for req in list(self._running.values()) + list(self._waiting):
                    req.finish = {"type": "abort", "message": f"engine error: {exc!r}"}
                    self._complete(req)
                self._waiting.clear()
            self.steps += 1

    def release_answered(self) -> None:
        """Drop the engine's last references to answered requests (engine thread: after a launch, while the device
        works, or when idle)."""
        self._answered.clear()

    def _land_inflight(self) -> None:
        if self._overlap is not None:
            self._overlap.land_inflight()

    def _run_calls(self) -> None:
        while True:
            try:
                fn, done, box = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed back to the caller
                box["error"] = exc
            done.set()

    def _drain(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, list):  # submit_many's requests
                self._waiting.add(item)
            elif item[0] == "abort":
                _, rid, abort_all = item
                for req in list(self._waiting) + list(self._running.values()):
                    if abort_all or req.rid == rid:
                        req.finish = {"type": "abort", "message": "aborted by /abort_request"}
                        self._complete(req)
                self._waiting.drop_finished()
            elif item[0] == "pause":
                self._paused = item[1]

    def _admit(self) -> None:
        batch: list[Request] = []
        budget = self.prefill_tokens  # prompt tokens per prefill batch: bounds the prefill activation memory
        while self._waiting and self._free_slots and (not batch or budget > 0):
            req = self._waiting.popleft()
            limit = self.runner.context_length
            if len(req.prompt_ids) >= limit:  # checked by the server too; kept for direct callers
                req.finish = {"type": "abort", "message": f"prompt of {len(req.prompt_ids)} tokens exceeds the context"}
                self._complete(req)
                continue
            if req.sampling.max_new_tokens == 0 and not self._scores_input(req):
                req.finish = {"type": "length", "length": 0}
                self._complete(req)
                continue
            self._free_slots.sort()
            req.slot = self._free_slots.pop(0)
            batch.append(req)
            budget -= len(req.prompt_ids)
        if not batch:
            return
        t0 = time.perf_counter()
        starts = [r.logprob_start_len if self._scores_input(r) else None for r in batch]
        routing = None
        try:
            logits, scored = self.runner.prefill_scored([r.slot for r in batch], [r.prompt_ids for r in batch], starts)
            routing = self.runner.routed_experts  # [n, P, L, k] (MoE models)
        except Exception:  # find the request that fails alone (its prompt's routing is not kept)
            batch, logits, scored = self._prefill_each(batch, starts)
        generating, rows = [], []
        for row, (req, prompt_scores) in enumerate(zip(batch, scored)):
            req.input_logprobs = prompt_scores
            if req.return_routed_experts and routing is not None:
                req.routed.append(routing[row, : len(req.prompt_ids)])
            if req.sampling.max_new_tokens == 0:  # scored only: done after the prefill
                req.finish = {"type": "length", "length": 0}
                self._complete(req)
            else:
                self._running[req.slot] = req
                generating.append(req)
                rows.append(row)
        if generating:
            if len(generating) < len(batch):
                import torch

                logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
            kept, tokens, logprobs = self._sample_isolated(generating, logits)
            self._advance(kept, tokens, logprobs)
            if self._overlap is not None:
                self._overlap.put_next_tokens(kept, tokens)
        self.stats.add_prefill(t0)

    @staticmethod
    def _scores_input(req: Request) -> bool:
        return req.return_logprob and req.logprob_start_len >= 0

    def _decode(self) -> None:
        if self._overlap is not None:
            return self._overlap.step()
        import torch

        t0 = time.perf_counter()
        slots = sorted(self._running)
        reqs = [self._running[s] for s in slots]
        nb = slots[-1] + 1
        tokens, positions = [0] * nb, [0] * nb  # plain lists: per-element tensor writes cost ~10 us each
        for slot, req in zip(slots, reqs):
            tokens[slot] = req.output_ids[-1]
            positions[slot] = len(req.prompt_ids) + len(req.output_ids) - 1
        device = self.runner.device
        both = torch.tensor([tokens, positions], device=device)  # [2, nb]: one host-to-device copy
        logits = self.runner.decode(both[0], both[1], max_position=max(positions))
        self.release_answered()  # while a device works on the step
        self._keep_routing(slots, reqs)
        if len(slots) != nb:  # idle slots below the highest busy one: keep the busy rows only
            logits = logits[torch.tensor(slots, device=device)]
        t1 = time.perf_counter()
        sampled = self._sample_isolated(reqs, logits)
        t2 = time.perf_counter()
        self._advance(*sampled)
        self.stats.add_decode(len(reqs), t1 - t0, t2 - t1, time.perf_counter() - t2)

    def _keep_routing(self, slots: list[int], reqs: list[Request]) -> None:
        """Copy this decode step's expert ids (``[nb, L, k]``, overwritten by the next step) for the
        requests that asked for them: one gather on the device, no host sync."""
        from posttrain.plugins.engines.local.sampling import to_device

        routing = self.runner.routed_experts
        wanted = [i for i, req in enumerate(reqs) if req.return_routed_experts]
        if routing is None or not wanted:
            return
        rows = routing.index_select(0, to_device([slots[i] for i in wanted], routing.device))
        for j, i in enumerate(wanted):
            reqs[i].routed.append(rows[j: j + 1])

    def _sample(self, reqs: list[Request], logits) -> tuple[list[int], list[float]]:
        """Sample a token per request from ``logits`` ``[len(reqs), V]``; return tokens and log-probs as
        Python lists (one device-to-host copy: the step's only sync on the fast path)."""
        from posttrain.plugins.engines.local.sampling import sample_tokens, to_host

        return to_host(*sample_tokens(logits, [r.sampling for r in reqs], [len(r.output_ids) for r in reqs],
                                      fused=self.fused_sampling))

    def _sample_isolated(self, reqs: list[Request], logits) -> tuple[list[Request], list[int], list[float]]:
        """:meth:`_sample` for the batch; when that raises, row by row, so a request whose own parameters
        break the draw fails alone (its answer is an error) and the others get their tokens.
        Returns the requests that got a token, their tokens and log-probs."""
        if not reqs:
            return [], [], []
        try:
            return reqs, *self._sample(reqs, logits)
        except Exception:
            if len(reqs) == 1:
                self._fail(reqs[0], sys.exc_info()[1])
                return [], [], []
        kept, tokens, logprobs = [], [], []
        for i, req in enumerate(reqs):
            try:
                tok, lp = self._sample([req], logits[i:i + 1])
            except Exception as exc:
                self._fail(req, exc)
                continue
            kept.append(req)
            tokens += tok
            logprobs += lp
        return kept, tokens, logprobs

    def _prefill_each(self, batch: list[Request], starts: list[int | None]):
        """Prefill one request at a time after a batched prefill raised; the ones that fail alone are
        failed. Returns the others, their logits ``[n, V]`` and their input log-probs."""
        import torch

        kept, rows, scored = [], [], []
        for req, start in zip(batch, starts):
            try:
                logits, [lps] = self.runner.prefill_scored([req.slot], [req.prompt_ids], [start])
            except Exception as exc:
                self._fail(req, exc)
                continue
            kept.append(req)
            rows.append(logits)
            scored.append(lps)
        return kept, (torch.cat(rows) if rows else None), scored

    def _fail(self, req: Request, exc: BaseException) -> None:
        """End ``req`` with an error of its own (the server answers it with HTTP 400)."""
        print(f"engine: request {req.rid} failed alone: {exc!r}", file=sys.stderr, flush=True)
        req.finish = {"type": "abort", "message": f"engine error: {exc!r}"}
        req.error = f"request failed in the engine: {exc!r}"
        self._complete(req)

    def _advance(self, reqs: list[Request], tokens: list[int], logprobs: list[float]) -> None:
        """Append each request's new token and log-prob; complete the requests that finish (their texts
        decoded together: ``texts.AnswerTexts.decode_many``)."""
        done = []
        for req, tok, lp in zip(reqs, tokens, logprobs):
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            check_finish(req, tok, self.eos_token_ids, self.tokenizer, self.runner.context_length)
            if req.finish is not None:
                done.append(req)
        if self.texts is not None and len(done) > 1:
            for skip in {r.sampling.skip_special_tokens for r in done}:
                same = [r for r in done if r.sampling.skip_special_tokens == skip]
                for req, text in zip(same, self.texts.decode_many([r.output_ids for r in same], skip)):
                    req.text = text
        for req in done:
            self._complete(req)

    def _complete(self, req: Request) -> None:
        if req.slot >= 0:
            self._running.pop(req.slot, None)
            self._free_slots.append(req.slot)
            req.slot = -1
        s = req.sampling
        text = req.text  # decoded with the others of its step (_advance), or here
        if text is None:
            text = "" if self.texts is None else self.texts.decode(req.output_ids, s.skip_special_tokens)
        if req.text_cut is not None:
            text = text[: req.text_cut]
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": time.monotonic() - req.created,
        }
        if req.return_routed_experts and req.routed:
            # overlap decodes a request that stopped on a token once more: keep the rows of tokens it read
            meta["routed_experts"] = encode_routed_experts(req.routed, len(req.prompt_ids) + len(req.output_ids) - 1)
        req.routed = []
        if req.return_logprob:
            meta["output_token_logprobs"] = list(zip(req.logprobs, req.output_ids, itertools.repeat(None)))
            meta["input_token_logprobs"] = input_logprobs(req)
        result = {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
        if req.error is not None:
            result["error"] = req.error
        try:
            req.on_done(result)
        except Exception:  # the waiter went away (client disconnected): nothing to deliver to
            pass
        self._answered.append(req)


def encode_routed_experts(rows: list[Any], count: int | None = None) -> str:
    """SGLang's ``meta_info.routed_experts``: base64 of an int32 array ``[prompt + output - 1, L, k]`` in C
    order (every token the model read: the prompt, then each generated token but the last; ``L`` all
    decoder layers, -1 in dense ones). Decode with ``np.frombuffer(b64decode(s), np.int32).reshape(-1, L, k)``.
    ``count``: keep the first ``count`` rows."""
    import base64

    import torch

    return base64.b64encode(torch.cat(rows)[:count].to(device="cpu", dtype=torch.int32).contiguous().numpy().tobytes()).decode("ascii")
