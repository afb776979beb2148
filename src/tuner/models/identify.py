"""Recognising what a single checkpoint file holds: which architecture, which layout, which variant.

A single file says nothing about its hyperparameters, and diffusers' own guess goes to the Hugging Face
hub (and can be wrong: a tiny Wan T2V file was taken for `wan-i2v-14B`). So each architecture ships the
configs of the variants it knows and declares a *shape signature* for each: a few tensor names with
their shapes, or `None` for "must be absent" (which pins the number of blocks, or tells text-to-video
from image-to-video). `identify_single_file` reads only the file's header, recognises the key layout
(the original release's, or diffusers' saved as one file), picks the one variant whose signature
matches and checks that every expected tensor is there, so that loading never half-succeeds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from tuner.errors import CheckpointError
from tuner.models.loading import as_file_list, normalize_shapes, read_shapes_of, strip_known_prefixes

T = TypeVar("T")

# A few key fragments that identify common architectures, to say what a wrong file probably is.
_ARCHITECTURE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("a LoRA / adapter file, not a base model", ("lora_", ".lora.", "lora_A", "lora_down", "hada_", "lokr_")),
    ("FLUX (original BFL layout)", ("double_blocks.0.img_attn.qkv.weight",)),
    ("FramePack (architecture framepack)", ("clean_x_embedder.",)),
    ("HunyuanVideo (original layout)", ("double_blocks.0.img_attn_qkv.weight",)),
    (
        "HunyuanVideo 1.5 (architecture hunyuan_video15)",
        ("byt5_in.fc1.weight", "context_embedder_2.linear_1.weight"),
    ),
    ("AuraFlow (architecture aura_flow)", ("double_layers.0.attn.w1q.", "joint_transformer_blocks.0.")),
    ("FLUX / HunyuanVideo (diffusers layout)", ("single_transformer_blocks.0.",)),
    ("Qwen-Image", ("transformer_blocks.0.img_mod.",)),
    ("Krea 2 (architecture krea2)", ("txtfusion.projector.", "text_fusion.projector.")),
    ("ERNIE-Image (architecture ernie_image)", ("layers.0.adaLN_sa_ln.",)),
    ("HiDream-I1", ("double_stream_blocks.0.block.",)),
    ("Kandinsky 5 (architecture kandinsky5)", ("visual_transformer_blocks.0.visual_modulation.",)),
    ("Z-Image (architecture z_image)", ("x_pad_token", "cap_pad_token")),  # Lumina 2 has neither
    (
        "Lumina Image 2.0 (architecture lumina2)",
        ("cap_embedder.0.weight", "time_caption_embed.caption_embedder."),
    ),
    (
        'an SD / SDXL UNet (SDXL: model.architecture = "sdxl")',
        ("input_blocks.0.0.weight", "down_blocks.0.resnets.0.conv1.weight"),
    ),
    ("Stable Diffusion 3 / 3.5 MMDiT", ("joint_blocks.0.x_block.attn.qkv.weight",)),
    ("an LTX-2 transformer (architecture ltx2)", ("av_ca_a2v_gate_adaln_single.", "audio_patchify_proj.")),
    ("an LTX-Video 0.9 transformer (architecture ltx_video)", ("patchify_proj.weight",)),
    ("Wan 2.1 transformer (original layout)", ("blocks.0.self_attn.q.weight",)),
    ("Wan 2.1 transformer (diffusers layout)", ("blocks.0.attn1.to_q.weight",)),
    ("Wan VAE", ("encoder.downsamples.0.residual.0.gamma", "encoder.down_blocks.0.norm1.gamma")),
    ("the official Wan T5 encoder (models_t5_umt5-xxl-enc-*.pth)", ("token_embedding.weight",)),
    ("a T5 / UMT5 text encoder", ("encoder.block.0.layer.0.SelfAttention.q.weight",)),
    (
        "a Cosmos-Predict2 transformer (architecture cosmos_predict2; Video2World: cosmos_predict2_v2w)",
        ("blocks.0.adaln_modulation_self_attn.",),
    ),
)


# Keys that tell apart architectures sharing block names, for loaders refusing a sibling's file:
# Chroma is FLUX.1-schnell's names plus a guidance approximator; FLUX.2 modulates per kind of block
# (its key in the release's and in diffusers' layout).
CHROMA_MARKER = "distilled_guidance_layer.in_proj.weight"
FLUX2_MARKERS = ("double_stream_modulation_img.lin.weight", "double_stream_modulation_img.linear.weight")


@dataclass(frozen=True)
class Variant:
    """A known variant of an architecture: its shipped config folder and the shapes that identify it."""

    name: str
    config_dir: Path
    # tensor name (in the layout the matcher is given) -> exact shape, or None: the tensor must be absent
    signature: Mapping[str, tuple[int, ...] | None]

    def mismatches(self, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
        """Human-readable reasons why `shapes` is not this variant (empty when it is)."""
        reasons = []
        for name, want in self.signature.items():
            got = shapes.get(name)
            if want is None and got is not None:
                reasons.append(f"{name} present")
            elif want is not None and got is None:
                reasons.append(f"{name} missing")
            elif want is not None and tuple(got) != tuple(want):
                reasons.append(f"{name} {tuple(got)} != {tuple(want)}")
        return reasons


UNCHECKED = "unchecked"
"""A `variant_table` cell for a tensor that variant's signature leaves out."""


