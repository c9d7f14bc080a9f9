"""KV events as a KV-aware router reads them, and the block hash it can compute itself.

A ``SequenceManager(..., kv_events=True)`` records what its prefix cache stores and drops;
``manager.take_kv_events()`` returns them as dictionaries with vLLM's names
(``vllm/distributed/kv_events.py``): ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared``.
``encode`` serializes a batch as vLLM publishes one (msgpack; a batch ``[ts, events, dp_rank]``, each
event ``[type, field, ...]`` in vLLM's field order, trailing defaults left out), so that a consumer
of vLLM's events (Dynamo, llm-d) decodes it with vLLM's own classes. ``decode`` reads one back.

``block_hash`` is kvforge's block hash, as docs/memory.md defines it: a router computes the hashes of
a prompt's blocks with it and looks them up among the stored ones.
"""

import time
from typing import Iterable, List, Optional, Sequence, Tuple

MASK = (1 << 64) - 1

# vLLM's field order for each event type after its tag, and which trailing fields have defaults
# (left out when at them, as msgspec's omit_defaults does).
FIELDS = {
    "BlockStored": (("block_hashes", False), ("parent_block_hash", False), ("token_ids", False),
                    ("block_size", False), ("lora_id", False), ("medium", False), ("lora_name", False),
                    ("extra_keys", True), ("group_idx", True)),
    "BlockRemoved": (("block_hashes", False), ("medium", False), ("group_idx", True)),
    "AllBlocksCleared": (),
}


def _mix(h: int, v: int) -> int:
    h ^= (v + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)) & MASK
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & MASK
    return h ^ (h >> 31)


def block_hash(parent: Optional[int], salt: int, tokens: Sequence[int]) -> int:
    """The hash of a full block of ``tokens`` after the block hashed ``parent`` (None for the first),
    under ``salt`` (the manager's, or add()'s): docs/memory.md, "Block hashes"."""
    h = _mix(parent or 0, salt & MASK)
    for t in tokens:
        h = _mix(h, t & 0xFFFFFFFF)
    return h


def prompt_hashes(tokens: Sequence[int], block_size: int, salt: int = 0) -> List[int]:
    """The hashes of every full block of a prompt, first to last."""
    out, parent = [], None
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, salt, tokens[i:i + block_size])
        out.append(parent)
    return out


def _msgpack():
    try:
        import msgpack
    except ImportError as e:  # pragma: no cover - setup installs it
        raise ImportError("kvforge.kv_events needs msgpack: pip install -r tools/requirements.txt") from e
    return msgpack


def _as_array(event: dict) -> list:
    kind = event.get("type")
    if kind not in FIELDS:
        raise ValueError(f"event type {kind!r}: allowed {', '.join(FIELDS)}")
    values = [event.get(name) for name, _ in FIELDS[kind]]
    while values and FIELDS[kind][len(values) - 1][1] and values[-1] is None:
        values.pop()
    return [kind] + values


def encode(events: Iterable[dict], ts: Optional[float] = None, data_parallel_rank: Optional[int] = None) -> bytes:
    """One batch of events (``take_kv_events()``'s dictionaries) as vLLM's ``KVEventBatch`` in msgpack."""
    batch = [time.time() if ts is None else float(ts), [_as_array(e) for e in events]]
    if data_parallel_rank is not None:
        batch.append(int(data_parallel_rank))
    return _msgpack().packb(batch, use_bin_type=True)


def decode(data: bytes) -> Tuple[float, List[dict], Optional[int]]:
    """A batch ``encode`` (or vLLM) wrote: (ts, events as dictionaries, data_parallel_rank)."""
    batch = _msgpack().unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KV event batch: expected [ts, events, data_parallel_rank?]")
    events = []
    for item in batch[1]:
        if not isinstance(item, list) or not item or item[0] not in FIELDS:
            raise ValueError(f"not a KV event: {item!r:.80}")
        fields = FIELDS[item[0]]
        event = {"type": item[0]}
        for (name, _), value in zip(fields, item[1:]):
            event[name] = value
        for name, _ in fields[len(item) - 1:]:
            event[name] = None
        events.append(event)
    return float(batch[0]), events, batch[2] if len(batch) > 2 else None
