"""tools/gtest_watch.py against a stand-in for a GoogleTest binary (written here, speaking gtest's list and
run output) whose cases pass, skip, fail, hang (always, or only after another case of the same process),
and kill their own process: each outcome is named, a hung case is killed at the case limit, the cases
after a hang or a crash still run, a case that hung after another is run alone and the report says how it
went, and the run stops starting cases at its deadline."""

import json
import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WATCH = os.path.join(HERE, "..", "..", "tools", "gtest_watch.py")

FAKE = textwrap.dedent('''\
    #!{python}
    import os, sys, time
    CASES = {cases!r}
    args = dict(a.split("=", 1) if "=" in a else (a, "") for a in sys.argv[1:])
    if "--gtest_list_tests" in args:
        suites = {{}}
        for c in CASES:
            suite, name = c.split(".")
            suites.setdefault(suite, []).append(name)
        for suite, names in suites.items():
            print(suite + ".")
            for n in names:
                print("  " + n + "  # GetParam() = x")
        sys.exit(0)
    wanted = args["--gtest_filter"].split(":")
    ran = 0  # cases this process has run
    for c in CASES:
        if c not in wanted:
            continue
        print("[ RUN      ] " + c, flush=True)
        kind = c.split(".")[1]
        if kind.startswith("Hang") or (kind.startswith("Wedged") and ran):
            time.sleep(3600)
        ran += 1
        if kind.startswith("Crash"):
            os._exit(3)
        if kind.startswith("Fail"):
            print("a failure's message", flush=True)
            print("[  FAILED  ] " + c + " (1 ms)", flush=True)
        elif kind.startswith("Skip"):
            print("[  SKIPPED ] " + c + " (0 ms)", flush=True)
        else:
            time.sleep(0.05)
            print("[       OK ] " + c + " (50 ms)", flush=True)
''')


def fake(tmp_path, cases):
    path = tmp_path / "fake_tests"
    path.write_text(FAKE.format(python=sys.executable, cases=cases))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def watch(tmp_path, binary, case_limit, deadline):
    results = tmp_path / "results.jsonl"
    start = time.monotonic()
    out = subprocess.run([sys.executable, WATCH, binary, "--filter", "*", "--case-limit", str(case_limit),
                          "--deadline", str(deadline), "--results", str(results), "--log", str(tmp_path / "log"),
                          "--summary", str(tmp_path / "summary.md")], capture_output=True, text=True)
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    return out, {r["case"]: r for r in rows}, time.monotonic() - start


def test_each_outcome_is_named_and_the_cases_after_a_hang_or_a_crash_still_run(tmp_path):
    cases = ["A.Pass1", "A.Hang1", "A.Pass2", "B.Crash1", "B.Skip1", "B.Fail1", "B.Pass3"]
    out, rows, took = watch(tmp_path, fake(tmp_path, cases), case_limit=1.5, deadline=60)
    assert {c: r["outcome"] for c, r in rows.items()} == {
        "A.Pass1": "passed", "A.Hang1": "hung", "A.Pass2": "passed", "B.Crash1": "crashed", "B.Skip1": "skipped",
        "B.Fail1": "failed", "B.Pass3": "passed"}
    assert 1.4 <= rows["A.Hang1"]["seconds"] < 10, rows["A.Hang1"]
    assert "a failure's message" in rows["B.Fail1"]["note"]
    assert out.returncode == 1
    assert took < 30  # the hang cost its limit, not the hour it would have slept
    summary = (tmp_path / "summary.md").read_text()
    assert "| 7 | 3 | 1 | 1 | 1 | 1 | 0 | 0 |" in summary, summary
    assert "`A.Hang1`: hung" in summary


def test_the_deadline_stops_the_run_and_names_what_it_did_not_reach(tmp_path):
    cases = ["A.Pass1", "A.Hang1", "A.Hang2", "A.Pass2"]
    out, rows, took = watch(tmp_path, fake(tmp_path, cases), case_limit=30, deadline=2)
    assert rows["A.Pass1"]["outcome"] == "passed"
    assert rows["A.Hang1"]["outcome"] == "hung" and "deadline" in rows["A.Hang1"]["note"]
    assert [rows[c]["outcome"] for c in ("A.Hang2", "A.Pass2")] == ["not run", "not run"]
    assert took < 20 and out.returncode == 1


def test_a_run_where_everything_passes_or_skips_succeeds(tmp_path):
    out, rows, _ = watch(tmp_path, fake(tmp_path, ["A.Pass1", "A.Skip1", "B.Pass2"]), case_limit=5, deadline=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(rows) == 3


def test_a_case_that_hangs_after_another_is_run_alone_and_the_report_names_both(tmp_path):
    # Wedged1 hangs only behind another case (a case that left the process wedged); Hang1 hangs anyway.
    cases = ["A.Pass1", "A.Wedged1", "A.Pass2", "A.Hang1", "A.Pass3"]
    out, rows, took = watch(tmp_path, fake(tmp_path, cases), case_limit=1.5, deadline=60)
    assert {c: r["outcome"] for c, r in rows.items()} == {
        "A.Pass1": "passed", "A.Wedged1": "hung", "A.Pass2": "passed", "A.Hang1": "hung", "A.Pass3": "passed"}
    assert (rows["A.Wedged1"]["after"], rows["A.Wedged1"]["alone"]) == ("A.Pass1", "passed")
    assert (rows["A.Hang1"]["after"], rows["A.Hang1"]["alone"]) == ("A.Pass2", "hung")
    assert rows["A.Pass1"]["alone"] is None
    summary = (tmp_path / "summary.md").read_text()
    assert "- `A.Wedged1`: hung (after `A.Pass1`; alone: passed)" in summary, summary
    assert "- `A.Hang1`: hung (after `A.Pass2`; alone: hung)" in summary, summary
    assert took < 30 and out.returncode == 1


def test_a_case_that_hangs_first_in_its_process_is_not_run_again(tmp_path):
    out, rows, _ = watch(tmp_path, fake(tmp_path, ["A.Hang1", "A.Pass1"]), case_limit=1.5, deadline=60)
    assert rows["A.Hang1"]["outcome"] == "hung" and rows["A.Hang1"]["alone"] is None
    assert rows["A.Pass1"]["outcome"] == "passed"
