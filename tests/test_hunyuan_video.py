"""HunyuanVideo loading, key conversion, model inputs and LoRA interop, checked against diffusers on the
tiny fixture (and, where diffusers' converters hard-code the real width 3072, at that width)."""

import re
from types import SimpleNamespace

import pytest
import torch
from diffusers import HunyuanVideoPipeline, HunyuanVideoTransformer3DModel
from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

from project import assert_equal_weights
from tuner.archs.hunyuan_video import loaders as hv
from tuner.archs.hunyuan_video.keys import (
    HUNYUAN_VIDEO_LAYOUT,
    transformer_to_diffusers,
    transformer_to_original,
)
from tuner.errors import CheckpointError
from tuner.fixtures import write_fixture
from tuner.io import save_safetensors
from tuner.models.identify import pick_variant
from tuner.models.loading import load_tensors, read_tensor_shapes
from tuner.networks import LoRANetwork, TargetSpec
from tuner.networks.architectures import canonical_modules
from tuner.networks.delta import LORA, ModuleWeights
from tuner.networks.formats import layout_state, parse_modules
from tuner.networks.keys import ModuleNameIndex, read_safetensors
from tuner.registry import ARCHITECTURES, resolve_save_format

CAPTIONS = ["a dog runs", "a red car drives on the street at night while the rain falls"]
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_fixture("hunyuan_video", tmp_path_factory.mktemp("hunyuan_video_model"))


@pytest.fixture(scope="module")
def pipe(paths):
    pipe = HunyuanVideoPipeline.from_pretrained(paths["diffusers"])
    for component in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        component.eval()
    return pipe


def _single_encoders(paths) -> hv.TextEncoders:
    return hv.load_text_encoders(paths["text_encoder_file"], paths["text_encoder_2_file"], paths["tokenizer"],
                                 paths["tokenizer_2"], torch.float32)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Loading both layouts
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_files_load_like_the_diffusers_folder(paths, dtype):
    root = paths["diffusers"]
    assert_equal_weights(
        hv.load_transformer(paths["transformer_file"], dtype), hv.load_transformer(root, dtype)
    )
    assert_equal_weights(hv.load_vae(paths["vae_file"], dtype), hv.load_vae(root, dtype))
    single = _single_encoders(paths)
    folder = hv.load_text_encoders(root, None, None, None, torch.float32)  # CLIP found beside the Llama
    assert_equal_weights(single.llama, folder.llama)
    assert_equal_weights(single.clip, folder.clip)
    for a, b in (
        (single.llama_tokenizer, folder.llama_tokenizer),
        (single.clip_tokenizer, folder.clip_tokenizer),
    ):
        assert a("a red car").input_ids == b("a red car").input_ids


def test_single_files_use_tencent_key_names(paths):
    keys = set(read_tensor_shapes(paths["transformer_file"]))
    for name in ("double_blocks.0.img_attn_qkv.weight", "double_blocks.0.txt_attn_qkv.bias",
                 "double_blocks.0.img_mlp.fc1.weight", "single_blocks.0.linear1.weight",
                 "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight",
                 "txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.weight",
                 "final_layer.adaLN_modulation.1.weight", "guidance_in.mlp.0.weight"):  # fmt: skip
        assert name in keys, name
    assert not any("transformer_blocks" in k for k in keys)


