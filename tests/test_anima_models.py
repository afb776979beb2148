"""Anima: loading every layout to the same weights, refusing other models' files by name, the text inputs
as ComfyUI builds them, and the LLM adapter and its wiring into the DiT against a plain-torch computation
written from the published description (`tuner.archs.anima.adapter`'s docstring), not from our output."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

import math

import pytest
import torch
from diffusers import CosmosTransformer3DModel
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from project import assert_equal_weights
from tuner.archs.anima import loaders as anima
from tuner.archs.anima.adapter import LLMAdapter
from tuner.archs.cosmos_predict2 import loaders as cosmos
from tuner.archs.qwen_image import loaders as qwen_image
from tuner.errors import CheckpointError
from tuner.fixtures import write_fixture
from tuner.models.identify import pick_variant

PROMPTS = ["a red cat sits on a blue chair", "a dog"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_fixture("anima", tmp_path_factory.mktemp("anima_model"))


@pytest.fixture(scope="module")
def transformer(paths):
    return anima.load_transformer(paths["transformer_file"], torch.float32)


@pytest.fixture(scope="module")
def text(paths):
    return anima.load_text_encoder(
        paths["text_encoder_file"], paths["tokenizer"], paths["tokenizer_2"], torch.float32
    )


# ---------------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["net.", "model.diffusion_model."])
def test_release_file_loads_the_same_with_any_prefix(paths, transformer, tmp_path, prefix):
    """The release's names as they are, under NVIDIA's `net.` and under ComfyUI's prefix: one model."""
    stored = load_file(paths["transformer_file"])
    renamed = {prefix + k: v for k, v in stored.items()}
    save_file(renamed, tmp_path / "anima.safetensors")
    assert_equal_weights(anima.load_transformer(tmp_path / "anima.safetensors", torch.float32), transformer)
    assert "llm_adapter.blocks.0.self_attn.q_proj.weight" in stored


def test_file_in_diffusers_names_loads_the_same(transformer, tmp_path):
    """A full fine-tune saved with `save.format = "diffusers"`: diffusers' DiT names, the adapter's own."""
    save_file(
        {k: v.contiguous() for k, v in transformer.state_dict().items()}, tmp_path / "anima.safetensors"
    )
    assert_equal_weights(anima.load_transformer(tmp_path / "anima.safetensors", torch.float32), transformer)


def test_every_tensor_is_used(paths, transformer):
    """The model holds exactly the file's tensors (the adapter as `llm_adapter`), bit for bit."""
    stored = load_file(paths["transformer_file"])
    adapter = {k.removeprefix("llm_adapter."): v for k, v in stored.items() if k.startswith("llm_adapter.")}
    assert adapter.keys() == transformer.llm_adapter.state_dict().keys()
    for k, v in adapter.items():
        assert torch.equal(transformer.llm_adapter.state_dict()[k], v)
    assert len(stored) == len(transformer.state_dict())


def test_text_encoder_and_vae_layouts_are_identical(paths, text):
    folder, _ = anima.load_text_encoder(
        paths["diffusers"], None, paths["diffusers"] / "tokenizer_2", torch.float32
    )
    assert_equal_weights(folder.model, text[0].model)
    single_vae = qwen_image.load_vae(paths["vae_file"], torch.float32)
    assert_equal_weights(qwen_image.load_vae(paths["diffusers"], torch.float32), single_vae)


@pytest.mark.parametrize("variant", anima.TRANSFORMER_VARIANTS, ids=lambda v: v.name)
def test_transformer_variant_picked_from_shapes(variant):
    config = CosmosTransformer3DModel.load_config(variant.config_dir)
    with torch.device("meta"):
        dit = CosmosTransformer3DModel.from_config(config)
        adapter = LLMAdapter(**anima.adapter_config(variant))
    shapes = {anima.ANIMA_LAYOUT.key_to_original(k): tuple(v.shape) for k, v in dit.state_dict().items()}
    shapes |= {f"llm_adapter.{k}": tuple(v.shape) for k, v in adapter.state_dict().items()}
    assert pick_variant(shapes, anima.TRANSFORMER_VARIANTS, "x.safetensors", "Anima") is variant
    assert anima.expected_keys(variant) == set(shapes)


