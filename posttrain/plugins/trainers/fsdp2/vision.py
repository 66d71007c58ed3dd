"""Vision-language models in the ``fsdp2`` trainer: which parts are the vision tower and the language model,
freezing the tower, and a micro-batch's pixel inputs.

A vision-language checkpoint (its config has a ``vision_config``) is built with
``AutoModelForImageTextToText`` (Qwen2.5-VL: ``Qwen2_5_VLForConditionalGeneration``, whose ``model.visual``
is the vision tower and ``model.language_model`` the decoder; ``lm_head`` sits beside them). With
``trainer.backend.freeze_vision`` the tower's parameters get ``requires_grad = False`` before sharding, so
AdamW holds only the language model's (and the projector's, when it lives outside the tower); the tower still
runs forward on every micro-batch, and its weights are still exported and saved.

Log-probs of a micro-batch with images: ``model(input_ids [b, T], pixel_values [P, D], image_grid_thw [n, 3],
position_ids [3, b, T])``, the images of its samples in sample order (the order of their image tokens in
``input_ids``), processed by the checkpoint's image processor as the engines process them
(:class:`posttrain.core.vision.ImageInputs`), positions from the model's ``get_rope_index``.
"""

from __future__ import annotations

from typing import Any

import torch

VISION_ATTRS = ("visual", "vision_tower", "vision_model")  # where transformers' VLMs keep their vision tower
LANGUAGE_ATTRS = ("language_model", "text_model")


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "model", model)


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision tower of an image-text-to-text model, or None (a text model)."""
    for name in VISION_ATTRS:
        for owner in (_inner(model), model):
            tower = getattr(owner, name, None)
            if isinstance(tower, torch.nn.Module):
                return tower
    return None


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack that LoRA and the language-model-only options target (the model itself for a text model)."""
    for name in LANGUAGE_ATTRS:
        part = getattr(_inner(model), name, None)
        if isinstance(part, torch.nn.Module):
            return part
    return model


def freeze_vision(model: torch.nn.Module) -> int:
    """``requires_grad = False`` on the vision tower's parameters; how many were frozen."""
    tower = vision_tower(model)
    params = list(tower.parameters()) if tower is not None else []
    for p in params:
        p.requires_grad_(False)
    return len(params)


class PixelInputs:
    """The forward kwargs of micro-batches with images, from the checkpoint's image processor.

    A sampled response may hold the image token itself (a policy can emit any id): the engine fed it back as
    plain text (its embedding row, text positions). So in each sample only the first ``sum_i t_i h_i w_i / m^2``
    image tokens (its prompt's) take image features; later ones are replaced by token 0 in ``input_ids`` (text to
    the model's placeholder count and positions) and get the image token's embedding row back from a forward hook
    on the input embedding (:meth:`attach`), as the engine computed them."""

    def __init__(self, model_dir: str, dtype: torch.dtype):
        from posttrain.core.vision import ImageInputs

        self.images, self.dtype = ImageInputs.from_dir(model_dir), dtype
        self.generated: torch.Tensor | None = None  # [b, T] bool: image tokens the policy generated

    def attach(self, model: torch.nn.Module) -> None:
        """The embedding hook (before ``fully_shard``: it runs inside the root's forward, weights gathered)."""
        image_id = self.images.image_token_id

        def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            if self.generated is None or not bool(self.generated.any()):
                return output
            row = module.weight[image_id].to(output.dtype)
            return torch.where(self.generated[..., None], row, output)

        model.get_input_embeddings().register_forward_hook(hook)

    def prepare(self, model: torch.nn.Module, tokens: torch.Tensor, images: list[list[str]] | None,
                ) -> tuple[torch.Tensor, dict[str, Any]]:
        """``(input_ids, {pixel_values, image_grid_thw, position_ids})`` for ``tokens [b, T]`` and its samples'
        ``images``, and :attr:`generated` set for the hook (``(tokens, {})`` without images)."""
        from posttrain.core.vision import rope_positions

        self.generated = None
        refs = [ref for sample in images or [] for ref in sample]
        if not refs:
            return tokens, {}
        pixel_values, grid = self.images.pixels(refs)
        counts = self.images.counts(grid)
        is_image = tokens == self.images.image_token_id
        generated, k = torch.zeros_like(is_image), 0
        for b, sample in enumerate(images):
            need = sum(counts[k:k + len(sample)])
            k += len(sample)
            at = is_image[b].nonzero().flatten()
            if len(at) < need:
                raise ValueError(f"sample {b} holds {len(at)} image tokens; its {len(sample)} image(s) take {need}")
            generated[b, at[need:]] = True
        if bool(generated.any()):
            tokens = tokens.masked_fill(generated, 0)
            self.generated = generated
        grid = grid.to(tokens.device)
        return tokens, {"pixel_values": pixel_values.to(tokens.device), "image_grid_thw": grid,
                        "position_ids": rope_positions(model, tokens, grid, self.images.image_token_id)}
