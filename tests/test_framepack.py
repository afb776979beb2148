"""FramePack: both layouts load alike, the section inputs are the pipeline's, text and SigLIP match it, and
diffusers' LoRA loader reads our diffusers-layout file; all on the tiny fixture."""

from types import SimpleNamespace

import pytest
import torch
from diffusers import HunyuanVideoFramepackPipeline, HunyuanVideoFramepackTransformer3DModel
from PIL import Image

from project import assert_equal_weights
from tuner.archs.framepack import loaders as framepack
from tuner.archs.framepack.keys import FRAMEPACK_LAYOUT
from tuner.archs.framepack.trainer import FramePackModel
from tuner.archs.hunyuan_video import loaders as hv
from tuner.archs.wan.trainer_i2v import LatentEncoders
from tuner.config import load_config
from tuner.config.schema import OneFrameConfig
from tuner.errors import CheckpointError, ConfigError
from tuner.fixtures import write_fixture
from tuner.io import save_safetensors
from tuner.models.loading import load_tensors, read_tensor_shapes
from tuner.networks import LoRANetwork, TargetSpec
from tuner.registry import ARCHITECTURES

CAPTIONS = ["a dog runs", "a red car drives on the street at night while the rain falls"]
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_fixture("framepack", tmp_path_factory.mktemp("framepack_model"))


@pytest.fixture(scope="module")
def pipe(paths):
    pipe = HunyuanVideoFramepackPipeline.from_pretrained(paths["diffusers"])
    for component in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.image_encoder):
        component.eval()
    return pipe


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_layout_loads_to_theassert_equal_weights(paths, dtype):
    folder = framepack.load_transformer(paths["diffusers"], dtype)
    assert isinstance(folder, HunyuanVideoFramepackTransformer3DModel)
    assert_equal_weights(framepack.load_transformer(paths["release_file"], dtype), folder)
    assert_equal_weights(framepack.load_transformer(paths["transformer_file"], dtype), folder)
    siglip = framepack.load_image_encoder(paths["diffusers"], dtype)
    assert_equal_weights(framepack.load_image_encoder(paths["image_encoder_file"], dtype).model, siglip.model)


def test_prefixed_and_fp8_release_files_load(paths, tmp_path):
    """ComfyUI's `model.diffusion_model.` prefix, and Kijai's `FramePackI2V_HY_fp8_e4m3fn` (the release's
    names, matrices cast to fp8 without scales) load; fp8 within its rounding."""
    state = load_tensors(paths["release_file"])
    prefixed = {f"model.diffusion_model.{k}": v for k, v in state.items()}
    save_safetensors(prefixed, tmp_path / "prefixed.safetensors")
    reference = framepack.load_transformer(paths["release_file"], torch.float32)
    assert_equal_weights(
        framepack.load_transformer(tmp_path / "prefixed.safetensors", torch.float32), reference
    )
    fp8 = {k: v.to(torch.float8_e4m3fn) if v.ndim == 2 else v for k, v in state.items()}
    save_safetensors(fp8, tmp_path / "fp8.safetensors")
    loaded = framepack.load_transformer(tmp_path / "fp8.safetensors", torch.float32).state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(loaded[key], value, atol=0.1, rtol=0.07)


def test_release_file_has_diffusers_names_and_the_layout_hunyuan_videos(paths):
    release = read_tensor_shapes(paths["release_file"])
    assert "clean_x_embedder.proj_4x.weight" in release and "transformer_blocks.0.attn.to_q.weight" in release
    hunyuan = read_tensor_shapes(paths["transformer_file"])
    assert "double_blocks.0.img_attn_qkv.weight" in hunyuan and "clean_x_embedder.proj_4x.weight" in hunyuan
    assert "single_blocks.0.linear1.weight" in hunyuan and "image_projection.up.weight" in hunyuan


