"""The store behind kvforge.vllm: a kvforge paged cache in host memory and the SequenceManager that
indexes its blocks by prefix hash, with the copies between it and an engine's own K/V blocks.

Nothing here imports vLLM: the engine's K/V reach it as its layer [blocks, H, E] with where each (token,
dim) of K and of V sits among a block's head's E elements (B: the engine's block size); token ranges
are multiples of B. Every copy goes through the kvforge cache's
append and gather, so any layout and storage dtype (int8, fp8, NVFP4, ...) serves, quantized on the way in
and dequantized on the way out by the variant's own kernels.

A store's sequence ids are its own: each pin (a load) or save takes a fresh one and frees it when the
engine's step is done with it, so a block stays cached, evictable by priority and age, whoever wrote it.
"""

import hashlib
import threading

import kvforge
from .errors import ArgumentError

SENTINEL = 0  # a token after a prefix, so that add()/cached_prefix() may cover the whole prefix


def salt_of(*keys):
    """A block-key salt for what else than the tokens a cached block depends on (a LoRA adapter, a
    request's cache salt): None when nothing is given."""
    keys = [str(k) for k in keys if k]
    if not keys:
        return None
    return int.from_bytes(hashlib.blake2b("\0".join(keys).encode(), digest_size=8).digest(), "little")


class Store:
    """kvforge's cache and prefix index for one engine. Thread-safe: an engine may schedule one step
    while it runs the one before.

    layout, storage: the kvforge layout (a default one's name, a spec file or a dict) and storage dtype;
    input: the engine's K/V dtype (bf16, fp16, fp32); layers, kv_heads, head_dim: the model's, as the
    engine shards it; block_size: the engine's (a multiple of the layout's page size); host_bytes: the
    store's size; disk_path, disk_blocks: an optional disk tier under it; priority: the default retention
    priority (0..100); weights_tag: names the weights (the disk tier's identity); kv_events: record them."""

    def __init__(self, *, layout, storage, input, layers, kv_heads, head_dim, block_size, host_bytes,
                 disk_path="", disk_blocks=0, priority=None, weights_tag="", kv_events=False):
        descriptor = kvforge.variant(layout, {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                                              "max_seq_len": 4096}, storage, input)
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
        self.cache = kvforge.create(descriptor.name, pages=pages)
        options = {"kv_events": bool(kv_events), "disk_path": disk_path or "", "disk_blocks": int(disk_blocks or 0),
                   "weights_tag": weights_tag}
        if priority is not None:
            options["default_priority"] = int(priority)
        self.manager = kvforge.SequenceManager(self.cache, **options)
        self.lazy = descriptor.update == "lazy"
        self._lock = threading.Lock()
        self._next_seq = 0

    def _new_seq(self):
        self._next_seq += 1
        return self._next_seq

    def bytes_per_token(self):
        return self.descriptor.bytes_per_token

    def cached(self, tokens, salt=None):
        """Tokens at the head of `tokens` the store holds, a multiple of the block size, leaving at least
        the last token to compute (an engine computes it to sample the next)."""
        with self._lock:
            hit = self.manager.cached_prefix(list(tokens), salt)
        return hit // self.block_size * self.block_size

    def pin(self, tokens, end, salt=None):
        """Holds the store's blocks of tokens [0, end) until release(): returns (seq, pages, covered),
        covered <= end being what the store still held."""
        with self._lock:
            seq = self._new_seq()
            covered = self.manager.add(seq, list(tokens[:end]) + [SENTINEL], salt)
            return seq, list(self.manager.pages(seq)), min(covered, end) // self.block_size * self.block_size

    def reserve(self, tokens, end, salt=None, priority=None):
        """Takes store pages for the blocks of tokens [0, end) it does not hold yet: returns (seq, slots,
        begin), the store's slots for tokens [begin, end) that the engine's K/V must fill, or None when
        the store holds them all or has no room (a save is best effort: a miss later, never an error)."""
        with self._lock:
            if self.manager.cached_prefix(list(tokens[:end]) + [SENTINEL], salt) >= end:
                return None
            seq = self._new_seq()
            try:
                begin = self.manager.add(seq, list(tokens[:end]), salt)
            except kvforge.CapacityError:
                return None
            if priority is not None:
                self.manager.set_retention(seq, [(0, end, int(priority))])
            slots = self.manager.step([seq])["slots"]
            return seq, slots, begin

    def release(self, seqs):
        with self._lock:
            for seq in seqs:
                self.manager.free(seq)

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

    def take_events(self):
        with self._lock:
            return self.manager.take_kv_events()

    def reset(self):
        with self._lock:
            self.manager.reset_prefix_cache()
