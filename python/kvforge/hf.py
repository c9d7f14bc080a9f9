"""A transformers `Cache` over any kvforge variant, so HF models generate through kvforge's layouts.

    cache = kvforge.hf.KvforgeCache("vllm_paged_nhd.tiny.fp32", model.config, batch_size=2)
    model.generate(input_ids, attention_mask=mask, max_new_tokens=20, **kvforge.hf.cache_kwarg(cache))

Row b of the batch is row b of a contiguous or ring cache, or sequence b of a paged one, whose pages a
kvforge SequenceManager (HybridSequenceManager for hybrid variants) allocates as the batch grows, and
frees as they leave a sliding window. Each layer's `update` reads the layer's cached positions back
from kvforge (dequantized, for int8 and fp8 storage), appends the new tokens, and returns
[batch, heads, cached + new, head_dim] as transformers' own DynamicCache does: every position for a
full-attention layer, and the last `sliding_window - 1` cached positions plus the new ones for a
sliding layer. The new tokens join the returned keys and values as computed; they are read back from
the cache from the next step on. With kvforge's own attention (use_kvforge_attention(model), or
attn_implementation="kvforge"; kvforge._hf_attention), the update appends and gathers nothing, and the
attention reads every layout where it lies (Cache.attend, docs/attention.md).

Hybrid models (transformers' `linear_attention` and `conv` layer types: Qwen3-Next's gated delta net,
Mamba-2 in Bamba, Jamba or Nemotron-H, LFM2's short convolutions) keep each linear layer's conv and
recurrent states in kvforge.StatePool slots, one per sequence, which the model updates in place; the
variant then holds the attention layers only (kvforge.jit.model_spec counts them).

MLA models (DeepSeek-V2/V3, Kimi, GLM-4-MoE-Lite, ...) pass their cache the latent (kv_nope, k_rot), which
the variant of a model spec's `mla` holds as one record a token; DeepSeek sparse attention's
`indexed_attention` layers add an index key a token, held in a companion cache over the same pages.

The variant must match the model: layers, key/value heads and head_dim of the config (and v_head_dim, where
V is another width than K: MiMo-V2-Flash), or its MLA record. Sequences are
all in step (HF pads a batch to one length); `KvforgeCache.sequence_manager` exposes the manager for
prefix sharing and forks outside `generate`.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvforge._hf_attention import ATTENTION, kvforge_attention, note_update, use_kvforge_attention  # noqa: F401
from kvforge._hf_indexer import INDEX_KEY_FORMS, index_variant, update_indexer
from kvforge._hf_compat import DummyLayer, cache_kwarg  # noqa: F401  (cache_kwarg: kvforge.hf's, for callers)
from kvforge._hf_states import KvforgeStateLayer, States, probe, probe_kv_heads, probe_record  # noqa: F401

import kvforge
import kvforge.jit
from kvforge.torch_dtypes import TORCH_DTYPES



class KvforgeLayer(CacheLayerMixin):
    """One model layer's view of a KvforgeCache (transformers' per-layer cache interface)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, owner, layer_idx, sliding_window=None):
        super().__init__()
        self.owner, self.layer_idx, self.sliding_window = owner, layer_idx, sliding_window
        self.is_sliding = sliding_window is not None

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner._update(self, key_states, value_states)

    def visible_from(self, cached):
        """The first cached position the next query still sees (transformers' sliding rule)."""
        return max(cached - self.sliding_window + 1, 0) if self.is_sliding else 0

    def update_indexer(self, indexer_key_states, *args, **kwargs):
        """DeepSeek sparse attention's index keys [batch, new, index_head_dim] -> [batch, cached + new, ...]."""
        return update_indexer(self.owner, self, indexer_key_states)

    def get_mask_sizes(self, query_length):
        cached = self.owner.past_length()
        offset = self.visible_from(cached)
        return cached - offset + query_length, offset

    def get_seq_length(self):
        return self.owner.past_length()

    def get_max_length(self):
        return self.sliding_window if self.is_sliding else -1

    def reset(self):
        pass  # KvforgeCache.reset resets the kvforge cache and its sequences once for every layer


