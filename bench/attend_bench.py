"""Cache.attend beside its same-run baselines: a copy of the bytes it reads, and kvforge's gather + SDPA.

    PYTHONPATH=build/python python3 bench/attend_bench.py [--variants V,...] [--cases decode:4x4096,...]
                                                          [--repeat 5] [--markdown FILE]

One layer of a llama3-8b-shaped cache (32 query heads over 8 KV heads of 128; the layer's history
written once through append), one process, the same buffers for every column:
  - attend: Cache.attend of the case's queries over the history where it lies;
  - copy: torch's copy of as many bytes as the layer's history holds in its storage (codes and scales),
    a streaming floor for an op that must read them;
  - gather+sdpa: what kvforge.hf's gather path does per layer and step: gather_batch of the whole history
    into [B, H, n, D] in the input dtype, then torch's scaled_dot_product_attention (enable_gqa) over it.
Cases: decode:BxN (B sequences of N positions, one query each) and prefill:CxN (one sequence, a causal
chunk of C queries that ends at position N). Times are medians of `repeat` runs of a few calls each; the
ratios are to the copy of the same run, so the machine's drift cancels.
"""

import argparse
import statistics
import time

import torch

import kvforge
from kvforge.torch_dtypes import TORCH_DTYPES

Q_HEADS = 32


def timed(fn, calls):
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


class Case:
    def __init__(self, text):
        kind, shape = text.split(":")
        first, positions = (int(x) for x in shape.split("x"))
        self.text, self.kind, self.positions = text, kind, positions
        self.batch, self.queries = (first, 1) if kind == "decode" else (1, first)


def run(variant, case, repeat):
    d = kvforge.describe(variant)
    dtype = TORCH_DTYPES[d.input]
    per = -(-case.positions // d.page_size)
    cache = kvforge.create(variant, pages=case.batch * per)
    table = torch.arange(case.batch * per, dtype=torch.int32).view(case.batch, per)
    g = torch.Generator().manual_seed(0)
    for b in range(case.batch):
        for begin in range(0, case.positions, 4096):  # appends of at most 4096 tokens
            n = min(4096, case.positions - begin)
            pos = torch.arange(begin, begin + n)
            slots = (table[b, pos // d.page_size].long() * d.page_size + pos % d.page_size)
            k = torch.randn(n, d.heads, d.head_dim, generator=g).to(dtype)
            cache.append(0, k, torch.randn(n, d.heads, d.head_dim, generator=g).to(dtype), slots=slots)
    tokens = case.batch * case.queries
    q = torch.randn(tokens, Q_HEADS, d.head_dim, generator=g).to(dtype)
    out = torch.empty(tokens, Q_HEADS, d.head_dim, dtype=dtype)
    starts = torch.arange(0, tokens + 1, case.queries, dtype=torch.int32)
    lengths = torch.full((case.batch,), case.positions, dtype=torch.int32)
    attend = lambda: cache.attend(0, q, out, query_start=starts, lengths=lengths, page_table=table)  # noqa: E731

    # The bytes the layer's history holds: the cache holds exactly the history's pages, so a layer's share
    # of its buffers (pool and scales).
    read = sum(b.numel() * b.element_size() for b in (torch.from_dlpack(x) for x in cache.buffers())) // d.layers
    src = torch.randint(0, 255, (read,), dtype=torch.uint8, generator=g)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731

    k_all = torch.empty(case.batch, d.heads, case.positions, d.head_dim, dtype=dtype)
    v_all = torch.empty_like(k_all)
    qs = q.view(case.batch, case.queries, Q_HEADS, d.head_dim).transpose(1, 2)
    mask = torch.ones(case.queries, case.positions, dtype=torch.bool).tril(case.positions - case.queries)

    def gather_sdpa():
        cache.gather_batch(0, k_all, v_all, page_table=table, begin=0, end=case.positions)
        torch.nn.functional.scaled_dot_product_attention(qs, k_all, v_all, attn_mask=mask, enable_gqa=True)

    calls = 3
    rows = {"attend": [], "copy": [], "gather+sdpa": []}
    for _ in range(repeat):  # interleaved, so the drift of a run touches every column alike
        rows["attend"].append(timed(attend, calls))
        rows["copy"].append(timed(copy, calls))
        rows["gather+sdpa"].append(timed(gather_sdpa, calls))
    return {k: statistics.median(v) for k, v in rows.items()}, read


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="vllm_paged_nhd.llama3_8b.bf16,vllm_paged_nhd.llama3_8b.fp8_e4m3_in_bf16,"
                                              "flashinfer_paged_hnd.llama3_8b.int8_in_bf16")
    parser.add_argument("--cases", default="decode:4x4096,decode:1x16384,prefill:512x4096")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--markdown")
    args = parser.parse_args()
    lines = [f"torch threads {torch.get_num_threads()}, kvforge threads as its CPU backend picks",
             "", "| variant | case | bytes read | copy ms | attend ms | attend/copy | gather+sdpa ms | "
             "(gather+sdpa)/attend |", "|---|---|---|---|---|---|---|---|"]
    for variant in args.variants.split(","):
        for text in args.cases.split(","):
            t, read = run(variant, Case(text), args.repeat)
            lines.append(f"| {variant} | {text} | {read / 2**20:.1f} MiB | {t['copy'] * 1e3:.2f} | "
                         f"{t['attend'] * 1e3:.2f} | {t['attend'] / t['copy']:.2f} | {t['gather+sdpa'] * 1e3:.2f} | "
                         f"{t['gather+sdpa'] / t['attend']:.2f} |")
            print(lines[-1], flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
