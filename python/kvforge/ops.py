"""kvforge's cache operations as torch custom ops, which torch.compile(fullgraph=True) traces.

    tc = kvforge.ops.TorchCache(kvforge.create("vllm_paged_nhd.tiny.fp32", pages=64))
    tc.append(layer, k, v, slots=slots)            # torch.ops.kvforge.append
    k_all, v_all = tc.gather(layer, 0, n, pages=p)  # torch.ops.kvforge.gather -> [H, n, D] each
    tc.commit()                                     # torch.ops.kvforge.commit
    tc.copy_blocks(pairs)                           # torch.ops.kvforge.copy_blocks

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

from typing import Optional, Tuple

import torch

from .errors import ArgumentError
from .torch_dtypes import TORCH_DTYPES

_caches = {}


class TorchCache:
    """A kvforge Cache registered for the torch ops. Keep it alive while compiled code may call it."""

    def __init__(self, cache):
        self.cache = cache
        # A str, not an int: torch.compile keeps a str a constant of the graph, where dynamic=True
        # would make an int symbolic and the fake implementations could not look the cache up.
        self.handle = f"kvforge-cache-{id(self):x}"
        self.version = torch.zeros((), dtype=torch.int64)
        d = cache.descriptor  # copied into plain attributes: compiled code reads no native object
        self.heads, self.head_dim, self.dtype = d.heads, d.head_dim, TORCH_DTYPES[d.input]
        _caches[self.handle] = self

    def __del__(self):
        if _caches is not None:  # None while the interpreter shuts down
            _caches.pop(self.handle, None)

    def append(self, layer: int, k, v, rows=None, positions=None, slots=None):
        torch.ops.kvforge.append(self.version, self.handle, layer, k, v, rows, positions, slots)

    def gather(self, layer: int, begin: int, end: int, row: int = 0, pages=None):
        return torch.ops.kvforge.gather(self.version, self.handle, layer, row, pages, begin, end)

    def commit(self):
        torch.ops.kvforge.commit(self.version, self.handle)

    def copy_blocks(self, pairs):
        torch.ops.kvforge.copy_blocks(self.version, self.handle, pairs)


def _cache(handle: str) -> TorchCache:
    try:
        return _caches[handle]
    except KeyError:
        raise ArgumentError(f"cache: no live kvforge.ops.TorchCache has handle {handle!r}") from None


@torch.library.custom_op("kvforge::append", mutates_args=("version",))
def append(version: torch.Tensor, cache: str, layer: int, k: torch.Tensor, v: torch.Tensor,
           rows: Optional[torch.Tensor], positions: Optional[torch.Tensor], slots: Optional[torch.Tensor]) -> None:
    """Writes T tokens of one layer. k, v: [T, H, D]; rows, positions: int32 [T] (contiguous, ring) or
    slots: int64 [T] (paged); -1 is padding."""
    _cache(cache).cache.append(layer, k, v, rows=rows, positions=positions, slots=slots)
    version.add_(1)


@append.register_fake
def _(version, cache, layer, k, v, rows, positions, slots):
    return None


@torch.library.custom_op("kvforge::gather", mutates_args=())
def gather(version: torch.Tensor, cache: str, layer: int, row: int, pages: Optional[torch.Tensor], begin: int,
           end: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reads positions [begin, end) of one sequence of one layer, dequantized: two [H, end - begin, D]
    tensors of the input dtype. row: contiguous and ring; pages: int32 page list (paged)."""
    tc = _cache(cache)
    k = torch.empty(tc.heads, end - begin, tc.head_dim, dtype=tc.dtype)
    v = torch.empty_like(k)
    tc.cache.gather(layer, k, v, row=row, pages=pages, begin=begin, end=end)
    return k, v


@gather.register_fake
def _(version, cache, layer, row, pages, begin, end):
    tc = _cache(cache)
    k = version.new_empty((tc.heads, end - begin, tc.head_dim), dtype=tc.dtype)
    return k, torch.empty_like(k)


@torch.library.custom_op("kvforge::commit", mutates_args=("version",))
def commit(version: torch.Tensor, cache: str) -> None:
    """Lazy variants: writes every layer's staged tokens. Eager variants: nothing to do."""
    _cache(cache).cache.commit()
    version.add_(1)


@commit.register_fake
def _(version, cache):
    return None


@torch.library.custom_op("kvforge::copy_blocks", mutates_args=("version",))
def copy_blocks(version: torch.Tensor, cache: str, pairs: torch.Tensor) -> None:
    """Paged: for each (src, dst) in pairs (int32 [2n]), page dst of every layer becomes a copy of src."""
    _cache(cache).cache.copy_blocks(pairs)
    version.add_(1)


@copy_blocks.register_fake
def _(version, cache, pairs):
    return None