class KvforgeCache(Cache):
    """transformers' Cache over a kvforge variant (a name, layout.model.dtype, of kvforge.variants()).

    config: the model's config. batch_size: the rows of a contiguous or ring cache, and the sequences
    `generate` serves by default (ids 0 .. batch_size - 1). pages: a paged cache's pool (default: every
    one of batch_size sequences can reach the variant's max_seq_len). prefix_caching: paged variants
    share the full pages of prompts added with `add` (token ids known). tensor_scales: per_tensor
    quantized variants, and tensor-scaled ones (NVFP4's second level), {layer: (k_scale, v_scale)}; a
    layer without one is calibrated on its first tokens as vLLM does, to twice their amax over the
    format's largest code (times e4m3's largest value under e4m3 group scales: headroom for later
    tokens; larger values saturate). device: where the kvforge cache lives.

    A hybrid model's linear layers (_hf_states.py): state_slots, the sequences that hold states at once
    (default: batch_size; without prefix caching, sequence s holds slot s). state_record: the states of
    one linear layer, [(name, shape, dtype)], as from_model probes it; with it, and prefix_caching, a
    prompt's cached prefix is shared up to its longest boundary of checkpoint_every blocks whose state
    was checkpointed (state_checkpoints records, default one per such boundary of the pool).
    states_in_pages: the states lie in the paged cache's own pages, one page a sequence from the same
    free list as K/V (StatePool.in_pages_of; the record must be known, and sequences start with add()).
    index_keys: how DeepSeek sparse attention's index keys are kept: None, in the cache's input dtype; or
    "fp8", as vLLM and SGLang keep them (storage `indexer_fp8` in `vllm_indexer`'s pages of 64: e4m3 codes
    and a power-of-two fp32 scale per 128 values), over a variant of pages of 64 (`flashmla_paged`).

    Beyond `generate`, a paged cache serves sequences over one pool at different times (continuous
    batching): `add(seq, prompt)` returns how many prompt tokens the prefix cache already holds,
    `extend(seq, tokens)` registers the tokens the next forward feeds, `fork(parent, child)` shares
    every page, `free(seq)` gives them back, and `serve(seqs)` names the sequences of the next
    forward's batch rows, which must all hold the same number of tokens.
    """

    def __init__(self, variant, config, batch_size=1, pages=None, prefix_caching=False, tensor_scales=None,
                 device="cpu", state_slots=None, state_record=None, checkpoint_every=4, state_checkpoints=None,
                 kv_heads_per_layer=None, states_in_pages=False, index_keys=None):
        d = kvforge.describe(variant)
        if index_keys not in INDEX_KEY_FORMS:
            raise kvforge.ArgumentError(f"index_keys: {index_keys!r} (allowed: {', '.join(map(repr, INDEX_KEY_FORMS))})")
        self.index_keys = index_keys
        text = config.get_text_config(decoder=True)
        self._text_config = text  # its attn_implementation says, at each update, whether kvforge attends
        head_dim = kvforge.jit.head_dim_of(text)
        types = kvforge.jit.layer_types(text)
        attention = [i for i, t in enumerate(types) if t in kvforge.jit.ATTENTION_TYPES]
        mla = kvforge.jit.mla_record(text)
        widths = kvforge.jit.kv_widths(text)
        if mla or d.mla:  # an MLA model caches its latent record (kv_lora_rank, qk_rope_head_dim) a token
            what, model_shape, stored = "(layers, MLA record)", (len(attention), mla), (d.layers, d.mla)
        else:
            model_heads, stored_heads = self._model_heads(text, attention, kv_heads_per_layer), self._variant_heads(d)
            if widths or d.kv_widths:  # each head's record: K then V of another width
                what = "(layers, kv heads, (head_dim, v_head_dim))"
                model_shape = (len(attention), model_heads, widths)
                stored = (d.layers, stored_heads, d.kv_widths)
            else:
                what = "(layers, kv heads, head_dim)"
                model_shape, stored = (len(attention), model_heads, head_dim), (d.layers, stored_heads, d.head_dim)
        if model_shape != stored:
            note = " (its attention layers)" if len(attention) < len(types) else ""
            if kv_heads_per_layer is None and isinstance(stored[1], list):
                note += "; give kv_heads_per_layer= where the config does not say each layer's heads"
            raise kvforge.ArgumentError(f"variant: {variant} stores {what} = {stored}, the model has {model_shape}"
                                        f"{note}")
        self.descriptor, self.rows = d, batch_size  # (Cache.batch_size is a read-only property)
        self.dtype = TORCH_DTYPES[d.input]
        windows = [getattr(text, "sliding_window", None) if types[i] == "sliding_attention" else None
                   for i in attention]
        if d.addressing == "ring" and any(w is None or w > d.window for w in windows):
            raise kvforge.ArgumentError(f"variant: {variant} keeps a window of {d.window} positions; every layer of "
                                        f"the model must attend within it (sliding windows: {windows})")
        # DeepSeek sparse attention's indexer caches a key a token beside the attention's record: a companion
        # cache over the same pages, so the sequence manager's pages serve both.
        self.index_width = kvforge.jit.index_key_width(text)
        if d.paged:
            # A hybrid variant's members each have this many pages, at their own page sizes.
            page_size = min(g["page_size"] for g in d.groups) if d.hybrid else d.page_size
            pages = pages or batch_size * -(-d.max_seq_len // page_size)
            self.kv = kvforge.create(variant, pages=pages, device=device, companion=index_variant(self, d))
            if d.hybrid:
                # A layer whose group keeps a window must attend within it.
                for layer, w in enumerate(windows):
                    kept = d.groups[self.kv.group_of(layer)]["sliding_window"]
                    if kept and (w is None or w > kept):
                        raise kvforge.ArgumentError(
                            f"variant: {variant} keeps the last {kept} positions of layer {layer}; the model's layer "
                            f"attends to {'every position' if w is None else f'{w} positions'}")
                self.sequence_manager = kvforge.HybridSequenceManager(self.kv, prefix_caching=prefix_caching)
            else:
                # A model whose every layer slides frees the pages that leave the window.
                window = windows[0] if len(set(windows)) == 1 and windows[0] is not None else 0
                self.sequence_manager = kvforge.SequenceManager(self.kv, prefix_caching=prefix_caching, window=window)
        else:
            if self.index_width:
                raise kvforge.UnsupportedError(f"variant: {variant} is {d.addressing}; the model's indexer keys share "
                                               f"a paged variant's pages (choose a paged layout)")
            self.kv = kvforge.create(variant, rows=batch_size, device=device,
                                     max_staged_tokens=batch_size * d.max_seq_len if d.lazy else 0)
            self.sequence_manager = None
        # Every index array a kernel reads is made on the cache's device, once a forward (DESIGN.md §14).
        self.device = torch.device(device)
        self.lengths = {}   # sequence -> tokens its K/V hold in every layer
        self.pending = {}   # sequence -> tokens registered for the next forward (paged)
        self.active = list(range(batch_size))
        self._slots = None  # per layer group: this forward's append slots, sequence by sequence
        self._page_tables = None  # per layer group: this forward's [batch, pages] page lists (paged)
        self._row_targets = None  # (rows, positions) of this forward's tokens (contiguous and ring)
        self._forward = None  # (cached, new) positions of the forward under way
        self._attend_batch = None  # ((new, window, group), attend's arrays) of the forward under way
        self.tensor_scales = dict(tensor_scales or {})
        for layer, (k_scale, v_scale) in self.tensor_scales.items():
            self.kv.set_tensor_scale(layer, k_scale, v_scale)
        # A hybrid model's linear-attention and state-space layers keep a state per sequence, in
        # kvforge.StatePool slots (_hf_states.py).
        self.state_device = device
        kv_layer = {model_layer: i for i, model_layer in enumerate(attention)}
        layers = [KvforgeLayer(self, kv_layer[i], windows[kv_layer[i]]) if i in kv_layer else
                  KvforgeStateLayer(self, **kwargs) if types[i] in kvforge.jit.STATE_TYPES else DummyLayer()
                  for i, kwargs in enumerate(self._state_kwargs(text, types))]
        self.state_layers = [layer for layer in layers if isinstance(layer, KvforgeStateLayer)]
        self.states = None
        linear = [i for i, t in enumerate(types) if t in kvforge.jit.STATE_TYPES]
        if d.linear_layers and d.linear_layers != linear:
            raise kvforge.ArgumentError(f"variant: {variant}'s model keeps states in layers {d.linear_layers}, the "
                                        f"model's linear layers are {linear}")
        state_record = state_record or d.state_parts or None  # the spec's record, where its model names one
        if self.state_layers:
            if prefix_caching and not d.paged:
                raise kvforge.UnsupportedError(f"prefix_caching: {variant} is not paged")
            checkpoints = state_checkpoints if state_checkpoints is not None else \
                max(pages // max(checkpoint_every, 1), 1) if prefix_caching else 0
            if states_in_pages and not d.paged:
                raise kvforge.UnsupportedError(f"states_in_pages: {variant} is not paged")
            self.states = States(self, self.state_layers, state_slots or batch_size, state_record, prefix_caching,
                                 checkpoint_every, checkpoints, states_in_pages)
        self.kv_layers = len(attention)
        super().__init__(layers=layers)

    @staticmethod
    def _model_heads(text, attention, per_layer):
        """The model's KV heads: one count, or a list over its attention layers where they differ."""
        heads = [per_layer[i] for i in attention] if per_layer is not None else [text.num_key_value_heads]
        return heads[0] if len(set(heads)) == 1 else heads

    @staticmethod
    def _variant_heads(d):
        """The variant's KV heads: one count, or a list over its layers where its groups' differ."""
        if not d.hybrid or len({g["heads"] for g in d.groups}) == 1:
            return d.groups[0]["heads"] if d.hybrid else d.heads
        heads = [0] * d.layers
        for g in d.groups:
            for layer in g["layers"]:
                heads[layer] = g["heads"]
        return heads

    @classmethod
    def from_model(cls, model, layout="vllm_paged_nhd", dtype=None, input=None, max_seq_len=None, **kwargs):
        """A cache for `model` over `layout`, its variant built on demand from the model's config (kvforge.variant):
        any layers, KV heads, head_dim and sliding window, with no spec file and no rebuild. One token
        through transformers' DynamicCache first says each layer's KV heads; where they differ between
        layers (MiMo-V2-Flash), each group of layers gets a member cache of `layout` with its heads.

        layout: a default layout's name, a spec file's path or a dict (a ring layout keeps the model's window).
        dtype: the storage dtype (default: the model's). input: the dtype the cache appends and gathers
        (default: the model's; another is refused, naming both, since the model's attention would get
        keys and values of another dtype than its queries). max_seq_len: positions a sequence may reach
        (default: the config's max_position_embeddings). The other arguments are KvforgeCache's.
        """
        model_dtype = next(model.parameters()).dtype
        names = {v: k for k, v in TORCH_DTYPES.items()}
        if model_dtype not in names:
            raise kvforge.DtypeError(f"model: its dtype {model_dtype} is none kvforge appends "
                                     f"(allowed: {', '.join(str(t) for t in names)})")
        own = names[model_dtype]
        if input is not None and input != own:
            raise kvforge.DtypeError(f"input: the cache would append and gather {input}, the model computes in {own}; "
                                     f"give input={own!r} (or none) and choose the storage with dtype=")
        probed = probe(model)  # one token through DynamicCache: each layer's heads, a hybrid's state record
        heads = probe_kv_heads(probed)
        spec = kvforge.jit.model_spec(model.config, max_seq_len=max_seq_len, kv_heads_per_layer=heads)
        if any("kv_heads" in g for g in spec.get("layer_groups", ())):
            layout = kvforge.jit.by_group(layout, spec["layer_groups"])  # a member cache per group's heads
        d = kvforge.variant(layout, spec, dtype or own, own if (dtype or own) != own else None)
        text = model.config.get_text_config(decoder=True)
        if any(t in kvforge.jit.STATE_TYPES for t in kvforge.jit.layer_types(text)) and "state_record" not in kwargs:
            kwargs["state_record"] = probe_record(model, probed)
        kwargs.setdefault("kv_heads_per_layer", heads)
        return cls(d.name, model.config, **kwargs)

    @staticmethod
    def _state_kwargs(text, types):
        """Each layer's arguments for its state layer: how many conv and recurrent states it keeps."""
        return [{"number_of_states": getattr(text, "number_of_conv_states", 1)} for _ in types]

    # -- sequences ---------------------------------------------------------------------------------

    def _paged_only(self, what):
        if self.sequence_manager is None:
            raise kvforge.UnsupportedError(f"{what}: {self.descriptor.name} is not paged; its sequences are its rows")

    def add(self, seq, prompt):
        """Starts `seq` with prompt token ids; returns how many the prefix cache covers. Feed the rest."""
        self._paged_only("add")
        covered = self.states.add(seq, prompt) if self.states else self.sequence_manager.add(seq, list(prompt))
        self.lengths[seq], self.pending[seq] = covered, len(prompt) - covered
        return covered

    def extend(self, seq, tokens):
        """Registers the token ids the next forward feeds for `seq` (else placeholders are registered)."""
        self._paged_only("extend")
        if self.states:
            self.states.before_extend(seq)  # the state stands at the sequence's length: a boundary is kept
        self.sequence_manager.append(seq, list(tokens))
        self.pending[seq] += len(tokens)

    def fork(self, parent, child):
        """`child` continues from `parent`'s tokens: it shares every page, and gets a copy of each state."""
        self._paged_only("fork")
        if self.states:
            self.states.fork(parent, child)
        else:
            self.sequence_manager.fork(parent, child)
        self.lengths[child], self.pending[child] = self.lengths[parent], 0

    def free(self, seq):
        self._paged_only("free")
        if self.states:
            self.states.free(seq)
        else:
            self.sequence_manager.free(seq)
        del self.lengths[seq], self.pending[seq]

    def serve(self, seqs):
        """The sequences the next forward's batch rows are, in order; all must hold the same length."""
        seqs = list(seqs)
        held = {self.lengths.get(s, 0) for s in seqs}
        if len(held) > 1:
            raise kvforge.ArgumentError(f"seqs: a forward serves sequences of one length; these hold {sorted(held)}")
        if self.sequence_manager is None and any(not 0 <= s < self.rows for s in seqs):
            raise kvforge.OutOfRangeError(f"seqs: a row of this cache lies in [0, {self.rows})")
        previous, self.active = self.active, seqs
        if self.states:
            try:
                self.states.served()
            except kvforge.Error:
                self.active = previous
                raise
            self.states.bind()

    def sync_states(self):
        """Makes the state pools hold every state. A batch whose state slots are not consecutive is served
        from a gathered copy of its rows, which goes back to the slots at serve(), add(), extend(), fork()
        and free(); call this before reading the pools directly between those."""
        if self.states:
            self.states.sync()

    def past_length(self):
        return self.lengths.get(self.active[0], 0) if self.active else 0

    # -- one forward -------------------------------------------------------------------------------

    def _begin_step(self, new_tokens):
        """Registers the new tokens of every served sequence and takes their slots (paged variants)."""
        manager = self.sequence_manager
        for seq in self.active:
            if seq not in self.lengths:
                manager.add(seq, [0] * new_tokens)  # placeholder ids: only prefix hashing reads them
                self.lengths[seq], self.pending[seq] = 0, new_tokens
            elif self.pending[seq] == 0:
                manager.append(seq, [0] * new_tokens)
                self.pending[seq] = new_tokens
            if self.pending[seq] != new_tokens:
                raise kvforge.ArgumentError(f"seqs: sequence {seq} registered {self.pending[seq]} new tokens, "
                                            f"the forward feeds {new_tokens}")
        steps = manager.step(self.active)
        steps = steps if isinstance(steps, list) else [steps]
        self._slots = [torch.as_tensor(s["slots"], device=self.device) for s in steps]
        self._page_tables = [torch.as_tensor(s["page_table"], device=self.device) for s in steps]

    def attends(self):
        """Whether the model's attention is kvforge's (ATTENTION): updates then append and never gather."""
        return getattr(self._text_config, "_attn_implementation", None) == ATTENTION

    def _update(self, layer, key_states, value_states):
        """key_states, value_states: [batch, heads, new, head_dim] -> the same over visible + new positions.
        An MLA model's: its latent kv_nope [batch, 1, new, kv_lora_rank] and k_rot [batch, 1, new,
        qk_rope_head_dim], one record a token, which the cache holds as K then V of its one head. A model
        whose V is another width than K (v_head_dim) is held so too, a record of K then V a head."""
        if self.attends():
            if self.descriptor.mla:
                raise kvforge.UnsupportedError(
                    "attn_implementation: transformers' MLA attention decompresses the latent per head, and kvforge "
                    "attends the latent itself (Cache.attend's absorbed form); give the model attn_implementation='sdpa'")
            note_update(self, layer)
        if not (self.descriptor.mla or self.descriptor.kv_widths):
            return self._update_kv(layer, key_states, value_states,
                                   lambda shape, like: (like.new_empty(shape), like.new_empty(shape)))
        width, whole_width = key_states.shape[-1], key_states.shape[-1] + value_states.shape[-1]
        record = []

        def halves(shape, like):  # both halves of one [batch, heads, positions, record] tensor, to return whole
            record.append(like.new_empty(*shape[:-1], 2 * shape[-1]))
            return record[0].chunk(2, dim=-1)

        # A record of odd width is stored with a zero after it (the spec's head_dim is half of one more).
        joined = torch.nn.functional.pad(torch.cat([key_states, value_states], dim=-1), (0, whole_width % 2))
        self._update_kv(layer, *joined.chunk(2, dim=-1), halves)
        if self.attends():
            return key_states, value_states
        whole = record[0].to(key_states.dtype)
        return whole[..., :width], whole[..., width:whole_width]

    def _update_kv(self, layer, key_states, value_states, outputs):
        """The update of K and V [batch, heads, new, head_dim] into `outputs(shape, like)`'s two tensors,
        which it returns in the model's dtype."""
        d, index = self.descriptor, layer.layer_idx
        batch, heads, new, head_dim = key_states.shape
        if batch != len(self.active):
            raise kvforge.ShapeError(f"key_states: batch of {batch} rows, the cache serves {len(self.active)} "
                                     f"sequences (serve() names them)")
        # The model's own dtype comes back, whatever the variant's input dtype: its attention takes query,
        # keys and values of one dtype.
        model_dtype = key_states.dtype
        key_states, value_states = key_states.to(self.dtype), value_states.to(self.dtype)
        if d.paged and index == 0:
            self._begin_step(new)
        if index == 0:
            self._attend_batch = None
        if (d.quant == "per_tensor" or d.tensor_scaled) and index not in self.tensor_scales:
            self._calibrate(index, key_states, value_states)
        end = self.past_length()
        begin = layer.visible_from(end)
        self._forward = (end, new)  # the positions the layer's indexer keys take (kvforge._hf_indexer.update_indexer)
        attends = self.attends()  # the model attends through kvforge: nothing to gather
        keys, values = (None, None) if attends else outputs((batch, heads, end - begin + new, head_dim), key_states)
        group = self.kv.group_of(index) if d.paged else 0
        # The whole batch in one call each way: the cached positions straight into their part of the
        # result (strided output), and the new tokens, [batch * new, heads, head_dim] (a view at decode).
        if end > begin and not attends:
            if d.paged:
                self.kv.gather_batch(index, keys[:, :, :end - begin], values[:, :, :end - begin],
                                     page_table=self._page_tables[group], begin=begin, end=end)
            else:
                self.kv.gather_batch(index, keys[:, :, :end - begin], values[:, :, :end - begin], rows=self.active,
                                     begin=begin, end=end)
        k_new = key_states.transpose(1, 2).reshape(batch * new, heads, head_dim)
        v_new = value_states.transpose(1, 2).reshape(batch * new, heads, head_dim)
        if d.paged:
            self.kv.append(index, k_new, v_new, slots=self._slots[group])
        else:
            if index == 0:
                rows = torch.tensor(self.active, dtype=torch.int32, device=self.device).repeat_interleave(new)
                positions = torch.arange(end, end + new, dtype=torch.int32, device=self.device).repeat(batch)
                self._row_targets = (rows, positions)
            self.kv.append(index, k_new, v_new, rows=self._row_targets[0], positions=self._row_targets[1])
        # Staged tokens are held at a commit: once a forward, after its last attention layer, or after every
        # layer where kvforge attends next (its attention reads what the cache holds, this forward's own).
        if d.lazy and (attends or index == self.kv_layers - 1):
            self.kv.commit()
        if index == self.kv_layers - 1:  # the forward's last attention layer: its tokens are now held
            for seq in self.active:
                self.lengths[seq] = end + new
                self.pending[seq] = 0
        if attends:
            return key_states.to(model_dtype), value_states.to(model_dtype)
        keys[:, :, end - begin:] = key_states
        values[:, :, end - begin:] = value_states
        return keys.to(model_dtype), values.to(model_dtype)

    def _calibrate(self, layer, key_states, value_states):
        d = self.descriptor
        qmax = kvforge.quant_max(d.storage) * (kvforge.quant_max(d.scale_dtype) if d.tensor_scaled and
                                               d.scale_dtype == "fp8_e4m3" else 1.0)
        scale = lambda x: max(2.0 * float(x.float().abs().amax()) / qmax, 1e-12)  # noqa: E731
        self.tensor_scales[layer] = (scale(key_states), scale(value_states))
        self.kv.set_tensor_scale(layer, *self.tensor_scales[layer])

    def _range(self, layer, seq, begin, end):
        if self.descriptor.hybrid:
            return self.sequence_manager.range(layer, seq, begin, end)
        return self.sequence_manager.range(seq, begin, end)

    def reset(self):
        self.kv.reset()
        if self.sequence_manager is not None:
            for seq in list(self.lengths):
                (self.states.release if self.states else self.sequence_manager.free)(seq)
        self.lengths, self.pending = {}, {}
        self.active = list(range(self.rows))
        if self.states:
            self.states.reset()
