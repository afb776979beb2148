"""Ideogram 4: the release's single file (ComfyUI's, fp8 too) and the diffusers folder load to the same
weights; the unconditional transformer and other architectures' files are refused by name; prompts encode,
the model is called and a guided generation steps exactly as diffusers' Ideogram4Pipeline does (its
unconditional transformer being the trained one); `ideogram4_shift` draws musubi-tuner's logit-normal;
adapter files name release tensors and load in diffusers; a full fine-tune is saved in the release layout."""

import math
from types import SimpleNamespace

import pytest
import torch
from diffusers import Ideogram4Pipeline

from project import assert_equal_weights, check_comfy_stems_and_diffusers_load
from tuner.archs.ideogram4 import loaders as ideogram4
from tuner.archs.ideogram4 import text as ideogram4_text
from tuner.archs.ideogram4.fixture import build_ideogram4_components, write_ideogram4_fixture
from tuner.archs.ideogram4.trainer import Ideogram4Model
from tuner.diffusion.timesteps import TimestepSampler
from tuner.errors import CheckpointError
from tuner.io import save_safetensors
from tuner.models import qwen3_vl
from tuner.models.loading import load_tensors
from tuner.networks.lora import LoRANetwork
from tuner.networks.targets import TargetSpec
from tuner.registry import architecture

CAPTIONS = ["a red dog walking in the park", "a cat"]


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    return write_ideogram4_fixture(tmp_path_factory.mktemp("ideogram4"))


@pytest.fixture(scope="module")
def parts():
    return build_ideogram4_components()


@pytest.fixture(scope="module")
def pipe(parts):
    return Ideogram4Pipeline(**parts)


def _trainer(text_length: int = 2048) -> Ideogram4Model:
    trainer = Ideogram4Model.__new__(Ideogram4Model)
    trainer.record = architecture("ideogram4")
    trainer.cfg = SimpleNamespace(cache=SimpleNamespace(text_max_length=text_length))
    return trainer


def _encoder(parts):
    return qwen3_vl.TextEncoder(parts["text_encoder"].language_model, parts["tokenizer"])


def test_layouts_load_to_the_same_weights(fixture, tmp_path):
    folder = ideogram4.load_transformer(fixture["diffusers"], torch.float32)
    assert_equal_weights(ideogram4.load_transformer(fixture["transformer_file"], torch.float32), folder)
    keys = load_tensors(fixture["transformer_file"])
    assert "layers.0.attention.qkv.weight" in keys and "layers.0.attention.o.weight" in keys
    assert not any("to_q" in k or "to_out" in k for k in keys)
    single = ideogram4_text.load_text_encoder(
        fixture["text_encoder_file"], fixture["tokenizer"], torch.float32
    )
    assert_equal_weights(
        single.model, ideogram4_text.load_text_encoder(fixture["diffusers"], None, torch.float32).model
    )


def test_a_file_in_diffusers_names_loads(fixture, parts, tmp_path):
    """A single file of diffusers' keys (split q / k / v, `to_out.0`) is the same model as the release's."""
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    save_safetensors(dict(parts["transformer"].state_dict()), path)
    assert_equal_weights(ideogram4.load_transformer(path, torch.float32), parts["transformer"])


def test_prefixed_fp8_file_loads_dequantized(fixture, tmp_path):
    """ComfyUI's `model.diffusion_model.` prefix with a scaled fp8 qkv gives the fp8-rounded rows."""
    release = load_tensors(fixture["transformer_file"])
    fp8 = {f"model.diffusion_model.{k}": v for k, v in release.items()}
    qkv = "layers.0.attention.qkv.weight"
    fp8[f"model.diffusion_model.{qkv}"] = (release[qkv] / 0.5).to(torch.float8_e4m3fn)
    fp8["model.diffusion_model.layers.0.attention.qkv.weight_scale"] = torch.tensor(0.5)
    path = tmp_path / "ideogram4_fp8_scaled.safetensors"
    save_safetensors(fp8, path)
    got = ideogram4.load_transformer(path, torch.float32)
    rounded = (release[qkv] / 0.5).to(torch.float8_e4m3fn).float() * 0.5
    assert torch.equal(got.layers[0].attention.to_k.weight, rounded[64:128])


