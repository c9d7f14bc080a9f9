"""Variant plan -> file contents. One template per artifact kind; files written only when changed."""

from __future__ import annotations

import os
from typing import Dict, List

import jinja2

from . import VERSION, vocab
from .plan import Variant

TEMPLATE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "templates")

# (file-name pattern, template) per variant; {name} is the variant name.
PER_VARIANT = (("{name}.hpp", "variant.hpp.j2"), ("{name}.cpp", "variant.cpp.j2"), ("{name}.cu", "variant.cu.j2"))
PER_SET = (("registry.cpp", "registry.cpp.j2"), ("MANIFEST.md", "MANIFEST.md.j2"))


def output_names(variants: List[Variant], cuda: bool = True) -> List[str]:
    names = [pattern.format(name=v.name) for v in variants for pattern, _ in PER_VARIANT
             if cuda or not pattern.endswith(".cu")]
    return names + [pattern for pattern, _ in PER_SET]


def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, trim_blocks=False, lstrip_blocks=False)


def render(variants: List[Variant], registry_function: str = "kvforge::registry") -> Dict[str, str]:
    env = _environment()
    common = {"version": VERSION, "dtypes": vocab.DTYPES, "registry_function": registry_function}
    files: Dict[str, str] = {}
    for v in variants:
        for pattern, template in PER_VARIANT:
            files[pattern.format(name=v.name)] = env.get_template(template).render(v=v, **common)
    for name, template in PER_SET:
        files[name] = env.get_template(template).render(variants=variants, **common)
    return files


def differs(path: str, text: str) -> bool:
    """Staleness by content, never by modification time."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            return f.read() != text
    except OSError:
        return True


def write_changed(files: Dict[str, str], out_dir: str) -> List[str]:
    """Write each file whose content differs; never delete anything. Returns what was written."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, text in sorted(files.items()):
        path = os.path.join(out_dir, name)
        if not differs(path, text):
            continue
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        written.append(name)
    return written
