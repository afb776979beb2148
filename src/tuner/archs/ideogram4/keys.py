"""Ideogram 4's release layout (the `ideogram4*.safetensors` files ComfyUI loads) relative to diffusers'.

The facts are those of diffusers' LoRA converter for the model (`_convert_non_diffusers_ideogram4_lora_to_diffusers`
in `diffusers/loaders/lora_conversion_utils.py`) and of ComfyUI's model class (`comfy/ldm/ideogram4/model.py`,
whose state dict the release files are): the release is diffusers' network under diffusers' names except
in each block's attention, where q, k and v are one `attention.qkv` linear layer (rows q, k, v) and the
output projection is `attention.o`:

| diffusers                                      | release                           |
|------------------------------------------------|-----------------------------------|
| `layers.{i}.attention.to_q / to_k / to_v`      | `layers.{i}.attention.qkv` (fused) |
| `layers.{i}.attention.to_out.0`                | `layers.{i}.attention.o`          |
| everything else (`feed_forward.w1/w2/w3`, `adaln_modulation`, norms, `input_proj`, `llm_cond_*`, `t_embedding.*`, `adaln_proj`, `final_layer.*`) | the same name |

ComfyUI's files put `model.diffusion_model.` before every key; diffusers' converter also strips
`conditional_transformer.`.
"""

from __future__ import annotations

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.fused import FusedLayer
from tuner.networks.layouts import CheckpointLayout

BLOCK_LISTS = ("layers",)

# (diffusers module, release module); every linear layer is listed, so kohya spellings read back
_RENAMES = (
    ("layers.{i}.attention.to_out.0", "layers.{i}.attention.o"),
    *((f"layers.{{i}}.{m}", f"layers.{{i}}.{m}") for m in
      ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "adaln_modulation")),
    *((m, m) for m in ("input_proj", "llm_cond_proj", "t_embedding.mlp_in", "t_embedding.mlp_out",
                       "adaln_proj", "final_layer.linear", "final_layer.adaln_modulation")),
)  # fmt: skip

_FUSED = (
    FusedLayer(
        "layers.{i}.attention.qkv",
        ("layers.{i}.attention.to_q", "layers.{i}.attention.to_k", "layers.{i}.attention.to_v"),
    ),
)

# the tensors outside linear layers keep their names
_NORMS = (
    "attention.norm_q",
    "attention.norm_k",
    "attention_norm1",
    "attention_norm2",
    "ffn_norm1",
    "ffn_norm2",
)
_TENSORS = (
    *((f"layers.{{i}}.{n}.weight",) * 2 for n in _NORMS),
    *((k, k) for k in ("llm_cond_norm.weight", "embed_image_indicator.weight")),
)

IDEOGRAM4_KEYS = ArchitectureKeys("ideogram4", _RENAMES, _FUSED)
"""The adapter name map (diffusers module -> release module), carrying the fused qkv."""

IDEOGRAM4_LAYOUT = CheckpointLayout(IDEOGRAM4_KEYS, tensor_renames=_TENSORS)
"""The whole transformer checkpoint both ways (`to_original` / `to_diffusers`), at any size."""