def variant_table(folder: Path, columns: tuple[str, ...], rows: Mapping[str, tuple]) -> tuple[Variant, ...]:
    """Known variants written as a table: the signature's tensor names (`columns`) and, per variant name,
    one cell per column; each variant's config folder is `folder / name`.

    A cell is a shape, `None` (the tensor must be absent) or `UNCHECKED` (not in that variant's
    signature). A column with `{}` (a block index) pins a stack's depth: its cell is (number of blocks,
    the last block's shape), which puts the last block's tensor with that shape, then the next block's
    as absent, in the signature."""
    variants = []
    for name, cells in rows.items():
        signature: dict[str, tuple[int, ...] | None] = {}
        for column, cell in zip(columns, cells, strict=True):
            if cell == UNCHECKED:
                continue
            if "{}" in column:
                blocks, shape = cell
                signature[column.format(blocks - 1)] = shape
                signature[column.format(blocks)] = None
            else:
                signature[column] = cell
        variants.append(Variant(name, folder / name, signature))
    return tuple(variants)


def pick_variant(
    shapes: Mapping[str, tuple[int, ...]], variants: Iterable[Variant], path: str | Path, what: str
) -> Variant:
    """The single variant whose signature `shapes` match, or a CheckpointError listing the closest."""
    variants = list(variants)
    found = [v for v in variants if not v.mismatches(shapes)]
    if len(found) == 1:
        return found[0]
    if len(found) > 1:  # a bug in the shipped signatures, not in the user's file
        raise AssertionError(f"{what}: signatures of {[v.name for v in found]} all match {path}")
    closest = min(variants, key=lambda v: len(v.mismatches(shapes)))
    raise CheckpointError(
        f"{path}: a {what} checkpoint of a variant tuner does not know. Known variants: "
        f"{', '.join(v.name for v in variants)}; closest is {closest.name}, but "
        f"{'; '.join(closest.mismatches(shapes)[:4])}. Use a supported variant or a diffusers folder "
        "(with its config.json)."
    )


def guess_architecture(names: Iterable[str]) -> str | None:
    """A best guess at what a checkpoint is, from its key names, for error messages."""
    names = list(strip_known_prefixes(names))
    for label, markers in _ARCHITECTURE_MARKERS:
        if any(marker in name for marker in markers for name in names):
            return label
    return None


def wrong_architecture(
    path: str | Path, names: Iterable[str], what: str, expected_keys: Iterable[str]
) -> CheckpointError:
    """The error for a file that is not a `what` checkpoint at all."""
    names = list(names)
    guess = guess_architecture(names)
    looks_like = f" It looks like {guess}." if guess else ""
    return CheckpointError(
        f"{path}: not a {what} checkpoint: it lacks the keys that identify one ({', '.join(expected_keys)}; "
        f"its first keys are {', '.join(names[:3])}).{looks_like} Point to a {what} file or diffusers folder."
    )


