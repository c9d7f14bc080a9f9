"""`kvforge list` (the C++ descriptors, bytes per token from descriptor.hpp's bytes_per_token) and
`kvforge-codegen list` (the Python plan) must show the same variants with the same addressing, update
mode and bytes per token: two computations of one fact, held equal.

    python3 check_list_figures.py <kvforge binary> [codegen list options...]"""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows(lines):
    out = {}
    for line in lines:
        fields = line.split()
        if len(fields) >= 4 and "." in fields[0] and fields[-1].isdigit():
            out[fields[0]] = (fields[1], fields[2], int(fields[-1]))
    return out


def main() -> int:
    binary, extra = sys.argv[1], sys.argv[2:]
    cpp = subprocess.run([binary, "list"], capture_output=True, text=True, check=True).stdout.splitlines()
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "codegen"))
    py = subprocess.run([sys.executable, "-m", "kvforge_codegen", "list", *extra], capture_output=True, text=True,
                        env=env, check=True).stdout.splitlines()
    a, b = rows(cpp), rows(py)
    if not a:
        print("no variants in `kvforge list`", file=sys.stderr)
        return 1
    problems = [f"{n}: C++ {a.get(n)} vs codegen {b.get(n)}" for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n)]
    for p in problems:
        print(p, file=sys.stderr)
    print(f"{len(a)} variants compared, {len(problems)} differ")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
