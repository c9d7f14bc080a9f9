"""KV events as a KV-aware router reads them, and the block hash it can compute itself.

A ``SequenceManager(..., kv_events=True)`` records what its prefix cache stores and drops;
``manager.take_kv_events()`` returns them as dictionaries with vLLM's names
(``vllm/distributed/kv_events.py``): ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared``.
``encode`` serializes a batch as vLLM publishes one, in msgpack: a batch ``[ts, events, dp_rank]``,
each event in either of vLLM's two wire forms:
  - ``form="map"`` (the default, as vLLM writes since vllm#42892, and llm-d, Dynamo and SGLang read):
    a map ``{"type": tag, field: value, ...}``, fields at their default left out;
  - ``form="array"`` (vLLM before it): ``[tag, field, ...]`` in vLLM's field order, trailing defaults
    left out.
A consumer of vLLM's events decodes either with vLLM's own classes. ``decode`` reads both forms, in one
batch too, and fields it does not know are kept as they are.

``block_hash`` is kvforge's block hash, as docs/memory.md defines it: a router computes the hashes of
a prompt's blocks with it and looks them up among the stored ones. A manager made with
``block_hash="vllm_sha256_cbor"`` keys its blocks vLLM's way instead (``vllm_block_hash``), and its
events carry the integer block hashes that vLLM's do.
"""

import hashlib
import time
from typing import Iterable, List, Optional, Sequence, Tuple

MASK = (1 << 64) - 1

# vLLM's field order for each event type after its tag, and which fields have defaults (left out when
# at them, as msgspec's omit_defaults does: trailing ones in the array form, any in the map form).
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


VLLM_SEED = "vllm-none-hash"  # vLLM's seed of the chain where PYTHONHASHSEED is unset


def _cbor_head(major: int, value: int) -> bytes:
    """A CBOR item's head in its shortest form (RFC 8949, section 4.2.1)."""
    if value < 24:
        return bytes([major << 5 | value])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes([major << 5 | info]) + value.to_bytes(size, "big")
    raise ValueError(f"{value} does not fit in 64 bits")


def _cbor_int(v: int) -> bytes:
    return _cbor_head(0, v) if v >= 0 else _cbor_head(1, -1 - v)


def vllm_none_hash(seed: str = VLLM_SEED) -> bytes:
    """The digest a vLLM prefix starts from: SHA-256 of the CBOR text string ``seed``."""
    text = seed.encode()
    return hashlib.sha256(_cbor_head(3, len(text)) + text).digest()


def vllm_block_hash(parent: Optional[bytes], tokens: Sequence[int], salt: int = 0,
                    seed: str = VLLM_SEED) -> bytes:
    """vLLM's hash of a full block (``sha256_cbor``): SHA-256 of the canonical CBOR of
    ``[parent, [tokens], extra_keys]``, the parent ``vllm_none_hash(seed)`` for a first block and
    extra_keys null (kvforge's nonzero ``salt`` goes there as ``[salt]``). The 32-byte digest, which the
    next block chains; an event carries its low 64 bits (``int.from_bytes(digest, "big") & MASK``)."""
    body = _cbor_head(4, 3)
    parent = vllm_none_hash(seed) if parent is None else parent
    body += _cbor_head(2, len(parent)) + parent + _cbor_head(4, len(tokens))
    body += b"".join(_cbor_int(int(t)) for t in tokens)
    body += b"\xf6" if salt == 0 else _cbor_head(4, 1) + _cbor_head(0, salt)
    return hashlib.sha256(body).digest()


def prompt_hashes(tokens: Sequence[int], block_size: int, salt: int = 0, scheme: str = "kvforge",
                  seed: str = VLLM_SEED) -> List[int]:
    """The hashes of every full block of a prompt, first to last, as a manager made with
    ``block_hash=scheme`` (and ``hash_seed=seed``) keys them and its events carry them."""
    if scheme not in ("kvforge", "vllm_sha256_cbor"):
        raise ValueError(f"scheme: {scheme!r} is not a block hash (allowed: kvforge, vllm_sha256_cbor)")
    out, parent = [], None
    for i in range(0, len(tokens) - block_size + 1, block_size):
        if scheme == "kvforge":
            parent = block_hash(parent, salt, tokens[i:i + block_size])
            out.append(parent)
        else:
            parent = vllm_block_hash(parent, tokens[i:i + block_size], salt, seed)
            out.append(int.from_bytes(parent, "big") & MASK)
    return out


def _msgpack():
    try:
        import msgpack
    except ImportError as e:  # pragma: no cover - setup installs it
        raise ImportError("kvforge.kv_events needs msgpack: pip install -r tools/requirements.txt") from e
    return msgpack


def _kind(event: dict) -> str:
    kind = event.get("type")
    if kind not in FIELDS:
        raise ValueError(f"event type {kind!r}: allowed {', '.join(FIELDS)}")
    return kind


def _as_array(event: dict) -> list:
    kind = _kind(event)
    values = [event.get(name) for name, _ in FIELDS[kind]]
    while values and FIELDS[kind][len(values) - 1][1] and values[-1] is None:
        values.pop()
    return [kind] + values


def _as_map(event: dict) -> dict:
    kind = _kind(event)
    out = {"type": kind}
    for name, has_default in FIELDS[kind]:
        if not (has_default and event.get(name) is None):
            out[name] = event.get(name)
    return out


FORMS = {"map": _as_map, "array": _as_array}


def encode(events: Iterable[dict], ts: Optional[float] = None, data_parallel_rank: Optional[int] = None,
           form: str = "map") -> bytes:
    """One batch of events (``take_kv_events()``'s dictionaries) as vLLM's ``KVEventBatch`` in msgpack,
    each event a tagged map (``form="map"``, today's vLLM) or a positional array (``form="array"``)."""
    if form not in FORMS:
        raise ValueError(f"form: {form!r} is not a wire form (allowed: {', '.join(FORMS)})")
    batch = [time.time() if ts is None else float(ts), [FORMS[form](e) for e in events]]
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
        if isinstance(item, dict) and item.get("type") in FIELDS:
            event = {name: None for name, _ in FIELDS[item["type"]]}
            event.update(item)  # fields kvforge does not know (a newer vLLM's) kept as they are
        elif isinstance(item, list) and item and item[0] in FIELDS:
            fields = FIELDS[item[0]]
            event = {"type": item[0]}
            for (name, _), value in zip(fields, item[1:]):
                event[name] = value
            for name, _ in fields[len(item) - 1:]:
                event[name] = None
        else:
            raise ValueError(f"not a KV event (a tagged map or array of BlockStored, BlockRemoved or "
                             f"AllBlocksCleared): {item!r:.80}")
        events.append(event)
    return float(batch[0]), events, batch[2] if len(batch) > 2 else None
