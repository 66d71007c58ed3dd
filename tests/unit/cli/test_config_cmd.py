"""`rl-cli config show` lists every core config key from the dataclasses; `plugins list/show` print
docstrings literally ([low, high] kept) and without reST backticks."""

import dataclasses
import os
import subprocess
import sys
import typing

from posttrain.cli.config_cmd import sections
from posttrain.cli.text import plain, rich_text
from posttrain.core.config import RunConfig


def rl_cli(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}  # one row per line
    return subprocess.run([sys.executable, "-m", "posttrain.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def every_key(cls=RunConfig, prefix=""):
    """Dotted names of every leaf key under ``cls`` (list-of-dataclass items as ``name[]``)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name, tp = f"{prefix}{f.name}", hints[f.name]
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            yield from every_key(tp, f"{name}.")
        else:
            yield name
            if type(None) in args and dataclasses.is_dataclass(args[0]):  # an optional section
                yield from every_key(args[0], f"{name}.")
            elif args and dataclasses.is_dataclass(args[0]):
                yield from every_key(args[0], f"{name}[].")


def test_sections_cover_every_key_of_the_dataclasses():
    shown = {(f"{s.name}." if s.name != "(top level)" else "") + r["name"] for s in sections() for r in s.rows}
    expected = set(every_key())
    assert expected == shown and {"rollout.num_rollouts", "eval.datasets[].label_key", "seed"} <= shown


def test_config_show_prints_type_default_and_help():
    out = rl_cli("config", "show")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    row = next(line for line in lines if line.startswith("num_rollouts "))
    assert row.split()[:3] == ["num_rollouts", "int", "100"] and "rollout steps in the run" in row
    assert any(line.startswith("estimator ") and "estimator component" in line for line in lines)
    assert "eval.datasets[]: One eval set" in out.stdout


def test_config_show_one_section_and_an_unknown_one():
    out = rl_cli("config", "show", "data")
    assert out.returncode == 0 and "label_key" in out.stdout and "num_rollouts" not in out.stdout
    bad = rl_cli("config", "show", "rolout")
    assert bad.returncode == 2 and "Did you mean 'rollout'?" in bad.stderr and "Traceback" not in bad.stderr


def test_plugins_list_and_show_keep_brackets_and_drop_rst_backticks():
    listed = rl_cli("plugins", "list", "--kind", "correction")
    icepop = next(line for line in listed.stdout.splitlines() if line.startswith("correction  icepop"))
    assert "0 outside [low, high]." in icepop and "``" not in listed.stdout
    shown = rl_cli("plugins", "show", "icepop")
    assert "0 outside [low, high]" in shown.stdout and "``" not in shown.stdout


def test_rst_inline_markup_becomes_plain_or_coloured_text():
    assert plain("``w = clamp(x, low, high)``, see :class:`~posttrain.core.types.Sample`") == \
        "w = clamp(x, low, high), see Sample"
    text = rich_text("outside ``[low, high]`` [bold]")
    assert text.plain == "outside [low, high] [bold]" and text.spans[0].style == "cyan"


def test_error_lines_keep_brackets(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("estimator: grpo\ndata: {path: 'x[low, high].jsonl'}\n")
    out = rl_cli("run", str(cfg), "--dry-run")
    assert out.returncode == 2 and "no such file or directory: x[low, high].jsonl" in out.stderr


def test_every_core_key_has_a_help_text():
    from posttrain.cli.config_cmd import sections

    missing = [f"{s.name}.{r['name']}" for s in sections() for r in s.rows if not r["help"].strip()]
    assert not missing, missing


def test_plugins_show_of_a_config_section_points_at_config_show():
    out = rl_cli("plugins", "show", "trainer")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "'trainer' is a run-config section, not a component: its keys are in `rl-cli config show trainer`" in \
        out.stderr.replace("\n", " ")
