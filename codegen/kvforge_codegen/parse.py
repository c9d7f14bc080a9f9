"""Reading spec files into the typed objects of spec.py: every field checked, every problem recorded with
its file and line (diagnostics.py), and nothing returned for a file with errors."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from typing import AbstractSet, Dict, List, Optional, Sequence, Tuple

from . import vocab
from .diagnostics import Diagnostics, Loc
from .spec import (LayerGroup, Tuning, tp_divides, ModelSpec, Expansion, Quantization, LayoutSpec, SpecSet, MODEL_FIELDS, LAYER_GROUP_FIELDS, LAYOUT_FIELDS, STORAGE_FIELDS, EXPANSION_FIELDS)
from .parse_mla import parse_mla, parse_v_head_dim, refuse_heads_beside_mla, stored_half
from .parse_quant import parse_quantization
from .parse_records import parse_records
from .parse_states import parse_linear_layers
from .yamlnodes import Entry, Value, load


def _shown(data: object) -> str:
    """A refused value as the message quotes it: short, whatever was written."""
    if isinstance(data, list):
        return "a list"
    if isinstance(data, dict):
        return "a mapping"
    text = repr(data)
    return text if len(text) <= 40 else text[:37] + "..."


class _Reader:
    """Typed field access over one mapping, recording every problem instead of stopping."""

    def __init__(self, diags: Diagnostics, value: Value, prefix: str, allowed: Sequence[str]) -> None:
        self.diags = diags
        self.prefix = prefix
        self.loc = value.loc
        self.fields: Dict[str, Entry] = {}
        if not isinstance(value.data, dict):
            diags.error(value.loc, prefix or "(document)", "expected a mapping of fields", allowed)
            return
        self.fields = value.data
        for key, entry in self.fields.items():
            if key not in allowed:
                diags.error(entry.key_loc, self._field(key), "unknown field", allowed)

    def _field(self, key: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_]+", key):  # an odd key is quoted, so the message still parses
            key = repr(key)
        return f"{self.prefix}.{key}" if self.prefix else key

    def has(self, key: str) -> bool:
        return key in self.fields

    def loc_of(self, key: str) -> Loc:
        return self.fields[key].value.loc if key in self.fields else self.loc

    def _missing(self, key: str, allowed: Optional[Sequence[str] | str] = None) -> None:
        self.diags.error(self.loc, self._field(key), "required field is missing", allowed)

    def name(self, key: str) -> Optional[str]:
        if key not in self.fields:
            self._missing(key)
            return None
        v = self.fields[key].value
        if not isinstance(v.data, str) or not re.fullmatch(vocab.NAME_PATTERN, v.data):
            self.diags.error(v.loc, self._field(key), f"expected a lower-case identifier, got {_shown(v.data)}",
                             "letters a-z, digits and _, starting with a letter")
            return None
        return v.data

    def positive_int(self, key: str, required: bool = True, maximum: Optional[int] = None) -> Optional[int]:
        if key not in self.fields:
            if required:
                self._missing(key)
            return None
        v = self.fields[key].value
        allowed = f"1..{maximum}" if maximum is not None else "an integer >= 1"
        if isinstance(v.data, bool) or not isinstance(v.data, int) or v.data <= 0:
            self.diags.error(v.loc, self._field(key), f"expected a positive integer, got {_shown(v.data)}", allowed)
            return None
        if maximum is not None and v.data > maximum:
            self.diags.error(v.loc, self._field(key), f"{v.data} is too large", allowed)
            return None
        return v.data

    def flag(self, key: str) -> bool:
        """A true/false field; false where it is absent or after recording that it is not a boolean."""
        if key not in self.fields:
            return False
        v = self.fields[key].value
        if not isinstance(v.data, bool):
            self.diags.error(v.loc, self._field(key), f"expected true or false, got {_shown(v.data)}", "true, false")
            return False
        return v.data

    def choice(self, key: str, allowed: Sequence[str], default: Optional[str] = None) -> Optional[str]:
        if key not in self.fields:
            if default is not None:
                return default
            self._missing(key, allowed)
            return None
        v = self.fields[key].value
        if not isinstance(v.data, str) or v.data not in allowed:
            self.diags.error(v.loc, self._field(key), f"unknown value {_shown(v.data)}", allowed)
            return None
        return v.data

    def choice_list(self, key: str, allowed: Sequence[str], required: bool = True) -> Optional[Tuple[str, ...]]:
        if key not in self.fields:
            if required:
                self._missing(key, allowed)
            return None
        v = self.fields[key].value
        if not isinstance(v.data, list) or not v.data:
            self.diags.error(v.loc, self._field(key), "expected a non-empty list", allowed)
            return None
        out: List[str] = []
        ok = True
        for item in v.data:
            if not isinstance(item.data, str) or item.data not in allowed:
                self.diags.error(item.loc, self._field(key), f"unknown value {_shown(item.data)}", allowed)
                ok = False
            elif item.data in out:
                self.diags.error(item.loc, self._field(key), f"{item.data!r} is listed twice")
                ok = False
            else:
                out.append(item.data)
        return tuple(out) if ok else None


def _display(path: str, root: str) -> str:
    rel = os.path.relpath(path, root)
    return path if rel.startswith("..") else rel


def _check_file_name(name: Optional[str], path: str, r: _Reader, diags: Diagnostics) -> None:
    """One name per spec everywhere: the `name` field is the file's stem."""
    _check_file_name_field(name, "name", path, r, diags)


