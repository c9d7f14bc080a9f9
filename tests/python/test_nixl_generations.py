"""Page generations over NIXL (kvforge._nixl_generations): a pull of a page table its sender has since
freed or reused is refused, where it would have handed over another request's K/V.

  - pages retired by hand (Agent.retire) before a pull of their old placement, direct and prepared;
  - the issue's serving scenario with no generation call of anyone's own: the sender's SequenceManager
    frees a request and hands its pages to the next, and the decode side's old table is refused, after
    its READs landed in place (the pages named undefined) or before anything is written (staged);
  - a source Placement without generations refused unless unchecked=True;
  - a sender lost between the data READs and the generations' READ.

The peers, values and checks are test_nixl.py's (nixl_peer.py runs the sending processes).
"""

import json

import pytest
import torch

import kvforge
import kvforge.nixl  # before NIXL itself: it sets UCX's modules for this machine

pytest.importorskip("nixl_cu13", reason="NIXL is not installed (tools/setup installs nixl-cu13)")

from kvforge.nixl import Placement  # noqa: E402
from test_nixl import COUNT, Peer, assert_holds, pages_needed  # noqa: E402


@pytest.mark.parametrize("how", ["progress", "serve"])
def test_a_pull_of_pages_the_sender_reused_since_publishing_them_is_refused(how):
    # The sender publishes request 5's pages with their generations, frees them (Agent.retire) and writes
    # request 9 there. A pull of the old placement reads request 9's bytes under request 5's page table: it
    # is refused, naming the page, where it used to return the other request's rows. A pull of the placement
    # published now holds request 9, exactly. Direct READs (progress) and prepared ones (serve) alike.
    pages = [3, 2, 1, 0]
    listed = json.dumps(pages).replace(" ", "")  # one word of the peer's command line
    peer = Peer(f"stale_{how}", [{"key": "kv", "variant": "vllm_paged_nhd.tiny.bf16", "pages": 8,
                                  "requests": [[5, {"pages": pages}, COUNT]]}], how)
    peer.bytes = peer.metadata()
    target = Placement(pages=[4, 5, 6, 7])
    with kvforge.nixl.Agent(f"decode_stale_{how}") as agent:
        agent.connect(peer.bytes)
        cache = kvforge.create("vllm_paged_nhd.tiny.bf16" if how == "progress" else "flashinfer_paged_hnd.tiny.bf16",
                               pages=8)
        agent.register("kv", cache)

        def published():
            return Placement(pages=pages, generations=json.loads(peer.ask(f"placement kv {listed}",
                                                                          "placement")))
        before = published()
        agent.pull([(peer.name, "kv")], "kv", COUNT, before, target)
        assert_holds(cache, target, 5)
        peer.ask(f"reuse kv 9 {listed} {COUNT}", "reused")
        with pytest.raises(kvforge.StateError, match=r"source.pages\[0\] = 3 on 'stale_.*' was retired since"):
            agent.pull([(peer.name, "kv")], "kv", COUNT, before, target)
        agent.pull([(peer.name, "kv")], "kv", COUNT, published(), target)
        assert_holds(cache, target, 9)
        with pytest.raises(kvforge.ArgumentError, match=r"placement.generations: 2 given for 4 pages"):
            Placement(pages=pages, generations=[0, 0])
    peer.stop()


