"""Block-scaled storage seen from Python: the codes and group scales that `Cache.view` exports, decoded
here from the formats' public definitions (OCP e2m1, two's complement int4 nibbles low first, OCP
ue8m0, NVFP4's e4m3 group scales over an fp32 tensor scale), equal what `gather` returns, value for
value."""

import numpy as np
import pytest
import torch
from conftest import TORCH_DTYPE, variants_where

import kvforge

# OCP fp4 e2m1 magnitudes for codes 0..7 (sign in bit 3), and int4's two's complement nibbles.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP4 = torch.cat([E2M1, -E2M1])
INT4 = torch.tensor([float(n if n < 8 else n - 16) for n in range(16)])


def decode_codes(codes, storage):
    """[..., stored] codes as exported -> [..., values] floats."""
    if storage in ("fp4_e2m1", "int4"):
        table = FP4 if storage == "fp4_e2m1" else INT4
        b = codes.to(torch.int64)
        return torch.stack([table[b & 0xF], table[b >> 4]], dim=-1).flatten(-2)  # value 2i low, 2i + 1 high
    if storage == "int8":
        return codes.float()
    return codes.view(getattr(torch, "float8_e4m3fn" if storage == "fp8_e4m3" else "float8_e5m2")).float()


def decode_scales(scales, scale_dtype):
    if scale_dtype == "ue8m0":
        return torch.pow(2.0, scales.to(torch.float64) - 127).float()  # 2^(e - 127)
    if scale_dtype == "fp8_e4m3":
        return scales.view(torch.float8_e4m3fn).float()  # exported as bytes, as fp8 codes are
    return scales.float()


GROUPED = variants_where(quant="per_group", paged=True, layers=lambda n: n <= 24)


@pytest.mark.parametrize("d", GROUPED, ids=lambda d: d.name)
def test_exported_codes_and_group_scales_decode_to_what_gather_returns(d):
    assert GROUPED, "no per_group variant of a small model is registered"
    g = torch.Generator().manual_seed(7)
    tokens, layer = 2 * d.page_size + 3, d.layers - 1
    used = -(-tokens // d.page_size)
    pages = torch.arange(used, 0, -1, dtype=torch.int32)  # out of order, page 0 left unused
    cache = kvforge.create(d.name, pages=used + 1)
    # A second-level scale under every group scale of the layer (NVFP4): K's holds the outlier below
    # within e4m3's 448 (300 / 6 / 0.25 = 200), V's is far from 1.
    tensor = {"k": 0.25, "v": 2.0 ** -6} if d.tensor_scaled else {"k": 1.0, "v": 1.0}
    if d.tensor_scaled:
        cache.set_tensor_scale(layer, tensor["k"], tensor["v"])
    dtype = TORCH_DTYPE[d.input]
    # Heads of different magnitudes and an outlier, so that groups of one row get different scales.
    k = (torch.randn(tokens, d.heads, d.head_dim, generator=g) * torch.logspace(-2, 1, d.heads)[None, :, None]).to(dtype)
    k[1, 0, (d.quant_group + 1) % d.head_dim] = 300.0
    v = torch.randn(tokens, d.heads, d.head_dim, generator=g).to(dtype)
    slots = torch.tensor([int(pages[t // d.page_size]) * d.page_size + t % d.page_size for t in range(tokens)])
    cache.append(layer, k, v, slots=slots)
    got = {side: torch.empty(d.heads, tokens, d.head_dim, dtype=dtype) for side in "kv"}
    cache.gather(layer, got["k"], got["v"], pages=pages, begin=0, end=tokens)
    view = cache.view(layer)
    assert ("tensor_scales" in view) == d.tensor_scaled
    if d.tensor_scaled:
        assert torch.from_dlpack(view["tensor_scales"]).tolist() == [tensor["k"], tensor["v"]]
    groups = d.head_dim // d.quant_group
    for side, x in (("k", k), ("v", v)):
        codes = torch.from_dlpack(view[side])
        scales = torch.from_dlpack(view[side + "_scales"])
        stored = d.head_dim // (2 if d.storage in ("fp4_e2m1", "int4") else 1)
        assert codes.shape[2:] == (d.heads, stored)
        assert scales.shape[2:] == (d.heads, groups)
        at = (slots // d.page_size, slots % d.page_size)  # (physical page, slot) of each token
        values = decode_codes(codes[at], d.storage).view(tokens, d.heads, groups, d.quant_group)
        group_scales = decode_scales(scales[at], d.scale_dtype) * tensor[side]
        decoded = (values * group_scales[..., None]).view(tokens, d.heads, d.head_dim)
        assert torch.equal(decoded.to(dtype).transpose(0, 1), got[side]), side
        # And close to what went in (docs/quantization.md's bound, loosely): half a step of the integer
        # grids, at most one scale for e2m1 (half its top spacing of 2), 2^-4 relative for e4m3 and
        # 2^-3 for e5m2 plus half their smallest subnormal step; and the input dtype's rounding.
        s = group_scales.repeat_interleave(d.quant_group, dim=-1)
        a = x.float().abs()
        bound = {"int8": 0.5 * s, "int4": 0.5 * s, "fp4_e2m1": s, "fp8_e4m3": a * 2.0 ** -4 + s * 2.0 ** -10,
                 "fp8_e5m2": a * 2.0 ** -3 + s * 2.0 ** -17}[d.storage]
        assert ((decoded - x.float()).abs() <= bound * 1.001 + a * 2.0 ** -7).all(), side


def test_four_bit_storage_is_named_and_sized():
    assert kvforge.quant_max("fp4_e2m1") == 6.0 and kvforge.quant_max("int4") == 7.0
    four_bit = [d for d in kvforge.variants() if d.storage in ("fp4_e2m1", "int4") and not d.hybrid]
    assert four_bit, "no 4-bit variant is registered"
    for d in four_bit:
        # Two codes a byte, and each token's dynamic scales, K and V of every layer (a per-tensor scale
        # is per layer, not per token).
        scales = {"per_tensor": 0, "per_token": 1, "per_token_head": d.heads,
                  "per_group": d.heads * (d.head_dim // max(d.quant_group, 1))}[d.quant]
        scale_bytes = {"ue8m0": 1, "fp8_e4m3": 1, "bf16": 2, "fp32": 4}[d.scale_dtype]
        assert d.bytes_per_token == 2 * d.layers * (d.heads * d.head_dim // 2 + scales * scale_bytes), d.name
    with pytest.raises(kvforge.ArgumentError, match="int4"):
        kvforge.quant_max("int2")
