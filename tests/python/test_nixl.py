"""KV transfers over NIXL (kvforge.nixl) between processes on loopback: sending processes (nixl_peer.py)
write requests through their caches' own append, this process pulls them one-sided and reads them back
through its caches' gather. Every value is checked bitwise against nixl_peer.value, a function of
(request, layer, K or V, global head, position, dim); a quantizing receiver against the documented bound.

  - every ordered pair of the tiny model's float layouts (81: NHD and HND, pages of 16 and 64, blocked,
    contiguous, stacked, lazy), and the descriptors of a pair whose bytes line up merge into one per
    layer and K or V;
  - tensor parallelism 2 -> 1, 1 -> 2 and 4 -> 2 (five processes), over one layout and across layouts;
  - bf16 -> int8 and uint4 on arrival, and bf16 -> fp32 (staged, then the cache's own append); an int8 cache's
    whole pages (codes and their scales) from another of its variant, and fp8 codes under equal
    per-tensor scales, both bitwise as this process's append; fp8 codes under another scale, and into
    a bf16 cache, decoded with the sender's scales and appended;
  - three pulls in flight at once into one cache, with no mixing;
  - refusals, each naming its field, with the target pool's bytes unchanged; and a pull abandoned on
    its timeout, after which the same pull completes whole.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import kvforge
import kvforge.nixl  # before NIXL itself: it sets UCX's modules for this machine

pytest.importorskip("nixl_cu13", reason="NIXL is not installed (tools/setup installs nixl-cu13)")

from conftest import assert_reads_back, quantization_bound, variants_where  # noqa: E402
from kvforge.nixl import Placement  # noqa: E402
from kvforge.torch_dtypes import TORCH_DTYPES  # noqa: E402
from nixl_peer import value, where, write_request  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
COUNT = 50  # positions per request: several pages of 16, within the tiny model's 64

# The tiny model's float layouts, by property: bf16, one cache object, positions that do not wrap.
LAYOUTS = [d for d in variants_where(model="tiny", storage="bf16", hybrid=False) if d.addressing != "ring"]


def pages_needed(d):
    return -(-COUNT // d.page_size)


def placement_of(d, index):
    """Where request `index` lies in a cache of `d` (sending side): its pages in descending order from the
    pool's last, so not the identity, or row index % 2."""
    last = config_of(d)["pages"] - 1 if d.paged else 0
    return {"pages": [last - i for i in range(pages_needed(d))]} if d.paged else {"row": index % 2}


def config_of(d):
    """Pools that hold a request twice over, whatever the page size (a page of 1 slot too)."""
    if d.paged:
        return {"pages": 2 * pages_needed(d) + 2}
    return {"rows": 2, "max_staged_tokens": COUNT} if d.lazy else {"rows": 2}


