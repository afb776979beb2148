"""Split reads: workers locate and prefetch entries, the main process views them out of its own maps.

Checks that locations round-trip to identical tensors in any process, that a loader with workers
yields exactly what one without yields (fork and spawn), that no tensor bytes cross processes, and
that reads survive workers exiting, a writer appending and a prune compacting shards.
"""

import multiprocessing
import pickle
import time
from dataclasses import replace

import pytest
import torch

import tuner.cache.writer as writer_module
from test_datasets import make_spec
from tuner.cache import CacheStore
from tuner.cache import reads as reads_module
from tuner.cache.batches import TrainingData, TrainingSample
from tuner.cache.reads import EntryReads, close_workers
from tuner.errors import CacheError

FORK = multiprocessing.get_context("fork")


def _key(i: int) -> str:
    return f"key{i:05d}"


def _entry(i: int) -> dict[str, torch.Tensor]:
    """Two tensors of different dtypes and shapes, so locations carry more than one of each."""
    latents = torch.arange(4 * 3 * 8 * 8, dtype=torch.float32).reshape(4, 3, 8, 8) + i
    return {
        "latents": latents.to(torch.bfloat16),
        "context": torch.full((5, 6), float(i)),
        "n": torch.tensor(i),
    }


def _fill(root, indices, max_entries: int = 4) -> None:
    with CacheStore(root).writer(max_entries=max_entries) as w:
        for i in indices:
            w.put(_key(i), "latent", _entry(i))


def _assert_entry(tensors: dict[str, torch.Tensor], i: int) -> None:
    expected = _entry(i)
    assert list(tensors) == list(expected)
    for name, t in expected.items():
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), (i, name)


def _groups(root, indices, size: int) -> list[list[tuple[str, str]]]:
    indices = list(indices)
    return [[(str(root), _key(i)) for i in indices[j : j + size]] for j in range(0, len(indices), size)]


def _flatten(batches) -> list[dict[str, torch.Tensor]]:
    return [entry for batch in batches for entry in batch]


# -- locations -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int64, torch.bool]
)
def test_locations_round_trip_to_identical_tensors(tmp_path, dtype):
    tensors = {
        "x": (torch.randn(3, 5, 7) * 4).to(dtype),
        "scalar": torch.tensor(1).to(dtype),
        "empty": torch.zeros(0, 4, dtype=dtype),
    }
    with CacheStore(tmp_path).writer() as w:
        w.put("other", "latent", {"y": torch.ones(9)})  # so the entry does not start the shard
        w.put("k", "latent", tensors)
    locating = CacheStore(tmp_path, readonly=True)
    location = pickle.loads(pickle.dumps(locating.locate("k")))  # as a worker sends it
    assert location.key == "k" and [t.name for t in location.tensors] == list(tensors)
    viewing = CacheStore(tmp_path, readonly=True)  # another process's maps
    for got in (viewing.view(location), viewing.get("k"), locating.view(location)):
        assert list(got) == list(tensors)
        for name, t in tensors.items():
            assert got[name].dtype == dtype and got[name].shape == t.shape
            assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def _locate_in_child(root, indices, queue):
    store = CacheStore(root, readonly=True)
    locations = [store.locate(_key(i)) for i in indices]
    for location in locations:
        store.prefetch(location)
    queue.put(locations)


def test_location_made_in_another_process_views_without_copying(tmp_path):
    _fill(tmp_path, range(6))
    queue = FORK.Queue()
    child = FORK.Process(target=_locate_in_child, args=(tmp_path, range(6), queue))
    child.start()
    locations = queue.get(timeout=60)
    child.join()
    store = CacheStore(tmp_path, readonly=True)
    for i, location in enumerate(locations):
        viewed = store.view(location)
        _assert_entry(viewed, i)
        # Zero-copy: the same bytes as a plain read in this process, i.e. the same map.
        assert viewed["latents"].data_ptr() == store.get(_key(i))["latents"].data_ptr()


def test_workers_send_locations_not_bytes(tmp_path):
    _fill(tmp_path, range(4))
    item = EntryReads(_groups(tmp_path, range(4), 4))[0]
    entry_bytes = sum(t.nbytes for t in _entry(0).values())
    assert len(pickle.dumps(item)) < entry_bytes  # 4 entries' locations weigh less than 1 entry


# -- loaders ---------------------------------------------------------------------------------------


