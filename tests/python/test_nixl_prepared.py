"""Prepared pulls over NIXL (kvforge.nixl, docs/transfer.md "Over NIXL"): a serving sender writes each
layer in the receiver's page order, and the receiver READs it straight into its pool. Checked bitwise, as
test_nixl.py checks the other paths, against nixl_peer.value:

  - every ordered pair of the tiny model's float layouts from a serving sender: prepared where the two
    pools place bytes differently, direct where alike; pages outside the request untouched;
  - tensor parallelism 1 -> 2 (the sender writes each receiver's heads);
  - into every quantized or other-dtype paged variant of the tiny model: those whose pages are each one
    block of a layer (pages mode) get whole pages that the sender's scratch cache of their own variant
    quantized, the others stage; either way the values equal bitwise what this process's own append of
    the same values gives, and pages outside the request are untouched; a shorter request after a longer
    one, through the same spare scratch, leaves its last page as a fresh pool's append would;
  - MLA records between vLLM's pages of 16 and FlashMLA's of 64, both ways;
  - a hybrid model's state slot, pulled whole in one READ, against the sender's value function, and
    refused where the two records differ;
  - placements the sender refuses (it checks what crosses processes, before taking memory for them), a
    malformed request, and a pull
    that asks for the prepared path where it cannot go, each naming the field; the sender serves on.
"""

import random

import pytest
import torch

import kvforge
import kvforge.nixl  # before NIXL itself: it sets UCX's modules for this machine

pytest.importorskip("nixl_cu13", reason="NIXL is not installed (tools/setup installs nixl-cu13)")

from kvforge import _nixl_plan as plans  # noqa: E402
from kvforge import _nixl_wire  # noqa: E402
from kvforge._nixl_plan import _describe, _same_geometry  # noqa: E402
from kvforge.nixl import Placement  # noqa: E402
from nixl_peer import rank_share, state_value, write_request  # noqa: E402
from test_nixl import (COUNT, LAYOUTS, TP, TP_PAGES, Peer, assert_holds, config_of, gathered,  # noqa: E402
                       placement_of, pool_bytes, source_of, target_of)


STATE_RECORD = [["conv", [64, 4], "bf16"], ["recurrent", [4, 8, 8], "fp32"]]
# MLA records in vLLM's pages of 16 and FlashMLA's of 64, by property; request 90 + i in layout i.
MLA = [d for d in kvforge.variants(model="tiny_mla", storage="bf16") if d.mla]
# tiny_gdn whole and its shard at degree 2, in vLLM's NHD pages (a pool of their own, vLLM's order).
GDN = {tp: f"vllm_paged_nhd.{'tiny_gdn' if tp == 1 else 'tiny_gdn_tp2'}.fp32" for tp in (1, 2)}


@pytest.fixture(scope="module")
def served():
    """A serving sender with request i in tiny layout i, and the whole tiny_tp model's request 42."""
    plan = [{"key": d.name, "variant": d.name, **config_of(d), "requests": [[i, placement_of(d, i), COUNT]]}
            for i, d in enumerate(LAYOUTS)]
    plan.append({"key": "tp1", "variant": TP[1], "pages": 8, "requests": [[42, {"pages": TP_PAGES}, COUNT]]})
    plan.append({"key": "states", "states": {"record": STATE_RECORD, "layers": 3, "slots": 4}})
    # tiny_gdn's state whole, and as its two ranks at degree 2.
    plan.append({"key": "gdn", "states": {"variant": GDN[1], "rank": 0, "slots": 2}})
    plan += [{"key": f"gdn_r{r}", "states": {"variant": GDN[2], "rank": r, "slots": 2}} for r in range(2)]
    plan += [{"key": d.name, "variant": d.name, **config_of(d), "requests": [[90 + i, placement_of(d, 90 + i), COUNT]]}
             for i, d in enumerate(MLA)]
    peer = Peer("s0", plan, "serve")
    peer.bytes = peer.metadata()
    agent = kvforge.nixl.Agent("decode_prepared")
    agent.connect(peer.bytes)
    yield agent, peer
    agent.close()
    peer.stop()


def unit_views(cache):
    """Each layer's K and V, [rows or pages, positions or slots, heads, head_dim], copied."""
    return [[torch.from_dlpack(cache.view(layer)[side]).clone() for side in ("k", "v")]
            for layer in range(cache.descriptor.layers)]


