"""Block swap and activation offload on CPU, through a fake transfer device.

`FakeTransfer` keeps "device" copies apart from host masters, poisons weights that are not loaded and
device copies that were released (NaN), and in lazy mode delays every copy until its arrival event is
waited for. A schedule that computes a block before it arrives, after it left, or from a saved view of a
released weight therefore gives NaN, and an exact comparison with the same model without swapping
catches it. The trace the scheduler writes shows the order blocks arrive and leave.

The tiny models here are shared with the other memory tests (`tiny_wan`, `wan_inputs`, `add_lora`).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from diffusers import FluxTransformer2DModel, WanTransformer3DModel
from torch import nn

from project import wan_inputs
from tuner.errors import TunerError
from tuner.fixtures.weights import fill_random_
from tuner.networks import LoRANetwork, TargetSpec
from tuner.offload import BlockSwap, CheckpointBlocks, FakeTransfer, choose_blocks_to_swap

WAN_TARGETS = (r"blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0)", r"blocks\.\d+\.ffn\.net\.(0\.proj|2)")
FLUX_TARGETS = (
    r".*transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v)",
    r"single_transformer_blocks\.\d+\.proj_mlp",
)


# --- shared tiny models ------------------------------------------------------------------------------


def tiny_wan(num_layers: int = 4, seed: int = 0) -> WanTransformer3DModel:
    """A frozen 4-block Wan transformer (2 heads × 32, text dim 64, ffn 128) with distinct weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16,
            text_dim=64, freq_dim=64, ffn_dim=128, num_layers=num_layers, cross_attn_norm=True, rope_max_seq_len=32,
        )  # fmt: skip
    fill_random_(model, seed)
    return model.eval().requires_grad_(False)


def add_lora(model: nn.Module, targets=WAN_TARGETS, seed: int = 3) -> LoRANetwork:
    """Rank-4 LoRA with non-zero up matrices, so it changes outputs and every factor gets gradients."""
    lora = LoRANetwork.apply_to(model, TargetSpec(targets), rank=4)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return lora


def train_step(model: nn.Module, lora: LoRANetwork, inputs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(**inputs)[0]
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in lora.parameters()]


# --- helpers ---------------------------------------------------------------------------------------------


def prepared(model, checkpointing: str, swap: int | None, *, lazy=True, mode="h2d_only", trace=None):
    """`model` with checkpointing ('none' | 'diffusers' | 'offload') and `swap` blocks swapped, plus the
    fake device (None without swap/offload)."""
    fake = FakeTransfer(lazy=lazy)
    if checkpointing == "diffusers":
        model.enable_gradient_checkpointing()
        model.train()
    if checkpointing == "offload":
        CheckpointBlocks(model, ["blocks"], offload=True, transfer=fake, min_bytes=0)
    if swap is not None:
        BlockSwap(model, ["blocks"], swap, fake, mode=mode, trace=trace)
    return fake


def events(trace: list[str]) -> list[tuple[str, int]]:
    return [(kind, int(i)) for kind, i in (e.split() for e in trace)]


def check_schedule(trace: list[str], swapped: list[int], ring=2, backward=True, loaded=()) -> None:
    """Blocks are used in order (forward ascending, then backward descending), each only while loaded
    (`loaded`: those already on the device when the trace starts), never more than `ring` at once."""
    loaded = set(loaded)
    used = {"fwd": [], "bwd": []}
    for kind, i in events(trace):
        if kind == "load":
            assert i not in loaded
            loaded.add(i)
            assert len(loaded) <= ring
        elif kind == "leave":
            loaded.remove(i)
        elif kind in ("fwd", "bwd", "recompute"):
            assert i in loaded, f"block {i} used ({kind}) while not loaded: {trace}"
            if kind != "recompute":
                used[kind].append(i)
    assert used["fwd"] == swapped
    assert used["bwd"] == (list(reversed(swapped)) if backward else [])


