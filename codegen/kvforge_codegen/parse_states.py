"""Reading a model spec's `linear_layers`: which layers of a hybrid model keep a per-sequence state
instead of K/V, and that state's record (docs/specs.md, "Hybrid models with linear layers")."""

from __future__ import annotations

from typing import List, Optional, Tuple

from . import vocab
from .diagnostics import Diagnostics
from .spec import LINEAR_FIELDS, STATE_PART_FIELDS, StatePartSpec
from .yamlnodes import Value


def parse_linear_layers(value: Value, layers: int, diags: Diagnostics, reader, shown,
                        tensor_parallel: Tuple[int, ...] = ()
                        ) -> Optional[Tuple[Tuple[int, ...], Tuple[StatePartSpec, ...]]]:
    """(linear layer indices, state parts), or None after recording every problem. `reader` and `shown`
    are parse.py's _Reader and _shown, so that every field reads and reports the same way. Every degree
    of `tensor_parallel` must split each part's shard_axis evenly."""
    before = len(diags.errors)
    r = reader(diags, value, "linear_layers", LINEAR_FIELDS)
    if not r.fields:
        return None
    indices: List[int] = []
    lv = r.fields.get("layers")
    allowed = f"layer indices 0..{layers - 1}, leaving at least one attention layer"
    if lv is None:
        r._missing("layers", allowed)
    elif not isinstance(lv.value.data, list) or not lv.value.data:
        diags.error(lv.value.loc, "linear_layers.layers", "expected a non-empty list of layer indices", allowed)
    else:
        for entry in lv.value.data:
            if isinstance(entry.data, bool) or not isinstance(entry.data, int) or not 0 <= entry.data < layers:
                diags.error(entry.loc, "linear_layers.layers", f"{shown(entry.data)} is not a layer of this model",
                            f"0..{layers - 1}")
            elif entry.data in indices:
                diags.error(entry.loc, "linear_layers.layers", f"layer {entry.data} is listed twice")
            else:
                indices.append(entry.data)
        if len(indices) == layers:
            diags.error(lv.value.loc, "linear_layers.layers", "every layer is linear: there is no K/V to cache",
                        allowed)
    parts: List[StatePartSpec] = []
    sv = r.fields.get("states")
    if sv is None:
        r._missing("states", "a list of {name, shape, dtype}")
    elif not isinstance(sv.value.data, list) or not sv.value.data or len(sv.value.data) > vocab.MAX_STATE_PARTS:
        diags.error(sv.value.loc, "linear_layers.states", "expected a list of 1 to 64 {name, shape, dtype}")
    else:
        for i, item in enumerate(sv.value.data):
            part = _parse_part(item, i, diags, reader, shown, tensor_parallel)
            if part is not None and any(p.name == part.name for p in parts):
                diags.error(item.loc, f"linear_layers.states[{i}].name", f"{part.name!r} names two parts")
            elif part is not None:
                parts.append(part)
    if len(diags.errors) != before:
        return None
    return tuple(sorted(indices)), tuple(parts)


def _parse_part(item: Value, i: int, diags: Diagnostics, reader, shown, tensor_parallel: Tuple[int, ...]
                ) -> Optional[StatePartSpec]:
    at = f"linear_layers.states[{i}]"
    r = reader(diags, item, at, STATE_PART_FIELDS)
    if not r.fields:
        return None
    name = r.name("name")
    dtype = r.choice("dtype", vocab.STATE_DTYPES)
    allowed = f"1 to {vocab.MAX_STATE_RANK} extents >= 1, at most {vocab.MAX_STATE_PART_BYTES} bytes in all"
    if "shape" not in r.fields:
        r._missing("shape", allowed)
    shape = _extents(r.fields["shape"].value if "shape" in r.fields else None, f"{at}.shape", dtype, None, diags, shown,
                     allowed)
    ok = shape is not None
    axis = _shard_axis(r, at, shape if ok else None, tensor_parallel, diags, shown)
    shards = _shard_shapes(r, at, shape if ok else None, dtype, tensor_parallel, diags, shown)
    if name is None or dtype is None or not ok or axis is False or shards is False:
        return None
    return StatePartSpec(name, tuple(shape), dtype, item.loc, axis, shards)


