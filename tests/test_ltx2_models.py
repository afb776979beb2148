"""LTX-2: loading (both layouts), model inputs equal to diffusers' LTX2Pipeline, both streams in the loss."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

import pytest
import torch
from diffusers import LTX2Pipeline
from safetensors.torch import load_file, save_file

from project import NoAccelerator
from tuner.archs.ltx2 import loaders as ltx2
from tuner.archs.ltx2.fixture import write_ltx2_fixture
from tuner.archs.ltx2.keys import BWE_VOCODER_LAYOUT, CONNECTORS_LAYOUT, LTX2_LAYOUT
from tuner.archs.ltx2.trainer import LTX2Model
from tuner.errors import CheckpointError
from tuner.registry import ARCHITECTURES

CAPTIONS = ["a red circle moving left", "a small dog walks on the beach at sunset"]
MAX_LENGTH = 16


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return write_ltx2_fixture(tmp_path_factory.mktemp("ltx2"), seed=0)


@pytest.fixture(scope="module")
def pipe(fx):
    pipe = LTX2Pipeline.from_pretrained(fx["diffusers"])
    for name in ("transformer", "vae", "audio_vae", "vocoder", "connectors", "text_encoder"):
        getattr(pipe, name).eval()
    return pipe


def _bare_trainer() -> LTX2Model:
    """The trainer's model-input code, without a config (what these tests call needs none)."""
    return LTX2Model(None)


@pytest.mark.parametrize("file", ["checkpoint_file", "transformer_file"])
def test_single_file_and_diffusers_folder_load_identical_weights(fx, file):
    single = ltx2.load_transformer(fx[file], torch.float32)
    folder = ltx2.load_transformer(fx["diffusers"], torch.float32)
    a, b = single.state_dict(), folder.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    keys = load_file(fx["transformer_file"])
    assert "model.diffusion_model.patchify_proj.weight" in keys
    assert "model.diffusion_model.transformer_blocks.0.attn1.q_norm.weight" in keys
    assert "model.diffusion_model.av_ca_a2v_gate_adaln_single.linear.weight" in keys


@pytest.mark.parametrize(
    "load",
    [ltx2.load_vae, ltx2.load_audio_vae, ltx2.load_connectors, ltx2.load_vocoder],
    ids=["video", "audio", "connectors", "vocoder"],
)
def test_components_of_the_release_file_equal_the_diffusers_folders(fx, load):
    single, folder = load(fx["checkpoint_file"], torch.float32), load(fx["diffusers"], torch.float32)
    a, b = single.state_dict(), folder.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    keys = load_file(fx["checkpoint_file"])
    # the release's names: one sequence of stages and resamplers, `res_blocks`, per-channel statistics
    assert "vae.encoder.down_blocks.8.res_blocks.0.conv1.conv.weight" in keys
    assert "vae.decoder.up_blocks.1.conv.conv.weight" in keys
    assert "audio_vae.per_channel_statistics.mean-of-means" in keys
    # the connectors: the projection at the top level, the connector transformers beside the transformer
    assert "text_embedding_projection.aggregate_embed.weight" in keys
    assert (
        "model.diffusion_model.video_embeddings_connector.transformer_1d_blocks.0.attn1.q_norm.weight" in keys
    )
    assert (
        "vocoder.conv_pre.weight" in keys
        and "vocoder.ups.0.weight" in keys
        and "vocoder.resblocks.0.convs1.0.weight" in keys
    )


def test_a_file_without_vaes_is_named(fx):
    only = fx["transformer_file"]
    with pytest.raises(CheckpointError, match=r"holds no LTX-2 video VAE \(no `vae\.\*` keys"):
        ltx2.load_vae(only, torch.float32)


def test_release_file_bundling_connectors_loads_and_another_architecture_is_named(fx, tmp_path):
    tensors = load_file(fx["transformer_file"])
    bundled = tmp_path / "ltx-2-bundle.safetensors"
    extra = {"model.diffusion_model.video_embeddings_connector.x.weight": torch.zeros(2)}
    save_file({**tensors, **extra, "vae.per_channel_statistics.mean-of-means": torch.zeros(2)}, bundled)
    model = ltx2.load_transformer(bundled, torch.float32)
    assert model.config.num_layers == 2
    from tuner.archs.wan.fixture import write_wan_fixture

    wan = write_wan_fixture(tmp_path / "wan")
    with pytest.raises(CheckpointError, match="not a LTX-2 transformer.*Wan 2.1 transformer"):
        ltx2.load_transformer(wan["transformer_file"], torch.float32)
    from tuner.archs.wan import loaders as wan

    with pytest.raises(CheckpointError, match="LTX-2 transformer"):
        wan.load_transformer(fx["transformer_file"], torch.float32)