def _check_file_name_field(name: Optional[str], field: str, path: str, r: _Reader, diags: Diagnostics) -> None:
    stem = os.path.splitext(os.path.basename(path))[0]
    if name is not None and name != stem:
        diags.error(r.loc_of(field), field, f"{name!r} differs from the file name", stem)


def _parse_model(path: str, display: str, diags: Diagnostics) -> Optional[ModelSpec]:
    doc = load(path, display, diags)
    if doc is None:
        return None
    r = _Reader(diags, doc, "", MODEL_FIELDS)
    before = len(diags.errors)
    name = r.name("name")
    layers = r.positive_int("layers", maximum=vocab.MAX_LAYERS)
    mla = kv_widths = None
    if r.has("mla"):
        refuse_heads_beside_mla(r, diags)
        mla = parse_mla(r.fields["mla"].value, diags, _Reader)
        kv_heads, head_dim = 1, (stored_half(sum(mla)) if mla else None)  # one head: K and V are the record's halves
    else:
        kv_heads = r.positive_int("kv_heads", maximum=vocab.MAX_KV_HEADS)
        head_dim = r.positive_int("head_dim", maximum=vocab.MAX_HEAD_DIM)
        kv_widths = parse_v_head_dim(r, head_dim, diags)
        if kv_widths:
            head_dim = stored_half(sum(kv_widths))  # K and V are each head's record's halves
    max_seq_len = r.positive_int("max_seq_len", maximum=vocab.MAX_SEQ_LEN)
    window = r.positive_int("sliding_window", required=False, maximum=vocab.MAX_SEQ_LEN)
    _check_file_name(name, path, r, diags)
    if window is not None and max_seq_len is not None and window > max_seq_len:
        diags.error(r.loc_of("sliding_window"), "sliding_window",
                    f"{window} exceeds max_seq_len {max_seq_len}", f"1..{max_seq_len}")
    groups: Tuple[LayerGroup, ...] = ()
    if r.has("layer_groups") and layers is not None and max_seq_len is not None:
        groups = _parse_layer_groups(r.fields["layer_groups"].value, layers, max_seq_len, diags)
    if mla is not None:
        for i, g in enumerate(groups):
            if g.kv_heads:
                diags.error(g.loc, f"layer_groups[{i}].kv_heads", "an MLA model caches one record a token, with no "
                            "heads", "no kv_heads in an MLA model's groups")
    tensor_parallel = _parse_tensor_parallel(r, kv_heads, bool(groups), diags)
    linear: Tuple[Tuple[int, ...], tuple] = ((), ())
    if r.has("linear_layers") and layers is not None:
        if groups:
            diags.error(r.loc_of("linear_layers"), "linear_layers", "cannot be combined with layer_groups yet",
                        "one of linear_layers and layer_groups")
        else:
            linear = parse_linear_layers(r.fields["linear_layers"].value, layers, diags, _Reader, _shown,
                                         tensor_parallel) or linear
    if len(diags.errors) != before:
        return None
    # The K/V variants hold the attention layers: all of them but the linear ones.
    return ModelSpec(name, layers - len(linear[0]), kv_heads, head_dim, max_seq_len, window, doc.loc, groups,
                     tensor_parallel=tensor_parallel, linear_layers=linear[0], states=linear[1], model_layers=layers,
                     mla=mla, kv_widths=kv_widths)


