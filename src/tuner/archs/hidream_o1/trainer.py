"""HiDream-O1-Image (full, dev): text-to-image in pixel space on a Qwen3-VL (`tuner.archs.hidream_o1.model`).

Latents: none. The cache holds each resized picture ([3, 1, H, W] in [-1, 1], sides multiples of 32:
`tuner.archs.pixel_space`); the network cuts it into 32×32 patch tokens. Text: the chat-templated prompt's
token ids at their true length (`tuner.archs.hidream_o1.loaders.tokenize`); a batch is padded on the right
with a mask. No text encoder runs: the network embeds the ids itself.

The objective (musubi-tuner's `hidream_o1_train_network.py`, `get_noisy_model_input_and_timesteps` and
`call_dit`): the noise is scaled, x_σ = (1 − σ)·x0 + σ·s·ε with s = 8 (dev: 7.5, ε first clipped to ±2.5 of
its standard deviation: the record's `noise_scales`), the network is told 1 − σ and predicts x0, and the
loss is the mean squared error to x0 (the record's `flow_prediction = "x0"`:
`tuner.diffusion.timesteps.X0FlowObjective`). σ is drawn uniformly (musubi-tuner's HiDream-O1 branch of
`--timestep_sampling uniform`). Generation runs tuner's Euler sampler on the velocity (x_σ − x̂0)/σ (σ
floored at 1e-3, as the release's sampler does) from noise scaled the same way, with classifier-free
guidance on that velocity, as the release guides.

What the published descriptions left open, and what tuner does:
* The release samples full with UniPC and dev with its own "flash" Euler on 28 fixed timesteps; tuner
  samples both with its Euler steps on the shifted schedule (full: shift 3, dev: shift 1), so samples
  differ in detail from the release's, not in kind.
* Image-to-image (reference images read by the vision tower, musubi-tuner's `--task i2i`) is not trained:
  control images are refused (`control_images` is (0, 0)).
* Which checkpoint is dev is read from its name (`dev` in it), as the shapes are the same.
* The real variants' config (`configs/transformer/full`) is Qwen3-VL-8B's (36 layers of width 4096, a
  27-block vision tower): the release's config.json could not be read offline; the file's shapes are
  checked against it when loading, so a different size is refused by name rather than misread.
* The prompt is Qwen3-VL's chat template of one user turn (no system prompt, no thinking tags) followed by
  `<|boi_token|><|tms_token|>`, as musubi-tuner renders it with the release's processor; the timestep
  token is found as each prompt's last token (the template ends with it) rather than by its id, so the
  tiny fixture's vocabulary needs no id of 151673.
* A batch of prompts of different lengths is padded on the right and the padding masked, which gives each
  sample what the release computes for it alone (it runs one sample per forward); the image's positions
  do not depend on the prompt's length.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.hidream_o1 import loaders as hidream_o1
from tuner.archs.pixel_space import PixelSpaceImageModel


class HiDreamO1Model(PixelSpaceImageModel):
    architecture = "hidream_o1"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return hidream_o1.load_transformer(self.weights_path("transformer"), dtype)

    def load_text_encoder(self, device: torch.device, dtype: str):
        """The tokenizer (prompts are cached as token ids)."""
        return hidream_o1.load_prompt_tokenizer(
            self.cfg.model.tokenizer or None, self.weights_path("text_encoder")
        )

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        return [
            {"input_ids": ids}
            for ids in hidream_o1.tokenize(encoder, captions, self.cfg.cache.text_max_length)
        ]

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return hidream_o1.padded_ids(entries)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """The clean image x̂0 (the record's `flow_prediction = "x0"`), not a velocity."""
        return hidream_o1.predict_clean(model, noisy, t, cond["input_ids"], cond["text_mask"])

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import PipelineParts

        def prologue(noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> tuple[torch.Tensor, ...]:
            return model.embed(*hidream_o1.model_inputs(noisy, t, cond["input_ids"], cond["text_mask"]))

        def epilogue(carried, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
            return hidream_o1.as_image(model.pixels(carried[0], cond["input_ids"].shape[1]), noisy)

        return PipelineParts(
            prologue=prologue,
            blocks=list(model.language_model.layers),
            run_block=lambda layer, carried: (model.run_layer(layer, *carried), *carried[1:]),
            epilogue=epilogue,
            prologue_modules=(model.language_model.embed_tokens, model.t_embedder1, model.x_embedder),
        )
