"""Cosmos-Predict2: loading both layouts, variants from shapes, key names, and the model inputs against
diffusers' Cosmos2TextToImagePipeline on the tiny fixture."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKLWan,
    Cosmos2TextToImagePipeline,
    CosmosTransformer3DModel,
    FlowMatchEulerDiscreteScheduler,
)
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, T5Config, T5EncoderModel

from project import assert_equal_weights
from tuner.archs.cosmos_predict2 import loaders as cosmos
from tuner.archs.cosmos_predict2.keys import RELEASE_ONLY, transformer_key_to_original
from tuner.archs.cosmos_predict2.trainer import CosmosPredict2Model
from tuner.archs.wan import loaders as wan_models
from tuner.errors import CheckpointError
from tuner.fixtures import write_fixture
from tuner.models.identify import pick_variant

PROMPT = "a red cat sits on a blue chair"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_fixture("cosmos_predict2", tmp_path_factory.mktemp("cosmos_predict2_model"))


class _NoGuardrail:
    """Stands in for NVIDIA's `cosmos_guardrail` checker (not installed): every prompt passes. Only
    the text check runs, as the tests ask for latents."""

    def to(self, device):
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True


def _torchvision_resize(x, size, interpolation):
    """torchvision's `resize` of a tensor with NEAREST is `F.interpolate(mode="nearest")`."""
    return F.interpolate(x, size=size, mode="nearest")


@pytest.fixture
def pipe(paths, monkeypatch):
    return load_pipeline(Cosmos2TextToImagePipeline, paths["diffusers"], monkeypatch)


def load_pipeline(pipeline_class, root, monkeypatch):
    """The pipeline on the fixture's diffusers folder `root`, its transformer diffusers' own (with the
    released `concat_padding_mask=True`). That transformer resizes the padding mask with torchvision,
    which does not import beside this torch; it is given a stand-in doing what torchvision does."""
    from diffusers.models.transformers import transformer_cosmos

    transforms = SimpleNamespace(
        functional=SimpleNamespace(resize=_torchvision_resize),
        InterpolationMode=SimpleNamespace(NEAREST="nearest"),
    )
    monkeypatch.setattr(transformer_cosmos, "transforms", transforms, raising=False)
    return pipeline_class(
        transformer=CosmosTransformer3DModel.from_pretrained(root / "transformer").eval(),
        vae=AutoencoderKLWan.from_pretrained(root / "vae").eval(),
        text_encoder=T5EncoderModel.from_pretrained(root / "text_encoder").eval(),
        tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler"),
        safety_checker=_NoGuardrail(),
    )


def _trainer(text_length: int = 512) -> CosmosPredict2Model:
    return CosmosPredict2Model(SimpleNamespace(cache=SimpleNamespace(text_max_length=text_length)))


# ---------------------------------------------------------------------------------------------------
# Loading both layouts
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_file_loads_like_the_diffusers_folder(paths, tmp_path, dtype):
    folder = cosmos.load_transformer(paths["diffusers"], dtype)
    assert_equal_weights(folder, cosmos.load_transformer(paths["diffusers"] / "transformer", dtype))
    assert_equal_weights(folder, cosmos.load_transformer(paths["transformer_file"], dtype))
    # diffusers' own weights, the padding-mask columns of the patch embedding included
    reference = CosmosTransformer3DModel.from_pretrained(
        paths["diffusers"] / "transformer", torch_dtype=dtype
    )
    assert reference.state_dict().keys() == folder.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(value, folder.state_dict()[key]), key
    assert folder.config.in_channels == 17 and not folder.config.concat_padding_mask

    release = load_file(paths["transformer_file"])
    nvidia = {f"net.{k}": v for k, v in release.items()}  # model.pt's names, with its buffers and counters
    nvidia |= {f"net.{k}": torch.zeros(3) for k in RELEASE_ONLY}
    nvidia["net.blocks.0.self_attn.q_proj._extra_state"] = torch.zeros(0)
    for name, tensors in {
        "nvidia.safetensors": nvidia,
        "comfy.safetensors": {f"model.diffusion_model.{k}": v for k, v in release.items()},
        "diffusers_keys.safetensors": load_file(
            paths["diffusers"] / "transformer" / "diffusion_pytorch_model.safetensors"
        ),
    }.items():
        save_file(tensors, tmp_path / name)
        assert_equal_weights(folder, cosmos.load_transformer(tmp_path / name, dtype))


