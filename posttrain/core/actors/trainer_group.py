"""The trainer as a group of ranks (data, tensor, pipeline parallel) behind the methods of
:class:`~posttrain.core.actors.trainer.TrainerRole`, so the loop calls it as it calls one trainer.

World size = ``resources.trainer_nodes x resources.trainer_procs_per_node``. Every call runs on every
rank with the same arguments (pickled once): the trainer backend lays the ranks out, takes each
data-parallel replica's share of a batch and gathers results back (Megatron: TP fastest, then CP, DP,
PP; shares balanced by token count), and global rank 0 answers: log-probs ``[B, T]`` in sample order,
the step's metrics, the seconds of a weight push (rank 0 sends, the ranks of replica 0 gather each
bucket from their TP shards and PP stages). ``memory_stats`` is the busiest rank's; ``save``/``load``
run on every rank (dist-checkpointing, so a checkpoint loads into another layout).

Ranks are child processes under the local executor (:class:`LocalRanks`: torch.distributed over Gloo on
CPU, NCCL on GPUs; they die with the driver) or Ray actors on a placement group (:class:`RayRanks`: a
bundle per node, the rendezvous on rank 0's node). A rank that dies ends the run with
:class:`~posttrain.core.errors.RunFailed` naming it and its log; the other ranks are stopped.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from pathlib import Path
from typing import Any

from posttrain.core.actors.trainer_rank import answer, build_role
from posttrain.core.errors import RunFailed, UsageError
from posttrain.core.watchdog import waiting_on


class TrainerGroup:
    """``TrainerRole``'s methods over ``ranks`` (:class:`LocalRanks` or :class:`RayRanks`)."""

    def __init__(self, ranks: Any):
        self.ranks = ranks

    def log_probs(self, batch: Any, weights: str | None = None, with_entropy: bool = False) -> Any:
        return self.ranks.call("log_probs", batch, weights, with_entropy)

    def values(self, batch: Any) -> Any:
        return self.ranks.call("values", batch)

    def importance_weights(self, batch: Any, rollout_log_probs: Any) -> Any:
        return self.ranks.call("importance_weights", batch, rollout_log_probs, only=[0])

    def train(self, batch: Any, keep_log_probs: bool = False) -> Any:
        return self.ranks.call("train", batch, keep_log_probs)

    def save_hf(self, out_dir: str, replace: bool = False) -> str:
        return self.ranks.call("save_hf", out_dir, replace)

    def connect_engines(self, engine_urls: list[str], backend: str | None = None, api_key: str | None = None) -> None:
        self.ranks.call("connect_engines", engine_urls, backend, api_key)

    def push_weights(self, version: int, disk_dir: str | None = None) -> tuple[float, int]:
        return self.ranks.call("push_weights", version, disk_dir)

    def release_memory(self) -> None:
        self.ranks.call("release_memory")

    def offload(self) -> float:
        return self.ranks.call("offload")

    def onload(self) -> None:
        self.ranks.call("onload")

    def micro_batch_plan(self) -> str | None:
        """Rank 0's plan of ``trainer.max_tokens_per_micro_batch: auto`` (every rank plans from its device's total
        memory, so ranks on the same kind of GPU agree)."""
        return self.ranks.call("micro_batch_plan", only=[0])

    def memory_stats(self) -> dict[str, float]:
        """The busiest rank's figures (max over ranks, per key)."""
        out: dict[str, float] = {}
        for stats in self.ranks.call("memory_stats", every=True):
            out.update({k: max(out.get(k, v), v) for k, v in stats.items()})
        return out

    def save(self, ckpt_dir: str) -> None:
        self.ranks.call("save", ckpt_dir)

    def load(self, ckpt_dir: str) -> None:
        self.ranks.call("load", ckpt_dir)

    def pids(self) -> list[int]:
        """Process ids of the ranks, in rank order."""
        return self.ranks.call("pid", every=True)

    def processes(self) -> list[tuple[str, int, str | None]]:
        """``(label, pid, log)`` of each rank this host runs as a child (none for Ray actors): the watchdog's
        report asks them for their state and stacks without a call that a stuck rank would not answer."""
        procs = getattr(self.ranks, "procs", [])
        return [(f"trainer rank {r}", p.pid, self.ranks.logs[r]) for r, p in enumerate(procs)]

    def close(self) -> None:
        self.ranks.close()


