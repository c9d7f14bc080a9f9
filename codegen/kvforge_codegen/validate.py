"""Checks across spec files, and the one predicate "can this combination be built", which the planner
and the checks share. The flow is parse (parse.py, into spec.py's types), then validate (here), then plan (plan.py)."""

from __future__ import annotations

from typing import AbstractSet, Dict, List, Sequence

from . import vocab
from .diagnostics import Diagnostics, SpecFailure
from .naming import variant_name
from .parse import parse_specs
from .records import record_reasons
from .spec import LayoutSpec, ModelSpec, SpecSet


# ---- the one "is this combination supported" predicate ---------------------------------------------

def unsupported_reasons(layout: LayoutSpec, model: ModelSpec, storage: str, input_dtype: str) -> List[str]:
    """Why this combination cannot be built; empty when it can. The checks refuse an expansion that lists
    such a combination, naming these reasons, so the planner only ever sees buildable ones."""
    reasons: List[str] = []
    if layout.record(storage) is not None:
        reasons += record_reasons(layout, model, layout.record(storage), input_dtype)
    elif storage not in vocab.DTYPES:
        reasons.append(f"storage dtype {storage!r} is not supported")
    elif vocab.DTYPES[storage]["quantized"]:
        if input_dtype == storage:
            reasons.append(f"{storage} storage quantizes a float input; give input_dtypes "
                           f"({', '.join(vocab.INPUT_DTYPES)})")
        if layout.quantization is None:
            reasons.append(f"{storage} storage needs a quantization block "
                           f"(granularity: {', '.join(vocab.GRANULARITIES)})")
        values = vocab.DTYPES[storage].get("values", 1)
        if model.head_dim % values:
            reasons.append(f"{storage} packs {values} values a byte, and {model.name}'s head_dim {model.head_dim} "
                           f"is not a multiple of {values}")
        q = layout.quantization
        wants_zero = bool(vocab.DTYPES[storage].get("zero_point"))
        if q is not None and q.zero_point != wants_zero:
            reasons.append(f"{storage} codes are read around a zero point, and the layout's quantization has none "
                           f"(zero_point: true)" if wants_zero else
                           f"the layout's zero_point is for asymmetric codes "
                           f"({', '.join(vocab.ZERO_POINT_DTYPES)}), not {storage}")
        if q is not None and q.granularity == "per_group" and model.head_dim % q.group_size:
            reasons.append(f"group_size {q.group_size} does not divide {model.name}'s head_dim "
                           f"{model.head_dim}, so a head's row would end in part of a group")
        elif q is not None and q.scales == "in_page":
            inside = layout.axes[layout.axes.index("page") + 1:]
            codes = (layout.page_size or 0) * model.kv_heads * model.head_dim // values
            codes *= (2 if "kv" in inside else 1) * (model.layers if "layer" in inside else 1)
            scale_bytes = vocab.SCALE_ENTRIES[q.scale_entry]["bytes"]
            if codes % scale_bytes:
                reasons.append(f"a page holds {codes} code bytes, not a multiple of the {scale_bytes}-byte "
                               f"{q.scale_dtype} scales that follow them, so the scales would be misaligned")
    if input_dtype not in vocab.INPUT_DTYPES and input_dtype != storage and layout.record(storage) is None:
        reasons.append(f"input dtype {input_dtype!r} is not supported")
    if layout.addressing == "ring":
        if layout.window == "model" and not model.sliding_window:
            reasons.append(f"window: model needs a model with sliding_window, and {model.name} has none")
        elif isinstance(layout.window, int) and layout.window > model.max_seq_len:
            reasons.append(f"window {layout.window} exceeds {model.name}'s max_seq_len {model.max_seq_len}")
    if layout.addressing == "paged" and layout.page_size and layout.page_size > model.max_seq_len:
        reasons.append(f"page_size {layout.page_size} exceeds {model.name}'s max_seq_len {model.max_seq_len}")
    return reasons


def hybrid_reasons(specs: SpecSet, layout: LayoutSpec, model: ModelSpec, storage: str, input_dtype: str) -> List[str]:
    """Why a hybrid layout cannot serve this model and dtype; empty when it can."""
    layouts = {l.name: l for l in specs.layouts}
    reasons: List[str] = []
    wanted = [g for g, _ in layout.groups]
    have = [g.name for g in model.layer_groups]
    if sorted(wanted) != sorted(have):
        reasons.append(f"groups {', '.join(wanted)} do not match {model.name}'s layer_groups "
                       f"({', '.join(have) or 'none'})")
        return reasons
    for g, member in layout.groups:
        m = layouts.get(member)
        if m is None:
            reasons.append(f"group {g}: unknown layout {member!r}")
        elif m.hybrid:
            reasons.append(f"group {g}: {member} is itself hybrid")
        elif m.addressing != "paged":
            reasons.append(f"group {g}: {member} is {m.addressing}; a group's window is kept by freeing pages, "
                           f"so hybrid groups need paged layouts")
        else:
            for reason in unsupported_reasons(m, model.for_group(model.group(g)), storage, input_dtype):
                reasons.append(f"group {g} ({member}): {reason}")
    return reasons


def check_expansions(specs: SpecSet, diags: Diagnostics, refused_models: AbstractSet[str] = frozenset()) -> None:
    """Every expanded combination must be supported. A model whose own file was refused is skipped:
    one root cause, one error."""
    known = [m.name for m in specs.models]
    for layout in specs.layouts:
        seen: Dict[str, int] = {}
        for i, exp in enumerate(layout.expand):
            for model_name in exp.models:
                if model_name in refused_models:
                    continue
                if model_name not in known:
                    diags.error(exp.loc, f"expand[{i}].models", f"unknown model {model_name!r}", known)
                    continue
                model = specs.model(model_name)
                for storage in exp.dtypes:
                    for input_dtype in exp.input_dtypes or (storage,):
                        name = variant_name(layout.name, model_name, storage, input_dtype)
                        if name in seen:
                            diags.error(exp.loc, f"expand[{i}]", f"variant {name} is also expanded by expand[{seen[name]}]")
                            continue
                        seen[name] = i
                        check = hybrid_reasons(specs, layout, model, storage, input_dtype) if layout.hybrid else \
                            unsupported_reasons(layout, model, storage, input_dtype)
                        for reason in check:
                            diags.error(exp.loc, f"expand[{i}]", f"{name}: {reason}")



def load_specs(layout_paths: Sequence[str], model_paths: Sequence[str], root: str,
               tuning_paths: Sequence[str] = ()) -> SpecSet:
    """Read and validate every spec; raise SpecFailure with all errors if any file has one."""
    specs, diags, refused_models = parse_specs(layout_paths, model_paths, root, tuning_paths)
    check_expansions(specs, diags, refused_models)
    if diags:
        raise SpecFailure(diags.sorted())
    return specs
