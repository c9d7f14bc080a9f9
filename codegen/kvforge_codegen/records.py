"""A record format placed for one model: each part's values in the token's record (K then V of a head),
its codes' bytes and its scales' bytes. The one placement: the generated traits carry it to C++
(kvforge::RecordPart, detail/part_record.hpp codes by it) and the Python views name the parts by it.

Bytes, in the order of the parts: a part's codes (or values), then its scales where they live in the
record. Scales placed at the page's end follow the page's records, a token's one after another, in the
order of their parts. A head's K row holds the first half of the record's bytes and V's the second (the
pool's row is half of the record and its page-end scales), so a float layout's views of K and V are the
record's halves, as they are for an MLA latent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from . import vocab
from .spec import LayoutSpec, ModelSpec, RecordFormat

PART_BITS = {"fp8_e4m3": 8, "fp8_e5m2": 8, "int8": 8, "fp4_e2m1": 4, "int4": 4, "bf16": 16, "fp16": 16, "fp32": 32}
SCALE_BYTES = {"fp32": 4, "bf16": 2, "ue8m0": 1}
CPP_DTYPE = {"fp8_e4m3": "f8e4m3", "fp8_e5m2": "f8e5m2", "int8": "i8", "fp4_e2m1": "f4e2m1", "int4": "i4", "bf16": "bf16",
             "fp16": "f16", "fp32": "f32", "ue8m0": "ue8m0"}  # kvforge::DType


@dataclass(frozen=True)
class PlacedPart:
    name: str
    values_at: int  # its first value in the token's record
    width: int
    dtype: str
    bytes_at: int   # its codes' (or values') first byte in the record
    group: int = 0  # values that share a scale; 0: a float part, no scales
    scale_dtype: str = "fp32"
    scales_at: int = 0  # its scales' first byte: in the record, or in the token's page-end entry
    at_page_end: bool = False
    rounding: str = "exact"
    amax_floor: float = 0.0
    nan_group: bool = True

    @property
    def cpp(self) -> str:
        """Its kvforge::RecordPart initializer."""
        return (f'{{"{self.name}", {self.values_at}, {self.width}, kvforge::DType::{CPP_DTYPE[self.dtype]}, '
                f'{self.bytes_at}, {self.group}, kvforge::DType::{CPP_DTYPE[self.scale_dtype]}, {self.scales_at}, '
                f'{"true" if self.at_page_end else "false"}, kvforge::ScaleRounding::{self.rounding}, '
                f'{self.amax_floor!r}f, {"true" if self.nan_group else "false"}}}')

    @property
    def code_bytes(self) -> int:
        return self.width * PART_BITS[self.dtype] // 8

    @property
    def scale_bytes(self) -> int:
        return self.width // self.group * SCALE_BYTES[self.scale_dtype] if self.group else 0


@dataclass(frozen=True)
class PlacedRecord:
    name: str
    parts: Tuple[PlacedPart, ...]
    values: int        # of a token's record: K then V of a head
    record_bytes: int  # in the token's rows
    tail_bytes: int    # after the page's records: the token's page-end scales

    @property
    def stored_row(self) -> int:
        """Bytes of a head's K (or V) row in the pool: half of its record and its page-end scales."""
        return (self.record_bytes + self.tail_bytes) // 2


def record_values(model: ModelSpec) -> int:
    """Values of a head's record: an MLA latent, K and V of their widths, or K then V of head_dim each."""
    if model.mla:
        return sum(model.mla)
    if model.kv_widths:
        return sum(model.kv_widths)
    return 2 * model.head_dim


def named_widths(model: ModelSpec) -> Dict[str, Optional[int]]:
    """What each model field a part's width may name comes to; None where the model has no such field."""
    mla = model.mla or (None, None)
    k, v = model.kv_widths or ((None, None) if model.mla else (model.head_dim, model.head_dim))
    return {"kv_lora_rank": mla[0], "qk_rope_head_dim": mla[1], "head_dim": k, "v_head_dim": v}


