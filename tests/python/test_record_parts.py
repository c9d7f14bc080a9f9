"""Views by part name of every record format (docs/python.md; docs/specs.md "Records of named parts"):
each part of a head's record, and a coded part's scales, read here by the format's definition in torch
(codes in their dtype times their group's scale, a float part as it is), give what gather decodes. Every
variant whose storage is a record format, picked by that property: FlashMLA's fp8 record, the fp8 index
key (whose parts lie in its page, scales after the records) and the user specs' own formats."""

import pytest
import torch

import kvforge

from conftest import TORCH_DTYPE, variants_where

RECORDS = variants_where(record_parts=lambda parts: parts is not None, hybrid=False)
CODES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
# 4-bit codes, two a byte, low nibble first: e2m1's values by code (OCP MX), int4's two's complement.
NIBBLES = {"fp4_e2m1": torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]),
           "int4": torch.tensor([0.0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1])}
SCALES = {"fp32": torch.float32, "bf16": torch.bfloat16, "ue8m0": torch.float8_e8m0fnu}


def part_values(view, part, heads, tokens):
    """[tokens, heads, width] fp32: the part's values of the first `tokens` positions, by its definition."""
    def positions(name, width):
        x = torch.from_dlpack(view[name])  # [pages, slots, (heads,) width]
        if x.dim() == 3:  # one head: no heads axis
            x = x.unsqueeze(-2)
        return x.reshape(-1, heads, width)[:tokens]
    packed = part["dtype"] in NIBBLES
    codes = positions(part["name"], part["width"] // 2 if packed else part["width"])
    if "group" not in part:
        return codes.float()
    groups = part["width"] // part["group"]
    scales = positions(part["name"] + "_scales", groups).view(SCALES[part["scale_dtype"]]).float()
    if packed:
        nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2).long()
        values = NIBBLES[part["dtype"]][nibbles]
    else:
        values = codes.view(CODES[part["dtype"]]).float()
    values = values.unflatten(-1, (groups, part["group"]))
    return (values * scales[..., None]).flatten(-2)


@pytest.mark.parametrize("d", RECORDS, ids=lambda d: d.name)
def test_each_part_by_name_reads_as_gather_decodes(d):
    tokens = 5
    pages = -(-tokens // d.page_size) + 1
    cache = kvforge.create(d.name, pages=pages)
    layer = d.layers - 1
    generator = torch.Generator().manual_seed(7)
    dtype = TORCH_DTYPE[d.input]
    k, v = (torch.randn(tokens, d.heads, d.head_dim, generator=generator).mul(3).to(dtype) for _ in range(2))
    cache.append(layer, k, v, slots=torch.arange(tokens))
    k_out, v_out = (torch.empty(d.heads, tokens, d.head_dim, dtype=dtype) for _ in range(2))
    cache.gather(layer, k_out, v_out, pages=torch.arange(pages, dtype=torch.int32), begin=0, end=tokens)
    view = cache.view(layer)
    record = torch.empty(tokens, d.heads, 2 * d.head_dim)
    covered = 0
    for part in d.record_parts:
        record[..., part["values_at"]:part["values_at"] + part["width"]] = part_values(view, part, d.heads, tokens)
        covered += part["width"]
    assert covered == 2 * d.head_dim
    want = record.to(dtype).transpose(0, 1)  # [heads, tokens, K then V]
    assert torch.equal(want[..., :d.head_dim], k_out) and torch.equal(want[..., d.head_dim:], v_out)
    # The decode is no copy of the input: at least one coded value moved.
    if any("group" in part for part in d.record_parts):
        assert not (torch.equal(k_out, k.transpose(0, 1)) and torch.equal(v_out, v.transpose(0, 1)))

