"""Qwen-Image / Edit: loading (both layouts), clear errors, and model inputs equal to diffusers' pipelines."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKLQwenImage,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from PIL import Image
from safetensors.torch import load_file, save_file

from tuner.archs.qwen_image import loaders as qwen_image
from tuner.archs.qwen_image import text as qwen_image_text
from tuner.archs.qwen_image.fixture import write_qwen_image_fixture
from tuner.archs.qwen_image.trainer import QwenImageEditModel, QwenImageModel
from tuner.archs.wan.keys import vae_key_to_original
from tuner.errors import CheckpointError
from tuner.models.identify import pick_variant
from tuner.registry import ARCHITECTURES

CAPTIONS = ["a red circle moving left", "a small dog walks on the beach at sunset"]


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return write_qwen_image_fixture(tmp_path_factory.mktemp("qwen_image"), seed=0)


@pytest.fixture(scope="module")
def pipe(fx):
    pipe = QwenImagePipeline.from_pretrained(fx["diffusers"])
    for part in (pipe.transformer, pipe.vae, pipe.text_encoder):
        part.eval()
    return pipe


@pytest.fixture(scope="module")
def encoder(fx):
    return qwen_image_text.load_text_encoder(fx["diffusers"], None, torch.float32)


@pytest.fixture
def edit_pipe(pipe, encoder, monkeypatch):
    """QwenImageEditPlusPipeline on the fixture's components, with diffusers issue #14194 fixed: the
    text encoder gets `mm_token_type_ids`, as transformers 5 needs for the image tokens' positions."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    # transformers' class check wants torchvision's video processor class even for video_processor=None
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg))
    processor = Qwen2VLProcessor(image_processor=encoder.image_processor, tokenizer=pipe.tokenizer)
    image_token = pipe.text_encoder.config.image_token_id

    def pass_token_types(module, args, kwargs):
        kwargs["mm_token_type_ids"] = (kwargs["input_ids"] == image_token).int()
        return args, kwargs

    hook = pipe.text_encoder.register_forward_pre_hook(pass_token_types, with_kwargs=True)
    parts = {k: getattr(pipe, k) for k in ("scheduler", "vae", "text_encoder", "tokenizer", "transformer")}
    yield QwenImageEditPlusPipeline(**parts, processor=processor)
    hook.remove()


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key], sb[key]), key


def images(seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((48, 64), (64, 32))]


# ---------------------------------------------------------------------------------------------------
# Both layouts load the same weights
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformer_layouts_are_identical(fx, dtype, tmp_path):
    folder = qwen_image.load_transformer(fx["diffusers"], dtype)
    assert isinstance(folder, QwenImageTransformer2DModel) and not folder.config.zero_cond_t
    assert_same_weights(folder, qwen_image.load_transformer(fx["diffusers"] / "transformer", dtype))
    assert_same_weights(folder, qwen_image.load_transformer(fx["transformer_file"], dtype))
    prefixed = tmp_path / "qwen_image_bf16.safetensors"  # ComfyUI checkpoints carry a prefix
    save_file(
        {"model.diffusion_model." + k: v for k, v in load_file(fx["transformer_file"]).items()}, prefixed
    )
    assert_same_weights(folder, qwen_image.load_transformer(prefixed, dtype))


def test_edit_2511_marker_selects_zero_cond_t(fx, tmp_path):
    # ComfyUI's Qwen-Image-Edit-2511 files carry an empty `__index_timestep_zero__` tensor
    path = tmp_path / "qwen_image_edit_2511_bf16.safetensors"
    save_file({**load_file(fx["transformer_file"]), "__index_timestep_zero__": torch.zeros(0)}, path)
    model = qwen_image.load_transformer(path, torch.float32)
    assert model.config.zero_cond_t and model.transformer_blocks[0].zero_cond_t
    assert_same_weights(model, qwen_image.load_transformer(fx["transformer_file"], torch.float32))
    trainer = QwenImageEditModel.__new__(QwenImageEditModel)
    cond = {"prompt_embeds": torch.randn(1, 5, 64), "control_0": torch.randn(1, 16, 1, 4, 6)}
    with torch.no_grad():
        assert trainer.predict(model, torch.randn(1, 16, 1, 4, 6), torch.tensor([0.5]), cond).shape == (
            1,
            16,
            1,
            4,
            6,
        )