def _parse_tensor_parallel(r: "_Reader", kv_heads: Optional[int], hybrid: bool, diags: Diagnostics) -> Tuple[int, ...]:
    """`tensor_parallel: [1, 2, 4, 8]`: the degrees whose per-rank shards are generated (1 is the
    whole model, always there). A degree must divide kv_heads or be a multiple of it."""
    if not r.has("tensor_parallel"):
        return ()
    v = r.fields["tensor_parallel"].value
    allowed = f"1..{vocab.MAX_TENSOR_PARALLEL}, dividing kv_heads or a multiple of it"
    if not isinstance(v.data, list) or not v.data:
        diags.error(v.loc, "tensor_parallel", "expected a non-empty list of degrees", allowed)
        return ()
    if hybrid:
        diags.error(v.loc, "tensor_parallel", "a model with layer_groups cannot be sharded yet", "no tensor_parallel")
        return ()
    out: List[int] = []
    for item in v.data:
        tp = item.data
        if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= vocab.MAX_TENSOR_PARALLEL:
            diags.error(item.loc, "tensor_parallel", f"expected a degree, got {_shown(tp)}", allowed)
        elif kv_heads is not None and not tp_divides(kv_heads, tp):
            diags.error(item.loc, "tensor_parallel",
                        f"{tp} ranks cannot share {kv_heads} KV heads: it neither divides them nor is a multiple of them",
                        ", ".join(str(t) for t in range(1, vocab.MAX_TENSOR_PARALLEL + 1) if tp_divides(kv_heads, t)))
        elif tp in out:
            diags.error(item.loc, "tensor_parallel", f"{tp} is listed twice")
        else:
            out.append(tp)
    return tuple(sorted(t for t in out if t > 1))


def _parse_layer_groups(value: Value, layers: int, max_seq_len: int, diags: Diagnostics) -> Tuple[LayerGroup, ...]:
    """Groups must split the model's layers: every layer in exactly one group."""
    if not isinstance(value.data, list) or not value.data:
        diags.error(value.loc, "layer_groups", "expected a non-empty list of {name, layers, sliding_window?, kv_heads?}")
        return ()
    groups: List[LayerGroup] = []
    owner: Dict[int, str] = {}
    before = len(diags.errors)
    for i, item in enumerate(value.data):
        r = _Reader(diags, item, f"layer_groups[{i}]", LAYER_GROUP_FIELDS)
        if not isinstance(item.data, dict):
            continue
        name = r.name("name")
        window = r.positive_int("sliding_window", required=False, maximum=max_seq_len)
        heads = r.positive_int("kv_heads", required=False, maximum=vocab.MAX_KV_HEADS)
        members: List[int] = []
        lv = r.fields.get("layers")
        if lv is None:
            r._missing("layers", f"layer indices 0..{layers - 1}")
        elif not isinstance(lv.value.data, list) or not lv.value.data:
            diags.error(lv.value.loc, f"layer_groups[{i}].layers", "expected a non-empty list of layer indices",
                        f"0..{layers - 1}")
        else:
            for entry in lv.value.data:
                if isinstance(entry.data, bool) or not isinstance(entry.data, int) or not 0 <= entry.data < layers:
                    diags.error(entry.loc, f"layer_groups[{i}].layers", f"{_shown(entry.data)} is not a layer of this model",
                                f"0..{layers - 1}")
                elif entry.data in owner:
                    diags.error(entry.loc, f"layer_groups[{i}].layers",
                                f"layer {entry.data} is already in group {owner[entry.data]!r}")
                else:
                    owner[entry.data] = name or "?"
                    members.append(entry.data)
        if name is not None and any(g.name == name for g in groups):
            diags.error(r.loc_of("name"), f"layer_groups[{i}].name", f"group {name!r} is defined twice")
        elif name is not None:
            groups.append(LayerGroup(name, tuple(members), window, item.loc, heads))
    missing = [l for l in range(layers) if l not in owner]
    if missing and len(diags.errors) == before:
        diags.error(value.loc, "layer_groups", f"layers {', '.join(map(str, missing))} are in no group",
                    "every layer in exactly one group")
    return tuple(groups)


