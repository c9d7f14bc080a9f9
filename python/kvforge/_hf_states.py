"""The state layers of kvforge.hf: transformers' LinearAttentionLayer (the cache of a hybrid model's
gated-delta-net, Mamba or short-conv layer) with its conv and recurrent states in kvforge.StatePool slots.

A sequence's states are one slot. The tensors the model reads and updates in place are views of the
served sequences' slots, [batch, *state shape], so the model's own code writes the pool and nothing is
copied per step; the served sequences' slots must be consecutive, so that they form one view.

Two ways to hold them:
  - `record` known (KvforgeCache.from_model probes the model with one token): one StatePool whose
    record is every state of a linear layer, over all linear layers. With prefix caching, StateSlots
    assigns slots and checkpoints the states at every `checkpoint_every`-th block boundary, and a
    prompt that hits the prefix cache starts from the longest checkpointed boundary (docs/memory.md,
    "State slots"). A checkpoint is taken when the sequence stands on a boundary at extend(), fork()
    or free(): prefill in chunks that end on boundaries (next_boundary()) to get one.
  - otherwise: a pool per state, made when the layer first sees it, slot s for sequence s.
"""

import torch
from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin, LinearAttentionLayer

import kvforge
from kvforge.torch_dtypes import TORCH_DTYPES

_KVFORGE_DTYPES = {t: name for name, t in TORCH_DTYPES.items()}
KINDS = ("conv", "recurrent")


def state_dtype(kind, tensor):
    if tensor.dtype not in _KVFORGE_DTYPES:
        raise kvforge.DtypeError(f"{kind}_states: {tensor.dtype} is no state dtype (allowed: fp32, fp16, bf16)")
    return _KVFORGE_DTYPES[tensor.dtype]


def probe(model):
    """transformers' own DynamicCache after one forward of one token: what each layer caches, in shapes."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device), cache=cache, use_cache=True)
    return cache


def probe_kv_heads(cache):
    """Each layer's KV heads in a probed DynamicCache (None for a layer that keeps no keys)."""
    return [None if getattr(layer, "keys", None) is None else layer.keys.shape[1] for layer in cache.layers]


def probe_record(model, cache=None):
    """The state record of the model's linear layers, from one forward of one token through transformers'
    own DynamicCache (probe(model), or `cache` from it): [(part name, shape, dtype)], or None where the
    layers' records differ."""
    cache = cache or probe(model)
    records = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            records.append([(f"{kind}{index}", tuple(state.shape[1:]), state_dtype(kind, state))
                            for kind in KINDS for index, state in sorted(getattr(layer, f"{kind}_states").items())
                            if state is not None])
    return records[0] if records and all(r == records[0] for r in records) else None


class KvforgeStateLayer(LinearAttentionLayer):
    """One linear-attention or state-space layer's view of a KvforgeCache."""

    def __init__(self, owner, number_of_states=1):
        super().__init__(number_of_states=number_of_states)
        self.owner = owner
        self.pools = {}  # (kind, state index) -> (StatePool, layer in it, part name)

    def share(self, pool, layer):
        """Holds this layer's states in `layer` of the cache's one pool."""
        for name, _, _ in pool.parts:
            kind = name.rstrip("0123456789")  # conv, conv0, conv1...: kind and state index (0 unnumbered)
            if kind not in KINDS:
                raise kvforge.ArgumentError(f"state_record: part {name!r} is no transformers state (allowed: conv<i>, "
                                            f"recurrent<i>)")
            self.pools[(kind, int(name[len(kind):] or 0))] = (pool, layer, name)

    def _served(self, kind, index):
        pool, layer, name = self.pools[(kind, index)]
        first, count = self.owner.states.served()
        return torch.from_dlpack(pool.view(layer, name))[first:first + count]

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx=0, conv_kernel_size=None):
        for kind, state in (("conv", conv_states), ("recurrent", recurrent_states)):
            if state is None:
                continue
            self.dtype, self.device = state.dtype, state.device
            shape = tuple(state.shape[1:])
            if kind == "conv":
                kernel = state.shape[-1] if conv_kernel_size is None else conv_kernel_size
                shape = (*shape[:-1], kernel)
            if (kind, state_idx) not in self.pools:
                pool = kvforge.StatePool([(kind, shape, state_dtype(kind, state))], layers=1,
                                         slots=self.owner.states.slot_count, device=self.owner.state_device)
                self.owner.states.pools.append(pool)
                self.pools[(kind, state_idx)] = (pool, 0, kind)
            pool, _, name = self.pools[(kind, state_idx)]
            held = next(part for part in pool.parts if part[0] == name)
            if held[1] != shape:
                raise kvforge.ShapeError(f"{kind}_states: the model gives {shape}, the probed record holds {held[1]}")
            if kind == "conv":
                self.conv_kernel_size[state_idx] = shape[-1]
            getattr(self, f"{kind}_states")[state_idx] = self._served(kind, state_idx)
            getattr(self, f"is_{kind}_states_initialized")[state_idx] = True

    def bind(self):
        """Points the layer at the served sequences' slots (after KvforgeCache.serve)."""
        for (kind, index) in self.pools:
            if getattr(self, f"is_{kind}_states_initialized")[index]:
                getattr(self, f"{kind}_states")[index] = self._served(kind, index)
        for index in range(self.number_of_states):
            self.has_previous_state[index] = self.owner.past_length() > 0

    def reorder_cache(self, beam_idx):
        raise kvforge.UnsupportedError("reorder_cache: kvforge.hf serves no beam search; fork sequences instead")


