"""The CLIP ViT-H/14 image encoder of Wan 2.1 image-to-video: loading it and encoding frames.

Wan 2.1 I2V / FLF2V condition their image cross-attention (`img_emb`, `k_img` / `v_img`) on the
*penultimate* hidden states of a CLIP ViT-H/14 vision tower: all 257 tokens (class token + 16×16 patches)
after the 31st of its 32 layers, before the final layer norm. diffusers' `WanImageToVideoPipeline`
computes them as `CLIPVisionModel(...).hidden_states[-2]` on the output of its `CLIPImageProcessor`
(shortest side resized to 224 bicubic, center crop 224, CLIP's mean / std).

Two layouts are read, both the transformers CLIP vision layout:

* a diffusers folder (`image_encoder/` of a Wan I2V diffusers release, or the pipeline root), with the
  `image_processor/` folder beside it;
* ComfyUI's single file (`clip_vision_h.safetensors`): `vision_model.*` keys, plus a
  `visual_projection.weight` that the penultimate hidden states do not use (it is dropped).

The official release's own CLIP file (`models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth`, open_clip
names with the XLM-RoBERTa text tower) is not read. A single file carries no processor config: the one
shipped for its variant (`configs/clip_vision/<variant>/preprocessor_config.json`) is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tuner.errors import CheckpointError
from tuner.models.identify import Variant, check_keys, pick_variant, wrong_architecture
from tuner.models.loading import (
    load_tensors,
    normalize_shapes,
    normalize_state_dict,
    read_folder_config,
    read_shapes_of,
    resolve_folder,
)

# transformers is imported where a model is built: importing it costs seconds (see tuner.archs.wan.loaders)
if TYPE_CHECKING:
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

CONFIGS = Path(__file__).parent / "configs" / "clip_vision"
WHAT = "CLIP vision encoder"
_PREFIX = "vision_model."
# ComfyUI's files are CLIPVisionModelWithProjection's; the projection is not used by Wan
_UNUSED = ("visual_projection.weight",)

VARIANTS = (
    Variant(
        "vit-h-14",
        CONFIGS / "vit-h-14",
        {
            "vision_model.embeddings.patch_embedding.weight": (1280, 3, 14, 14),
            "vision_model.encoder.layers.31.layer_norm1.weight": (1280,),
            "vision_model.encoder.layers.32.layer_norm1.weight": None,
        },
    ),
    Variant(  # the test fixture: 32×32 images in 8×8 patches (17 tokens), width 32, 2 layers
        "tiny",
        CONFIGS / "tiny",
        {
            "vision_model.embeddings.patch_embedding.weight": (32, 3, 8, 8),
            "vision_model.encoder.layers.1.layer_norm1.weight": (32,),
            "vision_model.encoder.layers.2.layer_norm1.weight": None,
        },
    ),
)


class ImageEncoder:
    """A CLIP vision tower and the processor that prepares its input, in eval mode."""

    def __init__(self, model: CLIPVisionModel, processor: CLIPImageProcessorPil):
        self.model, self.processor = model, processor

    @torch.no_grad()
    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        """Penultimate hidden states [B, tokens, width] of frames [B, 3, H, W] in [-1, 1]."""
        images = ((frames.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        arrays = [np.ascontiguousarray(img.permute(1, 2, 0).cpu().numpy()) for img in images]
        pixels = self.processor(images=arrays, return_tensors="pt").pixel_values
        param = next(self.model.parameters())
        out = self.model(pixel_values=pixels.to(param.device, param.dtype), output_hidden_states=True)
        return out.hidden_states[-2]


def _expected_keys(variant: Variant) -> list[str]:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    with torch.device("meta"):
        model = CLIPVisionModel(CLIPVisionConfig.from_pretrained(variant.config_dir))
    return [_PREFIX + k.removeprefix(_PREFIX) for k in model.state_dict()]


def identify(path: str | Path) -> Variant:
    """The variant of a single CLIP vision file (headers only), after checking it holds every weight."""
    shapes = {k: v for k, v in normalize_shapes(read_shapes_of(path)).items() if k not in _UNUSED}
    if "vision_model.embeddings.patch_embedding.weight" not in shapes:
        raise wrong_architecture(path, shapes, WHAT, ("vision_model.embeddings.patch_embedding.weight",))
    variant = pick_variant(shapes, VARIANTS, path, WHAT)
    check_keys(_expected_keys(variant), shapes, path, f"{WHAT} {variant.name}")
    return variant


def load_image_encoder(path: str | Path, dtype: torch.dtype) -> ImageEncoder:
    """Load the CLIP vision tower and its processor from a diffusers folder or a single file."""
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

    folder = resolve_folder(path, "image_encoder")
    if folder is not None:
        if read_folder_config(folder).get("model_type") not in ("clip_vision_model", "clip"):
            raise CheckpointError(f"{folder}: config.json does not describe a CLIP vision model.")
        try:
            model = CLIPVisionModel.from_pretrained(folder, dtype=dtype, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{folder}: cannot be loaded as a CLIP vision model: {e}") from None
        processor_dir = folder.parent / "image_processor"
        if not (processor_dir / "preprocessor_config.json").is_file():
            processor_dir = _shipped_variant_of(model.config).config_dir
    else:
        variant = identify(path)
        state_dict = normalize_state_dict(load_tensors(path), dtype)
        state_dict = {k: v for k, v in state_dict.items() if k not in _UNUSED}
        config = CLIPVisionConfig.from_pretrained(variant.config_dir)
        model = CLIPVisionModel.from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype)
        processor_dir = variant.config_dir
    processor = CLIPImageProcessorPil.from_pretrained(processor_dir, local_files_only=True)
    return ImageEncoder(model.eval(), processor)


def _shipped_variant_of(config: CLIPVisionConfig) -> Variant:
    """The shipped variant with this config's sizes (for a folder that lacks its processor)."""
    from transformers import CLIPVisionConfig

    for variant in VARIANTS:
        shipped = CLIPVisionConfig.from_pretrained(variant.config_dir)
        if (shipped.hidden_size, shipped.image_size, shipped.num_hidden_layers) == (
            config.hidden_size,
            config.image_size,
            config.num_hidden_layers,
        ):
            return variant
    raise CheckpointError(
        f"a CLIP vision model of width {config.hidden_size} and image size {config.image_size} without an "
        "image_processor/ folder beside it; give the diffusers pipeline root (with image_processor/)."
    )