def _parse_expansion(value: Value, index: int, diags: Diagnostics, storages: Tuple[str, ...]) -> Optional[Expansion]:
    r = _Reader(diags, value, f"expand[{index}]", EXPANSION_FIELDS)
    if not r.fields:
        return None
    models: Optional[Tuple[str, ...]] = None
    # Model names are checked against the model set later, once every model file has been read.
    mv = r.fields.get("models")
    if mv is None:
        r._missing("models")
    elif not isinstance(mv.value.data, list) or not mv.value.data or \
            not all(isinstance(i.data, str) for i in mv.value.data):
        diags.error(mv.value.loc, f"expand[{index}].models", "expected a non-empty list of model names")
    else:
        models = tuple(i.data for i in mv.value.data)
    dtypes = r.choice_list("dtypes", storages)
    input_dtypes = r.choice_list("input_dtypes", vocab.INPUT_DTYPES, required=False)
    if models is None or dtypes is None or (r.has("input_dtypes") and input_dtypes is None):
        return None
    return Expansion(models, dtypes, input_dtypes, value.loc)


def _parse_layout(path: str, display: str, diags: Diagnostics) -> Optional[LayoutSpec]:
    doc = load(path, display, diags)
    if doc is None:
        return None
    r = _Reader(diags, doc, "", LAYOUT_FIELDS)
    before = len(diags.errors)
    name = r.name("name")
    _check_file_name(name, path, r, diags)
    if r.has("groups"):
        return _parse_hybrid_layout(r, name, doc, before, diags)
    addressing = r.choice("addressing", vocab.ADDRESSING)
    axes = r.choice_list("axes", vocab.AXES)
    update = r.choice("update", vocab.UPDATE_MODES)
    page_size = r.positive_int("page_size", required=False, maximum=vocab.MAX_PAGE_SIZE)

    window: Optional[str | int] = None
    if r.has("window"):
        wv = r.fields["window"].value
        if wv.data == "model" or (isinstance(wv.data, int) and not isinstance(wv.data, bool) and wv.data > 0):
            window = wv.data
        else:
            diags.error(wv.loc, "window", f"expected a positive integer or 'model', got {_shown(wv.data)}",
                        "a positive integer, model")

    if addressing is not None:
        if addressing == "paged" and not r.has("page_size"):
            diags.error(r.loc, "page_size", "required field is missing for paged addressing",
                        f"1..{vocab.MAX_PAGE_SIZE}")
        if addressing != "paged" and r.has("page_size"):
            diags.error(r.loc_of("page_size"), "page_size", f"only paged addressing has pages, not {addressing}")
        if addressing == "ring" and not r.has("window"):
            diags.error(r.loc, "window", "required field is missing for ring addressing",
                        "a positive integer, model")
        if addressing != "ring" and r.has("window"):
            diags.error(r.loc_of("window"), "window", f"only ring addressing has a window, not {addressing}")
        if axes is not None:
            loc = r.loc_of("axes")
            for axis in vocab.REQUIRED_AXES[addressing]:
                if axis not in axes:
                    diags.error(loc, "axes", f"{addressing} addressing needs axis '{axis}'",
                                ", ".join(vocab.REQUIRED_AXES[addressing]) + " plus optional layer, kv")
            for axis in vocab.FORBIDDEN_AXES[addressing]:
                if axis in axes:
                    diags.error(loc, "axes", f"axis '{axis}' has no meaning with {addressing} addressing",
                                ", ".join(vocab.REQUIRED_AXES[addressing]) + " plus optional layer, kv")
            if "dim" in axes and axes[-1] != "dim":
                diags.error(loc, "axes", "'dim' must be the last axis, so that each head's row is contiguous",
                            "[..., dim]")

    state_axes = r.choice_list("state_axes", vocab.STATE_AXES, required=False)
    if state_axes is not None and len(state_axes) != len(vocab.STATE_AXES):
        diags.error(r.fields["state_axes"].value.loc, "state_axes", "a state pool's memory needs every one of its axes",
                    "an order of " + ", ".join(vocab.STATE_AXES))

    quantization: Optional[Quantization] = None
    if r.has("quantization"):
        quantization = parse_quantization(r.fields["quantization"].value, addressing, axes, diags, _Reader)
    records = parse_records(r.fields["records"].value, diags, _Reader) if r.has("records") else ()

    expansions = _parse_expand_list(r, diags, tuple(vocab.DTYPES) + tuple(f.name for f in records))
    if quantization is not None and expansions and \
            not any(d in vocab.QUANTIZED_DTYPES for e in expansions for d in e.dtypes):
        diags.error(r.fields["quantization"].key_loc, "quantization", "no expansion stores a quantized dtype, so it applies to nothing",
                    ", ".join(vocab.QUANTIZED_DTYPES) + " in expand[].dtypes")
    if len(diags.errors) != before:
        return None
    return LayoutSpec(name, addressing, axes, page_size, window, update, quantization, tuple(expansions), doc.loc,
                      state_axes=state_axes, records=records)


