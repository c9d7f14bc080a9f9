"""kvforge from Python: the generated KV-cache variants, their operations and memory management.

Arrays go in and out through DLPack, so torch tensors, numpy arrays and any other `__dlpack__`
producer work, with no copy: strides are honoured and only the last dimension must be contiguous.
Shapes, per operation (H = heads, D = head_dim, L = layers, P = page_size of the descriptor):

    cache = kvforge.create("vllm_paged_nhd.tiny.fp32", pages=64)
    cache.append(layer, k, v, slots=slots)          # k, v [T, H, D]; slots int64 [T] (paged)
    cache.append(layer, k, v, rows=r, positions=p)  # r, p int32 [T] (contiguous, ring)
    cache.commit()                                   # lazy variants write what append staged
    cache.gather(layer, k_out, v_out, row=0, pages=pages, begin=0, end=n)  # k_out, v_out [H, n, D]
    cache.append_latent(layer, latent, slots=slots)  # MLA variants: latent [T, 1, R + P], one record a token
    cache.gather_latent(layer, out, pages=pages, end=n)  # out [1, n, R + P]  (R, P = descriptor.mla)
    cache.append_record(layer, kv, slots=slots)  # K and V of other widths: kv [T, H, K + V], K then V a head
    cache.gather_record(layer, out, pages=pages, end=n)  # out [H, n, K + V]  (K, V = descriptor.kv_widths)
    cache.view(layer)   # {"k", "v"[, "k_scales", "v_scales"]}: the cache's own memory, zero-copy,
                        # [rows or pages, positions or slots, H, D] with the layout's strides; where a
                        # float layout keeps each head's record whole, also "record" and its parts:
                        # "latent", "rope" (MLA; FlashMLA's fp8 also "latent_scales") or "k_part",
                        # "v_part" (K and V of other widths)
    pool = kvforge.StatePool([("conv", (C, K), "bf16"), ("ssm", (H, D, N), "fp32")], layers=L, slots=S)
    pool.view(layer, "ssm")  # [S, H, D, N]: a hybrid model's per-sequence state, updated in place

Every argument is checked before anything is written; a refused call raises one of the classes in
kvforge.errors with the runtime's message. The GIL is released while an operation runs. On a CUDA
build, `create(..., device="cuda", stream=<cudaStream_t as int>)` queues every operation on that
stream. torch custom ops are in kvforge.ops, a transformers Cache in kvforge.hf, spec validation in
kvforge.specs, variants built on demand in kvforge.jit (kvforge.variant), KV pulls between
processes over NIXL in kvforge.nixl, and a prefix cache's KV events as vLLM publishes them in
kvforge.kv_events.
"""

from . import errors
from ._native import (Cache, Descriptor, HybridSequenceManager, SequenceManager, StatePool, StateSlots, cpu_level,
                      cpu_levels_built, cpu_threads, cuda_available, describe, load_variants, nearest, plan_memory, quant_max,
                      set_cpu_threads, shard_pieces, state_model_hash, state_page_size, state_rows, variant_name)
from ._native import create as _create
from ._native import pair as _pair
from ._native import variants as _variants
from .errors import *  # noqa: F401,F403  (the exception classes, at the top level too)
from . import jit  # noqa: E402
from .jit import variant  # noqa: E402  (after the native names it builds on)

__all__ = ["Cache", "Descriptor", "SequenceManager", "HybridSequenceManager", "StatePool", "StateSlots", "create",
           "variants", "describe",
           "nearest", "plan_memory", "quant_max", "variant_name", "cpu_level", "cpu_levels_built", "cpu_threads",
           "set_cpu_threads",
           "cuda_available", "errors", "variant", "load_variants", "shard_pieces", "state_page_size",
           "state_rows", "state_model_hash"] + \
    [name for name in dir(errors) if name.endswith("Error") or name == "Error"]


def variants(layout=None, model=None, storage=None, input=None):
    """The registered variants matching every given field, as Descriptors (sorted by name).

    layout, model: spec names; storage, input: dtype names (fp32, fp16, bf16, int8, fp8_e4m3, fp8_e5m2,
    fp4_e2m1, int4, uint4, or a record format a layout defines, such as flashmla_fp8 and indexer_fp8;
    an input is a float one).
    """
    return [describe(name) for name in _variants(layout, model, storage, input)]


def create(name=None, *, layout=None, model=None, storage=None, input=None, device="cpu", rows=1, max_seq_len=0,
           pages=0, max_staged_tokens=0, stream=0, layers=None, kv_heads=None, head_dim=None, window=None,
           sliding_window=None, layer_groups=None, companion=None):
    """A new cache of the variant `name` (layout.model.dtype), or of the one variant a query matches.

    Sizes at run time: give a layout, a storage dtype and the model's layers, kv_heads and head_dim
    (optionally sliding_window, and window for a ring layout) instead of a model, and the variant is
    built on demand (kvforge.variant, any layout, quantized, ring and lazy ones too), or found in the disk
    cache. A hybrid layout (hybrid_paged) takes layer_groups as a model spec has them ([{"name": "local",
    "layers": [0, 2], "sliding_window": 4}, {"name": "global", "layers": [1, 3]}], named as the layout's
    groups). A query that names a layout, a model and a float storage dtype no variant was generated for is
    served by the generic runtime-strided path (CPU, eager non-ring layouts; descriptor.generic).
    Capacity, as CacheConfig (docs/contract.md): rows (contiguous, ring), max_seq_len (contiguous; 0:
    the model's), pages (paged), max_staged_tokens (lazy; 0: a default). stream: a cudaStream_t as int.
    companion: a second paged variant's name, created with the same capacity over the same pages (C++
    PairedCache, as DeepSeek-V3.2's indexer keys beside its MLA records): the cache returned is the main
    one, its `companion` the other, and a SequenceManager over it manages both caches' pages together.
    """
    sizes = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
    if any(v is not None for v in sizes.values()) or window is not None or sliding_window is not None or \
            layer_groups is not None:
        given = {"layout": layout, "storage": storage, **sizes}
        missing = [k for k, v in given.items() if v is None]
        if missing or name or model:
            raise ArgumentError(f"{(missing or ['model'])[0]}: sizes at run time take a layout, a storage dtype, "
                                f"layers, kv_heads and head_dim, and no name or model")
        spec = dict(sizes, max_seq_len=max_seq_len or max(4096, sliding_window or 0))
        if sliding_window is not None:
            spec["sliding_window"] = sliding_window
        groups = jit.layout_groups(layout)
        if groups and layer_groups is None:
            raise ArgumentError(f"layer_groups: {layout} keeps a member cache for each of the layer groups "
                                f"{', '.join(groups)}; give layer_groups=[{{'name': {groups[0]!r}, 'layers': [...]}}, "
                                f"...], as a model spec names them (docs/memory.md, \"Hybrid layer groups\")")
        if layer_groups is not None:
            spec["layer_groups"] = layer_groups
        name = variant(layout, spec, storage, input, window=window).name
        layout = storage = input = None
    cache = _create(name, layout, model, storage, input, device, rows, max_seq_len, pages, max_staged_tokens, stream)
    if companion is None:
        return cache
    return _pair(cache, _create(companion, None, None, None, None, device, rows, max_seq_len, pages, max_staged_tokens,
                                stream))
