"""Krea 2: the release's single file (ComfyUI's, fp8 too), its diffusers-named form and the diffusers folder
load to the same weights diffusers' own single-file loader gives; RAW and Turbo are told apart by name;
files of other architectures are refused by name; prompts encode, the model is called and a guided
generation steps exactly as diffusers' Krea2Pipeline does; adapter files load in diffusers."""

from types import SimpleNamespace

import pytest
import torch
from diffusers import Krea2Pipeline, Krea2Transformer2DModel
from safetensors.torch import load_file

from project import assert_equal_weights, check_comfy_stems_and_diffusers_load
from tuner.archs.krea2 import loaders as krea2
from tuner.archs.krea2 import text as krea2_text
from tuner.archs.krea2.fixture import build_krea2_components, write_krea2_fixture
from tuner.archs.krea2.keys import KREA2_LAYOUT
from tuner.archs.krea2.trainer import Krea2Model, turbo_warning
from tuner.archs.qwen_image import loaders as qwen_image
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
    return write_krea2_fixture(tmp_path_factory.mktemp("krea2"))


@pytest.fixture(scope="module")
def parts():
    return build_krea2_components()


@pytest.fixture(scope="module")
def pipe(parts):
    return Krea2Pipeline(**parts)


def _trainer(text_length: int = 512, transformer: str = "krea2_raw_bf16.safetensors") -> Krea2Model:
    """The family's model for a config naming only the cache's text length and the transformer."""
    trainer = Krea2Model.__new__(Krea2Model)
    trainer.record = architecture("krea2")
    trainer.cfg = SimpleNamespace(
        cache=SimpleNamespace(text_max_length=text_length), model=SimpleNamespace(transformer=transformer)
    )
    return trainer


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def test_layouts_load_bit_identical_to_diffusers_single_file_loader(fixture):
    folder = krea2.load_transformer(fixture["diffusers"], torch.float32)
    assert_equal_weights(krea2.load_transformer(fixture["transformer_file"], torch.float32), folder)
    theirs = Krea2Transformer2DModel.from_single_file(
        str(fixture["transformer_file"]), config=str(krea2.TRANSFORMER_VARIANTS[1].config_dir),
        torch_dtype=torch.float32, local_files_only=True,
    )  # fmt: skip
    assert_equal_weights(theirs, folder)
    assert_equal_weights(
        qwen_image.load_vae(fixture["vae_file"], torch.float32),
        qwen_image.load_vae(fixture["diffusers"], torch.float32),
    )
    single = krea2_text.load_text_encoder(fixture["text_encoder_file"], fixture["tokenizer"], torch.float32)
    assert_equal_weights(
        single.model, krea2_text.load_text_encoder(fixture["diffusers"], None, torch.float32).model
    )


def test_release_keys_are_the_release_layout(fixture):
    keys = load_tensors(fixture["transformer_file"])
    for key in ("blocks.0.attn.wq.weight", "blocks.0.attn.gate.weight", "blocks.0.attn.qknorm.qnorm.scale",
                "blocks.0.mlp.up.weight", "blocks.0.prenorm.scale", "first.weight", "tmlp.0.weight",
                "tproj.1.weight", "txtmlp.0.scale", "txtfusion.layerwise_blocks.0.attn.wo.weight",
                "txtfusion.projector.weight", "last.modulation.lin", "last.norm.scale"):  # fmt: skip
        assert key in keys, key
    assert keys["blocks.0.mod.lin"].shape == (6 * 64,)  # flattened, as the release stores it
    assert not any("transformer_blocks" in k or "to_q" in k for k in keys)


def test_prefixed_fp8_and_diffusers_named_files_load(fixture, tmp_path):
    """ComfyUI's `model.diffusion_model.` prefix with scaled fp8 weights (dequantized) and a single file in
    diffusers' names load; the fp8 file gives the fp8-rounded weights."""
    want = krea2.load_transformer(fixture["diffusers"], torch.float32)
    release = load_tensors(fixture["transformer_file"])
    fp8 = {}
    for key, value in release.items():
        fp8[f"model.diffusion_model.{key}"] = value
        if key == "blocks.0.attn.wq.weight":
            fp8[f"model.diffusion_model.{key}"] = (value / 0.5).to(torch.float8_e4m3fn)
            fp8["model.diffusion_model.blocks.0.attn.wq.weight_scale"] = torch.tensor(0.5)
    path = tmp_path / "krea2_raw_fp8_scaled.safetensors"
    save_safetensors(fp8, path)
    got = krea2.load_transformer(path, torch.float32)
    rounded = (release["blocks.0.attn.wq.weight"] / 0.5).to(torch.float8_e4m3fn).float() * 0.5
    assert torch.equal(got.transformer_blocks[0].attn.to_q.weight, rounded)
    assert torch.equal(got.transformer_blocks[1].ff.up.weight, want.transformer_blocks[1].ff.up.weight)
    as_diffusers = tmp_path / "krea2_diffusers.safetensors"
    save_safetensors(want.state_dict(), as_diffusers)
    assert_equal_weights(krea2.load_transformer(as_diffusers, torch.float32), want)