def test_vae_layouts_are_identical(fx, tmp_path):
    folder = qwen_image.load_vae(fx["diffusers"], torch.float32)
    assert isinstance(folder, AutoencoderKLQwenImage)
    assert_same_weights(folder, qwen_image.load_vae(fx["vae_file"], torch.float32))
    in_diffusers_keys = fx["diffusers"] / "vae" / "diffusion_pytorch_model.safetensors"
    assert_same_weights(folder, qwen_image.load_vae(in_diffusers_keys, torch.float32))
    assert "encoder.conv1.weight" in load_file(fx["vae_file"])  # the single file is in Wan's original keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_text_encoder_layouts_are_identical(fx, dtype, tmp_path):
    folder = qwen_image_text.load_text_encoder(fx["diffusers"], None, dtype)
    single = qwen_image_text.load_text_encoder(fx["text_encoder_file"], fx["tokenizer"], dtype)
    assert single.model.dtype == dtype
    assert_same_weights(folder.model, single.model)
    without_head = tmp_path / "no_lm_head.safetensors"
    save_file(
        {k: v for k, v in load_file(fx["text_encoder_file"]).items() if k != "lm_head.weight"}, without_head
    )
    assert_same_weights(
        folder.model, qwen_image_text.load_text_encoder(without_head, fx["tokenizer"], dtype).model
    )
    saved_by_transformers = fx["diffusers"] / "text_encoder" / "model.safetensors"  # model.language_model.*
    assert_same_weights(
        folder.model, qwen_image_text.load_text_encoder(saved_by_transformers, fx["tokenizer"], dtype).model
    )
    caption = "a dog runs on the beach"
    assert folder.tokenizer(caption).input_ids == single.tokenizer(caption).input_ids


def test_text_encoder_single_file_needs_a_tokenizer(fx):
    with pytest.raises(CheckpointError, match="tokenizer"):
        qwen_image_text.load_text_encoder(fx["text_encoder_file"], None, torch.float32)


# ---------------------------------------------------------------------------------------------------
# Variants and clear errors
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", qwen_image.TRANSFORMER_VARIANTS, ids=lambda v: v.name)
def test_transformer_variant_picked_from_shapes(variant):
    with torch.device("meta"):
        model = QwenImageTransformer2DModel.from_config(
            QwenImageTransformer2DModel.load_config(variant.config_dir)
        )
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert pick_variant(shapes, qwen_image.TRANSFORMER_VARIANTS, "x.safetensors", "Qwen-Image") is variant


@pytest.mark.parametrize("variant", qwen_image.VAE_VARIANTS, ids=lambda v: v.name)
def test_vae_variant_picked_from_shapes(variant):
    with torch.device("meta"):
        model = AutoencoderKLQwenImage.from_config(AutoencoderKLQwenImage.load_config(variant.config_dir))
    shapes = {vae_key_to_original(k): tuple(v.shape) for k, v in model.state_dict().items()}
    assert pick_variant(shapes, qwen_image.VAE_VARIANTS, "vae.safetensors", "VAE") is variant


@pytest.mark.parametrize("variant", qwen_image_text.VARIANTS, ids=lambda v: v.name)
def test_text_encoder_variant_picked_from_shapes(variant):
    keys = qwen_image_text.SPEC.expected_keys(variant)
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "visual.patch_embed.proj.weight" in keys
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    with torch.device("meta"):
        model = Qwen2_5_VLModel(Qwen2_5_VLConfig.from_pretrained(variant.config_dir))
    shapes = {qwen_image_text.original_key(k): tuple(v.shape) for k, v in model.state_dict().items()}
    assert pick_variant(shapes, qwen_image_text.VARIANTS, "te.safetensors", "Qwen2.5-VL") is variant


def test_wan_transformer_given_as_qwen_image(wan_model):
    path = wan_model / "single" / "wan2.1_t2v_tiny.safetensors"
    with pytest.raises(
        CheckpointError, match=r"wan2\.1_t2v_tiny\.safetensors.*not a Qwen-Image transformer.*Wan"
    ):
        qwen_image.load_transformer(path, torch.float32)


def test_wrong_component_files(fx):
    with pytest.raises(CheckpointError, match=r"qwen_image_vae\.safetensors.*not a Qwen-Image transformer"):
        qwen_image.load_transformer(fx["vae_file"], torch.float32)
    with pytest.raises(
        CheckpointError, match=r"qwen_image_tiny\.safetensors.*not a Qwen-Image VAE.*Qwen-Image"
    ):
        qwen_image.load_vae(fx["transformer_file"], torch.float32)
    with pytest.raises(
        CheckpointError, match=r"qwen_image_tiny\.safetensors.*not a Qwen2\.5-VL text encoder"
    ):
        qwen_image_text.load_text_encoder(fx["transformer_file"], fx["tokenizer"], torch.float32)


