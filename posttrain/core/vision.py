"""Images of vision-language prompts: reading and checking them, and turning them into a model's inputs.

An image travels as a *reference*, a string: an absolute file path (``data.images_key`` paths are relative to
the data file and resolved at load time) or base64 bytes (a ``data:image/...;base64,`` URL, or bare base64 of
more than 256 characters not ending in an image suffix), the
forms SGLang's ``/generate`` takes in ``image_data``. The driver, the engines and the trainer each open the
references they are given, so no pixels cross a process boundary.

Image tokens (the Qwen2-VL family's processor rule, which ``ImageInputs`` applies on token ids): the chat
template puts one ``image_token_id`` per image (``<|vision_start|><|image_pad|><|vision_end|>``); the image
processor cuts image ``i`` into a ``[t_i, h_i, w_i]`` grid of patches (``image_grid_thw [n, 3]``, ``pixel_values
[sum_i t_i h_i w_i, C * temporal_patch * patch^2]``) and the prompt then holds ``t_i h_i w_i / merge_size^2``
copies of the image token in place of the one: the tokens the vision tower's merged patches replace.
Positions (multimodal rotary embeddings, ``get_rope_index`` of those models): ``[3, B, T]``, an image's tokens
numbered by (time, row, column) of their merged patch, text after it continuing from the largest + 1.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff")


def is_vision_config(hf: dict[str, Any] | Any) -> bool:
    """Whether an HF config (``config.json`` mapping or ``PretrainedConfig``) describes a vision-language model."""
    if isinstance(hf, dict):
        return bool(hf.get("vision_config"))
    return getattr(hf, "vision_config", None) is not None


def image_refs(value: Any, base_dir: str | Path) -> tuple[list[str], str | None]:
    """``(references, problem)`` of a row's ``images_key`` value: a string or a list of strings, each a path
    (relative to ``base_dir``, the data file's folder; made absolute) or base64 bytes (kept as they are)."""
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, str) and v for v in items):
        return [], f"must be an image path or base64 string, or a non-empty list of them, got {type(value).__name__}"
    refs = []
    for v in items:
        if _is_base64(v):
            refs.append(v)
        else:
            p = Path(v)
            refs.append(str(p if p.is_absolute() else (Path(base_dir) / p).resolve()))
    return refs, None


def _is_base64(ref: str) -> bool:
    if ref.startswith("data:"):
        return True
    return len(ref) > 256 and not ref.lower().endswith(IMAGE_SUFFIXES)


def image_bytes(ref: str) -> bytes:
    """The encoded image of a reference (a file's bytes, or the decoded base64)."""
    if ref.startswith("data:"):
        ref = ref.split(",", 1)[1] if "," in ref else ""
    elif not _is_base64(ref):
        return Path(ref).read_bytes()
    return base64.b64decode(ref, validate=True)


def open_image(ref: str) -> Any:
    """The reference's image as an RGB ``PIL.Image`` (decoded in full)."""
    from PIL import Image

    image = Image.open(io.BytesIO(image_bytes(ref)))
    image.load()
    return image.convert("RGB")


def open_size(ref: str) -> tuple[int, int]:
    """``(width, height)`` of the reference's image, from its header (a file is not decoded)."""
    from PIL import Image

    with Image.open(io.BytesIO(image_bytes(ref)) if _is_base64(ref) else ref) as image:
        return image.size


def encode_png(image: Any) -> str:
    """``data:image/png;base64,...`` of a ``PIL.Image`` (how generated data and tools pass images inline)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def check_image(ref: str, max_pixels: int | None) -> tuple[Any, str | None]:
    """``(image or None, problem)``: a reference that cannot be read, or holds more than ``max_pixels``."""
    from PIL import UnidentifiedImageError

    shown = ref if not _is_base64(ref) else f"base64 image {ref[:24]}..."
    try:
        image = open_image(ref)
    except FileNotFoundError:
        return None, f"image not found: {shown}"
    except (binascii.Error, ValueError):
        return None, f"{shown}: not valid base64"
    except (UnidentifiedImageError, OSError) as exc:
        return None, f"unreadable image {shown}: {type(exc).__name__}: {exc}"
    w, h = image.size
    if max_pixels is not None and w * h > max_pixels:
        return None, f"image {shown} has {w}x{h} = {w * h} pixels, more than data.max_pixels={max_pixels}"
    return image, None


def with_image_slots(prompt: str | list[dict[str, Any]], count: int) -> tuple[list[dict[str, Any]], str | None]:
    """Chat messages whose content lists hold ``count`` ``{"type": "image"}`` items, and the problem if they
    cannot: a string prompt becomes one user message with the images first; messages that already carry image
    items must carry exactly ``count``; messages without any get them at the start of the first user turn."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    have = sum(1 for m in messages if isinstance(m.get("content"), list)
               for c in m["content"] if isinstance(c, dict) and c.get("type") == "image")
    if have:
        if have != count:
            return messages, f"the messages hold {have} image item(s) for {count} image(s)"
        return messages, None
    for m in messages:
        if m.get("role") == "user":
            text = m.get("content")
            items = text if isinstance(text, list) else [{"type": "text", "text": text or ""}]
            m["content"] = [{"type": "image"}] * count + items
            return messages, None
    return messages, "no user message to hold the images"


