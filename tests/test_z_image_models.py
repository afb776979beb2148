"""Z-Image: both checkpoint layouts load identically, files are recognised (and refused) by their
shapes, prompts encode and the model is called exactly as diffusers' ZImagePipeline does, and the
adapter layouts load through diffusers' own Z-Image LoRA loader."""

import shutil

import pytest
import torch
from diffusers import ZImagePipeline
from safetensors.torch import load_file

from project import assert_equal_weights
from tuner.archs.flux import loaders as flux
from tuner.archs.z_image import loaders as z_image
from tuner.archs.z_image import text as z_image_text
from tuner.archs.z_image.fixture import build_z_image_components, write_z_image_fixture
from tuner.errors import CheckpointError
from tuner.io import save_safetensors
from tuner.models.loading import load_tensors
from tuner.networks.lora import LoRANetwork
from tuner.networks.targets import TargetSpec
from tuner.registry import architecture

CAPTIONS = ["a red dog walking in the park", "a cat"]


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    return write_z_image_fixture(tmp_path_factory.mktemp("z_image"))


def test_both_layouts_load_bit_identical(fixture):
    assert_equal_weights(
        z_image.load_transformer(fixture["transformer_file"], torch.float32),
        z_image.load_transformer(fixture["diffusers"], torch.float32),
    )
    assert_equal_weights(
        flux.load_vae(fixture["vae_file"], torch.float32), flux.load_vae(fixture["diffusers"], torch.float32)
    )
    single = z_image_text.load_text_encoder(fixture["text_encoder_file"], fixture["tokenizer"], torch.float32)
    folder = z_image_text.load_text_encoder(fixture["diffusers"], None, torch.float32)
    assert_equal_weights(single.model, folder.model)


def test_release_keys_are_the_fused_layout(fixture):
    keys = set(load_tensors(fixture["transformer_file"]))
    for key in ("layers.0.attention.qkv.weight", "layers.0.attention.out.weight", "x_embedder.weight",
                "layers.0.attention.q_norm.weight", "final_layer.adaLN_modulation.1.weight",
                "noise_refiner.0.attention.qkv.weight", "context_refiner.0.feed_forward.w2.weight"):  # fmt: skip
        assert key in keys, key
    assert not any("to_q" in k or "all_x_embedder" in k for k in keys)


def test_prefixed_fp8_diffusers_and_unused_key_files_load(fixture, tmp_path):
    """ComfyUI's `model.diffusion_model.` prefix and a stray `norm_final.weight` are accepted; a single
    file in diffusers' layout loads too; Turbo's config is taken when the name says Turbo."""
    want = z_image.load_transformer(fixture["diffusers"], torch.float32)
    release = load_tensors(fixture["transformer_file"])
    prefixed = tmp_path / "z_image_turbo_bf16.safetensors"
    save_safetensors(
        {**{f"model.diffusion_model.{k}": v for k, v in release.items()},
         "model.diffusion_model.norm_final.weight": torch.ones(96)}, prefixed,
    )  # fmt: skip
    assert_equal_weights(z_image.load_transformer(prefixed, torch.float32), want)
    as_diffusers = tmp_path / "z_image_diffusers.safetensors"
    save_safetensors(want.state_dict(), as_diffusers)
    assert_equal_weights(z_image.load_transformer(as_diffusers, torch.float32), want)
    assert z_image.is_turbo(prefixed) and not z_image.is_turbo(fixture["transformer_file"])


def test_real_variants_are_told_apart_by_name_only(monkeypatch):
    """Turbo and Base have the same shapes: a real 6B header (in either layout) is the `z-image` variant,
    and the file name picks Turbo's or Base's config. A Qwen3-4B header is recognised as such."""
    from diffusers import ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from tuner.models import identify

    with torch.device("meta"):
        model = ZImageTransformer2DModel.from_config(
            ZImageTransformer2DModel.load_config(z_image.TURBO_CONFIG)
        )
        qwen3 = Qwen3Model(Qwen3Config.from_pretrained(z_image_text.CONFIGS / "qwen3-4b"))
    release = {k: tuple(v.shape) for k, v in z_image.Z_IMAGE_LAYOUT.to_original(model.state_dict()).items()}
    assert release["layers.29.attention.qkv.weight"] == (11520, 3840)
    diffusers_layout = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    text = {z_image_text.original_key(k): tuple(v.shape) for k, v in qwen3.state_dict().items()}
    for header in (release, diffusers_layout, text):
        monkeypatch.setattr(z_image, "read_shapes_of", lambda files, header=header: header)
        monkeypatch.setattr(identify, "read_shapes_of", lambda files, header=header: header)
        if header is text:
            assert (
                identify.identify_single_file("qwen_3_4b.safetensors", z_image_text.SPEC).name == "qwen3-4b"
            )
            continue
        assert z_image.identify_transformer_file("z_image_turbo_bf16.safetensors") == z_image.TURBO_CONFIG
        assert z_image.identify_transformer_file("z_image_bf16.safetensors").name == "base"


