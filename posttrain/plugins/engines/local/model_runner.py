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
captured in a CUDA graph per (batch bucket, span bucket) (``RunnerTuning.cuda_graphs``).

Decode levers (:class:`RunnerTuning`'s fields, defaults are the safe baseline; ``bench/rollout.py`` compares them):

- ``decode_attention``: ``"sdpa"`` runs ``scaled_dot_product_attention`` over the GQA-grouped query
  with a boolean mask over the span bucket; ``"bmm"`` runs two batched matmuls with a float32 masked
  softmax between them; ``"triton"`` is our flash-decoding kernel (``decode_kernel``), which reads
  only each slot's own ``position + 1`` cache entries. All compute the same attention (equal to
  float32 rounding); ``"auto"`` picks ``triton`` on CUDA. At the Qwen3-1.7B shape with 256 slots SDPA's masked
  kernel takes most of the step, reading a whole span bucket; triton + compile decodes about twice as fast.
- ``compile``: ``torch.compile`` (``fullgraph``) of the per-layer parts around the
  attention (norms, projections, rotary, residuals, SwiGLU MLP) so their elementwise work fuses. The
  KV-cache write and the attention stay eager: a compiled in-place write into a cache passed as an
  input may be functionalized into a copy of the whole cache layer. With ``triton`` the attention
  kernel writes the step's keys and values itself: two launches fewer per
  layer. Decode batches are padded to the power-of-two bucket so the compiled code sees a handful of
  shapes (the row count symbolic: one compile per part). The compiled step is cut at the attentions only
  (``layers.py``'s joined parts): a layer's closing residual add fuses into the next layer's input norm, and
  the final norm and rotary tables are fused kernels.
- :meth:`ModelRunner.decode_sampled`: the step with the one-pass sampler (``sampling_kernel``) inside its
  CUDA graph, for the engine's uniform batches (all greedy, or one temperature): one launch per step.

The layer parts are in ``layers``, the decode attention paths in ``attention``, ``torch.compile``'s use in ``compiling``.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from posttrain.core.exact import log_softmax as exact_log_softmax
from posttrain.core.lora import AdapterMerge
from posttrain.plugins.engines.local import compiling, graphs
from posttrain.plugins.engines.local.attention import checked_launch, step_attention
from posttrain.plugins.engines.local.cache_write import write_prompt_kv, write_prompt_kv_reference
from posttrain.plugins.engines.local.fused import Fused, fuse_layers, layer_parts
from posttrain.plugins.engines.local.layers import (embed_and_rotary, finish_layer, finish_then_head, finish_then_project,
                                                   finish_then_project_raw, project_qkv, project_raw,
                                                   rope_in_attention_refusal, rotary_of)
from posttrain.plugins.engines.local.mla import adopt_latent_attention, is_mla

DEFAULT_MAX_CONTEXT = 4096
DECODE_ATTENTION = ("sdpa", "bmm", "triton")  # "triton": decode_kernel.decode_attention
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


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


def to_dtype(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` on ``device`` with its parameters (and half-precision buffers) in ``dtype``, its float32 buffers
    kept float32 as transformers keeps them: the rotary ``inv_freq`` (in bfloat16 a position's angle is off by up
    to ``2^-9`` of itself: a radian by position 500 at the fastest frequency, where the trainer's table is float32)
    and a router's expert bias."""
    kept = {name: b for name, b in model.named_buffers() if b.dtype == torch.float32}
    model = model.to(device=device, dtype=dtype)
    for name, b in kept.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = b.to(device)
    return model


def _hf_model(model_dir: str, device: torch.device, dtype: torch.dtype, from_config: bool) -> Any:
    """The HF model of ``model_dir``: its weights read, or (``from_config``) built from its ``config.json`` on
    ``device`` with every parameter zero. The first push writes them all, so transformers' random init is skipped
    (at the Qwen3-0.6B shape on the CPU it took 10.7 s, single-threaded; the zeros take 2.2 s, mostly the pages'
    first touch). Zeros, not ``torch.empty``'s leftovers: a readiness check served before any push then samples
    from uniform logits, never from NaNs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not from_config:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    with device, _init_skipped():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    model.tie_weights()  # transformers 5 ties in the init that was skipped; a tied output layer is one tensor to push
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _init_skipped():
    """transformers' own switch that builds a model without its weight init (torch's ``nn.init`` functions and
    ``init_weights`` made no-ops while the model is built): ``transformers.initialization`` in 5.x,
    ``modeling_utils`` in 4.x; where neither has it, the init runs (slower, the same model)."""
    import contextlib
    import importlib

    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return importlib.import_module(module).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def _load_problems(named: dict[str, torch.Tensor], targets: dict[str, torch.Tensor | None],
                   params: dict[str, torch.Tensor], groups: list[list[str]] | None) -> list[str]:
    """What keeps ``named`` from loading into ``targets`` (``ModelRunner.load_weights``): unknown names, other
    shapes, integer tensors, and (``groups``: every tensor of the model must be covered) the tensors it misses."""
    problems = [f"unknown weight name {n!r}" for n, v in targets.items() if v is None]
    problems += [f"{n}: shape {tuple(t.shape)} does not match the model's {tuple(targets[n].shape)}"
                 for n, t in named.items() if targets[n] is not None and tuple(t.shape) != tuple(targets[n].shape)]
    problems += [f"{n}: dtype {t.dtype} is not a floating-point type" for n, t in named.items()
                 if targets[n] is not None and not t.is_floating_point()]
    missing = [names[0] for names in _uncovered(groups, params, targets)] if groups is not None else []
    if missing:
        problems.append(f"covers {len(groups) - len(missing)} of {len(groups)} tensors of the model; "
                        f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    return problems


def _uncovered(groups: list[list[str]], params: dict[str, torch.Tensor], targets: dict[str, torch.Tensor | None]
               ) -> list[list[str]]:
    """The name lists of ``groups`` (``ModelRunner.required_weights``) whose tensor no target of ``targets`` (HF
    name -> the view a load writes) starts at. By address, not storage: fused Q/K/V are blocks of one storage (expert
    0's view of a stacked expert tensor starts at the stacked tensor's address, as every parameter does at its own)."""
    covered = {v.data_ptr() for v in targets.values() if v is not None}
    return [names for names in groups if params[names[0]].data_ptr() not in covered]


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


@dataclass
class RunnerTuning:
    """How a :class:`ModelRunner` runs its decode step. Every setting computes the same attention and logits
    (to float rounding); they trade start-up time, memory and speed. ``LocalEngine.Config``'s fields of the
    same names map onto these (the engine server's ``runner_tuning``).

    - ``decode_attention``: ``"sdpa"``, ``"bmm"``, ``"triton"`` (the module docstring) or ``"auto"`` (``triton``
      on CUDA when Triton imports, else ``sdpa``). With ``triton`` the kernel also writes each step's keys and
      values into the cache, and on a GPU applies Qwen3's per-head Q/K norms and the rotary as it loads them
      where the checkpoint's are the standard ones (``layers.rope_in_attention_refusal``).
    - ``compile``: ``torch.compile`` the decode step between attentions (``layers``' joined parts: one graph
      from each attention to the next; Inductor's combo kernels; the row count symbolic, so each part compiles
      once), with Inductor ``compile_mode`` (``"default"`` or ``"max-autotune-no-cudagraphs"``: autotuned
      matmuls, much longer compiles; the prefill's parts then stay at ``"default"``).
    - ``cuda_graphs``: on CUDA, the decode step captured per (batch bucket, span bucket), every batch bucket of
      a temperature at its first step (``graphs.warm``).
    - ``fuse_projections``: each layer's Q/K/V and gate/up as one matmul each (``fused``; None: on a GPU, where
      it is faster; off on the CPU, whose seeded curves were recorded with separate matmuls).
    - ``float_logits``: :meth:`ModelRunner.decode` returns float32 logits; False: the model's dtype (a bf16
      step then writes 2 bytes per logit instead of 6, and ``sampling_kernel`` reads half: the engine's choice
      on a GPU, where its sampling upcasts anyway).
    - ``attention_launch``: launch settings of the Triton decode attention (``decode_kernel.decode_attention``'s
      ``block_n``, ``num_warps``, ``num_stages``, ``num_splits``, ``slots_per_program``; None: its defaults).
    - ``exact``: batch-invariant arithmetic shared with the trainer (``exact_mode``; ``rollout.exact``): the
      reported log-prob of a sampled token is the trainer's, bit for bit; eager, the levers above off.
    - ``rope_in_attention``: the decode step hands the ``triton`` attention raw Q/K projections, and the kernel
      applies Qwen3's per-head Q/K norms and the rotary as it loads them (``decode_kernel.Rope``: one kernel and
      a round trip of ``q`` and ``k`` fewer per layer). None: on where it can be on a GPU; True: on, also on the
      CPU (through the attention's reference), or a ValueError naming what refuses it; False: off.
    - ``moe_kernel``: on CUDA, a MoE model's routing and routed experts through ``moe_kernel`` (fused softmax
      top-k, two grouped expert GEMMs with the SwiGLU between: no per-expert launches, inside the CUDA graphs);
      False: transformers' own experts. Off the GPU, and in exact mode, the model's own.
    """

    decode_attention: str = "auto"
    compile: bool = False
    compile_mode: str = "default"
    cuda_graphs: bool = False
    fuse_projections: bool | None = None
    float_logits: bool = True
    attention_launch: dict | None = None
    rope_in_attention: bool | None = None
    exact: bool = False
    moe_kernel: bool = True

    def resolved(self, device: torch.device) -> RunnerTuning:
        """This tuning checked (a ValueError naming the field) with ``decode_attention: auto`` resolved for
        ``device``."""
        if self.exact:
            from posttrain.plugins.engines.local.exact_mode import exact_tuning

            self = exact_tuning(self)  # noqa: PLW0642 - the resolved copy
        attention = self.decode_attention
        if attention == "auto":  # the fastest on an H200 (python -m bench rollout)
            from posttrain.plugins.engines.local.decode_kernel import triton_available

            attention = "triton" if device.type == "cuda" and triton_available() else "sdpa"
        if attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention: expected one of {', '.join(DECODE_ATTENTION)}, got {attention!r}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode: expected one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}")
        return replace(self, decode_attention=attention, attention_launch=checked_launch(self.attention_launch))


class ModelRunner:
    """Owns the model and its slot KV cache. Not thread-safe: the engine thread alone calls it."""

    def __init__(self, model_dir: str | Path | None, device: str = "cpu", dtype: str = "auto", max_slots: int = 32,
                 context_length: int | None = None, tuning: RunnerTuning | None = None, *, model: Any = None,
                 from_config: bool = False):
        """The runner of ``model_dir``'s checkpoint on ``device`` (``dtype``: :func:`resolve_dtype`), with a KV
        cache of ``max_slots`` slots of ``context_length`` positions (None: the model's maximum, at most
        ``DEFAULT_MAX_CONTEXT``), its decode step run as ``tuning`` says (:class:`RunnerTuning`). ``model``: an
        already built HF model instead (benchmarks of random large shapes); ``from_config``: the model built
        from ``model_dir``'s ``config.json`` on the device, every parameter zero (no random init), no weight
        read (a run's engine, which gets every weight from the first push); until updates have written every
        tensor, :meth:`unwritten_weights` names those left."""
        self.device = torch.device(device)
        self.tuning = tuning = (tuning or RunnerTuning()).resolved(self.device)
        self.model_dir = str(model_dir) if model_dir is not None else None
        self.dtype = getattr(torch, resolve_dtype(dtype, self.device, self.model_dir))
        if model is None:
            model = _hf_model(self.model_dir, self.device, self.dtype, from_config)
        self.model = to_dtype(model, self.device, self.dtype).eval()
        self.hf_config = cfg = self.model.config
        self.layers = self.model.model.layers
        fuse = self.device.type == "cuda" if tuning.fuse_projections is None else tuning.fuse_projections
        self.fused_groups = fuse_layers(self.layers) if fuse else 0
        # a model built from its config: the tensors no update has written yet (one name list per tensor)
        self._unwritten = self.required_weights() if from_config else []
        self.weight_updates = 0  # load_weights calls that changed the model
        self.adapters = AdapterMerge()  # LoRA pushes: each adapted weight's base, merged again at every push
        self.num_layers = len(self.layers)
        attn = self.layers[0].self_attn
        # head_dim 0: MLA, whose latent cache replaces the empty one (mla.py)
        self.head_dim, self.scaling = getattr(attn, "head_dim", 0), attn.scaling
        self.num_kv_heads, self.vocab_size = cfg.num_key_value_heads, cfg.vocab_size
        # MoE: experts per token (0 for a dense model); ``routed_experts`` holds the last forward pass's
        # expert ids, ``[n, P, L, k]`` after a prefill and ``[nb, L, k]`` after a decode (-1: dense layer)
        self.moe_top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0) if any(
            hasattr(layer.mlp, "experts") for layer in self.layers) else 0
        self.routed_experts = None
        self._step_routing = None
        # default: the model's maximum, capped so a long-context model does not allocate a huge cache
        self.context_length = int(context_length or min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT))
        self.max_slots = int(max_slots)
        self._rope = rotary_of(self.model)
        self.cuda_graphs = tuning.cuda_graphs and self.device.type == "cuda"
        self._allocate()
        self.decode_attention, self.attention_launch = tuning.decode_attention, tuning.attention_launch
        from posttrain.plugins.engines.local.decode_kernel import triton_available

        # a prefill's keys and values go into the slot cache through one Triton launch per layer where it runs
        self.prefill_kv_kernel = self.device.type == "cuda" and triton_available()
        self.float_logits, self.compile, self.compile_mode = tuning.float_logits, tuning.compile, tuning.compile_mode
        self.rope_in_attention = self._rope_in_attention(tuning.rope_in_attention)
        from posttrain.plugins.engines.local.moe_kernel import set_moe_kernel

        self.moe_kernel_blocks = set_moe_kernel(self.model, tuning.moe_kernel and self.device.type == "cuda")
        self._build_step()
        self.mla = adopt_latent_attention(self) if is_mla(self.model) else None  # its cache, prefill parts, decode
        self.exact = tuning.exact
        if self.exact:  # after the MLA parts, which it replaces by their exact versions
            from posttrain.plugins.engines.local import exact_mode

            exact_mode.adopt(self)

    def _allocate(self) -> None:
        """The KV cache ``[L, N, Hkv, S_max, D]`` twice, the decode step's input buffers and the graphs' state."""
        shape = (self.num_layers, self.max_slots, self.num_kv_heads, self.context_length, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # the decode step's inputs, which every graph reads (slices): a caller passing slices of these
        # buffers (the overlapped engine does) costs no copies, and decode_sampled leaves its draw in
        # step_tokens, the next step's input
        self.step_tokens = torch.zeros(self.max_slots, dtype=torch.long, device=self.device)
        self.step_positions = torch.zeros(self.max_slots, dtype=torch.long, device=self.device)
        # (batch bucket, span bucket, sampling temperature or None) -> (graph, its static tensors)
        self._graphs: dict[tuple[int, int, float | None], tuple[Any, dict[str, torch.Tensor]]] = {}
        self._warmed: set[float | None] = set()  # temperatures whose buckets were all captured (graphs.warm)
        self.graph_totals = {"graph_captures": 0, "graph_capture_s": 0.0}  # since start (graphs.capture)
        # graphs share one memory pool: they never run at the same time
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None

    def _build_step(self) -> None:
        """The decode step's parts between attentions (``layers``' joined parts: ``_embed``, ``_step``, ``_last``;
        ``_project`` for the first layer's projections) and the prefill's (``_prefill_parts``), compiled with
        ``compile``. Uncompiled, the joined parts run the same calls as the layer parts one after another."""
        project = project_raw if self.rope_in_attention else project_qkv  # the decode step's projection part
        joined = (embed_and_rotary, finish_then_project_raw if self.rope_in_attention else finish_then_project,
                  finish_then_head)
        self._project, (self._embed, self._step, self._last) = project, joined
        self._prefill_parts = (project_qkv, finish_layer)
        if not self.compile:
            return
        compiling.prepare(self.device, self._bucket(self.max_slots).bit_length() + 1)
        qkv, finish = (compiling.compiled(f, self.compile_mode, combo=True) for f in (project_qkv, finish_layer))
        self._project = compiling.compiled(project, self.compile_mode, combo=True) if self.rope_in_attention else qkv
        self._embed, self._step, self._last = (compiling.compiled(f, self.compile_mode, combo=True) for f in joined)
        # the prefill's parts: the decode step's, except under max-autotune, whose timings at the prefill's
        # thousands of rows cost a minute or more of start-up and pick cuBLAS anyway on an H200
        self._prefill_parts = (qkv, finish)
        if self.compile_mode != "default":
            self._prefill_parts = (compiling.compiled(project_qkv, "default"), compiling.compiled(finish_layer, "default"))

    def _rope_in_attention(self, asked: bool | None) -> bool:
        """``RunnerTuning.rope_in_attention`` resolved: None -> on where it can be on a GPU."""
        if asked is False or (asked is None and self.device.type != "cuda"):
            return False
        why = None if self.decode_attention == "triton" else "it needs decode_attention='triton'"
        why = why or rope_in_attention_refusal(self.model, self.layers)
        if why and asked:
            raise ValueError(f"rope_in_attention: {why}")
        return why is None

    @property
    def advances_positions(self) -> bool:
        """Whether a decode step leaves ``step_positions[:bucket]`` one further than it read them (a CUDA graph's
        step does, ``graphs``): a caller whose rows all move on by one needs no copy before the next step."""
        return self.cuda_graphs

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
        of tensors copied. LoRA adapter pairs (``<module>.lora_A.weight``, ``.lora_B.weight``) are merged into
        their weight from its kept base first (:class:`~posttrain.core.lora.AdapterMerge`)."""
        params = self.named_weights()
        named = self.adapters.resolve(named, lambda name: _weight_view(params, name))
        targets = {n: _weight_view(params, n) for n in named}
        problems = _load_problems(named, targets, params, self.required_weights() if require_all else None)
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise ValueError("; ".join(problems[:3]) + more + "; no weight was changed")
        for name, tensor in named.items():
            target = targets[name]
            target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
        self._unwritten = _uncovered(self._unwritten, params, targets)
        self.weight_updates += bool(named)
        # In-place copies keep every parameter's storage, so captured graphs stay valid. (Dropping them
        # here and capturing again into the same memory pool trips an allocator assertion in PyTorch.)
        return len(named)

    def unwritten_weights(self) -> list[str]:
        """For a model built ``from_config``: the first HF name of each tensor no :meth:`load_weights` has written
        since; empty once every one has been, and for a model read from its checkpoint."""
        return [names[0] for names in self._unwritten]

    def weight_checksums(self) -> dict[str, str]:
        """SHA-256 of every tensor's bytes as the engine holds them (its dtype, row-major), by HF name, stacked
        MoE experts also by their per-expert checkpoint names (``core.rollout.weight_check.tensor_digests``)."""
        from posttrain.core.rollout.weight_check import tensor_digests

        return tensor_digests(self.named_weights())

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
        and SwiGLU fuse as the decode step's do. Compiled, a prefill of one prompt or of one-token prompts pads
        that size to two, which Dynamo would otherwise compile apart (its 0/1 specialization)."""
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
        if self.compile and len(unique) == 1:  # a lone prompt runs beside a copy of itself (its K/V unwritten):
            unique *= 2  # Dynamo compiles a size of one apart from the symbolic version (3.6 s on an H200 mid-run)
        n = len(unique)
        lens_np = np.fromiter(map(len, unique), dtype=np.int64, count=n)
        width = max(int(lens_np.max()), 2 if self.compile else 1)  # likewise a width of one: padded to two
        # the host's part of a prefill is latency (the device waits for it): C-level iteration over the tokens
        flat = np.fromiter(itertools.chain.from_iterable(unique), dtype=np.int64, count=int(lens_np.sum()))
        if (lens_np == width).all():
            ids_np = flat.reshape(n, width)
        else:
            ids_np = np.zeros((n, width), dtype=np.int64)
            ids_np[np.arange(width)[None, :] < lens_np[:, None]] = flat
        ids = torch.from_numpy(ids_np).to(self.device)
        lens = torch.from_numpy(lens_np).to(self.device)
        index = torch.tensor([slots, inverse], dtype=torch.long, device=self.device)  # one copy for both
        rows = index[1]  # [len(prompts)] -> unique row

        def spread(x):  # per unique prompt -> per row (as it is when no prompt repeats and none was copied)
            return x[rows] if n != len(prompts) and x is not None else x

        positions = torch.arange(width, device=self.device)[None, :].expand(n, width)
        # the cache rows to fill: a slice when the slots are consecutive (a plain copy; an indexed write ran
        # at a tenth of the bandwidth, 11 of a 256 x 128 prefill's 175 ms on an H200), else an index_copy_
        lo = slots[0] if slots else 0
        dest = slice(lo, lo + len(slots)) if slots == list(range(lo, lo + len(slots))) else index[0]
        h = self.model.model.embed_tokens(ids)
        cos, sin = self.model.model.rotary_emb(h, positions)
        project, finish = self._prefill_parts  # compiled: one version for every prompt count and width
        if self.compile:
            for t in (h, cos, sin):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 1)
        routed = []
        for l, layer in enumerate(self.layers):
            qkv, gate_up = self._parts(layer)
            q, k, v = project(layer, h, cos, sin, self._rope, qkv)
            if self.prefill_kv_kernel:  # gather and both copies in one launch
                write_prompt_kv(k, v, self.k_cache[l], self.v_cache[l], index[0], rows)
            else:
                write_prompt_kv_reference(k, v, self.k_cache[l], self.v_cache[l], dest,
                                          rows if n != len(prompts) else None)
            if self.exact:
                o = self._exact_attention(q, k, v, self.scaling)
            else:
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
            lp = exact_log_softmax(logits) if self.exact else logits.log_softmax(-1)
            out.append(lp.gather(-1, ids[at:at + rows, None]).squeeze(-1))
        return torch.cat(out).tolist() if out else []

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, max_position: int | None = None) -> torch.Tensor:
        """One step for slots ``0 .. nb - 1``: ``tokens``/``positions`` ``[nb]`` -> logits ``[nb, V]`` (float32,
        or the model's dtype without ``float_logits``).

        ``max_position``: ``max(positions)`` when the caller knows it (the engine does, from Python
        ints); it saves a device-to-host sync per step that would stall the CPU until the GPU is idle.
        """
        return self._decode(tokens, positions, max_position)

    def _decode(self, tokens, positions, max_position: int | None, temperature: float | None = None):
        """:meth:`decode`'s step (with ``temperature``, graphs only: :meth:`decode_sampled`'s draw instead of
        the logits); leaves the step's expert ids in ``routed_experts``."""
        need = (int(positions.max()) if max_position is None else int(max_position)) + 1
        nb = tokens.shape[0]
        if self.cuda_graphs:
            out, routing = graphs.replay(self, tokens, positions, need, temperature)
        elif self.compile and self._bucket(nb) > nb:  # pad to the bucket: compiled code is specialized to its batch size
            pad = tokens.new_zeros(self._bucket(nb) - nb)  # position 0 of idle slots nb..bucket-1, as graphs do
            out = self._decode_eager(torch.cat([tokens, pad]), torch.cat([positions, pad]), need)[:nb]
            routing = self._step_routing
        else:
            out, routing = self._decode_eager(tokens, positions, need), self._step_routing
        self.routed_experts = None if routing is None else routing[:nb]  # a view of a graph's static output:
        return out  # read it before the next step

    def _decode_eager(self, tokens, positions, span: int):
        """The decode step over an attention window of ``span`` cache positions (``>= max(positions) + 1``;
        positions past each slot's own are masked). ``tokens``/``positions`` ``[nb]`` -> logits ``[nb, V]``;
        the step's expert ids ``[nb, L, k]`` int32 (or None) are left in ``_step_routing``."""
        nb = tokens.shape[0]
        model = self.model.model
        h, cos, sin = self._embed(model, tokens[:, None], positions[:, None])
        if self.exact:
            attend = self._exact_step_attention(self, positions, span)
        else:
            attend = step_attention(self, positions, span, (cos, sin))  # attend(l, q, k, v)
        parts = [self._parts(layer) for layer in self.layers]  # [(qkv, gate_up)] per layer
        q, k, v = self._project(self.layers[0], h, cos, sin, self._rope, parts[0][0])
        routed = []
        for l, layer in enumerate(self.layers):
            o = attend(l, q, k, v)
            if l + 1 < self.num_layers:
                h, experts, q, k, v = self._step(layer, self.layers[l + 1], h, o, cos, sin, self._rope, parts[l][1],
                                                 parts[l + 1][0])
            else:
                logits, experts = self._last(layer, h, o, model.norm, self.model.lm_head, self.float_logits, parts[l][1])
            routed.append(experts)
        self._step_routing = self._stack_routing(routed, (nb,))
        return logits

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

    def _bucket(self, nb: int) -> int:
        """The batch bucket of ``nb`` rows: the power of two at or above it, at most ``max_slots``. A compiled
        runner's smallest bucket is 2: Dynamo specializes a dimension of size 1, so a step of one row would
        compile every part of the step once more (seconds at the first capture of bucket 1); it pads to two
        rows instead, as any batch pads to its bucket."""
        b = 2 if self.compile else 1
        while b < nb:
            b *= 2
        return min(b, self.max_slots)

    def _span(self, need: int) -> int:
        """Attention span of a graph: ``need`` (longest context) rounded up to 256, capped at the context length."""
        return min(self.context_length, -(-need // 256) * 256)

    def decode_sampled(self, tokens: torch.Tensor, positions: torch.Tensor, temperature: float,
                       max_position: int | None = None, packed: bool = False):
        """:meth:`decode`, then one token per slot from ``sampling_kernel.fused_sample`` at ``temperature``
        (0: greedy): ``(tokens [nb] int64, logprobs [nb] float32)``, or with ``packed`` both in one ``[2, nb]``
        float64 tensor (token ids are exact in float64), ready for one device-to-host copy. The tokens are
        also left in ``step_tokens[:nb]``: a caller that passes ``step_tokens[:nb]`` as ``tokens`` (and
        ``step_positions[:nb]``) has the next step's input in place, with no copies. With ``cuda_graphs``
        the sampling is part of the step's graph (one graph per temperature seen; the draw's seed comes
        from torch's CUDA generator, which a graph replay advances), so a step costs one launch and no
        separate sampler kernels. Views of a graph's static outputs: read them before the next step.
        Needs CUDA and Triton (``sampling_kernel.fused_sample_available``)."""
        if self.cuda_graphs:
            sampled, logprobs, both = self._decode(tokens, positions, max_position, float(temperature))
        else:
            sampled, logprobs, both = graphs.draw_into(self.decode(tokens, positions, max_position), temperature,
                                                 self.step_tokens[:tokens.shape[0]])
        return both if packed else (sampled, logprobs)
