"""Prompt datasets: local ``.jsonl`` / ``.json`` / ``.parquet`` files and HF ``save_to_disk`` folders.

::

    data:
      path: data/train.jsonl@[0:1000]     # optional row slice, Python semantics
      input_key: prompt                   # a string or chat messages [{role, content}, ...]
      label_key: label
      metadata_key: metadata              # a mapping (or a JSON string of one)
      tools_key: tools                    # a list or JSON string; copied to metadata["tools"]
      apply_chat_template: true           # rendered with the model's tokenizer, add_generation_prompt=True
      system_prompt: "Reason step by step."   # a system message before each prompt
      max_prompt_len: 1024                # longer prompts are dropped (the count is reported)
      images_key: images                  # vision-language: paths (relative to this file) or base64, or a list
      max_pixels: 1048576                 # a larger image is a bad row
      on_bad_row: error                   # or skip

Every bad row is reported as ``file:line: what is wrong`` (``file:row N`` for parquet and saved HF
datasets), all of them at once, before anything starts: :func:`load_prompts` raises
:class:`DataError`; :func:`check_data` returns the messages for ``rl-cli run --dry-run``.

Images (``images_key``, :mod:`posttrain.core.vision`): every one is opened and checked at load time (a missing
file, an unreadable image, more than ``max_pixels`` pixels are bad rows); the prompt becomes chat messages with
one ``{"type": "image"}`` item per image, which the chat template turns into the image placeholder, and
``max_prompt_len`` counts the image tokens the placeholders expand to.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.core.errors import UsageError

MAX_ERRORS_SHOWN = 50
_SLICE = re.compile(r"^(?P<path>.*)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]$")


class DataError(UsageError):
    """Problems in the prompt data; ``errors`` holds one ``file:line: message`` per problem."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        shown = self.errors[:MAX_ERRORS_SHOWN]
        more = len(self.errors) - len(shown)
        tail = [f"... and {more} more"] if more > 0 else []
        super().__init__(f"{len(self.errors)} error(s) in the prompt data:\n" +
                         "\n".join(f"  {e}" for e in shown + tail))


@dataclass
class PromptRow:
    """One prompt: as rendered (``prompt``), its label, metadata, and where it came from (``source``)."""

    prompt: str | list[dict[str, Any]]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    images: list[str] | None = None  # image references (core.vision): absolute paths or base64


@dataclass
class PromptDataset:
    """The loaded prompts plus what loading dropped: ``skipped`` bad rows (``on_bad_row: skip``) and
    ``filtered`` prompts longer than ``max_prompt_len``."""

    rows: list[PromptRow]
    path: str = ""
    skipped: int = 0
    filtered: int = 0
    errors: list[str] = field(default_factory=list)  # the skipped rows' messages

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PromptRow:
        return self.rows[i]

    def summary(self) -> str:
        return (f"{self.path}: {len(self.rows)} prompts ({self.skipped} bad rows skipped, "
                f"{self.filtered} longer than max_prompt_len dropped)")


def split_slice(spec: str) -> tuple[str, slice | None]:
    """``"a.jsonl@[10:20]"`` -> ``("a.jsonl", slice(10, 20))``; no suffix -> ``(spec, None)``."""
    m = _SLICE.match(spec)
    if not m:
        return spec, None
    to_int = lambda s: int(s) if s not in ("", "-") else None  # noqa: E731
    return m["path"], slice(to_int(m["start"]), to_int(m["end"]))


# ---- reading raw rows: (where, mapping) or (where, error message) ----

def read_records(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    """Yield ``(where, record, error)`` for each row of ``path``; ``error`` is set for unreadable rows."""
    if path.is_dir():
        yield from _read_saved_dataset(path)
    elif path.suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif path.suffix == ".json":
        yield from _read_json(path)
    elif path.suffix == ".parquet":
        yield from _read_parquet(path)
    else:
        raise DataError([f"{path}: unsupported format {path.suffix or '(no suffix)'!r}; "
                         f"use .jsonl, .json, .parquet or a folder written by datasets' save_to_disk"])


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, None, f"not UTF-8 text ({exc.reason} at byte {exc.start} of the line)"
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line), None
            except json.JSONDecodeError as exc:
                yield where, None, f"invalid JSON: {exc.msg} (column {exc.colno})"


