"""A lazy variant's commit() against what its appends staged, round after round: plain values, read back
with gather."""
import pytest
import torch
from conftest import TORCH_DTYPE, variants_where

import kvforge

TINY = variants_where(model="tiny")


@pytest.mark.parametrize("d", [d for d in TINY if d.lazy and not d.quantized and d.addressing == "contiguous"],
                         ids=lambda d: d.name)
def test_a_lazy_commit_never_writes_what_an_earlier_round_staged(d):
    # Round 1 stages 3 tokens in layer 0 and 1 in layer 1; round 2 stages 1 in layer 0, at the position
    # round 1's second token went to, and 3 in layer 1. Round 2's commit reads 3 entries of every layer:
    # layer 0's entries 1 and 2 are round 1's, and must be skipped, or position 1 gets round 1's value back.
    cache = kvforge.create(d.name, rows=1, max_seq_len=16, max_staged_tokens=4)
    dtype = TORCH_DTYPE[d.input]

    def tokens(n, value):
        return (torch.full((n, d.heads, d.head_dim), value, dtype=dtype),) * 2

    def stage(layer, positions, value):
        k, v = tokens(len(positions), value)
        cache.append(layer, k, v, rows=torch.zeros(len(positions), dtype=torch.int32),
                     positions=torch.tensor(positions, dtype=torch.int32))
    stage(0, [0, 1, 2], 1.0)
    stage(1, [0], 1.0)
    cache.commit()
    stage(0, [1], 2.0)
    stage(1, [0, 1, 2], 3.0)
    cache.commit()
    k, v = (torch.zeros(d.heads, 3, d.head_dim, dtype=dtype) for _ in range(2))
    cache.gather(0, k, v, row=0, begin=0, end=3)
    assert k[:, 0].eq(1.0).all() and k[:, 1].eq(2.0).all() and k[:, 2].eq(1.0).all()
    cache.gather(1, k, v, row=0, begin=0, end=3)
    assert k.eq(3.0).all() and v.eq(3.0).all()
