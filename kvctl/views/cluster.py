"""Cluster views: the launch progress display, the launched cluster, status, down."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kvctl.cluster.lifecycle import ClusterStatus, DamagedCluster, DownReport, LaunchProgress
from kvctl.cluster.spec import ClusterSpec, launch_warnings
from kvctl.cluster.state import ClusterState, InstanceRecord
from kvctl.views.output import Output


def _ident(rec: InstanceRecord) -> str:
    """What the runtime knows the server by: its pid, or its container's name (docker)."""
    f = rec.runtime_fields
    return str(f.get("pid") or f.get("container_name") or str(f.get("container_id", ""))[:12])


def _gpus(rec: InstanceRecord) -> str:
    """The instance's GPUs (docker), e.g. "0" or "0+1"; "" without any."""
    return "+".join(rec.runtime_fields.get("gpus") or [])


def render_launch_plan(out: Output, spec: ClusterSpec, why: str) -> None:
    """Before a launch: the runtime (and why it was chosen), the model and the store."""
    out.info(f"runtime: [bold]{spec.runtime}[/bold] ({why}); model {spec.model}; store {spec.store}")
    for warning in launch_warnings(spec):
        out.info(f"[yellow]warning:[/yellow] {warning}")


def render_launch_interrupted(out: Output, name: str, e: KeyboardInterrupt) -> None:
    """A launch stopped by Ctrl-C, SIGTERM or SIGHUP (it has cleaned up already)."""
    out.info(f"[yellow]interrupted[/yellow] ({e or 'SIGINT'}): stopped the servers of cluster "
             f"{name!r} and removed its state")


def render_log_lines(lines: Iterable[str], flush_each: bool) -> None:
    """`kvctl logs`: the lines on stdout as they come (flushed one by one when following)."""
    for line in lines:
        sys.stdout.write(line + "\n")
        if flush_each:
            sys.stdout.flush()


def render_launched(out: Output, state: ClusterState) -> None:
    """`kvctl launch`: the cluster state (JSON), or a table of its servers and what next."""
    if out.json_mode:
        out.emit_json(state.to_json())
        return
    table = Table(title=f"cluster {state.name!r} is up", title_justify="left")
    gpus = any(_gpus(rec) for rec in state.instances.values())
    for col in ("instance", "role", "url", "pid / container", *(("gpus",) if gpus else ()), "log"):
        table.add_column(col, overflow="fold")
    for name, rec in state.instances.items():
        table.add_row(name, rec.role, rec.url, _ident(rec), *((_gpus(rec),) if gpus else ()), rec.log_path)
    if state.router is not None:
        table.add_row("router", "", state.router["url"], str(state.router["pid"]), *(("",) if gpus else ()),
                      state.router["log_path"])
    for name, rec in state.lmcache.items():  # LMCache servers: their role names whom they serve
        table.add_row(name, f"lmcache for {', '.join(rec['serves'])}", rec["url"], str(rec["pid"]),
                      *(("",) if gpus else ()), rec["log_path"])
    out.stdout.print(table)
    if state.endpoint:
        out.stdout.print(f"endpoint: {state.endpoint}  (OpenAI API: {state.endpoint}/v1)", highlight=False)
    if state.api_key_required:
        out.stdout.print("API key: required on /v1/* of every server and the router (kvctl keeps it in "
                         "the cluster dir's api_key file, mode 0600)", highlight=False)
    if state.store_signed:
        out.stdout.print("store entries: signed, and only signed ones served (keys: the cluster dir's "
                         "store_key file, mode 0600)", highlight=False)
    out.info(f"store: {state.store}\nnext: `kvctl verify --name {state.name}`, "
             f"`kvctl down --name {state.name}`")


