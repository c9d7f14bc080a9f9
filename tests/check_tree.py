"""Rules of the source tree that no compiler checks (ctest tree.rules):

- No hand-written file is over 500 lines (generated/ and data are not hand-written).
- The README is under 150 lines: a front page, whose figures and history live in bench/RESULTS.md.
- Shared runtime code holds no CUDA: `__CUDA_ARCH__`, `__CUDACC__`, CUDA's headers and intrinsics live
  only in the CUDA backend's folders (runtime/include/kvforge/backends/cuda/, runtime/src/backends/cuda/).
  The same patterns must find CUDA there, or the check has gone blind.
- The public headers (runtime/include/kvforge/*.hpp) reach no kernel code, however deep their includes
  go: no backend's target or hooks (kvforge/backends/, detail/config.hpp, which picks the target) and so
  no codec or kernel body, all of which include that. They may take detail/qualifiers.hpp, the two
  function qualifiers element code is written with.
- The runtime's folders by job depend one way: each file of runtime/src/<folder>/, and each public or
  detail header (whose folder is its source's, or LAYER_OF_HEADER's), includes only headers of its own
  layer or one before it in LAYERS.
- Builds on demand name no backend: the on-demand machinery (ON_DEMAND_FILES) holds no device compiler,
  its flags or its runtime library (DEVICE_TOOLS); those are a backend's row of codegen's vocab.BACKENDS
  (`on_demand`), where the same pattern must find CUDA's, and the build's CUDA block. So a new backend
  is its folders, its row and its build block (docs/design.md, "What a contributor edits").
- The Python package's modules import each other one way: no cycle among python/kvforge/*.py, imports
  inside functions counted too (the package's __init__, its public face, is not one of them).
"""
import ast
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
ON_DEMAND_FILES = ("codegen/kvforge_codegen/on_demand.py", "codegen/kvforge_codegen/__main__.py", "python/kvforge/jit.py",
                   "runtime/include/kvforge/on_demand.hpp", "runtime/src/variants/on_demand.cpp", "cmake/install.cmake",
                   "python/CMakeLists.txt")
DEVICE_TOOLS = re.compile(r"nvcc|cudart|generate-code|-Xcompiler|--extended-lambda|\.cu\b|\bsm_\d|hipcc|amdhip", re.I)
BACKEND_ROWS = "codegen/kvforge_codegen/vocab.py"


INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
KERNEL_HEADERS = re.compile(r"^kvforge/(backends/|detail/config\.hpp$)")


def kernel_includes(header, include_root):
    """The include chain from `header` (a path under include_root) to the first kernel header it
    reaches, or None."""
    seen, stack = set(), [(header, [header])]
    while stack:
        name, chain = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        path = include_root / name
        for included in INCLUDE.findall(path.read_text()) if path.is_file() else []:
            if not included.startswith("kvforge/"):
                continue
            if KERNEL_HEADERS.match(included):
                return chain + [included]
            stack.append((included, chain + [included]))
    return None


# runtime/src's folders, in the order they may use each other: a layer includes its own and earlier ones.
LAYERS = (
    ("base", "errors, element types, the address formula, the backend interface, the device status word"),
    ("ranks", "Transport's collectives and the MPI transport"),
    ("kernels", "the one kernel source (detail/), the targets it compiles for, host-side index checks"),
    ("backends", "each backend's executor, memory and step building (backends/<name>/)"),
    ("caches", "Cache, TypedCache, the generic path, paired and hybrid caches, the physical wire"),
    ("variants", "the registry, variant libraries, variants built on demand"),
    ("memory", "block allocator, block hashes, prefix cache, memory plans"),
    ("tiers", "host and disk block stores, read-ahead, promotion ahead"),
    ("sequences", "SequenceManager and the hybrid one, step state, KV events"),
    ("states", "state pools and state slots of hybrid models"),
    ("scale_out", "tensor-parallel shards and transfers between ranks"),
)
# Public and detail headers with no source of their own name, by layer (kvforge.hpp, the whole API, has
# none).
LAYER_OF_HEADER = {
    "vocab.hpp": "base", "dtype.hpp": "base", "tensor.hpp": "base", "descriptor.hpp": "base", "quant.hpp": "base",
    "record_format.hpp": "base",
    "detail/qualifiers.hpp": "base", "transport.hpp": "ranks", "cache_ops.hpp": "caches",
    "detail/cache_impl.hpp": "caches", "detail/typed_cache.hpp": "caches", "detail/typed_cache_writes.hpp": "caches",
    "detail/typed_cache_gather.hpp": "caches", "detail/typed_cache_upkeep.hpp": "caches",
    "detail/typed_cache_attend.hpp": "caches", "attend.hpp": "caches", "kv_events.hpp": "sequences",
    "memory.hpp": "sequences", "hybrid.hpp": "sequences", "kvforge.hpp": None,
}


