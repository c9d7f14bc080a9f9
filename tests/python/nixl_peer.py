"""A sending process for tests/python/test_nixl.py: it creates caches, writes requests into them through
the caches' own append, registers them with a kvforge.nixl Agent and serves pulls until told to stop.

    python3 nixl_peer.py <agent name> <json: [{key, variant, rank, pages|rows, requests: [[id, placement]]}
                                                | {key, states: {record, layers, slots}}]> [how]

how: `serve` (the agent serves prepared pulls) or `progress` (it keeps NIXL's progress thread, which a peer
that is read over TCP without serving needs); neither by default.

stdout: a line `metadata <hex>`, the agent's metadata. stdin: `notifications` (answers `notifications <json>`, those
received so far), `placement <key> <json pages>` (answers `placement <json generations>`, as Agent.placement
publishes them), `reuse <key> <request> <json pages> <count>` (retires the pages, then writes that request
there; answers `reused <key>`) or `quit`.

A plan entry with "managed": true is a paged cache registered with the SequenceManager that allocates its pages
(no requests written up front); for it, `admit <key> <request> <count>` adds a prompt of that many tokens and
writes the request into the pages the manager gave it (answers `admitted <json pages>`), and `finish <key>
<request>` frees it the way a serving loop does (answers `finished <key>`). Nothing retires a page by hand.
"""

import json
import sys

import numpy as np
import torch

import kvforge
import kvforge.nixl
from kvforge.torch_dtypes import TORCH_DTYPES


def value(request, layer, kv, heads, positions, head_dim):
    """[positions, heads, head_dim] of exact bf16 values: multiples of 1/8 in [-12.5, 12.375], a function
    of (request, layer, K or V, global head, position, dim) alone."""
    h = torch.as_tensor(heads).view(1, -1, 1)
    p = torch.as_tensor(positions).view(-1, 1, 1)
    e = torch.arange(head_dim).view(1, 1, -1)
    return (((request * 13 + layer * 7 + kv * 5 + h * 3 + p * 11 + e) % 200) - 100).float() / 8


