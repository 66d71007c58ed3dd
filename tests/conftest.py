"""Shared test helpers. Test modules get fresh plugin managers; nothing global is mutated."""

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _collector_restored():
    """An in-process run settles the heap (core.gcutil): undo it so later tests see CPython's collector."""
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    yield
    if gc.get_freeze_count() != frozen:
        gc.unfreeze()
    if gc.get_threshold() != threshold:
        gc.set_threshold(*threshold)


@pytest.fixture
def write(tmp_path):
    """write("name.py", text) -> path, for plugin files, configs and data under tmp_path."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    return _write


@pytest.fixture(scope="session")
def pip_target(tmp_path_factory):
    """pip_target(project_dir) -> a directory holding that project installed (no deps), for PYTHONPATH."""

    def _install(project: Path) -> Path:
        target = tmp_path_factory.mktemp("site")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(project)], check=True, capture_output=True)
        return target

    return _install


def env_with(path: Path | None = None, **extra: str) -> dict:
    """os.environ plus ``path`` prepended to PYTHONPATH (and extra variables)."""
    env = dict(os.environ, **extra)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH", "")) if p)
    return env


def run_triton_interpreted(script: str, *args: str) -> None:
    """Run ``script`` (with ``args`` as ``sys.argv[1:]``) in a fresh interpreter under ``TRITON_INTERPRET=1``
    (it must be set before a kernel is defined) on CPU tensors; it must print ``ok`` last."""
    env = env_with(ROOT, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300, env=env,
                         cwd=str(ROOT))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory):
    """The quickstart run as docs/getting-started.md shows it, unmodified: ``rl-cli run examples/quickstart.yaml``
    in a folder of its own (``examples/`` linked there), so it writes ``runs/quickstart-<time>/`` there.
    Returns ``(folder, run directory, completed process)``; one run for every test that asks (about 40 s idle)."""
    folder = tmp_path_factory.mktemp("quickstart")
    (folder / "examples").symlink_to(ROOT / "examples")
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "run", "examples/quickstart.yaml"],
                         capture_output=True, text=True, cwd=folder, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    runs = sorted((folder / "runs").glob("quickstart-*"))
    assert len(runs) == 1, runs
    return folder, runs[0], out
