"""The arithmetic of a kvforge.nixl pull: what each side publishes of a cache (_describe), the checks of a
cache pair, where a request's positions lie, and the byte offsets of its (layer, K or V, position, head)
runs in the source, the target and a staging area, merged into NIXL descriptors. Pure numpy over the
published facts."""

import numpy as np
import torch

import kvforge

from .torch_dtypes import CODE_DTYPES


class Placement:
    """Where a request's positions lie in one cache: a page table (paged layouts; position p is on
    pages[p // page_size] at slot p % page_size) or a row (contiguous layouts; position p of that row).

    generations: what the sender's Agent.placement() published with it, one a page (or one for the row):
    a pull then checks after its READs that the sender has not retired (Agent.retire) any of them since,
    and refuses the request's bytes if it has."""

    def __init__(self, pages=None, row=None, generations=None):
        if (pages is None) == (row is None):
            raise kvforge.ArgumentError("placement: give pages (a paged cache) or row (a contiguous one), not both")
        self.pages = None if pages is None else np.asarray(pages, dtype=np.int64).reshape(-1)
        self.row = row
        self.generations = None if generations is None else np.asarray(generations, dtype=np.int64).reshape(-1)
        units = 1 if row is not None else len(self.pages)
        if self.generations is not None and len(self.generations) != units:
            raise kvforge.ArgumentError(f"placement.generations: {len(self.generations)} given for {units} "
                                        f"{'row' if row is not None else 'pages'} (allowed: one each)")