def others_unchanged(cache, before, target):
    """Every row or page but the request's holds the bytes it held before the pull."""
    units = target.pages.tolist() if target.pages is not None else [target.row]
    for was, now in zip(before, unit_views(cache)):
        for a, b in zip(was, now):
            keep = sorted(set(range(a.shape[0])) - set(units))
            if not torch.equal(a[keep], b[keep]):
                return False
    return True


def test_every_ordered_pair_of_float_layouts_from_a_serving_sender(served):
    agent, _ = served
    seen = set()
    for target in LAYOUTS:
        cache = kvforge.create(target.name, **config_of(target))
        agent.register(target.name, cache)
        mine = agent._caches[target.name][1]
        for index, source in enumerate(LAYOUTS):
            cache.reset()
            for layer in range(target.layers):  # bytes a pull must leave alone, in every page
                torch.from_dlpack(cache.view(layer)["k"]).fill_(3)
                torch.from_dlpack(cache.view(layer)["v"]).fill_(-3)
            before = unit_views(cache)
            report = agent.pull([("s0", source.name)], target.name, COUNT, source_of(source, index), target_of(target), unchecked=True)
            alike = _same_geometry(mine, [agent._peers["s0"][source.name]])
            assert report["how"] == ("direct" if alike else "prepared"), (source.name, target.name)
            assert_holds(cache, target_of(target), index)
            assert others_unchanged(cache, before, target_of(target)), f"{source.name} -> {target.name}"
            seen.add(report["how"])
    assert seen == {"direct", "prepared"}
    # FlashInfer's HND pages hold a page's K and V of every head as one block: pages in ascending order
    # make one READ descriptor per layer.
    cache = kvforge.create("flashinfer_paged_hnd.tiny.bf16", pages=8)
    agent.register("hnd_ascending", cache)
    nhd = next(i for i, d in enumerate(LAYOUTS) if d.layout == "vllm_paged_nhd")
    report = agent.pull([("s0", LAYOUTS[nhd].name)], "hnd_ascending", COUNT, source_of(LAYOUTS[nhd], nhd),
                        Placement(pages=[4, 5, 6, 7]), unchecked=True)
    assert (report["how"], report["descriptors"]) == ("prepared", cache.descriptor.layers)
    assert_holds(cache, Placement(pages=[4, 5, 6, 7]), nhd)


def test_mla_records_between_pages_of_different_sizes(served):
    agent, _ = served
    assert len({d.page_size for d in MLA}) > 1, "two MLA layouts of different page sizes"
    for target in MLA:
        cache = kvforge.create(target.name, **config_of(target))
        agent.register(f"mla_{target.name}", cache)
        for i, source in enumerate(MLA):
            cache.reset()
            report = agent.pull([("s0", source.name)], f"mla_{target.name}", COUNT, source_of(source, 90 + i),
                                target_of(target), unchecked=True)
            assert report["how"] == ("direct" if source.name == target.name else "prepared"), (source.name, target.name)
            assert_holds(cache, target_of(target), 90 + i)


def test_tensor_parallel_one_to_two(served):
    agent, peer = served
    place = Placement(pages=[3, 0, 7, 4])
    for rank in range(2):
        with kvforge.nixl.Agent(f"decode_prepared_{rank}") as receiver:
            receiver.connect(peer.bytes)
            cache = kvforge.create(TP[2], pages=8)
            receiver.register("kv", cache, rank=rank)
            report = receiver.pull([("s0", "tp1")], "kv", COUNT, Placement(pages=TP_PAGES), place, unchecked=True)
            assert report["how"] == "prepared"
            assert_holds(cache, place, 42, rank=rank)


