"""Damaged cache shards: checksums catch flipped bytes, truncation and header damage; reads name the
entry and the command that repairs it; caching re-encodes exactly the damaged entries."""

import json
import os
from pathlib import Path

import pytest
import torch

from project import cfg, make_project, run, summary
from tuner.cache.reads import EntryReads
from tuner.cache.shards import checksum_update, read_header, tensors_checksum
from tuner.cache.store import CacheStore, DamagedEntryError
from tuner.cache.writer import ShardWriter


def _key(i: int) -> str:
    return f"{i:064x}"


def _fill(root: Path, n: int = 6, max_entries: int = 1024) -> CacheStore:
    store = CacheStore(root)
    with store.writer(max_entries=max_entries) as w:
        for i in range(n):
            latents = torch.arange(4096, dtype=torch.float32).reshape(16, 256) + i
            w.put(_key(i), "latent", {"latents": latents}, {"source": f"/data/img_{i}.png"})
    return store


def _flip(store: CacheStore, key: str, at: int = 1000, keep_mtime: bool = False) -> None:
    """Flip one bit of `key`'s tensor bytes in its shard file, as a later edit would (its mtime moves
    on; the kernel's mtime clock ticks every few ms, so a test must move it), or with `keep_mtime`
    as bits rotting in place would (nothing about the file changes but its bytes)."""
    location = CacheStore(store.root, readonly=True).locate(key)
    path = store.shards_dir / location.shard
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(location.tensors[0].offset + at)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    mtime = st.st_mtime_ns if keep_mtime else st.st_mtime_ns + 1_000_000_000
    os.utime(path, ns=(st.st_atime_ns, mtime))


# -- the checksum --------------------------------------------------------------------------------