def placement_units(d, placement, positions):
    """Indices into placement's pages (or [0] for its row) that positions [begin, end) touch."""
    if not d["paged"]:
        return np.zeros(1, dtype=np.int64)
    return np.arange(int(positions[0]) // d["page_size"], int(positions[-1]) // d["page_size"] + 1)


def page_bytes(d):
    """Bytes of one page of a layer, where a page is one block of them (a published description); else None."""
    outermost = [axis for axis in d["axes"] if axis != "layer"][0]
    layers_outside = "layer" not in d["axes"] or d["axes"][0] == "layer"
    if not d["paged"] or outermost != "page" or not layers_outside or d["lazy"] or d["scales"] not in (None, "in_page"):
        return None
    return d["strides"][0] * d["element_bytes"]


def same_pages(mine, theirs):
    """Whether one sender's cache is this cache's own variant (and rank), its pages blocks: then its pages,
    codes and scales alike, can be read whole, a quantized one too."""
    return len(theirs) == 1 and theirs[0]["name"] == mine["name"] and theirs[0]["rank"] == mine["rank"] \
        and page_bytes(mine) is not None


def decodable(d):
    """Whether a quantized sender's codes can be read and decoded here: static per-tensor scales published at
    one address, and codes of one element each (int8, fp8)."""
    return d["quant"] == "per_tensor" and d["tensor_scales"] is not None and d["storage"] in CODE_DTYPES


def _describe(cache, rank):
    """What a peer needs of a registered cache: its variant's facts and each layer's K and V addresses."""
    d = cache.descriptor
    if d.hybrid:
        raise kvforge.UnsupportedError(f"cache: {d.name} is hybrid; register each group's cache (cache.group(g))")
    if d.addressing == "ring":
        raise kvforge.UnsupportedError(f"cache: {d.name} is a ring; its positions wrap, so a request has no fixed "
                                       f"place to pull from or into")
    if not 0 <= rank < d.tensor_parallel:
        raise kvforge.OutOfRangeError(f"rank: {rank} is outside [0, {d.tensor_parallel}) ({d.name} is a shard of "
                                      f"degree {d.tensor_parallel})")
    layers = []
    for layer in range(d.layers):
        view = cache.view(layer)
        k, v = torch.from_dlpack(view["k"]), torch.from_dlpack(view["v"])
        layers.append([k.data_ptr(), v.data_ptr()])
    strides = list(k.stride()[:3])  # [row or page, position or slot, head], in elements; dim is contiguous
    buffers = [[t.data_ptr(), t.numel()] for t in (torch.from_dlpack(b) for b in cache.buffers())]
    # Static per-tensor scales (vLLM's k_scale, v_scale): fp32 [layers, K/V] at one address, which a
    # receiver of the same codes reads to check that they mean the same values.
    scales = None
    if d.quant == "per_tensor":
        at = [torch.from_dlpack(cache.view(layer)[side]).data_ptr() for layer in range(d.layers)
              for side in ("k_scales", "v_scales")]
        scales = at[0] if at == [at[0] + 4 * i for i in range(len(at))] else None
    return {"name": d.name, "model": d.shard_of, "layers": d.layers, "heads": d.heads, "model_heads": d.model_heads,
            "head_dim": d.head_dim, "storage": d.storage, "input": d.input, "quant": d.quant, "paged": d.paged,
            "page_size": d.page_size, "extent": [k.shape[0], k.shape[1]], "element_bytes": k.element_size(),
            "axes": list(d.axes), "lazy": d.lazy, "scales": d.scale_placement,
            "tp": d.tensor_parallel, "rank": rank, "heads_of_rank": list(d.shard_heads(rank)),
            "device": "VRAM" if k.device.type == "cuda" else "DRAM", "device_id": max(k.get_device(), 0),
            "strides": strides, "addresses": layers, "buffers": buffers, "tensor_scales": scales}


def check_ranks(theirs, rank, name, kind):
    """Source `rank` of a sending group, described by theirs[rank] (its degree and rank): one source per
    rank, in rank order."""
    d = theirs[rank]
    if d["tp"] != len(theirs):
        raise kvforge.ArgumentError(f"sources: {len(theirs)} given, but sources[{rank}] ({name}) is a shard "
                                    f"of degree {d['tp']}: give one source per rank")
    if d["rank"] != rank:
        raise kvforge.ArgumentError(f"sources[{rank}]: that {kind} is rank {d['rank']}; list the sources in rank order")


def _check_pair(mine, theirs):
    """Every sender against this cache: one model, one degree, ranks in order; a refusal names the field."""
    for rank, d in enumerate(theirs):
        for field in ("model", "layers", "model_heads", "head_dim"):
            if d[field] != mine[field]:
                raise kvforge.ArgumentError(f"{field}: sources[{rank}] ({d['name']}) has {d[field]!r}, this cache "
                                            f"({mine['name']}) {mine[field]!r}")
        check_ranks(theirs, rank, d["name"], "cache")
        if d["quant"] != "none" and not same_pages(mine, theirs) and not decodable(d):
            raise kvforge.UnsupportedError(f"storage: sources[{rank}] ({d['name']}) is quantized ({d['storage']}, "
                                           f"{d['quant']} scales); pulls read float sources, int8 or fp8 codes under "
                                           f"static per-tensor scales, or the whole pages of one sender of this "
                                           f"cache's own variant whose pages are blocks")
        if d["device"] != theirs[0]["device"]:
            raise kvforge.ArgumentError("sources: every rank's cache must be in one kind of memory")
    if mine["storage"] != theirs[0]["storage"] and mine["input"] not in ("fp32", "fp16", "bf16"):
        raise kvforge.DtypeError(f"input: {mine['name']} appends {mine['input']}")


def _same_geometry(mine, theirs):
    """One sender whose pool places a request's bytes as this one's: the same storage, page size, heads
    and strides, and V at the same distance from K."""
    return len(theirs) == 1 and all(mine[f] == theirs[0][f] for f in ("storage", "page_size", "heads", "strides")) \
        and _axis_strides(mine)["kv"] == _axis_strides(theirs[0])["kv"]


def _places(what, d, placement, positions):
    """(row or page, position or slot) of each position, checked against the cache's extent."""
    if not isinstance(placement, Placement):
        raise kvforge.ArgumentError(f"{what}: expected a kvforge.nixl.Placement")
    extent_rows, extent_positions = d["extent"]
    if d["paged"]:
        if placement.pages is None:
            raise kvforge.ArgumentError(f"{what}: {d['name']} is paged; give Placement(pages=...)")
        needed = int(positions[-1]) // d["page_size"] + 1
        if len(placement.pages) < needed:
            raise kvforge.ArgumentError(f"{what}.pages: {len(placement.pages)} pages cover positions up to "
                                        f"{len(placement.pages) * d['page_size']}, the pull needs {needed} pages")
        used = placement.pages[:needed]
        bad = np.flatnonzero((used < 0) | (used >= extent_rows))
        if bad.size:
            i = int(bad[0])
            raise kvforge.OutOfRangeError(f"{what}.pages[{i}] = {int(used[i])} is outside [0, {extent_rows})")
        return placement.pages[positions // d["page_size"]], positions % d["page_size"]
    if placement.row is None:
        raise kvforge.ArgumentError(f"{what}: {d['name']} is contiguous; give Placement(row=...)")
    if not 0 <= placement.row < extent_rows:
        raise kvforge.OutOfRangeError(f"{what}.row = {placement.row} is outside [0, {extent_rows})")
    if positions[-1] >= extent_positions:
        raise kvforge.OutOfRangeError(f"count: positions up to {int(positions[-1])} do not fit a row of "
                                      f"{extent_positions} (allowed: begin + count <= {extent_positions})")
    return np.full_like(positions, placement.row), positions


def _layer_bases(d):
    """The byte address of each layer's K element 0: [layers]."""
    return np.asarray([k for k, _ in d["addresses"]], dtype=np.int64)


def _axis_strides(d):
    """Bytes between neighbours along K/V (V's element 0 less K's: one for every layer in a generated
    layout), positions within a page, and heads."""
    deltas = {v - k for k, v in d["addresses"]}
    if len(deltas) != 1:
        raise kvforge.UnsupportedError(f"cache: {d['name']} keeps V at another distance from K in each layer")
    _, s_pos, s_head = d["strides"]
    return {"kv": deltas.pop(), "pos": s_pos * d["element_bytes"], "head": s_head * d["element_bytes"]}


def _cells(sizes, order):
    """Every cell of a grid over `order`'s axes, enumerated with the last axis fastest: {axis: index}."""
    index = np.indices([sizes[axis] for axis in order], dtype=np.int64).reshape(len(order), -1)
    return {axis: index[i] for i, axis in enumerate(order)}


def _source_grid(d, positions):
    """The source's axes over a request, widest stride first, their sizes, and the position of cell (0, 0):
    (page, slot) for a paged cache, one page of `count` slots for a row."""
    strides = _axis_strides(d)
    if d["paged"]:
        page_size = d["page_size"]
        first, last = int(positions[0]) // page_size, int(positions[-1]) // page_size
        grid, start = {"page": last - first + 1, "slot": page_size}, first * page_size
    else:
        grid, start = {"page": 1, "slot": len(positions)}, int(positions[0])
    strides.update(page=d["strides"][0] * d["element_bytes"], slot=strides.pop("pos"))
    order = sorted(("page", "slot", "kv", "head"), key=lambda axis: -abs(strides[axis]))
    return order, grid, start


def _page_cells(order, sizes, start, positions):
    """Every (page, slot, K/V, head) cell in `order`, the last axis fastest, but those outside the request's
    positions; each also with `pos`, its index into the positions."""
    cells = _cells(sizes, order)
    position = start + cells["page"] * sizes["slot"] + cells["slot"]
    keep = (position >= positions[0]) & (position <= positions[-1])
    cells["pos"] = position - positions[0]
    return {axis: index[keep] for axis, index in cells.items()}


def _at(d, place, heads, cells):
    """Byte offsets from a layer's K base of each cell (K/V, index into the request's positions, index into
    `heads`): the view's strides."""
    rows, slots = place
    s_row, s_pos, s_head = d["strides"]
    position = (rows * s_row + slots * s_pos) * d["element_bytes"]
    return cells["kv"] * _axis_strides(d)["kv"] + position[cells["pos"]] + \
        heads[cells["head"]] * s_head * d["element_bytes"]


def _grid_offsets(cells, sizes, order, heads, run):
    """Byte offsets of each cell in a layer of the staging area, dense over `order` (`sizes` of its axes)
    then dim; a cell's head is `heads[cells["head"]]`."""
    stride, strides = run, {}
    for axis in reversed(order):
        strides[axis] = stride
        stride *= sizes[axis]
    return cells["kv"] * strides["kv"] + cells["page"] * strides["page"] + cells["slot"] * strides["slot"] + \
        heads[cells["head"]] * strides["head"]


def _merged(src, dst, run):
    """Consecutive runs of `run` bytes, merged where adjacent on both sides: (src, dst, lengths). The runs
    come in the source's order within a page, so a source page's runs are consecutive."""
    breaks = np.ones(len(src), dtype=bool)
    breaks[1:] = (src[1:] != src[:-1] + run) | (dst[1:] != dst[:-1] + run)
    starts = np.flatnonzero(breaks)
    lengths = np.diff(np.append(starts, len(src))) * run
    return src[starts], dst[starts], lengths