def _assert_pipeline_contexts(pipe, ours: dict) -> None:
    """`ours` (encode_prompts' output) are the contexts and mask LTX2Pipeline computes for CAPTIONS."""
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                                max_sequence_length=MAX_LENGTH, device="cpu")  # fmt: skip
        video, audio, text_mask = pipe.connectors(embeds, mask, padding_side="left")
    torch.testing.assert_close(ours["video_context"], video, rtol=0, atol=0)
    torch.testing.assert_close(ours["audio_context"], audio, rtol=0, atol=0)
    assert torch.equal(ours["text_mask"], text_mask)


def test_text_encoding_matches_the_pipeline(fx, pipe):
    model, tokenizer = ltx2.load_text_encoder(fx["diffusers"], None, torch.float32)
    connectors = ltx2.load_connectors(fx["diffusers"], torch.float32)
    _assert_pipeline_contexts(pipe, ltx2.encode_prompts(model, tokenizer, connectors, CAPTIONS, MAX_LENGTH))


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    noisy = torch.randn(1, 128, 2, 2, 3, generator=gen)
    audio = torch.randn(1, 8, 5, 16, generator=gen)
    cond = {
        "video_context": torch.randn(1, MAX_LENGTH, 32, generator=gen),
        "audio_context": torch.randn(1, MAX_LENGTH, 32, generator=gen),
        "text_mask": torch.ones(1, MAX_LENGTH, dtype=torch.long),
    }
    return noisy, audio, cond


def test_both_streams_match_the_pipelines_transformer_call(pipe):
    """`LTX2Sound.predict_streams` feeds the transformer exactly as LTX2Pipeline's denoising loop does (its own
    packing of both streams, timestep t·1000 as `timestep` and `sigma`), and unpacks both outputs."""
    noisy, audio, cond = _inputs()
    t = torch.tensor([0.7])
    with torch.no_grad():
        video_v, audio_v = (
            _bare_trainer().sound_stream().predict_streams(pipe.transformer, noisy, t, audio, t, cond)
        )
        packed = pipe._pack_latents(noisy, 1, 1)
        packed_audio = pipe._pack_audio_latents(audio)
        coords = pipe.transformer.rope.prepare_video_coords(1, 2, 2, 3, noisy.device, fps=24.0)
        audio_coords = pipe.transformer.audio_rope.prepare_audio_coords(1, 5, noisy.device)
        theirs_v, theirs_a = pipe.transformer(
            hidden_states=packed, audio_hidden_states=packed_audio,
            encoder_hidden_states=cond["video_context"], audio_encoder_hidden_states=cond["audio_context"],
            timestep=(t * 1000).expand(1), sigma=(t * 1000).expand(1), encoder_attention_mask=cond["text_mask"],
            audio_encoder_attention_mask=cond["text_mask"], num_frames=2, height=2, width=3, fps=24.0,
            audio_num_frames=5, video_coords=coords, audio_coords=audio_coords, return_dict=False,
        )  # fmt: skip
    torch.testing.assert_close(video_v, pipe._unpack_latents(theirs_v, 2, 2, 3, 1, 1), rtol=0, atol=0)
    torch.testing.assert_close(audio_v, pipe._unpack_audio_latents(theirs_a, 5, 16), rtol=0, atol=0)


