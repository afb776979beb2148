"""HunyuanVideo 1.5 loading, key layout and model inputs, checked against diffusers' HunyuanVideo15Pipeline
on the tiny fixture.

diffusers has no HunyuanVideo 1.5 LoRA loader (`HunyuanVideo15Pipeline` has no `load_lora_weights`) and no
single-file converter for it, so adapters are checked against the release's names (the contract suite:
every exported key names a weight of ComfyUI's single file; test_hunyuan_video15_layouts.py: ComfyUI's
key rules) and the layouts against the key names of Tencent's and Comfy-Org's files pinned below.
"""

import pytest
import torch
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts

from project import assert_equal_weights
from tuner.archs.hunyuan_video15 import loaders as hv
from tuner.archs.hunyuan_video15.keys import HUNYUAN_VIDEO15_LAYOUT, TENCENT_LAYOUT
from tuner.errors import CheckpointError
from tuner.fixtures import write_fixture
from tuner.io import save_safetensors
from tuner.models.identify import pick_variant
from tuner.models.loading import load_tensors, read_tensor_shapes

CAPTIONS = ['a neon sign that reads "OPEN" glows at night', "a dog runs", '“Hi” and "bye" and "Hi"']
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_fixture("hunyuan_video15", tmp_path_factory.mktemp("hunyuan_video15_model"))


@pytest.fixture(scope="module")
def pipe(paths):
    return HunyuanVideo15Pipeline.from_pretrained(paths["diffusers"])  # models in eval mode


def _single_encoders(paths) -> hv.TextEncoders:
    return hv.load_text_encoders(paths["text_encoder_file"], paths["text_encoder_2_file"], paths["tokenizer"],
                                 paths["tokenizer_2"], torch.float32)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Loading both layouts
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_files_load_like_the_diffusers_folder(paths, dtype):
    root = paths["diffusers"]
    folder = hv.load_transformer(root, dtype)
    assert_equal_weights(
        hv.load_transformer(paths["transformer_file"], dtype), folder
    )  # ComfyUI's: fused q/k/v
    assert_equal_weights(hv.load_transformer(paths["tencent_transformer_file"], dtype), folder)  # separate
    assert_equal_weights(hv.load_vae(paths["vae_file"], dtype), hv.load_vae(root, dtype))
    single = _single_encoders(paths)
    folder = hv.load_text_encoders(root, None, None, None, torch.float32)  # ByT5 found beside Qwen
    assert_equal_weights(single.qwen, folder.qwen)
    assert_equal_weights(single.byt5, folder.byt5)
    for a, b in (
        (single.qwen_tokenizer, folder.qwen_tokenizer),
        (single.byt5_tokenizer, folder.byt5_tokenizer),
    ):
        assert a("a red car").input_ids == b("a red car").input_ids


@pytest.mark.parametrize(
    ("file", "qkv", "absent"),
    [("transformer_file", ("img_attn_qkv.weight", "txt_attn_qkv.bias"), "img_attn_q.weight"),  # ComfyUI's
     ("tencent_transformer_file", ("img_attn_q.weight", "txt_attn_v.bias"), "img_attn_qkv.weight")],
)  # fmt: skip
def test_single_files_use_the_release_key_names(paths, file, qkv, absent):
    keys = set(read_tensor_shapes(paths[file]))
    assert f"double_blocks.0.{absent}" not in keys
    for name in (*(f"double_blocks.0.{k}" for k in qkv),
                 "double_blocks.0.img_attn_q_norm.weight", "double_blocks.0.txt_mlp.fc2.weight",
                 "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight", "byt5_in.layernorm.weight",
                 "byt5_in.fc3.weight", "vision_in.proj.4.bias", "cond_type_embedding.weight",
                 "final_layer.adaLN_modulation.1.weight", "time_in.mlp.2.weight"):  # fmt: skip
        assert name in keys, name
    assert not any("transformer_blocks" in k for k in keys)
    vae = set(read_tensor_shapes(paths["vae_file"]))
    for name in ("encoder.down.0.block.0.conv1.conv.weight", "encoder.down.0.downsample.conv.conv.weight",
                 "decoder.up.0.upsample.conv.conv.weight", "encoder.mid.attn_1.q.weight",
                 "decoder.mid.block_2.norm2.gamma"):  # fmt: skip
        assert name in vae, name


def test_final_modulation_halves_are_swapped(paths):
    single = load_tensors(paths["transformer_file"])["final_layer.adaLN_modulation.1.weight"]
    folder = hv.load_transformer(paths["diffusers"], torch.float32).state_dict()["norm_out.linear.weight"]
    assert torch.equal(single, torch.cat(folder.chunk(2)[::-1]))