def test_workers_yield_the_same_batches_as_the_main_process(tmp_path):
    _fill(tmp_path, range(30))
    reads = EntryReads(_groups(tmp_path, range(30), 4))  # the last group is short

    def load(workers):
        return list(reads.load(workers, shuffle=True, generator=torch.Generator().manual_seed(3)))

    in_process = load(0)
    with_workers = load(2)  # fork, the default on Linux
    assert len(in_process) == len(with_workers) == 8
    for a, b in zip(in_process, with_workers):
        assert [int(e["n"]) for e in a] == [int(e["n"]) for e in b]
        for ea, eb in zip(a, b):
            _assert_entry(eb, int(ea["n"]))
    assert sorted(int(e["n"]) for e in _flatten(with_workers)) == list(range(30))


def test_spawned_workers_yield_the_same_batches(tmp_path):
    _fill(tmp_path, range(12))
    reads = EntryReads(_groups(tmp_path, range(12), 3))
    reads.store(str(tmp_path)).get(_key(0))  # the main process has state: it must pickle by address
    spawned = _flatten(reads.load(2, multiprocessing_context="spawn"))
    assert [int(e["n"]) for e in spawned] == list(range(12))
    for i, entry in enumerate(spawned):
        _assert_entry(entry, i)


def test_tensors_stay_valid_after_workers_exit(tmp_path):
    _fill(tmp_path, range(16))
    reads = EntryReads(_groups(tmp_path, range(16), 2))
    loaded = _flatten(reads.load(2))
    close_workers()  # the workers exit, and their maps are gone
    for i, entry in enumerate(loaded):
        _assert_entry(entry, i)
        # Not copies: the bytes of the main process's own map of the shard.
        assert entry["latents"].data_ptr() == reads.store(str(tmp_path)).get(_key(i))["latents"].data_ptr()
    entry = loaded[0]
    entry["latents"].mul_(0)  # copy-on-write: must neither crash nor reach the shard
    _assert_entry(CacheStore(tmp_path, readonly=True).get(_key(0)), 0)


def _append_slowly(root, indices):
    writer_module._before_index_commit = lambda path: time.sleep(0.02)
    _fill(root, indices, max_entries=2)


def test_reading_while_another_process_appends(tmp_path):
    _fill(tmp_path, range(20))
    reads = EntryReads([])
    store = reads.store(str(tmp_path))
    _assert_entry(store.get(_key(0)), 0)  # the main process has its row map loaded before the appends
    writer = FORK.Process(target=_append_slowly, args=(tmp_path, range(20, 60)))
    writer.start()
    passes = 0
    while True:
        finished = not writer.is_alive()
        committed = sorted(int(k[3:]) for k in store.keys())
        # Each pass forks workers that locate entries committed since the last pass, and the main
        # process views them from shards it has not mapped yet.
        reads.groups = _groups(tmp_path, committed, 3)
        loaded = _flatten(reads.load(2))
        assert [int(e["n"]) for e in loaded] == committed
        for i, entry in zip(committed, loaded):
            _assert_entry(entry, i)
        passes += 1
        if finished:
            break
    writer.join()
    assert writer.exitcode == 0 and passes >= 2 and len(committed) == 60


def test_prune_between_locate_and_view(tmp_path):
    _fill(tmp_path, range(8))  # shards A: 0-3, B: 4-7
    worker = CacheStore(tmp_path, readonly=True)
    locations = {i: worker.locate(_key(i)) for i in (0, 4, 5)}
    mapped_before = CacheStore(tmp_path, readonly=True)
    mapped_before.view(locations[4])  # maps B
    kept = mapped_before.view(locations[4])["latents"]
    CacheStore(tmp_path).prune({_key(i) for i in (0, 1, 2, 3, 4)})  # B is 1/4 live: compacted away
    assert not (tmp_path / "shards" / locations[4].shard).exists()
    _assert_entry(mapped_before.view(locations[4]), 4)  # its map of B outlives the file
    assert torch.equal(kept, _entry(4)["latents"])
    fresh = CacheStore(tmp_path, readonly=True)
    _assert_entry(fresh.view(locations[4]), 4)  # B is gone: located again by key
    worker.prefetch(locations[4])  # the worker still maps B: harmless
    CacheStore(tmp_path, readonly=True).prefetch(locations[4])  # B unmapped and gone: a no-op
    _assert_entry(fresh.view(locations[0]), 0)
    with pytest.raises(CacheError, match=_key(5)):
        fresh.view(locations[5])  # pruned: its shard is gone and the key too


