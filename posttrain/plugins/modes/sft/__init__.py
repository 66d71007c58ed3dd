"""The ``sft`` run mode: supervised fine-tuning on labelled responses, no engines.

Modules (imported when the mode runs; this entry module stays light): ``data`` (rows -> token ids and
loss masks, chat templates, the batches of each epoch), ``loop`` (the training loop).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from posttrain import hookimpl, option
from posttrain.core.run_mode import RunMode


class SFTMode(RunMode):
    """Supervised fine-tuning: the trainer learns labelled responses; no engine starts.

    Reads ``data.path`` rows of ``prompt``/``response`` (``data.input_key``, ``response_key``) or chat
    ``messages`` (``messages_key``; the chat template applied, loss on the assistant turns only, every
    other turn masked), for ``data.epochs`` passes (shuffled per epoch with ``seed + epoch`` when
    ``data.shuffle``), one optimizer step per ``trainer.global_batch_size`` samples (micro-batches of
    ``micro_batch_size``, each packed into one row by the trainer backend). Pair it with ``loss: sft``
    (token-level cross-entropy, the aggregation modes of the RL losses). ``eval.datasets`` (rows of the
    same shapes) get their loss every ``eval.interval`` steps (``eval/<name>/loss``); checkpoints and
    ``--resume`` work as for RL runs; the final weights are written as an HF checkpoint to
    ``RUN_DIR/hf-final`` (``model.path`` of a following RL run)::

        mode: sft
        model: {name: qwen3, preset: tiny, tokenizer: char}
        data: {path: sft.jsonl, epochs: 3}
        loss: sft
        trainer: {global_batch_size: 64, micro_batch_size: 64, lr: 1.0e-3}
    """

    name = "sft"
    generates = False
    needed_to_train = ("model", "loss")
    smoke_overrides = ("mode.max_steps=2",)
    columns = (("loss", "train/loss", "{:.4f}"), ("grad norm", "train/grad_norm", "{:.3f}"),
               ("epoch", "train/epoch", "{:.2f}"), ("tok/s", "perf/train_tokens_per_s", "{:.0f}"),
               ("step s", "perf/step_time", "{:.2f}"))

    @dataclass
    class Config:
        response_key: str = option("response", help="key of the labelled response in prompt/response rows")
        messages_key: str = option("messages", help="key of chat messages (loss on the assistant turns)")
        add_eos: bool = option(True, help="end prompt/response samples (without a chat template) with the "
                                          "tokenizer's EOS, trained on, so the model learns to stop")
        max_len: int | None = option(None, ge=2, help="cut samples to this many tokens (None: keep them whole)")
        max_steps: int | None = option(None, ge=1, help="stop after this many optimizer steps "
                                                        "(None: data.epochs passes)")

    def check_config(self, run: Any, plugins: Any) -> list[str]:
        errors = []
        if not run.data.path:
            errors.append("data.path: required by mode sft (the labelled rows to train on)")
        if run.trainer.kl_loss_coef:
            errors.append("trainer.kl_loss_coef: mode sft has no reference log-probs for a KL term; set 0")
        if run.trainer.steps_per_rollout != 1:
            errors.append("trainer.steps_per_rollout: mode sft takes one optimizer step per global_batch_size "
                          "samples; set 1")
        return errors

    def inspect_data(self, run: Any) -> tuple[str | None, list[str]]:
        """The training rows and the eval sets, encoded as training will (tokenizer and chat template)."""
        from posttrain.core.data import DataError
        from posttrain.plugins.modes.sft.data import load_sft
        from posttrain.plugins.modes.sft.loop import load_tokenizer

        tokenizer, summaries, errors = load_tokenizer(run), [], []
        for ds in [None, *run.eval.datasets]:
            data = run.data if ds is None else dataclasses.replace(run.data, input_key=ds.input_key,
                                                                   apply_chat_template=ds.apply_chat_template)
            try:
                summaries.append(load_sft(ds.path if ds else run.data.path, data, self.config, tokenizer).summary())
            except DataError as exc:
                errors += exc.errors
        return (None if errors else "; ".join(summaries)), errors

    def total_steps(self, run: Any) -> int:
        """From the number of rows in ``data.path`` (bad or empty rows, dropped later, still counted)."""
        from pathlib import Path

        from posttrain.core.data import read_records, split_slice
        from posttrain.plugins.modes.sft.loop import total_steps

        local, rows = split_slice(run.data.path)
        records = list(read_records(Path(local)))
        return total_steps(len(records[rows] if rows is not None else records), run, self.config.max_steps)

    async def run(self, cfg: Any, plugins: Any, run: Any, resume: bool = False, on_step: Any = None,
                  on_phase: Any = None) -> dict[str, float]:
        from posttrain.plugins.modes.sft.loop import train_sft

        return await train_sft(cfg, plugins, run, self.config, resume=resume, on_step=on_step)


@hookimpl
def posttrain_register_modes(registry):
    registry.add(SFTMode)
