#!/usr/bin/env python3
"""bench/report.py on kvforge_cuda_bench's JSON: the ratios it prints are the baselines' times over
kvforge's, row by row, PyTorch's forms' too, and the goals count the rows they cover. The figures here are made up for the check (no GPU runs in this test)."""
import json
import os
import subprocess
import sys
import tempfile

REPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "report.py")


def timing(eager=None, graph=None, host=None, error=None):
    t = {"eager_us": eager, "graph_us": graph, "host_us": host}
    if error:
        t["graph_error"] = error
    return t


data = {
    "kind": "kvforge_cuda_bench", "preset": "short", "cold": False, "torch_version": "9.9.9",
    "device": {"name": "Made-up GPU", "sms": 10, "sm_clock_mhz": 1000, "memory_clock_mhz": 2000,
               "l2_bytes": 50 << 20, "memory_bytes": 1 << 34},
    "empty_kernel": timing(2.0, 1.0, 1.5),
    "records": [
        {"variant": "a.m.bf16", "op": "append_prefill", "n": 8192, "bytes": 8_000_000, "check": "ok", "d2d_us": 30.0,
         "kvforge": timing(40.0, 38.0, 3.0), "untuned": timing(50.0), "step": timing(), "reference": timing(60.0),
         "naive": timing(120.0), "twin": timing(), "torch": {"index_put": 80.0, "index_copy": 60.0}, "torch_note": ""},
        {"variant": "a.m.int8_in_bf16", "op": "append_decode", "n": 256, "bytes": 1_000_000, "check": "3 of 9 pool bytes differ",
         "d2d_us": 4.0, "kvforge": timing(8.0, None, 5.0, "operation not permitted when stream is capturing"),
         "untuned": timing(), "step": timing(None, 90.0), "commit": timing(None, 7.5), "reference": timing(),
         "naive": timing(), "twin": timing(4.0), "coded": True, "lazy_host": {"append_us": 6.0, "commit_us": 9.0}},
        {"variant": "a.m.int8_in_bf16", "op": "gather", "n": 8192, "bytes": 9_000_000, "check": "ok", "d2d_us": 9.0,
         "kvforge": timing(10.0, 9.5, 4.0), "untuned": timing(), "step": timing(), "reference": timing(),
         "naive": timing(), "twin": timing(), "coded": True, "lazy_host": {"append_us": None, "commit_us": None},
         "torch": {}, "torch_note": "no torch form serves this job on this layout"},
    ],
}
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "cuda.json")
    with open(path, "w") as f:
        json.dump(data, f)
    text = subprocess.run([sys.executable, REPORT, path], check=True, capture_output=True, text=True).stdout
# The main table's append rows (15 columns; the lazy table's rows have 5).
lines = {line.split("|")[3].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
         if line.startswith("| append") and line.count("|") == 16}
prefill, decode = lines["`a.m.bf16`"], lines["`a.m.int8_in_bf16`"]
# op | n | variant | eager | graph | host | step | commit | GB/s | ÷ D2D | ÷ reference | ÷ naive | ÷ twin | tuned | check
# (the prefill record predates the commit column: a JSON without it reads as empty)
expected_prefill = ["append_prefill", "8192", "`a.m.bf16`", "40.00", "38.00", "3.00", "", "", "200", "0.75", "1.50", "3.00",
                    "", "1.25", "ok"]
expected_decode = ["append_decode", "256", "`a.m.int8_in_bf16`", "8.00", "not capturable", "5.00", "90.00", "7.50", "125",
                   "0.50", "", "", "0.50", "", "3 of 9 pool bytes differ"]
failures = [(got, want) for got, want in ((prefill, expected_prefill), (decode, expected_decode)) if got != want]
# The goals: the decode's 4 / 8 misses 0.8, the gather's 9 / 10 meets 0.85, the lazy append's 6 µs meets 10;
# the bf16 prefill is no quantized row, and a row without a lazy figure is no lazy row.
for goal in ("| every quantized write ≥ 0.8× D2D | 1 | 0.50 to 0.50 | 0 of 1 |",
             "| every quantized gather ≥ 0.85× D2D | 1 | 0.90 to 0.90 | 1 of 1 |",
             "| a lazy variant's append ≤ 10 µs of host time per call | 1 | 6.00 to 6.00 | 1 of 1 |",
             "| append_decode | 256 | `a.m.int8_in_bf16` | 6.00 | 9.00 |",
             # --torch: each form's time over kvforge's 40 µs; a job no form serves says why
             "| append_prefill | 8192 | `a.m.bf16` | 40.00 | 0.75 | index_put | 80.00 | 2.00 |",
             "| append_prefill | 8192 | `a.m.bf16` | 40.00 | 0.75 | index_copy | 60.00 | 1.50 |",
             "| gather | 8192 | `a.m.int8_in_bf16` | 10.00 | 0.90 | none: no torch form serves this job on this layout | | |"):
    if goal not in text.splitlines():
        failures.append(("goal line missing", goal))
if "Made-up GPU" not in text or "operation not permitted" not in text:
    failures.append(("device line or capture error missing", text))
for got, want in failures:
    print(f"report row {got}\n  expected {want}", file=sys.stderr)
sys.exit(1 if failures else 0)
