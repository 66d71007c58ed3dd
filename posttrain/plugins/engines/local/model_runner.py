"""The forward passes of the local engine: a ``transformers`` causal LM run layer by layer over a static
KV cache with one slot per in-flight request.

The cache is two tensors ``k_cache, v_cache`` of shape ``[L, N, Hkv, S_max, D]`` (``L`` layers, ``N``
slots, ``Hkv`` KV heads, ``S_max`` the context length, ``D`` the head dim), allocated once. A request
owns one slot from prefill until it finishes; slot ``i`` holds its keys and values at positions
``0 .. len_i - 1``.

- **prefill** runs the prompts of newly admitted requests as one right-padded batch ``[n, P]`` with
  causal attention (right padding never leaks into valid positions under a causal mask) and writes
  their keys and values into their slots.
- **decode** runs one token for every slot ``0 .. nb - 1`` (``nb``: one past the highest busy slot;
  idle slots below it compute values nobody reads) at its own position ``pos_i``: the new key and
  value are written at ``pos_i`` and the query attends to cache positions ``<= pos_i``.

The weights, projections, norms, rotary embedding and MLP are the ``transformers`` modules of the
checkpoint's own class (Llama, Qwen2, Qwen3, GLM-4 with its sandwich norms and half-dim rotary); only the
attention over the slot cache is ours. On CUDA the decode step over a fixed ``(nb, S_max)`` can be
captured in a CUDA graph per (batch bucket, span bucket) (``cuda_graphs=True``).

Decode levers (constructor arguments, defaults are the safe baseline; ``bench/rollout.py`` compares them):

- ``decode_attention``: ``"sdpa"`` runs ``scaled_dot_product_attention`` over the GQA-grouped query
  with a boolean mask over the span bucket; ``"bmm"`` runs two batched matmuls with a float32 masked
  softmax between them; ``"triton"`` is our flash-decoding kernel (``decode_kernel``), which reads
  only each slot's own ``position + 1`` cache entries. All compute the same attention (equal to
  float32 rounding); ``"auto"`` picks ``triton`` on CUDA. On an H200 (Qwen3-1.7B shape, 256 slots)
  SDPA's masked kernel took ~70% of the step; triton + compile decodes 2.1x faster (bench/RESULTS.md).
- ``compile``: ``torch.compile`` (``fullgraph``, ``dynamic=False``) of the per-layer parts around the
  attention (norms, projections, rotary, residuals, SwiGLU MLP) so their elementwise work fuses. The
  KV-cache write and the attention stay eager: a compiled in-place write into a cache passed as an
  input may be functionalized into a copy of the whole cache layer. With ``triton`` the attention
  kernel writes the step's keys and values itself (``attention_writes_kv``): two launches fewer per
  layer. Decode batches are padded to the power-of-two bucket so the compiled code sees a handful of
  shapes (one compile per bucket).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from posttrain.plugins.engines.local.fused import Fused, fuse_layers, layer_parts, run_fused

DEFAULT_MAX_CONTEXT = 4096
DECODE_ATTENTION = ("sdpa", "bmm", "triton")  # "triton": decode_kernel.decode_attention
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


def _project_qkv(layer, h, cos, sin, rope, qkv: Fused | None = None):
    """A decoder layer up to its attention: input norm, Q/K/V projections, Qwen3's Q/K norms, rotary.

    ``h`` ``[n, q, hidden]``; ``cos``/``sin`` ``[n, q, D]`` -> ``q`` ``[n, H, q, D]``, ``k``/``v``
    ``[n, Hkv, q, D]``. A plain function of its inputs (no runner state) so ``torch.compile`` can
    reuse one compiled graph for every layer (the layer's parameters are graph inputs). ``qkv``: the
    three projections as one matmul (``fused.layer_parts``), else one module each.
    """
    attn = layer.self_attn
    n, q_len, _ = h.shape
    x = layer.input_layernorm(h)
    shape = (n, q_len, -1, attn.head_dim)
    if qkv is None:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    else:
        q, k, v = run_fused(qkv, x)
    q, k = q.view(shape), k.view(shape)
    v = v.view(shape).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm on queries and keys before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v


def _rotary_of(model):
    """The checkpoint's own ``apply_rotary_pos_emb(q, k, cos, sin)`` (from its modeling module): GLM's
    rotate only part of each head (and dense GLM-4 interleaved pairs); Llama's is the fallback."""
    import sys

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return getattr(sys.modules.get(type(model).__module__), "apply_rotary_pos_emb", apply_rotary_pos_emb)


def _finish_layer(layer, h, o, gate_up: Fused | None = None):
    """The rest of a decoder layer: output projection, residual, post-attention norm, MLP, residual.

    ``h`` ``[n, q, hidden]`` (the layer's input), ``o`` ``[n, H, q, D]`` (attention output) ->
    ``(h [n, q, hidden], expert ids [n * q, k] or None)``: a MoE layer also returns the experts it routed
    each token to (the routed-experts answer of ``return_routed_experts``). ``gate_up``: a dense MLP's
    gate and up projections as one matmul.
    """
    n, q_len, _ = h.shape
    attn = layer.self_attn.o_proj(o.transpose(1, 2).reshape(n, q_len, -1))
    if hasattr(layer, "post_self_attn_layernorm"):  # GLM-4's sandwich norms after attention and the MLP
        h = h + layer.post_self_attn_layernorm(attn)
        y, experts = _mlp(layer.mlp, layer.post_attention_layernorm(h), gate_up)
        return h + layer.post_mlp_layernorm(y), experts
    h = h + attn
    y, experts = _mlp(layer.mlp, layer.post_attention_layernorm(h), gate_up)
    return h + y, experts


def _mlp(mlp, x, gate_up: Fused | None = None):
    """A dense MLP, or a HF MoE block run through its own parts so the routing is visible:
    ``mlp.gate(x) -> (logits, weights [m, k], ids [m, k])``, ``mlp.experts(x, ids, weights)`` (HF's
    ``grouped_mm`` implementation by default: experts' matmuls grouped by expert in one kernel, sorted
    by expert with no host sync, so it can be captured in a CUDA graph), plus ungated shared experts
    (GLM-4.5). The same sum as the block's own ``forward`` (Qwen3-MoE, GLM-4.5). ``gate_up``: a dense
    SwiGLU's ``down(act(gate(x)) * up(x))`` with gate and up as one matmul.
    ``x`` ``[n, q, hidden]`` -> ``(y [n, q, hidden], ids [n * q, k] or None)``."""
    if gate_up is not None:
        gate, up = run_fused(gate_up, x)
        return mlp.down_proj(mlp.act_fn(gate) * up), None
    if not hasattr(mlp, "experts"):
        return mlp(x), None
    flat = x.reshape(-1, x.shape[-1])
    _, weights, ids = mlp.gate(flat)
    y = mlp.experts(flat, ids, weights).reshape(x.shape)
    if hasattr(mlp, "shared_experts"):
        y = y + mlp.shared_experts(x)
    return y, ids


_CKPT_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _weight_view(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The model tensor (or view) a checkpoint tensor ``name`` fills, or None.

    transformers 5 keeps a MoE layer's experts stacked: ``experts.gate_up_proj [E, 2F, H]`` (gate rows,
    then up rows) and ``experts.down_proj [E, H, F]``; checkpoints keep one tensor per expert. Expert
    ``e``'s ``gate_proj`` is ``gate_up_proj[e, :F]``, its ``up_proj`` ``gate_up_proj[e, F:]``, its
    ``down_proj`` ``down_proj[e]``."""
    if name in params:
        return params[name]
    m = _CKPT_EXPERT.match(name)
    if m is None:
        return None
    prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
    stacked = params.get(f"{prefix}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}")
    if stacked is None or e >= stacked.shape[0]:
        return None
    if kind == "down_proj":
        return stacked[e]
    half = stacked.shape[1] // 2
    return stacked[e, :half] if kind == "gate_proj" else stacked[e, half:]


def _compiled(fn, mode: str):
    """``fn`` under ``torch.compile``: one graph (``fullgraph``), no Inductor CUDA graphs (ours wrap the
    whole step), and automatic dynamic shapes: the second batch size seen recompiles ``fn`` with the batch
    dimension symbolic, and that version serves every later bucket. (Static shapes compiled once per
    bucket, each a few seconds on an H200, so a colocated step that first met a bucket took seconds
    longer than the others.) Each CUDA graph still captures the kernels at its own bucket's size."""
    return torch.compile(fn, fullgraph=True, dynamic=None, mode=None if mode == "default" else mode)


def _raise_recompile_limit(shapes: int) -> None:
    """Dynamo stops compiling a function after ``recompile_limit`` versions (8 by default) and runs it
    eagerly from then on; decode needs one per batch bucket (10 for 512 slots), and runners of other
    dtypes or devices in the same process add theirs to the same functions: leave room for several."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), 4 * shapes))


def _bmm_fp32_out_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.bmm(..., out_dtype=torch.float32)`` works here for ``dtype`` inputs (CUDA
    half/bf16 only): scores then leave the matmul in float32 instead of being rounded to bf16."""
    if device.type != "cuda" or dtype == torch.float32:
        return False
    try:
        a = torch.zeros((1, 2, 8), dtype=dtype, device=device)
        return torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def resolve_dtype(dtype: str, device: torch.device, model_dir: str | None) -> str:
    """``dtype`` with ``auto`` resolved: float32 on the CPU; on a GPU the checkpoint's own ``torch_dtype``
    (``config.json``), bfloat16 when it names none. A float32 policy (the trainer's export says so) is
    then sampled in float32 too: a bf16 copy of it parts from the trainer's log-probs by ~1e-3 per
    token, which is an off-policy gap of the engine's making."""
    if dtype != "auto":
        return dtype
    if device.type != "cuda":
        return "float32"
    import json

    try:
        hf = json.loads((Path(model_dir) / "config.json").read_text()) if model_dir else {}
    except (OSError, ValueError):
        hf = {}
    named = hf.get("torch_dtype") or hf.get("dtype")
    return named if named in ("float32", "bfloat16", "float16") else "bfloat16"


class ModelRunner:
    """Owns the model and its slot KV cache. Not thread-safe: the engine thread alone calls it."""

    def __init__(self, model_dir: str | Path | None, device: str = "cpu", dtype: str = "auto", max_slots: int = 32,
                 context_length: int | None = None, cuda_graphs: bool = False, model: Any = None,
                 decode_attention: str = "sdpa", compile: bool = False, compile_mode: str = "default",
                 fuse_projections: bool | None = None, attention_writes_kv: bool | None = None,
                 float_logits: bool = True):
        """``decode_attention``: ``"sdpa"``, ``"bmm"``, ``"triton"`` (see the module docstring) or ``"auto"``
        (``triton`` on CUDA when Triton imports, else ``sdpa``); ``compile``:
        ``torch.compile`` the per-layer decode parts, with Inductor ``compile_mode`` (``"default"`` or
        ``"max-autotune-no-cudagraphs"``: autotuned matmuls, much longer compiles); ``fuse_projections``:
        each layer's Q/K/V and gate/up as one matmul each (``fused``; None: on a GPU, where it is measured
        faster; off on the CPU, whose seeded curves were recorded with separate matmuls);
        ``attention_writes_kv``: with ``triton`` decode attention, the kernel writes each step's keys and
        values into the cache itself (no two cache-write kernels per layer; None: on with ``triton``);
        ``float_logits``: :meth:`decode` returns float32 logits; False: the model's dtype (a bf16 step then
        writes 2 bytes per logit instead of 6, and a sampler reading bf16, ``sampling_kernel``, reads half:
        the engine's choice on a GPU, where its sampling upcasts anyway)."""
        from transformers import AutoModelForCausalLM

        if decode_attention == "auto":  # the measured fastest on an H200 (bench/RESULTS.md)
            from posttrain.plugins.engines.local.decode_kernel import triton_available

            decode_attention = "triton" if str(device).startswith("cuda") and triton_available() else "sdpa"
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention: expected one of {', '.join(DECODE_ATTENTION)}, "
                             f"got {decode_attention!r}")
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode: expected one of {', '.join(COMPILE_MODES)}, got {compile_mode!r}")

        self.model_dir = str(model_dir) if model_dir is not None else None
        self.device = torch.device(device)
        self.dtype = getattr(torch, resolve_dtype(dtype, self.device, self.model_dir))
        if model is None:  # ``model``: an already built HF model (benchmarks of random large shapes)
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.hf_config = self.model.config
        cfg = self.hf_config
        self.layers = self.model.model.layers
        fuse = self.device.type == "cuda" if fuse_projections is None else bool(fuse_projections)
        self.fused_groups = fuse_layers(self.layers) if fuse else 0
        self.num_layers = len(self.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = attn.scaling
        self.vocab_size = cfg.vocab_size
        # MoE: experts per token (0 for a dense model); ``routed_experts`` holds the last forward pass's
        # expert ids, ``[n, P, L, k]`` after a prefill and ``[nb, L, k]`` after a decode (-1: dense layer)
        self.moe_top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0) if any(
            hasattr(layer.mlp, "experts") for layer in self.model.model.layers) else 0
        self.routed_experts = None
        self._step_routing = None
        # default: the model's maximum, capped so a long-context model does not allocate a huge cache
        self.context_length = int(context_length or min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT))
        self.max_slots = int(max_slots)
        self._rope = _rotary_of(self.model)
        shape = (self.num_layers, self.max_slots, self.num_kv_heads, self.context_length, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self._graphs: dict[tuple[int, int], tuple[Any, dict[str, torch.Tensor]]] = {}
        # graphs share one memory pool: they never run at the same time
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.decode_attention = decode_attention
        self.attention_writes_kv = decode_attention == "triton" and attention_writes_kv is not False
        self.float_logits = bool(float_logits)
        self._fp32_scores = decode_attention == "bmm" and _bmm_fp32_out_supported(self.device, self.dtype)
        self.compile = bool(compile)
        self.compile_mode = compile_mode
        self._qkv, self._finish = _project_qkv, _finish_layer  # the decode step's per-layer parts
        if self.compile:
            _raise_recompile_limit(self._bucket(self.max_slots).bit_length() + 1)
            self._qkv, self._finish = _compiled(_project_qkv, compile_mode), _compiled(_finish_layer, compile_mode)
        # the prefill's parts: the decode step's, except under max-autotune, whose timings at the prefill's
        # thousands of rows cost a minute or more of start-up and picked cuBLAS anyway on an H200 (RESULTS.md)
        self._prefill_parts = (self._qkv, self._finish)
        if self.compile and compile_mode != "default":
            self._prefill_parts = (_compiled(_project_qkv, "default"), _compiled(_finish_layer, "default"))

    # -- weights --------------------------------------------------------------------------------
    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF name -> tensor, tied weights listed under every name (``lm_head.weight`` included)."""
        return dict(self.model.state_dict(keep_vars=True))

    def required_weights(self) -> list[list[str]]:
        """The tensors a full checkpoint must hold: one list per distinct storage, each naming every HF
        name of it (tied weights: ``lm_head.weight`` and ``model.embed_tokens.weight`` are one entry,
        covered by either name, since ``save_pretrained`` writes only one of them)."""
        by_storage: dict[int, list[str]] = {}
        for name, t in self.named_weights().items():
            by_storage.setdefault(t.data_ptr(), []).append(name)
        return list(by_storage.values())

    @torch.no_grad()
    def load_weights(self, named: dict[str, torch.Tensor], require_all: bool = False) -> int:
        """Copy tensors into the model by HF name, all or nothing: every name, shape and dtype kind is
        checked before the first copy, so a bad update raises ``ValueError`` and leaves the weights as
        they were. ``require_all``: ``named`` must cover every tensor of the model (a checkpoint
        directory). Checkpoint names of MoE experts (``mlp.experts.<e>.{gate,up,down}_proj.weight``, what
        trainers export and hub checkpoints hold) land in transformers' stacked expert tensors (see
        :func:`_weight_view`); coverage then counts the stacked tensors as covered. Returns the number
        of tensors copied."""
        params = self.named_weights()
        targets = {n: _weight_view(params, n) for n in named}
        problems = [f"unknown weight name {n!r}" for n, v in targets.items() if v is None]
        problems += [f"{n}: shape {tuple(t.shape)} does not match the model's {tuple(targets[n].shape)}"
                     for n, t in named.items() if targets[n] is not None and tuple(t.shape) != tuple(targets[n].shape)]
        problems += [f"{n}: dtype {t.dtype} is not a floating-point type" for n, t in named.items()
                     if targets[n] is not None and not t.is_floating_point()]
        if require_all:
            groups = self.required_weights()
            # by address, not storage: fused Q/K/V are blocks of one storage (expert 0's view of a stacked
            # expert tensor starts at the stacked tensor's address, as every parameter does at its own)
            covered = {v.data_ptr() for v in targets.values() if v is not None}
            missing = [names[0] for names in groups if params[names[0]].data_ptr() not in covered]
            if missing:
                problems.append(f"covers {len(groups) - len(missing)} of {len(groups)} tensors of the model; "
                                f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise ValueError("; ".join(problems[:3]) + more + "; no weight was changed")
        for name, tensor in named.items():
            target = targets[name]
            target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
        # In-place copies keep every parameter's storage, so captured graphs stay valid. (Dropping them
        # here and capturing again into the same memory pool trips an allocator assertion in PyTorch.)
        return len(named)

    def weight_checksums(self) -> dict[str, str]:
        """SHA-256 of every tensor's bytes as the engine holds them (its dtype, row-major), by HF name."""
        import hashlib

        out = {}
        for name, t in self.named_weights().items():
            data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
            out[name] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
        return out

    def reset_graphs(self) -> None:
        """Drop the captured graphs (after weights or the KV cache moved to new storage); later captures
        go into a fresh memory pool: capturing into the pool of destroyed graphs is not safe."""
        self._graphs.clear()
        if self.cuda_graphs:
            self._graph_pool = torch.cuda.graph_pool_handle()

    # -- forward passes -------------------------------------------------------------------------
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Run ``prompts`` into ``slots``; return the next-token logits ``[n, V]`` (float32).

        Never in a CUDA graph (prompt shapes vary); with ``compile`` the layer parts are the decode step's
        compiled ones, compiled once more with the prompt count and width symbolic, so a prefill's norms, rotary
        and SwiGLU fuse as the decode step's do."""
        return self.prefill_scored(slots, prompts, [None] * len(prompts))[0]

    @torch.no_grad()
    def prefill_scored(self, slots: list[int], prompts: list[list[int]], starts: list[int | None]
                       ) -> tuple[torch.Tensor, list[list[float] | None]]:
        """:meth:`prefill`, plus the log-probs of each prompt's own tokens from position ``starts[i]`` on.

        For prompt ``ids`` with ``s = starts[i]`` (None: nothing asked), the list holds
        ``log p(ids[t] | ids[:t])`` for ``t = s + 1 .. len(ids) - 1`` (``len(ids) - 1 - s`` floats): the
        log-softmax of the raw logits (no temperature), float32, computed from the prefill's own hidden
        states in chunks of rows (a vocabulary of 150k over a long prompt would not fit at once).
        SGLang's ``input_token_logprobs`` is ``[None] + this`` (its first entry has no value)."""
        # a group's samples share their prompt: run each distinct prompt once and copy its K/V into every
        # slot that holds it (SGLang shares such prefixes through its radix cache)
        first: dict[tuple[int, ...], int] = {}
        inverse = [first.setdefault(tuple(p), len(first)) for p in prompts]
        unique = list(first)  # in order of first appearance: unique[inverse[i]] == prompts[i]
        n = len(unique)
        lens_np = np.fromiter((len(p) for p in unique), dtype=np.int64, count=n)
        width = int(lens_np.max())
        ids_np = np.zeros((n, width), dtype=np.int64)
        ids_np[np.arange(width)[None, :] < lens_np[:, None]] = np.fromiter(
            (t for p in unique for t in p), dtype=np.int64, count=int(lens_np.sum()))
        ids = torch.from_numpy(ids_np).to(self.device)
        lens = torch.from_numpy(lens_np).to(self.device)
        rows = torch.tensor(inverse, dtype=torch.long, device=self.device)  # [len(prompts)] -> unique row

        def spread(x):  # per unique prompt -> per row (as it is when no prompt repeats)
            return x[rows] if n < len(prompts) and x is not None else x

        positions = torch.arange(width, device=self.device)[None, :].expand(n, width)
        slot_idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        h = self.model.model.embed_tokens(ids)
        cos, sin = self.model.model.rotary_emb(h, positions)
        project, finish = _project_qkv, _finish_layer
        if self.compile:  # compiled parts (``_prefill_parts``); one version for every prompt count and width
            project, finish = self._prefill_parts
            for t in (h, cos, sin):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 1)
        routed = []
        for l, layer in enumerate(self.layers):
            qkv, gate_up = self._parts(layer)
            q, k, v = project(layer, h, cos, sin, self._rope, qkv)
            self.k_cache[l, slot_idx, :, :width] = spread(k)
            self.v_cache[l, slot_idx, :, :width] = spread(v)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=True)
            if self.compile:  # [n, H, P, D]
                torch._dynamo.maybe_mark_dynamic(o, 0)
                torch._dynamo.maybe_mark_dynamic(o, 2)
            h, experts = finish(layer, h, o, gate_up)
            routed.append(experts)
        self.routed_experts = spread(self._stack_routing(routed, (n, width)))
        last = h[torch.arange(n, device=self.device), lens - 1]
        scored = [None if s is None else self._token_logprobs(h[inverse[i], s:len(p) - 1], p[s + 1:])
                  for i, (p, s) in enumerate(zip(prompts, starts))]
        return spread(self.model.lm_head(self.model.model.norm(last)).float()), scored

    def _token_logprobs(self, hidden: torch.Tensor, targets: list[int], rows: int = 1024) -> list[float]:
        """``log_softmax(lm_head(norm(hidden)))[targets]`` for ``hidden [m, H]``, ``rows`` at a time."""
        out = []
        ids = torch.tensor(targets, dtype=torch.long, device=self.device)
        for at in range(0, len(targets), rows):
            logits = self.model.lm_head(self.model.model.norm(hidden[at:at + rows])).float()
            out.append(logits.log_softmax(-1).gather(-1, ids[at:at + rows, None]).squeeze(-1))
        return torch.cat(out).tolist() if out else []

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, max_position: int | None = None) -> torch.Tensor:
        """One step for slots ``0 .. nb - 1``: ``tokens``/``positions`` ``[nb]`` -> logits ``[nb, V]`` (float32,
        or the model's dtype without ``float_logits``).

        ``max_position``: ``max(positions)`` when the caller knows it (the engine does, from Python
        ints); it saves a device-to-host sync per step that would stall the CPU until the GPU is idle.
        """
        need = (int(positions.max()) if max_position is None else int(max_position)) + 1
        nb = tokens.shape[0]
        if self.cuda_graphs:
            logits, routing = self._decode_graphed(tokens, positions, need)
        elif self.compile and self._bucket(nb) > nb:  # pad to the bucket: compiled code is specialized to its batch size
            pad = tokens.new_zeros(self._bucket(nb) - nb)  # position 0 of idle slots nb..bucket-1, as graphs do
            logits = self._decode_eager(torch.cat([tokens, pad]), torch.cat([positions, pad]), need)
            routing = self._step_routing
        else:
            logits, routing = self._decode_eager(tokens, positions, need), self._step_routing
        self.routed_experts = None if routing is None else routing[:nb]  # a view of a graph's static output:
        return logits[:nb]  # read it before the next step

    def _decode_eager(self, tokens, positions, span: int):
        """The decode step over an attention window of ``span`` cache positions (``>= max(positions) + 1``;
        positions past each slot's own are masked). ``tokens``/``positions`` ``[nb]`` -> logits ``[nb, V]``;
        the step's expert ids ``[nb, L, k]`` int32 (or None) are left in ``_step_routing``."""
        nb = tokens.shape[0]
        h = self.model.model.embed_tokens(tokens[:, None])
        cos, sin = self.model.model.rotary_emb(h, positions[:, None])
        attend = self._decode_attention_fn(positions, span)
        routed = []
        for l, layer in enumerate(self.layers):
            qkv, gate_up = self._parts(layer)
            q, k, v = self._qkv(layer, h, cos, sin, self._rope, qkv)
            o = attend(l, q, k, v)
            h, experts = self._finish(layer, h, o, gate_up)
            routed.append(experts)
        self._step_routing = self._stack_routing(routed, (nb,))
        logits = self.model.lm_head(self.model.model.norm(h[:, 0]))
        return logits.float() if self.float_logits else logits

    def _parts(self, layer) -> tuple[Fused | None, Fused | None]:
        """The layer's fused Q/K/V and gate/up matmuls (views of its weights, found again at every pass:
        a memory release may have moved them), or None each."""
        return layer_parts(layer) if self.fused_groups else (None, None)

    def _stack_routing(self, routed: list, lead: tuple[int, ...]):
        """Per-layer expert ids (``[m, k]`` or None for a dense layer) -> ``[*lead, L, k]`` int32, -1 for
        dense layers (SGLang's layout of ``routed_experts``); None for a model without MoE layers."""
        if self.moe_top_k == 0:
            return None
        dense = torch.full((*lead, self.moe_top_k), -1, dtype=torch.int32, device=self.device)
        return torch.stack([dense if r is None else r.to(torch.int32).reshape(*lead, -1) for r in routed], dim=-2)

    def _decode_attention_fn(self, positions, span: int):
        """``attend(l, q [nb, H, 1, D], k, v [nb, Hkv, 1, D]) -> [nb, H, 1, D]`` for this step: writes the
        step's keys and values into layer ``l``'s cache at ``positions`` and attends over the cache's first
        ``span`` positions, with the mask built once for all layers."""
        nb = positions.shape[0]
        caches = lambda l: (self.k_cache[l, :nb, :, :span], self.v_cache[l, :nb, :, :span])  # noqa: E731
        if self.decode_attention == "triton":  # no mask: each slot reads its own ``position + 1`` entries
            lengths = positions + 1
            kernel = self._triton_attention(positions.is_cuda)
            if self.attention_writes_kv:  # the kernel writes k, v at ``position`` itself
                return lambda l, q, k, v: kernel(q, *caches(l), lengths, self.scaling, k_new=k, v_new=v)
            attend = lambda q, kc, vc: kernel(q, kc, vc, lengths, self.scaling)  # noqa: E731
        else:
            past = torch.arange(span, device=self.device)[None, :] > positions[:, None]  # [nb, span]: masked out
            if self.decode_attention == "bmm":
                masked = past[:, None, :]
                attend = lambda q, kc, vc: self._attend_bmm(q, kc, vc, masked)  # noqa: E731
            else:
                allowed = ~past[:, None, None, :]
                attend = lambda q, kc, vc: self._attend_sdpa(q, kc, vc, allowed)  # noqa: E731
        rows = torch.arange(nb, device=self.device)

        def write_then_attend(l, q, k, v):
            self.k_cache[l][rows, :, positions] = k[:, :, 0]
            self.v_cache[l][rows, :, positions] = v[:, :, 0]
            return attend(q, *caches(l))

        return write_then_attend

    def _attend_sdpa(self, q, k, v, allowed):
        """SDPA with one query token per slot. ``q`` ``[nb, H, 1, D]``, ``k``/``v`` ``[nb, Hkv, span, D]``,
        ``allowed`` ``[nb, 1, 1, span]`` bool -> ``[nb, H, 1, D]``.

        GQA: the ``G = H / Hkv`` query heads sharing a KV head become ``G`` query rows of that head
        (``[nb, Hkv, G, D]``), so the kernel reads each cached K/V once instead of expanding it."""
        nb, heads, _, d = q.shape
        qg = q.reshape(nb, self.num_kv_heads, heads // self.num_kv_heads, d)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=allowed, scale=self.scaling)
        return o.reshape(nb, heads, 1, d)

    @staticmethod
    def _triton_attention(on_cuda: bool):
        """The Triton flash-decoding kernel (``decode_kernel.decode_attention``), called as
        ``attend(q [nb, H, 1, D], k/v [nb, Hkv, span, D] (strided cache views), lengths [nb], scale)
        -> [nb, H, 1, D]``; each slot reads only its own ``lengths[i] = position + 1`` cache entries.
        Without CUDA or triton, the same attention in plain torch (``decode_attention_reference``).
        Resolved once per step, not per layer."""
        from posttrain.plugins.engines.local.decode_kernel import (decode_attention, decode_attention_reference, triton_available)

        return decode_attention if on_cuda and triton_available() else decode_attention_reference

    def _attend_bmm(self, q, k, v, masked):
        """The same attention as two batched matmuls. ``q`` ``[nb, H, 1, D]``, ``k``/``v``
        ``[nb, Hkv, span, D]`` (strided views of the cache), ``masked`` ``[nb, 1, span]`` bool (True past
        the slot's position) -> ``[nb, H, 1, D]``.

        ``scores = q_g @ K^T`` over ``[nb*Hkv, G, D] x [nb*Hkv, D, span]`` (the cache views merge
        ``nb`` and ``Hkv`` without a copy), scaled and masked in float32, softmax in float32, cast back
        to the cache dtype for ``@ V``."""
        nb, heads, _, d = q.shape
        hkv, span = k.shape[1], k.shape[2]
        g = heads // hkv
        qg = q.reshape(nb * hkv, g, d)
        kt = k.reshape(nb * hkv, span, d).transpose(1, 2)
        if self._fp32_scores:  # bf16 inputs, float32 accumulator written out as float32
            scores = torch.bmm(qg, kt, out_dtype=torch.float32)
        else:
            scores = torch.bmm(qg, kt).float()
        scores = scores.view(nb, hkv * g, span).mul_(self.scaling).masked_fill_(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(nb * hkv, g, span)
        o = torch.bmm(probs, v.reshape(nb * hkv, span, d))
        return o.view(nb, heads, 1, d)

    def _bucket(self, nb: int) -> int:
        b = 1
        while b < nb:
            b *= 2
        return min(b, self.max_slots)

    def _span(self, need: int) -> int:
        """Attention span of a graph: ``need`` (longest context) rounded up to 256, capped at the context length."""
        return min(self.context_length, -(-need // 256) * 256)

    def _decode_graphed(self, tokens, positions, need: int):
        """CUDA-graph decode: one graph per (power-of-two batch bucket, 256-token span bucket)."""
        nb = tokens.shape[0]
        bucket = self._bucket(nb)
        span = self._span(need)
        key = (bucket, span)
        if key not in self._graphs:
            self._capture(bucket, span)
        graph, static = self._graphs[key]
        static["tokens"][:nb].copy_(tokens)
        static["positions"][:nb].copy_(positions)
        if bucket > nb:
            static["positions"][nb:].zero_()
        graph.replay()
        return static["logits"][:nb], static["routing"]

    def _capture(self, bucket: int, span: int) -> None:
        """Capture the decode step of ``bucket`` slots over ``span`` positions into ``self._graphs`` (one
        line on stderr each, with its seconds: the engine log then shows what a slow step captured)."""
        t0 = time.perf_counter()
        static = {"tokens": torch.zeros(bucket, dtype=torch.long, device=self.device),
                  "positions": torch.zeros(bucket, dtype=torch.long, device=self.device)}
        # The warm-up runs for real and writes K/V at position 0 of slots 0 .. bucket-1, which may
        # belong to requests in flight: keep those cache entries and put them back afterwards.
        saved = (self.k_cache[:, :bucket, :, 0].clone(), self.v_cache[:, :bucket, :, 0].clone())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels (and torch.compile) outside the graph
                self._decode_eager(static["tokens"], static["positions"], span)
        torch.cuda.current_stream().wait_stream(stream)
        self.k_cache[:, :bucket, :, 0] = saved[0]
        self.v_cache[:, :bucket, :, 0] = saved[1]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            static["logits"] = self._decode_eager(static["tokens"], static["positions"], span)
            static["routing"] = self._step_routing
        self._graphs[(bucket, span)] = (graph, static)
        print(f"captured the decode graph of {bucket} slots x {span} positions in {time.perf_counter() - t0:.2f} s",
              file=sys.stderr, flush=True)
