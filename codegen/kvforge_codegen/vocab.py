"""The fixed vocabularies of the spec language, and their C++ spellings. One place for both."""

AXES = ("layer", "row", "seq", "page", "slot", "kv", "head", "dim")
# Backends, in the order of kvforge::Device: each instantiates a variant's kernels in a file of its own,
# from a template that fills the backend's OpTable (see docs/design.md, "A new backend").
# The backend table. Each backend's kernels file and its template, and the DLPack device types
# (DLDeviceType) whose memory it addresses, the first of them the one its arrays export as: kDLCPU 1,
# kDLCUDA 2, kDLCUDAHost 3 (pinned host memory is host memory). Its C++ entry points, <name>_backend()
# and <name>_available(), come from its folder runtime/src/backends/<name>/ (vocab.hpp declares them).
# A device backend's `on_demand` says how a variant built on demand (on_demand.py) gets its kernels: its
# compiler's flags, the flag for each target architecture ({target}), and what the library links
# ({lib}: the backend's library folder). The build says which compiler, targets and folder it has
# (CMake's KVFORGE_ON_DEMAND_DEVICE, "backend|compiler|targets|lib"); the CPU's are the host compiler's.
BACKENDS = {
    "cpu": {"file": "{name}.cpp", "template": "variant.cpp.j2", "dlpack": (1, 3)},  # also the host-side class
    "cuda": {"file": "{name}.cu", "template": "variant.cu.j2", "dlpack": (2,),
             "on_demand": {"flags": ("-std=c++17", "-O3", "-DNDEBUG", "-Xcompiler=-fPIC", "--extended-lambda",
                                     "--expt-relaxed-constexpr"),
                           "target": "--generate-code=arch=compute_{target},code=[compute_{target},sm_{target}]",
                           "link": ("-L{lib}", "-lcudart", "-Wl,-rpath,{lib}")}},
}
# x86-64 microarchitecture levels of the CPU kernels. The variant's own file builds them for the base
# level, which every x86-64 machine kvforge supports runs; each wider level gets a file of its own,
# built with that level's -march, and cpu_level.hpp picks the widest this CPU has, once, at run time.
CPU_BASE_LEVEL = 2
CPU_WIDE_LEVELS = (3, 4)
CPU_LEVEL_FILE = "{name}.cpu_v{level}.cpp"
assert CPU_WIDE_LEVELS == tuple(range(CPU_BASE_LEVEL + 1, max(CPU_WIDE_LEVELS) + 1)), "levels run without gaps"
ADDRESSING = ("contiguous", "ring", "paged")
UPDATE_MODES = ("eager", "lazy")

# Storage types: bytes per stored element, the values it holds (1 unless given), the C++ type that
# carries it, and whether it holds quantized codes (which need a float input dtype and a `quantization`
# block).
DTYPES = {
    "fp32": {"bytes": 4, "cpp": "float", "enum": "f32", "quantized": False},
    "fp16": {"bytes": 2, "cpp": "kvforge::fp16", "enum": "f16", "quantized": False},
    "bf16": {"bytes": 2, "cpp": "kvforge::bf16", "enum": "bf16", "quantized": False},
    "int8": {"bytes": 1, "cpp": "int8_t", "enum": "i8", "quantized": True},
    "fp8_e4m3": {"bytes": 1, "cpp": "kvforge::fp8_e4m3", "enum": "f8e4m3", "quantized": True},
    "fp8_e5m2": {"bytes": 1, "cpp": "kvforge::fp8_e5m2", "enum": "f8e5m2", "quantized": True},
    # 4-bit codes, two values a byte (low nibble first): "bytes" and "cpp" are one stored element's.
    "fp4_e2m1": {"bytes": 1, "values": 2, "cpp": "kvforge::fp4_e2m1x2", "enum": "f4e2m1", "quantized": True},
    "int4": {"bytes": 1, "values": 2, "cpp": "kvforge::int4x2", "enum": "i4", "quantized": True},
    # Asymmetric 4-bit codes 0..15 around each group's zero point (lmdeploy's int4 KV cache); a layout
    # that stores them says `zero_point: true`, and its scale entries hold a scale and a zero point.
    "uint4": {"bytes": 1, "values": 2, "cpp": "kvforge::uint4x2", "enum": "u4", "quantized": True,
              "zero_point": True},
}
INPUT_DTYPES = ("fp32", "fp16", "bf16")
QUANTIZED_DTYPES = tuple(k for k, v in DTYPES.items() if v["quantized"])

