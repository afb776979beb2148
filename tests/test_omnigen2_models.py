"""OmniGen2: loading (the release's folder, ComfyUI's single files, both with bit-identical weights), clear
errors for wrong files, the prompt format, and the transformer's forward against a plain-torch computation
written from the release's description (`tuner.archs.omnigen2.model`'s docstring), so a change in any
block's wiring, the time embedding, the Omni-RoPE positions or the output layer fails here."""

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from project import assert_equal_weights
from tuner.archs.flux import loaders as flux
from tuner.archs.omnigen2 import loaders as omnigen2
from tuner.archs.omnigen2.fixture import write_omnigen2_fixture
from tuner.archs.omnigen2.model import OmniGen2Transformer2DModel
from tuner.archs.omnigen2.trainer import OmniGen2Model
from tuner.errors import CheckpointError
from tuner.models.identify import pick_variant


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return write_omnigen2_fixture(tmp_path_factory.mktemp("omnigen2"), seed=0)


@pytest.fixture(scope="module")
def model(fx):
    return omnigen2.load_transformer(fx["transformer_file"], torch.float32)


# ---------------------------------------------------------------------------------------------------
# Every layout loads the same weights
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformer_layouts_are_identical(fx, dtype, tmp_path):
    folder = omnigen2.load_transformer(fx["diffusers"], dtype)
    assert_equal_weights(folder, omnigen2.load_transformer(fx["transformer_file"], dtype))
    # ComfyUI's checkpoint prefix
    prefixed = {f"model.diffusion_model.{k}": v for k, v in load_file(fx["transformer_file"]).items()}
    save_file(prefixed, tmp_path / "prefixed.safetensors")
    assert_equal_weights(folder, omnigen2.load_transformer(tmp_path / "prefixed.safetensors", dtype))


def test_release_keys_are_the_model_keys(fx):
    keys = set(load_file(fx["transformer_file"]))
    assert {
        "layers.0.attn.to_q.weight",
        "layers.0.norm1.linear.weight",
        "context_refiner.0.norm1.weight",
        "ref_image_refiner.0.feed_forward.linear_3.weight",
        "ref_image_patch_embedder.weight",
        "image_index_embedding",
        "time_caption_embed.timestep_embedder.linear_1.weight",
        "time_caption_embed.caption_embedder.0.weight",
        "norm_out.linear_2.bias",
    } <= keys


def test_text_encoder_layouts_are_identical(fx):
    folder = omnigen2.load_text_encoder(fx["diffusers"], None, torch.float32)  # mllm/ + processor/
    single = omnigen2.load_text_encoder(fx["text_encoder_file"], fx["tokenizer"], torch.float32)
    assert_equal_weights(folder.model, single.model)
    assert folder.tokenizer("a dog").input_ids == single.tokenizer("a dog").input_ids


def test_vae_layouts_are_identical(fx):
    assert_equal_weights(
        flux.load_vae(fx["diffusers"], torch.float32), flux.load_vae(fx["vae_file"], torch.float32)
    )


# ---------------------------------------------------------------------------------------------------
# Variants and clear errors
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", omnigen2.TRANSFORMER_VARIANTS, ids=lambda v: v.name)
def test_transformer_variant_picked_from_shapes(variant):
    with torch.device("meta"):
        meta = OmniGen2Transformer2DModel.from_config(
            OmniGen2Transformer2DModel.load_config(variant.config_dir)
        )
    shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    assert pick_variant(shapes, omnigen2.TRANSFORMER_VARIANTS, "x.safetensors", "OmniGen2") is variant


def test_the_release_config_has_the_published_sizes():
    """4B transformer (the release: "a 3B VLM and a 4B diffusion model"), 120-dim heads split 40/40/40."""
    config = OmniGen2Transformer2DModel.load_config(omnigen2.CONFIGS / "transformer" / "omnigen2")
    with torch.device("meta"):
        meta = OmniGen2Transformer2DModel.from_config(config)
    assert 3.9e9 < sum(p.numel() for p in meta.parameters()) < 4.1e9
    assert config["hidden_size"] // config["num_attention_heads"] == sum(config["axes_dim_rope"]) == 120


def test_a_missing_or_foreign_tensor_is_named(fx, tmp_path):
    tensors = load_file(fx["transformer_file"])
    save_file(
        {k: v for k, v in tensors.items() if k != "layers.1.attn.to_v.weight"},
        tmp_path / "missing.safetensors",
    )
    with pytest.raises(CheckpointError, match=r"missing.safetensors.*layers\.1\.attn\.to_v\.weight"):
        omnigen2.load_transformer(tmp_path / "missing.safetensors", torch.float32)
    save_file({**tensors, "extra.weight": torch.zeros(2)}, tmp_path / "extra.safetensors")
    with pytest.raises(CheckpointError, match=r"extra\.weight"):
        omnigen2.load_transformer(tmp_path / "extra.safetensors", torch.float32)


