"""Text encoders that train (`network.train_text_encoder`): an adapter on the text encoders beside the
denoiser's, in the same network and the same file.

The record names its family's `TrainableTextEncoders` (`text_encoder_training = "module:Class"`): how the
encoders load as one module named as their adapters are, their adapter targets, what tokenizes captions
and which stems of an adapter file are theirs. Shared code calls it at one point each:

- training: `ArchitectureModel.build_trained` joins the encoders' adapter to the denoiser's
  (`join_text_adapters`; their own learning rate with `network.text_encoder_lr`) and keeps the encoders
  as `family.trained_text`, which the family's `predict` runs at every step;
- caching (`tuner.cache`): the text cache then holds token ids, not encoder outputs (`text_cache_encoder`,
  `encode_text_cache`);
- generation (`tuner.generate`): the denoiser takes the denoiser's part of each adapter file
  (`attach_to_denoiser`), the text encoders the rest (`attach_text_adapters`).
"""

from __future__ import annotations

import torch
from torch import nn


class TrainableTextEncoders:
    """What a family whose text encoders train implements; `family` is its `ArchitectureModel`."""

    targets: tuple[str, ...] = ()
    """Regexes over `load_trained`'s module names of the linear layers the adapter trains."""
    prefixes: tuple[str, ...] = ()
    """The module-name prefixes of the encoders in `load_trained` (their adapters' learning-rate groups)."""

    def __init__(self, family):
        self.family = family

    def load_trained(self, dtype: torch.dtype) -> nn.Module:
        """The text encoders as one frozen module, named as their adapters are (on the CPU)."""
        raise NotImplementedError

    def in_encoder(self, encoder) -> nn.Module:
        """The encoders of what the family's `load_text_encoder` returned, as one module named as
        `load_trained`'s (what an adapter file's text-encoder parts attach to)."""
        raise NotImplementedError

    def load_tokenizers(self):
        """What `token_ids` takes (the text cache's encoder while the encoders train)."""
        raise NotImplementedError

    def token_ids(self, tokenizers, captions: list[str]) -> list[dict[str, torch.Tensor]]:
        """One text cache entry of token ids per caption, as the family's `collate_text` and `predict` take
        them."""
        raise NotImplementedError

    def owns(self, stem: str) -> bool:
        """Whether an adapter file's stem (in any layout) names a text encoder's module."""
        raise NotImplementedError


def join_text_adapters(family, network, device: torch.device):
    """`network` (the denoiser's adapter) joined with one on the text encoders, which are loaded here in
    `model.dtype` on `device` and kept as `family.trained_text`."""
    from tuner.dtypes import DTYPES
    from tuner.networks.factory import build_network

    cfg, part = family.cfg, family.text_encoders()
    family.trained_text = part.load_trained(DTYPES[cfg.model.dtype]).requires_grad_(False).to(device)
    text = build_network(family.trained_text, part.targets, cfg.network, family.layout, seed=cfg.train.seed,
                         save_format=cfg.save.format)  # fmt: skip
    joined = type(network)([*network, *text], name_map=family.layout, prefix=network.prefix)
    if cfg.network.text_encoder_lr:
        joined.lr_by_prefix = dict.fromkeys(part.prefixes, cfg.network.text_encoder_lr)
    return joined


def text_cache_encoder(family, device: torch.device, dtype: str):
    """What `tuner cache text` encodes with: the family's text encoder, or while the encoders train
    their tokenizers."""
    if family.trains_text_encoder:
        return family.text_encoders().load_tokenizers()
    return family.load_text_encoder(device, dtype)


def encode_text_cache(family, encoder, captions: list[str], controls) -> list[dict[str, torch.Tensor]]:
    """The text cache entries of `captions`: the family's `encode_text`, or while the encoders train
    their token ids."""
    if family.trains_text_encoder:
        return family.text_encoders().token_ids(encoder, captions)
    return family.encode_text(encoder, captions, controls)


def attach_to_denoiser(family, model: nn.Module, path: str, strength: float):
    """Generation: an adapter file onto the denoiser (`tuner.networks.apply_adapter_file`), without
    the text encoders' parts it may hold."""
    from tuner.networks.factory import apply_adapter_file

    keep = None
    if family.record.text_encoder_training:
        part = family.text_encoders()
        keep = lambda stem: not part.owns(stem)  # noqa: E731
    return apply_adapter_file(model, path, strength, name_map=family.layout, keep=keep)


def attach_text_adapters(family, encoder, loras: list[tuple[str, float]]) -> None:
    """Generation: the text encoders' parts of each adapter file onto what `load_text_encoder` returned;
    nothing for a family whose encoders do not train."""
    if not family.record.text_encoder_training:
        return
    from tuner.networks.factory import apply_adapter_file
    from tuner.networks.formats import read_modules

    part = family.text_encoders()
    module = part.in_encoder(encoder)
    device = next(module.parameters()).device
    for path, strength in loras:
        if any(part.owns(stem) for stem in read_modules(path)[0]):
            apply_adapter_file(module, path, strength, name_map=family.layout, keep=part.owns).to(device)