def test_loss_covers_both_streams(pipe, tmp_path):
    """With sound the loss is the video stream's plus the audio stream's flow-matching loss, and the
    audio output head gets gradients; without sound only the video stream counts."""
    from tuner.diffusion.timesteps import FlowObjective, flow_loss, flow_target

    trainer = _bare_trainer()
    trainer._objective = FlowObjective()
    trainer.cfg = type("Cfg", (), {"model": type("M", (), {"dtype": "fp32"})})()
    model = pipe.transformer
    model.requires_grad_(True)  # a LoRA another test loaded into the shared pipeline froze its weights
    noisy, audio, cond = _inputs(1)
    x0, noise = noisy, torch.randn_like(noisy)
    t = torch.tensor([0.4])
    audio_noise = torch.randn_like(audio)
    with_sound = {**cond, "audio_latents": audio, "audio_noise": audio_noise}
    model.zero_grad()
    loss = trainer.loss(model, x0, noise, t, with_sound, NoAccelerator())
    loss.backward()
    assert model.audio_proj_out.weight.grad.abs().sum() > 0
    with torch.no_grad():
        xt, at = (1 - t) * x0 + t * noise, (1 - t) * audio + t * audio_noise
        v, a = trainer.sound_stream().predict_streams(model, xt, t, at, t, cond)
        expected = flow_loss(v, flow_target(x0, noise), t, "none") + flow_loss(
            a, flow_target(audio, audio_noise), t, "none"
        )
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-6, atol=1e-6)
    # a dataset's loss mask weighs the video stream only; its loss_weight scales the sum
    masked = {**with_sound, "loss_mask": torch.zeros(1, 1, *x0.shape[2:]), "loss_weight": torch.tensor([2.0])}
    with torch.no_grad():
        audio_only = flow_loss(a, flow_target(audio, audio_noise), t, "none")
        torch.testing.assert_close(trainer.loss(model, x0, noise, t, masked, NoAccelerator()), 2 * audio_only)
    model.zero_grad()
    silent = trainer.loss(model, x0, noise, t, cond, NoAccelerator())
    silent.backward()
    assert model.audio_proj_out.weight.grad is None or model.audio_proj_out.weight.grad.abs().sum() == 0
    model.zero_grad()


def test_audio_vae_round_trip_shapes(fx):
    audio_vae = ltx2.load_audio_vae(fx["diffusers"], torch.float32)
    vocoder = ltx2.load_vocoder(fx["diffusers"], torch.float32)
    waveform = torch.sin(torch.arange(6000) / 16000 * 2 * torch.pi * 220).repeat(2, 1)
    with torch.no_grad():
        latents = ltx2.encode_audio(audio_vae, waveform)
        assert latents.shape == (8, ltx2.audio_latent_frames(audio_vae, 6000), 16)
        sound = ltx2.decode_audio(audio_vae, vocoder, latents[None])
    assert sound.shape[:2] == (1, 2) and torch.isfinite(sound).all()


def test_saved_lora_loads_in_the_diffusers_pipeline(fx, pipe, tmp_path):
    """The default, `comfy_folded` (`diffusion_model.` + the release's names, alpha folded in, what ComfyUI
    reads), loads in diffusers' LTX-2 LoRA loader with the same result. A `comfy` file does not: diffusers
    0.42's LTX-2 converter keeps the `.alpha` keys and then refuses them as not LoRA parameters (pinned
    below, so a diffusers that starts reading them shows up here)."""
    pytest.importorskip("peft")
    from tuner.networks.lora import LoRANetwork
    from tuner.networks.targets import TargetSpec
    from tuner.registry import resolve_save_format

    record = ARCHITECTURES["ltx2"]
    model = ltx2.load_transformer(fx["diffusers"], torch.float32)
    network = LoRANetwork.apply_to(
        model, TargetSpec(record.default_targets), rank=4, alpha=2, name_map=record.key_table()
    )
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    network.save(tmp_path / "comfy.safetensors", format="comfy")
    saved = load_file(tmp_path / "comfy.safetensors")
    assert "diffusion_model.transformer_blocks.0.audio_to_video_attn.to_q.alpha" in saved
    with pytest.raises(ValueError, match="Invalid LoRA checkpoint"):
        pipe.load_lora_weights(tmp_path / "comfy.safetensors", adapter_name="comfy")
    assert resolve_save_format("ltx2", "auto") == "comfy_folded"  # the default: no `.alpha` keys
    network.save(tmp_path / "lora.safetensors", format="comfy_folded")
    assert not any(k.endswith(".alpha") for k in load_file(tmp_path / "lora.safetensors"))
    noisy, audio, cond = _inputs(2)
    t = torch.tensor([0.5])
    trainer = _bare_trainer()
    with torch.no_grad():
        ours = trainer.sound_stream().predict_streams(model, noisy, t, audio, t, cond)
        pipe.load_lora_weights(tmp_path / "lora.safetensors", adapter_name="tuner")
        try:
            theirs = trainer.sound_stream().predict_streams(pipe.transformer, noisy, t, audio, t, cond)
        finally:
            pipe.delete_adapters("tuner")
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_generate_writes_an_mp4_with_sound(fx, tmp_path):
    """`tuner generate` denoises the audio stream beside the video and muxes the vocoder's waveform."""
    import av

    from project import cfg, make_project
    from tuner.data.audio import has_audio, read_audio
    from tuner.generate import GenerateOptions, generate

    config = make_project(tmp_path, fx["root"], architecture="ltx2")
    opts = GenerateOptions(prompt="a red circle", out=str(tmp_path / "clip.mp4"), width=64, height=64, frames=17,
                           steps=2, guidance_scale=2.0, device="cpu")  # fmt: skip
    out = generate(cfg(config), opts, log=lambda s: None)
    assert out.suffix == ".mp4" and has_audio(out)
    with av.open(str(out)) as container:
        assert container.streams.audio[0].rate == 16000  # the tiny vocoder's output rate
    sound = read_audio(out, 16000, 2)
    assert torch.isfinite(sound).all()
    # the tiny vocoder keeps the real 160 samples per mel frame: the sound lasts as long as the clip
    assert abs(sound.shape[1] / 16000 - 17 / 24) < 0.1


