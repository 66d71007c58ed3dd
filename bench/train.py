"""Benchmark one full train step (forward + backward + optimizer) of MegatronTrainer; prints ONE JSON line.

    python bench/train.py --spec qwen3 --preset qwen3-1.7B --micro-batch 4 --seq-len 2048 --device cuda
    python bench/train.py --spec qwen3 --preset tiny --micro-batch 4 --seq-len 128 --device cpu

Weights are random (the preset's shape); tokens are random, every sample full length, all but the first
token trained on with a PPO-clip loss (log-probs from the chunked vocab-parallel path, never the full
fp32 logits). One optimizer step = ``--grad-accum`` micro-batches.

Model FLOPs per token (the convention of Megatron's and PaLM's MFU): ``6 * P + 12 * L * (n_q * d_head) * s``
with ``P`` the matmul parameters (attention, MLP, output layer; not the embedding lookup) and the
attention term counting the full ``s x s`` score matrix. Recomputation (the chunked log-softmax's
backward) is not counted: TFLOP/s is model FLOPs over wall time. For a MoE model ``P`` is the ACTIVE
count: per MoE layer the router, the ``num_experts_per_tok`` routed experts a token goes to and the
shared experts (:func:`active_matmul_params`); the JSON line also gives ``active_params``/``total_params``
(every parameter, embeddings included, as `rl-cli models list` counts them) and the matmul counts.

    python bench/train.py --spec qwen3_moe --preset qwen3-30B-A3B --layers 8 --micro-batch 4 --seq-len 2048 --device cuda

``--layers N`` cuts the preset to its first ``N`` layers (``model.overrides: {num_hidden_layers: N}``).
``--experts grouped|sequential`` picks a MoE model's expert layer (grouped GEMMs, the default, or Megatron's
``SequentialMLP`` loop: ``moe_grouped_gemm``); ``--experts both`` runs the step once with each, each in a
process of its own, one JSON line each (``experts`` in the line)::

    python bench/train.py --spec qwen3_moe --preset qwen3-30B-A3B --layers 8 --micro-batch 4 --seq-len 2048 \
        --device cuda --fused-adam --experts both
``--backend fsdp2`` times the ``fsdp2`` trainer (HF transformers under torch FSDP2, one rank; the
Megatron levers below don't apply) and ``--lora-rank R`` trains rank-``R`` adapters (``trainer.lora``)::

    python bench/train.py --backend fsdp2 --preset qwen3-1.7B --seq-len 2048 --micro-batch 4 --grad-accum 8 --device cuda

Options ``--megatron key=value`` set TransformerConfig/DDP/optimizer fields (e.g.
``bias_activation_fusion=true`` for the fused SwiGLU, ``recompute_granularity=selective``).
Levers with their own flags: ``--compile``, ``--sdpa-gqa``, ``--fused-adam`` (torch's fused AdamW inside
Megatron's optimizer), ``--keep-logits`` (the log-prob backward reuses the chunk's logits instead of
recomputing them). ``--profile`` adds ``gpu_ms_by_kind`` (one step's kernel time: gemm, attention,
optimizer, fused/elementwise, other) and ``--kernel-table PATH`` writes the profiler's op table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.core.flops import active_matmul_params  # noqa: E402  (one count for the bench and perf/mfu)


def model_flops_per_token(hf: dict, seq_len: int) -> float:
    """``6 P_active + 12 L (n_q d_head) s``: :func:`active_matmul_params` (a dense model's are all its
    matmul parameters) plus the full ``s x s`` attention score and value matmuls, forward and backward."""
    heads = hf["num_attention_heads"]
    hd = hf.get("head_dim") or hf["hidden_size"] // heads
    return 6.0 * active_matmul_params(hf)[0] + 12.0 * hf["num_hidden_layers"] * heads * hd * seq_len


def ppo_loss(log_probs, old_log_probs, advantages, response_mask, is_weights=None, global_tokens=None,
             global_seqs=None):
    import torch

    ratio = torch.exp(log_probs - old_log_probs)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.28) * advantages)
    return -(surrogate * response_mask).sum() / global_tokens, {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="qwen3")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--layers", type=int, default=None, help="cut the preset to N layers (model.overrides)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--attention", default="auto", help="auto | sdpa | local | te")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=4096, help="log-prob chunk size (tokens)")
    parser.add_argument("--no-packing", action="store_true", help="padded rows instead of THD packing")
    parser.add_argument("--compile", action="store_true", help="torch.compile each transformer layer")
    parser.add_argument("--sdpa-gqa", action="store_true", help="SDPA reads shared k/v heads (enable_gqa)")
    parser.add_argument("--fused-adam", action="store_true", help="torch's fused AdamW kernel")
    parser.add_argument("--keep-logits", action="store_true", help="log-prob backward without recomputing logits")
    parser.add_argument("--profile", action="store_true", help="kernel time of one step by kind")
    parser.add_argument("--kernel-table", default=None, metavar="PATH", help="write the profiler's op table")
    parser.add_argument("--megatron", action="append", default=[], help="key=value (repeatable)")
    parser.add_argument("--exact", choices=["off", "on", "both"], default="off",
                        help="rollout.exact's trainer (core.exact); both: default then exact, one process each")
    parser.add_argument("--backend", choices=["megatron", "fsdp2"], default="megatron",
                        help="trainer backend (fsdp2: HF transformers under torch FSDP2; Megatron's levers don't apply)")
    parser.add_argument("--lora-rank", type=int, default=0, help="trainer.lora.rank (0: full fine-tuning)")
    parser.add_argument("--experts", choices=["grouped", "sequential", "both"], default=None,
                        help="MoE expert layer (default: the spec's, grouped); both: one process each")
    args = parser.parse_args()
    if args.experts == "both":
        for kind in ("grouped", "sequential"):
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--experts", kind], check=False)  # last wins
        return
    if args.exact == "both":  # exact mode marks the process (core.exact.enable): one process each
        for mode in ("off", "on"):  # exact runs its layers eagerly: --compile applies to the default alone
            argv = [a for a in sys.argv[1:] if mode == "off" or a != "--compile"]
            subprocess.run([sys.executable, __file__, *argv, "--exact", mode], check=False)  # last wins
        return
    if args.exact == "on" and args.compile:
        parser.error("--exact on runs the layers eagerly: drop --compile")

    if args.sdpa_gqa:
        os.environ["POSTTRAIN_SDPA_GQA"] = "1"
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, even on a GPU machine
    import torch
    import yaml

    from posttrain.core.config import TrainerConfig
    from posttrain.core.lora import LoraConfig
    from posttrain.core.model_spec import count_params
    from posttrain.core.plugins import load_plugins
    from posttrain.core.train_batch import TrainBatch
    from posttrain.plugins.trainers.megatron import MegatronBackend
    from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    cls = load_plugins().registry("model")[args.spec]
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    spec = cls(cls.Config(preset=args.preset, dtype=dtype, overrides=overrides))
    megatron = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.megatron)}
    if args.experts:
        megatron["moe_grouped_gemm"] = args.experts == "grouped"
    if args.device == "cuda":
        megatron.setdefault("bias_activation_fusion", True)  # jit-fused SwiGLU (no TE needed)
    batch_size = args.micro_batch * args.grad_accum
    config = TrainerConfig(lr=1e-6, micro_batch_size=args.micro_batch, global_batch_size=batch_size,
                           lora=LoraConfig(rank=args.lora_rank, alpha=2.0 * max(args.lora_rank, 1)))
    if args.backend == "fsdp2":
        from posttrain.plugins.trainers.fsdp2 import FSDP2Backend
        from posttrain.plugins.trainers.fsdp2.model import FSDP2Model

        trainer = FSDP2Model(spec, config, backend=FSDP2Backend.Config(), seed=0, max_response_len=args.seq_len)
    else:
        backend = MegatronBackend.Config(tp=args.tp, attention=args.attention, log_probs_chunk_size=args.chunk,
                                         sequence_packing=not args.no_packing, megatron=megatron, compile=args.compile,
                                         fused_adam=args.fused_adam, log_probs_recompute=not args.keep_logits)
        trainer = MegatronTrainer(spec, config, backend=backend, exact=args.exact == "on")
    hf = spec.hf_config()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, hf["vocab_size"], (batch_size, args.seq_len), generator=g)
    batch = TrainBatch(tokens=tokens, lengths=torch.full((batch_size,), args.seq_len),
                       response_mask=torch.ones(batch_size, args.seq_len))
    batch.response_mask[:, 0] = 0
    batch.advantages = torch.randn(batch_size, 1, generator=g) * batch.response_mask
    batch.old_log_probs = torch.zeros(batch_size, args.seq_len)

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        trainer.train_step(batch, ppo_loss)
    sync()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step(batch, ppo_loss)
    sync()
    seconds = (time.perf_counter() - start) / args.steps
    tokens_per_step = batch_size * args.seq_len
    flops = model_flops_per_token(hf, args.seq_len) * tokens_per_step / args.tp
    active_matmul, total_matmul = active_matmul_params(hf)
    result = {
        "bench": "train_step", "backend": args.backend, "lora_rank": args.lora_rank, "spec": args.spec, "preset": args.preset, "layers": hf["num_hidden_layers"],
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "dtype": dtype, "tp": args.tp,
        "micro_batch": args.micro_batch, "grad_accum": args.grad_accum, "seq_len": args.seq_len,
        "attention": args.attention, "compile": args.compile, "sdpa_gqa": args.sdpa_gqa,
        "fused_adam": args.fused_adam, "keep_logits": args.keep_logits, "packing": not args.no_packing if args.backend == "megatron" else None,
        "exact": args.exact == "on",
        "megatron": megatron, "experts": _experts_kind(trainer.gpt) if args.backend == "megatron" else None,
        "step_s": round(seconds, 4), "tokens_per_s": round(tokens_per_step / seconds, 1),
        "model_tflops_per_s": round(flops / seconds / 1e12, 3),  # MoE: on active parameters
        "model_flops_per_token": model_flops_per_token(hf, args.seq_len),
        "active_params": count_params(hf, active=True), "total_params": count_params(hf),
        "active_matmul_params": active_matmul, "total_matmul_params": total_matmul,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if args.device == "cuda" else None,
    }
    if args.profile or args.kernel_table:
        try:
            result["gpu_ms_by_kind"] = profile_step(lambda: trainer.train_step(batch, ppo_loss), sync, args.kernel_table)
        except Exception as exc:  # instrumentation must not cost the step's numbers
            result["profile_error"] = repr(exc)[:300]
    print(json.dumps(result), flush=True)


def _experts_kind(gpt) -> str | None:
    """``grouped`` / ``sequential`` (the MoE layers' experts, as built), None for a dense model."""
    experts = [layer.mlp.experts for layer in gpt.decoder.layers if hasattr(layer.mlp, "experts")]
    if not experts:
        return None
    return "grouped" if getattr(experts[0], "grouped", False) else "sequential"


KINDS = (("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),  # before gemm: flash names hold "gemm"
         ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")),
         ("optimizer", ("adam", "multi_tensor", "l2norm")),
         ("fused", ("triton",)),
         ("elementwise", ("elementwise", "vectorized", "reduce", "softmax", "copy", "cat", "fill", "index")))


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel, from its name (first match in ``KINDS``; ``other`` if none)."""
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def profile_step(step, sync, table_path: str | None) -> dict:
    """One ``step`` under ``torch.profiler``: GPU kernel milliseconds by :func:`kernel_kind` (and the op
    table written to ``table_path``)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    by_kind: dict[str, float] = {}
    for evt in prof.key_averages():
        if evt.device_type != DeviceType.CUDA:
            continue
        us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        by_kind[kernel_kind(evt.key)] = by_kind.get(kernel_kind(evt.key), 0.0) + us / 1000.0
    if table_path:
        Path(table_path).parent.mkdir(parents=True, exist_ok=True)
        on_gpu = bool(by_kind)  # a CPU run has no device time to sort by: its table goes by CPU time
        key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        Path(table_path).write_text(prof.key_averages().table(sort_by=key, row_limit=50))
    return {k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    main()
