"""kvforge.vllm's store without vLLM: the scheduler's shadow decides and logs, the worker's replica replays
the log into the same pages (and refuses a log it cannot follow), and the copies between an engine's
blocks and the store put every (token, dim) back where the engine's own placement says, checked by plain
loops over logical coordinates."""
import pytest
import torch

import kvforge
from kvforge._vllm_store import Store

BLOCK = 32
DIMS = dict(layout="vllm_paged_nhd", storage="bf16", input="bf16", layers=2, kv_heads=2, head_dim=16,
            block_size=BLOCK, host_bytes=64 * BLOCK * 2 * 2 * 2 * 16 * 2)


def pair(**overrides):
    return Store(shadow=True, **dict(DIMS, **overrides)), Store(**dict(DIMS, **overrides))


def test_the_worker_replays_the_shadows_decisions_into_the_same_pages():
    shadow, worker = pair()
    assert shadow.cache.memory()["storage_bytes"] * 4 == worker.cache.memory()["storage_bytes"]  # 1 layer, 1 head
    tokens = list(range(1, 3 * BLOCK + 5))
    seq, begin = shadow.reserve(tokens, 3 * BLOCK)
    held = worker.replay(shadow.take_log())
    assert begin == 0 and len(held[seq][1]) == 3 * BLOCK
    pages = list(worker.manager.pages(seq))
    assert pages == list(shadow.manager.pages(seq))
    page = worker.page_size
    assert list(held[seq][1]) == [pages[t // page] * page + t % page for t in range(3 * BLOCK)]
    shadow.free([seq])
    pin, covered = shadow.pin(tokens, 3 * BLOCK)
    held = worker.replay(shadow.take_log())
    assert covered == 3 * BLOCK and held[pin][0] == list(shadow.manager.pages(pin))
    assert worker.cached(tokens) == shadow.cached(tokens) == 3 * BLOCK
    assert shadow.reserve(tokens, 3 * BLOCK) is None  # held already: nothing to write, nothing logged
    assert shadow.take_log() == []


def test_a_replica_that_diverged_is_refused_before_any_copy():
    shadow, worker = pair()
    tokens = list(range(7, 7 + 2 * BLOCK))
    seq, _ = shadow.reserve(tokens, 2 * BLOCK)
    worker.replay(shadow.take_log())
    shadow.free([seq])
    worker.replay(shadow.take_log())
    worker.manager.reset_prefix_cache()  # behind the shadow's back
    shadow.pin(tokens, 2 * BLOCK)
    with pytest.raises(kvforge.StateError, match="replicas diverged"):
        worker.replay(shadow.take_log())


@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_blocks_go_to_the_store_and_back_where_the_engines_placement_says(storage):
    shadow, worker = pair(storage=storage, layout="flashinfer_paged_hnd" if storage == "int8" else "vllm_paged_nhd")
    heads, dim, blocks_n = 2, 16, 6
    gen = torch.Generator().manual_seed(3)
    # An engine's placement of K[t, d] and V[t, d] among a block's head's 2 * B * D elements: any permutation.
    placement = torch.randperm(2 * BLOCK * dim, generator=gen)
    k_order, v_order = placement[:BLOCK * dim], placement[BLOCK * dim:]
    engine = torch.randn(blocks_n, heads, 2 * BLOCK * dim, generator=gen).to(torch.bfloat16)
    tokens = list(range(100, 100 + 2 * BLOCK + 3))
    seq, begin = shadow.reserve(tokens, 2 * BLOCK)
    held = worker.replay(shadow.take_log())
    for layer in range(2):
        worker.save(layer, engine, k_order, v_order, [4, 1], begin, held[seq][1])
    shadow.free([seq])
    pin, covered = shadow.pin(tokens, 2 * BLOCK)
    held = worker.replay(shadow.take_log())
    out = torch.zeros_like(engine)
    worker.load(1, out, k_order, v_order, [0, 5], held[pin][0], 0, covered)
    step = 1 / 127 if storage == "int8" else 0
    for i, (src, dst) in enumerate(((4, 0), (1, 5))):
        for h in range(heads):
            for t in range(BLOCK):
                for order in (k_order, v_order):
                    want = engine[src, h, order[t * dim:(t + 1) * dim]].float()
                    got = out[dst, h, order[t * dim:(t + 1) * dim]].float()
                    bound = want.abs().max() * step + 0.01 * want.abs().max()
                    assert (got - want).abs().max() <= bound, (i, h, t)
    assert out[[1, 2, 3, 4]].abs().sum() == 0  # no other block touched