@pytest.mark.parametrize("prefix", ["model.diffusion_model.", "diffusion_model."])
def test_comfyui_prefix_and_scaled_fp8_files_load(paths, tmp_path, prefix):
    """ComfyUI's transformer and Llama files: prefixed keys and fp8 weights with a per-tensor scale."""
    reference = hv.load_transformer(paths["transformer_file"], torch.float32).state_dict()
    fp8 = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}
    for key, value in load_tensors(paths["transformer_file"]).items():
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
    assert not torch.equal(loaded["transformer_blocks.0.attn.to_q.weight"],
                           reference["transformer_blocks.0.attn.to_q.weight"])  # fmt: skip

    llama = {}
    for key, value in load_tensors(paths["text_encoder_file"]).items():
        if key.endswith("proj.weight"):
            llama[key] = value.to(torch.float8_e4m3fn)
            llama[key.removesuffix(".weight") + ".scale_weight"] = torch.ones(1)
        else:
            llama[key] = value
    save_safetensors(
        {**llama, "scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}, tmp_path / "llama.safetensors"
    )
    encoders = hv.load_text_encoders(tmp_path / "llama.safetensors", paths["text_encoder_2_file"],
                                     paths["tokenizer"], paths["tokenizer_2"], torch.float32)  # fmt: skip
    q = encoders.llama.state_dict()["layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q, llama["model.layers.0.self_attn.q_proj.weight"].float())


def test_diffusers_layout_single_file_loads(paths, tmp_path):
    folder = hv.load_transformer(paths["diffusers"], torch.float32)
    save_safetensors(folder.state_dict(), tmp_path / "diffusers_keys.safetensors")
    assert_equal_weights(hv.load_transformer(tmp_path / "diffusers_keys.safetensors", torch.float32), folder)


# ---------------------------------------------------------------------------------------------------
# Wrong files
# ---------------------------------------------------------------------------------------------------


def test_hunyuan_video_15_is_refused_naming_its_architecture(paths, tmp_path):
    """A 1.5 transformer (Tencent's names: separate q/k/v, `vision_in`, `byt5_in`, `cond_type_embedding`,
    no single blocks) and a 1.5 diffusers folder both name `hunyuan_video15`."""
    names = ("img_in.proj.weight", "double_blocks.0.img_attn_q.weight", "double_blocks.0.img_attn_k.weight",
             "vision_in.proj.0.weight", "byt5_in.fc1.weight", "cond_type_embedding.weight")  # fmt: skip
    save_safetensors(
        {f"model.diffusion_model.{n}": torch.zeros(2, 2) for n in names}, tmp_path / "hv15.safetensors"
    )
    with pytest.raises(CheckpointError, match="hunyuan_video15"):
        hv.load_transformer(tmp_path / "hv15.safetensors", torch.float32)
    folder = tmp_path / "transformer"
    folder.mkdir()
    (folder / "config.json").write_text('{"_class_name": "HunyuanVideo15Transformer3DModel"}')
    with pytest.raises(CheckpointError, match="hunyuan_video15"):
        hv.load_transformer(folder, torch.float32)


def test_other_files_are_refused_naming_the_file(paths, tmp_path):
    with pytest.raises(CheckpointError, match="not a HunyuanVideo transformer") as e:
        hv.load_transformer(paths["vae_file"], torch.float32)
    assert str(paths["vae_file"]) in str(e.value)
    flux = {"double_blocks.0.img_attn.qkv.weight": torch.zeros(2, 2), "img_in.weight": torch.zeros(2, 2)}
    save_safetensors(flux, tmp_path / "flux.safetensors")
    with pytest.raises(CheckpointError, match="FLUX"):
        hv.load_transformer(tmp_path / "flux.safetensors", torch.float32)
    with pytest.raises(CheckpointError, match="not a Llama text encoder"):
        hv.load_text_encoders(paths["text_encoder_2_file"], paths["text_encoder_2_file"], paths["tokenizer"],
                              paths["tokenizer_2"], torch.float32)  # fmt: skip
    with pytest.raises(CheckpointError, match="tokenizer"):
        hv.load_text_encoders(
            paths["text_encoder_file"], paths["text_encoder_2_file"], None, None, torch.float32
        )
    shapes = dict(read_tensor_shapes(paths["transformer_file"]))
    shapes.pop("single_blocks.0.linear2.weight")
    save_safetensors({k: torch.zeros(v) for k, v in shapes.items()}, tmp_path / "partial.safetensors")
    with pytest.raises(CheckpointError, match="variant tuner does not know"):
        hv.load_transformer(tmp_path / "partial.safetensors", torch.float32)


# ---------------------------------------------------------------------------------------------------
# Variants and the key layout
# ---------------------------------------------------------------------------------------------------


def test_shipped_signatures_fit_the_shipped_configs():
    """Each variant's signature is what a checkpoint of its config holds, and picks that variant."""
    from diffusers import AutoencoderKLHunyuanVideo
    from transformers import LlamaConfig, LlamaModel

    def meta_state(model_cls, config_dir) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            return model_cls.from_config(model_cls.load_config(config_dir)).state_dict()

    def shapes(state) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in state.items()}

    for variant in hv.TRANSFORMER_VARIANTS:  # signatures in Tencent's names
        original = HUNYUAN_VIDEO_LAYOUT.to_original(
            meta_state(HunyuanVideoTransformer3DModel, variant.config_dir)
        )
        assert pick_variant(shapes(original), hv.TRANSFORMER_VARIANTS, "x", "transformer") is variant
    for variant in hv.VAE_VARIANTS:
        state = meta_state(AutoencoderKLHunyuanVideo, variant.config_dir)
        assert pick_variant(shapes(state), hv.VAE_VARIANTS, "x", "VAE") is variant
    for variant in hv.LLAMA_VARIANTS:
        with torch.device("meta"):
            state = LlamaModel(LlamaConfig.from_pretrained(variant.config_dir)).state_dict()
        assert pick_variant(shapes(state), hv.LLAMA_VARIANTS, "x", "Llama") is variant
    real = HunyuanVideoTransformer3DModel.load_config(hv.CONFIGS / "transformer" / "720p")
    assert (
        real["num_layers"],
        real["num_single_layers"],
        real["num_attention_heads"] * real["attention_head_dim"],
    ) == (20, 40, 3072)
    assert (
        AutoencoderKLHunyuanVideo.load_config(hv.CONFIGS / "vae" / "hunyuan_video")["scaling_factor"]
        == 0.476986
    )


def _row_tagged_state(config: dict) -> dict[str, torch.Tensor]:
    """A state dict of the config's keys whose tensors are [rows, 1] with distinct values: splits and joins
    of rows are checked without holding the real matrices."""
    with torch.device("meta"):
        model = HunyuanVideoTransformer3DModel.from_config(config)
    state, start = {}, 0
    for key, value in model.state_dict().items():
        rows = value.shape[0]
        state[key] = torch.arange(start, start + rows, dtype=torch.float64)[:, None]
        start += rows
    return state


def test_layout_agrees_with_diffusers_converter_at_full_width():
    """diffusers' single-file converter (original -> diffusers only; it cuts `linear1` at hidden size
    3072) reads our export of one block of each kind at the real width back to the same tensors."""
    config = HunyuanVideoTransformer3DModel.load_config(hv.CONFIGS / "transformer" / "720p")
    state = _row_tagged_state({**config, "num_layers": 1, "num_single_layers": 1, "num_refiner_layers": 1})
    original = transformer_to_original(state)
    converted = convert_hunyuan_video_transformer_to_diffusers(dict(original))
    assert converted.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(converted[key], value), key
    back = transformer_to_diffusers(original)
    assert all(torch.equal(back[k], v) for k, v in state.items()) and back.keys() == state.keys()


def test_every_default_target_exports_to_a_weight_of_the_single_file(paths):
    """Adapters on the default targets are named by Tencent modules the single file holds (fused ones by
    the fused layer); the final modulation (halves swapped) has no adapter name."""
    keys = set(read_tensor_shapes(paths["transformer_file"]))
    model = hv.load_transformer(paths["diffusers"], torch.float32)
    targets = ARCHITECTURES["hunyuan_video"].default_targets
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
             and any(re.fullmatch(p, n) for p in targets)]  # fmt: skip
    assert len(names) == 12 + 5  # double block: 8 attention + 4 MLP linears; single block: 5
    stems = {HUNYUAN_VIDEO_LAYOUT.key_to_original(f"{n}.weight") for n in names}
    assert stems == {
        "double_blocks.0.img_attn_qkv.weight", "double_blocks.0.txt_attn_qkv.weight",
        "double_blocks.0.img_attn_proj.weight", "double_blocks.0.txt_attn_proj.weight",
        "double_blocks.0.img_mlp.fc1.weight", "double_blocks.0.img_mlp.fc2.weight",
        "double_blocks.0.txt_mlp.fc1.weight", "double_blocks.0.txt_mlp.fc2.weight",
        "single_blocks.0.linear1.weight", "single_blocks.0.linear2.weight",
    }  # fmt: skip
    assert stems <= keys
    with pytest.raises(KeyError):
        HUNYUAN_VIDEO_LAYOUT("norm_out.linear")


