"""What an operator meets, through `rl-cli run` on real file systems: a disk that fills during a checkpoint, a
read-only run directory, and SIGTERM (what Slurm and Kubernetes send). Each ends in one line with no traceback;
the checkpoint before a failure stays whole and `--resume` continues exactly as an uninterrupted run."""

import os
import shutil
import signal
import subprocess
import sys

import pytest

from tests.integration.test_loop import QUICKSTART, SMALL, jsonl, rl_cli

pytestmark = pytest.mark.slow

FILLER = '''
import os
from posttrain import hookimpl

@hookimpl
def posttrain_on_step_end(step, metrics):
    """After step 2, fill the run's disk but for 64 KiB: that step's checkpoint cannot be written."""
    if step == 2:
        with open(os.environ["FILL_PATH"], "wb") as f:
            free = os.statvfs(os.path.dirname(os.environ["FILL_PATH"]))
            f.write(b"0" * max(0, free.f_bavail * free.f_frsize - 64 * 1024))
'''
STEPS = ["rollout.num_rollouts=4", "checkpoint.interval=1", "checkpoint.keep=4"]
CURVE = ("rollout/reward_mean", "train/loss", "train/grad_norm", "rollout/response_len_mean")


def curve(rows):
    return [(r["step"], *(r[k] for k in CURVE)) for r in rows]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="mounts a small tmpfs (root)")
def test_a_full_disk_and_a_read_only_run_dir_end_in_one_line_and_resume_is_exact(tmp_path, write, whole_curve):
    filler = write("filler.py", FILLER)
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    cli = f"{sys.executable} -m posttrain.cli.main run"
    small = " ".join([*SMALL, *STEPS])
    # one private mount namespace: a 64 MiB tmpfs as the run's disk, a read-only tmpfs as another run's
    script = f"""
mount -t tmpfs -o size=64m tmpfs {disk} && mkdir {disk}/ro && mount -t tmpfs -o size=1m,ro tmpfs {disk}/ro || exit 99
{cli} {QUICKSTART} --run-dir {disk}/run {small} --plugin {filler} > {out}/full.out 2> {out}/full.err
echo $? > {out}/full.rc
ls {disk}/run/checkpoints > {out}/after-failure.ls; cat {disk}/run/checkpoints/latest > {out}/latest
rm {disk}/filler.bin
{cli} --resume {disk}/run > {out}/resume.out 2> {out}/resume.err
echo $? > {out}/resume.rc
cp {disk}/run/metrics.jsonl {out}/
{cli} {QUICKSTART} --run-dir {disk}/ro/run {small} > {out}/ro.out 2> {out}/ro.err
echo $? > {out}/ro.rc
"""
    env = {**os.environ, "FILL_PATH": str(disk / "filler.bin")}
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", script], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    read = lambda name: (out / name).read_text()  # noqa: E731
    full_err = read("full.err")
    assert read("full.rc").strip() == "1", full_err[-3000:]
    errors = [line for line in full_err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in full_err, full_err[-3000:]
    assert f"error: storage: no space left on the device at {disk}/run/checkpoints" in errors[0]
    # the step-2 checkpoint's part was removed; `latest` still names the step-1 checkpoint, which resumes
    assert read("after-failure.ls").split() == ["latest", "step_000001"] and read("latest") == "step_000001"
    assert read("resume.rc").strip() == "0", read("resume.err")[-3000:]
    assert "resumed after step 1 (checkpoint" in read("resume.out") and "step_000001)" in read("resume.out")
    assert curve(jsonl(out / "metrics.jsonl")) == whole_curve
    ro_err = read("ro.err")
    assert read("ro.rc").strip() == "1" and "Traceback" not in ro_err, ro_err[-3000:]
    assert f"error: storage: read-only file system at {disk}/ro/run" in ro_err


STOPPER = '''
import os, signal, threading, time
from posttrain import hookimpl

@hookimpl
def posttrain_on_step_end(step, metrics):
    """Once: the signal 0.1 s after step 2 ends, while step 3 runs (its end waits for it: steps are fast)."""
    if step == 2 and not os.path.exists(os.environ["STOP_MARK"]):
        open(os.environ["STOP_MARK"], "w").close()
        threading.Timer(0.1, os.kill, (os.getpid(), int(os.environ["STOP_SIGNAL"]))).start()
    elif step == 3 and os.path.exists(os.environ["STOP_MARK"]) and not os.path.exists(os.environ["STOP_MARK"] + ".2"):
        open(os.environ["STOP_MARK"] + ".2", "w").close()
        time.sleep(2.0)  # the signal lands here at the latest, inside the step
'''


@pytest.fixture(scope="module")
def whole_curve(tmp_path_factory):
    """The curve of the runs below, uninterrupted."""
    whole = tmp_path_factory.mktemp("whole") / "run"
    out = rl_cli(QUICKSTART, "--run-dir", whole, *SMALL, *STEPS)
    assert out.returncode == 0, out.stderr[-3000:]
    return curve(jsonl(whole / "metrics.jsonl"))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_save_the_step_in_flight_and_resume_exactly(tmp_path, write, whole_curve, signum):
    run = tmp_path / "run"
    stopper = write("stopper.py", STOPPER)
    env = {**os.environ, "STOP_MARK": str(tmp_path / "stopped"), "STOP_SIGNAL": str(int(signum))}
    args = [*SMALL, *STEPS[:1], "checkpoint.interval=0", "--plugin", stopper]  # no periodic checkpoint at all
    first = rl_cli(QUICKSTART, "--run-dir", run, *args, env=env)
    assert first.returncode == (143 if signum == signal.SIGTERM else 130), first.stdout[-2000:] + first.stderr[-3000:]
    assert "stopping at the end of this step, with a checkpoint" in first.stderr and "Traceback" not in first.stderr
    assert f"resume with: rl-cli run --resume {run}" in first.stderr
    stopped_after = len(jsonl(run / "metrics.jsonl"))
    assert stopped_after == 3 and (run / "checkpoints" / "latest").read_text() == f"step_{stopped_after:06d}"
    resumed = rl_cli("--resume", run, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert curve(jsonl(run / "metrics.jsonl")) == whole_curve  # no step lost, none trained twice
