"""``python -m posttrain.plugins.engines.sglang.serve OPTIONS``: runs ``python -m sglang.launch_server
OPTIONS --api-key KEY`` in this process, with KEY read from ``POSTTRAIN_ENGINE_API_KEY`` (then cleared).

SGLang takes its key only as ``--api-key``; a key on the real command line is readable by every local user
(``/proc/PID/cmdline``), while ``sys.argv`` rewritten here stays inside the interpreter.
"""

from __future__ import annotations

import os
import runpy
import sys


def sglang_argv(argv: list[str], api_key: str | None) -> list[str]:
    """The ``sys.argv`` that ``sglang.launch_server`` sees."""
    return ["sglang.launch_server", *argv, *(["--api-key", api_key] if api_key else [])]


def main() -> None:
    from posttrain.core.rollout.backend import API_KEY_ENV

    sys.argv = sglang_argv(sys.argv[1:], os.environ.pop(API_KEY_ENV, "") or None)
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
