"""YAML -> plain values that remember their line, with duplicate keys rejected.

PyYAML's own loaders silently keep the last of duplicate keys and drop line numbers, so specs are
composed into nodes and converted here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import yaml

from .diagnostics import Diagnostics, Loc


@dataclass(frozen=True)
class Value:
    """A scalar, list or mapping from a spec, with where it was written."""

    data: Any  # str | int | bool | float | None | List[Value] | Dict[str, Entry]
    loc: Loc


@dataclass(frozen=True)
class Entry:
    key_loc: Loc
    value: Value


def _loc(path: str, node: yaml.Node) -> Loc:
    return Loc(path, node.start_mark.line + 1)


def _convert(path: str, node: yaml.Node, diags: Diagnostics, where: str) -> Value:
    loc = _loc(path, node)
    if isinstance(node, yaml.MappingNode):
        out: Dict[str, Entry] = {}
        for key_node, value_node in node.value:
            key_loc = _loc(path, key_node)
            if not isinstance(key_node, yaml.ScalarNode):
                diags.error(key_loc, where or "(document)", "keys must be plain names")
                continue
            key = str(key_node.value)
            field = f"{where}.{key}" if where else key
            if key in out:
                diags.error(key_loc, field, f"duplicate key (first given on line {out[key].key_loc.line})")
                continue
            out[key] = Entry(key_loc, _convert(path, value_node, diags, field))
        return Value(out, loc)
    if isinstance(node, yaml.SequenceNode):
        return Value([_convert(path, item, diags, where) for item in node.value], loc)
    # Scalars: let YAML's resolver decide int/bool/null, but keep strings as written.
    tag = node.tag
    text = node.value
    if tag == "tag:yaml.org,2002:int":
        try:
            return Value(int(text, 0), loc)
        except ValueError:
            return Value(text, loc)
    if tag == "tag:yaml.org,2002:bool":
        return Value(text.lower() in ("true", "yes", "on"), loc)
    if tag == "tag:yaml.org,2002:null":
        return Value(None, loc)
    if tag == "tag:yaml.org,2002:float":
        try:
            return Value(float(text), loc)
        except ValueError:
            return Value(text, loc)
    return Value(text, loc)


def load(path: str, display: str, diags: Diagnostics) -> Optional[Value]:
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        diags.error(Loc(display, 1), "(file)", f"cannot read: {exc.strerror}")
        return None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(exc, "problem", None) or str(exc)
        diags.error(Loc(display, line), "(yaml)", f"not valid YAML: {problem}")
        return None
    if node is None:
        diags.error(Loc(display, 1), "(document)", "the file is empty")
        return None
    return _convert(display, node, diags, "")
