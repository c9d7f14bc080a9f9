"""The variant plan: which (layout, model, dtype) combinations exist, and the one name for each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from . import vocab
from .naming import variant_name, variant_symbol  # noqa: F401  (re-exported: the plan names its variants)
from .records import PlacedRecord, place_record
from .spec import LayerGroup, LayoutSpec, ModelSpec, Quantization, SpecSet


@dataclass(frozen=True)
class Variant:
    layout: LayoutSpec
    model: ModelSpec
    storage: str
    input: str
    # Hybrid layouts: per layer group, the group and its member variant (the group's layout over the
    # group's layers). Empty otherwise.
    members: Tuple[Tuple[LayerGroup, "Variant"], ...] = ()

    @property
    def name(self) -> str:
        return variant_name(self.layout.name, self.model.name, self.storage, self.input)

    @property
    def symbol(self) -> str:
        return variant_symbol(self.name)

    @property
    def kernel_symbols(self) -> Tuple[str, ...]:
        """The traits structs whose kernels this variant's files instantiate: one per hybrid member, or its own."""
        return tuple(f"{self.symbol}__{g.name}" for g, _ in self.members) or (self.symbol,)

    @property
    def window(self) -> int:
        """Ring window in positions; 0 for layouts without one."""
        if self.layout.addressing != "ring":
            return 0
        if self.layout.window == "model":
            return self.model.sliding_window or 0
        return int(self.layout.window)

    @property
    def page_size(self) -> int:
        return self.layout.page_size or 0

    @property
    def quantization(self) -> Optional[Quantization]:
        """The layout's quantization, for quantized storage; None for float storage."""
        return self.layout.quantization if self.record is None and vocab.DTYPES[self.storage]["quantized"] else None

    @property
    def record(self) -> Optional[PlacedRecord]:
        """The placed record format, where the storage names one of the layout's; None for a dtype."""
        fmt = self.layout.record(self.storage)
        return place_record(fmt, self.model)[0] if fmt is not None else None

    @property
    def scales_per_token(self) -> int:
        """Dynamic scales one token holds, K and V of every layer (a per_tensor scale is per layer)."""
        q = self.quantization
        if q is None or q.granularity == "per_tensor":
            return 0
        per_layer_kv = {"per_token": 1, "per_token_head": self.model.kv_heads,
                        "per_group": self.model.kv_heads * self.scale_groups}[q.granularity]
        return 2 * self.model.layers * per_layer_kv

    @property
    def scale_groups(self) -> int:
        """Scales a head's row holds: head_dim / group_size for per_group, else 1."""
        q = self.quantization
        return self.model.head_dim // q.group_size if q and q.granularity == "per_group" else 1

    @property
    def stored_row(self) -> int:
        """Stored elements of a head's row (C++'s stored_row): head_dim over the values an element holds,
        or half a record format's bytes."""
        if self.record is not None:
            return self.record.stored_row
        return self.model.head_dim // vocab.DTYPES[self.storage].get("values", 1)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence occupies: K and V of every layer and head, and their scales."""
        if self.members:
            return sum(m.bytes_per_token for _, m in self.members)
        element = 1 if self.record is not None else vocab.DTYPES[self.storage]["bytes"]
        values = 2 * self.model.layers * self.model.kv_heads * self.stored_row * element
        q = self.quantization
        return values + (self.scales_per_token * vocab.SCALE_ENTRIES[q.scale_entry]["bytes"] if q else 0)


def hybrid_members(specs: SpecSet, layout: LayoutSpec, model: ModelSpec, storage: str,
                   input_dtype: str) -> Tuple[Tuple[LayerGroup, Variant], ...]:
    layouts = {l.name: l for l in specs.layouts}
    return tuple((model.group(g), Variant(layouts[member], model.for_group(model.group(g)), storage, input_dtype))
                 for g, member in layout.groups)


# ---- the plan ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Filters:
    """Typed matrix filters: empty means everything."""

    layouts: Tuple[str, ...] = ()
    models: Tuple[str, ...] = ()
    dtypes: Tuple[str, ...] = ()
    # Of the variants kept, only a set that covers every kernel: per layout and pair of dtypes, the
    # variants of the narrowest and the widest stored head (covering()).
    cover: bool = False

    def keeps(self, v: Variant) -> bool:
        return ((not self.layouts or v.layout.name in self.layouts)
                and (not self.models or (v.model.shard_of or v.model.name) in self.models)
                and (not self.dtypes or v.storage in self.dtypes))


def filter_problems(specs: SpecSet, f: Filters) -> List[str]:
    """A filter naming something that does not exist is a mistake worth stopping for."""
    problems = []
    for kind, given, allowed in (("layout", f.layouts, [l.name for l in specs.layouts]),
                                 ("model", f.models, [m.name for m in specs.models]),
                                 ("dtype", f.dtypes, list(vocab.DTYPES) + [r.name for l in specs.layouts for r in l.records])):
        for g in given:
            if g not in allowed:
                problems.append(f"filter {kind}: unknown {kind} {g!r} (allowed: {', '.join(allowed)})")
    return problems


def plan_variants(specs: SpecSet, filters: Optional[Filters] = None) -> List[Variant]:
    filters = filters or Filters()
    out: List[Variant] = []
    for layout in specs.layouts:
        for exp in layout.expand:
            for model in (shard for name in exp.models for shard in specs.model(name).with_shards()):
                for storage in exp.dtypes:
                    for input_dtype in exp.input_dtypes or (storage,):
                        members = hybrid_members(specs, layout, model, storage, input_dtype) if layout.hybrid else ()
                        v = Variant(layout, model, storage, input_dtype, members)
                        if filters.keeps(v):
                            out.append(v)
    return sorted(covering(out) if filters.cover else out, key=lambda v: v.name)


def covering(variants: List[Variant]) -> List[Variant]:
    """Per layout and (storage, input) pair, the variants of the narrowest and the widest stored head:
    every kernel body a layout and its dtypes instantiate, at both ends of the sizes that choose between
    a body's paths (a head under one vector, lanes per head), for builds that check that the kernels
    compile (tools/cuda-compile) or run clean under sanitizers (tools/fuzz-short), not their results at
    every model's size, which the test command checks on every variant."""
    groups: dict = {}
    for v in variants:
        groups.setdefault((v.layout.name, v.storage, v.input), []).append(v)
    kept = []
    for group in groups.values():
        by_head = sorted(group, key=lambda v: (v.stored_row * v.model.kv_heads, v.bytes_per_token, v.name))
        kept += [by_head[0]] + ([by_head[-1]] if len(by_head) > 1 else [])
    return kept
