"""The cache store: round trips, crash safety, concurrent readers, prune/compaction, hash memo, info.

Child processes are forked from the test process (no second torch import), like DataLoader workers.
"""

import multiprocessing
import os
import pickle
import re
import signal
import sqlite3
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import tuner.cache.store as store_module
import tuner.cache.writer as writer_module
from tuner.cache import CacheStore, format_info
from tuner.cache.keys import hash_file
from tuner.errors import CacheError, DataError

FORK = multiprocessing.get_context("fork")
REPO = Path(__file__).resolve().parents[1]


def _key(i: int) -> str:
    return f"key{i:05d}"


def _latent(i: int) -> torch.Tensor:
    return (torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5) + i).to(torch.bfloat16)


def _fill(store: CacheStore, indices, max_entries: int = 4) -> None:
    with store.writer(max_entries=max_entries) as w:
        for i in indices:
            w.put(_key(i), "latent", {"latents": _latent(i)}, {"bucket": "64x64x1", "index": i})


def _assert_entries(store: CacheStore, indices) -> None:
    for i in indices:
        assert torch.equal(store.get(_key(i))["latents"], _latent(i)), i
        assert store.meta(_key(i))["index"] == i


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _shard_files(root) -> set[str]:
    return {p.name for p in (Path(root) / "shards").iterdir()}


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
    ],
)
def test_put_get_round_trip_is_bit_exact(tmp_path, dtype):
    source = torch.randn(3, 5, 7) * 4
    batch = torch.randn(4, 16, 8).to(dtype)
    tensors = {
        "latents": source.to(dtype),
        "transposed": source.to(dtype).transpose(0, 2),  # non-contiguous input
        "row": batch[1],  # a view into a larger batch tensor
        "scalar": torch.tensor(3).to(dtype),
        "empty": torch.zeros(0, 4, dtype=dtype),
    }
    store = CacheStore(tmp_path)
    with store.writer() as w:
        w.put("k", "latent", tensors, {"bucket": "7x5x3", "crop": [0, 1, 2, 3]})
    for reopened in (store, CacheStore(tmp_path), CacheStore(tmp_path, readonly=True)):
        got = reopened.get("k")
        assert list(got) == list(tensors)
        for name, t in tensors.items():
            assert got[name].dtype == dtype and got[name].shape == t.shape, name
            assert torch.equal(_bytes(got[name]), _bytes(t.contiguous())), name
        assert reopened.meta("k") == {"bucket": "7x5x3", "crop": [0, 1, 2, 3]}


def test_returned_tensors_are_private_copies_on_write(tmp_path):
    store = CacheStore(tmp_path)
    _fill(store, [0])
    got = store.get(_key(0))["latents"]
    got.mul_(0)  # must not crash (read-only map) nor change the shard
    _assert_entries(CacheStore(tmp_path), [0])


def test_readers_and_batching(tmp_path):
    store = CacheStore(tmp_path)
    with store.writer(max_entries=3) as w:
        for i in range(7):
            w.put(_key(i), "latent" if i % 2 else "text", {"x": torch.full((4,), i)})
        w.put(_key(0), "text", {"x": torch.full((4,), 100)})  # replaces the buffered entry
    assert len(_shard_files(tmp_path)) == 3  # 3 + 3 + 1 entries
    assert store.has(_key(6)) and not store.has("nope")
    assert store.missing(["a", _key(1), "b", "a"]) == ["a", "b", "a"]
    assert store.keys() == [_key(i) for i in range(7)]
    assert store.keys(kind="latent") == [_key(1), _key(3), _key(5)]
    assert store.get(_key(0))["x"].tolist() == [100] * 4
    with pytest.raises(CacheError, match="nope"):
        store.get("nope")
    with pytest.raises(CacheError, match="nope"):
        store.meta("nope")


def test_writer_flushes_by_bytes(tmp_path):
    store = CacheStore(tmp_path)
    with store.writer(max_shard_bytes=1000) as w:
        for i in range(5):
            w.put(_key(i), "latent", {"x": torch.zeros(100)})  # 400 bytes: two per shard
        w.put("big", "latent", {"x": torch.zeros(1000)})  # larger than a shard: alone
    assert len(_shard_files(tmp_path)) == 4


