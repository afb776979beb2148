"""`tuner caption`: the walking, skipping and writing of caption files (`tuner.caption`), with a stand-in
captioner that reports what it was shown; then the whole command with the transformers captioner on a tiny
random LLaVA (image-text-to-text through `AutoProcessor` + `AutoModelForImageTextToText`), and the default
Qwen2.5-VL's need for torchvision named in one line."""

import av
import numpy as np
import pytest
import torch
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


# --- the transformers captioner on a tiny random VLM ----------------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    """A random-weight LLaVA (CLIP vision tower of width 32, 2-layer Qwen2 text model) with its processor,
    saved as a folder `AutoProcessor` / `AutoModelForImageTextToText` load: an image-text-to-text model
    whose processor needs only PIL (Qwen2-VL's needs torchvision). Its captions are nonsense."""
    from tokenizers import AddedToken
    from transformers import (
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        Qwen2Config,
    )
    from transformers.models.clip import CLIPImageProcessorPil

    from tuner.fixtures.tokenizers import build_qwen2_tokenizer

    tokenizer = build_qwen2_tokenizer(["Describe this image video what"])
    tokenizer.add_tokens([AddedToken("<image>", special=True)], special_tokens=True)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=28, patch_size=14, projection_dim=32)  # fmt: skip
    text = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-1)  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_vlm")
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14, chat_template=CHAT_TEMPLATE,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1).save_pretrained(folder)  # fmt: skip
    return folder


def test_tuner_caption_with_a_vlm_shows_frames_and_prompt_and_writes_its_answer(
    tiny_vlm, tmp_path, monkeypatch, capsys
):
    """Through `tuner caption --model FOLDER`: an image is one frame, a video `--frames` evenly spaced ones
    (first and last included), the prompt with its {kind} reaches the model in its chat template, the answer
    (the model's own greedy decoding, recomputed here) follows the trigger word, and captioned files are
    skipped on the next run."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, LlavaForConditionalGeneration

    from tuner.caption import read_frames
    from tuner.cli import main

    Image.new("RGB", (40, 30), (200, 30, 30)).save(tmp_path / "a.png")
    _video(tmp_path / "b.mp4", 9)
    seen, generate = [], LlavaForConditionalGeneration.generate

    def spy(self, **inputs):
        seen.append((inputs["pixel_values"].clone(), inputs["input_ids"].clone()))
        return generate(self, **inputs)

    monkeypatch.setattr(LlavaForConditionalGeneration, "generate", spy)
    argv = ["caption", str(tmp_path), "--model", str(tiny_vlm), "--prompt", "what {kind}?", "--trigger", "ohwx",
            "--frames", "3", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    assert "captioned 2 file(s), skipped 0" in capsys.readouterr().out
    shown = list(seen)
    assert [p.shape[0] for p, _ in shown] == [1, 3]

    levels = [float(np.asarray(f).mean()) for f in read_frames(tmp_path / "b.mp4", 3)]
    assert levels == pytest.approx([0, 4, 8], abs=1.5)  # frame i of the clip is grey level i: 0, 4, 8 of 0..8
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm).eval()
    for (pixels, ids), name, kind, count in zip(shown, ("a", "b"), ("image", "video"), (1, 3)):
        frames = read_frames(tmp_path / f"{name}{'.png' if kind == 'image' else '.mp4'}", 3)
        assert len(frames) == count and pixels.shape[0] == count
        assert torch.equal(
            pixels, processor(images=frames, text="<image>" * count, return_tensors="pt")["pixel_values"]
        )
        assert processor.tokenizer.decode(ids[0]).endswith(f"what {kind}?<|im_end|>\n<|im_start|>assistant\n")
        assert processor.tokenizer.decode(ids[0]).count("<image>") >= count
        with torch.no_grad():
            out = model.generate(pixel_values=pixels, input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=200, do_sample=False)  # fmt: skip
        answer = " ".join(processor.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)[0].split())
        assert answer  # the random model says something, and it is what was written
        assert (tmp_path / f"{name}.txt").read_text() == f"ohwx, {answer}\n"

    before = len(seen)
    assert main(argv) == 0  # everything has a caption: nothing is shown to the model again
    assert "captioned 0 file(s), skipped 2" in capsys.readouterr().out and len(seen) == before


def test_a_processor_that_needs_torchvision_is_one_line(tmp_path, capsys):
    """Qwen2.5-VL's processor (the default model's) holds a video processor built on torchvision; where
    torchvision does not import, the command says so and names the way out."""
    import json

    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    from tuner.archs.qwen_image.text import VARIANTS
    from tuner.cli import main
    from tuner.fixtures.tokenizers import build_qwen2_tokenizer

    try:
        import torchvision  # noqa: F401

        pytest.skip("torchvision imports here: Qwen2.5-VL's processor builds")
    except Exception:
        pass
    folder = tmp_path / "qwen"
    build_qwen2_tokenizer(["x"]).save_pretrained(folder)
    Qwen2VLImageProcessorPil().save_pretrained(folder)
    Qwen2_5_VLConfig.from_pretrained(
        next(v.config_dir for v in VARIANTS if v.name == "tiny")
    ).save_pretrained(folder)
    (folder / "video_preprocessor_config.json").write_text(
        json.dumps({"video_processor_type": "Qwen2VLVideoProcessor"})
    )
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    Image.new("RGB", (40, 30)).save(tmp_path / "a.png")
    assert main(["caption", str(tmp_path), "--model", str(folder), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "its processor needs torchvision" in err and "llava" in err and err.count("\n") == 1
    assert not (tmp_path / "a.txt").exists()
