"""Making a trainer-sized pinned host buffer: seconds, bytes actually pinned, and copy bandwidth, by method.

    python bench/pin_memory.py [--gib 28.8] [--methods cudahostalloc,register,register1,torch_register]

Each method runs in its own process (a fresh address space and pinned cache) and prints one JSON line:

- ``cudahostalloc``: ``torch.empty(n, pin_memory=True)`` (PyTorch's pinned allocator: ``cudaHostAlloc`` of the next
  power of two), what the offload used before host_memory.py;
- ``register``: :func:`posttrain.plugins.trainers.megatron.host_memory.pinned_empty` (exact size, pages faulted in
  by threads, then ``cudaHostRegister``), with its parts' seconds;
- ``register1``: the same with one thread (what the threads buy);
- ``torch_register``: PyTorch's allocator with ``pinned_use_cuda_host_register`` (its own threads, power of two).

and for each the device-to-host and host-to-device bandwidth of 4 GiB of it (non-blocking copies, CUDA events).
At Qwen3-1.7B the colocated run offloads 28.8 GiB of optimizer state: the default size. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
METHODS = ("cudahostalloc", "register", "register1", "torch_register")


def _bandwidth(host) -> dict:
    import torch

    n = min(host.numel(), 4 << 30)
    device = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("d2h_gbps", host[:n], device), ("h2d_gbps", device, host[:n])):
        dst.copy_(src, non_blocking=True)  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        out[name] = round(n / (start.elapsed_time(end) / 1000) / 1e9, 1)
    return out


def one(method: str, nbytes: int) -> dict:
    import torch

    from posttrain.plugins.trainers.megatron.host_memory import pinned_empty

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the context first: not timed
    row: dict = {"bench": "pin_memory", "method": method, "gib": round(nbytes / 2**30, 2)}
    t0 = time.perf_counter()
    if method in ("cudahostalloc", "torch_register"):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        row["pinned_gib"] = round(torch.cuda.host_memory_stats()["allocated_bytes.current"] / 2**30, 2)
    else:
        host, release, parts = pinned_empty(nbytes, threads=1 if method == "register1" else None)
        row.update({k: round(v, 2) if isinstance(v, float) else v for k, v in parts.items()})
        row["pinned_gib"] = row["gib"]
    row["make_s"] = round(time.perf_counter() - t0, 2)
    row["is_pinned"] = host.is_pinned()
    row.update(_bandwidth(host))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=28.8)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process: this method only
    args = ap.parse_args()
    nbytes = int(args.gib * 2**30)
    if args.one:
        print(json.dumps(one(args.one, nbytes)), flush=True)
        return
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(json.dumps({"bench": "pin_memory_host", "cpus": len(os.sched_getaffinity(0)),
                      "transparent_hugepage": thp.read_text().strip() if thp.exists() else None}), flush=True)
    for method in args.methods.split(","):
        if method not in METHODS:
            raise SystemExit(f"--methods: unknown method {method!r} (one of {', '.join(METHODS)})")
        env = dict(os.environ)
        if method == "torch_register":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "pinned_use_cuda_host_register:True,pinned_num_register_threads:16"
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--gib", str(args.gib), "--one", method], env=env,
                              capture_output=True, text=True)
        if done.returncode:
            error = done.stderr.strip()[-500:]
            print(json.dumps({"bench": "pin_memory", "method": method, "error": error}), flush=True)
        else:
            sys.stdout.write(done.stdout)
        print(json.dumps({"bench": "pin_memory_process", "method": method,
                          "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
