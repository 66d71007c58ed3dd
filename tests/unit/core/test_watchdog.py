"""The watchdog's registry of waits, its progress clock, its report and its two ways to react to a stall."""

import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from posttrain.core.watchdog import Waits, Watchdog, WatchdogConfig, engine_queue_lines, process_lines, waiting_on


def test_waits_are_listed_oldest_first_and_their_end_is_progress():
    waits = Waits()
    clock = waits.last_progress
    with waiting_on("engine", "POST http://e0/generate", waits) as first:
        time.sleep(0.01)
        with waiting_on("reward", "math", waits):
            assert [w.kind for w in waits.active()] == ["engine", "reward"]
            assert waits.last_progress == clock, "entering a wait is no progress"
        assert waits.last_progress > clock, "a finished wait is progress"
        first.update("POST http://e0/generate (retry 2)")
        assert [w.what for w in waits.active()] == ["POST http://e0/generate (retry 2)"]
    assert waits.active() == []
    with pytest.raises(ValueError, match="not one of"):
        waits.enter("coffee", "x")


def test_a_wait_that_blocks_its_thread_comes_before_older_coroutine_waits():
    """A sync reward blocking the event loop leaves the loop's /generate waits unfinished: the reward is the cause."""
    waits = Waits()
    with waiting_on("engine", "POST http://e0/generate", waits, blocking=False):
        time.sleep(0.01)
        with waiting_on("reward", "slow_sync_reward", waits):
            active = waits.active()
            assert [w.kind for w in active] == ["reward", "engine"]
            assert "blocks thread MainThread" in active[0].describe(time.monotonic())
            assert "a coroutine on thread MainThread" in active[1].describe(time.monotonic())


def test_an_exception_ends_the_wait_too():
    waits = Waits()
    with pytest.raises(RuntimeError):
        with waiting_on("trainer_rank", "train", waits):
            raise RuntimeError("rank died")
    assert waits.active() == []


def test_report_names_the_oldest_wait_probes_and_driver_stacks(tmp_path):
    waits = Waits()
    dog = Watchdog(WatchdogConfig(stall_s=10), tmp_path / "stall-report.txt", resume_hint="resume it", waits=waits)
    dog.add_probe("engine queues", lambda: ["engine http://e0: {'num_requests': 3}"])
    dog.add_probe("broken", lambda: 1 / 0)
    with waiting_on("weight_push", "weight push of version 4 to http://e0", waits):
        with waiting_on("engine", "POST http://e0/update_weights_from_distributed", waits):
            assert not dog.check(now=waits.last_progress + 9), "9 s without progress is no stall at 10"
            assert dog.check(now=waits.last_progress + 12)
    text = (tmp_path / "stall-report.txt").read_text()
    assert text.startswith("stalled: no progress for 12 s")
    assert text.index("weight_push weight push of version 4") < text.index("engine POST http://e0/update_weights")
    assert "engine http://e0: {'num_requests': 3}" in text
    assert "(probe failed: ZeroDivisionError" in text
    assert "--- thread MainThread ---" in text and "test_report_names_the_oldest_wait" in text
    assert dog.fired.startswith("stalled: no progress for 12 s, waiting on weight_push weight push of version 4")
    assert dog.fired.endswith(f"report: {tmp_path / 'stall-report.txt'}; resume it")


def test_wait_mode_reports_again_while_stalled_and_rearms_on_progress(tmp_path):
    waits, out = Waits(), io.StringIO()
    dog = Watchdog(WatchdogConfig(stall_s=5, on_stall="wait", report_every_s=30), tmp_path / "r.txt", waits=waits,
                   out=out)
    t0 = waits.last_progress
    assert dog.check(now=t0 + 6) and dog.reports == 1
    assert not dog.check(now=t0 + 20), "within report_every_s: no second report"
    assert dog.check(now=t0 + 37) and dog.reports == 2
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all("still waiting" in line and "waiting on nothing registered" in line for line in lines)
    waits.tick()  # progress resumed
    t1 = waits.last_progress
    assert not dog.check(now=t1 + 1)
    assert dog.check(now=t1 + 6) and dog.reports == 3, "a new stall reports at once"


def test_wait_mode_thread_keeps_the_run_going(tmp_path):
    waits = Waits()
    dog = Watchdog(WatchdogConfig(stall_s=0.3, on_stall="wait", report_every_s=0.3), tmp_path / "r.txt",
                   waits=waits, out=io.StringIO()).start()
    try:
        with waiting_on("reward", "slow_judge", waits):
            time.sleep(1.5)
        assert dog.reports >= 2, "the stall is reported again while it lasts"
        assert "reward slow_judge" in (tmp_path / "r.txt").read_text()
        seen = dog.reports
        for _ in range(10):  # progress every 0.1 s: no stall
            waits.tick()
            time.sleep(0.1)
        assert dog.reports == seen
    finally:
        dog.stop()