def test_put_validates_early(tmp_path):
    with CacheStore(tmp_path).writer() as w:
        with pytest.raises(TypeError, match="JSON"):
            w.put("k", "latent", {"x": torch.zeros(1)}, {"crop": torch.tensor([1])})
        with pytest.raises(TypeError, match="complex"):
            w.put("k", "latent", {"x": torch.zeros(1, dtype=torch.complex64)})
        with pytest.raises(TypeError, match="not a tensor"):
            w.put("k", "latent", {"x": [1.0]})
        with pytest.raises(ValueError):
            w.put("k", "latent", {})


def test_error_in_the_body_keeps_entries_put_before_it(tmp_path):
    store = CacheStore(tmp_path)
    with pytest.raises(RuntimeError), store.writer() as w:
        w.put(_key(0), "latent", {"latents": _latent(0)}, {"index": 0})
        raise RuntimeError("encoder crashed")
    _assert_entries(store, [0])


def test_store_pickles_by_address(tmp_path):
    store = CacheStore(tmp_path)
    _fill(store, [0, 1])
    store.get(_key(0))
    clone = pickle.loads(pickle.dumps(store))
    _assert_entries(clone, [0, 1])


# -- format and errors ---------------------------------------------------------------------------


def test_newer_format_is_refused_with_the_fix(tmp_path):
    CacheStore(tmp_path).close()
    with sqlite3.connect(tmp_path / "index.sqlite") as conn:
        conn.execute("UPDATE store SET value = '2' WHERE name = 'format_version'")
    for readonly in (False, True):
        with pytest.raises(CacheError, match=rf"{re.escape(str(tmp_path))}.*version 2.*delete"):
            CacheStore(tmp_path, readonly=readonly)


def test_foreign_index_is_refused(tmp_path):
    with sqlite3.connect(tmp_path / "index.sqlite") as conn:
        conn.execute("CREATE TABLE items (x)")
    with pytest.raises(CacheError, match="not a tuner cache"):
        CacheStore(tmp_path)


def test_readonly_needs_an_existing_store(tmp_path):
    with pytest.raises(CacheError, match="run caching"):
        CacheStore(tmp_path / "missing", readonly=True)
    store = CacheStore(tmp_path)
    _fill(store, [0])
    store.close()  # the last connection closes: the WAL files are gone, read-only must still work
    readonly = CacheStore(tmp_path, readonly=True)
    _assert_entries(readonly, [0])
    with pytest.raises(CacheError, match="read-only"):
        readonly.writer()


# -- crash safety --------------------------------------------------------------------------------


def _write_then_die(root, indices, die_at_shard):
    """Child: write `indices` in shards of 3; SIGKILL itself after shard `die_at_shard` is renamed."""
    shards = 0

    def hook(path):
        nonlocal shards
        shards += 1
        if shards == die_at_shard:
            os.kill(os.getpid(), signal.SIGKILL)

    writer_module._before_index_commit = hook
    _fill(CacheStore(root), indices, max_entries=3)


def test_kill_between_shard_rename_and_index_commit(tmp_path):
    child = FORK.Process(target=_write_then_die, args=(tmp_path, range(9), 2))
    child.start()
    child.join()
    assert child.exitcode == -signal.SIGKILL
    store = CacheStore(tmp_path)
    assert store.keys() == [_key(i) for i in range(3)]  # the first shard only
    _assert_entries(store, range(3))
    assert len(_shard_files(tmp_path)) == 2  # plus the orphan of the second
    (tmp_path / "shards" / ".x.safetensors.abc.tmp").write_bytes(b"half")  # a kill mid-write
    missing = store.missing(_key(i) for i in range(9))
    _fill(store, [int(k[3:]) for k in missing], max_entries=3)  # the re-run: orphans removed first
    assert len(_shard_files(tmp_path)) == 3
    _assert_entries(CacheStore(tmp_path), range(9))


def _write_forever(root):
    # Slow the commit down so kills land in every phase: writing, between rename and commit, idle.
    writer_module._before_index_commit = lambda path: time.sleep(0.005)
    _fill(CacheStore(root), range(100_000), max_entries=4)