def render_status(out: Output, statuses: list[ClusterStatus], damaged: list[DamagedCluster],
                  one: bool) -> None:
    """`kvctl status`: one cluster's status object (`one`), or every cluster's and the damaged ones."""
    if out.json_mode:
        out.emit_json(statuses[0].to_json() if one else {"clusters": [s.to_json() for s in statuses],
                                                         "damaged": [d.to_json() for d in damaged]})
        return
    for d in damaged:
        out.info(f"[red]cluster {escape(d.name)!r} is damaged:[/red] {escape(d.error)} ({escape(d.path)}); "
                 f"`kvctl down --name {escape(d.name)}` stops what runs there and removes it")
    if not statuses:
        out.info("no clusters (start one with `kvctl launch 1p1d`)")
        return
    table = Table(title_justify="left")
    for col in ("cluster", "instance", "role", "state", "url", "pid / container", "log"):
        table.add_column(col, overflow="fold")
    for st in statuses:
        for name, h in st.instances.items():
            rec = st.state.instances[name]
            state = ("[green]healthy[/green]" if h.healthy else
                     "[yellow]running, not healthy[/yellow]" if h.running else
                     f"[red]down[/red] ({h.detail})")
            table.add_row(st.state.name, name, rec.role, state, rec.url, _ident(rec), rec.log_path)
        router = st.state.router
        if router is not None:  # the endpoint: healthy while a P and a D answer behind it
            state = "[green]healthy[/green]" if st.endpoint_healthy else "[red]not healthy[/red]"
            table.add_row(st.state.name, "router", "", state, router["url"], str(router.get("pid", "")),
                          router.get("log_path", ""))
        for name, h in st.lmcache.items():  # LMCache servers: healthy while /healthcheck answers
            rec = st.state.lmcache[name]
            state = ("[green]healthy[/green]" if h.healthy else
                     "[yellow]running, not healthy[/yellow]" if h.running else f"[red]down[/red] ({h.detail})")
            table.add_row(st.state.name, name, f"lmcache for {', '.join(rec['serves'])}", state, rec["url"],
                          str(rec.get("pid", "")), rec.get("log_path", ""))
    out.stdout.print(table)


def render_down(out: Output, report: DownReport) -> None:
    """`kvctl down`: what was stopped and removed."""
    if out.json_mode:
        out.emit_json(report.to_json())
        return
    name = report.name
    if not report.found:
        out.info(f"no cluster named {name!r}; nothing to tear down")
        return
    for s in report.stopped:
        what = f"stopped ({s.signal}, {s.seconds:.1f} s)" if s.was_running else "was not running"
        out.info(f"{s.name}: {what}")
    if report.damaged_state:
        out.info(f"its state was unreadable ({report.damaged_state}): stopped the vLLM servers found in "
                 f"its directory ({len(report.stopped)})")
    if report.kept_store:
        out.info(f"removed cluster {name!r} ({report.removed}); kept its store {report.kept_store}")
    else:
        out.info(f"removed cluster {name!r} ({report.removed})")


class LaunchDisplay:
    """Renders LaunchProgress: a live table on a terminal, state changes otherwise."""

    def __init__(self, out: Output):
        self.out = out
        self.live: Live | None = None
        self.seen: dict[str, str] = {}

    def __enter__(self) -> LaunchDisplay:
        if self.out.stderr.is_terminal:
            self.live = Live(Text("starting servers..."), console=self.out.stderr,
                             refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def __call__(self, p: LaunchProgress) -> None:
        if self.live is not None:
            self.live.update(self._table(p))
            return
        for role, rp in p.roles.items():
            if self.seen.get(role) != rp.state:
                self.seen[role] = rp.state
                self.out.info(f"{role}: {rp.state} ({p.elapsed_s:.1f} s)")

    @staticmethod
    def _table(p: LaunchProgress) -> Table:
        table = Table(title=f"launching cluster {p.cluster!r}  {p.elapsed_s:5.1f} s",
                      title_justify="left", expand=True)
        table.add_column("instance", no_wrap=True)
        table.add_column("state", no_wrap=True)
        table.add_column("ready", no_wrap=True)
        table.add_column("last log line", overflow="ellipsis", no_wrap=True, ratio=1)
        colours = {"starting": "yellow", "healthy": "green", "failed": "red"}
        for role, rp in p.roles.items():
            table.add_row(role, Text(rp.state, style=colours.get(rp.state, "")),
                          f"{rp.ready_s:.1f} s" if rp.ready_s is not None else "",
                          Text(rp.last_line))
        return table