def test_text_encoder_layouts_are_identical(paths):
    folder, tokenizer = cosmos.load_text_encoder(paths["diffusers"], None, torch.float32)
    single, _ = cosmos.load_text_encoder(paths["text_encoder_file"], paths["tokenizer"], torch.float32)
    assert_equal_weights(folder, single)
    assert tokenizer("a cat").input_ids == [tokenizer.convert_tokens_to_ids("▁a"), tokenizer.convert_tokens_to_ids("▁cat"), 1]  # fmt: skip
    with pytest.raises(CheckpointError, match="tokenizer"):
        cosmos.load_text_encoder(paths["text_encoder_file"], None, torch.float32)


def test_text_encoder_of_another_t5_is_refused(tmp_path):
    """FLUX.1's T5-XXL v1.1 (gated FFN) is not Cosmos' T5-11B."""
    from tuner.archs.flux.loaders import T5_VARIANTS as FLUX_T5

    config = T5Config.from_pretrained(next(v.config_dir for v in FLUX_T5 if v.name == "tiny"))
    tensors = T5EncoderModel(config).state_dict()
    tensors.pop("encoder.embed_tokens.weight")  # tied to `shared.weight`
    save_file(tensors, tmp_path / "t5xxl.safetensors")
    with pytest.raises(CheckpointError, match="T5-11B"):
        cosmos.load_text_encoder(tmp_path / "t5xxl.safetensors", None, torch.float32)


# ---------------------------------------------------------------------------------------------------
# Variants and refusals
# ---------------------------------------------------------------------------------------------------