def test_partial_transformer_file(fx, tmp_path):
    path = tmp_path / "partial.safetensors"
    tensors = load_file(fx["transformer_file"])
    save_file({k: v for k, v in tensors.items() if "txt_mlp" not in k}, path)
    with pytest.raises(CheckpointError, match=r"partial\.safetensors.*missing"):
        qwen_image.load_transformer(path, torch.float32)


def test_shipped_configs_have_the_real_sizes():
    big = QwenImageTransformer2DModel.load_config(qwen_image.TRANSFORMER_VARIANTS[0].config_dir)
    assert (big["num_layers"], big["num_attention_heads"] * big["attention_head_dim"]) == (60, 3072)
    assert sum(big["axes_dims_rope"]) == big["attention_head_dim"]
    with torch.device("meta"):  # 20.4B parameters, the published size
        model = QwenImageTransformer2DModel.from_config(big)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == 20.4


# ---------------------------------------------------------------------------------------------------
# Model inputs equal the pipelines'
# ---------------------------------------------------------------------------------------------------


def test_fixture_tokenizer_drops_what_the_real_one_drops(encoder):
    # The pipelines drop a fixed number of leading tokens (the template before the user's text).
    for template, drop in ((qwen_image_text.TEXT_TO_IMAGE_TEMPLATE, 34), (qwen_image_text.EDIT_TEMPLATE, 64)):
        assert len(encoder.tokenizer(template.split("{}")[0]).input_ids) == drop


def test_prompt_embeddings_equal_pipeline(pipe, encoder):
    embeds, mask = pipe.encode_prompt(CAPTIONS, device="cpu", max_sequence_length=512)
    rows = qwen_image_text.encode_prompts(encoder, CAPTIONS, max_length=512)
    assert [r.shape[0] for r in rows] == mask.sum(dim=1).tolist()
    for i, row in enumerate(rows):
        assert torch.equal(row, embeds[i, : row.shape[0]])
        assert not embeds[i, row.shape[0] :].any()
    assert qwen_image_text.encode_prompts(encoder, CAPTIONS[:1], max_length=7)[0].shape[0] == 7


def test_edit_prompt_embeddings_equal_pipeline(edit_pipe, encoder):
    controls = images()
    shown = [
        edit_pipe.image_processor.resize(im, *qwen_image_text.condition_size(*im.size)[::-1])
        for im in controls
    ]
    expected, mask = edit_pipe.encode_prompt(CAPTIONS[0], image=shown, device="cpu")
    assert mask is None
    rows = qwen_image_text.encode_edit_prompts(encoder, CAPTIONS, [controls, controls[:1]])
    assert torch.equal(rows[0], expected[0])
    alone, _ = edit_pipe.encode_prompt(CAPTIONS[1], image=shown[:1], device="cpu")
    torch.testing.assert_close(rows[1], alone[0], rtol=1e-5, atol=1e-5)  # batched with padding
    # without control images: the edit template alone, as the pipeline does for image=None
    text_only, _ = edit_pipe.encode_prompt(CAPTIONS[0], image=None, device="cpu")
    assert torch.equal(qwen_image_text.encode_edit_prompts(encoder, CAPTIONS[:1], [[]])[0], text_only[0])


def test_edit_controls_as_tensors(encoder):
    from tuner.data.media import to_tensor

    control = images()[0]
    as_tensor = to_tensor(np.asarray(control))  # [3, 1, H, W] in [-1, 1], as the data pipeline loads it
    a = qwen_image_text.encode_edit_prompts(encoder, ["a"], [[as_tensor]])[0]
    assert torch.equal(a, qwen_image_text.encode_edit_prompts(encoder, ["a"], [[control]])[0])