def _extents(v: Optional[Value], field: str, dtype: Optional[str], rank: Optional[int], diags: Diagnostics, shown,
             allowed: str) -> Optional[List[int]]:
    """A shape: 1 to 4 extents >= 1 (`rank` of them where given), within the size limit where `dtype` is
    known; None after recording a problem, or where `v` is absent."""
    if v is None:
        return None
    if not isinstance(v.data, list) or not 1 <= len(v.data) <= vocab.MAX_STATE_RANK or \
            (rank is not None and len(v.data) != rank):
        diags.error(v.loc, field, f"expected a list of {rank if rank is not None else '1 to 4'} extents", allowed)
        return None
    shape: List[int] = []
    for item in v.data:  # every bad extent is reported
        if isinstance(item.data, bool) or not isinstance(item.data, int) or item.data < 1:
            diags.error(item.loc, field, f"expected an extent >= 1, got {shown(item.data)}", allowed)
        else:
            shape.append(item.data)
    if len(shape) != len(v.data):
        return None
    elements = 1
    for extent in shape:
        elements *= extent
    if dtype is not None and elements * vocab.DTYPES[dtype]["bytes"] > vocab.MAX_STATE_PART_BYTES:
        diags.error(v.loc, field, "is too large", allowed)
        return None
    return shape


def _shard_axis(r, at: str, shape: Optional[List[int]], tensor_parallel: Tuple[int, ...], diags: Diagnostics, shown):
    """The part's shard_axis (None where it has none), or False after recording a problem: an index into
    the shape whose extent every tensor-parallel degree divides."""
    if not r.has("shard_axis"):
        return None
    v = r.fields["shard_axis"].value
    if shape is None:
        return False
    allowed = f"an axis 0..{len(shape) - 1} of the shape"
    if isinstance(v.data, bool) or not isinstance(v.data, int) or not 0 <= v.data < len(shape):
        diags.error(v.loc, f"{at}.shard_axis", f"expected an axis of the shape, got {shown(v.data)}", allowed)
        return False
    extent = shape[v.data]
    uneven = [tp for tp in tensor_parallel if extent % tp]
    if uneven:
        diags.error(v.loc, f"{at}.shard_axis", f"extent {extent} does not split evenly over {uneven[0]} ranks "
                    f"(tensor_parallel)", "an axis whose extent every tensor_parallel degree divides")
        return False
    return v.data


def _shard_shapes(r, at: str, shape: Optional[List[int]], dtype: Optional[str], tensor_parallel: Tuple[int, ...],
                  diags: Diagnostics, shown):
    """The part's shape on a rank at each degree, where a plain split is not it (Mamba-2 with fewer groups
    than ranks: vLLM gives each rank a copy of a group): ((degree, shape), ...), () where the part gives
    none, or False after recording a problem. Every degree of tensor_parallel needs one."""
    if not r.has("shard_shapes"):
        return ()
    v = r.fields["shard_shapes"].value
    field = f"{at}.shard_shapes"
    if r.has("shard_axis"):
        diags.error(v.loc, field, "a part gives its ranks' shapes one way", "one of shard_axis and shard_shapes")
        return False
    if shape is None:
        return False
    allowed = f"a mapping of each tensor_parallel degree to a shape of {len(shape)} extents"
    if not isinstance(v.data, dict) or not v.data:
        diags.error(v.loc, field, "expected a mapping of degrees to shapes", allowed)
        return False
    shards = {}
    for key, entry in v.data.items():
        if not key.isdigit() or int(key) < 2:
            diags.error(entry.key_loc, field, f"{shown(key)} is not a degree above 1", allowed)
            continue
        extents = _extents(entry.value, f"{field}.{key}", dtype, len(shape), diags, shown, allowed)
        if extents is not None:
            shards[int(key)] = tuple(extents)
    missing = [tp for tp in tensor_parallel if tp not in shards]
    if missing and len(shards) == len(v.data):
        diags.error(v.loc, field, f"gives no shape for degree {missing[0]}", allowed)
    if missing or len(shards) != len(v.data):
        return False
    return tuple(sorted(shards.items()))
