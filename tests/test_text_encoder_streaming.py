"""Text encoders larger than the GPU: `cache.text_encoder_blocks_to_swap` streams their layers.

On this CPU-only machine the CUDA copy engine is replaced by `FakeTransfer`, which keeps "device" copies
apart from the host masters and poisons a weight that is used without being loaded, so a layer run
before its copy arrived gives wrong numbers instead of passing unnoticed.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from transformers import UMT5Config, UMT5EncoderModel

from project import cfg, run, summary
from tuner import memory
from tuner.cache.store import CacheStore
from tuner.errors import ConfigError
from tuner.fixtures.weights import fill_random_
from tuner.offload import FakeTransfer


def tiny_umt5() -> UMT5EncoderModel:
    config = UMT5Config(
        vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_heads=4,
        relative_attention_num_buckets=8,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        return fill_random_(UMT5EncoderModel(config), 0).eval()


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_a_streamed_encoder_gives_the_resident_outputs(precision):
    resident = tiny_umt5()
    streamed = copy.deepcopy(resident)
    memory.place_text_encoder(resident, precision, "cpu")
    fake = FakeTransfer()
    memory.place_text_encoder(streamed, precision, "cpu", blocks_to_swap=99, transfer=fake)  # clipped to 3
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = resident(input_ids=ids).last_hidden_state
        for _ in range(2):  # the second batch streams the layers again
            assert torch.equal(streamed(input_ids=ids).last_hidden_state, want)
    # three layers through a ring of two slots, twice: 0 1 2, then 0 (1 is still there) and 2
    assert [op for op, _ in fake.log].count("load") == 5


def test_the_layer_stack_is_the_largest_module_list():
    assert memory.text_encoder_layers(tiny_umt5()) == "encoder.block"


def test_quantized_bitsandbytes_layers_are_not_streamed(tmp_path):
    with pytest.raises(ConfigError, match="cannot be streamed"):
        memory.place_text_encoder(tiny_umt5(), "nf4", "cpu", blocks_to_swap=1, transfer=FakeTransfer())
    config = tmp_path / "train.toml"
    config.write_text(
        '[model]\narchitecture = "wan"\ntransformer = "t.safetensors"\n[data]\ndataset_config = "d.toml"\n'
        '[cache]\ntext_encoder_dtype = "nf4"\ntext_encoder_blocks_to_swap = 4\n'
    )
    with pytest.raises(ConfigError, match="text_encoder_blocks_to_swap = 4 cannot stream bitsandbytes nf4"):
        cfg(config)


def test_every_architecture_caches_the_same_text_with_streamed_layers(
    contract, tmp_path, capsys, monkeypatch
):
    """`tuner cache text` with one layer of each text encoder streamed writes entries bit-identical to the
    resident encoders' (the contract project's cache), under the same keys."""
    arch, config, _ = contract
    project = tmp_path / "project"
    shutil.copytree(config.parent, project, ignore=shutil.ignore_patterns("cache", "output"))
    streamed = []
    real = memory.stream_text_encoder
    monkeypatch.setattr(memory, "transfer_for", lambda device: FakeTransfer())
    monkeypatch.setattr(memory, "stream_text_encoder", lambda *a, **k: streamed.append(a[1]) or real(*a, **k))
    code, out = run(
        capsys,
        "cache",
        "text",
        "--config",
        project / config.name,
        "--set",
        "cache.text_encoder_blocks_to_swap=1",
    )
    assert code == 0, out
    want = CacheStore(config.parent / "cache", readonly=True)
    got = CacheStore(project / "cache", readonly=True)
    # entries of token ids alone (HiDream-O1, whose network embeds its prompt itself): no encoder runs
    ids_only = all(not t.is_floating_point() for key in want.keys("text") for t in want.get(key).values())
    if ids_only:
        assert not streamed, f"{arch}: caches token ids, yet streamed an encoder"
    else:
        assert streamed and set(streamed) == {1}, f"{arch}: load_text_encoder does not pass the stream count"
    keys = got.keys("text")
    assert summary(out) == (len(keys), 0, 0) and sorted(keys) == sorted(want.keys("text"))
    for key in keys:
        a, b = want.get(key), got.get(key)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), (
            f"{arch}: {got.describe(key)}"
        )
