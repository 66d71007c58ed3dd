"""The CPU vision-language example's data and model: which colour is the largest shape?

Writes, beside this file:

- ``data/images/*.png``: 56 x 56 pictures, each a large square of one colour and a small one of another on black
  (red, green or blue; sizes and places drawn at random);
- ``data/train.jsonl``: ``{"prompt": "largest:", "images": "images/N.png", "label": "r" | "g" | "b"}``, the image
  path relative to the data file (``data.images_key: images``);
- ``tiny-qwen2.5-vl/``: a randomly initialized tiny Qwen2.5-VL (a 2-block vision tower of width 32, a 2-layer
  language model of width 64), the character tokenizer with the vision tokens, and Qwen2-VL's image processor.
  A 56 x 56 image is 16 patches of 14 x 14, merged 2 x 2 into 4 image tokens.

Chance is 1/3 (three colours, one-letter answers).

    python examples/vlm/make_data.py [--count 512] [--seed 0] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
COLOURS = {"r": (230, 40, 40), "g": (40, 200, 40), "b": (50, 80, 240)}


def draw(rng: random.Random, size: int = 56):
    """``(image, letter of the large square's colour)``."""
    from PIL import Image, ImageDraw

    big, small = rng.sample(sorted(COLOURS), 2)
    image = Image.new("RGB", (size, size), (0, 0, 0))
    pen = ImageDraw.Draw(image)
    for letter, side in ((big, rng.randint(24, 34)), (small, rng.randint(6, 12))):
        x, y = rng.randint(0, size - side), rng.randint(0, size - side)
        pen.rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[letter])
    return image, big


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE), help="where data/ and tiny-qwen2.5-vl/ go (default: beside this)")
    args = parser.parse_args(argv)
    rng, out = random.Random(args.seed), Path(args.out)
    images = out / "data" / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in range(args.count):
        image, letter = draw(rng)
        image.save(images / f"{n}.png")
        rows.append({"prompt": "largest:", "images": f"images/{n}.png", "label": letter})
    (out / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    from posttrain.testing.tiny import make_tiny_vlm_checkpoint

    make_tiny_vlm_checkpoint(out / "tiny-qwen2.5-vl", seed=args.seed)
    print(f"wrote {args.count} images, {out / 'data' / 'train.jsonl'} and {out / 'tiny-qwen2.5-vl'}")


if __name__ == "__main__":
    main()
