"""What `rl-cli` prints: unwrapped lines off a terminal, an 80-column live table, start-up phases, a
steady-state ETA, `--debug` anywhere, `--version`, and engine logs without the HTTP/2-probe tracebacks."""

import io
import json
import logging
import os
import subprocess
import sys

from rich.console import Console

from posttrain.cli.console import PlainWhenRedirected
from posttrain.plugins.engines.local.command import quiet_http2_probes
from posttrain.cli.live import LiveDisplay, _Screen
from posttrain.cli.main import take_debug_flag

METRICS = {"rollout/reward_mean": 0.123456, "train/kl": 0.00123, "train/entropy": 4.83, "rollout/response_len_mean": 312.5,
           "perf/rollout_tokens_per_s": 123456.0, "perf/step_time": 12.34, "perf/time_generate": 5.5,
           "perf/time_log_probs": 2.25, "perf/time_train": 4.0, "perf/time_sync": 0.5}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def rl_cli(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}  # as under Slurm or nohup
    return subprocess.run([sys.executable, "-m", "posttrain.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=env)


def test_off_a_terminal_one_unwrapped_line_per_phase_and_step():
    out = io.StringIO()
    display = LiveDisplay(1000, PlainWhenRedirected(file=out, highlight=False))
    assert display.live is None
    for phase in ("model", "engines", "train"):
        display.phase(phase)
    for step in range(3):
        display.update(step, METRICS)
    lines = out.getvalue().splitlines()
    assert len(lines) == 6, lines
    assert lines[1].endswith("starting the engines and the router")
    assert lines[3].startswith("step 1/1000  reward 0.123") and lines[3].endswith("eta ~0s")
    assert all(len(line) > 80 for line in lines[3:])  # long, and still one line each


def test_live_table_fits_80_columns_and_shows_phases_when_wider():
    for width, phases_shown in ((80, False), (140, True)):
        console = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
        display = LiveDisplay(1000, console)
        display.phase("train")
        for step in range(997, 1000):
            display.update(step, METRICS)
        console.print(_Screen(display))
        text = console.file.getvalue()
        assert all(len(line) <= width for line in text.splitlines()), text
        assert "…" not in text and "1000/1000" in text and "123456" in text and "0.123" in text
        assert ("log probs" in text) == phases_shown, text


def test_start_up_phase_is_shown_before_the_first_step():
    clock = Clock()
    console = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    display = LiveDisplay(10, console, clock=clock)
    clock.now = 3.0
    display.phase("engines")
    clock.now = 10.0
    console.print(_Screen(display))
    assert "starting the engines and the router  7s  (total 10s)" in console.file.getvalue()


def test_eta_leaves_out_the_warm_up_step():
    clock = Clock()
    display = LiveDisplay(100, PlainWhenRedirected(file=io.StringIO()), clock=clock)
    clock.now = 40.0  # start-up: not a step
    display.phase("train")
    for step, seconds in enumerate([30.0, 2.0, 2.0, 2.0]):  # the first step warms up
        clock.now += seconds
        display.update(step, METRICS)
        if step == 0:
            assert display.eta_seconds(0) == 99 * 30.0 and display.eta(0).startswith("~")
    assert display.eta_seconds(3) == 96 * 2.0 and display.eta(3) == "3m12s"


def test_resumed_display_counts_from_the_checkpoint():
    clock = Clock()
    display = LiveDisplay(100, PlainWhenRedirected(file=io.StringIO()), first_step=50, clock=clock)
    display.phase("train")
    clock.now = 5.0
    display.update(50, METRICS)
    assert display.next_step == 51 and display.eta_seconds(50) == 49 * 5.0


def test_debug_flag_is_taken_anywhere_but_after_double_dash():
    assert take_debug_flag(["run", "c.yaml", "--debug", "--dry-run"]) == (True, ["run", "c.yaml", "--dry-run"])
    assert take_debug_flag(["run", "--", "--debug"]) == (False, ["run", "--", "--debug"])


def test_debug_after_the_subcommand_shows_the_traceback(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("estimator: {name: grop}\n")
    out = rl_cli("run", cfg, "--dry-run", "--debug")
    assert out.returncode != 0 and "Traceback" in out.stderr and "No such option" not in out.stderr


def test_version():
    from posttrain import __version__

    out = rl_cli("--version")
    assert out.returncode == 0 and out.stdout.startswith(f"rl-cli (posttrain) {__version__}, Python 3.")


def test_tables_in_a_pipe_are_not_truncated():
    out = rl_cli("plugins", "list")
    rows = json.loads(rl_cli("plugins", "list", "--json").stdout)
    assert "…" not in out.stdout and len(out.stdout.splitlines()) == len(rows) + 1


def test_engine_log_drops_only_the_http2_probe_traceback(caplog):
    from aiohttp.http_exceptions import BadHttpMessage

    quiet_http2_probes()
    log = logging.getLogger("aiohttp.server")
    for message in ("Pause on PRI/Upgrade", "Invalid header value"):
        try:
            raise BadHttpMessage(message)
        except BadHttpMessage:
            with caplog.at_level(logging.ERROR, logger="aiohttp.server"):
                log.exception("Error handling request from %s", "127.0.0.1")
    logged = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(logged) == 1 and "Invalid header value" in str(logged[0].exc_info[1])
