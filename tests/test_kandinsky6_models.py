"""Kandinsky 6 text-to-video with sound: loading (every layout, wrong files named), prompts, both streams
and generation equal to diffusers' Kandinsky6TI2VAPipeline on the tiny fixture, the two-stream loss, the
mp4 with sound, and the adapter file diffusers' transformer reads."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

import pytest
import torch
from safetensors.torch import load_file

from project import NoAccelerator, assert_equal_weights, cfg, make_project
from tuner.archs.kandinsky5 import loaders as kandinsky5
from tuner.archs.kandinsky6 import loaders as k6
from tuner.archs.kandinsky6.fixture import build_kandinsky6_components, write_kandinsky6_fixture
from tuner.archs.kandinsky6.trainer import Kandinsky6Model
from tuner.errors import CheckpointError
from tuner.registry import ARCHITECTURES

CAPTIONS = ["a red circle moving left", "a dog barks twice on the beach"]


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return write_kandinsky6_fixture(tmp_path_factory.mktemp("kandinsky6"), seed=0)


@pytest.fixture(scope="module")
def transformer(fx):
    return k6.load_transformer(fx["transformer_file"], torch.float32)


def _pipe():
    from diffusers import Kandinsky6TI2VAPipeline

    return Kandinsky6TI2VAPipeline(**build_kandinsky6_components(seed=0))


def _encoders(fx) -> kandinsky5.TextEncoders:
    return kandinsky5.load_text_encoders(
        fx["text_encoder_file"], fx["text_encoder_2_file"], fx["tokenizer"], fx["tokenizer_2"], torch.float32
    )


def _text(gen: torch.Generator) -> dict:
    return kandinsky5.collate(
        [{"text": torch.randn(3, 64, generator=gen), "pooled": torch.randn(32, generator=gen)}]
    )


def _family(fx, tmp_path) -> Kandinsky6Model:
    return ARCHITECTURES["kandinsky6"].family_model(
        cfg(make_project(tmp_path, fx["root"], architecture="kandinsky6"))
    )


# ---- loading ----------------------------------------------------------------------------------------


def test_every_layout_loads_identical_weights(fx, transformer, tmp_path):
    from safetensors.torch import save_file

    # the fixture's single file is in the release's names; diffusers' names and ComfyUI's prefix load too
    assert "visual_blocks.1.audioT.feed_forward.in_layer.weight" in load_file(fx["transformer_file"])
    diffusers_named = {f"model.diffusion_model.{k}": v for k, v in transformer.state_dict().items()}
    save_file(diffusers_named, tmp_path / "k6_diffusers_named.safetensors")
    assert_equal_weights(
        transformer, k6.load_transformer(tmp_path / "k6_diffusers_named.safetensors", torch.float32)
    )
    assert_equal_weights(transformer, k6.load_transformer(fx["diffusers"], torch.float32))
    assert_equal_weights(transformer, k6.load_transformer(fx["diffusers"] / "transformer", torch.float32))
    # the audio VAE and vocoder beside the VAE: pipeline root, its vae/ folder, or a VAE file's folder
    for load in (k6.load_audio_vae, k6.load_vocoder):
        want = load(fx["diffusers"], torch.float32)
        assert_equal_weights(want, load(fx["diffusers"] / "vae", torch.float32))
        assert_equal_weights(want, load(fx["vae_file"], torch.float32))


def test_wrong_files_are_named(fx, tmp_path):
    from tuner.archs.kandinsky5.fixture import write_kandinsky5_fixture

    k5 = write_kandinsky5_fixture(tmp_path / "k5")
    with pytest.raises(CheckpointError, match="kandinsky5lite_t2v_sft_5s_tiny"):
        k6.load_transformer(k5["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match=r"audio_vae/"):
        k6.load_audio_vae(k5["vae_file"], torch.float32)


def test_key_table_names_every_linear_layer_and_reads_its_kohya_stems_back(transformer):
    """Every linear layer has a release name (the ComfyUI names the fixture's single file holds) whose
    kohya stem reads back to it."""
    from tuner.archs.kandinsky6.keys import KANDINSKY6_KEYS

    linears = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    for name in linears:
        original = KANDINSKY6_KEYS(name)
        assert KANDINSKY6_KEYS.to_diffusers(original) == name
        assert KANDINSKY6_KEYS.from_kohya(original.replace(".", "_")) == name
    assert KANDINSKY6_KEYS("visual_transformer_blocks.1.audio_dec_block.feed_forward.net.2") == (
        "visual_blocks.1.audioT.feed_forward.out_layer"
    )


def test_record_matches_the_pipeline():
    from diffusers import Kandinsky6TI2VAPipeline
    from diffusers.pipelines.kandinsky6 import pipeline_kandinsky6_ti2va as upstream

    assert k6.PROMPT_TEMPLATE == upstream._PROMPT_TEMPLATE
    assert k6.CROP_START == upstream._QWEN_CROP_START
    assert (
        ARCHITECTURES["kandinsky6"].sampling.negative_prompt
        == Kandinsky6TI2VAPipeline._DEFAULT_NEGATIVE_PROMPT
    )


# ---- against the pipeline ---------------------------------------------------------------------------


def test_prompt_encoding_matches_the_pipeline(fx):
    """The template's prefix is 129 tokens; each caption's rows are the pipeline's unpadded rows."""
    pipe = _pipe()
    encoders = _encoders(fx)
    prefix = k6.PROMPT_TEMPLATE.split("{}")[0]
    assert len(encoders.qwen.tokenizer(text=prefix).input_ids) == k6.CROP_START
    ours = k6.encode_prompts(encoders, CAPTIONS, max_length=32)
    text, pooled, mask = pipe._get_prompt_embeds(
        CAPTIONS, pipe.tokenizer, pipe.text_encoder, pipe.tokenizer_2, pipe.text_encoder_2, 32, "cpu"
    )
    for i, entry in enumerate(ours):
        n = int(mask[i].sum())
        assert entry["text"].shape[0] == n > 0 and mask[i, :n].all()
        torch.testing.assert_close(entry["text"], text[i, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entry["pooled"], pooled[i], rtol=0, atol=0)


def _latent_sampling(pipe, fx, tmp_path, guidance: float):
    """tuner's generation and the pipeline's from the same noise and prompts: both streams' final latents. The
    pipeline is given tuner's evenly spaced levels (without `sigmas` it spaces its steps from 1 down to the
    scheduler's σ_min, not to 1/N: another schedule, not another model), shifted by its scheduler's shift."""
    import numpy as np

    from tuner.diffusion.sampling import flow_sigmas
    from tuner.generate import GenerateOptions, sample_latents

    family = _family(fx, tmp_path)
    encoders = _encoders(fx)
    cond = kandinsky5.collate(k6.encode_prompts(encoders, [CAPTIONS[1]], 64))
    uncond = kandinsky5.collate(k6.encode_prompts(encoders, [family.record.sampling.negative_prompt], 64))
    opts = GenerateOptions(prompt="-", out="-", width=64, height=64, frames=9, steps=3, guidance_scale=guidance,
                           device="cpu")  # fmt: skip
    with torch.no_grad():
        video, sound = sample_latents(family, pipe.transformer, opts, cond, uncond, torch.device("cpu"),
                                      torch.float32, progress=False)  # fmt: skip
        gen = torch.Generator().manual_seed(opts.seed)  # tuner's noise: the video's, then the sound's
        noise = torch.randn((1, *family.latent_shape(64, 64, 9)), generator=gen)
        sound_noise = torch.randn((1, *family.sound_stream().latent_shape(9)), generator=gen)
        theirs = pipe(prompt=CAPTIONS[1], height=64, width=64, num_frames=9, num_inference_steps=3,
                      guidance_scale=guidance, latents=noise, audio_latents=sound_noise, output_type="latent",
                      max_sequence_length=64, sigmas=np.linspace(1.0, 1 / 3, 3))  # fmt: skip
    torch.testing.assert_close(pipe.scheduler.sigmas, flow_sigmas(3, family.record.sampling.shift))
    return (video, sound), (theirs.frames, theirs.audio)


@pytest.mark.parametrize("guidance", [1.0, 5.0])
def test_generation_equals_the_pipeline(fx, tmp_path, guidance):
    """Both streams down the same schedule (flow shift 10, Euler), with and without CFG and the pipeline's
    negative prompt, land on the pipeline's latents (its padded, masked prompt rows against tuner's
    true-length rows: equal to float rounding)."""
    (video, sound), (want_video, want_sound) = _latent_sampling(_pipe(), fx, tmp_path, guidance)
    assert sound.shape == want_sound.shape == (1, 40, k6.audio_latent_length(9, 24.0))
    # float rounding of the masked padding, times the guidance scale
    tolerance = 1e-4 * guidance
    torch.testing.assert_close(video, want_video, rtol=1e-4, atol=tolerance)
    torch.testing.assert_close(sound, want_sound, rtol=1e-4, atol=tolerance)


def test_loss_sums_both_streams_and_a_silent_clip_trains_video_alone(transformer):
    """Both streams noised at the same t (the model has one timestep), their flow losses summed; a clip
    without sound: the video path alone (the pipeline's `sample_audio=False`)."""
    from tuner.diffusion.timesteps import FlowObjective, flow_loss, flow_target

    family = Kandinsky6Model.__new__(Kandinsky6Model)
    family.record = ARCHITECTURES["kandinsky6"]
    family._objective = FlowObjective()
    family.cfg = type("Cfg", (), {"model": type("M", (), {"dtype": "fp32"})})()
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(1, 16, 2, 4, 4, generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    audio, audio_noise = torch.randn(2, 1, 40, 7, generator=gen)
    text = _text(gen)
    t = torch.tensor([0.4])
    with torch.no_grad():
        both = family.loss(transformer, x0, noise, t, {**text, "audio_latents": audio, "audio_noise": audio_noise},
                           NoAccelerator())  # fmt: skip
        silent = family.loss(transformer, x0, noise, t, dict(text), NoAccelerator())
        noisy, noisy_audio = (1 - t) * x0 + t * noise, (1 - t) * audio + t * audio_noise
        v, a = k6.predict_velocities(transformer, noisy, t, noisy_audio, text)
        v_alone, none = k6.predict_velocities(transformer, noisy, t, None, text)
    assert none is None and not torch.allclose(v, v_alone)  # the sound reaches the video
    want = flow_loss(v, flow_target(x0, noise), t, "none") + flow_loss(
        a, flow_target(audio, audio_noise), t, "none"
    )
    torch.testing.assert_close(both, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        silent, flow_loss(v_alone, flow_target(x0, noise), t, "none"), rtol=1e-6, atol=1e-6
    )


def test_generate_writes_an_mp4_with_sound_of_the_clips_length(fx, tmp_path):
    import av

    from tuner.data.audio import read_audio
    from tuner.generate import GenerateOptions, generate

    config = make_project(tmp_path, fx["root"], architecture="kandinsky6")
    opts = GenerateOptions(prompt="a red circle", out=str(tmp_path / "clip.mp4"), width=64, height=64, frames=9,
                           steps=2, device="cpu")  # fmt: skip
    out = generate(cfg(config), opts, log=lambda s: None)
    with av.open(str(out)) as container:
        assert container.streams.video[0].frames == 9
        assert container.streams.audio[0].rate == 44100
    sound = read_audio(out, 44100, 1)
    assert torch.isfinite(sound).all() and sound.abs().max() > 0
    assert abs(sound.shape[1] / 44100 - 9 / 24) < 0.05


def test_saved_lora_is_what_diffusers_transformer_loads(fx, transformer, tmp_path):
    """`save.format = "diffusers"` (`transformer.` + diffusers' names, alpha folded in) loads with
    `Kandinsky6Transformer3DModel.load_lora_adapter` to the same output."""
    pytest.importorskip("peft")
    from tuner.networks.lora import LoRANetwork
    from tuner.networks.targets import TargetSpec

    record = ARCHITECTURES["kandinsky6"]
    model = k6.load_transformer(fx["diffusers"], torch.float32)
    network = LoRANetwork.apply_to(model, TargetSpec(record.default_targets), rank=4, alpha=2,
                                   name_map=record.key_table())  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    network.save(tmp_path / "lora.safetensors", format="diffusers")
    saved = load_file(tmp_path / "lora.safetensors")
    assert "transformer.visual_transformer_blocks.1.av_cross_attention.to_key.lora_A.weight" in saved
    text = _text(gen)
    noisy, sound = torch.randn(1, 16, 2, 4, 4, generator=gen), torch.randn(1, 40, 5, generator=gen)
    t = torch.tensor([0.6])
    upstream = k6.load_transformer(fx["diffusers"], torch.float32)
    upstream.load_lora_adapter(str(tmp_path / "lora.safetensors"), prefix="transformer", adapter_name="tuner")
    with torch.no_grad():
        ours = k6.predict_velocities(model, noisy, t, sound, text)
        theirs = k6.predict_velocities(upstream, noisy, t, sound, text)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
