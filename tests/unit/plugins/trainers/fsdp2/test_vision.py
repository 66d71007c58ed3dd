"""Vision-language models in the fsdp2 trainer with the hf engine: the trainer's log-probs of the engine's samples
(images, left padding, a text-only row, a generated image token) equal the engine's at step 0; the vision tower
stays frozen; a checkpoint resumes exactly; the HF export loads in transformers with its image processor and
answers as the trainer scores."""

from __future__ import annotations

import pytest
import torch

COLOURS = [(220, 30, 30), (30, 30, 220), (30, 200, 30)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """``(checkpoint dir, image references, engine, trainer backend, run config, plugins)``, shared."""
    from PIL import Image

    from posttrain.core.selection import Selection
    from posttrain.core.plugins import load_plugins
    from posttrain.plugins.engines.hf.generator import HFGenerator
    from posttrain.testing.contracts.trainer import run_config
    from posttrain.testing.tiny import make_tiny_vlm_checkpoint

    root = tmp_path_factory.mktemp("vlm")
    ckpt = make_tiny_vlm_checkpoint(root / "ckpt")
    refs = []
    for i, colour in enumerate(COLOURS):
        Image.new("RGB", (56, 56 * (1 + i % 2)), colour).save(root / f"{i}.png")
        refs.append(str(root / f"{i}.png"))
    plugins = load_plugins(autoload=False)
    cls = plugins.registry("trainers")["fsdp2"]
    backend = cls(cls.Config())
    run = run_config(backend)
    run.model = Selection("models", "hf", plugins.models["hf"].Config(path=str(ckpt), dtype="float32"),
                          cls=plugins.models["hf"])
    return ckpt, refs, HFGenerator(str(ckpt)), backend, run, plugins


def _prompt(engine, text: str, images: int) -> list[int]:
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                    add_generation_prompt=True)
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


def _rollout(engine, refs):
    """Rows decoded together by the engine: one image, two images (one twice as tall), text only."""
    from posttrain.plugins.engines.hf.generator import Row
    from posttrain.plugins.engines.local.sampling import parse_sampling

    rows, images = [], [[refs[0]], [refs[1], refs[2]], []]
    for k, im in enumerate(images):
        row = Row(_prompt(engine, "colour?" if k else "c?", len(im)),
                  parse_sampling({"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": k}), f"r{k}")
        if im:
            row.prompt, row.images = engine.vision.expand(row.prompt, im, pixels=False)[0], im
        rows.append(row)
    engine.decode(rows)
    return rows, images


def _batch(token_lists, prompt_lengths, images):
    from posttrain.core.train_batch import TrainBatch

    batch = TrainBatch.from_lists(token_lists, prompt_lengths)
    batch.images = images
    batch.advantages = torch.linspace(1.0, -1.0, len(token_lists))[:, None] * batch.response_mask
    return batch


@torch.no_grad()
def _engine_reference(engine, prompt, pixels, continuation):
    """The engine's log-probs of ``continuation`` fed token by token after the prompt (its decode path: a generated
    image token is plain text there)."""
    from posttrain.core.vision import rope_positions

    model, ids = engine.model, torch.tensor([prompt])
    pos = rope_positions(model, ids, pixels[1], engine.vision.image_token_id)
    out = model(input_ids=ids, position_ids=pos, pixel_values=pixels[0], image_grid_thw=pixels[1], use_cache=True)
    lps, cache = [], out.cache
    for token in continuation:
        lps.append(float(torch.log_softmax(out.logits[0, -1].float(), -1)[token]))
        pos = pos[..., -1:] + 1
        out = model(input_ids=torch.tensor([[token]]), position_ids=pos, cache=cache, use_cache=True)
        cache = out.cache
    return lps


