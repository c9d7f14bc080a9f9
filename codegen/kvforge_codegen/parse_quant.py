"""Reading a layout's `quantization` block (docs/specs.md, "Quantization")."""

from __future__ import annotations

from typing import Optional, Tuple

from . import vocab
from .diagnostics import Diagnostics
from .spec import QUANTIZATION_FIELDS, Quantization
from .yamlnodes import Value


def parse_quantization(value: Value, addressing: Optional[str], axes: Optional[Tuple[str, ...]],
                       diags: Diagnostics, reader) -> Optional[Quantization]:
    """The block, or None after recording every problem. `reader` is parse.py's _Reader, so that every
    field reads and reports the same way. Whether group_size divides each model's head_dim is checked
    per expansion (validate.py)."""
    r = reader(diags, value, "quantization", QUANTIZATION_FIELDS)
    if not isinstance(value.data, dict):
        return None
    before = len(diags.errors)
    granularity = r.choice("granularity", vocab.GRANULARITIES)
    scale_dtype = r.choice("scale_dtype", tuple(vocab.SCALE_DTYPES), default="fp32")
    scales = r.choice("scales", vocab.SCALE_PLACEMENTS, default="separate")
    sizes = ", ".join(map(str, vocab.GROUP_SIZES))
    group_size = r.positive_int("group_size", required=granularity == "per_group")
    if group_size is not None and group_size not in vocab.GROUP_SIZES:
        diags.error(r.loc_of("group_size"), "quantization.group_size", f"{group_size} is not a supported group size",
                    sizes)
    if r.has("group_size") and granularity is not None and granularity != "per_group":
        diags.error(r.loc_of("group_size"), "quantization.group_size",
                    f"only per_group quantization has groups, not {granularity}", "granularity: per_group")
    tensor_scale = r.choice("tensor_scale", vocab.TENSOR_SCALES, default="none")
    if scale_dtype in vocab.DYNAMIC_ONLY_SCALE_DTYPES and granularity == "per_tensor":
        diags.error(r.loc_of("scale_dtype"), "quantization.scale_dtype",
                    f"a per_tensor scale is set by the user, and {scale_dtype} rounds a scale up to its next value",
                    ", ".join(d for d in vocab.SCALE_DTYPES if d not in vocab.DYNAMIC_ONLY_SCALE_DTYPES))
    if tensor_scale not in (None, "none") and granularity is not None and granularity != "per_group":
        diags.error(r.loc_of("tensor_scale"), "quantization.tensor_scale",
                    f"a second-level tensor scale sits under group scales, and {granularity} has none",
                    "granularity: per_group")
    zero_point = r.flag("zero_point")
    if zero_point:
        loc = r.loc_of("zero_point")
        if scale_dtype is not None and scale_dtype not in vocab.ZERO_POINT_SCALE_DTYPES:
            diags.error(loc, "quantization.zero_point",
                        f"a zero point is held in the scale's dtype, and {scale_dtype} cannot hold 0..15",
                        "scale_dtype: " + ", ".join(vocab.ZERO_POINT_SCALE_DTYPES))
        if granularity is not None and granularity not in vocab.ZERO_POINT_GRANULARITIES:
            diags.error(loc, "quantization.zero_point", f"a zero point is a group's, and {granularity} is not grouped "
                        "by head", "granularity: " + ", ".join(vocab.ZERO_POINT_GRANULARITIES))
        if tensor_scale not in (None, "none"):
            diags.error(loc, "quantization.zero_point", "a zero-point group takes no second-level tensor scale",
                        "tensor_scale: none")
    if scales == "in_page":
        loc = r.loc_of("scales")
        if tensor_scale not in (None, "none"):
            diags.error(loc, "quantization.scales", "a layout's tensor scales live in its separate scale buffer",
                        "separate")
        if addressing is not None and addressing != "paged":
            diags.error(loc, "quantization.scales", f"in_page scales need paged addressing, not {addressing}",
                        "separate")
        if granularity == "per_tensor":
            diags.error(loc, "quantization.scales", "a per_tensor scale is one value per layer, not one per page",
                        "separate")
        if axes is not None and "page" in axes:
            inside = axes[axes.index("page") + 1:]
            missing = [a for a in ("slot", "head", "dim") if a not in inside]
            if missing:
                diags.error(loc, "quantization.scales",
                            f"in_page scales need the axes that vary within a page after 'page', "
                            f"and {', '.join(missing)} come before it", "[..., page, ..., slot, ..., head, ..., dim]")
    if len(diags.errors) != before:
        return None
    return Quantization(granularity, scale_dtype, scales, value.loc, group_size or 0, tensor_scale, zero_point)
