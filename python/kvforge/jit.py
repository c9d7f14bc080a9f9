"""Variants on demand: any layout x model x dtype, generated and compiled when first asked for.

    d = kvforge.variant("vllm_paged_nhd", {"layers": 2, "kv_heads": 1, "head_dim": 80, "max_seq_len": 256}, "bf16")
    cache = kvforge.create(d.name, pages=64)

The layout is a default layout's name, a spec file's path or a dict of a spec's fields; the model is the
same, or an HF `PretrainedConfig`. The same codegen as the build expands that one variant, the C++
compiler builds its CPU kernels into a shared library (every x86-64 level, picked at run time as in the
build), and the library joins the registry, so that create(), describe() and KvforgeCache see it.

Libraries are cached on disk (KVFORGE_CACHE_DIR, else ~/.cache/kvforge), keyed by a hash of everything
that shapes them: the specs, the dtypes, kvforge's codegen and runtime headers, the compiler, its flags
and this module's native library. A second process finds them; two processes building one key at once
build it once (a file lock); an entry whose library does not match its recorded hash is rebuilt, never
loaded. See docs/on_demand.md.
"""

import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import yaml

from . import _native
from ._paths import CODEGEN, CXX, INCLUDE, SPECS
from .errors import ArgumentError, BackendError, SpecError, UnsupportedError
from .specs import import_codegen

# What the build gives every kernel file (cmake/kvforge.cmake's KVFORGE_KERNEL_OPTIONS), and the levels
# it builds: the base file at x86-64-v2, <variant>.cpu_v<N>.cpp at level N.
FLAGS = ("-std=c++17", "-O3", "-DNDEBUG", "-fPIC", "-fopenmp", "-fno-trapping-math")
_LEVEL_FILE = re.compile(r"\.cpu_v(\d+)\.cpp$")
_BASE_LEVEL = 2
_NAME = re.compile(r"[a-z][a-z0-9_]*")


def cache_dir():
    """Where built variants are kept: KVFORGE_CACHE_DIR, else ~/.cache/kvforge (XDG_CACHE_HOME respected)."""
    if os.environ.get("KVFORGE_CACHE_DIR"):
        return os.environ["KVFORGE_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvforge")


def model_spec(config, name=None, max_seq_len=None):
    """A model spec (dict) from an HF PretrainedConfig: layers, KV heads, head_dim, windows.

    Mixed sliding and global layers (transformers' layer_types) become layer_groups `local` and `global`.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    spec = {"layers": int(text.num_hidden_layers), "kv_heads": int(kv_heads), "head_dim": int(head_dim),
            "max_seq_len": int(max_seq_len or getattr(text, "max_position_embeddings", 0) or 4096)}
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is None and window is not None:
        types = ["sliding_attention"] * spec["layers"]
    if types is not None and window is not None:
        local = [i for i, t in enumerate(types) if t == "sliding_attention"]
        window = min(int(window), spec["max_seq_len"])
        if len(local) == spec["layers"]:
            spec["sliding_window"] = window
        elif local:
            spec["layer_groups"] = [{"name": "local", "layers": local, "sliding_window": window},
                                    {"name": "global", "layers": [i for i in range(spec["layers"]) if i not in local]}]
    spec["name"] = name or _named_by_content(spec, "hf_")
    return spec


def _named_by_content(spec, prefix):
    """A model name for a spec that has none: its fields' hash, so that one model gets one name."""
    return prefix + hashlib.sha256(repr(sorted(spec.items())).encode()).hexdigest()[:10]


def _spec(what, value, kind):
    """A spec dict from a default's name, a file's path, a dict, or (models) an HF config."""
    if isinstance(value, dict):
        return dict(value)
    if kind == "models" and (hasattr(value, "num_hidden_layers") or hasattr(value, "get_text_config")):
        return model_spec(value)
    if not isinstance(value, (str, os.PathLike)):
        raise ArgumentError(f"{what}: expected a default's name, a spec file's path or a dict"
                            f"{' or an HF config' if kind == 'models' else ''}, got {type(value).__name__}")
    path = os.fspath(value)
    if not os.path.isfile(path):
        default = os.path.join(SPECS, kind, path + ".yaml")
        if not _NAME.fullmatch(path) or not os.path.isfile(default):
            known = sorted(f[:-5] for f in os.listdir(os.path.join(SPECS, kind)) if f.endswith(".yaml"))
            raise ArgumentError(f"{what}: {path!r} is neither a spec file nor a default {kind[:-1]} "
                                f"(defaults: {', '.join(known)})")
        path = default
    with open(path, "r", encoding="utf-8") as f:
        spec = yaml.safe_load(f)
    if not isinstance(spec, dict):
        raise SpecError([f"{path}:1: {kind[:-1]}: expected a mapping of the spec's fields"])
    return spec


