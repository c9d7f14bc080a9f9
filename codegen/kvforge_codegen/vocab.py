"""The fixed vocabularies of the spec language, and their C++ spellings. One place for both."""

AXES = ("layer", "row", "seq", "page", "slot", "kv", "head", "dim")
ADDRESSING = ("contiguous", "ring", "paged")
UPDATE_MODES = ("eager", "lazy")

# Floating-point storage and input types. Bytes per element and the C++ type that carries them.
DTYPES = {
    "fp32": {"bytes": 4, "cpp": "float", "enum": "f32"},
    "fp16": {"bytes": 2, "cpp": "kvforge::fp16", "enum": "f16"},
    "bf16": {"bytes": 2, "cpp": "kvforge::bf16", "enum": "bf16"},
}
INPUT_DTYPES = ("fp32", "fp16", "bf16")

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

NAME_PATTERN = r"[a-z][a-z0-9_]*"
MAX_PAGE_SIZE = 4096
MAX_LAYERS = 1024
