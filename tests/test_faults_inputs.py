"""Bad input that used to pass silently or with an unclear message: a resolution that is not a multiple of
the model's step, a control image without its item, a file that is not safetensors given to
`tuner lora info`, NaN in the base model's weights. docs/reliability.md lists the guarantees these back."""

from __future__ import annotations

import os
import pickle

import pytest

from project import cfg, make_cached_project, run
from test_datasets import image, make_spec
from tuner.data import discover_items, plan_latent_jobs
from tuner.errors import DataError, TrainingError
from tuner.trainers import trainer_class

WanTrainer = trainer_class("wan")


def test_a_resolution_that_is_not_a_multiple_of_the_step_says_what_it_becomes(tmp_path):
    image(tmp_path / "imgs" / "a.png", caption="a")
    spec = make_spec(tmp_path / "imgs", resolution=(30, 17))
    jobs, problems = plan_latent_jobs(spec, discover_items(spec)[0], step=16)
    assert jobs[0].bucket == (16, 16, 1)
    note = next(p for p in problems if "resolution" in p)
    assert "key 'resolution' [30, 17] is not a multiple of the model's spatial step 16" in note, note
    assert "the largest 16×16" in note and "Use [32, 16]" in note, note
    # a multiple of the step says nothing
    spec = make_spec(tmp_path / "imgs", resolution=(32, 16))
    assert not [p for p in plan_latent_jobs(spec, discover_items(spec)[0], step=16)[1] if "resolution" in p]


def test_a_control_image_without_its_item_is_refused_like_an_orphan_mask(tmp_path):
    """flux_kontext and the other edit models pair control images by stem: one whose name matches no
    item (a typo) was ignored, and the item it was meant for trained without it or was left out."""
    image(tmp_path / "imgs" / "cat.png", caption="a cat")
    image(tmp_path / "controls" / "cat.png")
    spec = make_spec(tmp_path / "imgs", control_directory=str(tmp_path / "controls"))
    assert discover_items(spec)[0][0].control_paths[0].endswith("controls/cat.png")
    image(tmp_path / "controls" / "dgo.png")  # meant for an item "dog" that is not there
    with pytest.raises(DataError, match=r"controls/dgo.png: a control image for a missing item"):
        discover_items(spec)


@pytest.mark.parametrize("protocol", [0, 1, 5])
def test_lora_info_on_a_renamed_pickle_refuses_it_as_a_pickle(tmp_path, capsys, protocol):
    path = tmp_path / "adapter.safetensors"
    path.write_bytes(pickle.dumps({"x.lora_A.weight": [1.0] * 64}, protocol=protocol))
    code, log = run(capsys, "lora", "info", path)
    assert (
        code == 2 and f"{path}: not a safetensors file (it is a pickle: refused, never unpickled)" in log
    ), log
    assert "header too large" not in log and "download" not in log and "Traceback" not in log, log


def test_lora_info_on_random_bytes_says_it_is_not_safetensors(tmp_path, capsys):
    path = tmp_path / "adapter.safetensors"
    path.write_bytes(os.urandom(4096))
    code, log = run(capsys, "lora", "info", path)
    assert code == 2 and f"{path}: not a safetensors file (its header claims" in log, log
    assert "damaged or not an adapter" in log and "header too large" not in log, log


@pytest.fixture(scope="module")
def project(tmp_path_factory, wan_model):
    return make_cached_project(tmp_path_factory.mktemp("inputs_project"), wan_model)


class _NanBase(WanTrainer):
    """A trainer whose base model holds a NaN weight, as a damaged checkpoint would."""

    def load_transformer(self, dtype):
        model = super().load_transformer(dtype)
        next(p for n, p in model.named_parameters() if n.endswith("weight")).data.fill_(float("nan"))
        return model


def test_nan_in_the_base_weights_is_named_as_the_cause(project, tmp_path):
    t = _NanBase(cfg(project, f"save.output_dir='{tmp_path / 'out'}'", "log.tensorboard=false",
                     "train.max_steps=2"))  # fmt: skip
    with pytest.raises(TrainingError) as e:
        t.train(log=lambda s: None)
    message = str(e.value)
    assert "step 1:" in message and "the base model's weights hold NaN or infinity (first:" in message, (
        message
    )
    assert f"model.transformer = {t.cfg.model.transformer}" in message and "damaged" in message, message
    assert "train.learning_rate" not in message  # not blamed on the settings


def test_a_nan_from_training_does_not_blame_the_base_weights(project, tmp_path):
    t = WanTrainer(cfg(project, f"save.output_dir='{tmp_path / 'out'}'", "log.tensorboard=false",
                       "train.max_steps=2", "network.alpha=1e30"))  # fmt: skip
    with pytest.raises(TrainingError) as e:
        t.train(log=lambda s: None)
    assert "base model" not in str(e.value) and "network.alpha" in str(e.value), str(e.value)
