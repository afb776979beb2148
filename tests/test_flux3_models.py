"""FLUX.3: the release's single file, a file in diffusers' names and the diffusers folder load to the same
weights (the release's as diffusers' own converter reads it); a step-distilled (flow-map) file and other
architectures' files are refused by name; prompts encode, the model is called and a guided generation steps
exactly as diffusers' modular FLUX.3 pipeline does (its prompt upsampler popped); adapter files name release
tensors and load in diffusers."""

from types import SimpleNamespace

import pytest
import torch
from diffusers.loaders.single_file_utils import convert_flux3_transformer_checkpoint_to_diffusers
from diffusers.modular_pipelines import Flux3AutoBlocks

from project import assert_equal_weights
from tuner.archs.flux3 import loaders as flux3
from tuner.archs.flux3 import text as flux3_text
from tuner.archs.flux3.fixture import build_flux3_components, write_flux3_fixture
from tuner.archs.flux3.trainer import Flux3Model
from tuner.config.schema import TimestepConfig
from tuner.diffusion.sampling import flow_sigmas
from tuner.errors import CheckpointError
from tuner.io import save_safetensors
from tuner.models import qwen3_vl
from tuner.models.loading import load_tensors
from tuner.networks.lora import LoRANetwork
from tuner.networks.targets import TargetSpec
from tuner.registry import architecture

CAPTION = "a red dog walking in the park"


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    return write_flux3_fixture(tmp_path_factory.mktemp("flux3"))


@pytest.fixture(scope="module")
def parts():
    return build_flux3_components()


class _Processor:
    """What the pipeline asks of its `AutoProcessor` for text: the chat template and the tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def apply_chat_template(self, *args, **kwargs):
        return self.tokenizer.apply_chat_template(*args, **kwargs)


@pytest.fixture(scope="module")
def pipe(parts):
    blocks = Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")  # a caption expander tuner does not run: prompts as given
    pipe = blocks.init_pipeline()
    pipe.update_components(**{**parts, "tokenizer": _Processor(parts["tokenizer"])})
    return pipe


def _trainer() -> Flux3Model:
    trainer = Flux3Model.__new__(Flux3Model)
    trainer.record = architecture("flux3")
    trainer._objective = None  # built on first use, as __init__ leaves it
    trainer.cfg = SimpleNamespace(
        cache=SimpleNamespace(text_max_length=8192),
        model=SimpleNamespace(transformer="flux3.safetensors"),
        timesteps=TimestepConfig(),
    )
    return trainer


def _encoder(parts):
    return qwen3_vl.TextEncoder(parts["text_encoder"].language_model, parts["tokenizer"])


def test_layouts_load_to_the_same_weights_as_diffusers_converter(fixture, parts, tmp_path):
    folder = flux3.load_transformer(fixture["diffusers"], torch.float32)
    single = flux3.load_transformer(fixture["transformer_file"], torch.float32)
    assert_equal_weights(single, folder)
    release = load_tensors(fixture["transformer_file"])
    assert (
        "content_mode_blocks.image.0.q_proj.weight" in release and "single_blocks.1.mlp_in.weight" in release
    )
    converted = convert_flux3_transformer_checkpoint_to_diffusers(dict(release))
    ours = single.state_dict()
    assert converted.keys() == ours.keys() and all(torch.equal(converted[k], ours[k]) for k in ours)
    prefixed = tmp_path / "flux3_prefixed.safetensors"
    save_safetensors({f"model.diffusion_model.{k}": v for k, v in release.items()}, prefixed)
    assert_equal_weights(flux3.load_transformer(prefixed, torch.float32), folder)
    named = tmp_path / "diffusion_pytorch_model.safetensors"
    save_safetensors(dict(parts["transformer"].state_dict()), named)
    assert_equal_weights(flux3.load_transformer(named, torch.float32), folder)
    encoders = [flux3_text.load_text_encoder(fixture["text_encoder_file"], fixture["tokenizer"], torch.float32),
                flux3_text.load_text_encoder(fixture["diffusers"], None, torch.float32)]  # fmt: skip
    assert_equal_weights(encoders[0].model, encoders[1].model)


def test_flow_map_and_other_files_are_refused_by_name(fixture, tmp_path):
    release = load_tensors(fixture["transformer_file"])
    width = release["time_in.in_layer.weight"]
    distilled = tmp_path / "flux3_klein.safetensors"
    save_safetensors({**release, "ref_time_in.in_layer.weight": width.clone()}, distilled)
    with pytest.raises(CheckpointError, match="step-distilled"):
        flux3.load_transformer(distilled, torch.float32)
    with pytest.raises(CheckpointError):
        flux3.load_transformer(fixture["text_encoder_file"], torch.float32)
    with pytest.raises(CheckpointError):
        flux3.load_transformer(fixture["vae_file"], torch.float32)


def test_prompts_encode_as_the_pipeline_does(pipe, parts):
    """Our rows are the pipeline's `prompt_embeds` (the 80-token window, every row), bit for bit."""
    for caption in (CAPTION, "", " ".join([CAPTION] * 30)):
        got = flux3_text.encode_prompts(_encoder(parts), [caption])[0]
        want = pipe.blocks.sub_blocks["text_encoder"]._get_qwen3_vl_prompt_embeds(
            parts["text_encoder"], pipe.tokenizer, caption, device="cpu"
        )[0]
        assert got.shape[0] % flux3_text.PAD_MULTIPLE == 0 and got.shape[1] == 8 * 16
        assert torch.equal(got, want)


