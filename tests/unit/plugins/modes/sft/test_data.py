"""The SFT mode's data path and config: rows -> tokens and masks, errors by file:line, the batch order
of each epoch, and what validation asks of an SFT config."""

from __future__ import annotations

import json

import pytest

from posttrain.core.config import DataConfig, load_config
from posttrain.core.data import DataError
from posttrain.core.errors import ConfigError
from posttrain.core.plugins import load_plugins
from posttrain.plugins.modes.sft import SFTMode
from posttrain.plugins.modes.sft.data import batch_indices, load_sft, to_batch


@pytest.fixture(scope="module")
def tok():
    from posttrain.testing.tiny import make_tokenizer

    return make_tokenizer()


def _rows(write, rows, name="d.jsonl"):
    return write(name, "".join(json.dumps(r) + "\n" for r in rows))


def test_every_bad_row_is_reported_with_its_line(write, tok):
    path = _rows(write, [{"prompt": "1+1=", "response": "2"}, {"prompt": "1+2="}, {"messages": "hi"},
                         {"prompt": "", "response": "3"}, {"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(DataError) as info:
        load_sft(str(path), DataConfig(), SFTMode.Config(), tok)
    errors = info.value.errors
    assert [e.split(": ")[0].rsplit(":", 1)[1] for e in errors] == ["2", "3", "4", "5"]
    assert "needs 'messages' (chat messages) or 'prompt' and 'response'" in errors[0]
    assert "no assistant turn to train on" in errors[3]
    skipped = load_sft(str(path), DataConfig(on_bad_row="skip"), SFTMode.Config(), tok)
    assert len(skipped) == 1 and skipped.skipped == 4


def test_chat_template_prompts_and_max_len(write, tok):
    path = _rows(write, [{"prompt": "12+30=", "response": "42"}])
    chat = load_sft(str(path), DataConfig(apply_chat_template=True), SFTMode.Config(), tok).examples[0]
    assert tok.decode(chat.tokens).startswith("<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode([t for t, m in zip(chat.tokens, chat.mask) if m]) == "42<|im_end|>\n"
    cut = load_sft(str(path), DataConfig(), SFTMode.Config(max_len=7), tok)
    assert cut.truncated == 1 and len(cut.examples[0].tokens) == 7 and sum(cut.examples[0].mask) == 1
    with pytest.raises(DataError, match="no samples to train on"):
        load_sft(str(path), DataConfig(), SFTMode.Config(max_len=6), tok)  # only the prompt would be left


def test_epochs_visit_every_sample_once_in_a_seeded_order():
    seen = [batch_indices(10, 4, step, seed=3, shuffle=True) for step in range(6)]
    assert [epoch for epoch, _ in seen] == [0, 0, 0, 1, 1, 1]
    for epoch in (0, 1):
        assert sorted(i for e, idx in seen if e == epoch for i in idx) == list(range(10))
    assert [idx for _, idx in seen[:3]] != [idx for _, idx in seen[3:]]  # reshuffled per epoch
    assert batch_indices(10, 4, 4, seed=3, shuffle=True) == seen[4]  # a function of the step: resume-safe
    assert batch_indices(10, 4, 2, seed=3, shuffle=False) == (0, [8, 9])


def test_batch_trains_on_the_mask_only(write, tok):
    path = _rows(write, [{"prompt": "1+1=", "response": "2"}, {"prompt": "9+9=", "response": "18"}])
    batch = to_batch(load_sft(str(path), DataConfig(), SFTMode.Config(add_eos=False), tok).examples)
    assert batch.lengths.tolist() == [5, 6]
    assert batch.response_mask.tolist() == [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]]
    assert (batch.advantages == batch.response_mask).all()


SFT = """
mode: sft
model: {name: qwen3, preset: tiny, tokenizer: char}
data: {path: d.jsonl}
loss: sft
trainer: {global_batch_size: 5, micro_batch_size: 5}
"""


def test_an_sft_config_needs_no_estimator_and_no_rollout_batch_identity(write):
    plugins = load_plugins()
    write("d.jsonl", '{"prompt": "1+1=", "response": "2"}\n')
    cfg = load_config(write("c.yaml", SFT), plugins=plugins)
    assert cfg.mode.name == "sft" and cfg.estimator is None and cfg.missing_for_training() == []
    with pytest.raises(ConfigError) as info:  # the RL mode still asks for both
        load_config(write("rl.yaml", SFT.replace("mode: sft", "mode: rl")), plugins=plugins)
    assert "estimator: required key is missing" in info.value.errors
    assert any("batch identity violated" in e for e in info.value.errors)
    with pytest.raises(ConfigError) as info:
        load_config(write("bad.yaml", SFT.replace("data: {path: d.jsonl}\n", "")
                          .replace("micro_batch_size: 5}", "micro_batch_size: 5, kl_loss_coef: 0.1}")),
                    plugins=plugins)
    assert "data.path: required by mode sft (the labelled rows to train on)" in info.value.errors
    assert any(e.startswith("trainer.kl_loss_coef: mode sft") for e in info.value.errors)
    assert not any("batch identity" in e for e in info.value.errors)


def test_dry_run_checks_sft_rows_as_the_mode_reads_them(tmp_path):
    import subprocess
    import sys

    (tmp_path / "d.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "1+1="},
                                                               {"role": "assistant", "content": "2"}]}) + "\n")
    (tmp_path / "c.yaml").write_text(SFT)

    def dry_run():
        return subprocess.run([sys.executable, "-m", "posttrain.cli.main", "run", "c.yaml", "--dry-run"],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120)

    out = dry_run()  # chat rows have no `prompt` key: not prompt data, and not an error here
    assert out.returncode == 0, out.stderr
    assert "data OK: d.jsonl: 1 samples, 26 tokens (3 trained)" in " ".join(out.stdout.split())
    with (tmp_path / "d.jsonl").open("a") as f:
        f.write('{"messages": []}\n')
    out = dry_run()
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "d.jsonl:2: 'messages' must be a non-empty list of chat messages" in " ".join(out.stderr.split())
