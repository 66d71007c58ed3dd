"""docs/getting-started.md against a real quickstart run: the commands it shows run, the files it shows a run
makes are there, and steps are counted from 1 in every place the page and the run show them."""

import json
import re
import shlex
import subprocess
import sys
from importlib.metadata import version

import pytest

from posttrain.core.metrics import read_jsonl
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
PAGE = (ROOT / "docs" / "getting-started.md").read_text()
FENCED = re.compile(r"```(\w*)\n(.*?)```", re.S)
# placeholders of the page's commands -> what they stand for in the quickstart run ({run}: its directory)
PLACEHOLDERS = {"runs/quickstart-<time>": "{run}", "RUN_DIR": "{run}", "CONFIG": "examples/quickstart.yaml",
                "[SECTION]": "rollout", "NAME": "grpo"}
# shown but not run here: the quickstart itself (the fixture runs it) and a server that runs until stopped
NOT_RUN = {"rl-cli run examples/quickstart.yaml", "rl-cli engine serve RUN_DIR/hf-final"}


def commands() -> list[str]:
    """Every ``rl-cli`` command on the page: the lines of its bash blocks and its inline code."""
    found = [line.split("#")[0].strip() for lang, block in FENCED.findall(PAGE) if lang == "bash"
             for line in block.splitlines()]
    found += re.findall(r"`[^`]*?(rl-cli [^`]+)`", FENCED.sub("", PAGE))
    return [c for c in dict.fromkeys(found) if c.startswith("rl-cli")]


def tree() -> list[str]:
    """The paths the "What a run writes" block shows (relative to the run directory; ``/``: a directory)."""
    block = PAGE.split("## What a run writes", 1)[1].split("```", 2)[1]
    lines = block.strip().splitlines()
    assert lines[0] == "runs/quickstart-<time>/"
    return [path for line in lines[1:] for path in line.split("#")[0].split()]


def rl_cli(folder, line: str, run):
    """``line`` run in ``folder`` with its placeholders filled in (the run directory as the page names it,
    ``runs/quickstart-<time>`` relative to where the quickstart ran)."""
    for placeholder, value in PLACEHOLDERS.items():
        line = line.replace(placeholder, value.format(run=run.relative_to(folder)))
    args = shlex.split(line)[1:]
    return subprocess.run([sys.executable, "-m", "posttrain.cli.main", *args], capture_output=True, text=True,
                          cwd=folder, timeout=300)


def test_the_install_lines_name_what_is_installed():
    assert "pip install torch==2.13.0" in PAGE and version("torch").startswith("2.13.0")
    assert "pip install -e ." in PAGE and version("posttrain")


def test_every_path_the_page_shows_is_in_the_quickstarts_run_directory(quickstart_run):
    folder, run, _ = quickstart_run
    assert run.parent == folder / "runs" and re.fullmatch(r"quickstart-\d{8}-\d{6}", run.name)
    paths = tree()
    assert {"metrics.jsonl", "checkpoints/step_000100/", "checkpoints/latest", "hf-final/"} <= set(paths)
    for path in paths:
        target = run / path.rstrip("/")
        assert (target.is_dir() if path.endswith("/") else target.is_file()), f"{path}: not in the run directory"
    assert (run / "checkpoints" / "latest").read_text() == "step_000150"
    assert json.loads((run / "complete.json").read_text()) == {"steps": 150}


def test_every_command_the_page_shows_runs_on_the_quickstart(quickstart_run):
    folder, run, _ = quickstart_run
    shown = commands()
    assert NOT_RUN <= set(shown) and len(shown) >= 8, shown
    expect = {"--version": "rl-cli (posttrain)", "models export": "100 steps)", "plot": "curves.png",
              "--dry-run": "num_rollouts: 150", "doctor": "is valid", "config show": "n_samples_per_prompt",
              "plugins show": "grpo  (estimator"}
    ran = set()
    for line in shown:
        if line in NOT_RUN:
            continue
        out = rl_cli(folder, line, run)
        assert out.returncode == 0, f"{line}: {out.stdout[-1500:]}{out.stderr[-2000:]}"
        ran |= {key for key, text in expect.items() if key in line and text in out.stdout}
    assert ran == set(expect), set(expect) - ran
    assert (folder / "out" / "step-100" / "config.json").is_file()


def test_resume_on_the_finished_quickstart_says_it_is_complete(quickstart_run):
    folder, run, _ = quickstart_run
    out = rl_cli(folder, "rl-cli run --resume RUN_DIR", run)
    assert out.returncode == 0 and f"run complete (150/150): nothing to resume in {run.relative_to(folder)}" in out.stdout


def test_steps_are_counted_from_one_in_the_console_the_logs_and_the_checkpoints(quickstart_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run, out = quickstart_run
    steps = list(range(1, 151))
    assert [int(n) for n in re.findall(r"^step (\d+)/150 ", out.stdout, re.M)] == steps
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == steps
    assert [r["step"] for r in read_jsonl(run / "rollouts.jsonl")] == steps
    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("rollout/reward_mean")] == steps
    for n in (100, 150):
        assert json.loads((run / "checkpoints" / f"step_{n:06d}" / "state.json").read_text())["steps"] == n
    # the page's curve: about 0.02 at the start, most prompts answered by the end
    reward = [r["rollout/reward_mean"] for r in rows]
    assert sum(reward[:10]) / 10 < 0.1 and sum(reward[-10:]) / 10 > 0.5, (reward[:10], reward[-10:])