def test_raw_and_turbo_are_told_apart_by_name(monkeypatch):
    """RAW and Turbo have the same shapes: a real 12B header (either layout) is Krea 2, the file name
    picks Turbo's config and sampling shift; a Qwen3-VL-4B header is recognised as such."""
    from transformers import Qwen3VLTextConfig, Qwen3VLTextModel

    from tuner.models import identify

    with torch.device("meta"):
        model = Krea2Transformer2DModel.from_config(Krea2Transformer2DModel.load_config(krea2.TURBO_CONFIG))
        qwen = Qwen3VLTextModel(Qwen3VLTextConfig.from_pretrained(krea2_text.CONFIGS / "qwen3-vl-4b"))
    release = {k: tuple(v.shape) for k, v in KREA2_LAYOUT.to_original(model.state_dict()).items()}
    assert release["blocks.27.attn.wq.weight"] == (6144, 6144)
    diffusers_layout = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for header in (release, diffusers_layout):
        monkeypatch.setattr(identify, "read_shapes_of", lambda files, header=header: header)
        assert (
            identify.identify_single_file("krea2_turbo_bf16.safetensors", krea2.TRANSFORMER_SPEC).name
            == "raw"
        )
    assert krea2.is_turbo("krea2_turbo_bf16.safetensors") and not krea2.is_turbo("krea2_raw_bf16.safetensors")
    text = {qwen3_vl.LANGUAGE_MODEL + k: tuple(v.shape) for k, v in qwen.state_dict().items()}
    monkeypatch.setattr(identify, "read_shapes_of", lambda files: text)
    assert identify.identify_single_file("qwen3vl_4b_bf16.safetensors", krea2_text.SPEC).name == "qwen3-vl-4b"
    cfg = SimpleNamespace(model=SimpleNamespace(transformer="models/krea2_turbo_bf16.safetensors"))
    assert "Krea 2 Turbo" in turbo_warning(cfg)
    assert (
        turbo_warning(SimpleNamespace(model=SimpleNamespace(transformer="krea2_raw_bf16.safetensors"))) == ""
    )


