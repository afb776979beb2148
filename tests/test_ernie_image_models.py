"""ERNIE-Image: the release's single file (ComfyUI's, fp8 too) and the diffusers folder load to the same
weights diffusers' own single-file loader gives; the base model and Turbo are told apart by name; files of
other architectures are refused by name; prompts encode, the model is called and a guided generation steps
exactly as diffusers' ErnieImagePipeline does; adapter files load in diffusers; a full fine-tune is saved in
the release's layout."""

from types import SimpleNamespace

import pytest
import torch
from diffusers import ErnieImagePipeline, ErnieImageTransformer2DModel
from safetensors.torch import load_file

from project import assert_equal_weights, check_comfy_stems_and_diffusers_load
from tuner.archs.ernie_image import loaders as ernie
from tuner.archs.ernie_image import text as ernie_text
from tuner.archs.ernie_image.fixture import build_ernie_image_components, write_ernie_image_fixture
from tuner.archs.ernie_image.trainer import ErnieImageModel, turbo_warning
from tuner.archs.flux2 import loaders as flux2
from tuner.archs.flux2 import text as flux2_text
from tuner.errors import CheckpointError
from tuner.io import save_safetensors
from tuner.models.loading import load_tensors
from tuner.networks.lora import LoRANetwork
from tuner.networks.targets import TargetSpec
from tuner.registry import architecture

CAPTIONS = ["a red dog walking in the park", "a cat"]


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    return write_ernie_image_fixture(tmp_path_factory.mktemp("ernie_image"))


@pytest.fixture(scope="module")
def parts():
    return build_ernie_image_components()


@pytest.fixture(scope="module")
def pipe(parts):
    return ErnieImagePipeline(**parts)


def _trainer(text_length: int = 512) -> ErnieImageModel:
    """The family's model for a config naming only the cache's text length."""
    trainer = ErnieImageModel.__new__(ErnieImageModel)
    trainer.record = architecture("ernie_image")
    trainer.cfg = SimpleNamespace(
        cache=SimpleNamespace(text_max_length=text_length),
        model=SimpleNamespace(transformer="ernie-image.safetensors"),
    )
    return trainer


def _encoder(parts) -> flux2_text.TextEncoder:
    return flux2_text.TextEncoder(
        parts["text_encoder"].language_model, parts["tokenizer"], ernie_text.MINISTRAL3
    )


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def test_layouts_load_bit_identical_to_diffusers_single_file_loader(fixture):
    folder = ernie.load_transformer(fixture["diffusers"], torch.float32)
    assert_equal_weights(ernie.load_transformer(fixture["transformer_file"], torch.float32), folder)
    theirs = ErnieImageTransformer2DModel.from_single_file(
        str(fixture["transformer_file"]), config=str(ernie.TRANSFORMER_VARIANTS[1].config_dir),
        torch_dtype=torch.float32, local_files_only=True,
    )  # fmt: skip
    assert_equal_weights(theirs, folder)
    assert_equal_weights(
        flux2.load_vae(fixture["vae_file"], torch.float32),
        flux2.load_vae(fixture["diffusers"], torch.float32),
    )
    kind = ernie_text.MINISTRAL3
    single = flux2_text.load_text_encoder(
        fixture["text_encoder_file"], fixture["tokenizer"], torch.float32, kind
    )
    folder_encoder = flux2_text.load_text_encoder(fixture["diffusers"], None, torch.float32, kind)
    assert_equal_weights(single.model, folder_encoder.model)
    assert single.tokenizer("a cat").input_ids == folder_encoder.tokenizer("a cat").input_ids


def test_a_tokenizer_without_a_chat_template_loads(fixture, tmp_path):
    """ERNIE-Image feeds prompts as they are: its tokenizer needs no chat template (FLUX.2's do)."""
    import shutil

    folder = tmp_path / "tokenizer"
    shutil.copytree(fixture["tokenizer"], folder)
    (folder / "chat_template.jinja").unlink()
    encoder = flux2_text.load_text_encoder(
        fixture["text_encoder_file"], folder, torch.float32, ernie_text.MINISTRAL3
    )
    assert encoder.tokenizer.chat_template is None
    assert ernie_text.encode_prompts(encoder, ["a cat"])[0].shape == (3, 32)


def test_prefixed_fp8_file_loads(fixture, tmp_path):
    """ComfyUI's `model.diffusion_model.` prefix with scaled fp8 weights (dequantized) loads to the
    fp8-rounded weights, the others unchanged."""
    want = ernie.load_transformer(fixture["diffusers"], torch.float32)
    release = load_tensors(fixture["transformer_file"])
    key = "layers.0.self_attention.to_q.weight"
    fp8 = {f"model.diffusion_model.{k}": v for k, v in release.items()}
    fp8[f"model.diffusion_model.{key}"] = (release[key] / 0.5).to(torch.float8_e4m3fn)
    fp8[f"model.diffusion_model.{key.removesuffix('weight')}weight_scale"] = torch.tensor(0.5)
    path = tmp_path / "ernie-image_fp8_scaled.safetensors"
    save_safetensors(fp8, path)
    got = ernie.load_transformer(path, torch.float32)
    rounded = (release[key] / 0.5).to(torch.float8_e4m3fn).float() * 0.5
    assert torch.equal(got.layers[0].self_attention.to_q.weight, rounded)
    assert torch.equal(got.layers[1].mlp.up_proj.weight, want.layers[1].mlp.up_proj.weight)