# ComfyUI's renames of the release's keys as it loads them (`HunyuanVideo.process_unet_state_dict` in
# comfy/supported_models.py), written out here apart from the table under test
_COMFY_KEY_RENAMES = (
    ("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."), ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
    ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."), ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
    ("_mod.linear.", "_mod.lin."), ("_attn_qkv.", "_attn.qkv."), ("mlp.fc1.", "mlp.0."), ("mlp.fc2.", "mlp.2."),
    ("_attn_proj.", "_attn.proj."), (".modulation.linear.", ".modulation.lin."),
    ("_in.mlp.2.", "_in.out_layer."), ("_in.mlp.0.", "_in.in_layer."),
)  # fmt: skip


def _comfy_lora_unet_map(release_keys) -> set[str]:
    """ComfyUI's `lora_unet_` keys (`model_lora_keys_unet` in comfy/lora.py): its module names, "_" for "."."""
    names = set()
    for key in release_keys:
        for old, new in _COMFY_KEY_RENAMES:
            key = key.replace(old, new)
        if key.endswith(".weight"):
            names.add("lora_unet_" + key.removesuffix(".weight").replace(".", "_"))
    return names


@pytest.mark.parametrize("arch", ["hunyuan_video", "framepack"])
def test_every_kohya_key_names_a_comfyui_module(paths, arch):
    """An adapter on every linear layer but the final modulation (no adapter name), saved as kohya: each
    stem is in ComfyUI's `lora_unet_` map (the MLPs are `img_mlp_0`, not the release's `img_mlp_fc1`), and
    reads back to its module, as does musubi-tuner's spelling of the release's names."""
    layout = ARCHITECTURES[arch].checkpoint_layout()
    comfy = _comfy_lora_unet_map(read_tensor_shapes(paths["transformer_file"]))
    modules = _adapter_on_every_linear(paths)
    names = list(modules)
    state, metadata = layout_state(modules, "kohya", layout)
    stems = {key.split(".")[0] for key in state}
    assert "lora_unet_double_blocks_0_img_mlp_0" in stems
    assert stems - comfy == set()
    assert canonical_modules(
        parse_modules(state, metadata, "kohya"), layout.keys, metadata, "kohya"
    ).keys() == set(names)
    index = ModuleNameIndex(names, layout)
    assert index.resolve(["lora_unet_double_blocks_0_img_mlp_fc1"], "musubi") == {
        "lora_unet_double_blocks_0_img_mlp_fc1": "transformer_blocks.0.ff.net.0.proj"
    }


