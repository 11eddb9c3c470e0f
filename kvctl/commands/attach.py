"""`kvctl attach` and `kvctl detach`: register a cluster kvctl did not start, and forget it.

Each command parses options, calls one function of kvctl.attach.attach and
renders the result (kvctl.views.attach).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import typer

from kvctl.attach.attach import AttachSpec, attach_cluster, detach_cluster, spec_from_file, spec_from_options
from kvctl.cluster.state import launch_store_keys
from kvctl.errors import BadInput
from kvctl.runtime.base import STORE_KEY_ENVS
from kvctl.options import json_option
from kvctl.views.attach import render_attached, render_detached
from kvctl.views.output import Output

_SOURCE_HELP = "a log file path, or cmd:COMMAND whose output is the log (e.g. 'cmd:kubectl logs -f --tail=0 pod/x')"


def attach_cmd(
    name: str | None = typer.Argument(None, help="Cluster name (default: the attach file's name)."),
    prefill: str | None = typer.Option(None, "--prefill", help="The prefill server's URL, e.g. http://10.0.0.5:8000."),
    decode: str | None = typer.Option(None, "--decode", help="The decode server's URL."),
    prefill_log: str | None = typer.Option(None, "--prefill-log", help=f"P's log: {_SOURCE_HELP}."),
    decode_log: str | None = typer.Option(None, "--decode-log", help="D's log: a file path or cmd:COMMAND."),
    store: Path | None = typer.Option(None, "--store", help="The store dir as seen from here (default: not "
                                                            "visible here; its check is then not observable)."),
    endpoint: str | None = typer.Option(None, "--endpoint", help="The router's URL, if there is one."),
    model_name: str | None = typer.Option(None, "--model-name", help="Served model name (default: asked from "
                                                                     "P's /v1/models)."),
    file: Path | None = typer.Option(None, "--file", help="An attach file (xPyD pools; see docs/k8s.md)."),
    from_k8s: Path | None = typer.Option(None, "--from-k8s", help="A directory `kvctl render k8s` wrote "
                                                                  "(its attach.yaml)."),
    store_key_file: Path | None = typer.Option(
        None, "--store-key-file", metavar="PATH",
        help="The cluster's store keys (one per line; default $KVCTL_STORE_KEY_FILE): verify and inspect-store "
             "check entries' tags with them. kvctl keeps a copy in CLUSTER_DIR/store_key (mode 0600)."),
    json_: bool = json_option("Print the cluster state as JSON."),
) -> None:
    """Register a running P/D cluster kvctl did not start; starts and changes nothing.

    One P and one D: --prefill URL --decode URL, with --prefill-log and --decode-log
    (a file, or cmd:COMMAND such as 'cmd:kubectl logs -f --tail=0 pod/x'). Pools:
    --file cluster.yaml, or --from-k8s DIR. Then status, verify, inspect-store and
    scenarios work on it; `kvctl detach NAME` forgets it; `kvctl down` refuses it.
    Servers that require an API key: set $KVCTL_API_KEY; verify and bench send it (never stored).
    Servers that sign store entries: --store-key-file PATH, and verify and inspect-store check the tags.
    """
    out = Output(json_mode=json_)
    try:
        spec = _spec(name, prefill, decode, prefill_log, decode_log, store, endpoint, model_name, file, from_k8s)
        keys = launch_store_keys(store_key_file is not None or STORE_KEY_ENVS[1] in os.environ, store_key_file)
        render_attached(out, attach_cluster(replace(spec, store_keys=keys)))
    except BadInput as e:
        if e.fields == ("name",) and e.where is None:
            e.where = "NAME"  # an argument here, not the usual --name option
        raise


def _spec(name: str | None, prefill: str | None, decode: str | None, prefill_log: str | None,
          decode_log: str | None, store: Path | None, endpoint: str | None, model_name: str | None,
          file: Path | None, from_k8s: Path | None) -> AttachSpec:
    """The AttachSpec the options describe. Raises BadInput for options that do not go together."""
    if file is not None and from_k8s is not None:
        raise BadInput("--file and --from-k8s both given", where="--file / --from-k8s", fix="give one of them")
    path = file if file is not None else from_k8s
    if path is not None:
        given = [flag for flag, v in (("--prefill", prefill), ("--decode", decode), ("--prefill-log", prefill_log),
                                      ("--decode-log", decode_log), ("--store", store), ("--endpoint", endpoint))
                 if v is not None]
        if given:
            raise BadInput(f"{', '.join(given)} given with an attach file, which says them",
                           where=" / ".join(given), fix="edit the attach file, or attach with options only")
        spec = spec_from_file(path, name)
        return replace(spec, served_model_name=model_name) if model_name else spec
    missing = [flag for flag, v in (("--prefill", prefill), ("--decode", decode)) if v is None]
    missing += [] if name else ["NAME"]
    if missing:
        raise BadInput(f"missing {', '.join(missing)}", where=" / ".join(missing),
                       fix="kvctl attach NAME --prefill URL --decode URL [--prefill-log SOURCE "
                           "--decode-log SOURCE --store DIR], or kvctl attach [NAME] --file FILE")
    return spec_from_options(name or "", prefill=prefill or "", decode=decode or "", prefill_log=prefill_log,
                             decode_log=decode_log, store=store, endpoint=endpoint, model_name=model_name)


def detach_cmd(
    name: str = typer.Argument(..., help="The attached cluster to forget."),
    json_: bool = json_option("Print JSON."),
) -> None:
    """Forget an attached cluster (its state and captured logs); its servers keep running."""
    render_detached(Output(json_mode=json_), detach_cluster(name))


def register(app: typer.Typer) -> None:
    app.command("attach")(attach_cmd)
    app.command("detach")(detach_cmd)