def test_files_of_the_other_architecture_are_refused_naming_it(paths):
    with pytest.raises(CheckpointError, match='architecture = "hunyuan_video"'):
        framepack.load_transformer(paths["hunyuan_video_file"], torch.float32)
    for path in (paths["release_file"], paths["transformer_file"], paths["diffusers"]):
        with pytest.raises(CheckpointError, match='architecture = "framepack"'):
            hv.load_transformer(path, torch.float32)
    with pytest.raises(CheckpointError, match="SigLIP"):
        framepack.load_image_encoder(paths["vae_file"], torch.float32)


def test_shipped_signatures_fit_the_shipped_configs():
    """Each variant's signature (HunyuanVideo names) is what a model of its config holds, shapes too, and
    SigLIP's likewise."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    for variant in framepack.TRANSFORMER_VARIANTS:
        with torch.device("meta"):
            model = HunyuanVideoFramepackTransformer3DModel.from_config(
                HunyuanVideoFramepackTransformer3DModel.load_config(variant.config_dir)
            )
        shapes = {k: tuple(v.shape) for k, v in FRAMEPACK_LAYOUT.to_original(model.state_dict()).items()}
        assert not variant.mismatches(shapes), (variant.name, variant.mismatches(shapes))
    for variant in framepack.SIGLIP_VARIANTS:
        with torch.device("meta"):
            model = SiglipVisionModel(SiglipVisionConfig.from_pretrained(variant.config_dir))
        shapes = {
            f"vision_model.{k.removeprefix('vision_model.')}": tuple(v.shape)
            for k, v in model.state_dict().items()
        }
        assert not variant.mismatches(shapes), (variant.name, variant.mismatches(shapes))


# ---------------------------------------------------------------------------------------------------
# The pipeline's inputs
# ---------------------------------------------------------------------------------------------------


def test_encode_prompts_match_the_pipeline(paths, pipe):
    encoders = hv.TextEncoders(pipe.text_encoder, pipe.tokenizer, pipe.text_encoder_2, pipe.tokenizer_2)
    ours = hv.encode_prompts(encoders, CAPTIONS)
    embeds, pooled, mask = pipe.encode_prompt(CAPTIONS, device="cpu")
    for i, entry in enumerate(ours):
        n = int(mask[i].sum())
        torch.testing.assert_close(entry["text"], embeds[i, :n], **TOLERANCE)
        torch.testing.assert_close(entry["pooled"], pooled[i], **TOLERANCE)


def test_section_indices_are_the_pipelines():
    """The release's inverted anti-drifting split, padding 0 and 2: [prefix | padding | section | 1x | 2x | 4x]."""
    idx = framepack.section_indices(3)
    assert idx.latents.tolist() == [1, 2, 3]
    assert idx.clean.tolist() == [0, 4]
    assert idx.history_2x.tolist() == [5, 6] and idx.history_4x.tolist() == list(range(7, 23))
    assert framepack.section_indices(3, padding=2).latents.tolist() == [3, 4, 5]


