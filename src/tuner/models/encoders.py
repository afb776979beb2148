"""One loader for a transformers encoder (a text encoder, an image encoder) in either layout users hold.

The diffusers-component loader (`tuner.models.component`) has a twin for the transformers models that
turn captions and images into conditioning: a pipeline's `text_encoder*/` folder goes through
`from_pretrained`, and a single file (ComfyUI's `t5xxl_fp16.safetensors`, a Llama or Gemma shard set) is
identified by its `SingleFileSpec` (headers only), normalized (prefixes, fp8, tied-weight aliases),
renamed to the model's keys where the release names them otherwise, and built from the variant's shipped
config. A single file carries no tokenizer, so only the folder layout finds one (beside the encoder).

CLIP text encoders (`load_clip_encoder`) and image encoders (`load_image_encoder`: CLIP vision, SigLIP)
are the same loader with one more step: a file holds more than the model (a CLIP model's `logit_scale`, a
projection or pooling head the model lacks or does not need, transformers 4's `text_model.` /
`vision_model.` level), or sits in a checkpoint that bundles every component under a prefix, so its
entries are picked and renamed (`entries`) before it is identified. A CLIP text model's number of
positions is read from the file (Long-CLIP has 248); an image encoder's processor config is the folder
beside it, or the one shipped with its variant.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from tuner.errors import CheckpointError
from tuner.models.component import read_single_file
from tuner.models.identify import SingleFileSpec, Variant
from tuner.models.loading import (
    assert_materialized,
    cast_like_from_pretrained_,
    load_transformers_folder,
    read_folder_config,
    resolve_folder,
    sibling,
)

StateDict = dict[str, torch.Tensor]
T = TypeVar("T")


# `variant_table` columns shared by the encoders of several families ({}: the block index)
T5_COLUMNS = ("shared.weight", "encoder.block.{}.layer.1.DenseReluDense.wi_0.weight")
"""A T5 v1.1 / UMT5 encoder: embedding (vocabulary, width), blocks (count, gated feed-forward shape)."""
DECODER_COLUMNS = ("embed_tokens.weight", "layers.{}.mlp.gate_proj.weight")
"""A decoder-only language model's base model (Llama, Gemma, Qwen): embedding, layers (count, gate
shape); a causal LM's file names them behind `model.` (`CAUSAL_LM_COLUMNS`)."""
CAUSAL_LM_COLUMNS = tuple("model." + column for column in DECODER_COLUMNS)
CLIP_COLUMNS = ("embeddings.token_embedding.weight", "encoder.layers.{}.mlp.fc1.weight")
"""A CLIP text model: token embedding (vocabulary, width), layers (count, first MLP layer shape)."""


def load_encoder(
    path: str | Path,
    dtype: torch.dtype,
    model_cls: type,
    model_type: str,
    folders: tuple[str, str],
    spec: SingleFileSpec,
    rename: Callable[[StateDict], StateDict] | None = None,
    entries: Callable[[StateDict], StateDict] = dict,
    bundled: tuple[str, ...] = (),
) -> tuple[torch.nn.Module, Path | None]:
    """A `model_cls` from a pipeline's (or its own) folder or a single file, in eval mode, and the tokenizer
    folder beside it in a diffusers layout (else None). `folders` = (the encoder's pipeline subfolder, its
    tokenizer's), e.g. ("text_encoder_2", "tokenizer_2"); `model_type` is what its config.json must say.
    A single file is the encoder alone or a checkpoint holding it under the first of `bundled` it uses."""
    subfolder, tokenizer = folders
    folder = resolve_folder(path, subfolder)
    if folder is not None:
        return load_transformers_folder(model_cls, folder, dtype, model_type), sibling(folder, tokenizer)
    return load_encoder_file(path, dtype, model_cls, spec, rename, entries, bundled), None


def load_encoder_file(
    files: str | Path | Sequence[Path],
    dtype: torch.dtype,
    model_cls: type,
    spec: SingleFileSpec,
    rename: Callable[[StateDict], StateDict] | None = None,
    entries: Callable[[StateDict], StateDict] = dict,
    bundled: tuple[str, ...] = (),
) -> torch.nn.Module:
    """`load_encoder` for a single file (or the shards of one): read by `read_single_file`, `rename`d to
    `model_cls`' keys, built from the variant's config, in eval mode."""
    variant, _, state_dict = read_single_file(files, dtype, spec, entries, bundled)
    if rename is not None:
        state_dict = rename(state_dict)
    config = model_cls.config_class.from_pretrained(variant.config_dir)
    return encoder_from_state_dict(model_cls, config, state_dict, dtype)


