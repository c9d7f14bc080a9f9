"""Prepared pulls (docs/transfer.md, "Over NIXL"): where the bytes of two layouts do not map one to one,
the receiver asks the sender to write the request in the receiver's own page order, and READs each layer
straight into its pool.

The receiver describes where the request goes in its pool: the physical wire format of the MPI transfers
(kvforge/physical_wire.hpp, Cache.physical_placement), which names no layout. The sender writes each layer
so with one pass over its pool (Cache.write_physical) into a registered ring of a few layers, and says so;
the receiver READs that layer, one descriptor per run of its adjacent blocks, and the READ's completion
frees the ring slot. The conversion is the sender's work, on its own core, a layer ahead of the READ, so
the receiver's core copies each byte once, as a raw READ does.

Its messages are _nixl_wire.py's.
"""

import time

import numpy as np
import torch

import kvforge

from . import _nixl_pages as page_pulls
from . import _nixl_wire as wire
from ._nixl_wait import InFlight

RING_LAYERS = 4  # layers a request's ring holds: the sender writes this far ahead of the receiver's READs
STALE_SECONDS = 120.0  # a served request whose receiver read nothing for this long is dropped


class Serving:
    """The sender's side of one prepared pull: the ring it writes into and how far it got."""

    def __init__(self, agent, peer, head, rest):
        self.agent, self.peer, self.id = agent, peer, head["id"]
        self.cache = wire.served_cache(agent, head)
        blocks, runs = int(head["blocks"]), int(head["runs"])
        arrays = np.frombuffer(rest, dtype=np.int64)
        if blocks < 0 or runs < 0 or len(arrays) != blocks + runs + int(head.get("pages_given", 0)):
            raise kvforge.ArgumentError("placement: its arrays do not match their counts")
        self.placement = {name: int(head[name]) for name in
                          ("page_size", "slot_stride", "head_stride", "pages", "head_blocks", "wire_bytes")}
        self.placement.update(block=arrays[:blocks].copy(), runs=arrays[blocks:blocks + runs].copy())
        self.pages = arrays[blocks + runs:].astype(np.int32) if head.get("pages_given") else None
        self.row, self.tokens = int(head.get("row", 0)), int(head["tokens"])
        self.head_offset, self.heads = int(head["head_offset"]), int(head["heads"])
        d = self.cache.descriptor
        self.layers = d.layers
        self.wire = self.placement["wire_bytes"]
        # A valid placement's wire is exactly the request's values: check before a ring that size is taken.
        place = self.placement
        element = torch.from_dlpack(self.cache.view(0)["k"]).element_size()
        if not (1 <= self.heads <= d.heads and 1 <= self.tokens and place["page_size"] >= 1 and
                self.wire == 2 * place["pages"] * place["page_size"] * self.heads * d.head_dim * element):
            raise kvforge.ArgumentError("placement: its wire is not the request's values (wire_bytes, pages, "
                                        "page_size and heads disagree)")
        self.area = agent._take_staging(min(RING_LAYERS, self.layers) * self.wire, torch.device("cpu"))
        try:
            self.write(0)  # every check of the request and its placement runs first, before a byte is written
        except Exception:
            agent._spare.append(self.area)
            raise
        self.next, self.read, self.last = 1, set(), time.monotonic()

    def write(self, layer):
        self.cache.write_physical(layer, self.tokens, self.placement, self.slot(layer), pages=self.pages, row=self.row,
                                  head_offset=self.head_offset, heads=self.heads)
        head = {"id": self.id, "layer": layer, "at": self.slot(layer).data_ptr()}
        if layer == 0:  # the ring's registration, which the receiver's copy of this agent's metadata may lack
            head["ring"] = self.agent._nixl.get_partial_agent_metadata(self.area[1], False).hex()
        self.agent._nixl.send_notif(self.peer, wire.encode(b"L", head))

    def slot(self, layer):
        at = (layer % RING_LAYERS) * self.wire
        return self.area[0][at:at + self.wire]

    def step(self):
        """Writes every layer whose ring slot is free; True if it wrote any."""
        wrote = False
        while self.next < self.layers and (self.next < RING_LAYERS or self.next - RING_LAYERS in self.read):
            self.write(self.next)
            self.next += 1
            wrote = True
        return wrote

    def finished(self):
        return len(self.read) == self.layers

    def release(self, agent):
        """The last layer was read: the ring goes back to the agent's spare staging areas."""
        agent._spare.append(self.area)


