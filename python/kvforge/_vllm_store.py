"""The store behind kvforge.vllm: a kvforge paged cache in host memory and the SequenceManager that
indexes its blocks by prefix hash, with the copies between it and an engine's own K/V blocks.

An engine's scheduler and its workers may live in different processes, so the store is two replicas of
one SequenceManager, driven by one log of operations:
  - the scheduler's `Store(shadow=True)` decides: it answers lookups, pins what a load needs and takes
    pages for what a save will write, and logs each of those operations (take_log());
  - the worker's `Store()` holds the K/V: it replays each step's log (replay()), in order, before the
    step's copies, and so holds the same blocks in the same pages.
A SequenceManager is deterministic in the calls it is given (retention without expiry, no disk tier), so
the replicas agree; replay() checks that they do, and a divergence is a StateError, never a wrong block.
The shadow is the same layout, dtype, page size and page count over one layer and one head: its memory
is 1 / (layers x heads) of the store's.

Nothing here imports vLLM: the engine's K/V reach the store as a layer [blocks, H, E] with where each
(token, dim) of K and of V sits among a block's head's E elements (B: the engine's block size); token
ranges are multiples of B. Every copy goes through the kvforge cache's append and gather, so any layout
and storage dtype serves, quantized on the way in and dequantized on the way out by its own kernels.
"""

import hashlib
import threading

import kvforge
from .errors import ArgumentError, StateError

SENTINEL = 0  # a token after a prefix, so that add()/cached_prefix() may cover the whole prefix


def salt_of(*keys):
    """A block-key salt for what else than the tokens a cached block depends on (a LoRA adapter, a
    request's cache salt): None when nothing is given."""
    keys = [str(k) for k in keys if k]
    if not keys:
        return None
    return int.from_bytes(hashlib.blake2b("\0".join(keys).encode(), digest_size=8).digest(), "little")


