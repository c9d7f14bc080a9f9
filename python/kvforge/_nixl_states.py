"""A hybrid model's per-sequence states over NIXL (kvforge.nixl.Agent.register_states, pull_state): a
StatePool's memory registered as it is, and a sequence's slot pulled one-sided with one READ from each
source, after the records are checked to agree.

- Between two pools of one rank each, the two records must be equal. The READ takes a descriptor for
  each run that the slot's parts make on both sides: one for two slot-major pools (a slot is one run,
  state_pool.hpp), a layer's or a part's where a pool keeps another order (StatePool axes), so pools of
  any two orders exchange states.
- Between tensor-parallel groups of any degrees, each pool is registered with its variant and rank, the
  sources are the sending group's pools in rank order, and this rank reads from each its rows of the
  model's state (kvforge.state_rows: each part split as its model spec's shard_axis says)."""

import time

import numpy as np
import torch

import kvforge

from ._nixl_plan import check_ranks
from ._nixl_wait import PullTimeout


def describe(pool, descriptor=None, rank=0):
    buffer = torch.from_dlpack(pool.buffer())
    # Each part of each layer: where slot 0's lies, and the step to the next slot's.
    places = [[pool.offset(0, layer, part), pool.slot_stride(layer, part)]
              for layer in range(pool.layers) for part in range(len(pool.parts))]
    return {"record": [[name, list(shape), dtype] for name, shape, dtype in pool.parts], "layers": pool.layers,
            "slots": pool.slots, "slot_bytes": pool.slot_bytes, "address": buffer.data_ptr(), "places": places,
            "device": "VRAM" if buffer.device.type == "cuda" else "DRAM", "device_id": max(buffer.get_device(), 0),
            "variant": descriptor.name if descriptor else None, "tp": descriptor.tensor_parallel if descriptor else 1,
            "rank": rank, "model_hash": kvforge.state_model_hash(descriptor) if descriptor else None}


def register(agent, key, pool, descriptor=None, rank=0):
    if key in agent._states:
        raise kvforge.ArgumentError(f"key: {key!r} is registered already")
    if not isinstance(pool, kvforge.StatePool):
        raise kvforge.ArgumentError("pool: expected a kvforge.StatePool")
    if descriptor is not None:
        if not isinstance(descriptor, kvforge.Descriptor) or not descriptor.linear_layers:
            raise kvforge.ArgumentError("descriptor: expected the Descriptor of a variant whose model names linear_layers")
        if [tuple(p) for p in pool.parts] != [tuple(p) for p in descriptor.state_parts] or \
                pool.layers != len(descriptor.linear_layers):
            raise kvforge.ArgumentError(f"pool: its record is not {descriptor.name}'s (StatePool.for_variant makes one)")
        if not 0 <= rank < descriptor.tensor_parallel:
            raise kvforge.OutOfRangeError(f"rank = {rank} is outside [0, {descriptor.tensor_parallel})")
    elif rank != 0:
        raise kvforge.ArgumentError("rank: a pool's rank needs its descriptor, which says how the model splits")
    agent._states[key] = (pool, describe(pool, descriptor, rank), agent._nixl.register_memory([torch.from_dlpack(pool.buffer())]),
                          descriptor)


def _whole_runs(pool, mine, theirs, src_slot, dst_slot):
    """[local, remote, bytes] for each run between two pools of one record: the slot's parts in order, a
    part joining the run before it where it lies the same distance from the run's start on both sides,
    past at most a part's 64-byte padding (which is zero in every pool)."""
    runs = []
    for i, ((at, step), (their_at, their_step)) in enumerate(zip(mine["places"], theirs["places"])):
        size = pool.part_bytes(i % len(pool.parts))
        local, remote = mine["address"] + at + dst_slot * step, theirs["address"] + their_at + src_slot * their_step
        if runs and local - runs[-1][0] == remote - runs[-1][1] and 0 <= local - runs[-1][0] - runs[-1][2] < 64:
            runs[-1][2] = local - runs[-1][0] + size
        else:
            runs.append([local, remote, size])
    return runs


def _share_runs(pool, descriptor, mine, theirs, sender, src_slot, dst_slot):
    """[local, remote, bytes] for each row that sender rank `sender` (`theirs`) gives this rank, rows that
    touch on both sides merged."""
    parts, runs = len(pool.parts), []
    for layer, part, their_offset, my_offset, size in kvforge.state_rows(descriptor, theirs["tp"], mine["tp"], sender,
                                                                          mine["rank"]):
        (at, step), (their_at, their_step) = mine["places"][layer * parts + part], theirs["places"][layer * parts + part]
        local = mine["address"] + at + dst_slot * step + my_offset
        remote = theirs["address"] + their_at + src_slot * their_step + their_offset
        if runs and runs[-1][0] + runs[-1][2] == local and runs[-1][1] + runs[-1][2] == remote:
            runs[-1][2] += size
        else:
            runs.append([local, remote, size])
    return runs


