"""Throughput of transformers' generate() through kvforge.hf.KvforgeCache against its own DynamicCache and
StaticCache, in one process on the same model and prompts: a Llama-3-8B-shaped decoder (hidden 4096, 32
query and 8 KV heads of 128; --layers of them) with random weights, greedy, at each batch size. The
figure is new tokens a second over the whole generate() call, and its ratio to DynamicCache's; every
cache must give DynamicCache's tokens (a mismatch fails the run).

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


def timed(args, model, ids, cache):
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                             **kvforge.hf.cache_kwarg(cache))
    sync()
    return out, time.perf_counter() - start


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
        caches = {
            "DynamicCache": lambda: DynamicCache(config=config),
            "StaticCache": lambda: StaticCache(config=config, max_cache_len=length),
            "kvforge vllm_paged_nhd bf16": lambda: kvforge.hf.KvforgeCache.from_model(
                model, layout="vllm_paged_nhd", batch_size=batch, max_seq_len=length, device=args.device),
        }
        timed(args, model, ids, DynamicCache(config=config))  # warm-up: kernels, allocator
        results = {name: timed(args, model, ids, make()) for name, make in caches.items()}
        want = results["DynamicCache"][0]
        for name, (out, seconds) in results.items():
            rows.append({"batch": batch, "cache": name, "tokens_per_s": batch * args.new / seconds,
                         "vs_dynamic": results["DynamicCache"][1] / seconds, "same_tokens": bool(torch.equal(out, want))})
    print(f"| batch | cache | new tokens/s | / DynamicCache | tokens equal DynamicCache's |\n|---:|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['cache']} | {r['tokens_per_s']:.0f} | {r['vs_dynamic']:.2f} | {r['same_tokens']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "layers": config.num_hidden_layers, "prompt": args.prompt,
                       "new": args.new, "rows": rows}, f, indent=1)
    if not all(r["same_tokens"] for r in rows if r["cache"].startswith("kvforge")):
        raise SystemExit("hf_generate: kvforge's tokens differ from DynamicCache's")


if __name__ == "__main__":
    main()