def test_refusals_name_the_field_and_the_sender_serves_on(served):
    agent, _ = served
    nhd = next(i for i, d in enumerate(LAYOUTS) if d.layout == "vllm_paged_nhd")
    source = LAYOUTS[nhd]
    cache = kvforge.create("flashinfer_paged_hnd.tiny.bf16", pages=8)
    agent.register("refused", cache)
    target = Placement(pages=[0, 1, 2, 3])
    before = pool_bytes(cache)
    # A placement that does not add up, as a faulty or hostile receiver might send: the sender checks it
    # before writing, and the pull fails naming it.
    for field, value, message in (("block", 2**62, "placement: has a block outside the wire"),
                                  ("wire_bytes", 2**50, "placement: its wire is not the request's values")):
        plan = agent._plan([("s0", source.name)], "refused", COUNT, source_of(source, nhd), target, 0, True)
        if field == "block":
            plan["placement"]["block"] = plan["placement"]["block"].copy()
            plan["placement"]["block"][0] = value  # an offset whose end would wrap past 2^63
        else:
            plan["placement"][field] = value  # a ring of 2^52 bytes, were it taken
        with pytest.raises(kvforge.ArgumentError, match=message):
            kvforge.nixl.prepared_pull(agent, plan, b"").wait(10)
    # A request that is not one at all gets an answer nobody waits for, and changes nothing.
    agent._nixl.send_notif("s0", _nixl_wire.encode(b"Q", {"id": "garbage", "blocks": -1}))
    agent.register("fp32", kvforge.create("vllm_paged_nhd.tiny.fp32", pages=8))
    with pytest.raises(kvforge.UnsupportedError, match="prepared: no prepared pull: vllm_paged_nhd.tiny.fp32 does not "
                                                       "keep each page as one block"):
        agent.pull([("s0", source.name)], "fp32", COUNT, source_of(source, nhd), target, prepared=True, unchecked=True)
    with pytest.raises(kvforge.UnsupportedError, match="prepared: no prepared pull: it starts past position 0"):
        agent.pull([("s0", source.name)], "refused", COUNT - 16, source_of(source, nhd), target, begin=16,
                   prepared=True, unchecked=True)
    assert all(torch.equal(a, b) for a, b in zip(before, pool_bytes(cache))), "a refused pull wrote to the pool"
    report = agent.pull([("s0", source.name)], "refused", COUNT, source_of(source, nhd), target, unchecked=True)
    assert report["how"] == "prepared"
    assert_holds(cache, target, nhd)
    assert agent.staging_bytes == 0  # a prepared pull stages nothing on the receiving side