def test_another_audio_vae_in_the_pipeline_folder_re_encodes_the_latents(fx, tmp_path, capsys):
    import shutil

    from project import make_project, run, summary

    folder = tmp_path / "LTX-2"
    shutil.copytree(fx["diffusers"], folder)
    config = make_project(tmp_path / "project", fx["root"], architecture="ltx2", vae=f'"{folder}"')
    assert summary(run(capsys, "cache", "latents", "--config", config)[1]) == (6, 0, 0)
    assert summary(run(capsys, "cache", "latents", "--config", config)[1]) == (0, 6, 0)
    weights = next((folder / "audio_vae").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8] + b"\x00" * 8)  # another audio VAE
    assert summary(run(capsys, "cache", "latents", "--config", config)[1])[0] == 6


def test_the_audio_vae_is_found_beside_the_given_vae_folder(fx):
    """The trainer hands `model.vae` to both VAE loaders: given the `vae/` folder, `audio_vae/` beside it."""
    beside = ltx2.load_audio_vae(Path(fx["diffusers"]) / "vae", torch.float32).state_dict()
    root = ltx2.load_audio_vae(fx["diffusers"], torch.float32).state_dict()
    assert beside.keys() == root.keys() and all(torch.equal(beside[k], root[k]) for k in root)


# ---------------------------------------------------------------- ComfyUI's Gemma 3 file, LTX-2.3


def _release_entries(path) -> dict[str, torch.Tensor]:
    """A release file's tensors, `model.diffusion_model.` dropped (the projection has none)."""
    return {k.removeprefix("model.diffusion_model."): v for k, v in load_file(path).items()}


def test_comfy_gemma_file_and_the_release_connectors_encode_as_the_pipeline(fx, pipe):
    """ComfyUI's single-file Gemma 3 (its vision and tokenizer entries left out) holds the folder's
    language model, and with the connectors of the release's file encodes prompts as LTX2Pipeline does."""
    model, tokenizer = ltx2.load_text_encoder(fx["gemma_file"], fx["tokenizer"], torch.float32)
    folder = pipe.text_encoder.model.state_dict()
    ours = model.state_dict()
    assert ours.keys() == folder.keys() and all(torch.equal(ours[k], folder[k]) for k in ours)
    assert {"spiece_model", "vision_model.embeddings.patch_embedding.weight"} <= load_file(
        fx["gemma_file"]
    ).keys()
    connectors = ltx2.load_connectors(fx["checkpoint_file"], torch.float32)
    _assert_pipeline_contexts(pipe, ltx2.encode_prompts(model, tokenizer, connectors, CAPTIONS, MAX_LENGTH))