@functools.lru_cache(maxsize=None)
def _vocab():
    """The spec compiler's vocabulary (dtypes and their kinds)."""
    import_codegen()
    from kvforge_codegen import vocab
    return vocab


@functools.lru_cache(maxsize=None)  # read once a process: the installed files do not change under it
def _digest_of_sources():
    """kvforge's codegen, templates and runtime headers: what shapes the generated code besides the specs."""
    h = hashlib.sha256()
    for root in (os.path.join(CODEGEN, "kvforge_codegen"), os.path.join(CODEGEN, "templates"),
                 os.path.join(INCLUDE, "kvforge")):
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            if os.path.isfile(path):
                h.update(name.encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


_compiler_identity = {}


def _compiler():
    if CXX not in _compiler_identity:
        found = shutil.which(CXX)
        if not found:
            _compiler_identity[CXX] = None
        else:
            out = subprocess.run([found, "--version"], capture_output=True, text=True)
            _compiler_identity[CXX] = (found, out.stdout.splitlines()[0] if out.stdout else "")
    return _compiler_identity[CXX]


def _sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _run(command, what):
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise BackendError(f"{what} failed ({' '.join(command[:3])} ...):\n{out.stderr[-4000:]}")
    return out


def _build(entry, layout, model, key, registry_function, compiler):
    """Generates the variant into a scratch folder beside `entry` and compiles it into entry/variants.so."""
    parent = os.path.dirname(entry)
    scratch = tempfile.mkdtemp(prefix=".build-", dir=parent)
    try:
        for kind, spec in (("layouts", layout), ("models", model)):
            os.makedirs(os.path.join(scratch, kind))
            with open(os.path.join(scratch, kind, spec["name"] + ".yaml"), "w", encoding="utf-8") as f:
                yaml.safe_dump(spec, f, sort_keys=False)
        generated = os.path.join(scratch, "generated")
        env = dict(os.environ, PYTHONPATH=CODEGEN + os.pathsep + os.environ.get("PYTHONPATH", ""))
        command = [sys.executable, "-m", "kvforge_codegen", "generate", "--layouts", os.path.join(scratch, "layouts"),
                   "--models", os.path.join(scratch, "models"), "--tuning", "--backends", "cpu",
                   "--source-root", scratch, "--out", generated, "--registry-function", registry_function]
        out = subprocess.run(command, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise SpecError([line for line in out.stderr.splitlines() if line.strip()])
        sources = sorted(f for f in os.listdir(generated) if f.endswith(".cpp"))
        # The base-level files (the variant's class and base kernels, and the registry) in one unit: the
        # runtime's headers are parsed once for both, and the wider levels compile beside it.
        base = [f for f in sources if not _LEVEL_FILE.search(f)]
        with open(os.path.join(generated, "base_unit.cpp"), "w", encoding="utf-8") as f:
            f.writelines(f'#include "{name}"\n' for name in base)
        sources = ["base_unit.cpp"] + [f for f in sources if _LEVEL_FILE.search(f)]

        def compile_one(source):
            match = _LEVEL_FILE.search(source)
            level = int(match.group(1)) if match else _BASE_LEVEL
            obj = os.path.join(scratch, source + ".o")
            _run([compiler, *FLAGS, f"-march=x86-64-v{level}", "-I", generated, "-I", INCLUDE, "-c",
                  os.path.join(generated, source), "-o", obj], f"compiling {source}")
            return obj

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            objects = list(pool.map(compile_one, sources))
        native = os.path.abspath(_native.__file__)
        library = os.path.join(scratch, "variants.so")
        # The runtime is the native module's: the library names it, so that its symbols resolve there.
        _run([compiler, "-shared", "-fopenmp", "-o", library, *objects, native,
              f"-Wl,-rpath,{os.path.dirname(native)}"], "linking the variant library")
        with open(os.path.join(scratch, "key"), "w", encoding="utf-8") as f:
            f.write(f"{key}\n{_sha256_of(library)}\n")
        if os.path.isdir(entry):
            shutil.rmtree(entry)
        os.rename(scratch, entry)
    finally:
        if os.path.isdir(scratch):
            shutil.rmtree(scratch, ignore_errors=True)


def _intact(entry, key):
    """The entry holds a library built for `key` whose bytes are the ones recorded."""
    try:
        with open(os.path.join(entry, "key"), "r", encoding="utf-8") as f:
            recorded_key, recorded_hash = f.read().split()
        return recorded_key == key and recorded_hash == _sha256_of(os.path.join(entry, "variants.so"))
    except (OSError, ValueError):
        return False


def variant(layout, model, dtype, input=None, *, window=None, name=None):
    """The variant `layout` x `model` x `dtype`, built and loaded on first use; returns its Descriptor.

    layout: a default layout's name, a layout spec file's path, or a dict of its fields (not a hybrid
        layout: its groups name layouts of their own).
    model: a default model's name, a model spec file's path, a dict of its fields (`name` optional), or
        an HF PretrainedConfig (kvforge.jit.model_spec reads it).
    dtype: the storage dtype (fp32, fp16, bf16, int8, fp8_e4m3, fp8_e5m2); input: the dtype appended and
        gathered (default: dtype; quantized storage needs one). window: a ring layout's window in positions
        (default: the layout's own). name: the layout's name in the variant's (default: the spec's).
    Raises SpecError with every `file:line: field: problem` of the specs, BackendError where no compiler
    is found or the build fails.
    """
    layout_spec, model_spec_ = _spec("layout", layout, "layouts"), _spec("model", model, "models")
    if "groups" in layout_spec:
        raise UnsupportedError("layout: a hybrid layout's groups name layouts of their own; on demand builds "
                               "non-hybrid layouts (build hybrids with kvforge_generate)")
    if name is not None:
        layout_spec["name"] = name
    if window is not None:
        layout_spec["window"] = window
    if "name" not in model_spec_:
        model_spec_["name"] = _named_by_content(model_spec_, "m_")
    for what, spec in (("layout", layout_spec), ("model", model_spec_)):
        if not isinstance(spec.get("name"), str) or not _NAME.fullmatch(spec["name"]):
            raise ArgumentError(f"{what}: name {spec.get('name')!r} is not a lower-case identifier "
                                f"(allowed: letters a-z, digits and _, starting with a letter)")
    expand = {"models": [model_spec_["name"]], "dtypes": [dtype]}
    if input is not None:
        expand["input_dtypes"] = [input]
    layout_spec["expand"] = [expand]
    if not _vocab().DTYPES.get(dtype, {}).get("quantized", True):
        layout_spec.pop("quantization", None)  # a default's settings for its quantized expansions
    wanted = _native.variant_name(layout_spec["name"], model_spec_["name"], dtype, input or dtype)
    compiler = _compiler()
    if compiler is None:
        raise BackendError(f"compiler: {CXX} was not found, so kvforge cannot build {wanted} on demand; install "
                           f"g++ (apt-get install g++). Without one, the generic path serves a float eager layout "
                           f"for a model that registered variants have: kvforge.create(layout=..., model=..., "
                           f"storage=...)")
    key = hashlib.sha256(yaml.safe_dump([layout_spec, model_spec_], sort_keys=True).encode() +
                         repr((_digest_of_sources(), compiler, FLAGS, os.path.abspath(_native.__file__),
                               os.path.getmtime(_native.__file__))).encode()).hexdigest()
    if wanted in set(_native.variants()):
        # Registered already: a default asked for by name, or a library loaded before from these very specs.
        if (_defaults(layout, model) and name is None and window is None) or _built.get(wanted) == key:
            return _native.describe(wanted)
        raise ArgumentError(f"name: {wanted} is registered already, from other specs; give the layout or the "
                            f"model a name of its own (variant(..., name=...), or the model's `name`)")
    registry_function = f"kvforge_on_demand::registry_{key[:16]}"
    root = cache_dir()
    os.makedirs(root, exist_ok=True)
    entry = os.path.join(root, key[:32])
    if not _intact(entry, key):
        with open(os.path.join(root, key[:32] + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process building this key finishes first
            if not _intact(entry, key):
                _build(entry, layout_spec, model_spec_, key, registry_function, compiler[0])
                global builds
                builds += 1
    names = _native.load_variants(os.path.join(entry, "variants.so"), registry_function)
    if wanted not in names:
        raise BackendError(f"{entry}: built {names}, not {wanted}")
    _built[wanted] = key
    return _native.describe(wanted)


_built = {}  # variant name -> the key its library was built for, in this process
builds = 0  # libraries this process built (not found on disk)


def _defaults(layout, model):
    """Both given by a default's name."""
    return all(isinstance(v, str) and _NAME.fullmatch(v) and not os.path.isfile(v) for v in (layout, model))