def test_other_files_are_refused_as_transformers(fx):
    for wrong in (fx["vae_file"], fx["text_encoder_file"]):
        with pytest.raises(CheckpointError, match="OmniGen2 transformer"):
            omnigen2.load_transformer(wrong, torch.float32)


def test_qwen_image_s_7b_text_encoder_is_not_omnigen2_s(fx):
    """The 3B and the test fixture load; a Qwen2.5-VL of another size is named as unknown."""
    tensors = load_file(fx["text_encoder_file"])
    tensors["model.embed_tokens.weight"] = torch.zeros(152064, 64)
    path = fx["root"] / "wrong_te.safetensors"
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match="Qwen2.5-VL-3B text encoder"):
        omnigen2.load_text_encoder(path, fx["tokenizer"], torch.float32)


def test_text_encoder_single_file_needs_a_tokenizer(fx):
    with pytest.raises(CheckpointError, match="tokenizer"):
        omnigen2.load_text_encoder(fx["text_encoder_file"], None, torch.float32)


# ---------------------------------------------------------------------------------------------------
# Model inputs
# ---------------------------------------------------------------------------------------------------


def test_prompts_are_chat_templated_and_kept_at_their_length(fx):
    encoder = omnigen2.load_text_encoder(fx["diffusers"], None, torch.float32)
    captions = ["a red circle", ""]
    rows = omnigen2.encode_prompts(encoder, captions)
    for caption, row in zip(captions, rows):
        ids = encoder.tokenizer(omnigen2.PROMPT_TEMPLATE.format(caption)).input_ids
        assert row.shape == (len(ids), 64)
        alone = encoder.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(row, alone, atol=1e-5, rtol=1e-5)  # padding changes nothing
    assert encoder.tokenizer.decode(
        encoder.tokenizer(omnigen2.PROMPT_TEMPLATE.format("x")).input_ids
    ).endswith("x<|im_end|>\n")  # no assistant turn: add_generation_prompt=False


def test_predict_is_the_negated_model_at_one_minus_t(model):
    trainer = OmniGen2Model.__new__(OmniGen2Model)
    gen = torch.Generator().manual_seed(1)
    noisy, text = torch.randn(1, 16, 4, 6, generator=gen), torch.randn(1, 5, 64, generator=gen)
    mask = torch.ones(1, 5, dtype=torch.bool)
    t = torch.tensor([0.3])
    with torch.no_grad():
        got = trainer.predict(model, noisy, t, {"prompt_embeds": text, "prompt_mask": mask})
        want = -model(noisy, torch.tensor([0.7]), text, mask, return_dict=False)[0]
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------------
# The forward against a plain-torch computation of the published architecture
# ---------------------------------------------------------------------------------------------------


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope_angles(positions, axes_dim):
    """[L, head_dim / 2] angles: per axis a, position p_a times 1 / 10000^(2j / d_a), axes concatenated."""
    parts = []
    for axis, d in enumerate(axes_dim):
        freqs = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        parts.append(positions[:, axis, None].double() * freqs)
    return torch.cat(parts, dim=-1)


def _rotate(x, angles):
    """Rotate adjacent pairs (x[2j], x[2j+1]) of every head by angle j; x [L, H, D]."""
    pairs = x.double().unflatten(-1, (-1, 2))
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).float()


def _block(w, name, x, angles, cfg, temb=None):
    def lin(n, h):
        return F.linear(h, w[f"{name}.{n}.weight"], w.get(f"{name}.{n}.bias"))

    heads, kv_heads = cfg["num_attention_heads"], cfg["num_kv_heads"]
    head_dim = cfg["hidden_size"] // heads

    def attention(h):
        q = lin("attn.to_q", h).unflatten(-1, (heads, head_dim))
        k = lin("attn.to_k", h).unflatten(-1, (kv_heads, head_dim))
        v = lin("attn.to_v", h).unflatten(-1, (kv_heads, head_dim))
        q = _rotate(_rms(q, w[f"{name}.attn.norm_q.weight"], 1e-5), angles)
        k = _rotate(_rms(k, w[f"{name}.attn.norm_k.weight"], 1e-5), angles)
        group = heads // kv_heads  # query head i reads key/value head i // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).flatten(-2)
        return lin("attn.to_out.0", out)

    def mlp(h):
        return lin(
            "feed_forward.linear_2", F.silu(lin("feed_forward.linear_1", h)) * lin("feed_forward.linear_3", h)
        )

    eps = cfg["norm_eps"]
    if temb is None:
        x = x + _rms(attention(_rms(x, w[f"{name}.norm1.weight"], eps)), w[f"{name}.norm2.weight"], eps)
        return x + _rms(mlp(_rms(x, w[f"{name}.ffn_norm1.weight"], eps)), w[f"{name}.ffn_norm2.weight"], eps)
    scale_attn, gate_attn, scale_mlp, gate_mlp = lin("norm1.linear", F.silu(temb)).chunk(4)
    h = _rms(x, w[f"{name}.norm1.norm.weight"], eps) * (1 + scale_attn)
    x = x + gate_attn.tanh() * _rms(attention(h), w[f"{name}.norm2.weight"], eps)
    h = _rms(x, w[f"{name}.ffn_norm1.weight"], eps) * (1 + scale_mlp)
    return x + gate_mlp.tanh() * _rms(mlp(h), w[f"{name}.ffn_norm2.weight"], eps)


