"""kvforge's cache operations as torch custom ops, which torch.compile(fullgraph=True) traces.

    tc = kvforge.ops.TorchCache(kvforge.create("vllm_paged_nhd.tiny.fp32", pages=64))
    tc.append(layer, k, v, slots=slots)            # torch.ops.kvforge.append
    k_all, v_all = tc.gather(layer, 0, n, pages=p)  # torch.ops.kvforge.gather -> [H, n, D] each
    tc.commit()                                     # torch.ops.kvforge.commit
    tc.copy_blocks(pairs)                           # torch.ops.kvforge.copy_blocks
    out, lse = tc.attend(layer, q, query_start, lengths, page_table=table)  # torch.ops.kvforge.attend
    tc.append_record(layer, rec, slots=slots)       # K and V of other widths, or an MLA latent:
    rec_all = tc.gather_record(layer, 0, n, pages=p)  # -> [H, n, W]; append_latent, gather_latent alike

The ops are made here from the operations table (runtime/include/kvforge/cache_ops.hpp): one for each row
marked `torch`, shaped by the family its signature binds through (kvforge._native._cache_ops, from
python/src/rows.hpp), with the row's own argument names:
    tensors_in   (layer, <tensors>, rows, positions, slots) -> ()    writes T tokens
    tensors_out  (layer, row, pages, begin, end) -> <tensors>        reads [begin, end) of a sequence
    whole        () -> ()                                            acts on the whole cache
    indices      (<index array>) -> ()                               e.g. copy_blocks' page pairs
    attend       (layer, q, query_start, lengths, ...) -> (out, lse) attention over the layer in place
Integers are SymInt in every schema, so a compiled decode loop does not specialize on a length, a
position or a layer: one graph serves every step.
A new row marked `torch` of one of these families is a new op with no edit here.

Each op takes the cache's `version`, a 0-d int64 tensor that every write increments, and names it
as mutated where the op writes the cache (`Tensor(a!) version`), as vLLM's reshape_and_cache names its
caches. So torch.compile orders every read after the writes before it, and never drops a write as
dead code. The version, not the cache memory, carries the annotation because functionalization
(torch.compile's aot_eager and inductor) clones what an op mutates and copies the clone back after
it: a clone of the pool would copy stale bytes over what the op wrote through the cache, while a
clone of the version is exact. The cache itself travels as a str handle (a constant of the graph).
Fake (meta) implementations give the output shapes, so tracing needs no data. Read the cache's
memory through `cache.view()` outside compiled regions.
"""

import torch

from . import _native
from .errors import ArgumentError
from .torch_dtypes import TORCH_DTYPES

_caches = {}

# A read's outputs: each output argument's [heads, width] beside its positions, from the cache's
# TorchCache (the rows' comments give the same shapes: gather's k_out and v_out are [H, end - begin, D]).
OUTPUT_SHAPES = {
    "k_out": lambda tc: (tc.heads, tc.head_dim),
    "v_out": lambda tc: (tc.heads, tc.head_dim),
    "record_out": lambda tc: (tc.heads, tc.record_width),  # K then V of other widths, or an MLA latent
    "latent_out": lambda tc: (1, tc.record_width),         # an MLA latent: one head
}
TARGETS = ("rows", "positions", "slots")  # a TokenTargets' arrays, as kvforge.Cache takes them
RANGE = ("row", "pages", "begin", "end")  # a GatherRange's fields, likewise


