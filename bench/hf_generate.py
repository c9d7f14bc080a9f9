"""Throughput of transformers' generate() through kvforge.hf.KvforgeCache against its own DynamicCache and
StaticCache, in one process on the same model and prompts: a Llama-3-8B-shaped decoder (hidden 4096, 32
query and 8 KV heads of 128; --layers of them) with random weights, greedy, at each batch size. The
figure is new tokens a second over the whole generate() call, and its ratio to DynamicCache's, and the
decode steps' own rate (the call less a one-token generate's, the prefill); every cache must give
DynamicCache's tokens (a mismatch fails the run). kvforge runs twice: through transformers' sdpa over its
gather, and through its own attention (attn_implementation "kvforge", Cache.attend).

    python3 bench/hf_generate.py --device cuda --batches 8,64 [--layers 8] [--prompt 128] [--new 32] [--json F]
    python3 bench/hf_generate.py --device cpu --tiny   # a small model, so that the script never rots (ctest)
"""

import argparse
import json
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

import kvforge.hf


def model_of(args):
    if args.tiny:
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    else:
        config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model, config


def timed(args, model, ids, cache, attention="sdpa", new=None):
    model.set_attn_implementation(attention)  # "kvforge": Cache.attend reads the cache where it lies
    new = new or args.new
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             **kvforge.hf.cache_kwarg(cache))
    sync()
    return out, time.perf_counter() - start


def leading_equal(out, want, ids):
    """How many new tokens, from the first, every sequence of `out` shares with `want`."""
    differ = (out[:, ids.shape[1]:] != want[:, ids.shape[1]:]).any(dim=0).nonzero()
    return int(differ[0]) if len(differ) else out.shape[1] - ids.shape[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="8,64")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    model, config = model_of(args)
    length = args.prompt + args.new
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = torch.randint(0, config.vocab_size, (batch, args.prompt), device=args.device)
        kvforge_cache = lambda: kvforge.hf.KvforgeCache.from_model(  # noqa: E731
            model, layout="vllm_paged_nhd", batch_size=batch, max_seq_len=length, device=args.device)
        caches = {  # name: (a fresh cache, the model's attn_implementation)
            "DynamicCache": (lambda: DynamicCache(config=config), "sdpa"),
            "StaticCache": (lambda: StaticCache(config=config, max_cache_len=length), "sdpa"),
            "kvforge vllm_paged_nhd bf16, gather + sdpa": (kvforge_cache, "sdpa"),
            "kvforge vllm_paged_nhd bf16, attend": (kvforge_cache, kvforge.hf.ATTENTION),
        }
        timed(args, model, ids, DynamicCache(config=config))  # warm-up: kernels, allocator
        results = {name: timed(args, model, ids, make(), attention) for name, (make, attention) in caches.items()}
        # The prefill alone (one new token), so that the decode steps' own rate shows: at a long prompt the
        # prefill's matmuls dominate the whole call.
        prefill = {name: timed(args, model, ids, make(), attention, new=1)[1] for name, (make, attention) in caches.items()}
        want = results["DynamicCache"][0]
        decode_rate = {name: batch * (args.new - 1) / max(seconds - prefill[name], 1e-9)
                       for name, (_, seconds) in results.items()}
        for name, (out, seconds) in results.items():
            rows.append({"batch": batch, "cache": name, "tokens_per_s": batch * args.new / seconds,
                         "vs_dynamic": results["DynamicCache"][1] / seconds, "decode_tokens_per_s": decode_rate[name],
                         "decode_vs_dynamic": decode_rate[name] / decode_rate["DynamicCache"],
                         "same_tokens": bool(torch.equal(out, want)), "leading_equal": leading_equal(out, want, ids)})
    print("| batch | cache | new tokens/s | / DynamicCache | decode steps' tokens/s | / DynamicCache | "
          "new tokens equal DynamicCache's, from the first |\n|---:|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['cache']} | {r['tokens_per_s']:.0f} | {r['vs_dynamic']:.2f} | "
              f"{r['decode_tokens_per_s']:.1f} | {r['decode_vs_dynamic']:.2f} | {r['leading_equal']} of {args.new} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "layers": config.num_hidden_layers, "prompt": args.prompt,
                       "new": args.new, "rows": rows}, f, indent=1)
    # The gather path hands transformers' attention the bytes DynamicCache holds: its tokens are equal. The
    # attend path computes in fp32 over bf16 values, which flips near-tied tokens of a random-weight model
    # (test_hf_attend checks its logits), so its agreement is reported, not required.
    if not all(r["same_tokens"] for r in rows if "gather" in r["cache"] or args.tiny and "kvforge" in r["cache"]):
        raise SystemExit("hf_generate: kvforge's tokens differ from DynamicCache's")


if __name__ == "__main__":
    main()