def test_unconditional_and_other_files_are_refused_by_name(fixture, tmp_path):
    """The release's unconditional transformer (metadata `model_type`, or its name) is not trained; a
    FLUX.2 transformer or a Qwen3-VL file is not an Ideogram 4 transformer."""
    from safetensors.torch import save_file

    from tuner.archs.flux2.fixture import write_flux2_fixture

    tensors = load_tensors(fixture["transformer_file"])
    marked, named = tmp_path / "ideogram4_b.safetensors", tmp_path / "ideogram4_uncond_bf16.safetensors"
    save_file(tensors, str(marked), metadata={"model_type": "ideogram4_uncond"})
    save_file(tensors, str(named))
    for path in (marked, named):
        with pytest.raises(CheckpointError, match="unconditional"):
            ideogram4.load_transformer(path, torch.float32)
    flux2 = write_flux2_fixture(tmp_path / "flux2")
    with pytest.raises(CheckpointError, match="Ideogram 4 transformer"):
        ideogram4.load_transformer(flux2["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError):
        ideogram4.load_transformer(fixture["text_encoder_file"], torch.float32)


def test_prompts_encode_as_the_pipeline_does(pipe, parts):
    """Our true-length stacks are the rows of the pipeline's left-padded text region."""
    got = ideogram4_text.encode_prompts(_encoder(parts), CAPTIONS)
    for caption, g in zip(CAPTIONS, got, strict=True):
        want = pipe.encode_prompt(caption, grid_h=1, grid_w=1, max_sequence_length=40, device="cpu")[0]
        assert g.shape[1] == 13 * 32
        # padded (the pipeline) and unpadded (ours) attention sum in another order: ~1e-5
        torch.testing.assert_close(g, want[0, 40 - g.shape[0] : 40], rtol=1e-4, atol=1e-4)
    assert ideogram4_text.encode_prompts(_encoder(parts), [""])[0].shape == (0, 13 * 32)


@torch.no_grad()
def test_guided_generation_matches_the_pipeline(pipe, parts):
    """`sample_flow` from our encoding (the empty negative: no text, the image-only pass), with the
    record's logit-normal schedule and tuner's guidance, gives Ideogram4Pipeline's latents for the same
    noise, steps and guidance (its unconditional transformer is the same model here)."""
    trainer = _trainer()
    encoder = _encoder(parts)
    cond, uncond = (trainer.collate_text(trainer.encode_text(encoder, [p])) for p in (CAPTIONS[0], ""))
    x = torch.randn(1, 128, 4, 2, generator=torch.Generator().manual_seed(0))  # a 64x32 image
    out = pipe(CAPTIONS[0], height=64, width=32, num_inference_steps=3, guidance_scale=3.0, guidance_schedule=None,
               output_type="latent", latents=x.flatten(2).transpose(1, 2), max_sequence_length=40).images  # fmt: skip

    def model_fn(x, t, c):  # as `tuner generate` calls the family
        return trainer.predict(parts["transformer"], x, t / 1000, c)

    x = trainer.sample_flow(model_fn, x, torch.zeros(4), cond, uncond, 3.0)
    torch.testing.assert_close(x.flatten(2).transpose(1, 2), out, rtol=1e-4, atol=1e-4)


def test_latents_round_trip_the_pipelines_packing(parts):
    """`patchify` is the inverse of the pipeline's unpacking ((row, column, channel) per token)."""
    z = torch.randn(1, 32, 8, 4)
    tokens = ideogram4.patchify(z).flatten(2).transpose(1, 2)
    back = tokens.view(1, 4, 2, 2, 2, 32).permute(0, 5, 1, 3, 2, 4).reshape(1, 32, 8, 4)
    assert torch.equal(back, z) and torch.equal(ideogram4.unpatchify(ideogram4.patchify(z)), z)


def test_ideogram4_shift_is_musubis_logit_normal():
    """t = sigmoid(n), n ~ N(0.5·ln(pixels / 512²), 1.5): a 1024² image (4096 tokens), checked against the
    normal's own quantiles."""
    from statistics import NormalDist

    sampler = TimestepSampler(mode="ideogram4_shift")
    u = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    normal = NormalDist(0.5 * math.log(1024**2 / 512**2), 1.5)
    want = [1 / (1 + math.exp(-normal.inv_cdf(p))) for p in u.tolist()]
    assert sampler.quantile(u, seq_len=4096).tolist() == pytest.approx(want, rel=1e-9)
    assert sampler.cdf(want[0], seq_len=4096) == pytest.approx(0.1, rel=1e-9)


def test_comfy_file_names_release_tensors_and_diffusers_loads_its_layout(fixture, pipe, parts, tmp_path):
    """The default comfy file's stems are `diffusion_model.` + release modules (qkv fused) that exist in the
    release file; diffusers' Ideogram4Pipeline.load_lora_weights loads the diffusers-layout file to our
    output."""
    model = parts["transformer"]
    record = architecture("ideogram4")
    network = LoRANetwork.apply_to(model, TargetSpec(record.default_targets), rank=4, alpha=4,
                                   name_map=record.checkpoint_layout())  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    assert len(network.weights()) == 7 * 2
    embeds = ideogram4_text.encode_prompts(_encoder(parts), ["a cat"])
    cond = _trainer().collate_text([{"prompt_embeds": embeds[0]}])
    noisy = torch.randn(1, 128, 2, 2, generator=torch.Generator().manual_seed(3))
    check_comfy_stems_and_diffusers_load(
        pipe, network, lambda: _trainer().predict(model, noisy, torch.tensor([0.4]), cond),
        set(load_tensors(fixture["transformer_file"])), record.checkpoint_layout(), tmp_path,
    )  # fmt: skip
    pipe.unload_lora_weights()


def test_full_fine_tune_samples_and_is_saved_in_the_release_layout(fixture, tmp_path):
    """One step of full fine-tuning draws its guided sample and writes the release's keys and shapes (fused
    `attention.qkv`, `attention.o`), which tuner's loader reads back to the trained weights (diffusers has no
    single-file converter for Ideogram 4: the release's layout is ComfyUI's)."""
    from project import cfg, make_project
    from tuner.cli import main
    from tuner.trainers import trainer_class

    config = make_project(tmp_path / "project", fixture["root"], architecture="ideogram4")
    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0
    overrides = ("network.type='full'", "train.max_steps=1", "train.lr_warmup_steps=0", "log.tensorboard=false",
                 "sample.prompts=['a cat']", "sample.every_n_steps=1", "sample.width=32", "sample.height=32",
                 "sample.steps=2", "sample.guidance=3.0")  # fmt: skip
    trainer = trainer_class("ideogram4")(cfg(config, f"save.output_dir='{tmp_path / 'out'}'", *overrides))
    trainer.train(log=lambda s: None)
    assert [p.suffix for p in (tmp_path / "out" / "samples").iterdir()] == [".png"]
    saved = load_tensors(tmp_path / "out" / "demo_lora.safetensors")
    release = load_tensors(fixture["transformer_file"])
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in release.items()}
    ours = ideogram4.load_transformer(tmp_path / "out" / "demo_lora.safetensors", torch.float32)
    assert torch.equal(ours.layers[0].attention.to_k.weight, saved["layers.0.attention.qkv.weight"][64:128])
    before = ideogram4.load_transformer(fixture["diffusers"], torch.float32)
    assert not torch.equal(ours.layers[0].attention.to_k.weight, before.layers[0].attention.to_k.weight)
