"""kvforge's float dtype names (a descriptor's `input`, `storage`, `scale_dtype`) as torch dtypes.

A module of its own because it needs torch, and `import kvforge` does not.
"""

import torch

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
