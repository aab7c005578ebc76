"""``--mixed-precision NAME`` -> the dtype that parameters are computed in (every strategy)."""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
