"""HunyuanImage 2.1: the release's / ComfyUI's single file (fp8 too), its diffusers-named form and the
diffusers folder load to the same weights; base and distilled are told apart by shapes, the refiner and
HunyuanVideo files are refused by name; prompts encode, the model is called and a guided generation steps
exactly as diffusers' HunyuanImagePipeline does; adapter files name release tensors in ComfyUI's spelling;
a full fine-tune is saved in the release layout."""

import json
from types import SimpleNamespace

import pytest
import torch
from diffusers import AutoencoderKLHunyuanImageRefiner, HunyuanImagePipeline, HunyuanImageTransformer2DModel
from safetensors.torch import load_file

from project import assert_equal_weights
from tuner.archs.hunyuan_image import loaders as hunyuan_image
from tuner.archs.hunyuan_image import text as hunyuan_image_text
from tuner.archs.hunyuan_image.fixture import build_hunyuan_image_components, write_hunyuan_image_fixture
from tuner.archs.hunyuan_image.keys import HUNYUAN_IMAGE_LAYOUT
from tuner.archs.hunyuan_image.trainer import HunyuanImageModel, distilled_warning
from tuner.archs.hunyuan_video15.loaders import TextEncoders, load_text_encoders
from tuner.diffusion.sampling import flow_sigmas
from tuner.errors import CheckpointError, ConfigError
from tuner.io import save_safetensors
from tuner.models.loading import load_tensors
from tuner.networks.lora import LoRANetwork
from tuner.networks.targets import TargetSpec
from tuner.registry import architecture

CAPTIONS = ["a red dog walking in the park", "a sign that says \"OPEN\" and 'shop' “店”"]


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    return write_hunyuan_image_fixture(tmp_path_factory.mktemp("hunyuan_image"))


@pytest.fixture(scope="module", params=[False, True], ids=["base", "distilled"])
def parts(request):
    return build_hunyuan_image_components(distilled=request.param)


@pytest.fixture(scope="module")
def pipe(parts):
    return HunyuanImagePipeline(**parts)


def _trainer(text_length: int = 24, transformer: str = "hunyuanimage2.1.safetensors") -> HunyuanImageModel:
    """The family's model for a config naming only the cache's text length and the transformer's file."""
    trainer = HunyuanImageModel.__new__(HunyuanImageModel)
    trainer.record = architecture("hunyuan_image")
    trainer.cfg = SimpleNamespace(
        cache=SimpleNamespace(text_max_length=text_length), model=SimpleNamespace(transformer=transformer)
    )
    return trainer


def _encoders(parts) -> TextEncoders:
    return TextEncoders(
        parts["text_encoder"], parts["tokenizer"], parts["text_encoder_2"], parts["tokenizer_2"]
    )


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def test_layouts_load_the_same_weights(fixture, tmp_path):
    """Transformer and VAE: the single file (the release's names), the same in diffusers' names and the
    folder; the text encoders from ComfyUI's files and from the folder."""
    folder = hunyuan_image.load_transformer(fixture["diffusers"], torch.float32)
    assert_equal_weights(hunyuan_image.load_transformer(fixture["transformer_file"], torch.float32), folder)
    save_safetensors(folder.state_dict(), tmp_path / "transformer_diffusers.safetensors")
    assert_equal_weights(
        hunyuan_image.load_transformer(tmp_path / "transformer_diffusers.safetensors", torch.float32), folder
    )
    vae = hunyuan_image.load_vae(fixture["diffusers"], torch.float32)
    assert_equal_weights(hunyuan_image.load_vae(fixture["vae_file"], torch.float32), vae)
    save_safetensors(vae.state_dict(), tmp_path / "vae_diffusers.safetensors")
    assert_equal_weights(hunyuan_image.load_vae(tmp_path / "vae_diffusers.safetensors", torch.float32), vae)
    single = load_text_encoders(fixture["text_encoder_file"], fixture["text_encoder_2_file"], fixture["tokenizer"],
                                fixture["tokenizer_2"], torch.float32)  # fmt: skip
    both = load_text_encoders(fixture["diffusers"], None, None, None, torch.float32)
    assert_equal_weights(single.qwen, both.qwen)
    assert_equal_weights(single.byt5, both.byt5)
    with pytest.raises(CheckpointError, match="HunyuanImage 2.1 needs a second text encoder"):
        load_text_encoders(fixture["text_encoder_file"], None, fixture["tokenizer"], None, torch.float32,
                           model="HunyuanImage 2.1")  # fmt: skip