def test_released_adapter_sizes():
    """circlestone-labs/Anima's adapter (ComfyUI's LLMAdapter defaults): 6 blocks, 16 heads, width 1024,
    the T5-11B vocabulary; its DiT is Cosmos-Predict2-2B's config (ComfyUI's `model_detection` for Anima:
    2048 channels, 28 blocks, 16 heads, AdaLN-LoRA 256, text 1024, RoPE extrapolation (1, 4, 4))."""
    two_b = next(v for v in anima.TRANSFORMER_VARIANTS if v.name == "2B")
    assert anima.adapter_config(two_b) == {"vocab_size": 32128, "dim": 1024, "layers": 6, "heads": 16}
    assert CosmosTransformer3DModel.load_config(two_b.config_dir) == CosmosTransformer3DModel.load_config(
        cosmos.CONFIGS / "transformer" / "2B-t2i"
    )


# ---------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------


def test_cosmos_predict2_file_is_refused_naming_it(paths, tmp_path):
    stored = load_file(paths["transformer_file"])
    save_file({k: v for k, v in stored.items() if not k.startswith("llm_adapter.")},
              tmp_path / "cosmos.safetensors")  # fmt: skip
    with pytest.raises(CheckpointError, match='architecture = "cosmos_predict2"'):
        anima.load_transformer(tmp_path / "cosmos.safetensors", torch.float32)


def test_anima_file_is_refused_by_cosmos_predict2_naming_anima(paths):
    with pytest.raises(CheckpointError, match='architecture = "anima"'):
        cosmos.load_transformer(paths["transformer_file"], torch.float32)


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_incomplete_or_extra_tensors_are_refused(paths, tmp_path, change):
    stored = load_file(paths["transformer_file"])
    if change == "missing":
        del stored["llm_adapter.blocks.1.cross_attn.k_norm.weight"]
    else:
        stored["llm_adapter.in_proj.weight"] = torch.zeros(64, 64)
    save_file(stored, tmp_path / "anima.safetensors")
    with pytest.raises(CheckpointError, match=f"1 {change}"):
        anima.load_transformer(tmp_path / "anima.safetensors", torch.float32)


def test_missing_t5_tokenizer_is_named(paths):
    with pytest.raises(CheckpointError, match="model.tokenizer_2"):
        anima.load_text_encoder(paths["text_encoder_file"], paths["tokenizer"], None, torch.float32)


def test_folder_is_refused(paths):
    with pytest.raises(CheckpointError, match="single file"):
        anima.load_transformer(paths["diffusers"], torch.float32)


# ---------------------------------------------------------------------------------------------------
# Text inputs (ComfyUI's comfy/text_encoders/anima.py)
# ---------------------------------------------------------------------------------------------------


def test_text_inputs_are_comfyuis(paths, text):
    """Qwen: the caption's tokens without special tokens, last hidden states of the caption alone; T5: the
    caption's ids closed by `</s>`; an empty caption is one Qwen padding token."""
    encoder, t5_tokenizer = text
    qwen_tokenizer = AutoTokenizer.from_pretrained(paths["tokenizer"])
    entries = anima.encode_prompts(encoder, t5_tokenizer, [*PROMPTS, ""])
    for prompt, entry in zip(PROMPTS, entries, strict=False):
        ids = qwen_tokenizer(prompt, add_special_tokens=False).input_ids
        alone = encoder.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(entry["qwen"], alone, rtol=1e-5, atol=1e-5)
        assert entry["t5_ids"].tolist()[-1] == t5_tokenizer.eos_token_id
        assert entry["t5_ids"].tolist() == t5_tokenizer(prompt).input_ids
    assert entries[2]["qwen"].shape[0] == 1 and entries[2]["t5_ids"].tolist() == [t5_tokenizer.eos_token_id]