# --- outputs and gradients are unchanged --------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", ["none", "diffusers", "offload"])
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy-copies", "eager-copies"])
@pytest.mark.parametrize("mode", ["h2d_only", "full"])
def test_swap_leaves_outputs_and_lora_gradients_identical(checkpointing, lazy, mode):
    reference = tiny_wan()
    prepared(reference, checkpointing, None)
    want_out, want_grads = train_step(reference, add_lora(reference), wan_inputs())

    model, trace = tiny_wan(), []
    prepared(model, checkpointing, 3, lazy=lazy, mode=mode, trace=trace)
    out, grads = train_step(model, add_lora(model), wan_inputs())

    assert torch.equal(out, want_out)
    for got, want in zip(grads, want_grads, strict=True):
        assert torch.equal(got, want)
    check_schedule(trace, [1, 2, 3])


def test_trace_shows_arrival_ahead_of_use_and_departure_after_use():
    model, trace = tiny_wan(), []
    prepared(model, "none", 3, trace=trace)
    train_step(model, add_lora(model), wan_inputs())
    assert trace == [
        "load 1", "load 2",  # the model's forward starts: the first two swapped blocks come in
        "fwd 1",
        "leave 1", "load 3",  # block 2 starts: block 1 is done, block 3 comes in behind it
        "fwd 2", "fwd 3",
        "bwd 3", "bwd-done 3",  # backward starts with the two blocks forward left in the ring
        "leave 3", "load 1",  # block 2's backward starts: 3 is done, 1 comes back
        "bwd 2", "bwd-done 2", "bwd 1", "bwd-done 1",
    ]  # fmt: skip


@pytest.mark.parametrize("checkpointing", ["none", "diffusers"])
def test_every_linear_computes_with_device_weights(checkpointing):
    model, trace = tiny_wan(), []
    fake = prepared(model, checkpointing, 3, trace=trace)
    lora = add_lora(model)
    seen = []

    def on_device(module, args):
        assert fake.is_device_tensor(module.weight), "computed with a weight that is not on the device"
        seen.append(module)

    for block in model.blocks[1:]:
        for m in block.modules():
            if isinstance(m, nn.Linear):
                m.register_forward_pre_hook(on_device)
    train_step(model, lora, wan_inputs())
    assert seen
    if checkpointing == "diffusers":  # recomputed in backward, with the block loaded again
        assert len(seen) == 2 * sum(isinstance(m, nn.Linear) for b in model.blocks[1:] for m in b.modules())


def test_the_fake_device_catches_a_missing_wait(monkeypatch):
    monkeypatch.setattr(FakeTransfer, "wait", lambda self, event: None)
    model = tiny_wan()
    prepared(model, "none", 3)
    out, _ = train_step(model, add_lora(model), wan_inputs())
    assert out.isnan().any()


def test_the_fake_device_catches_saved_views_of_released_weights(monkeypatch):
    """Without the saved-tensor hook, F.linear's saved weight view outlives the block's stay on the device."""
    monkeypatch.setattr(BlockSwap, "_saved_as_weight_refs", lambda self, block: contextlib.nullcontext())
    model = tiny_wan()
    prepared(model, "none", 3)
    out, grads = train_step(model, add_lora(model), wan_inputs())
    assert not out.isnan().any()
    assert any(g.isnan().any() for g in grads)


def test_trainable_parameters_never_move():
    reference = tiny_wan()
    reference.blocks[3].scale_shift_table.requires_grad_(True)
    _, want = train_step(reference, add_lora(reference), wan_inputs())

    model = tiny_wan()
    table = model.blocks[3].scale_shift_table.requires_grad_(True)
    fake = prepared(model, "none", 3)
    lora = add_lora(model)
    pointers = [p.data_ptr() for p in [table, *lora.parameters()]]
    _, got = train_step(model, lora, wan_inputs())
    train_step(model, lora, wan_inputs())
    assert [p.data_ptr() for p in [table, *lora.parameters()]] == pointers
    assert fake.is_device_tensor(table)
    assert torch.equal(table.grad, 2 * reference.blocks[3].scale_shift_table.grad)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_gradient_accumulation_over_two_passes():
    reference = tiny_wan()
    lora_ref = add_lora(reference)
    train_step(reference, lora_ref, wan_inputs(1))
    _, want = train_step(reference, lora_ref, wan_inputs(2))

    model, trace = tiny_wan(), []
    prepared(model, "diffusers", 4, trace=trace)
    lora = add_lora(model)
    train_step(model, lora, wan_inputs(1))
    first = list(trace)
    trace.clear()
    _, got = train_step(model, lora, wan_inputs(2))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    check_schedule(first, [0, 1, 2, 3])
    # The second pass finds blocks 0 and 1 still loaded by the first pass's backward.
    assert trace[:4] == ["fwd 0", "leave 0", "load 2", "fwd 1"]