def test_trainer_log_probs_equal_the_engines_and_the_tower_stays_frozen(setup):
    ckpt, refs, engine, backend, run, plugins = setup
    rows, images = _rollout(engine, refs)
    assert [len(r.output) for r in rows] == [5, 5, 5]
    image_id = engine.vision.image_token_id
    forced = _engine_reference(engine, rows[0].prompt, engine.vision.expand(rows[0].prompt, images[0])[1:],
                               [image_id, 40, image_id])
    model = backend.build(run.model.create(plugins), run)
    assert model.pixels is not None and model.architecture == "Qwen2_5_VLForConditionalGeneration"
    batch = _batch([r.prompt + r.output for r in rows] + [rows[0].prompt + [image_id, 40, image_id]],
                   [len(r.prompt) for r in rows] + [len(rows[0].prompt)], images + [images[0]])
    lp, _ = model.log_probs(batch)
    for b, r in enumerate(rows):
        start = len(r.prompt)
        diff = (lp[b, start:start + 5] - torch.tensor(r.logprobs)).abs().max()
        assert diff < 1e-5, f"row {b}: trainer and engine differ by {diff}"
    start = len(rows[0].prompt)
    assert (lp[3, start:start + 3] - torch.tensor(forced)).abs().max() < 1e-5  # generated image tokens are text

    from posttrain.plugins.trainers.fsdp2.vision import language_model, vision_tower

    model.model.reshard()  # FSDP2 registers the sharded parameters again (a forward left the root's gathered)
    trained = {id(p) for group in model.optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in trained for p in vision_tower(model.model).parameters())
    assert all(id(p) in trained for p in language_model(model.model).parameters())
    before = _weights(model)
    batch.old_log_probs, batch.ref_log_probs = lp, lp - 0.01
    model.train_step(batch, run.loss.create(plugins))
    after = _weights(model)
    tower = [n for n in before if ".visual." in f".{n}"]
    assert tower and all(torch.equal(after[n], before[n]) for n in tower), "the frozen tower moved"
    assert any(not torch.equal(after[n], before[n]) for n in before if "language_model" in n), "the LM did not train"


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: t.clone() for bucket in model.export_hf(1 << 30) for name, t in bucket}


def test_resume_is_exact_and_the_hf_export_answers(setup, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from posttrain.core.hf_init import write_tokenizer
    from posttrain.core.vision import ImageInputs, rope_positions

    ckpt, refs, engine, backend, run, plugins = setup
    rows, images = _rollout(engine, refs)
    batch = _batch([r.prompt + r.output for r in rows], [len(r.prompt) for r in rows], images)
    loss = run.loss.create(plugins)
    spec = run.model.create(plugins)
    model = backend.build(spec, run)
    batch.old_log_probs = model.log_probs(batch)[0]
    batch.ref_log_probs = batch.old_log_probs - 0.01
    model.train_step(batch, loss)
    model.save(tmp_path / "ckpt")
    model.train_step(batch, loss)
    went_on = model.log_probs(batch)[0]
    resumed = backend.build(spec, run, seed=1)
    resumed.load(tmp_path / "ckpt")
    assert resumed.step == 1
    resumed.train_step(batch, loss)
    assert torch.equal(resumed.log_probs(batch)[0], went_on), "resume is not exact"

    out = resumed.save_hf(tmp_path / "hf-final")
    write_tokenizer(spec, out)  # the trainer role adds the tokenizer and image processor files
    hf = AutoModelForImageTextToText.from_pretrained(out)
    tokenizer, processor = AutoTokenizer.from_pretrained(out), AutoImageProcessor.from_pretrained(out)
    vision = ImageInputs(processor, hf.config.image_token_id)
    ids, pixels, grid = vision.expand(_prompt(engine, "colour?", 2), images[1])
    x = torch.tensor([ids])
    answer = hf.generate(input_ids=x, pixel_values=pixels, image_grid_thw=grid, max_new_tokens=4, do_sample=False,
                         mm_token_type_ids=(x == vision.image_token_id).int())[0, len(ids):]
    assert len(answer) == 4 and isinstance(tokenizer.decode(answer), str)
    seq = torch.cat([x[0], answer])[None]
    logits = hf(input_ids=seq, pixel_values=pixels, image_grid_thw=grid,
                position_ids=rope_positions(hf, seq, grid, vision.image_token_id)).logits[0, :-1]
    hf_lp = torch.log_softmax(logits.float(), -1).gather(-1, seq[0, 1:, None]).squeeze(-1)[len(ids) - 1:]
    ours = resumed.log_probs(_batch([seq[0].tolist()], [len(ids)], [images[1]]))[0][0, len(ids):]
    assert (hf_lp - ours).abs().max() < 1e-5, "the export scores its answer as the trainer does"
