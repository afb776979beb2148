"""What happens before the first training step, checked by behaviour (speed is in benchmarks/startup.py).

Each epoch's plan is computed once: the summary, the step count and the epoch read the same plan. The
batch count is known without planning. Batches stack into pinned memory when asked and CUDA is there;
elsewhere the request is a no-op.
"""

from dataclasses import replace

import pytest
import torch

import tuner.cache.batches as batches_module
from project import cfg, make_cached_project
from test_datasets import make_spec
from tuner.cache import CacheStore
from tuner.cache.batches import TrainingData, TrainingSample
from tuner.trainers import trainer_class

WanTrainer = trainer_class("wan")


def _samples(counts: dict[tuple[int, str], int]) -> list[TrainingSample]:
    """`counts[(dataset, bucket)]` samples in that dataset's bucket."""
    return [
        TrainingSample("/c", f"l{d}{b}{i}", f"t{d}{b}{i}", "empty", b, dataset_index=d)
        for (d, b), n in counts.items()
        for i in range(n)
    ]


def _spec(index: int, batch_size: int, repeats: int = 1, dropout: float = 0.0):
    return replace(
        make_spec("/data"),
        index=index,
        batch_size=batch_size,
        num_repeats=repeats,
        caption_dropout_rate=dropout,
    )


@pytest.mark.parametrize("world", [1, 2, 3])
def test_batches_per_epoch_is_the_local_plan_length_without_planning(world, monkeypatch):
    samples = _samples({(0, "a"): 7, (0, "b"): 2, (1, "a"): 5, (1, "c"): 1})
    specs = (_spec(0, 3, repeats=2), _spec(1, 2, dropout=0.5))
    datas = [TrainingData(samples, specs, seed=1, num_workers=0, rank=r, world=world) for r in range(world)]
    lengths = {len(d.local_plan(e)) for d in datas for e in (0, 1, 2)}
    monkeypatch.setattr(batches_module, "plan_batches", _refuse)
    assert lengths == {d.batches_per_epoch() for d in datas}


def _refuse(*args):
    raise AssertionError("planned")


def test_each_epoch_is_planned_once_and_replans_when_the_epoch_changes(monkeypatch):
    calls = []
    real = batches_module.plan_batches
    monkeypatch.setattr(batches_module, "plan_batches", lambda *a: calls.append(a[3]) or real(*a))
    data = TrainingData(_samples({(0, "a"): 9}), (_spec(0, 2, dropout=0.3),), seed=3, num_workers=0)
    first = data.plan_epoch(0)
    assert data.plan_epoch(0) is first and data.local_plan(0) == first and calls == [0]
    data.summary()
    assert calls == [0]
    second = data.plan_epoch(1)
    assert calls == [0, 1] and second != first
    assert data.plan_epoch(0) == first  # replanned, and the same: a pure function of (seed, epoch)
    fresh = TrainingData(_samples({(0, "a"): 9}), (_spec(0, 2, dropout=0.3),), seed=3, num_workers=0)
    assert fresh.plan_epoch(1) == second


def test_no_dropout_keeps_every_caption_and_the_order_of_a_dropout_plan():
    """Without dropout no generator is seeded per batch; the batches are those a dropout plan draws."""
    samples = _samples({(0, "a"): 6, (0, "b"): 5})
    plain = TrainingData(samples, (_spec(0, 2),), seed=4, num_workers=0).plan_epoch(2)
    dropped = TrainingData(samples, (_spec(0, 2, dropout=0.5),), seed=4, num_workers=0).plan_epoch(2)
    assert all(tk != "empty" for batch in plain for _, _, tk in batch)
    assert any(tk == "empty" for batch in dropped for _, _, tk in batch)
    assert [[lk for _, lk, _ in b] for b in plain] == [[lk for _, lk, _ in b] for b in dropped]


def test_a_training_run_plans_its_first_epoch_once(tmp_path, wan_model, monkeypatch):
    config = make_cached_project(tmp_path / "project", wan_model)
    epochs = []
    real = batches_module.plan_batches
    monkeypatch.setattr(batches_module, "plan_batches", lambda *a: epochs.append(a[3]) or real(*a))
    run_cfg = cfg(
        config, f"save.output_dir='{tmp_path / 'out'}'", "log.tensorboard=false", "train.max_steps=1"
    )
    WanTrainer(run_cfg).train(log=lambda s: None)
    # one plan_batches per dataset, for epoch 0 only: the summary and the step count did not plan
    assert len(run_cfg.datasets) > 1 and epochs == [0] * len(run_cfg.datasets)


def test_long_lived_objects_are_out_of_the_collectors_reach_while_training(tmp_path, wan_model, monkeypatch):
    """Opening the data and every step run with the objects set up before them frozen (a full collection
    would walk torch, diffusers and the model again); training gives them back when it ends."""
    import gc

    config = make_cached_project(tmp_path / "project", wan_model)
    frozen = []
    real = WanTrainer._step
    monkeypatch.setattr(WanTrainer, "_step", lambda self, run, batch: frozen.append(gc.get_freeze_count())
                        or real(self, run, batch))  # fmt: skip
    run_cfg = cfg(
        config, f"save.output_dir='{tmp_path / 'out'}'", "log.tensorboard=false", "train.max_steps=2"
    )
    WanTrainer(run_cfg).train(log=lambda s: None)
    assert frozen and min(frozen) > 10_000  # torch alone is far more objects than that
    assert gc.get_freeze_count() == 0


# -- pinned memory ---------------------------------------------------------------------------------


def _cached_batches(root, pin: bool) -> tuple[TrainingData, list[dict]]:
    with CacheStore(root).writer() as w:
        for i in range(4):
            w.put(
                f"latent{i}",
                "latent",
                {"latents": torch.full((2, 1, 4, 4), float(i)), "control_0": torch.ones(3)},
            )
            w.put(f"text{i}", "text", {"context": torch.full((3, 8), float(i))})
    samples = [TrainingSample(str(root), f"latent{i}", f"text{i}", "text0", "b", 0) for i in range(4)]
    data = TrainingData(samples, (_spec(0, 2),), seed=0, num_workers=0, pin_memory=pin)
    return data, list(data.epoch(0))


def test_pinning_is_a_no_op_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(batches_module, "_pinned", _refuse)
    data, batches = _cached_batches(tmp_path, pin=True)
    assert not data.pin_memory and len(batches) == 2


def test_batches_stack_into_pinned_buffers_when_cuda_is_there(tmp_path, monkeypatch):
    """The logic on a CPU machine: CUDA is said to be there and the pinned allocator is replaced by
    one that records the buffers it hands out."""
    _, plain = _cached_batches(tmp_path / "plain", pin=False)
    given = []

    def pinned(shape, dtype):
        given.append(torch.empty(shape, dtype=dtype))
        return given[-1]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(batches_module, "_pinned", pinned)
    data, pinned_batches = _cached_batches(tmp_path / "pinned", pin=True)
    assert data.pin_memory and len(given) == 4  # latents and control_0 of each of two batches
    stacked = [t for b in pinned_batches for t in (b["latents"], b["extra"]["control_0"])]
    assert [t.data_ptr() for t in stacked] == [t.data_ptr() for t in given]
    for a, b in zip(plain, pinned_batches):
        assert torch.equal(a["latents"], b["latents"])
        assert torch.equal(a["extra"]["control_0"], b["extra"]["control_0"])
