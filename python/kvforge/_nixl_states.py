"""A hybrid model's per-sequence states over NIXL (kvforge.nixl.Agent.register_states, pull_state): a
StatePool's memory registered as it is, and a sequence's slot pulled one-sided with one READ of its
bytes, after both records are checked equal. A slot is one run of memory (state_pool.hpp), so the
pull is one descriptor whatever the record."""

import time

import numpy as np
import torch

import kvforge

from ._nixl_wait import PullTimeout


def describe(pool):
    buffer = torch.from_dlpack(pool.buffer())
    return {"record": [[name, list(shape), dtype] for name, shape, dtype in pool.parts], "layers": pool.layers,
            "slots": pool.slots, "slot_bytes": pool.slot_bytes, "address": buffer.data_ptr(),
            "device": "VRAM" if buffer.device.type == "cuda" else "DRAM", "device_id": max(buffer.get_device(), 0)}


def register(agent, key, pool):
    if key in agent._states:
        raise kvforge.ArgumentError(f"key: {key!r} is registered already")
    if not isinstance(pool, kvforge.StatePool):
        raise kvforge.ArgumentError("pool: expected a kvforge.StatePool")
    agent._states[key] = (pool, describe(pool), agent._nixl.register_memory([torch.from_dlpack(pool.buffer())]))


def pull(agent, source, key, src_slot, dst_slot, timeout):
    """Slot src_slot of the peer's pool `source` = (agent name, key) into slot dst_slot of this agent's `key`."""
    with agent._lock:
        if key not in agent._states:
            raise kvforge.ArgumentError(f"key: {key!r} is no state pool registered here (registered: "
                                        f"{sorted(agent._states)})")
        peer, their_key = source
        theirs = agent._peer_states.get(peer, {}).get(their_key)
        if theirs is None:
            raise kvforge.ArgumentError(f"source: agent {peer!r} is not connected or registered no state pool "
                                        f"{their_key!r}")
        pool, mine, _ = agent._states[key]
        if not isinstance(theirs, dict) or any(f not in theirs for f in mine):
            raise kvforge.ArgumentError(f"source: agent {peer!r}'s description of {their_key!r} is not a state pool's")
        for field in ("record", "layers", "slot_bytes"):
            if theirs[field] != mine[field]:
                raise kvforge.ArgumentError(f"{field}: the source pool has {theirs[field]!r}, this one {mine[field]!r}")
        for name, slot, slots in (("src_slot", src_slot, theirs["slots"]), ("dst_slot", dst_slot, mine["slots"])):
            if not 0 <= slot < slots:
                raise kvforge.OutOfRangeError(f"{name} = {slot} is outside [0, {slots})")
        size = mine["slot_bytes"]
        local = np.array([[mine["address"] + dst_slot * size, size, mine["device_id"]]], dtype=np.uint64)
        remote = np.array([[theirs["address"] + src_slot * size, size, theirs["device_id"]]], dtype=np.uint64)
        nixl = agent._nixl
        handle = nixl.initialize_xfer("READ", nixl.get_xfer_descs(local, mine["device"]),
                                      nixl.get_xfer_descs(remote, theirs["device"]), peer)
        state = nixl.transfer(handle)
    deadline = time.monotonic() + timeout
    while state == "PROC":
        if time.monotonic() >= deadline:
            with agent._lock:
                agent._abandoned.append(([handle], None, None))
                agent._release_abandoned()
            raise PullTimeout(f"timeout: the state pull did not complete in {timeout} s; it was abandoned")
        time.sleep(0)
        with agent._lock:
            state = nixl.check_xfer_state(handle)
    with agent._lock:
        handle.release()
    if state != "DONE":
        raise kvforge.BackendError(f"nixl: the READ of a state slot from {peer!r} failed; slot {dst_slot} holds "
                                   f"undefined bytes")
    return {"bytes": size, "descriptors": 1}
