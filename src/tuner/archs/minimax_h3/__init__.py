"""MiniMax H3: text-to-video with sound, the video and its stereo soundtrack denoised together in one packed sequence."""
