"""KV transfers over NIXL: a decode process pulls a request's KV from a prefill process, one-sided,
straight into its own layout (docs/transfer.md, "Over NIXL").

    # the prefill side: its cache and the SequenceManager that allocates its pages
    agent.register("kv", cache, manager=manager)      # the cache's own buffers, no copy
    published = agent.placement("kv", pages=manager.pages(seq))  # the pages and their generations now

    # the decode side
    agent = kvforge.nixl.Agent("decode-0")
    agent.register("kv", cache)
    peer = agent.connect(prefill_metadata)            # the bytes of the other side's Agent.metadata()
    agent.pull([(peer, "kv")], "kv", count=20,        # positions 0..19 of the request
               source=published, target=kvforge.nixl.Placement(pages=[0, 1]))

A pull checks its source's page generations after its data READs (_nixl_generations.py): a page the
sender's manager freed or reused since the placement was published fails the pull with StateError, where
it would have handed over another request's K/V. A source Placement without generations is refused unless
the pull passes unchecked=True (unsafe: nothing then tells a stale page table from a live one).

Each side publishes, per registered cache, what kvforge knows of it: the variant (layout, model, dtypes,
heads, head_dim), its tensor-parallel rank, and where each layer's K and V lie: the base addresses and the
strides of the cache's own views (Cache.view), so the addresses are the runtime's one formula. The
receiver builds NIXL descriptors from both placements, a run of head_dim values per (layer, K or V,
position, head), merges runs adjacent on both sides, and READs them:
  - direct, into its own pool, where the bytes map one to one (the same storage dtype, unquantized);
  - prepared, where the sender serves: it writes the receiver's page order (_nixl_prepared.py), or for
    another dtype its pages through a scratch cache of the receiver's variant (_nixl_pages.py);
  - through a staging area otherwise (another float dtype, or a quantizing receiver): the source's values
    arrive in a dense [positions, heads, head_dim] buffer and the cache's own append converts them.
A quantized source goes direct into a cache whose codes mean the same (_nixl_pages.py: its own variant's
whole pages, or codes under equal per-tensor scales). Other int8 and fp8 codes under per-tensor scales are
staged, decoded with the sender's scales and appended; other quantized sources are refused.

Every check runs before anything is read: a pair of caches that disagree is refused naming the field.
"""

import json
import logging
import os
import struct
import threading
import time
import weakref

import numpy as np
import torch

import kvforge

from . import _nixl_generations as generations
from . import _nixl_pages as page_pulls
from . import _nixl_plan as plans
from . import _nixl_prepared as prepared
from . import _nixl_staged as staged_pulls
from . import _nixl_states as states
from . import _nixl_wire as wire
from ._nixl_plan import (Placement,  # noqa: F401  (kvforge.nixl.Placement)
                         placement_units, _at, _check_pair, _describe, _grid_offsets, _layer_bases, _merged, _page_cells, _places,
                         _same_geometry, _source_grid)
from ._nixl_pull import Pull
from ._nixl_wait import PullTimeout  # noqa: F401  (kvforge.nixl.PullTimeout)
from .torch_dtypes import CODE_DTYPES, TORCH_DTYPES

_MAGIC = b"KVFN"
_VERSION = 1


# Where the machine has no InfiniBand device, UCX's IB module is left out: nixl-cu13 1.5.1 bundles a
# libnl-route whose destructor crashes the process at exit (SIGSEGV in rtnl_tc_unregister) once that module
# loaded it. UCX reads this when NIXL's library loads, so import kvforge.nixl before nixl itself. A
# caller's own UCX_MODULES wins.
if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
    os.environ.setdefault("UCX_MODULES", "^ib")


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


