"""``TorchModel``: the policy (or critic) of the ``torch_simple`` backend, an HF model in plain PyTorch.

Shapes follow :class:`posttrain.core.train_batch.TrainBatch`: every per-token tensor is ``[B, T]`` aligned
with ``tokens``, so with logits ``z = model(tokens) [B, T, V]``::

    log_probs[b, t] = log_softmax(z[b, t - 1])[tokens[b, t]]     for 1 <= t < lengths[b], else 0
    entropy[b, t]   = H(softmax(z[b, t - 1]))                    (same positions)
    values[b, t]    = head(h[b, t - 1])                          (critic: h the final hidden states)

Right padding needs no attention mask under a causal model: real tokens never see the padding after them.
The train step is the one every backend takes: ``total_loss(loss_fn(...), ...)`` per micro-batch with
the whole batch's token and sequence counts (so micro-batch losses sum to the batch loss), grad-norm
clipping to ``grad_clip``, the ``lr_at`` schedule, one AdamW step.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from posttrain.core.losses import batch_counts, entropy_from_logits, total_loss, value_loss
from posttrain.core.train_batch import TrainBatch
from posttrain.core.trainer_backend import lr_at

# files of an HF checkpoint besides the weights and config.json, copied from the spec's path
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# total_loss's terms as train/ metrics; each micro-batch's is its share of the batch value (summed)
SUMMED = {"kl_loss": "kl", "entropy": "entropy"}


def build_hf_model(spec: Any, seed: int) -> Any:
    """The spec's HF model in float32: its checkpoint (``spec.config.path``) or, from ``hf_config()``, a
    random init drawn after ``torch.manual_seed(seed)`` (the same seed gives the same weights)."""
    import transformers

    if spec.config.path:
        return transformers.AutoModelForCausalLM.from_pretrained(spec.config.path, dtype=torch.float32)
    hf = spec.hf_config()
    kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "architectures", "torch_dtype", "dtype")}
    config = transformers.AutoConfig.for_model(hf["model_type"], **kwargs)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


class TorchModel:
    """One HF model and its AdamW, on one device; ``role="critic"`` adds a zero-initialized value head."""

    def __init__(self, spec: Any, config: Any, *, device: str = "auto", seed: int = 0, role: str = "actor",
                 max_response_len: int | None = None):
        """``config``: the run's ``trainer`` section (lr, schedule, clipping, Adam, KL, entropy, batch sizes)."""
        self.spec, self.config, self.role, self.max_response_len = spec, config, role, max_response_len
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.dtype = DTYPES[spec.config.dtype]  # of what leaves: export_hf, save_hf
        self.model = build_hf_model(spec, seed).to(self.device)
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self.value_head = None
        if role == "critic":  # zero: every initial value is 0
            self.value_head = torch.nn.Linear(self.model.config.hidden_size, 1, device=self.device)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
        c = config
        self.optimizer = torch.optim.AdamW(self._params(), lr=c.lr, betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps,
                                           weight_decay=c.weight_decay)
        self.step = 0
        self._snapshots: dict[str, dict[str, torch.Tensor]] = {}
        if role == "actor":
            self.snapshot("ref")

    def _params(self) -> list[torch.nn.Parameter]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return params + (list(self.value_head.parameters()) if self.value_head is not None else [])

    # ------------------------------------------------------------------ forward
    def _micro_batches(self, batch: TrainBatch) -> Iterator[TrainBatch]:
        size = self.config.micro_batch_size
        for start in range(0, len(batch), size):
            yield batch.select(start, min(start + size, len(batch))).to(self.device)

    def _forward(self, mb: TrainBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(log_probs [b, T], entropy [b, T] | None)`` of micro-batch ``mb``, with autograd."""
        logits = self.model(input_ids=mb.tokens).logits.float()[:, :-1]  # [b, T-1, V]: predicts tokens 1..T-1
        lp = torch.log_softmax(logits, -1).gather(-1, mb.tokens[:, 1:, None]).squeeze(-1)
        keep = _valid(mb)
        lp = torch.nn.functional.pad(lp, (1, 0)) * keep
        ent = torch.nn.functional.pad(entropy_from_logits(logits), (1, 0)) * keep if with_entropy else None
        return lp, ent

    def _values(self, mb: TrainBatch) -> torch.Tensor:
        hidden = self.model(input_ids=mb.tokens, output_hidden_states=True).hidden_states[-1][:, :-1]
        return torch.nn.functional.pad(self.value_head(hidden.float()).squeeze(-1), (1, 0)) * _valid(mb)

    @torch.no_grad()
    def log_probs(self, batch: TrainBatch, *, with_entropy: bool = False, weights: str | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(log_probs [B, T], entropy [B, T] | None)``, float32 on the CPU; ``weights="ref"`` (or any
        :meth:`snapshot` tag) uses those weights."""
        width = batch.tokens.shape[1]
        lps, ents = [], []
        with self._weights(weights):
            self.model.eval()
            for mb in self._micro_batches(batch):
                lp, ent = self._forward(mb, with_entropy)
                lps.append(_pad(lp, width).cpu())
                ents.append(_pad(ent, width).cpu() if ent is not None else None)
        return torch.cat(lps), (torch.cat(ents) if with_entropy else None)

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """Critic values ``[B, T]`` (float32, CPU)."""
        self.model.eval()
        width = batch.tokens.shape[1]
        return torch.cat([_pad(self._values(mb), width).cpu() for mb in self._micro_batches(batch)])

    # ------------------------------------------------------------------ reference weights
    def snapshot(self, tag: str) -> None:
        """Keep a CPU copy of the current weights under ``tag`` (``"ref"``: taken at build)."""
        self._snapshots[tag] = {n: t.detach().to("cpu", copy=True) for n, t in self.model.state_dict().items()}

    @contextmanager
    def _weights(self, tag: str | None):
        if tag is None:
            yield
            return
        if tag not in self._snapshots:
            raise KeyError(f"no weights snapshot {tag!r}; have: {', '.join(self._snapshots) or 'none'}")
        current = {n: t.detach().to("cpu", copy=True) for n, t in self.model.state_dict().items()}
        self.model.load_state_dict(self._snapshots[tag])
        try:
            yield
        finally:
            self.model.load_state_dict(current)

    # ------------------------------------------------------------------ training
    def train_step(self, batch: TrainBatch, loss_fn: Callable[..., Any] | None = None) -> dict[str, float]:
        """One AdamW step over ``batch`` in micro-batches; ``loss``, ``grad_norm``, ``lr``, the loss's own
        metrics (``pg/...``), ``kl`` and ``entropy`` (actor), or the value loss's (critic)."""
        c = self.config
        lr = lr_at(self.step, c)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        tokens, seqs = batch_counts(batch.response_mask)
        totals: dict[str, float] = {}
        for mb in self._micro_batches(batch):
            if self.role == "critic":
                loss, metrics = value_loss(self._values(mb), mb.old_values if mb.old_values is not None else
                                           torch.zeros_like(mb.returns), mb.returns, mb.response_mask,
                                           clip=c.value_clip if c.value_clip and mb.old_values is not None else None,
                                           global_tokens=tokens, global_seqs=seqs)
            else:
                loss, metrics = self._policy_loss(mb, loss_fn, tokens, seqs)
            loss.backward()
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
            for key, value in metrics.items():
                share = 1.0 if key in SUMMED.values() else len(mb) / len(batch)
                totals[key] = totals.get(key, 0.0) + float(value) * share
        norm = torch.nn.utils.clip_grad_norm_(self._params(), c.grad_clip if c.grad_clip else float("inf"))
        self.optimizer.step()
        self.step += 1
        return {**totals, "grad_norm": float(norm), "lr": lr}

    def _policy_loss(self, mb: TrainBatch, loss_fn: Any, tokens: int, seqs: int) -> tuple[torch.Tensor, dict]:
        c = self.config
        if loss_fn is None:
            raise ValueError("train_step: the actor needs a loss_fn")
        if c.kl_loss_coef and mb.ref_log_probs is None:
            raise ValueError("train_step: kl_loss_coef > 0 needs batch.ref_log_probs")
        lp, ent = self._forward(mb, with_entropy=c.entropy_coef != 0.0)
        old = mb.old_log_probs if mb.old_log_probs is not None else lp.detach()
        pg, metrics = loss_fn(lp, old, mb.advantages, mb.response_mask, is_weights=mb.is_weights,
                              global_tokens=tokens, global_seqs=seqs)
        loss_cfg = getattr(loss_fn, "config", None)
        total, terms = total_loss(
            pg, mb.response_mask, log_probs=lp if c.kl_loss_coef else None,
            ref_log_probs=mb.ref_log_probs if c.kl_loss_coef else None, entropy=ent, kl_loss_coef=c.kl_loss_coef,
            kl_kind=c.kl_kind, entropy_coef=c.entropy_coef, aggregation=getattr(loss_cfg, "aggregation", "token-mean"),
            global_tokens=tokens, global_seqs=seqs,
            max_response_len=getattr(loss_cfg, "max_response_len", None) or self.max_response_len)
        out = {f"pg/{k}" if "/" not in k else k: v for k, v in dict(metrics or {}).items()}
        out.update({SUMMED[k]: v for k, v in terms.items() if k in SUMMED})
        return total, out

    # ------------------------------------------------------------------ weights out
    def _hf_named(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            if not (self.tied and name == "lm_head.weight"):  # the embedding carries a tied output layer
                yield name, tensor.detach().to(self.dtype)

    def export_hf(self, bucket_bytes: int = 1 << 30) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets ``[(hf_name, tensor)]`` of at most ``bucket_bytes`` (a larger tensor alone), in ``model.dtype``."""
        bucket, size = [], 0
        for name, tensor in self._hf_named():
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += nbytes
        if bucket:
            yield bucket

    def save_hf(self, out_dir: str | Path) -> Path:
        """An HF checkpoint (``save_pretrained``: config.json + safetensors, ``model.dtype``); tokenizer
        files copied from the spec's checkpoint when it has one."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        named = {n: t.cpu() for n, t in self._hf_named()}
        self.model.save_pretrained(str(out), state_dict=named)
        config = json.loads((out / "config.json").read_text())
        config["dtype"] = self.spec.config.dtype  # save_pretrained writes the live (float32) model's
        (out / "config.json").write_text(json.dumps(config, indent=2))
        source = self.spec.config.path
        for fname in TOKENIZER_FILES if source else ():
            if (Path(source) / fname).is_file():
                shutil.copy(Path(source) / fname, out / fname)
        return out

    # ------------------------------------------------------------------ checkpoints
    def save(self, ckpt_dir: str | Path) -> None:
        """Weights, optimizer state and step (``torch.save``); the reference is rebuilt from the seed."""
        path = Path(ckpt_dir)
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                    "value_head": self.value_head.state_dict() if self.value_head is not None else None},
                   path / "trainer.pt")

    def load(self, ckpt_dir: str | Path) -> None:
        state = torch.load(Path(ckpt_dir) / "trainer.pt", map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        if self.value_head is not None:
            self.value_head.load_state_dict(state["value_head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])


def _valid(mb: TrainBatch) -> torch.Tensor:
    """``[b, T]`` 1.0 on columns ``1 <= t < lengths[b]`` (a prefix precedes them), else 0."""
    cols = torch.arange(mb.tokens.shape[1], device=mb.tokens.device)[None]
    return ((cols >= 1) & (cols < mb.lengths.to(cols.device)[:, None])).float()


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1])) if t.shape[1] < width else t
