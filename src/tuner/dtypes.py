"""The one table from the precision names of configs and command lines to torch dtypes."""

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