# A layout's record formats (`records`, docs/specs.md "Records of named parts"): a token's record, K then V
# of a head, as a list of named parts, each of its own width and dtype, codes with their own scales or
# values as they are. A format's name is a storage its expansions can list beside DTYPES; its variants
# store the record's bytes (the C++ type kvforge::record_byte), a head's K row its first half of bytes and
# V's its second.
# A part's dtype: codes that take scales (each with its largest code; fp4_e2m1 and int4 two to a byte,
# low nibble first), or floats stored as they are.
RECORD_CODE_DTYPES = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0, "fp4_e2m1": 6.0, "int4": 7.0}
RECORD_FLOAT_DTYPES = ("bf16", "fp16", "fp32")
RECORD_PART_DTYPES = tuple(RECORD_CODE_DTYPES) + RECORD_FLOAT_DTYPES
# A part's width: values, or a field of the model (an MLA model's two, a K/V model's K and V widths), or
# `rest`: what the record's other parts leave.
RECORD_WIDTHS = ("kv_lora_rank", "qk_rope_head_dim", "head_dim", "v_head_dim", "rest")
# A coded part's scale: its group (values that share one), its dtype, its rounding (`exact`: amax / the
# code's largest value; `pow2_up`: the smallest power of two at or above that, as OCP MX and FlashMLA
# round, which ue8m0 requires), the floor under amax, what a NaN does (`group`: its group's scale is NaN,
# as MX defines; `value`: only its own code), and where the scales live (in the record after the part's
# codes, or after the page's records, a token's scales one after another: vLLM's indexer pages).
RECORD_GROUP_SIZES = (8, 16, 32, 64, 128)
RECORD_SCALE_DTYPES = ("fp32", "bf16", "ue8m0")
RECORD_SCALE_ROUNDINGS = ("exact", "pow2_up")
RECORD_NAN_RULES = ("group", "value")
RECORD_SCALE_PLACES = ("record", "page_end")
RECORD_FIELDS = ("name", "parts")
RECORD_PART_FIELDS = ("name", "width", "dtype", "scale")
RECORD_SCALE_FIELDS = ("group", "dtype", "rounding", "amax_floor", "nan", "place")
MAX_RECORD_PARTS = 16

# Quantization: how many values share a scale, the scale's type, and where scales live. per_group
# shares a scale among `group_size` consecutive values of a head's row (OCP MX: 32).
GRANULARITIES = ("per_tensor", "per_token", "per_token_head", "per_group")
GROUP_SIZES = (16, 32, 64, 128)
# Scale types: bytes and C++ spelling as DTYPES gives them. ue8m0 (OCP MX's power of two) and fp8_e4m3
# (NVFP4's block scale, at most 448) round a dynamic scale up to their next value; neither holds a
# per_tensor scale a user sets.
SCALE_DTYPES = {
    "fp32": {"bytes": 4, "cpp": "float"},
    "bf16": {"bytes": 2, "cpp": "kvforge::bf16"},
    "ue8m0": {"bytes": 1, "cpp": "kvforge::ue8m0"},
    "fp8_e4m3": {"bytes": 1, "cpp": "kvforge::fp8_e4m3"},
}
DYNAMIC_ONLY_SCALE_DTYPES = ("ue8m0", "fp8_e4m3")
# What one stored scale is: a scale dtype, or (quantization `zero_point: true`) a scale and a zero point
# of that dtype side by side, one entry of twice its bytes. Zero points are whole numbers 0..15, exact in
# either dtype.
ZERO_POINT_SCALE_DTYPES = ("fp32", "bf16")
ZERO_POINT_GRANULARITIES = ("per_token_head", "per_group")
SCALE_ENTRIES = {
    **SCALE_DTYPES,
    **{f"{d}_zero": {"bytes": 2 * SCALE_DTYPES[d]["bytes"], "cpp": f"kvforge::ScaleZero<{SCALE_DTYPES[d]['cpp']}>"}
       for d in ZERO_POINT_SCALE_DTYPES},
}
ZERO_POINT_DTYPES = tuple(k for k, v in DTYPES.items() if v.get("zero_point"))
# A per_group layout's second-level scale: none, or one fp32 scale per layer and K/V that the user sets,
# under every group scale (NVFP4: value = code * group scale * tensor scale).
TENSOR_SCALES = ("none", "fp32")
SCALE_PLACEMENTS = ("separate", "in_page")