def test_release_keys_are_the_fused_layout(fixture):
    keys = load_tensors(fixture["transformer_file"])
    for key in ("double_blocks.0.img_attn_qkv.weight", "double_blocks.0.txt_attn_qkv.bias", "double_blocks.0.img_mlp.fc1.weight",
                "single_blocks.0.linear1.weight", "single_blocks.0.linear2.weight", "single_blocks.0.modulation.linear.weight",
                "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight", "byt5_in.fc1.weight", "byt5_in.layernorm.weight",
                "time_in.mlp.0.weight", "img_in.proj.weight", "final_layer.adaLN_modulation.1.weight"):  # fmt: skip
        assert key in keys, key
    assert not any(k.startswith(("guidance_in.", "time_r_in.", "vector_in.")) for k in keys)
    assert not any("transformer_blocks" in k or "to_q" in k for k in keys)
    vae = load_tensors(fixture["vae_file"])
    assert {"encoder.down.0.block.0.conv1.weight", "encoder.down.0.downsample.conv.weight",
            "decoder.up.0.upsample.conv.weight", "decoder.mid.attn_1.proj_out.weight"} <= set(vae)  # fmt: skip


def test_comfy_fp8_scaled_file_loads(fixture, tmp_path):
    """ComfyUI's prefix with a scaled fp8 fused weight: dequantized, then split into q, k, v."""
    release = load_tensors(fixture["transformer_file"])
    key = "double_blocks.0.img_attn_qkv.weight"
    stored = {f"model.diffusion_model.{k}": v for k, v in release.items()}
    stored[f"model.diffusion_model.{key}"] = (release[key] / 0.5).to(torch.float8_e4m3fn)
    stored[f"model.diffusion_model.{key}_scale"] = torch.tensor(0.5)
    save_safetensors(stored, tmp_path / "hunyuanimage2.1_fp8_e4m3fn.safetensors")
    got = hunyuan_image.load_transformer(tmp_path / "hunyuanimage2.1_fp8_e4m3fn.safetensors", torch.float32)
    rounded = (release[key] / 0.5).to(torch.float8_e4m3fn).float() * 0.5
    attn = got.transformer_blocks[0].attn
    assert torch.equal(torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]), rounded)


def test_distilled_is_told_apart_by_its_embedders(tmp_path):
    paths = write_hunyuan_image_fixture(tmp_path / "distilled", distilled=True)
    model = hunyuan_image.load_transformer(paths["transformer_file"], torch.float32)
    assert model.config.guidance_embeds and model.config.use_meanflow
    assert_equal_weights(model, hunyuan_image.load_transformer(paths["diffusers"], torch.float32))
    assert hunyuan_image.is_distilled(paths["transformer_file"]) and hunyuan_image.is_distilled(
        paths["diffusers"]
    )
    warning = distilled_warning(
        SimpleNamespace(model=SimpleNamespace(transformer=str(paths["transformer_file"])))
    )
    assert "undoes the distillation" in warning


def test_real_variants_are_told_apart_by_shapes(monkeypatch):
    from tuner.models import identify

    for name in ("base", "distilled"):
        config = hunyuan_image.CONFIGS / "transformer" / name
        with torch.device("meta"):
            model = HunyuanImageTransformer2DModel.from_config(
                HunyuanImageTransformer2DModel.load_config(config)
            )
        header = {k: tuple(v.shape) for k, v in HUNYUAN_IMAGE_LAYOUT.to_original(model.state_dict()).items()}
        monkeypatch.setattr(identify, "read_shapes_of", lambda files, header=header: header)
        spec = hunyuan_image.TRANSFORMER_SPEC
        assert identify.identify_single_file("hunyuanimage2.1.safetensors", spec).name == name


