from tuner.data.frames import FrameRule, frame_windows, resample_indices, short_targets, video_windows


def r(a, b):
    return tuple(range(a, b))


def test_head_takes_the_start_for_each_target():
    assert frame_windows(10, (4,), "head") == [r(0, 4)]
    assert frame_windows(10, (1, 4), "head") == [(0,), r(0, 4)]


def test_chunk_takes_back_to_back_windows():
    assert frame_windows(10, (4,), "chunk") == [r(0, 4), r(4, 8)]  # frames 8, 9 are a partial chunk
    assert frame_windows(10, (5,), "chunk") == [r(0, 5), r(5, 10)]


def test_slide_steps_by_stride():
    assert frame_windows(10, (4,), "slide", stride=3) == [r(0, 4), r(3, 7), r(6, 10)]
    assert frame_windows(6, (4,), "slide", stride=1) == [r(0, 4), r(1, 5), r(2, 6)]


def test_uniform_spreads_starts_evenly():
    # last possible start 12-5=7; starts 0, 7/3, 14/3, 7 rounded → 0, 2, 5, 7
    assert frame_windows(12, (5,), "uniform", sample=4) == [r(0, 5), r(2, 7), r(5, 10), r(7, 12)]
    assert frame_windows(12, (5,), "uniform", sample=1) == [r(0, 5)]
    assert frame_windows(5, (5,), "uniform", sample=3) == [r(0, 5)]  # one possible start, no duplicates


def test_full_takes_all_frames_trimmed_to_a_valid_count():
    wan = FrameRule(4, 1)
    assert frame_windows(10, (1,), "full", valid_count=wan) == [r(0, 9)]
    assert frame_windows(10, (1,), "full", max_frames=6, valid_count=wan) == [r(0, 5)]
    assert frame_windows(10, (1,), "full") == [r(0, 10)]
    assert frame_windows(10, (1,), "full", valid_count=lambda n: n % 8 == 0) == [r(0, 8)]


def test_frame_rule():
    wan = FrameRule(4, 1)
    assert [n for n in range(1, 20) if wan(n)] == [1, 5, 9, 13, 17]
    assert str(wan) == "4N+1"


def test_short_video_gives_no_window_for_that_target():
    assert frame_windows(6, (5, 9), "head") == [r(0, 5)]
    assert short_targets(6, (5, 9), "head") == [9]
    assert frame_windows(3, (5,), "slide") == []


def test_resample_30_to_16_fps():
    kept = resample_indices(20, 30, 16)
    assert kept == [0, 2, 4, 6, 8, 9, 11, 13, 15, 17, 19]
    assert {b - a for a, b in zip(kept, kept[1:])} == {1, 2}
    assert len(resample_indices(60, 30, 16)) == 32  # 2 s of video at 16 fps
    assert resample_indices(5, 16, 16) == [0, 1, 2, 3, 4]
    assert resample_indices(5, 12, 16) == [0, 1, 2, 3, 4]  # never duplicates frames
    assert resample_indices(5, None, 16) == [0, 1, 2, 3, 4]


def test_video_windows_are_taken_over_resampled_frames():
    windows, short = video_windows(20, 30, 16, (5, 9, 17), "head", valid_count=FrameRule(4, 1))
    assert windows == [(0, 2, 4, 6, 8), (0, 2, 4, 6, 8, 9, 11, 13, 15)]
    assert short == [17]  # 11 frames at 16 fps
