"""Processes on this host, read from /proc (Linux): is it alive, is it still ours, its group.

The local runtime's servers and the docker runtime's log followers each run
in their own session (start_new_session), so a process group id equals the
leader's pid. A record keeps the leader's start time (`process_start_ticks`)
next to its pid, so a recycled pid is never mistaken for ours.
"""

from __future__ import annotations

import os
from pathlib import Path


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgrp, start_ticks) of a process, or None if it does not exist."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[2]), int(fields[19])


def _is_live(state: str) -> bool:
    return state not in ("Z", "X")  # zombies are dead; PID 1 here may never reap them


def is_alive(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie."""
    stat = _proc_stat(pid)
    return stat is not None and _is_live(stat[0])


def process_start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks after boot), or None if it does not exist."""
    stat = _proc_stat(pid)
    return stat[2] if stat else None


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`."""
    if not Path("/proc/self/stat").exists():  # no procfs: ask the kernel about the group
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except ProcessLookupError:
            return []
        except PermissionError:
            return [pgid]
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        if stat and stat[1] == pgid and _is_live(stat[0]):
            members.append(int(entry.name))
    return members


def server_groups_in(cwd: Path) -> list[int]:
    """Process groups of live vLLM servers (and kvctl routers) whose working directory is `cwd`.

    A local cluster's servers run in its cluster dir, each leading its own
    group; when the cluster's state is lost this is how `down` still finds
    them. Only processes whose command line names vLLM (or the router) count: a shell that
    happens to sit in that dir is not ours.
    """
    found: set[int] = set()
    target = os.path.realpath(cwd)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if os.readlink(f"/proc/{pid}/cwd") != target:
                continue
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        stat = _proc_stat(pid)
        if (b"vllm" in cmdline or b"kvctl.router" in cmdline) and stat and _is_live(stat[0]):
            found.add(stat[1])
    return sorted(found)
