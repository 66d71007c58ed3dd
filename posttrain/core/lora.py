"""LoRA: the ``trainer.lora`` config every trainer backend reads, and the adapter-update format of the weight push.

A LoRA adapter on a linear layer ``y = x W^T`` (``W [out, in]``) trains two small matrices ``A [r, in]`` and
``B [out, r]`` (``B`` starts at 0) while ``W`` stays frozen::

    y = x W^T + (alpha / r) * dropout(x) A^T B^T      i.e.  W_eff = W + (alpha / r) * B @ A

``r = trainer.lora.rank`` (0: off), on the modules named in ``target_modules`` (HF module names: ``q_proj``,
``down_proj``, ...; a Megatron backend maps them to its fused linears). ``lm_head`` may be named too (not by
default, and not with tied embeddings): a random-init model's frozen output layer (std 0.02 on RMS-normalized
hidden states) bounds its logits to about +-1.3, so adapters on the decoder alone cannot make it confident.

Adapter updates on the wire: a trainer with adapters pushes, after a first push of the base weights, only pairs
``<module>.lora_A.weight [r, in]`` and ``<module>.lora_B.weight [out, r]`` under the HF module name, with the
scale folded into ``B`` (``B' = (alpha / r) B``), so ``W_eff = W + B' @ A`` needs no config on the engine side.
:class:`AdapterMerge` is the engine's half: it keeps each adapted weight's base and re-merges from it at every
push (``W := W_base + B' @ A``, computed in float32), so deltas never accumulate. Per adapted ``[out, in]`` weight a
push carries ``r (in + out)`` numbers instead of ``in x out``; at rank 32 on the Qwen3-1.7B shape that is 0.75% of
the model's bytes with adapters on q, k, v, o and 2.03% on all seven linears (``tests/unit/core/test_lora.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.core.schema import option

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGETS = ALL_LINEAR + ("lm_head",)  # the output layer too, on request (not with tied embeddings)
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


@dataclass
class LoraConfig:
    """``trainer.lora``: low-rank adapters instead of full fine-tuning (rank 0 = off)."""

    rank: int = option(0, ge=0, help="adapter rank r; 0 trains every weight (no LoRA)")
    alpha: float = option(16.0, gt=0.0, help="the adapter's output is scaled by alpha / rank")
    dropout: float = option(0.0, ge=0.0, lt=1.0, help="dropout on the adapter's input (training passes only)")
    target_modules: list[str] = option(default_factory=lambda: list(ALL_LINEAR),
                                       help="HF module names (last name component) that get adapters")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    def validate(self) -> list[str]:
        errors = []
        if self.rank and not self.target_modules:
            errors.append("target_modules: empty; name the modules that get adapters (e.g. q_proj, v_proj)")
        unknown = sorted(set(self.target_modules) - set(TARGETS))
        if self.rank and unknown:
            errors.append(f"target_modules: {', '.join(unknown)} not among the linear layers that take adapters "
                          f"({', '.join(TARGETS)})")
        return errors


def tied_head_error(lora: LoraConfig, spec: Any) -> list[str]:
    """``trainer.lora.target_modules`` naming ``lm_head`` of a model whose output layer is its embedding: the merged
    output layer would no longer be the embedding every engine and checkpoint ties it to."""
    if not lora.enabled or "lm_head" not in lora.target_modules or spec is None:
        return []
    try:
        tied = bool(spec.hf_config().get("tie_word_embeddings"))
    except Exception:  # noqa: BLE001 - an unreadable checkpoint config is the model section's error to report
        return []
    return ["trainer.lora.target_modules: lm_head of a model with tied embeddings (its output layer is its "
            "embedding); leave lm_head out"] if tied else []


def write_peft_adapter(out: Any, adapters: dict[str, Any], lora: LoraConfig, base_path: str | None) -> Any:
    """An adapter in peft's format in directory ``out``: ``adapter_config.json`` (peft's own writer; its
    ``target_modules``: the module names the pairs adapt; ``base_model_name_or_path``: the checkpoint the run started
    from) and ``adapter_model.safetensors`` under peft's names (``base_model.model.<module>.lora_A.weight``).
    ``adapters``: ``{<module>.lora_A.weight: A, <module>.lora_B.weight: B}`` with ``B`` unscaled (peft applies
    alpha / r itself). Loads with ``peft.PeftModel.from_pretrained(base_model, out)``."""
    from pathlib import Path

    import peft
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    targets = sorted({adapter_part(name)[0].rsplit(".", 1)[-1] for name in adapters})
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                             bias="none", base_model_name_or_path=base_path)
    config.save_pretrained(str(out))
    save_file({"base_model.model." + name: t.detach().to("cpu", copy=True).contiguous() for name, t in adapters.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def adapter_part(name: str) -> tuple[str, str | None]:
    """``("<module>", "A" | "B")`` for an adapter tensor's name, ``(name, None)`` for any other tensor."""
    for suffix, kind in ((LORA_A, "A"), (LORA_B, "B")):
        if name.endswith(suffix):
            return name[: -len(suffix)], kind
    return name, None


@dataclass
class AdapterMerge:
    """An engine's adapter merging: :meth:`resolve` turns a pushed bucket (plain HF tensors and adapter pairs)
    into plain HF tensors to load. A plain tensor is a new base (the adapted weight's kept base is dropped); an
    adapter pair ``(A, B')`` of ``<module>`` gives ``<module>.weight = base + B' @ A`` from the base: the plain
    tensor of that name in the same bucket, else the one kept at an earlier pair, else the weight the engine holds. A pair may span two buckets: the first half waits."""

    base: dict[str, Any] = field(default_factory=dict)
    pending: dict[str, dict[str, Any]] = field(default_factory=dict)

    def resolve(self, named: dict[str, Any], current: Callable[[str], Any]) -> dict[str, Any]:
        """``named``: the bucket; ``current(hf_name)``: the engine's tensor of that name (to keep as a base), None
        when it has none. Raises ``ValueError`` naming such a weight, or a pair whose shapes do not give its shape."""
        import torch

        out, ready = {}, []
        for name, t in named.items():
            module, kind = adapter_part(name)
            if kind is None:
                out[name] = t
                self.base.pop(name, None)
                continue
            halves = self.pending.setdefault(module, {})
            halves[kind] = t
            if len(halves) == 2:
                ready.append(module)
        for module in ready:
            halves, target = self.pending.pop(module), module + ".weight"
            base = out.get(target)  # a base in this very bucket (a first push), else the kept one, else the engine's
            base = self.base.get(target) if base is None else base
            if base is None:
                held = current(target)
                if held is None:
                    raise ValueError(f"{target}: a LoRA adapter for a weight this model does not have")
                base = held.detach().clone()
            a, b = halves["A"], halves["B"]
            if b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(base.shape):
                raise ValueError(f"{module}: adapter B {tuple(b.shape)} @ A {tuple(a.shape)} does not give "
                                 f"the weight's shape {tuple(base.shape)}")
            delta = b.to(base.device, torch.float32) @ a.to(base.device, torch.float32)
            out[target] = (base.float() + delta).to(base.dtype)
            self.base[target] = base
        return out
