"""`kvctl validate`: check a kv-transfer-config or a scenario without starting anything."""

from __future__ import annotations

import typer

from kvctl.errors import ExitCode
from kvctl.options import JSON_OPT
from kvctl.scenario.validation import validate_target
from kvctl.views.output import Output
from kvctl.views.validate import render_validation


def register(app: typer.Typer) -> None:
    app.command("validate")(validate_cmd)


def validate_cmd(
    target: str = typer.Argument(..., metavar="CONFIG_OR_SCENARIO",
                                 help="Inline JSON, @file.json, a .json file, or a scenario (YAML path or name)."),
    json_out: bool = JSON_OPT,
) -> None:
    """Validate a --kv-transfer-config (incl. MultiConnectorV0 or vLLM V1 MultiConnector children) or a scenario.

    Lists every problem with its JSON path and fix; exits 2 on any error
    (warnings alone exit 0). Says which engine a config needs ("engine" in
    --json: "v0", "v1", or "any" when both run it); one that needs vLLM V1
    (a V1 connector, MultiConnector, kv_connector_module_path) is checked for V1.
    """
    out = Output(json_mode=json_out)
    result = validate_target(target)
    if json_out:
        out.emit_json(result.to_json())
    else:
        render_validation(result, out)
    if result.errors:
        raise typer.Exit(int(ExitCode.BAD_INPUT))
