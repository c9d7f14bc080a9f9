"""KV transfers over NIXL: a decode process pulls a request's KV from a prefill process, one-sided,
straight into its own layout (docs/transfer.md, "Over NIXL").

    agent = kvforge.nixl.Agent("decode-0")
    agent.register("kv", cache)                       # the cache's own buffers, no copy
    peer = agent.connect(prefill_metadata)            # the bytes of the other side's Agent.metadata()
    agent.pull([(peer, "kv")], "kv", count=20,        # positions 0..19 of the request
               source=kvforge.nixl.Placement(pages=[3, 7]), target=kvforge.nixl.Placement(pages=[0, 1]))

Each side publishes, per registered cache, what kvforge knows of it: the variant (layout, model, dtypes,
heads, head_dim), its tensor-parallel rank, and where each layer's K and V lie: the base addresses and the
strides of the cache's own views (Cache.view), so the addresses are the runtime's one formula. The
receiver builds NIXL descriptors from both placements, a run of head_dim values per (layer, K or V,
position, head), merges runs adjacent on both sides, and READs them:
  - direct, into its own pool, where the bytes map one to one (the same storage dtype, unquantized);
  - through a staging area otherwise (another float dtype, or a quantizing receiver): the source's values
    arrive in a dense [positions, heads, head_dim] buffer and the cache's own append converts them.
A quantized source is refused: its codes and scales would need the source's scale layout.

Every check runs before anything is read: a pair of caches that disagree is refused naming the field.
"""

import json
import logging
import os
import struct
import time

import numpy as np
import torch

import kvforge

from ._nixl_plan import (Placement,  # noqa: F401  (kvforge.nixl.Placement)
                         _at, _check_pair, _grid_offsets, _layer_bases, _merged, _page_cells, _places,
                         _source_grid)
from .torch_dtypes import TORCH_DTYPES

_MAGIC = b"KVFN"
_VERSION = 1


# Where the machine has no InfiniBand device, UCX's IB module is left out: nixl-cu13 1.5.1 bundles a
# libnl-route whose destructor crashes the process at exit (SIGSEGV in rtnl_tc_unregister) once that module
# loaded it. UCX reads this when NIXL's library loads, so import kvforge.nixl before nixl itself. A
# caller's own UCX_MODULES wins.
if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
    os.environ.setdefault("UCX_MODULES", "^ib")


class PullTimeout(kvforge.Error, TimeoutError):
    """A pull did not complete in time. It was abandoned: its NIXL requests were cancelled and released
    (or are released by a later call where NIXL could not yet), and the target positions hold undefined
    bytes, as before any write. Nothing else changed; the same request can be pulled again."""


def _import_nixl():
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError:
            raise kvforge.BackendError("nixl: the NIXL Python package is not installed (pip install nixl-cu13; "
                                       "tools/setup installs the pinned version)") from None
    # NIXL logs each agent's creation at INFO, on stdout: a caller's output stays its own.
    logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config


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
    return {"name": d.name, "model": d.shard_of, "layers": d.layers, "heads": d.heads, "model_heads": d.model_heads,
            "head_dim": d.head_dim, "storage": d.storage, "input": d.input, "quant": d.quant, "paged": d.paged,
            "page_size": d.page_size, "extent": [k.shape[0], k.shape[1]], "element_bytes": k.element_size(),
            "tp": d.tensor_parallel, "rank": rank, "heads_of_rank": list(d.shard_heads(rank)),
            "device": "VRAM" if k.device.type == "cuda" else "DRAM", "device_id": max(k.get_device(), 0),
            "strides": strides, "addresses": layers, "buffers": buffers}


