"""Checks every component keeps, whatever its kind."""

from __future__ import annotations

import dataclasses
import inspect
import json
import pickle
import subprocess
import sys

import pytest

# Entry modules are imported by every `rl-cli` call and every worker: nothing heavy at module level.
HEAVY_MODULES = ("torch", "transformers", "megatron", "sglang", "ray")


class ComponentContract:
    """Base of every contract. Each kind's contract defines a ``component`` fixture that returns the
    fixture the author supplies (``estimator``, ``reward``, ...), so parametrized fixtures work too."""

    def test_has_name_and_docstring(self, component):
        cls = type(component)
        assert isinstance(getattr(cls, "name", None), str) and cls.name, f"{cls.__name__} needs a `name`"
        assert inspect.getdoc(cls), f"{cls.__name__} needs a docstring (rl-cli plugins show prints it)"

    def test_config_is_a_picklable_dataclass(self, component):
        config = component.config
        assert dataclasses.is_dataclass(config), "component.config must be its Config dataclass instance"
        assert pickle.loads(pickle.dumps(config)) == config, "configs cross process boundaries by pickle"
        json.dumps(dataclasses.asdict(config))  # and are plain data (written to the run directory)

    def test_module_is_import_light(self, component):
        module = type(component).__module__
        if module.startswith("posttrain_local_"):
            pytest.skip("--plugin files are imported by path")
        code = (f"import sys, json; import {module}; "
                f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY_MODULES!r}))))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        heavy = json.loads(out.stdout.strip().splitlines()[-1])
        assert heavy == [], f"importing {module} imports {heavy}: import them inside functions instead"
