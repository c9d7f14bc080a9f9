"""Variant names: one function forms them, one parses them. The planner names its variants with these, the
checks name them in messages, and the runtime's variant_name (registry.hpp) spells them the same way
(a test holds the two equal for every variant)."""

from __future__ import annotations

from typing import Tuple


def dtype_field(storage: str, input_dtype: str) -> str:
    return storage if storage == input_dtype else f"{storage}_in_{input_dtype}"


def variant_name(layout: str, model: str, storage: str, input_dtype: str) -> str:
    return f"{layout}.{model}.{dtype_field(storage, input_dtype)}"


def variant_symbol(name: str) -> str:
    """The C++ identifier of a variant: its name with '.' spelled '__' (names never contain '__')."""
    return name.replace(".", "__")


def parse_variant_name(name: str) -> Tuple[str, str, str, str]:
    """name -> (layout, model, storage, input). Inverse of variant_name."""
    parts = name.split(".")
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"{name!r} is not layout.model.dtype")
    layout, model, dt = parts
    storage, _, input_dtype = dt.partition("_in_")
    return layout, model, storage, input_dtype or storage