def test_sigkill_mid_flight_leaves_whole_shards_that_a_second_writer_completes(tmp_path):
    store = CacheStore(tmp_path)
    child = FORK.Process(target=_write_forever, args=(tmp_path,))
    child.start()
    deadline = time.monotonic() + 20
    while len(store.keys()) < 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    committed = store.keys()
    assert len(committed) >= 40 and len(committed) % 4 == 0  # shards commit whole or not at all
    indices = sorted(int(k[3:]) for k in committed)
    assert indices == list(range(len(indices)))
    _assert_entries(store, indices)
    _fill(store, [int(k[3:]) for k in store.missing(_key(i) for i in range(len(indices) + 10))])
    _assert_entries(CacheStore(tmp_path), range(len(indices) + 10))
    referenced = {
        row[0] for row in sqlite3.connect(tmp_path / "index.sqlite").execute("SELECT shard FROM entries")
    }
    assert _shard_files(tmp_path) == referenced  # no orphan or temp file survived the re-run


# -- concurrency ---------------------------------------------------------------------------------


class _Latents(Dataset):
    def __init__(self, store, indices):
        self.store, self.indices = store, list(indices)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        return self.indices[i], self.store.get(_key(self.indices[i]))["latents"]


def _append_slowly(root, indices):
    writer_module._before_index_commit = lambda path: time.sleep(0.02)
    _fill(CacheStore(root), indices, max_entries=2)


def _read_until(root, done):
    store = CacheStore(root, readonly=True)
    _assert_entries(store, range(40))  # loads this process's location map now
    while True:
        finished = done.is_set()
        # Keys committed after the map was loaded are found by a lookup on miss.
        _assert_entries(store, sorted(int(k[3:]) for k in store.keys()))
        if finished:
            break
    assert len(store.keys()) == 80


def test_concurrent_readers_while_a_writer_appends(tmp_path):
    store = CacheStore(tmp_path)
    _fill(store, range(40), max_entries=8)
    _assert_entries(store, range(40))  # the parent holds a connection and maps before forking
    writer = FORK.Process(target=_append_slowly, args=(tmp_path, range(40, 80)))
    done = FORK.Event()
    reader = FORK.Process(target=_read_until, args=(tmp_path, done))
    writer.start()
    reader.start()
    loader = DataLoader(
        _Latents(store, range(40)), batch_size=4, shuffle=True, num_workers=2, multiprocessing_context=FORK
    )
    for _ in range(2):
        for indices, latents in loader:
            for i, latent in zip(indices.tolist(), latents):
                assert torch.equal(latent, _latent(i))
    writer.join()
    done.set()
    reader.join()
    assert writer.exitcode == 0 and reader.exitcode == 0
    _assert_entries(store, range(80))


# -- prune and compaction ------------------------------------------------------------------------


def _shard_of(root, key) -> str:
    return (
        sqlite3.connect(Path(root) / "index.sqlite")
        .execute("SELECT shard FROM entries WHERE key = ?", (key,))
        .fetchone()[0]
    )


def test_prune_deletes_entries_and_empty_shards_and_compacts_sparse_ones(tmp_path):
    store = CacheStore(tmp_path)
    _fill(store, range(12))  # shards A: 0-3, B: 4-7, C: 8-11
    a, b, c = (_shard_of(tmp_path, _key(i)) for i in (0, 4, 8))
    stale_reader = CacheStore(tmp_path)
    stale_reader.get(_key(0))  # its location map now points key 4 at shard B
    keep = {_key(i) for i in (0, 1, 2, 3, 4, 8, 9)}  # A whole, B 1/4 live, C 1/2 live
    assert store.prune(keep) == 5
    assert _shard_of(tmp_path, _key(0)) == a and _shard_of(tmp_path, _key(8)) == c
    assert _shard_of(tmp_path, _key(4)) not in (a, b, c)  # B was rewritten
    assert len(_shard_files(tmp_path)) == 3
    assert store.keys() == sorted(keep)
    _assert_entries(store, [0, 1, 2, 3, 4, 8, 9])
    _assert_entries(stale_reader, [4])  # B is gone: the reader looks key 4 up again
    assert store.prune(set()) == 7
    assert _shard_files(tmp_path) == set() and store.info()["entries"] == 0