def place_record(fmt: RecordFormat, model: ModelSpec) -> Tuple[Optional[PlacedRecord], List[str]]:
    """The format's bytes for this model, or the reasons it cannot hold its record."""
    reasons: List[str] = []
    total, named = record_values(model), named_widths(model)
    widths: List[Optional[int]] = []
    for p in fmt.parts:
        if isinstance(p.width, int):
            widths.append(p.width)
        elif p.width == "rest":
            widths.append(None)
        elif named[p.width] is None:
            reasons.append(f"part {p.name}'s width {p.width} is not a field of {model.name}")
            return None, reasons
        else:
            widths.append(named[p.width])
    known = sum(w for w in widths if w is not None)
    if None in widths:
        if known >= total:
            reasons.append(f"the parts other than {fmt.parts[widths.index(None)].name} take {known} of the "
                           f"record's {total} values, and leave it none")
            return None, reasons
        widths[widths.index(None)] = total - known
    elif known != total:
        reasons.append(f"the parts' widths add up to {known}, and {model.name}'s record holds {total} values")
        return None, reasons
    if total % 2:
        reasons.append(f"{fmt.name} keeps a record as two halves of bytes, and {model.name}'s record of {total} "
                       f"values is odd")
    parts: List[PlacedPart] = []
    at = values_at = tail = 0
    for p, width in zip(fmt.parts, widths):
        s = p.scale
        if s is not None and width % s.group:
            reasons.append(f"part {p.name}: group {s.group} does not divide its {width} values")
            return None, reasons
        part = PlacedPart(p.name, values_at, width, p.dtype, at)
        at += part.code_bytes
        if s is not None:
            part = PlacedPart(p.name, values_at, width, p.dtype, part.bytes_at, s.group, s.dtype,
                              tail if s.place == "page_end" else at, s.place == "page_end", s.rounding,
                              s.amax_floor, s.nan == "group")
            if s.place == "page_end":
                tail += part.scale_bytes
            else:
                at += part.scale_bytes
        parts.append(part)
        values_at += width
    placed = PlacedRecord(fmt.name, tuple(parts), total, at, tail)
    reasons += _alignment_reasons(placed)
    return (placed if not reasons else None), reasons


def _alignment_reasons(r: PlacedRecord) -> List[str]:
    """Each part's codes and scales start on a multiple of their element's bytes, in the record and from
    record to record, so that a view of a part is a typed tensor with whole strides."""
    reasons: List[str] = []
    widest = 1
    for p in r.parts:
        size = max(PART_BITS[p.dtype] // 8, 1)
        widest = max(widest, size)
        if p.bytes_at % size:
            reasons.append(f"part {p.name}'s {p.dtype} values would start at byte {p.bytes_at} of the record, not a "
                           f"multiple of {size}")
        if p.group:
            scale = SCALE_BYTES[p.scale_dtype]
            widest = max(widest, scale)
            if p.scales_at % scale:
                reasons.append(f"part {p.name}'s {p.scale_dtype} scales would start at byte {p.scales_at} of "
                               f"{'its page-end entry' if p.at_page_end else 'the record'}, not a multiple of {scale}")
    if r.record_bytes % widest or r.tail_bytes % widest:
        reasons.append(f"a record of {r.record_bytes} bytes (and {r.tail_bytes} at the page's end) is not a multiple "
                       f"of its widest element's {widest} bytes, so the next token's parts would be misaligned")
    if (r.record_bytes + r.tail_bytes) % 2:
        reasons.append(f"{r.name} keeps a record as two halves of bytes, and its {r.record_bytes + r.tail_bytes} "
                       f"bytes are odd")
    return reasons


def record_reasons(layout: LayoutSpec, model: ModelSpec, fmt: RecordFormat, input_dtype: str) -> List[str]:
    """Why the layout's record format cannot store this model; empty when it can."""
    reasons: List[str] = []
    if input_dtype not in vocab.INPUT_DTYPES:
        reasons.append(f"{fmt.name} storage encodes a float input; give input_dtypes ({', '.join(vocab.INPUT_DTYPES)})")
    _, placing = place_record(fmt, model)
    reasons += placing
    if any(p.scale is not None and p.scale.place == "page_end" for p in fmt.parts):
        inside = tuple(layout.axes[layout.axes.index("page") + 1:]) if "page" in layout.axes else ()
        if model.kv_heads != 1:
            reasons.append(f"{fmt.name} places scales at the page's end, a token's after the page's records, which "
                           f"takes one record a token: {model.name} has {model.kv_heads} KV heads")
        if layout.addressing != "paged" or inside != ("slot", "kv", "head", "dim") or layout.update != "eager":
            reasons.append(f"{fmt.name} places a page's records, then their scales: it takes a paged, eager layout "
                           f"whose axes end [page, slot, kv, head, dim]")
    return reasons