# ---------------------------------------------------------------------------------------------------
# Parity: the adapter and its wiring, computed here in plain torch from the weights
# ---------------------------------------------------------------------------------------------------


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, positions):
    """RoPE, θ = 10000, dimension i turning with i + d/2, written as explicit pairs; x [L, d]."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for i in range(d // 2):
        angle = positions * 10000.0 ** (-2 * i / d)
        a, b = x[:, i], x[:, i + d // 2]
        out[:, i] = a * torch.cos(angle) - b * torch.sin(angle)
        out[:, i + d // 2] = b * torch.cos(angle) + a * torch.sin(angle)
    return out


def _attention(w, prefix, x, ctx, heads):
    """Per head: softmax(q·k / √d) v with normed, rotated q and k; no biases."""
    outs = []
    d = x.shape[-1] // heads
    for h in range(heads):
        rows = slice(h * d, (h + 1) * d)
        q = x @ w[f"{prefix}.q_proj.weight"][rows].T
        k = ctx @ w[f"{prefix}.k_proj.weight"][rows].T
        v = ctx @ w[f"{prefix}.v_proj.weight"][rows].T
        q = _rotate(_rms(q, w[f"{prefix}.q_norm.weight"]), torch.arange(x.shape[0], dtype=torch.float64))
        k = _rotate(_rms(k, w[f"{prefix}.k_norm.weight"]), torch.arange(ctx.shape[0], dtype=torch.float64))
        outs.append(torch.softmax(q @ k.T / math.sqrt(d), dim=-1) @ v)
    return torch.cat(outs, dim=-1) @ w[f"{prefix}.o_proj.weight"].T


def reference_adapter(
    w: dict, qwen: torch.Tensor, t5_ids: torch.Tensor, layers: int, heads: int
) -> torch.Tensor:
    """Anima's adapter for one caption (no batch, no padding), from the state dict alone."""
    x = w["embed.weight"][t5_ids]
    for i in range(layers):
        b = f"blocks.{i}"
        x = x + _attention(w, f"{b}.self_attn", _rms(x, w[f"{b}.norm_self_attn.weight"]),
                           _rms(x, w[f"{b}.norm_self_attn.weight"]), heads)  # fmt: skip
        x = x + _attention(w, f"{b}.cross_attn", _rms(x, w[f"{b}.norm_cross_attn.weight"]), qwen, heads)
        h = _rms(x, w[f"{b}.norm_mlp.weight"]) @ w[f"{b}.mlp.0.weight"].T + w[f"{b}.mlp.0.bias"]
        h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))  # exact GELU
        x = x + h @ w[f"{b}.mlp.2.weight"].T + w[f"{b}.mlp.2.bias"]
    return _rms(x @ w["out_proj.weight"].T + w["out_proj.bias"], w["norm.weight"])


@torch.no_grad()
def test_adapter_matches_the_plain_computation_batched_and_alone(transformer, text):
    """Each caption's context rows, computed in a padded batch, equal the plain computation on the caption
    alone; the padded rows are zero."""
    encoder, t5_tokenizer = text
    entries = anima.encode_prompts(encoder, t5_tokenizer, PROMPTS)
    batch = anima.collate(entries)
    assert batch["qwen_mask"].sum() < batch["qwen_mask"].numel()  # the batch is padded
    out = transformer.llm_adapter(batch["qwen"], batch["t5_ids"], batch["qwen_mask"], batch["t5_mask"])
    weights = {
        k: v.double() if v.is_floating_point() else v for k, v in transformer.llm_adapter.state_dict().items()
    }
    for i, e in enumerate(entries):
        expected = reference_adapter(weights, e["qwen"].double(), e["t5_ids"], layers=2, heads=4)
        n = e["t5_ids"].shape[0]
        torch.testing.assert_close(out[i, :n].double(), expected, rtol=1e-4, atol=1e-5)
        assert not out[i, n:].any()


@torch.no_grad()
def test_prediction_is_the_dit_on_the_adapters_rows_padded_to_512(transformer, text):
    """`predict_velocity` = the DiT called on `x_t` at t with the reference adapter rows zero-padded to 512
    and the all-zero padding-mask channel (as ComfyUI's `Anima.preprocess_text_embeds` + MiniTrainDIT)."""
    encoder, t5_tokenizer = text
    entries = anima.encode_prompts(encoder, t5_tokenizer, PROMPTS)
    noisy = torch.randn(2, 16, 1, 4, 6, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.25, 0.8])
    weights = {
        k: v.double() if v.is_floating_point() else v for k, v in transformer.llm_adapter.state_dict().items()
    }
    context = torch.zeros(2, 512, 64)
    for i, e in enumerate(entries):
        rows = reference_adapter(weights, e["qwen"].double(), e["t5_ids"], layers=2, heads=4)
        context[i, : rows.shape[0]] = rows.float()
    inputs = torch.cat([noisy, torch.zeros(2, 1, 1, 4, 6)], dim=1)
    expected = transformer(
        hidden_states=inputs, timestep=t, encoder_hidden_states=context, return_dict=False
    )[0]
    got = anima.predict_velocity(transformer, noisy, t, anima.collate(entries))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
