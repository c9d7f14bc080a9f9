"""Writes a batch of random, valid kvforge specs: models of uncommon shapes and layouts with random axis
orders, page sizes, windows, update modes, dtypes and quantization options. Every spec is validated
by the codegen before it is kept, so the batch is what a careful user could write.

    python3 make_specs.py --seed S --out DIR [--layouts N]

The same seed gives the same batch: a failure in CI names its seed, and this command replays it."""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "codegen"))

from kvforge_codegen import vocab  # noqa: E402
from kvforge_codegen.diagnostics import SpecFailure  # noqa: E402
from kvforge_codegen.validate import load_specs  # noqa: E402

HEAD_DIMS = (1, 3, 8, 16, 24, 64, 80, 96, 128, 256)  # the validator takes 1..4096; these cover odd and wide
KV_HEADS = (1, 2, 3, 5, 8, 16, 64)
NARROW_HEAD_DIMS = (1, 3, 8, 16)  # with many heads, so that a token stays small enough to test quickly
SEQ_LENS = (33, 64, 100, 256)
PAGE_SIZES = (1, 2, 3, 5, 8, 16, 32, 64, 100, 256)


def model_yaml(rng: random.Random, name: str) -> tuple:
    """The model's spec, and the width of the head its variants store (an MLA record's half)."""
    max_seq_len = rng.choice(SEQ_LENS)
    heads = rng.choice(KV_HEADS)
    head_dim = rng.choice(NARROW_HEAD_DIMS if heads >= 16 else HEAD_DIMS)
    layers = rng.randint(1, 3)
    shape = [f"kv_heads: {heads}", f"head_dim: {head_dim}"]
    draw = rng.random()
    if draw < 0.15:  # K and V of different widths: each head's record, K then V, held as a head of half of it
        # of either parity: an odd record is stored with one zero after it
        v_head_dim = rng.choice([w for w in range(1, 2 * head_dim + 3) if w != head_dim])
        shape.append(f"v_head_dim: {v_head_dim}")
        head_dim = (head_dim + v_head_dim + 1) // 2
    elif draw < 0.35:  # an MLA model: a latent record of any width, held as one head's K and V
        rope = rng.choice((2, 4, 8, 64))
        rank = rng.choice((2, 6, 16, 21, 62, 128, 512))  # 128 and 512 also take FlashMLA's fp8 record
        shape = ["mla:", f"  kv_lora_rank: {rank}", f"  qk_rope_head_dim: {rope}"]
        head_dim = (rank + rope + 1) // 2
    lines = [f"name: {name}", f"layers: {layers}", *shape, f"max_seq_len: {max_seq_len}"]
    if rng.random() < 0.5:
        lines.append(f"sliding_window: {rng.randint(1, max_seq_len)}")
    if layers > 1 and rng.random() < 0.3:  # a hybrid model: some layers keep a state, the variants the rest
        linear = sorted(rng.sample(range(layers), rng.randint(1, layers - 1)))
        lines += ["linear_layers:", f"  layers: {linear}", "  states:"]
        for part in range(rng.randint(1, 3)):
            shape = [rng.randint(1, 40) for _ in range(rng.randint(1, 4))]
            lines += [f"    - name: s{part}", f"      shape: {shape}", f"      dtype: {rng.choice(('fp32', 'fp16', 'bf16'))}"]
    return "\n".join(lines) + "\n", head_dim


def axes_for(rng: random.Random, addressing: str, in_page: bool) -> list:
    required = list(vocab.REQUIRED_AXES[addressing])
    optional = [a for a in ("layer", "kv") if rng.random() < 0.5]
    body = [a for a in required if a != "dim"] + optional
    rng.shuffle(body)
    if in_page:  # scales in the page need slot, head (and dim) after page
        body.remove("page")
        first_inner = min(body.index("slot"), body.index("head"))
        body.insert(rng.randint(0, first_inner), "page")
    return body + ["dim"]