def test_latents_equal_pipeline(pipe, edit_pipe):
    pixels = torch.rand(2, 3, 1, 48, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = qwen_image.encode_images(pipe.vae, pixels)
    assert latents.shape == (2, 16, 1, 6, 8)
    assert torch.equal(latents, edit_pipe._encode_vae_image(pixels, generator=None))
    assert torch.equal(qwen_image.unpack_latents(qwen_image.pack_latents(latents), 6, 8), latents)
    assert qwen_image.decode_latents(pipe.vae, latents).shape == pixels.shape


def test_predict_equals_pipeline_transformer_call(pipe, encoder):
    trainer = QwenImageModel.__new__(QwenImageModel)
    cond = trainer.collate_text(
        [{"prompt_embeds": r} for r in qwen_image_text.encode_prompts(encoder, CAPTIONS)]
    )
    embeds, mask = pipe.encode_prompt(CAPTIONS, device="cpu")
    noisy = torch.randn(2, 16, 1, 6, 8, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        ours = trainer.predict(pipe.transformer, noisy, t, cond)
        # QwenImagePipeline's loop: packed latents, timestep = scheduler t / 1000, one img_shape per sample
        tokens = pipe._pack_latents(noisy, 2, 16, 6, 8)
        velocity = pipe.transformer(hidden_states=tokens, timestep=(t * 1000) / 1000, encoder_hidden_states=embeds,
                                    encoder_hidden_states_mask=mask, img_shapes=[[(1, 3, 4)]] * 2,
                                    return_dict=False)[0]  # fmt: skip
    assert torch.equal(ours, pipe._unpack_latents(velocity, 48, 64, 8))


def test_edit_predict_equals_pipeline_transformer_call(edit_pipe):
    trainer = QwenImageEditModel.__new__(QwenImageEditModel)
    gen = torch.Generator().manual_seed(2)
    noisy = torch.randn(1, 16, 1, 6, 8, generator=gen)
    controls = [torch.randn(1, 16, 1, 6, 8, generator=gen), torch.randn(1, 16, 1, 4, 10, generator=gen)]
    embeds = torch.randn(1, 9, 64, generator=gen)
    t = torch.tensor([0.6])
    cond = {
        **trainer.collate_text([{"prompt_embeds": embeds[0]}]),
        "control_0": controls[0],
        "control_1": controls[1],
    }
    with torch.no_grad():
        ours = trainer.predict(edit_pipe.transformer, noisy, t, cond)
        # QwenImageEditPlusPipeline: control tokens after the target's, each image its own img_shape
        tokens = torch.cat(
            [edit_pipe._pack_latents(x, 1, 16, *x.shape[-2:]) for x in (noisy, *controls)], dim=1
        )
        velocity = edit_pipe.transformer(
            hidden_states=tokens,
            timestep=t,
            encoder_hidden_states=embeds,
            img_shapes=[[(1, 3, 4), (1, 3, 4), (1, 2, 5)]],
            return_dict=False,
        )[0]
    assert torch.equal(ours, edit_pipe._unpack_latents(velocity[:, :12], 48, 64, 8))


def test_edit_fixture_is_an_edit_plus_pipeline_folder(tmp_path):
    import json

    paths = write_qwen_image_fixture(tmp_path, seed=0, edit=True)
    index = json.loads((paths["diffusers"] / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    assert (paths["diffusers"] / "processor" / "preprocessor_config.json").is_file()
    encoder = qwen_image_text.load_text_encoder(paths["diffusers"], None, torch.float32)
    assert encoder.image_processor.merge_size == 2 and encoder.image_processor.patch_size == 14


def test_saved_lora_loads_in_the_diffusers_pipeline(fx, pipe, tmp_path):
    """What training writes by default (the auto layout, comfy: `diffusion_model.` + release names, with
    `.alpha`) is what diffusers' Qwen-Image LoRA loader reads too, with the same result."""
    pytest.importorskip("peft")
    from tuner.networks.lora import LoRANetwork
    from tuner.networks.targets import TargetSpec
    from tuner.registry import resolve_save_format

    record = ARCHITECTURES["qwen_image"]
    model = qwen_image.load_transformer(fx["diffusers"], torch.float32)
    network = LoRANetwork.apply_to(
        model, TargetSpec(record.default_targets), rank=4, alpha=2, name_map=record.key_table()
    )
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    network.save(tmp_path / "lora.safetensors", format=resolve_save_format("qwen_image", "auto"))
    assert "diffusion_model.transformer_blocks.0.attn.to_q.alpha" in load_file(tmp_path / "lora.safetensors")
    trainer = QwenImageModel.__new__(QwenImageModel)
    noisy, t = torch.randn(1, 16, 1, 6, 8, generator=gen), torch.tensor([0.5])
    cond = {"prompt_embeds": torch.randn(1, 7, 64, generator=gen)}
    with torch.no_grad():
        ours = trainer.predict(model, noisy, t, cond)
        pipe.load_lora_weights(tmp_path / "lora.safetensors", adapter_name="tuner")
        try:
            theirs = trainer.predict(pipe.transformer, noisy, t, cond)
        finally:
            pipe.delete_adapters("tuner")
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_linear_modules_name_every_linear_layer():
    # the adapter key table (identity) must cover exactly the transformer's linear layers
    import re

    config = QwenImageTransformer2DModel.load_config(qwen_image.TRANSFORMER_VARIANTS[0].config_dir)
    with torch.device("meta"):
        model = QwenImageTransformer2DModel.from_config(config)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    patterns = [re.compile(re.escape(p).replace(r"\{i\}", r"\d+")) for p in qwen_image.LINEAR_MODULES]
    assert all(any(p.fullmatch(n) for p in patterns) for n in linears)
    assert all(any(p.fullmatch(n) for n in linears) for p in patterns)
