"""`kvctl inspect-store`, `kvctl store check` and `kvctl store prune`: read, check and trim the FS KV store."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from connectors.store.eviction import evict, store_lock
from kvctl.errors import BadInput, ExitCode, RuntimeFailure
from kvctl.options import JSON_OPT
from kvctl.store.inspect import (
    TEMP_GRACE_S,
    store_keys_for,
    fix_store,
    inspect_store,
    resolve_store_dir,
)
from kvctl.views.output import Output
from kvctl.store.doctor import MIN_FREE_BYTES, doctor_store
from kvctl.views.store import render_check_verdict, render_doctor, render_fix, render_prune, render_store_report

store_app = typer.Typer(help="Check and maintain the FS KV store.", no_args_is_help=True)
doctor_app = typer.Typer(help="Check that a path gives kvctl what it needs.", no_args_is_help=True)

DIR_ARG = typer.Argument(None, metavar="[DIR]", help="Store directory (default: the store of --name).")
NAME_OPT = typer.Option(None, "--name", "-n", help="Cluster whose store to read (default: 'default').")
KEY_FILE_OPT = typer.Option(None, "--key-file", metavar="PATH",
                            help="Check entries' tags with the store keys in PATH (one per line). Default: "
                                 "with --name the cluster's store_key file, else $KVCTL_STORE_KEY_FILE or "
                                 "$KVCTL_STORE_KEY; without any, tags are shown (signed/unsigned), not checked.")


def register(app: typer.Typer) -> None:
    app.command("inspect-store")(inspect_store_cmd)
    store_app.command("check")(check_cmd)
    store_app.command("prune")(prune_cmd)
    app.add_typer(store_app, name="store")
    doctor_app.command("store")(doctor_store_cmd)
    app.add_typer(doctor_app, name="doctor")


def inspect_store_cmd(
    directory: Optional[str] = DIR_ARG,
    name: Optional[str] = NAME_OPT,
    verify: bool = typer.Option(False, "--verify", help="Read every entry: checksum, key, token ids and "
                                                        "(given the store key) its tag."),
    key_file: Optional[Path] = KEY_FILE_OPT,
    json_out: bool = JSON_OPT,
) -> None:
    """List the store's entries (key, tokens, shape, dtype, bytes, created, signature) and stray files.

    Given the store key, each entry is verified / bad signature / unsigned (with --verify).
    Exits 1 with --verify when any entry is invalid or could not be read.
    """
    out = Output(json_mode=json_out)
    root = resolve_store_dir(directory, name)
    report = inspect_store(root, verify=verify, keys=store_keys_for(key_file, directory, name))
    if json_out:
        out.emit_json(report.to_json())
    else:
        render_store_report(report, out)
    if verify and (report.invalid or report.unchecked):
        raise typer.Exit(int(ExitCode.CHECK_FAILED))


def check_cmd(
    directory: Optional[str] = DIR_ARG,
    name: Optional[str] = NAME_OPT,
    fix: bool = typer.Option(False, "--fix", help="Remove stale temp files and invalid entries "
                                                  "(never foreign files, never entries it cannot read)."),
    grace: float = typer.Option(TEMP_GRACE_S, "--grace", min=0,
                                help="Seconds a temp file may be a live write before --fix removes it."),
    key_file: Optional[Path] = KEY_FILE_OPT,
    json_out: bool = JSON_OPT,
) -> None:
    """Verify every entry and flag temp leftovers, unreadable entries and foreign files.

    Exits 1 when invalid or unreadable entries or temp files remain (after --fix, if given).
    """
    out = Output(json_mode=json_out)
    root = resolve_store_dir(directory, name)
    keys = store_keys_for(key_file, directory, name)
    report = inspect_store(root, verify=True, keys=keys)
    if not json_out:
        render_store_report(report, out)  # shown before --fix removes anything
    fixed = fix_store(report, temp_grace_s=grace) if fix else None
    after = inspect_store(root, verify=True, keys=keys) if fixed and fixed.removed else report
    if json_out:
        out.emit_json({**after.to_json(), "fix": fixed.to_json() if fixed else None,
                       "passed": after.problems == 0})
    else:
        if fixed:
            render_fix(fixed, out)
        render_check_verdict(after, fix, out)
    if after.problems:
        raise typer.Exit(int(ExitCode.CHECK_FAILED))


def prune_cmd(
    directory: Optional[str] = DIR_ARG,
    name: Optional[str] = NAME_OPT,
    max_bytes: Optional[int] = typer.Option(
        None, "--max-bytes", min=0, help="Evict least recently used entries until the store holds at most this "
                                         "many bytes (0 empties it)."),
    older_than: Optional[float] = typer.Option(
        None, "--older-than", min=0, metavar="SECONDS",
        help="Evict entries not used (published or loaded) for more than this many seconds."),
    json_out: bool = JSON_OPT,
) -> None:
    """Evict entries the way a bounded FSConnector does: expired first, then least recently used.

    Holds the store's lock, so it is safe while producers publish; a consumer
    that loses an entry recomputes it.
    """
    out = Output(json_mode=json_out)
    if max_bytes is None and older_than is None:
        raise BadInput("nothing to prune by", where="--max-bytes / --older-than",
                       fix="pass --max-bytes BYTES, --older-than SECONDS, or both")
    root = resolve_store_dir(directory, name)
    try:
        with store_lock(root):
            report = evict(root, max_bytes=max_bytes, ttl_seconds=older_than)
    except OSError as e:
        raise RuntimeFailure(f"cannot prune the store: {e.strerror or e}", where=str(root),
                             fix="run as a user who may write the store directory") from None
    if json_out:
        out.emit_json({"root": str(root), "max_bytes": max_bytes, "older_than_s": older_than,
                       "removed": report.removed, "num_removed": len(report.removed),
                       "freed_bytes": report.freed_bytes, "total_bytes": report.total_bytes})
    else:
        render_prune(report, out)



def doctor_store_cmd(
    path: Path = typer.Argument(..., metavar="PATH", help="The store directory (as P or D mounts it)."),
    min_free_gb: float = typer.Option(MIN_FREE_BYTES / 2**30, "--min-free-gb", min=0,
                                      help="Free space below this (GiB) fails the check."),
    json_out: bool = JSON_OPT,
) -> None:
    """Check a store path for what the FS store needs: O_EXCL, fsync, atomic rename (a reader of the
    replaced file reads it whole), free space, permissions and, on a network mount, lookup caching.

    Exits 1 when a check fails.
    """
    out = Output(json_mode=json_out)
    report = doctor_store(path, min_free=int(min_free_gb * 2**30))
    if json_out:
        out.emit_json(report.to_json())
    else:
        render_doctor(report, out)
    if not report.passed:
        raise typer.Exit(int(ExitCode.CHECK_FAILED))
