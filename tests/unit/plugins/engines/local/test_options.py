"""One option schema for the local engine: ``LocalEngine.Config`` is what a run's ``rollout.engine`` section
builds, what ``launch()`` passes to ``rl-cli engine serve`` (every field, as flags) and what ``serve`` rebuilds
through ``posttrain.core.schema``; no option is declared anywhere else."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from posttrain.core.rollout.backend import API_KEY_ENV, EngineSlot
from posttrain.core.schema import build, option
from posttrain.plugins.engines.local import LocalEngine

from tests.conftest import ROOT

LOCAL = ROOT / "posttrain" / "plugins" / "engines" / "local"


class Served(Exception):
    """Raised by the stand-in for the server: ``serve`` got as far as starting it."""


@pytest.fixture
def serve_config(monkeypatch, tmp_path):
    """``serve_config(argv)``: run ``rl-cli engine serve`` on ``argv`` (what follows ``serve``) up to where it
    starts the server, and return the ``Config`` it rebuilt and the server's other arguments."""
    from posttrain.plugins.engines.local import command, server

    (tmp_path / "config.json").write_text("{}")
    seen: dict = {}

    def run(model_dir, config, **kwargs):
        seen.update(kwargs, config=config, model_dir=model_dir)
        raise Served

    monkeypatch.setattr(server, "serve", run)

    def invoke(argv: list[str]):
        seen.clear()
        result = CliRunner().invoke(command.app, argv, env={API_KEY_ENV: "k"})  # its one command: serve
        assert isinstance(result.exception, Served), (result.output, result.exception)
        return seen["config"], seen

    invoke.model_dir = str(tmp_path)
    return invoke


def _launch(backend: LocalEngine, model_dir: str, colocate: bool = True) -> list[str]:
    slot = EngineSlot(index=0, port=30001, host="127.0.0.1", model_path=model_dir, seed=0, api_key="k",
                      resources=SimpleNamespace(colocate=colocate), weights_from_push=True,
                      sampling={"temperature": 1.0})
    cmd = backend.launch(slot).command
    assert cmd[3:5] == ["engine", "serve"]
    return cmd[5:]


def _other_value(f: dataclasses.Field, tp) -> object:
    """A valid value of field ``f`` unlike its default."""
    if tp is bool:
        return not f.default
    if typing.get_origin(tp) is typing.Literal:
        return next(c for c in reversed(typing.get_args(tp)) if c != f.default)
    if tp is int:
        return f.default + 7
    if tp is float:
        return f.default * 2.5
    assert f.name == "device", f"a new field of type {tp}: give it a value here"
    return "cuda:0"


def test_every_config_field_reaches_serve_unchanged(serve_config):
    """A config with every field away from its default: ``launch()``'s command, parsed by ``serve``, rebuilds
    it field for field (the device as the engine sees it: its one GPU, ``cuda``)."""
    hints = typing.get_type_hints(LocalEngine.Config)
    changed = {f.name: _other_value(f, hints[f.name]) for f in dataclasses.fields(LocalEngine.Config)}
    config, errors = build(LocalEngine.Config, changed, "rollout.engine")
    assert not errors
    rebuilt, server = serve_config(_launch(LocalEngine(config), serve_config.model_dir))
    assert rebuilt == dataclasses.replace(config, device="cuda")
    default = LocalEngine.Config()
    assert [f.name for f in dataclasses.fields(rebuilt) if getattr(rebuilt, f.name) == getattr(default, f.name)] == []
    assert server["from_config"] and server["warm_sampling"] is None  # warm_up off: no warm-up sampling passed


def test_a_default_changed_in_the_config_is_seen_by_launch_and_by_serve(serve_config, monkeypatch):
    """The dataclass is the only place a default lives: changed there, a run's launch command carries it and a
    standalone ``rl-cli engine serve MODEL_DIR --port P`` rebuilds it."""
    @dataclasses.dataclass
    class Patched(LocalEngine.Config):
        max_running_requests: int = option(7, ge=1, help="KV-cache slots")
        decode_attention: typing.Literal["auto", "sdpa", "bmm", "triton"] = option("bmm", help="decode attention")

    from posttrain.plugins.engines.local import options

    assert LocalEngine.Config is options.EngineOptions  # one class: the backend's Config is the options module's
    monkeypatch.setattr(options, "EngineOptions", Patched)  # so replacing it replaces both names
    monkeypatch.setattr(LocalEngine, "Config", Patched)
    argv = _launch(LocalEngine(), serve_config.model_dir, colocate=False)
    assert argv[argv.index("--max-running-requests") + 1] == "7" and argv[argv.index("--decode-attention") + 1] == "bmm"
    launched, _ = serve_config(argv)
    standalone, _ = serve_config([serve_config.model_dir, "--port", "30002", "--load-format", "dummy"])
    for config in (launched, standalone):
        assert isinstance(config, Patched) and config.max_running_requests == 7 and config.decode_attention == "bmm"


