"""The state layers of kvforge.hf: transformers' LinearAttentionLayer (the cache of a hybrid model's
gated-delta-net, Mamba or short-conv layer) with its conv and recurrent states in kvforge.StatePool slots.

Slot s holds sequence s's state. The tensors the model reads and updates in place are views of the
served sequences' slots, [batch, *state shape], so the model's own code (torch, or its kernels) writes
the pool; nothing is copied per step. A pool is made per state when the layer first sees it, with that
state's shape and dtype, so any model's states fit. The served sequences must be consecutive ids, so
that their slots form one view.
"""

import torch
from transformers.cache_utils import LinearAttentionLayer

import kvforge
from kvforge.torch_dtypes import TORCH_DTYPES

_KVFORGE_DTYPES = {t: name for name, t in TORCH_DTYPES.items()}


class KvforgeStateLayer(LinearAttentionLayer):
    """One linear-attention or state-space layer's view of a KvforgeCache."""

    def __init__(self, owner, number_of_states=1):
        super().__init__(number_of_states=number_of_states)
        self.owner = owner
        self.pools = {}  # (kind, state index) -> StatePool of one part, `kind`

    def _pool(self, kind, index, state, shape):
        if state.dtype not in _KVFORGE_DTYPES:
            raise kvforge.DtypeError(f"{kind}_states: {state.dtype} is no state dtype (allowed: fp32, fp16, bf16)")
        pool = kvforge.StatePool([(kind, tuple(shape), _KVFORGE_DTYPES[state.dtype])], layers=1,
                                 slots=self.owner.state_slots, device=self.owner.state_device)
        self.pools[(kind, index)] = pool
        return self._served(pool)

    def _served(self, pool):
        """[batch, *shape]: the served sequences' slots of `pool`, a view."""
        rows = self.owner.active
        return torch.from_dlpack(pool.view(0, 0))[rows[0]:rows[0] + len(rows)]

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx=0, conv_kernel_size=None):
        if conv_states is not None:
            self.dtype, self.device = conv_states.dtype, conv_states.device
            kernel = conv_states.shape[-1] if conv_kernel_size is None else conv_kernel_size
            self.conv_kernel_size[state_idx] = kernel
            self.conv_states[state_idx] = self._pool("conv", state_idx, conv_states,
                                                     (*conv_states.shape[1:-1], kernel))
            self.is_conv_states_initialized[state_idx] = True
        if recurrent_states is not None:
            self.recurrent_states[state_idx] = self._pool("recurrent", state_idx, recurrent_states,
                                                          recurrent_states.shape[1:])
            self.is_recurrent_states_initialized[state_idx] = True

    def bind(self):
        """Points the layer at the served sequences' slots (after KvforgeCache.serve)."""
        for (kind, index), pool in self.pools.items():
            getattr(self, f"{kind}_states")[index] = self._served(pool)
        for index in range(self.number_of_states):
            self.has_previous_state[index] = self.owner.past_length() > 0

    def copy_slot(self, src, dst):
        for pool in self.pools.values():
            pool.copy_slot(src, dst)

    def zero_slot(self, slot):
        for pool in self.pools.values():
            pool.zero_slot(slot)

    def reset(self):
        for pool in self.pools.values():
            for slot in range(pool.slots):
                pool.zero_slot(slot)
        for index in range(self.number_of_states):
            self.has_previous_state[index] = False

    def reorder_cache(self, beam_idx):
        raise kvforge.UnsupportedError("reorder_cache: kvforge.hf serves no beam search; fork sequences instead")
