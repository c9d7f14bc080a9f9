"""Block-scaled storage seen from Python: the codes and group scales that `Cache.view` exports, decoded
here from the formats' public definitions (OCP e2m1, two's complement int4 nibbles low first, OCP
ue8m0, NVFP4's e4m3 group scales over an fp32 tensor scale, uint4 around lmdeploy-style zero points),
equal what `gather` returns, value for value."""

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


def append_and_gather(cache, layer, k, v, pages):
    """Appends the tokens k, v [tokens, heads, head_dim] of one sequence into `pages` in order, and gathers
    them back: their slots, and {"k", "v"} [heads, tokens, head_dim]."""
    d, tokens = cache.descriptor, k.shape[0]
    slots = torch.tensor([int(pages[t // d.page_size]) * d.page_size + t % d.page_size for t in range(tokens)])
    cache.append(layer, k, v, slots=slots)
    got = {side: torch.empty(d.heads, tokens, d.head_dim, dtype=k.dtype) for side in "kv"}
    cache.gather(layer, got["k"], got["v"], pages=pages, begin=0, end=tokens)
    return slots, got


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
    slots, got = append_and_gather(cache, layer, k, v, pages)
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


ZERO_POINT = variants_where(storage="uint4", paged=True, layers=lambda n: n <= 24)


@pytest.mark.parametrize("d", ZERO_POINT, ids=lambda d: d.name)
def test_zero_point_codes_decode_with_their_scales_and_zeros_to_what_gather_returns(d):
    """uint4 as docs/quantization.md states it, in torch: a head's (or group's) finite range widened to hold
    0 spans 15 steps of its scale (hi / 15 - lo / 15, rounded up to bf16), the zero point is -lo / scale
    rounded half to even, and a code reads as (code - zero) * scale. The exported [.., 2] entries are the
    scale and the zero point, and gather returns exactly what they decode to."""
    assert d.zero_point and d.quant in ("per_token_head", "per_group")
    g = torch.Generator().manual_seed(11)
    tokens, layer = d.page_size + 5, d.layers - 1
    used = -(-tokens // d.page_size)
    pages = torch.arange(used, 0, -1, dtype=torch.int32)
    cache = kvforge.create(d.name, pages=used + 1)
    dtype = TORCH_DTYPE[d.input]
    # Heads of different magnitudes, off-centre (so that zero points differ from 8), an all-positive head,
    # an outlier, and a NaN (which takes its group's zero point and reads back as 0).
    shift = torch.linspace(-1.0, 1.0, d.heads)[None, :, None]
    k = ((torch.randn(tokens, d.heads, d.head_dim, generator=g) + 2 * shift) * torch.logspace(-2, 1, d.heads)[None, :, None]).to(dtype)
    k[:, 0] = k[:, 0].abs()
    k[1, -1, 3 % d.head_dim] = 300.0
    k[2, 0, 5 % d.head_dim] = float("nan")
    v = torch.randn(tokens, d.heads, d.head_dim, generator=g).to(dtype)
    slots, got = append_and_gather(cache, layer, k, v, pages)
    view = cache.view(layer)
    group = d.quant_group or d.head_dim
    groups = d.head_dim // group
    at = (slots // d.page_size, slots % d.page_size)
    for side, x in (("k", k), ("v", v)):
        codes, entries = torch.from_dlpack(view[side])[at], torch.from_dlpack(view[side + "_scales"])[at]
        assert codes.shape == (tokens, d.heads, d.head_dim // 2)
        entries = entries.float().view(tokens, d.heads, groups, 2)
        b = codes.to(torch.int64)
        nibbles = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2).float().view(tokens, d.heads, groups, group)
        scale, zero = entries[..., :1], entries[..., 1:]
        decoded = ((nibbles - zero) * scale).view(tokens, d.heads, d.head_dim)
        assert torch.equal(decoded.to(dtype).transpose(0, 1), got[side]), side
        # The rule, from the definition, in torch.
        xf = x.float().view(tokens, d.heads, groups, group)
        finite = torch.where(xf.isfinite(), xf, torch.zeros_like(xf))
        lo, hi = finite.amin(-1, keepdim=True).clamp(max=0), finite.amax(-1, keepdim=True).clamp(min=0)
        wanted = hi / 15 - lo / 15
        want_scale = next_bf16_up(torch.where(wanted > 0, wanted, torch.ones_like(wanted))) if d.scale_dtype == "bf16" \
            else torch.where(wanted > 0, wanted, torch.ones_like(wanted))
        want_zero = torch.round(-lo / want_scale).clamp(0, 15)
        assert torch.equal(scale, want_scale), side
        assert torch.equal(zero, want_zero), side
        want_codes = torch.where(xf.isnan(), want_zero, (torch.round(xf / want_scale) + want_zero).clamp(0, 15))
        assert torch.equal(nibbles, want_codes), side
        # Within half a step of what went in, where it was finite.
        err = (decoded - x.float()).abs().view(tokens, d.heads, groups, group)
        ok = (err <= 0.5 * want_scale * 1.0001 + x.float().abs().view_as(err) * 2.0 ** -8) | xf.isnan()
        assert ok.all(), side


def next_bf16_up(s):
    """The smallest bf16 value >= s (s > 0, fp32): truncate to bf16, and step up where that lost anything."""
    bits = s.view(torch.int32)
    down = bits & ~0xFFFF
    return torch.where(down == bits, down, down + 0x10000).view(torch.float32)


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