def layout_yaml(rng: random.Random, name: str, models: dict) -> str:
    """A layout over one or two of `models` ({name: stored head width})."""
    addressing = rng.choice(vocab.ADDRESSING)
    storage = rng.choice(tuple(vocab.DTYPES))
    quantized = vocab.DTYPES[storage]["quantized"]
    granularity = rng.choice(vocab.GRANULARITIES)
    zero_point = bool(vocab.DTYPES[storage].get("zero_point"))  # uint4: a scale and a zero point a group
    if zero_point and granularity not in vocab.ZERO_POINT_GRANULARITIES:
        granularity = rng.choice(vocab.ZERO_POINT_GRANULARITIES)
    # A group divides every chosen model's row: a per_group layout expands the models that have one
    # (or, where none has, takes the row's own scale instead).
    grouped = [m for m in sorted(models) if models[m] % min(vocab.GROUP_SIZES) == 0]
    if granularity == "per_group" and not grouped:
        granularity = "per_token_head"
    candidates = grouped if granularity == "per_group" else sorted(models)
    chosen = rng.sample(candidates, rng.randint(1, min(2, len(candidates))))
    group_sizes = [g for g in vocab.GROUP_SIZES if all(models[m] % g == 0 for m in chosen)]
    scales = "in_page" if quantized and addressing == "paged" and granularity != "per_tensor" and rng.random() < 0.5 \
        else "separate"
    lines = [f"name: {name}", f"addressing: {addressing}",
             f"axes: [{', '.join(axes_for(rng, addressing, scales == 'in_page'))}]",
             f"update: {rng.choice(vocab.UPDATE_MODES)}"]
    if addressing == "paged":
        lines.append(f"page_size: {rng.choice(PAGE_SIZES)}")
    if addressing == "ring":
        lines.append(f"window: {rng.choice(['model', rng.randint(1, 40)])}")
    if quantized:
        # ue8m0 and e4m3 hold dynamic scales only.
        scale_dtypes = vocab.ZERO_POINT_SCALE_DTYPES if zero_point else \
            tuple(d for d in vocab.SCALE_DTYPES if d not in vocab.DYNAMIC_ONLY_SCALE_DTYPES or granularity != "per_tensor")
        lines += ["quantization:", f"  granularity: {granularity}",
                  f"  scale_dtype: {rng.choice(scale_dtypes)}", f"  scales: {scales}"]
        if zero_point:
            lines.append("  zero_point: true")
        if granularity == "per_group":
            lines.append(f"  group_size: {rng.choice(group_sizes)}")
            if scales == "separate" and not zero_point and rng.random() < 0.5:  # a second level (NVFP4's)
                lines.append(f"  tensor_scale: {rng.choice(vocab.TENSOR_SCALES)}")
    lines += ["expand:", f"  - models: [{', '.join(chosen)}]", f"    dtypes: [{storage}]"]
    if quantized or vocab.DTYPES[storage].get("record") or rng.random() < 0.3:
        lines.append(f"    input_dtypes: [{rng.choice(vocab.INPUT_DTYPES)}]")
    return "\n".join(lines) + "\n"


def valid(layouts_dir: str, models_dir: str) -> bool:
    try:
        load_specs([layouts_dir], [models_dir], os.path.dirname(layouts_dir))
    except SpecFailure:
        return False
    return True


def make(seed: int, out: str, layouts: int, models: int) -> None:
    rng = random.Random(seed)
    layouts_dir, models_dir = os.path.join(out, "layouts"), os.path.join(out, "models")
    os.makedirs(layouts_dir, exist_ok=True)
    os.makedirs(models_dir, exist_ok=True)
    widths = {}
    for name in (f"rnd_model_{i}" for i in range(models)):
        text, widths[name] = model_yaml(rng, name)
        with open(os.path.join(models_dir, f"{name}.yaml"), "w") as f:
            f.write(text)
    made = 0
    while made < layouts:
        name = f"rnd_layout_{made}"
        text = layout_yaml(rng, name, widths)
        # A combination the validator refuses (a window past a model's length, misaligned in-page
        # scales) is drawn again: the batch holds valid specs only.
        with tempfile.TemporaryDirectory() as tmp:
            os.makedirs(os.path.join(tmp, "layouts"))
            with open(os.path.join(tmp, "layouts", f"{name}.yaml"), "w") as f:
                f.write(text)
            if not valid(os.path.join(tmp, "layouts"), models_dir):
                continue
        with open(os.path.join(layouts_dir, f"{name}.yaml"), "w") as f:
            f.write(text)
        made += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layouts", type=int, default=8)
    p.add_argument("--models", type=int, default=4)
    a = p.parse_args()
    make(a.seed, a.out, a.layouts, a.models)
    return 0


if __name__ == "__main__":
    sys.exit(main())