def test_batches_of_different_windows_repeat_the_padding_row(parts):
    """A shorter window is brought to the longest by its last (padding) row, which the encoder's own longer
    window would hold too: the padding rows all encode alike."""
    short, long = flux3_text.encode_prompts(_encoder(parts), ["a cat", " ".join([CAPTION] * 30)])
    assert short.shape[0] < long.shape[0]
    torch.testing.assert_close(short[-1], short[-2], rtol=0, atol=0)
    batch = _trainer().collate_text([{"prompt_embeds": short}, {"prompt_embeds": long}])["prompt_embeds"]
    assert batch.shape == (2, *long.shape) and torch.equal(batch[0, -1], short[-1])


@torch.no_grad()
def test_guided_generation_matches_the_pipeline(pipe, parts):
    """What `tuner generate` computes (our encoding, `sample_flow`'s Euler steps and CFG, the record's shift
    6.93 on linear sigmas) gives the pipeline's latents for the same noise, steps and guidance."""
    trainer = _trainer()
    encoder = _encoder(parts)
    cond, uncond = (trainer.collate_text(trainer.encode_text(encoder, [p])) for p in (CAPTION, ""))
    x = torch.randn(1, 128, 4, 2, generator=torch.Generator().manual_seed(0))  # a 64x32 image
    out = pipe(prompt=CAPTION, height=64, width=32, num_inference_steps=3, latents=x, output="latents")
    sigmas = flow_sigmas(3, trainer.default_sample_shift(x.shape[1:]))
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas, rtol=1e-6, atol=1e-6)

    def model_fn(x, t, c):  # as `tuner generate` calls the family
        return trainer.predict(parts["transformer"], x, t / 1000, c)

    x = trainer.sample_flow(model_fn, x, sigmas, cond, uncond, trainer.record.sampling.guidance)
    torch.testing.assert_close(x, out, rtol=1e-4, atol=1e-4)


def test_default_adapter_file_names_release_tensors_and_diffusers_loads_it(fixture, pipe, parts, tmp_path):
    """The record's layout (`comfy_folded`: `diffusion_model.` + release modules, alpha folded) names tensors
    of the release file, and diffusers' Flux3LoraLoaderMixin (the pipeline's `load_lora_weights`) gives the
    model our network's output."""
    model = parts["transformer"]
    record = architecture("flux3")
    network = LoRANetwork.apply_to(model, TargetSpec(record.default_targets), rank=4, alpha=2,
                                   name_map=record.checkpoint_layout())  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    # 6 linears in each of the image, reference, text per-mode blocks (1 each) and the 2 joint blocks
    assert len(network.weights()) == 6 * 5
    cond = _trainer().collate_text(_trainer().encode_text(_encoder(parts), ["a cat"]))
    noisy = torch.randn(1, 128, 2, 2, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = _trainer().predict(model, noisy, torch.tensor([0.4]), cond)
    path = tmp_path / "flux3_lora.safetensors"
    network.save(path, record.checkpoint_layout(), format=record.save_format)
    network.remove()
    release = set(load_tensors(fixture["transformer_file"]))
    stems = {k.rsplit(".", 2)[0] for k in load_tensors(path)}
    assert stems and all(
        s.startswith("diffusion_model.") and f"{s.removeprefix('diffusion_model.')}.weight" in release
        for s in stems
    )
    pipe.load_lora_weights(str(path))
    try:
        with torch.no_grad():
            got = _trainer().predict(model, noisy, torch.tensor([0.4]), cond)
    finally:
        pipe.unload_lora_weights()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_reference_images_are_called_as_the_pipeline_calls_them(parts):
    """Control images are the model's `image_cond` tokens with the pipeline's ids (the H/W scale 0.5, the
    `l` axis -1, -2, ...; `_prepare_image_ids` of its before-denoise steps), the text with its `txt_ids`."""
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids

    gen = torch.Generator().manual_seed(5)
    noisy, refs = (
        torch.randn(1, 128, 2, 3, generator=gen),
        [torch.randn(1, 128, *s, generator=gen) for s in ((2, 2), (1, 3))],
    )
    embeds = flux3_text.encode_prompts(_encoder(parts), ["a cat"])[0][None]
    t = torch.tensor([0.7])
    want = parts["transformer"](
        hidden_states=noisy.flatten(2).transpose(1, 2),
        encoder_hidden_states=embeds,
        timestep=t,
        img_ids=_prepare_image_ids(2, 3, 0.5),
        txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(embeds),
        image_cond_hidden_states=torch.cat([r.flatten(2).transpose(1, 2) for r in refs], dim=1),
        image_cond_ids=torch.cat(
            [_prepare_image_ids(*r.shape[-2:], 0.5, l_coord=-(1 + i)) for i, r in enumerate(refs)]
        ),
        return_dict=False,
    )[0]
    cond = {"prompt_embeds": embeds, "control_0": refs[0], "control_1": refs[1]}
    got = _trainer().predict(parts["transformer"], noisy, t, cond)
    assert torch.equal(got, want.transpose(1, 2).reshape(1, 128, 2, 3))
    assert not torch.equal(got, _trainer().predict(parts["transformer"], noisy, t, {"prompt_embeds": embeds}))


@pytest.mark.slow
def test_reference_images_cache_train_and_generate(fixture, tmp_path, capsys):
    """Two reference images per item: cached as control latents, given to the model as its `image_cond`
    tokens in training, and to `generate --control` twice."""
    from project import check_reference_images_cli

    check_reference_images_cli(capsys, tmp_path, fixture["root"], "flux3")
