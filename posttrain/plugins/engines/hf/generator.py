"""The ``hf`` engine's model: any ``AutoModelForCausalLM`` decoding batches of rows with its own KV cache.

A batch is decoded as one left-padded ``[B, P]`` prefill and then one token per step (``[B, 1]`` with the
cache transformers' forward returns), with an attention mask and explicit position ids
(``position[b, t] = (number of real tokens of row b up to t) - 1``), so a padded row computes what it
computes alone. Each step's next-token logits ``z [B, V]`` (float32) go through the local engine's
sampler (:func:`posttrain.plugins.engines.local.sampling.sample_tokens`): greedy rows take ``argmax z``
with log-prob ``log_softmax(z)[token]``; sampled rows draw from ``softmax(z / T)`` truncated by
``top_k``/``top_p``/``min_p`` and report ``log_softmax(z / T)[token]``; a seeded row's draw is a function
of ``(seed, step)`` only, so it repeats under any batching (and matches the local engine's draw on the
same logits).

A row ends on a stop token (``stop_token_ids``, or EOS unless ``ignore_eos``; kept as its last output
id), a stop string (``stop``; trimmed from ``text`` unless ``no_stop_trim``), ``max_new_tokens``, the
context length, or an abort. Weights are replaced only between batches (:meth:`HFGenerator.load_weights`:
every name and shape checked before the first copy).

Vision-language checkpoints (a ``vision_config``; built with ``AutoModelForImageTextToText``): a row's
``images`` (references, :mod:`posttrain.core.vision`) become ``pixel_values`` and ``image_grid_thw`` for the
prefill (the image processor runs in the decode thread), in row order, and its prompt holds the expanded image
tokens; every row's positions are the model's
multimodal ones (``[3, B, P]`` from ``get_rope_index`` over the real tokens), each decode step the last + 1.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.core.lora import AdapterMerge
from posttrain.plugins.engines.local.sampling import RequestSampling, sample_tokens

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Row:
    """One prompt of a request, decoded as one row of a batch."""

    prompt: list[int]
    params: RequestSampling
    rid: str
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    text_end: int | None = None  # where a matched stop string starts in the decoded text (trimmed there)
    images: list[str] | None = None  # image references (vision-language), their tokens expanded in ``prompt``


class HFGenerator:
    """An HF causal LM on one device; ``decode(rows)`` fills each row's ``output``, ``logprobs``, ``finish``."""

    def __init__(self, model_dir: str, device: str = "cpu", dtype: str = "auto", from_config: bool = False,
                 context_length: int = 0):
        """``dtype``: ``auto`` is the checkpoint's ``torch_dtype`` on a GPU and float32 on the CPU;
        ``from_config``: build the model from ``config.json`` alone (random weights; every weight comes
        from the first update)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        from posttrain.core.vision import ImageInputs, is_vision_config

        self.model_dir, self.device = str(Path(model_dir).resolve()), torch.device(device)
        config = AutoConfig.from_pretrained(self.model_dir)
        self.vision = ImageInputs.from_dir(self.model_dir) if is_vision_config(config) else None
        auto = AutoModelForImageTextToText if self.vision is not None else AutoModelForCausalLM
        if dtype == "auto":
            named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
            self.dtype = torch.float32 if self.device.type == "cpu" else (
                DTYPES.get(str(named).removeprefix("torch."), torch.bfloat16))
        else:
            self.dtype = DTYPES[dtype]
        if from_config:
            self.model = auto.from_config(config, dtype=self.dtype)
        else:
            self.model = auto.from_pretrained(self.model_dir, dtype=self.dtype)
        self.model.to(self.device).eval()
        self.config = self.model.config
        # the KV cache's argument and output field: ``cache`` in newer transformers, ``past_key_values`` before
        params = inspect.signature(self.model.forward).parameters
        self.cache_key = "cache" if "cache" in params else "past_key_values"
        # only the last position's logits: a prefill's [B, P, V] would dwarf the model at a 150k vocabulary
        self.last_logits = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.tied = bool(getattr(self.config, "tie_word_embeddings", False))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        text = self.config.get_text_config()
        eos = getattr(text, "eos_token_id", None)
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer.eos_token_id is not None:
            self.eos.add(self.tokenizer.eos_token_id)
        self.vocab_size = int(text.vocab_size)
        limit = int(getattr(text, "max_position_embeddings", 0) or 4096)
        self.context_length = min(context_length, limit) if context_length else limit
        self.weight_version = "0"
        self.lock = threading.Lock()  # one batch or one weight update at a time
        self.adapters = AdapterMerge()  # LoRA pushes: each adapted weight's base, merged again at every push
        self.aborted: set[str] = set()  # rids to end at the next step ("" ends every row)

    # ------------------------------------------------------------------ decoding
    @torch.no_grad()
    def decode(self, rows: list[Row]) -> None:
        """Decode ``rows`` together until every one has finished."""
        with self.lock:
            ids, mask = self._left_padded(rows)
            positions, extra = self._prefill_inputs(rows, ids, mask)
            cache = None
            for r in rows:
                self._finished(r)
            while any(r.finish is None for r in rows):
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                                 **{self.cache_key: cache}, **extra, **self.last_logits)
                extra = {}
                cache = getattr(out, self.cache_key)
                live = [i for i, r in enumerate(rows) if r.finish is None]
                logits = out.logits[live, -1].float()
                tokens, logprobs = sample_tokens(logits, [rows[i].params for i in live],
                                                 [len(rows[i].output) for i in live], fused=False)
                step = torch.zeros(len(rows), dtype=torch.long)
                for i, token, lp in zip(live, tokens.tolist(), logprobs.tolist()):
                    rows[i].output.append(token)
                    rows[i].logprobs.append(lp)
                    step[i] = token
                    self._finished(rows[i])
                ids = step[:, None].to(self.device)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                positions = positions[..., -1:] + 1

    def _prefill_inputs(self, rows: list[Row], ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """``(position_ids, extra forward kwargs)`` of the prefill: ``[B, P]`` counts of real tokens - 1, or for
        a vision-language model its ``[3, B, P]`` multimodal positions and the rows' pixels."""
        if self.vision is None:
            return (mask.cumsum(-1) - 1).clamp(min=0), {}
        from posttrain.core.vision import rope_positions

        refs = [ref for r in rows for ref in r.images or []]
        pixels, grid = self.vision.pixels(refs) if refs else (None, None)
        grid = grid.to(self.device) if refs else None
        extra = {"pixel_values": pixels.to(self.device, self.dtype), "image_grid_thw": grid} if refs else {}
        return rope_positions(self.model, ids, grid, self.vision.image_token_id, mask), extra

    def _left_padded(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids [B, P], attention_mask [B, P])``: prompts right-aligned, so every row's next token
        is predicted at the last column."""
        width = max(len(r.prompt) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt):] = 1
        return ids.to(self.device), mask.to(self.device)

    def _finished(self, r: Row) -> bool:
        """Set ``r.finish`` when its last token ends it (see the module doc); whether it has ended."""
        if r.finish is not None:
            return True
        p, n = r.params, len(r.output)
        if r.rid in self.aborted or "" in self.aborted:
            r.finish = {"type": "abort", "message": "aborted by /abort_request"}
        elif n and n >= p.min_new_tokens and (r.output[-1] in p.stop_token_ids
                                               or (not p.ignore_eos and r.output[-1] in self.eos)):
            r.finish = {"type": "stop", "matched": r.output[-1]}
        elif n and p.stop and n >= p.min_new_tokens and self._stop_string(r):
            pass
        elif n >= p.max_new_tokens or len(r.prompt) + n >= self.context_length:
            r.finish = {"type": "length", "length": n}
        return r.finish is not None

    def _stop_string(self, r: Row) -> bool:
        text = self.tokenizer.decode(r.output, skip_special_tokens=r.params.skip_special_tokens)
        for s in r.params.stop:
            at = text.find(s)
            if at >= 0:
                r.finish = {"type": "stop", "matched": s}
                r.text_end = None if r.params.no_stop_trim else at
                return True
        return False

    def text(self, r: Row) -> str:
        text = self.tokenizer.decode(r.output, skip_special_tokens=r.params.skip_special_tokens)
        return text if r.text_end is None else text[:r.text_end]

    # ------------------------------------------------------------------ weights
    def own_tensors(self) -> dict[str, torch.Tensor]:
        """The model's tensors by HF name (a tied ``lm_head.weight`` is the embedding's)."""
        return dict(self.model.state_dict())

    def load_weights(self, named: dict[str, torch.Tensor], require_all: bool = False) -> int:
        """Copy ``named`` (HF names -> tensors, cast to the model's dtype) into the model; all or nothing:
        unknown names, wrong shapes or (``require_all``) missing tensors raise ``ValueError`` before any
        copy. A tied output layer may come under either name. Returns the tensors copied. LoRA adapter pairs are
        merged into their weight from its kept base first (:class:`~posttrain.core.lora.AdapterMerge`)."""
        own = self.own_tensors()
        with self.lock:
            named = self.adapters.resolve(named, own.get)
        unknown = sorted(set(named) - set(own))
        if unknown:
            raise ValueError(f"unknown tensor(s) {', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}")
        bad = [n for n, t in named.items() if tuple(t.shape) != tuple(own[n].shape)]
        if bad:
            raise ValueError(f"{bad[0]} has shape {tuple(named[bad[0]].shape)}, the model's is {tuple(own[bad[0]].shape)}")
        if require_all:
            optional = {"lm_head.weight"} if self.tied else set()
            missing = sorted(set(own) - set(named) - optional)
            if missing:
                raise ValueError(f"missing tensor(s) {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        with self.lock, torch.no_grad():
            for name, tensor in named.items():
                own[name].copy_(tensor.to(own[name].device, own[name].dtype))
        return len(named)

    def weight_checksums(self) -> dict[str, str]:
        """SHA-256 of every tensor's bytes as held (``core.rollout.weight_check.tensor_digests``)."""
        from posttrain.core.rollout.weight_check import tensor_digests

        with self.lock:
            return tensor_digests(self.own_tensors())

    def move(self, device: str | torch.device) -> int:
        """The weights to ``device`` (``/release_memory_occupation`` on a GPU: to host memory); bytes moved."""
        with self.lock:
            self.model.to(device)
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