def route(agent, peer, kind, head, rest):
    """A prepared pull's message, to the request it is about (Agent._drain)."""
    request = head.get("id")
    if kind == b"Q":
        accept(agent, peer, head, rest)
    elif kind == b"A" and request in agent._serving:
        serving = agent._serving[request]
        serving.read.add(int(head["layer"]))
        serving.last = time.monotonic()
        if serving.finished():
            agent._serving.pop(request).release(agent)
    elif kind == b"C" and request in agent._serving:
        agent._parked.append(agent._serving.pop(request).area)  # a READ of the ring may still be under way
    elif kind in (b"L", b"E") and request in agent._prepared_inbox:
        agent._prepared_inbox[request].append((kind, head))


def accept(agent, peer, head, rest):
    """A receiver's request: served from now on, or refused naming the field."""
    if peer not in agent._answering and peer not in agent._peers:
        try:
            agent._nixl.add_remote_agent(bytes.fromhex(head.get("metadata", "")))
        except Exception:  # noqa: BLE001  (nothing reaches a peer that sent no usable metadata)
            return
        agent._answering.add(peer)
    try:
        if not agent._serves:
            raise kvforge.UnsupportedError(f"serve: agent {agent.name!r} does not serve prepared pulls")
        if head["id"] in agent._serving:
            raise kvforge.StateError(f"id: {head['id']!r} is being served already")
        serving = page_pulls.PageServing if head.get("mode") == "pages" else Serving
        agent._serving[head["id"]] = serving(agent, peer, head, rest)
    except (kvforge.Error, KeyError, ValueError, TypeError, OverflowError, RuntimeError, MemoryError) as e:
        error = type(e).__name__ if isinstance(e, kvforge.Error) else "ArgumentError"
        message = str(e) if isinstance(e, kvforge.Error) else f"request: malformed ({e!r})"
        agent._nixl.send_notif(peer, wire.encode(b"E", {"id": head.get("id"), "error": error, "message": message}))


