#!/usr/bin/env python3
"""Runs a GoogleTest binary's cases so that no case can take the rest with it: each case has a time
limit, a case over it is named, killed and reported as hung, and the cases after it still run, in a
fresh process; the whole run stops starting cases at its own deadline. A case that hangs or crashes
after other cases of its process is run again by itself, in a fresh process under the same limit, and
its report names the case before it and the outcome alone: a case that passes alone was wedged by what
ran before it, not by itself. Results go to a JSON-lines file as each case ends, so a killed run still
leaves everything it found.

    gtest_watch.py BINARY --filter F --case-limit S --deadline S --results FILE [--log FILE] [--summary FILE]

tools/gpu-check runs the CUDA cases this way (a lease is minutes long, and one wedged case once took a
whole lease). Exit status: 0 when every case that ran passed or skipped, 1 otherwise (failed, hung, or
left unrun by the deadline)."""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

RUN = re.compile(r"^\[ RUN      \] (\S+)")
CHUNK = 200  # cases a process, at most
END = re.compile(r"^\[ +(OK|FAILED|SKIPPED) +\] (\S+)")
OUTCOME = {"OK": "passed", "FAILED": "failed", "SKIPPED": "skipped"}  # END's word -> the outcome recorded


def listed(binary: str, gtest_filter: str) -> List[str]:
    """The cases the filter selects, in the binary's order."""
    out = subprocess.run([binary, "--gtest_list_tests", f"--gtest_filter={gtest_filter}"], capture_output=True,
                         text=True, check=True).stdout
    cases, suite = [], ""
    for line in out.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            suite = line.split()[0]
        else:
            cases.append(suite + line.split()[0])
    return cases


