"""``rl-cli plot RUN_DIR``: reward, KL, response length and throughput over steps, as ``RUN_DIR/curves.png``."""

from __future__ import annotations

from pathlib import Path

import typer

from posttrain.cli.console import console
from posttrain.core.errors import UsageError

# (title, metric keys drawn on that panel); keys absent from a run are skipped
PANELS = [
    ("reward", ["rollout/reward_mean", "eval/reward_mean"]),
    ("KL / entropy", ["train/kl", "train/pg/approx_kl", "train/entropy", "estimator/reverse_kl"]),  # approx_kl: always
    ("response length", ["rollout/response_len_mean"]),
    ("throughput (tokens/s)", ["perf/rollout_tokens_per_s", "perf/train_tokens_per_s"]),
]


def plot(run_dir: Path = typer.Argument(..., help="a run directory holding metrics.jsonl", show_default=False),
         out: Path = typer.Option(None, "--out", help="image path (default RUN_DIR/curves.png)")) -> None:
    """Plot a run's curves from its metrics.jsonl."""
    from posttrain.core.metrics import METRICS_FILE, read_metrics

    rows = read_metrics(run_dir)
    if not rows:
        raise UsageError(f"{run_dir / METRICS_FILE}: no metrics found")
    out = out or run_dir / "curves.png"
    write_curves(rows, out, title=run_dir.name)
    console.print(f"wrote {out}", soft_wrap=True, markup=False, highlight=False)  # a long path unbroken


def write_curves(rows: list[dict], out: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eval_keys = sorted({k for r in rows for k in r if k.startswith("eval/") and k.endswith("reward_mean")})
    panels = [(t, keys + eval_keys if t == "reward" else keys) for t, keys in PANELS]
    if not any("rollout/reward_mean" in r for r in rows):  # no rollouts (an SFT run): its losses instead
        loss_keys = sorted({k for r in rows for k in r if k.startswith("eval/") and k.endswith("/loss")})
        panels[0] = ("loss", ["train/loss", *loss_keys])
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (name, keys) in zip(axes.flat, panels):
        drawn = False
        for key in dict.fromkeys(keys):
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), label=key, marker="." if len(points) < 50 else None)
                drawn = True
        ax.set_title(name)
        ax.set_xlabel("step")
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
