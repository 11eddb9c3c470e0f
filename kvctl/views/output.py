"""Everything kvctl shows people or machines goes through an Output.

Human output is rich on stderr/stdout; `--json` prints exactly one JSON object
on stdout and nothing else there. Tests pass their own consoles in.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from kvctl.errors import KvctlError


@dataclass
class Output:
    json_mode: bool = False
    stdout: Console = field(default_factory=lambda: Console(soft_wrap=True))
    stderr: Console = field(default_factory=lambda: Console(stderr=True, soft_wrap=True))

    def emit_json(self, obj: Any) -> None:
        """The one JSON object of a --json run, on stdout."""
        sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
        sys.stdout.flush()

    def info(self, msg: str) -> None:
        """Progress and diagnostics: stderr, so --json stdout stays clean."""
        self.stderr.print(msg)

    def error(self, e: KvctlError) -> None:
        if self.json_mode:
            self.emit_json(e.to_json())
        self.stderr.print(f"[bold red]error:[/bold red] {e.what}", highlight=False)
        if e.where:
            self.stderr.print(f"  [dim]where:[/dim] {e.where}", highlight=False)
        if e.fix:
            self.stderr.print(f"  [dim]fix:[/dim]   {e.fix}", highlight=False)
        if e.details:
            self.stderr.print(e.details, highlight=False, markup=False)


def human_size(n: float) -> str:
    """Bytes as people read them: 512 B, 16.1 KiB, 3.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
