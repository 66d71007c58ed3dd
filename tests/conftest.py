"""Shared test helpers. Test modules get fresh plugin managers; nothing global is mutated."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