class TorchCache:
    """A kvforge Cache registered for the torch ops. Keep it alive while compiled code may call it. Its
    methods are the ops, one per row marked `torch`."""

    def __init__(self, cache):
        self.cache = cache
        # A str, not an int: torch.compile keeps a str a constant of the graph, where dynamic=True
        # would make an int symbolic and the fake implementations could not look the cache up.
        self.handle = f"kvforge-cache-{id(self):x}"
        self.version = torch.zeros((), dtype=torch.int64)
        d = cache.descriptor  # copied into plain attributes: compiled code reads no native object
        self.heads, self.head_dim, self.dtype = d.heads, d.head_dim, TORCH_DTYPES[d.input]
        # A token's record (descriptor.records(): K then V of other widths, or an MLA latent and its RoPE
        # part), else the stored K and V, which the record calls then refuse.
        parts = d.kv_widths or d.mla
        self.record_width = sum(parts) if parts else 2 * d.head_dim
        # attend's query and output widths: an MLA latent and its RoPE part in, the latent out (the
        # absorbed form); K's and V's widths; else head_dim.
        self.key_width = sum(d.mla) if d.mla else d.kv_widths[0] if d.kv_widths else d.head_dim
        self.value_width = d.mla[0] if d.mla else d.kv_widths[1] if d.kv_widths else d.head_dim
        self.device = torch.device(cache.config["device"])
        _caches[self.handle] = self

    def __del__(self):
        if _caches is not None:  # None while the interpreter shuts down
            _caches.pop(self.handle, None)


def _cache(handle: str) -> TorchCache:
    try:
        return _caches[handle]
    except KeyError:
        raise ArgumentError(f"cache: no live kvforge.ops.TorchCache has handle {handle!r}") from None


def _tensors_in(name, arguments):
    """A write of T tokens: (layer, <tensors>, targets) -> the op and TorchCache's method."""
    tensors = arguments[1:-1]
    schema = ("(Tensor(a0!) version, str cache, SymInt layer, " + "".join(f"Tensor {t}, " for t in tensors) +
              ", ".join(f"Tensor? {t}" for t in TARGETS) + ") -> ()")

    def run(version, cache, layer, *given):
        values, targets = given[:len(tensors)], dict(zip(TARGETS, given[len(tensors):]))
        getattr(_cache(cache).cache, name)(layer, *values, **targets)
        version.add_(1)

    op = torch.library.custom_op(f"kvforge::{name}", run, mutates_args=("version",), schema=schema)
    op.register_fake(lambda version, cache, layer, *given: None)

    def method(self, layer, *values, rows=None, positions=None, slots=None):
        if len(values) != len(tensors):
            raise ArgumentError(f"{name} takes {', '.join(tensors)} after the layer; {len(values)} tensors were given")
        getattr(torch.ops.kvforge, name)(self.version, self.handle, layer, *values, rows, positions, slots)
    return op, method


def _tensors_out(name, arguments):
    """A read of positions [begin, end): (layer, range, <outputs>) -> the op, returning the outputs, and
    TorchCache's method (layer, begin, end, row=0, pages=None)."""
    outputs = arguments[2:]
    unknown = [o for o in outputs if o not in OUTPUT_SHAPES]
    if unknown:
        raise ArgumentError(f"kvforge.ops: {name}'s outputs {unknown} have no shape in OUTPUT_SHAPES")
    results = ", ".join("Tensor" for _ in outputs)
    schema = (f"(Tensor version, str cache, SymInt layer, SymInt row, Tensor? pages, SymInt begin, SymInt end) -> "
              f"{'(' + results + ')' if len(outputs) > 1 else results}")

    def shapes(tc, begin, end):
        return [(OUTPUT_SHAPES[o](tc)[0], end - begin, OUTPUT_SHAPES[o](tc)[1]) for o in outputs]

    def run(version, cache, layer, row, pages, begin, end):
        tc = _cache(cache)
        out = [torch.empty(s, dtype=tc.dtype, device=tc.device) for s in shapes(tc, begin, end)]
        getattr(tc.cache, name)(layer, *out, row=row, pages=pages, begin=begin, end=end)
        return tuple(out) if len(out) > 1 else out[0]

    def fake(version, cache, layer, row, pages, begin, end):
        tc = _cache(cache)
        out = [version.new_empty(s, dtype=tc.dtype) for s in shapes(tc, begin, end)]
        return tuple(out) if len(out) > 1 else out[0]

    op = torch.library.custom_op(f"kvforge::{name}", run, mutates_args=(), schema=schema)
    op.register_fake(fake)

    def method(self, layer, begin, end, row=0, pages=None):
        return getattr(torch.ops.kvforge, name)(self.version, self.handle, layer, row, pages, begin, end)
    return op, method


