"""One loader for a transformers encoder (a text encoder, an image encoder) in either layout users hold.

The diffusers-component loader (`tuner.models.component`) has a twin for the transformers models that
turn captions and images into conditioning: a pipeline's `text_encoder*/` folder goes through
`from_pretrained`, and a single file (ComfyUI's `t5xxl_fp16.safetensors`, a Llama or Gemma shard set) is
identified by its `SingleFileSpec` (headers only), normalized (prefixes, fp8, tied-weight aliases),
renamed to the model's keys where the release names them otherwise, and built from the variant's shipped
config. A single file carries no tokenizer, so only the folder layout finds one (beside the encoder).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tuner.models.identify import SingleFileSpec, apply_aliases, identify_single_file
from tuner.models.loading import (
    load_tensors_of,
    load_transformers_folder,
    normalize_state_dict,
    resolve_folder,
    sibling,
)

StateDict = dict[str, torch.Tensor]


def load_encoder(
    path: str | Path,
    dtype: torch.dtype,
    model_cls: type,
    model_type: str,
    folders: tuple[str, str],
    spec: SingleFileSpec,
    rename: Callable[[StateDict], StateDict] | None = None,
) -> tuple[torch.nn.Module, Path | None]:
    """A `model_cls` from a pipeline's (or its own) folder or a single file, in eval mode, and the tokenizer
    folder beside it in a diffusers layout (else None). `folders` = (the encoder's pipeline subfolder, its
    tokenizer's), e.g. ("text_encoder_2", "tokenizer_2"); `model_type` is what its config.json must say."""
    subfolder, tokenizer = folders
    folder = resolve_folder(path, subfolder)
    if folder is not None:
        return load_transformers_folder(model_cls, folder, dtype, model_type), sibling(folder, tokenizer)
    return load_encoder_file(path, dtype, model_cls, spec, rename), None


def load_encoder_file(
    files: str | Path | Sequence[Path],
    dtype: torch.dtype,
    model_cls: type,
    spec: SingleFileSpec,
    rename: Callable[[StateDict], StateDict] | None = None,
) -> torch.nn.Module:
    """`load_encoder` for a single file (or the shards of one): identified by `spec`, its tied-weight
    aliases resolved, `rename`d to `model_cls`' keys, built from the variant's config, in eval mode."""
    variant = identify_single_file(files, spec)
    state_dict = apply_aliases(normalize_state_dict(load_tensors_of(files), dtype), spec.aliases)
    if rename is not None:
        state_dict = rename(state_dict)
    config = model_cls.config_class.from_pretrained(variant.config_dir)
    return model_cls.from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype).eval()


def base_model_keys(state_dict: StateDict) -> StateDict:
    """A causal language model's tensors under its base model's keys (`model.layers.0.*` -> `layers.0.*`):
    the released files are saved from the `...ForCausalLM`, the text encoders are its base model."""
    return {k.removeprefix("model."): v for k, v in state_dict.items()}