def test_base_and_turbo_are_told_apart_by_name(monkeypatch):
    """The base model and Turbo have the same shapes: a real 8B header is ERNIE-Image, the file name says
    Turbo (training it warns); a Ministral 3 3B header is recognised as such."""
    from transformers import Ministral3Config, Ministral3Model

    from tuner.models import identify

    config = ernie.TRANSFORMER_VARIANTS[0].config_dir
    with torch.device("meta"):
        model = ErnieImageTransformer2DModel.from_config(ErnieImageTransformer2DModel.load_config(config))
        text = Ministral3Model(Ministral3Config.from_pretrained(ernie_text.CONFIGS / "ministral-3-3b"))
    header = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert header["layers.35.mlp.gate_proj.weight"] == (12288, 4096)
    monkeypatch.setattr(identify, "read_shapes_of", lambda files: header)
    assert (
        identify.identify_single_file("ernie-image-turbo.safetensors", ernie.TRANSFORMER_SPEC).name
        == "ernie-image"
    )
    assert ernie.is_turbo("ernie-image-turbo.safetensors") and not ernie.is_turbo("ernie-image.safetensors")
    lm = {k: tuple(v.shape) for k, v in text.state_dict().items()}
    assert identify.pick_variant(lm, ernie_text.MINISTRAL3.variants, "te", "text").name == "ministral-3-3b"
    cfg = SimpleNamespace(model=SimpleNamespace(transformer="models/ernie-image-turbo.safetensors"))
    assert "ERNIE-Image-Turbo" in turbo_warning(cfg)
    assert turbo_warning(SimpleNamespace(model=SimpleNamespace(transformer="ernie-image.safetensors"))) == ""


