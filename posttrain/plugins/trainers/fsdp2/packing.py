"""Sequence packing in the ``fsdp2`` trainer (``trainer.backend.sequence_packing``): a micro-batch's samples
concatenated into one row, each attending to its own tokens only.

A micro-batch of ``b`` samples of lengths ``n_1..n_b`` becomes one row of ``N = sum n_i`` tokens
(:func:`posttrain.core.train_batch.pack`): ``input_ids [1, N]``, ``position_ids [1, N]`` restarting at 0 in
each sample, ``cu_seqlens [b + 1]`` (int32 offsets ``0, n_1, n_1 + n_2, ...``). The model runs with the
attention implementation :data:`ATTENTION`, registered in transformers' ``AttentionInterface``: it reads the
offsets from the forward's kwargs (``cu_seq_lens_q``, ``max_length_q``: transformers passes them down to
every attention call) and computes, for query ``i`` and key ``j`` of the row::

    visible(i, j) = same sample(i, j) and j <= i and (no sliding window W, or i - j < W)

on CUDA with torch's variable-length flash kernel (``torch.nn.attention.varlen.varlen_attn``, no padding
and ``sum n_i^2`` attention work), elsewhere (the CPU, float32, head dims past 256) with one SDPA per
sample. The model builds no mask (its mask functions know no such implementation).

So a sample's log-probs are those of its padded row: the same positions, the same attention, no padding
computed. An architecture packs when transformers hands its attention these kwargs and attention is its
only token mixer (:func:`cannot_pack` gives the reason when not). Packing is unsupported with pixel inputs
(vision-language models keep padded rows: their M-RoPE positions come from the image grid).
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config check imports this module before the driver imports torch
    import torch

ATTENTION = "posttrain_varlen"
# layer kinds (config ``layer_types``, ``layers_block_type``, ``block_types``) that are attention and nothing else
ATTENTION_LAYERS = {"full_attention", "sliding_attention", "attention"}
LAYER_KEYS = ("layer_types", "layers_block_type", "block_types")
log = logging.getLogger("posttrain.trainer")
_said: set[str] = set()


def cannot_pack(hf: dict[str, Any]) -> str | None:
    """Why the model of HF config ``hf`` cannot pack samples into one row, or None when it can. Reads the config
    and the text of transformers' modeling file: the config check runs before the driver imports torch."""
    from posttrain.core.vision import is_vision_config

    if is_vision_config(hf):
        return "a vision-language model (its positions come from the image grid; pixel inputs run padded)"
    kinds = {str(k) for key in LAYER_KEYS for k in (hf.get(key) or ())} - ATTENTION_LAYERS
    if kinds:
        return f"its {', '.join(sorted(kinds))} layers mix tokens outside attention, across sample boundaries"
    if hf.get("attn_logit_softcapping"):
        return "attention logit soft-capping (attn_logit_softcapping), which the varlen kernel lacks"
    if hf.get("attention_dropout"):
        return "attention dropout (attention_dropout), which the varlen kernel lacks"
    model_type = hf.get("model_type", "")
    source = modeling_source(model_type)
    if source is None:
        return f"transformers has no modeling code for model_type {model_type!r}"
    if "_supports_attention_backend = True" not in source:  # its attention calls get no forward kwargs
        return f"transformers' {model_type} does not hand its attention the sample offsets (no attention backends)"
    if "s_aux=" in source:  # its attention takes sink logits (gpt-oss)
        return "attention sinks, which the varlen kernel lacks"
    return None


@functools.cache
def modeling_source(model_type: str) -> str | None:
    """The text of transformers' ``modeling_*.py`` for ``model_type`` (found without importing transformers: the
    file beside the ``configuration_*.py`` that declares ``model_type = "..."``), or None."""
    import importlib.util
    import re
    from pathlib import Path

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations or not model_type:
        return None
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    direct = models / model_type / f"modeling_{model_type}.py"
    if direct.is_file():
        return direct.read_text()
    declares = re.compile(rf'model_type\s*=\s*"{re.escape(model_type)}"')
    for config in sorted(models.glob("*/configuration_*.py")):
        modeling = config.with_name(config.name.replace("configuration_", "modeling_", 1))
        if modeling.is_file() and declares.search(config.read_text()):
            return modeling.read_text()
    return None


