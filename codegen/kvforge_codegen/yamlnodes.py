"""Spec bytes -> plain values that remember their line, for any input.

PyYAML's own loaders keep the last of duplicate keys, drop line numbers, expand aliases without bound
(a "billion laughs" file never finishes) and recurse once per nesting level. So a spec is built here
straight from the parser's event stream, without recursion, under a size limit, a depth limit and a
node budget, with anchors and aliases refused. Whatever the bytes, the result is a value or
diagnostics, never an exception.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import yaml

from . import vocab
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


class _Refused(Exception):
    """One structural problem ends the file: everything read after it would be noise."""

    def __init__(self, line: int, field: str, problem: str, allowed: Optional[str] = None) -> None:
        super().__init__(problem)
        self.line, self.field, self.problem, self.allowed = line, field, problem, allowed


_RESOLVER = yaml.resolver.Resolver()


def _scalar(text: str, tag: Optional[str], implicit: Tuple[bool, bool], loc: Loc) -> Value:
    """YAML's resolver decides int/bool/null/float for plain scalars; everything else stays a string."""
    if tag is None or tag == "!":
        tag = _RESOLVER.resolve(yaml.ScalarNode, text, implicit)
    try:
        if tag == "tag:yaml.org,2002:int":
            return Value(int(text.replace("_", ""), 0), loc)
        if tag == "tag:yaml.org,2002:float":
            return Value(float(text.replace("_", "")), loc)
    except ValueError:  # YAML 1.1 forms Python does not read (sexagesimal, 0755): keep the text
        return Value(text, loc)
    if tag == "tag:yaml.org,2002:bool":
        return Value(text.lower() in ("true", "yes", "on", "y"), loc)
    if tag == "tag:yaml.org,2002:null":
        return Value(None, loc)
    return Value(text, loc)


class _Collection:
    """A mapping or sequence being built; mappings alternate between expecting a key and a value."""

    def __init__(self, loc: Loc, where: str, is_map: bool) -> None:
        self.loc, self.where, self.is_map = loc, where, is_map
        self.items: List[Value] = []
        self.entries: Dict[str, Entry] = {}
        self.pending_key: Optional[Tuple[str, Loc]] = None  # key read, value not yet
        self.skip_value = False  # the key was refused; its value is read and dropped
        self.refused_key = False  # this collection is itself a refused key: read and dropped

    def field(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def child_where(self) -> str:
        if self.is_map and self.pending_key is not None:
            return self.field(self.pending_key[0])
        return self.where

    def expects_key(self) -> bool:
        return self.is_map and self.pending_key is None and not self.skip_value


def _build(events, display: str, diags: Diagnostics) -> Optional[Value]:
    stack: List[_Collection] = []
    root: Optional[Value] = None
    nodes = 0
    documents = 0

    def place(value: Value) -> None:
        nonlocal root
        if not stack:
            root = value
            return
        top = stack[-1]
        if top.refused_key:
            return
        if not top.is_map:
            top.items.append(value)
        elif top.skip_value:
            top.skip_value = False
        else:
            key, key_loc = top.pending_key
            top.pending_key = None
            top.entries[key] = Entry(key_loc, value)

    for event in events:
        line = event.start_mark.line + 1 if event.start_mark is not None else 1
        loc = Loc(display, line)
        if isinstance(event, yaml.DocumentStartEvent):
            documents += 1
            if documents > 1:
                raise _Refused(line, "(document)", "a spec file holds one YAML document; found a second",
                               "one document, no '---' after the first")
            continue
        if isinstance(event, (yaml.StreamStartEvent, yaml.StreamEndEvent, yaml.DocumentEndEvent)):
            continue
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Refused(line, (stack[-1].child_where() if stack else "") or "(document)",
                           "anchors (&name) and aliases (*name) are not allowed in specs", "values written out in full")
        if isinstance(event, (yaml.ScalarEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            nodes += 1
            if nodes > vocab.MAX_SPEC_NODES:
                raise _Refused(line, "(document)", f"more than {vocab.MAX_SPEC_NODES} values; a spec is far smaller",
                               f"at most {vocab.MAX_SPEC_NODES} values")
        if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            done = stack.pop()
            if not done.refused_key:  # a refused key's value comes next and is dropped
                place(Value(done.entries if done.is_map else done.items, done.loc))
            continue
        if stack and stack[-1].expects_key():
            top = stack[-1]
            if not isinstance(event, yaml.ScalarEvent):
                diags.error(loc, top.where or "(document)", "keys must be plain names")
                top.skip_value = True
                # The key itself is a collection: skip it whole, then its value.
                if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                    stack.append(_Collection(loc, top.where, False))
                    stack[-1].refused_key = True
                continue
            key = str(event.value)
            if key in top.entries:
                diags.error(loc, top.field(key), f"duplicate key (first given on line {top.entries[key].key_loc.line})")
                top.skip_value = True
                continue
            top.pending_key = (key, loc)
            continue
        if isinstance(event, yaml.ScalarEvent):
            place(_scalar(event.value, event.tag, event.implicit, loc))
        elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            if len(stack) >= vocab.MAX_SPEC_DEPTH:
                raise _Refused(line, stack[-1].child_where() or "(document)",
                               f"nested more than {vocab.MAX_SPEC_DEPTH} levels deep",
                               f"at most {vocab.MAX_SPEC_DEPTH} levels")
            where = stack[-1].child_where() if stack else ""
            stack.append(_Collection(loc, where, isinstance(event, yaml.MappingStartEvent)))
    return root


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, max(0, offset)) + 1


def load(path: str, display: str, diags: Diagnostics) -> Optional[Value]:
    try:
        with open(path, "rb") as f:
            data = f.read(vocab.MAX_SPEC_BYTES + 1)
    except OSError as exc:
        diags.error(Loc(display, 1), "(file)", f"cannot read: {exc.strerror or exc}")
        return None
    if len(data) > vocab.MAX_SPEC_BYTES:
        diags.error(Loc(display, 1), "(file)", f"larger than {vocab.MAX_SPEC_BYTES} bytes; a spec is a short file",
                    f"at most {vocab.MAX_SPEC_BYTES} bytes")
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        diags.error(Loc(display, _line_of(data, exc.start)), "(file)",
                    f"byte 0x{data[exc.start]:02x} at offset {exc.start} is not UTF-8", "UTF-8 text")
        return None
    before = len(diags.errors)
    try:
        # The pure-Python parser: its messages do not depend on whether libyaml is installed, and at
        # MAX_SPEC_BYTES it still takes well under a second.
        root = _build(yaml.parse(text, Loader=yaml.SafeLoader), display, diags)
    except _Refused as r:
        del diags.errors[before:]  # what was read before the refusal is incomplete
        diags.error(Loc(display, r.line), r.field, r.problem, r.allowed)
        return None
    except yaml.YAMLError as exc:
        del diags.errors[before:]
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            line = mark.line + 1
        else:  # a reader error knows only the character position
            line = text.count("\n", 0, max(0, getattr(exc, "position", 0) or 0)) + 1
        problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or str(exc).splitlines()[0]
        diags.error(Loc(display, line), "(yaml)", f"not valid YAML: {problem}")
        return None
    if root is None:
        if len(diags.errors) == before:
            diags.error(Loc(display, 1), "(document)", "the file is empty")
        return None
    return root
