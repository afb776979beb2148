"""A tiny random-weight Wan 2.1 text-to-video model, written in both layouts users have.

The models are built from the `tiny` configs shipped with `tuner.archs.wan.loaders` (transformer: 2 heads of
32, 2 blocks, text dim 64; VAE: base width 16 with the real 4x temporal / 8x spatial compression and 16
latent channels; UMT5: 2 layers of width 64), so loaders recognise them like real checkpoints.

    out_dir/
      diffusers/                      what `WanPipeline.from_pretrained(out_dir/"diffusers")` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  scheduler/
      single/                         the official / ComfyUI single-file layout
        wan2.1_t2v_tiny.safetensors   official transformer keys (blocks.0.self_attn.q.weight, ...)
        wan_2.1_vae.safetensors       original VAE keys (encoder.downsamples.0.residual.0.gamma, ...)
        umt5_tiny.safetensors         ComfyUI text-encoder layout (transformers keys, no embed_tokens)
        tokenizer/

Both layouts hold the same float32 weights: the single files are the diffusers state dicts renamed by
tuner's own diffusers -> original converters (`tuner.archs.wan.keys`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from tuner.archs.wan.keys import transformer_to_original, vae_to_original
from tuner.archs.wan.loaders import TEXT_ENCODER_VARIANTS, TRANSFORMER_VARIANTS, VAE_VARIANTS
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.tokenizers import build_t5_tokenizer
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors
from tuner.models.identify import Variant

TRANSFORMER_FILE = "wan2.1_t2v_tiny.safetensors"
VAE_FILE = "wan_2.1_vae.safetensors"
TEXT_ENCODER_FILE = "umt5_tiny.safetensors"


def _tiny(variants: tuple[Variant, ...]) -> Path:
    return next(v.config_dir for v in variants if v.name == "tiny")


def build_wan_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`.

    Keys: transformer, vae, text_encoder, tokenizer, scheduler (the arguments of `WanPipeline`).
    """
    # Constructors draw initial weights from the global generator; keep the caller's stream untouched.
    with torch.random.fork_rng(devices=[]):
        transformer = WanTransformer3DModel.from_config(
            WanTransformer3DModel.load_config(_tiny(TRANSFORMER_VARIANTS))
        )
        vae = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(_tiny(VAE_VARIANTS)))
        text_encoder = UMT5EncoderModel(UMT5Config.from_pretrained(_tiny(TEXT_ENCODER_VARIANTS)))
    fill_random_(transformer, seed)
    fill_random_(vae, seed + 1)
    fill_random_(text_encoder, seed + 2)
    # Wan 2.1's diffusers release samples with UniPC on flow-matching sigmas, shift 3 (480p).
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    return {
        "transformer": transformer.eval(),
        "vae": vae.eval(),
        "text_encoder": text_encoder.eval(),
        "tokenizer": build_t5_tokenizer(),
        "scheduler": scheduler,
    }


def write_wan_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Wan 2.1 T2V model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file, tokenizer
    (the single-file layout's tokenizer folder). Existing `diffusers/` and `single/` folders under
    `out_dir` are replaced only once the new ones are complete.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = build_wan_components(seed)

    def write(staging: Path) -> None:
        WanPipeline(**parts).save_pretrained(staging / "diffusers", safe_serialization=True)
        write_single_files(staging / "single", parts)

    publish_layouts(out, "wan", write)
    return fixture_paths(out, TRANSFORMER_FILE, VAE_FILE)


def fixture_paths(out: Path, transformer_file: str, vae_file: str) -> dict[str, Path]:
    """What a Wan fixture writer returns: the folders, and the single files under `single/`."""
    single = out / "single"
    return {
        "root": out,
        "diffusers": out / "diffusers",
        "transformer_file": single / transformer_file,
        "vae_file": single / vae_file,
        "text_encoder_file": single / TEXT_ENCODER_FILE,
        "tokenizer": single / "tokenizer",
    }


def write_single_files(folder: Path, parts: dict) -> None:
    folder.mkdir(parents=True)
    save_safetensors(transformer_to_original(parts["transformer"].state_dict()), folder / TRANSFORMER_FILE)
    save_safetensors(vae_to_original(parts["vae"].state_dict()), folder / VAE_FILE)
    write_text_encoder_files(folder, parts)


def write_text_encoder_files(folder: Path, parts: dict) -> None:
    """The UMT5 encoder in ComfyUI's single-file layout, and the tokenizer folder beside it."""
    # ComfyUI's UMT5 files hold `shared.weight` only; the encoder's embedding is tied to it.
    text_encoder = parts["text_encoder"].state_dict()
    text_encoder.pop("encoder.embed_tokens.weight")
    save_safetensors(text_encoder, folder / TEXT_ENCODER_FILE)
    parts["tokenizer"].save_pretrained(folder / "tokenizer")


FIXTURE = Fixture(
    write=write_wan_fixture,
    # the original single-file layout for the transformer, the diffusers folder for the rest
    model_section=f"""\
architecture = "wan"
transformer = "{{root}}/single/{TRANSFORMER_FILE}"
vae = "{{root}}/diffusers"
text_encoder = "{{root}}/diffusers"
""",
)
