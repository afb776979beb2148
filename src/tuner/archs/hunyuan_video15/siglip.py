"""The SigLIP image encoder of HunyuanVideo 1.5 image-to-video: loading it and encoding first frames.

HunyuanVideo15ImageToVideoPipeline conditions on SigLIP so400m-patch14-384's `last_hidden_state` (729
tokens of 1152, after the post layer norm) of the first frame, prepared by its `SiglipImageProcessor` (here its PIL twin, without torchvision)
(resized to 384×384 bicubic, scaled to [-1, 1]). Two layouts, both transformers' SigLIP vision names:

* a diffusers folder (`image_encoder/` of a HunyuanVideo 1.5 I2V release, or the pipeline root), with
  `feature_extractor/` beside it;
* ComfyUI's single file (`sigclip_vision_patch14_384.safetensors`: `vision_model.*` keys). Its pooling
  head (`head.*`) is not used by the pipeline; a file without it loads too.
A single file carries no processor config: the one shipped for its variant is used.
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

if TYPE_CHECKING:
    from transformers import SiglipVisionModel

CONFIGS = Path(__file__).parent / "configs" / "siglip"
WHAT = "SigLIP vision encoder"
_PREFIX = "vision_model."
_HEAD = "head."
_MARKER = "embeddings.patch_embedding.weight"

VARIANTS = (
    Variant(
        "so400m-patch14-384",
        CONFIGS / "so400m-patch14-384",
        {
            "embeddings.patch_embedding.weight": (1152, 3, 14, 14),
            "encoder.layers.26.layer_norm1.weight": (1152,),
            "encoder.layers.27.layer_norm1.weight": None,
        },
    ),
    Variant(  # the test fixture: 28×28 images in 14×14 patches (4 tokens), width 32, one layer
        "tiny",
        CONFIGS / "tiny",
        {
            "embeddings.patch_embedding.weight": (32, 3, 14, 14),
            "encoder.layers.0.layer_norm1.weight": (32,),
            "encoder.layers.1.layer_norm1.weight": None,
        },
    ),
)


class ImageEncoder:
    """The SigLIP vision tower and the processor that prepares its input, in eval mode."""

    def __init__(self, model: SiglipVisionModel, processor):
        self.model, self.processor = model, processor

    @torch.no_grad()
    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        """`last_hidden_state` [B, tokens, width] of frames [B, 3, H, W] in [-1, 1], as the pipeline
        computes it from the (8-bit) image."""
        images = ((frames.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        arrays = [np.ascontiguousarray(img.permute(1, 2, 0).cpu().numpy()) for img in images]
        pixels = self.processor(images=arrays, return_tensors="pt").pixel_values
        param = next(self.model.parameters())
        return self.model(pixel_values=pixels.to(param.device, param.dtype)).last_hidden_state


def _names(keys) -> dict:
    """Keys without transformers 4's / ComfyUI's `vision_model.` prefix, the unused head left out."""
    out = {k.removeprefix(_PREFIX): v for k, v in keys.items()}
    return {k: v for k, v in out.items() if not k.startswith(_HEAD)}


def _expected_keys(variant: Variant) -> list[str]:
    from transformers import SiglipVisionConfig, SiglipVisionModel

    with torch.device("meta"):
        model = SiglipVisionModel(SiglipVisionConfig.from_pretrained(variant.config_dir))
    return list(_names(model.state_dict()))


def load_image_encoder(path: str | Path, dtype: torch.dtype) -> ImageEncoder:
    """Load the SigLIP vision tower and its processor from a diffusers folder or a single file."""
    from accelerate import init_empty_weights
    from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

    folder = resolve_folder(path, "image_encoder")
    if folder is not None:
        if read_folder_config(folder).get("model_type") not in ("siglip_vision_model", "siglip"):
            raise CheckpointError(f"{folder}: config.json does not describe a SigLIP vision model.")
        try:
            model = SiglipVisionModel.from_pretrained(folder, dtype=dtype, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{folder}: cannot be loaded as a SigLIP vision model: {e}") from None
        processor_dir = folder.parent / "feature_extractor"
        if not (processor_dir / "preprocessor_config.json").is_file():
            processor_dir = VARIANTS[0].config_dir
    else:
        shapes = _names(normalize_shapes(read_shapes_of(path)))
        if _MARKER not in shapes:
            raise wrong_architecture(path, shapes, WHAT, (_PREFIX + _MARKER,))
        variant = pick_variant(shapes, VARIANTS, path, WHAT)
        check_keys(_expected_keys(variant), shapes, path, f"{WHAT} {variant.name}")
        config = SiglipVisionConfig.from_pretrained(variant.config_dir)
        with init_empty_weights():  # parameters on the meta device; buffers are real
            model = SiglipVisionModel(config)
        stored = {
            k.removeprefix(_PREFIX): v for k, v in normalize_state_dict(load_tensors(path), dtype).items()
        }
        state_dict = {}
        for (
            key,
            meta,
        ) in model.state_dict().items():  # the pooling head is not used: zeros if the file has none
            name = key.removeprefix(_PREFIX)
            state_dict[key] = stored[name] if name in stored else torch.zeros(meta.shape, dtype=dtype)
        model.load_state_dict(state_dict, strict=True, assign=True)
        model = model.to(dtype)
        processor_dir = variant.config_dir
    processor = SiglipImageProcessorPil.from_pretrained(processor_dir, local_files_only=True)
    return ImageEncoder(model.eval(), processor)