def test_another_architecture_is_refused_by_name(fixture, tmp_path):
    """A Qwen-Image file given to ernie_image is named as Qwen-Image; an ERNIE-Image file given to
    qwen_image names ERNIE-Image; FLUX.2's Mistral-Small text encoder names flux2."""
    from tuner.archs.flux2.fixture import write_flux2_fixture
    from tuner.archs.qwen_image import loaders as qwen_image
    from tuner.archs.qwen_image.fixture import write_qwen_image_fixture

    qwen = write_qwen_image_fixture(tmp_path / "qwen")
    with pytest.raises(CheckpointError, match="not an? ERNIE-Image transformer.*Qwen-Image"):
        ernie.load_transformer(qwen["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match="ernie_image"):
        qwen_image.load_transformer(fixture["transformer_file"], torch.float32)
    flux2_files = write_flux2_fixture(tmp_path / "flux2")
    with pytest.raises(CheckpointError, match='Mistral-Small.*"flux2"'):
        flux2_text.load_text_encoder(
            flux2_files["text_encoder_file"], fixture["tokenizer"], torch.float32, ernie_text.MINISTRAL3
        )


# ---------------------------------------------------------------------------------------------------
# Against ErnieImagePipeline
# ---------------------------------------------------------------------------------------------------


def test_prompts_encode_as_the_pipeline_does(pipe, parts):
    want = pipe.encode_prompt([*CAPTIONS, ""], device="cpu")
    got = ernie_text.encode_prompts(_encoder(parts), [*CAPTIONS, ""])
    assert got[2].shape == (1, 32)  # the BOS token alone
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_predict_matches_the_pipelines_transformer_call(pipe, parts):
    """Every transformer call of a guided 2-step run (the empty negative and the caption padded to one
    length), redone by the trainer's `predict` from the same rows, mask and t."""
    calls = []
    hook = parts["transformer"].register_forward_hook(
        lambda m, a, kw, out: calls.append((kw, out[0])), with_kwargs=True
    )
    try:
        pipe(CAPTIONS[0], height=64, width=32, num_inference_steps=2, guidance_scale=3.0, output_type="latent",
             generator=torch.Generator().manual_seed(0))  # fmt: skip
    finally:
        hook.remove()
    assert len(calls) == 2
    for kw, out in calls:
        lens = kw["text_lens"]
        mask = torch.arange(kw["text_bth"].shape[1]) < lens[:, None]
        cond = {"prompt_embeds": kw["text_bth"], "prompt_mask": mask}
        got = _trainer().predict(parts["transformer"], kw["hidden_states"], kw["timestep"] / 1000, cond)
        torch.testing.assert_close(got, out, rtol=0, atol=0)


@torch.no_grad()
def test_latents_decode_as_the_pipeline_does(pipe, parts, monkeypatch):
    """The VAE's BatchNorm de-normalization uses ErnieImagePipeline's ε = 1e-5, not the config's 1e-4."""
    import copy

    latents = torch.randn(1, 128, 4, 2, generator=torch.Generator().manual_seed(1))
    bn = pipe.vae.bn
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + 1e-5)
    want = pipe.vae.decode(pipe._unpatchify_latents(latents * std + bn.running_mean.view(1, -1, 1, 1))).sample
    vae = copy.deepcopy(parts["vae"])
    assert vae.config.batch_norm_eps == 1e-4
    monkeypatch.setattr(flux2, "load_vae", lambda path, dtype: vae)
    trainer = _trainer()
    trainer.weights_path = lambda component: "flux2-vae.safetensors"
    loaded = trainer.load_vae(torch.device("cpu"), torch.float32)
    assert loaded.config.batch_norm_eps == 1e-5
    torch.testing.assert_close(trainer.decode_latents(loaded, latents)[:, :, 0], want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------
# Adapter files
# ---------------------------------------------------------------------------------------------------


def _lora(model) -> LoRANetwork:
    record = architecture("ernie_image")
    network = LoRANetwork.apply_to(model, TargetSpec(record.default_targets), rank=4, alpha=4,
                                   name_map=record.checkpoint_layout())  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    return network


def test_default_targets_are_every_block_linear(parts):
    """The attention q/k/v/out and the three MLP linears of every block: 7 per block."""
    network = _lora(parts["transformer"])
    try:
        assert len(network.weights()) == 7 * 2
    finally:
        network.remove()


def test_comfy_file_names_release_tensors_and_diffusers_loads_its_layout(fixture, pipe, parts, tmp_path):
    """The comfy file's stems (the default `comfy_folded`'s too, without `.alpha`) are `diffusion_model.` +
    release modules that exist in the release file; diffusers' ErnieImagePipeline.load_lora_weights loads
    the diffusers-layout file (and the default file) to our output; it refuses the comfy file's `.alpha`."""
    assert architecture("ernie_image").save_format == "comfy_folded"
    model = parts["transformer"]
    layout = architecture("ernie_image").checkpoint_layout()
    release = set(load_tensors(fixture["transformer_file"]))
    embeds = ernie_text.encode_prompts(_encoder(parts), ["a cat"])
    cond = _trainer().collate_text([{"prompt_embeds": embeds[0]}])
    noisy = torch.randn(1, 128, 2, 2, generator=torch.Generator().manual_seed(3))
    check_comfy_stems_and_diffusers_load(
        pipe, _lora(model), lambda: _trainer().predict(model, noisy, torch.tensor([0.4]), cond), release,
        layout, tmp_path,
    )  # fmt: skip
    with pytest.raises(ValueError, match="lora"):
        pipe.load_lora_weights(str(tmp_path / "comfy.safetensors"))
    pipe.unload_lora_weights()


def test_full_fine_tune_samples_and_is_saved_in_the_release_layout(fixture, tmp_path):
    """One step of full fine-tuning draws its guided sample and writes the release's keys and shapes, which
    diffusers' own single-file loader reads, and tuner's loader reads back to the trained weights."""
    from project import cfg, make_project
    from tuner.cli import main
    from tuner.trainers import trainer_class

    config = make_project(tmp_path / "project", fixture["root"], architecture="ernie_image")
    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0
    overrides = ("network.type='full'", "train.max_steps=1", "train.lr_warmup_steps=0", "log.tensorboard=false",
                 "sample.prompts=['a cat']", "sample.every_n_steps=1", "sample.width=32", "sample.height=32",
                 "sample.steps=2", "sample.guidance=4.0")  # fmt: skip
    trainer = trainer_class("ernie_image")(cfg(config, f"save.output_dir='{tmp_path / 'out'}'", *overrides))
    trainer.train(log=lambda s: None)
    assert [p.suffix for p in (tmp_path / "out" / "samples").iterdir()] == [".png"]
    saved = tmp_path / "out" / "demo_lora.safetensors"
    shapes = {k: tuple(v.shape) for k, v in load_file(saved).items()}
    assert shapes == {k: tuple(v.shape) for k, v in load_tensors(fixture["transformer_file"]).items()}
    ours = ernie.load_transformer(saved, torch.float32)
    theirs = ErnieImageTransformer2DModel.from_single_file(
        str(saved), config=str(ernie.TRANSFORMER_VARIANTS[1].config_dir), torch_dtype=torch.float32,
        local_files_only=True,
    )  # fmt: skip
    assert_equal_weights(ours, theirs)
    assert not torch.equal(
        ours.text_proj.weight, ernie.load_transformer(fixture["diffusers"], torch.float32).text_proj.weight
    )