def test_another_architecture_is_refused_by_name(fixture, tmp_path):
    """A FLUX.1 file given to z_image is named as FLUX; a Z-Image file given to flux names z_image."""
    from tuner.archs.flux.fixture import write_flux_fixture

    paths = write_flux_fixture(tmp_path / "flux")
    with pytest.raises(CheckpointError, match="not a Z-Image transformer.*FLUX"):
        z_image.load_transformer(paths["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match="z_image"):
        flux.load_transformer(fixture["transformer_file"], torch.float32)


@pytest.fixture(scope="module")
def pipeline():
    parts = build_z_image_components()
    return ZImagePipeline(**parts), parts


def test_prompts_encode_as_the_pipeline_does(pipeline):
    pipe, parts = pipeline
    want, _ = pipe.encode_prompt(list(CAPTIONS), device="cpu", do_classifier_free_guidance=False)
    got = z_image_text.encode_prompts(
        z_image_text.TextEncoder(parts["text_encoder"], parts["tokenizer"]), CAPTIONS
    )
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_predict_matches_the_pipelines_transformer_call(pipeline, fixture):
    """Every transformer call of a 3-step pipeline run, redone by the trainer's `predict` from the
    noisy latents and the pipeline's t: the model's output is minus the velocity at t = 1 - timestep."""
    from tuner.archs.z_image.trainer import ZImageModel

    pipe, parts = pipeline
    calls = []
    hook = parts["transformer"].register_forward_hook(
        lambda module, args, out: calls.append((args[0], args[1], args[2], out[0])), with_kwargs=False
    )
    try:
        pipe(CAPTIONS[0], height=64, width=64, num_inference_steps=3, guidance_scale=0.0, output_type="latent",
             generator=torch.Generator().manual_seed(0))  # fmt: skip
    finally:
        hook.remove()
    assert len(calls) == 3
    trainer = ZImageModel.__new__(ZImageModel)  # predict reads nothing from the config
    for latents, timestep, captions, out in calls:
        noisy = torch.stack(latents).squeeze(2)
        cond = trainer.collate_text([{"prompt_embeds": c} for c in captions])
        got = trainer.predict(parts["transformer"], noisy, 1.0 - timestep, cond)
        torch.testing.assert_close(got, -torch.stack(out).squeeze(2), rtol=1e-5, atol=1e-5)


def _lora(model) -> LoRANetwork:
    record = architecture("z_image")
    network = LoRANetwork.apply_to(model, TargetSpec(record.default_targets), rank=4, alpha=2,
                                   name_map=record.checkpoint_layout())  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    return network


def _velocity(model, captions):
    g = torch.Generator().manual_seed(3)
    noisy = torch.randn(1, 16, 8, 8, generator=g)
    embeds = captions[0][None]
    return z_image.predict_velocity(
        model, noisy, torch.tensor([0.4]), embeds, torch.ones(embeds.shape[:2], dtype=torch.bool)
    )


@pytest.mark.parametrize("layout", ["kohya", "diffusers", "musubi"])
def test_diffusers_lora_loader_reads_the_default_and_diffusers_layouts(pipeline, layout, tmp_path):
    """diffusers' ZImagePipeline.load_lora_weights loads tuner's default file (kohya spelling of the
    release's names: its converter splits the fused `attention.qkv` adapter into to_q / to_k / to_v), the
    musubi file (kohya's spelling of diffusers' names) and the diffusers-layout file (alpha folded) to the
    same output. The comfy layout it refuses (its
    converter leaves the `attention.out.alpha` tensors of lora_A / lora_B files unread)."""
    assert architecture("z_image").save_format == "kohya"
    pipe, parts = pipeline
    model = parts["transformer"]
    encoder = z_image_text.TextEncoder(parts["text_encoder"], parts["tokenizer"])
    captions = z_image_text.encode_prompts(encoder, ["a cat"])
    network = _lora(model)
    with torch.no_grad():
        want = _velocity(model, captions)
    path = tmp_path / f"lora_{layout}.safetensors"
    network.save(path, architecture("z_image").checkpoint_layout(), format=layout)
    network.save(tmp_path / "lora_comfy.safetensors", architecture("z_image").checkpoint_layout())
    network.remove()
    with torch.no_grad():
        base = _velocity(model, captions)
    pipe.load_lora_weights(str(path))
    try:
        with torch.no_grad():
            got = _velocity(model, captions)
    finally:
        pipe.unload_lora_weights()
    assert not torch.allclose(want, base)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="attention.to_out.0.alpha"):
        pipe.load_lora_weights(str(tmp_path / "lora_comfy.safetensors"))
    pipe.unload_lora_weights()


def test_folder_without_transformer_config_is_named(fixture, tmp_path):
    broken = tmp_path / "pipeline"
    shutil.copytree(fixture["diffusers"], broken)
    shutil.rmtree(broken / "transformer")
    with pytest.raises(CheckpointError, match="transformer"):
        z_image.load_transformer(broken, torch.float32)


def test_musubi_file_names_only_musubi_tuners_modules(fixture, tmp_path):
    """musubi-tuner's Z-Image model keeps diffusers' module names (`musubi_tuner/zimage/zimage_model.py`:
    `attention.to_q` / `to_k` / `to_v` / `to_out.0`) and names an adapter `lora_unet_` + that name with "_"
    (`networks/lora.py`), loading with strict=False. The musubi file's stems are such names of the adapted
    modules, one each (ComfyUI's fused `attention_qkv` / `attention_out` are none), and the file reads
    back into tuner equal."""
    model = z_image.load_transformer(fixture["diffusers"], torch.float32)
    musubi = {
        "lora_unet_" + n.replace(".", "_") for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }
    network = _lora(model)
    path = tmp_path / "musubi.safetensors"
    network.save(path, architecture("z_image").checkpoint_layout(), format="musubi")
    stems = {key.split(".")[0] for key in load_file(path)}
    assert {"lora_unet_layers_0_attention_to_q", "lora_unet_layers_0_attention_to_out_0"} <= stems
    assert stems <= musubi
    assert len(stems) == len(network.weights())
    want = network.weights()
    network.remove()
    fresh = _lora(z_image.load_transformer(fixture["diffusers"], torch.float32))
    fresh.load_weights(path)
    for name, weights in fresh.weights().items():
        assert weights.alpha == want[name].alpha, name
        for role, tensor in weights.tensors.items():
            assert torch.equal(tensor, want[name].tensors[role]), (name, role)