def _reference(w, cfg, latent, tau, text):
    """One sample: latent [C, H, W], τ a float, text [L, D] (its true length, no padding)."""
    p, hidden, channels = cfg["patch_size"], cfg["hidden_size"], cfg["in_channels"]
    # time: 256 sinusoids of timestep_scale · τ (cos half first), then linear, SiLU, linear
    freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float32) / 128)
    arg = cfg["timestep_scale"] * tau * freqs
    sinusoids = torch.cat([arg.cos(), arg.sin()])
    temb = F.linear(F.silu(F.linear(sinusoids, w["time_caption_embed.timestep_embedder.linear_1.weight"],
                                    w["time_caption_embed.timestep_embedder.linear_1.bias"])),
                    w["time_caption_embed.timestep_embedder.linear_2.weight"],
                    w["time_caption_embed.timestep_embedder.linear_2.bias"])  # fmt: skip
    txt = F.linear(_rms(text, w["time_caption_embed.caption_embedder.0.weight"], cfg["norm_eps"]),
                   w["time_caption_embed.caption_embedder.1.weight"], w["time_caption_embed.caption_embedder.1.bias"])  # fmt: skip
    # 2x2 patches, token (r, c) holding the values in (row in patch, column in patch, channel) order
    rows, cols = latent.shape[1] // p, latent.shape[2] // p
    patches = latent.reshape(channels, rows, p, cols, p).permute(1, 3, 2, 4, 0).reshape(rows * cols, -1)
    img = F.linear(patches, w["x_embedder.weight"], w["x_embedder.bias"])
    # Omni-RoPE: text token i at (i, i, i); image token (r, c) at (L, r, c)
    length = text.shape[0]
    text_pos = torch.arange(length)[:, None].expand(length, 3)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    img_pos = torch.stack([torch.full_like(r, length), r, c], dim=-1).reshape(-1, 3)
    text_angles, img_angles = (
        _rope_angles(text_pos, cfg["axes_dim_rope"]),
        _rope_angles(img_pos, cfg["axes_dim_rope"]),
    )
    for i in range(cfg["num_refiner_layers"]):
        txt = _block(w, f"context_refiner.{i}", txt, text_angles, cfg)
        img = _block(w, f"noise_refiner.{i}", img, img_angles, cfg, temb)
    joint, angles = torch.cat([txt, img]), torch.cat([text_angles, img_angles])
    for i in range(cfg["num_layers"]):
        joint = _block(w, f"layers.{i}", joint, angles, cfg, temb)
    # output: LayerNorm without affine, scaled by 1 + linear(SiLU(temb)), then linear to patch values
    scale = F.linear(F.silu(temb), w["norm_out.linear_1.weight"], w["norm_out.linear_1.bias"])
    out = F.layer_norm(joint[length:], (hidden,), eps=1e-6) * (1 + scale)
    out = F.linear(out, w["norm_out.linear_2.weight"], w["norm_out.linear_2.bias"])
    return (
        out.reshape(rows, cols, p, p, channels).permute(4, 0, 2, 1, 3).reshape(channels, rows * p, cols * p)
    )


def test_forward_matches_the_published_architecture(model):
    """Two captions of unequal length in one batch (padding masked) against each computed alone."""
    cfg, w = model.config, model.state_dict()
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 16, 6, 4, generator=gen)
    lengths = (7, 4)
    text = torch.randn(2, max(lengths), cfg["text_feat_dim"], generator=gen)
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    tau = torch.tensor([0.25, 0.8])
    with torch.no_grad():
        got = model(latents, tau, text * mask[..., None], mask, return_dict=False)[0]
        for i, length in enumerate(lengths):
            want = _reference(w, cfg, latents[i], tau[i].item(), text[i, :length])
            torch.testing.assert_close(got[i], want, atol=1e-4, rtol=1e-4)


def test_text_to_image_never_runs_the_reference_image_path(model):
    """The reference-image weights load and save but take no part in text-to-image (no gradient)."""
    trained = OmniGen2Transformer2DModel.from_config(model.config)
    trained.load_state_dict(model.state_dict())
    mask = torch.ones(1, 3, dtype=torch.bool)
    trained(
        torch.randn(1, 16, 4, 4), torch.tensor([0.5]), torch.randn(1, 3, 64), mask
    ).sample.sum().backward()
    unused = {n for n, p in trained.named_parameters() if p.grad is None}
    assert unused == {n for n, _ in trained.named_parameters()
                      if n.startswith(("ref_image_refiner.", "ref_image_patch_embedder.", "image_index_embedding"))}  # fmt: skip
