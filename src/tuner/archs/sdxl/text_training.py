"""SDXL's text encoders as they train (`tuner.archs.parts.text_encoder_training`): CLIP-L and bigG under
one module (`te1.` / `te2.`), every linear layer of their attention and MLPs adapted (kohya's set), saved
as kohya's `lora_te1_*` / `lora_te2_*` parts (see `tuner.archs.sdxl.keys`)."""

from __future__ import annotations

import torch

from tuner.archs.parts.text_encoder_training import TrainableTextEncoders
from tuner.archs.sdxl import loaders as sdxl
from tuner.archs.sdxl.keys import TEXT_ENCODER_STEMS, is_text_encoder_stem

# the text encoders' adapter targets (`network.train_text_encoder`): kohya's, every linear layer of the
# CLIP attention and MLP blocks, in both encoders
TEXT_ENCODER_TARGETS = (
    r"te[12]\.text_model\.encoder\.layers\.\d+\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])",
)


class SDXLTextEncoders(TrainableTextEncoders):
    targets = TEXT_ENCODER_TARGETS
    prefixes = tuple(TEXT_ENCODER_STEMS)

    def _paths(self) -> tuple:
        m = self.family.cfg.model
        return (self.family.weights_path("text_encoder"), m.text_encoder_2 or None, m.tokenizer or None,
                m.tokenizer_2 or None)  # fmt: skip

    def load_trained(self, dtype: torch.dtype) -> sdxl.TextEncoderPair:
        encoders = sdxl.load_text_encoders(*self._paths(), dtype)
        return sdxl.TextEncoderPair(encoders.clip_l, encoders.clip_g)

    def in_encoder(self, encoder: sdxl.TextEncoders) -> sdxl.TextEncoderPair:
        return sdxl.TextEncoderPair(encoder.clip_l, encoder.clip_g)

    def load_tokenizers(self):
        return sdxl.load_tokenizers(*self._paths())

    def token_ids(self, tokenizers, captions: list[str]) -> list[dict[str, torch.Tensor]]:
        ids = sdxl.token_ids(*tokenizers, captions)
        return [{"ids_l": a, "ids_g": b} for a, b in zip(ids["ids_l"], ids["ids_g"])]

    def owns(self, stem: str) -> bool:
        return is_text_encoder_stem(stem)