def _adapter_on_every_linear(paths) -> dict[str, ModuleWeights]:
    """A random LoRA on every linear layer but the final modulation (which has no adapter name)."""
    model = hv.load_transformer(paths["diffusers"], torch.float32)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "norm_out.linear"]
    gen = torch.Generator().manual_seed(0)
    return {n: ModuleWeights(LORA, {"down": torch.randn(2, 4, generator=gen), "up": torch.randn(4, 2, generator=gen)}, 2.0)
            for n in names}  # fmt: skip


@pytest.mark.parametrize("arch", ["hunyuan_video", "framepack"])
def test_every_musubi_key_names_a_module_of_musubi_tuners_model(paths, arch):
    """musubi-tuner names an adapter `lora_unet_` + its model's module name with "_" (`networks/lora.py`)
    and leaves any other key unread (strict=False). Its HunyuanVideo model keeps the release's names
    (`hunyuan_model/models.py`: `img_mlp.fc1`, fused `img_attn_qkv`, `linear1`), its FramePack model
    diffusers' (`frame_pack/hunyuan_video_packed.py`): the musubi file names only those, and reads back
    to the same adapters."""
    layout = ARCHITECTURES[arch].checkpoint_layout()
    modules = _adapter_on_every_linear(paths)
    if arch == "hunyuan_video":
        weights = [k for k in read_tensor_shapes(paths["transformer_file"]) if k.endswith(".weight")]
        musubi = {"lora_unet_" + k.removesuffix(".weight").replace(".", "_") for k in weights}
        expected = "lora_unet_double_blocks_0_img_mlp_fc1"
    else:
        musubi = {"lora_unet_" + n.replace(".", "_") for n in modules}
        expected = "lora_unet_transformer_blocks_0_attn_to_q"
    state, metadata = layout_state(modules, "musubi", layout)
    stems = {key.split(".")[0] for key in state}
    assert expected in stems
    assert stems - musubi == set()
    back = canonical_modules(parse_modules(state, metadata, "musubi"), layout.keys, metadata, "musubi")
    assert back.keys() == modules.keys()
    for name, weights in back.items():
        assert weights.alpha == modules[name].alpha, name
        for role, tensor in weights.tensors.items():
            assert torch.equal(tensor, modules[name].tensors[role]), (name, role)


# ---------------------------------------------------------------------------------------------------
# Model inputs against the pipeline
# ---------------------------------------------------------------------------------------------------


