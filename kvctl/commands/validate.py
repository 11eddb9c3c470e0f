"""`kvctl validate`: check a kv-transfer-config or a scenario without starting anything."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from connectors.config.validate import ConfigProblem, check_kv_transfer_config
from kvctl.errors import BadInput, ExitCode
from kvctl.options import JSON_OPT
from kvctl.scenario.schema import (
    SCENARIO_SUFFIXES,
    check_scenario,
    read_scenario_yaml,
    scenario_file,
)
from kvctl.views.output import Output


@dataclass
class ValidationResult:
    target: str
    kind: str  # "kv_transfer_config" or "scenario"
    problems: list[ConfigProblem]

    @property
    def errors(self) -> list[ConfigProblem]:
        return [p for p in self.problems if p.severity == "error"]

    def to_json(self) -> dict:
        return {"target": self.target, "kind": self.kind, "valid": not self.errors,
                "errors": len(self.errors), "warnings": len(self.problems) - len(self.errors),
                "problems": [asdict(p) for p in self.problems]}


def register(app: typer.Typer) -> None:
    app.command("validate")(validate_cmd)


def validate_cmd(
    target: str = typer.Argument(..., metavar="CONFIG_OR_SCENARIO",
                                 help="Inline JSON, @file.json, a .json file, or a scenario (YAML path or name)."),
    json_out: bool = JSON_OPT,
) -> None:
    """Validate a --kv-transfer-config (incl. MultiConnectorV0 children) or a scenario file.

    Lists every problem with its JSON path and fix; exits 2 on any error
    (warnings alone exit 0).
    """
    out = Output(json_mode=json_out)
    result = validate_target(target)
    if json_out:
        out.emit_json(result.to_json())
    else:
        render_result(result, out)
    if result.errors:
        raise typer.Exit(int(ExitCode.BAD_INPUT))


def validate_target(target: str) -> ValidationResult:
    """Parse the argument (see validate_cmd) and check it. Raises BadInput if it can't be read."""
    text = target.strip()
    if text.startswith("{") or text.startswith("["):
        return ValidationResult("inline JSON", "kv_transfer_config", check_kv_transfer_config(_json(text, "argument")))
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        return ValidationResult(str(path), "kv_transfer_config", check_kv_transfer_config(_json_file(path)))
    path = Path(text).expanduser()
    if path.suffix == ".json":
        return ValidationResult(str(path), "kv_transfer_config", check_kv_transfer_config(_json_file(path)))
    if path.is_file() and path.suffix not in SCENARIO_SUFFIXES:
        raise BadInput(f"{target}: not a .json, .yaml or .yml file", where=str(path),
                       fix="give inline JSON, @config.json, a .json file, or a scenario .yaml")
    scenario = scenario_file(text)  # BadInput names the shipped scenarios
    return ValidationResult(str(scenario), "scenario", check_scenario(read_scenario_yaml(scenario)))


def _json_file(path: Path) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(f"config file {path} does not exist", where=str(path.absolute()),
                       fix="give an existing JSON file, or the JSON itself in quotes") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read config file: {e}", where=str(path)) from None
    return _json(text, str(path))


def _json(text: str, where: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", where=where,
                       fix="quote the whole JSON for the shell ('{...}') and use double quotes inside") from None


def render_result(result: ValidationResult, out: Output) -> None:
    if not result.problems:
        kind = result.kind.replace("_", "-")
        out.stdout.print(f"[green]valid[/green] {kind}: {escape(result.target)}", highlight=False)
        return
    table = Table(title=escape(result.target), title_justify="left", show_lines=True)
    table.add_column("", no_wrap=True)
    table.add_column("path", overflow="fold")
    table.add_column("problem", overflow="fold")
    table.add_column("fix", overflow="fold")
    for p in result.problems:
        tag = "[red]error[/red]" if p.severity == "error" else "[yellow]warning[/yellow]"
        table.add_row(tag, Text(p.path), Text(p.message), Text(p.fix))
    out.stdout.print(table)
    n_err, n_warn = len(result.errors), len(result.problems) - len(result.errors)
    verdict = "[red]invalid[/red]" if n_err else "[green]valid[/green]"
    out.stdout.print(f"{verdict}: {n_err} error(s), {n_warn} warning(s)")
