"""A tiny random-weight LTX-2 (video + audio) as a diffusers pipeline folder.

Built from the `tiny` configs in `tuner/archs/ltx2/configs/` (transformer: 2 blocks, 2 heads of 16
per stream, 128 video and 128 audio input channels as the release; video VAE with the real 32×/8×
compression and 128 channels; audio VAE over 64 mel bins with 8 latent channels; connectors of one
layer with 8 registers; Gemma 3 text model of 2 layers of width 32) and the offline Gemma tokenizer.

    out_dir/
      single/ltx-2-tiny.safetensors   the release's layout: transformer (`model.diffusion_model.*`),
                                      video VAE (`vae.*`) and audio VAE (`audio_vae.*`) in one file
      single/ltx-2-tiny-transformer.safetensors   the transformer alone (what a full fine-tune saves)
      diffusers/   what `LTX2Pipeline.from_pretrained(out_dir/"diffusers")` loads
        model_index.json  transformer/  vae/  audio_vae/  vocoder/  connectors/  text_encoder/
        tokenizer/  scheduler/
"""

from __future__ import annotations

from pathlib import Path

import torch

from tuner.archs.ltx2.keys import AUDIO_VAE_LAYOUT, LTX2_LAYOUT, VIDEO_VAE_LAYOUT
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.tokenizers import build_gemma_tokenizer
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors

CONFIG_DIR = Path(__file__).parent / "configs"
CHECKPOINT_FILE = "ltx-2-tiny.safetensors"  # the release's file: transformer, video and audio VAE
TRANSFORMER_FILE = "ltx-2-tiny-transformer.safetensors"  # the transformer alone, in the same names


def _tiny(component: str) -> Path:
    return CONFIG_DIR / component / "tiny"


def build_ltx2_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the
    arguments of `LTX2Pipeline`."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    classes = {
        "transformer": LTX2VideoTransformer3DModel,
        "vae": AutoencoderKLLTX2Video,
        "audio_vae": AutoencoderKLLTX2Audio,
        "vocoder": LTX2Vocoder,
        "connectors": LTX2TextConnectors,
    }
    parts = {}
    with torch.random.fork_rng(devices=[]):  # constructors draw from the global generator
        for i, (name, cls) in enumerate(classes.items()):
            parts[name] = fill_random_(cls.from_config(cls.load_config(_tiny(name))), seed + i).eval()
        text_encoder = Gemma3ForCausalLM(Gemma3TextConfig.from_pretrained(_tiny("text_encoder")))
    parts["text_encoder"] = fill_random_(text_encoder, seed + len(classes)).eval()
    parts["tokenizer"] = build_gemma_tokenizer()
    parts["scheduler"] = FlowMatchEulerDiscreteScheduler(shift_terminal=0.1, use_dynamic_shifting=True)
    return parts


def write_ltx2_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny LTX-2 under `out_dir` in both layouts; returns {root, diffusers, checkpoint_file,
    transformer_file}."""
    from diffusers import LTX2Pipeline

    out = Path(out_dir)
    parts = build_ltx2_components(seed)

    def write(staging: Path) -> None:
        LTX2Pipeline(**parts).save_pretrained(staging / "diffusers", safe_serialization=True)
        (staging / "single").mkdir()
        # the release bundles the transformer, both VAEs (and the vocoder, connectors) in one file; a
        # full fine-tune saves the transformer alone, in the same names
        alone = {
            f"model.diffusion_model.{k}": v
            for k, v in LTX2_LAYOUT.to_original(parts["transformer"].state_dict()).items()
        }
        save_safetensors(alone, staging / "single" / TRANSFORMER_FILE)
        vaes = {f"vae.{k}": v for k, v in VIDEO_VAE_LAYOUT.to_original(parts["vae"].state_dict()).items()}
        vaes |= {
            f"audio_vae.{k}": v
            for k, v in AUDIO_VAE_LAYOUT.to_original(parts["audio_vae"].state_dict()).items()
        }
        save_safetensors(alone | vaes, staging / "single" / CHECKPOINT_FILE)

    publish_layouts(out, "ltx2", write)
    single = out / "single"
    return {
        "root": out,
        "diffusers": out / "diffusers",
        "checkpoint_file": single / CHECKPOINT_FILE,
        "transformer_file": single / TRANSFORMER_FILE,
    }


FIXTURE = Fixture(
    write=write_ltx2_fixture,
    model_section="""\
architecture = "ltx2"
transformer = "{root}/single/ltx-2-tiny.safetensors"
vae = "{root}/single/ltx-2-tiny.safetensors"
text_encoder = "{root}/diffusers"
""",
)
