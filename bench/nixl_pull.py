"""Pulls of one llama3-8b request over NIXL (kvforge.nixl) between two processes on this machine, against
a raw NIXL READ of the same bytes, contiguous, between the same two pools, in the same run.

    PYTHONPATH=build/python python3 bench/nixl_pull.py [--tokens 4096 32768] [--repeat 3]

Per layout pair and size: how the pull went (direct into the pool; prepared, the sender writing this pool's
page order a few layers ahead; or staged and appended), its NIXL
descriptors, the median pull time (planning, READs and any append included) checked (the source Placement
the sender published, with its pages' generations, read back after the data) and unchecked (unchecked=True),
taken in turn, and the median raw READ time. A fresh sending process serves each row, so that only one pair's
pools are in memory at once.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import kvforge
import kvforge.nixl  # before NIXL itself (UCX's modules)
from kvforge.nixl import Placement

PAIRS = [("vllm_paged_nhd", "flashinfer_paged_hnd"), ("deepspeed_blocked", "vllm_paged_nhd"),
         ("vllm_paged_nhd", "jetstream_paged"), ("flashinfer_paged_hnd", "deepspeed_blocked"),
         ("vllm_paged_nhd", "vllm_paged_nhd"), ("jetstream_contiguous", "vllm_paged_nhd"),
         ("vllm_paged_nhd", "jetstream_contiguous"),
         ("flashinfer_paged_hnd", "flashinfer_paged_hnd.llama3_8b.int8_in_bf16"),
         ("flashinfer_paged_hnd.llama3_8b.int8_in_bf16", "flashinfer_paged_hnd.llama3_8b.int8_in_bf16"),
         ("vllm_paged_nhd.llama3_8b.fp8_e4m3_in_bf16", "vllm_paged_nhd.llama3_8b.fp8_e4m3_in_bf16"),
         ("vllm_paged_nhd.llama3_8b.fp8_e4m3_in_bf16", "vllm_paged_nhd")]  # fp8 codes decoded into bf16


def variant(layout):
    return layout if "." in layout else f"{layout}.llama3_8b.bf16"


def config(name, tokens):
    d = kvforge.describe(name)
    return ({"pages": -(-tokens // d.page_size)}, Placement(pages=np.arange(-(-tokens // d.page_size)))) \
        if d.paged else ({"rows": 1}, Placement(row=0))


def serve(name, tokens):
    """The sending side: one cache of `name` holding `tokens` positions, registered; waits for `quit`."""
    with kvforge.nixl.Agent("prefill", serve=True) as agent:
        cache = kvforge.create(name, **config(name, tokens)[0])
        agent.register("kv", cache)
        where = config(name, tokens)[1]
        published = agent.placement("kv", pages=where.pages, row=where.row)
        print("metadata", agent.metadata().hex(), flush=True)
        print("generations", json.dumps(published.generations.tolist()), flush=True)
        for line in sys.stdin:
            if line.strip() == "quit":
                break


def row(source, target, tokens, repeat, prepared=None):
    server = subprocess.Popen([sys.executable, __file__, "--serve", source, str(tokens)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    metadata = next(bytes.fromhex(line.split()[1]) for line in server.stdout if line.startswith("metadata "))
    generations = next(json.loads(line.split(" ", 1)[1]) for line in server.stdout if line.startswith("generations "))
    unchecked_source = config(source, tokens)[1]
    checked_source = Placement(pages=unchecked_source.pages, row=unchecked_source.row, generations=generations)
    with kvforge.nixl.Agent("decode") as agent:
        peer = agent.connect(metadata)
        cache = kvforge.create(target, **config(target, tokens)[0])
        agent.register("kv", cache)
        facts = agent._peers[peer]["kv"]
        times, report = {True: [], False: []}, None
        for _ in range(repeat):
            for checked in (True, False):
                start = time.perf_counter()
                report = agent.pull([(peer, "kv")], "kv", tokens, checked_source if checked else unchecked_source,
                                    config(target, tokens)[1], timeout=600, prepared=prepared, unchecked=not checked)
                times[checked].append(time.perf_counter() - start)
        # The raw READ: the same number of bytes, one descriptor, from the sender's pool to this one's.
        nixl, mine = agent._nixl, agent._caches["kv"][1]
        size = min(report["bytes"], facts["buffers"][0][1], mine["buffers"][0][1])
        local = nixl.get_xfer_descs(np.array([[mine["buffers"][0][0], size, 0]], dtype=np.uint64), "DRAM")
        remote = nixl.get_xfer_descs(np.array([[facts["buffers"][0][0], size, 0]], dtype=np.uint64), "DRAM")
        raws = []
        for _ in range(repeat):
            start = time.perf_counter()
            with agent._lock:  # NIXL is the agent's thread's too: polled as a pull polls it
                handle = nixl.initialize_xfer("READ", local, remote, peer)
                state = nixl.transfer(handle)
            while state == "PROC":
                with agent._lock:
                    state = nixl.check_xfer_state(handle)
                time.sleep(0)
            assert state == "DONE", state
            raws.append(time.perf_counter() - start)
            handle.release()
    server.stdin.write("quit\n")
    server.stdin.flush()
    server.wait()
    pull, unchecked, raw = statistics.median(times[True]), statistics.median(times[False]), statistics.median(raws)
    return (f"| {source} | {target} | {tokens} | {report['bytes']} | {report['how']} | {report['descriptors']} | "
            f"{pull * 1e3:.1f} | {unchecked * 1e3:.1f} | {raw * 1e3:.1f} | {raw / pull:.2f} | {raw / unchecked:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--staged-too", action="store_true",
                        help="after each prepared pull, the same pull staged (the receiver converting)")
    parser.add_argument("--pairs", type=int, nargs="+", help="indices into PAIRS (default: all)")
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve[0], int(args.serve[1]))
    print("| prefill | decode | tokens | bytes | how | descriptors | pull ms | unchecked ms | raw READ ms | ÷ raw | "
          "unchecked ÷ raw |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for source, target in [PAIRS[i] for i in args.pairs] if args.pairs else PAIRS:
        for tokens in args.tokens:
            if any(tokens > d.max_seq_len for d in map(kvforge.describe, (variant(source), variant(target)))
                   if not d.paged):
                continue  # a contiguous row holds max_seq_len positions
            line = row(variant(source), variant(target), tokens, args.repeat)
            print(line, flush=True)
            if "| prepared |" in line and args.staged_too:  # the same pull with the receiver converting
                print(row(variant(source), variant(target), tokens, args.repeat, prepared=False), flush=True)


if __name__ == "__main__":
    main()
