"""The ``local`` engine backend's options: one dataclass, read by the backend (``LocalEngine.Config``), passed whole
to ``rl-cli engine serve`` by ``launch()`` and rebuilt there through the same schema (``command``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from posttrain.core.schema import option


@dataclass
class EngineOptions:
    """The ``local`` backend's options (``rollout.engine`` in a run config): the one schema of ``LocalEngine.Config``
    and of ``rl-cli engine serve``'s flags, which ``launch()`` passes whole and ``serve`` rebuilds through it."""

    device: str = option("cpu", help="cpu | cuda (placed after the trainer's GPUs) | cuda:N")
    max_running_requests: int = option(32, ge=1, help="KV-cache slots (requests decoded together)")
    decode_attention: Literal["auto", "sdpa", "bmm", "triton"] = option(
        "auto", help="decode attention: auto = triton on a GPU (reads each request's own length), sdpa elsewhere")
    compile: bool = option(False, help="torch.compile the decode step (GPU; slower start)")
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = option(
        "default", help="with compile: Inductor's mode; max-autotune-no-cudagraphs times Triton matmul templates "
                        "against cuBLAS per shape (minutes more at start, cached on disk)")
    cuda_graphs: bool = option(True, help="GPU: the decode step captured in CUDA graphs (one per batch and "
                                          "span bucket), replayed at one launch a step")
    stable_memory: bool = option(
        True, help="GPU: weights and KV cache at fixed virtual addresses (CUDA VMM), so a memory release keeps "
                   "the CUDA graphs (no recapture each step); a run asks for it only where engines release "
                   "(colocated); off, or where the driver refuses: re-allocated")
    overlap: bool = option(
        True, help="GPU: launch decode step N + 1 before step N's tokens reach the host (the host's work on a "
                   "step hides behind the next one); same answers, each one step later")
    fused_sampling: bool = option(
        True, help="GPU: draw uniform batches (all greedy, or one temperature without top-p/top-k/min-p or seeds) "
                   "with a one-pass Triton kernel (an inverse-CDF draw: the same distribution as multinomial, other draws)")
    moe_kernel: bool = option(
        True, help="GPU: a MoE model's routing and experts through fused Triton kernels (fused top-k, grouped expert "
                   "GEMMs inside the CUDA graphs); off: transformers' per-expert loop")
    warm_up: bool = option(
        True, help="GPU: before it answers, the engine generates two tokens with the run's sampling, so the decode "
                   "step's compiles and CUDA graphs are ready for the first rollout (disaggregated: while the trainer "
                   "builds); off: they run in the first rollout")
    prefill_tokens: int = option(0, ge=0, help="prompt tokens per prefill batch (bounds its activation memory); "
                                               "0: 8192 on the CPU, 32768 on a GPU")
    context_length: int = option(0, ge=0, help="tokens per request; 0: the model's maximum (at most 4096)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", help="weights and KV cache: auto = float32 on the CPU; on a GPU the checkpoint's torch_dtype (a "
                     "float32 policy is sampled in float32), bfloat16 when it names none")
    exact: bool = option(
        False, help="batch-invariant arithmetic shared with the trainer: a sampled token's log-prob equals the "
                    "trainer's bit for bit (eager: compile, CUDA graphs and fused kernels off); a run sets it from "
                    "rollout.exact")
    request_timeout_s: float = option(
        60.0, gt=0.0, help="seconds a request body may take to arrive (a stalled or slow client gets HTTP 408 "
                           "and its connection closed); a connection idle this long is closed too")

    def validate(self) -> list[str]:
        device = self.device
        if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
            return [f"device: expected cpu, cuda or cuda:N, got {device!r}"]
        return []