def test_inference_passes_reload_from_the_start():
    reference = tiny_wan()
    add_lora(reference)
    model, trace = tiny_wan(), []
    prepared(model, "none", 3, trace=trace)
    add_lora(model)
    with torch.no_grad():
        for seed in (1, 2, 3):
            trace.clear()
            assert torch.equal(model(**wan_inputs(seed))[0], reference(**wan_inputs(seed))[0])
            check_schedule(trace, [1, 2, 3], backward=False, loaded={2, 3} if seed > 1 else ())


def test_ring_bounds_the_device_memory_of_swapped_blocks():
    model = tiny_wan()
    fake = FakeTransfer()
    swap = BlockSwap(model, ["blocks"], 4, fake, ring=2)
    resident = fake.device_bytes  # everything outside the blocks
    fake.reset_peak()
    train_step(model, add_lora(model), wan_inputs())
    assert fake.peak_bytes() - resident == 2 * swap.blocks[0].nbytes


def test_two_block_lists_and_tuple_outputs_flux():
    def flux():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            m = FluxTransformer2DModel(
                patch_size=1, in_channels=16, out_channels=16, num_layers=2, num_single_layers=2,
                attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                axes_dims_rope=(4, 6, 6),
            )  # fmt: skip
        return fill_random_(m, 0).eval().requires_grad_(False)

    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(1, 16, 16, generator=g), "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
        "pooled_projections": torch.randn(1, 32, generator=g), "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3), "return_dict": False,
    }  # fmt: skip
    reference = flux()
    want_out, want = train_step(reference, add_lora(reference, FLUX_TARGETS), inputs)
    model, trace = flux(), []
    BlockSwap(model, ["transformer_blocks", "single_transformer_blocks"], 3, FakeTransfer(), trace=trace)
    out, got = train_step(model, add_lora(model, FLUX_TARGETS), inputs)
    assert torch.equal(out, want_out)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    check_schedule(trace, [1, 2, 3])  # the last double block and both single blocks


def test_activation_offload_parks_exactly_the_block_inputs():
    model = tiny_wan()
    fake = prepared(model, "offload", None)
    inputs = wan_inputs()
    train_step(model, add_lora(model), inputs)
    parked = [shape for kind, shape in fake.log if kind == "offload"]
    # Per block: hidden states [1, 32 tokens, 64], text [1, 8, 64], timestep projection [1, 6, 64].
    assert parked == [(1, 32, 64), (1, 8, 64), (1, 6, 64)] * 4
    assert sorted(s for k, s in fake.log if k == "restore") == sorted(parked)


def test_refuses_to_swap_more_blocks_than_the_model_has():
    with pytest.raises(TunerError, match="between 0 and 4"):
        BlockSwap(tiny_wan(), ["blocks"], 5, FakeTransfer())
    with pytest.raises(TunerError, match="no block list 'layers'"):
        BlockSwap(tiny_wan(), ["layers"], 1, FakeTransfer())


# --- auto sizing --------------------------------------------------------------------------------------


def test_choose_blocks_to_swap_arithmetic():
    blocks = [100] * 10
    # All 10 swapped peaked at 1000 (ring of 2 = 200 of it). Each block kept adds 100.
    assert choose_blocks_to_swap(blocks, 10, 1000, budget=1400) == 7  # 5% headroom: 1330 usable
    assert choose_blocks_to_swap(blocks, 10, 1000, budget=1100) == 10
    assert choose_blocks_to_swap(blocks, 10, 1000, budget=10**9) == 0
    assert choose_blocks_to_swap(blocks, 10, 1000, budget=500) == 10  # does not fit at all: keep all swapped
    # Uneven blocks: the leading swapped blocks are kept first, and the ring holds the two largest.
    # Swapped [100, 300, 100, 100] peaked at 700 with 400 in the ring; keeping the first adds 100.
    assert choose_blocks_to_swap([50, 100, 300, 100, 100], 4, 700, budget=900) == 3
    # Keeping the 300 too: 300 more, but the ring then holds 200 instead of 400: 900 in all.
    assert choose_blocks_to_swap([50, 100, 300, 100, 100], 4, 700, budget=950) == 0


