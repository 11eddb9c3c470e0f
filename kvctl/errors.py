"""The one user-facing error family and the exit codes the CLI maps it to."""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    CHECK_FAILED = 1  # the cluster ran, but a verification check failed
    BAD_INPUT = 2  # the user asked for something invalid; nothing was changed
    RUNTIME_FAILED = 3  # a launch, rig install or process failed
    INTERRUPTED = 130  # Ctrl-C


class KvctlError(Exception):
    """An error a person can act on: what went wrong, where, and the fix.

    Library code raises it (or a subclass); only the CLI renders it, in one
    place, and exits with `exit_code`.
    """

    exit_code: ExitCode = ExitCode.BAD_INPUT

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None,
                 details: str | None = None, field: str | tuple[str, ...] | None = None):
        self.what = what
        # Library code names the input at fault by its field name ("max_tokens",
        # "prefill_config"); each front end turns that into what its user typed
        # (a CLI flag, a scenario path) with `locate`. `where` is for places that
        # are not inputs (a file, a JSON path inside a config).
        self.fields: tuple[str, ...] = (field,) if isinstance(field, str) else tuple(field or ())
        self.where = where
        self.fix = fix
        self.details = details  # e.g. a log tail or pip output
        super().__init__(self.message)

    def locate(self, name_of: "Callable[[str], str | None]") -> "KvctlError":
        """Fill `where` from `fields` as a front end names them; returns self.

        `name_of` maps a field to the user's spelling of it, or None when that
        front end has no such input (then the field name itself is shown).
        """
        if self.where is None and self.fields:
            self.where = ", ".join(name_of(f) or f for f in self.fields)
        return self

    @property
    def message(self) -> str:
        parts = [self.what]
        if self.where:
            parts.append(f"where: {self.where}")
        if self.fix:
            parts.append(f"fix: {self.fix}")
        return "\n".join(parts)

    def to_json(self) -> dict:
        return {"error": self.what, "where": self.where, "fix": self.fix,
                "details": self.details, "exit_code": int(self.exit_code)}


class BadInput(KvctlError):
    exit_code = ExitCode.BAD_INPUT


class RuntimeFailure(KvctlError):
    """Something we started (pip, a server, a container) failed."""

    exit_code = ExitCode.RUNTIME_FAILED
