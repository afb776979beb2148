"""The chroma family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from dataclasses import replace

from tuner.archs.flux.record import FLUX

RECORDS = (
    # Chroma: FLUX.1-schnell with T5 only and a guidance approximator in place of the modulation
    # linears; the release keeps FLUX.1's names, fused layers and adapter targets
    replace(
        FLUX,
        name="chroma",
        title="Chroma text-to-image (FLUX.1-schnell based, T5 only)",
        family="tuner.archs.chroma.trainer:ChromaModel",
        layout="tuner.archs.chroma.keys:CHROMA_LAYOUT",
        fixture="tuner.archs.chroma.fixture:FIXTURE",
        model_class="ChromaTransformer2DModel",
        configs="chroma",
        tokenizers=(("tokenizer", "black-forest-labs/FLUX.1-schnell:tokenizer_2"),),  # T5-XXL only
        hub_repos=(("HD", "lodestones/Chroma1-HD"),),
    ),
)