def load_encoder_file_on_meta(
    path: str | Path,
    dtype: torch.dtype,
    model_cls: type,
    spec: SingleFileSpec,
    rename: Callable[[StateDict], StateDict],
    what: str,
    entries: Callable[[StateDict], StateDict] = dict,
) -> torch.nn.Module:
    """`load_encoder_file` for models `from_pretrained` cannot be handed a state dict of (Qwen2.5-VL, Qwen3):
    built on the meta device (rotary tables are real buffers) with SDPA attention (what `from_pretrained`
    picks, so both layouts compute alike), given exactly the file's tensors (picked by `entries`, see
    `read_single_file`) `rename`d to its keys, and cast the way `from_pretrained` casts. Not in eval mode."""
    from accelerate import init_empty_weights

    variant, _, stored = read_single_file(path, dtype, spec, entries)
    config = model_cls.config_class.from_pretrained(variant.config_dir)
    config._attn_implementation = "sdpa"
    with init_empty_weights():
        model = model_cls(config)
    try:
        model.load_state_dict(rename(stored), strict=True, assign=True)
    except (KeyError, RuntimeError) as e:
        raise CheckpointError(f"{path}: cannot be loaded as {what}: {e}") from None
    assert_materialized(model, path)
    cast_like_from_pretrained_(model, dtype)
    return model


def encoder_from_state_dict(
    model_cls: type, config, state_dict: StateDict, dtype: torch.dtype
) -> torch.nn.Module:
    """A transformers `model_cls` of `config` holding `state_dict` (its keys), in `dtype`, in eval mode."""
    return model_cls.from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype).eval()


def causal_lm_key(key: str) -> str:
    """A base model's key (`layers.0...`) as a causal language model's file names it (`model.layers.0...`):
    a `SingleFileSpec.to_original` for the decoder-only text encoders (Gemma, Llama, Qwen)."""
    return key if key.startswith("model.") else f"model.{key}"


def base_model_keys(state_dict: StateDict) -> StateDict:
    """A causal language model's tensors under its base model's keys (`model.layers.0.*` -> `layers.0.*`):
    the released files are saved from the `...ForCausalLM`, the text encoders are its base model."""
    return {k.removeprefix("model."): v for k, v in state_dict.items()}


# ---------------------------------------------------------------------------------------------------
# CLIP text encoders
# ---------------------------------------------------------------------------------------------------

# Entries of a CLIP file that no text model holds: the contrastive temperature, the position-id buffer.
CLIP_EXTRAS = ("logit_scale", "text_model.embeddings.position_ids")
_TEXT_MODEL = "text_model."
_POSITIONS = "embeddings.position_embedding.weight"


def clip_with_projection_entries(entries: dict[str, T]) -> dict[str, T]:
    """A CLIP file's entries under `CLIPTextModelWithProjection`'s names (the file's own, the extras left
    out)."""
    return {k: v for k, v in entries.items() if k not in CLIP_EXTRAS}


def clip_text_entries(entries: dict[str, T]) -> dict[str, T]:
    """A CLIP file's entries under `CLIPTextModel`'s names: the extras and the projection left out,
    transformers 4's `text_model.` level dropped (transformers 5's `CLIPTextModel` has none)."""
    named = clip_with_projection_entries(entries)
    return {k.removeprefix(_TEXT_MODEL): v for k, v in named.items() if k != "text_projection.weight"}


def model_keys(
    class_name: str,
    leave_out: tuple[str, ...] = (),
    prefix: str = "",
    to_original: Callable[[str], str] | None = None,
) -> Callable[[Variant], list[str]]:
    """A `SingleFileSpec.expected_keys`: the state-dict keys of the transformers model `class_name` (imported
    when called: it costs seconds) of a variant's config, less those starting with one of `leave_out`,
    each renamed by `to_original` (the release's layout) and behind `prefix`."""

    def expected_keys(variant: Variant) -> list[str]:
        import transformers

        model_cls = getattr(transformers, class_name)
        with torch.device("meta"):
            model = model_cls(model_cls.config_class.from_pretrained(variant.config_dir))
        keys = [k for k in model.state_dict() if not k.startswith(leave_out)]
        return [prefix + (to_original(k) if to_original is not None else k) for k in keys]

    return expected_keys


