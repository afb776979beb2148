"""SDXL (and its fine-tunes) on diffusers' UNet2DConditionModel: the first DDPM-objective architecture.

Latents: the SDXL VAE's mean × 0.13025, 4 channels at 1/8 of the pixels (sides multiples of 8; 64 keeps
every UNet level even). Text: CLIP-L's and bigG's penultimate hidden states concatenated, and bigG's
pooled projection (see `tuner.archs.sdxl.loaders`). Size conditioning: each item's latent entry carries its
`time_ids` (source height and width, crop top and left in the resized image, bucket height and width),
as SDXL was trained; generation uses (H, W, 0, 0, H, W).

With `network.train_text_encoder`, an adapter also trains on both text encoders (every linear layer of
their attention and MLPs, kohya's set), at `network.text_encoder_lr`: the text cache then holds token
ids, and `predict` runs the encoders at every step. The adapters are saved in the same file as kohya's
`lora_te1_*` / `lora_te2_*` parts (see `tuner.archs.sdxl.keys`).

The objective is DDPM's (`tuner.diffusion.ddpm`): t ∈ [0, 1] from the timestep sampler (uniform by default, within
`min_timestep` / `max_timestep`) picks one of the 1000 noise levels, and the model predicts the noise or,
with `timesteps.prediction = "v"`, the velocity.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.model import ArchitectureModel
from tuner.archs.sdxl import loaders as sdxl
from tuner.archs.sdxl.keys import TEXT_ENCODER_STEMS, is_text_encoder_stem
from tuner.dtypes import DTYPES
from tuner.errors import ConfigError
from tuner.memory import place_text_encoder, text_encoder_dtype

# the text encoders' adapter targets (`network.train_text_encoder`): kohya's, every linear layer of the
# CLIP attention and MLP blocks, in both encoders
TEXT_ENCODER_TARGETS = (
    r"te[12]\.text_model\.encoder\.layers\.\d+\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])",
)


class SDXLModel(ArchitectureModel):
    architecture = "sdxl"
    _trained_text: sdxl.TextEncoderPair | None = None  # the text encoders training adapts, once built

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        path = self.weights_path("transformer")
        sdxl.warn_if_v_prediction(path, self.training_objective().prediction)
        return sdxl.load_unet(path, dtype)

    def export_layout(self):
        """A full fine-tune saves the bundled checkpoint (UNet, VAE, both text encoders), which A1111,
        Forge and ComfyUI load; adapters and diffusers-named saves use the UNet layout."""
        if self.cfg.network.type != "full" or self.cfg.save.format == "diffusers":
            return self.layout
        m = self.cfg.model
        vae, text_encoder = self.weights_path("vae"), self.weights_path("text_encoder")

        def companions() -> dict[str, torch.Tensor]:
            return sdxl.bundle_companions(
                vae, text_encoder, m.text_encoder_2 or None, DTYPES[self.cfg.save.precision]
            )

        return sdxl.BundledLayout(self.layout.keys, companions=companions)

    def build_trained(self, model: nn.Module):
        """The UNet's adapter, and with `network.train_text_encoder` the text encoders' in the same network
        (names `te1.` / `te2.`; their own learning rate with `network.text_encoder_lr`). The encoders are
        loaded here, in `model.dtype` on the UNet's device, frozen but for their adapters."""
        from tuner.networks.factory import build_network

        network = super().build_trained(model)
        if not self.trains_text_encoder:
            return network
        m, nc = self.cfg.model, self.cfg.network
        encoders = sdxl.load_text_encoders(self.weights_path("text_encoder"), m.text_encoder_2 or None,
                                           m.tokenizer or None, m.tokenizer_2 or None, DTYPES[m.dtype])  # fmt: skip
        pair = sdxl.TextEncoderPair(encoders.clip_l, encoders.clip_g).requires_grad_(False)
        self._trained_text = pair.to(model.conv_in.weight.device)
        text = build_network(pair, TEXT_ENCODER_TARGETS, nc, self.layout, seed=self.cfg.train.seed,
                             save_format=self.cfg.save.format)  # fmt: skip
        joined = type(network)([*network, *text], name_map=self.layout, prefix=network.prefix)
        if nc.text_encoder_lr:
            joined.lr_by_prefix = dict.fromkeys(TEXT_ENCODER_STEMS, nc.text_encoder_lr)
        return joined

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return sdxl.load_vae(self.weights_path("vae"), dtype).to(device)

    def load_text_encoder(self, device: torch.device, dtype: str) -> sdxl.TextEncoders:
        """Both encoders and tokenizers; while the text encoders train (samples), the ones training."""
        m = self.cfg.model
        if self._trained_text is not None:
            clip_l, clip_g = self._trained_text.encoders
            tokenizer, tokenizer_2 = self.load_text_cache_encoder(device, dtype)
            return sdxl.TextEncoders(clip_l, tokenizer, clip_g, tokenizer_2)
        encoders = sdxl.load_text_encoders(
            self.weights_path("text_encoder"), m.text_encoder_2 or None, m.tokenizer or None,
            m.tokenizer_2 or None, text_encoder_dtype(dtype),
        )  # fmt: skip
        for model in (encoders.clip_l, encoders.clip_g):
            place_text_encoder(model, dtype, device, self.cfg.cache.text_encoder_blocks_to_swap)
        return encoders

    def load_text_cache_encoder(self, device: torch.device, dtype: str):
        if not self.trains_text_encoder:
            return self.load_text_encoder(device, dtype)
        m = self.cfg.model
        return sdxl.load_tokenizers(self.weights_path("text_encoder"), m.text_encoder_2 or None,
                                    m.tokenizer or None, m.tokenizer_2 or None)  # fmt: skip

    def encode_text_cache(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        """Token ids ({"ids_l", "ids_g"}) while the text encoders train, else `encode_text`'s outputs."""
        if not self.trains_text_encoder:
            return self.encode_text(encoder, captions)
        ids = sdxl.token_ids(*encoder, captions)
        return [{"ids_l": a, "ids_g": b} for a, b in zip(ids["ids_l"], ids["ids_g"])]

    def attach_adapter_file(self, model: nn.Module, path: str, strength: float):
        from tuner.networks.factory import apply_adapter_file

        return apply_adapter_file(model, path, strength, name_map=self.layout,
                                  keep=lambda stem: not is_text_encoder_stem(stem))  # fmt: skip

    def attach_text_adapters(self, encoder: sdxl.TextEncoders, loras: list[tuple[str, float]]) -> None:
        """The `lora_te1_*` / `lora_te2_*` parts of each file onto CLIP-L and bigG."""
        from tuner.networks.factory import apply_adapter_file
        from tuner.networks.formats import read_modules

        pair = sdxl.TextEncoderPair(encoder.clip_l, encoder.clip_g)
        for path, strength in loras:
            if any(is_text_encoder_stem(stem) for stem in read_modules(path)[0]):
                apply_adapter_file(pair, path, strength, name_map=self.layout,
                                   keep=is_text_encoder_stem).to(encoder.clip_l.device)  # fmt: skip

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.shape[2] != 1:
            raise ConfigError(f"{self.architecture} encodes single images, got {pixels.shape[2]} frames.")
        return sdxl.encode_images(vae, pixels[:, :, 0])

    def latent_conditions(self, job) -> dict[str, torch.Tensor]:
        """SDXL's size conditioning of one item: its source size, where the bucket's crop starts in the
        resized image, and the bucket size (each as (height, width))."""
        from tuner.data.media import probe_image

        width, height = probe_image(job.source)
        left, top, right, bottom = job.crop.box
        return {"time_ids": sdxl.time_ids((height, width), (top, left), (bottom - top, right - left))}

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return sdxl.decode_latents(vae, latents).unsqueeze(2)

    def encode_text(
        self, encoder: sdxl.TextEncoders, captions: list[str], controls=None
    ) -> list[dict[str, torch.Tensor]]:
        return sdxl.encode_prompts(encoder, captions)

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Outputs ({"hidden", "pooled"}) or, while the text encoders train, token ids ({"ids_l", "ids_g"})."""
        return {name: torch.stack([e[name] for e in entries]) for name in entries[0]}

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        level = (t.float() * 1000).round()
        size_ids = cond.get("time_ids")
        if size_ids is None:  # generation: the full picture at its own size, uncropped
            h, w = noisy.shape[-2] * 8, noisy.shape[-1] * 8
            size_ids = sdxl.time_ids((h, w), (0, 0), (h, w)).expand(noisy.shape[0], 6)
        if "ids_l" in cond:  # the text encoders train: their outputs now, through their adapters
            clip_l, clip_g = self._trained_text.encoders
            hidden, pooled = sdxl.encode_ids(clip_l, clip_g, cond["ids_l"], cond["ids_g"])
        else:
            hidden, pooled = cond["hidden"], cond["pooled"]
        return sdxl.predict(model, noisy, level, hidden, pooled, size_ids)

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (4, height // 8, width // 8)
