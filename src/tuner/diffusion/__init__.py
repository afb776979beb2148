"""The diffusion math: which timesteps to train on and the flow-matching loss (`timesteps`), the DDPM
objective of SD-family models (`ddpm`), EDM's (`edm`, Cosmos 1.0), and generating latents from each
(`sampling`, `ddpm`, `edm`)."""
