"""Images in the prompt data (``data.images_key``): every bad image named by file:line at validation, the prompt
given image slots, ``max_prompt_len`` counting image tokens, image-token expansion, and the local engine's refusal."""

from __future__ import annotations

import base64
import io
import json

import pytest


def _png(size=(56, 56), colour=(200, 30, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from posttrain.testing.tiny import make_tiny_vlm_checkpoint

    return make_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vlm") / "ckpt")


def _data(tmp_path, rows):
    (tmp_path / "img").mkdir(exist_ok=True)
    (tmp_path / "img" / "ok.png").write_bytes(_png())
    (tmp_path / "img" / "big.png").write_bytes(_png((200, 100)))
    (tmp_path / "img" / "junk.png").write_bytes(b"not an image at all")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(path, **kw):
    from posttrain.core.config import DataConfig

    return DataConfig(path=str(path), images_key="images", **kw)


def test_every_bad_image_is_reported_with_file_and_line(tmp_path):
    from posttrain.core.data import check_data

    inline = "data:image/png;base64," + base64.b64encode(_png()).decode()
    path = _data(tmp_path, [
        {"prompt": "a", "images": "img/ok.png"},                       # 1 fine (relative to the data file)
        {"prompt": "b", "images": "img/missing.png"},                  # 2 no such file
        {"prompt": "c", "images": ["img/ok.png", "img/junk.png"]},     # 3 the second is not an image
        {"prompt": "d", "images": "img/big.png"},                      # 4 200 x 100 > max_pixels
        {"prompt": "e", "images": "data:image/png;base64,@@@"},        # 5 not base64
        {"prompt": "f", "images": 7},                                  # 6 not a reference
        {"prompt": "g", "images": [inline, "img/ok.png"]},             # 7 fine: inline and a path
        {"prompt": "h"},                                               # 8 fine: text only
    ])
    errors = check_data(_cfg(path, max_pixels=56 * 56 * 2), base_dir=tmp_path)
    assert [e.split(": ", 1)[0] for e in errors] == [f"{path}:{n}" for n in (2, 3, 4, 5, 6)], errors
    assert "image not found" in errors[0] and "missing.png" in errors[0]
    assert "unreadable image" in errors[1] and "junk.png" in errors[1]
    assert "200x100 = 20000 pixels, more than data.max_pixels=6272" in errors[2]
    assert "not valid base64" in errors[3]
    assert "'images' must be an image path or base64 string" in errors[4]


def test_rows_get_image_slots_and_absolute_references(tmp_path):
    from posttrain.core.data import load_prompts

    path = _data(tmp_path, [{"prompt": "which colour?", "images": ["img/ok.png", "img/ok.png"]},
                            {"prompt": [{"role": "user", "content": [{"type": "image"},
                                                                     {"type": "text", "text": "x"}]}],
                             "images": "img/ok.png"},
                            {"prompt": [{"role": "user", "content": [{"type": "image"}]}],
                             "images": ["img/ok.png", "img/ok.png"]}])
    cfg = _cfg(path, on_bad_row="skip")
    data = load_prompts(cfg, base_dir=tmp_path)
    assert len(data) == 2 and data.skipped == 1 and "1 image item(s) for 2 image(s)" in data.errors[0]
    first = data[0]
    assert first.images == [str(tmp_path / "img" / "ok.png")] * 2
    assert first.prompt == [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                          {"type": "text", "text": "which colour?"}]}]
    assert data[1].prompt[0]["content"][0] == {"type": "image"} and len(data[1].images) == 1


