"""Rollout engine backends: the interface a ``posttrain_register_engines`` plugin implements.

An engine backend decides *what runs* behind SGLang's HTTP protocol: posttrain's own engine server
(``local``), real SGLang servers (``sglang``), servers someone else started (``external``), or a
third-party engine (vLLM, an HF ``generate`` server, ...). Everything else about engines is shared and
lives in :mod:`posttrain.core.rollout`: the client generators use, the router in front, the weight-sync
protocol, and :class:`~posttrain.core.rollout.fleet.EngineFleet`, which starts, watches and restarts
the servers a backend describes.

The run config selects a backend by name and passes the rest of the section to its ``Config``::

    rollout:
      engine: {name: local, device: cuda, compile: true}

A backend class::

    class MyEngine(EngineBackend):
        name = "my_engine"

        @dataclass
        class Config:
            device: str = "cuda"

        def launch(self, slot):              # one server per engine: its command line and environment
            return EngineLaunch([sys.executable, "-m", "my_engine.serve", slot.model_path,
                                 "--port", str(slot.port)])

The server a backend starts must answer SGLang's ``/health_generate`` and ``/generate`` (``input_ids``,
``sampling_params``, ``return_logprob``; ``meta_info.output_token_logprobs``, ``finish_reason``,
``weight_version``) and the weight-update endpoints of the modes in ``weight_sync_modes``
(``/update_weights_from_disk`` for ``disk``; ``/init_weights_update_group`` and
``/update_weights_from_distributed`` for ``distributed``; ``/update_weights_from_tensor`` for
``tensor``). ``posttrain.testing.EngineContract`` checks all of it against a live server.

Every server of a run is given the run's API key (``slot.api_key``, made by the fleet) and must require
``Authorization: Bearer KEY`` on every endpoint except ``/health*`` (SGLang's ``--api-key`` rule). Hand
the key over in the environment (``EngineLaunch.env``), never in argv: any local user can read another
process's command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.core.interfaces import Component

WEIGHT_SYNC_MODES = ("distributed", "tensor", "disk")
API_KEY_ENV = "POSTTRAIN_ENGINE_API_KEY"  # where engine servers (and the router) find the run's key


@dataclass
class EngineSlot:
    """What a backend needs to start engine ``index`` of a run.

    ``gpus``: the GPU indices of this process (before ``CUDA_VISIBLE_DEVICES`` mapping) that the
    engine may use, ``resources.gpus_per_engine`` of them, placed after the trainer's GPUs unless the
    run is colocated; empty on CPU-only placements. ``api_key``: the run's engine API key (see the
    module doc: pass it by environment).
    """

    index: int
    port: int
    host: str
    model_path: str
    seed: int
    resources: Any  # the run's ResourcesConfig (num_engines, gpus_per_engine, colocate, ...)
    gpus: list[int] = field(default_factory=list)
    api_key: str = field(default="", repr=False)
    model_pending: bool = False  # model_path is not written yet (a backend with waits_for_checkpoint only)
    weights_from_push: bool = False  # read model_path's config and tokenizer only (a backend with starts_without_weights)
    # the run's rollout sampling_params as its requests send them (SGLang's form, seeded if the run seeds): a backend
    # may prepare its kernels for them before it answers (the local engine's --warm-sampling); None: unknown
    sampling: dict[str, Any] | None = None
    exact: bool = False  # rollout.exact: the engine computes with core.exact's batch-invariant arithmetic


@dataclass
class EngineLaunch:
    """One engine server to start: its argv, extra environment, and the path probed for readiness."""

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/health_generate"


class EngineBackend(Component):
    """Base of every engine backend; every method has a working default except :meth:`launch`.

    Class attributes:

    - ``name``: the name the run config selects (``rollout.engine.name``).
    - ``weight_sync_modes``: the ``rollout.weight_sync`` modes its servers implement.
    - ``seeds_batch_rows``: a batched request with one ``sampling_params.sampling_seed`` seeds row ``j``
      with ``seed + j`` (posttrain's local engine does; SGLang does not, so seeded groups are sent one
      request per sample there).
    - ``merges_adapters``: its servers take LoRA adapter pairs in a weight push and merge them into the weights
      (``posttrain.core.lora.AdapterMerge``); a LoRA run then pushes adapters only. Otherwise merged weights.
    - ``flat_weight_buckets``: its servers take ``load_format: "flattened_bucket"`` on
      ``/update_weights_from_distributed`` (a bucket as one broadcast; ``weight_sync.flat_layout``).
    - ``waits_for_checkpoint``: its servers may be launched before their checkpoint exists
      (``EngineSlot.model_pending``): they get ready meanwhile (imports, device) and load ``model_path`` once
      that directory appears. The loop then starts them while the trainer builds and writes it (runs that
      are not colocated; the trainer writes the directory under another name and renames it in, so it
      appears whole).
    - ``starts_without_weights``: its servers can build the model from ``model_path``'s ``config.json`` and
      tokenizer alone, reading no weights (``EngineSlot.weights_from_push``; SGLang's ``--load-format dummy``),
      and take every weight from the run's first push, which comes before any generation. The run's
      ``hf-init`` then holds no weights (``core.hf_init``), and engines not colocated start before the
      trainer builds. Servers so started should refuse to generate after a push that left a weight unwritten.
    """

    name = ""
    weight_sync_modes: tuple[str, ...] = WEIGHT_SYNC_MODES
    exact_mode = False  # rollout.exact: its servers compute with core.exact's arithmetic (EngineSlot.exact)
    seeds_batch_rows = False
    flat_weight_buckets = False
    merges_adapters = False
    waits_for_checkpoint = False
    starts_without_weights = False

    @dataclass
    class Config:
        pass

    # ---------------------------------------------------------------- before start
    def check_config(self, run: Any, plugins: Any) -> list[str]:
        """Problems with this backend for ``run`` (a validated RunConfig), as ``key: reason`` lines
        reported with every other config error before anything starts. Default: none."""
        return []

    def on_gpu(self, resources: Any) -> bool:
        """Whether the engines hold their weights on GPUs (weight sync then uses NCCL or CUDA IPC, and
        the fleet asks the servers for memory figures). Default: ``resources.rollout_gpus > 0``."""
        return resources.rollout_gpus > 0

    def engine_gpus(self, resources: Any) -> list[int]:
        """The GPU indices (of this machine) its engines take, for placement checks: ``gpu_ids`` of every
        engine when :meth:`on_gpu`, else none. A backend whose servers run elsewhere gives none."""
        if not self.on_gpu(resources):
            return []
        return sorted({g for i in range(resources.num_engines) for g in gpu_ids(resources, i)})

    def ranks_per_engine(self, resources: Any) -> int:
        """Ranks one engine contributes to a distributed weight-update group (its TP size)."""
        return 1

    # ---------------------------------------------------------------- start
    def urls(self) -> list[str] | None:
        """URLs of engines that are already running (the fleet then starts nothing), or None."""
        return None

    def api_key(self) -> str | None:
        """The API key of engines that are already running (``urls()``); None: the fleet makes one."""
        return None

    def launch(self, slot: EngineSlot) -> EngineLaunch:
        """The server for engine ``slot.index``: argv and environment. The fleet starts it in its own
        session (dying with the driver), waits for ``health_path``, and restarts it when it dies. With
        ``slot.model_pending`` (only for a backend with ``waits_for_checkpoint``), the server must wait for
        ``slot.model_path`` to appear; with ``slot.weights_from_push`` (only for a backend with
        ``starts_without_weights``), it must not read weights from it."""
        raise NotImplementedError(f"engine backend {self.name!r} starts no servers; give urls() instead")

    # ---------------------------------------------------------------- weights
    def check_weights(self, url: str, api_key: str | None, buckets: Any) -> str | None:
        """``rollout.check_weights``: None when the engine at ``url`` holds exactly the tensors of
        ``buckets`` (``[(hf_name, tensor), ...]`` lists, as pushed), else the first difference ("tensor
        NAME: ..."). Default: the engine's ``/weights_checksum`` (posttrain's engine server)."""
        from posttrain.core.rollout.weight_check import engine_checksums, first_mismatch

        report = engine_checksums(url, api_key)
        if report is None:
            return f"{url} has no /weights_checksum; backend {self.name!r} cannot check weights"
        return first_mismatch(buckets, report)

    # ---------------------------------------------------------------- colocated memory
    def release_memory(self, url: str, tags: list[str] | None, api_key: str | None = None) -> None:
        """Free the engine's GPU memory (``tags``: ``weights``, ``kv_cache``; None: both) while a
        colocated trainer runs: SGLang's ``/release_memory_occupation``."""
        from posttrain.core.rollout.weight_sync import post_json

        post_json(url + "/release_memory_occupation", {"tags": tags} if tags else {}, api_key=api_key)

    def resume_memory(self, url: str, tags: list[str] | None, api_key: str | None = None) -> None:
        """Take the memory back (``/resume_memory_occupation``)."""
        from posttrain.core.rollout.weight_sync import post_json

        post_json(url + "/resume_memory_occupation", {"tags": tags} if tags else {}, api_key=api_key)


def gpu_ids(resources: Any, index: int) -> list[int]:
    """The GPUs of engine ``index``: ``gpus_per_engine`` of them, after the trainer's unless colocated."""
    first = 0 if resources.colocate else resources.trainer_gpus_per_node
    per = resources.gpus_per_engine
    return list(range(first + index * per, first + (index + 1) * per))


def placement_gpus(resources: Any, backend: Any) -> tuple[int, list[int]]:
    """``(GPUs the placement needs on this machine, the engines' GPU indices)``: the trainer's
    ``trainer_gpus_per_node`` first, then every engine's :func:`gpu_ids` (none for external or CPU engines)."""
    engines = sorted({g for i in range(resources.num_engines) for g in gpu_ids(resources, i)}) \
        if backend.urls() is None and backend.on_gpu(resources) else []
    return max([resources.trainer_gpus_per_node, *(g + 1 for g in engines)], default=0), engines


def gpu_shortfall(resources: Any, backend: Any, have: int) -> str | None:
    """The one-line error of a placement that needs more GPUs than the ``have`` this machine shows, or None."""
    need, engines = placement_gpus(resources, backend)
    if have >= need:
        return None
    hint = ("; on one GPU add resources.colocate=true (the engines share the trainer's GPU)"
            if not resources.colocate and resources.trainer_gpus_per_node <= have else "")
    return (f"resources: the placement needs {need} GPU(s) (trainer {resources.trainer_gpus_per_node}, engines on "
            f"{engines or 'none'}), this machine has {have}{hint}")

