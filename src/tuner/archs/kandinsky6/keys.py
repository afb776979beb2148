"""Kandinsky 6's release layout (the reference code's names, which ComfyUI's Kandinsky 6 model loads)
relative to diffusers' `Kandinsky6Transformer3DModel`.

The renames are those ComfyUI's Kandinsky 6 detection applies to a diffusers-named file (its tests'
`_DIFFUSERS_TO_NATIVE`; `comfy/ldm/kandinsky6`): `visual_blocks.N` for `visual_transformer_blocks.N`,
`videoT` / `audioT` for `video_dec_block` / `audio_dec_block`, `feed_forward.in_layer` / `out_layer` for
`feed_forward.net.0.proj` / `net.2`, the text blocks' `self_attention` for `attn`, the time embeddings'
`in_layer` / `out_layer` for `timestep_embedder.linear_1` / `linear_2`, and `audio_outLayer` for
`audio_out_layer`; every other name is diffusers' own. No layer is fused or split.
"""

from __future__ import annotations

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

_FEED_FORWARD = (
    ("feed_forward.net.0.proj", "feed_forward.in_layer"),
    ("feed_forward.net.2", "feed_forward.out_layer"),
)
_STREAMS = (("video", "videoT"), ("audio", "audioT"))


def _renames() -> tuple[tuple[str, str], ...]:
    text = [
        (f"{s}_text_transformer_blocks.{{i}}.{d}", f"{s}_text_transformer_blocks.{{i}}.{o}")
        for s, _ in _STREAMS
        for d, o in (("attn", "self_attention"), *_FEED_FORWARD, ("", ""))
    ]
    fused = [
        (f"visual_transformer_blocks.{{i}}.{s}_dec_block.{d}", f"visual_blocks.{{i}}.{t}.{o}")
        for s, t in _STREAMS
        for d, o in (*_FEED_FORWARD, ("", ""))
    ]
    time = [
        (f"{s}_time_embeddings.timestep_embedder.linear_{n}", f"{s}_time_embeddings.{o}")
        for s, _ in _STREAMS
        for n, o in ((1, "in_layer"), (2, "out_layer"))
    ]
    same = [
        "visual_embeddings", "visual_token_type_embeddings", "out_layer", "audio_embeddings",
        *(f"{s}_{m}" for s, _ in _STREAMS for m in ("text_embeddings", "pooled_text_embeddings")),
    ]  # fmt: skip
    pairs = [
        *text,
        *fused,
        ("visual_transformer_blocks.{i}", "visual_blocks.{i}"),  # cross-attention, modulations, norms
        *time,
        ("audio_out_layer", "audio_outLayer"),
        *((name, name) for name in same),
    ]
    return tuple((d.rstrip("."), o.rstrip(".")) for d, o in pairs)


_ATTENTION = ("to_query", "to_key", "to_value", "out_layer")


def _linears() -> tuple[str, ...]:
    """Every linear layer's diffusers name (adapters' modules: their kohya stems must read back)."""
    block = ("self_attention", "cross_attention")
    return (
        *(f"{s}_text_transformer_blocks.{{i}}.{m}" for s, _ in _STREAMS for m in (
            "text_modulation.out_layer", *(f"attn.{p}" for p in _ATTENTION), *(d for d, _ in _FEED_FORWARD))),
        *(f"visual_transformer_blocks.{{i}}.{s}_dec_block.{m}" for s, _ in _STREAMS for m in (
            "visual_modulation.out_layer", *(f"{a}.{p}" for a in block for p in _ATTENTION),
            *(d for d, _ in _FEED_FORWARD))),
        *(f"visual_transformer_blocks.{{i}}.{a}.{p}" for a in ("va_cross_attention", "av_cross_attention")
          for p in _ATTENTION),
        *(f"visual_transformer_blocks.{{i}}.{m}_modulation.out_layer" for m in ("va", "av")),
        *(f"{s}_{m}" for s, _ in _STREAMS for m in ("time_embeddings.timestep_embedder.linear_1",
          "time_embeddings.timestep_embedder.linear_2", "text_embeddings.in_layer", "pooled_text_embeddings.in_layer")),
        "visual_embeddings.in_layer", "audio_embeddings.in_layer", "out_layer.modulation.out_layer",
        "out_layer.out_layer", "audio_out_layer.modulation.out_layer", "audio_out_layer.out_layer",
    )  # fmt: skip


def _with_linears(prefixes: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """Each linear layer renamed by the first module rename that covers it, listed first (a kohya stem
    reads back only from a whole module's name), then the module renames themselves."""

    def original(name: str) -> str:
        for d, o in prefixes:
            if name == d or name.startswith(d + "."):
                return o + name[len(d) :]
        raise KeyError(name)

    return (*((name, original(name)) for name in _linears()), *prefixes)


KANDINSKY6_KEYS = ArchitectureKeys("kandinsky6", _with_linears(_renames()))
"""The key table of Kandinsky 6: module renames (diffusers, release)."""
KANDINSKY6_LAYOUT = CheckpointLayout(
    KANDINSKY6_KEYS,
    # diffusers' Kandinsky6Modulation and time embeddings cast their input to these layers' dtype
    read_for_dtype=(r"modulation\.out_layer$", r"timestep_embedder\."),
)