class Store:
    """One replica of the store (module docstring). Thread-safe: an engine may schedule one step while
    it runs the one before.

    layout, storage: the kvforge layout (a default one's name, a spec file or a dict) and storage dtype;
    input: the engine's K/V dtype (bf16, fp16, fp32); layers, kv_heads, head_dim: the model's, as the
    engine shards it; block_size: the engine's (a multiple of the layout's page size); host_bytes: the
    store's size; priority: the default retention priority (0..100); kv_events: record them (the
    scheduler's replica); shadow: the scheduler's replica, which holds no K/V."""

    def __init__(self, *, layout, storage, input, layers, kv_heads, head_dim, block_size, host_bytes,
                 priority=None, kv_events=False, shadow=False):
        def described(layers, kv_heads):
            return kvforge.variant(layout, {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                                            "max_seq_len": 4096}, storage, input)
        descriptor = described(layers, kv_heads)
        page = descriptor.page_size
        if block_size % page:
            raise ArgumentError(f"kv_connector_extra_config.layout: {descriptor.layout}'s page of {page} tokens "
                                f"does not divide the engine's block size {block_size} (allowed: a layout whose "
                                f"page_size divides it)")
        page_bytes = descriptor.bytes_per_token * page
        pages = int(host_bytes) // page_bytes
        if pages < 2 * (block_size // page):
            raise ArgumentError(f"kv_connector_extra_config.host_bytes: {host_bytes} holds {pages} pages of "
                                f"{page_bytes} bytes (allowed: at least {2 * block_size // page * page_bytes})")
        self.descriptor = descriptor
        self.page_size = page
        self.block_size = block_size
        self.shadow = shadow
        held = described(1, 1) if shadow else descriptor
        self.cache = kvforge.create(held.name, pages=pages)
        options = {"kv_events": bool(kv_events)}
        if priority is not None:
            options["default_priority"] = int(priority)
        self.manager = kvforge.SequenceManager(self.cache, **options)
        self.lazy = descriptor.update == "lazy"
        self._lock = threading.Lock()
        self._next_seq = 0
        self._log = []

    def bytes_per_token(self):
        return self.descriptor.bytes_per_token

    # ---- the scheduler's replica: decisions, logged ----------------------------------------------------

    def cached(self, tokens, salt=None):
        """Tokens at the head of `tokens` the store holds, a multiple of the block size, leaving at least
        the last token to compute (an engine computes it to sample the next)."""
        with self._lock:
            hit = self.manager.cached_prefix(list(tokens), salt)
        return hit // self.block_size * self.block_size

    def pin(self, tokens, end, salt=None):
        """Holds the store's blocks of tokens [0, end) until free(): returns (seq, covered), covered <= end
        being what the store still holds, a multiple of the block size."""
        with self._lock:
            self._next_seq += 1
            op = ("pin", self._next_seq, list(tokens[:end]) + [SENTINEL], salt)
            covered = self._apply(op)[0]
            self._log.append(op + (covered,))
        return op[1], min(covered, end) // self.block_size * self.block_size

    def reserve(self, tokens, end, salt=None, priority=None):
        """Takes store pages for the blocks of tokens [0, end) it does not hold yet: returns (seq, begin),
        tokens [begin, end) being those the engine's K/V must fill, or None when the store holds them all
        or has no room (a save is best effort: a miss later, never an error)."""
        with self._lock:
            if self.manager.cached_prefix(list(tokens[:end]) + [SENTINEL], salt) >= end:
                return None
            self._next_seq += 1
            op = ("reserve", self._next_seq, list(tokens[:end]), salt, None if priority is None else int(priority))
            try:
                begin = self._apply(op)[0]
            except kvforge.CapacityError:  # all or nothing: nothing was taken, nothing is logged
                return None
            self._log.append(op + (begin,))
        return op[1], begin

    def free(self, seqs):
        with self._lock:
            for seq in seqs:
                self._apply(("free", seq))
                self._log.append(("free", seq))

    def reset(self):
        with self._lock:
            self._apply(("reset",))
            self._log.append(("reset",))

    def take_log(self):
        with self._lock:
            log, self._log = self._log, []
        return log

    def take_events(self):
        with self._lock:
            return self.manager.take_kv_events()

    # ---- both replicas ---------------------------------------------------------------------------------

    def _apply(self, op):
        """One logged operation on this replica's manager: (covered or begin, pages, slots) where it has them."""
        kind, m = op[0], self.manager
        if kind == "pin":
            covered = m.add(op[1], op[2], op[3])
            return covered, list(m.pages(op[1])), None
        if kind == "reserve":
            begin = m.add(op[1], op[2], op[3])
            if op[4] is not None:
                m.set_retention(op[1], [(0, len(op[2]), op[4])])
            return begin, None, m.step([op[1]])["slots"]
        if kind == "free":
            m.free(op[1])
        elif kind == "reset":
            m.reset_prefix_cache()
        return None, None, None

    def replay(self, log):
        """The worker's replica: applies the scheduler's log in order. Returns {seq: (pages, slots)} of its
        pins and reservations; a result other than the scheduler's is a StateError."""
        out = {}
        with self._lock:
            for op in log:
                if op[0] in ("pin", "reserve"):
                    head, expected = op[:-1], op[-1]
                    got, pages, slots = self._apply(head)
                    if got != expected:
                        raise StateError(f"kvforge.vllm: the worker's store replica covers {got} tokens of sequence "
                                         f"{op[1]} where the scheduler's covers {expected}: the replicas diverged")
                    out[op[1]] = (pages, slots)
                else:
                    self._apply(op)
        return out

    # ---- the worker's replica: the copies ---------------------------------------------------------------

    def save(self, layer, blocks, k_order, v_order, block_ids, first_token, slots):
        """Writes the engine's K/V of tokens [first_token, first_token + len(slots)) into the store.
        blocks: the engine's layer as [blocks, H, E], E elements a block's head; k_order, v_order: int64
        [B * D], where K[t, d] and V[t, d] of a block's head are among its E; block_ids: the engine's blocks
        holding tokens [first_token // B * B, ...), one per block; slots: the store's, int64 [T]."""
        import torch
        content = blocks[torch.as_tensor(block_ids, dtype=torch.long)]  # [n, H, E]
        n, heads = content.shape[0], content.shape[1]
        skip, count = first_token % self.block_size, len(slots)

        def tokens(order):  # [n, H, B * D] -> [n * B, H, D]: token-major, as append takes it
            return content[:, :, order].view(n, heads, self.block_size, -1).transpose(1, 2).reshape(
                n * self.block_size, heads, -1)[skip:skip + count].contiguous()
        self.cache.append(layer, tokens(k_order), tokens(v_order), slots=slots)
        if self.lazy:
            self.cache.commit()

    def load(self, layer, blocks, k_order, v_order, block_ids, pages, begin, end):
        """Reads the store's tokens [begin, end) (multiples of B) of the pinned `pages` into the engine's
        blocks `block_ids` (one per block of the range), whole: blocks, k_order, v_order as save() takes them."""
        import torch
        heads, n = blocks.shape[1], (end - begin) // self.block_size
        dim = k_order.numel() // self.block_size
        k = torch.empty((heads, end - begin, dim), dtype=blocks.dtype)
        v = torch.empty_like(k)
        self.cache.gather(layer, k, v, row=0, pages=torch.as_tensor(pages, dtype=torch.int32), begin=begin, end=end)
        content = torch.empty((n, heads, blocks.shape[2]), dtype=blocks.dtype)
        # [H, n * B, D] -> [n, H, B * D], placed where the engine's own write puts each (token, dim).
        content[:, :, k_order] = k.view(heads, n, -1).transpose(0, 1)
        content[:, :, v_order] = v.view(heads, n, -1).transpose(0, 1)
        blocks[torch.as_tensor(block_ids, dtype=torch.long)] = content.to(blocks.device)