def test_tiny_tokenizer_crops_the_template_where_the_real_one_does(paths):
    """The pipeline crops a fixed 95 tokens (the real tokenizer's count of the template before the
    prompt); the tiny tokenizer gives the same count, so the crop keeps exactly the prompt."""
    tokenizer = _single_encoders(paths).llama_tokenizer
    before_prompt = DEFAULT_PROMPT_TEMPLATE["template"].split("{}")[0]
    assert DEFAULT_PROMPT_TEMPLATE["crop_start"] == hv.CROP_START == len(tokenizer(before_prompt).input_ids)
    assert hv.PROMPT_TEMPLATE == DEFAULT_PROMPT_TEMPLATE["template"]
    ids = tokenizer(hv.PROMPT_TEMPLATE.format("a dog runs")).input_ids[hv.CROP_START :]
    assert tokenizer.decode(ids) == "a dog runs<|eot_id|>"


def test_encode_prompts_match_the_pipeline(paths, pipe):
    ours = hv.encode_prompts(_single_encoders(paths), CAPTIONS)
    embeds, pooled, mask = pipe.encode_prompt(CAPTIONS, device="cpu")
    assert embeds.shape[1] == hv.MAX_LENGTH
    for i, entry in enumerate(ours):
        n = int(mask[i].sum())
        assert entry["text"].shape[0] == n and mask[i, :n].all()
        torch.testing.assert_close(entry["text"], embeds[i, :n], **TOLERANCE)
        torch.testing.assert_close(entry["pooled"], pooled[i], **TOLERANCE)
    assert ours[0]["text"].shape[0] < ours[1]["text"].shape[0]


def test_predict_matches_the_pipeline_transformer_call(paths, pipe):
    """Cached entries (true length) collated and passed through `predict` give what the pipeline's own
    transformer call gives on its 256-token padded embeddings and mask, at its t and guidance scaling."""
    cond = hv.collate(hv.encode_prompts(_single_encoders(paths), CAPTIONS))
    embeds, pooled, mask = pipe.encode_prompt(CAPTIONS, device="cpu")
    noisy = torch.randn(2, 16, 2, 4, 6, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.25, 0.8])
    guidance = 6.0
    with torch.no_grad():
        ours = hv.predict_velocity(pipe.transformer, noisy, t, cond, guidance)
        theirs = pipe.transformer(
            hidden_states=noisy, timestep=t * 1000, encoder_hidden_states=embeds, encoder_attention_mask=mask,
            pooled_projections=pooled, guidance=torch.tensor([guidance] * 2) * 1000.0, return_dict=False,
        )[0]  # fmt: skip
    assert ours.shape == noisy.shape
    torch.testing.assert_close(ours, theirs, **TOLERANCE)


@torch.no_grad()
def test_two_euler_steps_of_the_trainer_match_the_pipeline(pipe):
    """The trainer's text encoding, collation, embedded guidance and timesteps, stepped with Euler, give
    the pipeline's latents (guidance 6, its own 256 text tokens and scheduler sigmas)."""
    from tuner.archs.hunyuan_video.trainer import HunyuanVideoModel

    cfg = SimpleNamespace(model=SimpleNamespace(guidance=6.0), cache=SimpleNamespace(text_max_length=256))
    trainer = HunyuanVideoModel(cfg)
    encoders = hv.TextEncoders(pipe.text_encoder, pipe.tokenizer, pipe.text_encoder_2, pipe.tokenizer_2)
    cond = trainer.collate_text(trainer.encode_text(encoders, CAPTIONS[1:]))
    x = torch.randn(1, *trainer.latent_shape(48, 32, 5), generator=torch.Generator().manual_seed(0))
    out = pipe(prompt=CAPTIONS[1], height=32, width=48, num_frames=5, num_inference_steps=2, guidance_scale=6.0,
               latents=x.clone(), output_type="latent").frames  # fmt: skip
    sigmas = pipe.scheduler.sigmas
    for i in range(2):
        t = sigmas[i].reshape(1)
        x = x + (sigmas[i + 1] - sigmas[i]) * trainer.predict(pipe.transformer, x, t, cond)
    torch.testing.assert_close(x, out, rtol=1e-5, atol=1e-5)


