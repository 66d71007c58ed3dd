"""The posttrain plugin contract: every hook a plugin may implement.

A plugin is a module (or object) with functions decorated by ``posttrain.hookimpl`` whose names match
the hooks below. It reaches posttrain in one of three ways:

- an entry point in the ``posttrain`` group of an installed distribution (our own built-ins are declared
  exactly so, in posttrain's pyproject)::

      [project.entry-points.posttrain]
      my_reward = "posttrain_my_reward"

- a file passed on the command line: ``rl-cli run cfg.yaml --plugin my_reward.py``;
- ``load_plugins(plugin_files=[...])`` from Python.

Every process (the driver, each Ray actor, each engine server) builds its own plugin manager from the
installed entry points, so a plugin that is installed works everywhere without being pickled.

Rules for plugin authors:

- Entry modules stay import-light: no ``torch``, ``torch.distributed``, Megatron, SGLang or Ray at
  module level. Import them inside methods; ``rl-cli plugins list`` and ``--help`` import every entry
  module and must stay fast.
- Hooks are called with keyword arguments. An implementation may accept a subset of the arguments
  (pluggy's opt-in arguments); never give defaults to arguments you expect to receive.
- Registration hooks add **named components** to a registry: ``registry.add(MyEstimator)``. The name
  is the class attribute ``name`` (or ``registry.add(obj, name="...")``). Names are unique per kind
  across all plugins; a duplicate stops start-up and names both providers.
- A component class carries a nested dataclass ``Config`` (see ``posttrain.core.schema``). The run config
  selects a component by ``name:`` and passes the remaining keys of that section to its ``Config``;
  unknown keys, wrong types and out-of-range values are reported before anything starts.
- Registration hooks fire once per process, inside ``load_plugins()``, after every plugin module has
  been imported and before any config is validated. They must not start work or touch devices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import typer

    from posttrain.core.config import RunConfig
    from posttrain.core.interfaces import Finding
    from posttrain.core.plugins import Plugins
    from posttrain.core.registry import Registry

PROJECT = "posttrain"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def posttrain_register_estimators(registry: Registry) -> None:
    """Add advantage estimators.

    :param registry: the estimator registry; call ``registry.add(EstimatorClass)``.

    An estimator subclasses ``posttrain.api.Estimator``: ``name``, a ``Config`` dataclass, and the method
    ``advantages(batch: AdvantageBatch) -> (advantages, returns)``, both ``[B, T]`` float tensors that are
    exactly 0 where ``batch.response_mask`` is 0. It declares what the loop must compute for it beyond
    rewards as one value, ``needs = posttrain.api.EstimatorNeeds(critic=..., log_probs=..., teacher=...,
    baseline_sampling=...)`` (default: nothing more). Without ``log_probs`` the loop may take the old
    policy's log-probs from the train step, after the estimator has run, and pass None
    (``posttrain.core.batching.old_log_probs_from_train``). It is constructed as
    ``Estimator(Estimator.Config(...))``.

    Fires once per process inside ``load_plugins()``. Use in ``--plugin`` files: yes.
    """


@hookspec
def posttrain_register_losses(registry: Registry) -> None:
    """Add policy losses (PPO clip, GSPO, CISPO, ...).

    :param registry: the loss registry; call ``registry.add(LossClass)``.

    A loss satisfies ``posttrain.api.Loss`` (a Protocol). It is constructed as ``Loss(Loss.Config(...))`` and
    called as
    ``loss_fn(log_probs, old_log_probs, advantages, response_mask, is_weights=None, global_tokens=None,
    global_seqs=None)``, tensors ``[B, T]``, returning ``(loss, metrics)``: a scalar tensor with gradient
    and a ``dict[str, float]`` (at least ``clipfrac``, ``approx_kl``, ``ratio_mean``). A micro-batch passes
    the whole batch's token and sequence counts (``posttrain.core.losses.batch_counts``) so that the sum of
    micro-batch losses equals the full-batch loss. Subclass ``posttrain.core.losses.PolicyLoss`` to get the
    shape checks, IS weights, aggregation modes and metrics for free (``posttrain.api.PolicyLoss``).

    Fires once per process inside ``load_plugins()``. Use in ``--plugin`` files: yes.
    """


@hookspec
def posttrain_register_corrections(registry: Registry) -> None:
    """Add rollout/training mismatch corrections (truncated or masked importance sampling).

    :param registry: the correction registry; call ``registry.add(CorrectionClass)``.

    A correction satisfies ``posttrain.api.Correction`` (a Protocol). It is constructed from its ``Config``
    and called as
    ``correction(train_log_probs, rollout_log_probs, response_mask)`` (all ``[B, T]``), returning
    ``(is_weights [B, T], metrics)``; the policy loss multiplies its per-token terms by ``is_weights``.

    Fires once per process inside ``load_plugins()``. Use in ``--plugin`` files: yes.
    """


@hookspec
def posttrain_register_rewards(registry: Registry) -> None:
    """Add reward functions.

    :param registry: the reward registry; call ``registry.add(RewardClass)``.

    A reward satisfies ``posttrain.api.Reward`` (a Protocol). It is constructed as
    ``Reward(Reward.Config(...))`` and called with one ``Sample``
    (``scope = "sample"``, the default) or a whole group ``list[Sample]`` (``scope = "group"``).
    It returns a float, or a dict of named floats with the key ``"score"`` (group rewards return one
    such value per sample). ``async def __call__`` is allowed and preferred for I/O.

    Fires once per process inside ``load_plugins()``. Use in ``--plugin`` files: yes.
    """


@hookspec
def posttrain_register_generators(registry: Registry) -> None:
    """Add rollout generators (single-turn, multi-turn, agents).

    :param registry: the generator registry; call ``registry.add(GeneratorClass)``, or
        ``registry.add(async_function, name="...")`` for a generator without options.

    A generator satisfies ``posttrain.api.Generator`` (a Protocol). It is called as
    ``await generator(group: list[Sample], engine: EngineClient, sampling: SamplingParams) -> list[Sample]``
    and may return more samples than it got (fan-out keeps ``group_index``). It builds each request's
    ``sampling_params`` with ``sampling.for_sample(sample, turn)`` (or ``sampling.for_group(group)`` for
    one batched request), so that runs with ``rollout.seed_sampling`` draw the same tokens again.

    Fires once per process inside ``load_plugins()``. Use in ``--plugin`` files: yes.
    """


@hookspec
def posttrain_register_models(registry: Registry) -> None:
    """Add model specs: the mapping between an HF model family and Megatron-core.

    :param registry: the model-spec registry; call ``registry.add(ModelSpecClass)``.

    A spec subclasses ``posttrain.api.ModelSpec`` (``posttrain.core.model_spec``: config, presets,
    ``hf_config()``). It maps an HF ``config.json`` to a Megatron ``TransformerConfig`` and layer spec, and
    HF tensor names and shapes to Megatron's and back; the built-in specs implement that mapping as
    ``posttrain.plugins.trainers.megatron.spec.DenseGPTSpec``.

    Fires once per process inside ``load_plugins()``. Use in ``--plugin`` files: yes.
    """


@hookspec
def posttrain_register_filters(registry: Registry) -> None:
    """Add dynamic-sampling filters (e.g. DAPO's ``nonzero_std``).

    :param registry: the filter registry; call ``registry.add(FilterClass)``.

    A filter satisfies ``posttrain.api.Filter`` (a Protocol). It is constructed from its ``Config`` and
    called with a completed, rewarded group
    ``list[Sample]``; it returns ``None`` to keep the group or a short reason string to drop it
    (reasons are counted in the metrics).

    Fires once per process inside ``load_plugins()``. Use in ``--plugin`` files: yes.
    """


@hookspec
def posttrain_register_tools(registry: Registry) -> None:
    """Add tools that multi-turn generators may call.

    :param registry: the tool registry; call ``registry.add(tool_callable, name="search")``.

    A tool satisfies ``posttrain.api.Tool`` (a Protocol): a plain (sync or async) callable taking the tool call's JSON arguments as keywords and
    returning a string shown to the model. It runs with the generator's per-tool timeout; an exception
    is returned to the model as error text rather than ending the rollout.

    Fires once per process inside ``load_plugins()``. Use in ``--plugin`` files: yes.
    """


@hookspec
def posttrain_register_engines(registry: Registry) -> None:
    """Add rollout engine backends: what runs behind SGLang's HTTP protocol.

    :param registry: the engine registry; call ``registry.add(EngineBackendClass)``.

    A backend subclasses ``posttrain.api.EngineBackend`` (``posttrain.core.rollout.backend``) and is constructed as
    ``Backend(Backend.Config(...))`` from the run config's ``rollout.engine`` section. It owns its config,
    the launch of each engine server (``launch(slot) -> EngineLaunch``: argv, environment, health path) or
    the URLs of running ones (``urls()``), the weight-update modes its servers implement
    (``weight_sync_modes``), memory release/resume for colocation, and ``check_config(run, plugins)`` for config
    errors found before start. The fleet (``posttrain.core.rollout.fleet``) starts, watches and restarts
    the servers and puts sglang-router in front; generators reach them only through ``EngineClient``.
    Built-ins: ``local`` (posttrain's engine server), ``sglang`` (real SGLang servers), ``external``
    (running servers by URL). ``posttrain.testing.EngineContract`` checks a live server.

    Fires once per process inside ``load_plugins()``. Use in ``--plugin`` files: yes, but the servers a
    backend launches are separate processes: they import what their command line names.
    """


@hookspec
def posttrain_register_trainers(registry: Registry) -> None:
    """Add trainer backends: the model the loop trains.

    :param registry: the trainer registry; call ``registry.add(TrainerBackendClass)``.

    A backend subclasses ``posttrain.api.TrainerBackend`` (``posttrain.core.trainer_backend``) and is constructed as
    ``Backend(Backend.Config(...))`` from ``trainer.backend``; ``build(spec, run, role, seed)`` returns the
    model of one role (``actor`` or ``critic``) with ``log_probs``, ``values``, ``train_step``,
    ``export_hf``, ``save_hf``, ``save`` and ``load`` (the interface is documented in that module). It owns
    model build, log-probs, the train step (adding KL and entropy through ``core.losses.total_loss``),
    checkpoints, HF export and the sending side of weight sync (HF-named tensor buckets). Built-in:
    ``megatron``. ``posttrain.testing.TrainerContract`` checks a backend on the tiny model.

    Fires once per process inside ``load_plugins()``. Use in ``--plugin`` files: yes.
    """


@hookspec
def posttrain_register_modes(registry: Registry) -> None:
    """Add run modes: what ``rl-cli run`` does with a config (RL, SFT, ...).

    :param registry: the mode registry; call ``registry.add(ModeClass)``.

    A mode subclasses ``posttrain.api.RunMode`` (``posttrain.core.run_mode``) and is constructed as ``Mode(Mode.Config(...))``
    from the run config's ``mode`` section (``mode: sft`` or ``{name: sft, ...}``; left out: the mode
    registered with ``is_default = True``, the RL loop). It declares which sections a run needs and
    whether it generates with engines (so the rollout batch identity applies), and runs the whole
    run: ``await mode.run(cfg, plugins, run_dir, resume=..., on_step=...)``. Built-ins: ``rl`` (the loop of
    ``posttrain.core.loop``) and ``sft`` (labelled data, no engines).

    Fires once per process inside ``load_plugins()``. Use in ``--plugin`` files: yes.
    """


@hookspec
def posttrain_register_commands(app: typer.Typer) -> None:
    """Add sub-commands to ``rl-cli``.

    :param app: the root Typer application; call ``app.command()(fn)`` or ``app.add_typer(sub, name=...)``.

    Fires once when ``rl-cli`` starts, after the built-in commands exist. Keep it import-light: it runs
    for every ``rl-cli`` invocation, ``--help`` included. Use in ``--plugin`` files: no (commands are
    built before options are parsed).
    """


@hookspec
def posttrain_doctor_checks(run: RunConfig, plugins: Plugins) -> list[Finding]:
    """Check this machine for a run: what ``rl-cli doctor`` reports beside its own checks.

    :param run: the validated run config (``run.rewards``, ``run.rollout``, ...).
    :param plugins: the loaded plugins (registries and hooks).
    :return: ``posttrain.api.Finding`` rows (``ok``, ``area``, ``message``, ``note``); an empty list when
        nothing of this plugin is in the run. A failed finding makes ``doctor`` exit 2.

    Fires once per ``rl-cli doctor``, after the config is valid; it must not start work that outlives it.
    Import what a check needs inside the hook. Use in ``--plugin`` files: yes.
    """


@hookspec
def posttrain_on_step_end(step: int, metrics: dict) -> None:
    """Observe the loop: called after every training step, once its metrics are final.

    :param step: the step just finished, counted from 1 (its ``step`` in ``metrics.jsonl``).
    :param metrics: every metric of the step (``rollout/...``, ``train/...``, ``perf/...``), as written
        to ``metrics.jsonl``. Treat it as read-only.

    Fires in the driver process after each step's weights reached the engines, before checkpoints.
    Use it for custom loggers and alerts; an exception stops the run. Use in ``--plugin`` files: yes.
    """