def _whole(name, arguments):
    """An operation on the whole cache, no arguments."""
    def run(version, cache):
        getattr(_cache(cache).cache, name)()
        version.add_(1)

    op = torch.library.custom_op(f"kvforge::{name}", run, mutates_args=("version",),
                                 schema="(Tensor(a0!) version, str cache) -> ()")
    op.register_fake(lambda version, cache: None)

    def method(self):
        getattr(torch.ops.kvforge, name)(self.version, self.handle)
    return op, method


def _indices(name, arguments):
    """An operation that takes one index array (copy_blocks' pairs)."""
    (indices,) = arguments

    def run(version, cache, values):
        getattr(_cache(cache).cache, name)(values)
        version.add_(1)

    op = torch.library.custom_op(f"kvforge::{name}", run, mutates_args=("version",),
                                 schema=f"(Tensor(a0!) version, str cache, Tensor {indices}) -> ()")
    op.register_fake(lambda version, cache, values: None)

    def method(self, values):
        getattr(torch.ops.kvforge, name)(self.version, self.handle, values)
    return op, method


def _attend(name, arguments):
    """Attention over a layer where it lies: (layer, q, batch arrays, options) -> out [T, QH, Dv] and lse [T, QH]."""
    schema = ("(Tensor version, str cache, SymInt layer, Tensor q, Tensor query_start, Tensor lengths, "
              "Tensor? positions, Tensor? rows, Tensor? page_table, SymInt max_pages, float scale, bool causal, "
              "SymInt window, float softcap, Tensor? sinks, Tensor? begins) -> (Tensor, Tensor)")

    def run(version, cache, layer, q, query_start, lengths, positions, rows, page_table, max_pages, scale, causal,
            window, softcap, sinks, begins):
        tc = _cache(cache)
        out = q.new_empty((q.shape[0], q.shape[1], tc.value_width))
        lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
        getattr(tc.cache, name)(layer, q, out, query_start, lengths, positions=positions, rows=rows,
                                page_table=page_table, max_pages=max_pages, lse=lse, scale=scale, causal=causal,
                                window=window, softcap=softcap, sinks=sinks, begins=begins)
        return out, lse

    def fake(version, cache, layer, q, query_start, lengths, positions, rows, page_table, max_pages, scale, causal,
             window, softcap, sinks, begins):
        tc = _cache(cache)
        return (q.new_empty((q.shape[0], q.shape[1], tc.value_width)),
                q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32))

    op = torch.library.custom_op(f"kvforge::{name}", run, mutates_args=(), schema=schema)
    op.register_fake(fake)

    def method(self, layer, q, query_start, lengths, positions=None, rows=None, page_table=None, max_pages=0,
               scale=0.0, causal=True, window=0, softcap=0.0, sinks=None, begins=None):
        return getattr(torch.ops.kvforge, name)(self.version, self.handle, layer, q, query_start, lengths, positions,
                                                rows, page_table, max_pages, scale, causal, window, softcap, sinks,
                                                begins)
    return op, method


FAMILIES = {"tensors_in": _tensors_in, "tensors_out": _tensors_out, "whole": _whole, "indices": _indices,
            "attend": _attend}


def _make_ops():
    """One op and one TorchCache method per row marked `torch`, as this module's attributes by the row's
    name (kvforge.ops.append is torch.ops.kvforge.append's definition)."""
    made = {}
    for name, _route, python, family, arguments in _native._cache_ops():
        if python != "torch":
            continue
        if family not in FAMILIES:
            raise ArgumentError(f"kvforge.ops: the row {name} is marked torch, but its family {family} makes no "
                                f"op (allowed: {', '.join(FAMILIES)})")
        op, method = FAMILIES[family](name, list(arguments))
        method.__name__ = name
        method.__doc__ = f"torch.ops.kvforge.{name}: {FAMILIES[family].__doc__.splitlines()[0]}"
        setattr(TorchCache, name, method)
        made[name] = op
    return made


globals().update(_make_ops())