def resolve(setting: bool | str, hf: dict[str, Any], key: str = "trainer.backend.sequence_packing") -> bool:
    """Whether to pack: ``auto`` packs where :func:`cannot_pack` finds nothing against it (and says once why not);
    ``true`` on a model that cannot pack is a :class:`~posttrain.core.errors.UsageError` naming the reason."""
    from posttrain.core.errors import UsageError

    if setting is False:
        return False
    reason = cannot_pack(hf)
    if reason is None:
        return True
    if setting is True:
        raise UsageError(f"{key}: {hf.get('model_type')} cannot pack: {reason}; set it to false (or auto)")
    line = f"{key}: auto -> off for {hf.get('model_type')}: {reason}"
    if line not in _said:
        _said.add(line)
        log.warning(line)
    return False


def register() -> None:
    """Add :data:`ATTENTION` to transformers' attention implementations (once per process)."""
    from transformers import AttentionInterface

    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, varlen_attention)


def forward_kwargs(packed: Any) -> dict[str, Any]:
    """The model's kwargs for a :class:`~posttrain.core.train_batch.Packed` row on its device."""
    return {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "cu_seq_lens_q": packed.cu_seqlens,
            "cu_seq_lens_k": packed.cu_seqlens, "max_length_q": packed.max_len, "max_length_k": packed.max_len}


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None, s_aux: Any = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query [1, Hq, N, D]``, ``key``/``value [1, Hkv, N, D(v)]``
    of a packed row -> ``([1, N, Hq, Dv], None)``, causal within each sample of ``kwargs["cu_seq_lens_q"]``."""
    import torch

    if softcap is not None or s_aux is not None or dropout:
        raise RuntimeError(f"{ATTENTION}: attention soft-capping, sinks and dropout are not supported; "
                           "set trainer.backend.sequence_packing: false")
    if attention_mask is not None:
        raise RuntimeError(f"{ATTENTION}: the model built an attention mask for a packed row")
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None:
        raise RuntimeError(f"{ATTENTION}: a forward without cu_seq_lens_q (the packed row's sample offsets)")
    window = sliding_window if sliding_window and sliding_window < max_len else None
    kernel = _flash_varlen()
    if kernel is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) \
            and query.shape[-1] <= 256 and (window is None or "window_size" in kernel[1]) and not _flash_refused:
        try:
            return _flash(kernel, query, key, value, cu, max_len, scaling, window), None
        except (RuntimeError, TypeError, ValueError) as exc:  # this torch's kernel refuses the call: exact fallback
            _flash_refused.append(repr(exc)[:200])
            log.warning("%s: torch's varlen flash attention refused a packed row (%s); packed rows run one SDPA "
                        "per sample", ATTENTION, _flash_refused[0])
    return _per_sample(query, key, value, cu.tolist(), scaling, window), None


_flash_refused: list[str] = []  # why the varlen kernel failed in this process (then never tried again)


@functools.cache
def _flash_varlen() -> tuple[Any, frozenset[str]] | None:
    """``(varlen_attn, its keyword names)`` of this torch, or None (before torch 2.9)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _flash(kernel: tuple[Any, frozenset[str]], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           cu: torch.Tensor, max_len: int, scale: float | None, window: int | None) -> torch.Tensor:
    """torch's varlen flash attention over the row (``[N, H, D]`` layout); a value head narrower than the query's
    (multi-head latent attention) is zero-padded for the kernel and cut back."""
    import torch

    fn, names = kernel
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, H, D]
    dv = v.shape[-1]
    if dv != q.shape[-1]:
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - dv))
    kw: dict[str, Any] = {}
    if "scale" in names:
        kw["scale"] = scale
    elif scale is not None:  # the kernel's own scale is D^-1/2
        q = q * (scale * q.shape[-1] ** 0.5)
    if "window_size" in names:
        kw["window_size"] = (window - 1 if window else -1, 0)  # left, right: causal, W keys back with self
    else:
        kw["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in names:
            kw["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    cu = cu.to(torch.int32)
    out = fn(q, k, v, cu, cu, max_len, max_len, **kw)
    return out[..., :dv].unsqueeze(0)


def _per_sample(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: list[int], scale: float | None,
                window: int | None) -> torch.Tensor:
    """One causal SDPA per sample (its keys and values only; a sliding window as an explicit mask)."""
    import torch

    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    outs = []
    for start, end in zip(cu[:-1], cu[1:]):
        n, mask = end - start, None
        if window is not None and n > window:
            i = torch.arange(n, device=query.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], attn_mask=mask,
            is_causal=mask is None, scale=scale))
    return torch.cat(outs, 2).transpose(1, 2)