def test_prune_refuses_while_a_writer_is_open(tmp_path):
    store = CacheStore(tmp_path)
    with store.writer(), pytest.raises(CacheError, match="writer is open"):
        store.prune(set())


def test_compaction_killed_midway_leaves_a_valid_store(tmp_path, monkeypatch):
    store = CacheStore(tmp_path)
    _fill(store, range(8))

    def crash(path):
        raise RuntimeError("killed")

    monkeypatch.setattr(writer_module, "_before_index_commit", crash)
    with pytest.raises(RuntimeError):
        store.prune({_key(0), _key(4)})  # both shards sparse: compaction writes, then "dies"
    monkeypatch.setattr(writer_module, "_before_index_commit", None)
    _assert_entries(CacheStore(tmp_path), [0, 4])
    assert store.prune({_key(0), _key(4)}) == 0  # completes the compaction, removes the orphan
    assert len(_shard_files(tmp_path)) == 1
    _assert_entries(CacheStore(tmp_path), [0, 4])


# -- source hashes -------------------------------------------------------------------------------


def _set_mtime(path, seconds_ago):
    ns = time.time_ns() - int(seconds_ago * 1e9)
    os.utime(path, ns=(ns, ns))
    return ns


def test_hash_source_memoizes_and_sees_changes(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(store_module, "hash_file", lambda p: calls.append(p) or hash_file(p))
    video = tmp_path / "clip.mp4"
    video.write_bytes(b"a" * 1000)
    _set_mtime(video, 100)
    store = CacheStore(tmp_path / "cache")
    first = store.hash_source(video)
    assert first == hash_file(video)
    assert CacheStore(tmp_path / "cache").hash_source(video) == first  # a re-run reads nothing
    assert len(calls) == 1

    video.write_bytes(b"b" * 1000)  # same size, new mtime
    _set_mtime(video, 90)
    assert store.hash_source(video) == hash_file(video) != first and len(calls) == 2

    video.write_bytes(b"b" * 1001)  # new size, mtime forced back to the recorded one
    os.utime(video, ns=(os.stat(video).st_atime_ns, _set_mtime(video, 90)))
    assert store.hash_source(video) == hash_file(video) and len(calls) == 3

    replacement = tmp_path / "new.mp4"  # same size and mtime, but a new file put in place by rename
    replacement.write_bytes(b"c" * 1001)
    stat = os.stat(video)
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(replacement, video)
    assert store.hash_source(video) == hash_file(video) and len(calls) == 4

    video.write_bytes(b"d" * 1001)  # just modified: not memoized (it may change again this tick)
    store.hash_source(video)
    store.hash_source(video)
    assert len(calls) == 6

    with pytest.raises(DataError, match="gone.mp4"):
        store.hash_source(tmp_path / "gone.mp4")


# -- info ----------------------------------------------------------------------------------------


def test_info_counts_and_format(tmp_path):
    store = CacheStore(tmp_path)
    with store.writer(max_entries=2) as w:
        for i in range(5):
            bucket = "832x480x33" if i < 3 else "480x832x33"
            w.put(f"l{i}", "latent", {"latents": torch.zeros(16)}, {"bucket": bucket, "encoder": "wan-vae"})
        for i in range(2):
            w.put(f"t{i}", "text", {"embeds": torch.zeros(8)}, {"encoder": "umt5"})
    info = store.info()
    assert info["entries"] == 7 and info["shards"] == 4
    assert info["kinds"] == {"latent": 5, "text": 2}
    assert info["buckets"] == {"480x832x33": 2, "832x480x33": 3}
    assert info["encoders"] == {"umt5": 2, "wan-vae": 5}
    assert info["live_bytes"] == 5 * 64 + 2 * 32
    assert info["bytes"] > info["live_bytes"]
    text = format_info(info)
    assert str(tmp_path) in text and "7 entries in 4 shards" in text
    assert re.search(r"832x480x33\s+3", text) and re.search(r"umt5\s+2", text)


# -- benchmark -----------------------------------------------------------------------------------