class Watch:
    def __init__(self, binary: str, case_limit: float, deadline: float, results: str, log: Optional[str]):
        self.binary, self.case_limit, self.deadline = binary, case_limit, deadline
        self.results = open(results, "a", buffering=1)
        self.log = open(log, "a", buffering=1) if log else None
        self.outcome: Dict[str, str] = {}
        self.detail: Dict[str, str] = {}  # a hung or crashed case: what ran before it, and how it did alone

    def record(self, case: str, outcome: str, seconds: float, note: str = "", after: Optional[str] = None) -> None:
        """One case's outcome. For a hang or a crash with `after` (the case before it in its process), the
        case also runs alone, and the record says how that went."""
        alone = self.alone(case) if after and outcome in ("hung", "crashed") else None
        if alone:
            note += f"; after {after} in the same process; run alone: {alone}"
            self.detail[case] = f"after `{after}`; alone: {alone}"
        self.outcome[case] = outcome
        self.results.write(json.dumps({"case": case, "outcome": outcome, "seconds": round(seconds, 3), "note": note,
                                       "after": after, "alone": alone}) + "\n")

    def alone(self, case: str) -> str:
        """The outcome of `case` by itself in a fresh process, under the case limit (and the deadline)."""
        limit = min(self.case_limit, self.deadline - time.monotonic())
        if limit <= 0:
            return "not run (the run's deadline)"
        proc = subprocess.Popen([self.binary, "--gtest_filter=" + case, "--gtest_color=no"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out = proc.communicate(timeout=limit)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            self.kill(proc)
            proc.stdout.close()
            return "hung"
        if self.log:
            self.log.write(f"gtest_watch: {case} run alone:\n" + out)
        for line in out.splitlines():
            if (m := END.match(line)) and m.group(2) == case:
                return OUTCOME[m.group(1)]
        return f"crashed (status {proc.returncode})"

    def run(self, cases: List[str]) -> None:
        """Runs `cases` in few processes, at most CHUNK cases each (a filter of names stays well under
        the kernel's limit on one argument): a process that hangs or dies is replaced by one over the
        cases it had not reached."""
        left = list(cases)
        while left:
            if time.monotonic() >= self.deadline:
                for case in left:
                    self.record(case, "not run", 0.0, "the run's deadline came first")
                return
            chunk = left[:CHUNK]
            done = self.one_process(chunk)
            remaining = [c for c in chunk if c not in self.outcome]
            if remaining and (done or remaining == chunk):
                # A process that ended without reporting a case, or died before the first it was given:
                # that case is charged, so the run always moves on.
                self.record(remaining[0], "not reported" if done else "crashed", 0.0,
                            "the process ended without reporting this case" if done else
                            "the process ended before or during this case")
            left = [c for c in left if c not in self.outcome]

    def one_process(self, cases: List[str]) -> bool:
        """One process over `cases` (in order); returns whether it ran to its end. Its output is read from
        the pipe's descriptor as it comes (no buffered reader holding lines back from select)."""
        proc = subprocess.Popen([self.binary, "--gtest_filter=" + ":".join(cases), "--gtest_color=no"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        fd = proc.stdout.fileno()
        selector = selectors.DefaultSelector()
        selector.register(fd, selectors.EVENT_READ)
        current, started, lines, pending = None, time.monotonic(), [], b""
        previous = None  # the last case this process finished
        try:
            while True:
                now = time.monotonic()
                limit = min(started + self.case_limit if current else now + self.case_limit, self.deadline)
                if now >= limit:
                    self.kill(proc)
                    if current:
                        why = "over the case limit" if now < self.deadline else "at the run's deadline"
                        self.record(current, "hung", now - started, f"killed {why} ({self.case_limit:.0f} s a case)",
                                    after=previous)
                        self.tail(current, lines)
                    return False
                if not selector.select(timeout=max(0.0, limit - now)):
                    continue
                data = os.read(fd, 65536)
                if not data:
                    proc.wait()
                    if current:  # it died inside a case
                        self.record(current, "crashed", time.monotonic() - started,
                                    f"the process ended with status {proc.returncode} inside this case", after=previous)
                        self.tail(current, lines)
                        return False
                    return True
                pending += data
                *complete, pending = pending.split(b"\n")
                for raw in complete:
                    line = raw.decode(errors="replace") + "\n"
                    if self.log:
                        self.log.write(line)
                    lines = (lines + [line])[-40:]
                    if m := RUN.match(line):
                        current, started, lines = m.group(1), time.monotonic(), [line]
                    elif (m := END.match(line)) and m.group(2) == current:
                        outcome = OUTCOME[m.group(1)]
                        self.record(current, outcome, time.monotonic() - started,
                                    "".join(lines[-12:]) if outcome == "failed" else "")
                        previous, current = current, None
        finally:
            selector.close()
            if proc.poll() is None:
                self.kill(proc)
            proc.stdout.close()

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def tail(self, case: str, lines: List[str]) -> None:
        if self.log:
            self.log.write(f"gtest_watch: {case}: {self.outcome[case]}; its last output:\n" + "".join(lines[-12:]))


def summary(outcome: Dict[str, str], seconds: float, detail: Optional[Dict[str, str]] = None) -> str:
    counts: Dict[str, int] = {}
    for o in outcome.values():
        counts[o] = counts.get(o, 0) + 1
    order = ["passed", "skipped", "failed", "hung", "crashed", "not reported", "not run"]
    lines = ["| cases | " + " | ".join(order) + " | seconds |", "|---:|" + "---:|" * len(order) + "---:|",
             f"| {len(outcome)} | " + " | ".join(str(counts.get(o, 0)) for o in order) + f" | {seconds:.0f} |"]
    bad = [(c, o) for c, o in outcome.items() if o not in ("passed", "skipped")]
    if bad:
        detail = detail or {}
        lines += ["", "Not passed:"] + [f"- `{c}`: {o}" + (f" ({detail[c]})" if c in detail else "") for c, o in bad[:50]]
        if len(bad) > 50:
            lines.append(f"- and {len(bad) - 50} more")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("binary")
    p.add_argument("--filter", default="*", help="the gtest filter of the cases to run")
    p.add_argument("--case-limit", type=float, required=True, help="seconds one case may take")
    p.add_argument("--deadline", type=float, required=True, help="seconds the whole run may take")
    p.add_argument("--results", required=True, help="JSON lines, one a case as it ends (appended)")
    p.add_argument("--log", help="the processes' output (appended)")
    p.add_argument("--summary", help="a markdown table of the outcomes (written at the end)")
    args = p.parse_args(argv)
    start = time.monotonic()
    cases = listed(args.binary, args.filter)
    watch = Watch(args.binary, args.case_limit, start + args.deadline, args.results, args.log)
    watch.run(cases)
    text = summary(watch.outcome, time.monotonic() - start, watch.detail)
    if args.summary:
        with open(args.summary, "w") as f:
            f.write(text)
    sys.stdout.write(text)
    return 0 if all(o in ("passed", "skipped") for o in watch.outcome.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