def test_max_prompt_len_counts_image_tokens(tmp_path, vlm_dir):
    from transformers import AutoTokenizer

    from posttrain.core.data import load_prompts, prompt_length
    from posttrain.core.vision import ImageInputs

    path = _data(tmp_path, [{"prompt": "hi", "images": "img/ok.png"}, {"prompt": "hi"}])
    tokenizer, vision = AutoTokenizer.from_pretrained(vlm_dir), ImageInputs.from_dir(vlm_dir)
    text_len = prompt_length([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
                             tokenizer, {})
    assert vision.tokens_added([str(tmp_path / "img" / "ok.png")]) == 3  # 56 x 56: 4 image tokens for the 1
    kept = load_prompts(_cfg(path, apply_chat_template=True, max_prompt_len=text_len + 3), tokenizer, tmp_path, vision)
    assert len(kept) == 2 and kept.filtered == 0
    cut = load_prompts(_cfg(path, apply_chat_template=True, max_prompt_len=text_len + 2), tokenizer, tmp_path, vision)
    assert len(cut) == 1 and cut.filtered == 1 and cut[0].images is None
    assert "<|vision_start|><|image_pad|><|vision_end|>hi" in kept[0].prompt


def test_expand_image_tokens_once_and_accepts_them_expanded(vlm_dir, tmp_path):
    from posttrain.core.vision import ImageInputs

    (tmp_path / "a.png").write_bytes(_png((56, 56)))
    (tmp_path / "b.png").write_bytes(_png((112, 56)))
    vision, pad = ImageInputs.from_dir(vlm_dir), None
    pad = vision.image_token_id
    refs = [str(tmp_path / "a.png"), str(tmp_path / "b.png")]
    ids, pixels, grid = vision.expand([5, pad, 6, pad, 7], refs)
    assert grid.tolist() == [[1, 4, 4], [1, 4, 8]] and pixels.shape[0] == 16 + 32
    assert ids == [5] + [pad] * 4 + [6] + [pad] * 8 + [7]
    assert vision.expand(ids, refs)[0] == ids  # already expanded (as an engine receives it): kept
    (tmp_path / "c.png").write_bytes(_png((30, 500)))  # resized within the processor's pixel bounds
    refs.append(str(tmp_path / "c.png"))
    assert vision.token_counts(refs) == vision.counts(vision.pixels(refs)[1]) == [4, 8, 16]  # sizes alone suffice
    with pytest.raises(ValueError, match="holds 3 image tokens"):
        vision.expand([pad, pad, pad], refs[:2])


def test_the_local_engine_and_megatron_refuse_vision_language_runs(vlm_dir):
    from posttrain.core.config import ConfigError, load_config
    from posttrain.core.plugins import load_plugins

    plugins = load_plugins()
    data = {"estimator": "grpo", "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4},
            "trainer": {"global_batch_size": 16, "micro_batch_size": 4, "backend": {"name": "fsdp2"}}}
    base = ["model.name=hf", f"model.path={vlm_dir}"]
    for extra in ([], ["model.path=null", "data.images_key=images"]):
        with pytest.raises(ConfigError) as err:
            load_config(None, base + extra + ["rollout.engine.name=local"], plugins=plugins, data=data)
        assert err.value.errors == ["rollout.engine: the local engine serves text models only, not a vision-language "
                                    "model or images (data.images_key); use rollout.engine.name: hf (or sglang)"]
    load_config(None, base + ["rollout.engine.name=hf"], plugins=plugins, data=data)  # the hf engine serves it
    with pytest.raises(ConfigError) as err:  # and Megatron trains no images
        load_config(None, ["data.images_key=images", "rollout.engine.name=hf", "trainer.backend.name=megatron"],
                    plugins=plugins, data=data)
    assert err.value.errors == ["trainer.backend: megatron trains text models only; images (data.images_key) need "
                                "trainer.backend.name: fsdp2"]


def test_count_params_counts_the_language_model_and_the_vision_tower(vlm_dir):
    from safetensors import safe_open

    from posttrain.core.model_spec import count_params, read_hf_config

    with safe_open(str(vlm_dir / "model.safetensors"), "pt") as f:
        real = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    counted = count_params(read_hf_config(vlm_dir))
    assert abs(counted - real) <= 0.01 * real, (counted, real)  # biases are not counted


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
