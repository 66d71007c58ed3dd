"""One quickstart step's ``generate`` on the CPU: 64 prompts x 16 samples, one new token each, through the
real generator (``single_turn``), client and local engine server, without the trainer.

    python bench/generate_step.py [--rounds 20] [--slots 32] [--context 0] [--router] [--coalesce ROWS]
        [--prompts N] [--samples N] [--new-tokens N] [--profile OUT.prof] [--py-spy OUT.raw]

Starts ``rl-cli engine serve`` on a tiny random-init Qwen3 (the quickstart's shape and character
vocabulary), optionally behind sglang-router (``--router``, as the quickstart runs), then times
``--rounds`` rounds of the loop's generation (``collect_groups`` over the quickstart prompts, seeded
sampling) and prints one JSON line: median and mean seconds per round (target: <= 0.15 s on 2
cores), and the engine's and the client's CPU seconds per round (on a loaded machine the wall clock
includes waiting for a core; CPU time does not). ``--profile`` writes a cProfile of the client side (the driver's event loop) to OUT.prof.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


async def rounds(url: str, ckpt: Path, n: int, api_key: str, coalesce: int = 0, overrides: list[str] = ()) -> list[float]:
    from posttrain.core.buffer import DataBuffer, collect_groups
    from posttrain.core.config import load_config
    from posttrain.core.data import load_prompts
    from posttrain.core.plugins import load_plugins
    from posttrain.core.rollout.client import EngineClient
    from posttrain.core.rollout.coalesce import CoalescingEngine
    from transformers import AutoTokenizer

    plugins = load_plugins(autoload=False)
    cfg = load_config(ROOT / "examples" / "quickstart.yaml", list(overrides), plugins)
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    dataset = load_prompts(cfg.data, tokenizer=tokenizer, base_dir=ROOT / "examples")
    buffer = DataBuffer.from_config(cfg, dataset)
    generator = cfg.generator.create(plugins)
    sampling = cfg.rollout.sampling_params(seed=cfg.seed)
    times = []
    async with EngineClient(url, max_concurrency=cfg.rollout.server_concurrency, api_key=api_key) as client:
        engine = CoalescingEngine(client, coalesce, cfg.rollout.seeds_batch_rows) if coalesce else client

        async def one(group):
            return await generator(group, engine, sampling)

        for _ in range(n):
            t0 = time.perf_counter()
            groups, _ = await collect_groups(buffer, one, cfg.rollout.rollout_batch_size)
            times.append(time.perf_counter() - t0)
            assert sum(len(g) for g in groups) == cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    return times


def _has_orjson() -> bool:
    """Whether the rollout protocol's JSON goes through orjson here (``core.jsonio``; sglang-router's dependency)."""
    from posttrain.core import jsonio

    return jsonio.orjson is not None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--slots", type=int, default=32, help="engine max_running_requests")
    parser.add_argument("--context", type=int, default=0, help="engine context_length (0: the model's)")
    parser.add_argument("--router", action="store_true", help="through sglang-router, as the quickstart")
    parser.add_argument("--coalesce", type=int, default=0, help="rollout.coalesce_rows (0: one request per group)")
    parser.add_argument("--prompts", type=int, default=0, help="rollout.rollout_batch_size (0: the quickstart's 64)")
    parser.add_argument("--samples", type=int, default=0, help="rollout.n_samples_per_prompt (0: the quickstart's 16)")
    parser.add_argument("--new-tokens", type=int, default=0,
                        help="rollout.max_new_tokens (0: the quickstart's 1; the GPU example's shape: --prompts 64 "
                             "--samples 8 --new-tokens 512 --slots 512 --context 640)")
    parser.add_argument("--profile", default=None, help="cProfile of the client side to this file")
    parser.add_argument("--py-spy", default=None, help="py-spy raw samples of the engine server to this file")
    args = parser.parse_args()
    from posttrain.testing.engine import start_local_engine
    from posttrain.testing.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "qwen3", "qwen3", max_position_embeddings=max(512, args.context))
        options = {"max_running_requests": args.slots}
        if args.context:
            options["context_length"] = args.context
        server = start_local_engine(ckpt, **options)
        router = None
        url = server.base_url
        try:
            if args.router:
                from posttrain.core.rollout.router import RouterProcess

                router = RouterProcess([server.base_url], model_path=str(ckpt), api_key=server.api_key).start()
                url = router.url
            spy = None
            if args.py_spy:  # the engine process, while the rounds run
                import subprocess

                spy = subprocess.Popen(["py-spy", "record", "-p", str(server.proc.pid), "-r", "200", "-f", "raw",
                                        "-o", args.py_spy, "--nonblocking"], stdout=subprocess.DEVNULL)
            if args.profile:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            import psutil

            engine_proc = psutil.Process(server.proc.pid)
            cpu0, own0 = sum(engine_proc.cpu_times()[:2]), time.process_time()
            overrides = [f"rollout.{key}={value}" for key, value in (("rollout_batch_size", args.prompts),
                         ("n_samples_per_prompt", args.samples), ("max_new_tokens", args.new_tokens)) if value]
            if args.prompts or args.samples:  # the trainer's batch follows (config validation checks the identity)
                rows = (args.prompts or 64) * (args.samples or 16)
                overrides += [f"trainer.global_batch_size={rows}", f"trainer.micro_batch_size={rows}"]
            times = asyncio.run(rounds(url, ckpt, args.rounds, server.api_key, args.coalesce, overrides))
            engine_cpu, client_cpu = sum(engine_proc.cpu_times()[:2]) - cpu0, time.process_time() - own0
            if args.profile:
                prof.disable()
                prof.dump_stats(args.profile)
            if spy is not None:
                import signal

                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
        finally:
            if router is not None:
                router.stop()
            server.stop()
    steady = times[2:] or times
    print(json.dumps({"bench": "generate_step", "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                      "load": os.getloadavg()[0], "slots": args.slots, "router": args.router, "coalesce": args.coalesce,
                      "prompts": args.prompts or 64, "samples": args.samples or 16, "new_tokens": args.new_tokens or 1,
                      "orjson": _has_orjson(), "rounds": len(times),
                      "median_s": round(statistics.median(steady), 4), "mean_s": round(statistics.mean(steady), 4),
                      "first_s": round(times[0], 4),
                      # CPU seconds per round (all rounds): what a loaded machine's wall clock cannot show
                      "engine_cpu_s": round(engine_cpu / len(times), 4), "client_cpu_s": round(client_cpu / len(times), 4)}))


if __name__ == "__main__":
    main()
