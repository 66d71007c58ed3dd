import subprocess
import sys

from posttrain.core.metrics import MetricsWriter


def test_plot_writes_a_png(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(5):
        writer.log(step, {"rollout/reward_mean": step / 4, "train/kl": 0.01 * step,
                          "rollout/response_len_mean": 3.0, "perf/rollout_tokens_per_s": 100.0})
    writer.close()
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "plot", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_plot_without_metrics_is_a_usage_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "plot", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "no metrics found" in out.stderr and "Traceback" not in out.stderr


def test_the_kl_panel_has_a_curve_without_a_kl_term():
    # a run with no KL loss, KL reward or log_kl (the default) still logs the policy's approximate KL to the
    # policy that sampled (train/pg/approx_kl): the panel draws it instead of "no data"
    from posttrain.cli.plot_cmd import PANELS

    keys = dict(PANELS)["KL / entropy"]
    assert "train/pg/approx_kl" in keys and "train/kl" in keys
