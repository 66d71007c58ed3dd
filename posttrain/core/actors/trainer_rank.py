"""One rank of a trainer group: a :class:`~posttrain.core.actors.trainer.TrainerRole` running the calls
the driver fans out to every rank.

Under the local executor a rank is a child process running :func:`serve` (``python -m
posttrain.core.actors.trainer_rank``): it connects back to the driver's listener and answers one pickled
``(method, args, kwargs)`` at a time with ``("ok", result)`` or ``("error", (type, is_usage, message))``.
Under Ray, ``trainer_group.RankActor`` runs the same :func:`answer`. torch.distributed's rendezvous
comes from the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
which the trainer backend's parallel init reads.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from typing import Any

FROM_EVERY_RANK = {"memory_stats", "pid"}  # the driver combines these; of the rest, rank 0 answers


def answer(role: Any, message: tuple, build: Any = None) -> tuple[str, Any]:
    """Run ``(method, args, kwargs)`` on ``role`` (``"__init__"`` calls ``build(*args)`` instead); a
    failure comes back as data, its traceback goes to this rank's log."""
    method, args, kwargs = message
    try:
        if method == "__init__":
            return "ok", build(*args)
        if method == "pid":
            return "ok", os.getpid()
        out = getattr(role, method)(*args, **kwargs)
        return "ok", out if role.rank == 0 or method in FROM_EVERY_RANK else None
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, which decides
        from posttrain.core.errors import RunFailed, UsageError
        from posttrain.core.storage import storage_failure

        traceback.print_exc()
        sys.stderr.flush()
        writing = args[0] if method in ("save", "save_hf") and args and isinstance(args[0], str) else None
        disk = storage_failure(exc, writing)  # a full or read-only disk: one line for the driver, as out of memory is
        if disk:
            return "error", (RunFailed.__name__, True, disk)
        return "error", (type(exc).__name__, isinstance(exc, UsageError), str(exc))


def build_role(config: dict[str, Any], load_args: dict[str, list[str]] | None = None) -> Any:
    from posttrain.core.actors.trainer import TrainerRole

    return TrainerRole(config, load_args)


def serve() -> None:
    """A rank process: connect to the driver, answer until told to exit or until the driver is gone."""
    from multiprocessing.connection import Client

    from posttrain.core.rollout.procs import exit_with_parent

    exit_with_parent()
    host, port = os.environ["POSTTRAIN_GROUP_DRIVER"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ.pop("POSTTRAIN_GROUP_KEY")))
    conn.send_bytes(pickle.dumps(int(os.environ["RANK"])))
    role = None

    def build(*args: Any) -> None:
        nonlocal role
        role = build_role(*args)

    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if message[0] == "__exit__":
            conn.send_bytes(pickle.dumps(("ok", None)))
            break
        conn.send_bytes(pickle.dumps(answer(role, message, build)))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: nothing of torch.distributed or dist-checkpointing to wait for


if __name__ == "__main__":  # dist-checkpointing starts worker processes: the guard is required
    serve()