def test_ltx23_file_is_told_from_ltx2_by_shapes_and_loads_its_own_weights(fx, tmp_path):
    """The same sizes as LTX-2; the prompt modulation's shapes (and the per-stream projections of the
    connectors) tell LTX-2.3 apart, and every tensor loads unchanged."""
    transformer = ltx2.load_transformer(fx["ltx23_file"], torch.float32)
    assert transformer.config.gated_attn and transformer.config.cross_attn_mod
    assert not transformer.config.use_prompt_embeddings
    assert not ltx2.load_transformer(fx["checkpoint_file"], torch.float32).config.gated_attn
    stored = _release_entries(fx["ltx23_file"])
    ours = LTX2_LAYOUT.to_original(transformer.state_dict())
    assert all(torch.equal(v, stored[k]) for k, v in ours.items())
    assert (
        "prompt_adaln_single.linear.weight" in ours
        and "transformer_blocks.0.attn1.to_gate_logits.weight" in ours
    )
    connectors = ltx2.load_connectors(fx["ltx23_file"], torch.float32)
    assert connectors.config.per_modality_projections
    ours = CONNECTORS_LAYOUT.to_original(connectors.state_dict())
    assert all(torch.equal(v, stored[k]) for k, v in ours.items())
    assert "text_embedding_projection.video_aggregate_embed.bias" in ours
    vocoder = ltx2.load_vocoder(fx["ltx23_file"], torch.float32)
    assert vocoder.config.output_sampling_rate == 48000
    vocoder.save_pretrained(tmp_path / "LTX-2.3" / "vocoder")  # a diffusers folder's LTX2VocoderWithBWE
    folder = ltx2.load_vocoder(tmp_path / "LTX-2.3", torch.float32).state_dict()
    assert all(torch.equal(v, folder[k]) for k, v in vocoder.state_dict().items())
    stored = {
        k.removeprefix("vocoder."): v
        for k, v in load_file(fx["ltx23_file"]).items()
        if k.startswith("vocoder.")
    }
    ours = BWE_VOCODER_LAYOUT.to_original(vocoder.state_dict())
    assert ours.keys() == stored.keys() and all(torch.equal(v, stored[k]) for k, v in ours.items())
    assert (
        "vocoder.resblocks.0.acts1.0.downsample.lowpass.filter" in ours
        and "bwe_generator.ups.0.weight" in ours
    )


@pytest.fixture(scope="module")
def pipe23(fx, pipe):
    """LTX2Pipeline holding the LTX-2.3 file's transformer and connectors (the rest the tiny pipeline's)."""
    parts = {name: getattr(pipe, name) for name in ("scheduler", "vae", "audio_vae", "text_encoder", "tokenizer",
                                                    "vocoder")}  # fmt: skip
    return LTX2Pipeline(transformer=ltx2.load_transformer(fx["ltx23_file"], torch.float32).eval(),
                        connectors=ltx2.load_connectors(fx["ltx23_file"], torch.float32).eval(), **parts)  # fmt: skip


def test_ltx23_text_and_both_streams_match_the_pipeline(fx, pipe23):
    """LTX-2.3's text contexts (the per-stream projections) and transformer call (each stream's noise level
    as `sigma` / `audio_sigma`, the cross-modal modulation by the other stream's) are LTX2Pipeline's."""
    model, tokenizer = ltx2.load_text_encoder(fx["gemma_file"], fx["tokenizer"], torch.float32)
    _assert_pipeline_contexts(
        pipe23, ltx2.encode_prompts(model, tokenizer, pipe23.connectors, CAPTIONS, MAX_LENGTH)
    )
    noisy, audio, cond = _inputs()
    t = torch.tensor([0.7])
    transformer = pipe23.transformer
    with torch.no_grad():
        video_v, audio_v = (
            _bare_trainer().sound_stream().predict_streams(transformer, noisy, t, audio, t, cond)
        )
        coords = transformer.rope.prepare_video_coords(1, 2, 2, 3, noisy.device, fps=24.0)
        audio_coords = transformer.audio_rope.prepare_audio_coords(1, 5, noisy.device)
        theirs_v, theirs_a = transformer(
            hidden_states=pipe23._pack_latents(noisy, 1, 1), audio_hidden_states=pipe23._pack_audio_latents(audio),
            encoder_hidden_states=cond["video_context"], audio_encoder_hidden_states=cond["audio_context"],
            timestep=(t * 1000).expand(1), sigma=(t * 1000).expand(1), encoder_attention_mask=cond["text_mask"],
            audio_encoder_attention_mask=cond["text_mask"], num_frames=2, height=2, width=3, fps=24.0,
            audio_num_frames=5, video_coords=coords, audio_coords=audio_coords, use_cross_timestep=True,
            return_dict=False,
        )  # fmt: skip
    torch.testing.assert_close(video_v, pipe23._unpack_latents(theirs_v, 2, 2, 3, 1, 1), rtol=0, atol=0)
    torch.testing.assert_close(audio_v, pipe23._unpack_audio_latents(theirs_a, 5, 16), rtol=0, atol=0)


