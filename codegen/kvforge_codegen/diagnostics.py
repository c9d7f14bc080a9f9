"""Every spec error carries `file:line`, and all of them are reported at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional


@dataclass(frozen=True)
class Loc:
    file: str
    line: int  # 1-based

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class SpecError:
    loc: Loc
    field: str
    problem: str
    allowed: Optional[str] = None

    def __str__(self) -> str:
        text = f"{self.loc}: {self.field}: {self.problem}"
        if self.allowed:
            text += f" (allowed: {self.allowed})"
        return text


class Diagnostics:
    def __init__(self) -> None:
        self.errors: List[SpecError] = []

    def error(self, loc: Loc, field: str, problem: str, allowed: Optional[Iterable[str] | str] = None) -> None:
        if allowed is not None and not isinstance(allowed, str):
            allowed = ", ".join(allowed)
        self.errors.append(SpecError(loc, field, problem, allowed))

    def __bool__(self) -> bool:
        return bool(self.errors)

    def sorted(self) -> List[SpecError]:
        return sorted(self.errors, key=lambda e: (e.loc.file, e.loc.line, e.field))


class SpecFailure(Exception):
    """Raised once, after every file was read, when any error was found."""

    def __init__(self, errors: List[SpecError]) -> None:
        super().__init__("\n".join(str(e) for e in errors))
        self.errors = errors
