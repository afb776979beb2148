"""AuraFlow: the release's single file (bare, under ComfyUI's `model.` prefix, fp8), its diffusers-named form
and the diffusers folder load to the weights diffusers' own single-file loader gives; other architectures'
files are refused by name; prompts encode, the model is called and a guided generation steps exactly as
diffusers' AuraFlowPipeline does; adapter files name release tensors and load in diffusers; a full
fine-tune is saved in the release layout."""

from types import SimpleNamespace

import pytest
import torch
from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel
from safetensors.torch import load_file

from project import assert_equal_weights, check_comfy_stems_and_diffusers_load
from tuner.archs.aura_flow import loaders as aura_flow
from tuner.archs.aura_flow.fixture import build_aura_flow_components, write_aura_flow_fixture
from tuner.archs.aura_flow.trainer import AuraFlowModel
from tuner.archs.sdxl import loaders as sdxl
from tuner.errors import CheckpointError
from tuner.io import save_safetensors
from tuner.models.loading import load_tensors
from tuner.networks.lora import LoRANetwork
from tuner.networks.targets import TargetSpec
from tuner.registry import architecture

CAPTIONS = ["a red dog walking in the park", "a cat"]
TINY_CONFIG = str(aura_flow.TRANSFORMER_VARIANTS[2].config_dir)


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    return write_aura_flow_fixture(tmp_path_factory.mktemp("aura_flow"))


@pytest.fixture(scope="module")
def parts():
    return build_aura_flow_components()


@pytest.fixture(scope="module")
def pipe(parts):
    return AuraFlowPipeline(**parts)


def _trainer(text_length: int = 24) -> AuraFlowModel:
    """The family's model for a config naming only the cache's text length."""
    trainer = AuraFlowModel.__new__(AuraFlowModel)
    trainer.record = architecture("aura_flow")
    trainer.cfg = SimpleNamespace(
        cache=SimpleNamespace(text_max_length=text_length), model=SimpleNamespace(transformer="aura_flow.st")
    )
    return trainer


def _encoder(parts) -> aura_flow.TextEncoder:
    return aura_flow.TextEncoder(parts["text_encoder"], parts["tokenizer"])


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def test_layouts_load_bit_identical_to_diffusers_single_file_loader(fixture):
    folder = aura_flow.load_transformer(fixture["diffusers"], torch.float32)
    assert_equal_weights(aura_flow.load_transformer(fixture["transformer_file"], torch.float32), folder)
    theirs = AuraFlowTransformer2DModel.from_single_file(
        str(fixture["transformer_file"]), config=TINY_CONFIG, torch_dtype=torch.float32, local_files_only=True
    )
    assert_equal_weights(theirs, folder)
    assert_equal_weights(
        sdxl.load_vae(fixture["vae_file"], torch.float32), sdxl.load_vae(fixture["diffusers"], torch.float32)
    )
    single = aura_flow.load_text_encoder(fixture["text_encoder_file"], fixture["tokenizer"], torch.float32)
    assert_equal_weights(
        single.model, aura_flow.load_text_encoder(fixture["diffusers"], None, torch.float32).model
    )


def test_release_keys_are_the_release_layout(fixture):
    keys = load_tensors(fixture["transformer_file"])
    for key in ("double_layers.0.attn.w1q.weight", "double_layers.0.attn.w2o.weight",
                "double_layers.0.mlpC.c_fc1.weight", "double_layers.0.modX.1.weight", "single_layers.1.modCX.1.weight",
                "single_layers.0.mlp.c_proj.weight", "modF.1.weight", "positional_encoding", "register_tokens",
                "init_x_linear.bias", "t_embedder.mlp.2.weight", "cond_seq_linear.weight", "final_linear.weight"):  # fmt: skip
        assert key in keys, key
    assert not any("transformer_blocks" in k or "to_q" in k for k in keys)


