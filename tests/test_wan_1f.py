"""One-frame Wan (`wan_1f`): the frames' RoPE time positions, the frame order of a cached item, the model
call, the settings in the latent cache key, `tuner generate` of one frame, and bad settings refused.

The contract suite (test_contract*.py) runs its user paths (cache, train, generate) on its fixture.
"""

import pytest
import torch

from project import cfg, make_project, run
from tuner.archs.wan.frame_positions import frame_positions
from tuner.archs.wan.trainer_i2v import LatentEncoders
from tuner.cache.plan import latent_encoder
from tuner.errors import ConfigError
from tuner.fixtures import write_fixture
from tuner.models import clip_vision
from tuner.trainers import trainer_class


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_1f")
    paths = write_fixture("wan_1f", root / "model")
    return make_project(root / "project", root / "model", architecture="wan_1f"), paths


def _trainer(config, *overrides):
    c = cfg(config, *overrides)
    return trainer_class(c.model.architecture)(c)


def test_frame_positions_place_the_frames_at_their_indices(project):
    """Indices 0, 1, ... leave diffusers' rotary embedding as it is (the hook fits the module's layout); other
    indices change only the time channels, to the table's rows at those indices."""
    trainer = _trainer(project[0])
    model = trainer.load_transformer(torch.float32)
    x = torch.randn(1, 36, 3, 4, 6)
    plain = model.rope(x)
    with frame_positions(model, [0, 1, 2]):
        same = model.rope(x)
    with frame_positions(model, [0, 5, 9]):
        moved = model.rope(x)
    assert model.rope(x)[0].equal(plain[0])  # the hook is gone
    t = model.rope.t_dim
    for a, b, table in zip(plain, moved, (model.rope.freqs_cos, model.rope.freqs_sin)):
        a, b = a.reshape(3, 6, -1), b.reshape(3, 6, -1)  # 3 frames of 2 x 3 tokens
        assert torch.equal(a[..., t:], b[..., t:]) and torch.equal(a[0], b[0])
        assert torch.equal(b[1, :, :t], table[5, :t].float().expand(6, -1))
        assert torch.equal(b[2, :, :t], table[9, :t].float().expand(6, -1))
    for a, b in zip(plain, same):
        assert torch.equal(a, b)


@torch.no_grad()
def test_an_item_is_its_frames_in_time_order_and_the_model_sees_the_indices(project):
    """Target at 0 and the reference at 3: `latents` is [target, reference]; the condition latents hold the
    blank image's latent then the reference's, the mask is 1 on the reference only, and the call is the
    transformer's at positions [0, 3] (not [0, 1])."""
    trainer = _trainer(project[0], "one_frame.clean_indices=[3]", "one_frame.target_index=0")
    encoders = LatentEncoders(
        trainer.load_vae(torch.device("cpu"), torch.float32),
        clip_vision.load_image_encoder(trainer.weights_path("image_encoder"), torch.float32),
    )
    gen = torch.Generator().manual_seed(0)
    pixels, reference = (torch.rand(1, 3, 1, 32, 48, generator=gen) * 2 - 1 for _ in range(2))
    entry = trainer.encode_latents(encoders, pixels, [reference])
    target, ref = trainer.encode_pixels(encoders.vae, pixels), trainer.encode_pixels(encoders.vae, reference)
    blank = trainer.encode_pixels(encoders.vae, torch.zeros_like(reference))
    torch.testing.assert_close(entry["latents"], torch.cat([target, ref], dim=2))
    torch.testing.assert_close(entry["cond_latents"], torch.cat([blank, ref], dim=2))
    torch.testing.assert_close(entry["clip"], encoders.image_encoder.encode(reference[:, :, 0]))

    model = trainer.load_transformer(torch.float32)
    cond = {"context": torch.randn(1, 512, 64, generator=gen), **entry}
    noisy, t = torch.randn(entry["latents"].shape, generator=gen), torch.tensor([0.6])
    mask = torch.zeros(1, 4, 2, 4, 6)
    mask[:, :, 1] = 1
    inputs = {"hidden_states": torch.cat([noisy, mask, entry["cond_latents"]], dim=1), "timestep": t * 1000,
              "encoder_hidden_states": cond["context"], "encoder_hidden_states_image": entry["clip"],
              "return_dict": False}  # fmt: skip
    with frame_positions(model, [0, 3]):
        expected = model(**inputs)[0]
    at_0_1 = model(**inputs)[0]
    got = trainer.predict(model, noisy, t, cond)
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, at_0_1, atol=1e-4)


def test_the_one_frame_settings_are_in_the_latent_cache_key(project):
    key = latent_encoder(_trainer(project[0]))
    assert latent_encoder(_trainer(project[0])) == key
    assert latent_encoder(_trainer(project[0], "one_frame.target_index=5")) != key
    assert latent_encoder(_trainer(project[0], "one_frame.clean_indices=[2]")) != key


@pytest.mark.parametrize(
    "override,match",
    [
        ("one_frame.no_post=true", r"key 'one_frame.no_post': wan_1f has no post latent"),
        ("one_frame.latent_window=5", r"key 'one_frame.latent_window': wan_1f"),
        ("one_frame.target_index=0", r"key 'one_frame.target_index': 0 is also a reference's"),
        ("one_frame.clean_indices=[0, 2]", r"key 'one_frame.clean_indices': wan_1f takes 1 to 1"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(project, override, match):
    with pytest.raises(ConfigError, match=match):
        cfg(project[0], override)


def test_generate_makes_one_frame_from_a_reference(project, tmp_path, capsys):
    """`tuner generate --control REF --frames 1` writes one image (the target frame decoded)."""
    from PIL import Image

    ref = tmp_path / "ref.png"
    Image.new("RGB", (48, 32), (200, 30, 30)).save(ref)
    out = tmp_path / "out.png"
    code, text = run(capsys, "generate", "--config", project[0], "--prompt", "a red square", "--control", ref,
                     "--frames", "1", "--size", "48x32", "--steps", "2", "--out", out)  # fmt: skip
    assert code == 0, text
    assert Image.open(out).size == (48, 32)