def test_other_dtypes_arrive_as_their_own_append_writes_them(served):
    agent, _ = served
    nhd = next(i for i, d in enumerate(LAYOUTS) if d.layout == "vllm_paged_nhd")
    source = LAYOUTS[nhd]
    targets = [d for d in kvforge.variants(model="tiny") if d.paged and not d.hybrid and d.storage != "bf16"]
    assert {plans.page_bytes(published(d)) is None for d in targets} == {True, False}, \
        "targets whose pages come whole, and targets that stage"
    def placement_for(d):
        """Pages out of order for COUNT tokens of `d`'s pages, in a pool of twice as many and more (a layout
        of small pages, a user's, takes more of them)."""
        n = -(-COUNT // d.page_size)
        pool = max(8, 2 * n + 2)
        return Placement(pages=[5, 3, 4, 0][:n] if n <= 4 else random.Random(d.name).sample(range(pool), n)), pool

    for d in targets:
        place, pool = placement_for(d)
        cache, reference = kvforge.create(d.name, pages=pool), kvforge.create(d.name, pages=pool)
        agent.register(f"dtype_{d.name}", cache)
        for layer in range(d.layers):  # bytes the pull must leave alone
            for side in ("k", "v"):
                torch.from_dlpack(cache.view(layer)[side]).view(torch.uint8).fill_(7)
        before = unit_views(cache)
        report = agent.pull([("s0", source.name)], f"dtype_{d.name}", COUNT, source_of(source, nhd), place, unchecked=True)
        whole = plans.page_bytes(agent._caches[f"dtype_{d.name}"][1]) is not None
        assert report["how"] == ("prepared" if whole else "staged"), d.name
        if whole:  # a descriptor a layer for each run of consecutive pages: [5], [3, 4], [0] of those it fills
            used = place.pages[:-(-COUNT // d.page_size)].tolist()
            runs = 1 + sum(b != a + 1 for a, b in zip(used, used[1:]))
            assert report["descriptors"] == runs * d.layers, d.name
        write_request(reference, 0, nhd, {"pages": place.pages.tolist()}, COUNT)
        for layer in range(d.layers):
            for got, want in zip(gathered(cache, layer, place), gathered(reference, layer, place)):
                assert torch.equal(got, want), f"{d.name} layer {layer}"
        assert_holds(cache, place, nhd)
        assert others_unchanged(cache, before, place), d.name
    # A shorter request after a longer one, through the same spare scratch: its last page's positions past
    # its end arrive as a fresh pool's bytes, never the former request's.
    for d in [d for d in targets if plans.page_bytes(published(d)) is not None]:
        place, pool = placement_for(d)
        cache, reference = kvforge.create(d.name, pages=pool), kvforge.create(d.name, pages=pool)
        agent.register(f"short_{d.name}", cache)
        short_pages = list(range(1, 1 + -(-5 // d.page_size)))  # 5 tokens: one page, or more of small ones
        short = Placement(pages=short_pages)
        agent.pull([("s0", source.name)], f"short_{d.name}", COUNT, source_of(source, nhd), place, unchecked=True)
        agent.pull([("s0", source.name)], f"short_{d.name}", 5, source_of(source, nhd), short, unchecked=True)
        write_request(reference, 0, nhd, {"pages": short_pages}, 5)
        size = plans.page_bytes(published(d))
        for layer in range(d.layers):
            for page in short_pages:
                got, want = (page_of(c, layer, page, size) for c in (cache, reference))
                assert torch.equal(got, want), f"{d.name} layer {layer}: page {page} is not what a fresh pool's append writes"
    # The sender checks what a receiver asks for before it takes memory: a page size it does not have.
    hnd = next(d for d in targets if plans.page_bytes(published(d)) is not None)
    place, _ = placement_for(hnd)  # its own pages, not the last loop's variant's
    plan = agent._plan([("s0", source.name)], f"dtype_{hnd.name}", COUNT, source_of(source, nhd), place, 0, True)
    plan["placement"]["page_bytes"] += 1
    with pytest.raises(kvforge.ArgumentError, match="page_bytes: .* the receiver's"):
        kvforge.nixl.prepared_pull(agent, plan, b"").wait(10)
    # A sender without the receiver's variant built: the pull stages, or refuses where it must be prepared.
    built = agent._peers["s0"][source.name]["built"]
    agent._peers["s0"][source.name]["built"] = []
    try:
        with pytest.raises(kvforge.UnsupportedError, match=f"the sender has no {hnd.name} built"):
            agent.pull([("s0", source.name)], f"dtype_{hnd.name}", COUNT, source_of(source, nhd), place, prepared=True, unchecked=True)
        assert agent.pull([("s0", source.name)], f"dtype_{hnd.name}", COUNT, source_of(source, nhd), place, unchecked=True)["how"] == "staged"
    finally:
        agent._peers["s0"][source.name]["built"] = built


def page_of(cache, layer, page, size):
    """The bytes of one page of a layer, where a page is one block of them."""
    pool = torch.from_dlpack(cache.buffers()[0]).view(torch.uint8)
    at = torch.from_dlpack(cache.view(layer)["k"]).data_ptr() - pool.data_ptr() + page * size
    return pool[at:at + size].clone()


def published(d):
    """What a receiver publishes of a cache of `d` (its axes, page stride, scales)."""
    return _describe(kvforge.create(d.name, pages=1), 0)


def test_a_state_slot_arrives_in_one_read_a_run(served):
    agent, _ = served
    pool = kvforge.StatePool([tuple(p) for p in STATE_RECORD], layers=3, slots=2)
    agent.register_states("states_here", pool)
    report = agent.pull_state(("s0", "states"), "states_here", src_slot=3, dst_slot=1)
    assert report["descriptors"] == 1 and report["bytes"] <= pool.slot_bytes
    for layer in range(3):
        for part, (name, shape, _) in enumerate(STATE_RECORD):
            view = torch.from_dlpack(pool.view(layer, name))
            assert torch.equal(view[1].float(), state_value(3, layer, part, shape)), (layer, name)
            assert not view[0].any(), "the other slot was written"
    # Into pools of vLLM's and SGLang's orders: a run a layer, or a run a part of each layer.
    for axes, runs in ((("layer", "slot", "part"), 3), (("part", "layer", "slot"), 3 * len(STATE_RECORD))):
        ordered = kvforge.StatePool([tuple(p) for p in STATE_RECORD], layers=3, slots=2, axes=axes)
        agent.register_states("by_" + axes[0], ordered)
        assert agent.pull_state(("s0", "states"), "by_" + axes[0], src_slot=2, dst_slot=0)["descriptors"] == runs
        for layer in range(3):
            for part, (name, shape, _) in enumerate(STATE_RECORD):
                view = torch.from_dlpack(ordered.view(layer, name))
                assert torch.equal(view[0].float(), state_value(2, layer, part, shape)), (axes, layer, name)
                assert not view[1].any(), "the other slot was written"
    other = kvforge.StatePool([("conv", (64, 4), "bf16")], layers=3, slots=2)
    agent.register_states("other_record", other)
    with pytest.raises(kvforge.ArgumentError, match="record: the source pool has"):
        agent.pull_state(("s0", "states"), "other_record", 0, 0)
    with pytest.raises(kvforge.OutOfRangeError, match=r"src_slot = 4 is outside \[0, 4\)"):
        agent.pull_state(("s0", "states"), "states_here", 4, 0)
    with pytest.raises(kvforge.ArgumentError, match="source: agent 's0' is not connected or registered no state pool"):
        agent.pull_state(("s0", "nothing"), "states_here", 0, 0)


def test_a_state_goes_between_tensor_parallel_groups_as_its_spec_splits_it(served):
    # Each pool holds its rank's share of the model's state (nixl_peer.rank_share: the slice of each part's
    # shard_axis); a pull assembles this rank's share from the sending group's pools, one READ a source.
    agent, _ = served

    def holds(pool, d, rank, slot, src_slot):
        return all(torch.equal(torch.from_dlpack(pool.view(layer, name))[slot], rank_share(d, rank, src_slot, layer, part))
                   for layer in range(pool.layers) for part, (name, _, _) in enumerate(pool.parts))

    whole, half = kvforge.describe(GDN[1]), kvforge.describe(GDN[2])
    assert half.state_shard_axes == [0, 0]  # the model spec splits conv channels and recurrent heads
    pool = kvforge.StatePool.for_variant(whole, slots=2)
    agent.register_states("gdn_whole", pool, whole)
    report = agent.pull_state([("s0", "gdn_r0"), ("s0", "gdn_r1")], "gdn_whole", src_slot=1, dst_slot=0)
    assert report["reads"] == 2 and holds(pool, whole, 0, 0, 1)
    assert not torch.from_dlpack(pool.view(2, "recurrent"))[1].any(), "the other slot was written"
    for rank in range(2):  # 1 -> 2: each rank its half, from the one whole pool
        shard = kvforge.StatePool.for_variant(half, slots=2)
        agent.register_states(f"gdn_half{rank}", shard, half, rank)
        assert agent.pull_state([("s0", "gdn")], f"gdn_half{rank}", 0, 1)["reads"] == 1
        assert holds(shard, half, rank, 1, 0), rank
    with pytest.raises(kvforge.ArgumentError, match=r"sources: 1 given, but sources\[0\] .* degree 2"):
        agent.pull_state([("s0", "gdn_r0")], "gdn_whole", 0, 0)
    with pytest.raises(kvforge.ArgumentError, match=r"sources\[0\]: that pool is rank 1"):
        agent.pull_state([("s0", "gdn_r1"), ("s0", "gdn_r0")], "gdn_whole", 0, 0)
    with pytest.raises(kvforge.ArgumentError, match="key: 'states_plain' was registered without its descriptor"):
        agent.register_states("states_plain", kvforge.StatePool.for_variant(whole, slots=1))
        agent.pull_state([("s0", "gdn_r0"), ("s0", "gdn_r1")], "states_plain", 0, 0)
    with pytest.raises(kvforge.ArgumentError, match=r"pool: its record is not vllm_paged_nhd.tiny_gdn.fp32's"):
        agent.register_states("wrong", kvforge.StatePool([("conv", (64, 4), "fp32")], layers=3, slots=1), whole)
    with pytest.raises(kvforge.OutOfRangeError, match=r"sender = 2 is outside \[0, 2\)"):
        kvforge.state_rows(half, 2, 1, 2, 0)
    with pytest.raises(kvforge.OutOfRangeError, match=r"rank = 2 is outside \[0, 2\)"):
        agent.register_states("far", kvforge.StatePool.for_variant(half, slots=1), half, 2)