class _Ranks:
    """Fan-out and collection over ``world`` ranks; a dead or stuck rank breaks the group."""

    grace_s = 60.0  # after one rank failed, how long the others may take to answer before they count as stuck

    def __init__(self, world: int, logs: list[str]):
        self.world, self.logs = world, logs
        self.broken = self.closed = False

    def _send(self, ranks: list[int], message: tuple) -> None:
        raise NotImplementedError

    def _wait(self, pending: set[int], timeout_s: float) -> dict[int, tuple]:
        """Replies that arrived within ``timeout_s`` from ranks in ``pending``."""
        raise NotImplementedError

    def _death(self) -> tuple[int, str] | None:
        """``(rank, how it died)`` of a rank that is gone, else None."""
        raise NotImplementedError

    def call(self, method: str, *args: Any, only: list[int] | None = None, every: bool = False,
             timeout_s: float | None = None, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` on every rank (or ``only`` these); rank 0's result, or with
        ``every`` all ranks' in rank order. A rank's exception is raised here once all ranks answered."""
        if self.broken or self.closed:
            raise RunFailed("the trainer group lost a rank (or was closed); rl-cli run --resume RUN_DIR continues")
        ranks = list(range(self.world)) if only is None else only
        self._send(ranks, (method, args, kwargs))
        with waiting_on("trainer_rank", f"{method}: ranks {ranks} of {self.world} have not answered") as wait:
            return self._collect(ranks, every, timeout_s, lambda pending: wait.update(
                f"{method}: ranks {sorted(pending)} of {self.world} have not answered"))

    def _collect(self, ranks: list[int], every: bool = False, timeout_s: float | None = None,
                 pending_now: Any = None) -> Any:
        """The answers of ``ranks`` (bounded by ``timeout_s`` when given; else the watchdog's ``stall_s``)."""
        pending, results, failures = set(ranks), {}, {}
        start, failed_at = time.monotonic(), None
        while pending:
            for rank, (status, value) in self._wait(pending, 0.5).items():
                pending.discard(rank)
                (results if status == "ok" else failures)[rank] = value
                failed_at = failed_at or (time.monotonic() if failures else None)
                if pending_now is not None:
                    pending_now(pending)
            death = self._death()
            if death is not None:
                self.broken = True
                raise RunFailed(f"trainer rank {death[0]} of {self.world} {death[1]}; its log: {self.logs[death[0]]}")
            stuck = failures and pending and time.monotonic() - failed_at > self.grace_s
            if stuck or (timeout_s is not None and pending and time.monotonic() - start > timeout_s):
                self.broken = True
                first = min(failures or pending)
                what = f"failed ({failures[first][0]}: {failures[first][2]})" if failures else "did not answer"
                raise RunFailed(f"trainer rank {first} of {self.world} {what} and ranks {sorted(pending)} are "
                                f"stuck; its log: {self.logs[first]}")
        if failures:
            rank = min(failures)
            name, usage, message = failures[rank]
            if usage:  # one line, no traceback; a failed run (out of memory) keeps its exit code
                raise (RunFailed if name == RunFailed.__name__ else UsageError)(message)
            raise RuntimeError(f"trainer rank {rank}: {name}: {message} (traceback in {self.logs[rank]})")
        return [results[r] for r in ranks] if every else results[ranks[0]]

    def _leave(self) -> None:
        """A healthy group leaves the weight-update group before its processes go."""
        if not self.broken and not self.closed:
            try:
                self.call("close", timeout_s=120)
            except (RunFailed, RuntimeError, UsageError):
                pass


class LocalRanks(_Ranks):
    """Ranks as child processes of the driver (``python -m posttrain.core.actors.trainer_rank``), each in
    its own session and told by the kernel to die with the driver (``procs.spawn``); their output goes to
    ``log_dir/trainer-rank<N>.log``."""

    def __init__(self, world: int, procs_per_node: int, config: dict[str, Any], load_args: dict[str, Any],
                 log_dir: str | Path, start_timeout_s: float = 600.0):
        import secrets
        import threading
        from multiprocessing.connection import Listener

        from posttrain.core.rollout.procs import free_port, spawn

        Path(log_dir).mkdir(parents=True, exist_ok=True)
        super().__init__(world, [str(Path(log_dir) / f"trainer-rank{r}.log") for r in range(world)])
        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        common = {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                  "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // procs_per_node)),
                  "POSTTRAIN_GROUP_DRIVER": f"127.0.0.1:{listener.address[1]}", "POSTTRAIN_GROUP_KEY": key.hex()}
        self.procs = [spawn([sys.executable, "-m", "posttrain.core.actors.trainer_rank", "--log", self.logs[r]],
                            self.logs[r], {**common, "RANK": str(r), "LOCAL_RANK": str(r % procs_per_node)})
                      for r in range(world)]
        self.conns: dict[int, Any] = {}
        accepted: list[Any] = []

        def accept() -> None:
            for _ in range(world):
                try:
                    accepted.append(listener.accept())
                except OSError:  # closed: start-up failed
                    return

        threading.Thread(target=accept, daemon=True).start()
        deadline = time.monotonic() + start_timeout_s
        try:
            while len(self.conns) < world:
                while accepted:
                    conn = accepted.pop()
                    self.conns[pickle.loads(conn.recv_bytes())] = conn
                if (death := self._death()) is not None or time.monotonic() > deadline:
                    rank, how = death or (min(set(range(world)) - set(self.conns)), "did not connect in time")
                    raise RunFailed(f"trainer rank {rank} of {world} {how} while starting; its log: {self.logs[rank]}")
                time.sleep(0.05)
            self.call("__init__", config, load_args)
        except BaseException:
            self.broken = True
            self.close()
            raise
        finally:
            listener.close()

    def _send(self, ranks: list[int], message: tuple) -> None:
        data = pickle.dumps(message)
        for rank in ranks:
            try:
                self.conns[rank].send_bytes(data)
            except OSError:  # it died; _death() names it
                pass

    def _wait(self, pending: set[int], timeout_s: float) -> dict[int, tuple]:
        from multiprocessing.connection import wait

        conns = {self.conns[r]: r for r in pending}
        out = {}
        for conn in wait(list(conns), timeout_s):
            try:
                out[conns[conn]] = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the pipe closed: the process is exiting
                self.procs[conns[conn]].wait(5)
        return out

    def _death(self) -> tuple[int, str] | None:
        for rank, proc in enumerate(self.procs):
            if (code := proc.poll()) is not None:
                return rank, f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return None

    def close(self) -> None:
        from posttrain.core.rollout.procs import stop_process

        self._leave()
        if not self.broken:
            self._send(list(self.conns), ("__exit__", (), {}))
        for proc in self.procs:
            if self.broken and proc.poll() is None:  # may be stuck in a collective with the dead rank
                os.killpg(proc.pid, signal.SIGKILL)
            stop_process(proc, grace_s=10.0)
        for conn in self.conns.values():
            conn.close()
        self.closed = True


class RankActor:
    """A trainer rank as a Ray actor; its output goes to ``log_path`` (on its node)."""

    def __init__(self, rank: int, log_path: str):
        import ray

        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        print(f"trainer rank {rank} on Ray node {ray.get_runtime_context().get_node_id()}", flush=True)
        self.role = None

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it (rank 0 hosts torch.distributed's store)."""
        import ray

        from posttrain.core.rollout.procs import free_port

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def run(self, message: tuple) -> tuple[str, Any]:
        return answer(self.role, message, self._build)

    def _build(self, env: dict[str, str], config: dict[str, Any], load_args: dict[str, Any]) -> None:
        os.environ.update(env)
        self.role = build_role(config, load_args)


class RayRanks(_Ranks):
    """Ranks as Ray actors on ``placement_group``: rank ``r`` in bundle ``r // procs_per_node`` (a bundle
    per node), one CPU and ``gpus_per_rank`` GPUs each; ``MASTER_ADDR`` is rank 0's node."""

    def __init__(self, world: int, procs_per_node: int, config: dict[str, Any], load_args: dict[str, Any],
                 log_dir: str | Path, placement_group: Any, gpus_per_rank: float = 0):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as InGroup

        super().__init__(world, [str(Path(log_dir) / f"trainer-rank{r}.log") for r in range(world)])
        self.actors = [ray.remote(RankActor).options(
            num_cpus=1, num_gpus=gpus_per_rank,
            scheduling_strategy=InGroup(placement_group, placement_group_bundle_index=r // procs_per_node),
        ).remote(r, self.logs[r]) for r in range(world)]
        self.refs: dict[int, Any] = {}
        self._gone: dict[int, str] = {}
        try:
            address, port = ray.get(self.actors[0].rendezvous.remote())
            for r in range(world):  # each rank's own environment, then one collective build
                self._send([r], ("__init__", ({"RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": address,
                                               "MASTER_PORT": str(port), "LOCAL_RANK": "0" if gpus_per_rank else
                                               str(r % procs_per_node)}, config, load_args), {}))
            self._collect(list(range(world)))
        except BaseException:
            self.broken = True
            self.close()
            raise

    def _send(self, ranks: list[int], message: tuple) -> None:
        import ray

        ref = ray.put(message) if len(ranks) > 1 else message  # one copy in the object store for all
        for rank in ranks:
            self.refs[rank] = self.actors[rank].run.remote(ref)

    def _wait(self, pending: set[int], timeout_s: float) -> dict[int, tuple]:
        import ray

        refs = {self.refs[r]: r for r in pending}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        out = {}
        for ref in ready:
            try:
                out[refs[ref]] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._gone[refs[ref]] = f"died ({type(exc).__name__})"
        return out

    def _death(self) -> tuple[int, str] | None:
        return min(self._gone.items()) if self._gone else None

    def close(self) -> None:
        import ray

        self._leave()
        for actor in self.actors:
            ray.kill(actor)
        self.closed = True