def test_encode_video_and_decode_latents(paths, pipe):
    vae = hv.load_vae(paths["vae_file"], torch.float32)
    pixels = torch.rand(1, 3, 5, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = hv.encode_video(vae, pixels)
    assert latents.shape == (1, 16, 2, 4, 6)
    with torch.no_grad():
        raw = pipe.vae.encode(pixels).latent_dist.mode()
    torch.testing.assert_close(latents, raw * 0.476986)
    with torch.no_grad():
        expected = pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample
    torch.testing.assert_close(hv.decode_latents(vae, latents), expected)
    with pytest.raises(ValueError, match="1 \\+ 4k frames"):
        hv.encode_video(vae, pixels[:, :, :4])


# ---------------------------------------------------------------------------------------------------
# diffusers' LoRA loader
# ---------------------------------------------------------------------------------------------------


def test_diffusers_layout_loads_in_hunyuan_video_pipeline(paths, pipe, tmp_path):
    """Every default target (rank 4, alpha 3) saved in the diffusers layout (alpha folded into lora_B)
    goes through `HunyuanVideoPipeline.load_lora_weights` to the same transformer output."""
    ours = HunyuanVideoTransformer3DModel.from_pretrained(paths["diffusers"] / "transformer").eval()
    record = ARCHITECTURES["hunyuan_video"]
    network = LoRANetwork.apply_to(
        ours, TargetSpec(record.default_targets), 4, 3.0, name_map=record.key_table()
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in network.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    inputs = _transformer_inputs()
    with torch.no_grad():
        expected = ours(**inputs)[0]
        base = pipe.transformer(**inputs)[0]
    network.save(tmp_path / "lora.safetensors", format="diffusers")

    pipe.load_lora_weights(str(tmp_path / "lora.safetensors"), adapter_name="ours")
    try:
        injected = {k.split(".lora_A.")[0] for k in pipe.transformer.state_dict() if ".lora_A." in k}
        assert injected == set(network.names())
        with torch.no_grad():
            got = pipe.transformer(**inputs)[0]
    finally:
        pipe.unload_lora_weights()
    assert not torch.allclose(expected, base, atol=1e-3)
    torch.testing.assert_close(got, expected, **TOLERANCE)


def test_auto_layout_is_not_read_by_diffusers_converter(paths, tmp_path):
    """The auto layout (comfy: Tencent names, fused `img_attn_qkv` / `txt_attn_qkv` / `linear1`, one
    `.alpha` per module, what ComfyUI loads) does not load through `HunyuanVideoPipeline.load_lora_weights`:
    diffusers' HunyuanVideo LoRA converter cuts every tensor whose key holds `img_attn_qkv` into three,
    the scalar `.alpha` too (RuntimeError), and has no use for alphas. Use `save.format = "diffusers"` for
    diffusers. When this test fails, diffusers reads alphas: make the comfy layout the one for both."""
    from diffusers.loaders import HunyuanVideoLoraLoaderMixin

    model = HunyuanVideoTransformer3DModel.from_pretrained(paths["diffusers"] / "transformer").eval()
    record = ARCHITECTURES["hunyuan_video"]
    network = LoRANetwork.apply_to(
        model, TargetSpec(record.default_targets), 4, 3.0, name_map=record.key_table()
    )
    network.save(tmp_path / "lora.safetensors", format=resolve_save_format("hunyuan_video", "auto"))
    state = read_safetensors(tmp_path / "lora.safetensors")[0]
    assert "diffusion_model.double_blocks.0.img_attn_qkv.alpha" in state
    with pytest.raises(RuntimeError, match="chunk"):
        HunyuanVideoLoraLoaderMixin.lora_state_dict(str(tmp_path / "lora.safetensors"))


def _transformer_inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 16, 2, 4, 4, generator=g),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 7, 64, generator=g),
        "encoder_attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0, 0]]),
        "pooled_projections": torch.randn(1, 32, generator=g),
        "guidance": torch.tensor([6000.0]),
        "return_dict": False,
    }


