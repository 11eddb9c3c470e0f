"""Reading and checking an FS KV store without vLLM or torch.

`inspect_store` sorts every file of a store directory into entries (with what
each header claims and, when verified, whether its data checks out), temp
leftovers and foreign files. `fix_store` removes what a `store check --fix`
may remove: stale temp files and invalid entries, never foreign files. The
format itself is connectors.store.format's (spec: docs/store-format.md).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from connectors.store.format import (
    DTYPE_SIZES,
    ENTRY_SUFFIX,
    KEY_HEX_LEN,
    LOCK_NAME,
    EntryCorrupt,
    EntryHeader,
    KVIdentity,
    is_temp_name,
    parse_header,
    read_entry,
    token_ids_of,
)
from kvctl.errors import BadInput
from kvctl.paths import kvctl_home

log = logging.getLogger(__name__)

# A temp file younger than this may belong to a writer still at work (seconds).
# Writes take well under a second per entry; 15 minutes leaves room for slow
# network filesystems. Writer pids are not checked: the store may be shared
# by several hosts.
TEMP_GRACE_S = 900.0


@dataclass
class EntryReport:
    """One `<key>.safetensors` file: what its header says, and whether it is valid.

    `valid` is None when the header is fine but the data was not read
    (inspect without --verify); False with `error` when anything is wrong.
    A header that cannot be parsed leaves `identity` None and num_tokens 0.
    """

    path: Path
    bytes: int
    stamp: tuple[int, int, int]  # (inode, size, mtime_ns) when inspected: detects a republish
    valid: bool | None
    error: str | None = None
    identity: KVIdentity | None = None
    num_tokens: int = 0
    hidden_tokens: int | None = None
    created: float | None = None

    @property
    def key(self) -> str:
        return self.path.name[: -len(ENTRY_SUFFIX)]

    def to_json(self) -> dict:
        ident = self.identity
        fields = ("model", "num_layers", "kv_parts", "kv_heads", "head_size", "dtype", "tp_rank", "tp_size")
        return {
            "key": self.key, "file": self.path.name, "num_tokens": self.num_tokens, "bytes": self.bytes,
            "valid": self.valid, "error": self.error,
            **{f: getattr(ident, f) if ident else None for f in fields},
            "hidden_tokens": self.hidden_tokens, "created": self.created,
        }


@dataclass
class StrayFile:
    """A file that is not an entry: a temp leftover or something foreign."""

    path: Path
    bytes: int
    age_s: float
    is_dir: bool = False

    def to_json(self) -> dict:
        return {"file": self.path.name, "bytes": self.bytes, "age_s": round(self.age_s, 1),
                "is_dir": self.is_dir}


@dataclass
class StoreReport:
    root: Path
    verified: bool
    entries: list[EntryReport] = field(default_factory=list)
    temp_files: list[StrayFile] = field(default_factory=list)
    foreign_files: list[StrayFile] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """Bytes of all entry files (valid or not); temp and foreign files not counted."""
        return sum(e.bytes for e in self.entries)

    @property
    def invalid(self) -> list[EntryReport]:
        return [e for e in self.entries if e.valid is False]

    @property
    def problems(self) -> int:
        """Things `store check` fails on: invalid entries and temp leftovers."""
        return len(self.invalid) + len(self.temp_files)

    def to_json(self) -> dict:
        return {
            "root": str(self.root), "verified": self.verified,
            "entries": [e.to_json() for e in self.entries],
            "temp_files": [t.to_json() for t in self.temp_files],
            "foreign_files": [f.to_json() for f in self.foreign_files],
            "total_bytes": self.total_bytes,
            "num_entries": len(self.entries),
            "num_valid": sum(1 for e in self.entries if e.valid is True),
            "num_invalid": len(self.invalid),
            "temp_bytes": sum(t.bytes for t in self.temp_files),
            "foreign_bytes": sum(f.bytes for f in self.foreign_files),
        }


def resolve_store_dir(path: str | None, name: str | None) -> Path:
    """The store directory to inspect: `path`, or cluster `name`'s store. Raises BadInput."""
    if path is not None and name is not None:
        raise BadInput("give a store directory or --name, not both", fix="drop one of them")
    if path is None:
        return cluster_store_dir(name or "default")
    root = Path(path).expanduser()
    if not root.exists():
        raise BadInput(f"store directory {path} does not exist", where=str(root.absolute()),
                       fix="give an existing store directory, or --name of a running cluster")
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
        store = json.loads(state.read_text())["store"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadInput(f"cluster {name!r} has no readable store path: {e}", where=str(state),
                       fix="give the store directory itself") from None
    root = Path(store)
    if not root.is_dir():
        raise BadInput(f"cluster {name!r}'s store {store} does not exist (removed by kvctl down?)",
                       where=str(state), fix="give an existing store directory")
    return root


def inspect_store(root: Path | str, verify: bool = False, now: float | None = None) -> StoreReport:
    """Classify and (with `verify`) fully check every file in a store.

    Raises BadInput when `root` cannot be listed. Never raises for a bad file:
    that is reported as an invalid entry.
    """
    root = Path(root)
    now = time.time() if now is None else now
    report = StoreReport(root=root, verified=verify)
    try:
        items = sorted(root.iterdir())
    except OSError as e:
        raise BadInput(f"cannot list store directory: {e.strerror or e}", where=str(root)) from None
    for item in items:
        try:
            st = item.lstat()
        except FileNotFoundError:
            continue  # evicted or replaced while we looked
        name = item.name
        if name == LOCK_NAME:
            continue  # the bounded store's publish lock: part of the format
        if is_temp_name(name):
            report.temp_files.append(StrayFile(item, st.st_size, now - st.st_mtime))
        elif _is_entry_name(name) and item.is_file():
            entry = _inspect_entry(item, st, verify)
            if entry is not None:
                report.entries.append(entry)
        else:
            is_dir = item.is_dir()
            report.foreign_files.append(StrayFile(item, 0 if is_dir else st.st_size, now - st.st_mtime, is_dir))
    report.entries.sort(key=lambda e: (e.created or 0.0, e.key))
    return report


def _is_entry_name(name: str) -> bool:
    key = name[: -len(ENTRY_SUFFIX)]
    return (name.endswith(ENTRY_SUFFIX) and len(key) == KEY_HEX_LEN
            and all(c in "0123456789abcdef" for c in key))


def _inspect_entry(path: Path, st: os.stat_result, verify: bool) -> EntryReport | None:
    entry = EntryReport(path, st.st_size, _stamp(st), valid=None)
    try:
        header = parse_header(path)
        entry.identity = header.identity
        entry.num_tokens = header.num_tokens
        entry.created = header.created
        entry.hidden_tokens = header.tensors["hidden"]["shape"][0]
        entry.error = _check_shapes(header)
    except FileNotFoundError:
        return None  # evicted or replaced while we looked
    except EntryCorrupt as e:
        entry.error = e.reason
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        # A garbled header the format module did not anticipate: still corrupt.
        entry.error = f"malformed header: {type(e).__name__}: {e}"
    except OSError as e:
        entry.error = f"unreadable: {e.strerror or e}"
    if entry.error is not None:
        entry.valid = False
    elif verify:
        entry.valid, entry.error = _verify_data(path)
    return entry


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _check_shapes(header: EntryHeader) -> str | None:
    """Whether the tensors match the identity and token count the header claims."""
    ident, n = header.identity, header.num_tokens
    if n <= 0:
        return f"num_tokens is {n}"
    expected = {
        "token_ids": ("I64", [n]),
        "kv": (ident.dtype, [ident.num_layers, ident.kv_parts, n, ident.kv_heads, ident.head_size]),
    }
    for name, (dtype, shape) in expected.items():
        info = header.tensors[name]
        if info["dtype"] != dtype or info["shape"] != shape:
            return (f"tensor {name} is {info['dtype']} {info['shape']}, "
                    f"the header's identity says {dtype} {shape}")
    hidden = header.tensors["hidden"]["shape"]
    if len(hidden) != 2 or not 1 <= hidden[0] <= n:
        return f"tensor hidden has shape {hidden}, want [1..{n}, hidden_size]"
    for name in ("token_ids", "kv", "hidden"):
        info = header.tensors[name]
        begin, end = header.span(name)
        want = DTYPE_SIZES.get(info["dtype"], 0)
        for dim in info["shape"]:
            want *= int(dim)
        if end - begin != want:
            return f"tensor {name} spans {end - begin} bytes, its {info['dtype']} {info['shape']} needs {want}"
    return None


def _verify_data(path: Path) -> tuple[bool, str | None]:
    """Read the whole entry: checksum, key = name, token ids >= 0."""
    try:
        header, data = read_entry(path)
        tokens = token_ids_of(header, data)
    except FileNotFoundError:
        return False, "removed while being verified"
    except EntryCorrupt as e:
        return False, e.reason
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        return False, f"malformed header: {type(e).__name__}: {e}"
    except OSError as e:
        return False, f"unreadable: {e.strerror or e}"
    negative = [t for t in tokens if t < 0]
    if negative:
        return False, f"{len(negative)} negative token ids (first: {negative[0]})"
    return True, None


@dataclass
class FixResult:
    removed: list[tuple[Path, str]] = field(default_factory=list)
    kept: list[tuple[Path, str]] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"removed": [{"file": p.name, "reason": r} for p, r in self.removed],
                "kept": [{"file": p.name, "reason": r} for p, r in self.kept]}


