import av
import numpy as np
import pytest
import torch
from PIL import Image

from tuner.data.media import probe_image, probe_video, read_image, read_video_frames, to_tensor
from tuner.errors import DataError


def write_video(path, n_frames=20, fps=30, size=(64, 48), codec="mpeg4"):
    """Frame i is flat gray at level 10*i, so decoded frames say which index they are."""
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(n_frames):
            pixels = np.full((size[1], size[0], 3), 10 * i, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return path


def test_probe_and_read_mp4(tmp_path):
    path = write_video(tmp_path / "clip.mp4")
    assert probe_video(path) == (20, 30.0, 64, 48)
    frames = read_video_frames(path, [0, 5, 19, 5])
    assert frames.shape == (4, 48, 64, 3) and frames.dtype == np.uint8
    assert np.abs(frames.reshape(4, -1).mean(1) - [0, 50, 190, 50]).max() < 4


def test_probe_counts_frames_when_the_container_does_not(tmp_path):
    path = write_video(tmp_path / "clip.mkv", n_frames=7, fps=24)
    n, fps, w, h = probe_video(path)
    assert (n, fps, w, h) == (7, 24.0, 64, 48)


def test_reading_past_the_end_names_the_file(tmp_path):
    path = write_video(tmp_path / "clip.mp4", n_frames=5)
    with pytest.raises(DataError, match=r"clip\.mp4.*frame 9"):
        read_video_frames(path, [0, 9])


@pytest.mark.parametrize("content", [b"not a video at all", b"\x00" * 100])
def test_corrupt_video_raises_data_error_naming_it(tmp_path, content):
    path = tmp_path / "broken.mp4"
    path.write_bytes(content)
    with pytest.raises(DataError, match="broken.mp4"):
        probe_video(path)
    with pytest.raises(DataError, match="broken.mp4"):
        read_video_frames(path, [0])


def test_truncated_video_raises_data_error(tmp_path):
    path = write_video(tmp_path / "cut.mp4")
    path.write_bytes(path.read_bytes()[:600])
    with pytest.raises(DataError, match="cut.mp4"):  # mp4 writes its index last: the cut loses it
        probe_video(path)


def test_missing_video(tmp_path):
    with pytest.raises(DataError, match="gone.mp4: file not found"):
        probe_video(tmp_path / "gone.mp4")


def test_frame_folder_is_a_video(tmp_path):
    folder = tmp_path / "clip"
    folder.mkdir()
    for i in range(6):
        Image.new("RGB", (40, 30), (20 * i, 0, 0)).save(folder / f"f_{i:03d}.png")
    assert probe_video(folder) == (6, None, 40, 30)
    frames = read_video_frames(folder, [1, 4])
    assert frames.shape == (2, 30, 40, 3) and frames[1, 0, 0, 0] == 80


def test_read_image_applies_exif_orientation(tmp_path):
    img = Image.new("RGB", (40, 20), (200, 10, 10))
    exif = img.getexif()
    exif[0x0112] = 6  # stored landscape, displayed rotated 90° clockwise
    img.save(tmp_path / "phone.jpg", exif=exif)
    assert read_image(tmp_path / "phone.jpg").size == (20, 40)
    assert probe_image(tmp_path / "phone.jpg") == (20, 40)


def test_read_image_composites_alpha_on_white(tmp_path):
    img = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    img.putpixel((0, 0), (255, 0, 0, 255))
    img.save(tmp_path / "cutout.png")
    out = read_image(tmp_path / "cutout.png")
    assert out.mode == "RGB"
    assert out.getpixel((0, 0)) == (255, 0, 0) and out.getpixel((3, 3)) == (255, 255, 255)


def test_read_image_converts_gray_to_rgb(tmp_path):
    Image.new("L", (8, 8), 77).save(tmp_path / "gray.png")
    assert read_image(tmp_path / "gray.png").getpixel((1, 1)) == (77, 77, 77)


def test_corrupt_and_truncated_images_name_the_file(tmp_path):
    (tmp_path / "junk.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match="junk.png"):
        read_image(tmp_path / "junk.png")
    Image.effect_noise((64, 64), 50).convert("RGB").save(tmp_path / "whole.png")
    data = (tmp_path / "whole.png").read_bytes()
    (tmp_path / "half.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="half.png"):
        probe_image(tmp_path / "half.png")


def test_to_tensor_layout_and_range():
    frames = np.zeros((2, 4, 6, 3), dtype=np.uint8)
    frames[1] = 255
    t = to_tensor(frames)
    assert t.shape == (3, 2, 4, 6) and t.dtype == torch.float32
    assert t[:, 0].eq(-1).all() and t[:, 1].eq(1).all()
    assert to_tensor(np.zeros((4, 6, 3), dtype=np.uint8)).shape == (3, 1, 4, 6)


def test_probe_image_reads_headers_only_and_matches_read_image(tmp_path, monkeypatch):
    import zlib

    from PIL import ImageFile

    img = Image.new("RGB", (40, 20), (200, 10, 10))
    exif = img.getexif()
    exif[0x0112] = 8
    img.save(tmp_path / "phone.jpg", exif=exif)
    img.save(tmp_path / "plain.png")
    img.save(tmp_path / "early.webp", exif=exif)
    # A PNG whose eXIf chunk comes after the image data, just before IEND.
    data = (tmp_path / "plain.png").read_bytes()
    payload = exif.tobytes()
    chunk = len(payload).to_bytes(4, "big") + b"eXIf" + payload
    chunk += zlib.crc32(b"eXIf" + payload).to_bytes(4, "big")
    (tmp_path / "late.png").write_bytes(data[:-12] + chunk + data[-12:])
    expected = {
        name: read_image(tmp_path / name).size
        for name in ("phone.jpg", "plain.png", "early.webp", "late.png")
    }
    assert expected == {
        "phone.jpg": (20, 40),
        "plain.png": (40, 20),
        "early.webp": (20, 40),
        "late.png": (20, 40),
    }

    def no_decoding(self):
        raise AssertionError("probe_image decoded pixels")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    assert {name: probe_image(tmp_path / name) for name in expected} == expected