class Agent:
    """A NIXL agent over kvforge caches. name: unique among the agents that connect; backends: NIXL's.

    serve: this agent also serves prepared pulls of its caches (a prefill side): a thread of its own writes
    each asked-for request in the receiver's page order, a few layers ahead of the receiver's READs, so
    that a pull between layouts whose bytes do not map one to one still reads each byte once
    (docs/transfer.md, "Over NIXL").

    Every agent has a thread of its own that polls NIXL (which is what lets others read from it) every
    millisecond while idle, and without pause while it serves a pull. progress_thread: NIXL's own
    progress thread as well, which polls without pause and so takes a whole core; kvforge's agents need
    none.
    """

    def __init__(self, name, backends=("UCX",), serve=False, progress_thread=False):
        nixl_agent, nixl_agent_config = _import_nixl()
        self.name = name
        self._nixl = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends)))
        self._lock = threading.RLock()  # NIXL calls and the state below, shared with the serving thread
        self._serves = bool(serve)
        self._serving = {}  # request id -> prepared.Serving (the sender's side)
        self._answering = set()  # agents whose metadata came with a request, so that answers can reach them
        self._prepared_inbox = {}  # request id -> [(kind, head)] (the receiver's side)
        self._cancelled = set()  # ids of prepared pulls this agent abandoned
        self._user_notifs = {}  # agent name -> [bytes]: notify= messages, for notifications()
        self.thread_error = None  # the last failure the polling thread survived, for diagnosis
        self._pulls = 0  # prepared pulls started; with _run, their ids, unique across restarts too
        self._run = os.urandom(4).hex()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._progress_loop, daemon=True, name=f"kvforge.nixl {name}")
        self._thread.start()
        # An agent left open stops polling at exit, before NIXL's objects go (which would abort the process).
        weakref.finalize(self, _stop_polling, self._stop, self._thread)
        self._caches = {}  # key -> (cache, description)
        self._generations = {}  # key -> _nixl_generations.Generations: what placement() publishes
        self._states = {}  # key -> (StatePool, description, registration): hybrid models' states
        self._peer_states = {}  # agent name -> {key: description}
        self._peers = {}  # agent name -> {key: description}
        self._abandoned = []  # (NIXL requests, staging area, registration) of pulls a timeout abandoned
        self._parked = []  # abandoned pulls' staging areas (and registrations), kept until close()
        self._spare = []  # (byte buffer, registration): staging areas that pulls reuse, each in one at a time
        self._scratch = []  # (cache, registration): a serving agent's spare scratch caches (_nixl_pages.py)
        # (dtype, heads, head_dim) -> K and V gather buffers (_nixl_pages.gather_buffers): the serving thread's,
        # for scratch writes, and the caller's, for codes decoded in a scratch of the sender's variant.
        self._gather_buffers, self._decode_buffers = {}, {}

    def close(self):
        """Deregisters every cache, forgets every peer and ends the NIXL agent. Call it (or use the agent as
        a context manager) before the caches go: NIXL must not outlive memory registered with it."""
        if self._nixl is None:
            return
        self._stop.set()
        self._thread.join()
        for serving in self._serving.values():  # a READ of its ring may still be under way
            self._parked.append(serving.area)
        self._serving = {}
        self._release_abandoned()
        if not (self._abandoned or self._parked):  # else a cancelled READ may still use a registration
            for registered in [c[2] for c in self._caches.values()] + [s[2] for s in self._states.values()] + \
                    [g.registered for g in self._generations.values()]:
                self._nixl.deregister_memory(registered)
            for _, registered in self._spare + self._scratch:
                self._nixl.deregister_memory(registered)
        for peer in self._peers:
            self._nixl.remove_remote_agent(peer)
        # Ending the agent ends UCX's work on the parked staging areas; only then may their memory go.
        self._caches, self._states, self._peers, self._nixl = {}, {}, {}, None
        self._abandoned, self._parked, self._spare, self._scratch = [], [], [], []

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

    def register(self, key, cache, rank=0, manager=None):
        """Registers `cache`'s buffers with NIXL under `key`; rank: its tensor-parallel rank (a shard's).

        manager: the kvforge.SequenceManager that allocates a paged cache's pages. Its page generations,
        which its frees and reuses advance, are what placement() publishes and a pull checks. Without one
        the agent keeps generations of its own, which only retire() advances."""
        if key in self._caches:
            raise kvforge.ArgumentError(f"key: {key!r} is registered already")
        description = _describe(cache, rank)
        managed = None if manager is None else torch.from_dlpack(manager.page_generations)
        if managed is not None and (not cache.descriptor.paged or len(managed) != description["extent"][0]):
            raise kvforge.ArgumentError(f"manager: a SequenceManager of this paged cache's {description['extent'][0]} "
                                        f"pages (got one of {len(managed)} over a {cache.descriptor.addressing} cache)")
        buffers = [torch.from_dlpack(b) for b in cache.buffers()]
        registered = self._nixl.register_memory(buffers)
        self._generations[key] = generations.Generations(
            self._nixl, description["extent"][0], managed)
        description["generations"] = self._generations[key].describe()
        self._caches[key] = (cache, description, registered)

    def placement(self, key, pages=None, row=None):
        """A request's Placement in the cache registered as `key`, with its pages' generations now: publish
        this one, and a pull of it is refused should any of its pages be retired before it completes."""
        if key not in self._generations:
            raise kvforge.ArgumentError(f"key: {key!r} is not registered here (registered: {sorted(self._caches)})")
        with self._lock:
            units = self._generations[key].units("placement", pages, row)
            return Placement(pages=pages, row=row, generations=self._generations[key].now(units))

    def retire(self, key, pages=None, row=None):
        """Says that a published request's pages (or row) of the cache `key` are freed: call it before
        anything else is written there. A pull of an earlier placement() of them is then refused."""
        if key not in self._generations:
            raise kvforge.ArgumentError(f"key: {key!r} is not registered here (registered: {sorted(self._caches)})")
        with self._lock:
            self._generations[key].retire(self._generations[key].units("retire", pages, row))

    def register_states(self, key, pool, descriptor=None, rank=0):
        """Registers a StatePool's memory under `key`, as it is; its variant and TP rank let pulls span groups."""
        with self._lock:
            states.register(self, key, pool, descriptor, rank)

    def pull_state(self, source, key, src_slot, dst_slot, timeout=30.0):
        """Pulls slot src_slot of the state pool source = (agent name, key), or of a TP group's pools listed in
        rank order (each gives this rank its share, kvforge.state_rows), into slot dst_slot of pool `key`, one
        READ a source, after the records are checked. Returns {bytes, descriptors, reads}."""
        return states.pull(self, source, key, src_slot, dst_slot, timeout)

    def metadata(self):
        """Bytes for the other side's connect(): NIXL's agent metadata and every registered cache's facts."""
        # A serving agent also says which variants it has built: it can write a request in those (pages mode).
        built = sorted(d.name for d in kvforge.variants()) if self._serves else []
        facts = json.dumps({"version": _VERSION, "agent": self.name, "serves": self._serves, "built": built,
                            "caches": {k: c[1] for k, c in self._caches.items()},
                            "states": {k: s[1] for k, s in self._states.items()}}).encode()
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
            agent, caches, serves = facts["agent"], facts["caches"], bool(facts.get("serves"))
        except (ValueError, KeyError, TypeError):
            raise kvforge.ArgumentError("metadata: its header is not a kvforge.nixl Agent.metadata()'s") from None
        if agent == self.name:
            raise kvforge.ArgumentError(f"metadata: {agent!r} is this agent's own name")
        if serves:
            built = facts.get("built") if isinstance(facts.get("built"), list) else []
            caches = {key: dict(facts, serves=True, built=built) for key, facts in caches.items()}
        try:
            name = self._nixl.add_remote_agent(bytes(metadata[12 + size:]))
        except Exception as e:  # noqa: BLE001  (NIXL's own error, about bytes the caller passed)
            raise kvforge.ArgumentError(f"metadata: NIXL refused the agent metadata of {agent!r}: {e}") from None
        name = name.decode() if isinstance(name, bytes) else name
        if name != agent:
            self._nixl.remove_remote_agent(name)
            raise kvforge.ArgumentError(f"metadata: the header names {agent!r}, NIXL's part {name!r}")
        self._peers[name] = caches
        self._peer_states[name] = facts.get("states", {}) if isinstance(facts.get("states"), dict) else {}
        return name

    def notifications(self):
        """{agent name: [message bytes]}: the notify= messages of pulls that completed from this agent."""
        with self._lock:
            self._drain()
            received, self._user_notifs = self._user_notifs, {}
        return received

    # -- the messages of prepared pulls (_nixl_prepared.py) ---------------------------------------

    def _drain(self):
        """Takes NIXL's new notifications: a prepared pull's messages go to their request, others stay
        for notifications()."""
        with self._lock:
            for peer, messages in self._nixl.get_new_notifs().items():
                peer = peer.decode() if isinstance(peer, bytes) else peer
                for message in messages:
                    parsed = wire.decode(message)
                    if parsed is None:
                        self._user_notifs.setdefault(peer, []).append(message)
                    else:
                        prepared.route(self, peer, *parsed)

    def _progress_loop(self):
        idle_since = time.monotonic()
        while not self._stop.is_set():
            busy = False
            with self._lock:
                try:
                    self._drain()
                except Exception as e:  # noqa: BLE001  (NIXL's own failure: kept for close(), polling goes on)
                    self.thread_error = e
                now = time.monotonic()
                for request, serving in list(self._serving.items()):
                    try:
                        busy = serving.step() or busy
                    except Exception as e:  # noqa: BLE001  (this request ends; the others go on)
                        serving.last = -prepared.STALE_SECONDS
                        self.thread_error = e
                    if now - serving.last > prepared.STALE_SECONDS:  # the receiver went away, or it failed
                        self._parked.append(self._serving.pop(request).area)
            if busy or self._serving:
                idle_since = now
            time.sleep(0 if now - idle_since < 0.01 else 0.001)

    # -- pulls ---------------------------------------------------------------------------------------

    def pull(self, sources, key, count, source, target, begin=0, timeout=30.0, notify=b"", prepared=None,
             unchecked=False):
        """Pulls positions [begin, begin + count) of one request into the cache registered as `key`.

        sources: [(agent name, key)] for each rank of the sending tensor-parallel group, in rank order.
        source, target: Placements of the request in the sending caches (the same on every rank) and here.
        timeout: seconds; then PullTimeout. notify: bytes each sender gets in notifications() when done.
        prepared: None lets the pull ask a serving sender (Agent(serve=True)) to write the request in this
        cache's page order where the bytes do not map one to one; False never asks; True requires it.
        unchecked: pull a source Placement that carries no generations (refused otherwise). Unsafe: a page
        the sender freed or reused since would hand over another request's K/V, and nothing would say so.
        Returns a dict: how (direct, prepared, staged, or scratch: codes decoded in a scratch of the sender's
        variant), descriptors and bytes read.
        """
        return self.start_pull(sources, key, count, source, target, begin, notify, prepared, unchecked).wait(timeout)

    def start_pull(self, sources, key, count, source, target, begin=0, notify=b"", prepared=None, unchecked=False):
        """As pull(), but returns a Pull at once; several may be in flight. Pull.wait(timeout) ends it."""
        with self._lock:
            self._release_abandoned()
            generations.refuse_unchecked(self, sources, source, unchecked)  # before anything is read
            plan = self._plan(sources, key, count, source, target, begin, prepared)
            pull = prepared_pull(self, plan, notify) if plan.get("placement") else Pull(self, plan, notify)
        if getattr(source, "generations", None) is not None:
            generations.check_after(self, pull, sources, key, source, target, np.arange(begin, begin + count))
        return pull

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

    def _plan(self, sources, key, count, source, target, begin, ask=None):
        if key not in self._caches:
            raise kvforge.ArgumentError(f"key: {key!r} is not registered here (registered: {sorted(self._caches)})")
        cache, mine, _ = self._caches[key]
        return self._plan_into(cache, mine, sources, count, source, target, begin, ask)

    def _plan_into(self, cache, mine, sources, count, source, target, begin, ask=None):
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
        scales = None  # each sender's per-tensor scales, where its codes are decoded on arrival
        if theirs[0]["quant"] != "none":  # whole pages of this variant, codes under equal scales, or decoded
            if ask:
                raise kvforge.UnsupportedError("prepared: no prepared pull: a quantized source's codes go direct")
            if plans.same_pages(mine, theirs):
                return page_pulls.direct(cache, mine, theirs[0], sources[0][0], source, target, begin, count)
            scales = [staged_pulls.read_tensor_scales(self, d, sources[rank][0]) for rank, d in enumerate(theirs)]
            if all(staged_pulls.same_codes(cache, mine, d, s) for d, s in zip(theirs, scales)):
                scales = None
            elif plan := staged_pulls.scratch_plan(self, cache, mine, theirs, scales, sources, source, target, begin, count):
                return plan  # decoded by the sender's own kernels, in a scratch of its variant
        # A sender that serves writes this cache's page order, unless both pools place a request's bytes
        # alike: then a direct READ takes as few descriptors, with no pass on either side.
        if scales is None and (ask or (ask is None and not _same_geometry(mine, theirs))):
            plan, why = self._prepared_plan(cache, mine, theirs, sources, source, target, count, begin)
            if ask and not plan:
                raise kvforge.UnsupportedError(f"prepared: no prepared pull: {why}")
            if plan:
                return plan
        # Runs are enumerated in the source's own order: its (page, slot, K/V, head) axes from the widest
        # stride in, so that its adjacent runs come one after another and merge without sorting. The
        # staging area is dense over the same axes: a source page lands whole.
        first = theirs[0]
        order, grid, start = _source_grid(first, positions)
        element_bytes = first["element_bytes"]
        sizes = dict(grid, kv=2, head=mine["heads"])
        shape = (mine["layers"],) + tuple(sizes[axis] for axis in order) + (mine["head_dim"],)
        layer_bytes = int(np.prod(shape[1:])) * element_bytes
        codes = first["quant"] != "none" and scales is None  # checked above: they mean here what they mean there
        may_go_direct = mine["storage"] == first["storage"] and (mine["quant"] == "none" or codes) and scales is None
        pieces = kvforge.shard_pieces(mine["model_heads"], len(theirs), mine["tp"])
        direct, staged, decode = [], [], []
        for sender, receiver, head_begin, head_end in pieces:
            if receiver != mine["rank"]:
                continue
            d, peer = theirs[sender], sources[sender][0]
            heads = np.arange(head_begin, head_end, dtype=np.int64)
            theirs_heads, local = heads - d["heads_of_rank"][0], heads - mine["heads_of_rank"][0]
            if scales is not None:
                decode.append((int(local[0]), int(local[-1]) + 1, scales[sender]))
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
        if may_go_direct and (codes or runs(direct) <= 2 * runs(staged)):
            chosen = direct
        else:
            area = self._take_staging(int(np.prod(shape)) * element_bytes,
                                      torch.device("cuda" if mine["device"] == "VRAM" else "cpu"))
            element = CODE_DTYPES[first["storage"]] if scales is not None else TORCH_DTYPES[first["storage"]]
            staging = area[0][:int(np.prod(shape)) * element_bytes].view(element).view(shape)
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
                "dst_place": dst_place, "first_position": int(positions[0]) - start, "count": count,
                "decode": decode if scales is not None else None}


    def _prepared_plan(self, cache, mine, theirs, sources, source, target, count, begin):
        """(the plan of a prepared pull, None) or (None, why one cannot go)."""
        pieces = [p for p in kvforge.shard_pieces(mine["model_heads"], len(theirs), mine["tp"]) if p[1] == mine["rank"]]
        d = theirs[pieces[0][0]] if len(pieces) == 1 else None
        why = ("the request comes from several senders" if d is None else
               "the sender does not serve (Agent(serve=True))" if not d.get("serves") else
               "it starts past position 0" if begin else
               "a cache is not in host memory" if "DRAM" != mine["device"] or "DRAM" != d["device"] else None)
        placement = None
        if why is None and (d["storage"] != mine["storage"] or mine["quant"] != "none"):
            placement, why = page_pulls.placement(mine, d, target, count)  # the sender writes this cache's own bytes
        elif why is None:
            pages = None if target.pages is None else target.pages[:-(-count // mine["page_size"])].astype(np.int32)
            placement = cache.physical_placement(count, pages=pages, row=target.row or 0)
            why = None if placement is not None else f"{mine['name']}'s pages are not dense blocks"
        if why is not None:
            return None, why
        self._pulls += 1
        sender, _, head_begin, head_end = pieces[0]
        return {"id": f"{self.name}/{self._run}/{self._pulls}", "peer": sources[sender][0], "their_key": sources[sender][1],
                "count": count, "source": source, "source_page_size": d["page_size"], "placement": placement,
                "head_offset": head_begin - d["heads_of_rank"][0], "heads": head_end - head_begin,
                "layers": mine["layers"], "layer_bases": _layer_bases(mine), "device_id": mine["device_id"]}, None


def _stop_polling(stop, thread):
    stop.set()
    thread.join()


prepared_pull = prepared.PreparedPull  # (agent, plan, notify)