def test_bundled_fp8_and_diffusers_named_files_load(fixture, tmp_path):
    """ComfyUI's checkpoint (the transformer under `model.`, its VAE and text encoder beside it, skipped) with
    a scaled fp8 weight (dequantized), and a single file in diffusers' names, load."""
    want = aura_flow.load_transformer(fixture["diffusers"], torch.float32)
    release = load_tensors(fixture["transformer_file"])
    bundle = {f"model.{k}": v for k, v in release.items()}
    key = "double_layers.0.attn.w2q.weight"
    bundle[f"model.{key}"] = (release[key] / 0.5).to(torch.float8_e4m3fn)
    bundle[f"model.{key}_scale"] = torch.tensor(0.5)
    bundle |= {f"vae.{k}": v for k, v in load_tensors(fixture["vae_file"]).items()}
    bundle |= {
        f"text_encoders.pile_t5xl.transformer.{k}": v
        for k, v in load_tensors(fixture["text_encoder_file"]).items()
    }
    path = tmp_path / "aura_flow_0.3.safetensors"
    save_safetensors(bundle, path)
    got = aura_flow.load_transformer(path, torch.float32)
    rounded = (release[key] / 0.5).to(torch.float8_e4m3fn).float() * 0.5
    assert torch.equal(got.joint_transformer_blocks[0].attn.to_q.weight, rounded)
    assert torch.equal(
        got.single_transformer_blocks[1].ff.linear_1.weight,
        want.single_transformer_blocks[1].ff.linear_1.weight,
    )
    as_diffusers = tmp_path / "aura_flow_diffusers.safetensors"
    save_safetensors(want.state_dict(), as_diffusers)
    assert_equal_weights(aura_flow.load_transformer(as_diffusers, torch.float32), want)


def test_real_variants_are_told_apart_by_the_position_table(monkeypatch):
    from tuner.archs.aura_flow.keys import AURA_FLOW_LAYOUT
    from tuner.models import identify

    for name in ("v0.1", "v0.3"):
        config = aura_flow.CONFIGS / "transformer" / name
        with torch.device("meta"):
            model = AuraFlowTransformer2DModel.from_config(AuraFlowTransformer2DModel.load_config(config))
        header = {k: tuple(v.shape) for k, v in AURA_FLOW_LAYOUT.to_original(model.state_dict()).items()}
        monkeypatch.setattr(identify, "read_shapes_of", lambda files, header=header: header)
        assert identify.identify_single_file("aura_flow.safetensors", aura_flow.TRANSFORMER_SPEC).name == name


