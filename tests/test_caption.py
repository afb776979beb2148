"""`tuner caption`: the walking, skipping and writing of caption files (`tuner.caption`), with a stand-in
captioner that reports what it was shown."""

import av
import numpy as np
from PIL import Image

from tuner.caption import CaptionOptions, caption_folder


def _video(path, frames: int) -> None:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(frames):
            container.mux(
                stream.encode(av.VideoFrame.from_ndarray(np.full((32, 32, 3), i, np.uint8), format="rgb24"))
            )
        container.mux(stream.encode())


def _seen(frames, prompt):
    return f"{len(frames)} frame(s) {frames[0].size}\n  {prompt}"


def test_captions_images_and_videos_with_trigger_and_skip(tmp_path):
    Image.new("RGB", (40, 30)).save(tmp_path / "a.png")
    _video(tmp_path / "b.mp4", 9)
    (tmp_path / "c.jpg").write_bytes(b"")  # has a caption already: never opened
    (tmp_path / "c.txt").write_text("kept\n")
    (tmp_path / "notes.md").write_text("not media")
    opts = CaptionOptions(prompt="what {kind}?", trigger="ohwx", frames=3)
    done = caption_folder(tmp_path, _seen, opts)
    assert [p.name for p in done["written"]] == ["a.txt", "b.txt"] and [p.name for p in done["skipped"]] == [
        "c.txt"
    ]
    assert (tmp_path / "a.txt").read_text() == "ohwx, 1 frame(s) (40, 30) what image?\n"
    assert (tmp_path / "b.txt").read_text() == "ohwx, 3 frame(s) (32, 32) what video?\n"
    assert (tmp_path / "c.txt").read_text() == "kept\n"
    assert not list(tmp_path.glob(".*.tmp"))
    (tmp_path / "c.jpg").unlink()
    again = caption_folder(tmp_path, _seen, CaptionOptions(overwrite=True, extension=".caption"))
    assert [p.name for p in again["written"]] == ["a.caption", "b.caption"]
    assert (tmp_path / "a.caption").read_text().startswith("1 frame(s) (40, 30) Describe this image")