def meta_original_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = CosmosTransformer3DModel.from_config(config)
    return {transformer_key_to_original(k): tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("variant", cosmos.TRANSFORMER_VARIANTS, ids=lambda v: v.name)
def test_transformer_variant_picked_from_shapes(variant):
    shapes = meta_original_shapes(CosmosTransformer3DModel.load_config(variant.config_dir))
    assert pick_variant(shapes, cosmos.TRANSFORMER_VARIANTS, "x.safetensors", "Cosmos") is variant


@pytest.mark.parametrize("variant", cosmos.T5_VARIANTS, ids=lambda v: v.name)
def test_text_encoder_variant_picked_from_shapes(variant):
    with torch.device("meta"):
        model = T5EncoderModel(T5Config.from_pretrained(variant.config_dir))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert pick_variant(shapes, cosmos.T5_VARIANTS, "t5.safetensors", "T5") is variant


def test_shipped_configs_have_the_real_sizes():
    """diffusers' conversion script's Cosmos-2.0 Text2Image configs: 2B = 16 heads × 28 blocks, 14B =
    40 heads × 36 blocks, all with a padding-mask channel, no learnable position embedding; T5-11B."""
    for name, heads, layers in [("2B-t2i", 16, 28), ("14B-t2i", 40, 36)]:
        config = CosmosTransformer3DModel.load_config(cosmos.CONFIGS / "transformer" / name)
        assert (config["num_attention_heads"], config["num_layers"]) == (heads, layers)
        assert config["concat_padding_mask"] and config["extra_pos_embed_type"] is None
        assert config["text_embed_dim"] == 1024 and list(config["rope_scale"]) == [1.0, 4.0, 4.0]
    t5 = T5Config.from_pretrained(cosmos.CONFIGS / "text_encoder" / "t5-11b")
    assert (t5.d_model, t5.d_ff, t5.num_layers, t5.num_heads, t5.is_gated_act) == (
        1024,
        65536,
        24,
        128,
        False,
    )


def test_other_models_are_named(paths, tmp_path):
    release = load_file(paths["transformer_file"])
    v2w = dict(release)  # Video2World: a condition-mask channel more in the patch embedding
    v2w["x_embedder.proj.1.weight"] = torch.zeros(64, 72)
    save_file(v2w, tmp_path / "v2w.safetensors")
    with pytest.raises(CheckpointError, match="Video2World"):
        cosmos.load_transformer(tmp_path / "v2w.safetensors", torch.float32)
    for marker, what in [("net.crossattn_proj.0.weight", "Predict2.5"),
                         ("net.blocks.block1.blocks.0.block.attn.to_q.0.weight", "Cosmos 1.0")]:  # fmt: skip
        save_file(
            {f"net.{k}": v for k, v in release.items()} | {marker: torch.zeros(1)}, tmp_path / "o.safetensors"
        )
        with pytest.raises(CheckpointError, match=what):
            cosmos.load_transformer(tmp_path / "o.safetensors", torch.float32)
    wan = write_fixture("wan", tmp_path / "wan")
    with pytest.raises(CheckpointError, match="not a Cosmos-Predict2 transformer.*Wan 2.1"):
        cosmos.load_transformer(wan["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match="WanTransformer3DModel"):
        cosmos.load_transformer(wan["diffusers"], torch.float32)
    with pytest.raises(
        CheckpointError, match="looks like a Cosmos-Predict2 transformer"
    ):  # and the other way
        wan_models.load_transformer(paths["transformer_file"], torch.float32)
    partial = dict(release)
    partial.pop("blocks.1.mlp.layer2.weight")
    save_file(partial, tmp_path / "partial.safetensors")
    with pytest.raises(CheckpointError, match="missing"):
        cosmos.load_transformer(tmp_path / "partial.safetensors", torch.float32)


# ---------------------------------------------------------------------------------------------------
# Key names
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", cosmos.TRANSFORMER_VARIANTS, ids=lambda v: v.name)
def test_release_layout_is_what_diffusers_converter_reads(variant):
    """diffusers' own release -> diffusers converter (what `from_single_file` runs) takes our release
    names, with NVIDIA's `net.` prefix and buffers, back to exactly diffusers' keys."""
    from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

    with torch.device("meta"):
        keys = list(CosmosTransformer3DModel.from_config(CosmosTransformer3DModel.load_config(variant.config_dir)).state_dict())  # fmt: skip
    release = {f"net.{transformer_key_to_original(k)}": torch.empty(0) for k in keys}
    release |= {f"net.{k}": torch.empty(0) for k in RELEASE_ONLY}
    assert sorted(convert_cosmos_transformer_checkpoint_to_diffusers(release)) == sorted(keys)


def test_release_names():
    assert (
        transformer_key_to_original("transformer_blocks.3.attn1.to_q.weight")
        == "blocks.3.self_attn.q_proj.weight"
    )
    assert transformer_key_to_original("transformer_blocks.0.attn2.to_out.0.weight") == "blocks.0.cross_attn.output_proj.weight"  # fmt: skip
    assert (
        transformer_key_to_original("transformer_blocks.1.ff.net.0.proj.weight")
        == "blocks.1.mlp.layer1.weight"
    )
    assert transformer_key_to_original("patch_embed.proj.weight") == "x_embedder.proj.1.weight"


def test_no_diffusers_lora_loader_for_predict2():
    """diffusers 0.42 has a Cosmos LoRA loader only for Predict2.5 (`CosmosLoraLoaderMixin`); the
    Predict2 pipelines have none, so adapters are saved for ComfyUI (release names). When this fails, a
    loader exists and an interop test belongs here."""
    from diffusers import Cosmos2VideoToWorldPipeline

    assert not hasattr(Cosmos2TextToImagePipeline, "load_lora_weights")
    assert not hasattr(Cosmos2VideoToWorldPipeline, "load_lora_weights")


# ---------------------------------------------------------------------------------------------------
# Model inputs against the pipeline
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()  # as the pipeline's __call__ runs it (attention takes another kernel under autograd)
def test_text_encoding_matches_the_pipeline(pipe):
    """The pipeline's 512 rows: the prompt's rows (its tokens and `</s>`), then zeros."""
    captions = [PROMPT, "x", "a b c d e f g h i j k l m n o p q r s t"]  # the last fills all 16 tokens
    embeds, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=16)
    trainer = _trainer(16)
    entries = trainer.encode_text((pipe.text_encoder, pipe.tokenizer), captions)
    assert [e["context"].shape[0] for e in entries] == [
        min(len(pipe.tokenizer(c).input_ids), 16) for c in captions
    ]
    assert torch.equal(trainer.collate_text(entries)["context"], embeds)


@torch.no_grad()
def test_euler_steps_match_the_pipeline(pipe, paths):
    """Three steps of the pipeline's EDM loop (Karras σ from 80, c_in / c_skip / c_out, guidance 7 on
    x̂0) against the same steps taken with our velocity: x̂0 = x_t − t·v at x_t = x_σ / (1 + σ). Ours runs
    the transformer loaded from the release file (padding mask as an input channel), the pipeline
    diffusers' own from the folder."""
    captured = []

    def keep(pipeline, i, t, kwargs):
        captured.append(kwargs["latents"].clone())
        return {}

    noise = torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    guidance = 7.0
    pipe(prompt=PROMPT, negative_prompt="blurry", height=32, width=32, num_inference_steps=3,
         guidance_scale=guidance, latents=noise.clone(), output_type="latent", max_sequence_length=16,
         callback_on_step_end=keep)  # fmt: skip
    sigmas = pipe.scheduler.sigmas.double()

    trainer = _trainer(16)
    model = cosmos.load_transformer(paths["transformer_file"], torch.float32)
    text = [trainer.collate_text(trainer.encode_text((pipe.text_encoder, pipe.tokenizer), [c])) for c in (PROMPT, "blurry")]  # fmt: skip
    x = noise.double() * 80.0  # the pipeline starts from noise × sigma_max
    for i, expected in enumerate(captured):
        sigma = sigmas[i]
        t = sigma / (1 + sigma)
        x_t = (x * (1 - t)).float()
        v_cond, v_uncond = (trainer.predict(model, x_t, t.float().reshape(1), c) for c in text)
        v = v_cond + guidance * (v_cond - v_uncond)  # the pipeline's convention, = plain CFG at 8
        plain = trainer.record.sampling.plain_guidance(guidance)  # the record's CFG form: 7 typed, 8 applied
        torch.testing.assert_close(v, trainer.combine_guidance(v_cond, v_uncond, plain))
        x0 = x_t.double() - t * v.double()
        x = x + (sigmas[i + 1] - sigma) * (x - x0) / sigma
        torch.testing.assert_close(x.float(), expected, rtol=1e-4, atol=1e-4)


def test_latents_match_the_pipelines_normalization(pipe, paths):
    """Encoding is Wan's normalization × sigma_data (1.0); decoding undoes it as the pipeline does."""
    trainer = _trainer()
    vae = trainer_vae(paths)
    pixels = torch.rand(1, 3, 1, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    latents = trainer.encode_pixels(vae, pixels)
    assert latents.shape == (1, 16, 1, 4, 4)
    with torch.no_grad():
        raw = vae.encode(pixels).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
        # the pipeline's decode: latents / latents_std / sigma_data + latents_mean
        undone = latents / inv_std / pipe.scheduler.config.sigma_data + mean
        torch.testing.assert_close(undone, raw, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(trainer.decode_latents(vae, latents), vae.decode(raw).sample)


def trainer_vae(paths):
    trainer = CosmosPredict2Model(
        SimpleNamespace(model=SimpleNamespace(vae=str(paths["vae_file"])), cache=SimpleNamespace())
    )
    return trainer.load_vae(torch.device("cpu"), torch.float32).eval()