def test_refiner_and_hunyuan_video_files_are_refused_by_name(tmp_path):
    from tuner.archs.hunyuan_video.fixture import write_hunyuan_video_fixture

    with torch.device("meta"):  # the refiner: a 3D patch embedder, no ByT5 mapper
        refiner = HunyuanImageTransformer2DModel(num_attention_heads=2, attention_head_dim=32, num_layers=1,
                                                 num_single_layers=1, num_refiner_layers=1, patch_size=(1, 1, 1),
                                                 in_channels=128, rope_axes_dim=(8, 12, 12), text_embed_dim=64)  # fmt: skip
    state = {
        k: torch.zeros(v.shape) for k, v in HUNYUAN_IMAGE_LAYOUT.to_original(refiner.state_dict()).items()
    }
    save_safetensors(state, tmp_path / "hunyuanimage2.1_refiner_bf16.safetensors")
    with pytest.raises(CheckpointError, match="refiner"):
        hunyuan_image.load_transformer(tmp_path / "hunyuanimage2.1_refiner_bf16.safetensors", torch.float32)
    folder = tmp_path / "refiner_diffusers" / "transformer"  # the same class: told apart by its 3D patch
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps({**dict(refiner.config), "_class_name": "HunyuanImageTransformer2DModel"})
    )
    with pytest.raises(CheckpointError, match="HunyuanImage 2.1 refiner"):
        hunyuan_image.load_transformer(folder.parent, torch.float32)
    with torch.device("meta"):
        vae = AutoencoderKLHunyuanImageRefiner(block_out_channels=(32,) * 5, layers_per_block=1)
    save_safetensors(
        {k: torch.zeros(v.shape) for k, v in vae.state_dict().items()}, tmp_path / "refiner_vae.safetensors"
    )
    with pytest.raises(CheckpointError, match="refiner's 3D VAE"):
        hunyuan_image.load_vae(tmp_path / "refiner_vae.safetensors", torch.float32)
    video = write_hunyuan_video_fixture(tmp_path / "hunyuan_video")
    with pytest.raises(CheckpointError, match='"hunyuan_video"'):
        hunyuan_image.load_transformer(video["transformer_file"], torch.float32)


def test_hunyuan_video_loaders_refuse_a_hunyuan_image_file_by_name(fixture):
    """Its blocks are HunyuanVideo's: both HunyuanVideo loaders name `hunyuan_image`."""
    from tuner.archs.hunyuan_video import loaders as hunyuan_video
    from tuner.archs.hunyuan_video15 import loaders as hunyuan_video15

    for other in (hunyuan_video, hunyuan_video15):
        with pytest.raises(CheckpointError, match='"hunyuan_image"'):
            other.load_transformer(fixture["transformer_file"], torch.float32)


# ---------------------------------------------------------------------------------------------------
# Against HunyuanImagePipeline
# ---------------------------------------------------------------------------------------------------


def test_glyph_text_takes_every_kind_of_quote_in_the_pipelines_order():
    from diffusers.pipelines.hunyuan_image.pipeline_hunyuanimage import extract_glyph_text

    for caption in CAPTIONS + ["'a' \"b\" 'c' ‘d’ “e”"]:
        assert hunyuan_image_text.glyph_text(caption) == extract_glyph_text(caption)


def test_prompts_encode_as_the_pipeline_does(pipe, parts):
    pipe.tokenizer_max_length = 24
    want = pipe.encode_prompt(list(CAPTIONS), device="cpu", batch_size=2)
    got = _trainer().collate_text(
        hunyuan_image_text.encode_prompts(_encoders(parts), CAPTIONS, max_length=24)
    )
    for name, (embeds, mask) in {"text": want[:2], "glyph": want[2:]}.items():
        for row, (e, m) in enumerate(zip(embeds, mask)):
            length = int(m.sum())
            torch.testing.assert_close(got[name][row, :length], e[m.bool()], rtol=1e-5, atol=1e-5)
            assert int(got["mask" if name == "text" else "glyph_mask"][row].sum()) == length