def layer_problems(root):
    """Each include that runs against LAYERS, and each file no layer holds."""
    order = [name for name, _ in LAYERS]
    src, include = root / "runtime" / "src", root / "runtime" / "include"

    def folder(path):
        return path.relative_to(src).parts[0]
    by_source = {p.stem: folder(p) for p in src.rglob("*") if p.suffix in (".cpp", ".cu")}

    def header_layer(name):  # "kvforge/..."
        rel = name[len("kvforge/"):]
        if rel.startswith("backends/"):  # a target answers the kernels' questions; the rest runs them
            return "kernels" if "/target." in rel else "backends"
        if rel in LAYER_OF_HEADER:
            return LAYER_OF_HEADER[rel]
        stem = pathlib.Path(rel).stem
        return by_source.get(stem, "kernels" if rel.startswith("detail/") else "?")

    files = [(p, folder(p)) for p in src.rglob("*") if p.suffix in (".cpp", ".hpp", ".cu", ".cuh")]
    files += [(p, header_layer("kvforge/" + p.relative_to(include / "kvforge").as_posix()))
              for p in (include / "kvforge").rglob("*") if p.suffix in (".hpp", ".cuh")]
    problems = []
    for path, layer in files:
        where = path.relative_to(root)
        if layer is None:
            continue
        if layer not in order:
            problems.append(f"{where}: in no layer (add its folder to LAYERS, or the header to LAYER_OF_HEADER)")
            continue
        for name in INCLUDE.findall(path.read_text()):
            if name.startswith("kvforge/"):
                other = header_layer(name)
            else:  # a private header, named from runtime/src or from the file's own folder
                found = [q.resolve() for q in (src / name, path.parent / name) if q.is_file()]
                if not found or not found[0].is_relative_to(src.resolve()):
                    continue  # a system or test header
                other = found[0].relative_to(src.resolve()).parts[0]
            if other is not None and (other not in order or order.index(other) > order.index(layer)):
                problems.append(f"{where}: includes {name} of layer {other}, after its own {layer} "
                                "(move the code, or split the header, so that layers use only earlier ones)")
    return problems


def tracked_files():
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [p for p in out if not p.startswith("generated/") and (ROOT / p).is_file()]


def _package_imports(folder):
    """{module: the package's other modules it imports}, for every module of a flat package but __init__."""
    modules = {p.stem: p for p in folder.glob("*.py") if p.stem != "__init__"}
    package = folder.name
    edges = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    found |= {a.name for a in node.names} if node.module is None else {node.module.split(".")[0]}
                elif node.module == package:
                    found |= {a.name for a in node.names}
                elif node.module and node.module.startswith(package + "."):
                    found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith(package + ".")}
        edges[name] = sorted(found & modules.keys() - {name})
    return edges


def import_cycles(folder):
    """Each cycle among a package's modules, as the list of modules around it."""
    edges, state, path, cycles = _package_imports(folder), {}, [], []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for other in edges[module]:
            if state.get(other) == "open":
                cycles.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other)
        path.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)
    return cycles


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
    for path in ON_DEMAND_FILES + (BACKEND_ROWS,):
        text = (ROOT / path).read_text(errors="replace")
        hits = [(n + 1, m.group(0)) for n, line in enumerate(text.splitlines()) for m in [DEVICE_TOOLS.search(line)] if m]
        if path == BACKEND_ROWS and not hits:
            problems.append(f"{path}: no device compiler's flags found: the on-demand check has gone blind")
        elif path != BACKEND_ROWS:
            problems += [f"{path}:{n}: {word}: a device backend's tool in the on-demand machinery (its row of "
                         f"{BACKEND_ROWS}'s BACKENDS says it)" for n, word in hits]
    include_root = ROOT / "runtime" / "include"
    for header in sorted((include_root / "kvforge").glob("*.hpp")):
        chain = kernel_includes(str(header.relative_to(include_root)), include_root)
        if chain:
            problems.append(f"{' -> '.join(chain)}: a public header reaches kernel code (move what it needs "
                            "into a header of plain declarations)")
    problems += layer_problems(ROOT)
    if not kernel_includes("kvforge/detail/ops.hpp", include_root):
        problems.append("kvforge/detail/ops.hpp reaches no kernel header: the include check has gone blind")
    problems += [f"python/kvforge: {' -> '.join(c)}: an import cycle (layer the modules so that imports run one way)"
                 for c in import_cycles(ROOT / "python" / "kvforge")]
    for p in problems:
        print(p, file=sys.stderr)
    print(f"tree.rules: {len(files)} files, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