def _read_json(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        yield f"{path}:{line}", None, f"not UTF-8 text ({exc.reason} at byte {exc.start})"
        return
    decoder = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "[":
        yield f"{path}:{text.count(chr(10), 0, i) + 1}", None, \
            "expected a JSON list of objects (for one object per line use .jsonl)"
        return
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            yield f"{path}:{text.count(chr(10)) + 1}", None, "invalid JSON: the list is never closed"
            return
        if text[i] == "]":
            return
        line = text.count("\n", 0, i) + 1
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            yield f"{path}:{exc.lineno}", None, f"invalid JSON: {exc.msg} (column {exc.colno})"
            return  # the rest of the list cannot be located reliably
        yield f"{path}:{line}", obj, None
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i += 1


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _read_parquet(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise DataError([f"{path}: not a readable parquet file ({exc})"]) from None
    for n, row in enumerate(table.to_pylist(), 1):
        yield f"{path}:row {n}", row, None


def _read_saved_dataset(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise DataError([f"{path}: not a dataset saved with save_to_disk ({exc})"]) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError([f"{path}: a DatasetDict without a 'train' split; point data.path at one of "
                             f"{', '.join(f'{path}/{s}' for s in ds)}"])
        ds = ds["train"]
    for n, row in enumerate(ds, 1):
        yield f"{path}:row {n}", row, None


# ---- validating and rendering rows ----

def _check_messages(value: Any) -> str | None:
    if isinstance(value, str):
        return None
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and (
                isinstance(m.get("content"), (str, list)) or (m.get("content") is None and m.get("tool_calls")))
            for m in value):  # an assistant turn that only calls tools has content None
        return None
    return f"must be a string or a non-empty list of chat messages {{role, content}}, got {_show(value)}"


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def parse_row(record: Any, cfg: Any) -> tuple[PromptRow | None, str | None]:
    """One raw record -> a :class:`PromptRow`, or the message saying what is wrong with it."""
    if not isinstance(record, dict):
        return None, f"expected a JSON object, got {_show(record)}"
    if cfg.input_key not in record:
        keys = ", ".join(map(str, record)) or "(none)"
        return None, f"missing key {cfg.input_key!r} (data.input_key); the row has: {keys}"
    prompt = record[cfg.input_key]
    problem = _check_messages(prompt)
    if problem:
        return None, f"{cfg.input_key!r} {problem}"
    if isinstance(prompt, str) and not prompt.strip():
        return None, f"{cfg.input_key!r} is empty"
    metadata = record.get(cfg.metadata_key)
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError:
            return None, f"{cfg.metadata_key!r} is a string that is not JSON"
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        return None, f"{cfg.metadata_key!r} must be a mapping, got {_show(metadata)}"
    tools = record.get(cfg.tools_key)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            return None, f"{cfg.tools_key!r} is a string that is not JSON"
    if tools is not None:
        if not isinstance(tools, list):
            return None, f"{cfg.tools_key!r} must be a list of tool schemas, got {_show(tools)}"
        metadata = {**metadata, "tools": tools}
    return PromptRow(prompt=prompt, label=record.get(cfg.label_key), metadata=metadata), None


def with_system_prompt(prompt: str | list, system: str) -> list:
    """Chat messages with ``system`` first: a string prompt becomes a system and a user message; a
    conversation that has its own system message keeps it."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if messages and messages[0].get("role") == "system":
        return messages
    return [{"role": "system", "content": system}, *messages]


def render_prompt(row: PromptRow, tokenizer: Any, template_kwargs: dict[str, Any]) -> str:
    """The prompt as text through the tokenizer's chat template (a string becomes one user message)."""
    messages = [{"role": "user", "content": row.prompt}] if isinstance(row.prompt, str) else row.prompt
    kwargs = dict(template_kwargs)
    if row.metadata.get("tools") is not None:
        kwargs["tools"] = row.metadata["tools"]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def prompt_length(prompt: str | list, tokenizer: Any, template_kwargs: dict[str, Any]) -> int:
    """Tokens in the prompt as the engine will see it (messages rendered with the chat template)."""
    if isinstance(prompt, str):
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **template_kwargs)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _add_images(row: PromptRow, record: dict[str, Any], cfg: Any, data_dir: Path) -> str | None:
    """``row.images`` from ``record[cfg.images_key]`` (each opened and checked), and the prompt as chat
    messages with an image item per image (:func:`posttrain.core.vision.with_image_slots`); the problem if any."""
    from posttrain.core.vision import check_image, image_refs, with_image_slots

    if record.get(cfg.images_key) is None:
        return None  # a text-only prompt among image ones
    refs, problem = image_refs(record[cfg.images_key], data_dir)
    if problem:
        return f"{cfg.images_key!r} {problem}"
    for ref in refs:
        problem = check_image(ref, cfg.max_pixels)[1]
        if problem:
            return problem
    row.prompt, problem = with_image_slots(row.prompt, len(refs))
    row.images = refs
    return problem


def _collect(cfg: Any, tokenizer: Any, base_dir: str | Path, vision: Any = None) -> tuple[PromptDataset, list[str]]:
    spec = cfg.path
    if not spec:
        return PromptDataset([], ""), ["data.path: no prompt data configured"]
    local, rows_slice = split_slice(spec)
    path = Path(local)
    if not path.is_absolute() and not path.exists() and (Path(base_dir) / local).exists():
        path = Path(base_dir) / local
    if not path.exists():
        return PromptDataset([], str(path)), [f"data.path: no such file or directory: {local}"]
    needs_tokenizer = cfg.apply_chat_template or cfg.max_prompt_len is not None
    if needs_tokenizer and tokenizer is None:
        return PromptDataset([], str(path)), ["data: apply_chat_template and max_prompt_len need the model's "
                                              "tokenizer (set model:)"]
    errors: list[str] = []
    try:
        records = list(read_records(path))
    except DataError as exc:
        return PromptDataset([], str(path)), exc.errors
    if rows_slice is not None:
        records = records[rows_slice]
    if not records:
        which = f" (slice {spec.split('@', 1)[1]})" if rows_slice is not None else ""
        return PromptDataset([], str(path)), [f"{path}: the dataset is empty{which}"]
    rows, filtered = [], 0
    for where, record, problem in records:
        row = None
        if problem is None:
            row, problem = parse_row(record, cfg)
        if problem is None and getattr(cfg, "images_key", None):
            problem = _add_images(row, record, cfg, path.parent)
        if problem is None and getattr(cfg, "system_prompt", None):
            row.prompt = with_system_prompt(row.prompt, cfg.system_prompt)
        if problem is None and cfg.apply_chat_template:
            try:
                row.prompt = render_prompt(row, tokenizer, cfg.chat_template_kwargs)
            except Exception as exc:  # a template error names the row, never a traceback
                problem = f"the chat template failed: {type(exc).__name__}: {exc}"
        if problem is not None:
            errors.append(f"{where}: {problem}")
            continue
        row.source = where
        if cfg.max_prompt_len is not None and prompt_length(row.prompt, tokenizer, cfg.chat_template_kwargs) + (
                vision.tokens_added(row.images) if vision is not None and row.images else 0) > cfg.max_prompt_len:
            filtered += 1
            continue
        rows.append(row)
    dataset = PromptDataset(rows, str(path), filtered=filtered)
    if cfg.on_bad_row == "skip":
        dataset.skipped, dataset.errors = len(errors), errors
        errors = []
    if not errors and not rows:
        errors.append(f"{path}: no prompts left ({filtered} longer than data.max_prompt_len="
                      f"{cfg.max_prompt_len}, {dataset.skipped} bad rows skipped)")
    return dataset, errors


def load_prompts(cfg: Any, tokenizer: Any = None, base_dir: str | Path = ".", vision: Any = None) -> PromptDataset:
    """Load the prompt data described by a ``DataConfig``.

    :param tokenizer: the model's HF tokenizer; required for ``apply_chat_template`` and ``max_prompt_len``.
    :param base_dir: relative paths are also tried against this (the config file's folder).
    :param vision: the model's :class:`~posttrain.core.vision.ImageInputs`: ``max_prompt_len`` counts image tokens.
    :raises DataError: every bad row as ``file:line: message`` (unless ``on_bad_row: skip``).
    """
    dataset, errors = _collect(cfg, tokenizer, base_dir, vision)
    if errors:
        raise DataError(errors)
    return dataset


def scan_prompts(cfg: Any, base_dir: str | Path = ".") -> tuple[PromptDataset | None, list[str]]:
    """``(dataset or None, problems)``: every row of ``cfg`` (a ``DataConfig``) read and checked, without a
    tokenizer (so chat templates and ``max_prompt_len`` are not applied), for ``rl-cli run --dry-run``."""
    import dataclasses

    cfg = dataclasses.replace(cfg, apply_chat_template=False, max_prompt_len=None)
    dataset, errors = _collect(cfg, None, base_dir)
    if len(errors) > MAX_ERRORS_SHOWN:
        errors = errors[:MAX_ERRORS_SHOWN] + [f"... and {len(errors) - MAX_ERRORS_SHOWN} more data errors"]
    return (None if errors else dataset), errors


# ---- a cheap look at a dataset: its first rows and its size, without parsing every row ----

@dataclass
class DatasetPreview:
    """The first readable rows of a dataset (``(where, mapping)``) and how many rows it has (slice applied)."""

    path: Path
    rows: list[tuple[str, dict[str, Any]]]
    count: int

    def keys(self) -> list[str]:
        """Every key of the previewed rows, in first-seen order."""
        return list(dict.fromkeys(str(k) for _, r in self.rows for k in r))


def resolve_path(spec: str, base_dir: str | Path = ".") -> tuple[Path, slice | None]:
    """``(path, slice)`` of a ``data.path`` spec; a relative path is also tried against ``base_dir``."""
    local, rows_slice = split_slice(spec)
    path = Path(local)
    if not path.is_absolute() and not path.exists() and (Path(base_dir) / local).exists():
        path = Path(base_dir) / local
    return path, rows_slice


def preview(spec: str, base_dir: str | Path = ".", n: int = 5) -> DatasetPreview:
    """The first ``n`` readable object rows of ``spec`` and its row count; cheap for large files (parquet
    and saved datasets read their metadata, JSONL counts lines).

    :raises DataError: the file is missing, of an unsupported format, or unreadable.
    """
    path, rows_slice = resolve_path(spec, base_dir)
    if not path.exists():
        raise DataError([f"{path}: no such file or directory"])
    if path.suffix == ".jsonl" and not path.is_dir():
        with path.open("rb") as f:
            total = sum(1 for line in f if line.strip())
    elif path.suffix == ".parquet" and not path.is_dir():
        import pyarrow.parquet as pq

        try:
            total = pq.ParquetFile(path).metadata.num_rows
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise DataError([f"{path}: not a readable parquet file ({exc})"]) from None
    elif path.is_dir():
        total = _saved_dataset_len(path)
    else:
        total = None  # .json: counted while reading below (the whole file is parsed anyway)
    records: Any = read_records(path)  # lazy: stops after the last row it needs
    if total is None:
        records = list(records)
        total = len(records)
    wanted = range(total)[rows_slice or slice(None)]
    keep = set(wanted[:n])
    rows = []
    for i, (where, record, problem) in enumerate(records):
        if i > max(keep, default=-1):
            break
        if i in keep and problem is None and isinstance(record, dict):
            rows.append((where, record))
    return DatasetPreview(path, rows, len(wanted))


def _saved_dataset_len(path: Path) -> int:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise DataError([f"{path}: not a dataset saved with save_to_disk ({exc})"]) from None
    if isinstance(ds, datasets.DatasetDict):
        return len(ds["train"]) if "train" in ds else 0  # read_records names the splits
    return len(ds)


def check_data(cfg: Any, tokenizer: Any = None, base_dir: str | Path = ".") -> list[str]:
    """The data's problems as messages (empty when it loads), for ``rl-cli run --dry-run``."""
    return _collect(cfg, tokenizer, base_dir)[1]


def check_config_data(config_path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
                      tokenizer: Any = None) -> list[str]:
    """The prompt-data problems of a run config file (see :func:`inspect_config_data`)."""
    return inspect_config_data(config_path, overrides, tokenizer)[1]


def inspect_config_data(config_path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
                        tokenizer: Any = None, plugins: Any = None) -> tuple[PromptDataset | None, list[str]]:
    """``(dataset or None, problems)`` for the ``data:`` section of a run config file, for
    ``rl-cli run --dry-run``: read straight from the YAML, so they are reported even when other
    sections are invalid. Without a ``tokenizer``, chat templates and ``max_prompt_len`` are not
    checked. A missing file or an invalid ``data:`` section is left to ``load_config`` (no duplicates), and
    so is the data of a run mode that does not read prompts (``RunMode.inspect_data``; needs ``plugins``).
    """
    from posttrain.core.config import DataConfig, mode_generates
    from posttrain.core.config_source import apply_overrides, read_yaml
    from posttrain.core.schema import build

    try:
        raw = read_yaml(config_path) if config_path is not None else {}
    except UsageError:
        return None, []  # load_config reports it
    apply_overrides(raw, overrides)
    if plugins is not None and not mode_generates(raw, plugins):
        return None, []
    cfg, errors = build(DataConfig, raw.get("data"), "data")
    if errors or cfg is None or not cfg.path:
        return None, []
    base = Path(config_path).parent if config_path is not None else Path(".")
    local = split_slice(cfg.path)[0]
    if not (Path(local).exists() or (base / local).exists()):
        return None, []
    if tokenizer is None:
        cfg.apply_chat_template, cfg.max_prompt_len = False, None
    dataset, errors = _collect(cfg, tokenizer, base)
    if len(errors) > MAX_ERRORS_SHOWN:
        errors = errors[:MAX_ERRORS_SHOWN] + [f"... and {len(errors) - MAX_ERRORS_SHOWN} more data errors"]
    return (None if errors else dataset), errors
