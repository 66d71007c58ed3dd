"""The SFT loop: epochs over labelled samples, one optimizer step per ``trainer.global_batch_size`` of
them, eval loss, checkpoints and resume as RL runs keep them, and an HF export at the end. No engine
starts. The trainer is the RL one (the trainer role of the run's executor, ``trainer.backend``)::

    for step in range(start, total):                     # total: data.epochs passes (or max_steps)
        batch = to_batch(samples of this step)           # the order depends on (seed, epoch) only
        metrics = trainer.train(batch)                   # the run's loss (``loss: sft``) over the mask
        eval loss / log / checkpoint at their intervals
    trainer.save_hf(RUN_DIR / "hf-final")                # config.json, safetensors, tokenizer
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from contextlib import ExitStack
from typing import Any

from posttrain.core.errors import UsageError
from posttrain.core.executors import EXECUTORS
from posttrain.core.metrics import MetricsWriter
from posttrain.plugins.modes.sft.data import SFTDataset, batch_indices, load_sft, steps_per_epoch, to_batch


def load_tokenizer(cfg: Any) -> Any:
    """The model's tokenizer (``model.tokenizer``, else ``model.path``; ``char``: posttrain's own)."""
    source = getattr(cfg.model.config, "tokenizer", None) or getattr(cfg.model.config, "path", None)
    if source == "char":
        from posttrain.core.char_tokenizer import make_tokenizer

        return make_tokenizer()
    if not source:
        raise UsageError("model: mode sft needs a tokenizer (model.tokenizer or model.path)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def total_steps(samples: int, cfg: Any, max_steps: int | None) -> int:
    """``data.epochs`` passes of ``ceil(samples / global_batch_size)`` steps, at most ``max_steps``."""
    total = cfg.data.epochs * steps_per_epoch(samples, cfg.trainer.global_batch_size)
    return min(total, max_steps) if max_steps else total


def eval_loss(trainer: Any, loss_fn: Any, data: SFTDataset, batch_size: int) -> float:
    """The run's loss over all of ``data`` under the current weights (no update): each chunk's loss is
    normalized by the whole set's token and sample counts, so the chunks sum to the set's loss in the
    loss's aggregation mode."""
    tokens, seqs = sum(e.trained for e in data.examples), len(data.examples)
    total = 0.0
    for start in range(0, len(data), batch_size):
        batch = to_batch(data.examples[start:start + batch_size])
        log_probs = trainer.log_probs(batch)
        value, _ = loss_fn(log_probs, log_probs, batch.advantages, batch.response_mask,
                           global_tokens=tokens, global_seqs=seqs)
        total += float(value)
    return total


async def train_sft(cfg: Any, plugins: Any, run: Any, mode: Any, resume: bool = False,
                    on_step: Any = None) -> dict[str, float]:
    """Run SFT for ``cfg`` (mode config ``mode``) in ``run`` (a RunDirectory); the last metrics."""
    tokenizer = load_tokenizer(cfg)
    train_set = load_sft(cfg.data.path, cfg.data, mode, tokenizer, run.base_dir)
    evals = {}
    for ds in cfg.eval.datasets:
        data = dataclasses.replace(cfg.data, input_key=ds.input_key, apply_chat_template=ds.apply_chat_template)
        evals[ds.name] = load_sft(ds.path, data, mode, tokenizer, run.base_dir)
        evals[ds.name].examples = evals[ds.name].examples[:ds.limit]
    loss_fn = cfg.loss.create(plugins)
    size, total = cfg.trainer.global_batch_size, total_steps(len(train_set), cfg, mode.max_steps)
    per_epoch = steps_per_epoch(len(train_set), size)
    executor = EXECUTORS[cfg.resources.executor](cfg, **plugins.load_args)
    last: dict[str, float] = {}
    with ExitStack() as stack:
        stack.callback(executor.close)
        trainer = executor.trainer()
        stack.callback(trainer.close)
        metrics_out = MetricsWriter(run.path, cfg.logging.tensorboard, cfg.logging.wandb, cfg.logging.wandb_project,
                                    cfg.to_dict())
        stack.callback(metrics_out.close)
        start = 0
        if resume:  # trainer state and step; the batches are a function of the step
            done = 0  # steps done: the 0-based index of the next one
            if (ckpt := run.latest_checkpoint()) is not None:
                trainer.load(str(ckpt / "trainer"))
                state = run.load_checkpoint(ckpt)
                if state.get("samples") != len(train_set):
                    raise UsageError(f"--resume {run.path}: the data has {len(train_set)} samples now, "
                                     f"{state.get('samples')} when the checkpoint was written")
                done = state["steps"]
            start = done
            metrics_out.truncate_after(done)
        for step in range(start, total):
            t0 = time.perf_counter()
            epoch, indices = batch_indices(len(train_set), size, step, cfg.seed, cfg.data.shuffle)
            batch = to_batch([train_set.examples[i] for i in indices])
            metrics = await asyncio.to_thread(trainer.train, batch)
            elapsed = time.perf_counter() - t0
            last = {**{f"train/{k}": v for k, v in metrics.items()}, "train/epoch": (step + 1) / per_epoch,
                    "train/samples": float(len(batch)), "train/trained_tokens": float(batch.response_mask.sum()),
                    "perf/step_time": elapsed, "perf/train_tokens_per_s": float(batch.lengths.sum()) / elapsed}
            final = step + 1 == total
            if evals and cfg.eval.interval and ((step + 1) % cfg.eval.interval == 0 or final):
                for name, data in evals.items():
                    last[f"eval/{name}/loss"] = await asyncio.to_thread(eval_loss, trainer, loss_fn, data, size)
            metrics_out.log(step + 1, last)  # steps are counted from 1 where a user meets them
            plugins.pm.hook.posttrain_on_step_end(step=step + 1, metrics=last)
            if on_step is not None and ((step + 1) % cfg.logging.interval == 0 or final):
                on_step(step, last, [])
            if cfg.checkpoint.interval and ((step + 1) % cfg.checkpoint.interval == 0 or final):
                run.save_checkpoint(step + 1, trainer.save, {"samples": len(train_set), "epoch": epoch},
                                    cfg.checkpoint.keep)
        trainer.save_hf(str(run.path / "hf-final"))
    return last
