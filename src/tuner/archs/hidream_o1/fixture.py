"""A tiny random-weight HiDream-O1, written in both layouts users have.

The network is built from the `tiny` config shipped in `configs/transformer/` (a Qwen3-VL language model of
2 layers of width 64 and a one-block vision tower, with HiDream-O1's pixel modules: 32x32 patches, a
bottleneck of width 16). The tokenizer is a byte-level BPE learned from the prompt template and caption
words, with Qwen's special tokens and HiDream's `<|boi_token|>` and `<|tms_token|>`.

    out_dir/
      diffusers/                  the release's folder (`HiDream-ai/HiDream-O1-Image`): config.json, the
                                  tokenizer, model.safetensors (`model.`-prefixed names, `lm_head.weight`)
      single/                     the ComfyUI layout
        hidream_o1_image_tiny.safetensors   bare names (language_model..., visual..., t_embedder1...)
        tokenizer/

Both layouts hold the same float32 network.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3VLConfig

from tuner.archs.hidream_o1.loaders import PROMPT, SPECIAL_TOKENS
from tuner.archs.hidream_o1.model import HiDreamO1Transformer
from tuner.fixtures import Fixture, model_section, write_layouts
from tuner.fixtures.encoders import prefixed
from tuner.fixtures.tokenizers import build_qwen2_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model
from tuner.io import save_safetensors

TRANSFORMER_FILE = "hidream_o1_image_tiny.safetensors"


def build_tokenizer():
    """Qwen's BPE learned from the prompt template, with HiDream's two tokens added as special tokens."""
    from tokenizers import AddedToken

    tokenizer = build_qwen2_tokenizer([PROMPT.format("\n")])
    tokenizer.add_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS], special_tokens=True)
    return tokenizer


def build_hidream_o1_components(seed: int = 0) -> dict:
    """The tiny network (eval mode, float32) and tokenizer, deterministic given `seed`."""
    config = Qwen3VLConfig.from_pretrained(tiny_config("hidream_o1", "transformer"))
    tokenizer = build_tokenizer()
    assert len(tokenizer) <= config.text_config.vocab_size, "the tiny vocabulary outgrew the tiny config"
    network = _quiet_residual_writes_(tiny_model(HiDreamO1Transformer, config, seed))
    return {"transformer": network, "tokenizer": tokenizer}


@torch.no_grad()
def _quiet_residual_writes_(network: HiDreamO1Transformer) -> HiDreamO1Transformer:
    """Scale what each decoder layer adds to the residual stream (`o_proj`, `down_proj`) by 1/4. A trained
    model's layers refine the stream; random ones each replace it, and a few percent of fp8 rounding per
    weight then compounds past the contract suite's 5% bound on the output."""
    for name, param in network.language_model.layers.named_parameters():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            param.mul_(0.25)
    return network


def release_folder(parts: dict, seed: int):
    """A function writing the release's folder: its config, its tokenizer at the root, and the network
    saved as `Qwen3VLForConditionalGeneration` saves it (`model.` before every name, an LM head)."""

    def write(folder: Path) -> None:
        network = parts["transformer"]
        folder.mkdir(parents=True)
        network.config.save_pretrained(folder)
        parts["tokenizer"].save_pretrained(folder)
        text = network.config.text_config
        head = torch.randn(
            text.vocab_size, text.hidden_size, generator=torch.Generator().manual_seed(seed + 1)
        )
        save_safetensors(
            {**prefixed("model.", network.state_dict()), "lm_head.weight": head}, folder / "model.safetensors"
        )

    return write


def write_hidream_o1_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny HiDream-O1 under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (the release's folder), transformer_file, tokenizer (the single-file layout's
    tokenizer folder). Existing `diffusers/` and `single/` folders under `out_dir` are replaced only once
    the new ones are complete.
    """
    parts = build_hidream_o1_components(seed)
    single = {"transformer_file": (TRANSFORMER_FILE, parts["transformer"].state_dict())}
    return write_layouts(
        out_dir, "hidream_o1", release_folder(parts, seed), single, {"tokenizer": parts["tokenizer"]}
    )


FIXTURE = Fixture(
    write=write_hidream_o1_fixture,
    # the ComfyUI file, which is also what the prompt's tokens are embedded by (the tokenizer from its folder)
    model_section=model_section("hidream_o1", transformer=TRANSFORMER_FILE, text_encoder=TRANSFORMER_FILE),
)
