"""`kvctl scenario list` and `kvctl scenario run`: declarative 1P1D runs, always torn down."""

from __future__ import annotations

from pathlib import Path

import typer

from kvctl.errors import BadInput
from kvctl.options import JSON_OPT, json_option
from kvctl.runtime import requested_runtime_class
from kvctl.scenario.catalog import describe_shipped
from kvctl.scenario.runner import run_scenario, write_scenario_junit
from kvctl.scenario.schema import load_scenario, scenario_file
from kvctl.views.output import Output
from kvctl.views.rig import ensure_rig
from kvctl.views.scenario import RunDisplay, render_run, render_scenario_list

scenario_app = typer.Typer(help="Run declarative scenarios: launch, verify, inspect the store, tear down.",
                           no_args_is_help=True)


def register(app: typer.Typer) -> None:
    scenario_app.command("list")(list_cmd)
    scenario_app.command("run")(run_cmd)
    app.add_typer(scenario_app, name="scenario")


def list_cmd(json_out: bool = JSON_OPT) -> None:
    """List the shipped scenarios and whether this machine can run them."""
    out = Output(json_mode=json_out)
    rows = describe_shipped()
    if json_out:
        out.emit_json({"scenarios": rows})
    else:
        render_scenario_list(rows, out)


def run_cmd(
    target: str = typer.Argument(..., metavar="NAME|FILE", help="A shipped scenario's name or a YAML file."),
    json_out: bool = json_option("Print one JSON object (the report) on stdout."),
    junit_xml: Path | None = typer.Option(None, "--junit-xml", help="Also write JUnit XML here."),
    keep: bool = typer.Option(False, "--keep", help="Keep the store and server logs (servers still stop)."),
    engine: str | None = typer.Option(
        None, "--engine", help="vLLM engine of P and D: v0 or v1, over the scenario's `engine:` "
                               "(default there: v0) and its roles' own."),
) -> None:
    """Launch the scenario's cluster, verify every prompt, inspect the store, tear down.

    Teardown always runs. Exit 0 when everything passes, 1 when a check or the
    store check fails, 2 for an invalid scenario (nothing is started), 3 when
    the cluster cannot start, 130 on Ctrl-C.
    """
    out = Output(json_mode=json_out)
    if junit_xml is not None and not junit_xml.expanduser().absolute().parent.is_dir():
        raise BadInput(f"the directory of {junit_xml} does not exist", where="--junit-xml",
                       fix="pass a path in an existing directory")
    source = str(scenario_file(target))
    scenario = load_scenario(target)
    if engine is not None:
        if engine not in ("v0", "v1"):
            raise BadInput(f"unknown engine {engine!r}", where="--engine", fix="use v0 or v1")
        scenario = scenario.model_copy(update={
            "engine": engine,
            **{role: scenario.role(role).model_copy(update={"engine": None})
               for role in ("prefill", "decode") if getattr(scenario, role) is not None}})
    out.info(f"scenario [bold]{scenario.name}[/bold] ({source})")
    engines = () if scenario.attaches else tuple(scenario.role(r).engine or scenario.engine
                                                  for r in ("prefill", "decode"))
    if requested_runtime_class(scenario.runtime).host_rigs and (scenario.attaches or "v0" in engines):
        ensure_rig(out)  # the V0 rig; a V1 one missing is reported by the launch, with its fix
    with RunDisplay(out) as display:
        report = run_scenario(scenario, display, keep=keep, source=source)
    if junit_xml is not None:
        write_scenario_junit(report, junit_xml)
        out.info(f"JUnit XML written to {junit_xml}")
    if json_out:
        if report.error is not None:
            Output(stderr=out.stderr).error(report.error)  # human form: stdout holds the report
        out.emit_json(report.to_json())
    else:
        render_run(report, out)
    if report.exit_code:
        raise typer.Exit(report.exit_code)