def test_standalone_flags_keep_working(serve_config):
    """The flags users of ``rl-cli engine serve`` already pass (``--no-overlap``, ``--cuda-graphs``, ...) set the
    fields of the same names; what they leave out keeps the dataclass's defaults."""
    config, server = serve_config([serve_config.model_dir, "--port", "30003", "--device", "cuda:1", "--dtype", "float32",
                                   "--max-running-requests", "4", "--context-length", "128", "--cuda-graphs",
                                   "--no-overlap", "--no-fused-sampling", "--stable-memory", "--compile",
                                   "--compile-mode", "max-autotune-no-cudagraphs", "--prefill-tokens", "4096",
                                   "--decode-attention", "sdpa", "--load-format", "dummy",
                                   "--warm-sampling", json.dumps({"temperature": 0.5})])
    assert config == LocalEngine.Config(device="cuda:1", dtype="float32", max_running_requests=4, context_length=128,
                                        cuda_graphs=True, overlap=False, fused_sampling=False, stable_memory=True,
                                        compile=True, compile_mode="max-autotune-no-cudagraphs", prefill_tokens=4096,
                                        decode_attention="sdpa")
    assert server["port"] == 30003 and server["warm_sampling"] == {"temperature": 0.5}
    assert serve_config([serve_config.model_dir, "--load-format", "dummy"])[0] == LocalEngine.Config()


def test_serve_help_lists_every_config_field_with_its_help(monkeypatch):
    from posttrain.plugins.engines.local.command import app

    out = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400", "TERM": "dumb"}).output
    lines = out.splitlines()
    for f in dataclasses.fields(LocalEngine.Config):
        flag = "--" + f.name.replace("_", "-")
        line = next((row for row in lines if f" {flag} " in row), None)
        assert line is not None, flag
        assert f.metadata["help"].split()[0] in line, (flag, line)  # its help text starts on the flag's line


def test_a_bad_value_is_one_line_naming_its_option(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    serve = [sys.executable, "-m", "posttrain.cli.main", "engine", "serve", str(tmp_path), "--load-format", "dummy",
             "--no-api-key"]
    out = subprocess.run([*serve, "--max-running-requests", "0", "--decode-attention", "flash"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--max-running-requests: 0 is out of range (must be >= 1)" in out.stderr
    assert "--decode-attention: 'flash' is not one of 'auto', 'sdpa', 'bmm', 'triton'" in out.stderr
    out = subprocess.run([*serve, "--device", "tpu"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--device: expected cpu, cuda or cuda:N, got 'tpu'" in out.stderr


def test_a_run_config_checks_the_device_through_the_same_schema():
    _, errors = build(LocalEngine.Config, {"device": "gpu0"}, "rollout.engine")
    assert errors == ["rollout.engine.device: expected cpu, cuda or cuda:N, got 'gpu0'"]
    assert build(LocalEngine.Config, {"device": "cuda:3"}, "rollout.engine")[1] == []


@pytest.mark.parametrize("colocate, stable, expect", [(True, True, True), (False, True, False), (True, False, False)])
def test_launch_asks_for_stable_memory_only_for_colocated_gpu_engines(colocate, stable, expect):
    """Only a colocated engine releases its memory, so only there do weights and cache go to VMM buffers."""
    argv = _launch(LocalEngine(LocalEngine.Config(device="cuda:0", stable_memory=stable)), "/ckpt", colocate)
    assert ("--stable-memory" in argv) == expect and ("--no-stable-memory" in argv) == (not expect)
    cpu = _launch(LocalEngine(LocalEngine.Config(stable_memory=stable)), "/ckpt", colocate)
    assert "--no-stable-memory" in cpu


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}


def test_the_testing_helpers_take_the_engine_from_the_registry_and_the_server_has_no_import_circle():
    helper = ROOT / "posttrain" / "testing" / "engine.py"
    assert not any(m.startswith("posttrain.plugins") for m in _imports(helper))
    assert "posttrain.plugins.engines.local.server" not in _imports(LOCAL / "weight_routes.py")
    assert "posttrain.plugins.engines.local.weight_routes" in _imports(LOCAL / "server.py")


def test_one_name_per_class_in_the_local_engine():
    names: dict[str, list[str]] = {}
    for path in sorted(LOCAL.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                names.setdefault(node.name, []).append(path.name)
    assert {n: files for n, files in names.items() if len(files) > 1} == {}
