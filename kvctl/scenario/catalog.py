"""The shipped scenarios, each with whether it is valid and whether this machine can run it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvctl.errors import BadInput
from kvctl.runtime import select_runtime
from kvctl.scenario.schema import list_scenarios, load_scenario


def describe_scenario(path: Path) -> dict[str, Any]:
    """One row of `kvctl scenario list --json`: name, file, valid, runnable, note (and more when valid)."""
    row: dict[str, Any] = {"name": path.stem, "file": str(path)}
    try:
        s = load_scenario(str(path))
    except BadInput as e:
        return {**row, "valid": False, "runnable": False, "note": f"invalid: {e.what}"}
    row.update(name=s.name, valid=True, runtime=s.runtime, model=s.model, prompts=len(s.prompts),
               description=" ".join(s.description.split()))
    try:
        runtime, why = select_runtime(s.runtime)
        row.update(runnable=True, note=f"{runtime}: {why}")
    except BadInput as e:
        row.update(runnable=False, note=e.what)
    return row


def describe_shipped() -> list[dict[str, Any]]:
    """`describe_scenario` of every shipped scenario, sorted by file name."""
    return [describe_scenario(path) for path in list_scenarios()]
