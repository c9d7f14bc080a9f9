"""Shared helpers of the Python tests: variant selection by property, and the independent reference.

The reference is a plain dict keyed by logical (layer, sequence, position) coordinates, holding the
[heads, head_dim] values that were appended there; no test reads the cache through its own strides to
decide what is right.
"""

import pytest
import torch

import kvforge

from kvforge.torch_dtypes import TORCH_DTYPES as TORCH_DTYPE

# ctest runs as many test processes at once as there are cores (tools/test-all), so torch's intra-op
# threads would wait for cores the other processes hold: a forward of test_hf's 24-layer model took
# 3.6 s alone and 11.7 s beside one busy core on two threads, 5.5 s on one. No result depends on it.
torch.set_num_threads(1)


def variants_where(**wanted):
    """Registered variants whose descriptor attributes equal every given value (a callable is a test)."""
    out = []
    for d in kvforge.variants():
        if all((want(getattr(d, key)) if callable(want) else getattr(d, key) == want) for key, want in wanted.items()):
            out.append(d)
    return out


def strided_tokens(tokens, heads, head_dim, dtype, generator, order):
    """[tokens, heads, head_dim] values in a non-contiguous view: only the last axis is contiguous.

    order "heads_outside": the storage is [heads, tokens, head_dim] (an HND tensor viewed as NHD);
    order "padded": each token row is padded to twice its width.
    """
    if order == "heads_outside":
        base = torch.randn(heads, tokens, head_dim, generator=generator).to(dtype)
        return base.transpose(0, 1)
    base = torch.randn(tokens, heads, 2 * head_dim, generator=generator).to(dtype)
    return base[:, :, :head_dim]


def quantization_bound(descriptor, expected):
    """Per-element bound on |gathered - appended| for one sequence's expected [H, n, D] values.

    docs/quantization.md: |x^ - x| <= s * h + 1/2 ulp of the input dtype, with h = 1/2 for int8 and
    half the fp8 grid spacing. Taken loosely here (the C++ test holds the tight bound): int8 within
    one step of a dynamic per-token scale over all heads, uint4 within one step of a head's range, fp8 within 2^-(M) relative plus a step of
    its smallest normal.
    """
    x = expected.float()
    ulp = x.abs() * 2.0 ** -7 if descriptor.input == "bf16" else x.abs() * 2.0 ** -10
    if descriptor.storage == "int8":
        amax = x.abs().amax(dim=(0, 2), keepdim=True) if descriptor.quant == "per_token" else \
            x.abs().amax(dim=2, keepdim=True)
        return amax / 127.0 + ulp
    if descriptor.storage == "uint4":  # one step of a head's range (a group's lies within it) in 15
        span = x.amax(dim=2, keepdim=True).clamp(min=0) - x.amin(dim=2, keepdim=True).clamp(max=0)
        return span / 15.0 + ulp
    mantissa = 3 if descriptor.storage == "fp8_e4m3" else 2
    return x.abs() * 2.0 ** -mantissa + ulp + 1e-3


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(1234)
