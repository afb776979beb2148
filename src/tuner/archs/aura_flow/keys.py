"""AuraFlow's release layout (fal's `aura_flow_0.3.safetensors`, which ComfyUI loads) relative to diffusers'.

The facts are those of diffusers' single-file converter for the model
(`convert_auraflow_transformer_checkpoint_to_diffusers` in `diffusers/loaders/single_file_utils.py`):

| diffusers                                          | release                                    |
|----------------------------------------------------|--------------------------------------------|
| `joint_transformer_blocks.{i}.attn.to_q/k/v/to_out.0` | `double_layers.{i}.attn.w2q/w2k/w2v/w2o` (image) |
| `...attn.add_q/k/v_proj`, `...attn.to_add_out`     | `...attn.w1q/w1k/w1v/w1o` (text)           |
| `...ff.linear_1/linear_2/out_projection`           | `...mlpX.c_fc1/c_fc2/c_proj` (`ff_context`: `mlpC`) |
| `...norm1.linear`, `...norm1_context.linear`       | `...modX.1`, `...modC.1`                   |
| `single_transformer_blocks.{i}.attn.to_q/k/v/to_out.0` | `single_layers.{i}.attn.w1q/w1k/w1v/w1o` |
| `single_transformer_blocks.{i}.ff.*`, `.norm1.linear` | `single_layers.{i}.mlp.*`, `.modCX.1`    |
| `pos_embed.proj`, `pos_embed.pos_embed`            | `init_x_linear`, `positional_encoding`     |
| `time_step_proj.linear_1/2`, `context_embedder`    | `t_embedder.mlp.0/2`, `cond_seq_linear`    |
| `norm_out.linear` (scale, shift)                   | `modF.1` (shift, scale: halves swapped)    |
| `proj_out`, `register_tokens`                      | `final_linear`, `register_tokens`          |

No layer is fused and the q/k norms hold no weights. ComfyUI's checkpoint puts `model.` before the
transformer's keys (its `unet_prefix_from_state_dict` falls back to `model.` for AuraFlow).
"""

from __future__ import annotations

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

BLOCK_LISTS = ("joint_transformer_blocks", "single_transformer_blocks")

_FEED_FORWARD = (("linear_1", "c_fc1"), ("linear_2", "c_fc2"), ("out_projection", "c_proj"))
_IMAGE_ATTENTION = (("to_q", "w2q"), ("to_k", "w2k"), ("to_v", "w2v"), ("to_out.0", "w2o"))
_TEXT_ATTENTION = (("add_q_proj", "w1q"), ("add_k_proj", "w1k"), ("add_v_proj", "w1v"), ("to_add_out", "w1o"))
# the single blocks' one stream takes the text stream's names
_SINGLE_ATTENTION = tuple((d, o) for (d, _), (_, o) in zip(_IMAGE_ATTENTION, _TEXT_ATTENTION, strict=True))

_JOINT, _DOUBLE = "joint_transformer_blocks.{i}", "double_layers.{i}"
_SINGLE, _SINGLE_ORIGINAL = "single_transformer_blocks.{i}", "single_layers.{i}"

# (diffusers module, release module); every linear layer is listed, so kohya spellings read back
_RENAMES = (
    *((f"{_JOINT}.attn.{d}", f"{_DOUBLE}.attn.{o}") for d, o in _IMAGE_ATTENTION + _TEXT_ATTENTION),
    *((f"{_JOINT}.ff.{d}", f"{_DOUBLE}.mlpX.{o}") for d, o in _FEED_FORWARD),
    *((f"{_JOINT}.ff_context.{d}", f"{_DOUBLE}.mlpC.{o}") for d, o in _FEED_FORWARD),
    (f"{_JOINT}.norm1.linear", f"{_DOUBLE}.modX.1"),
    (f"{_JOINT}.norm1_context.linear", f"{_DOUBLE}.modC.1"),
    *((f"{_SINGLE}.attn.{d}", f"{_SINGLE_ORIGINAL}.attn.{o}") for d, o in _SINGLE_ATTENTION),
    *((f"{_SINGLE}.ff.{d}", f"{_SINGLE_ORIGINAL}.mlp.{o}") for d, o in _FEED_FORWARD),
    (f"{_SINGLE}.norm1.linear", f"{_SINGLE_ORIGINAL}.modCX.1"),
    ("pos_embed.proj", "init_x_linear"),
    ("time_step_proj.linear_1", "t_embedder.mlp.0"),
    ("time_step_proj.linear_2", "t_embedder.mlp.2"),
    ("context_embedder", "cond_seq_linear"),
    ("proj_out", "final_linear"),
)

FINAL_MODULATION = ("norm_out.linear", "modF.1")
"""The output head's modulation: (scale, shift) rows in diffusers, (shift, scale) in the release."""

AURA_FLOW_KEYS = ArchitectureKeys(
    "aura_flow",
    _RENAMES,
    # ComfyUI's `model_lora_keys_unet` (`comfy/lora.py`, "Diffusers lora AuraFlow") maps `transformer.` +
    # diffusers' names through `comfy.utils.auraflow_to_diffusers`
    comfy_forms=("transformer.{d}",),
)
"""The adapter name map (diffusers module -> release module): renames only, nothing fused."""

AURA_FLOW_LAYOUT = CheckpointLayout(
    AURA_FLOW_KEYS,
    tensor_renames=(("pos_embed.pos_embed", "positional_encoding"), ("register_tokens", "register_tokens")),
    swapped_halves=(FINAL_MODULATION,),
)
"""The whole transformer checkpoint both ways (`to_original` / `to_diffusers`), at any size."""