@pytest.mark.parametrize("into", ["vllm_paged_nhd.tiny.bf16", "vllm_paged_nhd.tiny.fp32"])
def test_a_stale_page_table_is_refused_after_the_senders_manager_frees_and_reuses_its_pages(into):
    # The scenario with no generation call of anyone's own: the prefill side's SequenceManager gives
    # request 5 its pages, the decode side pulls it and keeps the published table; the manager frees 5 as a
    # serving loop does and hands the same pages (the pool holds one request) to request 9. A pull of 5's old
    # table is refused, naming the page, where it would have returned request 9's K/V. Into the sender's own
    # variant the READs land in place (direct): the error names the target's pages that now hold undefined
    # bytes. Into fp32 they land in a staging area (staged): the refused pull writes nothing to the cache.
    d = kvforge.describe("vllm_paged_nhd.tiny.bf16")
    peer = Peer(f"managed_{into.split('.')[-1]}", [{"key": "kv", "variant": d.name, "pages": pages_needed(d),
                                                    "managed": True}], "progress")
    peer.bytes = peer.metadata()

    def published(pages):
        return Placement(pages=pages, generations=json.loads(peer.ask(f"placement kv {json.dumps(pages).replace(' ', '')}",
                                                                      "placement")))
    with kvforge.nixl.Agent(f"decode_{peer.name}") as agent:
        agent.connect(peer.bytes)
        cache = kvforge.create(into, pages=2 * pages_needed(d))
        agent.register("kv", cache)
        target = Placement(pages=[pages_needed(d) + i for i in range(pages_needed(d))])
        table = published(json.loads(peer.ask(f"admit kv 5 {COUNT}", "admitted")))
        report = agent.pull([(peer.name, "kv")], "kv", COUNT, table, target)
        assert report["how"] == ("direct" if into == d.name else "staged"), report
        assert_holds(cache, target, 5)
        peer.ask("finish kv 5", "finished")
        reused = json.loads(peer.ask(f"admit kv 9 {COUNT}", "admitted"))
        assert sorted(reused) == sorted(table.pages.tolist()), "the manager reuses 5's pages for 9"
        before = [torch.from_dlpack(b).clone() for b in cache.buffers()]
        with pytest.raises(kvforge.StateError, match=rf"source.pages\[0\] = {table.pages[0]} on '{peer.name}' was "
                                                     r"retired since") as refused:
            agent.pull([(peer.name, "kv")], "kv", COUNT, table, target)
        if into == d.name:
            assert refused.value.undefined_pages == target.pages.tolist()
            assert f"target's pages {target.pages.tolist()} hold undefined bytes" in str(refused.value)
        else:
            assert "nothing was written to the target" in str(refused.value)
            assert all(torch.equal(a, torch.from_dlpack(b)) for a, b in zip(before, cache.buffers()))
        agent.pull([(peer.name, "kv")], "kv", COUNT, published(reused), target)
        assert_holds(cache, target, 9)
        with pytest.raises(kvforge.ArgumentError, match=r"source.generations: the source Placement carries none"):
            agent.pull([(peer.name, "kv")], "kv", COUNT, Placement(pages=reused), target)
        agent.pull([(peer.name, "kv")], "kv", COUNT, Placement(pages=reused), target, unchecked=True)
        assert_holds(cache, target, 9)
    peer.stop()


def test_a_sender_lost_before_its_generations_are_read_fails_the_pull_naming_it(monkeypatch):
    # The data READs complete; then the sender is killed, so the READ of its generations fails: kvforge's
    # error names it, and nothing of that READ is left in flight.
    peer = Peer("gone_late", [{"key": "kv", "variant": "vllm_paged_nhd.tiny.bf16", "pages": 8,
                               "requests": [[5, {"pages": [3, 2, 1, 0]}, COUNT]]}], "progress")
    peer.bytes = peer.metadata()
    published = Placement(pages=[3, 2, 1, 0], generations=json.loads(peer.ask("placement kv [3,2,1,0]", "placement")))
    check = kvforge._nixl_generations.check
    monkeypatch.setattr(kvforge._nixl_generations, "check", lambda *a: (peer.process.kill(), peer.process.wait(),
                                                                        check(*a)))
    with kvforge.nixl.Agent("decode_gone_late") as agent:
        agent.connect(peer.bytes)
        agent.register("kv", kvforge.create("vllm_paged_nhd.tiny.bf16", pages=8))
        with pytest.raises((kvforge.BackendError, kvforge.nixl.PullTimeout), match="gone_late") as failed:
            agent.pull([(peer.name, "kv")], "kv", COUNT, published, Placement(pages=[4, 5, 6, 7]), timeout=5)
        assert agent.abandoned() == 0, failed.value
