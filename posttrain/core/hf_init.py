"""``RUN_DIR/hf-init``: the model files a run's engines start from, written from the model spec alone.

An engine needs the model's ``config.json`` and its tokenizer; its weights come from the trainer's first push,
which the loop makes before any generation. So a run writes only those files here (:func:`write_model_files`:
no trainer, milliseconds), and engines whose backend can start without weights
(``EngineBackend.starts_without_weights``: posttrain's engine builds the model from the config, SGLang loads
``--load-format dummy``) read nothing else. Engines that do not share the trainer's GPUs then start on these
files before the trainer has built, and load, compile and capture while it builds.

``checkpoint.hf_init_weights: true``, or an engine backend that must read weights, has the trainer write the
initial policy's safetensors here too (``save_hf``), and the engines load them. That write and read sit on the
run's start (seconds at 1.7B on a GPU host) and keep a copy of the model in the run directory (60 GB at 30B).

- :func:`config_json`: the ``config.json`` mapping every writer uses (the trainer's ``save_hf`` too);
- :func:`write_tokenizer`: the tokenizer and the checkpoint's companion files (generation config, chat
  template) beside it;
- :func:`write_model_files`: both, into a directory that appears whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

# files of an HF checkpoint besides config.json and the weights, carried from the source checkpoint
HF_EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                  "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                  # a vision-language model's image processor and processor
                  "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def config_json(spec: Any, hf: dict[str, Any], dtype: str) -> dict[str, Any]:
    """``config.json`` for ``spec``'s model: its HF config ``hf`` (``spec.hf_config()``), the architecture and
    ``model_type`` where ``hf`` names none, and ``torch_dtype`` = ``dtype`` (the weights' dtype: an engine on a GPU
    serves in it)."""
    out = dict(hf)
    out.setdefault("architectures", [spec.hf_architecture])
    out.setdefault("model_type", spec.model_types[0] if spec.model_types else spec.name)
    out["torch_dtype"] = dtype
    return out


def write_tokenizer(spec: Any, out_dir: str | Path) -> None:
    """The tokenizer and companion files of ``spec``'s model into ``out_dir``: :data:`HF_EXTRA_FILES` found in
    ``model.path``, then ``model.tokenizer`` when set (``char``: posttrain's character tokenizer, unless one is
    there already; else a tokenizer directory or hub name, saved through transformers)."""
    out = Path(out_dir)
    source = spec.config.path
    if source and Path(source).is_dir():
        for name in HF_EXTRA_FILES:
            if (Path(source) / name).is_file():
                shutil.copy(Path(source) / name, out / name)
    tokenizer = spec.config.tokenizer
    if tokenizer == "char" and not (out / "tokenizer.json").exists():
        from posttrain.core.char_tokenizer import make_tokenizer

        make_tokenizer(out)
    elif tokenizer and tokenizer != "char":
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(str(out))


def write_model_files(spec: Any, out_dir: str | Path) -> Path:
    """``config.json`` (:func:`config_json` at ``model.dtype``) and the tokenizer (:func:`write_tokenizer`) of
    ``spec``'s model, no weights. Written beside ``out_dir`` and renamed to it (whatever was there is removed),
    so an engine waiting for ``out_dir`` sees all of it or nothing."""
    out = Path(out_dir)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    (partial / "config.json").write_text(json.dumps(config_json(spec, spec.hf_config(), spec.config.dtype), indent=2))
    write_tokenizer(spec, partial)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)
    return out