def test_fused_rows_agree_with_diffusers_converter_at_full_width(tmp_path):
    """Every default target of one double and one single block, rank 4, at the real sizes (hidden 3072,
    MLP 12288), in the auto layout with scale 1 (alpha = rank) and its `.alpha` keys left out (ComfyUI
    reads a missing alpha as scale 1, diffusers cannot read one, see above): diffusers' HunyuanVideo LoRA
    converter (it cuts `linear1` at hidden size 3072, so the tiny fixture cannot be used) turns it back
    into one LoRA per diffusers module whose ΔW = B @ A is ours: the fused rows are where diffusers
    expects them."""
    from diffusers.loaders import HunyuanVideoLoraLoaderMixin

    hidden, mlp, rank = 3072, 12288, 4
    g = torch.Generator().manual_seed(0)

    def lora(out_features: int, in_features: int) -> ModuleWeights:
        return ModuleWeights(LORA, {"down": torch.randn(rank, in_features, generator=g) * 0.02,
                                    "up": torch.randn(out_features, rank, generator=g) * 0.02}, float(rank))  # fmt: skip

    double, single = "transformer_blocks.0", "single_transformer_blocks.0"
    modules = {f"{double}.attn.{n}": lora(hidden, hidden) for n in ("to_q", "to_k", "to_v")}
    modules |= {
        f"{double}.attn.{n}": lora(hidden, hidden) for n in ("add_q_proj", "add_k_proj", "add_v_proj")
    }
    modules |= {f"{double}.attn.{n}": lora(hidden, hidden) for n in ("to_out.0", "to_add_out")}
    for ff in ("ff", "ff_context"):
        modules[f"{double}.{ff}.net.0.proj"] = lora(mlp, hidden)
        modules[f"{double}.{ff}.net.2"] = lora(hidden, mlp)
    for name, out_features in (("attn.to_q", hidden), ("attn.to_k", hidden), ("attn.to_v", hidden),
                               ("proj_mlp", mlp)):  # fmt: skip
        modules[f"{single}.{name}"] = lora(out_features, hidden)
    modules[f"{single}.proj_out"] = lora(hidden, hidden + mlp)
    record = ARCHITECTURES["hunyuan_video"]
    assert all(any(re.fullmatch(p, name) for p in record.default_targets) for name in modules)

    state, metadata = layout_state(modules, resolve_save_format("hunyuan_video", "auto"), record.key_table())
    assert "diffusion_model.single_blocks.0.linear1.lora_A.weight" in state
    state = {k: v for k, v in state.items() if not k.endswith(".alpha")}
    save_safetensors(state, tmp_path / "lora.safetensors", metadata=metadata)

    converted = HunyuanVideoLoraLoaderMixin.lora_state_dict(str(tmp_path / "lora.safetensors"))
    assert {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in converted} == set(modules)
    for name, weights in modules.items():
        up, down = (converted[f"transformer.{name}.lora_{ab}.weight"].double() for ab in "BA")
        probe = torch.randn(down.shape[1], 16, generator=g, dtype=torch.float64)
        ours = weights.scale * (weights.tensors["up"].double() @ (weights.tensors["down"].double() @ probe))
        torch.testing.assert_close(up @ (down @ probe), ours, atol=1e-9, rtol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------------
# Memory settings: HunyuanVideo's blocks return (hidden_states, encoder_hidden_states), FLUX's the
# opposite order; the wrappers pass whatever a block returns through
# ---------------------------------------------------------------------------------------------------


def test_block_swap_and_activation_offload_keep_output_and_gradients(paths):
    from tuner.config.schema import MemorySettings
    from tuner.memory import apply_memory_settings
    from tuner.offload import FakeTransfer

    record = ARCHITECTURES["hunyuan_video"]
    cond = hv.collate(hv.encode_prompts(_single_encoders(paths), CAPTIONS))
    noisy = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([0.3, 0.7])

    def step(settings: MemorySettings | None):
        model = hv.load_transformer(paths["transformer_file"], torch.float32).requires_grad_(False)
        handle = None
        if settings is not None:
            handle = apply_memory_settings(model, settings, "cpu", block_lists=record.block_lists,
                                           transfer=fake)  # fmt: skip
            handle.checkpointing.min_bytes = 0  # the tiny model's activations are below the default
        torch.manual_seed(0)  # the adapters' initial down matrices
        network = LoRANetwork.apply_to(model, TargetSpec(record.default_targets), 4, 4.0,
                                       name_map=record.key_table())  # fmt: skip
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in network.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        out = hv.predict_velocity(model, noisy, t, cond, 1.0)
        out.square().mean().backward()
        return out.detach(), [p.grad for p in network.parameters()], handle

    fake = FakeTransfer()
    want, want_grads, _ = step(None)
    got, got_grads, handle = step(MemorySettings(blocks_to_swap=2, activation_offload=True))
    assert handle.block_swap.blocks_to_swap == 2 and any(kind == "offload" for kind, _ in fake.log)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
