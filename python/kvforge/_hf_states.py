"""The state layers of kvforge.hf: transformers' LinearAttentionLayer (the cache of a hybrid model's
gated-delta-net, Mamba or short-conv layer) with its conv and recurrent states in kvforge.StatePool slots.

A sequence's states are one slot. The tensors the model reads and updates in place are views of the
served sequences' slots, [batch, *state shape], so the model's own code writes the pool and nothing is
copied per step, where the served sequences' slots are consecutive. Where they are not (a batch of any
sequence ids, or slots that StateSlots handed out), the layer holds a gathered copy of their rows, which
the model updates in place (its own kernels too). The copy goes back to the slots before anything reads
or changes them (serve, add, extend, fork, free, and KvforgeCache.sync_states() for a reader of the pool);
a change of the sequences then asks for serve() before the next forward.

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
from kvforge._hf_compat import cache_kwarg
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
        model(torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device), use_cache=True,
              **cache_kwarg(cache))
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
        self.gathered = {}  # (kind, state index) -> (pool view, slot indices, the batch's copy of their rows)

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
        view = torch.from_dlpack(pool.view(layer, name))
        slots = self.owner.states.served()
        self.gathered.pop((kind, index), None)
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return view[slots[0]:slots[0] + len(slots)]
        rows = torch.tensor(slots, dtype=torch.long, device=view.device)
        batch = view.index_select(0, rows)
        self.gathered[(kind, index)] = (view, rows, batch)
        return batch

    def write_back(self):
        """The gathered rows back into their slots."""
        for view, rows, batch in self.gathered.values():
            view.index_copy_(0, rows, batch)

    def update_conv_state(self, conv_states, state_idx=0, conv_kernel_size=None, **kwargs):
        self.owner.states.check_bound()
        return super().update_conv_state(conv_states, state_idx=state_idx, conv_kernel_size=conv_kernel_size, **kwargs)

    def update_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):
        self.owner.states.check_bound()
        return super().update_recurrent_state(recurrent_states, state_idx=state_idx, **kwargs)

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
            if held[2] != state_dtype(kind, state):  # never kept quietly at another precision than the model's
                raise kvforge.DtypeError(f"{kind}_states: the model keeps {state_dtype(kind, state)}, the state_record's "
                                         f"part {name!r} is {held[2]} (give the model's dtype, as from_model probes it)")
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
                 checkpoints=0, in_pages=False):
        self.owner, self.layers, self.slot_count, self.pools = owner, layers, slot_count, []
        self.slots = None
        self.unbound = False  # a gathered batch whose sequences changed: serve() binds again
        checkpoints = checkpoints if prefix_caching else 0
        if record and in_pages:  # the cache's own pages: StateSlots takes each sequence's from the manager
            pool = kvforge.StatePool.in_pages_of(owner.kv, parts=record, layers=len(layers), checkpoints=checkpoints)
        elif record:
            pool = kvforge.StatePool(record, layers=len(layers), slots=slot_count, device=owner.state_device,
                                     checkpoints=checkpoints, axes=owner.descriptor.state_axes)  # the layout's order
        elif prefix_caching or in_pages:
            raise kvforge.UnsupportedError(f"{'states_in_pages' if in_pages else 'prefix_caching'}: a hybrid model's "
                                           f"linear layers need one state record for that; build the cache with "
                                           f"KvforgeCache.from_model, which probes it")
        if record:
            self.pools.append(pool)
            for ordinal, layer in enumerate(layers):
                layer.share(pool, ordinal)
            if prefix_caching or in_pages:
                self.slots = kvforge.StateSlots(owner.sequence_manager, pool, checkpoint_every)

    def slot(self, seq):
        if self.slots is not None:
            try:
                return self.slots.slot(seq)
            except kvforge.StateError:
                raise kvforge.StateError(f"seq: sequence {seq} was not add()ed: with prefix caching or states in the "
                                         f"cache's pages, a hybrid model's sequences start with add(seq, prompt)") from None
        if not 0 <= seq < self.slot_count:
            raise kvforge.OutOfRangeError(f"seq = {seq} is outside [0, {self.slot_count}), the state slots of the "
                                          f"model's linear layers (state_slots=)")
        return seq

    def served(self):
        """The served sequences' slots, in the batch's order."""
        return [self.slot(s) for s in self.owner.active]

    def sync(self):
        """Gathered rows back into their slots, so that the pools hold every state (a gathered batch only)."""
        for layer in self.layers:
            layer.write_back()

    def check_bound(self):
        if self.unbound:
            raise kvforge.StateError("seqs: the served sequences changed since serve() (add, fork or free) and their "
                                     "states are a gathered copy; call serve(seqs) before the next forward")

    def _changing(self):
        """Before the sequences change: gathered rows go back to their slots, and a gathered batch needs serve()."""
        self.sync()
        self.unbound |= any(layer.gathered for layer in self.layers)

    def add(self, seq, prompt):
        """The manager's add, through StateSlots where it checkpoints; returns the covered tokens."""
        self._changing()
        if self.slots is not None:
            return self.slots.add(seq, list(prompt))
        self.slot(seq)
        covered = self.owner.sequence_manager.add(seq, list(prompt))
        self._each(lambda pool: pool.zero_slot(seq))
        return covered

    def before_extend(self, seq):
        self.sync()
        if self.slots is not None:
            self.slots.checkpoint(seq)

    def fork(self, parent, child):
        self._changing()
        if self.slots is not None:
            self.slots.checkpoint(parent)
            self.slots.fork(parent, child)
            return
        self.slot(child)
        self.owner.sequence_manager.fork(parent, child)
        self._each(lambda pool: pool.copy_slot(parent, child))

    def free(self, seq):
        self._changing()
        if self.slots is not None:
            self.slots.checkpoint(seq)
            self.slots.free(seq)
            return
        self.owner.sequence_manager.free(seq)
        self._each(lambda pool: pool.zero_slot(seq))

    def release(self, seq):
        """Frees `seq` without a checkpoint (its K/V are being reset)."""
        self._changing()
        if self.slots is not None:
            self.slots.free(seq)
        else:
            self.free(seq)

    def bind(self):
        if not self.unbound:
            self.sync()
        self.unbound = False
        for layer in self.layers:
            layer.bind()

    def reset(self):
        # A pool in the cache's pages holds no sequence now: add() zeroes or restores each one's page.
        self._each(lambda pool: None if pool.in_pages else [pool.zero_slot(s) for s in range(pool.slots)])
        gathered = any(layer.gathered for layer in self.layers)
        for layer in self.layers:
            layer.gathered.clear()
            for index in range(layer.number_of_states):
                layer.has_previous_state[index] = False
        # Without StateSlots the rows are the slots again, bound at once; with it, sequences start anew
        # through add(), and a gathered batch needs serve().
        self.unbound = False
        if self.slots is None:
            self.bind()
        else:
            self.unbound = gathered

    def _each(self, f):
        for pool in self.pools:
            f(pool)
