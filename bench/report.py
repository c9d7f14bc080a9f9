#!/usr/bin/env python3
"""Turns kvforge_bench's JSON (--benchmark_out=F --benchmark_out_format=json), or kvforge_cuda_bench's
(--json F), into a markdown report and a PNG chart.

Every figure that counts is a ratio measured in the same run: a variant's bandwidth over the
streaming copy of the same bytes (copy/bytes:N), and a quantized variant's over its bf16 twin (same
layout, model and shape).
"""

import argparse
import json
import os
import re
import sys
from collections import OrderedDict

BASELINES = (
    "`÷ generic` divides by the generic runtime-strided path serving the same descriptor (every dimension "
    "and stride a run-time value); `÷ naive` by a naive engine's scatter: one memcpy per token, K/V and "
    "head on one thread; `tuned ÷ default` is the variant with its specs/tuning launch parameters over the same "
    "variant with the defaults.")

BYTES_RULE = (
    "Bytes moved = everything read plus everything written, at the types actually stored: for an append, "
    "the K and V input, the 8-byte target of each token, and the codes and scales written (a lazy variant "
    "stages every layer and commits once, so its step counts every layer); for a gather, the codes and "
    "scales read and the K and V output written. `copy` is a streaming copy of half that many bytes with "
    "every core, so the same bytes cross the memory bus. Caches: `hot` repeats one layer and target; `cold` "
    "flushes the last-level cache before every iteration; `big` holds a pool of at least 1 GiB and moves to "
    "the next layer every iteration and to other rows, positions or pages after each pass, so neither the "
    "pool nor a gather's output is in cache (its copy walks 512 MiB buffers).")

NAME = re.compile(r"^(?P<op>[a-z_]+)/(?P<variant>[^/]+)/(?P<shape>[a-z]+:\d+)(?P<mode>/cold|/big)?"
                  r"(?P<impl>/generic|/naive|/untuned|/torch_[a-z_]+)?$")

PEERS = (
    "`÷ torch` divides by the fastest of PyTorch's forms of the same job (named beside it), timed in the same "
    "process on the same pool and input buffers through ATen, PyTorch's C++ library: vLLM's paged write "
    "(`index_put`), `index_copy_` (over whole-page slots, or HF StaticCache's `index_copy_(2, pos, k)`), "
    "DeepSpeed's slice `copy_`, and for gathers a slice `copy_` or `index_select` of the sequence's pages; "
    "quantized layouts quantize (amax, divide, round, clamp, cast) or dequantize in torch ops too. Above 1, "
    "kvforge is faster.")


def load(path):
    with open(path) as f:
        data = json.load(f)
    runs = [b for b in data["benchmarks"] if b.get("run_type", "iteration") == "iteration" and "error_occurred" not in b]
    return data.get("context", {}), runs


def gbps(b):
    return b.get("bytes_per_second", 0.0) / 1e9


def build(runs):
    copies = {}
    rows = []
    memory = []
    simulations = []
    for b in runs:
        name = re.sub(r"/(real_time|manual_time|iterations:\d+)", "", b["name"])
        if name.startswith("copy/bytes:"):
            mode = "cold" if name.endswith("/cold") else "big" if name.endswith("/big") else "hot"
            copies[(int(float(b["bytes_moved"])), mode)] = gbps(b)
        elif name.startswith("memory/"):
            memory.append((name, b))
        elif name.startswith("simulate/"):
            simulations.append((name.split("/")[1], b))
        else:
            m = NAME.match(name)
            if m:
                rows.append(dict(m.groupdict(), cache=(m.group("mode") or "/hot")[1:], gbps=gbps(b),
                                 bytes=int(float(b["bytes_moved"])),
                                 bytes_per_token=int(float(b.get("bytes_per_token", 0)))))
    baselines = {(r["op"], r["variant"], r["shape"], r["cache"], r["impl"]): r for r in rows if r["impl"]}
    rows = [r for r in rows if not r["impl"]]
    by_key = {(r["op"], r["variant"], r["shape"], r["cache"]): r for r in rows}
    for r in rows:
        for impl in ("generic", "naive", "untuned"):
            b = baselines.get((r["op"], r["variant"], r["shape"], r["cache"], "/" + impl))
            r["to_" + impl] = r["gbps"] / b["gbps"] if b else None
        copy = copies.get((r["bytes"], r["cache"]))
        peers = [(b["gbps"], impl[len("/torch_"):]) for (op, v, shape, cache, impl), b in baselines.items()
                 if (op, v, shape, cache) == (r["op"], r["variant"], r["shape"], r["cache"]) and impl.startswith("/torch_")]
        best = max(peers) if peers else None
        r["to_torch"] = r["gbps"] / best[0] if best else None
        r["torch_form"] = best[1] if best else ""
        r["to_copy"] = r["gbps"] / copy if copy else None
        layout, model, dtype = r["variant"].split(".")
        twin = by_key.get((r["op"], f"{layout}.{model}.bf16", r["shape"], r["cache"]))
        r["to_bf16"] = r["gbps"] / twin["gbps"] if twin and twin is not r and "_in_" in dtype else None
    return rows, memory, copies, simulations