def _parse_expand_list(r: _Reader, diags: Diagnostics, storages: Tuple[str, ...] = tuple(vocab.DTYPES)) -> List[Expansion]:
    """The `expand` list; `storages` are the dtypes and the layout's record formats its entries may store."""
    expansions: List[Expansion] = []
    if not r.has("expand"):
        r._missing("expand")
        return expansions
    ev = r.fields["expand"].value
    if not isinstance(ev.data, list) or not ev.data:
        diags.error(ev.loc, "expand", "expected a non-empty list of {models, dtypes} entries")
        return expansions
    for i, item in enumerate(ev.data):
        e = _parse_expansion(item, i, diags, storages)
        if e is not None:
            expansions.append(e)
    return expansions


def _parse_hybrid_layout(r: _Reader, name: Optional[str], doc: Value, before: int,
                         diags: Diagnostics) -> Optional[LayoutSpec]:
    """`groups: {group: layout}`: each layer group of the model is stored by the named layout."""
    for field in STORAGE_FIELDS:
        if r.has(field):
            diags.error(r.fields[field].key_loc, field,
                        "a hybrid layout takes its storage from the layouts its groups name", "name, groups, expand")
    gv = r.fields["groups"].value
    groups: List[Tuple[str, str]] = []
    if not isinstance(gv.data, dict) or not gv.data:
        diags.error(gv.loc, "groups", "expected a mapping of layer group name to layout name")
    else:
        for group, entry in gv.data.items():
            if not isinstance(entry.value.data, str) or not re.fullmatch(vocab.NAME_PATTERN, entry.value.data):
                diags.error(entry.value.loc, f"groups.{group}", f"expected a layout name, got {_shown(entry.value.data)}")
            else:
                groups.append((group, entry.value.data))
    expansions = _parse_expand_list(r, diags)
    if len(diags.errors) != before:
        return None
    return LayoutSpec(name, "paged", (), None, None, "eager", None, tuple(expansions), doc.loc, tuple(groups))