@torch.no_grad()
def test_one_section_of_the_pipeline_is_what_the_trainer_feeds(pipe):
    """A one-section pipeline run (inverted anti-drifting, window 2): every transformer call it makes is
    `predict` on the trainer's inputs: text, SigLIP embedding, indices, an empty history, and the image's
    latent frame (the pipeline samples it from the VAE; that latent is taken from the call)."""
    image = Image.fromarray(
        (torch.rand(32, 48, 3, generator=torch.Generator().manual_seed(1)) * 255).byte().numpy()
    )
    calls = []
    hook = pipe.transformer.register_forward_hook(
        lambda m, args, kwargs, out: calls.append((kwargs, out[0])), with_kwargs=True
    )
    try:
        pipe(image=image, prompt=CAPTIONS[1], height=32, width=48, num_frames=5, latent_window_size=2,
             num_inference_steps=2, guidance_scale=6.0, output_type="latent",
             generator=torch.Generator().manual_seed(0))  # fmt: skip
    finally:
        hook.remove()
    assert len(calls) == 2
    trainer = FramePackModel(SimpleNamespace(model=SimpleNamespace(guidance=6.0)))
    pixels = pipe.video_processor.preprocess(image, 32, 48)
    encoders = LatentEncoders(pipe.vae, framepack.ImageEncoder(pipe.image_encoder, pipe.feature_extractor))
    given = trainer.encode_frame_images(encoders, [pixels], 5)
    text = hv.collate(hv.encode_prompts(
        hv.TextEncoders(pipe.text_encoder, pipe.tokenizer, pipe.text_encoder_2, pipe.tokenizer_2), CAPTIONS[1:]
    ))  # fmt: skip
    indices = framepack.section_indices(2)
    for kwargs, out in calls:
        torch.testing.assert_close(given["image_embeds"], kwargs["image_embeds"], **TOLERANCE)
        for name, ours in (("latents", indices.latents), ("latents_clean", indices.clean),
                           ("latents_history_2x", indices.history_2x), ("latents_history_4x", indices.history_4x)):  # fmt: skip
            assert torch.equal(kwargs[f"indices_{name}"], ours), name
        history = torch.cat([kwargs["latents_clean"][:, :, 1:], kwargs["latents_history_2x"],
                             kwargs["latents_history_4x"]], dim=2)  # fmt: skip
        assert torch.equal(history, given["history"])
        cond = {**text, **given, "first_frame": kwargs["latents_clean"][:, :, :1]}
        noisy = torch.cat([cond["first_frame"], kwargs["hidden_states"]], dim=2)
        t = kwargs["timestep"] / 1000
        pred = trainer.predict(pipe.transformer, noisy, t, cond)
        torch.testing.assert_close(pred[:, :, 1:], out, **TOLERANCE)
        assert pred[:, :, :1].abs().max() == 0  # x_t already is the given frame: the straight line is 0