def test_predict_matches_the_pipelines_transformer_call(pipe, parts):
    calls = []
    hook = parts["transformer"].register_forward_hook(
        lambda m, a, kw, out: calls.append((kw, out[0])), with_kwargs=True
    )
    pipe.tokenizer_max_length = 24
    try:
        pipe(CAPTIONS[1], height=64, width=32, num_inference_steps=2, output_type="latent",
             generator=torch.Generator().manual_seed(0))  # fmt: skip
    finally:
        hook.remove()
    assert len(calls) == (4 if pipe.guider is not None else 2)
    for kw, out in calls:
        cond = {"text": kw["encoder_hidden_states"], "mask": kw["encoder_attention_mask"],
                "glyph": kw["encoder_hidden_states_2"], "glyph_mask": kw["encoder_attention_mask_2"]}  # fmt: skip
        if kw["timestep_r"] is not None:
            cond["t_next"] = kw["timestep_r"] / 1000
        got = _trainer().predict(parts["transformer"], kw["hidden_states"], kw["timestep"] / 1000, cond)
        torch.testing.assert_close(got, out, rtol=1e-6, atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("method", ["auto", "cfg"])
def test_guided_generation_matches_the_pipeline(method):
    """What `tuner generate` computes for the base model (our encoding, shift 5 over tuner's evenly spaced
    sigmas, the Euler steps and guidance of `sample_flow`) gives the latents HunyuanImagePipeline gives for
    the same noise, steps and guidance: by default with its release guider (`AdaptiveProjectedMixGuidance`
    as constructed: CFG for 6 steps, then APG), with `cfg` with plain CFG. 8 steps reach APG."""
    from diffusers import AdaptiveProjectedMixGuidance, ClassifierFreeGuidance

    parts = build_hunyuan_image_components()
    guider = (
        AdaptiveProjectedMixGuidance() if method == "auto" else ClassifierFreeGuidance(guidance_scale=3.5)
    )
    pipe = HunyuanImagePipeline(**{**parts, "guider": guider})
    pipe.tokenizer_max_length = 24
    trainer = _trainer(24)
    cond, uncond = (
        trainer.collate_text(trainer.encode_text(_encoders(parts), [p])) for p in (CAPTIONS[1], "")
    )
    x = torch.randn(1, 64, 2, 1, generator=torch.Generator().manual_seed(0))  # a 64x32 image
    out = pipe(
        CAPTIONS[1], height=64, width=32, num_inference_steps=8, output_type="latent", latents=x
    ).images
    sigmas = flow_sigmas(8, trainer.default_sample_shift(x.shape[1:]))
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas, rtol=1e-6, atol=1e-6)

    def model_fn(x, t, c):  # as `tuner generate` calls the family
        return trainer.predict(parts["transformer"], x, t / 1000, c)

    x = trainer.sample_flow(model_fn, x, sigmas, cond, uncond, 3.5, guidance_method=method)
    torch.testing.assert_close(x, out, rtol=1e-5, atol=1e-5)


def _guidance_methods(monkeypatch) -> list[str]:
    """The `guidance_method` of every `sample_flow` call from now on (the 8th argument or a keyword)."""
    seen = []
    sample_flow = HunyuanImageModel.sample_flow

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("guidance_method", args[7] if len(args) > 7 else "auto"))
        return sample_flow(self, *args, **kwargs)

    monkeypatch.setattr(HunyuanImageModel, "sample_flow", spy)
    return seen


@pytest.mark.parametrize("method", ["auto", "cfg"])
def test_generate_cli_passes_the_guidance_method(fixture, tmp_path, capsys, monkeypatch, method):
    from project import make_project, run

    seen = _guidance_methods(monkeypatch)
    config = make_project(tmp_path / "project", fixture["root"], architecture="hunyuan_image")
    code, log = run(capsys, "generate", "--config", config, "--prompt", "a cat", "--size", "32x32",
                    "--frames", "1", "--steps", "2", "--guidance", "3.5", "--guidance-method", method,
                    "--device", "cpu", "--out", tmp_path / "a.png")  # fmt: skip
    assert code == 0, log
    assert seen == [method]


def test_apg_is_refused_for_a_model_whose_release_guides_with_cfg():
    from tuner.config.schema import OneFrameConfig
    from tuner.generate import GenerateOptions, check_options
    from tuner.trainers import trainer_class

    model = SimpleNamespace(transformer="flux1-dev.safetensors", guidance=1.0)
    flux = trainer_class("flux")(SimpleNamespace(model=model, one_frame=OneFrameConfig()))
    with pytest.raises(ConfigError, match="--guidance-method apg: flux"):
        check_options(flux, GenerateOptions(prompt="a", out="a.png", width=64, height=64, frames=1,
                                            guidance_method="apg"))  # fmt: skip


@torch.no_grad()
def test_distilled_generation_matches_the_pipeline():
    """The distilled model as `tuner generate` samples it (no CFG, shift 4, the record's `flow_next_time`
    giving MeanFlow's interval end r) gives the latents HunyuanImagePipeline gives for the same noise and
    steps: r is the next step's time, 0 at the last."""
    parts = build_hunyuan_image_components(distilled=True)
    pipe = HunyuanImagePipeline(**parts)
    pipe.tokenizer_max_length = 24
    trainer = _trainer(24, "hunyuanimage2.1-distilled.safetensors")
    cond = trainer.collate_text(trainer.encode_text(_encoders(parts), [CAPTIONS[0]]))
    x = torch.randn(1, 64, 2, 1, generator=torch.Generator().manual_seed(0))
    out = pipe(
        CAPTIONS[0], height=64, width=32, num_inference_steps=3, output_type="latent", latents=x
    ).images
    sigmas = flow_sigmas(3, trainer.default_sample_shift(x.shape[1:]))
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas, rtol=1e-6, atol=1e-6)

    def model_fn(x, t, c):  # as `tuner generate` calls the family
        return trainer.predict(parts["transformer"], x, t / 1000, c)

    x = trainer.sample_flow(model_fn, x, sigmas, cond, None, 1.0)
    torch.testing.assert_close(x, out, rtol=1e-5, atol=1e-5)


