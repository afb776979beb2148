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
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from tuner.models import encoders
from tuner.models.encoders import model_keys
from tuner.models.identify import SingleFileSpec, Variant

if TYPE_CHECKING:
    from transformers import SiglipVisionModel

CONFIGS = Path(__file__).parent / "configs" / "siglip"
T = TypeVar("T")
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


def _vision_model_entries(entries: dict[str, T]) -> dict[str, T]:
    """A file's entries without transformers 4's / ComfyUI's `vision_model.` prefix."""
    return {k.removeprefix(_PREFIX): v for k, v in entries.items()}


# the pooling head (`head.*`) is not used: identification ignores it, a file without it loads it as zeros
SPEC = SingleFileSpec(WHAT, VARIANTS, model_keys("SiglipVisionModel", leave_out=(_HEAD,)), (_MARKER,))


def load_image_encoder(path: str | Path, dtype: torch.dtype) -> ImageEncoder:
    """Load the SigLIP vision tower and its processor from a diffusers folder (`feature_extractor/` beside
    it) or a single file."""
    from transformers import SiglipImageProcessorPil, SiglipVisionModel

    folders = ("image_encoder", "feature_extractor")
    model, processor_dir = encoders.load_image_encoder(
        path, dtype, SiglipVisionModel, folders, SPEC, _vision_model_entries, (_HEAD,)
    )
    return ImageEncoder(model, SiglipImageProcessorPil.from_pretrained(processor_dir, local_files_only=True))
