"""Disaggregated serving over NIXL: a prefill process fills a request's KV, a decode process pulls it
one-sided into another layout and continues generation in HF transformers.

    PYTHONPATH=build/python python3 examples/disaggregated_nixl.py [prefill variant] [decode variant]
    # default: vllm_paged_nhd.tiny.fp32 -> flashinfer_paged_hnd.tiny.fp32 (NHD pages of 16 into HND)

Both processes build the same tiny Llama (random weights, fixed seed: nothing is downloaded). The prefill
process runs the prompt through kvforge.hf.KvforgeCache, picks the first token, registers its cache with
a kvforge.nixl Agent, with the SequenceManager that allocates its pages, and hands the decode process its
metadata, its page table with the pages' generations (Agent.placement), and the first token. The decode
process allocates pages for the prompt, pulls them, and generates the rest. Its tokens are compared with
one process generating through transformers' own DynamicCache. Exits 1 if they differ.
"""

import json
import subprocess
import sys

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvforge
import kvforge.nixl  # before NIXL itself (UCX's modules)
import kvforge.hf
from kvforge.nixl import Placement
from kvforge.torch_dtypes import TORCH_DTYPES

NEW_TOKENS = 12


def model_for(variant):
    d = kvforge.describe(variant)
    config = LlamaConfig(vocab_size=128, hidden_size=4 * d.head_dim, intermediate_size=8 * d.head_dim,
                         num_hidden_layers=d.layers, num_attention_heads=4, num_key_value_heads=d.heads,
                         head_dim=d.head_dim, max_position_embeddings=d.max_seq_len)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().to(TORCH_DTYPES[d.input])


def prompt():
    return torch.randint(1, 128, (1, 21), generator=torch.Generator().manual_seed(7))


def prefill(variant):
    model, ids = model_for(variant), prompt()
    cache = kvforge.hf.KvforgeCache(variant, model.config, batch_size=1)
    with torch.no_grad():
        logits = model(ids, cache=cache, use_cache=True).logits
    first = int(logits[0, -1].argmax())
    with kvforge.nixl.Agent("prefill", serve=True) as agent:
        agent.register("kv", cache.kv, manager=cache.sequence_manager)  # its frees and reuses advance generations
        published = agent.placement("kv", pages=cache.sequence_manager.pages(0))
        print("ready", json.dumps({"metadata": agent.metadata().hex(), "pages": published.pages.tolist(),
                                   "generations": published.generations.tolist(), "count": ids.shape[1],
                                   "first": first}), flush=True)
        sys.stdin.readline()  # the decode process says when it has pulled


def decode(prefill_variant, variant):
    server = subprocess.Popen([sys.executable, __file__, "--prefill", prefill_variant], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    handoff = json.loads(next(line for line in server.stdout if line.startswith("ready "))[len("ready "):])
    model, ids = model_for(variant), prompt()
    cache = kvforge.hf.KvforgeCache(variant, model.config, batch_size=1)
    count = handoff["count"]
    manager = cache.sequence_manager
    manager.add(0, ids[0].tolist())  # pages for the prompt, as a prefill here would have taken
    manager.step([0])
    with kvforge.nixl.Agent("decode") as agent:
        peer = agent.connect(bytes.fromhex(handoff["metadata"]))
        agent.register("kv", cache.kv)
        # Checked: had the prefill side freed and reused a page since it published the table, the pull would
        # fail with StateError rather than hand over another request's K/V.
        report = agent.pull([(peer, "kv")], "kv", count,
                            Placement(pages=handoff["pages"], generations=handoff["generations"]),
                            Placement(pages=manager.pages(0)), notify=b"pulled")
    server.stdin.write("done\n")
    server.stdin.flush()
    server.wait()
    cache.lengths[0], cache.pending[0] = count, 0  # the prompt is held; generation goes on from here
    first = torch.tensor([[handoff["first"]]])
    with torch.no_grad():
        ours = model.generate(torch.cat([ids, first], dim=1), max_new_tokens=NEW_TOKENS - 1, do_sample=False,
                              cache=cache, pad_token_id=0)
        theirs = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, cache=DynamicCache(config=model.config),
                                pad_token_id=0)
    print(f"{prefill_variant} -> {variant}: pulled {count} positions {report['how']}, {report['descriptors']} "
          f"descriptors, {report['bytes']} bytes")
    print("disaggregated:", ours[0, count:].tolist())
    print("one process:  ", theirs[0, count:].tolist())
    if not torch.equal(ours, theirs):
        print("disaggregated_nixl: the tokens differ")
        return 1
    print("disaggregated_nixl: same tokens")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--prefill"]:
        prefill(sys.argv[2])
    else:
        args = sys.argv[1:] + ["vllm_paged_nhd.tiny.fp32", "flashinfer_paged_hnd.tiny.fp32"][len(sys.argv[1:]):]
        sys.exit(decode(*args[:2]))