# Axes each addressing mode needs and forbids; `layer` and `kv` are optional for all.
REQUIRED_AXES = {
    "contiguous": ("row", "seq", "head", "dim"),
    "ring": ("row", "seq", "head", "dim"),
    "paged": ("page", "slot", "head", "dim"),
}
FORBIDDEN_AXES = {
    "contiguous": ("page", "slot"),
    "ring": ("page", "slot"),
    "paged": ("row", "seq"),
}

# The axes of a state pool of its own (a layout's `state_axes`), in the default order: slot-major, so that
# a sequence's whole state is one run.
STATE_AXES = ("slot", "layer", "part")

# Enums C++ mirrors in runtime/include/kvforge/vocab.hpp (generated from this table), in this order.
# Quant is the granularity, with `none` first for float storage.
CPP_ENUMS = (("Device", tuple(BACKENDS)), ("Axis", AXES), ("Addressing", ADDRESSING), ("UpdateMode", UPDATE_MODES),
             ("Quant", ("none",) + GRANULARITIES), ("ScalePlacement", SCALE_PLACEMENTS), ("StateAxis", STATE_AXES))

NAME_PATTERN = r"[a-z][a-z0-9_]*"
MAX_PAGE_SIZE = 4096
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_SEQ_LEN = 1 << 24
MAX_TENSOR_PARALLEL = 64  # ranks one model's KV heads may be sharded over
# A hybrid model's per-sequence state record (kvforge::StatePool, state_pool.hpp checks the same).
STATE_DTYPES = ("fp32", "fp16", "bf16")
MAX_STATE_PARTS = 64
MAX_STATE_RANK = 4
MAX_STATE_PART_BYTES = 1 << 40

WARP = 32  # cuda.block_threads is a whole number of warps
# Launch parameters a model's specs/tuning/<model>.yaml may set (written by kvforge_bench --kvf_tune),
# one section per backend: the default every variant gets otherwise, the range [lo, hi] each may
# take, the number it must be a multiple of, and what it means. C++'s Tuning (vocab.hpp), its checks,
# the traits' constants and Python's Cache.tuning / set_tuning all follow from this table.
TUNABLES = {
    "cpu": {"parallel_bytes": (65536, 0, 1 << 30, 1, "below this much data an operation runs on one thread"),
            "chunk_items": (0, 0, 1 << 20, 1, "OpenMP chunk in items; 0: one even chunk per thread")},
    "cuda": {"block_threads": (256, 32, 1024, WARP, "threads per CUDA block; items per block = this / lanes"),
             "items_per_thread": (1, 1, 64, 1, "items a CUDA thread takes, a grid apart")},
}

# What the spec loader accepts before it refuses a file outright; the default specs are a few hundred
# bytes, 4 levels and 40 values deep.
MAX_SPEC_BYTES = 64 * 1024
MAX_SPEC_DEPTH = 32
MAX_SPEC_NODES = 20000
