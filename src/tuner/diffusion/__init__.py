"""The diffusion math: which timesteps to train on and the flow-matching loss (`timesteps`), the DDPM
objective of SD-family models (`ddpm`), and generating latents from either (`sampling`, `ddpm`)."""