def _fp8_scaled(tensors: dict, key: str, scale: float = 0.5) -> dict:
    """`tensors` with `key` stored as ComfyUI's scaled fp8 (`.weight_scale` beside it)."""
    return {**tensors, key: (tensors[key] / scale).to(torch.float8_e4m3fn),
            key.removesuffix(".weight") + ".weight_scale": torch.tensor(scale)}  # fmt: skip


def test_fp8_release_and_gemma_files_load_dequantized(fx, tmp_path):
    """The release's fp8 transformer (and connectors) and ComfyUI's fp8 Gemma load through the fp8 path:
    each scaled weight is its fp8 value times the scale, the rest unchanged."""
    key = "model.diffusion_model.transformer_blocks.0.attn1.to_q.weight"
    conn = "model.diffusion_model.video_embeddings_connector.transformer_1d_blocks.0.attn1.to_q.weight"
    tensors = load_file(fx["ltx23_file"])
    fp8 = _fp8_scaled(_fp8_scaled(tensors, key), conn)
    save_file(fp8, tmp_path / "ltx-2.3-tiny-fp8.safetensors")
    model = ltx2.load_transformer(tmp_path / "ltx-2.3-tiny-fp8.safetensors", torch.float32)
    assert torch.equal(model.transformer_blocks[0].attn1.to_q.weight, fp8[key].float() * 0.5)
    assert torch.equal(model.proj_in.weight, tensors["model.diffusion_model.patchify_proj.weight"])
    # fp8 storage (memory.fp8_base) keeps the file's fp8 layers of the transformer, not those of the
    # connectors it bundles under the same prefix
    from tuner.fp8 import load_comfy_fp8_weights

    stored = load_comfy_fp8_weights(model.requires_grad_(False), tmp_path / "ltx-2.3-tiny-fp8.safetensors",
                                    LTX2_LAYOUT.inverse)  # fmt: skip
    assert stored == ["transformer_blocks.0.attn1.to_q"]
    connectors = ltx2.load_connectors(tmp_path / "ltx-2.3-tiny-fp8.safetensors", torch.float32)
    assert torch.equal(
        connectors.video_connector.transformer_blocks[0].attn1.to_q.weight, fp8[conn].float() * 0.5
    )
    gemma = load_file(fx["gemma_file"])
    q = "model.layers.0.self_attn.q_proj.weight"
    save_file(_fp8_scaled(gemma, q), tmp_path / "gemma_3_tiny_fp8_scaled.safetensors")
    model, _ = ltx2.load_text_encoder(
        tmp_path / "gemma_3_tiny_fp8_scaled.safetensors", fx["tokenizer"], torch.float32
    )
    assert torch.equal(
        model.layers[0].self_attn.q_proj.weight, (gemma[q] / 0.5).to(torch.float8_e4m3fn).float() * 0.5
    )


