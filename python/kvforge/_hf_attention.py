"""transformers' attention over a KvforgeCache where it lies (Cache.attend, docs/attention.md): the
attention implementation "kvforge", its mask function, and one layer's call with the batch arrays a
forward builds once.

A model whose config names it (attn_implementation="kvforge", or use_kvforge_attention(model)) never
gathers a layer's history. Its layer's update appends the new tokens and returns them as they are; the
attention function, called next on the same thread, attends over the layer through kvforge. One case
reads nothing from the cache: a prompt's first chunk over a float cache that stores the model's own
dtype, whose history is the K/V in hand, bit for bit; torch's attention takes it (first_chunk_attention). Another
attn_implementation gets kvforge.hf's gather path: the update gathers every visible position for the
model's own attention.
"""

import threading

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import kvforge

ATTENTION = "kvforge"
_last_update = threading.local()  # the cache and layer whose update ran last on this thread


def note_update(cache, layer):
    """A KvforgeCache's layer has appended this forward's tokens: the attention called next reads it."""
    _last_update.cache, _last_update.layer = cache, layer


class _PaddingMask:
    """What the mask function hands the kvforge attention: the 2-D padding mask [batch, positions] (True:
    a real token; column j is position j), or no mask. The causal rule and the window are attend's own."""

    def __init__(self, mask):
        self.mask = mask


def _padding_mask(batch_size, *args, attention_mask=None, **kwargs):
    return None if attention_mask is None else _PaddingMask(attention_mask)


def kvforge_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, s_aux=None, **kwargs):
    """transformers' attention interface over a KvforgeCache: query [batch, q_heads, new, head_dim] ->
    ([batch, new, q_heads, v_head_dim], None). key and value are the new tokens the update appended."""
    cache = getattr(_last_update, "cache", None)
    _last_update.cache = None  # one attention per update: another cache's call never reads this one
    if cache is None:
        raise kvforge.StateError("attn_implementation", "'kvforge' attends over a KvforgeCache: pass one as the "
                                                        "model's cache (past_key_values)")
    layer = _last_update.layer
    if _first_chunk_in_hand(cache, key, softcap, s_aux):
        return first_chunk_attention(layer, query, key, value, attention_mask, scaling, sliding_window), None
    return attend_layer(cache, layer, query, attention_mask, scaling, sliding_window, softcap, s_aux), None


def _first_chunk_in_hand(cache, key, softcap, sinks):
    """Whether this forward's queries see only this forward's tokens (no position before it), and the
    cache stores those tokens bit for bit as the model gave them (float storage in the model's dtype): the
    K/V in hand are then exactly what Cache.attend would read, and there is nothing in the cache to read
    but them. The prompt's first chunk of a float cache, where torch's prefill attention (oneDNN's tiles)
    runs far ahead of Cache.attend's CPU prefill (bench/RESULTS.md, section 20)."""
    d = cache.descriptor
    return (cache._forward[0] == 0 and not (d.quantized or d.record_parts or d.mla or d.kv_widths)
            and d.storage == d.input and key.dtype == cache.dtype and not softcap and sinks is None)


def first_chunk_attention(layer, query, key, value, padding, scaling, sliding_window):
    """Causal attention of query [batch, q_heads, new, D] over key, value [batch, heads, new, D], the
    forward's own tokens, with attend's rules (left padding, the layer's window) -> [batch, new, q_heads, D]."""
    new = query.shape[2]
    i = torch.arange(new, device=query.device)
    visible = i[None, :] <= i[:, None]  # [new queries, new keys]
    window = layer.sliding_window or sliding_window or 0
    if window:
        visible &= i[None, :] > i[:, None] - window
    mask = visible[None, None]
    if padding is not None:
        # A pad column is seen by no query; a pad row sees itself only, so that its softmax has a term (its
        # output is never read).
        real = padding.mask.to(device=query.device, dtype=torch.bool)[:, :new]  # columns are positions
        mask = (mask & real[:, None, None, :]) | torch.eye(new, dtype=torch.bool, device=query.device)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                           enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


AttentionInterface.register(ATTENTION, kvforge_attention)
AttentionMaskInterface.register(ATTENTION, _padding_mask)


def use_kvforge_attention(model):
    """Makes `model` attend through kvforge (Cache.attend) over a KvforgeCache; returns the model."""
    model.set_attn_implementation(ATTENTION)
    return model


def attend_layer(cache, layer, query, padding, scaling, sliding_window, softcap, sinks):
    """The kvforge attention of one layer's queries [batch, q_heads, new, width] over every position its
    sequences hold (this forward's included) -> [batch, new, q_heads, v_width] in the query's dtype."""
    batch, q_heads, new, width = query.shape
    end = cache._forward[0] + new
    group = cache.kv.group_of(layer.layer_idx) if cache.descriptor.paged else 0
    key = (new, layer.sliding_window, group)  # a forward's arrays: one set a window and layer group
    if cache._attend_batch is None or cache._attend_batch[0] != key:
        cache._attend_batch = (key, _attend_arrays(cache, batch, new, end, padding, group))
    arrays = cache._attend_batch[1]
    q = query.transpose(1, 2).reshape(batch * new, q_heads, width).to(cache.dtype)
    v_width = cache.descriptor.kv_widths[1] if cache.descriptor.kv_widths else cache.descriptor.head_dim
    out = q.new_empty(batch * new, q_heads, v_width)
    # A ring holds its last `window` positions: a query sees at most those (transformers' sliding rule,
    # the key above the query's position less the window).
    window = layer.sliding_window or sliding_window or 0
    if cache.descriptor.addressing == "ring":
        window = min(window or cache.descriptor.window, cache.descriptor.window)
    cache.kv.attend(layer.layer_idx, q, out, scale=float(scaling or 0.0), window=int(window),
                    softcap=float(softcap or 0.0),
                    sinks=None if sinks is None else sinks.detach().to(device=cache.device, dtype=torch.float32),
                    **arrays)
    return out.view(batch, new, q_heads, v_width).to(query.dtype)


def _attend_arrays(cache, batch, new, end, padding, group):
    """A forward's batch for attend, on the cache's device: queries, lengths, left padding, pages or rows."""
    arrays = {
        "query_start": torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=cache.device),
        "lengths": torch.full((batch,), end, dtype=torch.int32, device=cache.device),
        "max_query_len": new, "max_kv_len": end,
    }
    if padding is not None:
        mask = padding.mask.to(torch.bool)
        first = mask.int().argmax(dim=1)  # a row's first real token
        held = mask.sum(dim=1)
        if not torch.equal(held, mask.shape[1] - first):
            raise kvforge.UnsupportedError("attention_mask: kvforge's attention takes left padding (a row's tokens "
                                           "after its pad); this mask has pad after a token")
        # The mask's columns are absolute positions (transformers passes the whole 2-D mask beside the
        # window's kv_offset): a row begins at its first real token.
        arrays["begins"] = first.to(device=cache.device, dtype=torch.int32)
    if cache.descriptor.paged:
        arrays["page_table"] = cache._page_tables[group].to(torch.int32)
    else:
        arrays["rows"] = torch.tensor(cache.active, dtype=torch.int32, device=cache.device)
    return arrays