class States:
    """Where a KvforgeCache's linear layers keep their states, and which slot each sequence holds."""

    def __init__(self, owner, layers, slot_count, record=None, prefix_caching=False, checkpoint_every=4,
                 checkpoints=0):
        self.owner, self.layers, self.slot_count, self.pools = owner, layers, slot_count, []
        self.slots = None
        if record:
            pool = kvforge.StatePool(record, layers=len(layers), slots=slot_count, device=owner.state_device,
                                     checkpoints=checkpoints if prefix_caching else 0)
            self.pools.append(pool)
            for ordinal, layer in enumerate(layers):
                layer.share(pool, ordinal)
            if prefix_caching:
                self.slots = kvforge.StateSlots(owner.sequence_manager, pool, checkpoint_every)
        elif prefix_caching:
            raise kvforge.UnsupportedError("prefix_caching: a hybrid model's linear layers need one state record to "
                                           "checkpoint; build the cache with KvforgeCache.from_model, which probes it")

    def slot(self, seq):
        if self.slots is not None:
            try:
                return self.slots.slot(seq)
            except kvforge.StateError:
                raise kvforge.StateError(f"seq: sequence {seq} was not add()ed: with prefix caching, a hybrid model's "
                                         f"sequences start with add(seq, prompt)") from None
        if not 0 <= seq < self.slot_count:
            raise kvforge.OutOfRangeError(f"seq = {seq} is outside [0, {self.slot_count}), the state slots of the "
                                          f"model's linear layers (state_slots=)")
        return seq

    def served(self):
        """(first slot, count) of the served sequences, whose slots must be consecutive."""
        seqs = self.owner.active
        slots = [self.slot(s) for s in seqs]
        if slots != list(range(slots[0], slots[0] + len(slots))):
            raise kvforge.UnsupportedError(f"seqs: a hybrid model's forward serves sequences whose state slots are "
                                           f"consecutive, so that they form one view; {seqs} hold slots {slots}")
        return slots[0], len(slots)

    def add(self, seq, prompt):
        """The manager's add, through StateSlots where it checkpoints; returns the covered tokens."""
        if self.slots is not None:
            return self.slots.add(seq, list(prompt))
        self.slot(seq)
        covered = self.owner.sequence_manager.add(seq, list(prompt))
        self._each(lambda pool: pool.zero_slot(seq))
        return covered

    def before_extend(self, seq):
        if self.slots is not None:
            self.slots.checkpoint(seq)

    def fork(self, parent, child):
        if self.slots is not None:
            self.slots.checkpoint(parent)
            self.slots.fork(parent, child)
            return
        self.slot(child)
        self.owner.sequence_manager.fork(parent, child)
        self._each(lambda pool: pool.copy_slot(parent, child))

    def free(self, seq):
        if self.slots is not None:
            self.slots.checkpoint(seq)
            self.slots.free(seq)
            return
        self.owner.sequence_manager.free(seq)
        self._each(lambda pool: pool.zero_slot(seq))

    def release(self, seq):
        """Frees `seq` without a checkpoint (its K/V are being reset)."""
        if self.slots is not None:
            self.slots.free(seq)
        else:
            self.free(seq)

    def bind(self):
        for layer in self.layers:
            layer.bind()

    def reset(self):
        self._each(lambda pool: [pool.zero_slot(s) for s in range(pool.slots)])
        for layer in self.layers:
            for index in range(layer.number_of_states):
                layer.has_previous_state[index] = False

    def _each(self, f):
        for pool in self.pools:
            f(pool)
