"""kvforge's float dtype names (a descriptor's `input`, `storage`, `scale_dtype`) as torch dtypes.

A module of its own because it needs torch, and `import kvforge` does not.
"""

import torch

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Quantized storage whose codes are one torch element each (4-bit codes go two a byte): the code as stored,
# before its scale.
CODE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
