"""``trainer.max_tokens_per_micro_batch: auto``: the tokens of one forward/backward pass, from a memory plan.

One trainer device holds the model's state, a fixed working set and the activations of one pass, which grow
with its tokens. With ``P`` parameters, ``L`` layers of width ``h`` (query width ``q``, key/value width
``kv``, MLP width ``f`` per token: the intermediate size, or the active experts' for a mixture of experts),
vocabulary ``V``, activations of ``a`` bytes (2 in bf16, 4 in float32) and device memory ``M``::

    state      = P * (a + 16)      weights, fp32 master copy (bf16 only: else a + 12), fp32 gradients, Adam's
                                   two moments; + P * a for a reference copy (KL terms), x 2 with a critic
    per token  = a * L * (6h + 2q + 2kv + 4f) + 2V
                                   what backward keeps per layer (norm inputs, Q/K/V, attention output, the
                                   MLP's gate, up and activation) and the bf16 logits kept for backward
    fixed      = 12 * C * V        fp32 logits, their softmax and gradient of one chunk of C tokens
                                   (``logits_chunk_tokens``; without chunks, 12V more per token)
    engines    = 0.12 * M + P * a  a colocated engine's share while the trainer trains (its weights, CUDA
                                   graphs and context: 0.107 M measured beside a 1.7B model); 0 on GPUs of its own
    tokens     = (M - engines - 3 GiB - state - fixed) / (1.25 * per token)

rounded down to a multiple of 1024, at least one sample (``max_prompt_len + max_new_tokens``) and at most
:data:`MAX_TOKENS` (beyond it a pass is no faster per token, and no device was measured there). 3 GiB is the
trainer's CUDA context and what its first step allocates outside the allocator; 1.25 the margin for the
allocator's fragmentation. For Qwen3-1.7B in bf16 (``P`` = 1.72e9, embeddings tied; ``C`` = 4096) the per-token
estimate is 2.58 MiB against 2.55 measured (trainer peak 76.5 GiB at 16,384 tokens, state 28.8 GiB), and the
plan gives 8,192 tokens on an 80 GB H100 and 16,384 on a 141 GB H200, colocated. On a CPU the plan is
:data:`CPU_TOKENS` (host memory is not the limit there; time per pass is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.core.gpu_memory import GIB

MAX_TOKENS = 16384
CPU_TOKENS = 8192
MIB = 1024 ** 2
OVERHEAD = 3 * GIB  # CUDA context and the first step's allocations outside the allocator
ENGINE_SHARE = 0.12  # a colocated engine's share of the device while the trainer trains (besides its weights)
MARGIN = 1.25  # activations x this: the allocator's fragmentation


@dataclass(frozen=True)
class Shape:
    """What the plan reads of a model (an HF ``config.json``)."""

    params: int
    layers: int
    hidden: int
    q_width: int
    kv_width: int
    mlp_width: int  # MLP intermediate width per token: dense, or the active experts' (top-k + shared)
    vocab: int

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Shape:
        h, layers, vocab = int(hf["hidden_size"]), int(hf["num_hidden_layers"]), int(hf["vocab_size"])
        heads = int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or h // heads)
        q, kv = heads * head_dim, int(hf.get("num_key_value_heads") or heads) * head_dim
        experts = int(hf.get("num_experts") or hf.get("n_routed_experts") or 0)
        if experts:
            expert = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
            shared = int(hf.get("shared_expert_intermediate_size") or 0) + \
                int(hf.get("n_shared_experts") or 0) * expert
            active = int(hf.get("num_experts_per_tok") or 1) * expert + shared
            mlp_params = 3 * h * (experts * expert + shared) + h * experts
        else:
            active = int(hf["intermediate_size"])
            mlp_params = 3 * h * active
        embeddings = vocab * h * (1 if hf.get("tie_word_embeddings") else 2)
        params = embeddings + layers * (2 * h * q + 2 * h * kv + mlp_params + 2 * h) + h
        return cls(params, layers, h, q, kv, active, vocab)


@dataclass(frozen=True)
class MicroBatchPlan:
    """The chosen tokens per pass and the figures it came from (bytes), for the start-up line."""

    tokens: int
    device: str
    total: int
    state: int
    fixed: int
    engines: int
    per_token: int

    def line(self) -> str:
        if not self.total:
            return f"trainer.max_tokens_per_micro_batch: auto -> {self.tokens} (on {self.device})"
        return (f"trainer.max_tokens_per_micro_batch: auto -> {self.tokens} ({self.device}, "
                f"{self.total / GIB:.1f} GiB: model state {self.state / GIB:.1f} GiB, logits {self.fixed / GIB:.1f} "
                f"GiB, engines {self.engines / GIB:.1f} GiB, {self.per_token / MIB:.2f} MiB per token)")


def plan(shape: Shape, *, total_bytes: int | None, device: str, sample_tokens: int, bf16: bool = True,
         colocated: bool = False, reference: bool = False, critic: bool = False,
         logits_chunk: int | None = None) -> MicroBatchPlan:
    """The micro-batch plan of the formulas above for one trainer device of ``total_bytes`` (None: a CPU)."""
    if not total_bytes:
        return MicroBatchPlan(max(CPU_TOKENS, sample_tokens), device, 0, 0, 0, 0, 0)
    a = 2 if bf16 else 4
    state = shape.params * (a + (16 if bf16 else 12)) * (2 if critic else 1) + (shape.params * a if reference else 0)
    per_token = a * shape.layers * (6 * shape.hidden + 2 * shape.q_width + 2 * shape.kv_width
                                    + 4 * shape.mlp_width) + 2 * shape.vocab
    if logits_chunk:
        fixed = 12 * logits_chunk * shape.vocab
    else:
        fixed, per_token = 0, per_token + 12 * shape.vocab
    engines = int(ENGINE_SHARE * total_bytes) + shape.params * 2 if colocated else 0
    room = total_bytes - engines - OVERHEAD - state - fixed
    tokens = int(room / (MARGIN * per_token)) // 1024 * 1024
    return MicroBatchPlan(max(sample_tokens, min(MAX_TOKENS, tokens)), device, total_bytes, state, fixed, engines,
                          per_token)


def plan_for(cfg: Any, hf_config: dict[str, Any], logits_chunk: int | None, critic: bool) -> MicroBatchPlan:
    """The plan of a run's trainer on the device this process trains on (CUDA's current device, else the CPU)."""
    import torch

    sample = (cfg.data.max_prompt_len or 0) + cfg.rollout.max_new_tokens
    total, device = None, "cpu"
    if torch.cuda.is_available():
        _, total = torch.cuda.mem_get_info()
        device = torch.cuda.get_device_name()
    return plan(Shape.from_hf(hf_config), total_bytes=total, device=device, sample_tokens=sample,
                bf16=getattr(cfg.model.config, "dtype", "bfloat16") != "float32", colocated=cfg.resources.colocate,
                reference=cfg.trainer.uses_reference, critic=critic, logits_chunk=logits_chunk)