class Peer:
    """A sending process: its caches, its agent's metadata, and its notifications."""

    def __init__(self, name, plan, how=""):
        self.name, self.plan = name, plan
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
        self.process = subprocess.Popen([sys.executable, os.path.join(HERE, "nixl_peer.py"), name, json.dumps(plan), how],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def answer(self, tag):
        """The next line of the peer's stdout that starts with `tag` (NIXL may print lines of its own)."""
        for line in self.process.stdout:
            if line.startswith(tag + " "):
                return line[len(tag) + 1:].strip()
        raise AssertionError(f"peer {self.name} exited with {self.process.wait()}")

    def metadata(self):
        return bytes.fromhex(self.answer("metadata"))

    def notifications(self):
        self.process.stdin.write("notifications\n")
        self.process.stdin.flush()
        return json.loads(self.answer("notifications"))

    def ask(self, line, tag):
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self.answer(tag)

    def stop(self):
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
            self.process.stdin.flush()
        assert self.process.wait(timeout=30) == 0


TP = {tp: f"vllm_paged_nhd.{'tiny_tp' if tp == 1 else f'tiny_tp_tp{tp}'}.bf16" for tp in (1, 2, 4)}
TP_FP32 = {4: "deepspeed_blocked.tiny_tp_tp4.fp32", 2: "flashinfer_paged_hnd.tiny_tp_tp2.fp32"}
TP_PAGES = [5, 2, 6, 1]


# Quantized tiny variants, by property: one under static per-tensor scales (vLLM's fp8), and one whose pages
# are each one block of a layer with its scales inside (pages of more than one slot, so that a begin can
# fall inside one). Request PER_TENSOR_REQUEST / BLOCKS_REQUEST on the sender's pages SOURCE_PAGES(d).
PER_TENSOR = next(d for d in variants_where(model="tiny", hybrid=False) if d.paged and d.quant == "per_tensor")
BLOCKS = next(d for d in variants_where(model="tiny", hybrid=False)
              if d.paged and d.quantized and d.scale_placement == "in_page" and not d.lazy and d.page_size > 1
              and [a for a in d.axes if a != "layer"][0] == "page" and ("layer" not in d.axes or d.axes[0] == "layer"))


SENDER_SCALES = [0.5, 0.125]  # p0's "fp8_scaled" K and V scales, every layer


def source_pages(d):
    """The sender's pages of a request in a quantized cache of 2 x pages_needed(d) pages: the upper half,
    descending."""
    return [2 * pages_needed(d) - 1 - i for i in range(pages_needed(d))]


def peer_plans():
    """Four sending processes. p0: every tiny layout (request i in layout i), three requests in one cache,
    an int8 cache; each pN: its rank of the tp-4 groups, p0 and p1 their rank of the tp-2 group, p0 the
    whole tiny_tp model."""
    plans = {f"p{r}": [] for r in range(4)}
    for i, d in enumerate(LAYOUTS):
        plans["p0"].append({"key": d.name, "variant": d.name, **config_of(d),
                            "requests": [[i, placement_of(d, i), COUNT]]})
    plans["p0"].append({"key": "three", "variant": "vllm_paged_nhd.tiny.bf16", "pages": 12,
                        "requests": [[100 + r, {"pages": [3 * r + 2, 3 * r, 3 * r + 1, 11 - r]}, COUNT]
                                     for r in range(3)]})
    for key, d, request in (("fp8", PER_TENSOR, 11), ("quantized", BLOCKS, 7), ("fp8_scaled", PER_TENSOR, 12)):
        plans["p0"].append({"key": key, "variant": d.name, "pages": 2 * pages_needed(d),
                            "requests": [[request, {"pages": source_pages(d)}, COUNT]],
                            **({"tensor_scales": SENDER_SCALES} if key == "fp8_scaled" else {})})
    plans["p0"].append({"key": "tp1", "variant": TP[1], "pages": 8, "requests": [[42, {"pages": TP_PAGES}, COUNT]]})
    for rank in range(4):
        for key, variant in (("tp4", TP[4]), ("tp4_fp32", TP_FP32[4])):
            plans[f"p{rank}"].append({"key": key, "variant": variant, "rank": rank, "pages": 8,
                                      "requests": [[42, {"pages": TP_PAGES[:1] if "fp32" in key else TP_PAGES},
                                                    COUNT]]})
        if rank < 2:
            plans[f"p{rank}"].append({"key": "tp2", "variant": TP[2], "rank": rank, "pages": 8,
                                      "requests": [[42, {"pages": TP_PAGES}, COUNT]]})
    return plans


@pytest.fixture(scope="module")
def peers():
    started = {name: Peer(name, plan) for name, plan in peer_plans().items()}  # start together: imports overlap
    for peer in started.values():
        peer.bytes = peer.metadata()
    agent = agent_connected_to(started, "decode")
    yield agent, started
    agent.close()
    for peer in started.values():
        peer.stop()


def agent_connected_to(started, name):
    agent = kvforge.nixl.Agent(name)
    assert [agent.connect(peer.bytes) for peer in started.values()] == list(started)
    return agent


def expect(request, d, rank, layer, kv, count=COUNT):
    """[heads, positions, head_dim] that a gather of this rank's heads must give."""
    begin, end = d.shard_heads(rank)
    return value(request, layer, kv, range(begin, end), np.arange(count), d.head_dim).transpose(0, 1)


def gathered(cache, layer, placement, count=COUNT):
    d = cache.descriptor
    k, v = (torch.zeros(d.heads, count, d.head_dim, dtype=TORCH_DTYPES[d.input]) for _ in range(2))
    if placement.pages is not None:
        cache.gather(layer, k, v, pages=torch.from_numpy(placement.pages.astype(np.int32)), begin=0, end=count)
    else:
        cache.gather(layer, k, v, row=placement.row, begin=0, end=count)
    return k, v


def assert_holds(cache, placement, request, rank=0, count=COUNT):
    d = cache.descriptor
    for layer in range(d.layers):
        k, v = gathered(cache, layer, placement, count)
        want_k, want_v = (expect(request, d, rank, layer, kv, count).to(k.dtype) for kv in (0, 1))
        assert_reads_back(d, k, v, want_k.float(), want_v.float())


def target_of(d):
    """Where this process puts a pulled request: another page table than the sender's, or row 1."""
    return Placement(pages=[2 + i for i in range(pages_needed(d))]) if d.paged else Placement(row=1)


def source_of(d, index):
    p = placement_of(d, index)
    return Placement(pages=p["pages"]) if "pages" in p else Placement(row=p["row"])


def test_every_ordered_pair_of_float_layouts(peers):
    agent, _ = peers
    descriptors = {}
    for target in LAYOUTS:
        cache = kvforge.create(target.name, **config_of(target))
        agent.register(target.name, cache)
        for index, source in enumerate(LAYOUTS):
            cache.reset()
            report = agent.pull([("p0", source.name)], target.name, COUNT, source_of(source, index), target_of(target), unchecked=True)
            assert report["bytes"] == COUNT * target.bytes_per_token
            assert report["how"] == "direct" or source.layout != target.layout, "one layout on both sides: direct"
            assert_holds(cache, target_of(target), index)
            descriptors[f"{source.layout} -> {target.layout}"] = (report["how"], report["descriptors"])
    print("descriptors per pull of", COUNT, "positions:", json.dumps(descriptors, indent=1))
    # vLLM's NHD pages hold a page's positions and heads as one run: with the pages in ascending order on
    # both sides, the runs of a layer's K (or V) merge into one.
    cache = kvforge.create("vllm_paged_nhd.tiny.bf16", pages=12)
    agent.register("nhd_ascending", cache)
    pages = Placement(pages=[4, 5, 6, 7])
    report = agent.pull([("p0", "three")], "nhd_ascending", 64, pages, pages, unchecked=True)
    assert report["descriptors"] == 2 * cache.descriptor.layers


def test_tensor_parallel_groups(peers):
    agent, started = peers
    place = Placement(pages=[3, 0, 7, 4])
    # 2 -> 1: both ranks of the tp-2 group into the whole model.
    whole = kvforge.create(TP[1], pages=8)
    agent.register("tp_whole", whole)
    agent.pull([("p0", "tp2"), ("p1", "tp2")], "tp_whole", COUNT, Placement(pages=TP_PAGES), place, unchecked=True)
    assert_holds(whole, place, 42)
    # 1 -> 2 and 4 -> 2: two receiving ranks, each an agent of its own, each pulling its heads.
    # Then 4 -> 2 across layouts and page sizes: DeepSpeed's blocked pages of 64 into FlashInfer's HND of 16.
    cases = [([("p0", "tp1")], TP[2], TP_PAGES), ([(f"p{r}", "tp4") for r in range(4)], TP[2], TP_PAGES),
             ([(f"p{r}", "tp4_fp32") for r in range(4)], TP_FP32[2], TP_PAGES[:1])]
    for case, (sources, variant, source_pages) in enumerate(cases):
        for rank in range(2):
            with agent_connected_to(started, f"decode_{case}_{rank}") as receiver:
                cache = kvforge.create(variant, pages=8)
                receiver.register("kv", cache, rank=rank)
                receiver.pull(sources, "kv", COUNT, Placement(pages=source_pages), place, unchecked=True)
                assert_holds(cache, place, 42, rank=rank)


def test_another_dtype_arrives_through_the_caches_own_append(peers):
    agent, _ = peers
    source = next(i for i, d in enumerate(LAYOUTS) if d.layout == "vllm_paged_nhd")
    for variant in ("vllm_paged_nhd.tiny.fp32", "deepspeed_blocked.tiny.int8_in_bf16", "paged_zero_point.tiny.uint4_in_bf16"):
        cache = kvforge.create(variant, pages=8)
        agent.register(variant, cache)
        target = Placement(pages=[5, 3, 1, 0])
        report = agent.pull([("p0", LAYOUTS[source].name)], variant, COUNT, source_of(LAYOUTS[source], source), target, unchecked=True)
        assert report["how"] == "staged"
        assert_holds(cache, target, source)


def test_a_quantized_cache_pulls_whole_pages_from_its_own_variant(peers):
    agent, _ = peers
    d, n = BLOCKS, pages_needed(BLOCKS)  # p0's "quantized": request 7
    cache, reference = kvforge.create(d.name, pages=2 * n + 1), kvforge.create(d.name, pages=2 * n + 1)
    agent.register("same_int8", cache)
    source, target = Placement(pages=source_pages(d)), Placement(pages=[2 * n - i for i in range(n)])
    report = agent.pull([("p0", "quantized")], "same_int8", COUNT, source, target, unchecked=True)
    # Pages descending on both sides: one descriptor a page and layer.
    assert (report["how"], report["descriptors"]) == ("direct", n * d.layers)
    write_request(reference, 0, 7, {"pages": target.pages.tolist()}, COUNT)  # codes and scales as this process writes them
    for layer in range(d.layers):
        assert all(torch.equal(a, b) for a, b in zip(gathered(cache, layer, target), gathered(reference, layer, target)))
    assert_holds(cache, target, 7)
    with pytest.raises(kvforge.ArgumentError, match=f"begin: 1 is not a multiple of the page size {d.page_size}"):
        agent.pull([("p0", "quantized")], "same_int8", COUNT - 1, source, target, begin=1, unchecked=True)
    with pytest.raises(kvforge.UnsupportedError, match="a quantized source's codes go direct"):
        agent.pull([("p0", "quantized")], "same_int8", COUNT, source, target, prepared=True, unchecked=True)


def test_fp8_codes_under_equal_per_tensor_scales_go_direct(peers):
    agent, _ = peers
    d, n = PER_TENSOR, pages_needed(PER_TENSOR)  # p0's "fp8": request 11, its K and V scales 1
    cache, reference = kvforge.create(d.name, pages=2 * n), kvforge.create(d.name, pages=2 * n)
    agent.register("fp8", cache)
    source, target = Placement(pages=source_pages(d)), Placement(pages=[2 * i for i in range(n)])
    report = agent.pull([("p0", "fp8")], "fp8", COUNT, source, target, unchecked=True)
    assert report["how"] == "direct"
    write_request(reference, 0, 11, {"pages": target.pages.tolist()}, COUNT)
    for layer in range(cache.descriptor.layers):
        assert all(torch.equal(a, b) for a, b in zip(gathered(cache, layer, target), gathered(reference, layer, target)))


@pytest.mark.parametrize("through", ["scratch", "staged"])
def test_codes_under_other_scales_are_decoded_with_the_senders_and_appended(peers, monkeypatch, through):
    """p0's fp8 request 12 (K and V scales SENDER_SCALES) into a cache of its variant whose scales are 1 but
    V's of layer 1, 2, and into a bf16 cache of another layout: the codes are decoded with the sender's
    scales, in a scratch of the sender's variant (its gather) or, where none can be had, in torch from a
    staging area; the receiver's append writes them. Each holds what its append makes of the sender's
    gather, bitwise."""
    agent, _ = peers
    if through == "staged":
        monkeypatch.setattr(kvforge._nixl_staged, "scratch_plan", lambda *args: None)
    d, n = PER_TENSOR, pages_needed(PER_TENSOR)
    source = Placement(pages=source_pages(d))
    sender = kvforge.create(d.name, pages=2 * n)  # the sender's codes, decoded by its own gather
    for layer in range(d.layers):
        sender.set_tensor_scale(layer, *SENDER_SCALES)
    write_request(sender, 0, 12, {"pages": source.pages.tolist()}, COUNT)
    sent = [gathered(sender, layer, source) for layer in range(d.layers)]
    bf16 = next(t for t in LAYOUTS if t.paged and t.page_size != d.page_size)
    for name, v_scale in ((d.name, 2.0), (bf16.name, None)):
        # Sized by the receiving variant's own pages (a user's layout may hold fewer tokens a page).
        pages = 2 * max(n, pages_needed(kvforge.describe(name))) + 2
        cache, reference = (kvforge.create(name, pages=pages) for _ in range(2))
        if v_scale is not None:
            for c in (cache, reference):
                torch.from_dlpack(c.view(1)["v_scales"]).fill_(v_scale)
        agent.register(f"decoded_{through}_{name}", cache)
        t = cache.descriptor
        target = Placement(pages=[1 + 2 * i for i in range(pages_needed(t))])
        report = agent.pull([("p0", "fp8_scaled")], f"decoded_{through}_{name}", COUNT, source, target, unchecked=True)
        assert report["how"] == through, name
        positions = np.arange(COUNT)
        for layer, (k, v) in enumerate(sent):
            reference.append(layer, k.transpose(0, 1).to(TORCH_DTYPES[t.input]), v.transpose(0, 1).to(TORCH_DTYPES[t.input]),
                             **where(t, {"pages": target.pages.tolist()}, positions))
        if t.lazy:
            reference.commit()
        for layer in range(d.layers):
            got = gathered(cache, layer, target)
            assert all(torch.equal(a, b) for a, b in zip(got, gathered(reference, layer, target))), (name, layer)
            for kv in (0, 1):  # within two quantizations of the values the sender was given
                want = expect(12, t, 0, layer, kv).float()
                assert ((got[kv].float() - want).abs() <= 2 * quantization_bound(d, want)).all(), (name, layer, kv)


def test_three_pulls_in_flight_do_not_mix(peers):
    agent, started = peers
    cache = kvforge.create("flashinfer_paged_hnd.tiny.bf16", pages=12)
    agent.register("in_flight", cache)
    targets = [Placement(pages=[r, r + 3, r + 6, r + 9]) for r in range(3)]
    pulls = [agent.start_pull([("p0", "three")], "in_flight", COUNT,
                              Placement(pages=[3 * r + 2, 3 * r, 3 * r + 1, 11 - r]), targets[r],
                              notify=f"request {100 + r}".encode(), unchecked=True) for r in range(3)]
    for pull in reversed(pulls):
        pull.wait(30)
    for r in range(3):
        assert_holds(cache, targets[r], 100 + r)
    # Each completed READ notifies its sender; the messages arrive a moment after the data.
    wanted, deadline = {f"request {100 + r}" for r in range(3)}, time.monotonic() + 20
    while not wanted <= set(started["p0"].notifications().get("decode", [])):
        assert time.monotonic() < deadline, "the senders were not notified of every pull"
        time.sleep(0.05)


def pool_bytes(cache):
    return [torch.from_dlpack(b).clone() for b in cache.buffers()]


def test_refusals_name_the_field_and_write_nothing(peers):
    agent, _ = peers
    cache = kvforge.create("vllm_paged_nhd.tiny.bf16", pages=8)
    agent.register("refusals", cache)
    for layer in range(cache.descriptor.layers):  # something to keep
        cache.append(layer, torch.ones(3, 2, 16, dtype=torch.bfloat16), torch.ones(3, 2, 16, dtype=torch.bfloat16),
                     slots=torch.arange(3))
    agent.register("refusals_tp", kvforge.create(TP[1], pages=8))
    before = pool_bytes(cache)
    nhd = next(i for i, d in enumerate(LAYOUTS) if d.layout == "vllm_paged_nhd")
    good_source, target = source_of(LAYOUTS[nhd], nhd), Placement(pages=[0, 1, 2, 3])
    cases = [
        (dict(sources=[("p0", "tp1")]), kvforge.ArgumentError, r"model: sources\[0\] .* 'tiny_tp', this cache .* 'tiny'"),
        (dict(sources=[("p0", "tp2")], key="refusals_tp"), kvforge.ArgumentError, "sources: 1 given, but .* degree 2"),
        (dict(sources=[("p1", "tp2"), ("p0", "tp2")], key="refusals_tp"), kvforge.ArgumentError,
         r"sources\[0\]: that cache is rank 1; list the sources in rank order"),
        (dict(sources=[("p0", "quantized")]), kvforge.UnsupportedError, "storage: .* quantized"),
        (dict(sources=[("p9", "x")]), kvforge.ArgumentError, r"sources\[0\]: agent 'p9' is not connected"),
        (dict(sources=[("p0", "nothing")]), kvforge.ArgumentError, "registered no cache 'nothing'"),
        (dict(key="unknown"), kvforge.ArgumentError, "key: 'unknown' is not registered"),
        (dict(target=Placement(pages=[0, 1, 99, 3])), kvforge.OutOfRangeError, r"target.pages\[2\] = 99 is outside \[0, 8\)"),
        (dict(target=Placement(pages=[0, 1])), kvforge.ArgumentError, "target.pages: 2 pages cover positions up to 32"),
        (dict(target=Placement(row=0)), kvforge.ArgumentError, "target: .* is paged"),
        (dict(count=0), kvforge.OutOfRangeError, "count: 0 is below 1"),
        (dict(unchecked=False), kvforge.ArgumentError, "source.generations: the source Placement carries none"),
    ]
    for change, error, message in cases:
        args = dict(sources=[("p0", LAYOUTS[nhd].name)], key="refusals", count=COUNT, source=good_source, target=target,
                    unchecked=True)
        args.update(change)
        with pytest.raises(error, match=message):
            agent.pull(**args)
    assert all(torch.equal(a, b) for a, b in zip(before, pool_bytes(cache))), "a refused pull wrote to the pool"
    with pytest.raises(kvforge.UnsupportedError, match="ring"):
        agent.register("ring", kvforge.create("jetstream_ring.tiny.bf16", rows=1))
    with pytest.raises(kvforge.ArgumentError, match="metadata: not the bytes"):
        agent.connect(b"hello")
    with pytest.raises(kvforge.ArgumentError, match="metadata: its header is not"):
        agent.connect(b"KVFN" + bytes([1, 0, 0, 0, 3, 0, 0, 0]) + b"{x}garbage")
    with pytest.raises(kvforge.ArgumentError, match="'decode' is this agent's own name"):
        agent.connect(agent.metadata())


@pytest.mark.parametrize("how", ["progress", "serve"])
def test_a_stalled_sender_times_out_and_the_same_pull_then_completes(monkeypatch, how):
    # Over TCP a READ needs the sender's progress (NIXL's thread, or the serving thread, which also writes a
    # prepared pull's layers), so a stopped sender stalls it (over shared memory the READ completes without
    # the sender, and no timeout could happen).
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    peer = Peer(f"stalling_{how}", [{"key": "kv", "variant": "vllm_paged_nhd.tiny.bf16", "pages": 8,
                                     "requests": [[5, {"pages": [3, 2, 1, 0]}, COUNT]]}], how)
    peer.bytes = peer.metadata()
    with kvforge.nixl.Agent("decode_tcp") as agent:
        agent.connect(peer.bytes)
        cache = kvforge.create("flashinfer_paged_hnd.tiny.bf16", pages=8)
        agent.register("kv", cache)
        source, target = Placement(pages=[3, 2, 1, 0]), Placement(pages=[0, 1, 2, 3])
        os.kill(peer.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(kvforge.nixl.PullTimeout, match="did not complete in 0.5 s; it was abandoned"):
                agent.pull([(peer.name, "kv")], "kv", COUNT, source, target, timeout=0.5, unchecked=True)
        finally:
            os.kill(peer.process.pid, signal.SIGCONT)
        report = agent.pull([(peer.name, "kv")], "kv", COUNT, source, target, timeout=30, unchecked=True)
        assert report["how"] == ("prepared" if how == "serve" else "staged")
        assert_holds(cache, target, 5)
    peer.stop()


@pytest.mark.parametrize("how", ["progress", "serve"])
def test_a_killed_sender_fails_the_pull_with_kvforges_error_naming_it_and_writes_nothing(how):
    # kill -9 of the sender: NIXL 1.5 raises its own nixlRemoteDisconnectError (a plain Exception) where a
    # READ is posted or the request is sent, or a prepared pull waits for a sender that never answers; either
    # way the caller gets kvforge's error, naming the peer, and the receiving cache holds what it held.
    peer = Peer(f"killed_{how}", [{"key": "kv", "variant": "vllm_paged_nhd.tiny.bf16", "pages": 8,
                                   "requests": [[5, {"pages": [3, 2, 1, 0]}, COUNT]]}], how)
    peer.bytes = peer.metadata()
    with kvforge.nixl.Agent(f"decode_killed_{how}") as agent:
        agent.connect(peer.bytes)
        cache = kvforge.create("flashinfer_paged_hnd.tiny.bf16", pages=8)
        agent.register("kv", cache)
        before = [torch.from_dlpack(b).clone() for b in cache.buffers()]
        os.kill(peer.process.pid, signal.SIGKILL)
        peer.process.wait()
        with pytest.raises(kvforge.Error, match=peer.name):
            agent.pull([(peer.name, "kv")], "kv", COUNT, Placement(pages=[3, 2, 1, 0]), Placement(pages=[0, 1, 2, 3]),
                       timeout=3, unchecked=True)  # a prepared pull waits for the sender's word, which never comes: PullTimeout
        assert all(torch.equal(a, torch.from_dlpack(b)) for a, b in zip(before, cache.buffers()))
