"""Variants on demand: any layout x model x dtype, generated and compiled when first asked for.

    d = kvforge.variant("vllm_paged_nhd", {"layers": 2, "kv_heads": 1, "head_dim": 80, "max_seq_len": 256}, "bf16")
    cache = kvforge.create(d.name, pages=64)

The layout is a default layout's name, a spec file's path or a dict of a spec's fields; the model is the
same, or an HF `PretrainedConfig`. The same codegen as the build expands that one variant, the C++
compiler builds its CPU kernels into a shared library (for the x86-64 level this process runs at, in one
compile), and the library joins the registry, so that create(), describe() and KvforgeCache see it.

Libraries are cached on disk (KVFORGE_CACHE_DIR, else ~/.cache/kvforge), keyed by a hash of everything
that shapes them: the specs, the dtypes, kvforge's codegen and runtime headers, the compiler, its flags
and this module's native library. A second process finds them; two processes building one key at once
build it once (a file lock); an entry whose library does not match its recorded hash is rebuilt, never
loaded. See docs/on_demand.md.
"""

import os

from . import _native
from ._paths import CXX, DEVICE, INCLUDE, SPECS
from .errors import ArgumentError, BackendError, SpecError, UnsupportedError
from .specs import import_codegen

import_codegen()
from kvforge_codegen import on_demand  # noqa: E402  (the build machinery that C++'s kvforge::variant shares)

cache_dir = on_demand.cache_dir


# transformers' layer types (DynamicCache's): those that keep K and V per token, those that keep a state
# per sequence (kvforge.StatePool), and those that keep nothing.
ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention")
STATE_TYPES = ("linear_attention", "conv")
CACHELESS_TYPES = ("dummy", "moe", "mlp")


def layer_types(text):
    """Each layer's transformers layer type, as DynamicCache(config) reads it: `layer_types`, or sliding and
    full attention from the config's window. A type kvforge does not serve raises UnsupportedError."""
    types = getattr(text, "layer_types", None)
    if types is None:
        window = getattr(text, "sliding_window", None)
        types = ["sliding_attention" if window is not None else "full_attention"] * int(text.num_hidden_layers)
    types = list(types)
    for layer, kind in enumerate(types):
        if kind not in ATTENTION_TYPES + STATE_TYPES + CACHELESS_TYPES:
            raise UnsupportedError(f"config.layer_types[{layer}]: '{kind}' is no layer type kvforge serves (allowed: "
                                   f"{', '.join(ATTENTION_TYPES + STATE_TYPES + CACHELESS_TYPES)})")
    return types