@pytest.mark.parametrize("file", ["transformer_file", "tencent_transformer_file"])
@pytest.mark.parametrize("prefix", ["model.diffusion_model.", "diffusion_model."])
def test_comfyui_prefix_and_fp8_files_load(paths, tmp_path, prefix, file):
    reference = hv.load_transformer(paths["diffusers"], torch.float32).state_dict()
    fp8 = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}
    for key, value in load_tensors(paths[file]).items():
        if key.endswith(".weight") and value.ndim == 2:
            scale = value.abs().max() / 448
            fp8[f"{prefix}{key}"] = (value / scale).to(torch.float8_e4m3fn)
            fp8[f"{prefix}{key.removesuffix('.weight')}.scale_weight"] = scale.reshape(1)
        else:
            fp8[f"{prefix}{key}"] = value
    save_safetensors(fp8, tmp_path / "fp8.safetensors")
    loaded = hv.load_transformer(tmp_path / "fp8.safetensors", torch.float32).state_dict()
    assert loaded.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(loaded[key], value, atol=0.07 * value.abs().max().item(), rtol=0)


def test_diffusers_layout_single_files_load(paths, tmp_path):
    folder = hv.load_transformer(paths["diffusers"], torch.float32)
    save_safetensors(folder.state_dict(), tmp_path / "transformer.safetensors")
    assert_equal_weights(hv.load_transformer(tmp_path / "transformer.safetensors", torch.float32), folder)
    vae = hv.load_vae(paths["diffusers"], torch.float32)
    save_safetensors(vae.state_dict(), tmp_path / "vae.safetensors")
    assert_equal_weights(hv.load_vae(tmp_path / "vae.safetensors", torch.float32), vae)


# ---------------------------------------------------------------------------------------------------
# Variants and wrong files
# ---------------------------------------------------------------------------------------------------


def test_shipped_signatures_fit_the_shipped_configs():
    def meta_state(model_cls, config_dir) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            return model_cls.from_config(model_cls.load_config(config_dir)).state_dict()

    def shapes(state) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in state.items()}

    real = ["480p_t2v", "720p_t2v", "480p_i2v", "720p_i2v"]
    for name in [*real, "tiny", "tiny_i2v"]:  # every shipped config has the shapes of one variant
        state = meta_state(HunyuanVideo15Transformer3DModel, hv.CONFIGS / "transformer" / name)
        want = "8.3B" if name in real else "tiny"
        for layout in (HUNYUAN_VIDEO15_LAYOUT, TENCENT_LAYOUT):
            original = shapes(layout.to_original(state))
            assert pick_variant(original, hv.TRANSFORMER_VARIANTS, "x", "transformer").name == want
    for variant in hv.VAE_VARIANTS:
        state = shapes(meta_state(AutoencoderKLHunyuanVideo15, variant.config_dir))
        original = {hv.vae_key_to_original(k): v for k, v in state.items()}
        assert pick_variant(original, hv.VAE_VARIANTS, "x", "VAE") is variant


@pytest.mark.parametrize(
    ("name", "task", "config"),
    [("hunyuanvideo1.5_720p_t2v_fp16.safetensors", "t2v", "720p_t2v"),
     ("480p_i2v/diffusion_pytorch_model.safetensors", "i2v", "480p_i2v"),
     ("hunyuanvideo1.5_t2v_bf16.safetensors", "t2v", "480p_t2v")],
)  # fmt: skip
def test_real_config_is_picked_by_name(name, task, config):
    """The four real networks have the same shapes: resolution comes from the name, task from the arch."""
    real = hv.TRANSFORMER_VARIANTS[0]
    assert hv.transformer_config(name, real, task) == hv.CONFIGS / "transformer" / config


def test_file_named_for_the_other_task_is_refused(paths, tmp_path):
    i2v = tmp_path / "hunyuanvideo1.5_480p_i2v_fp16.safetensors"
    i2v.symlink_to(paths["transformer_file"])
    with pytest.raises(CheckpointError, match="hunyuan_video15_i2v"):
        hv.load_transformer(i2v, torch.float32, "t2v")


def test_hunyuan_video_1_file_is_refused_naming_hunyuan_video(tmp_path):
    """Told by its single-stream blocks: its double blocks fuse q/k/v as ComfyUI's 1.5 files do."""
    save_safetensors({"double_blocks.0.img_attn_qkv.weight": torch.zeros(96, 32),
                      "single_blocks.0.linear1.weight": torch.zeros(160, 32),
                      "img_in.proj.weight": torch.zeros(32, 16, 1, 2, 2)}, tmp_path / "hv1.safetensors")  # fmt: skip
    with pytest.raises(CheckpointError, match='"hunyuan_video"'):
        hv.load_transformer(tmp_path / "hv1.safetensors", torch.float32)


