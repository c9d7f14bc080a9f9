"""The kernels built for each x86-64 level stay apart in the link: a symbol two objects both define is
kept once, so a wider level's body must never be able to stand in for a narrower one's.

Checks, over every object file of the variants library:
  - every symbol a <variant>.cpu_v<N>.cpp object defines belongs to level N's kernels;
  - no other object defines a kernel of a level above the base.
Usage: check_cpu_levels.py <base level> <object files...>
"""

import re
import subprocess
import sys

LEVEL_FILE = re.compile(r"\.cpu_v(\d+)\.cpp\.o$")
KERNEL_LEVEL = re.compile(r"CpuExec<(\d+)>|cpu_kernels<.*, (\d+)>\(\)")


def defined_symbols(obj):
    """The code an object defines for the linker to see: global and weak functions (nm types T, W, i).
    Weak data such as DW.ref.__gxx_personality_v0 (the exception personality's address, type V) is the
    same bytes in every object, so the linker keeping any one of them is harmless."""
    out = subprocess.run(["nm", "-C", "--defined-only", "-g", obj], check=True, capture_output=True, text=True).stdout
    fields = [line.split(" ", 2) for line in out.splitlines() if line.count(" ") >= 2]
    return [name for _, kind, name in fields if kind in ("T", "W", "i")]


def levels_named(symbol):
    return {int(a or b) for a, b in KERNEL_LEVEL.findall(symbol)}


def main(argv):
    # Object files only: CMake lists a precompiled header's .gch among an object library's objects.
    base, objects = int(argv[1]), [o for o in argv[2:] if o.endswith(".o")]
    problems, wide_files = [], 0
    for obj in objects:
        file_level = LEVEL_FILE.search(obj)
        for symbol in defined_symbols(obj):
            named = levels_named(symbol)
            if file_level:
                if named != {int(file_level.group(1))}:
                    problems.append(f"{obj}: defines {symbol}, which is not level {file_level.group(1)}'s kernel")
            elif any(level > base for level in named):
                problems.append(f"{obj}: built for the base level, but defines {symbol}")
        wide_files += bool(file_level)
    if wide_files == 0:
        problems.append("no <variant>.cpu_v<N>.cpp object among the arguments: nothing was checked")
    for p in problems:
        print(p)
    print(f"{len(objects)} objects, {wide_files} of wider levels: {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
