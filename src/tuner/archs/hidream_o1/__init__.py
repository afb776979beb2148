"""HiDream-O1-Image (full, dev): text-to-image in pixel space, a Qwen3-VL-8B denoising 32x32 pixel patches."""
