"""``rl-cli run CONFIG [key=value ...]``: check everything that can be checked (every error at once,
exit code 2), then train.

``--resume RUN_DIR`` continues a run from its latest checkpoint with the config it was started with
(overrides still apply); a run without a checkpoint is an error. ``--resume-or-start RUN_DIR`` is for
schedulers that requeue the same command: it resumes when there is a checkpoint, and otherwise starts
(over) in RUN_DIR. ``--smoke`` runs two steps: a quick check that every part starts and connects.
Ctrl-C stops the run and prints the command that continues it (exit code 130).
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.markup import escape

from posttrain.cli.console import console, err_console
from posttrain.cli.options import Disabled, PluginFiles, load
from posttrain.core.errors import ConfigError, UsageError


@dataclass
class Plan:
    """Where a run writes and what it starts from, decided before anything is validated or started."""

    run: Any  # RunDirectory, or None for a new one (created after validation)
    raw: dict[str, Any]  # the config mapping as read (before overrides)
    config_file: Path | None  # the YAML file the config comes from (None: the run directory's config.yaml)
    source: str  # named in error messages
    base_dir: Path  # relative data paths are also tried here
    checkpoint: Path | None = None  # resuming from it
    resume_step: int = 0  # the steps that checkpoint holds (the number of the last step it trained)
    start_over: bool = False  # a run directory used again from step 0 (its old metrics are dropped)
    completed: int | None = None  # the steps of the finished run in that directory (complete.json)


def run(config: Path = typer.Argument(None, help="run config (YAML); optional with --resume", show_default=False),
        overrides: list[str] = typer.Argument(None, help="dotted overrides: estimator.epsilon=1e-4",
                                              show_default=False),
        dry_run: bool = typer.Option(False, "--dry-run", help="check everything and print the resolved config; "
                                                               "start nothing"),
        run_dir: Path = typer.Option(None, "--run-dir", help="where the run writes (default runs/<name>-<time>)"),
        resume: Path = typer.Option(None, "--resume", help="continue the run in this directory from its latest "
                                                           "checkpoint (an error if it has none)", show_default=False),
        resume_or_start: Path = typer.Option(None, "--resume-or-start", show_default=False,
                                             help="resume the run in this directory if it has a checkpoint, "
                                                  "else start it there (for schedulers that requeue)"),
        smoke: bool = typer.Option(False, "--smoke", help="two steps only, to check that everything connects"),
        plugin: list[str] = PluginFiles, disable: list[str] = Disabled) -> None:
    """Check CONFIG (every error at once, before anything starts), then train."""
    plugins = load(plugin, disable)
    overrides = list(overrides or [])
    if config is not None and "=" in config.name and not config.exists():  # `--resume DIR key=value`
        config, overrides = None, [str(config), *overrides]
    plan = plan_run(config, run_dir, resume, resume_or_start)
    cfg, findings = check(plan, overrides, plugins, scan_data=dry_run)
    if smoke:  # two steps, in the run mode's own terms
        cfg, findings = check(plan, overrides + list(cfg.mode.cls.smoke_overrides), plugins, scan_data=dry_run)
    console.print(plugins.header())
    for note in findings.notes:
        err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    if dry_run:
        from posttrain.core.secrets import redact

        summary = findings.dataset.summary() if findings.dataset is not None else None
        if not cfg.mode.cls.generates:  # a mode that reads its data its own way checks it so
            summary, data_errors = cfg.mode.create(plugins).inspect_data(cfg)
            if data_errors:
                raise ConfigError(data_errors, plan.source)
        console.print(yaml.safe_dump(redact(cfg.to_dict()), sort_keys=False).rstrip(), markup=False)
        if summary is not None:
            console.print(f"[green]data OK[/]: {escape(summary)}", highlight=False, soft_wrap=True)
        console.print(f"[green]config OK[/]: {escape(plan.source)}", highlight=False, soft_wrap=True)
        return
    if plan.completed is not None and finished(plan, cfg.mode.create(plugins).total_steps(cfg), bool(overrides)):
        return
    short = gpu_shortfall(cfg, plugins)
    if short is not None:
        raise ConfigError([short], plan.source)
    run = plan.run
    if run is None:
        from posttrain.core.run_dir import RunDirectory

        run = RunDirectory.create(run_dir, config.stem)  # locked by its creation
    else:
        run.lock()  # one writer per run directory: a second exits 2 naming the holder's PID
    run.base_dir = plan.base_dir
    if plan.checkpoint is None:  # a new run, or one started over in place: its config is this one
        run.logs.mkdir(parents=True, exist_ok=True)
        run.write_config(cfg.to_dict(), plugins)

    from posttrain.cli.live import LiveDisplay

    console.print(f"run directory: {run.path}", soft_wrap=True, markup=False)
    if plan.checkpoint is not None:
        console.print(f"resumed after step {plan.resume_step} (checkpoint {plan.checkpoint})", soft_wrap=True,
                      markup=False)
    elif plan.start_over:
        console.print(f"no checkpoint in {run.path}: starting it over from step 1", soft_wrap=True, markup=False)
    mode = cfg.mode.create(plugins)
    total = mode.total_steps(cfg)
    display = LiveDisplay(total, console, first_step=plan.resume_step, columns=mode.columns)
    try:
        with display:
            start_training(cfg, plugins, run, resume=plan.checkpoint is not None or plan.start_over,
                           on_step=display.update, on_phase=display.phase)
    except KeyboardInterrupt as exc:
        from posttrain.core.errors import RunFailed, Stalled

        if isinstance(exc, Stalled):  # the watchdog's line: what the run waits on, the report, how to resume
            raise RunFailed(str(exc)) from None
        interrupted(run, display.next_step, total, signalled=exc)
    run.mark_complete(total)
    _finish(run, exact=bool(getattr(getattr(cfg, "rollout", None), "exact", False)))


def finished(plan: Plan, total: int, overridden: bool) -> bool:
    """A finished run asked to resume: True (said so, nothing to do) when it trained ``total`` steps already
    (with overrides and a checkpoint, the resume goes on to check them, e.g. another model is refused); more
    steps go on from its last checkpoint, or are refused where it has none."""
    if total <= plan.completed and (not overridden or plan.checkpoint is None):
        console.print(f"run complete ({plan.completed}/{total}): nothing to resume in {plan.run.path}; its final "
                      f"model is in {plan.run.path / 'hf-final'}", soft_wrap=True, markup=False)
        return True
    if plan.checkpoint is None:
        raise UsageError(f"{plan.run.path}: finished after {plan.completed} steps with no checkpoint to continue "
                         f"from to {total} (checkpoint.interval); start a new run from its hf-final")
    return False


def start_training(cfg: Any, plugins: Any, run: Any, **kwargs: Any) -> None:
    """The run mode's loop (``mode:``, the RL loop by default), in its own event loop (a seam: CLI tests
    replace it)."""
    asyncio.run(cfg.mode.create(plugins).run(cfg, plugins, run, **kwargs))


def plan_run(config: Path | None, run_dir: Path | None, resume: Path | None, resume_or_start: Path | None) -> Plan:
    """Decide what ``rl-cli run`` starts from; a run that cannot be resumed is a UsageError here."""
    from posttrain.core.config_source import read_yaml
    from posttrain.core.run_dir import RunDirectory

    if resume is not None and resume_or_start is not None:
        raise UsageError("give --resume or --resume-or-start, not both")
    if config is None and resume is None and resume_or_start is None:
        raise UsageError("give a CONFIG to run, or --resume RUN_DIR")
    if (resume or resume_or_start) is not None and run_dir is not None:
        raise UsageError("--run-dir: not with --resume/--resume-or-start (they name the run directory)")
    target = resume if resume is not None else resume_or_start
    if target is None:
        return Plan(None, read_yaml(config), config, str(config), Path(config).parent)
    run = RunDirectory(target)
    base_dir = Path(config).parent if config else Path(".")
    saved = run.path / "config.yaml"
    done = run.completed_steps()
    if done is not None:  # finished: nothing to do unless the overrides ask for more steps (checked in run)
        ckpt = run.latest_checkpoint()
        return Plan(run, run.read_config(), None, str(saved), base_dir, ckpt,
                    run.checkpoint_step(ckpt) if ckpt is not None else 0, completed=done)
    if resume is not None or (saved.is_file() and run.latest_checkpoint() is not None):
        ckpt, step = run.resume_point()  # raises with the reason when there is nothing to resume
        return Plan(run, run.read_config(), None, str(saved), base_dir, ckpt, step)
    # --resume-or-start without a checkpoint: start in RUN_DIR, with CONFIG or else its own config.yaml
    if config is not None:
        return Plan(run, read_yaml(config), config, str(config), base_dir, start_over=saved.is_file())
    if saved.is_file():
        return Plan(run, run.read_config(), None, str(saved), base_dir, start_over=True)
    raise UsageError(f"--resume-or-start {target}: no run there yet; give the CONFIG to start it with")


def check(plan: Plan, overrides: list[str], plugins: Any, scan_data: bool = False) -> tuple[Any, Any]:
    """The validated config and the preflight findings; every error found raises one ConfigError."""
    from posttrain.core.config import load_config
    from posttrain.core.config_source import apply_overrides
    from posttrain.core.preflight import check_run

    errors: list[str] = []
    try:
        if plan.config_file is not None:
            cfg = load_config(plan.config_file, overrides, plugins)
        else:
            cfg = load_config(None, overrides, plugins, data=plan.raw)
    except ConfigError as exc:
        cfg, errors = None, list(exc.errors)
    raw = copy.deepcopy(plan.raw)
    apply_overrides(raw, overrides)  # its errors are load_config's
    findings = check_run(cfg, raw, plugins, plan.base_dir, scan_data=scan_data)
    errors += findings.errors
    if errors:
        raise ConfigError(errors, plan.source)
    return cfg, findings


def gpu_shortfall(cfg: Any, plugins: Any) -> str | None:
    """The placement's missing GPUs on this machine, as a one-line error (local executor: a Ray cluster
    places the ranks on its own nodes); None when the GPUs are there."""
    if cfg.resources.executor != "local" or not cfg.mode.cls.generates:
        return None
    import torch

    from posttrain.core.rollout.backend import gpu_shortfall as shortfall

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return shortfall(cfg.resources, cfg.rollout.engine.create(plugins), have)


def interrupted(run: Any, next_step: int, total: int, signalled: BaseException | None = None) -> None:
    """Ctrl-C or SIGTERM: say where the run stopped and how to continue it; exit code 130 (128 + SIGINT) or
    143 (128 + SIGTERM)."""
    from posttrain.core.errors import Terminated

    terminated = isinstance(signalled, Terminated)
    ckpt = run.latest_checkpoint()
    err_console.print(f"{'terminated (SIGTERM)' if terminated else 'interrupted'} at step "
                      f"{min(next_step + 1, total)}/{total}", highlight=False)
    if ckpt is not None:
        err_console.print(f"resume with: rl-cli run --resume {run.path}  (continues after step "
                          f"{run.checkpoint_step(ckpt)}, checkpoint {ckpt})", highlight=False, soft_wrap=True,
                          markup=False)
    else:
        err_console.print(f"no checkpoint yet (checkpoint.interval); start it over with: "
                          f"rl-cli run --resume-or-start {run.path}", highlight=False, soft_wrap=True,
                          markup=False)
    raise typer.Exit(143 if terminated else 130)


def exact_line(rows: list[dict]) -> str:
    """``rollout.exact``'s verdict over a run's metric rows: every compared token's train log-prob equal to the
    rollout's, or the first step where one was not."""
    key = "train_rollout_logprob_abs_diff_max"
    scored = [r for r in rows if key in r]
    bad = next((r for r in scored if r[key] != 0.0), None)
    tokens = int(sum(r.get("train_rollout_logprob_tokens", 0.0) for r in scored))
    if not scored:
        return "exact: no step compared train and rollout log-probs"
    if bad is None:
        return f"exact: every token matched ({tokens} tokens, {len(scored)} steps)"
    return (f"exact: step {bad['step']} did not match: max |train - rollout| log-prob {bad[key]:.3g} "
            f"(mean {bad.get('train_rollout_logprob_abs_diff', float('nan')):.3g})")


def _finish(run: Any, exact: bool = False) -> None:
    from posttrain.cli.plot_cmd import write_curves
    from posttrain.core.metrics import read_metrics

    rows = read_metrics(run.path)
    if rows:
        write_curves(rows, run.path / "curves.png", title=run.path.name)
        console.print(f"done: {len(rows)} steps; curves: {run.path / 'curves.png'}; "
                      f"metrics: {run.path / 'metrics.jsonl'}", soft_wrap=True, markup=False)
        if exact:
            console.print(exact_line(rows), soft_wrap=True, markup=False)
    if (run.path / "hf-final" / "config.json").is_file():
        console.print(f"final model (HF checkpoint): {run.path / 'hf-final'}; any checkpoint's: "
                      f"rl-cli models export {run.path} --step N OUT", soft_wrap=True, markup=False)
