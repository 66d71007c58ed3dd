"""Where a run config's mapping comes from, before any validation: the YAML file (``read_yaml``), the command
line's ``key.sub=value`` overrides (``apply_overrides``), keys that moved into a backend's section
(``moved_keys``) and the input files it names, found relative to the config's folder (``resolve_files``). Each
returns its problems as one-line errors, so :func:`posttrain.core.config.load_config` reports them with the rest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from posttrain.core.errors import ConfigError

# keys that moved into a backend's section: an old config gets the new name, not "unknown key"
MOVED = {
    "rollout.engine_urls": "rollout.engine.urls (with the external engine backend)",
    "rollout.engine_device": "rollout.engine.device", "rollout.engine_compile": "rollout.engine.compile",
    "rollout.engine_max_running_requests": "rollout.engine.max_running_requests",
    "rollout.engine_decode_attention": "rollout.engine.decode_attention",
    "rollout.engine_context_length": "rollout.engine.context_length",
    "rollout.mem_fraction_static": "rollout.engine.mem_fraction_static (with the SGLang engine backend)",
    "rollout.sglang": "rollout.engine.args (with the SGLang engine backend)",
    **{f"trainer.{key}": f"trainer.backend.{key}" for key in (
        "tp", "pp", "attention", "compile", "sequence_packing", "log_probs_chunk_size", "log_probs_recompute",
        "use_distributed_optimizer", "fused_adam")},
    "trainer.megatron": "trainer.backend.megatron",
}


def moved_keys(raw: Any) -> list[str]:
    """One ``old.key: moved to new.key`` error per moved key in ``raw`` (which loses them, so they are not
    reported twice as unknown)."""
    errors = []
    for old, new in MOVED.items():
        section, key = old.split(".")
        node = raw.get(section) if isinstance(raw, dict) else None
        if isinstance(node, dict) and key in node:
            del node[key]
            errors.append(f"{old}: moved to {new}")
    return errors


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The YAML mapping in ``path``; a missing file or a syntax error is a one-line ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"{p}: no such config file"])
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise ConfigError([f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{p}: the top level must be a mapping of sections, got {type(raw).__name__}"])
    return raw


def split_setting(item: str) -> tuple[str, Any] | None:
    """``key=value`` as ``(key, value)``, the value parsed as YAML (its text where YAML cannot read it); None when
    ``item`` has no ``=`` or no key."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        return None
    try:
        return key, yaml.safe_load(text)
    except yaml.YAMLError:
        return key, text


# component sections whose components share one option schema: a switch keeps the file's keys there
# (every model spec takes ModelSpec.Config: ``model.name=qwen3_moe`` keeps ``preset``, ``dtype``, ``tokenizer``)
SHARED_SCHEMA_SECTIONS = ("model",)


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> list[str]:
    """Apply ``a.b.c=value`` (value parsed as YAML; list items by index: ``rewards.0.weight=0.5``).

    ``section.name=other`` that switches a component section to another component drops the keys the
    file gave that section (they configured the one it named: ``trainer.backend.name=fsdp`` on a
    file with ``backend: {name: megatron, tp: 2}``); keys set by earlier overrides stay. Sections of
    :data:`SHARED_SCHEMA_SECTIONS` keep them (their components take the same keys)."""
    errors = []
    overridden: set[tuple[int, Any]] = set()  # (id(section), key) set on the command line
    for item in overrides:
        setting = split_setting(item)
        if setting is None:
            errors.append(f"{item}: an override must look like key.sub=value")
            continue
        key, value = setting
        node: Any = raw
        parts = key.split(".")
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    errors.append(f"{key}: {'.'.join(parts[:i]) or 'config'} has no item {part} "
                                  f"(it has {len(node)})")
                    break
                part = int(part)
            elif not isinstance(node, dict):
                errors.append(f"{key}: {'.'.join(parts[:i])} is not a section")
                break
            if last:
                if part == "name" and isinstance(node, dict) and node.get("name") not in (None, value) \
                        and ".".join(parts[:-1]) not in SHARED_SCHEMA_SECTIONS:
                    for k in [k for k in node if k != "name" and (id(node), k) not in overridden]:
                        del node[k]
                node[part] = value
                overridden.add((id(node), part))
            else:
                if isinstance(node, dict) and not isinstance(node.get(part), (dict, list)):
                    node[part] = {"name": node[part]} if isinstance(node.get(part), str) else {}
                node = node[part]
    return errors


def resolve_files(raw: dict[str, Any], base: Path) -> list[str]:
    """Input files: missing ones are errors (checked on the raw mapping, so they are reported with the
    others); a path found only relative to the config's folder is made absolute there, so every process
    (and a resumed run) reads the same file wherever it starts."""
    errors = []
    data = raw.get("data")
    entries = [(data, "data.path")] if isinstance(data, dict) else []
    evals = raw.get("eval", {}).get("datasets") if isinstance(raw.get("eval"), dict) else None
    entries += [(d, f"eval.datasets.{i}.path") for i, d in enumerate(evals or []) if isinstance(d, dict)]
    if isinstance(raw.get("teacher"), dict):
        entries.append((raw["teacher"], "teacher.path"))
    for section, where in entries:
        path = section.get("path")
        if not isinstance(path, str) or "://" in path:
            continue
        local, _, slicing = path.partition("@[")
        if Path(local).exists():
            continue
        if (base / local).exists():
            section["path"] = str((base / local).resolve()) + (f"@[{slicing}" if slicing else "")
        else:
            errors.append(f"{where}: no such file or directory: {local}")
    return errors
