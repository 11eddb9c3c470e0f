"""Kubernetes views: what `kvctl render k8s` wrote, the client check, and the commands to run next."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape

from kvctl.k8s.check import ClientCheck
from kvctl.k8s.render import RenderedDeployment, kubectl_commands
from kvctl.views.output import Output


def render_k8s_result(out: Output, rendered: RenderedDeployment, directory: Path, files: list[Path],
                      check: ClientCheck) -> None:
    """The files written, the model check, notes, and the apply/attach/verify commands."""
    spec = rendered.spec
    steps = kubectl_commands(spec, directory)
    if out.json_mode:
        out.emit_json({"name": spec.name, "out": str(directory), "files": [str(f) for f in files],
                       "prefill": spec.prefill, "decode": spec.decode, "store_path": rendered.store_path,
                       "objects": [f"{d['kind']}/{d['metadata']['name']}" for d in rendered.documents()],
                       "check": check.to_json(), "notes": rendered.notes, "next": steps})
        return
    out.stdout.print(f"rendered {spec.prefill}P{spec.decode}D [bold]{escape(spec.name)}[/bold] into "
                     f"{escape(str(directory))}:")
    for f in files:
        out.stdout.print(f"  {escape(str(f.relative_to(directory)))}")
    if check.version is None:
        out.info("[yellow]not checked[/yellow]: the kubernetes client is not installed "
                 "(pip install 'kvctl[k8s]' checks every manifest against its models)")
    elif check.problems:
        out.info(f"[bold red]{len(check.problems)} problems[/bold red] under the kubernetes client "
                 f"{escape(check.version)}'s models:")
        for p in check.problems:
            out.info(f"  {escape(p)}")
    else:
        out.info(f"[green]checked[/green]: {check.checked} manifests load exactly into the kubernetes client "
                 f"{escape(check.version)}'s models")
    for n in rendered.notes:
        out.info(f"[yellow]note:[/yellow] {escape(n)}")
    out.info("next:\n" + "\n".join(f"  {escape(s)}" for s in steps))