class Agent:
    """A NIXL agent over kvforge caches. name: unique among the agents that connect; backends: NIXL's."""

    def __init__(self, name, backends=("UCX",)):
        nixl_agent, nixl_agent_config = _import_nixl()
        self.name = name
        self._nixl = nixl_agent(name, nixl_agent_config(backends=list(backends)))
        self._caches = {}  # key -> (cache, description)
        self._peers = {}  # agent name -> {key: description}
        self._abandoned = []  # (NIXL requests, staging area, registration) of pulls a timeout abandoned
        self._parked = []  # abandoned pulls' staging areas (and registrations), kept until close()
        self._spare = []  # (byte buffer, registration): staging areas that pulls reuse, each in one at a time

    def close(self):
        """Deregisters every cache, forgets every peer and ends the NIXL agent. Call it (or use the agent as
        a context manager) before the caches go: NIXL must not outlive memory registered with it."""
        if self._nixl is None:
            return
        self._release_abandoned()
        if not (self._abandoned or self._parked):  # else a cancelled READ may still use a registration
            for _, _, registered in self._caches.values():
                self._nixl.deregister_memory(registered)
            for _, registered in self._spare:
                self._nixl.deregister_memory(registered)
        for peer in self._peers:
            self._nixl.remove_remote_agent(peer)
        # Ending the agent ends UCX's work on the parked staging areas; only then may their memory go.
        self._caches, self._peers, self._nixl = {}, {}, None
        self._abandoned, self._parked, self._spare = [], [], []

    @property
    def staging_bytes(self):
        """Bytes of the staging areas this agent keeps for reuse (registered with NIXL, touched once)."""
        return sum(buffer.numel() for buffer, _ in self._spare)

    def _take_staging(self, size, device):
        """A registered staging area of at least `size` bytes: the smallest spare one, or a new one."""
        fits = [i for i, (buffer, _) in enumerate(self._spare) if buffer.numel() >= size and buffer.device == device]
        if fits:
            return self._spare.pop(min(fits, key=lambda i: self._spare[i][0].numel()))
        buffer = torch.zeros(size, dtype=torch.uint8, device=device)  # its pages faulted in here, not under a READ
        return buffer, self._nixl.register_memory([buffer])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- registration and metadata -----------------------------------------------------------------

    def register(self, key, cache, rank=0):
        """Registers `cache`'s buffers with NIXL under `key`; rank: its tensor-parallel rank (a shard's)."""
        if key in self._caches:
            raise kvforge.ArgumentError(f"key: {key!r} is registered already")
        description = _describe(cache, rank)
        buffers = [torch.from_dlpack(b) for b in cache.buffers()]
        registered = self._nixl.register_memory(buffers)
        self._caches[key] = (cache, description, registered)

    def metadata(self):
        """Bytes for the other side's connect(): NIXL's agent metadata and every registered cache's facts."""
        facts = json.dumps({"version": _VERSION, "agent": self.name,
                            "caches": {k: c[1] for k, c in self._caches.items()}}).encode()
        return _MAGIC + struct.pack("<II", _VERSION, len(facts)) + facts + self._nixl.get_agent_metadata()

    def connect(self, metadata):
        """Adds the agent whose metadata() these bytes are; returns its name."""
        if not isinstance(metadata, (bytes, bytearray)) or metadata[:4] != _MAGIC or len(metadata) < 12:
            raise kvforge.ArgumentError("metadata: not the bytes of a kvforge.nixl Agent.metadata()")
        version, size = struct.unpack_from("<II", metadata, 4)
        if version != _VERSION:
            raise kvforge.ArgumentError(f"metadata: version {version}, this kvforge reads {_VERSION}")
        try:
            facts = json.loads(bytes(metadata[12:12 + size]))
            agent, caches = facts["agent"], facts["caches"]
        except (ValueError, KeyError, TypeError):
            raise kvforge.ArgumentError("metadata: its header is not a kvforge.nixl Agent.metadata()'s") from None
        if agent == self.name:
            raise kvforge.ArgumentError(f"metadata: {agent!r} is this agent's own name")
        try:
            name = self._nixl.add_remote_agent(bytes(metadata[12 + size:]))
        except Exception as e:  # noqa: BLE001  (NIXL's own error, about bytes the caller passed)
            raise kvforge.ArgumentError(f"metadata: NIXL refused the agent metadata of {agent!r}: {e}") from None
        name = name.decode() if isinstance(name, bytes) else name
        if name != agent:
            self._nixl.remove_remote_agent(name)
            raise kvforge.ArgumentError(f"metadata: the header names {agent!r}, NIXL's part {name!r}")
        self._peers[name] = caches
        return name

    def notifications(self):
        """{agent name: [message bytes]}: the notify= messages of pulls that completed from this agent."""
        return self._nixl.get_new_notifs()

    # -- pulls ---------------------------------------------------------------------------------------

    def pull(self, sources, key, count, source, target, begin=0, timeout=30.0, notify=b""):
        """Pulls positions [begin, begin + count) of one request into the cache registered as `key`.

        sources: [(agent name, key)] for each rank of the sending tensor-parallel group, in rank order.
        source, target: Placements of the request in the sending caches (the same on every rank) and here.
        timeout: seconds; then PullTimeout. notify: bytes each sender gets in notifications() when done.
        Returns a dict: how (direct or staged), descriptors and bytes read.
        """
        return self.start_pull(sources, key, count, source, target, begin, notify).wait(timeout)

    def start_pull(self, sources, key, count, source, target, begin=0, notify=b""):
        """As pull(), but returns a Pull at once; several may be in flight. Pull.wait(timeout) ends it."""
        self._release_abandoned()
        plan = self._plan(sources, key, count, source, target, begin)
        return Pull(self, plan, notify)

    def abandoned(self):
        """How many abandoned pulls still have READs in flight that NIXL could not cancel. Their target
        positions (and staging areas) may still be written until then; each call of this agent retries."""
        self._release_abandoned()
        return len(self._abandoned)

    def _release_abandoned(self):
        kept = []
        for handles, staging, registered in self._abandoned:
            left = []
            for handle in handles:
                try:
                    handle.release()
                except Exception:  # still in flight: NIXL could not cancel it yet
                    left.append(handle)
            if left:
                kept.append((left, staging, registered))
            elif staging is not None:
                # A released READ may still be under way inside UCX, and deregistering memory under it
                # crashes the process: the area stays registered and alive until close().
                self._parked.append((staging, registered))
        self._abandoned = kept

    def _plan(self, sources, key, count, source, target, begin):
        if key not in self._caches:
            raise kvforge.ArgumentError(f"key: {key!r} is not registered here (registered: {sorted(self._caches)})")
        cache, mine, _ = self._caches[key]
        if not sources:
            raise kvforge.ArgumentError("sources: give (agent name, key) for each rank of the sending group")
        theirs = []
        for rank, pair in enumerate(sources):
            agent, their_key = pair
            if agent not in self._peers:
                raise kvforge.ArgumentError(f"sources[{rank}]: agent {agent!r} is not connected (connected: "
                                            f"{sorted(self._peers)})")
            if their_key not in self._peers[agent]:
                raise kvforge.ArgumentError(f"sources[{rank}]: agent {agent!r} registered no cache {their_key!r}")
            theirs.append(self._peers[agent][their_key])
        _check_pair(mine, theirs)
        if count <= 0:
            raise kvforge.OutOfRangeError(f"count: {count} is below 1 (allowed: >= 1)")
        if begin < 0:
            raise kvforge.OutOfRangeError(f"begin: {begin} is below 0 (allowed: >= 0)")
        positions = np.arange(begin, begin + count, dtype=np.int64)
        src_place = _places("source", theirs[0], source, positions)
        dst_place = _places("target", mine, target, positions)
        # Runs are enumerated in the source's own order: its (page, slot, K/V, head) axes from the widest
        # stride in, so that its adjacent runs come one after another and merge without sorting. The
        # staging area is dense over the same axes: a source page lands whole.
        first = theirs[0]
        order, grid, start = _source_grid(first, positions)
        element_bytes = first["element_bytes"]
        sizes = dict(grid, kv=2, head=mine["heads"])
        shape = (mine["layers"],) + tuple(sizes[axis] for axis in order) + (mine["head_dim"],)
        layer_bytes = int(np.prod(shape[1:])) * element_bytes
        may_go_direct = mine["storage"] == first["storage"] and mine["quant"] == "none"
        pieces = kvforge.shard_pieces(mine["model_heads"], len(theirs), mine["tp"])
        direct, staged = [], []
        for sender, receiver, head_begin, head_end in pieces:
            if receiver != mine["rank"]:
                continue
            d, peer = theirs[sender], sources[sender][0]
            heads = np.arange(head_begin, head_end, dtype=np.int64)
            theirs_heads, local = heads - d["heads_of_rank"][0], heads - mine["heads_of_rank"][0]
            run = d["head_dim"] * d["element_bytes"]
            cells = _page_cells(order, dict(grid, kv=2, head=len(heads)), start, positions)
            src = _at(d, src_place, theirs_heads, cells)
            staged.append((peer, _layer_bases(d), np.arange(mine["layers"], dtype=np.int64) * layer_bytes,
                           _merged(src, _grid_offsets(cells, sizes, order, local, mine["head_dim"] * element_bytes),
                                   run), d))
            if may_go_direct:
                direct.append((peer, _layer_bases(d), _layer_bases(mine),
                               _merged(src, _at(mine, dst_place, local, cells), run), d))
        # Straight into the pool unless that takes many more descriptors than the staging area does
        # (NHD pages into HND ones: a run per position and head, against one per page).
        runs = lambda pieces: sum(len(p[3][2]) for p in pieces)  # noqa: E731
        staging, area = None, None
        if may_go_direct and runs(direct) <= 2 * runs(staged):
            chosen = direct
        else:
            area = self._take_staging(int(np.prod(shape)) * element_bytes,
                                      torch.device("cuda" if mine["device"] == "VRAM" else "cpu"))
            staging = area[0][:int(np.prod(shape)) * element_bytes].view(TORCH_DTYPES[first["storage"]]).view(shape)
            # Each layer as [K/V, page, slot, head, dim]; _finish makes positions of (page, slot).
            staging = staging.permute(0, *(1 + order.index(axis) for axis in ("kv", "page", "slot", "head")), 5)
            chosen = [(peer, src_bases, dst_bases + area[0].data_ptr(), runs_, d)
                      for peer, src_bases, dst_bases, runs_, d in staged]
        requests = []
        for peer, src_bases, dst_bases, (src, dst, lengths), d in chosen:
            requests.append((peer, ((src_bases[:, None] + src[None, :]).reshape(-1),
                                    (dst_bases[:, None] + dst[None, :]).reshape(-1), np.tile(lengths, mine["layers"])),
                             d))
        return {"cache": cache, "mine": mine, "staging": staging, "area": area, "requests": requests,
                "dst_place": dst_place, "first_position": int(positions[0]) - start, "count": count}