def test_latents_of_a_clip_are_image_then_section_then_history(paths, pipe):
    """A 45-frame clip (12 latent frames): the image's frame and a 9-frame section; the 2 frames after
    the section open the 19-frame history, the rest is zeros; the image's frame is not in the loss."""
    trainer = FramePackModel(SimpleNamespace())
    encoders = LatentEncoders(pipe.vae, framepack.ImageEncoder(pipe.image_encoder, pipe.feature_extractor))
    pixels = torch.rand(1, 3, 45, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    entry = trainer.encode_latents(encoders, pixels, [])
    clip = hv.encode_video(pipe.vae, pixels)
    torch.testing.assert_close(entry["latents"], clip[:, :, :10])
    torch.testing.assert_close(entry["history"][:, :, :2], clip[:, :, 10:])
    assert entry["history"].shape[2] == 19 and entry["history"][:, :, 2:].abs().max() == 0
    # the image's latent as the pipeline makes it: the frame encoded alone (the VAE's group norms see the
    # whole clip, so the clip's own first latent frame differs; it is left out of the loss)
    torch.testing.assert_close(entry["first_frame"], hv.encode_video(pipe.vae, pixels[:, :, :1]))
    assert trainer.loss_mask(entry["latents"], {}).flatten().tolist() == [0.0] + [1.0] * 9


# ---------------------------------------------------------------------------------------------------
# diffusers' LoRA loader
# ---------------------------------------------------------------------------------------------------


def test_diffusers_layout_loads_in_the_framepack_pipeline(paths, pipe, tmp_path):
    """Every default target saved in the diffusers layout goes through
    `HunyuanVideoFramepackPipeline.load_lora_weights` (HunyuanVideo's loader) to the same output. The
    default (comfy) layout is HunyuanVideo's, which that converter does not read (its `.alpha` keys; see
    tests/test_hunyuan_video.py)."""
    ours = HunyuanVideoFramepackTransformer3DModel.from_pretrained(paths["diffusers"] / "transformer").eval()
    record = ARCHITECTURES["framepack"]
    network = LoRANetwork.apply_to(
        ours, TargetSpec(record.default_targets), 4, 3.0, name_map=record.key_table()
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in network.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    trainer = FramePackModel(SimpleNamespace(model=SimpleNamespace(guidance=6.0)))
    gen = torch.Generator().manual_seed(2)
    cond = {"text": torch.randn(1, 7, 64, generator=gen), "mask": torch.ones(1, 7, dtype=torch.long),
            "pooled": torch.randn(1, 32, generator=gen), "image_embeds": torch.randn(1, 16, 32, generator=gen),
            "first_frame": torch.randn(1, 16, 1, 4, 6, generator=gen),
            "history": torch.randn(1, 16, 19, 4, 6, generator=gen)}  # fmt: skip
    noisy, t = torch.randn(1, 16, 3, 4, 6, generator=gen), torch.tensor([0.6])
    with torch.no_grad():
        expected = trainer.predict(ours, noisy, t, cond)
        base = trainer.predict(pipe.transformer, noisy, t, cond)
    network.save(tmp_path / "lora.safetensors", format="diffusers")
    pipe.load_lora_weights(str(tmp_path / "lora.safetensors"), adapter_name="ours")
    try:
        injected = {k.split(".lora_A.")[0] for k in pipe.transformer.state_dict() if ".lora_A." in k}
        assert injected == set(network.names())
        with torch.no_grad():
            got = trainer.predict(pipe.transformer, noisy, t, cond)
    finally:
        pipe.unload_lora_weights()
    assert not torch.allclose(expected, base, atol=1e-3)
    torch.testing.assert_close(got, expected, **TOLERANCE)


# ---------------------------------------------------------------------------------------------------
# The single-frame mode
# ---------------------------------------------------------------------------------------------------


def test_one_frame_indices_are_musubis_defaults():
    """target index 9 (= latent window), clean indices [0] + the zero post latent at 1 + 9, 2× and 4×
    zeros after it (musubi-tuner's `fp_1f_*` defaults with `one_frame_no_2x` / `no_4x` off)."""
    idx = framepack.one_frame_indices()
    assert idx.latents.tolist() == [9] and idx.clean.tolist() == [0, 10]
    assert idx.history_2x.tolist() == [11, 12] and idx.history_4x.tolist() == list(range(13, 29))


def test_one_frame_indices_follow_the_settings():
    """musubi's kisekaeichi settings: two references at 0 and 10, the target at 5, no post latent; a
    window of 5 moves the post latent and the history."""
    idx = framepack.one_frame_indices(9, (0, 10), 5, no_post=True)
    assert idx.latents.tolist() == [5] and idx.clean.tolist() == [0, 10]
    assert idx.history_2x.tolist() == [11, 12] and idx.history_4x.tolist() == list(range(13, 29))
    idx = framepack.one_frame_indices(5, (0,), 1)
    assert idx.latents.tolist() == [1] and idx.clean.tolist() == [0, 6]
    assert idx.history_2x.tolist() == [7, 8] and idx.history_4x.tolist() == list(range(9, 25))


ONE_FRAME_TOML = """
[model]
architecture = "{arch}"
transformer = "model.safetensors"
[data]
dataset_config = "dataset.toml"
[one_frame]
{body}
"""


@pytest.mark.parametrize(
    "arch,body,match",
    [
        ("framepack_1f", "target_index = 0", r"key 'one_frame.target_index': 0 is also a reference's"),
        (
            "framepack_1f",
            "clean_indices = [0, 3, 4]",
            r"key 'one_frame.clean_indices': framepack_1f takes 1 to 2",
        ),
        ("framepack_1f", "clean_indices = []", r"key 'one_frame.clean_indices'"),
        ("framepack_1f", "clean_indices = [-1]", r"key 'one_frame.clean_indices': \[-1\]: indices must be"),
        ("framepack_1f", "clean_indices = [0, 10]", r"key 'one_frame.latent_window': the zero post latent"),
        ("framepack_1f", "latent_window = 0", r"one_frame.latent_window.*out of range"),
        ("framepack_1f", "target_indx = 3", r"one_frame.target_indx.*Did you mean 'target_index'"),
        ("framepack", "target_index = 3", r"section 'one_frame': framepack has no one-frame mode"),
    ],
)
def test_bad_one_frame_settings_are_one_line_errors_naming_the_key(tmp_path, arch, body, match):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "dataset.toml").write_text('[[datasets]]\nimage_directory = "imgs"\n')
    (tmp_path / "train.toml").write_text(ONE_FRAME_TOML.format(arch=arch, body=body))
    with pytest.raises(ConfigError, match=match) as e:
        load_config(tmp_path / "train.toml")
    assert "\n" not in str(e.value)


def test_good_one_frame_settings_load(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "dataset.toml").write_text('[[datasets]]\nimage_directory = "imgs"\n')
    body = "clean_indices = [0, 10]\ntarget_index = 5\nno_post = true"
    (tmp_path / "train.toml").write_text(ONE_FRAME_TOML.format(arch="framepack_1f", body=body))
    one = load_config(tmp_path / "train.toml").one_frame
    assert (one.clean_indices, one.target("section"), one.no_post) == ((0, 10), 5, True)


@torch.no_grad()
def test_one_frame_predict_with_two_references_and_no_post(pipe):
    """Two references (control_0, control_1) at clean indices [0, 10], the target at 5, no post latent: the
    transformer gets both references as clean latents and an 18-frame zero history."""
    from tuner.archs.framepack.trainer import FramePackOneFrameModel

    one = OneFrameConfig(target_index=5, clean_indices=(0, 10), no_post=True)
    trainer = FramePackOneFrameModel(SimpleNamespace(model=SimpleNamespace(guidance=10.0), one_frame=one))
    gen = torch.Generator().manual_seed(5)
    cond = {"text": torch.randn(1, 7, 64, generator=gen), "mask": torch.ones(1, 7, dtype=torch.long),
            "pooled": torch.randn(1, 32, generator=gen), "image_embeds": torch.randn(1, 16, 32, generator=gen),
            "control_0": torch.randn(1, 16, 1, 4, 6, generator=gen),
            "control_1": torch.randn(1, 16, 1, 4, 6, generator=gen)}  # fmt: skip
    noisy, t = torch.randn(1, 16, 1, 4, 6, generator=gen), torch.tensor([0.4])
    zeros = torch.zeros(1, 16, 1, 4, 6)
    expected = pipe.transformer(
        hidden_states=noisy, timestep=t * 1000, encoder_hidden_states=cond["text"],
        encoder_attention_mask=cond["mask"], pooled_projections=cond["pooled"], image_embeds=cond["image_embeds"],
        indices_latents=torch.tensor([5]), guidance=torch.tensor([10000.0]),
        latents_clean=torch.cat([cond["control_0"], cond["control_1"]], dim=2),
        indices_latents_clean=torch.tensor([0, 10]),
        latents_history_2x=zeros.repeat(1, 1, 2, 1, 1), indices_latents_history_2x=torch.tensor([11, 12]),
        latents_history_4x=zeros.repeat(1, 1, 16, 1, 1), indices_latents_history_4x=torch.arange(13, 29),
        return_dict=False,
    )[0]  # fmt: skip
    torch.testing.assert_close(trainer.predict(pipe.transformer, noisy, t, cond), expected, **TOLERANCE)


@torch.no_grad()
def test_one_frame_predict_and_text_entry(pipe):
    """The reference's SigLIP embedding rides in the text entry (the pipeline's `encode_image`), and
    `predict` is the transformer called with the reference and a zero post latent as clean latents."""
    from tuner.archs.framepack.trainer import FramePackOneFrameModel, OneFrameEncoders

    trainer = FramePackOneFrameModel(SimpleNamespace(model=SimpleNamespace(guidance=10.0), one_frame=OneFrameConfig(),
                                                     cache=SimpleNamespace(text_max_length=256)))  # fmt: skip
    reference = torch.rand(3, 1, 32, 48, generator=torch.Generator().manual_seed(3)) * 2 - 1
    encoders = OneFrameEncoders(
        hv.TextEncoders(pipe.text_encoder, pipe.tokenizer, pipe.text_encoder_2, pipe.tokenizer_2),
        framepack.ImageEncoder(pipe.image_encoder, pipe.feature_extractor),
    )
    entry = trainer.encode_text(encoders, CAPTIONS[:1], [[reference]])[0]
    torch.testing.assert_close(
        entry["image_embeds"], pipe.encode_image(reference[:, 0][None], device="cpu")[0]
    )
    cond = trainer.collate_text([entry])
    gen = torch.Generator().manual_seed(4)
    cond["control_0"] = torch.randn(1, 16, 1, 4, 6, generator=gen)
    noisy, t = torch.randn(1, 16, 1, 4, 6, generator=gen), torch.tensor([0.7])
    zeros = torch.zeros(1, 16, 1, 4, 6)
    expected = pipe.transformer(
        hidden_states=noisy, timestep=t * 1000, encoder_hidden_states=cond["text"],
        encoder_attention_mask=cond["mask"], pooled_projections=cond["pooled"], image_embeds=cond["image_embeds"],
        indices_latents=torch.tensor([9]), guidance=torch.tensor([10000.0]),
        latents_clean=torch.cat([cond["control_0"], zeros], dim=2), indices_latents_clean=torch.tensor([0, 10]),
        latents_history_2x=zeros.repeat(1, 1, 2, 1, 1), indices_latents_history_2x=torch.tensor([11, 12]),
        latents_history_4x=zeros.repeat(1, 1, 16, 1, 1), indices_latents_history_4x=torch.arange(13, 29),
        return_dict=False,
    )[0]  # fmt: skip
    torch.testing.assert_close(trainer.predict(pipe.transformer, noisy, t, cond), expected, **TOLERANCE)


# ---------------------------------------------------------------------------------------------------
# Generation, section by section
# ---------------------------------------------------------------------------------------------------


def test_section_paddings_are_the_pipelines():
    assert framepack.section_paddings(1) == [0]
    assert framepack.section_paddings(3) == [18, 9, 0]
    assert framepack.section_paddings(6, window=2) == [6, 4, 4, 4, 2, 0]


def test_sections_are_generated_from_the_end_with_the_later_ones_as_history():
    """25 latent frames after the image: sections 18-24, 9-17, 0-8 in that order, at the pipeline's
    paddings, each given the frames generated after it (zeros past the end) as its 19-frame history."""
    trainer = FramePackModel(SimpleNamespace())
    calls = []

    def model_fn(x, t, c):  # a model that moves every frame towards its section's padding
        calls.append((x.shape[2], c["padding"], c["history"].clone()))
        return -torch.full_like(x, float(c["padding"] + 1))

    noise = torch.zeros(1, 2, 26, 1, 1)
    sigmas = torch.tensor([1.0, 0.0])
    out = trainer.sample_flow(model_fn, noise, sigmas, {}, {}, 1.0)
    assert [(n, p) for n, p, _ in calls] == [(8, 18), (10, 9), (10, 0)]
    assert torch.equal(out[0, 0, 1:, 0, 0], torch.tensor([1.0] * 9 + [10.0] * 9 + [19.0] * 7))
    history = [h[0, 0, :, 0, 0].tolist() for _, _, h in calls]
    assert history[0] == [0.0] * 19
    assert history[1] == [19.0] * 7 + [0.0] * 12
    assert history[2] == [10.0] * 9 + [19.0] * 7 + [0.0] * 3


def test_the_default_flow_sampler_is_eulers_with_the_models_guidance():
    """`ArchitectureModel.sample_flow` without a record's `flow_sampler` (FramePack's sections) is one
    `euler_sample` with the model's `combine_guidance`, so every other architecture generates as before."""
    from tuner.archs.hunyuan_video.trainer import HunyuanVideoModel
    from tuner.diffusion.sampling import euler_sample

    trainer = HunyuanVideoModel(SimpleNamespace())
    noise = torch.randn(1, 2, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    sigmas = torch.tensor([1.0, 0.6, 0.0])

    def model_fn(x, t, c):
        return x * c["k"] + t.view(-1, 1, 1, 1, 1)

    cond, uncond = {"k": torch.tensor([0.5])}, {"k": torch.tensor([-0.25])}
    want = euler_sample(model_fn, noise, sigmas, cond, uncond, 3.0, combine=trainer.combine_guidance)
    torch.testing.assert_close(trainer.sample_flow(model_fn, noise, sigmas, cond, uncond, 3.0), want)


def test_comfyui_framepack_wrappers_converter_reads_the_diffusers_layout_only(paths, tmp_path):
    """ComfyUI's FramePack wrapper (kijai/ComfyUI-FramePackWrapper) passes a LoRA file through diffusers'
    `_convert_hunyuan_video_lora_to_diffusers` before `load_lora_adapter`. The default (comfy: HunyuanVideo
    names, fused qkv / linear1, `.alpha` keys) and kohya layouts stop there (it chunks the scalar alphas
    of fused layers); the diffusers layout passes unchanged, and loads as the pipeline test above shows.
    When this test fails, the converter reads alphas: the default layout then serves the wrapper too."""
    from diffusers.loaders.lora_conversion_utils import _convert_hunyuan_video_lora_to_diffusers

    from tuner.networks.keys import read_safetensors

    model = framepack.load_transformer(paths["release_file"], torch.float32)
    record = ARCHITECTURES["framepack"]
    network = LoRANetwork.apply_to(
        model, TargetSpec(record.default_targets), 4, 3.0, name_map=record.key_table()
    )
    for layout in ("comfy", "kohya", "diffusers"):
        network.save(tmp_path / f"{layout}.safetensors", format=layout)
        state = read_safetensors(tmp_path / f"{layout}.safetensors")[0]
        if layout == "diffusers":
            assert _convert_hunyuan_video_lora_to_diffusers(dict(state)).keys() == state.keys()
        else:
            with pytest.raises(RuntimeError, match="chunk"):
                _convert_hunyuan_video_lora_to_diffusers(dict(state))


# ---------------------------------------------------------------------------------------------------
# FramePack-F1: forward sections
# ---------------------------------------------------------------------------------------------------


def test_forward_section_indices_are_f1s():
    """F1's vanilla split [prefix | 4x | 2x | 1x | section], the clean latents being the prefix and the 1x."""
    idx = framepack.forward_section_indices(3)
    assert idx.history_4x.tolist() == list(range(1, 17)) and idx.history_2x.tolist() == [17, 18]
    assert idx.clean.tolist() == [0, 19] and idx.latents.tolist() == [20, 21, 22]


@torch.no_grad()
def test_f1_section_is_what_the_vanilla_pipeline_feeds(pipe):
    """`HunyuanVideoFramepackPipeline(sampling_type="vanilla")` (F1's sampler): every transformer call of its
    first section is F1's `predict` with the forward indices and the history its sampler starts from (18 zeros,
    then the image's latent)."""
    from tuner.archs.framepack.trainer import FramePackF1Model

    image = Image.fromarray(
        (torch.rand(32, 48, 3, generator=torch.Generator().manual_seed(1)) * 255).byte().numpy()
    )
    calls = []
    hook = pipe.transformer.register_forward_hook(
        lambda m, args, kwargs, out: calls.append((kwargs, out[0])), with_kwargs=True
    )
    try:
        pipe(image=image, prompt=CAPTIONS[1], height=32, width=48, num_frames=5, latent_window_size=2,
             num_inference_steps=2, guidance_scale=6.0, output_type="latent", sampling_type="vanilla",
             generator=torch.Generator().manual_seed(0))  # fmt: skip
    finally:
        hook.remove()
    trainer = FramePackF1Model(SimpleNamespace(model=SimpleNamespace(guidance=6.0)))
    text = hv.collate(hv.encode_prompts(
        hv.TextEncoders(pipe.text_encoder, pipe.tokenizer, pipe.text_encoder_2, pipe.tokenizer_2), CAPTIONS[1:]
    ))  # fmt: skip
    indices = framepack.forward_section_indices(2)
    for kwargs, out in calls[:2]:
        for name, ours in (("latents", indices.latents), ("latents_clean", indices.clean),
                           ("latents_history_2x", indices.history_2x), ("latents_history_4x", indices.history_4x)):  # fmt: skip
            assert torch.equal(kwargs[f"indices_{name}"], ours), name
        first = kwargs["latents_clean"][:, :, :1]
        history = torch.cat([kwargs["latents_history_4x"], kwargs["latents_history_2x"],
                             kwargs["latents_clean"][:, :, 1:]], dim=2)  # fmt: skip
        assert history[:, :, :18].abs().max() == 0 and torch.equal(history[:, :, 18:], first)
        cond = {**text, "image_embeds": kwargs["image_embeds"], "first_frame": first, "history": history}
        noisy = torch.cat([first, kwargs["hidden_states"]], dim=2)
        pred = trainer.predict(pipe.transformer, noisy, kwargs["timestep"] / 1000, cond)
        torch.testing.assert_close(pred[:, :, 1:], out, **TOLERANCE)


def test_f1_sections_are_generated_forwards_with_the_earlier_ones_as_history():
    """20 latent frames after the image: sections 0-8, 9-17, 18-19 in that order, each given the 19 frames
    before it (zeros, the image's latent, then what was made) in time order."""
    from tuner.archs.framepack.trainer import FramePackF1Model

    trainer = FramePackF1Model(SimpleNamespace())
    calls = []

    def model_fn(x, t, c):  # every frame of the k-th section moves to k + 1
        calls.append((x.shape[2], c["history"].clone()))
        return -torch.full_like(x, float(len(calls)))

    noise = torch.zeros(1, 2, 21, 1, 1)
    cond = {"first_frame": torch.full((1, 2, 1, 1, 1), 7.0)}
    out = trainer.sample_flow(model_fn, noise, torch.tensor([1.0, 0.0]), cond, dict(cond), 1.0)
    assert [n for n, _ in calls] == [10, 10, 3]
    assert out[0, 0, 1:, 0, 0].tolist() == [1.0] * 9 + [2.0] * 9 + [3.0] * 2
    history = [h[0, 0, :, 0, 0].tolist() for _, h in calls]
    assert history[0] == [0.0] * 18 + [7.0]
    assert history[1] == [0.0] * 9 + [7.0] + [1.0] * 9
    assert history[2] == [7.0] + [1.0] * 9 + [2.0] * 9


def test_f1_latents_of_a_clip_are_its_last_section_and_the_frames_before(pipe):
    """A 45-frame clip (12 latent frames): the image's slot and the last 9 frames (3-11); the history is 16
    zeros then latent frames 0-2, oldest first."""
    from tuner.archs.framepack.trainer import FramePackF1Model

    trainer = FramePackF1Model(SimpleNamespace())
    encoders = LatentEncoders(pipe.vae, framepack.ImageEncoder(pipe.image_encoder, pipe.feature_extractor))
    pixels = torch.rand(1, 3, 45, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    entry = trainer.encode_latents(encoders, pixels, [])
    clip = hv.encode_video(pipe.vae, pixels)
    torch.testing.assert_close(entry["latents"], torch.cat([clip[:, :, :1], clip[:, :, 3:]], dim=2))
    assert entry["history"].shape[2] == 19 and entry["history"][:, :, :16].abs().max() == 0
    torch.testing.assert_close(entry["history"][:, :, 16:], clip[:, :, :3])