class ImageInputs:
    """A vision-language checkpoint's image processor and image token: prompts with images as model inputs.

    ``expand(ids, images) -> (ids', pixel_values, image_grid_thw)``: ``ids`` holds one image token per image
    (as rendered) or the expanded run already (as sent to an engine); either way ``ids'`` holds the expanded
    runs. ``tokens_added(images)``: how many tokens the expansion adds (``data.max_prompt_len`` counts them).
    """

    def __init__(self, image_processor: Any, image_token_id: int):
        self.processor, self.image_token_id = image_processor, int(image_token_id)
        self.merge = int(getattr(image_processor, "merge_size", 1) or 1)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ImageInputs":
        """From a checkpoint directory's ``config.json`` (``image_token_id``) and its image processor files."""
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(str(path))
        return cls(AutoImageProcessor.from_pretrained(str(path)), config.image_token_id)

    def pixels(self, images: list[Any]) -> tuple[Any, Any]:
        """``(pixel_values [P, D] float32, image_grid_thw [n, 3] long)`` of PIL images or references."""
        opened = [open_image(i) if isinstance(i, str) else i for i in images]
        out = self.processor(images=opened, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def counts(self, grid_thw: Any) -> list[int]:
        """Image tokens of each image: ``t h w / merge_size^2``."""
        return [int(n) // self.merge ** 2 for n in grid_thw.prod(-1).tolist()]

    def token_counts(self, images: list[Any]) -> list[int]:
        """Image tokens of each image from its size alone (the processor's ``get_number_of_image_patches``: no
        pixels are processed), else through :meth:`pixels`."""
        patches = getattr(self.processor, "get_number_of_image_patches", None)
        if patches is None:
            return self.counts(self.pixels(images)[1])
        sizes = [(open_size(i) if isinstance(i, str) else i.size) for i in images]
        return [int(patches(h, w)) // self.merge ** 2 for w, h in sizes]

    def tokens_added(self, images: list[Any]) -> int:
        return sum(c - 1 for c in self.token_counts(images))

    def expand(self, ids: list[int], images: list[Any], pixels: bool = True) -> tuple[list[int], Any, Any]:
        """``(ids', pixel_values, image_grid_thw)`` (the class doc); ``pixels=False`` counts the image tokens
        from the images' sizes and returns ``(ids', None, None)``."""
        if pixels:
            pixel_values, grid = self.pixels(images)
            counts = self.counts(grid)
        else:
            pixel_values = grid = None
            counts = self.token_counts(images)
        have = sum(1 for t in ids if t == self.image_token_id)
        if have == sum(counts):
            return list(ids), pixel_values, grid
        if have != len(counts):
            raise ValueError(f"the prompt holds {have} image tokens (id {self.image_token_id}) for {len(counts)} "
                             f"image(s) of {sum(counts)} tokens")
        out, k = [], 0
        for t in ids:
            if t == self.image_token_id:
                out.extend([t] * counts[k])
                k += 1
            else:
                out.append(t)
        return out, pixel_values, grid


def rope_positions(model: Any, input_ids: Any, image_grid_thw: Any, image_token_id: int,
                   attention_mask: Any = None) -> Any:
    """``[3, B, T]`` multimodal rotary positions of ``input_ids [B, T]`` from the model's own ``get_rope_index``
    (image tokens numbered by their patch's time, row and column; text continuing after each image), counting
    only ``attention_mask`` tokens (left padding gets 0); None for a model that has no such positions."""
    inner = getattr(model, "model", model)
    get = getattr(inner, "get_rope_index", None)
    if get is None:
        return None
    types = (input_ids == image_token_id).int()
    positions, _ = get(input_ids, mm_token_type_ids=types, image_grid_thw=image_grid_thw,
                       attention_mask=attention_mask)
    return positions
