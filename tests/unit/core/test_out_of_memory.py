"""A trainer pass out of GPU memory ends the run with one line naming the keys that shrink it (core.out_of_memory)."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.errors import RunFailed
from posttrain.core.out_of_memory import config_value, out_of_memory_text, passes_report_memory
from tests.conftest import ROOT

TORCH_TEXT = ("CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.20 "
              "GiB is free. Of the allocated memory 73.40 GiB is allocated by PyTorch")


def _run_config(*overrides):
    from posttrain.core.config import load_config
    from posttrain.core.plugins import load_plugins

    return load_config(ROOT / "examples" / "quickstart.yaml", list(overrides), plugins=load_plugins(autoload=False))


def test_the_line_names_the_allocation_the_device_and_each_key_with_its_value():
    run = _run_config("trainer.max_tokens_per_micro_batch=16384", "trainer.backend.log_probs_chunk_size=4096")
    keys = run.trainer.backend.cls.memory_keys
    text = out_of_memory_text("train", torch.OutOfMemoryError(TORCH_TEXT), run.to_dict(), keys,
                              "cuda:0 held 73.4 GiB (this process's tensors), 1.2 of 79.2 GiB free")
    assert "\n" not in text
    assert text.startswith("trainer: out of GPU memory in the train pass (tried to allocate 2.32 GiB; cuda:0 held 73.4")
    assert "take less: trainer.max_tokens_per_micro_batch (16384), trainer.backend" in text
    assert "micro_batch_size" not in text  # the token budget bounds the pass, not the sample count
    assert "trainer.backend.log_probs_chunk_size (4096)" in text and "trainer.backend.tp (1)" in text
    assert text.endswith("rl-cli run --resume RUN_DIR continues from the last checkpoint")


def test_keys_the_config_lacks_are_left_out_and_so_is_an_allocation_torch_did_not_name():
    config = {"trainer": {"micro_batch_size": 8, "max_tokens_per_micro_batch": None}}
    text = out_of_memory_text("log-prob", RuntimeError("out of memory"), config, ("trainer.backend.tp",))
    assert "take less: trainer.micro_batch_size (8);" in text and "max_tokens" not in text and "tp" not in text
    assert "tried to allocate" not in text and "()" not in text
    assert config_value(config, "trainer.micro_batch_size") == 8 and config_value(config, "trainer.x.y") is None


def test_inside_a_pass_out_of_memory_becomes_a_failed_run_and_other_errors_stay_themselves():
    run = _run_config()
    with pytest.raises(RunFailed) as caught:
        with passes_report_memory("log-prob", run, ("trainer.backend.log_probs_chunk_size",)):
            raise torch.OutOfMemoryError(TORCH_TEXT)
    assert caught.value.exit_code == 1 and isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert "in the log-prob pass" in str(caught.value) and "log_probs_chunk_size (1024)" in str(caught.value)
    with pytest.raises(ValueError, match="not memory"):
        with passes_report_memory("train", run):
            raise ValueError("not memory")