def load_clip_encoder(
    path: str | Path,
    dtype: torch.dtype,
    model_cls: type,
    folders: tuple[str, str],
    spec: SingleFileSpec,
    entries: Callable[[StateDict], StateDict],
    bundled: tuple[str, ...] = (),
    complete: Callable[[StateDict], StateDict] | None = None,
) -> tuple[torch.nn.Module, Path | None]:
    """A CLIP text model (`CLIPTextModel` or `...WithProjection`) from a pipeline's (or its own) folder or
    a single file, in eval mode, and the tokenizer folder beside it in a diffusers layout (else None).

    A single file is the encoder alone or a checkpoint holding it under the first of `bundled` it uses;
    its (normalized) entries are put under `model_cls`' names by `entries`, identified by `spec` in those
    names, and `complete`d (e.g. with a projection the release leaves out) before the model is built."""
    subfolder, tokenizer = folders
    folder = resolve_folder(path, subfolder)
    if folder is not None:
        model = load_transformers_folder(model_cls, folder, dtype, "clip_text_model")
        return model, sibling(folder, tokenizer)
    variant, shapes, state_dict = read_single_file(path, dtype, spec, entries, bundled)
    if complete is not None:
        state_dict = complete(state_dict)
    config = model_cls.config_class.from_pretrained(variant.config_dir)
    # the file's own number of positions (Long-CLIP's 248; 77 everywhere else), not the shipped config's
    config.max_position_embeddings = shapes.get(_POSITIONS, shapes.get(_TEXT_MODEL + _POSITIONS))[0]
    return encoder_from_state_dict(model_cls, config, state_dict, dtype), None


def load_image_encoder(
    path: str | Path,
    dtype: torch.dtype,
    model_cls: type,
    folders: tuple[str, str],
    spec: SingleFileSpec,
    entries: Callable[[StateDict], StateDict],
    optional: tuple[str, ...] = (),
) -> tuple[torch.nn.Module, Path]:
    """An image encoder (`CLIPVisionModel`, `SiglipVisionModel`) from a pipeline's (or its own) folder or a
    single file, in eval mode, and the folder of its processor config. `folders` = (the encoder's
    pipeline subfolder, its processor's), e.g. ("image_encoder", "feature_extractor").

    A file's entries are put under `spec`'s names by `entries`; those starting with one of `optional`
    (SigLIP's pooling head, which the pipelines do not use) are left out of identification and loaded
    as zeros when the file lacks them."""
    subfolder, processor = folders
    what = model_cls.__name__
    folder = resolve_folder(path, subfolder)
    if folder is not None:
        model_type = model_cls.config_class.model_type
        found = read_folder_config(folder).get("model_type")
        if found not in (model_type, model_type.removesuffix("_vision_model")):  # the vision or whole model
            raise CheckpointError(f"{folder}: config.json describes a {found!r} model, not a {what}.")
        try:
            model = model_cls.from_pretrained(folder, dtype=dtype, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{folder}: cannot be loaded as a {what}: {e}") from None
        if (folder.parent / processor / "preprocessor_config.json").is_file():
            return model.eval(), folder.parent / processor
        return model.eval(), _shipped_processor(model_cls, model.config, spec, folder.parent / processor)
    variant, _, state_dict = read_single_file(path, dtype, spec, entries, optional=optional)
    config = model_cls.config_class.from_pretrained(variant.config_dir)
    if optional:
        with torch.device("meta"):
            full = model_cls(config).state_dict()
        zeros = {k: torch.zeros(v.shape, dtype=dtype) for k, v in full.items() if k.startswith(optional)}
        state_dict = zeros | state_dict
    return encoder_from_state_dict(model_cls, config, state_dict, dtype), variant.config_dir


def _shipped_processor(model_cls: type, config, spec: SingleFileSpec, missing: Path) -> Path:
    """The shipped variant's folder (config and processor config) of an encoder folder's sizes, for a
    pipeline without its `missing` processor folder."""
    sizes = ("hidden_size", "image_size", "num_hidden_layers")
    for variant in spec.variants:
        shipped = model_cls.config_class.from_pretrained(variant.config_dir)
        if all(getattr(shipped, k) == getattr(config, k) for k in sizes):
            return variant.config_dir
    raise CheckpointError(
        f"{missing.parent}: no {missing.name}/ folder beside the {spec.what} (width {config.hidden_size}, "
        f"{config.image_size} px), and no shipped variant of its sizes: add the folder (its "
        "preprocessor_config.json)."
    )