def fix_store(report: StoreReport, temp_grace_s: float = TEMP_GRACE_S) -> FixResult:
    """Remove temp files older than `temp_grace_s` and invalid entries; never foreign files.

    Removing an entry that a producer replaced a moment ago only costs a
    recompute (a missing entry is a miss), so there is no lock; an entry whose
    file changed since the check is kept. Never raises for one file.
    """
    result = FixResult()
    for temp in report.temp_files:
        if temp.age_s < temp_grace_s:
            result.kept.append((temp.path, f"temp file only {temp.age_s:.0f}s old; a writer may still own it"))
        else:
            _remove(temp.path, f"temp leftover, {temp.age_s:.0f}s old", result)
    for entry in report.invalid:
        try:
            st = entry.path.stat()
        except FileNotFoundError:
            continue
        if _stamp(st) != entry.stamp:
            result.kept.append((entry.path, "changed since the check (a producer rewrote it)"))
            continue
        _remove(entry.path, f"invalid entry: {entry.error}", result)
    for stray in report.foreign_files:
        result.kept.append((stray.path, "foreign file: not kvctl's, never removed"))
    return result


def _remove(path: Path, reason: str, result: FixResult) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as e:
        result.kept.append((path, f"could not remove: {e.strerror or e}"))
        return
    log.info("removed %s: %s", path, reason)
    result.removed.append((path, reason))
