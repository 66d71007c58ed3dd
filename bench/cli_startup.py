"""Wall time of `rl-cli plugins list` and `rl-cli --help` (fresh processes), one JSON line.

    python bench/cli_startup.py [--repeat 5]

Target: `rl-cli plugins list` under 2 s on the 2-core CPU machine.
"""

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time


def timed(cmd: list[str], repeat: int) -> dict[str, float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return {"median_s": round(statistics.median(times), 3), "max_s": round(max(times), 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    exe = shutil.which("rl-cli")
    base = [exe] if exe else [sys.executable, "-m", "posttrain.cli.main"]
    result = {"bench": "cli_startup", "machine": f"{platform.machine()} {__import__('os').cpu_count()} cpus",
              "plugins_list": timed(base + ["plugins", "list"], args.repeat),
              "help": timed(base + ["--help"], args.repeat), "repeat": args.repeat}
    result["target_met"] = result["plugins_list"]["median_s"] < 2.0
    print(json.dumps(result))


if __name__ == "__main__":
    main()