class Pull:
    """A pull in flight (Agent.start_pull). wait(timeout) completes it or abandons it."""

    def __init__(self, agent, plan, notify):
        self._agent, self._plan, self._handles = agent, plan, []
        nixl, mine = agent._nixl, plan["mine"]
        self.report = {"how": "staged" if plan["staging"] is not None else "direct", "descriptors": 0, "bytes": 0}
        for peer, (src, dst, lengths), theirs in plan["requests"]:
            local = np.stack([dst, lengths, np.full_like(dst, mine["device_id"])], axis=1).astype(np.uint64)
            remote = np.stack([src, lengths, np.full_like(src, theirs["device_id"])], axis=1).astype(np.uint64)
            handle = nixl.initialize_xfer("READ", nixl.get_xfer_descs(local, mine["device"]),
                                          nixl.get_xfer_descs(remote, theirs["device"]), peer, notify)
            self._handles.append(handle)
            self.report["descriptors"] += len(lengths)
            self.report["bytes"] += int(lengths.sum())
        for handle in self._handles:
            if nixl.transfer(handle) == "ERR":
                self._abandon()
                raise kvforge.BackendError(f"nixl: posting a READ from {peer} failed")
        self._finished = False

    def done(self):
        """True once every READ completed (then wait() returns at once). Raises BackendError on a failed READ."""
        if self._finished:
            return True
        states = [self._agent._nixl.check_xfer_state(h) for h in self._handles]
        if "ERR" in states:
            self._abandon()
            raise kvforge.BackendError("nixl: a READ of this pull failed; the target positions hold undefined bytes")
        return all(s == "DONE" for s in states)

    def wait(self, timeout=30.0):
        """Blocks until done; after `timeout` seconds abandons the pull and raises PullTimeout."""
        deadline = time.monotonic() + timeout
        while not self.done():
            if time.monotonic() >= deadline:
                self._abandon()
                raise PullTimeout(f"timeout: the pull did not complete in {timeout} s; it was abandoned")
            time.sleep(0)
        if not self._finished:
            self._finish()
        return self.report

    def _finish(self):
        plan = self._plan
        for handle in self._handles:
            handle.release()
        self._handles = []
        staging = plan["staging"]
        if staging is not None:
            cache, mine = plan["cache"], plan["mine"]
            rows, slots = plan["dst_place"]
            into = TORCH_DTYPES[mine["input"]]
            at, count = plan["first_position"], plan["count"]
            for layer in range(mine["layers"]):
                kv = staging[layer]  # [K/V, page, slot, head, dim]: a view of the pages as they came, or
                # (heads outside slots in the source's pages) a copy with positions outside heads
                kv = kv.reshape(2, kv.shape[1] * kv.shape[2], kv.shape[3], kv.shape[4])[:, at:at + count]
                k, v = kv[0].to(into), kv[1].to(into)  # [positions, heads, dim]
                if mine["paged"]:
                    cache.append(layer, k, v, slots=torch.from_numpy(rows * mine["page_size"] + slots))
                else:
                    cache.append(layer, k, v, rows=torch.from_numpy(rows.astype(np.int32)),
                                 positions=torch.from_numpy(slots.astype(np.int32)))
            if cache.descriptor.lazy:
                cache.commit()
            self._agent._spare.append(plan["area"])
        self._finished = True

    def _abandon(self):
        """Cancels and releases this pull's READs. One that NIXL cannot cancel yet keeps the staging area
        alive and registered, parked with the agent, until a later call releases it."""
        area = self._plan["area"] or (None, None)
        self._agent._abandoned.append((self._handles, area[0], area[1]))
        self._handles = []
        self._agent._release_abandoned()
        self._finished = True