def test_off_when_stall_s_is_zero(tmp_path):
    dog = Watchdog(WatchdogConfig(stall_s=0), tmp_path / "r.txt").start()
    assert dog._thread is None and not dog.enabled


EXIT_SCRIPT = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    from posttrain.core.errors import Stalled
    from posttrain.core.watchdog import Watchdog, WatchdogConfig, waiting_on
    dog = Watchdog(WatchdogConfig(stall_s=0.5, exit_grace_s=GRACE), Path(sys.argv[1]), resume_hint="resume").start()
    try:
        with waiting_on("reward", "sleeps_forever"):
            try:
                time.sleep(3600)
            except Exception:
                print("swallowed")  # a reward runner's `except Exception` must not catch the stall
    except Stalled as exc:
        print("STALLED", exc)
        if sys.argv[2] == "hang":
            time.sleep(3600)   # a shut-down that hangs: the grace timer ends the process
''')


@pytest.mark.parametrize("shutdown", ["clean", "hang"])
def test_exit_mode_interrupts_a_blocked_main_thread(tmp_path, shutdown):
    script = tmp_path / "s.py"
    script.write_text(EXIT_SCRIPT.replace("GRACE", "1.0"))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "report.txt"), shutdown], capture_output=True,
                         text=True, timeout=60)
    assert "swallowed" not in out.stdout
    assert "STALLED stalled: no progress for" in out.stdout and "waiting on reward sleeps_forever" in out.stdout
    assert "reward sleeps_forever" in (tmp_path / "report.txt").read_text()
    if shutdown == "hang":
        assert out.returncode == 1 and "exiting now: the shut-down did not finish in 1 s" in out.stderr
    else:
        assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 30


def test_process_lines_name_a_stopped_process_and_spare_one_without_a_handler(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.2)
        lines = process_lines([("trainer rank 1", proc.pid, "rank1.log")])
        assert lines == [f"trainer rank 1 pid {proc.pid}: stopped"], "no SIGUSR1 handler there: not signalled"
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.2)
        assert proc.poll() is None, "an uncaught SIGUSR1 would have ended it"
    finally:
        proc.kill()
        proc.wait()
    assert "gone" in process_lines([("engine x", proc.pid, None)])[0]


def test_engine_queue_lines_name_an_engine_that_does_not_answer():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # accepts, never answers
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    t0 = time.monotonic()
    try:
        lines = engine_queue_lines([url], timeout_s=0.5)
    finally:
        sock.close()
    assert lines[0].startswith(f"engine {url}: did not answer /get_server_info in 0.5 s")
    assert time.monotonic() - t0 < 5


def test_start_up_has_its_own_bound_until_training_starts(tmp_path):
    waits = Waits()
    dog = Watchdog(WatchdogConfig(stall_s=5, startup_stall_s=60), tmp_path / "r.txt", waits=waits)
    t0 = waits.last_progress
    assert dog.limit_s == 60 and not dog.check(now=t0 + 30), "a 30 s model build is no stall at start-up"
    assert dog.check(now=t0 + 61)
    assert "(watchdog.startup_stall_s (start-up) = 60)" in (tmp_path / "r.txt").read_text()
    dog.training()
    assert dog.limit_s == 5 and dog.check(now=waits.last_progress + 6)
    assert "(watchdog.stall_s = 5)" in (tmp_path / "r.txt").read_text()
    assert Watchdog(WatchdogConfig(stall_s=7), tmp_path / "x.txt").limit_s == 7, "default: stall_s throughout"


def test_a_probe_that_hangs_does_not_keep_the_report_back(tmp_path):
    waits, release = Waits(), threading.Event()
    dog = Watchdog(WatchdogConfig(stall_s=1), tmp_path / "r.txt", waits=waits)
    dog.probe_timeout_s = 0.2
    dog.add_probe("asks the stuck process", lambda: [release.wait(30) and "late"])
    try:
        assert dog.check(now=waits.last_progress + 2)
    finally:
        release.set()
    assert "(probe did not finish in 0.2 s)" in (tmp_path / "r.txt").read_text()


def test_a_weight_update_collective_is_a_wait_named_with_its_engines_and_bound():
    from posttrain.core.rollout.weight_sync import WeightSender
    from posttrain.core.watchdog import WAITS

    sender = WeightSender(["http://127.0.0.1:9"], timeout_s=3)  # port 9: refused at once
    seen = []
    with pytest.raises(RuntimeError):
        sender._fan_out("/update_weights_from_distributed", [{}], during=lambda: seen.extend(WAITS.active()))
    assert [(w.kind, w.what) for w in seen] == [("collective", "/update_weights_from_distributed with "
                                                 "http://127.0.0.1:9 (group weight_update_group; "
                                                 "rollout.weight_sync_timeout_s = 3)")]
    assert WAITS.active() == []
