"""Vision-language GRPO end to end: a random Qwen2.5-VL of a given shape, drawn images, one colocated run.

    python bench/vlm.py --shape qwen2.5-vl-3b --device cuda [--steps 5] [key=value ...]   # one GPU, colocated
    python bench/vlm.py --shape tiny [--steps 3]                                        # the CPU check of it

Writes, in a temporary directory, a randomly initialized checkpoint of the shape (``qwen2.5-vl-3b``:
Qwen2.5-VL-3B's language model, 36 layers of width 2048, GQA 16/2, vocabulary 151,936, tied embeddings, and its
32-block vision tower of width 1280, 3.75B parameters; the character tokenizer with the vision tokens; Qwen2-VL's
image processor), ``--prompts`` drawn images of ``--image-size`` pixels square (the colour of the largest shape,
``examples/vlm``; 224 x 224 is 256 patches, 64 image tokens) and a run config: the ``fsdp2`` trainer (bf16 compute,
float32 master weights, vision tower frozen), the ``hf`` engine on the same GPU (``resources.colocate``: its weights
leave the GPU while the trainer steps), GRPO with ``--new-tokens`` sampled tokens per answer. Then ``bench/e2e.py`` runs it and its one JSON line is printed with
``"bench": "vlm"``, the shape and its depths.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "tiny": {},
    "qwen2.5-vl-3b": dict(
        text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                         num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
        tie_word_embeddings=True),
}


def write_task(root: Path, args: argparse.Namespace) -> Path:
    """The checkpoint, images, prompts and config under ``root``; the config's path."""
    from examples.vlm.make_data import draw
    from posttrain.testing.tiny import make_tiny_vlm_checkpoint

    gpu = args.device == "cuda"
    ckpt = make_tiny_vlm_checkpoint(root / "ckpt", max_pixels=args.image_size ** 2, dtype="bfloat16" if gpu else
                                    "float32", device=args.device, **SHAPES[args.shape])
    if gpu:  # the run's trainer and engine need the memory the random draw took
        import torch

        torch.cuda.empty_cache()
    rng = random.Random(0)
    (root / "images").mkdir()
    rows = []
    for n in range(args.prompts):
        image, letter = draw(rng, args.image_size)
        image.save(root / "images" / f"{n}.png")
        rows.append({"prompt": "Which colour is the largest shape?", "images": f"images/{n}.png", "label": letter})
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    engine = {"name": "hf", "device": "cuda", "max_batch_size": 256} if gpu else {"name": "hf"}
    config = {
        "seed": 0, "model": {"name": "hf", "path": str(ckpt), "dtype": "bfloat16" if gpu else "float32"},
        "data": {"path": str(root / "train.jsonl"), "images_key": "images", "epochs": 100},
        "rollout": {"rollout_batch_size": args.prompts, "n_samples_per_prompt": args.samples,
                    "num_rollouts": args.steps, "max_new_tokens": args.new_tokens, "use_router": False,
                    "engine": engine},
        "generator": "single_turn", "estimator": "grpo", "loss": "ppo_clip",
        "rewards": [{"name": "regex", "pattern": "[rgb]"}],
        "trainer": {"global_batch_size": args.prompts * args.samples, "micro_batch_size": args.micro_batch,
                    "lr": 1.0e-6, "backend": {"name": "fsdp2", "freeze_vision": True}},
        "resources": {"trainer_gpus_per_node": 1, "colocate": True} if gpu else {},
        "checkpoint": {"interval": 0}, "logging": {"tensorboard": False},
    }
    path = root / "config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=56)
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the run is stopped "
                        "(bench/e2e.py --timeout: the failure then shows the run's logs)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = write_task(Path(tmp), args)
        limit = ["--timeout", str(args.timeout)] if args.timeout else []
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--config", str(config), "--name",
                              f"vlm-{args.shape}", *limit, *args.overrides], capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            sys.exit(f"bench/e2e.py failed ({out.returncode}):\n{out.stderr[-4000:]}")
        from posttrain.core.model_spec import read_hf_config
        from posttrain.core.vision import is_vision_config

        hf = read_hf_config(Path(tmp) / "ckpt")
        assert is_vision_config(hf)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(bench="vlm", shape=args.shape, device=args.device, image_size=args.image_size,
                  text_layers=hf["text_config"]["num_hidden_layers"], vision_depth=hf["vision_config"]["depth"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
