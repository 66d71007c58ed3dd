"""Start-up order: which of the trainer, the engines and their checkpoint (``RUN_DIR/hf-init``) comes first.

The engines start from ``hf-init``: the model's config and tokenizer (:func:`core.hf_init.write_model_files`),
with the trainer's initial weights too when the engine backend must read weights or ``checkpoint.hf_init_weights``
asks for them. Model files alone can be written before the trainer builds; weights only after. Engines that need
not size their memory beside the trainer start on the files at once; a backend that can wait for its checkpoint
(``waits_for_checkpoint``) launches before ``hf-init`` exists and imports meanwhile. Colocated engines load in the
room the trainer leaves: beside it, or (``resources.offload_trainer``) after its offload, so their checkpoint is
written under ``hf-init.staged`` and renamed into place only then.

:class:`StartupOrder` names the decision; :func:`start_roles` carries it out and returns the roles.
"""

from __future__ import annotations

import enum
import os
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from posttrain.core.hf_init import write_model_files
from posttrain.core.rollout.teacher import launch_teacher


class InitCheckpoint(enum.Enum):
    """What ``hf-init`` holds and when it is written."""

    FILES_BEFORE_TRAINER = "model files, before the trainer builds"  # weights come with the first push
    FILES_AFTER_TRAINER = "model files, once the trainer has built"  # colocated: engines size beside the trainer
    TRAINER_WEIGHTS = "the trainer's initial weights, once it has built"


class EngineStart(enum.Enum):
    """When the engine role launches."""

    AWAITING_CHECKPOINT = "before the trainer, before hf-init exists"  # they import meanwhile, load it when whole
    ON_MODEL_FILES = "before the trainer, on hf-init's model files"
    AFTER_TRAINER = "after the trainer, on a finished hf-init"


@dataclass(frozen=True)
class StartupOrder:
    """The start-up decision. ``staged``: ``hf-init`` is written under ``hf-init.staged`` and renamed into place
    after the trainer's offload (engines already waiting must not load it while the trainer's state is on the
    device)."""

    init: InitCheckpoint
    engines: EngineStart
    staged: bool

    @classmethod
    def decide(cls, backend: Any, engines_before_trainer: bool, hf_init_weights: bool, colocate: bool,
               offload: bool) -> StartupOrder:
        """From the engine backend's abilities, the executor's (``engines_before_trainer``) and the config."""
        if not backend.starts_without_weights or hf_init_weights:
            init = InitCheckpoint.TRAINER_WEIGHTS
        elif colocate:
            init = InitCheckpoint.FILES_AFTER_TRAINER
        else:
            init = InitCheckpoint.FILES_BEFORE_TRAINER
        files_first = init is InitCheckpoint.FILES_BEFORE_TRAINER
        if not engines_before_trainer or not (files_first or backend.waits_for_checkpoint):
            engines = EngineStart.AFTER_TRAINER
        elif backend.waits_for_checkpoint:
            engines = EngineStart.AWAITING_CHECKPOINT
        else:
            engines = EngineStart.ON_MODEL_FILES
        return cls(init, engines, staged=offload and engines is not EngineStart.AFTER_TRAINER)

    @property
    def weights_from_push(self) -> bool:
        """The engines read no weights from ``hf-init``: the first push gives them all."""
        return self.init is not InitCheckpoint.TRAINER_WEIGHTS

    @property
    def engines_first(self) -> bool:
        return self.engines is not EngineStart.AFTER_TRAINER


@dataclass
class Roles:
    """The run's processes once started. ``engines`` may still be loading (``wait_ready`` waits);
    ``teacher_role`` is None when the teacher starts later (``rollout.teacher.open_teacher``) or there is none;
    ``checkpoint``: the one a resume continues from, already checked against this run's model."""

    order: StartupOrder
    trainer: Any
    engines: Any
    teacher_role: Any
    init_dir: str
    checkpoint: Path | None


def start_roles(cfg: Any, plugins: Any, executor: Any, run: Any, stack: AsyncExitStack, resume: bool,
                phase: Callable[..., None]) -> Roles:
    """Start the engines, the teacher's engines and the trainer in ``StartupOrder``'s order; each role's close
    goes on ``stack`` as it starts (the trainer's last, so it runs first: it leaves the weight-update group while
    the engines still answer). ``phase(name, detail)`` marks each timed part."""
    order = StartupOrder.decide(cfg.rollout.engine.create(plugins), executor.engines_before_trainer,
                                cfg.checkpoint.hf_init_weights, cfg.resources.colocate, cfg.resources.offload_trainer)
    init_dir, spec = run.fresh_dir("hf-init"), cfg.model.create(plugins)
    engines = _launch_engines_first(order, spec, executor, init_dir, run, stack)
    teacher_role = launch_teacher(cfg, plugins, executor, run.logs)  # or None; loads its own checkpoint meanwhile
    if teacher_role is not None:
        stack.callback(teacher_role.close)
    phase("model", "the engines start beside it" if order.engines_first else "")
    trainer = executor.trainer(run.logs)  # one rank in this process, or a group of ranks
    if cfg.trainer.max_tokens_per_micro_batch == "auto":  # the number the trainer's memory plan chose
        phase("plan", trainer.micro_batch_plan())
    written = run.fresh_dir("hf-init.staged") if order.staged else init_dir
    if order.init is InitCheckpoint.FILES_AFTER_TRAINER:
        phase("model_files")
        write_model_files(spec, written)
    elif order.init is InitCheckpoint.TRAINER_WEIGHTS:
        phase("init_checkpoint")
        trainer.save_hf(written, replace=True)  # appears whole
    ckpt = run.latest_checkpoint() if resume else None
    if ckpt is not None:  # another model's checkpoint is refused before the first push
        run.check_resume(ckpt, cfg.to_dict(), written)
    if cfg.resources.offload_trainer:  # the engines load in the room the trainer's state leaves, as they will generate
        phase("offload")
        trainer.offload()
    if written != init_dir:  # only now may the engines that wait for it load it
        os.replace(written, init_dir)
    if engines is None:
        phase("engines")
        engines = executor.engines(init_dir, run.logs, weights_from_push=order.weights_from_push)
        stack.callback(engines.close)
    stack.callback(trainer.close)  # runs first: leaves the weight-update group while engines still answer
    return Roles(order, trainer, engines, teacher_role, init_dir, ckpt)


def _launch_engines_first(order: StartupOrder, spec: Any, executor: Any, init_dir: str, run: Any,
                          stack: AsyncExitStack) -> Any:
    """The engine role when it launches before the trainer (else None), with ``hf-init``'s model files written
    when they come first: before engines that read them at once, after engines that wait for them (those import
    meanwhile)."""
    files_first = order.init is InitCheckpoint.FILES_BEFORE_TRAINER
    awaiting = order.engines is EngineStart.AWAITING_CHECKPOINT
    if files_first and not awaiting:
        write_model_files(spec, init_dir)
    if not order.engines_first:
        return None
    engines = executor.engines(init_dir, run.logs, model_pending=awaiting, weights_from_push=order.weights_from_push,
                               wait=False)
    stack.callback(engines.close)
    if files_first and awaiting:
        write_model_files(spec, init_dir)
    return engines
