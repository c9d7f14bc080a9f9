"""A hybrid model's per-sequence states over NIXL (kvforge.nixl.Agent.register_states, pull_state): a
StatePool's memory registered as it is, and a sequence's slot pulled one-sided with one READ, after
both records are checked equal. The READ takes a descriptor for each run that the slot's parts make on
both sides: one for two slot-major pools (a slot is one run, state_pool.hpp), a layer's or a part's
where a pool keeps another order (StatePool axes), so pools of any two orders exchange states."""

import time

import numpy as np
import torch

import kvforge

from ._nixl_wait import PullTimeout


def describe(pool):
    buffer = torch.from_dlpack(pool.buffer())
    # Each part of each layer: where slot 0's lies, and the step to the next slot's.
    places = [[pool.offset(0, layer, part), pool.slot_stride(layer, part)]
              for layer in range(pool.layers) for part in range(len(pool.parts))]
    return {"record": [[name, list(shape), dtype] for name, shape, dtype in pool.parts], "layers": pool.layers,
            "slots": pool.slots, "slot_bytes": pool.slot_bytes, "address": buffer.data_ptr(), "places": places,
            "device": "VRAM" if buffer.device.type == "cuda" else "DRAM", "device_id": max(buffer.get_device(), 0)}


def _runs(pool, mine, theirs, src_slot, dst_slot):
    """[local, remote, bytes] for each run: the slot's parts in order, a part joining the run before it
    where it lies the same distance from the run's start on both sides, past at most a part's 64-byte
    padding (which is zero in every pool)."""
    runs = []
    for i, ((at, step), (their_at, their_step)) in enumerate(zip(mine["places"], theirs["places"])):
        size = pool.part_bytes(i % len(pool.parts))
        local, remote = mine["address"] + at + dst_slot * step, theirs["address"] + their_at + src_slot * their_step
        if runs and local - runs[-1][0] == remote - runs[-1][1] and 0 <= local - runs[-1][0] - runs[-1][2] < 64:
            runs[-1][2] = local - runs[-1][0] + size
        else:
            runs.append([local, remote, size])
    return runs


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
        runs = _runs(pool, mine, theirs, src_slot, dst_slot)
        local = np.array([[at, size, mine["device_id"]] for at, _, size in runs], dtype=np.uint64)
        remote = np.array([[at, size, theirs["device_id"]] for _, at, size in runs], dtype=np.uint64)
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
    return {"bytes": sum(size for _, _, size in runs), "descriptors": len(runs)}