def where(descriptor, placement, positions):
    """The append arguments that put positions at `placement` ({"pages": [...]} or {"row": r})."""
    if "pages" in placement:
        pages = np.asarray(placement["pages"])
        return {"slots": torch.from_numpy(pages[positions // descriptor.page_size] * descriptor.page_size +
                                          positions % descriptor.page_size)}
    return {"rows": torch.full((len(positions),), placement["row"], dtype=torch.int32),
            "positions": torch.from_numpy(positions.astype(np.int32))}


def write_request(cache, rank, request, placement, count):
    d = cache.descriptor
    begin, end = d.shard_heads(rank)
    positions = np.arange(count)
    dtype = TORCH_DTYPES[d.input]
    for layer in range(d.layers):
        k, v = (value(request, layer, kv, range(begin, end), positions, d.head_dim).to(dtype) for kv in (0, 1))
        cache.append(layer, k, v, **where(d, placement, positions))
    if d.lazy:
        cache.commit()


def state_value(slot, layer, part, shape):
    """A state part's values in slot `slot` of layer `layer`: exact in every float dtype (integers below 256)."""
    n = int(np.prod(shape))
    return (((torch.arange(n) + slot * 37 + layer * 11 + part * 5) % 251).float()).view(*shape)


def fill_states(pool):
    for layer in range(pool.layers):
        for part, (name, shape, dtype) in enumerate(pool.parts):
            view = torch.from_dlpack(pool.view(layer, name))
            for slot in range(pool.slots):
                view[slot].copy_(state_value(slot, layer, part, shape))


def model_state(slot, layer, part, model_shape):
    """The model's whole part (every rank's share together) in slot `slot` of layer `layer`: exact in fp32."""
    n = int(np.prod(model_shape))
    return ((torch.arange(n) * 3 + slot * 1000 + layer * 101 + part * 7) % 4093).float().view(*model_shape)


def model_shape(descriptor, part):
    """A part's shape in the whole model: a rank's, times the degree along its spec's shard_axis."""
    shape = list(descriptor.state_parts[part][1])
    axis = descriptor.state_shard_axes[part]
    if axis >= 0:
        shape[axis] *= descriptor.tensor_parallel
    return shape


def rank_share(descriptor, rank, slot, layer, part):
    """Rank `rank`'s share of the model's part: its 1 / degree of the shard axis, or all of a whole part."""
    full = model_state(slot, layer, part, model_shape(descriptor, part))
    axis = descriptor.state_shard_axes[part]
    if axis < 0:
        return full
    n = descriptor.state_parts[part][1][axis]
    return full.narrow(axis, rank * n, n)


def main():
    name, plan, how = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else ""
    agent = kvforge.nixl.Agent(name, serve=how == "serve", progress_thread=how == "progress")
    caches = []
    for entry in plan:
        if "states" in entry:  # a hybrid model's state pool, every slot filled by state_value
            st = entry["states"]
            if "variant" in st:  # a variant's pool at its rank, each slot its share of the model's state
                d = kvforge.describe(st["variant"])
                pool = kvforge.StatePool.for_variant(d, slots=st["slots"])
                for layer in range(pool.layers):
                    for part, (name, _, _) in enumerate(pool.parts):
                        for slot in range(pool.slots):
                            torch.from_dlpack(pool.view(layer, name))[slot].copy_(rank_share(d, st["rank"], slot, layer, part))
                agent.register_states(entry["key"], pool, d, st["rank"])
            else:
                pool = kvforge.StatePool([tuple(p) for p in st["record"]], layers=st["layers"], slots=st["slots"])
                fill_states(pool)
                agent.register_states(entry["key"], pool)
            caches.append((pool, None))
            continue
        cache = kvforge.create(entry["variant"], **{k: entry[k] for k in ("pages", "rows", "max_staged_tokens")
                                                    if k in entry})
        for layer in range(cache.descriptor.layers if "tensor_scales" in entry else 0):
            cache.set_tensor_scale(layer, *entry["tensor_scales"])
        for request, placement, count in entry.get("requests", []):
            write_request(cache, entry.get("rank", 0), request, placement, count)
        manager = kvforge.SequenceManager(cache) if entry.get("managed") else None
        agent.register(entry["key"], cache, rank=entry.get("rank", 0), manager=manager)
        caches.append((cache, manager))
    print("metadata", agent.metadata().hex(), flush=True)
    received = {}
    for line in sys.stdin:
        if line.strip() == "notifications":
            for peer, messages in agent.notifications().items():
                received.setdefault(peer, []).extend(m.decode() for m in messages)
            print("notifications", json.dumps(received), flush=True)
        elif line.startswith("reuse "):  # reuse <key> <request> <json pages> <count>: freed, then rewritten
            _, key, request, pages, count = line.split(" ", 4)
            cache = caches[[e.get("key") for e in plan].index(key)][0]
            agent.retire(key, pages=json.loads(pages))
            write_request(cache, 0, int(request), {"pages": json.loads(pages)}, int(count))
            print("reused", key, flush=True)
        elif line.startswith("placement "):  # placement <key> <json pages>: as published now
            _, key, pages = line.split(" ", 2)
            published = agent.placement(key, pages=json.loads(pages))
            print("placement", json.dumps(published.generations.tolist()), flush=True)
        elif line.startswith("admit "):  # admit <key> <request> <count>: pages from the manager, then written
            _, key, request, count = line.split()
            cache, manager = caches[[e.get("key") for e in plan].index(key)]
            manager.add(int(request), [int(request) * 1000 + t for t in range(int(count))])  # no shared prefix
            manager.step([int(request)])
            write_request(cache, 0, int(request), {"pages": manager.pages(int(request))}, int(count))
            print("admitted", json.dumps(manager.pages(int(request))), flush=True)
        elif line.startswith("finish "):  # finish <key> <request>: the manager frees it, as a serving loop does
            _, key, request = line.split()
            caches[[e.get("key") for e in plan].index(key)][1].free(int(request))
            print("finished", key, flush=True)
        elif line.strip() == "quit":
            break
    agent.close()


if __name__ == "__main__":
    main()