def test_wrong_files_are_refused_by_name(fx, tmp_path):
    with pytest.raises(CheckpointError, match=r"holds no LTX-2 text connectors .*Set model.transformer"):
        ltx2.load_connectors(fx["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match="holds no LTX-2 vocoder"):
        ltx2.load_vocoder(fx["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match="Gemma 3 text encoder"):
        ltx2.load_text_encoder(fx["checkpoint_file"], fx["tokenizer"], torch.float32)
    with pytest.raises(CheckpointError, match="no tokenizer"):
        ltx2.load_text_encoder(fx["gemma_file"], None, torch.float32)
    with pytest.raises(CheckpointError, match="LTX-2 transformer"):
        ltx2.load_transformer(fx["gemma_file"], torch.float32)
    gemma = load_file(fx["gemma_file"])
    q = "model.layers.0.self_attn.q_proj.weight"
    fp4 = {**gemma, q: torch.zeros(32, 16, dtype=torch.uint8), q + "_scale_2": torch.tensor(1.0)}
    save_file(fp4, tmp_path / "gemma_3_tiny_fp4_mixed.safetensors")
    with pytest.raises(CheckpointError, match=r"fp4_mixed.*gemma_3_12B_it_fp8_scaled"):
        ltx2.load_text_encoder(
            tmp_path / "gemma_3_tiny_fp4_mixed.safetensors", fx["tokenizer"], torch.float32
        )


def _single_files_project(fx, root: Path) -> Path:
    """A project on LTX-2.3's release file (transformer, connectors, VAEs, vocoder) and ComfyUI's Gemma 3."""
    from project import make_project

    single = {"transformer": fx["ltx23_file"], "vae": fx["ltx23_file"],
              "text_encoder": f'{fx["gemma_file"]}"\ntokenizer = "{fx["tokenizer"]}'}  # fmt: skip
    return make_project(root, fx["root"], architecture="ltx2", **{k: f'"{v}"' for k, v in single.items()})


@pytest.mark.slow
def test_ltx23_trains_a_lora_in_comfyuis_names_from_single_files(fx, tmp_path, capsys):
    """Caching and training run on LTX-2.3's files alone; the adapter keeps the release's block names."""
    from project import run

    config = _single_files_project(fx, tmp_path)
    for argv in (("cache", "latents"), ("cache", "text")):
        code, log = run(capsys, *argv, "--config", config)
        assert code == 0, log
    out = tmp_path / "out"
    code, log = run(capsys, "train", "--config", config, "--set", f"save.output_dir='{out}'",
                    "--set", "train.max_steps=2")  # fmt: skip
    assert code == 0, log
    keys = load_file(out / "demo_lora.safetensors").keys()
    assert "diffusion_model.transformer_blocks.0.audio_to_video_attn.to_q.lora_A.weight" in keys


@pytest.mark.slow
def test_generate_from_single_files_only_with_the_ltx23_variant(fx, tmp_path):
    """No diffusers folder: LTX-2.3's release file (transformer, connectors, VAEs, vocoder) and ComfyUI's
    Gemma 3 file give an mp4 with sound, at the bandwidth extension's 48 kHz."""
    import av

    from project import cfg
    from tuner.data.audio import has_audio
    from tuner.generate import GenerateOptions, generate

    config = _single_files_project(fx, tmp_path)
    opts = GenerateOptions(prompt="a red circle", out=str(tmp_path / "clip.mp4"), width=64, height=64, frames=17,
                           steps=2, guidance_scale=2.0, device="cpu")  # fmt: skip
    out = generate(cfg(config), opts, log=lambda s: None)
    assert out.suffix == ".mp4" and has_audio(out)
    with av.open(str(out)) as container:
        assert container.streams.audio[0].rate == 48000


def _meta_state(cls, config_dir) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        if hasattr(cls, "load_config"):
            return cls.from_config(cls.load_config(config_dir)).state_dict()
        return cls(cls.config_class.from_pretrained(config_dir)).state_dict()


def test_every_shipped_config_is_the_variant_its_shapes_name():
    """Each real and tiny config, built on the meta device and named as the release's files name it, is
    picked as its own variant (19b and 22b differ only where the table says), and its layout converts
    every tensor both ways (LTX-2.3's fourth VAE decoder stage, its vocoder's bandwidth extension)."""
    from diffusers import AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE
    from transformers import Gemma3TextModel

    from tuner.archs.ltx2.keys import VIDEO_VAE_LAYOUT
    from tuner.models.encoders import causal_lm_key
    from tuner.models.identify import pick_variant

    tables = [(ltx2.TRANSFORMER_VARIANTS, LTX2VideoTransformer3DModel, LTX2_LAYOUT.to_original),
              (ltx2.CONNECTORS_VARIANTS, LTX2TextConnectors, CONNECTORS_LAYOUT.to_original),
              (ltx2.TEXT_ENCODER_VARIANTS, Gemma3TextModel, lambda sd: {causal_lm_key(k): v for k, v in sd.items()})]  # fmt: skip
    for variants, cls, to_original in tables:
        for variant in variants:
            shapes = {k: tuple(v.shape) for k, v in to_original(_meta_state(cls, variant.config_dir)).items()}
            assert pick_variant(shapes, variants, variant.config_dir, cls.__name__) == variant
    for cls, layout, name in ((AutoencoderKLLTX2Video, VIDEO_VAE_LAYOUT, "vae/22b"),
                              (LTX2VocoderWithBWE, BWE_VOCODER_LAYOUT, "vocoder/22b")):  # fmt: skip
        state = _meta_state(cls, ltx2.CONFIGS / name)
        assert layout.to_diffusers(layout.to_original(state)).keys() == state.keys()
