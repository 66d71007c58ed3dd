"""Weight sync trainer -> engines: seconds per full push, end to end (HF-name conversion, TP gather,
transport, the engines' load), by the run config's ``rollout.weight_sync``.

    python bench/weight_sync.py examples/gpu/qwen3-1.7b-grpo.yaml [key=value ...] [--pushes 5]

Builds the trainer and the engines as a run does (local executor), pushes the weights ``--pushes`` times
and prints one JSON line: bytes per push, the median and each push's seconds, GB/s, the seconds of
``export_hf`` alone (conversion without transport) and which transport ran. That the pushed weights
are the right ones is checked by the runs (``train_rollout_logprob_abs_diff`` after each push).
Target (1.7B shape, 3.4 GB bf16, NCCL between two H200s): under 0.2 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--pushes", type=int, default=5)
    args = ap.parse_args()

    import torch

    from posttrain.core.actors.engines import EngineRole
    from posttrain.core.actors.trainer import TrainerRole
    from posttrain.core.config import load_config

    cfg = load_config(args.config, args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = TrainerRole(cfg.to_dict())
        init_dir = trainer.save_hf(str(Path(tmp) / "hf-init"))
        engines = EngineRole(cfg.to_dict(), init_dir, str(Path(tmp) / "logs"))
        try:
            _, urls = engines.urls()
            t0 = time.perf_counter()
            trainer.connect_engines(urls)
            connect_s = time.perf_counter() - t0
            bucket = int(cfg.rollout.weight_bucket_mb * (1 << 20))
            nbytes = sum(t.numel() * t.element_size() for b in trainer.policy.export_hf(bucket) for _, t in b)
            export = []
            for _ in range(3):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for b in trainer.policy.export_hf(bucket):
                    for _, t in b:
                        t.contiguous()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                export.append(time.perf_counter() - t0)
            times = [trainer.push_weights(version, str(Path(tmp) / "hf-disk")) for version in range(1, args.pushes + 1)]
            backend = trainer.sender.backend if trainer.weight_sync == "distributed" else None
        finally:
            trainer.close()
            engines.close()
    median = statistics.median(times)
    print(json.dumps({
        "bench": "weight_sync", "config": Path(args.config).name, "overrides": args.overrides,
        "mode": trainer.weight_sync, "backend": backend,
        "engines": len(urls), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "bytes": nbytes, "push_s_median": round(median, 4), "push_s": [round(t, 4) for t in times],
        "gb_per_s": round(nbytes / median / 1e9, 1), "export_only_s": round(min(export), 4),
        "connect_s": round(connect_s, 3), "target_met": median < 0.2 if torch.cuda.is_available() else None}))


if __name__ == "__main__":
    main()