# -- training batches ------------------------------------------------------------------------------


def test_training_batches_are_the_planned_entries_with_and_without_workers(tmp_path):
    with CacheStore(tmp_path).writer() as w:
        for i in range(7):
            w.put(f"latent{i}", "latent", {"latents": torch.full((2, 1, 4, 4), float(i))})
            w.put(f"text{i}", "text", {"context": torch.full((3, 8), float(i))})
        w.put("empty", "text", {"context": torch.zeros(1, 8)})
    samples = [
        TrainingSample(str(tmp_path), f"latent{i}", f"text{i}", "empty", f"b{i % 2}", dataset_index=0)
        for i in range(7)
    ]
    spec = replace(make_spec("/data"), batch_size=2, num_repeats=2, caption_dropout_rate=0.3)
    by_workers = {}
    for workers in (0, 2):
        data = TrainingData(samples, (spec,), seed=5, num_workers=workers)
        by_workers[workers] = [list(data.epoch(e)) for e in (0, 1)] + [list(data.epoch(1, start=3))]
    plan = data.plan_epoch(1)
    assert any(tk == "empty" for batch in plan for _, _, tk in batch)  # dropout is exercised
    for workers, (_, epoch1, resumed) in by_workers.items():
        assert len(epoch1) == len(plan) and _same_batches(resumed, epoch1[3:]), workers
        for batch, planned in zip(epoch1, plan):
            expected = torch.stack([torch.full((2, 1, 4, 4), float(lk[6:])) for _, lk, _ in planned])
            assert torch.equal(batch["latents"], expected)
            assert [t["context"][0, 0].item() for t in batch["text"]] == [
                0.0 if tk == "empty" else float(tk[4:]) for _, _, tk in planned
            ]
    for a, b in zip(by_workers[0], by_workers[2]):
        assert _same_batches(a, b)


def _same_batches(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x["latents"], y["latents"])
        and len(x["text"]) == len(y["text"])
        and all(
            list(tx) == list(ty) and all(torch.equal(tx[n], ty[n]) for n in tx)
            for tx, ty in zip(x["text"], y["text"])
        )
        for x, y in zip(a, b)
    )


# -- persistent workers ----------------------------------------------------------------------------


def _worker_pids() -> list[int]:
    (loader,) = reads_module._IDLE[(2, None)]
    return [w.pid for w in loader._iterator._workers]


def test_workers_persist_across_passes_and_follow_each_pass_order(tmp_path):
    close_workers()
    _fill(tmp_path, range(24))
    first = [int(e["n"]) for e in _flatten(EntryReads(_groups(tmp_path, range(24), 3)).load(2))]
    pids = _worker_pids()
    order = [5, 17, 2, 23, 11, 0, 8, 14, 20]  # another epoch: other groups, in another order
    second = [int(e["n"]) for e in _flatten(EntryReads(_groups(tmp_path, order, 2)).load(2))]
    assert first == list(range(24)) and second == order
    assert _worker_pids() == pids  # the same processes served both passes
    close_workers()
    assert reads_module._IDLE == {}


def test_a_pass_inside_a_pass_and_an_abandoned_pass(tmp_path):
    """Validation runs inside a training epoch (two loaders at once); an epoch cut short (max_steps)
    leaves read-ahead batches in the workers, which the next pass must not yield."""
    close_workers()
    _fill(tmp_path, range(20))
    outer = EntryReads(_groups(tmp_path, range(10), 2)).load(2)
    got = [int(e["n"]) for e in next(outer)]
    inner = _flatten(EntryReads(_groups(tmp_path, range(10, 20), 2)).load(2))
    got += [int(e["n"]) for e in _flatten(outer)]
    assert got == list(range(10)) and [int(e["n"]) for e in inner] == list(range(10, 20))
    assert len(reads_module._IDLE[(2, None)]) == 2

    cut = EntryReads(_groups(tmp_path, range(20), 1)).load(2)
    assert [int(e["n"]) for e in next(cut)] == [0]
    cut.close()
    again = _flatten(EntryReads(_groups(tmp_path, range(19, -1, -1), 1)).load(2))
    assert [int(e["n"]) for e in again] == list(range(19, -1, -1))
    close_workers()
