"""What an operator meets, through `rl-cli run` on real file systems: a disk that fills during a checkpoint, a
read-only run directory, and SIGTERM (what Slurm and Kubernetes send). Each ends in one line with no traceback;
the checkpoint before a failure stays whole and `--resume` continues exactly as an uninterrupted run."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.test_loop import QUICKSTART, SMALL, jsonl, rl_cli

pytestmark = pytest.mark.slow

FILLER = '''
import os
from posttrain import hookimpl

@hookimpl
def posttrain_on_step_end(step, metrics):
    """After step 1, fill the run's disk but for 64 KiB: that step's checkpoint cannot be written."""
    if step == 1:
        with open(os.environ["FILL_PATH"], "wb") as f:
            free = os.statvfs(os.path.dirname(os.environ["FILL_PATH"]))
            f.write(b"0" * max(0, free.f_bavail * free.f_frsize - 64 * 1024))
'''
STEPS = ["rollout.num_rollouts=4", "checkpoint.interval=1", "checkpoint.keep=4"]
CURVE = ("rollout/reward_mean", "train/loss", "train/grad_norm", "rollout/response_len_mean")


def curve(rows):
    return [(r["step"], *(r[k] for k in CURVE)) for r in rows]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="mounts a small tmpfs (root)")
def test_a_full_disk_and_a_read_only_run_dir_end_in_one_line_and_resume_is_exact(tmp_path, write):
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
    # the step-1 checkpoint's part was removed; `latest` still names the step-0 checkpoint, which resumes
    assert read("after-failure.ls").split() == ["latest", "step_000000"] and read("latest") == "step_000000"
    assert read("resume.rc").strip() == "0", read("resume.err")[-3000:]
    assert "resumed from step 1 (checkpoint" in read("resume.out") and "step_000000)" in read("resume.out")
    whole = tmp_path / "whole"
    uninterrupted = rl_cli(QUICKSTART, "--run-dir", whole, *SMALL, *STEPS)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert curve(jsonl(out / "metrics.jsonl")) == curve(jsonl(whole / "metrics.jsonl"))
    ro_err = read("ro.err")
    assert read("ro.rc").strip() == "1" and "Traceback" not in ro_err, ro_err[-3000:]
    assert f"error: storage: read-only file system at {disk}/ro/run" in ro_err


def test_sigterm_stops_a_run_with_the_command_that_resumes_it(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli.main", "run", str(QUICKSTART), "--run-dir",
                             str(run), *SMALL, "rollout.num_rollouts=100", "checkpoint.interval=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(jsonl(run / "metrics.jsonl")) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stdout[-2000:] + stderr[-3000:]
    assert "terminated (SIGTERM) at step" in stderr and f"resume with: rl-cli run --resume {run}" in stderr
    assert "Traceback" not in stderr