def test_another_architecture_is_refused_by_name(fixture, tmp_path):
    """A Qwen-Image file given to krea2 is named as Qwen-Image; a Krea 2 file given to qwen_image names
    Krea 2; a Krea 2 text encoder file is not a transformer."""
    from tuner.archs.qwen_image.fixture import write_qwen_image_fixture

    qwen = write_qwen_image_fixture(tmp_path / "qwen")
    with pytest.raises(CheckpointError, match="not a Krea 2 transformer.*Qwen-Image"):
        krea2.load_transformer(qwen["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match="krea2"):
        qwen_image.load_transformer(fixture["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match="not a Qwen3-VL text encoder"):
        krea2_text.load_text_encoder(qwen["text_encoder_file"], fixture["tokenizer"], torch.float32)


# ---------------------------------------------------------------------------------------------------
# Against Krea2Pipeline
# ---------------------------------------------------------------------------------------------------


def test_prompts_encode_as_the_pipeline_does(pipe, parts):
    """Our true-length stacks are the pipeline's rows its mask keeps (fixed length 40 there)."""
    want, mask = pipe.encode_prompt(list(CAPTIONS), device="cpu", max_sequence_length=40)
    encoder = qwen3_vl.TextEncoder(parts["text_encoder"].language_model, parts["tokenizer"])
    got = krea2_text.encode_prompts(encoder, CAPTIONS, max_length=40)
    for g, w, m in zip(got, want, mask, strict=True):
        assert g.shape == (int(m.sum()), 2, 64)
        torch.testing.assert_close(g, w[m], rtol=1e-5, atol=1e-5)


def test_predict_matches_the_pipelines_transformer_call(pipe, parts):
    """Every transformer call of a guided 2-step run, redone by the trainer's `predict` from the same text
    stacks (padded: the pipeline's fixed length) and t."""
    calls = []
    hook = parts["transformer"].register_forward_hook(
        lambda m, a, kw, out: calls.append((kw, out[0])), with_kwargs=True
    )
    try:
        pipe(CAPTIONS[0], height=64, width=32, num_inference_steps=2, guidance_scale=3.0, output_type="latent",
             max_sequence_length=24, generator=torch.Generator().manual_seed(0))  # fmt: skip
    finally:
        hook.remove()
    assert len(calls) == 4
    for kw, out in calls:
        noisy = qwen_image.unpack_latents(kw["hidden_states"], 8, 4)
        cond = {"prompt_embeds": kw["encoder_hidden_states"], "prompt_mask": kw["encoder_attention_mask"]}
        got = _trainer().predict(parts["transformer"], noisy, kw["timestep"], cond)
        torch.testing.assert_close(qwen_image.pack_latents(got), out, rtol=0, atol=0)


def test_turbo_samples_with_the_pipelines_fixed_shift():
    """Krea2Pipeline's `is_distilled`: μ = 1.15 whatever the size; RAW's μ grows with the token count."""
    import math

    turbo = _trainer(transformer="models/krea2_turbo_bf16.safetensors")
    assert turbo.default_sample_shift((16, 1, 128, 128)) == pytest.approx(math.exp(1.15))
    assert _trainer().default_sample_shift((16, 1, 160, 160)) == pytest.approx(math.exp(1.15))  # 6400 tokens
    assert _trainer().default_sample_shift((16, 1, 32, 32)) == pytest.approx(math.exp(0.5))  # 256 tokens


# ---------------------------------------------------------------------------------------------------
# Adapter files
# ---------------------------------------------------------------------------------------------------


def _lora(model) -> LoRANetwork:
    record = architecture("krea2")
    network = LoRANetwork.apply_to(model, TargetSpec(record.default_targets), rank=4, alpha=4,
                                   name_map=record.checkpoint_layout())  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    return network


def test_default_targets_are_every_block_linear(parts):
    """All attention and MLP linears of the blocks and text-fusion blocks: 8 per block."""
    network = _lora(parts["transformer"])
    try:
        assert len(network.weights()) == 8 * (2 + 1 + 1)
    finally:
        network.remove()


def test_comfy_file_names_release_tensors_and_diffusers_loads_its_layout(fixture, pipe, parts, tmp_path):
    """The comfy file's stems (the default `comfy_folded`'s too, without `.alpha`) are `diffusion_model.` +
    release modules that exist in the release file; diffusers' Krea2Pipeline.load_lora_weights loads the
    diffusers-layout file to our output (it refuses the comfy file: its converter leaves the `alpha`
    tensors unread)."""
    assert architecture("krea2").save_format == "comfy_folded"
    model = parts["transformer"]
    layout = architecture("krea2").checkpoint_layout()
    release = set(load_tensors(fixture["transformer_file"]))
    embeds = krea2_text.encode_prompts(
        qwen3_vl.TextEncoder(parts["text_encoder"].language_model, parts["tokenizer"]), ["a cat"]
    )
    cond = _trainer().collate_text([{"prompt_embeds": embeds[0]}])
    noisy = torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(3))
    check_comfy_stems_and_diffusers_load(
        pipe, _lora(model), lambda: _trainer().predict(model, noisy, torch.tensor([0.4]), cond), release,
        layout, tmp_path,
    )  # fmt: skip
    with pytest.raises(ValueError, match="alpha"):
        pipe.load_lora_weights(str(tmp_path / "comfy.safetensors"))
    pipe.unload_lora_weights()


def test_full_fine_tune_samples_and_is_saved_in_the_release_layout(fixture, tmp_path):
    """One step of full fine-tuning draws its guided sample and writes the release's keys and shapes (the
    modulation flattened), which diffusers' own single-file loader reads, and tuner's loader reads back to
    the trained weights."""
    from project import cfg, make_project
    from tuner.cli import main
    from tuner.trainers import trainer_class

    config = make_project(tmp_path / "project", fixture["root"], architecture="krea2")
    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0
    overrides = ("network.type='full'", "train.max_steps=1", "train.lr_warmup_steps=0", "log.tensorboard=false",
                 "sample.prompts=['a cat']", "sample.every_n_steps=1", "sample.width=32", "sample.height=32",
                 "sample.steps=2", "sample.guidance=4.5")  # fmt: skip
    trainer = trainer_class("krea2")(cfg(config, f"save.output_dir='{tmp_path / 'out'}'", *overrides))
    trainer.train(log=lambda s: None)
    assert [p.suffix for p in (tmp_path / "out" / "samples").iterdir()] == [".png"]
    saved = tmp_path / "out" / "demo_lora.safetensors"
    shapes = {k: tuple(v.shape) for k, v in load_file(saved).items()}
    assert shapes == {k: tuple(v.shape) for k, v in load_tensors(fixture["transformer_file"]).items()}
    ours = krea2.load_transformer(saved, torch.float32)
    theirs = Krea2Transformer2DModel.from_single_file(
        str(saved), config=str(krea2.TRANSFORMER_VARIANTS[1].config_dir), torch_dtype=torch.float32,
        local_files_only=True,
    )  # fmt: skip
    assert_equal_weights(ours, theirs)
    assert not torch.equal(
        ours.img_in.weight, krea2.load_transformer(fixture["diffusers"], torch.float32).img_in.weight
    )
