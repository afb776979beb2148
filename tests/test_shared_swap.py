"""One host copy of the swapped weights for all processes on a machine (`tuner.offload.shared`), in one
process: the segment file and its checks, and the handshake and block swap with two threads standing in
for two processes (each maps the file itself, as a process would). `test_shared_swap_ddp.py` trains with
two real processes."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import pytest
import torch

from project import wan_inputs
from test_blockswap import add_lora, tiny_wan, train_step
from tuner import fp8
from tuner.config.schema import MemorySettings
from tuner.errors import TunerError
from tuner.memory import apply_memory_settings
from tuner.offload import BlockSwap, FakeTransfer
from tuner.offload.shared import (
    HEADER_BYTES,
    PREFIX,
    SHM,
    Layout,
    Mismatch,
    NoRoom,
    attach,
    mapped_segments,
    publish,
    share_host_copies,
    sweep_stale,
)


def weights(seed: int = 0) -> list[torch.Tensor]:
    """Tensors of the dtypes a swapped block holds: bf16 and fp32 weights, fp8 weights with scales."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, 5, generator=g).to(torch.bfloat16),
        torch.randn(7, generator=g),
        torch.randn(64, 64, generator=g).to(torch.float8_e4m3fn),
        torch.rand(64, 1, generator=g),
        torch.randn(2, 3, generator=g).t(),  # not contiguous
    ]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


class ThreadPeers:
    """`Peers` for threads: `exchange` posts on a shared board and waits for everyone."""

    def __init__(self, board: dict, rank: int):
        self.board, self.rank, self.size = board, rank, board["size"]

    def exchange(self, obj):
        self.board["slots"][self.rank] = obj
        self.board["barrier"].wait()
        got = list(self.board["slots"])
        self.board["barrier"].wait()  # nobody posts the next round before everyone has read this one
        return got


def as_peers(work, size: int = 2) -> list:
    """Run `work(peers)` in `size` threads that are each other's peers; their results by rank."""
    board = {"size": size, "slots": [None] * size, "barrier": threading.Barrier(size, timeout=60)}
    results, errors = [None] * size, []

    def run(rank):
        try:
            results[rank] = work(ThreadPeers(board, rank))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
            board["barrier"].abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def leftovers(directory: Path = SHM, *copies) -> list[Path]:
    """Segment files left in `directory`; given the test's `SharedHostCopy`s, only theirs (their names, the
    `.partial` being written): other tests' processes may be publishing segments of their own meanwhile."""
    found = sorted(Path(directory).glob(PREFIX + "*"))
    if copies:
        names = {c.path.name for c in copies}
        found = [p for p in found if p.name.removesuffix(".partial") in names]
    return found


# --- the segment ---------------------------------------------------------------------------------------


def test_published_segment_is_the_memory_attach_maps(tmp_path):
    tensors, path = weights(), tmp_path / f"{PREFIX}k1"
    layout = Layout.of(tensors)
    leader = publish(tensors, layout, path, "k1")
    other = attach(weights(), layout, path, "k1")
    assert os.path.getsize(path) == HEADER_BYTES + layout.nbytes == leader.nbytes
    for copy in (leader, other):
        assert all(same_bytes(m, t) for m, t in zip(copy.masters, tensors, strict=True))
        assert all(m.data_ptr() % 256 == 0 for m in copy.masters)
    assert leader.buffer.data_ptr() != other.buffer.data_ptr()  # two mappings ...
    leader.masters[1][0] = 123.0
    assert other.masters[1][0] == 123.0  # ... of one memory
    leader.unlink()
    assert not path.exists()
    assert other.masters[1][0] == 123.0  # the memory outlives the name


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("key", "header"),  # a stale segment of another run
        ("content", "tensor 2 of 5 differs"),
        ("size", "bytes, expected"),
    ],
)
def test_attach_refuses_a_segment_that_is_not_this_runs(tmp_path, change, message):
    tensors, path = weights(), tmp_path / f"{PREFIX}k1"
    layout = Layout.of(tensors)
    publish(tensors, layout, path, "k1")
    mine, key = weights(), "k1"
    if change == "key":
        key = "k2"
    elif change == "content":
        mine[2] = (mine[2].float() + 1).to(torch.float8_e4m3fn)
    else:
        mine[1] = torch.zeros(7 + 64)
        layout = Layout.of(mine)
    with pytest.raises(Mismatch, match=message):
        attach(mine, layout, path, key)