def _yaml_files(paths: Sequence[str]) -> List[str]:
    files: List[str] = []
    for p in paths:
        if os.path.isdir(p):
            files.extend(os.path.join(p, f) for f in sorted(os.listdir(p)) if f.endswith((".yaml", ".yml")))
        else:
            files.append(p)
    return files


def _parse_all(paths: Sequence[str], parse, kind: str, root: str, diags: Diagnostics,
               refused: Optional[set] = None) -> list:
    """Parse every file of one kind; a name defined twice is an error at the second definition.
    The names (file stems) of files that were refused go into `refused`, so that what refers to them
    is not reported a second time as unknown."""
    seen: Dict[str, object] = {}
    for path in _yaml_files(paths):
        spec = parse(path, _display(path, root), diags)
        if spec is None:
            if refused is not None:
                refused.add(os.path.splitext(os.path.basename(path))[0])
            continue
        if spec.name in seen:
            diags.error(spec.loc, "name", f"{kind} {spec.name!r} is also defined at {seen[spec.name].loc}")
            continue
        seen[spec.name] = spec
    return list(seen.values())


def _parse_tuning(path: str, display: str, diags: Diagnostics) -> Optional[Tuple[str, Tuning, Loc]]:
    doc = load(path, display, diags)
    if doc is None:
        return None
    r = _Reader(diags, doc, "", ("model",) + tuple(vocab.TUNABLES))
    before = len(diags.errors)
    model = r.name("model")
    _check_file_name_field(model, "model", path, r, diags)
    values = {}
    for section, fields in vocab.TUNABLES.items():
        if not r.has(section):
            continue
        sr = _Reader(diags, r.fields[section].value, section, tuple(fields))
        for field, (default, lo, hi, multiple, _) in fields.items():
            if not sr.has(field):
                continue
            v = sr.fields[field].value
            if isinstance(v.data, bool) or not isinstance(v.data, int) or not lo <= v.data <= hi:
                diags.error(v.loc, f"{section}.{field}", f"expected an integer in {lo}..{hi}, got {_shown(v.data)}", f"{lo}..{hi}")
            elif v.data % multiple:
                diags.error(v.loc, f"{section}.{field}", f"{v.data} is not a multiple of {multiple}",
                            f"multiples of {multiple} in {lo}..{hi}")
            else:
                values[f"{section}_{field}"] = v.data
    if len(diags.errors) != before:
        return None
    return model, Tuning(**values, source=display), doc.loc


def parse_specs(layout_paths: Sequence[str], model_paths: Sequence[str], root: str,
                tuning_paths: Sequence[str] = ()) -> Tuple[SpecSet, Diagnostics, AbstractSet[str]]:
    """Read every file into typed specs, checking each on its own. Returns the specs that parsed, every
    problem found, and the names of model files that were refused (so that what names them is not
    reported again). Checks across files are validate.py's."""
    diags = Diagnostics()
    refused_models: set = set()
    models = _parse_all(model_paths, _parse_model, "model", root, diags, refused_models)
    by_name = {m.name: m for m in models}
    for path in _yaml_files(tuning_paths):
        parsed = _parse_tuning(path, _display(path, root), diags)
        if parsed is None:
            continue
        name, tuning, loc = parsed
        if name in refused_models:
            continue  # the model file's own errors say why
        if name not in by_name:
            diags.error(loc, "model", f"unknown model {name!r}", sorted(by_name))
        else:
            by_name[name] = replace(by_name[name], tuning=tuning)
    models = [by_name[m.name] for m in models]
    for m in models:  # a shard's generated name must not be another model's
        for shard in m.with_shards()[1:]:
            if shard.name in by_name:
                diags.error(m.loc, "tensor_parallel", f"degree {shard.tp} names its shard model {shard.name!r}, "
                            f"which is another model's name", "a model name without that suffix")
    layouts = _parse_all(layout_paths, _parse_layout, "layout", root, diags)
    if not layouts and not diags:
        diags.error(Loc(", ".join(layout_paths) or "(none)", 1), "layouts", "no layout spec files found",
                    "*.yaml files")
    return SpecSet(tuple(layouts), tuple(models)), diags, frozenset(refused_models)
