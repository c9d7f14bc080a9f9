"""kvforge codegen command line. Run as `python3 -m kvforge_codegen` with codegen/ on PYTHONPATH,
or through tools/kvforge-codegen."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import List

from . import VERSION, vocab
from .diagnostics import SpecFailure
from .plan import Filters, filter_problems, plan_variants
from .render import SOURCES, differs, output_names, read_sources, render, render_vocab_header, write_changed
from .validate import load_specs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _built(args: argparse.Namespace) -> tuple:
    return args.backends


def _wide_levels(args: argparse.Namespace) -> tuple:
    """The wider x86-64 levels that get kernel files of their own: none with --one-cpu-level."""
    return () if args.one_cpu_level else vocab.CPU_WIDE_LEVELS


def _backend_list(text: str) -> tuple:
    given = _csv(text)
    unknown = [b for b in given if b not in vocab.BACKENDS]
    if unknown or "cpu" not in given:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed backends are {', '.join(vocab.BACKENDS)}, cpu included")
    return tuple(b for b in vocab.BACKENDS if b in given)  # in Device order


def _csv(text: str) -> tuple:
    return tuple(x for x in (p.strip() for p in text.split(",")) if x) if text else ()


_QUALIFIED_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(::[A-Za-z_][A-Za-z0-9_]*)*")


def _registry_function(text: str) -> str:
    if not _QUALIFIED_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: not a qualified C++ name (allowed: identifiers joined by ::)")
    return text


def _tuning_beside(layouts: List[str]) -> List[str]:
    """The tuning folders that sit beside the given layouts folders (specs/layouts -> specs/tuning)."""
    found = []
    for path in layouts:
        if os.path.isdir(path):
            tuning = os.path.join(os.path.dirname(os.path.abspath(path.rstrip(os.sep))), "tuning")
            if os.path.isdir(tuning) and tuning not in found:
                found.append(tuning)
    return found


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvforge-codegen",
        description="Validate kvforge layout and model specs, list their variants, and generate C++/CUDA.")
    p.add_argument("--version", action="version", version=f"kvforge codegen {VERSION}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def backends(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--backends", type=_backend_list, default=tuple(vocab.BACKENDS), metavar="B,B",
                        help=f"the backends the build has: each gets its kernel files, and the variants' traits name "
                             f"only their kernels (default and allowed: {','.join(vocab.BACKENDS)}; cpu is required)")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--layouts", nargs="+", default=[os.path.join(REPO, "specs", "layouts")],
                        metavar="PATH", help="layout spec files or folders (default: specs/layouts)")
        sp.add_argument("--models", nargs="+", default=[os.path.join(REPO, "specs", "models")],
                        metavar="PATH", help="model spec files or folders (default: specs/models)")
        sp.add_argument("--tuning", nargs="*", default=None, metavar="PATH",
                        help="tuning files or folders (default: the folder `tuning` beside each layouts folder, "
                             "where it exists; never another project's)")
        sp.add_argument("--source-root", default=REPO,
                        help="paths in messages and provenance headers are relative to this (default: repo)")
        sp.add_argument("--layout", type=_csv, default=(), help="keep only these layouts (comma-separated)")
        sp.add_argument("--model", type=_csv, default=(), help="keep only these models (comma-separated)")
        sp.add_argument("--dtype", type=_csv, default=(), help="keep only these storage dtypes (comma-separated)")
        sp.add_argument("--cover", action="store_true",
                        help="of the variants kept, only those that cover every kernel: per layout and dtypes, the "
                             "narrowest and the widest stored head (a compile or sanitizer check)")

    sp = sub.add_parser("validate", help="check every spec and report all errors as file:line")
    common(sp)
    sp = sub.add_parser("list", help="list the variants with their bytes per token; builds nothing")
    common(sp)
    def registry_function(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--registry-function", default="kvforge::registry", type=_registry_function,
                        help="qualified name of the generated registry accessor (default: kvforge::registry); "
                             "<name with :: as _>.hpp declares it")

    def one_cpu_level(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--one-cpu-level", action="store_true",
                        help="no CPU kernel files for the wider x86-64 levels: each variant's file holds the kernels "
                             "of the level it is compiled for only (an on-demand library, or a build of "
                             "KVFORGE_CPU_LEVELS=<level> or native, built for one kind of machine)")

    sp = sub.add_parser("outputs", help="print the files `generate` would write, one per line (for CMake)")
    common(sp)
    backends(sp)
    registry_function(sp)
    one_cpu_level(sp)
    sp = sub.add_parser("generate", help="write generated sources into a folder, touching only changed files")
    common(sp)
    backends(sp)
    registry_function(sp)
    one_cpu_level(sp)
    sp.add_argument("--out", required=True, help="output folder")
    sp = sub.add_parser("check", help="fail if a folder differs from what the specs generate (stale generated/)")
    common(sp)
    sp.add_argument("--against", required=True, help="folder holding a committed expansion")
    sp.add_argument("--refresh-hint", default="cmake --build build --target kvforge_refresh_generated",
                    help="the command printed to refresh a stale folder")
    sp.add_argument("--listed-specs", action="store_true",
                    help="expand only the spec files the folder's SOURCES.txt lists (relative to --source-root), "
                         "so that specs added beside them do not count; the test of the committed generated/ "
                         "uses this")
    sp = sub.add_parser("build-variant",
                        help="build one variant on demand into a cached shared library (what C++'s kvforge::variant "
                             "runs); prints the library's path, its registry function and the variant's name")
    sp.add_argument("--layout", required=True, help="a default layout's name (in --specs) or a layout spec file")
    sp.add_argument("--model", required=True, help="a default model's name (in --specs) or a model spec file")
    sp.add_argument("--dtype", required=True, help="the storage dtype")
    sp.add_argument("--input", default=None, help="the dtype appended and gathered (default: --dtype)")
    sp.add_argument("--window", type=int, default=None, help="a ring layout's window (default: the layout's)")
    sp.add_argument("--name", default=None, help="the layout's name in the variant's (default: the spec's)")
    sp.add_argument("--specs", default=os.path.join(REPO, "specs"), help="where default specs are (default: specs/)")
    sp.add_argument("--include", required=True, help="the runtime's include folder")
    sp.add_argument("--compiler", default="c++", help="the C++ compiler (default: c++)")
    sp.add_argument("--device", default="", metavar="BACKEND|COMPILER|TARGETS|LIB",
                    help="where the runtime has a device backend: the library gets its kernels too, compiled by "
                         "COMPILER for TARGETS (comma-separated) with the flags of its vocab.BACKENDS row, linking "
                         "its runtime from LIB (default: none, CPU only)")
    sp.add_argument("--cpu-level", type=int, default=vocab.CPU_BASE_LEVEL,
                    choices=(vocab.CPU_BASE_LEVEL,) + vocab.CPU_WIDE_LEVELS,
                    help="the x86-64 level the library's CPU kernels are built for: the level the asking process "
                         f"runs at (default: {vocab.CPU_BASE_LEVEL}, which every x86-64 CPU kvforge serves runs)")
    sp.add_argument("--link", action="append", default=[], metavar="ITEM",
                    help="what the library links for the runtime (repeat; --link=ITEM for an ITEM starting with -): "
                         "the runtime archive, or a library holding it")
    sp = sub.add_parser("vocab-header", help="write or check runtime/include/kvforge/vocab.hpp, vocab.py's table for C++")
    group = sp.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", help="write the header here (only when its content changed)")
    group.add_argument("--check", help="fail if this header differs from what vocab.py gives")
    return p


def _vocab_header(args: argparse.Namespace) -> int:
    text = render_vocab_header()
    if args.check:
        if differs(args.check, text):
            print(f"kvforge-codegen: {args.check} differs from codegen/kvforge_codegen/vocab.py; refresh it with: "
                  f"tools/kvforge-codegen vocab-header --out {args.check}", file=sys.stderr)
            return 1
        print(f"ok: {args.check} matches vocab.py")
        return 0
    directory, name = os.path.split(os.path.abspath(args.out))
    written = write_changed({name: text}, directory)
    print(f"kvforge-codegen: {args.out} {'written' if written else 'unchanged'}")
    return 0


# build-variant's exit status per kind of refusal (C++'s kvforge::variant maps it back to its error class).
BUILD_VARIANT_STATUS = {"spec": 1, "argument": 3, "unsupported": 4, "backend": 5}


def _build_variant(args: argparse.Namespace) -> int:
    from . import on_demand
    try:
        layouts, model, wanted = on_demand.request(on_demand.spec_of("layout", args.layout, "layouts", args.specs),
                                                   on_demand.spec_of("model", args.model, "models", args.specs),
                                                   args.dtype, args.input, args.window, args.name, args.specs)
        compiler = on_demand.compiler_identity(args.compiler)
        if compiler is None:
            raise on_demand.no_compiler(args.compiler, wanted)
        device = on_demand.device_of(args.device, wanted)
        key = on_demand.key_of(layouts, model, args.include, compiler, args.link, device, args.cpu_level)
        path, registry_function = on_demand.library(layouts, model, wanted, key, compiler=compiler[0],
                                                    include=args.include, link=args.link, device=device,
                                                    cpu_level=args.cpu_level)
    except on_demand.OnDemandError as e:
        # First line: the kind and the argument it names; then the message (a spec's: one error a line).
        print(f"{e.kind} {e.argument or '-'}", file=sys.stderr)
        print("\n".join(e.lines) if e.lines else str(e), file=sys.stderr)
        return BUILD_VARIANT_STATUS[e.kind]
    print(path)
    print(registry_function)
    print(wanted)
    return 0


def main(argv: List[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "vocab-header":
        return _vocab_header(args)
    if args.command == "build-variant":
        return _build_variant(args)
    if getattr(args, "listed_specs", False):
        listed = read_sources(os.path.join(args.against, SOURCES))
        if not listed["layout"]:
            print(f"kvforge-codegen: {os.path.join(args.against, SOURCES)} is missing or lists no layout; "
                  f"refresh it with: {args.refresh_hint}", file=sys.stderr)
            return 1
        root = args.source_root
        args.layouts, args.models, args.tuning = ([os.path.join(root, f) for f in listed[k]]
                                                  for k in ("layout", "model", "tuning"))
    if args.tuning is None:
        args.tuning = _tuning_beside(args.layouts)
    try:
        specs = load_specs(args.layouts, args.models, args.source_root, args.tuning)
    except SpecFailure as failure:
        for e in failure.errors:
            print(e, file=sys.stderr)
        print(f"kvforge-codegen: {len(failure.errors)} error(s) in the specs; nothing was written",
              file=sys.stderr)
        return 1
    filters = Filters(args.layout, args.model, args.dtype, getattr(args, "cover", False))
    problems = filter_problems(specs, filters)
    if problems:
        for p in problems:
            print(f"kvforge-codegen: {p}", file=sys.stderr)
        return 2
    variants = plan_variants(specs, filters)

    if args.command == "validate":
        print(f"ok: {len(specs.layouts)} layouts, {len(specs.models)} models, {len(variants)} variants")
        return 0
    if args.command == "list":
        width = max((len(v.name) for v in variants), default=7)
        print(f"{'variant':<{width}}  {'addressing':<10}  {'update':<6}  {'scales':<44}  {'bytes/token':>11}")
        for v in variants:
            q = v.quantization
            scales = q.summary if q else "-"
            addressing = "hybrid" if v.members else v.layout.addressing
            if v.members:
                scales = ", ".join(f"{g.name}: {m.layout.name}" for g, m in v.members)
            print(f"{v.name:<{width}}  {addressing:<10}  {v.layout.update:<6}  {scales:<44}  {v.bytes_per_token:>11}")
        print(f"{len(variants)} variants")
        return 0
    if args.command == "outputs":
        for name in output_names(variants, _built(args), args.registry_function, _wide_levels(args)):
            print(name)
        return 0
    if args.command == "generate":
        written = write_changed(render(variants, args.registry_function, _built(args), _wide_levels(args)), args.out)
        print(f"kvforge-codegen: {len(variants)} variants, {len(written)} file(s) changed in {args.out}")
        return 0
    if args.command == "check":
        files = render(variants)
        stale = [name for name, text in sorted(files.items()) if differs(os.path.join(args.against, name), text)]
        extra = sorted(set(os.listdir(args.against)) - set(files)) if os.path.isdir(args.against) else []
        if stale or extra:
            for name in stale:
                print(f"stale or missing: {os.path.join(args.against, name)}", file=sys.stderr)
            for name in extra:
                print(f"not generated by any spec: {os.path.join(args.against, name)}", file=sys.stderr)
            print(f"kvforge-codegen: {args.against} does not match the specs; refresh it with: {args.refresh_hint}",
                  file=sys.stderr)
            return 1
        print(f"ok: {args.against} matches the specs ({len(files)} files)")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
