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
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from tuner.models import encoders
from tuner.models.encoders import model_keys
from tuner.models.identify import SingleFileSpec, Variant

# transformers is imported where a model is built: importing it costs seconds (see tuner.archs.wan.loaders)
if TYPE_CHECKING:
    from transformers import CLIPImageProcessorPil, CLIPVisionModel

CONFIGS = Path(__file__).parent / "configs" / "clip_vision"
T = TypeVar("T")
WHAT = "CLIP vision encoder"
_PREFIX = "vision_model."
_MARKER = "embeddings.patch_embedding.weight"
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


def _without_projection(entries: dict[str, T]) -> dict[str, T]:
    return {k: v for k, v in entries.items() if k not in _UNUSED}


SPEC = SingleFileSpec(WHAT, VARIANTS, model_keys("CLIPVisionModel", prefix=_PREFIX), (_PREFIX + _MARKER,))


def load_image_encoder(path: str | Path, dtype: torch.dtype) -> ImageEncoder:
    """Load the CLIP vision tower and its processor from a diffusers folder (`image_processor/` beside it)
    or a single file."""
    from transformers import CLIPImageProcessorPil, CLIPVisionModel

    folders = ("image_encoder", "image_processor")
    model, processor_dir = encoders.load_image_encoder(
        path, dtype, CLIPVisionModel, folders, SPEC, _without_projection
    )
    return ImageEncoder(model, CLIPImageProcessorPil.from_pretrained(processor_dir, local_files_only=True))
