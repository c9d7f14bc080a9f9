"""Prepared pulls into a cache of another storage dtype, a quantized one among them (docs/transfer.md,
"Over NIXL"): the sender appends the request into a scratch cache of the receiver's own variant, so that
the receiver's kernels quantize it there, on the sender's core, and the receiver READs whole pages
(codes, and the scales its pages hold) straight into its pool.

A receiver qualifies whose pages are each one block of a layer's bytes: its axes start with `page` (after
`layer`), its scales (if any) live in the page, and it updates eagerly. Page j of the request goes from the scratch's
page j to the receiver's pages[j], so the receiver's READs take one descriptor per run of its consecutive
pages, per layer, and copy each byte once, as a raw READ does. The sender must have the receiver's variant
built (its registry, or kvforge.variant); it holds the request in that variant until the last layer is
read.

A quantized source's whole pages go direct into a cache of its own variant whose pages are blocks
(plans.same_pages, direct); its codes under per-tensor scales are _nixl_staged.py's.
"""

import time

import numpy as np
import torch

import kvforge

from . import _nixl_plan as plans
from . import _nixl_wire as wire
from .torch_dtypes import TORCH_DTYPES


def placement(mine, theirs, target, count):
    """(the receiver's page runs of a request, None), or (None, why its pages cannot be read whole)."""
    size = plans.page_bytes(mine)
    if mine["name"] not in theirs.get("built", []):
        return None, f"the sender has no {mine['name']} built to write the request in"
    if size is None:
        return None, (f"{mine['name']} does not keep each page as one block of a layer's bytes (axes that start "
                      f"with page, scales in the page, eager update), so its pages cannot come whole")
    pages = target.pages[:-(-count // mine["page_size"])].astype(np.int64)
    _, run_at, runs = plans._merged(np.arange(len(pages), dtype=np.int64) * size, pages * size, size)
    return {"mode": "pages", "variant": mine["name"], "page_bytes": size, "pages": len(pages),
            "run_at": run_at, "runs": runs.astype(np.int64)}, None


def direct(cache, mine, theirs, peer, source, target, begin, count):
    """The plan of a pull of whole pages from a cache of this variant (plans.same_pages): a descriptor per layer
    per run of pages consecutive on both sides."""
    size, page_size = plans.page_bytes(mine), mine["page_size"]
    if begin % page_size:
        raise kvforge.ArgumentError(f"begin: {begin} is not a multiple of the page size {page_size}; a quantized "
                                    f"source's pages move whole")
    used = slice(begin // page_size, (begin + count - 1) // page_size + 1)
    src, dst, lengths = plans._merged(source.pages[used].astype(np.int64) * size,
                                      target.pages[used].astype(np.int64) * size, size)
    bases = [plans._layer_bases(d) for d in (theirs, mine)]
    request = ((bases[0][:, None] + src[None, :]).reshape(-1), (bases[1][:, None] + dst[None, :]).reshape(-1),
               np.tile(lengths, mine["layers"]))
    return {"cache": cache, "mine": mine, "staging": None, "area": None, "requests": [(peer, request, theirs)],
            "count": count}


def request_head(plan):
    """The scalars of a pages-mode request (kind Q), beside the common ones."""
    place = plan["placement"]
    return {"mode": "pages", "variant": place["variant"], "page_bytes": int(place["page_bytes"]),
            "pages": int(place["pages"]), "blocks": 0, "runs": 0}


class PageServing:
    """The sender's side of a pages-mode pull: a scratch cache of the receiver's variant, written a layer at a
    time from this agent's cache through its gather and the scratch's append."""

    def __init__(self, agent, peer, head, rest):
        self.agent, self.peer, self.id = agent, peer, head["id"]
        self.cache = wire.served_cache(agent, head)
        mine = self.cache.descriptor
        self.tokens, self.heads, self.head_offset = int(head["tokens"]), int(head["heads"]), int(head["head_offset"])
        pages, variant = int(head["pages"]), str(head["variant"])
        arrays = np.frombuffer(rest, dtype=np.int64)
        if len(arrays) != int(head.get("pages_given", 0)):
            raise kvforge.ArgumentError("pages_given: the request's arrays do not match its count")
        self.source_pages = arrays.astype(np.int32) if head.get("pages_given") else None
        self.row = int(head.get("row", 0))
        try:
            theirs = kvforge.describe(variant)
        except kvforge.errors.UnknownVariantError:
            raise kvforge.ArgumentError(f"variant: {variant} is not built at {agent.name!r} (load or build it there, "
                                        f"or pull with prepared=False)") from None
        if not 0 <= self.head_offset <= mine.heads - self.heads or self.heads < 1:
            raise kvforge.ArgumentError(f"heads: [{self.head_offset}, {self.head_offset + self.heads}) is not within "
                                        f"{mine.name}'s {mine.heads} heads")
        facts = {"model": (theirs.shard_of, mine.shard_of), "layers": (theirs.layers, mine.layers),
                 "head_dim": (theirs.head_dim, mine.head_dim), "heads": (theirs.heads, self.heads),
                 "pages": (-(-self.tokens // theirs.page_size) if self.tokens >= 1 else None, pages)}
        for field, (want, have) in facts.items():
            if want != have:
                raise kvforge.ArgumentError(f"{field}: {variant} needs {want!r}, the request has {have!r}")
        self.area = take_scratch(agent, variant, pages)
        scratch = self.area[0]
        self.page_bytes = plans.page_bytes(plans._describe(scratch, 0))  # any rank: pages are alike
        if self.page_bytes != int(head["page_bytes"]):
            give_back(agent, self.area)
            raise kvforge.ArgumentError(f"page_bytes: {variant}'s pages here take {self.page_bytes} bytes, "
                                        f"the receiver's {head['page_bytes']}")
        self.scratch, self.pages = scratch, pages
        # The pool as bytes: a reused scratch's last page still holds a former request's positions past this
        # one's end, which must arrive as zeros, as in a fresh pool.
        self.pool = torch.from_dlpack(scratch.buffers()[0]).view(torch.uint8)
        self.input = TORCH_DTYPES[theirs.input]
        self.slots = torch.arange(self.tokens, dtype=torch.int64)
        self.layers, self.next, self.read, self.last = theirs.layers, 0, set(), time.monotonic()
        try:
            self.step()  # layer 0: every check of the request ran before it
        except Exception:
            give_back(agent, self.area)
            raise

    def write(self, layer):
        mine = self.cache.descriptor
        k, v = gather_buffers(self.agent._gather_buffers, mine, self.tokens)
        if self.source_pages is not None:
            self.cache.gather(layer, k, v, pages=self.source_pages, begin=0, end=self.tokens)
        else:
            self.cache.gather(layer, k, v, row=self.row, begin=0, end=self.tokens)
        heads = slice(self.head_offset, self.head_offset + self.heads)
        base = torch.from_dlpack(self.scratch.view(layer)["k"]).data_ptr()
        if self.tokens < self.pages * self.scratch.descriptor.page_size:
            last = base - self.pool.data_ptr() + (self.pages - 1) * self.page_bytes
            self.pool[last:last + self.page_bytes].zero_()
        self.scratch.append(layer, k[heads].transpose(0, 1).to(self.input), v[heads].transpose(0, 1).to(self.input),
                            slots=self.slots)
        head = {"id": self.id, "layer": layer, "at": base}
        if layer == 0:  # the scratch's registration, which the receiver's copy of this agent's metadata lacks
            head["ring"] = self.agent._nixl.get_partial_agent_metadata(self.area[1], False).hex()
        self.agent._nixl.send_notif(self.peer, wire.encode(b"L", head))

    def step(self):
        """Writes the next layer (one a call, so that the agent's thread polls between them); True if it did."""
        if self.next >= self.layers:
            return False
        self.write(self.next)
        self.next += 1
        return True

    def finished(self):
        return len(self.read) == self.layers

    def release(self, agent):
        """The last layer was read: the scratch goes back to the agent, for the next pull into that variant."""
        give_back(agent, self.area)


def take_scratch(agent, variant, pages):
    """A registered scratch cache of `variant` with at least `pages` pages: a spare one (a cache is slow to
    make: 1.4-3.3 s for 2 GiB here), or a new one. An agent keeps one spare per variant, the largest."""
    fits = [i for i, (cache, _) in enumerate(agent._scratch)
            if cache.descriptor.name == variant and cache.config["pages"] >= pages]
    if fits:
        return agent._scratch.pop(min(fits, key=lambda i: agent._scratch[i][0].config["pages"]))
    cache = kvforge.create(variant, pages=pages)
    return cache, agent._nixl.register_memory([torch.from_dlpack(b) for b in cache.buffers()])


def gather_buffers(kept, d, tokens):
    """K and V [heads, tokens, head_dim] of `d`'s input dtype that a layer is gathered into: views of buffers
    kept in `kept` (an agent's dict, one per thread that gathers), the largest asked for, whose pages were
    faulted in once (a fresh 128 MiB a layer took 60-180 ms here, twice the gather and the quantizing append
    together)."""
    key = (d.input, d.heads, d.head_dim)
    held = kept.get(key)
    if held is None or held[0].shape[1] < tokens:
        held = tuple(torch.zeros(d.heads, tokens, d.head_dim, dtype=TORCH_DTYPES[d.input]) for _ in range(2))
        kept[key] = held
    return held[0][:, :tokens], held[1][:, :tokens]


def give_back(agent, area):
    """Keeps `area` as its variant's spare scratch, or the larger of it and the one kept already."""
    name = area[0].descriptor.name
    same = [a for a in agent._scratch if a[0].descriptor.name == name] + [area]
    keep = max(same, key=lambda a: a[0].config["pages"])
    for a in same:
        if a is not keep:
            agent._nixl.deregister_memory(a[1])
    agent._scratch = [a for a in agent._scratch if a[0].descriptor.name != name] + [keep]
