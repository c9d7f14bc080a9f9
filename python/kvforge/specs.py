"""Spec validation from Python: the same checks and messages as `kvforge-codegen validate`.

    kvforge.specs.validate(["specs/layouts"], ["specs/models"])  # -> list of variant names

Raises kvforge.SpecError carrying every `file:line: field: problem (allowed: ...)` at once.
"""

import os
import sys

from .errors import SpecError


def import_codegen():
    """Makes the spec compiler kvforge was built with importable (the installed copy for an install)."""
    try:
        import kvforge_codegen  # noqa: F401
    except ImportError:
        from ._paths import CODEGEN
        sys.path.insert(0, CODEGEN)


def _codegen():
    import_codegen()
    from kvforge_codegen import plan, validate as checks
    from kvforge_codegen.diagnostics import SpecFailure
    return plan, checks, SpecFailure


def validate(layouts, models, tuning=(), root=None):
    """Reads and checks spec files or folders; returns the names of the variants they expand to.

    layouts, models, tuning: lists of YAML files or folders of them. root: paths in messages are
    shown relative to it (default: the current directory).
    """
    plan, checks, SpecFailure = _codegen()
    root = root or os.getcwd()
    try:
        specs = checks.load_specs(list(layouts), list(models), root, list(tuning))
    except SpecFailure as failure:
        raise SpecError([str(e) for e in failure.errors]) from None
    return [v.name for v in plan.plan_variants(specs)]
