"""Wan 2.1 VACE (`wan_vace`): both layouts of the transformer, wrong files named (variants from shapes:
test_wan_models.py),
the control branch's inputs and `tuner generate` with a control video against diffusers' WanVACEPipeline,
and the adapter's ComfyUI names of the control branch.

The contract suite (test_contract*.py) runs the architecture's user paths on its fixture.
"""

import numpy as np
import pytest
import torch
from diffusers import WanVACEPipeline
from PIL import Image
from safetensors.torch import load_file, save_file

from project import cfg, make_project, run
from tuner.archs.wan import loaders as wan
from tuner.archs.wan.keys import original_module_name
from tuner.data.media import read_video_frames, to_tensor
from tuner.errors import CheckpointError
from tuner.fixtures import write_fixture
from tuner.generate import GenerateOptions, encode_conditions, load_control, sample_latents
from tuner.registry import ARCHITECTURES
from tuner.trainers import trainer_class

FRAMES, WIDTH, HEIGHT = 9, 64, 48


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_vace")
    paths = write_fixture("wan_vace", root / "model")
    config = make_project(root / "project", root / "model", architecture="wan_vace")
    return config, paths


@pytest.fixture(scope="module")
def pipe(project):
    _, paths = project
    pipe = WanVACEPipeline.from_pretrained(paths["diffusers"], local_files_only=True)
    for part in (pipe.transformer, pipe.vae, pipe.text_encoder):
        part.eval()
    return pipe


def _control_video(config) -> str:
    return str(config.parent / "data" / "control_videos" / "video_000.mp4")


# --- loading -------------------------------------------------------------------------------------


def test_every_layout_loads_the_same_vace_transformer(project, tmp_path):
    """The release single file, the same with ComfyUI's prefix, and the diffusers folder give identical
    WanVACETransformer3DModel weights (`before_proj` / `after_proj` are `proj_in` / `proj_out`)."""
    _, paths = project
    single = wan.load_transformer(paths["transformer_file"], torch.float32, "wan_vace")
    assert type(single).__name__ == "WanVACETransformer3DModel"
    prefixed = tmp_path / "comfy.safetensors"
    save_file(
        {f"model.diffusion_model.{k}": v for k, v in load_file(paths["transformer_file"]).items()}, prefixed
    )
    for other in (paths["diffusers"], prefixed):
        theirs = wan.load_transformer(other, torch.float32, "wan_vace").state_dict()
        ours = single.state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    keys = load_file(paths["transformer_file"])
    assert "vace_blocks.0.before_proj.weight" in keys and "vace_blocks.1.after_proj.weight" in keys
    assert "vace_blocks.1.before_proj.weight" not in keys  # only the first VACE block projects its input


def test_wrong_files_name_the_architecture_to_use(project, wan_model):
    _, paths = project
    with pytest.raises(CheckpointError, match='VACE test transformer.*use architecture = "wan_vace"'):
        wan.load_transformer(paths["transformer_file"], torch.float32, "wan")
    with pytest.raises(CheckpointError, match='VACE test transformer.*use architecture = "wan_vace"'):
        wan.load_transformer(paths["diffusers"], torch.float32, "wan_i2v")
    with pytest.raises(CheckpointError, match='use architecture = "wan"'):
        wan.load_transformer(wan_model / "single" / "wan2.1_t2v_tiny.safetensors", torch.float32, "wan_vace")
    with pytest.raises(CheckpointError, match="Wan 2.1 VACE 14B.*wan_vace"):
        wan.check_variant("vace-14B", "wan", "x.safetensors")


# --- the control branch's inputs are the pipeline's ----------------------------------------------


