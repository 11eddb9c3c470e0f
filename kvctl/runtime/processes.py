"""Processes on this host, through psutil: is it alive, is it still ours, its group.

The local runtime's servers and the docker runtime's log followers each run
in their own session (start_new_session), so a process group id equals the
leader's pid. A record keeps the leader's start time (`process_start_ticks`,
clock ticks after boot, as /proc/PID/stat counts them) next to its pid, so a
recycled pid is never mistaken for ours. Zombies count as gone: PID 1 here
may never reap them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import psutil

_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _live(proc: psutil.Process) -> bool:
    try:
        return proc.status() not in _GONE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # it exists; we may not look inside


def is_alive(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie."""
    try:
        return _live(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def process_start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks after boot), or None if it does not exist."""
    try:
        created = psutil.Process(pid).create_time()  # boot time + ticks / CLK_TCK
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    return round((created - psutil.boot_time()) * _CLOCK_TICKS)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _live_processes(attrs: list[str]) -> Iterator[psutil.Process]:
    for proc in psutil.process_iter(attrs):
        if proc.info.get("status") not in _GONE:
            yield proc


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`."""
    return sorted(p.pid for p in _live_processes(["status"]) if _pgid(p.pid) == pgid)


def processes_under(root: Path) -> list[tuple[int, str]]:
    """(pid, command line) of the live processes whose working directory or command line is
    inside `root` (a test's or a cluster's directory)."""
    root_s = os.path.realpath(root)
    found = []
    for p in _live_processes(["status", "cwd", "cmdline"]):
        cwd, cmd = p.info.get("cwd") or "", " ".join(p.info.get("cmdline") or [])
        if cwd == root_s or cwd.startswith(root_s + os.sep) or root_s in cmd:
            found.append((p.pid, cmd))
    return found


def server_groups_in(cwd: Path) -> list[int]:
    """Process groups of live vLLM servers (and kvctl routers) whose working directory is `cwd`.

    A local cluster's servers run in its cluster dir, each leading its own
    group; when the cluster's state is lost this is how `down` still finds
    them. Only processes whose command line names vLLM (or the router) count: a shell that
    happens to sit in that dir is not ours.
    """
    target = os.path.realpath(cwd)
    found: set[int] = set()
    for p in _live_processes(["status", "cwd", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if p.info.get("cwd") == target and ("vllm" in cmd or "kvctl.router" in cmd):
            pgid = _pgid(p.pid)
            if pgid is not None:
                found.add(pgid)
    return sorted(found)