def _plan(agent, sources, key, src_slot, dst_slot):
    """(pool, [(peer, their description, runs)]) after every check, under the agent's lock."""
    if key not in agent._states:
        raise kvforge.ArgumentError(f"key: {key!r} is no state pool registered here (registered: {sorted(agent._states)})")
    pool, mine, _, descriptor = agent._states[key]
    named = []
    for i, (peer, their_key) in enumerate(sources):
        theirs = agent._peer_states.get(peer, {}).get(their_key)
        if theirs is None:
            raise kvforge.ArgumentError(f"source: agent {peer!r} is not connected or registered no state pool {their_key!r}")
        if not isinstance(theirs, dict) or any(f not in theirs for f in mine):
            raise kvforge.ArgumentError(f"source: agent {peer!r}'s description of {their_key!r} is not a state pool's")
        named.append((peer, theirs))
    if not 0 <= dst_slot < mine["slots"]:
        raise kvforge.OutOfRangeError(f"dst_slot = {dst_slot} is outside [0, {mine['slots']})")
    for _, theirs in named:
        if not 0 <= src_slot < theirs["slots"]:
            raise kvforge.OutOfRangeError(f"src_slot = {src_slot} is outside [0, {theirs['slots']})")
    if len(named) == 1 and mine["tp"] == 1 and named[0][1]["tp"] == 1:
        peer, theirs = named[0]
        for field in ("record", "layers", "slot_bytes"):
            if theirs[field] != mine[field]:
                raise kvforge.ArgumentError(f"{field}: the source pool has {theirs[field]!r}, this one {mine[field]!r}")
        return pool, [(peer, theirs, _whole_runs(pool, mine, theirs, src_slot, dst_slot))]
    # Between tensor-parallel groups: both sides registered with their variants, one model, ranks in order.
    if descriptor is None:
        raise kvforge.ArgumentError(f"key: {key!r} was registered without its descriptor, which a state between "
                                    f"groups of degree above 1 needs (register_states(key, pool, descriptor, rank))")
    plans = []
    for rank, (peer, theirs) in enumerate(named):
        if theirs["model_hash"] != mine["model_hash"]:
            raise kvforge.ArgumentError(f"model: sources[{rank}] ({theirs['variant']}) holds another model's state than "
                                        f"this pool ({mine['variant']})")
        check_ranks([t for _, t in named], rank, theirs["variant"], "pool")
        runs = _share_runs(pool, descriptor, mine, theirs, rank, src_slot, dst_slot)
        if runs:
            plans.append((peer, theirs, runs))
    return pool, plans


def pull(agent, sources, key, src_slot, dst_slot, timeout):
    """Slot src_slot of the peers' pools `sources` = [(agent name, key), ...], one per rank of the sending
    group in rank order (or one (agent name, key)), into slot dst_slot of this agent's pool `key`."""
    sources = [sources] if isinstance(sources, tuple) else list(sources)
    if not sources or any(not isinstance(s, tuple) or len(s) != 2 for s in sources):
        raise kvforge.ArgumentError("source: expected (agent name, key), or a list of them, one per sending rank")
    nixl, handles = agent._nixl, []
    with agent._lock:
        pool, plans = _plan(agent, sources, key, src_slot, dst_slot)
        mine = agent._states[key][1]
        for peer, theirs, runs in plans:
            local = np.array([[at, size, mine["device_id"]] for at, _, size in runs], dtype=np.uint64)
            remote = np.array([[at, size, theirs["device_id"]] for _, at, size in runs], dtype=np.uint64)
            handle = nixl.initialize_xfer("READ", nixl.get_xfer_descs(local, mine["device"]),
                                          nixl.get_xfer_descs(remote, theirs["device"]), peer)
            handles.append([peer, handle, nixl.transfer(handle)])
    deadline = time.monotonic() + timeout
    while any(state == "PROC" for _, _, state in handles):
        if time.monotonic() >= deadline:
            with agent._lock:
                agent._abandoned.append(([h for _, h, _ in handles], None, None))
                agent._release_abandoned()
            raise PullTimeout(f"timeout: the state pull did not complete in {timeout} s; it was abandoned")
        time.sleep(0)
        with agent._lock:
            for entry in handles:
                if entry[2] == "PROC":
                    entry[2] = nixl.check_xfer_state(entry[1])
    with agent._lock:
        for _, handle, _ in handles:
            handle.release()
    failed = [peer for peer, _, state in handles if state != "DONE"]
    if failed:
        raise kvforge.BackendError(f"nixl: the READ of a state slot from {failed[0]!r} failed; slot {dst_slot} holds "
                                   f"undefined bytes")
    return {"bytes": sum(size for _, _, runs in plans for _, _, size in runs),
            "descriptors": sum(len(runs) for _, _, runs in plans), "reads": len(plans)}
