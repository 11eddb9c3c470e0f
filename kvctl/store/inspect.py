"""Reading and checking an FS KV store without vLLM or torch.

`inspect_store` sorts every name of a store directory by the format's one
rule (`connectors.store.format.file_kind`) into entries (with what each header
claims and, when verified, whether its data checks out), temp leftovers,
pending markers (saves under way) and foreign files. `fix_store` removes what
a `store check --fix` may remove: stale temp files, stale pending markers and
entries proven invalid, never foreign files and never an entry it could not
read (that is reported as unchecked). The format itself
is connectors.store.format's (spec: docs/store-format.md).
"""

from __future__ import annotations

import json
import logging
import os
import stat as stat_mod
import time
from dataclasses import dataclass, field
from pathlib import Path

from connectors.store import auth
from connectors.store.format import (
    ENTRY_SUFFIX,
    EntryCorrupt,
    FileKind,
    KVIdentity,
    StoreFile,
    file_kind,
    list_store,
    open_entry,
    parse_header,
    remove_store_file,
    verify_data,
)
from kvctl.errors import BadInput
from kvctl.paths import kvctl_home

log = logging.getLogger(__name__)

# A temp file younger than this may belong to a writer still at work (seconds).
# Writes take well under a second per entry; 15 minutes leaves room for slow
# network filesystems. Writer pids are not checked: the store may be shared
# by several hosts.
TEMP_GRACE_S = 900.0
# A pending marker older than this is a leftover (its writer died or its store hung): readers
# already ignore it past their own deadline (store_timeout_ms, 2 s by default). Seconds.
PENDING_GRACE_S = 60.0


@dataclass
class EntryReport:
    """One entry (by the format's rule): what its header says, and whether it is valid.

    `valid` is True when fully verified, False with `error` when anything is
    wrong, None when the data was not read: without --verify (`error` None),
    or because the entry could not be read at all (`error` says why: it is
    unchecked, never removed). A header that cannot be parsed leaves
    `identity` None and num_tokens 0.
    """

    path: Path
    bytes: int
    file: StoreFile  # the file that was judged (fix_store removes only that same, unchanged file)
    valid: bool | None
    error: str | None = None
    identity: KVIdentity | None = None
    num_tokens: int = 0
    hidden_tokens: int | None = None
    created: float | None = None
    # "unsigned", "signed" (a tag, not checked), "verified", "bad signature"; None: header unreadable
    signature: str | None = None
    key_id: str | None = None  # the key id in the entry's tag
    refused: bool = False  # invalid only for its tag: another writer's entry, never removed

    @property
    def key(self) -> str:
        return self.path.name[: -len(ENTRY_SUFFIX)]

    @property
    def unchecked(self) -> bool:
        return self.valid is None and self.error is not None

    def to_json(self) -> dict:
        ident = self.identity
        fields = ("model", "num_layers", "kv_parts", "kv_heads", "head_size", "dtype", "tp_rank", "tp_size")
        return {
            "key": self.key, "file": self.path.name, "num_tokens": self.num_tokens, "bytes": self.bytes,
            "valid": self.valid, "error": self.error,
            **{f: getattr(ident, f) if ident else None for f in fields},
            "hidden_tokens": self.hidden_tokens, "created": self.created,
            "signature": self.signature, "key_id": self.key_id,
        }


@dataclass
class StrayFile:
    """A name that is not an entry: a temp leftover or something foreign."""

    path: Path
    bytes: int
    age_s: float
    file: StoreFile
    is_dir: bool = False

    def to_json(self) -> dict:
        return {"file": self.path.name, "bytes": self.bytes, "age_s": round(self.age_s, 1),
                "is_dir": self.is_dir}


@dataclass
class StoreReport:
    root: Path
    verified: bool
    keyed: bool = False  # checked against store keys (tags verified with --verify)
    entries: list[EntryReport] = field(default_factory=list)
    temp_files: list[StrayFile] = field(default_factory=list)
    pending: list[StrayFile] = field(default_factory=list)  # pending markers: saves under way, or leftovers
    foreign_files: list[StrayFile] = field(default_factory=list)

    @property
    def stale_pending(self) -> list[StrayFile]:
        """Pending markers older than PENDING_GRACE_S: no save is under way behind them any more."""
        return [m for m in self.pending if m.age_s >= PENDING_GRACE_S]

    @property
    def total_bytes(self) -> int:
        """Bytes of all entry files (valid or not); temp and foreign files not counted."""
        return sum(e.bytes for e in self.entries)

    @property
    def invalid(self) -> list[EntryReport]:
        return [e for e in self.entries if e.valid is False]

    @property
    def unchecked(self) -> list[EntryReport]:
        """Entries that could not be read (permissions, I/O errors): neither valid nor invalid."""
        return [e for e in self.entries if e.unchecked]

    @property
    def problems(self) -> int:
        """Things `store check` fails on: invalid and unchecked entries, temp leftovers, stale pending markers."""
        return len(self.invalid) + len(self.unchecked) + len(self.temp_files) + len(self.stale_pending)

    def to_json(self) -> dict:
        return {
            "root": str(self.root), "verified": self.verified, "keyed": self.keyed,
            "entries": [e.to_json() for e in self.entries],
            "temp_files": [t.to_json() for t in self.temp_files],
            "pending_markers": [m.to_json() for m in self.pending],
            "num_stale_pending": len(self.stale_pending),
            "foreign_files": [f.to_json() for f in self.foreign_files],
            "total_bytes": self.total_bytes,
            "num_entries": len(self.entries),
            "num_valid": sum(1 for e in self.entries if e.valid is True),
            "num_invalid": len(self.invalid),
            "num_unchecked": len(self.unchecked),
            "temp_bytes": sum(t.bytes for t in self.temp_files),
            "foreign_bytes": sum(f.bytes for f in self.foreign_files),
        }