def check_keys(expected: Iterable[str], found: Iterable[str], path: str | Path, what: str) -> None:
    """Raise CheckpointError unless `found` holds exactly the `expected` tensor names."""
    expected, found = set(expected), set(found)
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
    raise CheckpointError(
        f"{path}: does not match the {what} layout: {'; '.join(parts)} keys. The file may be a different "
        "model variant, a partial save or an adapter; use the complete base-model file."
    )


@dataclass(frozen=True)
class SingleFileSpec:
    """How to recognise one component (a transformer, a VAE, a text encoder) in a single file."""

    what: str  # for messages, e.g. "Wan 2.1 transformer"
    variants: tuple[Variant, ...]
    # tensor names (original layout) the variant's file must hold, exactly
    expected_keys: Callable[[Variant], Iterable[str]]
    # keys every file in the original layout has; how the layout is recognised
    original_markers: tuple[str, ...]
    # keys every file saved in diffusers' layout has, and how to rename those keys to the original layout
    diffusers_markers: tuple[str, ...] = ()
    to_original: Callable[[str], str] | None = None
    # tied-weight aliases: alias -> canonical name; the alias is dropped, or renamed when alone
    aliases: Mapping[str, str] = field(default_factory=dict)
    # raises a CheckpointError naming a known file of a model tuner does not train (SD 3.0 given as SD 3.5),
    # given the shapes and the path before identification
    refuse: Callable[[Mapping[str, tuple[int, ...]], Path], None] | None = None


def apply_aliases(tensors: Mapping[str, T], aliases: Mapping[str, str]) -> dict[str, T]:
    """Drop tied-weight aliases, or rename an alias to its canonical name when only the alias is stored."""
    out = dict(tensors)
    for alias, canonical in aliases.items():
        if alias in out:
            value = out.pop(alias)
            out.setdefault(canonical, value)
    return out


def identify_single_file(files: str | Path | Sequence[Path], spec: SingleFileSpec) -> Variant:
    """Check that a single file (or the shards of one) is a complete `spec.what` of a known variant.

    Reads only headers. Returns the variant, whose `config_dir` is the config the model is built from.
    """
    files = as_file_list(files)
    path = files[0] if len(files) == 1 else files[0].parent
    return identify_shapes(normalize_shapes(read_shapes_of(files)), spec, path)


def identify_shapes(shapes: Mapping[str, tuple[int, ...]], spec: SingleFileSpec, path: str | Path) -> Variant:
    """`identify_single_file` on shapes already read (prefixes stripped), e.g. one component of a file
    that bundles several (SD3's `text_encoders.clip_g.*` beside the transformer)."""
    if spec.refuse is not None:
        spec.refuse(shapes, Path(path))
    shapes = apply_aliases(shapes, spec.aliases)
    if all(k in shapes for k in spec.original_markers):
        original = shapes
    elif spec.diffusers_markers and all(k in shapes for k in spec.diffusers_markers):
        original = {_to_original_or_keep(spec, k): v for k, v in shapes.items()}
    else:
        raise wrong_architecture(path, shapes, spec.what, spec.original_markers + spec.diffusers_markers)
    variant = pick_variant(original, spec.variants, path, spec.what)
    check_keys(spec.expected_keys(variant), original, path, f"{spec.what} {variant.name}")
    return variant


def _to_original_or_keep(spec: SingleFileSpec, key: str) -> str:
    try:
        return spec.to_original(key)
    except KeyError:  # left as is, so that check_keys reports it as unexpected
        return key


def diffusers_meta_keys(model_cls: type, config_dir: Path) -> list[str]:
    """State-dict keys of a diffusers model built from `config_dir` on the meta device (no memory).

    Built once per (class, folder) in a process: building costs about half of a small model's load, and
    every load of a single file asks again. Never invalidated: the folders are the variants' configs that
    ship inside the package, which nothing writes while a process runs."""
    return list(_meta_keys(model_cls, Path(config_dir)))


@functools.cache
def _meta_keys(model_cls: type, config_dir: Path) -> tuple[str, ...]:
    with torch.device("meta"):
        model = model_cls.from_config(model_cls.load_config(config_dir))
    return tuple(model.state_dict())
