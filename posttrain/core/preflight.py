"""Checks a run must pass before any process starts: what the config's keys point at.

``load_config`` checks each key's type, range and plugin name; it cannot see that ``data.label_key``
names a key the data does not have, that the data runs out before ``rollout.num_rollouts``, or that
``model.path`` is a hub id rather than a directory. Each of those would pass ``--dry-run`` and fail
minutes later inside a worker. :func:`check_run` finds them from the config and the first rows of each
dataset (no engine, no model, no tokenizer), one ``key: message`` line per problem::

    data.label_key: no key 'answer' in the first 5 rows of data/train.jsonl (they have: prompt, label)
    data.epochs: 100 prompts x 1 epoch = 100, but rollout.num_rollouts (150) x ...

``rl-cli run`` reports its errors together with the config's own, exit code 2, then runs nothing.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.core.data import DataError, PromptDataset, preview, resolve_path, scan_prompts
from posttrain.core.registry import KINDS

FIRST_ROWS = 5  # rows of each dataset whose keys are checked; a key missing from all of them is an error
# `org/name`: what a Hugging Face hub id looks like (a relative path of two parts looks the same, so
# the message says "if it is a hub id")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
REQUIRED_SECTIONS = ("model", "generator", "loss")


@dataclass
class Findings:
    """``errors`` stop the run (exit 2); ``notes`` are printed and the run goes on."""

    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dataset: PromptDataset | None = None  # the fully read prompts (``scan_data``), for the dry-run summary


def check_run(cfg: Any, raw: dict[str, Any], plugins: Any, base_dir: str | Path = ".",
              scan_data: bool = False) -> Findings:
    """Every problem of a run that can be found without starting anything.

    :param cfg: the validated ``RunConfig``, or None when ``load_config`` failed (then only what
        ``raw`` allows is checked, so its errors come together with the config's).
    :param raw: the config mapping as read (overrides applied).
    :param base_dir: relative data paths are also tried against it (the config file's folder).
    :param scan_data: also read every row of ``data.path`` (``--dry-run``); otherwise only its first rows.
    """
    out = Findings()
    out.errors += _missing_sections(cfg, raw, plugins)
    if cfg is not None and cfg.model is not None:
        out.errors += _model_paths(cfg.model.config)
    data = cfg.data if cfg is not None else _build_data(raw)
    if cfg is not None and not cfg.mode.cls.generates:  # a mode with its own data (SFT rows) checks them itself
        data = None
    count = None
    if data is not None and data.path:
        keys_ok, count = _check_keys(out, "data", data, _data_keys(data), base_dir)
        if keys_ok and scan_data:
            out.dataset, row_errors = scan_prompts(data, base_dir)
            out.errors += row_errors
            count = len(out.dataset) if out.dataset is not None else None
    if cfg is not None and count:
        out.errors += _coverage(cfg, count)
    for i, ds in enumerate(cfg.eval.datasets if cfg is not None else []):
        _check_keys(out, f"eval.datasets.{i}", ds, _data_keys(ds), base_dir)
    return out


def _missing_sections(cfg: Any, raw: dict[str, Any], plugins: Any) -> list[str]:
    kinds = {"model": "models", "generator": "generators", "loss": "losses"}
    if cfg is not None:  # what the run mode needs (the RL loop: model, generator, loss; SFT: model, loss)
        missing = [key for key in cfg.mode.cls.needed_to_train if key in kinds and getattr(cfg, key) is None]
        no_data = not cfg.data.path
    else:  # the config did not validate: judge from the mapping, so these come with its errors
        from posttrain.core.config import mode_generates

        needed = REQUIRED_SECTIONS if plugins is None or mode_generates(raw, plugins) else ("model", "loss")
        missing = [key for key in needed if not raw.get(key)]
        data = raw.get("data")
        no_data = isinstance(data, dict) and not data.get("path") or data is None
    errors = []
    for key in missing:
        names = ", ".join(sorted(plugins.registry(kinds[key]))) if plugins is not None else ""
        errors.append(f"{key}: required to train; choose one of: {names} "
                      f"(`rl-cli plugins list --kind {KINDS[kinds[key]]}`)")
    if no_data:
        errors.append("data.path: required to train (a .jsonl, .json or .parquet file, or a saved HF dataset)")
    return errors


def _looks_local(value: str) -> bool:
    """``owner/name`` that is a path here: absolute, relative to ``.``/``~``, or under a directory that exists."""
    return value.startswith(("/", ".", "~")) or Path(value).expanduser().parent.is_dir()


def _model_paths(model_config: Any) -> list[str]:
    """``model.path`` (and ``model.tokenizer``) must be local directories: nothing is downloaded."""
    errors = []
    for key in ("path", "tokenizer"):
        value = getattr(model_config, key, None)
        if not isinstance(value, str) or (key == "tokenizer" and "/" not in value):
            continue  # a tokenizer without a slash is a name its model spec knows, not a directory
        where, p = f"model.{key}", Path(value).expanduser()
        if p.is_dir():
            if key == "path" and not (p / "config.json").is_file():
                errors.append(f"{where}: {value} is not an HF checkpoint directory (no config.json in it)")
        elif p.exists():
            errors.append(f"{where}: {value} is a file; expected an HF checkpoint directory")
        elif _HUB_ID.match(value) and not _looks_local(value):
            local = f"checkpoints/{value.split('/')[1]}"
            errors.append(f"{where}: no such directory: {value}. If it is a Hugging Face hub id, download it "
                          f"first (`hf download {value} --local-dir {local}`) and set {where}: {local}")
        else:
            errors.append(f"{where}: no such directory: {value}")
    return errors


def _build_data(raw: dict[str, Any]) -> Any:
    from posttrain.core.config import DataConfig
    from posttrain.core.schema import build

    data, errors = build(DataConfig, raw.get("data"), "data")
    return None if errors else data


def _data_keys(section: Any) -> list[tuple[str, str, bool]]:
    """``(config key, data key, required)`` of a ``data`` or eval section: the prompt key always; the
    others when the config names a key other than the default (rows without a default key simply have
    none: no labels, no metadata)."""
    return [("input_key", section.input_key, True)] + [
        (key, getattr(section, key), getattr(section, key) != _default(type(section), key))
        for key in ("label_key", "metadata_key", "tools_key") if hasattr(section, key)]


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _check_keys(out: Findings, where: str, section: Any, keys: list[tuple[str, str, bool]],
                base_dir: str | Path) -> tuple[bool, int | None]:
    """Each key against the first rows of ``section.path``; ``(keys all found, row count)``."""
    try:
        seen = preview(section.path, base_dir, FIRST_ROWS)
    except DataError as exc:
        if not resolve_path(section.path, base_dir)[0].exists():
            return False, None  # load_config already said "no such file"
        out.errors += [f"{where}.path: {e}" for e in exc.errors]
        return False, None
    if not seen.rows:
        if seen.count == 0:
            out.errors.append(f"{where}.path: {seen.path} has no rows")
        return True, seen.count  # only unreadable rows: the full read reports them line by line
    have = seen.keys()
    ok = True
    for config_key, data_key, required in keys:
        if data_key in have:
            continue
        what = (f"{where}.{config_key}: no key {data_key!r} in the first {len(seen.rows)} rows of {seen.path} "
                f"(they have: {', '.join(have)})")
        if required:
            out.errors.append(what)
            ok = False
        elif config_key == "label_key":
            out.notes.append(f"{what}; rewards get label None")
    return ok, seen.count


def _coverage(cfg: Any, prompts: int) -> list[str]:
    """The data must hold ``num_rollouts x rollout_batch_size`` prompts over its epochs (dynamic-sampling
    filters may need more; that is only known while running)."""
    r, epochs = cfg.rollout, cfg.data.epochs
    needed = r.num_rollouts * r.rollout_batch_size
    if prompts * epochs >= needed:
        return []
    return [f"data.epochs: {prompts} prompts x {epochs} epoch(s) = {prompts * epochs}, but rollout.num_rollouts "
            f"({r.num_rollouts}) x rollout.rollout_batch_size ({r.rollout_batch_size}) needs {needed}; set "
            f"data.epochs: {math.ceil(needed / prompts)} (or fewer rollout.num_rollouts)"]