def resolve_store_dir(path: str | None, name: str | None) -> Path:
    """The store directory to inspect: `path`, or cluster `name`'s store. Raises BadInput."""
    if path is not None and name is not None:
        raise BadInput("give a store directory or a cluster name, not both", field="name",
                       fix="drop one of them")
    if path is None:
        return cluster_store_dir(name or "default")
    root = Path(path).expanduser()
    if not root.exists():
        raise BadInput(f"store directory {path} does not exist", where=str(root.absolute()),
                       fix="give an existing store directory, or the name of a running cluster")
    if not root.is_dir():
        raise BadInput(f"{path} is not a directory", where=str(root.absolute()),
                       fix="give the store directory (the fs_storage_path of the FSConnector)")
    return root


def cluster_store_dir(name: str) -> Path:
    """The `store` field of `$KVCTL_HOME/clusters/<name>/cluster.json`. Raises BadInput."""
    clusters = kvctl_home() / "clusters"
    state = clusters / name / "cluster.json"
    if "/" in name or name in ("", ".", "..") or not state.is_file():
        known = sorted(p.name for p in clusters.iterdir() if (p / "cluster.json").is_file()) \
            if clusters.is_dir() else []
        raise BadInput(f"no cluster named {name!r}", where=str(state),
                       fix=(f"use one of: {', '.join(known)}" if known else "launch one: kvctl launch 1p1d")
                       + ", or give the store directory itself")
    try:
        data = json.loads(state.read_text())
        if data.get("managed") is False and data.get("store") is None:
            raise BadInput(f"cluster {name!r} was attached without a store path: its store is not visible here",
                           where=str(state), fix="give the store directory itself (as mounted here), or attach "
                                                 "the cluster again with its store")
        store = data["store"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadInput(f"cluster {name!r} has no readable store path: {e}", where=str(state),
                       fix="give the store directory itself") from None
    root = Path(store)
    if not root.is_dir():
        raise BadInput(f"cluster {name!r}'s store {store} does not exist (removed by kvctl down?)",
                       where=str(state), fix="give an existing store directory")
    return root


def inspect_store(root: Path | str, verify: bool = False, now: float | None = None,
                  keys: auth.StoreKeys | None = None) -> StoreReport:
    """Classify and (with `verify`) fully check every name in a store.

    With `keys`, each entry's tag is checked too (from the header: unsigned,
    or a key not accepted; with `verify`, the tag itself): an entry that fails
    only that is invalid and `refused`, and never removed by `fix_store`.
    Without keys an entry is "signed" or "unsigned" by its header alone.

    Raises BadInput when `root` cannot be listed. Never raises for a bad
    file: that is an invalid entry (with its reason), an unchecked one (could
    not be read), or a foreign file. Memory stays bounded whatever sizes
    headers claim (the data is streamed).
    """
    root = Path(root)
    now = time.time() if now is None else now
    report = StoreReport(root=root, verified=verify, keyed=keys is not None)
    try:
        files = list_store(root)
    except OSError as e:
        raise BadInput(f"cannot list store directory: {e.strerror or e}", where=str(root)) from None
    for found in files:
        st = found.stat
        if found.kind is FileKind.LOCK:
            continue  # the bounded store's publish lock: part of the format
        if found.kind is FileKind.TEMP:
            report.temp_files.append(StrayFile(found.path, st.st_size, now - st.st_mtime, found))
        elif found.kind is FileKind.PENDING:
            report.pending.append(StrayFile(found.path, st.st_size, now - st.st_mtime, found))
        elif found.kind is FileKind.ENTRY:
            entry = _inspect_entry(found, verify, keys)
            if entry is not None:
                report.entries.append(entry)
        else:
            is_dir = stat_mod.S_ISDIR(st.st_mode)
            report.foreign_files.append(StrayFile(found.path, 0 if is_dir else st.st_size,
                                                  now - st.st_mtime, found, is_dir))
    report.entries.sort(key=lambda e: (e.created or 0.0, e.key))
    return report


def _inspect_entry(found: StoreFile, verify: bool, keys: auth.StoreKeys | None) -> EntryReport | None:
    path = found.path
    entry = EntryReport(path, found.stat.st_size, found, valid=None)
    try:
        with open_entry(path) as (f, st):
            entry.file, entry.bytes = StoreFile(path, found.kind, st), st.st_size
            header = parse_header(path, f)
            entry.identity, entry.num_tokens = header.identity, header.num_tokens
            entry.created, entry.hidden_tokens = header.created, header.hidden_tokens
            entry.signature, entry.key_id = _signature(header.metadata)
            if keys is not None:
                header.tag_check(keys)  # unsigned or an unknown key: known from the header
            if verify:
                verify_data(path, f, header, keys)
                entry.valid = True
                if keys is not None:
                    entry.signature = "verified"
    except FileNotFoundError:
        return None  # evicted or replaced while we looked
    except auth.EntryUnauthenticated as e:
        entry.valid, entry.error, entry.refused = False, e.reason, True
        entry.signature = auth.UNSIGNED if e.reason.startswith(auth.UNSIGNED) else auth.BAD_SIGNATURE
    except EntryCorrupt as e:
        entry.valid, entry.error = False, e.reason
        if e.stat is not None:
            entry.file = StoreFile(path, file_kind(path.name, e.stat), e.stat)
    except OSError as e:
        entry.error = f"unreadable: {e.strerror or e}"  # unchecked: valid stays None
    return entry


@dataclass
class FixResult:
    removed: list[tuple[Path, str]] = field(default_factory=list)
    kept: list[tuple[Path, str]] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"removed": [{"file": p.name, "reason": r} for p, r in self.removed],
                "kept": [{"file": p.name, "reason": r} for p, r in self.kept]}


