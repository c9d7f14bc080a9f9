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


def record_bound(descriptor, expected_k, expected_v):
    """Per-element bounds on |gathered - appended| for a record format's K and V [H, n, D] values, each part
    by its own definition (descriptor.record_parts): a float part within half its ulp, a coded part within
    half a step of its grid at the value (e4m3 2^-4, e5m2 2^-3, e2m1 1/4 relative) or of int8's and int4's
    (amax / 127, amax / 7), plus a
    subnormal step of its group's scale; the group's scale taken as amax / the code's largest, twice that
    where it rounds up to a power of two. Plus half an ulp of the input dtype."""
    x = torch.cat([expected_k.float(), expected_v.float()], dim=-1)
    bound = torch.zeros_like(x)
    for p in descriptor.record_parts:
        part = x[..., p["values_at"]:p["values_at"] + p["width"]]
        if "group" not in p:
            relative = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp32": 0.0}[p["dtype"]]
            bound[..., p["values_at"]:p["values_at"] + p["width"]] = part.abs() * relative
            continue
        groups = part.reshape(*part.shape[:-1], -1, p["group"])
        qmax = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0, "fp4_e2m1": 6.0, "int4": 7.0}[p["dtype"]]
        scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=p["amax_floor"]) / qmax
        scale = scale * (2.0 if p["rounding"] == "pow2_up" else 1.0)
        if p["dtype"] in ("int8", "int4"):
            step = scale.expand_as(groups) * 0.5
        elif p["dtype"] == "fp4_e2m1":  # half of e2m1's widest gap (4 to 6) relative, or its subnormal step
            step = groups.abs() / 4 + scale * 0.25
        else:
            relative, subnormal = (2.0 ** -4, 2.0 ** -9) if p["dtype"] == "fp8_e4m3" else (2.0 ** -3, 2.0 ** -16)
            step = groups.abs() * relative + scale * subnormal
        bound[..., p["values_at"]:p["values_at"] + p["width"]] = step.reshape(part.shape)
    bound = bound * 1.001 + x.abs() * (2.0 ** -7 if descriptor.input == "bf16" else 2.0 ** -10) + 1e-6
    D = expected_k.shape[-1]
    return bound[..., :D], bound[..., D:]


def assert_reads_back(descriptor, got_k, got_v, want_k, want_v):
    """Gathered K and V [H, n, D] against the appended values: exact for float storage, else within the
    storage's bound (record_bound for a record format, quantization_bound for codes)."""
    got_k, got_v = got_k.float(), got_v.float()
    if descriptor.record_parts:
        k_bound, v_bound = record_bound(descriptor, want_k, want_v)
        assert ((got_k - want_k).abs() <= k_bound).all() and ((got_v - want_v).abs() <= v_bound).all()
    elif descriptor.quantized:
        assert ((got_k - want_k).abs() <= quantization_bound(descriptor, want_k)).all()
        assert ((got_v - want_v).abs() <= quantization_bound(descriptor, want_v)).all()
    else:
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(1234)
