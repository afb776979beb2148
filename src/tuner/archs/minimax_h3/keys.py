"""MiniMax H3's release layout (the reference code's names: ComfyUI's `Comfy-Org/MiniMax-H3` single files)
relative to diffusers' `MiniMaxH3Transformer3DModel`.

The facts are those of diffusers' single-file converter (`convert_minimax_h3_transformer_checkpoint_to_diffusers`
in `diffusers/loaders/single_file_utils.py`) and its LoRA converter
(`_convert_non_diffusers_minimax_h3_lora_to_diffusers`, `loaders/lora_conversion_utils.py`), which read
these files: no prefix (`diffusion_model.` in LoRA files), `blocks.N` for `transformer_blocks.N`,
`token_refiner.blocks.N` for `token_refiner.refiner_blocks.N`, one `attn.qkv_proj` holding q, k, v
stacked (rows q; k; v, the published single files' order), `attn.out_proj`, `attn.q_norm` / `k_norm`, an
`mlp.fc1` whose two row halves are diffusers' `ff.net.0.proj` swapped (gate first; SwiGLU reads the value
first), `mlp.fc2`, and the embedders and heads renamed (`video_patch_proj`, `audio_patch_proj`,
`condition_proj`, `time_embedder.proj_in` / `proj_out`, `final_layer.*`). `rope.inv_freq` is stored
there and recomputed by diffusers.

`mlp.fc1` is a swapped layer, so it is not in the adapter map (an adapter's up rows would have to swap
with it); the fused `qkv_proj` is, as a fused layer.
"""

from __future__ import annotations

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.fused import FusedLayer
from tuner.networks.layouts import CheckpointLayout

# (diffusers block list, release block list)
_STACKS = (("transformer_blocks", "blocks"), ("token_refiner.refiner_blocks", "token_refiner.blocks"))

MINIMAX_H3_KEYS = ArchitectureKeys(
    "minimax_h3",
    (
        *(
            (f"{d}.{{i}}.{dm}", f"{o}.{{i}}.{om}")
            for d, o in _STACKS
            for dm, om in (("attn.to_out.0", "attn.out_proj"), ("ff.net.2", "mlp.fc2"))
        ),
        ("transformer_blocks.{i}.adaln_proj.linear", "blocks.{i}.adaln_proj.linear"),
        ("proj_in", "video_patch_proj"),
        ("audio_proj_in", "audio_patch_proj"),
        ("context_embedder", "condition_proj"),
        ("time_embedder.linear_1", "time_embedder.proj_in"),
        ("time_embedder.linear_2", "time_embedder.proj_out"),
        ("norm_out.linear", "final_layer.adaln_proj.linear"),
        ("norm_out.norm", "final_layer.norm"),
        ("proj_out", "final_layer.video_out"),
        ("audio_proj_out", "final_layer.audio_out"),
        ("token_refiner.final_norm", "token_refiner.final_norm"),
        *((f"{d}.{{i}}", f"{o}.{{i}}") for d, o in _STACKS),  # the norms keep their names
    ),
    tuple(
        FusedLayer(f"{o}.{{i}}.attn.qkv_proj", tuple(f"{d}.{{i}}.attn.to_{x}" for x in "qkv"))
        for d, o in _STACKS
    ),
)
"""The key table of MiniMax H3: module renames (diffusers, release) and the fused q, k, v."""

MINIMAX_H3_LAYOUT = CheckpointLayout(
    MINIMAX_H3_KEYS,
    tensor_renames=tuple(
        (f"{d}.{{i}}.attn.norm_{x}.weight", f"{o}.{{i}}.attn.{x}_norm.weight")
        for d, o in _STACKS
        for x in "qk"
    ),
    swapped_halves=tuple((f"{d}.{{i}}.ff.net.0.proj", f"{o}.{{i}}.mlp.fc1") for d, o in _STACKS),
    # diffusers' MiniMaxH3Transformer3DModel casts these layers' input (and `proj_out`'s, the final norm's
    # output) to their own dtype; `time_embedder` is `tuner.fp8.READ_FOR_DTYPE`
    read_for_dtype=(
        r"adaln_proj\.linear$",
        r"^norm_out\.linear$",
        r"^(audio_)?proj_in$",
        r"^context_embedder$",
        r"^proj_out$",
    ),
)
"""The whole transformer checkpoint, both directions."""

RECOMPUTED = ("rope.inv_freq",)
"""Tensors of the release's file that diffusers recomputes from the config."""
