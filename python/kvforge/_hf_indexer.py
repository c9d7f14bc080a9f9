"""DeepSeek sparse attention's index keys beside a KvforgeCache (kvforge.hf): one record a token in a
companion cache over the main cache's pages, its variant, and each layer's update of it."""

import kvforge
import kvforge.jit

INDEX_KEY_FORMS = (None, "fp8")  # KvforgeCache's index_keys: the cache's input dtype, or vLLM's fp8 keys


def index_variant(cache, d):
    """The indexer keys' variant: one record of index_head_dim values a token held as K then V of one head,
    in the layout's pages as the cache's input dtype, or (index_keys "fp8") vLLM's fp8 keys in
    `vllm_indexer`'s; a registered variant of those dimensions, or one built on first use."""
    if not cache.index_width:
        return None
    if cache.index_width % 2 or d.hybrid:
        raise kvforge.UnsupportedError(f"config.index_head_dim: {cache.index_width} index keys over {d.name} "
                                       f"(allowed: an even width over a paged, non-hybrid layout)")
    spec = {"layers": d.layers, "kv_heads": 1, "head_dim": cache.index_width // 2, "max_seq_len": d.max_seq_len}
    layout, storage = (d.layout, d.input) if cache.index_keys is None else ("vllm_indexer", "indexer_fp8")
    if cache.index_keys == "fp8" and cache.index_width % 128:
        raise kvforge.UnsupportedError(f"index_keys: 'fp8' keys are scaled per 128 values, and the model's "
                                       f"index_head_dim is {cache.index_width} (allowed: a multiple of 128)")
    # A registered variant of these dimensions serves as it is (its pages must be the main cache's: the
    # pair refuses others, naming both); another is built on first use.
    for e in kvforge.variants(layout=layout, storage=storage, input=d.input):
        if (e.layers, e.heads, e.head_dim) == (d.layers, 1, spec["head_dim"]) and e.max_seq_len >= d.max_seq_len \
                and not (e.hybrid or e.mla or e.kv_widths or e.linear_layers or e.shard_of != e.model):
            return e.name
    spec["name"] = kvforge.jit.on_demand.named_by_content(spec, "hf_index_")
    return kvforge.variant(layout, spec, storage, d.input).name

def update_indexer(cache, layer, keys):
    """Index keys [batch, new, width] of this forward's tokens into the companion cache, at the slots the
    layer's update took; returns every position's, [batch, cached + new, width]."""
    if not cache.index_width:
        raise kvforge.UnsupportedError(f"update_indexer: {cache.descriptor.name}'s model has no indexer keys")
    batch, new, width = keys.shape
    if width != cache.index_width or batch != len(cache.active) or cache._forward is None or cache._forward[1] != new:
        raise kvforge.ShapeError(f"indexer_key_states: shape {list(keys.shape)}, expected [{len(cache.active)}, "
                                 f"{new if cache._forward is None else cache._forward[1]}, {cache.index_width}] after the "
                                 f"layer's update")
    end, index, companion = cache._forward[0], layer.layer_idx, cache.kv.companion
    held = keys.to(cache.dtype)
    out = held.new_empty(batch, end + new, width)
    # A key is one record of K then V of one head: [batch * new, 1, width / 2] halves in, and the batch's
    # [batch, 1, end + new, width / 2] halves out, each in one call.
    companion.append(index, *held.reshape(batch * new, 1, width).chunk(2, dim=-1), slots=cache._slots[0])
    companion.gather_batch(index, *out.view(batch, 1, end + new, width).chunk(2, dim=-1),
                           page_table=cache._page_tables[0], begin=0, end=end + new)
    return out.to(keys.dtype)