def test_no_room_says_what_it_needs_and_has(tmp_path, monkeypatch):
    monkeypatch.setattr("tuner.offload.shared.shm_free_bytes", lambda directory: 2**30)
    tensors = [torch.empty(2**30, device="meta")]  # 4 GiB of fp32, never allocated: refused before writing
    with pytest.raises(NoRoom, match=r"has 1\.00 GiB free, the shared copy .* needs 4\.00 GiB.*--shm-size"):
        publish(tensors, Layout.of(tensors), tmp_path / f"{PREFIX}k", "k")
    assert list(tmp_path.iterdir()) == []


def test_sweep_removes_only_segments_no_live_process_holds(tmp_path):
    stale, live = tmp_path / f"{PREFIX}dead", tmp_path / f"{PREFIX}alive"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    (tmp_path / "other-file").write_bytes(b"x")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a leader still setting up (another run on this machine)
    try:
        assert sweep_stale(tmp_path) == [stale]
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-file", f"{PREFIX}alive"]


# --- the handshake ------------------------------------------------------------------------------------------


def test_handshake_maps_one_segment_and_removes_its_name(tmp_path):
    (tmp_path / f"{PREFIX}stale").write_bytes(b"left by a killed run")
    tensors = weights()
    results = as_peers(lambda peers: share_host_copies(tensors, peers, tmp_path))
    (a, note_a), (b, note_b) = results
    assert a.inode == b.inode and a.path == b.path
    assert note_a == note_b and "shared by 2 processes" in note_a
    assert list(tmp_path.iterdir()) == []  # the name is gone, and so is the stale segment
    for copy in (a, b):
        assert all(same_bytes(m, t) for m, t in zip(copy.masters, tensors, strict=True))
    a.masters[0].fill_(1)
    assert torch.equal(b.masters[0], torch.ones(3, 5, dtype=torch.bfloat16))


def test_processes_swapping_different_weights_keep_their_own(tmp_path):
    results = as_peers(lambda peers: share_host_copies(weights()[: 4 + peers.rank], peers, tmp_path))
    assert results == [(None, "the processes on this machine swap different weights")] * 2
    assert list(tmp_path.iterdir()) == []


def test_no_room_falls_back_on_every_process(tmp_path, monkeypatch):
    monkeypatch.setattr("tuner.offload.shared.shm_free_bytes", lambda directory: 1000)
    results = as_peers(lambda peers: share_host_copies(weights(), peers, tmp_path))
    for copy, why in results:
        assert copy is None and "GiB free" in why and "share_swapped_weights" in why
    assert list(tmp_path.iterdir()) == []