def model_spec(config, name=None, max_seq_len=None, kv_heads_per_layer=None):
    """A model spec (dict) from an HF PretrainedConfig: its attention layers, KV heads, head_dim (and
    v_head_dim, where V is another width than K: MiMo-V2-Flash), windows; an MLA model's latent record
    (`mla`) instead of heads.

    Mixed sliding and global layers (transformers' layer_types) become layer_groups `local` and `global`. A
    hybrid model's linear-attention and state-space layers keep no K/V: the spec counts the attention
    layers only, in order (their states live in kvforge.StatePool slots).

    kv_heads_per_layer: each model layer's KV heads (None for a layer without K/V), where they differ from
    the config's num_key_value_heads (MiMo-V2-Flash's sliding layers keep twice its full layers'; the
    config does not say so, a forward does: KvforgeCache.from_model reads them from one). Layers of
    other heads then form groups of their own, each with its `kv_heads` (`local_4`, `global_2`, ... where
    one kind of layer holds several), and the model's kv_heads are its global layers'.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = head_dim_of(text)
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    types = [t for t in layer_types(text) if t in ATTENTION_TYPES]
    if not types:
        raise UnsupportedError("config: the model has no attention layer, so no K/V to cache")
    spec = {"layers": len(types), "max_seq_len": int(max_seq_len or getattr(text, "max_position_embeddings", 0) or 4096)}
    mla = mla_record(text)
    if mla:  # transformers caches an MLA model's latent (kv_nope, then k_rot), one record a token
        spec["mla"] = {"kv_lora_rank": mla[0], "qk_rope_head_dim": mla[1]}
    else:
        heads = [int(kv_heads)] * len(types)
        if kv_heads_per_layer is not None:
            heads = [int(h) for t, h in zip(layer_types(text), kv_heads_per_layer) if t in ATTENTION_TYPES]
        spec.update(kv_heads=heads[0], head_dim=int(head_dim))
        if kv_widths(text):
            spec["v_head_dim"] = kv_widths(text)[1]
    window = getattr(text, "sliding_window", None)
    window = min(int(window), spec["max_seq_len"]) if window is not None else None
    sliding = [window is not None and t == "sliding_attention" for t in types]
    if mla:
        heads = [1] * len(types)  # the record has no heads
    # A group per kind of layer (sliding or not) and head count; the local ones first.
    kinds = sorted(set(zip(sliding, heads)), key=lambda k: (not k[0], heads.index(k[1])))
    if len(kinds) == 1:
        if sliding[0]:
            spec["sliding_window"] = window
    else:
        if not mla:
            spec["kv_heads"] = next((h for s, h in zip(sliding, heads) if not s), heads[0])
        groups = []
        for local, h in kinds:
            kind = "local" if local else "global"
            several = len({k for k in kinds if k[0] == local}) > 1
            group = {"name": f"{kind}_{h}" if several else kind,
                     "layers": [i for i, key in enumerate(zip(sliding, heads)) if key == (local, h)]}
            if local:
                group["sliding_window"] = window
            if not mla and h != spec["kv_heads"]:
                group["kv_heads"] = h
            groups.append(group)
        spec["layer_groups"] = groups
    spec["name"] = name or on_demand.named_by_content(spec, "hf_")
    return spec


def head_dim_of(text):
    """K's width a head: the config's head_dim, else hidden_size over the attention heads."""
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def kv_widths(text):
    """(head_dim, v_head_dim) of a K/V model whose V is another width than its K (MiMo-V2-Flash: 192 and
    128); None where they are one width, or the model is MLA (its v_head_dim is the decompressed V's)."""
    v_head_dim = getattr(text, "v_head_dim", None)
    if mla_record(text) or not v_head_dim or int(v_head_dim) == head_dim_of(text):
        return None
    return head_dim_of(text), int(v_head_dim)


def layout_groups(layout):
    """The layer groups a hybrid layout (a default's name, a spec file, or a dict) keeps a member cache for,
    in its order; () for any other layout."""
    try:
        spec = on_demand.spec_of("layout", layout, "layouts", SPECS) if isinstance(layout, (str, os.PathLike)) else layout
    except on_demand.OnDemandError as e:
        raise _raised(e) from None
    return tuple(spec.get("groups", {})) if isinstance(spec, dict) else ()


def by_group(layout, groups):
    """`layout` for a model whose layer groups keep different KV heads: a hybrid layout naming `layout` for
    every group, so that each group is a member cache of its own heads. A hybrid layout stays itself."""
    try:
        spec = on_demand.spec_of("layout", layout, "layouts", SPECS) if isinstance(layout, (str, os.PathLike)) else layout
    except on_demand.OnDemandError as e:
        raise _raised(e) from None
    if isinstance(spec, dict) and "groups" in spec:
        return layout
    if not isinstance(layout, (str, os.PathLike)):
        raise UnsupportedError("layout: the model's layer groups keep different KV heads, which takes a member "
                               "cache a group; give the layout as a default's name or a spec file's path")
    name = spec.get("name") if isinstance(spec.get("name"), str) else os.path.splitext(os.path.basename(layout))[0]
    return {"name": f"{name}_by_group", "groups": {g["name"]: os.fspath(layout) for g in groups}}


def mla_record(text):
    """(kv_lora_rank, qk_rope_head_dim) of a multi-head latent attention model's text config (DeepSeek-V2/V3,
    Kimi, GLM-4-MoE-Lite, ...), whose layers cache that latent record; None for a K/V model."""
    rank, rope = getattr(text, "kv_lora_rank", None), getattr(text, "qk_rope_head_dim", None)
    return (int(rank), int(rope)) if rank and rope else None


def index_key_width(text):
    """index_head_dim of a model with DeepSeek sparse attention (`indexed_attention` layers: V3.2, GLM-5, ...),
    whose indexer caches one key of that width a token beside the attention's record; None for another."""
    if "indexed_attention" not in layer_types(text):
        return None
    return int(text.index_head_dim)


_ERRORS = {"argument": ArgumentError, "unsupported": UnsupportedError, "backend": BackendError}


def _raised(e):
    """The Python error of an on_demand.OnDemandError."""
    if e.kind == "spec":
        return SpecError(e.lines)
    return _ERRORS[e.kind](str(e))


def variant(layout, model, dtype, input=None, *, window=None, name=None):
    """The variant `layout` x `model` x `dtype`, built and loaded on first use; returns its Descriptor.

    layout: a default layout's name, a layout spec file's path, or a dict of its fields. A hybrid layout's
        groups name default layouts (or spec files); the model then needs layer groups of those names.
    model: a default model's name, a model spec file's path, a dict of its fields (`name` optional), or
        an HF PretrainedConfig (kvforge.jit.model_spec reads it).
    dtype: the storage dtype (fp32, fp16, bf16, int8, fp8_e4m3, fp8_e5m2, fp4_e2m1, int4, uint4), or a record
        format the layout's `records` define (flashmla_fp8, indexer_fp8, a user's; docs/specs.md says which
        layouts and models each takes); input: the dtype appended and
        gathered (default: dtype; quantized storage needs one). window: a ring layout's window in positions
        (default: the layout's own). name: the layout's name in the variant's (default: the spec's).
    Raises SpecError with every `file:line: field: problem` of the specs, BackendError where no compiler
    is found or the build fails.
    """
    if not isinstance(model, (dict, str, os.PathLike)) and (hasattr(model, "num_hidden_layers") or
                                                            hasattr(model, "get_text_config")):
        model = model_spec(model)
    try:
        layouts, model_spec_, wanted = on_demand.request(
            on_demand.spec_of("layout", layout, "layouts", SPECS), on_demand.spec_of("model", model, "models", SPECS),
            dtype, input, window, name, SPECS)
        compiler = on_demand.compiler_identity(CXX)
        if compiler is None:
            raise on_demand.no_compiler(CXX, wanted)
        native = os.path.abspath(_native.__file__)
        # The runtime is the native module's: the library names it, so that its symbols resolve there.
        link = [native, f"-Wl,-rpath,{os.path.dirname(native)}"]
        device = on_demand.device_of(DEVICE, wanted)  # a device backend's kernels too, where the runtime has one
        level = _native.cpu_level()  # the library's CPU kernels: the level this process runs at, only
        key = on_demand.key_of(layouts, model_spec_, INCLUDE, compiler, link, device, level)
        if wanted in set(_native.variants()):
            # Registered already: a default asked for by name, or a library loaded before from these very specs.
            if (_defaults(layout, model) and name is None and window is None) or _built.get(wanted) == key:
                return _native.describe(wanted)
            raise ArgumentError(f"name: {wanted} is registered already, from other specs; give the layout or the "
                                f"model a name of its own (variant(..., name=...), or the model's `name`)")
        path, registry_function = on_demand.library(layouts, model_spec_, wanted, key, compiler=compiler[0],
                                                    include=INCLUDE, link=link, device=device, cpu_level=level)
    except on_demand.OnDemandError as e:
        raise _raised(e) from None
    names = _native.load_variants(path, registry_function)
    if wanted not in names:
        raise BackendError(f"{os.path.dirname(path)}: built {names}, not {wanted}")
    _built[wanted] = key
    return _native.describe(wanted)


_built = {}  # variant name -> the key its library was built for, in this process


def __getattr__(attribute):
    if attribute == "builds":  # libraries this process built (not found on disk)
        return on_demand.builds
    raise AttributeError(attribute)


def _defaults(layout, model):
    """Both given by a default's name."""
    return all(isinstance(v, str) and on_demand.NAME.fullmatch(v) and not os.path.isfile(v) for v in (layout, model))