class _Synthetic(nn.Module):
    """Blocks of k_i 32×32 linear layers; each block adds its input back."""

    def __init__(self, layers_per_block: list[int]):
        super().__init__()
        self.stem = nn.Linear(32, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(*(nn.Linear(32, 32) for _ in range(k))) for k in layers_per_block
        )

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return x


def test_auto_picks_n_for_the_budget_from_measured_sizes():
    torch.manual_seed(0)
    model = _Synthetic([2] * 8).requires_grad_(False)
    reference = _Synthetic([2] * 8).requires_grad_(False)
    reference.load_state_dict(model.state_dict())
    block = 2 * (32 * 32 + 32) * 4  # bytes of one block
    stem = (32 * 32 + 32) * 4
    activations = 10_000
    fake = FakeTransfer(extra_bytes=activations)
    # Measured with all 8 swapped: stem + ring of 2 + activations. Room for 3 more blocks in the budget.
    budget = int((stem + 2 * block + activations + 3 * block + 100) / 0.95)
    swap = BlockSwap(model, ["blocks"], "auto", fake, budget_bytes=budget, probe_forwards=1)
    x = torch.randn(4, 32)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert swap.blocks_to_swap == 8
        assert torch.equal(model(x), reference(x))  # sized at the start of this pass
    assert swap.decisions == [5]
    assert swap.blocks_to_swap == 5 and [b.index for b in swap.swapped] == [3, 4, 5, 6, 7]
    assert all(fake.is_device_tensor(p) for p in model.blocks[0].parameters())


def test_block_bytes_count_only_what_travels():
    model = tiny_wan()
    table = model.blocks[0].scale_shift_table.requires_grad_(True)
    fake = FakeTransfer()
    swap = BlockSwap(model, ["blocks"], 4, fake)
    frozen = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters() if p is not table)
    assert swap.blocks[0].nbytes == frozen
    assert all(t is not table for t in swap.blocks[0].tensors)
    assert fake.is_device_tensor(table)


def test_a_stand_in_without_tensors_is_not_a_block_to_swap():
    """A pipeline stage's stand-in for a block another stage holds has nothing to stream: N counts the
    blocks this process holds."""

    def stage_view():
        model = tiny_wan()
        model.blocks[0] = nn.Identity()
        return model

    model = stage_view()
    swap = BlockSwap(model, ["blocks"], 3, FakeTransfer())
    assert swap.blocks_to_swap == 3 and len(swap.blocks) == 3 and swap.blocks[0].module is model.blocks[1]
    with pytest.raises(TunerError, match="between 0 and 3"):
        BlockSwap(stage_view(), ["blocks"], 4, FakeTransfer())


@pytest.mark.parametrize("signalled", [True, False])
def test_a_pipeline_stage_streams_its_blocks_through_interleaved_micro_batches(signalled):
    """As a pipeline stage runs them under 1F1B: the blocks called one by one (never the model), the
    forwards of later micro-batches between the backwards of earlier ones. With `forward_starts` before
    each micro-batch's forward, outputs and LoRA gradients equal the model's without swap (3 of 4 blocks
    swapped through a ring of 2, so blocks leave and come back); without it, the swap takes a later
    forward for a recomputation and the stage computes from released weights."""
    from tuner.archs.wan import loaders as wan

    order = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    micro = [wan_inputs(seed=s) for s in (1, 2, 3)]
    runs = []
    for swapped in (None, 3):
        model = tiny_wan()
        lora = add_lora(model)
        swap = None if swapped is None else BlockSwap(model, ["blocks"], swapped, FakeTransfer())
        outs = {}
        for kind, m in order:
            if kind == "B":
                outs[m].square().mean().backward()
                continue
            if swap is not None and signalled:
                swap.forward_starts()
            inputs = {k: v for k, v in micro[m].items() if k != "return_dict"}
            carried = wan.embed(model, inputs)
            for block in model.blocks:
                carried = wan.run_block(model, block, carried)
            outs[m] = wan.project_out(model, carried, inputs["hidden_states"])
        runs.append(([o.detach() for o in outs.values()], [p.grad.clone() for p in lora.parameters()]))
    (outs, grads), (swapped_outs, swapped_grads) = runs
    same = all(torch.equal(a, b) for a, b in zip(outs + grads, swapped_outs + swapped_grads, strict=True))
    assert same == signalled
