"""Key names of FLUX.3 in diffusers' layout and in Black Forest Labs' release layout, both directions.

The facts are those of diffusers' single-file converter (`convert_flux3_transformer_checkpoint_to_diffusers`
in `diffusers/loaders/single_file_utils.py`) and its LoRA converter (`_convert_non_diffusers_flux3_lora_to_
diffusers` in `diffusers/loaders/lora_conversion_utils.py`):

| diffusers                                          | release                                           |
|----------------------------------------------------|---------------------------------------------------|
| `mode_blocks.{image,image_cond}.{i}.*`             | `content_mode_blocks.{image,image_cond}.{i}.*`    |
| `txt_mode_blocks.{i}.*`, `single_transformer_blocks.{i}.*` | `txt_mode_blocks.{i}.*`, `single_blocks.{i}.*` |
| a block's `attn.to_q/to_k/to_v/to_out.0`           | `q_proj` / `k_proj` / `v_proj` / `attn_out`       |
| a block's `ff.linear_in` / `ff.linear_out`         | `mlp_in` / `mlp_out`                              |
| a block's `attn.norm_q.weight` / `norm_k.weight`   | `norm.query_norm.scale` / `norm.key_norm.scale`   |
| `{early,single}_stream_modulations.{mode}.linear`  | `{early,single}_stream_modulations.{mode}.lin`    |
| `x_embedders.{mode}`, `context_embedder`           | `emb_in.{mode}`, `txt_in`                         |
| `timestep_embedder.linear_1/2`                     | `time_in.in_layer` / `out_layer`                  |
| `proj_out`, `norm_out.linear`                      | `final_layer.image.linear`, `final_layer.image.adaLN_modulation.1` (row halves swapped) |

Nothing is fused. The step-distilled (flow-map) release adds `ref_time_in.*` (diffusers'
`target_timestep_embedder`); training-only `repa_projectors.*` heads are not part of the model. ComfyUI's
files would put `model.diffusion_model.` before every key; no ComfyUI support for FLUX.3 was found to
confirm its file names.
"""

from __future__ import annotations

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

IMAGE_MODES = ("image", "image_cond")
"""The image token modes (the noisy image, the reference images); the text context is `txt`."""

_BLOCKS = (
    *((f"mode_blocks.{mode}", f"content_mode_blocks.{mode}") for mode in IMAGE_MODES),
    ("txt_mode_blocks", "txt_mode_blocks"),
    ("single_transformer_blocks", "single_blocks"),
)
_BLOCK_LINEARS = (
    ("attn.to_q", "q_proj"),
    ("attn.to_k", "k_proj"),
    ("attn.to_v", "v_proj"),
    ("attn.to_out.0", "attn_out"),
    ("ff.linear_in", "mlp_in"),
    ("ff.linear_out", "mlp_out"),
)
_MODULATIONS = tuple(
    (f"{stream}_stream_modulations.{mode}.linear", f"{stream}_stream_modulations.{mode}.lin")
    for stream in ("early", "single")
    for mode in (*IMAGE_MODES, "txt")
)

# (diffusers module, release module); `{i}` is a block index
TRANSFORMER_RULES: tuple[tuple[str, str], ...] = (
    *((f"{d}.{{i}}.{a}", f"{o}.{{i}}.{b}") for d, o in _BLOCKS for a, b in _BLOCK_LINEARS),
    *_MODULATIONS,
    *((f"x_embedders.{mode}", f"emb_in.{mode}") for mode in IMAGE_MODES),
    ("context_embedder", "txt_in"),
    ("timestep_embedder.linear_1", "time_in.in_layer"),
    ("timestep_embedder.linear_2", "time_in.out_layer"),
    ("proj_out", "final_layer.image.linear"),
)

# tensors whose own name changes: the q/k RMSNorms' `weight` is the release's `scale`
NORM_RULES: tuple[tuple[str, str], ...] = tuple(
    (f"{d}.{{i}}.attn.{a}.weight", f"{o}.{{i}}.norm.{b}.scale")
    for d, o in _BLOCKS
    for a, b in (("norm_q", "query_norm"), ("norm_k", "key_norm"))
)

# the output modulation emits (shift, scale) in the release and (scale, shift) in diffusers
FINAL_MODULATION = ("norm_out.linear", "final_layer.image.adaLN_modulation.1")

FLUX3_KEYS = ArchitectureKeys("flux3", TRANSFORMER_RULES)
"""The adapter name map (diffusers module -> release module): renames only, nothing fused."""

FLUX3_LAYOUT = CheckpointLayout(FLUX3_KEYS, NORM_RULES, (FINAL_MODULATION,))
"""The whole transformer checkpoint both ways (`to_original` / `to_diffusers`), at any size."""
