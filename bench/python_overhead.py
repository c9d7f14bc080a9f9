"""What the Python boundary costs per call: one decode append from Python, over the same append from C++.

    PYTHONPATH=build/python python3 bench/python_overhead.py [--variant V] [--tokens 1,64] [--repeat 5]

For each token count, in one process on the same buffers: the append called from C++ in a loop
(kvforge._native._append_loop_seconds, arguments converted once), the same append through
kvforge.Cache.append (torch tensors in, through DLPack), through torch.ops.kvforge.append (the torch
custom op, eager), and torch's own index_copy_ of the same bytes into a tensor as a yardstick. Times
are medians of `repeat` runs; the overhead columns are differences from the C++ call, so the drift of
a shared machine cancels.
"""

import argparse
import statistics
import time

import torch

import kvforge
import kvforge.ops
from kvforge.torch_dtypes import TORCH_DTYPES
from kvforge import _native


def per_call(fn, iterations):
    fn()
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="vllm_paged_nhd.llama3_8b.bf16")
    parser.add_argument("--tokens", default="1,64")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=20000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    d = kvforge.describe(args.variant)
    cache = kvforge.create(d.name, pages=256)
    tc = kvforge.ops.TorchCache(cache)
    dtype = TORCH_DTYPES[d.input]
    print(f"{d.name}, CPU level x86-64-v{kvforge.cpu_level()}, torch {torch.__version__}, "
          f"medians of {args.repeat} runs of {args.iterations} calls")
    print(f"{'tokens':>6}  {'C++ us':>8}  {'Python us':>9}  {'overhead us':>11}  {'torch op us':>11}  "
          f"{'op overhead us':>14}  {'index_copy_ us':>14}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        k = torch.randn(tokens, d.heads, d.head_dim).to(dtype)
        v = torch.randn(tokens, d.heads, d.head_dim).to(dtype)
        slots = torch.arange(tokens, dtype=torch.int64) * 3
        pool = torch.zeros(256 * d.page_size, d.heads, d.head_dim, dtype=dtype)
        runs = {"cpp": [], "py": [], "op": [], "copy": []}
        for _ in range(args.repeat):
            runs["cpp"].append(_native._append_loop_seconds(cache, 0, k, v, slots, args.iterations))
            runs["py"].append(per_call(lambda: cache.append(0, k, v, slots=slots), args.iterations))
            runs["op"].append(per_call(lambda: tc.append(0, k, v, slots=slots), args.iterations // 4))
            runs["copy"].append(per_call(lambda: (pool.index_copy_(0, slots, k), pool.index_copy_(0, slots, v)),
                                         args.iterations))
        cpp, py, op, copy = (statistics.median(runs[key]) * 1e6 for key in ("cpp", "py", "op", "copy"))
        print(f"{tokens:>6}  {cpp:>8.2f}  {py:>9.2f}  {py - cpp:>11.2f}  {op:>11.2f}  {op - cpp:>14.2f}  {copy:>14.2f}")


if __name__ == "__main__":
    main()
