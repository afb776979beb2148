"""Kandinsky 6's key table: diffusers' module names (`Kandinsky6Transformer3DModel`), which tuner's single
files and adapters use as they are (`same_names`); the linear layers are listed so kohya stems read back."""

from __future__ import annotations

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

_ATTENTION = ("to_query", "to_key", "to_value", "out_layer")
_FEED_FORWARD = ("feed_forward.net.0.proj", "feed_forward.net.2")


def _linears() -> tuple[str, ...]:
    text = [
        f"{stream}_text_transformer_blocks.{{i}}.{m}"
        for stream in ("video", "audio")
        for m in ("text_modulation.out_layer", *(f"attn.{p}" for p in _ATTENTION), *_FEED_FORWARD)
    ]
    fused = [
        f"visual_transformer_blocks.{{i}}.{stream}_dec_block.{m}"
        for stream in ("video", "audio")
        for m in (
            "visual_modulation.out_layer",
            *(f"{a}.{p}" for a in ("self_attention", "cross_attention") for p in _ATTENTION),
            *_FEED_FORWARD,
        )
    ]
    cross = [
        f"visual_transformer_blocks.{{i}}.{m}"
        for m in (
            *(f"{a}.{p}" for a in ("va_cross_attention", "av_cross_attention") for p in _ATTENTION),
            "va_modulation.out_layer",
            "av_modulation.out_layer",
        )
    ]
    heads = [
        f"{stream}_{m}"
        for stream in ("video", "audio")
        for m in (
            "time_embeddings.timestep_embedder.linear_1",
            "time_embeddings.timestep_embedder.linear_2",
            "text_embeddings.in_layer",
            "pooled_text_embeddings.in_layer",
        )
    ]
    ends = ("visual_embeddings.in_layer", "audio_embeddings.in_layer", "out_layer.modulation.out_layer",
            "out_layer.out_layer", "audio_out_layer.modulation.out_layer", "audio_out_layer.out_layer")  # fmt: skip
    return (*text, *fused, *cross, *heads, *ends)


KANDINSKY6_KEYS = ArchitectureKeys("kandinsky6", tuple((n, n) for n in _linears()), same_names=True)
KANDINSKY6_LAYOUT = CheckpointLayout(KANDINSKY6_KEYS)