# ---------------------------------------------------------------------------------------------------
# Model inputs against the pipeline
# ---------------------------------------------------------------------------------------------------


def test_tiny_tokenizer_crops_the_template_where_the_real_one_does(pipe):
    """The template's tokens before the prompt: 108 with the real Qwen2.5-VL tokenizer (the pipeline's
    `prompt_template_encode_start_idx`), and as many with the fixture's."""
    chat = [{"role": "system", "content": pipe.system_message}, {"role": "user", "content": "dog"}]
    ids = pipe.tokenizer.apply_chat_template(
        [chat], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert chat[0]["content"] == hv.SYSTEM_MESSAGE
    assert (
        len(ids["input_ids"][0]) == hv.CROP_START + 1 + 5
    )  # "dog", then <|im_end|>\n<|im_start|>assistant\n
    assert pipe.prompt_template_encode_start_idx == hv.CROP_START


def test_glyph_text_matches_the_pipeline():
    for caption in [*CAPTIONS, "no quotes", '"a" "b" "a"']:
        assert hv.glyph_text(caption) == extract_glyph_texts(caption), caption


def test_encode_prompts_match_the_pipeline(paths, pipe):
    entries = hv.encode_prompts(_single_encoders(paths), CAPTIONS)
    text, mask, glyph, glyph_mask = pipe.encode_prompt(CAPTIONS, device="cpu", dtype=torch.float32,
                                                       batch_size=len(CAPTIONS))  # fmt: skip
    assert text.shape[1] == hv.MAX_LENGTH and glyph.shape[1] == hv.GLYPH_MAX_LENGTH
    for entry, t, m, g, gm in zip(entries, text, mask, glyph, glyph_mask):
        torch.testing.assert_close(entry["text"], t[m.bool()], **TOLERANCE)
        torch.testing.assert_close(entry["glyph"], g[gm.bool()], **TOLERANCE)
    assert entries[1]["glyph"].shape[0] == 0 and entries[0]["glyph"].shape[0] > 0


def test_predict_matches_the_pipeline_transformer_call(paths, pipe):
    """Our call (text at its true length, the zero first-frame condition and image tokens built in
    `predict_velocity`) against the pipeline's (text padded to 1000 / 256 tokens)."""
    entries = hv.encode_prompts(_single_encoders(paths), CAPTIONS)
    text, mask, glyph, glyph_mask = pipe.encode_prompt(CAPTIONS, device="cpu", dtype=torch.float32,
                                                       batch_size=len(CAPTIONS))  # fmt: skip
    noisy = torch.randn(len(CAPTIONS), 32, 2, 2, 3, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.9, 0.5, 0.2])
    model = hv.load_transformer(paths["transformer_file"], torch.float32)
    with torch.no_grad():
        ours = hv.predict_velocity(model, noisy, t, hv.collate(entries))
        cond, frame_mask = pipe.prepare_cond_latents_and_mask(noisy, torch.float32, "cpu")
        image_embeds = torch.zeros(len(CAPTIONS), pipe.vision_num_semantic_tokens, pipe.vision_states_dim)
        theirs = pipe.transformer(
            hidden_states=torch.cat([noisy, cond, frame_mask], dim=1), image_embeds=image_embeds,
            timestep=t * 1000, encoder_hidden_states=text, encoder_attention_mask=mask,
            encoder_hidden_states_2=glyph, encoder_attention_mask_2=glyph_mask, return_dict=False,
        )[0]  # fmt: skip
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_encode_video_and_decode_latents(paths, pipe):
    video = torch.rand(2, 3, 5, 32, 48, generator=torch.Generator().manual_seed(1)) * 2 - 1
    vae = hv.load_vae(paths["vae_file"], torch.float32)
    latents = hv.encode_video(vae, video)
    assert latents.shape == (2, 32, 2, 2, 3)
    with torch.no_grad():
        first = pipe.vae.encode(video[:1]).latent_dist.mode() * pipe.vae.config.scaling_factor
        torch.testing.assert_close(latents[:1], first, **TOLERANCE)
        decoded = hv.decode_latents(vae, latents)
        torch.testing.assert_close(decoded[1:], pipe.vae.decode(latents[1:] / pipe.vae.config.scaling_factor).sample,
                                   **TOLERANCE)  # fmt: skip
    assert decoded.shape == video.shape


