"""``rl-cli models``: list, verify (PASS, and FAIL on a wrong mapping), convert round trip, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

# A plausible mapping bug: k and v swapped in both directions, so HF -> Megatron -> HF still round-trips
# exactly and every shape fits. Only comparing logits catches it.
BROKEN_SPEC = textwrap.dedent('''
    from posttrain import hookimpl
    from posttrain.plugins.models.qwen3 import Qwen3Spec


    class SwappedKV(Qwen3Spec):
        """Qwen3 with k and v swapped (a deliberately wrong mapping)."""

        name = "qwen3_swapped_kv"
        model_types = ()

        def to_megatron(self, hf, mname, tensors):
            if mname.endswith("linear_qkv.weight"):
                tensors = [tensors[0], tensors[2], tensors[1]]
            return super().to_megatron(hf, mname, tensors)

        def to_hf(self, hf, mname, tensor):
            out = super().to_hf(hf, mname, tensor)
            if mname.endswith("linear_qkv.weight"):
                (q, tq), (k, tk), (v, tv) = out
                out = [(q, tq), (k, tv), (v, tk)]
            return out


    @hookimpl
    def posttrain_register_models(registry):
        registry.add(SwappedKV)
''')


def rl_cli(*args, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "posttrain.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_list_shows_families_and_presets():
    out = rl_cli("models", "list", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    presets = {(r["family"], r["preset"]) for r in rows}
    for want in [("qwen3", "qwen3-1.7B"), ("qwen2", "qwen2.5-7B"), ("llama3", "llama3-8B"), ("glm4", "glm4-9B"),
                 ("qwen3", "tiny"), ("qwen3_moe", "qwen3-30B-A3B"), ("qwen3_moe", "qwen3-235B-A22B"),
                 ("glm4_moe", "glm4.5-air"), ("glm4_moe", "glm4.5"), ("qwen3_moe", "tiny"), ("glm4_moe", "tiny")]:
        assert want in presets
    moe = next(r for r in rows if r["preset"] == "qwen3-30B-A3B")
    assert moe["experts"] == "128x768 top-8" and 3.3e9 < moe["active_params"] < 3.4e9 < 30e9 < moe["params"]
    table = rl_cli("models", "list")
    assert "qwen3-1.7B" in table.stdout and "HEADS/KV" in table.stdout and "glm4.5-air" in table.stdout


def test_verify_passes_and_a_swapped_mapping_fails(tiny_ckpts, tmp_path):
    path = str(tiny_ckpts("qwen3"))
    ok = rl_cli("models", "verify", path)
    assert ok.returncode == 0, ok.stderr
    assert "PASS" in ok.stdout and "exact" in ok.stdout
    plugin = tmp_path / "broken_spec.py"
    plugin.write_text(BROKEN_SPEC)
    bad = rl_cli("models", "verify", path, "--spec", "qwen3_swapped_kv", "--plugin", str(plugin))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL" in bad.stdout and "exact" in bad.stdout  # round trip fine, logits wrong


def test_convert_to_megatron_and_back_is_bit_exact(tiny_ckpts, tmp_path):
    from safetensors.torch import load_file

    path = tiny_ckpts("glm4")
    to_m = rl_cli("models", "convert", str(path), str(tmp_path / "m"), "--to", "megatron")
    assert to_m.returncode == 0, to_m.stderr
    assert (tmp_path / "m" / "posttrain_model.json").is_file() and (tmp_path / "m" / "metadata.json").is_file()
    back = rl_cli("models", "convert", str(tmp_path / "m"), str(tmp_path / "h"), "--to", "hf")
    assert back.returncode == 0, back.stderr
    a, b = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "h" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)



def test_convert_refuses_a_non_empty_output_directory(tiny_ckpts, tmp_path, megatron_tp1):
    from posttrain.core.errors import UsageError
    from posttrain.plugins.trainers.megatron.convert import hf_to_megatron_dir
    from tests.unit.plugins.trainers.megatron.train_helpers import spec_for

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "keep.txt").write_text("x")
    with pytest.raises(UsageError, match="not empty"):
        hf_to_megatron_dir(spec_for("qwen3", tiny_ckpts("qwen3")), tiny_ckpts("qwen3"), tmp_path / "m")


@pytest.mark.parametrize("args,message", [
    (["models", "verify", "/nonexistent"], "no config.json"),
    (["models", "convert", "/nonexistent", "/tmp/x", "--to", "hf"], "no such directory"),
    (["models", "convert", ".", "/tmp/x", "--to", "onnx"], "megatron"),
    (["models", "verify", "{ckpt}", "--spec", "qwen33"], "qwen3"),
    (["models", "verify", "{ckpt}", "--dtype", "fp8"], "bfloat16"),
])
def test_bad_input_is_one_line_exit_2(tiny_ckpts, args, message):
    args = [a.replace("{ckpt}", str(tiny_ckpts("qwen3"))) for a in args]
    out = rl_cli(*args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_convert_with_tp2_reshards_to_tp1_exactly(tiny_ckpts, tmp_path, megatron_tp1):
    """`--tp 2` runs under torchrun; the TP=2 dist-checkpoint converts back with TP=1 bit-exactly."""
    from safetensors.torch import load_file

    from posttrain.plugins.trainers.megatron.convert import megatron_dir_to_hf, read_meta
    from tests.unit.plugins.trainers.megatron.train_helpers import spec_for

    path = tiny_ckpts("qwen3")
    to_m = rl_cli("models", "convert", str(path), str(tmp_path / "m"), "--to", "megatron", "--tp", "2")
    assert to_m.returncode == 0, to_m.stderr
    megatron_dir_to_hf(spec_for("qwen3"), tmp_path / "m", tmp_path / "h", read_meta(tmp_path / "m")["hf_config"])
    a, b = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "h" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
