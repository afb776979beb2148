"""A tiny random-weight Anima model, written in the layouts users have.

The DiT is cosmos_predict2's `tiny` config (2 heads of 32, 2 blocks, text width 64, the released
`concat_padding_mask`), the LLM adapter 2 blocks of width 64 with 4 heads over a 512-id vocabulary
(`configs/transformer/tiny/llm_adapter.json`), Qwen3 2 layers of width 64, the VAE the tiny Qwen-Image
one of `tuner.archs.qwen_image.fixture`; the Qwen tokenizer is a byte-level BPE, the T5 tokenizer a
small unigram one.

    out_dir/
      diffusers/                the component folders that exist in diffusers / transformers form
        vae/  text_encoder/  tokenizer/  tokenizer_2/      (Anima itself has no diffusers pipeline)
      single/                   the release's files (ComfyUI's)
        anima_tiny.safetensors     `blocks.0.self_attn.q_proj.weight`, `llm_adapter.embed.weight`, ... (no `net.`)
        qwen_image_vae.safetensors original Wan VAE keys
        qwen_3_06b_tiny.safetensors Hugging Face Qwen3 keys (model.layers.0...)
        tokenizer/  tokenizer_2/   Qwen's and T5's

Both layouts hold the same float32 weights.
"""

from __future__ import annotations

from pathlib import Path

from diffusers import AutoencoderKLQwenImage, CosmosTransformer3DModel
from transformers import Qwen3Model

from tuner.archs.anima import loaders as anima
from tuner.archs.anima.adapter import LLMAdapter
from tuner.archs.anima.keys import ADAPTER, transformer_to_original
from tuner.archs.qwen_image.fixture import VAE_FILE
from tuner.archs.wan.keys import vae_to_original
from tuner.archs.z_image.text import original_key
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.tokenizers import build_qwen3_tokenizer, build_t5_tokenizer
from tuner.fixtures.weights import fill_random_, tiny_config, tiny_model

TRANSFORMER_FILE = "anima_tiny.safetensors"
TEXT_ENCODER_FILE = "qwen_3_06b_tiny.safetensors"


def build_anima_components(seed: int = 0) -> dict:
    """The tiny model's parts (eval mode, float32), deterministic given `seed`: transformer (the DiT with
    its `llm_adapter`), vae, text_encoder (Qwen3), tokenizer (Qwen's), tokenizer_2 (T5's)."""
    transformer = tiny_model(CosmosTransformer3DModel, tiny_config("anima", "transformer"), seed)
    tiny = next(v for v in anima.TRANSFORMER_VARIANTS if v.name == "tiny")
    adapter = fill_random_(LLMAdapter(**anima.adapter_config(tiny)), seed + 3).eval()
    transformer.add_module(ADAPTER, adapter)
    text_encoder = tiny_model(Qwen3Model, tiny_config("anima", "text_encoder"), seed + 2)
    tokenizer, t5_tokenizer = build_qwen3_tokenizer(), build_t5_tokenizer()
    assert len(tokenizer) <= text_encoder.config.vocab_size, (
        "the tiny Qwen vocabulary outgrew the tiny config"
    )
    assert len(t5_tokenizer) <= adapter.embed.num_embeddings, "the tiny T5 vocabulary outgrew the adapter"
    return {
        "transformer": transformer,
        "vae": tiny_model(AutoencoderKLQwenImage, tiny_config("qwen_image", "vae"), seed + 1),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "tokenizer_2": t5_tokenizer,
    }


def write_anima_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Anima model under `out_dir`; returns the paths.

    Keys: root, diffusers (the component folders), transformer_file, vae_file, text_encoder_file,
    tokenizer, tokenizer_2 (the single-file layout's tokenizer folders)."""
    parts = build_anima_components(seed)

    def diffusers(folder: Path) -> None:
        for name in ("vae", "text_encoder", "tokenizer", "tokenizer_2"):
            parts[name].save_pretrained(folder / name)

    single = {
        "transformer_file": (TRANSFORMER_FILE, transformer_to_original(parts["transformer"].state_dict())),
        "vae_file": (VAE_FILE, vae_to_original(parts["vae"].state_dict())),
        "text_encoder_file": (
            TEXT_ENCODER_FILE,
            {original_key(k): v for k, v in parts["text_encoder"].state_dict().items()},
        ),
    }
    return write_layouts(out_dir, "anima", diffusers, single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_anima_fixture,
    # every part as the release's single file, the tokenizers from their folders
    model_section=model_section(
        "anima", transformer=TRANSFORMER_FILE, vae=VAE_FILE, text_encoder=TEXT_ENCODER_FILE
    )
    + 'tokenizer_2 = "{root}/single/tokenizer_2"\n',
)
