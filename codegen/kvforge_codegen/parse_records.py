"""Reading a layout's `records` list (docs/specs.md, "Records of named parts"): each a format of named
parts. What a part's width comes to, and whether the bytes fit a model and the layout, is checked per
expansion (records.py), where the model is known."""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

from . import vocab
from .diagnostics import Diagnostics
from .spec import RecordFormat, RecordPartSpec, RecordScale
from .yamlnodes import Value


def parse_records(value: Value, diags: Diagnostics, reader) -> Tuple[RecordFormat, ...]:
    """Every well-formed format of the list, after recording every problem. `reader` is parse.py's
    _Reader, so that every field reads and reports the same way."""
    if not isinstance(value.data, list) or not value.data:
        diags.error(value.loc, "records", "expected a non-empty list of {name, parts} entries")
        return ()
    formats: List[RecordFormat] = []
    for i, item in enumerate(value.data):
        before = len(diags.errors)
        r = reader(diags, item, f"records[{i}]", vocab.RECORD_FIELDS)
        if not r.fields:
            continue
        name = r.name("name")
        if name in vocab.DTYPES:
            diags.error(r.loc_of("name"), f"records[{i}].name", f"{name} is a storage dtype already",
                        "a name that is no dtype")
        elif name is not None and any(f.name == name for f in formats):
            diags.error(r.loc_of("name"), f"records[{i}].name", f"a record named {name} is defined twice")
        parts = _parse_parts(r, f"records[{i}]", diags, reader)
        if len(diags.errors) == before and name is not None:
            formats.append(RecordFormat(name, parts, item.loc))
    return tuple(formats)


def _parse_parts(r, prefix: str, diags: Diagnostics, reader) -> Tuple[RecordPartSpec, ...]:
    if not r.has("parts"):
        r._missing("parts")
        return ()
    pv = r.fields["parts"].value
    if not isinstance(pv.data, list) or not pv.data or len(pv.data) > vocab.MAX_RECORD_PARTS:
        diags.error(pv.loc, f"{prefix}.parts", "expected a list of parts",
                    f"1..{vocab.MAX_RECORD_PARTS} entries of {{{', '.join(vocab.RECORD_PART_FIELDS)}}}")
        return ()
    parts: List[RecordPartSpec] = []
    for j, item in enumerate(pv.data):
        where = f"{prefix}.parts[{j}]"
        p = reader(diags, item, where, vocab.RECORD_PART_FIELDS)
        if not p.fields:
            continue
        name = p.name("name")
        if name is not None and any(q.name == name for q in parts):
            diags.error(p.loc_of("name"), f"{where}.name", f"a part named {name} is listed twice")
        width = _width(p, where, diags)
        dtype = p.choice("dtype", vocab.RECORD_PART_DTYPES)
        scale = _parse_scale(p.fields["scale"].value, where, diags, reader) if p.has("scale") else None
        if dtype in vocab.RECORD_CODE_DTYPES and not p.has("scale"):
            diags.error(p.loc, f"{where}.scale", f"{dtype} holds codes, which need a scale",
                        "scale: {group, dtype, rounding, amax_floor, nan, place}")
        if dtype in vocab.RECORD_FLOAT_DTYPES and p.has("scale"):
            diags.error(p.loc_of("scale"), f"{where}.scale", f"{dtype} values are stored as they are, with no scale",
                        ", ".join(vocab.RECORD_CODE_DTYPES))
        if name is not None and width is not None and dtype is not None and (scale is not None or not p.has("scale")):
            parts.append(RecordPartSpec(name, width, dtype, scale, item.loc))
    if sum(1 for q in parts if q.width == "rest") > 1:
        diags.error(pv.loc, f"{prefix}.parts", "only one part can take the rest of the record's values",
                    "width: rest on one part")
    return tuple(parts)


def _width(p, where: str, diags: Diagnostics) -> Optional[int | str]:
    if not p.has("width"):
        p._missing("width", vocab.RECORD_WIDTHS)
        return None
    v = p.fields["width"].value
    if isinstance(v.data, str):
        return p.choice("width", vocab.RECORD_WIDTHS)
    return p.positive_int("width", maximum=vocab.MAX_HEAD_DIM * 2)


def _parse_scale(value: Value, where: str, diags: Diagnostics, reader) -> Optional[RecordScale]:
    r = reader(diags, value, f"{where}.scale", vocab.RECORD_SCALE_FIELDS)
    if not isinstance(value.data, dict):
        return None
    before = len(diags.errors)
    group = r.positive_int("group")
    if group is not None and group not in vocab.RECORD_GROUP_SIZES:
        diags.error(r.loc_of("group"), f"{where}.scale.group", f"{group} is not a supported group size",
                    ", ".join(map(str, vocab.RECORD_GROUP_SIZES)))
    dtype = r.choice("dtype", vocab.RECORD_SCALE_DTYPES, default="fp32")
    rounding = r.choice("rounding", vocab.RECORD_SCALE_ROUNDINGS, default="exact")
    if dtype == "ue8m0" and rounding == "exact":
        diags.error(r.loc_of("rounding") if r.has("rounding") else r.loc, f"{where}.scale.rounding",
                    "a ue8m0 scale is a power of two, so it is rounded up to one", "pow2_up")
    floor = 0.0
    if r.has("amax_floor"):
        fv = r.fields["amax_floor"].value
        if isinstance(fv.data, bool) or not isinstance(fv.data, (int, float)) or not math.isfinite(fv.data) \
                or fv.data < 0 or fv.data > 1e30:
            diags.error(fv.loc, f"{where}.scale.amax_floor", f"expected a number, got {fv.data!r}"[:80],
                        "a finite number, 0..1e30")
        else:
            floor = float(fv.data)
    nan = r.choice("nan", vocab.RECORD_NAN_RULES, default="group")
    place = r.choice("place", vocab.RECORD_SCALE_PLACES, default="record")
    if len(diags.errors) != before:
        return None
    return RecordScale(group, dtype, rounding, floor, nan, place)
