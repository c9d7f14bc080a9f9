"""The staged way of a kvforge.nixl pull, and codes under per-tensor scales (docs/transfer.md, "Over NIXL").

A staged pull READs the source's values into a staging area dense over the source's axes; the receiver's own
append then writes them in its layout and dtype. Codes under static per-tensor scales go direct into any
layout of that storage dtype whose scales equal the sender's, which the receiver READs first
(read_tensor_scales, same_codes). Other int8 and fp8 codes under per-tensor scales (another scale, another
storage dtype, a float receiver) are decoded with the sender's scales before that append, which quantizes
them under the receiver's own scales: by the sender's own kernels, where one sender's paged, eager cache
sends from position 0 and its variant is built here (scratch_plan: the codes go direct into a scratch cache
of that variant under the sender's scales, whose gather decodes them), else in torch from a staging area
(decode_codes), about 8x slower (bench/RESULTS.md §14d).
"""

import time

import numpy as np
import torch

import kvforge

from . import _nixl_pages as page_pulls
from . import _nixl_plan as plans
from .torch_dtypes import TORCH_DTYPES


def read_tensor_scales(agent, d, peer, timeout=10.0):
    """The sender's per-tensor scales, fp32 [layers, K/V], by one READ of 8 bytes a layer."""
    size = 8 * d["layers"]
    area = agent._take_staging(size, torch.device("cpu"))
    try:
        nixl = agent._nixl
        local = nixl.get_xfer_descs(np.array([[area[0].data_ptr(), size, 0]], dtype=np.uint64), "DRAM")
        remote = nixl.get_xfer_descs(np.array([[d["tensor_scales"], size, d["device_id"]]], dtype=np.uint64),
                                     d["device"])
        with agent._lock:
            handle = nixl.initialize_xfer("READ", local, remote, peer)
            state = nixl.transfer(handle)
        deadline = time.monotonic() + timeout
        while state == "PROC" and time.monotonic() < deadline:
            with agent._lock:
                state = nixl.check_xfer_state(handle)
        if state != "DONE":  # a READ NIXL could not finish may still write into the area: it is parked
            agent._abandoned.append(([handle], area[0], area[1]))
            agent._release_abandoned()
            area = None
            raise kvforge.BackendError(f"nixl: reading {peer}'s scales ended {state}; nothing was read into the pool")
        handle.release()
        return area[0][:size].view(torch.float32).view(-1, 2).clone()
    finally:
        if area is not None:
            agent._spare.append(area)


def same_codes(cache, mine, d, theirs_scales):
    """Whether a sender's codes mean in this cache what they mean in the sender's: the same storage dtype
    under static per-tensor scales, each equal to this cache's. Codes under another scale are other
    values, so they are decoded on arrival instead (decode_codes)."""
    if not (mine["quant"] == d["quant"] == "per_tensor" and mine["storage"] == d["storage"] and
            None not in (mine["tensor_scales"], d["tensor_scales"])):
        return False
    for layer in range(mine["layers"]):
        view = cache.view(layer)
        for kv, side in enumerate("kv"):
            scale = torch.from_dlpack(view[f"{side}_scales"])
            if float(scale[(0,) * scale.dim()]) != float(theirs_scales[layer, kv]):
                return False
    return True


def decode_codes(kv, layer, decode):
    """[K/V, positions, heads, dim] codes as they came, to fp32 values: each sender's heads [h0, h1) times
    its scales of `layer` (decode: [(h0, h1, fp32 [layers, K/V])]), as the sender's own gather decodes."""
    values = kv.to(torch.float32)
    for h0, h1, scales in decode:
        values[:, :, h0:h1] *= scales[layer].view(2, 1, 1, 1)
    return values


def write_staged(plan):
    """Writes a completed staged pull from its staging area into the cache, a layer at a time, through the
    cache's own append (and commit, for a lazy variant)."""
    cache, mine, staging = plan["cache"], plan["mine"], plan["staging"]
    into = TORCH_DTYPES[mine["input"]]
    at, count = plan["first_position"], plan["count"]
    for layer in range(mine["layers"]):
        kv = staging[layer]  # [K/V, page, slot, head, dim]: a view of the pages as they came, or
        # (heads outside slots in the source's pages) a copy with positions outside heads
        kv = kv.reshape(2, kv.shape[1] * kv.shape[2], kv.shape[3], kv.shape[4])[:, at:at + count]
        if plan["decode"] is not None:
            kv = decode_codes(kv, layer, plan["decode"])
        append_at(cache, mine, layer, kv[0].to(into), kv[1].to(into), plan["dst_place"])  # [positions, heads, dim]
    if cache.descriptor.lazy:
        cache.commit()


def append_at(cache, mine, layer, k, v, place):
    """Appends one layer's k, v [positions, heads, dim] where `place` (_places' rows and slots) puts them."""
    rows, slots = place
    if mine["paged"]:
        cache.append(layer, k, v, slots=torch.from_numpy(rows * mine["page_size"] + slots))
    else:
        cache.append(layer, k, v, rows=torch.from_numpy(rows.astype(np.int32)),
                     positions=torch.from_numpy(slots.astype(np.int32)))


def scratch_plan(agent, cache, mine, theirs, scales, sources, source, target, begin, count):
    """The plan of a pull whose codes go direct into a scratch cache of the sender's own variant, under the
    sender's scales, to be gathered from there (decoded by the variant's kernels) and appended here; None
    where it cannot go that way (several senders, begin > 0, a lazy or contiguous sender, or its variant
    not built here)."""
    d = theirs[0]
    if len(theirs) != 1 or begin or d["lazy"] or not d["paged"]:
        return None
    pages = -(-count // d["page_size"])
    try:
        area = page_pulls.take_scratch(agent, d["name"], pages)
    except kvforge.errors.UnknownVariantError:
        return None
    scratch = area[0]
    for layer in range(d["layers"]):
        scratch.set_tensor_scale(layer, float(scales[0][layer, 0]), float(scales[0][layer, 1]))
    into = plans.Placement(pages=np.arange(pages))
    described = plans._describe(scratch, d["rank"])
    if not same_codes(scratch, described, d, scales[0]):  # its codes go direct, never through here again
        page_pulls.give_back(agent, area)
        return None
    try:
        plan = agent._plan_into(scratch, described, sources, count, source, into, 0, False)
    except Exception:
        page_pulls.give_back(agent, area)
        raise
    plan.update(how="scratch", area=area, then={"cache": cache, "mine": mine, "into": into,
                                                "dst_place": plans._places("target", mine, target, np.arange(count))})
    return plan


def write_decoded(agent, plan):
    """Gathers a completed scratch_plan pull from the scratch, a layer at a time (the sender's variant decoding
    its codes), appends it into the cache, and keeps the scratch for the next pull."""
    then, scratch = plan["then"], plan["area"][0]
    cache, mine, count = then["cache"], then["mine"], plan["count"]
    d = scratch.descriptor
    k, v = page_pulls.gather_buffers(agent._decode_buffers, d, count)
    into = TORCH_DTYPES[mine["input"]]
    pages = torch.from_numpy(then["into"].pages.astype(np.int32))
    for layer in range(d.layers):
        scratch.gather(layer, k, v, pages=pages, begin=0, end=count)  # [heads, positions, head_dim]
        append_at(cache, mine, layer, k.transpose(0, 1).to(into), v.transpose(0, 1).to(into), then["dst_place"])
    if cache.descriptor.lazy:
        cache.commit()
    with agent._lock:
        page_pulls.give_back(agent, plan["area"])