def fix_store(report: StoreReport, temp_grace_s: float = TEMP_GRACE_S,
              pending_grace_s: float = PENDING_GRACE_S) -> FixResult:
    """Remove temp files older than `temp_grace_s`, pending markers older than
    `pending_grace_s` and invalid entries; nothing else.

    Foreign files are never removed, nor entries that could not be read
    (unchecked). Removing an entry that a producer replaced a moment ago only
    costs a recompute (a missing entry is a miss), so there is no lock; a file
    that changed since the check is kept. Never raises for one file.
    """
    result = FixResult()
    for temp in report.temp_files:
        if temp.age_s < temp_grace_s:
            result.kept.append((temp.path, f"temp file only {temp.age_s:.0f}s old; a writer may still own it"))
        else:
            _remove(temp.file, f"temp leftover, {temp.age_s:.0f}s old", result)
    for marker in report.pending:
        if marker.age_s < pending_grace_s:
            result.kept.append((marker.path, f"pending marker only {marker.age_s:.0f}s old: a save may be "
                                             f"under way"))
        else:
            _remove(marker.file, f"stale pending marker, {marker.age_s:.0f}s old", result)
    for entry in report.invalid:
        if entry.refused:
            result.kept.append((entry.path, f"{entry.error}: another writer's entry, never removed "
                                            f"for its tag"))
        else:
            _remove(entry.file, f"invalid entry: {entry.error}", result)
    for entry in report.unchecked:
        result.kept.append((entry.path, f"unchecked ({entry.error}): never removed; "
                                        "check as a user who can read it"))
    for stray in report.foreign_files:
        result.kept.append((stray.path, "foreign file: not kvctl's, never removed"))
    return result


def _remove(found: StoreFile, reason: str, result: FixResult) -> None:
    try:
        removed = remove_store_file(found, unchanged=True)
    except OSError as e:
        result.kept.append((found.path, f"could not remove: {e.strerror or e}"))
        return
    if removed:
        log.info("removed %s: %s", found.path, reason)
        result.removed.append((found.path, reason))
    elif os.path.lexists(found.path):
        result.kept.append((found.path, "changed since the check (a producer rewrote it)"))


def _signature(metadata: dict) -> tuple[str, str | None]:
    """("signed", key id) or ("unsigned", None) from a header alone; a malformed tag is a bad signature."""
    try:
        signed = auth.signature_of(metadata)
    except ValueError:
        return auth.BAD_SIGNATURE, None
    return ("signed", signed[0]) if signed else (auth.UNSIGNED, None)


def store_keys_for(key_file: Path | None, directory: str | None, name: str | None) -> auth.StoreKeys | None:
    """The keys inspect-store and store check verify tags with: `key_file`, else (a cluster's
    store, by --name or by default) its store_key file, else $KVCTL_STORE_KEY_FILE /
    $KVCTL_STORE_KEY, else None. Raises BadInput for a key file that cannot be used."""
    from kvctl.cluster.state import cluster_store_keys

    try:
        if key_file is not None:
            return auth.read_key_file(key_file)
        if directory is None:
            return cluster_store_keys(name or "default")
        return auth.keys_from()
    except auth.StoreKeyError as e:
        raise BadInput(str(e), field="key_file", fix="name a readable file of store keys, one per line") from None