def test_distilled_samples_at_shift_4():
    assert (
        _trainer(transformer="hunyuanimage2.1_distilled_fp8_e4m3fn.safetensors").default_sample_shift(
            (64, 2, 2)
        )
        == 4.0
    )
    assert _trainer().default_sample_shift((64, 2, 2)) == 5.0


# ---------------------------------------------------------------------------------------------------
# Adapter files
# ---------------------------------------------------------------------------------------------------


def test_kohya_file_names_release_tensors_in_comfyuis_spelling(fixture, tmp_path):
    """Double blocks: 8 attention + 4 MLP linears (q/k/v written fused); single blocks: q/k/v + MLP in
    (fused `linear1`) and `linear2`. The default file's stems are `lora_unet_` + ComfyUI's module names
    (`img_mlp_0`, `img_attn_qkv`), each a release tensor once ComfyUI's renames are undone."""
    record = architecture("hunyuan_image")
    assert record.save_format == "kohya"
    model = hunyuan_image.load_transformer(fixture["diffusers"], torch.float32)
    network = LoRANetwork.apply_to(model, TargetSpec(record.default_targets), rank=4, alpha=4,
                                   name_map=record.checkpoint_layout())  # fmt: skip
    assert len(network.weights()) == 12 + 5
    network.save(tmp_path / "kohya.safetensors", record.checkpoint_layout(), format="kohya")
    network.remove()
    stems = {k.split(".")[0] for k in load_file(tmp_path / "kohya.safetensors")}
    release = {k.removesuffix(".weight").replace(".", "_") for k in load_tensors(fixture["transformer_file"])}
    comfy = {
        "img_mlp_0": "img_mlp_fc1",
        "img_mlp_2": "img_mlp_fc2",
        "txt_mlp_0": "txt_mlp_fc1",
        "txt_mlp_2": "txt_mlp_fc2",
    }
    assert (
        "lora_unet_double_blocks_0_img_mlp_0" in stems and "lora_unet_double_blocks_0_img_attn_qkv" in stems
    )
    for stem in stems:
        body = stem.removeprefix("lora_unet_")
        for theirs, ours in comfy.items():
            body = body.replace(theirs, ours)
        assert body in release, stem


def test_full_fine_tune_samples_and_is_saved_in_the_release_layout(fixture, tmp_path, monkeypatch):
    """One step of full fine-tuning draws its guided sample (plain CFG, as `sample.guidance_method` asks)
    and writes the release's keys and shapes, which tuner's loader reads back to the trained weights."""
    from project import cfg, make_project
    from tuner.cli import main
    from tuner.trainers import trainer_class

    config = make_project(tmp_path / "project", fixture["root"], architecture="hunyuan_image")
    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0
    overrides = ("network.type='full'", "train.max_steps=1", "train.lr_warmup_steps=0", "log.tensorboard=false",
                 "sample.prompts=['a cat']", "sample.every_n_steps=1", "sample.width=32", "sample.height=32",
                 "sample.steps=2", "sample.guidance=3.5", "sample.guidance_method='cfg'")  # fmt: skip
    seen = _guidance_methods(monkeypatch)
    trainer = trainer_class("hunyuan_image")(cfg(config, f"save.output_dir='{tmp_path / 'out'}'", *overrides))
    trainer.train(log=lambda s: None)
    assert [p.suffix for p in (tmp_path / "out" / "samples").iterdir()] == [".png"] and seen == ["cfg"]
    saved = tmp_path / "out" / "demo_lora.safetensors"
    shapes = {k: tuple(v.shape) for k, v in load_file(saved).items()}
    assert shapes == {k: tuple(v.shape) for k, v in load_tensors(fixture["transformer_file"]).items()}
    ours = hunyuan_image.load_transformer(saved, torch.float32)
    before = hunyuan_image.load_transformer(fixture["diffusers"], torch.float32)
    assert not torch.equal(
        ours.transformer_blocks[0].attn.to_q.weight, before.transformer_blocks[0].attn.to_q.weight
    )