def test_a_failing_leader_never_leaves_the_others_waiting(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr("tuner.offload.shared.publish", broken)
    results = as_peers(lambda peers: share_host_copies(weights(), peers, tmp_path))
    (a, why), second = results
    assert a is None and second == (None, why)
    assert why.startswith(f"could not write {tmp_path}/{PREFIX}") and why.endswith(
        "(RuntimeError: disk on fire)"
    )


def test_a_process_with_other_weights_keeps_its_own_copy(tmp_path):
    def work(peers):
        mine = weights()
        if peers.rank == 1:
            mine[0] = mine[0] + 1
        return share_host_copies(mine, peers, tmp_path)

    (leader, _), (other, why) = as_peers(work)
    assert leader is not None and other is None and "differs from this process's weights" in why
    assert list(tmp_path.iterdir()) == []


# --- block swap on a shared copy -------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_base", [False, True], ids=["bf16", "fp8"])
def test_block_swap_on_a_shared_copy_trains_like_a_private_one(fp8_base):
    def model():
        m = tiny_wan().to(torch.bfloat16)
        if fp8_base:
            fp8.quantize_linears(m, prefixes=["blocks"])
        return m

    reference = model()
    BlockSwap(reference, ["blocks"], 3, FakeTransfer())
    want_out, want_grads = train_step(reference, add_lora(reference), wan_inputs(dtype=torch.bfloat16))

    def build(peers):
        m, fake = model(), FakeTransfer()
        return m, fake, BlockSwap(m, ["blocks"], 3, fake, peers=peers)

    built = as_peers(build)
    inodes = {swap.shared.inode for _, _, swap in built}
    assert len(inodes) == 1 and leftovers(SHM, *(swap.shared for _, _, swap in built)) == []
    segments = [s for s in mapped_segments() if s.inode in inodes]
    assert len(segments) == 2  # this process maps it twice (once per thread), and each mapping is half its
    nbytes = built[0][2].shared.nbytes
    assert all(0 <= s.size - nbytes < 4096 and s.pss * 2 == s.rss == s.size for s in segments)
    for m, fake, swap in built:
        masters = [t for block in swap.swapped for t in block.masters]
        assert all(t.untyped_storage().data_ptr() == swap.shared.buffer.data_ptr() for t in masters)
        assert (torch.float8_e4m3fn in {t.dtype for t in masters}) == fp8_base
        assert fake.log[0] == ("page_lock", swap.shared.nbytes)
        assert swap.summary().endswith(f"; host copy shared by 2 processes ({swap.shared.nbytes / 2**20:.0f} "
                                       f"MiB in {swap.shared.path})")  # fmt: skip
        out, grads = train_step(m, add_lora(m), wan_inputs(dtype=torch.bfloat16))
        assert torch.equal(out, want_out)
        for got, want in zip(grads, want_grads, strict=True):
            assert torch.equal(got, want)
        swap.remove()
        assert fake.log[-1][0] == "page_unlock" and not fake.page_locked and swap.shared is None


def test_a_refused_page_lock_warns_and_still_shares(caplog):
    def build(peers):
        m, fake = tiny_wan(), FakeTransfer()
        fake.lockable = False
        return BlockSwap(m, ["blocks"], 2, fake, peers=peers)

    swaps = as_peers(build)
    assert all(s.shared is not None for s in swaps)
    assert "could not page-lock the shared host copy" in caplog.text
    for s in swaps:
        s.remove()
        assert not any(kind == "page_unlock" for kind, _ in s.transfer.log)


def test_two_experts_get_a_segment_each(monkeypatch):
    """Wan 2.2's experts each go through `apply_memory_settings`: one handshake and one segment each."""
    peers_of_thread: dict[int, ThreadPeers] = {}
    monkeypatch.setattr("tuner.memory.machine_peers", lambda: peers_of_thread[threading.get_ident()])
    settings = MemorySettings(blocks_to_swap=2, fp8_base=True)

    def experts(peers):
        peers_of_thread[threading.get_ident()] = peers
        return [
            apply_memory_settings(tiny_wan(seed=seed), settings, "cpu", transfer=FakeTransfer()).block_swap
            for seed in (1, 2)  # low, high
        ]

    (low_a, high_a), (low_b, high_b) = as_peers(experts)
    assert low_a.shared.inode == low_b.shared.inode != high_a.shared.inode == high_b.shared.inode
    assert not torch.equal(low_a.shared.buffer[HEADER_BYTES:], high_a.shared.buffer[HEADER_BYTES:])
    assert leftovers(SHM, low_a.shared, high_a.shared) == []


def test_full_mode_and_the_switch_keep_private_copies(monkeypatch):
    def no_handshake():
        raise AssertionError("asked the other processes")

    monkeypatch.setattr("tuner.memory.machine_peers", no_handshake)
    for settings in (MemorySettings(blocks_to_swap=2, swap_mode="full"),
                     MemorySettings(blocks_to_swap=2, share_swapped_weights=False)):  # fmt: skip
        swap = apply_memory_settings(tiny_wan(), settings, "cpu", transfer=FakeTransfer()).block_swap
        assert swap.shared is None and "host copy" not in swap.summary()
    with pytest.raises(TunerError, match="cannot be shared"):
        BlockSwap(tiny_wan(), ["blocks"], 2, FakeTransfer(), mode="full", peers=ThreadPeers({"size": 1}, 0))
