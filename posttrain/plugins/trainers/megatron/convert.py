"""Checkpoint conversion and verification (``rl-cli models convert|verify``).

- :func:`verify_checkpoint`: load an HF checkpoint into Megatron (TP from the parallel state), run the
  same tokens through Megatron and ``transformers``, and report the max absolute logit difference and
  whether Megatron -> HF gives back every checkpoint tensor bit for bit. A wrong mapping (swapped q/k,
  gate/up, a missed bias) shows up in the logits even when every shape fits.
- :func:`hf_to_megatron_dir` / :func:`megatron_dir_to_hf`: HF <-> Megatron dist-checkpoint (torch_dist)
  directories. A Megatron directory also holds ``posttrain_model.json`` (spec name + HF config), so the
  way back needs nothing else.

All functions are collective over the TP group when TP > 1 (run under ``torchrun``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.core.errors import UsageError
from posttrain.plugins.trainers.megatron import model as M

META_FILE = "posttrain_model.json"


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def verify_checkpoint(spec: Any, hf_dir: str | Path, *, tolerance: float = 1e-4, seq_len: int = 16,
                      batch: int = 2, seed: int = 0, attention: str = "auto") -> dict[str, Any]:
    """``{"max_abs_diff", "tolerance", "passed", "round_trip_exact", "round_trip_mismatches"}``.

    Both models run in ``spec.config.dtype`` (use float32 for a 1e-4 tolerance) on random token ids.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf = spec.hf_config()
    model = M.build_gpt(spec, hf, dtype=spec.config.dtype, attention=attention, init_weights=False)
    M.load_hf(model, spec, hf, hf_dir)
    model.eval()
    ckpt = M.HFCheckpoint(hf_dir)
    mismatches = []
    for name, tensor in M.iter_hf(model, spec, hf):
        original = ckpt.get(name).to(tensor.dtype)
        if original.shape != tensor.shape or not torch.equal(original, tensor.cpu()):
            mismatches.append(name)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(hf["vocab_size"]), (batch, seq_len), generator=g)
    device = next(model.parameters()).device
    with torch.no_grad():
        positions = torch.arange(seq_len).unsqueeze(0).expand(batch, -1)
        mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), 1)[None, None]
        ours = _staged_logits(model, ids.to(device), positions.to(device), mask.to(device),
                              int(hf["vocab_size"]), int(hf["hidden_size"]))
        reference = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=M.DTYPES[spec.config.dtype]).eval()
        theirs = reference(ids).logits.float()
    diff = float((ours - theirs).abs().max())
    return {"max_abs_diff": diff, "tolerance": tolerance, "passed": diff <= tolerance and not mismatches,
            "round_trip_exact": not mismatches, "round_trip_mismatches": mismatches}


def _staged_logits(model: Any, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, vocab: int,
                   hidden: int) -> torch.Tensor:
    """Logits ``[b, s, vocab]`` (fp32, CPU, on every rank) of ``ids [b, s]``; with PP each stage receives
    the previous stage's hidden states ``[s, b, H]``, runs its layers and sends them on, and the last
    stage's logits are broadcast over the pipeline group."""
    from megatron.core import parallel_state as ps

    if M.pp_size() == 1:
        return model(ids, positions, attention_mask=mask, runtime_gather_output=True)[..., :vocab].float().cpu()
    dtype = next(model.parameters()).dtype
    if not ps.is_pipeline_first_stage():
        received = torch.empty(ids.shape[1], ids.shape[0], hidden, dtype=dtype, device=ids.device)
        dist.recv(received, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(received)
    out = model(ids, positions, attention_mask=mask, runtime_gather_output=True)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        out = torch.empty(*ids.shape, vocab, dtype=torch.float32, device=ids.device)
    else:
        out = out[..., :vocab].float().contiguous()
    group = ps.get_pipeline_model_parallel_group()
    dist.broadcast(out, src=dist.get_global_rank(group, M.pp_size() - 1), group=group)  # on the model's device
    return out.cpu()


def hf_to_megatron_dir(spec: Any, hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``out_dir`` as a Megatron dist-checkpoint of the HF checkpoint (model weights only)."""
    from megatron.core import dist_checkpointing

    hf = spec.hf_config()
    model = M.build_gpt(spec, hf, dtype=spec.config.dtype, attention="sdpa", init_weights=False)
    M.load_hf(model, spec, hf, hf_dir)
    out = Path(out_dir)
    if _is_writer():
        if out.exists() and any(out.iterdir()):
            raise UsageError(f"{out}: exists and is not empty")
        out.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(prefix="model.")}, str(out))
    if _is_writer():  # written last: a directory with it is a complete checkpoint
        (out / META_FILE).write_text(json.dumps({"spec": spec.name, "dtype": spec.config.dtype, "hf_config": hf,
                                                 "source": str(hf_dir)}, indent=2))
    return out


def read_meta(megatron_dir: str | Path) -> dict[str, Any]:
    p = Path(megatron_dir) / META_FILE
    if not p.is_file():
        raise UsageError(f"{megatron_dir}: not a posttrain Megatron checkpoint (no {META_FILE})")
    return json.loads(p.read_text())


def megatron_dir_to_hf(spec: Any, megatron_dir: str | Path, out_dir: str | Path, hf: dict[str, Any]) -> Path | None:
    """Write an HF checkpoint from a dist-checkpoint written by :func:`hf_to_megatron_dir` (or ``save``)."""
    from megatron.core import dist_checkpointing

    from posttrain.plugins.trainers.megatron.checkpoint import quiet_sharded_tensor

    model = M.build_gpt(spec, hf, dtype=spec.config.dtype, attention="sdpa", init_weights=False)
    with quiet_sharded_tensor():
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict(prefix="model.")}, str(megatron_dir))
    state = {k.removeprefix("model."): v for k, v in loaded["model"].items()}
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise UsageError(f"{megatron_dir}: checkpoint lacks {missing[:3]}")
    source = read_meta(megatron_dir).get("source") if (Path(megatron_dir) / META_FILE).is_file() else None
    return M.save_hf(model, spec, hf, out_dir, source_dir=source if source and Path(source).is_dir() else None)