def fmt(x, digits=2):
    return "" if x is None else f"{x:.{digits}f}"


def markdown(rows, memory, copies, context, simulations=()):
    out = []
    out.append(f"Machine: {context.get('num_cpus', '?')} CPUs at {context.get('mhz_per_cpu', '?')} MHz; "
               f"caches {', '.join(str(c.get('size', '?')) for c in context.get('caches', []))} bytes; "
               f"CPU kernels built for {context.get('kvforge_cpu_level', 'an unreported level')}.\n")
    out.append(BYTES_RULE + "\n")
    out.append(BASELINES + "\n")
    torch = context.get("torch_version", "not built")
    out.append((PEERS + f" PyTorch {torch}, {context.get('torch_threads', '?')} threads.\n") if torch != "not built" else
               "PyTorch was not found when this bench was built, so there is no `÷ torch` column "
               "(`tools/setup` installs it; reconfigure after).\n")
    if rows:
        out.append("| op | variant | shape | cache | GB/s | ÷ copy | ÷ torch (form) | ÷ generic | ÷ naive | tuned ÷ default "
                   "| ÷ bf16 twin | bytes/token |")
        out.append("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in sorted(rows, key=lambda r: (r["op"], r["shape"], r["cache"], r["variant"])):
            peer = f"{fmt(r['to_torch'])} ({r['torch_form']})" if r["to_torch"] is not None else ""
            out.append(f"| {r['op']} | `{r['variant']}` | {r['shape']} | {r['cache']} | {r['gbps']:.1f} | {fmt(r['to_copy'])} | "
                       f"{peer} | {fmt(r['to_generic'])} | {fmt(r['to_naive'])} | {fmt(r['to_untuned'])} | "
                       f"{fmt(r['to_bf16'])} | {r['bytes_per_token']} |")
        out.append("")
    if memory:
        out.append("| memory benchmark | time | figure |")
        out.append("|---|---:|---|")
        for name, b in memory:
            figure = []
            if "items_per_second" in b:
                figure.append(f"{b['items_per_second'] / 1e6:.1f} M items/s")
            if "bytes_per_second" in b:
                copy = copies.get((int(float(b.get("bytes_moved", 0))), "hot"))
                figure.append(f"{gbps(b):.2f} GB/s" + (f", {gbps(b) / copy:.2f}× copy" if copy else ""))
            for key in ("utilization", "prefix_hit_blocks", "evictions"):
                if key in b:
                    figure.append(f"{key} {b[key]:.3g}")
            out.append(f"| {name} | {b['real_time']:.0f} {b['time_unit']} | {'; '.join(figure)} |")
        out.append("")
    if simulations:
        out.append("Serving-trace simulator (the same trace and a 16k-token pool for every paged layout; "
                   "utilization = token slots holding tokens / slots of pages held, so waste = 1 - utilization):\n")
        out.append("| layout | utilization | waste | prefix hit rate | evictions | preempted | offloaded MB | "
                   "completed | append M tokens/s | append GB/s |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, b in simulations:
            out.append(f"| `{name}` | {b['utilization']:.1%} | {1 - b['utilization']:.1%} | {b['prefix_hit_rate']:.1%} | "
                       f"{b['evictions']:.0f} | {b['preempted']:.0f} | {b['offloaded_bytes'] / 1e6:.1f} | "
                       f"{b['completed']:.0f} | {b['append_tokens_per_s'] / 1e6:.2f} | {b['append_GBps']:.2f} |")
        out.append("")
    return "\n".join(out)


def chart(rows, path, only=None):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not importable here (tools/setup installs python3-matplotlib for /usr/bin/python3)"
    groups = OrderedDict()
    for r in sorted(rows, key=lambda r: (r["variant"].split(".")[0], r["variant"])):
        if r["to_copy"] is not None and (not only or re.search(only, r["variant"])):
            groups.setdefault((r["op"], r["shape"], r["cache"]), []).append(r)
    if not groups:
        return "no chart: no variant benchmark had a copy baseline"
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 3.2 * len(groups)), squeeze=False)
    for ax, ((op, shape, cache), rs) in zip(axes[:, 0], groups.items()):
        layouts = [r["variant"].split(".")[0] for r in rs]
        palette = {l: plt.cm.tab10(i % 10) for i, l in enumerate(OrderedDict.fromkeys(layouts))}
        ax.bar(range(len(rs)), [r["to_copy"] for r in rs], color=[palette[l] for l in layouts])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels([".".join(r["variant"].split(".")[1:]) + "\n" + r["variant"].split(".")[0] for r in rs],
                           rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("÷ streaming copy")
        ax.set_title(f"{op} {shape} ({cache} cache): bandwidth as a share of a same-run streaming copy")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return f"chart: {path}"


CUDA_RULE = (
    "Bytes moved as above. Times are µs per call: `eager` from cudaEvents around repeated calls, `graph` per "
    "replay of captured calls, `host` the host's enqueue time per call, `step` a whole 32-layer decode step "
    "(every layer's append, and a lazy variant's commit) replayed as one graph, `commit` a lazy variant's commit "
    "of every staged layer alone (one graph launch, enqueued behind a busy kernel so the host's enqueue is not "
    "timed). Each call moves to the next "
    "layer and, after all layers, to other inputs and targets, so the working set stays above L2; `cold` runs "
    "also flush L2 before each call, untimed. `÷ D2D` is a same-run cudaMemcpyAsync of half the bytes moved "
    "over kvforge's time (above 1, kvforge is faster); `÷ reference` a kernel written from scratch on vLLM's "
    "strategy (a block per token, 16-byte vectors, `__restrict__`; fp8 through the hardware convert); `÷ naive` "
    "one thread per element with run-time division; `÷ bf16 twin` the same layout storing bf16; `tuned ÷ default` "
    "the specs/tuning launch parameters against the defaults. `check`: the pool bytes (or gather output) against "
    "the CPU backend's for the same inputs, at up to 4096 tokens.")


def cuda_rows(data):
    rows = []
    for r in data["records"]:
        us = (r.get("kvforge") or {}).get("eager_us")
        if not us:
            rows.append(dict(r, us=None))
            continue
        ratio = lambda other: other / us if other else None
        rows.append(dict(r, us=us, gbps=r["bytes"] / us / 1e3, to_d2d=ratio(r.get("d2d_us")),
                         to_reference=ratio(r["reference"].get("eager_us")), to_naive=ratio(r["naive"].get("eager_us")),
                         to_twin=ratio(r["twin"].get("eager_us")), tuned=ratio(r["untuned"].get("eager_us"))))
    return rows


def cuda_markdown(data):
    dev, empty = data["device"], data.get("empty_kernel", {})
    out = [f"Device: {dev['name']}, {dev['sms']} SMs at {dev['sm_clock_mhz']} MHz, memory at {dev['memory_clock_mhz']} MHz, "
           f"L2 {dev['l2_bytes'] >> 20} MiB. Preset `{data['preset']}`, {'cold' if data.get('cold') else 'warm'} L2. "
           f"Empty kernel: {fmt(empty.get('eager_us'))} µs eager, {fmt(empty.get('graph_us'))} µs in a graph.\n",
           CUDA_RULE + "\n",
           "| op | n | variant | eager µs | graph µs | host µs | step µs | commit µs | GB/s | ÷ D2D | ÷ reference | "
           "÷ naive | ÷ bf16 twin | tuned ÷ default | check |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    rows = cuda_rows(data)
    for r in sorted(rows, key=lambda r: (r["op"], r["n"], r["variant"])):
        if r["us"] is None:
            out.append(f"| {r['op']} | {r['n']} | `{r['variant']}` | | | | | | | | | | | | {r['check']} |")
            continue
        graph = fmt(r["kvforge"].get("graph_us")) or ("not capturable" if r["kvforge"].get("graph_error") else "")
        out.append(f"| {r['op']} | {r['n']} | `{r['variant']}` | {fmt(r['us'])} | {graph} | {fmt(r['kvforge'].get('host_us'))} | "
                   f"{fmt(r['step'].get('graph_us'))} | {fmt((r.get('commit') or {}).get('graph_us'))} | {r['gbps']:.0f} | {fmt(r['to_d2d'])} | {fmt(r['to_reference'])} | "
                   f"{fmt(r['to_naive'])} | {fmt(r['to_twin'])} | {fmt(r['tuned'])} | {r['check']} |")
    errors = sorted({(r["variant"], r["kvforge"]["graph_error"]) for r in data["records"] if r["kvforge"].get("graph_error")})
    if errors:
        out.append("\nNot capturable in a graph:\n")
        out += [f"- `{v}`: {e}" for v, e in errors]
    out += cuda_torch(data, rows)
    out += cuda_goals(rows)
    return "\n".join(out)


def cuda_torch(data, rows):
    """kvforge_cuda_bench --torch's table: each PyTorch form's time beside kvforge's eager call."""
    timed = [r for r in rows if r["us"] is not None and (r.get("torch") or r.get("torch_note"))]
    if not timed:
        return []
    out = ["", f"PyTorch {data.get('torch_version') or '(absent)'} on the same buffers, eager calls on its stream "
               "(`÷ torch` is torch's time over kvforge's: above 1, kvforge is faster):", "",
           "| op | n | variant | kvforge µs | ÷ D2D | torch form | torch µs | ÷ torch |", "|---|---:|---|---:|---:|---|---:|---:|"]
    for r in sorted(timed, key=lambda r: (r["op"], r["n"], r["variant"])):
        forms = [(f, us) for f, us in (r.get("torch") or {}).items() if us]
        head = f"| {r['op']} | {r['n']} | `{r['variant']}` | {fmt(r['us'])} | {fmt(r['to_d2d'])} |"
        out += [f"{head} {f} | {fmt(us)} | {fmt(us / r['us'])} |" for f, us in forms]
        if r.get("torch_note"):
            out.append(f"{head} none: {r['torch_note']} | | |")
    return out


# The GPU goals (issue 55), each over the rows it names: (goal, the rows it covers, a row's figure, whether
# the figure meets it). Quantized rows store codes or records; a lazy variant's rows time it per call.
CUDA_GOALS = [
    ("every quantized write ≥ 0.8× D2D", lambda r: r.get("coded") and r["op"].startswith("append"),
     lambda r: r["to_d2d"], lambda x: x >= 0.8),
    ("every quantized gather ≥ 0.85× D2D", lambda r: r.get("coded") and r["op"] == "gather",
     lambda r: r["to_d2d"], lambda x: x >= 0.85),
    ("a lazy variant's append ≤ 10 µs of host time per call", lambda r: True,
     lambda r: (r.get("lazy_host") or {}).get("append_us"), lambda x: x <= 10),
]


def cuda_goals(rows):
    out = ["", "Against the goals (each row's figure from this run; `met` counts the rows that meet it):", "",
           "| goal | rows | range | met |", "|---|---:|---|---:|"]
    for goal, covers, figure, meets in CUDA_GOALS:
        xs = [figure(r) for r in rows if r["us"] is not None and covers(r) and figure(r) is not None]
        span = f"{min(xs):.2f} to {max(xs):.2f}" if xs else "no row"
        out.append(f"| {goal} | {len(xs)} | {span} | {sum(meets(x) for x in xs)} of {len(xs)} |")
    lazy = [r for r in rows if (r.get("lazy_host") or {}).get("append_us") is not None]
    if lazy:
        out += ["", "A lazy variant's host time per call (its eager `host µs` above is a whole step's):", "",
                "| op | n | variant | append µs | commit µs |", "|---|---:|---|---:|---:|"]
        out += [f"| {r['op']} | {r['n']} | `{r['variant']}` | {fmt(r['lazy_host']['append_us'])} | "
                f"{fmt(r['lazy_host'].get('commit_us'))} |" for r in lazy]
    return out


def cuda_chart(data, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not importable here"
    groups = OrderedDict()
    for r in sorted(cuda_rows(data), key=lambda r: r["variant"]):
        if r["us"] is not None and r["to_d2d"] is not None:
            groups.setdefault((r["op"], r["n"]), []).append(r)
    if not groups:
        return "no chart: no case had a D2D baseline"
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 3.2 * len(groups)), squeeze=False)
    for ax, ((op, n), rs) in zip(axes[:, 0], groups.items()):
        ax.bar(range(len(rs)), [r["to_d2d"] for r in rs], color="tab:blue", label="÷ D2D")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels([r["variant"] for r in rs], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("÷ D2D copy")
        ax.set_title(f"{op} n={n}: a same-run device-to-device copy's time over kvforge's ({data['device']['name']})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return f"chart: {path}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="kvforge_bench --benchmark_out file, or kvforge_cuda_bench --json file")
    p.add_argument("--markdown", help="write the table here (default: print it)")
    p.add_argument("--chart", help="write the PNG chart here")
    p.add_argument("--chart-only", metavar="REGEX", help="chart only the variants this matches (the full grid is wide)")
    args = p.parse_args()
    try:
        with open(args.json) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        print(f"report: cannot read {args.json}: {e}", file=sys.stderr)
        return 1
    if isinstance(data, dict) and data.get("kind") == "kvforge_cuda_bench":
        return emit(args, cuda_markdown(data), lambda path: cuda_chart(data, path))
    try:
        context, runs = load(args.json)
    except (OSError, ValueError, KeyError) as e:
        print(f"report: cannot read {args.json}: {e}", file=sys.stderr)
        return 1
    rows, memory, copies, simulations = build(runs)
    return emit(args, markdown(rows, memory, copies, context, simulations),
                lambda path: chart(rows, path, args.chart_only))


def emit(args, text, draw):
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
        print(f"report: table in {args.markdown}")
    else:
        print(text)
    if args.chart:
        print("report: " + draw(args.chart))
    return 0


if __name__ == "__main__":
    sys.exit(main())