# ---------------------------------------------------------------------------------------------------
# Image to video
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def i2v_paths(tmp_path_factory):
    return write_fixture("hunyuan_video15_i2v", tmp_path_factory.mktemp("hunyuan_video15_i2v_model"))


@pytest.fixture(scope="module")
def i2v_pipe(i2v_paths):
    return HunyuanVideo15ImageToVideoPipeline.from_pretrained(i2v_paths["diffusers"])


def test_i2v_single_files_load_like_the_diffusers_folder(i2v_paths):
    from tuner.archs.hunyuan_video15 import siglip

    root = i2v_paths["diffusers"]
    single = hv.load_transformer(i2v_paths["transformer_file"], torch.float32, "i2v")
    assert_equal_weights(single, hv.load_transformer(root, torch.float32, "i2v"))
    assert single.config.task_type == "i2v"
    assert_equal_weights(siglip.load_image_encoder(i2v_paths["image_encoder_file"], torch.float32).model,
                  siglip.load_image_encoder(root, torch.float32).model)  # fmt: skip
    with pytest.raises(CheckpointError, match='"hunyuan_video15_i2v"'):  # an I2V file trains as I2V only
        hv.load_transformer(i2v_paths["transformer_file"], torch.float32, "t2v")


def test_t2v_file_is_refused_by_i2v(paths):
    with pytest.raises(CheckpointError, match='"hunyuan_video15"'):
        hv.load_transformer(paths["transformer_file"], torch.float32, "i2v")


def test_i2v_inputs_match_the_pipeline(i2v_paths, i2v_pipe):
    """The first frame's latent and SigLIP tokens, the condition channels and the transformer call, against
    HunyuanVideo15ImageToVideoPipeline's `_get_image_latents`, `_get_image_embeds`,
    `prepare_cond_latents_and_mask` and its transformer call."""
    from PIL import Image

    from tuner.archs.hunyuan_video15 import siglip

    pixels = torch.randint(0, 256, (32, 48, 3), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    image = Image.fromarray(pixels.numpy())
    frame = pixels.permute(2, 0, 1)[None].float() / 127.5 - 1  # [1, 3, H, W] in [-1, 1]
    vae = hv.load_vae(i2v_paths["diffusers"], torch.float32)
    encoder = siglip.load_image_encoder(i2v_paths["image_encoder_file"], torch.float32)
    image_latents = hv.encode_video(vae, frame[:, :, None])
    image_embeds = encoder.encode(frame)
    noisy = torch.randn(1, 32, 2, 2, 3, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs_latents = i2v_pipe._get_image_latents(
            i2v_pipe.vae, i2v_pipe.video_processor, image, 32, 48, "cpu"
        )
        theirs_embeds = i2v_pipe._get_image_embeds(
            i2v_pipe.image_encoder, i2v_pipe.feature_extractor, image, "cpu"
        )
        cond, mask = i2v_pipe.prepare_cond_latents_and_mask(noisy, image, 1, 32, 48, torch.float32, "cpu")
    torch.testing.assert_close(image_latents, theirs_latents, **TOLERANCE)
    torch.testing.assert_close(image_embeds, theirs_embeds, **TOLERANCE)
    frame_cond = hv.first_frame_condition(image_latents, noisy)
    torch.testing.assert_close(frame_cond, torch.cat([cond, mask], dim=1), **TOLERANCE)

    entries = hv.encode_prompts(_single_encoders_of(i2v_paths), CAPTIONS[:1])
    text, text_mask, glyph, glyph_mask = i2v_pipe.encode_prompt(
        CAPTIONS[:1], device="cpu", dtype=torch.float32
    )
    model = hv.load_transformer(i2v_paths["transformer_file"], torch.float32, "i2v")
    t = torch.tensor([0.7])
    with torch.no_grad():
        ours = hv.predict_velocity(model, noisy, t, {**hv.collate(entries), "cond_latents": frame_cond,
                                                     "image_embeds": image_embeds})  # fmt: skip
        theirs = i2v_pipe.transformer(
            hidden_states=torch.cat([noisy, cond, mask], dim=1), image_embeds=theirs_embeds, timestep=t * 1000,
            encoder_hidden_states=text, encoder_attention_mask=text_mask, encoder_hidden_states_2=glyph,
            encoder_attention_mask_2=glyph_mask, return_dict=False,
        )[0]  # fmt: skip
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def _single_encoders_of(paths) -> hv.TextEncoders:
    return hv.load_text_encoders(paths["diffusers"], None, None, None, torch.float32)