def _mask_frames() -> list[Image.Image]:
    """A mask video: white (generate) over the right half and the last frames' bottom rows, else black."""
    frames = []
    for f in range(FRAMES):
        mask = np.zeros((HEIGHT, WIDTH, 3), dtype=np.uint8)
        mask[:, WIDTH // 2 :] = 255
        if f >= 5:
            mask[HEIGHT - 16 :] = 255
        frames.append(Image.fromarray(mask))
    return frames


@pytest.mark.parametrize("masked", [False, True], ids=["whole", "mask"])
def test_control_latents_and_prediction_match_the_pipeline(project, pipe, masked):
    """The cached controls (`control_encoder`: the kept and generated parts' latents, the packed mask, or
    ones made when predicting without one) equal WanVACEPipeline's `prepare_video_latents` +
    `prepare_masks`, and `predict` its transformer call."""
    config, _ = project
    trainer = trainer_class("wan_vace")(cfg(config))
    control = load_control(_control_video(config), WIDTH, HEIGHT, FRAMES).unsqueeze(0)
    masks = _mask_frames() if masked else None
    controls = [control] + (
        [to_tensor(np.stack([np.asarray(m) for m in masks])).unsqueeze(0)] if masked else []
    )
    frames = [Image.fromarray(f) for f in _frames(config)]
    with torch.no_grad():
        mine = trainer.encode_latents(pipe.vae, control, controls)
        video, mask, refs = pipe.preprocess_conditions(frames, masks, None, 1, HEIGHT, WIDTH, FRAMES, torch.float32, "cpu")  # fmt: skip
        latents = pipe.prepare_video_latents(video, mask, refs, None, "cpu")
        packed = pipe.prepare_masks(mask, refs, None)
        theirs = torch.cat([latents, packed], dim=1)
    assert mine["control_0"].shape[1] == 32 and theirs.shape[1] == 96
    torch.testing.assert_close(mine["control_0"], latents, rtol=0, atol=1e-5)
    assert ("control_1" in mine) == masked
    if masked:
        torch.testing.assert_close(mine["control_1"], packed, rtol=0, atol=0)
        assert 0 < packed.mean() < 1
    noise = torch.randn(1, 16, *latents.shape[2:], generator=torch.Generator().manual_seed(0))
    text = trainer.collate_text(trainer.encode_text((pipe.text_encoder, pipe.tokenizer), ["a red circle"]))
    t = torch.tensor([0.6])
    with torch.no_grad():
        got = trainer.predict(pipe.transformer, noise, t, {**text, **mine})
        want = pipe.transformer(hidden_states=noise, timestep=t * 1000, encoder_hidden_states=text["context"],
                                control_hidden_states=theirs, return_dict=False)[0]  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _frames(config) -> np.ndarray:
    return read_video_frames(_control_video(config), list(range(FRAMES)))


@pytest.mark.parametrize("masked", [False, True], ids=["whole", "mask"])
def test_generate_with_a_control_video_equals_the_pipeline(project, pipe, monkeypatch, masked):
    """`tuner generate --control VIDEO [--control MASK]`'s conditions and sampling (control latents and
    mask, CFG, Euler on the shifted levels) give WanVACEPipeline's latents, its scheduler set to the same
    levels and given tuner's text embeddings (they equal the pipeline's: test_wan_models.py; its prompt
    cleaning needs ftfy). The mask here is the gray control video itself (white where it is bright)."""
    config, _ = project
    c = cfg(config)
    family = ARCHITECTURES["wan_vace"].family_model(c)
    controls = (_control_video(config),) * (2 if masked else 1)
    opts = GenerateOptions(prompt="a red circle", negative_prompt="blurry", out="x.mp4", controls=controls,
                           width=WIDTH, height=HEIGHT, frames=FRAMES, steps=3, device="cpu")  # fmt: skip
    cpu = torch.device("cpu")
    cond, uncond = encode_conditions(family, c, opts, cpu)
    with torch.no_grad():
        ours = sample_latents(
            family, pipe.transformer, opts, cond, uncond, cpu, torch.float32, progress=False
        )
    # the pipeline on the same levels: tuner's unshifted grid, shifted by its scheduler (shift 3)
    from diffusers import FlowMatchEulerDiscreteScheduler

    monkeypatch.setattr(
        pipe, "scheduler", FlowMatchEulerDiscreteScheduler(shift=family.sampling_defaults().shift)
    )
    set_timesteps = pipe.scheduler.set_timesteps
    grid = np.linspace(1.0, 0.0, opts.steps + 1)[:-1]
    monkeypatch.setattr(
        pipe.scheduler, "set_timesteps", lambda n, device=None: set_timesteps(sigmas=grid, device=device)
    )
    noise = torch.randn(
        (1, *family.latent_shape(WIDTH, HEIGHT, FRAMES)), generator=torch.Generator().manual_seed(0)
    )
    # the text embeddings: the pipeline's own (test_wan_models.py), here given as tuner computed them
    theirs = pipe(prompt_embeds=cond["context"], negative_prompt_embeds=uncond["context"],
                  video=[Image.fromarray(f) for f in _frames(config)],
                  mask=[Image.fromarray(f) for f in _frames(config)] if masked else None, height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=opts.steps,
                  guidance_scale=family.sampling_defaults().guidance, latents=noise, output_type="latent").frames  # fmt: skip
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_control_video_shorter_than_the_clip_is_refused(project):
    config, _ = project
    with pytest.raises(Exception, match="control video has 24 frames; --frames 29"):
        load_control(_control_video(config), WIDTH, HEIGHT, 29)


def test_a_video_item_with_a_control_image_is_refused(tmp_path, project, capsys):
    """A video item takes a control video; a control image (one frame) is refused while caching, naming
    what each kind of item takes."""
    _, paths = project
    config = make_project(tmp_path / "p", paths["root"], architecture="wan_vace")
    controls = config.parent / "data" / "control_videos"
    for video in controls.glob("*.mp4"):
        Image.fromarray(read_video_frames(video, [0])[0]).save(video.with_suffix(".png"))
        video.unlink()
    code, log = run(capsys, "cache", "latents", "--config", config)
    assert code != 0 and "a video item takes a control video" in log, log


@pytest.mark.slow
def test_an_item_with_a_mask_video_caches_and_trains(tmp_path, project, capsys):
    """`name_0` (the control video) and `name_1` (the mask video) in the control folder: the item caches
    its packed mask as `control_1`, and training runs on batches with and without one."""
    import shutil

    from tuner.cache.plan import open_training_data

    _, paths = project
    config = make_project(tmp_path / "p", paths["root"], architecture="wan_vace")
    controls = config.parent / "data" / "control_videos"
    video = controls / "video_000.mp4"
    shutil.copy(video, controls / "video_000_1.mp4")  # the gray video as its own mask
    video.rename(controls / "video_000_0.mp4")
    for command in ("latents", "text"):
        code, log = run(capsys, "cache", command, "--config", config)
        assert code == 0, log
    trainer = trainer_class("wan_vace")(cfg(config))
    batches = list(open_training_data(trainer, trainer.cfg, log=lambda s: None).epoch(0))
    masks = [b["extra"]["control_1"] for b in batches if "control_1" in b["extra"]]
    assert len(masks) == 1 and masks[0].shape[:2] == (1, 64)
    assert all(b["extra"]["control_0"].shape[1] == 32 for b in batches)
    code, log = run(capsys, "train", "--config", config, "--set", f"save.output_dir='{tmp_path / 'out'}'",
                    "--set", "train.max_steps=4")  # fmt: skip
    assert code == 0, log


# --- adapters ------------------------------------------------------------------------------------


def test_the_control_branch_exports_to_the_release_names(project):
    """Every default target exports to a weight of the release single file (`vace_blocks.N.before_proj`,
    `.self_attn.q`, ...), the names ComfyUI's Wan key map reads (`diffusion_model.` + the model's keys)."""
    _, paths = project
    record = ARCHITECTURES["wan_vace"]
    from tuner.networks.targets import TargetSpec, find_targets

    model = wan.load_transformer(paths["transformer_file"], torch.float32, "wan_vace")
    names = find_targets(model, TargetSpec(record.default_targets))
    weights = set(load_file(paths["transformer_file"]))
    exported = {original_module_name(n) + ".weight" for n in names}
    assert exported <= weights
    assert {"vace_blocks.0.before_proj.weight", "vace_blocks.1.after_proj.weight",
            "vace_blocks.0.self_attn.q.weight", "blocks.1.ffn.2.weight"} <= exported  # fmt: skip
