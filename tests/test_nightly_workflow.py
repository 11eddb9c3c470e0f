"""The nightly GPU workflow (.github/workflows/nightly-gpu.yml), checked without a GPU.

It cannot run here. These tests check what can be checked: the YAML parses into
a workflow for a self-hosted `gpu` runner that runs nightly and on demand;
every `kvctl ...` command line in it names a command that exists, with flags
that command accepts and values it takes (read from the CLI's own click
objects); it builds both GPU images, runs every shipped GPU scenario on its
engine with JUnit XML into a directory it made, and uploads the results.
"""

from __future__ import annotations

import shlex
from pathlib import Path, PurePosixPath

import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from connectors.config.names import ENGINES
from kvctl.cli import app
from kvctl.scenario.schema import list_scenarios, load_scenario

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "nightly-gpu.yml"
CLI = typer.main.get_command(app)  # the click command tree typer builds (public attributes only)


class BadLine(Exception):
    """A kvctl command line the CLI would refuse."""


def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def steps() -> list[dict]:
    (job,) = workflow()["jobs"].values()
    return job["steps"]


def kvctl_lines() -> list[list[str]]:
    """Each kvctl invocation in the run scripts, as argv after `kvctl` (redirections dropped)."""
    found = []
    for step in steps():
        script = step.get("run", "").replace("\\\n", " ")
        for line in script.splitlines():
            argv = shlex.split(line, comments=True)
            for i, word in enumerate(argv):
                if word == "kvctl" or word.endswith("/kvctl"):
                    rest = argv[i + 1:]
                    cut = [j for j, w in enumerate(rest) if w in (">", ">>", "|", "&&", "||", ";")]
                    found.append(rest[:cut[0]] if cut else rest)
                    break
    return found


def parse(argv: list[str]) -> tuple[list[str], dict[str, object], list[str]]:
    """(command path, {option name: value}, arguments) as the CLI would take them; raises BadLine."""
    cmd, path = CLI, []
    while hasattr(cmd, "commands") and argv and not argv[0].startswith("-"):
        if argv[0] not in cmd.commands:
            raise BadLine(f"kvctl {' '.join(path + [argv[0]])}: no such command")
        cmd, path, argv = cmd.commands[argv[0]], path + [argv[0]], argv[1:]
    if hasattr(cmd, "commands"):
        raise BadLine(f"kvctl {' '.join(path)} needs a subcommand")
    options = {o: p for p in cmd.params if p.param_type_name == "option" for o in p.opts}
    wanted = [p for p in cmd.params if p.param_type_name == "argument"]
    opts: dict[str, object] = {}
    args: list[str] = []
    rest = list(argv)
    while rest:
        word = rest.pop(0)
        if word.startswith("-"):
            name, eq, value = word.partition("=")
            if name not in options:
                raise BadLine(f"kvctl {' '.join(path)}: no option {name}")
            p = options[name]
            if p.is_flag:
                opts[p.name] = True
            else:
                if not eq:
                    if not rest:
                        raise BadLine(f"kvctl {' '.join(path)}: {name} needs a value")
                    value = rest.pop(0)
                opts[p.name] = value
        else:
            args.append(word)
    if len(args) != len(wanted):
        raise BadLine(f"kvctl {' '.join(path)}: {len(wanted)} argument(s) expected, got {args}")
    if opts.get("engine", "v0") not in ENGINES:
        raise BadLine(f"kvctl {' '.join(path)}: engine {opts['engine']!r}")
    return path, opts, args


def test_workflow_parses_and_targets_a_self_hosted_gpu_runner_nightly_and_on_demand():
    wf = workflow()
    triggers = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` as true
    assert triggers["schedule"][0]["cron"].split()[2:] == ["*", "*", "*"]  # every day
    assert "workflow_dispatch" in triggers
    (job,) = wf["jobs"].values()
    assert job["runs-on"] == ["self-hosted", "gpu"]
    assert job["env"]["KVCTL_MODELS"]  # the GPU scenarios' model cache


def test_every_kvctl_command_exists_and_accepts_its_flags():
    lines = kvctl_lines()
    assert len(lines) >= 6
    for argv in lines:
        try:
            parse(argv)
        except BadLine as e:
            pytest.fail(f"kvctl {shlex.join(argv)}: {e}")


def test_every_flag_is_in_the_commands_own_help():
    """The installed CLI agrees: `kvctl <command> --help` shows every flag the workflow passes."""
    seen: dict[tuple[str, ...], set[str]] = {}
    for argv in kvctl_lines():
        path, _, _ = parse(argv)
        seen.setdefault(tuple(path), set()).update(w.partition("=")[0] for w in argv if w.startswith("--"))
    for path, flags in seen.items():
        r = CliRunner().invoke(app, [*path, "--help"], terminal_width=200, env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        for flag in flags:
            assert flag in r.output, f"kvctl {' '.join(path)} --help does not show {flag}"


def test_the_flag_check_catches_a_bad_flag_and_a_bad_command():
    for bad in (["scenario", "run", "fs-1p1d-gpu", "--junit-xm", "x.xml"], ["scenarios", "run", "x"],
                ["scenario", "run"], ["image", "build", "gpu", "--engine"], ["image", "build", "gpu", "--engine", "v2"],
                ["image"]):
        with pytest.raises(BadLine):
            parse(bad)


def test_builds_both_gpu_images():
    builds = {(a[0], o["engine"]) for p, o, a in map(parse, kvctl_lines()) if p == ["image", "build"]}
    assert builds == {("gpu", "v0"), ("gpu", "v1")}


def test_runs_every_shipped_gpu_scenario_on_its_engine_with_junit():
    runs = [(a[0], o) for p, o, a in map(parse, kvctl_lines()) if p == ["scenario", "run"]]
    gpu = {load_scenario(str(f)).name: load_scenario(str(f)) for f in list_scenarios()}
    gpu = {n: s for n, s in gpu.items() if s.gpus}
    assert {name for name, _ in runs} == set(gpu), "every GPU scenario, and only those"
    assert {o["engine"] for _, o in runs} == {"v0", "v1"}
    for name, opts in runs:
        assert opts["engine"] == gpu[name].engine, name  # the engine its image runs
        junit = PurePosixPath(str(opts["junit_xml"]))
        assert junit.suffix == ".xml"
        assert f"mkdir -p {junit.parent}" in WORKFLOW.read_text()  # its directory exists


def test_results_are_uploaded_even_when_a_scenario_fails():
    upload = next(s for s in steps() if str(s.get("uses", "")).startswith("actions/upload-artifact@"))
    assert upload["if"].strip("${} ") == "always()"
    assert "results/" in upload["with"]["path"]
    later = steps()[steps().index(upload) - 1]
    assert "!cancelled()" in later["if"]  # a failed scenario does not skip the next


def test_readme_documents_the_nightly_workflow():
    readme = (ROOT / "README.md").read_text()
    assert ".github/workflows/nightly-gpu.yml" in readme and "self-hosted" in readme