def test_checksum_sees_every_single_bit_flip_and_swapped_blocks():
    data = bytearray(torch.randn(3 * 1024 + 3, generator=torch.Generator().manual_seed(0)).numpy().tobytes())
    base = checksum_update(0, "x", torch.float32, (len(data) // 4,), data)
    for pos in range(0, len(data), 97):
        for bit in (0, 7):
            data[pos] ^= 1 << bit
            assert checksum_update(0, "x", torch.float32, (len(data) // 4,), data) != base, (pos, bit)
            data[pos] ^= 1 << bit
    swapped = data[4096:8192] + data[:4096] + data[8192:]
    assert checksum_update(0, "x", torch.float32, (len(data) // 4,), swapped) != base
    assert checksum_update(0, "x", torch.bfloat16, (len(data) // 2,), data) != base  # a header edit


def test_writer_records_the_checksum_readers_compute(tmp_path):
    store = _fill(tmp_path)
    shard = next(store.shards_dir.glob("*.safetensors"))
    meta = read_header(shard)[0]["__metadata__"]
    sums = json.loads(meta["checksums"])
    assert len(sums) == 6 and meta["checksum"] == "blocksum64-crc32"
    assert sums["0/"] == tensors_checksum({"latents": store.get(_key(0))["latents"]})
    assert store.verify().damaged == {}


# -- reads ---------------------------------------------------------------------------------------


def test_flipped_byte_is_named_on_read_and_by_verify(tmp_path):
    store = _fill(tmp_path)
    _flip(store, _key(2))
    reader = CacheStore(tmp_path, readonly=True)
    for i in (0, 1, 3):
        assert torch.equal(reader.get(_key(i))["latents"][0, :3], torch.tensor([0.0, 1, 2]) + i)
    with pytest.raises(DamagedEntryError, match=r"img_2\.png.*tuner cache latents"):
        reader.get(_key(2))
    report = reader.verify()
    assert set(report.damaged) == {_key(2)} and report.checked == 6 and "checksum" in report.damaged[_key(2)]
    assert reader.missing([_key(1), _key(2)], verify=True) == [_key(2)]
    assert reader.missing([_key(1), _key(2)]) == []  # without verify: only the index is asked


def test_reads_check_checksums_only_in_shards_changed_since_they_were_known_good(tmp_path):
    store = _fill(tmp_path)
    _flip(store, _key(2), keep_mtime=True)  # rot in place: the stamp is unchanged
    reader = CacheStore(tmp_path, readonly=True)
    assert reader.get(_key(2))["latents"].shape == (16, 256)  # read as known good: not caught here
    assert reader.verify(trust_stamps=True).damaged == {}
    assert list(reader.verify().damaged) == [_key(2)]  # `tuner cache verify` reads everything
    CacheStore(tmp_path).verify()  # a failed full check records nothing
    assert list(CacheStore(tmp_path).verify(trust_stamps=True).damaged) == []
    _flip(store, _key(2), keep_mtime=True)  # flipped back
    os.utime(next(store.shards_dir.glob("*.safetensors")))  # touched: no longer known good
    writable = CacheStore(tmp_path)
    assert writable.verify(trust_stamps=True).bytes_read > 0  # checked in full, then recorded
    assert writable.verify(trust_stamps=True).bytes_read == 0


def test_damage_found_in_a_worker_is_raised_in_the_main_process(tmp_path):
    store = _fill(tmp_path)
    _flip(store, _key(4))
    reads = EntryReads([[(str(tmp_path), _key(i))] for i in range(6)])
    with pytest.raises(DamagedEntryError, match=r"img_4\.png") as e:
        list(reads.load(num_workers=1))
    assert "Traceback" not in str(e.value)  # raised by the main process's view, not re-raised from the worker


def test_truncated_shard_damages_only_the_entries_past_its_end(tmp_path):
    store = _fill(tmp_path)
    shard = next(store.shards_dir.glob("*.safetensors"))
    last = CacheStore(tmp_path, readonly=True).locate(_key(5)).tensors[0]
    os.truncate(shard, last.offset + 100)
    reader = CacheStore(tmp_path, readonly=True)
    assert reader.get(_key(0))["latents"].shape == (16, 256)
    with pytest.raises(DamagedEntryError, match="truncated"):
        reader.get(_key(5))
    assert list(reader.verify(trust_stamps=True).damaged) == [_key(5)]

    os.truncate(shard, 20)  # into the header: every entry of the shard is damaged
    reader = CacheStore(tmp_path, readonly=True)
    with pytest.raises(DamagedEntryError, match="unreadable"):
        reader.get(_key(0))
    assert len(reader.verify().damaged) == 6


def test_entries_of_shards_without_checksums_are_read_unverified(tmp_path, monkeypatch):
    from tuner.cache import writer as writer_module

    # An older tuner wrote no checksum metadata.
    real_save = writer_module.save_safetensors
    monkeypatch.setattr(
        writer_module,
        "save_safetensors",
        lambda tensors, path, metadata: real_save(
            tensors, path, {"format": "tuner-cache-shard", "version": 1}
        ),
    )
    store = _fill(tmp_path)
    monkeypatch.undo()
    _flip(store, _key(1))
    reader = CacheStore(tmp_path, readonly=True)
    assert reader.get(_key(1))["latents"].shape == (16, 256)  # read, not verifiable
    report = reader.verify()
    assert report.damaged == {} and report.unverified == 6 and reader.unverified_entries() == 6


def test_compaction_drops_damaged_entries_instead_of_blessing_them(tmp_path):
    store = _fill(tmp_path, n=8, max_entries=4)
    _flip(store, _key(1))
    keep = {_key(i) for i in (0, 1)}  # shard one keeps 2 of 4 entries: below 0.5 live, compacted
    store.prune(keep, compact_below=0.6)
    reader = CacheStore(tmp_path, readonly=True)
    assert reader.keys() == [_key(0)] and reader.verify().damaged == {}


# -- the commands --------------------------------------------------------------------------------


@pytest.fixture
def project(tmp_path, wan_model) -> Path:
    return make_project(tmp_path, wan_model)


def test_caching_reencodes_exactly_the_damaged_entries_and_training_names_them(project, capsys):
    assert summary(run(capsys, "cache", "latents", "--config", project)[1]) == (6, 0, 0)
    run(capsys, "cache", "text", "--config", project)
    cache = project.parent / "cache"
    store = CacheStore(cache, readonly=True)
    key = next(k for k in store.keys("latent") if "image_001" in store.meta(k)["source"])
    _flip(store, key, at=17)

    code, out = run(capsys, "cache", "verify", cache)
    assert code == 2 and "image_001.png" in out and "1 damaged" in out

    code, out = run(capsys, "train", "--config", project)
    assert code == 2 and "image_001.png" in out and "tuner cache latents --config" in out
    assert "Traceback" not in out

    code, out = run(capsys, "cache", "latents", "--config", project)
    assert (
        code == 0 and summary(out) == (1, 5, 0) and "re-encoded 1 damaged" in out and "image_001.png" in out
    )
    assert run(capsys, "cache", "verify", cache)[0] == 0

    video = next(k for k in store.keys("latent") if "video_001" in store.meta(k)["source"])
    shard = cache / "shards" / CacheStore(cache, readonly=True).locate(video).shard
    os.truncate(shard, shard.stat().st_size - 100)  # the first run's shard loses its last bytes
    encoded, reused, _ = summary(run(capsys, "cache", "latents", "--config", project)[1])
    assert encoded >= 1 and encoded + reused == 6
    assert run(capsys, "cache", "verify", cache)[0] == 0


def test_training_reads_a_store_it_cannot_write(project, capsys, monkeypatch):
    """Training opens the store read-only: nothing it does may write to the index."""
    run(capsys, "cache", "latents", "--config", project)
    run(capsys, "cache", "text", "--config", project)
    from tuner.archs.wan.trainer import WanModel
    from tuner.cache import index
    from tuner.cache import store as store_module
    from tuner.cache.plan import open_training_data

    opened = []
    real = index.connect
    monkeypatch.setattr(
        store_module, "connect", lambda root, readonly: opened.append(readonly) or real(root, readonly)
    )
    data = open_training_data(WanModel(cfg(project)), cfg(project), log=lambda s: None)
    assert next(iter(data.epoch(0)))["latents"].shape[0] >= 1
    assert opened and not any(readonly is False for readonly in opened)


def test_writer_commits_on_its_interval(tmp_path):
    store = CacheStore(tmp_path)
    writer = ShardWriter(tmp_path, 1 << 30, 1024, lock=None, commit_every_seconds=0)
    writer.put(_key(0), "latent", {"x": torch.ones(3)})
    assert store.keys() == [_key(0)]  # committed before the writer closes
    writer.close()
    with store.writer(commit_every_seconds=3600) as w:
        w.put(_key(1), "latent", {"x": torch.ones(3)})
        assert store.keys() == [_key(0)]
    assert store.keys() == [_key(0), _key(1)]


# -- killed and concurrent caching runs ------------------------------------------------------------

# Runs `tuner` with WanModel.encode_pixels slowed down and announcing each call on stdout, so the
# test knows how far the run got. Item k is put (and, with commit_every_seconds = 0, committed)
# before call k + 1 starts.
_SLOW_TUNER = """
import sys, time
from tuner.archs.wan.trainer import WanModel
real = WanModel.encode_pixels
def slow(self, vae, pixels):
    print("encoding", flush=True)
    time.sleep(float(sys.argv[1]))
    return real(self, vae, pixels)
WanModel.encode_pixels = slow
from tuner.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _start_slow_caching(project: Path, *settings: str, delay: float = 0.2):
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "HF_HUB_OFFLINE": "1"}
    argv = ["cache", "latents", "--config", str(project), "--batch-size", "1"]
    for s in settings:
        argv += ["--set", s]
    return subprocess.Popen(
        [sys.executable, "-c", _SLOW_TUNER, str(delay), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for_calls(proc, n: int) -> None:
    for _ in range(n):
        line = proc.stdout.readline()
        assert line.startswith("encoding"), (line, proc.stderr.read() if proc.poll() is not None else "")


def _committed(project: Path) -> int:
    return len(CacheStore(project.parent / "cache", readonly=True).keys("latent"))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_killed_caching_run_keeps_what_it_encoded(project, capsys, how):
    """SIGKILL after K items, committing every item: K kept. SIGTERM after K items with a long
    commit interval: the signal commits them on the way out."""
    import signal

    k = 3
    interval = "0" if how == "SIGKILL" else "3600"
    proc = _start_slow_caching(project, f"cache.commit_every_seconds={interval}")
    try:
        _wait_for_calls(proc, k + 1)  # call k + 1 started: item k was put
        proc.send_signal(getattr(signal, how))
        proc.wait(timeout=60)
    finally:
        proc.kill()
    if how == "SIGTERM":
        err = proc.stderr.read()
        assert proc.returncode == 2 and "interrupted by SIGTERM" in err and "Traceback" not in err
    kept = _committed(project)
    assert k <= kept < 6
    assert summary(run(capsys, "cache", "latents", "--config", project)[1]) == (6 - kept, kept, 0)


@pytest.mark.slow
def test_a_second_caching_run_waits_and_reuses_the_first_runs_entries(project, capsys):
    first = _start_slow_caching(project, delay=0.3)
    try:
        _wait_for_calls(first, 1)  # it holds the lock and has planned its work
        code, out = run(capsys, "cache", "latents", "--config", project)
        assert first.wait(timeout=60) == 0
    finally:
        first.kill()
    assert code == 0 and "waiting for it to finish" in out and summary(out) == (0, 6, 0)
