"""Rules of the source tree that no compiler checks (ctest tree.rules):

- No hand-written file is over 500 lines (generated/ and data are not hand-written).
- The README is under 150 lines: a front page, whose figures and history live in bench/RESULTS.md.
- Shared runtime code holds no CUDA: `__CUDA_ARCH__`, `__CUDACC__`, CUDA's headers and intrinsics live
  only in the CUDA backend's folders (runtime/include/kvforge/backends/cuda/, runtime/src/backends/cuda/).
  The same patterns must find CUDA there, or the check has gone blind.
"""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 500
README_LINES = 150
SOURCE_SUFFIXES = {".cpp", ".hpp", ".cu", ".cuh", ".py", ".j2", ".cmake", ".sh"}
CUDA = re.compile(r"__CUDA_ARCH__|__CUDACC__|#include <cuda|__syncthreads|__shfl|__stcg|__ldg|atomicCAS|"
                  r"threadIdx|blockIdx|__device__|__global__|griddepcontrol|__nv_|__float2int")
CUDA_FOLDERS = ("runtime/include/kvforge/backends/cuda/", "runtime/src/backends/cuda/")


def tracked_files():
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [p for p in out if not p.startswith("generated/") and (ROOT / p).is_file()]


def main() -> int:
    problems = []
    files = tracked_files()
    for path in files:
        if pathlib.Path(path).suffix in SOURCE_SUFFIXES or path.startswith("tools/"):
            lines = (ROOT / path).read_text(errors="replace").count("\n")
            if lines > MAX_LINES:
                problems.append(f"{path}: {lines} lines (at most {MAX_LINES}: split it by job)")
    readme = (ROOT / "README.md").read_text().count("\n")
    if readme >= README_LINES:
        problems.append(f"README.md: {readme} lines (under {README_LINES}: move figures and history to bench/RESULTS.md)")
    found_in_cuda = False
    for path in files:
        if not path.startswith("runtime/"):
            continue
        text = (ROOT / path).read_text(errors="replace")
        hits = [(n + 1, m.group(0)) for n, line in enumerate(text.splitlines()) for m in [CUDA.search(line)] if m]
        if path.startswith(CUDA_FOLDERS):
            found_in_cuda = found_in_cuda or bool(hits)
        else:
            problems += [f"{path}:{n}: {word}: CUDA outside the CUDA backend's folders" for n, word in hits]
    if not found_in_cuda:
        problems.append(f"no CUDA found in {' or '.join(CUDA_FOLDERS)}: the pattern no longer sees it")
    for p in problems:
        print(p, file=sys.stderr)
    print(f"tree.rules: {len(files)} files, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
