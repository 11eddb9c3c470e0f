"""Cluster views: the launch progress display."""

from __future__ import annotations

from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvctl.cluster.lifecycle import LaunchProgress
from kvctl.views.output import Output


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
        table.add_column("role", no_wrap=True)
        table.add_column("state", no_wrap=True)
        table.add_column("ready", no_wrap=True)
        table.add_column("last log line", overflow="ellipsis", no_wrap=True, ratio=1)
        colours = {"starting": "yellow", "healthy": "green", "failed": "red"}
        for role, rp in p.roles.items():
            table.add_row(role, Text(rp.state, style=colours.get(rp.state, "")),
                          f"{rp.ready_s:.1f} s" if rp.ready_s is not None else "",
                          Text(rp.last_line))
        return table
