"""Sample files as TensorBoard images (`tuner.trainers.board`)."""

import av
import numpy as np
from PIL import Image

from tuner.trainers.board import STRIP_FRAMES, frame_strip


def test_image_and_video_strips(tmp_path):
    png = tmp_path / "a.png"
    Image.fromarray(np.full((48, 64, 3), 200, np.uint8)).save(png)
    assert frame_strip(png).shape == (48, 64, 3)

    mp4 = tmp_path / "a.mp4"
    with av.open(str(mp4), "w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(17):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 10, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    strip = frame_strip(mp4)
    assert strip.shape == (48, 64 * STRIP_FRAMES, 3) and strip.dtype == np.uint8
    assert strip[:, :64].mean() < strip[:, -64:].mean()  # first frame on the left, last on the right