def test_another_architecture_is_refused_by_name(fixture, tmp_path):
    """An SD3 file given to aura_flow is named as SD3; an AuraFlow file given to sd3 names AuraFlow."""
    from tuner.archs.sd3 import loaders as sd3
    from tuner.archs.sd3.fixture import write_sd3_fixture

    other = write_sd3_fixture(tmp_path / "sd3")
    with pytest.raises(CheckpointError, match="AuraFlow transformer.*Stable Diffusion 3"):
        aura_flow.load_transformer(other["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match="aura_flow"):
        sd3.load_transformer(fixture["transformer_file"], torch.float32)


# ---------------------------------------------------------------------------------------------------
# Against AuraFlowPipeline
# ---------------------------------------------------------------------------------------------------


def test_prompts_encode_as_the_pipeline_does(pipe, parts):
    want, _, _, _ = pipe.encode_prompt(list(CAPTIONS), do_classifier_free_guidance=False, device="cpu",
                                       max_sequence_length=24)  # fmt: skip
    got = aura_flow.encode_prompts(_encoder(parts), CAPTIONS, max_length=24)
    torch.testing.assert_close(torch.stack(got), want, rtol=1e-5, atol=1e-5)


def test_predict_matches_the_pipelines_transformer_call(pipe, parts):
    calls = []
    hook = parts["transformer"].register_forward_hook(
        lambda m, a, kw, out: calls.append((a, kw, out[0])), with_kwargs=True
    )
    try:
        pipe(CAPTIONS[0], height=64, width=32, num_inference_steps=2, guidance_scale=3.5, output_type="latent",
             max_sequence_length=24, generator=torch.Generator().manual_seed(0))  # fmt: skip
    finally:
        hook.remove()
    assert len(calls) == 2
    for args, kw, out in calls:
        got = _trainer().predict(
            parts["transformer"], args[0], kw["timestep"], {"prompt_embeds": kw["encoder_hidden_states"]}
        )
        torch.testing.assert_close(got, out, rtol=0, atol=0)


def _lora(model) -> LoRANetwork:
    record = architecture("aura_flow")
    network = LoRANetwork.apply_to(model, TargetSpec(record.default_targets), rank=4, alpha=4,
                                   name_map=record.checkpoint_layout())  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    return network


def test_default_targets_are_every_block_linear(parts):
    """Joint blocks: 8 attention + 6 MLP linears; single blocks: 4 + 3."""
    network = _lora(parts["transformer"])
    try:
        assert len(network.weights()) == 14 * 1 + 7 * 2
    finally:
        network.remove()


def test_comfy_file_names_release_tensors_and_diffusers_loads_its_layout(fixture, pipe, parts, tmp_path):
    """The comfy file's stems are `diffusion_model.` + release modules that exist in the release file;
    AuraFlowPipeline.load_lora_weights loads the diffusers-layout file (the default) to our output."""
    assert architecture("aura_flow").save_format == "diffusers"
    model = parts["transformer"]
    layout = architecture("aura_flow").checkpoint_layout()
    release = set(load_tensors(fixture["transformer_file"]))
    cond = {"prompt_embeds": torch.stack(aura_flow.encode_prompts(_encoder(parts), ["a cat"], 24))}
    noisy = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(3))
    check_comfy_stems_and_diffusers_load(
        pipe, _lora(model), lambda: _trainer().predict(model, noisy, torch.tensor([0.4]), cond), release,
        layout, tmp_path,
    )  # fmt: skip


def test_full_fine_tune_samples_and_is_saved_in_the_release_layout(fixture, tmp_path):
    """One step of full fine-tuning draws its guided sample and writes the release's keys and shapes, which
    diffusers' own single-file loader reads, and tuner's loader reads back to the trained weights."""
    from project import cfg, make_project
    from tuner.cli import main
    from tuner.trainers import trainer_class

    config = make_project(tmp_path / "project", fixture["root"], architecture="aura_flow")
    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0
    overrides = ("network.type='full'", "train.max_steps=1", "train.lr_warmup_steps=0", "log.tensorboard=false",
                 "sample.prompts=['a cat']", "sample.every_n_steps=1", "sample.width=32", "sample.height=32",
                 "sample.steps=2", "sample.guidance=3.5")  # fmt: skip
    trainer = trainer_class("aura_flow")(cfg(config, f"save.output_dir='{tmp_path / 'out'}'", *overrides))
    trainer.train(log=lambda s: None)
    assert [p.suffix for p in (tmp_path / "out" / "samples").iterdir()] == [".png"]
    saved = tmp_path / "out" / "demo_lora.safetensors"
    shapes = {k: tuple(v.shape) for k, v in load_file(saved).items()}
    assert shapes == {k: tuple(v.shape) for k, v in load_tensors(fixture["transformer_file"]).items()}
    ours = aura_flow.load_transformer(saved, torch.float32)
    theirs = AuraFlowTransformer2DModel.from_single_file(
        str(saved), config=TINY_CONFIG, torch_dtype=torch.float32, local_files_only=True
    )
    assert_equal_weights(ours, theirs)
    before = aura_flow.load_transformer(fixture["diffusers"], torch.float32)
    assert not torch.equal(ours.context_embedder.weight, before.context_embedder.weight)