def request_message(agent, plan):
    """The receiver's request for a prepared pull (kind Q)."""
    place, source = plan["placement"], plan["source"]
    head = {"id": plan["id"], "key": plan["their_key"], "tokens": plan["count"], "head_offset": plan["head_offset"],
            "heads": plan["heads"], "metadata": agent._nixl.get_agent_metadata().hex()}
    if place.get("mode") == "pages":
        head.update(page_pulls.request_head(plan))
        arrays = []
    else:
        head.update({"blocks": len(place["block"]), "runs": len(place["runs"]), **{name: int(place[name]) for name in
                     ("page_size", "slot_stride", "head_stride", "pages", "head_blocks", "wire_bytes")}})
        arrays = [place["block"], place["runs"]]
    if source.pages is not None:
        needed = -(-plan["count"] // plan["source_page_size"])
        head["pages_given"] = needed
        arrays.append(source.pages[:needed].astype(np.int64))
    else:
        head["row"] = int(source.row)
    return wire.encode(b"Q", head, *arrays)


class PreparedPull(InFlight):
    """The receiver's side: READs each layer the sender says is ready, straight into the pool."""

    def __init__(self, agent, plan, notify):
        self._agent, self._plan, self._notify = agent, plan, notify
        self.peers = (plan["peer"],)
        self._handles = {}  # layer -> NIXL READ in flight
        self._done = 0
        place = plan["placement"]
        self._runs = place["runs"]
        self._wire_at = np.concatenate(([0], np.cumsum(self._runs)[:-1])).astype(np.int64)
        self.report = {"how": "prepared", "descriptors": len(self._runs) * plan["layers"],
                       "bytes": int(self._runs.sum()) * plan["layers"]}
        self._finished = False
        agent._prepared_inbox[plan["id"]] = []
        try:
            agent._nixl.send_notif(plan["peer"], request_message(agent, plan))
        except Exception as e:  # noqa: BLE001  (NIXL 1.5 raises for a peer gone; its classes are not kvforge's)
            agent._prepared_inbox.pop(plan["id"], None)
            raise kvforge.BackendError(f"nixl: asking peer {plan['peer']!r} for the request failed: "
                                       f"{type(e).__name__}: {e}; nothing was read") from e

    def _read(self, layer, at):
        plan, nixl = self._plan, self._agent._nixl
        local = np.stack([plan["layer_bases"][layer] + plan["placement"]["run_at"], self._runs,
                          np.full_like(self._runs, plan["device_id"])], axis=1).astype(np.uint64)
        remote = np.stack([at + self._wire_at, self._runs, np.zeros_like(self._runs)], axis=1).astype(np.uint64)
        handle = nixl.initialize_xfer("READ", nixl.get_xfer_descs(local, "DRAM"), nixl.get_xfer_descs(remote, "DRAM"),
                                      plan["peer"], wire.encode(b"A", {"id": plan["id"], "layer": layer}))
        self._handles[layer] = handle
        try:
            if nixl.transfer(handle) == "ERR":
                raise RuntimeError("its state is ERR")
        except Exception as e:  # noqa: BLE001  (an ERR, or NIXL 1.5's raise: the READs posted are parked)
            self._abandon_locked()
            raise kvforge.BackendError(f"nixl: posting a READ from peer {plan['peer']!r} failed: {type(e).__name__}: "
                                       f"{e}") from e

    def done(self):
        with self._agent._lock:  # the agent's thread polls NIXL too
            return self._done_locked()

    def _done_locked(self):
        if self._finished:
            return True
        agent, plan = self._agent, self._plan
        agent._drain()
        for kind, head in agent._prepared_inbox.get(plan["id"], []):
            if kind == b"E":
                self._abandon()
                error = getattr(kvforge, head.get("error", ""), None)
                error = error if isinstance(error, type) and issubclass(error, kvforge.Error) else kvforge.ArgumentError
                raise error(f"{head['message']} (refused by the sender, {plan['peer']!r}; nothing was read)")
            if "ring" in head:
                agent._nixl.add_remote_agent(bytes.fromhex(head["ring"]))
            self._read(int(head["layer"]), int(head["at"]))
        agent._prepared_inbox[plan["id"]] = []
        for layer, handle in list(self._handles.items()):
            try:
                state = agent._nixl.check_xfer_state(handle)
            except Exception:  # noqa: BLE001  (NIXL 1.5 raises where a peer is gone)
                state = "ERR"
            if state == "ERR":
                self._abandon_locked()
                raise kvforge.BackendError(f"nixl: a READ of this pull from peer {plan['peer']!r} failed; the target "
                                           f"positions hold undefined bytes")
            if state == "DONE":
                handle.release()
                del self._handles[layer]
                self._done += 1
        return self._done == plan["layers"]

    def _finish(self):
        self._finished = True
        self._agent._prepared_inbox.pop(self._plan["id"], None)
        if self._notify:
            self._agent._nixl.send_notif(self._plan["peer"], self._notify)

    def _abandon(self):
        with self._agent._lock:
            self._abandon_locked()

    def _abandon_locked(self):
        agent, plan = self._agent, self._plan
        agent._prepared_inbox.pop(plan["id"], None)
        agent._cancelled.add(plan["id"])  # ready messages that still come are dropped
        try:
            agent._nixl.send_notif(plan["peer"], wire.encode(b"C", {"id": plan["id"]}))
        except Exception:  # noqa: BLE001  (a vanished sender: it has nothing left to drop)
            pass
        agent._abandoned.append((list(self._handles.values()), None, None))
        self._handles = {}
        agent._release_abandoned()
        self._finished = True
