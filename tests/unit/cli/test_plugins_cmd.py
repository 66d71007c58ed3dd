"""Every estimator, loss and correction is listed by `rl-cli plugins list` with its formula."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from posttrain.cli.main import app

ALGORITHMS = {
    "estimator": {"grpo": "std_g + epsilon", "dr_grpo": "r_i - mean_g", "rloo": "(n_g - 1)", "opo": "l_j r_j",
                  "remax": "r_greedy", "reinforce_plus_plus": "gamma^k", "reinforce_plus_plus_baseline": "whiten",
                  "gae": "delta_t", "gpg": "alpha", "grpo_passk": "r_max - r_2nd"},
    "loss": {"ppo_clip": "clip(ratio", "gspo": "exp(mean_t", "cispo": "-sg(clip(ratio", "gmpo": "exp(mean_t",
             "reinforce": "-A_t * logp_t"},
    "correction": {"tis": "clamp(exp(", "mis": "exp(sum_t", "icepop": "0 outside"},
}


def test_plugins_list_shows_each_formula():
    result = CliRunner().invoke(app, ["plugins", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = {(r["kind"], r["name"]): r for r in json.loads(result.output)}
    for kind, names in ALGORITHMS.items():
        for name, formula in names.items():
            row = rows[(kind, name)]
            assert formula in row["summary"], (name, row["summary"])
            assert row["distribution"] == "posttrain"


def test_plugins_show_prints_the_config():
    result = CliRunner().invoke(app, ["plugins", "show", "ppo_clip"])
    assert result.exit_code == 0 and "dual_clip" in result.output and "seq-mean-token-sum" in result.output


def test_run_config_reports_bad_algorithm_options_by_dotted_key():
    import pytest

    from posttrain.core.config import load_config
    from posttrain.core.errors import ConfigError

    data = {"estimator": {"name": "gae", "lam": 2.0}, "loss": {"name": "ppo_clip", "aggregation": "seq-mean"},
            "correction": {"name": "tis", "low": 3.0}}
    with pytest.raises(ConfigError) as info:
        load_config(None, data=data)
    text = str(info.value)
    for key in ("estimator.lam", "loss.aggregation", "correction.low"):
        assert key in text, text
    config = load_config(None, data={"estimator": "rloo", "loss": {"name": "cispo", "clip_high": 0.3},
                                     "correction": "icepop"})
    assert config.loss.config.clip_high == 0.3 and config.correction.name == "icepop"
