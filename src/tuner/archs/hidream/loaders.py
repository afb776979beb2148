"""HiDream-I1 (Full, Dev, Fast): loading the transformer and turning latents into model inputs.

The text side (two CLIPs, T5-XXL, Llama 3.1) is in `tuner.archs.hidream.text`; the VAE is FLUX.1's
(`tuner.archs.flux.loaders.load_vae`, same latents: 16 channels, 8×, (z − shift) · scale).

Each loader takes either layout users have (see `tuner.models.loading`):

* transformer: a diffusers folder (`HiDream-ai/HiDream-I1-Full`, `-Dev`, `-Fast`), or the single file
  (ComfyUI's `hidream_i1_full_fp16.safetensors`, `hidream_i1_dev_bf16.safetensors`,
  `hidream_i1_fast_fp8.safetensors`, ...). **The release is already diffusers-named**
  (`double_stream_blocks.0.block.attn1.to_q.weight`, `...ff_i.experts.0.w1.weight`; diffusers' own
  single-file converter only strips ComfyUI's `model.diffusion_model.` prefix), so the single file is
  the diffusers state dict. Full, Dev and Fast are one network (17B: 16 double-stream and 32
  single-stream MoE blocks) distilled differently: their shapes are identical, so which one a file is
  can only be read from its name (`release_name`), and only sampling defaults depend on it.

The transformer's MoE feed-forward (`MOEFeedForwardSwiGLU`: a shared SwiGLU expert plus 4 routed ones,
2 active per token) has two code paths in diffusers, chosen by the module's `training` flag unless the
config's `force_inference_output` is set:

* inference (`moe_infer`) runs under `torch.no_grad()`: the routed experts' outputs carry no gradient,
  so adapters on them (or anything reached only through them, the router included) would never train;
* training computes the same sum through a differentiable loop, and the router's load-balancing
  auxiliary loss, which diffusers then discards (`AddAuxiliaryLoss` is commented out): diffusers trains
  without it, and so does tuner.

The model's `training` flag also changes the *output layout* (`unpatchify`): in training mode it returns
`[B, C, S, p·p]` tokens instead of the image, which is why diffusers' scripts set
`force_inference_output=True` — which also switches every MoE to the no-grad path. tuner keeps the
released config (`force_inference_output=False`) and instead sets each MoE's path from
`torch.is_grad_enabled()` on every call (its router stays in eval mode: no discarded aux loss), and
reads the output in whichever layout the model's mode produced. Both paths give the same numbers.

Model inputs are what HiDreamImagePipeline feeds: latents as [B, 16, H, W] (the model patchifies them;
a non-square latent is zero-padded to `max_resolution`'s token count with a mask), the timestep
t · 1000, T5's hidden states, the hidden states of every Llama layer ([layers, B, L, D]; the model picks
`llama_layers`), CLIP-L's and CLIP-G's projected pooled outputs concatenated, and the output negated
(the network predicts x0 − noise; the flow velocity is noise − x0).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.models.component import component_spec, load_component
from tuner.models.identify import variant_table
from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

if TYPE_CHECKING:
    from diffusers import HiDreamImageTransformer2DModel

CONFIGS = Path(__file__).parent / "configs"
ROUTED_EXPERTS = 4  # every released HiDream-I1 model (and the tiny fixture) routes over 4 experts

# ---------------------------------------------------------------------------------------------------
# Known variants. `None`: the tensor must be absent (it pins the number of blocks).
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("x_embedder.proj.weight", "p_embedder.pooled_embedder.linear_1.weight",
     "caption_projection.0.linear.weight", "double_stream_blocks.{}.block.adaLN_modulation.1.weight",
     "single_stream_blocks.{}.block.adaLN_modulation.1.weight"),
    {
        # HiDream-I1 Full, Dev and Fast: 16 double + 32 single blocks of width 2560
        "i1": ((2560, 64), (2560, 2048), (2560, 4096), (16, (30720, 2560)), (32, (15360, 2560))),
        # the test fixture (tuner.archs.hidream.fixture): 2 heads of 32, one block of each kind
        "tiny": ((64, 64), (64, 64), (64, 64), (1, (768, 64)), (1, (384, 64))),
    },
)  # fmt: skip

# The release's distillations, as its file and folder names spell them (their sampling shifts are the
# record's `sampling.by_name`).
_RELEASE_NAME = re.compile(r"i1[-_](full|dev|fast)", re.IGNORECASE)


def release_name(path: str | Path) -> str | None:
    """ "full", "dev" or "fast" from a HiDream-I1 file or folder name (`hidream_i1_dev_bf16.safetensors`,
    `HiDream-I1-Fast/transformer`); None when the name does not say. Shapes cannot tell them apart."""
    found = _RELEASE_NAME.search(str(path))
    return found.group(1).lower() if found else None


# ---------------------------------------------------------------------------------------------------
# The key table: the release uses diffusers' names. The linear layers are listed so kohya stems read
# back; `{i}` is a block index, routed experts are numbered.
# ---------------------------------------------------------------------------------------------------
_SWIGLU = ("w1", "w2", "w3")
_MOE = (
    *(f"ff_i.shared_experts.{w}" for w in _SWIGLU),
    *(f"ff_i.experts.{e}.{w}" for e in range(ROUTED_EXPERTS) for w in _SWIGLU),
)
_DOUBLE = ("adaLN_modulation.1", *(f"attn1.{p}" for p in ("to_q", "to_k", "to_v", "to_out")),
           *(f"attn1.{p}_t" for p in ("to_q", "to_k", "to_v", "to_out")), *_MOE,
           *(f"ff_t.{w}" for w in _SWIGLU))  # fmt: skip
_SINGLE = ("adaLN_modulation.1", *(f"attn1.{p}" for p in ("to_q", "to_k", "to_v", "to_out")), *_MOE)
LINEAR_MODULES = (
    *(f"double_stream_blocks.{{i}}.block.{name}" for name in _DOUBLE),
    *(f"single_stream_blocks.{{i}}.block.{name}" for name in _SINGLE),
    "x_embedder.proj", "t_embedder.timestep_embedder.linear_1", "t_embedder.timestep_embedder.linear_2",
    "p_embedder.pooled_embedder.linear_1", "p_embedder.pooled_embedder.linear_2",
    "caption_projection.{i}.linear", "final_layer.linear", "final_layer.adaLN_modulation.1",
)  # fmt: skip
HIDREAM_KEYS = ArchitectureKeys(
    "hidream",
    tuple((name, name) for name in LINEAR_MODULES),
    same_names=True,
    comfy_forms=("transformer.{c}",),
)
"""The key table of HiDream-I1: the release's names are diffusers'."""
HIDREAM_LAYOUT = CheckpointLayout(HIDREAM_KEYS)

_MARKERS = ("x_embedder.proj.weight", "double_stream_blocks.0.block.adaLN_modulation.1.bias")
TRANSFORMER_SPEC = component_spec(
    "HiDream-I1 transformer", "HiDreamImageTransformer2DModel", TRANSFORMER_VARIANTS, _MARKERS
)


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def load_transformer(path: str | Path, dtype: torch.dtype) -> HiDreamImageTransformer2DModel:
    """Load the HiDream-I1 transformer from a diffusers folder or a single file, in eval mode."""
    cls = "HiDreamImageTransformer2DModel"
    return load_component(path, dtype, cls, "transformer", TRANSFORMER_SPEC, diffusers_converter=True)


# ---------------------------------------------------------------------------------------------------
# The transformer call
# ---------------------------------------------------------------------------------------------------


def route_experts(model: torch.nn.Module, differentiable: bool) -> None:
    """Put every MoE feed-forward of `model` on diffusers' differentiable path (`differentiable`) or its
    no-grad inference path, whatever the model's own mode; routers stay in eval mode (no auxiliary loss,
    which diffusers would compute and discard). See the module docstring."""
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    for module in model.modules():
        if isinstance(module, MOEFeedForwardSwiGLU):
            module.train(differentiable)
            module.gate.eval()


def predict_velocity(
    model: HiDreamImageTransformer2DModel,
    noisy: torch.Tensor,
    t: torch.Tensor,
    t5: torch.Tensor,
    llama: torch.Tensor,
    pooled: torch.Tensor,
) -> torch.Tensor:
    """The flow velocity (noise − x0) for latents `noisy` [B, 16, H, W] at t ∈ [0, 1], as
    HiDreamImagePipeline calls the model. `t5` is [B, L, D], `llama` [B, layers, L, D] (every layer's
    hidden states), `pooled` [B, D_clip_l + D_clip_g]."""
    config = model.config
    p = config.patch_size
    b, _, h, w = noisy.shape
    tokens = (h // p) * (w // p)
    capacity = config.max_resolution[0] * config.max_resolution[1] // (p * p)
    if h != w and tokens > capacity:  # non-square latents are padded to `capacity` tokens
        raise ValueError(
            f"HiDream-I1 takes non-square latents of at most {capacity} tokens, got {h}×{w} latents "
            f"({tokens} tokens): use smaller images (at most about {config.max_resolution[0] * 8}² pixels)."
        )
    route_experts(model, torch.is_grad_enabled())
    out = model(
        hidden_states=noisy,
        timesteps=t * 1000,
        encoder_hidden_states_t5=t5.to(noisy.dtype),
        encoder_hidden_states_llama3=llama.transpose(0, 1).to(noisy.dtype),
        pooled_embeds=pooled.to(noisy.dtype),
        return_dict=False,
    )[0]
    return velocity(model, out, noisy)


def velocity(model: HiDreamImageTransformer2DModel, out: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """The model's output → the velocity (shape of `noisy`): in training mode the output is in the token
    layout [B, C, S, p·p], unfolded here; negated."""
    p = model.config.patch_size
    b, _, h, w = noisy.shape
    if model.training and not model.config.force_inference_output:  # the token layout [B, C, S, p·p]
        c = out.shape[1]
        out = out[:, :, : (h // p) * (w // p)].reshape(b, c, h // p, w // p, p, p).permute(0, 1, 2, 4, 3, 5)
        out = out.reshape(b, c, h, w)
    return -out


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# HiDreamImageTransformer2DModel.forward; every block is given its own Llama layer's projected hidden
# states, so all of them travel (stacked) with the streams. The contract suite checks the parts against
# the whole forward.


def embed(model: HiDreamImageTransformer2DModel, noisy: torch.Tensor, t: torch.Tensor, t5: torch.Tensor,
          llama: torch.Tensor, pooled: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """`predict_velocity`'s forward up to its first block: (image tokens, the initial text (T5 then the last
    Llama layer), every block's Llama layer stacked [blocks, B, L, D], the conditioning embedding, the
    rotary table, the image token mask or empty (non-square latents are padded))."""
    from tuner.archs.stages import optional

    b, dtype = noisy.shape[0], noisy.dtype
    route_experts(model, torch.is_grad_enabled())
    tokens, token_mask, _, image_ids = model.patchify(noisy)
    hidden = model.x_embedder(tokens)
    temb = model.t_embedder(t * 1000, dtype) + model.p_embedder(pooled.to(dtype))
    layers = llama.transpose(0, 1).to(dtype)
    texts = [model.caption_projection[i](layers[k]).view(b, -1, hidden.shape[-1])
             for i, k in enumerate(model.config.llama_layers)]  # fmt: skip
    texts.append(model.caption_projection[-1](t5.to(dtype)).view(b, -1, hidden.shape[-1]))
    text_ids = image_ids.new_zeros(b, texts[-1].shape[1] + texts[-2].shape[1] + texts[0].shape[1], 3)
    rope = model.pe_embedder(torch.cat((image_ids, text_ids), dim=1))
    initial = torch.cat([texts[-1], texts[-2]], dim=1)
    return hidden, initial, torch.stack(texts[:-1]), temb, rope, optional(token_mask, hidden)


def run_block(model: HiDreamImageTransformer2DModel, block: torch.nn.Module, carried: tuple) -> tuple:
    """One dual-stream block on the image tokens and the initial text with its Llama layer, or one
    single-stream block on image, initial text and its Llama layer joined (split again after it)."""
    from tuner.archs.stages import call_block, given

    hidden, initial, layers, temb, rope, token_mask = carried
    route_experts(block, torch.is_grad_enabled())
    duals = list(model.double_stream_blocks)
    mask = given(token_mask)
    if block in duals:
        text = torch.cat([initial, layers[duals.index(block)]], dim=1)
        hidden, text = call_block(model, block, hidden, mask, text, temb, rope)
        return hidden, text[:, : initial.shape[1]], layers, temb, rope, token_mask
    own = layers[len(duals) + list(model.single_stream_blocks).index(block)]
    if mask is not None:
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], initial.shape[1] + own.shape[1])], dim=1)
    joined = call_block(model, block, torch.cat([hidden, initial, own], dim=1), mask, None, temb, rope)
    n = hidden.shape[1]
    return joined[:, :n], joined[:, n : n + initial.shape[1]], layers, temb, rope, token_mask


def project_out(model: HiDreamImageTransformer2DModel, carried: tuple, noisy: torch.Tensor) -> torch.Tensor:
    """The forward after its last block: the final layer on the image tokens, unpatchified, the velocity."""
    hidden, temb = carried[0], carried[3]
    p = model.config.patch_size
    sizes = torch.tensor([[noisy.shape[-2] // p, noisy.shape[-1] // p]] * noisy.shape[0], device=noisy.device)
    return velocity(model, model.unpatchify(model.final_layer(hidden, temb), sizes, model.training), noisy)
